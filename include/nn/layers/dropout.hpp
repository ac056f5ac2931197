// SPDX-License-Identifier: MIT OR Apache-2.0
// Dropout as MLX's nn.Dropout: in training, y = x * bernoulli(1 - p, x.shape, key) / (1 - p);
// in evaluation, or with p = 0, y = x.
#pragma once

#include "../ops/random.hpp"

namespace nn {

/// MLX nn.Dropout(p) (python/mlx/nn/layers/dropout.py) on the tape.
///   x:   (...) float32 or float64
///   key: uint32 (2), an MLX key, normally an input slot (tp.input(nn::random::next_key())): a
///        compiled step sets a fresh key into the slot before each replay, as MLX threads its
///        random state through mx.compile, so each replay draws a new mask, and the masks equal
///        mx.random.bernoulli(1 - p, x.shape, key=k) for the same keys.
/// p outside [0, 1) raises, as MLX does. p = 0 and training = false return x itself (no node;
/// switching mode therefore means recording the step again, as the design has it).
template <class B>
GVar dropout(GTape<B>& tp, GVar x, double p, GVar key, bool training = true) {
  if (!(p >= 0.0 && p < 1.0)) detail::fail("dropout", "the dropout probability ", p, " is not in [0, 1)");
  detail::require_key(tp, key, "dropout");
  if (p == 0.0 || !training) return x;
  return dropout_mask_mul(tp, x, p, key);
}

}  // namespace nn
