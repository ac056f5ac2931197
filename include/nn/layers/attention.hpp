// SPDX-License-Identifier: MIT OR Apache-2.0
// Multi-head attention with grouped-query sharing (Vaswani et al. 2017; Ainslie et al. 2023,
// "GQA"), as HF's LlamaAttention / Qwen2Attention compute it: per-head RoPE, scaled scores, an
// additive mask, softmax, weighted sum of values, heads concatenated.
#pragma once

#include "../ops/attention.hpp"
#include "../ops/matmul.hpp"
#include "../ops/softmax.hpp"
#include "activations.hpp"
#include "mask.hpp"
#include "rope.hpp"

namespace nn {

/// Head h's slice of a packed projection.  x: (..., n * head_dim) -> (..., head_dim).
template <class B>
GVar head(GTape<B>& tp, GVar x, std::int64_t h, std::int64_t head_dim) {
  const Shape& xs = tp.shape(x);
  if (xs.rank() < 1 || head_dim <= 0 || xs.dim(-1) % head_dim != 0)
    detail::fail("head", "x ", xs.str(), " is not a whole number of heads of size ", head_dim);
  const std::int64_t n = xs.dim(-1) / head_dim;
  if (h < 0 || h >= n) detail::fail("head", "head ", h, " out of range: x ", xs.str(), " holds ", n, " heads of size ", head_dim);
  return slice(tp, x, -1, h * head_dim, (h + 1) * head_dim);
}

namespace detail {

/// Checks that a mask broadcasts against the scores (B, n_heads, T, T) (left-padded with 1s as
/// NumPy broadcasting does; its last dim must be T).
template <class B>
void check_gqa_mask(const GTape<B>& tp, GVar mask, std::int64_t Bn, std::int64_t T, std::int64_t nh) {
  const Shape& ms = tp.shape(mask);
  if (ms.rank() < 1 || ms.rank() > 4 || ms.dim(-1) != T || !broadcasts_to(ms, Shape{Bn, nh, T, T}))
    fail("gqa_attention", "mask ", ms.str(), " does not broadcast against the scores (B, n_heads, T, T) = (", Bn,
         ", ", nh, ", ", T, ", ", T, ")");
}

/// The mask as a rank-5 view that broadcasts against the grouped scores (B, n_kv, group, T, T):
/// a mask of (B | 1, n_heads | 1, T | 1, T), left-padded with 1s as NumPy broadcasting does.
template <class B>
GVar grouped_mask(GTape<B>& tp, GVar mask, std::int64_t Bn, std::int64_t T, std::int64_t nh, std::int64_t nkv) {
  check_gqa_mask(tp, mask, Bn, T, nh);
  const Shape& ms = tp.shape(mask);
  std::int64_t d[4] = {1, 1, 1, 1};
  for (int i = 0; i < ms.rank(); ++i) d[4 - ms.rank() + i] = ms[i];
  const bool per_head = d[1] == nh && nh > 1;
  return view(tp, mask, Shape{d[0], per_head ? nkv : 1, per_head ? nh / nkv : 1, d[2], d[3]});
}

/// gqa_attention's argument checks; returns B (the batch: q's rows / T).
template <class B>
std::int64_t check_gqa(const GTape<B>& tp, GVar q, GVar k, GVar v, std::int64_t T, std::int64_t n_heads,
                       std::int64_t n_kv_heads, std::int64_t head_dim) {
  const char* L = "gqa_attention";
  layer_same_dtype(tp, q, k, L, "q", "k");
  layer_same_dtype(tp, q, v, L, "q", "v");
  if (T <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads != 0)
    fail(L, "needs T, head_dim > 0 and n_heads a positive multiple of n_kv_heads, got T = ", T,
         ", n_heads = ", n_heads, ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  const Shape &qs = tp.shape(q), &ks = tp.shape(k), &vs = tp.shape(v);
  const std::int64_t qc = n_heads * head_dim, kc = n_kv_heads * head_dim;
  const bool ranks_ok = (qs.rank() == 2 || qs.rank() == 3) && ks.rank() == qs.rank() && vs.rank() == qs.rank();
  if (!ranks_ok || qs.dim(-1) != qc || ks.dim(-1) != kc || vs.dim(-1) != kc ||
      (qs.rank() == 3 && qs[1] != T) || qs.prod(0, qs.rank() - 1) % T != 0 ||
      ks.prod(0, ks.rank() - 1) != qs.prod(0, qs.rank() - 1) || !(ks == vs))
    fail(L, "q ", qs.str(), ", k ", ks.str(), ", v ", vs.str(), " do not fit T = ", T, ", n_heads = ", n_heads,
         ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim, ": expected q (B, T, ", qc,
         ") and k, v (B, T, ", kc, ") (or rows B*T)");
  return qs.prod(0, qs.rank() - 1) / T;
}

/// gqa_attention's RoPE table checks (both tables or neither; (T, dims/2), dims <= head_dim).
template <class B>
void check_gqa_rope(const GTape<B>& tp, GVar k, GVar cos, GVar sin, std::int64_t Bn, std::int64_t T,
                    std::int64_t nkv, std::int64_t hd) {
  const char* L = "gqa_attention";
  if (!cos.valid() || !sin.valid()) fail(L, "pass both cos and sin, or neither");
  layer_same_dtype(tp, k, cos, L, "x", "cos");
  layer_same_dtype(tp, k, sin, L, "x", "sin");
  const Shape &cs = tp.shape(cos), &ss = tp.shape(sin);
  if (!(cs == ss)) fail(L, "cos ", cs.str(), " and sin ", ss.str(), " must have the same shape");
  if (cs.rank() != 2 || (cs[0] != T && cs[0] != Bn * T))
    fail(L, "cos/sin must be (T, dims/2) with T = ", T, " (or per token, (B * T, dims/2)), got ", cs.str());
  if (2 * cs[1] > hd)
    fail(L, "cos/sin ", cs.str(), " rotate ", 2 * cs[1], " features but a head has only ", hd,
         " (k as heads: (", Bn, ", ", nkv, ", ", T, ", ", hd, "))");
}

}  // namespace detail

namespace reference {

/// Grouped-query attention composed from primitives (permutes, RoPE, batched matmuls, softmax):
/// the reference the fused primitive is tested against, and the path when the tables or the mask
/// need a gradient. The contract is nn::gqa_attention's (below). q is viewed as
/// (B, n_kv, group, T, head_dim) and merged to (B, n_kv, group*T, head_dim), so one batched
/// matmul per kv head serves its whole group: K and V are never repeated, and their gradients
/// sum over the group inside that matmul's vjp. `scale` multiplies q after RoPE — the same
/// product as scaling the scores, on head_dim columns instead of T. `softcap` > 0 caps the
/// scaled scores (nn::softcap) before the mask is added, as transformers' Gemma 2.
template <class B>
GVar gqa_attention(GTape<B>& tp, GVar q, GVar k, GVar v, GVar cos, GVar sin, GVar mask, std::int64_t T,
                   std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, double scale,
                   bool traditional = false, double softcap = 0) {
  const Shape qs = tp.shape(q);  // a copy: used after recording
  const std::int64_t Bn = detail::check_gqa(tp, q, k, v, T, n_heads, n_kv_heads, head_dim);
  const std::int64_t nkv = n_kv_heads, g = n_heads / n_kv_heads, hd = head_dim;
  GVar qh = permute(tp, detail::view(tp, q, Shape{Bn, T, nkv, g, hd}), {0, 2, 3, 1, 4});  // (B, nkv, g, T, hd)
  GVar kh = permute(tp, detail::view(tp, k, Shape{Bn, T, nkv, hd}), {0, 2, 1, 3});        // (B, nkv, T, hd)
  GVar vh = permute(tp, detail::view(tp, v, Shape{Bn, T, nkv, hd}), {0, 2, 1, 3});        // (B, nkv, T, hd)
  if (cos.valid() || sin.valid()) {
    detail::check_gqa_rope(tp, k, cos, sin, Bn, T, nkv, hd);
    qh = reference::rope(tp, qh, cos, sin, traditional);
    kh = reference::rope(tp, kh, cos, sin, traditional);
  }
  qh = nn::scale(tp, qh, scale);
  GVar scores = matmul(tp, detail::view(tp, qh, Shape{Bn, nkv, g * T, hd}), kh, false, true);  // (B, nkv, g*T, T)
  if (softcap > 0) scores = nn::softcap(tp, scores, softcap);
  if (mask.valid()) {
    detail::layer_same_dtype(tp, q, mask, "gqa_attention", "q", "mask");
    GVar m = detail::grouped_mask(tp, mask, Bn, T, n_heads, nkv);
    scores = add(tp, detail::view(tp, scores, Shape{Bn, nkv, g, T, T}), m);  // (B, nkv, g, T, T)
  }
  GVar p = softmax(tp, scores);
  GVar ctx = matmul(tp, detail::view(tp, p, Shape{Bn, nkv, g * T, T}), vh);  // (B, nkv, g*T, hd)
  ctx = permute(tp, detail::view(tp, ctx, Shape{Bn, nkv, g, T, hd}), {0, 3, 1, 2, 4});  // (B, T, nkv, g, hd)
  return detail::view(tp, ctx, qs);
}

}  // namespace reference

namespace detail {

/// gqa_attention's body: causal adds the causal structure (fused) or mask (composite); a window
/// or a soft cap runs flash attention.
template <class B>
GVar gqa_attention(GTape<B>& tp, GVar q, GVar k, GVar v, GVar cos, GVar sin, GVar mask, bool causal, std::int64_t T,
                   std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, double scale,
                   bool traditional, GVar starts = GVar{}, std::int64_t window = 0, double softcap = 0) {
  const Shape qs = tp.shape(q), ks = tp.shape(k);  // copies: used after recording
  const std::int64_t Bn = detail::check_gqa(tp, q, k, v, T, n_heads, n_kv_heads, head_dim);
  const bool roped = cos.valid() || sin.valid();
  if (roped) detail::check_gqa_rope(tp, k, cos, sin, Bn, T, n_kv_heads, head_dim);
  // per-token tables (B * T, dims/2): positions that restart inside a row (packed documents)
  const bool per_token = roped && Bn > 1 && tp.shape(cos)[0] == Bn * T;
  if (starts.valid()) {
    if (!causal || mask.valid()) fail("gqa_attention", "doc_starts need causal attention without a mask tensor");
    if constexpr (!detail::HasFlashAttention<B>)
      fail("gqa_attention", "doc_starts (packed rows) need flash attention, which the ", B::name, " backend lacks");
  }
  // a window or a soft cap: flash attention's options (fold a window into a mask tensor, or cap
  // with reference::gqa_attention, where it cannot run)
  const bool flash_only = window != 0 || softcap != 0;
  if (flash_only) {
    if (!causal && window != 0) fail("gqa_attention", "a sliding window needs causal attention");
    if (mask.valid()) fail("gqa_attention", "window and softcap run in flash attention, which takes no mask tensor");
    if constexpr (!detail::HasFlashAttention<B>)
      fail("gqa_attention", "window and softcap need flash attention, which the ", B::name, " backend lacks");
  }
  if (mask.valid()) {
    detail::layer_same_dtype(tp, q, mask, "gqa_attention", "q", "mask");
    detail::check_gqa_mask(tp, mask, Bn, T, n_heads);
  }
  if ((roped && (tp.requires_grad(cos) || tp.requires_grad(sin))) || (mask.valid() && tp.requires_grad(mask))) {
    if (per_token || starts.valid() || flash_only)
      fail("gqa_attention", "per-token RoPE tables, doc_starts, window and softcap need constant tables and mask");
    if (causal) mask = causal_mask_fill(tp, T, tp.dtype(q));
    return reference::gqa_attention(tp, q, k, v, cos, sin, mask, T, n_heads, n_kv_heads, head_dim, scale, traditional);
  }
  if (roped) {
    // The tables (T, dims/2) as (T, 1, dims/2): every head of a position turns by its angles
    // (per-token tables: (B * T, 1, dims/2) against the heads of each of the B * T rows).
    const std::int64_t half = tp.shape(cos)[1], P = per_token ? Bn * T : T, Bq = per_token ? 1 : Bn;
    GVar c = detail::view(tp, cos, Shape{P, 1, half}), s = detail::view(tp, sin, Shape{P, 1, half});
    q = detail::view(tp, fused_rope(tp, detail::view(tp, q, Shape{Bq, P, n_heads, head_dim}), c, s, traditional), qs);
    k = detail::view(tp, fused_rope(tp, detail::view(tp, k, Shape{Bq, P, n_kv_heads, head_dim}), c, s, traditional), ks);
  }
  if constexpr (detail::HasFlashAttention<B>)
    if (!mask.valid() && (T >= detail::kFlashMinT || starts.valid() || flash_only))
      return flash_attention(tp, q, k, v, T, n_heads, n_kv_heads, head_dim, scale, causal, starts, window, softcap);
  return fused_attention(tp, q, k, v, mask, T, n_heads, n_kv_heads, head_dim, scale, causal);
}

}  // namespace detail

/// gqa_attention's arguments by name, for the form that cannot mix up its four integers:
///   gqa_attention(tp, q, k, v, {.T = T, .n_heads = 8, .n_kv_heads = 2, .head_dim = 64,
///                               .cos = rope.cos, .sin = rope.sin, .causal = true});
/// (Designated initializers go in declaration order; leave out what you do not need.)
struct AttentionOptions {
  std::int64_t T = 0;           // the sequence length (q's rows split into (B, T))
  std::int64_t n_heads = 0;     // query heads
  std::int64_t n_kv_heads = 0;  // key/value heads; 0: n_heads (MHA)
  std::int64_t head_dim = 0;
  double scale = 0;             // multiplies the scores; 0: 1 / sqrt(head_dim)
  GVar cos{}, sin{};            // RoPE tables from rope_fill; none when empty
  GVar mask{};                  // additive, broadcasting to (B, n_heads, T, T); none when empty
  bool causal = false;          // query i sees keys 0..i, with or without a mask, no (T, T) tensor
  bool traditional = false;     // interleaved RoPE pairs (2i, 2i + 1) instead of NEOX halves
  // Packed rows (causal, no mask): (B, T) int32, where each position's document begins; a query
  // sees only its own document's keys (flash_attention's starts). cos/sin may then be per token,
  // (B * T, dims/2), so that positions restart at each document.
  GVar doc_starts{};
  // Causal only: query i sees keys i - window < j <= i (transformers' sliding window); 0: none.
  std::int64_t window = 0;
  // > 0: the scores are capped to softcap * tanh(s / softcap) before the softmax (Gemma 2).
  double softcap = 0;
};

/// Grouped-query attention over packed projections.
///   q: (B, T, n_heads * head_dim)     k, v: (B, T, n_kv_heads * head_dim)
///   (or the same with B and T merged into rows: (B*T, ...), which T splits)
///   .cos, .sin: RoPE tables (T, dims/2) from rope_fill, dims <= head_dim; none: no RoPE
///   .mask: additive, broadcasting against (B, n_heads, T, T) — (T, T) causal, (B, 1, T, T)
///          causal + padding (attention_mask_fill); none: no mask
///   .causal: query i sees keys 0..i with no (T, T) tensor read and the products above the
///            diagonal skipped (about half the work); with or without a mask
///   .window, .softcap: a sliding window (causal) and a soft cap on the scores, in flash
///            attention only (no mask tensor; backends with the flash kernels: the CPU's)
///   -> (B, T, n_heads * head_dim) (the rank of q), heads concatenated in order.
/// n_heads must be a multiple of n_kv_heads: query head h reads kv head h / (n_heads / n_kv_heads)
/// (HF's repeat_kv); n_kv_heads == n_heads is MHA, n_kv_heads == 1 is MQA.
///
/// Runs as RoPE on q and k in place of layout (B, T, n, head_dim), then one fused attention
/// primitive (ops/attention.hpp: per-head strided GEMMs, mask and softmax in place, no head
/// permutes). Without a mask tensor and from T = detail::kFlashMinT on, that primitive is
/// flash_attention, which never stores the (T, T) probabilities. `.scale` (default
/// 1/sqrt(head_dim)) multiplies the scores. When the tables or the mask need a gradient,
/// reference::gqa_attention computes the same thing from primitives. `.traditional` selects the
/// interleaved RoPE.
///
/// The seed's positional form (tp, q, k, v, cos, sin, mask, T, n_heads, n_kv_heads, head_dim,
/// scale) is gone from the public API: four adjacent integers that compile in any order. Its
/// fields map one to one onto the options; reference::gqa_attention keeps that order.
template <class B>
GVar gqa_attention(GTape<B>& tp, GVar q, GVar k, GVar v, const AttentionOptions& o) {
  const std::int64_t n_kv = o.n_kv_heads == 0 ? o.n_heads : o.n_kv_heads;
  if (o.head_dim <= 0) detail::fail("gqa_attention", "options need head_dim > 0, got ", o.head_dim);
  const double scale = o.scale != 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  return detail::gqa_attention(tp, q, k, v, o.cos, o.sin, o.mask, o.causal, o.T, o.n_heads, n_kv, o.head_dim, scale,
                               o.traditional, o.doc_starts, o.window, o.softcap);
}

}  // namespace nn
