// SPDX-License-Identifier: MIT OR Apache-2.0
// LoRA and DoRA adapters for decoder models named as Hugging Face names them
// (model.layers.N.<key>): applying them by path, and reading/writing mlx-lm and PEFT adapter
// directories.
#pragma once

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <set>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include "../backend/cpu.hpp"  // the GTape<cpu> the writers record on
#include "../io/safetensors.hpp"
#include "../io/weights.hpp"
#include "../modules/dora.hpp"
#include "json.hpp"

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
