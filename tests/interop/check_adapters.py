#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Do the adapters examples/finetune writes load in the Python tools, with the same logits?

For a tiny random Llama (untied head) and a tiny random Qwen2 (tied, q/k/v biases), made here
with transformers and a byte-level BPE tokenizer trained here with tokenizers, this script:

  1. runs the finetune program (a few LoRA steps on all seven projections, rank 4, plus a second
     run with --rslora, and a DoRA run, --fine-tune-type dora), which writes the mlx-lm adapter directory, the PEFT directory, a fused
     Hugging Face folder (--fuse) and the logits of a prompt after training (--logits-out);
  2. loads the PEFT directory over the base model with peft.PeftModel (torch, float32; DoRA's
     through its use_dora and lora_magnitude_vector);
  3. loads the mlx-lm directory with mlx_lm.utils.load_model + load_adapters (MLX, float32);
  4. loads the fused folder with transformers;
  5. (QLoRA, and QDoRA the same way) converts each model with mlx_lm.convert -q (affine, group 64, 4 bits; the down
     projections' 160 inputs are not a multiple of 64, so mlx-lm leaves them float32), finetunes
     over that folder kept quantized, loads the adapters over the same 4-bit folder in mlx-lm,
     and the fused folder (dequantized base + merged LoRA) in transformers;
and compares each one's logits for the prompt's tokens with the program's: max |a - b| / max |b|.
It also prints how far the adapters moved the logits from the base model's, so a no-op adapter
cannot pass. Exit status 1 when any comparison is above 1e-4 (float32, different summation
orders) or the adapters did not move the logits.

A development check (its results are in the issue's closing note); it needs one Python with
torch, transformers, peft, mlx[cpu], mlx-lm, safetensors and tokenizers:
    python3 -m venv /tmp/interop && /tmp/interop/bin/pip install torch transformers peft \
        "mlx[cpu]" mlx-lm safetensors tokenizers
    /tmp/interop/bin/python tests/interop/check_adapters.py --finetune build/examples/finetune/finetune
"""
import argparse
import json
import os
import random
import shutil
import subprocess
import sys
import tempfile

import numpy as np

WORDS = ("the a wise man fool heart word mouth way path light darkness righteous wicked son father "
         "keep hear give take walk shall not be is are of in to and with for his my thy understanding "
         "wisdom knowledge instruction fear lord good evil life death gold silver house").split()


def corpus(n, seed):
    rng = random.Random(seed)
    lines = []
    for _ in range(n):
        words = [rng.choice(WORDS) for _ in range(rng.randint(6, 18))]
        lines.append(" ".join(words).capitalize() + rng.choice([".", "!", "?", ", 42 times.", " (3:5)."]))
    return lines


def make_model(folder, arch, texts):
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    os.makedirs(folder, exist_ok=True)
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=384, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    tok.save(os.path.join(folder, "tokenizer.json"))
    with open(os.path.join(folder, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|endoftext|>", "bos_token": None}, f)
    common = dict(vocab_size=tok.get_vocab_size(), hidden_size=64, intermediate_size=160, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5)
    torch.manual_seed(0)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**common, tie_word_embeddings=False, rope_theta=10000.0)
        model = transformers.LlamaForCausalLM(cfg)
    else:
        cfg = transformers.Qwen2Config(**common, tie_word_embeddings=True, rope_theta=1e6)
        model = transformers.Qwen2ForCausalLM(cfg)
    with torch.no_grad():  # larger than the default 0.02 init, so the logits are far from uniform
        for name, p in model.named_parameters():
            if p.dim() == 2:
                p.normal_(0, 0.08)
            elif name.endswith(".bias"):  # Qwen2's q/k/v biases (zeros by default)
                p.normal_(0, 0.05)
    model.to(torch.float32).save_pretrained(folder, safe_serialization=True)


def rel(a, b):
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64))) / np.max(np.abs(b.astype(np.float64))))


def peft_logits(base_dir, peft_dir, ids):
    import torch
    import transformers
    from peft import PeftModel

    base = transformers.AutoModelForCausalLM.from_pretrained(base_dir, torch_dtype=torch.float32)
    base.eval()
    with torch.no_grad():
        plain = base(torch.tensor(ids, dtype=torch.long)).logits.numpy()
    model = PeftModel.from_pretrained(base, peft_dir)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy(), plain


def hf_logits(folder, ids):
    import torch
    import transformers

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(torch.tensor(ids, dtype=torch.long)).logits.numpy()


def mlx_logits(base_dir, adapter_dir, ids):
    from pathlib import Path

    import mlx.core as mx
    from mlx_lm.utils import load_adapters, load_model

    model, _ = load_model(Path(base_dir))
    if adapter_dir is not None:
        model = load_adapters(model, adapter_dir)
    model.eval()
    out = model(mx.array(np.asarray(ids, dtype=np.int32)))
    mx.eval(out)
    return np.array(out.astype(mx.float32))


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--finetune", default="build/examples/finetune/finetune")
    ap.add_argument("--work", default=None, help="keep the files here (default: a temporary folder)")
    args = ap.parse_args()
    from safetensors.numpy import load_file

    work = args.work or tempfile.mkdtemp(prefix="nn-interop-")
    os.makedirs(work, exist_ok=True)
    texts = corpus(400, 1)
    data = os.path.join(work, "data")
    os.makedirs(data, exist_ok=True)
    with open(os.path.join(data, "train.jsonl"), "w") as f:
        for t in texts[:360]:
            f.write(json.dumps({"text": t}) + "\n")
    with open(os.path.join(data, "valid.jsonl"), "w") as f:
        for t in texts[360:]:
            f.write(json.dumps({"text": t}) + "\n")

    worst, rows = 0.0, []
    for arch in ("llama", "qwen2"):
        base = os.path.join(work, arch)
        make_model(base, arch, texts)
        q4 = base + "-q4"
        shutil.rmtree(q4, ignore_errors=True)
        from mlx_lm import convert
        convert(base, q4, quantize=True, dtype="float32")
        dora = ["--fine-tune-type", "dora"]
        for variant, extra in (("lora", []), ("rslora", ["--rslora", "--dropout", "0.1"]), ("qlora-4bit", []),
                               ("dora", dora), ("qdora-4bit", dora)):
            quantized = variant.startswith("q")
            model_dir = q4 if quantized else base
            out = os.path.join(work, f"{arch}-{variant}")
            shutil.rmtree(out, ignore_errors=True)
            cmd = [args.finetune, "--model", model_dir, "--data", data, "--iters", "12", "--batch", "4", "--seq", "24",
                   "--lr", "3e-2", "--schedule", "constant", "--rank", "4", "--scale", "2",
                   "--keys", "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj", "--val-every", "0",
                   "--save-every", "0", "--num-layers", "-1", "--mask-prompt", "--adapter-path", out, "--prompt", "The wise son shall hear instruction",
                   "--max-tokens", "0", "--logits-out", os.path.join(out, "logits.safetensors"),
                   "--fuse", os.path.join(out, "fused"), "--threads", "1"] + extra
            subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
            ours = load_file(os.path.join(out, "logits.safetensors"))
            ids, mine = ours["ids"].astype(np.int64), ours["logits"]
            m = mlx_logits(model_dir, out, ids)
            fz = hf_logits(os.path.join(out, "fused"), ids)
            if quantized:  # PEFT does not read mlx-lm's quantized layers: mlx-lm and the fused folder only
                plain = mlx_logits(model_dir, None, ids)
                errs = {"PEFT": float("nan"), "mlx-lm": rel(m, mine), "fused (transformers)": rel(fz, mine)}
            else:
                p, plain = peft_logits(base, os.path.join(out, "peft"), ids)
                errs = {"PEFT": rel(p, mine), "mlx-lm": rel(m, mine), "fused (transformers)": rel(fz, mine)}
            moved = rel(plain, mine)
            rows.append((arch, variant, ids.shape[1], moved, errs))
            worst = max(worst, *(e for e in errs.values() if e == e))
            if moved < 1e-2:
                print(f"{arch} {variant}: the adapters moved the logits by only {moved:.1e}", file=sys.stderr)
                worst = max(worst, 1.0)

    print("| model | adapter | tokens | adapters move logits by | PEFT | mlx-lm | fused in transformers |")
    print("|---|---|---|---|---|---|---|")
    for arch, variant, t, moved, e in rows:
        peft_cell = f"{e['PEFT']:.1e}" if e["PEFT"] == e["PEFT"] else "n/a"
        print(f"| {arch} | {variant} | {t} | {moved:.2e} | {peft_cell} | {e['mlx-lm']:.1e} | "
              f"{e['fused (transformers)']:.1e} |")
    import mlx.core as mx
    import peft
    import torch
    import transformers
    print(f"\ntorch {torch.__version__}, transformers {transformers.__version__}, peft {peft.__version__}, "
          f"mlx {mx.__version__}; files in {work}")
    ok = worst <= 1e-4
    print("interop: ok" if ok else f"interop: FAILED (worst {worst:.2e} > 1e-4)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
