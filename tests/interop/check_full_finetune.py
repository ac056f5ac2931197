#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Development check (not CI) of `finetune --fine-tune-type full`: a short full finetune of the
last layers of SmolLM2-135M (the main job's Q4_1 GGUF, loaded dequantized) is read back by
  1. transformers, from the Hugging Face folder `--fuse` writes, and
  2. mlx-lm, from the adapter folder (adapters.safetensors + adapter_config.json with
     fine_tune_type full) over the untrained base written the same way (`--learning-rate 0`),
and each one's logits on the prompt's ids are compared with the logits nn wrote (--logits-out).

  pip install torch transformers safetensors numpy mlx[cpu] mlx-lm
  python3 tests/interop/check_full_finetune.py --finetune build/examples/finetune/finetune \
      --model SmolLM2-135M-Instruct.Q4_1.gguf --data build/finetune-data [--work /tmp/nn_full]
"""
import argparse
import os
import subprocess
import sys

import numpy as np
from safetensors.numpy import load_file


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--finetune", required=True)
    ap.add_argument("--model", required=True)
    ap.add_argument("--data", required=True)
    ap.add_argument("--work", default="/tmp/nn_full")
    args = ap.parse_args()
    w = args.work
    common = [args.finetune, "--model", args.model, "--data", args.data, "--fine-tune-type", "full",
              "--num-layers", "2", "--seq", "64", "--val-batches", "1", "--steps-per-eval", "0",
              "--prompt", "Recite Proverbs 3:5 from the King James Bible.", "--max-tokens", "0"]
    subprocess.run(common + ["--iters", "3", "--learning-rate", "1e-4", "--adapter-path", f"{w}/run",
                             "--fuse", f"{w}/trained-hf", "--logits-out", f"{w}/nn.safetensors"],
                   check=True, stdout=subprocess.DEVNULL)
    subprocess.run(common + ["--iters", "1", "--learning-rate", "0", "--adapter-path", f"{w}/base-run",
                             "--fuse", f"{w}/base-hf"], check=True, stdout=subprocess.DEVNULL)
    ours = load_file(f"{w}/nn.safetensors")
    ids, mine = ours["ids"].astype(np.int64), ours["logits"].astype(np.float64)
    scale = np.abs(mine).max()
    status = 0

    import torch
    import transformers
    hf = transformers.AutoModelForCausalLM.from_pretrained(f"{w}/trained-hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        theirs = hf(input_ids=torch.from_numpy(ids)).logits.double().numpy()
    d = np.abs(theirs - mine).max() / scale
    print(f"transformers, the --fuse folder: max |diff| / max |logit| = {d:.2e}")
    status |= d > 1e-4
    base = transformers.AutoModelForCausalLM.from_pretrained(f"{w}/base-hf", torch_dtype=torch.float32).eval()
    with torch.no_grad():
        moved = np.abs(base(input_ids=torch.from_numpy(ids)).logits.double().numpy() - mine).max() / scale
    print(f"(the untrained base differs by {moved:.2e}: the comparisons can fail)")
    status |= moved < 1e-2

    import mlx.core as mx
    from mlx_lm.tuner.utils import load_adapters
    from mlx_lm.utils import load_model
    from pathlib import Path
    model, _ = load_model(Path(f"{w}/base-hf"))
    model = load_adapters(model, f"{w}/run")
    theirs = np.array(model(mx.array(ids.astype(np.int32))).astype(mx.float32)).astype(np.float64)
    d = np.abs(theirs - mine).max() / scale
    print(f"mlx-lm, base + the adapter folder (fine_tune_type full): max |diff| / max |logit| = {d:.2e}")
    status |= d > 1e-4
    sys.exit(int(status))


if __name__ == "__main__":
    main()
