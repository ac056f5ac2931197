// SPDX-License-Identifier: MIT OR Apache-2.0
// Float32 matmul through nn's tape beside OpenBLAS's cblas_sgemm and Eigen's GEMM called
// directly, at 1 and 2 threads, plus the tape's per-node cost for a chain of tiny ops; prints
// markdown tables for the README.
//
// Usage: bench_matmul [--sizes 256,512,1024,2048] [--threads 1,2] [--chain 10000] [--quick]
//                     [--overhead-only] [--cpu-time]
// Each figure is the median of all timed repetitions after warm-up, taken in three rounds that
// cycle through the engines. Run it on an idle machine; the load average at start and end is
// printed with the results (--cpu-time makes 1-thread figures usable on a busy one).
#include <algorithm>
#include <chrono>
#include <ctime>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include <nn/nn.hpp>

#if defined(NN_BENCH_CBLAS) && !defined(NN_USE_BLAS)
#include <cblas.h>  // nn::cpu includes it itself when it routes matmul to CBLAS
#endif
#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using Clock = std::chrono::steady_clock;

constexpr bool kHaveCblas =
#if defined(NN_BENCH_CBLAS) || defined(NN_USE_BLAS)
    true;
#else
    false;
#endif

const char* nn_gemm_path() { return nn::cpu_info().gemm.c_str(); }

/// Sets the thread count of every engine in the run: OpenBLAS, OpenMP, Eigen.
void set_threads(int n) {
#if (defined(NN_BENCH_CBLAS) || defined(NN_USE_BLAS)) && defined(OPENBLAS_VERSION)
  openblas_set_num_threads(n);
#endif
#if defined(_OPENMP)
  omp_set_num_threads(n);
#endif
  Eigen::setNbThreads(n);
}

/// Spinning worker threads of one runtime (OpenBLAS's pthreads, libgomp's team) slow the other
/// for a while after their last job; a pause between engines lets them go to sleep.
void settle() { std::this_thread::sleep_for(std::chrono::milliseconds(300)); }

std::string loadavg() {
  std::ifstream f("/proc/loadavg");
  std::string a, b, c;
  if (!(f >> a >> b >> c)) return "n/a";
  return a + " " + b + " " + c;
}

std::string cpu_model() {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  while (std::getline(f, line))
    if (line.rfind("model name", 0) == 0) return line.substr(line.find(':') + 2);
  return "unknown CPU";
}

/// --cpu-time: time by the process's CPU clock instead of the wall clock. On a machine shared with
/// other work a single-threaded figure then leaves out the time the process was descheduled
/// (threads > 1 would count spin-waiting too, so use it for --threads 1 only).
bool g_cpu_clock = false;

double now_seconds() {
  if (g_cpu_clock) {
    timespec ts{};
    clock_gettime(CLOCK_PROCESS_CPUTIME_ID, &ts);
    return static_cast<double>(ts.tv_sec) + 1e-9 * static_cast<double>(ts.tv_nsec);
  }
  return std::chrono::duration<double>(Clock::now().time_since_epoch()).count();
}

/// Timings of one call of a measured function, collected over several rounds.
struct Samples {
  std::vector<double> t;
  double median() const {
    std::vector<double> v = t;
    std::sort(v.begin(), v.end());
    const std::size_t n = v.size();
    return n == 0 ? 0.0 : n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
  }
};

/// Appends to `s` the time of `reps` calls of fn (more while under `min_seconds`, at most 200),
/// after `warm` untimed calls.
void sample(Samples& s, const std::function<void()>& fn, int warm, int reps, double min_seconds) {
  for (int i = 0; i < warm; ++i) fn();
  const auto start = Clock::now();
  for (int i = 0; i < 200; ++i) {
    const double t0 = now_seconds();
    fn();
    s.t.push_back(now_seconds() - t0);
    if (i + 1 >= reps && std::chrono::duration<double>(Clock::now() - start).count() >= min_seconds) break;
  }
}

/// Median seconds of one call of fn, sampled in one go (the tape-overhead figures).
double median_seconds(const std::function<void()>& fn, int warm, int min_reps, double min_seconds) {
  Samples s;
  sample(s, fn, warm, min_reps, min_seconds);
  return s.median();
}

nn::Tensor random_matrix(std::int64_t r, std::int64_t c, std::uint64_t seed) {
  nn::Tensor t = nn::Tensor::empty(nn::Shape{r, c}, nn::DType::f32);
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  float* p = t.data<float>();
  for (std::int64_t i = 0; i < r * c; ++i) p[i] = u(rng);
  return t;
}

struct Row {
  int threads;
  std::int64_t n;
  double nn_fwd, blas, eigen, nn_fb, blas_fb;  // GFLOP/s; 0 = not measured
};

std::vector<int> parse_list(const char* s) {
  std::vector<int> v;
  for (const char* p = s; *p;) {
    v.push_back(std::atoi(p));
    p = std::strchr(p, ',');
    if (!p) break;
    ++p;
  }
  return v;
}

/// Every engine is sampled in each of `kRounds` rounds, in turn, and its figure is the median of
/// all its samples: on a machine that other work shares, each engine then sees the same spread
/// of conditions rather than one engine a quiet minute and another a busy one.
constexpr int kRounds = 3;

Row bench_size(int threads, std::int64_t n, double min_seconds) {
  using namespace nn;
  Row r{threads, n, 0, 0, 0, 0, 0};
  const double flop = 2e-9 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n);  // GFLOP
  const int reps = n >= 2048 ? 2 : 4;  // per round
  const double secs = min_seconds / kRounds;
  Tensor A = random_matrix(n, n, 1), B = random_matrix(n, n, 2), G = random_matrix(n, n, 3);
  Tensor Cd = Tensor::empty(Shape{n, n}, DType::f32);
  Tensor GA = Tensor::empty(Shape{n, n}, DType::f32), GB = Tensor::empty(Shape{n, n}, DType::f32);
  const float* a = A.data<float>();
  const float* b = B.data<float>();
  const float* g = G.data<float>();
  float* c = Cd.data<float>();
  float* ga = GA.data<float>();
  float* gb = GB.data<float>();
  const int ni = static_cast<int>(n);

  // The tape: y = a @ b, both trainable, so backward is two more GEMMs (dA = G B^T, dB = A^T G).
  GTape<cpu> tp;
  GVar va = tp.param(A), vb = tp.param(B);
  GVar y = matmul(tp, va, vb);
  tp.backward(y, G);

  Samples blas, blas_fb, nn_fwd, nn_fb, eigen;
  auto run_blas = [&] {
#if defined(NN_BENCH_CBLAS) || defined(NN_USE_BLAS)
    settle();
    sample(blas, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a, ni, b, ni, 0.0f, c, ni);
    }, 1, reps, secs);
    // The same three GEMMs the tape's forward + backward runs: C = AB, dA = G B^T, dB = A^T G.
    sample(blas_fb, [&] {
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, ni, ni, ni, 1.0f, a, ni, b, ni, 0.0f, c, ni);
      cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, ni, ni, ni, 1.0f, g, ni, b, ni, 0.0f, ga, ni);
      cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, ni, ni, ni, 1.0f, a, ni, g, ni, 0.0f, gb, ni);
    }, 1, reps, secs);
#endif
  };
  auto run_nn = [&] {
    settle();
    sample(nn_fwd, [&] { tp.replay_forward(); }, 1, reps, secs);
    sample(nn_fb, [&] {
      tp.replay_forward();
      tp.backward(y, G);
    }, 1, reps, secs);
  };
  auto run_eigen = [&] {
    settle();
    using Mat = Eigen::Matrix<float, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    Eigen::Map<const Mat> Am(a, n, n), Bm(b, n, n);
    Eigen::Map<Mat> Cm(c, n, n);
    sample(eigen, [&] { Cm.noalias() = Am * Bm; }, 1, reps, secs);
  };
  // Engines that share a thread pool run back to back (nn with the one it calls), with a pause
  // whenever the pool changes, so spinning workers of one do not slow the other.
  for (int round = 0; round < kRounds; ++round) {
#if defined(NN_USE_BLAS)
    run_blas();
    run_nn();
    run_eigen();
#else
    run_blas();
    run_eigen();
    run_nn();
#endif
  }
  auto rate = [](double gflop, const Samples& s) { return s.t.empty() ? 0.0 : gflop / s.median(); };
  r.blas = rate(flop, blas);
  r.blas_fb = rate(3 * flop, blas_fb);
  r.nn_fwd = rate(flop, nn_fwd);
  r.nn_fb = rate(3 * flop, nn_fb);
  r.eigen = rate(flop, eigen);
  return r;
}

/// Per-node cost of the tape on ops too small to cost anything themselves: a chain of `len`
/// adds of one-element tensors.
void bench_overhead(int len) {
  using namespace nn;
  Tensor X = Tensor::from<float>(Shape{1}, {0.5f});
  Tensor K = Tensor::from<float>(Shape{1}, {0.25f});
  auto build = [&](GTape<cpu>& tp) {
    GVar v = tp.param(X);
    GVar k = tp.constant(K);
    for (int i = 0; i < len; ++i) v = add(tp, v, k);
    return v;
  };
  // record (each node: allocate its output, run its forward)
  const double t_record = median_seconds([&] {
    GTape<cpu> tp;
    build(tp);
  }, 2, 11, 0.5);
  // backward on a fresh recording each time: the first sweep allocates every gradient buffer
  std::vector<double> first;
  for (int rep = 0; rep < 11; ++rep) {
    GTape<cpu> tp;
    GVar y = build(tp);
    const double t0 = now_seconds();
    tp.backward(y);
    first.push_back(now_seconds() - t0);
  }
  std::sort(first.begin(), first.end());
  const double t_backward_first = first[first.size() / 2];
  // and the steady state: replays reuse every buffer
  GTape<cpu> tp;
  GVar y = build(tp);
  tp.backward(y);
  const double t_backward = median_seconds([&] { tp.backward(y); }, 3, 11, 0.5);
  const double t_replay_fwd = median_seconds([&] { tp.replay_forward(); }, 3, 11, 0.5);
  const double t_replay = median_seconds([&] { tp.replay(); }, 3, 11, 0.5);
  const double check = static_cast<double>(tp.value(y).data<float>()[0]);
  if (std::abs(check - (0.5 + 0.25 * len)) > 1e-2 * len) std::printf("(unexpected chain value %g)\n", check);

  auto ns = [&](double s) { return s * 1e9 / len; };
  std::printf("\n### Tape overhead per node (chain of %d `add`s of 1-element float32 tensors, 1 thread)\n\n", len);
  std::printf("| phase | ns / node |\n|---|---:|\n");
  std::printf("| record (allocate output + forward) | %.0f |\n", ns(t_record));
  std::printf("| first backward (allocates gradient buffers) | %.0f |\n", ns(t_backward_first));
  std::printf("| backward, steady state | %.0f |\n", ns(t_backward));
  std::printf("| replay_forward() | %.0f |\n", ns(t_replay_fwd));
  std::printf("| replay() (forward + backward) | %.0f |\n", ns(t_replay));
}


void print_tables(const std::vector<Row>& rows) {
  std::printf("\n### C = A @ B (GFLOP/s)\n\n");
  std::printf("| n | threads | nn, through the tape | OpenBLAS sgemm | Eigen GEMM | nn / OpenBLAS | nn / Eigen |\n");
  std::printf("|---:|---:|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    if (kHaveCblas)
      std::printf("| %lld | %d | %.1f | %.1f | %.1f | %.2f | %.2f |\n", static_cast<long long>(r.n), r.threads, r.nn_fwd,
                  r.blas, r.eigen, r.nn_fwd / r.blas, r.nn_fwd / r.eigen);
    else
      std::printf("| %lld | %d | %.1f | - | %.1f | - | %.2f |\n", static_cast<long long>(r.n), r.threads, r.nn_fwd,
                  r.eigen, r.nn_fwd / r.eigen);
  }

  std::printf("\n### Forward + backward of C = A @ B through the tape: 3 GEMMs (GFLOP/s)\n\n");
  std::printf("| n | threads | nn replay_forward + backward | OpenBLAS, the same 3 sgemm calls | nn / OpenBLAS |\n");
  std::printf("|---:|---:|---:|---:|---:|\n");
  for (const Row& r : rows) {
    if (kHaveCblas)
      std::printf("| %lld | %d | %.1f | %.1f | %.2f |\n", static_cast<long long>(r.n), r.threads, r.nn_fb, r.blas_fb,
                  r.nn_fb / r.blas_fb);
    else
      std::printf("| %lld | %d | %.1f | - | - |\n", static_cast<long long>(r.n), r.threads, r.nn_fb);
  }
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<int> sizes{256, 512, 1024, 2048}, threads{1, 2};
  double min_seconds = 0.4;
  int chain = 10000;
  for (int i = 1; i < argc; ++i) {
    if (!std::strcmp(argv[i], "--sizes") && i + 1 < argc) sizes = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--threads") && i + 1 < argc) threads = parse_list(argv[++i]);
    else if (!std::strcmp(argv[i], "--quick")) min_seconds = 0.05;
    else if (!std::strcmp(argv[i], "--cpu-time")) g_cpu_clock = true;
    else if (!std::strcmp(argv[i], "--chain") && i + 1 < argc) chain = std::atoi(argv[++i]);
    else if (!std::strcmp(argv[i], "--overhead-only")) sizes.clear();
    else {
      std::fprintf(stderr, "usage: %s [--sizes 256,512,...] [--threads 1,2] [--chain N] [--quick] [--overhead-only] [--cpu-time]\n",
                   argv[0]);
      return 2;
    }
  }

  std::printf("# %s\n", nn::cpu_info().line().c_str());
  std::printf("## nn matmul benchmark\n\n");
  std::printf("- CPU: %s, %u hardware threads; load average at start: %s\n", cpu_model().c_str(),
              std::thread::hardware_concurrency(), loadavg().c_str());
  std::printf("- nn GEMM path: %s\n", nn_gemm_path());
  std::printf("- Eigen %d.%d.%d, SIMD: %s\n", EIGEN_WORLD_VERSION, EIGEN_MAJOR_VERSION, EIGEN_MINOR_VERSION,
              Eigen::SimdInstructionSetsInUse());
#if (defined(NN_BENCH_CBLAS) || defined(NN_USE_BLAS)) && defined(OPENBLAS_VERSION)
  std::printf("- OpenBLAS: %s(core %s)\n", openblas_get_config(), openblas_get_corename());
#endif
  std::printf("- float32, square n x n, row-major; GFLOP/s = 2n^3 / median time (x3 for forward+backward)%s\n",
              g_cpu_clock ? "; time = process CPU time (--cpu-time), not wall clock" : "");

  std::vector<Row> rows;
  for (int t : sizes.empty() ? std::vector<int>{} : threads) {
    set_threads(t);
    for (int n : sizes) rows.push_back(bench_size(t, n, min_seconds));
  }

  if (!rows.empty()) print_tables(rows);
  set_threads(1);
  bench_overhead(chain);
  std::printf("\nLoad average at end: %s\n", loadavg().c_str());
  return 0;
}
