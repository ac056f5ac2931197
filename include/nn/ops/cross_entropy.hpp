// SPDX-License-Identifier: MIT OR Apache-2.0
// softmax_cross_entropy: log-softmax and target pick fused into one primitive with integer
// targets, an ignore index and the reduction, for speed and memory at vocab 50k+ (no (R, V)
// log-probabilities kept, one pass back). Its composite reference is -pick(log_softmax(x), t);
// tests/layers/loss.test.cpp checks the two agree.
#pragma once

#include "index.hpp"

namespace nn {

namespace detail {

/// inputs: 0 logits (..., T, V), 1 targets (..., N) integer, N <= T (N == T: one row per
/// target; the kernel maps target rows to logit rows). Attributes: CrossEntropyAttrs
/// (backend/policy.hpp). saved[0] = logsumexp per target.
template <class B>
struct CrossEntropyPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor& t = tp.in(n, 1);
    Tensor& lse = tp.scratch(n, 0, Shape{t.numel()}, n.value.dtype());
    B::cross_entropy(tp.in(n, 0), t, attrs_of<CrossEntropyAttrs>(n), n.value, lse);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    B::cross_entropy_vjp(tp.in(n, 0), tp.in(n, 1), attrs_of<CrossEntropyAttrs>(n), n.saved[0], n.grad, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
// The vjp reads the logits and targets (and the saved logsumexp), and writes each logit's
// gradient after reading that logit only: the gradient may take the logits' memory.
template <class B>
const OpDef<B> CrossEntropyPrim<B>::def{.prim = Prim::cross_entropy, .forward = &forward, .vjp = &vjp,
                                        .vjp_reads = &vjp_reads_fixed<B, 3u>, .vjp_overwrites = 0};

}  // namespace detail

namespace detail {
template <class B>
GVar record_cross_entropy(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction, std::int64_t ignore_index,
                          bool first_rows) {
  const char* op = first_rows ? "cross_entropy_rows" : "cross_entropy";
  require_float(tp, logits, op);
  require_ids(tp, targets, op);
  const Shape ls = tp.shape(logits), ts = tp.shape(targets);
  bool ok = ls.rank() == ts.rank() + 1 && ls.dim(-1) > 0;
  for (int i = 0; ok && i < ts.rank(); ++i) ok = ls[i] == ts[i] || (first_rows && i == ts.rank() - 1 && ts[i] <= ls[i]);
  if (!ok)
    fail(op, "targets ", ts.str(), " do not match logits ", ls.str(),
         first_rows ? ": expected logits (..., T, V) and targets (..., N) with N <= T"
                    : ": expected targets of the logits' leading dims (classes on the last axis)");
  GVar in[] = {logits, targets};
  return tp.record(CrossEntropyPrim<B>::def, in, CrossEntropyAttrs{ignore_index, reduction}, reduction == Reduction::none ? ts : Shape{}, tp.dtype(logits));
}
}  // namespace detail

/// -log softmax(logits)[target] per row, over the last axis (classes last, as MLX).
///   logits: (..., V) float, targets: (...) int32/int64 -> (...) for Reduction::none, else ().
/// A target equal to `ignore_index` (PyTorch's default -100) contributes 0 loss and 0 gradient,
/// and the mean is over the other rows (torch.nn.functional.cross_entropy's semantics).
template <class B>
GVar softmax_cross_entropy(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction = Reduction::mean,
                           std::int64_t ignore_index = -100) {
  return detail::record_cross_entropy(tp, logits, targets, reduction, ignore_index, false);
}

/// The same over the first N rows of each sequence, without copying the logits:
///   logits: (..., T, V), targets: (..., N), N <= T -> (..., N) for Reduction::none, else ().
/// Target [..., n] scores logits[..., n, :]; rows n >= N get no loss and a zero gradient (the
/// next-token case: N = T - 1, the last position has no target).
template <class B>
GVar softmax_cross_entropy_rows(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction = Reduction::mean,
                                std::int64_t ignore_index = -100) {
  return detail::record_cross_entropy(tp, logits, targets, reduction, ignore_index, true);
}

}  // namespace nn
