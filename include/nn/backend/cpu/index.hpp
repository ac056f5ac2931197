// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's indexed kernels: embedding rows (gather/scatter-add) and pick (ops/index.hpp).
#pragma once

#include "common.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `IndexKernels` (why: backend/cpu.hpp).
template <class = void>
struct IndexKernelsT {
  /// y[i, :] = table[ids[i], :]; table: (N, D), ids: any shape of i32/i64 (flattened), y: (n, D).
  /// A bf16 table (Precision::bf16) gives f32 rows, widened exactly.
  static void gather_rows(const Tensor& table, const Tensor& ids, Tensor& y) {
    const std::int64_t D = table.dim(-1), n = ids.numel();
    const bool widen = table.dtype() == DType::bf16 && y.dtype() == DType::f32;
    const std::size_t row = static_cast<std::size_t>(D) * dtype_size(table.dtype());
    const auto* ts = static_cast<const char*>(table.raw());
    auto* ys = static_cast<char*>(y.raw());
    const std::int64_t N = table.dim(0);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t id = detail::load_index(ids, i);
      if (id < 0 || id >= N)
        detail::fail("gather_rows", "id ", id, " at position ", i, " is out of range for a table of ", N, " rows");
      if (widen) {
        const auto* src = reinterpret_cast<const std::uint16_t*>(ts + static_cast<std::size_t>(id) * row);
        float* dst = reinterpret_cast<float*>(ys) + i * D;
        for (std::int64_t j = 0; j < D; ++j) dst[j] = half::bf16_to_f32(src[j]);
      } else {
        std::memcpy(ys + static_cast<std::size_t>(i) * row, ts + static_cast<std::size_t>(id) * row, row);
      }
    }
  }

  /// gtable[ids[i], :] += g[i, :]; repeated ids accumulate, in order (deterministic).
  static void scatter_add_rows(const Tensor& g, const Tensor& ids, Tensor& gtable) {
    detail::dispatch_float(g.dtype(), "embedding", [&]<class T>() {
      const std::int64_t D = gtable.dim(-1), n = ids.numel();
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gtable.raw());
      for (std::int64_t i = 0; i < n; ++i) {
        T* dst = out + detail::load_index(ids, i) * D;
        const T* src = gs + i * D;
        for (std::int64_t j = 0; j < D; ++j) dst[j] += src[j];
      }
    });
  }

  /// y[i] = x[i, idx[i]] for x: (R, V), idx: (R) i32/i64; y[i] = 0 where idx[i] < 0.
  static void pick(const Tensor& x, const Tensor& idx, Tensor& y) {
    detail::dispatch_float(x.dtype(), "pick", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = idx.numel();
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      for (std::int64_t i = 0; i < R; ++i) {
        std::int64_t k = detail::load_index(idx, i);
        if (k >= V) detail::fail("pick", "index ", k, " at row ", i, " is out of range for ", V, " classes");
        ys[i] = k < 0 ? T(0) : xs[i * V + k];
      }
    });
  }

  /// gx[i, idx[i]] += g[i] (gx must already hold its other values).
  static void pick_vjp(const Tensor& g, const Tensor& idx, Tensor& gx) {
    detail::dispatch_float(g.dtype(), "pick", [&]<class T>() {
      const std::int64_t V = gx.dim(-1), R = idx.numel();
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      for (std::int64_t i = 0; i < R; ++i) {
        std::int64_t k = detail::load_index(idx, i);
        if (k >= 0) out[i * V + k] += gs[i];
      }
    });
  }
};
using IndexKernels = IndexKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
