// SPDX-License-Identifier: MIT OR Apache-2.0
// Replaces global operator new/delete and (on glibc) malloc & co. with counting versions, so the
// tests of this area can assert that a replay performs no heap allocation; checks the counters.
#include <doctest/doctest.h>

#include <dlfcn.h>

#include <atomic>
#include <cerrno>
#include <cstdlib>
#include <map>
#include <new>
#include <sstream>
#include <string>

#include "count.hpp"

#if defined(__GLIBC__) && !defined(__SANITIZE_ADDRESS__) && !defined(__SANITIZE_THREAD__)
#define NN_TEST_HOOK_MALLOC 1
#else
#define NN_TEST_HOOK_MALLOC 0
#endif

namespace {

// Plain globals, constant-initialised: usable before any constructor runs (the C runtime and
// other libraries allocate before main).
std::atomic<bool> g_on{false};
std::atomic<std::int64_t> g_news{0}, g_new_bytes{0}, g_mallocs{0}, g_malloc_bytes{0};

// Who allocated: the return address of the first kSites counted calls, resolved after stop().
constexpr int kSites = 256;
struct Site {
  void* caller;
  std::size_t bytes;
  bool is_new;
};
Site g_sites[kSites];
std::atomic<int> g_nsites{0};
// Set while operator new runs on this thread, so the malloc it makes is not counted twice.
thread_local bool t_in_new = false;

inline void note(std::atomic<std::int64_t>& count, std::atomic<std::int64_t>& bytes, std::size_t n, void* caller,
                 bool is_new) {
  if (g_on.load(std::memory_order_relaxed) && !t_in_new) {
    count.fetch_add(1, std::memory_order_relaxed);
    bytes.fetch_add(static_cast<std::int64_t>(n), std::memory_order_relaxed);
    int i = g_nsites.fetch_add(1, std::memory_order_relaxed);
    if (i < kSites) g_sites[i] = Site{caller, n, is_new};
  }
}

/// The shared object (basename) and, when exported, the function holding `pc`.
std::string site_name(void* pc) {
  Dl_info info{};
  if (!dladdr(pc, &info) || !info.dli_fname) return "?";
  std::string f = info.dli_fname;
  if (auto slash = f.rfind('/'); slash != std::string::npos) f = f.substr(slash + 1);
  if (f.empty()) f = "(executable)";
  if (info.dli_sname) f += std::string(":") + info.dli_sname;
  return f;
}

void* new_impl(std::size_t n, void* caller) {
  note(g_news, g_new_bytes, n, caller, true);
  if (n == 0) n = 1;
  for (;;) {
    t_in_new = true;
    void* p = std::malloc(n);
    t_in_new = false;
    if (p) return p;
    std::new_handler h = std::get_new_handler();
    if (!h) throw std::bad_alloc();
    h();
  }
}

void* new_aligned_impl(std::size_t n, std::align_val_t al, void* caller) {
  note(g_news, g_new_bytes, n, caller, true);
  std::size_t a = static_cast<std::size_t>(al);
  if (a < sizeof(void*)) a = sizeof(void*);
  if (n == 0) n = 1;
  for (;;) {
    void* p = nullptr;
    t_in_new = true;
    int rc = posix_memalign(&p, a, n);
    t_in_new = false;
    if (rc == 0) return p;
    std::new_handler h = std::get_new_handler();
    if (!h) throw std::bad_alloc();
    h();
  }
}

}  // namespace

namespace nn::test::alloc {

bool malloc_hooked() { return NN_TEST_HOOK_MALLOC != 0; }

void start() {
  g_on.store(false);
  for (auto* c : {&g_news, &g_new_bytes, &g_mallocs, &g_malloc_bytes}) c->store(0);
  g_nsites.store(0);
  g_on.store(true, std::memory_order_seq_cst);
}

Counts stop() {
  g_on.store(false, std::memory_order_seq_cst);
  Counts c;
  c.news = g_news.load();
  c.mallocs = g_mallocs.load();
  c.bytes = g_new_bytes.load() + g_malloc_bytes.load();
  return c;
}

namespace {
template <class F>
void for_each_site(F&& f) {
  const int n = std::min(g_nsites.load(), kSites);
  for (int i = 0; i < n; ++i) f(g_sites[i]);
}
}  // namespace

std::string callers() {
  std::map<std::string, std::pair<int, std::size_t>> by;
  for_each_site([&](const Site& s) {
    auto& e = by[std::string(s.is_new ? "new from " : "malloc from ") + site_name(s.caller)];
    e.first += 1;
    e.second += s.bytes;
  });
  std::ostringstream os;
  for (auto& [k, v] : by)
    os << "\n    " << v.first << " x " << k << ": " << v.second / static_cast<std::size_t>(v.first) << " bytes each ("
       << v.second << " in all)";
  if (g_nsites.load() > kSites) os << "\n    (only the first " << kSites << " were recorded)";
  return os.str();
}

std::int64_t count_from(const std::string& library) {
  std::int64_t n = 0;
  for_each_site([&](const Site& s) {
    if (site_name(s.caller).find(library) != std::string::npos) ++n;
  });
  return n;
}

}  // namespace nn::test::alloc

// ---- operator new / delete ---------------------------------------------------------------------

void* operator new(std::size_t n) { return new_impl(n, __builtin_return_address(0)); }
void* operator new[](std::size_t n) { return new_impl(n, __builtin_return_address(0)); }
void* operator new(std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return new_impl(n, __builtin_return_address(0));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, const std::nothrow_t&) noexcept {
  try {
    return new_impl(n, __builtin_return_address(0));
  } catch (...) {
    return nullptr;
  }
}
void* operator new(std::size_t n, std::align_val_t al) { return new_aligned_impl(n, al, __builtin_return_address(0)); }
void* operator new[](std::size_t n, std::align_val_t al) { return new_aligned_impl(n, al, __builtin_return_address(0)); }
void* operator new(std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  try {
    return new_aligned_impl(n, al, __builtin_return_address(0));
  } catch (...) {
    return nullptr;
  }
}
void* operator new[](std::size_t n, std::align_val_t al, const std::nothrow_t&) noexcept {
  try {
    return new_aligned_impl(n, al, __builtin_return_address(0));
  } catch (...) {
    return nullptr;
  }
}
void operator delete(void* p) noexcept { std::free(p); }
void operator delete[](void* p) noexcept { std::free(p); }
void operator delete(void* p, std::size_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t) noexcept { std::free(p); }
void operator delete(void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete[](void* p, std::size_t, std::align_val_t) noexcept { std::free(p); }
void operator delete(void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }
void operator delete[](void* p, std::align_val_t, const std::nothrow_t&) noexcept { std::free(p); }

// ---- the malloc family (glibc): interposed in the executable, forwarded to glibc's own --------
// Libraries (OpenBLAS, libgomp, libstdc++) resolve malloc to these too, so their allocations on
// worker threads are counted as well.

#if NN_TEST_HOOK_MALLOC
extern "C" {
void* __libc_malloc(std::size_t);
void* __libc_calloc(std::size_t, std::size_t);
void* __libc_realloc(void*, std::size_t);
void __libc_free(void*);
void* __libc_memalign(std::size_t, std::size_t);
void* __libc_valloc(std::size_t);
void* __libc_pvalloc(std::size_t);

void* malloc(std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  return __libc_malloc(n);
}
void* calloc(std::size_t c, std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, c * n, __builtin_return_address(0), false);
  return __libc_calloc(c, n);
}
void* realloc(void* p, std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  return __libc_realloc(p, n);
}
void free(void* p) noexcept { __libc_free(p); }
void* memalign(std::size_t a, std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  return __libc_memalign(a, n);
}
void* aligned_alloc(std::size_t a, std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  return __libc_memalign(a, n);
}
int posix_memalign(void** out, std::size_t a, std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  if (a % sizeof(void*) != 0 || (a & (a - 1)) != 0) return EINVAL;
  void* p = __libc_memalign(a, n);
  if (!p && n) return ENOMEM;
  *out = p;
  return 0;
}
void* valloc(std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  return __libc_valloc(n);
}
void* pvalloc(std::size_t n) noexcept {
  note(g_mallocs, g_malloc_bytes, n, __builtin_return_address(0), false);
  return __libc_pvalloc(n);
}
}  // extern "C"
#endif

// ---- the counters count --------------------------------------------------------------------

namespace {
// Called through volatile pointers so the compiler cannot elide the allocation pairs.
void* (*volatile g_malloc)(std::size_t) = &std::malloc;
void (*volatile g_free)(void*) = &std::free;
}  // namespace

TEST_CASE("allocation counters see operator new and malloc, and nothing when idle") {
  using namespace nn::test::alloc;
  {
    CountScope s;
    Counts c = s.stop();
    CHECK(c.total() == 0);
  }
  {
    CountScope s;
    int* volatile p = new int(3);
    delete p;
    auto* volatile q = new double[100];
    delete[] q;
    Counts c = s.stop();
    CHECK(c.news == 2);
    CHECK(c.mallocs == 0);
  }
  if (malloc_hooked()) {
    CountScope s;
    void* p = g_malloc(1000);
    g_free(p);
    void* q = std::aligned_alloc(64, 4096);
    std::free(q);
    Counts c = s.stop();
    CHECK(c.news == 0);
    CHECK(c.mallocs == 2);
  } else {
    MESSAGE("malloc is not counted in this build (not glibc, or a sanitizer owns malloc)");
  }
}
