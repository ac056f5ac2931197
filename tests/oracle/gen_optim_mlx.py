#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records float32 training trajectories of every MLX optimizer, schedule and clip_grad_norm on
a small model, as the golden reference of tests/optim/mlx_trajectory.test.cpp.

    python3 tests/oracle/gen_optim_mlx.py   # (pip mlx[cpu]) rewrites tests/fixtures/optim/mlx.json

The model (float32, parameters by path as nn's NN_MODULE names them):
    h = tanh(x @ l1.weight^T + l1.bias)          l1.weight (8, 4), l1.bias (8)
    y = h @ l2.weight^T + l2.bias                l2.weight (3, 8), l2.bias (3)
    z = tanh(x @ reshape(e, (6, 4))^T)            e (3, 2, 4): a rank-3 parameter (Muon's reshape)
    loss = mean((y - t)^2) + mean((z - u)^2)
with fixed inputs x (6, 4), t (6, 3), u (6, 6). Initial parameters and inputs are drawn by numpy
from a fixed seed in float32 and saved in the fixture, so the C++ test starts from the same bits.

Each case runs STEPS updates (loss and gradients by mx.value_and_grad, then the optimizer, on
mx.cpu) and records: "loss" at every step (before that step's update), the parameters after
the updates listed in SNAPSHOTS, the optimizer's slots after the last update, and for the
clip cases the gradient norm clip_grad_norm returned at every step. The C++ test has one
builder per case name making the same optimizer.

"updates" isolates the optimizers' arithmetic: UPDATE_STEPS updates with the fixed gradient
trees "update_grads" (no model, no forward pass), final parameters and slots. "schedules" holds
the schedules alone at steps 0..SCHEDULE_STEPS-1, as MLX computes them (in float32).

Floats are written as the shortest decimal that reads back (as a double, then rounded to
float32) to the exact float32 value; the generator checks that it does.
"""
import json
import math
import os

import mlx.core as mx
import mlx.optimizers as optim
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "optim", "mlx.json")

STEPS = 20
SNAPSHOTS = [1, 10, 20]
mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0x0971)


def arr(shape, lo, hi):
    return rng.uniform(lo, hi, size=shape).astype(np.float32)


INIT = {
    "l1.weight": arr((8, 4), -0.5, 0.5),
    "l1.bias": arr((8,), -0.1, 0.1),
    "l2.weight": arr((3, 8), -0.5, 0.5),
    "l2.bias": arr((3,), -0.1, 0.1),
    "e": arr((3, 2, 4), -0.5, 0.5),
}
INPUTS = {
    "x": rng.normal(0.0, 1.0, size=(6, 4)).astype(np.float32),
    "t": arr((6, 3), -1.0, 1.0),
    "u": arr((6, 6), -0.8, 0.8),
}
X, T, U = (mx.array(INPUTS[k]) for k in ("x", "t", "u"))


def loss_fn(p):
    h = mx.tanh(X @ p["l1"]["weight"].T + p["l1"]["bias"])
    y = h @ p["l2"]["weight"].T + p["l2"]["bias"]
    z = mx.tanh(X @ mx.reshape(p["e"], (6, 4)).T)
    return mx.mean(mx.square(y - T)) + mx.mean(mx.square(z - U))


value_and_grad = mx.value_and_grad(loss_fn)
is_matrix = lambda path, w: w.ndim >= 2  # noqa: E731  (MLX's Muon docs: Muon for matrices)

S = optim.schedulers
CASES = {
    "sgd/plain": lambda: optim.SGD(0.1),
    "sgd/momentum": lambda: optim.SGD(0.1, momentum=0.9),
    "sgd/momentum_dampening": lambda: optim.SGD(0.1, momentum=0.9, dampening=0.3),
    "sgd/nesterov": lambda: optim.SGD(0.1, momentum=0.9, nesterov=True),
    "sgd/weight_decay": lambda: optim.SGD(0.1, weight_decay=0.05),
    "sgd/nesterov_weight_decay": lambda: optim.SGD(0.1, momentum=0.8, weight_decay=0.02, nesterov=True),
    "adam/default": lambda: optim.Adam(0.01),
    "adam/betas_eps": lambda: optim.Adam(0.01, betas=[0.8, 0.99], eps=1e-4),
    "adam/bias_correction": lambda: optim.Adam(0.01, bias_correction=True),
    "adamw/default": lambda: optim.AdamW(0.01),
    "adamw/decay_bias_correction": lambda: optim.AdamW(0.01, weight_decay=0.1, bias_correction=True),
    "lion/default": lambda: optim.Lion(0.003),
    "lion/weight_decay": lambda: optim.Lion(0.003, betas=[0.8, 0.95], weight_decay=0.5),
    "muon/default": lambda: optim.Muon(0.02),
    "muon/no_nesterov": lambda: optim.Muon(0.02, nesterov=False),
    "muon/ns_steps_3": lambda: optim.Muon(0.02, ns_steps=3),
    "muon/no_weight_decay": lambda: optim.Muon(0.02, momentum=0.9, weight_decay=0.0),
    # Adafactor: factored second moments for the rank >= 2 parameters (l1.weight, l2.weight, e)
    "adafactor/default": lambda: optim.Adafactor(),
    "adafactor/lr": lambda: optim.Adafactor(learning_rate=0.003, relative_step=False),
    "adafactor/beta1_wd": lambda: optim.Adafactor(learning_rate=0.01, beta_1=0.9, weight_decay=0.01, relative_step=False),
    "adafactor/warmup_noscale": lambda: optim.Adafactor(warmup_init=True, scale_parameter=False),
    # clips at every step (the unclipped update's RMS is about 1)
    "adafactor/clip_decay_eps": lambda: optim.Adafactor(
        learning_rate=0.01, relative_step=False, clip_threshold=0.3, decay_rate=-0.5, eps=(1e-20, 1e-2)
    ),
    "adafactor/schedule": lambda: optim.Adafactor(learning_rate=S.cosine_decay(0.01, 15, 1e-3), relative_step=False),
    "schedule/exponential_decay": lambda: optim.SGD(S.exponential_decay(0.1, 0.9)),
    "schedule/step_decay": lambda: optim.SGD(S.step_decay(0.1, 0.5, 6), momentum=0.9),
    "schedule/cosine_decay": lambda: optim.Adam(S.cosine_decay(0.01, 15, 1e-3)),
    "schedule/linear_warmup": lambda: optim.Adam(S.linear_schedule(0.0, 0.01, 8)),
    # mlx-lm's warm-up (tuner/utils.py build_schedule): join([linear(init, lr, W), main], [W + 1])
    "schedule/warmup_cosine": lambda: optim.AdamW(
        S.join_schedules([S.linear_schedule(0.0, 0.01, 5), S.cosine_decay(0.01, 12, 1e-3)], [6])
    ),
    "multi/sgd_adam": lambda: optim.MultiOptimizer(
        [optim.Adam(0.01), optim.SGD(0.1)], [lambda path, w: "l1" in path]
    ),
    "multi/muon_adamw": lambda: optim.MultiOptimizer([optim.Muon(0.02), optim.AdamW(0.01)], [is_matrix]),
    "clip/active": lambda: optim.SGD(0.1, momentum=0.9),
    "clip/inactive": lambda: optim.SGD(0.1, momentum=0.9),
    "freeze/adam": lambda: optim.Adam(0.01, bias_correction=True),
    "set_learning_rate/sgd": lambda: optim.SGD(0.1, momentum=0.9),
}
CLIP = {"clip/active": 0.2, "clip/inactive": 100.0}
FROZEN = {"freeze/adam": ("l1.", range(5, 12))}  # 0-based updates during which l1 is frozen
SET_LR = {"set_learning_rate/sgd": (10, 0.03)}   # before 0-based update 10: learning_rate = 0.03

# The schedules alone, evaluated at steps 0..SCHEDULE_STEPS-1 (MLX computes them in float32).
SCHEDULE_STEPS = 30
SCHEDULES = {
    "exponential_decay": S.exponential_decay(0.1, 0.9),
    "step_decay": S.step_decay(0.1, 0.5, 6),
    "cosine_decay": S.cosine_decay(0.01, 15, 1e-3),
    "linear_schedule": S.linear_schedule(0.0, 0.01, 8),
    "warmup_cosine": S.join_schedules([S.linear_schedule(0.0, 0.01, 5), S.cosine_decay(0.01, 12, 1e-3)], [6]),
}


# Optimizer arithmetic alone: UPDATE_STEPS updates from INIT with fixed gradient trees (no model),
# so nothing but the optimizer's own float32 arithmetic can differ. Step 2's gradient puts some
# elements on a near-tie for Lion's default betas: c = b1 m + (1 - b1) g lands within rounding of 0
# (m = (1 - b2) g1 after step 1), so sign(c) depends on the exact arithmetic order.
UPDATE_STEPS = 3
UPDATE_CASES = [
    n for n in CASES if n.split("/")[0] in ("sgd", "adam", "adamw", "lion", "muon", "adafactor", "schedule", "multi")
]


def update_grads():
    gs = [{k: arr(v.shape, -0.5, 0.5) for k, v in INIT.items()} for _ in range(UPDATE_STEPS)]
    b1, b2 = np.float32(0.9), np.float32(0.99)
    for k in ("l2.bias", "e"):
        g1 = gs[0][k].reshape(-1)
        m1 = np.float32(1 - 0.99) * g1
        g2 = gs[1][k].reshape(-1)
        g2[:3] = -(b1 * m1[:3]) / np.float32(1 - 0.9)
    return gs


UPDATE_GRADS = update_grads()


def run_updates(make):
    params = tree_unflatten([(k, mx.array(v)) for k, v in INIT.items()])
    opt = make()
    for g in UPDATE_GRADS:
        grads = tree_unflatten([(k, mx.array(v)) for k, v in g.items()])
        new = dict(tree_flatten(opt.apply_gradients(grads, params)))
        params = tree_unflatten([(k, new.get(k, v)) for k, v in tree_flatten(params)])
        mx.eval(params, opt.state)
    states = opt.state["states"] if isinstance(opt, optim.MultiOptimizer) else [opt.state]
    slots = {}
    for st in states:
        slots.update(tree_flatten({k: v for k, v in st.items() if k not in ("step", "learning_rate")}))
    return {"params": {k: np.array(v) for k, v in tree_flatten(params)}, "slots": {k: np.array(v) for k, v in slots.items()}}


def f32str(v):
    v = np.float32(v)
    if not math.isfinite(v):
        raise ValueError(f"non-finite value {v}")
    s = str(v)
    if np.float32(float(s)) != v:
        s = repr(float(v))
    assert np.float32(float(s)) == v
    return s


def dump(o):
    """Compact JSON with float32 values in their shortest exact form."""
    if isinstance(o, dict):
        return "{" + ",".join(json.dumps(k) + ":" + dump(v) for k, v in o.items()) + "}"
    if isinstance(o, (list, tuple)):
        return "[" + ",".join(dump(v) for v in o) + "]"
    if isinstance(o, (np.ndarray, mx.array)):
        return "[" + ",".join(f32str(v) for v in np.asarray(o, dtype=np.float32).reshape(-1)) + "]"
    if isinstance(o, (float, np.floating)):
        return f32str(o)
    return json.dumps(o)


def tensor(a):
    a = np.asarray(a)
    return {"shape": list(a.shape), "data": a}


def run(name, make):
    params = tree_unflatten([(k, mx.array(v)) for k, v in INIT.items()])
    opt = make()
    frozen = FROZEN.get(name)
    out = {"loss": [], "params": {}}
    norms = []
    for i in range(STEPS):
        if name in SET_LR and i == SET_LR[name][0]:
            opt.learning_rate = SET_LR[name][1]
        loss, grads = value_and_grad(params)
        if name in CLIP:
            grads, norm = optim.clip_grad_norm(grads, CLIP[name])
            norms.append(norm.item())
        if frozen and i in frozen[1]:
            # a frozen parameter has no gradient (as nn.value_and_grad on a frozen module)
            grads = tree_unflatten([(k, g) for k, g in tree_flatten(grads) if not k.startswith(frozen[0])])
        new = dict(tree_flatten(opt.apply_gradients(grads, params)))
        params = tree_unflatten([(k, new.get(k, v)) for k, v in tree_flatten(params)])
        mx.eval(params, opt.state)
        out["loss"].append(loss.item())
        if i + 1 in SNAPSHOTS:
            out["params"][str(i + 1)] = {k: np.array(v) for k, v in tree_flatten(params)}
    if norms:
        out["norm"] = norms
    # Slots by parameter path, as nn's state() names them ("slots.<path>.<slot>").
    states = opt.state["states"] if isinstance(opt, optim.MultiOptimizer) else [opt.state]
    slots = {}
    for st in states:
        for path, v in tree_flatten({kk: vv for kk, vv in st.items() if kk not in ("step", "learning_rate")}):
            slots[path] = np.array(v)
    out["slots"] = slots
    out["step"] = [int(s["step"].item()) for s in states]
    return out


def main():
    fixture = {
        "generator": "tests/oracle/gen_optim_mlx.py",
        "mlx_version": mx.__version__,
        "device": str(mx.default_device()),
        "steps": STEPS,
        "snapshots": SNAPSHOTS,
        "init": {k: tensor(v) for k, v in INIT.items()},
        "inputs": {k: tensor(v) for k, v in INPUTS.items()},
        "clip": CLIP,
        "frozen": {k: {"prefix": p, "from": r.start, "to": r.stop} for k, (p, r) in FROZEN.items()},
        "set_learning_rate": {k: {"before": i, "lr": lr} for k, (i, lr) in SET_LR.items()},
        "schedules": {
            k: [np.array(s(mx.array(i, mx.uint64))).item() for i in range(SCHEDULE_STEPS)] for k, s in SCHEDULES.items()
        },
        "cases": {name: run(name, make) for name, make in CASES.items()},
        "update_grads": [{k: tensor(v) for k, v in g.items()} for g in UPDATE_GRADS],
        "updates": {name: run_updates(CASES[name]) for name in UPDATE_CASES},
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    text = dump(fixture)
    json.loads(text)  # valid JSON
    with open(OUT, "w") as f:
        f.write(text + "\n")
    print(f"wrote {OUT} ({len(text)} bytes, {len(CASES)} cases, mlx {mx.__version__})")


if __name__ == "__main__":
    main()
