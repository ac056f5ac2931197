// SPDX-License-Identifier: MIT OR Apache-2.0
// Adam and AdamW with MLX's defaults: betas (0.9, 0.999), eps 1e-8, no bias correction unless
// asked; AdamW's decoupled decay (default 0.01) applied before the Adam step.
#pragma once

#include "optimizer.hpp"

namespace nn {

/// MLX's Adam: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, p -= lr m / (sqrt v + eps);
/// .bias_correction() gives torch.optim.Adam's update.
template <class B = cpu>
class Adam : public Optimizer {
 public:
  explicit Adam(double lr) : Optimizer(lr) {}
  explicit Adam(Schedule s) : Optimizer(std::move(s)) {}

  Adam& betas(double b1, double b2) { b1_ = b1; b2_ = b2; return *this; }
  Adam& eps(double e) { eps_ = e; return *this; }
  Adam& bias_correction(bool on = true) { bias_correction_ = on; return *this; }

  NN_OPTIMIZER(Adam, Optimizer, b1_, b2_, eps_, bias_correction_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    B::adam_update(p, g, slot(path, "m"), slot(path, "v"), lr_, step_, b1_, b2_, eps_, decoupled_wd(), bias_correction_);
  }

 protected:
  virtual double decoupled_wd() const { return 0.0; }
  std::vector<const char*> slot_names(const Tensor&) const override { return {"m", "v"}; }
  double b1_ = 0.9, b2_ = 0.999, eps_ = 1e-8;
  bool bias_correction_ = false;
};

/// MLX's AdamW: p *= 1 - lr wd, then Adam. With .bias_correction() it is torch.optim.AdamW.
template <class B = cpu>
class AdamW : public Adam<B> {
 public:
  explicit AdamW(double lr) : Adam<B>(lr) {}
  explicit AdamW(Schedule s) : Adam<B>(std::move(s)) {}

  AdamW& weight_decay(double w) { wd_ = w; return *this; }
  AdamW& betas(double b1, double b2) { Adam<B>::betas(b1, b2); return *this; }
  AdamW& eps(double e) { Adam<B>::eps(e); return *this; }
  AdamW& bias_correction(bool on = true) { Adam<B>::bias_correction(on); return *this; }

  NN_OPTIMIZER(AdamW, Adam<B>, wd_)

 protected:
  double decoupled_wd() const override { return wd_; }

 private:
  double wd_ = 0.01;
};

}  // namespace nn
