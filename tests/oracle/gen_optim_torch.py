#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records float64 training trajectories of torch.optim SGD, Adam and AdamW where their
semantics coincide with MLX's (and so with nn's), for tests/optim/torch_trajectory.test.cpp.

    /usr/bin/python3 tests/oracle/gen_optim_torch.py   # rewrites tests/fixtures/optim/torch.json

Where they coincide: SGD without dampening (plain, momentum, nesterov, weight decay: torch's
first momentum step copies the gradient, which equals MLX's 0*mu + g); Adam with MLX's
bias_correction=True is torch.optim.Adam; AdamW with bias_correction=True is torch.optim.AdamW
(decay p *= 1 - lr wd first, then Adam). MLX's default Adam/AdamW (no bias correction) has no
torch counterpart and is checked against MLX only.

The model is the one of gen_optim_mlx.py, in float64 (initial values and inputs drawn here in
float64 and saved, so C++ starts from the same bits):
    loss = mean((tanh(x W1^T + b1) W2^T + b2 - t)^2) + mean((tanh(x reshape(E, (6, 4))^T) - u)^2)
Each case records the loss at every step (before that step's update) and the parameters after
the updates in SNAPSHOTS, with Python's repr (exact doubles).
"""
import json
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "optim", "torch.json")

STEPS = 20
SNAPSHOTS = [1, 10, 20]
torch.set_default_dtype(torch.float64)
torch.set_num_threads(1)
rng = np.random.default_rng(0x7064)

INIT = {
    "l1.weight": rng.uniform(-0.5, 0.5, size=(8, 4)),
    "l1.bias": rng.uniform(-0.1, 0.1, size=(8,)),
    "l2.weight": rng.uniform(-0.5, 0.5, size=(3, 8)),
    "l2.bias": rng.uniform(-0.1, 0.1, size=(3,)),
    "e": rng.uniform(-0.5, 0.5, size=(3, 2, 4)),
}
INPUTS = {
    "x": rng.normal(0.0, 1.0, size=(6, 4)),
    "t": rng.uniform(-1.0, 1.0, size=(6, 3)),
    "u": rng.uniform(-0.8, 0.8, size=(6, 6)),
}
X, T, U = (torch.tensor(INPUTS[k]) for k in ("x", "t", "u"))


def loss_fn(p):
    h = torch.tanh(X @ p["l1.weight"].T + p["l1.bias"])
    y = h @ p["l2.weight"].T + p["l2.bias"]
    z = torch.tanh(X @ p["e"].reshape(6, 4).T)
    return torch.mean(torch.square(y - T)) + torch.mean(torch.square(z - U))


O = torch.optim
CASES = {
    "sgd/plain": lambda ps: O.SGD(ps, lr=0.1),
    "sgd/momentum": lambda ps: O.SGD(ps, lr=0.1, momentum=0.9),
    "sgd/nesterov": lambda ps: O.SGD(ps, lr=0.1, momentum=0.9, nesterov=True),
    "sgd/weight_decay": lambda ps: O.SGD(ps, lr=0.1, weight_decay=0.05),
    "sgd/nesterov_weight_decay": lambda ps: O.SGD(ps, lr=0.1, momentum=0.8, weight_decay=0.02, nesterov=True),
    "adam/bias_correction": lambda ps: O.Adam(ps, lr=0.01),
    "adam/betas_eps_bias_correction": lambda ps: O.Adam(ps, lr=0.01, betas=(0.8, 0.99), eps=1e-4),
    "adamw/bias_correction": lambda ps: O.AdamW(ps, lr=0.01),  # torch's default decay is MLX's 0.01
    "adamw/decay_bias_correction": lambda ps: O.AdamW(ps, lr=0.01, weight_decay=0.1),
}


def tensor(a):
    return {"shape": list(a.shape), "data": [float(v) for v in np.asarray(a).reshape(-1)]}


def run(make):
    params = {k: torch.tensor(v, requires_grad=True) for k, v in INIT.items()}
    opt = make(list(params.values()))
    out = {"loss": [], "params": {}}
    for i in range(STEPS):
        opt.zero_grad()
        loss = loss_fn(params)
        loss.backward()
        opt.step()
        out["loss"].append(loss.item())
        if i + 1 in SNAPSHOTS:
            out["params"][str(i + 1)] = {k: [float(v) for v in p.detach().numpy().reshape(-1)] for k, p in params.items()}
    return out


def main():
    fixture = {
        "generator": "tests/oracle/gen_optim_torch.py",
        "torch_version": torch.__version__,
        "steps": STEPS,
        "snapshots": SNAPSHOTS,
        "init": {k: tensor(v) for k, v in INIT.items()},
        "inputs": {k: tensor(v) for k, v in INPUTS.items()},
        "cases": {name: run(make) for name, make in CASES.items()},
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    text = json.dumps(fixture, separators=(",", ":"))
    with open(OUT, "w") as f:
        f.write(text + "\n")
    print(f"wrote {OUT} ({len(text)} bytes, {len(CASES)} cases, torch {torch.__version__})")


if __name__ == "__main__":
    main()
