// SPDX-License-Identifier: MIT OR Apache-2.0
// GGUF quantizers: float32 rows into ggml's tensor types, the inverse of gguf.hpp's
// detail::gguf_decode_block. Written here after ggml's reference algorithms (ggml-quants.c's
// quantize_row_*_ref, which llama-quantize runs when no importance matrix is given), step for step
// and in the same float32 operation order, so:
//   F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1  give gguf-py's quantize() bytes exactly;
//   Q4_K Q5_K Q6_K                          give ggml's reference bytes (gguf-py has no quantizer
//                                           for them), checked against ggml's own quantize-fns
//                                           error thresholds and against gguf-py's dequantize.
// (The equality needs the compiler not to contract a * b + c into an FMA, which is GCC's and
// Clang's default unless -march enables FMA with -ffp-contract=fast.)
//
// Block layouts (ggml-common.h), QK = 32 elements, QK_K = 256:
//   Q8_0  f16 d · int8 q[32]                               x ≈ d·q,          d = amax / 127
//   Q4_0  f16 d · u8 qs[16]                                x ≈ d·(q − 8),    d = max / −8
//   Q4_1  f16 d · f16 m · u8 qs[16]                        x ≈ d·q + m,      d = (max − min) / 15
//   Q5_0  f16 d · u32 qh · u8 qs[16]                       x ≈ d·(q − 16),   d = max / −16
//   Q5_1  f16 d · f16 m · u32 qh · u8 qs[16]               x ≈ d·q + m,      d = (max − min) / 31
//   Q4_K  f16 d · f16 dmin · u8 scales[12] · u8 qs[128]     8 groups of 32: x ≈ d·sc·q − dmin·m
//   Q5_K  f16 d · f16 dmin · u8 scales[12] · qh[32] · qs[128]  the same with 5-bit q
//   Q6_K  u8 ql[128] · u8 qh[64] · int8 scales[16] · f16 d   16 groups of 16: x ≈ d·sc·(q − 32)
// (max is the element of largest magnitude, with its sign.)
#pragma once

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>

#include "../tensor.hpp"
#include "gguf.hpp"

namespace nn::lm {

/// Whether gguf_quantize writes ggml type `type`: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K.
inline bool gguf_can_quantize(std::uint32_t type) {
  switch (type) {
    case 0: case 1: case 30: case 8: case 2: case 3: case 6: case 7: case 12: case 13: case 14: return true;
    default: return false;
  }
}

namespace detail {

inline void gguf_put_u16(std::byte* p, std::uint16_t v) {
  p[0] = static_cast<std::byte>(v & 0xff);
  p[1] = static_cast<std::byte>(v >> 8);
}
inline void gguf_put_f16(std::byte* p, float v) { gguf_put_u16(p, half::f32_to_f16(v)); }
inline float gguf_f16_round(float v) { return half::f16_to_f32(half::f32_to_f16(v)); }

/// ggml's nearest_int: round to nearest, ties to even, through the float32 mantissa (|x| < 2^22).
inline int gguf_nearest_int(float fval) {
  const float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

/// Q4_0 / Q5_0 (symmetric, nbits 4 or 5) and Q4_1 / Q5_1 (with a minimum): one block of 32.
inline void gguf_quantize_block32(std::uint32_t type, const float* x, std::byte* y) {
  const bool with_min = type == 3 || type == 7;
  const int nbits = type == 2 || type == 3 ? 4 : 5;
  const int top = (1 << nbits) - 1;
  std::uint8_t q[32];
  float d, m = 0;
  if (!with_min) {
    float amax = 0, max = 0;  // the element of largest magnitude, first of equals, with its sign
    for (int j = 0; j < 32; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    d = max / static_cast<float>(-(1 << (nbits - 1)));
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const float off = static_cast<float>(1 << (nbits - 1)) + 0.5f;
    for (int j = 0; j < 32; ++j) q[j] = static_cast<std::uint8_t>(std::min(top, static_cast<int>(static_cast<std::int8_t>(x[j] * id + off))));
  } else {
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; ++j) {
      mn = std::min(mn, x[j]);
      mx = std::max(mx, x[j]);
    }
    d = (mx - mn) / static_cast<float>(top);
    m = mn;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; ++j) q[j] = static_cast<std::uint8_t>(std::min(top, static_cast<int>(static_cast<std::int8_t>((x[j] - mn) * id + 0.5f))));
  }
  std::size_t at = 0;
  gguf_put_f16(y, d);
  at = 2;
  if (with_min) {
    gguf_put_f16(y + 2, m);
    at = 4;
  }
  if (nbits == 5) {  // bit 4 of element j is bit j of the little-endian u32 qh
    std::uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= static_cast<std::uint32_t>((q[j] >> 4) & 1u) << j;
    for (int b = 0; b < 4; ++b) y[at + b] = static_cast<std::byte>((qh >> (8 * b)) & 0xffu);
    at += 4;
  }
  for (int j = 0; j < 16; ++j) y[at + j] = static_cast<std::byte>((q[j] & 15u) | (q[j + 16] & 15u) << 4);
}

inline void gguf_quantize_q8_0(const float* x, std::byte* y) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  gguf_put_f16(y, d);
  for (int j = 0; j < 32; ++j) y[2 + j] = static_cast<std::byte>(static_cast<std::int8_t>(std::round(x[j] * id)));
}

/// ggml's make_qkx2_quants: codes L in [0, nmax] and a scale and minimum for n weighted values,
/// the minimum searched over nstep + 1 trial scales (weighted least squares per trial).
inline float gguf_make_qkx2(int n, int nmax, const float* x, const float* w, std::uint8_t* L, float* the_min,
                            std::uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = gguf_nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<std::uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = diff * diff;
    best_error += w[i] * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = gguf_nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = static_cast<std::uint8_t>(l);
      sum_l += w[i] * static_cast<float>(l);
      sum_l2 += w[i] * static_cast<float>(l) * static_cast<float>(l);
      sum_xl += w[i] * static_cast<float>(l) * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = diff * diff;
        cur_error += w[i] * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

/// Q4_K (nbits 4) and Q5_K (nbits 5): one super-block of 256 as quantize_row_q{4,5}_K_ref.
inline void gguf_quantize_qk(int nbits, const float* x, std::byte* y) {
  const int nmax = (1 << nbits) - 1;
  std::uint8_t L[256], Laux[32], sc6[12] = {};
  float w[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = nbits == 4 ? gguf_make_qkx2(32, nmax, x + 32 * j, w, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20)
                           : gguf_make_qkx2(32, nmax, x + 32 * j, w, L + 32 * j, &mins[j], Laux, -0.5f, 0.1f, 15);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  std::uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    ls[j] = std::min<std::uint8_t>(63, static_cast<std::uint8_t>(gguf_nearest_int(inv_scale * scales[j])));
    lm[j] = std::min<std::uint8_t>(63, static_cast<std::uint8_t>(gguf_nearest_int(inv_min * mins[j])));
    // The 12-byte packing gguf_decode_block's k_scale_min reads.
    if (j < 4) {
      sc6[j] = ls[j];
      sc6[j + 4] = lm[j];
    } else {
      sc6[j + 4] = static_cast<std::uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      sc6[j - 4] |= static_cast<std::uint8_t>((ls[j] >> 4) << 6);
      sc6[j] |= static_cast<std::uint8_t>((lm[j] >> 4) << 6);
    }
  }
  const float d = gguf_f16_round(max_scale / 63.f), dmin = gguf_f16_round(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    const float dj = d * ls[j];
    if (!(dj != 0)) continue;  // ggml's `if (!d) continue`: the codes of make_qkx2 stay
    const float dm = dmin * lm[j];
    for (int ii = 0; ii < 32; ++ii)
      L[32 * j + ii] = static_cast<std::uint8_t>(std::max(0, std::min(nmax, gguf_nearest_int((x[32 * j + ii] + dm) / dj))));
  }
  gguf_put_f16(y, max_scale / 63.f);
  gguf_put_f16(y + 2, max_min / 63.f);
  for (int i = 0; i < 12; ++i) y[4 + i] = static_cast<std::byte>(sc6[i]);
  std::byte* qs = y + (nbits == 4 ? 16 : 48);
  if (nbits == 5) std::memset(y + 16, 0, 32);
  // Group pairs (2k, 2k + 1) share 32 bytes: low nibble, high nibble; Q5_K's bit 4 of group g in
  // bit g of qh[e % 32].
  for (int n = 0; n < 256; n += 64)
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (nbits == 5) {
        auto* qh = reinterpret_cast<std::uint8_t*>(y + 16);
        if (l1 > 15) {
          l1 -= 16;
          qh[j] = static_cast<std::uint8_t>(qh[j] | (1u << (n / 32)));
        }
        if (l2 > 15) {
          l2 -= 16;
          qh[j] = static_cast<std::uint8_t>(qh[j] | (2u << (n / 32)));
        }
      }
      qs[n / 2 + j] = static_cast<std::byte>(l1 | (l2 << 4));
    }
}

/// ggml's make_qx_quants with rmse_type 1 (weights x²) and no importance: codes L + nmax.
inline float gguf_make_qx(int n, int nmax, const float* x, std::int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < 1e-15f) {  // GROUP_MAX_EPS: all zero
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = gguf_nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<std::int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * static_cast<float>(l);
    suml2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = gguf_nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * static_cast<float>(l);
      suml2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = gguf_nearest_int(iscale * x[i]);
        L[i] = static_cast<std::int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

/// Q6_K: one super-block of 256 as quantize_row_q6_K_ref.
inline void gguf_quantize_q6_k(const float* x, std::byte* y) {
  std::int8_t L[256];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    scales[ib] = gguf_make_qx(16, 32, x + 16 * ib, L + 16 * ib);
    const float abs_scale = std::fabs(scales[ib]);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scales[ib];
    }
  }
  std::memset(y, 0, 210);
  if (max_abs_scale < 1e-15f) return;  // an all-zero block: zero bytes, d = +0
  const float iscale = -128.f / max_scale;
  gguf_put_f16(y + 208, 1 / iscale);
  const float d = gguf_f16_round(1 / iscale);
  std::int8_t sc[16];
  for (int ib = 0; ib < 16; ++ib) {
    sc[ib] = static_cast<std::int8_t>(std::min(127, gguf_nearest_int(iscale * scales[ib])));
    y[192 + ib] = static_cast<std::byte>(sc[ib]);
  }
  for (int j = 0; j < 16; ++j) {
    const float dj = d * sc[j];
    if (!(dj != 0)) continue;
    for (int ii = 0; ii < 16; ++ii) {
      const int l = std::max(-32, std::min(31, gguf_nearest_int(x[16 * j + ii] / dj)));
      L[16 * j + ii] = static_cast<std::int8_t>(l + 32);
    }
  }
  // Element e = 128h + r: low nibble in ql[64h + r % 64] (nibble r / 64), top two bits in
  // qh[32h + r % 32] (bits 2 (r / 32)) -- the layout gguf_decode_block reads.
  auto* ql = reinterpret_cast<std::uint8_t*>(y);
  auto* qh = reinterpret_cast<std::uint8_t*>(y + 128);
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128;
    const auto q = static_cast<std::uint8_t>(L[e]);
    ql[64 * h + r % 64] = static_cast<std::uint8_t>(ql[64 * h + r % 64] | (q & 15u) << (4 * (r / 64)));
    qh[32 * h + r % 32] = static_cast<std::uint8_t>(qh[32 * h + r % 32] | (q >> 4) << (2 * (r / 32)));
  }
}

/// n values of one row into `type` (n a multiple of the type's block).
inline void gguf_quantize_row(std::uint32_t type, const float* x, std::int64_t n, std::byte* y) {
  const auto N = static_cast<std::size_t>(n);
  switch (type) {
    case 0:
      for (std::size_t i = 0; i < N; ++i) {
        std::uint32_t u = std::bit_cast<std::uint32_t>(x[i]);
        if constexpr (std::endian::native == std::endian::big) u = gguf_bswap(u);
        std::memcpy(y + 4 * i, &u, 4);
      }
      return;
    case 1: for (std::size_t i = 0; i < N; ++i) gguf_put_u16(y + 2 * i, half::f32_to_f16(x[i])); return;
    case 30: for (std::size_t i = 0; i < N; ++i) gguf_put_u16(y + 2 * i, half::f32_to_bf16(x[i])); return;
    case 8: for (std::size_t b = 0; b < N / 32; ++b) gguf_quantize_q8_0(x + 32 * b, y + 34 * b); return;
    case 2: case 3: case 6: case 7: {
      const std::uint32_t bytes = ggml_type_info(type)->bytes;
      for (std::size_t b = 0; b < N / 32; ++b) gguf_quantize_block32(type, x + 32 * b, y + bytes * b);
      return;
    }
    case 12: for (std::size_t b = 0; b < N / 256; ++b) gguf_quantize_qk(4, x + 256 * b, y + 144 * b); return;
    case 13: for (std::size_t b = 0; b < N / 256; ++b) gguf_quantize_qk(5, x + 256 * b, y + 176 * b); return;
    case 14: for (std::size_t b = 0; b < N / 256; ++b) gguf_quantize_q6_k(x + 256 * b, y + 210 * b); return;
    default: nn::detail::fail("gguf_quantize", "type ", type, " is not written");
  }
}

}  // namespace detail

/// A float32 (or float64, narrowed) tensor of row-major shape (..., n) as ggml type `type`'s
/// bytes, row by row. `name` leads errors: a type nn does not write, or rows of n that do not
/// split into the type's blocks.
inline std::vector<std::byte> gguf_quantize(const Tensor& t, std::uint32_t type, const std::string& name = "tensor") {
  const GgmlTypeInfo* info = ggml_type_info(type);
  if (!info || !gguf_can_quantize(type))
    nn::detail::fail("gguf_quantize", "tensor \"", name, "\": ggml type ", info ? info->name : std::to_string(type).c_str(),
                     " is not written (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K are)");
  if (t.rank() == 0) nn::detail::fail("gguf_quantize", "tensor \"", name, "\" is a scalar");
  const std::int64_t n = t.dim(t.rank() - 1);
  if (n % info->block != 0)
    nn::detail::fail("gguf_quantize", "tensor \"", name, "\" ", t.shape().str(), ": rows of ", n,
                     " do not split into ", info->name, " blocks of ", info->block);
  const Tensor f = t.dtype() == DType::f32 ? t : t.to(DType::f32);
  const std::int64_t rows = n ? f.numel() / n : 0;
  const std::size_t row_bytes = static_cast<std::size_t>(n / info->block) * info->bytes;
  std::vector<std::byte> out(static_cast<std::size_t>(rows) * row_bytes);
  const float* src = f.data<float>();
  for (std::int64_t r = 0; r < rows; ++r) detail::gguf_quantize_row(type, src + r * n, n, out.data() + r * row_bytes);
  return out;
}

}  // namespace nn::lm
