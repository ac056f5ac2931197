// SPDX-License-Identifier: MIT OR Apache-2.0
// fused_attention: scaled dot-product attention with grouped-query sharing as one primitive, for
// speed and memory: it reads q, k, v in their projection layout (B, T, n * head_dim) (no head
// permutes), adds the mask and takes the softmax in place, and keeps only the probabilities for
// the vjp. Its composite reference is nn::reference::gqa_attention (layers/attention.hpp);
// tests/ops/fused.test.cpp checks that the two agree, values and gradients.
#pragma once

#include "common.hpp"

namespace nn {

namespace detail {

/// inputs: 0 q (B, T, H * hd), 1 k, 2 v (B, T, KV * hd) (or the same with B and T merged),
/// optionally 3 an additive mask broadcasting to (B, H, T, T) (no gradient).
/// attrs.shape = (B, T, H, KV, hd), attrs.scalar = the score scale, attrs.flag_a = causal.
/// saved[0] = the probabilities (B, H, T, T); saved[1] = the vjp's scratch (B * KV, T, T).
template <class B>
struct AttentionPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Shape& d = n.attrs.shape;
    Tensor& p = tp.scratch(n, 0, Shape{d[0], d[2], d[1], d[1]}, n.value.dtype());
    B::attention(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(), d[0], d[1], d[2],
                 d[3], d[4], n.attrs.scalar, n.value, p, n.attrs.flag_a);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const Shape& d = n.attrs.shape;
    Tensor* g[3] = {nullptr, nullptr, nullptr};
    bool acc[3] = {false, false, false};
    for (std::size_t k = 0; k < 3; ++k) {
      if (!tp.needs_grad(n, k)) continue;
      GradSlot s = tp.grad_slot(n, k);
      g[k] = &s.g;
      acc[k] = s.acc;
    }
    Tensor& scratch = tp.scratch(n, 1, Shape{d[0] * d[3], d[1], d[1]}, n.value.dtype());
    B::attention_vjp(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.saved[0], n.grad, d[0], d[1], d[2], d[3], d[4],
                     n.attrs.scalar, scratch, g[0], acc[0], g[1], acc[1], g[2], acc[2], n.attrs.flag_a);
  }
  static constexpr OpDef<B> def{"attention", &forward, &vjp};
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
  detail::require_same_dtype(tp, q, k, op);
  detail::require_same_dtype(tp, q, v, op);
  const Shape &qs = tp.shape(q), &ks = tp.shape(k), &vs = tp.shape(v);
  if (T <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads != 0)
    detail::fail(op, "needs T, head_dim > 0 and n_heads a positive multiple of n_kv_heads, got T = ", T,
                 ", n_heads = ", n_heads, ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  const bool ranks_ok = (qs.rank() == 2 || qs.rank() == 3) && ks.rank() == qs.rank() && vs.rank() == qs.rank();
  if (!ranks_ok || qs.dim(-1) != n_heads * head_dim || ks.dim(-1) != n_kv_heads * head_dim || !(ks == vs) ||
      (qs.rank() == 3 && qs[1] != T) || qs.prod(0, qs.rank() - 1) % T != 0 ||
      ks.prod(0, ks.rank() - 1) != qs.prod(0, qs.rank() - 1))
    detail::fail(op, "q ", qs.str(), ", k ", ks.str(), ", v ", vs.str(), " do not fit T = ", T, ", n_heads = ", n_heads,
                 ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  const std::int64_t Bn = qs.prod(0, qs.rank() - 1) / T;
  Attrs a;
  a.shape = Shape{Bn, T, n_heads, n_kv_heads, head_dim};
  a.scalar = scale;
  a.flag_a = causal;
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

}  // namespace nn
