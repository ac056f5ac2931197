#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Makes the tiny random Llama (untied head, F32), Qwen2 (tied head, F16) and Phi-3 (fused qkv and
gate_up, F32) GGUF fixtures into
models llama.cpp and nn's finetune can both run end to end, for tests/interop/check_gguf_tiny.sh:
their 64-token vocabularies become a working byte-level BPE (the letters, the space, and merges
learnt from a small lowercase corpus), and that corpus is written as JSONL data.

    python3 tests/interop/make_tiny_gguf.py OUT_DIR
writes OUT_DIR/{llama,qwen2,phi3}.gguf, OUT_DIR/data/{train,valid}.jsonl, and the same
models as Hugging Face folders OUT_DIR/hf-llama, hf-qwen2, hf-phi3 (the fixtures' config.json and
safetensors, with the same vocabulary as a tokenizer.json), for exports from a Hugging Face source.
"""
import json
import os
import sys
from collections import Counter

import numpy as np
from gguf import GGUFReader, GGUFWriter, GGUFValueType as VT

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from check_gguf_py import field_value  # noqa: E402

FIX = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "lm", "models", "gguf")
WORDS = ("the cat sat on a mat and the dog ran to the hat while a bird sang in the tree "
         "then the cat saw the dog and the bird flew over the hill").split()


def corpus(n, seed):
    rng = np.random.default_rng(seed)
    return [" ".join(rng.choice(WORDS, size=int(rng.integers(5, 9)))) for _ in range(n)]


def learn_bpe(texts, vocab_size):
    """Byte-level BPE over GPT-2's symbols (a space is 'Ġ'), words split GPT-2's way (a leading
    space stays with its word). Returns (tokens, merges)."""
    words = Counter()
    for t in texts:
        for i, w in enumerate(t.split(" ")):
            words[("Ġ" if i else "") + w] += 1
    tokens = ["<unk>", "<s>", "</s>"] + sorted({c for w in words for c in w})
    segs = {w: list(w) for w in words}
    merges = []
    while len(tokens) < vocab_size - 1:  # the last id is <|endoftext|> (below)
        pairs = Counter()
        for w, n in words.items():
            s = segs[w]
            for a, b in zip(s, s[1:]):
                pairs[(a, b)] += n
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda kv: (kv[1], kv[0]))
        merges.append(f"{a} {b}")
        tokens.append(a + b)
        for w in words:
            s, out, i = segs[w], [], 0
            while i < len(s):
                if i + 1 < len(s) and s[i] == a and s[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(s[i])
                    i += 1
            segs[w] = out
    while len(tokens) < vocab_size - 1:
        tokens.append(f"<unused{len(tokens)}>")
    # llama.cpp sets attributes on "<|endoftext|>" for a model whose general.name says phi3, and
    # fails to load one without it
    tokens.append("<|endoftext|>")
    return tokens, merges


def rewrite(src, dst, tokens, merges):
    r = GGUFReader(src)
    w = GGUFWriter(dst, field_value(r.fields["general.architecture"]))
    for name, f in r.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture" or name.startswith("tokenizer.") \
                or name.startswith("test."):
            continue
        vtype = f.types[0]
        w.add_key_value(name, field_value(f), vtype, sub_type=f.types[-1] if vtype == VT.ARRAY else None)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-2")
    w.add_token_list(tokens)
    w.add_token_types([3, 3, 3] + [1 if not t.startswith("<unused") else 5 for t in tokens[3:]])
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    for t in r.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def write_hf(name, dst, tokens, merges):
    """The fixture's HF folder with a GPT-2-style byte-level tokenizer.json of this vocabulary."""
    import shutil
    src = os.path.join(FIX, "..", name)
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        shutil.copy(os.path.join(src, f), dst)
    added = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False,
              "normalized": False, "special": True} for i, t in enumerate(tokens[:3])]
    tj = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": added, "normalizer": None,
          "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True},
          "post_processor": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": False, "use_regex": True},
          "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
          "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": "",
                    "end_of_word_suffix": "", "fuse_unk": False, "byte_fallback": False,
                    "vocab": {t: i for i, t in enumerate(tokens)}, "merges": merges}}
    with open(os.path.join(dst, "tokenizer.json"), "w") as f:
        json.dump(tj, f)
    with open(os.path.join(dst, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": "<s>", "eos_token": "</s>", "add_bos_token": False}, f)


def main():
    out = sys.argv[1]
    os.makedirs(os.path.join(out, "data"), exist_ok=True)
    train, valid = corpus(200, 1), corpus(20, 2)
    tokens, merges = learn_bpe(train + valid, 64)
    for name, rows in (("train", train), ("valid", valid)):
        with open(os.path.join(out, "data", f"{name}.jsonl"), "w") as f:
            for t in rows:
                f.write(json.dumps({"text": t}) + "\n")
    rewrite(os.path.join(FIX, "llama-F32.gguf"), os.path.join(out, "llama.gguf"), tokens, merges)
    rewrite(os.path.join(FIX, "qwen2-F16.gguf"), os.path.join(out, "qwen2.gguf"), tokens, merges)
    rewrite(os.path.join(FIX, "phi3-F32.gguf"), os.path.join(out, "phi3.gguf"), tokens, merges)
    for name in ("llama", "qwen2", "phi3"):
        write_hf(name, os.path.join(out, f"hf-{name}"), tokens, merges)
    print(f"{out}: hf-llama/, hf-qwen2/, hf-phi3/, llama.gguf, qwen2.gguf, phi3.gguf ({len(merges)} merges), "
          f"data/ ({len(train)} + {len(valid)} lines)")


if __name__ == "__main__":
    main()
