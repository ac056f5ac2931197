#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""DoRA's oracle: PEFT (use_dora=True, torch float64) and mlx-lm (DoRALinear, MLX float32) on the
tiny models, with the logits and the adapters' gradients each computes.

    python3 tests/oracle/gen_dora.py     # rewrites tests/fixtures/lm/dora/

Needs torch, transformers, peft, mlx[cpu] and mlx-lm in one Python (recorded with torch 2.15,
transformers 5.25, peft 0.21.2, mlx 0.32.4, mlx-lm 0.32.2), and gen_lm_models.py beside it (its
float64 patches of transformers: see its docstring; without them HF's float64 forward is float32
in places and bounds any comparison at ~1e-7).

Cases (the HF folders under tests/fixtures/lm/models/, the MLX-quantized one under
tests/fixtures/lm/mlx_quantized/):
  llama     DoRA rank 4, scale 2, on q_proj, v_proj, down_proj of both layers
  qwen2     DoRA rank 4, scale 0.5, on q_proj, k_proj, o_proj, up_proj of the last layer only
            (q/k biases: added after the rescale)
  llama_q4  (mlx-lm only) DoRA rank 4, scale 2 on q_proj, v_proj, down_proj over the 4-bit
            affine base, kept quantized as mlx-lm keeps it (PEFT's quantized bases need bitsandbytes
            on a GPU)
The adapters are not at their initial values (lora_b would be zero and m the weight's norms, so
the layer would be its base and half the gradients would vanish): lora_a ~ U(+-1/sqrt(in)),
lora_b ~ 0.2 N(0, 1), m = ||W + s (A B)^T||_row * (1 + 0.2 N(0, 1)).

The loss is the mean cross-entropy of the logits at every position against fixed random targets.
Writes, under tests/fixtures/lm/dora/:
  expected.safetensors  ids, targets (2, 7) int64; per case and tool ("peft_<case>", "mlx_<case>"):
                        .logits (2, 7, V) and .grad.<path>.{lora_a, lora_b, m} in nn's (mlx-lm's)
                        orientation; "<case>.<path>.{lora_a, lora_b, m}" the adapter values (f64)
  peft_llama/           PEFT's own save_pretrained of the llama case (adapter_model.safetensors,
                        adapter_config.json with use_dora: true)
  mlx_llama_q4/         mlx-lm's adapter folder of the llama_q4 case (adapters.safetensors with the
                        .m vectors, adapter_config.json with fine_tune_type: dora)
  expected.json         per case, how far PEFT's and mlx-lm's logits are apart (float32 vs float64)
                        and how far the adapters move the logits from the base model's
"""
import json
import math
import os
import pathlib
import shutil
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
FIX = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm"))
OUT = os.path.join(FIX, "dora")
CASES = {
    "llama": dict(folder=os.path.join(FIX, "models", "llama"), keys=["q_proj", "v_proj", "down_proj"], scale=2.0, last=2),
    "qwen2": dict(folder=os.path.join(FIX, "models", "qwen2"), keys=["q_proj", "k_proj", "o_proj", "up_proj"], scale=0.5, last=1),
    "llama_q4": dict(folder=os.path.join(FIX, "mlx_quantized", "llama_q4"), keys=["q_proj", "v_proj", "down_proj"], scale=2.0,
                     last=2, mlx_only=True),
}
R = 4
rng = np.random.default_rng(0xD0DA)


def full_key(k):
    return ("mlp." if k in ("gate_proj", "up_proj", "down_proj") else "self_attn.") + k


def adapter_values(weights, cfg, layers):
    """{path: (A (in, r), B (r, out), m (out))} from the base weights {path: W (out, in)} (f64)."""
    out = {}
    for i in range(layers - cfg["last"], layers):
        for k in cfg["keys"]:
            p = f"model.layers.{i}.{full_key(k)}"
            W = weights[p]
            o, n = W.shape
            A = rng.uniform(-1 / math.sqrt(n), 1 / math.sqrt(n), (n, R))
            B = 0.2 * rng.standard_normal((R, o))
            norm = np.linalg.norm(W + cfg["scale"] * (A @ B).T, axis=1)
            out[p] = (A, B, norm * (1 + 0.2 * rng.standard_normal(o)))
    return out


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def use_f64_rope(g, model, folder):
    """gen_lm_models.use_f64_rope, with the RoPE settings read from config.json (transformers 5
    keeps them in rope_parameters, not as attributes)."""
    import types
    import torch
    c = json.load(open(os.path.join(folder, "config.json")))
    inv = g.inv_freq64(types.SimpleNamespace(hidden_size=c["hidden_size"], num_attention_heads=c["num_attention_heads"],
                                            rope_theta=c.get("rope_theta", 10000.0), rope_scaling=c.get("rope_scaling")))
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding"):
            assert torch.allclose(mod.inv_freq.to(torch.float64), inv, rtol=1e-6, atol=0)
            assert getattr(mod, "attention_scaling", 1.0) == 1.0
            mod.inv_freq = inv.clone()


# ---- PEFT ---------------------------------------------------------------------------------------

def peft_case(name, cfg, ids, targets, save=None):
    import torch
    import gen_lm_models as g
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(cfg["folder"], dtype=torch.float64, attn_implementation="eager")
    use_f64_rope(g, model, cfg["folder"])
    layers = model.config.num_hidden_layers
    W = {n[:-7]: p.detach().numpy() for n, p in model.named_parameters() if n.endswith(".weight")}
    ids_t, tg_t = torch.tensor(ids), torch.tensor(targets)

    def logits_of(m):
        # gen_lm_models' patches, and Qwen2's own rotary class (transformers 5 has one) in float64
        from transformers.models.qwen2 import modeling_qwen2
        stock_rope = modeling_qwen2.Qwen2RotaryEmbedding.forward
        g.set_patches(True)
        modeling_qwen2.Qwen2RotaryEmbedding.forward = g.llama_rope_forward64
        try:
            return m.lm_head(m.model(input_ids=ids_t).last_hidden_state)
        finally:
            g.set_patches(False)
            modeling_qwen2.Qwen2RotaryEmbedding.forward = stock_rope

    with torch.no_grad():
        base = logits_of(model).numpy().copy()
    vals = adapter_values(W, cfg, layers)
    lc = LoraConfig(r=R, lora_alpha=cfg["scale"] * R, target_modules=cfg["keys"], use_dora=True, lora_dropout=0.0,
                    layers_to_transform=list(range(layers - cfg["last"], layers)))
    pm = get_peft_model(model, lc)
    pm.train()  # no DoRA weight-norm caching
    mods = dict(pm.base_model.model.named_modules())
    with torch.no_grad():
        for p, (A, B, m) in vals.items():
            mod = mods[p]
            mod.lora_A["default"].weight.copy_(torch.tensor(A.T))
            mod.lora_B["default"].weight.copy_(torch.tensor(B.T))
            mod.lora_magnitude_vector["default"].weight.copy_(torch.tensor(m))
    hf = pm.base_model.model
    logits = logits_of(hf)
    V = logits.shape[-1]
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, V), tg_t.reshape(-1))
    loss.backward()
    rec = {f"peft_{name}.logits": logits.detach().numpy()}
    for p in vals:
        mod = mods[p]
        rec[f"peft_{name}.grad.{p}.lora_a"] = mod.lora_A["default"].weight.grad.numpy().T
        rec[f"peft_{name}.grad.{p}.lora_b"] = mod.lora_B["default"].weight.grad.numpy().T
        rec[f"peft_{name}.grad.{p}.m"] = mod.lora_magnitude_vector["default"].weight.grad.numpy()
    # the patches change precision, not the model: PEFT's stock forward agrees to float32 accuracy
    with torch.no_grad():
        stock = hf(input_ids=ids_t).logits.to(torch.float64).numpy()
    assert rel(stock, rec[f"peft_{name}.logits"]) < 2e-5
    if save:
        shutil.rmtree(save, ignore_errors=True)
        pm.save_pretrained(save)
        cpath = os.path.join(save, "adapter_config.json")
        c = json.load(open(cpath))
        c["base_model_name_or_path"] = os.path.relpath(cfg["folder"], os.path.join(HERE, "..", ".."))
        json.dump(c, open(cpath, "w"), indent=2, sort_keys=True)
        if os.path.exists(os.path.join(save, "README.md")):
            os.remove(os.path.join(save, "README.md"))
    return rec, vals, base


# ---- mlx-lm -------------------------------------------------------------------------------------

def f32_folder(folder):
    """The folder itself, or (MLX reads no F64 safetensors) a float32 copy of it in a temporary
    directory: config.json and every *.safetensors shard with its tensors rounded to float32."""
    import glob
    import tempfile
    from safetensors.numpy import load_file, save_file
    shards = glob.glob(os.path.join(folder, "*.safetensors"))
    if all(v.dtype != np.float64 for s in shards for v in load_file(s).values()):
        return folder
    tmp = tempfile.mkdtemp()
    for f in os.listdir(folder):
        src = os.path.join(folder, f)
        if f.endswith(".safetensors"):
            save_file({k: v.astype(np.float32) for k, v in load_file(src).items()}, os.path.join(tmp, f))
        elif f.endswith(".json"):
            shutil.copy(src, tmp)
    return tmp


def mlx_case(name, cfg, ids, targets, vals=None, save=None):
    import mlx.core as mx
    import mlx.nn as nn
    from mlx.utils import tree_flatten
    from mlx_lm.tuner.utils import linear_to_lora_layers
    from mlx_lm.utils import load_model

    model, _ = load_model(pathlib.Path(f32_folder(cfg["folder"])))
    layers = len(model.model.layers)
    ids_m, tg_m = mx.array(ids), mx.array(targets)
    base = np.array(model(ids_m).astype(mx.float32))
    if vals is None:  # the quantized case: the dequantized weights give the norms
        W = {}
        for p, mod in tree_flatten(model.leaf_modules(), is_leaf=lambda m: isinstance(m, nn.Module)):
            if isinstance(mod, nn.QuantizedLinear):
                W[p] = np.array(mx.dequantize(mod.weight, mod.scales, mod.biases, group_size=mod.group_size, bits=mod.bits,
                                              mode=mod.mode)).astype(np.float64)
            elif isinstance(mod, nn.Linear):
                W[p] = np.array(mod.weight).astype(np.float64)
        vals = adapter_values(W, cfg, layers)
    model.freeze()
    lp = {"rank": R, "scale": cfg["scale"], "dropout": 0.0, "keys": [full_key(k) for k in cfg["keys"]]}
    linear_to_lora_layers(model, cfg["last"], lp, use_dora=True)
    weights = []
    for p, (A, B, m) in vals.items():
        weights += [(p + ".lora_a", mx.array(A.astype(np.float32))), (p + ".lora_b", mx.array(B.astype(np.float32))),
                    (p + ".m", mx.array(m.astype(np.float32)))]
    model.load_weights(weights, strict=False)
    logits = model(ids_m)

    def loss_fn(mod):
        return nn.losses.cross_entropy(mod(ids_m), tg_m).mean()

    _, grads = nn.value_and_grad(model, loss_fn)(model)
    grads = dict(tree_flatten(grads))
    rec = {f"mlx_{name}.logits": np.array(logits.astype(mx.float32))}
    for p in vals:
        for t in ("lora_a", "lora_b", "m"):
            rec[f"mlx_{name}.grad.{p}.{t}"] = np.array(grads[f"{p}.{t}"])
    if save:
        shutil.rmtree(save, ignore_errors=True)
        os.makedirs(save)
        mx.save_safetensors(os.path.join(save, "adapters.safetensors"), dict(weights), metadata={"format": "mlx"})
        with open(os.path.join(save, "adapter_config.json"), "w") as f:
            json.dump({"fine_tune_type": "dora", "num_layers": cfg["last"], "lora_parameters": lp}, f, indent=2)
    return rec, vals, base


def main():
    import mlx.core as mx
    from safetensors.numpy import save_file

    shutil.rmtree(OUT, ignore_errors=True)
    os.makedirs(OUT)
    rec, meta = {}, {}
    for name, cfg in CASES.items():
        V = json.load(open(os.path.join(cfg["folder"], "config.json")))["vocab_size"]
        ids = rng.integers(3, V, size=(2, 7))
        targets = rng.integers(0, V, size=(2, 7))
        rec[f"{name}.ids"], rec[f"{name}.targets"] = ids, targets
        m = {}
        if cfg.get("mlx_only"):
            r, vals, base = mlx_case(name, cfg, ids, targets, save=os.path.join(OUT, f"mlx_{name}"))
            rec.update(r)
        else:
            r, vals, base = peft_case(name, cfg, ids, targets, save=os.path.join(OUT, "peft_llama") if name == "llama" else None)
            rec.update(r)
            r2, _, _ = mlx_case(name, cfg, ids, targets, vals=vals)
            rec.update(r2)
            m["mlx_vs_peft_logits"] = rel(rec[f"mlx_{name}.logits"], rec[f"peft_{name}.logits"])
            m["mlx_vs_peft_grads"] = max(rel(rec[f"mlx_{name}.grad.{p}.{t}"], rec[f"peft_{name}.grad.{p}.{t}"])
                                         for p in vals for t in ("lora_a", "lora_b", "m"))
            assert m["mlx_vs_peft_logits"] < 1e-5 and m["mlx_vs_peft_grads"] < 1e-4, m
        tool = "mlx" if cfg.get("mlx_only") else "peft"
        m["adapters_move_logits"] = rel(base, rec[f"{tool}_{name}.logits"])
        assert m["adapters_move_logits"] > 0.01, m
        for p, (A, B, mm) in vals.items():
            rec[f"{name}.{p}.lora_a"], rec[f"{name}.{p}.lora_b"], rec[f"{name}.{p}.m"] = A, B, mm
        meta[name] = m
        print(name, m)
    save_file({k: np.ascontiguousarray(v) for k, v in rec.items()}, os.path.join(OUT, "expected.safetensors"))
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump({"mlx": mx.__version__, "cases": meta}, f, indent=2, sort_keys=True)


if __name__ == "__main__":
    main()
