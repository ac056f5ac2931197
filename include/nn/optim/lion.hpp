// SPDX-License-Identifier: MIT OR Apache-2.0
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), MLX's form.
#pragma once

#include "optimizer.hpp"

namespace nn {

/// c = b1 m + (1-b1) g; m = b2 m + (1-b2) g; p *= 1 - lr wd (when wd > 0); p -= lr sign(c).
template <class B = cpu>
class Lion : public Optimizer {
 public:
  explicit Lion(double lr) : Optimizer(lr) {}
  explicit Lion(Schedule s) : Optimizer(std::move(s)) {}

  Lion& betas(double b1, double b2) { b1_ = b1; b2_ = b2; return *this; }
  Lion& weight_decay(double w) { wd_ = w; return *this; }

  NN_OPTIMIZER(Lion, Optimizer, b1_, b2_, wd_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    B::lion_update(p, g, slot(path, "m"), lr_, b1_, b2_, wd_);
  }

 protected:
  std::vector<const char*> slot_names(const Tensor&) const override { return {"m"}; }

 private:
  double b1_ = 0.9, b2_ = 0.99, wd_ = 0.0;
};

}  // namespace nn
