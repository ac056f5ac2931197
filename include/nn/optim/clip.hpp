// SPDX-License-Identifier: MIT OR Apache-2.0
// Global gradient-norm clipping over a whole gradient tree (MLX's clip_grad_norm).
#pragma once

#include <cmath>
#include <utility>

#include "../module.hpp"

namespace nn {

namespace detail {
/// The factor clip_grad_norm scales by: min(max_norm / (norm + 1e-6), 1) (MLX's).
inline double clip_scale(double max_norm, double norm) { return std::min(max_norm / (norm + 1e-6), 1.0); }
}  // namespace detail

/// Returns {clipped, norm}: norm = sqrt(sum over every gradient of sum(g^2)) (one global norm,
/// not per tensor), and clipped = grads * min(max_norm / (norm + 1e-6), 1) in new tensors (the
/// input tree is not modified). Empty (frozen) gradients stay empty.
template <class B = cpu, class M>
std::pair<M, double> clip_grad_norm(const M& grads, double max_norm) {
  if (max_norm < 0) detail::fail("clip_grad_norm", "max_norm must be >= 0, got ", max_norm);
  double sq = 0;
  detail::for_each(grads, [&](const std::string&, const Param& g) {
    if (g.value.defined()) sq += B::sum_squares(g.value);
  });
  const double norm = std::sqrt(sq);
  const double scale = detail::clip_scale(max_norm, norm);
  M out = grads;
  detail::for_each(out, [&](const std::string&, Param& g) {
    if (!g.value.defined()) return;
    Tensor t = B::alloc(g.value.shape(), g.value.dtype());
    B::unary(Unary::scale, scale, g.value, t);
    g.value = t;
  });
  return {std::move(out), norm};
}

}  // namespace nn
