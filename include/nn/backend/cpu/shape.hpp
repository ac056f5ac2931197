// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's data movement: permute and slice copies (ops/shape.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `ShapeKernels` (why: backend/cpu.hpp).
template <class = void>
struct ShapeKernelsT {
  /// y (+)= x with its axes permuted: y.shape[i] = x.shape[perm[i]].
  static void permute(const Tensor& x, const std::array<int, kMaxRank>& perm, Tensor& y, bool acc) {
    detail::dispatch_any(x.dtype(), "permute", acc, [&]<class T>() {
      const int r = x.rank();
      std::array<std::int64_t, kMaxRank> xst{}, st{};
      std::int64_t s = 1;
      for (int i = r - 1; i >= 0; --i) { xst[static_cast<std::size_t>(i)] = s; s *= x.shape()[i]; }
      for (int i = 0; i < r; ++i) st[static_cast<std::size_t>(i)] = xst[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])];
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      std::array<std::array<std::int64_t, kMaxRank>, 1> sts{st};
      detail::for_each_broadcast<1>(y.shape(), sts, [&](std::int64_t i, std::int64_t ix) {
        if constexpr (std::is_floating_point_v<T>) detail::put(ys, i, xs[ix], acc);
        else ys[i] = xs[ix];
      });
    });
  }

  /// y = x[..., start:start + y.shape[axis], ...]
  static void slice_copy(const Tensor& x, int axis, std::int64_t start, Tensor& y) {
    const std::size_t es = dtype_size(x.dtype());
    const Shape& s = x.shape();
    const std::int64_t outer = s.prod(0, axis), inner = s.prod(axis + 1, s.rank());
    const std::int64_t len = y.shape()[axis], full = s[axis];
    const auto* xs = static_cast<const char*>(x.raw());
    auto* ys = static_cast<char*>(y.raw());
    for (std::int64_t o = 0; o < outer; ++o)
      std::memcpy(ys + static_cast<std::size_t>(o * len * inner) * es,
                  xs + static_cast<std::size_t>((o * full + start) * inner) * es, static_cast<std::size_t>(len * inner) * es);
  }

  /// y[..., start:start + x.shape[axis], ...] (+)= x; the rest of y is left as it is.
  static void slice_scatter(const Tensor& x, int axis, std::int64_t start, Tensor& y, bool acc) {
    const Shape& s = y.shape();
    const std::int64_t outer = s.prod(0, axis), inner = s.prod(axis + 1, s.rank());
    const std::int64_t len = x.shape()[axis], full = s[axis];
    if (!acc) {
      const std::size_t es = dtype_size(x.dtype());
      const auto* xs = static_cast<const char*>(x.raw());
      auto* ys = static_cast<char*>(y.raw());
      for (std::int64_t o = 0; o < outer; ++o)
        std::memcpy(ys + static_cast<std::size_t>((o * full + start) * inner) * es,
                    xs + static_cast<std::size_t>(o * len * inner) * es, static_cast<std::size_t>(len * inner) * es);
      return;
    }
    detail::dispatch_float(x.dtype(), "slice", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      for (std::int64_t o = 0; o < outer; ++o)
        for (std::int64_t k = 0; k < len * inner; ++k) ys[(o * full + start) * inner + k] += xs[o * len * inner + k];
    });
  }
};
using ShapeKernels = ShapeKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
