// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's own GEMM: a BLIS-style packed, blocked product C (+)= op(A) @ op(B) on row-major matrices,
// with micro-kernels for AVX-512, AVX2+FMA and the compiler's baseline, all in one binary and
// chosen at run time from CPUID feature bits (backend/cpu_info.hpp), never from a CPU model name.
//
// Why nn owns it: a BLAS picks its kernels from a table of CPU models, and Debian's OpenBLAS
// 0.3.21 falls back to SSE3 kernels on CPUs newer than its table (Sapphire Rapids runs at a
// fifth of its speed). Owning the loops also gives the hooks the rest of nn needs: caller-supplied
// packing (quantized weights dequantized straight into packed panels) and an epilogue per tile.
//
// One micro-kernel body serves every instruction set: it is written with GCC/Clang vector
// extensions and inlined into a small entry function per ISA marked with a target attribute, so
// the compiler emits zmm FMAs in one, ymm FMAs in another and SSE2 in the baseline one, with no
// -m flags on the user's command line.
#pragma once

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "../tensor.hpp"
#include "cpu_info.hpp"
#include "threads.hpp"

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define NN_OWN_GEMM 1
#endif

// Full unrolling keeps a micro-tile's accumulators in registers (gemv.hpp's too). nvcc's front end knows only the
// plain form (and passes host code on to the host compiler).
#define NN_GEMM_STR2(x) #x
#define NN_GEMM_STR(x) NN_GEMM_STR2(x)
#if defined(__CUDACC__)
#define NN_GEMM_UNROLL(n) _Pragma(NN_GEMM_STR(unroll n))
#else
#define NN_GEMM_UNROLL(n) _Pragma(NN_GEMM_STR(GCC unroll n))
#endif

// NN_PIN_REGISTER(v): v must be in a vector register here (not folded into its users as a memory
// operand). An empty asm with v as its in/out operand; nothing on other targets or under nvcc.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
#define NN_PIN_REGISTER(v) asm("" : "+v"(v))
#else
#define NN_PIN_REGISTER(v) ((void)0)
#endif

namespace nn {
namespace detail {

/// This thread's working space number `slot` (0: its own GEMM panels, 1: B panels it shares with
/// its team, 2: a kernel's tiles around its GEMM calls, such as flash attention's scores, 3: a
/// narrow product's transposed C, see gemm::narrow_product): at
/// least `bytes`, 64-byte aligned. It grows only when a larger request comes, so replaying
/// kernels already seen allocates nothing.
inline void* gemm_workspace(std::size_t bytes, int slot = 0) {
  struct Buffer {
    void* p = nullptr;
    std::size_t n = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer bufs[4];
  Buffer& buf = bufs[slot];
  if (buf.n < bytes) {
    const std::size_t n = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::bad_alloc();
    std::free(buf.p);
    buf.p = p;
    buf.n = n;
  }
  return buf.p;
}

}  // namespace detail

#if defined(NN_OWN_GEMM)
namespace gemm {

using index = std::int64_t;

/// A row-major operand as the product reads it: element (r, c) of op(X) is X[r*ld + c], or
/// X[c*ld + r] when trans (X stored transposed). The default packers read these.
template <class T>
struct Matrix {
  const T* p;
  index ld;
  bool trans;
  T at(index r, index c) const { return trans ? p[c * ld + r] : p[r * ld + c]; }
};

/// The shape of one micro-kernel: an MR x NR tile of C held in registers, NR = NV vectors of W
/// lanes per row; blocking sizes follow from it (KC: depth of a packed panel; NB: columns of a
/// packed B block, sized for L2; MB: rows of a packed A block).
template <class T, Isa I>
struct Shape;
// Baseline (SSE2 on x86-64, NEON elsewhere): 16 registers of 16 bytes; 6 x 2 accumulators.
template <class T>
struct Shape<T, Isa::generic> {
  static constexpr int W = 16 / sizeof(T), NV = 2, MR = 6, NR = W * NV;
  static constexpr index KC = 256, NB = 512, MB = 960;
};
// AVX2: 16 ymm registers; 6 x 2 accumulators + 2 B vectors + 1 broadcast.
template <class T>
struct Shape<T, Isa::avx2> {
  static constexpr int W = 32 / sizeof(T), NV = 2, MR = 6, NR = W * NV;
  static constexpr index KC = 256, NB = 512, MB = 960;
};
// AVX-512: 32 zmm registers; 12 x 2 accumulators + 2 B vectors + 1 broadcast.
template <class T>
struct Shape<T, Isa::avx512> {
  static constexpr int W = 64 / sizeof(T), NV = 2, MR = 12, NR = W * NV;
  static constexpr index KC = 384, NB = 384, MB = 1536;
};

/// Whether the AVX2 micro-kernel pins each B vector in a register (NN_PIN_REGISTER). Each one
/// feeds MR FMAs, but GCC tuned for AMD Zen 2/3 (-mtune=znver2/znver3, what -march=native gives
/// there) folds the 256-bit load into every FMA instead: 24 loads a depth pair for 4, and the
/// kernel ran at 61-66% of its speed (55-65 -> 86-97 GFLOP/s with the pin, one thread, AMD EPYC
/// family 25 model 1, FMA peak 90). No other tuning folds them (generic, haswell to
/// sapphirerapids, znver1, checked with GCC 12), and there the asm would only move GCC's schedule
/// (3% slower under generic tuning), so the pin is for those tunings alone; the 512- and 128-bit
/// kernels keep their loads in registers under every tuning.
#if defined(__tune_znver2__) || defined(__tune_znver3__) || defined(__tune_znver4__) || defined(__tune_znver5__)
inline constexpr bool kPinAvx2B = true;
#else
inline constexpr bool kPinAvx2B = false;
#endif

/// The one micro-kernel body: C[MR x NR] (row stride ldc) = (or +=, unless overwrite) the sum over
/// k < kc of A(i, k) * B(k, j), k in order. B(k, j) is b[k*ldb + j]: a packed B panel (ldb = NR,
/// packed by pack_b below) or NR columns of a row-major op(B) read in place (ldb its row stride).
/// A(i, k) is a[k*MR + i] from a packed A panel, or a[i*lda + k] read in place (DirectA: rows of a
/// row-major A, which saves packing A when C is narrow and A's rows would be packed for few uses).
/// Either way each C element sees the same products in the same order: in place and packed are
/// bit-identical.
template <class T, int W, int MR, int NV, bool DirectA>
[[gnu::always_inline]] inline void micro_body(index kc, const T* __restrict a, index lda, const T* __restrict b,
                                              index ldb, T* __restrict c, index ldc, bool overwrite) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  V acc[MR][NV] = {};
  // one depth: NV vectors of B's row k, each A(i, k) broadcast against them
  const auto depth = [&](index k) [[gnu::always_inline]] {
    V bv[NV];
    NN_GEMM_UNROLL(8)
    for (int j = 0; j < NV; ++j) {
      if constexpr (kPinAvx2B && sizeof(V) == 32) {
        V v;
        __builtin_memcpy(&v, b + k * ldb + j * W, sizeof(V));
        NN_PIN_REGISTER(v);
        bv[j] = v;
      } else {
        __builtin_memcpy(&bv[j], b + k * ldb + j * W, sizeof(V));
      }
    }
    NN_GEMM_UNROLL(16)
    for (int i = 0; i < MR; ++i) {
      const T ai = DirectA ? a[i * lda + k] : a[k * MR + i];
      NN_GEMM_UNROLL(8)
      for (int j = 0; j < NV; ++j) acc[i][j] += bv[j] * ai;
    }
  };
  // Two depths per trip: the loop's own counter and branch uops then share the FMA ports half as
  // often (one trip of 24 FMAs ran at ~83% of the FMA peak, two at ~88%, Xeon model 167).
  index k = 0;
  for (; k + 2 <= kc; k += 2) {
    depth(k);
    depth(k + 1);
  }
  if (k < kc) depth(k);
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i)
    NN_GEMM_UNROLL(8)
    for (int j = 0; j < NV; ++j) {
      V cv = acc[i][j];
      if (!overwrite) {
        V old;
        __builtin_memcpy(&old, c + i * ldc + j * W, sizeof(V));
        cv += old;
      }
      __builtin_memcpy(c + i * ldc + j * W, &cv, sizeof(V));
    }
}

/// One ISA's pair of micro-kernels: on a packed A panel (lda unused), and on A rows read in place;
/// both read B at b[k*ldb + j].
template <class T>
struct Kernels {
  using Fn = void (*)(index kc, const T* a, index lda, const T* b, index ldb, T* c, index ldc, bool overwrite);
  Fn packed, direct;
};

// The entry points, one per ISA and form: the same body, compiled for each instruction set.
template <class T, bool D>
void micro_generic(index kc, const T* a, index lda, const T* b, index ldb, T* c, index ldc, bool overwrite) {
  using S = Shape<T, Isa::generic>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, ldb, c, ldc, overwrite);
}
#if defined(__x86_64__) || defined(__i386__)
template <class T, bool D>
[[gnu::target("avx2,fma")]] void micro_avx2(index kc, const T* a, index lda, const T* b, index ldb, T* c,
                                            index ldc, bool overwrite) {
  using S = Shape<T, Isa::avx2>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, ldb, c, ldc, overwrite);
}
template <class T, bool D>
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]] void micro_avx512(index kc, const T* a, index lda,
                                                                                const T* b, index ldb, T* c,
                                                                                index ldc, bool overwrite) {
  using S = Shape<T, Isa::avx512>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, ldb, c, ldc, overwrite);
}
#endif

/// The kernel entry point of ISA I, form D (direct A or packed).
template <class T, Isa I, bool D>
constexpr auto micro_entry() {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (I == Isa::avx512) return &micro_avx512<T, D>;
  else if constexpr (I == Isa::avx2) return &micro_avx2<T, D>;
  else return &micro_generic<T, D>;
#else
  return &micro_generic<T, D>;
#endif
}

template <class T, Isa I>
constexpr Kernels<T> micro_kernels() {
  return {micro_entry<T, I, false>(), micro_entry<T, I, true>()};
}

// ---- packing ------------------------------------------------------------------------------
// A block (rows i0.., depth k0..) is laid out as ceil(mc/MR) panels of kc x MR values; a B block
// (depth k0.., columns j0..) as ceil(nc/NR) panels of kc x NR. Rows and columns past the edge are
// zero, so every micro-kernel call is a full tile. A caller with its own storage (quantized
// weights) supplies a packer with the same contract in place of these.

/// Packs an L-wide strip of a row-major matrix into a panel of kc x L values: `contiguous` when
/// the strip's L values at depth k lie side by side (src + k*ld), else each of its L lines runs
/// along k (src + l*ld + k). Lines past `n` are zero. This is both pack_a and pack_b: a panel of
/// op(A) rows and a panel of op(B) columns are the same thing seen from either side.
/// An element of a source matrix as the packed type: bf16 bits (std::uint16_t) widened exactly to
/// f32, anything else as it is.
template <class T, class S>
inline T widen(S s) {
  if constexpr (std::is_same_v<S, std::uint16_t>) return half::bf16_to_f32(s);
  else return static_cast<T>(s);
}

/// Whether the packers may use AVX-512 (or AVX2): the kernel set in use is (NN_CPU_ISA lowers
/// both alike).
inline bool pack_avx512() {
  static const bool yes = detail::choose_isa(detail::detect_cpu_features()) == Isa::avx512;
  return yes;
}
inline bool pack_avx2() {
  static const bool yes = detail::choose_isa(detail::detect_cpu_features()) == Isa::avx2;
  return yes;
}

#if defined(__x86_64__) || defined(__i386__)
/// dst[d * L + l] = src[l * ld + d] for d < 16 and l < n (n <= 16; lanes past n are not written):
/// a 16 x 16 block of floats transposed in registers. Packing a strip whose lines run along k (a
/// Linear's weight as op(B) = W^T, activations as op(A)) is this transpose. Element by element it
/// took 12% of the main job's LoRA step (perf); a 576 x 576 weight in L2 packs at 0.34 ns per
/// element that way, 0.24 this way, against 0.15 for a plain copy (Xeon model 207).
/// transpose16 from registers: line l of the block is r[l] (lines past n are not stored). The
/// quantized packer decodes its lines straight into r.
[[gnu::target("avx512f"), gnu::always_inline]] inline void transpose16_store(const __m512 (&r)[16], int n, float* dst,
                                                                           index L) {
  // the all-lanes zero-masked forms: GCC 12's plain ones read an undefined register (-Wuninitialized)
  constexpr __mmask16 all16 = 0xFFFF;
  constexpr __mmask8 all8 = 0xFF;
  __m512 t[16], u[16];
  // within each 128-bit lane q: t pairs lines (depths 4q..4q+3), u gathers 4 lines per depth
  NN_GEMM_UNROLL(8)
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_maskz_unpacklo_ps(all16, r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_maskz_unpackhi_ps(all16, r[2 * p], r[2 * p + 1]);
  }
  NN_GEMM_UNROLL(4)
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, a, c));      // depth 4q + 0 of lines 4g..4g+3
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, a, c));  // depth 4q + 1
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, b, d));  // depth 4q + 2
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, b, d));  // depth 4q + 3
  }
  // across lanes: depth 4q + e takes lane q of u[e], u[4 + e], u[8 + e], u[12 + e]
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  NN_GEMM_UNROLL(4)
  for (int e = 0; e < 4; ++e) {
    // EVEN_LANES(x, y): 128-bit lanes x0 x2 y0 y2; ODD_LANES(x, y): x1 x3 y1 y3
#define NN_EVEN_LANES(x, y) _mm512_maskz_shuffle_f32x4(all16, x, y, 0x88)
#define NN_ODD_LANES(x, y) _mm512_maskz_shuffle_f32x4(all16, x, y, 0xDD)
    const __m512 w0 = NN_EVEN_LANES(u[e], u[4 + e]), w1 = NN_ODD_LANES(u[e], u[4 + e]);
    const __m512 w2 = NN_EVEN_LANES(u[8 + e], u[12 + e]), w3 = NN_ODD_LANES(u[8 + e], u[12 + e]);
    _mm512_mask_storeu_ps(dst + e * L, mask, NN_EVEN_LANES(w0, w2));
    _mm512_mask_storeu_ps(dst + (4 + e) * L, mask, NN_EVEN_LANES(w1, w3));
    _mm512_mask_storeu_ps(dst + (8 + e) * L, mask, NN_ODD_LANES(w0, w2));
    _mm512_mask_storeu_ps(dst + (12 + e) * L, mask, NN_ODD_LANES(w1, w3));
#undef NN_EVEN_LANES
#undef NN_ODD_LANES
  }
}
[[gnu::target("avx512f")]] inline void transpose16(const float* src, index ld, int n, float* dst, index L) {
  __m512 r[16];
  NN_GEMM_UNROLL(16)
  for (int l = 0; l < 16; ++l) r[l] = l < n ? _mm512_loadu_ps(src + l * ld) : _mm512_setzero_ps();
  transpose16_store(r, n, dst, L);
}
#endif

#if defined(__x86_64__) || defined(__i386__)
/// dst[d * L + l] = src[l * ld + d] for d < 8 and l < n (n <= 8; lanes past n are not written):
/// transpose16's AVX2 form, an 8 x 8 block of floats transposed in registers.
/// transpose8 from registers: line l of the block is r[l] (lines past n are not stored). The
/// quantized packer decodes its lines straight into r.
[[gnu::target("avx2"), gnu::always_inline]] inline void transpose8_store(const __m256 (&r)[8], int n, float* dst,
                                                                        index L) {
  __m256 t[8], u[8];
  // within each 128-bit half (depths 0-3 | 4-7): t pairs lines, u gathers 4 lines per depth
  NN_GEMM_UNROLL(4)
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);      // depths 0, 1 | 4, 5 of 2 lines
    t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);  // depths 2, 3 | 6, 7
  }
  NN_GEMM_UNROLL(2)
  for (int g = 0; g < 2; ++g) {
    u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);          // depth 0 | 4 of lines 4g..4g+3
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);      // depth 1 | 5
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);  // depth 2 | 6
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);  // depth 3 | 7
  }
  NN_GEMM_UNROLL(8)
  for (int d = 0; d < 8; ++d) {
    // depth d: its half of u[d % 4] (lines 0-3) beside the same half of u[4 + d % 4] (lines 4-7)
    const __m256 v = d < 4 ? _mm256_permute2f128_ps(u[d], u[4 + d], 0x20)
                           : _mm256_permute2f128_ps(u[d - 4], u[d], 0x31);
    float* o = dst + d * L;
    if (n == 8) {
      _mm256_storeu_ps(o, v);
    } else if (n == 6) {  // an AVX2 A panel (MR = 6): plain stores, not a masked one
      _mm_storeu_ps(o, _mm256_castps256_ps128(v));
      _mm_storel_pi(reinterpret_cast<__m64*>(o + 4), _mm256_extractf128_ps(v, 1));
    } else {
      alignas(32) float row[8];
      _mm256_store_ps(row, v);
      for (int l = 0; l < n; ++l) o[l] = row[l];
    }
  }
}
[[gnu::target("avx2"), gnu::always_inline]] inline void transpose8(const float* src, index ld, int n, float* dst,
                                                                  index L) {
  __m256 r[8];
  NN_GEMM_UNROLL(8)
  for (int l = 0; l < 8; ++l) r[l] = l < n ? _mm256_loadu_ps(src + l * ld) : _mm256_setzero_ps();
  transpose8_store(r, n, dst, L);
}

/// pack_panel's L full lines running along k (src + l*ld + k) on AVX2: 8 depths x 8 lines at a
/// time through transpose8, each panel row stored whole, each line's 16 depths (a cache line) read
/// at once. The element loop it replaces packed a 576 x 576 weight at 0.34 ns per element built
/// for the baseline and at 1.1 built -march=native (GCC turns the strided reads into vgatherdps,
/// slow on Zen 3); this way 0.17-0.20 either way, against 0.14 for a memcpy of the same matrix
/// (AMD EPYC family 25 model 1; 8 depths at a time: 0.26).
template <int L>
[[gnu::target("avx2")]] void pack_lines_avx2(const float* src, index ld, index kc, float* dst) {
  const index k16 = kc / 16 * 16, k8 = kc / 8 * 8;
  for (index k = 0; k < k16; k += 16) {
    NN_GEMM_UNROLL(4)
    for (int l0 = 0; l0 < L; l0 += 8) {
      transpose8(src + l0 * ld + k, ld, std::min(8, L - l0), dst + k * L + l0, L);
      transpose8(src + l0 * ld + k + 8, ld, std::min(8, L - l0), dst + (k + 8) * L + l0, L);
    }
  }
  for (index k = k16; k < k8; k += 8) {
    NN_GEMM_UNROLL(4)
    for (int l0 = 0; l0 < L; l0 += 8) transpose8(src + l0 * ld + k, ld, std::min(8, L - l0), dst + k * L + l0, L);
  }
  for (index k = k8; k < kc; ++k)
    for (int l = 0; l < L; ++l) dst[k * L + l] = src[l * ld + k];
}
#endif

template <int L, class S, class T>
inline void pack_panel(const S* src, index ld, bool contiguous, index n, index kc, T* dst) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (std::is_same_v<S, float> && std::is_same_v<T, float>) {
    if (!contiguous && n == L && kc >= 8 && pack_avx2()) {
      pack_lines_avx2<L>(src, ld, kc, dst);
      return;
    }
    if (!contiguous && n == L && kc >= 16 && pack_avx512()) {
      const index k16 = kc / 16 * 16;
      // 16 lines x 16 depths at a time, each line read front to back; the blocks of one 16 depths
      // side by side, so each panel row is stored whole while its line is in L1 (line blocks in
      // the outer loop wrote each half apart: 0.22 ns per element for a 576 x 576 weight in L2,
      // this way 0.18, Xeon model 167)
      for (index k = 0; k < k16; k += 16)
        for (int l0 = 0; l0 < L; l0 += 16) transpose16(src + l0 * ld + k, ld, std::min(16, L - l0), dst + k * L + l0, L);
      for (index k = k16; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = src[l * ld + k];
      return;
    }
  }
#endif
  if (n == L) {
    // full panels (all but the edge): constant trip counts the compiler unrolls and vectorises
    if (contiguous) {  // bf16 widened (lines of one type go to pack_side_by_side)
      for (index k = 0; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = widen<T>(src[k * ld + l]);
    } else {
      // 16 depths at a time: each line's 16 values are one cache line
      index k = 0;
      for (; k + 16 <= kc; k += 16)
        for (int u = 0; u < 16; ++u) {
          T* d = dst + (k + u) * L;
          NN_GEMM_UNROLL(32)
          for (int l = 0; l < L; ++l) d[l] = widen<T>(src[l * ld + k + u]);
        }
      for (; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = widen<T>(src[l * ld + k]);
    }
    return;
  }
  for (index k = 0; k < kc; ++k) {
    T* d = dst + k * L;
    for (index l = 0; l < n; ++l) d[l] = widen<T>(contiguous ? src[k * ld + l] : src[l * ld + k]);
    for (index l = n; l < L; ++l) d[l] = T(0);
  }
}

/// Packs n lines that lie side by side at each depth (src + k*ld: line l at depth k is
/// src[k * ld + l]) into ceil(n / L) panels of kc x L at dst, lines past n zero. Eight depths at a
/// time, across all the panels: the eight source rows are read front to back (streams the
/// prefetcher follows) and each panel gets eight depths, whole cache lines, at once. (Panel by
/// panel, a panel's kc reads were a row apart each, a cache line apiece that no prefetcher follows
/// on a wide matrix -- the head's dY^T rows are 32 KB apart -- and made pack_a 5.5% of the
/// decoder's full step, Xeon model 167. Eight panels at a time over all depths took it to 3.6%,
/// and still left the head's dW = dY^T X (8192 x 256 x 1024) at 213 GFLOP/s where this order gives
/// 222-227, Zen 5.)
template <int L, class T>
void pack_side_by_side(const T* src, index ld, index n, index kc, T* dst) {
  constexpr index kDepths = 8;
  const index full = n / L * L;
  for (index k0 = 0; k0 < kc; k0 += kDepths) {
    const index k1 = std::min(kc, k0 + kDepths);
    index p = 0;
    for (; p < full; p += L) {
      T* d = dst + p * kc;
      for (index k = k0; k < k1; ++k) std::memcpy(d + k * L, src + k * ld + p, sizeof(T) * L);
    }
    if (p < n) {
      T* d = dst + p * kc;
      for (index k = k0; k < k1; ++k) {
        std::memcpy(d + k * L, src + k * ld + p, sizeof(T) * static_cast<std::size_t>(n - p));
        std::fill_n(d + k * L + (n - p), L - (n - p), T(0));
      }
    }
  }
}

/// Packs op(A)[i0 : i0+mc, k0 : k0+kc] into MR-row panels at dst.
template <int MR, class T>
void pack_a(const Matrix<T>& A, index i0, index mc, index k0, index kc, T* dst) {
  if (A.trans) {  // op(A) = X^T (a weight gradient's dY^T): depth k's rows lie side by side in X's row k
    pack_side_by_side<MR>(A.p + k0 * A.ld + i0, A.ld, mc, kc, dst);
    return;
  }
  for (index p = 0; p < mc; p += MR, dst += kc * MR) {
    const index rows = std::min<index>(MR, mc - p);
    pack_panel<MR>(A.p + (i0 + p) * A.ld + k0, A.ld, false, rows, kc, dst);  // each row runs along k
  }
}

/// Packs op(B)[k0 : k0+kc, j0 : j0+nc] into NR-column panels at dst (of T; B's elements widened
/// to it, see widen()).
template <int NR, class S, class T>
void pack_b(const Matrix<S>& B, index k0, index kc, index j0, index nc, T* dst) {
  if constexpr (std::is_same_v<S, T>) {
    if (!B.trans) {  // op(B) = X: depth k's columns lie side by side in X's row k
      pack_side_by_side<NR>(B.p + k0 * B.ld + j0, B.ld, nc, kc, dst);
      return;
    }
  }
  for (index q = 0; q < nc; q += NR, dst += kc * NR) {
    const index cols = std::min<index>(NR, nc - q);
    // op(B) = X^T (a Linear's weight): column c of the panel is row j0+q+c of X, running along k
    const S* src = B.trans ? B.p + (j0 + q) * B.ld + k0 : B.p + k0 * B.ld + j0 + q;
    pack_panel<NR>(src, B.ld, !B.trans, cols, kc, dst);
  }
}

/// The dense packers as the driver calls them: pack(dst, outer0, outer_n, k0, kc).
template <int MR, class T>
struct DensePackA {
  Matrix<T> m;
  void operator()(T* dst, index i0, index mc, index k0, index kc) const { pack_a<MR>(m, i0, mc, k0, kc, dst); }
  /// Row i0 of op(A) from column k0, read in place by the direct kernel (null when op(A) is
  /// transposed: its rows are not contiguous). A packer without this method is always packed.
  const T* rows(index i0, index k0) const { return m.trans ? nullptr : m.p + i0 * m.ld + k0; }
  index ld() const { return m.ld; }
};

// ---- epilogues ------------------------------------------------------------------------------
// An epilogue runs on each micro-tile of C once its last K slice is in, while the tile is still in
// L1: epi(c, ldc, i, j, rows, cols) for the tile at C(i, j) (whole-product coordinates), rows x
// cols of it valid. This is where a bias, a scale or a residual fuses into the product instead of
// taking another pass over C; the default does nothing and compiles away.
struct NoEpilogue {
  template <class T>
  void operator()(T*, index, index, index, index, index) const {}
};

/// c = scale * c + bias[j] + residual[i, j] (each part optional): a Linear's bias, a residual
/// stream's add, a LoRA update already in C scaled (y = x W^T + b + r, or C (+)= alpha op(A) op(B)).
template <class T>
struct BiasResidual {
  const T* bias = nullptr;      // (N), or null
  const T* residual = nullptr;  // (M, N) with row stride ldr, or null; may be C itself only if read first
  index ldr = 0;
  T scale = T(1);
  void operator()(T* c, index ldc, index i0, index j0, index rows, index cols) const {
    for (index r = 0; r < rows; ++r) {
      T* row = c + r * ldc;
      const T* res = residual ? residual + (i0 + r) * ldr + j0 : nullptr;
      for (index q = 0; q < cols; ++q) {
        T v = scale == T(1) ? row[q] : scale * row[q];
        if (bias) v += bias[j0 + q];
        if (res) v += res[q];
        row[q] = v;
      }
    }
  }
};

/// An epilogue seen from a sub-product whose C starts at (di, dj) of the whole.
template <class Epi>
struct ShiftedEpilogue {
  const Epi& epi;
  index di, dj;
  template <class T>
  void operator()(T* c, index ldc, index i, index j, index rows, index cols) const {
    epi(c, ldc, i + di, j + dj, rows, cols);
  }
};

template <class Epi>
inline constexpr bool is_no_epilogue = std::is_same_v<Epi, NoEpilogue>;

/// Where block_product finds its operands. A: ceil(mc/MR) packed panels of kc x MR at abuf, except
/// full panels read in place (the direct kernel) from op(A)'s rows at a_rows + ir*lda when set. B:
/// ceil(nc/NR) packed panels of kc x NR at bbuf, except full panels read in place from op(B)'s
/// rows at b + jr (depth k at + k*ldb) when set. Ragged panels are always packed, at the place
/// they would have among the others.
template <class T>
struct BlockOperands {
  T* abuf;
  T* bbuf;
  const T* a_rows = nullptr;
  index lda = 0;
  const T* b = nullptr;
  index ldb = 0;
};

/// Runs C[0:mc, 0:nc] (+)= (A block, mc x kc) @ (B block, kc x nc) tile by tile, the operands where
/// `op` says. An edge tile is computed whole into `tile` and its valid part copied. On the last K
/// slice (`last`) each tile then gets the epilogue, at whole-product offset (ci, cj).
template <class T, class S, class Epi = NoEpilogue>
void block_product(const Kernels<T>& kern, index mc, index nc, index kc, const BlockOperands<T>& op, T* C, index ldc,
                   bool overwrite, T* tile, const Epi& epi = {}, bool last = false, index ci = 0, index cj = 0) {
  constexpr int MR = S::MR, NR = S::NR;
  for (index ir = 0; ir < mc; ir += MR) {
    const index rows = std::min<index>(MR, mc - ir);
    const bool direct = op.a_rows && rows == MR;
    const T* ap = direct ? op.a_rows + ir * op.lda : op.abuf + ir * kc;
    const auto fn = direct ? kern.direct : kern.packed;
    for (index jr = 0; jr < nc; jr += NR) {
      const index cols = std::min<index>(NR, nc - jr);
      const bool b_in_place = op.b && cols == NR;
      const T* bp = b_in_place ? op.b + jr : op.bbuf + jr * kc;
      const index ldb = b_in_place ? op.ldb : NR;
      T* c = C + ir * ldc + jr;
      if (rows == MR && cols == NR) {
        fn(kc, ap, op.lda, bp, ldb, c, ldc, overwrite);
      } else {
        fn(kc, ap, op.lda, bp, ldb, tile, NR, true);
        for (index r = 0; r < rows; ++r)
          for (index q = 0; q < cols; ++q)
            c[r * ldc + q] = overwrite ? tile[r * NR + q] : c[r * ldc + q] + tile[r * NR + q];
      }
      if constexpr (!is_no_epilogue<Epi>)
        if (last) epi(c, ldc, ci + ir, cj + jr, rows, cols);
    }
  }
}

/// The epilogue over all of C (M x N): for a product with K = 0, whose C gets no tiles.
template <class T, class Epi>
void epilogue_all(const Epi& epi, T* C, index ldc, index M, index N) {
  if constexpr (!is_no_epilogue<Epi>)
    if (M > 0 && N > 0) epi(C, ldc, index(0), index(0), M, N);
}

/// Packs what block_product reads of A rows [i0, i0+mc), depth [k0, k0+kc) and sets op's A part:
/// every panel into op.abuf, or, when A is read in place (C narrow: at most 8 NR-wide panels, where
/// packing A would cost as much as the product), only a ragged last panel.
template <class T, class S, class PackA>
void prepare_a(const PackA& pack_a_fn, index N, index i0, index mc, index k0, index kc, BlockOperands<T>& op) {
  constexpr int MR = S::MR;
  op.a_rows = nullptr;
  if constexpr (requires { pack_a_fn.rows(i0, k0); }) {
    if (N <= 8 * S::NR && (op.a_rows = pack_a_fn.rows(i0, k0))) {
      op.lda = pack_a_fn.ld();
      const index full = mc / MR * MR;
      if (full < mc) pack_a_fn(op.abuf + full * kc, i0 + full, mc - full, k0, kc);
      return;
    }
  }
  pack_a_fn(op.abuf, i0, mc, k0, kc);
}

/// Rows of A up to which B is read in place rather than packed: a packed B panel pays for itself
/// by being read once per MR-row A panel from compact, L1-friendly lines; with a few A panels
/// (attention's blocks, LoRA's rank-r products) the packing costs more than it saves. Beyond,
/// strided in-place reads are slower (Xeon model 167: -5 to -30% on 256..1024-row products).
inline constexpr index kInPlaceBRows = 48;

/// The same for B's columns [j0, j0+nc) (or, in a team, the panels [p0, p1) of them this thread
/// packs) for an A block of `a_rows` rows: in place when the packer offers op(B)'s rows (op(B) = X,
/// same type) and a_rows <= kInPlaceBRows; then only a ragged last panel is packed.
template <class T, class S, class PackB>
void prepare_b(const PackB& pack_b_fn, index a_rows, index j0, index nc, index k0, index kc, BlockOperands<T>& op,
               index p0 = 0, index p1 = -1) {
  constexpr int NR = S::NR;
  if (p1 < 0) p1 = (nc + NR - 1) / NR;
  op.b = nullptr;
  if constexpr (requires { pack_b_fn.rows(j0, k0); })
    if (a_rows <= kInPlaceBRows && (op.b = pack_b_fn.rows(j0, k0))) {
      op.ldb = pack_b_fn.ld();
      p0 = std::max(p0, nc / NR);  // full panels are read in place
    }
  if (p0 < p1) pack_b_fn(op.bbuf + p0 * NR * kc, j0 + p0 * NR, std::min(nc, p1 * NR) - p0 * NR, k0, kc);
}

template <int NR, class T, class S = T>
struct DensePackB {
  Matrix<S> m;
  void operator()(T* dst, index j0, index nc, index k0, index kc) const { pack_b<NR>(m, k0, kc, j0, nc, dst); }
  /// op(B)(k0, j0) when op(B) = X holds T: depth k's columns lie side by side in X's row k, ld()
  /// apart, read in place by the kernels (null when op(B) is transposed: a Linear's weight).
  const T* rows(index j0, index k0) const
    requires std::is_same_v<S, T>
  {
    return m.trans ? nullptr : m.p + k0 * m.ld + j0;
  }
  index ld() const { return m.ld; }
};

// ---- the blocked driver --------------------------------------------------------------------

/// C[M x N] (row stride ldc) (+)= op(A) @ op(B) on the calling thread, with the micro-kernels of
/// shape S (a Shape<T, Isa>). Loops, outer to inner: A blocks of MB rows; K in KC slices (pack A);
/// B blocks of NB columns (pack B, kept in L2); A panels (one MR x KC panel stays in L1); B panels
/// -> micro-kernel. pack_a / pack_b follow the DensePack* contract, so packed layouts can come
/// from elsewhere (dequantized weights).
template <class T, class S, class PackA, class PackB, class Epi = NoEpilogue>
void gemm_blocked(const Kernels<T>& kern, index M, index N, index K, const PackA& pack_a_fn, const PackB& pack_b_fn,
                  T* C, index ldc, bool acc, const Epi& epi = {}) {
  constexpr int MR = S::MR, NR = S::NR;
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc)
      for (index i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
    epilogue_all(epi, C, ldc, M, N);
    return;
  }
  const index mb = std::min<index>(S::MB, (M + MR - 1) / MR * MR);
  const index nb = std::min<index>(S::NB, (N + NR - 1) / NR * NR);
  const index kcap = std::min<index>(S::KC, K);
  const std::size_t a_bytes = (static_cast<std::size_t>(mb * kcap) * sizeof(T) + 63) / 64 * 64;
  const std::size_t b_bytes = (static_cast<std::size_t>(nb * kcap) * sizeof(T) + 63) / 64 * 64;
  auto* ws = static_cast<char*>(detail::gemm_workspace(a_bytes + b_bytes + sizeof(T) * MR * NR));
  T* abuf = reinterpret_cast<T*>(ws);
  T* bbuf = reinterpret_cast<T*>(ws + a_bytes);
  T* tile = reinterpret_cast<T*>(ws + a_bytes + b_bytes);
  BlockOperands<T> op{abuf, bbuf};
  for (index i0 = 0; i0 < M; i0 += mb) {
    const index mc = std::min(mb, M - i0);
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0);
      const bool overwrite = !acc && k0 == 0;
      prepare_a<T, S>(pack_a_fn, N, i0, mc, k0, kc, op);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        prepare_b<T, S>(pack_b_fn, mc, j0, nc, k0, kc, op);
        block_product<T, S>(kern, mc, nc, kc, op, C + i0 * ldc + j0, ldc, overwrite, tile, epi, k0 + kc == K, i0, j0);
      }
    }
  }
}

#if defined(_OPENMP)
/// gemm_blocked for a team of `threads` OpenMP threads: each thread owns a slice of C's rows (whole
/// MR tiles) and packs its own A panels; each B block is packed once, its panels shared out over
/// the team, into one buffer they all read (two barriers per block). Every C element sees the same
/// panels and k order as in gemm_blocked, so the result is bit-identical to the serial product.
template <class T, class S, class PackA, class PackB, class Epi = NoEpilogue>
void gemm_team(int threads, const Kernels<T>& kern, index M, index N, index K, const PackA& pack_a_fn,
               const PackB& pack_b_fn, T* C, index ldc, bool acc, const Epi& epi = {}) {
  constexpr int MR = S::MR, NR = S::NR;
  const index nb = std::min<index>(S::NB, (N + NR - 1) / NR * NR);
  const index kcap = std::min<index>(S::KC, K);
  const index rows_per = ((M + threads - 1) / threads + MR - 1) / MR * MR;
  T* bbuf = static_cast<T*>(detail::gemm_workspace(static_cast<std::size_t>(nb * kcap) * sizeof(T), 1));
  detail::team(threads, [&](int thread, int team_size) {
    const index t = thread, nt = team_size;
    const index r0 = std::min(M, t * rows_per), r1 = std::min(M, r0 + rows_per), mine = r1 - r0;
    const index a_rows_n = std::max<index>((mine + MR - 1) / MR * MR, MR);
    const std::size_t a_bytes = (static_cast<std::size_t>(a_rows_n * kcap) * sizeof(T) + 63) / 64 * 64;
    auto* ws = static_cast<char*>(detail::gemm_workspace(a_bytes + sizeof(T) * MR * NR));
    T* abuf = reinterpret_cast<T*>(ws);
    T* tile = reinterpret_cast<T*>(ws + a_bytes);
    BlockOperands<T> op{abuf, bbuf};
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0);
      const bool overwrite = !acc && k0 == 0;
      if (mine > 0) prepare_a<T, S>(pack_a_fn, N, r0, mine, k0, kc, op);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        const index panels = (nc + NR - 1) / NR, per = (panels + nt - 1) / nt;
        const index p0 = std::min(panels, t * per), p1 = std::min(panels, p0 + per);
        prepare_b<T, S>(pack_b_fn, rows_per, j0, nc, k0, kc, op, p0, p1);
#pragma omp barrier
        if (mine > 0)
          block_product<T, S>(kern, mine, nc, kc, op, C + r0 * ldc + j0, ldc, overwrite, tile, epi, k0 + kc == K, r0,
                              j0);
#pragma omp barrier
      }
    }
  });
}
#endif

/// The kernel set in use for T (NN_CPU_ISA may lower it; see cpu_info.hpp), read once.
inline Isa active_isa() { return detail::active_isa(); }

/// f.template operator()<I>() for the run-time ISA `isa`: one instantiation per kernel set.
template <class F>
decltype(auto) with_isa(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f.template operator()<Isa::avx512>();
    case Isa::avx2: return f.template operator()<Isa::avx2>();
    case Isa::generic: break;
  }
  return f.template operator()<Isa::generic>();
}

/// Row-major C[M x N] (row stride ldc) (+)= op(A) @ op(B) with the dense packers, on the calling
/// thread, with the micro-kernel of `isa`; then the epilogue on each finished tile.
template <class T, class Epi = NoEpilogue>
void gemm_serial(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                 T* C, index ldc, bool acc, const Epi& epi = {}) {
  const Matrix<T> a{A, lda, ta}, b{B, ldb, tb};
  with_isa(isa, [&]<Isa I>() {
    using S = Shape<T, I>;
    gemm_blocked<T, S>(micro_kernels<T, I>(), M, N, K, DensePackA<S::MR, T>{a}, DensePackB<S::NR, T>{b}, C, ldc, acc,
                       epi);
  });
}

/// The OpenMP team a product of M x N x K pays for from the calling thread: one thread per 2^18
/// multiply-adds (below that a team costs more than it saves), and at least two 12-row tiles (or
/// one 64-column strip) per thread; 1 inside a parallel region.
inline int team_threads(index M, index N, index K) {
#if defined(_OPENMP)
  if (omp_in_parallel() || M <= 0 || N <= 0 || K <= 0) return 1;
  const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  return std::max(1, static_cast<int>(std::min<double>({static_cast<double>(detail::free_threads()), work / 262144.0,
                                                        static_cast<double>(std::max(M / 24, N / 64))})));
#else
  (void)M, (void)N, (void)K;
  return 1;
#endif
}

/// part(d0, d1) for column ranges of whole 32-wide tiles, one per thread of a team of `threads`:
/// how a short, wide product (too few rows to share out) is split, each thread packing its own.
template <class F>
void split_columns(int threads, index N, F&& part) {
  detail::team(threads, [&](int t, int nt) {
    const index per = ((N + nt - 1) / nt + 31) / 32 * 32;
    const index d0 = std::min(N, t * per), d1 = std::min(N, d0 + per);
    if (d0 < d1) part(d0, d1);
  });
}

/// Whether C (M x N) is so much narrower than a micro-tile (N < NR, and fewer MR-row tiles would
/// hold N than NR-column ones: a LoRA rank, a classifier's outputs) while tall (M >= 2 NR) that
/// its transpose C^T = op(B)^T op(A)^T fills the tiles better: at rank 8 a 12 x 32 tile runs 8 of
/// its 32 columns, its transpose 8 of 12 rows.
template <class T>
bool narrow_product(Isa isa, index M, index N) {
  return with_isa(isa, [&]<Isa I>() {
    using S = Shape<T, I>;
    return N < S::NR && M >= 2 * S::NR && (N + S::MR - 1) / S::MR * S::MR < S::NR;
  });
}

/// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols.
template <class T>
void transpose_copy(const T* src, index lds, index rows, index cols, T* dst, index ldd) {
  for (index r = 0; r < rows; ++r)
    for (index c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

/// The same, on a team of OpenMP threads (when not already inside a parallel region, and the
/// product is big enough to pay for one): C's rows split over the team, B's packed panels shared
/// (gemm_team); bit-identical to gemm_serial, epilogue included. A narrow_product runs as its
/// transpose into scratch (seeded with C^T when accumulating), then copied back: each element
/// still sums the same products in the same order, so this too is bit-identical.
template <class T, class Epi = NoEpilogue>
void gemm_parallel(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                   T* C, index ldc, bool acc, const Epi& epi = {}) {
  if (K > 0 && narrow_product<T>(isa, M, N)) {
    T* ct = static_cast<T*>(detail::gemm_workspace(sizeof(T) * static_cast<std::size_t>(M * N), 3));  // C^T: (N, M)
    if (acc) transpose_copy(C, ldc, M, N, ct, M);
    gemm_parallel<T>(isa, !tb, !ta, N, M, K, B, ldb, A, lda, ct, M, acc);
    transpose_copy(ct, M, N, M, C, ldc);
    epilogue_all(epi, C, ldc, M, N);
    return;
  }
  const int threads = team_threads(M, N, K);
  if (threads > 1 && M < 24 * threads) {
    split_columns(threads, N, [&](index d0, index d1) {
      gemm_serial<T>(isa, ta, tb, M, d1 - d0, K, A, lda, B + (tb ? d0 * ldb : d0), ldb, C + d0, ldc, acc,
                     ShiftedEpilogue<Epi>{epi, 0, d0});
    });
    return;
  }
#if defined(_OPENMP)
  if (threads > 1) {
    const Matrix<T> a{A, lda, ta}, b{B, ldb, tb};
    with_isa(isa, [&]<Isa I>() {
      using S = Shape<T, I>;
      gemm_team<T, S>(threads, micro_kernels<T, I>(), M, N, K, DensePackA<S::MR, T>{a}, DensePackB<S::NR, T>{b}, C,
                      ldc, acc, epi);
    });
    return;
  }
#endif
  gemm_serial<T>(isa, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc, epi);
}

/// A batch of products with the same shape, item b at A + b*sa, B + b*sb, C + b*sc: one kernel
/// choice for all, and when each item is too small for a thread team of its own (attention's
/// per-head blocks, a model's batched small matrices), the items shared out over the team, each
/// the single-thread product gemm_parallel would run for it; so bit-identical to calling
/// gemm_parallel per item. Items must not share C (a batch summed into one C is a loop of
/// accumulating calls).
template <class T>
void gemm_batched(Isa isa, index batch, bool ta, bool tb, index M, index N, index K, const T* A, index sa, index lda,
                  const T* B, index sb, index ldb, T* C, index sc, index ldc, bool acc) {
#if defined(_OPENMP)
  int threads = 1;
  if (batch > 1 && team_threads(M, N, K) == 1 && !omp_in_parallel()) {
    const double work = static_cast<double>(batch) * static_cast<double>(M) * static_cast<double>(N) *
                        static_cast<double>(K);
    threads = static_cast<int>(std::min<double>({static_cast<double>(detail::free_threads()),
                                                 static_cast<double>(batch), std::max(1.0, work / 262144.0)}));
  }
  if (threads > 1) {
    detail::team(threads, [&](int, int) {
#pragma omp for schedule(static)
      for (index b = 0; b < batch; ++b)
        gemm_serial<T>(isa, ta, tb, M, N, K, A + b * sa, lda, B + b * sb, ldb, C + b * sc, ldc, acc);
    });
    return;
  }
#endif
  for (index b = 0; b < batch; ++b)
    gemm_parallel<T>(isa, ta, tb, M, N, K, A + b * sa, lda, B + b * sb, ldb, C + b * sc, ldc, acc);
}

// ---- bf16 operands, f32 accumulation -------------------------------------------------------
// Precision::bf16 stores frozen weights in bfloat16 (raw bits in std::uint16_t), and autocast
// rounds float32 weights; either way activations rounded to bf16 multiply them with f32
// accumulation: PyTorch's bf16 autocast contract for a product. Three kernels (Bf16Kernel), equal
// up to the order of f32 additions:
//  - AMX (namespace amx below): bf16 tiles, where the CPU has AMX-BF16 and the OS grants it.
//  - vdpbf16ps, where the CPU has AVX512_BF16: pairs of bf16 (two depths per 32-bit lane) into
//    f32 lanes. A and B panels hold pairs of depths: word (kp, i) = bf16(X(i, 2kp)) |
//    bf16(X(i, 2kp + 1)) << 16.
//  - emulated, on every CPU: the f32 micro-kernels on panels whose values are rounded to bf16 (or
//    widened from it) while packing; bit-identical to the f32 product of the rounded operands.
// The last two reuse the f32 driver (gemm_blocked / gemm_team): a pair panel of kc depths uses the
// first half of the kc x MR floats the driver sets aside for it.

using bf16 = std::uint16_t;

/// Emulated: the f32 packer `Pack` (DensePackA or DensePackB, L-wide panels), then every packed
/// value rounded to bf16. (No in-place rows(): every value must pass through the rounding.)
template <int L, class Pack>
struct Bf16Rounded {
  Pack pack;
  void operator()(float* dst, index o0, index on, index k0, index kc) const {
    pack(dst, o0, on, k0, kc);
    const index n = (on + L - 1) / L * L * kc;
    for (index i = 0; i < n; ++i) dst[i] = half::bf16_round(dst[i]);
  }
};

typedef std::uint32_t pair_word __attribute__((may_alias));  // two bf16 read as one 32-bit lane

#if defined(__x86_64__) || defined(__i386__)
/// vpermw's order that interleaves two rows converted together (vcvtne2ps2bf16: the even depth's
/// 16 bf16 low, the odd one's high) into 16 pair words: word j = bf16 j of each.
alignas(64) inline constexpr std::uint16_t kPairInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                                  21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/// One Bf16PairPackA panel with AVX512_BF16: rows r0..r0+rows (rows <= MR <= 16) of op(A) at
/// depths k0..k0+kc, word (kp, i) at w[kp * MR + i], zero past the edges. vcvtne2ps2bf16 rounds
/// to nearest even and, like every AVX512_BF16 conversion, flushes float32 denormals to zero (as
/// the B and AMX packers do). Element by element, with the scalar rounding, this packing was 21% of
/// the main job's bf16 LoRA step (perf, Zen 5 family 26 model 2).
///  - op(A) = X (activations, dY): a row's pairs lie side by side, so 32 depths convert to its 16
///    words at once; MR such vectors, one per row, are transposed (transpose16_store) into place.
///  - op(A) = X^T (a weight gradient's dY^T): depth k's rows lie side by side in X's row k, so X's
///    rows 2kp and 2kp + 1 convert together and interleave (vpermw) into pair kp's MR words.
template <int MR>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]] inline void pack_pair_rows(
    const Matrix<float>& m, index r0, index rows, index k0, index kc, pair_word* w) {
  static_assert(MR <= 16);
  const index pairs = (kc + 1) / 2;
  if (m.trans) {
    const __m512i inter = _mm512_load_si512(kPairInterleave);
    const __mmask16 in_rows = static_cast<__mmask16>((1u << rows) - 1), out = static_cast<__mmask16>((1u << MR) - 1);
    for (index kp = 0; kp < pairs; ++kp) {
      const float* even = m.p + (k0 + 2 * kp) * m.ld + r0;
      const __m512 lo = _mm512_maskz_loadu_ps(in_rows, even);
      const __m512 hi = 2 * kp + 1 < kc ? _mm512_maskz_loadu_ps(in_rows, even + m.ld) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(w + kp * MR, out, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
    return;
  }
  for (index kp0 = 0; kp0 < pairs; kp0 += 16) {
    // depths 2 kp0 .. 2 kp0 + 31 of each row, zero past kc
    const index left = kc - 2 * kp0;
    const __mmask16 m_lo = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    const __mmask16 m_hi = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = _mm512_setzero_ps();
      if (i < rows) {
        const float* src = m.p + (r0 + i) * m.ld + k0 + 2 * kp0;
        r[i] = (__m512)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m_hi, src + 16), _mm512_maskz_loadu_ps(m_lo, src));
      }
    }
    if (pairs - kp0 >= 16) {
      transpose16_store(r, MR, reinterpret_cast<float*>(w + kp0 * MR), MR);
    } else {  // the last pairs: the transpose writes 16 depths, the panel holds fewer
      alignas(64) pair_word tail[16 * MR];
      transpose16_store(r, MR, reinterpret_cast<float*>(tail), MR);
      std::memcpy(w + kp0 * MR, tail, sizeof(pair_word) * static_cast<std::size_t>((pairs - kp0) * MR));
    }
  }
}
#endif

/// Native: op(A) rows as bf16 pairs, zero past the edge (rows, and the odd last depth).
template <int MR>
struct Bf16PairPackA {
  Matrix<float> m;
  void operator()(float* dst, index i0, index mc, index k0, index kc) const {
    const index pairs = (kc + 1) / 2;
    for (index p = 0; p < mc; p += MR, dst += kc * MR) {
      auto* w = reinterpret_cast<pair_word*>(dst);
      const index rows = std::min<index>(MR, mc - p);
#if defined(__x86_64__) || defined(__i386__)
      if constexpr (MR <= 16) {  // this packer only runs where AVX512_BF16 does (gemm_bf16)
        pack_pair_rows<MR>(m, i0 + p, rows, k0, kc, w);
        continue;
      }
#endif
      for (index kp = 0; kp < pairs; ++kp)
        for (index i = 0; i < MR; ++i) {
          std::uint32_t lo = 0, hi = 0;
          if (i < rows) {
            const index r = i0 + p + i, k = k0 + 2 * kp;
            lo = half::f32_to_bf16(m.at(r, k));
            if (2 * kp + 1 < kc) hi = half::f32_to_bf16(m.at(r, k + 1));
          }
          w[kp * MR + i] = lo | hi << 16;
        }
    }
  }
};

/// The bf16 bits of a B element: bf16 as stored, f32 rounded to nearest even (autocast).
template <class S>
inline std::uint32_t bf16_bits(S v) {
  if constexpr (std::is_same_v<S, bf16>) return v;
  else return half::f32_to_bf16(v);
}

#if defined(__x86_64__) || defined(__i386__)
/// One Bf16PairPackB panel (NR = 32 columns j0.., depths k0..k0+kc) with AVX-512: word (kp, j) =
/// bits(op(B)(k0 + 2kp, j)) | bits(op(B)(k0 + 2kp + 1, j)) << 16, zero past the edges.
///  - op(B) = X^T (a Linear's weight, X[j][k]): each column's pairs lie side by side in X's row j.
///    bf16 rows are already pair words; f32 rows convert 32 floats to 16 words at a time
///    (vcvtne2ps2bf16: round to nearest even, denormals flushed) into a column-major scratch.
///    Either way a transposing copy of 32-bit words (pack_panel) lays the panel out.
///  - op(B) = X (X[k][j]): a pair interleaves rows k and k + 1, 16 columns at a time.
template <class S>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]] inline void pack_pair_panel(
    const Matrix<S>& m, index j0, index cols, index k0, index kc, pair_word* w) {
  constexpr int NR = 32;
  const index pairs = (kc + 1) / 2, even = kc / 2;
  auto bits = [&](index k, index c) -> std::uint32_t { return k < k0 + kc && c < j0 + cols ? bf16_bits(m.at(k, c)) : 0; };
  index kp = 0;
  if (m.trans && cols == NR) {
    if constexpr (std::is_same_v<S, bf16>) {
      if (m.ld % 2 == 0 && k0 % 2 == 0) {
        pack_panel<NR>(reinterpret_cast<const pair_word*>(m.p + j0 * m.ld + k0), m.ld / 2, false, cols, even, w);
        kp = even;
      }
    } else {
      // column j's words for pairs 0..full-1 (full: whole 16-word groups), then transposed
      const index full = even / 16 * 16;
      alignas(64) pair_word tmp[NR * 256];
      if (full > 0 && full <= 256) {
        for (index j = 0; j < NR; ++j) {
          const float* src = m.p + (j0 + j) * m.ld + k0;
          for (index q = 0; q < full; q += 16) {
            const __m512 lo = _mm512_loadu_ps(src + 2 * q), hi = _mm512_loadu_ps(src + 2 * q + 16);
            _mm512_store_si512(tmp + j * full + q, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
        }
        pack_panel<NR>(tmp, full, false, NR, full, w);
        kp = full;
      }
    }
  } else if (!m.trans) {
    for (; kp < even; ++kp) {
      const index k = k0 + 2 * kp;
      index j = 0;
      // (the zero-masked forms: GCC 12 warns that the unmasked ones read an undefined register)
      constexpr __mmask16 all = 0xFFFF;
      for (; j + 16 <= cols; j += 16) {
        __m256i lo16, hi16;
        if constexpr (std::is_same_v<S, bf16>) {
          lo16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.p + k * m.ld + j0 + j));
          hi16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.p + (k + 1) * m.ld + j0 + j));
        } else {
          lo16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(m.p + k * m.ld + j0 + j));
          hi16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(m.p + (k + 1) * m.ld + j0 + j));
        }
        const __m512i lo = _mm512_maskz_cvtepu16_epi32(all, lo16), hi = _mm512_maskz_cvtepu16_epi32(all, hi16);
        _mm512_storeu_si512(w + kp * NR + j, _mm512_or_si512(lo, _mm512_maskz_slli_epi32(all, hi, 16)));
      }
      for (; j < NR; ++j) w[kp * NR + j] = bits(k, j0 + j) | bits(k + 1, j0 + j) << 16;
    }
  }
  for (; kp < pairs; ++kp)
    for (index j = 0; j < NR; ++j) {
      const index k = k0 + 2 * kp;
      w[kp * NR + j] = bits(k, j0 + j) | bits(k + 1, j0 + j) << 16;
    }
}
#endif

/// Native: op(B) columns as bf16 pairs, from bf16 (a stored weight) or f32 (rounded, autocast),
/// one NR = 32 panel at a time (pack_pair_panel).
template <int NR, class S = bf16>
struct Bf16PairPackB {
  static_assert(NR == 32);
  Matrix<S> m;
  void operator()(float* dst, index j0, index nc, index k0, index kc) const {
#if defined(__x86_64__) || defined(__i386__)
    for (index q = 0; q < nc; q += NR, dst += kc * NR)
      pack_pair_panel(m, j0 + q, std::min<index>(NR, nc - q), k0, kc, reinterpret_cast<pair_word*>(dst));
#else
    (void)dst, (void)j0, (void)nc, (void)k0, (void)kc;
#endif
  }
};

#if defined(__x86_64__) || defined(__i386__)
/// The native micro-kernel: a 12 x 32 f32 tile of C from pair panels, 2 x 12 vdpbf16ps per pair.
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma")]] inline void micro_avx512_bf16(
    index kc, const float* a, index, const float* b, index, float* c, index ldc, bool overwrite) {
  // Pair panels are always packed (Bf16PairPack* offer nothing in place): steps MR and NR pairs.
  constexpr int MR = Shape<float, Isa::avx512>::MR, NR = Shape<float, Isa::avx512>::NR;
  static_assert(NR == 32);
  const auto* aw = reinterpret_cast<const pair_word*>(a);
  const auto* bw = reinterpret_cast<const pair_word*>(b);
  __m512 acc[MR][2];
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const index pairs = (kc + 1) / 2;
  for (index kp = 0; kp < pairs; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bw + kp * NR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bw + kp * NR + 16);
    NN_GEMM_UNROLL(16)
    for (int i = 0; i < MR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(aw[kp * MR + i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2; ++j) {
      __m512 v = acc[i][j];
      if (!overwrite) v = _mm512_add_ps(v, _mm512_loadu_ps(c + i * ldc + 16 * j));
      _mm512_storeu_ps(c + i * ldc + 16 * j, v);
    }
}
#endif

#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
// ---- AMX: bf16 tiles (Sapphire Rapids and later) --------------------------------------------
// A core's AMX unit multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 f32 in one
// instruction (tdpbf16ps): 16 times the multiply-adds of an AVX-512 FMA. The micro-tile is 32 x
// 32 of C in four accumulator tiles, fed per 32 depths by two A tiles (16 rows x 16 pairs each,
// row-major pairs: word (r, kp) = bf16(A(r, 2kp)) | bf16(A(r, 2kp + 1)) << 16) and two B tiles
// (16 pairs x 16 columns: Bf16PairPackB's panel layout, 32 columns per panel row).
namespace amx {

inline constexpr index MR = 32, NR = 32, KC = 512, NB = 256, MB = 256;  // KC: depths, a multiple of 32

/// Linux grants the AMX tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM for
/// XFEATURE_XTILEDATA), once per process for all its threads. False when the CPU or the OS (XCR0)
/// has no AMX-BF16, or the request is refused.
inline bool available() {
  static const bool ok = [] {
    const CpuFeatures f = detail::detect_cpu_features();
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return f.amx_tile && f.amx_bf16 && f.avx512_bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

/// Tiles 0-3: C (16 rows x 16 f32), 4-5: A, 6-7: B (16 rows x 64 bytes), set once per thread (the
/// configuration is thread state).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
[[gnu::target("amx-tile")]] inline void configure_thread() {
  // Static storage, not a local: GCC 12 does not see ldtilecfg read its operand and drops the
  // stores that fill a local configuration (the instruction then faults on garbage).
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  thread_local bool done = false;
  if (done) return;
  if (!available()) detail::fail("gemm", "AMX tiles are not available in this process (CPU, OS or permission)");
  _tile_loadconfig(&config);
  done = true;
}

/// C[32 x 32] (row stride ldc) (+)= A panel (32 rows x `pairs` words, row-major) @ B panel
/// (`pairs` x 32 words); pairs is a multiple of 16 (zero pairs pad the depth).
[[gnu::target("amx-tile,amx-bf16")]] inline void micro(index pairs, const pair_word* a, const pair_word* b, float* c,
                                                         index ldc, bool overwrite) {
  const long cs = ldc * 4, as = pairs * 4;
  if (overwrite) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, cs);
    _tile_loadd(1, c + 16, cs);
    _tile_loadd(2, c + 16 * ldc, cs);
    _tile_loadd(3, c + 16 * ldc + 16, cs);
  }
  for (index k = 0; k < pairs; k += 16) {
    _tile_loadd(4, a + k, as);
    _tile_loadd(5, a + 16 * pairs + k, as);
    _tile_loadd(6, b + k * NR, NR * 4);
    _tile_loadd(7, b + k * NR + 16, NR * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cs);
  _tile_stored(1, c + 16, cs);
  _tile_stored(2, c + 16 * ldc, cs);
  _tile_stored(3, c + 16 * ldc + 16, cs);
}

/// The pair words of 16 rows r0.. of a transposed A (op(A) = X^T, so depth k of those rows is
/// X's row k, the rows side by side) at `pairs` pair depths from k0, written to 16 panel rows
/// of stride p16: two X rows (depths 2kp, 2kp + 1) convert to 16 rows' words at once (one
/// vcvtne2ps2bf16, interleaved by vpermw), and 16 such vectors are a 16 x 16 block of words that
/// transpose16 turns into each row's run of 16 words. Rows past nr read as zero. pairs: a
/// multiple of 16.
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] inline void pack_a_transposed(const float* x, index ld,
                                                                                      index nr, index pairs,
                                                                                      index p16, pair_word* dst) {
  alignas(64) pair_word blk[16 * 16];
  const __m512i inter = _mm512_load_si512(kPairInterleave);
  const __mmask16 rows = static_cast<__mmask16>((1u << nr) - 1);
  for (index kp0 = 0; kp0 < pairs; kp0 += 16) {
    for (int u = 0; u < 16; ++u) {
      const float* even = x + 2 * (kp0 + u) * ld;
      const __m512 lo = _mm512_maskz_loadu_ps(rows, even), hi = _mm512_maskz_loadu_ps(rows, even + ld);
      _mm512_store_si512(blk + 16 * u, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
    transpose16(reinterpret_cast<const float*>(blk), 16, 16, reinterpret_cast<float*>(dst + kp0), p16);
  }
}

/// Packs op(A)[i0 : i0+mc, k0 : k0+kc] as row-major pair panels of 32 rows x p16 words, zero past
/// the edges. Full rows of an untransposed A convert 32 floats at a time (vcvtne2ps2bf16, round
/// to nearest even; like every AVX512_BF16 conversion it flushes float32 denormals to zero); a
/// transposed A (a weight gradient's dY^T) goes 16 rows x 32 depths at a time (pack_a_transposed).
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] inline void pack_a(const Matrix<float>& m, index i0, index mc,
                                                                           index k0, index kc, index p16,
                                                                           pair_word* dst) {
  const index vec_pairs = m.trans ? kc / 32 * 16 : 0;  // pairs the transposed path covers
  for (index p = 0; p < mc; p += MR, dst += MR * p16) {
    if (vec_pairs > 0)
      for (index r0 = 0; r0 < MR && p + r0 < mc; r0 += 16)
        pack_a_transposed(m.p + k0 * m.ld + i0 + p + r0, m.ld, std::min<index>(16, mc - p - r0), vec_pairs, p16,
                          dst + r0 * p16);
    for (index r = 0; r < MR; ++r) {
      pair_word* w = dst + r * p16;
      if (p + r >= mc) {
        std::fill_n(w, p16, 0u);
        continue;
      }
      const index row = i0 + p + r;
      index kp = vec_pairs;
      if (!m.trans)
        for (const float* src = m.p + row * m.ld + k0; 2 * kp + 32 <= kc; kp += 16) {
          const __m512 lo = _mm512_loadu_ps(src + 2 * kp), hi = _mm512_loadu_ps(src + 2 * kp + 16);
          _mm512_storeu_si512(w + kp, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      for (; kp < p16; ++kp) {
        const index k = 2 * kp;
        const std::uint32_t lo = k < kc ? half::f32_to_bf16(m.at(row, k0 + k)) : 0;
        const std::uint32_t hi = k + 1 < kc ? half::f32_to_bf16(m.at(row, k0 + k + 1)) : 0;
        w[kp] = lo | hi << 16;
      }
    }
  }
}

/// C[M x N] (row stride ldc) (+)= bf16(op(A)) @ op(B) on the calling thread: A blocks of MB rows,
/// K in KC slices (A packed), B blocks of NB columns (packed), 32 x 32 micro-tiles; an edge tile
/// is computed whole into a scratch tile and its valid part copied.
template <class SB>
void gemm(bool ta, bool tb, index M, index N, index K, const float* A, index lda, const SB* B, index ldb, float* C,
          index ldc, bool acc) {
  configure_thread();
  const Matrix<float> am{A, lda, ta};
  const Bf16PairPackB<NR, SB> pack_b{Matrix<SB>{B, ldb, tb}};
  const index kcap = std::min<index>(KC, (K + 31) / 32 * 32), pcap = kcap / 2;
  const index mb = std::min<index>(MB, (M + MR - 1) / MR * MR), nb = std::min<index>(NB, (N + NR - 1) / NR * NR);
  auto* a_blk = static_cast<pair_word*>(
      detail::gemm_workspace(sizeof(pair_word) * static_cast<std::size_t>(mb * pcap + pcap * nb + MR * NR)));
  pair_word* b_blk = a_blk + mb * pcap;
  float* tile = reinterpret_cast<float*>(b_blk + pcap * nb);
  for (index i0 = 0; i0 < M; i0 += mb) {
    const index mc = std::min(mb, M - i0);
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0), pairs = (kc + 1) / 2, p16 = (pairs + 15) / 16 * 16;
      const bool overwrite = !acc && k0 == 0;
      pack_a(am, i0, mc, k0, kc, p16, a_blk);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        for (index q = 0; q < nc; q += NR) {
          pair_word* bp = b_blk + q * p16;
          pack_b(reinterpret_cast<float*>(bp), j0 + q, std::min(NR, nc - q), k0, kc);
          std::fill(bp + pairs * NR, bp + p16 * NR, 0u);
        }
        for (index ir = 0; ir < mc; ir += MR)
          for (index jr = 0; jr < nc; jr += NR) {
            const pair_word *ap = a_blk + ir * p16, *bp = b_blk + jr * p16;
            const index rows = std::min(MR, mc - ir), cols = std::min(NR, nc - jr);
            float* c = C + (i0 + ir) * ldc + j0 + jr;
            if (rows == MR && cols == NR) {
              micro(p16, ap, bp, c, ldc, overwrite);
              continue;
            }
            micro(p16, ap, bp, tile, NR, true);
            for (index r = 0; r < rows; ++r)
              for (index x = 0; x < cols; ++x)
                c[r * ldc + x] = overwrite ? tile[r * NR + x] : c[r * ldc + x] + tile[r * NR + x];
          }
      }
    }
  }
}

}  // namespace amx
#endif

/// The bf16 product kernels: the f32 kernels on rounded/widened panels (every CPU), vdpbf16ps
/// (AVX512_BF16 with the AVX-512 set in use), AMX tiles (AMX-BF16, granted by the OS).
enum class Bf16Kernel : std::uint8_t { emulated, avx512_bf16, amx };

inline const char* bf16_kernel_name(Bf16Kernel k) {
  switch (k) {
    case Bf16Kernel::amx: return "amx tdpbf16ps";
    case Bf16Kernel::avx512_bf16: return "native vdpbf16ps";
    case Bf16Kernel::emulated: break;
  }
  return "emulated (f32 kernels)";
}

/// True when kernel k can run here (NN_CPU_ISA=avx2 or generic rules out both native ones).
inline bool bf16_kernel_available(Bf16Kernel k) {
  const bool avx512 = active_isa() == Isa::avx512 && detail::detect_cpu_features().avx512_bf16;
  switch (k) {
    case Bf16Kernel::emulated: return true;
    case Bf16Kernel::avx512_bf16: return avx512;
    case Bf16Kernel::amx:
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
      return avx512 && amx::available();
#else
      return false;
#endif
  }
  return false;
}

template <class SB>
void gemm_bf16(Isa isa, Bf16Kernel kernel, bool ta, bool tb, index M, index N, index K, const float* A, index lda,
               const SB* B, index ldb, float* C, index ldc, bool acc, bool parallel);

/// The bf16 kernel this process runs, decided once by measurement, not by CPU model: every kernel
/// that can run here times one L2-resident product (64 x 256 x 512, best of 5, well under a
/// millisecond each) and the fastest is kept. On the Sapphire Rapids kind AMX wins by far, and
/// vdpbf16ps loses to the emulation (0.6-0.7x the f32 FMA rate). NN_BF16=amx|native|emulated
/// fixes the choice where that kernel can run.
inline Bf16Kernel bf16_kernel() {
  static const Bf16Kernel chosen = [] {
    std::vector<Bf16Kernel> cands;
    for (Bf16Kernel k : {Bf16Kernel::emulated, Bf16Kernel::avx512_bf16, Bf16Kernel::amx})
      if (bf16_kernel_available(k)) cands.push_back(k);
    if (const char* e = std::getenv("NN_BF16")) {
      const std::string want = e;
      for (Bf16Kernel k : cands)
        if ((want == "amx" && k == Bf16Kernel::amx) || (want == "native" && k == Bf16Kernel::avx512_bf16) ||
            (want == "emulated" && k == Bf16Kernel::emulated))
          return k;
    }
    if (cands.size() == 1) return cands[0];
    constexpr index M = 64, N = 256, K = 512;
    std::vector<float> a(M * K, 0.5f), c(M * N);
    std::vector<bf16> b(K * N, 0x3f00);  // 0.5
    auto best = [&](Bf16Kernel k) {
      double t = 1e30;
      for (int r = 0; r < 6; ++r) {  // the first run warms the packing space and the caches
        const auto t0 = std::chrono::steady_clock::now();
        gemm_bf16<bf16>(active_isa(), k, false, true, M, N, K, a.data(), K, b.data(), K, c.data(), N, false, false);
        if (r > 0) t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      return t;
    };
    Bf16Kernel pick = cands[0];
    double t_pick = best(pick);
    for (std::size_t i = 1; i < cands.size(); ++i) {
      const double t = best(cands[i]);
      if (t < t_pick) pick = cands[i], t_pick = t;
    }
    return pick;
  }();
  return chosen;
}

/// C[M x N] (row stride ldc) (+)= bf16(op(A)) @ bf16(op(B)): A f32 (rounded to bf16 while
/// packing), B bf16 (a stored weight) or f32 (rounded too: autocast), f32 accumulation, on up to
/// team_threads() threads when `parallel`, with `kernel` (one bf16_kernel_available() says can
/// run; the emulation runs on `isa`'s f32 kernels).
template <class SB>
void gemm_bf16(Isa isa, Bf16Kernel kernel, bool ta, bool tb, index M, index N, index K, const float* A, index lda,
               const SB* B, index ldb, float* C, index ldc, bool acc, bool parallel) {
  static_assert(std::is_same_v<SB, bf16> || std::is_same_v<SB, float>);
  const int threads = parallel ? team_threads(M, N, K) : 1;
  // AMX packs its own B columns per thread (each thread's share of the weight), so it always
  // splits by columns; the others share B panels over the team unless C is short and wide.
  if (threads > 1 && (M < 24 * threads || kernel == Bf16Kernel::amx)) {
    split_columns(threads, N, [&](index d0, index d1) {
      gemm_bf16(isa, kernel, ta, tb, M, d1 - d0, K, A, lda, B + (tb ? d0 * ldb : d0), ldb, C + d0, ldc, acc, false);
    });
    return;
  }
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc)
      for (index i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, 0.0f);
    return;
  }
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
  if (kernel == Bf16Kernel::amx) return amx::gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc);
#endif
  const Matrix<float> a{A, lda, ta};
  const Matrix<SB> b{B, ldb, tb};
  auto run = [&]<class S>(const Kernels<float>& kern, const auto& pack_a_fn, const auto& pack_b_fn) {
#if defined(_OPENMP)
    if (threads > 1) return gemm_team<float, S>(threads, kern, M, N, K, pack_a_fn, pack_b_fn, C, ldc, acc);
#endif
    gemm_blocked<float, S>(kern, M, N, K, pack_a_fn, pack_b_fn, C, ldc, acc);
  };
#if defined(__x86_64__) || defined(__i386__)
  if (kernel == Bf16Kernel::avx512_bf16) {
    using S = Shape<float, Isa::avx512>;
    const Kernels<float> kern{&micro_avx512_bf16, &micro_avx512_bf16};
    run.template operator()<S>(kern, Bf16PairPackA<S::MR>{a}, Bf16PairPackB<S::NR, SB>{b});
    return;
  }
#endif
  with_isa(isa, [&]<Isa I>() {
    using S = Shape<float, I>;
    const Bf16Rounded<S::MR, DensePackA<S::MR, float>> pack_a_fn{{a}};
    if constexpr (std::is_same_v<SB, bf16>)  // bf16 B is widened exactly: nothing to round
      run.template operator()<S>(micro_kernels<float, I>(), pack_a_fn, DensePackB<S::NR, float, bf16>{b});
    else
      run.template operator()<S>(micro_kernels<float, I>(), pack_a_fn, Bf16Rounded<S::NR, DensePackB<S::NR, float>>{{b}});
  });
}

/// "nn avx512 12x32 f32 / 12x16 f64 + gemv": the engine and tile shapes for an ISA (gemv.hpp's
/// one-row products run on the same ISA).
inline std::string describe(Isa isa) {
  return with_isa(isa, [&]<Isa I>() {
    return "nn " + std::string(isa_name(I)) + " " + std::to_string(Shape<float, I>::MR) + "x" +
           std::to_string(Shape<float, I>::NR) + " f32 / " + std::to_string(Shape<double, I>::MR) + "x" +
           std::to_string(Shape<double, I>::NR) + " f64 + gemv";
  });
}

}  // namespace gemm
#endif  // NN_OWN_GEMM

}  // namespace nn

