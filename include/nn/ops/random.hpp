// SPDX-License-Identifier: MIT OR Apache-2.0
// Random primitives on the tape, drawn by the backend from a key that is itself a tape value (an
// input slot), so a replay with a new key draws anew and an eager run with the same key agrees.
#pragma once

#include "common.hpp"

namespace nn {

namespace detail {

/// Checks that `key` is an MLX key on the tape: uint32, shape (2).
template <class B>
void require_key(const GTape<B>& tp, GVar key, const char* op) {
  if (tp.dtype(key) != DType::u32 || !(tp.shape(key) == Shape{2}))
    fail(op, "the key must be a uint32 tensor of shape (2) (an MLX key, e.g. nn::random::key(seed)), got ",
         dtype_name(tp.dtype(key)), " ", tp.shape(key).str());
}

/// bernoulli's and dropout's probability (of a 1 in the mask; of dropping).
struct ProbabilityAttrs {
  double p;
};

/// bernoulli(p, shape, key) as a uint8 mask: inputs 0 key. No gradient.
template <class B>
struct BernoulliPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::bernoulli_mask(tp.in(n, 0), attrs_of<ProbabilityAttrs>(n).p, 1.0, n.value); }
  static void vjp(GTape<B>&, Node<B>&) {}
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> BernoulliPrim<B>::def{.prim = Prim::bernoulli, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// y = x * bernoulli(1 - p, x.shape, key) / (1 - p): inputs 0 x, 1 key; p the drop probability.
/// saved[0] holds the mask already scaled (0 or 1/(1-p), in x's dtype), drawn by the forward
/// into a buffer the node owns, so the vjp reuses exactly the mask the forward applied and a
/// replay redraws it in place from the key then in the slot.
/// MLX computes (mask * x) * (1/(1-p)); with mask in {0, 1} that equals x * (mask/(1-p)) bit
/// for bit (signed zeros and NaNs included), which is what this computes in one pass.
template <class B>
struct DropoutPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor& x = tp.in(n, 0);
    Tensor& m = tp.scratch(n, 0, x.shape(), x.dtype());
    // 1 - p and 1 / (1 - p) in double, as MLX's Python layer computes them, then rounded to the
    // mask's dtype by the kernel (float32(p_keep) for the test, float32(scale) for the values).
    const double p_keep = 1.0 - attrs_of<ProbabilityAttrs>(n).p;
    B::bernoulli_mask(tp.in(n, 1), p_keep, 1.0 / p_keep, m);
    B::binary(Binary::mul, m, x, n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    // d(m * x)/dx = m: the same scaled mask the forward drew.
    GradSlot s = tp.grad_slot(n, 0);
    B::binary_vjp(Binary::mul, 1, n.saved[0], tp.in(n, 0), n.grad, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> DropoutPrim<B>::def{.prim = Prim::dropout, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

}  // namespace detail

/// A uint8 mask of `shape`, 1 with probability p: mx.random.bernoulli(p, shape, key) on the tape.
template <class B>
GVar bernoulli(GTape<B>& tp, double p, const Shape& shape, GVar key) {
  detail::require_key(tp, key, "bernoulli");
  if (!(p >= 0.0 && p <= 1.0)) detail::fail("bernoulli", "p = ", p, " is not a probability in [0, 1]");
  GVar in[] = {key};
  return tp.record(detail::BernoulliPrim<B>::def, in, detail::ProbabilityAttrs{p}, shape, DType::u8);
}

/// The dropout primitive: x * bernoulli(1 - p, x.shape, key) / (1 - p), for p in [0, 1). Models
/// call nn::dropout (layers/dropout.hpp), which adds MLX's identity cases (p = 0, evaluation).
template <class B>
GVar dropout_mask_mul(GTape<B>& tp, GVar x, double p, GVar key) {
  detail::require_float(tp, x, "dropout");
  detail::require_key(tp, key, "dropout");
  if (!(p >= 0.0 && p < 1.0)) detail::fail("dropout", "the dropout probability ", p, " is not in [0, 1)");
  GVar in[] = {x, key};
  return tp.record(detail::DropoutPrim<B>::def, in, detail::ProbabilityAttrs{p}, tp.shape(x), tp.dtype(x));
}

}  // namespace nn
