#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Installs the Debian 12 packages nn's build, tests and example need -- only the missing ones, so
# on a prepared machine it touches nothing (and needs no network).
set -euo pipefail

# make: cmake only *recommends* it. dataset-fashion-mnist: the example's data (and its CTest run).
# python3: tools/amalgamate --check and tools/check_readme run as tests. libopenmpi-dev +
# openmpi-bin: nn::distributed's MPI and the mpirun data-parallel tests. bible-kjv: the text the
# finetune smoke tests (and the README's main job) make their Proverbs data from. libcli11-dev +
# libyaml-cpp-dev: the finetune example's flags and its mlx-lm config file (the example only).
pkgs=(cmake make g++ libeigen3-dev nlohmann-json3-dev doctest-dev libopenblas-dev python3 dataset-fashion-mnist
      libopenmpi-dev openmpi-bin bible-kjv libcli11-dev libyaml-cpp-dev)

missing=()
for p in "${pkgs[@]}"; do
  dpkg -s "$p" 2>/dev/null | grep -q '^Status: install ok installed' || missing+=("$p")
done
if ((${#missing[@]} == 0)); then
  echo "deps: all ${#pkgs[@]} packages present"
  exit 0
fi

echo "deps: installing ${missing[*]}"
sudo=()
if [[ $(id -u) != 0 ]]; then sudo=(sudo); fi
export DEBIAN_FRONTEND=noninteractive
"${sudo[@]}" apt-get update -q
"${sudo[@]}" apt-get install -y -q --no-install-recommends "${missing[@]}"
