// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's reductions: sum_to (sum, mean and every broadcast gradient), broadcast_to and
// max over an axis, with their vjps (ops/reduce.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `ReduceKernels` (why: backend/cpu.hpp).
template <class = void>
struct ReduceKernelsT {
  /// y (+)= scale * (x summed over the dims where y has size 1 or is missing). The one kernel
  /// behind sum, mean and every broadcast gradient. Deterministic: fixed summation order.
  static void sum_to(const Tensor& x, Tensor& y, double scale, bool acc) {
    detail::dispatch_float(x.dtype(), "sum", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sc = static_cast<T>(scale);
      std::int64_t outer, red, inner;
      if (detail::reduction_as_3d(x.shape(), y.shape(), outer, red, inner)) {
        if (inner == 1) {  // reduce contiguous rows
          detail::parallel_for(outer, outer * red > detail::kParallelGrain && outer > 1, [&](std::int64_t o) {
            const T* row = xs + o * red;
            T s = 0;
            for (std::int64_t k = 0; k < red; ++k) s += row[k];
            detail::put(ys, o, sc * s, acc);
          });
        } else {  // reduce a middle dim: accumulate rows of length `inner`
          detail::parallel_for(outer, outer * red * inner > detail::kParallelGrain, [&](std::int64_t o) {
            T* dst = ys + o * inner;
            const T* src = xs + o * red * inner;
            for (std::int64_t i = 0; i < inner; ++i) {
              T s = 0;
              for (std::int64_t k = 0; k < red; ++k) s += src[k * inner + i];
              detail::put(dst, i, sc * s, acc);
            }
          });
        }
        return;
      }
      // General case: several non-adjacent reduced dims. Serial scatter into y.
      if (!acc) std::fill_n(ys, y.numel(), T(0));
      std::array<std::array<std::int64_t, kMaxRank>, 1> st{detail::broadcast_strides(y.shape(), x.shape())};
      detail::for_each_broadcast<1>(x.shape(), st, [&](std::int64_t i, std::int64_t iy) { ys[iy] += sc * xs[i]; });
    });
  }

  /// y (+)= scale * x broadcast to y's shape (the vjp of sum and mean).
  static void broadcast_to(const Tensor& x, Tensor& y, double scale, bool acc) {
    detail::dispatch_float(x.dtype(), "broadcast", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sc = static_cast<T>(scale);
      std::array<std::array<std::int64_t, kMaxRank>, 1> st{detail::broadcast_strides(x.shape(), y.shape())};
      detail::for_each_broadcast<1>(y.shape(), st, [&](std::int64_t i, std::int64_t ix) { detail::put(ys, i, sc * xs[ix], acc); });
    });
  }

  /// y = max of x over `axis` (y has keepdims shape), idx (i32, y's shape) = the first index
  /// attaining it. NaN propagates (a NaN wins, as PyTorch).
  static void max_axis(const Tensor& x, int axis, Tensor& y, Tensor& idx) {
    detail::dispatch_float(x.dtype(), "max", [&]<class T>() {
      const Shape& s = x.shape();
      const std::int64_t outer = s.prod(0, axis), red = s[axis], inner = s.prod(axis + 1, s.rank());
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      auto* is = static_cast<std::int32_t*>(idx.raw());
      detail::parallel_for(outer, x.numel() > detail::kParallelGrain, [&](std::int64_t o) {
        for (std::int64_t i = 0; i < inner; ++i) {
          const T* p = xs + o * red * inner + i;
          T best = p[0];
          std::int32_t bi = 0;
          for (std::int64_t k = 1; k < red && !std::isnan(best); ++k) {
            T v = p[k * inner];
            if (v > best || std::isnan(v)) { best = v; bi = static_cast<std::int32_t>(k); }
          }
          ys[o * inner + i] = best;
          is[o * inner + i] = bi;
        }
      });
    });
  }

  /// gx (+)= g placed at the argmax positions recorded by max_axis.
  static void max_axis_vjp(const Tensor& g, const Tensor& idx, int axis, Tensor& gx, bool acc) {
    detail::dispatch_float(g.dtype(), "max", [&]<class T>() {
      const Shape& s = gx.shape();
      const std::int64_t outer = s.prod(0, axis), red = s[axis], inner = s.prod(axis + 1, s.rank());
      const T* gs = static_cast<const T*>(g.raw());
      const auto* is = static_cast<const std::int32_t*>(idx.raw());
      T* out = static_cast<T*>(gx.raw());
      if (!acc) std::fill_n(out, gx.numel(), T(0));
      for (std::int64_t o = 0; o < outer; ++o)
        for (std::int64_t i = 0; i < inner; ++i)
          out[(o * red + is[o * inner + i]) * inner + i] += gs[o * inner + i];
    });
  }
};
using ReduceKernels = ReduceKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
