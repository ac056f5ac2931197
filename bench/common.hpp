// SPDX-License-Identifier: MIT OR Apache-2.0
// What the bench programs share: the splitmix64 token stream their Python counterparts
// reproduce (decoder_torch.py's batch()), thread setup, peak RSS, CPU time and the FMA peak.
#pragma once

#include <nn/nn.hpp>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <utility>

#include <sys/resource.h>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__AVX2__) || defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace bench {

inline std::uint64_t splitmix64(std::uint64_t& s) {
  std::uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

/// Batch `i` of the stream: ids[b, t] = s[b, t], targets[b, t] = s[b, t + 1], s (B, T + 1) the
/// next B (T + 1) draws of splitmix64 seeded with i, modulo the vocabulary.
inline std::pair<nn::Tensor, nn::Tensor> batch(std::uint64_t i, std::int64_t B, std::int64_t T, std::int64_t V) {
  nn::Tensor ids = nn::Tensor::empty({B, T}, nn::DType::i32), tg = nn::Tensor::empty({B, T}, nn::DType::i32);
  std::uint64_t s = i;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int32_t prev = static_cast<std::int32_t>(splitmix64(s) % static_cast<std::uint64_t>(V));
    for (std::int64_t t = 0; t < T; ++t) {
      const auto next = static_cast<std::int32_t>(splitmix64(s) % static_cast<std::uint64_t>(V));
      ids.data<std::int32_t>()[b * T + t] = prev;
      tg.data<std::int32_t>()[b * T + t] = next;
      prev = next;
    }
  }
  return {ids, tg};
}

using nn::proc_status_kb;  // kB of a /proc/self/status field (include/nn/resources.hpp)

/// User + system CPU seconds of the whole process so far: on a loaded machine, a 1-thread step's
/// CPU time is what its wall time would be on an idle one (within cache effects).
inline double cpu_seconds() {
  rusage u{};
  getrusage(RUSAGE_SELF, &u);
  return static_cast<double>(u.ru_utime.tv_sec + u.ru_stime.tv_sec) +
         1e-6 * static_cast<double>(u.ru_utime.tv_usec + u.ru_stime.tv_usec);
}

/// The first line of every bench's output: the CPU, its features and the GEMM nn runs on it.
inline void print_cpu_info() { std::printf("# %s\n", nn::cpu_info().line().c_str()); }

/// Sets every thread count nn's kernels read: OpenMP's, Eigen's and OpenBLAS's.
inline void set_threads(int threads) {
#if defined(_OPENMP)
  omp_set_num_threads(threads);
#endif
  Eigen::setNbThreads(threads);
#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
  openblas_set_num_threads(threads);
#endif
}

/// GFLOP/s of independent FMA chains on every thread: the ceiling no kernel can pass. 512-bit
/// and 256-bit vectors are both tried (Zen 4 runs AVX-512 as two 256-bit halves, so they tie).
inline double fma_peak(int threads) {
  double best = 0;
  for (int width : {8, 16}) {
#if !defined(__AVX512F__)
    if (width == 16) continue;
#endif
    const long iters = 20'000'000;
    double secs = 0;
    float sink = 0;
    auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(threads) reduction(+ : sink)
    {
#if defined(__AVX512F__)
      if (width == 16) {
        __m512 a[12];
        const __m512 x = _mm512_set1_ps(0.999999f), y = _mm512_set1_ps(1e-7f);
        for (int i = 0; i < 12; ++i) a[i] = _mm512_set1_ps(static_cast<float>(i));
        for (long it = 0; it < iters / 2; ++it)
          for (int i = 0; i < 12; ++i) a[i] = _mm512_fmadd_ps(a[i], x, y);
        float buf[16];
        for (int i = 0; i < 12; ++i) {
          _mm512_storeu_ps(buf, a[i]);
          for (float v : buf) sink += v;
        }
      }
#endif
#if defined(__AVX2__) && defined(__FMA__)
      if (width == 8) {
        __m256 a[12];
        const __m256 x = _mm256_set1_ps(0.999999f), y = _mm256_set1_ps(1e-7f);
        for (int i = 0; i < 12; ++i) a[i] = _mm256_set1_ps(static_cast<float>(i));
        for (long it = 0; it < iters; ++it)
          for (int i = 0; i < 12; ++i) a[i] = _mm256_fmadd_ps(a[i], x, y);
        float buf[8];
        for (int i = 0; i < 12; ++i) {
          _mm256_storeu_ps(buf, a[i]);
          for (float v : buf) sink += v;
        }
      }
#endif
    }
    secs = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (sink == 12345.0f) std::printf(" ");  // keeps the chains alive
    const long lanes_iters = width == 16 ? iters / 2 * 16 : iters * 8;
    best = std::max(best, 2.0 * 12 * static_cast<double>(lanes_iters) * threads / secs / 1e9);
  }
  return best;
}

}  // namespace bench
