#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Builds test areas with AddressSanitizer + UndefinedBehaviorSanitizer (-O1 -g) in their own
# build folder and runs them: any report fails the run (UBSan does not recover; ASan checks leaks).
#
#   bash tools/sanitize.sh [build-dir=build-asan] [area...]     (default areas: io lm core modules optim)
#
# CI runs the io and core areas (the five take about 20 minutes to build on two cores; `lm` is
# the longest); run all five before a change to a loader.
set -euo pipefail
root=$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)
dir=${1:-$root/build-asan}
shift || true
areas=("$@")
((${#areas[@]})) || areas=(io lm core modules optim)

flags="-O1 -g -fno-omit-frame-pointer -fsanitize=address,undefined -fno-sanitize-recover=undefined"
cmake -S "$root" -B "$dir" -DCMAKE_BUILD_TYPE=None -DCMAKE_CXX_FLAGS="$flags" \
  -DCMAKE_EXE_LINKER_FLAGS="-fsanitize=address,undefined" -DNN_BUILD_EXAMPLES=OFF -DNN_BUILD_BENCH=OFF \
  -DNN_WITH_CUDA=OFF -DNN_INSTALL=OFF -DNN_TEST_AREAS="$(IFS=';'; echo "${areas[*]}")" >/dev/null
start=$SECONDS
# one goal (tests/CMakeLists.txt): the areas, one unity source each, build side by side
cmake --build "$dir" -j"${NN_SANITIZE_JOBS:-2}" --target test_areas
built=$((SECONDS - start))

# allocator_may_return_null: a loader's refusal of a terabyte-sized model is an nn::Error, which
# ASan would otherwise turn into an abort before the allocator could return null.
export ASAN_OPTIONS=${ASAN_OPTIONS:-allocator_may_return_null=1:detect_leaks=1:abort_on_error=1}
export UBSAN_OPTIONS=${UBSAN_OPTIONS:-print_stacktrace=1:halt_on_error=1}
regex="^($(IFS='|'; echo "${areas[*]}"))\$"
ctest --test-dir "$dir" -R "$regex" -j"${NN_SANITIZE_JOBS:-2}" --output-on-failure --timeout 1800
echo "sanitize: ${areas[*]} clean under ASan+UBSan (build ${built} s, run $((SECONDS - start - built)) s)"
