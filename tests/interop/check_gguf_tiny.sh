#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Development check (not CI): the tiny random Llama (untied head), Qwen2 (tied head) and Phi-3
# (fused attn_qkv / ffn_up) models, finetuned by nn with LoRA on every projection (q/k included,
# whose rows llama.cpp permutes for Llama), exported as GGUF (f16, q8_0, q4_k_m) and as a GGUF
# adapter (not Phi-3: nn refuses it, see save_gguf_adapter), and run by llama.cpp
# (tests/interop/check_gguf.py's checks) -- once from the GGUF files, once from the same models as
# Hugging Face folders (metadata and tokenizer built from config.json / tokenizer.json).
#   pip install gguf numpy safetensors "llama-cpp-python>=0.3,<0.4"
#   bash tests/interop/check_gguf_tiny.sh [BUILD_DIR] [OUT_DIR]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
out=${2:-/tmp/nn_gguf_tiny}
cmake --build "$build" -j2 --target finetune >/dev/null
python3 tests/interop/make_tiny_gguf.py "$out"
ft="$build/examples/finetune/finetune"
status=0
for src in llama qwen2 phi3 hf-llama hf-qwen2 hf-phi3; do
  arch=$src
  d="$out/$arch"
  mkdir -p "$d"
  model="$out/$arch.gguf"
  [[ $src == hf-* ]] && model="$out/$src"
  common=(--model "$model" --data "$out/data" --iters 40 --batch 4 --seq 16 --lr 1e-2 --rank 4
          --scale 2 --keys q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj --val-every 0
          --save-every 40 --adapter-path "$d/run" --no-peft --seed 1 --num-layers -1 --mask-prompt)
  adapter=(--export-adapter "$d/adapter.gguf")
  check=()
  [[ $src == *phi3 ]] && adapter=() && check=(--no-adapter)
  "$ft" "${common[@]}" --prompt "the cat sat on" --max-tokens 8 --fuse "$d/fused-f16.gguf" --outtype f16 \
    "${adapter[@]}" --logits-out "$d/nn-logits.safetensors" | grep -E "Iter 40:|fused|adapter written"
  for o in q8_0 q4_k_m; do
    "$ft" "${common[@]}" --resume --fuse "$d/fused-$o.gguf" --outtype "$o" | grep -E "fused"
  done
  "$ft" --model "$model" --data "$out/data" --iters 1 --lr 0 --batch 4 --seq 16 --val-every 0 --num-layers -1 \
    --adapter-path "$d/base-run" --no-peft --fuse "$d/base-f16.gguf" --outtype f16 | grep -E "fused"
  echo "== $arch"
  base="$model"
  [[ $src == hf-* ]] && base="$d/base-f16.gguf"
  python3 tests/interop/check_gguf.py --base "$base" --dir "$d" "${check[@]}" || status=1
done
exit $status
