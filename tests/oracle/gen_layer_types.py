#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The oracle of the models whose layers differ by kind (transformers' layer_types): Gemma 3's
text model (Gemma3ForCausalLM, model_type "gemma3_text") and Qwen2 with use_sliding_window, tiny
and random, made by `transformers`, their logits in float64.

    python3 tests/oracle/gen_layer_types.py   # rewrites tests/fixtures/lm/models/{gemma3,qwen2_window}/
                                              # and {gemma3,qwen2_window}_expected.safetensors

Needs PyPI's torch (2.x) and transformers >= 4.53 (Gemma 3 since 4.50, layer_types since 4.53;
recorded with torch 2.15.0 and transformers 4.57.6):
    python3 -m pip install torch "transformers>=4.56,<5" safetensors
Debian's torch 1.13 is too old for these transformers (torch.distributed.tensor).

Why transformers is patched (as gen_lm_models.py explains for the other families): its float64
forward is not float64 throughout. The RMSNorms compute in float32, the eager softmax runs in
float32, and RoPE's inverse frequencies and angles are float32. The reference runs the same
modules with those three steps in float64; the script checks that the patched and stock forwards
agree to float32 accuracy and that its float64 inverse frequencies match transformers' float32
ones. The logits are model.lm_head on model.model's final hidden states (no final soft cap).

gemma3: embeddings times sqrt(hidden); (1 + w) RMSNorms, w drawn around 0, four a layer and one on
each head's queries and keys (q_norm, k_norm); the GeGLU MLP (gelu_pytorch_tanh); head_dim 16
over 4 heads while hidden is 32, GQA 4/2; query_pre_attn_scalar 24; layer_types [sliding,
sliding, full, sliding] with a window of 4 over the fixture's 7 positions, so the window masks
keys; the global layer's RoPE at rope_theta 10000 with linear scaling 4, the sliding layers' at
rope_local_base_freq 100, unscaled; tied embeddings.

qwen2_window: Qwen2 (q/k/v biases, GQA 4/2, tied) with use_sliding_window, sliding_window 4 and
max_window_layers 1 over 3 layers: layers 1 and 2 slide (Qwen2Config's layer_types rule), layer 0
does not.

Weights are stored F32 (rounded, then used in float64). Writes, under tests/fixtures/lm/models/:
  <name>/                       config.json + model.safetensors (save_pretrained)
  <name>_expected.safetensors   float64 "<name>.logits" (B, T, V) on the ids and keep of
                                expected.safetensors (right padded); "<name>.nowindow.logits" with
                                sliding_window 64 (no key hidden; each layer's RoPE kept)
"""
import math
import os
import shutil

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
MODELS = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "models"))


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


def gemma_rms_forward64(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def rms_forward64(self, x):
    return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


def rope_forward64(self, x, position_ids):
    freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq64[None, None, :]
    emb = torch.cat((freqs, freqs), dim=-1)
    return (emb.cos() * self.attention_scaling).to(x.dtype), (emb.sin() * self.attention_scaling).to(x.dtype)


def set_inv_freq64(rot, theta, hd, linear_factor=1.0):
    """The rotary module's inverse frequencies in float64, checked against transformers' own."""
    rot.inv_freq64 = torch.tensor(1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)) / linear_factor)
    assert torch.allclose(rot.inv_freq.to(torch.float64), rot.inv_freq64, rtol=1e-6, atol=0), (rot.inv_freq, rot.inv_freq64)
    assert rot.attention_scaling == 1.0


def randomise_f32(model, rng, norm_center):
    """Linear U(+-1/sqrt(in)), biases U(+-0.2), norms norm_center + 0.1 N(0, 1), embeddings N(0, 1),
    rounded to float32 (the folders store F32) and used in float64."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                a = norm_center + 0.1 * rng.standard_normal(p.shape)
            elif "embed_tokens" in name:
                a = rng.standard_normal(p.shape)
            elif name.endswith(".bias"):
                a = rng.uniform(-0.2, 0.2, p.shape)
            else:
                b = 1 / math.sqrt(p.shape[1])
                a = rng.uniform(-b, b, p.shape)
            p.copy_(torch.tensor(a.astype(np.float32).astype(np.float64)))
    model.tie_weights()
    model.eval()


def save_f32_folder(model, folder):
    shutil.rmtree(folder, ignore_errors=True)
    model.to(torch.float32).save_pretrained(folder, safe_serialization=True)
    for f in os.listdir(folder):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(folder, f))
    model.to(torch.float64)


def record(name, model, module, rms_cls, rms64, ids, keep, window):
    """Writes <name>_expected.safetensors: the patched float64 logits, and with sliding_window 64."""
    from safetensors.numpy import save_file
    stock_softmax = torch.nn.functional.softmax

    def softmax64(input, dim=None, _stacklevel=3, dtype=None):
        return stock_softmax(input, dim=dim, _stacklevel=_stacklevel,
                             dtype=torch.float64 if input.dtype == torch.float64 else dtype)

    rope_cls = next(getattr(module, n) for n in dir(module) if n.endswith("RotaryEmbedding"))

    def logits64():
        stock = (rms_cls.forward, rope_cls.forward)
        rms_cls.forward, rope_cls.forward = rms64, rope_forward64
        torch.nn.functional.softmax = softmax64
        try:
            with torch.no_grad():
                h = model.model(input_ids=ids, attention_mask=keep, use_cache=False).last_hidden_state
                return model.lm_head(h).numpy()
        finally:
            rms_cls.forward, rope_cls.forward = stock
            torch.nn.functional.softmax = stock_softmax

    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=keep, use_cache=False).logits.to(torch.float64).numpy()
    logits = logits64()
    err = rel(plain, logits)
    assert err < 2e-5, err  # the patches change precision, not the model
    out = {f"{name}.logits": np.ascontiguousarray(logits)}
    # control: the window moves the logits (a window of 64 hides no key of 7)
    model.config.sliding_window = 64
    out[f"{name}.nowindow.logits"] = np.ascontiguousarray(logits64())
    model.config.sliding_window = window
    d = rel(out[f"{name}.nowindow.logits"], logits)
    assert d > 1e-3, d
    save_file(out, os.path.join(MODELS, f"{name}_expected.safetensors"))
    print(f"{name}: patched vs stock {err:.1e}; without the window the logits move by {d:.2e}")


def gemma3(ids, keep):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig
    from transformers.models.gemma3 import modeling_gemma3 as mg

    hd = 16
    cfg = Gemma3TextConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=hd,
                           hidden_activation="gelu_pytorch_tanh", max_position_embeddings=64, rms_norm_eps=1e-6,
                           rope_theta=10000.0, rope_scaling={"rope_type": "linear", "factor": 4.0},
                           rope_local_base_freq=100.0, attention_bias=False, query_pre_attn_scalar=24,
                           sliding_window=4, layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                                          "sliding_attention"],
                           tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg._attn_implementation = "eager"
    model = Gemma3ForCausalLM(cfg).to(torch.float64)
    randomise_f32(model, np.random.default_rng(0x6E3), norm_center=0.0)  # Gemma's norms scale by 1 + w
    save_f32_folder(model, os.path.join(MODELS, "gemma3"))
    # the float32 round trip rounded the embed_scale buffer too: sqrt(hidden) in float64 again
    model.model.embed_tokens.embed_scale = torch.tensor(math.sqrt(32.0), dtype=torch.float64)
    set_inv_freq64(model.model.rotary_emb, 10000.0, hd, 4.0)
    set_inv_freq64(model.model.rotary_emb_local, 100.0, hd)
    record("gemma3", model, mg, mg.Gemma3RMSNorm, gemma_rms_forward64, ids, keep, 4)


def qwen2_window(ids, keep):
    from transformers import Qwen2Config, Qwen2ForCausalLM
    from transformers.models.qwen2 import modeling_qwen2 as mq

    cfg = Qwen2Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                      num_key_value_heads=2, max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=1000000.0,
                      use_sliding_window=True, sliding_window=4, max_window_layers=1, tie_word_embeddings=True)
    cfg._attn_implementation = "eager"
    assert cfg.layer_types == ["full_attention", "sliding_attention", "sliding_attention"], cfg.layer_types
    model = Qwen2ForCausalLM(cfg).to(torch.float64)
    randomise_f32(model, np.random.default_rng(0x5117), norm_center=1.0)
    save_f32_folder(model, os.path.join(MODELS, "qwen2_window"))
    set_inv_freq64(model.model.rotary_emb, 1000000.0, 8)
    record("qwen2_window", model, mq, mq.Qwen2RMSNorm, rms_forward64, ids, keep, 4)


def main():
    import transformers
    from safetensors.numpy import load_file

    torch.set_default_dtype(torch.float64)
    exp = load_file(os.path.join(MODELS, "expected.safetensors"))
    ids, keep = torch.tensor(exp["ids"]).long(), torch.tensor(exp["keep"]).long()
    gemma3(ids, keep)
    qwen2_window(ids, keep)
    print(f"torch {torch.__version__}, transformers {transformers.__version__}")


if __name__ == "__main__":
    main()
