#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records golden forward values and gradients of nn's primitives from PyTorch in float64.

    /usr/bin/python3 tests/oracle/gen_ops.py      # rewrites tests/fixtures/ops/*.json

One JSON file per ops header (elementwise, reduce, matmul, shape, index, softmax). Each case is
named "<op>/<variant>"; the C++ test of that header has one builder per case name that makes the
same call on a GTape, so the two sides read side by side.

For every case:
  * inputs are drawn from a fixed seed and rounded to float32, so the float32 run of the C++ test
    sees exactly the inputs PyTorch saw (its only error is its own arithmetic);
  * out = f(inputs) in float64, loss = sum(out * w) for a fixed random cotangent w (so every
    output element's gradient is exercised, not just their sum);
  * "grads" holds d loss / d input for every floating input (zeros where PyTorch says None);
  * "fd": false marks cases where a central difference is meaningless (relu/abs placed on their
    kink at exactly 0, stop_gradient): only the PyTorch convention is checked there;
  * "fd_step" (optional) overrides the C++ default probe step 2^-20 where the loss is so large
    that its rounding would swamp a small step (log_softmax of logits in the thousands).
Floats are written with Python's repr (shortest round-trip), so C++ reads back the exact doubles.
"""
import json
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "ops")

rng = np.random.default_rng(0x5EED)


def f32(a):
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def uniform(shape, lo=-1.0, hi=1.0):
    return f32(rng.uniform(lo, hi, size=shape))


def away_from_zero(shape, lo=0.25, hi=2.0):
    """|x| in [lo, hi), random sign."""
    mag = rng.uniform(lo, hi, size=shape)
    sign = np.where(rng.random(size=shape) < 0.5, -1.0, 1.0)
    return f32(mag * sign)


def distinct(shape, lo=-2.0, hi=2.0, gap=1e-2):
    """Values with no two closer than `gap` (so max/argmax has no ties and stays put under a
    finite-difference probe)."""
    n = int(np.prod(shape)) if shape else 1
    grid = np.arange(n) * gap * 1.5
    vals = lo + (hi - lo - grid[-1]) * rng.random() + grid if n > 1 else np.array([rng.uniform(lo, hi)])
    vals = vals + rng.uniform(0, gap * 0.25, size=n)
    rng.shuffle(vals)
    return f32(vals.reshape(shape))


def apart_from(a, lo=0.05, hi=1.0):
    """b with |a - b| >= lo everywhere (maximum/minimum without ties)."""
    return f32(a + away_from_zero(a.shape, lo, hi))


FLOAT, I64, I32, U8 = "float", "int64", "int32", "uint8"
TORCH_INT = {I64: torch.int64, I32: torch.int32, U8: torch.uint8}


class Case:
    def __init__(self, name, fn, inputs, fd=True, fd_step=None):
        self.name = name
        self.op = name.split("/")[0]
        self.fn = fn
        # inputs: list of (array, kind); arrays of kind FLOAT get gradients
        self.inputs = [(np.asarray(a), k) for a, k in inputs]
        self.fd = fd
        self.fd_step = fd_step


def fl(*arrays):
    return [(a, FLOAT) for a in arrays]


def tensor_json(a, kind=FLOAT):
    a = np.asarray(a)
    if kind == FLOAT:
        data = [float(x) for x in a.ravel()]
    else:
        data = [int(x) for x in a.ravel()]
    return {"shape": list(a.shape), "data": data}


def record(case):
    ts = []
    for a, kind in case.inputs:
        if kind == FLOAT:
            ts.append(torch.tensor(a, dtype=torch.float64, requires_grad=True))
        else:
            ts.append(torch.tensor(a, dtype=TORCH_INT[kind]))
    out = case.fn(*ts)
    assert out.dtype == torch.float64, case.name
    w = torch.tensor(uniform(tuple(out.shape), -1.0, 1.0))
    loss = (out * w).sum()
    diff = [t for t in ts if t.requires_grad]
    grads = torch.autograd.grad(loss, diff, allow_unused=True)
    grads = [torch.zeros_like(t) if g is None else g for t, g in zip(diff, grads)]
    it = iter(grads)
    ins = []
    for (a, kind), t in zip(case.inputs, ts):
        j = tensor_json(a, kind)
        j["dtype"] = kind
        if kind == FLOAT:
            j["grad"] = tensor_json(next(it).detach().numpy())
        ins.append(j)
    for g in grads:
        assert torch.isfinite(g).all(), case.name
    assert torch.isfinite(out).all(), case.name
    rec = {"name": case.name, "op": case.op, "fd": case.fd}
    if case.fd_step is not None:
        rec["fd_step"] = case.fd_step
    rec.update({"inputs": ins, "w": tensor_json(w.numpy()), "out": tensor_json(out.detach().numpy())})
    return rec


def write(fname, cases):
    names = [c.name for c in cases]
    assert len(names) == len(set(names)), "duplicate case names"
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, fname)
    head = {
        "generator": "tests/oracle/gen_ops.py",
        "torch": torch.__version__,
        "dtype": "float64",
        "loss": "sum(out * w)",
    }
    with open(path, "w") as f:
        f.write(json.dumps(head)[:-1] + ',\n"cases": [\n')
        f.write(",\n".join(json.dumps(record(c)) for c in cases))
        f.write("\n]}\n")
    print(f"{path}: {len(cases)} cases")


# ---------------------------------------------------------------------------------------------
# elementwise.hpp
def elementwise_cases():
    F = torch.nn.functional
    S = (3, 4)
    c = []
    c.append(Case("neg/matrix", torch.neg, fl(uniform(S))))
    c.append(Case("exp/matrix", torch.exp, fl(uniform(S, -2, 2))))
    c.append(Case("log/positive", torch.log, fl(uniform(S, 0.25, 3))))
    c.append(Case("sqrt/positive", torch.sqrt, fl(uniform(S, 0.25, 3))))
    c.append(Case("rsqrt/positive", torch.rsqrt, fl(uniform(S, 0.25, 3))))
    c.append(Case("tanh/matrix", torch.tanh, fl(uniform(S, -3, 3))))
    c.append(Case("sigmoid/matrix", torch.sigmoid, fl(uniform(S, -4, 4))))
    c.append(Case("relu/away_from_zero", torch.relu, fl(away_from_zero(S, 0.05, 2))))
    kink = f32([[-1.5, 0.0, 0.5, -0.0], [2.0, -0.25, 0.0, 1.0]])
    c.append(Case("relu/at_zero", torch.relu, fl(kink), fd=False))  # relu'(0) = 0
    c.append(Case("abs/away_from_zero", torch.abs, fl(away_from_zero(S, 0.05, 2))))
    c.append(Case("abs/at_zero", torch.abs, fl(kink), fd=False))  # abs'(0) = sign(0) = 0
    c.append(Case("pow/2.5", lambda x: torch.pow(x, 2.5), fl(uniform(S, 0.25, 2))))
    c.append(Case("pow/-1.5", lambda x: torch.pow(x, -1.5), fl(uniform(S, 0.25, 2))))
    c.append(Case("pow/square_negative_base", lambda x: torch.pow(x, 2.0), fl(uniform(S, -2, 2))))
    c.append(Case("pow/cube_negative_base", lambda x: torch.pow(x, 3.0), fl(uniform(S, -2, 2))))
    c.append(Case("pow/zero", lambda x: torch.pow(x, 0.0), fl(uniform(S, 0.25, 2))))
    c.append(Case("scale/-1.75", lambda x: -1.75 * x, fl(uniform(S))))
    c.append(Case("add_scalar/0.625", lambda x: x + 0.625, fl(uniform(S))))
    c.append(Case("silu/matrix", F.silu, fl(uniform(S, -4, 4))))
    c.append(Case("gelu/matrix", F.gelu, fl(uniform(S, -4, 4))))
    c.append(Case("gelu_approx/matrix", lambda x: F.gelu(x, approximate="tanh"), fl(uniform(S, -4, 4))))
    c.append(Case("gelu_fast/matrix", lambda x: x * torch.sigmoid(1.702 * x), fl(uniform(S, -4, 4))))
    c.append(Case("tanh/rank3", torch.tanh, fl(uniform((2, 3, 4), -2, 2))))

    # binary ops over the broadcast patterns that matter: equal shapes, a scalar on either side,
    # trailing dims (a bias), a size-1 middle dim, both sides broadcast, higher rank on the right.
    patterns = [
        ("same", (3, 4), (3, 4)),
        ("scalar_b", (3, 4), ()),
        ("scalar_a", (), (3, 4)),
        ("trailing", (2, 3, 4), (4,)),
        ("middle_one", (2, 3, 4), (3, 1)),
        ("both", (3, 1), (1, 4)),
        ("rank_up", (4,), (2, 3, 4)),
    ]
    ops = {
        "add": torch.add,
        "sub": torch.sub,
        "mul": torch.mul,
        "div": torch.div,
        "maximum": torch.maximum,
        "minimum": torch.minimum,
    }
    for op, fn in ops.items():
        for tag, sa, sb in patterns:
            a = uniform(sa, -2, 2)
            if op == "div":
                b = away_from_zero(sb, 0.5, 2)
            elif op in ("maximum", "minimum"):
                # no ties anywhere (PyTorch splits a tie's gradient, nn gives it to a; tested apart)
                a = distinct(sa, -2, 2, 0.05)
                bb = distinct(sb, -2, 2, 0.05)
                ab = np.broadcast_arrays(a, bb)
                while np.min(np.abs(ab[0] - ab[1])) < 1e-3:
                    bb = distinct(sb, -2, 2, 0.05)
                    ab = np.broadcast_arrays(a, bb)
                b = bb
            else:
                b = uniform(sb, -2, 2)
            c.append(Case(f"{op}/{tag}", fn, fl(a, b)))

    # where(mask, a, b): the mask broadcasts too, and b may be a scalar.
    def where(m, a, b):
        return torch.where(m != 0, a, b)

    m = (rng.random((3, 4)) < 0.5).astype(np.uint8)
    c.append(Case("where/same", where, [(m, U8)] + fl(uniform((3, 4)), uniform((3, 4)))))
    m = np.array([[1], [0], [1]], dtype=np.uint8)
    c.append(Case("where/mask_column_scalar_b", where, [(m, U8)] + fl(uniform((3, 4)), uniform(()))))
    m = np.array([1, 0, 0, 1], dtype=np.uint8)
    c.append(Case("where/rank_up", where, [(m, U8)] + fl(uniform((2, 3, 4)), uniform((3, 4)))))

    # stop_gradient: x * stop_gradient(x) has gradient stop_gradient(x) * w (one path only). Not
    # a derivative of the function (a central difference sees 2 x w), so no finite differences.
    c.append(Case("stop_gradient/x_times_sg_x", lambda x: x * x.detach(), fl(uniform(S)), fd=False))
    return c


# ---------------------------------------------------------------------------------------------
# reduce.hpp
def reduce_cases():
    S = (2, 3, 4)
    c = []
    for op, fn in (("sum", torch.sum), ("mean", torch.mean)):
        c.append(Case(f"{op}/all", lambda x, fn=fn: fn(x), fl(uniform(S))))
        c.append(Case(f"{op}/all_keepdims", lambda x, fn=fn: fn(x, dim=(0, 1, 2), keepdim=True), fl(uniform(S))))
        c.append(Case(f"{op}/axis1", lambda x, fn=fn: fn(x, dim=1), fl(uniform(S))))
        c.append(Case(f"{op}/axis-1_keepdims", lambda x, fn=fn: fn(x, dim=-1, keepdim=True), fl(uniform(S))))
        c.append(Case(f"{op}/axes01", lambda x, fn=fn: fn(x, dim=(0, 1)), fl(uniform(S))))
        c.append(Case(f"{op}/axes02_keepdims", lambda x, fn=fn: fn(x, dim=(0, 2), keepdim=True), fl(uniform(S))))
        c.append(Case(f"{op}/axis0_matrix", lambda x, fn=fn: fn(x, dim=0), fl(uniform((5, 3)))))
    for axis in (0, 1, 2, -1):
        c.append(Case(f"max/axis{axis}", lambda x, a=axis: torch.max(x, dim=a).values, fl(distinct(S))))
    c.append(Case("max/axis1_keepdims", lambda x: torch.max(x, dim=1, keepdim=True).values, fl(distinct(S))))
    c.append(Case("max/vector", lambda x: torch.max(x, dim=0).values, fl(distinct((7,)))))
    return c


# ---------------------------------------------------------------------------------------------
# matmul.hpp
def matmul_cases():
    T = lambda x: x.transpose(-1, -2)  # noqa: E731
    c = []
    c.append(Case("matmul/plain", torch.matmul, fl(uniform((3, 4)), uniform((4, 5)))))
    c.append(Case("matmul/trans_a", lambda a, b: T(a) @ b, fl(uniform((4, 3)), uniform((4, 5)))))
    c.append(Case("matmul/trans_b", lambda a, b: a @ T(b), fl(uniform((3, 4)), uniform((5, 4)))))
    c.append(Case("matmul/trans_both", lambda a, b: T(a) @ T(b), fl(uniform((4, 3)), uniform((5, 4)))))
    c.append(Case("matmul/vector_row", torch.matmul, fl(uniform((1, 4)), uniform((4, 3)))))
    c.append(Case("matmul/batched", torch.matmul, fl(uniform((2, 3, 4)), uniform((2, 4, 5)))))
    c.append(Case("matmul/batched_trans_both", lambda a, b: T(a) @ T(b), fl(uniform((2, 4, 3)), uniform((2, 5, 4)))))
    c.append(Case("matmul/batched4d", torch.matmul, fl(uniform((2, 2, 3, 4)), uniform((2, 2, 4, 5)))))
    # the Linear case: batched x (B, T, in) @ W^T with W (out, in) shared by the batch
    c.append(Case("matmul/shared_xWt", lambda x, w: x @ T(w), fl(uniform((2, 3, 4)), uniform((5, 4)))))
    c.append(Case("matmul/shared_xW", torch.matmul, fl(uniform((2, 3, 4)), uniform((4, 5)))))
    c.append(Case("matmul/shared_trans_a", lambda a, b: T(a) @ b, fl(uniform((2, 4, 3)), uniform((4, 5)))))
    c.append(Case("matmul/shared_left", torch.matmul, fl(uniform((3, 4)), uniform((2, 4, 5)))))
    c.append(Case("matmul/shared_left_trans_b", lambda a, b: a @ T(b), fl(uniform((3, 4)), uniform((2, 5, 4)))))
    return c


# ---------------------------------------------------------------------------------------------
# shape.hpp
def shape_cases():
    S = (2, 3, 4)
    c = []
    c.append(Case("reshape/to_matrix", lambda x: x.reshape(6, 4), fl(uniform(S))))
    c.append(Case("reshape/infer", lambda x: x.reshape(4, -1), fl(uniform(S))))
    c.append(Case("reshape/flat", lambda x: x.reshape(24), fl(uniform(S))))
    c.append(Case("reshape/to_scalar", lambda x: x.reshape(()), fl(uniform((1, 1)))))
    c.append(Case("permute/201", lambda x: x.permute(2, 0, 1), fl(uniform(S))))
    c.append(Case("permute/matrix", lambda x: x.permute(1, 0), fl(uniform((3, 5)))))
    c.append(Case("permute/0213", lambda x: x.permute(0, 2, 1, 3), fl(uniform((2, 3, 2, 4)))))
    c.append(Case("transpose/last_two", lambda x: x.transpose(-2, -1), fl(uniform(S))))
    c.append(Case("transpose/0_2", lambda x: x.transpose(0, 2), fl(uniform(S))))
    c.append(Case("slice/axis1", lambda x: x[:, 1:3, :], fl(uniform(S))))
    c.append(Case("slice/negative", lambda x: x[..., -3:-1], fl(uniform(S))))
    c.append(Case("slice/axis0_first", lambda x: x[0:1], fl(uniform(S))))
    c.append(Case("concat/axis0", lambda a, b, d: torch.cat([a, b, d], 0),
                  fl(uniform((2, 3)), uniform((1, 3)), uniform((3, 3)))))
    c.append(Case("concat/last", lambda a, b: torch.cat([a, b], -1), fl(uniform((2, 3, 1)), uniform((2, 3, 2)))))
    c.append(Case("concat/middle", lambda a, b, d: torch.cat([a, b, d], 1),
                  fl(uniform((2, 1, 4)), uniform((2, 2, 4)), uniform((2, 3, 4)))))
    c.append(Case("broadcast_to/column", lambda x: torch.broadcast_to(x, (2, 3, 4)), fl(uniform((3, 1)))))
    c.append(Case("broadcast_to/row", lambda x: torch.broadcast_to(x, (3, 4)), fl(uniform((4,)))))
    c.append(Case("broadcast_to/scalar", lambda x: torch.broadcast_to(x, (2, 2)), fl(uniform(()))))
    return c


# ---------------------------------------------------------------------------------------------
# index.hpp
def pick_ref(x, idx):
    """x[..., idx] per row; idx < 0 picks 0 and passes no gradient."""
    valid = idx >= 0
    g = x.gather(-1, idx.clamp(min=0).long().unsqueeze(-1)).squeeze(-1)
    return torch.where(valid, g, torch.zeros((), dtype=x.dtype))


def index_cases():
    c = []
    gather = lambda t, ids: t[ids.long()]  # noqa: E731
    c.append(Case("gather_rows/repeated_ids", gather, fl(uniform((5, 3))) + [(np.array([1, 3, 1, 1]), I64)]))
    c.append(Case("gather_rows/ids_matrix_i32", gather,
                  fl(uniform((6, 4))) + [(np.array([[0, 5, 2], [2, 2, 4]]), I32)]))
    c.append(Case("pick/ignored_row", pick_ref, fl(uniform((4, 5))) + [(np.array([2, -1, 0, 4]), I64)]))
    c.append(Case("pick/rank3_i32", pick_ref, fl(uniform((2, 3, 5))) + [(np.array([[4, 0, -100], [1, 1, 3]]), I32)]))
    return c


# ---------------------------------------------------------------------------------------------
# softmax.hpp
def softmax_cases():
    c = []
    # logits in the thousands: a naive exp overflows; spread so several entries matter
    big = f32(np.array([[1000.0, 1001.5, 999.25, 1000.75, 998.0, 1002.0],
                        [-2000.0, -1999.0, -2001.5, -1998.25, -2000.5, -2003.0],
                        [3000.0, -3000.0, 2999.0, 2998.5, 0.0, 3001.0]]) + uniform((3, 6), -0.25, 0.25))
    for op, fn in (("softmax", lambda x: torch.softmax(x, -1)), ("log_softmax", lambda x: torch.log_softmax(x, -1))):
        c.append(Case(f"{op}/matrix", fn, fl(uniform((3, 5), -3, 3))))
        c.append(Case(f"{op}/rank3", fn, fl(uniform((2, 3, 4), -3, 3))))
        # outputs near -6000: each loss evaluation rounds at ~1e-12, so probe with h = 2^-14
        c.append(Case(f"{op}/thousands", fn, fl(big), fd_step=2.0**-14))
        c.append(Case(f"{op}/one_class", fn, fl(uniform((3, 1), -3, 3))))
    return c


if __name__ == "__main__":
    torch.set_default_dtype(torch.float64)
    write("elementwise.json", elementwise_cases())
    write("reduce.json", reduce_cases())
    write("matmul.json", matmul_cases())
    write("shape.json", shape_cases())
    write("index.json", index_cases())
    write("softmax.json", softmax_cases())
