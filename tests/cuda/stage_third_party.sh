#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Copies the dependencies the CUDA check builds against (the headers of Eigen, nlohmann_json and
# doctest; for finetune_cuda also CLI11's and yaml-cpp's headers and yaml-cpp's static library)
# from this machine into DEST (default .third_party/ in the repository, git-ignored through
# .git/info/exclude), for a GPU machine that has no package registry. Then run there with
# carry [".third_party"]:  bash tests/cuda/gpu_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/.third_party}
eigen=${EIGEN_SRC:-/usr/include/eigen3}
json=${JSON_SRC:-/usr/include}
doctest=${DOCTEST_SRC:-/usr/include}
cli11=${CLI11_SRC:-/usr/include}
yaml=${YAML_SRC:-/usr/include}
yaml_lib=${YAML_LIB_SRC:-/usr/lib/x86_64-linux-gnu/libyaml-cpp.a}
[ -f "$eigen/Eigen/Core" ] || { echo "stage_third_party: no Eigen at $eigen (set EIGEN_SRC)" >&2; exit 1; }
[ -f "$json/nlohmann/json.hpp" ] || { echo "stage_third_party: no nlohmann/json.hpp under $json (set JSON_SRC)" >&2; exit 1; }
[ -f "$doctest/doctest/doctest.h" ] || { echo "stage_third_party: no doctest/doctest.h under $doctest (set DOCTEST_SRC)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/eigen3" "$dest/nlohmann_json" "$dest/doctest"
cp -r "$eigen/Eigen" "$dest/eigen3/"
[ -d "$eigen/unsupported" ] && cp -r "$eigen/unsupported" "$dest/eigen3/" || true
cp -r "$json/nlohmann" "$dest/nlohmann_json/"
cp -r "$doctest/doctest" "$dest/doctest/"
# finetune_cuda's (optional: gpu_check.sh skips that build, saying so, without them)
if [ -f "$cli11/CLI/CLI.hpp" ] && [ -f "$yaml/yaml-cpp/yaml.h" ] && [ -f "$yaml_lib" ]; then
  mkdir -p "$dest/cli11" "$dest/yaml-cpp/include" "$dest/yaml-cpp/lib"
  cp -r "$cli11/CLI" "$dest/cli11/"
  cp -r "$yaml/yaml-cpp" "$dest/yaml-cpp/include/"
  cp "$yaml_lib" "$dest/yaml-cpp/lib/"
else
  echo "stage_third_party: no CLI11 / yaml-cpp (libcli11-dev libyaml-cpp-dev): the GPU check will not build finetune_cuda" >&2
fi
if [ "$dest" = "$root/.third_party" ] && [ -d "$root/.git" ] && ! grep -qx '/.third_party/' "$root/.git/info/exclude" 2>/dev/null; then
  echo '/.third_party/' >> "$root/.git/info/exclude"
fi
du -sh "$dest"
echo "staged; run the check on the GPU machine with carry [\".third_party\"]: bash tests/cuda/gpu_check.sh"
