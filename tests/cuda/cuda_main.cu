// SPDX-License-Identifier: MIT OR Apache-2.0
// The CUDA tests' main: exits with CTest's skip code 77 when no CUDA device is present (so CI,
// which compiles these tests without a GPU, reports them SKIPPED, not passed), else runs doctest
// and prints the table of CUDA-vs-CPU comparisons last.
#define DOCTEST_CONFIG_IMPLEMENT
#include "cuda_check.hpp"

#include <cstdio>

int main(int argc, char** argv) {
  const int devices = nn::cuda::device_count();
  if (devices == 0) {
    std::printf("SKIPPED: no CUDA device (cudaGetDeviceCount found none); the CUDA tests need a GPU\n");
    return 77;
  }
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("CUDA device 0: %s (sm_%d%d), %d device(s); input seed %llu (NN_CUDA_TEST_SEED to repeat)\n", prop.name,
                prop.major, prop.minor, devices, static_cast<unsigned long long>(nn::test::gpu::run_seed()));
  doctest::Context ctx(argc, argv);
  const int rc = ctx.run();
  if (ctx.shouldExit()) return rc;

  const auto& rows = nn::test::gpu::rows();
  std::size_t w = 5;
  for (const auto& r : rows) w = std::max(w, r.check.size());
  int failed = 0;
  std::printf("\n%-*s  %-8s  %-12s  %-9s  %s\n", static_cast<int>(w), "check", "dtype", "rel. error", "tolerance", "result");
  for (const auto& r : rows) {
    std::printf("%-*s  %-8s  %-12.3e  %-9.0e  %s\n", static_cast<int>(w), r.check.c_str(), r.dtype.c_str(), r.err, r.tol,
                r.pass ? "ok" : "FAIL");
    failed += !r.pass;
  }
  std::printf("%zu CUDA-vs-CPU comparisons, %d failed; doctest exit code %d\n", rows.size(), failed, rc);
  return rc;
}
