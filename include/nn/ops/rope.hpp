// SPDX-License-Identifier: MIT OR Apache-2.0
// fused_rope: the rotary position embedding as one primitive (mlx.core.fast.rope), for speed:
// one pass over x instead of the composite's slices, products and concat, and a vjp that is the
// inverse rotation. Its composite reference is nn::reference::rope (layers/rope.hpp);
// tests/ops/fused.test.cpp checks that the two agree, values and gradients.
#pragma once

#include "common.hpp"

namespace nn {

/// RoPE's pairing: traditional (interleaved pairs (2i, 2i + 1)) or NEOX (half split).
struct RopeAttrs {
  bool traditional;
};

namespace detail {

/// inputs: 0 x, 1 cos, 2 sin (tables, no gradient).
template <class B>
struct RopePrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    B::rope(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), RopeArgs{attrs_of<RopeAttrs>(n).traditional, false}, n.value, false);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    // the vjp rotates back
    B::rope(n.grad, tp.in(n, 1), tp.in(n, 2), RopeArgs{attrs_of<RopeAttrs>(n).traditional, true}, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> RopePrim<B>::def{.prim = Prim::rope, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 6u>};

}  // namespace detail

/// Whether fused_rope takes these shapes: cos/sin (T, dims/2) against x (..., T, D), or
/// (T, 1, dims/2) against x (..., T, M, D) (M heads sharing each position's angles), with
/// dims <= D. (Other broadcasts go through the composite.)
inline bool fused_rope_fits(const Shape& x, const Shape& cs) {
  if (x.rank() < 2 || cs.rank() < 2 || cs.rank() > 3 || 2 * cs.dim(-1) > x.dim(-1) || cs.dim(-1) == 0) return false;
  if (cs.rank() == 2) return x.dim(-2) == cs[0];
  return cs[1] == 1 && x.rank() >= 3 && x.dim(-3) == cs[0];
}

/// Rotates the first dims = 2 * cos.shape[-1] features of x by the tables' angles (NEOX pairs
/// (i, i + dims/2), or traditional pairs (2i, 2i + 1)); later features pass through.
///   x: (..., T, D) with cos/sin (T, dims/2), or x: (..., T, M, D) with cos/sin (T, 1, dims/2).
/// cos and sin are tables (constants): they get no gradient.
template <class B>
GVar fused_rope(GTape<B>& tp, GVar x, GVar cos, GVar sin, bool traditional = false) {
  detail::require_same_dtype(tp, x, cos, "rope");
  detail::require_same_dtype(tp, x, sin, "rope");
  const Shape &xs = tp.shape(x), &cs = tp.shape(cos);
  if (!(cs == tp.shape(sin)) || !fused_rope_fits(xs, cs))
    detail::fail("rope", "x ", xs.str(), " and cos ", cs.str(), " / sin ", tp.shape(sin).str(),
                 " do not fit: expected x (..., T, D) with tables (T, dims/2), or x (..., T, M, D) with (T, 1, dims/2)");
  if (tp.requires_grad(cos) || tp.requires_grad(sin))
    detail::fail("rope", "the cos/sin tables cannot require a gradient in the fused primitive");
  GVar in[] = {x, cos, sin};
  return tp.record(detail::RopePrim<B>::def, in, RopeAttrs{traditional}, xs, tp.dtype(x));
}

}  // namespace nn
