// SPDX-License-Identifier: MIT OR Apache-2.0
// Back to llama.cpp: a (fused) model as a GGUF file that llama.cpp, ollama and LM Studio run, and
// a LoRA adapter in llama.cpp's GGUF LoRA format (`llama-cli --lora`).
//
// save_gguf writes every tensor of a float model (fuse LoRA layers and dequantize a quantized
// base first) under llama.cpp's names (load.hpp's GgufNames), with Llama's q/k rows permuted as
// convert_hf_to_gguf.py permutes them, in the types an --outtype picks:
//   f32 | f16 | bf16      every matrix in that type, 1-D tensors (norms, biases) in F32, as
//                         convert_hf_to_gguf.py writes them;
//   q8_0 | q4_0 | q4_k_m | q5_k_m   llama-quantize's mixtures (llama-quant.cpp's
//                         llama_tensor_get_type, no importance matrix), gguf_mixture_type below;
//   same                  each tensor in the source GGUF's type for it.
// The metadata (architecture, hyperparameters, tokenizer, chat template) is carried over from the
// source GGUF key for key; general.file_type and general.quantization_version are set anew.
//
// save_gguf_adapter writes llama.cpp's adapter file, the layout convert_lora_to_gguf.py writes
// from a PEFT adapter: general.type = "adapter", adapter.type = "lora", adapter.lora.alpha, and
// per adapted matrix W (out, in) of llama.cpp name N: N.lora_a (r, in) and N.lora_b (out, r)
// (PEFT's lora_A / lora_B; ggml ne reversed), q/k's lora_b rows permuted as W's. llama.cpp
// applies W + (alpha / r) · lora_b · lora_a, so alpha = effective scale · r.
#pragma once

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <map>
#include <string>
#include <vector>

#include "../tape.hpp"
#include "adapters.hpp"
#include "gguf.hpp"
#include "gguf_quantize.hpp"
#include "gguf_write.hpp"
#include "load.hpp"
#include "model.hpp"

namespace nn::lm {

/// The --outtype values save_gguf takes.
inline const std::vector<std::string>& gguf_outtypes() {
  static const std::vector<std::string> v{"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "same"};
  return v;
}

namespace detail {

inline std::uint32_t ggml_block(std::uint32_t type) { return ggml_type_info(type)->block; }

/// llama.cpp's llama_ftype for general.file_type.
inline std::uint32_t gguf_file_type(const std::string& outtype) {
  static const std::map<std::string, std::uint32_t> m{{"f32", 0}, {"f16", 1}, {"q4_0", 2}, {"q8_0", 7},
                                                      {"q4_k_m", 15}, {"q5_k_m", 17}, {"bf16", 32}};
  return m.at(outtype);
}

}  // namespace detail

/// The ggml type llama.cpp gives tensor `name` (llama.cpp's name; `row` = ne[0], its row length;
/// `dims` its dimension count) in mixture `outtype` (not "same"); `layer` / `n_layers` place a
/// blk.N tensor; `tied` says token_embd is also the output matrix. As llama-quant.cpp:
///   1-D tensors and norms stay F32; f32 / f16 / bf16 put every matrix in that type;
///   the output matrix (output.weight, or token_embd when tied) takes Q6_K, unless its rows do
///   not split into the mixture's blocks (then Q8_0) or the mixture is q8_0;
///   q4_k_m: attn_v and ffn_down of the layers use_more_bits picks (the first and last eighth,
///   every third between) take Q6_K; q5_k_m: the same; everything else the mixture's base type
///   (Q8_0, Q4_0, Q4_K, Q5_K);
///   then rows that do not split into 256 fall back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
///   and a type still not fitting (rows not a multiple of 32) -> F16.
inline std::uint32_t gguf_mixture_type(const std::string& outtype, const std::string& name, std::int64_t row, int dims,
                                       int layer, int n_layers, bool tied) {
  constexpr std::uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30;
  const bool matrix = dims >= 2 && name.ends_with("weight") && name.find("_norm.weight") == std::string::npos;
  if (!matrix) return F32;
  if (outtype == "f32") return F32;
  if (outtype == "f16") return F16;
  if (outtype == "bf16") return BF16;
  std::uint32_t t = outtype == "q8_0" ? Q8_0 : outtype == "q4_0" ? Q4_0 : outtype == "q4_k_m" ? Q4_K
                  : outtype == "q5_k_m" ? Q5_K : 0;
  if (t == 0) nn::detail::fail("gguf", "unknown --outtype '", outtype, "' (f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m same)");
  const bool km = outtype == "q4_k_m" || outtype == "q5_k_m";
  auto use_more_bits = [](int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; };
  if (name == "output.weight" || (tied && name == "token_embd.weight")) {
    if (row % detail::ggml_block(t) != 0) t = Q8_0;
    else if (t != Q8_0) t = Q6_K;
  } else if (name.ends_with(".attn_v.weight") || name.ends_with(".ffn_down.weight")) {
    if (km && use_more_bits(layer, n_layers)) t = Q6_K;
  }
  if (row % detail::ggml_block(t) != 0) {
    t = t == Q4_K ? Q5_0 : t == Q5_K ? Q5_1 : t == Q6_K ? Q8_0 : t;
    if (row % detail::ggml_block(t) != 0) t = F16;
  }
  return t;
}

struct GgufExportReport {
  std::map<std::string, int> types;  // ggml type name -> tensor count
  std::uint64_t bytes = 0;           // tensor data
};

/// Writes `model` (float weights: no LoRA, no quantized layers left) to `path` as a GGUF file in
/// `outtype` (gguf_outtypes()), with the metadata of `source` (the GGUF it was loaded from).
/// Raises, leaving no file, for an architecture llama.cpp cannot name, a tensor with no llama.cpp
/// name, a LoRA or quantized layer still in the model, an outtype "same" type nn does not write,
/// and any write error.
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model, const GgufFile& source,
                                  const std::string& outtype = "f16") {
  const ModelConfig& c = model.config();
  if (c.arch != Arch::llama && c.arch != Arch::qwen2)
    nn::detail::fail("gguf", path.string(), ": cannot export architecture '", c.model_type, "' (llama, qwen2)");
  const std::string arch = c.arch == Arch::qwen2 ? "qwen2" : "llama";
  if (const GgufValue* a = source.find("general.architecture"); a && a->is_string() && a->as_string() != arch)
    nn::detail::fail("gguf", path.string(), ": the source ", source.path(), " is a '", a->as_string(),
                     "' model, this one '", arch, "'");
  bool known = false;
  for (const std::string& o : gguf_outtypes()) known |= o == outtype;
  if (!known) nn::detail::fail("gguf", path.string(), ": unknown --outtype '", outtype, "' (f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m same)");

  GgufWriter w;
  for (const auto& [key, v] : source.metadata())
    if (key != "general.file_type" && key != "general.quantization_version" && key != "general.alignment") w.copy(key, v);
  w.set("general.architecture", arch);

  GgufExportReport report;
  const int n_layers = static_cast<int>(c.num_hidden_layers);
  bool quantized = false;
  const NamedTensors params = model.parameters();
  for (const auto& [hf, t0] : params)
    if (hf.ends_with(".lora_a") || hf.ends_with(".lora_b"))
      nn::detail::fail("gguf", path.string(), ": the model still has LoRA layers (", hf, "): fuse them first");
  for (const auto& [hf, t0] : params) {
    if (hf.ends_with(".scales") || hf.ends_with(".biases") || !is_floating(t0.dtype()))
      nn::detail::fail("gguf", path.string(), ": tensor \"", hf, "\" belongs to a quantized layer: dequantize the model first");
    const std::string g = detail::hf_to_gguf_name(hf, path.string());
    Tensor t = t0.to(DType::f32);
    if (c.arch == Arch::llama) {  // llama.cpp runs Llama with interleaved RoPE pairs
      if (g.find(".attn_q.") != std::string::npos) t = detail::permute_rows(t, c.num_attention_heads, g, true);
      if (g.find(".attn_k.") != std::string::npos) t = detail::permute_rows(t, c.num_key_value_heads, g, true);
    }
    int layer = -1;
    if (g.rfind("blk.", 0) == 0) layer = std::stoi(g.substr(4, g.find('.', 4) - 4));
    std::uint32_t type;
    if (outtype == "same") {
      const GgufTensorInfo* src = source.find_tensor(g);
      if (!src) nn::detail::fail("gguf", path.string(), ": --outtype same, but the source has no tensor \"", g, "\"");
      type = src->type;
      if (!gguf_can_quantize(type))
        nn::detail::fail("gguf", path.string(), ": tensor \"", g, "\" is ", src->type_name(),
                         " in the source, a type nn does not write (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K); choose --outtype");
    } else {
      type = gguf_mixture_type(outtype, g, t.dim(t.rank() - 1), static_cast<int>(t.rank()), layer, n_layers,
                               c.tie_word_embeddings);
    }
    quantized |= ggml_type_info(type)->block > 1;
    std::vector<std::byte> bytes = gguf_quantize(t, type, g);
    report.bytes += bytes.size();
    ++report.types[ggml_type_info(type)->name];
    w.add_tensor(g, t.shape().vec(), type, std::move(bytes));
  }
  // llama.cpp's Llama 3 frequency remap is a tensor of its own; carried over as it was.
  if (const GgufTensorInfo* rf = source.find_tensor("rope_freqs.weight")) {
    const auto b = source.tensor_bytes(*rf);
    w.add_tensor(rf->name, rf->shape(), rf->type, std::vector<std::byte>(b.begin(), b.end()));
  }
  if (outtype == "same") {
    if (const GgufValue* ft = source.find("general.file_type")) w.copy("general.file_type", *ft);
  } else {
    w.set("general.file_type", detail::gguf_file_type(outtype));
  }
  if (quantized) w.set("general.quantization_version", std::uint32_t{2});
  w.write(path);
  return report;
}

/// Writes the LoRA layers of `model` (trained with `cfg`) as a llama.cpp GGUF LoRA adapter for a
/// base of architecture `arch` ("llama" / "qwen2"; the base's general.architecture). Factors in
/// F32. Raises, leaving no file, when the model has no LoRA layers or one has no llama.cpp name.
template <class M>
void save_gguf_adapter(const std::filesystem::path& path, const M& model, const LoraConfig& cfg, const ModelConfig& c) {
  if (c.arch != Arch::llama && c.arch != Arch::qwen2)
    nn::detail::fail("gguf", path.string(), ": cannot export an adapter for architecture '", c.model_type, "' (llama, qwen2)");
  GgufWriter w;
  w.set("general.architecture", c.arch == Arch::qwen2 ? "qwen2" : "llama");
  w.set("general.type", "adapter");
  w.set("adapter.type", "lora");
  const double eff = cfg.rslora ? cfg.scale / std::sqrt(static_cast<double>(cfg.rank)) : cfg.scale;
  w.set("adapter.lora.alpha", static_cast<float>(eff * static_cast<double>(cfg.rank)));
  GTape<cpu> tp;
  int n = 0;
  for (auto& [p, v] : model.trainable_parameters()) {
    const bool a = p.ends_with(".lora_a"), b = p.ends_with(".lora_b");
    if (!a && !b) continue;
    const std::string g = detail::hf_to_gguf_name(p.substr(0, p.size() - 7) + ".weight", path.string());
    // mlx-lm's factors (in, r) and (r, out), transposed to PEFT's (r, in) and (out, r).
    Tensor t = tp.value(transpose(tp, tp.constant(v))).to(DType::f32);
    if (b && c.arch == Arch::llama) {
      if (g.find(".attn_q.") != std::string::npos) t = detail::permute_rows(t, c.num_attention_heads, g, true);
      if (g.find(".attn_k.") != std::string::npos) t = detail::permute_rows(t, c.num_key_value_heads, g, true);
    }
    w.add_tensor(g + (a ? ".lora_a" : ".lora_b"), t.shape().vec(), 0, gguf_quantize(t, 0, g));
    ++n;
  }
  if (n == 0) nn::detail::fail("gguf", path.string(), ": the model has no LoRA layers to export");
  w.write(path);
}

}  // namespace nn::lm
