#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Causal attention forward + backward at long context, side by side: nn's flash_attention, nn's
# probabilities kernel (bench_attention) and PyTorch's scaled_dot_product_attention
# (attention_torch.py), at 1 and 2 threads: time per call, ratio, peak RSS per case.
#
#   bench/run_attention.sh [BUILD_DIR] [--threads "1 2"] [--t 256,1024,4096] [--seconds S] [--python PY]
#
# BUILD_DIR (default build) holds bench/bench_attention. PY (default $NN_BENCH_PYTHON, else
# python3) must import torch (2.5 or later: enable_gqa).
set -euo pipefail

here="$(cd "$(dirname "$0")" && pwd)"
build=build threads="1 2" ts=256,1024,4096 seconds=2
py="${NN_BENCH_PYTHON:-python3}"
while [ $# -gt 0 ]; do
  case "$1" in
    --threads) threads="$2"; shift 2 ;;
    --t) ts="$2"; shift 2 ;;
    --seconds) seconds="$2"; shift 2 ;;
    --python) py="$2"; shift 2 ;;
    -h|--help) sed -n '3,10p' "$0"; exit 0 ;;
    *) build="$1"; shift ;;
  esac
done
nn_bin="$build/bench/bench_attention"
[ -x "$nn_bin" ] || { echo "no $nn_bin: build the bench_attention target first" >&2; exit 2; }
"$py" -c "import torch" 2>/dev/null || { echo "$py cannot import torch (set --python or NN_BENCH_PYTHON)" >&2; exit 2; }

unset OMP_WAIT_POLICY
field() { sed -n "s/.* $1=\([^ ]*\).*/\1/p" <<<"$2"; }
row() { grep "^RESULT kernel=$1 T=$2 " <<<"$3"; }
echo "load average before: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "causal attention fwd + bwd, H 9 / KV 3, head_dim 64, B * T = 4096 tokens, float32 (ms per call, median)"
echo
echo "| T | threads | nn flash ms | nn probabilities ms | PyTorch sdpa ms | flash vs PyTorch | peak RSS flash / probabilities / PyTorch MB |"
echo "|---|---|---|---|---|---|---|"
for t in $threads; do
  nn=$(OMP_NUM_THREADS=$t "$nn_bin" --threads "$t" --seconds "$seconds" --t "$ts")
  cpu=$(grep -m1 '^# cpu:' <<<"$nn" | sed 's/^# //')
  th=$(OMP_NUM_THREADS=$t "$py" "$here/attention_torch.py" --threads "$t" --seconds "$seconds" --t "$ts")
  for T in ${ts//,/ }; do
    f=$(row flash "$T" "$nn") p=$(row probabilities "$T" "$nn") q=$(row torch "$T" "$th")
    printf '| %s | %s | %.1f | %.1f | %.1f | %.2fx | %s / %s / %s |\n' "$T" "$t" "$(field step_ms "$f")" \
      "$(field step_ms "$p")" "$(field step_ms "$q")" "$(awk "BEGIN{print $(field step_ms "$q")/$(field step_ms "$f")}")" \
      "$(field peak_mb "$f")" "$(field peak_mb "$p")" "$(field peak_mb "$q")"
  done
done
echo
echo "$cpu"
echo "PyTorch: $(field version "$(grep -m1 '^RESULT' <<<"$th")")"
echo "load average after: $(cut -d' ' -f1-3 /proc/loadavg)"
