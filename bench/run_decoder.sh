#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Runs the reference workload (bench/decoder.cpp and bench/decoder_torch.py) side by side, at 1
# and 2 threads, and prints one table: tokens/s of nn and PyTorch, their ratio, GFLOP/s against
# this machine's measured FMA peak, and each side's peak RSS.
#
#   bench/run_decoder.sh [BUILD_DIR] [--modes "full lora forward"] [--threads "1 2"] [--steps N]
#                        [--python PY] [--sdpa] [--nn-wait POLICY] [--torch-wait POLICY]
#
# BUILD_DIR (default build) holds bench/bench_decoder. PY (default $NN_BENCH_PYTHON, else python3)
# must import torch. Each run is its own process (so each peak RSS is that workload's own). Both
# sides run with libgomp's default OpenMP wait policy (threads spin briefly, then sleep), measured
# best for each here: with OMP_WAIT_POLICY=PASSIVE PyTorch 2.15's 2-thread steps ran 10-25% slower
# (unlike PyTorch 1.13's in REFERENCE-FACTS, which needed it) and nn's 5-10% slower.
# --nn-wait / --torch-wait set either side's (PASSIVE, ACTIVE or default). --sdpa adds PyTorch
# with F.scaled_dot_product_attention as a further column. Timings mean something only on an
# idle machine: the load average is printed before and after.
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
build="build"
modes="full lora forward"
threads="1 2"
steps=10
py="${NN_BENCH_PYTHON:-python3}"
sdpa=0
nn_wait=default
torch_wait=default
while [ $# -gt 0 ]; do
  case "$1" in
    --modes) modes="$2"; shift 2 ;;
    --threads) threads="$2"; shift 2 ;;
    --steps) steps="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    --sdpa) sdpa=1; shift ;;
    --nn-wait) nn_wait="$2"; shift 2 ;;
    --torch-wait) torch_wait="$2"; shift 2 ;;
    -h|--help) sed -n '3,16p' "$0"; exit 0 ;;
    *) build="$1"; shift ;;
  esac
done
nn_bin="$build/bench/bench_decoder"
[ -x "$nn_bin" ] || { echo "no $nn_bin: build the bench_decoder target first" >&2; exit 2; }
"$py" -c "import torch" 2>/dev/null || { echo "$py cannot import torch (set --python or NN_BENCH_PYTHON)" >&2; exit 2; }

# run_nn / run_torch CMD...: the command under that side's OpenMP wait policy
with_wait() { local pol=$1; shift; if [ "$pol" = default ]; then env -u OMP_WAIT_POLICY "$@"; else OMP_WAIT_POLICY="$pol" "$@"; fi; }
run_nn() { with_wait "$nn_wait" "$@"; }
run_torch() { with_wait "$torch_wait" "$@"; }
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }

echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
"$nn_bin" --peak --threads 1 >/dev/null  # warm-up
declare -A peak
for t in $threads; do
  peak[$t]=$(field gflops "$("$nn_bin" --peak --threads "$t")")
done
torch_version=$("$py" -c "import torch; print(torch.__version__)")
echo "PyTorch $torch_version ($py); nn $("$nn_bin" --mode forward --steps 1 --warmup 1 | sed -n 's/.* gemm=\([^ ]*\).*/\1/p') GEMM"
echo "OpenMP wait policy: nn $nn_wait, PyTorch $torch_wait"
echo "FMA peak (measured): $(for t in $threads; do printf '%s thread(s) %s GFLOP/s  ' "$t" "${peak[$t]}"; done)"
echo
header="| mode | threads | nn tok/s | torch tok/s | ratio | nn GFLOP/s (% peak) | torch GFLOP/s (% peak) | nn peak RSS MB | torch peak RSS MB |"
[ "$sdpa" = 1 ] && header="$header torch sdpa tok/s | ratio vs sdpa |"
echo "$header"
echo "$header" | sed 's/[^|]/-/g'
for mode in $modes; do
  for t in $threads; do
    nn=$(OMP_NUM_THREADS=$t run_nn "$nn_bin" --mode "$mode" --threads "$t" --steps "$steps" | grep '^RESULT')
    th=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t run_torch "$py" "$here/decoder_torch.py" --mode "$mode" --threads "$t" --steps "$steps" | grep '^RESULT')
    nt=$(field tok_s "$nn"); tt=$(field tok_s "$th")
    ng=$(field gflops "$nn"); tg=$(field gflops "$th")
    row=$(awk -v m="$mode" -v t="$t" -v nt="$nt" -v tt="$tt" -v ng="$ng" -v tg="$tg" -v p="${peak[$t]}" \
          -v nr="$(field rss_peak_mb "$nn")" -v tr="$(field rss_peak_mb "$th")" \
          'BEGIN { printf "| %s | %s | %.0f | %.0f | %.2fx | %.1f (%.0f%%) | %.1f (%.0f%%) | %.0f | %.0f |", m, t, nt, tt, nt / tt, ng, 100 * ng / p, tg, 100 * tg / p, nr, tr }')
    if [ "$sdpa" = 1 ]; then
      ts=$(OMP_NUM_THREADS=$t MKL_NUM_THREADS=$t run_torch "$py" "$here/decoder_torch.py" --mode "$mode" --threads "$t" --steps "$steps" --attn sdpa | grep '^RESULT')
      row="$row $(awk -v nt="$nt" -v s="$(field tok_s "$ts")" 'BEGIN { printf " %.0f | %.2fx |", s, nt / s }')"
    fi
    echo "$row"
  done
done
echo
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "(tok/s: batch 4 x 256 tokens over the median step; GFLOP/s from the model's shapes, the same count for both;"
echo " peak RSS: VmHWM / ru_maxrss of the whole process, PyTorch's including its libraries)"
