// SPDX-License-Identifier: MIT OR Apache-2.0
// The CUDA kernels behind nn::cuda: elementwise math with broadcasting, deterministic reductions
// (a fixed tree per block, or one thread per output walking its inputs in order), indexing,
// softmax and cross-entropy, the dropout mask and the optimizer updates. The math of each is
// cpu.hpp's, line for line, so the two backends differ only by rounding.
#pragma once

#include <cmath>

#include "runtime.cuh"
#include "../math.hpp"
#include "../policy.hpp"
#include "../../random.hpp"

namespace nn::detail::cu {

using i64 = std::int64_t;

/// Threads per block everywhere (the reductions' trees assume a power of two).
inline constexpr int kBlock = 256;

/// Blocks for a grid-stride loop over n items: enough to fill an H100/H200 several times over,
/// and at least one so a launch over nothing is still a valid launch.
inline unsigned grid_for(i64 n) {
  i64 b = (n + kBlock - 1) / kBlock;
  return static_cast<unsigned>(std::clamp<i64>(b, 1, 65536));
}
/// Block size for a one-block-per-row kernel: the power of two (32..256) covering the row.
inline unsigned threads_for(i64 len) {
  unsigned t = 32;
  while (t < kBlock && static_cast<i64>(t) < len) t *= 2;
  return t;
}

#define NN_CU_FOR(i, n)                                                                       \
  for (::std::int64_t i = static_cast<::std::int64_t>(blockIdx.x) * blockDim.x + threadIdx.x; \
       i < (n); i += static_cast<::std::int64_t>(blockDim.x) * gridDim.x)
#define NN_CU_ROWS(r, n) for (::std::int64_t r = blockIdx.x; r < (n); r += gridDim.x)

// Device math is backend/math.hpp's m_exp, m_log, ... (shared with the CPU).
template <class T>
__device__ inline bool d_isnan(T x) {
  return x != x;
}

template <class T>
__device__ inline T d_inf() {
  return static_cast<T>(INFINITY);
}

// unary_f, unary_df, binary_f, binary_df, put: backend/math.hpp (shared with nn::cpu).

// ---- dtype conversion on the device (tensor.hpp's half:: rules, bit for bit) ---------------
__device__ inline float bf16_to_f32(std::uint16_t h) { return __uint_as_float(static_cast<std::uint32_t>(h) << 16); }
__device__ inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = __float_as_uint(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);
  std::uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;
  return static_cast<std::uint16_t>(u >> 16);
}
__device__ inline float f16_to_f32(std::uint16_t h) {
  std::uint32_t sign = static_cast<std::uint32_t>(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu, man = h & 0x3ffu, bits;
  if (exp == 0) {
    if (man == 0) bits = sign;
    else bits = sign | __float_as_uint(static_cast<float>(man) * 5.9604644775390625e-8f);  // man * 2^-24, exact
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  return __uint_as_float(bits);
}
__device__ inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t u = __float_as_uint(f);
  std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);
  if (a < 0x38800000u) {
    float r = rintf(__uint_as_float(a) * 16777216.0f);  // rint: nearest, ties to even
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r));
  }
  std::uint32_t lsb = (a >> 13) & 1u;
  a += 0xfffu + lsb;
  a -= 112u << 23;
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(a >> 13));
}

__device__ inline double load_as_double(const void* p, DType t, i64 i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::f16: return f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::i32: return static_cast<const std::int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case DType::u32: return static_cast<const std::uint32_t*>(p)[i];
    case DType::u8: return static_cast<const std::uint8_t*>(p)[i];
  }
  return 0;
}
__device__ inline void store_from_double(void* p, DType t, i64 i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::bf16: static_cast<std::uint16_t*>(p)[i] = f32_to_bf16(static_cast<float>(v)); break;
    case DType::f16: static_cast<std::uint16_t*>(p)[i] = f32_to_f16(static_cast<float>(v)); break;
    case DType::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case DType::i64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
    case DType::u32: static_cast<std::uint32_t*>(p)[i] = static_cast<std::uint32_t>(v); break;
    case DType::u8: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); break;
  }
}
/// A where-mask element is true when nonzero, in any dtype (cpu.hpp's mask_at).
__device__ inline bool mask_at(const void* m, DType t, i64 i) { return load_as_double(m, t, i) != 0.0; }

__device__ inline i64 load_index(const void* ids, bool i32, i64 i) {
  return i32 ? static_cast<i64>(static_cast<const std::int32_t*>(ids)[i]) : static_cast<const i64*>(ids)[i];
}
/// Records a bad index: the smallest position wins (atomicMin is order-independent), its id
/// kept in the low 32 bits for the message.
__device__ inline void index_error(unsigned long long* errs, int kind, i64 pos, i64 id) {
  const unsigned long long key = (static_cast<unsigned long long>(pos) << 32) |
                                 static_cast<std::uint32_t>(static_cast<std::int32_t>(id));
  atomicMin(errs + kind, key);
}

// ---- broadcasting: an output index to the offsets of N inputs ------------------------------
template <int N>
struct Strided {
  int rank = 0;
  i64 dim[kMaxRank] = {};
  i64 st[N][kMaxRank] = {};
};

template <int N>
Strided<N> make_strided(const Shape& out, const std::array<std::array<i64, kMaxRank>, N>& st) {
  Strided<N> s;
  s.rank = out.rank();
  for (int d = 0; d < out.rank(); ++d) {
    s.dim[d] = out[d];
    for (int k = 0; k < N; ++k) s.st[k][d] = st[static_cast<std::size_t>(k)][static_cast<std::size_t>(d)];
  }
  return s;
}

template <int N>
__device__ inline void offsets(const Strided<N>& s, i64 i, i64 (&o)[N]) {
  for (int k = 0; k < N; ++k) o[k] = 0;
  for (int d = s.rank - 1; d >= 0; --d) {
    const i64 q = i / s.dim[d], r = i - q * s.dim[d];
    i = q;
    for (int k = 0; k < N; ++k) o[k] += r * s.st[k][d];
  }
}

// ---- block reductions: a fixed tree over the block, so the same input gives the same bits ---
struct SumOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a + b;
  }
};
/// std::max(a, b)'s rule (a < b ? b : a): a NaN never replaces a running maximum, as cpu.hpp's
/// softmax and cross-entropy maxima behave.
struct MaxOp {
  template <class T>
  __device__ T operator()(T a, T b) const {
    return a < b ? b : a;
  }
};

/// Reduces v over the block (blockDim.x a power of two) through sh (blockDim.x elements); every
/// thread gets the result. Pairs are fixed by thread index, not by arrival: deterministic.
template <class T, class Op>
__device__ inline T block_reduce(T v, T* sh, Op op) {
  const unsigned t = threadIdx.x;
  sh[t] = v;
  __syncthreads();
  for (unsigned s = blockDim.x / 2; s > 0; s >>= 1) {
    if (t < s) sh[t] = op(sh[t], sh[t + s]);
    __syncthreads();
  }
  T r = sh[0];
  __syncthreads();
  return r;
}

// ---- fill, copy, cast ------------------------------------------------------------------------
template <class T>
__global__ void k_fill(T* y, T v, i64 n) {
  NN_CU_FOR(i, n) y[i] = v;
}
template <class T>
__global__ void k_add_into(const T* x, T* y, i64 n) {
  NN_CU_FOR(i, n) y[i] += x[i];
}
// (Templates, like every kernel here, so the header can sit in many translation units.)
template <int = 0>
__global__ void k_cast(const void* x, DType xt, void* y, DType yt, i64 n) {
  // Tensor::to's paths: f32 -> bf16/f16 straight from the float's bits (a NaN's payload never
  // goes through a double), i64 -> i32 exactly, everything else through double.
  NN_CU_FOR(i, n) {
    if (xt == DType::f32 && yt == DType::bf16)
      static_cast<std::uint16_t*>(y)[i] = f32_to_bf16(static_cast<const float*>(x)[i]);
    else if (xt == DType::f32 && yt == DType::f16)
      static_cast<std::uint16_t*>(y)[i] = f32_to_f16(static_cast<const float*>(x)[i]);
    else if (xt == DType::i64 && yt == DType::i32)
      static_cast<std::int32_t*>(y)[i] = static_cast<std::int32_t>(static_cast<const i64*>(x)[i]);
    else
      store_from_double(y, yt, i, load_as_double(x, xt, i));
  }
}

// ---- elementwise ---------------------------------------------------------------------------
template <class T>
__global__ void k_unary(Unary op, T a, const T* x, T* y, i64 n) {
  NN_CU_FOR(i, n) y[i] = unary_f(op, x[i], a);
}
template <class T>
__global__ void k_unary_vjp(Unary op, T a, const T* x, const T* y, const T* g, T* gx, i64 n, bool acc) {
  NN_CU_FOR(i, n) put(gx, i, g[i] * unary_df(op, x[i], y[i], a), acc);
}
template <class T>
__global__ void k_binary_same(Binary op, const T* a, const T* b, T* y, i64 n) {
  NN_CU_FOR(i, n) y[i] = binary_f(op, a[i], b[i]);
}
template <class T>
__global__ void k_binary_bc(Binary op, const T* a, const T* b, T* y, i64 n, Strided<2> s) {
  NN_CU_FOR(i, n) {
    i64 o[2];
    offsets(s, i, o);
    y[i] = binary_f(op, a[o[0]], b[o[1]]);
  }
}
template <class T>
__global__ void k_binary_vjp_same(Binary op, int which, const T* a, const T* b, const T* g, T* d, i64 n, bool acc) {
  NN_CU_FOR(i, n) put(d, i, g[i] * binary_df(op, which, a[i], b[i]), acc);
}
template <class T>
__global__ void k_binary_vjp_bc(Binary op, int which, const T* a, const T* b, const T* g, T* d, i64 n, Strided<2> s,
                                bool acc) {
  NN_CU_FOR(i, n) {
    i64 o[2];
    offsets(s, i, o);
    put(d, i, g[i] * binary_df(op, which, a[o[0]], b[o[1]]), acc);
  }
}
template <class T>
__global__ void k_broadcast(const T* x, T* y, i64 n, Strided<1> s, T sc, bool acc) {
  NN_CU_FOR(i, n) {
    i64 o[1];
    offsets(s, i, o);
    put(y, i, sc * x[o[0]], acc);
  }
}
template <class T>
__global__ void k_where(const void* m, DType mt, const T* a, const T* b, T* y, i64 n, Strided<3> s) {
  NN_CU_FOR(i, n) {
    i64 o[3];
    offsets(s, i, o);
    y[i] = mask_at(m, mt, o[0]) ? a[o[1]] : b[o[2]];
  }
}
template <class T>
__global__ void k_where_vjp(const void* m, DType mt, const T* g, int which, T* d, i64 n, Strided<1> s, bool acc) {
  NN_CU_FOR(i, n) {
    i64 o[1];
    offsets(s, i, o);
    const bool take = mask_at(m, mt, o[0]) == (which == 0);
    put(d, i, take ? g[i] : T(0), acc);
  }
}

// ---- fused elementwise groups (ops/fused.hpp's FusedProgram; backend/cpu/fused.hpp's math) --
// One thread per output element runs the whole program in registers: the inputs read through
// their broadcast strides, each step through the functors the unfused kernels call (unary_f,
// binary_f; their derivatives in the vjp), so a fused step computes what the unfused nodes did,
// element by element. The vjp recomputes the intermediates it needs (FusedProgram::vjp_need),
// reads the last step's value from the output, and walks the steps in reverse as the backward
// sweep walks the nodes, adding each contribution to an input in the sweep's order.
template <class T>
struct FusedInputs {
  const void* p[kMaxFusedInputs] = {};
  DType dt[kMaxFusedInputs] = {};  // another than T's: a where's mask, loaded as 0 / 1
};
template <class T>
__device__ inline T fused_input(const FusedInputs<T>& in, int k, i64 o) {
  return in.dt[k] == nn::detail::dtype_of<T>() ? static_cast<const T*>(in.p[k])[o] : (mask_at(in.p[k], in.dt[k], o) ? T(1) : T(0));
}
template <class T>
struct FusedDests {
  T* p[2 * kMaxFusedSteps] = {};
  bool acc[2 * kMaxFusedSteps] = {};
};
template <class T>
__device__ inline T fused_step_value(const FusedStep& st, const T* r) {
  if (st.select) return r[st.m] != T(0) ? r[st.a] : r[st.b];
  return st.binary ? binary_f(static_cast<Binary>(st.op), r[st.a], r[st.b])
                   : unary_f(static_cast<Unary>(st.op), r[st.a], static_cast<T>(st.arg));
}
template <class T>
__global__ void k_fused(FusedProgram p, FusedInputs<T> in, T* y, i64 n, Strided<kMaxFusedInputs> s) {
  NN_CU_FOR(i, n) {
    i64 o[kMaxFusedInputs];
    offsets(s, i, o);
    T r[kMaxFusedInputs + kMaxFusedSteps];
    for (int k = 0; k < p.inputs; ++k) r[k] = fused_input(in, k, o[k]);
    for (int st = 0; st < p.steps; ++st) r[p.inputs + st] = fused_step_value(p.step[st], r);
    y[i] = r[p.inputs + p.steps - 1];
  }
}
template <class T>
__global__ void k_fused_vjp(FusedProgram p, FusedInputs<T> in, const T* y, const T* g, FusedDests<T> d, i64 n,
                            Strided<kMaxFusedInputs> s) {
  NN_CU_FOR(i, n) {
    i64 o[kMaxFusedInputs];
    offsets(s, i, o);
    auto need = [&](int reg) { return ((p.vjp_need >> reg) & 1u) != 0; };
    T r[kMaxFusedInputs + kMaxFusedSteps];
    for (int k = 0; k < p.inputs; ++k) r[k] = need(k) ? fused_input(in, k, o[k]) : T(0);
    const int last = p.inputs + p.steps - 1;
    for (int st = 0; st + 1 < p.steps; ++st) r[p.inputs + st] = need(p.inputs + st) ? fused_step_value(p.step[st], r) : T(0);
    r[last] = need(last) ? y[i] : T(0);
    T gr[kMaxFusedSteps];  // d loss / d (step s's value), s < steps - 1
    int c = 0;             // the next contribution to an input
    auto give = [&](int reg, T v) {
      if (reg >= p.inputs) {
        gr[reg - p.inputs] = v;  // an intermediate: its one consumer's gradient, written once
      } else {
        put(d.p[c], i, v, d.acc[c]);
        ++c;
      }
    };
    for (int st = p.steps - 1; st >= 0; --st) {
      const FusedStep& f = p.step[st];
      if (!f.grad) continue;
      const T go = st == p.steps - 1 ? g[i] : gr[st];
      if (f.select) {  // where's vjp: the cotangent where the branch was taken, else 0
        const bool take_a = r[f.m] != T(0);
        if (f.grad_a) give(f.a, take_a ? go : T(0));
        if (f.grad_b) give(f.b, take_a ? T(0) : go);
        continue;
      }
      if (!f.binary) {
        if (f.grad_a) give(f.a, go * unary_df(static_cast<Unary>(f.op), r[f.a], r[p.inputs + st], static_cast<T>(f.arg)));
        continue;
      }
      if (f.grad_a) give(f.a, go * binary_df(static_cast<Binary>(f.op), 0, r[f.a], r[f.b]));
      if (f.grad_b) give(f.b, go * binary_df(static_cast<Binary>(f.op), 1, r[f.a], r[f.b]));
    }
  }
}

// ---- sums: deterministic (fixed order per output) --------------------------------------------

/// One block per contiguous row: y[o] (+)= sc * sum(x[o, :]).
template <class T>
__global__ void k_sum_rows(const T* x, T* y, i64 outer, i64 red, T sc, bool acc) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(o, outer) {
    const T* row = x + o * red;
    T s = 0;
    for (i64 k = threadIdx.x; k < red; k += blockDim.x) s += row[k];
    s = block_reduce(s, sh, SumOp{});
    if (threadIdx.x == 0) put(y, o, sc * s, acc);
  }
}
/// One thread per output of a middle-axis reduction, walking the reduced axis in order
/// (neighbouring threads read neighbouring addresses).
template <class T>
__global__ void k_sum_mid(const T* x, T* y, i64 outer, i64 red, i64 inner, T sc, bool acc) {
  NN_CU_FOR(e, outer * inner) {
    const i64 o = e / inner, i = e - o * inner;
    const T* src = x + o * red * inner + i;
    T s = 0;
    for (i64 k = 0; k < red; ++k) s += src[k * inner];
    put(y, e, sc * s, acc);
  }
}
/// Any reduction: the kept dims index the output, the reduced dims are walked in row-major order.
struct ReduceSpec {
  int kept = 0, reduced = 0;
  i64 kept_dim[kMaxRank] = {}, kept_st[kMaxRank] = {};
  i64 red_dim[kMaxRank] = {}, red_st[kMaxRank] = {};
  i64 red_n = 1;
};
template <class T>
__global__ void k_sum_general(const T* x, T* y, i64 ny, ReduceSpec r, T sc, bool acc) {
  NN_CU_FOR(j, ny) {
    i64 base = 0, q = j;
    for (int d = r.kept - 1; d >= 0; --d) {
      const i64 n = q / r.kept_dim[d];
      base += (q - n * r.kept_dim[d]) * r.kept_st[d];
      q = n;
    }
    T s = 0;
    for (i64 k = 0; k < r.red_n; ++k) {
      i64 off = base, p = k;
      for (int d = r.reduced - 1; d >= 0; --d) {
        const i64 n = p / r.red_dim[d];
        off += (p - n * r.red_dim[d]) * r.red_st[d];
        p = n;
      }
      s += x[off];
    }
    put(y, j, sc * s, acc);
  }
}

// ---- max over an axis ------------------------------------------------------------------------
template <class T>
__global__ void k_max_axis(const T* x, T* y, std::int32_t* idx, i64 outer, i64 red, i64 inner) {
  NN_CU_FOR(e, outer * inner) {
    const i64 o = e / inner, i = e - o * inner;
    const T* p = x + o * red * inner + i;
    T best = p[0];
    std::int32_t bi = 0;
    for (i64 k = 1; k < red && !d_isnan(best); ++k) {
      const T v = p[k * inner];
      if (v > best || d_isnan(v)) {
        best = v;
        bi = static_cast<std::int32_t>(k);
      }
    }
    y[e] = best;
    idx[e] = bi;
  }
}
template <class T>
__global__ void k_max_axis_vjp(const T* g, const std::int32_t* idx, T* gx, i64 outer, i64 red, i64 inner) {
  NN_CU_FOR(e, outer * inner) {  // each output owns one distinct gx element: no race
    const i64 o = e / inner, i = e - o * inner;
    gx[(o * red + idx[e]) * inner + i] += g[e];
  }
}

// ---- data movement (element size only, so any dtype moves bit for bit) -----------------------
template <class E>
__global__ void k_permute(const E* x, E* y, i64 n, Strided<1> s) {
  NN_CU_FOR(i, n) {
    i64 o[1];
    offsets(s, i, o);
    y[i] = x[o[0]];
  }
}
template <class T>
__global__ void k_permute_acc(const T* x, T* y, i64 n, Strided<1> s) {
  NN_CU_FOR(i, n) {
    i64 o[1];
    offsets(s, i, o);
    y[i] += x[o[0]];
  }
}
/// y[o, k] = x[o * F + S + k] for k < L: a slice of L elements out of each row of F.
template <class E>
__global__ void k_slice_copy(const E* x, E* y, i64 outer, i64 F, i64 S, i64 L) {
  NN_CU_FOR(i, outer * L) {
    const i64 o = i / L, k = i - o * L;
    y[i] = x[o * F + S + k];
  }
}
template <class E>
__global__ void k_slice_scatter(const E* x, E* y, i64 outer, i64 F, i64 S, i64 L) {
  NN_CU_FOR(i, outer * L) {
    const i64 o = i / L, k = i - o * L;
    y[o * F + S + k] = x[i];
  }
}
template <class T>
__global__ void k_slice_scatter_acc(const T* x, T* y, i64 outer, i64 F, i64 S, i64 L) {
  NN_CU_FOR(i, outer * L) {
    const i64 o = i / L, k = i - o * L;
    y[o * F + S + k] += x[i];
  }
}

/// A dense table's element (r, c), for k_gather_rows.
template <class E>
struct DenseRows {
  const E* table;
  i64 D;
  __device__ E operator()(i64 r, i64 c) const { return table[r * D + c]; }
};
/// y[i, j] = rows(ids[i], j) for a table of N rows (DenseRows, or QuantRows below). An id out of
/// range writes a zero row and records the error once (its j == 0 thread).
template <class E, class Rows>
__global__ void k_gather_rows(Rows rows, const void* ids, bool i32, E* y, i64 n, i64 D, i64 N, unsigned long long* errs) {
  NN_CU_FOR(e, n * D) {
    const i64 i = e / D, j = e - i * D;
    const i64 id = load_index(ids, i32, i);
    if (id < 0 || id >= N) {
      if (j == 0) index_error(errs, kGatherRows, i, id);
      y[e] = E(0);
    } else {
      y[e] = rows(id, j);
    }
  }
}
/// gt[ids[i], j] += g[i, j], deterministic without sorting: thread (b, j) owns column j of the
/// table rows in bucket b and walks every id in order, so each table element is summed by one
/// thread in the order of the ids (cpu.hpp's order exactly).
template <class T>
__global__ void k_scatter_add_rows(const T* g, const void* ids, bool i32, T* gt, i64 n, i64 D, i64 N, i64 nb) {
  NN_CU_FOR(e, D * nb) {
    const i64 b = e / D, j = e - b * D;
    const i64 lo = b * N / nb, hi = (b + 1) * N / nb;
    for (i64 i = 0; i < n; ++i) {
      const i64 id = load_index(ids, i32, i);
      if (id >= lo && id < hi) gt[id * D + j] += g[i * D + j];
    }
  }
}
template <class T>
__global__ void k_pick(const T* x, const void* idx, bool i32, T* y, i64 R, i64 V, unsigned long long* errs) {
  NN_CU_FOR(i, R) {
    const i64 k = load_index(idx, i32, i);
    if (k >= V) {
      index_error(errs, kPick, i, k);
      y[i] = T(0);
    } else {
      y[i] = k < 0 ? T(0) : x[i * V + k];
    }
  }
}
template <class T>
__global__ void k_pick_vjp(const T* g, const void* idx, bool i32, T* gx, i64 R, i64 V) {
  NN_CU_FOR(i, R) {  // one row each: no race
    const i64 k = load_index(idx, i32, i);
    if (k >= 0 && k < V) gx[i * V + k] += g[i];
  }
}

// ---- the dropout mask: MLX's bernoulli, random.hpp's functions run on the device -------------
template <class M>
__global__ void k_bernoulli(const std::uint32_t* key, std::uint32_t k0, std::uint32_t k1, float p, M on, M* m, i64 n,
                            i64 blocks) {
  if (key) {  // read at run time: a replayed graph draws from whatever key the slot holds now
    k0 = key[0];
    k1 = key[1];
  }
  NN_CU_FOR(j, blocks) {
    random::detail::bits_block(k0, k1, n, j, [&](i64 i, std::uint32_t w) {
      m[i] = random::detail::uniform01(w) < p ? on : M(0);
    });
  }
}

// ---- softmax: one block per row ----------------------------------------------------------------
template <class T>
__global__ void k_softmax(const T* x, T* y, i64 R, i64 V, bool log) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, R) {
    const T* in = x + r * V;
    T* out = y + r * V;
    T m = -d_inf<T>();
    for (i64 j = threadIdx.x; j < V; j += blockDim.x) m = MaxOp{}(m, in[j]);
    m = SoftmaxMath::finite_max(block_reduce(m, sh, MaxOp{}));  // a fully masked row stays finite
    T s = 0;
    for (i64 j = threadIdx.x; j < V; j += blockDim.x) s += m_exp(in[j] - m);
    s = block_reduce(s, sh, SumOp{});
    if (log) {
      const T ls = m_log(s);
      for (i64 j = threadIdx.x; j < V; j += blockDim.x) out[j] = SoftmaxMath::log_p(in[j], m, ls);
    } else {
      const T inv = T(1) / s;
      for (i64 j = threadIdx.x; j < V; j += blockDim.x) out[j] = m_exp(in[j] - m) * inv;
    }
  }
}
template <class T>
__global__ void k_softmax_vjp(const T* y, const T* g, T* gx, i64 R, i64 V, bool log, bool acc) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, R) {
    const T* yr = y + r * V;
    const T* gr = g + r * V;
    T* o = gx + r * V;
    T s = 0;
    if (log) {
      for (i64 j = threadIdx.x; j < V; j += blockDim.x) s += gr[j];
      s = block_reduce(s, sh, SumOp{});
      for (i64 j = threadIdx.x; j < V; j += blockDim.x) put(o, j, SoftmaxMath::log_vjp(gr[j], yr[j], s), acc);
    } else {
      for (i64 j = threadIdx.x; j < V; j += blockDim.x) s += gr[j] * yr[j];
      s = block_reduce(s, sh, SumOp{});
      for (i64 j = threadIdx.x; j < V; j += blockDim.x) put(o, j, SoftmaxMath::vjp(yr[j], gr[j], s), acc);
    }
  }
}

// ---- cross-entropy (cpu.hpp's row mapping: target r scores row (r / N) * G + r % N) ----------
__device__ inline i64 ce_row(i64 r, i64 N, i64 G) { return (r / N) * G + r % N; }

template <class T>
__global__ void k_ce_rows(const T* x, const void* t, bool i32, i64 ignore, int reduction, T* y, T* lse, i64 R, i64 V,
                          i64 N, i64 G, unsigned long long* errs) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, R) {
    const T* in = x + ce_row(r, N, G) * V;
    const i64 k = load_index(t, i32, r);
    const bool bad = k != ignore && (k < 0 || k >= V);
    if (bad && threadIdx.x == 0) index_error(errs, kCrossEntropy, r, k);
    T m = -d_inf<T>();
    for (i64 j = threadIdx.x; j < V; j += blockDim.x) m = MaxOp{}(m, in[j]);
    m = block_reduce(m, sh, MaxOp{});
    T s = 0;
    for (i64 j = threadIdx.x; j < V; j += blockDim.x) s += m_exp(in[j] - m);
    s = block_reduce(s, sh, SumOp{});
    if (threadIdx.x == 0) {
      const T l = SoftmaxMath::lse(m, s);
      lse[r] = l;
      if (reduction == 0) y[r] = (k == ignore || bad) ? T(0) : SoftmaxMath::ce_loss(l, in[k]);
    }
  }
}
/// The sum (or mean over kept targets) of the per-target losses, in one block: a fixed tree.
template <class T>
__global__ void k_ce_reduce(const T* x, const void* t, bool i32, i64 ignore, int reduction, const T* lse, T* y, i64 R,
                            i64 V, i64 N, i64 G) {
  __shared__ double buf[kBlock];
  __shared__ long long cbuf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  T total = 0;
  long long count = 0;
  for (i64 r = threadIdx.x; r < R; r += blockDim.x) {
    const i64 k = load_index(t, i32, r);
    if (k == ignore || k < 0 || k >= V) continue;
    total += SoftmaxMath::ce_loss(lse[r], x[ce_row(r, N, G) * V + k]);
    ++count;
  }
  total = block_reduce(total, sh, SumOp{});
  count = block_reduce(count, cbuf, SumOp{});
  if (threadIdx.x == 0) y[0] = reduction == 2 ? total / static_cast<T>(count) : total;
}
/// The number of targets not ignored, for the mean's gradient (into a scratch word).
template <int = 0>
__global__ void k_ce_count(const void* t, bool i32, i64 ignore, i64 R, long long* out) {
  __shared__ long long cbuf[kBlock];
  long long count = 0;
  for (i64 r = threadIdx.x; r < R; r += blockDim.x) count += load_index(t, i32, r) != ignore;
  count = block_reduce(count, cbuf, SumOp{});
  if (threadIdx.x == 0) *out = count;
}
/// Rows past the first N of each group of G are scored by no target: their gradient is 0.
template <class T>
__global__ void k_ce_zero_unscored(T* gx, i64 groups, i64 G, i64 N, i64 V) {
  const i64 per = (G - N) * V;
  NN_CU_FOR(e, groups * per) {
    const i64 b = e / per, rem = e - b * per;
    gx[(b * G + N) * V + rem] = T(0);
  }
}
template <class T>
__global__ void k_ce_vjp(const T* x, const void* t, bool i32, i64 ignore, int reduction, const T* lse, const T* g,
                         const long long* count, T* gx, i64 R, i64 V, i64 N, i64 G, bool acc) {
  NN_CU_ROWS(r, R) {
    const i64 k = load_index(t, i32, r);
    T* o = gx + ce_row(r, N, G) * V;
    if (k == ignore || k < 0 || k >= V) {  // block-uniform branch
      if (!acc)
        for (i64 j = threadIdx.x; j < V; j += blockDim.x) o[j] = T(0);
      continue;
    }
    T g0 = reduction == 0 ? T(0) : g[0];
    if (reduction == 2) g0 = g0 / static_cast<T>(*count);
    const T* in = x + ce_row(r, N, G) * V;
    const T gr = reduction == 0 ? g[r] : g0, l = lse[r];
    for (i64 j = threadIdx.x; j < V; j += blockDim.x) put(o, j, SoftmaxMath::ce_grad(in[j], l, gr), acc);
    __syncthreads();  // the whole row is written before the target's element is adjusted
    if (threadIdx.x == 0) o[k] -= gr;
    __syncthreads();
  }
}

// ---- fused primitives (cpu.hpp's rms_norm, rope, attention, swiglu) -------------------------

/// One block per row: rstd = 1 / sqrt(mean(x^2) + eps), y = (x * rstd) * w.
template <class T>
__global__ void k_rms_norm(const T* x, const T* w, T* y, T* rstd, i64 R, i64 C, T inv_c, T eps) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, R) {
    const T* xr = x + r * C;
    T* yr = y + r * C;
    T s = 0;
    for (i64 j = threadIdx.x; j < C; j += blockDim.x) s += xr[j] * xr[j];
    s = block_reduce(s, sh, SumOp{});
    const T k = RmsNormMath::rstd(s, inv_c, eps);
    if (threadIdx.x == 0) rstd[r] = k;
    for (i64 j = threadIdx.x; j < C; j += blockDim.x) yr[j] = w ? (xr[j] * k) * w[j] : xr[j] * k;
  }
}
/// gx (+)= rstd u - rstd^3 x sum(u x) / C per row, u = g * w (or g): one block per row.
template <class T>
__global__ void k_rms_norm_vjp_x(const T* x, const T* w, const T* rstd, const T* g, T* gx, i64 R, i64 C, T inv_c,
                                 bool acc) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, R) {
    const T* xr = x + r * C;
    const T* gr = g + r * C;
    T* o = gx + r * C;
    T s = 0;
    for (i64 j = threadIdx.x; j < C; j += blockDim.x) s += (w ? gr[j] * w[j] : gr[j]) * xr[j];
    s = block_reduce(s, sh, SumOp{});
    const T k = rstd[r], c = RmsNormMath::vjp_coef(k, inv_c, s);
    for (i64 j = threadIdx.x; j < C; j += blockDim.x) put(o, j, RmsNormMath::gx(k, w ? gr[j] * w[j] : gr[j], c, xr[j]), acc);
  }
}
/// gw (+)= sum over rows of g x rstd: one thread per column, rows in order (the CPU's order).
template <class T>
__global__ void k_rms_norm_vjp_w(const T* x, const T* rstd, const T* g, T* gw, i64 R, i64 C, bool acc) {
  NN_CU_FOR(j, C) {
    T s = acc ? gw[j] : T(0);
    for (i64 r = 0; r < R; ++r) s += g[r * C + j] * x[r * C + j] * rstd[r];
    gw[j] = s;
  }
}
/// One thread per output element: the rotated pair member it owns, or a pass-through feature.
template <class T>
__global__ void k_rope(const T* x, const T* cs, const T* ss, T* y, i64 rows, i64 D, i64 half, i64 M, i64 Tn,
                       bool traditional, T sg, bool acc) {
  NN_CU_FOR(e, rows * D) {
    const i64 r = e / D, j = e - r * D;
    const T* a = x + r * D;
    T v;
    if (j < 2 * half) {
      const i64 i = traditional ? j / 2 : (j < half ? j : j - half);
      const bool first = traditional ? (j % 2 == 0) : (j < half);
      const i64 i1 = traditional ? 2 * i : i, i2 = traditional ? 2 * i + 1 : i + half;
      const i64 t = (r / M) % Tn;
      const T c = cs[t * half + i], si = sg * ss[t * half + i];
      v = first ? RopeMath::first(a[i1], a[i2], c, si) : RopeMath::second(a[i1], a[i2], c, si);
    } else {
      v = a[j];
    }
    put(y, e, v, acc);
  }
}
/// Attention's scores to probabilities in place, one block per row of P (B, H, T, T):
/// row = softmax(scale * row + mask row) (cpu.hpp's softmax_row); causal: over keys 0..i only,
/// the rest of the row 0.
template <class T>
__global__ void k_attn_softmax(T* P, const T* mask, i64 H, i64 Tn, i64 ms0, i64 ms1, i64 ms2, i64 ms3, T scale,
                               i64 rows, bool causal) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, rows) {
    const i64 i = r % Tn, bh = r / Tn, h = bh % H, b = bh / H;
    T* row = P + r * Tn;
    const T* add = mask ? mask + b * ms0 + h * ms1 + i * ms2 : nullptr;
    const i64 n = causal ? i + 1 : Tn;
    T m = -d_inf<T>();
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
      const T v = add ? row[j] * scale + add[j * ms3] : row[j] * scale;
      row[j] = v;
      m = MaxOp{}(m, v);
    }
    m = SoftmaxMath::finite_max(block_reduce(m, sh, MaxOp{}));
    T s = 0;
    for (i64 j = threadIdx.x; j < n; j += blockDim.x) {
      const T e = m_exp(row[j] - m);
      row[j] = e;
      s += e;
    }
    s = block_reduce(s, sh, SumOp{});
    const T inv = T(1) / s;
    for (i64 j = threadIdx.x; j < Tn; j += blockDim.x) row[j] = j < n ? row[j] * inv : T(0);
  }
}
/// dS = P * (dS - rowsum(P * dS)) * scale in place, one block per row; rows of `nb` matrices at
/// ds + u * ds_stride, p + u * p_stride.
template <class T>
__global__ void k_attn_dsoftmax(T* ds, i64 ds_stride, const T* p, i64 p_stride, i64 nb, i64 Tn, T scale) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  NN_CU_ROWS(r, nb * Tn) {
    const i64 u = r / Tn, i = r - u * Tn;
    T* d = ds + u * ds_stride + i * Tn;
    const T* pr = p + u * p_stride + i * Tn;
    T dot = 0;
    for (i64 j = threadIdx.x; j < Tn; j += blockDim.x) dot += d[j] * pr[j];
    dot = block_reduce(dot, sh, SumOp{});
    for (i64 j = threadIdx.x; j < Tn; j += blockDim.x) d[j] = SoftmaxMath::vjp(pr[j], d[j], dot) * scale;
  }
}
template <class T>
__global__ void k_swiglu(const T* a, const T* u, T* y, i64 n) {
  NN_CU_FOR(i, n) y[i] = SwiGluMath::y(a[i], u[i]);
}
template <class T>
__global__ void k_swiglu_vjp(const T* a, const T* u, const T* g, T* da, bool acc_a, T* du, bool acc_u, i64 n) {
  NN_CU_FOR(i, n) {
    const T s = SwiGluMath::sig(a[i]);
    if (da) put(da, i, SwiGluMath::dgate(a[i], u[i], g[i], s), acc_a);
    if (du) put(du, i, SwiGluMath::dup(a[i], g[i], s), acc_u);
  }
}

// ---- optimizer updates: backend/math.hpp's functors, one thread per element -----------------
template <class T>
__global__ void k_sgd(T* p, const T* g, T* v, SgdMath<T> f, i64 n) {
  NN_CU_FOR(i, n) f(p[i], g[i], v ? v + i : nullptr);
}
template <class T>
__global__ void k_adam(T* p, const T* g, T* m, T* v, AdamMath<T> f, i64 n) {
  NN_CU_FOR(i, n) {
    const T pi = f.decoupled ? p[i] * f.decay : p[i];
    const T mi = f.m(m[i], g[i]);
    const T vi = f.v(v[i], g[i]);
    m[i] = mi;
    v[i] = vi;
    p[i] = pi - f.delta(mi, m_sqrt(vi));
  }
}
template <class T>
__global__ void k_lion(T* p, const T* g, T* m, LionMath<T> f, i64 n) {
  NN_CU_FOR(i, n) f(p[i], g[i], m[i]);
}
template <class T>
__global__ void k_muon_momentum(const T* p, const T* g, T* v, T* u, MuonMomentumMath<T> f, i64 n) {
  NN_CU_FOR(i, n) f(p[i], g[i], v[i], u[i]);
}
template <class T>
__global__ void k_axpby(AxpbyMath<T> f, const T* x, T* y, i64 n) {
  NN_CU_FOR(i, n) y[i] = f(x[i], y[i]);
}
template <class T>
__global__ void k_apply_update(T* p, const T* x, ApplyUpdateMath<T> f, i64 n) {
  NN_CU_FOR(i, n) p[i] = f(p[i], x[i]);
}
/// sum of x^2 in double, one block (a fixed tree), into out[0].
template <class T>
__global__ void k_sum_squares(const T* x, i64 n, double* out) {
  __shared__ double sh[kBlock];
  double s = 0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += static_cast<double>(x[i]) * static_cast<double>(x[i]);
  s = block_reduce(s, sh, SumOp{});
  if (threadIdx.x == 0) out[0] = s;
}
/// d = sqrt(sum x^2) + eps in T, one block, into *d (then k_divide_by divides by it).
template <class T>
__global__ void k_frobenius(const T* x, i64 n, T eps, T* d) {
  __shared__ double buf[kBlock];
  T* sh = reinterpret_cast<T*>(buf);
  T s = 0;
  for (i64 i = threadIdx.x; i < n; i += blockDim.x) s += x[i] * x[i];
  s = block_reduce(s, sh, SumOp{});
  if (threadIdx.x == 0) *d = m_sqrt(s) + eps;
}
template <class T>
__global__ void k_divide_by(T* x, i64 n, const T* d) {
  const T dv = *d;
  NN_CU_FOR(i, n) x[i] = x[i] / dv;
}

// ---- quantized matrices (quant.hpp): QuantMath's reader, one thread per output element ------
/// A quantized matrix's element W[r, c] in T (quant.hpp's formats): codes, row_bytes per row,
/// scales (T, or u8 for the fp modes) and biases (T, affine) of `groups` groups per row.
template <class T>
struct QuantRows {
  const std::uint8_t* codes;
  i64 row_bytes;
  const void* scales;
  const T* biases;
  i64 groups;
  Quant q;
  __device__ T operator()(i64 r, i64 c) const {
    const std::uint32_t code = QuantMath::code(codes + r * row_bytes, c, q.bits, row_bytes);
    const i64 si = r * groups + c / q.group;
    if (q.mode == QuantMode::affine) return static_cast<const T*>(scales)[si] * static_cast<T>(code) + biases[si];
    const std::uint8_t sb = static_cast<const std::uint8_t*>(scales)[si];
    const T s = q.mode == QuantMode::nvfp4 ? static_cast<T>(QuantMath::e4m3(sb)) : QuantMath::e8m0<T>(sb);
    return s * static_cast<T>(q.mode == QuantMode::mxfp8 ? QuantMath::e4m3(code) : QuantMath::e2m1(code));
  }
};
/// y[m, n] (+)= sum_k x[m, k] op(W)[k, n]; op(W)[k, n] = W[n, k] (transpose) or W[k, n].
template <class T>
__global__ void k_quantized_matmul(const T* x, QuantRows<T> w, bool transpose, T* y, i64 M, i64 N, i64 K, bool acc) {
  NN_CU_FOR(e, M * N) {
    const i64 m = e / N, n = e - m * N;
    T s = 0;
    for (i64 k = 0; k < K; ++k) s += x[m * K + k] * (transpose ? w(n, k) : w(k, n));
    put(y, e, s, acc);
  }
}

#undef NN_CU_FOR
#undef NN_CU_ROWS

}  // namespace nn::detail::cu
