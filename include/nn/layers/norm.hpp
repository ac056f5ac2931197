// SPDX-License-Identifier: MIT OR Apache-2.0
// Normalization over the last axis: RMSNorm (Zhang & Sennrich 2019; mlx.nn.RMSNorm, HF
// LlamaRMSNorm) and LayerNorm (Ba et al. 2016; torch.nn.LayerNorm, mlx.nn.LayerNorm).
#pragma once

#include "../ops/elementwise.hpp"
#include "../ops/norm.hpp"
#include "../ops/reduce.hpp"
#include "helpers.hpp"

namespace nn {

namespace detail {

template <class B>
void check_norm_weight(const GTape<B>& tp, GVar x, GVar w, const char* layer, const char* what) {
  layer_same_dtype(tp, x, w, layer, "x", what);
  const Shape &xs = tp.shape(x), &ws = tp.shape(w);
  if (ws.rank() != 1 || xs.rank() < 1 || ws[0] != xs.dim(-1))
    fail(layer, what, " ", ws.str(), " does not match x ", xs.str(), ": expected (", xs.rank() ? xs.dim(-1) : 0, ")");
}

template <class B>
void check_norm_input(const GTape<B>& tp, GVar x, double eps, const char* layer) {
  layer_float(tp, x, layer, "x");
  if (tp.shape(x).rank() < 1 || tp.shape(x).dim(-1) == 0)
    fail(layer, "x must have a non-empty last axis, got ", tp.shape(x).str());
  if (!(eps >= 0)) fail(layer, "eps must be >= 0, got ", eps);
}

}  // namespace detail

namespace reference {

/// RMSNorm composed from primitives, the reference the fused primitive is tested against
/// (tests/ops/fused.test.cpp).  x: (..., C) -> (..., C).
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  GVar ms = mean(tp, mul(tp, x, x), {-1}, true);  // (..., 1)
  return mul(tp, x, rsqrt(tp, add_scalar(tp, ms, eps)));
}
/// The same with a gain w: (C).
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, GVar w, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  detail::check_norm_weight(tp, x, w, "rmsnorm", "weight");
  return mul(tp, reference::rmsnorm(tp, x, eps), w);
}

}  // namespace reference

/// y = x / sqrt(mean(x^2) + eps), over the last axis, without a gain.  x: (..., C) -> (..., C).
/// One fused primitive (ops/norm.hpp); reference::rmsnorm is the same math composed.
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  return fused_rmsnorm(tp, x, GVar{}, eps);
}

/// y = x / sqrt(mean(x^2) + eps) * w.  x: (..., C), w: (C) -> (..., C).
/// The order (normalise, then scale by w) is HF's Qwen2/Llama RMSNorm and MLX's fast.rms_norm.
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, GVar w, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  detail::check_norm_weight(tp, x, w, "rmsnorm", "weight");
  return fused_rmsnorm(tp, x, w, eps);
}

/// y = (x - mean) / sqrt(var + eps), biased variance over the last axis, no affine.
/// x: (..., C) -> (..., C).
template <class B>
GVar layernorm(GTape<B>& tp, GVar x, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "layernorm");
  GVar xc = sub(tp, x, mean(tp, x, {-1}, true));
  GVar var = mean(tp, mul(tp, xc, xc), {-1}, true);  // (..., 1)
  return mul(tp, xc, rsqrt(tp, add_scalar(tp, var, eps)));
}

/// LayerNorm with a gain and no bias (torch.nn.LayerNorm(bias=False)).  w: (C).
template <class B>
GVar layernorm(GTape<B>& tp, GVar x, GVar w, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "layernorm");
  detail::check_norm_weight(tp, x, w, "layernorm", "weight");
  return mul(tp, layernorm(tp, x, eps), w);
}

/// LayerNorm with gain and bias (the default of torch.nn.LayerNorm and mlx.nn.LayerNorm).
/// w, b: (C).
template <class B>
GVar layernorm(GTape<B>& tp, GVar x, GVar w, GVar b, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "layernorm");
  detail::check_norm_weight(tp, x, w, "layernorm", "weight");
  detail::check_norm_weight(tp, x, b, "layernorm", "bias");
  return add(tp, mul(tp, layernorm(tp, x, eps), w), b);
}

}  // namespace nn
