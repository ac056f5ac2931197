// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's matrix products: the GEMM engine choice (nn's own kernels by CPU features, CBLAS,
// or Eigen's kernel with reusable packing space), gemm_serial for kernels that run many
// products from their own parallel loops, and the batched matmul kernel (ops/matmul.hpp).
#pragma once

#if defined(NN_USE_BLAS)
#include <cblas.h>
#endif

#include "common.hpp"
#include "../gemm.hpp"
#include "../gemv.hpp"

namespace nn {

namespace detail {

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
    threads = std::min<Eigen::Index>({static_cast<Eigen::Index>(std::min(Eigen::nbThreads(), free_threads())),
                                      static_cast<Eigen::Index>(work / 50000.0), std::max(M, N) / 16});
  }
  if (threads > 1) {
    const bool by_rows = M >= N;
    const Eigen::Index D = by_rows ? M : N;
    team(static_cast<int>(threads), [&](int thread, int team_size) {
      const Eigen::Index nt = team_size, t = thread;
      const Eigen::Index per = ((D + nt - 1) / nt + 15) / 16 * 16;
      const Eigen::Index d0 = std::min(D, t * per), d1 = std::min(D, d0 + per);
      if (d0 < d1) {
        if (by_rows) block(d0, d1, 0, N);
        else block(0, M, d0, d1);
      }
    });
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

}  // namespace detail

namespace cpu_kernels {

// A class template with one instance, `MatmulKernels` (why: backend/cpu.hpp).
template <class = void>
struct MatmulKernelsT {
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

 private:
  /// One row or one column (a batch-1 Linear, a projection to one output) streams the matrix
  /// once: a packed GEMM would copy all of it first. Tiny products stay with coefficient loops.
  static bool gemm_vector_like(std::int64_t M, std::int64_t N, std::int64_t K) {
    return M == 1 || N == 1 || M + N + K < EIGEN_GEMM_TO_COEFFBASED_THRESHOLD;
  }

 public:
  /// One row-major GEMM: C[M,N] (+)= op(A) @ op(B), lda/ldb = the stored row lengths (also the
  /// products of linear_cross_entropy's vocabulary blocks).
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
        threads = static_cast<int>(std::min<double>({static_cast<double>(detail::free_threads()), work / 262144.0,
                                                     static_cast<double>(std::max(M, N) / 16)}));
      }
      detail::BlasSerial serial;
      if (threads > 1) {
        const bool by_rows = M >= N;
        const std::int64_t D = by_rows ? M : N;
        detail::team(threads, [&](int thread, int team_size) {
          const std::int64_t nt = team_size, t = thread;
          const std::int64_t per = ((D + nt - 1) / nt + 15) / 16 * 16;
          const std::int64_t d0 = std::min(D, t * per), d1 = std::min(D, d0 + per);
          if (d0 < d1) {
            if (by_rows) detail::gemm_serial<T>(ta, tb, d1 - d0, N, K, A + (ta ? d0 : d0 * lda), lda, Bp, ldb, C + d0 * N, N, acc);
            else detail::gemm_serial<T>(ta, tb, M, d1 - d0, K, A, lda, Bp + (tb ? d0 * ldb : d0), ldb, C + d0, N, acc);
          }
        });
        return;
      }
#endif
      detail::gemm_serial<T>(ta, tb, M, N, K, A, lda, Bp, ldb, C, N, acc);
      return;
    }
#endif
#if defined(NN_OWN_GEMM)
    if (engine == detail::GemmEngine::nn && ::nn::gemm::gemv_applies(ta, tb, M, N)) {  // gemv.hpp
      ::nn::gemm::gemv_product<T>(::nn::gemm::active_isa(), ta, tb, M, N, K, A, lda, Bp, ldb, C, acc);
      return;
    }
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
    // tiny products (and vectors, on the Eigen engine): Eigen's expressions, which do not allocate
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
using MatmulKernels = MatmulKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
