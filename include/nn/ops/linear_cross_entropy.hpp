// SPDX-License-Identifier: MIT OR Apache-2.0
// linear_cross_entropy: an LM head's product and the softmax cross-entropy over its logits as one
// primitive, so the (rows, vocab) logits are never stored (SmolLM2's 49152-wide head over 256
// tokens: 50 MB of logits, and as much again for their gradient in an unplanned step). The
// kernel (backend/cpu/linear_cross_entropy.hpp) walks the vocabulary in blocks with an online
// softmax, as flash attention walks keys, and skips rows that carry no loss (ignored targets,
// keep = 0: a prompt under --mask-prompt). When a backward pass is planned (a compiled step),
// the forward also forms d loss / d x in the same pass, so the step runs the same two products
// per block as logits + their gradient; otherwise the vjp computes it by the same pass.
// Its composite reference is cross_entropy(x @ W^T, targets[, keep]); tests/ops/
// linear_cross_entropy.test.cpp and the op registry check the two agree.
#pragma once

#include <optional>

#include "cross_entropy.hpp"
#include "quantized.hpp"

namespace nn {

/// An LM head as linear_cross_entropy reads it: a dense weight w (V, C) (nn.Linear's layout; a
/// tied embedding's table), or a quantized one (codes, scales, biases in format q). No bias.
struct HeadVars {
  GVar w;
  GVar codes, scales;
  std::optional<GVar> biases;
  Quant q;

  HeadVars() = default;
  explicit HeadVars(GVar weight) : w(weight) {}
  HeadVars(GVar c, GVar s, std::optional<GVar> b, Quant quant) : codes(c), scales(s), biases(b), q(quant) {}
  bool quantized() const { return codes.valid(); }
};

namespace detail {

/// True when backend B has the fused kernels (the CPU backend does; elsewhere the layer runs the
/// head's product and cross_entropy as two ops).
template <class B>
concept HasLinearCrossEntropy = requires(const Tensor& x, Tensor& y, const HeadWeight& w,
                                         const LinearCrossEntropyAttrs& a, GradOut g) {
  B::linear_cross_entropy(x, w, x, x, a, y, y, y, &y);  // (x, head, targets, keep, attrs, loss, lse, work, dx)
  B::linear_cross_entropy_vjp(x, w, x, x, a, x, y, true, x, y, g, g);  // (..., lse, dx, dx_fresh, g, work, gx, gw)
  { B::linear_cross_entropy_workspace(1, 1, 1, DType::f32) } -> std::convertible_to<std::size_t>;
};

/// inputs: 0 x (..., C), 1 targets (...) integer, [2 keep (...) float, when has_keep], then the
/// head: w (V, C), or codes, scales[, biases]. out: () the summed or mean loss.
/// saved[0] lse per row, saved[1] the kernels' workspace, saved[2] d loss / d x when the forward
/// computed it (a backward pass follows: GTape::backward_follows), absent otherwise.
template <class B>
struct LinearCrossEntropyPrim {
  static const LinearCrossEntropyAttrs& attrs(const Node<B>& n) { return attrs_of<LinearCrossEntropyAttrs>(n); }
  static std::size_t head_at(const Node<B>& n) { return attrs(n).has_keep ? 3 : 2; }
  static HeadWeight head(const GTape<B>& tp, const Node<B>& n) {
    const std::size_t h = head_at(n);
    HeadWeight w;
    if (!attrs(n).quantized) {
      w.w = tp.in(n, h);
      return w;
    }
    w.codes = tp.in(n, h);
    w.scales = tp.in(n, h + 1);
    if (n.inputs.size() > h + 2) w.biases = tp.in(n, h + 2);
    w.q = attrs(n).head.q;
    return w;
  }
  static Tensor keep(const GTape<B>& tp, const Node<B>& n) { return attrs(n).has_keep ? tp.in(n, 2) : Tensor(); }
  static bool head_needs_grad(const GTape<B>& tp, const Node<B>& n) {
    return !attrs(n).quantized && tp.needs_grad(n, head_at(n));
  }
  // The gradient is formed in the forward when only x wants one and a backward pass follows.
  static bool dx_in_forward(const GTape<B>& tp, const Node<B>& n) {
    return tp.backward_follows(n) && tp.needs_grad(n, 0) && !head_needs_grad(tp, n);
  }
  static Tensor rows(const Tensor& x) { return x.reshape(Shape{x.numel() / x.dim(-1), x.dim(-1)}); }
  static Tensor& work(GTape<B>& tp, Node<B>& n, const Tensor& x) {
    const std::size_t bytes = B::linear_cross_entropy_workspace(x.dim(0), x.dim(1), head(tp, n).rows(), x.dtype());
    return tp.scratch(n, 1, Shape{static_cast<std::int64_t>(bytes)}, DType::u8);
  }

  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor x = rows(tp.in(n, 0));
    // the highest slot first: a later scratch() never resizes n.saved under a reference taken
    const bool want = dx_in_forward(tp, n);
    if (want) tp.scratch(n, 2, x.shape(), x.dtype());
    else if (n.saved.size() > 2) n.saved.resize(2);  // an older gradient no longer matches
    work(tp, n, x);
    tp.scratch(n, 0, Shape{x.dim(0)}, x.dtype());
    B::linear_cross_entropy(x, head(tp, n), tp.in(n, 1), keep(tp, n), attrs(n), n.value, n.saved[0], n.saved[1],
                            want ? &n.saved[2] : nullptr);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const bool want_w = head_needs_grad(tp, n);
    if (!tp.needs_grad(n, 0) && !want_w) return;
    const Tensor x = rows(tp.in(n, 0));
    const bool fresh = n.saved.size() > 2 && n.saved[2].defined();
    Tensor none;  // a trainable head's pass forms x's gradient itself
    Tensor& dx = want_w ? none : tp.scratch(n, 2, x.shape(), x.dtype());  // slot 2 before slot 1 (above)
    Tensor& ws = work(tp, n, x);
    const auto g = tp.template grad_outs<6>(n);
    B::linear_cross_entropy_vjp(x, head(tp, n), tp.in(n, 1), keep(tp, n), attrs(n), n.saved[0], dx, fresh, n.grad, ws,
                                g[0], want_w ? g[head_at(n)] : GradOut{});
  }
  // With the gradient formed in the forward, the vjp reads only its saved buffers; else it
  // reruns the pass over every input.
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    return dx_in_forward(tp, n) ? 0u : (1u << n.inputs.size()) - 1u;
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> LinearCrossEntropyPrim<B>::def{.prim = Prim::linear_cross_entropy, .forward = &forward, .vjp = &vjp,
                                              .vjp_reads = &vjp_reads};

}  // namespace detail

/// The fused primitive (backends with detail::HasLinearCrossEntropy; see linear_cross_entropy
/// in layers/loss.hpp for the form that runs everywhere):
///   x: (..., C) float, head: (V, C), targets: (...) integer, keep: (...) x's dtype or GVar{}
///   -> () = sum_r c_r (lse(x_r W^T) - (x_r W^T)[t_r]), divided by sum_r c_r for the mean,
/// where c_r = keep_r (1 without keep) and 0 where t_r == ignore_index; without keep the mean is
/// over the targets not ignored (PyTorch's rule), with keep it is sum(keep * loss) / sum(keep)
/// (mlx-lm's length mask). Gradients: x, and a dense head's weight; keep takes none.
template <class B>
  requires detail::HasLinearCrossEntropy<B>
GVar fused_linear_cross_entropy(GTape<B>& tp, GVar x, const HeadVars& head, GVar targets, GVar keep = {},
                                Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  const char* op = "linear_cross_entropy";
  detail::require_float(tp, x, op);
  detail::require_ids(tp, targets, op);
  const Shape& xs = tp.shape(x);
  const Shape& ts = tp.shape(targets);
  if (reduction == Reduction::none)
    detail::fail(op, "returns a summed or mean loss; per-row losses need cross_entropy over the logits");
  Shape lead;
  for (int i = 0; i + 1 < xs.rank(); ++i) lead.push_back(xs[i]);
  if (xs.rank() < 1 || xs.dim(-1) == 0 || !(ts == lead))
    detail::fail(op, "x ", xs.str(), " and targets ", ts.str(),
                 " do not fit: expected x (..., C) and targets (...) of x's leading dims");
  LinearCrossEntropyAttrs a;
  a.ce = {ignore_index, reduction};
  std::vector<GVar> in{x, targets};
  if (keep.valid()) {
    detail::require_same_dtype(tp, x, keep, op);
    if (!(tp.shape(keep) == ts))
      detail::fail(op, "keep ", tp.shape(keep).str(), " must have the targets' shape ", ts.str());
    if (tp.requires_grad(keep)) detail::fail(op, "keep (the rows' weights) cannot require a gradient here");
    a.has_keep = true;
    in.push_back(keep);
  }
  std::int64_t V = 0, C = 0;
  if (head.quantized()) {
    C = detail::check_quantized_inputs(tp, head.codes, head.scales, head.biases, head.q, op);
    V = tp.shape(head.codes).dim(0);
    const DType sd = tp.dtype(head.scales);
    if (head.q.mode == QuantMode::affine && sd != tp.dtype(x) && sd != DType::bf16 && sd != DType::f16)
      detail::fail(op, "scales of ", dtype_name(sd), " beside x of ", dtype_name(tp.dtype(x)),
                   ": they must match, or be bfloat16/float16");
    a.quantized = true;
    a.head = {head.q, true};
    in.push_back(head.codes);
    in.push_back(head.scales);
    if (head.biases) in.push_back(*head.biases);
  } else {
    detail::require_same_dtype(tp, x, head.w, op);
    const Shape& ws = tp.shape(head.w);
    if (ws.rank() != 2) detail::fail(op, "the head's weight must be (V, C), got ", ws.str());
    V = ws[0];
    C = ws[1];
    in.push_back(head.w);
  }
  if (C != xs.dim(-1) || V == 0)
    detail::fail(op, "x ", xs.str(), " @ W^T with W (", V, ", ", C, "): inner dimensions differ (", xs.dim(-1), " vs ",
                 C, ")");
  return tp.record(detail::LinearCrossEntropyPrim<B>::def, in, a, Shape{}, tp.dtype(x));
}

}  // namespace nn
