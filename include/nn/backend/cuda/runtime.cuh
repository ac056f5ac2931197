// SPDX-License-Identifier: MIT OR Apache-2.0
// The CUDA runtime under nn::cuda: checked calls, the one stream and cuBLAS handle nn works on,
// a caching device allocator, the index-error block, and the Tensor allocation / copy hooks.
#pragma once

#if !defined(__CUDACC__)
#error "include <nn/cuda.hpp> from a .cu file compiled by nvcc"
#endif

#include <cuda_runtime.h>
#include <cublas_v2.h>

#include <bit>
#include <climits>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <vector>

#include "../../tensor.hpp"

// Every CUDA runtime call goes through this: a failure raises nn::Error naming the call as
// written and cudaGetErrorString's reason. (Undefined again at the end of nn/cuda.hpp.)
#define NN_CUDA_CHECK(call) ::nn::detail::cu::check_cuda((call), #call)
#define NN_CUBLAS_CHECK(call) ::nn::detail::cu::check_cublas((call), #call)

namespace nn {

/// Counters of nn's CUDA caching allocator (nn::cuda::memory_stats()). A replayed CUDA graph
/// must leave malloc_calls and alloc_calls unchanged: the tests hold it to that.
struct CudaMemoryStats {
  std::int64_t malloc_calls = 0;    // cudaMalloc calls made (a cache miss)
  std::int64_t alloc_calls = 0;     // device tensor allocations served (hits and misses)
  std::int64_t release_calls = 0;   // blocks given back to the cache
  std::int64_t bytes_reserved = 0;  // held from CUDA (in use + cached)
  std::int64_t bytes_in_use = 0;    // handed out to live storage
};

namespace detail::cu {

[[noreturn]] inline void fail_cuda(cudaError_t e, const char* call) {
  fail("cuda", call, " failed: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
}
inline void check_cuda(cudaError_t e, const char* call) {
  if (e != cudaSuccess) fail_cuda(e, call);
}
inline void check_cublas(cublasStatus_t s, const char* call) {
  if (s != CUBLAS_STATUS_SUCCESS) fail("cuda", call, " failed: ", cublasGetStatusString(s), " (cuBLAS status ", static_cast<int>(s), ")");
}
/// After a kernel launch: launch errors (bad configuration, no device) surface here, at the
/// op that caused them, not at the next synchronisation.
inline void check_launch(const char* kernel) {
  cudaError_t e = cudaGetLastError();
  if (e != cudaSuccess) fail("cuda", "launching ", kernel, " failed: ", cudaGetErrorString(e), " (", cudaGetErrorName(e), ")");
}

// ---- caching allocator -------------------------------------------------------------------
// cudaMalloc synchronises the device and costs tens of microseconds; a training step frees and
// re-makes the same sizes every step. Blocks are rounded up to a size class and kept in a free
// list per class; a request takes a cached block of its class or calls cudaMalloc. Releasing
// never calls CUDA (only a later empty_cache() does), so tensors destroyed at process exit, after
// the CUDA runtime has gone, are harmless. All nn work runs on one stream, so a block given back
// and handed out again is reused in stream order, after every kernel that used it before.
class Allocator {
 public:
  /// The size class of a request: 512-byte granularity up to 4 KiB, then steps of an eighth of
  /// the power of two below (at most 12.5% waste, a few dozen classes per doubling).
  static std::size_t size_class(std::size_t bytes) {
    bytes = bytes ? bytes : 1;
    const std::size_t step = std::max<std::size_t>(512, std::bit_floor(bytes) / 8);
    return (bytes + step - 1) / step * step;
  }

  void* allocate(std::size_t bytes) {
    const std::size_t cls = size_class(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.alloc_calls;
    auto it = free_.find(cls);
    if (it != free_.end() && !it->second.empty()) {
      void* p = it->second.back();
      it->second.pop_back();
      stats_.bytes_in_use += static_cast<std::int64_t>(cls);
      return p;
    }
    void* p = nullptr;
    cudaError_t e = cudaMalloc(&p, cls);
    if (e == cudaErrorMemoryAllocation) {  // give the cached blocks back to CUDA and try once more
      cudaGetLastError();
      release_cached_locked();
      e = cudaMalloc(&p, cls);
    }
    if (e != cudaSuccess) {
      cudaGetLastError();
      fail("cuda", "cudaMalloc of ", cls, " bytes (a tensor of ", bytes, " bytes) failed: ", cudaGetErrorString(e), " (",
           cudaGetErrorName(e), "); ", stats_.bytes_in_use, " bytes in use by nn");
    }
    ++stats_.malloc_calls;
    stats_.bytes_reserved += static_cast<std::int64_t>(cls);
    stats_.bytes_in_use += static_cast<std::int64_t>(cls);
    return p;
  }

  void release(void* p, std::size_t bytes) {
    const std::size_t cls = size_class(bytes);
    std::lock_guard<std::mutex> lock(mu_);
    ++stats_.release_calls;
    stats_.bytes_in_use -= static_cast<std::int64_t>(cls);
    free_[cls].push_back(p);
  }

  /// cudaFree every cached block (waits for the device first).
  void empty_cache() {
    std::lock_guard<std::mutex> lock(mu_);
    release_cached_locked();
  }

  CudaMemoryStats stats() {
    std::lock_guard<std::mutex> lock(mu_);
    return stats_;
  }

 private:
  void release_cached_locked() {
    NN_CUDA_CHECK(cudaDeviceSynchronize());
    for (auto& [cls, blocks] : free_) {
      for (void* p : blocks) {
        NN_CUDA_CHECK(cudaFree(p));
        stats_.bytes_reserved -= static_cast<std::int64_t>(cls);
      }
      blocks.clear();
    }
  }

  std::mutex mu_;
  std::map<std::size_t, std::vector<void*>> free_;
  CudaMemoryStats stats_;
};

/// The process's allocator. Never destroyed: storage released during static destruction still
/// finds it.
inline Allocator& allocator() {
  static Allocator* a = new Allocator();
  return *a;
}

// ---- context: stream, cuBLAS, scratch --------------------------------------------------------

/// Index errors found by kernels (gather_rows, pick, cross_entropy). A kernel cannot throw: it
/// records min(position << 32 | uint32(id)) per kind with atomicMin (order-independent, so the
/// first bad position wins whatever the schedule), and the host raises after synchronising.
enum IndexErrorKind : int { kGatherRows = 0, kPick = 1, kCrossEntropy = 2, kIndexErrorKinds = 3 };
inline constexpr unsigned long long kNoIndexError = ~0ull;

struct Context {
  cudaStream_t stream = nullptr;
  cublasHandle_t blas = nullptr;
  void* blas_workspace = nullptr;
  unsigned long long* index_errors = nullptr;       // device, kIndexErrorKinds words
  unsigned long long* index_errors_host = nullptr;  // pinned mirror for the read-back
  double* scratch = nullptr;                        // device, 16 words: reduction results
  double* scratch_host = nullptr;                   // pinned mirror
  bool capturing = false;                           // a CUDA graph capture is in progress on stream
};

/// cuBLAS on Hopper wants up to 32 MiB of workspace; owning it (rather than letting cuBLAS
/// allocate) is what makes GEMMs capturable into a graph without an allocation inside it.
inline constexpr std::size_t kBlasWorkspaceBytes = std::size_t{32} << 20;

inline Context* make_context() {
  auto* c = new Context();
  // A non-blocking stream: nn's work never waits on, nor is serialised with, the legacy default
  // stream, and a graph capture on it cannot be broken by another library's implicit sync.
  NN_CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
  NN_CUBLAS_CHECK(cublasCreate(&c->blas));
  NN_CUBLAS_CHECK(cublasSetStream(c->blas, c->stream));  // resets the workspace: set it after
  c->blas_workspace = allocator().allocate(kBlasWorkspaceBytes);
  NN_CUBLAS_CHECK(cublasSetWorkspace(c->blas, c->blas_workspace, kBlasWorkspaceBytes));
  // Full float32 GEMMs, never TF32 (which the default math mode already excludes; set here so
  // that no inherited setting changes it): the CUDA results must agree with the CPU to 1e-5.
  NN_CUBLAS_CHECK(cublasSetMathMode(c->blas, CUBLAS_DEFAULT_MATH));
  c->index_errors = static_cast<unsigned long long*>(allocator().allocate(kIndexErrorKinds * sizeof(unsigned long long)));
  c->scratch = static_cast<double*>(allocator().allocate(16 * sizeof(double)));
  NN_CUDA_CHECK(cudaMallocHost(&c->index_errors_host, kIndexErrorKinds * sizeof(unsigned long long)));
  NN_CUDA_CHECK(cudaMallocHost(&c->scratch_host, 16 * sizeof(double)));
  NN_CUDA_CHECK(cudaMemsetAsync(c->index_errors, 0xff, kIndexErrorKinds * sizeof(unsigned long long), c->stream));
  NN_CUDA_CHECK(cudaStreamSynchronize(c->stream));
  return c;
}

/// The context, made on first use (the first CUDA tensor or kernel) and kept for the process.
inline Context& ctx() {
  static Context* c = make_context();
  return *c;
}
inline cudaStream_t stream() { return ctx().stream; }

inline void require_not_capturing(const char* what) {
  if (ctx().capturing)
    fail("cuda", what, " needs the host to wait for the device, which a CUDA graph capture cannot contain");
}

// ---- the Tensor hooks ----------------------------------------------------------------------

inline void release_storage(void* p, std::size_t bytes) { allocator().release(p, bytes); }

inline std::shared_ptr<Storage> alloc_storage(std::size_t bytes) {
  auto s = std::make_shared<Storage>();
  s->data = allocator().allocate(bytes);
  s->bytes = bytes;
  s->device = Device::cuda;
  s->release = &release_storage;
  return s;
}

/// Tensor::to(Device) and clone(): ordered after every kernel already queued on nn's stream, and
/// finished when this returns (the host may read or free its side at once).
inline void copy_storage(void* dst, Device, const void* src, Device, std::size_t bytes) {
  require_not_capturing("copying a tensor between host and device");
  NN_CUDA_CHECK(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDefault, stream()));
  NN_CUDA_CHECK(cudaStreamSynchronize(stream()));
}

/// Installed before main(): any program that includes nn/cuda.hpp can make CUDA tensors; one
/// that does not never references the CUDA runtime.
inline const bool hooks_installed = [] {
  device_alloc_hook(Device::cuda) = &alloc_storage;
  device_copy_hook(Device::cuda) = &copy_storage;
  return true;
}();

}  // namespace detail::cu
}  // namespace nn
