// SPDX-License-Identifier: MIT OR Apache-2.0
// The reference workload's model, for bench/decoder.cpp (CPU) and bench/decoder_cuda.cu (GPU):
// a Llama-style decoder in HF Llama's module tree and names, its LoRA variant, and the FLOPs of a
// step counted from its shapes (the formula bench/decoder_torch.py uses too). Written over the
// backend: Decoder::loss records on any GTape<B>.
#pragma once

#include <nn/nn.hpp>

#include <cmath>
#include <cstdint>
#include <string>
#include <variant>
#include <vector>

namespace bench::decoder {

/// The CPU reference (the defaults), or Config::gpu(): the same decoder scaled to a GPU, as the
/// CUDA issue sets it (d 1024, 12 layers, 16/4 heads of 64, SwiGLU 2816, vocab 32000; its batch
/// is 8 x 1024).
struct Config {
  std::int64_t vocab = 8192, dim = 256, layers = 4, heads = 8, kv_heads = 2, head_dim = 32, hidden = 704;
  double eps = 1e-5, rope_base = 10000.0;
  std::int64_t lora_rank = 8;
  double lora_scale = 2.0;
  static Config gpu() {
    Config c;
    c.vocab = 32000, c.dim = 1024, c.layers = 12, c.heads = 16, c.kv_heads = 4, c.head_dim = 64, c.hidden = 2816;
    return c;
  }
};

// ---- the model: HF Llama's module tree and names -------------------------------------------

/// A projection that LoRA may replace in place (map_modules assigns into the variant).
using Proj = std::variant<nn::Linear, nn::LoraLinear>;

template <class B>
nn::GVar project(nn::GTape<B>& tp, const Proj& p, nn::GVar x) {
  return std::visit([&](const auto& l) { return l(tp, x); }, p);
}

inline nn::Linear linear(std::int64_t in, std::int64_t out) { return nn::Linear(in, out).without_bias(); }

struct Attention {
  Proj q_proj, k_proj, v_proj, o_proj;
  NN_MODULE(Attention, q_proj, k_proj, v_proj, o_proj)
};

struct Mlp {
  nn::Linear gate_proj, up_proj, down_proj;
  NN_MODULE(Mlp, gate_proj, up_proj, down_proj)
};

struct Block {
  nn::RmsNorm input_layernorm;
  Attention self_attn;
  nn::RmsNorm post_attention_layernorm;
  Mlp mlp;
  NN_MODULE(Block, input_layernorm, self_attn, post_attention_layernorm, mlp)
};

struct Body {
  nn::Embedding embed_tokens;
  std::vector<Block> layers;
  nn::RmsNorm norm;
  NN_MODULE(Body, embed_tokens, layers, norm)
};

struct Decoder {
  Body model;
  nn::Linear lm_head;
  Config cfg;  // set once by make_decoder; a recorded step bakes it in

  // ids, targets: (B, T) int32 -> mean next-token cross-entropy
  template <class B>
  nn::GVar loss(nn::GTape<B>& tp, nn::GVar ids, nn::GVar targets) const {
    const std::int64_t T = tp.shape(ids)[1];
    nn::RopeVars rope = nn::rope_fill(tp, T, cfg.head_dim, cfg.rope_base);
    const double scale = 1.0 / std::sqrt(static_cast<double>(cfg.head_dim));
    nn::GVar h = model.embed_tokens(tp, ids);  // (B, T, d)
    for (const Block& l : model.layers) {
      nn::GVar x = l.input_layernorm(tp, h);
      nn::GVar q = project(tp, l.self_attn.q_proj, x);  // (B, T, heads * hd)
      nn::GVar k = project(tp, l.self_attn.k_proj, x);  // (B, T, kv_heads * hd)
      nn::GVar v = project(tp, l.self_attn.v_proj, x);
      nn::GVar a = nn::gqa_attention(tp, q, k, v, {.T = T, .n_heads = cfg.heads, .n_kv_heads = cfg.kv_heads,
                                                   .head_dim = cfg.head_dim, .scale = scale, .cos = rope.cos,
                                                   .sin = rope.sin, .causal = true});
      // (the causal kernel: no mask, no products above the diagonal)
      h = nn::add(tp, h, project(tp, l.self_attn.o_proj, a));
      x = l.post_attention_layernorm(tp, h);
      nn::GVar m = nn::swiglu(tp, l.mlp.gate_proj(tp, x), l.mlp.up_proj(tp, x));  // (B, T, hidden)
      h = nn::add(tp, h, l.mlp.down_proj(tp, m));
    }
    h = model.norm(tp, h);
    // a frozen head (the LoRA step) takes the head and the loss as one primitive, storing no
    // logits (linear_cross_entropy); a trainable one, autocast and a bias keep them
    const nn::GVar w = nn::param(tp, lm_head.weight);
    if (!lm_head.bias && !tp.requires_grad(w) && tp.autocast() == nn::DType::f32)
      return nn::linear_cross_entropy(tp, h, nn::HeadVars(w), targets);
    nn::GVar logits = lm_head(tp, h);  // (B, T, vocab)
    return nn::cross_entropy(tp, logits, targets);
  }

  NN_MODULE(Decoder, model, lm_head, NN_UNCHECKED(cfg))
};

inline Decoder make_decoder(const Config& c) {
  Decoder m;
  m.cfg = c;
  m.model.embed_tokens = nn::Embedding(c.vocab, c.dim);
  for (std::int64_t i = 0; i < c.layers; ++i) {
    Block b;
    b.input_layernorm = nn::RmsNorm(c.dim).eps(c.eps);
    b.self_attn.q_proj = linear(c.dim, c.heads * c.head_dim);
    b.self_attn.k_proj = linear(c.dim, c.kv_heads * c.head_dim);
    b.self_attn.v_proj = linear(c.dim, c.kv_heads * c.head_dim);
    b.self_attn.o_proj = linear(c.heads * c.head_dim, c.dim);
    b.post_attention_layernorm = nn::RmsNorm(c.dim).eps(c.eps);
    b.mlp = Mlp{linear(c.dim, c.hidden), linear(c.dim, c.hidden), linear(c.hidden, c.dim)};
    m.model.layers.push_back(std::move(b));
  }
  m.model.norm = nn::RmsNorm(c.dim).eps(c.eps);
  m.lm_head = linear(c.dim, c.vocab);
  return m;
}

/// q, k, v, o -> LoraLinear(rank, scale) over the frozen base; everything else frozen too.
inline void apply_lora(Decoder& m) {
  const Config c = m.cfg;
  m.freeze();
  auto is_attn = [](const std::string& p) { return p.find(".self_attn.") != std::string::npos; };
  const int n = m.map_modules<nn::Linear>(is_attn, [&](const std::string&, nn::Linear& l) {
    return Proj(nn::LoraLinear::from_base(l, c.lora_rank).scale(c.lora_scale));
  });
  if (n != 4 * c.layers) nn::detail::fail("bench_decoder", "expected ", 4 * c.layers, " projections, wrapped ", n);
}

// ---- FLOPs ---------------------------------------------------------------------------------------

/// Multiply-adds counted as 2 FLOPs; attention scores and P V over the full T x T square (what
/// both implementations compute); elementwise work not counted.
inline double step_flops(const Config& c, const std::string& mode, std::int64_t B, std::int64_t T) {
  const double tok = static_cast<double>(B * T), d = static_cast<double>(c.dim);
  const double q = static_cast<double>(c.heads * c.head_dim), kv = static_cast<double>(c.kv_heads * c.head_dim);
  const double ff = static_cast<double>(c.hidden), L = static_cast<double>(c.layers), V = static_cast<double>(c.vocab);
  const double qkvo = d * q + 2 * d * kv + q * d, mlp = 3 * d * ff;
  const double weights = L * (qkvo + mlp) + d * V;
  const double attn = L * 4.0 * static_cast<double>(B * c.heads) * static_cast<double>(T * T) * static_cast<double>(c.head_dim);
  const double fwd = 2 * tok * weights + attn;
  if (mode == "forward") return fwd;
  if (mode == "full") return 3 * fwd;  // backward: d(input) and d(weight) of every product
  // lora: backward takes d(input) only, except where nothing upstream trains (layer 0's q, k, v
  // read the frozen embedding); attention's backward is four products (dP = dO V^T, dV = P^T dO,
  // dQ = dS K, dK = dS^T Q), twice its forward's two; the adapters add x A and (x A) B forward,
  // their three products back.
  const double r = static_cast<double>(c.lora_rank);
  const double lora = L * tok * 2 * (r * (d + q) + r * (d + kv) * 2 + r * (q + d));
  return fwd + (2 * tok * (weights - (d * q + 2 * d * kv)) + 2 * attn) + 3 * lora;
}

}  // namespace bench::decoder
