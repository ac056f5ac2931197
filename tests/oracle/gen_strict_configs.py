# SPDX-License-Identifier: MIT OR Apache-2.0
"""Writes the regression inputs for config validation (tests/lm/strict_config.test.cpp) into
tests/fixtures/lm/strict/: config.json files and tiny GGUF files (gguf-py) whose sizes are zero,
past ModelConfig's limits, or disagree with the file's tensors. Each must be refused by name
before anything is allocated.  python3 tests/oracle/gen_strict_configs.py"""
import json
import pathlib

import gguf
import numpy as np

root = pathlib.Path(__file__).resolve().parents[1] / "fixtures" / "lm"
out = root / "strict"
base = json.loads((root / "models" / "llama" / "config.json").read_text())

for name, change in {
    "config_layers_2e31.json": {"num_hidden_layers": 2**31 - 1},
    "config_layers_2e62.json": {"num_hidden_layers": 2**62},
    "config_vocab_2e40.json": {"vocab_size": 2**40},
    "config_positions_negative.json": {"max_position_embeddings": -1},
    "config_too_many_parameters.json": {"hidden_size": 2**20, "intermediate_size": 2**20, "num_attention_heads": 4096,
                                        "num_key_value_heads": 4096, "num_hidden_layers": 1024},
}.items():
    (out / name).write_text(json.dumps({**base, **change}, indent=1) + "\n")


def tiny_gguf(name, **meta):
    """A llama GGUF of width 8 with one block's norm and the embedding: enough for gguf_config and
    load_gguf's checks, which must fail before the rest of the tensors are looked for."""
    w = gguf.GGUFWriter(str(out / name), "llama")
    m = {"embedding_length": 8, "block_count": 1, "feed_forward_length": 16, "head_count": 2, "vocab_size": 4}
    m.update(meta)
    w.add_uint64("llama.embedding_length", m["embedding_length"])
    w.add_uint64("llama.block_count", m["block_count"])
    w.add_uint64("llama.feed_forward_length", m["feed_forward_length"])
    w.add_uint64("llama.attention.head_count", m["head_count"])
    w.add_uint64("llama.vocab_size", m["vocab_size"])
    width = min(m["embedding_length"], 1024)
    w.add_tensor("token_embd.weight", np.zeros((4, width), dtype=np.float32))
    w.add_tensor("blk.0.attn_norm.weight", np.ones(width, dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


tiny_gguf("gguf_head_count_0.gguf", head_count=0)
tiny_gguf("gguf_embedding_2e40.gguf", embedding_length=2**40)
tiny_gguf("gguf_block_count_2e62.gguf", block_count=2**62)
# within the limits, but the file holds one block: 1000 layers of width 1024 (6.3e9 weights) are
# refused before they are allocated
tiny_gguf("gguf_block_count_1000.gguf", block_count=1000, embedding_length=1024, feed_forward_length=2048, head_count=8)
tiny_gguf("gguf_vocab_mismatch.gguf", vocab_size=1000)  # the embedding has 4 rows


def hf_folder(name, config_change, tensors):
    """A Hugging Face folder: the llama fixture's config.json with `config_change`, and a
    model.safetensors of `tensors` (float32 arrays by name), too few for the model described."""
    import safetensors.numpy
    d = out / name
    d.mkdir(exist_ok=True)
    (d / "config.json").write_text(json.dumps({**base, **config_change}, indent=1) + "\n")
    safetensors.numpy.save_file(tensors, str(d / "model.safetensors"))


# 1000 layers of width 1024 (6.3e9 weights) over a file holding 9216 weights: refused before the
# model is allocated, as the GGUF above is
hf_folder("hf_layers_1000", {"num_hidden_layers": 1000, "hidden_size": 1024, "intermediate_size": 2048,
                             "num_attention_heads": 8, "num_key_value_heads": 8, "vocab_size": 8},
          {"model.embed_tokens.weight": np.zeros((8, 1024), np.float32), "model.norm.weight": np.ones(1024, np.float32)})
# the embedding has 4 rows, the config says 64
hf_folder("hf_vocab_mismatch", {}, {"model.embed_tokens.weight": np.zeros((4, 32), np.float32)})


def tokenizer_gguf(name, tokens, token_types=None, **ids):
    """A GGUF holding only tokenizer.ggml.* (gpt2 model, smollm pre-tokenizer): `tokens` as str
    or raw bytes, `token_types` with their integer type, ids (bos/eos) as uint64."""
    w = gguf.GGUFWriter(str(out / name), "llama")
    w.add_string("tokenizer.ggml.model", "gpt2")
    w.add_string("tokenizer.ggml.pre", "smollm")
    w.add_key_value("tokenizer.ggml.tokens", tokens, gguf.GGUFValueType.ARRAY, sub_type=gguf.GGUFValueType.STRING)
    w.add_array("tokenizer.ggml.merges", ["a b"])
    if token_types is not None:
        vals, vtype = token_types
        w.add_key_value("tokenizer.ggml.token_type", vals, gguf.GGUFValueType.ARRAY, sub_type=vtype)
    for k, v in ids.items():
        w.add_uint64(f"tokenizer.ggml.{k}_token_id", v)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


ok = ["a", "b", "ab", "<|end|>"]
tokenizer_gguf("gguf_tok_ok.gguf", ok, ([1, 1, 1, 3], gguf.GGUFValueType.INT32), eos=3)
tokenizer_gguf("gguf_tok_duplicate.gguf", ["a", "b", "ab", "b"])
tokenizer_gguf("gguf_tok_type_99.gguf", ok, ([1, 1, 99, 3], gguf.GGUFValueType.INT32))
tokenizer_gguf("gguf_tok_type_2e32.gguf", ok, ([1, 1, 2**32 + 1, 3], gguf.GGUFValueType.INT64))
tokenizer_gguf("gguf_tok_invalid_utf8.gguf", [b"a", b"b", b"a\xffb", b"<|end|>"])
tokenizer_gguf("gguf_tok_eos_2e32.gguf", ok, eos=2**32 + 3)  # wrapped to 3 through a 32-bit cast
