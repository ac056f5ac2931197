// SPDX-License-Identifier: MIT OR Apache-2.0
// What every family of nn::cpu's kernels shares: dtype dispatch, the OpenMP loop helpers,
// broadcasting strides, and the vectorised row math (Eigen array maps, exp, exact sqrt).
#pragma once

#include <cctype>
#include <cmath>
#include <limits>
#include <numbers>
#include <new>

#include <Eigen/Core>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__SSE2__) || defined(__AVX__)
#include <immintrin.h>
#endif

#include "../math.hpp"
#include "../policy.hpp"
#include "../simd.hpp"
#include "../threads.hpp"

namespace nn {
namespace detail {

/// Runs f.template operator()<T>() for T = float or double; other dtypes are an error naming op.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  if (t == DType::f32) f.template operator()<float>();
  else if (t == DType::f64) f.template operator()<double>();
  else fail(op, "needs a float32 or float64 tensor, got ", dtype_name(t));
}

/// Runs f.template operator()<Op>() with the Binary op as a compile-time constant: the
/// elementwise loops then inline one operation and vectorise (a switch per element does not).
template <class F>
void dispatch_binary(Binary op, F&& f) {
  switch (op) {
    case Binary::add: f.template operator()<Binary::add>(); return;
    case Binary::sub: f.template operator()<Binary::sub>(); return;
    case Binary::mul: f.template operator()<Binary::mul>(); return;
    case Binary::div: f.template operator()<Binary::div>(); return;
    case Binary::maximum: f.template operator()<Binary::maximum>(); return;
    case Binary::minimum: f.template operator()<Binary::minimum>(); return;
  }
}

/// Runs f.template operator()<Op>() with the Unary op as a compile-time constant (as
/// dispatch_binary): the fused kernel's per-step loops.
template <class F>
void dispatch_unary(Unary op, F&& f) {
  switch (op) {
    case Unary::neg: f.template operator()<Unary::neg>(); return;
    case Unary::exp: f.template operator()<Unary::exp>(); return;
    case Unary::log: f.template operator()<Unary::log>(); return;
    case Unary::sqrt: f.template operator()<Unary::sqrt>(); return;
    case Unary::rsqrt: f.template operator()<Unary::rsqrt>(); return;
    case Unary::tanh: f.template operator()<Unary::tanh>(); return;
    case Unary::sigmoid: f.template operator()<Unary::sigmoid>(); return;
    case Unary::relu: f.template operator()<Unary::relu>(); return;
    case Unary::abs: f.template operator()<Unary::abs>(); return;
    case Unary::pow: f.template operator()<Unary::pow>(); return;
    case Unary::silu: f.template operator()<Unary::silu>(); return;
    case Unary::gelu: f.template operator()<Unary::gelu>(); return;
    case Unary::gelu_approx: f.template operator()<Unary::gelu_approx>(); return;
    case Unary::gelu_fast: f.template operator()<Unary::gelu_fast>(); return;
    case Unary::scale: f.template operator()<Unary::scale>(); return;
    case Unary::add_scalar: f.template operator()<Unary::add_scalar>(); return;
  }
}

// dispatch over every dtype a data-movement kernel handles: floats, plus integers when not
// accumulating (permuting token ids is fine; adding them is not a gradient).
template <class F>
void dispatch_any(DType t, const char* op, bool acc, F&& f) {
  switch (t) {
    case DType::f32: f.template operator()<float>(); return;
    case DType::f64: f.template operator()<double>(); return;
    default: break;
  }
  if (acc) fail(op, "cannot accumulate into ", dtype_name(t));
  switch (dtype_size(t)) {
    case 1: f.template operator()<std::uint8_t>(); return;
    case 2: f.template operator()<std::uint16_t>(); return;
    case 4: f.template operator()<std::uint32_t>(); return;
    default: f.template operator()<std::uint64_t>(); return;
  }
}

/// Reads an integer id tensor (i32 or i64) at i.
inline std::int64_t load_index(const Tensor& ids, std::int64_t i) {
  if (ids.dtype() == DType::i32) return static_cast<const std::int32_t*>(ids.raw())[i];
  return static_cast<const std::int64_t*>(ids.raw())[i];
}

/// Elementwise loops run in parallel only past this size: below it thread start-up costs more
/// than it saves.
inline constexpr std::int64_t kParallelGrain = 1 << 15;

/// f(i) for i in [0, n), split over OpenMP threads when `wide` (the caller's size test against
/// kParallelGrain) holds and more than one thread is free: in equal contiguous shares, or one
/// iteration at a time when `uneven` (iterations of different cost). The test is a C++ branch
/// taken before OpenMP is entered, not an `if` clause: libgomp builds a one-thread team (a malloc
/// and a free) even for `#pragma omp parallel if (false)`, so every small replayed op would allocate.
template <class F>
inline void parallel_for(std::int64_t n, bool wide, F&& f, bool uneven = false) {
#if defined(_OPENMP)
  if (const int threads = wide && n > 1 ? free_threads() : 1; threads > 1) {
    // (maybe_unused: nvcc's front end sees _OPENMP but not the pragma that reads it)
    [[maybe_unused]] const std::int64_t share = uneven ? 1 : (n + threads - 1) / threads;
    team(threads, [&](int, int) {
#pragma omp for schedule(dynamic, share)
      for (std::int64_t i = 0; i < n; ++i) f(i);
    });
    return;
  }
#else
  (void)wide;
  (void)uneven;
#endif
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

/// Whether b is a trailing suffix of y's shape (b repeats along y's leading dims: a bias row).
inline bool is_suffix(const Shape& b, const Shape& y) {
  if (b.rank() > y.rank()) return false;
  for (int i = 1; i <= b.rank(); ++i)
    if (b[b.rank() - i] != y[y.rank() - i]) return false;
  return true;
}

/// Strides (in elements) of `in` seen through output shape `out`: the input is aligned to the
/// right, and a dimension of size 1 (or a missing one) gets stride 0, which is broadcasting.
inline std::array<std::int64_t, kMaxRank> broadcast_strides(const Shape& in, const Shape& out) {
  std::array<std::int64_t, kMaxRank> st{};
  std::int64_t s = 1;
  const int off = out.rank() - in.rank();
  for (int i = in.rank() - 1; i >= 0; --i) {
    st[static_cast<std::size_t>(i + off)] = in[i] == 1 ? 0 : s;
    s *= in[i];
  }
  return st;
}

/// Calls f(out_index, offset_0, offset_1, ...) for every element of `out`, with the offsets of
/// each broadcast input, walking an odometer so no division is needed per element.
template <std::size_t N, class F>
void for_each_broadcast(const Shape& out, const std::array<std::array<std::int64_t, kMaxRank>, N>& strides, F&& f) {
  const int r = out.rank();
  const std::int64_t n = out.numel();
  if (n == 0) return;
  std::array<std::int64_t, kMaxRank> idx{};
  std::array<std::int64_t, N> off{};
  const std::int64_t inner = r ? out[r - 1] : 1;
  for (std::int64_t i = 0; i < n; i += inner) {
    for (std::int64_t j = 0; j < inner; ++j) {
      std::array<std::int64_t, N> o = off;
      if (r)
        for (std::size_t k = 0; k < N; ++k) o[k] += j * strides[k][static_cast<std::size_t>(r - 1)];
      std::apply([&](auto... oo) { f(i + j, oo...); }, o);
    }
    // advance the odometer over dims [0, r-1)
    for (int d = r - 2; d >= 0; --d) {
      auto du = static_cast<std::size_t>(d);
      ++idx[du];
      for (std::size_t k = 0; k < N; ++k) off[k] += strides[k][du];
      if (idx[du] < out[d]) break;
      for (std::size_t k = 0; k < N; ++k) off[k] -= strides[k][du] * out[d];
      idx[du] = 0;
    }
  }
}


/// Splits a reduction of `x` to `y` (y's dims equal x's or 1, right-aligned) into
/// (outer, reduced, inner) when the reduced dims are one contiguous block; false otherwise.
inline bool reduction_as_3d(const Shape& x, const Shape& y, std::int64_t& outer, std::int64_t& red,
                            std::int64_t& inner) {
  const int r = x.rank(), off = x.rank() - y.rank();
  int first = -1, last = -1;
  for (int i = 0; i < r; ++i) {
    std::int64_t yd = i < off ? 1 : y[i - off];
    bool reduced = yd == 1 && x[i] != 1;
    if (reduced) {
      if (first < 0) first = i;
      else if (last != i - 1) return false;
      last = i;
    }
  }
  if (first < 0) { outer = x.numel(); red = 1; inner = 1; return true; }
  outer = x.prod(0, first);
  red = x.prod(first, last + 1);
  inner = x.prod(last + 1, r);
  return true;
}

/// A contiguous run of n values as an Eigen array, for the vectorised math (exp above all) of
/// the row kernels: softmax, cross-entropy, SwiGLU.
template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

/// x = exp(x) in place, vectorised, and exact zeros where exp underflows (below -88.72 for float,
/// -709.78 for double), where std::exp gives 0 or a denormal. So an additively masked score (-1e9)
/// still contributes exactly nothing, as layers/mask.hpp promises. float runs simd::exp at the
/// CPU's width; double runs Eigen's exp, which clamps its argument there (~1e-308 past it).
template <class T>
inline void exp_inplace(T* x, std::int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    simd::exp_inplace(x, n);
  } else {
    constexpr T lo = T(-709.78);
    constexpr std::int64_t blk = 256;
    T in[blk];
    for (std::int64_t i0 = 0; i0 < n; i0 += blk) {
      const std::int64_t len = std::min(blk, n - i0);
      std::copy_n(x + i0, len, in);
      ArrayMap<T>(x + i0, len) = ConstArrayMap<T>(in, len).exp();
      for (std::int64_t j = 0; j < len; ++j) x[i0 + j] = in[j] < lo ? T(0) : x[i0 + j];
    }
  }
}

// The row steps of a softmax (cpu::softmax, flash attention's tiles and their vjp), one pass over
// the row each: float at the CPU's vector width (simd.hpp), double through Eigen.

/// x *= sc in place; returns max_j x_j (-inf for n = 0).
template <class T>
inline T scale_max(T* x, std::int64_t n, T sc) {
  if constexpr (std::is_same_v<T, float>) return simd::scale_max(x, n, sc);
  ArrayMap<T> r(x, n);
  r *= sc;
  return n > 0 ? r.maxCoeff() : -std::numeric_limits<T>::infinity();
}

/// x = exp(x - m) in place (exact zeros where exp underflows, as exp_inplace); returns sum_j x_j.
template <class T>
inline T exp_sum(T* x, std::int64_t n, T m) {
  if constexpr (std::is_same_v<T, float>) return simd::exp_sum(x, n, m);
  ArrayMap<T> r(x, n);
  r -= m;
  exp_inplace(x, n);
  return r.sum();
}

/// x = SoftmaxMath::p_from_lse(sc x, lse) in place: probabilities recomputed from raw scores.
template <class T>
inline void probs_from_lse(T* x, std::int64_t n, T sc, T lse) {
  if constexpr (std::is_same_v<T, float>) return simd::probs_from_lse(x, n, sc, lse);
  ArrayMap<T> r(x, n);
  r = r * sc - lse;
  exp_inplace(x, n);
}

/// d = SoftmaxMath::vjp(p, d, dot) sc in place: score gradients from probabilities p and
/// dot = sum_j p_j d_j.
template <class T>
inline void softmax_vjp_row(const T* p, T* d, std::int64_t n, T dot, T sc) {
  if constexpr (std::is_same_v<T, float>) return simd::softmax_vjp(p, d, n, dot, sc);
  ArrayMap<T> r(d, n);
  r = SoftmaxMath::vjp(ConstArrayMap<T>(p, n), r, dot) * sc;
}

/// row = softmax(scale * row + add) in place (add may be null): max-subtracted, a row whose
/// every entry is -inf kept finite in its max, as cpu::softmax.
template <class T>
inline void softmax_row(T* row, std::int64_t n, T scale, const T* add) {
  ArrayMap<T> r(row, n);
  T m;
  if (add) {
    r = r * scale + ConstArrayMap<T>(add, n);
    m = r.maxCoeff();
  } else {
    m = scale_max(row, n, scale);
  }
  r *= T(1) / exp_sum(row, n, SoftmaxMath::finite_max(m));
}

/// y = sqrt(x), correctly rounded (what std::sqrt gives), vectorised with the x86 sqrt
/// instructions where available. Not Eigen's .sqrt(): under EIGEN_FAST_MATH (its default) the
/// float version is rsqrt plus one Newton step, a few ulp off, and the optimizers' updates must
/// match MLX's to the bit; nor a loop over std::sqrt, which compilers keep scalar for errno.
template <class T>
inline void sqrt_exact(const T* x, T* y, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float>)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
  else
    for (; i + 4 <= n; i += 4) _mm256_storeu_pd(y + i, _mm256_sqrt_pd(_mm256_loadu_pd(x + i)));
#elif defined(__SSE2__)
  if constexpr (std::is_same_v<T, float>)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(y + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
  else
    for (; i + 2 <= n; i += 2) _mm_storeu_pd(y + i, _mm_sqrt_pd(_mm_loadu_pd(x + i)));
#endif
  for (; i < n; ++i) y[i] = std::sqrt(x[i]);
}

/// Elementwise work over n values in chunks: f(i0, i1) per chunk, the chunks in parallel once n
/// passes kParallelGrain.
inline constexpr std::int64_t kChunk = 4096;
template <class F>
inline void parallel_chunks(std::int64_t n, F&& f) {
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(chunks, n > kParallelGrain, [&](std::int64_t c) { f(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

}  // namespace detail
}  // namespace nn
