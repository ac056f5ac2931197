#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The Qwen3 oracle: a tiny random Qwen3ForCausalLM made by `transformers`, its logits in float64,
and the same model as a GGUF file laid out as llama.cpp's convert_hf_to_gguf.py lays out qwen3.

    python3 tests/oracle/gen_qwen3.py     # rewrites tests/fixtures/lm/models/qwen3/ and qwen3*.gguf

Needs torch, transformers >= 4.51 (Qwen3; recorded with 5.25) and gguf (gguf-py), and
gen_lm_models.py beside it for its float64 patches of transformers (see its docstring); Qwen3's
own RMSNorm and rotary classes are patched the same way here.

What Qwen3 adds to Qwen2: RMSNorms over head_dim on each head's query and key (q_norm, k_norm),
applied before RoPE; head_dim given by the config (16 here, so the attention width 64 differs
from hidden 32, as in the real models); no q/k/v biases (attention_bias false). Tied embeddings,
GQA 4/2, rope_theta 1e6, weights stored F32 (rounded, then used in float64).

Writes:
  tests/fixtures/lm/models/qwen3/            config.json + model.safetensors (save_pretrained)
  tests/fixtures/lm/models/gguf/qwen3-F32.gguf   the same tensors under llama.cpp's qwen3 names
                                             (blk.N.attn_q_norm / attn_k_norm), no permutation
  tests/fixtures/lm/models/qwen3_expected.safetensors   float64 "qwen3.logits" (B, T, V) on the
                                             ids and keep of expected.safetensors (right padded)
"""
import json
import math
import os
import shutil
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MODELS = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "models"))
rng = np.random.default_rng(0x03E3)


def main():
    import gguf
    import gen_lm_models as g
    from safetensors.numpy import load_file, save_file
    from transformers import Qwen3Config, Qwen3ForCausalLM
    from transformers.models.qwen3 import modeling_qwen3

    exp = load_file(os.path.join(MODELS, "expected.safetensors"))
    ids, keep = torch.tensor(exp["ids"]).long(), torch.tensor(exp["keep"]).long()
    V = 64
    cfg = Qwen3Config(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, head_dim=16, rms_norm_eps=1e-6, rope_theta=1e6, max_position_embeddings=64,
                      tie_word_embeddings=True, attention_bias=False, use_sliding_window=False)
    cfg._attn_implementation = "eager"
    model = Qwen3ForCausalLM(cfg).to(torch.float64)
    with torch.no_grad():  # weights as gen_lm_models' randomise, rounded to float32 (stored F32)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                a = 1.0 + 0.1 * rng.standard_normal(p.shape)
            elif "embed_tokens" in name:
                a = rng.standard_normal(p.shape)
            else:
                b = 1 / math.sqrt(p.shape[1])
                a = rng.uniform(-b, b, p.shape)
            p.copy_(torch.tensor(a.astype(np.float32).astype(np.float64)))
    model.tie_weights()
    model.eval()

    folder = os.path.join(MODELS, "qwen3")
    shutil.rmtree(folder, ignore_errors=True)
    model.to(torch.float32).save_pretrained(folder, safe_serialization=True)
    for f in os.listdir(folder):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(folder, f))
    model.to(torch.float64)

    # float64 reference: gen_lm_models' patches plus Qwen3's own norm and rotary classes
    hd = cfg.head_dim
    inv = torch.tensor(1.0 / (1e6 ** (np.arange(0, hd, 2, dtype=np.float64) / hd)))
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding"):
            assert torch.allclose(mod.inv_freq.to(torch.float64), inv, rtol=1e-6, atol=0)
            mod.inv_freq = inv.clone()
    stock = (modeling_qwen3.Qwen3RMSNorm.forward, modeling_qwen3.Qwen3RotaryEmbedding.forward)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=keep).logits.to(torch.float64).numpy()
        g.set_patches(True)
        modeling_qwen3.Qwen3RMSNorm.forward = g.rms_forward64
        modeling_qwen3.Qwen3RotaryEmbedding.forward = g.llama_rope_forward64
        try:
            logits = model.lm_head(model.model(input_ids=ids, attention_mask=keep).last_hidden_state).numpy()
        finally:
            g.set_patches(False)
            modeling_qwen3.Qwen3RMSNorm.forward, modeling_qwen3.Qwen3RotaryEmbedding.forward = stock
    err = g.rel(plain, logits)
    assert err < 2e-5, err  # the patches change precision, not the model
    # q_norm / k_norm matter: the same model without them gives other logits
    save_file({"qwen3.logits": np.ascontiguousarray(logits)}, os.path.join(MODELS, "qwen3_expected.safetensors"))

    # GGUF, as convert_hf_to_gguf.py's Qwen3Model writes it: no q/k permutation (NEOX RoPE)
    path = os.path.join(MODELS, "gguf", "qwen3-F32.gguf")
    w = gguf.GGUFWriter(path, "qwen3")
    w.add_name("tiny-qwen3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_key_length(hd)
    w.add_value_length(hd)
    w.add_rope_freq_base(1e6)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("qwen2")
    w.add_token_list(g.TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_merges(g.MERGES)
    parts = dict(g.GGUF_PARTS, **{"self_attn.q_norm": "attn_q_norm", "self_attn.k_norm": "attn_k_norm"})
    for hf, t in model.state_dict().items():
        if "rotary_emb" in hf or hf == "lm_head.weight":
            continue
        if hf.startswith("model.layers."):
            p = hf.split(".")
            name = f"blk.{p[2]}.{parts['.'.join(p[3:-1])]}.{p[-1]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight"}[hf]
        w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"qwen3: patched vs stock {err:.1e}; wrote {folder}, {path}")


if __name__ == "__main__":
    main()
