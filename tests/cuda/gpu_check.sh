#!/usr/bin/env bash
# SPDX-License-Identifier: MIT OR Apache-2.0
# GPU evidence for nn's CUDA backend, for a machine with an NVIDIA GPU and nvcc but no package
# registry: builds tests/cuda with nvcc directly (no CMake package lookups) against Eigen,
# nlohmann_json and doctest headers carried into the tree, runs every CUDA-vs-CPU check (each
# primitive and layer, f64 to 1e-12 and f32 to 1e-5, fresh random inputs, NaN-poisoned outputs),
# the Qwen2 block gate on the GPU, graph replay == eager bit for bit with no device allocation,
# and full training steps; then the finetune example on --device cuda against --device cpu
# (finetune_cuda, examples/finetune/cuda_smoke.sh: the same losses to 1e-4 over 10 steps for LoRA,
# QLoRA, DoRA and a full finetune); compute-sanitizer memcheck over the kernel tests where the tool is;
# prints the table of checks last. Sized for under 8 minutes on 16 cores. It also builds
# bench_decoder_cuda, the speed table's nn side (the reference decoder scaled to the GPU, beside
# PyTorch eager and torch.compile), which a second call in the same lease runs (about 4 minutes;
# the build folder is kept between calls):
#   bash bench/run_decoder_cuda.sh .cuda-build/bench_decoder_cuda --steps 5
# (NN_CUDA_BENCH=1 runs it at the end of this script instead, where one call has the time.)
#
# Header locations (each must exist; the defaults are what tests/cuda/stage_third_party.sh writes):
#   EIGEN_INCLUDE    dir holding Eigen/Core             default $NN_THIRD_PARTY/eigen3
#   JSON_INCLUDE     dir holding nlohmann/json.hpp      default $NN_THIRD_PARTY/nlohmann_json
#   DOCTEST_INCLUDE  dir holding doctest/doctest.h      default $NN_THIRD_PARTY/doctest
#   CLI11_INCLUDE    dir holding CLI/CLI.hpp            default $NN_THIRD_PARTY/cli11
#   YAML_INCLUDE     dir holding yaml-cpp/yaml.h        default $NN_THIRD_PARTY/yaml-cpp/include
#   YAML_LIB         libyaml-cpp.a                      default $NN_THIRD_PARTY/yaml-cpp/lib/libyaml-cpp.a
#   (finetune_cuda's three are optional: without them the finetune check is reported not run)
#   NN_THIRD_PARTY   default <repo>/.third_party, else <repo>/shared/third_party, else /usr/include
# Other knobs: NVCC (nvcc), NN_CUDA_GENCODE (sm_90 + compute_90 PTX), NN_CUDA_BUILD (build dir,
# default <repo>/.cuda-build, git-ignored), NN_CUDA_TEST_SEED (repeat a run's random inputs),
# NN_CUDA_SANITIZE=0 (skip compute-sanitizer memcheck on the kernel tests), NN_CUDA_BENCH=1 (the
# speed table too), NN_CUDA_BENCH_STEPS (its timed steps, default 5), OUT (where logs go; the
# device tool's output folder).
set -uo pipefail
t0=$(date +%s)
root=$(cd "$(dirname "$0")/../.." && pwd)
die() { echo "gpu_check: $*" >&2; exit 2; }

if [ -z "${NN_THIRD_PARTY:-}" ]; then
  for d in "$root/.third_party" "$root/shared/third_party"; do [ -d "$d" ] && { NN_THIRD_PARTY=$d; break; }; done
fi
if [ -n "${NN_THIRD_PARTY:-}" ]; then
  EIGEN_INCLUDE=${EIGEN_INCLUDE:-$NN_THIRD_PARTY/eigen3}
  JSON_INCLUDE=${JSON_INCLUDE:-$NN_THIRD_PARTY/nlohmann_json}
  DOCTEST_INCLUDE=${DOCTEST_INCLUDE:-$NN_THIRD_PARTY/doctest}
  CLI11_INCLUDE=${CLI11_INCLUDE:-$NN_THIRD_PARTY/cli11}
  YAML_INCLUDE=${YAML_INCLUDE:-$NN_THIRD_PARTY/yaml-cpp/include}
  YAML_LIB=${YAML_LIB:-$NN_THIRD_PARTY/yaml-cpp/lib/libyaml-cpp.a}
else  # a machine with the packages installed
  EIGEN_INCLUDE=${EIGEN_INCLUDE:-/usr/include/eigen3}
  JSON_INCLUDE=${JSON_INCLUDE:-/usr/include}
  DOCTEST_INCLUDE=${DOCTEST_INCLUDE:-/usr/include}
  CLI11_INCLUDE=${CLI11_INCLUDE:-/usr/include}
  YAML_INCLUDE=${YAML_INCLUDE:-/usr/include}
  YAML_LIB=${YAML_LIB:-/usr/lib/x86_64-linux-gnu/libyaml-cpp.a}
fi
[ -f "$EIGEN_INCLUDE/Eigen/Core" ] || die "Eigen not found: no $EIGEN_INCLUDE/Eigen/Core (set EIGEN_INCLUDE, or run tests/cuda/stage_third_party.sh where Eigen is installed and carry .third_party)"
[ -f "$JSON_INCLUDE/nlohmann/json.hpp" ] || die "nlohmann_json not found: no $JSON_INCLUDE/nlohmann/json.hpp (set JSON_INCLUDE)"
[ -f "$DOCTEST_INCLUDE/doctest/doctest.h" ] || die "doctest not found: no $DOCTEST_INCLUDE/doctest/doctest.h (set DOCTEST_INCLUDE)"
NVCC=${NVCC:-nvcc}
if ! command -v "$NVCC" >/dev/null; then
  [ -x /usr/local/cuda/bin/nvcc ] && NVCC=/usr/local/cuda/bin/nvcc || die "nvcc not found (set NVCC)"
fi
gencode=${NN_CUDA_GENCODE:-"-gencode arch=compute_90,code=[sm_90,compute_90]"}
build=${NN_CUDA_BUILD:-$root/.cuda-build}
logs=${OUT:-$build}
mkdir -p "$build" "$logs"
rm -f "$build"/*.o "$build"/*.o.log

echo "== nn CUDA check: $("$NVCC" --version | tail -1)"
nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>/dev/null || echo "(nvidia-smi unavailable)"

# -O2 on the host side too: the CPU reference runs in the same binary. The CPU reference is
# built with OpenMP when the host compiler has it.
flags=(-std=c++20 -O2 $gencode --threads 2 --expt-relaxed-constexpr --diag-suppress=20012
       -Xcompiler=-fopenmp,-Wall,-Wextra,-Wno-unknown-pragmas
       -I"$root/include" -I"$root/tests" -I"$EIGEN_INCLUDE" -I"$JSON_INCLUDE" -I"$DOCTEST_INCLUDE"
       "-DNN_FIXTURES_DIR=\"$root/tests/fixtures\"")
# NCCL (nn::distributed's device collectives) where the toolkit has it: the 1-rank NCCL checks.
nvcc_dir=$(dirname "$(command -v "$NVCC")")/..
libs=(-lcublas)
if [ -f "$nvcc_dir/include/nccl.h" ] || [ -f /usr/include/nccl.h ] || [ -f /usr/local/include/nccl.h ]; then
  flags+=(-DNN_WITH_NCCL)
  libs+=(-lnccl)
  echo "== NCCL found: the distributed checks run through it"
else
  echo "== no nccl.h: the distributed checks run without NCCL (identity at one rank)"
fi
srcs=("$root/tests/cuda/cuda_main.cu" "$root"/tests/cuda/*.test.cu)
pids=()
objs=()
for s in "${srcs[@]}"; do
  o="$build/$(basename "$s" .cu).o"
  objs+=("$o")
  ( "$NVCC" "${flags[@]}" -c "$s" -o "$o" > "$o.log" 2>&1 || { echo "gpu_check: compiling $s failed:"; cat "$o.log"; exit 1; } ) &
  pids+=($!)
done
# finetune_cuda beside them: main.cpp by the host compiler, cuda_trainer.cu by nvcc (the CMake
# target's split), linked with yaml-cpp's static library. (test_cuda links its own objects by
# name: ft_main.o holds a main() too.)
ft=""
if [ -f "$CLI11_INCLUDE/CLI/CLI.hpp" ] && [ -f "$YAML_INCLUDE/yaml-cpp/yaml.h" ] && [ -f "$YAML_LIB" ]; then
  ft="$build/finetune_cuda"
  rm -f "$ft"
  ftinc=(-I"$root/include" -I"$EIGEN_INCLUDE" -I"$JSON_INCLUDE" -I"$CLI11_INCLUDE" -I"$YAML_INCLUDE")
  ( "${CXX:-g++}" -std=c++20 -O2 -fopenmp "${ftinc[@]}" -c "$root/examples/finetune/main.cpp" -o "$build/ft_main.o" > "$build/ft_main.o.log" 2>&1 &&
    "$NVCC" -std=c++20 -O2 $gencode --threads 2 --expt-relaxed-constexpr --diag-suppress=20012 -Xcompiler=-fopenmp "${ftinc[@]}" \
      -c "$root/examples/finetune/cuda_trainer.cu" -o "$build/ft_cuda.o" > "$build/ft_cuda.o.log" 2>&1 &&
    "$NVCC" $gencode -o "$ft" "$build/ft_main.o" "$build/ft_cuda.o" "$YAML_LIB" -lcublas -Xcompiler=-fopenmp > "$build/ft_link.log" 2>&1 ) \
    || { echo "gpu_check: building finetune_cuda failed:"; cat "$build"/ft_*.log | tail -40; ft="failed"; } &
  ftpid=$!
else
  echo "== finetune_cuda not built: no CLI11 / yaml-cpp (tests/cuda/stage_third_party.sh stages them)"
fi
# bench_decoder_cuda beside them (the speed table's nn side)
bench="$build/bench_decoder_cuda"
rm -f "$bench"
( "$NVCC" "${flags[@]}" -o "$bench" "$root/bench/decoder_cuda.cu" "${libs[@]}" -Xcompiler=-fopenmp > "$build/bench.log" 2>&1 ||
  { echo "gpu_check: building bench_decoder_cuda failed:"; tail -40 "$build/bench.log"; } ) &
benchpid=$!
ok=1
for p in "${pids[@]}"; do wait "$p" || ok=0; done
[ $ok = 1 ] || die "build failed"
"$NVCC" $gencode -o "$build/test_cuda" "${objs[@]}" "${libs[@]}" -Xcompiler=-fopenmp > "$build/link.log" 2>&1 \
  || { cat "$build/link.log"; die "link failed"; }
t1=$(date +%s)
echo "== built test_cuda in $((t1 - t0)) s"

if [ "${NN_CUDA_SANITIZE:-1}" = 1 ] && command -v compute-sanitizer >/dev/null && [ "$(nvidia-smi -L 2>/dev/null | wc -l)" -gt 0 ]; then
  echo "== compute-sanitizer memcheck on the kernel tests"
  compute-sanitizer --tool memcheck --error-exitcode 9 "$build/test_cuda" -tc="cuda kernels*" > "$logs/sanitizer.log" 2>&1
  san_rc=$?
  echo "compute-sanitizer exit code $san_rc (log: $logs/sanitizer.log)"; tail -3 "$logs/sanitizer.log"
fi

echo "== running test_cuda"
"$build/test_cuda" > "$logs/test_cuda.log" 2>&1
rc=$?
# memcheck's findings fail the check too
if [ "${san_rc:-0}" != 0 ] && [ "$rc" != 77 ]; then echo "gpu_check: compute-sanitizer memcheck failed (exit $san_rc)"; rc=1; fi
t2=$(date +%s)
# The finetune example: --device cuda against --device cpu (its own tiny model and data).
ft_line="finetune --device cuda vs cpu: not run (finetune_cuda not built)"
if [ -n "$ft" ]; then
  wait "$ftpid" 2>/dev/null || true
  if [ -x "$ft" ]; then
    bash "$root/examples/finetune/cuda_smoke.sh" "$ft" "$build/ft_smoke" > "$logs/finetune_cuda.log" 2>&1
    ft_rc=$?
    case $ft_rc in 0) verdict=pass ;; 77) verdict="skipped, no GPU" ;; *) verdict=FAIL; rc=1 ;; esac
    ft_line="finetune --device cuda vs cpu: exit $ft_rc ($verdict; log $logs/finetune_cuda.log)"
  else
    ft_line="finetune --device cuda vs cpu: FAIL (finetune_cuda did not build; logs $build/ft_*.log)"
    rc=1
  fi
fi
t3=$(date +%s)
# The speed table: only where test_cuda found a GPU.
wait "$benchpid" 2>/dev/null || true
bench_line="decoder bench: not run here (NN_CUDA_BENCH=1 runs it; or: bash bench/run_decoder_cuda.sh $bench --steps 5)"
[ -x "$bench" ] || bench_line="decoder bench: bench_decoder_cuda did not build (log $build/bench.log)"
if [ "${NN_CUDA_BENCH:-0}" = 1 ]; then
  if [ "$rc" = 77 ]; then
    bench_line="decoder bench: not run (no GPU)"
  elif [ -x "$bench" ]; then
    bash "$root/bench/run_decoder_cuda.sh" "$bench" --steps "${NN_CUDA_BENCH_STEPS:-5}" > "$logs/bench_decoder_cuda.log" 2>&1
    bench_line="decoder bench: exit $? (log $logs/bench_decoder_cuda.log)"
  else
    bench_line="decoder bench: bench_decoder_cuda did not build (log $build/bench.log)"
  fi
fi
t4=$(date +%s)
# doctest's report (failures, if any, and its summary), then the table of checks last.
sed '/^check  /,$d' "$logs/test_cuda.log" | tail -n 80
[ -f "$logs/finetune_cuda.log" ] && grep "^finetune cuda smoke" "$logs/finetune_cuda.log"
[ -f "$logs/bench_decoder_cuda.log" ] && cat "$logs/bench_decoder_cuda.log"
sed -n '/^check  /,$p' "$logs/test_cuda.log"
echo "$ft_line"
echo "$bench_line"
echo "gpu_check: exit code $rc (77 = no GPU found, skipped); build $((t1 - t0)) s, test_cuda $((t2 - t1)) s, finetune $((t3 - t2)) s, bench $((t4 - t3)) s; log $logs/test_cuda.log"
exit "$rc"
