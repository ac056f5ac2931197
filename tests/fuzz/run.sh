#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Builds one of the libFuzzer harnesses of tests/fuzz/ (clang++, ASan + UBSan) and runs it for a
# bounded time from its seeds: the committed corpus (tests/fuzz/corpus/<name>/), the committed
# crash inputs (tests/fuzz/crashes/<name>/) and the test fixtures that fit the parser.
#
#   tests/fuzz/run.sh [name=safetensors] [seconds=60] [extra libFuzzer flags...]
#   tests/fuzz/run.sh 330                      (a number alone: safetensors for 330 s, as before)
#   tests/fuzz/run.sh gguf 0 -runs=1000000     (a million inputs, no time limit)
#   NN_FUZZ_DIR=<dir> (default build-fuzz/)  CXX_FUZZ=<clang++> (default clang++)
#
# Harnesses (<name>_fuzz.cpp; each file's header says what it checks): safetensors, gguf,
# tokenizer (tokenizer.json and GGUF tokenizer metadata, then encode/decode), config
# (config.json -> ModelConfig), jsonl (datasets), checkpoint (whole-run checkpoints, load_into),
# adapter_config (mlx-lm and PEFT adapter_config.json), chat_template (Jinja chat templates).
#
# tests/fuzz/make_seeds.py wrote the small hand-made seeds the committed corpus started from.
# NN_FUZZ_FIXTURES=1 adds the GGUF fixtures (16-94 KB, far slower per input) to gguf's seeds.
#
# Prints libFuzzer's final stats (stat::number_of_executed_units is the exec count); exits non-zero
# and leaves crash-*/leak-*/timeout-* inputs in NN_FUZZ_DIR/<name>/ if it finds a crash. New
# inputs go to NN_FUZZ_DIR/<name>/corpus. To refresh the committed corpus, minimised:
#   build-fuzz/<name>_fuzz -merge=1 <fresh dir> tests/fuzz/corpus/<name> build-fuzz/<name>/corpus
# then replace tests/fuzz/corpus/<name> by the fresh dir. Crash inputs, once fixed, are committed
# under tests/fuzz/crashes/<name>/. CTest's fuzz_replay runs every committed input through the same
# LLVMFuzzerTestOneInput entry points, built with the normal compiler (tests/fuzz/replay_main.cpp).
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
name=safetensors
if [[ $# -gt 0 && ! $1 =~ ^[0-9]+$ ]]; then name=$1; shift; fi
seconds=${1:-60}
shift || true
src="$root/tests/fuzz/${name}_fuzz.cpp"
[[ -f $src ]] || { echo "run.sh: no harness $src" >&2; exit 2; }
out=${NN_FUZZ_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}
work="$out/$name"
mkdir -p "$work/corpus" "$work/seeds"

# nlohmann/json is header-only and found on the default include path (Debian: nlohmann-json3-dev),
# Eigen (the checkpoint harness includes the whole library) in /usr/include/eigen3; add -I<dir>
# through NN_FUZZ_CXXFLAGS when they live elsewhere.
build() {  # build <source> <output> [flags]; skipped while <output> is newer than every source
  if [[ -x $2 && -z $(find "$root/include" "$root/tests/fuzz" \( -name '*.hpp' -o -name '*.cpp' \) -newer "$2" -print -quit) ]]; then
    return
  fi
  "$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer -fno-sanitize-recover=undefined \
    -I"$root/include" -I/usr/include/eigen3 ${NN_FUZZ_CXXFLAGS:-} "${@:3}" "$1" -o "$2"
}
build "$src" "$out/${name}_fuzz" -fsanitize=fuzzer,address,undefined

fixtures="$root/tests/fixtures"
flags=()
case $name in
  safetensors)
    # Seeds: files from Python's safetensors and MLX, and headers at the edges of the rules.
    cp "$fixtures"/io/*.safetensors "$work/seeds/"
    export LC_ALL=C  # so that ${#2} below counts bytes
    seed() {  # seed <name> <header JSON> [data, printf escapes]: writes the 8-byte length itself
      local n=${#2}
      printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' $((n & 255)) $((n >> 8 & 255)) \
        $((n >> 16 & 255)) $((n >> 24 & 255)))" > "$work/seeds/$1"
      printf '%s' "$2" >> "$work/seeds/$1"
      printf "${3:-}" >> "$work/seeds/$1"
    }
    seed empty '{}      '
    seed meta '{"__metadata__":{"a":"b","format":"mlx"}}'
    seed one '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' '\x00\x00\x80\x3f'
    seed zero '{"e":{"dtype":"BF16","shape":[0,3],"data_offsets":[0,0],"x":{"k":[{}]}}}'
    seed two '{"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}' 'abcd'
    ;;
  gguf)  # the committed corpus's small files (make_seeds.py); the fixtures (16-94 KB) run 100x slower
    [[ ${NN_FUZZ_FIXTURES:-0} == 1 ]] && cp "$fixtures"/lm/*.gguf "$fixtures"/lm/models/gguf/*.gguf "$work/seeds/" ;;
  tokenizer)  # the committed corpus's small tokenizers (make_seeds.py); the real ones are 50-360 KB
    flags+=(-max_len=4200) ;;  # inputs as large as those seeds: 16 KB ones ran 4x slower
  config)
    for d in "$fixtures"/lm/models/*/; do cp "$d/config.json" "$work/seeds/$(basename "$d").json" 2>/dev/null || true; done
    cp "$fixtures"/lm/strict/config_*.json "$work/seeds/" ;;
  jsonl) cp "$fixtures"/lm/strict/data_*.jsonl "$work/seeds/" ;;
  checkpoint)  # checkpoints of the harness's model, one per optimizer, written by its seed writer
    build "$src" "$out/checkpoint_seeds" -DNN_FUZZ_WRITE_SEEDS -fsanitize=address,undefined
    "$out/checkpoint_seeds" "$work/seeds" ;;
  adapter_config) ;;
  chat_template)  # the real templates of the chat-template fixtures (SmolLM2, Qwen2.5, Qwen3, Llama 3.x)
    cp "$fixtures"/lm/chat_templates/*.jinja "$work/seeds/"
    flags+=(-max_len=5000) ;;
esac
dict="$root/tests/fuzz/$name.dict"
[[ -f $dict ]] && flags+=(-dict="$dict")
dirs=("$work/corpus" "$work/seeds")
for d in "$root/tests/fuzz/corpus/$name" "$root/tests/fuzz/crashes/$name"; do [[ -d $d ]] && dirs+=("$d"); done

"$out/${name}_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 -print_final_stats=1 -print_funcs=0 \
  -artifact_prefix="$work/" "${flags[@]}" "$@" "${dirs[@]}"
