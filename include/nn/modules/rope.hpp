// SPDX-License-Identifier: MIT OR Apache-2.0
// Rope: MLX's nn.RoPE as a module (no parameters; its options are configuration).
#pragma once

#include "../layers/rope.hpp"
#include "../module.hpp"

namespace nn {

/// Rotary position embedding on the first `dims` features of the last axis, positions along
/// the second-to-last axis: x (..., T, D). NEOX half-split by default (MLX traditional=False),
/// `.traditional()` for interleaved pairs; base 10000 and scale 1 as MLX.
struct Rope {
  Rope() = default;
  explicit Rope(std::int64_t dims) : dims_(dims) {}
  Rope& traditional(bool on = true) {
    traditional_ = on;
    return *this;
  }
  Rope& base(double b) {
    base_ = b;
    return *this;
  }
  Rope& scale(double s) {
    scale_ = s;
    return *this;
  }
  std::int64_t dims() const { return dims_; }

  // x: (..., T, D), D >= dims; positions offset, offset + 1, ...
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x, std::int64_t offset = 0) const {
    const Shape& s = tp.shape(x);
    if (s.rank() < 2) detail::fail("Rope", "expects x (..., T, D), got ", s.str());
    RopeVars t = rope_fill(tp, s.dim(-2), dims_, base_, scale_, offset, tp.dtype(x));
    return rope(tp, x, t.cos, t.sin, traditional_);
  }

  NN_MODULE(Rope, NN_STATIC(dims_, traditional_, base_, scale_))

 private:
  std::int64_t dims_ = 0;
  bool traditional_ = false;
  double base_ = 10000.0, scale_ = 1.0;
};

}  // namespace nn
