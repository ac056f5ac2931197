#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The layer library's gate: a Qwen2-style decoder block with LoRA adapters, in PyTorch float64.

    /usr/bin/python3 tests/oracle/gen_qwen2_block.py   # rewrites tests/fixtures/layers/qwen2_block.json

Written from the published model (HF transformers Qwen2DecoderLayer: RMSNorm, q/k/v projections
with bias and o without, rotate_half RoPE, repeat_kv grouped-query attention, a 4-D additive
causal + padding mask, SwiGLU MLP, residuals), LoRA as mlx-lm applies it (y = x W^T [+ b] +
scale (x A) B with A (in, r), B (r, out)), then a final RMSNorm, an LM head and next-token
cross-entropy over a right-padded batch (padded targets ignored). The C++ side
(tests/layers/qwen2_block.test.cpp) rebuilds the same block from nn's layers and must match the
loss to 1e-14 and every adapter gradient and the input gradient to 1e-12 (relative).

Records: the config, the input hidden states x, every weight, the 14 adapter tensors, tokens,
lengths, the loss, d loss / d x and d loss / d (each adapter).
"""
import json
import math
import os

import numpy as np
import torch
import torch.nn.functional as F

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "layers", "qwen2_block.json")

torch.set_default_dtype(torch.float64)
rng = np.random.default_rng(0x0E2B10C)

CFG = dict(B=2, T=7, hidden=32, n_heads=4, n_kv_heads=2, head_dim=8, intermediate=48, vocab=50,
           rank=4, lora_scale=2.0, rms_eps=1e-6, rope_theta=1000000.0, lengths=[7, 5], ignore_index=-100)
B, T, C = CFG["B"], CFG["T"], CFG["hidden"]
NH, NKV, HD, I, V, R = (CFG[k] for k in ("n_heads", "n_kv_heads", "head_dim", "intermediate", "vocab", "rank"))


def U(shape, bound):
    return rng.uniform(-bound, bound, size=shape)


# Weights as HF stores them: Linear weight (out, in), bias (out); RMSNorm weight (C).
W = {
    "x": rng.normal(0.0, 1.0, size=(B, T, C)),
    "input_layernorm": 1.0 + 0.1 * rng.normal(size=C),
    "q_proj.weight": U((NH * HD, C), 1 / math.sqrt(C)), "q_proj.bias": U((NH * HD,), 1 / math.sqrt(C)),
    "k_proj.weight": U((NKV * HD, C), 1 / math.sqrt(C)), "k_proj.bias": U((NKV * HD,), 1 / math.sqrt(C)),
    "v_proj.weight": U((NKV * HD, C), 1 / math.sqrt(C)), "v_proj.bias": U((NKV * HD,), 1 / math.sqrt(C)),
    "o_proj.weight": U((C, NH * HD), 1 / math.sqrt(NH * HD)),
    "post_attention_layernorm": 1.0 + 0.1 * rng.normal(size=C),
    "gate_proj.weight": U((I, C), 1 / math.sqrt(C)),
    "up_proj.weight": U((I, C), 1 / math.sqrt(C)),
    "down_proj.weight": U((C, I), 1 / math.sqrt(I)),
    "norm": 1.0 + 0.1 * rng.normal(size=C),
    "lm_head.weight": U((V, C), 1 / math.sqrt(C)),
}
# Adapters: lora_a (in, r) ~ U(+-1/sqrt(in)) as mlx-lm; lora_b (r, out) non-zero here (mlx-lm
# starts it at zero, which would make every lora_a gradient vanish and test nothing).
ADAPTED = {"q_proj": (C, NH * HD), "k_proj": (C, NKV * HD), "v_proj": (C, NKV * HD), "o_proj": (NH * HD, C),
           "gate_proj": (C, I), "up_proj": (C, I), "down_proj": (I, C)}
for name, (fan_in, fan_out) in ADAPTED.items():
    W[f"{name}.lora_a"] = U((fan_in, R), 1 / math.sqrt(fan_in))
    W[f"{name}.lora_b"] = 0.2 * rng.normal(size=(R, fan_out))

lengths = CFG["lengths"]
tokens = rng.integers(0, V, size=(B, T))
for b in range(B):
    tokens[b, lengths[b]:] = 0  # pad id; never a target, never attended to

P = {k: torch.tensor(v, requires_grad=True) for k, v in W.items()}
adapter_names = [k for k in W if ".lora_" in k]


def rmsnorm(x, w):
    variance = x.pow(2).mean(-1, keepdim=True)
    return w * (x * torch.rsqrt(variance + CFG["rms_eps"]))


def proj(x, name, bias=False):
    y = F.linear(x, P[f"{name}.weight"], P[f"{name}.bias"] if bias else None)
    return y + CFG["lora_scale"] * ((x @ P[f"{name}.lora_a"]) @ P[f"{name}.lora_b"])


def rotate_half(t):
    h = t.shape[-1] // 2
    return torch.cat([-t[..., h:], t[..., :h]], dim=-1)


x = P["x"]
# -- self-attention ---------------------------------------------------------------------------
h = rmsnorm(x, P["input_layernorm"])
q = proj(h, "q_proj", True).view(B, T, NH, HD).transpose(1, 2)   # (B, NH, T, HD)
k = proj(h, "k_proj", True).view(B, T, NKV, HD).transpose(1, 2)  # (B, NKV, T, HD)
v = proj(h, "v_proj", True).view(B, T, NKV, HD).transpose(1, 2)
inv_freq = 1.0 / (CFG["rope_theta"] ** (torch.arange(0, HD, 2, dtype=torch.float64) / HD))
freqs = torch.outer(torch.arange(T, dtype=torch.float64), inv_freq)
emb = torch.cat([freqs, freqs], dim=-1)
cos, sin = emb.cos(), emb.sin()
q = q * cos + rotate_half(q) * sin
k = k * cos + rotate_half(k) * sin
k = k[:, :, None].expand(B, NKV, NH // NKV, T, HD).reshape(B, NH, T, HD)  # repeat_kv
v = v[:, :, None].expand(B, NKV, NH // NKV, T, HD).reshape(B, NH, T, HD)
causal = torch.tril(torch.ones(T, T, dtype=torch.bool))
key_real = torch.arange(T)[None, :] < torch.tensor(lengths)[:, None]  # (B, T)
allowed = causal[None, None] & key_real[:, None, None, :]
mask = torch.zeros(B, 1, T, T).masked_fill(~allowed, torch.finfo(torch.float64).min)
scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(HD) + mask
probs = torch.softmax(scores, dim=-1)
attn = torch.matmul(probs, v).transpose(1, 2).reshape(B, T, NH * HD)
x1 = x + proj(attn, "o_proj")
# -- MLP -----------------------------------------------------------------------------------------
h2 = rmsnorm(x1, P["post_attention_layernorm"])
mlp = proj(F.silu(proj(h2, "gate_proj")) * proj(h2, "up_proj"), "down_proj")
out = x1 + mlp
# -- head and next-token loss ------------------------------------------------------------------
logits = F.linear(rmsnorm(out, P["norm"]), P["lm_head.weight"])  # (B, T, V)
targets = torch.tensor(tokens[:, 1:].copy())
for b in range(B):
    targets[b, lengths[b] - 1:] = CFG["ignore_index"]  # no target past the sequence's end
loss = F.cross_entropy(logits[:, :-1].reshape(-1, V), targets.reshape(-1), ignore_index=CFG["ignore_index"])
loss.backward()


def enc(a):
    a = a.detach().numpy() if isinstance(a, torch.Tensor) else np.asarray(a)
    kind = a.dtype.kind
    return {"shape": list(a.shape), "data": [int(v) if kind in "iu" else float(v) for v in a.reshape(-1)]}


doc = {
    "config": CFG,
    "weights": {k: enc(v) for k, v in W.items()},
    "tokens": enc(tokens),
    "targets": enc(targets),
    "loss": float(loss),
    "grads": {k: enc(P[k].grad) for k in ["x"] + adapter_names},
}
with open(OUT, "w") as f:
    json.dump(doc, f, separators=(",", ":"))
    f.write("\n")
print(f"loss {float(loss)!r} (ln V = {math.log(V)!r}); {len(adapter_names)} adapters; wrote {os.path.relpath(OUT)}")
