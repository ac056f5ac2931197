// SPDX-License-Identifier: MIT OR Apache-2.0
// RmsNorm and LayerNorm modules (MLX's nn.RMSNorm and nn.LayerNorm: eps 1e-5, weight ones,
// bias zeros).
#pragma once

#include "../layers/norm.hpp"
#include "../module.hpp"

namespace nn {

/// x / sqrt(mean(x^2) + eps) * weight over the last axis (Zhang & Sennrich 2019).
struct RmsNorm {
  Param weight;  // (dims)

  RmsNorm() = default;
  explicit RmsNorm(std::int64_t dims) : weight(Tensor::ones({dims})) {}
  RmsNorm& eps(double e) {
    eps_ = e;
    return *this;
  }
  double eps() const { return eps_; }
  /// Scale by (1 + weight) instead of weight: Gemma's RMSNorm (transformers' GemmaRMSNorm,
  /// mlx-lm's gemma RMSNorm), whose stored weight is the offset from 1 (zeros at init).
  RmsNorm& unit_offset(bool on) {
    unit_offset_ = on;
    return *this;
  }
  bool unit_offset() const { return unit_offset_; }

  // x: (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar w = nn::param(tp, weight);
    return rmsnorm(tp, x, unit_offset_ ? add_scalar(tp, w, 1.0) : w, eps_);
  }

  NN_MODULE(RmsNorm, weight, NN_STATIC(eps_), NN_STATIC(unit_offset_))

 private:
  double eps_ = 1e-5;
  bool unit_offset_ = false;
};

/// (x - mean) / sqrt(var + eps) * weight + bias over the last axis (Ba et al. 2016).
/// `.affine(false)`: no weight or bias; `.without_bias()`: weight only.
struct LayerNorm {
  std::optional<Param> weight;  // (dims)
  std::optional<Param> bias;    // (dims)

  LayerNorm() = default;
  explicit LayerNorm(std::int64_t dims) : weight(Param(Tensor::ones({dims}))), bias(Param(Tensor::zeros({dims}))) {}
  LayerNorm& eps(double e) {
    eps_ = e;
    return *this;
  }
  double eps() const { return eps_; }
  LayerNorm& affine(bool on) {
    if (!on) {
      weight.reset();
      bias.reset();
    }
    return *this;
  }
  LayerNorm& without_bias() {
    bias.reset();
    return *this;
  }

  // x: (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    if (!weight) return layernorm(tp, x, eps_);
    if (!bias) return layernorm(tp, x, nn::param(tp, *weight), eps_);
    return layernorm(tp, x, nn::param(tp, *weight), nn::param(tp, *bias), eps_);
  }

  NN_MODULE(LayerNorm, weight, bias, NN_STATIC(eps_))

 private:
  double eps_ = 1e-5;
};

}  // namespace nn
