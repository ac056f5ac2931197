// SPDX-License-Identifier: MIT OR Apache-2.0
// fused_swiglu: silu(gate) * up as one primitive, for speed and memory: one pass forward (no
// silu(gate) buffer kept) and one back. Its composite reference is nn::reference::swiglu
// (layers/activations.hpp); tests/ops/fused.test.cpp checks that the two agree.
#pragma once

#include "common.hpp"

namespace nn {

namespace detail {

/// inputs: 0 gate, 1 up, same shape.
template <class B>
struct SwigluPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::swiglu(tp.in(n, 0), tp.in(n, 1), n.value); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto g = tp.template grad_outs<2>(n);
    B::swiglu_vjp(tp.in(n, 0), tp.in(n, 1), n.grad, g[0], g[1]);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SwigluPrim<B>::def{.prim = Prim::swiglu, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 3u>};

}  // namespace detail

/// silu(gate) * up = gate * sigmoid(gate) * up, elementwise.  gate, up: same shape.
template <class B>
GVar fused_swiglu(GTape<B>& tp, GVar gate, GVar up) {
  detail::require_same_dtype(tp, gate, up, "swiglu");
  if (!(tp.shape(gate) == tp.shape(up)))
    detail::fail("swiglu", "gate ", tp.shape(gate).str(), " and up ", tp.shape(up).str(), " must have the same shape");
  GVar in[] = {gate, up};
  return tp.record(detail::SwigluPrim<B>::def, in, NoAttrs{}, tp.shape(gate), tp.dtype(gate));
}

}  // namespace nn
