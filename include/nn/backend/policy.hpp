// SPDX-License-Identifier: MIT OR Apache-2.0
// The backend policy concept: the kernels a backend (nn::cpu, nn::cuda) must supply so the tape
// and the ops can run on it without ever touching tensor memory themselves.
#pragma once

#include <array>
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

/// Every primitive the tape records (ops/), one enumerator each. A new primitive adds itself here
/// (beside its kernels' lines below), and
/// tests/ops/registry.test.cpp fails until the op registry (tests/support/op_registry.hpp) lists
/// it with sample inputs, so no primitive ships without its fixture, finite-difference, replay
/// and CUDA checks.
#define NN_PRIMITIVES(X)                                                                                  \
  X(unary) X(binary) X(where) X(stop_gradient) X(reshape) X(permute) X(slice) X(concat) X(broadcast_to)  \
  X(sum) X(max) X(matmul) X(gather_rows) X(pick) X(softmax) X(cross_entropy) X(bernoulli) X(dropout)     \
  X(rmsnorm) X(rope) X(attention) X(flash_attention) X(swiglu) X(quantized_matmul) X(quantized_gather)  \
  X(fused) X(linear_cross_entropy)

enum class Prim : std::uint8_t {
#define NN_PRIM_ENUMERATOR(p) p,
  NN_PRIMITIVES(NN_PRIM_ENUMERATOR)
#undef NN_PRIM_ENUMERATOR
};
#define NN_PRIM_COUNT(p) +1
inline constexpr std::size_t kPrimCount = 0 NN_PRIMITIVES(NN_PRIM_COUNT);
#undef NN_PRIM_COUNT

/// The primitive's name, as errors and summaries print it.
constexpr const char* prim_name(Prim p) {
  switch (p) {
#define NN_PRIM_NAME(n) \
  case Prim::n:         \
    return #n;
    NN_PRIMITIVES(NN_PRIM_NAME)
#undef NN_PRIM_NAME
  }
  return "?";
}

/// How a loss over rows is reduced (PyTorch's `reduction`).
enum class Reduction : std::uint8_t { none, sum, mean };

constexpr const char* reduction_name(Reduction r) {
  return r == Reduction::none ? "none" : (r == Reduction::sum ? "sum" : "mean");
}

// Attribute structs of the primitives whose kernels need more than a flag or two: the node keeps
// them (ops/), and the kernels take them whole, not as long positional lists.

/// Attention's shape and options: q, out (B, T, H * head_dim), k, v (B, T, KV * head_dim) (or
/// the same with B and T merged); query head h reads kv head h / (H / KV). `scale` multiplies the
/// scores; `causal`: query i sees keys 0..i only.
struct AttentionAttrs {
  std::int64_t B = 0, T = 0, H = 0, KV = 0, head_dim = 0;
  double scale = 1.0;
  bool causal = false;
  // flash attention only (0: off): a causal query i sees keys i - window < j <= i (a sliding
  // window, as transformers' Gemma 2 / Mistral / Phi-3 masks); scores soft-capped to
  // softcap * tanh(s / softcap) before the softmax (Gemma 2's attn_logit_softcapping)
  std::int64_t window = 0;
  double softcap = 0;
};

/// Softmax cross-entropy's options: a target equal to ignore_index counts nothing (loss and
/// gradient 0, left out of the mean).
struct CrossEntropyAttrs {
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
};

/// RoPE's kernel options: traditional (interleaved pairs (2i, 2i + 1)) or NEOX halves; inverse
/// rotates by minus the angle (the vjp).
struct RopeArgs {
  bool traditional = false;
  bool inverse = false;
};

/// A quantized matrix's format (quant.hpp): MLX's affine (w = scale * q + bias per group of
/// `group` values along a row, `bits`-bit codes), or one of its floating-point modes: mxfp4 (E2M1
/// codes, an E8M0 scale per 32), mxfp8 (E4M3 codes, an E8M0 scale per 32), nvfp4 (E2M1 codes, an
/// E4M3 scale per 16).
enum class QuantMode : std::uint8_t { affine, mxfp4, mxfp8, nvfp4 };

constexpr const char* quant_mode_name(QuantMode m) {
  switch (m) {
    case QuantMode::affine: return "affine";
    case QuantMode::mxfp4: return "mxfp4";
    case QuantMode::mxfp8: return "mxfp8";
    case QuantMode::nvfp4: return "nvfp4";
  }
  return "?";
}
/// The floating-point modes: u8 scales, no biases, E2M1 or E4M3 codes.
constexpr bool quant_fp(QuantMode m) { return m != QuantMode::affine; }

struct Quant {
  QuantMode mode = QuantMode::affine;
  int group = 64;
  int bits = 4;
  /// MLX's default: affine, groups of 64, 4 bits.
  static constexpr Quant affine(int group = 64, int bits = 4) { return {QuantMode::affine, group, bits}; }
  static constexpr Quant mxfp4() { return {QuantMode::mxfp4, 32, 4}; }
  static constexpr Quant mxfp8() { return {QuantMode::mxfp8, 32, 8}; }
  static constexpr Quant nvfp4() { return {QuantMode::nvfp4, 16, 4}; }
  friend constexpr bool operator==(const Quant&, const Quant&) = default;
};

/// quantized_matmul's options: y = x @ W^T when transpose (W (N, K), a Linear's weight), else
/// x @ W (W (K, N)); W quantized along its rows in format q.
struct QuantMatmulAttrs {
  Quant q;
  bool transpose = true;
};

/// The weight of a linear_cross_entropy's head (ops/linear_cross_entropy.hpp), a (V, C) matrix
/// in nn.Linear's layout: dense `w`, or quantized rows (`codes`, `scales`, `biases`, the last
/// undefined in the fp modes) in format `q`.
struct HeadWeight {
  Tensor w;
  Tensor codes, scales, biases;
  Quant q;
  bool quantized() const { return codes.defined(); }
  std::int64_t rows() const { return quantized() ? codes.dim(0) : w.dim(0); }
};

/// linear_cross_entropy's options: the cross-entropy's (ignore_index; sum or mean), and whether
/// the node has per-row weights `keep` (the mean is then sum(keep * loss) / sum(keep)).
struct LinearCrossEntropyAttrs {
  CrossEntropyAttrs ce;
  bool has_keep = false;
  QuantMatmulAttrs head;  // head.q: the quantized head's format (unused for a dense head)
  bool quantized = false;
};

/// A fused elementwise group's program (ops/fused.hpp makes it; backend/cpu/fused.hpp runs it):
/// registers 0..inputs-1 hold the group's inputs at each element, register inputs + s step s's
/// result, and the last step's result is the output. Each step is a unary or binary primitive,
/// or a where, that was a node of the tape, kept with its attributes, so the fused loop computes
/// exactly what the nodes did, element by element, with the same functors (backend/math.hpp).
/// An input of another dtype than the group's is a where's mask: it is loaded as 1 where it is
/// nonzero and 0 elsewhere (where's own test).
inline constexpr int kMaxFusedSteps = 16;
inline constexpr int kMaxFusedInputs = 8;
struct FusedStep {
  bool binary = false;  // else unary (or a where)
  bool select = false;  // where(mask register m, a, b): a where the mask is nonzero, else b
  std::uint8_t op = 0;  // the Unary or Binary enumerator
  std::int8_t a = 0, b = 0, m = 0;  // operand registers (b: binary and where; m: where only)
  bool grad = false;         // the step's value wants a gradient (its node's requires_grad)
  bool grad_a = false, grad_b = false;  // the gradient flows into operand a / b
  double arg = 0.0;          // a unary's scalar (pow's exponent, scale's factor)
  std::int32_t node = -1;    // the tape node it was (for reports)
};
struct FusedProgram {
  int inputs = 0, steps = 0;
  std::array<FusedStep, kMaxFusedSteps> step{};
  // The registers the vjp reads (bit r: register r): what the steps' derivatives read
  // (unary_df_reads, binary_df_reads) and what those values are computed from. The last step's
  // value comes from the output; a register outside the mask is neither loaded nor recomputed.
  std::uint32_t vjp_need = ~0u;
};

/// Where a vjp kernel writes one input's gradient: the buffer (null when that input needs none)
/// and whether it adds into what is there. The tape hands these out (GTape::grad_outs) with
/// aliasing resolved: when two inputs are one tensor, their slots name one buffer, already
/// zeroed, and both accumulate, so a kernel never tests whether its outputs overlap.
struct GradOut {
  Tensor* g = nullptr;
  bool acc = false;
};

/// What a backend policy provides. Every kernel takes tensors already allocated by the caller
/// (the tape owns all buffers, so a replay allocates nothing); `acc` means "add into the
/// destination" rather than overwrite, which is how gradients accumulate. Shapes are validated
/// by the ops before a kernel runs; kernels trust them.
template <class B>
concept BackendPolicy = requires(Tensor& y, const Tensor& x, const Shape& s, DType dt, double v, bool acc,
                                 int axis, std::int64_t i64, const std::array<int, kMaxRank>& perm,
                                 const AttentionAttrs& att, const CrossEntropyAttrs& ce, GradOut go,
                                 RopeArgs ra, const QuantMatmulAttrs& qa, const Quant& q) {
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
  B::cross_entropy(x, x, ce, y, y);            // (logits, targets, attrs, y, lse)
  B::cross_entropy_vjp(x, x, ce, x, x, y, acc);  // (logits, targets, attrs, lse, g, gx, acc)
  // fused primitives, each beside its composite reference (ops/norm, rope, attention, glu.hpp);
  // a null gradient pointer means that input needs none
  B::rms_norm(x, x, v, y, y);                    // (x, w or undefined, eps, y, rstd)
  B::rms_norm_vjp(x, x, x, x, go, go);           // (x, w, rstd, g, gx, gw)
  B::rope(x, x, x, ra, y, acc);                  // (x, cos, sin, {traditional, inverse}, y, acc)
  B::attention(x, x, x, x, att, y, y);           // (q, k, v, mask, attrs, out, p)
  B::attention_vjp(x, x, x, x, x, att, y, go, go, go);  // (q, k, v, p, g, attrs, scratch, gq, gk, gv)
  // (optional: B::flash_attention / flash_attention_vjp, see detail::HasFlashAttention in
  // ops/attention.hpp; a backend without them runs attention above for every gqa_attention)
  B::swiglu(x, x, y);                            // (gate, up, y)
  B::swiglu_vjp(x, x, x, go, go);                // (gate, up, g, ggate, gup)
  // quantized weights (quant.hpp, ops/quantized.hpp): W given as (codes, scales, biases)
  B::quantized_matmul(x, x, x, x, qa, y, acc);   // (x, wq, scales, biases, attrs, y, acc): y (+)= x @ op(W)
  B::quantized_gather(x, x, x, x, q, y);         // (ids, wq, scales, biases, format, y): y[i] = W[ids[i]]
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
