// SPDX-License-Identifier: MIT OR Apache-2.0
// nn on CUDA: the whole library (nn.hpp) plus the nn::cuda backend policy (GTape<nn::cuda>),
// CUDA tensors (Tensor::empty(shape, dtype, Device::cuda), t.to(Device::cuda), model.to(...)),
// and CudaGraphReplay, which replays a recorded step as one CUDA graph.
#pragma once

#if !defined(__CUDACC__)
#error "include <nn/cuda.hpp> from a .cu file compiled by nvcc"
#endif

#include <map>
#include <utility>
#include <vector>

#include "nn.hpp"
#include "backend/cuda.hpp"

namespace nn {

/// Replays a recorded GTape<cuda> (its forward and its last backward, as tp.replay() does) as
/// one CUDA graph: the first replay() captures tp.replay() on nn's stream, later ones relaunch the
/// graph, which costs one launch instead of one per kernel and allocates nothing.
///
/// A graph bakes in every buffer address and shape. Before each launch the replay compares the
/// tape's nodes (their ops, buffers, bound parameter tensors, shapes) with those it captured and
/// captures again when anything differs: a re-recorded tape (a new batch shape, as on the CPU), a
/// parameter tensor replaced (model.to(), load_weights), or an input slot pointed at another
/// tensor with tp.set(). Feed batches with set() instead: it copies the batch into a buffer the
/// replay owns, so the graph stays valid. Writing into a bound tensor in place (an optimizer step,
/// a copy into a tensor given to tp.input()) is seen by the next launch as it is.
///
/// Random keys (Dropout) live in device slots that tp.refresh_keys() rewrites in place, so call
/// it before replay() as on the CPU. Index checks (gather_rows, pick, cross_entropy) run inside
/// the graph; replay() waits for the device and raises the first one found. The optimizer update
/// is not in the graph: it reads the learning rate on the host, eagerly, after replay().
class CudaGraphReplay {
 public:
  CudaGraphReplay() = default;
  explicit CudaGraphReplay(GTape<cuda>& tp) : tp_(&tp) {}
  CudaGraphReplay(const CudaGraphReplay&) = delete;
  CudaGraphReplay& operator=(const CudaGraphReplay&) = delete;
  CudaGraphReplay(CudaGraphReplay&& o) noexcept { *this = std::move(o); }
  CudaGraphReplay& operator=(CudaGraphReplay&& o) noexcept {
    if (this != &o) {
      destroy();
      tp_ = std::exchange(o.tp_, nullptr);
      exec_ = std::exchange(o.exec_, nullptr);
      sig_ = std::move(o.sig_);
      owned_ = std::move(o.owned_);
      captures_ = o.captures_;
    }
    return *this;
  }
  ~CudaGraphReplay() { destroy(); }

  /// Replays `tp` from now on (forgetting the graph of another tape).
  void bind(GTape<cuda>& tp) {
    if (tp_ != &tp) {
      reset();
      tp_ = &tp;
    }
  }

  /// Puts `t` (host or device, the slot's shape and dtype) into input slot `slot`. The first set
  /// of a slot gives it a buffer this replay owns (the caller's tensor is never written); each
  /// later set is one copy into that buffer, which the graph reads.
  void set(GVar slot, const Tensor& t) {
    Node<cuda>& n = tape().node(slot);
    if (n.leaf != LeafKind::input)
      detail::fail("cuda_graph.set", "only input slots can be set; node ", slot.index, " is a ", n.name());
    if (!(t.shape() == n.value.shape()) || t.dtype() != n.value.dtype())
      detail::fail("cuda_graph.set", "input slot ", slot.index, " was recorded as ", n.value.shape().str(), " ",
                   dtype_name(n.value.dtype()), ", got ", t.shape().str(), " ", dtype_name(t.dtype()),
                   " (a new shape needs a new recording)");
    auto it = owned_.find(slot.index);
    if (it == owned_.end()) it = owned_.emplace(slot.index, cuda::alloc(n.value.shape(), n.value.dtype())).first;
    // The first time (a new address: the next launch captures again, once), or after a tp.set()
    // pointed the slot elsewhere (back to the address the graph was captured with).
    if (!n.value.shares_storage(it->second)) tape().set(slot, it->second);
    if (t.nbytes())
      NN_CUDA_CHECK(cudaMemcpyAsync(n.value.raw(), t.raw(), t.nbytes(), cudaMemcpyDefault, cuda::stream()));
  }

  /// Launches the graph (capturing it first when the tape changed), waits for it, and raises an
  /// index error it recorded.
  void replay() {
    launch();
    cuda::synchronize();
  }

  /// Launches the graph without waiting (the results are ready when nn's stream gets there: any
  /// copy to the host waits for them). Index errors surface at the next cuda::synchronize().
  void launch() {
    signature(now_);
    if (!exec_ || now_ != sig_) capture();
    NN_CUDA_CHECK(cudaGraphLaunch(exec_, cuda::stream()));
  }

  /// Forgets the graph and the slot buffers (the tape was recorded again).
  void reset() {
    destroy();
    sig_.clear();
    owned_.clear();
  }

  /// How many times a graph was captured (1 for a steady run of one shape).
  int captures() const { return captures_; }

 private:
  GTape<cuda>& tape() {
    if (!tp_) detail::fail("cuda_graph", "no tape is bound: construct CudaGraphReplay(tape) or call bind(tape)");
    return *tp_;
  }

  void destroy() {
    if (exec_) cudaGraphExecDestroy(exec_);  // no check: also runs from destructors at exit
    exec_ = nullptr;
  }

  /// Everything the captured kernels depend on, node by node: op, leaf kind, the addresses and
  /// sizes of value, gradient and saved buffers, the bound tensor, the inputs.
  void signature(std::vector<std::uintptr_t>& out) {
    GTape<cuda>& tp = tape();
    out.clear();
    auto put = [&](const Tensor& t) {
      out.push_back(reinterpret_cast<std::uintptr_t>(t.raw()));
      out.push_back(t.defined() ? static_cast<std::uintptr_t>(t.numel()) : 0);
      out.push_back(t.defined() ? static_cast<std::uintptr_t>(t.dtype()) : 0);
      for (std::int64_t d : t.shape()) out.push_back(static_cast<std::uintptr_t>(d));
    };
    for (std::size_t i = 0; i < tp.size(); ++i) {
      Node<cuda>& n = tp.at(static_cast<std::int32_t>(i));
      out.push_back(reinterpret_cast<std::uintptr_t>(n.def));
      out.push_back(static_cast<std::uintptr_t>(n.leaf));
      put(n.leaf == LeafKind::param && n.bound ? *n.bound : n.value);
      put(n.grad);
      out.push_back(n.saved.size());
      for (const Tensor& s : n.saved) put(s);
      for (std::int32_t k : n.inputs) out.push_back(static_cast<std::uintptr_t>(k));
    }
  }

  void capture() {
    destroy();
    GTape<cuda>& tp = tape();
    detail::cu::Context& c = detail::cu::ctx();
    const CudaMemoryStats before = cuda::memory_stats();
    // Thread-local mode: an unsafe call from this thread (a synchronising copy, a host wait)
    // fails the capture instead of silently running outside the graph.
    NN_CUDA_CHECK(cudaStreamBeginCapture(c.stream, cudaStreamCaptureModeThreadLocal));
    c.capturing = true;
    try {
      tp.replay();
    } catch (...) {
      c.capturing = false;
      cudaGraph_t broken = nullptr;
      cudaStreamEndCapture(c.stream, &broken);
      if (broken) cudaGraphDestroy(broken);
      cudaGetLastError();
      throw;
    }
    c.capturing = false;
    cudaGraph_t graph = nullptr;
    NN_CUDA_CHECK(cudaStreamEndCapture(c.stream, &graph));
    const cudaError_t e = cudaGraphInstantiate(&exec_, graph, 0);
    cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
      exec_ = nullptr;
      detail::cu::fail_cuda(e, "cudaGraphInstantiate(&exec_, graph, 0)");
    }
    // A buffer made during the capture could be freed and handed to another tensor while the
    // graph still writes it: a replay must own all its memory before it is captured.
    if (cuda::memory_stats().alloc_calls != before.alloc_calls) {
      destroy();
      detail::fail("cuda_graph", "device memory was allocated while capturing the replay (",
                   cuda::memory_stats().alloc_calls - before.alloc_calls,
                   " allocations); run the step once eagerly (record + backward) before replaying it");
    }
    signature(sig_);
    ++captures_;
  }

  GTape<cuda>* tp_ = nullptr;
  cudaGraphExec_t exec_ = nullptr;
  std::vector<std::uintptr_t> sig_, now_;  // captured vs current signature (capacity reused)
  std::map<std::int32_t, Tensor> owned_;   // input slots whose buffer this replay owns
  int captures_ = 0;
};

namespace detail {
/// A compiled step on CUDA (nn::compile<N, nn::cuda>) replays through a CUDA graph.
template <>
struct TapeReplayer<cuda> {
  CudaGraphReplay graph;
  void set(GTape<cuda>& tp, GVar slot, const Tensor& t) {
    graph.bind(tp);
    graph.set(slot, t);
  }
  void replay(GTape<cuda>& tp) {
    graph.bind(tp);
    graph.replay();
  }
  void reset() { graph.reset(); }
};
}  // namespace detail

}  // namespace nn

#undef NN_CUDA_CHECK
#undef NN_CUBLAS_CHECK
