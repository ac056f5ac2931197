// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's thread teams: every parallel region nn opens goes through team(), which runs it on OpenMP
// threads and notices when the machine's other work keeps those threads from running together.
//
// Why: an OpenMP team is as fast as its slowest thread. On a machine doing something else, a
// thread that shares its core with a busy process is off the CPU half the time, and every region
// (a step opens thousands) waits for it at its barriers: measured on 2 cores with one busy
// process at `nice -n 0`, two threads ran the finetune step at 0.07x of their idle speed, where
// one thread ran at 0.57x (bench/run_contention.sh; PyTorch, whose OpenMP team has the same
// problem, 0.12x). So nn measures it: at the end of each region every thread of the team asks
// the kernel how long it waited, runnable, for a core since its last region (its run-queue
// delay, read only after an involuntary context switch). The longest of those waits stalled the
// whole team at its barriers; when they add up to more than a fifth of a 50 ms window, the team
// is too big for the cores free now, and it gets one thread fewer for a back-off period (0.25 s,
// doubling while the probes at full size that follow find the same, up to 8 s), after which it
// is allowed its full size again. Neither lateness nor the count of preemptions would do: an
// idle virtual CPU can take milliseconds to wake a sleeping thread, and an idle machine's
// kernel threads preempt nn's for microseconds dozens of times a second. An idle machine
// shrinks nothing, and pays two clock reads per region and one getrusage per thread per region.
//
// The results do not depend on it: every parallel product and loop in nn is bit-identical for
// any team size. NN_ADAPTIVE_THREADS=0 in the environment (or set_adaptive_threads(false)) turns
// it off: teams are then always omp_get_max_threads() large.
#pragma once

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__linux__)
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace nn {
namespace detail {

/// The shared record of how long teams lose to the scheduler, and the current cap on team size
/// (one per process).
/// Times are steady-clock nanoseconds, passed in so that tests can drive it.
class TeamLoad {
 public:
  static constexpr std::int64_t kWindowNs = 50'000'000;  // judged every 50 ms of regions
  static constexpr double kLostShare = 0.2;               // more than 20% of it waiting for a core: too big
  static constexpr std::int64_t kFirstBackoffNs = 250'000'000, kMaxBackoffNs = 8'000'000'000;

  static TeamLoad& get() {
    static TeamLoad s;
    return s;
  }
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  /// How many threads a region may use at `now`, out of `max` (omp_get_max_threads()).
  int allowed(int max, std::int64_t now = now_ns()) {
    if (!enabled_.load(std::memory_order_relaxed) || max <= 1) return max;
    const int cap = cap_.load(std::memory_order_relaxed);
    if (cap == 0) return max;
    if (now < until_.load(std::memory_order_relaxed)) return std::min(max, cap);
    // The back-off is over: probe the full team for one window (a window that loses as much
    // again doubles the next back-off; a clean one resets it).
    std::lock_guard<std::mutex> lock(mu_);
    if (cap_.load(std::memory_order_relaxed) != 0) {
      cap_.store(0, std::memory_order_relaxed);
      probing_ = true;
      window_start_ = 0;
    }
    return max;
  }

  /// Records one region of `threads` threads, ending at `now`, that lost `lost_ns` to the
  /// scheduler (the longest any of its threads waited for a core since its previous region).
  void observe(int threads, std::int64_t lost_ns, std::int64_t now = now_ns()) {
    if (threads <= 1 || !enabled_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (window_start_ == 0) {
      window_start_ = now;
      lost_ = 0;
    }
    lost_ += lost_ns;
    const std::int64_t elapsed = now - window_start_;
    if (elapsed < kWindowNs) return;
    if (static_cast<double>(lost_) > kLostShare * static_cast<double>(elapsed)) {
      backoff_ = probing_ ? std::min(backoff_ * 2, kMaxBackoffNs) : kFirstBackoffNs;
      until_.store(now + backoff_, std::memory_order_relaxed);
      cap_.store(std::max(1, threads - 1), std::memory_order_relaxed);
      reductions_.fetch_add(1, std::memory_order_relaxed);
    } else if (probing_) {
      backoff_ = kFirstBackoffNs;  // a clean window at full size
    }
    probing_ = false;
    window_start_ = 0;
  }

  /// Turns it on or off, forgetting what was seen so far.
  void set_enabled(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_.store(on, std::memory_order_relaxed);
    cap_.store(0, std::memory_order_relaxed);
    probing_ = false;
    window_start_ = 0;
    backoff_ = kFirstBackoffNs;
  }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  /// How many times a team was made smaller since the process started.
  std::int64_t reductions() const { return reductions_.load(std::memory_order_relaxed); }
  /// The current cap on team size (0: none).
  int cap() const { return cap_.load(std::memory_order_relaxed); }

 private:
  TeamLoad() {
    const char* v = std::getenv("NN_ADAPTIVE_THREADS");
    enabled_.store(!(v && std::strcmp(v, "0") == 0), std::memory_order_relaxed);
  }
  // allowed() reads the cap and its end without the lock: a stale read costs at most one region
  // at the old size.
  std::atomic<bool> enabled_{true};
  std::atomic<int> cap_{0};
  std::atomic<std::int64_t> until_{0}, reductions_{0};
  std::mutex mu_;  // guards the window below
  bool probing_ = false;
  std::int64_t window_start_ = 0, lost_ = 0, backoff_ = kFirstBackoffNs;
};

/// How long the calling thread waited, runnable, for a core since it last asked (ns): the time
/// the scheduler kept it off its core for other work. Asked first of getrusage(RUSAGE_THREAD)
/// (an involuntary context switch since the last call, about 0.3 us), and only then of the
/// kernel's run-queue delay in /proc/thread-self/schedstat (kept open, one pread); where that
/// file is missing, each involuntary switch counts as a 3 ms time slice. 0 without either
/// (teams then keep their size).
inline std::int64_t waited_since_last_asked() {
#if defined(__linux__) && defined(RUSAGE_THREAD)
  struct Mine {
    long switches = -1;
    std::int64_t delay = -1;
    int fd = -2;  // -2: not opened yet, -1: unavailable
    ~Mine() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local Mine m;
  rusage u{};
  if (getrusage(RUSAGE_THREAD, &u) != 0) return 0;
  const long switched = m.switches < 0 ? 0 : u.ru_nivcsw - m.switches;
  m.switches = u.ru_nivcsw;
  if (switched <= 0 && m.delay >= 0) return 0;
  if (m.fd == -2) m.fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
  if (m.fd < 0) return switched * 3'000'000;
  char buf[96];
  const ssize_t n = ::pread(m.fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return switched * 3'000'000;
  buf[n] = 0;
  const char* p = std::strchr(buf, ' ');  // "<run time> <run-queue delay> <slices>"
  if (!p) return switched * 3'000'000;
  const std::int64_t delay = std::strtoll(p + 1, nullptr, 10);
  const std::int64_t waited = m.delay < 0 ? 0 : std::max<std::int64_t>(0, delay - m.delay);
  m.delay = delay;
  return waited;
#else
  return 0;
#endif
}

/// How many threads a parallel region may use now: omp_get_max_threads(), less while the
/// machine's other work keeps a team that size from running together; 1 inside a parallel region
/// or without OpenMP.
inline int free_threads() {
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
  return TeamLoad::get().allowed(omp_get_max_threads());
#else
  return 1;
#endif
}

/// body(t, nt) on a team of up to `threads` OpenMP threads (thread t of nt; the body may hold
/// `#pragma omp for` and `#pragma omp barrier`, which bind to this team), telling TeamLoad how
/// long the scheduler kept one of them off its core. `threads` comes from free_threads() or a
/// size rule capped by it.
template <class F>
void team(int threads, F&& body) {
#if defined(_OPENMP)
  if (threads > 1) {
    const std::int64_t t0 = TeamLoad::now_ns();
    std::atomic<std::int64_t> waited{0};  // the longest any thread of the team waited
    int size = threads;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      if (t == 0) size = nt;
      body(t, nt);
      // A thread kept off its core stalls the whole team at the region's barriers.
      const std::int64_t w = waited_since_last_asked();
      std::int64_t seen = waited.load(std::memory_order_relaxed);
      while (w > seen && !waited.compare_exchange_weak(seen, w, std::memory_order_relaxed)) {
      }
    }
    const std::int64_t t1 = TeamLoad::now_ns();
    TeamLoad::get().observe(size, std::min(waited.load(std::memory_order_relaxed), t1 - t0), t1);
    return;
  }
#else
  (void)threads;  // without OpenMP every team is the calling thread
#endif
  body(0, 1);
}

}  // namespace detail

/// Whether nn shrinks its thread teams while other processes keep them from running together
/// (backend/threads.hpp; on by default, NN_ADAPTIVE_THREADS=0 turns it off). Results are the
/// same either way; only the speed on a shared machine differs.
inline void set_adaptive_threads(bool on) { detail::TeamLoad::get().set_enabled(on); }
inline bool adaptive_threads() { return detail::TeamLoad::get().enabled(); }

}  // namespace nn
