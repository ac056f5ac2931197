// SPDX-License-Identifier: MIT OR Apache-2.0
// Linear, LoRA- and DoRA-adapted linear layers, weights laid out as PyTorch, MLX and Hugging Face store
// them: weight (out, in), so y = x W^T + b (torch.nn.Linear, mlx.nn.Linear).
#pragma once

#include <utility>

#include "../ops/elementwise.hpp"
#include "../ops/matmul.hpp"
#include "../ops/reduce.hpp"
#include "../ops/shape.hpp"
#include "helpers.hpp"

namespace nn {

namespace detail {

template <class B>
void check_linear(const GTape<B>& tp, GVar x, GVar w, const char* layer) {
  if (!bf16_weight(tp, x, w, layer)) layer_same_dtype(tp, x, w, layer, "x", "weight");
  const Shape &xs = tp.shape(x), &ws = tp.shape(w);
  if (ws.rank() != 2) fail(layer, "weight must be (out, in), got ", ws.str(), " (x ", xs.str(), ")");
  if (xs.rank() < 1 || xs.dim(-1) != ws[1])
    fail(layer, "x ", xs.str(), " does not match weight ", ws.str(), ": x's last dim must equal in = ", ws[1]);
}

template <class B>
void check_bias(const GTape<B>& tp, GVar w, GVar b, const char* layer) {
  if (tp.dtype(w) == DType::bf16) layer_float(tp, b, layer, "bias");  // a bf16 weight's bias stays f32
  else layer_same_dtype(tp, w, b, layer, "weight", "bias");
  const Shape &ws = tp.shape(w), &bs = tp.shape(b);
  if (bs.rank() != 1 || bs[0] != ws[0])
    fail(layer, "bias ", bs.str(), " does not match weight ", ws.str(), ": bias must be (out) = (", ws[0], ")");
}

}  // namespace detail

/// y = x W^T.  x: (..., in), w: (out, in) -> y: (..., out).
/// The transpose is matmul's trans_b flag (read transposed, never copied), and a batched x folds
/// into one GEMM against the shared weight.
template <class B>
GVar linear(GTape<B>& tp, GVar x, GVar w) {
  detail::check_linear(tp, x, w, "linear");
  if (tp.shape(x).rank() == 1) {  // a single vector: (in) -> (out)
    GVar y = matmul(tp, detail::view(tp, x, Shape{1, tp.shape(x)[0]}), w, false, true);
    return detail::view(tp, y, Shape{tp.shape(w)[0]});
  }
  return matmul(tp, x, w, false, true);
}

/// y = x W^T + b.  x: (..., in), w: (out, in), b: (out) -> y: (..., out).
template <class B>
GVar linear(GTape<B>& tp, GVar x, GVar w, GVar b) {
  detail::check_linear(tp, x, w, "linear");
  detail::check_bias(tp, w, b, "linear");
  return add(tp, linear(tp, x, w), b);
}

namespace detail {

template <class B>
void check_lora(const GTape<B>& tp, GVar x, GVar w0, GVar a, GVar b, const char* layer) {
  check_linear(tp, x, w0, layer);
  layer_same_dtype(tp, x, a, layer, "x", "lora_a");
  layer_same_dtype(tp, x, b, layer, "x", "lora_b");
  const Shape &ws = tp.shape(w0), &as = tp.shape(a), &bs = tp.shape(b);
  if (as.rank() != 2 || bs.rank() != 2 || as[0] != ws[1] || bs[1] != ws[0] || as[1] != bs[0])
    fail(layer, "adapters a ", as.str(), " and b ", bs.str(), " do not fit weight ", ws.str(),
         ": expected a (in, r) = (", ws[1], ", r) and b (r, out) = (r, ", ws[0], ") (mlx-lm orientation)");
}

/// x M for a matrix M stored (in, out), x of any rank >= 1.
template <class B>
GVar right_mul(GTape<B>& tp, GVar x, GVar m) {
  if (tp.shape(x).rank() == 1) {
    GVar y = matmul(tp, view(tp, x, Shape{1, tp.shape(x)[0]}), m);
    return view(tp, y, Shape{tp.shape(m)[1]});
  }
  return matmul(tp, x, m);
}

/// scale * (x A) B, the adapter branch. The scale is applied to the (..., r) intermediate:
/// the same product as mlx-lm's scale * ((x A) B), on r columns instead of out.
template <class B>
GVar lora_branch(GTape<B>& tp, GVar x, GVar a, GVar b, double scale) {
  GVar xa = right_mul(tp, x, a);
  if (scale != 1.0) xa = nn::scale(tp, xa, scale);
  return right_mul(tp, xa, b);
}

}  // namespace detail

/// y = x W0^T + scale (x A) B: a frozen base weight plus a low-rank update (Hu et al. 2021,
/// "LoRA"; mlx-lm tuner/lora.py LoRALinear, whose orientation this follows).
/// x: (..., in), w0: (out, in), a: (in, r), b: (r, out) -> y: (..., out).
/// `scale` multiplies the update as given (mlx-lm's `scale`; PEFT's is lora_alpha / r).
template <class B>
GVar lora_linear(GTape<B>& tp, GVar x, GVar w0, GVar a, GVar b, double scale) {
  detail::check_lora(tp, x, w0, a, b, "lora_linear");
  return add(tp, linear(tp, x, w0), detail::lora_branch(tp, x, a, b, scale));
}

/// y = x W0^T + b0 + scale (x A) B (a base layer with a bias, e.g. Qwen2's q/k/v projections).
/// bias0: (out).
template <class B>
GVar lora_linear(GTape<B>& tp, GVar x, GVar w0, GVar bias0, GVar a, GVar b, double scale) {
  detail::check_lora(tp, x, w0, a, b, "lora_linear");
  detail::check_bias(tp, w0, bias0, "lora_linear");
  return add(tp, linear(tp, x, w0, bias0), detail::lora_branch(tp, x, a, b, scale));
}

namespace detail {

/// The squared norms of a dense weight's rows, summed in double, stored in dtype dt (a host
/// tensor). w: (out, in) -> (out)
inline Tensor row_squares(const Tensor& weight, DType dt) {
  const Tensor w = weight.to(Device::cpu);
  Tensor out = Tensor::zeros(Shape{w.dim(0)}, dt);
  for (std::int64_t i = 0; i < w.dim(0); ++i) {
    double n2 = 0;
    for (std::int64_t j = 0; j < w.dim(1); ++j) {
      const double v = load_as_double(w.raw(), w.dtype(), i * w.dim(1) + j);
      n2 += v * v;
    }
    store_from_double(out.raw(), dt, i, n2);
  }
  return out;
}

/// What DoRA's norm reads of a full-precision base weight: its rows' squared norms (out) and
/// W A (out, r), the latter as (A^T W^T)^T through linear, so a bfloat16 weight (set_precision)
/// is read as linear reads it. A bfloat16 weight is frozen by construction: its squared norms are
/// a constant of the recording. w0: (out, in), a: (in, r).
template <class B>
std::pair<GVar, GVar> dora_weight_terms(GTape<B>& tp, GVar w0, GVar a) {
  GVar w_sq = tp.dtype(w0) == DType::bf16 ? tp.constant(row_squares(tp.value(w0), tp.dtype(a)).to(B::device))
                                          : sum(tp, mul(tp, w0, w0), {1});
  return {w_sq, transpose(tp, linear(tp, transpose(tp, a), w0))};
}

}  // namespace detail

/// DoRA's per-output-row factor m / ||W + scale (A B)^T||_row (Liu et al. 2024, "DoRA"; mlx-lm
/// tuner/dora.py DoRALinear; PEFT's use_dora), the norm detached (stop_gradient) as both do,
/// following the paper's section 4.3: m gets its gradient here, A and B only through the branch
/// this factor multiplies. The squared row norm is expanded,
///   ||W_i + s (A B)^T_i||^2 = ||W_i||^2 + 2 s (W A)_i . B_{:,i} + s^2 (B^T (A^T A))_i . B_{:,i},
/// so W enters only as its rows' squared norms and the product W A (r columns): a quantized W is
/// multiplied, never dequantized whole, and no (out, in) temporary is made.
/// w_sq: (out) sums of squares of W's rows, wa: (out, r) = W A, a: (in, r), b: (r, out),
/// m: (out) -> (out).
template <class B>
GVar dora_factor(GTape<B>& tp, GVar w_sq, GVar wa, GVar a, GVar b, GVar m, double scale) {
  GVar bt = transpose(tp, b);                                            // (out, r)
  GVar cross = sum(tp, mul(tp, wa, bt), {1});                            // (out)
  GVar ata = matmul(tp, a, a, true, false);                              // (r, r)
  GVar quad = sum(tp, mul(tp, matmul(tp, bt, ata), bt), {1});            // (out)
  GVar n2 = add(tp, add(tp, w_sq, nn::scale(tp, cross, 2 * scale)), nn::scale(tp, quad, scale * scale));
  return mul(tp, m, stop_gradient(tp, rsqrt(tp, n2)));
}

/// y = m / ||W0 + scale (A B)^T||_row * (x W0^T + scale (x A) B) [+ b0]: DoRA over a full-precision
/// weight (mlx-lm DoRALinear's forward; the bias is added after the rescale, as there and in
/// PEFT). x: (..., in), w0: (out, in), a: (in, r), b: (r, out), m: (out) -> y: (..., out).
template <class B>
GVar dora_linear(GTape<B>& tp, GVar x, GVar w0, GVar a, GVar b, GVar m, double scale) {
  detail::check_lora(tp, x, w0, a, b, "dora_linear");
  if (tp.shape(m) != Shape{tp.shape(w0)[0]})
    detail::fail("dora_linear", "magnitude m ", tp.shape(m).str(), " does not match weight ", tp.shape(w0).str(),
                 ": m must be (out) = (", tp.shape(w0)[0], ")");
  const auto [w_sq, wa] = detail::dora_weight_terms(tp, w0, a);
  return mul(tp, lora_linear(tp, x, w0, a, b, scale), dora_factor(tp, w_sq, wa, a, b, m, scale));
}

/// The same with the base's bias b0: (out), added after the rescale.
template <class B>
GVar dora_linear(GTape<B>& tp, GVar x, GVar w0, GVar bias0, GVar a, GVar b, GVar m, double scale) {
  detail::check_bias(tp, w0, bias0, "dora_linear");
  return add(tp, dora_linear(tp, x, w0, a, b, m, scale), bias0);
}

}  // namespace nn
