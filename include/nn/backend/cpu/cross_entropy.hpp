// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's softmax cross-entropy against integer targets, with its vjp (ops/cross_entropy.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `CrossEntropyKernels` (why: backend/cpu.hpp).
template <class = void>
struct CrossEntropyKernelsT {
  /// Softmax cross-entropy against integer targets (i32/i64): loss_r = logsumexp(x_row) -
  /// x_row[t_r], max-subtracted. x: (..., T, V), t: (..., N) with N <= T: target r scores row
  /// (r / N) * T + r % N of x, i.e. the first N rows of each group of T (next-token training
  /// scores T - 1 positions without copying the logits); N == T (x (R, V), t (R)) is one row per
  /// target. A target equal to a.ignore_index contributes nothing. Reduction::none: y (t's shape)
  /// per target (0 where ignored); sum: y (one element) the sum; mean: the mean over the targets not
  /// ignored (NaN when all are, as PyTorch). lse (t.numel()) keeps logsumexp for the vjp. Any
  /// other target outside [0, V) raises.
  static void cross_entropy(const Tensor& x, const Tensor& t, const CrossEntropyAttrs& a, Tensor& y, Tensor& lse) {
    const std::int64_t ignore = a.ignore_index;
    const int reduction = static_cast<int>(a.reduction);  // 0 none, 1 sum, 2 mean
    detail::dispatch_float(x.dtype(), "cross_entropy", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = t.numel();
      const std::int64_t N = t.rank() ? t.dim(-1) : 1, G = x.rank() >= 2 ? x.dim(-2) : 1;
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t k = detail::load_index(t, r);
        if (k != ignore && (k < 0 || k >= V))
          detail::fail("cross_entropy", "target ", k, " at row ", r, " is out of range for ", V,
                       " classes (ignore_index is ", ignore, ")");
      }
      const T* xs = static_cast<const T*>(x.raw());
      T* ls = static_cast<T*>(lse.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_for(R, R * V > detail::kParallelGrain, [&](std::int64_t r) {
        const T* in = xs + ((r / N) * G + r % N) * V;
        T m, s;
        if constexpr (std::is_same_v<T, float>) {  // at the CPU's vector width (simd.hpp)
          m = simd::max(in, V);
          s = simd::sum_exp(in, V, m);
        } else {
          m = V ? detail::ConstArrayMap<T>(in, V).maxCoeff() : -std::numeric_limits<T>::infinity();  // vectorised
          s = (detail::ConstArrayMap<T>(in, V) - m).exp().sum();  // vectorised exp
        }
        ls[r] = detail::SoftmaxMath::lse(m, s);
        if (reduction == 0) {
          const std::int64_t k = detail::load_index(t, r);
          ys[r] = k == ignore ? T(0) : detail::SoftmaxMath::ce_loss(ls[r], in[k]);
        }
      });
      if (reduction == 0) return;
      T total = 0;  // serial, in row order: deterministic
      std::int64_t count = 0;
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t k = detail::load_index(t, r);
        if (k == ignore) continue;
        total += detail::SoftmaxMath::ce_loss(ls[r], xs[((r / N) * G + r % N) * V + k]);
        ++count;
      }
      ys[0] = reduction == 2 ? total / static_cast<T>(count) : total;
    });
  }

  /// gx (+)= g_r (softmax(x_row) - onehot(t_r)) for each target's row (the mapping of
  /// cross_entropy); rows of ignored targets and rows no target scores get 0. g has t's shape
  /// for reduction 0, else one element (divided by the kept-target count for the mean).
  static void cross_entropy_vjp(const Tensor& x, const Tensor& t, const CrossEntropyAttrs& a, const Tensor& lse,
                                const Tensor& g, Tensor& gx, bool acc) {
    const std::int64_t ignore = a.ignore_index;
    const int reduction = static_cast<int>(a.reduction);  // 0 none, 1 sum, 2 mean
    detail::dispatch_float(x.dtype(), "cross_entropy", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = t.numel();
      const std::int64_t N = t.rank() ? t.dim(-1) : 1, G = x.rank() >= 2 ? x.dim(-2) : 1;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ls = static_cast<const T*>(lse.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      T g0 = reduction == 0 ? T(0) : gs[0];
      if (reduction == 2) {
        std::int64_t count = 0;
        for (std::int64_t r = 0; r < R; ++r) count += detail::load_index(t, r) != ignore;
        g0 = g0 / static_cast<T>(count);
      }
      if (!acc && N < G) {  // rows past the first N of each group are scored by no target
        const std::int64_t groups = N ? R / N : x.numel() / (G * V);
        for (std::int64_t b = 0; b < groups; ++b) std::fill_n(out + (b * G + N) * V, (G - N) * V, T(0));
      }
      detail::parallel_for(R, R * V > detail::kParallelGrain, [&](std::int64_t r) {
        const std::int64_t k = detail::load_index(t, r), row = (r / N) * G + r % N;
        T* o = out + row * V;
        if (k == ignore) {
          if (!acc) std::fill_n(o, V, T(0));
          return;
        }
        const T* in = xs + row * V;
        const T gr = reduction == 0 ? gs[r] : g0, l = ls[r];
        if constexpr (std::is_same_v<T, float>) {
          simd::ce_grad(in, V, l, gr, o, acc);
        } else {
          detail::ArrayMap<T> oa(o, V);
          if (acc) oa += detail::SoftmaxMath::ce_grad(detail::ConstArrayMap<T>(in, V), l, gr);
          else oa = detail::SoftmaxMath::ce_grad(detail::ConstArrayMap<T>(in, V), l, gr);
        }
        o[k] -= gr;
      });
    });
  }
};
using CrossEntropyKernels = CrossEntropyKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
