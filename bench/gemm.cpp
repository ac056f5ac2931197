// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's GEMM engine on the products a training step really runs -- the reference decoder's layer
// products, its 8192-wide head, the SmolLM2 finetune's 576-wide products and 49152-wide tied head,
// attention's per-head blocks, the transposed forms backward uses, and one-token products (nn's
// GEMV, beside Eigen's and OpenBLAS's sgemv) -- under every kernel set this
// CPU can run, beside OpenBLAS's sgemm on the same operands (when linked). Prints one markdown
// table per thread count, with the CPU line first. OpenBLAS runs the kernels it chose for this CPU;
// OPENBLAS_CORETYPE=SkylakeX (or Haswell) in the environment shows it with a kernel forced.
//
// The other candidates for nn's products are measured beside them where installed, with no build
// dependency: oneDNN's dnnl_sgemm (Debian libdnnl-dev, the library PyTorch uses on CPUs) and
// BLIS's sgemm_ (libblis-dev; BLIS picks its kernels by CPUID family, printed) are loaded with
// dlopen; libxsmm (libxsmm-dev, static only) is linked when CMake finds it and times its JIT
// kernels on the small products (M*N*K <= 64^3), the job it is built for. float32 only.
//
// Usage: bench_gemm [--threads 1,2] [--seconds S] [--rounds R] [--f64]
// Each figure is the median over R interleaved rounds (each at least S seconds of calls), so a
// 2-vCPU VM's drift falls on all engines alike.
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "common.hpp"

#if defined(NN_BENCH_CBLAS) && !defined(NN_USE_BLAS)
#include <cblas.h>
#endif
#if defined(__linux__)
#include <dlfcn.h>
#endif
#if defined(NN_BENCH_LIBXSMM)
#include <libxsmm.h>
#endif

namespace {

struct Case {
  const char* what;
  std::int64_t M, N, K;
  bool ta, tb;
};

// (M, N, K): C[M x N] = op(A)[M x K] op(B)[K x N]. A Linear y = x W^T is (tokens, out, in) with
// tb; its backward is dX = dY W (tokens, in, out) and dW = dY^T X (out, in, tokens) with ta.
const Case kCases[] = {
    {"decoder q/o proj fwd", 1024, 256, 256, false, true},
    {"decoder k/v proj fwd", 1024, 64, 256, false, true},
    {"decoder mlp up fwd", 1024, 704, 256, false, true},
    {"decoder mlp down fwd", 1024, 256, 704, false, true},
    {"decoder mlp down dX", 1024, 704, 256, false, false},
    {"decoder mlp up dW", 704, 256, 1024, true, false},
    {"decoder head fwd (8192)", 1024, 8192, 256, false, true},
    {"decoder head dX", 1024, 256, 8192, false, false},
    {"decoder head dW", 8192, 256, 1024, true, false},
    {"attn q k^T block (hd 32)", 32, 256, 32, false, true},
    {"attn P v block (hd 32)", 32, 32, 256, false, false},
    {"smollm2 q/o proj fwd", 256, 576, 576, false, true},
    {"smollm2 k/v proj fwd", 256, 192, 576, false, true},
    {"smollm2 mlp up fwd", 256, 1536, 576, false, true},
    {"smollm2 mlp down fwd", 256, 576, 1536, false, true},
    {"smollm2 mlp dX", 256, 1536, 576, false, false},
    {"smollm2 head fwd (49152)", 256, 49152, 576, false, true},
    {"smollm2 head dX", 256, 576, 49152, false, false},
    {"attn q k^T block (hd 64)", 32, 64, 64, false, true},
    // LoRA (rank 8) over a 576-wide projection: y = x A B, A (in, r), B (r, out) as mlx-lm's
    {"smollm2 LoRA dB = (xA)^T dY", 8, 576, 256, true, false},
    {"smollm2 LoRA dA = x^T d(xA)", 576, 8, 256, true, false},
    // one token (decoding, a batch of one): nn's GEMV (backend/gemv.hpp), not the packed GEMM
    {"1 token smollm2 q/o proj", 1, 576, 576, false, true},
    {"1 token smollm2 mlp up", 1, 1536, 576, false, true},
    {"1 token smollm2 mlp down", 1, 576, 1536, false, true},
    {"1 token smollm2 head (49152)", 1, 49152, 576, false, true},
    {"1 token x @ W (576 x 1536)", 1, 1536, 576, false, false},
    {"1 token x @ W (head^T)", 1, 576, 49152, false, false},
};

// ---- the other candidates ----------------------------------------------------------------
// Each is a row-major sgemm C = op(A) op(B) (beta 0) or absent. The libraries are opened with
// RTLD_DEEPBIND so their BLAS symbols (BLIS's sgemm_) resolve inside them, not to OpenBLAS's.
struct Candidate {
  std::string name, detail;
  std::function<bool(const Case&, const float*, std::int64_t, const float*, std::int64_t, float*)> run;  // false: n/a
  std::function<void(int)> set_threads;
};

void* open_library(const char* soname) {
#if defined(__linux__)
  return dlopen(soname, RTLD_NOW | RTLD_LOCAL | RTLD_DEEPBIND);
#else
  (void)soname;
  return nullptr;
#endif
}

template <class F>
F symbol(void* lib, const char* name) {
#if defined(__linux__)
  return lib ? reinterpret_cast<F>(dlsym(lib, name)) : nullptr;
#else
  (void)lib, (void)name;
  return nullptr;
#endif
}

std::vector<Candidate> other_candidates() {
  std::vector<Candidate> out;
  // oneDNN: dnnl_status_t dnnl_sgemm(char transa, char transb, dnnl_dim_t M, N, K, float alpha, const float* A,
  // dnnl_dim_t lda, const float* B, dnnl_dim_t ldb, float beta, float* C, dnnl_dim_t ldc), row-major; it
  // threads on the process's OpenMP runtime (libgomp, as nn).
  using DnnlSgemm = int (*)(char, char, std::int64_t, std::int64_t, std::int64_t, float, const float*, std::int64_t,
                            const float*, std::int64_t, float, float*, std::int64_t);
  struct DnnlVersion {
    int major, minor, patch;
    const char* hash;
    unsigned cpu_runtime, gpu_runtime;
  };
  void* dnnl = open_library("libdnnl.so.2");
  if (auto f = symbol<DnnlSgemm>(dnnl, "dnnl_sgemm")) {
    std::string ver;
    if (auto v = symbol<const DnnlVersion* (*)()>(dnnl, "dnnl_version"))
      ver = std::to_string(v()->major) + "." + std::to_string(v()->minor) + "." + std::to_string(v()->patch);
    out.push_back({"oneDNN", "oneDNN " + ver + " (dnnl_sgemm; kernels by its own CPUID dispatch)",
                   [f](const Case& c, const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float* C) {
                     return f(c.ta ? 'T' : 'N', c.tb ? 'T' : 'N', c.M, c.N, c.K, 1.0f, A, lda, B, ldb, 0.0f, C, c.N) ==
                            0;
                   },
                   [](int) {}});
  }
  // BLIS: the Fortran BLAS interface (column-major, 32-bit ints): row-major C = op(A) op(B) is
  // column-major C^T = op(B)^T op(A)^T, so B goes first.
  using F77Sgemm = void (*)(const char*, const char*, const int*, const int*, const int*, const float*, const float*,
                            const int*, const float*, const int*, const float*, float*, const int*);
  void* blis = open_library("libblis.so.4");
  if (auto f = symbol<F77Sgemm>(blis, "sgemm_")) {
    std::string arch = "?";
    auto query = symbol<int (*)()>(blis, "bli_arch_query_id");
    auto name = symbol<const char* (*)(int)>(blis, "bli_arch_string");
    if (query && name) arch = name(query());
    auto threads = symbol<void (*)(std::int64_t)>(blis, "bli_thread_set_num_threads");
    out.push_back({"BLIS", "BLIS (sgemm_; kernels for " + arch + ")",
                   [f](const Case& c, const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float* C) {
                     const int m = static_cast<int>(c.N), n = static_cast<int>(c.M), k = static_cast<int>(c.K);
                     const int la = static_cast<int>(ldb), lb = static_cast<int>(lda), lc = static_cast<int>(c.N);
                     const float one = 1, zero = 0;
                     f(c.tb ? "T" : "N", c.ta ? "T" : "N", &m, &n, &k, &one, B, &la, A, &lb, &zero, C, &lc);
                     return true;
                   },
                   [threads](int t) {
                     if (threads) threads(t);
                   }});
  }
  // Eigen's matrix-vector expressions: what nn ran for one-row products before its GEMV, here
  // built -march=native (a user's build without -march got SSE2 from them).
  out.push_back({"Eigen", "Eigen " + std::to_string(EIGEN_WORLD_VERSION) + "." + std::to_string(EIGEN_MAJOR_VERSION) +
                              "." + std::to_string(EIGEN_MINOR_VERSION) + " (one-row products only; " +
                              Eigen::SimdInstructionSetsInUse() + ")",
                 [](const Case& c, const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float* C) {
                   if (c.M != 1 || c.ta) return false;
                   using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
                   Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>> a(A, 1, c.K, Eigen::OuterStride<>(lda));
                   Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>> b(B, c.tb ? c.N : c.K, c.tb ? c.K : c.N,
                                                                                   Eigen::OuterStride<>(ldb));
                   Eigen::Map<Mat> y(C, 1, c.N);
                   if (c.tb) y.noalias() = a * b.transpose();
                   else y.noalias() = a * b;
                   return true;
                 },
                 [](int) {}});
#if defined(NN_BENCH_LIBXSMM)
  // libxsmm: one JIT kernel per shape (column-major, as BLIS above); single-threaded by design.
  out.push_back({"libxsmm", "libxsmm " LIBXSMM_VERSION " (JIT small products, 1 thread)",
                 [](const Case& c, const float* A, std::int64_t lda, const float* B, std::int64_t ldb, float* C) {
                   if (c.M * c.N * c.K > 64 * 64 * 64) return false;
                   const libxsmm_blasint m = c.N, n = c.M, k = c.K, la = ldb, lb = lda, lc = c.N;
                   const int flags = (c.tb ? LIBXSMM_GEMM_FLAG_TRANS_A : 0) | (c.ta ? LIBXSMM_GEMM_FLAG_TRANS_B : 0);
                   const float one = 1, zero = 0;
                   const libxsmm_smmfunction fn = libxsmm_smmdispatch(m, n, k, &la, &lb, &lc, &one, &zero, &flags, nullptr);
                   if (!fn) return false;
                   fn(B, A, C);
                   return true;
                 },
                 [](int) {}});
#endif
  return out;
}

double seconds_now() {
  return std::chrono::duration<double>(std::chrono::steady_clock::now().time_since_epoch()).count();
}

/// Calls per second of fn over at least `secs` (after one warm-up call).
double rate(const std::function<void()>& fn, double secs) {
  fn();
  const double t0 = seconds_now();
  long n = 0;
  double el = 0;
  do {
    fn();
    ++n;
    el = seconds_now() - t0;
  } while (el < secs);
  return static_cast<double>(n) / el;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0 : v[v.size() / 2];
}

std::vector<int> parse_list(const char* s) {
  std::vector<int> out;
  for (const char* p = s; *p;) {
    out.push_back(std::atoi(p));
    while (*p && *p != ',') ++p;
    if (*p) ++p;
  }
  return out;
}

/// GFLOP/s of ISA `isa`'s packed micro-kernel alone: one A panel of kc = 384 depths against 12
/// B panels (L2-resident: 576 KB for f32 on AVX-512), C tiles overwritten, no packing and no edge
/// tiles -- the inner loop of block_product, so the products' rows above show what packing,
/// edges and cache misses cost on top of it.
template <class T>
double kernel_alone(nn::Isa isa, double secs) {
  return nn::gemm::with_isa(isa, [&]<nn::Isa I>() {
    using S = nn::gemm::Shape<T, I>;
    constexpr std::int64_t kc = 384, tiles = 12;
    std::vector<T> a(static_cast<std::size_t>(S::MR * kc), T(0.5)), b(static_cast<std::size_t>(kc * S::NR * tiles), T(0.25)),
        c(static_cast<std::size_t>(S::MR * S::NR * tiles));
    const auto kernel = nn::gemm::micro_kernels<T, I>().packed;
    const double calls = rate(
        [&] {
          for (std::int64_t t = 0; t < tiles; ++t)
            kernel(kc, a.data(), 0, b.data() + t * kc * S::NR, S::NR, c.data() + t * S::NR, S::NR * tiles, true);
        },
        secs);
    return 2.0 * S::MR * S::NR * kc * tiles * calls / 1e9;
  });
}

template <class T>
void run_table(int threads, double secs, int rounds, const std::vector<Candidate>& others_all) {
  bench::set_threads(threads);
  const std::vector<Candidate> others = std::is_same_v<T, float> ? others_all : std::vector<Candidate>{};
  for (const Candidate& o : others) o.set_threads(threads);
#if defined(NN_BENCH_CBLAS) && defined(OPENBLAS_VERSION)
  openblas_set_num_threads(threads);
#endif
  const nn::Isa best = nn::cpu_info().features.best_isa();
  std::vector<nn::Isa> isas;
  for (nn::Isa i : {nn::Isa::avx512, nn::Isa::avx2, nn::Isa::generic})
    if (static_cast<int>(i) <= static_cast<int>(best)) isas.push_back(i);
  const bool blas =
#if defined(NN_BENCH_CBLAS)
      true;
#else
      false;
#endif
  std::printf("\n### %s, %d thread%s\n\n| product | M x N x K | ", sizeof(T) == 4 ? "float32" : "float64", threads,
              threads == 1 ? "" : "s");
  for (nn::Isa i : isas) std::printf("nn %s | ", nn::isa_name(i));
  if (blas) std::printf("OpenBLAS | ");
  for (const Candidate& o : others) std::printf("%s | ", o.name.c_str());
  const bool ratio = blas || !others.empty();
  if (ratio) std::printf("nn %s / best other |", nn::isa_name(isas[0]));
  std::printf("\n|---|---|");
  for (std::size_t i = 0; i < isas.size() + (blas ? 1 : 0) + others.size() + (ratio ? 1 : 0); ++i) std::printf("---|");
  std::printf("\n");
  std::mt19937 gen(7);
  std::uniform_real_distribution<double> u(-1, 1);
  for (const Case& c : kCases) {
    std::vector<T> A(static_cast<std::size_t>(c.M * c.K)), B(static_cast<std::size_t>(c.K * c.N)),
        C(static_cast<std::size_t>(c.M * c.N));
    for (T& x : A) x = static_cast<T>(u(gen));
    for (T& x : B) x = static_cast<T>(u(gen));
    const std::int64_t lda = c.ta ? c.M : c.K, ldb = c.tb ? c.K : c.N;
    std::vector<std::function<void()>> engines;
    for (nn::Isa i : isas)
      engines.push_back([&, i] {
        if (c.M == 1 || c.N == 1)  // what the tape's matmul runs for these (backend/cpu/matmul.hpp)
          nn::gemm::gemv_product<T>(i, c.ta, c.tb, c.M, c.N, c.K, A.data(), lda, B.data(), ldb, C.data(), false);
        else
          nn::gemm::gemm_parallel<T>(i, c.ta, c.tb, c.M, c.N, c.K, A.data(), lda, B.data(), ldb, C.data(), c.N, false);
      });
#if defined(NN_BENCH_CBLAS)
    engines.push_back([&] {
      const auto tA = c.ta ? CblasTrans : CblasNoTrans, tB = c.tb ? CblasTrans : CblasNoTrans;
      const int M = static_cast<int>(c.M), N = static_cast<int>(c.N), K = static_cast<int>(c.K);
      if (c.M == 1 && !c.ta) {  // ?gemv, as nn itself calls OpenBLAS for one-row products
        const auto t = c.tb ? CblasNoTrans : CblasTrans;
        const int rows = static_cast<int>(c.tb ? c.N : c.K), cols = static_cast<int>(c.tb ? c.K : c.N);
        if constexpr (sizeof(T) == 4)
          cblas_sgemv(CblasRowMajor, t, rows, cols, 1.0f, B.data(), static_cast<int>(ldb), A.data(), 1, 0.0f, C.data(), 1);
        else
          cblas_dgemv(CblasRowMajor, t, rows, cols, 1.0, B.data(), static_cast<int>(ldb), A.data(), 1, 0.0, C.data(), 1);
        return;
      }
      if constexpr (sizeof(T) == 4)
        cblas_sgemm(CblasRowMajor, tA, tB, M, N, K, 1.0f, A.data(), static_cast<int>(lda), B.data(),
                    static_cast<int>(ldb), 0.0f, C.data(), N);
      else
        cblas_dgemm(CblasRowMajor, tA, tB, M, N, K, 1.0, A.data(), static_cast<int>(lda), B.data(),
                    static_cast<int>(ldb), 0.0, C.data(), N);
    });
#endif
    // a candidate that cannot run this product (libxsmm past its small sizes) gets no engine
    std::vector<bool> runs(engines.size(), true);
    if constexpr (std::is_same_v<T, float>)
      for (const Candidate& o : others) {
        const bool ok = o.run(c, A.data(), lda, B.data(), ldb, C.data());
        runs.push_back(ok);
        engines.push_back([&, ok] {
          if (ok) o.run(c, A.data(), lda, B.data(), ldb, C.data());
        });
      }
    std::vector<std::vector<double>> g(engines.size());
    const double flop = 2.0 * static_cast<double>(c.M) * static_cast<double>(c.N) * static_cast<double>(c.K);
    for (int r = 0; r < rounds; ++r)
      for (std::size_t e = 0; e < engines.size(); ++e)
        if (runs[e]) g[e].push_back(flop * rate(engines[e], secs) / 1e9);
    std::printf("| %s%s%s | %lld x %lld x %lld |", c.what, c.ta ? " (A^T)" : "", c.tb ? " (B^T)" : "",
                static_cast<long long>(c.M), static_cast<long long>(c.N), static_cast<long long>(c.K));
    double best_other = 0;
    for (std::size_t e = 0; e < engines.size(); ++e) {
      if (runs[e]) std::printf(" %.1f |", median(g[e]));
      else std::printf(" - |");
      if (e >= isas.size() && runs[e]) best_other = std::max(best_other, median(g[e]));
    }
    if (ratio) std::printf(" %.2fx |", median(g[0]) / best_other);
    std::printf("\n");
    std::fflush(stdout);
  }
  if (threads == 1) {
    // the micro-kernels alone, and the best of them as a share of the FMA peak (float32)
    std::vector<std::vector<double>> g(isas.size());
    for (int r = 0; r < rounds; ++r)
      for (std::size_t e = 0; e < isas.size(); ++e) g[e].push_back(kernel_alone<T>(isas[e], secs));
    std::printf("| micro-kernel alone (one MR-row A panel x 12 NR-wide B panels in L2) | MR x 12 NR x 384 |");
    for (std::size_t e = 0; e < isas.size(); ++e) std::printf(" %.1f |", median(g[e]));
    for (std::size_t e = 0; e < (blas ? 1 : 0) + others.size(); ++e) std::printf(" - |");
    if (ratio) std::printf(" - |");
    std::printf("\n");
    if constexpr (std::is_same_v<T, float>) {
      const double peak = bench::fma_peak(1);
      std::printf("\nFMA peak (measured, 1 thread): %.1f GFLOP/s; the %s micro-kernel alone reaches %.0f%% of it.\n", peak,
                  nn::isa_name(isas[0]), 100.0 * median(g[0]) / peak);
    }
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> threads{1, 2};
  double secs = 0.1;
  int rounds = 5;
  bool f64 = false;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--seconds") && i + 1 < argc) secs = std::atof(argv[++i]);
    else if (!std::strcmp(argv[i], "--rounds") && i + 1 < argc) rounds = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--f64")) f64 = true;
    else {
      std::fprintf(stderr, "usage: %s [--threads 1,2] [--seconds S] [--rounds R] [--f64]\n", argv[0]);
      return 2;
    }
  }
  bench::print_cpu_info();
#if defined(NN_BENCH_CBLAS) && defined(OPENBLAS_VERSION)
  std::printf("# OpenBLAS: %s(core %s)\n", openblas_get_config(), openblas_get_corename());
#endif
  const std::vector<Candidate> others = other_candidates();
  for (const Candidate& o : others) std::printf("# %s\n", o.detail.c_str());
  std::printf("## nn GEMM engine vs the other candidates, GFLOP/s (median of %d interleaved rounds)\n", rounds);
  for (int t : threads) {
    if (f64) run_table<double>(t, secs, rounds, others);
    else run_table<float>(t, secs, rounds, others);
  }
  return 0;
}
