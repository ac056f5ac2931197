#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Runs the reference workload (bench/decoder.cpp and bench/decoder_torch.py) side by side, at 1
# and 2 threads, and prints one table: tokens/s of nn and PyTorch, their ratio, GFLOP/s against
# this machine's measured FMA peak, and each side's peak RSS.
#
#   bench/run_decoder.sh [BUILD_DIR] [--modes "full lora forward"] [--threads "1 2"] [--steps N]
#                        [--python PY] [--sdpa] [--compile] [--nn-wait POLICY] [--torch-wait POLICY]
#                        [--repeat N]
#                        [--precision f32|bf16]
#
# BUILD_DIR (default build) holds bench/bench_decoder. PY (default $NN_BENCH_PYTHON, else python3)
# must import torch. Each run is its own process (so each peak RSS is that workload's own). Both
# sides run with libgomp's default OpenMP wait policy (threads spin briefly, then sleep), measured
# best for each here: with OMP_WAIT_POLICY=PASSIVE PyTorch 2.15's 2-thread steps ran 10-25% slower
# (unlike PyTorch 1.13's in REFERENCE-FACTS, which needed it) and nn's 5-10% slower.
# --nn-wait / --torch-wait set either side's (PASSIVE, ACTIVE or default). --sdpa adds PyTorch
# with F.scaled_dot_product_attention as a further column, --compile PyTorch under torch.compile
# (Inductor; compiled in untimed warm-up steps). --repeat N (default 1) runs each cell
# as N back-to-back nn/PyTorch pairs and prints the medians: tokens/s, GFLOP/s and RSS per side,
# and the median of the N pair ratios with their range (a 2-vCPU VM drifts by up to 15% between
# runs; a pair shares the conditions of its moment). --precision bf16: nn with its frozen weights in
# bfloat16 (the LoRA base; every weight in forward mode; none in the full step) against PyTorch
# under torch.autocast("cpu", dtype=torch.bfloat16). Timings mean something only on an idle
# machine: the load average is printed before and after.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
build="build"
modes="full lora forward"
threads="1 2"
steps=10
py="${NN_BENCH_PYTHON:-python3}"
sdpa=0
compile=0
nn_wait=default
torch_wait=default
repeat=1
precision=f32
while [ $# -gt 0 ]; do
  case "$1" in
    --modes) modes="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --sdpa) sdpa=1; shift ;;
    --compile) compile=1; shift ;;
    --nn-wait) nn_wait="$2"; shift 2 ;;
    --torch-wait) torch_wait="$2"; shift 2 ;;
    --repeat) repeat="$2"; shift 2 ;;
    --precision) precision="$2"; shift 2 ;;
    -h|--help) sed -n '3,19p' "$0"; exit 0 ;;
    *) build="$1"; shift ;;
  esac
done
[[ "$repeat" =~ ^[1-9][0-9]*$ ]] || { echo "--repeat needs a positive whole number, got '$repeat'" >&2; exit 2; }
nn_bin="$build/bench/bench_decoder"
[ -x "$nn_bin" ] || { echo "no $nn_bin: build the bench_decoder target first" >&2; exit 2; }
"$py" -c "import torch" 2>/dev/null || { echo "$py cannot import torch (set --python or NN_BENCH_PYTHON)" >&2; exit 2; }

# run_nn / run_torch CMD...: the command under that side's OpenMP wait policy
with_wait() { local pol=$1; shift; if [ "$pol" = default ]; then env -u OMP_WAIT_POLICY "$@"; else OMP_WAIT_POLICY="$pol" "$@"; fi; }
run_nn() { with_wait "$nn_wait" "$@"; }
run_torch() { with_wait "$torch_wait" "$@"; }
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }
# median of the numbers given as arguments
median() { printf '%s\n' "$@" | sort -g | awk '{ v[NR] = $1 } END { print (NR % 2) ? v[(NR + 1) / 2] : (v[NR / 2] + v[NR / 2 + 1]) / 2 }'; }

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$nn_bin" --peak --threads 1 >/dev/null  # warm-up
declare -A peak
for t in $threads; do
  peak[$t]=$(field gflops "$("$nn_bin" --peak --threads "$t")")
done
torch_version=$("$py" -c "import torch; print(torch.__version__)")
probe=$("$nn_bin" --mode forward --steps 1 --warmup 1)
grep -m1 '^# cpu:' <<<"$probe" | sed 's/^# //'
echo "PyTorch $torch_version ($py); nn $(sed -n 's/.* gemm=\([^ ]*\).*/\1/p' <<<"$probe") GEMM"
echo "OpenMP wait policy: nn $nn_wait, PyTorch $torch_wait; precision $precision (bf16: nn's frozen weights in bfloat16, PyTorch under torch.autocast)"
echo "FMA peak (measured): $(for t in $threads; do printf '%s thread(s) %s GFLOP/s  ' "$t" "${peak[$t]}"; done)"
echo
header="| mode | threads | nn tok/s | torch tok/s | ratio | nn GFLOP/s (% peak) | torch GFLOP/s (% peak) | nn peak RSS MB | torch peak RSS MB |"
[ "$sdpa" = 1 ] && header="$header torch sdpa tok/s | ratio vs sdpa |"
[ "$compile" = 1 ] && header="$header torch.compile tok/s | ratio vs compile |"
echo "$header"
echo "$header" | sed 's/[^|]/-/g'
for mode in $modes; do
  for t in $threads; do
    declare -a nts=() tts=() ngs=() tgs=() nrs=() trs=() ratios=()
    for ((r = 0; r < repeat; r++)); do
      nn=$(OMP_NUM_THREADS=$t run_nn "$nn_bin" --mode "$mode" --threads "$t" --steps "$steps" --precision "$precision" | grep '^RESULT')
      th=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t run_torch "$py" "$here/decoder_torch.py" --mode "$mode" --threads "$t" --steps "$steps" --precision "$precision" | grep '^RESULT')
      nts+=("$(field tok_s "$nn")"); tts+=("$(field tok_s "$th")")
      ngs+=("$(field gflops "$nn")"); tgs+=("$(field gflops "$th")")
      nrs+=("$(field rss_peak_mb "$nn")"); trs+=("$(field rss_peak_mb "$th")")
      ratios+=("$(awk -v a="${nts[-1]}" -v b="${tts[-1]}" 'BEGIN { printf "%.4f", a / b }')")
    done
    nt=$(median "${nts[@]}"); tt=$(median "${tts[@]}"); ratio=$(median "${ratios[@]}")
    ng=$(median "${ngs[@]}"); tg=$(median "${tgs[@]}")
    range=""
    [ "$repeat" -gt 1 ] && range=$(printf '%s\n' "${ratios[@]}" | sort -g | awk 'NR == 1 { lo = $1 } { hi = $1 } END { printf " (%.2f-%.2f)", lo, hi }')
    row=$(awk -v m="$mode" -v t="$t" -v nt="$nt" -v tt="$tt" -v r="$ratio" -v rg="$range" -v ng="$ng" -v tg="$tg" -v p="${peak[$t]}" \
          -v nr="$(median "${nrs[@]}")" -v tr="$(median "${trs[@]}")" \
          'BEGIN { printf "| %s | %s | %.0f | %.0f | %.2fx%s | %.1f (%.0f%%) | %.1f (%.0f%%) | %.0f | %.0f |", m, t, nt, tt, r, rg, ng, 100 * ng / p, tg, 100 * tg / p, nr, tr }')
    if [ "$sdpa" = 1 ]; then
      ts=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t run_torch "$py" "$here/decoder_torch.py" --mode "$mode" --threads "$t" --steps "$steps" --attn sdpa | grep '^RESULT')
      row="$row $(awk -v nt="$nt" -v s="$(field tok_s "$ts")" 'BEGIN { printf " %.0f | %.2fx |", s, nt / s }')"
    fi
    if [ "$compile" = 1 ]; then
      tc=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t run_torch "$py" "$here/decoder_torch.py" --mode "$mode" --threads "$t" --steps "$steps" --precision "$precision" --compile | grep '^RESULT')
      row="$row $(awk -v nt="$nt" -v s="$(field tok_s "$tc")" 'BEGIN { printf " %.0f | %.2fx |", s, nt / s }')"
    fi
    echo "$row"
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
[ "$repeat" -gt 1 ] && echo "(each cell: the medians of $repeat back-to-back nn/PyTorch pairs; ratio: the median pair ratio, its range in brackets)"
echo "(tok/s: batch 4 x 256 tokens over the median step; GFLOP/s from the model's shapes, the same count for both;"
echo " peak RSS: VmHWM / ru_maxrss of the whole process, PyTorch's including its libraries)"
