#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records golden forward values and gradients of nn's layers (include/nn/layers/) from PyTorch
in float64, each written from the layer's published definition, not from the C++.

    /usr/bin/python3 tests/oracle/gen_layers.py   # rewrites tests/fixtures/layers/layers.json

Each case is named "<layer>/<variant>" and holds:
  * "inputs": every tensor the C++ test registers (floats rounded to float32 first, so a float32
    run of the same case sees exactly the inputs PyTorch saw); integer tensors as integers;
  * "config": the scalars of the call (eps, scale, rope base, ...);
  * "out": f(inputs) in float64;
  * "grads": d loss / d input for every floating input, loss = sum(out * w) with the fixed
    random cotangent "w" (so every output element's gradient is exercised).
Floats are written with Python's repr (shortest round-trip): C++ reads back the exact doubles.
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "layers", "layers.json")

rng = np.random.default_rng(0x1A7E5)
torch.set_default_dtype(torch.float64)


def f32(a):
    return np.asarray(a, dtype=np.float64).astype(np.float32).astype(np.float64)


def uniform(shape, lo=-1.0, hi=1.0):
    return f32(rng.uniform(lo, hi, size=shape))


def enc(t):
    a = t.detach().numpy() if isinstance(t, torch.Tensor) else np.asarray(t)
    if a.dtype.kind in "iu":
        return {"shape": list(a.shape), "data": [int(v) for v in a.reshape(-1)]}
    return {"shape": list(a.shape), "data": [float(v) for v in a.reshape(-1)]}


CASES = {}


def case(name, inputs, fn, config=None, grad_of=None):
    """inputs: name -> numpy array (float or int). fn(**tensors) -> output tensor."""
    ts = {}
    for k, v in inputs.items():
        if np.asarray(v).dtype.kind in "iu":
            ts[k] = torch.tensor(np.asarray(v), dtype=torch.int64)
        else:
            ts[k] = torch.tensor(np.asarray(v, dtype=np.float64), requires_grad=True)
    out = fn(**ts)
    w = torch.tensor(uniform(tuple(out.shape)))
    (out * w).sum().backward()
    floats = [k for k, t in ts.items() if t.dtype == torch.float64 and (grad_of is None or k in grad_of)]
    CASES[name] = {
        "inputs": {k: enc(v) for k, v in inputs.items()},
        "config": config or {},
        "out": enc(out),
        "w": enc(w),
        "grads": {k: enc(ts[k].grad if ts[k].grad is not None else torch.zeros_like(ts[k])) for k in floats},
    }


# ---- linear (torch.nn.functional.linear: y = x W^T + b) ----------------------------------------
x = uniform((2, 3, 5))
W = uniform((4, 5))
b = uniform((4,))
case("linear/nobias", {"x": x, "w": W}, lambda x, w: x @ w.T)
case("linear/bias", {"x": x, "w": W, "b": b}, lambda x, w, b: x @ w.T + b)
case("linear/vector", {"x": uniform((5,)), "w": W, "b": b}, lambda x, w, b: w @ x + b)

# ---- LoRA (mlx-lm LoRALinear: y = x W0^T [+ b0] + scale * (x A) B, A (in, r), B (r, out)) ----
A = uniform((5, 2))
Bm = uniform((2, 4))
case("lora_linear/nobias", {"x": x, "w0": W, "a": A, "b": Bm},
     lambda x, w0, a, b: x @ w0.T + 0.75 * ((x @ a) @ b), {"scale": 0.75})
case("lora_linear/bias", {"x": x, "w0": W, "b0": b, "a": A, "b": Bm},
     lambda x, w0, b0, a, b: x @ w0.T + b0 + 0.75 * ((x @ a) @ b), {"scale": 0.75})

# ---- normalization ------------------------------------------------------------------------------
xn = uniform((2, 3, 6), -2, 2)
g = uniform((6,), 0.5, 1.5)
beta = uniform((6,))


def rms(x, w=None, eps=1e-5):
    y = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
    return y if w is None else y * w


case("rmsnorm/weight", {"x": xn, "w": g}, lambda x, w: rms(x, w, 1e-5), {"eps": 1e-5})
case("rmsnorm/noweight", {"x": xn}, lambda x: rms(x, None, 1e-6), {"eps": 1e-6})
case("layernorm/affine", {"x": xn, "w": g, "b": beta}, lambda x, w, b: F.layer_norm(x, (6,), w, b, 1e-5),
     {"eps": 1e-5})
case("layernorm/nobias", {"x": xn, "w": g}, lambda x, w: F.layer_norm(x, (6,), w, None, 1e-5), {"eps": 1e-5})
case("layernorm/plain", {"x": xn}, lambda x: F.layer_norm(x, (6,), None, None, 1e-3), {"eps": 1e-3})

# ---- activations ----------------------------------------------------------------------------------
xa = uniform((3, 7), -4, 4)
xa[np.abs(xa) < 0.05] = 0.5  # keep relu off its kink
case("act/relu", {"x": xa}, lambda x: F.relu(x))
case("act/silu", {"x": xa}, lambda x: F.silu(x))
case("act/gelu", {"x": xa}, lambda x: F.gelu(x))
case("act/gelu_approx", {"x": xa}, lambda x: F.gelu(x, approximate="tanh"))
# mlx.nn.gelu_fast_approx: x * sigmoid(1.702 x)
case("act/gelu_fast_approx", {"x": xa}, lambda x: x * torch.sigmoid(1.702 * x))
case("act/softmax", {"x": xa}, lambda x: F.softmax(x, -1))
case("act/log_softmax", {"x": xa}, lambda x: F.log_softmax(x, -1))
case("act/swiglu", {"gate": xa, "up": uniform((3, 7))}, lambda gate, up: F.silu(gate) * up)

# ---- RoPE, from the RoFormer definition --------------------------------------------------------
# angle(t, i) = (t + offset) * scale * base^(-2i/dims); rotate pairs (a, b) -> (a c - b s, a s + b c).


def rope_ref(x, dims, base, scale, offset, traditional):
    T = x.shape[-2]
    i = torch.arange(dims // 2, dtype=torch.float64)
    inv = base ** (-2.0 * i / dims)
    ang = (torch.arange(T, dtype=torch.float64) + offset)[:, None] * scale * inv[None, :]
    c, s = torch.cos(ang), torch.sin(ang)
    rot, rest = x[..., :dims], x[..., dims:]
    if traditional:
        a, b = rot[..., 0::2], rot[..., 1::2]
        out = torch.stack([a * c - b * s, a * s + b * c], dim=-1).reshape(rot.shape)
    else:
        a, b = rot[..., : dims // 2], rot[..., dims // 2:]
        out = torch.cat([a * c - b * s, a * s + b * c], dim=-1)
    return torch.cat([out, rest], dim=-1)


xr = uniform((2, 3, 5, 10))
for trad in (False, True):
    name = "traditional" if trad else "neox"
    case(f"rope/{name}_partial", {"x": xr},
         lambda x, trad=trad: rope_ref(x, 8, 500.0, 0.5, 3, trad),
         {"dims": 8, "base": 500.0, "scale": 0.5, "offset": 3, "traditional": trad})
    case(f"rope/{name}_full", {"x": xr},
         lambda x, trad=trad: rope_ref(x, 10, 10000.0, 1.0, 0, trad),
         {"dims": 10, "base": 10000.0, "scale": 1.0, "offset": 0, "traditional": trad})

# ---- attention, as HF LlamaAttention computes it (repeat_kv, rotate_half, 4-D additive mask) ---


def attention_ref(q, k, v, nh, nkv, hd, lengths, base, scale):
    Bn, T, _ = q.shape
    q = q.view(Bn, T, nh, hd).transpose(1, 2)
    k = k.view(Bn, T, nkv, hd).transpose(1, 2)
    v = v.view(Bn, T, nkv, hd).transpose(1, 2)
    inv = 1.0 / (base ** (torch.arange(0, hd, 2, dtype=torch.float64) / hd))
    freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()

    def rotate_half(t):
        return torch.cat([-t[..., hd // 2:], t[..., : hd // 2]], dim=-1)

    q = q * cos + rotate_half(q) * sin
    k = k * cos + rotate_half(k) * sin
    k = k.repeat_interleave(nh // nkv, dim=1)
    v = v.repeat_interleave(nh // nkv, dim=1)
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None] & (
        torch.arange(T)[None, :] < torch.tensor(lengths)[:, None])[:, None, None, :]
    mask = torch.zeros(Bn, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float64).min)
    p = torch.softmax(q @ k.transpose(-1, -2) * scale + mask, dim=-1)
    return (p @ v).transpose(1, 2).reshape(Bn, T, nh * hd)


Bn, T, nh, hd = 2, 5, 4, 6
lengths = [5, 3]
for nkv, label in ((4, "mha"), (2, "gqa"), (1, "mqa")):
    case(f"attention/{label}",
         {"q": uniform((Bn, T, nh * hd)), "k": uniform((Bn, T, nkv * hd)), "v": uniform((Bn, T, nkv * hd)),
          "lengths": np.array(lengths, dtype=np.int64)},
         lambda q, k, v, lengths, nkv=nkv: attention_ref(q, k, v, nh, nkv, hd, lengths.tolist(), 10000.0,
                                                         1 / math.sqrt(hd)),
         {"T": T, "n_heads": nh, "n_kv_heads": nkv, "head_dim": hd, "base": 10000.0,
          "scale": 1 / math.sqrt(hd)})

# ---- embedding (torch.nn.functional.embedding; repeated ids accumulate) ------------------------
case("embedding/repeats", {"ids": np.array([[1, 3, 1, 6, 0], [3, 3, 2, 1, 5]], dtype=np.int64),
                           "table": uniform((7, 4))},
     lambda ids, table: F.embedding(ids, table))

# ---- cross-entropy (torch.nn.functional.cross_entropy, classes last here) ----------------------
R, V = 6, 11
logits = uniform((R, V), -3, 3)
tgt = np.array([3, 0, 10, -100, 7, 3], dtype=np.int64)
for red in ("mean", "sum", "none"):
    case(f"cross_entropy/int_{red}", {"logits": logits, "targets": tgt},
         lambda logits, targets, red=red: F.cross_entropy(logits, targets, reduction=red, ignore_index=-100),
         {"reduction": red, "ignore_index": -100})
case("cross_entropy/int_ignore_pad", {"logits": logits, "targets": np.array([3, 0, 10, 2, 7, 2])},
     lambda logits, targets: F.cross_entropy(logits, targets, ignore_index=2),
     {"reduction": "mean", "ignore_index": 2})
big = f32(logits * 1000.0)
case("cross_entropy/large_logits", {"logits": big, "targets": np.array([3, 0, 10, 1, 7, 3])},
     lambda logits, targets: F.cross_entropy(logits, targets), {"reduction": "mean", "ignore_index": -100})
probs = f32(np.exp(uniform((R, V), -2, 2)))
probs = probs / probs.sum(-1, keepdims=True)
for red in ("mean", "sum", "none"):
    case(f"cross_entropy/prob_{red}", {"logits": logits, "targets": probs},
         lambda logits, targets, red=red: F.cross_entropy(logits, targets, reduction=red),
         {"reduction": red}, grad_of={"logits"})
keep = np.array([1, 1, 0, 1, 1, 0], dtype=np.float64)
case("cross_entropy/keep_mean", {"logits": logits, "targets": np.array([3, 0, 10, 1, 7, 3]), "keep": keep},
     lambda logits, targets, keep: (F.cross_entropy(logits, targets, reduction="none") * keep).sum() / keep.sum(),
     {"reduction": "mean"}, grad_of={"logits"})
# next-token rows: logits (B, T, V), the first T-1 rows scored against tokens shifted left
lrows = uniform((2, 4, V), -3, 3)
trows = np.array([[5, 1, 9], [2, -100, 4]], dtype=np.int64)
case("cross_entropy_rows/batched", {"logits": lrows, "targets": trows},
     lambda logits, targets: F.cross_entropy(logits[:, :3].reshape(-1, V), targets.reshape(-1)),
     {"n_rows": 3})

with open(OUT, "w") as f:
    json.dump(CASES, f, indent=None, separators=(",", ":"))
    f.write("\n")
print(f"wrote {len(CASES)} cases to {os.path.relpath(OUT)}")
