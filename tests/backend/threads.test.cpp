// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's thread teams (include/nn/backend/threads.hpp): time in regions the scheduler stalled
// shrinks the team for a back-off period, a clean probe restores it, and a product is
// bit-identical whatever size the team had.
#include <doctest/doctest.h>

#include <nn/nn.hpp>

#include <chrono>
#include <thread>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace backend_threads {  // one unity source with the other backend files: its names stay its own

using nn::detail::TeamLoad;

namespace {
// The process-wide record, reset on entry and on exit (other tests run after these).
struct FreshLoad {
  FreshLoad() { TeamLoad::get().set_enabled(true); }
  ~FreshLoad() { TeamLoad::get().set_enabled(true); }
};
constexpr std::int64_t kMs = 1'000'000;
// Regions of 1 ms each from time `t` (ns) for `ms` milliseconds, every `every`-th one (0: none)
// stalled by the scheduler for `late` ns; returns the time after them.
std::int64_t regions(TeamLoad& load, int threads, std::int64_t t, int ms, std::int64_t late, int every) {
  for (int i = 0; i < ms; ++i) {
    t += kMs;
    load.observe(threads, every && i % every == 0 ? late : 0, t);
  }
  return t;
}
}  // namespace

TEST_CASE("a team that loses over a fifth of a window to the scheduler loses a thread; an idle one never") {
  FreshLoad fresh;
  TeamLoad& load = TeamLoad::get();
  const std::int64_t before = load.reductions();
  std::int64_t t = 1'000 * kMs;
  t = regions(load, 4, t, 500, 0, 0);  // idle: nothing lost
  CHECK(load.allowed(4, t) == 4);
  t = regions(load, 4, t, 500, 3 * kMs, 20);  // a nice-19 neighbour: a 3 ms slice now and then, 15%
  CHECK(load.allowed(4, t) == 4);
  CHECK(load.reductions() == before);
  t = regions(load, 4, t, 60, 3 * kMs, 4);  // a busy neighbour at the same priority: 75% of the time lost
  CHECK(load.reductions() == before + 1);
  CHECK(load.allowed(4, t) == 3);
  CHECK(load.allowed(8, t) == 3);
  CHECK(load.allowed(2, t) == 2);
  // Still losing at the smaller size: one fewer again, down to one thread and never below.
  t = regions(load, 3, t, 60, 3 * kMs, 4);
  CHECK(load.allowed(4, t) == 2);
  t = regions(load, 2, t, 60, 3 * kMs, 4);
  CHECK(load.allowed(4, t) == 1);
  t = regions(load, 2, t, 60, 3 * kMs, 4);
  CHECK(load.allowed(4, t) == 1);
  regions(load, 1, t, 60, 3 * kMs, 1);  // a one-thread region says nothing
  CHECK(load.allowed(4, t) == 1);
}

TEST_CASE("after the back-off the full team is probed; a losing probe doubles the back-off, a clean one restores it") {
  FreshLoad fresh;
  TeamLoad& load = TeamLoad::get();
  std::int64_t t = 1'000 * kMs;
  t = regions(load, 2, t, 51, 3 * kMs, 2);  // the 51st region ends the first window
  REQUIRE(load.allowed(2, t) == 1);
  CHECK(load.allowed(2, t + TeamLoad::kFirstBackoffNs - kMs) == 1);
  t += TeamLoad::kFirstBackoffNs;
  CHECK(load.allowed(2, t) == 2);  // the probe
  t = regions(load, 2, t, 51, 3 * kMs, 2);  // still contended: the next back-off is twice as long
  CHECK(load.allowed(2, t + 2 * TeamLoad::kFirstBackoffNs - kMs) == 1);
  t += 2 * TeamLoad::kFirstBackoffNs;
  CHECK(load.allowed(2, t) == 2);
  t = regions(load, 2, t, 51, 0, 0);  // the neighbour is gone
  CHECK(load.allowed(2, t) == 2);
  CHECK(load.cap() == 0);
  t = regions(load, 2, t, 51, 3 * kMs, 2);  // and back: the first back-off again
  CHECK(load.allowed(2, t + TeamLoad::kFirstBackoffNs - kMs) == 1);
  CHECK(load.allowed(2, t + TeamLoad::kFirstBackoffNs) == 2);
}

TEST_CASE("turned off (NN_ADAPTIVE_THREADS=0 or set_adaptive_threads(false)), teams keep their size") {
  FreshLoad fresh;
  nn::set_adaptive_threads(false);
  CHECK_FALSE(nn::adaptive_threads());
  TeamLoad& load = TeamLoad::get();
  const std::int64_t t = regions(load, 2, 1'000 * kMs, 200, 3 * kMs, 1);
  CHECK(load.allowed(2, t) == 2);
  nn::set_adaptive_threads(true);
  CHECK(nn::adaptive_threads());
}

#if defined(_OPENMP)
TEST_CASE("team() runs the body on the team it was given, and a product is the same bit for bit at any cap") {
  FreshLoad fresh;
  const int prev = omp_get_max_threads();
  omp_set_num_threads(2);
  std::vector<int> ran(2, 0);
  int size = 0;
  nn::detail::team(2, [&](int t, int nt) {
    ran[static_cast<std::size_t>(t)] = 1;
    if (t == 0) size = nt;
  });
  CHECK(size >= 1);
  CHECK(ran[0] == 1);
  if (size == 2) CHECK(ran[1] == 1);

  // A product at the full team, then capped at one thread: the same bits.
  const std::int64_t M = 300, N = 130, K = 200;
  std::vector<float> A(static_cast<std::size_t>(M * K)), B(static_cast<std::size_t>(K * N));
  for (std::size_t i = 0; i < A.size(); ++i) A[i] = static_cast<float>((i * 7919) % 1000) / 500.0f - 1.0f;
  for (std::size_t i = 0; i < B.size(); ++i) B[i] = static_cast<float>((i * 104729) % 1000) / 500.0f - 1.0f;
  std::vector<float> full(static_cast<std::size_t>(M * N)), capped(full.size());
  CHECK(nn::gemm::team_threads(M, N, K) == 2);
  nn::gemm::gemm_parallel<float>(nn::gemm::active_isa(), false, false, M, N, K, A.data(), K, B.data(), N, full.data(), N, false);
  TeamLoad::get().set_enabled(true);  // forget the window the team above opened
  regions(TeamLoad::get(), 2, TeamLoad::now_ns() - 100 * kMs, 60, 3 * kMs, 1);
  REQUIRE(nn::detail::free_threads() == 1);
  CHECK(nn::gemm::team_threads(M, N, K) == 1);
  nn::gemm::gemm_parallel<float>(nn::gemm::active_isa(), false, false, M, N, K, A.data(), K, B.data(), N, capped.data(), N, false);
  CHECK(full == capped);
  omp_set_num_threads(prev);
}
#endif

}  // namespace backend_threads
