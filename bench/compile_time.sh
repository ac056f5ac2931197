#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Compile time of two programs against <nn/nn.hpp>, at -O0 and -O2 (and -fsyntax-only): a 2-layer
# MLP trained by a compiled step (bench/compile_time/mlp_step.cpp, core only) and the README's API
# tour (tests/core/readme_tour.test.cpp), each as a header-only library compiles it and again
# with -DNN_PRECOMPILED (the common CPU code comes from nn::precompiled, include/nn/precompiled.hpp),
# plus that library's one source, which a program compiles once. Prints CPU seconds (user + sys)
# per compile, one translation unit each, as a user's build pays them; run on an idle machine.
#
#   bash bench/compile_time.sh [CXX]        (also: cmake --build build --target compile_time)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
cxx="${1:-${CXX:-g++}}"
base=(-std=c++20 -fopenmp -Iinclude -Itests -I/usr/include/eigen3 -DNN_FIXTURES_DIR=\"tests/fixtures\")
cpu=$(lscpu | sed -n 's/^Model name: *//p' | head -1)
echo "compiler: $($cxx --version | head -1); CPU: $cpu ($(nproc) cores)"
tmp=$(mktemp)
trap 'rm -f "$tmp"' EXIT
echo "| program | -fsyntax-only | -O0 | -O2 |"
echo "|---|---|---|---|"
row() {  # row LABEL FILE [FLAGS...]: the three compiles of FILE
  local label=$1 prog=$2 r
  shift 2
  r="| $label"
  for mode in -fsyntax-only -O0 -O2; do
    out=-c
    [ "$mode" = -fsyntax-only ] && out=
    /usr/bin/time -o "$tmp" -f '%U %S' "$cxx" "${base[@]}" "$@" $mode $out "$prog" -o /dev/null >/dev/null 2>&1
    r="$r | $(awk '{printf "%.1f s", $1 + $2}' "$tmp")"
  done
  echo "$r |"
}
for prog in bench/compile_time/mlp_step.cpp tests/core/readme_tour.test.cpp; do
  row "$prog" "$prog"
  row "$prog, -DNN_PRECOMPILED" "$prog" -DNN_PRECOMPILED
done
row "cmake/precompiled.cpp (nn::precompiled, once per program)" cmake/precompiled.cpp -DNN_PRECOMPILED
