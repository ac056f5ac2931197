#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
# Writes the small hand-made seeds of the fuzz harnesses into tests/fuzz/corpus/<name>/ (stdlib
# only): GGUF files of a few hundred bytes (every value type, one 2-row matrix of every tensor type
# the reader dequantises, a byte-level BPE tokenizer), small tokenizer.json files (GPT-2 style,
# Split regex + NFC, added tokens), adapter configs (mlx-lm, PEFT) and JSONL records. The real
# fixtures are larger (16-360 KB) and make the fuzzers 100x slower per input; run.sh adds a few.
# Run once; libFuzzer's -merge=1 keeps what of them adds coverage.
import json, os, random, struct, sys

root = os.path.join(os.path.dirname(os.path.abspath(__file__)), "corpus")
rng = random.Random(0)


def put(name, file, data):
    d = os.path.join(root, name)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, file), "wb") as f:
        f.write(data if isinstance(data, bytes) else data.encode())


# ---- GGUF -------------------------------------------------------------------------------------
def gstr(s):
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


SCALAR = {0: "<B", 1: "<b", 2: "<H", 3: "<h", 4: "<I", 5: "<i", 6: "<f", 7: "<?", 10: "<Q", 11: "<q", 12: "<d"}


def gval(t, v):
    if t == 8:
        return gstr(v)
    if t == 9:
        et, items = v
        return struct.pack("<IQ", et, len(items)) + b"".join(gval(et, x) for x in items)
    return struct.pack(SCALAR[t], v)


def gguf(kv, tensors, align=32):
    out = b"GGUF" + struct.pack("<IQQ", 3, len(tensors), len(kv))
    for k, t, v in kv:
        out += gstr(k) + struct.pack("<I", t) + gval(t, v)
    data, infos = b"", b""
    for name, ne, typ, raw in tensors:
        data += b"\0" * (-len(data) % align)
        infos += gstr(name) + struct.pack("<I", len(ne)) + b"".join(struct.pack("<Q", n) for n in ne)
        infos += struct.pack("<IQ", typ, len(data))
        data += raw
    out += infos
    out += b"\0" * (-len(out) % align)
    return out + data


# type: (elements per block, bytes per block)
TYPES = {0: (1, 4), 1: (1, 2), 30: (1, 2), 28: (1, 8), 2: (32, 18), 3: (32, 20), 6: (32, 22), 7: (32, 24),
         8: (32, 34), 10: (256, 84), 11: (256, 110), 12: (256, 144), 13: (256, 176), 14: (256, 210)}
for typ, (block, nbytes) in TYPES.items():
    cols = block if block > 1 else 4
    raw = bytes(rng.randrange(256) for _ in range(2 * cols // block * nbytes))
    if typ in (0, 28):  # finite floats
        raw = b"".join(struct.pack("<f" if typ == 0 else "<d", rng.uniform(-2, 2)) for _ in range(2 * cols))
    put("gguf", f"type_{typ}.gguf", gguf([("general.architecture", 8, "llama")], [("w", [cols, 2], typ, raw)]))
kv = [("general.architecture", 8, "llama"), ("general.alignment", 4, 16)]
kv += [(f"k.{t}", t, 1) for t in (0, 1, 2, 3, 4, 5, 10, 11)] + [("k.f32", 6, 0.5), ("k.f64", 12, -2.0), ("k.b", 7, True)]
kv += [("k.arr", 9, (5, [1, -2, 3])), ("k.strs", 9, (8, ["a", "bc", ""])), ("k.nested", 9, (9, [(0, [1]), (8, ["x"])]))]
put("gguf", "values.gguf", gguf(kv, [("a", [3], 0, struct.pack("<3f", 1, 2, 3)), ("b", [2, 1, 1], 1, b"\0<\0<")], 16))
put("gguf", "empty.gguf", gguf([], []))

# A byte-level BPE tokenizer in GGUF and tokenizer.json form.
bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAD)) + list(range(0xAE, 0x100))
cs, n = bs[:], 0
for b in range(256):
    if b not in bs:
        bs.append(b)
        cs.append(256 + n)
        n += 1
alphabet = [chr(c) for _, c in sorted(zip(bs, cs))]
merges = [("Ġ", "t"), ("h", "e"), ("Ġt", "he"), ("i", "n"), ("Ġ", "a")]
tokens = alphabet + [a + b for a, b in merges]
specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
gkv = [("general.architecture", 8, "llama"), ("tokenizer.ggml.model", 8, "gpt2"), ("tokenizer.ggml.pre", 8, "qwen2"),
       ("tokenizer.ggml.tokens", 9, (8, tokens + specials)), ("tokenizer.ggml.merges", 9, (8, [f"{a} {b}" for a, b in merges])),
       ("tokenizer.ggml.token_type", 9, (5, [1] * len(tokens) + [3] * len(specials))),
       ("tokenizer.ggml.bos_token_id", 4, len(tokens)), ("tokenizer.ggml.eos_token_id", 4, len(tokens) + 2),
       ("tokenizer.ggml.add_bos_token", 7, True)]
put("tokenizer", "gguf_tokenizer.gguf", gguf(gkv, []) + b"\x01TEXT\x01the cat <|im_end|> in\n")
put("gguf", "tokenizer.gguf", gguf(gkv, []))


def tok_json(pre, normalizer=None, post=None, added=True, pair_merges=True):
    vocab = {t: i for i, t in enumerate(tokens)}
    add = [{"id": len(tokens) + i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
            "normalized": False, "special": True} for i, s in enumerate(specials)] if added else []
    return json.dumps({"version": "1.0", "truncation": None, "padding": None, "added_tokens": add,
                       "normalizer": normalizer, "pre_tokenizer": pre, "post_processor": post,
                       "decoder": {"type": "ByteLevel", "add_prefix_space": True, "trim_offsets": True, "use_regex": True},
                       "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                                 "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                                 "vocab": vocab, "merges": [list(m) if pair_merges else " ".join(m) for m in merges]}},
                      ensure_ascii=False)


bl = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
split = {"type": "Sequence", "pretokenizers": [
    {"type": "Split", "pattern": {"Regex": "(?i:'s|'t)|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}{1,3}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s+(?!\\S)|\\s+"},
     "behavior": "Isolated", "invert": False},
    {"type": "Digits", "individual_digits": True},
    {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": False, "use_regex": False}]}
template = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}}, {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {"<|endoftext|>": {"id": "<|endoftext|>", "ids": [len(tokens)], "tokens": ["<|endoftext|>"]}}}
put("tokenizer", "gpt2.json", tok_json(bl) + "\x01TEXT\x01Hello the world, it's 2024!<|im_start|>")
put("tokenizer", "split_nfc.json", tok_json(split, {"type": "NFC"}, template, pair_merges=False) + "\x01TEXT\x01e\u0301 in 12345 ok\r\n  x")
put("tokenizer", "plain.json", tok_json({"type": "Split", "pattern": {"String": " "}, "behavior": "Removed", "invert": False}, added=False))

# A SentencePiece-style BPE (byte fallback, "▁" spaces) as tokenizer.json (Llama 2's layout, and
# Metaspace's) and as a GGUF "llama" vocabulary with scores.
sp_tokens = ["<unk>", "<s>", "</s>"] + [f"<0x{b:02X}>" for b in range(256)] + ["▁", "t", "h", "e", "a", "▁t", "he", "▁the", "▁a"]
sp_merges = [("▁", "t"), ("h", "e"), ("▁t", "he"), ("▁", "a")]
sp_vocab = {t: i for i, t in enumerate(sp_tokens)}
sp_dec = {"type": "Sequence", "decoders": [{"type": "Replace", "pattern": {"String": "▁"}, "content": " "}, {"type": "ByteFallback"},
                                           {"type": "Fuse"}, {"type": "Strip", "content": " ", "start": 1, "stop": 0}]}


def sp_json(normalizer, pre, decoder):
    add = [{"id": i, "content": t, "single_word": False, "lstrip": False, "rstrip": False, "normalized": False, "special": True}
           for i, t in enumerate(sp_tokens[:3])]
    return json.dumps({"version": "1.0", "added_tokens": add, "normalizer": normalizer, "pre_tokenizer": pre, "decoder": decoder,
                       "post_processor": None,
                       "model": {"type": "BPE", "unk_token": "<unk>", "fuse_unk": True, "byte_fallback": True,
                                 "vocab": sp_vocab, "merges": [list(m) for m in sp_merges]}}, ensure_ascii=False)


put("tokenizer", "spm_llama.json", sp_json({"type": "Sequence", "normalizers": [{"type": "Prepend", "prepend": "▁"},
                                                                                {"type": "Replace", "pattern": {"String": " "}, "content": "▁"}]},
                                           None, sp_dec) + "\x01TEXT\x01the a\u00e9 <s>x\U0001F600")
put("tokenizer", "spm_metaspace.json", sp_json(None, {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True},
                                               {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": True})
    + "\x01TEXT\x01 the  a\n")
skv = [("general.architecture", 8, "llama"), ("tokenizer.ggml.model", 8, "llama"), ("tokenizer.ggml.tokens", 9, (8, sp_tokens)),
       ("tokenizer.ggml.scores", 9, (6, [0.0] * 259 + [-1.0, -2.0, -3.0, -4.0, -5.0, -6.0, -7.0, -8.0, -9.0])),
       ("tokenizer.ggml.token_type", 9, (5, [2, 3, 3] + [6] * 256 + [1] * 9)),
       ("tokenizer.ggml.bos_token_id", 4, 1), ("tokenizer.ggml.eos_token_id", 4, 2), ("tokenizer.ggml.unknown_token_id", 4, 0),
       ("tokenizer.ggml.add_space_prefix", 7, True)]
put("tokenizer", "gguf_spm.gguf", gguf(skv, []) + "\x01TEXT\x01the a\u00e9 </s>x".encode())

# ---- adapter configs, JSONL --------------------------------------------------------------------
put("adapter_config", "mlx.json", json.dumps({"fine_tune_type": "lora", "num_layers": 2, "lora_parameters":
                                              {"rank": 8, "scale": 20.0, "dropout": 0.0, "keys": ["self_attn.q_proj", "self_attn.v_proj"]}}, indent=2))
put("adapter_config", "peft.json", json.dumps({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": 4, "lora_alpha": 8, "lora_dropout": 0.05,
                                               "use_rslora": True, "target_modules": ["q_proj", "v_proj"], "bias": "none",
                                               "fan_in_fan_out": False, "layers_to_transform": [0, 1]}, indent=2))
put("jsonl", "forms.jsonl", "\n".join(json.dumps(r) for r in [
    {"text": "hello world"}, {"prompt": "2+2?", "completion": "4"},
    {"messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]},
    {"messages": [{"role": "user", "content": "no answer"}]}]) + "\n\n  \r\n")
put("config", "llama3_rope.json", json.dumps({"model_type": "llama", "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
                                              "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 100, "rms_norm_eps": 1e-5,
                                              "rope_theta": 500000.0, "tie_word_embeddings": True,
                                              "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                                               "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}))
put("config", "qwen2_params.json", json.dumps({"model_type": "qwen2", "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 1,
                                               "num_attention_heads": 2, "head_dim": 16, "vocab_size": 50, "use_sliding_window": False,
                                               "rope_parameters": {"rope_type": "linear", "factor": 2.0, "rope_theta": 1e6}}))
print("seeds written under", root, file=sys.stderr)
