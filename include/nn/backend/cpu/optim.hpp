// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's optimizer updates: one fused pass per parameter in MLX's arithmetic order (optim/;
// the formulas in backend/math.hpp), and the small kernels Muon and clip_grad_norm compose.
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `OptimKernels` (why: backend/cpu.hpp).
template <class = void>
struct OptimKernelsT {
  // lr is a 0-D float64 tensor and step a 0-D int64 tensor, read at run time, so a replayed
  // step sees a scheduled learning rate without re-recording. T is the parameter's dtype. The
  // arithmetic of each update is backend/math.hpp's (SgdMath, AdamMath, ...), as on CUDA.

  static void sgd_update(Tensor& p, const Tensor& g, Tensor& v, const Tensor& lr, double momentum, double dampening,
                         double wd, bool nesterov) {
    detail::dispatch_float(p.dtype(), "sgd", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* vs = momentum > 0 ? static_cast<T*>(v.raw()) : nullptr;
      const auto f = detail::SgdMath<T>::make(lr.item(), momentum, dampening, wd, nesterov);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { f(ps[i], gs[i], vs ? vs + i : nullptr); });
    });
  }

  static void adam_update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const Tensor& lr, const Tensor& step,
                          double b1, double b2, double eps, double decoupled_wd, bool bias_correction) {
    detail::dispatch_float(p.dtype(), "adam", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* ms = static_cast<T*>(m.raw());
      T* vs = static_cast<T*>(v.raw());
      const auto f = detail::AdamMath<T>::make(lr.item(), step.item(), b1, b2, eps, decoupled_wd, bias_correction);
      const std::int64_t n = p.numel();
      if constexpr (std::is_same_v<T, float>) {  // one pass at the CPU's vector width (simd.hpp)
        detail::parallel_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
          simd::adam(ps + i0, gs + i0, ms + i0, vs + i0, i1 - i0, f);
        });
        return;
      }
      // AdamMath's arithmetic as Eigen array passes over cache-sized chunks (vectorised), the
      // square root by sqrt_exact (correctly rounded, as CUDA's sqrt).
      detail::parallel_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
        const std::int64_t len = i1 - i0;
        detail::ArrayMap<T> pa(ps + i0, len), ma(ms + i0, len), va(vs + i0, len);
        detail::ConstArrayMap<T> ga(gs + i0, len);
        alignas(64) T root[detail::kChunk];
        ma = f.m(ma, ga);
        va = f.v(va, ga);
        detail::sqrt_exact(vs + i0, root, len);
        if (f.decoupled) pa *= f.decay;
        pa -= f.delta(ma, detail::ConstArrayMap<T>(root, len));
      });
    });
  }

  static void lion_update(Tensor& p, const Tensor& g, Tensor& m, const Tensor& lr, double b1, double b2, double wd) {
    detail::dispatch_float(p.dtype(), "lion", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* ms = static_cast<T*>(m.raw());
      const auto f = detail::LionMath<T>::make(lr.item(), b1, b2, wd);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { f(ps[i], gs[i], ms[i]); });
    });
  }

  static void muon_momentum(const Tensor& p, const Tensor& g, Tensor& v, Tensor& u, double momentum, double wd,
                            bool nesterov) {
    detail::dispatch_float(p.dtype(), "muon", [&]<class T>() {
      const T* ps = static_cast<const T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* vs = static_cast<T*>(v.raw());
      T* us = static_cast<T*>(u.raw());
      const auto f = detail::MuonMomentumMath<T>::make(momentum, wd, nesterov);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { f(ps[i], gs[i], vs[i], us[i]); });
    });
  }

  /// sum of x^2 in double (the global norm of clip_grad_norm).
  static double sum_squares(const Tensor& x) {
    double s = 0;
    detail::dispatch_float(x.dtype(), "sum_squares", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      for (std::int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(xs[i]) * static_cast<double>(xs[i]);
    });
    return s;
  }

  /// y = a x + b y (elementwise; the Newton-Schulz steps of Muon).
  static void axpby(double a, const Tensor& x, double b, Tensor& y) {
    detail::dispatch_float(y.dtype(), "axpby", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const detail::AxpbyMath<T> f{static_cast<T>(a), static_cast<T>(b)};
      const std::int64_t n = y.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { ys[i] = f(xs[i], ys[i]); });
    });
  }

  /// x /= (||x||_F + eps) (Muon's normalisation before Newton-Schulz).
  static void normalize_frobenius(Tensor& x, double eps) {
    detail::dispatch_float(x.dtype(), "normalize", [&]<class T>() {
      T* xs = static_cast<T*>(x.raw());
      const std::int64_t n = x.numel();
      T ss = 0;
      for (std::int64_t i = 0; i < n; ++i) ss += xs[i] * xs[i];
      const T d = std::sqrt(ss) + static_cast<T>(eps);
      for (std::int64_t i = 0; i < n; ++i) xs[i] = xs[i] / d;
    });
  }

  /// p -= (lr * factor) x, lr a 0-D tensor rounded to p's dtype before the factor (MLX order).
  static void apply_update(Tensor& p, const Tensor& x, const Tensor& lr, double factor) {
    detail::dispatch_float(p.dtype(), "update", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* xs = static_cast<const T*>(x.raw());
      const auto f = detail::ApplyUpdateMath<T>::make(lr.item(), factor);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { ps[i] = f(ps[i], xs[i]); });
    });
  }
};
using OptimKernels = OptimKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
