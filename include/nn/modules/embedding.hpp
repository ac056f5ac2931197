// SPDX-License-Identifier: MIT OR Apache-2.0
// Embedding: a (num, dims) table looked up by token ids, MLX's nn.Embedding initialisation.
#pragma once

#include "../layers/embedding.hpp"
#include "../layers/linear.hpp"
#include "../module.hpp"
#include "../random.hpp"

namespace nn {

/// MLX nn.Embedding(num, dims): weight (num, dims) ~ N(0, 1/dims), drawn from nn::random's
/// global sequence as MLX draws it.
struct Embedding {
  Param weight;  // (num, dims)

  Embedding() = default;
  Embedding(std::int64_t num, std::int64_t dims) : weight(init::embedding(num, dims)) {}

  // ids: (...) int32/int64 -> (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    return embedding(tp, ids, nn::param(tp, weight));
  }
  /// The table as an output projection (a tied LM head): x (..., dims) -> logits (..., num).
  template <class B>
  GVar as_linear(GTape<B>& tp, GVar x) const {
    return linear(tp, x, nn::param(tp, weight));
  }

  NN_MODULE(Embedding, weight)
};

}  // namespace nn
