// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's quantized kernels (ops/quantized.hpp): products with a quantized matrix, whose values
// are dequantized panel by panel straight into the GEMM's packed layout (the matrix never exists
// in float), and the row gather of a quantized embedding table.
#pragma once

#include <cstring>

#include "../../quant.hpp"
#include "common.hpp"
#include "matmul.hpp"

namespace nn {

#if defined(NN_OWN_GEMM)
namespace gemm {

#if defined(NN_QUANT_AVX2) && (defined(__x86_64__) || defined(__i386__))
/// The scales and biases of group g of W's lines j .. j + lines as float32, for the transposed
/// packers below, which walk 8 or 16 lines a depth step at a time: widened once a group into
/// s_/b_, not once a step. float16's widening in software (half::f16_to_f32, branches for the
/// subnormals) once every 8 depths took more than half of the AVX2 packer's time: 0.54 against
/// 0.34 ms a 1536 x 576 matrix (group 32, 4 bits; AMD EPYC family 25 model 1; float32 scales 0.26).
template <DType SDT, int L>
struct LineScales {
  float s_[L], b_[L];
  void load(const detail::QuantReader<float>& rd, index j, int lines, index g) {
    for (int l = 0; l < lines; ++l) {
      const index si = (j + l) * rd.groups_per_row + g;
      s_[l] = detail::scale_f32<SDT>(rd.scales, si);
      b_[l] = detail::scale_f32<SDT>(rd.biases, si);
    }
  }
  float s(int l) const { return s_[l]; }
  float b(int l) const { return b_[l]; }
};

/// float32 scales are read in place (a copy a group cost the AVX2 packer 6%).
template <int L>
struct LineScales<DType::f32, L> {
  const float *sp = nullptr, *bp = nullptr;
  index stride = 0;
  void load(const detail::QuantReader<float>& rd, index j, int, index g) {
    stride = rd.groups_per_row;
    sp = static_cast<const float*>(rd.scales) + j * stride + g;
    bp = static_cast<const float*>(rd.biases) + j * stride + g;
  }
  float s(int l) const { return sp[l * stride]; }
  float b(int l) const { return bp[l * stride]; }
};

/// A panel of op(B) = W^T (x @ W^T) from an affine float32 W, on AVX-512: lines j .. j + n of W
/// (n <= NR; the panel's columns, zero past n) over depths k0 .. k0 + kc (a multiple of 16, whole
/// 16-code steps of a group), 16 lines x 16 depths at a time decoded into registers (codes16, the
/// values round(s * q) + b as everywhere) and transposed there (gemm::transpose16_store): the
/// values never pass through memory before the panel.
template <int NR, int BITS, DType SDT>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_pack_transposed(const detail::QuantReader<float>& rd, index j, index n,
                                                                    index k0, index kc, float* dst) {
  static_assert(NR % 16 == 0);
  LineScales<SDT, 16> sc;  // the lines' scales and biases for group gcur
  for (int l0 = 0; l0 < NR; l0 += 16) {
    const int lines = static_cast<int>(std::clamp<index>(n - l0, 0, 16));
    index gcur = -1;
    for (index k = 0; k < kc; k += 16) {
      if (const index g = (k0 + k) / rd.q.group; g != gcur) {
        gcur = g;
        sc.load(rd, j + l0, lines, g);
      }
      __m512 r[16];
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) {
        if (l < lines) {
          const index row = j + l0 + l;
          __m512 p = _mm512_mul_ps(_mm512_set1_ps(sc.s(l)), _mm512_maskz_cvtepi32_ps(detail::kAll16, detail::codes16<BITS>(
                                                                                       rd.codes + row * rd.row_bytes,
                                                                                       static_cast<std::uint64_t>(k0 + k))));
          asm("" : "+v"(p));
          r[l] = _mm512_add_ps(p, _mm512_set1_ps(sc.b(l)));
        } else {
          r[l] = _mm512_setzero_ps();
        }
      }
      transpose16_store(r, 16, dst + k * NR + l0, NR);
    }
  }
}

/// affine_pack_transposed's AVX2 form: 8 lines x 8 depths at a time decoded into ymm registers
/// (codes8) and transposed there (gemm::transpose8_store); k0, kc and the group multiples of 8.
/// Decoding each line into a run and transposing the runs afterwards (the staged path below) wrote
/// and read every value once more: that path's decode and transpose were about 5% of the main
/// job's QLoRA step on AVX2 (perf, AMD EPYC family 25 model 1).
template <int NR, int BITS, DType SDT>
[[gnu::target("avx2")]] inline void affine_pack_transposed_avx2(const detail::QuantReader<float>& rd, index j, index n,
                                                                index k0, index kc, float* dst) {
  static_assert(NR % 8 == 0);
  LineScales<SDT, 8> sc;  // the lines' scales and biases for group gcur
  for (int l0 = 0; l0 < NR; l0 += 8) {
    const int lines = static_cast<int>(std::clamp<index>(n - l0, 0, 8));
    index gcur = -1;
    for (index k = 0; k < kc; k += 8) {
      if (const index g = (k0 + k) / rd.q.group; g != gcur) {
        gcur = g;
        sc.load(rd, j + l0, lines, g);
      }
      __m256 r[8];
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        if (l < lines) {
          const index row = j + l0 + l;
          __m256 p = _mm256_mul_ps(_mm256_set1_ps(sc.s(l)), _mm256_cvtepi32_ps(detail::codes8<BITS>(
                                                              rd.codes + row * rd.row_bytes, static_cast<std::uint64_t>(k0 + k))));
          asm("" : "+x"(p));  // round(s * q) + b: the product kept out of an FMA
          r[l] = _mm256_add_ps(p, _mm256_set1_ps(sc.b(l)));
        } else {
          r[l] = _mm256_setzero_ps();
        }
      }
      transpose8_store(r, 8, dst + k * NR + l0, NR);
    }
  }
}

/// The panels of op(B) = W (x @ W, dX = dY @ W in QLoRA's backward) from an affine float32 W on
/// AVX2: depth k of every panel is a run of row k0 + k over columns c0 .. c0 + n, decoded 8 codes
/// at a time straight into the panels (c0 and the group multiples of 8; a last part of 8
/// one code at a time; columns past n zero). Decoding the whole run first and copying it into the
/// panels stored and loaded every value once more.
template <int NR, int BITS, DType SDT>
[[gnu::target("avx2")]] inline void affine_pack_rows_avx2(const detail::QuantReader<float>& rd, index c0, index n,
                                                          index k0, index kc, float* dst) {
  static_assert(NR % 8 == 0);
  const index n8 = n / 8 * 8, padded = (n + NR - 1) / NR * NR, G = rd.q.group;
  // column c of depth k lands at panel c / NR, row k, lane c % NR
  const auto at = [&](index k, index c) { return dst + (c / NR) * NR * kc + k * NR + c % NR; };
  for (index k = 0; k < kc; ++k) {
    const index row = k0 + k, sbase = row * rd.groups_per_row;
    const std::uint8_t* codes = rd.codes + row * rd.row_bytes;
    index g = c0 / G, gend = (g + 1) * G - c0;  // the group's end, as a column of this block
    float s = detail::scale_f32<SDT>(rd.scales, sbase + g), b = detail::scale_f32<SDT>(rd.biases, sbase + g);
    const auto next_group = [&] {
      ++g;
      gend += G;
      s = detail::scale_f32<SDT>(rd.scales, sbase + g), b = detail::scale_f32<SDT>(rd.biases, sbase + g);
    };
    index c = 0;
    for (; c < n8; c += 8) {
      if (c >= gend) next_group();
      __m256 p = _mm256_mul_ps(_mm256_set1_ps(s),
                               _mm256_cvtepi32_ps(detail::codes8<BITS>(codes, static_cast<std::uint64_t>(c0 + c))));
      asm("" : "+x"(p));  // round(s * q) + b: the product kept out of an FMA
      _mm256_storeu_ps(at(k, c), _mm256_add_ps(p, _mm256_set1_ps(b)));
    }
    for (; c < n; ++c) {
      if (c >= gend) next_group();
      *at(k, c) = detail::affine_value<BITS>(codes, rd.row_bytes, s, b, c0 + c);
    }
    for (; c < padded; ++c) *at(k, c) = 0.0f;
  }
}
#endif

/// The B packer (DensePackB's contract) of a quantized matrix W read through `rd`: op(B)(k, j) =
/// W[j0 + j][k] when trans (x @ W^T, a Linear's weight: each panel column is a run of one row of
/// W), else W[k][j0 + j] (each panel depth is a run of one row). Zero past the edge.
template <int NR, class T>
struct QuantPackB {
  const detail::QuantReader<T>* rd;
  bool trans;
  index j_off = 0;  // the first column of op(B) this product sees (a column split's share)
  void operator()(T* dst, index j0, index nc, index k0, index kc) const {
    // trans: the panel's columns are rows of W. Decoding each row into a contiguous run and then
    // transposing the runs (pack_panel: 16 x 16 in registers) beats writing the decoded values
    // NR apart, and lets the decoder run eight codes at a time.
    alignas(64) static thread_local unsigned char rows_buf[49152];
#if defined(NN_QUANT_AVX2) && (defined(__x86_64__) || defined(__i386__))
    if constexpr (std::is_same_v<T, float>) {
      if (!trans && (j_off + j0) % 8 == 0 && rd->q.mode == QuantMode::affine && rd->q.group % 8 == 0 &&
          detail::quant_avx2() && !detail::quant_avx512()) {
        detail::with_code_bits(rd->q.bits, [&]<int BITS>() {
          detail::with_scale_dtype(rd->sdt,
                                   [&]<DType SDT>() { affine_pack_rows_avx2<NR, BITS, SDT>(*rd, j_off + j0, nc, k0, kc, dst); });
        });
        return;
      }
    }
#endif
    if (!trans && sizeof(T) * static_cast<std::size_t>(nc) <= sizeof(rows_buf)) {
      // each depth is a run of one row of W over the block's columns: decoded in one call (one
      // dispatch, whole vectors), then cut into the NR-wide panels
      T* run = reinterpret_cast<T*>(rows_buf);
      for (index k = 0; k < kc; ++k) {
        rd->run(k0 + k, j_off + j0, nc, run, 1);
        for (index q = 0; q < nc; q += NR) {
          const index cols = std::min<index>(NR, nc - q);
          T* to = dst + q * kc + k * NR;  // panel q / NR starts q * kc values in
          if (cols == NR) {  // a fixed size the compiler inlines (a libc memmove call per 64 bytes
            std::memcpy(to, run + q, sizeof(T) * NR);  // was 1.2% of the main job's QLoRA step)
            continue;
          }
          std::copy_n(run + q, cols, to);
          std::fill(to + cols, to + NR, T(0));
        }
      }
      return;
    }
#if defined(NN_QUANT_AVX2) && (defined(__x86_64__) || defined(__i386__))
    if constexpr (std::is_same_v<T, float> && NR % 16 == 0) {
      if (trans && kc % 16 == 0 && rd->q.mode == QuantMode::affine && rd->q.group % 16 == 0 && detail::quant_avx512()) {
        detail::with_code_bits(rd->q.bits, [&]<int BITS>() {
          detail::with_scale_dtype(rd->sdt, [&]<DType SDT>() {
            for (index q = 0; q < nc; q += NR)
              affine_pack_transposed<NR, BITS, SDT>(*rd, j_off + j0 + q, std::min<index>(NR, nc - q), k0, kc,
                                                    dst + q * kc);
          });
        });
        return;
      }
      if (trans && k0 % 8 == 0 && kc % 8 == 0 && rd->q.mode == QuantMode::affine && rd->q.group % 8 == 0 &&
          detail::quant_avx2()) {
        detail::with_code_bits(rd->q.bits, [&]<int BITS>() {
          detail::with_scale_dtype(rd->sdt, [&]<DType SDT>() {
            for (index q = 0; q < nc; q += NR)
              affine_pack_transposed_avx2<NR, BITS, SDT>(*rd, j_off + j0 + q, std::min<index>(NR, nc - q), k0, kc,
                                                         dst + q * kc);
          });
        });
        return;
      }
    }
#endif
    const bool staged = trans && sizeof(T) * static_cast<std::size_t>(NR * kc) <= sizeof(rows_buf);
    for (index q = 0; q < nc; q += NR, dst += kc * NR) {
      const index cols = std::min<index>(NR, nc - q), j = j_off + j0 + q;
      if (staged) {
        T* rows = reinterpret_cast<T*>(rows_buf);
        for (index l = 0; l < cols; ++l) rd->run(j + l, k0, kc, rows + l * kc, 1);
        pack_panel<NR>(static_cast<const T*>(rows), kc, false, cols, kc, dst);
        continue;
      }
      if (trans)
        for (index l = 0; l < cols; ++l) rd->run(j + l, k0, kc, dst + l, NR);
      else
        for (index k = 0; k < kc; ++k) rd->run(k0 + k, j, cols, dst + k * NR, 1);
      if (cols < NR)
        for (index k = 0; k < kc; ++k) std::fill(dst + k * NR + cols, dst + (k + 1) * NR, T(0));
    }
  }
};

}  // namespace gemm
#endif

namespace detail {

/// sum_k a[k] * b[k] in T over two 32-byte vectors of partial sums (a fixed order: the compiler
/// may not reassociate a plain loop's reduction to vectorise it).
template <class T>
[[gnu::always_inline]] inline T dot_lanes(const T* a, const T* b, std::int64_t n) {
  typedef T V __attribute__((vector_size(32)));
  constexpr std::int64_t L = 32 / sizeof(T);
  V s0 = {}, s1 = {};
  std::int64_t k = 0;
  for (; k + 2 * L <= n; k += 2 * L) {
    V a0, a1, b0, b1;
    __builtin_memcpy(&a0, a + k, sizeof(V));
    __builtin_memcpy(&a1, a + k + L, sizeof(V));
    __builtin_memcpy(&b0, b + k, sizeof(V));
    __builtin_memcpy(&b1, b + k + L, sizeof(V));
    s0 += a0 * b0;
    s1 += a1 * b1;
  }
  s0 += s1;
  T t = 0;
  for (std::int64_t l = 0; l < L; ++l) t += s0[l];
  for (; k < n; ++k) t += a[k] * b[k];
  return t;
}
#if defined(NN_QUANT_AVX2)
[[gnu::target("avx2,fma")]] inline float dot_lanes_avx2(const float* a, const float* b, std::int64_t n) {
  return dot_lanes(a, b, n);
}
[[gnu::target("avx2,fma")]] inline void axpy_avx2(float* y, float a, const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
#endif
template <class T>
inline T dot_fast(const T* a, const T* b, std::int64_t n) {
#if defined(NN_QUANT_AVX2)
  if constexpr (std::is_same_v<T, float>)
    if (quant_avx2()) return dot_lanes_avx2(a, b, n);
#endif
  return dot_lanes(a, b, n);
}
template <class T>
inline void axpy_fast(T* y, T a, const T* x, std::int64_t n) {
#if defined(NN_QUANT_AVX2)
  if constexpr (std::is_same_v<T, float>)
    if (quant_avx2()) return axpy_avx2(y, a, x, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

#if defined(NN_QUANT_AVX2)
/// y[m, j] (+)= x[m] . W[j] for j in [n0, n1) (x @ W^T), M <= 4 rows of float32 x (M, K) and an
/// affine W of any width whose groups are multiples of 8 codes. No value of W is formed: each
/// row's codes are turned float and multiplied into every row of x as they are, and each group's
/// scale and bias enter once,
///   x . W[j] = sum_g s_g * (sum_{k in g} q_k x_k) + b_g * (sum_{k in g} x_k),
/// with xsum (M, groups) the sums of x per group. Dequantize-then-dot rounded in another order
/// (tests/quant/quant.test.cpp holds it to float64 and to MLX). U sums per row of x run side by
/// side so that one row (a decode step) is not bound by the FMA's latency.
template <int M, int BITS>
[[gnu::target("avx2,fma")]] inline void affine_dot_rows(const QuantReader<float>& rd, const float* X, const float* xsum,
                                                        float* Y, std::int64_t N, std::int64_t K, std::int64_t n0,
                                                        std::int64_t n1, bool acc) {
  constexpr int U = M == 1 ? 4 : M == 2 ? 2 : 1;
  const std::int64_t G = rd.q.group, groups = K / G;
  for (std::int64_t j = n0; j < n1; ++j) {
    const std::uint8_t* row = rd.codes + j * rd.row_bytes;
    __m256 tot[M];
    float bias[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) tot[m] = _mm256_setzero_ps(), bias[m] = 0.0f;
    for (std::int64_t g = 0; g < groups; ++g) {
      __m256 a[M][U];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) a[m][u] = _mm256_setzero_ps();
      std::int64_t c = g * G;
      const std::int64_t e = c + G;
      for (; c + 8 * U <= e; c += 8 * U)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
          const __m256 qv = _mm256_cvtepi32_ps(codes8<BITS>(row, static_cast<std::uint64_t>(c + 8 * u)));
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) a[m][u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(X + m * K + c + 8 * u), a[m][u]);
        }
      for (; c < e; c += 8) {
        const __m256 qv = _mm256_cvtepi32_ps(codes8<BITS>(row, static_cast<std::uint64_t>(c)));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(X + m * K + c), a[m][0]);
      }
      const std::int64_t si = j * rd.groups_per_row + g;
      const __m256 sv = _mm256_set1_ps(widen_scale<float>(rd.scales, rd.sdt, si));
      const float b = widen_scale<float>(rd.biases, rd.sdt, si);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        __m256 sum = a[m][0];
#pragma GCC unroll 4
        for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, a[m][u]);
        tot[m] = _mm256_fmadd_ps(sv, sum, tot[m]);
        bias[m] += b * xsum[m * groups + g];
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      alignas(32) float l[8];
      _mm256_store_ps(l, tot[m]);
      const float v = (((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))) + bias[m];
      Y[m * N + j] = acc ? Y[m * N + j] + v : v;
    }
  }
}

/// The sums of the 16 lanes of a, b, c and d, in that order (one tree of adds, the same for all).
// (both halves by masked extracts: GCC 12's _mm512_castps512_ps256 passes an undefined operand; see kAll16)
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline __m256 hsum_half(__m512 x) {
  return _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, x, 0), _mm512_maskz_extractf32x8_ps(0xff, x, 1));
}
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 ab = _mm256_hadd_ps(hsum_half(a), hsum_half(b)), cd = _mm256_hadd_ps(hsum_half(c), hsum_half(d));
  // ab: [a01 a23 b01 b23 | a45 a67 b45 b67]
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567]
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/// out[0, n) = scales (or biases) i0 .. i0 + n of storage type t as float32, 16 at a time.
[[gnu::target(NN_QUANT_AVX512)]] inline void widen_scales(const void* p, DType t, std::int64_t i0, std::int64_t n,
                                                         float* out) {
  std::int64_t i = 0;
  if (t == DType::f16 || t == DType::bf16) {
    const auto* h = static_cast<const std::uint16_t*>(p) + i0;
    for (; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? kAll16 : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m256i v = _mm256_maskz_loadu_epi16(m, h + i);
      const __m512 f = t == DType::f16 ? _mm512_maskz_cvtph_ps(kAll16, v)
                                       : _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll16, _mm512_maskz_cvtepu16_epi32(kAll16, v), 16));
      _mm512_mask_storeu_ps(out + i, m, f);
    }
  } else if (t == DType::f32) {
    std::memcpy(out, static_cast<const float*>(p) + i0, static_cast<std::size_t>(n) * sizeof(float));
  } else {
    for (; i < n; ++i) out[i] = widen_scale<float>(p, t, i0 + i);
  }
}

/// Scales per row a block of the few-row dots keeps as float32: groups of 16 codes or more, K <= 8192.
inline constexpr std::int64_t kDotGroups = 8192 / 16 + 16;

/// Asks for rows [r0, r1) of W's codes, scales and biases to be brought into L2; the float few-row
/// dot asks for the rows about 8 KB ahead of each block it starts. It reads J rows side by side
/// with many instructions a byte, and the hardware's prefetch alone often fell behind: the
/// 49152 x 576 head at 8 bits, 1 token, took 4.7-5.1 ms in most runs (2.2 in some) against
/// 1.8-1.9 ms with this, in every run; 4 bits unchanged (bench_quantized_matmul 1 15 8 32, Xeon
/// model 167). The int8 kernel, with a quarter of the instructions, kept up without it (and ran
/// 10% slower with it). An asm statement: GCC deletes a loop of __builtin_prefetch calls (a loop
/// without side effects).
inline void prefetch_rows(const QuantReader<float>& rd, std::int64_t r0, std::int64_t r1) {
  const auto ahead = [](const void* base, std::int64_t from, std::int64_t to) {
    const char* p = static_cast<const char*>(base);
    for (std::int64_t o = from; o < to; o += 64) asm volatile("prefetcht1 %0" : : "m"(p[o]));
  };
  ahead(rd.codes, r0 * rd.row_bytes, r1 * rd.row_bytes);
  const std::int64_t sb = static_cast<std::int64_t>(dtype_size(rd.sdt));
  ahead(rd.scales, r0 * rd.groups_per_row * sb, r1 * rd.groups_per_row * sb);
  if (rd.biases) ahead(rd.biases, r0 * rd.groups_per_row * sb, r1 * rd.groups_per_row * sb);
}

/// How many rows ahead of a block of J the few-row dots prefetch: whole blocks, about 8 KB of codes.
inline std::int64_t prefetch_ahead(const QuantReader<float>& rd, std::int64_t J) {
  return J * ((8192 + J * rd.row_bytes - 1) / (J * rd.row_bytes));
}

/// The start of a block of J rows of W (j .. j + J) in the few-row dots: sp[u] points at row
/// j + u's scales as float32 (read in place, or widened into sf[u]), and tot[u][m] starts as the
/// bias term, sum_g b_g xsum[m, g], spread over 16 lanes (the rest of the dot joins those lanes;
/// xsum: x's sums per group, (M, groups)).
template <int M, int J>
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline void dot_rows_begin(
    const QuantReader<float>& rd, std::int64_t j, std::int64_t groups, const float* xsum, float (*sf)[kDotGroups],
    float* bf, const float* (&sp)[J], __m512 (&tot)[J][M]) {
  const bool f32 = rd.sdt == DType::f32;
#pragma GCC unroll 4
  for (int u = 0; u < J; ++u) {
    const std::int64_t s0 = (j + u) * rd.groups_per_row;
    const float* bp = bf;
    if (f32) {
      sp[u] = static_cast<const float*>(rd.scales) + s0, bp = static_cast<const float*>(rd.biases) + s0;
    } else {
      widen_scales(rd.scales, rd.sdt, s0, groups, sf[u]), widen_scales(rd.biases, rd.sdt, s0, groups, bf);
      sp[u] = sf[u];
    }
    for (int m = 0; m < M; ++m) tot[u][m] = _mm512_setzero_ps();
    for (std::int64_t g = 0; g < groups; g += 16) {
      const __mmask16 gm = groups - g >= 16 ? kAll16 : static_cast<__mmask16>((1u << (groups - g)) - 1);
      const __m512 bv = _mm512_maskz_loadu_ps(gm, bp + g);
      for (int m = 0; m < M; ++m) tot[u][m] = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(gm, xsum + m * groups + g), tot[u][m]);
    }
  }
}

/// The end of that block: each tot[u][m]'s lanes summed (four accumulators at once, one fixed
/// order) into y[m, j + u], added to it when acc.
template <int M, int J>
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline void dot_rows_end(__m512 (&tot)[J][M], float* Y,
                                                                              std::int64_t N, std::int64_t j, bool acc) {
  constexpr int A = J * M;
  alignas(16) float v[A + 3];
#pragma GCC unroll 4
  for (int i = 0; i + 4 <= A; i += 4)
    _mm_store_ps(v + i, hsum4(tot[i / M][i % M], tot[(i + 1) / M][(i + 1) % M], tot[(i + 2) / M][(i + 2) % M],
                              tot[(i + 3) / M][(i + 3) % M]));
  for (int i = A / 4 * 4; i < A; ++i) {
    const __m512 t = tot[i / M][i % M];
    _mm_store_ss(v + i, hsum4(t, t, t, t));
  }
#pragma GCC unroll 4
  for (int u = 0; u < J; ++u)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      float& y = Y[m * N + j + u];
      y = acc ? y + v[u * M + m] : v[u * M + m];
    }
}

/// affine_dot_rows on AVX-512: the same factored sums, 16 codes a vector, and J columns of y at
/// once (each load of x serves J rows of W; J * M chains hide the FMA's latency). 4-bit codes go
/// 32 a step without being put in order: a 16-byte load widened to 16 lanes holds codes 2i in its
/// low nibbles and 2i + 1 in its high ones, so x is read as XP, each 32 values of x reordered
/// once per call into their even then odd positions (a group of 4-bit codes is a multiple of 32).
template <int M, int J, int BITS>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_dot_rows512(const QuantReader<float>& rd, const float* XP,
                                                                const float* xsum, float* Y, std::int64_t N,
                                                                std::int64_t K, std::int64_t n0, std::int64_t n1,
                                                                bool acc) {
  constexpr std::int64_t step = BITS == 4 ? 32 : 16;
  const std::int64_t G = rd.q.group, groups = K / G;
  alignas(64) float sf[J][kDotGroups], bf[kDotGroups];  // scales and biases as float32, where stored narrower
  const std::int64_t ahead = prefetch_ahead(rd, J);
  for (std::int64_t j = n0; j + J <= n1; j += J) {
    __m512 tot[J][M];
    const float* sp[J];
    if (j + ahead < n1) prefetch_rows(rd, j + ahead, std::min(n1, j + ahead + J));
    dot_rows_begin<M, J>(rd, j, groups, xsum, sf, bf, sp, tot);
    for (std::int64_t g = 0; g < groups; ++g) {
      __m512 a[J][M];
#pragma GCC unroll 4
      for (int u = 0; u < J; ++u)
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) a[u][m] = _mm512_setzero_ps();
      for (std::int64_t c = g * G; c < (g + 1) * G; c += step) {
        if constexpr (BITS == 4) {
          __m512 x0[M], x1[M];
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) x0[m] = _mm512_loadu_ps(XP + m * K + c), x1[m] = _mm512_loadu_ps(XP + m * K + c + 16);
#pragma GCC unroll 4
          for (int u = 0; u < J; ++u) {
            const __m512i b = _mm512_maskz_cvtepu8_epi32(
                kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rd.codes + (j + u) * rd.row_bytes + c / 2)));
            const __m512 lo = _mm512_maskz_cvtepi32_ps(kAll16, _mm512_and_si512(b, _mm512_set1_epi32(15)));
            const __m512 hi = _mm512_maskz_cvtepi32_ps(kAll16, _mm512_maskz_srli_epi32(kAll16, b, 4));
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) a[u][m] = _mm512_fmadd_ps(hi, x1[m], _mm512_fmadd_ps(lo, x0[m], a[u][m]));
          }
        } else {
          __m512 x0[M];
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) x0[m] = _mm512_loadu_ps(XP + m * K + c);
#pragma GCC unroll 4
          for (int u = 0; u < J; ++u) {
            const __m512 qv =
                _mm512_maskz_cvtepi32_ps(kAll16, codes16<BITS>(rd.codes + (j + u) * rd.row_bytes, static_cast<std::uint64_t>(c)));
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) a[u][m] = _mm512_fmadd_ps(qv, x0[m], a[u][m]);
          }
        }
      }
#pragma GCC unroll 4
      for (int u = 0; u < J; ++u) {
        const __m512 sv = _mm512_set1_ps(sp[u][g]);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) tot[u][m] = _mm512_fmadd_ps(sv, a[u][m], tot[u][m]);
      }
    }
    dot_rows_end<M, J>(tot, Y, N, j, acc);
  }
}

/// Whether affine_dot_rows512 serves rd: an affine matrix on a CPU that runs the AVX-512 decoder,
/// its groups whole steps of the kernel.
template <class T>
inline bool affine_dot_rows512_applies(const QuantReader<T>& rd) {
  return std::is_same_v<T, float> && rd.q.mode == QuantMode::affine && quant_avx512() &&
         rd.q.group % (rd.q.bits == 4 ? 32 : 16) == 0;
}

/// Whether affine_dot_rows_int8 serves rd (set_int8_activations): on, an affine 4- or 8-bit
/// matrix whose group is a power of two of 32 or more (a 64-byte chunk of codes then holds whole
/// groups or lies inside one), on a CPU with AVX512-VNNI.
template <class T>
inline bool affine_dot_int8_applies(const QuantReader<T>& rd) {
  const std::int64_t G = rd.q.group;
  return std::is_same_v<T, float> && int8_activations() && rd.q.mode == QuantMode::affine &&
         (rd.q.bits == 4 || rd.q.bits == 8) && G >= 32 && (G & (G - 1)) == 0 && quant_vnni();
}

/// x rounded to int8 for affine_dot_rows_int8, M rows of K (K a multiple of 32) in blocks of 32
/// values: d = max|x| / 127, q = nearbyint(x * (127 / max|x|)), q = 0 and d = 0 for a block of
/// zeros (set_int8_activations). Laid out as the kernel reads: byte i of a row of 4-bit codes
/// holds codes 2i and 2i + 1, so XQ holds x's even positions (K / 2 bytes) then its odd ones; for
/// 8-bit codes x in order. DL: d per int32 lane of a 64-byte chunk of codes (one lane: 4 bytes of
/// codes, 8 (4-bit) or 4 (8-bit) depths, all in one block). Rows padded with zeros to whole
/// chunks (XQ: stride xs bytes; DL: stride ds floats).
struct Int8Rows {
  static constexpr std::int64_t kMaxK = 8192;
  alignas(64) std::int8_t xq[4 * (kMaxK + 64)];
  alignas(64) float dl[4 * (kMaxK / 4 + 16)];
  std::int64_t xs = 0, ds = 0;

  void set(const float* X, std::int64_t M, std::int64_t K, int bits) {
    const std::int64_t bytes = K * bits / 8, chunks = (bytes + 63) / 64;
    xs = bits == 4 ? 2 * chunks * 64 : chunks * 64;  // 4 bits: even then odd positions, each padded
    ds = chunks * 16;
    std::fill_n(xq, M * xs, std::int8_t{0});
    std::fill_n(dl, M * ds, 0.0f);
    for (std::int64_t m = 0; m < M; ++m) {
      const float* x = X + m * K;
      std::int8_t* q = xq + m * xs;
      for (std::int64_t b = 0; b < K / 32; ++b) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; ++i) {
          const std::int64_t k = 32 * b + i;
          const auto v = static_cast<std::int8_t>(std::nearbyint(x[k] * id));
          if (bits == 4) q[(k % 2) * chunks * 64 + k / 2] = v;
          else q[k] = v;
        }
        const std::int64_t lanes = bits == 4 ? 4 : 8;  // int32 lanes a 32-block covers
        std::fill_n(dl + m * ds + b * lanes, lanes, amax / 127.0f);
      }
    }
  }
};

/// y[m, j] (+)= x[m] . W[j] for j in [n0, n1) (x @ W^T), M <= 4 rows, with x as int8 (Int8Rows)
/// and W's codes multiplied in int32 by vpdpbusd (u8 codes x s8 x): per 64-byte chunk of a row of
/// W (128 4-bit or 64 8-bit codes), each int32 lane sums 8 or 4 products of one 32-block (exact,
/// far below 2^24), is turned float and scaled by s * d of its block into a float accumulator;
/// xsum[m * groups + g]: sum_k x[m, k] over group g in float32, which the biases multiply
/// (sum_g b_g xsum_g, 16 groups a vector into the same accumulator). J rows of W share each
/// load of x.
template <int M, int J, int BITS>
[[gnu::target(NN_QUANT_AVX512 ",avx512vnni")]] inline void affine_dot_rows_int8(const QuantReader<float>& rd,
                                                                               const Int8Rows& xr, const float* xsum,
                                                                               float* Y, std::int64_t N, std::int64_t K,
                                                                               std::int64_t n0, std::int64_t n1, bool acc) {
  const std::int64_t G = rd.q.group, groups = K / G, bytes = K * BITS / 8, chunks = (bytes + 63) / 64;
  constexpr std::int64_t cpc = 64 * 8 / BITS;  // codes a chunk
  // Lane l of a chunk -> its group, counted from the chunk's first (0 where a group spans chunks).
  alignas(64) std::int32_t gl[16];
  for (int l = 0; l < 16; ++l) gl[l] = G < cpc ? static_cast<std::int32_t>(l * 4 * (8 / BITS) / G) : 0;
  const __m512i gidx = _mm512_load_si512(gl);
  const __m512i nib = _mm512_set1_epi8(0x0f);
  alignas(64) float sf[J][kDotGroups], bf[kDotGroups];  // scales and biases as float32, where stored narrower
  for (std::int64_t j = n0; j + J <= n1; j += J) {
    __m512 tot[J][M];
    const float* sp[J];
    dot_rows_begin<M, J>(rd, j, groups, xsum, sf, bf, sp, tot);
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t o = 64 * c, left = bytes - o;
      const __mmask64 bm = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      const std::int64_t g0 = o * (8 / BITS) / G;  // the chunk's first group
      const std::int64_t ng = G < cpc ? std::min<std::int64_t>(cpc, left * (8 / BITS)) / G : 1;
      const __mmask16 sm = static_cast<__mmask16>((1u << ng) - 1);
      __m512 dv[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) dv[m] = _mm512_load_ps(xr.dl + m * xr.ds + 16 * c);
#pragma GCC unroll 4
      for (int u = 0; u < J; ++u) {
        const __m512i v = _mm512_maskz_loadu_epi8(bm, rd.codes + (j + u) * rd.row_bytes + o);
        const __m512 sv = _mm512_maskz_permutexvar_ps(kAll16, gidx, _mm512_maskz_loadu_ps(sm, sp[u] + g0));
        if constexpr (BITS == 4) {
          const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const std::int8_t* q = xr.xq + m * xr.xs;
            const __m512i xe = _mm512_load_si512(q + o), xo = _mm512_load_si512(q + chunks * 64 + o);
            const __m512i is = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
            tot[u][m] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, is), _mm512_mul_ps(sv, dv[m]), tot[u][m]);
          }
        } else {
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_load_si512(xr.xq + m * xr.xs + o));
            tot[u][m] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, is), _mm512_mul_ps(sv, dv[m]), tot[u][m]);
          }
        }
      }
    }
    dot_rows_end<M, J>(tot, Y, N, j, acc);
  }
}

/// The column blocking of the few-row dots on AVX-512 (the float and the int8 kernel): J columns of
/// y at a time while they last (fewer rows of x: more columns, each load of x serving J rows of W),
/// then one at a time. kern.template operator()<MM, J>(from, to) runs MM rows over columns [from, to).
template <class Kern>
inline void dot_row_blocks(std::int64_t M, std::int64_t n0, std::int64_t n1, const Kern& kern) {
  const auto run = [&]<int MM, int J>() {
    const std::int64_t n_j = n0 + (n1 - n0) / J * J;
    kern.template operator()<MM, J>(n0, n_j);
    if constexpr (J > 1) kern.template operator()<MM, 1>(n_j, n1);
  };
  switch (M) {
    case 1: run.template operator()<1, 4>(); break;
    case 2: run.template operator()<2, 2>(); break;
    case 3: run.template operator()<3, 2>(); break;
    default: run.template operator()<4, 2>(); break;
  }
}

/// affine_dot_rows for M = 1..4 rows (1..8 on AVX-512); false where it does not apply (another format or dtype, a
/// CPU without AVX2, a group that is not a multiple of 8 codes, more rows).
template <class T>
inline bool affine_dot_rows_any(const QuantReader<T>& rd, const T* X, T* Y, std::int64_t M, std::int64_t N,
                                std::int64_t K, std::int64_t n0, std::int64_t n1, bool acc) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (rd.q.mode != QuantMode::affine || rd.q.group % 8 != 0 || K > 8192 || !quant_avx2()) return false;
    if (M > (affine_dot_rows512_applies(rd) ? 8 : 4)) return false;
    if (M > 4) {  // 5-8 rows (AVX-512): two passes over W (each still cheaper than packing it for the GEMM)
      affine_dot_rows_any(rd, X, Y, 4, N, K, n0, n1, acc);
      return affine_dot_rows_any(rd, X + 4 * K, Y + 4 * N, M - 4, N, K, n0, n1, acc);
    }
    const std::int64_t groups = K / rd.q.group;
    alignas(64) static thread_local float xsum[4 * 1024];  // K <= 8192 and groups >= 8 codes
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t g = 0; g < groups; ++g) {
        float t = 0.0f;
        for (std::int64_t k = g * rd.q.group; k < (g + 1) * rd.q.group; ++k) t += X[m * K + k];
        xsum[m * groups + g] = t;
      }
    if (affine_dot_int8_applies(rd)) {  // opt-in (set_int8_activations): x rounded to int8
      alignas(64) static thread_local Int8Rows xr;
      xr.set(X, M, K, rd.q.bits);
      const auto rows = [&]<int BITS>() {
        dot_row_blocks(M, n0, n1, [&]<int MM, int J>(std::int64_t a, std::int64_t b) {
          affine_dot_rows_int8<MM, J, BITS>(rd, xr, xsum, Y, N, K, a, b, acc);
        });
      };
      if (rd.q.bits == 4) rows.template operator()<4>();
      else rows.template operator()<8>();
      return true;
    }
    if (affine_dot_rows512_applies(rd)) {
      const float* XP = X;
      if (rd.q.bits == 4) {  // x's 32-value blocks in even-then-odd order (affine_dot_rows512)
        alignas(64) static thread_local float xp[4 * 8192];
        for (std::int64_t i = 0; i < M * K; i += 32)
          for (int l = 0; l < 16; ++l) xp[i + l] = X[i + 2 * l], xp[i + 16 + l] = X[i + 2 * l + 1];
        XP = xp;
      }
      with_code_bits(rd.q.bits, [&]<int BITS>() {
        dot_row_blocks(M, n0, n1, [&]<int MM, int J>(std::int64_t a, std::int64_t b) {
          affine_dot_rows512<MM, J, BITS>(rd, XP, xsum, Y, N, K, a, b, acc);
        });
      });
      return true;
    }
    with_code_bits(rd.q.bits, [&]<int BITS>() {
      switch (M) {
        case 1: affine_dot_rows<1, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
        case 2: affine_dot_rows<2, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
        case 3: affine_dot_rows<3, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
        default: affine_dot_rows<4, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
      }
    });
    return true;
  }
}

/// Whether affine_axpy_rows512 serves rd (x @ W): an affine float32 matrix on a CPU that runs the
/// AVX-512 decoder, its groups a power of two of 16 codes or more (a vector of y has one scale per
/// depth, and a block of 2^i vectors holds whole groups or lies inside one).
/// Rows: 1-8 for 4- and 8-bit codes (a plain load a vector), 1-2 for the bit-stream widths, whose
/// decode (a masked load, a shuffle and a shift) the buffered loop, decoding each depth once for
/// all rows, beats at 3-8 rows on a 49152-deep matrix (bench_quantized_matmul 1 5 5 32, AMD Zen 4).
template <class T>
inline bool affine_axpy_rows512_applies(const QuantReader<T>& rd, std::int64_t M) {
  const std::int64_t G = rd.q.group;
  return std::is_same_v<T, float> && rd.q.mode == QuantMode::affine && quant_avx512() && G >= 16 && (G & (G - 1)) == 0 &&
         M <= (rd.q.bits == 4 || rd.q.bits == 8 ? 8 : 2);
}

/// x @ W on 1-4 rows, W (K, N) affine, over depths [k0, k1): R vectors of y per row of x stay in
/// registers across those depths; each depth's codes are decoded into registers as the values
/// round(s q) + b that dequantize() gives (bit for bit: the product kept out of an FMA), and every
/// row of x takes them by an FMA -- no buffer written and read back, y not reloaded per depth.
/// (The factored form sum_k (x s) q + sum_k x b, which the dot of x @ W^T uses within a group,
/// would here carry the bias sum across all K depths: its partial sums outgrow y's and float32
/// loses digits, 5e-4 at K = 5000 against the 1e-5 of this form.) sc, bi: the depths' scales and
/// biases as float32, `groups` a depth from group g0. Columns [c0, c1), c0 a multiple of 16 R;
/// SV = min(R, G / 16) vectors share a group. add: y += the sums, else y = them.
template <int M, int R, int SV, int BITS>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_axpy_rows512(const QuantReader<float>& rd, const float* X,
                                                                 const float* sc, const float* bi, std::int64_t groups,
                                                                 std::int64_t g0, float* Y, std::int64_t N,
                                                                 std::int64_t K, std::int64_t k0, std::int64_t k1,
                                                                 std::int64_t c0, std::int64_t c1, bool add) {
  static_assert(R % SV == 0);
  // 4-bit codes 32 at a time where a group holds 32 or more: 16 bytes widened to 16 lanes hold the
  // even columns in their low nibbles and the odd ones in their high, so a[.][2i] sums the even
  // columns of its 32 and a[.][2i + 1] the odd ones, put back in order once, at the store.
  constexpr bool kPairs = BITS == 4 && SV % 2 == 0;
  for (std::int64_t cb = c0; cb + 16 * R <= c1; cb += 16 * R) {
    __m512 a[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[m][r] = _mm512_setzero_ps();
    const std::int64_t first = cb / rd.q.group - g0;  // the block's first group; R / SV groups follow
    for (std::int64_t k = k0; k < k1; ++k) {
      const std::uint8_t* row = rd.codes + k * rd.row_bytes;
      const float* sk = sc + (k - k0) * groups + first;
      const float* bk = bi + (k - k0) * groups + first;
      __m512 xk[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) xk[m] = _mm512_set1_ps(X[m * K + k]);
#pragma GCC unroll 8
      for (int h = 0; h < R / SV; ++h) {
        const __m512 sv = _mm512_set1_ps(sk[h]), bv = _mm512_set1_ps(bk[h]);
#pragma GCC unroll 8
        for (int v = 0; v < SV; ++v) {
          const int r = h * SV + v;
          __m512 q;
          if constexpr (kPairs) {
            const __m512i b = _mm512_maskz_cvtepu8_epi32(
                kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (cb + 16 * (r & ~1)) / 2)));
            q = _mm512_maskz_cvtepi32_ps(kAll16, r % 2 == 0 ? _mm512_and_si512(b, _mm512_set1_epi32(15))
                                                            : _mm512_maskz_srli_epi32(kAll16, b, 4));
          } else {
            q = _mm512_maskz_cvtepi32_ps(kAll16, codes16<BITS>(row, static_cast<std::uint64_t>(cb + 16 * r)));
          }
          __m512 w = _mm512_mul_ps(sv, q);  // round(s q) + b, as dequantize()
          asm("" : "+v"(w));
          w = _mm512_add_ps(w, bv);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) a[m][r] = _mm512_fmadd_ps(xk[m], w, a[m][r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* y = Y + m * N + cb + 16 * r;
        __m512 v = a[m][r];
        if constexpr (kPairs) {  // back from (even, odd) columns to their order
          const __m512i idx = r % 2 == 0 ? _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
                                         : _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
          v = r % 2 == 0 ? _mm512_maskz_permutex2var_ps(kAll16, a[m][r], idx, a[m][r + 1])
                         : _mm512_maskz_permutex2var_ps(kAll16, a[m][r - 1], idx, a[m][r]);
        }
        _mm512_storeu_ps(y, add ? _mm512_add_ps(_mm512_loadu_ps(y), v) : v);
      }
  }
}

/// y (M, N) (+)= x (M, K) @ W over columns [c0, c1) (multiples of 16), 1-8 rows, by
/// affine_axpy_rows512. Depths go in chunks whose codes (256 KB) stay in L2 across every column
/// block and both passes of 4 rows (5-8 rows), their scales and biases widened once to float32;
/// each chunk adds to y. Blocks of 128 columns (1-2 rows) or 64 (3-4) while they last, single
/// vectors at the ends.
inline void affine_axpy_rows_any(const QuantReader<float>& rd, const float* X, float* Y, std::int64_t M,
                                 std::int64_t N, std::int64_t K, std::int64_t c0, std::int64_t c1, bool acc) {
  const std::int64_t G = rd.q.group, g0 = c0 / G, groups = (c1 - 1) / G + 1 - g0;
  const std::int64_t KC = std::min(K, std::clamp<std::int64_t>((std::int64_t{256} << 10) / rd.row_bytes, 16, 4096));
  static thread_local std::vector<float> buf;
  buf.resize(static_cast<std::size_t>(2 * KC * groups));
  float* sc = buf.data();       // (KC, groups) scales of the chunk
  float* bi = sc + KC * groups;  // (KC, groups) biases of the chunk
  for (std::int64_t k0 = 0; k0 < K; k0 += KC) {
    const std::int64_t k1 = std::min(K, k0 + KC);
    for (std::int64_t k = k0; k < k1; ++k) {
      widen_scales(rd.scales, rd.sdt, k * rd.groups_per_row + g0, groups, sc + (k - k0) * groups);
      widen_scales(rd.biases, rd.sdt, k * rd.groups_per_row + g0, groups, bi + (k - k0) * groups);
    }
    const bool add = acc || k0 > 0;
    with_code_bits(rd.q.bits, [&]<int BITS>() {
      const auto run = [&]<int MM, int RR>(const float* Xm, float* Ym, std::int64_t from, std::int64_t to) {
        const std::int64_t vpg = G / 16;  // 16-code vectors a group
        const auto kern = [&]<int SV>() {
          affine_axpy_rows512<MM, RR, SV, BITS>(rd, Xm, sc, bi, groups, g0, Ym, N, K, k0, k1, from, to, add);
        };
        if constexpr (RR == 1) {
          kern.template operator()<1>();
        } else {  // SV = min(RR, vpg)
          if (vpg == 1) kern.template operator()<1>();
          else if (vpg == 2 || RR == 2) kern.template operator()<2>();
          else if constexpr (RR >= 4) {
            if (vpg == 4 || RR == 4) kern.template operator()<4>();
            else if constexpr (RR == 8) kern.template operator()<8>();
          }
        }
      };
      const auto rows = [&]<int MM, int RR>(const float* Xm, float* Ym) {
        // blocks of 16 RR columns from a multiple of 16 RR: whole groups, or inside one
        const std::int64_t a = std::min(c1, (c0 + 16 * RR - 1) / (16 * RR) * (16 * RR));
        const std::int64_t b = a + (c1 - a) / (16 * RR) * (16 * RR);
        run.template operator()<MM, 1>(Xm, Ym, c0, a);
        run.template operator()<MM, RR>(Xm, Ym, a, b);
        run.template operator()<MM, 1>(Xm, Ym, b, c1);
      };
      for (std::int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* Xm = X + m0 * K;
        float* Ym = Y + m0 * N;
        switch (std::min<std::int64_t>(4, M - m0)) {
          case 1: rows.template operator()<1, 8>(Xm, Ym); break;
          case 2: rows.template operator()<2, 8>(Xm, Ym); break;
          case 3: rows.template operator()<3, 4>(Xm, Ym); break;
          default: rows.template operator()<4, 4>(Xm, Ym); break;
        }
      }
    });
  }
}
#endif

/// y (M, N) (+)= x (M, K) @ op(W) for few rows of x (a decode step, a short prompt), columns
/// [n0, n1) of y: W is streamed once, a row (x @ W^T: one output column) or a row segment (x @ W:
/// one depth) at a time, decoded into a small buffer that every row of x then reads -- or, for
/// affine float32 on AVX-512, into registers (affine_dot_rows512: x @ W^T, factored within each
/// group; affine_axpy_rows512: x @ W, y held in registers over the depths). No packing, and no
/// padding of x to the micro-kernel's MR rows. False when a row does not fit the buffer (the
/// caller takes the GEMM path).
template <class T>
inline bool quantized_rows(const QuantReader<T>& rd, const T* X, T* Y, std::int64_t M, std::int64_t N, std::int64_t K,
                           std::int64_t n0, std::int64_t n1, bool transpose, bool acc) {
  alignas(64) static thread_local T buf[8192];
  constexpr std::int64_t cap = 8192;
  if (transpose) {
    if (K > cap) return false;
#if defined(NN_QUANT_AVX2)
    if (affine_dot_rows_any(rd, X, Y, M, N, K, n0, n1, acc)) return true;  // affine float32: no values formed
#endif
    for (std::int64_t j = n0; j < n1; ++j) {
      rd.run(j, 0, K, buf, 1);
      for (std::int64_t m = 0; m < M; ++m) {
        const T v = dot_fast(X + m * K, static_cast<const T*>(buf), K);
        Y[m * N + j] = acc ? Y[m * N + j] + v : v;
      }
    }
    return true;
  }
#if defined(NN_QUANT_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (affine_axpy_rows512_applies(rd, M)) {  // whole vectors of y in registers; the ragged ends as below
      const std::int64_t a = std::min(n1, (n0 + 15) / 16 * 16), b = std::max(a, n1 / 16 * 16);
      if (a < b) {
        affine_axpy_rows_any(rd, X, Y, M, N, K, a, b, acc);
        if (n0 < a) quantized_rows(rd, X, Y, M, N, K, n0, a, false, acc);  // not affine_axpy's: a - n0 < 16
        if (b < n1) quantized_rows(rd, X, Y, M, N, K, b, n1, false, acc);
        return true;
      }
    }
  }
#endif
  for (std::int64_t c0 = n0; c0 < n1; c0 += cap) {  // a block of y's columns stays in cache over all of K
    const std::int64_t nc = std::min(cap, n1 - c0);
    if (!acc)
      for (std::int64_t m = 0; m < M; ++m) std::fill_n(Y + m * N + c0, nc, T(0));
    for (std::int64_t k = 0; k < K; ++k) {
      rd.run(k, c0, nc, buf, 1);
      for (std::int64_t m = 0; m < M; ++m) axpy_fast(Y + m * N + c0, X[m * K + k], static_cast<const T*>(buf), nc);
    }
  }
  return true;
}

}  // namespace detail

namespace cpu_kernels {

// A class template with one instance, `QuantizedKernels` (why: backend/cpu.hpp).
template <class = void>
struct QuantizedKernelsT {
  /// Up to this many rows of x, products stream W once (detail::quantized_rows) instead of
  /// packing it for the GEMM: x @ W^T computes a dot product per output (up to twice as many
  /// rows where the AVX-512 factored dot serves the matrix), x @ W an axpy per depth, which holds
  /// its advantage longer (bench_quantized_matmul's 1-8 token rows decide it).
  static constexpr std::int64_t kFewRows = 4, kFewRowsAxpy = 8;

  /// y (M, N) (+)= x (M, K) @ op(W): W^T when a.transpose (W (N, K)), else W (K, N); W given
  /// as codes, scales and biases (undefined for mxfp4) in format a.q. T = y's dtype = x's;
  /// scales of another float dtype are widened to T.
  static void quantized_matmul(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const QuantMatmulAttrs& a, Tensor& y, bool acc) {
    detail::dispatch_float(y.dtype(), "quantized_matmul", [&]<class T>() {
      const std::int64_t K = x.dim(-1), M = x.numel() / std::max<std::int64_t>(K, 1), N = y.dim(-1);
      quantized_product<T>(detail::QuantReader<T>(wq, scales, biases, a.q), x.data<T>(), y.data<T>(), M, N, K,
                           a.transpose, acc);
    });
  }

  /// The same on raw rows: Y (M, N) (+)= X (M, K) @ op(W), W read through rd (a block of a
  /// matrix's rows: QuantReader::rows_from), X and Y contiguous.
  template <class T>
  static void quantized_product(const detail::QuantReader<T>& rd, const T* X, T* Y, std::int64_t M, std::int64_t N,
                                std::int64_t K, bool transpose, bool acc) {
    if (M == 0 || N == 0) return;
#if defined(NN_OWN_GEMM)
#if defined(NN_QUANT_AVX2)
    const std::int64_t dot_rows = detail::affine_dot_rows512_applies(rd) ? 2 * kFewRows : kFewRows;
#else
    const std::int64_t dot_rows = kFewRows;
#endif
    if (transpose ? M <= dot_rows && K <= 8192 : M <= kFewRowsAxpy) {
      const int threads = gemm::team_threads(M, N, K);
      if (threads > 1)
        gemm::split_columns(threads, N, [&](gemm::index d0, gemm::index d1) {
          detail::quantized_rows(rd, X, Y, M, N, K, d0, d1, transpose, acc);
        });
      else
        detail::quantized_rows(rd, X, Y, M, N, K, 0, N, transpose, acc);
      return;
    }
    gemm::with_isa(gemm::active_isa(), [&]<Isa I>() {
      using S = gemm::Shape<T, I>;
      const auto kern = gemm::micro_kernels<T, I>();
      const gemm::DensePackA<S::MR, T> pa{gemm::Matrix<T>{X, K, false}};
      const int threads = gemm::team_threads(M, N, K);
      if (threads > 1 && M < 24 * threads) {  // few rows: each thread packs its own columns
        gemm::split_columns(threads, N, [&](gemm::index d0, gemm::index d1) {
          gemm::gemm_blocked<T, S>(kern, M, d1 - d0, K, pa, gemm::QuantPackB<S::NR, T>{&rd, transpose, d0}, Y + d0,
                                   N, acc);
        });
        return;
      }
#if defined(_OPENMP)
      if (threads > 1)
        return gemm::gemm_team<T, S>(threads, kern, M, N, K, pa, gemm::QuantPackB<S::NR, T>{&rd, transpose}, Y, N,
                                     acc);
#endif
      gemm::gemm_blocked<T, S>(kern, M, N, K, pa, gemm::QuantPackB<S::NR, T>{&rd, transpose}, Y, N, acc);
    });
#else
    // no packing hook on this compiler: blocks of 128 rows of W dequantized into a workspace
    constexpr std::int64_t R = 128;
    const std::int64_t wrows = transpose ? N : K, wcols = transpose ? K : N;
    T* buf = static_cast<T*>(detail::gemm_workspace(sizeof(T) * static_cast<std::size_t>(R * wcols), 2));
    for (std::int64_t r0 = 0; r0 < wrows; r0 += R) {
      const std::int64_t nr = std::min(R, wrows - r0);
      for (std::int64_t r = 0; r < nr; ++r) rd.run(r0 + r, 0, wcols, buf + r * wcols, 1);
      if (transpose) detail::gemm_serial<T>(false, true, M, nr, K, X, K, buf, K, Y + r0, N, acc);
      else detail::gemm_serial<T>(false, false, M, N, nr, X + r0, K, buf, N, Y, N, acc || r0 > 0);
    }
#endif
  }

  /// y (n, D) = rows ids[0..n) of the quantized table W (V, D), dequantized to y's dtype.
  /// An id outside [0, V) is an nn::Error naming it.
  static void quantized_gather(const Tensor& ids, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const Quant& q, Tensor& y) {
    detail::dispatch_float(y.dtype(), "quantized_gather", [&]<class T>() {
      const detail::QuantReader<T> rd(wq, scales, biases, q);
      const std::int64_t n = ids.numel(), D = y.dim(-1), V = wq.dim(0);
      T* Y = y.data<T>();
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t id = ids.dtype() == DType::i32 ? ids.data<std::int32_t>()[i] : ids.data<std::int64_t>()[i];
        if (id < 0 || id >= V)
          detail::fail("quantized_gather", "id ", id, " at position ", i, " is outside the table's ", V, " rows");
        rd.run(id, 0, D, Y + i * D, 1);
      }
    });
  }
};
using QuantizedKernels = QuantizedKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
