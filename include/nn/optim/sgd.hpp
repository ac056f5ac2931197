// SPDX-License-Identifier: MIT OR Apache-2.0
// Stochastic gradient descent with momentum, dampening, Nesterov and weight decay (MLX's SGD).
#pragma once

#include "optimizer.hpp"

namespace nn {

/// MLX's SGD: g += wd p; without momentum p -= lr g; with it v = mu v + (1 - tau) g and
/// p -= lr (nesterov ? g + mu v : v). Matches torch.optim.SGD when dampening is 0.
template <class B = cpu>
class Sgd : public Optimizer {
 public:
  explicit Sgd(double lr) : Optimizer(lr) {}
  explicit Sgd(Schedule s) : Optimizer(std::move(s)) {}

  Sgd& momentum(double m) { momentum_ = m; return check(); }
  Sgd& dampening(double d) { dampening_ = d; return check(); }
  Sgd& weight_decay(double w) { wd_ = w; return *this; }
  /// Nesterov momentum; needs momentum > 0 and no dampening (as MLX and PyTorch).
  Sgd& nesterov(bool on = true) { nesterov_ = on; return check(); }

  NN_OPTIMIZER(Sgd, Optimizer, momentum_, dampening_, wd_, nesterov_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    Tensor none;
    B::sgd_update(p, g, momentum_ > 0 ? slot(path, "v") : none, lr_, momentum_, dampening_, wd_, nesterov_);
  }

 protected:
  std::vector<const char*> slot_names(const Tensor&) const override { return {"v"}; }

 private:
  Sgd& check() {
    if (nesterov_ && (momentum_ <= 0 || dampening_ != 0))
      detail::fail("sgd", "Nesterov momentum needs momentum > 0 and zero dampening (momentum ", momentum_,
                   ", dampening ", dampening_, ")");
    return *this;
  }
  double momentum_ = 0, dampening_ = 0, wd_ = 0;
  bool nesterov_ = false;
};

}  // namespace nn
