// SPDX-License-Identifier: MIT OR Apache-2.0
// Heap-allocation counters for the tests/alloc area: every operator new, and (glibc) every malloc
// family call from any thread, counted while a CountScope is open. Defined in hooks.test.cpp.
#pragma once

#include <cstdint>
#include <string>

namespace nn::test::alloc {

struct Counts {
  std::int64_t news = 0;     // operator new / new[] (all overloads)
  std::int64_t mallocs = 0;  // malloc, calloc, realloc, aligned_alloc, posix_memalign, memalign, valloc
  std::int64_t bytes = 0;    // bytes asked for by both
  std::int64_t total() const { return news + mallocs; }
};

/// Whether malloc-family calls are counted in this build (glibc, no sanitizer); operator new
/// always is.
bool malloc_hooked();

/// Zeroes the counters and starts counting (process-wide, every thread).
void start();
/// Stops counting and returns what was counted since start().
Counts stop();

/// After stop(): one line per allocating place
/// ("3 x malloc from libopenblas.so.0: 512 bytes each (1536 in all)"),
/// from the return addresses of the first 256 counted calls.
std::string callers();
/// After stop(): how many of the recorded calls came from a shared object whose name contains
/// `library` (e.g. "openblas").
std::int64_t count_from(const std::string& library);

/// Counts allocations for its lifetime: `CountScope s; ...; Counts c = s.stop();`.
class CountScope {
 public:
  CountScope() { start(); }
  ~CountScope() {
    if (!stopped_) stop();
  }
  CountScope(const CountScope&) = delete;
  CountScope& operator=(const CountScope&) = delete;
  Counts stop() {
    stopped_ = true;
    return alloc::stop();
  }

 private:
  bool stopped_ = false;
};

}  // namespace nn::test::alloc
