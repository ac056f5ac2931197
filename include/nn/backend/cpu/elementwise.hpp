// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's elementwise kernels: fill, copy, cast, unary and binary ops (math in ../math.hpp)
// and where, each with its vjp (ops/elementwise.hpp builds the primitives on them).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `ElementwiseKernels` (why: backend/cpu.hpp).
template <class = void>
struct ElementwiseKernelsT {
  static void fill(Tensor& y, double v) {
    if (v == 0.0) { std::memset(y.raw(), 0, y.nbytes()); return; }
    if (y.dtype() == DType::f32) std::fill_n(static_cast<float*>(y.raw()), y.numel(), static_cast<float>(v));
    else if (y.dtype() == DType::f64) std::fill_n(static_cast<double*>(y.raw()), y.numel(), v);
    else for (std::int64_t i = 0; i < y.numel(); ++i) detail::store_from_double(y.raw(), y.dtype(), i, v);
  }

  static void copy(const Tensor& x, Tensor& y, bool acc) {
    if (!acc) { std::memcpy(y.raw(), x.raw(), x.nbytes()); return; }
    detail::dispatch_float(y.dtype(), "copy", [&]<class T>() {
      const T* s = static_cast<const T*>(x.raw());
      T* d = static_cast<T*>(y.raw());
      const std::int64_t n = y.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { d[i] += s[i]; });
    });
  }

  static void cast(const Tensor& x, Tensor& y) {
    Tensor t = x.to(y.dtype());
    std::memcpy(y.raw(), t.raw(), y.nbytes());
  }

  static void unary(Unary op, double arg, const Tensor& x, Tensor& y) {
    detail::dispatch_float(x.dtype(), unary_name(op), [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T a = static_cast<T>(arg);
      const std::int64_t n = x.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        ys[i] = detail::unary_f(op, xs[i], a);
      });
    });
  }

  static void unary_vjp(Unary op, double arg, const Tensor& x, const Tensor& y, const Tensor& g, Tensor& gx,
                        bool acc) {
    detail::dispatch_float(x.dtype(), unary_name(op), [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      const T a = static_cast<T>(arg);
      const std::int64_t n = x.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        detail::put(out, i, gs[i] * detail::unary_df(op, xs[i], ys[i], a), acc);
      });
    });
  }

  static void binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) {
    detail::dispatch_float(y.dtype(), binary_name(op), [&]<class T>() {
      detail::dispatch_binary(op, [&]<Binary Op>() {
        const T* as = static_cast<const T*>(a.raw());
        const T* bs = static_cast<const T*>(b.raw());
        T* ys = static_cast<T*>(y.raw());
        const std::int64_t n = y.numel();
        if (a.shape() == y.shape() && b.shape() == y.shape()) {
          detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
            ys[i] = detail::binary_f(Op, as[i], bs[i]);
          });
        } else if (a.shape() == y.shape() && b.numel() == 1) {
          const T bv = bs[0];
          detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
            ys[i] = detail::binary_f(Op, as[i], bv);
          });
        } else if (a.shape() == y.shape() && detail::is_suffix(b.shape(), y.shape())) {
          const std::int64_t nb = b.numel(), rows = n / nb;  // b repeats along the leading dims
          detail::parallel_for(rows, n > detail::kParallelGrain, [&](std::int64_t r) {
            for (std::int64_t j = 0; j < nb; ++j) ys[r * nb + j] = detail::binary_f(Op, as[r * nb + j], bs[j]);
          });
        } else {
          std::array<std::array<std::int64_t, kMaxRank>, 2> st{detail::broadcast_strides(a.shape(), y.shape()),
                                                                detail::broadcast_strides(b.shape(), y.shape())};
          detail::for_each_broadcast<2>(y.shape(), st, [&](std::int64_t i, std::int64_t ia, std::int64_t ib) {
            ys[i] = detail::binary_f(Op, as[ia], bs[ib]);
          });
        }
      });
    });
  }

  /// dst (+)= g * d(a op b)/d(input `which`), at the output's full shape (the op reduces it to
  /// the input's shape afterwards with sum_to, the one place broadcasting gradients are summed).
  static void binary_vjp(Binary op, int which, const Tensor& a, const Tensor& b, const Tensor& g, Tensor& dst,
                         bool acc) {
    detail::dispatch_float(g.dtype(), binary_name(op), [&]<class T>() {
      detail::dispatch_binary(op, [&]<Binary Op>() {
        const T* as = static_cast<const T*>(a.raw());
        const T* bs = static_cast<const T*>(b.raw());
        const T* gs = static_cast<const T*>(g.raw());
        T* out = static_cast<T*>(dst.raw());
        const std::int64_t n = g.numel();
        if (a.shape() == g.shape() && b.shape() == g.shape()) {
          detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
            detail::put(out, i, gs[i] * detail::binary_df(Op, which, as[i], bs[i]), acc);
          });
        } else {
          std::array<std::array<std::int64_t, kMaxRank>, 2> st{detail::broadcast_strides(a.shape(), g.shape()),
                                                                detail::broadcast_strides(b.shape(), g.shape())};
          detail::for_each_broadcast<2>(g.shape(), st, [&](std::int64_t i, std::int64_t ia, std::int64_t ib) {
            detail::put(out, i, gs[i] * detail::binary_df(Op, which, as[ia], bs[ib]), acc);
          });
        }
      });
    });
  }

  /// y = mask != 0 ? a : b, every input broadcast to y. mask: u8, or the dtype of y.
  static void where(const Tensor& mask, const Tensor& a, const Tensor& b, Tensor& y) {
    detail::dispatch_float(y.dtype(), "where", [&]<class T>() {
      const T* as = static_cast<const T*>(a.raw());
      const T* bs = static_cast<const T*>(b.raw());
      T* ys = static_cast<T*>(y.raw());
      std::array<std::array<std::int64_t, kMaxRank>, 3> st{detail::broadcast_strides(mask.shape(), y.shape()),
                                                            detail::broadcast_strides(a.shape(), y.shape()),
                                                            detail::broadcast_strides(b.shape(), y.shape())};
      detail::for_each_broadcast<3>(y.shape(), st, [&](std::int64_t i, std::int64_t im, std::int64_t ia, std::int64_t ib) {
        ys[i] = mask_at(mask, im) ? as[ia] : bs[ib];
      });
    });
  }

  /// dst (+)= g where the mask selects branch `which` (0: a, taken where mask != 0), else 0.
  static void where_vjp(const Tensor& mask, const Tensor& g, int which, Tensor& dst, bool acc) {
    detail::dispatch_float(g.dtype(), "where", [&]<class T>() {
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(dst.raw());
      std::array<std::array<std::int64_t, kMaxRank>, 1> st{detail::broadcast_strides(mask.shape(), g.shape())};
      detail::for_each_broadcast<1>(g.shape(), st, [&](std::int64_t i, std::int64_t im) {
        bool take = mask_at(mask, im) == (which == 0);
        detail::put(out, i, take ? gs[i] : T(0), acc);
      });
    });
  }

 private:
  static bool mask_at(const Tensor& m, std::int64_t i) {
    switch (m.dtype()) {
      case DType::u8: return static_cast<const std::uint8_t*>(m.raw())[i] != 0;
      case DType::f32: return static_cast<const float*>(m.raw())[i] != 0.0f;
      case DType::f64: return static_cast<const double*>(m.raw())[i] != 0.0;
      case DType::i32: return static_cast<const std::int32_t*>(m.raw())[i] != 0;
      default: return detail::load_as_double(m.raw(), m.dtype(), i) != 0.0;
    }
  }
};
using ElementwiseKernels = ElementwiseKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
