#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The Phi-3 oracle: a tiny random Phi3ForCausalLM made by `transformers`, its logits in float64,
and the same model as a GGUF file laid out as llama.cpp's convert_hf_to_gguf.py lays out phi3.

    /usr/bin/python3 tests/oracle/gen_phi3.py     # rewrites tests/fixtures/lm/models/phi3/ and phi3*

Needs torch (Debian's python3-torch 1.13 works), transformers 4.44 (Phi3, recorded with 4.44.2)
and gguf (gguf-py), and gen_lm_models.py beside it for its float64 patches of transformers (see
its docstring); Phi-3's own RMSNorm and rotary classes are patched the same way here.

What Phi-3 stores differently from Llama: q, k and v as one matrix self_attn.qkv_proj (rows q,
then k, then v), gate and up as one mlp.gate_up_proj (rows gate, then up: the MLP is
down(up * silu(gate))), no biases, an untied head; config.json's sliding_window (2047 here, as
Phi-3-mini-4k) lies beyond the fixture's 7 positions. GQA 4/2 (Phi-3-mini has 32/32; later Phi-3
models group), rope_theta 10000, weights stored F32 (rounded, then used in float64).

Writes:
  tests/fixtures/lm/models/phi3/            config.json + model.safetensors (save_pretrained)
  tests/fixtures/lm/models/gguf/phi3-F32.gguf   the same tensors under llama.cpp's phi3 names
                                             (blk.N.attn_qkv, blk.N.ffn_up holding gate and up),
                                             no permutation (NEOX RoPE)
  tests/fixtures/lm/models/phi3_expected.safetensors   float64 "phi3.logits" (B, T, V) on the ids
                                             and keep of expected.safetensors (right padded)
"""
import os
import sys

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
MODELS = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "models"))
rng = np.random.default_rng(0x0F13)


def main():
    import gguf
    import gen_lm_models as g
    from safetensors.numpy import load_file, save_file
    from transformers import Phi3Config, Phi3ForCausalLM
    from transformers.models.phi3 import modeling_phi3

    exp = load_file(os.path.join(MODELS, "expected.safetensors"))
    ids, keep = torch.tensor(exp["ids"]).long(), torch.tensor(exp["keep"]).long()
    V = 64
    cfg = Phi3Config(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=64,
                     original_max_position_embeddings=64, sliding_window=2047, tie_word_embeddings=False,
                     pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_scaling=None)
    cfg._attn_implementation = "eager"
    model = Phi3ForCausalLM(cfg).to(torch.float64)
    g.randomise_f32(model, rng)
    model.eval()
    folder = os.path.join(MODELS, "phi3")
    g.save_f32_folder(model, folder)

    # float64 reference: gen_lm_models' patches plus Phi-3's own norm and rotary classes
    hd = cfg.hidden_size // cfg.num_attention_heads
    g.set_inv_freq64(model, cfg.rope_theta, hd)
    with torch.no_grad():
        plain = model(input_ids=ids, attention_mask=keep).logits.to(torch.float64).numpy()
    logits = g.family_logits64(model, ids, keep, modeling_phi3, "Phi3").numpy()
    err = g.rel(plain, logits)
    assert err < 2e-5, err  # the patches change precision, not the model
    save_file({"phi3.logits": np.ascontiguousarray(logits)}, os.path.join(MODELS, "phi3_expected.safetensors"))

    # GGUF, as convert_hf_to_gguf.py's Phi3MiniModel writes it: qkv_proj -> attn_qkv,
    # gate_up_proj -> ffn_up (fused, gate first), no q/k permutation (NEOX RoPE)
    path = os.path.join(MODELS, "gguf", "phi3-F32.gguf")
    w = gguf.GGUFWriter(path, "phi3")
    w.add_name("tiny-phi3")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_rope_scaling_orig_ctx_len(cfg.original_max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_dimension_count(hd)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_sliding_window(cfg.sliding_window)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(g.TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_merges(g.MERGES)
    parts = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm", "self_attn.qkv_proj": "attn_qkv",
             "self_attn.o_proj": "attn_output", "mlp.gate_up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for hf, t in model.state_dict().items():
        if "rotary_emb" in hf:
            continue
        if hf.startswith("model.layers."):
            p = hf.split(".")
            name = f"blk.{p[2]}.{parts['.'.join(p[3:-1])]}.{p[-1]}"
        else:
            name = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
                    "lm_head.weight": "output.weight"}[hf]
        w.add_tensor(name, t.numpy().astype(np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(f"phi3: patched vs stock {err:.1e}; wrote {folder}, {path}")


if __name__ == "__main__":
    main()
