// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's fused SwiGLU and its vjp (ops/glu.hpp; reference layers/activations.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `GluKernels` (why: backend/cpu.hpp).
template <class = void>
struct GluKernelsT {
  // The math is detail::SwiGluMath (backend/math.hpp), a chunk at a time: on simd.hpp's lane
  // vectors for float32, on Eigen arrays for float64.

  /// y = silu(gate) * up = gate * sigmoid(gate) * up.
  static void swiglu(const Tensor& gate, const Tensor& up, Tensor& y) {
    detail::dispatch_float(y.dtype(), "swiglu", [&]<class T>() {
      const T* gs = static_cast<const T*>(gate.raw());
      const T* us = static_cast<const T*>(up.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_chunks(y.numel(), [&](std::int64_t i0, std::int64_t i1) {
        if constexpr (std::is_same_v<T, float>) {  // at the CPU's vector width (simd.hpp)
          simd::swiglu(gs + i0, us + i0, ys + i0, i1 - i0);
        } else {
          detail::ConstArrayMap<T> a(gs + i0, i1 - i0), u(us + i0, i1 - i0);
          detail::ArrayMap<T>(ys + i0, i1 - i0) = detail::SwiGluMath::y(a, u);
        }
      });
    });
  }

  /// The vjp of swiglu: ggate (+)= g up s (1 + gate (1 - s)), gup (+)= g gate s, s = sigmoid(gate).
  static void swiglu_vjp(const Tensor& gate, const Tensor& up, const Tensor& g, GradOut og, GradOut ou) {
    Tensor *ggate = og.g, *gup = ou.g;
    const bool acc_gate = og.acc, acc_up = ou.acc;
    detail::dispatch_float(g.dtype(), "swiglu", [&]<class T>() {
      const T* as = static_cast<const T*>(gate.raw());
      const T* us = static_cast<const T*>(up.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* da = ggate ? static_cast<T*>(ggate->raw()) : nullptr;
      T* du = gup ? static_cast<T*>(gup->raw()) : nullptr;
      detail::parallel_chunks(g.numel(), [&](std::int64_t i0, std::int64_t i1) {
        const std::int64_t n = i1 - i0;
        if constexpr (std::is_same_v<T, float>) {  // at the CPU's vector width (simd.hpp)
          simd::swiglu_vjp(as + i0, us + i0, gs + i0, da ? da + i0 : nullptr, acc_gate, du ? du + i0 : nullptr, acc_up, n);
          return;
        }
        detail::ConstArrayMap<T> a(as + i0, n), u(us + i0, n), gr(gs + i0, n);
        alignas(64) T sbuf[detail::kChunk];  // on the stack: a replay allocates nothing
        detail::ArrayMap<T> s(sbuf, n);
        s = detail::SwiGluMath::sig(a);
        if (da) {
          detail::ArrayMap<T> o(da + i0, n);
          if (acc_gate) o += detail::SwiGluMath::dgate(a, u, gr, s);
          else o = detail::SwiGluMath::dgate(a, u, gr, s);
        }
        if (du) {
          detail::ArrayMap<T> o(du + i0, n);
          if (acc_up) o += detail::SwiGluMath::dup(a, gr, s);
          else o = detail::SwiGluMath::dup(a, gr, s);
        }
      });
    });
  }
};
using GluKernels = GluKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
