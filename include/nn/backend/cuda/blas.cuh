// SPDX-License-Identifier: MIT OR Apache-2.0
// Row-major (batched, transposed) GEMM on cuBLAS, which is column-major: C = op(A) op(B) is
// computed as C^T = op(B)^T op(A)^T, which reads the same memory with no copy.
#pragma once

#include <type_traits>

#include "runtime.cuh"

namespace nn::detail::cu {

inline int blas_int(std::int64_t v, const char* what) {
  if (v > INT_MAX) fail("matmul", what, " = ", v, " exceeds cuBLAS's 32-bit dimensions");
  return static_cast<int>(v);
}

/// `batch` row-major products C_i[M, N] = op(A_i) op(B_i) + beta C_i, operand i at base + i *
/// stride (stride 0: one matrix shared by the batch). lda / ldb / ldc: stored row lengths (ldc
/// defaults to N; attention writes head slices of wider rows).
template <class T>
void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
          std::int64_t sA, const T* B, std::int64_t ldb, std::int64_t sB, T* C, std::int64_t sC, std::int64_t batch,
          T beta, std::int64_t ldc = -1) {
  const T one = T(1);
  cublasHandle_t h = ctx().blas;
  // Row-major X (r x c, row length ld) is column-major X^T with leading dimension ld. So the
  // first cuBLAS operand is B (op N when B is used as is), the second A; m = N, n = M.
  const cublasOperation_t opB = tb ? CUBLAS_OP_T : CUBLAS_OP_N, opA = ta ? CUBLAS_OP_T : CUBLAS_OP_N;
  const int m = blas_int(N, "N"), n = blas_int(M, "M"), k = blas_int(K, "K");
  const int ldB = blas_int(ldb, "ldb"), ldA = blas_int(lda, "lda"), ldC = ldc < 0 ? m : blas_int(ldc, "ldc");
  if (batch == 1) {
    if constexpr (std::is_same_v<T, float>)
      NN_CUBLAS_CHECK(cublasSgemm(h, opB, opA, m, n, k, &one, B, ldB, A, ldA, &beta, C, ldC));
    else
      NN_CUBLAS_CHECK(cublasDgemm(h, opB, opA, m, n, k, &one, B, ldB, A, ldA, &beta, C, ldC));
    return;
  }
  const int count = blas_int(batch, "batch");
  if constexpr (std::is_same_v<T, float>)
    NN_CUBLAS_CHECK(cublasSgemmStridedBatched(h, opB, opA, m, n, k, &one, B, ldB, sB, A, ldA, sA, &beta, C, ldC, sC, count));
  else
    NN_CUBLAS_CHECK(cublasDgemmStridedBatched(h, opB, opA, m, n, k, &one, B, ldB, sB, A, ldA, sA, &beta, C, ldC, sC, count));
}

}  // namespace nn::detail::cu
