// SPDX-License-Identifier: MIT OR Apache-2.0
// CausalLM: the Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 / Mistral / SmolLM decoder-only
// transformer as Hugging Face's LlamaForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM,
// Phi3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM and MistralForCausalLM compute it, as a
// module tree whose parameter paths are HF's own ("model.layers.0.self_attn.q_proj.weight";
// Phi-3's fused qkv_proj / gate_up_proj held split),
// with a batched forward on the tape and a KV-cached forward for generation.
//
// One decoder layer (HF LlamaDecoderLayer):
//   h = x + o_proj(attention(rope(q_proj(n1)), rope(k_proj(n1)), v_proj(n1)))   n1 = RMSNorm(x)
//   (Qwen3: rope(q_norm(q_proj(n1))), rope(k_norm(k_proj(n1))), the norms per head)
//   y = h + down_proj(silu(gate_proj(n2)) * up_proj(n2))                         n2 = RMSNorm(h)
// then a final RMSNorm and the LM head (the embedding table itself when tie_word_embeddings).
// Gemma 2 (Gemma2DecoderLayer): x starts as embed * sqrt(C), every RMSNorm scales by (1 + w),
//   h = x + RMSNorm(o_proj(attention(...)))     scores cap*tanh(s/cap), scale 1/sqrt(qpas)
//   y = h + RMSNorm(down_proj(gelu_tanh(gate_proj(n2)) * up_proj(n2)))   n2 = RMSNorm(h)
// and the logits cap*tanh(logits/cap). Gemma 3 (Gemma3DecoderLayer): Gemma 2 with Qwen3's q/k
// head norms ((1 + w) norms), usually no caps, and RoPE of base rope_local_base_freq on its
// sliding layers. Sliding-window layers (Phi-3: all; Gemma 2: even; Gemma 3: by layer_types) see
// the keys less than sliding_window positions back.
// RoPE is the NEOX half-split form (HF rotate_half) with the config's inverse frequencies.
#pragma once

#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <variant>
#include <vector>

#include "../grad_checkpoint.hpp"
#include "../layers/activations.hpp"
#include "../layers/attention.hpp"
#include "../layers/loss.hpp"
#include "../layers/mask.hpp"
#include "../layers/rope.hpp"
#include "../module.hpp"
#include "../modules.hpp"
#include "config.hpp"

namespace nn::lm {

/// A projection LoRA may replace in place: model.map_modules<nn::Linear>(pred, f) with f
/// returning nn::LoraLinear::from_base(l, r) swaps the alternative and keeps the path
/// ("...q_proj.linear.weight", "...q_proj.lora_a" afterwards, as mlx-lm names them); DoRA's
/// nn::DoraLinear likewise. A quantized model (a GGUF's blocks kept, nn::quantize(model, ...))
/// holds QuantizedLinear.
using Projection = std::variant<Linear, LoraLinear, DoraLinear, QuantizedLinear>;

/// The token embedding, full precision or quantized (then also the tied head's matrix).
using TokenEmbedding = std::variant<Embedding, QuantizedEmbedding>;

namespace detail {

template <class B>
GVar project(GTape<B>& tp, const Projection& p, GVar x) {
  return std::visit([&](const auto& m) { return m(tp, x); }, p);
}
template <class B>
GVar embed(GTape<B>& tp, const TokenEmbedding& e, GVar ids) {
  return std::visit([&](const auto& m) { return m(tp, ids); }, e);
}
/// The embedding as the tied LM head: (..., C) -> (..., vocab).
template <class B>
GVar embed_as_linear(GTape<B>& tp, const TokenEmbedding& e, GVar h) {
  return std::visit([&](const auto& m) { return m.as_linear(tp, h); }, e);
}

/// The LM head as one matrix for linear_cross_entropy (a Linear or QuantizedLinear without a
/// bias; a tied embedding's table); nullopt for a head it cannot take (a bias, an adapter).
template <class B>
std::optional<HeadVars> head_vars(GTape<B>& tp, const Projection& p) {
  if (const auto* l = std::get_if<Linear>(&p); l && !l->bias) return HeadVars(nn::param(tp, l->weight));
  if (const auto* q = std::get_if<QuantizedLinear>(&p); q && !q->bias) {
    auto w = nn::detail::bind_quantized(tp, q->weight, q->scales, q->biases);
    return HeadVars(w.wq, w.scales, w.biases, q->quant());
  }
  return std::nullopt;
}
template <class B>
std::optional<HeadVars> head_vars(GTape<B>& tp, const TokenEmbedding& e) {
  if (const auto* d = std::get_if<Embedding>(&e)) return HeadVars(nn::param(tp, d->weight));
  const auto& q = std::get<QuantizedEmbedding>(e);
  auto w = nn::detail::bind_quantized(tp, q.weight, q.scales, q.biases);
  return HeadVars(w.wq, w.scales, w.biases, q.quant());
}

inline Tensor zeros_or_empty(const Shape& s, DType dt, bool zero) {
  return zero ? Tensor::zeros(s, dt) : Tensor::empty(s, dt);
}

inline Linear make_linear(std::int64_t in, std::int64_t out, bool bias, DType dt, bool zero) {
  Linear l;  // default-constructed: draws nothing from nn::random
  l.weight = Param(zeros_or_empty(Shape{out, in}, dt, zero));
  if (bias) l.bias = Param(zeros_or_empty(Shape{out}, dt, zero));
  return l;
}

/// An RMSNorm of the config's kind: Gemma's scales by (1 + weight), so its identity weight is 0.
inline RmsNorm make_norm(std::int64_t dims, const ModelConfig& c, DType dt, bool zero) {
  RmsNorm n;
  n.weight = Param(!zero ? Tensor::empty(Shape{dims}, dt) : c.norm_unit_offset ? Tensor::zeros(Shape{dims}, dt) : Tensor::ones(Shape{dims}, dt));
  n.eps(c.rms_norm_eps).unit_offset(c.norm_unit_offset);
  return n;
}

/// The additive mask (1, 1, 1, Tq, S) of queries at positions S0 .. S0+Tq-1 (S = S0 + Tq) over
/// keys 0 .. S-1: key j is seen when j <= i and, with a window W > 0, i - j < W (transformers'
/// sliding-window causal mask).
inline Tensor causal_window_mask(std::int64_t Tq, std::int64_t S0, std::int64_t window, DType dt) {
  const std::int64_t S = S0 + Tq;
  std::vector<double> m(static_cast<std::size_t>(Tq * S));
  for (std::int64_t i = 0; i < Tq; ++i)
    for (std::int64_t j = 0; j < S; ++j)
      m[static_cast<std::size_t>(i * S + j)] = j <= S0 + i && (window == 0 || S0 + i - j < window) ? 0.0 : kMaskedValue;
  return Tensor::from_doubles(Shape{1, 1, 1, Tq, S}, m, dt);
}

/// Attention written out, for what the fused kernel does not do (soft-capped scores, a sliding
/// window) and for decode's cached keys:
///   qh (B, nkv, g, Tq, hd) after RoPE; kh, vh (B, nkv, S, hd); mask additive, broadcasting
///   against (B, nkv, g, Tq, S) -> (B, Tq, nkv * g * hd)
/// softmax(cap(scale q k^T) + mask) v, with cap the soft cap when `cap` > 0.
template <class B>
GVar composite_attention(GTape<B>& tp, GVar qh, GVar kh, GVar vh, GVar mask, double scale, double cap) {
  const Shape qs = tp.shape(qh);
  const std::int64_t Bn = qs[0], nkv = qs[1], g = qs[2], Tq = qs[3], hd = qs[4], S = tp.shape(kh)[2];
  qh = nn::scale(tp, qh, scale);
  GVar scores = matmul(tp, nn::detail::view(tp, qh, Shape{Bn, nkv, g * Tq, hd}), kh, false, true);  // (B, nkv, g*Tq, S)
  scores = nn::detail::view(tp, scores, Shape{Bn, nkv, g, Tq, S});
  if (cap > 0) scores = nn::softcap(tp, scores, cap);
  GVar p = softmax(tp, add(tp, scores, mask));                                    // (B, nkv, g, Tq, S)
  GVar ctx = matmul(tp, nn::detail::view(tp, p, Shape{Bn, nkv, g * Tq, S}), vh);  // (B, nkv, g*Tq, hd)
  ctx = permute(tp, nn::detail::view(tp, ctx, Shape{Bn, nkv, g, Tq, hd}), {0, 3, 1, 2, 4});  // (B, Tq, nkv, g, hd)
  return nn::detail::view(tp, ctx, Shape{Bn, Tq, nkv * g * hd});
}

/// q (B, T, nkv * g * hd) or k / v (B, T, nkv * hd) in composite_attention's layout:
/// (B, nkv, g, T, hd) for queries (g > 0), (B, nkv, T, hd) for keys and values (g == 0).
template <class B>
GVar heads_first(GTape<B>& tp, GVar x, std::int64_t nkv, std::int64_t g, std::int64_t hd) {
  const Shape s = tp.shape(x);
  if (g > 0) return permute(tp, nn::detail::view(tp, x, Shape{s[0], s[1], nkv, g, hd}), {0, 2, 3, 1, 4});
  return permute(tp, nn::detail::view(tp, x, Shape{s[0], s[1], nkv, hd}), {0, 2, 1, 3});
}

/// cos and sin (T, head_dim/2) for positions offset .. offset+T-1, angles t * inv_freq[i] in
/// double, rounded once to dt. (nn::rope_fill takes a base and a scale; Llama 3's remapped
/// frequencies need the table per frequency, so it is built here from ModelConfig::inv_freq.)
/// local: Gemma 3's sliding layers' table (ModelConfig::local_rope).
inline RopeTable rope_table(const ModelConfig& c, std::int64_t T, std::int64_t offset, DType dt, bool local = false) {
  const std::vector<double> f = c.inv_freq(local);
  const std::int64_t half = static_cast<std::int64_t>(f.size());
  std::vector<double> cs(static_cast<std::size_t>(T * half)), sn(cs.size());
  for (std::int64_t t = 0; t < T; ++t)
    for (std::int64_t i = 0; i < half; ++i) {
      const double a = static_cast<double>(t + offset) * f[static_cast<std::size_t>(i)];
      cs[static_cast<std::size_t>(t * half + i)] = std::cos(a);
      sn[static_cast<std::size_t>(t * half + i)] = std::sin(a);
    }
  return {Tensor::from_doubles(Shape{T, half}, cs, dt), Tensor::from_doubles(Shape{T, half}, sn, dt)};
}

template <class B>
RopeVars rope_vars(GTape<B>& tp, const ModelConfig& c, std::int64_t T, std::int64_t offset, DType dt, bool local = false) {
  RopeTable t = rope_table(c, T, offset, dt, local);
  return {tp.constant(nn::detail::on_backend<B>(t.cos)), tp.constant(nn::detail::on_backend<B>(t.sin))};
}

/// The tables a forward needs, [local]: the global one, and Gemma 3's local one when a layer runs it.
template <class B>
std::array<RopeVars, 2> rope_vars_per_kind(GTape<B>& tp, const ModelConfig& c, std::int64_t T, std::int64_t offset, DType dt) {
  std::array<RopeVars, 2> rp;
  for (std::int64_t li = 0; li < c.num_hidden_layers; ++li) {
    const bool local = c.local_rope(li);
    if (!rp[local].cos.valid()) rp[local] = rope_vars(tp, c, T, offset, dt, local);
  }
  return rp;
}

}  // namespace detail

/// HF's LlamaAttention / Qwen2Attention / Qwen3Attention weights: q (n_heads*hd, C), k and v
/// (n_kv*hd, C), o (C, n_heads*hd); biases on q/k/v for Qwen2 (and Llama with attention_bias);
/// Qwen3's q_norm and k_norm (hd), RMSNorms over each head's features.
struct Attention {
  Projection q_proj, k_proj, v_proj, o_proj;
  std::optional<RmsNorm> q_norm, k_norm;

  /// Qwen3's per-head norm of the projected queries or keys, before RoPE (identity without it).
  /// x: (B, T, heads * hd) -> (B, T, heads * hd)
  template <class B>
  static GVar head_norm(GTape<B>& tp, const std::optional<RmsNorm>& n, GVar x, std::int64_t hd) {
    if (!n) return x;
    const Shape s = tp.shape(x);
    GVar h = reshape(tp, x, {s[0], s[1], s[2] / hd, hd});  // (B, T, heads, hd)
    return reshape(tp, (*n)(tp, h), {s[0], s[1], s[2]});
  }
  NN_MODULE(Attention, q_proj, k_proj, v_proj, o_proj, q_norm, k_norm)
};

/// HF's LlamaMLP: down(silu(gate(x)) * up(x)); gate, up (I, C), down (C, I). Gemma 2's GeGLU
/// (gelu): down(gelu_tanh(gate(x)) * up(x)).
struct Mlp {
  Projection gate_proj, up_proj, down_proj;
  bool gelu = false;

  // x: (..., C) -> (..., C)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar g = detail::project(tp, gate_proj, x), u = detail::project(tp, up_proj, x);
    return detail::project(tp, down_proj, gelu ? mul(tp, gelu_approx(tp, g), u) : swiglu(tp, g, u));
  }
  NN_MODULE(Mlp, gate_proj, up_proj, down_proj, NN_STATIC(gelu))
};

/// One pre-norm decoder layer, fields in HF's order. Gemma 2 ("sandwich"):
/// post_attention_layernorm normalises the attention's output before the residual add, and
/// pre_ / post_feedforward_layernorm wrap the MLP; elsewhere post_attention_layernorm is the
/// MLP's input norm and the other two are absent.
struct DecoderLayer {
  Attention self_attn;
  Mlp mlp;
  RmsNorm input_layernorm, post_attention_layernorm;
  std::optional<RmsNorm> pre_feedforward_layernorm, post_feedforward_layernorm;
  NN_MODULE(DecoderLayer, self_attn, mlp, input_layernorm, post_attention_layernorm, pre_feedforward_layernorm,
            post_feedforward_layernorm)

  /// h + attention's output ctx (B, T, heads * hd) through o_proj (and Gemma's norm). Each
  /// module runs inside a tape scope named by its path below the layer, so anomaly mode names it.
  template <class B>
  GVar attention_residual(GTape<B>& tp, GVar h, GVar ctx) const {
    GVar a;
    {
      auto s = tp.scope("self_attn");
      a = detail::project(tp, self_attn.o_proj, ctx);
    }
    if (pre_feedforward_layernorm) {
      auto s = tp.scope("post_attention_layernorm");
      a = post_attention_layernorm(tp, a);
    }
    return add(tp, h, a);
  }
  /// h + the MLP's output on the normalised h (scoped as attention_residual).
  template <class B>
  GVar mlp_residual(GTape<B>& tp, GVar h) const {
    auto scoped = [&tp](const char* name, auto&& f) {
      auto s = tp.scope(name);
      return f();
    };
    const bool gemma = pre_feedforward_layernorm.has_value();
    GVar n = gemma ? scoped("pre_feedforward_layernorm", [&] { return (*pre_feedforward_layernorm)(tp, h); })
                   : scoped("post_attention_layernorm", [&] { return post_attention_layernorm(tp, h); });
    GVar m = scoped("mlp", [&] { return mlp(tp, n); });
    if (gemma) m = scoped("post_feedforward_layernorm", [&] { return (*post_feedforward_layernorm)(tp, m); });
    return add(tp, h, m);
  }
};

/// HF's LlamaModel / Qwen2Model (the "model." prefix of every path): embedding, layers, norm.
struct Backbone {
  TokenEmbedding embed_tokens;  // (vocab, C)
  std::vector<DecoderLayer> layers;
  RmsNorm norm;
  NN_MODULE(Backbone, embed_tokens, layers, norm)
};

/// Packed rows: several documents per row of the batch, each attending only to itself, with
/// positions (RoPE) restarting at each document. Both (B, T) int32, usually input slots
/// (nn::lm::pack_examples / make_packed_batch make them):
///   starts[b, t]: where position t's document begins in row b (0, ..., 0, 5, 5, 5, 9, ...)
///   positions[b, t]: t - starts[b, t], the position inside the document.
struct Packing {
  GVar starts, positions;
  bool valid() const { return starts.valid(); }
};

/// The per-layer keys and values seen so far, for incremental decoding with CausalLM::decode.
/// k[l], v[l]: (B, n_kv_heads, S, head_dim), keys after RoPE; keep: (B, S) float, 1 for a real
/// token and 0 for padding. Empty until the first decode() call.
struct KVCache {
  std::vector<Tensor> k, v;
  Tensor keep;
  /// S: how many positions are cached (the next token's position).
  std::int64_t length() const { return k.empty() || !k[0].defined() ? 0 : k[0].dim(2); }
  void clear() {
    k.clear();
    v.clear();
    keep = Tensor();
  }
};

/// LlamaForCausalLM / Qwen2ForCausalLM / Qwen3ForCausalLM. Parameter paths: model.embed_tokens.weight,
/// model.layers.N.{self_attn.{q,k,v,o}_proj, mlp.{gate,up,down}_proj}.{weight,bias},
/// model.layers.N.{input,post_attention}_layernorm.weight, model.norm.weight, lm_head.weight
/// (absent when tied). Build one with nn::lm::load_hf / load_gguf, or CausalLM(config, dtype) for
/// zero weights of the right shapes.
struct CausalLM {
  Backbone model;
  std::optional<Projection> lm_head;  // (vocab, C); empty when tied to model.embed_tokens

  CausalLM() = default;
  /// Every weight of the config's shapes in `dtype` (f32 or f64): zeros, norms ones.
  explicit CausalLM(const ModelConfig& cfg, DType dtype = DType::f32) : CausalLM(cfg, dtype, true) {}
  /// The same with uninitialised storage (a loader about to fill every tensor).
  static CausalLM uninitialised(const ModelConfig& cfg, DType dtype = DType::f32) { return CausalLM(cfg, dtype, false); }

  const ModelConfig& config() const { return config_; }

  /// Gradient checkpointing per decoder layer (mlx-lm's --grad-checkpoint): each layer is
  /// recorded as an nn::checkpoint segment, so a training step keeps one layer's activations
  /// instead of all of them and runs each layer's forward once more in the backward pass.
  /// Gradients are bitwise the same. Part of the structure: a compiled step records again when
  /// it changes.
  CausalLM& grad_checkpoint(bool on) {
    grad_checkpoint_ = on;
    return *this;
  }
  bool grad_checkpoint() const { return grad_checkpoint_; }
  /// The dtype the model computes in (float32 when its frozen weights are stored in bfloat16,
  /// set_precision(model, Precision::bf16)).
  DType dtype() const {
    if (const auto* q = std::get_if<QuantizedEmbedding>(&model.embed_tokens))
      return q->scales.value.dtype() == DType::f64 ? DType::f64 : DType::f32;
    const DType t = std::get<Embedding>(model.embed_tokens).weight.value.dtype();
    return t == DType::bf16 ? DType::f32 : t;
  }

  /// The final hidden states (after the last RMSNorm).
  ///   ids: (B, T) int32/int64 token ids (usually an input slot, so a replay can swap batches)
  ///   mask: additive attention mask broadcasting against (B, n_heads, T, T) that already holds
  ///         causality — nn::attention_mask_fill(keep) for a padded batch; GVar{} for causal only
  ///   -> (B, T, C)
  /// Positions are 0..T-1 in every row, as HF's forward without position_ids: pad on the right.
  /// pk (packed rows, no mask): documents attend only to themselves, positions from pk.
  template <class B>
  GVar hidden(GTape<B>& tp, GVar ids, GVar mask = GVar{}, Packing pk = {}) const {
    const char* L = "CausalLM";
    const Shape ids_shape = tp.shape(ids);
    if (ids_shape.rank() != 2 || (tp.dtype(ids) != DType::i32 && tp.dtype(ids) != DType::i64))
      nn::detail::fail(L, "ids must be (B, T) int32 or int64, got ", ids_shape.str(), " ", dtype_name(tp.dtype(ids)));
    const std::int64_t T = ids_shape[1];
    const ModelConfig& c = config_;
    const DType dt = dtype();
    std::array<RopeVars, 2> rp_kind = detail::rope_vars_per_kind(tp, c, T, 0, dt);  // [local]
    if (pk.valid()) {
      if (mask.valid()) nn::detail::fail(L, "packed rows take no mask (documents are kept apart by pk.starts)");
      if (!pk.positions.valid() || !(tp.shape(pk.positions) == ids_shape) || tp.dtype(pk.positions) != DType::i32)
        nn::detail::fail(L, "packed rows need positions (B, T) int32 beside the starts");
      // each token's angles, by its position inside its document: (B * T, head_dim / 2)
      for (RopeVars& rp : rp_kind)
        if (rp.cos.valid()) {
          const std::int64_t n = ids_shape.numel(), half = tp.shape(rp.cos)[1];
          rp.cos = reshape(tp, gather_rows(tp, rp.cos, pk.positions), {n, half});
          rp.sin = reshape(tp, gather_rows(tp, rp.sin, pk.positions), {n, half});
        }
    }
    const double scale = c.attention_scale();
    // Soft-capped scores and a window shorter than the rows run in flash attention (its window
    // and softcap options). Where it cannot -- a padding mask tensor, or a backend without the
    // flash kernels -- attention is written out, under the causal + window mask (1, 1, 1, T, T)
    // and the padding mask; packed rows then cannot run.
    auto window_of = [&](std::size_t li) {
      return c.window_on(static_cast<std::int64_t>(li)) && T > c.sliding_window ? c.sliding_window : std::int64_t{0};
    };
    auto composite = [&](std::size_t li) {
      const bool special = c.attn_logit_softcapping > 0 || window_of(li) > 0;
      if constexpr (nn::detail::HasFlashAttention<B>) return special && mask.valid();
      return special;
    };
    GVar window_mask[2];  // [windowed]
    for (std::size_t li = 0; li < model.layers.size(); ++li)
      if (composite(li)) {
        if (pk.valid())
          nn::detail::fail(L, "packed rows need flash attention for ", c.model_type,
                           "'s soft-capped or sliding-window layers, which the ", B::name, " backend lacks");
        const bool w = c.window_on(static_cast<std::int64_t>(li));
        if (!window_mask[w].valid()) {
          GVar m = tp.constant(nn::detail::on_backend<B>(detail::causal_window_mask(T, 0, w ? c.sliding_window : 0, dt)));
          if (mask.valid()) {  // (b, 1, T, T) or fewer leading axes -> (b, 1, 1, T, T)
            const Shape ms = tp.shape(mask);
            const std::int64_t b = ms.rank() == 4 ? ms[0] : 1;
            if (ms.rank() < 2 || ms.rank() > 4 || (ms.rank() >= 3 && ms[ms.rank() - 3] != 1) || ms[ms.rank() - 1] != T ||
                ms[ms.rank() - 2] != T)
              nn::detail::fail(L, "mask ", ms.str(), ": ", c.model_type, "'s attention takes one (B, 1, T, T) mask for all heads");
            m = add(tp, m, nn::detail::view(tp, mask, Shape{b, 1, 1, T, T}));
          }
          window_mask[w] = m;
        }
      }

    // Each block is recorded inside a tape scope named by its parameter path, so anomaly mode
    // names the layer ("model.layers.3.self_attn") where a NaN first appears.
    GVar x;
    {
      auto s = tp.scope("model.embed_tokens");
      x = detail::embed(tp, model.embed_tokens, ids);  // (B, T, C)
      if (c.embed_scale > 0) x = nn::scale(tp, x, c.embed_scale);  // Gemma: times sqrt(hidden)
    }
    // One decoder layer: h (B, T, C) -> (B, T, C).
    auto layer = [&](const DecoderLayer& l, GVar h, std::size_t li) {
      GVar n1;
      {
        auto s = tp.scope("input_layernorm");
        n1 = l.input_layernorm(tp, h);
      }
      GVar ctx;  // attention's output before o_proj: (B, T, n_heads * hd)
      {
        auto s = tp.scope("self_attn");
        const Attention& at = l.self_attn;
        GVar q = Attention::head_norm(tp, at.q_norm, detail::project(tp, at.q_proj, n1), c.head_dim);  // (B, T, n_heads * hd)
        GVar k = Attention::head_norm(tp, at.k_norm, detail::project(tp, at.k_proj, n1), c.head_dim);  // (B, T, n_kv * hd)
        GVar v = detail::project(tp, at.v_proj, n1);
        const RopeVars& rp = rp_kind[c.local_rope(static_cast<std::int64_t>(li))];
        if (composite(li)) {
          const std::int64_t nkv = c.num_key_value_heads, g = c.num_attention_heads / nkv, hd = c.head_dim;
          GVar qh = rope(tp, detail::heads_first(tp, q, nkv, g, hd), rp.cos, rp.sin);  // (B, nkv, g, T, hd)
          GVar kh = rope(tp, detail::heads_first(tp, k, nkv, 0, hd), rp.cos, rp.sin);  // (B, nkv, T, hd)
          ctx = detail::composite_attention(tp, qh, kh, detail::heads_first(tp, v, nkv, 0, hd),
                                            window_mask[c.window_on(static_cast<std::int64_t>(li))], scale,
                                            c.attn_logit_softcapping);
        } else {
          // causal only: the fused kernel's causal form (no (T, T) mask, half the products, or
          // T * window with a window); capped scores and windows: flash attention
          ctx = gqa_attention(tp, q, k, v,
                              {.T = T,
                               .n_heads = c.num_attention_heads,
                               .n_kv_heads = c.num_key_value_heads,
                               .head_dim = c.head_dim,
                               .scale = scale,
                               .cos = rp.cos,
                               .sin = rp.sin,
                               .mask = mask,
                               .causal = !mask.valid(),
                               .doc_starts = pk.starts,
                               .window = window_of(li),
                               .softcap = c.attn_logit_softcapping});  // (B, T, n_heads * hd)
        }
      }
      return l.mlp_residual(tp, l.attention_residual(tp, h, ctx));
    };
    for (std::size_t li = 0; li < model.layers.size(); ++li) {
      auto in_layer = tp.scope("model.layers." + std::to_string(li));
      const DecoderLayer& l = model.layers[li];
      x = grad_checkpoint_ ? nn::checkpoint(tp, layer, l, x, li) : layer(l, x, li);
    }
    auto s = tp.scope("model.norm");
    return model.norm(tp, x);
  }

  /// The LM head on hidden states: (..., C) -> (..., vocab).
  template <class B>
  GVar head(GTape<B>& tp, GVar h) const {
    auto s = tp.scope(lm_head ? "lm_head" : "model.embed_tokens");
    GVar out = lm_head ? detail::project(tp, *lm_head, h) : detail::embed_as_linear(tp, model.embed_tokens, h);
    return config_.final_logit_softcapping > 0 ? nn::softcap(tp, out, config_.final_logit_softcapping) : out;
  }

  /// The next-token loss on hidden states h (B, T, C): cross_entropy(head(h), targets, keep,
  /// reduction) (keep: GVar{} for none), without storing the (B, T, vocab) logits where it can:
  /// a frozen head of one matrix (tied embedding, Linear or QuantizedLinear without a bias; the
  /// LoRA and QLoRA case) and no logit soft cap go through linear_cross_entropy (layers/loss.hpp),
  /// which skips rows of weight 0 too. A trainable head keeps the logits, whose two products are
  /// fewer than the fused kernel's three for its weight's gradient; so do bf16 weights and
  /// autocast (matmul rounds their operands).
  template <class B>
  GVar head_loss(GTape<B>& tp, GVar h, GVar targets, GVar keep, Reduction reduction = Reduction::mean,
                 std::int64_t ignore_index = -100) const {
    if (config_.final_logit_softcapping <= 0) {
      auto s = tp.scope(lm_head ? "lm_head" : "model.embed_tokens");
      const std::optional<HeadVars> hv = lm_head ? detail::head_vars(tp, *lm_head) : detail::head_vars(tp, model.embed_tokens);
      const bool dense_ok = hv && !hv->quantized() && !tp.requires_grad(hv->w) && tp.dtype(hv->w) == tp.dtype(h) &&
                            tp.autocast() == DType::f32;  // bf16 weights and autocast: matmul's rounding
      if (hv && (hv->quantized() || dense_ok))
        return linear_cross_entropy(tp, h, *hv, targets, keep, reduction, ignore_index);
    }
    GVar logits = head(tp, h);
    return keep.valid() ? cross_entropy(tp, logits, targets, keep, reduction, ignore_index)
                        : cross_entropy(tp, logits, targets, reduction, ignore_index);
  }
  /// head_loss(hidden(ids)): the next-token loss of ids (B, T) against targets (B, T).
  template <class B>
  GVar loss(GTape<B>& tp, GVar ids, GVar targets, GVar keep, Reduction reduction = Reduction::mean) const {
    return head_loss(tp, hidden(tp, ids), targets, keep, reduction);
  }
  /// The same on packed rows (see Packing).
  template <class B>
  GVar loss(GTape<B>& tp, GVar ids, Packing pk, GVar targets, GVar keep, Reduction reduction = Reduction::mean) const {
    return head_loss(tp, hidden(tp, ids, GVar{}, pk), targets, keep, reduction);
  }

  /// Next-token logits (B, T, vocab) for ids (B, T), causal attention only.
  template <class B>
  GVar logits(GTape<B>& tp, GVar ids) const {
    return head(tp, hidden(tp, ids));
  }
  /// The same with an additive mask (see hidden()).
  template <class B>
  GVar logits(GTape<B>& tp, GVar ids, GVar mask) const {
    return head(tp, hidden(tp, ids, mask));
  }
  /// The same on packed rows (see Packing): each document attends only to itself.
  template <class B>
  GVar logits(GTape<B>& tp, GVar ids, Packing pk) const {
    return head(tp, hidden(tp, ids, GVar{}, pk));
  }
  /// The same with a padding mask keep (B, T) (nonzero = real token), turned into the causal +
  /// key-padding mask as a constant. (A compiled step that swaps batches should register the
  /// mask itself as an input slot — nn::input(tp, nn::attention_mask_fill(keep, dtype())) — and
  /// use the overload above.)
  template <class B>
  GVar logits(GTape<B>& tp, GVar ids, const Tensor& keep) const {
    return head(tp, hidden(tp, ids, attention_mask_fill(tp, keep, dtype())));
  }

  /// Incremental forward for generation: runs ids (B, Tq) at positions S .. S+Tq-1, where S =
  /// cache.length(), attending to the cached keys/values and to each other causally; appends
  /// this step's keys/values to `cache` and returns the logits (B, Tq, vocab) as a host tensor.
  /// keep (B, Tq), optional: 0 marks padding among the new tokens (never attended to later).
  /// Prefill with the prompt (Tq = its length), then one token at a time: the logits equal
  /// logits() on the whole sequence. Each call records a fresh tape (no gradient is wanted).
  template <class B = cpu>
  Tensor decode(const Tensor& ids, KVCache& cache, const Tensor& keep = Tensor()) const {
    const char* L = "CausalLM.decode";
    if (!ids.defined() || ids.rank() != 2 || (ids.dtype() != DType::i32 && ids.dtype() != DType::i64))
      nn::detail::fail(L, "ids must be a (B, Tq) int32 or int64 tensor, got ",
                       ids.defined() ? ids.shape().str() + " " + dtype_name(ids.dtype()) : std::string("an empty tensor"));
    const ModelConfig& c = config_;
    const DType dt = dtype();
    const std::int64_t Bn = ids.dim(0), Tq = ids.dim(1), S0 = cache.length(), S = S0 + Tq;
    if (Tq == 0) nn::detail::fail(L, "ids ", ids.shape().str(), " holds no token");
    const std::size_t nl = model.layers.size();
    if (S0 > 0 && (cache.k.size() != nl || cache.v.size() != nl || cache.k[0].dim(0) != Bn))
      nn::detail::fail(L, "the cache holds ", cache.k.size(), " layers of batch ", cache.k.empty() ? 0 : cache.k[0].dim(0),
                       "; this model has ", nl, " layers and ids ", ids.shape().str(), " (clear() it for a new batch)");
    if (keep.defined() && !(keep.shape() == ids.shape()))
      nn::detail::fail(L, "keep ", keep.shape().str(), " must have the shape of ids ", ids.shape().str());

    // keep for every position so far (B, S), and the additive mask (B, 1, Tq, S): query i (at
    // position S0 + i) sees key j when j <= S0 + i, key j is a real token and (a sliding-window
    // layer: Phi-3 all, Gemma 2 even ones) S0 + i - j < W, as transformers' sliding-window causal mask.
    std::vector<double> kp(static_cast<std::size_t>(Bn * S), 1.0);
    for (std::int64_t b = 0; b < Bn; ++b)
      for (std::int64_t j = 0; j < S; ++j) {
        double v = 1.0;
        if (j < S0 && cache.keep.defined()) v = cache.keep.item(b * S0 + j);
        if (j >= S0 && keep.defined()) v = keep.item(b * Tq + (j - S0)) != 0 ? 1.0 : 0.0;
        kp[static_cast<std::size_t>(b * S + j)] = v;
      }
    std::vector<double> pad(static_cast<std::size_t>(Bn * S));  // the keys' padding, additive
    for (std::size_t i = 0; i < pad.size(); ++i) pad[i] = kp[i] != 0 ? 0.0 : kMaskedValue;

    GTape<B> tp;
    GVar key_pad = tp.constant(nn::detail::on_backend<B>(Tensor::from_doubles(Shape{Bn, 1, 1, 1, S}, pad, dt)));
    GVar masks[2];  // [windowed]: causal (+ window) + padding, (B, 1, 1, Tq, S)
    for (std::size_t li = 0; li < nl; ++li) {
      const bool w = c.window_on(static_cast<std::int64_t>(li));
      if (!masks[w].valid())
        masks[w] = add(tp, tp.constant(nn::detail::on_backend<B>(detail::causal_window_mask(Tq, S0, w ? c.sliding_window : 0, dt))),
                       key_pad);
    }
    const std::array<RopeVars, 2> rp_kind = detail::rope_vars_per_kind(tp, c, Tq, S0, dt);  // [local]
    const std::int64_t nkv = c.num_key_value_heads, g = c.num_attention_heads / nkv, hd = c.head_dim;

    std::vector<Tensor> new_k(nl), new_v(nl);
    GVar x = detail::embed(tp, model.embed_tokens, tp.constant(nn::detail::on_backend<B>(ids)));  // (B, Tq, C)
    if (c.embed_scale > 0) x = nn::scale(tp, x, c.embed_scale);
    for (std::size_t li = 0; li < nl; ++li) {
      const DecoderLayer& l = model.layers[li];
      GVar n1 = l.input_layernorm(tp, x);
      const Attention& at = l.self_attn;
      GVar q = Attention::head_norm(tp, at.q_norm, detail::project(tp, at.q_proj, n1), hd);  // (B, Tq, n_heads * hd)
      GVar k = Attention::head_norm(tp, at.k_norm, detail::project(tp, at.k_proj, n1), hd);  // (B, Tq, n_kv * hd)
      GVar v = detail::project(tp, at.v_proj, n1);
      // The layout of gqa_attention, with Tq queries against S keys.
      GVar qh = detail::heads_first(tp, q, nkv, g, hd);  // (B, nkv, g, Tq, hd)
      GVar kh = detail::heads_first(tp, k, nkv, 0, hd);  // (B, nkv, Tq, hd)
      GVar vh = detail::heads_first(tp, v, nkv, 0, hd);  // (B, nkv, Tq, hd)
      const RopeVars& rp = rp_kind[c.local_rope(static_cast<std::int64_t>(li))];
      qh = rope(tp, qh, rp.cos, rp.sin);
      kh = rope(tp, kh, rp.cos, rp.sin);
      if (S0 > 0) {
        kh = concat(tp, {tp.constant(cache.k[li]), kh}, 2);  // (B, nkv, S, hd)
        vh = concat(tp, {tp.constant(cache.v[li]), vh}, 2);
      }
      new_k[li] = tp.value(kh);
      new_v[li] = tp.value(vh);
      GVar ctx = detail::composite_attention(tp, qh, kh, vh, masks[c.window_on(static_cast<std::int64_t>(li))],
                                             c.attention_scale(), c.attn_logit_softcapping);  // (B, Tq, n_heads * hd)
      x = l.mlp_residual(tp, l.attention_residual(tp, x, ctx));
    }
    Tensor out = tp.value(head(tp, model.norm(tp, x)));
    // Commit only once the whole step has run, so a failed call leaves the cache as it was.
    cache.k = std::move(new_k);
    cache.v = std::move(new_v);
    cache.keep = Tensor::from_doubles(Shape{Bn, S}, kp, DType::f32);
    return out.device() == Device::cpu ? out : out.to(Device::cpu);
  }

  // config_ fixes the shapes (hashed through the tensors) and the RoPE table; it is set at
  // construction and read-only afterwards, so a recorded step may bake it in.
  NN_MODULE(CausalLM, model, lm_head, NN_STATIC(grad_checkpoint_), NN_UNCHECKED(config_))

 private:
  CausalLM(const ModelConfig& cfg, DType dt, bool zero) : config_(cfg) {
    cfg.validate("CausalLM");
    if (dt != DType::f32 && dt != DType::f64)
      nn::detail::fail("CausalLM", "the model computes in float32 or float64, not ", dtype_name(dt));
    const std::int64_t C = cfg.hidden_size, I = cfg.intermediate_size;
    Embedding e;
    e.weight = Param(detail::zeros_or_empty(Shape{cfg.vocab_size, C}, dt, zero));
    model.embed_tokens = std::move(e);
    model.layers.resize(static_cast<std::size_t>(cfg.num_hidden_layers));
    for (DecoderLayer& l : model.layers) {
      l.self_attn.q_proj = detail::make_linear(C, cfg.q_dim(), cfg.qkv_bias, dt, zero);
      l.self_attn.k_proj = detail::make_linear(C, cfg.kv_dim(), cfg.qkv_bias, dt, zero);
      l.self_attn.v_proj = detail::make_linear(C, cfg.kv_dim(), cfg.qkv_bias, dt, zero);
      l.self_attn.o_proj = detail::make_linear(cfg.q_dim(), C, cfg.o_bias, dt, zero);
      if (cfg.qk_norm) {
        l.self_attn.q_norm = detail::make_norm(cfg.head_dim, cfg, dt, zero);
        l.self_attn.k_norm = detail::make_norm(cfg.head_dim, cfg, dt, zero);
      }
      l.mlp.gate_proj = detail::make_linear(C, I, cfg.mlp_bias, dt, zero);
      l.mlp.up_proj = detail::make_linear(C, I, cfg.mlp_bias, dt, zero);
      l.mlp.down_proj = detail::make_linear(I, C, cfg.mlp_bias, dt, zero);
      l.mlp.gelu = cfg.gelu_mlp;
      l.input_layernorm = detail::make_norm(C, cfg, dt, zero);
      l.post_attention_layernorm = detail::make_norm(C, cfg, dt, zero);
      if (cfg.sandwich_norms) {
        l.pre_feedforward_layernorm = detail::make_norm(C, cfg, dt, zero);
        l.post_feedforward_layernorm = detail::make_norm(C, cfg, dt, zero);
      }
    }
    model.norm = detail::make_norm(C, cfg, dt, zero);
    if (!cfg.tie_word_embeddings) lm_head = Projection(detail::make_linear(C, cfg.vocab_size, false, dt, zero));
  }

  ModelConfig config_;
  bool grad_checkpoint_ = false;
};

}  // namespace nn::lm
