// SPDX-License-Identifier: MIT OR Apache-2.0
// A pretrained model and its tokenizer from a Hugging Face folder (config.json, safetensors,
// tokenizer.json) or a GGUF file (weights, hyperparameters and tokenizer in its metadata).
#pragma once

#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>

#include "adapters.hpp"
#include "data.hpp"
#include "gguf.hpp"
#include "load.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace nn::lm {

struct Pretrained {
  CausalLM model;
  Tokenizer tokenizer;
  /// The model's chat template (Jinja source; empty when it has none): a folder's
  /// chat_template.jinja or tokenizer_config.json "chat_template", a GGUF's tokenizer.chat_template.
  std::string chat_template;
};

/// The chat template of a Hugging Face folder, as transformers finds it: chat_template.jinja,
/// else tokenizer_config.json's "chat_template" (a string, or a list of {name, template} whose
/// "default" entry is used). Empty when there is none.
inline std::string hf_chat_template(const std::filesystem::path& folder) {
  if (std::filesystem::exists(folder / "chat_template.jinja")) {
    std::ifstream f(folder / "chat_template.jinja", std::ios::binary);
    if (!f) nn::detail::fail("load_pretrained", (folder / "chat_template.jinja").string(), ": cannot open");
    return std::string(std::istreambuf_iterator<char>(f), {});
  }
  const auto cfg = folder / "tokenizer_config.json";
  if (!std::filesystem::exists(cfg)) return "";
  const nlohmann::json j = detail::read_json_file(cfg, "load_pretrained");
  auto it = j.find("chat_template");
  if (it == j.end() || it->is_null()) return "";
  if (it->is_string()) return it->get<std::string>();
  if (it->is_array())
    for (const auto& t : *it)
      if (t.is_object() && t.value("name", "") == "default" && t.contains("template") && t["template"].is_string())
        return t["template"].get<std::string>();
  nn::detail::fail("load_pretrained", cfg.string(), ": chat_template must be a string or a list with a \"default\" entry");
}

/// The tokenizer a GGUF file carries (tokenizer.ggml.*), built by Tokenizer::from_gguf.
inline Tokenizer gguf_tokenizer(const GgufFile& f) {
  GgufTokenizerMetadata m = f.tokenizer();
  if (m.eot_id) m.eos_id = m.eot_id;  // chat models end a turn with EOT
  return Tokenizer::from_gguf_metadata(m, f.path());  // ids range-checked at their 64-bit width
}

/// Replaces every QuantizedLinear / QuantizedEmbedding of `model` by its full-precision layer
/// (mx.dequantize of the weight, in the scales' dtype, or in `dtype` when given). Returns how
/// many were replaced.
template <class M>
int dequantize_layers(M& model, std::optional<DType> dtype = std::nullopt) {
  auto all = [](const std::string&) { return true; };
  auto cast = [&](Param& p) {
    if (dtype && p.value.dtype() != *dtype) p.value = p.value.to(*dtype);
  };
  int n = model.template map_modules<QuantizedLinear>(all, [&](const std::string&, const QuantizedLinear& q) {
    Linear l = q.dequantized();
    cast(l.weight);
    if (l.bias) cast(*l.bias);
    return l;
  });
  n += model.template map_modules<QuantizedEmbedding>(all, [&](const std::string&, const QuantizedEmbedding& q) {
    Embedding e = q.dequantized();
    cast(e.weight);
    return e;
  });
  return n;
}

/// Loads `path`: a folder (config.json + model.safetensors or a sharded index + tokenizer.json)
/// or a .gguf file. Weights are converted to `dtype`. With keep_quantized, a GGUF's quantized
/// matrices (load_gguf) and an mlx-lm quantized folder's layers (load_hf) stay quantized;
/// without it both come back as `dtype` layers.
inline Pretrained load_pretrained(const std::filesystem::path& path, DType dtype = DType::f32,
                                  bool keep_quantized = false) {
  if (!std::filesystem::exists(path)) nn::detail::fail("load_pretrained", path.string(), ": no such file or folder");
  if (std::filesystem::is_directory(path)) {
    const auto tok = path / "tokenizer.json";
    if (!std::filesystem::exists(tok)) nn::detail::fail("load_pretrained", tok.string(), ": missing (a BPE tokenizer.json)");
    CausalLM m = load_hf(path, dtype);
    if (!keep_quantized) dequantize_layers(m, dtype);
    return {std::move(m), Tokenizer::from_file(tok.string()), hf_chat_template(path)};
  }
  GgufFile f(path);
  return {load_gguf(f, dtype, keep_quantized), gguf_tokenizer(f), f.tokenizer().chat_template};
}

/// Writes `model` as a Hugging Face folder: config.json and model.safetensors (its dtype), so
/// transformers' from_pretrained loads it. A LoRA model should be fused first (LoraLinear::fused),
/// and a quantized one dequantized (dequantize_layers).
inline void save_hf(const std::filesystem::path& folder, const CausalLM& model) {
  const ModelConfig& c = model.config();
  std::filesystem::create_directories(folder);
  nlohmann::json j = {{"architectures", {hf_architecture(c.arch)}},
                      {"model_type", arch_name(c.arch)},
                      {"hidden_size", c.hidden_size},
                      {"intermediate_size", c.intermediate_size},
                      {"num_hidden_layers", c.num_hidden_layers},
                      {"num_attention_heads", c.num_attention_heads},
                      {"num_key_value_heads", c.num_key_value_heads},
                      {"head_dim", c.head_dim},
                      {"vocab_size", c.vocab_size},
                      {"max_position_embeddings", c.max_position_embeddings},
                      {"rms_norm_eps", c.rms_norm_eps},
                      {"rope_theta", c.rope_theta},
                      {"tie_word_embeddings", c.tie_word_embeddings},
                      {c.gelu_mlp ? "hidden_activation" : "hidden_act", c.gelu_mlp ? "gelu_pytorch_tanh" : "silu"},
                      {"torch_dtype", model.dtype() == DType::f64 ? "float64" : "float32"}};
  if (c.arch == Arch::llama || c.arch == Arch::qwen3) j["attention_bias"] = c.qkv_bias;  // Qwen2, Phi-3: fixed
  const bool gemma = c.arch == Arch::gemma2 || c.arch == Arch::gemma3;
  if (c.arch == Arch::phi3 || gemma || c.arch == Arch::mistral)
    j["sliding_window"] = c.sliding_window > 0 ? nlohmann::json(c.sliding_window) : nlohmann::json();
  if (gemma) {
    j["attention_bias"] = c.qkv_bias;
    j["query_pre_attn_scalar"] = c.query_pre_attn_scalar;
    auto cap = [](double v) { return v > 0 ? nlohmann::json(v) : nlohmann::json(); };
    j["attn_logit_softcapping"] = cap(c.attn_logit_softcapping);
    j["final_logit_softcapping"] = cap(c.final_logit_softcapping);
  }
  if (c.arch == Arch::qwen2 || c.arch == Arch::qwen3) {
    j["use_sliding_window"] = c.sliding_window > 0;
    if (c.sliding_window > 0) {
      std::int64_t from = 0;  // max_window_layers for transformers < 4.53, which reads no layer_types
      while (from < c.num_hidden_layers && !c.sliding_layer(from)) ++from;
      j["sliding_window"] = c.sliding_window;
      j["max_window_layers"] = from;
    }
  }
  if (c.arch == Arch::gemma3 || !c.sliding_layers.empty()) {
    // layer_types for transformers >= 4.53; sliding_window_pattern too where the kinds follow one
    // (4.50-4.52 read only that)
    nlohmann::json kinds = nlohmann::json::array();
    for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) kinds.push_back(c.sliding_layer(i) ? "sliding_attention" : "full_attention");
    j["layer_types"] = kinds;
    for (std::int64_t p = 1; c.arch == Arch::gemma3 && p <= c.num_hidden_layers + 1; ++p) {
      bool fits = true;
      for (std::int64_t i = 0; i < c.num_hidden_layers && fits; ++i) fits = c.sliding_layer(i) == ((i + 1) % p != 0);
      if (fits) {
        j["sliding_window_pattern"] = p;
        break;
      }
    }
    if (c.arch == Arch::gemma3) j["rope_local_base_freq"] = c.rope_local_base_freq;
  }
  if (c.arch == Arch::llama) j["mlp_bias"] = c.mlp_bias;
  const RopeScaling& rs = c.rope_scaling;
  if (rs.type == "linear") j["rope_scaling"] = {{"rope_type", "linear"}, {"factor", rs.factor}};
  else if (rs.type == "llama3")
    j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", rs.factor}, {"low_freq_factor", rs.low_freq_factor},
                         {"high_freq_factor", rs.high_freq_factor},
                         {"original_max_position_embeddings", rs.original_max_position_embeddings}};
  else if (rs.type != "default" && !rs.type.empty())
    nn::detail::fail("save_hf", "writing rope_scaling '", rs.type, "' is not supported");
  if (!c.rope_freq_factors.empty())  // a GGUF's rope_freqs tensor: config.json has no field for it
    nn::detail::fail("save_hf", "the model's RoPE frequencies come from a GGUF rope_freqs tensor, which config.json cannot express");
  for (const auto& [path, t] : model.parameters())
    if (path.ends_with(".lora_a") || path.ends_with(".lora_b"))
      nn::detail::fail("save_hf", "the model still has LoRA layers (", path, "): fuse them first");
  NamedTensors w = detail::join_fused(c, model.parameters());  // Phi-3: qkv_proj, gate_up_proj
  save_safetensors(folder / "model.safetensors", w, {{"format", "pt"}});
  detail::write_text(folder / "config.json", j.dump(2) + "\n");
}

/// The TextEncoder view of a Tokenizer for the data layer: special tokens in the text (ChatML's
/// <|im_start|>) are parsed, no BOS/EOS is added (the templates and the data layer write them).
struct TokenizerText {
  const Tokenizer& tok;
  std::vector<std::int32_t> encode(const std::string& s, bool add_special) const {
    EncodeOptions o;
    o.add_special_tokens = add_special;
    return tok.encode(s, o);
  }
  std::int32_t eos_id() const {
    if (!tok.eos_id()) nn::detail::fail("data", "the tokenizer has no end-of-sequence token (set one in tokenizer_config.json)");
    return *tok.eos_id();
  }
};

}  // namespace nn::lm
