// SPDX-License-Identifier: MIT OR Apache-2.0
// The backend policy concept: the kernels a backend (nn::cpu, nn::cuda) must supply so the tape
// and the ops can run on it without ever touching tensor memory themselves.
#pragma once

#include <concepts>

#include "../tensor.hpp"

namespace nn {

/// Elementwise one-input kernels. `arg` is the op's scalar (the exponent of pow, unused else).
/// The math of each lives in the backend's unary kernel and its vjp next to it.
enum class Unary : std::uint8_t {
  neg,
  exp,
  log,
  sqrt,
  rsqrt,
  tanh,
  sigmoid,
  relu,
  abs,
  pow,         // x^arg
  silu,        // x * sigmoid(x)
  gelu,        // 0.5 x (1 + erf(x / sqrt 2))                      (PyTorch gelu, MLX nn.gelu)
  gelu_approx, // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (MLX nn.gelu_approx)
  gelu_fast,   // x * sigmoid(1.702 x)                              (MLX nn.gelu_fast_approx)
  scale,       // arg * x
  add_scalar,  // x + arg
};

/// Elementwise two-input kernels with NumPy broadcasting.
enum class Binary : std::uint8_t { add, sub, mul, div, maximum, minimum };

constexpr const char* unary_name(Unary u) {
  switch (u) {
    case Unary::neg: return "neg";
    case Unary::exp: return "exp";
    case Unary::log: return "log";
    case Unary::sqrt: return "sqrt";
    case Unary::rsqrt: return "rsqrt";
    case Unary::tanh: return "tanh";
    case Unary::sigmoid: return "sigmoid";
    case Unary::relu: return "relu";
    case Unary::abs: return "abs";
    case Unary::pow: return "pow";
    case Unary::silu: return "silu";
    case Unary::gelu: return "gelu";
    case Unary::gelu_approx: return "gelu_approx";
    case Unary::gelu_fast: return "gelu_fast_approx";
    case Unary::scale: return "scale";
    case Unary::add_scalar: return "add_scalar";
  }
  return "?";
}
constexpr const char* binary_name(Binary b) {
  switch (b) {
    case Binary::add: return "add";
    case Binary::sub: return "sub";
    case Binary::mul: return "mul";
    case Binary::div: return "div";
    case Binary::maximum: return "maximum";
    case Binary::minimum: return "minimum";
  }
  return "?";
}

/// What a backend policy provides. Every kernel takes tensors already allocated by the caller
/// (the tape owns all buffers, so a replay allocates nothing); `acc` means "add into the
/// destination" rather than overwrite, which is how gradients accumulate. Shapes are validated
/// by the ops before a kernel runs; kernels trust them.
template <class B>
concept BackendPolicy = requires(Tensor& y, const Tensor& x, const Shape& s, DType dt, double v, bool acc,
                                 int axis, std::int64_t i64, const std::array<int, kMaxRank>& perm) {
  { B::device } -> std::convertible_to<Device>;
  { B::name } -> std::convertible_to<const char*>;
  { B::alloc(s, dt) } -> std::same_as<Tensor>;
  B::fill(y, v);
  B::copy(x, y, acc);                          // y (+)= x, same element count
  B::cast(x, y);                               // dtype conversion, same shape
  B::unary(Unary::exp, v, x, y);               // y = f(x)
  B::unary_vjp(Unary::exp, v, x, x, x, y, acc);  // gx (+)= g * f'(x), given x, y = f(x), g
  B::binary(Binary::add, x, x, y);             // y = a op b, broadcast
  B::binary_vjp(Binary::add, 0, x, x, x, y, acc);  // d(a op b)/d(a or b) * g, full output shape
  B::sum_to(x, y, v, acc);                     // y (+)= v * sum of x over y's broadcast dims
  B::broadcast_to(x, y, v, acc);               // y (+)= v * x broadcast to y's shape
  B::where(x, x, x, y);                        // y = mask ? a : b, broadcast
  B::where_vjp(x, x, 0, y, acc);               // g masked to one branch, full output shape
  B::max_axis(x, axis, y, y);                  // y = max over axis (keepdims), index of first max
  B::max_axis_vjp(x, y, axis, y, acc);         // gx (+)= g at the argmax, 0 elsewhere
  B::matmul(x, acc, x, acc, y, acc);           // c (+)= op(a) @ op(b), batched, see cpu.hpp
  B::permute(x, perm, y, acc);                 // y (+)= x permuted
  B::slice_copy(x, axis, i64, y);              // y = x[..., start:start+len, ...]
  B::slice_scatter(x, axis, i64, y, acc);      // y[..., start:start+len, ...] (+)= x
  B::gather_rows(x, x, y);                     // y[i, :] = table[ids[i], :]
  B::scatter_add_rows(x, x, y);                // table_grad[ids[i], :] += g[i, :]
  B::pick(x, x, y);                            // y[i] = x[i, idx[i]] (0 where idx < 0)
  B::pick_vjp(x, x, y);                        // gx[i, idx[i]] += g[i]
  B::bernoulli_mask(x, v, v, y);               // (key, p_keep, value, mask): MLX bernoulli ? value : 0
  B::softmax(x, y, acc);                       // last axis; acc selects log_softmax here
  B::softmax_vjp(x, x, y, acc, acc);           // (y, g, gx, log?, acc)
  B::cross_entropy(x, x, i64, axis, y, y);     // (logits, targets, ignore, reduction, y, lse)
  B::cross_entropy_vjp(x, x, i64, axis, x, x, y, acc);  // (logits, targets, ignore, reduction, lse, g, gx, acc)
  // fused primitives, each beside its composite reference (ops/norm, rope, attention, glu.hpp);
  // a null gradient pointer means that input needs none
  B::rms_norm(x, x, v, y, y);                    // (x, w or undefined, eps, y, rstd)
  B::rms_norm_vjp(x, x, x, x, &y, acc, &y, acc); // (x, w, rstd, g, gx, acc_x, gw, acc_w)
  B::rope(x, x, x, acc, acc, y, acc);            // (x, cos, sin, traditional, inverse, y, acc)
  B::attention(x, x, x, x, i64, i64, i64, i64, i64, v, y, y, acc);  // (q, k, v, mask, B, T, H, KV, hd, scale, out, p, causal)
  B::attention_vjp(x, x, x, x, x, i64, i64, i64, i64, i64, v, y, &y, acc, &y, acc, &y, acc, acc);  // (q, k, v, p, g, B, T, H, KV, hd, scale, scratch, gq, acc, gk, acc, gv, acc, causal)
  // (optional: B::flash_attention / flash_attention_vjp, see detail::HasFlashAttention in
  // ops/attention.hpp; a backend without them runs attention above for every gqa_attention)
  B::swiglu(x, x, y);                            // (gate, up, y)
  B::swiglu_vjp(x, x, x, &y, acc, &y, acc);      // (gate, up, g, ggate, acc, gup, acc)
  // optimizer updates (optim/): p, g and slots of one parameter; lr/step 0-D tensors
  B::sgd_update(y, x, y, x, v, v, v, acc);
  B::adam_update(y, x, y, y, x, x, v, v, v, v, acc);
  B::lion_update(y, x, y, x, v, v, v);
  B::muon_momentum(x, x, y, y, v, v, acc);
  B::axpby(v, x, v, y);
  { B::sum_squares(x) } -> std::convertible_to<double>;
  B::normalize_frobenius(y, v);
  B::apply_update(y, x, x, v);
};

}  // namespace nn
