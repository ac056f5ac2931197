// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's fused RMSNorm and its vjp (ops/norm.hpp; the composite reference in layers/norm.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `NormKernels` (why: backend/cpu.hpp).
template <class = void>
struct NormKernelsT {
  /// y = x * rstd (* w) with rstd = 1 / sqrt(mean(x^2) + eps) per row of the last axis (kept in
  /// `rstd` for the vjp). w may be undefined (no gain).
  static void rms_norm(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const std::int64_t C = x.dim(-1), R = x.numel() / C;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ws = w.defined() ? static_cast<const T*>(w.raw()) : nullptr;
      T* ys = static_cast<T*>(y.raw());
      T* rs = static_cast<T*>(rstd.raw());
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C)), e = static_cast<T>(eps);
      detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        detail::ConstArrayMap<T> xr(xs + r * C, C);
        detail::ArrayMap<T> yr(ys + r * C, C);
        const T k = detail::RmsNormMath::rstd(xr.square().sum(), inv_c, e);
        rs[r] = k;
        if (ws) yr = (xr * k) * detail::ConstArrayMap<T>(ws, C);
        else yr = xr * k;
      });
    });
  }

  /// The vjp of rms_norm: with u = g * w (or g), gx (+)= rstd u - rstd^3 x sum(u x) / C per row,
  /// gw (+)= sum over rows of g x rstd (serial over rows: deterministic). Either may be null.
  static void rms_norm_vjp(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& g, GradOut ox,
                           GradOut ow) {
    Tensor *gx = ox.g, *gw = ow.g;
    const bool acc_x = ox.acc, acc_w = ow.acc;
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const std::int64_t C = x.dim(-1), R = x.numel() / C;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ws = w.defined() ? static_cast<const T*>(w.raw()) : nullptr;
      const T* rs = static_cast<const T*>(rstd.raw());
      const T* gs = static_cast<const T*>(g.raw());
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C));
      if (gx) {
        T* out = static_cast<T*>(gx->raw());
        detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
          detail::ConstArrayMap<T> xr(xs + r * C, C), gr(gs + r * C, C);
          detail::ArrayMap<T> o(out + r * C, C);
          const T k = rs[r];
          if (ws) {
            detail::ConstArrayMap<T> wr(ws, C);
            const T c = detail::RmsNormMath::vjp_coef(k, inv_c, T((gr * wr * xr).sum()));
            if (acc_x) o += detail::RmsNormMath::gx(k, gr * wr, c, xr);
            else o = detail::RmsNormMath::gx(k, gr * wr, c, xr);
          } else {
            const T c = detail::RmsNormMath::vjp_coef(k, inv_c, T((gr * xr).sum()));
            if (acc_x) o += detail::RmsNormMath::gx(k, gr, c, xr);
            else o = detail::RmsNormMath::gx(k, gr, c, xr);
          }
        });
      }
      if (gw) {
        detail::ArrayMap<T> o(static_cast<T*>(gw->raw()), C);
        if (!acc_w) o.setZero();
        for (std::int64_t r = 0; r < R; ++r)
          o += detail::ConstArrayMap<T>(gs + r * C, C) * detail::ConstArrayMap<T>(xs + r * C, C) * rs[r];
      }
    });
  }
};
using NormKernels = NormKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
