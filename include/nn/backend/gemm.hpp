// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's own GEMM: a BLIS-style packed, blocked product C (+)= op(A) @ op(B) on row-major matrices,
// with micro-kernels for AVX-512, AVX2+FMA and the compiler's baseline, all in one binary and
// chosen at run time from CPUID feature bits (backend/cpu_info.hpp), never from a CPU model name.
//
// Why nn owns it: a BLAS picks its kernels from a table of CPU models, and Debian's OpenBLAS
// 0.3.21 falls back to SSE3 kernels on CPUs newer than its table (Sapphire Rapids runs at a
// fifth of its speed). Owning the loops also gives the hooks the rest of nn needs: caller-supplied
// packing (quantized weights dequantized straight into packed panels) and an epilogue per tile.
//
// One micro-kernel body serves every instruction set: it is written with GCC/Clang vector
// extensions and inlined into a small entry function per ISA marked with a target attribute, so
// the compiler emits zmm FMAs in one, ymm FMAs in another and SSE2 in the baseline one, with no
// -m flags on the user's command line.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>

#if defined(_OPENMP)
#include <omp.h>
#endif

#include "cpu_info.hpp"

#if defined(__GNUC__) || defined(__clang__)
#define NN_OWN_GEMM 1
#endif

// Full unrolling keeps a micro-tile's accumulators in registers. nvcc's front end knows only the
// plain form (and passes host code on to the host compiler).
#define NN_GEMM_STR2(x) #x
#define NN_GEMM_STR(x) NN_GEMM_STR2(x)
#if defined(__CUDACC__)
#define NN_GEMM_UNROLL(n) _Pragma(NN_GEMM_STR(unroll n))
#else
#define NN_GEMM_UNROLL(n) _Pragma(NN_GEMM_STR(GCC unroll n))
#endif

namespace nn {
namespace detail {

/// This thread's working space number `slot` (0: its own GEMM panels, 1: B panels it shares with
/// its team, 2: a kernel's tiles around its GEMM calls, such as flash attention's scores): at
/// least `bytes`, 64-byte aligned. It grows only when a larger request comes, so replaying
/// kernels already seen allocates nothing.
inline void* gemm_workspace(std::size_t bytes, int slot = 0) {
  struct Buffer {
    void* p = nullptr;
    std::size_t n = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer bufs[3];
  Buffer& buf = bufs[slot];
  if (buf.n < bytes) {
    const std::size_t n = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::bad_alloc();
    std::free(buf.p);
    buf.p = p;
    buf.n = n;
  }
  return buf.p;
}

}  // namespace detail

#if defined(NN_OWN_GEMM)
namespace gemm {

using index = std::int64_t;

/// A row-major operand as the product reads it: element (r, c) of op(X) is X[r*ld + c], or
/// X[c*ld + r] when trans (X stored transposed). The default packers read these.
template <class T>
struct Matrix {
  const T* p;
  index ld;
  bool trans;
  T at(index r, index c) const { return trans ? p[c * ld + r] : p[r * ld + c]; }
};

/// The shape of one micro-kernel: an MR x NR tile of C held in registers, NR = NV vectors of W
/// lanes per row; blocking sizes follow from it (KC: depth of a packed panel; NB: columns of a
/// packed B block, sized for L2; MB: rows of a packed A block).
template <class T, Isa I>
struct Shape;
// Baseline (SSE2 on x86-64, NEON elsewhere): 16 registers of 16 bytes; 6 x 2 accumulators.
template <class T>
struct Shape<T, Isa::generic> {
  static constexpr int W = 16 / sizeof(T), NV = 2, MR = 6, NR = W * NV;
  static constexpr index KC = 256, NB = 512, MB = 960;
};
// AVX2: 16 ymm registers; 6 x 2 accumulators + 2 B vectors + 1 broadcast.
template <class T>
struct Shape<T, Isa::avx2> {
  static constexpr int W = 32 / sizeof(T), NV = 2, MR = 6, NR = W * NV;
  static constexpr index KC = 256, NB = 512, MB = 960;
};
// AVX-512: 32 zmm registers; 12 x 2 accumulators + 2 B vectors + 1 broadcast.
template <class T>
struct Shape<T, Isa::avx512> {
  static constexpr int W = 64 / sizeof(T), NV = 2, MR = 12, NR = W * NV;
  static constexpr index KC = 384, NB = 384, MB = 1536;
};

/// The one micro-kernel body: C[MR x NR] (row stride ldc) = (or +=, unless overwrite) the sum over
/// k < kc of A(i, k) * b[k*NR + j]. b is a B panel (NR values per k, packed by pack_b below); A(i,
/// k) is a[k*MR + i] from a packed A panel, or a[i*lda + k] read in place (DirectA: rows of a
/// row-major A, which saves packing A when C is narrow and A's rows would be packed for few uses).
template <class T, int W, int MR, int NV, bool DirectA>
[[gnu::always_inline]] inline void micro_body(index kc, const T* __restrict a, index lda, const T* __restrict b,
                                              T* __restrict c, index ldc, bool overwrite) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  constexpr int NR = W * NV;
  V acc[MR][NV] = {};
  for (index k = 0; k < kc; ++k) {
    V bv[NV];
    NN_GEMM_UNROLL(8)
    for (int j = 0; j < NV; ++j) __builtin_memcpy(&bv[j], b + k * NR + j * W, sizeof(V));
    NN_GEMM_UNROLL(16)
    for (int i = 0; i < MR; ++i) {
      const T ai = DirectA ? a[i * lda + k] : a[k * MR + i];
      NN_GEMM_UNROLL(8)
      for (int j = 0; j < NV; ++j) acc[i][j] += bv[j] * ai;
    }
  }
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i)
    NN_GEMM_UNROLL(8)
    for (int j = 0; j < NV; ++j) {
      V cv = acc[i][j];
      if (!overwrite) {
        V old;
        __builtin_memcpy(&old, c + i * ldc + j * W, sizeof(V));
        cv += old;
      }
      __builtin_memcpy(c + i * ldc + j * W, &cv, sizeof(V));
    }
}

/// One ISA's pair of micro-kernels: on a packed A panel (lda unused), and on A rows read in place.
template <class T>
struct Kernels {
  using Fn = void (*)(index kc, const T* a, index lda, const T* b, T* c, index ldc, bool overwrite);
  Fn packed, direct;
};

// The entry points, one per ISA and form: the same body, compiled for each instruction set.
template <class T, bool D>
void micro_generic(index kc, const T* a, index lda, const T* b, T* c, index ldc, bool overwrite) {
  using S = Shape<T, Isa::generic>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, c, ldc, overwrite);
}
#if defined(__x86_64__) || defined(__i386__)
template <class T, bool D>
[[gnu::target("avx2,fma")]] void micro_avx2(index kc, const T* a, index lda, const T* b, T* c, index ldc,
                                            bool overwrite) {
  using S = Shape<T, Isa::avx2>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, c, ldc, overwrite);
}
template <class T, bool D>
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]] void micro_avx512(index kc, const T* a, index lda,
                                                                                const T* b, T* c, index ldc,
                                                                                bool overwrite) {
  using S = Shape<T, Isa::avx512>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, c, ldc, overwrite);
}
#endif

/// The kernel entry point of ISA I, form D (direct A or packed).
template <class T, Isa I, bool D>
constexpr auto micro_entry() {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (I == Isa::avx512) return &micro_avx512<T, D>;
  else if constexpr (I == Isa::avx2) return &micro_avx2<T, D>;
  else return &micro_generic<T, D>;
#else
  return &micro_generic<T, D>;
#endif
}

template <class T, Isa I>
constexpr Kernels<T> micro_kernels() {
  return {micro_entry<T, I, false>(), micro_entry<T, I, true>()};
}

// ---- packing ------------------------------------------------------------------------------
// A block (rows i0.., depth k0..) is laid out as ceil(mc/MR) panels of kc x MR values; a B block
// (depth k0.., columns j0..) as ceil(nc/NR) panels of kc x NR. Rows and columns past the edge are
// zero, so every micro-kernel call is a full tile. A caller with its own storage (quantized
// weights) supplies a packer with the same contract in place of these.

/// Packs an L-wide strip of a row-major matrix into a panel of kc x L values: `contiguous` when
/// the strip's L values at depth k lie side by side (src + k*ld), else each of its L lines runs
/// along k (src + l*ld + k). Lines past `n` are zero. This is both pack_a and pack_b: a panel of
/// op(A) rows and a panel of op(B) columns are the same thing seen from either side.
template <int L, class T>
inline void pack_panel(const T* src, index ld, bool contiguous, index n, index kc, T* dst) {
  if (n == L) {
    // full panels (all but the edge): constant trip counts the compiler unrolls and vectorises
    if (contiguous) {
      for (index k = 0; k < kc; ++k) std::memcpy(dst + k * L, src + k * ld, sizeof(T) * L);
    } else {
      // 16 depths at a time: each line's 16 values are one cache line
      index k = 0;
      for (; k + 16 <= kc; k += 16)
        for (int u = 0; u < 16; ++u) {
          T* d = dst + (k + u) * L;
          NN_GEMM_UNROLL(32)
          for (int l = 0; l < L; ++l) d[l] = src[l * ld + k + u];
        }
      for (; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = src[l * ld + k];
    }
    return;
  }
  for (index k = 0; k < kc; ++k) {
    T* d = dst + k * L;
    for (index l = 0; l < n; ++l) d[l] = contiguous ? src[k * ld + l] : src[l * ld + k];
    for (index l = n; l < L; ++l) d[l] = T(0);
  }
}

/// Packs op(A)[i0 : i0+mc, k0 : k0+kc] into MR-row panels at dst.
template <int MR, class T>
void pack_a(const Matrix<T>& A, index i0, index mc, index k0, index kc, T* dst) {
  for (index p = 0; p < mc; p += MR, dst += kc * MR) {
    const index rows = std::min<index>(MR, mc - p);
    // op(A) = X^T: the MR rows at depth k are side by side in X's row k
    const T* src = A.trans ? A.p + k0 * A.ld + i0 + p : A.p + (i0 + p) * A.ld + k0;
    pack_panel<MR>(src, A.ld, A.trans, rows, kc, dst);
  }
}

/// Packs op(B)[k0 : k0+kc, j0 : j0+nc] into NR-column panels at dst.
template <int NR, class T>
void pack_b(const Matrix<T>& B, index k0, index kc, index j0, index nc, T* dst) {
  for (index q = 0; q < nc; q += NR, dst += kc * NR) {
    const index cols = std::min<index>(NR, nc - q);
    // op(B) = X^T (a Linear's weight): column c of the panel is row j0+q+c of X, running along k
    const T* src = B.trans ? B.p + (j0 + q) * B.ld + k0 : B.p + k0 * B.ld + j0 + q;
    pack_panel<NR>(src, B.ld, !B.trans, cols, kc, dst);
  }
}

/// The dense packers as the driver calls them: pack(dst, outer0, outer_n, k0, kc).
template <int MR, class T>
struct DensePackA {
  Matrix<T> m;
  void operator()(T* dst, index i0, index mc, index k0, index kc) const { pack_a<MR>(m, i0, mc, k0, kc, dst); }
  /// Row i0 of op(A) from column k0, read in place by the direct kernel (null when op(A) is
  /// transposed: its rows are not contiguous). A packer without this method is always packed.
  const T* rows(index i0, index k0) const { return m.trans ? nullptr : m.p + i0 * m.ld + k0; }
  index ld() const { return m.ld; }
};

/// Runs C[0:mc, 0:nc] (+)= (A block, mc x kc) @ (packed B block, kc x nc) tile by tile. A's full
/// MR-row panels come from `a_rows` in place (row stride lda) when it is not null; other panels
/// from the packed `abuf`. An edge tile is computed whole into `tile` and its valid part copied.
template <class T, class S>
void block_product(const Kernels<T>& kern, index mc, index nc, index kc, const T* abuf, const T* a_rows, index lda,
                   const T* bbuf, T* C, index ldc, bool overwrite, T* tile) {
  constexpr int MR = S::MR, NR = S::NR;
  for (index ir = 0; ir < mc; ir += MR) {
    const index rows = std::min<index>(MR, mc - ir);
    const bool direct = a_rows && rows == MR;
    const T* ap = direct ? a_rows + ir * lda : abuf + ir * kc;
    const auto fn = direct ? kern.direct : kern.packed;
    for (index jr = 0; jr < nc; jr += NR) {
      const T* bp = bbuf + jr * kc;
      const index cols = std::min<index>(NR, nc - jr);
      T* c = C + ir * ldc + jr;
      if (rows == MR && cols == NR) {
        fn(kc, ap, lda, bp, c, ldc, overwrite);
      } else {
        fn(kc, ap, lda, bp, tile, NR, true);
        for (index r = 0; r < rows; ++r)
          for (index q = 0; q < cols; ++q)
            c[r * ldc + q] = overwrite ? tile[r * NR + q] : c[r * ldc + q] + tile[r * NR + q];
      }
    }
  }
}

/// Packs what block_product reads of A rows [i0, i0+mc), depth [k0, k0+kc): every panel into abuf,
/// or, when A is read in place (C narrow: at most 8 NR-wide panels, where packing A would cost as
/// much as the product), only a ragged last panel. Returns the in-place row pointer, or null.
template <class T, class S, class PackA>
const T* prepare_a(const PackA& pack_a_fn, index N, index i0, index mc, index k0, index kc, T* abuf) {
  constexpr int MR = S::MR;
  if constexpr (requires { pack_a_fn.rows(i0, k0); }) {
    const T* rows = N <= 8 * S::NR ? pack_a_fn.rows(i0, k0) : nullptr;
    if (rows) {
      const index full = mc / MR * MR;
      if (full < mc) pack_a_fn(abuf + full * kc, i0 + full, mc - full, k0, kc);
      return rows;
    }
  }
  pack_a_fn(abuf, i0, mc, k0, kc);
  return nullptr;
}

template <class PackA>
index a_ld(const PackA& p) {
  if constexpr (requires { p.ld(); }) return p.ld();
  else return 0;
}
template <int NR, class T>
struct DensePackB {
  Matrix<T> m;
  void operator()(T* dst, index j0, index nc, index k0, index kc) const { pack_b<NR>(m, k0, kc, j0, nc, dst); }
};

// ---- the blocked driver --------------------------------------------------------------------

/// C[M x N] (row stride ldc) (+)= op(A) @ op(B) on the calling thread, with the micro-kernels of
/// shape S (a Shape<T, Isa>). Loops, outer to inner: A blocks of MB rows; K in KC slices (pack A);
/// B blocks of NB columns (pack B, kept in L2); A panels (one MR x KC panel stays in L1); B panels
/// -> micro-kernel. pack_a / pack_b follow the DensePack* contract, so packed layouts can come
/// from elsewhere (dequantized weights).
template <class T, class S, class PackA, class PackB>
void gemm_blocked(const Kernels<T>& kern, index M, index N, index K, const PackA& pack_a_fn, const PackB& pack_b_fn,
                  T* C, index ldc, bool acc) {
  constexpr int MR = S::MR, NR = S::NR;
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc)
      for (index i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
    return;
  }
  const index mb = std::min<index>(S::MB, (M + MR - 1) / MR * MR);
  const index nb = std::min<index>(S::NB, (N + NR - 1) / NR * NR);
  const index kcap = std::min<index>(S::KC, K);
  const std::size_t a_bytes = (static_cast<std::size_t>(mb * kcap) * sizeof(T) + 63) / 64 * 64;
  const std::size_t b_bytes = (static_cast<std::size_t>(nb * kcap) * sizeof(T) + 63) / 64 * 64;
  auto* ws = static_cast<char*>(detail::gemm_workspace(a_bytes + b_bytes + sizeof(T) * MR * NR));
  T* abuf = reinterpret_cast<T*>(ws);
  T* bbuf = reinterpret_cast<T*>(ws + a_bytes);
  T* tile = reinterpret_cast<T*>(ws + a_bytes + b_bytes);
  for (index i0 = 0; i0 < M; i0 += mb) {
    const index mc = std::min(mb, M - i0);
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0);
      const bool overwrite = !acc && k0 == 0;
      const T* a_rows = prepare_a<T, S>(pack_a_fn, N, i0, mc, k0, kc, abuf);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        pack_b_fn(bbuf, j0, nc, k0, kc);
        block_product<T, S>(kern, mc, nc, kc, abuf, a_rows, a_ld(pack_a_fn), bbuf, C + i0 * ldc + j0, ldc, overwrite,
                            tile);
      }
    }
  }
}

#if defined(_OPENMP)
/// gemm_blocked for a team of `threads` OpenMP threads: each thread owns a slice of C's rows (whole
/// MR tiles) and packs its own A panels; each B block is packed once, its panels shared out over
/// the team, into one buffer they all read (two barriers per block). Every C element sees the same
/// panels and k order as in gemm_blocked, so the result is bit-identical to the serial product.
template <class T, class S, class PackA, class PackB>
void gemm_team(int threads, const Kernels<T>& kern, index M, index N, index K, const PackA& pack_a_fn,
               const PackB& pack_b_fn, T* C, index ldc, bool acc) {
  constexpr int MR = S::MR, NR = S::NR;
  const index nb = std::min<index>(S::NB, (N + NR - 1) / NR * NR);
  const index kcap = std::min<index>(S::KC, K);
  const index rows_per = ((M + threads - 1) / threads + MR - 1) / MR * MR;
  T* bbuf = static_cast<T*>(detail::gemm_workspace(static_cast<std::size_t>(nb * kcap) * sizeof(T), 1));
#pragma omp parallel num_threads(threads)
  {
    const index t = omp_get_thread_num(), nt = omp_get_num_threads();
    const index r0 = std::min(M, t * rows_per), r1 = std::min(M, r0 + rows_per), mine = r1 - r0;
    const index a_rows_n = std::max<index>((mine + MR - 1) / MR * MR, MR);
    const std::size_t a_bytes = (static_cast<std::size_t>(a_rows_n * kcap) * sizeof(T) + 63) / 64 * 64;
    auto* ws = static_cast<char*>(detail::gemm_workspace(a_bytes + sizeof(T) * MR * NR));
    T* abuf = reinterpret_cast<T*>(ws);
    T* tile = reinterpret_cast<T*>(ws + a_bytes);
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0);
      const bool overwrite = !acc && k0 == 0;
      const T* a_rows = mine > 0 ? prepare_a<T, S>(pack_a_fn, N, r0, mine, k0, kc, abuf) : nullptr;
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        const index panels = (nc + NR - 1) / NR, per = (panels + nt - 1) / nt;
        const index p0 = std::min(panels, t * per), p1 = std::min(panels, p0 + per);
        if (p0 < p1) pack_b_fn(bbuf + p0 * NR * kc, j0 + p0 * NR, std::min(nc, p1 * NR) - p0 * NR, k0, kc);
#pragma omp barrier
        if (mine > 0)
          block_product<T, S>(kern, mine, nc, kc, abuf, a_rows, a_ld(pack_a_fn), bbuf, C + r0 * ldc + j0, ldc,
                              overwrite, tile);
#pragma omp barrier
      }
    }
  }
}
#endif

/// The kernel set in use for T (NN_CPU_ISA may lower it; see cpu_info.hpp), read once.
inline Isa active_isa() {
  static const Isa isa = detail::choose_isa(detail::detect_cpu_features());
  return isa;
}

/// Row-major C[M x N] (row stride ldc) (+)= op(A) @ op(B) with the dense packers, on the calling
/// thread, with the micro-kernel of `isa`.
template <class T>
void gemm_serial(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                 T* C, index ldc, bool acc) {
  const Matrix<T> a{A, lda, ta}, b{B, ldb, tb};
  auto run = [&]<Isa I>() {
    using S = Shape<T, I>;
    gemm_blocked<T, S>(micro_kernels<T, I>(), M, N, K, DensePackA<S::MR, T>{a}, DensePackB<S::NR, T>{b}, C, ldc, acc);
  };
  switch (isa) {
    case Isa::avx512: run.template operator()<Isa::avx512>(); return;
    case Isa::avx2: run.template operator()<Isa::avx2>(); return;
    case Isa::generic: run.template operator()<Isa::generic>(); return;
  }
}

/// The same, on a team of OpenMP threads (when not already inside a parallel region, and the
/// product is big enough to pay for one): C's rows split over the team, B's packed panels shared
/// (gemm_team); bit-identical to gemm_serial.
template <class T>
void gemm_parallel(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                   T* C, index ldc, bool acc) {
#if defined(_OPENMP)
  int threads = 1;
  if (!omp_in_parallel() && M > 0 && N > 0 && K > 0) {
    // a thread per 2^18 multiply-adds (below that the team costs more than it saves), and at least
    // two 12-row tiles per thread
    const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
    threads = static_cast<int>(std::min<double>({static_cast<double>(omp_get_max_threads()), work / 262144.0,
                                                 static_cast<double>(std::max(M / 24, N / 64))}));
  }
  if (threads > 1 && M < 24 * threads) {
    // too few rows to share out (a short, wide product): columns in whole 32-wide tiles instead,
    // each thread packing its own panels
#pragma omp parallel num_threads(threads)
    {
      const index nt = omp_get_num_threads(), t = omp_get_thread_num();
      const index per = ((N + nt - 1) / nt + 31) / 32 * 32;
      const index d0 = std::min(N, t * per), d1 = std::min(N, d0 + per);
      if (d0 < d1) gemm_serial<T>(isa, ta, tb, M, d1 - d0, K, A, lda, B + (tb ? d0 * ldb : d0), ldb, C + d0, ldc, acc);
    }
    return;
  }
  if (threads > 1) {
    const Matrix<T> a{A, lda, ta}, b{B, ldb, tb};
    auto run = [&]<Isa I>() {
      using S = Shape<T, I>;
      gemm_team<T, S>(threads, micro_kernels<T, I>(), M, N, K, DensePackA<S::MR, T>{a}, DensePackB<S::NR, T>{b}, C,
                      ldc, acc);
    };
    switch (isa) {
      case Isa::avx512: run.template operator()<Isa::avx512>(); return;
      case Isa::avx2: run.template operator()<Isa::avx2>(); return;
      case Isa::generic: run.template operator()<Isa::generic>(); return;
    }
  }
#endif
  gemm_serial<T>(isa, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc);
}

/// "nn avx512 12x32 f32 / 12x16 f64": the engine and tile shapes for an ISA.
inline std::string describe(Isa isa) {
  auto shapes = [&]<Isa I>() {
    return "nn " + std::string(isa_name(I)) + " " + std::to_string(Shape<float, I>::MR) + "x" +
           std::to_string(Shape<float, I>::NR) + " f32 / " + std::to_string(Shape<double, I>::MR) + "x" +
           std::to_string(Shape<double, I>::NR) + " f64";
  };
  switch (isa) {
    case Isa::avx512: return shapes.template operator()<Isa::avx512>();
    case Isa::avx2: return shapes.template operator()<Isa::avx2>();
    case Isa::generic: return shapes.template operator()<Isa::generic>();
  }
  return "?";
}

}  // namespace gemm
#endif  // NN_OWN_GEMM

}  // namespace nn

#undef NN_GEMM_UNROLL
#undef NN_GEMM_STR
#undef NN_GEMM_STR2
