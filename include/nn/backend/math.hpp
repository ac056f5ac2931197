// SPDX-License-Identifier: MIT OR Apache-2.0
// The math of every elementwise primitive, forward and derivative side by side, compiled for the
// host and (under nvcc) for the device, so nn::cpu and nn::cuda run the same formulas.
#pragma once

#include <cmath>
#include <cstdint>
#include <numbers>

#include "policy.hpp"

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

template <class T>
NN_HD inline T sigmoid(T x) {
  return T(1) / (T(1) + m_exp(-x));
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

template <class T>
NN_HD inline void put(T* y, std::int64_t i, T v, bool acc) {
  if (acc) y[i] += v;
  else y[i] = v;
}

}  // namespace nn::detail
