#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""mlx-lm's quantized model folders, made by mlx-lm itself, with the logits mlx-lm computes from them.

    python3 tests/oracle/gen_mlx_lm_quantized.py     # rewrites tests/fixtures/lm/mlx_quantized/

Needs mlx and mlx-lm (pip install "mlx[cpu]" mlx-lm; recorded with mlx 0.32.4, mlx-lm 0.32.2) and
transformers (an mlx-lm dependency), for the tokenizer files mlx_lm.convert insists on reading.

Two tiny random float32 Hugging Face folders are written to a temporary directory: an untied Llama
(hidden 64, GQA 4/2, 2 layers, vocab 96) and a SmolLM-style tied one with q/k/v biases (a qwen2).
Each is converted by mlx_lm.convert -- the CLI's own function, --dtype float32 -- into:

  llama_q4/      -q (affine, group 64, 4 bits: mlx-lm's default); the embedding and head too
  llama_q8/      -q --q-bits 8
  qwen2_mixed/   -q --quant-predicate mixed_3_6 --q-group-size 32: per-layer overrides in
                 config.json (3 bits, and 6 bits for layer 1's v_proj / down_proj), 3-bit tied
                 embedding
  llama_mxfp4/   -q --q-mode mxfp4 (group 32, E2M1 codes, u8 E8M0 scales, no biases)
  llama_mxfp8/   -q --q-mode mxfp8 (group 32, E4M3 codes, u8 E8M0 scales)
  llama_nvfp4/   -q --q-mode nvfp4 (group 16, E2M1 codes, u8 E4M3 scales, no global scale)

Only config.json and model.safetensors are kept. mlx_lm.utils.load_model then loads each folder (its
own class_predicate: the per-layer override, else the group and bits inferred from the shapes) and
the model's logits for fixed ids are recorded in expected.safetensors ("<case>.logits", float32,
(2, 8, 96), and "ids" int32 (2, 8)); expected.json records, per case, the largest difference from
the unquantized model's logits, so the test's tolerance (1e-5) is far below the quantization error
it would otherwise hide.
"""
import json
import os
import shutil
import tempfile

import mlx.core as mx
import numpy as np
from mlx_lm import convert
from mlx_lm.utils import load_model

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "mlx_quantized"))
VOCAB, HIDDEN, INTER, HEADS, KV, LAYERS = 96, 64, 128, 4, 2, 2


def write_hf(folder, model_type, tied, qkv_bias, seed):
    rng = np.random.default_rng(seed)
    hd = HIDDEN // HEADS
    w = {"model.embed_tokens.weight": rng.normal(0, 0.5, (VOCAB, HIDDEN)), "model.norm.weight": 1 + 0.1 * rng.normal(size=HIDDEN)}
    if not tied:
        w["lm_head.weight"] = rng.normal(0, 0.2, (VOCAB, HIDDEN))
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        shapes = {"self_attn.q_proj": (HEADS * hd, HIDDEN), "self_attn.k_proj": (KV * hd, HIDDEN),
                  "self_attn.v_proj": (KV * hd, HIDDEN), "self_attn.o_proj": (HIDDEN, HEADS * hd),
                  "mlp.gate_proj": (INTER, HIDDEN), "mlp.up_proj": (INTER, HIDDEN), "mlp.down_proj": (HIDDEN, INTER)}
        for k, s in shapes.items():
            w[p + k + ".weight"] = rng.normal(0, 0.2, s)
            if qkv_bias and k in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"):
                w[p + k + ".bias"] = rng.normal(0, 0.1, s[0])
        w[p + "input_layernorm.weight"] = 1 + 0.1 * rng.normal(size=HIDDEN)
        w[p + "post_attention_layernorm.weight"] = 1 + 0.1 * rng.normal(size=HIDDEN)
    os.makedirs(folder)
    mx.save_safetensors(os.path.join(folder, "model.safetensors"), {k: mx.array(v.astype(np.float32)) for k, v in w.items()})
    cfg = {"architectures": ["Qwen2ForCausalLM" if model_type == "qwen2" else "LlamaForCausalLM"],
           "model_type": model_type, "hidden_size": HIDDEN, "intermediate_size": INTER,
           "num_attention_heads": HEADS, "num_key_value_heads": KV, "num_hidden_layers": LAYERS,
           "vocab_size": VOCAB, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 64,
           "tie_word_embeddings": tied, "torch_dtype": "float32", "hidden_act": "silu"}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f, indent=2)
    # A word-level tokenizer: mlx_lm.convert loads (and copies) one, nn does not read it.
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"t{i}": i for i in range(VOCAB)}, unk_token="t0"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="t0").save_pretrained(folder)


def logits(folder, ids):
    model, _ = load_model(__import__("pathlib").Path(folder))
    return np.array(model(mx.array(ids)).astype(mx.float32))


def main():
    ids = np.random.default_rng(7).integers(0, VOCAB, (2, 8)).astype(np.int32)
    cases = {
        "llama_q4": ("llama", dict(quantize=True)),
        "llama_q8": ("llama", dict(quantize=True, q_bits=8)),
        "qwen2_mixed": ("qwen2", dict(quantize=True, q_group_size=32, quant_predicate="mixed_3_6")),
        "llama_mxfp4": ("llama", dict(quantize=True, q_mode="mxfp4")),
        "llama_mxfp8": ("llama", dict(quantize=True, q_mode="mxfp8")),
        "llama_nvfp4": ("llama", dict(quantize=True, q_mode="nvfp4")),
    }
    if os.path.isdir(OUT):
        shutil.rmtree(OUT)
    os.makedirs(OUT)
    expected = {"ids": ids}
    meta = {"mlx": mx.__version__, "mlx_lm": __import__("mlx_lm").__version__, "cases": {}}
    with tempfile.TemporaryDirectory() as tmp:
        src = {"llama": os.path.join(tmp, "llama"), "qwen2": os.path.join(tmp, "qwen2")}
        write_hf(src["llama"], "llama", tied=False, qkv_bias=False, seed=1)
        write_hf(src["qwen2"], "qwen2", tied=True, qkv_bias=True, seed=2)
        full = {k: logits(v, ids) for k, v in src.items()}
        for name, (base, kw) in cases.items():
            out = os.path.join(tmp, name)
            convert(src[base], out, dtype="float32", **kw)
            os.makedirs(os.path.join(OUT, name))
            for f in ("config.json", "model.safetensors"):
                shutil.copy(os.path.join(out, f), os.path.join(OUT, name, f))
            got = logits(out, ids)
            expected[name + ".logits"] = got
            meta["cases"][name] = {"max_abs_diff_vs_unquantized": float(np.abs(got - full[base]).max()),
                                   "max_abs_logit": float(np.abs(got).max())}
    mx.save_safetensors(os.path.join(OUT, "expected.safetensors"), {k: mx.array(v) for k, v in expected.items()})
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(meta, f, indent=2)
    print(json.dumps(meta, indent=2))


if __name__ == "__main__":
    main()
