#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# finetune_cuda's --device cuda against --device cpu: the same run (seed, data, flags) on both, 10
# steps with validations and a mid-run save (the model visits the host and the compiled step
# records again), for LoRA, QLoRA (LoRA over the 4-bit base), DoRA and a full finetune of the
# last layer; every training and validation loss in metrics.jsonl equal to 1e-4 relative; the
# device refusals of --grad-accumulation-steps and --pack said. The models and data are
# tiny_model.py's (a 2-layer random Llama, in float32 and mlx-lm's affine 4-bit; arithmetic
# prompts), made here in a second, so it runs on the GPU check's machine as is. Without a GPU it
# runs the CPU side once and checks the error --device cuda gives, then exits 77 (CTest's
# "skipped"); CI compiles finetune_cuda and runs this that way.
#   cuda_smoke.sh FINETUNE_CUDA WORK_DIR
set -euo pipefail
exe=$1
work=$2
src=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
fail() { echo "finetune cuda smoke: $*" >&2; exit 1; }
py=$(command -v python3 || command -v python) || fail "no python3"
rm -rf "$work" && mkdir -p "$work"
"$py" "$src/tiny_model.py" "$work" > /dev/null
args=(--model "$work/model" --data "$work/data" --batch-size 4 --max-seq-length 32 --seed 5 --learning-rate 1e-3
      --num-layers -1 --steps-per-report 1 --steps-per-eval 5 --val-batches 2 --save-every 5 --max-tokens 0 --no-peft --iters 10)
compare() {  # compare CPU_METRICS CUDA_METRICS NAME: every loss within 1e-4 relative
  "$py" - "$@" <<'EOF2'
import json, sys
def losses(path):
    out = {}
    for line in open(path):
        j = json.loads(line)
        for k in ("loss", "val_loss"):
            if k in j: out[(k, j["step"])] = j[k]
    return out
c, g = losses(sys.argv[1]), losses(sys.argv[2])
assert c.keys() == g.keys() and len(c) >= 13, (sorted(c), sorted(g))
worst = max(abs(c[k] - g[k]) / max(abs(c[k]), 1e-30) for k in c)
print(f"finetune cuda smoke {sys.argv[3]}: {len(c)} losses, worst relative difference {worst:.2e}")
assert worst <= 1e-4, worst
EOF2
}

if ! nvidia-smi -L > /dev/null 2>&1; then
  "$exe" "${args[@]}" --device cpu --adapter-path "$work/cpu" > "$work/cpu.log" 2>&1 || { tail -20 "$work/cpu.log" >&2; fail "--device cpu failed"; }
  grep -q "^device: cpu" "$work/cpu.log" || fail "the run did not say it trains on the cpu"
  compare "$work/cpu/metrics.jsonl" "$work/cpu/metrics.jsonl" "cpu against itself"
  if "$exe" "${args[@]}" --device cuda --adapter-path "$work/none" > "$work/nodev.log" 2>&1; then
    fail "--device cuda trained without a GPU"
  fi
  grep -q -- "--device cuda: no CUDA device" "$work/nodev.log" || { cat "$work/nodev.log" >&2; fail "the error does not say there is no CUDA device"; }
  echo "finetune cuda smoke: no GPU here; --device cuda said so (skipped)"
  exit 77
fi

for variant in lora qlora dora full; do
  extra=()
  case $variant in
    qlora) extra=(--model "$work/model-q4") ;;
    dora) extra=(--fine-tune-type dora) ;;
    full) extra=(--fine-tune-type full --num-layers 1) ;;
  esac
  for dev in cpu cuda; do
    "$exe" "${args[@]}" "${extra[@]}" --device "$dev" --adapter-path "$work/$variant-$dev" > "$work/$variant-$dev.log" 2>&1 ||
      { tail -20 "$work/$variant-$dev.log" >&2; fail "$variant --device $dev failed"; }
  done
  grep -q "^device: cuda" "$work/$variant-cuda.log" || fail "$variant: the run did not say it trains on cuda"
  compare "$work/$variant-cpu/metrics.jsonl" "$work/$variant-cuda/metrics.jsonl" "$variant"
done
expect_error() {  # expect_error PATTERN ARGS...
  local pat=$1; shift
  if "$exe" "$@" > "$work/err.log" 2>&1; then fail "accepted: $*"; fi
  grep -q -- "$pat" "$work/err.log" || { cat "$work/err.log" >&2; fail "the error for '$*' does not say '$pat'"; }
}
expect_error "accumulating runs on the CPU only" "${args[@]}" --device cuda --grad-accumulation-steps 2 --adapter-path "$work/acc"
expect_error "packed rows need the flash attention kernels" "${args[@]}" --device cuda --pack --adapter-path "$work/pack"
echo "finetune cuda smoke: ok"
