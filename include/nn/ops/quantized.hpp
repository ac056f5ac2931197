// SPDX-License-Identifier: MIT OR Apache-2.0
// Primitives over quantized matrices (quant.hpp): quantized_matmul (x @ dequant(W)^T, or
// x @ dequant(W); vjp with respect to x only) and quantized_gather (rows of a quantized table: a
// quantized embedding). The matrix is three constants, codes (u32), scales and biases: it is never
// trained, and asking for its gradient is an error naming the op.
#pragma once

#include <optional>
#include <vector>

#include "../quant.hpp"
#include "common.hpp"
#include "index.hpp"  // detail::require_ids

namespace nn {

namespace detail {

/// inputs: 0 x (..., K), 1 codes, 2 scales, 3 biases (affine only). out: (..., N).
/// y = x @ op(W);  dx = g @ op(W)^T, the same kernel with the transpose flipped.
template <class B>
struct QuantizedMatmulPrim {
  static Tensor rows(const Tensor& t) { return t.reshape(Shape{t.numel() / t.dim(-1), t.dim(-1)}); }
  static Tensor biases(const GTape<B>& tp, const Node<B>& n) { return n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(); }
  static void forward(GTape<B>& tp, Node<B>& n) {
    Tensor y = rows(n.value);
    B::quantized_matmul(rows(tp.in(n, 0)), tp.in(n, 1), tp.in(n, 2), biases(tp, n), attrs_of<QuantMatmulAttrs>(n), y,
                        false);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    QuantMatmulAttrs t = attrs_of<QuantMatmulAttrs>(n);
    t.transpose = !t.transpose;
    Tensor gx = rows(s.g);
    B::quantized_matmul(rows(n.grad), tp.in(n, 1), tp.in(n, 2), biases(tp, n), t, gx, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> QuantizedMatmulPrim<B>::def{.prim = Prim::quantized_matmul, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 14u>};

/// inputs: 0 ids (integer, any shape), 1 codes, 2 scales, 3 biases (affine only). out: ids.shape + (D).
template <class B>
struct QuantizedGatherPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    Tensor y = n.value.reshape(Shape{tp.in(n, 0).numel(), n.value.dim(-1)});
    B::quantized_gather(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), QuantizedMatmulPrim<B>::biases(tp, n),
                        attrs_of<Quant>(n), y);
  }
  static void vjp(GTape<B>&, Node<B>&) {}  // nothing to differentiate: integer ids, a constant table
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> QuantizedGatherPrim<B>::def{.prim = Prim::quantized_gather, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// The checks both builders share: the matrix's three tensors form one (rows, cols) matrix in
/// format q (quant.hpp's check, with the op's name), none asks for a gradient.
template <class B>
std::int64_t check_quantized_inputs(const GTape<B>& tp, GVar wq, GVar scales, std::optional<GVar> biases,
                                    const Quant& q, const char* op) {
  const char* names[] = {"codes", "scales", "biases"};
  GVar vs[] = {wq, scales, biases ? *biases : wq};
  for (int i = 0; i < (biases ? 3 : 2); ++i)
    if (tp.requires_grad(vs[i]))
      fail(op, "the quantized weight's ", names[i], " ", tp.shape(vs[i]).str(),
           " cannot have a gradient: quantized weights are frozen buffers (train a LoRA over them, or dequantize)");
  auto part = [&](GVar v) { return QuantPart(tp.shape(v), tp.dtype(v)); };
  return check_quantized(part(wq), part(scales), biases ? part(*biases) : QuantPart(), q, op);
}

}  // namespace detail

/// x @ dequant(W)^T (transpose, MLX's default: W (N, K), a QuantizedLinear's weight) or
/// x @ dequant(W) (W (K, N)), for x (..., K) float32/float64; W as codes (u32), scales and
/// biases (affine; std::nullopt for the fp modes) in format q (mx.quantized_matmul). The scales may be
/// bfloat16/float16 beside a float32 x (widened). Gradient: x only.
template <class B>
GVar quantized_matmul(GTape<B>& tp, GVar x, GVar wq, GVar scales, std::optional<GVar> biases, Quant q,
                      bool transpose = true) {
  detail::require_float(tp, x, "quantized_matmul");
  const std::int64_t cols = detail::check_quantized_inputs(tp, wq, scales, biases, q, "quantized_matmul");
  const DType sd = tp.dtype(scales);
  if (q.mode == QuantMode::affine && sd != tp.dtype(x) && sd != DType::bf16 && sd != DType::f16)
    detail::fail("quantized_matmul", "scales of ", dtype_name(sd), " beside x of ", dtype_name(tp.dtype(x)),
                 ": they must match, or be bfloat16/float16");
  const Shape& xs = tp.shape(x);
  const std::int64_t rows = tp.shape(wq).dim(0), K = transpose ? cols : rows, N = transpose ? rows : cols;
  if (xs.rank() < 1 || xs.dim(-1) != K)
    detail::fail("quantized_matmul", "x ", xs.str(), " @ W", transpose ? "^T" : "", " with W (", rows, ", ", cols,
                 ") dequantized: inner dimensions differ (", xs.rank() ? xs.dim(-1) : 0, " vs ", K, ")");
  Shape out = xs;
  out[out.rank() - 1] = N;
  std::vector<GVar> in{x, wq, scales};
  if (biases) in.push_back(*biases);
  return tp.record(detail::QuantizedMatmulPrim<B>::def, in, QuantMatmulAttrs{q, transpose}, out, tp.dtype(x));
}

/// Rows `ids` (integer, any shape) of the quantized table W (V, D): out ids.shape + (D), in
/// `dtype` (float32 by default). No gradient flows (the table is frozen; ids are integers).
template <class B>
GVar quantized_gather(GTape<B>& tp, GVar ids, GVar wq, GVar scales, std::optional<GVar> biases, Quant q,
                      DType dtype = DType::f32) {
  detail::require_ids(tp, ids, "quantized_gather");
  const std::int64_t D = detail::check_quantized_inputs(tp, wq, scales, biases, q, "quantized_gather");
  if (dtype != DType::f32 && dtype != DType::f64)
    detail::fail("quantized_gather", "rows are float32 or float64, not ", dtype_name(dtype));
  Shape out = tp.shape(ids);
  out.push_back(D);
  std::vector<GVar> in{ids, wq, scales};
  if (biases) in.push_back(*biases);
  return tp.record(detail::QuantizedGatherPrim<B>::def, in, q, out, dtype);
}

}  // namespace nn
