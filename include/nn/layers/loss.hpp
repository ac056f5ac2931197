// SPDX-License-Identifier: MIT OR Apache-2.0
// Cross-entropy losses (torch.nn.functional.cross_entropy, mlx.nn.losses.cross_entropy) and the
// next-token form over the first N rows of a sequence (the seed's nn_cross_entropy_rows).
#pragma once

#include "../ops/cross_entropy.hpp"
#include "../ops/elementwise.hpp"
#include "../ops/linear_cross_entropy.hpp"
#include "../ops/matmul.hpp"
#include "../ops/reduce.hpp"
#include "../ops/shape.hpp"
#include "../ops/softmax.hpp"
#include "helpers.hpp"

namespace nn {

namespace detail {

template <class B>
GVar reduce_rows(GTape<B>& tp, GVar rows, Reduction reduction) {
  if (reduction == Reduction::none) return rows;
  return reduction == Reduction::sum ? sum(tp, rows) : mean(tp, rows);
}

/// -sum_j p_j log softmax(x)_j per row: probability (or one-hot, or label-smoothed) targets.
template <class B>
GVar prob_cross_entropy_rows(GTape<B>& tp, GVar logits, GVar probs) {
  if (!(tp.shape(logits) == tp.shape(probs)))
    fail("cross_entropy", "probability targets ", tp.shape(probs).str(), " must have the logits' shape ",
         tp.shape(logits).str());
  layer_same_dtype(tp, logits, probs, "cross_entropy", "logits", "targets");
  return neg(tp, sum(tp, mul(tp, probs, log_softmax(tp, logits)), {-1}));
}

/// keep * rows, reduced: sum -> sum(keep * rows), mean -> sum(keep * rows) / sum(keep).
template <class B>
GVar weighted(GTape<B>& tp, GVar rows, GVar keep, Reduction reduction) {
  GVar w = mul(tp, rows, keep);
  if (reduction == Reduction::none) return w;
  GVar total = sum(tp, w);
  return reduction == Reduction::sum ? total : div(tp, total, sum(tp, keep));
}

template <class B>
void check_logits(const GTape<B>& tp, GVar logits) {
  layer_float(tp, logits, "cross_entropy", "logits");
  if (tp.shape(logits).rank() < 1 || tp.shape(logits).dim(-1) == 0)
    fail("cross_entropy", "logits must be (..., V) with V > 0, got ", tp.shape(logits).str());
}

}  // namespace detail

/// Softmax cross-entropy, classes on the last axis (as MLX).
///   logits: (..., V).  targets: integer class ids (...), or probabilities (..., V) (one-hot,
///   label-smoothed) when float.  -> () for mean / sum, (...) for none.
/// Integer targets go through the fused softmax_cross_entropy primitive: no (..., V) one-hot or
/// log-probabilities are materialised, logits in the thousands are safe (max-subtracted), and a
/// target equal to `ignore_index` (default -100, as PyTorch) is left out, the mean being over
/// the rest. Probability targets: mean over all rows (PyTorch's rule); ignore_index unused.
template <class B>
GVar cross_entropy(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction = Reduction::mean,
                   std::int64_t ignore_index = -100) {
  detail::check_logits(tp, logits);
  if (is_floating(tp.dtype(targets)))
    return detail::reduce_rows(tp, detail::prob_cross_entropy_rows(tp, logits, targets), reduction);
  return softmax_cross_entropy(tp, logits, targets, reduction, ignore_index);
}

/// The same with per-row weights `keep` (...) (1 = count the row, 0 = skip it; mlx-lm's length
/// mask): sum -> sum(keep * loss), mean -> sum(keep * loss) / sum(keep), none -> keep * loss.
/// keep may be a constant or an input slot (set per batch on replay).
template <class B>
GVar cross_entropy(GTape<B>& tp, GVar logits, GVar targets, GVar keep, Reduction reduction = Reduction::mean,
                   std::int64_t ignore_index = -100) {
  detail::check_logits(tp, logits);
  detail::layer_same_dtype(tp, logits, keep, "cross_entropy", "logits", "keep");
  Shape rows_shape = tp.shape(logits);
  Shape expect;
  for (int i = 0; i + 1 < rows_shape.rank(); ++i) expect.push_back(rows_shape[i]);
  if (!(tp.shape(keep) == expect))
    detail::fail("cross_entropy", "keep ", tp.shape(keep).str(), " must have the logits' leading dims ", expect.str(),
                 " (logits ", rows_shape.str(), ")");
  GVar rows = is_floating(tp.dtype(targets)) ? detail::prob_cross_entropy_rows(tp, logits, targets)
                                             : softmax_cross_entropy(tp, logits, targets, Reduction::none, ignore_index);
  return detail::weighted(tp, rows, keep, reduction);
}

namespace detail {
template <class B>
void check_rows(const GTape<B>& tp, GVar logits, GVar targets, std::int64_t n_rows) {
  check_logits(tp, logits);
  const Shape &ls = tp.shape(logits), &ts = tp.shape(targets);
  // integer targets are (..., n_rows); probability targets (..., n_rows, V)
  const int row_axis = is_floating(tp.dtype(targets)) ? 2 : 1;
  if (ls.rank() < 2 || n_rows < 0 || n_rows > ls.dim(-2) || ts.rank() < row_axis || ts.dim(-row_axis) != n_rows)
    fail("cross_entropy_rows", "logits ", ls.str(), " and targets ", ts.str(), " do not fit n_rows = ", n_rows,
         ": expected logits (..., T, V) with T >= n_rows and targets (..., n_rows) (or (..., n_rows, V))");
}
template <class B>
GVar first_rows(GTape<B>& tp, GVar logits, GVar targets, std::int64_t n_rows) {
  check_rows(tp, logits, targets, n_rows);
  return n_rows == tp.shape(logits).dim(-2) ? logits : slice(tp, logits, -2, 0, n_rows);
}
}  // namespace detail

/// Next-token cross-entropy: only the first n_rows positions of each sequence are scored (the
/// last position has no next token; the seed's nn_cross_entropy_rows).
///   logits: (..., T, V), targets: (..., n_rows) (the tokens shifted left), n_rows <= T.
/// With integer targets the fused primitive reads the first n_rows rows in place (no copy of
/// the logits); probability targets (..., n_rows, V) go through a slice.
template <class B>
GVar cross_entropy_rows(GTape<B>& tp, GVar logits, GVar targets, std::int64_t n_rows,
                        Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  if (is_floating(tp.dtype(targets)))
    return cross_entropy(tp, detail::first_rows(tp, logits, targets, n_rows), targets, reduction, ignore_index);
  detail::check_rows(tp, logits, targets, n_rows);
  return softmax_cross_entropy_rows(tp, logits, targets, reduction, ignore_index);
}
/// The same with per-row weights keep (..., n_rows).
template <class B>
GVar cross_entropy_rows(GTape<B>& tp, GVar logits, GVar targets, GVar keep, std::int64_t n_rows,
                        Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  if (is_floating(tp.dtype(targets)))
    return cross_entropy(tp, detail::first_rows(tp, logits, targets, n_rows), targets, keep, reduction, ignore_index);
  detail::check_rows(tp, logits, targets, n_rows);
  detail::layer_same_dtype(tp, logits, keep, "cross_entropy_rows", "logits", "keep");
  if (!(tp.shape(keep) == tp.shape(targets)))
    detail::fail("cross_entropy_rows", "keep ", tp.shape(keep).str(), " must have the targets' shape ",
                 tp.shape(targets).str());
  return detail::weighted(tp, softmax_cross_entropy_rows(tp, logits, targets, Reduction::none, ignore_index), keep,
                          reduction);
}

namespace detail {
/// linear_cross_entropy as two ops: the logits x @ W^T, then cross_entropy (its reference, and
/// what runs where the fused primitive cannot).
template <class B>
GVar linear_cross_entropy_composite(GTape<B>& tp, GVar x, const HeadVars& head, GVar targets, GVar keep,
                                    Reduction reduction, std::int64_t ignore_index) {
  GVar logits = head.quantized() ? quantized_matmul(tp, x, head.codes, head.scales, head.biases, head.q, true)
                                 : matmul(tp, x, head.w, false, true);
  return keep.valid() ? cross_entropy(tp, logits, targets, keep, reduction, ignore_index)
                      : cross_entropy(tp, logits, targets, reduction, ignore_index);
}
}  // namespace detail

/// cross_entropy(x @ W^T, targets[, keep]) for an LM head W (V, C), dense or quantized
/// (HeadVars), without storing the (..., V) logits where the backend has the fused primitive
/// (the CPU's: fused_linear_cross_entropy, ops/linear_cross_entropy.hpp): the same loss and
/// gradients up to rounding, in the memory of one block of the vocabulary. Per-row losses
/// (Reduction::none), a keep that wants a gradient, and other backends take the two ops.
///   x: (..., C), targets: (...) integer, keep: (...) or GVar{} -> () for mean / sum.
template <class B>
GVar linear_cross_entropy(GTape<B>& tp, GVar x, const HeadVars& head, GVar targets, GVar keep = {},
                          Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  if constexpr (detail::HasLinearCrossEntropy<B>) {
    if (reduction != Reduction::none && !(keep.valid() && tp.requires_grad(keep)) && !is_floating(tp.dtype(targets)))
      return fused_linear_cross_entropy(tp, x, head, targets, keep, reduction, ignore_index);
  }
  return detail::linear_cross_entropy_composite(tp, x, head, targets, keep, reduction, ignore_index);
}

}  // namespace nn
