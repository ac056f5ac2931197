// SPDX-License-Identifier: MIT OR Apache-2.0
// Linear: y = x W^T + b with weight (out, in), MLX's nn.Linear initialisation and names.
#pragma once

#include "../layers/linear.hpp"
#include "../module.hpp"
#include "../random.hpp"

namespace nn {

/// MLX nn.Linear / torch.nn.Linear. Linear(in, out) draws weight then bias from nn::random's
/// global sequence, uniform in [-1/sqrt(in), 1/sqrt(in)) as MLX (so nn::random::seed(s) gives
/// MLX's values bit for bit). `.without_bias()` drops the bias; right after construction it
/// also gives the bias's draw back to the sequence, so the next draws match MLX's
/// nn.Linear(in, out, bias=False).
struct Linear {
  Param weight;               // (out, in)
  std::optional<Param> bias;  // (out)

  Linear() = default;
  Linear(std::int64_t in, std::int64_t out) {
    init::LinearInit w = init::linear(in, out, false);
    before_bias_ = random::state();
    weight = Param(w.weight);
    bias = Param(init::linear_bias(in, out));
    after_bias_ = random::state();
  }
  Linear& without_bias() {
    bias.reset();
    if (after_bias_.defined() && random::state().to_doubles() == after_bias_.to_doubles()) random::set_state(before_bias_);
    return *this;
  }
  std::int64_t in_features() const { return weight.value.dim(1); }
  std::int64_t out_features() const { return weight.value.dim(0); }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return bias ? linear(tp, x, nn::param(tp, weight), nn::param(tp, *bias)) : linear(tp, x, nn::param(tp, weight));
  }

  NN_MODULE(Linear, weight, bias, NN_UNCHECKED(before_bias_, after_bias_))

 private:
  Tensor before_bias_, after_bias_;  // the global RNG state around the bias draw
};

}  // namespace nn
