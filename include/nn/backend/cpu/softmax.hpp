// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's softmax and log-softmax over the last axis, with their vjp (ops/softmax.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `SoftmaxKernels` (why: backend/cpu.hpp).
template <class = void>
struct SoftmaxKernelsT {
  /// Softmax (or log-softmax) over the last axis, max-subtracted so logits in the thousands
  /// neither overflow nor lose precision.
  static void softmax(const Tensor& x, Tensor& y, bool log) {
    detail::dispatch_float(x.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = x.numel() / std::max<std::int64_t>(V, 1);
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        // Eigen's array exp is vectorised (std::exp is not, and takes a slow path on underflow,
        // which every masked score hits).
        detail::ConstArrayMap<T> in(xs + r * V, V);
        detail::ArrayMap<T> out(ys + r * V, V);
        T m = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j < V; ++j) m = std::max(m, in[j]);
        m = detail::SoftmaxMath::finite_max(m);  // a fully masked row stays finite
        if (log) {
          const T ls = std::log((in - m).exp().sum());
          out = detail::SoftmaxMath::log_p(in, m, ls);
        } else {
          out = in;
          out *= T(1) / detail::exp_sum(ys + r * V, V, m);
        }
      });
    });
  }

  /// gx (+)= J^T g for y = softmax(x):  y * (g - sum(g*y));  log_softmax: g - softmax * sum(g).
  static void softmax_vjp(const Tensor& y, const Tensor& g, Tensor& gx, bool log, bool acc) {
    detail::dispatch_float(y.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      const std::int64_t V = y.dim(-1), R = y.numel() / std::max<std::int64_t>(V, 1);
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      detail::parallel_for(R, y.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        const T* yr = ys + r * V;
        const T* gr = gs + r * V;
        T* o = out + r * V;
        T s = 0;
        if (log) {
          for (std::int64_t j = 0; j < V; ++j) s += gr[j];
          detail::ConstArrayMap<T> ya(yr, V), ga(gr, V);
          detail::ArrayMap<T> oa(o, V);
          if (acc) oa += detail::SoftmaxMath::log_vjp(ga, ya, s);
          else oa = detail::SoftmaxMath::log_vjp(ga, ya, s);
        } else {
          for (std::int64_t j = 0; j < V; ++j) s += gr[j] * yr[j];
          for (std::int64_t j = 0; j < V; ++j) detail::put(o, j, detail::SoftmaxMath::vjp(yr[j], gr[j], s), acc);
        }
      });
    });
  }
};
using SoftmaxKernels = SoftmaxKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
