// SPDX-License-Identifier: MIT OR Apache-2.0
// "No per-call heap allocation in the matmul path": after one warm-up, replaying a recorded tape
// of matmuls (forward and backward; 2-D, batched, shared-operand, transposed, vector, tiny) makes
// zero operator-new and zero malloc calls on every thread, on the GEMM path this build uses (nn's
// own engine by default; build with NN_USE_BLAS for CBLAS), at 1 and 2 threads. The only exception, reported rather than
// failed, is what OpenBLAS mallocs inside itself.
//
// The claim holds at a fixed team size: a team of another size gives each thread another share of
// a product, so a thread's workspace may grow once, on the first replay at that size. nn's teams
// shrink on their own when other processes take the cores (backend/threads.hpp), as CTest's
// parallel jobs do, so every case here holds the size fixed (FixedTeams), and the last case
// checks the re-warming: one replay at the new size, then none allocates.
#include <doctest/doctest.h>

#include <set>
#include <sstream>
#include <string>
#include <vector>

#include "count.hpp"
#include "support/check.hpp"

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace alloc_matmul_alloc {  // one unity source with the other alloc files: its names stay its own

using namespace nn;
namespace alloc = nn::test::alloc;

namespace {

/// Sets the thread count every GEMM engine this build may use reads.
void set_threads(int n) {
#if defined(_OPENMP)
  omp_set_num_threads(n);
#endif
  Eigen::setNbThreads(n);
#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
  openblas_set_num_threads(n);
#endif
}

/// Turns nn's team-size adaptation off for a test case's lifetime, so that the counted replays run
/// at the warm-up's team size whatever else the machine is doing.
struct FixedTeams {
  bool was = adaptive_threads();
  FixedTeams() { set_adaptive_threads(false); }
  ~FixedTeams() { set_adaptive_threads(was); }
};

std::string gemm_path() { return cpu_info().gemm; }

/// What this test tolerates: allocations made inside OpenBLAS itself, which nn cannot avoid.
/// Debian's OpenBLAS 0.3.21 mallocs on some calls: its threaded level-3 driver (level3_thread.c)
/// its job array, on every call run on more than one thread, since it is built with MAX_THREADS
/// above BLAS3_MEM_ALLOC_THRESHOLD (64 > 32: 512 KiB per call); its AVX-512 small-matrix sgemm
/// kernel a copy of the edge rows when M is not a multiple of its tile. They are counted and
/// reported, not failed; every other allocation (nn's own, libgomp's, Eigen's) fails the test.
std::int64_t g_openblas_mallocs = 0;
std::set<std::string> g_openblas_sites;

/// Checks that the counted window allocated nothing (OpenBLAS's own allocations aside).
void check_none(const alloc::Counts& n, const std::string& what) {
  const std::string who = alloc::callers();
  std::int64_t tolerated = 0;
#if defined(NN_USE_BLAS)
  tolerated = alloc::count_from("openblas");
  if (tolerated) {
    std::istringstream lines(who);
    for (std::string line; std::getline(lines, line);)
      if (line.find("openblas") != std::string::npos) {
        const std::size_t from = line.find("malloc"), to = line.find(" (", from);
        g_openblas_sites.insert(line.substr(from, to - from));
      }
  }
#endif
  g_openblas_mallocs += tolerated;
  const std::int64_t mallocs = n.mallocs - tolerated;
  CHECK_MESSAGE(n.news == 0, n.news << " operator new calls in " << what << ":" << who);
  CHECK_MESSAGE(mallocs == 0, mallocs << " malloc calls in " << what << ":" << who);
}

void report_tolerated() {
  if (g_openblas_mallocs == 0) return;
  std::string config = "?", sites;
#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
  config = openblas_get_config();
#endif
  for (const auto& s : g_openblas_sites) sites += "\n    " + s;
  MESSAGE("OpenBLAS (" << config << ") allocated " << g_openblas_mallocs
                       << " times inside itself; nn allocated nothing. Sites:" << sites);
  g_openblas_mallocs = 0;
  g_openblas_sites.clear();
}

struct Case {
  std::string name;
  Shape a, b;
  bool ta = false, tb = false;
  DType dt = DType::f32;
};

std::vector<Case> cases() {
  return {
      {"2-D", {192, 320}, {320, 256}},
      {"2-D a^T", {320, 192}, {320, 256}, true, false},
      {"2-D b^T", {192, 320}, {256, 320}, false, true},
      {"2-D a^T b^T", {320, 192}, {256, 320}, true, true},
      {"odd sizes", {97, 131}, {131, 67}},
      {"wide (split by columns)", {40, 300}, {700, 300}, false, true},
      {"batched", {3, 96, 200}, {3, 200, 160}},
      {"batched a^T b^T", {3, 200, 96}, {3, 160, 200}, true, true},
      {"batched @ shared W^T (Linear, folded)", {4, 64, 320}, {256, 320}, false, true},
      {"batched^T @ shared matrix", {2, 320, 96}, {320, 128}, true, false},
      {"matrix @ batched", {96, 200}, {3, 200, 160}},
      {"4-D batched", {2, 3, 48, 64}, {2, 3, 64, 80}},
      {"row vector @ matrix", {1, 512}, {512, 384}},
      {"matrix @ column vector", {384, 512}, {512, 1}},
      {"long column (M*4 bytes > Eigen's stack limit)", {40000, 64}, {64, 1}},
      {"long row^T", {40000, 1}, {40000, 24}, true, false},
      {"tiny", {3, 4}, {4, 5}},
      {"float64 a^T", {200, 160}, {200, 180}, true, false, DType::f64},
      {"float64 batched b^T", {2, 64, 96}, {2, 80, 96}, false, true, DType::f64},
  };
}

// ---- a naive reference, in double ----------------------------------------------------------

struct Ref {
  std::vector<double> y, ga, gb;
};

/// y = op(A) @ op(B) with the batch rules of nn::matmul, and the vjp for cotangent g.
Ref reference(const Case& c, const Tensor& A, const Tensor& B, const Tensor& G) {
  const auto a = A.to_doubles(), b = B.to_doubles(), g = G.to_doubles();
  const std::int64_t ar = c.a.dim(-2), ac = c.a.dim(-1), br = c.b.dim(-2), bc = c.b.dim(-1);
  const std::int64_t M = c.ta ? ac : ar, K = c.ta ? ar : ac, N = c.tb ? br : bc;
  const std::int64_t ba = c.a.prod(0, c.a.rank() - 2), bb = c.b.prod(0, c.b.rank() - 2), bt = std::max(ba, bb);
  Ref r;
  r.y.assign(static_cast<std::size_t>(bt * M * N), 0.0);
  r.ga.assign(a.size(), 0.0);
  r.gb.assign(b.size(), 0.0);
  for (std::int64_t i = 0; i < bt; ++i) {
    const std::int64_t oa = (ba == 1 ? 0 : i) * ar * ac, ob = (bb == 1 ? 0 : i) * br * bc;
    auto ia = [&](std::int64_t m, std::int64_t k) { return static_cast<std::size_t>(oa + (c.ta ? k * ac + m : m * ac + k)); };
    auto ib = [&](std::int64_t k, std::int64_t n) { return static_cast<std::size_t>(ob + (c.tb ? n * bc + k : k * bc + n)); };
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t n = 0; n < N; ++n) {
        const auto iy = static_cast<std::size_t>((i * M + m) * N + n);
        double s = 0;
        for (std::int64_t k = 0; k < K; ++k) {
          s += a[ia(m, k)] * b[ib(k, n)];
          r.ga[ia(m, k)] += g[iy] * b[ib(k, n)];
          r.gb[ib(k, n)] += g[iy] * a[ia(m, k)];
        }
        r.y[iy] = s;
      }
  }
  return r;
}

/// Records y = matmul(a, b) and its backward, replays it once (the warm-up), then counts the
/// allocations of `reps` further replays of forward + backward.
void check_case(const Case& c, int threads) {
  CAPTURE(c.name);
  CAPTURE(threads);
  const std::string path = gemm_path();
  CAPTURE(path);
  Tensor A = test::random_tensor(c.a, c.dt, 11);
  Tensor B = test::random_tensor(c.b, c.dt, 12);
  GTape<cpu> tp;
  GVar a = tp.param(A), b = tp.param(B);
  GVar y = matmul(tp, a, b, c.ta, c.tb);
  Tensor G = test::random_tensor(tp.shape(y), c.dt, 13);
  tp.backward(y, G);
  tp.replay_forward();  // warm-up: the first replay may size per-thread workspaces
  tp.backward(y, G);

  alloc::Counts n;
  {
    alloc::CountScope scope;
    for (int rep = 0; rep < 3; ++rep) {
      tp.replay_forward();
      tp.backward(y, G);
    }
    n = scope.stop();
  }
  check_none(n, "3 replays of forward + backward");

  // The replayed results are still right (the allocation-free GEMM path computes the product).
  const Ref r = reference(c, A, B, G);
  const double tol = c.dt == DType::f32 ? 1e-5 : 1e-12;
  CHECK(test::rel_err(tp.value(y).to_doubles(), r.y) < tol);
  CHECK(test::rel_err(tp.grad(a).to_doubles(), r.ga) < tol);
  CHECK(test::rel_err(tp.grad(b).to_doubles(), r.gb) < tol);
}

}  // namespace

TEST_CASE("replaying matmul forward and backward allocates nothing (after one warm-up)") {
  FixedTeams fixed;
  MESSAGE("GEMM path: " << gemm_path() << "; malloc counted: " << std::string(alloc::malloc_hooked() ? "yes" : "no"));
  for (int threads : {1, 2}) {
    set_threads(threads);
    for (const Case& c : cases()) check_case(c, threads);
  }
#if defined(_OPENMP)
  set_threads(omp_get_num_procs());
#endif
  report_tolerated();
}

// Records the backward of `loss`, replays once (buffers made lazily by the first sweep settle),
// then counts two more replays: they must allocate nothing.
static void check_replays_allocate_nothing(GTape<cpu>& tp, GVar loss, const std::string& what) {
  tp.backward(loss);
  tp.replay();
  alloc::CountScope scope;
  tp.replay();
  tp.replay();
  check_none(scope.stop(), what);
}

TEST_CASE("a replayed matmul with a swapped input allocates nothing") {
  FixedTeams fixed;
  // The Linear pattern of a training loop: x is an input slot set() to a new batch each step.
  GTape<cpu> tp;
  Tensor W = test::random_tensor({256, 320}, DType::f32, 1);
  Tensor X0 = test::random_tensor({4, 64, 320}, DType::f32, 2);
  Tensor X1 = test::random_tensor({4, 64, 320}, DType::f32, 3);
  GVar w = tp.param(W);
  GVar x = tp.input(X0);
  GVar y = matmul(tp, x, w, false, true);
  Tensor G = test::random_tensor(tp.shape(y), DType::f32, 4);
  tp.backward(y, G);
  tp.replay_forward();
  tp.backward(y, G);
  alloc::CountScope scope;
  for (int rep = 0; rep < 4; ++rep) {
    tp.set(x, rep % 2 ? X0 : X1);
    tp.replay_forward();
    tp.backward(y, G);
  }
  alloc::Counts n = scope.stop();
  check_none(n, "4 steps with set()");
  report_tolerated();
}

// The design's wider claim: a whole recorded step (Linear, bias, relu, loss) replays without
// allocating. The elementwise kernels test their size in C++ before entering OpenMP
// (detail::parallel_for): `#pragma omp parallel for if (false)` would still build a one-thread
// libgomp team, a malloc and a free on every call.
TEST_CASE("replaying a small training step allocates nothing") {
  FixedTeams fixed;
  GTape<cpu> tp;
  Tensor W = test::random_tensor({64, 32}, DType::f32, 1), Bias = test::random_tensor({64}, DType::f32, 2);
  Tensor X = test::random_tensor({8, 32}, DType::f32, 3);
  GVar w = tp.param(W), bias = tp.param(Bias), x = tp.input(X);
  GVar loss = sum(tp, relu(tp, add(tp, matmul(tp, x, w, false, true), bias)));
  check_replays_allocate_nothing(tp, loss, "2 replays of a Linear + relu + sum step");
}

namespace {

// A small MLP with dropout: Linear, relu, Dropout, Linear, cross-entropy (a namespace-scope
// module, as NN_MODULE requires).
struct DropMlp {
  Linear fc1{32, 64}, fc2{64, 10};
  Dropout drop{0.25};
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return fc2(tp, drop(tp, relu(tp, fc1(tp, x))));
  }
  NN_MODULE(DropMlp, fc1, fc2, drop)
};

}  // namespace

// The claim itself: a compiled step (forward, backward, dropout's fresh key, the AdamW
// update with a changing learning rate) replays without a heap allocation, at 1 and 2 threads.
TEST_CASE("a compiled training step (MLP, dropout, AdamW) replays without allocating") {
  FixedTeams fixed;
  for (int threads : {1, 2}) {
    CAPTURE(threads);
    set_threads(threads);
    nn::random::seed(7);
    DropMlp model;
    AdamW opt(1e-3);
    auto step = compile<2>(model, opt, [](GTape<cpu>& tp, const DropMlp& m, GVar x, GVar y) {
      return cross_entropy(tp, m(tp, x), y);
    });
    Tensor x = test::random_tensor({16, 32}, DType::f32, 11);
    Tensor y = Tensor::empty({16}, DType::i32, Device::cpu);
    for (int i = 0; i < 16; ++i) static_cast<std::int32_t*>(y.raw())[i] = (i * 7) % 10;
    step(x, y);
    step(x, y);  // warm-up: the first replay
    double loss = 0;
    alloc::CountScope scope;
    for (int i = 0; i < 3; ++i) {
      opt.set_learning_rate(1e-3 / (i + 1));
      loss = step(x, y).item();
    }
    alloc::Counts n = scope.stop();
    check_none(n, "3 compiled steps");
    CHECK(step.recordings() == 1);
    CHECK(std::isfinite(loss));
  }
  set_threads(omp_get_num_procs());
  report_tolerated();
}

// Gradient checkpointing's recomputation runs into the tape's segment pool: a replay of a step
// with checkpointed blocks (whose backward reruns each block's forward) allocates nothing either.
TEST_CASE("replaying a step with checkpoint segments allocates nothing") {
  FixedTeams fixed;
  GTape<cpu> tp;
  Tensor W1 = test::random_tensor({64, 32}, DType::f32, 1), W2 = test::random_tensor({32, 64}, DType::f32, 2);
  Tensor X = test::random_tensor({8, 32}, DType::f32, 3);
  GVar w1 = tp.param(W1), w2 = tp.param(W2), x = tp.input(X);
  GVar h = x;
  for (int b = 0; b < 3; ++b)
    h = checkpoint(tp, [&](GVar in) {
      return add(tp, in, matmul(tp, silu(tp, matmul(tp, rmsnorm(tp, in, 1e-6), w1, false, true)), w2, false, true));
    }, h);
  check_replays_allocate_nothing(tp, sum(tp, mul(tp, h, h)), "2 replays of 3 checkpointed blocks");
}

namespace {
/// The naive reference above (reference() alone is ambiguous outside this namespace: nn has one).
Ref naive(const Case& c, const Tensor& A, const Tensor& B, const Tensor& G) { return reference(c, A, B, G); }
}  // namespace

// What a team-size change costs (adaptation shrinking a team, or giving it back its size): the
// first replay at the new size may grow the workspaces of the threads whose share grew; from the
// second on, nothing allocates again. A product none of the cases above has run, so that its
// shares are new to every thread.
TEST_CASE("after a team-size change, one replay re-warms and then replays allocate nothing") {
  FixedTeams fixed;
  const Case c{"team-size change", {560, 264}, {560, 392}, true, false};  // a^T: (264, 560) @ (560, 392)
  Tensor A = test::random_tensor(c.a, DType::f32, 21), B = test::random_tensor(c.b, DType::f32, 22);
  set_threads(1);
  GTape<cpu> tp;
  GVar a = tp.param(A), b = tp.param(B);
  GVar y = matmul(tp, a, b, true, false);
  Tensor G = test::random_tensor(tp.shape(y), DType::f32, 23);
  tp.backward(y, G);
  for (int threads : {2, 1, 2}) {
    CAPTURE(threads);
    set_threads(threads);
    tp.replay_forward();  // the first replay at this size: may grow a thread's workspace
    tp.backward(y, G);
    alloc::CountScope scope;
    for (int rep = 0; rep < 2; ++rep) {
      tp.replay_forward();
      tp.backward(y, G);
    }
    const alloc::Counts n = scope.stop();  // before the message's std::string is made
    check_none(n, "2 replays after a team-size change and one re-warming replay");
  }
  const Ref r = naive(c, A, B, G);
  CHECK(test::rel_err(tp.value(y).to_doubles(), r.y) < 1e-5);
  CHECK(test::rel_err(tp.grad(a).to_doubles(), r.ga) < 1e-5);
  CHECK(test::rel_err(tp.grad(b).to_doubles(), r.gb) < 1e-5);
#if defined(_OPENMP)
  set_threads(omp_get_num_procs());
#endif
  report_tolerated();
}

}  // namespace alloc_matmul_alloc
