// SPDX-License-Identifier: MIT OR Apache-2.0
// Rotary position embedding (Su et al. 2021, "RoFormer"): the cos/sin tables and the rotation,
// in the NEOX half-split form (mlx.nn.RoPE traditional=False, HF rotate_half) and the original
// interleaved form (traditional=True), on the first `dims` features only.
#pragma once

#include <cmath>

#include "../ops/elementwise.hpp"
#include "../ops/rope.hpp"
#include "../ops/shape.hpp"
#include "helpers.hpp"

namespace nn {

/// cos and sin of the rotation angles, each (T, dims/2):
///   angle[t, i] = (t + offset) * scale * base^(-i / (dims/2)),  i < dims/2
/// (mlx.nn.RoPE / mlx.fast.rope: positions scaled by `scale`; HF's inv_freq = 1/base^(2i/dims)).
/// Angles are computed in double, then rounded once to `dtype`.
struct RopeTable {
  Tensor cos, sin;
};

inline RopeTable rope_fill(std::int64_t T, std::int64_t dims, double base = 10000.0, double scale = 1.0,
                           std::int64_t offset = 0, DType dtype = DType::f32) {
  if (T < 0 || dims <= 0 || dims % 2 != 0)
    detail::fail("rope_fill", "needs T >= 0 and an even dims > 0, got T = ", T, ", dims = ", dims);
  if (!(base > 0)) detail::fail("rope_fill", "base must be > 0, got ", base);
  if (!is_floating(dtype)) detail::fail("rope_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t half = dims / 2;
  std::vector<double> c(static_cast<std::size_t>(T * half)), s(c.size());
  for (std::int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(base, -static_cast<double>(i) / static_cast<double>(half));
    for (std::int64_t t = 0; t < T; ++t) {
      const double a = static_cast<double>(t + offset) * scale * inv_freq;
      c[static_cast<std::size_t>(t * half + i)] = std::cos(a);
      s[static_cast<std::size_t>(t * half + i)] = std::sin(a);
    }
  }
  return {Tensor::from_doubles(Shape{T, half}, c, dtype), Tensor::from_doubles(Shape{T, half}, s, dtype)};
}

/// The tables registered as constants on a tape (on its backend's device), in `dtype`, or else in
/// the tape's float dtype (GTape::float_dtype).
struct RopeVars {
  GVar cos, sin;
};

template <class B>
RopeVars rope_fill(GTape<B>& tp, std::int64_t T, std::int64_t dims, double base = 10000.0, double scale = 1.0,
                   std::int64_t offset = 0, std::optional<DType> dtype = std::nullopt) {
  RopeTable t = rope_fill(T, dims, base, scale, offset, dtype.value_or(tp.float_dtype()));
  return {tp.constant(detail::on_backend<B>(t.cos)), tp.constant(detail::on_backend<B>(t.sin))};
}

namespace detail {

template <class B>
void check_rope(const GTape<B>& tp, GVar x, GVar cos, GVar sin, const char* layer) {
  layer_same_dtype(tp, x, cos, layer, "x", "cos");
  layer_same_dtype(tp, x, sin, layer, "x", "sin");
  const Shape &xs = tp.shape(x), &cs = tp.shape(cos), &ss = tp.shape(sin);
  if (!(cs == ss)) fail(layer, "cos ", cs.str(), " and sin ", ss.str(), " must have the same shape");
  if (xs.rank() < 2 || cs.rank() < 2)
    fail(layer, "x must be (..., T, D) and cos/sin (..., T, dims/2), got x ", xs.str(), " and cos ", cs.str());
  if (2 * cs.dim(-1) > xs.dim(-1))
    fail(layer, "cos/sin ", cs.str(), " rotate ", 2 * cs.dim(-1), " features but x ", xs.str(), " has only ",
         xs.dim(-1));
  Shape rot = xs;
  rot[rot.rank() - 1] = cs.dim(-1);
  if (!broadcasts_to(cs, rot))
    fail(layer, "cos/sin ", cs.str(), " do not broadcast against x ", xs.str(), " (expected (T, dims/2) = (",
         xs.dim(-2), ", ", cs.dim(-1), ") or a broadcastable batch of it)");
}

}  // namespace detail

namespace reference {

/// RoPE composed from primitives (slices, products, concat): the reference the fused primitive
/// is tested against, and the path for table shapes the fused one does not take. The contract
/// is nn::rope's (below).
template <class B>
GVar rope(GTape<B>& tp, GVar x, GVar cos, GVar sin, bool traditional = false) {
  detail::check_rope(tp, x, cos, sin, "rope");
  const Shape xs = tp.shape(x);  // a copy: used after recording
  const std::int64_t D = xs.dim(-1), half = tp.shape(cos).dim(-1), dims = 2 * half;
  GVar rotated;
  if (!traditional) {
    GVar x1 = slice(tp, x, -1, 0, half);     // (..., T, dims/2)
    GVar x2 = slice(tp, x, -1, half, dims);  // (..., T, dims/2)
    GVar o1 = sub(tp, mul(tp, x1, cos), mul(tp, x2, sin));
    GVar o2 = add(tp, mul(tp, x1, sin), mul(tp, x2, cos));
    rotated = concat(tp, {o1, o2}, -1);
  } else {
    // View the rotated features as (..., T, dims/2, 2) pairs and the tables as (..., T, dims/2, 1).
    GVar xr = dims == D ? x : slice(tp, x, -1, 0, dims);
    Shape pairs = xs;
    pairs[pairs.rank() - 1] = half;
    pairs.push_back(2);
    xr = detail::view(tp, xr, pairs);
    Shape tab = tp.shape(cos);
    tab.push_back(1);
    GVar c = detail::view(tp, cos, tab), s = detail::view(tp, sin, tab);
    GVar x1 = slice(tp, xr, -1, 0, 1), x2 = slice(tp, xr, -1, 1, 2);  // (..., T, dims/2, 1)
    GVar o1 = sub(tp, mul(tp, x1, c), mul(tp, x2, s));
    GVar o2 = add(tp, mul(tp, x1, s), mul(tp, x2, c));
    Shape flat = xs;
    flat[flat.rank() - 1] = dims;
    rotated = detail::view(tp, concat(tp, {o1, o2}, -1), flat);
  }
  if (dims == D) return rotated;
  return concat(tp, {rotated, slice(tp, x, -1, dims, D)}, -1);
}

}  // namespace reference

/// Rotates pairs of the first dims = 2 * cos.shape[-1] features of x by the table's angles; the
/// features past dims pass through unchanged.
///   x: (..., T, D), cos/sin: (T, dims/2) (or anything broadcasting to (..., T, dims/2)).
/// NEOX form (traditional = false, the default as in mlx.nn.RoPE and HF Llama/Qwen2): the pairs
/// are (x[i], x[i + dims/2]).  Traditional form: the pairs are (x[2i], x[2i + 1]).
///   (a, b) -> (a cos - b sin, a sin + b cos)
/// Tables (T, dims/2) — or (T, 1, dims/2) against x (..., T, M, D) — that need no gradient take
/// the fused primitive (ops/rope.hpp); other broadcasts take reference::rope, the same math.
template <class B>
GVar rope(GTape<B>& tp, GVar x, GVar cos, GVar sin, bool traditional = false) {
  detail::check_rope(tp, x, cos, sin, "rope");
  if (fused_rope_fits(tp.shape(x), tp.shape(cos)) && !tp.requires_grad(cos) && !tp.requires_grad(sin))
    return fused_rope(tp, x, cos, sin, traditional);
  return reference::rope(tp, x, cos, sin, traditional);
}

}  // namespace nn
