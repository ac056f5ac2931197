#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The Gemma 2 oracle: a tiny random Gemma2ForCausalLM made by `transformers`, its logits in float64.

    /usr/bin/python3 tests/oracle/gen_gemma2.py     # rewrites tests/fixtures/lm/models/gemma2/ and gemma2_expected*

Needs torch (Debian's python3-torch 1.13 works) and transformers 4.44 (Gemma2 since 4.42;
recorded with 4.44.2), and gen_lm_models.py beside it for its float64 patches of transformers
(see its docstring); Gemma 2's own RMSNorm (which computes in float32 and scales by 1 + w) and
rotary classes are patched the same way here, and the final soft cap is applied to the float64
logits as Gemma2ForCausalLM applies it.

What the tiny model exercises: embeddings times sqrt(hidden); RMSNorms with (1 + w), w drawn
around 0; the four norms of each layer (input, post-attention on the attention's output,
pre- and post-feedforward around the MLP); the GeGLU MLP (gelu_pytorch_tanh); head_dim 16 over
4 heads while hidden is 32, GQA 4/2; query_pre_attn_scalar 24 (so the scale is not
1/sqrt(head_dim)); attention and final soft caps small enough (2 and 3) to bend the scores and
logits; a sliding window of 4 on layers 0 and 2 (of 3) over the fixture's 7 positions, so the
window masks keys; tied embeddings. Weights stored F32 (rounded, then used in float64).

Writes:
  tests/fixtures/lm/models/gemma2/            config.json + model.safetensors (save_pretrained)
  tests/fixtures/lm/models/gemma2_expected.safetensors   float64 "gemma2.logits" (B, T, V) on the
                                             ids and keep of expected.safetensors (right padded),
                                             "gemma2.nocap.logits" the same model without the
                                             soft caps, "gemma2.nowindow.logits" without the window
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MODELS = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "models"))
rng = np.random.default_rng(0x6E2)


def rms_forward64(self, x):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * (1.0 + self.weight)


def main():
    import gen_lm_models as g
    from safetensors.numpy import load_file, save_file
    from transformers import Gemma2Config, Gemma2ForCausalLM
    from transformers.models.gemma2 import modeling_gemma2 as mg

    exp = load_file(os.path.join(MODELS, "expected.safetensors"))
    ids, keep = torch.tensor(exp["ids"]).long(), torch.tensor(exp["keep"]).long()
    V = 64
    cfg = Gemma2Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=16, hidden_activation="gelu_pytorch_tanh",
                       max_position_embeddings=64, rms_norm_eps=1e-6, rope_theta=10000.0, attention_bias=False,
                       query_pre_attn_scalar=24, attn_logit_softcapping=2.0, final_logit_softcapping=3.0,
                       sliding_window=4, tie_word_embeddings=True, pad_token_id=0, eos_token_id=1, bos_token_id=2)
    cfg._attn_implementation = "eager"
    model = Gemma2ForCausalLM(cfg).to(torch.float64)
    g.randomise_f32(model, rng, norm_center=0.0)  # Gemma's norms scale by 1 + w
    model.tie_weights()
    model.eval()
    folder = os.path.join(MODELS, "gemma2")
    g.save_f32_folder(model, folder)
    g.set_inv_freq64(model, cfg.rope_theta, cfg.head_dim)

    def logits64():
        out = g.family_logits64(model, ids, keep, mg, "Gemma2", rms_forward64, use_cache=False)
        cap = model.config.final_logit_softcapping
        if cap is not None:  # as Gemma2ForCausalLM.forward
            out = torch.tanh(out / cap) * cap
        return out.numpy()

    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=keep, use_cache=False).logits.to(torch.float64).numpy()
    logits = logits64()
    err = g.rel(plain, logits)
    assert err < 2e-5, err  # the patches change precision, not the model
    out = {"gemma2.logits": np.ascontiguousarray(logits)}
    # controls: the caps and the window each move the logits
    model.config.attn_logit_softcapping = model.config.final_logit_softcapping = None
    out["gemma2.nocap.logits"] = np.ascontiguousarray(logits64())
    model.config.attn_logit_softcapping, model.config.final_logit_softcapping = 2.0, 3.0
    for layer in model.model.layers:
        layer.is_sliding = False
    out["gemma2.nowindow.logits"] = np.ascontiguousarray(logits64())
    for k in ("nocap", "nowindow"):
        d = g.rel(out[f"gemma2.{k}.logits"], logits)
        assert d > 1e-3, (k, d)
        print(f"gemma2: without {k[2:]}: logits move by {d:.2e}")
    save_file(out, os.path.join(MODELS, "gemma2_expected.safetensors"))
    print(f"gemma2: patched vs stock {err:.1e}; wrote {folder}")


if __name__ == "__main__":
    main()
