// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's own matrix-vector products, the one-row (or one-column) products a GEMM's packing does not
// pay for: decoding one token (x (1, C) @ W^T for every projection and the head), a batch of one,
// a vector's gradient; and x @ W^T on 2-4 rows (a few tokens decoded side by side), where the
// GEMM would pack all of W for a 12-row tile. Two forms cover every op(A) @ op(B) with M == 1 or
// N == 1 on row-major matrices (gemv_product below maps them; backend/cpu/matmul.hpp calls it):
//   dot rows:  y[i] (+)= sum_k m[i*ld + k] x[k]   (the matrix's rows run along the vector; up to
//              four vectors x at once, each row read once for all of them)
//   axpy rows: y[j] (+)= sum_k x[k] m[k*ld + j]   (the matrix's rows run along the output)
// Why nn owns them: they went to Eigen's expressions, whose SIMD width is the one the user's
// translation unit was compiled for; without -march (the README's build, a distro's) that is SSE2
// on an AVX-512 machine. Like gemm.hpp's micro-kernels, each body is written once with GCC/Clang
// vector extensions and compiled per ISA under a target attribute, chosen at run time from CPUID.
// Both read the matrix once, front to back along its rows: the products are memory-bound, so
// the bodies keep enough independent accumulators in flight to stream, and no more.
#pragma once

#include "gemm.hpp"

#if defined(NN_OWN_GEMM)
namespace nn {
namespace gemm {

/// v = the W lanes at p (unaligned); the lanes of v added up. Free functions taking vectors by
/// reference, not lambdas: a lambda does not inherit its caller's target attribute, and a vector
/// passed by value crosses an ABI these are inlined away from.
template <class V, class T>
[[gnu::always_inline]] inline void gemv_load(V& v, const T* p) {
  __builtin_memcpy(&v, p, sizeof(V));
}
template <class T, int W, class V>
[[gnu::always_inline]] inline T gemv_lanes(const V& v) {
  // halves added pairwise (log2 W dependent adds, not W: one row's sum cost more than its dot
  // at 576 columns, added lane by lane)
  if constexpr (W == 1) {
    return v[0];
  } else {
    typedef T H __attribute__((vector_size(W / 2 * sizeof(T))));
    H lo, hi;
    __builtin_memcpy(&lo, &v, sizeof(H));
    __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(H), sizeof(H));
    const H sum = lo + hi;
    return gemv_lanes<T, W / 2>(sum);
  }
}

/// Dot rows for RB rows of m at once (m and y at the block's first row) against NX vectors x
/// (x + n*ldx): y[n*ldy + r] (+)= sum_k m[r*ld + k] x[n*ldx + k]. RB x NX x U accumulators of W
/// lanes, each row's load shared by the NX vectors; the lanes are added at the end, then the
/// k past the last full step (the order differs from a serial dot, within float rounding).
template <class T, int W, int NX, int U, int RB>
[[gnu::always_inline]] inline void gemv_dot_block(index cols, const T* __restrict m, index ld, const T* __restrict x,
                                                  index ldx, T* __restrict y, index ldy, bool acc) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  const index kv = cols / (U * W) * (U * W);
  V a[RB][NX][U] = {};
  for (index k = 0; k < kv; k += U * W) {
    V xv[NX][U];
    NN_GEMM_UNROLL(4)
    for (int n = 0; n < NX; ++n)
      NN_GEMM_UNROLL(4)
      for (int u = 0; u < U; ++u) gemv_load(xv[n][u], x + n * ldx + k + u * W);
    NN_GEMM_UNROLL(4)
    for (int r = 0; r < RB; ++r)
      NN_GEMM_UNROLL(4)
      for (int u = 0; u < U; ++u) {
        V mv;
        gemv_load(mv, m + r * ld + k + u * W);
        NN_GEMM_UNROLL(4)
        for (int n = 0; n < NX; ++n) a[r][n][u] += mv * xv[n][u];
      }
  }
  NN_GEMM_UNROLL(4)
  for (int r = 0; r < RB; ++r)
    NN_GEMM_UNROLL(4)
    for (int n = 0; n < NX; ++n) {
      V sum = a[r][n][0];
      NN_GEMM_UNROLL(4)
      for (int u = 1; u < U; ++u) sum += a[r][n][u];
      T s = gemv_lanes<T, W>(sum);
      for (index k = kv; k < cols; ++k) s += m[r * ld + k] * x[n * ldx + k];
      T& out = y[n * ldy + r];
      out = acc ? out + s : s;
    }
}

/// Dot rows: y[n*ldy + i] (+)= sum_k m[i*ld + k] * x[n*ldx + k] for i < rows, k < cols and NX
/// vectors n (1-4: a token, or a few decoded side by side), reading m once for all of them
/// (overwrite unless acc). Blocks of four rows (two where NX > 2 on 16-register ISAs); with one
/// vector, two accumulators per row, so eight loads stream per step.
template <class T, int W, int NX>
[[gnu::always_inline]] inline void gemv_dot_rows_body(index rows, index cols, const T* __restrict m, index ld,
                                                      const T* __restrict x, index ldx, T* __restrict y, index ldy,
                                                      bool acc) {
  constexpr int U = NX == 1 ? 2 : 1, R = (NX <= 2 || W * sizeof(T) >= 64) ? 4 : 2;
  index i = 0;
  for (; i + R <= rows; i += R) gemv_dot_block<T, W, NX, U, R>(cols, m + i * ld, ld, x, ldx, y + i, ldy, acc);
  for (; i < rows; ++i) gemv_dot_block<T, W, NX, U, 1>(cols, m + i * ld, ld, x, ldx, y + i, ldy, acc);
}

/// Axpy rows: y[j] (+)= sum_k x[k] * m[k*ld + j] for j < cols, k < rows (overwrite unless acc).
/// Four rows at a time, each swept across y in strips of 8 vectors held in registers: the four
/// rows are four front-to-back streams (a strip of one row at a time across all rows was 25%
/// slower past L2, its reads a row apart), and y (one row's width, in L1) is read and written
/// once per four rows. y starts as 0 unless acc; columns past the last full vector go one by one.
template <class T, int W>
[[gnu::always_inline]] inline void gemv_axpy_rows_body(index rows, index cols, const T* __restrict m, index ld,
                                                       const T* __restrict x, T* __restrict y, bool acc) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  constexpr int R = 4, NV = 8;
  const index jv = cols / W * W;
  if (!acc) std::fill_n(y, cols, T(0));
  index k = 0;
  for (; k + R <= rows; k += R) {
    V xb[R];
    NN_GEMM_UNROLL(4)
    for (int r = 0; r < R; ++r) xb[r] = V{} + x[k + r];
    index j = 0;
    for (; j + NV * W <= cols; j += NV * W) {
      V a[NV];
      NN_GEMM_UNROLL(8)
      for (int v = 0; v < NV; ++v) gemv_load(a[v], y + j + v * W);
      NN_GEMM_UNROLL(4)
      for (int r = 0; r < R; ++r)
        NN_GEMM_UNROLL(8)
        for (int v = 0; v < NV; ++v) {
          V mv;
          gemv_load(mv, m + (k + r) * ld + j + v * W);
          a[v] += mv * xb[r];
        }
      NN_GEMM_UNROLL(8)
      for (int v = 0; v < NV; ++v) __builtin_memcpy(y + j + v * W, &a[v], sizeof(V));
    }
    for (; j < jv; j += W) {
      V a;
      gemv_load(a, y + j);
      NN_GEMM_UNROLL(4)
      for (int r = 0; r < R; ++r) {
        V mv;
        gemv_load(mv, m + (k + r) * ld + j);
        a += mv * xb[r];
      }
      __builtin_memcpy(y + j, &a, sizeof(V));
    }
    for (; j < cols; ++j)
      for (int r = 0; r < R; ++r) y[j] += x[k + r] * m[(k + r) * ld + j];
  }
  for (; k < rows; ++k) {
    const V xb = V{} + x[k];
    index j = 0;
    for (; j < jv; j += W) {
      V a, mv;
      gemv_load(a, y + j);
      gemv_load(mv, m + k * ld + j);
      a += mv * xb;
      __builtin_memcpy(y + j, &a, sizeof(V));
    }
    for (; j < cols; ++j) y[j] += x[k] * m[k * ld + j];
  }
}

/// The two forms' entry points per ISA: the same bodies, compiled for each instruction set.
/// dot[n - 1] takes n vectors.
template <class T>
struct GemvKernels {
  using Dot = void (*)(index rows, index cols, const T* m, index ld, const T* x, index ldx, T* y, index ldy, bool acc);
  using Axpy = void (*)(index rows, index cols, const T* m, index ld, const T* x, T* y, bool acc);
  Dot dot[4];
  Axpy axpy;
};
#define NN_GEMV_ENTRY(ATTR)                                                                                          \
  static constexpr int W = Shape<T, I>::W;                                                                           \
  template <int NX>                                                                                                  \
  ATTR static void dot(index r, index c, const T* m, index ld, const T* x, index ldx, T* y, index ldy, bool acc) {   \
    gemv_dot_rows_body<T, W, NX>(r, c, m, ld, x, ldx, y, ldy, acc);                                                  \
  }                                                                                                                  \
  ATTR static void axpy(index r, index c, const T* m, index ld, const T* x, T* y, bool acc) {                        \
    gemv_axpy_rows_body<T, W>(r, c, m, ld, x, y, acc);                                                               \
  }
template <class T, Isa I>
struct GemvEntry {
  NN_GEMV_ENTRY()
};
#if defined(__x86_64__) || defined(__i386__)
template <class T>
struct GemvEntry<T, Isa::avx2> {
  static constexpr Isa I = Isa::avx2;
  NN_GEMV_ENTRY([[gnu::target("avx2,fma")]])
};
template <class T>
struct GemvEntry<T, Isa::avx512> {
  static constexpr Isa I = Isa::avx512;
  NN_GEMV_ENTRY([[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]])
};
#endif
#undef NN_GEMV_ENTRY

template <class T>
GemvKernels<T> gemv_kernels(Isa isa) {
  return with_isa(isa, [&]<Isa I>() {
    using E = GemvEntry<T, I>;
    return GemvKernels<T>{{&E::template dot<1>, &E::template dot<2>, &E::template dot<3>, &E::template dot<4>},
                          &E::axpy};
  });
}

/// The team a matrix-vector product of rows x cols pays for: one thread per 2^18 multiply-adds
/// (gemm.hpp's rule; a 1536 x 576 matrix ran 116 -> 26-46 us on two threads, a 576 x 576 one
/// is left on one), at least 64 outputs each; 1 inside a parallel region.
inline int gemv_threads(index outputs, index rows, index cols) {
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
  const double work = static_cast<double>(rows) * static_cast<double>(cols);
  return std::max(1, static_cast<int>(std::min<double>(
                         {static_cast<double>(detail::free_threads()), work / 262144.0, static_cast<double>(outputs / 64)})));
#else
  (void)outputs, (void)rows, (void)cols;
  return 1;
#endif
}

/// y[n*ldy + i] (+)= sum_k m[i*ld + k] x[n*ldx + k]: the row-major matrix m (rows x cols, row
/// stride ld) dotted with nv vectors (1-4) at once, y = x @ m^T for x (nv, cols), y (nv, rows).
/// The rows are split over a team (split_columns' 32-wide whole pieces) past 2^18 multiply-adds;
/// each output is summed by one thread in one order whatever the team, so the result does not
/// depend on it.
template <class T>
void gemv_dot(Isa isa, int nv, index rows, index cols, const T* m, index ld, const T* x, index ldx, T* y, index ldy,
              bool acc) {
  if (rows == 0 || nv == 0) return;
  const auto dot = gemv_kernels<T>(isa).dot[nv - 1];
  const int threads = gemv_threads(rows, rows, cols * nv);
  if (threads <= 1) return dot(rows, cols, m, ld, x, ldx, y, ldy, acc);
  split_columns(threads, rows, [&](index d0, index d1) { dot(d1 - d0, cols, m + d0 * ld, ld, x, ldx, y + d0, ldy, acc); });
}

/// y (+)= the product of the row-major matrix m (rows x cols, row stride ld) with one vector x:
///   along_rows (dot rows):   y (rows)  = m @ x,   x (cols)
///   !along_rows (axpy rows): y (cols)  = m^T @ x, x (rows)
/// x is read at stride incx (a column of a row-major matrix; copied to a contiguous buffer
/// first). Threads as gemv_dot (the columns of y split for axpy rows).
template <class T>
void gemv(Isa isa, bool along_rows, index rows, index cols, const T* m, index ld, const T* x, index incx, T* y,
          bool acc) {
  const index nx = along_rows ? cols : rows, ny = along_rows ? rows : cols;
  if (ny == 0) return;
  if (nx == 0) {
    if (!acc) std::fill_n(y, ny, T(0));
    return;
  }
  if (incx != 1) {  // rare: a (K, 1) operand has stride 1; grown once per thread, never freed
    thread_local std::vector<T> xc;
    if (xc.size() < static_cast<std::size_t>(nx)) xc.resize(static_cast<std::size_t>(nx));
    for (index k = 0; k < nx; ++k) xc[static_cast<std::size_t>(k)] = x[k * incx];
    x = xc.data();
  }
  if (along_rows) return gemv_dot<T>(isa, 1, rows, cols, m, ld, x, 0, y, 0, acc);
  const auto axpy = gemv_kernels<T>(isa).axpy;
  const int threads = gemv_threads(cols, rows, cols);
  if (threads <= 1) return axpy(rows, cols, m, ld, x, y, acc);
  split_columns(threads, cols, [&](index d0, index d1) { axpy(rows, d1 - d0, m + d0, ld, x, y + d0, acc); });
}

/// The most rows of x @ W^T nn's dot rows take (reading W once for all); more go to the GEMM.
inline constexpr index kGemvRows = 4;

/// Whether row-major C = op(A) @ op(B) (M x N x K) runs as GEMV here rather than the GEMM: one
/// row or one column, or up to kGemvRows rows of x @ W^T (A's rows and B's rows along k: a
/// Linear's forward on a few tokens), where packing W for the GEMM costs more than reading it.
inline bool gemv_applies(bool ta, bool tb, index M, index N) {
  return M == 1 || N == 1 || (M <= kGemvRows && !ta && tb);
}

/// Row-major C (+)= op(A) @ op(B) when gemv_applies (C contiguous, M x N). M == 1: C's row =
/// op(A)'s row (A, or A's column at stride lda) times op(B), whose rows run along k when tb.
/// N == 1: C's column = op(A) times op(B)'s column. Otherwise C = A @ B^T on M <= 4 rows.
template <class T>
void gemv_product(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                  T* C, bool acc) {
  if (M > 1 && N > 1) {
    // few rows of x @ W^T: each of W's N rows dotted with the M rows of A
    gemv_dot<T>(isa, static_cast<int>(M), N, K, B, ldb, A, lda, C, N, acc);
  } else if (M == 1) {
    // x_k = op(A)(0, k); op(B) (K x N): B (N x K) dotted row by row when tb, else rows of B (K x N)
    if (tb) gemv<T>(isa, true, N, K, B, ldb, A, ta ? lda : 1, C, acc);
    else gemv<T>(isa, false, K, N, B, ldb, A, ta ? lda : 1, C, acc);
  } else {
    // N == 1: x_k = op(B)(k, 0); op(A) (M x K): A (M x K) dotted row by row, or rows of A (K x M)
    if (!ta) gemv<T>(isa, true, M, K, A, lda, B, tb ? 1 : ldb, C, acc);
    else gemv<T>(isa, false, K, M, A, lda, B, tb ? 1 : ldb, C, acc);
  }
}

}  // namespace gemm
}  // namespace nn
#endif  // NN_OWN_GEMM
