// SPDX-License-Identifier: MIT OR Apache-2.0
// nn 0.1.0 LLM kit in one header (nn::lm, include/nn/lm.hpp), on top of nn.hpp beside it.
//
// GENERATED FILE - DO NOT EDIT. Edit include/nn/ and run tools/amalgamate; the CTest test
// amalgamate_fresh (tools/amalgamate --check) fails while this file is stale.
// Needs Eigen 3.3+ and nlohmann_json 3.2+ on the include path (and cblas.h with -DNN_USE_BLAS).
//
// Inlined, in order: nn/lm.hpp, nn/lm/config.hpp, nn/lm/json.hpp, nn/lm/model.hpp, nn/lm/gguf.hpp,
// nn/lm/load.hpp, nn/lm/adapters.hpp, nn/lm/tokenizer.hpp, nn/lm/regex.hpp, nn/lm/unicode.hpp,
// nn/lm/unicode_data.hpp, nn/lm/chat_template.hpp, nn/lm/data.hpp, nn/lm/pretrained.hpp,
// nn/lm/gguf_write.hpp, nn/lm/gguf_quantize.hpp, nn/lm/gguf_export.hpp
#pragma once

#include "nn.hpp"

// ---- begin nn/lm.hpp ----
// The LLM kit's umbrella: nn's core plus nn::lm (Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / SmolLM decoders, Hugging
// Face and GGUF loading, BPE tokenizers (byte-level and SentencePiece-style), chat templates,
// JSONL data, LoRA / DoRA by path and adapter files).
// Kept out of <nn/nn.hpp> so a program that only trains its own model does not compile it.

// ---- begin nn/lm/config.hpp ----
// ModelConfig: the hyperparameters of a Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 / Mistral /
// SmolLM decoder, parsed from a Hugging Face config.json (transformers' LlamaConfig, Qwen2Config,
// Qwen3Config, Phi3Config, Gemma2Config, Gemma3TextConfig, MistralConfig) with errors that name the
// file and field.

#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <limits>
#include <optional>
#include <string_view>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

// ---- begin nn/lm/json.hpp ----
// Strict JSON for the LLM kit's files (config.json, tokenizer.json, tokenizer_config.json,
// adapter configs, safetensors indexes, JSONL records): one reader, so every loader refuses the
// same things with errors that name the file and where.
//
// nlohmann::json ends its input at a NUL byte, so `{"text":"a"}\0{"text":"b"}` would parse as the
// first document and drop the rest silently. JSON text holds no NUL (RFC 8259: control characters
// appear only escaped), so a NUL anywhere is refused with its offset; anything after the document
// but whitespace is refused by the strict parse, with nlohmann's line and column.

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>


namespace nn::lm::detail {

/// Parses `text` (all of it) as one JSON document; `who` and `label` (the file, with a line for
/// JSONL) lead errors.
inline nlohmann::json parse_json_strict(std::string_view text, std::string_view who, const std::string& label) {
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    nn::detail::fail(who, label, ": a NUL byte at offset ", nul, " (JSON text holds none; the rest would be dropped)");
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    nn::detail::fail(who, label, ": not valid JSON (", e.what(), ")");
  }
}

/// Reads and parses a whole JSON file strictly (parse_json_strict).
inline nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view who) {
  std::ifstream in(path, std::ios::binary);
  if (!in) nn::detail::fail(who, path.string(), ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_json_strict(ss.str(), who, path.string());
}

}  // namespace nn::lm::detail
// ---- end nn/lm/json.hpp ----

namespace nn::lm {

/// The decoder families this kit runs. SmolLM / SmolLM2 checkpoints are Llama models
/// (their config.json says "model_type": "llama"). Qwen3 is Qwen2 without the q/k/v biases and
/// with an RMSNorm on each head's query and key (q_norm, k_norm) before RoPE. Phi-3 is Llama
/// with q/k/v stored as one qkv_proj and gate/up as one gate_up_proj (its checkpoints only: nn
/// splits them on load and joins them on save, see detail::fused_projections) and a sliding
/// window on attention (Qwen2 and Qwen3 too under use_sliding_window, on the layers from
/// max_window_layers on). Gemma 2 scales the embeddings by sqrt(hidden), normalises with (1 + w),
/// wraps attention and MLP in norms before and after ("sandwich"), runs a GeGLU MLP (tanh GELU),
/// caps attention scores and logits softly (cap * tanh(x / cap)) and slides a window over every
/// other layer's attention (the even ones). Gemma 3's text models (model_type "gemma3_text":
/// gemma-3-270m, gemma-3-1b) are Gemma 2 with Qwen3's per-head q/k norms (as (1 + w) norms),
/// no soft caps by default, and the layers named by layer_types (every sixth global, the others
/// sliding) running RoPE of their own base (rope_local_base_freq, unscaled) where the global
/// layers run rope_theta and rope_scaling. Mistral is Llama (no biases) with a sliding window on
/// every layer's attention (MistralConfig's sliding_window: 4096 when absent, none when null);
/// llama.cpp runs it as a "llama" model, and nn writes its GGUF so (without the window).
enum class Arch : std::uint8_t { llama, qwen2, qwen3, phi3, gemma2, gemma3, mistral };

/// The family's model_type in config.json, which is also its GGUF general.architecture.
inline const char* arch_name(Arch a) {
  switch (a) {
    case Arch::llama: return "llama";
    case Arch::qwen2: return "qwen2";
    case Arch::qwen3: return "qwen3";
    case Arch::phi3: return "phi3";
    case Arch::gemma2: return "gemma2";
    case Arch::gemma3: return "gemma3_text";
    case Arch::mistral: return "mistral";
  }
  return "?";
}
/// The family's class in transformers (config.json's "architectures").
inline const char* hf_architecture(Arch a) {
  switch (a) {
    case Arch::llama: return "LlamaForCausalLM";
    case Arch::qwen2: return "Qwen2ForCausalLM";
    case Arch::qwen3: return "Qwen3ForCausalLM";
    case Arch::phi3: return "Phi3ForCausalLM";
    case Arch::gemma2: return "Gemma2ForCausalLM";
    case Arch::gemma3: return "Gemma3ForCausalLM";
    case Arch::mistral: return "MistralForCausalLM";
  }
  return "?";
}
/// model_type / general.architecture -> family; nullopt for one nn does not run.
inline std::optional<Arch> arch_from_name(std::string_view name) {
  if (name == "llama" || name == "smollm") return Arch::llama;
  for (Arch a : {Arch::qwen2, Arch::qwen3, Arch::phi3, Arch::gemma2, Arch::gemma3, Arch::mistral})
    if (name == arch_name(a)) return a;
  return std::nullopt;
}
/// What the unsupported-family errors list.
inline constexpr const char* kSupportedFamilies = "llama (also SmolLM / SmolLM2), qwen2, qwen3, phi3, gemma2, gemma3_text, mistral";
/// The family's general.architecture in GGUF files: llama.cpp's converter writes Mistral as
/// "llama" (its q/k rows permuted for llama.cpp's interleaved RoPE, see uses_llama_rope_layout).
inline const char* gguf_arch_name(Arch a) {
  return a == Arch::mistral ? "llama" : a == Arch::gemma3 ? "gemma3" : arch_name(a);
}
/// Whether llama.cpp runs the family with interleaved RoPE pairs, so its GGUF q/k rows are
/// permuted (convert_hf_to_gguf.py's LlamaModel, which also converts Mistral).
inline bool uses_llama_rope_layout(Arch a) { return a == Arch::llama || a == Arch::mistral; }

/// rope_scaling of config.json. "default" is plain RoPE; "linear" divides every frequency by
/// `factor` (position interpolation, Chen et al. 2023); "llama3" is Meta's Llama 3.1 frequency
/// remap (transformers' _compute_llama3_parameters). Other types (dynamic, yarn, longrope) are
/// refused when the config is read, since their tables depend on the sequence length.
struct RopeScaling {
  std::string type = "default";
  double factor = 1.0;
  double low_freq_factor = 1.0;
  double high_freq_factor = 4.0;
  std::int64_t original_max_position_embeddings = 0;
};

/// Everything the model needs to lay out its weights and run.
struct ModelConfig {
  Arch arch = Arch::llama;
  std::string model_type = "llama";  // as written in the file
  std::int64_t hidden_size = 0;
  std::int64_t intermediate_size = 0;
  std::int64_t num_hidden_layers = 0;
  std::int64_t num_attention_heads = 0;
  std::int64_t num_key_value_heads = 0;
  std::int64_t head_dim = 0;  // hidden_size / num_attention_heads unless the file says otherwise
  std::int64_t vocab_size = 0;
  std::int64_t max_position_embeddings = 2048;
  double rms_norm_eps = 1e-6;
  double rope_theta = 10000.0;
  bool tie_word_embeddings = false;
  bool qkv_bias = false;   // Qwen2: always; Llama: attention_bias
  bool o_bias = false;     // Llama: attention_bias (HF puts it on o_proj too); Qwen2: never
  bool mlp_bias = false;   // Llama: mlp_bias
  bool qk_norm = false;    // Qwen3: q_norm and k_norm, RMSNorms over head_dim
  /// sliding_window: on the layers window_on() names, a query sees only the keys less than this
  /// many positions back (Phi-3, Mistral: every layer; Gemma 2: the even layers; Gemma 3: those
  /// layer_types calls "sliding_attention"); 0 for none.
  std::int64_t sliding_window = 0;
  /// Per layer, whether it is a "sliding_attention" layer: Gemma 3 (config.json's layer_types, or
  /// its sliding_window_pattern p: layer i slides unless (i + 1) % p == 0), Qwen2 / Qwen3 with
  /// use_sliding_window (layer_types, or the layers from max_window_layers on); empty for the
  /// others, whose rule is in sliding_layer().
  std::vector<bool> sliding_layers;
  /// Gemma 3's rope_local_base_freq: the sliding layers' RoPE base (plain RoPE, no rope_scaling);
  /// 0: every layer runs rope_theta and rope_scaling.
  double rope_local_base_freq = 0;
  // Gemma 2 (all off / zero for the other families):
  bool norm_unit_offset = false;      // every RMSNorm scales by (1 + weight); weights stored as w
  bool sandwich_norms = false;        // post_attention_layernorm on the attention's output,
                                      // pre_/post_feedforward_layernorm around the MLP
  bool gelu_mlp = false;              // down(gelu_tanh(gate) * up) in place of SwiGLU
  double embed_scale = 0;             // embeddings times this (sqrt(hidden_size)); 0: none
  double query_pre_attn_scalar = 0;   // attention scale 1 / sqrt(this); 0: head_dim
  double attn_logit_softcapping = 0;  // scores -> cap * tanh(scores / cap) before the mask; 0: none
  double final_logit_softcapping = 0; // logits -> cap * tanh(logits / cap); 0: none

  /// Whether layer `layer` is of the sliding kind (Gemma 2: the even layers; Gemma 3 and Qwen
  /// with use_sliding_window: by sliding_layers; the others: every layer, with no window when
  /// sliding_window is 0).
  bool sliding_layer(std::int64_t layer) const {
    if (!sliding_layers.empty()) return sliding_layers[static_cast<std::size_t>(layer)];
    return arch != Arch::gemma2 || layer % 2 == 0;
  }
  /// Whether layer `layer`'s attention slides a window (see sliding_window).
  bool window_on(std::int64_t layer) const { return sliding_window > 0 && sliding_layer(layer); }
  /// Whether layer `layer` runs the local RoPE (inv_freq(true); Gemma 3's sliding layers).
  bool local_rope(std::int64_t layer) const { return rope_local_base_freq > 0 && sliding_layer(layer); }
  /// The factor on q k^T: 1 / sqrt(query_pre_attn_scalar or head_dim).
  double attention_scale() const {
    return 1.0 / std::sqrt(query_pre_attn_scalar > 0 ? query_pre_attn_scalar : static_cast<double>(head_dim));
  }
  RopeScaling rope_scaling;
  /// Per-frequency divisors (head_dim / 2 of them) from a GGUF "rope_freqs" tensor, which is how
  /// llama.cpp stores Llama 3's frequency remap; empty for none.
  std::vector<double> rope_freq_factors;

  std::int64_t q_dim() const { return num_attention_heads * head_dim; }
  std::int64_t kv_dim() const { return num_key_value_heads * head_dim; }

  /// The RoPE inverse frequencies, head_dim / 2 of them, in double:
  ///   inv_freq[i] = 1 / theta^(2i / head_dim)        (HF's _compute_default_rope_parameters)
  /// then remapped by rope_scaling and divided by rope_freq_factors. local: Gemma 3's sliding
  /// layers, theta = rope_local_base_freq and nothing remapped (transformers' rotary_emb_local).
  std::vector<double> inv_freq(bool local = false) const {
    const std::int64_t half = head_dim / 2;
    const double theta = local ? rope_local_base_freq : rope_theta;
    std::vector<double> f(static_cast<std::size_t>(half));
    for (std::int64_t i = 0; i < half; ++i)
      f[static_cast<std::size_t>(i)] =
          1.0 / std::pow(theta, static_cast<double>(2 * i) / static_cast<double>(head_dim));
    if (local) return f;
    const RopeScaling& s = rope_scaling;
    if (s.type == "linear") {
      for (double& x : f) x /= s.factor;
    } else if (s.type == "llama3") {
      // Long wavelengths are slowed by `factor`, short ones kept, the band between blended
      // linearly in (original context / wavelength).
      const double old_ctx = static_cast<double>(s.original_max_position_embeddings);
      const double low_wavelen = old_ctx / s.low_freq_factor, high_wavelen = old_ctx / s.high_freq_factor;
      const double pi = 3.14159265358979323846;
      for (double& x : f) {
        const double wavelen = 2 * pi / x;
        const double scaled = wavelen > low_wavelen ? x / s.factor : x;
        if (!(wavelen < high_wavelen) && !(wavelen > low_wavelen)) {
          const double smooth = (old_ctx / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor);
          x = (1 - smooth) * scaled / s.factor + smooth * scaled;
        } else {
          x = scaled;
        }
      }
    }
    for (std::size_t i = 0; i < rope_freq_factors.size() && i < f.size(); ++i) f[i] /= rope_freq_factors[i];
    return f;
  }

  /// The limits validate() holds a config to, before anything is allocated: far above any released
  /// model (Llama 3.1 405B: 126 layers, width 16384, 128 heads, 128256 tokens; Gemma 3: 262144
  /// tokens), low enough that a corrupt number is refused by name instead of by a failed
  /// allocation. kMaxParameters (2^40, 4 TiB of float32) bounds the whole model.
  static constexpr std::int64_t kMaxLayers = 1024, kMaxWidth = std::int64_t{1} << 20, kMaxHeads = 4096,
                                kMaxVocab = std::int64_t{1} << 24, kMaxPositions = std::int64_t{1} << 30,
                                kMaxParameters = std::int64_t{1} << 40;
  /// How many weights the model's matrices hold (the projections, the embedding and an untied
  /// head; norms and biases left out): a lower bound on its parameter count, in double so that no
  /// size overflows it.
  double matrix_parameters() const {
    const double H = static_cast<double>(hidden_size), D = static_cast<double>(head_dim);
    const double per_layer = H * D * static_cast<double>(2 * num_attention_heads + 2 * num_key_value_heads) +
                             3 * H * static_cast<double>(intermediate_size);
    return per_layer * static_cast<double>(num_hidden_layers) +
           static_cast<double>(vocab_size) * H * (tie_word_embeddings ? 1 : 2);
  }
  /// Raises "[config] <label>: field "<field>" must be ..." unless 0 < v <= max.
  static void check_size(const std::string& label, std::string_view field, std::int64_t v, std::int64_t max) {
    if (v <= 0 || v > max)
      nn::detail::fail("config", label, ": field \"", field, "\" must be a positive integer",
                       v > max ? " at most " + std::to_string(max) : std::string(), ", got ", v);
  }

  /// Raises "[config] <label>: ..." when the numbers cannot describe a model, or describe one
  /// beyond the limits above.
  void validate(const std::string& label) const {
    check_size(label, "hidden_size", hidden_size, kMaxWidth);
    check_size(label, "intermediate_size", intermediate_size, kMaxWidth);
    check_size(label, "num_hidden_layers", num_hidden_layers, kMaxLayers);
    check_size(label, "num_attention_heads", num_attention_heads, kMaxHeads);
    check_size(label, "num_key_value_heads", num_key_value_heads, kMaxHeads);
    check_size(label, "head_dim", head_dim, kMaxWidth);
    check_size(label, "vocab_size", vocab_size, kMaxVocab);
    check_size(label, "max_position_embeddings", max_position_embeddings, kMaxPositions);
    const double total = matrix_parameters();
    if (total > static_cast<double>(kMaxParameters))
      nn::detail::fail("config", label, ": the config describes ", total, " parameters, more than the limit of 2^40");
    if (num_attention_heads % num_key_value_heads != 0)
      nn::detail::fail("config", label, ": field \"num_key_value_heads\" (", num_key_value_heads,
                   ") must divide num_attention_heads (", num_attention_heads, ")");
    if (head_dim % 2 != 0) nn::detail::fail("config", label, ": field \"head_dim\" must be even for RoPE, got ", head_dim);
    if (!(rms_norm_eps > 0) || !std::isfinite(rms_norm_eps))
      nn::detail::fail("config", label, ": field \"rms_norm_eps\" must be a positive number, got ", rms_norm_eps);
    if (!(rope_theta > 0) || !std::isfinite(rope_theta))
      nn::detail::fail("config", label, ": field \"rope_theta\" must be a positive number, got ", rope_theta);
    if (rope_local_base_freq < 0 || !std::isfinite(rope_local_base_freq))
      nn::detail::fail("config", label, ": field \"rope_local_base_freq\" must be a positive number, got ", rope_local_base_freq);
    if (!sliding_layers.empty() && static_cast<std::int64_t>(sliding_layers.size()) != num_hidden_layers)
      nn::detail::fail("config", label, ": field \"layer_types\" names ", sliding_layers.size(), " layers for num_hidden_layers ",
                       num_hidden_layers);
    if (!rope_freq_factors.empty() && static_cast<std::int64_t>(rope_freq_factors.size()) != head_dim / 2)
      nn::detail::fail("config", label, ": ", rope_freq_factors.size(), " rope frequency factors for head_dim ", head_dim,
                   " (expected ", head_dim / 2, ")");
  }
};

namespace detail {

/// Typed reads of config.json fields; every error names the file and the field.
struct ConfigReader {
  const nlohmann::json& j;
  const std::string& label;

  const nlohmann::json* find(const char* field) const {
    auto it = j.find(field);
    if (it == j.end() || it->is_null()) return nullptr;  // HF writes null for "not set"
    return &*it;
  }
  [[noreturn]] void bad(const char* field, const char* expected, const nlohmann::json& v) const {
    std::string got = v.dump();
    if (got.size() > 80) got = got.substr(0, 77) + "...";
    nn::detail::fail("config", label, ": field \"", field, "\": expected ", expected, ", got ", got);
  }
  std::int64_t integer(const nlohmann::json& v, const char* field) const {
    if (v.is_number_unsigned()) {
      if (v.get<std::uint64_t>() > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        bad(field, "an integer below 2^63", v);
      return static_cast<std::int64_t>(v.get<std::uint64_t>());
    }
    if (v.is_number_integer()) return v.get<std::int64_t>();
    bad(field, "an integer", v);
  }
  std::int64_t req_int(const char* field) const {
    const nlohmann::json* v = find(field);
    if (!v) nn::detail::fail("config", label, ": missing field \"", field, "\" (an integer)");
    return integer(*v, field);
  }
  std::int64_t opt_int(const char* field, std::int64_t dflt) const {
    const nlohmann::json* v = find(field);
    return v ? integer(*v, field) : dflt;
  }
  double number(const nlohmann::json& v, const char* field) const {
    if (!v.is_number()) bad(field, "a number", v);
    return v.get<double>();
  }
  double opt_num(const char* field, double dflt) const {
    const nlohmann::json* v = find(field);
    return v ? number(*v, field) : dflt;
  }
  bool opt_bool(const char* field, bool dflt) const {
    const nlohmann::json* v = find(field);
    if (!v) return dflt;
    if (!v->is_boolean()) bad(field, "true or false", *v);
    return v->get<bool>();
  }
  std::string opt_str(const char* field, const std::string& dflt) const {
    const nlohmann::json* v = find(field);
    if (!v) return dflt;
    if (!v->is_string()) bad(field, "a string", *v);
    return v->get<std::string>();
  }
};

/// config.json's layer_types (transformers >= 4.53): per layer, whether it is "sliding_attention"
/// (true) or "full_attention"; nullopt when absent. Raises on another kind, or on a list whose
/// length is not num_hidden_layers.
inline std::optional<std::vector<bool>> read_layer_types(const ConfigReader& r, std::int64_t layers) {
  const nlohmann::json* lt = r.find("layer_types");
  if (!lt) return std::nullopt;
  if (!lt->is_array()) r.bad("layer_types", "a list", *lt);
  if (static_cast<std::int64_t>(lt->size()) != layers)
    nn::detail::fail("config", r.label, ": field \"layer_types\" lists ", lt->size(), " layers; num_hidden_layers is ", layers);
  std::vector<bool> kinds;
  for (std::size_t i = 0; i < lt->size(); ++i) {
    const bool sliding = (*lt)[i] == "sliding_attention";
    if (!(sliding || (*lt)[i] == "full_attention"))
      nn::detail::fail("config", r.label, ": field \"layer_types\"[", i, "]: ", (*lt)[i].dump(),
                       " (expected \"sliding_attention\" or \"full_attention\")");
    kinds.push_back(sliding);
  }
  return kinds;
}

}  // namespace detail

namespace detail {

/// A projection a family's checkpoints store as one matrix: the rows of `parts`, in order,
/// stacked. Phi-3 stores q/k/v as self_attn.qkv_proj and gate/up as mlp.gate_up_proj (its MLP
/// takes the first half as the gate, as SwiGLU's gate). nn's model holds the parts, so LoRA,
/// quantization and the kernels see the same projections in every family; the loaders split
/// (detail::split_fused) and the writers join (detail::join_fused) by this one table.
struct FusedProjection {
  std::string fused;                // path inside a decoder layer, "self_attn.qkv_proj"
  std::vector<std::string> parts;   // "self_attn.q_proj", ...
  std::vector<std::int64_t> rows;   // each part's output features
};
inline std::vector<FusedProjection> fused_projections(const ModelConfig& c) {
  if (c.arch != Arch::phi3) return {};
  return {{"self_attn.qkv_proj", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"}, {c.q_dim(), c.kv_dim(), c.kv_dim()}},
          {"mlp.gate_up_proj", {"mlp.gate_proj", "mlp.up_proj"}, {c.intermediate_size, c.intermediate_size}}};
}

}  // namespace detail

/// Parses a config.json document (already read); `label` (the file name) leads every error.
inline ModelConfig config_from_json(const nlohmann::json& j, const std::string& label = "config.json") {
  if (!j.is_object()) nn::detail::fail("config", label, ": expected a JSON object at the top level");
  detail::ConfigReader r{j, label};
  ModelConfig c;
  const nlohmann::json* mt = r.find("model_type");
  if (!mt) nn::detail::fail("config", label, ": missing field \"model_type\" (one of ", kSupportedFamilies, ")");
  if (!mt->is_string()) r.bad("model_type", "a string", *mt);
  c.model_type = mt->get<std::string>();
  if (c.model_type == "gemma3")  // Gemma3Config: the image-text models, the decoder under text_config
    nn::detail::fail("config", label, ": model_type \"gemma3\" is Gemma 3's image-text model (Gemma3ForConditionalGeneration); "
                     "nn runs Gemma 3's text-only checkpoints, model_type \"gemma3_text\" (gemma-3-270m, gemma-3-1b)");
  if (const std::optional<Arch> a = arch_from_name(c.model_type)) c.arch = *a;
  else {
    const nlohmann::json* archs = r.find("architectures");
    nn::detail::fail("config", label, ": model_type \"", c.model_type, "\"",
                     archs ? " (architectures " + archs->dump() + ")" : std::string(),
                     " is not a supported model family (supported: ", kSupportedFamilies, ")");
  }

  const bool gemma = c.arch == Arch::gemma2 || c.arch == Arch::gemma3;
  if (gemma) {  // Gemma2Config / Gemma3TextConfig name the MLP's activation hidden_activation
    const char* field = r.find("hidden_activation") ? "hidden_activation" : "hidden_act";
    const std::string act = r.opt_str(field, "gelu_pytorch_tanh");
    if (act != "gelu_pytorch_tanh")
      nn::detail::fail("config", label, ": field \"", field, "\": \"", act, "\" is not supported (Gemma's GeGLU uses gelu_pytorch_tanh)");
  } else {
    const std::string act = r.opt_str("hidden_act", "silu");
    if (act != "silu")
      nn::detail::fail("config", label, ": field \"hidden_act\": \"", act, "\" is not supported (the SwiGLU MLP uses silu)");
  }
  c.hidden_size = r.req_int("hidden_size");
  c.intermediate_size = r.req_int("intermediate_size");
  c.num_hidden_layers = r.req_int("num_hidden_layers");
  c.num_attention_heads = r.req_int("num_attention_heads");
  c.num_key_value_heads = r.opt_int("num_key_value_heads", c.num_attention_heads);
  c.vocab_size = r.req_int("vocab_size");
  if (c.num_attention_heads > 0 && !r.find("head_dim") && c.hidden_size % c.num_attention_heads != 0)
    nn::detail::fail("config", label, ": field \"hidden_size\" (", c.hidden_size,
                 ") is not a multiple of num_attention_heads (", c.num_attention_heads, ") and no head_dim is given");
  c.head_dim = r.opt_int("head_dim", c.num_attention_heads > 0 ? c.hidden_size / c.num_attention_heads : 0);
  c.max_position_embeddings = r.opt_int("max_position_embeddings", c.arch == Arch::llama     ? 2048
                                                                  : c.arch == Arch::phi3    ? 4096
                                                                  : c.arch == Arch::gemma2  ? 8192
                                                                  : c.arch == Arch::mistral || c.arch == Arch::gemma3 ? 131072
                                                                                            : 32768);
  c.rms_norm_eps = r.opt_num("rms_norm_eps", 1e-6);
  c.rope_theta = r.opt_num("rope_theta", c.arch == Arch::gemma3 ? 1000000.0 : 10000.0);
  c.tie_word_embeddings = r.opt_bool("tie_word_embeddings", gemma);
  if (c.arch == Arch::qwen2) {
    // Qwen2Attention hard-codes bias=True on q/k/v and bias=False on o_proj; the MLP has none.
    c.qkv_bias = true;
  } else if (gemma) {
    // Gemma2Config's / Gemma3TextConfig's defaults where a field is absent; attention_bias on
    // q/k/v/o, no MLP bias.
    const bool g3 = c.arch == Arch::gemma3;
    c.qkv_bias = c.o_bias = r.opt_bool("attention_bias", false);
    c.norm_unit_offset = c.sandwich_norms = c.gelu_mlp = true;
    c.qk_norm = g3;
    c.embed_scale = std::sqrt(static_cast<double>(c.hidden_size));
    c.query_pre_attn_scalar = r.opt_num("query_pre_attn_scalar", g3 ? 256 : 224);
    c.attn_logit_softcapping = r.opt_num("attn_logit_softcapping", 0);
    c.final_logit_softcapping = r.opt_num("final_logit_softcapping", 0);
    c.sliding_window = r.opt_int("sliding_window", 4096);
    if (!(c.query_pre_attn_scalar > 0) || !(c.attn_logit_softcapping >= 0) || !(c.final_logit_softcapping >= 0) ||
        c.sliding_window < 0)
      nn::detail::fail("config", label, ": query_pre_attn_scalar must be positive, the soft caps and sliding_window "
                       "not negative");
    if (g3 && r.opt_bool("use_bidirectional_attention", false))  // EmbeddingGemma: an encoder
      nn::detail::fail("config", label, ": field \"use_bidirectional_attention\": bidirectional attention (EmbeddingGemma) "
                       "is not supported (nn runs causal decoders)");
    // Gemma 3's layer kinds: layer_types (transformers >= 4.53), else sliding_window_pattern
    // (4.50-4.52; "_sliding_window_pattern" later), 6 by default: layer i slides unless (i + 1) % p == 0.
    if (g3) {
      const char* pf = r.find("sliding_window_pattern") ? "sliding_window_pattern" : "_sliding_window_pattern";
      const std::int64_t pattern = r.opt_int(pf, 6);
      if (pattern <= 0) nn::detail::fail("config", label, ": field \"", pf, "\" must be a positive integer, got ", pattern);
      ModelConfig::check_size(label, "num_hidden_layers", c.num_hidden_layers, ModelConfig::kMaxLayers);  // before the list
      for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) c.sliding_layers.push_back((i + 1) % pattern != 0);
      c.rope_local_base_freq = r.opt_num("rope_local_base_freq", 10000.0);  // checked below, wherever it came from
    }
    // Each layer's kind (transformers >= 4.53 writes it for both). Gemma 2 runs its alternation
    // (even layers slide); Gemma 3 takes the list as given.
    if (const std::optional<std::vector<bool>> kinds = detail::read_layer_types(r, c.num_hidden_layers)) {
      if (g3) c.sliding_layers = *kinds;
      else
        for (std::size_t i = 0; i < kinds->size(); ++i)
          if ((*kinds)[i] != (i % 2 == 0))
            nn::detail::fail("config", label, ": field \"layer_types\"[", i, "]: ", r.find("layer_types")->at(i).dump(),
                             " (nn runs Gemma 2's pattern: sliding_attention on even layers, full_attention on odd)");
    }
  } else if (c.arch == Arch::phi3) {
    // Phi3Attention / Phi3MLP: no biases anywhere. Only partial_rotary_factor 1 (Phi-3 itself;
    // Phi-4-mini's 0.75 rotates part of each head).
    c.sliding_window = r.opt_int("sliding_window", 0);
    if (c.sliding_window < 0) nn::detail::fail("config", label, ": field \"sliding_window\" must not be negative, got ", c.sliding_window);
    const nlohmann::json* rp = r.find("rope_parameters");
    const double prf = rp && rp->is_object() && rp->contains("partial_rotary_factor")
                           ? detail::ConfigReader{*rp, label}.opt_num("partial_rotary_factor", 1.0)
                           : r.opt_num("partial_rotary_factor", 1.0);
    if (prf != 1.0)
      nn::detail::fail("config", label, ": field \"partial_rotary_factor\": ", prf,
                       " is not supported (RoPE over whole heads, 1.0, only)");
  } else if (c.arch == Arch::mistral) {
    // MistralAttention / MistralMLP: no biases. MistralConfig's sliding_window is 4096 when the
    // field is absent, and null (written out) means none.
    const auto sw = r.j.find("sliding_window");
    c.sliding_window = sw == r.j.end() ? 4096 : r.opt_int("sliding_window", 0);
    if (c.sliding_window < 0) nn::detail::fail("config", label, ": field \"sliding_window\" must not be negative, got ", c.sliding_window);
  } else {
    // Llama and Qwen3: attention_bias on q/k/v and o_proj; Qwen3's MLP has no bias field
    c.qkv_bias = c.o_bias = r.opt_bool("attention_bias", false);
    c.mlp_bias = r.opt_bool("mlp_bias", false);
  }
  if (c.arch == Arch::qwen3) c.qk_norm = true;
  if (c.arch == Arch::qwen2 || c.arch == Arch::qwen3) {
    // Qwen2Config / Qwen3Config: use_sliding_window (off in every released Qwen2.5 / Qwen3
    // checkpoint) slides sliding_window (4096 when absent) over the layers from
    // max_window_layers (28) on, or over those layer_types names; without it no layer slides.
    if (r.opt_bool("use_sliding_window", false)) {
      const auto sw = r.j.find("sliding_window");  // null: transformers slides no layer
      c.sliding_window = sw == r.j.end() ? 4096 : r.opt_int("sliding_window", 0);
      const std::int64_t from = r.opt_int("max_window_layers", 28);
      if (c.sliding_window < 0 || from < 0)
        nn::detail::fail("config", label, ": fields \"sliding_window\" (", c.sliding_window, ") and \"max_window_layers\" (",
                         from, ") must not be negative");
      ModelConfig::check_size(label, "num_hidden_layers", c.num_hidden_layers, ModelConfig::kMaxLayers);  // before the list
      for (std::int64_t i = 0; i < c.num_hidden_layers; ++i) c.sliding_layers.push_back(i >= from);
      if (const std::optional<std::vector<bool>> kinds = detail::read_layer_types(r, c.num_hidden_layers)) c.sliding_layers = *kinds;
    }
  }

  // RoPE's scaling: "rope_scaling" (transformers 4), or "rope_parameters" (transformers 5, which
  // writes rope_theta there too and no top-level rope_theta).
  std::string rope_field = r.find("rope_parameters") ? "rope_parameters" : "rope_scaling";
  if (const nlohmann::json* rs = r.find(rope_field.c_str())) {
    if (!rs->is_object()) r.bad(rope_field.c_str(), "null or an object", *rs);
    // transformers 5's Gemma 3 keys them by layer kind: the sliding layers' (plain RoPE, whose
    // base is rope_local_base_freq) and the global layers' (read as every other family's)
    if (c.arch == Arch::gemma3 && rs->contains("full_attention")) {
      detail::ConfigReader kinds{*rs, label};
      if (const nlohmann::json* loc = kinds.find("sliding_attention")) {
        if (!loc->is_object()) r.bad("rope_parameters.sliding_attention", "an object", *loc);
        detail::ConfigReader l{*loc, label};
        if (l.opt_str("rope_type", "default") != "default")
          nn::detail::fail("config", label, ": field \"rope_parameters.sliding_attention.rope_type\": the sliding layers' RoPE "
                           "must be \"default\", got \"", l.opt_str("rope_type", ""), "\"");
        c.rope_local_base_freq = l.opt_num("rope_theta", c.rope_local_base_freq);
      }
      rope_field += ".full_attention";
      rs = kinds.find("full_attention");
      if (!rs || !rs->is_object()) r.bad(rope_field.c_str(), "an object", rs ? *rs : nlohmann::json());
    }
    detail::ConfigReader s{*rs, label};
    auto sub = [&](const char* k) { return rope_field + "." + k; };
    if (!r.find("rope_theta") && s.find("rope_theta")) {
      const std::string tk = sub("rope_theta");
      c.rope_theta = s.number(*s.find("rope_theta"), tk.c_str());
    }
    // transformers reads "rope_type", falling back to the older "type".
    std::string type = s.opt_str("rope_type", s.opt_str("type", "default"));
    c.rope_scaling.type = type;
    if (type == "default") {
    } else if (type == "linear" || type == "llama3") {
      const nlohmann::json* f = s.find("factor");
      if (!f) nn::detail::fail("config", label, ": field \"", sub("factor"), "\" is required for rope type \"", type, "\"");
      const std::string fk = sub("factor");
      c.rope_scaling.factor = s.number(*f, fk.c_str());
      if (!(c.rope_scaling.factor > 0))
        nn::detail::fail("config", label, ": field \"", fk, "\" must be positive, got ", c.rope_scaling.factor);
      if (type == "llama3") {
        auto need = [&](const char* k) -> const nlohmann::json& {
          const nlohmann::json* v = s.find(k);
          if (!v) nn::detail::fail("config", label, ": field \"", sub(k), "\" is required for rope type \"llama3\"");
          return *v;
        };
        const std::string lk = sub("low_freq_factor"), hk = sub("high_freq_factor"),
                          ok = sub("original_max_position_embeddings");
        c.rope_scaling.low_freq_factor = s.number(need("low_freq_factor"), lk.c_str());
        c.rope_scaling.high_freq_factor = s.number(need("high_freq_factor"), hk.c_str());
        c.rope_scaling.original_max_position_embeddings = s.integer(need("original_max_position_embeddings"), ok.c_str());
        if (!(c.rope_scaling.high_freq_factor > c.rope_scaling.low_freq_factor) ||
            !(c.rope_scaling.low_freq_factor > 0) || c.rope_scaling.original_max_position_embeddings <= 0)
          nn::detail::fail("config", label, ": field \"", rope_field, "\": llama3 needs high_freq_factor > low_freq_factor > 0 "
                       "and original_max_position_embeddings > 0");
      }
    } else {
      nn::detail::fail("config", label, ": field \"", rope_field, "\": rope type \"", type,
                   "\" is not supported (supported: default, linear, llama3)");
    }
  }
  if (c.arch == Arch::gemma3 && !(c.rope_local_base_freq > 0))  // (0 in a ModelConfig means one table for all layers)
    nn::detail::fail("config", label, ": field \"rope_local_base_freq\" must be a positive number, got ", c.rope_local_base_freq);
  c.validate(label);
  return c;
}

/// Reads `path`: a config.json file, or a folder holding one.
inline ModelConfig load_config(const std::filesystem::path& path) {
  std::filesystem::path file = std::filesystem::is_directory(path) ? path / "config.json" : path;
  return config_from_json(detail::read_json_file(file, "config"), file.string());
}

}  // namespace nn::lm
// ---- end nn/lm/config.hpp ----
// ---- begin nn/lm/model.hpp ----
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

#include <array>
#include <cmath>
#include <optional>
#include <string>
#include <variant>
#include <vector>


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
// ---- end nn/lm/model.hpp ----
// ---- begin nn/lm/gguf.hpp ----
// GGUF: a validating, memory-mapped reader of llama.cpp's model files (versions 2 and 3), with
// dequantisation of F32, F16, BF16, F64, Q8_0, Q4_0 and Q4_1 tensors to float32 / float64.
//
// Layout (ggml docs/gguf.md; gguf-py gguf_reader.py), all little-endian:
//   "GGUF" · u32 version · u64 tensor_count · u64 kv_count
//   kv_count × { string key · u32 value_type · value }
//   tensor_count × { string name · u32 n_dims · u64 ne[n_dims] · u32 ggml_type · u64 offset }
//   padding to `general.alignment` (default 32) · the data section (offsets are relative to it)
// A string is u64 length + bytes (no terminator); an array is u32 element type + u64 count +
// elements. ne[0] is the fastest-varying dimension, so a row-major shape is ne reversed: a
// Linear weight (out, in) is stored with ne = [in, out], and quantisation blocks run along in.
//
// Everything is checked before a value is handed out: the magic and version, every length and
// count against the bytes that remain (so an absurd count fails at once instead of allocating),
// value and tensor types, duplicate keys and names, the alignment (a power of two), each
// tensor's byte size, its offset's alignment, that it lies inside the file, and that no two
// tensors overlap. A bad file raises nn::Error "[gguf] <file>: <what> (at byte N)".
//
// Block layouts (ggml-common.h; gguf-py quants.py), 32 weights per block:
//   Q8_0: f16 d · 32 × int8 q                 w = q · d
//   Q4_0: f16 d · 16 bytes                    w = (q − 8) · d
//   Q4_1: f16 d · f16 m · 16 bytes            w = q · d + m
// In the 16 bytes, byte j holds element j in its low nibble and element j + 16 in its high one.
// Each product is exact in float32 (an 11-bit mantissa times at most 8 bits), so float32 and
// float64 dequantisation give the same values as gguf-py's dequantize.

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>


#if defined(_WIN32)
#include <fstream>
#else
#include <cerrno>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace nn::lm {

/// GGUF metadata value types, numbered as in the file.
enum class GgufType : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12
};

inline const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::u8: return "uint8";
    case GgufType::i8: return "int8";
    case GgufType::u16: return "uint16";
    case GgufType::i16: return "int16";
    case GgufType::u32: return "uint32";
    case GgufType::i32: return "int32";
    case GgufType::f32: return "float32";
    case GgufType::boolean: return "bool";
    case GgufType::string: return "string";
    case GgufType::array: return "array";
    case GgufType::u64: return "uint64";
    case GgufType::i64: return "int64";
    case GgufType::f64: return "float64";
  }
  return "?";
}

/// ggml tensor types (ggml.h's ggml_type), the ones a reader must at least size.
enum class GgmlType : std::uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10, Q3_K = 11,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
  IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28,
  IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39
};

/// A type's name, its block (elements per block) and the bytes of one block (gguf-py's
/// GGML_QUANT_SIZES); null for a number ggml does not define.
struct GgmlTypeInfo {
  const char* name;
  std::uint32_t block;
  std::uint32_t bytes;
  bool dequantises;  // this reader turns it into floats
};

inline const GgmlTypeInfo* ggml_type_info(std::uint32_t t) {
  static constexpr std::uint32_t K = 256;
  switch (t) {
    case 0: { static constexpr GgmlTypeInfo i{"F32", 1, 4, true}; return &i; }
    case 1: { static constexpr GgmlTypeInfo i{"F16", 1, 2, true}; return &i; }
    case 2: { static constexpr GgmlTypeInfo i{"Q4_0", 32, 2 + 16, true}; return &i; }
    case 3: { static constexpr GgmlTypeInfo i{"Q4_1", 32, 2 + 2 + 16, true}; return &i; }
    case 6: { static constexpr GgmlTypeInfo i{"Q5_0", 32, 2 + 4 + 16, true}; return &i; }
    case 7: { static constexpr GgmlTypeInfo i{"Q5_1", 32, 2 + 2 + 4 + 16, true}; return &i; }
    case 8: { static constexpr GgmlTypeInfo i{"Q8_0", 32, 2 + 32, true}; return &i; }
    case 9: { static constexpr GgmlTypeInfo i{"Q8_1", 32, 4 + 4 + 32, false}; return &i; }
    case 10: { static constexpr GgmlTypeInfo i{"Q2_K", K, 2 + 2 + K / 16 + K / 4, true}; return &i; }
    case 11: { static constexpr GgmlTypeInfo i{"Q3_K", K, 2 + K / 4 + K / 8 + 12, true}; return &i; }
    case 12: { static constexpr GgmlTypeInfo i{"Q4_K", K, 2 + 2 + K / 2 + 12, true}; return &i; }
    case 13: { static constexpr GgmlTypeInfo i{"Q5_K", K, 2 + 2 + K / 2 + K / 8 + 12, true}; return &i; }
    case 14: { static constexpr GgmlTypeInfo i{"Q6_K", K, 2 + K / 2 + K / 4 + K / 16, true}; return &i; }
    case 15: { static constexpr GgmlTypeInfo i{"Q8_K", K, 4 + K + K / 8, false}; return &i; }
    case 16: { static constexpr GgmlTypeInfo i{"IQ2_XXS", K, 2 + K / 4, false}; return &i; }
    case 17: { static constexpr GgmlTypeInfo i{"IQ2_XS", K, 2 + K / 4 + K / 32, false}; return &i; }
    case 18: { static constexpr GgmlTypeInfo i{"IQ3_XXS", K, 2 + K / 4 + K / 8, false}; return &i; }
    case 19: { static constexpr GgmlTypeInfo i{"IQ1_S", K, 2 + K / 8 + K / 16, false}; return &i; }
    case 20: { static constexpr GgmlTypeInfo i{"IQ4_NL", 32, 2 + 16, false}; return &i; }
    case 21: { static constexpr GgmlTypeInfo i{"IQ3_S", K, 2 + K / 4 + K / 8 + K / 32 + 4, false}; return &i; }
    case 22: { static constexpr GgmlTypeInfo i{"IQ2_S", K, 2 + K / 4 + K / 16, false}; return &i; }
    case 23: { static constexpr GgmlTypeInfo i{"IQ4_XS", K, 2 + 2 + K / 2 + K / 64, false}; return &i; }
    case 24: { static constexpr GgmlTypeInfo i{"I8", 1, 1, false}; return &i; }
    case 25: { static constexpr GgmlTypeInfo i{"I16", 1, 2, false}; return &i; }
    case 26: { static constexpr GgmlTypeInfo i{"I32", 1, 4, false}; return &i; }
    case 27: { static constexpr GgmlTypeInfo i{"I64", 1, 8, false}; return &i; }
    case 28: { static constexpr GgmlTypeInfo i{"F64", 1, 8, true}; return &i; }
    case 29: { static constexpr GgmlTypeInfo i{"IQ1_M", K, K / 8 + K / 16 + K / 32, false}; return &i; }
    case 30: { static constexpr GgmlTypeInfo i{"BF16", 1, 2, true}; return &i; }
    case 34: { static constexpr GgmlTypeInfo i{"TQ1_0", K, 2 + 4 * 13, false}; return &i; }
    case 35: { static constexpr GgmlTypeInfo i{"TQ2_0", K, 2 + 64, false}; return &i; }
    case 39: { static constexpr GgmlTypeInfo i{"MXFP4", 32, 1 + 16, false}; return &i; }
    default: return nullptr;
  }
}

class GgufFile;
namespace detail {
class GgufParser;
}

/// One metadata value: a scalar, a string, or an array (of scalars, strings or arrays). Typed
/// reads raise naming the key and the type held.
class GgufValue {
 public:
  GgufType type() const { return type_; }
  /// The element type of an array.
  GgufType array_type() const { return elem_; }
  bool is_array() const { return type_ == GgufType::array; }
  bool is_string() const { return type_ == GgufType::string; }
  bool is_integer() const { return is_int_type(type_); }
  bool is_float() const { return type_ == GgufType::f32 || type_ == GgufType::f64; }
  /// The key it was stored under ("key[3]" inside an array).
  const std::string& key() const { return key_; }

  /// Any integer type, as int64 (a uint64 above 2^63 - 1 raises).
  std::int64_t as_int() const {
    if (!is_integer()) wrong("an integer");
    if (type_ == GgufType::u64 && u_ > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      nn::detail::fail("gguf", "key \"", key_, "\": ", u_, " does not fit int64");
    return type_ == GgufType::u64 ? static_cast<std::int64_t>(u_) : i_;
  }
  /// A non-negative integer of any integer type.
  std::uint64_t as_uint() const {
    if (!is_integer()) wrong("an integer");
    if (type_ != GgufType::u64 && i_ < 0) nn::detail::fail("gguf", "key \"", key_, "\": ", i_, " is negative");
    return type_ == GgufType::u64 ? u_ : static_cast<std::uint64_t>(i_);
  }
  /// float32 / float64 (and integers, converted).
  double as_float() const {
    if (is_float()) return f_;
    if (is_integer()) return type_ == GgufType::u64 ? static_cast<double>(u_) : static_cast<double>(i_);
    wrong("a number");
  }
  bool as_bool() const {
    if (type_ != GgufType::boolean) wrong("a bool");
    return i_ != 0;
  }
  const std::string& as_string() const {
    if (type_ != GgufType::string) wrong("a string");
    return s_;
  }

  /// Array length.
  std::size_t size() const {
    if (!is_array()) wrong("an array");
    switch (elem_) {
      case GgufType::string: return strings_.size();
      case GgufType::array: return arrays_.size();
      case GgufType::f32: case GgufType::f64: return floats_.size();
      default: return ints_.size();
    }
  }
  /// An array of any integer type (or bool) as int64 (uint64 elements above 2^63 - 1 raise).
  std::vector<std::int64_t> ints() const {
    if (!is_array() || !(is_int_type(elem_) || elem_ == GgufType::boolean)) wrong("an array of integers");
    if (elem_ == GgufType::u64)
      for (std::int64_t v : ints_)
        if (v < 0) nn::detail::fail("gguf", "key \"", key_, "\": a uint64 element does not fit int64");
    return ints_;
  }
  /// An array of float32 / float64.
  const std::vector<double>& floats() const {
    if (!is_array() || !(elem_ == GgufType::f32 || elem_ == GgufType::f64)) wrong("an array of floats");
    return floats_;
  }
  const std::vector<std::string>& strings() const {
    if (!is_array() || elem_ != GgufType::string) wrong("an array of strings");
    return strings_;
  }
  /// An array of arrays.
  const std::vector<GgufValue>& arrays() const {
    if (!is_array() || elem_ != GgufType::array) wrong("an array of arrays");
    return arrays_;
  }

 private:
  friend class detail::GgufParser;
  static bool is_int_type(GgufType t) {
    return t == GgufType::u8 || t == GgufType::i8 || t == GgufType::u16 || t == GgufType::i16 || t == GgufType::u32 ||
           t == GgufType::i32 || t == GgufType::u64 || t == GgufType::i64;
  }
  [[noreturn]] void wrong(const char* expected) const {
    std::string held = gguf_type_name(type_);
    if (is_array()) held = std::string("an array of ") + gguf_type_name(elem_);
    nn::detail::fail("gguf", "key \"", key_, "\": expected ", expected, ", the file holds ", held);
  }

  std::string key_;
  GgufType type_ = GgufType::u8, elem_ = GgufType::u8;
  std::int64_t i_ = 0;   // signed integers and bool
  std::uint64_t u_ = 0;  // uint64
  double f_ = 0;
  std::string s_;
  std::vector<std::int64_t> ints_;  // integer / bool arrays (uint64 bit-cast)
  std::vector<double> floats_;
  std::vector<std::string> strings_;
  std::vector<GgufValue> arrays_;
};

/// One tensor's header entry.
struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> ne;  // ggml order: ne[0] fastest
  std::uint32_t type = 0;        // a GgmlType number
  std::uint64_t offset = 0;      // relative to the data section
  std::uint64_t nbytes = 0;

  /// The row-major shape (ne reversed): a Linear weight reads (out, in).
  std::vector<std::int64_t> shape() const { return {ne.rbegin(), ne.rend()}; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : ne) n *= d;
    return n;
  }
  const char* type_name() const { return ggml_type_info(type)->name; }
};

/// The tokenizer's raw metadata (llama.cpp's tokenizer.ggml.* keys), for building a tokenizer
/// without a tokenizer.json. Absent keys stay empty / nullopt.
struct GgufTokenizerMetadata {
  std::string model;                  // tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
  std::string pre;                    // tokenizer.ggml.pre: the pre-tokenizer ("qwen2", "smollm", "llama-bpe", ...)
  std::vector<std::string> tokens;    // tokenizer.ggml.tokens: id -> token text
  std::vector<std::string> merges;    // tokenizer.ggml.merges: "a b", in rank order
  std::vector<std::int32_t> token_types;  // tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user, 5 unused, 6 byte
  std::vector<float> scores;          // tokenizer.ggml.scores (SentencePiece)
  std::optional<std::int64_t> bos_id, eos_id, eot_id, unk_id, pad_id;
  std::optional<bool> add_bos, add_eos;
  std::optional<bool> add_space_prefix;  // tokenizer.ggml.add_space_prefix (SentencePiece; llama.cpp's default: true)
  std::string chat_template;          // tokenizer.chat_template
};

namespace detail {

/// The file's bytes: mapped read-only (POSIX), or owned (from_bytes, and Windows).
struct GgufBytes {
  const std::byte* data = nullptr;
  std::size_t size = 0;
  std::vector<std::byte> owned;
  void* map_base = nullptr;
  std::size_t map_len = 0;
  GgufBytes() = default;
  GgufBytes(const GgufBytes&) = delete;
  GgufBytes& operator=(const GgufBytes&) = delete;
  ~GgufBytes() {
#if !defined(_WIN32)
    if (map_base) ::munmap(map_base, map_len);
#endif
  }
};

inline std::shared_ptr<GgufBytes> gguf_map(const std::filesystem::path& path) {
  auto b = std::make_shared<GgufBytes>();
  const std::string label = path.string();
#if defined(_WIN32)
  std::ifstream in(path, std::ios::binary);
  if (!in) nn::detail::fail("gguf", label, ": cannot open");
  in.seekg(0, std::ios::end);
  b->owned.resize(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(b->owned.data()), static_cast<std::streamsize>(b->owned.size()));
  b->data = b->owned.data();
  b->size = b->owned.size();
#else
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // O_NONBLOCK: a FIFO never blocks
  if (fd < 0) nn::detail::fail("gguf", label, ": cannot open: ", std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    nn::detail::fail("gguf", label, ": not a regular file");
  }
  const auto len = static_cast<std::size_t>(sb.st_size);
  if (len > 0) {
    void* base = ::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    if (base == MAP_FAILED) {
      ::close(fd);
      nn::detail::fail("gguf", label, ": cannot mmap: ", std::strerror(err));
    }
    b->map_base = base;
    b->map_len = len;
    b->data = static_cast<const std::byte*>(base);
    b->size = len;
  }
  ::close(fd);  // the mapping keeps the file
#endif
  return b;
}

/// Reverses the bytes of an integer (std::byteswap is C++23); only big-endian hosts need it.
template <class T>
T gguf_bswap(T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  std::reverse(b, b + sizeof(T));
  std::memcpy(&v, b, sizeof(T));
  return v;
}

/// The parsed file shared by GgufFile copies.
struct GgufState {
  std::string label;
  std::shared_ptr<GgufBytes> bytes;
  std::uint32_t version = 0;
  std::uint64_t alignment = 32;
  std::uint64_t data_offset = 0;
  std::vector<std::pair<std::string, GgufValue>> kv;  // file order
  std::map<std::string, std::size_t, std::less<>> kv_index;
  std::vector<GgufTensorInfo> tensors;  // file order
  std::map<std::string, std::size_t, std::less<>> tensor_index;
};

/// A bounds-checked cursor over the header: every read names what it was reading and where.
class GgufParser {
 public:
  GgufParser(GgufState& st) : st_(st), p_(st.bytes->data), n_(st.bytes->size) {}

  void parse() {
    if (n_ < 4) fail("the file has ", n_, " bytes; a GGUF file starts with the 4-byte magic \"GGUF\"");
    if (std::memcmp(p_, "GGUF", 4) != 0) {
      if (std::memcmp(p_, "FUGG", 4) == 0) fail("this is a big-endian GGUF file; only little-endian files are read");
      fail("bad magic: the file does not start with \"GGUF\" (a GGUF model file)");
    }
    pos_ = 4;
    st_.version = u32("the version");
    if (st_.version == 1) fail("GGUF version 1 (32-bit counts) is not supported; versions 2 and 3 are");
    if (st_.version != 2 && st_.version != 3) {
      // A byte-swapped small number means a big-endian writer.
      if (st_.version == 0x02000000u || st_.version == 0x03000000u)
        fail("GGUF version ", st_.version, " reads as a big-endian file; only little-endian files are read");
      fail("unsupported GGUF version ", st_.version, " (versions 2 and 3 are)");
    }
    const std::uint64_t n_tensors = u64("the tensor count");
    const std::uint64_t n_kv = u64("the metadata count");
    // The smallest key-value is 13 bytes (empty key, type, one byte) and the smallest tensor
    // info 24 (empty name, n_dims, type, offset); larger counts cannot fit in the file.
    if (n_kv > remaining() / 13) fail("absurd metadata count ", n_kv, " for a file of ", n_, " bytes");
    if (n_tensors > remaining() / 24) fail("absurd tensor count ", n_tensors, " for a file of ", n_, " bytes");

    st_.kv.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t i = 0; i < n_kv; ++i) {
      const std::size_t at = pos_;
      std::string key = str("a metadata key");
      if (st_.kv_index.count(key)) fail_at(at, "duplicate metadata key \"", key, "\"");
      const auto t = static_cast<GgufType>(u32("the type of key \"" + key + "\""));
      GgufValue v = value(t, key, 0);
      st_.kv_index.emplace(key, st_.kv.size());
      st_.kv.emplace_back(std::move(key), std::move(v));
    }
    if (auto it = st_.kv_index.find("general.alignment"); it != st_.kv_index.end()) {
      const GgufValue& a = st_.kv[it->second].second;
      if (a.type() != GgufType::u32) fail("general.alignment must be a uint32, the file holds ", gguf_type_name(a.type()));
      const std::uint64_t al = a.as_uint();
      if (al == 0 || (al & (al - 1)) != 0) fail("general.alignment must be a power of two, got ", al);
      st_.alignment = al;
    }

    st_.tensors.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t i = 0; i < n_tensors; ++i) tensor_info();
    const std::uint64_t end_of_infos = pos_;
    st_.data_offset = (end_of_infos + st_.alignment - 1) / st_.alignment * st_.alignment;
    const std::uint64_t data_bytes = st_.data_offset <= n_ ? n_ - st_.data_offset : 0;

    std::vector<std::size_t> order(st_.tensors.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    for (const GgufTensorInfo& t : st_.tensors) {
      if (t.offset % st_.alignment != 0)
        fail("tensor \"", t.name, "\": offset ", t.offset, " is not a multiple of the alignment ", st_.alignment);
      if (t.offset > data_bytes || t.nbytes > data_bytes - t.offset)
        fail("tensor \"", t.name, "\": bytes [", t.offset, ", ", t.offset + t.nbytes,
             ") of the data section run past the end of the file (the data section holds ", data_bytes,
             " bytes from byte ", st_.data_offset, ")");
    }
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return st_.tensors[a].offset < st_.tensors[b].offset; });
    for (std::size_t i = 1; i < order.size(); ++i) {
      const GgufTensorInfo &a = st_.tensors[order[i - 1]], &b = st_.tensors[order[i]];
      if (a.offset + a.nbytes > b.offset && a.nbytes > 0 && b.nbytes > 0)
        fail("tensors \"", a.name, "\" and \"", b.name, "\" overlap in the data section");
    }
  }

 private:
  template <class... P>
  [[noreturn]] void fail(const P&... parts) const {
    nn::detail::fail("gguf", st_.label, ": ", parts..., " (at byte ", pos_, ")");
  }
  template <class... P>
  [[noreturn]] void fail_at(std::size_t at, const P&... parts) const {
    nn::detail::fail("gguf", st_.label, ": ", parts..., " (at byte ", at, ")");
  }
  std::size_t remaining() const { return n_ - pos_; }
  void need(std::uint64_t k, const std::string& what) const {
    if (k > remaining())
      fail("the file ends while reading ", what, " (", k, " bytes needed, ", remaining(), " left)");
  }
  template <class T>
  T le(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) v = gguf_bswap(v);
    pos_ += sizeof(T);
    return v;
  }
  std::uint32_t u32(const std::string& what) { return le<std::uint32_t>(what); }
  std::uint64_t u64(const std::string& what) { return le<std::uint64_t>(what); }
  std::string str(const std::string& what) {
    const std::uint64_t len = u64("the length of " + what);
    need(len, what + " (a string of " + std::to_string(len) + " bytes)");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return s;
  }
  static std::size_t scalar_size(GgufType t) {
    switch (t) {
      case GgufType::u8: case GgufType::i8: case GgufType::boolean: return 1;
      case GgufType::u16: case GgufType::i16: return 2;
      case GgufType::u32: case GgufType::i32: case GgufType::f32: return 4;
      case GgufType::u64: case GgufType::i64: case GgufType::f64: return 8;
      default: return 0;
    }
  }
  /// One scalar into v (its type already set).
  void scalar(GgufValue& v, GgufType t, const std::string& what) {
    switch (t) {
      case GgufType::u8: v.i_ = le<std::uint8_t>(what); break;
      case GgufType::i8: v.i_ = le<std::int8_t>(what); break;
      case GgufType::u16: v.i_ = le<std::uint16_t>(what); break;
      case GgufType::i16: v.i_ = le<std::int16_t>(what); break;
      case GgufType::u32: v.i_ = le<std::uint32_t>(what); break;
      case GgufType::i32: v.i_ = le<std::int32_t>(what); break;
      case GgufType::i64: v.i_ = le<std::int64_t>(what); break;
      case GgufType::u64: v.u_ = le<std::uint64_t>(what); break;
      case GgufType::boolean: v.i_ = le<std::uint8_t>(what); break;  // nonzero is true, as ggml reads it
      case GgufType::f32: v.f_ = std::bit_cast<float>(le<std::uint32_t>(what)); break;
      case GgufType::f64: v.f_ = std::bit_cast<double>(le<std::uint64_t>(what)); break;
      default: break;
    }
  }
  GgufValue value(GgufType t, const std::string& key, int depth) {
    GgufValue v;
    v.key_ = key;
    v.type_ = t;
    const std::string what = "the value of \"" + key + "\"";
    if (scalar_size(t) > 0) {
      scalar(v, t, what);
    } else if (t == GgufType::string) {
      v.s_ = str(what);
    } else if (t == GgufType::array) {
      if (depth >= 8) fail("key \"", key, "\": arrays nested deeper than 8 levels");
      const auto et = static_cast<GgufType>(u32("the element type of \"" + key + "\""));
      v.elem_ = et;
      const std::uint64_t count = u64("the length of \"" + key + "\"");
      const std::size_t es = scalar_size(et);
      // The least each element can take: its size, a string's length field, an array's header.
      const std::uint64_t least = es > 0 ? es : et == GgufType::string ? 8 : et == GgufType::array ? 12 : 0;
      if (least == 0) fail("key \"", key, "\": unknown array element type ", static_cast<std::uint32_t>(et));
      if (count > remaining() / least)
        fail("key \"", key, "\": absurd array length ", count, " (", remaining(), " bytes left in the file)");
      const auto n = static_cast<std::size_t>(count);
      if (es > 0) {
        if (et == GgufType::f32 || et == GgufType::f64) {
          v.floats_.resize(n);
          GgufValue tmp;
          for (std::size_t i = 0; i < n; ++i) {
            scalar(tmp, et, what);
            v.floats_[i] = tmp.f_;
          }
        } else {
          v.ints_.resize(n);
          GgufValue tmp;
          for (std::size_t i = 0; i < n; ++i) {
            scalar(tmp, et, what);
            v.ints_[i] = et == GgufType::u64 ? static_cast<std::int64_t>(tmp.u_) : tmp.i_;
          }
        }
      } else if (et == GgufType::string) {
        v.strings_.resize(n);
        for (std::size_t i = 0; i < n; ++i) v.strings_[i] = str(what);
      } else {
        v.arrays_.reserve(n);
        for (std::size_t i = 0; i < n; ++i)
          v.arrays_.push_back(value(GgufType::array, key + "[" + std::to_string(i) + "]", depth + 1));
      }
    } else {
      fail("key \"", key, "\": unknown value type ", static_cast<std::uint32_t>(t));
    }
    return v;
  }
  void tensor_info() {
    const std::size_t at = pos_;
    GgufTensorInfo t;
    t.name = str("a tensor name");
    if (st_.tensor_index.count(t.name)) fail_at(at, "duplicate tensor name \"", t.name, "\"");
    const std::uint32_t nd = u32("the rank of tensor \"" + t.name + "\"");
    if (nd == 0 || nd > 4) fail("tensor \"", t.name, "\": rank ", nd, " (ggml tensors have 1 to 4 dimensions)");
    // The product of the non-zero dimensions must fit in int64 too: an empty tensor's shape is
    // multiplied out in any order (Shape::numel), so [2^40, 0, 2^40] would overflow.
    std::uint64_t numel = 1, nonzero = 1;
    for (std::uint32_t d = 0; d < nd; ++d) {
      const std::uint64_t e = u64("a dimension of tensor \"" + t.name + "\"");
      if (e > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (e != 0 && nonzero > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / e))
        fail("tensor \"", t.name, "\": dimension ", e, " makes the element count overflow");
      numel *= e;
      if (e != 0) nonzero *= e;
      t.ne.push_back(static_cast<std::int64_t>(e));
    }
    t.type = u32("the type of tensor \"" + t.name + "\"");
    const GgmlTypeInfo* info = ggml_type_info(t.type);
    if (!info) fail("tensor \"", t.name, "\": unknown ggml type ", t.type);
    if (t.ne[0] % info->block != 0)
      fail("tensor \"", t.name, "\": its first dimension ", t.ne[0], " is not a multiple of ", info->name, "'s block of ",
           info->block);
    const std::uint64_t blocks = numel / info->block;
    if (blocks > std::numeric_limits<std::uint64_t>::max() / info->bytes)
      fail("tensor \"", t.name, "\": its byte size overflows");
    t.nbytes = blocks * info->bytes;
    t.offset = u64("the offset of tensor \"" + t.name + "\"");
    st_.tensor_index.emplace(t.name, st_.tensors.size());
    st_.tensors.push_back(std::move(t));
  }

  GgufState& st_;
  const std::byte* p_;
  std::size_t n_;
  std::size_t pos_ = 0;
};

inline std::uint16_t gguf_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  if constexpr (std::endian::native == std::endian::big) v = gguf_bswap(v);
  return v;
}

/// How a quantized GGUF block type maps onto affine groups (quant.hpp): `bits`-bit codes in groups
/// of `group` elements; `offset` > 0 for the symmetric types (value d * (code - offset), bias
/// -offset * d), 0 where the block stores the bias (m, or -dmin * min).
struct GgufAffine {
  int bits = 0, group = 0, offset = 0;
};
inline GgufAffine gguf_affine(std::uint32_t type) {
  switch (type) {
    case 2: return {4, 32, 8};     // Q4_0
    case 3: return {4, 32, 0};     // Q4_1
    case 6: return {5, 32, 16};    // Q5_0
    case 7: return {5, 32, 0};     // Q5_1
    case 8: return {8, 32, 128};   // Q8_0
    case 10: return {2, 16, 0};    // Q2_K
    case 11: return {3, 16, 4};    // Q3_K
    case 12: return {4, 32, 0};    // Q4_K
    case 13: return {5, 32, 0};    // Q5_K
    case 14: return {6, 16, 32};   // Q6_K
    default: return {};
  }
}

/// One block of a quantized GGUF type (ggml's block_* layouts) as affine groups, losslessly:
/// code[e] for its elements and, per group g, float32 scale[g] and bias[g], value = scale * code
/// + bias. Each scale is a float16 d times a small integer (a K-quant's sub-block scale), which is
/// exact in float32, and so is scale * code (at most 24 significant bits): the one rounding left
/// is the sum's, as in ggml's d * q + m -- the values are ggml's (and gguf-py's), bit for bit.
inline void gguf_decode_block(std::uint32_t type, const std::byte* blk, std::uint8_t* code, float* scale, float* bias) {
  auto u8 = [&](std::size_t i) { return static_cast<unsigned>(blk[i]); };
  auto f16 = [&](std::size_t i) { return half::f16_to_f32(gguf_u16(blk + i)); };
  auto c8 = [](unsigned v) { return static_cast<std::uint8_t>(v); };
  // 32-element blocks keep element j < 16 in the low nibble of qs[j], j >= 16 in the high nibble of qs[j - 16].
  auto nib32 = [&](std::size_t qs, int j) { return j < 16 ? u8(qs + j) & 15u : u8(qs + j - 16) >> 4; };
  // Q4_K / Q5_K: 12 bytes at 4 hold 8 six-bit scales and mins; groups 4..7 split theirs in two.
  auto k_scale_min = [&](int g, unsigned& sc, unsigned& mn) {
    if (g < 4) {
      sc = u8(4 + g) & 63u;
      mn = u8(8 + g) & 63u;
    } else {
      sc = (u8(12 + g - 4) & 15u) | (u8(4 + g - 4) >> 6) << 4;
      mn = (u8(12 + g - 4) >> 4) | (u8(8 + g - 4) >> 6) << 4;
    }
  };
  switch (type) {
    case 2:    // Q4_0: d, qs[16]
    case 3: {  // Q4_1: d, m, qs[16]
      scale[0] = f16(0);
      bias[0] = type == 2 ? -8.0f * scale[0] : f16(2);
      for (int j = 0; j < 32; ++j) code[j] = c8(nib32(type == 2 ? 2 : 4, j));
      return;
    }
    case 6:    // Q5_0: d, qh (u32), qs[16]; bit 4 of element j is bit j of qh
    case 7: {  // Q5_1: d, m, qh, qs[16]
      const std::size_t qh = type == 6 ? 2 : 4;
      scale[0] = f16(0);
      bias[0] = type == 6 ? -16.0f * scale[0] : f16(2);
      const std::uint32_t h = u8(qh) | u8(qh + 1) << 8 | u8(qh + 2) << 16 | u8(qh + 3) << 24;
      for (int j = 0; j < 32; ++j) code[j] = c8(nib32(qh + 4, j) | ((h >> j) & 1u) << 4);
      return;
    }
    case 8: {  // Q8_0: d, int8 qs[32]; code q + 128
      scale[0] = f16(0);
      bias[0] = -128.0f * scale[0];
      for (int j = 0; j < 32; ++j) code[j] = c8(u8(2 + j) ^ 0x80u);
      return;
    }
    case 10: {  // Q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64] at 16, d at 80, dmin at 82
      const float d = f16(80), dmin = f16(82);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * static_cast<float>(u8(g) & 15u);
        bias[g] = -(dmin * static_cast<float>(u8(g) >> 4));
      }
      // Element e = 128h + 32k + l: bits 2k of qs[32h + l].
      for (int e = 0; e < 256; ++e) code[e] = c8((u8(16 + (e / 128) * 32 + e % 32) >> (2 * ((e % 128) / 32))) & 3u);
      return;
    }
    case 11: {  // Q3_K: hmask[32], qs[64] at 32, scales[12] at 96 (6-bit, minus 32), d at 108
      const float d = f16(108);
      for (int g = 0; g < 16; ++g) {
        const unsigned lo = g < 8 ? u8(96 + g) & 15u : u8(96 + g - 8) >> 4, hi = (u8(104 + g % 4) >> (2 * (g / 4))) & 3u;
        scale[g] = d * static_cast<float>(static_cast<int>(lo | hi << 4) - 32);
        bias[g] = -4.0f * scale[g];
      }
      // Low two bits as Q2_K's; the third is bit e/32 of hmask[e % 32] (set: no -4 offset).
      for (int e = 0; e < 256; ++e)
        code[e] = c8(((u8(32 + (e / 128) * 32 + e % 32) >> (2 * ((e % 128) / 32))) & 3u) | ((u8(e % 32) >> (e / 32)) & 1u) << 2);
      return;
    }
    case 12:    // Q4_K: d, dmin, scales[12], qs[128] at 16
    case 13: {  // Q5_K: d, dmin, scales[12], qh[32] at 16, qs[128] at 48
      const float d = f16(0), dmin = f16(2);
      for (int g = 0; g < 8; ++g) {
        unsigned sc = 0, mn = 0;
        k_scale_min(g, sc, mn);
        scale[g] = d * static_cast<float>(sc);
        bias[g] = -(dmin * static_cast<float>(mn));
      }
      const std::size_t qs = type == 12 ? 16 : 48;
      for (int e = 0; e < 256; ++e) {  // group g = e / 32 in nibble g % 2 of qs[32 (g / 2) + e % 32]
        const int g = e / 32;
        unsigned c = (u8(qs + static_cast<std::size_t>(g / 2) * 32 + e % 32) >> (4 * (g % 2))) & 15u;
        if (type == 13) c |= ((u8(16 + e % 32) >> g) & 1u) << 4;
        code[e] = c8(c);
      }
      return;
    }
    case 14: {  // Q6_K: ql[128], qh[64] at 128, int8 scales[16] at 192, d at 208; code q + 32
      const float d = f16(208);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * static_cast<float>(static_cast<std::int8_t>(u8(192 + g)));
        bias[g] = -32.0f * scale[g];
      }
      for (int e = 0; e < 256; ++e) {  // e = 128h + r: nibble r / 64 of ql[64h + r % 64], bits 2 (r / 32) of qh[32h + r % 32]
        const int h = e / 128, r = e % 128;
        code[e] = c8(((u8(static_cast<std::size_t>(h) * 64 + r % 64) >> (4 * (r / 64))) & 15u) |
                     ((u8(128 + static_cast<std::size_t>(h) * 32 + r % 32) >> (2 * (r / 32))) & 3u) << 4);
      }
      return;
    }
    default: nn::detail::fail("gguf", "block type ", type, " has no affine decoding");
  }
}

/// Dequantises n elements of type `type` from `src` into out[0..n), as T (float or double).
template <class T>
void gguf_dequantize_into(const std::byte* src, std::uint32_t type, std::int64_t n, T* out) {
  const auto N = static_cast<std::size_t>(n);
  switch (type) {
    case 0:  // F32
      for (std::size_t i = 0; i < N; ++i) {
        std::uint32_t u;
        std::memcpy(&u, src + 4 * i, 4);
        if constexpr (std::endian::native == std::endian::big) u = gguf_bswap(u);
        out[i] = static_cast<T>(std::bit_cast<float>(u));
      }
      break;
    case 28:  // F64
      for (std::size_t i = 0; i < N; ++i) {
        std::uint64_t u;
        std::memcpy(&u, src + 8 * i, 8);
        if constexpr (std::endian::native == std::endian::big) u = gguf_bswap(u);
        out[i] = static_cast<T>(std::bit_cast<double>(u));
      }
      break;
    case 1:  // F16
      for (std::size_t i = 0; i < N; ++i) out[i] = static_cast<T>(half::f16_to_f32(gguf_u16(src + 2 * i)));
      break;
    case 30:  // BF16
      for (std::size_t i = 0; i < N; ++i) out[i] = static_cast<T>(half::bf16_to_f32(gguf_u16(src + 2 * i)));
      break;
    default: {  // the quantized block types: one decoder (gguf_decode_block) for these and quantized()
      const GgufAffine a = gguf_affine(type);
      const std::uint32_t block = ggml_type_info(type)->block, bytes = ggml_type_info(type)->bytes;
      std::uint8_t code[256];
      float scale[16], bias[16];
      for (std::size_t b = 0; b < N / block; ++b) {
        gguf_decode_block(type, src + bytes * b, code, scale, bias);
        T* o = out + block * b;
        for (std::uint32_t e = 0; e < block; ++e) {
          const std::uint32_t g = e / static_cast<std::uint32_t>(a.group);
          // The symmetric types as ggml writes them, scale * (code - offset): a zero comes out
          // as d * 0 (-0 for a negative d), as in gguf-py, where scale * code + bias gives +0.
          o[e] = static_cast<T>(a.offset ? scale[g] * static_cast<float>(static_cast<int>(code[e]) - a.offset)
                                         : scale[g] * static_cast<float>(code[e]) + bias[g]);
        }
      }
      break;
    }
  }
}

}  // namespace detail

/// A GGUF file, memory-mapped and validated on open. Cheap to copy (shared).
class GgufFile {
 public:
  explicit GgufFile(const std::filesystem::path& path) {
    auto st = std::make_shared<detail::GgufState>();
    st->label = path.string();
    st->bytes = detail::gguf_map(path);
    detail::GgufParser(*st).parse();
    st_ = std::move(st);
  }
  /// Validates a file image held in memory; `label` leads errors.
  static GgufFile from_bytes(std::vector<std::byte> bytes, std::string label = "<memory>") {
    auto st = std::make_shared<detail::GgufState>();
    st->label = std::move(label);
    st->bytes = std::make_shared<detail::GgufBytes>();
    st->bytes->owned = std::move(bytes);
    st->bytes->data = st->bytes->owned.data();
    st->bytes->size = st->bytes->owned.size();
    detail::GgufParser(*st).parse();
    return GgufFile(std::move(st));
  }

  const std::string& path() const { return st_->label; }
  std::uint32_t version() const { return st_->version; }
  std::uint64_t alignment() const { return st_->alignment; }
  /// Where the data section starts in the file.
  std::uint64_t data_offset() const { return st_->data_offset; }

  /// Every key-value in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return st_->kv; }
  bool contains(std::string_view key) const { return st_->kv_index.find(key) != st_->kv_index.end(); }
  const GgufValue* find(std::string_view key) const {
    auto it = st_->kv_index.find(key);
    return it == st_->kv_index.end() ? nullptr : &st_->kv[it->second].second;
  }
  /// The value of `key`; raises naming the file and the key when absent.
  const GgufValue& at(std::string_view key) const {
    const GgufValue* v = find(key);
    if (!v) nn::detail::fail("gguf", path(), ": missing metadata key \"", key, "\"");
    return *v;
  }

  const std::vector<GgufTensorInfo>& tensors() const { return st_->tensors; }
  const GgufTensorInfo* find_tensor(std::string_view name) const {
    auto it = st_->tensor_index.find(name);
    return it == st_->tensor_index.end() ? nullptr : &st_->tensors[it->second];
  }
  const GgufTensorInfo& tensor_info(std::string_view name) const {
    const GgufTensorInfo* t = find_tensor(name);
    if (!t) nn::detail::fail("gguf", path(), ": no tensor named \"", name, "\" (", st_->tensors.size(), " tensors)");
    return *t;
  }
  /// A tensor's raw (possibly quantised) bytes inside the mapping.
  std::span<const std::byte> tensor_bytes(const GgufTensorInfo& t) const {
    if (t.nbytes == 0) return {};  // the data section may be absent (a file without tensor bytes)
    return {st_->bytes->data + st_->data_offset + t.offset, static_cast<std::size_t>(t.nbytes)};
  }

  /// Tensor `name` dequantised to a host tensor of `dtype` (f32 or f64), row-major shape
  /// (ne reversed). F32 F16 BF16 F64 and the block types Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K
  /// Q5_K Q6_K are read (bit for bit gguf-py's values); other types raise naming it.
  Tensor tensor(std::string_view name, DType dtype = DType::f32) const { return tensor(tensor_info(name), dtype); }
  Tensor tensor(const GgufTensorInfo& t, DType dtype = DType::f32) const {
    if (dtype != DType::f32 && dtype != DType::f64)
      nn::detail::fail("gguf", path(), ": tensors dequantise to float32 or float64, not ", dtype_name(dtype));
    const GgmlTypeInfo* info = ggml_type_info(t.type);
    if (!info->dequantises)
      nn::detail::fail("gguf", path(), ": tensor \"", t.name, "\" has type ", info->name,
                       ", which this reader does not dequantise (F32 F16 BF16 F64 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K are)");
    Tensor out = Tensor::empty(Shape(t.shape()), dtype);
    const std::byte* src = tensor_bytes(t).data();
    if (dtype == DType::f32) detail::gguf_dequantize_into(src, t.type, t.numel(), out.data<float>());
    else detail::gguf_dequantize_into(src, t.type, t.numel(), out.data<double>());
    return out;
  }

  /// Whether tensors of a GGML type load as quantized matrices, no float copy: Q4_0 Q4_1 Q5_0
  /// Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K.
  static bool keeps_quantized(std::uint32_t type) { return detail::gguf_affine(type).bits != 0; }

  /// A quantized matrix's blocks as an affine quantized matrix (quant.hpp), losslessly
  /// (detail::gguf_decode_block): Q4_0/Q4_1 4-bit, Q5_0/Q5_1 5-bit, Q8_0 8-bit codes in groups of
  /// 32 (a block); the K-quants in their sub-blocks: Q2_K 2-bit, Q3_K 3-bit and Q6_K 6-bit in
  /// groups of 16, Q4_K 4-bit and Q5_K 5-bit in groups of 32. Scales and biases float32 (d * sc and
  /// -dmin * m are exact). The codes are repacked into MLX's LSB-first bit stream. Dequantized,
  /// the values equal gguf-py's (a zero of a symmetric type comes out +0 where gguf-py has -0).
  QuantizedMatrix quantized(const GgufTensorInfo& t) const {
    if (!keeps_quantized(t.type) || t.ne.size() != 2)
      nn::detail::fail("gguf", path(), ": tensor \"", t.name, "\" (", t.type_name(), ", ", t.ne.size(),
                       "-D) is not a matrix of a quantized block type (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K..Q6_K)");
    // An empty matrix's other dimension is bounded by nothing in the file (its byte size is 0):
    // refused, rather than looping over up to 2^63 rows of nothing or overflowing cols * bits.
    if (t.numel() == 0)
      nn::detail::fail("gguf", path(), ": tensor \"", t.name, "\" (", t.type_name(), ", ne ", t.ne[0], " x ", t.ne[1],
                       ") has no elements; an empty quantized matrix is not loaded");
    const detail::GgufAffine a = detail::gguf_affine(t.type);
    const GgmlTypeInfo* info = ggml_type_info(t.type);
    const std::int64_t rows = t.ne[1], cols = t.ne[0], groups = cols / a.group, block = info->block;
    const std::int64_t blocks = cols / block, per_block = block / a.group, row_bytes = cols * a.bits / 8;
    QuantizedMatrix m;
    m.q = Quant::affine(a.group, a.bits);
    m.weight = Tensor::zeros(Shape{rows, cols * a.bits / 32}, DType::u32);  // put_code ORs into zeros
    m.scales = Tensor::empty(Shape{rows, groups}, DType::f32);
    m.biases = Tensor::empty(Shape{rows, groups}, DType::f32);
    const std::byte* src = tensor_bytes(t).data();
    auto* codes = static_cast<std::uint8_t*>(m.weight.raw());
    float* sc = m.scales.data<float>();
    float* bi = m.biases.data<float>();
    std::uint8_t code[256];
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::int64_t g0 = r * groups + b * per_block;
        detail::gguf_decode_block(t.type, src + info->bytes * static_cast<std::size_t>(r * blocks + b), code, sc + g0, bi + g0);
        for (std::int64_t e = 0; e < block; ++e)
          nn::detail::QuantMath::put_code(codes + r * row_bytes, b * block + e, a.bits, code[e]);
      }
    return m;
  }

  /// tokenizer.ggml.* and tokenizer.chat_template, raw. A key of the wrong type raises naming
  /// the file and the key.
  GgufTokenizerMetadata tokenizer() const {
    try {
      return tokenizer_metadata();
    } catch (const Error& e) {  // GgufValue's errors name the key, not the file
      std::string_view what = e.what();
      if (what.starts_with("[gguf] ")) what.remove_prefix(7);
      nn::detail::fail("gguf", path(), ": ", what);
    }
  }

 private:
  GgufTokenizerMetadata tokenizer_metadata() const {
    GgufTokenizerMetadata m;
    auto str = [&](const char* k, std::string& dst) {
      if (const GgufValue* v = find(k)) dst = v->as_string();
    };
    auto id = [&](const char* k, std::optional<std::int64_t>& dst) {
      if (const GgufValue* v = find(k)) dst = v->as_int();
    };
    auto flag = [&](const char* k, std::optional<bool>& dst) {
      if (const GgufValue* v = find(k)) dst = v->as_bool();
    };
    str("tokenizer.ggml.model", m.model);
    str("tokenizer.ggml.pre", m.pre);
    str("tokenizer.chat_template", m.chat_template);
    if (const GgufValue* v = find("tokenizer.ggml.tokens")) m.tokens = v->strings();
    if (const GgufValue* v = find("tokenizer.ggml.merges")) m.merges = v->strings();
    if (const GgufValue* v = find("tokenizer.ggml.token_type")) {
      const std::vector<std::int64_t> types = v->ints();
      for (std::size_t i = 0; i < types.size(); ++i) {  // read at the file's width: no wrap to a valid type
        if (types[i] < INT32_MIN || types[i] > INT32_MAX)
          nn::detail::fail("gguf", "key \"tokenizer.ggml.token_type[", i, "]\": ", types[i], " is not a token type (0..6)");
        m.token_types.push_back(static_cast<std::int32_t>(types[i]));
      }
    }
    if (const GgufValue* v = find("tokenizer.ggml.scores"))
      for (double x : v->floats()) m.scores.push_back(static_cast<float>(x));
    id("tokenizer.ggml.bos_token_id", m.bos_id);
    id("tokenizer.ggml.eos_token_id", m.eos_id);
    id("tokenizer.ggml.eot_token_id", m.eot_id);
    id("tokenizer.ggml.unknown_token_id", m.unk_id);
    id("tokenizer.ggml.padding_token_id", m.pad_id);
    flag("tokenizer.ggml.add_bos_token", m.add_bos);
    flag("tokenizer.ggml.add_eos_token", m.add_eos);
    flag("tokenizer.ggml.add_space_prefix", m.add_space_prefix);
    return m;
  }

  explicit GgufFile(std::shared_ptr<detail::GgufState> st) : st_(std::move(st)) {}
  std::shared_ptr<detail::GgufState> st_;
};

}  // namespace nn::lm
// ---- end nn/lm/gguf.hpp ----
// ---- begin nn/lm/load.hpp ----
// Loading a CausalLM: from a Hugging Face folder (config.json + model.safetensors, or a sharded
// model.safetensors.index.json) and from a GGUF file (llama.cpp's names, dequantised, Q/K rows
// un-permuted), strictly: every missing, unknown and mismatched name is reported at once.

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <new>
#include <optional>
#include <set>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

// ---- begin nn/lm/adapters.hpp ----
// LoRA and DoRA adapters for decoder models named as Hugging Face names them
// (model.layers.N.<key>): applying them by path, and reading/writing mlx-lm and PEFT adapter
// directories.

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>


namespace nn::lm {

/// The LoRA (or DoRA) of a fine-tune, as mlx-lm's adapter_config.json holds it.
struct LoraConfig {
  bool dora = false;      // DoraLinear instead of LoraLinear (mlx-lm fine_tune_type "dora", PEFT use_dora)
  std::int64_t rank = 8;
  double scale = 20.0;    // mlx-lm's multiplier (PEFT's lora_alpha / r)
  double dropout = 0.0;
  bool rslora = false;    // the multiplier is scale / sqrt(rank) (PEFT's use_rslora)
  int num_layers = -1;    // the last N decoder layers (-1: all), as mlx-lm
  std::vector<std::string> keys{"self_attn.q_proj", "self_attn.v_proj"};  // paths inside a layer

  double effective_scale() const { return rslora ? scale / std::sqrt(static_cast<double>(rank)) : scale; }
};

/// A LoRA key as the command line names it ("q_proj", "down_proj") to its path inside a
/// decoder layer ("self_attn.q_proj", "mlp.down_proj"); a key with a dot is already a path.
inline std::string lora_key_path(const std::string& key) {
  if (key.find('.') != std::string::npos) return key;
  const bool mlp = key == "gate_proj" || key == "up_proj" || key == "down_proj";
  return (mlp ? "mlp." : "self_attn.") + key;
}

namespace detail {

/// "model.layers.12.self_attn.q_proj" -> {12, "self_attn.q_proj"}; nullopt for other paths.
inline std::optional<std::pair<int, std::string>> layer_path(const std::string& path) {
  const std::string pre = "model.layers.";
  if (path.rfind(pre, 0) != 0) return std::nullopt;
  const std::size_t dot = path.find('.', pre.size());
  if (dot == std::string::npos) return std::nullopt;
  try {
    return std::pair{std::stoi(path.substr(pre.size(), dot - pre.size())), path.substr(dot + 1)};
  } catch (...) {
    return std::nullopt;
  }
}

/// Whether a parameter path names an adapter's trained tensor: lora_a, lora_b, or DoRA's m.
inline bool is_adapter_param(const std::string& p) {
  return p.ends_with(".lora_a") || p.ends_with(".lora_b") || p.ends_with(".m");
}

template <class M>
int count_layers(const M& model) {
  int n = 0;
  nn::detail::for_each(model, [&](const std::string& p, auto&) {
    if (auto lp = layer_path(p)) n = std::max(n, lp->first + 1);
  });
  return n;
}

inline void write_text(const std::filesystem::path& path, const std::string& text) {
  // temporary file + rename, as every nn writer: a crash never leaves half a config behind
  auto tmp = path;
  tmp += ".tmp";
  {
    std::ofstream f(tmp);
    if (!(f << text)) nn::detail::fail("adapters", path.string(), ": cannot write");
  }
  std::filesystem::rename(tmp, path);
}

inline nlohmann::json read_json(const std::filesystem::path& path) { return read_json_file(path, "adapters"); }

}  // namespace detail

/// Replaces every Linear at "model.layers.N.<key>" (key in cfg.keys, N among the last
/// cfg.num_layers layers) by a LoraLinear (mlx-lm's linear_to_lora_layers), and every
/// QuantizedLinear there by a LoraLinear over it (QLoRA); a DoraLinear instead with cfg.dora.
/// The fields must be std::variant<Linear, LoraLinear, DoraLinear, ...>. Returns how many layers were converted; raises when a key
/// matches nothing (a typo would otherwise train nothing).
template <class M>
int apply_lora(M& model, const LoraConfig& cfg) {
  const int n = detail::count_layers(model);
  const int first = cfg.num_layers < 0 ? 0 : std::max(0, n - cfg.num_layers);
  std::set<std::string> seen;
  auto pick = [&](const std::string& path) {
    auto lp = detail::layer_path(path);
    if (!lp || lp->first < first) return false;
    for (const auto& k : cfg.keys)
      if (lp->second == k) {
        seen.insert(k);
        return true;
      }
    return false;
  };
  auto adapt = [&]<class Layer>(const auto& base) {
    return Layer::from_base(base, cfg.rank).scale(cfg.scale).dropout(cfg.dropout).rslora(cfg.rslora);
  };
  auto lora = [&](const std::string&, const auto& base) { return adapt.template operator()<LoraLinear>(base); };
  auto dora = [&](const std::string&, const auto& base) { return adapt.template operator()<DoraLinear>(base); };
  // full-precision bases (LoRA), then quantized ones (QLoRA)
  int converted = cfg.dora ? model.template map_modules<Linear>(pick, dora) : model.template map_modules<Linear>(pick, lora);
  converted += cfg.dora ? model.template map_modules<QuantizedLinear>(pick, dora)
                        : model.template map_modules<QuantizedLinear>(pick, lora);
  for (const auto& k : cfg.keys)
    if (!seen.count(k)) nn::detail::fail("apply_lora", "key '", k, "' matches no Linear or QuantizedLinear in model.layers.N");
  return converted;
}

// ---- mlx-lm --------------------------------------------------------------------------------

/// Writes an mlx-lm adapter directory: adapters.safetensors (model.layers.N.<key>.lora_a (in, r),
/// .lora_b (r, out), and DoRA's .m (out)) and adapter_config.json (fine_tune_type "lora" or
/// "dora", num_layers, lora_parameters; an rsLoRA config is written with its effective scale).
/// mlx_lm.load(model, adapter_path=dir) applies it.
template <class M>
void save_mlx_adapters(const std::filesystem::path& dir, const M& model, const LoraConfig& cfg) {
  std::filesystem::create_directories(dir);
  NamedTensors t;
  for (auto& [p, v] : model.trainable_parameters())
    if (detail::is_adapter_param(p)) t.emplace_back(p, v);
  if (t.empty()) nn::detail::fail("adapters", "the model has no trainable LoRA parameters to save");
  save_safetensors(dir / "adapters.safetensors", t, {{"format", "mlx"}});
  // mlx-lm multiplies by lora_parameters.scale and has no rsLoRA flag: rsLoRA is written as its
  // effective scale (scale / sqrt(rank)), which computes the same layer (and reads back so).
  nlohmann::json j = {{"fine_tune_type", cfg.dora ? "dora" : "lora"},
                      {"num_layers", cfg.num_layers},
                      {"lora_parameters",
                       {{"rank", cfg.rank}, {"scale", cfg.effective_scale()}, {"dropout", cfg.dropout}, {"keys", cfg.keys}}}};
  detail::write_text(dir / "adapter_config.json", j.dump(2) + "\n");
}

namespace detail {

/// The numbers a LoRA needs, checked once for both formats: "[adapters] <label>: ..." otherwise.
inline void check_lora_config(const LoraConfig& c, const std::string& label) {
  if (c.rank < 1) nn::detail::fail("adapters", label, ": the rank must be a positive integer, got ", c.rank);
  if (!std::isfinite(c.scale)) nn::detail::fail("adapters", label, ": the scale must be a finite number, got ", c.scale);
  if (!(c.dropout >= 0 && c.dropout < 1))
    nn::detail::fail("adapters", label, ": the dropout must lie in [0, 1), got ", c.dropout);
}

}  // namespace detail

/// An mlx-lm adapter_config.json, parsed (fine_tune_type "lora", lora_parameters {rank, scale,
/// dropout, keys}, num_layers); `label` (the file) leads every error.
inline LoraConfig mlx_adapter_config_from_json(const nlohmann::json& j, const std::string& label) {
  if (!j.is_object()) nn::detail::fail("adapters", label, ": expected a JSON object at the top level");
  LoraConfig c;
  try {
    const std::string type = j.value("fine_tune_type", std::string("lora"));
    if (type != "lora" && type != "dora")
      nn::detail::fail("adapters", label, ": fine_tune_type '", type, "' is not an adapter (lora or dora)");
    c.dora = type == "dora";
    auto lp = j.find("lora_parameters");
    if (lp == j.end() || !lp->is_object()) nn::detail::fail("adapters", label, ": missing object field 'lora_parameters'");
    c.rank = lp->at("rank").get<std::int64_t>();
    c.scale = lp->at("scale").get<double>();
    c.dropout = lp->value("dropout", 0.0);
    if (lp->contains("keys")) c.keys = lp->at("keys").get<std::vector<std::string>>();
    const std::int64_t layers = j.value("num_layers", std::int64_t{-1});
    if (layers < -1 || layers > std::numeric_limits<int>::max())
      nn::detail::fail("adapters", label, ": num_layers must be -1 (all) or a layer count, got ", layers);
    c.num_layers = static_cast<int>(layers);
  } catch (const nlohmann::json::exception& e) {
    nn::detail::fail("adapters", label, ": bad field (", e.what(), ")");
  }
  detail::check_lora_config(c, label);
  return c;
}

/// Reads an mlx-lm adapter directory's config.
inline LoraConfig read_mlx_adapter_config(const std::filesystem::path& dir) {
  const auto path = dir / "adapter_config.json";
  return mlx_adapter_config_from_json(detail::read_json(path), path.string());
}

/// Applies the directory's LoRA to `model` and loads its adapter weights (strict: every adapter
/// tensor must match a LoRA parameter by name and shape, and every LoRA parameter must be given;
/// on error the model's weights are unchanged — the layers are converted first).
template <class M>
LoraConfig load_mlx_adapters(const std::filesystem::path& dir, M& model) {
  LoraConfig cfg = read_mlx_adapter_config(dir);
  NamedTensors w = load_safetensors(dir / "adapters.safetensors");
  apply_lora(model, cfg);
  NamedTensors all;
  for (auto& [p, v] : model.parameters())
    if (!detail::is_adapter_param(p)) all.emplace_back(p, v);  // the base is given as it is
  for (auto& e : w) all.push_back(e);
  nn::detail::load_weights_impl(model, all, true, (dir / "adapters.safetensors").string());
  return cfg;
}

// ---- PEFT ----------------------------------------------------------------------------------

/// Writes a PEFT LoRA directory: adapter_model.safetensors with
/// base_model.model.<path>.lora_A.weight (r, in) and .lora_B.weight (out, r) — the transposes of
/// mlx-lm's factors — (and DoRA's .lora_magnitude_vector (out), m as it is) and
/// adapter_config.json with r, lora_alpha (scale * r, or scale with rslora, so PEFT's scaling
/// equals ours), target_modules, use_rslora, use_dora, layers_to_transform.
template <class M>
void save_peft_adapters(const std::filesystem::path& dir, const M& model, const LoraConfig& cfg,
                        const std::string& base_model = "") {
  std::filesystem::create_directories(dir);
  NamedTensors t;
  GTape<cpu> tp;
  for (auto& [p, v] : model.trainable_parameters()) {
    if (!detail::is_adapter_param(p)) continue;
    if (p.ends_with(".m")) {
      t.emplace_back("base_model.model." + p.substr(0, p.size() - 2) + ".lora_magnitude_vector", v);
      continue;
    }
    const bool a = p.ends_with(".lora_a");
    const std::string mod = p.substr(0, p.size() - 7);
    Tensor tr = tp.value(transpose(tp, tp.constant(v))).clone();  // (in, r) -> (r, in); (r, out) -> (out, r)
    t.emplace_back("base_model.model." + mod + (a ? ".lora_A.weight" : ".lora_B.weight"), tr);
  }
  if (t.empty()) nn::detail::fail("adapters", "the model has no trainable LoRA parameters to save");
  save_safetensors(dir / "adapter_model.safetensors", t, {{"format", "pt"}});
  std::vector<std::string> targets;
  for (const auto& k : cfg.keys) targets.push_back(k.substr(k.rfind('.') + 1));
  nlohmann::json j = {{"peft_type", "LORA"},
                      {"task_type", "CAUSAL_LM"},
                      {"base_model_name_or_path", base_model},
                      {"r", cfg.rank},
                      {"lora_alpha", cfg.rslora ? cfg.scale : cfg.scale * static_cast<double>(cfg.rank)},
                      {"lora_dropout", cfg.dropout},
                      {"use_rslora", cfg.rslora},
                      {"use_dora", cfg.dora},
                      {"target_modules", targets},
                      {"bias", "none"},
                      {"fan_in_fan_out", false},
                      {"inference_mode", true}};
  if (cfg.num_layers >= 0) {
    const int n = detail::count_layers(model);
    std::vector<int> layers;
    for (int i = std::max(0, n - cfg.num_layers); i < n; ++i) layers.push_back(i);
    j["layers_to_transform"] = layers;
  }
  detail::write_text(dir / "adapter_config.json", j.dump(2) + "\n");
}

/// A PEFT adapter_config.json, parsed: rank (r), scale (lora_alpha / r, or / sqrt(r) with
/// use_rslora: the LoraConfig's scale is alpha then) and dropout; the targets and layers come
/// from the tensor names. `label` (the file) leads every error.
inline LoraConfig peft_adapter_config_from_json(const nlohmann::json& j, const std::string& label) {
  if (!j.is_object()) nn::detail::fail("adapters", label, ": expected a JSON object at the top level");
  LoraConfig cfg;
  try {
    const std::string type = j.value("peft_type", std::string("LORA"));
    if (type != "LORA") nn::detail::fail("adapters", label, ": peft_type '", type, "' is not LORA");
    cfg.rank = j.at("r").get<std::int64_t>();
    if (cfg.rank < 1) nn::detail::fail("adapters", label, ": r must be a positive integer, got ", cfg.rank);
    const double alpha = j.value("lora_alpha", static_cast<double>(cfg.rank));
    cfg.rslora = j.value("use_rslora", false);
    cfg.dora = j.value("use_dora", false);
    cfg.scale = cfg.rslora ? alpha : alpha / static_cast<double>(cfg.rank);
    cfg.dropout = j.value("lora_dropout", 0.0);
    if (j.value("fan_in_fan_out", false)) nn::detail::fail("adapters", label, ": fan_in_fan_out is not supported");
    // what would change the layer beyond one rank and one scale: refused, never ignored
    for (const char* k : {"rank_pattern", "alpha_pattern"})
      if (j.contains(k) && !j[k].is_null() && !j[k].empty())
        nn::detail::fail("adapters", label, ": ", k, " (per-module ranks or alphas) is not supported");
    if (j.contains("modules_to_save") && !j["modules_to_save"].is_null() && !j["modules_to_save"].empty())
      nn::detail::fail("adapters", label, ": modules_to_save is not supported (adapters only)");
    if (const std::string bias = j.value("bias", std::string("none")); bias != "none")
      nn::detail::fail("adapters", label, ": bias '", bias, "' is not supported (\"none\" only)");
  } catch (const nlohmann::json::exception& e) {
    nn::detail::fail("adapters", label, ": bad field (", e.what(), ")");
  }
  detail::check_lora_config(cfg, label);
  return cfg;
}

/// Reads a PEFT LoRA directory into `model`: the config gives rank, scale (lora_alpha / r, or
/// / sqrt(r) with use_rslora) and targets; the factors are transposed into mlx-lm's
/// orientation. Orientation is checked by name and by shape (a square factor in the wrong
/// orientation would load silently otherwise).
template <class M>
LoraConfig load_peft_adapters(const std::filesystem::path& dir, M& model) {
  const auto cpath = dir / "adapter_config.json";
  LoraConfig cfg = peft_adapter_config_from_json(detail::read_json(cpath), cpath.string());
  NamedTensors w = load_safetensors(dir / "adapter_model.safetensors");
  // targets from the tensor names: "...model.layers.N.<key>.lora_A.weight"
  std::set<std::string> keys;
  std::set<int> layers;
  NamedTensors mine;
  GTape<cpu> tp;
  for (auto& [name, t] : w) {
    std::string n = name;
    const std::string pre = "base_model.model.";
    if (n.rfind(pre, 0) == 0) n = n.substr(pre.size());
    if (n.ends_with(".lora_magnitude_vector")) {  // DoRA's m, (out), as it is
      if (!cfg.dora)
        nn::detail::fail("adapters", (dir / "adapter_model.safetensors").string(), ": tensor '", name,
                         "' is a DoRA magnitude but adapter_config.json has no use_dora: true");
      mine.emplace_back(n.substr(0, n.size() - 22) + ".m", t);
      continue;
    }
    const bool a = n.ends_with(".lora_A.weight"), b = n.ends_with(".lora_B.weight");
    if (!a && !b) nn::detail::fail("adapters", (dir / "adapter_model.safetensors").string(), ": tensor '", name, "' is not a LoRA factor");
    const std::string mod = n.substr(0, n.size() - 14);
    auto lp = detail::layer_path(mod);
    if (!lp) nn::detail::fail("adapters", "tensor '", name, "' is not under model.layers.N");
    keys.insert(lp->second);
    layers.insert(lp->first);
    if (t.rank() != 2 || (a ? t.dim(0) : t.dim(1)) != cfg.rank)
      nn::detail::fail("adapters", "tensor '", name, "' has shape ", t.shape().str(), "; PEFT's ", a ? "lora_A is (r, in)" : "lora_B is (out, r)",
                       " with r = ", cfg.rank);
    mine.emplace_back(mod + (a ? ".lora_a" : ".lora_b"), tp.value(transpose(tp, tp.constant(t))).clone());
  }
  cfg.keys.assign(keys.begin(), keys.end());
  const int n = detail::count_layers(model);
  cfg.num_layers = static_cast<int>(layers.size()) == n ? -1 : static_cast<int>(layers.size());
  if (cfg.num_layers >= 0 && *layers.begin() != n - cfg.num_layers)
    nn::detail::fail("adapters", cpath.string(), ": adapted layers are not the last ", cfg.num_layers, " (unsupported)");
  apply_lora(model, cfg);
  NamedTensors all;
  for (auto& [p, v] : model.parameters())
    if (!detail::is_adapter_param(p)) all.emplace_back(p, v);
  for (auto& e : mine) all.push_back(e);
  nn::detail::load_weights_impl(model, all, true, (dir / "adapter_model.safetensors").string());
  return cfg;
}

}  // namespace nn::lm
// ---- end nn/lm/adapters.hpp ----

namespace nn::lm {

namespace detail {

/// Checks `named` against the model with load_weights' strict plan (missing, unknown,
/// mismatched and duplicated names all in one error, nothing written on failure), then hands
/// each converted tensor's storage to the model instead of copying it: a loader's tensors are
/// fresh, and the model was built uninitialised, so the peak is one copy of the weights.
inline void load_named(CausalLM& m, const nn::detail::NamedTensorList& named, const std::string& source) {
  auto plan = nn::detail::plan_load(m, named, true, source);
  for (auto& [target, t] : plan) *target = *t;
}

/// t's rows (dim 0) in consecutive blocks of `rows` each, copied; `name` and `source` lead the
/// error when they do not add up to t's rows.
inline std::vector<Tensor> split_rows(const Tensor& t, const std::vector<std::int64_t>& rows, const std::string& name,
                                      const std::string& source) {
  std::int64_t total = 0;
  for (std::int64_t r : rows) total += r;
  if (t.rank() < 1 || t.dim(0) != total)
    nn::detail::fail("load", source, ": \"", name, "\" is ", t.shape().str(), " but its parts need ", total, " rows");
  const std::size_t row_bytes = total ? t.nbytes() / static_cast<std::size_t>(total) : 0;
  std::vector<Tensor> out;
  std::size_t at = 0;
  for (std::int64_t r : rows) {
    std::vector<std::int64_t> d = t.shape().vec();
    d[0] = r;
    Tensor p = Tensor::empty(Shape(d), t.dtype());
    std::memcpy(p.raw(), static_cast<const std::byte*>(t.raw()) + at, p.nbytes());
    at += static_cast<std::size_t>(r) * row_bytes;
    out.push_back(std::move(p));
  }
  return out;
}

/// The parts' rows stacked (the inverse of split_rows); the parts agree in dtype and trailing shape.
inline Tensor join_rows(const std::vector<Tensor>& parts, const std::string& name) {
  std::vector<std::int64_t> d = parts.at(0).shape().vec();
  d[0] = 0;
  for (const Tensor& p : parts) {
    std::vector<std::int64_t> e = p.shape().vec();
    e[0] = 0;
    if (e != std::vector<std::int64_t>(d.begin(), d.end()) || p.dtype() != parts[0].dtype())
      nn::detail::fail("save", "cannot join the parts of \"", name, "\": ", parts[0].shape().str(), " ",
                       dtype_name(parts[0].dtype()), " beside ", p.shape().str(), " ", dtype_name(p.dtype()));
  }
  for (const Tensor& p : parts) d[0] += p.dim(0);
  Tensor out = Tensor::empty(Shape(d), parts[0].dtype());
  std::size_t at = 0;
  for (const Tensor& p : parts) {
    const Tensor h = p.device() == Device::cpu ? p : p.to(Device::cpu);
    std::memcpy(static_cast<std::byte*>(out.raw()) + at, h.raw(), h.nbytes());
    at += h.nbytes();
  }
  return out;
}

/// "model.layers.N.<fused>.<leaf>" -> {"model.layers.N.", fused entry}; nullopt for other names.
inline std::optional<std::pair<std::string, const FusedProjection*>> fused_name(const std::vector<FusedProjection>& table,
                                                                                 const std::string& name, bool of_part) {
  const auto lp = layer_path(name.substr(0, name.rfind('.')));
  if (!lp) return std::nullopt;
  for (const FusedProjection& f : table)
    if (of_part ? lp->second == f.parts[0] : lp->second == f.fused)
      return std::make_pair("model.layers." + std::to_string(lp->first) + ".", &f);
  return std::nullopt;
}

/// A checkpoint's tensor list in the model's names: each fused projection's leaves (weight,
/// bias; a quantized layer's scales and biases, whose rows are the matrix's) split into its parts.
inline void split_fused(const ModelConfig& c, nn::detail::NamedTensorList& named, const std::string& source) {
  const std::vector<FusedProjection> table = fused_projections(c);
  if (table.empty()) return;
  nn::detail::NamedTensorList out;
  out.reserve(named.size() + named.size() / 2);
  for (auto& [name, t] : named) {
    const auto f = fused_name(table, name, false);
    if (!f) {
      out.emplace_back(std::move(name), std::move(t));
      continue;
    }
    const std::string leaf = name.substr(name.rfind('.'));
    std::vector<Tensor> parts = split_rows(t, f->second->rows, name, source);
    for (std::size_t i = 0; i < parts.size(); ++i) out.emplace_back(f->first + f->second->parts[i] + leaf, std::move(parts[i]));
  }
  named = std::move(out);
}

/// The model's tensors in its checkpoint's names: the parts of each fused projection joined,
/// in the place of the first part (the inverse of split_fused). Other families: unchanged.
inline nn::detail::NamedTensorList join_fused(const ModelConfig& c, const nn::detail::NamedTensorList& params) {
  const std::vector<FusedProjection> table = fused_projections(c);
  if (table.empty()) return params;
  std::map<std::string, const Tensor*> by_name;
  for (const auto& [n, t] : params) by_name.emplace(n, &t);
  nn::detail::NamedTensorList out;
  for (const auto& [name, t] : params) {
    if (const auto lp = layer_path(name.substr(0, name.rfind('.'))))
      if (std::any_of(table.begin(), table.end(), [&](const FusedProjection& f) {
            return std::find(f.parts.begin() + 1, f.parts.end(), lp->second) != f.parts.end();
          }))
        continue;  // joined at its first part
    const auto f = fused_name(table, name, true);
    if (!f) {
      out.emplace_back(name, t);
      continue;
    }
    const std::string leaf = name.substr(name.rfind('.'));
    std::vector<Tensor> parts;
    for (const std::string& p : f->second->parts) {
      auto it = by_name.find(f->first + p + leaf);
      if (it == by_name.end())
        nn::detail::fail("save", "\"", f->first + p + leaf, "\" is missing: ", c.model_type, " stores ", f->second->fused,
                         " as one matrix, so its parts must have the same layout");
      parts.push_back(*it->second);
    }
    out.emplace_back(f->first + f->second->fused + leaf, join_rows(parts, f->first + f->second->fused + leaf));
  }
  return out;
}

/// One safetensors tensor as a host tensor of the model's dtype. bf16 and f16 widen exactly;
/// f64 -> f32 rounds once.
inline Tensor float_tensor(const SafetensorsView& v, DType dt) {
  const SafetensorsDtype s = v.dtype();
  if (s != SafetensorsDtype::F32 && s != SafetensorsDtype::F16 && s != SafetensorsDtype::BF16 &&
      s != SafetensorsDtype::F64)
    nn::detail::fail("load_hf", v.file(), ": tensor \"", v.name(), "\" has dtype ", safetensors_dtype_name(s),
                     "; model weights must be F32, F16, BF16 or F64");
  Tensor t = v.to_tensor();
  return t.dtype() == dt ? t : t.to(dt);
}

/// The safetensors files of a Hugging Face folder: model.safetensors, or the shards a
/// model.safetensors.index.json names (each once, in the index's order), with the index's
/// weight_map (name -> shard file; empty for a single file).
struct HfWeightFiles {
  std::vector<std::filesystem::path> files;
  std::map<std::string, std::string> weight_map;
};

inline HfWeightFiles hf_weight_files(const std::filesystem::path& folder) {
  HfWeightFiles out;
  const std::filesystem::path single = folder / "model.safetensors", index = folder / "model.safetensors.index.json";
  if (std::filesystem::is_regular_file(single)) {
    out.files.push_back(single);
    return out;
  }
  if (!std::filesystem::is_regular_file(index))
    nn::detail::fail("load_hf", folder.string(), ": no model.safetensors and no model.safetensors.index.json");
  const std::string label = index.string();
  const nlohmann::json j = detail::read_json_file(index, "load_hf");
  if (!j.is_object()) nn::detail::fail("load_hf", label, ": not a JSON object");
  auto wm = j.find("weight_map");
  if (wm == j.end() || !wm->is_object() || wm->empty())
    nn::detail::fail("load_hf", label, ": field \"weight_map\" must be a non-empty object of tensor name -> shard file");
  std::set<std::string> seen;
  for (auto it = wm->begin(); it != wm->end(); ++it) {
    if (!it.value().is_string())
      nn::detail::fail("load_hf", label, ": field \"weight_map\": \"", it.key(), "\" must map to a file name");
    const std::string shard = it.value().get<std::string>();
    const std::filesystem::path rel(shard);
    bool safe = !shard.empty() && rel.is_relative() && !rel.has_root_name();
    for (const auto& part : rel) safe = safe && part != "..";
    if (!safe)
      nn::detail::fail("load_hf", label, ": field \"weight_map\": shard \"", shard, "\" (for \"", it.key(),
                       "\") must be a file name inside the folder");
    out.weight_map[it.key()] = shard;
    if (seen.insert(shard).second) {
      if (!std::filesystem::is_regular_file(folder / rel))
        nn::detail::fail("load_hf", label, ": shard \"", shard, "\" (listed for \"", it.key(), "\") is not in the folder");
      out.files.push_back(folder / rel);
    }
  }
  return out;
}

/// CausalLM::uninitialised(cfg, dtype), with an allocation failure (a config within the limits
/// that is still larger than this machine's memory) raised as nn::Error naming the source:
/// std::bad_alloc and std::length_error never escape a loader.
inline CausalLM allocate(const ModelConfig& cfg, DType dtype, const std::string& source) {
  std::string why;
  try {
    return CausalLM::uninitialised(cfg, dtype);
  } catch (const std::bad_alloc&) {
    why = "out of memory";
  } catch (const std::length_error&) {
    why = "too large";
  } catch (const Error& e) {  // a tensor's allocation failed ("[tensor] out of host memory ...")
    why = e.what();
  }
  nn::detail::fail("load", source, ": cannot allocate the model the config describes (", cfg.num_hidden_layers,
                   " layers of width ", cfg.hidden_size, ", vocabulary ", cfg.vocab_size, "): ", why);
}

/// A weight file's tensors against its config, before the model is allocated: the embedding (its
/// shape as stored in the file, (vocab, hidden) once read) must have the config's shape, and a
/// large model (over 2^24 weights) the file cannot fill is refused here; a smaller one reaches the
/// strict load, which lists every missing tensor. `sizes` spells the config's sizes as the file
/// names them.
inline void check_weights_fit(const ModelConfig& cfg, const std::optional<Shape>& embed, std::string_view embed_name,
                              double in_file, const std::string& who, const std::string& source,
                              const std::string& sizes) {
  if (embed && *embed != Shape{cfg.vocab_size, cfg.hidden_size})
    nn::detail::fail(who, source, ": ", embed_name, " is ", embed->str(), " but the config describes (",
                     cfg.vocab_size, ", ", cfg.hidden_size, ")");
  if (const double needs = cfg.matrix_parameters(); needs > in_file && needs > static_cast<double>(1 << 24))
    nn::detail::fail(who, source, ": the config describes at least ", needs, " weights (", sizes,
                     ") but the file's tensors hold ", in_file);
}

/// mlx-lm's "quantization" block of config.json (mlx_lm.convert -q writes it, and a copy as
/// "quantization_config"): the default format, and the per-layer entries a mixed recipe writes
/// ("model.layers.1.mlp.down_proj": {"group_size": 32, "bits": 6, "mode": "affine"}, or false
/// for a layer left in full precision).
struct MlxQuantization {
  bool present = false;
  std::map<std::string, std::optional<Quant>> layers;  // nullopt: the layer is not quantized
};

/// One {"group_size", "bits", "mode"} object as a Quant; `where` names it in errors.
inline Quant mlx_quant_from_json(const nlohmann::json& j, const std::string& where) {
  auto num = [&](const char* k) -> int {
    const auto it = j.find(k);
    if (it == j.end() || !it->is_number_integer())
      nn::detail::fail("load_hf", where, ": \"", k, "\" must be an integer, got ", it == j.end() ? "nothing" : it->dump());
    return it->get<int>();
  };
  const std::string mode = j.contains("mode") ? (j["mode"].is_string() ? j["mode"].get<std::string>() : j["mode"].dump()) : "affine";
  Quant q;
  if (mode == "affine") q = Quant::affine(num("group_size"), num("bits"));
  else if (mode == "mxfp4") q = Quant::mxfp4();
  else if (mode == "mxfp8") q = Quant::mxfp8();
  else if (mode == "nvfp4") q = Quant::nvfp4();
  else
    nn::detail::fail("load_hf", where, ": quantization mode \"", mode,
                     "\" is not supported (nn reads MLX's affine, mxfp4, mxfp8 and nvfp4 formats)");
  if (quant_fp(q.mode) && ((j.contains("group_size") && num("group_size") != q.group) || (j.contains("bits") && num("bits") != q.bits)))
    nn::detail::fail("load_hf", where, ": ", quant_mode_name(q.mode), " needs group_size ", q.group, " and bits ", q.bits,
                     ", got ", j.dump());
  try {
    nn::detail::check_quant(q, "load_hf");
  } catch (const Error&) {
    nn::detail::fail("load_hf", where, ": group_size ", q.group, " with ", q.bits,
                     " bits is not a format MLX defines (affine: groups 32, 64, 128; bits 2, 3, 4, 5, 6, 8)");
  }
  return q;
}

/// Reads config.json's quantization. A Hugging Face "quantization_config" of another method
/// (GPTQ, AWQ, bitsandbytes, fp8: "quant_method") is refused by name: nn reads mlx-lm's format.
inline MlxQuantization mlx_quantization(const nlohmann::json& cfg, const std::string& file) {
  MlxQuantization out;
  const nlohmann::json* q = nullptr;
  if (cfg.contains("quantization")) q = &cfg["quantization"];
  else if (cfg.contains("quantization_config")) {
    const nlohmann::json& hf = cfg["quantization_config"];
    if (hf.is_object() && hf.contains("quant_method"))
      nn::detail::fail("load_hf", file, ": quantization_config.quant_method ", hf["quant_method"].dump(),
                       " is not supported: nn loads mlx-lm's quantized folders (\"quantization\": group_size, bits, "
                       "mode) and GGUF files; dequantize the checkpoint, or convert it with mlx_lm.convert -q");
    q = &hf;
  }
  if (!q || q->is_null()) return out;
  if (!q->is_object()) nn::detail::fail("load_hf", file, ": \"quantization\" must be an object, got ", q->dump());
  out.present = true;
  for (auto it = q->begin(); it != q->end(); ++it) {
    if (it.key() == "group_size" || it.key() == "bits" || it.key() == "mode") continue;
    const std::string where = file + ": quantization[\"" + it.key() + "\"]";
    if (it->is_boolean()) {
      if (it->get<bool>()) nn::detail::fail("load_hf", where, ": true names no format (mlx-lm writes an object or false)");
      out.layers.emplace(it.key(), std::nullopt);
    } else if (it->is_object()) {
      out.layers.emplace(it.key(), mlx_quant_from_json(*it, where));
    } else {
      nn::detail::fail("load_hf", where, ": must be an object {group_size, bits, mode} or false, got ", it->dump());
    }
  }
  return out;
}

/// The format of the layer at `path` whose in_features is `in`: its config entry, else (as
/// mlx-lm's load_model does) the group and bits the stored shapes imply, affine unless the scales
/// are u8 (then the fp mode with that group and bits: mxfp4, mxfp8 or nvfp4).
inline Quant mlx_layer_quant(const MlxQuantization& mq, const std::string& path, std::int64_t in,
                             const SafetensorsView& w, const SafetensorsView& scales) {
  const std::string where = scales.file() + ": \"" + path + "\"";
  if (!mq.present)
    nn::detail::fail("load_hf", where, ".scales is stored but config.json has no \"quantization\" block (mlx-lm would "
                     "not quantize this layer either)");
  if (auto it = mq.layers.find(path); it != mq.layers.end()) {
    if (!it->second)
      nn::detail::fail("load_hf", where, ": config.json's quantization marks it false (full precision), but the file stores ",
                       path, ".scales");
    return *it->second;
  }
  if (w.shape().size() != 2 || scales.shape().size() != 2 || scales.shape()[1] <= 0 || in % scales.shape()[1] != 0 ||
      w.shape()[1] * 32 % in != 0)
    nn::detail::fail("load_hf", where, ": cannot infer a format from weight ", Shape(w.shape()).str(), " and scales ",
                     Shape(scales.shape()).str(), " for ", in, " input features");
  const int group = static_cast<int>(in / scales.shape()[1]), bits = static_cast<int>(w.shape()[1] * 32 / in);
  if (scales.dtype() != SafetensorsDtype::U8) return Quant::affine(group, bits);
  for (const Quant q : {Quant::mxfp4(), Quant::mxfp8(), Quant::nvfp4()})  // u8 scales: one (bits, group) per mode
    if (q.bits == bits && q.group == group) return q;
  nn::detail::fail("load_hf", where, ": u8 scales with group ", group, " and ", bits,
                   " bits match none of MLX's fp modes (mxfp4 32/4, mxfp8 32/8, nvfp4 16/4)");
}

}  // namespace detail

/// Loads a Hugging Face checkpoint folder (config.json plus model.safetensors or a sharded
/// model.safetensors.index.json) into a model computing in `dtype` (f32, or f64 for oracle
/// tests); bf16 / f16 / f32 / f64 weights are converted on load. Strict: a name the model lacks,
/// a weight it needs that is absent, or a shape that differs raises nn::Error listing every
/// such name, and no model is returned. As transformers does, rotary_emb.inv_freq buffers and a
/// stored lm_head.weight of a tied model are skipped.
///
/// An mlx-lm quantized folder (mlx_lm.convert -q: config.json's "quantization", per-layer
/// overrides included) loads quantized, as mlx_lm.load does: every Linear / Embedding whose
/// `<path>.scales` is stored becomes a QuantizedLinear / QuantizedEmbedding holding the stored
/// codes, scales and biases as they are (no float copy of the matrix; scales keep their dtype,
/// and widen to f64 for an f64 model). Its format is the layer's config entry, else the one the
/// shapes imply. dequantize_layers(model) turns them back into float layers.
inline CausalLM load_hf(const std::filesystem::path& folder, DType dtype = DType::f32) {
  const std::filesystem::path config_file = folder / "config.json";
  const ModelConfig cfg = load_config(config_file);
  const detail::MlxQuantization mq =
      detail::mlx_quantization(detail::read_json_file(config_file, "load_hf"), config_file.string());
  detail::HfWeightFiles wf = detail::hf_weight_files(folder);
  // Every file's header first (no tensor data is read): the tensors are checked against the
  // config before the model is allocated.
  std::vector<SafetensorsFile> files;
  std::map<std::string, SafetensorsView> scales;  // quantized layer path -> its stored scales
  for (const auto& file : wf.files) {
    files.emplace_back(file);
    for (const SafetensorsView& v : files.back().views())
      if (v.name().ends_with(".scales")) scales.emplace(v.name().substr(0, v.name().size() - 7), v);
  }
  auto quantized_part = [&](const std::string& name) {  // "<layer>.{weight,scales,biases}" of a quantized layer
    const std::size_t dot = name.rfind('.');
    if (dot == std::string::npos) return false;
    const std::string leaf = name.substr(dot + 1);
    return (leaf == "weight" || leaf == "scales" || leaf == "biases") && scales.count(name.substr(0, dot)) > 0;
  };
  std::optional<Shape> embed;
  double in_file = 0;
  for (const SafetensorsFile& f : files)
    for (const SafetensorsView& v : f.views()) {
      // A u32 word holds up to 16 codes (2 bits): the bound on what a quantized matrix can hold.
      const bool codes = quantized_part(v.name()) && v.dtype() == SafetensorsDtype::U32;
      in_file += static_cast<double>(v.numel()) * (codes ? 16.0 : 1.0);
      if (v.name() == "model.embed_tokens.weight" && !codes) embed = Shape(v.shape());
    }
  detail::check_weights_fit(cfg, embed, "model.embed_tokens.weight", in_file, "load_hf", folder.string(),
                            "num_hidden_layers " + std::to_string(cfg.num_hidden_layers) + ", hidden_size " +
                                std::to_string(cfg.hidden_size) + ", intermediate_size " +
                                std::to_string(cfg.intermediate_size) + ", vocab_size " +
                                std::to_string(cfg.vocab_size));
  CausalLM m = detail::allocate(cfg, dtype, folder.string());
  nn::detail::NamedTensorList named;
  std::map<std::string, std::map<std::string, SafetensorsView>> parts;  // layer path -> leaf -> view
  for (std::size_t i = 0; i < files.size(); ++i) {
    const SafetensorsFile& f = files[i];
    const std::filesystem::path& file = wf.files[i];
    for (const SafetensorsView& v : f.views()) {
      if (!wf.weight_map.empty()) {
        auto it = wf.weight_map.find(v.name());
        if (it == wf.weight_map.end() || std::filesystem::path(it->second).filename() != file.filename())
          nn::detail::fail("load_hf", file.string(), ": holds \"", v.name(), "\", which the index ",
                           it == wf.weight_map.end() ? std::string("does not list")
                                                     : "places in \"" + it->second + "\"");
      }
      if (v.name().ends_with(".rotary_emb.inv_freq")) continue;  // a derived buffer
      if (cfg.tie_word_embeddings && v.name() == "lm_head.weight") continue;  // the embedding is the head
      if (quantized_part(v.name())) {
        const std::size_t dot = v.name().rfind('.');
        parts[v.name().substr(0, dot)].emplace(v.name().substr(dot + 1), v);
        continue;
      }
      named.emplace_back(v.name(), detail::float_tensor(v, dtype));
    }
  }
  if (!wf.weight_map.empty()) {
    std::set<std::string> got;
    for (const auto& [n, t] : named) got.insert(n);
    for (const auto& [p, leaves] : parts)
      for (const auto& [leaf, v] : leaves) got.insert(p + "." + leaf);
    for (const auto& [n, shard] : wf.weight_map) {
      const bool skipped = n.ends_with(".rotary_emb.inv_freq") || (cfg.tie_word_embeddings && n == "lm_head.weight");
      if (!skipped && !got.count(n))
        nn::detail::fail("load_hf", (folder / "model.safetensors.index.json").string(), ": lists \"", n, "\" in \"",
                         shard, "\", which does not hold it");
    }
  }
  for (const auto& [p, leaves] : parts)
    if (detail::fused_name(detail::fused_projections(cfg), p + ".weight", false))
      nn::detail::fail("load_hf", folder.string(), ": \"", p, "\" is quantized; a quantized ", cfg.model_type,
                       " projection stored fused is not supported (load the float checkpoint)");
  for (const auto& [p, q] : mq.layers)
    if (q && !parts.count(p) && (p.starts_with("model.") || p == "lm_head"))
      nn::detail::fail("load_hf", config_file.string(), ": quantization[\"", p, "\"] quantizes a layer whose ", p,
                       ".scales no weight file stores");
  // A stored quantized layer, checked against the float layer it replaces: (out, in) as the
  // config makes it. Its tensors join `named`, so the strict load still checks every name.
  auto matrix = [&](const std::string& p, const Shape& float_shape) {
    const auto& leaves = parts.at(p);
    const auto w = leaves.find("weight");
    if (w == leaves.end())
      nn::detail::fail("load_hf", leaves.at("scales").file(), ": stores \"", p, ".scales\" but no \"", p, ".weight\"");
    const Quant q = detail::mlx_layer_quant(mq, p, float_shape[1], w->second, leaves.at("scales"));
    QuantizedMatrix qm{w->second.to_tensor(), leaves.at("scales").to_tensor(), Tensor(), q};
    if (auto b = leaves.find("biases"); b != leaves.end()) qm.biases = b->second.to_tensor();
    std::int64_t cols = 0;
    try {
      cols = nn::detail::check_quantized(qm.weight, qm.scales, qm.biases, q, "quantized layer");
    } catch (const Error& e) {
      nn::detail::fail("load_hf", w->second.file(), ": \"", p, "\" (", quant_mode_name(q.mode), ", group ", q.group, ", ",
                       q.bits, " bits): ", e.what());
    }
    if (qm.rows() != float_shape[0] || cols != float_shape[1])
      nn::detail::fail("load_hf", w->second.file(), ": \"", p, "\" holds a (", qm.rows(), ", ", cols, ") matrix in ",
                       quant_mode_name(q.mode), " ", q.group, "/", q.bits, " but the config makes it ", float_shape.str());
    if (dtype == DType::f64 && q.mode == QuantMode::affine) {  // an f64 oracle model: its scales in f64 (exact)
      qm.scales = qm.scales.to(DType::f64);
      qm.biases = qm.biases.to(DType::f64);
    }
    named.emplace_back(p + ".weight", qm.weight);
    named.emplace_back(p + ".scales", qm.scales);
    if (qm.biases.defined()) named.emplace_back(p + ".biases", qm.biases);
    return qm;
  };
  auto stored = [&](const std::string& p) { return parts.count(p) > 0; };
  m.map_modules<Linear>(stored, [&](const std::string& p, const Linear& l) {
    QuantizedMatrix qm = matrix(p, l.weight.value.shape());
    std::optional<Tensor> bias;
    if (l.bias) bias = Tensor::empty(l.bias->shape(), l.bias->dtype());
    return QuantizedLinear::from_quantized(std::move(qm), bias);
  });
  m.map_modules<Embedding>(stored, [&](const std::string& p, const Embedding& e) {
    QuantizedMatrix qm = matrix(p, e.weight.value.shape());
    if (dtype == DType::f64 && quant_fp(qm.q.mode))  // its rows would gather in float32
      nn::detail::fail("load_hf", folder.string(), ": \"", p, "\" is ", quant_mode_name(qm.q.mode),
                       ", which a float64 model cannot keep quantized (an fp-mode embedding gathers float32); load "
                       "in float32, or dequantize_layers");
    return QuantizedEmbedding::from_quantized(std::move(qm));
  });
  detail::split_fused(cfg, named, folder.string());
  // Parts of a path the model has no Linear / Embedding at reach the strict load as they are,
  // which names them as unknown.
  std::set<std::string> listed;
  for (const auto& [n, t] : named) listed.insert(n);
  for (const auto& [p, leaves] : parts)
    for (const auto& [leaf, v] : leaves)
      if (!listed.count(p + "." + leaf)) named.emplace_back(p + "." + leaf, v.to_tensor());
  detail::load_named(m, named, folder.string());
  return m;
}

// ---------------------------------------------------------------------------------------------
// GGUF

namespace detail {

/// The names llama.cpp and Hugging Face give the same tensors (llama.cpp src/llama-arch.cpp,
/// gguf-py tensor_mapping.py): whole names, then the parts of "blk.N.<part>.<leaf>" <->
/// "model.layers.N.<part>.<leaf>". The one table both directions read.
struct GgufNames {
  static constexpr std::pair<std::string_view, std::string_view> whole[] = {
      {"token_embd.weight", "model.embed_tokens.weight"},
      {"output_norm.weight", "model.norm.weight"},
      {"output.weight", "lm_head.weight"}};
  static constexpr std::pair<std::string_view, std::string_view> parts[] = {
      {"attn_norm", "input_layernorm"}, {"ffn_norm", "post_attention_layernorm"},
      {"attn_q", "self_attn.q_proj"},   {"attn_k", "self_attn.k_proj"},
      {"attn_v", "self_attn.v_proj"},   {"attn_output", "self_attn.o_proj"},
      {"ffn_gate", "mlp.gate_proj"},    {"ffn_up", "mlp.up_proj"},
      {"ffn_down", "mlp.down_proj"},   {"attn_q_norm", "self_attn.q_norm"},
      {"attn_k_norm", "self_attn.k_norm"}, {"attn_qkv", "self_attn.qkv_proj"}};

  /// Maps `name` from one side to the other (to_hf: llama.cpp -> HF). A name with no mapping
  /// comes back nullopt. Phi-3's ffn_up is its gate_up_proj (gate and up stacked, as llama.cpp's
  /// phi3 graph splits it), every other family's up_proj.
  static std::optional<std::string> map(const std::string& name, bool to_hf, Arch arch = Arch::llama) {
    for (const auto& [g, h] : whole)
      if (name == (to_hf ? g : h)) return std::string(to_hf ? h : g);
    const std::string_view prefix = to_hf ? "blk." : "model.layers.";
    if (name.rfind(prefix, 0) != 0) return std::nullopt;
    const std::size_t dot1 = name.find('.', prefix.size());
    if (dot1 == std::string::npos || dot1 == prefix.size()) return std::nullopt;
    const std::string layer = name.substr(prefix.size(), dot1 - prefix.size());
    if (layer.find_first_not_of("0123456789") != std::string::npos) return std::nullopt;
    const std::size_t dot2 = name.rfind('.');
    if (dot2 <= dot1) return std::nullopt;
    const std::string part = name.substr(dot1 + 1, dot2 - dot1 - 1), leaf = name.substr(dot2 + 1);
    if (leaf != "weight" && leaf != "bias") return std::nullopt;
    for (auto [g, h] : parts) {
      if (arch == Arch::phi3 && g == "ffn_up") h = "mlp.gate_up_proj";
      if (part == (to_hf ? g : h))
        return (to_hf ? "model.layers." : "blk.") + layer + "." + std::string(to_hf ? h : g) + "." + leaf;
    }
    return std::nullopt;
  }
};

/// llama.cpp's tensor name -> Hugging Face's. A name with no mapping is returned unchanged, so the
/// strict load reports it as unknown.
inline std::string gguf_to_hf_name(const std::string& g, Arch arch = Arch::llama) {
  return GgufNames::map(g, true, arch).value_or(g);
}

/// Hugging Face's tensor name -> llama.cpp's; raises naming the file being written (`label`) and
/// the tensor when llama.cpp has no name for it.
inline std::string hf_to_gguf_name(const std::string& hf, const std::string& label, Arch arch = Arch::llama) {
  if (auto g = GgufNames::map(hf, false, arch)) return *g;
  nn::detail::fail("gguf", label, ": tensor \"", hf, "\" has no llama.cpp name (the Llama / Qwen2 / Qwen3 / Phi-3 decoder's tensors have)");
}

/// convert_hf_to_gguf.py's LlamaModel.permute on the rows of a q/k weight (out, in) or bias (out),
/// and its inverse. The converter regroups each head's rows from HF's half-split RoPE pairs
/// (x[i], x[i + hd/2]) to llama.cpp's interleaved ones (x[2i], x[2i + 1]):
///   stored row h*hd + 2i + s  <-  HF row h*hd + s*hd/2 + i      (s in {0, 1}, i < hd/2)
/// to_gguf false undoes it (loading), true applies it (export). n_head is the tensor's own head
/// count (n_kv_heads for k).
inline Tensor permute_rows(const Tensor& t, std::int64_t n_head, const std::string& name, bool to_gguf) {
  const std::int64_t rows = t.dim(0), cols = rows ? t.numel() / rows : 0;
  if (n_head <= 0 || rows % n_head != 0 || (rows / n_head) % 2 != 0)
    nn::detail::fail("gguf", "tensor \"", name, "\" ", t.shape().str(), " does not split into ", n_head,
                     " heads of even size");
  const std::int64_t hd = rows / n_head, half = hd / 2;
  Tensor out = Tensor::empty(t.shape(), t.dtype());
  const std::size_t row_bytes = static_cast<std::size_t>(cols) * dtype_size(t.dtype());
  const auto* src = static_cast<const std::byte*>(t.raw());
  auto* dst = static_cast<std::byte*>(out.raw());
  for (std::int64_t h = 0; h < n_head; ++h)
    for (std::int64_t s = 0; s < 2; ++s)
      for (std::int64_t i = 0; i < half; ++i) {
        const auto hf = static_cast<std::size_t>(h * hd + s * half + i), gg = static_cast<std::size_t>(h * hd + 2 * i + s);
        std::memcpy(dst + (to_gguf ? gg : hf) * row_bytes, src + (to_gguf ? hf : gg) * row_bytes, row_bytes);
      }
  return out;
}
inline Tensor unpermute_rows(const Tensor& t, std::int64_t n_head, const std::string& name) {
  return permute_rows(t, n_head, name, false);
}

/// Typed metadata reads whose errors name the file and the key.
struct GgufMeta {
  const GgufFile& f;
  template <class Fn>
  auto read(const std::string& key, Fn fn) const -> decltype(fn(std::declval<const GgufValue&>())) {
    try {
      return fn(f.at(key));
    } catch (const nn::Error& e) {
      std::string msg = e.what();
      if (msg.find(f.path()) != std::string::npos) throw;
      if (msg.rfind("[gguf] ", 0) == 0) msg = msg.substr(7);
      nn::detail::fail("gguf", f.path(), ": ", msg);
    }
  }
  std::int64_t req_int(const std::string& key) const {
    return read(key, [](const GgufValue& v) { return v.as_int(); });
  }
  std::int64_t opt_int(const std::string& key, std::int64_t dflt) const { return f.contains(key) ? req_int(key) : dflt; }
  double opt_num(const std::string& key, double dflt) const {
    return f.contains(key) ? read(key, [](const GgufValue& v) { return v.as_float(); }) : dflt;
  }
  std::string opt_str(const std::string& key, const std::string& dflt) const {
    return f.contains(key) ? read(key, [](const GgufValue& v) { return v.as_string(); }) : dflt;
  }
};

}  // namespace detail

/// The model's hyperparameters from GGUF metadata: general.architecture ("llama", "qwen2", "qwen3")
/// and <arch>.embedding_length, .block_count, .feed_forward_length, .attention.head_count,
/// .attention.head_count_kv, .attention.key_length, .attention.layer_norm_rms_epsilon,
/// .rope.freq_base, .rope.scaling.*, .context_length; the vocabulary size from <arch>.vocab_size,
/// else the tokenizer's token list, else token_embd's rows. Tied embeddings when there is no
/// output.weight; biases when the tensors are there; a rope_freqs tensor becomes
/// rope_freq_factors (llama.cpp's form of Llama 3's frequency remap).
inline ModelConfig gguf_config(const GgufFile& f) {
  detail::GgufMeta m{f};
  const std::string label = f.path();
  ModelConfig c;
  c.model_type = m.read("general.architecture", [](const GgufValue& v) { return v.as_string(); });
  if (c.model_type == "gemma2" || c.model_type == "gemma3")  // llama.cpp stores Gemma's norms as 1 + w, named its own way
    nn::detail::fail("gguf", label, ": general.architecture \"", c.model_type, "\": nn reads Gemma 2 and 3 from Hugging Face "
                     "folders only, not from GGUF (supported here: llama, qwen2, qwen3, phi3)");
  if (const std::optional<Arch> arch = arch_from_name(c.model_type); arch && c.model_type != "smollm") c.arch = *arch;
  else
    nn::detail::fail("gguf", label, ": general.architecture \"", c.model_type, "\" is not a supported model family (supported: ",
                     kSupportedFamilies, ")");
  const std::string a = c.model_type + ".";
  // Each size is checked as it is read, under its GGUF key and ModelConfig's limits, so that a
  // bad one is named before anything is derived from it or allocated.
  auto sized = [&](const std::string& key, std::int64_t v, std::int64_t max) {
    ModelConfig::check_size(label, key, v, max);
    return v;
  };
  c.hidden_size = sized(a + "embedding_length", m.req_int(a + "embedding_length"), ModelConfig::kMaxWidth);
  c.num_hidden_layers = sized(a + "block_count", m.req_int(a + "block_count"), ModelConfig::kMaxLayers);
  c.intermediate_size = sized(a + "feed_forward_length", m.req_int(a + "feed_forward_length"), ModelConfig::kMaxWidth);
  c.num_attention_heads = sized(a + "attention.head_count", m.req_int(a + "attention.head_count"), ModelConfig::kMaxHeads);
  c.num_key_value_heads = sized(a + "attention.head_count_kv",
                               m.opt_int(a + "attention.head_count_kv", c.num_attention_heads), ModelConfig::kMaxHeads);
  c.head_dim = sized(a + "attention.key_length", m.opt_int(a + "attention.key_length", c.hidden_size / c.num_attention_heads),
                    ModelConfig::kMaxWidth);
  if (const std::int64_t vl = m.opt_int(a + "attention.value_length", c.head_dim); vl != c.head_dim)
    nn::detail::fail("gguf", label, ": ", a, "attention.value_length ", vl, " differs from the key length ", c.head_dim);
  if (const std::int64_t rd = m.opt_int(a + "rope.dimension_count", c.head_dim); rd != c.head_dim)
    nn::detail::fail("gguf", label, ": ", a, "rope.dimension_count ", rd, " differs from head_dim ", c.head_dim,
                     " (partial rotary embeddings are not supported)");
  c.rms_norm_eps = m.opt_num(a + "attention.layer_norm_rms_epsilon", 1e-6);
  c.rope_theta = m.opt_num(a + "rope.freq_base", 10000.0);
  const std::string scaling = m.opt_str(a + "rope.scaling.type", "none");
  if (scaling == "linear") {
    c.rope_scaling.type = "linear";
    c.rope_scaling.factor = m.opt_num(a + "rope.scaling.factor", 1.0);
    if (!(c.rope_scaling.factor > 0)) nn::detail::fail("gguf", label, ": ", a, "rope.scaling.factor must be positive");
  } else if (scaling != "none") {
    nn::detail::fail("gguf", label, ": ", a, "rope.scaling.type \"", scaling, "\" is not supported (none, linear)");
  }
  if (f.contains(a + "vocab_size")) {
    c.vocab_size = sized(a + "vocab_size", m.req_int(a + "vocab_size"), ModelConfig::kMaxVocab);
  } else if (f.contains("tokenizer.ggml.tokens")) {
    c.vocab_size = static_cast<std::int64_t>(m.read("tokenizer.ggml.tokens", [](const GgufValue& v) { return v.size(); }));
  } else if (const GgufTensorInfo* t = f.find_tensor("token_embd.weight"); t && t->ne.size() == 2) {
    c.vocab_size = t->ne[1];
  }
  c.max_position_embeddings =
      sized(a + "context_length", m.opt_int(a + "context_length", c.max_position_embeddings), ModelConfig::kMaxPositions);
  c.tie_word_embeddings = f.find_tensor("output.weight") == nullptr;
  c.qkv_bias = c.arch == Arch::qwen2 || f.find_tensor("blk.0.attn_q.bias") != nullptr;
  c.o_bias = f.find_tensor("blk.0.attn_output.bias") != nullptr;
  c.mlp_bias = f.find_tensor("blk.0.ffn_gate.bias") != nullptr;
  c.qk_norm = c.arch == Arch::qwen3;
  if (c.arch == Arch::phi3) {  // llama.cpp's phi3: no biases; the window as convert_hf_to_gguf writes it
    c.qkv_bias = c.o_bias = c.mlp_bias = false;
    c.sliding_window = m.opt_int(a + "attention.sliding_window", 0);
    if (c.sliding_window < 0) nn::detail::fail("gguf", label, ": ", a, "attention.sliding_window must not be negative");
  }
  if (const GgufTensorInfo* t = f.find_tensor("rope_freqs.weight")) {
    Tensor ff = f.tensor(*t, DType::f64);
    c.rope_freq_factors = ff.to_doubles();
  }
  c.validate(label);
  return c;
}

/// Builds a CausalLM from an open GGUF file, renaming llama.cpp's tensors to HF's and, for the
/// llama architecture, undoing the converter's q/k row permutation (qwen2 files are stored
/// unpermuted, as llama.cpp runs qwen2 with NEOX RoPE). Strict, as load_hf.
/// With keep_quantized, the Q4_0 / Q4_1 / Q8_0 matrices of the projections, the embedding and the
/// head stay quantized (QuantizedLinear / QuantizedEmbedding, GgufFile::quantized: affine groups
/// of 32, no float copy of the matrix is ever made); every other tensor is dequantised to
/// `dtype` (f32, or f64 for oracle tests), as without it.
inline CausalLM load_gguf(const GgufFile& f, DType dtype = DType::f32, bool keep_quantized = false) {
  const ModelConfig cfg = gguf_config(f);
  // The file's tensors against the metadata, before the model is allocated. The embedding must
  // have the metadata's shape. A model the tensors cannot fill is refused here when it is large
  // (over 2^24 weights); a smaller one reaches the strict load, which lists every missing tensor.
  const GgufTensorInfo* e = f.find_tensor("token_embd.weight");
  double in_file = 0;
  for (const GgufTensorInfo& t : f.tensors()) in_file += static_cast<double>(t.numel());
  detail::check_weights_fit(cfg, e ? std::optional<Shape>(Shape(e->shape())) : std::nullopt, "token_embd.weight",
                            in_file, "gguf", f.path(),
                            cfg.model_type + ".block_count " + std::to_string(cfg.num_hidden_layers) +
                                ", embedding_length " + std::to_string(cfg.hidden_size) + ", feed_forward_length " +
                                std::to_string(cfg.intermediate_size) + ", vocabulary " +
                                std::to_string(cfg.vocab_size));
  CausalLM m = detail::allocate(cfg, dtype, f.path());
  nn::detail::NamedTensorList named;
  named.reserve(f.tensors().size());
  std::map<std::string, QuantizedMatrix> quantized;  // module path -> matrix
  auto unpermute = [&](const std::string& hf, Tensor w, const std::string& gname) {
    if (cfg.arch == Arch::llama) {
      if (hf.ends_with("self_attn.q_proj.weight") || hf.ends_with("self_attn.q_proj.bias"))
        return detail::unpermute_rows(w, cfg.num_attention_heads, gname);
      if (hf.ends_with("self_attn.k_proj.weight") || hf.ends_with("self_attn.k_proj.bias"))
        return detail::unpermute_rows(w, cfg.num_key_value_heads, gname);
    }
    return w;
  };
  for (const GgufTensorInfo& t : f.tensors()) {
    if (t.name == "rope_freqs.weight") continue;  // read into the config
    std::string hf = detail::gguf_to_hf_name(t.name, cfg.arch);
    const bool matrix = hf.ends_with("_proj.weight") || hf == "model.embed_tokens.weight" || hf == "lm_head.weight";
    if (keep_quantized && matrix && GgufFile::keeps_quantized(t.type) && t.ne.size() == 2) {
      QuantizedMatrix q = f.quantized(t);
      q.weight = unpermute(hf, q.weight, t.name);  // a row of codes, scales and biases moves whole
      q.scales = unpermute(hf, q.scales, t.name);
      q.biases = unpermute(hf, q.biases, t.name);
      if (dtype == DType::f64) {  // an f64 oracle model: its scales in f64 (exact)
        q.scales = q.scales.to(DType::f64);
        q.biases = q.biases.to(DType::f64);
      }
      const std::string mod = hf.substr(0, hf.size() - 7);  // without ".weight"
      named.emplace_back(mod + ".weight", q.weight);
      named.emplace_back(mod + ".scales", q.scales);
      named.emplace_back(mod + ".biases", q.biases);
      quantized.emplace(mod, std::move(q));
      continue;
    }
    named.emplace_back(hf, unpermute(hf, f.tensor(t, dtype), t.name));
  }
  // Phi-3's fused projections, split into the model's parts (a quantized matrix by whole rows:
  // each row's codes, scales and biases move together). A fused matrix kept quantized becomes its
  // parts' QuantizedMatrix from the rows split_fused cut (shared storage: no second copy).
  detail::split_fused(cfg, named, f.path());
  if (const auto table = detail::fused_projections(cfg); !table.empty()) {
    std::map<std::string, const Tensor*> by_name;
    for (const auto& [n, t] : named) by_name.emplace(n, &t);
    for (const detail::FusedProjection& fp : table)
      for (std::int64_t li = 0; li < cfg.num_hidden_layers; ++li) {
        const std::string pre = "model.layers." + std::to_string(li) + ".";
        auto it = quantized.find(pre + fp.fused);
        if (it == quantized.end()) continue;
        const Quant q = it->second.q;
        quantized.erase(it);
        for (const std::string& part : fp.parts)
          quantized.emplace(pre + part, QuantizedMatrix{*by_name.at(pre + part + ".weight"),
                                                        *by_name.at(pre + part + ".scales"),
                                                        *by_name.at(pre + part + ".biases"), q});
      }
  }
  // Quantized matrices replace their layers before the strict load, which then checks every name
  // (a bias of a quantized projection lands in its QuantizedLinear) and hands over the storage.
  auto has = [&](const std::string& p) { return quantized.count(p) > 0; };
  m.map_modules<Linear>(has, [&](const std::string& p, const Linear& l) {
    const QuantizedMatrix& q = quantized.at(p);
    std::optional<Tensor> bias;
    if (l.bias) bias = Tensor::empty(l.bias->shape(), l.bias->dtype());
    return QuantizedLinear::from_quantized(q, bias);
  });
  m.map_modules<Embedding>(has, [&](const std::string& p, const Embedding&) {
    return QuantizedEmbedding::from_quantized(quantized.at(p));
  });
  detail::load_named(m, named, f.path());
  return m;
}

/// Opens, validates and loads a GGUF file (see load_gguf(const GgufFile&, DType)).
inline CausalLM load_gguf(const std::filesystem::path& path, DType dtype = DType::f32, bool keep_quantized = false) {
  return load_gguf(GgufFile(path), dtype, keep_quantized);
}

}  // namespace nn::lm
// ---- end nn/lm/load.hpp ----
// ---- begin nn/lm/tokenizer.hpp ----
// BPE tokenizer from a Hugging Face tokenizer.json or from GGUF vocabulary metadata, giving the
// same ids as Hugging Face `tokenizers`: byte-level BPE (GPT-2, Qwen2, SmolLM, Llama-3 style) and
// SentencePiece-style BPE with byte fallback (Llama 2, Mistral, TinyLlama, Gemma: GGUF's "llama"
// tokenizer model).
//
// Pipeline, as in `tokenizers`: added tokens that are not normalized are split out of the raw
// text first (leftmost-longest; special ones unless parse_special is off), the normalizer (none
// or NFC) runs on each stretch left, normalized added tokens are split out of that, the
// pre-tokenizer cuts words (Split regexes, ByteLevel's GPT-2 regex, Digits, in sequence), each
// word's UTF-8 bytes become byte-level symbols merged lowest rank first (leftmost on ties), and
// the post-processor adds BOS/EOS when asked. Decoding maps byte-level characters back to bytes
// and repairs broken UTF-8 as Rust's from_utf8_lossy does.
//
// SentencePiece-style BPE (a tokenizer.json whose BPE model has byte_fallback, or a Metaspace
// pre-tokenizer): spaces become "▁" (normalizers Prepend/Replace, or Metaspace), each stretch
// between added tokens is one word (or is cut before each "▁" by a splitting Metaspace), its
// symbols are Unicode characters, and a character not in the vocabulary becomes its <0xXX> byte
// tokens (else <unk>, fused). Decoding runs the file's decoder chain (Replace, ByteFallback, Fuse,
// Strip, Metaspace) token by token, as `tokenizers` does. From GGUF ("llama" model) it is
// llama.cpp's SentencePiece algorithm instead of merges: repeatedly join the adjacent pair whose
// joined text is the best-scoring token (tokenizer.ggml.scores), leftmost on ties, after a " "
// is put before each stretch of text (add_space_prefix) and spaces become "▁"; for a model
// converted from SentencePiece this gives the ids of its tokenizer.json.
//
// Not supported, and reported as nn::Error when a file asks for it: models other than BPE,
// BPE dropout, continuing_subword_prefix / end_of_word_suffix, normalizers other than NFC /
// Prepend / Replace with a string pattern, pre-tokenizers other than ByteLevel / Split / Digits /
// WhitespaceSplit / Metaspace, and files that are neither byte-level nor SentencePiece-style.

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

// ---- begin nn/lm/regex.hpp ----
// A small backtracking regex over Unicode code points, enough for tokenizer pre-tokenizer
// patterns (\p{L}, \p{N}, \s, classes, alternation, counted repeats, lookahead, (?i:...)).
//
// Why not std::regex: it has no \p{..} classes and works on bytes or wchar_t. The semantics
// follow Oniguruma (what Hugging Face `tokenizers` uses): leftmost-first alternation, greedy
// quantifiers with backtracking, \s = White_Space, \d = Nd, \w = word characters (below), ^ and
// $ are line anchors (Ruby syntax). Case-insensitive matching folds ASCII letters, plus U+017F (long s)
// with s and U+212A (Kelvin sign) with k, which are the only non-ASCII simple case folds onto
// ASCII; non-ASCII letters in a (?i) pattern match only themselves. Lookbehind, backreferences,
// possessive quantifiers, atomic groups and nested classes are not supported and are reported.

#include <cstddef>
#include <cstdint>
#include <memory>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// ---- begin nn/lm/unicode.hpp ----
// UTF-8 decoding and encoding, Unicode general categories, and NFC: what the tokenizer's
// pre-tokenizer regexes (\p{L}, \p{N}, \s) and Qwen2's NFC normalizer need.

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

// ---- begin nn/lm/unicode_data.hpp ----
// Unicode tables for the tokenizer (general categories, canonical decompositions and
// combining classes); generated by tests/oracle/gen_unicode_tables.py, do not edit.

#include <cstdint>

namespace nn::lm::detail {

inline constexpr const char* kUnicodeVersion = "16.0.0";
inline constexpr const char* kNfcUnicodeVersion = "9.0";  // as tokenizers' NFC

// (first << 5) | category, one entry per run; 4099 runs.
inline constexpr std::uint32_t kGcRuns[4099] = {
    0x1a, 0x417, 0x432, 0x494, 0x4b2, 0x50e, 0x52f, 0x552,
    0x573, 0x592, 0x5ad, 0x5d2, 0x609, 0x752, 0x793, 0x7f2,
    0x821, 0xb6e, 0xb92, 0xbaf, 0xbd5, 0xbec, 0xc15, 0xc22,
    0xf6e, 0xf93, 0xfaf, 0xfd3, 0xffa, 0x1417, 0x1432, 0x1454,
    0x14d6, 0x14f2, 0x1515, 0x1536, 0x1545, 0x1570, 0x1593, 0x15bb,
    0x15d6, 0x15f5, 0x1616, 0x1633, 0x164b, 0x1695, 0x16a2, 0x16d2,
    0x1715, 0x172b, 0x1745, 0x1771, 0x178b, 0x17f2, 0x1801, 0x1af3,
    0x1b01, 0x1be2, 0x1ef3, 0x1f02, 0x2001, 0x2022, 0x2041, 0x2062,
    0x2081, 0x20a2, 0x20c1, 0x20e2, 0x2101, 0x2122, 0x2141, 0x2162,
    0x2181, 0x21a2, 0x21c1, 0x21e2, 0x2201, 0x2222, 0x2241, 0x2262,
    0x2281, 0x22a2, 0x22c1, 0x22e2, 0x2301, 0x2322, 0x2341, 0x2362,
    0x2381, 0x23a2, 0x23c1, 0x23e2, 0x2401, 0x2422, 0x2441, 0x2462,
    0x2481, 0x24a2, 0x24c1, 0x24e2, 0x2501, 0x2522, 0x2541, 0x2562,
    0x2581, 0x25a2, 0x25c1, 0x25e2, 0x2601, 0x2622, 0x2641, 0x2662,
    0x2681, 0x26a2, 0x26c1, 0x26e2, 0x2721, 0x2742, 0x2761, 0x2782,
    0x27a1, 0x27c2, 0x27e1, 0x2802, 0x2821, 0x2842, 0x2861, 0x2882,
    0x28a1, 0x28c2, 0x28e1, 0x2902, 0x2941, 0x2962, 0x2981, 0x29a2,
    0x29c1, 0x29e2, 0x2a01, 0x2a22, 0x2a41, 0x2a62, 0x2a81, 0x2aa2,
    0x2ac1, 0x2ae2, 0x2b01, 0x2b22, 0x2b41, 0x2b62, 0x2b81, 0x2ba2,
    0x2bc1, 0x2be2, 0x2c01, 0x2c22, 0x2c41, 0x2c62, 0x2c81, 0x2ca2,
    0x2cc1, 0x2ce2, 0x2d01, 0x2d22, 0x2d41, 0x2d62, 0x2d81, 0x2da2,
    0x2dc1, 0x2de2, 0x2e01, 0x2e22, 0x2e41, 0x2e62, 0x2e81, 0x2ea2,
    0x2ec1, 0x2ee2, 0x2f01, 0x2f42, 0x2f61, 0x2f82, 0x2fa1, 0x2fc2,
    0x3021, 0x3062, 0x3081, 0x30a2, 0x30c1, 0x3102, 0x3121, 0x3182,
    0x31c1, 0x3242, 0x3261, 0x32a2, 0x32c1, 0x3322, 0x3381, 0x33c2,
    0x33e1, 0x3422, 0x3441, 0x3462, 0x3481, 0x34a2, 0x34c1, 0x3502,
    0x3521, 0x3542, 0x3581, 0x35a2, 0x35c1, 0x3602, 0x3621, 0x3682,
    0x36a1, 0x36c2, 0x36e1, 0x3722, 0x3765, 0x3781, 0x37a2, 0x3805,
    0x3881, 0x38a3, 0x38c2, 0x38e1, 0x3903, 0x3922, 0x3941, 0x3963,
    0x3982, 0x39a1, 0x39c2, 0x39e1, 0x3a02, 0x3a21, 0x3a42, 0x3a61,
    0x3a82, 0x3aa1, 0x3ac2, 0x3ae1, 0x3b02, 0x3b21, 0x3b42, 0x3b61,
    0x3b82, 0x3bc1, 0x3be2, 0x3c01, 0x3c22, 0x3c41, 0x3c62, 0x3c81,
    0x3ca2, 0x3cc1, 0x3ce2, 0x3d01, 0x3d22, 0x3d41, 0x3d62, 0x3d81,
    0x3da2, 0x3dc1, 0x3de2, 0x3e21, 0x3e43, 0x3e62, 0x3e81, 0x3ea2,
    0x3ec1, 0x3f22, 0x3f41, 0x3f62, 0x3f81, 0x3fa2, 0x3fc1, 0x3fe2,
    0x4001, 0x4022, 0x4041, 0x4062, 0x4081, 0x40a2, 0x40c1, 0x40e2,
    0x4101, 0x4122, 0x4141, 0x4162, 0x4181, 0x41a2, 0x41c1, 0x41e2,
    0x4201, 0x4222, 0x4241, 0x4262, 0x4281, 0x42a2, 0x42c1, 0x42e2,
    0x4301, 0x4322, 0x4341, 0x4362, 0x4381, 0x43a2, 0x43c1, 0x43e2,
    0x4401, 0x4422, 0x4441, 0x4462, 0x4481, 0x44a2, 0x44c1, 0x44e2,
    0x4501, 0x4522, 0x4541, 0x4562, 0x4581, 0x45a2, 0x45c1, 0x45e2,
    0x4601, 0x4622, 0x4641, 0x4662, 0x4741, 0x4782, 0x47a1, 0x47e2,
    0x4821, 0x4842, 0x4861, 0x48e2, 0x4901, 0x4922, 0x4941, 0x4962,
    0x4981, 0x49a2, 0x49c1, 0x49e2, 0x5285, 0x52a2, 0x5604, 0x5855,
    0x58c4, 0x5a55, 0x5c04, 0x5cb5, 0x5d84, 0x5db5, 0x5dc4, 0x5df5,
    0x6006, 0x6e01, 0x6e22, 0x6e41, 0x6e62, 0x6e84, 0x6eb5, 0x6ec1,
    0x6ee2, 0x6f00, 0x6f44, 0x6f62, 0x6fd2, 0x6fe1, 0x7000, 0x7095,
    0x70c1, 0x70f2, 0x7101, 0x7160, 0x7181, 0x71a0, 0x71c1, 0x7202,
    0x7221, 0x7440, 0x7461, 0x7582, 0x79e1, 0x7a02, 0x7a41, 0x7aa2,
    0x7b01, 0x7b22, 0x7b41, 0x7b62, 0x7b81, 0x7ba2, 0x7bc1, 0x7be2,
    0x7c01, 0x7c22, 0x7c41, 0x7c62, 0x7c81, 0x7ca2, 0x7cc1, 0x7ce2,
    0x7d01, 0x7d22, 0x7d41, 0x7d62, 0x7d81, 0x7da2, 0x7dc1, 0x7de2,
    0x7e81, 0x7ea2, 0x7ed3, 0x7ee1, 0x7f02, 0x7f21, 0x7f62, 0x7fa1,
    0x8602, 0x8c01, 0x8c22, 0x8c41, 0x8c62, 0x8c81, 0x8ca2, 0x8cc1,
    0x8ce2, 0x8d01, 0x8d22, 0x8d41, 0x8d62, 0x8d81, 0x8da2, 0x8dc1,
    0x8de2, 0x8e01, 0x8e22, 0x8e41, 0x8e62, 0x8e81, 0x8ea2, 0x8ec1,
    0x8ee2, 0x8f01, 0x8f22, 0x8f41, 0x8f62, 0x8f81, 0x8fa2, 0x8fc1,
    0x8fe2, 0x9001, 0x9022, 0x9056, 0x9066, 0x9108, 0x9141, 0x9162,
    0x9181, 0x91a2, 0x91c1, 0x91e2, 0x9201, 0x9222, 0x9241, 0x9262,
    0x9281, 0x92a2, 0x92c1, 0x92e2, 0x9301, 0x9322, 0x9341, 0x9362,
    0x9381, 0x93a2, 0x93c1, 0x93e2, 0x9401, 0x9422, 0x9441, 0x9462,
    0x9481, 0x94a2, 0x94c1, 0x94e2, 0x9501, 0x9522, 0x9541, 0x9562,
    0x9581, 0x95a2, 0x95c1, 0x95e2, 0x9601, 0x9622, 0x9641, 0x9662,
    0x9681, 0x96a2, 0x96c1, 0x96e2, 0x9701, 0x9722, 0x9741, 0x9762,
    0x9781, 0x97a2, 0x97c1, 0x97e2, 0x9801, 0x9842, 0x9861, 0x9882,
    0x98a1, 0x98c2, 0x98e1, 0x9902, 0x9921, 0x9942, 0x9961, 0x9982,
    0x99a1, 0x99c2, 0x9a01, 0x9a22, 0x9a41, 0x9a62, 0x9a81, 0x9aa2,
    0x9ac1, 0x9ae2, 0x9b01, 0x9b22, 0x9b41, 0x9b62, 0x9b81, 0x9ba2,
    0x9bc1, 0x9be2, 0x9c01, 0x9c22, 0x9c41, 0x9c62, 0x9c81, 0x9ca2,
    0x9cc1, 0x9ce2, 0x9d01, 0x9d22, 0x9d41, 0x9d62, 0x9d81, 0x9da2,
    0x9dc1, 0x9de2, 0x9e01, 0x9e22, 0x9e41, 0x9e62, 0x9e81, 0x9ea2,
    0x9ec1, 0x9ee2, 0x9f01, 0x9f22, 0x9f41, 0x9f62, 0x9f81, 0x9fa2,
    0x9fc1, 0x9fe2, 0xa001, 0xa022, 0xa041, 0xa062, 0xa081, 0xa0a2,
    0xa0c1, 0xa0e2, 0xa101, 0xa122, 0xa141, 0xa162, 0xa181, 0xa1a2,
    0xa1c1, 0xa1e2, 0xa201, 0xa222, 0xa241, 0xa262, 0xa281, 0xa2a2,
    0xa2c1, 0xa2e2, 0xa301, 0xa322, 0xa341, 0xa362, 0xa381, 0xa3a2,
    0xa3c1, 0xa3e2, 0xa401, 0xa422, 0xa441, 0xa462, 0xa481, 0xa4a2,
    0xa4c1, 0xa4e2, 0xa501, 0xa522, 0xa541, 0xa562, 0xa581, 0xa5a2,
    0xa5c1, 0xa5e2, 0xa600, 0xa621, 0xaae0, 0xab24, 0xab52, 0xac02,
    0xb132, 0xb14d, 0xb160, 0xb1b6, 0xb1f4, 0xb200, 0xb226, 0xb7cd,
    0xb7e6, 0xb812, 0xb826, 0xb872, 0xb886, 0xb8d2, 0xb8e6, 0xb900,
    0xba05, 0xbd60, 0xbde5, 0xbe72, 0xbea0, 0xc01b, 0xc0d3, 0xc132,
    0xc174, 0xc192, 0xc1d6, 0xc206, 0xc372, 0xc39b, 0xc3b2, 0xc405,
    0xc804, 0xc825, 0xc966, 0xcc09, 0xcd52, 0xcdc5, 0xce06, 0xce25,
    0xda92, 0xdaa5, 0xdac6, 0xdbbb, 0xdbd6, 0xdbe6, 0xdca4, 0xdce6,
    0xdd36, 0xdd46, 0xddc5, 0xde09, 0xdf45, 0xdfb6, 0xdfe5, 0xe012,
    0xe1c0, 0xe1fb, 0xe205, 0xe226, 0xe245, 0xe606, 0xe960, 0xe9a5,
    0xf4c6, 0xf625, 0xf640, 0xf809, 0xf945, 0xfd66, 0xfe84, 0xfed6,
    0xfef2, 0xff44, 0xff60, 0xffa6, 0xffd4, 0x10005, 0x102c6, 0x10344,
    0x10366, 0x10484, 0x104a6, 0x10504, 0x10526, 0x105c0, 0x10612, 0x107e0,
    0x10805, 0x10b26, 0x10b80, 0x10bd2, 0x10be0, 0x10c05, 0x10d60, 0x10e05,
    0x11115, 0x11125, 0x111e0, 0x1121b, 0x11240, 0x112e6, 0x11405, 0x11924,
    0x11946, 0x11c5b, 0x11c66, 0x12067, 0x12085, 0x12746, 0x12767, 0x12786,
    0x127a5, 0x127c7, 0x12826, 0x12927, 0x129a6, 0x129c7, 0x12a05, 0x12a26,
    0x12b05, 0x12c46, 0x12c92, 0x12cc9, 0x12e12, 0x12e24, 0x12e45, 0x13026,
    0x13047, 0x13080, 0x130a5, 0x131a0, 0x131e5, 0x13220, 0x13265, 0x13520,
    0x13545, 0x13620, 0x13645, 0x13660, 0x136c5, 0x13740, 0x13786, 0x137a5,
    0x137c7, 0x13826, 0x138a0, 0x138e7, 0x13920, 0x13967, 0x139a6, 0x139c5,
    0x139e0, 0x13ae7, 0x13b00, 0x13b85, 0x13bc0, 0x13be5, 0x13c46, 0x13c80,
    0x13cc9, 0x13e05, 0x13e54, 0x13e8b, 0x13f56, 0x13f74, 0x13f85, 0x13fb2,
    0x13fc6, 0x13fe0, 0x14026, 0x14067, 0x14080, 0x140a5, 0x14160, 0x141e5,
    0x14220, 0x14265, 0x14520, 0x14545, 0x14620, 0x14645, 0x14680, 0x146a5,
    0x146e0, 0x14705, 0x14740, 0x14786, 0x147a0, 0x147c7, 0x14826, 0x14860,
    0x148e6, 0x14920, 0x14966, 0x149c0, 0x14a26, 0x14a40, 0x14b25, 0x14ba0,
    0x14bc5, 0x14be0, 0x14cc9, 0x14e06, 0x14e45, 0x14ea6, 0x14ed2, 0x14ee0,
    0x15026, 0x15067, 0x15080, 0x150a5, 0x151c0, 0x151e5, 0x15240, 0x15265,
    0x15520, 0x15545, 0x15620, 0x15645, 0x15680, 0x156a5, 0x15740, 0x15786,
    0x157a5, 0x157c7, 0x15826, 0x158c0, 0x158e6, 0x15927, 0x15940, 0x15967,
    0x159a6, 0x159c0, 0x15a05, 0x15a20, 0x15c05, 0x15c46, 0x15c80, 0x15cc9,
    0x15e12, 0x15e34, 0x15e40, 0x15f25, 0x15f46, 0x16000, 0x16026, 0x16047,
    0x16080, 0x160a5, 0x161a0, 0x161e5, 0x16220, 0x16265, 0x16520, 0x16545,
    0x16620, 0x16645, 0x16680, 0x166a5, 0x16740, 0x16786, 0x167a5, 0x167c7,
    0x167e6, 0x16807, 0x16826, 0x168a0, 0x168e7, 0x16920, 0x16967, 0x169a6,
    0x169c0, 0x16aa6, 0x16ae7, 0x16b00, 0x16b85, 0x16bc0, 0x16be5, 0x16c46,
    0x16c80, 0x16cc9, 0x16e16, 0x16e25, 0x16e4b, 0x16f00, 0x17046, 0x17065,
    0x17080, 0x170a5, 0x17160, 0x171c5, 0x17220, 0x17245, 0x172c0, 0x17325,
    0x17360, 0x17385, 0x173a0, 0x173c5, 0x17400, 0x17465, 0x174a0, 0x17505,
    0x17560, 0x175c5, 0x17740, 0x177c7, 0x17806, 0x17827, 0x17860, 0x178c7,
    0x17920, 0x17947, 0x179a6, 0x179c0, 0x17a05, 0x17a20, 0x17ae7, 0x17b00,
    0x17cc9, 0x17e0b, 0x17e76, 0x17f34, 0x17f56, 0x17f60, 0x18006, 0x18027,
    0x18086, 0x180a5, 0x181a0, 0x181c5, 0x18220, 0x18245, 0x18520, 0x18545,
    0x18740, 0x18786, 0x187a5, 0x187c6, 0x18827, 0x188a0, 0x188c6, 0x18920,
    0x18946, 0x189c0, 0x18aa6, 0x18ae0, 0x18b05, 0x18b60, 0x18ba5, 0x18bc0,
    0x18c05, 0x18c46, 0x18c80, 0x18cc9, 0x18e00, 0x18ef2, 0x18f0b, 0x18ff6,
    0x19005, 0x19026, 0x19047, 0x19092, 0x190a5, 0x191a0, 0x191c5, 0x19220,
    0x19245, 0x19520, 0x19545, 0x19680, 0x196a5, 0x19740, 0x19786, 0x197a5,
    0x197c7, 0x197e6, 0x19807, 0x198a0, 0x198c6, 0x198e7, 0x19920, 0x19947,
    0x19986, 0x199c0, 0x19aa7, 0x19ae0, 0x19ba5, 0x19be0, 0x19c05, 0x19c46,
    0x19c80, 0x19cc9, 0x19e00, 0x19e25, 0x19e67, 0x19e80, 0x1a006, 0x1a047,
    0x1a085, 0x1a1a0, 0x1a1c5, 0x1a220, 0x1a245, 0x1a766, 0x1a7a5, 0x1a7c7,
    0x1a826, 0x1a8a0, 0x1a8c7, 0x1a920, 0x1a947, 0x1a9a6, 0x1a9c5, 0x1a9f6,
    0x1aa00, 0x1aa85, 0x1aae7, 0x1ab0b, 0x1abe5, 0x1ac46, 0x1ac80, 0x1acc9,
    0x1ae0b, 0x1af36, 0x1af45, 0x1b000, 0x1b026, 0x1b047, 0x1b080, 0x1b0a5,
    0x1b2e0, 0x1b345, 0x1b640, 0x1b665, 0x1b780, 0x1b7a5, 0x1b7c0, 0x1b805,
    0x1b8e0, 0x1b946, 0x1b960, 0x1b9e7, 0x1ba46, 0x1baa0, 0x1bac6, 0x1bae0,
    0x1bb07, 0x1bc00, 0x1bcc9, 0x1be00, 0x1be47, 0x1be92, 0x1bea0, 0x1c025,
    0x1c626, 0x1c645, 0x1c686, 0x1c760, 0x1c7f4, 0x1c805, 0x1c8c4, 0x1c8e6,
    0x1c9f2, 0x1ca09, 0x1cb52, 0x1cb80, 0x1d025, 0x1d060, 0x1d085, 0x1d0a0,
    0x1d0c5, 0x1d160, 0x1d185, 0x1d480, 0x1d4a5, 0x1d4c0, 0x1d4e5, 0x1d626,
    0x1d645, 0x1d686, 0x1d7a5, 0x1d7c0, 0x1d805, 0x1d8a0, 0x1d8c4, 0x1d8e0,
    0x1d906, 0x1d9e0, 0x1da09, 0x1db40, 0x1db85, 0x1dc00, 0x1e005, 0x1e036,
    0x1e092, 0x1e276, 0x1e292, 0x1e2b6, 0x1e306, 0x1e356, 0x1e409, 0x1e54b,
    0x1e696, 0x1e6a6, 0x1e6d6, 0x1e6e6, 0x1e716, 0x1e726, 0x1e74e, 0x1e76f,
    0x1e78e, 0x1e7af, 0x1e7c7, 0x1e805, 0x1e900, 0x1e925, 0x1eda0, 0x1ee26,
    0x1efe7, 0x1f006, 0x1f0b2, 0x1f0c6, 0x1f105, 0x1f1a6, 0x1f300, 0x1f326,
    0x1f7a0, 0x1f7d6, 0x1f8c6, 0x1f8f6, 0x1f9a0, 0x1f9d6, 0x1fa12, 0x1fab6,
    0x1fb32, 0x1fb60, 0x20005, 0x20567, 0x205a6, 0x20627, 0x20646, 0x20707,
    0x20726, 0x20767, 0x207a6, 0x207e5, 0x20809, 0x20952, 0x20a05, 0x20ac7,
    0x20b06, 0x20b45, 0x20bc6, 0x20c25, 0x20c47, 0x20ca5, 0x20ce7, 0x20dc5,
    0x20e26, 0x20ea5, 0x21046, 0x21067, 0x210a6, 0x210e7, 0x211a6, 0x211c5,
    0x211e7, 0x21209, 0x21347, 0x213a6, 0x213d6, 0x21401, 0x218c0, 0x218e1,
    0x21900, 0x219a1, 0x219c0, 0x21a02, 0x21f72, 0x21f84, 0x21fa2, 0x22005,
    0x24920, 0x24945, 0x249c0, 0x24a05, 0x24ae0, 0x24b05, 0x24b20, 0x24b45,
    0x24bc0, 0x24c05, 0x25120, 0x25145, 0x251c0, 0x25205, 0x25620, 0x25645,
    0x256c0, 0x25705, 0x257e0, 0x25805, 0x25820, 0x25845, 0x258c0, 0x25905,
    0x25ae0, 0x25b05, 0x26220, 0x26245, 0x262c0, 0x26305, 0x26b60, 0x26ba6,
    0x26c12, 0x26d2b, 0x26fa0, 0x27005, 0x27216, 0x27340, 0x27401, 0x27ec0,
    0x27f02, 0x27fc0, 0x2800d, 0x28025, 0x2cdb6, 0x2cdd2, 0x2cde5, 0x2d017,
    0x2d025, 0x2d36e, 0x2d38f, 0x2d3a0, 0x2d405, 0x2dd72, 0x2ddca, 0x2de25,
    0x2df20, 0x2e005, 0x2e246, 0x2e2a7, 0x2e2c0, 0x2e3e5, 0x2e646, 0x2e687,
    0x2e6b2, 0x2e6e0, 0x2e805, 0x2ea46, 0x2ea80, 0x2ec05, 0x2eda0, 0x2edc5,
    0x2ee20, 0x2ee46, 0x2ee80, 0x2f005, 0x2f686, 0x2f6c7, 0x2f6e6, 0x2f7c7,
    0x2f8c6, 0x2f8e7, 0x2f926, 0x2fa92, 0x2fae4, 0x2fb12, 0x2fb74, 0x2fb85,
    0x2fba6, 0x2fbc0, 0x2fc09, 0x2fd40, 0x2fe0b, 0x2ff40, 0x30012, 0x300cd,
    0x300f2, 0x30166, 0x301db, 0x301e6, 0x30209, 0x30340, 0x30405, 0x30864,
    0x30885, 0x30f20, 0x31005, 0x310a6, 0x310e5, 0x31526, 0x31545, 0x31560,
    0x31605, 0x31ec0, 0x32005, 0x323e0, 0x32406, 0x32467, 0x324e6, 0x32527,
    0x32580, 0x32607, 0x32646, 0x32667, 0x32726, 0x32780, 0x32816, 0x32820,
    0x32892, 0x328c9, 0x32a05, 0x32dc0, 0x32e05, 0x32ea0, 0x33005, 0x33580,
    0x33605, 0x33940, 0x33a09, 0x33b4b, 0x33b60, 0x33bd6, 0x34005, 0x342e6,
    0x34327, 0x34366, 0x34380, 0x343d2, 0x34405, 0x34aa7, 0x34ac6, 0x34ae7,
    0x34b06, 0x34be0, 0x34c06, 0x34c27, 0x34c46, 0x34c67, 0x34ca6, 0x34da7,
    0x34e66, 0x34fa0, 0x34fe6, 0x35009, 0x35140, 0x35209, 0x35340, 0x35412,
    0x354e4, 0x35512, 0x355c0, 0x35606, 0x357c8, 0x357e6, 0x359e0, 0x36006,
    0x36087, 0x360a5, 0x36686, 0x366a7, 0x366c6, 0x36767, 0x36786, 0x367a7,
    0x36846, 0x36867, 0x368a5, 0x369a0, 0x369d2, 0x36a09, 0x36b52, 0x36c36,
    0x36d66, 0x36e96, 0x36fb2, 0x37006, 0x37047, 0x37065, 0x37427, 0x37446,
    0x374c7, 0x37506, 0x37547, 0x37566, 0x375c5, 0x37609, 0x37745, 0x37cc6,
    0x37ce7, 0x37d06, 0x37d47, 0x37da6, 0x37dc7, 0x37de6, 0x37e47, 0x37e80,
    0x37f92, 0x38005, 0x38487, 0x38586, 0x38687, 0x386c6, 0x38700, 0x38772,
    0x38809, 0x38940, 0x389a5, 0x38a09, 0x38b45, 0x38f04, 0x38fd2, 0x39002,
    0x39121, 0x39142, 0x39160, 0x39201, 0x39760, 0x397a1, 0x39812, 0x39900,
    0x39a06, 0x39a72, 0x39a86, 0x39c27, 0x39c46, 0x39d25, 0x39da6, 0x39dc5,
    0x39e86, 0x39ea5, 0x39ee7, 0x39f06, 0x39f45, 0x39f60, 0x3a002, 0x3a584,
    0x3ad62, 0x3af04, 0x3af22, 0x3b364, 0x3b806, 0x3c001, 0x3c022, 0x3c041,
    0x3c062, 0x3c081, 0x3c0a2, 0x3c0c1, 0x3c0e2, 0x3c101, 0x3c122, 0x3c141,
    0x3c162, 0x3c181, 0x3c1a2, 0x3c1c1, 0x3c1e2, 0x3c201, 0x3c222, 0x3c241,
    0x3c262, 0x3c281, 0x3c2a2, 0x3c2c1, 0x3c2e2, 0x3c301, 0x3c322, 0x3c341,
    0x3c362, 0x3c381, 0x3c3a2, 0x3c3c1, 0x3c3e2, 0x3c401, 0x3c422, 0x3c441,
    0x3c462, 0x3c481, 0x3c4a2, 0x3c4c1, 0x3c4e2, 0x3c501, 0x3c522, 0x3c541,
    0x3c562, 0x3c581, 0x3c5a2, 0x3c5c1, 0x3c5e2, 0x3c601, 0x3c622, 0x3c641,
    0x3c662, 0x3c681, 0x3c6a2, 0x3c6c1, 0x3c6e2, 0x3c701, 0x3c722, 0x3c741,
    0x3c762, 0x3c781, 0x3c7a2, 0x3c7c1, 0x3c7e2, 0x3c801, 0x3c822, 0x3c841,
    0x3c862, 0x3c881, 0x3c8a2, 0x3c8c1, 0x3c8e2, 0x3c901, 0x3c922, 0x3c941,
    0x3c962, 0x3c981, 0x3c9a2, 0x3c9c1, 0x3c9e2, 0x3ca01, 0x3ca22, 0x3ca41,
    0x3ca62, 0x3ca81, 0x3caa2, 0x3cac1, 0x3cae2, 0x3cb01, 0x3cb22, 0x3cb41,
    0x3cb62, 0x3cb81, 0x3cba2, 0x3cbc1, 0x3cbe2, 0x3cc01, 0x3cc22, 0x3cc41,
    0x3cc62, 0x3cc81, 0x3cca2, 0x3ccc1, 0x3cce2, 0x3cd01, 0x3cd22, 0x3cd41,
    0x3cd62, 0x3cd81, 0x3cda2, 0x3cdc1, 0x3cde2, 0x3ce01, 0x3ce22, 0x3ce41,
    0x3ce62, 0x3ce81, 0x3cea2, 0x3cec1, 0x3cee2, 0x3cf01, 0x3cf22, 0x3cf41,
    0x3cf62, 0x3cf81, 0x3cfa2, 0x3cfc1, 0x3cfe2, 0x3d001, 0x3d022, 0x3d041,
    0x3d062, 0x3d081, 0x3d0a2, 0x3d0c1, 0x3d0e2, 0x3d101, 0x3d122, 0x3d141,
    0x3d162, 0x3d181, 0x3d1a2, 0x3d1c1, 0x3d1e2, 0x3d201, 0x3d222, 0x3d241,
    0x3d262, 0x3d281, 0x3d2a2, 0x3d3c1, 0x3d3e2, 0x3d401, 0x3d422, 0x3d441,
    0x3d462, 0x3d481, 0x3d4a2, 0x3d4c1, 0x3d4e2, 0x3d501, 0x3d522, 0x3d541,
    0x3d562, 0x3d581, 0x3d5a2, 0x3d5c1, 0x3d5e2, 0x3d601, 0x3d622, 0x3d641,
    0x3d662, 0x3d681, 0x3d6a2, 0x3d6c1, 0x3d6e2, 0x3d701, 0x3d722, 0x3d741,
    0x3d762, 0x3d781, 0x3d7a2, 0x3d7c1, 0x3d7e2, 0x3d801, 0x3d822, 0x3d841,
    0x3d862, 0x3d881, 0x3d8a2, 0x3d8c1, 0x3d8e2, 0x3d901, 0x3d922, 0x3d941,
    0x3d962, 0x3d981, 0x3d9a2, 0x3d9c1, 0x3d9e2, 0x3da01, 0x3da22, 0x3da41,
    0x3da62, 0x3da81, 0x3daa2, 0x3dac1, 0x3dae2, 0x3db01, 0x3db22, 0x3db41,
    0x3db62, 0x3db81, 0x3dba2, 0x3dbc1, 0x3dbe2, 0x3dc01, 0x3dc22, 0x3dc41,
    0x3dc62, 0x3dc81, 0x3dca2, 0x3dcc1, 0x3dce2, 0x3dd01, 0x3dd22, 0x3dd41,
    0x3dd62, 0x3dd81, 0x3dda2, 0x3ddc1, 0x3dde2, 0x3de01, 0x3de22, 0x3de41,
    0x3de62, 0x3de81, 0x3dea2, 0x3dec1, 0x3dee2, 0x3df01, 0x3df22, 0x3df41,
    0x3df62, 0x3df81, 0x3dfa2, 0x3dfc1, 0x3dfe2, 0x3e101, 0x3e202, 0x3e2c0,
    0x3e301, 0x3e3c0, 0x3e402, 0x3e501, 0x3e602, 0x3e701, 0x3e802, 0x3e8c0,
    0x3e901, 0x3e9c0, 0x3ea02, 0x3eb00, 0x3eb21, 0x3eb40, 0x3eb61, 0x3eb80,
    0x3eba1, 0x3ebc0, 0x3ebe1, 0x3ec02, 0x3ed01, 0x3ee02, 0x3efc0, 0x3f002,
    0x3f103, 0x3f202, 0x3f303, 0x3f402, 0x3f503, 0x3f602, 0x3f6a0, 0x3f6c2,
    0x3f701, 0x3f783, 0x3f7b5, 0x3f7c2, 0x3f7f5, 0x3f842, 0x3f8a0, 0x3f8c2,
    0x3f901, 0x3f983, 0x3f9b5, 0x3fa02, 0x3fa80, 0x3fac2, 0x3fb01, 0x3fb80,
    0x3fbb5, 0x3fc02, 0x3fd01, 0x3fdb5, 0x3fe00, 0x3fe42, 0x3fea0, 0x3fec2,
    0x3ff01, 0x3ff83, 0x3ffb5, 0x3ffe0, 0x40017, 0x4017b, 0x4020d, 0x402d2,
    0x40310, 0x40331, 0x4034e, 0x40370, 0x403b1, 0x403ce, 0x403f0, 0x40412,
    0x40518, 0x40539, 0x4055b, 0x405f7, 0x40612, 0x40730, 0x40751, 0x40772,
    0x407ec, 0x40832, 0x40893, 0x408ae, 0x408cf, 0x408f2, 0x40a53, 0x40a72,
    0x40a8c, 0x40ab2, 0x40bf7, 0x40c1b, 0x40ca0, 0x40cdb, 0x40e0b, 0x40e24,
    0x40e40, 0x40e8b, 0x40f53, 0x40fae, 0x40fcf, 0x40fe4, 0x4100b, 0x41153,
    0x411ae, 0x411cf, 0x411e0, 0x41204, 0x413a0, 0x41414, 0x41820, 0x41a06,
    0x41ba8, 0x41c26, 0x41c48, 0x41ca6, 0x41e20, 0x42016, 0x42041, 0x42076,
    0x420e1, 0x42116, 0x42142, 0x42161, 0x421c2, 0x42201, 0x42262, 0x42296,
    0x422a1, 0x422d6, 0x42313, 0x42321, 0x423d6, 0x42481, 0x424b6, 0x424c1,
    0x424f6, 0x42501, 0x42536, 0x42541, 0x425d6, 0x425e2, 0x42601, 0x42682,
    0x426a5, 0x42722, 0x42756, 0x42782, 0x427c1, 0x42813, 0x428a1, 0x428c2,
    0x42956, 0x42973, 0x42996, 0x429c2, 0x429f6, 0x42a0b, 0x42c0a, 0x43061,
    0x43082, 0x430aa, 0x4312b, 0x43156, 0x43180, 0x43213, 0x432b6, 0x43353,
    0x43396, 0x43413, 0x43436, 0x43473, 0x43496, 0x434d3, 0x434f6, 0x435d3,
    0x435f6, 0x439d3, 0x43a16, 0x43a53, 0x43a76, 0x43a93, 0x43ab6, 0x43e93,
    0x46016, 0x4610e, 0x4612f, 0x4614e, 0x4616f, 0x46196, 0x46413, 0x46456,
    0x4652e, 0x4654f, 0x46576, 0x46f93, 0x46fb6, 0x47373, 0x47696, 0x47b93,
    0x47c56, 0x48540, 0x48816, 0x48960, 0x48c0b, 0x49396, 0x49d4b, 0x4a016,
    0x4b6f3, 0x4b716, 0x4b833, 0x4b856, 0x4bf13, 0x4c016, 0x4cdf3, 0x4ce16,
    0x4ed0e, 0x4ed2f, 0x4ed4e, 0x4ed6f, 0x4ed8e, 0x4edaf, 0x4edce, 0x4edef,
    0x4ee0e, 0x4ee2f, 0x4ee4e, 0x4ee6f, 0x4ee8e, 0x4eeaf, 0x4eecb, 0x4f296,
    0x4f813, 0x4f8ae, 0x4f8cf, 0x4f8f3, 0x4fcce, 0x4fcef, 0x4fd0e, 0x4fd2f,
    0x4fd4e, 0x4fd6f, 0x4fd8e, 0x4fdaf, 0x4fdce, 0x4fdef, 0x4fe13, 0x50016,
    0x52013, 0x5306e, 0x5308f, 0x530ae, 0x530cf, 0x530ee, 0x5310f, 0x5312e,
    0x5314f, 0x5316e, 0x5318f, 0x531ae, 0x531cf, 0x531ee, 0x5320f, 0x5322e,
    0x5324f, 0x5326e, 0x5328f, 0x532ae, 0x532cf, 0x532ee, 0x5330f, 0x53333,
    0x53b0e, 0x53b2f, 0x53b4e, 0x53b6f, 0x53b93, 0x53f8e, 0x53faf, 0x53fd3,
    0x56016, 0x56613, 0x568b6, 0x568f3, 0x569b6, 0x56e80, 0x56ed6, 0x572c0,
    0x572f6, 0x58001, 0x58602, 0x58c01, 0x58c22, 0x58c41, 0x58ca2, 0x58ce1,
    0x58d02, 0x58d21, 0x58d42, 0x58d61, 0x58d82, 0x58da1, 0x58e22, 0x58e41,
    0x58e62, 0x58ea1, 0x58ec2, 0x58f84, 0x58fc1, 0x59022, 0x59041, 0x59062,
    0x59081, 0x590a2, 0x590c1, 0x590e2, 0x59101, 0x59122, 0x59141, 0x59162,
    0x59181, 0x591a2, 0x591c1, 0x591e2, 0x59201, 0x59222, 0x59241, 0x59262,
    0x59281, 0x592a2, 0x592c1, 0x592e2, 0x59301, 0x59322, 0x59341, 0x59362,
    0x59381, 0x593a2, 0x593c1, 0x593e2, 0x59401, 0x59422, 0x59441, 0x59462,
    0x59481, 0x594a2, 0x594c1, 0x594e2, 0x59501, 0x59522, 0x59541, 0x59562,
    0x59581, 0x595a2, 0x595c1, 0x595e2, 0x59601, 0x59622, 0x59641, 0x59662,
    0x59681, 0x596a2, 0x596c1, 0x596e2, 0x59701, 0x59722, 0x59741, 0x59762,
    0x59781, 0x597a2, 0x597c1, 0x597e2, 0x59801, 0x59822, 0x59841, 0x59862,
    0x59881, 0x598a2, 0x598c1, 0x598e2, 0x59901, 0x59922, 0x59941, 0x59962,
    0x59981, 0x599a2, 0x599c1, 0x599e2, 0x59a01, 0x59a22, 0x59a41, 0x59a62,
    0x59a81, 0x59aa2, 0x59ac1, 0x59ae2, 0x59b01, 0x59b22, 0x59b41, 0x59b62,
    0x59b81, 0x59ba2, 0x59bc1, 0x59be2, 0x59c01, 0x59c22, 0x59c41, 0x59c62,
    0x59cb6, 0x59d61, 0x59d82, 0x59da1, 0x59dc2, 0x59de6, 0x59e41, 0x59e62,
    0x59e80, 0x59f32, 0x59fab, 0x59fd2, 0x5a002, 0x5a4c0, 0x5a4e2, 0x5a500,
    0x5a5a2, 0x5a5c0, 0x5a605, 0x5ad00, 0x5ade4, 0x5ae12, 0x5ae20, 0x5afe6,
    0x5b005, 0x5b2e0, 0x5b405, 0x5b4e0, 0x5b505, 0x5b5e0, 0x5b605, 0x5b6e0,
    0x5b705, 0x5b7e0, 0x5b805, 0x5b8e0, 0x5b905, 0x5b9e0, 0x5ba05, 0x5bae0,
    0x5bb05, 0x5bbe0, 0x5bc06, 0x5c012, 0x5c050, 0x5c071, 0x5c090, 0x5c0b1,
    0x5c0d2, 0x5c130, 0x5c151, 0x5c172, 0x5c190, 0x5c1b1, 0x5c1d2, 0x5c2ed,
    0x5c312, 0x5c34d, 0x5c372, 0x5c390, 0x5c3b1, 0x5c3d2, 0x5c410, 0x5c431,
    0x5c44e, 0x5c46f, 0x5c48e, 0x5c4af, 0x5c4ce, 0x5c4ef, 0x5c50e, 0x5c52f,
    0x5c552, 0x5c5e4, 0x5c612, 0x5c74d, 0x5c792, 0x5c80d, 0x5c832, 0x5c84e,
    0x5c872, 0x5ca16, 0x5ca52, 0x5caae, 0x5cacf, 0x5caee, 0x5cb0f, 0x5cb2e,
    0x5cb4f, 0x5cb6e, 0x5cb8f, 0x5cbad, 0x5cbc0, 0x5d016, 0x5d340, 0x5d376,
    0x5de80, 0x5e016, 0x5fac0, 0x5fe16, 0x60017, 0x60032, 0x60096, 0x600a4,
    0x600c5, 0x600ea, 0x6010e, 0x6012f, 0x6014e, 0x6016f, 0x6018e, 0x601af,
    0x601ce, 0x601ef, 0x6020e, 0x6022f, 0x60256, 0x6028e, 0x602af, 0x602ce,
    0x602ef, 0x6030e, 0x6032f, 0x6034e, 0x6036f, 0x6038d, 0x603ae, 0x603cf,
    0x60416, 0x6042a, 0x60546, 0x605c7, 0x6060d, 0x60624, 0x606d6, 0x6070a,
    0x60764, 0x60785, 0x607b2, 0x607d6, 0x60800, 0x60825, 0x612e0, 0x61326,
    0x61375, 0x613a4, 0x613e5, 0x6140d, 0x61425, 0x61f72, 0x61f84, 0x61fe5,
    0x62000, 0x620a5, 0x62600, 0x62625, 0x631e0, 0x63216, 0x6324b, 0x632d6,
    0x63405, 0x63816, 0x63cc0, 0x63df6, 0x63e05, 0x64016, 0x643e0, 0x6440b,
    0x64556, 0x6490b, 0x64a16, 0x64a2b, 0x64c16, 0x6500b, 0x65156, 0x6562b,
    0x65816, 0x68005, 0x9b816, 0x9c005, 0x1402a4, 0x1402c5, 0x1491a0, 0x149216,
    0x1498e0, 0x149a05, 0x149f04, 0x149fd2, 0x14a005, 0x14c184, 0x14c1b2, 0x14c205,
    0x14c409, 0x14c545, 0x14c580, 0x14c801, 0x14c822, 0x14c841, 0x14c862, 0x14c881,
    0x14c8a2, 0x14c8c1, 0x14c8e2, 0x14c901, 0x14c922, 0x14c941, 0x14c962, 0x14c981,
    0x14c9a2, 0x14c9c1, 0x14c9e2, 0x14ca01, 0x14ca22, 0x14ca41, 0x14ca62, 0x14ca81,
    0x14caa2, 0x14cac1, 0x14cae2, 0x14cb01, 0x14cb22, 0x14cb41, 0x14cb62, 0x14cb81,
    0x14cba2, 0x14cbc1, 0x14cbe2, 0x14cc01, 0x14cc22, 0x14cc41, 0x14cc62, 0x14cc81,
    0x14cca2, 0x14ccc1, 0x14cce2, 0x14cd01, 0x14cd22, 0x14cd41, 0x14cd62, 0x14cd81,
    0x14cda2, 0x14cdc5, 0x14cde6, 0x14ce08, 0x14ce72, 0x14ce86, 0x14cfd2, 0x14cfe4,
    0x14d001, 0x14d022, 0x14d041, 0x14d062, 0x14d081, 0x14d0a2, 0x14d0c1, 0x14d0e2,
    0x14d101, 0x14d122, 0x14d141, 0x14d162, 0x14d181, 0x14d1a2, 0x14d1c1, 0x14d1e2,
    0x14d201, 0x14d222, 0x14d241, 0x14d262, 0x14d281, 0x14d2a2, 0x14d2c1, 0x14d2e2,
    0x14d301, 0x14d322, 0x14d341, 0x14d362, 0x14d384, 0x14d3c6, 0x14d405, 0x14dcca,
    0x14de06, 0x14de52, 0x14df00, 0x14e015, 0x14e2e4, 0x14e415, 0x14e441, 0x14e462,
    0x14e481, 0x14e4a2, 0x14e4c1, 0x14e4e2, 0x14e501, 0x14e522, 0x14e541, 0x14e562,
    0x14e581, 0x14e5a2, 0x14e5c1, 0x14e5e2, 0x14e641, 0x14e662, 0x14e681, 0x14e6a2,
    0x14e6c1, 0x14e6e2, 0x14e701, 0x14e722, 0x14e741, 0x14e762, 0x14e781, 0x14e7a2,
    0x14e7c1, 0x14e7e2, 0x14e801, 0x14e822, 0x14e841, 0x14e862, 0x14e881, 0x14e8a2,
    0x14e8c1, 0x14e8e2, 0x14e901, 0x14e922, 0x14e941, 0x14e962, 0x14e981, 0x14e9a2,
    0x14e9c1, 0x14e9e2, 0x14ea01, 0x14ea22, 0x14ea41, 0x14ea62, 0x14ea81, 0x14eaa2,
    0x14eac1, 0x14eae2, 0x14eb01, 0x14eb22, 0x14eb41, 0x14eb62, 0x14eb81, 0x14eba2,
    0x14ebc1, 0x14ebe2, 0x14ec01, 0x14ec22, 0x14ec41, 0x14ec62, 0x14ec81, 0x14eca2,
    0x14ecc1, 0x14ece2, 0x14ed01, 0x14ed22, 0x14ed41, 0x14ed62, 0x14ed81, 0x14eda2,
    0x14edc1, 0x14ede2, 0x14ee04, 0x14ee22, 0x14ef21, 0x14ef42, 0x14ef61, 0x14ef82,
    0x14efa1, 0x14efe2, 0x14f001, 0x14f022, 0x14f041, 0x14f062, 0x14f081, 0x14f0a2,
    0x14f0c1, 0x14f0e2, 0x14f104, 0x14f135, 0x14f161, 0x14f182, 0x14f1a1, 0x14f1c2,
    0x14f1e5, 0x14f201, 0x14f222, 0x14f241, 0x14f262, 0x14f2c1, 0x14f2e2, 0x14f301,
    0x14f322, 0x14f341, 0x14f362, 0x14f381, 0x14f3a2, 0x14f3c1, 0x14f3e2, 0x14f401,
    0x14f422, 0x14f441, 0x14f462, 0x14f481, 0x14f4a2, 0x14f4c1, 0x14f4e2, 0x14f501,
    0x14f522, 0x14f541, 0x14f5e2, 0x14f601, 0x14f6a2, 0x14f6c1, 0x14f6e2, 0x14f701,
    0x14f722, 0x14f741, 0x14f762, 0x14f781, 0x14f7a2, 0x14f7c1, 0x14f7e2, 0x14f801,
    0x14f822, 0x14f841, 0x14f862, 0x14f881, 0x14f902, 0x14f921, 0x14f942, 0x14f961,
    0x14f9a2, 0x14f9c0, 0x14fa01, 0x14fa22, 0x14fa40, 0x14fa62, 0x14fa80, 0x14faa2,
    0x14fac1, 0x14fae2, 0x14fb01, 0x14fb22, 0x14fb41, 0x14fb62, 0x14fb81, 0x14fba0,
    0x14fe44, 0x14fea1, 0x14fec2, 0x14fee5, 0x14ff04, 0x14ff42, 0x14ff65, 0x150046,
    0x150065, 0x1500c6, 0x1500e5, 0x150166, 0x150185, 0x150467, 0x1504a6, 0x1504e7,
    0x150516, 0x150586, 0x1505a0, 0x15060b, 0x1506d6, 0x150714, 0x150736, 0x150740,
    0x150805, 0x150e92, 0x150f00, 0x151007, 0x151045, 0x151687, 0x151886, 0x1518c0,
    0x1519d2, 0x151a09, 0x151b40, 0x151c06, 0x151e45, 0x151f12, 0x151f65, 0x151f92,
    0x151fa5, 0x151fe6, 0x152009, 0x152145, 0x1524c6, 0x1525d2, 0x152605, 0x1528e6,
    0x152a47, 0x152a80, 0x152bf2, 0x152c05, 0x152fa0, 0x153006, 0x153067, 0x153085,
    0x153666, 0x153687, 0x1536c6, 0x153747, 0x153786, 0x1537c7, 0x153832, 0x1539c0,
    0x1539e4, 0x153a09, 0x153b40, 0x153bd2, 0x153c05, 0x153ca6, 0x153cc4, 0x153ce5,
    0x153e09, 0x153f45, 0x153fe0, 0x154005, 0x154526, 0x1545e7, 0x154626, 0x154667,
    0x1546a6, 0x1546e0, 0x154805, 0x154866, 0x154885, 0x154986, 0x1549a7, 0x1549c0,
    0x154a09, 0x154b40, 0x154b92, 0x154c05, 0x154e04, 0x154e25, 0x154ef6, 0x154f45,
    0x154f67, 0x154f86, 0x154fa7, 0x154fc5, 0x155606, 0x155625, 0x155646, 0x1556a5,
    0x1556e6, 0x155725, 0x1557c6, 0x155805, 0x155826, 0x155845, 0x155860, 0x155b65,
    0x155ba4, 0x155bd2, 0x155c05, 0x155d67, 0x155d86, 0x155dc7, 0x155e12, 0x155e45,
    0x155e64, 0x155ea7, 0x155ec6, 0x155ee0, 0x156025, 0x1560e0, 0x156125, 0x1561e0,
    0x156225, 0x1562e0, 0x156405, 0x1564e0, 0x156505, 0x1565e0, 0x156602, 0x156b75,
    0x156b84, 0x156c02, 0x156d24, 0x156d55, 0x156d80, 0x156e02, 0x157805, 0x157c67,
    0x157ca6, 0x157cc7, 0x157d06, 0x157d27, 0x157d72, 0x157d87, 0x157da6, 0x157dc0,
    0x157e09, 0x157f40, 0x158005, 0x1af480, 0x1af605, 0x1af8e0, 0x1af965, 0x1aff80,
    0x1b001c, 0x1c001d, 0x1f2005, 0x1f4dc0, 0x1f4e05, 0x1f5b40, 0x1f6002, 0x1f60e0,
    0x1f6262, 0x1f6300, 0x1f63a5, 0x1f63c6, 0x1f63e5, 0x1f6533, 0x1f6545, 0x1f66e0,
    0x1f6705, 0x1f67a0, 0x1f67c5, 0x1f67e0, 0x1f6805, 0x1f6840, 0x1f6865, 0x1f68a0,
    0x1f68c5, 0x1f7655, 0x1f7860, 0x1f7a65, 0x1fa7cf, 0x1fa7ee, 0x1fa816, 0x1faa05,
    0x1fb200, 0x1fb245, 0x1fb900, 0x1fb9f6, 0x1fba00, 0x1fbe05, 0x1fbf94, 0x1fbfb6,
    0x1fc006, 0x1fc212, 0x1fc2ee, 0x1fc30f, 0x1fc332, 0x1fc340, 0x1fc406, 0x1fc612,
    0x1fc62d, 0x1fc66c, 0x1fc6ae, 0x1fc6cf, 0x1fc6ee, 0x1fc70f, 0x1fc72e, 0x1fc74f,
    0x1fc76e, 0x1fc78f, 0x1fc7ae, 0x1fc7cf, 0x1fc7ee, 0x1fc80f, 0x1fc82e, 0x1fc84f,
    0x1fc86e, 0x1fc88f, 0x1fc8b2, 0x1fc8ee, 0x1fc90f, 0x1fc932, 0x1fc9ac, 0x1fca12,
    0x1fca60, 0x1fca92, 0x1fcb0d, 0x1fcb2e, 0x1fcb4f, 0x1fcb6e, 0x1fcb8f, 0x1fcbae,
    0x1fcbcf, 0x1fcbf2, 0x1fcc53, 0x1fcc6d, 0x1fcc93, 0x1fcce0, 0x1fcd12, 0x1fcd34,
    0x1fcd52, 0x1fcd80, 0x1fce05, 0x1fcea0, 0x1fcec5, 0x1fdfa0, 0x1fdffb, 0x1fe000,
    0x1fe032, 0x1fe094, 0x1fe0b2, 0x1fe10e, 0x1fe12f, 0x1fe152, 0x1fe173, 0x1fe192,
    0x1fe1ad, 0x1fe1d2, 0x1fe209, 0x1fe352, 0x1fe393, 0x1fe3f2, 0x1fe421, 0x1fe76e,
    0x1fe792, 0x1fe7af, 0x1fe7d5, 0x1fe7ec, 0x1fe815, 0x1fe822, 0x1feb6e, 0x1feb93,
    0x1febaf, 0x1febd3, 0x1febee, 0x1fec0f, 0x1fec32, 0x1fec4e, 0x1fec6f, 0x1fec92,
    0x1fecc5, 0x1fee04, 0x1fee25, 0x1ff3c4, 0x1ff405, 0x1ff7e0, 0x1ff845, 0x1ff900,
    0x1ff945, 0x1ffa00, 0x1ffa45, 0x1ffb00, 0x1ffb45, 0x1ffba0, 0x1ffc14, 0x1ffc53,
    0x1ffc75, 0x1ffc96, 0x1ffcb4, 0x1ffce0, 0x1ffd16, 0x1ffd33, 0x1ffdb6, 0x1ffde0,
    0x1fff3b, 0x1fff96, 0x1fffc0, 0x200005, 0x200180, 0x2001a5, 0x2004e0, 0x200505,
    0x200760, 0x200785, 0x2007c0, 0x2007e5, 0x2009c0, 0x200a05, 0x200bc0, 0x201005,
    0x201f60, 0x202012, 0x202060, 0x2020eb, 0x202680, 0x2026f6, 0x20280a, 0x202eab,
    0x202f36, 0x20314b, 0x203196, 0x2031e0, 0x203216, 0x2033a0, 0x203416, 0x203420,
    0x203a16, 0x203fa6, 0x203fc0, 0x205005, 0x2053a0, 0x205405, 0x205a20, 0x205c06,
    0x205c2b, 0x205f80, 0x206005, 0x20640b, 0x206480, 0x2065a5, 0x20682a, 0x206845,
    0x20694a, 0x206960, 0x206a05, 0x206ec6, 0x206f60, 0x207005, 0x2073c0, 0x2073f2,
    0x207405, 0x207880, 0x207905, 0x207a12, 0x207a2a, 0x207ac0, 0x208001, 0x208502,
    0x208a05, 0x2093c0, 0x209409, 0x209540, 0x209601, 0x209a80, 0x209b02, 0x209f80,
    0x20a005, 0x20a500, 0x20a605, 0x20ac80, 0x20adf2, 0x20ae01, 0x20af60, 0x20af81,
    0x20b160, 0x20b181, 0x20b260, 0x20b281, 0x20b2c0, 0x20b2e2, 0x20b440, 0x20b462,
    0x20b640, 0x20b662, 0x20b740, 0x20b762, 0x20b7a0, 0x20b805, 0x20be80, 0x20c005,
    0x20e6e0, 0x20e805, 0x20eac0, 0x20ec05, 0x20ed00, 0x20f004, 0x20f0c0, 0x20f0e4,
    0x20f620, 0x20f644, 0x20f760, 0x210005, 0x2100c0, 0x210105, 0x210120, 0x210145,
    0x2106c0, 0x2106e5, 0x210720, 0x210785, 0x2107a0, 0x2107e5, 0x210ac0, 0x210af2,
    0x210b0b, 0x210c05, 0x210ef6, 0x210f2b, 0x211005, 0x2113e0, 0x2114eb, 0x211600,
    0x211c05, 0x211e60, 0x211e85, 0x211ec0, 0x211f6b, 0x212005, 0x2122cb, 0x212380,
    0x2123f2, 0x212405, 0x212740, 0x2127f2, 0x212800, 0x213005, 0x213700, 0x21378b,
    0x2137c5, 0x21380b, 0x213a00, 0x213a4b, 0x214005, 0x214026, 0x214080, 0x2140a6,
    0x2140e0, 0x214186, 0x214205, 0x214280, 0x2142a5, 0x214300, 0x214325, 0x2146c0,
    0x214706, 0x214760, 0x2147e6, 0x21480b, 0x214920, 0x214a12, 0x214b20, 0x214c05,
    0x214fab, 0x214ff2, 0x215005, 0x2153ab, 0x215400, 0x215805, 0x215916, 0x215925,
    0x215ca6, 0x215ce0, 0x215d6b, 0x215e12, 0x215ee0, 0x216005, 0x2166c0, 0x216732,
    0x216805, 0x216ac0, 0x216b0b, 0x216c05, 0x216e60, 0x216f0b, 0x217005, 0x217240,
    0x217332, 0x2173a0, 0x21752b, 0x217600, 0x218005, 0x218920, 0x219001, 0x219660,
    0x219802, 0x219e60, 0x219f4b, 0x21a005, 0x21a486, 0x21a500, 0x21a609, 0x21a740,
    0x21a809, 0x21a945, 0x21a9c4, 0x21a9e5, 0x21aa01, 0x21acc0, 0x21ad26, 0x21adcd,
    0x21ade4, 0x21ae02, 0x21b0c0, 0x21b1d3, 0x21b200, 0x21cc0b, 0x21cfe0, 0x21d005,
    0x21d540, 0x21d566, 0x21d5ad, 0x21d5c0, 0x21d605, 0x21d640, 0x21d845, 0x21d8a0,
    0x21df86, 0x21e005, 0x21e3ab, 0x21e4e5, 0x21e500, 0x21e605, 0x21e8c6, 0x21ea2b,
    0x21eab2, 0x21eb40, 0x21ee05, 0x21f046, 0x21f0d2, 0x21f140, 0x21f605, 0x21f8ab,
    0x21f980, 0x21fc05, 0x21fee0, 0x220007, 0x220026, 0x220047, 0x220065, 0x220706,
    0x2208f2, 0x2209c0, 0x220a4b, 0x220cc9, 0x220e06, 0x220e25, 0x220e66, 0x220ea5,
    0x220ec0, 0x220fe6, 0x221047, 0x221065, 0x221607, 0x221666, 0x2216e7, 0x221726,
    0x221772, 0x2217bb, 0x2217d2, 0x221846, 0x221860, 0x2219bb, 0x2219c0, 0x221a05,
    0x221d20, 0x221e09, 0x221f40, 0x222006, 0x222065, 0x2224e6, 0x222587, 0x2225a6,
    0x2226a0, 0x2226c9, 0x222812, 0x222885, 0x2228a7, 0x2228e5, 0x222900, 0x222a05,
    0x222e66, 0x222e92, 0x222ec5, 0x222ee0, 0x223006, 0x223047, 0x223065, 0x223667,
    0x2236c6, 0x2237e7, 0x223825, 0x2238b2, 0x223926, 0x2239b2, 0x2239c7, 0x2239e6,
    0x223a09, 0x223b45, 0x223b72, 0x223b85, 0x223bb2, 0x223c00, 0x223c2b, 0x223ea0,
    0x224005, 0x224240, 0x224265, 0x224587, 0x2245e6, 0x224647, 0x224686, 0x2246a7,
    0x2246c6, 0x224712, 0x2247c6, 0x2247e5, 0x224826, 0x224840, 0x225005, 0x2250e0,
    0x225105, 0x225120, 0x225145, 0x2251c0, 0x2251e5, 0x2253c0, 0x2253e5, 0x225532,
    0x225540, 0x225605, 0x225be6, 0x225c07, 0x225c66, 0x225d60, 0x225e09, 0x225f40,
    0x226006, 0x226047, 0x226080, 0x2260a5, 0x2261a0, 0x2261e5, 0x226220, 0x226265,
    0x226520, 0x226545, 0x226620, 0x226645, 0x226680, 0x2266a5, 0x226740, 0x226766,
    0x2267a5, 0x2267c7, 0x226806, 0x226827, 0x2268a0, 0x2268e7, 0x226920, 0x226967,
    0x2269c0, 0x226a05, 0x226a20, 0x226ae7, 0x226b00, 0x226ba5, 0x226c47, 0x226c80,
    0x226cc6, 0x226da0, 0x226e06, 0x226ea0, 0x227005, 0x227140, 0x227165, 0x227180,
    0x2271c5, 0x2271e0, 0x227205, 0x2276c0, 0x2276e5, 0x227707, 0x227766, 0x227820,
    0x227847, 0x227860, 0x2278a7, 0x2278c0, 0x2278e7, 0x227960, 0x227987, 0x2279c6,
    0x2279e7, 0x227a06, 0x227a25, 0x227a46, 0x227a65, 0x227a92, 0x227ac0, 0x227af2,
    0x227b20, 0x227c26, 0x227c60, 0x228005, 0x2286a7, 0x228706, 0x228807, 0x228846,
    0x2288a7, 0x2288c6, 0x2288e5, 0x228972, 0x228a09, 0x228b52, 0x228b80, 0x228bb2,
    0x228bc6, 0x228be5, 0x228c40, 0x229005, 0x229607, 0x229666, 0x229727, 0x229746,
    0x229767, 0x2297e6, 0x229827, 0x229846, 0x229885, 0x2298d2, 0x2298e5, 0x229900,
    0x229a09, 0x229b40, 0x22b005, 0x22b5e7, 0x22b646, 0x22b6c0, 0x22b707, 0x22b786,
    0x22b7c7, 0x22b7e6, 0x22b832, 0x22bb05, 0x22bb86, 0x22bbc0, 0x22c005, 0x22c607,
    0x22c666, 0x22c767, 0x22c7a6, 0x22c7c7, 0x22c7e6, 0x22c832, 0x22c885, 0x22c8a0,
    0x22ca09, 0x22cb40, 0x22cc12, 0x22cda0, 0x22d005, 0x22d566, 0x22d587, 0x22d5a6,
    0x22d5c7, 0x22d606, 0x22d6c7, 0x22d6e6, 0x22d705, 0x22d732, 0x22d740, 0x22d809,
    0x22d940, 0x22da09, 0x22dc80, 0x22e005, 0x22e360, 0x22e3a6, 0x22e3c7, 0x22e3e6,
    0x22e407, 0x22e446, 0x22e4c7, 0x22e4e6, 0x22e580, 0x22e609, 0x22e74b, 0x22e792,
    0x22e7f6, 0x22e805, 0x22e8e0, 0x230005, 0x230587, 0x2305e6, 0x230707, 0x230726,
    0x230772, 0x230780, 0x231401, 0x231802, 0x231c09, 0x231d4b, 0x231e60, 0x231fe5,
    0x2320e0, 0x232125, 0x232140, 0x232185, 0x232280, 0x2322a5, 0x2322e0, 0x232305,
    0x232607, 0x2326c0, 0x2326e7, 0x232720, 0x232766, 0x2327a7, 0x2327c6, 0x2327e5,
    0x232807, 0x232825, 0x232847, 0x232866, 0x232892, 0x2328e0, 0x232a09, 0x232b40,
    0x233405, 0x233500, 0x233545, 0x233a27, 0x233a86, 0x233b00, 0x233b46, 0x233b87,
    0x233c06, 0x233c25, 0x233c52, 0x233c65, 0x233c87, 0x233ca0, 0x234005, 0x234026,
    0x234165, 0x234666, 0x234727, 0x234745, 0x234766, 0x2347f2, 0x2348e6, 0x234900,
    0x234a05, 0x234a26, 0x234ae7, 0x234b26, 0x234b85, 0x235146, 0x2352e7, 0x235306,
    0x235352, 0x2353a5, 0x2353d2, 0x235460, 0x235605, 0x235f20, 0x236012, 0x236140,
    0x237805, 0x237c32, 0x237c40, 0x237e09, 0x237f40, 0x238005, 0x238120, 0x238145,
    0x2385e7, 0x238606, 0x2386e0, 0x238706, 0x2387c7, 0x2387e6, 0x238805, 0x238832,
    0x2388c0, 0x238a09, 0x238b4b, 0x238da0, 0x238e12, 0x238e45, 0x239200, 0x239246,
    0x239500, 0x239527, 0x239546, 0x239627, 0x239646, 0x239687, 0x2396a6, 0x2396e0,
    0x23a005, 0x23a0e0, 0x23a105, 0x23a140, 0x23a165, 0x23a626, 0x23a6e0, 0x23a746,
    0x23a760, 0x23a786, 0x23a7c0, 0x23a7e6, 0x23a8c5, 0x23a8e6, 0x23a900, 0x23aa09,
    0x23ab40, 0x23ac05, 0x23acc0, 0x23ace5, 0x23ad20, 0x23ad45, 0x23b147, 0x23b1e0,
    0x23b206, 0x23b240, 0x23b267, 0x23b2a6, 0x23b2c7, 0x23b2e6, 0x23b305, 0x23b320,
    0x23b409, 0x23b540, 0x23dc05, 0x23de66, 0x23dea7, 0x23def2, 0x23df20, 0x23e006,
    0x23e045, 0x23e067, 0x23e085, 0x23e220, 0x23e245, 0x23e687, 0x23e6c6, 0x23e760,
    0x23e7c7, 0x23e806, 0x23e827, 0x23e846, 0x23e872, 0x23ea09, 0x23eb46, 0x23eb60,
    0x23f605, 0x23f620, 0x23f80b, 0x23fab6, 0x23fbb4, 0x23fc36, 0x23fe40, 0x23fff2,
    0x240005, 0x247340, 0x24800a, 0x248de0, 0x248e12, 0x248ea0, 0x249005, 0x24a880,
    0x25f205, 0x25fe32, 0x25fe60, 0x260005, 0x26861b, 0x268806, 0x268825, 0x2688e6,
    0x268ac0, 0x268c05, 0x287f60, 0x288005, 0x28c8e0, 0x2c2005, 0x2c23c6, 0x2c2547,
    0x2c25a6, 0x2c2609, 0x2c2740, 0x2d0005, 0x2d4720, 0x2d4805, 0x2d4be0, 0x2d4c09,
    0x2d4d40, 0x2d4dd2, 0x2d4e05, 0x2d57e0, 0x2d5809, 0x2d5940, 0x2d5a05, 0x2d5dc0,
    0x2d5e06, 0x2d5eb2, 0x2d5ec0, 0x2d6005, 0x2d6606, 0x2d66f2, 0x2d6796, 0x2d6804,
    0x2d6892, 0x2d68b6, 0x2d68c0, 0x2d6a09, 0x2d6b40, 0x2d6b6b, 0x2d6c40, 0x2d6c65,
    0x2d6f00, 0x2d6fa5, 0x2d7200, 0x2da804, 0x2da865, 0x2dad64, 0x2dadb2, 0x2dae09,
    0x2daf40, 0x2dc801, 0x2dcc02, 0x2dd00b, 0x2dd2f2, 0x2dd360, 0x2de005, 0x2de960,
    0x2de9e6, 0x2dea05, 0x2dea27, 0x2df100, 0x2df1e6, 0x2df264, 0x2df400, 0x2dfc04,
    0x2dfc52, 0x2dfc64, 0x2dfc86, 0x2dfca0, 0x2dfe07, 0x2dfe40, 0x2e0005, 0x30ff00,
    0x310005, 0x319ac0, 0x319fe5, 0x31a120, 0x35fe04, 0x35fe80, 0x35fea4, 0x35ff80,
    0x35ffa4, 0x35ffe0, 0x360005, 0x362460, 0x362645, 0x362660, 0x362a05, 0x362a60,
    0x362aa5, 0x362ac0, 0x362c85, 0x362d00, 0x362e05, 0x365f80, 0x378005, 0x378d60,
    0x378e05, 0x378fa0, 0x379005, 0x379120, 0x379205, 0x379340, 0x379396, 0x3793a6,
    0x3793f2, 0x37941b, 0x379480, 0x398016, 0x399e09, 0x399f40, 0x39a016, 0x39d680,
    0x39e006, 0x39e5c0, 0x39e606, 0x39e8e0, 0x39ea16, 0x39f880, 0x3a0016, 0x3a1ec0,
    0x3a2016, 0x3a24e0, 0x3a2536, 0x3a2ca7, 0x3a2ce6, 0x3a2d56, 0x3a2da7, 0x3a2e7b,
    0x3a2f66, 0x3a3076, 0x3a30a6, 0x3a3196, 0x3a3546, 0x3a35d6, 0x3a3d60, 0x3a4016,
    0x3a4846, 0x3a48b6, 0x3a48c0, 0x3a580b, 0x3a5a80, 0x3a5c0b, 0x3a5e80, 0x3a6016,
    0x3a6ae0, 0x3a6c0b, 0x3a6f20, 0x3a8001, 0x3a8342, 0x3a8681, 0x3a89c2, 0x3a8aa0,
    0x3a8ac2, 0x3a8d01, 0x3a9042, 0x3a9381, 0x3a93a0, 0x3a93c1, 0x3a9400, 0x3a9441,
    0x3a9460, 0x3a94a1, 0x3a94e0, 0x3a9521, 0x3a95a0, 0x3a95c1, 0x3a96c2, 0x3a9740,
    0x3a9762, 0x3a9780, 0x3a97a2, 0x3a9880, 0x3a98a2, 0x3a9a01, 0x3a9d42, 0x3aa081,
    0x3aa0c0, 0x3aa0e1, 0x3aa160, 0x3aa1a1, 0x3aa2a0, 0x3aa2c1, 0x3aa3a0, 0x3aa3c2,
    0x3aa701, 0x3aa740, 0x3aa761, 0x3aa7e0, 0x3aa801, 0x3aa8a0, 0x3aa8c1, 0x3aa8e0,
    0x3aa941, 0x3aaa20, 0x3aaa42, 0x3aad81, 0x3ab0c2, 0x3ab401, 0x3ab742, 0x3aba81,
    0x3abdc2, 0x3ac101, 0x3ac442, 0x3ac781, 0x3acac2, 0x3ace01, 0x3ad142, 0x3ad4c0,
    0x3ad501, 0x3ad833, 0x3ad842, 0x3adb73, 0x3adb82, 0x3adc41, 0x3adf73, 0x3adf82,
    0x3ae2b3, 0x3ae2c2, 0x3ae381, 0x3ae6b3, 0x3ae6c2, 0x3ae9f3, 0x3aea02, 0x3aeac1,
    0x3aedf3, 0x3aee02, 0x3af133, 0x3af142, 0x3af201, 0x3af533, 0x3af542, 0x3af873,
    0x3af882, 0x3af941, 0x3af962, 0x3af980, 0x3af9c9, 0x3b0016, 0x3b4006, 0x3b46f6,
    0x3b4766, 0x3b4db6, 0x3b4ea6, 0x3b4ed6, 0x3b5086, 0x3b50b6, 0x3b50f2, 0x3b5180,
    0x3b5366, 0x3b5400, 0x3b5426, 0x3b5600, 0x3be002, 0x3be145, 0x3be162, 0x3be3e0,
    0x3be4a2, 0x3be560, 0x3c0006, 0x3c00e0, 0x3c0106, 0x3c0320, 0x3c0366, 0x3c0440,
    0x3c0466, 0x3c04a0, 0x3c04c6, 0x3c0560, 0x3c0604, 0x3c0dc0, 0x3c11e6, 0x3c1200,
    0x3c2005, 0x3c25a0, 0x3c2606, 0x3c26e4, 0x3c27c0, 0x3c2809, 0x3c2940, 0x3c29c5,
    0x3c29f6, 0x3c2a00, 0x3c5205, 0x3c55c6, 0x3c55e0, 0x3c5805, 0x3c5d86, 0x3c5e09,
    0x3c5f40, 0x3c5ff4, 0x3c6000, 0x3c9a05, 0x3c9d64, 0x3c9d86, 0x3c9e09, 0x3c9f40,
    0x3cba05, 0x3cbdc6, 0x3cbe05, 0x3cbe29, 0x3cbf60, 0x3cbff2, 0x3cc000, 0x3cfc05,
    0x3cfce0, 0x3cfd05, 0x3cfd80, 0x3cfda5, 0x3cfde0, 0x3cfe05, 0x3cffe0, 0x3d0005,
    0x3d18a0, 0x3d18eb, 0x3d1a06, 0x3d1ae0, 0x3d2001, 0x3d2442, 0x3d2886, 0x3d2964,
    0x3d2980, 0x3d2a09, 0x3d2b40, 0x3d2bd2, 0x3d2c00, 0x3d8e2b, 0x3d9596, 0x3d95ab,
    0x3d9614, 0x3d962b, 0x3d96a0, 0x3da02b, 0x3da5d6, 0x3da5eb, 0x3da7c0, 0x3dc005,
    0x3dc080, 0x3dc0a5, 0x3dc400, 0x3dc425, 0x3dc460, 0x3dc485, 0x3dc4a0, 0x3dc4e5,
    0x3dc500, 0x3dc525, 0x3dc660, 0x3dc685, 0x3dc700, 0x3dc725, 0x3dc740, 0x3dc765,
    0x3dc780, 0x3dc845, 0x3dc860, 0x3dc8e5, 0x3dc900, 0x3dc925, 0x3dc940, 0x3dc965,
    0x3dc980, 0x3dc9a5, 0x3dca00, 0x3dca25, 0x3dca60, 0x3dca85, 0x3dcaa0, 0x3dcae5,
    0x3dcb00, 0x3dcb25, 0x3dcb40, 0x3dcb65, 0x3dcb80, 0x3dcba5, 0x3dcbc0, 0x3dcbe5,
    0x3dcc00, 0x3dcc25, 0x3dcc60, 0x3dcc85, 0x3dcca0, 0x3dcce5, 0x3dcd60, 0x3dcd85,
    0x3dce60, 0x3dce85, 0x3dcf00, 0x3dcf25, 0x3dcfa0, 0x3dcfc5, 0x3dcfe0, 0x3dd005,
    0x3dd140, 0x3dd165, 0x3dd380, 0x3dd425, 0x3dd480, 0x3dd4a5, 0x3dd540, 0x3dd565,
    0x3dd780, 0x3dde13, 0x3dde40, 0x3e0016, 0x3e0580, 0x3e0616, 0x3e1280, 0x3e1416,
    0x3e15e0, 0x3e1636, 0x3e1800, 0x3e1836, 0x3e1a00, 0x3e1a36, 0x3e1ec0, 0x3e200b,
    0x3e21b6, 0x3e35c0, 0x3e3cd6, 0x3e4060, 0x3e4216, 0x3e4780, 0x3e4816, 0x3e4920,
    0x3e4a16, 0x3e4a40, 0x3e4c16, 0x3e4cc0, 0x3e6016, 0x3e7f75, 0x3e8016, 0x3edb00,
    0x3edb96, 0x3edda0, 0x3ede16, 0x3edfa0, 0x3ee016, 0x3eeee0, 0x3eef76, 0x3efb40,
    0x3efc16, 0x3efd80, 0x3efe16, 0x3efe20, 0x3f0016, 0x3f0180, 0x3f0216, 0x3f0900,
    0x3f0a16, 0x3f0b40, 0x3f0c16, 0x3f1100, 0x3f1216, 0x3f15c0, 0x3f1616, 0x3f1780,
    0x3f1816, 0x3f1840, 0x3f2016, 0x3f4a80, 0x3f4c16, 0x3f4dc0, 0x3f4e16, 0x3f4fa0,
    0x3f5016, 0x3f5140, 0x3f51f6, 0x3f58e0, 0x3f59d6, 0x3f5ba0, 0x3f5bf6, 0x3f5d40,
    0x3f5e16, 0x3f5f20, 0x3f6016, 0x3f7260, 0x3f7296, 0x3f7e09, 0x3f7f40, 0x400005,
    0x54dc00, 0x54e005, 0x56e740, 0x56e805, 0x5703c0, 0x570405, 0x59d440, 0x59d605,
    0x5d7c20, 0x5d7e05, 0x5dcbc0, 0x5f0005, 0x5f43c0, 0x600005, 0x626960, 0x626a05,
    0x647600, 0x1c0003b, 0x1c00040, 0x1c0041b, 0x1c01000, 0x1c02006, 0x1c03e00, 0x1e0001d,
    0x1ffffc0, 0x200001d, 0x21fffc0,
};

struct CccRange { std::uint32_t first, last; std::uint8_t ccc; };
inline constexpr CccRange kCccRuns[333] = {
    {0x300, 0x314, 230}, {0x315, 0x315, 232}, {0x316, 0x319, 220}, {0x31a, 0x31a, 232}, {0x31b, 0x31b, 216},
    {0x31c, 0x320, 220}, {0x321, 0x322, 202}, {0x323, 0x326, 220}, {0x327, 0x328, 202}, {0x329, 0x333, 220},
    {0x334, 0x338, 1}, {0x339, 0x33c, 220}, {0x33d, 0x344, 230}, {0x345, 0x345, 240}, {0x346, 0x346, 230},
    {0x347, 0x349, 220}, {0x34a, 0x34c, 230}, {0x34d, 0x34e, 220}, {0x350, 0x352, 230}, {0x353, 0x356, 220},
    {0x357, 0x357, 230}, {0x358, 0x358, 232}, {0x359, 0x35a, 220}, {0x35b, 0x35b, 230}, {0x35c, 0x35c, 233},
    {0x35d, 0x35e, 234}, {0x35f, 0x35f, 233}, {0x360, 0x361, 234}, {0x362, 0x362, 233}, {0x363, 0x36f, 230},
    {0x483, 0x487, 230}, {0x591, 0x591, 220}, {0x592, 0x595, 230}, {0x596, 0x596, 220}, {0x597, 0x599, 230},
    {0x59a, 0x59a, 222}, {0x59b, 0x59b, 220}, {0x59c, 0x5a1, 230}, {0x5a2, 0x5a7, 220}, {0x5a8, 0x5a9, 230},
    {0x5aa, 0x5aa, 220}, {0x5ab, 0x5ac, 230}, {0x5ad, 0x5ad, 222}, {0x5ae, 0x5ae, 228}, {0x5af, 0x5af, 230},
    {0x5b0, 0x5b0, 10}, {0x5b1, 0x5b1, 11}, {0x5b2, 0x5b2, 12}, {0x5b3, 0x5b3, 13}, {0x5b4, 0x5b4, 14},
    {0x5b5, 0x5b5, 15}, {0x5b6, 0x5b6, 16}, {0x5b7, 0x5b7, 17}, {0x5b8, 0x5b8, 18}, {0x5b9, 0x5ba, 19},
    {0x5bb, 0x5bb, 20}, {0x5bc, 0x5bc, 21}, {0x5bd, 0x5bd, 22}, {0x5bf, 0x5bf, 23}, {0x5c1, 0x5c1, 24},
    {0x5c2, 0x5c2, 25}, {0x5c4, 0x5c4, 230}, {0x5c5, 0x5c5, 220}, {0x5c7, 0x5c7, 18}, {0x610, 0x617, 230},
    {0x618, 0x618, 30}, {0x619, 0x619, 31}, {0x61a, 0x61a, 32}, {0x64b, 0x64b, 27}, {0x64c, 0x64c, 28},
    {0x64d, 0x64d, 29}, {0x64e, 0x64e, 30}, {0x64f, 0x64f, 31}, {0x650, 0x650, 32}, {0x651, 0x651, 33},
    {0x652, 0x652, 34}, {0x653, 0x654, 230}, {0x655, 0x656, 220}, {0x657, 0x65b, 230}, {0x65c, 0x65c, 220},
    {0x65d, 0x65e, 230}, {0x65f, 0x65f, 220}, {0x670, 0x670, 35}, {0x6d6, 0x6dc, 230}, {0x6df, 0x6e2, 230},
    {0x6e3, 0x6e3, 220}, {0x6e4, 0x6e4, 230}, {0x6e7, 0x6e8, 230}, {0x6ea, 0x6ea, 220}, {0x6eb, 0x6ec, 230},
    {0x6ed, 0x6ed, 220}, {0x711, 0x711, 36}, {0x730, 0x730, 230}, {0x731, 0x731, 220}, {0x732, 0x733, 230},
    {0x734, 0x734, 220}, {0x735, 0x736, 230}, {0x737, 0x739, 220}, {0x73a, 0x73a, 230}, {0x73b, 0x73c, 220},
    {0x73d, 0x73d, 230}, {0x73e, 0x73e, 220}, {0x73f, 0x741, 230}, {0x742, 0x742, 220}, {0x743, 0x743, 230},
    {0x744, 0x744, 220}, {0x745, 0x745, 230}, {0x746, 0x746, 220}, {0x747, 0x747, 230}, {0x748, 0x748, 220},
    {0x749, 0x74a, 230}, {0x7eb, 0x7f1, 230}, {0x7f2, 0x7f2, 220}, {0x7f3, 0x7f3, 230}, {0x816, 0x819, 230},
    {0x81b, 0x823, 230}, {0x825, 0x827, 230}, {0x829, 0x82d, 230}, {0x859, 0x85b, 220}, {0x8d4, 0x8e1, 230},
    {0x8e3, 0x8e3, 220}, {0x8e4, 0x8e5, 230}, {0x8e6, 0x8e6, 220}, {0x8e7, 0x8e8, 230}, {0x8e9, 0x8e9, 220},
    {0x8ea, 0x8ec, 230}, {0x8ed, 0x8ef, 220}, {0x8f0, 0x8f0, 27}, {0x8f1, 0x8f1, 28}, {0x8f2, 0x8f2, 29},
    {0x8f3, 0x8f5, 230}, {0x8f6, 0x8f6, 220}, {0x8f7, 0x8f8, 230}, {0x8f9, 0x8fa, 220}, {0x8fb, 0x8ff, 230},
    {0x93c, 0x93c, 7}, {0x94d, 0x94d, 9}, {0x951, 0x951, 230}, {0x952, 0x952, 220}, {0x953, 0x954, 230},
    {0x9bc, 0x9bc, 7}, {0x9cd, 0x9cd, 9}, {0xa3c, 0xa3c, 7}, {0xa4d, 0xa4d, 9}, {0xabc, 0xabc, 7},
    {0xacd, 0xacd, 9}, {0xb3c, 0xb3c, 7}, {0xb4d, 0xb4d, 9}, {0xbcd, 0xbcd, 9}, {0xc4d, 0xc4d, 9},
    {0xc55, 0xc55, 84}, {0xc56, 0xc56, 91}, {0xcbc, 0xcbc, 7}, {0xccd, 0xccd, 9}, {0xd4d, 0xd4d, 9},
    {0xdca, 0xdca, 9}, {0xe38, 0xe39, 103}, {0xe3a, 0xe3a, 9}, {0xe48, 0xe4b, 107}, {0xeb8, 0xeb9, 118},
    {0xec8, 0xecb, 122}, {0xf18, 0xf19, 220}, {0xf35, 0xf35, 220}, {0xf37, 0xf37, 220}, {0xf39, 0xf39, 216},
    {0xf71, 0xf71, 129}, {0xf72, 0xf72, 130}, {0xf74, 0xf74, 132}, {0xf7a, 0xf7d, 130}, {0xf80, 0xf80, 130},
    {0xf82, 0xf83, 230}, {0xf84, 0xf84, 9}, {0xf86, 0xf87, 230}, {0xfc6, 0xfc6, 220}, {0x1037, 0x1037, 7},
    {0x1039, 0x103a, 9}, {0x108d, 0x108d, 220}, {0x135d, 0x135f, 230}, {0x1714, 0x1714, 9}, {0x1734, 0x1734, 9},
    {0x17d2, 0x17d2, 9}, {0x17dd, 0x17dd, 230}, {0x18a9, 0x18a9, 228}, {0x1939, 0x1939, 222}, {0x193a, 0x193a, 230},
    {0x193b, 0x193b, 220}, {0x1a17, 0x1a17, 230}, {0x1a18, 0x1a18, 220}, {0x1a60, 0x1a60, 9}, {0x1a75, 0x1a7c, 230},
    {0x1a7f, 0x1a7f, 220}, {0x1ab0, 0x1ab4, 230}, {0x1ab5, 0x1aba, 220}, {0x1abb, 0x1abc, 230}, {0x1abd, 0x1abd, 220},
    {0x1b34, 0x1b34, 7}, {0x1b44, 0x1b44, 9}, {0x1b6b, 0x1b6b, 230}, {0x1b6c, 0x1b6c, 220}, {0x1b6d, 0x1b73, 230},
    {0x1baa, 0x1bab, 9}, {0x1be6, 0x1be6, 7}, {0x1bf2, 0x1bf3, 9}, {0x1c37, 0x1c37, 7}, {0x1cd0, 0x1cd2, 230},
    {0x1cd4, 0x1cd4, 1}, {0x1cd5, 0x1cd9, 220}, {0x1cda, 0x1cdb, 230}, {0x1cdc, 0x1cdf, 220}, {0x1ce0, 0x1ce0, 230},
    {0x1ce2, 0x1ce8, 1}, {0x1ced, 0x1ced, 220}, {0x1cf4, 0x1cf4, 230}, {0x1cf8, 0x1cf9, 230}, {0x1dc0, 0x1dc1, 230},
    {0x1dc2, 0x1dc2, 220}, {0x1dc3, 0x1dc9, 230}, {0x1dca, 0x1dca, 220}, {0x1dcb, 0x1dcc, 230}, {0x1dcd, 0x1dcd, 234},
    {0x1dce, 0x1dce, 214}, {0x1dcf, 0x1dcf, 220}, {0x1dd0, 0x1dd0, 202}, {0x1dd1, 0x1df5, 230}, {0x1dfb, 0x1dfb, 230},
    {0x1dfc, 0x1dfc, 233}, {0x1dfd, 0x1dfd, 220}, {0x1dfe, 0x1dfe, 230}, {0x1dff, 0x1dff, 220}, {0x20d0, 0x20d1, 230},
    {0x20d2, 0x20d3, 1}, {0x20d4, 0x20d7, 230}, {0x20d8, 0x20da, 1}, {0x20db, 0x20dc, 230}, {0x20e1, 0x20e1, 230},
    {0x20e5, 0x20e6, 1}, {0x20e7, 0x20e7, 230}, {0x20e8, 0x20e8, 220}, {0x20e9, 0x20e9, 230}, {0x20ea, 0x20eb, 1},
    {0x20ec, 0x20ef, 220}, {0x20f0, 0x20f0, 230}, {0x2cef, 0x2cf1, 230}, {0x2d7f, 0x2d7f, 9}, {0x2de0, 0x2dff, 230},
    {0x302a, 0x302a, 218}, {0x302b, 0x302b, 228}, {0x302c, 0x302c, 232}, {0x302d, 0x302d, 222}, {0x302e, 0x302f, 224},
    {0x3099, 0x309a, 8}, {0xa66f, 0xa66f, 230}, {0xa674, 0xa67d, 230}, {0xa69e, 0xa69f, 230}, {0xa6f0, 0xa6f1, 230},
    {0xa806, 0xa806, 9}, {0xa8c4, 0xa8c4, 9}, {0xa8e0, 0xa8f1, 230}, {0xa92b, 0xa92d, 220}, {0xa953, 0xa953, 9},
    {0xa9b3, 0xa9b3, 7}, {0xa9c0, 0xa9c0, 9}, {0xaab0, 0xaab0, 230}, {0xaab2, 0xaab3, 230}, {0xaab4, 0xaab4, 220},
    {0xaab7, 0xaab8, 230}, {0xaabe, 0xaabf, 230}, {0xaac1, 0xaac1, 230}, {0xaaf6, 0xaaf6, 9}, {0xabed, 0xabed, 9},
    {0xfb1e, 0xfb1e, 26}, {0xfe20, 0xfe26, 230}, {0xfe27, 0xfe2d, 220}, {0xfe2e, 0xfe2f, 230}, {0x101fd, 0x101fd, 220},
    {0x102e0, 0x102e0, 220}, {0x10376, 0x1037a, 230}, {0x10a0d, 0x10a0d, 220}, {0x10a0f, 0x10a0f, 230}, {0x10a38, 0x10a38, 230},
    {0x10a39, 0x10a39, 1}, {0x10a3a, 0x10a3a, 220}, {0x10a3f, 0x10a3f, 9}, {0x10ae5, 0x10ae5, 230}, {0x10ae6, 0x10ae6, 220},
    {0x11046, 0x11046, 9}, {0x1107f, 0x1107f, 9}, {0x110b9, 0x110b9, 9}, {0x110ba, 0x110ba, 7}, {0x11100, 0x11102, 230},
    {0x11133, 0x11134, 9}, {0x11173, 0x11173, 7}, {0x111c0, 0x111c0, 9}, {0x111ca, 0x111ca, 7}, {0x11235, 0x11235, 9},
    {0x11236, 0x11236, 7}, {0x112e9, 0x112e9, 7}, {0x112ea, 0x112ea, 9}, {0x1133c, 0x1133c, 7}, {0x1134d, 0x1134d, 9},
    {0x11366, 0x1136c, 230}, {0x11370, 0x11374, 230}, {0x11442, 0x11442, 9}, {0x11446, 0x11446, 7}, {0x114c2, 0x114c2, 9},
    {0x114c3, 0x114c3, 7}, {0x115bf, 0x115bf, 9}, {0x115c0, 0x115c0, 7}, {0x1163f, 0x1163f, 9}, {0x116b6, 0x116b6, 9},
    {0x116b7, 0x116b7, 7}, {0x1172b, 0x1172b, 9}, {0x11c3f, 0x11c3f, 9}, {0x16af0, 0x16af4, 1}, {0x16b30, 0x16b36, 230},
    {0x1bc9e, 0x1bc9e, 1}, {0x1d165, 0x1d166, 216}, {0x1d167, 0x1d169, 1}, {0x1d16d, 0x1d16d, 226}, {0x1d16e, 0x1d172, 216},
    {0x1d17b, 0x1d182, 220}, {0x1d185, 0x1d189, 230}, {0x1d18a, 0x1d18b, 220}, {0x1d1aa, 0x1d1ad, 230}, {0x1d242, 0x1d244, 230},
    {0x1e000, 0x1e006, 230}, {0x1e008, 0x1e018, 230}, {0x1e01b, 0x1e021, 230}, {0x1e023, 0x1e024, 230}, {0x1e026, 0x1e02a, 230},
    {0x1e8d0, 0x1e8d6, 220}, {0x1e944, 0x1e949, 230}, {0x1e94a, 0x1e94a, 7},
};

struct Decomp { std::uint32_t cp, first, second; };
inline constexpr Decomp kDecomp[2060] = {
    {0xc0, 0x41, 0x300}, {0xc1, 0x41, 0x301}, {0xc2, 0x41, 0x302}, {0xc3, 0x41, 0x303},
    {0xc4, 0x41, 0x308}, {0xc5, 0x41, 0x30a}, {0xc7, 0x43, 0x327}, {0xc8, 0x45, 0x300},
    {0xc9, 0x45, 0x301}, {0xca, 0x45, 0x302}, {0xcb, 0x45, 0x308}, {0xcc, 0x49, 0x300},
    {0xcd, 0x49, 0x301}, {0xce, 0x49, 0x302}, {0xcf, 0x49, 0x308}, {0xd1, 0x4e, 0x303},
    {0xd2, 0x4f, 0x300}, {0xd3, 0x4f, 0x301}, {0xd4, 0x4f, 0x302}, {0xd5, 0x4f, 0x303},
    {0xd6, 0x4f, 0x308}, {0xd9, 0x55, 0x300}, {0xda, 0x55, 0x301}, {0xdb, 0x55, 0x302},
    {0xdc, 0x55, 0x308}, {0xdd, 0x59, 0x301}, {0xe0, 0x61, 0x300}, {0xe1, 0x61, 0x301},
    {0xe2, 0x61, 0x302}, {0xe3, 0x61, 0x303}, {0xe4, 0x61, 0x308}, {0xe5, 0x61, 0x30a},
    {0xe7, 0x63, 0x327}, {0xe8, 0x65, 0x300}, {0xe9, 0x65, 0x301}, {0xea, 0x65, 0x302},
    {0xeb, 0x65, 0x308}, {0xec, 0x69, 0x300}, {0xed, 0x69, 0x301}, {0xee, 0x69, 0x302},
    {0xef, 0x69, 0x308}, {0xf1, 0x6e, 0x303}, {0xf2, 0x6f, 0x300}, {0xf3, 0x6f, 0x301},
    {0xf4, 0x6f, 0x302}, {0xf5, 0x6f, 0x303}, {0xf6, 0x6f, 0x308}, {0xf9, 0x75, 0x300},
    {0xfa, 0x75, 0x301}, {0xfb, 0x75, 0x302}, {0xfc, 0x75, 0x308}, {0xfd, 0x79, 0x301},
    {0xff, 0x79, 0x308}, {0x100, 0x41, 0x304}, {0x101, 0x61, 0x304}, {0x102, 0x41, 0x306},
    {0x103, 0x61, 0x306}, {0x104, 0x41, 0x328}, {0x105, 0x61, 0x328}, {0x106, 0x43, 0x301},
    {0x107, 0x63, 0x301}, {0x108, 0x43, 0x302}, {0x109, 0x63, 0x302}, {0x10a, 0x43, 0x307},
    {0x10b, 0x63, 0x307}, {0x10c, 0x43, 0x30c}, {0x10d, 0x63, 0x30c}, {0x10e, 0x44, 0x30c},
    {0x10f, 0x64, 0x30c}, {0x112, 0x45, 0x304}, {0x113, 0x65, 0x304}, {0x114, 0x45, 0x306},
    {0x115, 0x65, 0x306}, {0x116, 0x45, 0x307}, {0x117, 0x65, 0x307}, {0x118, 0x45, 0x328},
    {0x119, 0x65, 0x328}, {0x11a, 0x45, 0x30c}, {0x11b, 0x65, 0x30c}, {0x11c, 0x47, 0x302},
    {0x11d, 0x67, 0x302}, {0x11e, 0x47, 0x306}, {0x11f, 0x67, 0x306}, {0x120, 0x47, 0x307},
    {0x121, 0x67, 0x307}, {0x122, 0x47, 0x327}, {0x123, 0x67, 0x327}, {0x124, 0x48, 0x302},
    {0x125, 0x68, 0x302}, {0x128, 0x49, 0x303}, {0x129, 0x69, 0x303}, {0x12a, 0x49, 0x304},
    {0x12b, 0x69, 0x304}, {0x12c, 0x49, 0x306}, {0x12d, 0x69, 0x306}, {0x12e, 0x49, 0x328},
    {0x12f, 0x69, 0x328}, {0x130, 0x49, 0x307}, {0x134, 0x4a, 0x302}, {0x135, 0x6a, 0x302},
    {0x136, 0x4b, 0x327}, {0x137, 0x6b, 0x327}, {0x139, 0x4c, 0x301}, {0x13a, 0x6c, 0x301},
    {0x13b, 0x4c, 0x327}, {0x13c, 0x6c, 0x327}, {0x13d, 0x4c, 0x30c}, {0x13e, 0x6c, 0x30c},
    {0x143, 0x4e, 0x301}, {0x144, 0x6e, 0x301}, {0x145, 0x4e, 0x327}, {0x146, 0x6e, 0x327},
    {0x147, 0x4e, 0x30c}, {0x148, 0x6e, 0x30c}, {0x14c, 0x4f, 0x304}, {0x14d, 0x6f, 0x304},
    {0x14e, 0x4f, 0x306}, {0x14f, 0x6f, 0x306}, {0x150, 0x4f, 0x30b}, {0x151, 0x6f, 0x30b},
    {0x154, 0x52, 0x301}, {0x155, 0x72, 0x301}, {0x156, 0x52, 0x327}, {0x157, 0x72, 0x327},
    {0x158, 0x52, 0x30c}, {0x159, 0x72, 0x30c}, {0x15a, 0x53, 0x301}, {0x15b, 0x73, 0x301},
    {0x15c, 0x53, 0x302}, {0x15d, 0x73, 0x302}, {0x15e, 0x53, 0x327}, {0x15f, 0x73, 0x327},
    {0x160, 0x53, 0x30c}, {0x161, 0x73, 0x30c}, {0x162, 0x54, 0x327}, {0x163, 0x74, 0x327},
    {0x164, 0x54, 0x30c}, {0x165, 0x74, 0x30c}, {0x168, 0x55, 0x303}, {0x169, 0x75, 0x303},
    {0x16a, 0x55, 0x304}, {0x16b, 0x75, 0x304}, {0x16c, 0x55, 0x306}, {0x16d, 0x75, 0x306},
    {0x16e, 0x55, 0x30a}, {0x16f, 0x75, 0x30a}, {0x170, 0x55, 0x30b}, {0x171, 0x75, 0x30b},
    {0x172, 0x55, 0x328}, {0x173, 0x75, 0x328}, {0x174, 0x57, 0x302}, {0x175, 0x77, 0x302},
    {0x176, 0x59, 0x302}, {0x177, 0x79, 0x302}, {0x178, 0x59, 0x308}, {0x179, 0x5a, 0x301},
    {0x17a, 0x7a, 0x301}, {0x17b, 0x5a, 0x307}, {0x17c, 0x7a, 0x307}, {0x17d, 0x5a, 0x30c},
    {0x17e, 0x7a, 0x30c}, {0x1a0, 0x4f, 0x31b}, {0x1a1, 0x6f, 0x31b}, {0x1af, 0x55, 0x31b},
    {0x1b0, 0x75, 0x31b}, {0x1cd, 0x41, 0x30c}, {0x1ce, 0x61, 0x30c}, {0x1cf, 0x49, 0x30c},
    {0x1d0, 0x69, 0x30c}, {0x1d1, 0x4f, 0x30c}, {0x1d2, 0x6f, 0x30c}, {0x1d3, 0x55, 0x30c},
    {0x1d4, 0x75, 0x30c}, {0x1d5, 0xdc, 0x304}, {0x1d6, 0xfc, 0x304}, {0x1d7, 0xdc, 0x301},
    {0x1d8, 0xfc, 0x301}, {0x1d9, 0xdc, 0x30c}, {0x1da, 0xfc, 0x30c}, {0x1db, 0xdc, 0x300},
    {0x1dc, 0xfc, 0x300}, {0x1de, 0xc4, 0x304}, {0x1df, 0xe4, 0x304}, {0x1e0, 0x226, 0x304},
    {0x1e1, 0x227, 0x304}, {0x1e2, 0xc6, 0x304}, {0x1e3, 0xe6, 0x304}, {0x1e6, 0x47, 0x30c},
    {0x1e7, 0x67, 0x30c}, {0x1e8, 0x4b, 0x30c}, {0x1e9, 0x6b, 0x30c}, {0x1ea, 0x4f, 0x328},
    {0x1eb, 0x6f, 0x328}, {0x1ec, 0x1ea, 0x304}, {0x1ed, 0x1eb, 0x304}, {0x1ee, 0x1b7, 0x30c},
    {0x1ef, 0x292, 0x30c}, {0x1f0, 0x6a, 0x30c}, {0x1f4, 0x47, 0x301}, {0x1f5, 0x67, 0x301},
    {0x1f8, 0x4e, 0x300}, {0x1f9, 0x6e, 0x300}, {0x1fa, 0xc5, 0x301}, {0x1fb, 0xe5, 0x301},
    {0x1fc, 0xc6, 0x301}, {0x1fd, 0xe6, 0x301}, {0x1fe, 0xd8, 0x301}, {0x1ff, 0xf8, 0x301},
    {0x200, 0x41, 0x30f}, {0x201, 0x61, 0x30f}, {0x202, 0x41, 0x311}, {0x203, 0x61, 0x311},
    {0x204, 0x45, 0x30f}, {0x205, 0x65, 0x30f}, {0x206, 0x45, 0x311}, {0x207, 0x65, 0x311},
    {0x208, 0x49, 0x30f}, {0x209, 0x69, 0x30f}, {0x20a, 0x49, 0x311}, {0x20b, 0x69, 0x311},
    {0x20c, 0x4f, 0x30f}, {0x20d, 0x6f, 0x30f}, {0x20e, 0x4f, 0x311}, {0x20f, 0x6f, 0x311},
    {0x210, 0x52, 0x30f}, {0x211, 0x72, 0x30f}, {0x212, 0x52, 0x311}, {0x213, 0x72, 0x311},
    {0x214, 0x55, 0x30f}, {0x215, 0x75, 0x30f}, {0x216, 0x55, 0x311}, {0x217, 0x75, 0x311},
    {0x218, 0x53, 0x326}, {0x219, 0x73, 0x326}, {0x21a, 0x54, 0x326}, {0x21b, 0x74, 0x326},
    {0x21e, 0x48, 0x30c}, {0x21f, 0x68, 0x30c}, {0x226, 0x41, 0x307}, {0x227, 0x61, 0x307},
    {0x228, 0x45, 0x327}, {0x229, 0x65, 0x327}, {0x22a, 0xd6, 0x304}, {0x22b, 0xf6, 0x304},
    {0x22c, 0xd5, 0x304}, {0x22d, 0xf5, 0x304}, {0x22e, 0x4f, 0x307}, {0x22f, 0x6f, 0x307},
    {0x230, 0x22e, 0x304}, {0x231, 0x22f, 0x304}, {0x232, 0x59, 0x304}, {0x233, 0x79, 0x304},
    {0x340, 0x300, 0x80000000}, {0x341, 0x301, 0x80000000}, {0x343, 0x313, 0x80000000}, {0x344, 0x308, 0x80000301},
    {0x374, 0x2b9, 0x80000000}, {0x37e, 0x3b, 0x80000000}, {0x385, 0xa8, 0x301}, {0x386, 0x391, 0x301},
    {0x387, 0xb7, 0x80000000}, {0x388, 0x395, 0x301}, {0x389, 0x397, 0x301}, {0x38a, 0x399, 0x301},
    {0x38c, 0x39f, 0x301}, {0x38e, 0x3a5, 0x301}, {0x38f, 0x3a9, 0x301}, {0x390, 0x3ca, 0x301},
    {0x3aa, 0x399, 0x308}, {0x3ab, 0x3a5, 0x308}, {0x3ac, 0x3b1, 0x301}, {0x3ad, 0x3b5, 0x301},
    {0x3ae, 0x3b7, 0x301}, {0x3af, 0x3b9, 0x301}, {0x3b0, 0x3cb, 0x301}, {0x3ca, 0x3b9, 0x308},
    {0x3cb, 0x3c5, 0x308}, {0x3cc, 0x3bf, 0x301}, {0x3cd, 0x3c5, 0x301}, {0x3ce, 0x3c9, 0x301},
    {0x3d3, 0x3d2, 0x301}, {0x3d4, 0x3d2, 0x308}, {0x400, 0x415, 0x300}, {0x401, 0x415, 0x308},
    {0x403, 0x413, 0x301}, {0x407, 0x406, 0x308}, {0x40c, 0x41a, 0x301}, {0x40d, 0x418, 0x300},
    {0x40e, 0x423, 0x306}, {0x419, 0x418, 0x306}, {0x439, 0x438, 0x306}, {0x450, 0x435, 0x300},
    {0x451, 0x435, 0x308}, {0x453, 0x433, 0x301}, {0x457, 0x456, 0x308}, {0x45c, 0x43a, 0x301},
    {0x45d, 0x438, 0x300}, {0x45e, 0x443, 0x306}, {0x476, 0x474, 0x30f}, {0x477, 0x475, 0x30f},
    {0x4c1, 0x416, 0x306}, {0x4c2, 0x436, 0x306}, {0x4d0, 0x410, 0x306}, {0x4d1, 0x430, 0x306},
    {0x4d2, 0x410, 0x308}, {0x4d3, 0x430, 0x308}, {0x4d6, 0x415, 0x306}, {0x4d7, 0x435, 0x306},
    {0x4da, 0x4d8, 0x308}, {0x4db, 0x4d9, 0x308}, {0x4dc, 0x416, 0x308}, {0x4dd, 0x436, 0x308},
    {0x4de, 0x417, 0x308}, {0x4df, 0x437, 0x308}, {0x4e2, 0x418, 0x304}, {0x4e3, 0x438, 0x304},
    {0x4e4, 0x418, 0x308}, {0x4e5, 0x438, 0x308}, {0x4e6, 0x41e, 0x308}, {0x4e7, 0x43e, 0x308},
    {0x4ea, 0x4e8, 0x308}, {0x4eb, 0x4e9, 0x308}, {0x4ec, 0x42d, 0x308}, {0x4ed, 0x44d, 0x308},
    {0x4ee, 0x423, 0x304}, {0x4ef, 0x443, 0x304}, {0x4f0, 0x423, 0x308}, {0x4f1, 0x443, 0x308},
    {0x4f2, 0x423, 0x30b}, {0x4f3, 0x443, 0x30b}, {0x4f4, 0x427, 0x308}, {0x4f5, 0x447, 0x308},
    {0x4f8, 0x42b, 0x308}, {0x4f9, 0x44b, 0x308}, {0x622, 0x627, 0x653}, {0x623, 0x627, 0x654},
    {0x624, 0x648, 0x654}, {0x625, 0x627, 0x655}, {0x626, 0x64a, 0x654}, {0x6c0, 0x6d5, 0x654},
    {0x6c2, 0x6c1, 0x654}, {0x6d3, 0x6d2, 0x654}, {0x929, 0x928, 0x93c}, {0x931, 0x930, 0x93c},
    {0x934, 0x933, 0x93c}, {0x958, 0x915, 0x8000093c}, {0x959, 0x916, 0x8000093c}, {0x95a, 0x917, 0x8000093c},
    {0x95b, 0x91c, 0x8000093c}, {0x95c, 0x921, 0x8000093c}, {0x95d, 0x922, 0x8000093c}, {0x95e, 0x92b, 0x8000093c},
    {0x95f, 0x92f, 0x8000093c}, {0x9cb, 0x9c7, 0x9be}, {0x9cc, 0x9c7, 0x9d7}, {0x9dc, 0x9a1, 0x800009bc},
    {0x9dd, 0x9a2, 0x800009bc}, {0x9df, 0x9af, 0x800009bc}, {0xa33, 0xa32, 0x80000a3c}, {0xa36, 0xa38, 0x80000a3c},
    {0xa59, 0xa16, 0x80000a3c}, {0xa5a, 0xa17, 0x80000a3c}, {0xa5b, 0xa1c, 0x80000a3c}, {0xa5e, 0xa2b, 0x80000a3c},
    {0xb48, 0xb47, 0xb56}, {0xb4b, 0xb47, 0xb3e}, {0xb4c, 0xb47, 0xb57}, {0xb5c, 0xb21, 0x80000b3c},
    {0xb5d, 0xb22, 0x80000b3c}, {0xb94, 0xb92, 0xbd7}, {0xbca, 0xbc6, 0xbbe}, {0xbcb, 0xbc7, 0xbbe},
    {0xbcc, 0xbc6, 0xbd7}, {0xc48, 0xc46, 0xc56}, {0xcc0, 0xcbf, 0xcd5}, {0xcc7, 0xcc6, 0xcd5},
    {0xcc8, 0xcc6, 0xcd6}, {0xcca, 0xcc6, 0xcc2}, {0xccb, 0xcca, 0xcd5}, {0xd4a, 0xd46, 0xd3e},
    {0xd4b, 0xd47, 0xd3e}, {0xd4c, 0xd46, 0xd57}, {0xdda, 0xdd9, 0xdca}, {0xddc, 0xdd9, 0xdcf},
    {0xddd, 0xddc, 0xdca}, {0xdde, 0xdd9, 0xddf}, {0xf43, 0xf42, 0x80000fb7}, {0xf4d, 0xf4c, 0x80000fb7},
    {0xf52, 0xf51, 0x80000fb7}, {0xf57, 0xf56, 0x80000fb7}, {0xf5c, 0xf5b, 0x80000fb7}, {0xf69, 0xf40, 0x80000fb5},
    {0xf73, 0xf71, 0x80000f72}, {0xf75, 0xf71, 0x80000f74}, {0xf76, 0xfb2, 0x80000f80}, {0xf78, 0xfb3, 0x80000f80},
    {0xf81, 0xf71, 0x80000f80}, {0xf93, 0xf92, 0x80000fb7}, {0xf9d, 0xf9c, 0x80000fb7}, {0xfa2, 0xfa1, 0x80000fb7},
    {0xfa7, 0xfa6, 0x80000fb7}, {0xfac, 0xfab, 0x80000fb7}, {0xfb9, 0xf90, 0x80000fb5}, {0x1026, 0x1025, 0x102e},
    {0x1b06, 0x1b05, 0x1b35}, {0x1b08, 0x1b07, 0x1b35}, {0x1b0a, 0x1b09, 0x1b35}, {0x1b0c, 0x1b0b, 0x1b35},
    {0x1b0e, 0x1b0d, 0x1b35}, {0x1b12, 0x1b11, 0x1b35}, {0x1b3b, 0x1b3a, 0x1b35}, {0x1b3d, 0x1b3c, 0x1b35},
    {0x1b40, 0x1b3e, 0x1b35}, {0x1b41, 0x1b3f, 0x1b35}, {0x1b43, 0x1b42, 0x1b35}, {0x1e00, 0x41, 0x325},
    {0x1e01, 0x61, 0x325}, {0x1e02, 0x42, 0x307}, {0x1e03, 0x62, 0x307}, {0x1e04, 0x42, 0x323},
    {0x1e05, 0x62, 0x323}, {0x1e06, 0x42, 0x331}, {0x1e07, 0x62, 0x331}, {0x1e08, 0xc7, 0x301},
    {0x1e09, 0xe7, 0x301}, {0x1e0a, 0x44, 0x307}, {0x1e0b, 0x64, 0x307}, {0x1e0c, 0x44, 0x323},
    {0x1e0d, 0x64, 0x323}, {0x1e0e, 0x44, 0x331}, {0x1e0f, 0x64, 0x331}, {0x1e10, 0x44, 0x327},
    {0x1e11, 0x64, 0x327}, {0x1e12, 0x44, 0x32d}, {0x1e13, 0x64, 0x32d}, {0x1e14, 0x112, 0x300},
    {0x1e15, 0x113, 0x300}, {0x1e16, 0x112, 0x301}, {0x1e17, 0x113, 0x301}, {0x1e18, 0x45, 0x32d},
    {0x1e19, 0x65, 0x32d}, {0x1e1a, 0x45, 0x330}, {0x1e1b, 0x65, 0x330}, {0x1e1c, 0x228, 0x306},
    {0x1e1d, 0x229, 0x306}, {0x1e1e, 0x46, 0x307}, {0x1e1f, 0x66, 0x307}, {0x1e20, 0x47, 0x304},
    {0x1e21, 0x67, 0x304}, {0x1e22, 0x48, 0x307}, {0x1e23, 0x68, 0x307}, {0x1e24, 0x48, 0x323},
    {0x1e25, 0x68, 0x323}, {0x1e26, 0x48, 0x308}, {0x1e27, 0x68, 0x308}, {0x1e28, 0x48, 0x327},
    {0x1e29, 0x68, 0x327}, {0x1e2a, 0x48, 0x32e}, {0x1e2b, 0x68, 0x32e}, {0x1e2c, 0x49, 0x330},
    {0x1e2d, 0x69, 0x330}, {0x1e2e, 0xcf, 0x301}, {0x1e2f, 0xef, 0x301}, {0x1e30, 0x4b, 0x301},
    {0x1e31, 0x6b, 0x301}, {0x1e32, 0x4b, 0x323}, {0x1e33, 0x6b, 0x323}, {0x1e34, 0x4b, 0x331},
    {0x1e35, 0x6b, 0x331}, {0x1e36, 0x4c, 0x323}, {0x1e37, 0x6c, 0x323}, {0x1e38, 0x1e36, 0x304},
    {0x1e39, 0x1e37, 0x304}, {0x1e3a, 0x4c, 0x331}, {0x1e3b, 0x6c, 0x331}, {0x1e3c, 0x4c, 0x32d},
    {0x1e3d, 0x6c, 0x32d}, {0x1e3e, 0x4d, 0x301}, {0x1e3f, 0x6d, 0x301}, {0x1e40, 0x4d, 0x307},
    {0x1e41, 0x6d, 0x307}, {0x1e42, 0x4d, 0x323}, {0x1e43, 0x6d, 0x323}, {0x1e44, 0x4e, 0x307},
    {0x1e45, 0x6e, 0x307}, {0x1e46, 0x4e, 0x323}, {0x1e47, 0x6e, 0x323}, {0x1e48, 0x4e, 0x331},
    {0x1e49, 0x6e, 0x331}, {0x1e4a, 0x4e, 0x32d}, {0x1e4b, 0x6e, 0x32d}, {0x1e4c, 0xd5, 0x301},
    {0x1e4d, 0xf5, 0x301}, {0x1e4e, 0xd5, 0x308}, {0x1e4f, 0xf5, 0x308}, {0x1e50, 0x14c, 0x300},
    {0x1e51, 0x14d, 0x300}, {0x1e52, 0x14c, 0x301}, {0x1e53, 0x14d, 0x301}, {0x1e54, 0x50, 0x301},
    {0x1e55, 0x70, 0x301}, {0x1e56, 0x50, 0x307}, {0x1e57, 0x70, 0x307}, {0x1e58, 0x52, 0x307},
    {0x1e59, 0x72, 0x307}, {0x1e5a, 0x52, 0x323}, {0x1e5b, 0x72, 0x323}, {0x1e5c, 0x1e5a, 0x304},
    {0x1e5d, 0x1e5b, 0x304}, {0x1e5e, 0x52, 0x331}, {0x1e5f, 0x72, 0x331}, {0x1e60, 0x53, 0x307},
    {0x1e61, 0x73, 0x307}, {0x1e62, 0x53, 0x323}, {0x1e63, 0x73, 0x323}, {0x1e64, 0x15a, 0x307},
    {0x1e65, 0x15b, 0x307}, {0x1e66, 0x160, 0x307}, {0x1e67, 0x161, 0x307}, {0x1e68, 0x1e62, 0x307},
    {0x1e69, 0x1e63, 0x307}, {0x1e6a, 0x54, 0x307}, {0x1e6b, 0x74, 0x307}, {0x1e6c, 0x54, 0x323},
    {0x1e6d, 0x74, 0x323}, {0x1e6e, 0x54, 0x331}, {0x1e6f, 0x74, 0x331}, {0x1e70, 0x54, 0x32d},
    {0x1e71, 0x74, 0x32d}, {0x1e72, 0x55, 0x324}, {0x1e73, 0x75, 0x324}, {0x1e74, 0x55, 0x330},
    {0x1e75, 0x75, 0x330}, {0x1e76, 0x55, 0x32d}, {0x1e77, 0x75, 0x32d}, {0x1e78, 0x168, 0x301},
    {0x1e79, 0x169, 0x301}, {0x1e7a, 0x16a, 0x308}, {0x1e7b, 0x16b, 0x308}, {0x1e7c, 0x56, 0x303},
    {0x1e7d, 0x76, 0x303}, {0x1e7e, 0x56, 0x323}, {0x1e7f, 0x76, 0x323}, {0x1e80, 0x57, 0x300},
    {0x1e81, 0x77, 0x300}, {0x1e82, 0x57, 0x301}, {0x1e83, 0x77, 0x301}, {0x1e84, 0x57, 0x308},
    {0x1e85, 0x77, 0x308}, {0x1e86, 0x57, 0x307}, {0x1e87, 0x77, 0x307}, {0x1e88, 0x57, 0x323},
    {0x1e89, 0x77, 0x323}, {0x1e8a, 0x58, 0x307}, {0x1e8b, 0x78, 0x307}, {0x1e8c, 0x58, 0x308},
    {0x1e8d, 0x78, 0x308}, {0x1e8e, 0x59, 0x307}, {0x1e8f, 0x79, 0x307}, {0x1e90, 0x5a, 0x302},
    {0x1e91, 0x7a, 0x302}, {0x1e92, 0x5a, 0x323}, {0x1e93, 0x7a, 0x323}, {0x1e94, 0x5a, 0x331},
    {0x1e95, 0x7a, 0x331}, {0x1e96, 0x68, 0x331}, {0x1e97, 0x74, 0x308}, {0x1e98, 0x77, 0x30a},
    {0x1e99, 0x79, 0x30a}, {0x1e9b, 0x17f, 0x307}, {0x1ea0, 0x41, 0x323}, {0x1ea1, 0x61, 0x323},
    {0x1ea2, 0x41, 0x309}, {0x1ea3, 0x61, 0x309}, {0x1ea4, 0xc2, 0x301}, {0x1ea5, 0xe2, 0x301},
    {0x1ea6, 0xc2, 0x300}, {0x1ea7, 0xe2, 0x300}, {0x1ea8, 0xc2, 0x309}, {0x1ea9, 0xe2, 0x309},
    {0x1eaa, 0xc2, 0x303}, {0x1eab, 0xe2, 0x303}, {0x1eac, 0x1ea0, 0x302}, {0x1ead, 0x1ea1, 0x302},
    {0x1eae, 0x102, 0x301}, {0x1eaf, 0x103, 0x301}, {0x1eb0, 0x102, 0x300}, {0x1eb1, 0x103, 0x300},
    {0x1eb2, 0x102, 0x309}, {0x1eb3, 0x103, 0x309}, {0x1eb4, 0x102, 0x303}, {0x1eb5, 0x103, 0x303},
    {0x1eb6, 0x1ea0, 0x306}, {0x1eb7, 0x1ea1, 0x306}, {0x1eb8, 0x45, 0x323}, {0x1eb9, 0x65, 0x323},
    {0x1eba, 0x45, 0x309}, {0x1ebb, 0x65, 0x309}, {0x1ebc, 0x45, 0x303}, {0x1ebd, 0x65, 0x303},
    {0x1ebe, 0xca, 0x301}, {0x1ebf, 0xea, 0x301}, {0x1ec0, 0xca, 0x300}, {0x1ec1, 0xea, 0x300},
    {0x1ec2, 0xca, 0x309}, {0x1ec3, 0xea, 0x309}, {0x1ec4, 0xca, 0x303}, {0x1ec5, 0xea, 0x303},
    {0x1ec6, 0x1eb8, 0x302}, {0x1ec7, 0x1eb9, 0x302}, {0x1ec8, 0x49, 0x309}, {0x1ec9, 0x69, 0x309},
    {0x1eca, 0x49, 0x323}, {0x1ecb, 0x69, 0x323}, {0x1ecc, 0x4f, 0x323}, {0x1ecd, 0x6f, 0x323},
    {0x1ece, 0x4f, 0x309}, {0x1ecf, 0x6f, 0x309}, {0x1ed0, 0xd4, 0x301}, {0x1ed1, 0xf4, 0x301},
    {0x1ed2, 0xd4, 0x300}, {0x1ed3, 0xf4, 0x300}, {0x1ed4, 0xd4, 0x309}, {0x1ed5, 0xf4, 0x309},
    {0x1ed6, 0xd4, 0x303}, {0x1ed7, 0xf4, 0x303}, {0x1ed8, 0x1ecc, 0x302}, {0x1ed9, 0x1ecd, 0x302},
    {0x1eda, 0x1a0, 0x301}, {0x1edb, 0x1a1, 0x301}, {0x1edc, 0x1a0, 0x300}, {0x1edd, 0x1a1, 0x300},
    {0x1ede, 0x1a0, 0x309}, {0x1edf, 0x1a1, 0x309}, {0x1ee0, 0x1a0, 0x303}, {0x1ee1, 0x1a1, 0x303},
    {0x1ee2, 0x1a0, 0x323}, {0x1ee3, 0x1a1, 0x323}, {0x1ee4, 0x55, 0x323}, {0x1ee5, 0x75, 0x323},
    {0x1ee6, 0x55, 0x309}, {0x1ee7, 0x75, 0x309}, {0x1ee8, 0x1af, 0x301}, {0x1ee9, 0x1b0, 0x301},
    {0x1eea, 0x1af, 0x300}, {0x1eeb, 0x1b0, 0x300}, {0x1eec, 0x1af, 0x309}, {0x1eed, 0x1b0, 0x309},
    {0x1eee, 0x1af, 0x303}, {0x1eef, 0x1b0, 0x303}, {0x1ef0, 0x1af, 0x323}, {0x1ef1, 0x1b0, 0x323},
    {0x1ef2, 0x59, 0x300}, {0x1ef3, 0x79, 0x300}, {0x1ef4, 0x59, 0x323}, {0x1ef5, 0x79, 0x323},
    {0x1ef6, 0x59, 0x309}, {0x1ef7, 0x79, 0x309}, {0x1ef8, 0x59, 0x303}, {0x1ef9, 0x79, 0x303},
    {0x1f00, 0x3b1, 0x313}, {0x1f01, 0x3b1, 0x314}, {0x1f02, 0x1f00, 0x300}, {0x1f03, 0x1f01, 0x300},
    {0x1f04, 0x1f00, 0x301}, {0x1f05, 0x1f01, 0x301}, {0x1f06, 0x1f00, 0x342}, {0x1f07, 0x1f01, 0x342},
    {0x1f08, 0x391, 0x313}, {0x1f09, 0x391, 0x314}, {0x1f0a, 0x1f08, 0x300}, {0x1f0b, 0x1f09, 0x300},
    {0x1f0c, 0x1f08, 0x301}, {0x1f0d, 0x1f09, 0x301}, {0x1f0e, 0x1f08, 0x342}, {0x1f0f, 0x1f09, 0x342},
    {0x1f10, 0x3b5, 0x313}, {0x1f11, 0x3b5, 0x314}, {0x1f12, 0x1f10, 0x300}, {0x1f13, 0x1f11, 0x300},
    {0x1f14, 0x1f10, 0x301}, {0x1f15, 0x1f11, 0x301}, {0x1f18, 0x395, 0x313}, {0x1f19, 0x395, 0x314},
    {0x1f1a, 0x1f18, 0x300}, {0x1f1b, 0x1f19, 0x300}, {0x1f1c, 0x1f18, 0x301}, {0x1f1d, 0x1f19, 0x301},
    {0x1f20, 0x3b7, 0x313}, {0x1f21, 0x3b7, 0x314}, {0x1f22, 0x1f20, 0x300}, {0x1f23, 0x1f21, 0x300},
    {0x1f24, 0x1f20, 0x301}, {0x1f25, 0x1f21, 0x301}, {0x1f26, 0x1f20, 0x342}, {0x1f27, 0x1f21, 0x342},
    {0x1f28, 0x397, 0x313}, {0x1f29, 0x397, 0x314}, {0x1f2a, 0x1f28, 0x300}, {0x1f2b, 0x1f29, 0x300},
    {0x1f2c, 0x1f28, 0x301}, {0x1f2d, 0x1f29, 0x301}, {0x1f2e, 0x1f28, 0x342}, {0x1f2f, 0x1f29, 0x342},
    {0x1f30, 0x3b9, 0x313}, {0x1f31, 0x3b9, 0x314}, {0x1f32, 0x1f30, 0x300}, {0x1f33, 0x1f31, 0x300},
    {0x1f34, 0x1f30, 0x301}, {0x1f35, 0x1f31, 0x301}, {0x1f36, 0x1f30, 0x342}, {0x1f37, 0x1f31, 0x342},
    {0x1f38, 0x399, 0x313}, {0x1f39, 0x399, 0x314}, {0x1f3a, 0x1f38, 0x300}, {0x1f3b, 0x1f39, 0x300},
    {0x1f3c, 0x1f38, 0x301}, {0x1f3d, 0x1f39, 0x301}, {0x1f3e, 0x1f38, 0x342}, {0x1f3f, 0x1f39, 0x342},
    {0x1f40, 0x3bf, 0x313}, {0x1f41, 0x3bf, 0x314}, {0x1f42, 0x1f40, 0x300}, {0x1f43, 0x1f41, 0x300},
    {0x1f44, 0x1f40, 0x301}, {0x1f45, 0x1f41, 0x301}, {0x1f48, 0x39f, 0x313}, {0x1f49, 0x39f, 0x314},
    {0x1f4a, 0x1f48, 0x300}, {0x1f4b, 0x1f49, 0x300}, {0x1f4c, 0x1f48, 0x301}, {0x1f4d, 0x1f49, 0x301},
    {0x1f50, 0x3c5, 0x313}, {0x1f51, 0x3c5, 0x314}, {0x1f52, 0x1f50, 0x300}, {0x1f53, 0x1f51, 0x300},
    {0x1f54, 0x1f50, 0x301}, {0x1f55, 0x1f51, 0x301}, {0x1f56, 0x1f50, 0x342}, {0x1f57, 0x1f51, 0x342},
    {0x1f59, 0x3a5, 0x314}, {0x1f5b, 0x1f59, 0x300}, {0x1f5d, 0x1f59, 0x301}, {0x1f5f, 0x1f59, 0x342},
    {0x1f60, 0x3c9, 0x313}, {0x1f61, 0x3c9, 0x314}, {0x1f62, 0x1f60, 0x300}, {0x1f63, 0x1f61, 0x300},
    {0x1f64, 0x1f60, 0x301}, {0x1f65, 0x1f61, 0x301}, {0x1f66, 0x1f60, 0x342}, {0x1f67, 0x1f61, 0x342},
    {0x1f68, 0x3a9, 0x313}, {0x1f69, 0x3a9, 0x314}, {0x1f6a, 0x1f68, 0x300}, {0x1f6b, 0x1f69, 0x300},
    {0x1f6c, 0x1f68, 0x301}, {0x1f6d, 0x1f69, 0x301}, {0x1f6e, 0x1f68, 0x342}, {0x1f6f, 0x1f69, 0x342},
    {0x1f70, 0x3b1, 0x300}, {0x1f71, 0x3ac, 0x80000000}, {0x1f72, 0x3b5, 0x300}, {0x1f73, 0x3ad, 0x80000000},
    {0x1f74, 0x3b7, 0x300}, {0x1f75, 0x3ae, 0x80000000}, {0x1f76, 0x3b9, 0x300}, {0x1f77, 0x3af, 0x80000000},
    {0x1f78, 0x3bf, 0x300}, {0x1f79, 0x3cc, 0x80000000}, {0x1f7a, 0x3c5, 0x300}, {0x1f7b, 0x3cd, 0x80000000},
    {0x1f7c, 0x3c9, 0x300}, {0x1f7d, 0x3ce, 0x80000000}, {0x1f80, 0x1f00, 0x345}, {0x1f81, 0x1f01, 0x345},
    {0x1f82, 0x1f02, 0x345}, {0x1f83, 0x1f03, 0x345}, {0x1f84, 0x1f04, 0x345}, {0x1f85, 0x1f05, 0x345},
    {0x1f86, 0x1f06, 0x345}, {0x1f87, 0x1f07, 0x345}, {0x1f88, 0x1f08, 0x345}, {0x1f89, 0x1f09, 0x345},
    {0x1f8a, 0x1f0a, 0x345}, {0x1f8b, 0x1f0b, 0x345}, {0x1f8c, 0x1f0c, 0x345}, {0x1f8d, 0x1f0d, 0x345},
    {0x1f8e, 0x1f0e, 0x345}, {0x1f8f, 0x1f0f, 0x345}, {0x1f90, 0x1f20, 0x345}, {0x1f91, 0x1f21, 0x345},
    {0x1f92, 0x1f22, 0x345}, {0x1f93, 0x1f23, 0x345}, {0x1f94, 0x1f24, 0x345}, {0x1f95, 0x1f25, 0x345},
    {0x1f96, 0x1f26, 0x345}, {0x1f97, 0x1f27, 0x345}, {0x1f98, 0x1f28, 0x345}, {0x1f99, 0x1f29, 0x345},
    {0x1f9a, 0x1f2a, 0x345}, {0x1f9b, 0x1f2b, 0x345}, {0x1f9c, 0x1f2c, 0x345}, {0x1f9d, 0x1f2d, 0x345},
    {0x1f9e, 0x1f2e, 0x345}, {0x1f9f, 0x1f2f, 0x345}, {0x1fa0, 0x1f60, 0x345}, {0x1fa1, 0x1f61, 0x345},
    {0x1fa2, 0x1f62, 0x345}, {0x1fa3, 0x1f63, 0x345}, {0x1fa4, 0x1f64, 0x345}, {0x1fa5, 0x1f65, 0x345},
    {0x1fa6, 0x1f66, 0x345}, {0x1fa7, 0x1f67, 0x345}, {0x1fa8, 0x1f68, 0x345}, {0x1fa9, 0x1f69, 0x345},
    {0x1faa, 0x1f6a, 0x345}, {0x1fab, 0x1f6b, 0x345}, {0x1fac, 0x1f6c, 0x345}, {0x1fad, 0x1f6d, 0x345},
    {0x1fae, 0x1f6e, 0x345}, {0x1faf, 0x1f6f, 0x345}, {0x1fb0, 0x3b1, 0x306}, {0x1fb1, 0x3b1, 0x304},
    {0x1fb2, 0x1f70, 0x345}, {0x1fb3, 0x3b1, 0x345}, {0x1fb4, 0x3ac, 0x345}, {0x1fb6, 0x3b1, 0x342},
    {0x1fb7, 0x1fb6, 0x345}, {0x1fb8, 0x391, 0x306}, {0x1fb9, 0x391, 0x304}, {0x1fba, 0x391, 0x300},
    {0x1fbb, 0x386, 0x80000000}, {0x1fbc, 0x391, 0x345}, {0x1fbe, 0x3b9, 0x80000000}, {0x1fc1, 0xa8, 0x342},
    {0x1fc2, 0x1f74, 0x345}, {0x1fc3, 0x3b7, 0x345}, {0x1fc4, 0x3ae, 0x345}, {0x1fc6, 0x3b7, 0x342},
    {0x1fc7, 0x1fc6, 0x345}, {0x1fc8, 0x395, 0x300}, {0x1fc9, 0x388, 0x80000000}, {0x1fca, 0x397, 0x300},
    {0x1fcb, 0x389, 0x80000000}, {0x1fcc, 0x397, 0x345}, {0x1fcd, 0x1fbf, 0x300}, {0x1fce, 0x1fbf, 0x301},
    {0x1fcf, 0x1fbf, 0x342}, {0x1fd0, 0x3b9, 0x306}, {0x1fd1, 0x3b9, 0x304}, {0x1fd2, 0x3ca, 0x300},
    {0x1fd3, 0x390, 0x80000000}, {0x1fd6, 0x3b9, 0x342}, {0x1fd7, 0x3ca, 0x342}, {0x1fd8, 0x399, 0x306},
    {0x1fd9, 0x399, 0x304}, {0x1fda, 0x399, 0x300}, {0x1fdb, 0x38a, 0x80000000}, {0x1fdd, 0x1ffe, 0x300},
    {0x1fde, 0x1ffe, 0x301}, {0x1fdf, 0x1ffe, 0x342}, {0x1fe0, 0x3c5, 0x306}, {0x1fe1, 0x3c5, 0x304},
    {0x1fe2, 0x3cb, 0x300}, {0x1fe3, 0x3b0, 0x80000000}, {0x1fe4, 0x3c1, 0x313}, {0x1fe5, 0x3c1, 0x314},
    {0x1fe6, 0x3c5, 0x342}, {0x1fe7, 0x3cb, 0x342}, {0x1fe8, 0x3a5, 0x306}, {0x1fe9, 0x3a5, 0x304},
    {0x1fea, 0x3a5, 0x300}, {0x1feb, 0x38e, 0x80000000}, {0x1fec, 0x3a1, 0x314}, {0x1fed, 0xa8, 0x300},
    {0x1fee, 0x385, 0x80000000}, {0x1fef, 0x60, 0x80000000}, {0x1ff2, 0x1f7c, 0x345}, {0x1ff3, 0x3c9, 0x345},
    {0x1ff4, 0x3ce, 0x345}, {0x1ff6, 0x3c9, 0x342}, {0x1ff7, 0x1ff6, 0x345}, {0x1ff8, 0x39f, 0x300},
    {0x1ff9, 0x38c, 0x80000000}, {0x1ffa, 0x3a9, 0x300}, {0x1ffb, 0x38f, 0x80000000}, {0x1ffc, 0x3a9, 0x345},
    {0x1ffd, 0xb4, 0x80000000}, {0x2000, 0x2002, 0x80000000}, {0x2001, 0x2003, 0x80000000}, {0x2126, 0x3a9, 0x80000000},
    {0x212a, 0x4b, 0x80000000}, {0x212b, 0xc5, 0x80000000}, {0x219a, 0x2190, 0x338}, {0x219b, 0x2192, 0x338},
    {0x21ae, 0x2194, 0x338}, {0x21cd, 0x21d0, 0x338}, {0x21ce, 0x21d4, 0x338}, {0x21cf, 0x21d2, 0x338},
    {0x2204, 0x2203, 0x338}, {0x2209, 0x2208, 0x338}, {0x220c, 0x220b, 0x338}, {0x2224, 0x2223, 0x338},
    {0x2226, 0x2225, 0x338}, {0x2241, 0x223c, 0x338}, {0x2244, 0x2243, 0x338}, {0x2247, 0x2245, 0x338},
    {0x2249, 0x2248, 0x338}, {0x2260, 0x3d, 0x338}, {0x2262, 0x2261, 0x338}, {0x226d, 0x224d, 0x338},
    {0x226e, 0x3c, 0x338}, {0x226f, 0x3e, 0x338}, {0x2270, 0x2264, 0x338}, {0x2271, 0x2265, 0x338},
    {0x2274, 0x2272, 0x338}, {0x2275, 0x2273, 0x338}, {0x2278, 0x2276, 0x338}, {0x2279, 0x2277, 0x338},
    {0x2280, 0x227a, 0x338}, {0x2281, 0x227b, 0x338}, {0x2284, 0x2282, 0x338}, {0x2285, 0x2283, 0x338},
    {0x2288, 0x2286, 0x338}, {0x2289, 0x2287, 0x338}, {0x22ac, 0x22a2, 0x338}, {0x22ad, 0x22a8, 0x338},
    {0x22ae, 0x22a9, 0x338}, {0x22af, 0x22ab, 0x338}, {0x22e0, 0x227c, 0x338}, {0x22e1, 0x227d, 0x338},
    {0x22e2, 0x2291, 0x338}, {0x22e3, 0x2292, 0x338}, {0x22ea, 0x22b2, 0x338}, {0x22eb, 0x22b3, 0x338},
    {0x22ec, 0x22b4, 0x338}, {0x22ed, 0x22b5, 0x338}, {0x2329, 0x3008, 0x80000000}, {0x232a, 0x3009, 0x80000000},
    {0x2adc, 0x2add, 0x80000338}, {0x304c, 0x304b, 0x3099}, {0x304e, 0x304d, 0x3099}, {0x3050, 0x304f, 0x3099},
    {0x3052, 0x3051, 0x3099}, {0x3054, 0x3053, 0x3099}, {0x3056, 0x3055, 0x3099}, {0x3058, 0x3057, 0x3099},
    {0x305a, 0x3059, 0x3099}, {0x305c, 0x305b, 0x3099}, {0x305e, 0x305d, 0x3099}, {0x3060, 0x305f, 0x3099},
    {0x3062, 0x3061, 0x3099}, {0x3065, 0x3064, 0x3099}, {0x3067, 0x3066, 0x3099}, {0x3069, 0x3068, 0x3099},
    {0x3070, 0x306f, 0x3099}, {0x3071, 0x306f, 0x309a}, {0x3073, 0x3072, 0x3099}, {0x3074, 0x3072, 0x309a},
    {0x3076, 0x3075, 0x3099}, {0x3077, 0x3075, 0x309a}, {0x3079, 0x3078, 0x3099}, {0x307a, 0x3078, 0x309a},
    {0x307c, 0x307b, 0x3099}, {0x307d, 0x307b, 0x309a}, {0x3094, 0x3046, 0x3099}, {0x309e, 0x309d, 0x3099},
    {0x30ac, 0x30ab, 0x3099}, {0x30ae, 0x30ad, 0x3099}, {0x30b0, 0x30af, 0x3099}, {0x30b2, 0x30b1, 0x3099},
    {0x30b4, 0x30b3, 0x3099}, {0x30b6, 0x30b5, 0x3099}, {0x30b8, 0x30b7, 0x3099}, {0x30ba, 0x30b9, 0x3099},
    {0x30bc, 0x30bb, 0x3099}, {0x30be, 0x30bd, 0x3099}, {0x30c0, 0x30bf, 0x3099}, {0x30c2, 0x30c1, 0x3099},
    {0x30c5, 0x30c4, 0x3099}, {0x30c7, 0x30c6, 0x3099}, {0x30c9, 0x30c8, 0x3099}, {0x30d0, 0x30cf, 0x3099},
    {0x30d1, 0x30cf, 0x309a}, {0x30d3, 0x30d2, 0x3099}, {0x30d4, 0x30d2, 0x309a}, {0x30d6, 0x30d5, 0x3099},
    {0x30d7, 0x30d5, 0x309a}, {0x30d9, 0x30d8, 0x3099}, {0x30da, 0x30d8, 0x309a}, {0x30dc, 0x30db, 0x3099},
    {0x30dd, 0x30db, 0x309a}, {0x30f4, 0x30a6, 0x3099}, {0x30f7, 0x30ef, 0x3099}, {0x30f8, 0x30f0, 0x3099},
    {0x30f9, 0x30f1, 0x3099}, {0x30fa, 0x30f2, 0x3099}, {0x30fe, 0x30fd, 0x3099}, {0xf900, 0x8c48, 0x80000000},
    {0xf901, 0x66f4, 0x80000000}, {0xf902, 0x8eca, 0x80000000}, {0xf903, 0x8cc8, 0x80000000}, {0xf904, 0x6ed1, 0x80000000},
    {0xf905, 0x4e32, 0x80000000}, {0xf906, 0x53e5, 0x80000000}, {0xf907, 0x9f9c, 0x80000000}, {0xf908, 0x9f9c, 0x80000000},
    {0xf909, 0x5951, 0x80000000}, {0xf90a, 0x91d1, 0x80000000}, {0xf90b, 0x5587, 0x80000000}, {0xf90c, 0x5948, 0x80000000},
    {0xf90d, 0x61f6, 0x80000000}, {0xf90e, 0x7669, 0x80000000}, {0xf90f, 0x7f85, 0x80000000}, {0xf910, 0x863f, 0x80000000},
    {0xf911, 0x87ba, 0x80000000}, {0xf912, 0x88f8, 0x80000000}, {0xf913, 0x908f, 0x80000000}, {0xf914, 0x6a02, 0x80000000},
    {0xf915, 0x6d1b, 0x80000000}, {0xf916, 0x70d9, 0x80000000}, {0xf917, 0x73de, 0x80000000}, {0xf918, 0x843d, 0x80000000},
    {0xf919, 0x916a, 0x80000000}, {0xf91a, 0x99f1, 0x80000000}, {0xf91b, 0x4e82, 0x80000000}, {0xf91c, 0x5375, 0x80000000},
    {0xf91d, 0x6b04, 0x80000000}, {0xf91e, 0x721b, 0x80000000}, {0xf91f, 0x862d, 0x80000000}, {0xf920, 0x9e1e, 0x80000000},
    {0xf921, 0x5d50, 0x80000000}, {0xf922, 0x6feb, 0x80000000}, {0xf923, 0x85cd, 0x80000000}, {0xf924, 0x8964, 0x80000000},
    {0xf925, 0x62c9, 0x80000000}, {0xf926, 0x81d8, 0x80000000}, {0xf927, 0x881f, 0x80000000}, {0xf928, 0x5eca, 0x80000000},
    {0xf929, 0x6717, 0x80000000}, {0xf92a, 0x6d6a, 0x80000000}, {0xf92b, 0x72fc, 0x80000000}, {0xf92c, 0x90ce, 0x80000000},
    {0xf92d, 0x4f86, 0x80000000}, {0xf92e, 0x51b7, 0x80000000}, {0xf92f, 0x52de, 0x80000000}, {0xf930, 0x64c4, 0x80000000},
    {0xf931, 0x6ad3, 0x80000000}, {0xf932, 0x7210, 0x80000000}, {0xf933, 0x76e7, 0x80000000}, {0xf934, 0x8001, 0x80000000},
    {0xf935, 0x8606, 0x80000000}, {0xf936, 0x865c, 0x80000000}, {0xf937, 0x8def, 0x80000000}, {0xf938, 0x9732, 0x80000000},
    {0xf939, 0x9b6f, 0x80000000}, {0xf93a, 0x9dfa, 0x80000000}, {0xf93b, 0x788c, 0x80000000}, {0xf93c, 0x797f, 0x80000000},
    {0xf93d, 0x7da0, 0x80000000}, {0xf93e, 0x83c9, 0x80000000}, {0xf93f, 0x9304, 0x80000000}, {0xf940, 0x9e7f, 0x80000000},
    {0xf941, 0x8ad6, 0x80000000}, {0xf942, 0x58df, 0x80000000}, {0xf943, 0x5f04, 0x80000000}, {0xf944, 0x7c60, 0x80000000},
    {0xf945, 0x807e, 0x80000000}, {0xf946, 0x7262, 0x80000000}, {0xf947, 0x78ca, 0x80000000}, {0xf948, 0x8cc2, 0x80000000},
    {0xf949, 0x96f7, 0x80000000}, {0xf94a, 0x58d8, 0x80000000}, {0xf94b, 0x5c62, 0x80000000}, {0xf94c, 0x6a13, 0x80000000},
    {0xf94d, 0x6dda, 0x80000000}, {0xf94e, 0x6f0f, 0x80000000}, {0xf94f, 0x7d2f, 0x80000000}, {0xf950, 0x7e37, 0x80000000},
    {0xf951, 0x964b, 0x80000000}, {0xf952, 0x52d2, 0x80000000}, {0xf953, 0x808b, 0x80000000}, {0xf954, 0x51dc, 0x80000000},
    {0xf955, 0x51cc, 0x80000000}, {0xf956, 0x7a1c, 0x80000000}, {0xf957, 0x7dbe, 0x80000000}, {0xf958, 0x83f1, 0x80000000},
    {0xf959, 0x9675, 0x80000000}, {0xf95a, 0x8b80, 0x80000000}, {0xf95b, 0x62cf, 0x80000000}, {0xf95c, 0x6a02, 0x80000000},
    {0xf95d, 0x8afe, 0x80000000}, {0xf95e, 0x4e39, 0x80000000}, {0xf95f, 0x5be7, 0x80000000}, {0xf960, 0x6012, 0x80000000},
    {0xf961, 0x7387, 0x80000000}, {0xf962, 0x7570, 0x80000000}, {0xf963, 0x5317, 0x80000000}, {0xf964, 0x78fb, 0x80000000},
    {0xf965, 0x4fbf, 0x80000000}, {0xf966, 0x5fa9, 0x80000000}, {0xf967, 0x4e0d, 0x80000000}, {0xf968, 0x6ccc, 0x80000000},
    {0xf969, 0x6578, 0x80000000}, {0xf96a, 0x7d22, 0x80000000}, {0xf96b, 0x53c3, 0x80000000}, {0xf96c, 0x585e, 0x80000000},
    {0xf96d, 0x7701, 0x80000000}, {0xf96e, 0x8449, 0x80000000}, {0xf96f, 0x8aaa, 0x80000000}, {0xf970, 0x6bba, 0x80000000},
    {0xf971, 0x8fb0, 0x80000000}, {0xf972, 0x6c88, 0x80000000}, {0xf973, 0x62fe, 0x80000000}, {0xf974, 0x82e5, 0x80000000},
    {0xf975, 0x63a0, 0x80000000}, {0xf976, 0x7565, 0x80000000}, {0xf977, 0x4eae, 0x80000000}, {0xf978, 0x5169, 0x80000000},
    {0xf979, 0x51c9, 0x80000000}, {0xf97a, 0x6881, 0x80000000}, {0xf97b, 0x7ce7, 0x80000000}, {0xf97c, 0x826f, 0x80000000},
    {0xf97d, 0x8ad2, 0x80000000}, {0xf97e, 0x91cf, 0x80000000}, {0xf97f, 0x52f5, 0x80000000}, {0xf980, 0x5442, 0x80000000},
    {0xf981, 0x5973, 0x80000000}, {0xf982, 0x5eec, 0x80000000}, {0xf983, 0x65c5, 0x80000000}, {0xf984, 0x6ffe, 0x80000000},
    {0xf985, 0x792a, 0x80000000}, {0xf986, 0x95ad, 0x80000000}, {0xf987, 0x9a6a, 0x80000000}, {0xf988, 0x9e97, 0x80000000},
    {0xf989, 0x9ece, 0x80000000}, {0xf98a, 0x529b, 0x80000000}, {0xf98b, 0x66c6, 0x80000000}, {0xf98c, 0x6b77, 0x80000000},
    {0xf98d, 0x8f62, 0x80000000}, {0xf98e, 0x5e74, 0x80000000}, {0xf98f, 0x6190, 0x80000000}, {0xf990, 0x6200, 0x80000000},
    {0xf991, 0x649a, 0x80000000}, {0xf992, 0x6f23, 0x80000000}, {0xf993, 0x7149, 0x80000000}, {0xf994, 0x7489, 0x80000000},
    {0xf995, 0x79ca, 0x80000000}, {0xf996, 0x7df4, 0x80000000}, {0xf997, 0x806f, 0x80000000}, {0xf998, 0x8f26, 0x80000000},
    {0xf999, 0x84ee, 0x80000000}, {0xf99a, 0x9023, 0x80000000}, {0xf99b, 0x934a, 0x80000000}, {0xf99c, 0x5217, 0x80000000},
    {0xf99d, 0x52a3, 0x80000000}, {0xf99e, 0x54bd, 0x80000000}, {0xf99f, 0x70c8, 0x80000000}, {0xf9a0, 0x88c2, 0x80000000},
    {0xf9a1, 0x8aaa, 0x80000000}, {0xf9a2, 0x5ec9, 0x80000000}, {0xf9a3, 0x5ff5, 0x80000000}, {0xf9a4, 0x637b, 0x80000000},
    {0xf9a5, 0x6bae, 0x80000000}, {0xf9a6, 0x7c3e, 0x80000000}, {0xf9a7, 0x7375, 0x80000000}, {0xf9a8, 0x4ee4, 0x80000000},
    {0xf9a9, 0x56f9, 0x80000000}, {0xf9aa, 0x5be7, 0x80000000}, {0xf9ab, 0x5dba, 0x80000000}, {0xf9ac, 0x601c, 0x80000000},
    {0xf9ad, 0x73b2, 0x80000000}, {0xf9ae, 0x7469, 0x80000000}, {0xf9af, 0x7f9a, 0x80000000}, {0xf9b0, 0x8046, 0x80000000},
    {0xf9b1, 0x9234, 0x80000000}, {0xf9b2, 0x96f6, 0x80000000}, {0xf9b3, 0x9748, 0x80000000}, {0xf9b4, 0x9818, 0x80000000},
    {0xf9b5, 0x4f8b, 0x80000000}, {0xf9b6, 0x79ae, 0x80000000}, {0xf9b7, 0x91b4, 0x80000000}, {0xf9b8, 0x96b8, 0x80000000},
    {0xf9b9, 0x60e1, 0x80000000}, {0xf9ba, 0x4e86, 0x80000000}, {0xf9bb, 0x50da, 0x80000000}, {0xf9bc, 0x5bee, 0x80000000},
    {0xf9bd, 0x5c3f, 0x80000000}, {0xf9be, 0x6599, 0x80000000}, {0xf9bf, 0x6a02, 0x80000000}, {0xf9c0, 0x71ce, 0x80000000},
    {0xf9c1, 0x7642, 0x80000000}, {0xf9c2, 0x84fc, 0x80000000}, {0xf9c3, 0x907c, 0x80000000}, {0xf9c4, 0x9f8d, 0x80000000},
    {0xf9c5, 0x6688, 0x80000000}, {0xf9c6, 0x962e, 0x80000000}, {0xf9c7, 0x5289, 0x80000000}, {0xf9c8, 0x677b, 0x80000000},
    {0xf9c9, 0x67f3, 0x80000000}, {0xf9ca, 0x6d41, 0x80000000}, {0xf9cb, 0x6e9c, 0x80000000}, {0xf9cc, 0x7409, 0x80000000},
    {0xf9cd, 0x7559, 0x80000000}, {0xf9ce, 0x786b, 0x80000000}, {0xf9cf, 0x7d10, 0x80000000}, {0xf9d0, 0x985e, 0x80000000},
    {0xf9d1, 0x516d, 0x80000000}, {0xf9d2, 0x622e, 0x80000000}, {0xf9d3, 0x9678, 0x80000000}, {0xf9d4, 0x502b, 0x80000000},
    {0xf9d5, 0x5d19, 0x80000000}, {0xf9d6, 0x6dea, 0x80000000}, {0xf9d7, 0x8f2a, 0x80000000}, {0xf9d8, 0x5f8b, 0x80000000},
    {0xf9d9, 0x6144, 0x80000000}, {0xf9da, 0x6817, 0x80000000}, {0xf9db, 0x7387, 0x80000000}, {0xf9dc, 0x9686, 0x80000000},
    {0xf9dd, 0x5229, 0x80000000}, {0xf9de, 0x540f, 0x80000000}, {0xf9df, 0x5c65, 0x80000000}, {0xf9e0, 0x6613, 0x80000000},
    {0xf9e1, 0x674e, 0x80000000}, {0xf9e2, 0x68a8, 0x80000000}, {0xf9e3, 0x6ce5, 0x80000000}, {0xf9e4, 0x7406, 0x80000000},
    {0xf9e5, 0x75e2, 0x80000000}, {0xf9e6, 0x7f79, 0x80000000}, {0xf9e7, 0x88cf, 0x80000000}, {0xf9e8, 0x88e1, 0x80000000},
    {0xf9e9, 0x91cc, 0x80000000}, {0xf9ea, 0x96e2, 0x80000000}, {0xf9eb, 0x533f, 0x80000000}, {0xf9ec, 0x6eba, 0x80000000},
    {0xf9ed, 0x541d, 0x80000000}, {0xf9ee, 0x71d0, 0x80000000}, {0xf9ef, 0x7498, 0x80000000}, {0xf9f0, 0x85fa, 0x80000000},
    {0xf9f1, 0x96a3, 0x80000000}, {0xf9f2, 0x9c57, 0x80000000}, {0xf9f3, 0x9e9f, 0x80000000}, {0xf9f4, 0x6797, 0x80000000},
    {0xf9f5, 0x6dcb, 0x80000000}, {0xf9f6, 0x81e8, 0x80000000}, {0xf9f7, 0x7acb, 0x80000000}, {0xf9f8, 0x7b20, 0x80000000},
    {0xf9f9, 0x7c92, 0x80000000}, {0xf9fa, 0x72c0, 0x80000000}, {0xf9fb, 0x7099, 0x80000000}, {0xf9fc, 0x8b58, 0x80000000},
    {0xf9fd, 0x4ec0, 0x80000000}, {0xf9fe, 0x8336, 0x80000000}, {0xf9ff, 0x523a, 0x80000000}, {0xfa00, 0x5207, 0x80000000},
    {0xfa01, 0x5ea6, 0x80000000}, {0xfa02, 0x62d3, 0x80000000}, {0xfa03, 0x7cd6, 0x80000000}, {0xfa04, 0x5b85, 0x80000000},
    {0xfa05, 0x6d1e, 0x80000000}, {0xfa06, 0x66b4, 0x80000000}, {0xfa07, 0x8f3b, 0x80000000}, {0xfa08, 0x884c, 0x80000000},
    {0xfa09, 0x964d, 0x80000000}, {0xfa0a, 0x898b, 0x80000000}, {0xfa0b, 0x5ed3, 0x80000000}, {0xfa0c, 0x5140, 0x80000000},
    {0xfa0d, 0x55c0, 0x80000000}, {0xfa10, 0x585a, 0x80000000}, {0xfa12, 0x6674, 0x80000000}, {0xfa15, 0x51de, 0x80000000},
    {0xfa16, 0x732a, 0x80000000}, {0xfa17, 0x76ca, 0x80000000}, {0xfa18, 0x793c, 0x80000000}, {0xfa19, 0x795e, 0x80000000},
    {0xfa1a, 0x7965, 0x80000000}, {0xfa1b, 0x798f, 0x80000000}, {0xfa1c, 0x9756, 0x80000000}, {0xfa1d, 0x7cbe, 0x80000000},
    {0xfa1e, 0x7fbd, 0x80000000}, {0xfa20, 0x8612, 0x80000000}, {0xfa22, 0x8af8, 0x80000000}, {0xfa25, 0x9038, 0x80000000},
    {0xfa26, 0x90fd, 0x80000000}, {0xfa2a, 0x98ef, 0x80000000}, {0xfa2b, 0x98fc, 0x80000000}, {0xfa2c, 0x9928, 0x80000000},
    {0xfa2d, 0x9db4, 0x80000000}, {0xfa2e, 0x90de, 0x80000000}, {0xfa2f, 0x96b7, 0x80000000}, {0xfa30, 0x4fae, 0x80000000},
    {0xfa31, 0x50e7, 0x80000000}, {0xfa32, 0x514d, 0x80000000}, {0xfa33, 0x52c9, 0x80000000}, {0xfa34, 0x52e4, 0x80000000},
    {0xfa35, 0x5351, 0x80000000}, {0xfa36, 0x559d, 0x80000000}, {0xfa37, 0x5606, 0x80000000}, {0xfa38, 0x5668, 0x80000000},
    {0xfa39, 0x5840, 0x80000000}, {0xfa3a, 0x58a8, 0x80000000}, {0xfa3b, 0x5c64, 0x80000000}, {0xfa3c, 0x5c6e, 0x80000000},
    {0xfa3d, 0x6094, 0x80000000}, {0xfa3e, 0x6168, 0x80000000}, {0xfa3f, 0x618e, 0x80000000}, {0xfa40, 0x61f2, 0x80000000},
    {0xfa41, 0x654f, 0x80000000}, {0xfa42, 0x65e2, 0x80000000}, {0xfa43, 0x6691, 0x80000000}, {0xfa44, 0x6885, 0x80000000},
    {0xfa45, 0x6d77, 0x80000000}, {0xfa46, 0x6e1a, 0x80000000}, {0xfa47, 0x6f22, 0x80000000}, {0xfa48, 0x716e, 0x80000000},
    {0xfa49, 0x722b, 0x80000000}, {0xfa4a, 0x7422, 0x80000000}, {0xfa4b, 0x7891, 0x80000000}, {0xfa4c, 0x793e, 0x80000000},
    {0xfa4d, 0x7949, 0x80000000}, {0xfa4e, 0x7948, 0x80000000}, {0xfa4f, 0x7950, 0x80000000}, {0xfa50, 0x7956, 0x80000000},
    {0xfa51, 0x795d, 0x80000000}, {0xfa52, 0x798d, 0x80000000}, {0xfa53, 0x798e, 0x80000000}, {0xfa54, 0x7a40, 0x80000000},
    {0xfa55, 0x7a81, 0x80000000}, {0xfa56, 0x7bc0, 0x80000000}, {0xfa57, 0x7df4, 0x80000000}, {0xfa58, 0x7e09, 0x80000000},
    {0xfa59, 0x7e41, 0x80000000}, {0xfa5a, 0x7f72, 0x80000000}, {0xfa5b, 0x8005, 0x80000000}, {0xfa5c, 0x81ed, 0x80000000},
    {0xfa5d, 0x8279, 0x80000000}, {0xfa5e, 0x8279, 0x80000000}, {0xfa5f, 0x8457, 0x80000000}, {0xfa60, 0x8910, 0x80000000},
    {0xfa61, 0x8996, 0x80000000}, {0xfa62, 0x8b01, 0x80000000}, {0xfa63, 0x8b39, 0x80000000}, {0xfa64, 0x8cd3, 0x80000000},
    {0xfa65, 0x8d08, 0x80000000}, {0xfa66, 0x8fb6, 0x80000000}, {0xfa67, 0x9038, 0x80000000}, {0xfa68, 0x96e3, 0x80000000},
    {0xfa69, 0x97ff, 0x80000000}, {0xfa6a, 0x983b, 0x80000000}, {0xfa6b, 0x6075, 0x80000000}, {0xfa6c, 0x242ee, 0x80000000},
    {0xfa6d, 0x8218, 0x80000000}, {0xfa70, 0x4e26, 0x80000000}, {0xfa71, 0x51b5, 0x80000000}, {0xfa72, 0x5168, 0x80000000},
    {0xfa73, 0x4f80, 0x80000000}, {0xfa74, 0x5145, 0x80000000}, {0xfa75, 0x5180, 0x80000000}, {0xfa76, 0x52c7, 0x80000000},
    {0xfa77, 0x52fa, 0x80000000}, {0xfa78, 0x559d, 0x80000000}, {0xfa79, 0x5555, 0x80000000}, {0xfa7a, 0x5599, 0x80000000},
    {0xfa7b, 0x55e2, 0x80000000}, {0xfa7c, 0x585a, 0x80000000}, {0xfa7d, 0x58b3, 0x80000000}, {0xfa7e, 0x5944, 0x80000000},
    {0xfa7f, 0x5954, 0x80000000}, {0xfa80, 0x5a62, 0x80000000}, {0xfa81, 0x5b28, 0x80000000}, {0xfa82, 0x5ed2, 0x80000000},
    {0xfa83, 0x5ed9, 0x80000000}, {0xfa84, 0x5f69, 0x80000000}, {0xfa85, 0x5fad, 0x80000000}, {0xfa86, 0x60d8, 0x80000000},
    {0xfa87, 0x614e, 0x80000000}, {0xfa88, 0x6108, 0x80000000}, {0xfa89, 0x618e, 0x80000000}, {0xfa8a, 0x6160, 0x80000000},
    {0xfa8b, 0x61f2, 0x80000000}, {0xfa8c, 0x6234, 0x80000000}, {0xfa8d, 0x63c4, 0x80000000}, {0xfa8e, 0x641c, 0x80000000},
    {0xfa8f, 0x6452, 0x80000000}, {0xfa90, 0x6556, 0x80000000}, {0xfa91, 0x6674, 0x80000000}, {0xfa92, 0x6717, 0x80000000},
    {0xfa93, 0x671b, 0x80000000}, {0xfa94, 0x6756, 0x80000000}, {0xfa95, 0x6b79, 0x80000000}, {0xfa96, 0x6bba, 0x80000000},
    {0xfa97, 0x6d41, 0x80000000}, {0xfa98, 0x6edb, 0x80000000}, {0xfa99, 0x6ecb, 0x80000000}, {0xfa9a, 0x6f22, 0x80000000},
    {0xfa9b, 0x701e, 0x80000000}, {0xfa9c, 0x716e, 0x80000000}, {0xfa9d, 0x77a7, 0x80000000}, {0xfa9e, 0x7235, 0x80000000},
    {0xfa9f, 0x72af, 0x80000000}, {0xfaa0, 0x732a, 0x80000000}, {0xfaa1, 0x7471, 0x80000000}, {0xfaa2, 0x7506, 0x80000000},
    {0xfaa3, 0x753b, 0x80000000}, {0xfaa4, 0x761d, 0x80000000}, {0xfaa5, 0x761f, 0x80000000}, {0xfaa6, 0x76ca, 0x80000000},
    {0xfaa7, 0x76db, 0x80000000}, {0xfaa8, 0x76f4, 0x80000000}, {0xfaa9, 0x774a, 0x80000000}, {0xfaaa, 0x7740, 0x80000000},
    {0xfaab, 0x78cc, 0x80000000}, {0xfaac, 0x7ab1, 0x80000000}, {0xfaad, 0x7bc0, 0x80000000}, {0xfaae, 0x7c7b, 0x80000000},
    {0xfaaf, 0x7d5b, 0x80000000}, {0xfab0, 0x7df4, 0x80000000}, {0xfab1, 0x7f3e, 0x80000000}, {0xfab2, 0x8005, 0x80000000},
    {0xfab3, 0x8352, 0x80000000}, {0xfab4, 0x83ef, 0x80000000}, {0xfab5, 0x8779, 0x80000000}, {0xfab6, 0x8941, 0x80000000},
    {0xfab7, 0x8986, 0x80000000}, {0xfab8, 0x8996, 0x80000000}, {0xfab9, 0x8abf, 0x80000000}, {0xfaba, 0x8af8, 0x80000000},
    {0xfabb, 0x8acb, 0x80000000}, {0xfabc, 0x8b01, 0x80000000}, {0xfabd, 0x8afe, 0x80000000}, {0xfabe, 0x8aed, 0x80000000},
    {0xfabf, 0x8b39, 0x80000000}, {0xfac0, 0x8b8a, 0x80000000}, {0xfac1, 0x8d08, 0x80000000}, {0xfac2, 0x8f38, 0x80000000},
    {0xfac3, 0x9072, 0x80000000}, {0xfac4, 0x9199, 0x80000000}, {0xfac5, 0x9276, 0x80000000}, {0xfac6, 0x967c, 0x80000000},
    {0xfac7, 0x96e3, 0x80000000}, {0xfac8, 0x9756, 0x80000000}, {0xfac9, 0x97db, 0x80000000}, {0xfaca, 0x97ff, 0x80000000},
    {0xfacb, 0x980b, 0x80000000}, {0xfacc, 0x983b, 0x80000000}, {0xfacd, 0x9b12, 0x80000000}, {0xface, 0x9f9c, 0x80000000},
    {0xfacf, 0x2284a, 0x80000000}, {0xfad0, 0x22844, 0x80000000}, {0xfad1, 0x233d5, 0x80000000}, {0xfad2, 0x3b9d, 0x80000000},
    {0xfad3, 0x4018, 0x80000000}, {0xfad4, 0x4039, 0x80000000}, {0xfad5, 0x25249, 0x80000000}, {0xfad6, 0x25cd0, 0x80000000},
    {0xfad7, 0x27ed3, 0x80000000}, {0xfad8, 0x9f43, 0x80000000}, {0xfad9, 0x9f8e, 0x80000000}, {0xfb1d, 0x5d9, 0x800005b4},
    {0xfb1f, 0x5f2, 0x800005b7}, {0xfb2a, 0x5e9, 0x800005c1}, {0xfb2b, 0x5e9, 0x800005c2}, {0xfb2c, 0xfb49, 0x800005c1},
    {0xfb2d, 0xfb49, 0x800005c2}, {0xfb2e, 0x5d0, 0x800005b7}, {0xfb2f, 0x5d0, 0x800005b8}, {0xfb30, 0x5d0, 0x800005bc},
    {0xfb31, 0x5d1, 0x800005bc}, {0xfb32, 0x5d2, 0x800005bc}, {0xfb33, 0x5d3, 0x800005bc}, {0xfb34, 0x5d4, 0x800005bc},
    {0xfb35, 0x5d5, 0x800005bc}, {0xfb36, 0x5d6, 0x800005bc}, {0xfb38, 0x5d8, 0x800005bc}, {0xfb39, 0x5d9, 0x800005bc},
    {0xfb3a, 0x5da, 0x800005bc}, {0xfb3b, 0x5db, 0x800005bc}, {0xfb3c, 0x5dc, 0x800005bc}, {0xfb3e, 0x5de, 0x800005bc},
    {0xfb40, 0x5e0, 0x800005bc}, {0xfb41, 0x5e1, 0x800005bc}, {0xfb43, 0x5e3, 0x800005bc}, {0xfb44, 0x5e4, 0x800005bc},
    {0xfb46, 0x5e6, 0x800005bc}, {0xfb47, 0x5e7, 0x800005bc}, {0xfb48, 0x5e8, 0x800005bc}, {0xfb49, 0x5e9, 0x800005bc},
    {0xfb4a, 0x5ea, 0x800005bc}, {0xfb4b, 0x5d5, 0x800005b9}, {0xfb4c, 0x5d1, 0x800005bf}, {0xfb4d, 0x5db, 0x800005bf},
    {0xfb4e, 0x5e4, 0x800005bf}, {0x1109a, 0x11099, 0x110ba}, {0x1109c, 0x1109b, 0x110ba}, {0x110ab, 0x110a5, 0x110ba},
    {0x1112e, 0x11131, 0x11127}, {0x1112f, 0x11132, 0x11127}, {0x1134b, 0x11347, 0x1133e}, {0x1134c, 0x11347, 0x11357},
    {0x114bb, 0x114b9, 0x114ba}, {0x114bc, 0x114b9, 0x114b0}, {0x114be, 0x114b9, 0x114bd}, {0x115ba, 0x115b8, 0x115af},
    {0x115bb, 0x115b9, 0x115af}, {0x1d15e, 0x1d157, 0x8001d165}, {0x1d15f, 0x1d158, 0x8001d165}, {0x1d160, 0x1d15f, 0x8001d16e},
    {0x1d161, 0x1d15f, 0x8001d16f}, {0x1d162, 0x1d15f, 0x8001d170}, {0x1d163, 0x1d15f, 0x8001d171}, {0x1d164, 0x1d15f, 0x8001d172},
    {0x1d1bb, 0x1d1b9, 0x8001d165}, {0x1d1bc, 0x1d1ba, 0x8001d165}, {0x1d1bd, 0x1d1bb, 0x8001d16e}, {0x1d1be, 0x1d1bc, 0x8001d16e},
    {0x1d1bf, 0x1d1bb, 0x8001d16f}, {0x1d1c0, 0x1d1bc, 0x8001d16f}, {0x2f800, 0x4e3d, 0x80000000}, {0x2f801, 0x4e38, 0x80000000},
    {0x2f802, 0x4e41, 0x80000000}, {0x2f803, 0x20122, 0x80000000}, {0x2f804, 0x4f60, 0x80000000}, {0x2f805, 0x4fae, 0x80000000},
    {0x2f806, 0x4fbb, 0x80000000}, {0x2f807, 0x5002, 0x80000000}, {0x2f808, 0x507a, 0x80000000}, {0x2f809, 0x5099, 0x80000000},
    {0x2f80a, 0x50e7, 0x80000000}, {0x2f80b, 0x50cf, 0x80000000}, {0x2f80c, 0x349e, 0x80000000}, {0x2f80d, 0x2063a, 0x80000000},
    {0x2f80e, 0x514d, 0x80000000}, {0x2f80f, 0x5154, 0x80000000}, {0x2f810, 0x5164, 0x80000000}, {0x2f811, 0x5177, 0x80000000},
    {0x2f812, 0x2051c, 0x80000000}, {0x2f813, 0x34b9, 0x80000000}, {0x2f814, 0x5167, 0x80000000}, {0x2f815, 0x518d, 0x80000000},
    {0x2f816, 0x2054b, 0x80000000}, {0x2f817, 0x5197, 0x80000000}, {0x2f818, 0x51a4, 0x80000000}, {0x2f819, 0x4ecc, 0x80000000},
    {0x2f81a, 0x51ac, 0x80000000}, {0x2f81b, 0x51b5, 0x80000000}, {0x2f81c, 0x291df, 0x80000000}, {0x2f81d, 0x51f5, 0x80000000},
    {0x2f81e, 0x5203, 0x80000000}, {0x2f81f, 0x34df, 0x80000000}, {0x2f820, 0x523b, 0x80000000}, {0x2f821, 0x5246, 0x80000000},
    {0x2f822, 0x5272, 0x80000000}, {0x2f823, 0x5277, 0x80000000}, {0x2f824, 0x3515, 0x80000000}, {0x2f825, 0x52c7, 0x80000000},
    {0x2f826, 0x52c9, 0x80000000}, {0x2f827, 0x52e4, 0x80000000}, {0x2f828, 0x52fa, 0x80000000}, {0x2f829, 0x5305, 0x80000000},
    {0x2f82a, 0x5306, 0x80000000}, {0x2f82b, 0x5317, 0x80000000}, {0x2f82c, 0x5349, 0x80000000}, {0x2f82d, 0x5351, 0x80000000},
    {0x2f82e, 0x535a, 0x80000000}, {0x2f82f, 0x5373, 0x80000000}, {0x2f830, 0x537d, 0x80000000}, {0x2f831, 0x537f, 0x80000000},
    {0x2f832, 0x537f, 0x80000000}, {0x2f833, 0x537f, 0x80000000}, {0x2f834, 0x20a2c, 0x80000000}, {0x2f835, 0x7070, 0x80000000},
    {0x2f836, 0x53ca, 0x80000000}, {0x2f837, 0x53df, 0x80000000}, {0x2f838, 0x20b63, 0x80000000}, {0x2f839, 0x53eb, 0x80000000},
    {0x2f83a, 0x53f1, 0x80000000}, {0x2f83b, 0x5406, 0x80000000}, {0x2f83c, 0x549e, 0x80000000}, {0x2f83d, 0x5438, 0x80000000},
    {0x2f83e, 0x5448, 0x80000000}, {0x2f83f, 0x5468, 0x80000000}, {0x2f840, 0x54a2, 0x80000000}, {0x2f841, 0x54f6, 0x80000000},
    {0x2f842, 0x5510, 0x80000000}, {0x2f843, 0x5553, 0x80000000}, {0x2f844, 0x5563, 0x80000000}, {0x2f845, 0x5584, 0x80000000},
    {0x2f846, 0x5584, 0x80000000}, {0x2f847, 0x5599, 0x80000000}, {0x2f848, 0x55ab, 0x80000000}, {0x2f849, 0x55b3, 0x80000000},
    {0x2f84a, 0x55c2, 0x80000000}, {0x2f84b, 0x5716, 0x80000000}, {0x2f84c, 0x5606, 0x80000000}, {0x2f84d, 0x5717, 0x80000000},
    {0x2f84e, 0x5651, 0x80000000}, {0x2f84f, 0x5674, 0x80000000}, {0x2f850, 0x5207, 0x80000000}, {0x2f851, 0x58ee, 0x80000000},
    {0x2f852, 0x57ce, 0x80000000}, {0x2f853, 0x57f4, 0x80000000}, {0x2f854, 0x580d, 0x80000000}, {0x2f855, 0x578b, 0x80000000},
    {0x2f856, 0x5832, 0x80000000}, {0x2f857, 0x5831, 0x80000000}, {0x2f858, 0x58ac, 0x80000000}, {0x2f859, 0x214e4, 0x80000000},
    {0x2f85a, 0x58f2, 0x80000000}, {0x2f85b, 0x58f7, 0x80000000}, {0x2f85c, 0x5906, 0x80000000}, {0x2f85d, 0x591a, 0x80000000},
    {0x2f85e, 0x5922, 0x80000000}, {0x2f85f, 0x5962, 0x80000000}, {0x2f860, 0x216a8, 0x80000000}, {0x2f861, 0x216ea, 0x80000000},
    {0x2f862, 0x59ec, 0x80000000}, {0x2f863, 0x5a1b, 0x80000000}, {0x2f864, 0x5a27, 0x80000000}, {0x2f865, 0x59d8, 0x80000000},
    {0x2f866, 0x5a66, 0x80000000}, {0x2f867, 0x36ee, 0x80000000}, {0x2f868, 0x36fc, 0x80000000}, {0x2f869, 0x5b08, 0x80000000},
    {0x2f86a, 0x5b3e, 0x80000000}, {0x2f86b, 0x5b3e, 0x80000000}, {0x2f86c, 0x219c8, 0x80000000}, {0x2f86d, 0x5bc3, 0x80000000},
    {0x2f86e, 0x5bd8, 0x80000000}, {0x2f86f, 0x5be7, 0x80000000}, {0x2f870, 0x5bf3, 0x80000000}, {0x2f871, 0x21b18, 0x80000000},
    {0x2f872, 0x5bff, 0x80000000}, {0x2f873, 0x5c06, 0x80000000}, {0x2f874, 0x5f53, 0x80000000}, {0x2f875, 0x5c22, 0x80000000},
    {0x2f876, 0x3781, 0x80000000}, {0x2f877, 0x5c60, 0x80000000}, {0x2f878, 0x5c6e, 0x80000000}, {0x2f879, 0x5cc0, 0x80000000},
    {0x2f87a, 0x5c8d, 0x80000000}, {0x2f87b, 0x21de4, 0x80000000}, {0x2f87c, 0x5d43, 0x80000000}, {0x2f87d, 0x21de6, 0x80000000},
    {0x2f87e, 0x5d6e, 0x80000000}, {0x2f87f, 0x5d6b, 0x80000000}, {0x2f880, 0x5d7c, 0x80000000}, {0x2f881, 0x5de1, 0x80000000},
    {0x2f882, 0x5de2, 0x80000000}, {0x2f883, 0x382f, 0x80000000}, {0x2f884, 0x5dfd, 0x80000000}, {0x2f885, 0x5e28, 0x80000000},
    {0x2f886, 0x5e3d, 0x80000000}, {0x2f887, 0x5e69, 0x80000000}, {0x2f888, 0x3862, 0x80000000}, {0x2f889, 0x22183, 0x80000000},
    {0x2f88a, 0x387c, 0x80000000}, {0x2f88b, 0x5eb0, 0x80000000}, {0x2f88c, 0x5eb3, 0x80000000}, {0x2f88d, 0x5eb6, 0x80000000},
    {0x2f88e, 0x5eca, 0x80000000}, {0x2f88f, 0x2a392, 0x80000000}, {0x2f890, 0x5efe, 0x80000000}, {0x2f891, 0x22331, 0x80000000},
    {0x2f892, 0x22331, 0x80000000}, {0x2f893, 0x8201, 0x80000000}, {0x2f894, 0x5f22, 0x80000000}, {0x2f895, 0x5f22, 0x80000000},
    {0x2f896, 0x38c7, 0x80000000}, {0x2f897, 0x232b8, 0x80000000}, {0x2f898, 0x261da, 0x80000000}, {0x2f899, 0x5f62, 0x80000000},
    {0x2f89a, 0x5f6b, 0x80000000}, {0x2f89b, 0x38e3, 0x80000000}, {0x2f89c, 0x5f9a, 0x80000000}, {0x2f89d, 0x5fcd, 0x80000000},
    {0x2f89e, 0x5fd7, 0x80000000}, {0x2f89f, 0x5ff9, 0x80000000}, {0x2f8a0, 0x6081, 0x80000000}, {0x2f8a1, 0x393a, 0x80000000},
    {0x2f8a2, 0x391c, 0x80000000}, {0x2f8a3, 0x6094, 0x80000000}, {0x2f8a4, 0x226d4, 0x80000000}, {0x2f8a5, 0x60c7, 0x80000000},
    {0x2f8a6, 0x6148, 0x80000000}, {0x2f8a7, 0x614c, 0x80000000}, {0x2f8a8, 0x614e, 0x80000000}, {0x2f8a9, 0x614c, 0x80000000},
    {0x2f8aa, 0x617a, 0x80000000}, {0x2f8ab, 0x618e, 0x80000000}, {0x2f8ac, 0x61b2, 0x80000000}, {0x2f8ad, 0x61a4, 0x80000000},
    {0x2f8ae, 0x61af, 0x80000000}, {0x2f8af, 0x61de, 0x80000000}, {0x2f8b0, 0x61f2, 0x80000000}, {0x2f8b1, 0x61f6, 0x80000000},
    {0x2f8b2, 0x6210, 0x80000000}, {0x2f8b3, 0x621b, 0x80000000}, {0x2f8b4, 0x625d, 0x80000000}, {0x2f8b5, 0x62b1, 0x80000000},
    {0x2f8b6, 0x62d4, 0x80000000}, {0x2f8b7, 0x6350, 0x80000000}, {0x2f8b8, 0x22b0c, 0x80000000}, {0x2f8b9, 0x633d, 0x80000000},
    {0x2f8ba, 0x62fc, 0x80000000}, {0x2f8bb, 0x6368, 0x80000000}, {0x2f8bc, 0x6383, 0x80000000}, {0x2f8bd, 0x63e4, 0x80000000},
    {0x2f8be, 0x22bf1, 0x80000000}, {0x2f8bf, 0x6422, 0x80000000}, {0x2f8c0, 0x63c5, 0x80000000}, {0x2f8c1, 0x63a9, 0x80000000},
    {0x2f8c2, 0x3a2e, 0x80000000}, {0x2f8c3, 0x6469, 0x80000000}, {0x2f8c4, 0x647e, 0x80000000}, {0x2f8c5, 0x649d, 0x80000000},
    {0x2f8c6, 0x6477, 0x80000000}, {0x2f8c7, 0x3a6c, 0x80000000}, {0x2f8c8, 0x654f, 0x80000000}, {0x2f8c9, 0x656c, 0x80000000},
    {0x2f8ca, 0x2300a, 0x80000000}, {0x2f8cb, 0x65e3, 0x80000000}, {0x2f8cc, 0x66f8, 0x80000000}, {0x2f8cd, 0x6649, 0x80000000},
    {0x2f8ce, 0x3b19, 0x80000000}, {0x2f8cf, 0x6691, 0x80000000}, {0x2f8d0, 0x3b08, 0x80000000}, {0x2f8d1, 0x3ae4, 0x80000000},
    {0x2f8d2, 0x5192, 0x80000000}, {0x2f8d3, 0x5195, 0x80000000}, {0x2f8d4, 0x6700, 0x80000000}, {0x2f8d5, 0x669c, 0x80000000},
    {0x2f8d6, 0x80ad, 0x80000000}, {0x2f8d7, 0x43d9, 0x80000000}, {0x2f8d8, 0x6717, 0x80000000}, {0x2f8d9, 0x671b, 0x80000000},
    {0x2f8da, 0x6721, 0x80000000}, {0x2f8db, 0x675e, 0x80000000}, {0x2f8dc, 0x6753, 0x80000000}, {0x2f8dd, 0x233c3, 0x80000000},
    {0x2f8de, 0x3b49, 0x80000000}, {0x2f8df, 0x67fa, 0x80000000}, {0x2f8e0, 0x6785, 0x80000000}, {0x2f8e1, 0x6852, 0x80000000},
    {0x2f8e2, 0x6885, 0x80000000}, {0x2f8e3, 0x2346d, 0x80000000}, {0x2f8e4, 0x688e, 0x80000000}, {0x2f8e5, 0x681f, 0x80000000},
    {0x2f8e6, 0x6914, 0x80000000}, {0x2f8e7, 0x3b9d, 0x80000000}, {0x2f8e8, 0x6942, 0x80000000}, {0x2f8e9, 0x69a3, 0x80000000},
    {0x2f8ea, 0x69ea, 0x80000000}, {0x2f8eb, 0x6aa8, 0x80000000}, {0x2f8ec, 0x236a3, 0x80000000}, {0x2f8ed, 0x6adb, 0x80000000},
    {0x2f8ee, 0x3c18, 0x80000000}, {0x2f8ef, 0x6b21, 0x80000000}, {0x2f8f0, 0x238a7, 0x80000000}, {0x2f8f1, 0x6b54, 0x80000000},
    {0x2f8f2, 0x3c4e, 0x80000000}, {0x2f8f3, 0x6b72, 0x80000000}, {0x2f8f4, 0x6b9f, 0x80000000}, {0x2f8f5, 0x6bba, 0x80000000},
    {0x2f8f6, 0x6bbb, 0x80000000}, {0x2f8f7, 0x23a8d, 0x80000000}, {0x2f8f8, 0x21d0b, 0x80000000}, {0x2f8f9, 0x23afa, 0x80000000},
    {0x2f8fa, 0x6c4e, 0x80000000}, {0x2f8fb, 0x23cbc, 0x80000000}, {0x2f8fc, 0x6cbf, 0x80000000}, {0x2f8fd, 0x6ccd, 0x80000000},
    {0x2f8fe, 0x6c67, 0x80000000}, {0x2f8ff, 0x6d16, 0x80000000}, {0x2f900, 0x6d3e, 0x80000000}, {0x2f901, 0x6d77, 0x80000000},
    {0x2f902, 0x6d41, 0x80000000}, {0x2f903, 0x6d69, 0x80000000}, {0x2f904, 0x6d78, 0x80000000}, {0x2f905, 0x6d85, 0x80000000},
    {0x2f906, 0x23d1e, 0x80000000}, {0x2f907, 0x6d34, 0x80000000}, {0x2f908, 0x6e2f, 0x80000000}, {0x2f909, 0x6e6e, 0x80000000},
    {0x2f90a, 0x3d33, 0x80000000}, {0x2f90b, 0x6ecb, 0x80000000}, {0x2f90c, 0x6ec7, 0x80000000}, {0x2f90d, 0x23ed1, 0x80000000},
    {0x2f90e, 0x6df9, 0x80000000}, {0x2f90f, 0x6f6e, 0x80000000}, {0x2f910, 0x23f5e, 0x80000000}, {0x2f911, 0x23f8e, 0x80000000},
    {0x2f912, 0x6fc6, 0x80000000}, {0x2f913, 0x7039, 0x80000000}, {0x2f914, 0x701e, 0x80000000}, {0x2f915, 0x701b, 0x80000000},
    {0x2f916, 0x3d96, 0x80000000}, {0x2f917, 0x704a, 0x80000000}, {0x2f918, 0x707d, 0x80000000}, {0x2f919, 0x7077, 0x80000000},
    {0x2f91a, 0x70ad, 0x80000000}, {0x2f91b, 0x20525, 0x80000000}, {0x2f91c, 0x7145, 0x80000000}, {0x2f91d, 0x24263, 0x80000000},
    {0x2f91e, 0x719c, 0x80000000}, {0x2f91f, 0x243ab, 0x80000000}, {0x2f920, 0x7228, 0x80000000}, {0x2f921, 0x7235, 0x80000000},
    {0x2f922, 0x7250, 0x80000000}, {0x2f923, 0x24608, 0x80000000}, {0x2f924, 0x7280, 0x80000000}, {0x2f925, 0x7295, 0x80000000},
    {0x2f926, 0x24735, 0x80000000}, {0x2f927, 0x24814, 0x80000000}, {0x2f928, 0x737a, 0x80000000}, {0x2f929, 0x738b, 0x80000000},
    {0x2f92a, 0x3eac, 0x80000000}, {0x2f92b, 0x73a5, 0x80000000}, {0x2f92c, 0x3eb8, 0x80000000}, {0x2f92d, 0x3eb8, 0x80000000},
    {0x2f92e, 0x7447, 0x80000000}, {0x2f92f, 0x745c, 0x80000000}, {0x2f930, 0x7471, 0x80000000}, {0x2f931, 0x7485, 0x80000000},
    {0x2f932, 0x74ca, 0x80000000}, {0x2f933, 0x3f1b, 0x80000000}, {0x2f934, 0x7524, 0x80000000}, {0x2f935, 0x24c36, 0x80000000},
    {0x2f936, 0x753e, 0x80000000}, {0x2f937, 0x24c92, 0x80000000}, {0x2f938, 0x7570, 0x80000000}, {0x2f939, 0x2219f, 0x80000000},
    {0x2f93a, 0x7610, 0x80000000}, {0x2f93b, 0x24fa1, 0x80000000}, {0x2f93c, 0x24fb8, 0x80000000}, {0x2f93d, 0x25044, 0x80000000},
    {0x2f93e, 0x3ffc, 0x80000000}, {0x2f93f, 0x4008, 0x80000000}, {0x2f940, 0x76f4, 0x80000000}, {0x2f941, 0x250f3, 0x80000000},
    {0x2f942, 0x250f2, 0x80000000}, {0x2f943, 0x25119, 0x80000000}, {0x2f944, 0x25133, 0x80000000}, {0x2f945, 0x771e, 0x80000000},
    {0x2f946, 0x771f, 0x80000000}, {0x2f947, 0x771f, 0x80000000}, {0x2f948, 0x774a, 0x80000000}, {0x2f949, 0x4039, 0x80000000},
    {0x2f94a, 0x778b, 0x80000000}, {0x2f94b, 0x4046, 0x80000000}, {0x2f94c, 0x4096, 0x80000000}, {0x2f94d, 0x2541d, 0x80000000},
    {0x2f94e, 0x784e, 0x80000000}, {0x2f94f, 0x788c, 0x80000000}, {0x2f950, 0x78cc, 0x80000000}, {0x2f951, 0x40e3, 0x80000000},
    {0x2f952, 0x25626, 0x80000000}, {0x2f953, 0x7956, 0x80000000}, {0x2f954, 0x2569a, 0x80000000}, {0x2f955, 0x256c5, 0x80000000},
    {0x2f956, 0x798f, 0x80000000}, {0x2f957, 0x79eb, 0x80000000}, {0x2f958, 0x412f, 0x80000000}, {0x2f959, 0x7a40, 0x80000000},
    {0x2f95a, 0x7a4a, 0x80000000}, {0x2f95b, 0x7a4f, 0x80000000}, {0x2f95c, 0x2597c, 0x80000000}, {0x2f95d, 0x25aa7, 0x80000000},
    {0x2f95e, 0x25aa7, 0x80000000}, {0x2f95f, 0x7aee, 0x80000000}, {0x2f960, 0x4202, 0x80000000}, {0x2f961, 0x25bab, 0x80000000},
    {0x2f962, 0x7bc6, 0x80000000}, {0x2f963, 0x7bc9, 0x80000000}, {0x2f964, 0x4227, 0x80000000}, {0x2f965, 0x25c80, 0x80000000},
    {0x2f966, 0x7cd2, 0x80000000}, {0x2f967, 0x42a0, 0x80000000}, {0x2f968, 0x7ce8, 0x80000000}, {0x2f969, 0x7ce3, 0x80000000},
    {0x2f96a, 0x7d00, 0x80000000}, {0x2f96b, 0x25f86, 0x80000000}, {0x2f96c, 0x7d63, 0x80000000}, {0x2f96d, 0x4301, 0x80000000},
    {0x2f96e, 0x7dc7, 0x80000000}, {0x2f96f, 0x7e02, 0x80000000}, {0x2f970, 0x7e45, 0x80000000}, {0x2f971, 0x4334, 0x80000000},
    {0x2f972, 0x26228, 0x80000000}, {0x2f973, 0x26247, 0x80000000}, {0x2f974, 0x4359, 0x80000000}, {0x2f975, 0x262d9, 0x80000000},
    {0x2f976, 0x7f7a, 0x80000000}, {0x2f977, 0x2633e, 0x80000000}, {0x2f978, 0x7f95, 0x80000000}, {0x2f979, 0x7ffa, 0x80000000},
    {0x2f97a, 0x8005, 0x80000000}, {0x2f97b, 0x264da, 0x80000000}, {0x2f97c, 0x26523, 0x80000000}, {0x2f97d, 0x8060, 0x80000000},
    {0x2f97e, 0x265a8, 0x80000000}, {0x2f97f, 0x8070, 0x80000000}, {0x2f980, 0x2335f, 0x80000000}, {0x2f981, 0x43d5, 0x80000000},
    {0x2f982, 0x80b2, 0x80000000}, {0x2f983, 0x8103, 0x80000000}, {0x2f984, 0x440b, 0x80000000}, {0x2f985, 0x813e, 0x80000000},
    {0x2f986, 0x5ab5, 0x80000000}, {0x2f987, 0x267a7, 0x80000000}, {0x2f988, 0x267b5, 0x80000000}, {0x2f989, 0x23393, 0x80000000},
    {0x2f98a, 0x2339c, 0x80000000}, {0x2f98b, 0x8201, 0x80000000}, {0x2f98c, 0x8204, 0x80000000}, {0x2f98d, 0x8f9e, 0x80000000},
    {0x2f98e, 0x446b, 0x80000000}, {0x2f98f, 0x8291, 0x80000000}, {0x2f990, 0x828b, 0x80000000}, {0x2f991, 0x829d, 0x80000000},
    {0x2f992, 0x52b3, 0x80000000}, {0x2f993, 0x82b1, 0x80000000}, {0x2f994, 0x82b3, 0x80000000}, {0x2f995, 0x82bd, 0x80000000},
    {0x2f996, 0x82e6, 0x80000000}, {0x2f997, 0x26b3c, 0x80000000}, {0x2f998, 0x82e5, 0x80000000}, {0x2f999, 0x831d, 0x80000000},
    {0x2f99a, 0x8363, 0x80000000}, {0x2f99b, 0x83ad, 0x80000000}, {0x2f99c, 0x8323, 0x80000000}, {0x2f99d, 0x83bd, 0x80000000},
    {0x2f99e, 0x83e7, 0x80000000}, {0x2f99f, 0x8457, 0x80000000}, {0x2f9a0, 0x8353, 0x80000000}, {0x2f9a1, 0x83ca, 0x80000000},
    {0x2f9a2, 0x83cc, 0x80000000}, {0x2f9a3, 0x83dc, 0x80000000}, {0x2f9a4, 0x26c36, 0x80000000}, {0x2f9a5, 0x26d6b, 0x80000000},
    {0x2f9a6, 0x26cd5, 0x80000000}, {0x2f9a7, 0x452b, 0x80000000}, {0x2f9a8, 0x84f1, 0x80000000}, {0x2f9a9, 0x84f3, 0x80000000},
    {0x2f9aa, 0x8516, 0x80000000}, {0x2f9ab, 0x273ca, 0x80000000}, {0x2f9ac, 0x8564, 0x80000000}, {0x2f9ad, 0x26f2c, 0x80000000},
    {0x2f9ae, 0x455d, 0x80000000}, {0x2f9af, 0x4561, 0x80000000}, {0x2f9b0, 0x26fb1, 0x80000000}, {0x2f9b1, 0x270d2, 0x80000000},
    {0x2f9b2, 0x456b, 0x80000000}, {0x2f9b3, 0x8650, 0x80000000}, {0x2f9b4, 0x865c, 0x80000000}, {0x2f9b5, 0x8667, 0x80000000},
    {0x2f9b6, 0x8669, 0x80000000}, {0x2f9b7, 0x86a9, 0x80000000}, {0x2f9b8, 0x8688, 0x80000000}, {0x2f9b9, 0x870e, 0x80000000},
    {0x2f9ba, 0x86e2, 0x80000000}, {0x2f9bb, 0x8779, 0x80000000}, {0x2f9bc, 0x8728, 0x80000000}, {0x2f9bd, 0x876b, 0x80000000},
    {0x2f9be, 0x8786, 0x80000000}, {0x2f9bf, 0x45d7, 0x80000000}, {0x2f9c0, 0x87e1, 0x80000000}, {0x2f9c1, 0x8801, 0x80000000},
    {0x2f9c2, 0x45f9, 0x80000000}, {0x2f9c3, 0x8860, 0x80000000}, {0x2f9c4, 0x8863, 0x80000000}, {0x2f9c5, 0x27667, 0x80000000},
    {0x2f9c6, 0x88d7, 0x80000000}, {0x2f9c7, 0x88de, 0x80000000}, {0x2f9c8, 0x4635, 0x80000000}, {0x2f9c9, 0x88fa, 0x80000000},
    {0x2f9ca, 0x34bb, 0x80000000}, {0x2f9cb, 0x278ae, 0x80000000}, {0x2f9cc, 0x27966, 0x80000000}, {0x2f9cd, 0x46be, 0x80000000},
    {0x2f9ce, 0x46c7, 0x80000000}, {0x2f9cf, 0x8aa0, 0x80000000}, {0x2f9d0, 0x8aed, 0x80000000}, {0x2f9d1, 0x8b8a, 0x80000000},
    {0x2f9d2, 0x8c55, 0x80000000}, {0x2f9d3, 0x27ca8, 0x80000000}, {0x2f9d4, 0x8cab, 0x80000000}, {0x2f9d5, 0x8cc1, 0x80000000},
    {0x2f9d6, 0x8d1b, 0x80000000}, {0x2f9d7, 0x8d77, 0x80000000}, {0x2f9d8, 0x27f2f, 0x80000000}, {0x2f9d9, 0x20804, 0x80000000},
    {0x2f9da, 0x8dcb, 0x80000000}, {0x2f9db, 0x8dbc, 0x80000000}, {0x2f9dc, 0x8df0, 0x80000000}, {0x2f9dd, 0x208de, 0x80000000},
    {0x2f9de, 0x8ed4, 0x80000000}, {0x2f9df, 0x8f38, 0x80000000}, {0x2f9e0, 0x285d2, 0x80000000}, {0x2f9e1, 0x285ed, 0x80000000},
    {0x2f9e2, 0x9094, 0x80000000}, {0x2f9e3, 0x90f1, 0x80000000}, {0x2f9e4, 0x9111, 0x80000000}, {0x2f9e5, 0x2872e, 0x80000000},
    {0x2f9e6, 0x911b, 0x80000000}, {0x2f9e7, 0x9238, 0x80000000}, {0x2f9e8, 0x92d7, 0x80000000}, {0x2f9e9, 0x92d8, 0x80000000},
    {0x2f9ea, 0x927c, 0x80000000}, {0x2f9eb, 0x93f9, 0x80000000}, {0x2f9ec, 0x9415, 0x80000000}, {0x2f9ed, 0x28bfa, 0x80000000},
    {0x2f9ee, 0x958b, 0x80000000}, {0x2f9ef, 0x4995, 0x80000000}, {0x2f9f0, 0x95b7, 0x80000000}, {0x2f9f1, 0x28d77, 0x80000000},
    {0x2f9f2, 0x49e6, 0x80000000}, {0x2f9f3, 0x96c3, 0x80000000}, {0x2f9f4, 0x5db2, 0x80000000}, {0x2f9f5, 0x9723, 0x80000000},
    {0x2f9f6, 0x29145, 0x80000000}, {0x2f9f7, 0x2921a, 0x80000000}, {0x2f9f8, 0x4a6e, 0x80000000}, {0x2f9f9, 0x4a76, 0x80000000},
    {0x2f9fa, 0x97e0, 0x80000000}, {0x2f9fb, 0x2940a, 0x80000000}, {0x2f9fc, 0x4ab2, 0x80000000}, {0x2f9fd, 0x29496, 0x80000000},
    {0x2f9fe, 0x980b, 0x80000000}, {0x2f9ff, 0x980b, 0x80000000}, {0x2fa00, 0x9829, 0x80000000}, {0x2fa01, 0x295b6, 0x80000000},
    {0x2fa02, 0x98e2, 0x80000000}, {0x2fa03, 0x4b33, 0x80000000}, {0x2fa04, 0x9929, 0x80000000}, {0x2fa05, 0x99a7, 0x80000000},
    {0x2fa06, 0x99c2, 0x80000000}, {0x2fa07, 0x99fe, 0x80000000}, {0x2fa08, 0x4bce, 0x80000000}, {0x2fa09, 0x29b30, 0x80000000},
    {0x2fa0a, 0x9b12, 0x80000000}, {0x2fa0b, 0x9c40, 0x80000000}, {0x2fa0c, 0x9cfd, 0x80000000}, {0x2fa0d, 0x4cce, 0x80000000},
    {0x2fa0e, 0x4ced, 0x80000000}, {0x2fa0f, 0x9d67, 0x80000000}, {0x2fa10, 0x2a0ce, 0x80000000}, {0x2fa11, 0x4cf8, 0x80000000},
    {0x2fa12, 0x2a105, 0x80000000}, {0x2fa13, 0x2a20e, 0x80000000}, {0x2fa14, 0x2a291, 0x80000000}, {0x2fa15, 0x9ebb, 0x80000000},
    {0x2fa16, 0x4d56, 0x80000000}, {0x2fa17, 0x9ef9, 0x80000000}, {0x2fa18, 0x9efe, 0x80000000}, {0x2fa19, 0x9f05, 0x80000000},
    {0x2fa1a, 0x9f0f, 0x80000000}, {0x2fa1b, 0x9f16, 0x80000000}, {0x2fa1c, 0x9f3b, 0x80000000}, {0x2fa1d, 0x2a600, 0x80000000},
};

// [first, last] pairs, flattened.
inline constexpr std::uint32_t kNfcCheck[494] = {
    0x300, 0x34e, 0x350, 0x36f, 0x374, 0x374, 0x37e, 0x37e,
    0x387, 0x387, 0x483, 0x487, 0x591, 0x5bd, 0x5bf, 0x5bf,
    0x5c1, 0x5c2, 0x5c4, 0x5c5, 0x5c7, 0x5c7, 0x610, 0x61a,
    0x64b, 0x65f, 0x670, 0x670, 0x6d6, 0x6dc, 0x6df, 0x6e4,
    0x6e7, 0x6e8, 0x6ea, 0x6ed, 0x711, 0x711, 0x730, 0x74a,
    0x7eb, 0x7f3, 0x816, 0x819, 0x81b, 0x823, 0x825, 0x827,
    0x829, 0x82d, 0x859, 0x85b, 0x8d4, 0x8e1, 0x8e3, 0x8ff,
    0x93c, 0x93c, 0x94d, 0x94d, 0x951, 0x954, 0x958, 0x95f,
    0x9bc, 0x9bc, 0x9be, 0x9be, 0x9cd, 0x9cd, 0x9d7, 0x9d7,
    0x9dc, 0x9dd, 0x9df, 0x9df, 0xa33, 0xa33, 0xa36, 0xa36,
    0xa3c, 0xa3c, 0xa4d, 0xa4d, 0xa59, 0xa5b, 0xa5e, 0xa5e,
    0xabc, 0xabc, 0xacd, 0xacd, 0xb3c, 0xb3c, 0xb3e, 0xb3e,
    0xb4d, 0xb4d, 0xb56, 0xb57, 0xb5c, 0xb5d, 0xbbe, 0xbbe,
    0xbcd, 0xbcd, 0xbd7, 0xbd7, 0xc4d, 0xc4d, 0xc55, 0xc56,
    0xcbc, 0xcbc, 0xcc2, 0xcc2, 0xccd, 0xccd, 0xcd5, 0xcd6,
    0xd3e, 0xd3e, 0xd4d, 0xd4d, 0xd57, 0xd57, 0xdca, 0xdca,
    0xdcf, 0xdcf, 0xddf, 0xddf, 0xe38, 0xe3a, 0xe48, 0xe4b,
    0xeb8, 0xeb9, 0xec8, 0xecb, 0xf18, 0xf19, 0xf35, 0xf35,
    0xf37, 0xf37, 0xf39, 0xf39, 0xf43, 0xf43, 0xf4d, 0xf4d,
    0xf52, 0xf52, 0xf57, 0xf57, 0xf5c, 0xf5c, 0xf69, 0xf69,
    0xf71, 0xf76, 0xf78, 0xf78, 0xf7a, 0xf7d, 0xf80, 0xf84,
    0xf86, 0xf87, 0xf93, 0xf93, 0xf9d, 0xf9d, 0xfa2, 0xfa2,
    0xfa7, 0xfa7, 0xfac, 0xfac, 0xfb9, 0xfb9, 0xfc6, 0xfc6,
    0x102e, 0x102e, 0x1037, 0x1037, 0x1039, 0x103a, 0x108d, 0x108d,
    0x1161, 0x1175, 0x11a8, 0x11c2, 0x135d, 0x135f, 0x1714, 0x1714,
    0x1734, 0x1734, 0x17d2, 0x17d2, 0x17dd, 0x17dd, 0x18a9, 0x18a9,
    0x1939, 0x193b, 0x1a17, 0x1a18, 0x1a60, 0x1a60, 0x1a75, 0x1a7c,
    0x1a7f, 0x1a7f, 0x1ab0, 0x1abd, 0x1b34, 0x1b35, 0x1b44, 0x1b44,
    0x1b6b, 0x1b73, 0x1baa, 0x1bab, 0x1be6, 0x1be6, 0x1bf2, 0x1bf3,
    0x1c37, 0x1c37, 0x1cd0, 0x1cd2, 0x1cd4, 0x1ce0, 0x1ce2, 0x1ce8,
    0x1ced, 0x1ced, 0x1cf4, 0x1cf4, 0x1cf8, 0x1cf9, 0x1dc0, 0x1df5,
    0x1dfb, 0x1dff, 0x1f71, 0x1f71, 0x1f73, 0x1f73, 0x1f75, 0x1f75,
    0x1f77, 0x1f77, 0x1f79, 0x1f79, 0x1f7b, 0x1f7b, 0x1f7d, 0x1f7d,
    0x1fbb, 0x1fbb, 0x1fbe, 0x1fbe, 0x1fc9, 0x1fc9, 0x1fcb, 0x1fcb,
    0x1fd3, 0x1fd3, 0x1fdb, 0x1fdb, 0x1fe3, 0x1fe3, 0x1feb, 0x1feb,
    0x1fee, 0x1fef, 0x1ff9, 0x1ff9, 0x1ffb, 0x1ffb, 0x1ffd, 0x1ffd,
    0x2000, 0x2001, 0x20d0, 0x20dc, 0x20e1, 0x20e1, 0x20e5, 0x20f0,
    0x2126, 0x2126, 0x212a, 0x212b, 0x2329, 0x232a, 0x2adc, 0x2adc,
    0x2cef, 0x2cf1, 0x2d7f, 0x2d7f, 0x2de0, 0x2dff, 0x302a, 0x302f,
    0x3099, 0x309a, 0xa66f, 0xa66f, 0xa674, 0xa67d, 0xa69e, 0xa69f,
    0xa6f0, 0xa6f1, 0xa806, 0xa806, 0xa8c4, 0xa8c4, 0xa8e0, 0xa8f1,
    0xa92b, 0xa92d, 0xa953, 0xa953, 0xa9b3, 0xa9b3, 0xa9c0, 0xa9c0,
    0xaab0, 0xaab0, 0xaab2, 0xaab4, 0xaab7, 0xaab8, 0xaabe, 0xaabf,
    0xaac1, 0xaac1, 0xaaf6, 0xaaf6, 0xabed, 0xabed, 0xf900, 0xfa0d,
    0xfa10, 0xfa10, 0xfa12, 0xfa12, 0xfa15, 0xfa1e, 0xfa20, 0xfa20,
    0xfa22, 0xfa22, 0xfa25, 0xfa26, 0xfa2a, 0xfa6d, 0xfa70, 0xfad9,
    0xfb1d, 0xfb1f, 0xfb2a, 0xfb36, 0xfb38, 0xfb3c, 0xfb3e, 0xfb3e,
    0xfb40, 0xfb41, 0xfb43, 0xfb44, 0xfb46, 0xfb4e, 0xfe20, 0xfe2f,
    0x101fd, 0x101fd, 0x102e0, 0x102e0, 0x10376, 0x1037a, 0x10a0d, 0x10a0d,
    0x10a0f, 0x10a0f, 0x10a38, 0x10a3a, 0x10a3f, 0x10a3f, 0x10ae5, 0x10ae6,
    0x11046, 0x11046, 0x1107f, 0x1107f, 0x110b9, 0x110ba, 0x11100, 0x11102,
    0x11127, 0x11127, 0x11133, 0x11134, 0x11173, 0x11173, 0x111c0, 0x111c0,
    0x111ca, 0x111ca, 0x11235, 0x11236, 0x112e9, 0x112ea, 0x1133c, 0x1133c,
    0x1133e, 0x1133e, 0x1134d, 0x1134d, 0x11357, 0x11357, 0x11366, 0x1136c,
    0x11370, 0x11374, 0x11442, 0x11442, 0x11446, 0x11446, 0x114b0, 0x114b0,
    0x114ba, 0x114ba, 0x114bd, 0x114bd, 0x114c2, 0x114c3, 0x115af, 0x115af,
    0x115bf, 0x115c0, 0x1163f, 0x1163f, 0x116b6, 0x116b7, 0x1172b, 0x1172b,
    0x11c3f, 0x11c3f, 0x16af0, 0x16af4, 0x16b30, 0x16b36, 0x1bc9e, 0x1bc9e,
    0x1d15e, 0x1d169, 0x1d16d, 0x1d172, 0x1d17b, 0x1d182, 0x1d185, 0x1d18b,
    0x1d1aa, 0x1d1ad, 0x1d1bb, 0x1d1c0, 0x1d242, 0x1d244, 0x1e000, 0x1e006,
    0x1e008, 0x1e018, 0x1e01b, 0x1e021, 0x1e023, 0x1e024, 0x1e026, 0x1e02a,
    0x1e8d0, 0x1e8d6, 0x1e944, 0x1e94a, 0x2f800, 0x2fa1d,
};

}  // namespace nn::lm::detail
// ---- end nn/lm/unicode_data.hpp ----

namespace nn::lm {

/// Unicode general categories, in the order of the generated tables (tests/oracle/
/// gen_unicode_tables.py).
enum class Gc : std::uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps,
  Pe, Pi, Pf, Po, Sm, Sc, Sk, So, Zs, Zl, Zp, Cc, Cf, Cs, Co
};
inline constexpr int kGcCount = 30;

namespace detail {

// ASCII categories, so plain English and code never reach the binary search.
inline constexpr std::uint8_t kAsciiGc[128] = {
    26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26,  // controls
    26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26,
    23, 18, 18, 18, 20, 18, 18, 18, 14, 15, 18, 19, 18, 13, 18, 18,  //  !"#$%&'()*+,-./
    9,  9,  9,  9,  9,  9,  9,  9,  9,  9,  18, 18, 19, 19, 19, 18,  // 0-9 :;<=>?
    18, 1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,   // @ A-O
    1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  14, 18, 15, 21, 12,  // P-Z [\]^_
    21, 2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,   // ` a-o
    2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  14, 19, 15, 19, 26,  // p-z {|}~ DEL
};

}  // namespace detail

/// The general category of a code point (Cn for unassigned and for anything past U+10FFFF).
inline Gc general_category(char32_t c) {
  if (c < 128) return static_cast<Gc>(detail::kAsciiGc[c]);
  if (c > 0x10FFFF) return Gc::Cn;
  const std::uint32_t key = (static_cast<std::uint32_t>(c) << 5) | 31u;
  const auto* end = std::end(detail::kGcRuns);
  const auto* it = std::upper_bound(std::begin(detail::kGcRuns), end, key);
  return static_cast<Gc>(*(it - 1) & 31u);
}

inline bool is_letter(Gc g) { return g >= Gc::Lu && g <= Gc::Lo; }
inline bool is_mark(Gc g) { return g >= Gc::Mn && g <= Gc::Me; }
inline bool is_number(Gc g) { return g >= Gc::Nd && g <= Gc::No; }

/// Oniguruma's \s under Unicode (and the White_Space property): \t..\r, U+0085 and the
/// separators Zs, Zl, Zp.
inline bool is_whitespace(char32_t c, Gc g) {
  return (c >= 9 && c <= 13) || c == 0x85 || g == Gc::Zs || g == Gc::Zl || g == Gc::Zp;
}
inline bool is_whitespace(char32_t c) { return is_whitespace(c, general_category(c)); }

/// Stands for a byte that is not part of valid UTF-8: pre-tokenization sees one "other"
/// character and the byte itself still reaches byte-level BPE, so nothing is lost.
inline constexpr char32_t kInvalidByte = 0xFFFFFFFFu;

/// Decodes one code point at s[i], advancing i. Overlong forms, surrogates and values past
/// U+10FFFF are invalid: one byte is consumed and kInvalidByte returned.
inline char32_t utf8_next(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  auto cont = [&](std::size_t k) {
    return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
  };
  auto cb = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  if (b0 >= 0xC2 && b0 < 0xE0 && cont(1)) {
    char32_t c = ((b0 & 0x1Fu) << 6) | cb(1);
    i += 2;
    return c;
  }
  if (b0 >= 0xE0 && b0 < 0xF0 && cont(1) && cont(2)) {
    char32_t c = ((b0 & 0x0Fu) << 12) | (cb(1) << 6) | cb(2);
    if (c >= 0x800 && (c < 0xD800 || c > 0xDFFF)) {
      i += 3;
      return c;
    }
  }
  if (b0 >= 0xF0 && b0 < 0xF5 && cont(1) && cont(2) && cont(3)) {
    char32_t c = ((b0 & 0x07u) << 18) | (cb(1) << 12) | (cb(2) << 6) | cb(3);
    if (c >= 0x10000 && c <= 0x10FFFF) {
      i += 4;
      return c;
    }
  }
  ++i;
  return kInvalidByte;
}

inline void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

/// Replaces every maximal invalid subsequence with U+FFFD, exactly as Rust's
/// String::from_utf8_lossy (and so Hugging Face's decode) does.
inline std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      out += static_cast<char>(b0);
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (Unicode Table 3-7).
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
    else if (b0 == 0xE0) need = 2, lo = 0xA0;
    else if (b0 >= 0xE1 && b0 <= 0xEC) need = 2;
    else if (b0 == 0xED) need = 2, hi = 0x9F;
    else if (b0 >= 0xEE && b0 <= 0xEF) need = 2;
    else if (b0 == 0xF0) need = 3, lo = 0x90;
    else if (b0 >= 0xF1 && b0 <= 0xF3) need = 3;
    else if (b0 == 0xF4) need = 3, hi = 0x8F;
    if (need == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    std::size_t k = 1;
    for (; k <= need; ++k) {
      if (i + k >= s.size()) break;
      const auto b = static_cast<unsigned char>(s[i + k]);
      const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
      if (b < l || b > h) break;
    }
    if (k > need) {
      out.append(s.substr(i, need + 1));
      i += need + 1;
    } else {
      out += "\xEF\xBF\xBD";  // the maximal subpart s[i, i+k) is one replacement
      i += k;
    }
  }
  return out;
}

/// Length of the longest prefix of `s` that does not end inside an incomplete (but so far
/// valid) UTF-8 sequence; a streaming decoder prints that much and keeps the rest for later.
inline std::size_t utf8_complete_prefix(std::string_view s) {
  const std::size_t n = s.size();
  for (std::size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<unsigned char>(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    std::size_t len = b >= 0xF0 && b < 0xF5 ? 4 : b >= 0xE0 ? 3 : b >= 0xC2 && b < 0xE0 ? 2 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

// ---- NFC (Unicode Standard Annex #15) --------------------------------------------------------

namespace detail {

inline constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
inline constexpr int kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                     kSCount = kLCount * kNCount;

inline std::uint8_t ccc(char32_t c) {
  if (c < 0x300) return 0;
  const auto* b = std::begin(kCccRuns);
  const auto* e = std::end(kCccRuns);
  const auto* it = std::upper_bound(b, e, c, [](char32_t v, const CccRange& r) { return v < r.first; });
  if (it == b) return 0;
  --it;
  return c <= it->last ? it->ccc : 0;
}

inline const Decomp* find_decomp(char32_t c) {
  const auto* b = std::begin(kDecomp);
  const auto* e = std::end(kDecomp);
  const auto* it = std::lower_bound(b, e, c, [](const Decomp& d, char32_t v) { return d.cp < v; });
  return it != e && it->cp == c ? it : nullptr;
}

inline bool nfc_maybe_unstable(char32_t c) {
  if (c < 0x300) return false;
  const auto* b = std::begin(kNfcCheck);
  const auto* e = std::end(kNfcCheck);
  const auto idx = static_cast<std::size_t>(std::upper_bound(b, e, static_cast<std::uint32_t>(c)) - b);
  // Inside a [first, last] pair when an odd number of bounds are <= c, or c equals a `last`.
  if (idx % 2 == 1) return true;
  return idx > 0 && kNfcCheck[idx - 1] == c;
}

inline void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSBase && c < kSBase + static_cast<char32_t>(kSCount)) {
    const char32_t s = c - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const Decomp* d = find_decomp(c)) {
    decompose(d->first, out);
    if (d->second & 0x7FFFFFFFu) decompose(d->second & 0x7FFFFFFFu, out);
    return;
  }
  out.push_back(c);
}

/// The primary composite of (a, b), or 0.
inline char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + static_cast<char32_t>(kSCount) && (a - kSBase) % kTCount == 0 &&
      b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  // The composition table is small (~940 pairs); a sorted copy keyed by (a, b) is built once.
  struct Pair { std::uint64_t key; char32_t c; };
  static const std::vector<Pair> pairs = [] {
    std::vector<Pair> v;
    for (const Decomp& d : kDecomp)
      if (!(d.second & 0x80000000u) && d.second)
        v.push_back({(static_cast<std::uint64_t>(d.first) << 32) | d.second, d.cp});
    std::sort(v.begin(), v.end(), [](const Pair& x, const Pair& y) { return x.key < y.key; });
    return v;
  }();
  const std::uint64_t key = (static_cast<std::uint64_t>(a) << 32) | b;
  auto it = std::lower_bound(pairs.begin(), pairs.end(), key, [](const Pair& p, std::uint64_t k) { return p.key < k; });
  return it != pairs.end() && it->key == key ? it->c : 0;
}

}  // namespace detail

/// True when NFC would leave `s` unchanged for certain (the quick check: no character that
/// is not NFC-stable or carries a combining class). Most text passes and skips the work.
inline bool nfc_quick_check(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0xCC) {  // every code point below U+0300 is stable
      ++i;
      if (static_cast<unsigned char>(s[i - 1]) >= 0x80)
        while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
      continue;
    }
    const char32_t c = utf8_next(s, i);
    if (c != kInvalidByte && detail::nfc_maybe_unstable(c)) return false;
  }
  return true;
}

/// Unicode Normalization Form C. Invalid UTF-8 bytes are kept as they are.
inline std::string nfc(std::string_view s) {
  if (nfc_quick_check(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  std::vector<char32_t> buf;  // the decomposed text since the last invalid byte
  auto flush = [&] {
    // Canonical ordering: stable sort of each run of nonzero combining classes.
    for (std::size_t i = 0; i < buf.size();) {
      if (detail::ccc(buf[i]) == 0) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < buf.size() && detail::ccc(buf[j]) != 0) ++j;
      std::stable_sort(buf.begin() + static_cast<std::ptrdiff_t>(i), buf.begin() + static_cast<std::ptrdiff_t>(j),
                       [](char32_t a, char32_t b) { return detail::ccc(a) < detail::ccc(b); });
      i = j;
    }
    // Canonical composition: each character joins the last starter unless blocked.
    std::size_t starter = SIZE_MAX;
    std::size_t w = 0;
    int last_ccc = -1;
    for (std::size_t r = 0; r < buf.size(); ++r) {
      const char32_t c = buf[r];
      const int cc = detail::ccc(c);
      // last_ccc == 0 means the starter itself is the previous character (not blocked).
      if (starter != SIZE_MAX && (last_ccc < cc || last_ccc == 0)) {
        if (char32_t comp = detail::compose_pair(buf[starter], c)) {
          buf[starter] = comp;
          continue;
        }
      }
      if (cc == 0) starter = w;
      last_ccc = cc;
      buf[w++] = c;
    }
    buf.resize(w);
    for (char32_t c : buf) utf8_append(out, c);
    buf.clear();
  };
  std::size_t i = 0;
  while (i < s.size()) {
    const std::size_t at = i;
    const char32_t c = utf8_next(s, i);
    if (c == kInvalidByte) {
      flush();
      out += s[at];
      continue;
    }
    detail::decompose(c, buf);
  }
  flush();
  return out;
}

}  // namespace nn::lm
// ---- end nn/lm/unicode.hpp ----

namespace nn::lm::detail {

/// A set of code points: a union of atoms, each a set of ranges and general categories,
/// possibly complemented. ASCII membership is precomputed into a bitmap.
struct CharSet {
  struct Atom {
    std::vector<std::pair<char32_t, char32_t>> ranges;
    std::uint32_t cats = 0;  // bit per Gc
    bool negated = false;
    bool contains(char32_t c, Gc g) const {
      bool in = (cats >> static_cast<unsigned>(g)) & 1u;
      for (std::size_t i = 0; !in && i < ranges.size(); ++i) in = c >= ranges[i].first && c <= ranges[i].second;
      return in != negated;
    }
  };
  std::vector<Atom> atoms;
  bool negated = false;
  std::uint64_t ascii[2] = {0, 0};

  bool contains_slow(char32_t c, Gc g) const {
    bool in = false;
    for (std::size_t i = 0; !in && i < atoms.size(); ++i) in = atoms[i].contains(c, g);
    return in != negated;
  }
  void finish() {
    ascii[0] = ascii[1] = 0;
    for (char32_t c = 0; c < 128; ++c)
      if (contains_slow(c, general_category(c))) ascii[c >> 6] |= std::uint64_t{1} << (c & 63);
  }
  bool contains(char32_t c, Gc g) const {
    if (c < 128) return (ascii[c >> 6] >> (c & 63)) & 1u;
    return contains_slow(c, g);
  }
};

inline constexpr std::uint32_t gc_bit(Gc g) { return 1u << static_cast<unsigned>(g); }
inline constexpr std::uint32_t kLetterBits = gc_bit(Gc::Lu) | gc_bit(Gc::Ll) | gc_bit(Gc::Lt) | gc_bit(Gc::Lm) | gc_bit(Gc::Lo);
inline constexpr std::uint32_t kMarkBits = gc_bit(Gc::Mn) | gc_bit(Gc::Mc) | gc_bit(Gc::Me);
inline constexpr std::uint32_t kNumberBits = gc_bit(Gc::Nd) | gc_bit(Gc::Nl) | gc_bit(Gc::No);
inline constexpr std::uint32_t kPunctBits = gc_bit(Gc::Pc) | gc_bit(Gc::Pd) | gc_bit(Gc::Ps) | gc_bit(Gc::Pe) |
                                            gc_bit(Gc::Pi) | gc_bit(Gc::Pf) | gc_bit(Gc::Po);
inline constexpr std::uint32_t kSymbolBits = gc_bit(Gc::Sm) | gc_bit(Gc::Sc) | gc_bit(Gc::Sk) | gc_bit(Gc::So);
inline constexpr std::uint32_t kSepBits = gc_bit(Gc::Zs) | gc_bit(Gc::Zl) | gc_bit(Gc::Zp);
inline constexpr std::uint32_t kOtherBits = gc_bit(Gc::Cn) | gc_bit(Gc::Cc) | gc_bit(Gc::Cf) | gc_bit(Gc::Cs) | gc_bit(Gc::Co);

inline CharSet::Atom space_atom(bool neg) {
  return {{{9, 13}, {0x85, 0x85}}, kSepBits, neg};
}
// Oniguruma's \w (checked against tokenizers over every code point): letters, marks, Nd, Pc,
// letter numbers (Nl), the Latin-1 digits and fractions it counts as alphanumeric, and the
// circled / squared Latin letters (So, but Alphabetic).
inline constexpr std::uint32_t kWordBits = kLetterBits | kMarkBits | gc_bit(Gc::Nd) | gc_bit(Gc::Pc) | gc_bit(Gc::Nl);
inline constexpr std::pair<char32_t, char32_t> kWordExtra[] = {
    {0xB2, 0xB3}, {0xB9, 0xB9}, {0xBC, 0xBE}, {0x24B6, 0x24E9}, {0x1F130, 0x1F149}, {0x1F150, 0x1F169}, {0x1F170, 0x1F189}};
inline CharSet::Atom word_atom(bool neg) {
  return {{std::begin(kWordExtra), std::end(kWordExtra)}, kWordBits, neg};
}
inline bool is_word_char(char32_t c, Gc g) {
  if ((kWordBits >> static_cast<unsigned>(g)) & 1u) return true;
  for (const auto& [lo, hi] : kWordExtra)
    if (c >= lo && c <= hi) return true;
  return false;
}

class Regex {
 public:
  Regex() = default;
  /// Compiles `pattern`; a syntax error or unsupported construct throws nn::Error under `where`.
  explicit Regex(std::string_view pattern, std::string where = "regex") : pattern_(pattern) {
    std::size_t i = 0;
    while (i < pattern.size()) pat_.push_back(utf8_next(pattern, i));
    Parser p{*this, std::move(where)};
    Node root = p.parse_alt();
    if (p.pos != pat_.size()) p.error("unbalanced ')'");
    auto prog = std::make_shared<Program>();
    compile(root, *prog);
    prog->code.push_back({Op::match, 0, 0, false});
    prog_ = std::move(prog);
    pat_.clear();
  }

  const std::string& pattern() const { return pattern_; }

  /// End of the match starting exactly at `pos` of cps[0, n), or SIZE_MAX when none.
  std::size_t match_at(const char32_t* cps, const Gc* gcs, std::size_t n, std::size_t pos) const {
    return run(*prog_, cps, gcs, n, pos);
  }

  /// Calls f(begin, end) for every non-empty leftmost-first match, scanning left to right and
  /// resuming after each match (Oniguruma's find_iter without empty matches).
  template <class F>
  void find_all(const char32_t* cps, const Gc* gcs, std::size_t n, F&& f) const {
    std::size_t pos = 0;
    while (pos < n) {
      const std::size_t e = run(*prog_, cps, gcs, n, pos);
      if (e != SIZE_MAX && e > pos) {
        f(pos, e);
        pos = e;
      } else {
        ++pos;
      }
    }
  }

 private:
  // rep: a greedy run of one set (sets[a], at least b, at most c or unbounded when c < 0),
  // which backtracks by giving back one character at a time through a single stack entry
  // instead of one entry per character: \p{L}+ and \s+ are most of the work.
  enum class Op : std::uint8_t { cls, split, jmp, match, look, bol, eol, bos, eos, wordb, nwordb, rep };
  struct Inst {
    Op op;
    std::int32_t a, b;
    bool neg;
    std::int32_t c = 0;
  };
  struct Program {
    std::vector<Inst> code;
    std::vector<CharSet> sets;
    std::vector<std::shared_ptr<Program>> subs;  // lookahead bodies
  };

  struct Node {
    enum Kind : std::uint8_t { set, concat, alt, repeat, look, assert_, empty } kind = empty;
    CharSet cs;
    std::vector<Node> kids;
    int min = 0, max = 0;  // repeat; max < 0: unbounded
    bool greedy = true;
    bool neg = false;      // look
    Op assertion = Op::bol;
  };

  struct Parser {
    Regex& re;
    std::string where;
    std::size_t pos = 0;
    std::vector<bool> icase{false};

    [[noreturn]] void error(const std::string& what) const {
      nn::detail::fail(where, "pattern ", '"', re.pattern_, '"', ": ", what, " (at code point ", pos, ")");
    }
    bool more() const { return pos < re.pat_.size(); }
    char32_t peek() const { return re.pat_[pos]; }
    bool eat(char32_t c) {
      if (more() && peek() == c) {
        ++pos;
        return true;
      }
      return false;
    }

    Node parse_alt() {
      Node first = parse_concat();
      if (!more() || peek() != U'|') return first;
      Node n;
      n.kind = Node::alt;
      n.kids.push_back(std::move(first));
      while (eat(U'|')) n.kids.push_back(parse_concat());
      return n;
    }

    Node parse_concat() {
      Node n;
      n.kind = Node::concat;
      const bool saved_icase = icase.back();
      while (more() && peek() != U'|' && peek() != U')') {
        if (auto atom = parse_repeat()) n.kids.push_back(std::move(*atom));
      }
      icase.back() = saved_icase;  // an inline (?i) lasts to the end of its alternative's group
      return n;
    }

    std::unique_ptr<Node> parse_repeat() {
      auto atom = parse_atom();
      if (!atom) return nullptr;
      while (more()) {
        int mn = 0, mx = 0;
        const char32_t c = peek();
        if (c == U'*') mn = 0, mx = -1, ++pos;
        else if (c == U'+') mn = 1, mx = -1, ++pos;
        else if (c == U'?') mn = 0, mx = 1, ++pos;
        else if (c == U'{' && parse_braces(mn, mx)) {}
        else break;
        if (atom->kind == Node::assert_ || atom->kind == Node::look) error("quantifier after an assertion");
        Node r;
        r.kind = Node::repeat;
        r.min = mn;
        r.max = mx;
        if (eat(U'?')) r.greedy = false;
        else if (more() && peek() == U'+') error("possessive quantifiers are not supported");
        if (nullable(*atom) && mx < 0) error("an unbounded repeat of something that can match empty");
        r.kids.push_back(std::move(*atom));
        *atom = std::move(r);
      }
      return atom;
    }

    // {n}, {n,}, {n,m}; anything else is a literal '{' (as Oniguruma reads it).
    bool parse_braces(int& mn, int& mx) {
      std::size_t p = pos + 1;
      auto num = [&](int& v) {
        std::size_t s = p;
        v = 0;
        while (p < re.pat_.size() && re.pat_[p] >= U'0' && re.pat_[p] <= U'9') v = v * 10 + static_cast<int>(re.pat_[p++] - U'0');
        return p > s;
      };
      if (!num(mn)) return false;
      if (p < re.pat_.size() && re.pat_[p] == U'}') {
        mx = mn;
      } else if (p < re.pat_.size() && re.pat_[p] == U',') {
        ++p;
        if (!num(mx)) mx = -1;
        if (p >= re.pat_.size() || re.pat_[p] != U'}') return false;
      } else {
        return false;
      }
      if (mx >= 0 && mx < mn) error("bad repeat bounds");
      if (mn > 1000 || mx > 1000) error("repeat bound too large");
      pos = p + 1;
      return true;
    }

    static bool nullable(const Node& n) {
      switch (n.kind) {
        case Node::set: return false;
        case Node::concat:
          for (const auto& k : n.kids)
            if (!nullable(k)) return false;
          return true;
        case Node::alt:
          for (const auto& k : n.kids)
            if (nullable(k)) return true;
          return false;
        case Node::repeat: return n.min == 0 || nullable(n.kids[0]);
        default: return true;
      }
    }

    Node literal(char32_t c) {
      Node n;
      n.kind = Node::set;
      CharSet::Atom a;
      add_char(a, c);
      n.cs.atoms.push_back(std::move(a));
      n.cs.finish();
      return n;
    }

    void add_char(CharSet::Atom& a, char32_t c) {
      a.ranges.push_back({c, c});
      if (!icase.back()) return;
      if (c >= U'a' && c <= U'z') a.ranges.push_back({c - 32, c - 32});
      if (c >= U'A' && c <= U'Z') a.ranges.push_back({c + 32, c + 32});
      if (c == U's' || c == U'S' || c == 0x17F) a.ranges.push_back({U's', U's'}), a.ranges.push_back({U'S', U'S'}), a.ranges.push_back({0x17F, 0x17F});
      if (c == U'k' || c == U'K' || c == 0x212A) a.ranges.push_back({U'k', U'k'}), a.ranges.push_back({U'K', U'K'}), a.ranges.push_back({0x212A, 0x212A});
    }
    void add_range(CharSet::Atom& a, char32_t lo, char32_t hi) {
      a.ranges.push_back({lo, hi});
      if (!icase.back()) return;
      for (char32_t c = lo; c <= hi && c < 128; ++c) add_char(a, c);
    }

    std::unique_ptr<Node> parse_atom() {
      const char32_t c = peek();
      ++pos;
      switch (c) {
        case U'(': return std::make_unique<Node>(parse_group());
        case U'[': {
          Node n;
          n.kind = Node::set;
          n.cs = parse_class();
          return std::make_unique<Node>(std::move(n));
        }
        case U'.': {
          Node n;
          n.kind = Node::set;
          n.cs.atoms.push_back({{{U'\n', U'\n'}}, 0, true});
          n.cs.finish();
          return std::make_unique<Node>(std::move(n));
        }
        case U'^': return std::make_unique<Node>(assertion(Op::bol));
        case U'$': return std::make_unique<Node>(assertion(Op::eol));
        case U'\\': return parse_escape_atom();
        case U'*': case U'+': case U'?': error("nothing to repeat");
        default: return std::make_unique<Node>(literal(c));
      }
    }

    static Node assertion(Op op) {
      Node n;
      n.kind = Node::assert_;
      n.assertion = op;
      return n;
    }

    Node parse_group() {
      if (eat(U'?')) {
        if (!more()) error("unterminated group");
        const char32_t c = peek();
        if (c == U':') {
          ++pos;
          return group_body(icase.back());
        }
        if (c == U'=' || c == U'!') {
          ++pos;
          Node n;
          n.kind = Node::look;
          n.neg = c == U'!';
          n.kids.push_back(group_body(icase.back()));
          return n;
        }
        if (c == U'<' && pos + 1 < re.pat_.size() && (re.pat_[pos + 1] == U'=' || re.pat_[pos + 1] == U'!'))
          error("lookbehind is not supported");
        if (c == U'<' || c == U'\'') {  // named group: matched as a plain group
          const char32_t close = c == U'<' ? U'>' : U'\'';
          while (more() && peek() != close) ++pos;
          if (!eat(close)) error("unterminated group name");
          return group_body(icase.back());
        }
        // Flags: (?i) (?-i) (?i:...) (?-i:...); other flags are rejected.
        bool on = true, flag = icase.back();
        while (more() && peek() != U':' && peek() != U')') {
          const char32_t f = peek();
          ++pos;
          if (f == U'-') on = false;
          else if (f == U'i') flag = on;
          else error(std::string("unsupported group flag"));
        }
        if (eat(U':')) return group_body(flag);
        if (!eat(U')')) error("unterminated group");
        icase.back() = flag;  // (?i) applies to the rest of the enclosing group
        return Node{};
      }
      return group_body(icase.back());
    }

    Node group_body(bool ic) {
      icase.push_back(ic);
      Node n = parse_alt();
      icase.pop_back();
      if (!eat(U')')) error("missing ')'");
      return n;
    }

    // A category name after \p or \P: one-letter or two-letter general categories and the long
    // names of the seven major classes.
    std::uint32_t category_bits(const std::u32string& name) {
      static const char* const names[kGcCount] = {"Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd",
                                                  "Nl", "No", "Pc", "Pd", "Ps", "Pe", "Pi", "Pf", "Po", "Sm",
                                                  "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"};
      std::string s;
      for (char32_t c : name) s += static_cast<char>(c < 128 ? c : '?');
      if (s == "L" || s == "Letter") return kLetterBits;
      if (s == "M" || s == "Mark") return kMarkBits;
      if (s == "N" || s == "Number") return kNumberBits;
      if (s == "P" || s == "Punctuation") return kPunctBits;
      if (s == "S" || s == "Symbol") return kSymbolBits;
      if (s == "Z" || s == "Separator") return kSepBits;
      if (s == "C" || s == "Other") return kOtherBits;
      if (s == "L&" || s == "LC") return gc_bit(Gc::Lu) | gc_bit(Gc::Ll) | gc_bit(Gc::Lt);
      for (int i = 0; i < kGcCount; ++i)
        if (s == names[i]) return 1u << i;
      error("unsupported property \\p{" + s + "}");
    }

    // After a backslash: a class escape (\s \d \w \p{..} and negations) into `a`, returning
    // true; or false with `lit` set to the escaped literal code point.
    bool parse_escape(CharSet::Atom& a, char32_t& lit, bool in_class) {
      if (!more()) error("trailing backslash");
      const char32_t c = peek();
      ++pos;
      switch (c) {
        case U's': a = space_atom(false); return true;
        case U'S': a = space_atom(true); return true;
        case U'd': a = {{}, gc_bit(Gc::Nd), false}; return true;
        case U'D': a = {{}, gc_bit(Gc::Nd), true}; return true;
        case U'w': a = word_atom(false); return true;
        case U'W': a = word_atom(true); return true;
        case U'h': a = {{{U'0', U'9'}, {U'a', U'f'}, {U'A', U'F'}}, 0, false}; return true;
        case U'H': a = {{{U'0', U'9'}, {U'a', U'f'}, {U'A', U'F'}}, 0, true}; return true;
        case U'p': case U'P': {
          bool neg = c == U'P';
          std::u32string name;
          if (eat(U'{')) {
            if (eat(U'^')) neg = !neg;
            while (more() && peek() != U'}') name += re.pat_[pos++];
            if (!eat(U'}')) error("unterminated \\p{");
          } else {
            if (!more()) error("\\p without a name");
            name += re.pat_[pos++];
          }
          a = {{}, category_bits(name), neg};
          return true;
        }
        case U'n': lit = U'\n'; return false;
        case U'r': lit = U'\r'; return false;
        case U't': lit = U'\t'; return false;
        case U'f': lit = U'\f'; return false;
        case U'v': lit = U'\v'; return false;
        case U'a': lit = 7; return false;
        case U'e': lit = 27; return false;
        case U'b':
          if (in_class) {
            lit = 8;
            return false;
          }
          break;
        case U'x': case U'u': {
          char32_t v = 0;
          int digits = 0;
          const bool brace = c == U'x' && eat(U'{');
          const int maxd = brace ? 8 : c == U'x' ? 2 : 4;
          while (more() && digits < maxd) {
            const char32_t h = peek();
            int d = h >= U'0' && h <= U'9' ? static_cast<int>(h - U'0')
                    : h >= U'a' && h <= U'f' ? static_cast<int>(h - U'a' + 10)
                    : h >= U'A' && h <= U'F' ? static_cast<int>(h - U'A' + 10) : -1;
            if (d < 0) break;
            v = v * 16 + static_cast<char32_t>(d);
            ++digits;
            ++pos;
          }
          if (brace && !eat(U'}')) error("unterminated \\x{");
          if (digits == 0) error("bad hex escape");
          lit = v;
          return false;
        }
        default: break;
      }
      if ((c >= U'0' && c <= U'9') || (c >= U'A' && c <= U'Z') || (c >= U'a' && c <= U'z'))
        error(std::string("unsupported escape \\") + static_cast<char>(c));
      lit = c;  // an escaped punctuation character stands for itself
      return false;
    }

    std::unique_ptr<Node> parse_escape_atom() {
      if (more()) {
        const char32_t c = peek();
        Op op{};
        bool is_assert = true;
        switch (c) {
          case U'b': op = Op::wordb; break;
          case U'B': op = Op::nwordb; break;
          case U'A': op = Op::bos; break;
          case U'z': op = Op::eos; break;
          case U'Z': op = Op::eol; break;  // end, or before a final newline (close enough: a line end)
          default: is_assert = false;
        }
        if (is_assert) {
          ++pos;
          return std::make_unique<Node>(assertion(op));
        }
      }
      CharSet::Atom a;
      char32_t lit = 0;
      if (!parse_escape(a, lit, false)) return std::make_unique<Node>(literal(lit));
      Node n;
      n.kind = Node::set;
      n.cs.atoms.push_back(std::move(a));
      n.cs.finish();
      return std::make_unique<Node>(std::move(n));
    }

    CharSet parse_class() {
      CharSet cs;
      if (eat(U'^')) cs.negated = true;
      CharSet::Atom lits;  // literal characters and ranges collect into one atom
      bool first = true;
      while (true) {
        if (!more()) error("unterminated character class");
        char32_t c = peek();
        if (c == U']' && !first) {
          ++pos;
          break;
        }
        first = false;
        if (c == U'[') error("nested character classes are not supported");
        if (c == U'&' && pos + 1 < re.pat_.size() && re.pat_[pos + 1] == U'&') error("class intersection is not supported");
        ++pos;
        char32_t lo = c;
        if (c == U'\\') {
          CharSet::Atom a;
          if (parse_escape(a, lo, true)) {
            cs.atoms.push_back(std::move(a));
            continue;
          }
        }
        // A range lo-hi (a '-' before ']' is a literal).
        if (more() && peek() == U'-' && pos + 1 < re.pat_.size() && re.pat_[pos + 1] != U']') {
          ++pos;
          char32_t hi = re.pat_[pos++];
          if (hi == U'\\') {
            CharSet::Atom a;
            if (parse_escape(a, hi, true)) error("a class escape cannot end a range");
          }
          if (hi < lo) error("bad range in character class");
          add_range(lits, lo, hi);
        } else {
          add_char(lits, lo);
        }
      }
      if (!lits.ranges.empty()) cs.atoms.push_back(std::move(lits));
      cs.finish();
      return cs;
    }
  };

  static void compile(const Node& n, Program& p) {
    auto emit = [&](Op op, std::int32_t a = 0, std::int32_t b = 0, bool neg = false) {
      p.code.push_back({op, a, b, neg});
      return static_cast<std::int32_t>(p.code.size() - 1);
    };
    auto here = [&] { return static_cast<std::int32_t>(p.code.size()); };
    switch (n.kind) {
      case Node::empty: return;
      case Node::set:
        p.sets.push_back(n.cs);
        emit(Op::cls, static_cast<std::int32_t>(p.sets.size() - 1));
        return;
      case Node::assert_: emit(n.assertion); return;
      case Node::concat:
        for (const auto& k : n.kids) compile(k, p);
        return;
      case Node::alt: {
        // split L1, next; L1: a; jmp end; next: split L2, next2; ...
        std::vector<std::int32_t> jumps;
        for (std::size_t i = 0; i < n.kids.size(); ++i) {
          if (i + 1 < n.kids.size()) {
            const std::int32_t s = emit(Op::split);
            p.code[static_cast<std::size_t>(s)].a = here();
            compile(n.kids[i], p);
            jumps.push_back(emit(Op::jmp));
            p.code[static_cast<std::size_t>(s)].b = here();
          } else {
            compile(n.kids[i], p);
          }
        }
        for (auto j : jumps) p.code[static_cast<std::size_t>(j)].a = here();
        return;
      }
      case Node::look: {
        auto sub = std::make_shared<Program>();
        compile(n.kids[0], *sub);
        sub->code.push_back({Op::match, 0, 0, false});
        p.subs.push_back(std::move(sub));
        emit(Op::look, static_cast<std::int32_t>(p.subs.size() - 1), 0, n.neg);
        return;
      }
      case Node::repeat: {
        const Node& body = n.kids[0];
        if (n.greedy && body.kind == Node::set) {
          p.sets.push_back(body.cs);
          emit(Op::rep, static_cast<std::int32_t>(p.sets.size() - 1), n.min, false);
          p.code.back().c = n.max;
          return;
        }
        for (int i = 0; i < n.min; ++i) compile(body, p);
        // A split's preferred branch is `a`: the body when greedy, the exit when lazy.
        auto split_to = [&](std::int32_t s, std::int32_t body_at, std::int32_t exit_at) {
          p.code[static_cast<std::size_t>(s)].a = n.greedy ? body_at : exit_at;
          p.code[static_cast<std::size_t>(s)].b = n.greedy ? exit_at : body_at;
        };
        if (n.max < 0) {
          const std::int32_t s = emit(Op::split);
          const std::int32_t body_at = here();
          compile(body, p);
          emit(Op::jmp, s);
          split_to(s, body_at, here());
        } else {
          std::vector<std::int32_t> splits;
          for (int i = n.min; i < n.max; ++i) {
            splits.push_back(emit(Op::split));
            compile(body, p);
          }
          const std::int32_t exit_at = here();
          for (auto s : splits) split_to(s, s + 1, exit_at);
        }
        return;
      }
    }
  }

  struct Frame {
    std::int32_t pc;
    std::size_t pos;
    std::size_t lo;  // a rep's give-back frame: retry at pos - 1 while pos - 1 >= lo; else SIZE_MAX
  };

  static std::size_t run(const Program& p, const char32_t* cps, const Gc* gcs, std::size_t n, std::size_t start) {
    // Explicit backtracking stack; thread_local so matching never allocates after warm-up.
    thread_local std::vector<Frame> stack_storage;
    const std::size_t base = stack_storage.size();
    auto& st = stack_storage;
    st.push_back({0, start, SIZE_MAX});
    std::size_t result = SIZE_MAX;
    while (st.size() > base) {
      std::int32_t pc = st.back().pc;
      std::size_t pos = st.back().pos;
      if (st.back().lo == SIZE_MAX) {
        st.pop_back();
      } else {  // give back one more character of a rep
        --pos;
        if (pos <= st.back().lo) st.pop_back();
        else st.back().pos = pos;
      }
      while (true) {
        const Inst& in = p.code[static_cast<std::size_t>(pc)];
        bool ok = true;
        switch (in.op) {
          case Op::cls:
            ok = pos < n && p.sets[static_cast<std::size_t>(in.a)].contains(cps[pos], gcs[pos]);
            if (ok) ++pos, ++pc;
            break;
          case Op::split: {
            // Peephole: when the preferred branch must start with a character of one set and
            // the next character is not in it, go straight to the other branch (no frame).
            const Inst& first = p.code[static_cast<std::size_t>(in.a)];
            if ((first.op == Op::cls || (first.op == Op::rep && first.b > 0)) &&
                (pos >= n || !p.sets[static_cast<std::size_t>(first.a)].contains(cps[pos], gcs[pos]))) {
              pc = in.b;
              break;
            }
            st.push_back({in.b, pos, SIZE_MAX});
            pc = in.a;
            break;
          }
          case Op::rep: {
            const CharSet& cs = p.sets[static_cast<std::size_t>(in.a)];
            const std::size_t lim = in.c < 0 ? n : std::min(n, pos + static_cast<std::size_t>(in.c));
            std::size_t e = pos;
            while (e < lim && cs.contains(cps[e], gcs[e])) ++e;
            const std::size_t lo = pos + static_cast<std::size_t>(in.b);
            ok = e >= lo;
            if (ok) {
              if (e > lo) st.push_back({pc + 1, e, lo});
              pos = e;
              ++pc;
            }
            break;
          }
          case Op::jmp: pc = in.a; break;
          case Op::match:
            result = pos;
            st.resize(base);
            return result;
          case Op::look: {
            const bool m = run(*p.subs[static_cast<std::size_t>(in.a)], cps, gcs, n, pos) != SIZE_MAX;
            ok = m != in.neg;
            ++pc;
            break;
          }
          case Op::bol: ok = pos == 0 || cps[pos - 1] == U'\n'; ++pc; break;
          case Op::eol: ok = pos == n || cps[pos] == U'\n'; ++pc; break;
          case Op::bos: ok = pos == 0; ++pc; break;
          case Op::eos: ok = pos == n; ++pc; break;
          case Op::wordb: case Op::nwordb: {
            const bool l = pos > 0 && is_word_char(cps[pos - 1], gcs[pos - 1]);
            const bool r = pos < n && is_word_char(cps[pos], gcs[pos]);
            ok = (l != r) == (in.op == Op::wordb);
            ++pc;
            break;
          }
        }
        if (!ok) break;
      }
    }
    return result;
  }

  std::string pattern_;
  std::vector<char32_t> pat_;  // only while parsing
  std::shared_ptr<const Program> prog_;
};

}  // namespace nn::lm::detail
// ---- end nn/lm/regex.hpp ----

namespace nn::lm {

/// GGUF's token types (llama.cpp's llama_token_type).
enum class TokenType : std::int32_t { undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

/// A token matched in the text before pre-tokenization (tokenizer.json "added_tokens").
struct AddedToken {
  std::string content;
  std::int32_t id = -1;
  bool special = false;      // skipped by decode(skip_special_tokens); not split when parse_special is off
  bool single_word = false;  // only matches when not inside a word
  bool lstrip = false;       // swallows the whitespace on its left
  bool rstrip = false;       // swallows the whitespace on its right
  bool normalized = false;   // matched in the normalized text rather than the raw text
};

struct EncodeOptions {
  /// Run the post-processor: BOS/EOS as tokenizer.json's post_processor (TemplateProcessing,
  /// RobertaProcessing, BertProcessing) or GGUF's add_bos/add_eos say. Hugging Face's default.
  bool add_special_tokens = true;
  /// Split special added tokens ("<|im_start|>") out of the text. Off: they are plain text, as
  /// `tokenizers`' split_special_tokens / llama.cpp's parse_special=false.
  bool parse_special = true;
};

/// The tokenizer part of GGUF metadata (tokenizer.ggml.*), as the GGUF reader hands it over.
struct GgufTokenizerData {
  std::string model = "gpt2";              // tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
  std::string pre;                         // tokenizer.ggml.pre: names the split regexes
  std::vector<std::string> tokens;         // tokenizer.ggml.tokens (byte-level form)
  std::vector<std::string> merges;         // tokenizer.ggml.merges ("a b")
  std::vector<std::int32_t> token_types;   // tokenizer.ggml.token_type (empty: all normal)
  std::vector<float> scores;               // tokenizer.ggml.scores ("llama": what merges first; empty: all 0)
  std::optional<std::int32_t> bos_id, eos_id, pad_id, unk_id;
  std::optional<bool> add_bos, add_eos;    // tokenizer.ggml.add_bos_token / add_eos_token
  std::optional<bool> add_space_prefix;    // tokenizer.ggml.add_space_prefix ("llama"; default true)
};

namespace detail {

/// GPT-2's reversible byte <-> printable-character table (bytes_to_unicode in GPT-2's encoder.py).
struct ByteAlphabet {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, std::uint8_t> to_byte;
  std::array<std::string, 256> utf8;  // to_char[b] encoded
  ByteAlphabet() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
    }
    for (int b = 0; b < 256; ++b) {
      to_byte[to_char[static_cast<std::size_t>(b)]] = static_cast<std::uint8_t>(b);
      utf8_append(utf8[static_cast<std::size_t>(b)], to_char[static_cast<std::size_t>(b)]);
    }
  }
  static const ByteAlphabet& get() {
    static const ByteAlphabet a;
    return a;
  }
  /// The raw bytes a byte-level token stands for, or nullopt when a character is outside the
  /// alphabet (then the token is plain text, e.g. an added token with a space in it).
  std::optional<std::string> decode(std::string_view token) const {
    std::string out;
    std::size_t i = 0;
    while (i < token.size()) {
      auto it = to_byte.find(utf8_next(token, i));
      if (it == to_byte.end()) return std::nullopt;
      out += static_cast<char>(it->second);
    }
    return out;
  }
  std::string encode(std::string_view bytes) const {
    std::string out;
    for (unsigned char b : bytes) out += utf8[b];
    return out;
  }
};

/// Open-addressing map from a merge pair (left id, right id) to (rank, merged id): the BPE
/// inner loop looks a pair up for every adjacent pair of every word.
class PairMap {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, {});
    mask_ = cap - 1;
  }
  /// Inserts; a pair already there keeps its value unless `overwrite`.
  void insert(std::int32_t a, std::int32_t b, std::int32_t rank, std::int32_t id, bool overwrite) {
    const std::uint64_t k = key(a, b);
    for (std::size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == k) {
        if (overwrite) vals_[i] = {rank, id};
        return;
      }
      if (keys_[i] == kEmpty) {
        keys_[i] = k;
        vals_[i] = {rank, id};
        ++size_;
        return;
      }
    }
  }
  const std::pair<std::int32_t, std::int32_t>* find(std::int32_t a, std::int32_t b) const {
    if (keys_.empty()) return nullptr;
    const std::uint64_t k = key(a, b);
    for (std::size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }
  std::size_t size() const { return size_; }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  static std::uint64_t key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  static std::size_t hash(std::uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<std::size_t>(k);
  }
  std::vector<std::uint64_t> keys_;
  std::vector<std::pair<std::int32_t, std::int32_t>> vals_;
  std::size_t mask_ = 0, size_ = 0;
};

inline std::uint64_t hash_bytes(std::string_view s) {
  std::uint64_t h = 0x9E3779B97F4A7C15ULL ^ s.size();
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  }
  std::uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94D049BB133111EBULL;
  return h ^ (h >> 29);
}

/// Word -> ids, for words seen before (text repeats its words, and BPE on a word is the costly
/// part). Open addressing over pooled keys and ids; stops growing when full.
class WordCache {
 public:
  static constexpr std::size_t kSlots = std::size_t{1} << 17;
  static constexpr std::size_t kMaxEntries = kSlots / 2;
  static constexpr std::size_t kMaxWord = 256;  // longer words are rare: not cached

  bool find(std::string_view w, std::uint64_t h, std::vector<std::int32_t>& out) const {
    if (slots_.empty()) return false;
    for (std::size_t i = h & (kSlots - 1);; i = (i + 1) & (kSlots - 1)) {
      const Slot& s = slots_[i];
      if (!s.used) return false;
      if (s.hash == h && s.key_len == w.size() && std::memcmp(keys_.data() + s.key_off, w.data(), w.size()) == 0) {
        out.insert(out.end(), vals_.begin() + s.val_off, vals_.begin() + s.val_off + s.val_len);
        return true;
      }
    }
  }
  void insert(std::string_view w, std::uint64_t h, const std::int32_t* ids, std::size_t n) {
    if (size_ >= kMaxEntries) return;
    if (slots_.empty()) slots_.resize(kSlots);
    std::size_t i = h & (kSlots - 1);
    while (slots_[i].used) i = (i + 1) & (kSlots - 1);
    slots_[i] = {h, static_cast<std::uint32_t>(keys_.size()), static_cast<std::uint32_t>(w.size()),
                 static_cast<std::uint32_t>(vals_.size()), static_cast<std::uint32_t>(n), true};
    keys_.append(w);
    vals_.insert(vals_.end(), ids, ids + n);
    ++size_;
  }

 private:
  struct Slot {
    std::uint64_t hash = 0;
    std::uint32_t key_off = 0, key_len = 0, val_off = 0, val_len = 0;
    bool used = false;
  };
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<std::int32_t> vals_;
  std::size_t size_ = 0;
};

/// Transparent hashing, so lookups by string_view allocate nothing.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>>;

/// SentencePiece's visible space, U+2581 "▁".
inline constexpr const char* kSpmSpace = "\xE2\x96\x81";

/// The byte a SentencePiece byte token ("<0x0A>") stands for, as tokenizers' ByteFallback
/// decoder reads it (either case of hex digit), or -1.
inline int spm_byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The split regexes: GPT-2's (ByteLevel's use_regex) and those llama.cpp applies for each
// tokenizer.ggml.pre name (src/llama-vocab.cpp), applied one after the other.
inline constexpr const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr const char* kLlamaCppGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
inline constexpr const char* kLlama3Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kQwen2Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kQwen35Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kGpt4oRegex =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kTekkenRegex =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct GgufPre {
  std::vector<std::string> regexes;
  bool ignore_merges = false;
  bool add_bos = false;
};

inline GgufPre gguf_pre(const std::string& name, const std::string& where) {
  auto is = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (name == n) return true;
    return false;
  };
  if (name.empty() || name == "default")
    return {{R"([\p{P}\$\+<=>\^~\|]+)", kLlamaCppGpt2Regex, R"(\p{N}+)", "[0-9][0-9][0-9]"}, false, false};
  if (is({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}))
    return {{kLlama3Regex}, true, true};
  if (is({"dbrx", "smaug-bpe"})) return {{kLlama3Regex}, false, false};
  if (is({"chatglm-bpe"})) return {{kLlama3Regex}, false, false};
  if (is({"glm4", "glm5"})) return {{kLlama3Regex}, true, false};
  if (is({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open"}))
    return {{kQwen2Regex}, false, false};
  if (is({"qwen35"})) return {{kQwen35Regex}, false, false};
  if (is({"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
          "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe"}))
    return {{kLlamaCppGpt2Regex}, false, false};
  if (is({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva", "mellum2"}))
    return {{R"(\p{N})", kLlamaCppGpt2Regex}, false, false};
  if (is({"falcon"}))
    return {{R"([\p{P}\$\+<=>\^~\|`]+)", kLlamaCppGpt2Regex, "[0-9][0-9][0-9]"}, false, false};
  if (is({"deepseek-coder"}))
    return {{"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", "[一-龥ࠀ-一가-퟿]+", R"(\p{N})"}, false, false};
  if (is({"deepseek-v3"}))
    return {{R"(\p{N}{1,3})", "[一-龥぀-ゟ゠-ヿ]+",
             R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
            false, false};
  if (is({"poro-chat", "bloom", "gpt3-finnish"})) return {{R"( ?[^(\s|.,!?…。，、।۔،)]+)"}, false, false};
  if (is({"viking"})) return {{R"( ?[^(\s|.,!?…。，、।۔،)]+)", R"(\p{N})"}, false, false};
  if (is({"tekken"})) return {{kTekkenRegex}, true, true};
  if (is({"gpt-4o", "gpt4o", "minimax-m2"})) return {{kGpt4oRegex}, false, false};
  nn::detail::fail(where, "tokenizer.ggml.pre: unsupported pre-tokenizer '", name,
                   "' (supported: default, gpt-2, llama-bpe/llama3, qwen2, qwen35, smollm/starcoder, dbrx, falcon, "
                   "deepseek-coder, deepseek-v3, chatglm-bpe, glm4, bloom, viking, tekken, gpt-4o and their aliases)");
}

}  // namespace detail

class Tokenizer {
 public:
  Tokenizer() = default;

  /// Loads a Hugging Face tokenizer.json. bos/eos/pad/unk ids come from a tokenizer_config.json
  /// in the same folder when there is one (`config_path` overrides where to look), else from the
  /// post-processor (BOS) and model.unk_token.
  static Tokenizer from_file(const std::string& path, const std::string& config_path = "") {
    Tokenizer t = from_json(detail::read_json_file(path, "tokenizer"), path);
    std::filesystem::path cfg = config_path.empty()
                                    ? std::filesystem::path(path).parent_path() / "tokenizer_config.json"
                                    : std::filesystem::path(config_path);
    std::error_code ec;
    if (std::filesystem::exists(cfg, ec)) t.load_config_file(cfg.string());
    else if (!config_path.empty()) nn::detail::fail(config_path, "cannot open tokenizer config");
    return t;
  }

  /// From the parsed JSON of a tokenizer.json; `source` names it in errors.
  static Tokenizer from_json(const nlohmann::json& j, const std::string& source = "tokenizer.json") {
    Tokenizer t;
    t.source_ = source;
    t.load_json(j);
    return t;
  }

  /// From the tokenizer.ggml.* metadata of a GGUF file (llama.cpp's "gpt2" and "llama" tokenizer models).
  static Tokenizer from_gguf(const GgufTokenizerData& d, const std::string& source = "gguf") {
    Tokenizer t;
    t.source_ = source;
    t.load_gguf(d);
    return t;
  }

  /// The same from any struct with GgufTokenizerData's field names, ids of any integer width:
  /// gguf.hpp's GgufTokenizerMetadata (from GgufFile::tokenizer()) goes straight in, and this
  /// header need not include the GGUF reader.
  template <class Meta>
  static Tokenizer from_gguf_metadata(const Meta& m, const std::string& source = "gguf") {
    GgufTokenizerData d;
    d.model = m.model;
    d.pre = m.pre;
    d.tokens = m.tokens;
    d.merges = m.merges;
    d.token_types.assign(m.token_types.begin(), m.token_types.end());
    if constexpr (requires { m.scores; }) d.scores.assign(m.scores.begin(), m.scores.end());  // SentencePiece fields: optional
    if constexpr (requires { m.add_space_prefix; }) d.add_space_prefix = m.add_space_prefix;
    auto id = [&](const auto& v, const char* field) -> std::optional<std::int32_t> {
      if (!v) return std::nullopt;
      if (*v < 0 || *v > INT32_MAX) nn::detail::fail(source, field, ": id ", *v, " is out of range");
      return static_cast<std::int32_t>(*v);
    };
    d.bos_id = id(m.bos_id, "tokenizer.ggml.bos_token_id");
    d.eos_id = id(m.eos_id, "tokenizer.ggml.eos_token_id");
    d.pad_id = id(m.pad_id, "tokenizer.ggml.padding_token_id");
    d.unk_id = id(m.unk_id, "tokenizer.ggml.unknown_token_id");
    d.add_bos = m.add_bos;
    d.add_eos = m.add_eos;
    return from_gguf(d, source);
  }

  /// Reads bos/eos/pad/unk tokens from a transformers tokenizer_config.json (strings or
  /// {"content": ...} objects); tokens not in the vocabulary are an error naming the field.
  void load_config_file(const std::string& path) {
    const nlohmann::json j = detail::read_json_file(path, "tokenizer");
    auto read = [&](const char* field, std::optional<std::int32_t>& out) {
      auto it = j.find(field);
      if (it == j.end() || it->is_null()) return;
      std::string content;
      if (it->is_string()) content = it->get<std::string>();
      else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) content = (*it)["content"].get<std::string>();
      else nn::detail::fail(path, field, ": expected a string or an object with \"content\"");
      auto id = token_to_id(content);
      if (!id) nn::detail::fail(path, field, ": token '", content, "' is not in the vocabulary");
      out = *id;
    };
    read("bos_token", bos_id_);
    read("eos_token", eos_id_);
    read("pad_token", pad_id_);
    read("unk_token", unk_token_id_);
  }

  // ---- encoding ------------------------------------------------------------------------------

  std::vector<std::int32_t> encode(std::string_view text, const EncodeOptions& opt = {}) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3 + 4);
    std::unique_lock<std::mutex> lock(cache_.p->mu, std::try_to_lock);
    detail::WordCache* cache = lock.owns_lock() ? &cache_.p->words : nullptr;
    if (opt.add_special_tokens) out.insert(out.end(), prefix_.begin(), prefix_.end());
    // Pass 1 on the raw text: added tokens that are not normalized (special ones only when
    // parse_special); pass 2 on each normalized remainder: the normalized added tokens.
    split_added(text, raw_added_, opt.parse_special, [&](std::string_view seg, std::int32_t id) {
      if (id >= 0) {
        out.push_back(id);
        return;
      }
      std::string norm;
      std::string_view ns = seg;
      if (!norms_.empty()) {
        norm = normalize(seg);
        ns = norm;
      }
      // Metaspace's prepend_scheme "first" looks at where the piece starts in the input.
      const bool seg_first = seg.data() == text.data();
      split_added(ns, norm_added_, opt.parse_special, [&](std::string_view s2, std::int32_t id2) {
        if (id2 >= 0) out.push_back(id2);
        else for_each_word(s2, seg_first && s2.data() == ns.data(), [&](std::string_view w) { encode_word(w, out, cache); });
      });
    });
    if (opt.add_special_tokens) out.insert(out.end(), suffix_.begin(), suffix_.end());
    return out;
  }

  /// The pre-tokenizer's words for `text` (normalized first; added tokens are not split out):
  /// what Hugging Face's pre_tokenizer.pre_tokenize_str gives after the normalizer.
  std::vector<std::string> pre_tokenize(std::string_view text) const {
    std::string norm = normalize(text);
    std::vector<std::string> words;
    for_each_word(norm, true, [&](std::string_view w) { words.emplace_back(w); });
    return words;
  }

  // ---- decoding ------------------------------------------------------------------------------

  /// The raw bytes the ids stand for (may end inside a UTF-8 sequence: see
  /// utf8_complete_prefix for streaming). Throws nn::Error on an id outside the vocabulary.
  /// SentencePiece-style: "▁" is a space and <0xXX> its byte; no leading space is stripped.
  std::string decode_bytes(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const {
    std::string out;
    for (std::int32_t id : ids) {
      check_id(id, "decode");
      if (skip_special_tokens && is_special_[static_cast<std::size_t>(id)]) continue;
      out += id_bytes_[static_cast<std::size_t>(id)];
    }
    return out;
  }

  /// Text for the ids; invalid UTF-8 (a sequence cut by the ids chosen) becomes U+FFFD, as in
  /// Hugging Face's decode. skip_special_tokens drops added tokens marked special.
  /// SentencePiece-style: the decoder chain, so also the leading space Strip removes.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const {
    if (!spm_) return utf8_lossy(decode_bytes(ids, skip_special_tokens));
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (std::int32_t id : ids) {
      check_id(id, "decode");
      if (skip_special_tokens && is_special_[static_cast<std::size_t>(id)]) continue;
      toks.push_back(id_to_token_[static_cast<std::size_t>(id)]);
    }
    for (const DecStep& d : decoders_) run_decoder(d, toks);
    std::string out;
    for (const auto& t : toks) out += t;
    return out;
  }
  std::string decode(const std::vector<std::int32_t>& ids, bool skip_special_tokens = false) const {
    return decode(std::span<const std::int32_t>(ids), skip_special_tokens);
  }

  // ---- vocabulary ----------------------------------------------------------------------------

  /// Id of a token in its vocabulary form ("Ġhello", "<|im_start|>"), or nullopt.
  std::optional<std::int32_t> token_to_id(std::string_view token) const {
    auto it = token_to_id_.find(token);
    if (it == token_to_id_.end()) return std::nullopt;
    return it->second;
  }
  /// The vocabulary form of token `id`.
  const std::string& id_to_token(std::int32_t id) const {
    check_id(id, "id_to_token");
    return id_to_token_[static_cast<std::size_t>(id)];
  }
  /// One past the largest id (model vocabulary and added tokens).
  std::size_t vocab_size() const { return id_to_token_.size(); }
  bool is_special(std::int32_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < is_special_.size() && is_special_[static_cast<std::size_t>(id)];
  }
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  std::size_t merges_size() const { return merges_.size(); }

  std::optional<std::int32_t> bos_id() const { return bos_id_; }
  std::optional<std::int32_t> eos_id() const { return eos_id_; }
  std::optional<std::int32_t> pad_id() const { return pad_id_; }
  std::optional<std::int32_t> unk_id() const { return unk_token_id_; }
  void set_bos_id(std::optional<std::int32_t> id) { bos_id_ = id; }
  void set_eos_id(std::optional<std::int32_t> id) { eos_id_ = id; }
  void set_pad_id(std::optional<std::int32_t> id) { pad_id_ = id; }

  /// SentencePiece-style BPE (GGUF's "llama" tokenizer model): characters as symbols, "▁" for
  /// spaces, byte fallback. False for byte-level BPE.
  bool sentencepiece() const { return spm_; }
  /// SentencePiece-style and puts a "▁" before the text (a Prepend normalizer or Metaspace's
  /// prepend scheme): GGUF's add_space_prefix.
  bool space_prefix() const {
    if (!spm_) return false;
    if (metaspace_) return metaspace_->scheme != Metaspace::never;
    return std::any_of(norms_.begin(), norms_.end(), [](const NormStep& n) { return n.kind == NormStep::prepend && n.a == detail::kSpmSpace; });
  }

  /// Ids the post-processor puts before / after a single sequence.
  const std::vector<std::int32_t>& prefix_ids() const { return prefix_; }
  const std::vector<std::int32_t>& suffix_ids() const { return suffix_; }
  const std::string& source() const { return source_; }

 private:
  enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
  struct PreStep {
    enum Kind { split, byte_level, digits } kind = split;
    std::shared_ptr<const detail::Regex> re;  // split; byte_level with use_regex
    Behavior behavior = Behavior::isolated;
    bool invert = false;
    bool individual_digits = false;
  };
  // Normalizer steps, in order (tokenizers' NFC, Prepend, Replace with a String pattern).
  struct NormStep {
    enum Kind { nfc, prepend, replace } kind = nfc;
    std::string a, b;  // prepend: a; replace: a -> b
  };
  // The Metaspace pre-tokenizer: spaces become `replacement`, which is put in front as the
  // scheme says (not when the piece already starts with it), and words are cut before each one
  // when `split`.
  struct Metaspace {
    std::string replacement = detail::kSpmSpace;
    enum Scheme { always, first, never } scheme = always;
    bool split = true;
  };
  // Decoder steps (SentencePiece-style files), run on the token strings in order.
  struct DecStep {
    enum Kind { replace, byte_fallback, fuse, strip, metaspace } kind = fuse;
    std::string a, b;  // replace: a -> b; strip: a is the character; metaspace: a is the replacement
    std::size_t start = 0, stop = 0;
    bool prepend = true;  // metaspace: its prepend_scheme is not "never"
  };
  struct AddedSet {
    std::vector<AddedToken> toks;                         // longest first
    std::array<std::vector<std::uint32_t>, 256> by_first;  // indices into toks by first byte
  };
  // The word cache is taken for a whole encode() with try_lock: no lock per word, and a
  // thread that finds it busy (another thread encoding with the same tokenizer) encodes
  // without it rather than waiting. A copy of the tokenizer gets its own, empty cache, so one
  // copy per thread encodes in parallel at full speed.
  struct Cache {
    std::mutex mu;
    detail::WordCache words;
  };
  struct CacheHolder {
    std::unique_ptr<Cache> p = std::make_unique<Cache>();
    CacheHolder() = default;
    CacheHolder(const CacheHolder&) : p(std::make_unique<Cache>()) {}
    CacheHolder& operator=(const CacheHolder&) {
      p = std::make_unique<Cache>();
      return *this;
    }
    CacheHolder(CacheHolder&&) noexcept = default;
    CacheHolder& operator=(CacheHolder&&) noexcept = default;
  };

  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    nn::detail::fail(source_, field, ": ", msg);
  }
  void check_id(std::int32_t id, const char* op) const {
    if (id < 0 || static_cast<std::size_t>(id) >= id_to_token_.size() || !valid_[static_cast<std::size_t>(id)])
      nn::detail::fail(op, "token id ", id, " is not in the vocabulary of ", source_, " (size ", id_to_token_.size(), ")");
  }

  // ---- loading -------------------------------------------------------------------------------

  // Ids may leave gaps (a trimmed vocabulary keeps its added tokens' ids), but the tables are
  // indexed by id: an id this far past the tokens given would allocate gigabytes for nothing.
  static constexpr std::size_t kMaxIdGap = std::size_t{1} << 20;

  void set_token(std::int32_t id, const std::string& tok) {
    if (id < 0) fail("vocab", "negative id for token '" + tok + "'");
    if (static_cast<std::size_t>(id) >= token_to_id_.size() + kMaxIdGap)
      fail("vocab", "id " + std::to_string(id) + " of token '" + tok + "' lies more than 2^20 past the " +
                        std::to_string(token_to_id_.size()) + " tokens read so far (ids this sparse are refused)");
    if (static_cast<std::size_t>(id) >= id_to_token_.size()) {
      id_to_token_.resize(static_cast<std::size_t>(id) + 1);
      valid_.resize(static_cast<std::size_t>(id) + 1, false);
    }
    id_to_token_[static_cast<std::size_t>(id)] = tok;
    valid_[static_cast<std::size_t>(id)] = true;
    token_to_id_[tok] = id;
  }

  /// A pair listed twice: tokenizer.json keeps the last rank (`tokenizers` collects the merges
  /// into a map), GGUF the first (llama.cpp's emplace); `last_wins` picks which.
  void add_merge(const std::string& a, const std::string& b, std::size_t rank, const std::string& field, bool last_wins) {
    auto ia = model_vocab_.find(a);
    if (ia == model_vocab_.end()) fail(field, "token '" + a + "' is not in the vocabulary");
    auto ib = model_vocab_.find(b);
    if (ib == model_vocab_.end()) fail(field, "token '" + b + "' is not in the vocabulary");
    auto im = model_vocab_.find(a + b);
    if (im == model_vocab_.end()) fail(field, "merged token '" + a + b + "' is not in the vocabulary");
    merges_.insert(ia->second, ib->second, static_cast<std::int32_t>(rank), im->second, last_wins);
  }

  void finish() {
    const auto& alpha = detail::ByteAlphabet::get();
    byte_id_.fill(-1);
    for (int b = 0; b < 256; ++b) {
      // Byte-level: the byte's printable character; SentencePiece: its <0xXX> byte token.
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      const std::string key = spm_ ? std::string(buf) : alpha.utf8[static_cast<std::size_t>(b)];
      const detail::StringMap& vocab = spm_scores_ ? token_to_id_ : model_vocab_;
      auto it = vocab.find(key);
      if (it != vocab.end()) byte_id_[static_cast<std::size_t>(b)] = it->second;
    }
    is_special_.assign(id_to_token_.size(), false);
    for (const auto& a : added_)
      if (a.special) is_special_[static_cast<std::size_t>(a.id)] = true;
    id_bytes_.assign(id_to_token_.size(), std::string());
    for (std::size_t i = 0; i < id_to_token_.size(); ++i) {
      if (!valid_[i]) continue;
      if (spm_) {  // "▁" is a space, a byte token its byte
        const int b = detail::spm_byte_token(id_to_token_[i]);
        id_bytes_[i] = b >= 0 ? std::string(1, static_cast<char>(b)) : replace_all(id_to_token_[i], detail::kSpmSpace, " ");
        continue;
      }
      // The ByteLevel decoder: tokens made of byte-level characters are bytes; any other token
      // (an added token with a space, say) is its own UTF-8 text.
      auto bytes = alpha.decode(id_to_token_[i]);
      id_bytes_[i] = bytes ? std::move(*bytes) : id_to_token_[i];
    }
    if (ignore_merges_) {  // keyed by the word as bpe() receives it
      raw_vocab_.clear();
      for (const auto& [tok, id] : model_vocab_)
        if (spm_) raw_vocab_.emplace(tok, id);
        else if (auto bytes = alpha.decode(tok)) raw_vocab_.emplace(std::move(*bytes), id);
    }
    raw_added_ = AddedSet{};
    norm_added_ = AddedSet{};
    for (const auto& a : added_) {
      if (a.content.empty()) continue;
      (a.normalized && !norms_.empty() ? norm_added_ : raw_added_).toks.push_back(a);
    }
    for (AddedSet* set : {&raw_added_, &norm_added_}) {
      // Longest first, so the first candidate that matches at a position is the longest one.
      std::stable_sort(set->toks.begin(), set->toks.end(),
                       [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
      for (std::size_t i = 0; i < set->toks.size(); ++i)
        set->by_first[static_cast<unsigned char>(set->toks[i].content[0])].push_back(static_cast<std::uint32_t>(i));
    }
    cache_ = CacheHolder{};
  }

  static const nlohmann::json* member(const nlohmann::json& j, const char* key) {
    if (!j.is_object()) return nullptr;
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }

  void load_json(const nlohmann::json& j) {
    if (!j.is_object()) fail("(root)", "expected a JSON object");
    const nlohmann::json* model = member(j, "model");
    if (!model) fail("model", "missing");
    if (!model->is_object()) fail("model", "expected an object");
    if (const auto* type = member(*model, "type")) {
      if (!type->is_string()) fail("model.type", "expected a string");
      if (type->get<std::string>() != "BPE")
        fail("model.type", "unsupported tokenizer model '" + type->get<std::string>() + "' (only byte-level BPE)");
    }
    const nlohmann::json* vocab = member(*model, "vocab");
    if (!vocab) fail("model.vocab", "missing");
    if (!vocab->is_object()) fail("model.vocab", "expected an object mapping token to id");
    const nlohmann::json* merges = member(*model, "merges");
    if (!merges) fail("model.merges", "missing");
    if (!merges->is_array()) fail("model.merges", "expected an array");
    if (const auto* p = member(*model, "continuing_subword_prefix"); p && p->is_string() && !p->get<std::string>().empty())
      fail("model.continuing_subword_prefix", "not supported by byte-level BPE");
    if (const auto* p = member(*model, "end_of_word_suffix"); p && p->is_string() && !p->get<std::string>().empty())
      fail("model.end_of_word_suffix", "not supported by byte-level BPE");
    if (const auto* p = member(*model, "dropout"); p && p->is_number() && p->get<double>() > 0)
      fail("model.dropout", "BPE dropout is not supported (the tokenizer is deterministic)");
    if (const auto* p = member(*model, "ignore_merges")) ignore_merges_ = p->is_boolean() && p->get<bool>();
    if (const auto* p = member(*model, "fuse_unk")) fuse_unk_ = p->is_boolean() && p->get<bool>();
    if (const auto* p = member(*model, "byte_fallback")) byte_fallback_ = p->is_boolean() && p->get<bool>();

    token_to_id_.reserve(vocab->size() + 64);
    model_vocab_.reserve(vocab->size());
    id_to_token_.reserve(vocab->size() + 64);
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      if (!it.value().is_number_integer()) fail("model.vocab", "id of token '" + it.key() + "' is not an integer");
      const auto id = it.value().get<std::int64_t>();
      if (id < 0 || id > INT32_MAX) fail("model.vocab", "id of token '" + it.key() + "' is out of range");
      set_token(static_cast<std::int32_t>(id), it.key());
      model_vocab_[it.key()] = static_cast<std::int32_t>(id);
    }
    merges_.reserve(merges->size());
    for (std::size_t r = 0; r < merges->size(); ++r) {
      const auto& m = (*merges)[r];
      const std::string field = "model.merges[" + std::to_string(r) + "]";
      if (m.is_string()) {  // "a b": older files
        const std::string s = m.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail(field, "expected \"left right\", got \"" + s + "\"");
        add_merge(s.substr(0, sp), s.substr(sp + 1), r, field, true);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
        add_merge(m[0].get<std::string>(), m[1].get<std::string>(), r, field, true);
      } else {
        fail(field, "expected \"left right\" or [\"left\", \"right\"]");
      }
    }
    if (const auto* u = member(*model, "unk_token")) {
      if (!u->is_string()) fail("model.unk_token", "expected a string");
      auto it = model_vocab_.find(u->get<std::string>());
      if (it == model_vocab_.end()) fail("model.unk_token", "token '" + u->get<std::string>() + "' is not in the vocabulary");
      unk_token_id_ = it->second;
    }

    if (const auto* added = member(j, "added_tokens")) {
      if (!added->is_array()) fail("added_tokens", "expected an array");
      std::map<std::int32_t, std::size_t> added_ids;  // id -> its entry, so a repeat is named
      for (std::size_t i = 0; i < added->size(); ++i) {
        const auto& a = (*added)[i];
        const std::string field = "added_tokens[" + std::to_string(i) + "]";
        if (!a.is_object() || !member(a, "id") || !member(a, "content") || !a["id"].is_number_integer() || !a["content"].is_string())
          fail(field, "expected an object with integer \"id\" and string \"content\"");
        AddedToken t;
        t.content = a["content"].get<std::string>();
        const auto id = a["id"].get<std::int64_t>();
        if (id < 0 || id > INT32_MAX) fail(field + ".id", "id " + std::to_string(id) + " is out of range");
        t.id = static_cast<std::int32_t>(id);
        if (t.content.empty()) fail(field + ".content", "an added token cannot be empty");
        if (auto [it, fresh] = added_ids.emplace(t.id, i); !fresh)
          fail(field + ".id", "id " + std::to_string(id) + " is also added_tokens[" + std::to_string(it->second) + "]'s");
        auto flag = [&](const char* k, bool dflt) {
          const auto* v = member(a, k);
          return v && v->is_boolean() ? v->get<bool>() : dflt;
        };
        t.special = flag("special", false);
        t.single_word = flag("single_word", false);
        t.lstrip = flag("lstrip", false);
        t.rstrip = flag("rstrip", false);
        t.normalized = flag("normalized", !t.special);
        set_token(t.id, t.content);
        added_.push_back(std::move(t));
      }
    }

    load_normalizer(member(j, "normalizer"), "normalizer");
    if (const auto* pre = member(j, "pre_tokenizer")) load_pre(*pre, "pre_tokenizer");
    // SentencePiece-style: characters as symbols, spaces as "▁" (by the normalizer or Metaspace).
    const bool spaces_replaced = std::any_of(norms_.begin(), norms_.end(), [](const NormStep& n) {
      return n.kind == NormStep::replace && n.a == " " && n.b == detail::kSpmSpace;
    });
    spm_ = !byte_level_ && (byte_fallback_ || metaspace_ || spaces_replaced);
    if (!byte_level_ && !spm_)
      fail("pre_tokenizer", "neither byte-level BPE (a ByteLevel pre-tokenizer) nor SentencePiece-style BPE (model.byte_fallback, "
                            "a Metaspace pre-tokenizer or a \" \" -> \"\u2581\" normalizer): not supported");
    if (byte_level_ && byte_fallback_) fail("model.byte_fallback", "byte fallback with a ByteLevel pre-tokenizer is not supported");
    if (const auto* dec = member(j, "decoder")) load_decoder(*dec, "decoder");
    if (const auto* post = member(j, "post_processor")) load_post(*post, "post_processor");
    if (!prefix_.empty() && !bos_id_) bos_id_ = prefix_.front();
    finish();
  }

  void load_normalizer(const nlohmann::json* n, const std::string& field) {
    if (!n) return;
    const auto* type = member(*n, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (t == "NFC") {
      norms_.push_back({NormStep::nfc, {}, {}});
    } else if (t == "Prepend") {
      const auto* a = member(*n, "prepend");
      if (!a || !a->is_string()) fail(field + ".prepend", "expected a string");
      norms_.push_back({NormStep::prepend, a->get<std::string>(), {}});
    } else if (t == "Replace") {
      norms_.push_back({NormStep::replace, string_pattern(*n, field), replacement_of(*n, field)});
    } else if (t == "Sequence") {
      const auto* list = member(*n, "normalizers");
      if (!list || !list->is_array()) fail(field + ".normalizers", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i)
        load_normalizer(&(*list)[i], field + ".normalizers[" + std::to_string(i) + "]");
    } else {
      fail(field + ".type", "unsupported normalizer '" + t + "' (supported: NFC, Prepend, Replace, Sequence)");
    }
  }

  // Replace's {"String": ...} pattern (a Regex pattern is not supported) and its content.
  std::string string_pattern(const nlohmann::json& n, const std::string& field) const {
    const auto* pat = member(n, "pattern");
    const auto* st = pat ? member(*pat, "String") : nullptr;
    if (!st || !st->is_string()) fail(field + ".pattern", "expected {\"String\": ...} (a Regex pattern is not supported)");
    if (st->get<std::string>().empty()) fail(field + ".pattern", "an empty pattern");
    return st->get<std::string>();
  }
  std::string replacement_of(const nlohmann::json& n, const std::string& field) const {
    const auto* c = member(n, "content");
    if (!c || !c->is_string()) fail(field + ".content", "expected a string");
    return c->get<std::string>();
  }

  // Metaspace's fields, from a pre-tokenizer or a decoder (older files: add_prefix_space).
  Metaspace metaspace_of(const nlohmann::json& p, const std::string& field) const {
    Metaspace m;
    if (const auto* r = member(p, "replacement")) {
      if (!r->is_string() || r->get<std::string>().empty()) fail(field + ".replacement", "expected a character");
      m.replacement = r->get<std::string>();
    }
    if (const auto* sc = member(p, "prepend_scheme")) {
      const std::string v = sc->is_string() ? sc->get<std::string>() : "";
      if (v == "always") m.scheme = Metaspace::always;
      else if (v == "first") m.scheme = Metaspace::first;
      else if (v == "never") m.scheme = Metaspace::never;
      else fail(field + ".prepend_scheme", "expected \"always\", \"first\" or \"never\"");
    } else if (const auto* a = member(p, "add_prefix_space"); a && a->is_boolean()) {
      m.scheme = a->get<bool>() ? Metaspace::always : Metaspace::never;
    }
    if (const auto* sp = member(p, "split"); sp && sp->is_boolean()) m.split = sp->get<bool>();
    return m;
  }

  static Behavior parse_behavior(const std::string& s, bool& ok) {
    ok = true;
    std::string l;
    for (char c : s) l += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
    if (l == "removed") return Behavior::removed;
    if (l == "isolated") return Behavior::isolated;
    if (l == "mergedwithprevious") return Behavior::merged_with_previous;
    if (l == "mergedwithnext") return Behavior::merged_with_next;
    if (l == "contiguous") return Behavior::contiguous;
    ok = false;
    return Behavior::isolated;
  }

  static std::string regex_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
      out += c;
    }
    return out;
  }

  void load_pre(const nlohmann::json& p, const std::string& field) {
    const auto* type = member(p, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (byte_level_) fail(field, "a pre-tokenizer after ByteLevel is not supported");
    if (t == "Sequence") {
      const auto* list = member(p, "pretokenizers");
      if (!list || !list->is_array()) fail(field + ".pretokenizers", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i) load_pre((*list)[i], field + ".pretokenizers[" + std::to_string(i) + "]");
      return;
    }
    if (t == "Metaspace") {
      if (!steps_.empty() || metaspace_) fail(field, "Metaspace is only supported as the first pre-tokenizer");
      metaspace_ = metaspace_of(p, field);
      return;
    }
    PreStep s;
    if (t == "ByteLevel") {
      if (metaspace_) fail(field, "ByteLevel after Metaspace is not supported");
      byte_level_ = true;
      if (const auto* a = member(p, "add_prefix_space"); a && a->is_boolean() && a->get<bool>()) {
        if (!steps_.empty()) fail(field + ".add_prefix_space", "only supported when ByteLevel is the first pre-tokenizer");
        add_prefix_space_ = true;
      }
      const auto* u = member(p, "use_regex");
      if (u && u->is_boolean() && !u->get<bool>()) return;
      s.kind = PreStep::byte_level;
      s.re = std::make_shared<detail::Regex>(detail::kGpt2Regex, source_);
    } else if (t == "Split") {
      const auto* pat = member(p, "pattern");
      if (!pat || !pat->is_object()) fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      std::string re;
      if (const auto* r = member(*pat, "Regex"); r && r->is_string()) re = r->get<std::string>();
      else if (const auto* st = member(*pat, "String"); st && st->is_string()) re = regex_escape(st->get<std::string>());
      else fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      s.re = std::make_shared<detail::Regex>(re, source_ + ": " + field + ".pattern");
      bool ok = false;
      const auto* b = member(p, "behavior");
      s.behavior = parse_behavior(b && b->is_string() ? b->get<std::string>() : "", ok);
      if (!ok) fail(field + ".behavior", "unknown split behavior");
      if (const auto* inv = member(p, "invert")) s.invert = inv->is_boolean() && inv->get<bool>();
    } else if (t == "Digits") {
      s.kind = PreStep::digits;
      if (const auto* d = member(p, "individual_digits")) s.individual_digits = d->is_boolean() && d->get<bool>();
    } else if (t == "WhitespaceSplit") {  // Rust's char::is_whitespace is White_Space, as \s
      s.re = std::make_shared<detail::Regex>(R"(\s+)", source_);
      s.behavior = Behavior::removed;
    } else {
      // Whitespace and Punctuation are left out on purpose: `tokenizers` implements them with
      // its own character classes (older Unicode data, ZWJ as a word character), which no
      // byte-level BPE uses; a near miss would give wrong ids silently.
      fail(field + ".type", "unsupported pre-tokenizer '" + t + "'");
    }
    steps_.push_back(std::move(s));
  }

  // Byte-level files decode with ByteLevel only (the byte table); SentencePiece-style files with
  // a chain of Replace / ByteFallback / Fuse / Strip / Metaspace, kept in decoders_.
  void load_decoder(const nlohmann::json& d, const std::string& field) {
    const auto* type = member(d, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (t == "Sequence") {
      const auto* list = member(d, "decoders");
      if (!list || !list->is_array()) fail(field + ".decoders", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i) load_decoder((*list)[i], field + ".decoders[" + std::to_string(i) + "]");
      return;
    }
    if (byte_level_) {
      if (t == "ByteLevel") return;
      fail(field + ".type", "unsupported decoder '" + t + "' (byte-level BPE decodes with ByteLevel)");
    }
    DecStep s;
    if (t == "Replace") {
      s = {DecStep::replace, string_pattern(d, field), replacement_of(d, field)};
    } else if (t == "ByteFallback") {
      s.kind = DecStep::byte_fallback;
    } else if (t == "Fuse") {
      s.kind = DecStep::fuse;
    } else if (t == "Strip") {
      s.kind = DecStep::strip;
      const auto* c = member(d, "content");
      if (!c || !c->is_string()) fail(field + ".content", "expected a character");
      s.a = c->get<std::string>();
      std::size_t at = 0;
      if (s.a.empty() || (utf8_next(s.a, at), at != s.a.size())) fail(field + ".content", "expected one character");
      for (auto [key, dst] : {std::pair{"start", &s.start}, std::pair{"stop", &s.stop}}) {
        const auto* v = member(d, key);
        if (v && (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<std::int64_t>() >= 0)))
          fail(field + "." + key, "expected a count");
        if (v) *dst = v->get<std::size_t>();
      }
    } else if (t == "Metaspace") {
      const Metaspace m = metaspace_of(d, field);
      s.kind = DecStep::metaspace;
      s.a = m.replacement;
      s.prepend = m.scheme != Metaspace::never;
    } else {
      fail(field + ".type", "unsupported decoder '" + t + "' (SentencePiece-style BPE: Replace, ByteFallback, Fuse, Strip, Metaspace)");
    }
    decoders_.push_back(std::move(s));
  }

  /// One decoder over the token strings, as `tokenizers`' decode_chain does it.
  void run_decoder(const DecStep& d, std::vector<std::string>& toks) const {
    switch (d.kind) {
      case DecStep::replace:
        for (auto& t : toks) t = replace_all(t, d.a, d.b);
        break;
      case DecStep::byte_fallback: {
        // A run of byte tokens becomes its bytes if they are valid UTF-8, else one U+FFFD per byte.
        std::vector<std::string> out;
        std::string run;
        std::size_t run_n = 0;
        auto flush = [&] {
          if (run_n == 0) return;
          if (utf8_lossy(run) == run) out.push_back(run);
          else for (std::size_t k = 0; k < run_n; ++k) out.emplace_back("\xEF\xBF\xBD");
          run.clear();
          run_n = 0;
        };
        for (auto& t : toks) {
          const int b = detail::spm_byte_token(t);
          if (b >= 0) {
            run += static_cast<char>(b);
            ++run_n;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        toks = std::move(out);
        break;
      }
      case DecStep::fuse: {
        std::string all;
        for (const auto& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecStep::strip:
        for (auto& t : toks) {
          std::size_t b = 0, e = t.size();
          for (std::size_t k = 0; k < d.start && t.compare(b, d.a.size(), d.a) == 0 && b < e; ++k) b += d.a.size();
          for (std::size_t k = 0; k < d.stop && e >= b + d.a.size() && t.compare(e - d.a.size(), d.a.size(), d.a) == 0; ++k)
            e -= d.a.size();
          t = t.substr(b, e - b);
        }
        break;
      case DecStep::metaspace:
        // The replacement is a space, except in the first token, where it is dropped (the
        // prefix the pre-tokenizer put there) unless the scheme is "never".
        for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = replace_all(toks[i], d.a, i == 0 && d.prepend ? "" : " ");
        break;
    }
  }

  static std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0;;) {
      const std::size_t k = s.find(from, i);
      if (k == std::string_view::npos) {
        out.append(s.substr(i));
        return out;
      }
      out.append(s.substr(i, k - i));
      out.append(to);
      i = k + from.size();
    }
  }

  std::string normalize(std::string_view seg) const {
    std::string s(seg);
    for (const NormStep& n : norms_) {
      if (n.kind == NormStep::nfc) s = nn::lm::nfc(s);
      else if (n.kind == NormStep::prepend) s = s.empty() ? s : n.a + s;  // tokenizers' Prepend skips empty text
      else s = replace_all(s, n.a, n.b);
    }
    return s;
  }

  std::int32_t special_id(const nlohmann::json& v, const std::string& field) {
    // A token given as a string, or as [string, id] (Roberta/Bert processors).
    std::string tok;
    if (v.is_string()) tok = v.get<std::string>();
    else if (v.is_array() && !v.empty() && v[0].is_string()) tok = v[0].get<std::string>();
    else fail(field, "expected a token");
    auto it = token_to_id_.find(tok);
    if (it == token_to_id_.end()) fail(field, "token '" + tok + "' is not in the vocabulary");
    return it->second;
  }

  void load_post(const nlohmann::json& p, const std::string& field) {
    const auto* type = member(p, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (t == "ByteLevel") return;  // offsets only
    if (t == "Sequence") {
      const auto* list = member(p, "processors");
      if (!list || !list->is_array()) fail(field + ".processors", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i) load_post((*list)[i], field + ".processors[" + std::to_string(i) + "]");
      return;
    }
    if (t == "TemplateProcessing") {
      const auto* single = member(p, "single");
      if (!single || !single->is_array()) fail(field + ".single", "expected an array");
      const auto* specials = member(p, "special_tokens");
      bool seen_a = false;
      for (std::size_t i = 0; i < single->size(); ++i) {
        const auto& item = (*single)[i];
        const std::string f = field + ".single[" + std::to_string(i) + "]";
        if (const auto* seq = member(item, "Sequence")) {
          if (seen_a) fail(f, "a single-sequence template with the sequence twice");
          (void)seq;
          seen_a = true;
        } else if (const auto* sp = member(item, "SpecialToken")) {
          const auto* id = member(*sp, "id");
          if (!id || !id->is_string()) fail(f + ".SpecialToken.id", "expected a string");
          const std::string name = id->get<std::string>();
          std::vector<std::int32_t> ids;
          const nlohmann::json* entry = specials ? member(*specials, name.c_str()) : nullptr;
          if (entry) {
            const auto* list = member(*entry, "ids");
            if (!list || !list->is_array()) fail(field + ".special_tokens." + name + ".ids", "expected an array");
            for (const auto& x : *list) {  // ids the encoder emits as they are: each must be a token
              const std::int64_t v = x.is_number_integer() ? x.get<std::int64_t>() : -1;
              if (v < 0 || v > INT32_MAX || static_cast<std::size_t>(v) >= valid_.size() || !valid_[static_cast<std::size_t>(v)])
                fail(field + ".special_tokens." + name + ".ids", "id " + x.dump() + " is not in the vocabulary");
              ids.push_back(static_cast<std::int32_t>(v));
            }
          } else {
            auto it = token_to_id_.find(name);
            if (it == token_to_id_.end()) fail(f, "special token '" + name + "' is not in special_tokens or the vocabulary");
            ids.push_back(it->second);
          }
          auto& dst = seen_a ? suffix_ : prefix_;
          dst.insert(dst.end(), ids.begin(), ids.end());
        } else {
          fail(f, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
      return;
    }
    if (t == "RobertaProcessing" || t == "BertProcessing") {
      const auto* cls = member(p, "cls");
      const auto* sep = member(p, "sep");
      if (!cls || !sep) fail(field, "missing cls or sep");
      prefix_.push_back(special_id(*cls, field + ".cls"));
      suffix_.push_back(special_id(*sep, field + ".sep"));
      return;
    }
    fail(field + ".type", "unsupported post-processor '" + t + "'");
  }

  void load_gguf(const GgufTokenizerData& d) {
    if (d.model != "gpt2" && d.model != "llama")
      nn::detail::fail(source_, "tokenizer.ggml.model: unsupported tokenizer model '", d.model,
                       "' (supported: \"gpt2\", byte-level BPE; \"llama\", SentencePiece BPE)");
    const bool llama = d.model == "llama";
    if (!d.token_types.empty() && d.token_types.size() != d.tokens.size())
      nn::detail::fail(source_, "tokenizer.ggml.token_type: ", d.token_types.size(), " entries for ", d.tokens.size(), " tokens");
    if (llama && !d.scores.empty() && d.scores.size() != d.tokens.size())
      nn::detail::fail(source_, "tokenizer.ggml.scores: ", d.scores.size(), " entries for ", d.tokens.size(), " tokens");
    // llama.cpp ignores tokenizer.ggml.pre (and any merges) for SentencePiece models.
    const detail::GgufPre pre = llama ? detail::GgufPre{} : detail::gguf_pre(d.pre, source_);
    token_to_id_.reserve(d.tokens.size());
    model_vocab_.reserve(d.tokens.size());
    id_to_token_.reserve(d.tokens.size());
    for (std::size_t i = 0; i < d.tokens.size(); ++i) {
      const auto id = static_cast<std::int32_t>(i);
      const std::string field = "tokenizer.ggml.tokens[" + std::to_string(i) + "]";
      const std::string& tok = d.tokens[i];
      // Byte-level tokens are printable code points, each standing for one byte: valid UTF-8.
      for (std::size_t k = 0; k < tok.size();) {
        const std::size_t at = k;
        if (utf8_next(tok, k) == kInvalidByte)
          fail(field, "not valid UTF-8 (byte " + std::to_string(static_cast<unsigned char>(tok[at])) + " at offset " +
                          std::to_string(at) + ")");
      }
      if (auto it = token_to_id_.find(tok); it != token_to_id_.end())
        fail(field, "token \"" + tok + "\" is already tokens[" + std::to_string(it->second) +
                        "] (llama.cpp would map it to one id only)");
      const std::int32_t raw_type = d.token_types.empty() ? 1 : d.token_types[i];
      if (raw_type < 0 || raw_type > static_cast<std::int32_t>(TokenType::byte))
        fail("tokenizer.ggml.token_type[" + std::to_string(i) + "]",
             std::to_string(raw_type) + " is not a token type (0 undefined .. 6 byte)");
      const auto type = static_cast<TokenType>(raw_type);
      set_token(id, tok);
      if (type == TokenType::control || type == TokenType::user_defined || type == TokenType::unknown) {
        // llama.cpp splits all three out of the raw text; user-defined ones even without
        // parse_special, which is what special=false gives here.
        AddedToken a;
        a.content = d.tokens[i];
        a.id = id;
        a.special = type != TokenType::user_defined;
        added_.push_back(std::move(a));
      } else {
        model_vocab_[d.tokens[i]] = id;
      }
    }
    if (llama) {
      spm_ = spm_scores_ = true;
      scores_ = d.scores;
      scores_.resize(d.tokens.size(), 0.0f);
      // llama.cpp puts a " " before each stretch of text, then spaces become "▁": tokenizers'
      // Prepend + Replace normalizers give the same; decoding undoes both.
      const bool space_prefix = d.add_space_prefix.value_or(true);
      if (space_prefix) norms_.push_back({NormStep::prepend, detail::kSpmSpace, {}});
      norms_.push_back({NormStep::replace, " ", detail::kSpmSpace});
      decoders_ = {{DecStep::replace, detail::kSpmSpace, " "}, {DecStep::byte_fallback, {}, {}}, {DecStep::fuse, {}, {}}};
      if (space_prefix) decoders_.push_back({DecStep::strip, " ", {}, 1, 0});
    }
    merges_.reserve(llama ? 0 : d.merges.size());
    for (std::size_t r = 0; r < (llama ? 0 : d.merges.size()); ++r) {
      const std::string& s = d.merges[r];
      const std::string field = "tokenizer.ggml.merges[" + std::to_string(r) + "]";
      // The separator is the first space after the first character (a token never starts
      // with a raw space in byte-level form, but be exact anyway).
      const auto sp = s.find(' ', 1);
      if (sp == std::string::npos) fail(field, "expected \"left right\", got \"" + s + "\"");
      add_merge(s.substr(0, sp), s.substr(sp + 1), r, field, false);
    }
    for (const auto& re : pre.regexes) {
      PreStep s;
      s.re = std::make_shared<detail::Regex>(re, source_ + ": tokenizer.ggml.pre");
      steps_.push_back(std::move(s));
    }
    byte_level_ = !llama;
    ignore_merges_ = pre.ignore_merges;
    auto check = [&](const std::optional<std::int32_t>& id, const char* field) {
      if (id && (*id < 0 || static_cast<std::size_t>(*id) >= d.tokens.size()))
        nn::detail::fail(source_, field, ": id ", *id, " is outside the vocabulary (", d.tokens.size(), " tokens)");
    };
    check(d.bos_id, "tokenizer.ggml.bos_token_id");
    check(d.eos_id, "tokenizer.ggml.eos_token_id");
    check(d.pad_id, "tokenizer.ggml.padding_token_id");
    check(d.unk_id, "tokenizer.ggml.unknown_token_id");
    bos_id_ = d.bos_id;
    eos_id_ = d.eos_id;
    pad_id_ = d.pad_id;
    unk_token_id_ = d.unk_id;
    if (d.add_bos.value_or(llama || pre.add_bos)) {  // llama.cpp: SentencePiece models add BOS by default
      if (!d.bos_id) nn::detail::fail(source_, "tokenizer.ggml.add_bos_token: set but there is no bos_token_id");
      prefix_.push_back(*d.bos_id);
    }
    if (d.add_eos.value_or(false)) {
      if (!d.eos_id) nn::detail::fail(source_, "tokenizer.ggml.add_eos_token: set but there is no eos_token_id");
      suffix_.push_back(*d.eos_id);
    }
    finish();
  }

  // ---- added tokens --------------------------------------------------------------------------

  /// Calls f(segment, -1) for text and f({}, id) for each added token found, in order.
  template <class F>
  void split_added(std::string_view text, const AddedSet& set, bool parse_special, F&& f) const {
    if (set.toks.empty()) {
      if (!text.empty()) f(text, -1);
      return;
    }
    std::size_t start = 0;  // start of the pending text
    std::size_t i = 0;
    while (i < text.size()) {
      const AddedToken* hit = nullptr;
      for (std::uint32_t k : set.by_first[static_cast<unsigned char>(text[i])]) {
        const AddedToken& t = set.toks[k];
        if (t.special && !parse_special) continue;
        if (text.compare(i, t.content.size(), t.content) != 0) continue;
        if (t.single_word && !single_word_ok(text, i, i + t.content.size())) continue;
        hit = &t;
        break;
      }
      if (!hit) {
        ++i;
        continue;
      }
      std::size_t b = i, e = i + hit->content.size();
      if (hit->lstrip)
        while (b > start && is_ascii_or_unicode_space_before(text, b)) b = prev_char(text, b);
      if (hit->rstrip)
        while (e < text.size() && is_space_at(text, e)) e = next_char(text, e);
      if (b > start) f(text.substr(start, b - start), -1);
      f(std::string_view{}, hit->id);
      start = i = e;
    }
    if (start < text.size()) f(text.substr(start), -1);
  }

  static std::size_t prev_char(std::string_view s, std::size_t i) {
    do --i;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80);
    return i;
  }
  static std::size_t next_char(std::string_view s, std::size_t i) {
    utf8_next(s, i);
    return i;
  }
  static bool is_space_at(std::string_view s, std::size_t i) {
    const char32_t c = utf8_next(s, i);
    return c != kInvalidByte && is_whitespace(c);
  }
  static bool is_ascii_or_unicode_space_before(std::string_view s, std::size_t i) {
    return is_space_at(s, prev_char(s, i));
  }
  static bool single_word_ok(std::string_view s, std::size_t b, std::size_t e) {
    auto word = [](char32_t c) { return c != kInvalidByte && detail::is_word_char(c, general_category(c)); };
    if (b > 0) {
      std::size_t p = prev_char(s, b);
      if (word(utf8_next(s, p))) return false;
    }
    if (e < s.size()) {
      std::size_t p = e;
      if (word(utf8_next(s, p))) return false;
    }
    return true;
  }

  // ---- pre-tokenization ----------------------------------------------------------------------

  struct Piece {
    std::uint32_t b, e;  // code point indices
  };

  /// Splits `pieces` with the step, writing into `out`.
  void apply_step(const PreStep& s, const std::vector<char32_t>& cps, const std::vector<Gc>& gcs,
                  const std::vector<Piece>& pieces, std::vector<Piece>& out) const {
    out.clear();
    thread_local std::vector<std::pair<Piece, bool>> parts;  // (range, is delimiter)
    for (const Piece& p : pieces) {
      parts.clear();
      std::uint32_t prev = p.b;
      auto delim = [&](std::uint32_t b, std::uint32_t e) {
        if (b > prev) parts.push_back({{prev, b}, false});
        parts.push_back({{b, e}, true});
        prev = e;
      };
      Behavior behavior = s.behavior;
      bool invert = s.invert;
      if (s.kind == PreStep::split || s.kind == PreStep::byte_level) {
        s.re->find_all(cps.data() + p.b, gcs.data() + p.b, p.e - p.b,
                       [&](std::size_t b, std::size_t e) { delim(p.b + static_cast<std::uint32_t>(b), p.b + static_cast<std::uint32_t>(e)); });
        if (s.kind == PreStep::byte_level) behavior = Behavior::isolated, invert = false;
      } else {
        // Digits: Rust's char::is_numeric, i.e. Nd, Nl and No.
        for (std::uint32_t i = p.b; i < p.e; ++i)
          if (is_number(gcs[i])) delim(i, i + 1);
        behavior = s.individual_digits ? Behavior::isolated : Behavior::contiguous;
        invert = false;
      }
      if (p.e > prev) parts.push_back({{prev, p.e}, false});
      if (invert)
        for (auto& x : parts) x.second = !x.second;
      emit_parts(parts, behavior, out);
    }
  }

  static void emit_parts(const std::vector<std::pair<Piece, bool>>& parts, Behavior behavior, std::vector<Piece>& out) {
    switch (behavior) {
      case Behavior::removed:
        for (const auto& [r, d] : parts)
          if (!d) out.push_back(r);
        return;
      case Behavior::isolated:
        for (const auto& x : parts) out.push_back(x.first);
        return;
      case Behavior::merged_with_previous: {
        bool prev_is_delim_free = false;  // can the next delimiter join the last piece out?
        for (const auto& [r, d] : parts) {
          if (d && prev_is_delim_free && !out.empty()) {
            out.back().e = r.e;
            prev_is_delim_free = false;
          } else {
            out.push_back(r);
            prev_is_delim_free = !d;
          }
        }
        return;
      }
      case Behavior::merged_with_next: {
        bool pending = false;
        for (const auto& [r, d] : parts) {
          if (pending && !d) {
            out.back().e = r.e;
            pending = false;
          } else {
            out.push_back(r);
            pending = d;
          }
        }
        return;
      }
      case Behavior::contiguous: {
        bool last_delim = false;
        for (const auto& [r, d] : parts) {
          if (d && last_delim && !out.empty()) out.back().e = r.e;
          else out.push_back(r);
          last_delim = d;
        }
        return;
      }
    }
  }

  /// Calls f(word bytes) for each pre-tokenized word of an already normalized segment; `first`:
  /// the segment starts the input (Metaspace's prepend_scheme "first").
  template <class F>
  void for_each_word(std::string_view seg, bool first, F&& f) const {
    if (!metaspace_) return split_words(seg, f);
    const Metaspace& m = *metaspace_;
    if (seg.empty()) return;
    std::string ms = replace_all(seg, " ", m.replacement);
    const bool starts = ms.compare(0, m.replacement.size(), m.replacement) == 0;
    if (!starts && (m.scheme == Metaspace::always || (m.scheme == Metaspace::first && first))) ms.insert(0, m.replacement);
    if (!m.split) return split_words(ms, f);
    // Cut before each replacement character (tokenizers' MergedWithNext).
    std::string_view v = ms;
    std::size_t b = 0;
    for (std::size_t k = v.find(m.replacement, 1); k != std::string_view::npos; k = v.find(m.replacement, k + 1)) {
      if (k > b) split_words(v.substr(b, k - b), f);
      b = k;
    }
    split_words(v.substr(b), f);
  }

  /// The pre-tokenizer steps after Metaspace (all of them when there is none).
  template <class F>
  void split_words(std::string_view seg, F&& f) const {
    std::string prefixed;
    if (add_prefix_space_ && !seg.empty() && seg.front() != ' ') {
      prefixed.reserve(seg.size() + 1);
      prefixed += ' ';
      prefixed += seg;
      seg = prefixed;
    }
    if (seg.empty()) return;
    if (steps_.empty()) {
      f(seg);
      return;
    }
    thread_local std::vector<char32_t> cps;
    thread_local std::vector<Gc> gcs;
    thread_local std::vector<std::uint32_t> offs;
    thread_local std::vector<Piece> a, b;
    cps.clear();
    gcs.clear();
    offs.clear();
    for (std::size_t i = 0; i < seg.size();) {
      offs.push_back(static_cast<std::uint32_t>(i));
      const char32_t c = utf8_next(seg, i);
      cps.push_back(c);
      gcs.push_back(c == kInvalidByte ? Gc::Cn : general_category(c));
    }
    offs.push_back(static_cast<std::uint32_t>(seg.size()));
    a.assign(1, Piece{0, static_cast<std::uint32_t>(cps.size())});
    for (const auto& s : steps_) {
      apply_step(s, cps, gcs, a, b);
      std::swap(a, b);
    }
    for (const Piece& p : a)
      if (p.e > p.b) f(seg.substr(offs[p.b], offs[p.e] - offs[p.b]));
  }

  // ---- BPE -----------------------------------------------------------------------------------

  void encode_word(std::string_view w, std::vector<std::int32_t>& out, detail::WordCache* cache) const {
    const bool cacheable = cache && w.size() <= detail::WordCache::kMaxWord;
    const std::uint64_t h = cacheable ? detail::hash_bytes(w) : 0;
    if (cacheable && cache->find(w, h, out)) return;
    const std::size_t at = out.size();
    // ignore_merges (Llama-3): a word that is a token is that token, whatever the merges say.
    auto it = ignore_merges_ ? raw_vocab_.find(w) : raw_vocab_.end();
    if (it != raw_vocab_.end()) out.push_back(it->second);
    else if (spm_scores_) spm_merge(w, out);
    else bpe(w, out);
    if (cacheable) cache->insert(w, h, out.data() + at, out.size() - at);
  }

  /// Merges the word's byte symbols, lowest rank first and leftmost among equals, as
  /// `tokenizers`' Word::merge_all (a heap of candidate merges, stale entries skipped).
  void bpe(std::string_view w, std::vector<std::int32_t>& out) const {
    struct Sym {
      std::int32_t id, prev, next;
      bool alive;
    };
    thread_local std::vector<Sym> syms;
    syms.clear();
    auto add = [&](std::int32_t id) {
      const auto n = static_cast<std::int32_t>(syms.size());
      syms.push_back({id, n - 1, n + 1, true});
    };
    // A symbol with no token: <unk> if the model has one (fused with a preceding <unk> when
    // fuse_unk), else dropped, as `tokenizers` does.
    auto add_unk = [&] {
      if (!unk_token_id_) return;
      if (fuse_unk_ && !syms.empty() && syms.back().id == *unk_token_id_) return;
      add(*unk_token_id_);
    };
    if (spm_) {
      // SentencePiece-style: one symbol per character; a character not in the vocabulary is
      // its byte tokens when byte_fallback has them all, else <unk>.
      for (std::size_t i = 0; i < w.size();) {
        const std::size_t b = i;
        utf8_next(w, i);  // an invalid byte is a character of its own
        if (auto it = model_vocab_.find(w.substr(b, i - b)); it != model_vocab_.end()) {
          add(it->second);
          continue;
        }
        bool bytes = byte_fallback_;
        for (std::size_t k = b; bytes && k < i; ++k) bytes = byte_id_[static_cast<unsigned char>(w[k])] >= 0;
        if (!bytes) {
          add_unk();
          continue;
        }
        for (std::size_t k = b; k < i; ++k) add(byte_id_[static_cast<unsigned char>(w[k])]);
      }
    } else {
      for (unsigned char c : w) {
        if (byte_id_[c] < 0) add_unk();
        else add(byte_id_[c]);
      }
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    if (syms.size() == 1) {
      out.push_back(syms[0].id);
      return;
    }
    struct Cand {
      std::int32_t rank, pos, new_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    thread_local std::vector<Cand> heap;
    heap.clear();
    auto push = [&](std::int32_t pos) {
      const std::int32_t nx = syms[static_cast<std::size_t>(pos)].next;
      if (nx < 0) return;
      if (const auto* m = merges_.find(syms[static_cast<std::size_t>(pos)].id, syms[static_cast<std::size_t>(nx)].id)) {
        heap.push_back({m->first, pos, m->second});
        std::push_heap(heap.begin(), heap.end(), std::greater<>{});
      }
    };
    for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(syms.size()); ++i) push(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
      const Cand c = heap.back();
      heap.pop_back();
      Sym& l = syms[static_cast<std::size_t>(c.pos)];
      if (!l.alive || l.next < 0) continue;
      Sym& r = syms[static_cast<std::size_t>(l.next)];
      const auto* m = merges_.find(l.id, r.id);
      if (!m || m->second != c.new_id) continue;  // stale: a neighbour changed since it was queued
      l.id = c.new_id;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = c.pos;
      if (l.prev >= 0) push(l.prev);
      push(c.pos);
    }
    for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) out.push_back(syms[static_cast<std::size_t>(i)].id);
  }

  /// llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm): symbols are UTF-8 characters (by
  /// their lead byte); repeatedly join the adjacent pair whose joined text is the token with the
  /// highest score, leftmost on ties; a final symbol that is no token becomes its byte tokens.
  /// (llama.cpp also re-splits a joined symbol that is no token along the joins that made it,
  /// but a join only happens when the joined text is a token, so that never applies.)
  void spm_merge(std::string_view w, std::vector<std::int32_t>& out) const {
    struct Sym {
      std::uint32_t start, n;
      std::int32_t prev, next;
    };
    struct Bigram {
      float score;
      std::int32_t left, right;
      std::uint32_t size;
    };
    // Heap order: highest score on top, then the leftmost.
    auto lower = [](const Bigram& x, const Bigram& y) { return x.score < y.score || (x.score == y.score && x.left > y.left); };
    thread_local std::vector<Sym> syms;
    thread_local std::vector<Bigram> heap;
    syms.clear();
    heap.clear();
    static constexpr std::uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    for (std::size_t i = 0; i < w.size();) {
      const std::size_t len = std::min<std::size_t>(w.size() - i, kLen[static_cast<unsigned char>(w[i]) >> 4]);
      const auto n = static_cast<std::int32_t>(syms.size());
      syms.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(len), n - 1, n + 1});
      i += len;
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    auto try_add = [&](std::int32_t l, std::int32_t r) {
      if (l < 0 || r < 0) return;
      const Sym& a = syms[static_cast<std::size_t>(l)];
      const std::uint32_t size = a.n + syms[static_cast<std::size_t>(r)].n;
      auto it = token_to_id_.find(w.substr(a.start, size));
      if (it == token_to_id_.end() || static_cast<std::size_t>(it->second) >= scores_.size()) return;
      heap.push_back({scores_[static_cast<std::size_t>(it->second)], l, r, size});
      std::push_heap(heap.begin(), heap.end(), lower);
    };
    for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(syms.size()); ++i) try_add(i, i + 1);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), lower);
      const Bigram bg = heap.back();
      heap.pop_back();
      Sym& l = syms[static_cast<std::size_t>(bg.left)];
      Sym& r = syms[static_cast<std::size_t>(bg.right)];
      if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;  // stale: a side changed since
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = bg.left;
      try_add(l.prev, bg.left);
      try_add(bg.left, l.next);
    }
    for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) {
      const Sym& a = syms[static_cast<std::size_t>(i)];
      const std::string_view text = w.substr(a.start, a.n);
      if (auto it = token_to_id_.find(text); it != token_to_id_.end()) {
        out.push_back(it->second);
        continue;
      }
      for (char c : text) {
        std::int32_t id = byte_id_[static_cast<unsigned char>(c)];
        if (id < 0)
          if (auto it = token_to_id_.find(std::string_view(&c, 1)); it != token_to_id_.end()) id = it->second;
        if (id < 0)
          nn::detail::fail(source_, ": encode: byte 0x", "0123456789ABCDEF"[(c >> 4) & 15], "0123456789ABCDEF"[c & 15],
                           " has no token (no <0x", "0123456789ABCDEF"[(c >> 4) & 15], "0123456789ABCDEF"[c & 15],
                           "> byte token in the vocabulary)");
        out.push_back(id);
      }
    }
  }

  std::string source_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> valid_;
  detail::StringMap token_to_id_;  // vocabulary form, added tokens included
  detail::StringMap model_vocab_;  // the BPE model's own vocabulary
  detail::StringMap raw_vocab_;    // raw bytes -> id, for ignore_merges
  std::vector<std::string> id_bytes_;
  std::vector<bool> is_special_;
  std::array<std::int32_t, 256> byte_id_ = [] {
    std::array<std::int32_t, 256> a{};
    a.fill(-1);  // an empty tokenizer maps no byte
    return a;
  }();
  detail::PairMap merges_;
  std::vector<AddedToken> added_;
  AddedSet raw_added_, norm_added_;  // matched in the raw text / in the normalized text
  std::vector<PreStep> steps_;
  std::vector<std::int32_t> prefix_, suffix_;
  std::optional<std::int32_t> bos_id_, eos_id_, pad_id_, unk_token_id_;
  std::vector<NormStep> norms_;
  std::optional<Metaspace> metaspace_;
  std::vector<DecStep> decoders_;  // SentencePiece-style only (byte-level decodes by the byte table)
  std::vector<float> scores_;      // GGUF "llama": token scores for spm_merge
  bool byte_level_ = false, add_prefix_space_ = false, ignore_merges_ = false, fuse_unk_ = false;
  bool spm_ = false;          // SentencePiece-style: character symbols, "▁" spaces, byte fallback
  bool spm_scores_ = false;   // ... merged by token score (GGUF) rather than by merges
  bool byte_fallback_ = false;
  CacheHolder cache_;
};

}  // namespace nn::lm
// ---- end nn/lm/tokenizer.hpp ----
// ---- begin nn/lm/chat_template.hpp ----
// Chat templates: the Jinja subset that models' own templates (tokenizer_config.json's
// "chat_template", GGUF's tokenizer.chat_template) use, rendered as transformers'
// apply_chat_template renders them -- Jinja with trim_blocks and lstrip_blocks, loop controls,
// transformers' tojson (json.dumps, ensure_ascii=False), raise_exception, strftime_now and
// namespace. Checked byte for byte against transformers on the real templates of SmolLM2,
// Qwen2.5, Qwen3 and Llama 3.1 / 3.2 (tests/lm/chat_template.test.cpp).
//
//   nn::lm::ChatTemplate t(source);                   // parses; nn::Error naming line and construct
//   std::string text = t.apply(messages, true);       // messages: a JSON array of {"role", "content", ...}
//   std::string text = t.render({{"messages", m}, {"tools", tools}, {"bos_token", "<s>"}});
//
// What is there: text, {{ }}, {% %}, {# #} with "-" / "+" whitespace control; if / elif / else,
// for (one name or a tuple, an "if" filter, else, loop.index / index0 / revindex / revindex0 /
// first / last / length / previtem / nextitem), break / continue, set (a name, a namespace
// attribute, or a block), generation (transformers' tag: renders its body); literals (strings,
// numbers, true / false / none in either case, lists, dicts, tuples), attribute and item access,
// slices, calls, the operators of Jinja's grammar (if-else, or, and, not, comparisons, in, not in,
// + - ~ * / // % **, unary - +), filters (tojson, length / count, trim, join, items, first, last,
// string, lower, upper, capitalize, title, default / d, list, replace, int, float, abs, round,
// map, select, reject, selectattr, rejectattr, unique, sort, dictsort, reverse, safe, indent,
// wordcount, sum, min, max, batch-free), tests (defined, undefined, none, string, number, integer,
// float, boolean, true, false, mapping, iterable, sequence, callable, equalto / eq / ==, ne / !=,
// lt, le, gt, ge, in, odd, even, divisibleby, lower, upper, sameas), string methods (startswith,
// endswith, split, rsplit, strip, lstrip, rstrip, upper, lower, title, capitalize, replace, find,
// count, join, format-free), dict methods (items, keys, values, get), and the globals range,
// namespace, dict, raise_exception, strftime_now. Anything else -- macros, call blocks, includes,
// filter blocks, an unknown filter, test, method or tag -- is an nn::Error naming it and its line.
// Values are Python's: None renders as "None", True as "True", lists and dicts as their repr
// (tuples are lists here: printing one directly shows [..] where Python shows (..)).

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstdint>
#include <ctime>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>


namespace nn::lm {

namespace detail::jinja {

using Json = nlohmann::ordered_json;

// A template value: JSON data (insertion-ordered objects, as Python dicts), or one of Jinja's own
// kinds: undefined, a namespace (shared, so `set ns.x` is seen by every holder), a global
// function, or a method bound to its object.
struct Value {
  enum Kind { undefined, data, ns, func, method } kind = undefined;
  Json j;                           // data; the object of a method
  std::shared_ptr<Json> space;      // ns: an object
  std::string name;                 // func / method name; undefined: what was looked up (for errors)
  static Value of(Json v) {
    Value x;
    x.kind = data;
    x.j = std::move(v);
    return x;
  }
  static Value undef(std::string what = {}) {
    Value x;
    x.name = std::move(what);
    return x;
  }
  static Value fn(std::string n) {
    Value x;
    x.kind = func;
    x.name = std::move(n);
    return x;
  }
  bool is_undefined() const { return kind == undefined; }
  bool is_none() const { return kind == data && j.is_null(); }
  bool is_string() const { return kind == data && j.is_string(); }
};

[[noreturn]] inline void fail_at(const std::string& where, int line, const std::string& msg) {
  nn::detail::fail("chat_template", where, " line ", line, ": ", msg);
}

// ---- Python's str(), repr() and json.dumps ------------------------------------------------------

inline std::string py_float(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d > 0 ? "inf" : "-inf";
  // Python's repr: the shortest digits that round-trip; "1.0" for integral values below 1e16.
  std::string s = Json(d).dump();  // shortest round-trip digits; exponents as 1e+20 / 1e-07, as Python
  if (s.find_first_of(".eEn") == std::string::npos) s += ".0";
  return s;
}

inline void py_json_string(std::string& out, const std::string& s) {
  out += '"';
  for (unsigned char c : s) {
    switch (c) {
      case '"': out += "\\\""; break;
      case '\\': out += "\\\\"; break;
      case '\n': out += "\\n"; break;
      case '\r': out += "\\r"; break;
      case '\t': out += "\\t"; break;
      case '\b': out += "\\b"; break;
      case '\f': out += "\\f"; break;
      default:
        if (c < 0x20) {
          char buf[8];
          std::snprintf(buf, sizeof buf, "\\u%04x", c);
          out += buf;
        } else {
          out += static_cast<char>(c);
        }
    }
  }
  out += '"';
}

/// json.dumps(v, ensure_ascii=False, indent=indent) (indent < 0: None), as transformers' tojson.
inline void py_json(std::string& out, const Json& v, int indent, int level) {
  auto newline = [&](int lv) {
    out += '\n';
    out.append(static_cast<std::size_t>(indent * lv), ' ');
  };
  if (v.is_object()) {
    if (v.empty()) {
      out += "{}";
      return;
    }
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out += indent >= 0 ? "," : ", ";
      first = false;
      if (indent >= 0) newline(level + 1);
      py_json_string(out, it.key());
      out += ": ";
      py_json(out, it.value(), indent, level + 1);
    }
    if (indent >= 0) newline(level);
    out += '}';
  } else if (v.is_array()) {
    if (v.empty()) {
      out += "[]";
      return;
    }
    out += '[';
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) out += indent >= 0 ? "," : ", ";
      if (indent >= 0) newline(level + 1);
      py_json(out, v[i], indent, level + 1);
    }
    if (indent >= 0) newline(level);
    out += ']';
  } else if (v.is_string()) {
    py_json_string(out, v.get<std::string>());
  } else if (v.is_number_float()) {
    const double d = v.get<double>();
    out += std::isnan(d) ? "NaN" : std::isinf(d) ? (d > 0 ? "Infinity" : "-Infinity") : py_float(d);
  } else if (v.is_boolean()) {
    out += v.get<bool>() ? "true" : "false";
  } else if (v.is_null()) {
    out += "null";
  } else {
    out += v.dump();
  }
}

inline void py_repr_string(std::string& out, const std::string& s) {
  // Python's repr of a str: single quotes unless the text has ' and no ".
  const bool dq = s.find('\'') != std::string::npos && s.find('"') == std::string::npos;
  const char q = dq ? '"' : '\'';
  out += q;
  for (unsigned char c : s) {
    if (c == '\\') out += "\\\\";
    else if (c == static_cast<unsigned char>(q)) (out += '\\') += static_cast<char>(c);
    else if (c == '\n') out += "\\n";
    else if (c == '\r') out += "\\r";
    else if (c == '\t') out += "\\t";
    else if (c < 0x20 || c == 0x7F) {
      char buf[8];
      std::snprintf(buf, sizeof buf, "\\x%02x", c);
      out += buf;
    } else out += static_cast<char>(c);
  }
  out += q;
}

inline void py_repr(std::string& out, const Json& v) {
  if (v.is_string()) py_repr_string(out, v.get<std::string>());
  else if (v.is_null()) out += "None";
  else if (v.is_boolean()) out += v.get<bool>() ? "True" : "False";
  else if (v.is_number_float()) out += py_float(v.get<double>());
  else if (v.is_number()) out += v.dump();
  else if (v.is_array()) {
    out += '[';
    for (std::size_t i = 0; i < v.size(); ++i) {
      if (i) out += ", ";
      py_repr(out, v[i]);
    }
    out += ']';
  } else {
    out += '{';
    bool first = true;
    for (auto it = v.begin(); it != v.end(); ++it) {
      if (!first) out += ", ";
      first = false;
      py_repr_string(out, it.key());
      out += ": ";
      py_repr(out, it.value());
    }
    out += '}';
  }
}

/// str(value), as {{ }} prints it.
inline std::string py_str(const Value& v) {
  switch (v.kind) {
    case Value::undefined: return "";
    case Value::ns: return "<Namespace>";
    case Value::func:
    case Value::method: return "<function " + v.name + ">";
    case Value::data: break;
  }
  if (v.j.is_string()) return v.j.get<std::string>();
  std::string out;
  py_repr(out, v.j);
  return out;
}

inline bool truthy(const Value& v) {
  if (v.kind != Value::data) return v.kind != Value::undefined;
  const Json& j = v.j;
  if (j.is_null()) return false;
  if (j.is_boolean()) return j.get<bool>();
  if (j.is_number_integer()) return j.get<std::int64_t>() != 0;
  if (j.is_number()) return j.get<double>() != 0;
  if (j.is_string()) return !j.get_ref<const std::string&>().empty();  // json::empty() is false for any string
  if (j.is_array() || j.is_object()) return !j.empty();
  return true;
}

/// Python's ==, as far as JSON values go (1 == 1.0, True == 1).
inline bool py_equal(const Value& a, const Value& b) {
  if (a.kind != Value::data || b.kind != Value::data) return a.kind == b.kind && a.kind == Value::undefined;
  const Json &x = a.j, &y = b.j;
  auto num = [](const Json& v) { return v.is_number() || v.is_boolean(); };
  if (num(x) && num(y)) {
    auto d = [](const Json& v) { return v.is_boolean() ? (v.get<bool>() ? 1.0 : 0.0) : v.get<double>(); };
    if (x.is_number_integer() && y.is_number_integer()) return x.get<std::int64_t>() == y.get<std::int64_t>();
    return d(x) == d(y);
  }
  return x == y;
}

// ---- lexing -----------------------------------------------------------------------------------

struct Chunk {
  enum Kind { text, expr, stmt } kind = text;
  std::string s;
  int line = 1;
};

/// Cuts the template into text, {{ expression }} and {% statement %} chunks with Jinja's
/// whitespace rules (trim_blocks, lstrip_blocks, "-" / "+" markers; comments dropped; a single
/// trailing newline of the template removed; newlines kept as written).
inline std::vector<Chunk> lex(std::string_view source, const std::string& where) {
  std::vector<Chunk> out;
  // Jinja first makes every \r\n and \r a \n, and drops one trailing newline.
  std::string norm;
  norm.reserve(source.size());
  for (std::size_t k = 0; k < source.size(); ++k) {
    if (source[k] == '\r') {
      norm += '\n';
      if (k + 1 < source.size() && source[k + 1] == '\n') ++k;
    } else {
      norm += source[k];
    }
  }
  if (!norm.empty() && norm.back() == '\n') norm.pop_back();
  const std::string_view src = norm;
  std::size_t i = 0;
  int line = 1;
  bool strip_next = false;     // the previous tag ended with "-": strip leading whitespace
  bool trim_newline = false;   // the previous tag was a block or comment: drop one newline
  bool line_starting = true;   // the previous match ended a line (or this is the start)
  auto count_lines = [&](std::string_view s) {
    for (char c : s) line += c == '\n';
  };
  while (i <= src.size()) {
    std::size_t open = src.find('{', i);
    while (open != std::string_view::npos && open + 1 < src.size() && src[open + 1] != '{' && src[open + 1] != '%' && src[open + 1] != '#')
      open = src.find('{', open + 1);
    if (open != std::string_view::npos && open + 1 >= src.size()) open = std::string_view::npos;
    std::string text(src.substr(i, open == std::string_view::npos ? std::string_view::npos : open - i));
    const int text_line = line;
    count_lines(text);
    if (strip_next) {
      const std::size_t k = text.find_first_not_of(" \t\n\r\f\v");
      const std::size_t n = k == std::string::npos ? text.size() : k;
      line_starting = n > 0 && text[n - 1] == '\n';  // what the tag's end consumed ended a line
      text.erase(0, n);
    } else if (trim_newline && !text.empty() && text[0] == '\n') {
      text.erase(0, 1);
      line_starting = true;
    }
    strip_next = trim_newline = false;
    if (open == std::string_view::npos) {
      if (!text.empty()) out.push_back({Chunk::text, text, text_line});
      break;
    }
    const char kind = src[open + 1];
    const char sign = open + 2 < src.size() ? src[open + 2] : '\0';
    if (sign == '-') {
      const std::size_t k = text.find_last_not_of(" \t\n\r\f\v");
      text.erase(k == std::string::npos ? 0 : k + 1);
    } else if (sign != '+' && kind != '{') {  // lstrip_blocks: a block or comment alone on its line
      const std::size_t nl = text.rfind('\n');
      const std::size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
      if ((l_pos > 0 || line_starting) && l_pos < text.size() &&
          text.find_first_not_of(" \t\r\f\v", l_pos) == std::string::npos)
        text.erase(l_pos);
    }
    if (!text.empty()) out.push_back({Chunk::text, text, text_line});
    // The tag's end, skipping string literals inside {{ }} and {% %}.
    const std::size_t body = open + 2 + (sign == '-' || sign == '+' ? 1 : 0);
    const char close = kind == '{' ? '}' : kind;
    std::size_t k = body;
    std::size_t end = std::string_view::npos;
    while (k + 1 < src.size()) {
      const char c = src[k];
      if (kind != '#' && (c == '\'' || c == '"')) {
        std::size_t q = k + 1;
        while (q < src.size() && src[q] != c) q += src[q] == '\\' ? 2 : 1;
        k = q + 1;
        continue;
      }
      if (c == close && src[k + 1] == '}') {
        end = k;
        break;
      }
      ++k;
    }
    if (end == std::string_view::npos)
      fail_at(where, line, std::string("unclosed ") + (kind == '{' ? "{{" : kind == '%' ? "{%" : "{#"));
    std::size_t inner_end = end;
    const bool strip_after = end > body && src[end - 1] == '-';
    const bool keep_newline = end > body && src[end - 1] == '+';  // "+%}": no trim_blocks here
    if (strip_after || keep_newline) --inner_end;
    const std::string inner(src.substr(body, inner_end - body));
    const int tag_line = line;
    count_lines(src.substr(open, end + 2 - open));
    if (kind == '{') out.push_back({Chunk::expr, inner, tag_line});
    else if (kind == '%') out.push_back({Chunk::stmt, inner, tag_line});
    i = end + 2;
    strip_next = strip_after;
    trim_newline = kind != '{' && !keep_newline;
    // Jinja's line_starting: whether its last match ended with a newline. A tag's end only does
    // when trim_blocks or "-" swallowed one (set above, with the next text).
    line_starting = false;
    if (i >= src.size()) break;
  }
  return out;
}

// ---- expression parsing ---------------------------------------------------------------------

struct Tok {
  enum Kind { name, str, integer, real, op, end } kind = end;
  std::string s;
  std::int64_t i = 0;
  double d = 0;
};

inline std::vector<Tok> tokenize(const std::string& s, const std::string& where, int line) {
  std::vector<Tok> out;
  std::size_t i = 0;
  while (i < s.size()) {
    const char c = s[i];
    if (c == ' ' || c == '\t' || c == '\n' || c == '\r') {
      ++i;
      continue;
    }
    if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
      std::size_t k = i;
      while (k < s.size() && (std::isalnum(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
      out.push_back({Tok::name, s.substr(i, k - i)});
      i = k;
      continue;
    }
    if (std::isdigit(static_cast<unsigned char>(c))) {
      std::size_t k = i;
      bool real = false;
      while (k < s.size() && (std::isdigit(static_cast<unsigned char>(s[k])) || s[k] == '_')) ++k;
      if (k + 1 < s.size() && s[k] == '.' && std::isdigit(static_cast<unsigned char>(s[k + 1]))) {
        real = true;
        ++k;
        while (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) ++k;
      }
      if (k < s.size() && (s[k] == 'e' || s[k] == 'E')) {
        std::size_t e = k + 1;
        if (e < s.size() && (s[e] == '+' || s[e] == '-')) ++e;
        if (e < s.size() && std::isdigit(static_cast<unsigned char>(s[e]))) {
          real = true;
          k = e;
          while (k < s.size() && std::isdigit(static_cast<unsigned char>(s[k]))) ++k;
        }
      }
      std::string num = s.substr(i, k - i);
      num.erase(std::remove(num.begin(), num.end(), '_'), num.end());
      Tok t;
      t.kind = real ? Tok::real : Tok::integer;
      try {
        if (real) t.d = std::stod(num);
        else t.i = std::stoll(num);
      } catch (const std::exception&) {
        fail_at(where, line, "the number " + num + " is out of range");
      }
      out.push_back(t);
      i = k;
      continue;
    }
    if (c == '\'' || c == '"') {
      std::string v;
      std::size_t k = i + 1;
      for (; k < s.size() && s[k] != c; ++k) {
        if (s[k] != '\\' || k + 1 >= s.size()) {
          v += s[k];
          continue;
        }
        const char e = s[++k];
        switch (e) {
          case 'n': v += '\n'; break;
          case 't': v += '\t'; break;
          case 'r': v += '\r'; break;
          case '0': v += '\0'; break;
          case '\\': v += '\\'; break;
          case '\'': v += '\''; break;
          case '"': v += '"'; break;
          case '\n': break;
          case 'u':
          case 'x': {
            const std::size_t n = e == 'u' ? 4 : 2;
            if (k + n >= s.size()) fail_at(where, line, "a truncated \\" + std::string(1, e) + " escape");
            const std::string hex = s.substr(k + 1, n);
            if (hex.find_first_not_of("0123456789abcdefABCDEF") != std::string::npos)
              fail_at(where, line, "a bad \\" + std::string(1, e) + " escape");
            const auto cp = static_cast<std::uint32_t>(std::stoul(hex, nullptr, 16));
            k += n;
            // UTF-8 of the code point
            if (cp < 0x80) v += static_cast<char>(cp);
            else if (cp < 0x800) {
              v += static_cast<char>(0xC0 | (cp >> 6));
              v += static_cast<char>(0x80 | (cp & 0x3F));
            } else {
              v += static_cast<char>(0xE0 | (cp >> 12));
              v += static_cast<char>(0x80 | ((cp >> 6) & 0x3F));
              v += static_cast<char>(0x80 | (cp & 0x3F));
            }
            break;
          }
          default: v += '\\'; v += e;
        }
      }
      if (k >= s.size()) fail_at(where, line, "an unterminated string");
      out.push_back({Tok::str, v});
      i = k + 1;
      continue;
    }
    static const char* ops[] = {"**", "//", "==", "!=", "<=", ">=", "+", "-", "*", "/", "%", "~", "<", ">", "(", ")",
                                "[", "]", "{", "}", ",", ".", ":", "|", "="};
    bool found = false;
    for (const char* o : ops) {
      const std::size_t n = std::char_traits<char>::length(o);
      if (s.compare(i, n, o) == 0) {
        out.push_back({Tok::op, o});
        i += n;
        found = true;
        break;
      }
    }
    if (!found) fail_at(where, line, std::string("unexpected character '") + c + "'");
  }
  out.push_back({Tok::end, ""});
  return out;
}

struct Node;
using NodeP = std::shared_ptr<const Node>;

struct Node {
  enum Kind {
    literal, name, getattr, getitem, slice, call, filter, test, unary, binary, compare, cond, and_, or_, not_,
    list, dict, tuple
  } kind = literal;
  Json value;                 // literal
  std::string s;              // name / attribute / filter / test / operator
  std::vector<NodeP> args;    // operands, call / filter / test positional args (first: the object)
  std::vector<std::pair<std::string, NodeP>> kwargs;
  bool negate = false;        // "is not"
};

class ExprParser {
 public:
  ExprParser(std::vector<Tok> toks, std::string where, int line) : t_(std::move(toks)), where_(std::move(where)), line_(line) {}

  NodeP expression() { return cond(); }
  bool at_end() const { return t_[p_].kind == Tok::end; }
  const Tok& peek(std::size_t k = 0) const { return t_[std::min(p_ + k, t_.size() - 1)]; }
  bool is_op(const char* o, std::size_t k = 0) const { return peek(k).kind == Tok::op && peek(k).s == o; }
  bool is_name(const char* n, std::size_t k = 0) const { return peek(k).kind == Tok::name && peek(k).s == n; }
  void expect_op(const char* o) {
    if (!is_op(o)) fail("expected '" + std::string(o) + "'");
    ++p_;
  }
  std::string expect_name() {
    if (peek().kind != Tok::name) fail("expected a name");
    return t_[p_++].s;
  }
  void expect_end() {
    if (!at_end()) fail("unexpected '" + describe(peek()) + "'");
  }
  [[noreturn]] void fail(const std::string& msg) const { fail_at(where_, line_, msg); }
  static std::string describe(const Tok& t) {
    return t.kind == Tok::end ? "end of tag" : t.kind == Tok::str ? "'" + t.s + "' (a string)" : t.kind == Tok::integer ? std::to_string(t.i) : t.s;
  }

  // A target of for / set: a name or a tuple of names.
  std::vector<std::string> targets() {
    std::vector<std::string> names{expect_name()};
    while (is_op(",")) {
      ++p_;
      names.push_back(expect_name());
    }
    return names;
  }

  NodeP cond(bool allow_cond = true) {
    const Depth guard(*this);
    NodeP a = or_expr();
    while (allow_cond && is_name("if")) {
      ++p_;
      auto n = std::make_shared<Node>();
      n->kind = Node::cond;
      NodeP c = or_expr();
      NodeP b;
      if (is_name("else")) {
        ++p_;
        b = cond();
      }
      n->args = {c, a, b};
      a = n;
    }
    return a;
  }

 private:
  static NodeP make(Node::Kind k, std::string s, std::vector<NodeP> args) {
    auto n = std::make_shared<Node>();
    n->kind = k;
    n->s = std::move(s);
    n->args = std::move(args);
    return n;
  }
  NodeP or_expr() {
    NodeP a = and_expr();
    while (is_name("or")) {
      ++p_;
      a = make(Node::or_, "or", {a, and_expr()});
    }
    return a;
  }
  NodeP and_expr() {
    NodeP a = not_expr();
    while (is_name("and")) {
      ++p_;
      a = make(Node::and_, "and", {a, not_expr()});
    }
    return a;
  }
  NodeP not_expr() {
    const Depth guard(*this);
    if (is_name("not")) {
      ++p_;
      return make(Node::not_, "not", {not_expr()});
    }
    return compare();
  }
  NodeP compare() {
    NodeP a = math();
    for (;;) {
      std::string op;
      if (peek().kind == Tok::op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" || peek().s == ">" ||
                                     peek().s == "<=" || peek().s == ">=")) {
        op = t_[p_++].s;
      } else if (is_name("in")) {
        ++p_;
        op = "in";
      } else if (is_name("not") && is_name("in", 1)) {
        p_ += 2;
        op = "not in";
      } else {
        return a;
      }
      a = make(Node::compare, op, {a, math()});
    }
  }
  // The left-associative arithmetic levels, loosest first (Jinja's parse_math1, parse_concat,
  // parse_math2, parse_pow); below them the unary operators.
  NodeP math(std::size_t level = 0) {
    static const std::vector<std::vector<std::string>> levels = {{"+", "-"}, {"~"}, {"*", "/", "//", "%"}, {"**"}};
    if (level == levels.size()) return unary();
    NodeP a = math(level + 1);
    for (;;) {
      const auto& ops = levels[level];
      const auto it = std::find_if(ops.begin(), ops.end(), [&](const std::string& o) { return is_op(o.c_str()); });
      if (it == ops.end()) return a;
      ++p_;
      a = make(Node::binary, *it, {a, math(level + 1)});
    }
  }
  NodeP unary() {
    if (is_op("-") || is_op("+")) {
      const std::string op = t_[p_++].s;
      return filters(make(Node::unary, op, {unary_no_filter()}));
    }
    return filters(postfix(primary()));
  }
  NodeP unary_no_filter() {
    const Depth guard(*this);
    if (is_op("-") || is_op("+")) {
      const std::string op = t_[p_++].s;
      return make(Node::unary, op, {unary_no_filter()});
    }
    return postfix(primary());
  }
  NodeP primary() {
    const Tok& t = peek();
    if (t.kind == Tok::str) {
      std::string s;
      while (peek().kind == Tok::str) s += t_[p_++].s;  // adjacent strings join
      auto n = std::make_shared<Node>();
      n->value = s;
      return n;
    }
    if (t.kind == Tok::integer || t.kind == Tok::real) {
      ++p_;
      auto n = std::make_shared<Node>();
      n->value = t.kind == Tok::integer ? Json(t.i) : Json(t.d);
      return n;
    }
    if (t.kind == Tok::name) {
      ++p_;
      auto n = std::make_shared<Node>();
      if (t.s == "true" || t.s == "True") n->value = true;
      else if (t.s == "false" || t.s == "False") n->value = false;
      else if (t.s == "none" || t.s == "None") n->value = nullptr;
      else {
        n->kind = Node::name;
        n->s = t.s;
      }
      return n;
    }
    if (is_op("(")) {
      ++p_;
      if (is_op(")")) {
        ++p_;
        return make(Node::tuple, "", {});
      }
      NodeP e = cond();
      if (is_op(",")) {
        std::vector<NodeP> items{e};
        while (is_op(",")) {
          ++p_;
          if (is_op(")")) break;
          items.push_back(cond());
        }
        expect_op(")");
        return make(Node::tuple, "", items);
      }
      expect_op(")");
      return e;
    }
    if (is_op("[")) {
      ++p_;
      std::vector<NodeP> items;
      while (!is_op("]")) {
        items.push_back(cond());
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("]");
      return make(Node::list, "", items);
    }
    if (is_op("{")) {
      ++p_;
      std::vector<NodeP> items;  // key, value, key, value, ...
      while (!is_op("}")) {
        items.push_back(cond());
        expect_op(":");
        items.push_back(cond());
        if (!is_op(",")) break;
        ++p_;
      }
      expect_op("}");
      return make(Node::dict, "", items);
    }
    fail("unexpected '" + describe(t) + "'");
  }
  void call_args(Node& n) {
    expect_op("(");
    while (!is_op(")")) {
      if (peek().kind == Tok::name && is_op("=", 1)) {
        const std::string k = t_[p_].s;
        p_ += 2;
        n.kwargs.emplace_back(k, cond());
      } else {
        n.args.push_back(cond());
      }
      if (!is_op(",")) break;
      ++p_;
    }
    expect_op(")");
  }
  NodeP postfix(NodeP a) {
    for (;;) {
      if (is_op(".")) {
        ++p_;
        if (peek().kind == Tok::integer) {  // x.0 is x[0]
          auto n = std::make_shared<Node>();
          n->value = t_[p_++].i;
          a = make(Node::getitem, "", {a, n});
          continue;
        }
        a = make(Node::getattr, expect_name(), {a});
      } else if (is_op("[")) {
        ++p_;
        NodeP parts[3];
        bool is_slice = false;
        for (int k = 0; k < 3; ++k) {
          if (!is_op(":") && !is_op("]")) parts[k] = cond();
          if (k < 2 && is_op(":")) {
            ++p_;
            is_slice = true;
          } else {
            break;
          }
        }
        expect_op("]");
        a = is_slice ? make(Node::slice, "", {a, parts[0], parts[1], parts[2]}) : make(Node::getitem, "", {a, parts[0]});
        if (!is_slice && !parts[0]) fail("an empty subscript");
      } else if (is_op("(")) {
        auto n = std::make_shared<Node>();
        n->kind = Node::call;
        n->args.push_back(a);
        call_args(*n);
        a = n;
      } else {
        return a;
      }
    }
  }
  NodeP filters(NodeP a) {
    for (;;) {
      if (is_op("|")) {
        ++p_;
        auto n = std::make_shared<Node>();
        n->kind = Node::filter;
        n->s = expect_name();
        while (is_op(".")) {  // dotted filter names are not Jinja's builtins; keep the name for the error
          ++p_;
          n->s += "." + expect_name();
        }
        n->args.push_back(a);
        if (is_op("(")) call_args(*n);
        a = n;
      } else if (is_name("is")) {
        ++p_;
        auto n = std::make_shared<Node>();
        n->kind = Node::test;
        if (is_name("not")) {
          ++p_;
          n->negate = true;
        }
        // Test names may be keywords ("none", "true", "in") or operators ("==").
        if (peek().kind == Tok::name || (peek().kind == Tok::op && (peek().s == "==" || peek().s == "!=" || peek().s == "<" ||
                                                                    peek().s == ">" || peek().s == "<=" || peek().s == ">=")))
          n->s = t_[p_++].s;
        else
          fail("expected a test name after 'is'");
        n->args.push_back(a);
        if (is_op("(")) {
          call_args(*n);
        } else if (peek().kind == Tok::str || peek().kind == Tok::integer || peek().kind == Tok::real ||
                   (peek().kind == Tok::name && !is_name("and") && !is_name("or") && !is_name("else") && !is_name("if") &&
                    !is_name("is") && !is_name("in") && !is_name("not"))) {
          n->args.push_back(postfix(primary()));  // "is divisibleby 3", "is sameas false"
        }
        a = n;
      } else if (is_op("(")) {
        auto n = std::make_shared<Node>();
        n->kind = Node::call;
        n->args.push_back(a);
        call_args(*n);
        a = n;
      } else {
        return a;
      }
    }
  }

  // Nesting bound: a template is input, and "((((..." must not exhaust the stack.
  struct Depth {
    ExprParser& p;
    explicit Depth(ExprParser& q) : p(q) {
      if (++p.depth_ > kMaxDepth) p.fail("expression nested more than " + std::to_string(kMaxDepth) + " deep");
    }
    ~Depth() { --p.depth_; }
  };
  static constexpr int kMaxDepth = 200;

  std::vector<Tok> t_;
  std::size_t p_ = 0;
  std::string where_;
  int line_;
  int depth_ = 0;
};

// ---- statements -------------------------------------------------------------------------------

struct Stmt;
using StmtP = std::shared_ptr<const Stmt>;
using Body = std::vector<StmtP>;

struct Stmt {
  enum Kind { text, output, if_, for_, set, set_attr, set_block, brk, cont, generation } kind = text;
  int line = 1;
  std::string str;                                   // text
  NodeP expr;                                        // output / set value / for iterable / set_attr object
  std::vector<std::pair<NodeP, Body>> branches;      // if: (condition or null for else, body)
  std::vector<std::string> names;                    // for / set targets; set_attr: {attribute}
  NodeP filter;                                      // for ... if filter
  Body body, else_body;                              // for / set_block / generation
};

class Parser {
 public:
  Parser(std::vector<Chunk> chunks, std::string where) : c_(std::move(chunks)), where_(std::move(where)) {}

  Body parse() {
    std::string stop;
    Body b = block({}, stop);
    if (!stop.empty()) fail_at(where_, line_, "unexpected {% " + stop + " %}");
    return b;
  }

 private:
  static std::pair<std::string, std::string> split_tag(const std::string& s) {
    std::size_t b = s.find_first_not_of(" \t\r\n");
    if (b == std::string::npos) return {"", ""};
    std::size_t e = b;
    while (e < s.size() && (std::isalnum(static_cast<unsigned char>(s[e])) || s[e] == '_')) ++e;
    return {s.substr(b, e - b), s.substr(e)};
  }
  ExprParser expr_parser(const std::string& s, int line) const { return ExprParser(tokenize(s, where_, line), where_, line); }

  // Parses statements until one of `ends` (tag names); `stop` gets the tag that ended the block
  // (empty at the end of the template), and p_ is past it.
  Body block(const std::vector<std::string>& ends, std::string& stop, std::string* stop_rest = nullptr) {
    Body out;
    while (p_ < c_.size()) {
      const Chunk& ch = c_[p_++];
      line_ = ch.line;
      if (ch.kind == Chunk::text) {
        auto s = std::make_shared<Stmt>();
        s->kind = Stmt::text;
        s->str = ch.s;
        out.push_back(s);
        continue;
      }
      if (ch.kind == Chunk::expr) {
        ExprParser ep = expr_parser(ch.s, ch.line);
        auto s = std::make_shared<Stmt>();
        s->kind = Stmt::output;
        s->line = ch.line;
        s->expr = ep.expression();
        ep.expect_end();
        out.push_back(s);
        continue;
      }
      auto [tag, rest] = split_tag(ch.s);
      if (std::find(ends.begin(), ends.end(), tag) != ends.end()) {
        stop = tag;
        if (stop_rest) *stop_rest = rest;
        return out;
      }
      out.push_back(statement(tag, rest, ch.line));
    }
    stop.clear();
    return out;
  }

  StmtP statement(const std::string& tag, const std::string& rest, int line) {
    if (++depth_ > 200) fail_at(where_, line, "blocks nested more than 200 deep");
    struct Leave {
      int& d;
      ~Leave() { --d; }
    } leave{depth_};
    auto s = std::make_shared<Stmt>();
    s->line = line;
    if (tag == "if") {
      s->kind = Stmt::if_;
      std::string cond_src = rest;
      for (;;) {
        ExprParser ep = expr_parser(cond_src, line);
        NodeP c = ep.expression();
        ep.expect_end();
        std::string stop, stop_rest;
        Body b = block({"elif", "else", "endif"}, stop, &stop_rest);
        s->branches.emplace_back(c, std::move(b));
        if (stop == "elif") {
          cond_src = stop_rest;
          continue;
        }
        if (stop == "else") {
          Body e = block({"endif"}, stop);
          s->branches.emplace_back(nullptr, std::move(e));
        }
        if (stop != "endif") fail_at(where_, line, "{% if %} without {% endif %}");
        return s;
      }
    }
    if (tag == "for") {
      s->kind = Stmt::for_;
      ExprParser ep = expr_parser(rest, line);
      s->names = ep.targets();
      // "for x in iterable [if filter]": the iterable takes no if-else, the "if" is the filter.
      if (!ep.is_name("in")) ep.fail("expected 'in' in {% for %}");
      ep.expect_name();
      s->expr = ep.cond(false);
      if (ep.is_name("if")) {
        ep.expect_name();
        s->filter = ep.expression();
      }
      if (ep.is_name("recursive")) ep.fail("recursive loops are not supported");
      ep.expect_end();
      std::string stop;
      s->body = block({"else", "endfor"}, stop);
      if (stop == "else") s->else_body = block({"endfor"}, stop);
      if (stop != "endfor") fail_at(where_, line, "{% for %} without {% endfor %}");
      return s;
    }
    if (tag == "set") {
      ExprParser ep = expr_parser(rest, line);
      std::string first = ep.expect_name();
      if (ep.is_op(".")) {  // set ns.attr = value
        ep.expect_op(".");
        s->kind = Stmt::set_attr;
        s->names = {first, ep.expect_name()};
        ep.expect_op("=");
        s->expr = ep.expression();
        ep.expect_end();
        return s;
      }
      s->names = {first};
      while (ep.is_op(",")) {
        ep.expect_op(",");
        s->names.push_back(ep.expect_name());
      }
      if (ep.at_end()) {  // {% set x %}...{% endset %}
        if (s->names.size() != 1) ep.fail("a block set takes one name");
        s->kind = Stmt::set_block;
        std::string stop;
        s->body = block({"endset"}, stop);
        if (stop != "endset") fail_at(where_, line, "{% set %} without {% endset %}");
        return s;
      }
      s->kind = Stmt::set;
      ep.expect_op("=");
      s->expr = ep.expression();
      if (ep.is_op(",")) {  // set a, b = x, y
        auto tup = std::make_shared<Node>();
        tup->kind = Node::tuple;
        tup->args.push_back(s->expr);
        while (ep.is_op(",")) {
          ep.expect_op(",");
          tup->args.push_back(ep.expression());
        }
        s->expr = tup;
      }
      ep.expect_end();
      return s;
    }
    if (tag == "break" || tag == "continue") {
      s->kind = tag == "break" ? Stmt::brk : Stmt::cont;
      return s;
    }
    if (tag == "generation") {
      s->kind = Stmt::generation;
      std::string stop;
      s->body = block({"endgeneration"}, stop);
      if (stop != "endgeneration") fail_at(where_, line, "{% generation %} without {% endgeneration %}");
      return s;
    }
    if (tag.empty()) fail_at(where_, line, "an empty {% %} tag");
    if (tag.rfind("end", 0) == 0 || tag == "elif" || tag == "else") fail_at(where_, line, "unexpected {% " + tag + " %}");
    fail_at(where_, line, "unsupported tag {% " + tag + " %}" +
                              (tag == "macro" || tag == "call" || tag == "include" || tag == "import" || tag == "extends" ||
                                       tag == "block" || tag == "filter" || tag == "raw" || tag == "with" || tag == "do"
                                   ? " (not in nn's Jinja subset)"
                                   : ""));
  }

  std::vector<Chunk> c_;
  std::size_t p_ = 0;
  std::string where_;
  int line_ = 1;
  int depth_ = 0;
};

}  // namespace detail::jinja

/// A chat template (Jinja), parsed once, rendered as transformers renders it.
class ChatTemplate {
 public:
  using Json = nlohmann::ordered_json;

  ChatTemplate() = default;
  /// Parses `source`; `name` (a file, "tokenizer_config.json chat_template") names it in errors.
  explicit ChatTemplate(std::string source, std::string name = "chat_template") : source_(std::move(source)), name_(std::move(name)) {
    body_ = std::make_shared<detail::jinja::Body>(
        detail::jinja::Parser(detail::jinja::lex(source_, name_), name_).parse());
  }

  bool empty() const { return !body_; }

  /// Bounds on one render: a template is input, and must not hang or fill memory (an nn::Error
  /// says which bound it passed).
  std::size_t max_steps = 20'000'000;            // statements run plus loop turns
  std::size_t max_output = std::size_t{256} << 20;  // bytes of rendered text
  /// The local time strftime_now() formats (Llama 3's "Today Date"); unset, the clock's now, as
  /// transformers does. Set it for renders that must not change with the day (tests, recorded
  /// prompts).
  std::optional<std::tm> now;
  const std::string& source() const { return source_; }

  /// Renders with the variables of `context` (an object: messages, tools, add_generation_prompt,
  /// bos_token, eos_token, and any template option such as enable_thinking).
  std::string render(const Json& context) const {
    if (!body_) nn::detail::fail("chat_template", name_, ": no template");
    if (!context.is_object()) nn::detail::fail("chat_template", name_, ": the context must be a JSON object");
    Renderer r{*this, {}};
    r.scopes.emplace_back();
    for (auto it = context.begin(); it != context.end(); ++it) r.scopes.back()[it.key()] = detail::jinja::Value::of(it.value());
    std::string out;
    try {
      r.run(*body_, out);
    } catch (const nn::Error&) {
      throw;
    } catch (const std::exception& e) {  // a JSON type error, an allocation refused, ...
      detail::jinja::fail_at(name_, r.line, std::string("cannot render: ") + e.what());
    }
    return out;
  }

  /// apply_chat_template(messages, tools=tools, add_generation_prompt=..., tokenize=False) with
  /// `extra` variables (bos_token, eos_token, enable_thinking, date_string, ...) beside them. As
  /// transformers does, tools and documents are always defined (None when not given), and a
  /// message's reasoning under "reasoning_content", "thinking" or "reasoning" is passed as both
  /// "thinking" (first) and "reasoning_content" (last).
  std::string apply(const Json& messages, bool add_generation_prompt, const Json& extra = Json::object(),
                    const Json& tools = nullptr) const {
    if (!messages.is_array()) nn::detail::fail("chat_template", name_, ": messages must be a JSON array");
    Json ctx = extra.is_object() ? extra : Json::object();
    Json msgs = Json::array();
    for (const Json& m : messages) {
      if (!m.is_object()) nn::detail::fail("chat_template", name_, ": each message must be a JSON object, got ", m.dump().substr(0, 80));
      const Json* reasoning = nullptr;
      for (const char* k : {"reasoning_content", "thinking", "reasoning"})
        if (auto it = m.find(k); !reasoning && it != m.end() && !it->is_null()) reasoning = &*it;
      if (!reasoning) {
        msgs.push_back(m);
        continue;
      }
      Json a = Json::object();
      a["thinking"] = *reasoning;
      for (auto it = m.begin(); it != m.end(); ++it) a[it.key()] = it.value();
      a.erase("reasoning_content");
      a["reasoning_content"] = *reasoning;
      msgs.push_back(std::move(a));
    }
    ctx["messages"] = std::move(msgs);
    ctx["tools"] = tools;
    if (!ctx.contains("documents")) ctx["documents"] = nullptr;
    ctx["add_generation_prompt"] = add_generation_prompt;
    return render(ctx);
  }

 private:
  using Value = detail::jinja::Value;
  using Node = detail::jinja::Node;
  using Stmt = detail::jinja::Stmt;

  struct LoopSignal {
    enum Kind { none, brk, cont } kind = none;
  };

  struct Renderer {
    const ChatTemplate& t;
    std::vector<std::map<std::string, Value, std::less<>>> scopes;
    int line = 1;
    std::size_t steps = 0;

    [[noreturn]] void fail(const std::string& msg) const { detail::jinja::fail_at(t.name_, line, msg); }

    [[noreturn]] std::int64_t overflow() const { fail("integer overflow (past 64 bits)"); }

    void step() {
      if (++steps > t.max_steps) fail("the template ran more than " + std::to_string(t.max_steps) + " statements and loop turns");
    }

    Value lookup(const std::string& name) const {
      for (auto it = scopes.rbegin(); it != scopes.rend(); ++it)
        if (auto f = it->find(name); f != it->end()) return f->second;
      static const char* globals[] = {"range", "namespace", "dict", "raise_exception", "strftime_now", "lipsum", "cycler", "joiner"};
      for (const char* g : globals)
        if (name == g) return Value::fn(name);
      return Value::undef(name);
    }

    // ---- statements ----

    LoopSignal run(const detail::jinja::Body& body, std::string& out) {
      for (const auto& sp : body) {
        const Stmt& s = *sp;
        line = s.line;
        // A template is input: bound its work and output rather than hang or exhaust memory.
        step();
        if (out.size() > t.max_output) fail("the rendered text passed " + std::to_string(t.max_output) + " bytes");
        switch (s.kind) {
          case Stmt::text: out += s.str; break;
          case Stmt::output: out += detail::jinja::py_str(eval(*s.expr)); break;
          case Stmt::if_:
            for (const auto& [c, b] : s.branches)
              if (!c || detail::jinja::truthy(eval(*c))) {
                if (LoopSignal sig = run(b, out); sig.kind != LoopSignal::none) return sig;
                break;
              }
            break;
          case Stmt::for_:
            run_for(s, out);
            break;
          case Stmt::set: {
            Value v = eval(*s.expr);
            if (s.names.size() == 1) {
              scopes.back()[s.names[0]] = std::move(v);
            } else {
              const auto items = iterate(v);
              if (items.size() != s.names.size())
                fail("cannot unpack " + std::to_string(items.size()) + " values into " + std::to_string(s.names.size()) + " names");
              for (std::size_t i = 0; i < items.size(); ++i) scopes.back()[s.names[i]] = items[i];
            }
            break;
          }
          case Stmt::set_attr: {
            Value ns = lookup(s.names[0]);
            if (ns.kind != Value::ns) fail("cannot set attribute '" + s.names[1] + "' of '" + s.names[0] + "': not a namespace");
            if (!s.names[1].empty() && s.names[1][0] == '_') fail("namespace attributes cannot start with '_'");
            Value v = eval(*s.expr);
            if (v.kind != Value::data && v.kind != Value::undefined) fail("a namespace attribute holds data only");
            (*ns.space)[s.names[1]] = v.kind == Value::data ? v.j : Json();
            break;
          }
          case Stmt::set_block: {
            std::string inner;
            scopes.emplace_back();
            run(s.body, inner);
            scopes.pop_back();
            scopes.back()[s.names[0]] = Value::of(inner);
            break;
          }
          case Stmt::brk: return {LoopSignal::brk};
          case Stmt::cont: return {LoopSignal::cont};
          case Stmt::generation:
            if (LoopSignal sig = run(s.body, out); sig.kind != LoopSignal::none) return sig;
            break;
        }
      }
      return {};
    }

    void run_for(const Stmt& s, std::string& out) {
      Value seq = eval(*s.expr);
      std::vector<Value> items = iterate(seq);
      if (s.filter) {
        std::vector<Value> kept;
        for (const Value& v : items) {
          scopes.emplace_back();
          bind(s, v);
          if (detail::jinja::truthy(eval(*s.filter))) kept.push_back(v);
          scopes.pop_back();
        }
        items = std::move(kept);
      }
      if (items.empty()) {
        scopes.emplace_back();
        run(s.else_body, out);
        scopes.pop_back();
        return;
      }
      const auto n = static_cast<std::int64_t>(items.size());
      for (std::int64_t i = 0; i < n; ++i) {
        step();
        scopes.emplace_back();
        bind(s, items[static_cast<std::size_t>(i)]);
        Json loop = {{"index", i + 1}, {"index0", i}, {"revindex", n - i}, {"revindex0", n - i - 1}, {"first", i == 0},
                     {"last", i == n - 1}, {"length", n}, {"depth", 1}, {"depth0", 0}};
        const Value& prev = items[static_cast<std::size_t>(std::max<std::int64_t>(i - 1, 0))];
        const Value& next = items[static_cast<std::size_t>(std::min(i + 1, n - 1))];
        if (i > 0 && prev.kind == Value::data) loop["previtem"] = prev.j;
        if (i + 1 < n && next.kind == Value::data) loop["nextitem"] = next.j;
        scopes.back()["loop"] = Value::of(std::move(loop));
        const LoopSignal sig = run(s.body, out);
        scopes.pop_back();
        if (sig.kind == LoopSignal::brk) break;
      }
    }

    void bind(const Stmt& s, const Value& v) {
      if (s.names.size() == 1) {
        scopes.back()[s.names[0]] = v;
        return;
      }
      const auto parts = iterate(v);
      if (parts.size() != s.names.size())
        fail("cannot unpack " + std::to_string(parts.size()) + " values into " + std::to_string(s.names.size()) + " loop names");
      for (std::size_t k = 0; k < parts.size(); ++k) scopes.back()[s.names[k]] = parts[k];
    }

    // The items a for loop (or list()) goes over: a list's elements, a dict's keys, a string's
    // characters (UTF-8 code points).
    std::vector<Value> iterate(const Value& v) const {
      std::vector<Value> out;
      if (v.kind == Value::undefined) return out;  // Jinja iterates an undefined value as empty
      if (v.kind != Value::data) fail("cannot iterate over " + detail::jinja::py_str(v));
      if (v.j.is_array()) {
        for (const auto& x : v.j) out.push_back(Value::of(x));
      } else if (v.j.is_object()) {
        for (auto it = v.j.begin(); it != v.j.end(); ++it) out.push_back(Value::of(it.key()));
      } else if (v.j.is_string()) {
        const std::string s = v.j.get<std::string>();
        for (std::size_t i = 0; i < s.size();) {
          std::size_t n = 1;
          const auto c = static_cast<unsigned char>(s[i]);
          if (c >= 0xF0) n = 4;
          else if (c >= 0xE0) n = 3;
          else if (c >= 0xC0) n = 2;
          out.push_back(Value::of(s.substr(i, n)));
          i += n;
        }
      } else {
        fail("cannot iterate over " + detail::jinja::py_str(v));
      }
      return out;
    }

    // ---- expressions ----

    const Json& data(const Value& v, const char* what) const {
      if (v.kind == Value::undefined) fail(std::string(what) + ": '" + v.name + "' is undefined");
      if (v.kind != Value::data) fail(std::string(what) + ": expected data, got " + detail::jinja::py_str(v));
      return v.j;
    }
    std::string str_arg(const Value& v, const char* what) const {
      const Json& j = data(v, what);
      if (!j.is_string()) fail(std::string(what) + ": expected a string, got " + detail::jinja::py_str(v));
      return j.get<std::string>();
    }
    std::int64_t int_arg(const Value& v, const char* what) const {
      const Json& j = data(v, what);
      if (j.is_boolean()) return j.get<bool>() ? 1 : 0;
      if (!j.is_number_integer()) fail(std::string(what) + ": expected an integer, got " + detail::jinja::py_str(v));
      return j.get<std::int64_t>();
    }

    Value attr(const Value& obj, const std::string& name) const {
      if (obj.kind == Value::undefined) fail("'" + obj.name + "' is undefined, so it has no attribute '" + name + "'");
      if (obj.kind == Value::ns) {
        auto it = obj.space->find(name);
        return it == obj.space->end() ? Value::undef(name) : Value::of(*it);
      }
      if (obj.kind != Value::data) return Value::undef(name);
      static const char* str_methods[] = {"startswith", "endswith", "split", "rsplit", "strip", "lstrip", "rstrip", "upper",
                                          "lower", "title", "capitalize", "replace", "find", "count", "join", "splitlines"};
      static const char* dict_methods[] = {"items", "keys", "values", "get"};
      auto is_method = [&](const auto& list) { return std::find(std::begin(list), std::end(list), name) != std::end(list); };
      if ((obj.j.is_string() && is_method(str_methods)) || (obj.j.is_object() && is_method(dict_methods))) {
        Value m;
        m.kind = Value::method;
        m.name = name;
        m.j = obj.j;
        return m;
      }
      if (obj.j.is_object()) {
        auto it = obj.j.find(name);
        return it == obj.j.end() ? Value::undef(name) : Value::of(*it);
      }
      return Value::undef(name);
    }

    Value item(const Value& obj, const Value& key) const {
      if (obj.kind == Value::undefined) fail("'" + obj.name + "' is undefined, so it cannot be subscripted");
      if (obj.kind == Value::ns) return key.is_string() ? attr(obj, key.j.get<std::string>()) : Value::undef();
      if (obj.kind != Value::data) return Value::undef();
      const Json& j = obj.j;
      if (j.is_object()) {
        if (!key.is_string()) return Value::undef();
        auto it = j.find(key.j.get<std::string>());
        return it == j.end() ? Value::undef(key.j.get<std::string>()) : Value::of(*it);
      }
      if ((j.is_array() || j.is_string()) && key.kind == Value::data && (key.j.is_number_integer() || key.j.is_boolean())) {
        if (j.is_string()) {
          const auto chars = iterate(obj);
          std::int64_t i = int_arg(key, "index");
          if (i < 0) i += static_cast<std::int64_t>(chars.size());
          return i < 0 || i >= static_cast<std::int64_t>(chars.size()) ? Value::undef() : chars[static_cast<std::size_t>(i)];
        }
        std::int64_t i = int_arg(key, "index");
        if (i < 0) i += static_cast<std::int64_t>(j.size());
        return i < 0 || i >= static_cast<std::int64_t>(j.size()) ? Value::undef() : Value::of(j[static_cast<std::size_t>(i)]);
      }
      if (key.is_string()) return attr(obj, key.j.get<std::string>());
      return Value::undef();
    }

    Value slice(const Value& obj, const Value& a, const Value& b, const Value& c) const {
      std::vector<Value> items;
      const bool is_str = obj.is_string();
      if (obj.kind == Value::data && (obj.j.is_array() || is_str)) items = iterate(obj);
      else fail("cannot slice " + detail::jinja::py_str(obj));
      const auto n = static_cast<std::int64_t>(items.size());
      const std::int64_t step = c.kind == Value::undefined || c.is_none() ? 1 : int_arg(c, "slice step");
      if (step == 0) fail("slice step cannot be zero");
      // Python's slice.indices
      auto norm = [&](const Value& v, std::int64_t dflt, bool is_start) {
        if (v.kind == Value::undefined || v.is_none()) return dflt;
        std::int64_t x = int_arg(v, "slice bound");
        if (x < 0) x += n;
        if (step > 0) return std::clamp<std::int64_t>(x, 0, n);
        (void)is_start;
        return std::clamp<std::int64_t>(x, -1, n - 1);
      };
      const std::int64_t start = norm(a, step > 0 ? 0 : n - 1, true);
      const std::int64_t stop = norm(b, step > 0 ? n : -1, false);
      Json out = is_str ? Json("") : Json::array();
      for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
        const Value& v = items[static_cast<std::size_t>(i)];
        if (is_str) out.get_ref<std::string&>() += v.j.get<std::string>();
        else out.push_back(v.j);
      }
      return Value::of(std::move(out));
    }

    Value eval(const Node& n) {
      using K = Node::Kind;
      switch (n.kind) {
        case K::literal: return Value::of(n.value);
        case K::name: return lookup(n.s);
        case K::getattr: return attr(eval(*n.args[0]), n.s);
        case K::getitem: return item(eval(*n.args[0]), eval(*n.args[1]));
        case K::slice: {
          auto opt = [&](std::size_t k) { return n.args[k] ? eval(*n.args[k]) : Value::undef(); };
          return slice(eval(*n.args[0]), opt(1), opt(2), opt(3));
        }
        case K::list: {
          Json a = Json::array();
          for (const auto& x : n.args) a.push_back(data(eval(*x), "list item"));
          return Value::of(std::move(a));
        }
        case K::tuple: {
          Json a = Json::array();
          for (const auto& x : n.args) a.push_back(data(eval(*x), "tuple item"));
          return Value::of(std::move(a));
        }
        case K::dict: {
          Json o = Json::object();
          for (std::size_t k = 0; k + 1 < n.args.size(); k += 2) o[str_arg(eval(*n.args[k]), "dict key")] = data(eval(*n.args[k + 1]), "dict value");
          return Value::of(std::move(o));
        }
        case K::not_: return Value::of(!detail::jinja::truthy(eval(*n.args[0])));
        case K::and_: {
          Value a = eval(*n.args[0]);
          return detail::jinja::truthy(a) ? eval(*n.args[1]) : a;
        }
        case K::or_: {
          Value a = eval(*n.args[0]);
          return detail::jinja::truthy(a) ? a : eval(*n.args[1]);
        }
        case K::cond: {
          if (detail::jinja::truthy(eval(*n.args[0]))) return eval(*n.args[1]);
          return n.args[2] ? eval(*n.args[2]) : Value::undef();
        }
        case K::unary: {
          const Value operand = eval(*n.args[0]);
          const Json& v = data(operand, "unary operator");
          if (!v.is_number()) fail("unary '" + n.s + "' needs a number");
          if (n.s == "+") return Value::of(v);
          if (v.is_number_integer() && v.get<std::int64_t>() == INT64_MIN) fail("integer overflow");
          return Value::of(v.is_number_integer() ? Json(-v.get<std::int64_t>()) : Json(-v.get<double>()));
        }
        case K::binary: return binary(n.s, eval(*n.args[0]), eval(*n.args[1]));
        case K::compare: return Value::of(compare(n.s, eval(*n.args[0]), eval(*n.args[1])));
        case K::call: return call(n);
        case K::filter: return filter(n);
        case K::test: {
          const bool r = test(n);
          return Value::of(n.negate ? !r : r);
        }
      }
      return Value::undef();
    }

    Value binary(const std::string& op, const Value& a, const Value& b) const {
      if (op == "~") return Value::of(detail::jinja::py_str(a) + detail::jinja::py_str(b));
      const Json& x = data(a, ("operator " + op).c_str());
      const Json& y = data(b, ("operator " + op).c_str());
      if (op == "+" && x.is_string() && y.is_string()) return Value::of(x.get<std::string>() + y.get<std::string>());
      if (op == "+" && x.is_array() && y.is_array()) {
        Json r = x;
        for (const auto& e : y) r.push_back(e);
        return Value::of(std::move(r));
      }
      if (op == "*" && (x.is_string() || x.is_array()) && y.is_number_integer()) {
        const std::size_t unit = x.is_string() ? x.get_ref<const std::string&>().size() : x.size();
        if (y.get<std::int64_t>() > 0 && unit > 0 && static_cast<std::uint64_t>(y.get<std::int64_t>()) > t.max_output / unit)
          fail("a repetition longer than the output bound");
        Json r = x.is_string() ? Json("") : Json::array();
        for (std::int64_t k = 0; k < y.get<std::int64_t>(); ++k)
          if (x.is_string()) r.get_ref<std::string&>() += x.get<std::string>();
          else
            for (const auto& e : x) r.push_back(e);
        return Value::of(std::move(r));
      }
      auto num = [](const Json& v) { return v.is_number() || v.is_boolean(); };
      if (!num(x) || !num(y))
        fail("unsupported operand types for " + op + ": " + detail::jinja::py_str(a).substr(0, 40) + " and " +
             detail::jinja::py_str(b).substr(0, 40));
      auto as_i = [](const Json& v) { return v.is_boolean() ? std::int64_t{v.get<bool>()} : v.get<std::int64_t>(); };
      auto as_d = [](const Json& v) { return v.is_boolean() ? double(v.get<bool>()) : v.get<double>(); };
      const bool ints = !x.is_number_float() && !y.is_number_float();
      if (op == "/") {
        if (as_d(y) == 0) fail("division by zero");
        return Value::of(as_d(x) / as_d(y));
      }
      if (ints) {
        const std::int64_t p = as_i(x), q = as_i(y);
        std::int64_t r = 0;
        // Python's integers do not overflow; ours are 64-bit: past that is an error, not UB.
        if (op == "+") return Value::of(__builtin_add_overflow(p, q, &r) ? overflow() : r);
        if (op == "-") return Value::of(__builtin_sub_overflow(p, q, &r) ? overflow() : r);
        if (op == "*") return Value::of(__builtin_mul_overflow(p, q, &r) ? overflow() : r);
        if ((op == "//" || op == "%") && p == INT64_MIN && q == -1) overflow();
        if (op == "//" || op == "%") {
          if (q == 0) fail("division by zero");
          std::int64_t d = p / q, m = p % q;
          if (m != 0 && ((m < 0) != (q < 0))) {
            --d;
            m += q;
          }
          return Value::of(op == "//" ? d : m);
        }
        if (op == "**") {
          if (q < 0) return Value::of(std::pow(double(p), double(q)));
          std::int64_t acc = 1;
          for (std::int64_t k = 0; k < q; ++k)
            if (__builtin_mul_overflow(acc, p, &acc)) overflow();
          return Value::of(acc);
        }
      }
      const double p = as_d(x), q = as_d(y);
      if (op == "+") return Value::of(p + q);
      if (op == "-") return Value::of(p - q);
      if (op == "*") return Value::of(p * q);
      if (op == "//") return Value::of(std::floor(p / q));
      if (op == "%") return Value::of(p - std::floor(p / q) * q);
      if (op == "**") return Value::of(std::pow(p, q));
      fail("unknown operator " + op);
    }

    bool contains(const Value& hay, const Value& needle) const {
      const Json& h = data(hay, "operator in");
      if (h.is_string()) return needle.is_string() && h.get<std::string>().find(needle.j.get<std::string>()) != std::string::npos;
      if (h.is_object()) return needle.is_string() && h.contains(needle.j.get<std::string>());
      if (h.is_array()) {
        for (const auto& e : h)
          if (detail::jinja::py_equal(Value::of(e), needle)) return true;
        return false;
      }
      fail("operator in: " + detail::jinja::py_str(hay) + " is not a container");
    }

    bool compare(const std::string& op, const Value& a, const Value& b) const {
      if (op == "==") return detail::jinja::py_equal(a, b);
      if (op == "!=") return !detail::jinja::py_equal(a, b);
      if (op == "in") return contains(b, a);
      if (op == "not in") return !contains(b, a);
      const Json& x = data(a, ("operator " + op).c_str());
      const Json& y = data(b, ("operator " + op).c_str());
      int c;
      if (x.is_string() && y.is_string()) c = x.get<std::string>().compare(y.get<std::string>());
      else if ((x.is_number() || x.is_boolean()) && (y.is_number() || y.is_boolean())) {
        const double p = x.is_boolean() ? x.get<bool>() : x.get<double>(), q = y.is_boolean() ? y.get<bool>() : y.get<double>();
        c = p < q ? -1 : p > q ? 1 : 0;
      } else {
        fail("'" + op + "' not supported between " + detail::jinja::py_str(a).substr(0, 40) + " and " + detail::jinja::py_str(b).substr(0, 40));
      }
      if (op == "<") return c < 0;
      if (op == ">") return c > 0;
      if (op == "<=") return c <= 0;
      return c >= 0;
    }

    std::vector<Value> args_of(const Node& n, std::size_t from = 1) {
      std::vector<Value> a;
      for (std::size_t k = from; k < n.args.size(); ++k) a.push_back(eval(*n.args[k]));
      return a;
    }
    std::optional<Value> kwarg(const Node& n, const char* name) {
      for (const auto& [k, v] : n.kwargs)
        if (k == name) return eval(*v);
      return std::nullopt;
    }

    Value call(const Node& n) {
      Value f = eval(*n.args[0]);
      std::vector<Value> a = args_of(n);
      if (f.kind == Value::method) return method(f, a, n);
      if (f.kind != Value::func) {
        const Node& callee = *n.args[0];
        fail("'" + (callee.kind == Node::name || callee.kind == Node::getattr ? callee.s : detail::jinja::py_str(f)) + "' is not callable" +
             (f.kind == Value::undefined ? " (undefined)" : ""));
      }
      const std::string& name = f.name;
      if (name == "raise_exception") nn::detail::fail("chat_template", t.name_, " line ", line, ": the template raised: ", a.empty() ? "" : detail::jinja::py_str(a[0]));
      if (name == "namespace" || name == "dict") {
        auto space = std::make_shared<Json>(Json::object());
        for (const Value& v : a) {  // dict(mapping) / namespace(mapping)
          const Json& m = data(v, name.c_str());
          if (!m.is_object()) fail(name + "(): a positional argument must be a mapping");
          for (auto it = m.begin(); it != m.end(); ++it) (*space)[it.key()] = it.value();
        }
        for (const auto& [k, v] : n.kwargs) {
          if (name == "namespace" && !k.empty() && k[0] == '_') fail("namespace attributes cannot start with '_'");
          Value x = eval(*v);
          (*space)[k] = x.kind == Value::data ? x.j : Json();
        }
        if (name == "dict") return Value::of(std::move(*space));
        Value ns;
        ns.kind = Value::ns;
        ns.space = std::move(space);
        return ns;
      }
      if (name == "range") {
        std::int64_t start = 0, stop = 0, step = 1;
        if (a.size() == 1) stop = int_arg(a[0], "range");
        else if (a.size() >= 2) {
          start = int_arg(a[0], "range");
          stop = int_arg(a[1], "range");
          if (a.size() >= 3) step = int_arg(a[2], "range");
        } else {
          fail("range() takes 1 to 3 arguments");
        }
        if (step == 0) fail("range() step cannot be zero");
        Json r = Json::array();
        for (std::int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          r.push_back(i);
          if (r.size() > t.max_steps) fail("range() longer than the step bound");
        }
        return Value::of(std::move(r));
      }
      if (name == "strftime_now") {
        const std::string fmt = a.empty() ? "%Y-%m-%d" : str_arg(a[0], "strftime_now");
        std::tm tm{};
        if (t.now) {
          tm = *t.now;
        } else {
          const std::time_t clock = std::time(nullptr);
#if defined(_WIN32)
          localtime_s(&tm, &clock);
#else
          localtime_r(&clock, &tm);
#endif
        }
        char buf[256];
        const std::size_t len = std::strftime(buf, sizeof buf, fmt.c_str(), &tm);
        return Value::of(std::string(buf, len));
      }
      fail("unsupported function '" + name + "'");
    }

    static std::string strip_chars(const std::string& s, const std::string& chars, bool left, bool right) {
      std::size_t b = 0, e = s.size();
      if (left)
        while (b < e && chars.find(s[b]) != std::string::npos) ++b;
      if (right)
        while (e > b && chars.find(s[e - 1]) != std::string::npos) --e;
      return s.substr(b, e - b);
    }

    // Python's str.split(sep) / split() (whitespace runs), with maxsplit.
    static Json py_split(const std::string& s, const std::optional<std::string>& sep, std::int64_t maxsplit) {
      Json out = Json::array();
      if (sep) {
        std::size_t b = 0;
        for (std::int64_t n = 0; maxsplit < 0 || n < maxsplit; ++n) {
          const std::size_t k = s.find(*sep, b);
          if (k == std::string::npos) break;
          out.push_back(s.substr(b, k - b));
          b = k + sep->size();
        }
        out.push_back(s.substr(b));
        return out;
      }
      const std::string ws = " \t\n\r\f\v";
      std::size_t i = s.find_first_not_of(ws);
      std::int64_t n = 0;
      while (i != std::string::npos) {
        if (maxsplit >= 0 && n == maxsplit) {
          out.push_back(strip_chars(s.substr(i), ws, false, true));
          break;
        }
        const std::size_t e = s.find_first_of(ws, i);
        out.push_back(s.substr(i, e == std::string::npos ? std::string::npos : e - i));
        ++n;
        i = e == std::string::npos ? e : s.find_first_not_of(ws, e);
      }
      return out;
    }

    static std::string case_map(std::string s, int mode) {  // 0 lower, 1 upper, 2 title, 3 capitalize (ASCII)
      bool start = true;
      for (std::size_t i = 0; i < s.size(); ++i) {
        char& c = s[i];
        const bool alpha = std::isalpha(static_cast<unsigned char>(c));
        if (mode == 0) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
        else if (mode == 1) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        else if (mode == 2) c = static_cast<char>(start ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        else c = static_cast<char>(i == 0 ? std::toupper(static_cast<unsigned char>(c)) : std::tolower(static_cast<unsigned char>(c)));
        start = !alpha;
      }
      return s;
    }

    Value method(const Value& m, const std::vector<Value>& a, const Node& n) {
      const Json& self = m.j;
      const std::string& name = m.name;
      auto arg_str = [&](std::size_t k, const char* what) { return str_arg(a.at(k), what); };
      if (self.is_object()) {
        if (name == "items") {
          Json r = Json::array();
          for (auto it = self.begin(); it != self.end(); ++it) r.push_back(Json::array({it.key(), it.value()}));
          return Value::of(std::move(r));
        }
        if (name == "keys" || name == "values") {
          Json r = Json::array();
          for (auto it = self.begin(); it != self.end(); ++it) r.push_back(name == "keys" ? Json(it.key()) : it.value());
          return Value::of(std::move(r));
        }
        if (name == "get") {
          if (a.empty()) fail("get() needs a key");
          auto it = a[0].is_string() ? self.find(a[0].j.get<std::string>()) : self.end();
          if (it != self.end()) return Value::of(*it);
          return a.size() > 1 ? a[1] : Value::of(nullptr);
        }
      }
      const std::string s = self.get<std::string>();
      const std::string ws = " \t\n\r\f\v";
      if (name == "startswith" || name == "endswith") {
        if (a.empty()) fail(name + "() needs an argument");
        std::vector<std::string> options;
        if (a[0].kind == Value::data && a[0].j.is_array())
          for (const auto& e : a[0].j) options.push_back(e.get<std::string>());
        else
          options.push_back(arg_str(0, name.c_str()));
        for (const auto& o : options)
          if (name == "startswith" ? s.compare(0, o.size(), o) == 0 && s.size() >= o.size()
                                   : s.size() >= o.size() && s.compare(s.size() - o.size(), o.size(), o) == 0)
            return Value::of(true);
        return Value::of(false);
      }
      if (name == "strip" || name == "lstrip" || name == "rstrip") {
        const std::string chars = a.empty() || a[0].is_none() ? ws : arg_str(0, name.c_str());
        return Value::of(strip_chars(s, chars, name != "rstrip", name != "lstrip"));
      }
      if (name == "split" || name == "rsplit") {
        std::optional<std::string> sep;
        if (!a.empty() && !a[0].is_none()) sep = arg_str(0, "split");
        if (auto kw = kwarg(n, "sep"); kw && !kw->is_none()) sep = str_arg(*kw, "split");
        if (sep && sep->empty()) fail("split(): empty separator");
        std::int64_t maxsplit = a.size() > 1 ? int_arg(a[1], "split") : -1;
        if (auto kw = kwarg(n, "maxsplit")) maxsplit = int_arg(*kw, "split");
        if (name == "rsplit" && maxsplit >= 0) {
          if (!sep) fail("rsplit() with maxsplit needs a separator in nn's subset");
          Json all = py_split(s, sep, -1);
          if (static_cast<std::int64_t>(all.size()) <= maxsplit + 1) return Value::of(std::move(all));
          const std::size_t head = all.size() - static_cast<std::size_t>(maxsplit);
          std::string first;
          for (std::size_t k = 0; k < head; ++k) first += (k ? *sep : std::string()) + all[k].get<std::string>();
          Json r = Json::array({first});
          for (std::size_t k = head; k < all.size(); ++k) r.push_back(all[k]);
          return Value::of(std::move(r));
        }
        return Value::of(py_split(s, sep, maxsplit));
      }
      if (name == "splitlines") {
        Json r = Json::array();
        std::size_t b = 0;
        for (std::size_t k = 0; k < s.size(); ++k)
          if (s[k] == '\n' || s[k] == '\r') {
            r.push_back(s.substr(b, k - b));
            if (s[k] == '\r' && k + 1 < s.size() && s[k + 1] == '\n') ++k;
            b = k + 1;
          }
        if (b < s.size()) r.push_back(s.substr(b));
        return Value::of(std::move(r));
      }
      if (name == "upper") return Value::of(case_map(s, 1));
      if (name == "lower") return Value::of(case_map(s, 0));
      if (name == "title") return Value::of(case_map(s, 2));
      if (name == "capitalize") return Value::of(case_map(s, 3));
      if (name == "replace") {
        if (a.size() < 2) fail("replace() needs two arguments");
        const std::string from = arg_str(0, "replace"), to = arg_str(1, "replace");
        std::int64_t count = a.size() > 2 ? int_arg(a[2], "replace") : -1;
        std::string r;
        std::size_t b = 0;
        if (from.empty()) fail("replace(): an empty pattern");
        for (std::size_t k; count != 0 && (k = s.find(from, b)) != std::string::npos; --count) {
          r += s.substr(b, k - b) + to;
          b = k + from.size();
        }
        return Value::of(r + s.substr(b));
      }
      if (name == "find") {
        const std::size_t k = s.find(arg_str(0, "find"));
        return Value::of(k == std::string::npos ? std::int64_t{-1} : static_cast<std::int64_t>(k));
      }
      if (name == "count") {
        const std::string sub = arg_str(0, "count");
        if (sub.empty()) fail("count(): an empty pattern");
        std::int64_t c = 0;
        for (std::size_t k = s.find(sub); k != std::string::npos; k = s.find(sub, k + sub.size())) ++c;
        return Value::of(c);
      }
      if (name == "join") {
        std::string r;
        bool first = true;
        for (const Value& v : iterate(a.at(0))) {
          if (!first) r += s;
          first = false;
          r += str_arg(v, "join");
        }
        return Value::of(r);
      }
      fail("unsupported method '" + name + "'");
    }

    // Filter / test arguments, with a test named by a string (select('equalto', x)).
    bool run_test(const std::string& name, const Value& v, const std::vector<Value>& a) const {
      auto arg = [&](std::size_t k) -> const Value& {
        if (k >= a.size()) fail("test '" + name + "' needs an argument");
        return a[k];
      };
      if (name == "defined") return v.kind != Value::undefined;
      if (name == "undefined") return v.kind == Value::undefined;
      if (name == "none") return v.is_none();
      if (name == "string") return v.is_string();
      if (name == "mapping") return v.kind == Value::data && v.j.is_object();
      if (name == "iterable") return v.kind == Value::data && (v.j.is_array() || v.j.is_object() || v.j.is_string());
      if (name == "sequence") return v.kind == Value::data && (v.j.is_array() || v.j.is_object() || v.j.is_string());
      if (name == "number") return v.kind == Value::data && v.j.is_number();
      if (name == "integer") return v.kind == Value::data && v.j.is_number_integer();
      if (name == "float") return v.kind == Value::data && v.j.is_number_float();
      if (name == "boolean") return v.kind == Value::data && v.j.is_boolean();
      if (name == "true") return v.kind == Value::data && v.j.is_boolean() && v.j.get<bool>();
      if (name == "false") return v.kind == Value::data && v.j.is_boolean() && !v.j.get<bool>();
      if (name == "callable") return v.kind == Value::func || v.kind == Value::method;
      if (name == "equalto" || name == "eq" || name == "==") return detail::jinja::py_equal(v, arg(0));
      if (name == "ne" || name == "!=") return !detail::jinja::py_equal(v, arg(0));
      if (name == "sameas") return detail::jinja::py_equal(v, arg(0)) && v.kind == arg(0).kind &&
                                   (v.kind != Value::data || v.j.type() == arg(0).j.type());
      if (name == "lt" || name == "<") return compare("<", v, arg(0));
      if (name == "le" || name == "<=") return compare("<=", v, arg(0));
      if (name == "gt" || name == ">" || name == "greaterthan") return compare(">", v, arg(0));
      if (name == "ge" || name == ">=") return compare(">=", v, arg(0));
      if (name == "lessthan") return compare("<", v, arg(0));
      if (name == "in") return contains(arg(0), v);
      if (name == "odd" || name == "even") {
        const std::int64_t i = int_arg(v, name.c_str());
        return ((i % 2) != 0) == (name == "odd");
      }
      if (name == "divisibleby") {
        const std::int64_t d = int_arg(arg(0), "divisibleby");
        return d != 0 && int_arg(v, "divisibleby") % d == 0;
      }
      if (name == "lower" || name == "upper") {
        if (!v.is_string()) return false;
        const std::string s = v.j.get<std::string>();
        return s == case_map(s, name == "lower" ? 0 : 1);
      }
      fail("unsupported test '" + name + "'");
    }

    bool test(const Node& n) {
      Value v = eval(*n.args[0]);
      return run_test(n.s, v, args_of(n));
    }

    Value filter(const Node& n) {
      const std::string& f = n.s;
      Value v = eval(*n.args[0]);
      std::vector<Value> a = args_of(n);
      auto list_of = [&](const Value& x) {
        Json r = Json::array();
        for (const Value& e : iterate(x)) r.push_back(e.j);
        return r;
      };
      if (f == "tojson") {
        const Json& j = v.kind == Value::undefined ? Json() : data(v, "tojson");
        std::int64_t indent = -1;
        if (!a.empty() && !a[0].is_none()) indent = int_arg(a[0], "tojson");
        if (auto k = kwarg(n, "indent"); k && !k->is_none()) indent = int_arg(*k, "tojson");
        if (auto k = kwarg(n, "ensure_ascii"); k && detail::jinja::truthy(*k)) fail("tojson(ensure_ascii=True) is not supported");
        if (auto k = kwarg(n, "sort_keys"); k && detail::jinja::truthy(*k)) fail("tojson(sort_keys=True) is not supported");
        if (kwarg(n, "separators")) fail("tojson(separators=...) is not supported");
        std::string out;
        detail::jinja::py_json(out, j, static_cast<int>(indent), 0);
        return Value::of(out);
      }
      if (f == "length" || f == "count") {
        if (v.kind == Value::undefined) return Value::of(std::int64_t{0});
        const Json& j = data(v, "length");
        if (j.is_string()) return Value::of(static_cast<std::int64_t>(iterate(v).size()));
        if (!j.is_array() && !j.is_object()) fail("length of " + detail::jinja::py_str(v) + " (not a sequence)");
        return Value::of(static_cast<std::int64_t>(j.size()));
      }
      if (f == "trim") {
        const std::string chars = a.empty() || a[0].is_none() ? std::string(" \t\n\r\f\v") : str_arg(a[0], "trim");
        return Value::of(strip_chars(detail::jinja::py_str(v), chars, true, true));
      }
      if (f == "string") return Value::of(detail::jinja::py_str(v));
      if (f == "lower" || f == "upper" || f == "title" || f == "capitalize")
        return Value::of(case_map(detail::jinja::py_str(v), f == "lower" ? 0 : f == "upper" ? 1 : f == "title" ? 2 : 3));
      if (f == "safe" || f == "e" || f == "escape") {
        if (f != "safe") fail("filter '" + f + "' (HTML escaping) is not in nn's Jinja subset");
        return v;
      }
      if (f == "default" || f == "d") {
        const bool boolean = (a.size() > 1 && detail::jinja::truthy(a[1])) || (kwarg(n, "boolean") && detail::jinja::truthy(*kwarg(n, "boolean")));
        if (v.kind == Value::undefined || (boolean && !detail::jinja::truthy(v))) return a.empty() ? Value::of("") : a[0];
        return v;
      }
      if (f == "items") {
        if (v.kind == Value::undefined) return Value::of(Json::array());
        const Json& j = data(v, "items");
        if (!j.is_object()) fail("items of " + detail::jinja::py_str(v) + " (not a mapping)");
        Json r = Json::array();
        for (auto it = j.begin(); it != j.end(); ++it) r.push_back(Json::array({it.key(), it.value()}));
        return Value::of(std::move(r));
      }
      if (f == "list") return Value::of(list_of(v));
      if (f == "first" || f == "last") {
        const auto items = iterate(v);
        if (items.empty()) return Value::undef(f);
        return f == "first" ? items.front() : items.back();
      }
      if (f == "reverse") {
        if (v.is_string()) {
          auto items = iterate(v);
          std::string r;
          for (auto it = items.rbegin(); it != items.rend(); ++it) r += it->j.get<std::string>();
          return Value::of(r);
        }
        Json r = list_of(v);
        std::reverse(r.begin(), r.end());
        return Value::of(std::move(r));
      }
      if (f == "join") {
        const std::string sep = a.empty() ? std::string() : str_arg(a[0], "join");
        std::optional<std::string> attribute;
        if (auto k = kwarg(n, "attribute")) attribute = str_arg(*k, "join");
        std::string r;
        bool first = true;
        for (const Value& e : iterate(v)) {
          if (!first) r += sep;
          first = false;
          r += detail::jinja::py_str(attribute ? attr(e, *attribute) : e);
        }
        return Value::of(r);
      }
      if (f == "select" || f == "reject" || f == "selectattr" || f == "rejectattr") {
        const bool by_attr = f == "selectattr" || f == "rejectattr";
        const bool keep_if = f == "select" || f == "selectattr";
        std::size_t k = 0;
        std::optional<std::string> attribute;
        if (by_attr) attribute = str_arg(a.at(k++), f.c_str());
        std::optional<std::string> test_name;
        if (k < a.size()) test_name = str_arg(a[k++], f.c_str());
        const std::vector<Value> rest(a.begin() + static_cast<std::ptrdiff_t>(std::min(k, a.size())), a.end());
        Json r = Json::array();
        for (const Value& e : iterate(v)) {
          const Value subject = attribute ? attr(e, *attribute) : e;
          const bool pass = test_name ? run_test(*test_name, subject, rest) : detail::jinja::truthy(subject);
          if (pass == keep_if) r.push_back(e.j);
        }
        return Value::of(std::move(r));
      }
      if (f == "map") {
        Json r = Json::array();
        if (auto k = kwarg(n, "attribute")) {
          const std::string at = str_arg(*k, "map");
          for (const Value& e : iterate(v)) {
            Value x = attr(e, at);
            if (x.kind == Value::undefined) {
              if (auto d = kwarg(n, "default")) x = *d;
            }
            r.push_back(x.kind == Value::data ? x.j : Json());
          }
          return Value::of(std::move(r));
        }
        if (a.empty()) fail("map() needs a filter name or attribute=");
        const std::string fname = str_arg(a[0], "map");
        for (const Value& e : iterate(v)) {
          // Apply the named filter with the remaining arguments.
          auto node = std::make_shared<Node>();
          node->kind = Node::filter;
          node->s = fname;
          auto lit = std::make_shared<Node>();
          lit->value = e.j;
          node->args.push_back(lit);
          for (std::size_t k = 1; k < n.args.size() - 1; ++k) node->args.push_back(n.args[k + 1]);
          Value x = filter(*node);
          r.push_back(x.kind == Value::data ? x.j : Json());
        }
        return Value::of(std::move(r));
      }
      if (f == "unique") {
        Json r = Json::array();
        for (const Value& e : iterate(v)) {
          bool seen = false;
          for (const auto& x : r) seen = seen || detail::jinja::py_equal(Value::of(x), e);
          if (!seen) r.push_back(e.j);
        }
        return Value::of(std::move(r));
      }
      if (f == "replace") {
        if (a.size() < 2) fail("replace needs two arguments");
        Value m;
        m.kind = Value::method;
        m.name = "replace";
        m.j = detail::jinja::py_str(v);
        return method(m, a, n);
      }
      if (f == "int") {
        if (v.kind == Value::data && v.j.is_number()) return Value::of(v.j.is_number_float() ? static_cast<std::int64_t>(v.j.get<double>()) : v.j.get<std::int64_t>());
        if (v.is_string()) try {
            return Value::of(static_cast<std::int64_t>(std::stoll(v.j.get<std::string>())));
          } catch (...) {
          }
        return a.empty() ? Value::of(std::int64_t{0}) : a[0];
      }
      if (f == "float") {
        if (v.kind == Value::data && v.j.is_number()) return Value::of(v.j.get<double>());
        if (v.is_string()) try {
            return Value::of(std::stod(v.j.get<std::string>()));
          } catch (...) {
          }
        return a.empty() ? Value::of(0.0) : a[0];
      }
      if (f == "abs") {
        const Json& j = data(v, "abs");
        if (j.is_number_integer()) {
          if (j.get<std::int64_t>() == INT64_MIN) fail("integer overflow");
          return Value::of(std::llabs(j.get<std::int64_t>()));
        }
        return Value::of(std::fabs(j.get<double>()));
      }
      if (f == "sum" || f == "min" || f == "max") {
        const auto items = iterate(v);
        if (f == "sum") {
          Value acc = Value::of(std::int64_t{0});
          for (const Value& e : items) acc = binary("+", acc, e);
          return acc;
        }
        if (items.empty()) return Value::undef(f);
        Value best = items[0];
        for (const Value& e : items)
          if (compare(f == "min" ? "<" : ">", e, best)) best = e;
        return best;
      }
      if (f == "indent") {
        const std::int64_t w = a.empty() ? 4 : int_arg(a[0], "indent");
        const bool first = a.size() > 1 && detail::jinja::truthy(a[1]);
        const std::string pad(static_cast<std::size_t>(std::max<std::int64_t>(w, 0)), ' ');
        const std::string s = detail::jinja::py_str(v);
        std::string r;
        for (std::size_t k = 0; k < s.size(); ++k) {
          r += s[k];
          if (s[k] == '\n' && k + 1 < s.size() && s[k + 1] != '\n') r += pad;
        }
        return Value::of(first ? pad + r : r);
      }
      if (f == "wordcount") return Value::of(static_cast<std::int64_t>(py_split(detail::jinja::py_str(v), std::nullopt, -1).size()));
      if (f == "sort" || f == "dictsort") {
        Json r = f == "dictsort" ? filter_items(v) : list_of(v);
        std::stable_sort(r.begin(), r.end(), [&](const Json& x, const Json& y) {
          const Json& p = f == "dictsort" ? x[0] : x;
          const Json& q = f == "dictsort" ? y[0] : y;
          return compare("<", Value::of(p), Value::of(q));
        });
        if (!a.empty() && detail::jinja::truthy(a[0])) std::reverse(r.begin(), r.end());
        return Value::of(std::move(r));
      }
      fail("unsupported filter '" + f + "'");
    }

    Json filter_items(const Value& v) const {
      const Json& j = data(v, "dictsort");
      if (!j.is_object()) fail("dictsort of a non-mapping");
      Json r = Json::array();
      for (auto it = j.begin(); it != j.end(); ++it) r.push_back(Json::array({it.key(), it.value()}));
      return r;
    }
  };

  std::string source_;
  std::string name_ = "chat_template";
  std::shared_ptr<const detail::jinja::Body> body_;
};

}  // namespace nn::lm
// ---- end nn/lm/chat_template.hpp ----
// ---- begin nn/lm/data.hpp ----
// Fine-tuning data as mlx-lm reads it: JSONL in three forms ({"text"}, {"prompt","completion"},
// {"messages"} through the model's own chat template, or ChatML), tokenized, split, shuffled
// with a seed, and batched with padding and a loss mask.

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <istream>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>


namespace nn::lm {

/// What the data layer needs of a tokenizer: encode text without adding special tokens (the
/// templates write them), and the end-of-sequence id.
template <class T>
concept TextEncoder = requires(const T& t, const std::string& s) {
  { t.encode(s, false) } -> std::convertible_to<std::vector<std::int32_t>>;
  { t.eos_id() } -> std::convertible_to<std::int32_t>;
};

/// One training sequence: its tokens, the first token position that counts in the loss (0 =
/// all; the prompt's length when only the completion is learned), and, for a conversation
/// learned turn by turn, the token ranges [begin, end) of its assistant turns (empty: everything
/// from `offset` on).
struct Example {
  std::vector<std::int32_t> tokens;
  std::size_t offset = 0;
  std::vector<std::pair<std::size_t, std::size_t>> learn;

  /// Whether the next-token target at token position `pos` (>= 1) counts in the loss.
  bool learned(std::size_t pos) const {
    if (pos < std::max<std::size_t>(offset, 1)) return false;
    if (learn.empty()) return true;
    for (const auto& [b, e] : learn)
      if (pos >= b && pos < e) return true;
    return false;
  }
};

/// A chat message, as mlx-lm's {"role", "content"}.
struct Message {
  std::string role, content;
};

/// ChatML (<|im_start|>role\ncontent<|im_end|>\n), the format of SmolLM2-Instruct and Qwen2.
/// `default_system`, when not empty, is inserted as the system message of a conversation that
/// has none (Qwen2.5's template does this with "You are a helpful assistant.").
struct ChatML {
  std::string default_system;

  std::string render(const std::vector<Message>& messages, bool add_generation_prompt) const {
    std::string out;
    if (!default_system.empty() && (messages.empty() || messages.front().role != "system"))
      out += "<|im_start|>system\n" + default_system + "<|im_end|>\n";
    for (const Message& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
};

/// How the three JSONL forms become examples.
struct DataOptions {
  ChatML chat;
  /// The model's own chat template (tokenizer.chat_template), used instead of `chat` when set:
  /// conversations render as apply_chat_template renders them, with every field of each message
  /// (tool_calls, reasoning_content, ...) and the record's "tools" passed through, as mlx-lm
  /// does. `template_vars` go beside them (bos_token, eos_token, options like enable_thinking).
  std::shared_ptr<const ChatTemplate> chat_template;
  nlohmann::ordered_json template_vars = nlohmann::ordered_json::object();
  /// Learn only the completion / the assistant turns (mlx-lm's --mask-prompt).
  bool mask_prompt = true;
  /// With mask_prompt, a {"messages"} conversation learns every assistant turn, each from its
  /// first token to its end-of-turn marker, and nothing else (the user, system and tool turns
  /// are context). False: mlx-lm's rule, the last message only, everything before it masked.
  bool every_assistant_turn = true;
};

namespace detail {

[[noreturn]] inline void data_fail(const std::string& where, std::size_t line, const std::string& what) {
  nn::detail::fail("data", where, ":", line, ": ", what);
}

inline std::string field_string(const nlohmann::json& j, const char* key, const std::string& where, std::size_t line) {
  auto it = j.find(key);
  if (it == j.end()) data_fail(where, line, std::string("missing field \"") + key + "\"");
  if (!it->is_string()) data_fail(where, line, std::string("field \"") + key + "\" must be a string");
  return it->get<std::string>();
}

}  // namespace detail

/// One JSONL record as an example. Forms (as mlx-lm's create_dataset): {"text"}: every token
/// counts, an EOS is appended if missing; {"prompt", "completion"}: a user/assistant exchange in
/// the chat format, the prompt masked; {"messages": [{"role", "content"}, ...], "tools": [...]}:
/// the conversation, all but the last message masked. `where`/`line` name the source in errors.
/// `ordered`, when given, is the same record with its keys in file order (what a chat template's
/// tojson prints); without it they come sorted.
template <TextEncoder Tok>
Example make_example(const nlohmann::json& j, const Tok& tok, const DataOptions& opt, const std::string& where,
                     std::size_t line, const nlohmann::ordered_json* ordered = nullptr) {
  if (!j.is_object()) detail::data_fail(where, line, "a record must be a JSON object");
  Example ex;
  if (j.contains("text")) {
    ex.tokens = tok.encode(detail::field_string(j, "text", where, line), false);
    if (ex.tokens.empty() || ex.tokens.back() != tok.eos_id()) ex.tokens.push_back(tok.eos_id());
    return ex;
  }
  // The conversation as roles and a renderer of its first n messages (with or without the
  // generation prompt): through the chat template, or ChatML.
  std::vector<std::string> roles;
  std::function<std::string(std::size_t, bool)> render;
  std::vector<Message> msgs;
  nlohmann::ordered_json jmsgs = nlohmann::ordered_json::array(), tools;
  if (j.contains("prompt") || j.contains("completion")) {
    msgs = {{"user", detail::field_string(j, "prompt", where, line)},
            {"assistant", detail::field_string(j, "completion", where, line)}};
    for (const Message& m : msgs) jmsgs.push_back({{"role", m.role}, {"content", m.content}});
  } else if (j.contains("messages")) {
    const auto& ms = j["messages"];
    if (!ms.is_array() || ms.empty()) detail::data_fail(where, line, "field \"messages\" must be a non-empty array");
    if (!opt.chat_template && j.contains("tools"))
      detail::data_fail(where, line, "\"tools\" needs the model's chat template (ChatML has no tool format)");
    const nlohmann::ordered_json oj = ordered ? *ordered : nlohmann::ordered_json(j);
    for (std::size_t i = 0; i < ms.size(); ++i) {
      if (!ms[i].is_object())
        detail::data_fail(where, line, "messages[" + std::to_string(i) + "] must be an object");
      const std::string role = detail::field_string(ms[i], "role", where, line);
      // A template takes any message (a tool call's content may be null); ChatML needs text.
      msgs.push_back({role, opt.chat_template ? std::string() : detail::field_string(ms[i], "content", where, line)});
      jmsgs.push_back(oj["messages"][i]);
    }
    if (j.contains("tools")) {
      if (!j["tools"].is_array() && !j["tools"].is_null()) detail::data_fail(where, line, "field \"tools\" must be an array");
      tools = oj["tools"];
    }
  } else {
    detail::data_fail(where, line, "a record needs \"text\", \"prompt\"+\"completion\" or \"messages\"");
  }
  for (const Message& m : msgs) roles.push_back(m.role);
  if (opt.chat_template) {
    render = [&](std::size_t n, bool open) {
      const nlohmann::ordered_json part(jmsgs.begin(), jmsgs.begin() + static_cast<std::ptrdiff_t>(n));
      try {
        return opt.chat_template->apply(part, open, opt.template_vars, tools);
      } catch (const nn::Error& e) {
        detail::data_fail(where, line, e.what());
      }
    };
  } else {
    render = [&](std::size_t n, bool open) {
      return opt.chat.render(std::vector<Message>(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(n)), open);
    };
  }
  ex.tokens = tok.encode(render(roles.size(), false), false);
  if (!opt.mask_prompt) return ex;
  const auto count = [&](std::size_t n, bool open_turn) { return tok.encode(render(n, open_turn), false).size(); };
  if (opt.every_assistant_turn) {
    // each assistant turn: from after its header (the prefix rendered with a generation prompt)
    // to the end of the prefix that includes it (its content and end-of-turn marker)
    for (std::size_t i = 0; i < roles.size(); ++i)
      if (roles[i] == "assistant")
        ex.learn.emplace_back(std::min(count(i, true), ex.tokens.size()), std::min(count(i + 1, false), ex.tokens.size()));
    if (!ex.learn.empty()) {
      ex.offset = ex.learn.front().first;
      return ex;
    }
  }
  ex.offset = count(roles.size() - 1, roles.back() == "assistant");
  return ex;
}

/// Every record of JSONL text read from `in` (blank lines skipped); `label` (the file) leads
/// errors, with the line.
template <TextEncoder Tok>
std::vector<Example> read_jsonl(std::istream& in, const std::string& label, const Tok& tok, const DataOptions& opt = {}) {
  std::vector<Example> out;
  std::string text;
  std::size_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = detail::parse_json_strict(text, "data", label + ":" + std::to_string(line));
    if (opt.chat_template) {  // keys in file order for the template (strictness checked above)
      const nlohmann::ordered_json oj = nlohmann::ordered_json::parse(text);
      out.push_back(make_example(j, tok, opt, label, line, &oj));
    } else {
      out.push_back(make_example(j, tok, opt, label, line));
    }
  }
  if (out.empty()) nn::detail::fail("data", label, ": no records");
  return out;
}

/// Every record of a JSONL file (blank lines skipped). Errors name the file and line.
template <TextEncoder Tok>
std::vector<Example> load_jsonl(const std::filesystem::path& path, const Tok& tok, const DataOptions& opt = {}) {
  std::ifstream f(path);
  if (!f) nn::detail::fail("data", path.string(), ": cannot open the file");
  return read_jsonl(f, path.string(), tok, opt);
}

/// The train and validation sets: from DIR/train.jsonl and DIR/valid.jsonl (mlx-lm's layout),
/// or from one file split with `valid_fraction` of the records (shuffled with `seed`) held out.
struct Splits {
  std::vector<Example> train, valid;
};

template <TextEncoder Tok>
Splits load_splits(const std::filesystem::path& path, const Tok& tok, const DataOptions& opt = {},
                   double valid_fraction = 0.1, std::uint64_t seed = 0) {
  if (std::filesystem::is_directory(path)) {
    Splits s;
    s.train = load_jsonl(path / "train.jsonl", tok, opt);
    if (std::filesystem::exists(path / "valid.jsonl")) s.valid = load_jsonl(path / "valid.jsonl", tok, opt);
    return s;
  }
  std::vector<Example> all = load_jsonl(path, tok, opt);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  const std::size_t nv = std::min(all.size() - 1, static_cast<std::size_t>(valid_fraction * static_cast<double>(all.size())));
  Splits s;
  s.valid.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(nv));
  s.train.assign(all.begin() + static_cast<std::ptrdiff_t>(nv), all.end());
  return s;
}

/// A padded batch. inputs/targets: (B, T) int32, targets[b, t] = tokens[t + 1] (0 as padding);
/// mask: (B, T) float32, 1 where the target counts: t + 1 in [max(offset, 1), length - 1] (the
/// next-token targets of the sequence's own tokens after the prompt). mlx-lm's default_loss also
/// counts one padding target at t + 1 = length; this mask does not.
struct Batch {
  Tensor inputs, targets, mask;
  std::int64_t tokens = 0;  // how many targets count
};

/// Batch `rows` of `data` (indices), padded to the longest (truncated to max_seq tokens).
/// `pad_to` rounds T up (mlx-lm pads to a multiple of 32; a fixed T lets a compiled step replay).
inline Batch make_batch(const std::vector<Example>& data, std::span<const std::size_t> rows, std::int64_t max_seq,
                        std::int64_t pad_to = 1, DType mask_dtype = DType::f32) {
  if (rows.empty()) nn::detail::fail("data", "an empty batch");
  std::int64_t longest = 0;
  for (std::size_t r : rows) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(data[r].tokens.size()));
  longest = std::min(longest, max_seq);
  std::int64_t T = std::max<std::int64_t>(longest - 1, 1);
  if (pad_to > 1) T = std::min((T + pad_to - 1) / pad_to * pad_to, std::max<std::int64_t>(max_seq - 1, 1));
  const std::int64_t B = static_cast<std::int64_t>(rows.size());
  std::vector<std::int32_t> in(static_cast<std::size_t>(B * T), 0), tg(in.size(), 0);
  std::vector<double> mk(in.size(), 0.0);
  std::int64_t count = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const Example& ex = data[rows[static_cast<std::size_t>(b)]];
    const std::int64_t L = std::min<std::int64_t>(static_cast<std::int64_t>(ex.tokens.size()), max_seq);
    for (std::int64_t t = 0; t < T && t + 1 < L; ++t) {
      const std::size_t i = static_cast<std::size_t>(b * T + t);
      in[i] = ex.tokens[static_cast<std::size_t>(t)];
      tg[i] = ex.tokens[static_cast<std::size_t>(t + 1)];
      if (ex.learned(static_cast<std::size_t>(t + 1))) {
        mk[i] = 1.0;
        ++count;
      }
    }
  }
  return {Tensor::from<std::int32_t>({B, T}, in), Tensor::from<std::int32_t>({B, T}, tg),
          Tensor::from_doubles({B, T}, mk, mask_dtype), count};
}

/// Sequence packing (TRL's packing, kept apart by document): which examples each row of `T`
/// positions holds, first-fit decreasing. An example of L tokens takes L - 1 positions (its
/// input/target pairs), truncated to T as make_batch truncates; rows are filled longest first,
/// each example going into the first row with room. Deterministic; every example is placed once.
inline std::vector<std::vector<std::size_t>> pack_examples(const std::vector<Example>& data, std::int64_t T) {
  if (T < 1) nn::detail::fail("data", "pack_examples needs T >= 1, got ", T);
  auto len = [&](std::size_t i) {
    return std::clamp<std::int64_t>(static_cast<std::int64_t>(data[i].tokens.size()) - 1, 1, T);
  };
  std::vector<std::size_t> idx(data.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return len(a) > len(b); });
  std::vector<std::vector<std::size_t>> rows;
  std::vector<std::int64_t> room;
  for (std::size_t i : idx) {
    std::size_t r = 0;
    while (r < rows.size() && room[r] < len(i)) ++r;
    if (r == rows.size()) {
      rows.emplace_back();
      room.push_back(T);
    }
    rows[r].push_back(i);
    room[r] -= len(i);
  }
  return rows;
}

/// The share of a packing's positions that hold an example's token (the rest is padding).
inline double pack_fill(const std::vector<Example>& data, const std::vector<std::vector<std::size_t>>& rows, std::int64_t T) {
  std::int64_t used = 0;
  for (const auto& r : rows)
    for (std::size_t i : r) used += std::clamp<std::int64_t>(static_cast<std::int64_t>(data[i].tokens.size()) - 1, 1, T);
  return rows.empty() ? 0.0 : static_cast<double>(used) / static_cast<double>(T * static_cast<std::int64_t>(rows.size()));
}

/// A batch of packed rows (B, T): inputs, targets and mask as make_batch makes them per example
/// (the prompt of a prompt/completion or chat example stays masked), plus each position's
/// document start and position inside its document (CausalLM's Packing), both int32. Padding
/// after the last document is its own one-token documents with mask 0.
struct PackedBatch {
  Batch batch;
  Tensor starts, positions;
};
inline PackedBatch make_packed_batch(const std::vector<Example>& data, std::span<const std::vector<std::size_t>> rows,
                                     std::int64_t T, DType mask_dtype = DType::f32) {
  if (rows.empty()) nn::detail::fail("data", "an empty batch");
  const std::int64_t B = static_cast<std::int64_t>(rows.size());
  const std::size_t n = static_cast<std::size_t>(B * T);
  std::vector<std::int32_t> in(n, 0), tg(n, 0), st(n), pos(n, 0);
  std::vector<double> mk(n, 0.0);
  std::int64_t count = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t at = 0;  // the next free position of row b
    for (std::size_t e : rows[static_cast<std::size_t>(b)]) {
      const Example& ex = data[e];
      const std::int64_t L = std::min<std::int64_t>(static_cast<std::int64_t>(ex.tokens.size()), T + 1);
      const std::int64_t m = std::max<std::int64_t>(L - 1, 1);
      if (at + m > T) nn::detail::fail("data", "packed row ", b, " holds more than ", T, " positions");
      for (std::int64_t t = 0; t < m; ++t) {
        const std::size_t i = static_cast<std::size_t>(b * T + at + t);
        st[i] = static_cast<std::int32_t>(at);
        pos[i] = static_cast<std::int32_t>(t);
        if (t + 1 >= L) continue;  // a one-token example: no target
        in[i] = ex.tokens[static_cast<std::size_t>(t)];
        tg[i] = ex.tokens[static_cast<std::size_t>(t + 1)];
        if (ex.learned(static_cast<std::size_t>(t + 1))) {
          mk[i] = 1.0;
          ++count;
        }
      }
      at += m;
    }
    for (std::int64_t t = at; t < T; ++t) st[static_cast<std::size_t>(b * T + t)] = static_cast<std::int32_t>(t);
  }
  PackedBatch out;
  out.batch = {Tensor::from<std::int32_t>({B, T}, in), Tensor::from<std::int32_t>({B, T}, tg),
               Tensor::from_doubles({B, T}, mk, mask_dtype), count};
  out.starts = Tensor::from<std::int32_t>({B, T}, st);
  out.positions = Tensor::from<std::int32_t>({B, T}, pos);
  return out;
}

/// Batches over `data` for training: examples sorted by length and grouped (so padding is
/// small), batch order shuffled with `seed` each epoch (as mlx-lm's iterate_batches). Yields
/// index lists; pass them to make_batch.
class BatchOrder {
 public:
  BatchOrder(const std::vector<Example>& data, std::size_t batch, std::uint64_t seed) : rng_(seed) {
    if (data.size() < batch)
      nn::detail::fail("data", "the data set has ", data.size(), " examples, fewer than the batch size ", batch);
    std::vector<std::size_t> idx(data.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](std::size_t a, std::size_t b) { return data[a].tokens.size() < data[b].tokens.size(); });
    group(idx, batch);
  }
  /// Over `n` items of one length (packed rows, pack_examples): batches of consecutive indices,
  /// their order shuffled each epoch the same way.
  BatchOrder(std::size_t n, std::size_t batch, std::uint64_t seed) : rng_(seed) {
    if (n < batch) nn::detail::fail("data", "the data set packs into ", n, " rows, fewer than the batch size ", batch);
    std::vector<std::size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    group(idx, batch);
  }
  /// The next batch's rows; a new shuffled epoch starts when one ends.
  const std::vector<std::size_t>& next() {
    if (pos_ == order_.size()) reshuffle();
    return batches_[order_[pos_++]];
  }
  std::size_t batches_per_epoch() const { return batches_.size(); }

 private:
  void group(const std::vector<std::size_t>& idx, std::size_t batch) {
    for (std::size_t i = 0; i + batch <= idx.size(); i += batch)
      batches_.emplace_back(idx.begin() + static_cast<std::ptrdiff_t>(i), idx.begin() + static_cast<std::ptrdiff_t>(i + batch));
    reshuffle();
  }
  void reshuffle() {
    order_.resize(batches_.size());
    std::iota(order_.begin(), order_.end(), 0);
    std::shuffle(order_.begin(), order_.end(), rng_);
    pos_ = 0;
  }
  std::vector<std::vector<std::size_t>> batches_;
  std::vector<std::size_t> order_;
  std::size_t pos_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace nn::lm
// ---- end nn/lm/data.hpp ----
// ---- begin nn/lm/pretrained.hpp ----
// A pretrained model and its tokenizer from a Hugging Face folder (config.json, safetensors,
// tokenizer.json) or a GGUF file (weights, hyperparameters and tokenizer in its metadata).

#include <filesystem>
#include <fstream>
#include <iterator>
#include <optional>
#include <string>


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
// ---- end nn/lm/pretrained.hpp ----
// ---- begin nn/lm/gguf_write.hpp ----
// GGUF writer: builds a GGUF v3 file (the layout gguf.hpp reads; ggml docs/gguf.md) from metadata
// of every value type (scalars, strings, arrays of them, nested arrays) and tensors already in
// their ggml type's bytes (gguf_quantize.hpp makes them), and writes it atomically
// (io/atomic_file.hpp: a temporary sibling, fsync, rename; nothing is left behind on failure).
//
// Layout written, all little-endian:
//   "GGUF" · u32 3 · u64 tensor_count · u64 kv_count · kvs (insertion order) · tensor infos
//   · zero padding to general.alignment (32 unless set) · each tensor's bytes at its offset, each
//   padded to the alignment (as gguf-py's GGUFWriter pads them).
// Every check (sizes against the type's blocks, names, alignment) runs before a byte is written.

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>


namespace nn::lm {

class GgufWriter {
 public:
  // ---- metadata: set() replaces a key in place, or appends it -------------------------------
  /// A scalar: uint8..int64 map to GGUF's integer types of the same width and sign, float to
  /// float32, double to float64, bool to bool; strings (std::string, string_view, const char*).
  template <class T>
  void set(std::string key, T v) {
    Bytes b;
    if constexpr (std::is_convertible_v<T, std::string_view> && !std::is_same_v<T, bool>) {
      put_str(b, std::string_view(v));
      put_kv(std::move(key), GgufType::string, std::move(b));
    } else {
      put_scalar(b, v);
      put_kv(std::move(key), scalar_type<T>(), std::move(b));
    }
  }
  /// An array of scalars (as set()) or of strings.
  template <class T>
  void set_array(std::string key, const std::vector<T>& v) {
    Bytes b;
    if constexpr (std::is_same_v<T, std::string>) {
      put_le(b, static_cast<std::uint32_t>(GgufType::string));
      put_le(b, static_cast<std::uint64_t>(v.size()));
      for (const std::string& s : v) put_str(b, s);
    } else {
      put_le(b, static_cast<std::uint32_t>(scalar_type<T>()));
      put_le(b, static_cast<std::uint64_t>(v.size()));
      for (const T& x : v) put_scalar(b, x);
    }
    put_kv(std::move(key), GgufType::array, std::move(b));
  }
  /// A value read from another file, type for type (so carried metadata keeps its exact types).
  void copy(std::string key, const GgufValue& v) {
    Bytes b;
    put_value(b, v);
    put_kv(std::move(key), v.type(), std::move(b));
  }
  void remove(std::string_view key) {
    for (std::size_t i = 0; i < kv_.size(); ++i)
      if (kv_[i].key == key) {
        kv_.erase(kv_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }
  bool contains(std::string_view key) const {
    for (const Kv& kv : kv_)
      if (kv.key == key) return true;
    return false;
  }
  std::size_t metadata_count() const { return kv_.size(); }

  // ---- tensors --------------------------------------------------------------------------------
  /// A tensor of row-major `shape` (written as ne = shape reversed) whose bytes are already in
  /// ggml type `type`. Raises when the bytes do not match the shape and type, when the rows do not
  /// split into the type's blocks, or when the name repeats or is too long for ggml (63 bytes).
  void add_tensor(std::string name, const std::vector<std::int64_t>& shape, std::uint32_t type,
                  std::vector<std::byte> data) {
    const GgmlTypeInfo* info = ggml_type_info(type);
    if (!info) nn::detail::fail("gguf_write", "tensor \"", name, "\": unknown ggml type ", type);
    if (name.empty() || name.size() >= 64)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": a ggml tensor name has 1 to 63 bytes, this one ", name.size());
    for (const Tensor_& t : tensors_)
      if (t.name == name) nn::detail::fail("gguf_write", "tensor \"", name, "\" is added twice");
    if (shape.empty() || shape.size() > 4)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": ", shape.size(), " dimensions (ggml holds 1 to 4)");
    std::int64_t numel = 1;
    for (std::int64_t d : shape) {
      if (d <= 0) nn::detail::fail("gguf_write", "tensor \"", name, "\": dimension ", d, " is not positive");
      numel *= d;
    }
    const std::int64_t row = shape.back();
    if (row % info->block != 0)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": rows of ", row, " do not split into ", info->name,
                       " blocks of ", info->block);
    const auto nbytes = static_cast<std::uint64_t>(numel / info->block) * info->bytes;
    if (data.size() != nbytes)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": ", data.size(), " bytes given, ", info->name, " ",
                       shape_str(shape), " takes ", nbytes);
    tensors_.push_back({std::move(name), {shape.rbegin(), shape.rend()}, type, std::move(data)});
  }
  std::size_t tensor_count() const { return tensors_.size(); }

  // ---- output ---------------------------------------------------------------------------------
  /// The whole file image.
  std::vector<std::byte> bytes() const {
    std::vector<std::byte> out;
    emit([&](const std::byte* p, std::size_t k) { out.insert(out.end(), p, p + k); });
    return out;
  }
  /// Writes the file atomically; on error nn::Error names the path and the reason, and neither
  /// the target nor a temporary file is left changed.
  void write(const std::filesystem::path& path) const {
    alignment();  // checked before the file is touched
    nn::detail::write_atomically(path, "gguf_write", [&](const nn::detail::ByteSink& sink) { emit(sink); });
  }

 private:
  using Bytes = std::vector<std::byte>;
  struct Kv {
    std::string key;
    GgufType type;
    Bytes value;  // the encoded value after the type field
  };
  struct Tensor_ {
    std::string name;
    std::vector<std::int64_t> ne;
    std::uint32_t type;
    Bytes data;
  };

  static std::string shape_str(const std::vector<std::int64_t>& s) {
    std::string r = "(";
    for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + ")";
  }
  template <class T>
  static constexpr GgufType scalar_type() {
    if constexpr (std::is_same_v<T, bool>) return GgufType::boolean;
    else if constexpr (std::is_same_v<T, float>) return GgufType::f32;
    else if constexpr (std::is_same_v<T, double>) return GgufType::f64;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 1) return std::is_signed_v<T> ? GgufType::i8 : GgufType::u8;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 2) return std::is_signed_v<T> ? GgufType::i16 : GgufType::u16;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 4) return std::is_signed_v<T> ? GgufType::i32 : GgufType::u32;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return std::is_signed_v<T> ? GgufType::i64 : GgufType::u64;
    else static_assert(sizeof(T) == 0, "GGUF metadata holds integers, float, double, bool and strings");
  }
  template <class T>
  static void put_le(Bytes& b, T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) v = detail::gguf_bswap(v);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  template <class T>
  static void put_scalar(Bytes& b, T v) {
    if constexpr (std::is_same_v<T, bool>) put_le(b, static_cast<std::uint8_t>(v ? 1 : 0));
    else if constexpr (std::is_same_v<T, float>) put_le(b, std::bit_cast<std::uint32_t>(v));
    else if constexpr (std::is_same_v<T, double>) put_le(b, std::bit_cast<std::uint64_t>(v));
    else put_le(b, v);
  }
  static void put_str(Bytes& b, std::string_view s) {
    put_le(b, static_cast<std::uint64_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    b.insert(b.end(), p, p + s.size());
  }
  /// One element of type t from a reader's value (integers through as_int / as_uint by width).
  static void put_typed(Bytes& b, GgufType t, std::int64_t i, double f) {
    switch (t) {
      case GgufType::u8: put_le(b, static_cast<std::uint8_t>(i)); break;
      case GgufType::i8: put_le(b, static_cast<std::int8_t>(i)); break;
      case GgufType::u16: put_le(b, static_cast<std::uint16_t>(i)); break;
      case GgufType::i16: put_le(b, static_cast<std::int16_t>(i)); break;
      case GgufType::u32: put_le(b, static_cast<std::uint32_t>(i)); break;
      case GgufType::i32: put_le(b, static_cast<std::int32_t>(i)); break;
      case GgufType::u64: put_le(b, static_cast<std::uint64_t>(i)); break;  // bit-cast back
      case GgufType::i64: put_le(b, i); break;
      case GgufType::boolean: put_le(b, static_cast<std::uint8_t>(i != 0)); break;
      case GgufType::f32: put_le(b, std::bit_cast<std::uint32_t>(static_cast<float>(f))); break;  // exact: read from f32
      case GgufType::f64: put_le(b, std::bit_cast<std::uint64_t>(f)); break;
      default: nn::detail::fail("gguf_write", "not a scalar type: ", gguf_type_name(t));
    }
  }
  static void put_value(Bytes& b, const GgufValue& v) {
    switch (v.type()) {
      case GgufType::string: put_str(b, v.as_string()); return;
      case GgufType::array: {
        const GgufType et = v.array_type();
        put_le(b, static_cast<std::uint32_t>(et));
        put_le(b, static_cast<std::uint64_t>(v.size()));
        if (et == GgufType::string) {
          for (const std::string& s : v.strings()) put_str(b, s);
        } else if (et == GgufType::array) {
          for (const GgufValue& a : v.arrays()) put_value(b, a);
        } else if (et == GgufType::f32 || et == GgufType::f64) {
          for (double x : v.floats()) put_typed(b, et, 0, x);
        } else {
          // ints() refuses uint64 elements above 2^63 - 1; their bits go through unchanged here.
          const std::vector<std::int64_t> xs = et == GgufType::u64 ? u64_bits(v) : v.ints();
          for (std::int64_t x : xs) put_typed(b, et, x, 0);
        }
        return;
      }
      case GgufType::f32: case GgufType::f64: put_typed(b, v.type(), 0, v.as_float()); return;
      case GgufType::u64: put_le(b, v.as_uint()); return;
      case GgufType::boolean: put_typed(b, v.type(), v.as_bool(), 0); return;
      default: put_typed(b, v.type(), v.as_int(), 0); return;
    }
  }
  static std::vector<std::int64_t> u64_bits(const GgufValue& v) {
    try {
      return v.ints();
    } catch (const nn::Error&) {
      nn::detail::fail("gguf_write", "key \"", v.key(), "\": uint64 array elements above 2^63 - 1 are not carried");
    }
  }
  void put_kv(std::string key, GgufType t, Bytes b) {
    for (Kv& kv : kv_)
      if (kv.key == key) {
        kv.type = t;
        kv.value = std::move(b);
        return;
      }
    kv_.push_back({std::move(key), t, std::move(b)});
  }
  std::uint64_t alignment() const {
    for (const Kv& kv : kv_)
      if (kv.key == "general.alignment") {
        std::uint32_t a = 0;
        if (kv.type != GgufType::u32) nn::detail::fail("gguf_write", "general.alignment must be a uint32");
        std::memcpy(&a, kv.value.data(), 4);
        if (a == 0 || (a & (a - 1)) != 0) nn::detail::fail("gguf_write", "general.alignment ", a, " is not a power of two");
        return a;
      }
    return 32;
  }
  template <class Sink>
  void emit(Sink&& sink) const {
    const std::uint64_t al = alignment();
    auto pad = [&](std::uint64_t n) { return (n + al - 1) / al * al; };
    Bytes h;
    h.insert(h.end(), {std::byte{'G'}, std::byte{'G'}, std::byte{'U'}, std::byte{'F'}});
    put_le(h, std::uint32_t{3});
    put_le(h, static_cast<std::uint64_t>(tensors_.size()));
    put_le(h, static_cast<std::uint64_t>(kv_.size()));
    for (const Kv& kv : kv_) {
      put_str(h, kv.key);
      put_le(h, static_cast<std::uint32_t>(kv.type));
      h.insert(h.end(), kv.value.begin(), kv.value.end());
    }
    std::uint64_t offset = 0;
    for (const Tensor_& t : tensors_) {
      put_str(h, t.name);
      put_le(h, static_cast<std::uint32_t>(t.ne.size()));
      for (std::int64_t d : t.ne) put_le(h, static_cast<std::uint64_t>(d));
      put_le(h, t.type);
      put_le(h, offset);
      offset += pad(t.data.size());
    }
    h.resize(static_cast<std::size_t>(pad(h.size())), std::byte{0});
    sink(h.data(), h.size());
    static const Bytes zeros(4096, std::byte{0});
    for (const Tensor_& t : tensors_) {
      sink(t.data.data(), t.data.size());
      std::size_t fill = static_cast<std::size_t>(pad(t.data.size()) - t.data.size());
      for (; fill > 0;) {
        const std::size_t k = std::min(fill, zeros.size());
        sink(zeros.data(), k);
        fill -= k;
      }
    }
  }

  std::vector<Kv> kv_;
  std::vector<Tensor_> tensors_;
};

}  // namespace nn::lm
// ---- end nn/lm/gguf_write.hpp ----
// ---- begin nn/lm/gguf_quantize.hpp ----
// GGUF quantizers: float32 rows into ggml's tensor types, the inverse of gguf.hpp's
// detail::gguf_decode_block. Written here after ggml's reference algorithms (ggml-quants.c's
// quantize_row_*_ref, which llama-quantize runs when no importance matrix is given), step for step
// and in the same float32 operation order, so:
//   F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1  give gguf-py's quantize() bytes exactly;
//   Q4_K Q5_K Q6_K                          give ggml's reference bytes (gguf-py has no quantizer
//                                           for them), checked against ggml's own quantize-fns
//                                           error thresholds and against gguf-py's dequantize.
// (The equality needs the compiler not to contract a * b + c into an FMA, which is GCC's and
// Clang's default unless -march enables FMA with -ffp-contract=fast.)
//
// Block layouts (ggml-common.h), QK = 32 elements, QK_K = 256:
//   Q8_0  f16 d · int8 q[32]                               x ≈ d·q,          d = amax / 127
//   Q4_0  f16 d · u8 qs[16]                                x ≈ d·(q − 8),    d = max / −8
//   Q4_1  f16 d · f16 m · u8 qs[16]                        x ≈ d·q + m,      d = (max − min) / 15
//   Q5_0  f16 d · u32 qh · u8 qs[16]                       x ≈ d·(q − 16),   d = max / −16
//   Q5_1  f16 d · f16 m · u32 qh · u8 qs[16]               x ≈ d·q + m,      d = (max − min) / 31
//   Q4_K  f16 d · f16 dmin · u8 scales[12] · u8 qs[128]     8 groups of 32: x ≈ d·sc·q − dmin·m
//   Q5_K  f16 d · f16 dmin · u8 scales[12] · qh[32] · qs[128]  the same with 5-bit q
//   Q6_K  u8 ql[128] · u8 qh[64] · int8 scales[16] · f16 d   16 groups of 16: x ≈ d·sc·(q − 32)
// (max is the element of largest magnitude, with its sign.)

#include <algorithm>
#include <cmath>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <string>
#include <vector>


namespace nn::lm {

/// Whether gguf_quantize writes ggml type `type`: F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K.
inline bool gguf_can_quantize(std::uint32_t type) {
  switch (type) {
    case 0: case 1: case 30: case 8: case 2: case 3: case 6: case 7: case 12: case 13: case 14: return true;
    default: return false;
  }
}

namespace detail {

inline void gguf_put_u16(std::byte* p, std::uint16_t v) {
  p[0] = static_cast<std::byte>(v & 0xff);
  p[1] = static_cast<std::byte>(v >> 8);
}
inline void gguf_put_f16(std::byte* p, float v) { gguf_put_u16(p, half::f32_to_f16(v)); }
inline float gguf_f16_round(float v) { return half::f16_to_f32(half::f32_to_f16(v)); }

/// ggml's nearest_int: round to nearest, ties to even, through the float32 mantissa (|x| < 2^22).
inline int gguf_nearest_int(float fval) {
  const float val = fval + 12582912.f;
  int i;
  std::memcpy(&i, &val, sizeof(int));
  return (i & 0x007fffff) - 0x00400000;
}

/// Q4_0 / Q5_0 (symmetric, nbits 4 or 5) and Q4_1 / Q5_1 (with a minimum): one block of 32.
inline void gguf_quantize_block32(std::uint32_t type, const float* x, std::byte* y) {
  const bool with_min = type == 3 || type == 7;
  const int nbits = type == 2 || type == 3 ? 4 : 5;
  const int top = (1 << nbits) - 1;
  std::uint8_t q[32];
  float d, m = 0;
  if (!with_min) {
    float amax = 0, max = 0;  // the element of largest magnitude, first of equals, with its sign
    for (int j = 0; j < 32; ++j)
      if (amax < std::fabs(x[j])) {
        amax = std::fabs(x[j]);
        max = x[j];
      }
    d = max / static_cast<float>(-(1 << (nbits - 1)));
    const float id = d != 0 ? 1.0f / d : 0.0f;
    const float off = static_cast<float>(1 << (nbits - 1)) + 0.5f;
    for (int j = 0; j < 32; ++j) q[j] = static_cast<std::uint8_t>(std::min(top, static_cast<int>(static_cast<std::int8_t>(x[j] * id + off))));
  } else {
    float mn = x[0], mx = x[0];
    for (int j = 1; j < 32; ++j) {
      mn = std::min(mn, x[j]);
      mx = std::max(mx, x[j]);
    }
    d = (mx - mn) / static_cast<float>(top);
    m = mn;
    const float id = d != 0 ? 1.0f / d : 0.0f;
    for (int j = 0; j < 32; ++j) q[j] = static_cast<std::uint8_t>(std::min(top, static_cast<int>(static_cast<std::int8_t>((x[j] - mn) * id + 0.5f))));
  }
  std::size_t at = 0;
  gguf_put_f16(y, d);
  at = 2;
  if (with_min) {
    gguf_put_f16(y + 2, m);
    at = 4;
  }
  if (nbits == 5) {  // bit 4 of element j is bit j of the little-endian u32 qh
    std::uint32_t qh = 0;
    for (int j = 0; j < 32; ++j) qh |= static_cast<std::uint32_t>((q[j] >> 4) & 1u) << j;
    for (int b = 0; b < 4; ++b) y[at + b] = static_cast<std::byte>((qh >> (8 * b)) & 0xffu);
    at += 4;
  }
  for (int j = 0; j < 16; ++j) y[at + j] = static_cast<std::byte>((q[j] & 15u) | (q[j + 16] & 15u) << 4);
}

inline void gguf_quantize_q8_0(const float* x, std::byte* y) {
  float amax = 0;
  for (int j = 0; j < 32; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float d = amax / 127.0f;
  const float id = d != 0 ? 1.0f / d : 0.0f;
  gguf_put_f16(y, d);
  for (int j = 0; j < 32; ++j) y[2 + j] = static_cast<std::byte>(static_cast<std::int8_t>(std::round(x[j] * id)));
}

/// ggml's make_qkx2_quants: codes L in [0, nmax] and a scale and minimum for n weighted values,
/// the minimum searched over nstep + 1 trial scales (weighted least squares per trial).
inline float gguf_make_qkx2(int n, int nmax, const float* x, const float* w, std::uint8_t* L, float* the_min,
                            std::uint8_t* Laux, float rmin, float rdelta, int nstep) {
  float min = x[0], max = x[0], sum_w = w[0], sum_x = sum_w * x[0];
  for (int i = 1; i < n; ++i) {
    if (x[i] < min) min = x[i];
    if (x[i] > max) max = x[i];
    sum_w += w[i];
    sum_x += w[i] * x[i];
  }
  if (min > 0) min = 0;
  if (max == min) {
    for (int i = 0; i < n; ++i) L[i] = 0;
    *the_min = -min;
    return 0.f;
  }
  float iscale = static_cast<float>(nmax) / (max - min);
  float scale = 1 / iscale;
  float best_error = 0;
  for (int i = 0; i < n; ++i) {
    const int l = gguf_nearest_int(iscale * (x[i] - min));
    L[i] = static_cast<std::uint8_t>(std::max(0, std::min(nmax, l)));
    float diff = scale * L[i] + min - x[i];
    diff = diff * diff;
    best_error += w[i] * diff;
  }
  for (int is = 0; is <= nstep; ++is) {
    iscale = (rmin + rdelta * static_cast<float>(is) + static_cast<float>(nmax)) / (max - min);
    float sum_l = 0, sum_l2 = 0, sum_xl = 0;
    for (int i = 0; i < n; ++i) {
      int l = gguf_nearest_int(iscale * (x[i] - min));
      l = std::max(0, std::min(nmax, l));
      Laux[i] = static_cast<std::uint8_t>(l);
      sum_l += w[i] * static_cast<float>(l);
      sum_l2 += w[i] * static_cast<float>(l) * static_cast<float>(l);
      sum_xl += w[i] * static_cast<float>(l) * x[i];
    }
    const float D = sum_w * sum_l2 - sum_l * sum_l;
    if (D > 0) {
      float this_scale = (sum_w * sum_xl - sum_x * sum_l) / D;
      float this_min = (sum_l2 * sum_x - sum_l * sum_xl) / D;
      if (this_min > 0) {
        this_min = 0;
        this_scale = sum_xl / sum_l2;
      }
      float cur_error = 0;
      for (int i = 0; i < n; ++i) {
        float diff = this_scale * Laux[i] + this_min - x[i];
        diff = diff * diff;
        cur_error += w[i] * diff;
      }
      if (cur_error < best_error) {
        for (int i = 0; i < n; ++i) L[i] = Laux[i];
        best_error = cur_error;
        scale = this_scale;
        min = this_min;
      }
    }
  }
  *the_min = -min;
  return scale;
}

/// Q4_K (nbits 4) and Q5_K (nbits 5): one super-block of 256 as quantize_row_q{4,5}_K_ref.
inline void gguf_quantize_qk(int nbits, const float* x, std::byte* y) {
  const int nmax = (1 << nbits) - 1;
  std::uint8_t L[256], Laux[32], sc6[12] = {};
  float w[32], mins[8], scales[8];
  float max_scale = 0, max_min = 0;
  for (int j = 0; j < 8; ++j) {
    float sum_x2 = 0;
    for (int l = 0; l < 32; ++l) sum_x2 += x[32 * j + l] * x[32 * j + l];
    const float av_x = std::sqrt(sum_x2 / 32);
    for (int l = 0; l < 32; ++l) w[l] = av_x + std::fabs(x[32 * j + l]);
    scales[j] = nbits == 4 ? gguf_make_qkx2(32, nmax, x + 32 * j, w, L + 32 * j, &mins[j], Laux, -1.f, 0.1f, 20)
                           : gguf_make_qkx2(32, nmax, x + 32 * j, w, L + 32 * j, &mins[j], Laux, -0.5f, 0.1f, 15);
    max_scale = std::max(max_scale, scales[j]);
    max_min = std::max(max_min, mins[j]);
  }
  const float inv_scale = max_scale > 0 ? 63.f / max_scale : 0.f;
  const float inv_min = max_min > 0 ? 63.f / max_min : 0.f;
  std::uint8_t ls[8], lm[8];
  for (int j = 0; j < 8; ++j) {
    ls[j] = std::min<std::uint8_t>(63, static_cast<std::uint8_t>(gguf_nearest_int(inv_scale * scales[j])));
    lm[j] = std::min<std::uint8_t>(63, static_cast<std::uint8_t>(gguf_nearest_int(inv_min * mins[j])));
    // The 12-byte packing gguf_decode_block's k_scale_min reads.
    if (j < 4) {
      sc6[j] = ls[j];
      sc6[j + 4] = lm[j];
    } else {
      sc6[j + 4] = static_cast<std::uint8_t>((ls[j] & 0xF) | ((lm[j] & 0xF) << 4));
      sc6[j - 4] |= static_cast<std::uint8_t>((ls[j] >> 4) << 6);
      sc6[j] |= static_cast<std::uint8_t>((lm[j] >> 4) << 6);
    }
  }
  const float d = gguf_f16_round(max_scale / 63.f), dmin = gguf_f16_round(max_min / 63.f);
  for (int j = 0; j < 8; ++j) {
    const float dj = d * ls[j];
    if (!(dj != 0)) continue;  // ggml's `if (!d) continue`: the codes of make_qkx2 stay
    const float dm = dmin * lm[j];
    for (int ii = 0; ii < 32; ++ii)
      L[32 * j + ii] = static_cast<std::uint8_t>(std::max(0, std::min(nmax, gguf_nearest_int((x[32 * j + ii] + dm) / dj))));
  }
  gguf_put_f16(y, max_scale / 63.f);
  gguf_put_f16(y + 2, max_min / 63.f);
  for (int i = 0; i < 12; ++i) y[4 + i] = static_cast<std::byte>(sc6[i]);
  std::byte* qs = y + (nbits == 4 ? 16 : 48);
  if (nbits == 5) std::memset(y + 16, 0, 32);
  // Group pairs (2k, 2k + 1) share 32 bytes: low nibble, high nibble; Q5_K's bit 4 of group g in
  // bit g of qh[e % 32].
  for (int n = 0; n < 256; n += 64)
    for (int j = 0; j < 32; ++j) {
      int l1 = L[n + j], l2 = L[n + j + 32];
      if (nbits == 5) {
        auto* qh = reinterpret_cast<std::uint8_t*>(y + 16);
        if (l1 > 15) {
          l1 -= 16;
          qh[j] = static_cast<std::uint8_t>(qh[j] | (1u << (n / 32)));
        }
        if (l2 > 15) {
          l2 -= 16;
          qh[j] = static_cast<std::uint8_t>(qh[j] | (2u << (n / 32)));
        }
      }
      qs[n / 2 + j] = static_cast<std::byte>(l1 | (l2 << 4));
    }
}

/// ggml's make_qx_quants with rmse_type 1 (weights x²) and no importance: codes L + nmax.
inline float gguf_make_qx(int n, int nmax, const float* x, std::int8_t* L) {
  float max = 0, amax = 0;
  for (int i = 0; i < n; ++i) {
    const float ax = std::fabs(x[i]);
    if (ax > amax) {
      amax = ax;
      max = x[i];
    }
  }
  if (amax < 1e-15f) {  // GROUP_MAX_EPS: all zero
    for (int i = 0; i < n; ++i) L[i] = 0;
    return 0.f;
  }
  float iscale = static_cast<float>(-nmax) / max;
  float sumlx = 0, suml2 = 0;
  for (int i = 0; i < n; ++i) {
    int l = gguf_nearest_int(iscale * x[i]);
    l = std::max(-nmax, std::min(nmax - 1, l));
    L[i] = static_cast<std::int8_t>(l + nmax);
    const float w = x[i] * x[i];
    sumlx += w * x[i] * static_cast<float>(l);
    suml2 += w * static_cast<float>(l) * static_cast<float>(l);
  }
  float scale = suml2 != 0 ? sumlx / suml2 : 0.0f;
  float best = scale * sumlx;
  for (int is = -9; is <= 9; ++is) {
    if (is == 0) continue;
    iscale = -(static_cast<float>(nmax) + 0.1f * static_cast<float>(is)) / max;
    sumlx = suml2 = 0;
    for (int i = 0; i < n; ++i) {
      int l = gguf_nearest_int(iscale * x[i]);
      l = std::max(-nmax, std::min(nmax - 1, l));
      const float w = x[i] * x[i];
      sumlx += w * x[i] * static_cast<float>(l);
      suml2 += w * static_cast<float>(l) * static_cast<float>(l);
    }
    if (suml2 > 0 && sumlx * sumlx > best * suml2) {
      for (int i = 0; i < n; ++i) {
        const int l = gguf_nearest_int(iscale * x[i]);
        L[i] = static_cast<std::int8_t>(nmax + std::max(-nmax, std::min(nmax - 1, l)));
      }
      scale = sumlx / suml2;
      best = scale * sumlx;
    }
  }
  return scale;
}

/// Q6_K: one super-block of 256 as quantize_row_q6_K_ref.
inline void gguf_quantize_q6_k(const float* x, std::byte* y) {
  std::int8_t L[256];
  float scales[16];
  float max_scale = 0, max_abs_scale = 0;
  for (int ib = 0; ib < 16; ++ib) {
    scales[ib] = gguf_make_qx(16, 32, x + 16 * ib, L + 16 * ib);
    const float abs_scale = std::fabs(scales[ib]);
    if (abs_scale > max_abs_scale) {
      max_abs_scale = abs_scale;
      max_scale = scales[ib];
    }
  }
  std::memset(y, 0, 210);
  if (max_abs_scale < 1e-15f) return;  // an all-zero block: zero bytes, d = +0
  const float iscale = -128.f / max_scale;
  gguf_put_f16(y + 208, 1 / iscale);
  const float d = gguf_f16_round(1 / iscale);
  std::int8_t sc[16];
  for (int ib = 0; ib < 16; ++ib) {
    sc[ib] = static_cast<std::int8_t>(std::min(127, gguf_nearest_int(iscale * scales[ib])));
    y[192 + ib] = static_cast<std::byte>(sc[ib]);
  }
  for (int j = 0; j < 16; ++j) {
    const float dj = d * sc[j];
    if (!(dj != 0)) continue;
    for (int ii = 0; ii < 16; ++ii) {
      const int l = std::max(-32, std::min(31, gguf_nearest_int(x[16 * j + ii] / dj)));
      L[16 * j + ii] = static_cast<std::int8_t>(l + 32);
    }
  }
  // Element e = 128h + r: low nibble in ql[64h + r % 64] (nibble r / 64), top two bits in
  // qh[32h + r % 32] (bits 2 (r / 32)) -- the layout gguf_decode_block reads.
  auto* ql = reinterpret_cast<std::uint8_t*>(y);
  auto* qh = reinterpret_cast<std::uint8_t*>(y + 128);
  for (int e = 0; e < 256; ++e) {
    const int h = e / 128, r = e % 128;
    const auto q = static_cast<std::uint8_t>(L[e]);
    ql[64 * h + r % 64] = static_cast<std::uint8_t>(ql[64 * h + r % 64] | (q & 15u) << (4 * (r / 64)));
    qh[32 * h + r % 32] = static_cast<std::uint8_t>(qh[32 * h + r % 32] | (q >> 4) << (2 * (r / 32)));
  }
}

/// n values of one row into `type` (n a multiple of the type's block).
inline void gguf_quantize_row(std::uint32_t type, const float* x, std::int64_t n, std::byte* y) {
  const auto N = static_cast<std::size_t>(n);
  switch (type) {
    case 0:
      for (std::size_t i = 0; i < N; ++i) {
        std::uint32_t u = std::bit_cast<std::uint32_t>(x[i]);
        if constexpr (std::endian::native == std::endian::big) u = gguf_bswap(u);
        std::memcpy(y + 4 * i, &u, 4);
      }
      return;
    case 1: for (std::size_t i = 0; i < N; ++i) gguf_put_u16(y + 2 * i, half::f32_to_f16(x[i])); return;
    case 30: for (std::size_t i = 0; i < N; ++i) gguf_put_u16(y + 2 * i, half::f32_to_bf16(x[i])); return;
    case 8: for (std::size_t b = 0; b < N / 32; ++b) gguf_quantize_q8_0(x + 32 * b, y + 34 * b); return;
    case 2: case 3: case 6: case 7: {
      const std::uint32_t bytes = ggml_type_info(type)->bytes;
      for (std::size_t b = 0; b < N / 32; ++b) gguf_quantize_block32(type, x + 32 * b, y + bytes * b);
      return;
    }
    case 12: for (std::size_t b = 0; b < N / 256; ++b) gguf_quantize_qk(4, x + 256 * b, y + 144 * b); return;
    case 13: for (std::size_t b = 0; b < N / 256; ++b) gguf_quantize_qk(5, x + 256 * b, y + 176 * b); return;
    case 14: for (std::size_t b = 0; b < N / 256; ++b) gguf_quantize_q6_k(x + 256 * b, y + 210 * b); return;
    default: nn::detail::fail("gguf_quantize", "type ", type, " is not written");
  }
}

}  // namespace detail

/// A float32 (or float64, narrowed) tensor of row-major shape (..., n) as ggml type `type`'s
/// bytes, row by row. `name` leads errors: a type nn does not write, or rows of n that do not
/// split into the type's blocks.
inline std::vector<std::byte> gguf_quantize(const Tensor& t, std::uint32_t type, const std::string& name = "tensor") {
  const GgmlTypeInfo* info = ggml_type_info(type);
  if (!info || !gguf_can_quantize(type))
    nn::detail::fail("gguf_quantize", "tensor \"", name, "\": ggml type ", info ? info->name : std::to_string(type).c_str(),
                     " is not written (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K are)");
  if (t.rank() == 0) nn::detail::fail("gguf_quantize", "tensor \"", name, "\" is a scalar");
  const std::int64_t n = t.dim(t.rank() - 1);
  if (n % info->block != 0)
    nn::detail::fail("gguf_quantize", "tensor \"", name, "\" ", t.shape().str(), ": rows of ", n,
                     " do not split into ", info->name, " blocks of ", info->block);
  const Tensor f = t.dtype() == DType::f32 ? t : t.to(DType::f32);
  const std::int64_t rows = n ? f.numel() / n : 0;
  const std::size_t row_bytes = static_cast<std::size_t>(n / info->block) * info->bytes;
  std::vector<std::byte> out(static_cast<std::size_t>(rows) * row_bytes);
  const float* src = f.data<float>();
  for (std::int64_t r = 0; r < rows; ++r) detail::gguf_quantize_row(type, src + r * n, n, out.data() + r * row_bytes);
  return out;
}

}  // namespace nn::lm
// ---- end nn/lm/gguf_quantize.hpp ----
// ---- begin nn/lm/gguf_export.hpp ----
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
// source GGUF key for key, or built from a Hugging Face folder as convert_hf_to_gguf.py builds it
// (config.json's hyperparameters; tokenizer.json's vocabulary, merges and added tokens, its
// pre-tokenizer named as llama.cpp names it; tokenizer_config.json's special tokens and chat
// template); general.file_type and general.quantization_version are set anew.
//
// save_gguf_adapter writes llama.cpp's adapter file, the layout convert_lora_to_gguf.py writes
// from a PEFT adapter: general.type = "adapter", adapter.type = "lora", adapter.lora.alpha, and
// per adapted matrix W (out, in) of llama.cpp name N: N.lora_a (r, in) and N.lora_b (out, r)
// (PEFT's lora_A / lora_B; ggml ne reversed), q/k's lora_b rows permuted as W's. llama.cpp
// applies W + (alpha / r) · lora_b · lora_a, so alpha = effective scale · r.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>


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

/// The metadata of a GGUF written from a model loaded from `source`: every key but
/// general.file_type, general.quantization_version and general.alignment, type for type.
inline GgufWriter gguf_metadata(const GgufFile& source) {
  GgufWriter w;
  for (const auto& [key, v] : source.metadata())
    if (key != "general.file_type" && key != "general.quantization_version" && key != "general.alignment") w.copy(key, v);
  return w;
}

namespace detail {

inline nlohmann::json gguf_read_json(const std::filesystem::path& p) { return read_json_file(p, "gguf"); }

/// llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre-tokenizer, as
/// convert_hf_to_gguf.py identifies it: GPT-2's byte-level regex alone ("gpt-2"), digits split
/// one by one before it (SmolLM's, "smollm"), or Llama 3's / Qwen2's split regex ("llama-bpe",
/// "qwen2"). Anything else raises naming it.
inline std::string gguf_pre_name(const nlohmann::json& pre, const std::string& where) {
  static const std::string llama3 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::string qwen2 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  auto type = [](const nlohmann::json& j) { return j.is_object() ? j.value("type", std::string()) : std::string(); };
  auto byte_level = [&](const nlohmann::json& j, bool regex) { return type(j) == "ByteLevel" && j.value("use_regex", true) == regex; };
  if (byte_level(pre, true)) return "gpt-2";
  if (type(pre) == "Sequence" && pre.contains("pretokenizers") && pre["pretokenizers"].size() == 2) {
    const nlohmann::json &a = pre["pretokenizers"][0], &b = pre["pretokenizers"][1];
    if (type(a) == "Digits" && a.value("individual_digits", false) && byte_level(b, true)) return "smollm";
    if (type(a) == "Split" && a.contains("pattern") && a["pattern"].contains("Regex") && byte_level(b, false)) {
      const std::string r = a["pattern"]["Regex"].get<std::string>();
      if (r == llama3) return "llama-bpe";
      if (r == qwen2) return "qwen2";
    }
  }
  nn::detail::fail("gguf", where, ": the pre-tokenizer ", pre.dump().substr(0, 200),
                   " has no llama.cpp name nn knows (GPT-2's, SmolLM's, Llama 3's and Qwen2's have)");
}

}  // namespace detail

/// The metadata of a GGUF written from a model loaded from the Hugging Face folder `folder` (its
/// config `c`), as convert_hf_to_gguf.py writes it: <arch>.* hyperparameters and the tokenizer --
/// tokens by id (padded to the model's vocabulary with [PAD<i>], type unused), token types
/// (special added tokens control, other added tokens user-defined), BOS / EOS / padding ids,
/// whether BOS is added, and tokenizer_config.json's chat template. A byte-level BPE becomes a
/// "gpt2" tokenizer (merges, the pre-tokenizer's llama.cpp name); a SentencePiece-style one
/// (Llama 2, Mistral, TinyLlama) a "llama" tokenizer: byte tokens typed byte, <unk> unknown,
/// add_space_prefix, and scores that make llama.cpp's rule (join the pair whose joined text scores
/// highest) follow the merges: a token scores minus the rank of the first merge that makes it.
/// (llama.cpp also joins a pair whose text is a token no merge makes; a tokenizer.json converted
/// from SentencePiece lists a merge for every such pair.)
inline GgufWriter gguf_metadata_hf(const std::filesystem::path& folder, const ModelConfig& c) {
  const std::string where = (folder / "tokenizer.json").string();
  const nlohmann::json tj = detail::gguf_read_json(folder / "tokenizer.json");
  const Tokenizer tok = Tokenizer::from_file(where);
  const std::string a = gguf_arch_name(c.arch);
  if (!c.rope_freq_factors.empty() || (c.rope_scaling.type != "default" && !c.rope_scaling.type.empty() && c.rope_scaling.type != "linear"))
    nn::detail::fail("gguf", folder.string(), ": rope_scaling '", c.rope_scaling.type, "' is not written (default, linear are)");
  GgufWriter w;
  w.set("general.architecture", a);
  w.set("general.type", "model");
  w.set("general.name", folder.filename().string().empty() ? folder.parent_path().filename().string() : folder.filename().string());
  w.set(a + ".vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  w.set(a + ".context_length", static_cast<std::uint32_t>(c.max_position_embeddings));
  w.set(a + ".embedding_length", static_cast<std::uint32_t>(c.hidden_size));
  w.set(a + ".block_count", static_cast<std::uint32_t>(c.num_hidden_layers));
  w.set(a + ".feed_forward_length", static_cast<std::uint32_t>(c.intermediate_size));
  w.set(a + ".attention.head_count", static_cast<std::uint32_t>(c.num_attention_heads));
  w.set(a + ".attention.head_count_kv", static_cast<std::uint32_t>(c.num_key_value_heads));
  w.set(a + ".rope.freq_base", static_cast<float>(c.rope_theta));
  w.set(a + ".attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  w.set(a + ".rope.dimension_count", static_cast<std::uint32_t>(c.head_dim));
  if (c.head_dim * c.num_attention_heads != c.hidden_size) {
    w.set(a + ".attention.key_length", static_cast<std::uint32_t>(c.head_dim));
    w.set(a + ".attention.value_length", static_cast<std::uint32_t>(c.head_dim));
  }
  // Phi-3 only: Mistral goes out as "llama", and llama.cpp's qwen2 / qwen3 graphs have no window
  // either (convert_hf_to_gguf.py writes none for them)
  if (c.sliding_window > 0 && c.arch == Arch::phi3)
    w.set(a + ".attention.sliding_window", static_cast<std::uint32_t>(c.sliding_window));
  if (c.rope_scaling.type == "linear") {
    w.set(a + ".rope.scaling.type", "linear");
    w.set(a + ".rope.scaling.factor", static_cast<float>(c.rope_scaling.factor));
  }
  // The vocabulary by id: model tokens in their byte-level form, added tokens as written.
  const auto n = static_cast<std::int32_t>(std::max<std::int64_t>(c.vocab_size, static_cast<std::int64_t>(tok.vocab_size())));
  std::vector<std::string> tokens(static_cast<std::size_t>(n));
  std::vector<std::int32_t> types(static_cast<std::size_t>(n), 1);
  for (std::int32_t i = 0; i < n; ++i) {
    std::string t;
    if (static_cast<std::size_t>(i) < tok.vocab_size()) try {
        t = tok.id_to_token(i);
      } catch (const nn::Error&) {  // an id the vocabulary skips
      }
    if (t.empty()) {
      t = "[PAD" + std::to_string(i) + "]";
      types[static_cast<std::size_t>(i)] = 5;
    }
    tokens[static_cast<std::size_t>(i)] = std::move(t);
  }
  for (const AddedToken& t : tok.added_tokens())
    if (t.id >= 0 && t.id < n) types[static_cast<std::size_t>(t.id)] = t.special ? 3 : 4;
  std::vector<std::pair<std::string, std::string>> merges;
  if (tj.contains("model") && tj["model"].contains("merges"))
    for (const auto& m : tj["model"]["merges"]) {
      if (!m.is_string()) {
        merges.emplace_back(m.at(0).get<std::string>(), m.at(1).get<std::string>());
        continue;
      }
      const std::string s = m.get<std::string>();
      const auto sp = s.find(' ', 1);
      merges.emplace_back(s.substr(0, sp), sp == std::string::npos ? std::string() : s.substr(sp + 1));
    }
  if (tok.sentencepiece()) {
    std::vector<float> scores(static_cast<std::size_t>(n), -1e9f);  // made by no merge: joined last, if ever
    std::vector<bool> scored(static_cast<std::size_t>(n), false);
    for (std::size_t r = 0; r < merges.size(); ++r)
      if (auto id = tok.token_to_id(merges[r].first + merges[r].second); id && *id < n && !scored[static_cast<std::size_t>(*id)]) {
        scores[static_cast<std::size_t>(*id)] = -static_cast<float>(r + 1);
        scored[static_cast<std::size_t>(*id)] = true;
      }
    for (std::int32_t i = 0; i < n; ++i)
      if (types[static_cast<std::size_t>(i)] == 1 && detail::spm_byte_token(tokens[static_cast<std::size_t>(i)]) >= 0)
        types[static_cast<std::size_t>(i)] = 6;
    if (tok.unk_id() && *tok.unk_id() < n) types[static_cast<std::size_t>(*tok.unk_id())] = 2;
    w.set("tokenizer.ggml.model", "llama");
    w.set_array("tokenizer.ggml.tokens", tokens);
    w.set_array("tokenizer.ggml.scores", scores);
    w.set_array("tokenizer.ggml.token_type", types);
    w.set("tokenizer.ggml.add_space_prefix", tok.space_prefix());
    if (tok.unk_id()) w.set("tokenizer.ggml.unknown_token_id", static_cast<std::uint32_t>(*tok.unk_id()));
  } else {
    std::vector<std::string> joined;
    for (const auto& [a, b] : merges) joined.push_back(a + " " + b);
    w.set("tokenizer.ggml.model", "gpt2");
    w.set("tokenizer.ggml.pre", detail::gguf_pre_name(tj.value("pre_tokenizer", nlohmann::json()), where));
    w.set_array("tokenizer.ggml.tokens", tokens);
    w.set_array("tokenizer.ggml.token_type", types);
    w.set_array("tokenizer.ggml.merges", joined);
  }
  if (tok.bos_id()) w.set("tokenizer.ggml.bos_token_id", static_cast<std::uint32_t>(*tok.bos_id()));
  if (tok.eos_id()) w.set("tokenizer.ggml.eos_token_id", static_cast<std::uint32_t>(*tok.eos_id()));
  if (tok.pad_id()) w.set("tokenizer.ggml.padding_token_id", static_cast<std::uint32_t>(*tok.pad_id()));
  w.set("tokenizer.ggml.add_bos_token", !tok.prefix_ids().empty());
  if (std::filesystem::exists(folder / "tokenizer_config.json")) {
    const nlohmann::json tc = detail::gguf_read_json(folder / "tokenizer_config.json");
    if (tc.contains("chat_template") && tc["chat_template"].is_string())
      w.set("tokenizer.chat_template", tc["chat_template"].get<std::string>());
  }
  return w;
}

/// Writes `model` (float weights: no LoRA, no quantized layers left) to `path` as a GGUF file in
/// `outtype` (gguf_outtypes()) with the metadata `meta` (gguf_metadata / gguf_metadata_hf).
/// `source` is the GGUF the model came from, if it did: "same" reads each tensor's type there
/// (from a Hugging Face folder, "same" is `same_type`, its torch_dtype), and a rope_freqs tensor is
/// carried over. Raises, leaving no file, for an architecture llama.cpp cannot name, a tensor with
/// no llama.cpp name, a LoRA or quantized layer still in the model, an outtype "same" type nn does
/// not write, and any write error.
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model, GgufWriter w,
                                  const std::string& outtype, const GgufFile* source, std::uint32_t same_type = 0) {
  const ModelConfig& c = model.config();
  const std::string arch = gguf_arch_name(c.arch);  // llama.cpp's names for the families (Mistral: llama)
  if (c.arch == Arch::gemma2 || c.arch == Arch::gemma3)
    nn::detail::fail("gguf", path.string(), ": writing Gemma ", c.arch == Arch::gemma2 ? 2 : 3,
                     " as GGUF is not supported (save_hf writes the folder, which llama.cpp's convert_hf_to_gguf.py converts)");
  if (source)
    if (const GgufValue* a = source->find("general.architecture"); a && a->is_string() && a->as_string() != arch)
      nn::detail::fail("gguf", path.string(), ": the source ", source->path(), " is a '", a->as_string(),
                       "' model, this one '", arch, "'");
  bool known = false;
  for (const std::string& o : gguf_outtypes()) known |= o == outtype;
  if (!known) nn::detail::fail("gguf", path.string(), ": unknown --outtype '", outtype, "' (f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m same)");
  w.set("general.architecture", arch);

  GgufExportReport report;
  const int n_layers = static_cast<int>(c.num_hidden_layers);
  bool quantized = false;
  for (const auto& [hf, t0] : model.parameters()) {
    if (hf.ends_with(".lora_a") || hf.ends_with(".lora_b"))
      nn::detail::fail("gguf", path.string(), ": the model still has LoRA layers (", hf, "): fuse them first");
    if (hf.ends_with(".scales") || hf.ends_with(".biases") || !is_floating(t0.dtype()))
      nn::detail::fail("gguf", path.string(), ": tensor \"", hf, "\" belongs to a quantized layer: dequantize the model first");
  }
  const NamedTensors params = detail::join_fused(c, model.parameters());  // Phi-3: attn_qkv, ffn_up
  for (const auto& [hf, t0] : params) {
    const std::string g = detail::hf_to_gguf_name(hf, path.string(), c.arch);
    Tensor t = t0.to(DType::f32);
    if (uses_llama_rope_layout(c.arch)) {  // llama.cpp runs Llama (and Mistral) with interleaved RoPE pairs
      if (g.find(".attn_q.") != std::string::npos) t = detail::permute_rows(t, c.num_attention_heads, g, true);
      if (g.find(".attn_k.") != std::string::npos) t = detail::permute_rows(t, c.num_key_value_heads, g, true);
    }
    int layer = -1;
    if (g.rfind("blk.", 0) == 0) layer = std::stoi(g.substr(4, g.find('.', 4) - 4));
    std::uint32_t type;
    if (outtype == "same" && !source) {
      type = t.rank() >= 2 ? same_type : 0;
    } else if (outtype == "same") {
      const GgufTensorInfo* src = source->find_tensor(g);
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
  if (const GgufTensorInfo* rf = source ? source->find_tensor("rope_freqs.weight") : nullptr) {
    const auto b = source->tensor_bytes(*rf);
    w.add_tensor(rf->name, rf->shape(), rf->type, std::vector<std::byte>(b.begin(), b.end()));
  }
  if (outtype == "same" && source) {
    if (const GgufValue* ft = source->find("general.file_type")) w.copy("general.file_type", *ft);
  } else if (outtype == "same") {
    w.set("general.file_type", std::uint32_t{same_type == 1 ? 1u : same_type == 30 ? 32u : 0u});
  } else {
    w.set("general.file_type", detail::gguf_file_type(outtype));
  }
  if (quantized) w.set("general.quantization_version", std::uint32_t{2});
  w.write(path);
  return report;
}

/// `model`, loaded from the GGUF `source`, with its metadata (see the overload above).
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model, const GgufFile& source,
                                  const std::string& outtype = "f16") {
  return save_gguf(path, model, gguf_metadata(source), outtype, &source);
}

/// `model`, loaded from the Hugging Face folder `folder`, with metadata from its config and
/// tokenizer files (gguf_metadata_hf); "same" is the checkpoint's torch_dtype (F32, F16, BF16).
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model,
                                  const std::filesystem::path& folder, const std::string& outtype = "f16") {
  std::uint32_t same = 0;
  if (outtype == "same") {
    const nlohmann::json cfg = detail::gguf_read_json(folder / "config.json");
    const std::string dt = cfg.value("torch_dtype", cfg.value("dtype", std::string("float32")));
    same = dt == "bfloat16" ? 30u : dt == "float16" ? 1u : 0u;
  }
  return save_gguf(path, model, gguf_metadata_hf(folder, model.config()), outtype, nullptr, same);
}

/// Writes the LoRA layers of `model` (trained with `cfg`) as a llama.cpp GGUF LoRA adapter for a
/// base of architecture `arch` ("llama" / "qwen2" / "qwen3"; the base's general.architecture; not phi3). Factors in
/// F32. Raises, leaving no file, when the model has no LoRA layers or one has no llama.cpp name.
template <class M>
void save_gguf_adapter(const std::filesystem::path& path, const M& model, const LoraConfig& cfg, const ModelConfig& c) {
  if (c.arch == Arch::gemma2 || c.arch == Arch::gemma3)
    nn::detail::fail("gguf", path.string(), ": llama.cpp adapters for Gemma ", c.arch == Arch::gemma2 ? 2 : 3,
                     " are not written (use the mlx-lm or PEFT adapter, or fuse)");
  if (!detail::fused_projections(c).empty())
    nn::detail::fail("gguf", path.string(), ": llama.cpp's ", arch_name(c.arch), " graph has one attn_qkv and one ffn_up "
                     "matrix, and nn trains their parts as separate LoRA layers, which a llama.cpp adapter cannot name: "
                     "export the fused model instead (--fuse OUT.gguf)");
  GgufWriter w;
  w.set("general.architecture", gguf_arch_name(c.arch));
  w.set("general.type", "adapter");
  w.set("adapter.type", "lora");
  const double eff = cfg.rslora ? cfg.scale / std::sqrt(static_cast<double>(cfg.rank)) : cfg.scale;
  w.set("adapter.lora.alpha", static_cast<float>(eff * static_cast<double>(cfg.rank)));
  GTape<cpu> tp;
  int n = 0;
  for (auto& [p, v] : model.trainable_parameters()) {
    if (p.ends_with(".m"))  // a DoRA layer: llama.cpp's adapters add b·a to W, nothing rescales rows
      nn::detail::fail("gguf", path.string(), ": '", p, "' is a DoRA magnitude; llama.cpp's LoRA adapters cannot "
                       "express DoRA: fuse the model (DoraLinear::fused) and export that instead");
    const bool a = p.ends_with(".lora_a"), b = p.ends_with(".lora_b");
    if (!a && !b) continue;
    const std::string g = detail::hf_to_gguf_name(p.substr(0, p.size() - 7) + ".weight", path.string());
    // mlx-lm's factors (in, r) and (r, out), transposed to PEFT's (r, in) and (out, r).
    Tensor t = tp.value(transpose(tp, tp.constant(v))).to(DType::f32);
    if (b && uses_llama_rope_layout(c.arch)) {
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
// ---- end nn/lm/gguf_export.hpp ----
// ---- end nn/lm.hpp ----
