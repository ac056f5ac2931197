// SPDX-License-Identifier: MIT OR Apache-2.0
// Muon (Jordan et al. 2024): momentum orthogonalised by Newton-Schulz iterations, MLX's form.
#pragma once

#include <cmath>

#include "optimizer.hpp"

namespace nn {

/// g += wd p (coupled); v = mu v + (1-mu) g; u = nesterov ? (1-mu) g + mu v : v. For a
/// parameter of rank >= 2, u is viewed as (shape[0], -1), orthogonalised by `ns_steps`
/// Newton-Schulz iterations with (a, b, c) = (3.4445, -4.7750, 2.0315) on the wide orientation,
/// and the step is scaled by sqrt(max(1, shape[-2] / shape[-1])) of the parameter's own shape
/// (MLX's choice). Rank < 2: the plain momentum update.
template <class B = cpu>
class Muon : public Optimizer {
 public:
  explicit Muon(double lr) : Optimizer(lr) {}
  explicit Muon(Schedule s) : Optimizer(std::move(s)) {}

  Muon& momentum(double m) { mu_ = m; return *this; }
  Muon& weight_decay(double w) { wd_ = w; return *this; }
  Muon& nesterov(bool on = true) { nesterov_ = on; return *this; }
  Muon& ns_steps(int n) { steps_ = n; return *this; }

  NN_OPTIMIZER(Muon, Optimizer, mu_, wd_, nesterov_, steps_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    Slots& w = work_.at(path);
    Tensor& u = w.at("u");
    B::muon_momentum(p, g, slot(path, "v"), u, mu_, wd_, nesterov_);
    if (p.rank() < 2) {
      B::apply_update(p, u, lr_, 1.0);
      return;
    }
    const std::int64_t rows = p.dim(0), cols = p.numel() / rows;
    const bool tall = rows > cols;  // iterate on X = u^T so that X X^T is the small Gram matrix
    const std::int64_t r = tall ? cols : rows, c = tall ? rows : cols;
    Tensor X = w.at("x"), A = w.at("a"), Bm = w.at("b"), T1 = w.at("t");
    X = X.reshape(Shape{r, c});
    A = A.reshape(Shape{r, r});
    Bm = Bm.reshape(Shape{r, r});
    T1 = T1.reshape(Shape{r, c});
    Tensor u2 = u.reshape(Shape{rows, cols});
    if (tall) B::permute(u2, {1, 0}, X, false);
    else B::copy(u2, X, false);
    B::normalize_frobenius(X, 1e-7);
    for (int i = 0; i < steps_; ++i) {
      B::matmul(X, false, X, true, A, false);  // A = X X^T
      B::copy(A, Bm, false);
      B::matmul(A, false, A, false, Bm, false);  // Bm = A A
      B::axpby(kB, A, kC, Bm);                   // Bm = b A + c A A
      B::matmul(Bm, false, X, false, T1, false); // T1 = Bm X
      B::axpby(kA, X, 1.0, T1);                  // T1 = a X + Bm X
      std::swap(X, T1);
    }
    if (tall) B::permute(X, {1, 0}, u2, false);
    else B::copy(X, u2, false);
    const double ratio = static_cast<double>(p.dim(-2)) / static_cast<double>(p.dim(-1));
    B::apply_update(p, u, lr_, std::sqrt(std::max(1.0, ratio)));
  }

 protected:
  void init_param(const std::string& path, const Tensor& p) override {
    Optimizer::init_param(path, p);
    if (work_.count(path)) return;
    // Workspace, not state (not saved): the update direction and the Newton-Schulz buffers,
    // kept so an update allocates nothing.
    Slots& w = work_[path];
    w["u"] = detail::zeros_on(p.shape(), p.dtype(), p.device());
    if (p.rank() >= 2) {
      const std::int64_t rows = p.dim(0), cols = p.numel() / rows, r = std::min(rows, cols);
      w["x"] = detail::zeros_on(Shape{rows * cols}, p.dtype(), p.device());
      w["t"] = detail::zeros_on(Shape{rows * cols}, p.dtype(), p.device());
      w["a"] = detail::zeros_on(Shape{r * r}, p.dtype(), p.device());
      w["b"] = detail::zeros_on(Shape{r * r}, p.dtype(), p.device());
    }
  }
  std::vector<const char*> slot_names(const Tensor&) const override { return {"v"}; }

 private:
  static constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
  double mu_ = 0.95, wd_ = 0.01;
  bool nesterov_ = true;
  int steps_ = 5;
  std::map<std::string, Slots> work_;
};

}  // namespace nn
