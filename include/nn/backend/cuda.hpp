// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cuda: the CUDA backend policy. GEMM goes to cuBLAS, every other kernel is nn's own
// (backend/cuda/kernels.cuh); all work runs in order on one stream, from a caching allocator.
// Compiled by nvcc only: a CPU-only program never needs the CUDA toolkit.
#pragma once

#if !defined(__CUDACC__)
#error "include <nn/cuda.hpp> from a .cu file compiled by nvcc"
#endif

#include <optional>

#include "cpu.hpp"  // the host-side helpers (dtype dispatch, broadcast strides) both backends share
#include "cuda/blas.cuh"
#include "cuda/kernels.cuh"
#include "cuda/runtime.cuh"

namespace nn {

namespace detail::cu {

/// f.template operator()<E>() for the unsigned type of `bytes` bytes: data movement that copies
/// elements bit for bit whatever their dtype.
template <class F>
void by_size(std::size_t bytes, F&& f) {
  switch (bytes) {
    case 1: f.template operator()<std::uint8_t>(); return;
    case 2: f.template operator()<std::uint16_t>(); return;
    case 4: f.template operator()<std::uint32_t>(); return;
    default: f.template operator()<std::uint64_t>(); return;
  }
}

struct IndexError {
  int kind;
  std::int64_t pos, id;
};

/// Waits for the stream, then takes (and clears) the first bad index a kernel of `kind` recorded
/// (every kind when kind < 0: the first one set).
inline std::optional<IndexError> take_index_error(int kind) {
  Context& c = ctx();
  NN_CUDA_CHECK(cudaMemcpyAsync(c.index_errors_host, c.index_errors, kIndexErrorKinds * sizeof(unsigned long long),
                                cudaMemcpyDeviceToHost, c.stream));
  NN_CUDA_CHECK(cudaStreamSynchronize(c.stream));
  for (int k = 0; k < kIndexErrorKinds; ++k) {
    const unsigned long long v = c.index_errors_host[k];
    if ((kind >= 0 && k != kind) || v == kNoIndexError) continue;
    NN_CUDA_CHECK(cudaMemsetAsync(c.index_errors + k, 0xff, sizeof(unsigned long long), c.stream));
    NN_CUDA_CHECK(cudaStreamSynchronize(c.stream));
    return IndexError{k, static_cast<std::int64_t>(v >> 32), static_cast<std::int32_t>(static_cast<std::uint32_t>(v))};
  }
  return std::nullopt;
}

/// After work the host did not wait for (a graph replay): raises the first index error recorded.
inline void raise_pending_index_errors() {
  static constexpr const char* what[kIndexErrorKinds] = {"gather_rows", "pick", "cross_entropy"};
  if (auto e = take_index_error(-1))
    fail(what[e->kind], "index ", e->id, " at position ", e->pos,
         " is out of range (found on the device after a CUDA graph replay)");
}

/// A 0-D learning rate or step read on the host (the Optimizer keeps them there; a device
/// tensor is read back, which a graph capture cannot contain).
inline double host_scalar(const Tensor& t) {
  if (t.device() == Device::cpu) return t.item();
  require_not_capturing("reading a device scalar (learning rate / step)");
  return t.to(Device::cpu).item();
}

template <class T>
T* ptr(Tensor& t) {
  return static_cast<T*>(t.raw());
}
template <class T>
const T* ptr(const Tensor& t) {
  return static_cast<const T*>(t.raw());
}

}  // namespace detail::cu

/// The CUDA backend policy (GTape<nn::cuda>). Kernels are queued on nn::cuda::stream() and
/// return at once; the host waits only where it must (a copy to the host, sum_squares, the index
/// checks of gather_rows / pick / cross_entropy outside a graph capture).
///
/// The optimizer kernels take the learning rate and step as 0-D tensors, as the CPU's do, and read
/// them on the host at launch (the Optimizer keeps them on the host): the update therefore runs
/// eagerly, after the graph of forward + backward, and a schedule needs no re-capture.
struct cuda {
  static constexpr Device device = Device::cuda;
  static constexpr const char* name = "cuda";

  // ---- runtime -------------------------------------------------------------------------------

  /// The stream every nn CUDA kernel and copy runs on.
  static cudaStream_t stream() { return detail::cu::stream(); }
  /// Waits for all queued nn work; raises an index error a graph replay recorded.
  static void synchronize() {
    NN_CUDA_CHECK(cudaStreamSynchronize(stream()));
    detail::cu::raise_pending_index_errors();
  }
  /// The caching allocator's counters (cudaMalloc calls, allocations, bytes).
  static CudaMemoryStats memory_stats() { return detail::cu::allocator().stats(); }
  /// Returns every cached, unused block to CUDA.
  static void empty_cache() { detail::cu::allocator().empty_cache(); }
  /// CUDA devices visible; 0 (never an error) without a device or a driver.
  static int device_count() {
    int n = 0;
    if (cudaGetDeviceCount(&n) != cudaSuccess) {
      cudaGetLastError();
      return 0;
    }
    return n;
  }

  // ---- buffers -------------------------------------------------------------------------------

  static Tensor alloc(const Shape& s, DType t) { return Tensor::empty(s, t, Device::cuda); }

  static void fill(Tensor& y, double v) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    if (v == 0.0) {
      NN_CUDA_CHECK(cudaMemsetAsync(y.raw(), 0, y.nbytes(), stream()));
      return;
    }
    if (y.dtype() == DType::f32) cu::k_fill<float><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<float>(y), static_cast<float>(v), n);
    else if (y.dtype() == DType::f64) cu::k_fill<double><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<double>(y), v, n);
    else {  // the element's bits, made on the host by the CPU's own conversion, then replicated
      std::uint64_t bits = 0;
      detail::store_from_double(&bits, y.dtype(), 0, v);
      cu::by_size(dtype_size(y.dtype()), [&]<class E>() {
        E e;
        std::memcpy(&e, &bits, sizeof(E));
        cu::k_fill<E><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<E>(y), e, n);
      });
    }
    cu::check_launch("fill");
  }

  /// y (+)= x. Without acc, x may also be a host tensor: an upload into y's buffer (how the tape
  /// refreshes its random-key slots in place, so a captured graph keeps reading the same address).
  static void copy(const Tensor& x, Tensor& y, bool acc) {
    namespace cu = detail::cu;
    if (!acc) {
      if (x.device() == Device::cpu) cu::require_not_capturing("uploading a host tensor");
      if (x.nbytes()) NN_CUDA_CHECK(cudaMemcpyAsync(y.raw(), x.raw(), x.nbytes(), cudaMemcpyDefault, stream()));
      return;
    }
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(y.dtype(), "copy", [&]<class T>() {
      cu::k_add_into<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), n);
    });
    cu::check_launch("copy");
  }

  static void cast(const Tensor& x, Tensor& y) {
    namespace cu = detail::cu;
    if (x.dtype() == y.dtype()) {
      if (x.nbytes()) NN_CUDA_CHECK(cudaMemcpyAsync(y.raw(), x.raw(), x.nbytes(), cudaMemcpyDeviceToDevice, stream()));
      return;
    }
    const std::int64_t n = y.numel();
    if (n == 0) return;
    cu::k_cast<><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(x.raw(), x.dtype(), y.raw(), y.dtype(), n);
    cu::check_launch("cast");
  }

  // ---- elementwise ---------------------------------------------------------------------------

  static void unary(Unary op, double arg, const Tensor& x, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t n = x.numel();
    if (n == 0) return;
    detail::dispatch_float(x.dtype(), unary_name(op), [&]<class T>() {
      cu::k_unary<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(op, static_cast<T>(arg), cu::ptr<T>(x), cu::ptr<T>(y), n);
    });
    cu::check_launch(unary_name(op));
  }

  static void unary_vjp(Unary op, double arg, const Tensor& x, const Tensor& y, const Tensor& g, Tensor& gx, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t n = x.numel();
    if (n == 0) return;
    detail::dispatch_float(x.dtype(), unary_name(op), [&]<class T>() {
      cu::k_unary_vjp<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(op, static_cast<T>(arg), cu::ptr<T>(x), cu::ptr<T>(y),
                                                                       cu::ptr<T>(g), cu::ptr<T>(gx), n, acc);
    });
    cu::check_launch(unary_name(op));
  }

  static void binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(y.dtype(), binary_name(op), [&]<class T>() {
      if (a.shape() == y.shape() && b.shape() == y.shape()) {
        cu::k_binary_same<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(op, cu::ptr<T>(a), cu::ptr<T>(b), cu::ptr<T>(y), n);
      } else {
        auto s = cu::make_strided<2>(y.shape(), {detail::broadcast_strides(a.shape(), y.shape()),
                                                 detail::broadcast_strides(b.shape(), y.shape())});
        cu::k_binary_bc<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(op, cu::ptr<T>(a), cu::ptr<T>(b), cu::ptr<T>(y), n, s);
      }
    });
    cu::check_launch(binary_name(op));
  }

  static void binary_vjp(Binary op, int which, const Tensor& a, const Tensor& b, const Tensor& g, Tensor& dst, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t n = g.numel();
    if (n == 0) return;
    detail::dispatch_float(g.dtype(), binary_name(op), [&]<class T>() {
      if (a.shape() == g.shape() && b.shape() == g.shape()) {
        cu::k_binary_vjp_same<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(op, which, cu::ptr<T>(a), cu::ptr<T>(b),
                                                                               cu::ptr<T>(g), cu::ptr<T>(dst), n, acc);
      } else {
        auto s = cu::make_strided<2>(g.shape(), {detail::broadcast_strides(a.shape(), g.shape()),
                                                 detail::broadcast_strides(b.shape(), g.shape())});
        cu::k_binary_vjp_bc<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(op, which, cu::ptr<T>(a), cu::ptr<T>(b),
                                                                             cu::ptr<T>(g), cu::ptr<T>(dst), n, s, acc);
      }
    });
    cu::check_launch(binary_name(op));
  }

  /// y (+)= scale * x summed over y's broadcast dims. Deterministic: each output is summed by one
  /// block (a fixed tree) or one thread (in index order), never by racing atomics.
  static void sum_to(const Tensor& x, Tensor& y, double scale, bool acc) {
    namespace cu = detail::cu;
    if (y.numel() == 0) return;
    detail::dispatch_float(x.dtype(), "sum", [&]<class T>() {
      const T sc = static_cast<T>(scale);
      std::int64_t outer, red, inner;
      if (detail::reduction_as_3d(x.shape(), y.shape(), outer, red, inner)) {
        if (inner == 1 && red > 64) {  // long contiguous rows: a block each
          const unsigned grid = static_cast<unsigned>(std::clamp<std::int64_t>(outer, 1, 65536));
          cu::k_sum_rows<T><<<grid, cu::threads_for(red), 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), outer, red, sc, acc);
        } else {
          cu::k_sum_mid<T><<<cu::grid_for(outer * inner), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), outer,
                                                                                    red, inner, sc, acc);
        }
      } else {
        const Shape &xs = x.shape(), &ys = y.shape();
        const int r = xs.rank(), off = xs.rank() - ys.rank();
        cu::ReduceSpec spec;
        std::int64_t stride = 1;
        std::array<std::int64_t, kMaxRank> xst{};
        for (int d = r - 1; d >= 0; --d) {
          xst[static_cast<std::size_t>(d)] = stride;
          stride *= xs[d];
        }
        for (int d = 0; d < r; ++d) {
          const std::int64_t yd = d < off ? 1 : ys[d - off];
          if (xs[d] == 1) continue;
          if (yd == 1) {
            spec.red_dim[spec.reduced] = xs[d];
            spec.red_st[spec.reduced++] = xst[static_cast<std::size_t>(d)];
            spec.red_n *= xs[d];
          } else {
            spec.kept_dim[spec.kept] = xs[d];
            spec.kept_st[spec.kept++] = xst[static_cast<std::size_t>(d)];
          }
        }
        cu::k_sum_general<T><<<cu::grid_for(y.numel()), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), y.numel(),
                                                                                  spec, sc, acc);
      }
    });
    cu::check_launch("sum_to");
  }

  static void broadcast_to(const Tensor& x, Tensor& y, double scale, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(x.dtype(), "broadcast", [&]<class T>() {
      auto s = cu::make_strided<1>(y.shape(), {detail::broadcast_strides(x.shape(), y.shape())});
      cu::k_broadcast<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), n, s,
                                                                       static_cast<T>(scale), acc);
    });
    cu::check_launch("broadcast_to");
  }

  static void where(const Tensor& mask, const Tensor& a, const Tensor& b, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(y.dtype(), "where", [&]<class T>() {
      auto s = cu::make_strided<3>(y.shape(), {detail::broadcast_strides(mask.shape(), y.shape()),
                                               detail::broadcast_strides(a.shape(), y.shape()),
                                               detail::broadcast_strides(b.shape(), y.shape())});
      cu::k_where<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(mask.raw(), mask.dtype(), cu::ptr<T>(a), cu::ptr<T>(b),
                                                                   cu::ptr<T>(y), n, s);
    });
    cu::check_launch("where");
  }

  static void where_vjp(const Tensor& mask, const Tensor& g, int which, Tensor& dst, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t n = g.numel();
    if (n == 0) return;
    detail::dispatch_float(g.dtype(), "where", [&]<class T>() {
      auto s = cu::make_strided<1>(g.shape(), {detail::broadcast_strides(mask.shape(), g.shape())});
      cu::k_where_vjp<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(mask.raw(), mask.dtype(), cu::ptr<T>(g), which,
                                                                       cu::ptr<T>(dst), n, s, acc);
    });
    cu::check_launch("where_vjp");
  }

  static void max_axis(const Tensor& x, int axis, Tensor& y, Tensor& idx) {
    namespace cu = detail::cu;
    const Shape& s = x.shape();
    const std::int64_t outer = s.prod(0, axis), red = s[axis], inner = s.prod(axis + 1, s.rank());
    if (outer * inner == 0 || red == 0) return;
    detail::dispatch_float(x.dtype(), "max", [&]<class T>() {
      cu::k_max_axis<T><<<cu::grid_for(outer * inner), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(x), cu::ptr<T>(y), cu::ptr<std::int32_t>(idx), outer, red, inner);
    });
    cu::check_launch("max_axis");
  }

  static void max_axis_vjp(const Tensor& g, const Tensor& idx, int axis, Tensor& gx, bool acc) {
    namespace cu = detail::cu;
    const Shape& s = gx.shape();
    const std::int64_t outer = s.prod(0, axis), red = s[axis], inner = s.prod(axis + 1, s.rank());
    if (!acc) fill(gx, 0.0);
    if (outer * inner == 0 || red == 0) return;
    detail::dispatch_float(g.dtype(), "max", [&]<class T>() {
      cu::k_max_axis_vjp<T><<<cu::grid_for(outer * inner), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(g), cu::ptr<std::int32_t>(idx), cu::ptr<T>(gx), outer, red, inner);
    });
    cu::check_launch("max_axis_vjp");
  }

  /// c (+)= op(a) @ op(b) with cpu.hpp's batch rules: one strided-batched cuBLAS call when c is
  /// batched (a shared operand has stride 0); when c has one matrix and the operands a batch, the
  /// products are summed by one GEMM per batch element, in batch order with beta = 1 after the
  /// first (deterministic, as the CPU's loop).
  static void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    namespace cu = detail::cu;
    detail::dispatch_float(c.dtype(), "matmul", [&]<class T>() {
      const Shape &sa = a.shape(), &sb = b.shape(), &sc = c.shape();
      const std::int64_t ar = sa.dim(-2), ac = sa.dim(-1), br = sb.dim(-2), bc = sb.dim(-1);
      const std::int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc;
      const std::int64_t ba = sa.prod(0, sa.rank() - 2), bb = sb.prod(0, sb.rank() - 2);
      const std::int64_t bcnt = sc.prod(0, sc.rank() - 2), batch = std::max(ba, bb);
      if (M == 0 || N == 0 || batch == 0) return;
      if (K == 0) {  // an empty sum: c = 0 (or unchanged when accumulating)
        if (!acc) fill(c, 0.0);
        return;
      }
      const T* A = cu::ptr<T>(a);
      const T* Bp = cu::ptr<T>(b);
      T* C = cu::ptr<T>(c);
      const std::int64_t sA = ba == 1 ? 0 : ar * ac, sB = bb == 1 ? 0 : br * bc;
      if (bcnt == batch) {
        cu::gemm<T>(ta, tb, M, N, K, A, ac, sA, Bp, bc, sB, C, M * N, batch, acc ? T(1) : T(0));
      } else {
        for (std::int64_t i = 0; i < batch; ++i)
          cu::gemm<T>(ta, tb, M, N, K, A + i * sA, ac, 0, Bp + i * sB, bc, 0, C, 0, 1, (acc || i > 0) ? T(1) : T(0));
      }
    });
  }

  // ---- data movement ---------------------------------------------------------------------------

  static void permute(const Tensor& x, const std::array<int, kMaxRank>& perm, Tensor& y, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    const int r = x.rank();
    std::array<std::int64_t, kMaxRank> xst{}, st{};
    std::int64_t s = 1;
    for (int i = r - 1; i >= 0; --i) {
      xst[static_cast<std::size_t>(i)] = s;
      s *= x.shape()[i];
    }
    for (int i = 0; i < r; ++i)
      st[static_cast<std::size_t>(i)] = xst[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])];
    auto spec = cu::make_strided<1>(y.shape(), {st});
    if (acc) {
      detail::dispatch_float(x.dtype(), "permute", [&]<class T>() {
        cu::k_permute_acc<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), n, spec);
      });
    } else {
      cu::by_size(dtype_size(x.dtype()), [&]<class E>() {
        cu::k_permute<E><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<E>(x), cu::ptr<E>(y), n, spec);
      });
    }
    cu::check_launch("permute");
  }

  static void slice_copy(const Tensor& x, int axis, std::int64_t start, Tensor& y) {
    namespace cu = detail::cu;
    const Shape& s = x.shape();
    const std::int64_t outer = s.prod(0, axis), inner = s.prod(axis + 1, s.rank());
    const std::int64_t len = y.shape()[axis], full = s[axis];
    if (outer * len * inner == 0) return;
    cu::by_size(dtype_size(x.dtype()), [&]<class E>() {
      cu::k_slice_copy<E><<<cu::grid_for(outer * len * inner), cu::kBlock, 0, stream()>>>(
          cu::ptr<E>(x), cu::ptr<E>(y), outer, full * inner, start * inner, len * inner);
    });
    cu::check_launch("slice_copy");
  }

  static void slice_scatter(const Tensor& x, int axis, std::int64_t start, Tensor& y, bool acc) {
    namespace cu = detail::cu;
    const Shape& s = y.shape();
    const std::int64_t outer = s.prod(0, axis), inner = s.prod(axis + 1, s.rank());
    const std::int64_t len = x.shape()[axis], full = s[axis];
    const std::int64_t n = outer * len * inner;
    if (n == 0) return;
    if (acc) {
      detail::dispatch_float(x.dtype(), "slice", [&]<class T>() {
        cu::k_slice_scatter_acc<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), outer,
                                                                                 full * inner, start * inner, len * inner);
      });
    } else {
      cu::by_size(dtype_size(x.dtype()), [&]<class E>() {
        cu::k_slice_scatter<E><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<E>(x), cu::ptr<E>(y), outer, full * inner,
                                                                            start * inner, len * inner);
      });
    }
    cu::check_launch("slice_scatter");
  }

  // ---- integer indexing ------------------------------------------------------------------------

  /// y[i, :] = table[ids[i], :]. An id out of range writes a zero row, and outside a graph capture
  /// raises as the CPU does (the host waits for the kernel to know).
  static void gather_rows(const Tensor& table, const Tensor& ids, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t D = table.dim(-1), n = ids.numel(), N = table.dim(0);
    if (n * D == 0) return;
    const bool i32 = ids.dtype() == DType::i32;
    cu::by_size(dtype_size(table.dtype()), [&]<class E>() {
      cu::k_gather_rows<E><<<cu::grid_for(n * D), cu::kBlock, 0, stream()>>>(
          cu::DenseRows<E>{cu::ptr<E>(table), D}, ids.raw(), i32, cu::ptr<E>(y), n, D, N, cu::ctx().index_errors);
    });
    cu::check_launch("gather_rows");
    if (cu::ctx().capturing) return;
    if (auto e = cu::take_index_error(cu::kGatherRows))
      detail::fail("gather_rows", "id ", e->id, " at position ", e->pos, " is out of range for a table of ", N, " rows");
  }

  /// gtable[ids[i], :] += g[i, :] in id order, deterministic (see k_scatter_add_rows).
  static void scatter_add_rows(const Tensor& g, const Tensor& ids, Tensor& gtable) {
    namespace cu = detail::cu;
    const std::int64_t D = gtable.dim(-1), n = ids.numel(), N = gtable.dim(0);
    if (n == 0 || D == 0 || N == 0) return;
    // Enough (bucket, column) threads to fill the GPU, never more buckets than rows.
    const std::int64_t nb = std::clamp<std::int64_t>(65536 / D, 1, std::min<std::int64_t>(N, 64));
    detail::dispatch_float(g.dtype(), "embedding", [&]<class T>() {
      cu::k_scatter_add_rows<T><<<cu::grid_for(D * nb), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(g), ids.raw(), ids.dtype() == DType::i32, cu::ptr<T>(gtable), n, D, N, nb);
    });
    cu::check_launch("scatter_add_rows");
  }

  static void pick(const Tensor& x, const Tensor& idx, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t V = x.dim(-1), R = idx.numel();
    if (R == 0) return;
    detail::dispatch_float(x.dtype(), "pick", [&]<class T>() {
      cu::k_pick<T><<<cu::grid_for(R), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), idx.raw(), idx.dtype() == DType::i32,
                                                                  cu::ptr<T>(y), R, V, cu::ctx().index_errors);
    });
    cu::check_launch("pick");
    if (cu::ctx().capturing) return;
    if (auto e = cu::take_index_error(cu::kPick))
      detail::fail("pick", "index ", e->id, " at row ", e->pos, " is out of range for ", V, " classes");
  }

  static void pick_vjp(const Tensor& g, const Tensor& idx, Tensor& gx) {
    namespace cu = detail::cu;
    const std::int64_t V = gx.dim(-1), R = idx.numel();
    if (R == 0) return;
    detail::dispatch_float(g.dtype(), "pick", [&]<class T>() {
      cu::k_pick_vjp<T><<<cu::grid_for(R), cu::kBlock, 0, stream()>>>(cu::ptr<T>(g), idx.raw(), idx.dtype() == DType::i32,
                                                                      cu::ptr<T>(gx), R, V);
    });
    cu::check_launch("pick_vjp");
  }

  /// MLX's bernoulli mask, bit for bit the CPU's (random.hpp's threefry, run on the device). A
  /// device key is read by the kernel when it runs, so a replayed graph sees a refreshed key.
  static void bernoulli_mask(const Tensor& key, double p_keep, double value, Tensor& mask) {
    namespace cu = detail::cu;
    const std::int64_t n = mask.numel(), blocks = random::detail::bits_blocks(n);
    if (n == 0) return;
    const std::uint32_t* kp = nullptr;
    std::uint32_t k0 = 0, k1 = 0;
    if (key.device() == Device::cpu) {
      k0 = static_cast<const std::uint32_t*>(key.raw())[0];
      k1 = static_cast<const std::uint32_t*>(key.raw())[1];
    } else {
      kp = static_cast<const std::uint32_t*>(key.raw());
    }
    const float p = static_cast<float>(p_keep);
    auto draw = [&]<class M>() {
      cu::k_bernoulli<M><<<cu::grid_for(blocks), cu::kBlock, 0, stream()>>>(kp, k0, k1, p, static_cast<M>(value),
                                                                            cu::ptr<M>(mask), n, blocks);
    };
    switch (mask.dtype()) {
      case DType::f32: draw.template operator()<float>(); break;
      case DType::f64: draw.template operator()<double>(); break;
      case DType::u8: draw.template operator()<std::uint8_t>(); break;
      default: detail::fail("bernoulli_mask", "needs a float32, float64 or uint8 mask, got ", dtype_name(mask.dtype()));
    }
    cu::check_launch("bernoulli_mask");
  }

  // ---- softmax and cross-entropy: one block per row ----------------------------------------------

  static void softmax(const Tensor& x, Tensor& y, bool log) {
    namespace cu = detail::cu;
    const std::int64_t V = x.dim(-1), R = x.numel() / std::max<std::int64_t>(V, 1);
    if (R == 0 || V == 0) return;
    detail::dispatch_float(x.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      cu::k_softmax<T><<<rows_grid(R), cu::threads_for(V), 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(y), R, V, log);
    });
    cu::check_launch("softmax");
  }

  static void softmax_vjp(const Tensor& y, const Tensor& g, Tensor& gx, bool log, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t V = y.dim(-1), R = y.numel() / std::max<std::int64_t>(V, 1);
    if (R == 0 || V == 0) return;
    detail::dispatch_float(y.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      cu::k_softmax_vjp<T><<<rows_grid(R), cu::threads_for(V), 0, stream()>>>(cu::ptr<T>(y), cu::ptr<T>(g), cu::ptr<T>(gx), R,
                                                                              V, log, acc);
    });
    cu::check_launch("softmax_vjp");
  }

  /// cpu.hpp's cross_entropy (same row mapping, reductions and ignore rule); the sum over targets
  /// is one block's fixed tree. A target out of range raises outside a graph capture.
  static void cross_entropy(const Tensor& x, const Tensor& t, const CrossEntropyAttrs& a, Tensor& y, Tensor& lse) {
    const std::int64_t ignore = a.ignore_index;
    const int reduction = static_cast<int>(a.reduction);  // 0 none, 1 sum, 2 mean
    namespace cu = detail::cu;
    const std::int64_t V = x.dim(-1), R = t.numel();
    const std::int64_t N = t.rank() ? t.dim(-1) : 1, G = x.rank() >= 2 ? x.dim(-2) : 1;
    const bool i32 = t.dtype() == DType::i32;
    detail::dispatch_float(x.dtype(), "cross_entropy", [&]<class T>() {
      if (R > 0)
        cu::k_ce_rows<T><<<rows_grid(R), cu::threads_for(V), 0, stream()>>>(cu::ptr<T>(x), t.raw(), i32, ignore, reduction,
                                                                            cu::ptr<T>(y), cu::ptr<T>(lse), R, V, N, G,
                                                                            cu::ctx().index_errors);
      if (reduction != 0)
        cu::k_ce_reduce<T><<<1, cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), t.raw(), i32, ignore, reduction, cu::ptr<T>(lse),
                                                           cu::ptr<T>(y), R, V, N, G);
    });
    cu::check_launch("cross_entropy");
    if (cu::ctx().capturing) return;
    if (auto e = cu::take_index_error(cu::kCrossEntropy))
      detail::fail("cross_entropy", "target ", e->id, " at row ", e->pos, " is out of range for ", V,
                   " classes (ignore_index is ", ignore, ")");
  }

  static void cross_entropy_vjp(const Tensor& x, const Tensor& t, const CrossEntropyAttrs& a, const Tensor& lse,
                                const Tensor& g, Tensor& gx, bool acc) {
    const std::int64_t ignore = a.ignore_index;
    const int reduction = static_cast<int>(a.reduction);  // 0 none, 1 sum, 2 mean
    namespace cu = detail::cu;
    const std::int64_t V = x.dim(-1), R = t.numel();
    const std::int64_t N = t.rank() ? t.dim(-1) : 1, G = x.rank() >= 2 ? x.dim(-2) : 1;
    const bool i32 = t.dtype() == DType::i32;
    auto* count = reinterpret_cast<long long*>(cu::ctx().scratch);
    detail::dispatch_float(x.dtype(), "cross_entropy", [&]<class T>() {
      if (reduction == 2) cu::k_ce_count<><<<1, cu::kBlock, 0, stream()>>>(t.raw(), i32, ignore, R, count);
      if (!acc && N < G && V > 0) {
        const std::int64_t groups = N ? R / N : x.numel() / (G * V);
        if (groups > 0)
          cu::k_ce_zero_unscored<T><<<cu::grid_for(groups * (G - N) * V), cu::kBlock, 0, stream()>>>(cu::ptr<T>(gx), groups,
                                                                                                    G, N, V);
      }
      if (R > 0 && V > 0)
        cu::k_ce_vjp<T><<<rows_grid(R), cu::threads_for(V), 0, stream()>>>(cu::ptr<T>(x), t.raw(), i32, ignore, reduction,
                                                                           cu::ptr<T>(lse), cu::ptr<T>(g), count,
                                                                           cu::ptr<T>(gx), R, V, N, G, acc);
    });
    cu::check_launch("cross_entropy_vjp");
  }

  // ---- fused elementwise groups (ops/fused.hpp): one thread per element runs the program ------

  /// y = the program's output; ins: its inputs, each of y's shape or broadcast to it.
  static void fused(const FusedProgram& p, std::span<const Tensor* const> ins, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(y.dtype(), "fused", [&]<class T>() {
      cu::FusedInputs<T> in;
      auto s = fused_strides<T>(p, ins, y.shape(), in);
      cu::k_fused<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(p, in, cu::ptr<T>(y), n, s);
    });
    cu::check_launch("fused");
  }
  /// The program's vjp (backend/cpu/fused.hpp's contract): dest[c] receives contribution c, the
  /// contributions numbered as the steps are walked in reverse, operand a before b.
  static void fused_vjp(const FusedProgram& p, std::span<const Tensor* const> ins, const Tensor& y, const Tensor& g,
                        std::span<const FusedGradDest> dest) {
    namespace cu = detail::cu;
    const std::int64_t n = g.numel();
    if (n == 0) return;
    if (dest.size() > static_cast<std::size_t>(2 * kMaxFusedSteps))
      detail::fail("fused", "a program with ", dest.size(), " gradient contributions (at most ", 2 * kMaxFusedSteps, ")");
    detail::dispatch_float(g.dtype(), "fused", [&]<class T>() {
      cu::FusedInputs<T> in;
      auto s = fused_strides<T>(p, ins, g.shape(), in);
      cu::FusedDests<T> d;
      for (std::size_t c = 0; c < dest.size(); ++c) {
        d.p[c] = static_cast<T*>(dest[c].g->raw());
        d.acc[c] = dest[c].acc;
      }
      cu::k_fused_vjp<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(p, in, cu::ptr<T>(y), cu::ptr<T>(g), d, n, s);
    });
    cu::check_launch("fused_vjp");
  }

  // ---- fused primitives (ops/norm, rope, attention, glu.hpp): cpu.hpp's math, CUDA kernels ----

  /// y = x * rstd (* w), rstd = 1 / sqrt(mean(x^2) + eps) per row (kept for the vjp): a block a row.
  static void rms_norm(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
    namespace cu = detail::cu;
    const std::int64_t C = x.dim(-1), R = x.numel() / std::max<std::int64_t>(C, 1);
    if (R == 0 || C == 0) return;
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C));
      cu::k_rms_norm<T><<<rows_grid(R), cu::threads_for(C), 0, stream()>>>(
          cu::ptr<T>(x), w.defined() ? cu::ptr<T>(w) : nullptr, cu::ptr<T>(y), cu::ptr<T>(rstd), R, C, inv_c,
          static_cast<T>(eps));
    });
    cu::check_launch("rms_norm");
  }

  /// gx per row (a block each); gw per column, summed over the rows in order (deterministic).
  static void rms_norm_vjp(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& g, GradOut ox,
                           GradOut ow) {
    Tensor *gx = ox.g, *gw = ow.g;
    const bool acc_x = ox.acc, acc_w = ow.acc;
    namespace cu = detail::cu;
    const std::int64_t C = x.dim(-1), R = x.numel() / std::max<std::int64_t>(C, 1);
    if (C == 0) return;
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C));
      const T* ws = w.defined() ? cu::ptr<T>(w) : nullptr;
      if (gx && R > 0)
        cu::k_rms_norm_vjp_x<T><<<rows_grid(R), cu::threads_for(C), 0, stream()>>>(
            cu::ptr<T>(x), ws, cu::ptr<T>(rstd), cu::ptr<T>(g), cu::ptr<T>(*gx), R, C, inv_c, acc_x);
      if (gw)
        cu::k_rms_norm_vjp_w<T><<<cu::grid_for(C), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(rstd), cu::ptr<T>(g),
                                                                             cu::ptr<T>(*gw), R, C, acc_w);
    });
    cu::check_launch("rms_norm_vjp");
  }

  /// y (+)= x rotated by its position's angles (minus them when `inverse`: the vjp).
  static void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, RopeArgs args, Tensor& y, bool acc) {
    const bool traditional = args.traditional, inverse = args.inverse;
    namespace cu = detail::cu;
    const std::int64_t D = x.dim(-1), half = cos.dim(-1), Tn = cos.dim(0);
    const std::int64_t M = cos.rank() == 3 ? x.dim(-2) : 1, rows = x.numel() / std::max<std::int64_t>(D, 1);
    if (rows * D == 0) return;
    detail::dispatch_float(x.dtype(), "rope", [&]<class T>() {
      cu::k_rope<T><<<cu::grid_for(rows * D), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), cu::ptr<T>(cos), cu::ptr<T>(sin),
                                                                         cu::ptr<T>(y), rows, D, half, M, Tn, traditional,
                                                                         inverse ? T(-1) : T(1), acc);
    });
    cu::check_launch("rope");
  }

  /// Attention, cpu.hpp's layout and math: the (batch, head) products as strided-batched cuBLAS
  /// GEMMs reading q, k, v in their projection layout (no permuted copies), the masked, scaled
  /// softmax in place in p (B, H, T, T), one block per row.
  static void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const AttentionAttrs& a,
                        Tensor& out, Tensor& p) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    namespace cu = detail::cu;
    if (Bn * H * T_ == 0 || hd == 0) return;
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const AttnLayout L{Bn, T_, H, KV, hd};
      const T* Q = cu::ptr<T>(q);
      const T* K = cu::ptr<T>(k);
      const T* V = cu::ptr<T>(v);
      T* O = cu::ptr<T>(out);
      T* P = cu::ptr<T>(p);
      L.each([&](const AttnLayout::Batch& b) {  // S = q k^T
        cu::gemm<T>(false, true, T_, T_, hd, Q + b.q, L.qs(), b.sq, K + b.k, L.ks(), b.sk, P + b.p, b.sp, b.n, T(0), T_);
      });
      std::array<std::int64_t, kMaxRank> ms{};
      if (mask.defined()) ms = detail::broadcast_strides(mask.shape(), Shape{Bn, H, T_, T_});
      const std::int64_t rows = Bn * H * T_;
      cu::k_attn_softmax<T><<<rows_grid(rows), cu::threads_for(T_), 0, stream()>>>(
          P, mask.defined() ? cu::ptr<T>(mask) : nullptr, H, T_, ms[0], ms[1], ms[2], ms[3], static_cast<T>(scale), rows,
          causal);
      cu::check_launch("attention");
      L.each([&](const AttnLayout::Batch& b) {  // out = P v
        cu::gemm<T>(false, false, T_, hd, T_, P + b.p, T_, b.sp, V + b.k, L.ks(), b.sk, O + b.q, b.sq, b.n, T(0), L.qs());
      });
    });
  }

  /// The vjp of attention, cpu.hpp's order: the group's query heads j = 0, 1, ... in turn, so
  /// dk and dv sum them in the CPU's order (beta = 1 after the first), deterministic.
  /// (a.causal needs nothing here: P is 0 above the diagonal, so dS is too.) The tape has resolved
  /// aliasing: gradients that share a buffer arrive zeroed and accumulating.
  static void attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& p, const Tensor& g,
                            const AttentionAttrs& a, Tensor& scratch, GradOut oq, GradOut ok, GradOut ov) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    Tensor *gq = oq.g, *gk = ok.g, *gv = ov.g;
    const bool acc_q = oq.acc, acc_k = ok.acc, acc_v = ov.acc;
    namespace cu = detail::cu;
    if (Bn * H * T_ == 0 || hd == 0) return;
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const AttnLayout L{Bn, T_, H, KV, hd};
      const T* Q = cu::ptr<T>(q);
      const T* K = cu::ptr<T>(k);
      const T* V = cu::ptr<T>(v);
      const T* P = cu::ptr<T>(p);
      const T* G = cu::ptr<T>(g);
      T* S = cu::ptr<T>(scratch);
      T* GQ = gq ? cu::ptr<T>(*gq) : nullptr;
      T* GK = gk ? cu::ptr<T>(*gk) : nullptr;
      T* GV = gv ? cu::ptr<T>(*gv) : nullptr;
      L.each([&](const AttnLayout::Batch& b) {
        const bool later = b.j > 0;
        if (GV)  // dv (+)= P^T g
          cu::gemm<T>(true, false, T_, hd, T_, P + b.p, T_, b.sp, G + b.q, L.qs(), b.sq, GV + b.k, b.sk, b.n,
                      (acc_v || later) ? T(1) : T(0), L.ks());
        if (!GQ && !GK) return;
        // dS = g v^T, then P * (dS - rowsum(P * dS)) * scale
        cu::gemm<T>(false, true, T_, T_, hd, G + b.q, L.qs(), b.sq, V + b.k, L.ks(), b.sk, S + b.s, b.ss, b.n, T(0), T_);
        cu::k_attn_dsoftmax<T><<<rows_grid(b.n * T_), cu::threads_for(T_), 0, stream()>>>(S + b.s, b.ss, P + b.p, b.sp, b.n,
                                                                                          T_, static_cast<T>(scale));
        cu::check_launch("attention_vjp");
        if (GQ)  // dq (+)= dS k
          cu::gemm<T>(false, false, T_, hd, T_, S + b.s, T_, b.ss, K + b.k, L.ks(), b.sk, GQ + b.q, b.sq, b.n,
                      acc_q ? T(1) : T(0), L.qs());
        if (GK)  // dk (+)= dS^T q
          cu::gemm<T>(true, false, T_, hd, T_, S + b.s, T_, b.ss, Q + b.q, L.qs(), b.sq, GK + b.k, b.sk, b.n,
                      (acc_k || later) ? T(1) : T(0), L.ks());
      });
    });
  }

  // ---- quantized matrices (quant.hpp, ops/quantized.hpp) --------------------------------------
  // A plain kernel, one thread per output, reading codes through backend/math.hpp's QuantMath as
  // the CPU does. Scales must have x's dtype (affine) or be u8 (the fp modes).

  static void check_quant_scales(const Tensor& scales, const Quant& q, DType t, const char* op) {
    if (q.mode == QuantMode::affine && scales.dtype() != t)
      detail::fail(op, "on CUDA the scales must be ", dtype_name(t), " like x, got ", dtype_name(scales.dtype()),
                   " (convert the layer with to(dtype))");
  }

  template <class T>
  static detail::cu::QuantRows<T> quant_rows(const Tensor& wq, const Tensor& scales, const Tensor& biases, const Quant& q) {
    return {static_cast<const std::uint8_t*>(wq.raw()), wq.dim(1) * 4, scales.raw(),
            biases.defined() ? detail::cu::ptr<T>(biases) : nullptr, scales.dim(1), q};
  }

  static void quantized_matmul(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const QuantMatmulAttrs& a, Tensor& y, bool acc) {
    namespace cu = detail::cu;
    const std::int64_t K = x.dim(-1), N = y.dim(-1), M = y.numel() / std::max<std::int64_t>(N, 1);
    if (M * N == 0) return;
    detail::dispatch_float(y.dtype(), "quantized_matmul", [&]<class T>() {
      check_quant_scales(scales, a.q, y.dtype(), "quantized_matmul");
      cu::k_quantized_matmul<T><<<cu::grid_for(M * N), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(x), quant_rows<T>(wq, scales, biases, a.q), a.transpose, cu::ptr<T>(y), M, N, K, acc);
    });
    cu::check_launch("quantized_matmul");
  }

  static void quantized_gather(const Tensor& ids, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const Quant& q, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t D = y.dim(-1), n = ids.numel(), V = wq.dim(0);
    if (n * D == 0) return;
    detail::dispatch_float(y.dtype(), "quantized_gather", [&]<class T>() {
      check_quant_scales(scales, q, y.dtype(), "quantized_gather");
      cu::k_gather_rows<T><<<cu::grid_for(n * D), cu::kBlock, 0, stream()>>>(
          quant_rows<T>(wq, scales, biases, q), ids.raw(), ids.dtype() == DType::i32, cu::ptr<T>(y), n, D, V,
          cu::ctx().index_errors);
    });
    cu::check_launch("quantized_gather");
    if (cu::ctx().capturing) return;
    if (auto e = cu::take_index_error(cu::kGatherRows))
      detail::fail("quantized_gather", "id ", e->id, " at position ", e->pos, " is outside the table's ", V, " rows");
  }

  static void swiglu(const Tensor& gate, const Tensor& up, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(y.dtype(), "swiglu", [&]<class T>() {
      cu::k_swiglu<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(gate), cu::ptr<T>(up), cu::ptr<T>(y), n);
    });
    cu::check_launch("swiglu");
  }

  static void swiglu_vjp(const Tensor& gate, const Tensor& up, const Tensor& g, GradOut og, GradOut ou) {
    Tensor *ggate = og.g, *gup = ou.g;
    const bool acc_gate = og.acc, acc_up = ou.acc;
    namespace cu = detail::cu;
    const std::int64_t n = g.numel();
    if (n == 0 || (!ggate && !gup)) return;
    detail::dispatch_float(g.dtype(), "swiglu", [&]<class T>() {
      cu::k_swiglu_vjp<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(gate), cu::ptr<T>(up), cu::ptr<T>(g), ggate ? cu::ptr<T>(*ggate) : nullptr, acc_gate,
          gup ? cu::ptr<T>(*gup) : nullptr, acc_up, n);
    });
    cu::check_launch("swiglu_vjp");
  }

  // ---- optimizer updates: backend/math.hpp's functors (scalars formed on the host, as on the
  // CPU; lr and step read on the host at launch) ---------------------------------------------

  static void sgd_update(Tensor& p, const Tensor& g, Tensor& v, const Tensor& lr, double momentum, double dampening,
                         double wd, bool nesterov) {
    namespace cu = detail::cu;
    const std::int64_t n = p.numel();
    if (n == 0) return;
    const double lr_v = cu::host_scalar(lr);
    detail::dispatch_float(p.dtype(), "sgd", [&]<class T>() {
      T* vs = momentum > 0 ? cu::ptr<T>(v) : nullptr;
      cu::k_sgd<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(p), cu::ptr<T>(g), vs, detail::SgdMath<T>::make(lr_v, momentum, dampening, wd, nesterov), n);
    });
    cu::check_launch("sgd_update");
  }

  static void adam_update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const Tensor& lr, const Tensor& step,
                          double b1, double b2, double eps, double decoupled_wd, bool bias_correction) {
    namespace cu = detail::cu;
    const std::int64_t n = p.numel();
    if (n == 0) return;
    const double lr_v = cu::host_scalar(lr), step_v = cu::host_scalar(step);
    detail::dispatch_float(p.dtype(), "adam", [&]<class T>() {
      const auto f = detail::AdamMath<T>::make(lr_v, step_v, b1, b2, eps, decoupled_wd, bias_correction);
      cu::k_adam<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(p), cu::ptr<T>(g), cu::ptr<T>(m),
                                                                  cu::ptr<T>(v), f, n);
    });
    cu::check_launch("adam_update");
  }

  static void lion_update(Tensor& p, const Tensor& g, Tensor& m, const Tensor& lr, double b1, double b2, double wd) {
    namespace cu = detail::cu;
    const std::int64_t n = p.numel();
    if (n == 0) return;
    const double lr_v = cu::host_scalar(lr);
    detail::dispatch_float(p.dtype(), "lion", [&]<class T>() {
      cu::k_lion<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(p), cu::ptr<T>(g), cu::ptr<T>(m),
                                                                  detail::LionMath<T>::make(lr_v, b1, b2, wd), n);
    });
    cu::check_launch("lion_update");
  }

  static void muon_momentum(const Tensor& p, const Tensor& g, Tensor& v, Tensor& u, double momentum, double wd,
                            bool nesterov) {
    namespace cu = detail::cu;
    const std::int64_t n = p.numel();
    if (n == 0) return;
    detail::dispatch_float(p.dtype(), "muon", [&]<class T>() {
      cu::k_muon_momentum<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(
          cu::ptr<T>(p), cu::ptr<T>(g), cu::ptr<T>(v), cu::ptr<T>(u),
          detail::MuonMomentumMath<T>::make(momentum, wd, nesterov), n);
    });
    cu::check_launch("muon_momentum");
  }

  /// sum of x^2 in double (clip_grad_norm's global norm). The host waits for the result.
  static double sum_squares(const Tensor& x) {
    namespace cu = detail::cu;
    cu::require_not_capturing("sum_squares");
    cu::Context& c = cu::ctx();
    detail::dispatch_float(x.dtype(), "sum_squares", [&]<class T>() {
      cu::k_sum_squares<T><<<1, cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), x.numel(), c.scratch + 1);
    });
    cu::check_launch("sum_squares");
    NN_CUDA_CHECK(cudaMemcpyAsync(c.scratch_host + 1, c.scratch + 1, sizeof(double), cudaMemcpyDeviceToHost, c.stream));
    NN_CUDA_CHECK(cudaStreamSynchronize(c.stream));
    return c.scratch_host[1];
  }

  static void axpby(double a, const Tensor& x, double b, Tensor& y) {
    namespace cu = detail::cu;
    const std::int64_t n = y.numel();
    if (n == 0) return;
    detail::dispatch_float(y.dtype(), "axpby", [&]<class T>() {
      const detail::AxpbyMath<T> f{static_cast<T>(a), static_cast<T>(b)};
      cu::k_axpby<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(f, cu::ptr<T>(x), cu::ptr<T>(y), n);
    });
    cu::check_launch("axpby");
  }

  /// x /= (||x||_F + eps): the norm in one block (a fixed tree), kept on the device.
  static void normalize_frobenius(Tensor& x, double eps) {
    namespace cu = detail::cu;
    const std::int64_t n = x.numel();
    if (n == 0) return;
    detail::dispatch_float(x.dtype(), "normalize", [&]<class T>() {
      T* d = reinterpret_cast<T*>(cu::ctx().scratch + 2);
      cu::k_frobenius<T><<<1, cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), n, static_cast<T>(eps), d);
      cu::k_divide_by<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(x), n, d);
    });
    cu::check_launch("normalize_frobenius");
  }

  static void apply_update(Tensor& p, const Tensor& x, const Tensor& lr, double factor) {
    namespace cu = detail::cu;
    const std::int64_t n = p.numel();
    if (n == 0) return;
    const double lr_v = cu::host_scalar(lr);
    detail::dispatch_float(p.dtype(), "update", [&]<class T>() {
      cu::k_apply_update<T><<<cu::grid_for(n), cu::kBlock, 0, stream()>>>(cu::ptr<T>(p), cu::ptr<T>(x),
                                                                          detail::ApplyUpdateMath<T>::make(lr_v, factor), n);
    });
    cu::check_launch("apply_update");
  }

 private:
  /// Attention's (batch, query head) products as strided batches. Query head h = kh * g + j
  /// (g = H / KV) reads kv head kh; for a fixed group member j the operands step evenly both in
  /// the batch b and in kh, so each j is a loop over one of them and a cuBLAS batch over the
  /// other (the larger). Offsets, in elements: q/out/g rows (B, T, H * hd), k/v (B, T, KV * hd),
  /// p (B, H, T, T), the vjp's scratch s (B * KV, T, T).
  struct AttnLayout {
    std::int64_t Bn, Tn, H, KV, hd;
    struct Batch {
      std::int64_t j, n;           // group member; how many (b, kh) pairs in this batch
      std::int64_t q, k, p, s;     // offsets of the first pair
      std::int64_t sq, sk, sp, ss; // strides from one pair to the next
    };
    std::int64_t qs() const { return H * hd; }
    std::int64_t ks() const { return KV * hd; }
    template <class F>
    void each(F&& f) const {
      const std::int64_t g = H / KV;
      const bool over_b = Bn >= KV;  // batch over b (loop kh), else batch over kh (loop b)
      for (std::int64_t j = 0; j < g; ++j)
        for (std::int64_t o = 0; o < (over_b ? KV : Bn); ++o) {
          const std::int64_t b = over_b ? 0 : o, kh = over_b ? o : 0, h = kh * g + j;
          Batch x;
          x.j = j;
          x.n = over_b ? Bn : KV;
          x.q = b * Tn * qs() + h * hd;
          x.k = b * Tn * ks() + kh * hd;
          x.p = (b * H + h) * Tn * Tn;
          x.s = (b * KV + kh) * Tn * Tn;
          x.sq = over_b ? Tn * qs() : g * hd;
          x.sk = over_b ? Tn * ks() : hd;
          x.sp = over_b ? H * Tn * Tn : g * Tn * Tn;
          x.ss = over_b ? KV * Tn * Tn : Tn * Tn;
          f(x);
        }
    }
  };

  /// A fused program's inputs as device pointers, and the strides reading each at an output
  /// element (0 along its broadcast dimensions).
  template <class T>
  static detail::cu::Strided<kMaxFusedInputs> fused_strides(const FusedProgram& p, std::span<const Tensor* const> ins,
                                                            const Shape& out, detail::cu::FusedInputs<T>& in) {
    std::array<std::array<std::int64_t, kMaxRank>, kMaxFusedInputs> st{};
    for (int k = 0; k < p.inputs; ++k) {
      const Tensor& x = *ins[static_cast<std::size_t>(k)];
      in.p[k] = x.raw();
      in.dt[k] = x.dtype();
      st[static_cast<std::size_t>(k)] = detail::broadcast_strides(x.shape(), out);
    }
    return detail::cu::make_strided<kMaxFusedInputs>(out, st);
  }

  /// Blocks for a one-block-per-row kernel (rows past the grid are taken in a block-stride loop).
  static unsigned rows_grid(std::int64_t rows) { return static_cast<unsigned>(std::clamp<std::int64_t>(rows, 1, 65536)); }
};

static_assert(BackendPolicy<cuda>);

}  // namespace nn
