#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# Copies the header-only dependencies the CUDA check builds against (Eigen, nlohmann_json, doctest)
# from this machine into DEST (default .third_party/ in the repository, git-ignored through
# .git/info/exclude), for a GPU machine that has no package registry. Then run there with
# carry [".third_party"]:  bash tests/cuda/gpu_check.sh
set -euo pipefail
root=$(cd "$(dirname "$0")/../.." && pwd)
dest=${1:-$root/.third_party}
eigen=${EIGEN_SRC:-/usr/include/eigen3}
json=${JSON_SRC:-/usr/include}
doctest=${DOCTEST_SRC:-/usr/include}
[ -f "$eigen/Eigen/Core" ] || { echo "stage_third_party: no Eigen at $eigen (set EIGEN_SRC)" >&2; exit 1; }
[ -f "$json/nlohmann/json.hpp" ] || { echo "stage_third_party: no nlohmann/json.hpp under $json (set JSON_SRC)" >&2; exit 1; }
[ -f "$doctest/doctest/doctest.h" ] || { echo "stage_third_party: no doctest/doctest.h under $doctest (set DOCTEST_SRC)" >&2; exit 1; }
rm -rf "$dest"
mkdir -p "$dest/eigen3" "$dest/nlohmann_json" "$dest/doctest"
cp -r "$eigen/Eigen" "$dest/eigen3/"
[ -d "$eigen/unsupported" ] && cp -r "$eigen/unsupported" "$dest/eigen3/" || true
cp -r "$json/nlohmann" "$dest/nlohmann_json/"
cp -r "$doctest/doctest" "$dest/doctest/"
if [ "$dest" = "$root/.third_party" ] && [ -d "$root/.git" ] && ! grep -qx '/.third_party/' "$root/.git/info/exclude" 2>/dev/null; then
  echo '/.third_party/' >> "$root/.git/info/exclude"
fi
du -sh "$dest"
echo "staged; run the check on the GPU machine with carry [\".third_party\"]: bash tests/cuda/gpu_check.sh"
