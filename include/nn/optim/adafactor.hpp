// SPDX-License-Identifier: MIT OR Apache-2.0
// Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
// Cost"), MLX's form, composed from backend kernels (no kernel of its own).
#pragma once

#include <algorithm>
#include <cmath>
#include <memory>
#include <string_view>

#include "optimizer.hpp"

namespace nn {

/// MLX's Adafactor. With t the step (already incremented), per parameter p with gradient g:
///
///     beta2 = 1 - t^decay_rate                      rms(x) = sqrt(mean(x^2))
///     rho   = relative_step ? min(warmup_init ? 1e-6 t : 1e-2, 1/sqrt(t)) : learning_rate
///     lr    = scale_parameter ? max(eps2, rms(p)) rho : rho
///     u     = g^2 + eps1
///     rank >= 2 (factored; R over the last axis, C over the second-to-last):
///       row = beta2 row + (1 - beta2) mean(u, -1)          shape[:-1]
///       col = beta2 col + (1 - beta2) mean(u, -2)          shape[:-2] + shape[-1:]
///       u   = rsqrt(row / mean(row, -1))[..., None] * rsqrt(col)[..., None, :] * g
///     rank < 2: v = beta2 v + (1 - beta2) u;  u = rsqrt(v) g
///     u  = lr u / max(1, rms(u) / clip_threshold)
///     beta1 set: m = beta1 m + (1 - beta1) u;  u = m
///     p  = p + p (-weight_decay lr) - u
///
/// Slots as MLX names them: exp_avg_sq_row and exp_avg_sq_col (rank >= 2) or exp_avg_sq, plus
/// exp_avg with .beta1(). Like MLX, relative_step is on unless turned off, even with a learning
/// rate given: Adafactor(lr).relative_step(false) is MLX's Adafactor(learning_rate=lr,
/// relative_step=False). The scalars (beta2, rho, the RMSs, the clip divisor) are computed on the
/// host at each update in MLX's float32 order; the step-derived ones (t^decay_rate, 1/sqrt(t),
/// 1e-6 t) in float32 as MLX does, then rounded to the parameter's dtype (MLX's astype).
template <class B = cpu>
class Adafactor : public Optimizer {
 public:
  /// The relative step size (MLX's Adafactor() without a learning rate).
  Adafactor() : Optimizer(0.0) {}
  explicit Adafactor(double lr) : Optimizer(lr), has_lr_(true) {}
  explicit Adafactor(Schedule s) : Optimizer(std::move(s)), has_lr_(true) {}

  Adafactor& eps(double e1, double e2) { eps1_ = e1; eps2_ = e2; return *this; }
  Adafactor& clip_threshold(double c) { clip_threshold_ = c; return *this; }
  Adafactor& decay_rate(double d) { decay_rate_ = d; return *this; }
  Adafactor& beta1(double b) { beta1_ = b; use_beta1_ = true; return *this; }
  Adafactor& weight_decay(double w) { wd_ = w; return *this; }
  Adafactor& scale_parameter(bool on = true) { scale_parameter_ = on; return *this; }
  Adafactor& relative_step(bool on = true) { relative_step_ = on; return *this; }
  Adafactor& warmup_init(bool on = true) { warmup_init_ = on; return *this; }

  void set_learning_rate(double lr) override {
    Optimizer::set_learning_rate(lr);
    has_lr_ = true;
  }

  NN_OPTIMIZER(Adafactor, Optimizer, eps1_, eps2_, clip_threshold_, decay_rate_, use_beta1_, beta1_, wd_,
               scale_parameter_, relative_step_, warmup_init_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    if (p.dtype() == DType::f32) update_as<float>(*work_.at(path), path, p, g);
    else update_as<double>(*work_.at(path), path, p, g);
  }

  Shape slot_shape(const std::string&, std::string_view name, const Tensor& p) const override {
    if (p.rank() >= 2 && name == "exp_avg_sq_row") return head(p.shape(), 1);
    if (p.rank() >= 2 && name == "exp_avg_sq_col") return head(p.shape(), 2, {p.shape().dim(-1)});
    return p.shape();
  }

 protected:
  void init_param(const std::string& path, const Tensor& p) override {
    if (!relative_step_ && !has_lr_)
      detail::fail("optimizer", "Adafactor with relative_step(false) needs a learning rate: Adafactor(lr) or Adafactor(schedule)");
    if (p.dtype() != DType::f32 && p.dtype() != DType::f64)
      detail::fail("optimizer", "Adafactor updates float32 and float64 parameters; '", path, "' is ", dtype_name(p.dtype()));
    Optimizer::init_param(path, p);
    auto it = work_.find(path);
    if (it != work_.end() && it->second->u.device() == p.device()) return;
    // Workspace, not state (not saved), so an update allocates nothing: temporaries, shared by
    // the parameters of one shape, dtype and device (they are updated one after another).
    std::shared_ptr<Work>& w = by_shape_[p.shape().str() + dtype_name(p.dtype()) + (p.device() == Device::cpu ? "" : "@dev")];
    if (!w) w = std::make_shared<Work>(make_work(p));
    work_[path] = w;
  }
  std::vector<const char*> slot_names(const Tensor& p) const override {
    std::vector<const char*> names;
    if (p.rank() >= 2) names = {"exp_avg_sq_row", "exp_avg_sq_col"};
    else names = {"exp_avg_sq"};
    if (use_beta1_) names.push_back("exp_avg");
    return names;
  }

 private:
  /// Temporaries of one parameter shape. Factored (rank >= 2) ones are views: rk (shape[:-1] + [1])
  /// holds mean(u, -1) and then r (its shape[:-1] view), ck (shape[:-2] + [1, n]) holds mean(u, -2)
  /// and then c (its shape[:-2] + [n] view), rm (shape[:-2] + [1]) holds mean(row, -1).
  struct Work {
    Tensor u, t;  // the update; squares for an RMS
    Tensor s;     // one element: a mean of squares, then the clip divisor
    Tensor rk, r, ck, c, rm;
  };
  /// shape[:-drop] + tail.
  static Shape head(const Shape& s, int drop, std::initializer_list<std::int64_t> tail = {}) {
    Shape out;
    for (int i = 0; i < s.rank() - drop; ++i) out.push_back(s[i]);
    for (std::int64_t d : tail) out.push_back(d);
    return out;
  }
  static Work make_work(const Tensor& p) {
    auto z = [&](const Shape& s) { return detail::zeros_on(s, p.dtype(), p.device()); };
    const Shape& s = p.shape();
    Shape ones;
    for (int i = 0; i < s.rank(); ++i) ones.push_back(1);
    Work w{z(s), z(s), z(ones), {}, {}, {}, {}, {}};
    if (s.rank() >= 2) {
      w.rk = z(head(s, 1, {1}));
      w.r = w.rk.reshape(head(s, 1));
      w.ck = z(head(s, 2, {1, s.dim(-1)}));
      w.c = w.ck.reshape(head(s, 2, {s.dim(-1)}));
      w.rm = z(head(s, 2, {1}));
    }
    return w;
  }

  /// sqrt(mean(x^2)) in x's dtype, summed in sequence as MLX's CPU reduction (w.t: the squares).
  /// The mean comes back to the host through sum_squares of its one element: s^2 in double,
  /// whose square root is s again (exactly: sqrt(fl(s^2)) = s for s >= 0 in IEEE arithmetic).
  template <class T>
  static T rms(const Tensor& x, Work& w) {
    B::binary(Binary::mul, x, x, w.t);
    B::sum_to(w.t, w.s, 1.0 / static_cast<double>(x.numel()), false);
    return std::sqrt(static_cast<T>(std::sqrt(B::sum_squares(w.s))));
  }

  template <class T>
  void update_as(Work& w, const std::string& path, Tensor& p, const Tensor& g) {
    const Shape& s = p.shape();
    const auto t = static_cast<float>(step());
    // float32 as MLX forms them (the step is a uint64 array, the exponent a weak Python float)
    const T b2 = T(1) - static_cast<T>(std::pow(t, static_cast<float>(decay_rate_)));
    const T c2 = T(1) - b2;
    const T rho = relative_step_ ? static_cast<T>(std::min(warmup_init_ ? 1e-6f * t : 1e-2f, 1.0f / std::sqrt(t)))
                                 : static_cast<T>(learning_rate());
    const T lr = scale_parameter_ ? std::max(static_cast<T>(eps2_), rms<T>(p, w)) * rho : rho;

    B::binary(Binary::mul, g, g, w.u);
    B::unary(Unary::add_scalar, eps1_, w.u, w.u);
    if (s.rank() >= 2) {
      Tensor& row = slot(path, "exp_avg_sq_row");
      Tensor& col = slot(path, "exp_avg_sq_col");
      B::sum_to(w.u, w.rk, 1.0 / static_cast<double>(s.dim(-1)), false);
      B::axpby(c2, w.rk, b2, row);
      B::sum_to(w.u, w.ck, 1.0 / static_cast<double>(s.dim(-2)), false);
      B::axpby(c2, w.ck, b2, col);
      B::sum_to(row, w.rm, 1.0 / static_cast<double>(s.dim(-2)), false);
      B::binary(Binary::div, row, w.rm, w.r);
      B::unary(Unary::rsqrt, 0.0, w.r, w.r);
      B::unary(Unary::rsqrt, 0.0, col, w.c);
      B::binary(Binary::mul, w.rk, w.ck, w.u);  // r[..., None] * c[..., None, :]
    } else {
      Tensor& v = slot(path, "exp_avg_sq");
      B::axpby(c2, w.u, b2, v);
      B::unary(Unary::rsqrt, 0.0, v, w.u);
    }
    B::binary(Binary::mul, w.u, g, w.u);

    const T divisor = std::max(T(1), rms<T>(w.u, w) / static_cast<T>(clip_threshold_));
    if (divisor > T(1)) {  // dividing by 1 changes nothing
      B::fill(w.s, divisor);
      B::binary(Binary::div, w.u, w.s, w.u);
    }
    B::unary(Unary::scale, lr, w.u, w.u);
    const Tensor* u = &w.u;
    if (use_beta1_) {
      Tensor& m = slot(path, "exp_avg");
      B::axpby(1 - beta1_, w.u, beta1_, m);  // 1 - beta1 in double, as MLX's Python float
      u = &m;
    }
    if (wd_ != 0) B::axpby(static_cast<T>(-wd_) * lr, p, 1.0, p);  // p + p (-wd lr)
    B::binary(Binary::sub, p, *u, p);
  }

  double eps1_ = 1e-30, eps2_ = 1e-3, clip_threshold_ = 1.0, decay_rate_ = -0.8;
  bool use_beta1_ = false;
  double beta1_ = 0.0;  // used only with use_beta1_ (MLX's beta_1=None otherwise)
  double wd_ = 0.0;
  bool scale_parameter_ = true, relative_step_ = true, warmup_init_ = false;
  bool has_lr_ = false;  // a learning rate was given (relative_step(false) needs one)
  std::map<std::string, std::shared_ptr<Work>> work_, by_shape_;  // by parameter path; by shape key
};

}  // namespace nn
