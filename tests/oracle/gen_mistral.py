#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The Mistral oracle: a tiny random MistralForCausalLM made by `transformers`, its logits in float64.

    /usr/bin/python3 tests/oracle/gen_mistral.py     # rewrites tests/fixtures/lm/models/mistral/ and mistral_expected*

Needs torch (Debian's python3-torch 1.13 works) and transformers 4.44 (recorded with 4.44.2), and
gen_lm_models.py beside it for its float64 patches of transformers (see its docstring); Mistral's
own RMSNorm and rotary classes are patched the same way here.

What Mistral adds to Llama: a sliding window on every layer's attention (a query sees the keys
less than sliding_window positions back; 4 here, over the fixture's 7 positions, so the window
hides keys), no biases, an untied head, GQA 4/2, rope_theta 1e6 (Mistral-7B v0.2 on). Weights
stored F32 (rounded, then used in float64).

Writes:
  tests/fixtures/lm/models/mistral/            config.json + model.safetensors (save_pretrained)
  tests/fixtures/lm/models/mistral_expected.safetensors   float64 "mistral.logits" (B, T, V) on the
                                             ids and keep of expected.safetensors (right padded),
                                             "mistral.nowindow.logits" the same model with
                                             sliding_window null (plain causal)
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MODELS = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "models"))
rng = np.random.default_rng(0x3157)


def main():
    import gen_lm_models as g
    from safetensors.numpy import load_file, save_file
    from transformers import MistralConfig, MistralForCausalLM
    from transformers.models.mistral import modeling_mistral as mm

    exp = load_file(os.path.join(MODELS, "expected.safetensors"))
    ids, keep = torch.tensor(exp["ids"]).long(), torch.tensor(exp["keep"]).long()
    V = 64
    cfg = MistralConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                        num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=1e6, max_position_embeddings=64,
                        sliding_window=4, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2)
    cfg._attn_implementation = "eager"
    model = MistralForCausalLM(cfg).to(torch.float64)
    g.randomise_f32(model, rng)
    model.eval()
    folder = os.path.join(MODELS, "mistral")
    g.save_f32_folder(model, folder)
    hd = cfg.hidden_size // cfg.num_attention_heads
    g.set_inv_freq64(model, cfg.rope_theta, hd)

    def logits64():
        return g.family_logits64(model, ids, keep, mm, "Mistral", use_cache=False).numpy()

    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=keep, use_cache=False).logits.to(torch.float64).numpy()
    logits = logits64()
    err = g.rel(plain, logits)
    assert err < 2e-5, err  # the patches change precision, not the model
    out = {"mistral.logits": np.ascontiguousarray(logits)}
    # the control: without the window the logits move (the window hides keys at these lengths)
    model.config.sliding_window = None
    out["mistral.nowindow.logits"] = np.ascontiguousarray(logits64())
    d = g.rel(out["mistral.nowindow.logits"], logits)
    assert d > 1e-3, d
    print(f"mistral: without the window: logits move by {d:.2e}")
    save_file(out, os.path.join(MODELS, "mistral_expected.safetensors"))
    print(f"mistral: patched vs stock {err:.1e}; wrote {folder}")


if __name__ == "__main__":
    main()
