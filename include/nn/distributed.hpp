// SPDX-License-Identifier: MIT OR Apache-2.0
// Data-parallel training on MPI (MLX's mx.distributed + nn.average_gradients, PyTorch DDP's
// semantics): every rank holds the whole model, takes its share of each global batch, and the
// ranks average their gradients between backward and the update, so N ranks train the same
// model one process would on the same global batches.
//
//   auto world = nn::distributed::init();              // MPI_Init once; size 1 without mpirun
//   nn::distributed::broadcast_parameters(model, world);   // rank 0's initial weights everywhere
//   nn::distributed::GradientAverager avg(world);
//   auto step = nn::compile<2>(model, opt, loss_fn);
//   step.reduce_gradients(avg);                         // between backward and the update
//   for (...) { avg.set_weight(real_tokens_of_my_rows); step(x_mine, y_mine); }
//
// Token weighting. Each rank's loss is the mean over its own real tokens n_r; the averager
// returns sum_r n_r g_r / sum_r n_r, the gradient of the mean over all N = sum_r n_r tokens --
// the answer one process gives on the whole global batch, even when ranks hold different
// numbers of real tokens (not the plain mean of per-rank means; transformers #34242).
// weighted_mean() gives the matching global loss for logs.
//
// MPI only where this header is included: a target that links nn::distributed (CMake) is built
// with NN_WITH_MPI and MPI::MPI_CXX. Without NN_WITH_MPI every group is a single process (size
// 1, every collective the identity), so the same program builds and runs without MPI.
// Collectives run from the thread that called init() (MPI_THREAD_FUNNELED): host tensors through
// MPI; device tensors (nn::cuda) through NCCL where the program is built with NN_WITH_NCCL
// (nvcc, -lnccl), on a communicator of the group's ranks made at the first device collective
// (each rank uses the GPU current when it makes it: cudaSetDevice(local rank) first).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <span>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "compile.hpp"
#include "module.hpp"
#include "random.hpp"
#include "tensor.hpp"

#if defined(NN_WITH_MPI)
// nn calls MPI's C API only: skip the deprecated C++ bindings' header (and its warnings).
#ifndef OMPI_SKIP_MPICXX
#define OMPI_SKIP_MPICXX 1
#endif
#ifndef MPICH_SKIP_MPICXX
#define MPICH_SKIP_MPICXX 1
#endif
#include <mpi.h>
#endif
#if defined(NN_WITH_NCCL)
// Device tensors (nn::cuda) are reduced by NCCL on the group's ranks; its unique id travels by the
// group's own broadcast (MPI, or nothing for one process), as llm.c does.
#include <cuda_runtime.h>
#include <nccl.h>
#endif

namespace nn::distributed {

/// MLX's default: gradients are packed into buffers of this many bytes, so a step makes a few
/// allreduces rather than one per parameter.
inline constexpr std::size_t kDefaultBucketBytes = std::size_t{32} << 20;

namespace detail {
using nn::detail::fail;

/// FNV-1a over bytes: the fingerprints ranks compare (equal on every rank iff the described
/// layout is; collisions only hide a mismatch, they never invent one).
inline std::uint64_t fnv1a(std::string_view s, std::uint64_t h = 1469598103934665603ull) {
  for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
  return h;
}

/// "dtype shape" of a tensor, as ranks print and compare it.
inline std::string describe(const Tensor& t) {
  if (!t.defined()) return "empty";
  return std::string(dtype_name(t.dtype())) + " " + t.shape().str();
}

inline bool on_device(const Tensor& t) { return t.defined() && t.device() != Device::cpu; }

#if defined(NN_WITH_NCCL)
inline void nccl_check(ncclResult_t rc, const char* op) {
  if (rc != ncclSuccess) fail(op, "NCCL error ", static_cast<int>(rc), ": ", ncclGetErrorString(rc));
}
inline void cuda_check(cudaError_t rc, const char* op) {
  if (rc != cudaSuccess) fail(op, "CUDA error: ", cudaGetErrorString(rc));
}
inline ncclDataType_t nccl_type(DType dt, const char* op) {
  switch (dt) {
    case DType::f32: return ncclFloat32;
    case DType::f64: return ncclFloat64;
    case DType::bf16: return ncclBfloat16;
    case DType::f16: return ncclFloat16;
    case DType::i32: return ncclInt32;
    case DType::i64: return ncclInt64;
    case DType::u32: return ncclUint32;
    case DType::u8: return ncclUint8;
  }
  fail(op, "no NCCL type for ", dtype_name(dt));
}
/// A group's NCCL communicator, made at its first device collective and shared by its copies.
struct NcclComm {
  ncclComm_t comm = nullptr;
  NcclComm() = default;
  NcclComm(const NcclComm&) = delete;
  NcclComm& operator=(const NcclComm&) = delete;
  ~NcclComm() {
    if (comm) ncclCommDestroy(comm);
  }
};
#endif

/// Without NCCL a device tensor can only be "reduced" over one rank (the identity).
inline void require_nccl(int group_size, const char* op) {
#if !defined(NN_WITH_NCCL)
  if (group_size > 1)
    fail(op, "device tensors over ", group_size, " ranks need NCCL: build with NN_WITH_NCCL (nvcc, -lnccl), or copy them to the host");
#else
  (void)group_size, (void)op;
#endif
}
}  // namespace detail

/// A set of ranks that run collectives together (an MPI communicator). Cheap to copy: copies
/// share the communicator, freed with the last copy.
class Group {
 public:
  /// The single-process group: rank 0 of 1, every collective the identity.
  Group() = default;

  int rank() const { return rank_; }
  int size() const { return size_; }

  /// Ranks with the same color form one new group, ordered by key (default: this rank), as
  /// MPI_Comm_split. Every rank of this group must call it.
  Group split(int color, int key = -1) const {
#if defined(NN_WITH_MPI)
    if (comm_) {
      MPI_Comm out;
      check(MPI_Comm_split(*comm_, color, key < 0 ? rank_ : key, &out), "split");
      return Group(out, /*owned=*/true);
    }
#endif
    (void)color, (void)key;
    return Group();
  }

  /// t = the elementwise sum of t over the group's ranks, in place. Every rank passes the same
  /// dtype and element count (checked: a mismatch is an nn::Error on every rank, not a hang).
  /// bf16/f16 are summed in float32 and rounded once, as MPI has no half-precision sum.
  void all_sum(Tensor& t) const {
    if (detail::on_device(t)) return device_all_sum(t);
    if (size_ == 1 || !t.defined()) return;
    agree(detail::describe(t), "all_sum");
    sum_in_place(t.raw(), static_cast<std::size_t>(t.numel()), t.dtype(), "all_sum");
  }

  /// The tensors of every rank stacked along a new leading axis: (size, ...t's shape). Every rank
  /// passes the same dtype and shape.
  Tensor all_gather(const Tensor& t) const {
    if (detail::on_device(t)) detail::fail("all_gather", "takes host tensors (a device tensor: copy it to the host)");
    std::vector<std::int64_t> dims{size_};
    for (std::int64_t d : t.shape()) dims.push_back(d);
    Tensor out = Tensor::empty(Shape(dims), t.dtype());
    if (size_ == 1) {
      if (t.nbytes()) std::memcpy(out.raw(), t.raw(), t.nbytes());
      return out;
    }
#if defined(NN_WITH_MPI)
    agree(detail::describe(t), "all_gather");
    check(MPI_Allgather(t.raw(), static_cast<int>(t.nbytes()), MPI_BYTE, out.raw(), static_cast<int>(t.nbytes()),
                        MPI_BYTE, *comm_),
          "all_gather");
#endif
    return out;
  }

  /// t = root's t on every rank, in place. Every rank passes the same dtype and shape.
  void broadcast(Tensor& t, int root = 0) const {
    if (root < 0 || root >= size_) detail::fail("broadcast", "root ", root, " is not a rank of this group of ", size_);
    if (detail::on_device(t)) return device_broadcast(t, root);
    if (size_ == 1 || !t.defined()) return;
    agree(detail::describe(t), "broadcast");
#if defined(NN_WITH_MPI)
    bytes_in_chunks(t.raw(), t.nbytes(), [&](void* p, int n) {
      check(MPI_Bcast(p, n, MPI_BYTE, root, *comm_), "broadcast");
    });
#endif
  }

  /// Waits until every rank of the group has called it.
  void barrier() const {
#if defined(NN_WITH_MPI)
    if (comm_) check(MPI_Barrier(*comm_), "barrier");
#endif
  }

  /// The sum of one double over the ranks (token counts, losses).
  double sum(double v) const {
    if (size_ > 1) sum_in_place(&v, 1, DType::f64, "sum");
    return v;
  }

  /// Raises the same nn::Error on every rank unless every rank passed the same `listing` (one
  /// item per line: what `op` is about to exchange). Ranks that disagree before a collective
  /// whose sizes depend on it would wait on each other for ever; this costs one 16-byte
  /// allreduce of a fingerprint, and only a mismatch gathers the listings to name the first
  /// item (line) where some rank differs from rank 0. fingerprint: fnv1a(listing), passed in
  /// so that a caller reusing one listing need not hash it each time.
  void agree(const std::string& listing, const char* op, std::uint64_t fingerprint) const {
    if (size_ == 1) return;
#if defined(NN_WITH_MPI)
    // AND over (h, ~h): both come back unchanged on a rank iff every rank's h equals its own.
    std::uint64_t v[2] = {fingerprint, ~fingerprint};
    check(MPI_Allreduce(MPI_IN_PLACE, v, 2, MPI_UINT64_T, MPI_BAND, *comm_), op);
    if (v[0] == fingerprint && v[1] == ~fingerprint) return;
    const std::vector<std::string> all = gather_strings(listing, op);
    auto line = [](const std::string& s, std::size_t i) -> std::string {
      std::istringstream is(s);
      std::string l;
      for (std::size_t k = 0; k <= i; ++k)
        if (!std::getline(is, l)) return "(nothing more)";
      return l;
    };
    std::size_t lines = 1;
    for (const std::string& s : all) lines = std::max<std::size_t>(lines, 1 + std::count(s.begin(), s.end(), '\n'));
    for (std::size_t i = 0; i < lines; ++i)
      for (std::size_t r = 1; r < all.size(); ++r)
        if (line(all[0], i) != line(all[r], i))
          detail::fail(op, "the ranks disagree", lines > 2 ? " at item " + std::to_string(i) : std::string(),
                       ": rank 0 has '", line(all[0], i), "', rank ", r, " has '", line(all[r], i), "'");
    detail::fail(op, "the ranks disagree on what to exchange");  // unreachable: the fingerprints differ
#else
    (void)listing, (void)op, (void)fingerprint;
#endif
  }
  void agree(const std::string& listing, const char* op) const { agree(listing, op, detail::fnv1a(listing)); }

  /// Every rank's string, in rank order.
  std::vector<std::string> gather_strings(const std::string& mine, const char* op) const {
    if (size_ == 1) return {mine};
    std::vector<std::string> out(static_cast<std::size_t>(size_));
#if defined(NN_WITH_MPI)
    int n = static_cast<int>(mine.size());
    std::vector<int> counts(static_cast<std::size_t>(size_)), offs(static_cast<std::size_t>(size_));
    check(MPI_Allgather(&n, 1, MPI_INT, counts.data(), 1, MPI_INT, *comm_), op);
    int total = 0;
    for (int r = 0; r < size_; ++r) offs[static_cast<std::size_t>(r)] = total, total += counts[static_cast<std::size_t>(r)];
    std::string all(static_cast<std::size_t>(total), '\0');
    check(MPI_Allgatherv(mine.data(), n, MPI_CHAR, all.data(), counts.data(), offs.data(), MPI_CHAR, *comm_), op);
    for (int r = 0; r < size_; ++r)
      out[static_cast<std::size_t>(r)] = all.substr(static_cast<std::size_t>(offs[static_cast<std::size_t>(r)]),
                                                    static_cast<std::size_t>(counts[static_cast<std::size_t>(r)]));
#else
    (void)op;
#endif
    return out;
  }

  /// The elementwise sum over ranks of `count` values of dtype `dt` at p, in place (no checks:
  /// the caller has made the ranks agree on count and dtype).
  void sum_in_place(void* p, std::size_t count, DType dt, const char* op) const {
    if (size_ == 1 || count == 0) return;
#if defined(NN_WITH_MPI)
    if (dt == DType::bf16 || dt == DType::f16) {  // no MPI half types: widen, sum, round once
      std::vector<float> wide(count);
      auto* h = static_cast<std::uint16_t*>(p);
      for (std::size_t i = 0; i < count; ++i)
        wide[i] = dt == DType::bf16 ? half::bf16_to_f32(h[i]) : half::f16_to_f32(h[i]);
      sum_in_place(wide.data(), count, DType::f32, op);
      for (std::size_t i = 0; i < count; ++i)
        h[i] = dt == DType::bf16 ? half::f32_to_bf16(wide[i]) : half::f32_to_f16(wide[i]);
      return;
    }
    const MPI_Datatype type = mpi_type(dt);
    const std::size_t width = dtype_size(dt);
    bytes_in_chunks(p, count * width, [&](void* q, int nbytes) {
      check(MPI_Allreduce(MPI_IN_PLACE, q, nbytes / static_cast<int>(width), type, MPI_SUM, *comm_), op);
    });
#else
    (void)p, (void)dt, (void)op;
#endif
  }

  /// Device tensors (NCCL): t = sum over ranks in place, and root's t everywhere. Every rank
  /// passes the same dtype and shape (checked on the host first). NCCL is used at every group
  /// size, one rank included, so a 1-rank run exercises the same path.
  void device_all_sum(Tensor& t) const {
    agree(detail::describe(t), "all_sum");
#if defined(NN_WITH_NCCL)
    device_sync("all_sum");
    detail::nccl_check(ncclAllReduce(t.raw(), t.raw(), static_cast<std::size_t>(t.numel()),
                                     detail::nccl_type(t.dtype(), "all_sum"), ncclSum, nccl("all_sum"), nullptr),
                       "all_sum");
    device_sync("all_sum");
#else
    detail::require_nccl(size_, "all_sum");
#endif
  }
  void device_broadcast(Tensor& t, int root) const {
    agree(detail::describe(t), "broadcast");
#if defined(NN_WITH_NCCL)
    device_sync("broadcast");
    detail::nccl_check(ncclBroadcast(t.raw(), t.raw(), static_cast<std::size_t>(t.numel()),
                                     detail::nccl_type(t.dtype(), "broadcast"), root, nccl("broadcast"), nullptr),
                       "broadcast");
    device_sync("broadcast");
#else
    (void)root;
    detail::require_nccl(size_, "broadcast");
#endif
  }

#if defined(NN_WITH_NCCL)
  /// The group's NCCL communicator: made on first use (rank 0's unique id broadcast to the
  /// others), on the GPU current on each rank at that moment.
  ncclComm_t nccl(const char* op) const {
    if (!nccl_->comm) {
      ncclUniqueId id{};
      if (rank_ == 0) detail::nccl_check(ncclGetUniqueId(&id), op);
#if defined(NN_WITH_MPI)
      if (comm_) check(MPI_Bcast(&id, sizeof id, MPI_BYTE, 0, *comm_), op);
#endif
      detail::nccl_check(ncclCommInitRank(&nccl_->comm, size_, id, rank_), op);
    }
    return nccl_->comm;
  }
  // Kernels queued on any stream (nn::cuda's own included) finish before NCCL reads, and NCCL's
  // result is complete before the caller goes on.
  static void device_sync(const char* op) { detail::cuda_check(cudaDeviceSynchronize(), op); }
#endif

#if defined(NN_WITH_MPI)
  /// The group of an existing communicator (not freed by nn). Errors on it return codes, which
  /// nn turns into nn::Error.
  explicit Group(MPI_Comm comm) : Group(comm, false) {}
  MPI_Comm comm() const { return comm_ ? *comm_ : MPI_COMM_SELF; }

 private:
  Group(MPI_Comm comm, bool owned) {
    comm_ = std::shared_ptr<MPI_Comm>(new MPI_Comm(comm), [owned](MPI_Comm* c) {
      int done = 0;
      MPI_Finalized(&done);
      if (owned && !done) MPI_Comm_free(c);
      delete c;
    });
    MPI_Comm_set_errhandler(comm, MPI_ERRORS_RETURN);
    check(MPI_Comm_rank(comm, &rank_), "init");
    check(MPI_Comm_size(comm, &size_), "init");
  }

  static void check(int rc, const char* op) {
    if (rc == MPI_SUCCESS) return;
    char msg[MPI_MAX_ERROR_STRING];
    int len = 0;
    MPI_Error_string(rc, msg, &len);
    detail::fail(op, "MPI error ", rc, ": ", std::string(msg, static_cast<std::size_t>(len)));
  }

  static MPI_Datatype mpi_type(DType dt) {
    switch (dt) {
      case DType::f32: return MPI_FLOAT;
      case DType::f64: return MPI_DOUBLE;
      case DType::i32: return MPI_INT32_T;
      case DType::i64: return MPI_INT64_T;
      case DType::u32: return MPI_UINT32_T;
      case DType::u8: return MPI_UINT8_T;
      default: break;
    }
    detail::fail("distributed", "no MPI type for ", dtype_name(dt));
  }

  // MPI counts are int: a buffer past 2^31 bytes goes in pieces of 1 GiB.
  template <class F>
  static void bytes_in_chunks(void* p, std::size_t nbytes, F&& f) {
    constexpr std::size_t kChunk = std::size_t{1} << 30;
    auto* c = static_cast<char*>(p);
    for (std::size_t off = 0; off < nbytes; off += kChunk) f(c + off, static_cast<int>(std::min(kChunk, nbytes - off)));
  }

  std::shared_ptr<MPI_Comm> comm_;
#else
 private:
#endif
  int rank_ = 0, size_ = 1;
#if defined(NN_WITH_NCCL)
  std::shared_ptr<detail::NcclComm> nccl_ = std::make_shared<detail::NcclComm>();
#endif

  friend Group init();
};

/// The world group. Initialises MPI on first use (MPI_THREAD_FUNNELED: nn's own threads never
/// call MPI) and finalises it at exit. Without mpirun, MPI's singleton start gives size 1; a
/// build without NN_WITH_MPI always gives size 1.
inline Group init() {
#if defined(NN_WITH_MPI)
  int inited = 0;
  MPI_Initialized(&inited);
  if (!inited) {
    int provided = 0;
    if (MPI_Init_thread(nullptr, nullptr, MPI_THREAD_FUNNELED, &provided) != MPI_SUCCESS)
      detail::fail("init", "MPI_Init_thread failed");
    std::atexit([] {
      int done = 0;
      MPI_Finalized(&done);
      if (!done) MPI_Finalize();
    });
  }
  return Group(MPI_COMM_WORLD);
#else
  return Group();
#endif
}

/// Whether this build talks to MPI (NN_WITH_MPI) or runs every group as one process.
constexpr bool with_mpi() {
#if defined(NN_WITH_MPI)
  return true;
#else
  return false;
#endif
}

/// sum_r value_r * weight_r / sum_r weight_r: the global mean loss from each rank's mean over its
/// own weight_r tokens.
/// A rank of weight 0 adds nothing, even when its own mean is NaN (no real token: 0 / 0).
inline double weighted_mean(const Group& g, double value, double weight) {
  double v[2] = {weight == 0 ? 0.0 : value * weight, weight};
  if (g.size() > 1) g.sum_in_place(v, 2, DType::f64, "weighted_mean");
  if (v[1] == 0) detail::fail("weighted_mean", "the ranks' weights sum to 0 (no rank had a real token)");
  return v[0] / v[1];
}

/// Makes every rank agree on a model's parameter tree -- the same paths in the same order, each
/// with the same dtype and shape -- or raises the same nn::Error on every rank naming the first
/// path that differs and what each rank holds there.
template <class M>
void check_same_structure(const M& model, const Group& g, const char* op = "check_same_structure") {
  std::string layout;
  nn::detail::for_each(
      model, [&](const std::string& path, const Param& p) { layout += path + ": " + detail::describe(p.value) + "\n"; },
      [&](const std::string& path, const Buffer& b) { layout += path + ": buffer " + detail::describe(b.value) + "\n"; });
  g.agree(layout, op);
}

/// Rank `root`'s parameters and buffers on every rank (the initial weights of a data-parallel
/// run), after check_same_structure. trainable_only: the trainable parameters alone (a frozen
/// base every rank loaded from the same file need not travel; LoRA's random A must).
template <class M>
void broadcast_parameters(M& model, const Group& g, int root = 0, bool trainable_only = false) {
  check_same_structure(model, g, "broadcast_parameters");
  if (g.size() == 1) return;
  nn::detail::for_each(
      model, [&](const std::string&, Param& p) { if (p.trainable || !trainable_only) g.broadcast(p.value, root); },
      [&](const std::string&, Buffer& b) { if (!trainable_only) g.broadcast(b.value, root); });
}

/// Averages gradients over a group, token-weighted: each call turns every rank's gradients g_r
/// into sum_r w_r g_r / sum_r w_r, where w_r is the weight set_weight() gave on rank r (default
/// 1: the plain mean). The leaves are scaled by w_r / sum w in place, packed in order into
/// buckets of up to bucket_bytes of one dtype (a leaf as large as a bucket goes alone, in
/// place), each bucket summed by one allreduce, and unpacked. The plan and its bucket buffer are
/// made once per gradient layout, so a compiled step's replay allocates nothing here.
///
/// Before each reduction the ranks agree on the layout (one 16-byte allreduce): ranks holding
/// different trees raise the same nn::Error naming the first differing path instead of hanging.
class GradientAverager {
 public:
  explicit GradientAverager(Group g, std::size_t bucket_bytes = kDefaultBucketBytes)
      : g_(std::move(g)), bucket_bytes_(std::max<std::size_t>(bucket_bytes, 64)) {}

  /// This rank's weight for the next reduction: its count of real (unmasked) tokens.
  void set_weight(double w) {
    if (!(w >= 0)) nn::detail::fail("GradientAverager", "a rank's weight must be >= 0, not ", w);
    weight_ = w;
  }
  /// sum_r w_r of the last reduction.
  double total_weight() const { return total_; }
  /// How many allreduces the last reduction made (the weight sum and layout check not counted).
  int buckets() const { return static_cast<int>(plan_.size()); }
  const Group& group() const { return g_; }

  /// The compiled step's hook (CompiledStep::reduce_gradients): the tape's gradient buffers.
  void operator()(std::span<const GradBuffer> slots) { reduce(slots); }

  /// A gradient tree of the model's type (value_and_grad's result), in place.
  template <class M>
  void average(M& grads) {
    std::vector<GradBuffer> slots;
    nn::detail::for_each(grads, [&](const std::string& path, Param& p) {
      if (p.value.defined() && is_floating(p.value.dtype())) slots.push_back({path, &p.value});
    });
    reduce(slots);
  }

 private:
  struct Bucket {
    std::size_t first, last;  // slots [first, last)
    std::size_t bytes;
    bool in_place;  // one leaf, reduced where it lies
  };

  void reduce(std::span<const GradBuffer> slots) {
    const bool device = !slots.empty() && detail::on_device(*slots.front().grad);
    for (const GradBuffer& s : slots)
      if (detail::on_device(*s.grad) != device)
        nn::detail::fail("average_gradients", "'", s.path, "' is on ", s.grad->device(), " but '", slots.front().path,
                         "' on ", slots.front().grad->device(), ": one reduction takes one device's gradients");
    if (!same_layout(slots)) plan(slots, device);
    if (device) return reduce_device(slots);
    if (g_.size() == 1) {
      total_ = weight_;
      return;
    }
    // Weight sum and layout agreement: one small allreduce each.
    g_.agree(layout_, "average_gradients", fingerprint_);
    total_ = g_.sum(weight_);
    if (total_ == 0) nn::detail::fail("average_gradients", "the ranks' weights sum to 0 (no rank had a real token)");
    const double f = weight_ / total_;
    for (const Bucket& b : plan_) {
      if (b.in_place) {
        Tensor& t = *slots[b.first].grad;
        scale(t.raw(), static_cast<std::size_t>(t.numel()), t.dtype(), f);
        g_.sum_in_place(t.raw(), static_cast<std::size_t>(t.numel()), t.dtype(), "average_gradients");
        continue;
      }
      const DType dt = slots[b.first].grad->dtype();
      char* buf = buffer_.data();
      std::size_t off = 0;
      for (std::size_t i = b.first; i < b.last; ++i) {
        const Tensor& t = *slots[i].grad;
        std::memcpy(buf + off, t.raw(), t.nbytes());
        off += t.nbytes();
      }
      scale(buf, off / dtype_size(dt), dt, f);
      g_.sum_in_place(buf, off / dtype_size(dt), dt, "average_gradients");
      off = 0;
      for (std::size_t i = b.first; i < b.last; ++i) {
        Tensor& t = *slots[i].grad;
        std::memcpy(t.raw(), buf + off, t.nbytes());
        off += t.nbytes();
      }
    }
  }

  // Device gradients: one NCCL allreduce per leaf, grouped into one launch, each with NCCL's
  // pre-multiplied sum (sum_r f_r x_r, f_r = w_r / sum w) -- no packing, no scratch buffer. Runs
  // at one rank too (f = 1), so a 1-rank NCCL group must equal no group bit for bit.
  void reduce_device(std::span<const GradBuffer> slots) {
    g_.agree(layout_, "average_gradients", fingerprint_);
    total_ = g_.sum(weight_);
    if (total_ == 0) nn::detail::fail("average_gradients", "the ranks' weights sum to 0 (no rank had a real token)");
#if defined(NN_WITH_NCCL)
    const char* op = "average_gradients";
    ncclComm_t comm = g_.nccl(op);
    const double f64 = weight_ / total_;
    const float f32 = static_cast<float>(f64);
    ncclRedOp_t sum32, sum64;
    detail::nccl_check(ncclRedOpCreatePreMulSum(&sum32, const_cast<float*>(&f32), ncclFloat32, ncclScalarHostImmediate, comm), op);
    detail::nccl_check(ncclRedOpCreatePreMulSum(&sum64, const_cast<double*>(&f64), ncclFloat64, ncclScalarHostImmediate, comm), op);
    Group::device_sync(op);
    detail::nccl_check(ncclGroupStart(), op);
    for (const GradBuffer& s : slots) {
      Tensor& t = *s.grad;
      if (t.dtype() != DType::f32 && t.dtype() != DType::f64)
        nn::detail::fail(op, "'", s.path, "': gradients of dtype ", dtype_name(t.dtype()), " are not averaged (f32 and f64 are)");
      const bool single = t.dtype() == DType::f32;
      detail::nccl_check(ncclAllReduce(t.raw(), t.raw(), static_cast<std::size_t>(t.numel()), single ? ncclFloat32 : ncclFloat64,
                                       single ? sum32 : sum64, comm, nullptr),
                         op);
    }
    detail::nccl_check(ncclGroupEnd(), op);
    Group::device_sync(op);
    ncclRedOpDestroy(sum32, comm);
    ncclRedOpDestroy(sum64, comm);
#else
    (void)slots;
    detail::require_nccl(g_.size(), "average_gradients");
#endif
  }

  // x *= f; f == 0 (a rank without real tokens) writes zeros, so its 0/0 NaNs do not spread.
  static void scale(void* p, std::size_t n, DType dt, double f) {
    if (f == 1.0) return;
    if (f == 0.0 && (dt == DType::f32 || dt == DType::f64)) {
      std::memset(p, 0, n * dtype_size(dt));
      return;
    }
    if (dt == DType::f32) {
      auto* x = static_cast<float*>(p);
      const float s = static_cast<float>(f);
      for (std::size_t i = 0; i < n; ++i) x[i] *= s;
    } else if (dt == DType::f64) {
      auto* x = static_cast<double*>(p);
      for (std::size_t i = 0; i < n; ++i) x[i] *= f;
    } else {
      nn::detail::fail("average_gradients", "gradients of dtype ", dtype_name(dt), " are not averaged (f32 and f64 are)");
    }
  }

  bool same_layout(std::span<const GradBuffer> slots) const {
    if (slots.size() != seen_.size()) return false;
    for (std::size_t i = 0; i < slots.size(); ++i)
      if (slots[i].grad != seen_[i].first || slots[i].grad->nbytes() != seen_[i].second) return false;
    return true;
  }

  // The buckets for this layout, and its fingerprint (paths, dtypes and shapes; the pointers are
  // this process's own and stay out of it). A mismatch names the first differing path.
  void plan(std::span<const GradBuffer> slots, bool device) {
    seen_.clear();
    plan_.clear();
    std::string layout;
    std::size_t largest = 0;
    for (std::size_t i = 0; i < slots.size(); ++i) {
      const Tensor& t = *slots[i].grad;
      seen_.emplace_back(slots[i].grad, t.nbytes());
      layout += slots[i].path + ": " + detail::describe(t) + "\n";
      const bool alone = t.nbytes() >= bucket_bytes_;
      if (alone) {
        plan_.push_back({i, i + 1, t.nbytes(), true});
        continue;
      }
      Bucket* b = plan_.empty() ? nullptr : &plan_.back();
      if (!b || b->in_place || slots[b->first].grad->dtype() != t.dtype() || b->bytes + t.nbytes() > bucket_bytes_)
        plan_.push_back({i, i + 1, t.nbytes(), false});
      else
        b->last = i + 1, b->bytes += t.nbytes();
      if (!plan_.back().in_place) largest = std::max(largest, plan_.back().bytes);
    }
    fingerprint_ = detail::fnv1a(layout);
    layout_ = std::move(layout);
    buffer_.assign(device ? 0 : largest, 0);  // device gradients are reduced where they lie
  }

  Group g_;
  std::size_t bucket_bytes_;
  double weight_ = 1.0, total_ = 0;
  std::vector<std::pair<const Tensor*, std::size_t>> seen_;
  std::vector<Bucket> plan_;
  std::vector<char> buffer_;
  std::string layout_;  // "path: dtype shape" per line, what the ranks must agree on
  std::uint64_t fingerprint_ = 0;
};

/// Averages a gradient tree over the group in place (one call; for a loop, keep a
/// GradientAverager so its buffers are reused). weight: this rank's real-token count (see
/// GradientAverager); 1 gives the plain mean.
template <class M>
void average_gradients(M& grads, const Group& g, double weight = 1.0, std::size_t bucket_bytes = kDefaultBucketBytes) {
  GradientAverager avg(g, bucket_bytes);
  avg.set_weight(weight);
  avg.average(grads);
}

/// Seeds nn::random's global sequence per rank: key = seed + rank (documented so that a run's
/// dropout masks can be reproduced rank by rank). Every rank draws different masks, as DDP's
/// processes do; the same (seed, rank) always draws the same ones.
inline void seed(const Group& g, std::uint64_t s) { nn::random::seed(s + static_cast<std::uint64_t>(g.rank())); }

}  // namespace nn::distributed
