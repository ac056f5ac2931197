// SPDX-License-Identifier: MIT OR Apache-2.0
// The float32 row math of the CPU kernels (exp above all: softmax, cross-entropy, attention,
// SwiGLU) on vectors as wide as the CPU's, picked at run time from CPUID feature bits like the
// GEMM's micro-kernels (gemm.hpp): one body per row function, compiled for AVX-512, for AVX2 + FMA
// and for the compiler's baseline (SSE2 on x86-64) into every binary. The kernels ran Eigen's
// vectorised expressions before, whose width is fixed by the flags the user's own file is compiled
// with: SSE2 without -march, so a plain CMake build of the finetune ran its exps at a quarter of
// an AVX-512 machine's width (perf: Eigen's pexp_float<__m128> 6.6% and the cross-entropy vjp 8.3%
// of the decoder's LoRA step, against 2.5% for that vjp built -march=native).
//
// The formulas stay in backend/math.hpp: SwiGluMath and SoftmaxMath are templates over the value
// type, and this header makes its lane vectors one of them (v_exp takes them through
// detail::simd_exp, is_lane_vector, scalar_of). float64 keeps Eigen's expressions.
//
// Each row function gives every element the same lane arithmetic wherever it sits (a partial last
// vector is computed whole and stored in part), so results do not depend on a row's length or
// alignment; they may differ between kernel sets in the last bit (FMA contraction), as the GEMM's
// do. NN_CPU_ISA=avx2|generic runs a lower set (cpu_info.hpp).
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>

#include "cpu_info.hpp"
#include "math.hpp"

#if defined(__CUDACC__)
// Under nvcc the formulas of math.hpp are __host__ __device__, and nvcc rejects (and at times
// crashes on) GCC vector types in them even where only the host calls them. The CPU kernels a .cu
// file compiles (the CUDA tests' CPU references) run these rows one element at a time instead,
// with the same formulas; an inline namespace keeps their names apart from the lane versions that
// g++ compiles into the other files of the same program.
namespace nn::simd {
inline namespace scalar_rows {
inline void exp_inplace(float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = x[i] < -88.72f ? 0.0f : detail::m_exp(x[i]);
}
inline float max(const float* x, std::int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
inline float sum_exp(const float* x, std::int64_t n, float m) {
  float s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += detail::m_exp(x[i] - m);
  return s;
}
inline void ce_grad(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {
  for (std::int64_t i = 0; i < n; ++i) o[i] = detail::SoftmaxMath::ce_grad(x[i], lse, g) + (acc ? o[i] : 0.0f);
}
inline void swiglu(const float* a, const float* u, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = detail::SwiGluMath::y(a[i], u[i]);
}
inline void swiglu_vjp(const float* a, const float* u, const float* g, float* da, bool acc_a, float* du, bool acc_u,
                       std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float s = detail::SwiGluMath::sig(a[i]);
    if (da) da[i] = detail::SwiGluMath::dgate(a[i], u[i], g[i], s) + (acc_a ? da[i] : 0.0f);
    if (du) du[i] = detail::SwiGluMath::dup(a[i], g[i], s) + (acc_u ? du[i] : 0.0f);
  }
}
inline float scale_max(float* x, std::int64_t n, float sc) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) m = (x[i] *= sc) > m ? x[i] : m;
  return m;
}
inline float exp_sum(float* x, std::int64_t n, float m) {
  float s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += (x[i] = x[i] - m < -88.72f ? 0.0f : detail::m_exp(x[i] - m));
  return s;
}
inline void probs_from_lse(float* x, std::int64_t n, float sc, float lse) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = detail::SoftmaxMath::p_from_lse(x[i] * sc, lse);
}
inline void softmax_vjp(const float* p, float* d, std::int64_t n, float dot, float sc) {
  for (std::int64_t i = 0; i < n; ++i) d[i] = detail::SoftmaxMath::vjp(p[i], d[i], dot) * sc;
}
inline void adam(float* p, const float* g, float* m, float* v, std::int64_t n, const detail::AdamMath<float>& f) {
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = f.m(m[i], g[i]);
    v[i] = f.v(v[i], g[i]);
    p[i] = (f.decoupled ? p[i] * f.decay : p[i]) - f.delta(m[i], std::sqrt(v[i]));
  }
}
}  // namespace scalar_rows
}  // namespace nn::simd
#else

// -Wpsabi: every function here that takes or returns a lane vector is inlined into a kernel
// compiled for that vector's instruction set (as in math.hpp), so no call changes its ABI. GCC
// reports the note where the translation unit ends, past any pop, so it stays off from here on.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace nn {

namespace simd {

/// W float32 lanes (W = 4, 8, 16: SSE2, AVX2, AVX-512) and their int32 counterparts. (Spelled
/// out per W: GCC drops a vector_size attribute whose size depends on a template parameter.)
template <int W>
struct lane_types;
#define NN_SIMD_LANE_TYPES(W)                                                             \
  template <>                                                                             \
  struct lane_types<W> {                                                                  \
    typedef float f __attribute__((vector_size(W * sizeof(float))));                      \
    typedef std::int32_t i __attribute__((vector_size(W * sizeof(float))));               \
  };
NN_SIMD_LANE_TYPES(4)
NN_SIMD_LANE_TYPES(8)
NN_SIMD_LANE_TYPES(16)
#undef NN_SIMD_LANE_TYPES
template <int W>
using Vf = typename lane_types<W>::f;
template <int W>
using Vi = typename lane_types<W>::i;

template <class V>
inline constexpr int lanes = static_cast<int>(sizeof(V) / sizeof(float));

// x86 with GCC: AVX-512's and AVX's own max / min and AVX-512's scalef, spelled as GCC's builtins
// (an intrinsic is a function compiled for its own ISA, which GCC will not inline into exp, a
// template compiled for none; a builtin is expanded where exp lands, inside a kernel of that ISA).
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define NN_SIMD_X86_BUILTINS 1
#endif

/// min(hi, max(lo, x)) lane by lane, a NaN lane of x kept (x86's max / min return their second
/// operand where either is NaN, as `lo > x ? lo : x` does): one instruction a bound on AVX2 and
/// AVX-512 where GCC spells the conditional as a compare and a blend.
template <class V>
[[gnu::always_inline]] inline V clamp(V x, float lo, float hi) {
#if defined(NN_SIMD_X86_BUILTINS)
  if constexpr (lanes<V> == 16)
    return __builtin_ia32_minps512_mask(V{} + hi, __builtin_ia32_maxps512_mask(V{} + lo, x, V{}, 0xffff, 4), V{},
                                        0xffff, 4);
  else if constexpr (lanes<V> == 8)
    return __builtin_ia32_minps256(V{} + hi, __builtin_ia32_maxps256(V{} + lo, x));
#endif
  const V xl = (V{} + lo) > x ? (V{} + lo) : x;
  return (V{} + hi) < xl ? (V{} + hi) : xl;
}

/// sqrt of each lane, correctly rounded (IEEE's sqrt, as CUDA's: the optimizers' square roots).
template <class V>
[[gnu::always_inline]] inline V sqrt(V x) {
#if defined(NN_SIMD_X86_BUILTINS)
  if constexpr (lanes<V> == 16) return __builtin_ia32_sqrtps512_mask(x, V{}, 0xffff, 4);
  else if constexpr (lanes<V> == 8) return __builtin_ia32_sqrtps256(x);
  else return __builtin_ia32_sqrtps(x);
#else
  for (int l = 0; l < lanes<V>; ++l) x[l] = std::sqrt(x[l]);
  return x;
#endif
}

/// exp of each lane: Cephes' expf. n = round(x log2(e)), r = x - n ln 2 (ln 2 in two parts,
/// exact products), e^r by a degree-5 polynomial on |r| <= ln(2)/2, times 2^n built in the exponent
/// field in two halves (2^(n/2) 2^(n - n/2): no half is denormal or overflows). About 1 ulp, as
/// Eigen's and glibc's. x < -88.72 gives exactly 0 (where exp is 0 or a denormal: an additively
/// masked score, -1e9, contributes nothing, as layers/mask.hpp promises), x > 88.72 gives +inf,
/// NaN stays NaN.
///
/// AVX-512 multiplies by 2^n with one vscalefps (y 2^n rounded once, which is what the two
/// halves give: the first product is exact, the second rounds) in place of nine integer and float
/// instructions: the same bits for every float (a sweep of every 7th bit pattern, NaNs, infinities
/// and denormals included, found none apart), 16.3 -> 10.9 cycles a vector in a row's sum of
/// exps (Xeon family 6 model 167). tests/backend/simd.test.cpp holds the kernel sets to each other.
template <class V>
[[gnu::always_inline]] inline V exp(V x) {
  using I = Vi<lanes<V>>;
  constexpr float kLo = -88.72f, kHi = 88.72f;
  // clamped, one bound at a time; NaN lanes stay NaN
  const V xc = clamp(x, kLo, kHi);
  // n = x log2(e) rounded to the nearest integer: adding 1.5 * 2^23 leaves n in the low bits of
  // the mantissa (|n| <= 128), and subtracting it again gives n as a float
  constexpr float kRound = 12582912.0f;
  const V t = xc * 1.44269504088896341f + kRound, fn = t - kRound;
  const V r = (xc - fn * 0.693359375f) - fn * -2.12194440e-4f;
  const V r2 = r * r;
  V y = (V{} + 1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
#if defined(NN_SIMD_X86_BUILTINS)
  if constexpr (lanes<V> == 16) {
    y = __builtin_ia32_scalefps512_mask(y, fn, V{}, 0xffff, 4);  // y 2^fn (fn is integral)
  } else
#endif
  {
    I n;
    std::memcpy(&n, &t, sizeof(V));
    n -= 0x4B400000;  // kRound's bits
    const I n1 = n >> 1, n2 = n - n1;
    const I b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    V p1, p2;
    std::memcpy(&p1, &b1, sizeof(V));
    std::memcpy(&p2, &b2, sizeof(V));
    y = (y * p1) * p2;
  }
  y = x < kLo ? V{} : y;
  return x > kHi ? (V{} + std::numeric_limits<float>::infinity()) : y;
}

/// Lanes [0, n) of V from p, the rest 0 (a row's partial last vector).
template <class V>
[[gnu::always_inline]] inline V load_part(const float* p, std::int64_t n) {
  V v{};
  std::memcpy(&v, p, sizeof(float) * static_cast<std::size_t>(n));
  return v;
}
template <class V>
[[gnu::always_inline]] inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V>
[[gnu::always_inline]] inline void store(float* p, V v, std::int64_t n = lanes<V>) {
  std::memcpy(p, &v, sizeof(float) * static_cast<std::size_t>(n));
}

/// f(i, m) for each vector of a row of n, m the number of its lanes in the row (W but for the last).
template <class V, class F>
[[gnu::always_inline]] inline void for_vectors(std::int64_t n, F&& f) {
  constexpr int W = lanes<V>;
  std::int64_t i = 0;
  for (; i + W <= n; i += W) f(i, std::int64_t{W});
  if (i < n) f(i, n - i);
}

/// Lanes summed in a fixed order (lane 0 first).
template <class V>
[[gnu::always_inline]] inline float hsum(V v) {
  float s = 0;
  for (int l = 0; l < lanes<V>; ++l) s += v[l];
  return s;
}

// ---- the row functions: one body each, over V ------------------------------------------------

template <class V>
[[gnu::always_inline]] inline void exp_inplace_body(float* x, std::int64_t n) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    store(x + i, exp(m == lanes<V> ? load<V>(x + i) : load_part<V>(x + i, m)), m);
  });
}

/// max_j sc x_j (-inf for n = 0; NaN lanes lose to numbers, as Eigen's maxCoeff), storing each
/// sc x_j to y unless y is null (an attention tile's scores scaled in place; sc = 1 is exact).
template <class V>
[[gnu::always_inline]] inline float max_body(const float* x, std::int64_t n, float sc, float* y) {
  V mv = (V{} + -std::numeric_limits<float>::infinity());
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    V v = (m == lanes<V> ? load<V>(x + i) : load_part<V>(x + i, m)) * sc;
    if (y) store(y + i, v, m);
    if (m < lanes<V>)
      for (int l = static_cast<int>(m); l < lanes<V>; ++l) v[l] = -std::numeric_limits<float>::infinity();
    mv = v > mv ? v : mv;
  });
  float r = mv[0];
  for (int l = 1; l < lanes<V>; ++l) r = mv[l] > r ? mv[l] : r;
  return r;
}

/// sum_j exp(x_j - m), two vectors of partial sums, storing each exp(x_j - m) to y unless y is
/// null (an online softmax's tile of probabilities, not yet normalised).
template <class V>
[[gnu::always_inline]] inline float sum_exp_body(const float* x, std::int64_t n, float m, float* y) {
  constexpr int W = lanes<V>;
  V s0{}, s1{};
  std::int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const V e0 = exp(load<V>(x + i) - m), e1 = exp(load<V>(x + i + W) - m);
    if (y) {
      store(y + i, e0);
      store(y + i + W, e1);
    }
    s0 += e0;
    s1 += e1;
  }
  for (; i < n; i += W) {
    const std::int64_t k = std::min<std::int64_t>(W, n - i);
    V e = exp((k == W ? load<V>(x + i) : load_part<V>(x + i, k)) - m);
    if (y) store(y + i, e, k);
    for (std::int64_t l = k; l < W; ++l) e[l] = 0;
    s0 += e;
  }
  return hsum<V>(s0 + s1);
}

/// o (+)= SoftmaxMath::ce_grad(x, lse, g) = g exp(x - lse).
template <class V>
[[gnu::always_inline]] inline void ce_grad_body(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    V v = detail::SoftmaxMath::ce_grad(full ? load<V>(x + i) : load_part<V>(x + i, m), lse, g);
    if (acc) v += full ? load<V>(o + i) : load_part<V>(o + i, m);
    store(o + i, v, m);
  });
}

/// x = SoftmaxMath::p_from_lse(sc x, lse) = exp(sc x - lse) in place: a tile's probabilities
/// recomputed from its raw scores and the forward's log-sum-exp.
template <class V>
[[gnu::always_inline]] inline void probs_from_lse_body(float* x, std::int64_t n, float sc, float lse) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const V v = m == lanes<V> ? load<V>(x + i) : load_part<V>(x + i, m);
    store(x + i, detail::SoftmaxMath::p_from_lse(v * sc, lse), m);
  });
}

/// d = SoftmaxMath::vjp(p, d, dot) sc = p (d - dot) sc in place: a tile's score gradients.
template <class V>
[[gnu::always_inline]] inline void softmax_vjp_body(const float* p, float* d, std::int64_t n, float dot, float sc) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    const V pv = full ? load<V>(p + i) : load_part<V>(p + i, m), dv = full ? load<V>(d + i) : load_part<V>(d + i, m);
    store(d + i, detail::SoftmaxMath::vjp(pv, dv, dot) * sc, m);
  });
}

/// y = SwiGluMath::y(a, u).
template <class V>
[[gnu::always_inline]] inline void swiglu_body(const float* a, const float* u, float* y, std::int64_t n) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    const V av = full ? load<V>(a + i) : load_part<V>(a + i, m), uv = full ? load<V>(u + i) : load_part<V>(u + i, m);
    store(y + i, detail::SwiGluMath::y(av, uv), m);
  });
}

/// da (+)= SwiGluMath::dgate, du (+)= SwiGluMath::dup (either may be null).
template <class V>
[[gnu::always_inline]] inline void swiglu_vjp_body(const float* a, const float* u, const float* g, float* da,
                                                   bool acc_a, float* du, bool acc_u, std::int64_t n) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    const auto in = [&](const float* p) __attribute__((always_inline)) { return full ? load<V>(p + i) : load_part<V>(p + i, m); };
    const V av = in(a), uv = in(u), gv = in(g), s = detail::SwiGluMath::sig(av);
    if (da) store(da + i, detail::SwiGluMath::dgate(av, uv, gv, s) + (acc_a ? in(da) : V{}), m);
    if (du) store(du + i, detail::SwiGluMath::dup(av, gv, s) + (acc_u ? in(du) : V{}), m);
  });
}

/// One Adam / AdamW step over a run of parameters (AdamMath: m, v, then p, decayed when decoupled,
/// less delta(m, sqrt v)), in one pass: each value is read and written once. Its entry points are
/// compiled without FMA contraction: every product and sum rounds on its own, as MLX's and
/// PyTorch's updates do, so float32 trajectories stay bit for bit MLX's
/// (tests/optim/mlx_trajectory.test.cpp) at every kernel set. (As Eigen passes over
/// 4096-value chunks -- m, v, sqrt, decay, delta -- the five arrays' chunks did not fit in L1 and
/// the update took 12.5 ms for the decoder's 7M parameters against 8.8 ms in one pass, Xeon
/// family 6 model 167; and it ran at the build's width, SSE2 in a plain build.)
template <class V>
[[gnu::always_inline]] inline void adam_body(float* p, const float* g, float* m, float* v, std::int64_t n,
                                             const detail::AdamMath<float>& f) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t k) __attribute__((always_inline)) {
    const bool full = k == lanes<V>;
    const auto in = [&](const float* q) __attribute__((always_inline)) { return full ? load<V>(q + i) : load_part<V>(q + i, k); };
    const V gv = in(g), mv = f.m(in(m), gv), vv = f.v(in(v), gv), pv = in(p);
    store(m + i, mv, k);
    store(v + i, vv, k);
    store(p + i, (f.decoupled ? pv * f.decay : pv) - f.delta(mv, simd::sqrt(vv)), k);
  });
}

// ---- one entry point per kernel set, and the dispatch ----------------------------------------

// Each set's functions call the bodies above with its own vector width; the bodies are inlined
// into them and so compiled for that set's instructions.
#define NN_SIMD_ENTRIES(SUFFIX, W, ATTR)                                                                       \
  ATTR inline void exp_inplace_##SUFFIX(float* x, std::int64_t n) { exp_inplace_body<Vf<W>>(x, n); }            \
  ATTR inline float max_##SUFFIX(const float* x, std::int64_t n) {                                            \
    return max_body<Vf<W>>(x, n, 1.0f, nullptr);                                                               \
  }                                                                                                            \
  ATTR inline float sum_exp_##SUFFIX(const float* x, std::int64_t n, float m) {                                \
    return sum_exp_body<Vf<W>>(x, n, m, nullptr);                                                              \
  }                                                                                                            \
  ATTR inline void ce_grad_##SUFFIX(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {   \
    ce_grad_body<Vf<W>>(x, n, lse, g, o, acc);                                                                 \
  }                                                                                                            \
  ATTR inline float scale_max_##SUFFIX(float* x, std::int64_t n, float sc) {                                  \
    return max_body<Vf<W>>(x, n, sc, x);                                                                       \
  }                                                                                                            \
  ATTR inline float exp_sum_##SUFFIX(float* x, std::int64_t n, float m) {                                      \
    return sum_exp_body<Vf<W>>(x, n, m, x);                                                                    \
  }                                                                                                            \
  ATTR inline void probs_from_lse_##SUFFIX(float* x, std::int64_t n, float sc, float lse) {                    \
    probs_from_lse_body<Vf<W>>(x, n, sc, lse);                                                                 \
  }                                                                                                            \
  ATTR inline void softmax_vjp_##SUFFIX(const float* p, float* d, std::int64_t n, float dot, float sc) {       \
    softmax_vjp_body<Vf<W>>(p, d, n, dot, sc);                                                                 \
  }                                                                                                            \
  ATTR inline void swiglu_##SUFFIX(const float* a, const float* u, float* y, std::int64_t n) {                 \
    swiglu_body<Vf<W>>(a, u, y, n);                                                                            \
  }                                                                                                            \
  ATTR inline void swiglu_vjp_##SUFFIX(const float* a, const float* u, const float* g, float* da, bool acc_a,   \
                                       float* du, bool acc_u, std::int64_t n) {                                \
    swiglu_vjp_body<Vf<W>>(a, u, g, da, acc_a, du, acc_u, n);                                                  \
  }                                                                                                            \
  ATTR [[gnu::optimize("fp-contract=off")]] inline void adam_##SUFFIX(                                         \
      float* p, const float* g, float* m, float* v, std::int64_t n, const detail::AdamMath<float>& f) {       \
    adam_body<Vf<W>>(p, g, m, v, n, f);                                                                        \
  }

NN_SIMD_ENTRIES(generic, 4, )
#if defined(__x86_64__) || defined(__i386__)
NN_SIMD_ENTRIES(avx2, 8, [[gnu::target("avx2,fma")]])
NN_SIMD_ENTRIES(avx512, 16, [[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]])
#define NN_SIMD_DISPATCH(name, ...)                                         \
  switch (detail::active_isa()) {                                           \
    case Isa::avx512: return name##_avx512(__VA_ARGS__);                    \
    case Isa::avx2: return name##_avx2(__VA_ARGS__);                        \
    case Isa::generic: break;                                               \
  }                                                                         \
  return name##_generic(__VA_ARGS__);
#else
#define NN_SIMD_DISPATCH(name, ...) return name##_generic(__VA_ARGS__);
#endif
#undef NN_SIMD_ENTRIES

/// x = exp(x) in place (exp above: exact 0 below -88.72).
inline void exp_inplace(float* x, std::int64_t n) { NN_SIMD_DISPATCH(exp_inplace, x, n) }
/// max_j x_j (-inf for an empty row).
inline float max(const float* x, std::int64_t n) { NN_SIMD_DISPATCH(max, x, n) }
/// sum_j exp(x_j - m).
inline float sum_exp(const float* x, std::int64_t n, float m) { NN_SIMD_DISPATCH(sum_exp, x, n, m) }
/// o (+)= g exp(x - lse): cross-entropy's row gradient (SoftmaxMath::ce_grad), before the target's -g.
inline void ce_grad(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {
  NN_SIMD_DISPATCH(ce_grad, x, n, lse, g, o, acc)
}
/// x *= sc in place; returns the row's max (-inf for an empty row).
inline float scale_max(float* x, std::int64_t n, float sc) { NN_SIMD_DISPATCH(scale_max, x, n, sc) }
/// x = exp(x - m) in place (exact 0 below -88.72, as exp_inplace); returns sum_j x_j.
inline float exp_sum(float* x, std::int64_t n, float m) { NN_SIMD_DISPATCH(exp_sum, x, n, m) }
/// x = exp(sc x - lse) in place (SoftmaxMath::p_from_lse of the scaled scores).
inline void probs_from_lse(float* x, std::int64_t n, float sc, float lse) {
  NN_SIMD_DISPATCH(probs_from_lse, x, n, sc, lse)
}
/// d = p (d - dot) sc in place (SoftmaxMath::vjp, scaled).
inline void softmax_vjp(const float* p, float* d, std::int64_t n, float dot, float sc) {
  NN_SIMD_DISPATCH(softmax_vjp, p, d, n, dot, sc)
}
/// y = silu(a) u (SwiGluMath::y).
inline void swiglu(const float* a, const float* u, float* y, std::int64_t n) { NN_SIMD_DISPATCH(swiglu, a, u, y, n) }
/// da (+)= SwiGluMath::dgate, du (+)= SwiGluMath::dup; a null output is skipped.
inline void swiglu_vjp(const float* a, const float* u, const float* g, float* da, bool acc_a, float* du, bool acc_u,
                       std::int64_t n) {
  NN_SIMD_DISPATCH(swiglu_vjp, a, u, g, da, acc_a, du, acc_u, n)
}
/// One Adam / AdamW step over n parameters (adam_body).
inline void adam(float* p, const float* g, float* m, float* v, std::int64_t n, const detail::AdamMath<float>& f) {
  NN_SIMD_DISPATCH(adam, p, g, m, v, n, f)
}
#undef NN_SIMD_DISPATCH

}  // namespace simd

namespace detail {
// backend/math.hpp's formulas on lane vectors: v_exp takes them to simd::exp, and their scalar is
// float.
#define NN_SIMD_LANE_VECTOR(W)                               \
  template <>                                                 \
  struct is_lane_vector<simd::Vf<W>> : std::true_type {};     \
  template <>                                                 \
  struct scalar_of<simd::Vf<W>, void> {                       \
    using type = float;                                       \
  };
NN_SIMD_LANE_VECTOR(4)
NN_SIMD_LANE_VECTOR(8)
NN_SIMD_LANE_VECTOR(16)
#undef NN_SIMD_LANE_VECTOR
template <class V>
[[gnu::always_inline]] inline V simd_exp(V x) {
  return simd::exp(x);
}
}  // namespace detail

}  // namespace nn
#endif  // __CUDACC__
