#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Builds the safetensors reader's libFuzzer harness (clang++, ASan + UBSan) and runs it for a
# bounded time from a seed corpus (the committed fixtures plus a few hand-made headers).
#
#   tests/fuzz/run.sh [seconds=60] [extra libFuzzer flags...]
#   NN_FUZZ_DIR=<dir> (default build-fuzz/)  CXX_FUZZ=<clang++> (default clang++)
#
# Prints libFuzzer's final stats (stat::number_of_executed_units is the exec count); exits non-zero
# and leaves crash-*/leak-*/timeout-* inputs in NN_FUZZ_DIR if it finds a crash.
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
seconds=${1:-60}
shift || true
out=${NN_FUZZ_DIR:-$root/build-fuzz}
cxx=${CXX_FUZZ:-clang++}
mkdir -p "$out/corpus" "$out/seeds"

# nlohmann/json is header-only and found on the default include path (Debian: nlohmann-json3-dev);
# add -I<dir> through NN_FUZZ_CXXFLAGS when it lives elsewhere.
"$cxx" -std=c++20 -g -O1 -fno-omit-frame-pointer \
  -fsanitize=fuzzer,address,undefined -fno-sanitize-recover=undefined \
  -I"$root/include" ${NN_FUZZ_CXXFLAGS:-} \
  "$root/tests/fuzz/safetensors_fuzz.cpp" -o "$out/safetensors_fuzz"

# Seeds: files from Python's safetensors and MLX, and headers at the edges of the rules.
cp "$root"/tests/fixtures/io/*.safetensors "$out/seeds/"
export LC_ALL=C  # so that ${#2} below counts bytes
seed() {  # seed <name> <header JSON> [data, printf escapes]: writes the 8-byte length itself
  local n=${#2}
  printf "$(printf '\\x%02x\\x%02x\\x%02x\\x%02x\\x00\\x00\\x00\\x00' $((n & 255)) $((n >> 8 & 255)) \
    $((n >> 16 & 255)) $((n >> 24 & 255)))" > "$out/seeds/$1"
  printf '%s' "$2" >> "$out/seeds/$1"
  printf "${3:-}" >> "$out/seeds/$1"
}
seed empty '{}      '
seed meta '{"__metadata__":{"a":"b","format":"mlx"}}'
seed one '{"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}' '\x00\x00\x80\x3f'
seed zero '{"e":{"dtype":"BF16","shape":[0,3],"data_offsets":[0,0],"x":{"k":[{}]}}}'
seed two '{"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"a":{"dtype":"F4","shape":[4],"data_offsets":[0,2]}}' 'abcd'

"$out/safetensors_fuzz" -max_total_time="$seconds" -timeout=10 -rss_limit_mb=2048 \
  -dict="$root/tests/fuzz/safetensors.dict" -print_final_stats=1 -artifact_prefix="$out/" \
  "$@" "$out/corpus" "$out/seeds"
