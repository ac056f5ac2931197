// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's fused rotary embedding, forward and inverse (ops/rope.hpp; reference layers/rope.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `RopeKernels` (why: backend/cpu.hpp).
template <class = void>
struct RopeKernelsT {
  /// y (+)= x with the first dims = 2 * cos.shape[-1] features of each row rotated by its
  /// position's angles: NEOX pairs (i, i + dims/2), or traditional pairs (2i, 2i + 1);
  /// (a, b) -> (a cos - b sin, a sin + b cos), and with `inverse` by minus the angle (the vjp).
  /// cos/sin (T, dims/2) against x (..., T, D), or (T, 1, dims/2) against x (..., T, M, D).
  static void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, RopeArgs args, Tensor& y, bool acc) {
    const bool traditional = args.traditional, inverse = args.inverse;
    detail::dispatch_float(x.dtype(), "rope", [&]<class T>() {
      const std::int64_t D = x.dim(-1), half = cos.dim(-1), T_ = cos.dim(0);
      const std::int64_t M = cos.rank() == 3 ? x.dim(-2) : 1, rows = x.numel() / D;
      const T* xs = static_cast<const T*>(x.raw());
      const T* cs = static_cast<const T*>(cos.raw());
      const T* ss = static_cast<const T*>(sin.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sg = inverse ? T(-1) : T(1);
      auto rows_of = [&]<bool Acc, bool Trad>() {
        detail::parallel_for(rows, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
          const std::int64_t t = (r / M) % T_;
          const T* c = cs + t * half;
          const T* s = ss + t * half;
          const T* a = xs + r * D;
          T* o = ys + r * D;
          for (std::int64_t i = 0; i < half; ++i) {
            const std::int64_t i1 = Trad ? 2 * i : i, i2 = Trad ? 2 * i + 1 : i + half;
            const T si = sg * s[i], o1 = detail::RopeMath::first(a[i1], a[i2], c[i], si),
                  o2 = detail::RopeMath::second(a[i1], a[i2], c[i], si);
            if constexpr (Acc) {
              o[i1] += o1;
              o[i2] += o2;
            } else {
              o[i1] = o1;
              o[i2] = o2;
            }
          }
          for (std::int64_t j = 2 * half; j < D; ++j) {
            if constexpr (Acc) o[j] += a[j];
            else o[j] = a[j];
          }
        });
      };
      if (acc) traditional ? rows_of.template operator()<true, true>() : rows_of.template operator()<true, false>();
      else traditional ? rows_of.template operator()<false, true>() : rows_of.template operator()<false, false>();
    });
  }
};
using RopeKernels = RopeKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
