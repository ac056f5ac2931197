// SPDX-License-Identifier: MIT OR Apache-2.0
// Dropout: MLX's nn.Dropout as a module; its key comes from the tape's random_key().
#pragma once

#include "../layers/dropout.hpp"
#include "../module.hpp"

namespace nn {

/// In training, y = x * bernoulli(1 - p) / (1 - p) with a key drawn from nn::random's global
/// sequence through tp.random_key() (so nn::random::seed(s) gives MLX's masks, and a compiled
/// step draws a fresh mask each replay); in evaluation (train(false)), y = x.
struct Dropout {
  Dropout() = default;
  explicit Dropout(double p) : p_(p) {
    if (!(p >= 0.0 && p < 1.0)) detail::fail("Dropout", "the dropout probability ", p, " is not in [0, 1)");
  }
  double p() const { return p_; }

  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    if (!nn_training_ || p_ == 0.0) return x;
    return dropout(tp, x, p_, tp.random_key());
  }

  NN_MODULE(Dropout, NN_STATIC(p_))

 private:
  double p_ = 0.5;
};

}  // namespace nn
