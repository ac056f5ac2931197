// SPDX-License-Identifier: MIT OR Apache-2.0
// softmax and log_softmax over the last axis, max-subtracted (stable for logits in the
// thousands); both are single fused primitives whose vjp uses the saved output only.
#pragma once

#include "common.hpp"

namespace nn {

/// Softmax's one attribute: log-softmax or softmax.
struct SoftmaxAttrs {
  bool log;
};

namespace detail {

template <class B>
struct SoftmaxPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::softmax(tp.in(n, 0), n.value, attrs_of<SoftmaxAttrs>(n).log); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    GradSlot s = tp.grad_slot(n, 0);
    B::softmax_vjp(n.value, n.grad, s.g, attrs_of<SoftmaxAttrs>(n).log, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SoftmaxPrim<B>::def{.prim = Prim::softmax, .forward = &forward, .vjp = &vjp,
                                   .vjp_reads = &vjp_reads_fixed<B, kVjpReadsOutput>};  // y only

template <class B>
GVar softmax_impl(GTape<B>& tp, GVar x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  require_float(tp, x, op);
  if (tp.shape(x).rank() == 0) fail(op, "needs at least one axis, got a scalar");
  GVar in[] = {x};
  return tp.record(SoftmaxPrim<B>::def, in, SoftmaxAttrs{log}, tp.shape(x), tp.dtype(x));
}

}  // namespace detail

/// exp(x - max) / sum(exp(x - max)) over the last axis.
template <class B>
GVar softmax(GTape<B>& tp, GVar x) {
  return detail::softmax_impl(tp, x, false);
}
/// x - logsumexp(x) over the last axis.
template <class B>
GVar log_softmax(GTape<B>& tp, GVar x) {
  return detail::softmax_impl(tp, x, true);
}

}  // namespace nn
