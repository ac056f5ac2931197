// SPDX-License-Identifier: MIT OR Apache-2.0
// Elementwise primitives: unary math (the derivative of each sits beside its forward in the
// backend's unary_f / unary_df), broadcasting binary arithmetic, where, stop_gradient.
#pragma once

#include "../backend/math.hpp"
#include "common.hpp"

namespace nn {

/// A unary primitive's kernel and its scalar (pow's exponent, scale's factor; unused else).
struct UnaryAttrs {
  Unary op;
  double arg;
};
/// A binary primitive's kernel.
struct BinaryAttrs {
  Binary op;
};

namespace detail {

template <class B>
struct UnaryPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<UnaryAttrs>(n);
    B::unary(a.op, a.arg, tp.in(n, 0), n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<UnaryAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    B::unary_vjp(a.op, a.arg, tp.in(n, 0), n.value, n.grad, s.g, s.acc);
  }
  static const char* kernel(const Node<B>& n) { return unary_name(attrs_of<UnaryAttrs>(n).op); }
  static std::uint32_t vjp_reads(const GTape<B>&, const Node<B>& n) {
    const unsigned r = unary_df_reads(attrs_of<UnaryAttrs>(n).op);
    return ((r & 1) ? vjp_reads_input(0) : 0u) | ((r & 2) ? kVjpReadsOutput : 0u);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> UnaryPrim<B>::def{.prim = Prim::unary, .forward = &forward, .vjp = &vjp, .kernel = &kernel, .vjp_reads = &vjp_reads};

/// a op b with broadcasting. Each input's gradient is formed at the output's shape, then reduced
/// to the input's shape by the tape's accumulate_reduced (the one place that sums broadcasts).
template <class B>
struct BinaryPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    B::binary(attrs_of<BinaryAttrs>(n).op, tp.in(n, 0), tp.in(n, 1), n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const Binary op = attrs_of<BinaryAttrs>(n).op;
    const Tensor &a = tp.in(n, 0), &b = tp.in(n, 1);
    for (std::size_t k = 0; k < 2; ++k) {
      if (!tp.needs_grad(n, k)) continue;
      if (tp.in(n, k).shape() == n.value.shape()) {
        GradSlot s = tp.grad_slot(n, k);
        B::binary_vjp(op, static_cast<int>(k), a, b, n.grad, s.g, s.acc);
      } else {
        Tensor& full = tp.scratch(n, k, n.value.shape(), n.value.dtype());
        B::binary_vjp(op, static_cast<int>(k), a, b, n.grad, full, false);
        tp.accumulate_reduced(n, k, full);
      }
    }
  }
  static const char* kernel(const Node<B>& n) { return binary_name(attrs_of<BinaryAttrs>(n).op); }
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    unsigned r = 0;
    for (int k = 0; k < 2; ++k)
      if (tp.needs_grad(n, static_cast<std::size_t>(k))) r |= binary_df_reads(attrs_of<BinaryAttrs>(n).op, k);
    return r;  // bit 0 a (input 0), bit 1 b (input 1)
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> BinaryPrim<B>::def{.prim = Prim::binary, .forward = &forward, .vjp = &vjp, .kernel = &kernel, .vjp_reads = &vjp_reads};

/// where(mask, a, b): inputs 0 mask, 1 a, 2 b.
template <class B>
struct WherePrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::where(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.value); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    for (std::size_t k = 1; k < 3; ++k) {
      if (!tp.needs_grad(n, k)) continue;
      if (tp.in(n, k).shape() == n.value.shape()) {
        GradSlot s = tp.grad_slot(n, k);
        B::where_vjp(tp.in(n, 0), n.grad, static_cast<int>(k - 1), s.g, s.acc);
      } else {
        Tensor& full = tp.scratch(n, k, n.value.shape(), n.value.dtype());
        B::where_vjp(tp.in(n, 0), n.grad, static_cast<int>(k - 1), full, false);
        tp.accumulate_reduced(n, k, full);
      }
    }
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> WherePrim<B>::def{.prim = Prim::where, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 1u>};

/// A copy that the backward sweep does not cross.
template <class B>
struct StopGradientPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::copy(tp.in(n, 0), n.value, false); }
  static void vjp(GTape<B>&, Node<B>&) {}
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> StopGradientPrim<B>::def{.prim = Prim::stop_gradient, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

}  // namespace detail

/// y = f(x) for a Unary kernel; `arg` is its scalar (pow's exponent, scale's factor).
template <class B>
GVar unary(GTape<B>& tp, Unary op, GVar x, double arg = 0.0) {
  detail::require_float(tp, x, unary_name(op));
  GVar in[] = {x};
  return tp.record(detail::UnaryPrim<B>::def, in, UnaryAttrs{op, arg}, tp.shape(x), tp.dtype(x));
}

// clang-format off
template <class B> GVar neg(GTape<B>& tp, GVar x) { return unary(tp, Unary::neg, x); }
template <class B> GVar exp(GTape<B>& tp, GVar x) { return unary(tp, Unary::exp, x); }
template <class B> GVar log(GTape<B>& tp, GVar x) { return unary(tp, Unary::log, x); }
template <class B> GVar sqrt(GTape<B>& tp, GVar x) { return unary(tp, Unary::sqrt, x); }
template <class B> GVar rsqrt(GTape<B>& tp, GVar x) { return unary(tp, Unary::rsqrt, x); }
template <class B> GVar tanh(GTape<B>& tp, GVar x) { return unary(tp, Unary::tanh, x); }
template <class B> GVar sigmoid(GTape<B>& tp, GVar x) { return unary(tp, Unary::sigmoid, x); }
/// relu'(0) = 0, as PyTorch.
template <class B> GVar relu(GTape<B>& tp, GVar x) { return unary(tp, Unary::relu, x); }
/// abs'(0) = 0 (sign(0)), as PyTorch.
template <class B> GVar abs(GTape<B>& tp, GVar x) { return unary(tp, Unary::abs, x); }
/// x^p for a scalar exponent p.
template <class B> GVar pow(GTape<B>& tp, GVar x, double p) { return unary(tp, Unary::pow, x, p); }
/// s * x for a scalar s.
template <class B> GVar scale(GTape<B>& tp, GVar x, double s) { return unary(tp, Unary::scale, x, s); }
/// x + c for a scalar c.
template <class B> GVar add_scalar(GTape<B>& tp, GVar x, double c) { return unary(tp, Unary::add_scalar, x, c); }
// clang-format on

/// a op b with NumPy broadcasting (scalars, trailing dims, any dim of size 1).
template <class B>
GVar binary(GTape<B>& tp, Binary op, GVar a, GVar b) {
  detail::require_same_dtype(tp, a, b, binary_name(op));
  Shape out = detail::broadcast_shapes(tp.shape(a), tp.shape(b), binary_name(op));
  GVar in[] = {a, b};
  return tp.record(detail::BinaryPrim<B>::def, in, BinaryAttrs{op}, out, tp.dtype(a));
}

// clang-format off
template <class B> GVar add(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::add, a, b); }
template <class B> GVar sub(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::sub, a, b); }
template <class B> GVar mul(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::mul, a, b); }
template <class B> GVar div(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::div, a, b); }
/// Elementwise maximum; at a tie the gradient goes to a.
template <class B> GVar maximum(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::maximum, a, b); }
/// Elementwise minimum; at a tie the gradient goes to a.
template <class B> GVar minimum(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::minimum, a, b); }
// clang-format on

/// mask != 0 ? a : b, all three broadcast together. The mask (u8, i32 or the float dtype) gets
/// no gradient; each branch gets the cotangent where it was selected and zero elsewhere.
template <class B>
GVar where(GTape<B>& tp, GVar mask, GVar a, GVar b) {
  detail::require_same_dtype(tp, a, b, "where");
  Shape out = detail::broadcast_shapes(detail::broadcast_shapes(tp.shape(mask), tp.shape(a), "where"), tp.shape(b), "where");
  GVar in[] = {mask, a, b};
  return tp.record(detail::WherePrim<B>::def, in, NoAttrs{}, out, tp.dtype(a));
}

/// x in the forward pass; no gradient flows back through it.
template <class B>
GVar stop_gradient(GTape<B>& tp, GVar x) {
  GVar in[] = {x};
  GVar y = tp.record(detail::StopGradientPrim<B>::def, in, NoAttrs{}, tp.shape(x), tp.dtype(x));
  tp.node(y).requires_grad = false;
  return y;
}

}  // namespace nn
