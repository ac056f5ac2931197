// SPDX-License-Identifier: MIT OR Apache-2.0
// The math of every elementwise primitive, forward and derivative side by side, and the
// per-element math of the fused primitives and the optimizer updates, compiled for the host and
// (under nvcc) for the device, so nn::cpu and nn::cuda run the same formulas: a kernel in
// backend/cpu/ or backend/cuda/ loops, reduces and dispatches, and takes its arithmetic from here.
#pragma once

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numbers>
#include <type_traits>

#include "policy.hpp"

// GCC's -Wpsabi notes, for the formulas below taken on backend/simd.hpp's 32- and 64-byte lane
// vectors, that passing those by value changes the call's ABI without AVX: they are always inlined
// into the kernel compiled for the vectors' instruction set, so no such call exists.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace nn::detail {

// The libm functions both backends call: glibc's on the host (what std::exp(float) etc. resolve
// to), CUDA's device versions under nvcc (never the fast intrinsics).
// clang-format off
NN_HD inline float m_exp(float x) { return ::expf(x); }
NN_HD inline double m_exp(double x) { return ::exp(x); }
NN_HD inline float m_log(float x) { return ::logf(x); }
NN_HD inline double m_log(double x) { return ::log(x); }
NN_HD inline float m_sqrt(float x) { return ::sqrtf(x); }
NN_HD inline double m_sqrt(double x) { return ::sqrt(x); }
NN_HD inline float m_tanh(float x) { return ::tanhf(x); }
NN_HD inline double m_tanh(double x) { return ::tanh(x); }
NN_HD inline float m_erf(float x) { return ::erff(x); }
NN_HD inline double m_erf(double x) { return ::erf(x); }
NN_HD inline float m_pow(float x, float a) { return ::powf(x, a); }
NN_HD inline double m_pow(double x, double a) { return ::pow(x, a); }
NN_HD inline float m_abs(float x) { return ::fabsf(x); }
NN_HD inline double m_abs(double x) { return ::fabs(x); }
// clang-format on

// The scalar type of V: V itself, or an Eigen array expression's Scalar. The functions below that
// take a V run on scalars (every backend) and on Eigen arrays (the CPU's vectorised chunks).
template <class V, class = void>
struct scalar_of {
  using type = V;
};
template <class V>
struct scalar_of<V, std::void_t<typename V::Scalar>> {
  using type = typename V::Scalar;
};
template <class V>
using scalar_of_t = typename scalar_of<V>::type;

/// Whether V is a vector of float lanes of backend/simd.hpp (the CPU's per-ISA row kernels run
/// these formulas on them), and its exp (simd::exp; host only, defined there).
template <class V>
struct is_lane_vector : std::false_type {};
template <class V>
NN_LANES_INLINE V simd_exp(V x);

/// exp of a scalar (m_exp), of lane vectors (simd_exp) or of an Eigen array (its vectorised .exp()).
NN_HD_GENERIC template <class V>
NN_LANES_INLINE NN_HD inline auto v_exp(const V& x) {
  if constexpr (std::is_floating_point_v<V>) return m_exp(x);
  else if constexpr (is_lane_vector<V>::value) return simd_exp(x);
  else return x.exp();
}

/// 1 / (1 + exp(-x)), of a scalar or an Eigen array.
NN_HD_GENERIC template <class V>
NN_LANES_INLINE NN_HD inline auto sigmoid(const V& x) {
  using T = scalar_of_t<V>;
  return T(1) / (T(1) + v_exp(-x));
}

/// The forward math of every unary op.
template <class T>
NN_HD inline T unary_f(Unary op, T x, T a) {
  constexpr T kSqrt2OverPi = T(0.7978845608028654);  // sqrt(2/pi)
  switch (op) {
    case Unary::neg: return -x;
    case Unary::exp: return m_exp(x);
    case Unary::log: return m_log(x);
    case Unary::sqrt: return m_sqrt(x);
    case Unary::rsqrt: return T(1) / m_sqrt(x);
    case Unary::tanh: return m_tanh(x);
    case Unary::sigmoid: return sigmoid(x);
    case Unary::relu: return x > T(0) ? x : T(0);
    case Unary::abs: return m_abs(x);
    case Unary::pow: return m_pow(x, a);
    case Unary::silu: return x * sigmoid(x);
    case Unary::gelu: return T(0.5) * x * (T(1) + m_erf(x / std::numbers::sqrt2_v<T>));
    case Unary::gelu_approx: return T(0.5) * x * (T(1) + m_tanh(kSqrt2OverPi * (x + T(0.044715) * x * x * x)));
    case Unary::gelu_fast: return x * sigmoid(T(1.702) * x);
    case Unary::scale: return a * x;
    case Unary::add_scalar: return x + a;
  }
  return x;
}

/// d f(x) / dx for every unary op, given x and y = f(x). Kinks: relu'(0) = 0 (as PyTorch and
/// tinygrad's where(x > 0)), abs'(0) = 0 (sign(0), as PyTorch).
template <class T>
NN_HD inline T unary_df(Unary op, T x, T y, T a) {
  constexpr T kSqrt2OverPi = T(0.7978845608028654);
  switch (op) {
    case Unary::neg: return T(-1);
    case Unary::exp: return y;
    case Unary::log: return T(1) / x;
    case Unary::sqrt: return T(0.5) / y;
    case Unary::rsqrt: return T(-0.5) * y / x;
    case Unary::tanh: return T(1) - y * y;
    case Unary::sigmoid: return y * (T(1) - y);
    case Unary::relu: return x > T(0) ? T(1) : T(0);
    case Unary::abs: return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));
    case Unary::pow: return a == T(0) ? T(0) : a * m_pow(x, a - T(1));
    case Unary::silu: {
      T s = sigmoid(x);
      return s * (T(1) + x * (T(1) - s));
    }
    case Unary::gelu: {
      T cdf = T(0.5) * (T(1) + m_erf(x / std::numbers::sqrt2_v<T>));
      T pdf = m_exp(T(-0.5) * x * x) / m_sqrt(T(2) * std::numbers::pi_v<T>);
      return cdf + x * pdf;
    }
    case Unary::gelu_approx: {
      T u = kSqrt2OverPi * (x + T(0.044715) * x * x * x);
      T t = m_tanh(u);
      T du = kSqrt2OverPi * (T(1) + T(3) * T(0.044715) * x * x);
      return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * du;
    }
    case Unary::gelu_fast: {
      T s = sigmoid(T(1.702) * x);
      return s + x * T(1.702) * s * (T(1) - s);
    }
    case Unary::scale: return a;
    case Unary::add_scalar: return T(1);
  }
  return T(0);
}

/// Which operands unary_df reads: bit 0 x, bit 1 y. A value no vjp reads may share its memory
/// once its forward consumers ran (GTape::plan_memory); keep this beside unary_df's cases.
constexpr unsigned unary_df_reads(Unary op) {
  switch (op) {
    case Unary::neg: case Unary::scale: case Unary::add_scalar: return 0;
    case Unary::exp: case Unary::sqrt: case Unary::tanh: case Unary::sigmoid: return 2;
    case Unary::rsqrt: return 3;
    default: return 1;  // log relu abs pow silu gelu gelu_approx gelu_fast
  }
}

template <class T>
NN_HD inline T binary_f(Binary op, T a, T b) {
  switch (op) {
    case Binary::add: return a + b;
    case Binary::sub: return a - b;
    case Binary::mul: return a * b;
    case Binary::div: return a / b;
    case Binary::maximum: return a >= b ? a : b;
    case Binary::minimum: return a <= b ? a : b;
  }
  return a;
}

/// d(a op b)/d(a) (which = 0) or d/d(b) (which = 1). Ties of maximum/minimum send the gradient
/// to a (documented in ops/elementwise.hpp).
template <class T>
NN_HD inline T binary_df(Binary op, int which, T a, T b) {
  switch (op) {
    case Binary::add: return T(1);
    case Binary::sub: return which == 0 ? T(1) : T(-1);
    case Binary::mul: return which == 0 ? b : a;
    case Binary::div: return which == 0 ? T(1) / b : -a / (b * b);
    case Binary::maximum: return (a >= b) == (which == 0) ? T(1) : T(0);
    case Binary::minimum: return (a <= b) == (which == 0) ? T(1) : T(0);
  }
  return T(0);
}

/// Which operands binary_df(op, which, a, b) reads: bit 0 a, bit 1 b (see unary_df_reads).
constexpr unsigned binary_df_reads(Binary op, int which) {
  switch (op) {
    case Binary::add: case Binary::sub: return 0;
    case Binary::mul: return which == 0 ? 2 : 1;
    case Binary::div: return which == 0 ? 2 : 3;
    default: return 3;  // maximum, minimum compare a and b
  }
}

template <class T>
NN_HD inline void put(T* y, std::int64_t i, T v, bool acc) {
  if (acc) y[i] += v;
  else y[i] = v;
}

// ---- fused primitives and optimizer updates: the per-element math ----------------------------
// Generic over the value V (see scalar_of): a scalar (a CUDA thread's element, a CPU scalar
// loop) or an Eigen array expression (the CPU's vectorised chunks), so the CPU keeps its vector
// code and both backends still read one formula. Eigen's vectorised exp is not glibc's:
// the formula is shared, the last bits of exp are each backend's (tests compare with tolerance).

/// SwiGLU: y = silu(a) u = (a s) u, s = sigmoid(a); da = (g u) (s (1 + a (1 - s))), du = g (a s).
struct SwiGluMath {
  NN_HD_GENERIC template <class V>
  NN_LANES_INLINE NN_HD static auto sig(const V& a) {
    return sigmoid(a);
  }
  NN_HD_GENERIC template <class V, class U>
  NN_LANES_INLINE NN_HD static auto y(const V& a, const U& u) {
    return (a * sig(a)) * u;
  }
  NN_HD_GENERIC template <class V, class U, class G, class S>
  NN_LANES_INLINE NN_HD static auto dgate(const V& a, const U& u, const G& g, const S& s) {
    using T = scalar_of_t<V>;
    return (g * u) * (s * (T(1) + a * (T(1) - s)));
  }
  NN_HD_GENERIC template <class V, class G, class S>
  NN_LANES_INLINE NN_HD static auto dup(const V& a, const G& g, const S& s) {
    return g * (a * s);
  }
};

/// Softmax along a row, shifted by the row's maximum m so logits in the thousands neither
/// overflow nor lose bits. Softmax, log-softmax, cross-entropy and attention (dense and flash)
/// all run these steps around their row reductions (the CPU's Eigen chunks, CUDA's block
/// reductions), so each formula is written here once:
///   p = exp(x - m) / s, s = sum_j exp(x_j - m)     lse = m + log s;  p = exp(x - lse)
///   log p = (x - m) - log s   (not x - (m + log s): m + log s rounds to m's ulp, an absolute
///                              error of 1e-4 for float32 logits in the thousands)
///   softmax vjp:     gx = p (g - sum_j g_j p_j)
///   log-softmax vjp: gx = g - exp(y) sum_j g_j
///   cross-entropy:   loss = lse - x_t;  gx = g exp(x - lse), then - g at the target
///   online (flash):  partial sums over earlier tiles are re-based by exp(m_old - m_new)
struct SoftmaxMath {
  /// The shift of a row whose entries are all -inf (fully masked): 0, so the row stays finite.
  template <class T>
  NN_HD static T finite_max(T m) {
    return m == -std::numeric_limits<T>::infinity() ? T(0) : m;
  }
  template <class T>
  NN_HD static T lse(T m, T s) {
    return m + m_log(s);
  }
  NN_HD_GENERIC template <class V, class T>
  NN_HD static auto log_p(const V& x, T m, T log_s) {
    return (x - m) - log_s;
  }
  NN_HD_GENERIC template <class V, class T>
  NN_LANES_INLINE NN_HD static auto p_from_lse(const V& x, T lse) {
    return v_exp(x - lse);
  }
  template <class T>
  NN_HD static T rebase(T m_old, T m_new) {
    return m_exp(m_old - m_new);
  }
  NN_HD_GENERIC template <class P, class G, class T>
  NN_HD static auto vjp(const P& p, const G& g, T dot) {
    return p * (g - dot);
  }
  NN_HD_GENERIC template <class G, class Y, class T>
  NN_HD static auto log_vjp(const G& g, const Y& y, T gsum) {
    return g - v_exp(y) * gsum;
  }
  template <class T>
  NN_HD static T ce_loss(T lse, T x_target) {
    return lse - x_target;
  }
  NN_HD_GENERIC template <class V, class T>
  NN_LANES_INLINE NN_HD static auto ce_grad(const V& x, T lse, T g) {
    return g * p_from_lse(x, lse);
  }
};

/// A soft cap on scores (Gemma 2's attn_logit_softcapping; its final logits use the composite
/// nn::softcap): y = cap tanh(x / cap) keeps |y| < cap, dy/dx = 1 - (y / cap)^2. Flash
/// attention caps each tile's scaled scores with it and its vjp multiplies the score gradients by
/// the derivative, recomputed from y.
struct SoftcapMath {
  template <class T>
  NN_HD static T value(T x, T cap) {
    return cap * m_tanh(x / cap);
  }
  template <class T>
  NN_HD static T grad(T y, T cap) {
    const T t = y / cap;
    return T(1) - t * t;
  }
};

/// RMSNorm per row of C values: rstd = 1 / sqrt(inv_c sum(x^2) + eps), y = (x rstd) w; with
/// u = g w (or g), gx = rstd u - c x where c = rstd^3 inv_c sum(u x).
struct RmsNormMath {
  template <class T>
  NN_HD static T rstd(T sum_sq, T inv_c, T eps) {
    return T(1) / m_sqrt(inv_c * sum_sq + eps);
  }
  template <class T>
  NN_HD static T vjp_coef(T rstd, T inv_c, T sum_ux) {
    return rstd * rstd * rstd * inv_c * sum_ux;
  }
  NN_HD_GENERIC template <class T, class U, class X>
  NN_HD static auto gx(T rstd, const U& u, T c, const X& x) {
    return rstd * u - c * x;
  }
};

/// RoPE's rotation of a feature pair (a1, a2) by an angle with cosine c and sine s (the inverse,
/// the vjp, passes -s): (a1 c - a2 s, a1 s + a2 c).
struct RopeMath {
  template <class T>
  NN_HD static T first(T a1, T a2, T c, T s) {
    return a1 * c - a2 * s;
  }
  template <class T>
  NN_HD static T second(T a1, T a2, T c, T s) {
    return a1 * s + a2 * c;
  }
};

// The optimizer updates (MLX's arithmetic order). make() forms the scalars on the host, in the
// parameter's dtype T, as MLX does: 1 - b in double and then rounded (in float32, T(1) - T(0.999)
// is 1.3e-5 away from T(0.001)); the learning rate rounded to T first (MLX's
// learning_rate.astype(gradient.dtype)).

/// SGD: g += wd p; no momentum: p -= lr g; else v = mu v + (1 - tau) g (tau = 0: + g),
/// update = nesterov ? g + mu v : v; p -= lr update.
template <class T>
struct SgdMath {
  T l, mu, d, w;
  bool has_wd, damp, nesterov;
  static SgdMath make(double lr, double momentum, double dampening, double wd, bool nesterov) {
    return {static_cast<T>(lr), static_cast<T>(momentum), static_cast<T>(1 - dampening), static_cast<T>(wd), wd != 0,
            dampening > 0, nesterov};
  }
  /// One element; v is null without momentum.
  NN_HD void operator()(T& p, T g, T* v) const {
    const T gi = has_wd ? g + w * p : g;
    if (!v) {
      p = p - l * gi;
      return;
    }
    T vi = mu * *v;
    vi += damp ? d * gi : gi;
    *v = vi;
    p = p - l * (nesterov ? gi + mu * vi : vi);
  }
};

/// Adam / AdamW: decoupled wd first p *= 1 - lr wd (AdamW); m = b1 m + (1-b1) g;
/// v = b2 v + (1-b2) g^2; p -= c1 m / (sqrt(v) c2 + eps) with c1 = lr / (1 - b1^t),
/// c2 = 1 / sqrt(1 - b2^t) under bias correction, else c1 = lr, c2 = 1 (the same bits as
/// lr m / (sqrt v + eps): x 1 is exact). t = step, already incremented.
template <class T>
struct AdamMath {
  T B1, B2, E, C1, C2, decay, c1, c2;
  bool decoupled;
  static AdamMath make(double lr, double step, double b1, double b2, double eps, double decoupled_wd,
                       bool bias_correction) {
    AdamMath a;
    const T l = static_cast<T>(lr), t = static_cast<T>(step);
    a.B1 = static_cast<T>(b1), a.B2 = static_cast<T>(b2), a.E = static_cast<T>(eps);
    a.C1 = static_cast<T>(1 - b1), a.C2 = static_cast<T>(1 - b2);
    a.decay = T(1) - l * static_cast<T>(decoupled_wd);
    a.c1 = bias_correction ? l / (T(1) - std::pow(a.B1, t)) : l;
    a.c2 = bias_correction ? T(1) / std::sqrt(T(1) - std::pow(a.B2, t)) : T(1);
    a.decoupled = decoupled_wd != 0;
    return a;
  }
  NN_HD_GENERIC template <class M, class G>
  NN_HD auto m(const M& m, const G& g) const {
    return B1 * m + C1 * g;
  }
  NN_HD_GENERIC template <class V, class G>
  NN_HD auto v(const V& v, const G& g) const {
    return B2 * v + C2 * (g * g);
  }
  /// What p loses this step, from the new m and sqrt of the new v.
  NN_HD_GENERIC template <class M, class R>
  NN_HD auto delta(const M& m, const R& root_v) const {
    return (c1 * m) / (root_v * c2 + E);
  }
};

/// Lion: c = b1 m + (1-b1) g; m = b2 m + (1-b2) g; wd > 0: p *= 1 - lr wd; p -= lr sign(c).
template <class T>
struct LionMath {
  T l, B1, B2, C1, C2, decay;
  bool has_wd;
  static LionMath make(double lr, double b1, double b2, double wd) {
    const T l = static_cast<T>(lr);
    return {l, static_cast<T>(b1), static_cast<T>(b2), static_cast<T>(1 - b1), static_cast<T>(1 - b2),
            T(1) - l * static_cast<T>(wd), wd > 0};
  }
  NN_HD void operator()(T& p, T g, T& m) const {
    const T c = B1 * m + C1 * g;
    m = B2 * m + C2 * g;
    const T pi = has_wd ? decay * p : p;
    const T sg = c > T(0) ? T(1) : (c < T(0) ? T(-1) : T(0));
    p = pi - l * sg;
  }
};

/// Muon's momentum: g += wd p; v = mu v + (1-mu) g; u = nesterov ? (1-mu) g + mu v : v.
template <class T>
struct MuonMomentumMath {
  T mu, w, c;
  bool has_wd, nesterov;
  static MuonMomentumMath make(double momentum, double wd, bool nesterov) {
    return {static_cast<T>(momentum), static_cast<T>(wd), static_cast<T>(1 - momentum), wd != 0, nesterov};
  }
  NN_HD void operator()(T p, T g, T& v, T& u) const {
    const T gi = has_wd ? g + w * p : g;
    const T vi = mu * v + c * gi;
    v = vi;
    u = nesterov ? gi * c + vi * mu : vi;
  }
};

/// y = a x + b y (Muon's Newton-Schulz steps).
template <class T>
struct AxpbyMath {
  T a, b;
  NN_HD T operator()(T x, T y) const { return a * x + b * y; }
};

/// p -= (lr factor) x, the rate rounded to T before the factor is applied (MLX's order).
template <class T>
struct ApplyUpdateMath {
  T l;
  static ApplyUpdateMath make(double lr, double factor) {
    return {static_cast<T>(static_cast<T>(lr) * static_cast<T>(factor))};
  }
  NN_HD T operator()(T p, T x) const { return p - l * x; }
};

// ---- quantized formats (quant.hpp) ------------------------------------------------------------

/// MLX's quantization, per value: the code reader of every quantized kernel, mxfp4's E2M1 and
/// E8M0 tables, and the per-group arithmetic of nn::quantize, which follows MLX 0.32.4's CPU
/// kernel operation by operation (so its codes, scales and biases are MLX's bit for bit).
struct QuantMath {
  /// Code c of a row's LSB-first bit stream of row_bytes bytes: bits [c*bits, (c+1)*bits).
  NN_HD static std::uint32_t code(const std::uint8_t* row, std::int64_t c, int bits, std::int64_t row_bytes) {
    const std::int64_t bit = c * bits, byte = bit >> 3;
    std::uint32_t v = row[byte];
    if (byte + 1 < row_bytes) v |= static_cast<std::uint32_t>(row[byte + 1]) << 8;
    return (v >> (bit & 7)) & ((1u << bits) - 1u);
  }
  /// The inverse of code(): ORs code v (< 2^bits) into a zeroed row's bit stream at index c.
  static void put_code(std::uint8_t* row, std::int64_t c, int bits, std::uint32_t v) {
    const std::int64_t bit = c * bits;
    std::uint8_t* p = row + bit / 8;
    const std::uint32_t sh = static_cast<std::uint32_t>(bit % 8), wide = v << sh;
    p[0] = static_cast<std::uint8_t>(p[0] | (wide & 0xffu));
    if (sh + static_cast<std::uint32_t>(bits) > 8) p[1] = static_cast<std::uint8_t>(p[1] | (wide >> 8));
  }
  /// E2M1 code (sign in bit 3) -> {0, .5, 1, 1.5, 2, 3, 4, 6}, negated; code 8 is -0.
  NN_HD static float e2m1(std::uint32_t c) {
    const float lut[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = lut[c & 7u];
    return (c & 8u) ? -v : v;
  }
  /// E4M3 (fn: no infinities; 0x7f / 0xff are NaN) byte -> its value: sign, 4 exponent bits
  /// (bias 7), 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6).
  NN_HD static float e4m3(std::uint32_t b) {
    const std::uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15 && m == 7) {
      const std::uint32_t nan_bits = 0x7fc00000u;
      __builtin_memcpy(&v, &nan_bits, 4);
    }
    else if (e == 0) v = static_cast<float>(m) * 0.001953125f;  // m / 8 * 2^-6
    else v = ::ldexpf(1.0f + static_cast<float>(m) * 0.125f, static_cast<int>(e) - 7);
    return (b & 0x80u) ? -v : v;
  }
  /// float -> E4M3 byte, rounding to nearest even and saturating to +-448 (0x7e) as PyTorch's
  /// c10::Float8_e4m3fn and MLX's fp8_e4m3 do (bit manipulation on the float's encoding).
  NN_HD static std::uint8_t e4m3_byte(float f) {
    std::uint32_t fb;
    __builtin_memcpy(&fb, &f, 4);
    const std::uint32_t sign = fb & 0x80000000u;
    fb ^= sign;
    std::uint8_t bits;
    if (fb >= (543u << 21)) {
      bits = 0x7e;
    } else if (fb < (121u << 23)) {  // below 2^-6: subnormal; adding 2^-6 rounds the mantissa (RNE)
      const std::uint32_t denorm = 141u << 23;
      float x, d;
      __builtin_memcpy(&x, &fb, 4);
      __builtin_memcpy(&d, &denorm, 4);
      x += d;
      std::uint32_t xb;
      __builtin_memcpy(&xb, &x, 4);
      bits = static_cast<std::uint8_t>(xb - denorm);
    } else {
      const std::uint32_t mant_odd = (fb >> 20) & 1u;
      fb += (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7ffffu;
      fb += mant_odd;
      bits = static_cast<std::uint8_t>(fb >> 20);
    }
    return static_cast<std::uint8_t>(bits | (sign >> 24));
  }
  /// E8M0 scale byte -> 2^(e - 127) (255 gives infinity in float, as MLX's bf16 scale does).
  template <class T>
  NN_HD static T e8m0(std::uint8_t e) {
    return ::ldexp(static_cast<T>(1), static_cast<int>(e) - 127);
  }

  /// One affine group's scale and bias (F = float as MLX; double for float64 weights).
  template <class F>
  struct Affine {
    F scale, bias;
  };
  template <class F>
  static Affine<F> affine_params(const double* g, std::int64_t n, int bits) {
    const F n_bins = static_cast<F>((1 << bits) - 1), eps = static_cast<F>(1e-7);
    F w_min = std::numeric_limits<F>::infinity(), w_max = -w_min;
    for (std::int64_t j = 0; j < n; ++j) {
      w_max = std::max(w_max, static_cast<F>(g[j]));
      w_min = std::min(w_min, static_cast<F>(g[j]));
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    F scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const F edge = mask ? w_min : w_max;
    const F q0 = std::rint(edge / scale);
    F bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    return {scale, bias};
  }
  template <class F>
  static std::uint32_t affine_code(F w, const Affine<F>& p, int bits) {
    const F n_bins = static_cast<F>((1 << bits) - 1);
    F q = std::rint((w - p.bias) / p.scale);
    q = std::min(std::max(q, F(0)), n_bins);
    return static_cast<std::uint32_t>(static_cast<std::uint64_t>(q));
  }

  /// v rounded to dtype t's precision (float32 arithmetic on bf16/f16 values, as MLX computes
  /// half-precision ops: in float, rounded back), kept in double.
  static double in(DType t, double v) {
    if (t == DType::f64) return v;
    const float f = static_cast<float>(v);
    if (t == DType::bf16) return half::bf16_round(f);
    if (t == DType::f16) return half::f16_to_f32(half::f32_to_f16(f));
    return f;
  }
  /// The E8M0 scale exponent of an mxfp4 (elem_max 6) or mxfp8 (elem_max 448) group of n values
  /// of dtype t, as MLX 0.32.4 computes it: s = amax / elem_max rounded to t, e = the smallest
  /// integer with 2^e >= s (rounding the scale up, so no value saturates), 0 for a zero group.
  /// The stored byte is e + 127 (mod 256).
  static std::int32_t mx_exponent(const double* g, std::int64_t n, DType t, float elem_max) {
    double amax = 0;
    for (std::int64_t j = 0; j < n; ++j) amax = std::max(amax, std::abs(g[j]));
    const double s = t == DType::f64 ? amax / elem_max : in(t, static_cast<float>(amax) / elem_max);
    if (s == 0) return 0;
    if (!std::isfinite(s)) return 128;  // 2^128: float's infinity, as MLX stores it
    int k = 0;
    const double m = std::frexp(s, &k);  // s = m 2^k, m in [0.5, 1)
    return m == 0.5 ? k - 1 : k;
  }
  static std::uint8_t mxfp4_byte(std::int32_t e) {
    return static_cast<std::uint8_t>(static_cast<std::uint32_t>(e) + 127u);  // int32 -> uint8 wraps
  }
  /// nvfp4's scale byte of a group: amax / 6 rounded to t, then to E4M3 (MLX 0.32.4, no global
  /// scale).
  static std::uint8_t nvfp4_scale_byte(const double* g, std::int64_t n, DType t) {
    double amax = 0;
    for (std::int64_t j = 0; j < n; ++j) amax = std::max(amax, std::abs(g[j]));
    return e4m3_byte(static_cast<float>(t == DType::f64 ? amax / 6.0 : in(t, static_cast<float>(amax) / 6.0f)));
  }
  /// mxfp8's code of w in a group of exponent e: w / 2^e computed in t, then E4M3.
  static std::uint8_t mxfp8_code(double w, std::int32_t e, DType t) {
    const double p = t == DType::f64 ? std::ldexp(1.0, e) : in(t, std::ldexp(1.0f, e));
    const double v = t == DType::f64 ? w / p : in(t, static_cast<float>(w) / static_cast<float>(p));
    return e4m3_byte(static_cast<float>(v));
  }
  /// The E2M1 code of w in a group whose scale is p (mxfp4: 2^e; nvfp4: its E4M3 scale's value;
  /// zero gives code 0): the nearest table value to w / p, computed in t; the first index wins a
  /// tie (MLX's argmin).
  static std::uint32_t e2m1_code(double w, double p, DType t) {
    if (p == 0) return 0;
    const double v = t == DType::f64 ? w / p : in(t, static_cast<float>(w) / static_cast<float>(p));
    std::uint32_t best = 0;
    double best_d = 0;
    for (std::uint32_t i = 0; i < 16; ++i) {
      const double d = t == DType::f64 ? std::abs(v - e2m1(i)) : in(t, std::abs(static_cast<float>(v) - e2m1(i)));
      if (i == 0 || d < best_d) {
        best = i;
        best_d = d;
      }
    }
    return best;
  }
};

}  // namespace nn::detail

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC diagnostic pop
#endif
