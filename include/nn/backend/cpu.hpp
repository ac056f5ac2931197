// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu: the host backend policy. Elementwise kernels are plain loops (OpenMP when built with
// it); GEMM runs on nn's own engine (backend/gemm.hpp, kernels chosen by CPUID features), or on
// CBLAS (OpenBLAS) when NN_USE_BLAS is defined and that BLAS picked real kernels for this CPU, or
// on Eigen's GEMM with NN_GEMM_EIGEN (and compilers without GCC vector extensions). Either way
// nn's OpenMP threads do the splitting (omp_set_num_threads / OMP_NUM_THREADS set the count).
#pragma once

#include <cctype>
#include <cmath>
#include <limits>
#include <numbers>
#include <new>

#include <Eigen/Core>

#if defined(NN_USE_BLAS)
#include <cblas.h>
#endif

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__SSE2__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "gemm.hpp"
#include "math.hpp"
#include "policy.hpp"
#include "../random.hpp"

namespace nn {

namespace detail {

/// Runs f.template operator()<T>() for T = float or double; other dtypes are an error naming op.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  if (t == DType::f32) f.template operator()<float>();
  else if (t == DType::f64) f.template operator()<double>();
  else fail(op, "needs a float32 or float64 tensor, got ", dtype_name(t));
}

/// Runs f.template operator()<Op>() with the Binary op as a compile-time constant: the
/// elementwise loops then inline one operation and vectorise (a switch per element does not).
template <class F>
void dispatch_binary(Binary op, F&& f) {
  switch (op) {
    case Binary::add: f.template operator()<Binary::add>(); return;
    case Binary::sub: f.template operator()<Binary::sub>(); return;
    case Binary::mul: f.template operator()<Binary::mul>(); return;
    case Binary::div: f.template operator()<Binary::div>(); return;
    case Binary::maximum: f.template operator()<Binary::maximum>(); return;
    case Binary::minimum: f.template operator()<Binary::minimum>(); return;
  }
}

// dispatch over every dtype a data-movement kernel handles: floats, plus integers when not
// accumulating (permuting token ids is fine; adding them is not a gradient).
template <class F>
void dispatch_any(DType t, const char* op, bool acc, F&& f) {
  switch (t) {
    case DType::f32: f.template operator()<float>(); return;
    case DType::f64: f.template operator()<double>(); return;
    default: break;
  }
  if (acc) fail(op, "cannot accumulate into ", dtype_name(t));
  switch (dtype_size(t)) {
    case 1: f.template operator()<std::uint8_t>(); return;
    case 2: f.template operator()<std::uint16_t>(); return;
    case 4: f.template operator()<std::uint32_t>(); return;
    default: f.template operator()<std::uint64_t>(); return;
  }
}

/// Reads an integer id tensor (i32 or i64) at i.
inline std::int64_t load_index(const Tensor& ids, std::int64_t i) {
  if (ids.dtype() == DType::i32) return static_cast<const std::int32_t*>(ids.raw())[i];
  return static_cast<const std::int64_t*>(ids.raw())[i];
}

/// Elementwise loops run in parallel only past this size: below it thread start-up costs more
/// than it saves.
inline constexpr std::int64_t kParallelGrain = 1 << 15;

/// One tensor passed as two of attention's inputs (k = v, self-attention's q = k = v) has one
/// gradient buffer: the tape hands its first slot acc = false and the later ones acc = true, but
/// the vjps interleave their writes, so such a buffer is zeroed once and every write to it
/// accumulates.
inline void share_grad_buffers(Tensor* gq, bool& acc_q, Tensor* gk, bool& acc_k, Tensor* gv, bool& acc_v) {
  auto share = [](Tensor* a, bool& acc_a, Tensor* b, bool& acc_b) {
    if (!a || !b || a->raw() != b->raw() || (acc_a && acc_b)) return;
    std::memset(a->raw(), 0, a->nbytes());
    acc_a = acc_b = true;
  };
  share(gq, acc_q, gk, acc_k);
  share(gq, acc_q, gv, acc_v);
  share(gk, acc_k, gv, acc_v);
}

/// Flash attention's tile: kFlashRows queries against kFlashCols keys. A tile's scores (64 KiB in
/// f32) stay in L2 beside the q, k and v rows they come from. Measured on bench_attention at
/// T = 256..4096 against 64 x 64, 96 x 128 and 48 x 256: smaller tiles spend their time packing
/// each product's operands, not multiplying them.
inline constexpr std::int64_t kFlashRows = 128, kFlashCols = 128;

/// Causal attention's row (and key) block: the products of a block of queries stop at its last
/// key, so the work above the diagonal left undone is all but half a block wide.
inline constexpr std::int64_t kAttnBlock = 32;

/// f(i) for i in [0, n), split over OpenMP threads when `wide` (the caller's size test against
/// kParallelGrain) holds and more than one thread is free: in equal contiguous shares, or one
/// iteration at a time when `uneven` (iterations of different cost). The test is a C++ branch
/// taken before OpenMP is entered, not an `if` clause: libgomp builds a one-thread team (a malloc
/// and a free) even for `#pragma omp parallel if (false)`, so every small replayed op would allocate.
template <class F>
inline void parallel_for(std::int64_t n, bool wide, F&& f, bool uneven = false) {
#if defined(_OPENMP)
  if (wide && n > 1 && !omp_in_parallel() && omp_get_max_threads() > 1) {
    const std::int64_t share = uneven ? 1 : (n + omp_get_max_threads() - 1) / omp_get_max_threads();
#pragma omp parallel for schedule(dynamic, share)
    for (std::int64_t i = 0; i < n; ++i) f(i);
    return;
  }
#else
  (void)wide;
  (void)uneven;
#endif
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

/// Strides (in elements) of `in` seen through output shape `out`: the input is aligned to the
/// right, and a dimension of size 1 (or a missing one) gets stride 0, which is broadcasting.
inline std::array<std::int64_t, kMaxRank> broadcast_strides(const Shape& in, const Shape& out) {
  std::array<std::int64_t, kMaxRank> st{};
  std::int64_t s = 1;
  const int off = out.rank() - in.rank();
  for (int i = in.rank() - 1; i >= 0; --i) {
    st[static_cast<std::size_t>(i + off)] = in[i] == 1 ? 0 : s;
    s *= in[i];
  }
  return st;
}

/// Calls f(out_index, offset_0, offset_1, ...) for every element of `out`, with the offsets of
/// each broadcast input, walking an odometer so no division is needed per element.
template <std::size_t N, class F>
void for_each_broadcast(const Shape& out, const std::array<std::array<std::int64_t, kMaxRank>, N>& strides, F&& f) {
  const int r = out.rank();
  const std::int64_t n = out.numel();
  if (n == 0) return;
  std::array<std::int64_t, kMaxRank> idx{};
  std::array<std::int64_t, N> off{};
  const std::int64_t inner = r ? out[r - 1] : 1;
  for (std::int64_t i = 0; i < n; i += inner) {
    for (std::int64_t j = 0; j < inner; ++j) {
      std::array<std::int64_t, N> o = off;
      if (r)
        for (std::size_t k = 0; k < N; ++k) o[k] += j * strides[k][static_cast<std::size_t>(r - 1)];
      std::apply([&](auto... oo) { f(i + j, oo...); }, o);
    }
    // advance the odometer over dims [0, r-1)
    for (int d = r - 2; d >= 0; --d) {
      auto du = static_cast<std::size_t>(d);
      ++idx[du];
      for (std::size_t k = 0; k < N; ++k) off[k] += strides[k][du];
      if (idx[du] < out[d]) break;
      for (std::size_t k = 0; k < N; ++k) off[k] -= strides[k][du] * out[d];
      idx[du] = 0;
    }
  }
}


/// Splits a reduction of `x` to `y` (y's dims equal x's or 1, right-aligned) into
/// (outer, reduced, inner) when the reduced dims are one contiguous block; false otherwise.
inline bool reduction_as_3d(const Shape& x, const Shape& y, std::int64_t& outer, std::int64_t& red,
                            std::int64_t& inner) {
  const int r = x.rank(), off = x.rank() - y.rank();
  int first = -1, last = -1;
  for (int i = 0; i < r; ++i) {
    std::int64_t yd = i < off ? 1 : y[i - off];
    bool reduced = yd == 1 && x[i] != 1;
    if (reduced) {
      if (first < 0) first = i;
      else if (last != i - 1) return false;
      last = i;
    }
  }
  if (first < 0) { outer = x.numel(); red = 1; inner = 1; return true; }
  outer = x.prod(0, first);
  red = x.prod(first, last + 1);
  inner = x.prod(last + 1, r);
  return true;
}

// ---- GEMM on Eigen's kernel without Eigen's per-call heap allocations ------------------------
// `C.noalias() = A * B` heap-allocates Eigen's packing blocks on every call once they pass
// EIGEN_STACK_ALLOCATION_LIMIT (128 KiB: products past about 180 x 180 floats), and its OpenMP
// path allocates the shared packed A on every call. A replay must not allocate, so nn runs Eigen's
// blocked kernel (internal::general_matrix_matrix_product, stable since 3.3.90) itself, packing
// into a per-thread buffer that only grows, and splits the product over threads itself.
// The serial kernel also serves CBLAS builds where a fused kernel runs many small products at once
// inside its own parallel loop (see gemm_serial).
#if EIGEN_VERSION_AT_LEAST(3, 3, 90)

/// Eigen's blocking descriptor, pointing at nn's packing space instead of owning its own.
template <class T>
struct GemmBlocking : Eigen::internal::level3_blocking<T, T> {
  GemmBlocking(Eigen::Index mc, Eigen::Index nc, Eigen::Index kc, T* a, T* b) {
    this->m_mc = mc;
    this->m_nc = nc;
    this->m_kc = kc;
    this->m_blockA = a;
    this->m_blockB = b;
  }
};

/// Row-major C[M,N] (row stride ldc) += op(A) @ op(B) on the calling thread; OrderA/OrderB say
/// how op(A), op(B) lie in memory (ColMajor = read transposed).
template <class T, int OrderA, int OrderB>
void eigen_gemm_serial(Eigen::Index M, Eigen::Index N, Eigen::Index K, const T* A, Eigen::Index lda, const T* B,
                       Eigen::Index ldb, T* C, Eigen::Index ldc) {
  // Eigen runs a row-major product as the column-major C^T = op(B)^T op(A)^T, so the blocking is
  // sized as its gemm_blocking_space sizes it for a row-major destination: mc along N, nc along M.
  Eigen::Index kc = K, mc = N, nc = M;
  Eigen::internal::computeProductBlockingSizes<T, T, 1>(kc, mc, nc, Eigen::Index(1));
  const std::size_t a_bytes = (static_cast<std::size_t>(mc * kc) * sizeof(T) + 63) / 64 * 64;
  const std::size_t b_bytes = static_cast<std::size_t>(kc * nc) * sizeof(T);
  auto* ws = static_cast<char*>(gemm_workspace(a_bytes + b_bytes));
  GemmBlocking<T> blocking(mc, nc, kc, reinterpret_cast<T*>(ws), reinterpret_cast<T*>(ws + a_bytes));
  Eigen::internal::general_matrix_matrix_product<Eigen::Index, T, OrderA, false, T, OrderB, false, Eigen::RowMajor,
                                                 1>::run(M, N, K, A, lda, B, ldb, C, 1, ldc, T(1), blocking);
}

/// Row-major C[M,N] (+)= op(A) @ op(B), split into row (or column) blocks over as many threads
/// as Eigen's own GEMM would use; each block is one serial Eigen GEMM.
template <class T>
void eigen_gemm(bool ta, bool tb, Eigen::Index M, Eigen::Index N, Eigen::Index K, const T* A, Eigen::Index lda,
                const T* B, Eigen::Index ldb, T* C, bool acc) {
  const Eigen::Index ldc = N;
  auto block = [&](Eigen::Index m0, Eigen::Index m1, Eigen::Index n0, Eigen::Index n1) {
    if (!acc)
      for (Eigen::Index i = m0; i < m1; ++i) std::fill_n(C + i * ldc + n0, n1 - n0, T(0));
    const T* a = A + (ta ? m0 : m0 * lda);
    const T* b = B + (tb ? n0 * ldb : n0);
    T* c = C + m0 * ldc + n0;
    const Eigen::Index m = m1 - m0, n = n1 - n0;
    constexpr int R = Eigen::RowMajor, Cm = Eigen::ColMajor;
    if (ta && tb) eigen_gemm_serial<T, Cm, Cm>(m, n, K, a, lda, b, ldb, c, ldc);
    else if (ta) eigen_gemm_serial<T, Cm, R>(m, n, K, a, lda, b, ldb, c, ldc);
    else if (tb) eigen_gemm_serial<T, R, Cm>(m, n, K, a, lda, b, ldb, c, ldc);
    else eigen_gemm_serial<T, R, R>(m, n, K, a, lda, b, ldb, c, ldc);
  };
#if defined(_OPENMP)
  // Eigen's rule (Parallelizer.h): a thread per 50,000 multiply-adds, at most nbThreads(), none
  // when already inside a parallel region; and here at least 16 rows (or columns) per thread.
  Eigen::Index threads = 1;
  if (!omp_in_parallel()) {
    const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
    threads = std::min<Eigen::Index>({static_cast<Eigen::Index>(Eigen::nbThreads()),
                                      static_cast<Eigen::Index>(work / 50000.0), std::max(M, N) / 16});
  }
  if (threads > 1) {
    const bool by_rows = M >= N;
    const Eigen::Index D = by_rows ? M : N;
#pragma omp parallel num_threads(static_cast<int>(threads))
    {
      const Eigen::Index nt = omp_get_num_threads(), t = omp_get_thread_num();
      const Eigen::Index per = ((D + nt - 1) / nt + 15) / 16 * 16;
      const Eigen::Index d0 = std::min(D, t * per), d1 = std::min(D, d0 + per);
      if (d0 < d1) {
        if (by_rows) block(d0, d1, 0, N);
        else block(0, M, d0, d1);
      }
    }
    return;
  }
#endif
  block(0, M, 0, N);
}

#endif  // Eigen >= 3.3.90

#if !defined(NN_OWN_GEMM) && !defined(NN_GEMM_EIGEN)
#define NN_GEMM_EIGEN 1  // no GCC/Clang vector extensions: Eigen's GEMM is the portable one
#endif

/// The engine that runs matrix products in this process.
enum class GemmEngine : std::uint8_t { nn, blas, eigen };

#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
/// True when OpenBLAS runs kernels without AVX2/FMA on a CPU that has them: OpenBLAS picks its
/// kernels from a table of CPU models, and a model newer than its table falls back to a generic
/// core (0.3.21 runs Sapphire Rapids on "Prescott", SSE3, at a fifth of the machine's speed).
inline bool blas_core_is_generic(const CpuFeatures& f) {
  if (f.best_isa() == Isa::generic) return false;
  std::string core = openblas_get_corename();
  for (char& ch : core) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (const char* good : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids", "excavator"})
    if (core == good) return false;
  return true;
}
#endif

struct GemmChoice {
  GemmEngine engine = GemmEngine::nn;
  std::string note;  // why, when an external BLAS was linked
};

/// Decided once: NN_GEMM_EIGEN -> Eigen; NN_USE_BLAS -> CBLAS, unless OpenBLAS chose generic
/// kernels on a better CPU (then nn's engine, said once on stderr); otherwise nn's engine.
inline const GemmChoice& gemm_choice() {
  static const GemmChoice choice = [] {
    GemmChoice c;
#if defined(NN_GEMM_EIGEN)
    c.engine = GemmEngine::eigen;
#elif defined(NN_USE_BLAS)
    c.engine = GemmEngine::blas;
#if defined(OPENBLAS_VERSION)
    const CpuFeatures f = detect_cpu_features();
    const std::string core = openblas_get_corename();
    if (blas_core_is_generic(f)) {
      c.engine = GemmEngine::nn;
      c.note = "OpenBLAS chose its generic '" + core + "' kernels on this " + isa_name(f.best_isa()) +
               " CPU; nn's own GEMM runs instead";
      std::fprintf(stderr, "[nn] %s\n", c.note.c_str());
    } else {
      c.note = "OpenBLAS core " + core;
    }
#endif
#endif
    return c;
  }();
  return choice;
}

/// While alive, OpenBLAS runs each call on the calling thread (its thread count set to 1, then
/// restored): a kernel that splits its own work over OpenMP threads and calls GEMM from each
/// would otherwise have OpenBLAS's pthreads pool contend with them. A no-op for other builds.
struct BlasSerial {
#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
  int prev = openblas_get_num_threads();
  BlasSerial() {
    if (prev != 1) openblas_set_num_threads(1);
  }
  ~BlasSerial() {
    if (prev != 1) openblas_set_num_threads(prev);
  }
#else
  BlasSerial() = default;
#endif
  BlasSerial(const BlasSerial&) = delete;
  BlasSerial& operator=(const BlasSerial&) = delete;
};

/// How bf16 products run in this process (gemm::bf16_kernel on nn's engine; CBLAS and Eigen
/// multiply f32 copies).
inline std::string gemm_bf16_kernel() {
#if defined(NN_OWN_GEMM)
  if (gemm_choice().engine == GemmEngine::nn) return gemm::bf16_kernel_name(gemm::bf16_kernel());
#endif
  return "f32 copies";
}

template <class T>
void gemm_serial(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
                 const T* B, std::int64_t ldb, T* C, std::int64_t ldc, bool acc);

/// C[M x N] (row stride ldc) (+)= bf16(op(A)) @ bf16(op(B)): A f32 rounded to bf16, B bf16 (a
/// frozen weight, Precision::bf16) or f32 rounded too (autocast), f32 accumulation. nn's engine
/// packs straight from the operands (gemm::gemm_bf16); the CBLAS and Eigen engines get f32 copies
/// of the rounded operands (an allocation per call: those engines have no packing hook).
template <class SB>
void gemm_bf16(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const float* A, std::int64_t lda,
               const SB* B, std::int64_t ldb, float* C, std::int64_t ldc, bool acc, bool parallel) {
#if defined(NN_OWN_GEMM)
  if (gemm_choice().engine == GemmEngine::nn) {
    gemm::gemm_bf16<SB>(gemm::active_isa(), gemm::bf16_kernel(), ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc,
                        parallel);
    return;
  }
#endif
  (void)parallel;
  const std::int64_t ar = ta ? K : M, br = tb ? N : K, bc = tb ? K : N;
  std::vector<float> a(static_cast<std::size_t>(ar * (ta ? M : K))), b(static_cast<std::size_t>(br * bc));
  for (std::int64_t r = 0; r < ar; ++r)
    for (std::int64_t c = 0; c < (ta ? M : K); ++c)
      a[static_cast<std::size_t>(r * (ta ? M : K) + c)] = half::bf16_round(A[r * lda + c]);
  for (std::int64_t r = 0; r < br; ++r)
    for (std::int64_t c = 0; c < bc; ++c) {
      const SB v = B[r * ldb + c];
      if constexpr (std::is_same_v<SB, float>) b[static_cast<std::size_t>(r * bc + c)] = half::bf16_round(v);
      else b[static_cast<std::size_t>(r * bc + c)] = half::bf16_to_f32(v);
    }
  gemm_serial<float>(ta, tb, M, N, K, a.data(), ta ? M : K, b.data(), bc, C, ldc, acc);
}

/// Row-major C[M,N] with row stride ldc (+)= op(A) @ op(B) on the calling thread, for products
/// that a kernel runs many of at once from its own parallel loop (attention's per-head
/// products: strided views into (B, T, n * head_dim), no copies). With CBLAS, hold a
/// BlasSerial around the loop.
template <class T>
void gemm_serial(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
                 const T* B, std::int64_t ldb, T* C, std::int64_t ldc, bool acc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!acc)
      for (std::int64_t i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
    return;
  }
  [[maybe_unused]] const GemmEngine engine = gemm_choice().engine;
#if defined(NN_OWN_GEMM)
  if (engine == GemmEngine::nn) {
    gemm::gemm_serial<T>(gemm::active_isa(), ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc);
    return;
  }
#endif
#if defined(NN_USE_BLAS)
  if (engine == GemmEngine::blas) {
    const auto tA = ta ? CblasTrans : CblasNoTrans, tB = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, tA, tB, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0f, A,
                  static_cast<int>(lda), B, static_cast<int>(ldb), acc ? 1.0f : 0.0f, C, static_cast<int>(ldc));
    else
      cblas_dgemm(CblasRowMajor, tA, tB, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0, A,
                  static_cast<int>(lda), B, static_cast<int>(ldb), acc ? 1.0 : 0.0, C, static_cast<int>(ldc));
    return;
  }
#endif
  if (!acc)
    for (std::int64_t i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
#if EIGEN_VERSION_AT_LEAST(3, 3, 90)
  constexpr int R = Eigen::RowMajor, Cm = Eigen::ColMajor;
  if (ta && tb) eigen_gemm_serial<T, Cm, Cm>(M, N, K, A, lda, B, ldb, C, ldc);
  else if (ta) eigen_gemm_serial<T, Cm, R>(M, N, K, A, lda, B, ldb, C, ldc);
  else if (tb) eigen_gemm_serial<T, R, Cm>(M, N, K, A, lda, B, ldb, C, ldc);
  else eigen_gemm_serial<T, R, R>(M, N, K, A, lda, B, ldb, C, ldc);
#else
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>>;
  Eigen::Map<Mat, Eigen::Unaligned, Eigen::OuterStride<>> Cm(C, M, N, Eigen::OuterStride<>(ldc));
  CMap Am(A, ta ? K : M, ta ? M : K, Eigen::OuterStride<>(lda)), Bm(B, tb ? N : K, tb ? K : N, Eigen::OuterStride<>(ldb));
  if (ta && tb) Cm.noalias() += Am.transpose() * Bm.transpose();
  else if (ta) Cm.noalias() += Am.transpose() * Bm;
  else if (tb) Cm.noalias() += Am * Bm.transpose();
  else Cm.noalias() += Am * Bm;
#endif
}

/// A contiguous run of n values as an Eigen array, for the vectorised math (exp above all) of
/// the row kernels: softmax, cross-entropy, SwiGLU.
template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

/// x = exp(x) in place with Eigen's vectorised exp, and exact zeros where exp underflows: Eigen
/// clamps its argument at -88.72 (float) / -709.78 (double) and would return ~1e-38 / ~1e-308
/// there, where std::exp gives 0 (or a denormal below that size). So an additively masked score
/// (-1e9) still contributes exactly nothing, as layers/mask.hpp promises.
template <class T>
inline void exp_inplace(T* x, std::int64_t n) {
  constexpr T lo = std::is_same_v<T, float> ? T(-88.72) : T(-709.78);
  constexpr std::int64_t blk = 256;
  T in[blk];
  for (std::int64_t i0 = 0; i0 < n; i0 += blk) {
    const std::int64_t len = std::min(blk, n - i0);
    std::copy_n(x + i0, len, in);
    ArrayMap<T>(x + i0, len) = ConstArrayMap<T>(in, len).exp();
    for (std::int64_t j = 0; j < len; ++j) x[i0 + j] = in[j] < lo ? T(0) : x[i0 + j];
  }
}

/// row = softmax(scale * row + add) in place (add may be null): max-subtracted, a row whose
/// every entry is -inf kept finite in its max, as cpu::softmax.
template <class T>
inline void softmax_row(T* row, std::int64_t n, T scale, const T* add) {
  ArrayMap<T> r(row, n);
  if (add) r = r * scale + ConstArrayMap<T>(add, n);
  else if (scale != T(1)) r *= scale;
  T m = r.maxCoeff();
  if (m == -std::numeric_limits<T>::infinity()) m = 0;
  r -= m;
  exp_inplace(row, n);
  r *= T(1) / r.sum();
}

/// y = sqrt(x), correctly rounded (what std::sqrt gives), vectorised with the x86 sqrt
/// instructions where available. Not Eigen's .sqrt(): under EIGEN_FAST_MATH (its default) the
/// float version is rsqrt plus one Newton step, a few ulp off, and the optimizers' updates must
/// match MLX's to the bit; nor a loop over std::sqrt, which compilers keep scalar for errno.
template <class T>
inline void sqrt_exact(const T* x, T* y, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float>)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
  else
    for (; i + 4 <= n; i += 4) _mm256_storeu_pd(y + i, _mm256_sqrt_pd(_mm256_loadu_pd(x + i)));
#elif defined(__SSE2__)
  if constexpr (std::is_same_v<T, float>)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(y + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
  else
    for (; i + 2 <= n; i += 2) _mm_storeu_pd(y + i, _mm_sqrt_pd(_mm_loadu_pd(x + i)));
#endif
  for (; i < n; ++i) y[i] = std::sqrt(x[i]);
}

/// Elementwise work over n values in chunks: f(i0, i1) per chunk, the chunks in parallel once n
/// passes kParallelGrain.
inline constexpr std::int64_t kChunk = 4096;
template <class F>
inline void parallel_chunks(std::int64_t n, F&& f) {
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(chunks, n > kParallelGrain, [&](std::int64_t c) { f(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

}  // namespace detail

/// The CPU backend policy.
struct cpu {
  static constexpr Device device = Device::cpu;
  static constexpr const char* name = "cpu";

  static Tensor alloc(const Shape& s, DType t) { return Tensor::empty(s, t, Device::cpu); }

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
        } else if (a.shape() == y.shape() && is_suffix(b.shape(), y.shape())) {
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

  /// c (+)= op(a) @ op(b). Each operand is (batch, rows, cols) with batch = the product of its
  /// leading dims (1 for a matrix); a's and b's batch are equal or 1 (a shared operand); c's is
  /// their batch, or 1 to sum the products over the batch.
  /// op(x) = x^T when the flag is set: read transposed, never copied.
  /// Products whose right operand is a bf16 weight (Precision::bf16) run on bf16 operands with
  /// f32 accumulation (see matmul_bf16).
  static constexpr bool bf16_weights = true;

  static void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    if (b.dtype() == DType::bf16) return matmul_bf16(a, ta, b, tb, c, acc);
    detail::dispatch_float(c.dtype(), "matmul", [&]<class T>() {
      const Shape &sa = a.shape(), &sb = b.shape(), &sc = c.shape();
      const std::int64_t ar = sa.dim(-2), ac = sa.dim(-1), br = sb.dim(-2), bc = sb.dim(-1);
      const std::int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc;
      const std::int64_t ba = sa.prod(0, sa.rank() - 2), bb = sb.prod(0, sb.rank() - 2);
      const std::int64_t bcnt = sc.prod(0, sc.rank() - 2), batch = std::max(ba, bb);
      const T* A = static_cast<const T*>(a.raw());
      const T* Bp = static_cast<const T*>(b.raw());
      T* C = static_cast<T*>(c.raw());
      // bcnt == 1 < batch: the product is summed over the batch into one C (the gradient of an
      // operand shared across a batch).
#if defined(NN_OWN_GEMM)
      // one C per item: nn's engine shares out a batch of small products item by item
      if (bcnt == batch && batch > 1 && detail::gemm_choice().engine == detail::GemmEngine::nn &&
          !gemm_vector_like(M, N, K)) {
        ::nn::gemm::gemm_batched<T>(::nn::gemm::active_isa(), batch, ta, tb, M, N, K, A, ba == 1 ? 0 : ar * ac, ac, Bp,
                                    bb == 1 ? 0 : br * bc, bc, C, M * N, N, acc);
        return;
      }
#endif
      for (std::int64_t i = 0; i < batch; ++i)
        gemm<T>(ta, tb, M, N, K, A + (ba == 1 ? 0 : i * ar * ac), ac, Bp + (bb == 1 ? 0 : i * br * bc), bc,
                C + (bcnt == 1 ? 0 : i * M * N), acc || (bcnt == 1 && i > 0));
    });
  }

  /// c (+)= bf16(op(a)) @ bf16(op(b)) for a matrix b (bf16: a stored weight; f32: rounded too,
  /// autocast) and f32 a (..., M, K) (its batch shares b; ops/matmul.hpp folds it into rows): f32
  /// accumulation, c f32.
  static void matmul_bf16(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    if (a.dtype() != DType::f32 || c.dtype() != DType::f32 || b.rank() != 2 ||
        (b.dtype() != DType::bf16 && b.dtype() != DType::f32))
      detail::fail("matmul", "a bf16 product needs a float32 a and a bfloat16 or float32 matrix b, got a ",
                   dtype_name(a.dtype()), " ", a.shape().str(), ", b ", dtype_name(b.dtype()), " ", b.shape().str());
    const Shape& sa = a.shape();
    const std::int64_t ar = sa.dim(-2), ac = sa.dim(-1), br = b.dim(0), bc = b.dim(1);
    const std::int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc, batch = sa.prod(0, sa.rank() - 2);
    const float* A = static_cast<const float*>(a.raw());
    float* C = static_cast<float*>(c.raw());
    auto run = [&](const auto* Bp) {
      for (std::int64_t i = 0; i < batch; ++i)
        detail::gemm_bf16(ta, tb, M, N, K, A + i * ar * ac, ac, Bp, bc, C + i * M * N, N, acc, true);
    };
    if (b.dtype() == DType::bf16) run(static_cast<const std::uint16_t*>(b.raw()));
    else run(static_cast<const float*>(b.raw()));
  }

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

  /// mask[i] = value where MLX's bernoulli(p_keep, mask.shape, key) is true, else 0 (mask: f32,
  /// f64 or u8). key: u32 (2), read here so a replay draws from whatever key its slot holds now.
  /// The word layout and u < float32(p) test are random.hpp's, so the mask is MLX's bit for bit.
  static void bernoulli_mask(const Tensor& key, double p_keep, double value, Tensor& mask) {
    const auto* k = static_cast<const std::uint32_t*>(key.raw());
    const std::uint32_t k0 = k[0], k1 = k[1];
    const float p = static_cast<float>(p_keep);
    const std::int64_t n = mask.numel(), blocks = random::detail::bits_blocks(n);
    auto draw = [&]<class T>() {
      T* m = static_cast<T*>(mask.raw());
      const T on = static_cast<T>(value);
      detail::parallel_for(blocks, n > detail::kParallelGrain, [&](std::int64_t j) {
        random::detail::bits_block(k0, k1, n, j, [&](std::int64_t i, std::uint32_t w) {
          m[i] = random::detail::uniform01(w) < p ? on : T(0);
        });
      });
    };
    switch (mask.dtype()) {
      case DType::f32: draw.template operator()<float>(); break;
      case DType::f64: draw.template operator()<double>(); break;
      case DType::u8: draw.template operator()<std::uint8_t>(); break;
      default: detail::fail("bernoulli_mask", "needs a float32, float64 or uint8 mask, got ", dtype_name(mask.dtype()));
    }
  }

  /// Softmax (or log-softmax) over the last axis, max-subtracted so logits in the thousands
  /// neither overflow nor lose precision.
  static void softmax(const Tensor& x, Tensor& y, bool log) {
    detail::dispatch_float(x.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = x.numel() / std::max<std::int64_t>(V, 1);
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        // Eigen's array exp is vectorised (std::exp is not, and takes a slow path on underflow,
        // which every masked score hits).
        detail::ConstArrayMap<T> in(xs + r * V, V);
        detail::ArrayMap<T> out(ys + r * V, V);
        T m = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j < V; ++j) m = std::max(m, in[j]);
        if (m == -std::numeric_limits<T>::infinity()) m = 0;  // a fully masked row stays finite in its max
        if (log) {
          // (x - m) - log(s), not x - (m + log(s)): m + log(s) would round to m's ulp, an
          // absolute error of 1e-4 for float32 logits in the thousands.
          const T ls = std::log((in - m).exp().sum());
          out = (in - m) - ls;
        } else {
          out = in - m;
          detail::exp_inplace(ys + r * V, V);
          out *= T(1) / out.sum();
        }
      });
    });
  }

  /// gx (+)= J^T g for y = softmax(x):  y * (g - sum(g*y));  log_softmax: g - softmax * sum(g).
  static void softmax_vjp(const Tensor& y, const Tensor& g, Tensor& gx, bool log, bool acc) {
    detail::dispatch_float(y.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      const std::int64_t V = y.dim(-1), R = y.numel() / std::max<std::int64_t>(V, 1);
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      detail::parallel_for(R, y.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        const T* yr = ys + r * V;
        const T* gr = gs + r * V;
        T* o = out + r * V;
        T s = 0;
        if (log) {
          for (std::int64_t j = 0; j < V; ++j) s += gr[j];
          detail::ConstArrayMap<T> ya(yr, V), ga(gr, V);
          detail::ArrayMap<T> oa(o, V);
          if (acc) oa += ga - ya.exp() * s;
          else oa = ga - ya.exp() * s;
        } else {
          for (std::int64_t j = 0; j < V; ++j) s += gr[j] * yr[j];
          for (std::int64_t j = 0; j < V; ++j) detail::put(o, j, yr[j] * (gr[j] - s), acc);
        }
      });
    });
  }

  /// Softmax cross-entropy against integer targets (i32/i64): loss_r = logsumexp(x_row) -
  /// x_row[t_r], max-subtracted. x: (..., T, V), t: (..., N) with N <= T: target r scores row
  /// (r / N) * T + r % N of x, i.e. the first N rows of each group of T (next-token training
  /// scores T - 1 positions without copying the logits); N == T (x (R, V), t (R)) is one row per
  /// target. A target equal to `ignore` contributes nothing. reduction 0: y (t's shape) per
  /// target (0 where ignored); 1: y (one element) the sum; 2: the mean over the targets not
  /// ignored (NaN when all are, as PyTorch). lse (t.numel()) keeps logsumexp for the vjp. Any
  /// other target outside [0, V) raises.
  static void cross_entropy(const Tensor& x, const Tensor& t, std::int64_t ignore, int reduction, Tensor& y,
                            Tensor& lse) {
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
        const T m = V ? detail::ConstArrayMap<T>(in, V).maxCoeff() : -std::numeric_limits<T>::infinity();  // vectorised
        const T s = (detail::ConstArrayMap<T>(in, V) - m).exp().sum();  // vectorised exp
        ls[r] = m + std::log(s);
        if (reduction == 0) {
          const std::int64_t k = detail::load_index(t, r);
          ys[r] = k == ignore ? T(0) : ls[r] - in[k];
        }
      });
      if (reduction == 0) return;
      T total = 0;  // serial, in row order: deterministic
      std::int64_t count = 0;
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t k = detail::load_index(t, r);
        if (k == ignore) continue;
        total += ls[r] - xs[((r / N) * G + r % N) * V + k];
        ++count;
      }
      ys[0] = reduction == 2 ? total / static_cast<T>(count) : total;
    });
  }

  /// gx (+)= g_r (softmax(x_row) - onehot(t_r)) for each target's row (the mapping of
  /// cross_entropy); rows of ignored targets and rows no target scores get 0. g has t's shape
  /// for reduction 0, else one element (divided by the kept-target count for the mean).
  static void cross_entropy_vjp(const Tensor& x, const Tensor& t, std::int64_t ignore, int reduction,
                                const Tensor& lse, const Tensor& g, Tensor& gx, bool acc) {
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
        detail::ArrayMap<T> oa(o, V);
        if (acc) oa += gr * (detail::ConstArrayMap<T>(in, V) - l).exp();
        else oa = gr * (detail::ConstArrayMap<T>(in, V) - l).exp();
        o[k] -= gr;
      });
    });
  }

  // ---- fused primitives (ops/norm.hpp, rope.hpp, attention.hpp, glu.hpp), each the same math as
  // its composite reference in layers/, in one pass; tests/ops/fused.test.cpp holds them together.

  /// y = x * rstd (* w) with rstd = 1 / sqrt(mean(x^2) + eps) per row of the last axis (kept in
  /// `rstd` for the vjp). w may be undefined (no gain).
  static void rms_norm(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const std::int64_t C = x.dim(-1), R = x.numel() / C;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ws = w.defined() ? static_cast<const T*>(w.raw()) : nullptr;
      T* ys = static_cast<T*>(y.raw());
      T* rs = static_cast<T*>(rstd.raw());
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C)), e = static_cast<T>(eps);
      detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        detail::ConstArrayMap<T> xr(xs + r * C, C);
        detail::ArrayMap<T> yr(ys + r * C, C);
        const T k = T(1) / std::sqrt(inv_c * xr.square().sum() + e);
        rs[r] = k;
        if (ws) yr = (xr * k) * detail::ConstArrayMap<T>(ws, C);
        else yr = xr * k;
      });
    });
  }

  /// The vjp of rms_norm: with u = g * w (or g), gx (+)= rstd u - rstd^3 x sum(u x) / C per row,
  /// gw (+)= sum over rows of g x rstd (serial over rows: deterministic). Either may be null.
  static void rms_norm_vjp(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& g, Tensor* gx,
                           bool acc_x, Tensor* gw, bool acc_w) {
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const std::int64_t C = x.dim(-1), R = x.numel() / C;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ws = w.defined() ? static_cast<const T*>(w.raw()) : nullptr;
      const T* rs = static_cast<const T*>(rstd.raw());
      const T* gs = static_cast<const T*>(g.raw());
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C));
      if (gx) {
        T* out = static_cast<T*>(gx->raw());
        detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
          detail::ConstArrayMap<T> xr(xs + r * C, C), gr(gs + r * C, C);
          detail::ArrayMap<T> o(out + r * C, C);
          const T k = rs[r];
          if (ws) {
            detail::ConstArrayMap<T> wr(ws, C);
            const T c = k * k * k * inv_c * (gr * wr * xr).sum();
            if (acc_x) o += k * (gr * wr) - c * xr;
            else o = k * (gr * wr) - c * xr;
          } else {
            const T c = k * k * k * inv_c * (gr * xr).sum();
            if (acc_x) o += k * gr - c * xr;
            else o = k * gr - c * xr;
          }
        });
      }
      if (gw) {
        detail::ArrayMap<T> o(static_cast<T*>(gw->raw()), C);
        if (!acc_w) o.setZero();
        for (std::int64_t r = 0; r < R; ++r)
          o += detail::ConstArrayMap<T>(gs + r * C, C) * detail::ConstArrayMap<T>(xs + r * C, C) * rs[r];
      }
    });
  }

  /// y (+)= x with the first dims = 2 * cos.shape[-1] features of each row rotated by its
  /// position's angles: NEOX pairs (i, i + dims/2), or traditional pairs (2i, 2i + 1);
  /// (a, b) -> (a cos - b sin, a sin + b cos), and with `inverse` by minus the angle (the vjp).
  /// cos/sin (T, dims/2) against x (..., T, D), or (T, 1, dims/2) against x (..., T, M, D).
  static void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, bool traditional, bool inverse, Tensor& y,
                   bool acc) {
    detail::dispatch_float(x.dtype(), "rope", [&]<class T>() {
      const std::int64_t D = x.dim(-1), half = cos.dim(-1), T_ = cos.dim(0);
      const std::int64_t M = cos.rank() == 3 ? x.dim(-2) : 1, rows = x.numel() / D;
      const T* xs = static_cast<const T*>(x.raw());
      const T* cs = static_cast<const T*>(cos.raw());
      const T* ss = static_cast<const T*>(sin.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sg = inverse ? T(-1) : T(1);
      auto rows_of = [&]<bool Acc, bool Trad>() {
        detail::parallel_for(rows, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
          const std::int64_t t = (r / M) % T_;
          const T* c = cs + t * half;
          const T* s = ss + t * half;
          const T* a = xs + r * D;
          T* o = ys + r * D;
          for (std::int64_t i = 0; i < half; ++i) {
            const std::int64_t i1 = Trad ? 2 * i : i, i2 = Trad ? 2 * i + 1 : i + half;
            const T si = sg * s[i], o1 = a[i1] * c[i] - a[i2] * si, o2 = a[i1] * si + a[i2] * c[i];
            if constexpr (Acc) {
              o[i1] += o1;
              o[i2] += o2;
            } else {
              o[i1] = o1;
              o[i2] = o2;
            }
          }
          for (std::int64_t j = 2 * half; j < D; ++j) {
            if constexpr (Acc) o[j] += a[j];
            else o[j] = a[j];
          }
        });
      };
      if (acc) traditional ? rows_of.template operator()<true, true>() : rows_of.template operator()<true, false>();
      else traditional ? rows_of.template operator()<false, true>() : rows_of.template operator()<false, false>();
    });
  }

  /// Attention per (batch, query head): P = softmax(scale q k^T + mask) (kept in p: (B, H, T, T)),
  /// out = P v. q, out: (B, T, H * hd); k, v: (B, T, KV * hd); query head h reads kv head
  /// h / (H / KV); mask (may be undefined) broadcasts to (B, H, T, T). `causal`: query i sees keys
  /// 0..i only, besides any mask; the rows are then taken in blocks of kAttnBlock and each block's
  /// products stop at its last key, about half the work of the square. P's row i is then exact 0
  /// from key i + 1 to its block's end, and the rest is left unwritten (never read, here or in
  /// the vjp).
  /// The heads run in parallel, each product a strided GEMM on its thread (no permuted copies).
  static void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, std::int64_t Bn,
                        std::int64_t T_, std::int64_t H, std::int64_t KV, std::int64_t hd, double scale, Tensor& out,
                        Tensor& p, bool causal = false) {
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const std::int64_t g = H / KV, qs = H * hd, ks = KV * hd, rb = causal ? detail::kAttnBlock : T_;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* Mk = mask.defined() ? static_cast<const T*>(mask.raw()) : nullptr;
      T* O = static_cast<T*>(out.raw());
      T* P = static_cast<T*>(p.raw());
      std::array<std::int64_t, kMaxRank> ms{};
      if (Mk) ms = detail::broadcast_strides(mask.shape(), Shape{Bn, H, T_, T_});
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      detail::parallel_for(Bn * H, p.numel() * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / H, h = t % H, kh = h / g;
        T* pt = P + t * T_ * T_;
        const T* qt = Q + b * T_ * qs + h * hd;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ot = O + b * T_ * qs + h * hd;
        for (std::int64_t i0 = 0; i0 < T_; i0 += rb) {  // query rows i0..i1-1 against keys 0..kn-1
          const std::int64_t i1 = std::min(T_, i0 + rb), kn = causal ? i1 : T_;
          detail::gemm_serial<T>(false, true, i1 - i0, kn, hd, qt + i0 * qs, qs, kt, ks, pt + i0 * T_, T_, false);  // q k^T
          for (std::int64_t i = i0; i < i1; ++i) {
            const std::int64_t n = causal ? i + 1 : T_;
            detail::softmax_row(pt + i * T_, n, sc, Mk ? Mk + b * ms[0] + h * ms[1] + i * ms[2] : nullptr);
            std::fill(pt + i * T_ + n, pt + i * T_ + kn, T(0));  // the block's keys past i (all P v and the vjp read)
          }
          detail::gemm_serial<T>(false, false, i1 - i0, hd, kn, pt + i0 * T_, T_, vt, ks, ot + i0 * qs, qs, false);  // P v
        }
      }, /*uneven=*/true);
    });
  }

  /// The vjp of attention, per (batch, kv head) so each kv head's gradient sums its query heads
  /// without races: dv += P^T g; dS = P * (g v^T - rowsum(P * g v^T)) * scale (in `scratch`,
  /// (B * KV, T, T)); dq = dS k; dk += dS^T q. Any of gq, gk, gv may be null. `causal`: P is
  /// attention's causal one, and the products read only the blocks the forward wrote.
  static void attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& p, const Tensor& g,
                            std::int64_t Bn, std::int64_t T_, std::int64_t H, std::int64_t KV, std::int64_t hd,
                            double scale, Tensor& scratch, Tensor* gq, bool acc_q, Tensor* gk, bool acc_k, Tensor* gv,
                            bool acc_v, bool causal = false) {
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const std::int64_t grp = H / KV, qs = H * hd, ks = KV * hd, rb = causal ? detail::kAttnBlock : T_;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* P = static_cast<const T*>(p.raw());
      const T* G = static_cast<const T*>(g.raw());
      T* S = static_cast<T*>(scratch.raw());
      T* GQ = gq ? static_cast<T*>(gq->raw()) : nullptr;
      T* GK = gk ? static_cast<T*>(gk->raw()) : nullptr;
      T* GV = gv ? static_cast<T*>(gv->raw()) : nullptr;
      detail::share_grad_buffers(gq, acc_q, gk, acc_k, gv, acc_v);
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      detail::parallel_for(Bn * KV, p.numel() * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / KV, kh = t % KV;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ds = S + t * T_ * T_;
        for (std::int64_t j = 0; j < grp; ++j) {
          const std::int64_t h = kh * grp + j, qo = b * T_ * qs + h * hd, ko = b * T_ * ks + kh * hd;
          const T* pt = P + (b * H + h) * T_ * T_;
          // Rows by query block [i0, i1) (keys 0..kn-1): dS = P * (g v^T - rowsum) * scale, dq = dS k.
          if (GQ || GK)
            for (std::int64_t i0 = 0; i0 < T_; i0 += rb) {
              const std::int64_t i1 = std::min(T_, i0 + rb), kn = causal ? i1 : T_;
              detail::gemm_serial<T>(false, true, i1 - i0, kn, hd, G + qo + i0 * qs, qs, vt, ks, ds + i0 * T_, T_, false);  // g v^T
              for (std::int64_t i = i0; i < i1; ++i) {
                detail::ArrayMap<T> d(ds + i * T_, kn);
                detail::ConstArrayMap<T> pr(pt + i * T_, kn);
                const T dot = (d * pr).sum();
                d = pr * (d - dot) * sc;
              }
              if (GQ) detail::gemm_serial<T>(false, false, i1 - i0, hd, kn, ds + i0 * T_, T_, kt, ks, GQ + qo + i0 * qs, qs, acc_q);  // dS k
            }
          // Columns by key block [j0, j1) (queries j0..T-1 see them): dv (+)= P^T g, dk (+)= dS^T q.
          for (std::int64_t j0 = 0; j0 < T_; j0 += rb) {
            const std::int64_t j1 = std::min(T_, j0 + rb), i0 = causal ? j0 : 0;
            if (GV) detail::gemm_serial<T>(true, false, j1 - j0, hd, T_ - i0, pt + i0 * T_ + j0, T_, G + qo + i0 * qs, qs,
                                           GV + ko + j0 * ks, ks, acc_v || j > 0);  // P^T g
            if (GK) detail::gemm_serial<T>(true, false, j1 - j0, hd, T_ - i0, ds + i0 * T_ + j0, T_, Q + qo + i0 * qs, qs,
                                           GK + ko + j0 * ks, ks, acc_k || j > 0);  // dS^T q
          }
        }
      }, /*uneven=*/true);
    });
  }

  /// Flash attention (Dao et al. 2022; FlashAttention-2's loop order, Dao 2023): what attention
  /// computes without a mask tensor, without ever storing the (T, T) probabilities. Per (batch,
  /// query head, block of kFlashRows queries), the keys are read kFlashCols at a time; a tile's
  /// scores s = scale q k^T live in the thread's workspace, and an online softmax keeps per query
  /// row the running max m and sum l: out = sum_j exp(s_j - m) v_j / l, rescaled by
  /// exp(m_old - m_new) whenever the max grows. Saves only lse = m + log l (B, H, T) for the vjp. `causal`: query i
  /// sees keys 0..i; key blocks past a query block's last row are never touched.
  /// q, out: (B, T, H * hd); k, v: (B, T, KV * hd); query head h reads kv head h / (H / KV).
  static void flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, std::int64_t Bn, std::int64_t T_,
                              std::int64_t H, std::int64_t KV, std::int64_t hd, double scale, Tensor& out,
                              Tensor& lse, bool causal) {
    detail::dispatch_float(q.dtype(), "flash_attention", [&]<class T>() {
      constexpr std::int64_t Br = detail::kFlashRows, Bc = detail::kFlashCols;
      const std::int64_t g = H / KV, qs = H * hd, ks = KV * hd, nqb = (T_ + Br - 1) / Br;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      T* O = static_cast<T*>(out.raw());
      T* L = static_cast<T*>(lse.raw());
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      const bool wide = Bn * H * T_ * (causal ? T_ / 2 + 1 : T_) * hd > detail::kParallelGrain;
      detail::parallel_for(Bn * H * nqb, wide, [&](std::int64_t t) {
        const std::int64_t bh = t / nqb, b = bh / H, h = bh % H, kh = h / g;
        const std::int64_t i0 = (t % nqb) * Br, r = std::min(T_, i0 + Br) - i0, kend = causal ? i0 + r : T_;
        const T* qt = Q + (b * T_ + i0) * qs + h * hd;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ot = O + (b * T_ + i0) * qs + h * hd;
        // the tile's scores, then its exp(s - m): (r, c), row stride Bc; then m and l per row
        T* s = static_cast<T*>(detail::gemm_workspace(sizeof(T) * (Br * Bc + 2 * Br), 2));
        T *m = s + Br * Bc, *l = m + Br;
        for (std::int64_t j0 = 0; j0 < kend; j0 += Bc) {
          const std::int64_t c = std::min(kend, j0 + Bc) - j0;
          detail::gemm_serial<T>(false, true, r, c, hd, qt, qs, kt + j0 * ks, ks, s, Bc, false);  // q k^T
          for (std::int64_t i = 0; i < r; ++i) {
            // keys j0..j0+n-1 of this tile are visible to query i0 + i; the first tile (j0 = 0)
            // always has one, a later one on the diagonal may have none
            const std::int64_t n = causal ? std::clamp<std::int64_t>(i0 + i + 1 - j0, 0, c) : c;
            detail::ArrayMap<T> row(s + i * Bc, c);
            row.tail(c - n).setZero();
            if (n == 0) continue;
            row.head(n) *= sc;
            const T mx = row.head(n).maxCoeff();
            const T mnew = j0 == 0 ? mx : std::max(m[i], mx);
            row.head(n) -= mnew;
            detail::exp_inplace(s + i * Bc, n);
            const T sum = row.head(n).sum();
            if (j0 == 0) {
              l[i] = sum;
            } else {
              const T alpha = std::exp(m[i] - mnew);  // the earlier tiles' terms, re-based on the new max
              l[i] = l[i] * alpha + sum;
              if (alpha != T(1)) detail::ArrayMap<T>(ot + i * qs, hd) *= alpha;
            }
            m[i] = mnew;
          }
          detail::gemm_serial<T>(false, false, r, hd, c, s, Bc, vt + j0 * ks, ks, ot, qs, j0 > 0);  // (+)= p v
        }
        T* lt = L + bh * T_ + i0;
        for (std::int64_t i = 0; i < r; ++i) {
          detail::ArrayMap<T>(ot + i * qs, hd) *= T(1) / l[i];
          lt[i] = m[i] + std::log(l[i]);
        }
      }, /*uneven=*/causal);
    });
  }

  /// The vjp of flash_attention, recomputing each tile's probabilities p = exp(scale q k^T - lse)
  /// instead of reading stored ones. With dlt_i = rowsum(g_i * out_i) (in `delta`, (B, H, T)):
  /// dv_j += p^T g, ds = p * (g v_j^T - dlt) * scale, dq_i += ds k_j, dk_j += ds^T q_i. Per
  /// (batch, kv head), so every gradient row has one writer: key blocks outside, the group's
  /// query heads and the query blocks that see the key block inside. Any of gq, gk, gv may be null.
  static void flash_attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& out,
                                  const Tensor& lse, const Tensor& g, std::int64_t Bn, std::int64_t T_, std::int64_t H,
                                  std::int64_t KV, std::int64_t hd, double scale, Tensor& delta, Tensor* gq,
                                  bool acc_q, Tensor* gk, bool acc_k, Tensor* gv, bool acc_v, bool causal) {
    detail::dispatch_float(q.dtype(), "flash_attention", [&]<class T>() {
      constexpr std::int64_t Br = detail::kFlashRows, Bc = detail::kFlashCols;
      const std::int64_t grp = H / KV, qs = H * hd, ks = KV * hd;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* O = static_cast<const T*>(out.raw());
      const T* L = static_cast<const T*>(lse.raw());
      const T* G = static_cast<const T*>(g.raw());
      T* D = static_cast<T*>(delta.raw());
      T* GQ = gq ? static_cast<T*>(gq->raw()) : nullptr;
      T* GK = gk ? static_cast<T*>(gk->raw()) : nullptr;
      T* GV = gv ? static_cast<T*>(gv->raw()) : nullptr;
      detail::share_grad_buffers(gq, acc_q, gk, acc_k, gv, acc_v);
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      const bool wide = Bn * H * T_ * (causal ? T_ / 2 + 1 : T_) * hd > detail::kParallelGrain;
      detail::parallel_for(Bn * H * T_, Bn * H * T_ * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / (H * T_), h = t / T_ % H, i = t % T_, o = (b * T_ + i) * qs + h * hd;
        D[t] = (detail::ConstArrayMap<T>(G + o, hd) * detail::ConstArrayMap<T>(O + o, hd)).sum();  // t = (b, h, i)
      });
      detail::parallel_for(Bn * KV, wide, [&](std::int64_t t) {
        const std::int64_t b = t / KV, kh = t % KV;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* p = static_cast<T*>(detail::gemm_workspace(sizeof(T) * 2 * Br * Bc, 2));  // a tile's probabilities (r, c)
        T* ds = p + Br * Bc;                                                           // and score gradients
        for (std::int64_t j0 = 0; j0 < T_; j0 += Bc) {
          const std::int64_t c = std::min(T_, j0 + Bc) - j0;
          bool first_k = !acc_k, first_v = !acc_v;  // the first write to this key block overwrites
          for (std::int64_t jh = 0; jh < grp; ++jh) {
            const std::int64_t h = kh * grp + jh, bh = b * H + h;
            // causal: the first query block holding a row that sees key j0
            for (std::int64_t i0 = causal ? j0 / Br * Br : 0; i0 < T_; i0 += Br) {
              const std::int64_t r = std::min(T_, i0 + Br) - i0, o = (b * T_ + i0) * qs + h * hd;
              detail::gemm_serial<T>(false, true, r, c, hd, Q + o, qs, kt + j0 * ks, ks, p, Bc, false);  // q k^T
              for (std::int64_t i = 0; i < r; ++i) {
                const std::int64_t n = causal ? std::clamp<std::int64_t>(i0 + i + 1 - j0, 0, c) : c;
                detail::ArrayMap<T> row(p + i * Bc, c);
                row.head(n) = row.head(n) * sc - L[bh * T_ + i0 + i];
                detail::exp_inplace(p + i * Bc, n);
                row.tail(c - n).setZero();
              }
              if (GV) detail::gemm_serial<T>(true, false, c, hd, r, p, Bc, G + o, qs, GV + (b * T_ + j0) * ks + kh * hd,
                                             ks, !first_v);  // p^T g
              first_v = false;
              if (!GQ && !GK) continue;
              detail::gemm_serial<T>(false, true, r, c, hd, G + o, qs, vt + j0 * ks, ks, ds, Bc, false);  // g v^T
              for (std::int64_t i = 0; i < r; ++i) {
                detail::ArrayMap<T> d(ds + i * Bc, c);
                d = detail::ConstArrayMap<T>(p + i * Bc, c) * (d - D[bh * T_ + i0 + i]) * sc;
              }
              if (GQ) detail::gemm_serial<T>(false, false, r, hd, c, ds, Bc, kt + j0 * ks, ks, GQ + o, qs,
                                             acc_q || j0 > 0);  // ds k (query block i0 meets key block 0 first)
              if (GK) detail::gemm_serial<T>(true, false, c, hd, r, ds, Bc, Q + o, qs, GK + (b * T_ + j0) * ks + kh * hd,
                                             ks, !first_k);  // ds^T q
              first_k = false;
            }
          }
        }
      }, /*uneven=*/causal);
    });
  }

  /// y = silu(gate) * up = gate * sigmoid(gate) * up.
  static void swiglu(const Tensor& gate, const Tensor& up, Tensor& y) {
    detail::dispatch_float(y.dtype(), "swiglu", [&]<class T>() {
      const T* gs = static_cast<const T*>(gate.raw());
      const T* us = static_cast<const T*>(up.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_chunks(y.numel(), [&](std::int64_t i0, std::int64_t i1) {
        detail::ConstArrayMap<T> a(gs + i0, i1 - i0), u(us + i0, i1 - i0);
        detail::ArrayMap<T>(ys + i0, i1 - i0) = (a * (T(1) / (T(1) + (-a).exp()))) * u;
      });
    });
  }

  /// The vjp of swiglu: ggate (+)= g up s (1 + gate (1 - s)), gup (+)= g gate s, s = sigmoid(gate).
  static void swiglu_vjp(const Tensor& gate, const Tensor& up, const Tensor& g, Tensor* ggate, bool acc_gate,
                         Tensor* gup, bool acc_up) {
    detail::dispatch_float(g.dtype(), "swiglu", [&]<class T>() {
      const T* as = static_cast<const T*>(gate.raw());
      const T* us = static_cast<const T*>(up.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* da = ggate ? static_cast<T*>(ggate->raw()) : nullptr;
      T* du = gup ? static_cast<T*>(gup->raw()) : nullptr;
      detail::parallel_chunks(g.numel(), [&](std::int64_t i0, std::int64_t i1) {
        const std::int64_t n = i1 - i0;
        detail::ConstArrayMap<T> a(as + i0, n), u(us + i0, n), gr(gs + i0, n);
        alignas(64) T sbuf[detail::kChunk];  // on the stack: a replay allocates nothing
        detail::ArrayMap<T> s(sbuf, n);
        s = T(1) / (T(1) + (-a).exp());
        if (da) {
          detail::ArrayMap<T> o(da + i0, n);
          if (acc_gate) o += (gr * u) * (s * (T(1) + a * (T(1) - s)));
          else o = (gr * u) * (s * (T(1) + a * (T(1) - s)));
        }
        if (du) {
          detail::ArrayMap<T> o(du + i0, n);
          if (acc_up) o += gr * (a * s);
          else o = gr * (a * s);
        }
      });
    });
  }

  // ---- optimizer updates: one fused pass per parameter, MLX's arithmetic order -------------
  // lr is a 0-D float64 tensor and step a 0-D int64 tensor, read at run time, so a replayed
  // step sees a scheduled learning rate without re-recording. T is the parameter's dtype; lr is
  // rounded to T first, as MLX's learning_rate.astype(gradient.dtype).

  /// SGD (MLX): g += wd p; no momentum: p -= lr g; else v = mu v + (1 - tau) g (tau = 0: + g),
  /// update = nesterov ? g + mu v : v; p -= lr update.
  static void sgd_update(Tensor& p, const Tensor& g, Tensor& v, const Tensor& lr, double momentum, double dampening,
                         double wd, bool nesterov) {
    detail::dispatch_float(p.dtype(), "sgd", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* vs = momentum > 0 ? static_cast<T*>(v.raw()) : nullptr;
      const T l = static_cast<T>(lr.item()), mu = static_cast<T>(momentum), d = static_cast<T>(1 - dampening),
              w = static_cast<T>(wd);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        T gi = wd != 0 ? gs[i] + w * ps[i] : gs[i];
        if (!vs) {
          ps[i] = ps[i] - l * gi;
          return;
        }
        T vi = mu * vs[i];
        vi += dampening > 0 ? d * gi : gi;
        vs[i] = vi;
        ps[i] = ps[i] - l * (nesterov ? gi + mu * vi : vi);
      });
    });
  }

  /// Adam / AdamW (MLX): decoupled_wd > 0 first p *= 1 - lr wd (AdamW); m = b1 m + (1-b1) g;
  /// v = b2 v + (1-b2) g^2; p -= lr m / (sqrt v + eps), or with bias correction
  /// p -= (lr / (1 - b1^t)) m / (sqrt(v) rsqrt(1 - b2^t) + eps), t = step (already incremented).
  static void adam_update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const Tensor& lr, const Tensor& step,
                          double b1, double b2, double eps, double decoupled_wd, bool bias_correction) {
    detail::dispatch_float(p.dtype(), "adam", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* ms = static_cast<T*>(m.raw());
      T* vs = static_cast<T*>(v.raw());
      // 1 - b is formed in double and then rounded, as MLX's Python scalars are (in float32,
      // T(1) - T(0.999) is 1.3e-5 away from T(0.001)).
      const T l = static_cast<T>(lr.item()), B1 = static_cast<T>(b1), B2 = static_cast<T>(b2), E = static_cast<T>(eps),
              C1 = static_cast<T>(1 - b1), C2 = static_cast<T>(1 - b2);
      const T decay = T(1) - l * static_cast<T>(decoupled_wd);
      const T t = static_cast<T>(step.item());
      const T c1 = bias_correction ? l / (T(1) - std::pow(B1, t)) : l;
      const T c2 = bias_correction ? T(1) / std::sqrt(T(1) - std::pow(B2, t)) : T(1);
      const std::int64_t n = p.numel();
      // The same arithmetic per element as written out elementwise, as Eigen array passes over
      // cache-sized chunks (vectorised), the square root by sqrt_exact (correctly rounded).
      detail::parallel_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
        const std::int64_t len = i1 - i0;
        detail::ArrayMap<T> pa(ps + i0, len), ma(ms + i0, len), va(vs + i0, len);
        detail::ConstArrayMap<T> ga(gs + i0, len);
        alignas(64) T root[detail::kChunk];
        ma = B1 * ma + C1 * ga;
        va = B2 * va + C2 * (ga * ga);
        detail::sqrt_exact(vs + i0, root, len);
        detail::ConstArrayMap<T> ra(root, len);
        if (decoupled_wd != 0) pa *= decay;
        if (bias_correction) pa -= (c1 * ma) / (ra * c2 + E);
        else pa -= (l * ma) / (ra + E);
      });
    });
  }

  /// Lion (MLX): c = b1 m + (1-b1) g; m = b2 m + (1-b2) g; wd > 0: p *= 1 - lr wd; p -= lr sign(c).
  static void lion_update(Tensor& p, const Tensor& g, Tensor& m, const Tensor& lr, double b1, double b2, double wd) {
    detail::dispatch_float(p.dtype(), "lion", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* ms = static_cast<T*>(m.raw());
      const T l = static_cast<T>(lr.item()), B1 = static_cast<T>(b1), B2 = static_cast<T>(b2),
              C1 = static_cast<T>(1 - b1), C2 = static_cast<T>(1 - b2);  // 1 - b in double, as MLX
      const T decay = T(1) - l * static_cast<T>(wd);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        T c = B1 * ms[i] + C1 * gs[i];
        ms[i] = B2 * ms[i] + C2 * gs[i];
        T pi = wd > 0 ? decay * ps[i] : ps[i];
        T sg = c > T(0) ? T(1) : (c < T(0) ? T(-1) : T(0));
        ps[i] = pi - l * sg;
      });
    });
  }

  /// Muon's momentum (MLX): g += wd p; v = mu v + (1-mu) g; u = nesterov ? (1-mu) g + mu v : v.
  static void muon_momentum(const Tensor& p, const Tensor& g, Tensor& v, Tensor& u, double momentum, double wd,
                            bool nesterov) {
    detail::dispatch_float(p.dtype(), "muon", [&]<class T>() {
      const T* ps = static_cast<const T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* vs = static_cast<T*>(v.raw());
      T* us = static_cast<T*>(u.raw());
      const T mu = static_cast<T>(momentum), w = static_cast<T>(wd), c = static_cast<T>(1 - momentum);  // as MLX
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        T gi = wd != 0 ? gs[i] + w * ps[i] : gs[i];
        T vi = mu * vs[i] + c * gi;
        vs[i] = vi;
        us[i] = nesterov ? gi * c + vi * mu : vi;
      });
    });
  }

  /// sum of x^2 in double (the global norm of clip_grad_norm).
  static double sum_squares(const Tensor& x) {
    double s = 0;
    detail::dispatch_float(x.dtype(), "sum_squares", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      for (std::int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(xs[i]) * static_cast<double>(xs[i]);
    });
    return s;
  }

  /// y = a x + b y (elementwise; the Newton-Schulz steps of Muon).
  static void axpby(double a, const Tensor& x, double b, Tensor& y) {
    detail::dispatch_float(y.dtype(), "axpby", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T A = static_cast<T>(a), Bv = static_cast<T>(b);
      const std::int64_t n = y.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { ys[i] = A * xs[i] + Bv * ys[i]; });
    });
  }

  /// x /= (||x||_F + eps) (Muon's normalisation before Newton-Schulz).
  static void normalize_frobenius(Tensor& x, double eps) {
    detail::dispatch_float(x.dtype(), "normalize", [&]<class T>() {
      T* xs = static_cast<T*>(x.raw());
      const std::int64_t n = x.numel();
      T ss = 0;
      for (std::int64_t i = 0; i < n; ++i) ss += xs[i] * xs[i];
      const T d = std::sqrt(ss) + static_cast<T>(eps);
      for (std::int64_t i = 0; i < n; ++i) xs[i] = xs[i] / d;
    });
  }

  /// p -= (lr * factor) x, lr a 0-D tensor rounded to p's dtype before the factor (MLX order).
  static void apply_update(Tensor& p, const Tensor& x, const Tensor& lr, double factor) {
    detail::dispatch_float(p.dtype(), "update", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* xs = static_cast<const T*>(x.raw());
      const T l = static_cast<T>(static_cast<T>(lr.item()) * static_cast<T>(factor));
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { ps[i] = ps[i] - l * xs[i]; });
    });
  }

 private:
  static bool is_suffix(const Shape& b, const Shape& y) {
    if (b.rank() > y.rank()) return false;
    for (int i = 1; i <= b.rank(); ++i)
      if (b[b.rank() - i] != y[y.rank() - i]) return false;
    return true;
  }
  static bool mask_at(const Tensor& m, std::int64_t i) {
    switch (m.dtype()) {
      case DType::u8: return static_cast<const std::uint8_t*>(m.raw())[i] != 0;
      case DType::f32: return static_cast<const float*>(m.raw())[i] != 0.0f;
      case DType::f64: return static_cast<const double*>(m.raw())[i] != 0.0;
      case DType::i32: return static_cast<const std::int32_t*>(m.raw())[i] != 0;
      default: return detail::load_as_double(m.raw(), m.dtype(), i) != 0.0;
    }
  }

  /// One row or one column (a batch-1 Linear, a projection to one output) streams the matrix
  /// once: a packed GEMM would copy all of it first. Tiny products stay with coefficient loops.
  static bool gemm_vector_like(std::int64_t M, std::int64_t N, std::int64_t K) {
    return M == 1 || N == 1 || M + N + K < EIGEN_GEMM_TO_COEFFBASED_THRESHOLD;
  }

  /// One row-major GEMM: C[M,N] (+)= op(A) @ op(B), lda/ldb = the stored row lengths.
  template <class T>
  static void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
                   const T* Bp, std::int64_t ldb, T* C, bool acc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
      if (!acc) std::fill_n(C, M * N, T(0));
      return;
    }
    const detail::GemmEngine engine = detail::gemm_choice().engine;
    const bool vector_like = gemm_vector_like(M, N, K);
#if defined(NN_USE_BLAS)
    if (engine == detail::GemmEngine::blas && (M == 1 || N == 1)) {
      // ?gemv: OpenBLAS 0.3.21's ?gemm is 3-4x slower on these shapes and its small-matrix kernel
      // mallocs on each call. C is zeroed here rather than by beta = 0, so stale NaNs in an
      // uninitialised output never leak through a BLAS that scales by beta.
      if (!acc) std::fill_n(C, M * N, T(0));
      auto gemv = [&](bool trans, std::int64_t rows, std::int64_t cols, const T* mat, std::int64_t ld, const T* x,
                      std::int64_t incx) {
        const auto t = trans ? CblasTrans : CblasNoTrans;
        if constexpr (std::is_same_v<T, float>)
          cblas_sgemv(CblasRowMajor, t, static_cast<int>(rows), static_cast<int>(cols), 1.0f, mat, static_cast<int>(ld),
                      x, static_cast<int>(incx), 1.0f, C, 1);
        else
          cblas_dgemv(CblasRowMajor, t, static_cast<int>(rows), static_cast<int>(cols), 1.0, mat, static_cast<int>(ld),
                      x, static_cast<int>(incx), 1.0, C, 1);
      };
      if (N == 1) gemv(ta, ta ? K : M, ta ? M : K, A, lda, Bp, tb ? 1 : ldb);       // C = op(A) b
      else gemv(!tb, tb ? N : K, tb ? K : N, Bp, ldb, A, ta ? lda : 1);             // C^T = op(B)^T a^T
      return;
    }
    if (engine == detail::GemmEngine::blas) {
#if defined(OPENBLAS_VERSION) && defined(_OPENMP)
      // nn splits a product over its own OpenMP threads, each block one OpenBLAS call on its
      // thread: OpenBLAS's pthreads would otherwise spin-wait beside OpenMP's after every product
      // and take the cores nn's elementwise kernels run on (the two-runtime slowdown in
      // shared/REFERENCE-FACTS.md). OpenBLAS's own rule for going parallel (m n k > 64^3) and at
      // least 16 rows (or columns) per thread.
      int threads = 1;
      if (!omp_in_parallel()) {
        const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
        threads = static_cast<int>(std::min<double>({static_cast<double>(omp_get_max_threads()), work / 262144.0,
                                                     static_cast<double>(std::max(M, N) / 16)}));
      }
      detail::BlasSerial serial;
      if (threads > 1) {
        const bool by_rows = M >= N;
        const std::int64_t D = by_rows ? M : N;
#pragma omp parallel num_threads(threads)
        {
          const std::int64_t nt = omp_get_num_threads(), t = omp_get_thread_num();
          const std::int64_t per = ((D + nt - 1) / nt + 15) / 16 * 16;
          const std::int64_t d0 = std::min(D, t * per), d1 = std::min(D, d0 + per);
          if (d0 < d1) {
            if (by_rows) detail::gemm_serial<T>(ta, tb, d1 - d0, N, K, A + (ta ? d0 : d0 * lda), lda, Bp, ldb, C + d0 * N, N, acc);
            else detail::gemm_serial<T>(ta, tb, M, d1 - d0, K, A, lda, Bp + (tb ? d0 * ldb : d0), ldb, C + d0, N, acc);
          }
        }
        return;
      }
#endif
      detail::gemm_serial<T>(ta, tb, M, N, K, A, lda, Bp, ldb, C, N, acc);
      return;
    }
#endif
#if defined(NN_OWN_GEMM)
    if (engine == detail::GemmEngine::nn && !vector_like) {
      ::nn::gemm::gemm_parallel<T>(::nn::gemm::active_isa(), ta, tb, M, N, K, A, lda, Bp, ldb, C, N, acc);
      return;
    }
#endif
#if EIGEN_VERSION_AT_LEAST(3, 3, 90)
    // Eigen's kernel with nn's reusable packing space (no allocation per call)
    if (!vector_like) {
      detail::eigen_gemm<T>(ta, tb, M, N, K, A, lda, Bp, ldb, C, acc);
      return;
    }
#endif
    // vectors (GEMV) and tiny products: Eigen's expressions, which do not allocate for them
    using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using CMap = Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>>;
    Eigen::Map<Mat> Cm(C, M, N);
    CMap Am(A, ta ? K : M, ta ? M : K, Eigen::OuterStride<>(lda));
    CMap Bm(Bp, tb ? N : K, tb ? K : N, Eigen::OuterStride<>(ldb));
    auto run = [&](const auto& a, const auto& b) {
      if (acc) Cm.noalias() += a * b;
      else Cm.noalias() = a * b;
    };
    if (ta && tb) run(Am.transpose(), Bm.transpose());
    else if (ta) run(Am.transpose(), Bm);
    else if (tb) run(Am, Bm.transpose());
    else run(Am, Bm);
  }
};


static_assert(BackendPolicy<cpu>);

/// What this CPU offers and which GEMM nn runs on it (declared in backend/cpu_info.hpp), read
/// once per process. The finetune example and every bench print cpu_info().line() first.
inline const CpuInfo& cpu_info() {
  static const CpuInfo info = [] {
    CpuInfo i;
    i.features = detail::detect_cpu_features();
    const detail::GemmChoice& g = detail::gemm_choice();
    i.note = g.note;
#if defined(NN_OWN_GEMM)
    i.isa = gemm::active_isa();
    if (g.engine == detail::GemmEngine::nn) {
      i.gemm = gemm::describe(i.isa);
      i.gemm_id = std::string("nn-") + isa_name(i.isa);
    }
#endif
    i.bf16 = detail::gemm_bf16_kernel();
    if (g.engine == detail::GemmEngine::blas) i.gemm = "CBLAS", i.gemm_id = "cblas";
    if (g.engine == detail::GemmEngine::eigen) i.gemm = "Eigen's GEMM", i.gemm_id = "eigen";
    return i;
  }();
  return info;
}

}  // namespace nn
