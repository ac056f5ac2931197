#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The reference decoder on a GPU, nn against PyTorch in one run: bench_decoder_cuda (nn's compiled
# step on GTape<nn::cuda>) beside bench/decoder_torch.py --device cuda --size gpu, eager and under
# torch.compile, for the full AdamW step and the LoRA step in f32 and bf16 (batch 8 x 1024), and
# nn's cuBLAS f32 product on an 8192 square as the rate the steps are read against. Prints a
# Markdown table: tokens/s, the ratios, and nn's TFLOP/s as a share of that GEMM rate.
#
#   bash bench/run_decoder_cuda.sh BENCH_DECODER_CUDA [--python PY] [--steps N] [--no-compile]
#
# torch.compile runs for f32 only unless NN_BENCH_COMPILE_BF16=1 (each compilation takes about a
# minute; the GPU check's lease is short). A step nn cannot run prints its error in the table.
set -uo pipefail
exe=${1:?usage: run_decoder_cuda.sh BENCH_DECODER_CUDA [--python PY] [--steps N] [--no-compile]}
shift
py=python3
steps=10
compile=1
while [ $# -gt 0 ]; do
  case $1 in
    --python) py=$2; shift 2 ;;
    --steps) steps=$2; shift 2 ;;
    --no-compile) compile=0; shift ;;
    *) echo "run_decoder_cuda: unknown option $1" >&2; exit 2 ;;
  esac
done
here=$(cd "$(dirname "$0")" && pwd)
out=$(mktemp)
trap 'rm -f "$out"' EXIT
lscpu 2>/dev/null | grep -m1 "Model name" | sed 's/^/# host /'
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader 2>/dev/null | sed 's/^/# gpu /'
"$exe" --gemm >> "$out" 2>&1
for mode in full lora; do
  for prec in f32 bf16; do
    "$exe" --mode "$mode" --precision "$prec" --steps "$steps" >> "$out" 2>&1
    "$py" "$here/decoder_torch.py" --device cuda --size gpu --batch 8 --seq 1024 --mode "$mode" --precision "$prec" \
      --steps "$steps" >> "$out" 2>&1 || echo "RESULT impl=torch mode=$mode precision=$prec compile=0 error=\"exit $?\"" >> "$out"
    if [ $compile = 1 ] && { [ "$prec" = f32 ] || [ "${NN_BENCH_COMPILE_BF16:-0}" = 1 ]; }; then
      "$py" "$here/decoder_torch.py" --device cuda --size gpu --batch 8 --seq 1024 --mode "$mode" --precision "$prec" \
        --steps "$steps" --compile >> "$out" 2>&1 || echo "RESULT impl=torch mode=$mode precision=$prec compile=1 error=\"exit $?\"" >> "$out"
    fi
  done
done
grep -v '^RESULT' "$out" | grep -i "error\|Traceback" | head -20
"$py" - "$out" <<'EOF'
import re, sys
rows = []
for line in open(sys.argv[1]):
    if line.startswith("RESULT "):
        rows.append(dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line[7:])))
def find(**kw):
    for r in rows:
        if all(r.get(k) == v for k, v in kw.items()):
            return r
    return None
gemm = find(impl="nn", mode="gemm")
peak = float(gemm["tflops"]) if gemm and "tflops" in gemm else float("nan")
print(f"\nnn's cuBLAS f32 product, 8192 x 8192 x 8192: {peak:.1f} TFLOP/s\n")
print("| step | precision | nn tok/s | PyTorch eager tok/s | nn / eager | torch.compile tok/s | nn / compile | nn TFLOP/s | of GEMM f32 |")
print("|---|---|---|---|---|---|---|---|---|")
def tok(r):
    return float(r["tok_s"]) if r and "tok_s" in r else None
for mode in ("full", "lora"):
    for prec in ("f32", "bf16"):
        n = find(impl="nn", mode=mode, precision=prec)
        e = find(impl="torch", mode=mode, precision=prec, compile="0")
        c = find(impl="torch", mode=mode, precision=prec, compile="1")
        tn, te, tc = tok(n), tok(e), tok(c)
        cell = lambda t, r: f"{t:.0f}" if t else (r.get("error", "failed") if r else "not run")
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"
        tf = float(n["tflops"]) if n and "tflops" in n else None
        print(f"| {mode} | {prec} | {cell(tn, n)} | {cell(te, e)} | {ratio(tn, te)} | {cell(tc, c)} | {ratio(tn, tc)} | "
              f"{tf:.1f} | {tf / peak:.0%} |" if tf else
              f"| {mode} | {prec} | {cell(tn, n)} | {cell(te, e)} | {ratio(tn, te)} | {cell(tc, c)} | {ratio(tn, tc)} | - | - |")
EOF
