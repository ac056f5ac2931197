// SPDX-License-Identifier: MIT OR Apache-2.0
// fused_rmsnorm: RMSNorm over the last axis as one primitive (mlx.core.fast.rms_norm), for
// speed and memory: one pass forward, one back, only the per-row 1/rms kept. Its composite
// reference is nn::reference::rmsnorm (layers/norm.hpp); tests/ops/fused.test.cpp checks that
// the two agree, values and gradients.
#pragma once

#include "common.hpp"

namespace nn {

/// RMSNorm's epsilon.
struct NormAttrs {
  double eps;
};

namespace detail {

/// inputs: 0 x (..., C), optionally 1 w (C). saved[0] = 1/rms per row.
template <class B>
struct RmsNormPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor& x = tp.in(n, 0);
    Tensor& rstd = tp.scratch(n, 0, Shape{x.numel() / x.dim(-1)}, x.dtype());
    B::rms_norm(x, n.inputs.size() > 1 ? tp.in(n, 1) : Tensor(), attrs_of<NormAttrs>(n).eps, n.value, rstd);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const bool has_w = n.inputs.size() > 1;
    const auto g = tp.template grad_outs<2>(n);
    B::rms_norm_vjp(tp.in(n, 0), has_w ? tp.in(n, 1) : Tensor(), n.saved[0], n.grad, g[0], g[1]);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> RmsNormPrim<B>::def{.prim = Prim::rmsnorm, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 3u>};

}  // namespace detail

/// y = x / sqrt(mean(x^2) + eps) (* w), over the last axis, in one primitive.
/// x: (..., C), w: (C) or GVar{} for no gain -> (..., C). The reduction runs in x's dtype.
template <class B>
GVar fused_rmsnorm(GTape<B>& tp, GVar x, GVar w, double eps) {
  detail::require_float(tp, x, "rmsnorm");
  const Shape& xs = tp.shape(x);
  if (xs.rank() < 1 || xs.dim(-1) == 0) detail::fail("rmsnorm", "x must have a non-empty last axis, got ", xs.str());
  if (!(eps >= 0)) detail::fail("rmsnorm", "eps must be >= 0, got ", eps);
  const NormAttrs a{eps};
  if (!w.valid()) {
    GVar in[] = {x};
    return tp.record(detail::RmsNormPrim<B>::def, in, a, xs, tp.dtype(x));
  }
  detail::require_same_dtype(tp, x, w, "rmsnorm");
  const Shape& ws = tp.shape(w);
  if (ws.rank() != 1 || ws[0] != xs.dim(-1))
    detail::fail("rmsnorm", "weight ", ws.str(), " does not match x ", xs.str(), ": expected (", xs.dim(-1), ")");
  GVar in[] = {x, w};
  return tp.record(detail::RmsNormPrim<B>::def, in, a, xs, tp.dtype(x));
}

}  // namespace nn
