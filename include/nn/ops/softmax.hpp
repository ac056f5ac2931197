// SPDX-License-Identifier: MIT OR Apache-2.0
// softmax and log_softmax over the last axis, max-subtracted (stable for logits in the
// thousands); both are single fused primitives whose vjp uses the saved output only.
#pragma once

#include "common.hpp"

namespace nn {

namespace detail {

/// attrs.flag_a: log-softmax.
template <class B>
struct SoftmaxPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::softmax(tp.in(n, 0), n.value, n.attrs.flag_a); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    GradSlot s = tp.grad_slot(n, 0);
    B::softmax_vjp(n.value, n.grad, s.g, n.attrs.flag_a, s.acc);
  }
  static constexpr OpDef<B> def{"softmax", &forward, &vjp};
};

template <class B>
GVar softmax_impl(GTape<B>& tp, GVar x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  require_float(tp, x, op);
  if (tp.shape(x).rank() == 0) fail(op, "needs at least one axis, got a scalar");
  Attrs a;
  a.flag_a = log;
  GVar in[] = {x};
  return tp.record(SoftmaxPrim<B>::def, in, a, tp.shape(x), tp.dtype(x));
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
