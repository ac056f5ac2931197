// SPDX-License-Identifier: MIT OR Apache-2.0
// fused_attention: scaled dot-product attention with grouped-query sharing as one primitive, for
// speed and memory: it reads q, k, v in their projection layout (B, T, n * head_dim) (no head
// permutes), adds the mask and takes the softmax in place, and keeps only the probabilities for
// the vjp. Its composite reference is nn::reference::gqa_attention (layers/attention.hpp);
// tests/ops/fused.test.cpp checks that the two agree, values and gradients.
// flash_attention: the same math (without a mask tensor) tiled with an online softmax, so the
// (T, T) probabilities are never stored; tests/ops/fused.test.cpp checks it against both.
#pragma once

#include <cmath>

#include "common.hpp"

namespace nn {

namespace detail {

/// inputs: 0 q (B, T, H * hd), 1 k, 2 v (B, T, KV * hd) (or the same with B and T merged),
/// optionally 3 an additive mask broadcasting to (B, H, T, T) (no gradient). AttentionAttrs.
/// saved[0] = the probabilities (B, H, T, T); saved[1] = the vjp's scratch (B * KV, T, T).
template <class B>
struct AttentionPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    Tensor& p = tp.scratch(n, 0, Shape{a.B, a.H, a.T, a.T}, n.value.dtype());
    B::attention(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(), a, n.value, p);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    const auto g = tp.template grad_outs<3>(n);
    Tensor& scratch = tp.scratch(n, 1, Shape{a.B * a.KV, a.T, a.T}, n.value.dtype());
    B::attention_vjp(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.saved[0], n.grad, a, scratch, g[0], g[1], g[2]);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> AttentionPrim<B>::def{.prim = Prim::attention, .forward = &forward, .vjp = &vjp,
                                     .vjp_reads = &vjp_reads_fixed<B, 7u>};  // q, k, v and the saved probabilities

/// inputs: 0 q (B, T, H * hd), 1 k, 2 v (B, T, KV * hd), optionally 3 the document starts
/// (B, T) int32 of packed rows; AttentionAttrs (no mask).
/// saved[0] = the rows' log-sum-exp (B, H, T); saved[1] = the vjp's rowsum(g * out) (B, H, T).
/// The vjp reads the output (n.value), as the unary ops' vjps do.
template <class B>
struct FlashAttentionPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    Tensor& lse = tp.scratch(n, 0, Shape{a.B, a.H, a.T}, n.value.dtype());
    B::flash_attention(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), starts(tp, n), a, n.value, lse);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    const auto g = tp.template grad_outs<3>(n);
    Tensor& delta = tp.scratch(n, 1, Shape{a.B, a.H, a.T}, n.value.dtype());
    B::flash_attention_vjp(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), starts(tp, n), n.value, n.saved[0], n.grad, a, delta,
                           g[0], g[1], g[2]);
  }
  static Tensor starts(GTape<B>& tp, const Node<B>& n) { return n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(); }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> FlashAttentionPrim<B>::def{.prim = Prim::flash_attention, .forward = &forward, .vjp = &vjp,
                                          .vjp_reads = &vjp_reads_fixed<B, 15u | kVjpReadsOutput>};  // q, k, v, starts, out

/// The checks fused_attention and flash_attention share; returns B (q's rows / T).
template <class B>
std::int64_t check_attention(GTape<B>& tp, GVar q, GVar k, GVar v, std::int64_t T, std::int64_t n_heads,
                             std::int64_t n_kv_heads, std::int64_t head_dim, const char* op) {
  require_same_dtype(tp, q, k, op);
  require_same_dtype(tp, q, v, op);
  const Shape &qs = tp.shape(q), &ks = tp.shape(k), &vs = tp.shape(v);
  if (T <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads != 0)
    fail(op, "needs T, head_dim > 0 and n_heads a positive multiple of n_kv_heads, got T = ", T,
         ", n_heads = ", n_heads, ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  const bool ranks_ok = (qs.rank() == 2 || qs.rank() == 3) && ks.rank() == qs.rank() && vs.rank() == qs.rank();
  if (!ranks_ok || qs.dim(-1) != n_heads * head_dim || ks.dim(-1) != n_kv_heads * head_dim || !(ks == vs) ||
      (qs.rank() == 3 && qs[1] != T) || qs.prod(0, qs.rank() - 1) % T != 0 ||
      ks.prod(0, ks.rank() - 1) != qs.prod(0, qs.rank() - 1))
    fail(op, "q ", qs.str(), ", k ", ks.str(), ", v ", vs.str(), " do not fit T = ", T, ", n_heads = ", n_heads,
         ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  return qs.prod(0, qs.rank() - 1) / T;
}

/// gqa_attention runs flash_attention (when it has no mask tensor) from this context length on.
/// Below it the whole (T, T) tile is one or two GEMM blocks, and the probabilities kernel's
/// backward, which reads the stored softmax instead of recomputing q k^T, is faster
/// (bench_attention: 0.8-0.9x at T = 64, 1.1x at 128, 1.5-1.8x at 1024 and 4096).
inline constexpr std::int64_t kFlashMinT = 128;

/// True when backend B has the flash kernels (the CPU backend does; others run the
/// probabilities kernel instead).
template <class B>
concept HasFlashAttention = requires(const Tensor& x, Tensor& y, const AttentionAttrs& a, GradOut g) {
  B::flash_attention(x, x, x, x, a, y, y);                   // (q, k, v, starts, attrs, out, lse)
  B::flash_attention_vjp(x, x, x, x, x, x, x, a, y, g, g, g);  // (q, k, v, starts, out, lse, g, attrs, delta, gq, gk, gv)
};

}  // namespace detail

/// softmax(scale * q k^T + mask) v per query head, heads concatenated:
///   q: (B, T, n_heads * head_dim), k, v: (B, T, n_kv_heads * head_dim) (or rows (B*T, ...))
///   mask: additive, broadcasting to (B, n_heads, T, T) ((T, T) causal, (B, 1, T, T) causal +
///         padding); GVar{} for none. It gets no gradient.
///   causal: query i attends to keys 0..i only (on top of any mask), without a mask tensor, and
///         the kernels skip the products above the diagonal (about half the work).
///   -> q's shape. Query head h reads kv head h / (n_heads / n_kv_heads) (HF's repeat_kv).
/// RoPE, if any, is applied to q and k before (see gqa_attention).
template <class B>
GVar fused_attention(GTape<B>& tp, GVar q, GVar k, GVar v, GVar mask, std::int64_t T, std::int64_t n_heads,
                     std::int64_t n_kv_heads, std::int64_t head_dim, double scale, bool causal = false) {
  const char* op = "attention";
  const std::int64_t Bn = detail::check_attention(tp, q, k, v, T, n_heads, n_kv_heads, head_dim, op);
  const Shape& qs = tp.shape(q);
  const AttentionAttrs a{Bn, T, n_heads, n_kv_heads, head_dim, scale, causal};
  if (!mask.valid()) {
    GVar in[] = {q, k, v};
    return tp.record(detail::AttentionPrim<B>::def, in, a, qs, tp.dtype(q));
  }
  detail::require_same_dtype(tp, q, mask, op);
  const Shape& ms = tp.shape(mask);
  if (ms.rank() < 1 || ms.rank() > 4 || ms.dim(-1) != T || !detail::broadcasts_to(ms, Shape{Bn, n_heads, T, T}))
    detail::fail(op, "mask ", ms.str(), " does not broadcast against the scores (B, n_heads, T, T) = (", Bn, ", ",
                 n_heads, ", ", T, ", ", T, ")");
  if (tp.requires_grad(mask)) detail::fail(op, "the mask cannot require a gradient in the fused primitive");
  GVar in[] = {q, k, v, mask};
  return tp.record(detail::AttentionPrim<B>::def, in, a, qs, tp.dtype(q));
}

/// fused_attention without a mask tensor, as flash attention: the same values and gradients (up
/// to rounding), with O(T) memory in place of the (B, n_heads, T, T) probabilities and their vjp
/// scratch (B, n_kv_heads, T, T), which at T = 4096 is what decides whether a step fits.
///   q: (B, T, n_heads * head_dim), k, v: (B, T, n_kv_heads * head_dim) (or rows (B*T, ...))
///   causal: query i attends to keys 0..i only; the tiles above the diagonal are skipped.
///   starts (optional, causal only): (B, T) int32, packed rows' document starts -- query i sees
///         keys starts[b, i]..i only, so no token attends across a document boundary; each row
///         is whole documents (starts[b, i] is starts[b, i - 1] or i, checked), and the tiles
///         before a block's documents are skipped. It gets no gradient.
///   window (causal only; 0: none): query i sees keys i - window < j <= i only (transformers'
///         sliding-window causal mask, Gemma 2's even layers, Mistral, Phi-3); the key tiles
///         before a block's window are skipped, so the work grows as T * window, not T^2 / 2.
///   softcap (0: none): the scores scale q k^T are capped to softcap * tanh(s / softcap) before
///         the softmax (Gemma 2's attn_logit_softcapping), as nn::softcap written out would.
///   -> q's shape.
/// The backward recomputes each tile's probabilities from the saved log-sum-exp: one more
/// q k^T product per tile, in exchange for never reading a (T, T) buffer.
template <class B>
  requires detail::HasFlashAttention<B>
GVar flash_attention(GTape<B>& tp, GVar q, GVar k, GVar v, std::int64_t T, std::int64_t n_heads,
                     std::int64_t n_kv_heads, std::int64_t head_dim, double scale, bool causal = false,
                     GVar starts = GVar{}, std::int64_t window = 0, double softcap = 0) {
  const char* op = "flash_attention";
  const std::int64_t Bn = detail::check_attention(tp, q, k, v, T, n_heads, n_kv_heads, head_dim, op);
  const Shape& qs = tp.shape(q);
  if (window < 0 || (window > 0 && !causal))
    detail::fail(op, "a sliding window needs causal attention and window >= 0 (0: none), got window = ", window,
                 causal ? "" : " without causal");
  if (!(softcap >= 0) || !std::isfinite(softcap))
    detail::fail(op, "softcap must be finite and >= 0 (0: none), got ", softcap);
  const AttentionAttrs a{Bn, T, n_heads, n_kv_heads, head_dim, scale, causal, window, softcap};
  if (!starts.valid()) {
    GVar in[] = {q, k, v};
    return tp.record(detail::FlashAttentionPrim<B>::def, in, a, qs, tp.dtype(q));
  }
  if (!causal) detail::fail(op, "document starts need causal attention");
  if (tp.dtype(starts) != DType::i32 || !(tp.shape(starts) == Shape{Bn, T}))
    detail::fail(op, "document starts must be (B, T) = (", Bn, ", ", T, ") int32, got ", tp.shape(starts).str(), " ",
                 dtype_name(tp.dtype(starts)));
  GVar in[] = {q, k, v, starts};
  return tp.record(detail::FlashAttentionPrim<B>::def, in, a, qs, tp.dtype(q));
}

}  // namespace nn
