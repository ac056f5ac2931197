// SPDX-License-Identifier: MIT OR Apache-2.0
// Activations at layer level: SiLU, the three GELUs with MLX's definitions, the soft cap and
// SwiGLU.
// relu, sigmoid, tanh, softmax and log_softmax are primitives already (nn::relu etc. in
// ops/elementwise.hpp and ops/softmax.hpp); they are not redefined here.
#pragma once

#include <cmath>

#include "../ops/elementwise.hpp"
#include "../ops/glu.hpp"
#include "../ops/softmax.hpp"
#include "helpers.hpp"

namespace nn {

/// x * sigmoid(x) (Elfwing et al. 2017; mlx.nn.silu, torch.nn.functional.silu).
template <class B>
GVar silu(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "silu", "x");
  return unary(tp, Unary::silu, x);
}

/// 0.5 x (1 + erf(x / sqrt 2)), the exact GELU (Hendrycks & Gimpel 2016; mlx.nn.gelu,
/// torch.nn.functional.gelu).
template <class B>
GVar gelu(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "gelu", "x");
  return unary(tp, Unary::gelu, x);
}

/// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (mlx.nn.gelu_approx; torch's
/// gelu(approximate="tanh")).
template <class B>
GVar gelu_approx(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "gelu_approx", "x");
  return unary(tp, Unary::gelu_approx, x);
}

/// x * sigmoid(1.702 x) (mlx.nn.gelu_fast_approx, "QuickGELU").
template <class B>
GVar gelu_fast_approx(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "gelu_fast_approx", "x");
  return unary(tp, Unary::gelu_fast, x);
}

/// cap * tanh(x / cap), a soft cap that keeps |y| < cap (Gemma 2's attn_logit_softcapping on
/// attention scores, final_logit_softcapping on logits; SoftcapMath in backend/math.hpp is the
/// same math inside flash attention's tiles).
template <class B>
GVar softcap(GTape<B>& tp, GVar x, double cap) {
  detail::layer_float(tp, x, "softcap", "x");
  if (!(cap > 0) || !std::isfinite(cap)) detail::fail("softcap", "cap must be finite and > 0, got ", cap);
  return scale(tp, unary(tp, Unary::tanh, scale(tp, x, 1.0 / cap)), cap);
}

namespace detail {
template <class B>
void check_swiglu(const GTape<B>& tp, GVar gate, GVar up) {
  layer_same_dtype(tp, gate, up, "swiglu", "gate", "up");
  if (!(tp.shape(gate) == tp.shape(up)))
    fail("swiglu", "gate ", tp.shape(gate).str(), " and up ", tp.shape(up).str(), " must have the same shape");
}
}  // namespace detail

namespace reference {
/// SwiGLU composed from primitives, the reference the fused primitive is tested against.
template <class B>
GVar swiglu(GTape<B>& tp, GVar gate, GVar up) {
  detail::check_swiglu(tp, gate, up);
  return mul(tp, silu(tp, gate), up);
}
}  // namespace reference

/// silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer"; the Llama / Qwen2 MLP).
/// gate, up: (..., I) -> (..., I). One fused primitive (ops/glu.hpp).
template <class B>
GVar swiglu(GTape<B>& tp, GVar gate, GVar up) {
  detail::check_swiglu(tp, gate, up);
  return fused_swiglu(tp, gate, up);
}

}  // namespace nn
