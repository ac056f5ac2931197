// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's quantized kernels (ops/quantized.hpp): products with a quantized matrix, whose values
// are dequantized panel by panel straight into the GEMM's packed layout (the matrix never exists
// in float), and the row gather of a quantized embedding table.
#pragma once

#include "../../quant.hpp"
#include "common.hpp"
#include "matmul.hpp"

namespace nn {

#if defined(NN_OWN_GEMM)
namespace gemm {

/// The B packer (DensePackB's contract) of a quantized matrix W read through `rd`: op(B)(k, j) =
/// W[j0 + j][k] when trans (x @ W^T, a Linear's weight: each panel column is a run of one row of
/// W), else W[k][j0 + j] (each panel depth is a run of one row). Zero past the edge.
template <int NR, class T>
struct QuantPackB {
  const detail::QuantReader<T>* rd;
  bool trans;
  index j_off = 0;  // the first column of op(B) this product sees (a column split's share)
  void operator()(T* dst, index j0, index nc, index k0, index kc) const {
    for (index q = 0; q < nc; q += NR, dst += kc * NR) {
      const index cols = std::min<index>(NR, nc - q), j = j_off + j0 + q;
      if (trans)
        for (index l = 0; l < cols; ++l) rd->run(j + l, k0, kc, dst + l, NR);
      else
        for (index k = 0; k < kc; ++k) rd->run(k0 + k, j, cols, dst + k * NR, 1);
      if (cols < NR)
        for (index k = 0; k < kc; ++k) std::fill(dst + k * NR + cols, dst + (k + 1) * NR, T(0));
    }
  }
};

}  // namespace gemm
#endif

namespace cpu_kernels {

struct QuantizedKernels {
  /// y (M, N) (+)= x (M, K) @ op(W): W^T when a.transpose (W (N, K)), else W (K, N); W given
  /// as codes, scales and biases (undefined for mxfp4) in format a.q. T = y's dtype = x's;
  /// scales of another float dtype are widened to T.
  static void quantized_matmul(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const QuantMatmulAttrs& a, Tensor& y, bool acc) {
    detail::dispatch_float(y.dtype(), "quantized_matmul", [&]<class T>() {
      const std::int64_t K = x.dim(-1), M = x.numel() / std::max<std::int64_t>(K, 1), N = y.dim(-1);
      const detail::QuantReader<T> rd(wq, scales, biases, a.q);
      const T* X = x.data<T>();
      T* Y = y.data<T>();
      if (M == 0 || N == 0) return;
#if defined(NN_OWN_GEMM)
      gemm::with_isa(gemm::active_isa(), [&]<Isa I>() {
        using S = gemm::Shape<T, I>;
        const auto kern = gemm::micro_kernels<T, I>();
        const gemm::DensePackA<S::MR, T> pa{gemm::Matrix<T>{X, K, false}};
        const int threads = gemm::team_threads(M, N, K);
        if (threads > 1 && M < 24 * threads) {  // few rows: each thread packs its own columns
          gemm::split_columns(threads, N, [&](gemm::index d0, gemm::index d1) {
            gemm::gemm_blocked<T, S>(kern, M, d1 - d0, K, pa, gemm::QuantPackB<S::NR, T>{&rd, a.transpose, d0}, Y + d0,
                                     N, acc);
          });
          return;
        }
#if defined(_OPENMP)
        if (threads > 1)
          return gemm::gemm_team<T, S>(threads, kern, M, N, K, pa, gemm::QuantPackB<S::NR, T>{&rd, a.transpose}, Y, N,
                                       acc);
#endif
        gemm::gemm_blocked<T, S>(kern, M, N, K, pa, gemm::QuantPackB<S::NR, T>{&rd, a.transpose}, Y, N, acc);
      });
#else
      // no packing hook on this compiler: blocks of 128 rows of W dequantized into a workspace
      constexpr std::int64_t R = 128;
      const std::int64_t wrows = a.transpose ? N : K, wcols = a.transpose ? K : N;
      T* buf = static_cast<T*>(detail::gemm_workspace(sizeof(T) * static_cast<std::size_t>(R * wcols), 2));
      for (std::int64_t r0 = 0; r0 < wrows; r0 += R) {
        const std::int64_t nr = std::min(R, wrows - r0);
        for (std::int64_t r = 0; r < nr; ++r) rd.run(r0 + r, 0, wcols, buf + r * wcols, 1);
        if (a.transpose) detail::gemm_serial<T>(false, true, M, nr, K, X, K, buf, K, Y + r0, N, acc);
        else detail::gemm_serial<T>(false, false, M, N, nr, X + r0, K, buf, N, Y, N, acc || r0 > 0);
      }
#endif
    });
  }

  /// y (n, D) = rows ids[0..n) of the quantized table W (V, D), dequantized to y's dtype.
  /// An id outside [0, V) is an nn::Error naming it.
  static void quantized_gather(const Tensor& ids, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const Quant& q, Tensor& y) {
    detail::dispatch_float(y.dtype(), "quantized_gather", [&]<class T>() {
      const detail::QuantReader<T> rd(wq, scales, biases, q);
      const std::int64_t n = ids.numel(), D = y.dim(-1), V = wq.dim(0);
      T* Y = y.data<T>();
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t id = ids.dtype() == DType::i32 ? ids.data<std::int32_t>()[i] : ids.data<std::int64_t>()[i];
        if (id < 0 || id >= V)
          detail::fail("quantized_gather", "id ", id, " at position ", i, " is outside the table's ", V, " rows");
        rd.run(id, 0, D, Y + i * D, 1);
      }
    });
  }
};

}  // namespace cpu_kernels
}  // namespace nn
