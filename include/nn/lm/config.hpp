// SPDX-License-Identifier: MIT OR Apache-2.0
// ModelConfig: the hyperparameters of a Llama / Qwen2 / Qwen3 / Phi-3 / Gemma 2 / Gemma 3 / Mistral /
// SmolLM decoder, parsed from a Hugging Face config.json (transformers' LlamaConfig, Qwen2Config,
// Qwen3Config, Phi3Config, Gemma2Config, Gemma3TextConfig, MistralConfig) with errors that name the
// file and field.
#pragma once

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

#include "../config.hpp"
#include "json.hpp"

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
