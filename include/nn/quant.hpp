// SPDX-License-Identifier: MIT OR Apache-2.0
// Quantized matrices in MLX's formats, bit for bit: nn::quantize / nn::dequantize, and the code
// reader every quantized kernel (ops/quantized.hpp's CPU and CUDA kernels) decodes with.
//
// A quantized (rows, cols) matrix is three tensors, as mx.quantize returns them and
// mlx.nn.QuantizedLinear stores them:
//   weight (rows, cols * bits / 32) u32  the codes, an LSB-first bit stream per row: code j sits
//                                        at bits [j*bits, (j+1)*bits) of the row's little-endian
//                                        bytes (8 x 4-bit or 4 x 8-bit per word; 3/5/6-bit codes
//                                        straddle bytes, as MLX packs them)
//   scales (rows, cols / group)          the weight's float dtype (affine), or u8: E8M0 (mxfp4,
//                                        mxfp8), E4M3 (nvfp4)
//   biases (rows, cols / group)          affine only
// affine:  w = scale * q + bias,  q in [0, 2^bits - 1]               (groups 32/64/128, bits 2-8)
// mxfp4:   w = 2^(e - 127) * E2M1[q], E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6} with the sign in bit 3
//                                                                     (group 32, 4 bits)
// mxfp8:   w = 2^(e - 127) * E4M3[q]                                  (group 32, 8 bits)
// nvfp4:   w = E4M3[s] * E2M1[q]                                      (group 16, 4 bits)
#pragma once

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

#include "backend/cpu_info.hpp"
#include "backend/math.hpp"

namespace nn {

/// A quantized matrix: packed codes, scales, biases (undefined for the fp modes) and the format.
struct QuantizedMatrix {
  Tensor weight, scales, biases;
  Quant q;
  std::int64_t rows() const { return weight.dim(0); }
  std::int64_t cols() const { return weight.dim(-1) * 32 / q.bits; }
  /// The float dtype the matrix dequantizes to: the scales' (affine), float32 (the fp modes).
  DType dtype() const { return q.mode == QuantMode::affine ? scales.dtype() : DType::f32; }
  /// Bytes held: codes, scales and biases.
  std::size_t nbytes() const { return weight.nbytes() + scales.nbytes() + (biases.defined() ? biases.nbytes() : 0); }
};

namespace detail {
inline std::atomic<bool>& int8_activations_flag() {
  static std::atomic<bool> on{false};
  return on;
}
}  // namespace detail

/// Opt-in, off by default: int8 activations for quantized products on few rows (generation).
/// While on, x @ W^T with 1-8 rows of float32 x and an affine 4- or 8-bit W (a power-of-two
/// group of 32 or more: MLX's 32/64/128, GGUF's Q4_0/Q4_1/Q8_0) rounds x to int8 in blocks of 32
/// values -- llama.cpp's Q8_0 rule: d = max|x| / 127, q = nearbyint(x * (127 / max|x|)) -- and
/// multiplies the codes on the integer units (AVX512-VNNI `vpdpbusd`, 64 products an instruction,
/// where float32 takes 16), each 32-block's sum then scaled by s * d; the biases still meet the
/// exact sums of x. This is what llama.cpp does on every CPU product. It changes results (x
/// keeps about 8 bits: ~1e-3 relative on a logit), so it is off by default and meant for
/// generation, not for training or for matching MLX's quantized_matmul (which the default path
/// does to 1e-6). Where it does not apply (no AVX512-VNNI, NN_CPU_ISA=avx2 or generic, another
/// format, more rows) the float32 path runs unchanged. Process-wide; safe to flip between calls.
inline void set_int8_activations(bool on) { detail::int8_activations_flag().store(on, std::memory_order_relaxed); }
inline bool int8_activations() { return detail::int8_activations_flag().load(std::memory_order_relaxed); }

namespace detail {

/// Refuses a format MLX does not define: affine groups 32/64/128 with bits 2/3/4/5/6/8 (and the
/// GGUF-style groups 16 and 256), mxfp4 and mxfp8 with group 32 (4 and 8 bits), nvfp4 with
/// group 16 and 4 bits.
inline void check_quant(const Quant& q, const char* op) {
  if (quant_fp(q.mode)) {
    const Quant want = q.mode == QuantMode::mxfp4 ? Quant::mxfp4() : q.mode == QuantMode::mxfp8 ? Quant::mxfp8() : Quant::nvfp4();
    if (q.group != want.group || q.bits != want.bits)
      fail(op, quant_mode_name(q.mode), " needs group size ", want.group, " and ", want.bits, " bits, got group ", q.group,
           " and ", q.bits, " bits");
    return;
  }
  if (q.bits < 2 || q.bits > 8 || q.bits == 7)
    fail(op, "affine quantization supports 2, 3, 4, 5, 6 and 8 bits, got ", q.bits);
  if (q.group != 16 && q.group != 32 && q.group != 64 && q.group != 128 && q.group != 256)
    fail(op, "affine quantization supports group sizes 32, 64 and 128 (and GGUF's 16 and 256), got ", q.group);
}

/// What the checks read of a tensor: shape and dtype (or absent), so a tape's builder checks
/// without touching data.
struct QuantPart {
  bool defined = false;
  Shape shape;
  DType dtype = DType::f32;
  QuantPart() = default;
  QuantPart(const Shape& s, DType t) : defined(true), shape(s), dtype(t) {}
  QuantPart(const Tensor& t) : defined(t.defined()), shape(t.defined() ? t.shape() : Shape{}), dtype(t.dtype()) {}  // NOLINT
  std::string str() const { return defined ? std::string(dtype_name(dtype)) + " " + shape.str() : std::string("none"); }
};

/// Checks that codes, scales and biases form a (rows, cols) matrix in format q; returns cols.
inline std::int64_t check_quantized(const QuantPart& wq, const QuantPart& scales, const QuantPart& biases,
                                    const Quant& q, const char* op) {
  check_quant(q, op);
  if (!wq.defined || wq.dtype != DType::u32 || wq.shape.rank() != 2)
    fail(op, "the quantized weight must be a (rows, cols * bits / 32) uint32 matrix, got ", wq.str());
  const std::int64_t cols = wq.shape[1] * 32 / q.bits;
  if (wq.shape[1] * 32 % q.bits != 0 || cols % q.group != 0)
    fail(op, "a weight of ", wq.shape.str(), " words holds ", wq.shape[1] * 32, " bits per row, not a whole number of ",
         q.group, "-column groups of ", q.bits, "-bit codes");
  const Shape s{wq.shape[0], cols / q.group};
  if (!scales.defined || scales.shape != s)
    fail(op, "scales must be ", s.str(), " for a weight of ", wq.shape.str(), " (", quant_mode_name(q.mode), ", group ",
         q.group, ", ", q.bits, " bits), got ", scales.str());
  if (quant_fp(q.mode)) {
    if (scales.dtype != DType::u8)
      fail(op, quant_mode_name(q.mode), " scales must be uint8 (", q.mode == QuantMode::nvfp4 ? "E4M3" : "E8M0", "), got ",
           scales.str());
    if (biases.defined) fail(op, quant_mode_name(q.mode), " has no biases, got ", biases.str());
  } else {
    const DType t = scales.dtype;
    if (t != DType::f32 && t != DType::f64 && t != DType::bf16 && t != DType::f16)
      fail(op, "affine scales must be float32, float64, bfloat16 or float16, got ", scales.str());
    if (!biases.defined || biases.shape != s || biases.dtype != t)
      fail(op, "affine biases must be ", dtype_name(t), " ", s.str(), " like the scales, got ", biases.str());
  }
  return cols;
}

/// The same for tensors, which must also be on the host.
inline std::int64_t check_quantized(const Tensor& wq, const Tensor& scales, const Tensor& biases, const Quant& q,
                                    const char* op) {
  const std::int64_t cols = check_quantized(QuantPart(wq), QuantPart(scales), QuantPart(biases), q, op);
  for (const Tensor* t : {&wq, &scales, &biases})
    if (t->defined() && t->device() != Device::cpu) fail(op, "quantized tensors must be on the host here, got ", t->device());
  return cols;
}

/// A scale or bias element widened to T (f32/f64/bf16/f16 storage).
template <class T>
inline T widen_scale(const void* p, DType t, std::int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<T>(static_cast<const float*>(p)[i]);
    case DType::f64: return static_cast<T>(static_cast<const double*>(p)[i]);
    case DType::bf16: return static_cast<T>(half::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]));
    default: return static_cast<T>(half::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]));
  }
}

/// The value stored as T's storage type: f32 as is, bf16/f16 rounded to nearest even.
inline float round_to(DType t, float v) {
  if (t == DType::bf16) return half::bf16_round(v);
  if (t == DType::f16) return half::f16_to_f32(half::f32_to_f16(v));
  return v;
}

/// Keeps the compiler from fusing a product into the next addition (an FMA rounds once; MLX's
/// dequantize rounds the product, then the sum).
template <class T>
inline T rounded(T v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__)
  asm("" : "+x"(v));
#endif
  return v;
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__CUDACC__)
#define NN_QUANT_AVX2 1
/// Whether this CPU runs the AVX2 decoders below (checked once; NN_CPU_ISA=generic turns them off
/// with the GEMM's kernels).
inline bool quant_avx2() {
  static const bool yes = choose_isa(detect_cpu_features()) != Isa::generic;
  return yes;
}

/// Codes c .. c + 7 of one row's bit stream (c a multiple of 8) in eight int32 lanes, BITS wide:
/// 4 bits two a byte (low nibble first), 8 bits a byte each, and 2, 3, 5 and 6 bits straddling
/// bytes (the eight fill BITS bytes from byte c * BITS / 8: codes 0-3 in the low 4 * BITS <= 24
/// bits, codes 4-7 in the next 4 * BITS, the two halves shifted apart in one variable shift).
template <int BITS>
[[gnu::target("avx2"), gnu::always_inline]] inline __m256i codes8(const std::uint8_t* row, std::uint64_t c) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
  } else if constexpr (BITS == 4) {
    std::uint32_t w;
    std::memcpy(&w, row + c / 2, 4);
    const __m128i v = _mm_cvtsi32_si128(static_cast<int>(w)), nib = _mm_set1_epi8(0x0f);
    return _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib)));
  } else {
    // The BITS bytes assembled in a register from loads of 4, 2 and 1 bytes: no byte past the
    // eight codes is read, and no partial stores are read back whole (a store-forwarding stall).
    const std::uint8_t* p = row + c / 8 * BITS;
    std::uint32_t lo = 0;
    std::uint16_t mid = 0;
    std::uint64_t w;
    if constexpr (BITS == 2) std::memcpy(&mid, p, 2), w = mid;
    else if constexpr (BITS == 3) std::memcpy(&mid, p, 2), w = mid | static_cast<std::uint64_t>(p[2]) << 16;
    else if constexpr (BITS == 5) std::memcpy(&lo, p, 4), w = lo | static_cast<std::uint64_t>(p[4]) << 32;
    else std::memcpy(&lo, p, 4), std::memcpy(&mid, p + 4, 2), w = lo | static_cast<std::uint64_t>(mid) << 32;
    const __m256i v = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(w >> (4 * BITS))), _mm_set1_epi32(static_cast<int>(w)));
    const __m256i sh = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 0, BITS, 2 * BITS, 3 * BITS);
    return _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32((1 << BITS) - 1));
  }
}

/// Calls f.template operator()<BITS>() for bits in {2, 3, 4, 5, 6, 8} (a code width known at
/// compile time inside the loops that decode).
template <class F>
inline decltype(auto) with_code_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    default: return f.template operator()<8>();
  }
}

/// out[0, n) = values c0 .. c0 + n of one row of mxfp4 or nvfp4 in float32, s * E2M1[q], eight
/// at a time (c0 and n multiples of 8, inside one group). Affine runs go through affine_run_*.
[[gnu::target("avx2")]] inline void decode8_e2m1(const std::uint8_t* row, std::uint64_t c0, std::uint64_t n, float s,
                                                 float* out) {
  const __m256 vs = _mm256_set1_ps(s);
  // E2M1 in two halves of 8 (codes 0-7 positive, 8-15 their negatives, 8 being -0).
  const __m256 pos = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 neg = _mm256_setr_ps(-0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  for (std::uint64_t i = 0; i < n; i += 8) {
    const __m256i q = codes8<4>(row, c0 + i);
    const __m256 lo = _mm256_permutevar8x32_ps(pos, q), hi = _mm256_permutevar8x32_ps(neg, q);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(vs, _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)))));
  }
}

/// Whether this CPU runs the AVX-512 decoder (16 codes a vector; NN_CPU_ISA=avx2 or generic turns
/// it off with the GEMM's AVX-512 kernels).
inline bool quant_avx512() {
  static const bool yes = choose_isa(detect_cpu_features()) == Isa::avx512;
  return yes;
}

/// Whether this CPU runs the int8-activation kernel (set_int8_activations): the AVX-512 decoders
/// and AVX512-VNNI.
inline bool quant_vnni() {
  static const bool yes = quant_avx512() && detect_cpu_features().avx512_vnni;
  return yes;
}

/// Per lane i of 16: the bytes of code i (from byte i * BITS / 8) gathered into its dword, and
/// the shift that brings the code to bit 0 (codes16's shuffle and shift, as constants).
template <int BITS>
struct Codes16Layout {
  alignas(64) std::uint8_t shuffle[64];
  alignas(64) std::uint32_t shift[16];
  constexpr Codes16Layout() : shuffle(), shift() {
    for (int i = 0; i < 16; ++i) {
      const int byte = i * BITS / 8;
      for (int k = 0; k < 4; ++k) shuffle[4 * i + k] = k < 2 && byte + k < 16 ? static_cast<std::uint8_t>(byte + k) : 0x80;
      shift[i] = static_cast<std::uint32_t>(i * BITS % 8);
    }
  }
};
template <int BITS>
inline constexpr Codes16Layout<BITS> kCodes16{};

#define NN_QUANT_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
// The AVX-512 code below uses the zero-masked forms with every lane set (kAll16) where GCC 12's
// plain intrinsics pass an _mm512_undefined_* operand, which -Wmaybe-uninitialized reports
// wherever they are inlined (the same instructions; the GEMM's transposes do the same).
inline constexpr __mmask16 kAll16 = 0xffff;

/// Codes c .. c + 15 of one row's bit stream (c a multiple of 8) in sixteen int32 lanes. 4 and 8
/// bits as in codes8; other widths: the 2 * BITS bytes that hold them (a masked load reads nothing
/// past them) in every 128-bit lane, each code's two bytes shuffled into its lane, shifted down
/// and masked.
template <int BITS>
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline __m512i codes16(const std::uint8_t* row, std::uint64_t c) {
  if constexpr (BITS == 8) {
    return _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
  } else if constexpr (BITS == 4) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2)), nib = _mm_set1_epi8(0x0f);
    return _mm512_maskz_cvtepu8_epi32(kAll16, _mm_unpacklo_epi8(_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib)));
  } else {
    const __m128i bytes = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (2 * BITS)) - 1), row + c / 8 * BITS);
    const __m512i lanes = _mm512_maskz_shuffle_epi8(0xffffffffffffffffull, _mm512_maskz_broadcast_i32x4(kAll16, bytes),
                                                    _mm512_load_si512(kCodes16<BITS>.shuffle));
    return _mm512_and_si512(_mm512_maskz_srlv_epi32(kAll16, lanes, _mm512_load_si512(kCodes16<BITS>.shift)),
                            _mm512_set1_epi32((1 << BITS) - 1));
  }
}

/// A scale or bias of storage type SDT widened to float (affine_run's loads, the type fixed).
template <DType SDT>
[[gnu::always_inline]] inline float scale_f32(const void* p, std::int64_t i) {
  if constexpr (SDT == DType::f32) return static_cast<const float*>(p)[i];
  else if constexpr (SDT == DType::f64) return static_cast<float>(static_cast<const double*>(p)[i]);
  else if constexpr (SDT == DType::bf16) return half::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  else return half::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
}

/// One affine value, round(s * q) + b, as dequantize() and MLX compute it (the product is kept
/// out of an FMA).
template <int BITS>
[[gnu::always_inline]] inline float affine_value(const std::uint8_t* row, std::int64_t row_bytes, float s, float b,
                                                 std::int64_t c) {
  return rounded(s * static_cast<float>(QuantMath::code(row, c, BITS, row_bytes))) + b;
}

/// Values c .. gend of one group (scale s, bias b) into out, eight at a time from a multiple of 8,
/// the rest one at a time; c and out advance. Shared by both vector widths of affine_run.
template <int BITS>
[[gnu::target("avx2"), gnu::always_inline]] inline void affine_run8(const std::uint8_t* row, std::int64_t row_bytes,
                                                                   float s, float b, std::int64_t& c, std::int64_t gend,
                                                                   float*& out) {
  for (; c < gend && c % 8 != 0; ++c) *out++ = affine_value<BITS>(row, row_bytes, s, b, c);
  const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  for (; c + 8 <= gend; c += 8, out += 8) {
    __m256 p = _mm256_mul_ps(vs, _mm256_cvtepi32_ps(codes8<BITS>(row, static_cast<std::uint64_t>(c))));
    asm("" : "+x"(p));
    _mm256_storeu_ps(out, _mm256_add_ps(p, vb));
  }
  for (; c < gend; ++c) *out++ = affine_value<BITS>(row, row_bytes, s, b, c);
}

/// out[0, n) = W[r, c0 .. c0 + n) of an affine matrix in float32 (row: row r's codes; scales and
/// biases: row r's), the code width and the scales' storage fixed at compile time, so that a run
/// over many groups pays for no dispatch per group: the AVX-512 form decodes 16 codes a vector
/// (from a multiple of 8, after affine_run8's scalar head), the AVX2 form 8.
template <int BITS, DType SDT>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_run_avx512(const std::uint8_t* row, std::int64_t row_bytes,
                                                               const void* scales, const void* biases,
                                                               std::int64_t group, std::int64_t c, std::int64_t n,
                                                               float* out) {
  const std::int64_t end = c + n;
  for (std::int64_t g = c / group; c < end; ++g) {  // one division per run, none per group
    const std::int64_t gend = std::min(end, (g + 1) * group);
    const float s = scale_f32<SDT>(scales, g), b = scale_f32<SDT>(biases, g);
    for (; c < gend && c % 8 != 0; ++c) *out++ = affine_value<BITS>(row, row_bytes, s, b, c);
    const __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
    for (; c + 16 <= gend; c += 16, out += 16) {
      __m512 p = _mm512_mul_ps(vs, _mm512_maskz_cvtepi32_ps(kAll16, codes16<BITS>(row, static_cast<std::uint64_t>(c))));
      asm("" : "+v"(p));
      _mm512_storeu_ps(out, _mm512_add_ps(p, vb));
    }
    affine_run8<BITS>(row, row_bytes, s, b, c, gend, out);
  }
}
template <int BITS, DType SDT>
[[gnu::target("avx2")]] inline void affine_run_avx2(const std::uint8_t* row, std::int64_t row_bytes, const void* scales,
                                                    const void* biases, std::int64_t group, std::int64_t c,
                                                    std::int64_t n, float* out) {
  const std::int64_t end = c + n;
  for (std::int64_t g = c / group; c < end; ++g) {
    const std::int64_t gend = std::min(end, (g + 1) * group);
    affine_run8<BITS>(row, row_bytes, scale_f32<SDT>(scales, g), scale_f32<SDT>(biases, g), c, gend, out);
  }
}

/// Calls f.template operator()<SDT>() for a scale storage type (f32, f64, bf16, f16).
template <class F>
inline decltype(auto) with_scale_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f.template operator()<DType::f32>();
    case DType::f64: return f.template operator()<DType::f64>();
    case DType::bf16: return f.template operator()<DType::bf16>();
    default: return f.template operator()<DType::f16>();
  }
}
#endif

/// Reads a quantized matrix's values in T: the decoding every CPU quantized kernel shares.
/// Values are scale * q + bias (affine) or scale * E2M1[q] / E4M3[q] (the fp modes), in T's
/// arithmetic.
template <class T>
struct QuantReader {
  const std::uint8_t* codes;  // row r's bit stream at codes + r * row_bytes
  std::int64_t row_bytes, groups_per_row;
  const void* scales;
  const void* biases;
  DType sdt;
  Quant q;

  QuantReader(const Tensor& wq, const Tensor& s, const Tensor& b, const Quant& quant)
      : codes(static_cast<const std::uint8_t*>(wq.raw())),
        row_bytes(wq.dim(1) * 4),
        groups_per_row(s.dim(1)),
        scales(s.raw()),
        biases(b.defined() ? b.raw() : nullptr),
        sdt(s.dtype()),
        q(quant) {}

  /// The same matrix from row r0 on, its rows r0.. read as rows 0..: a block of rows, no copy
  /// (linear_cross_entropy's vocabulary blocks).
  QuantReader rows_from(std::int64_t r0) const {
    QuantReader r = *this;
    const std::int64_t skip = r0 * groups_per_row * static_cast<std::int64_t>(dtype_size(sdt));
    r.codes += r0 * row_bytes;
    r.scales = static_cast<const char*>(scales) + skip;
    if (biases) r.biases = static_cast<const char*>(biases) + skip;
    return r;
  }

  /// out[i * stride] = W[r, c0 + i] for i < n.
  void run(std::int64_t r, std::int64_t c0, std::int64_t n, T* out, std::int64_t stride) const {
    const std::uint8_t* row = codes + r * row_bytes;
    const std::int64_t end = c0 + n;
#if defined(NN_QUANT_AVX2)
    // affine float32 into a contiguous run (every GEMM packer and streamed product): one dispatch
    // per call on the code width, the scales' type and the vector width, none per group.
    if constexpr (std::is_same_v<T, float>) {
      if (stride == 1 && q.mode == QuantMode::affine && quant_avx2()) {
        const bool wide512 = quant_avx512();
        const void* s = static_cast<const char*>(scales) + r * groups_per_row * dtype_size(sdt);
        const void* b = static_cast<const char*>(biases) + r * groups_per_row * dtype_size(sdt);
        with_code_bits(q.bits, [&]<int BITS>() {
          with_scale_dtype(sdt, [&]<DType SDT>() {
            if (wide512) affine_run_avx512<BITS, SDT>(row, row_bytes, s, b, q.group, c0, n, out);
            else affine_run_avx2<BITS, SDT>(row, row_bytes, s, b, q.group, c0, n, out);
          });
        });
        return;
      }
    }
    // mxfp4 and nvfp4 float32 into a contiguous run: whole runs of 8 codes inside a group go
    // eight at a time (mxfp8's E4M3 bytes take the scalar loop).
    const bool wide = std::is_same_v<T, float> && stride == 1 && quant_fp(q.mode) && q.bits == 4 && quant_avx2();
#endif
    for (std::int64_t c = c0; c < end;) {
      const std::int64_t g = c / q.group, gend = std::min(end, (g + 1) * q.group);
      const std::int64_t si = r * groups_per_row + g;
      const bool fp = quant_fp(q.mode), fp4 = fp && q.bits == 4;
      const std::uint8_t sb = fp ? static_cast<const std::uint8_t*>(scales)[si] : 0;
      const T s = !fp                          ? widen_scale<T>(scales, sdt, si)
                  : q.mode == QuantMode::nvfp4 ? static_cast<T>(QuantMath::e4m3(sb))
                                               : QuantMath::e8m0<T>(sb);
      const T b = fp ? T(0) : widen_scale<T>(biases, sdt, si);
#if defined(NN_QUANT_AVX2)
      if (wide && c % 8 == 0 && gend - c >= 8) {
        if constexpr (std::is_same_v<T, float>) {
          const std::int64_t n8 = (gend - c) / 8 * 8;
          decode8_e2m1(row, static_cast<std::uint64_t>(c), static_cast<std::uint64_t>(n8), s, out);
          c += n8;
          out += n8;
        }
      }
#endif
      if (fp4) {
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>(QuantMath::e2m1(QuantMath::code(row, c, 4, row_bytes)));
      } else if (fp) {  // mxfp8: a byte per code
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>(QuantMath::e4m3(row[c]));
      } else if (q.bits == 4) {  // the common case: two codes a byte
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>((row[c >> 1] >> ((c & 1) * 4)) & 15u) + b;
      } else if (q.bits == 8) {
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>(row[c]) + b;
      } else {
        for (; c < gend; ++c, out += stride)
          *out = s * static_cast<T>(QuantMath::code(row, c, q.bits, row_bytes)) + b;
      }
    }
  }
};

}  // namespace detail

/// mx.quantize(w, group_size, bits, mode), bit for bit (MLX 0.32.4's CPU kernel): w (rows, cols)
/// float32, bfloat16, float16 (or float64, quantized in double), cols a multiple of the group.
/// Affine, per group of `group` values along a row, in float32:
///   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|;
///   edge = min or max (whichever is larger in magnitude); q0 = rint(edge / scale);
///   if q0 != 0: scale = edge / q0, bias = edge (so the edge value is exact), else bias = 0;
///   q = clamp(rint((w - bias) / scale), 0, 2^bits - 1); scales and biases stored in w's dtype.
/// mxfp4: e = the smallest integer with 2^e >= amax / 6 (0 for a zero group), codes the nearest
/// E2M1 value of w / 2^e (the first in {+0, .5, ..., 6, -0, -.5, ..., -6} on a tie), scale byte
/// e + 127. mxfp8: the same with amax / 448 and E4M3 codes (round to nearest even, saturating).
/// nvfp4: scale = E4M3(amax / 6), codes the nearest E2M1 value of w / scale (MLX's global scale
/// is not supported). The fp modes' divisions are computed in w's dtype, as MLX does.
inline QuantizedMatrix quantize(const Tensor& w, Quant q = Quant::affine()) {
  detail::check_quant(q, "quantize");
  if (!w.defined() || w.rank() != 2)
    detail::fail("quantize", "needs a (rows, cols) matrix, got ", w.defined() ? w.shape().str() : std::string("none"));
  const DType dt = w.dtype();
  if (dt != DType::f32 && dt != DType::f64 && dt != DType::bf16 && dt != DType::f16)
    detail::fail("quantize", "only float matrices can be quantized, got ", dtype_name(dt), " ", w.shape().str());
  if (w.device() != Device::cpu) detail::fail("quantize", "runs on the host; the matrix is on ", w.device());
  const std::int64_t rows = w.dim(0), cols = w.dim(1);
  if (cols % q.group != 0)
    detail::fail("quantize", "the last dimension of ", w.shape().str(), " is not a multiple of the group size ",
                 q.group);
  if (cols * q.bits % 32 != 0)
    detail::fail("quantize", "a row of ", cols, " ", q.bits, "-bit codes does not fill whole 32-bit words");
  QuantizedMatrix out;
  out.q = q;
  out.weight = Tensor::zeros(Shape{rows, cols * q.bits / 32}, DType::u32);
  const std::int64_t groups = cols / q.group;
  out.scales = Tensor::empty(Shape{rows, groups}, quant_fp(q.mode) ? DType::u8 : dt);
  if (q.mode == QuantMode::affine) out.biases = Tensor::empty(Shape{rows, groups}, dt);
  auto* codes = static_cast<std::uint8_t*>(out.weight.raw());
  const std::int64_t row_bytes = cols * q.bits / 8;
  auto put_code = [&](std::int64_t r, std::int64_t c, std::uint32_t v) {
    detail::QuantMath::put_code(codes + r * row_bytes, c, q.bits, v);
  };
  auto store = [&](Tensor& t, std::int64_t i, double v) { detail::store_from_double(t.raw(), t.dtype(), i, v); };
  std::vector<double> g(static_cast<std::size_t>(q.group));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t gi = 0; gi < groups; ++gi) {
      for (std::int64_t j = 0; j < q.group; ++j) g[static_cast<std::size_t>(j)] = detail::load_as_double(w.raw(), dt, r * cols + gi * q.group + j);
      const std::int64_t si = r * groups + gi;
      if (quant_fp(q.mode)) {
        using M = detail::QuantMath;
        std::uint8_t& byte = static_cast<std::uint8_t*>(out.scales.raw())[si];
        double p = 0;  // the divisor of an E2M1 code
        if (q.mode == QuantMode::nvfp4) {
          byte = M::nvfp4_scale_byte(g.data(), q.group, dt);
          p = dt == DType::f64 ? static_cast<double>(M::e4m3(byte)) : M::in(dt, M::e4m3(byte));
        } else {
          const std::int32_t e = M::mx_exponent(g.data(), q.group, dt, q.mode == QuantMode::mxfp8 ? 448.0f : 6.0f);
          byte = M::mxfp4_byte(e);
          if (q.mode == QuantMode::mxfp8) {
            for (std::int64_t j = 0; j < q.group; ++j) put_code(r, gi * q.group + j, M::mxfp8_code(g[static_cast<std::size_t>(j)], e, dt));
            continue;
          }
          p = dt == DType::f64 ? std::ldexp(1.0, e) : M::in(dt, std::ldexp(1.0f, e));
        }
        for (std::int64_t j = 0; j < q.group; ++j) put_code(r, gi * q.group + j, M::e2m1_code(g[static_cast<std::size_t>(j)], p, dt));
        continue;
      }
      if (dt == DType::f64) {
        const auto p = detail::QuantMath::affine_params<double>(g.data(), q.group, q.bits);
        for (std::int64_t j = 0; j < q.group; ++j)
          put_code(r, gi * q.group + j, detail::QuantMath::affine_code<double>(g[static_cast<std::size_t>(j)], p, q.bits));
        store(out.scales, si, p.scale);
        store(out.biases, si, p.bias);
      } else {
        // float32 arithmetic on the (exactly widened) values, as MLX's kernel
        const auto p = detail::QuantMath::affine_params<float>(g.data(), q.group, q.bits);
        for (std::int64_t j = 0; j < q.group; ++j)
          put_code(r, gi * q.group + j,
                   detail::QuantMath::affine_code<float>(static_cast<float>(g[static_cast<std::size_t>(j)]), p, q.bits));
        store(out.scales, si, p.scale);  // a float widened to double: store rounds it to dt once
        store(out.biases, si, p.bias);
      }
    }
  return out;
}

/// quantize(w, Quant{mode, group, bits}).
inline QuantizedMatrix quantize(const Tensor& w, int group, int bits, QuantMode mode = QuantMode::affine) {
  return quantize(w, Quant{mode, group, bits});
}

/// mx.dequantize, bit for bit: affine gives the scales' dtype, computed as MLX does in it
/// (scale * q rounded to that dtype, then + bias rounded); the fp modes give `out` (float32 by
/// default; MLX's is bfloat16) = code value * scale, the scale first rounded to `out`: E2M1[q] *
/// 2^(e - 127) (mxfp4), E4M3[q] * 2^(e - 127) (mxfp8), E2M1[q] * E4M3[s] (nvfp4). float64
/// scales dequantize in double.
inline Tensor dequantize(const Tensor& wq, const Tensor& scales, const Tensor& biases, Quant q,
                         DType out = DType::f32) {
  const std::int64_t cols = detail::check_quantized(wq, scales, biases, q, "dequantize");
  const std::int64_t rows = wq.dim(0);
  if (q.mode == QuantMode::affine) out = scales.dtype();
  else if (out != DType::f32 && out != DType::f64 && out != DType::bf16 && out != DType::f16)
    detail::fail("dequantize", quant_mode_name(q.mode), " dequantizes to a float dtype, not ", dtype_name(out));
  Tensor y = Tensor::empty(Shape{rows, cols}, out);
  if (out == DType::f64) {
    detail::QuantReader<double> rd(wq, scales, biases, q);
    for (std::int64_t r = 0; r < rows; ++r) rd.run(r, 0, cols, y.data<double>() + r * cols, 1);
    return y;
  }
  const auto* codes = static_cast<const std::uint8_t*>(wq.raw());
  const std::int64_t row_bytes = wq.dim(1) * 4, groups = cols / q.group;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::uint32_t code = detail::QuantMath::code(codes + r * row_bytes, c, q.bits, row_bytes);
      const std::int64_t si = r * groups + c / q.group;
      float v;
      if (quant_fp(q.mode)) {
        using M = detail::QuantMath;
        const std::uint8_t sb = scales.data<std::uint8_t>()[si];
        const float s = detail::round_to(out, q.mode == QuantMode::nvfp4 ? M::e4m3(sb) : M::e8m0<float>(sb));
        const float c = q.mode == QuantMode::mxfp8 ? M::e4m3(code) : M::e2m1(code);
        v = detail::round_to(out, detail::rounded(c * s));
      } else {
        const float s = detail::widen_scale<float>(scales.raw(), out, si), b = detail::widen_scale<float>(biases.raw(), out, si);
        const float p = detail::round_to(out, detail::rounded(static_cast<float>(code) * s));
        v = detail::round_to(out, p + b);
      }
      if (out == DType::bf16 && std::isnan(v))  // MLX's float -> bfloat16 makes every NaN 0x7fc0
        static_cast<std::uint16_t*>(y.raw())[r * cols + c] = 0x7fc0;
      else detail::store_from_double(y.raw(), out, r * cols + c, v);
    }
  return y;
}

inline Tensor dequantize(const QuantizedMatrix& m, DType out = DType::f32) {
  return dequantize(m.weight, m.scales, m.biases, m.q, out);
}

}  // namespace nn
