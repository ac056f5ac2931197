// SPDX-License-Identifier: MIT OR Apache-2.0
// Loading a CausalLM: from a Hugging Face folder (config.json + model.safetensors, or a sharded
// model.safetensors.index.json) and from a GGUF file (llama.cpp's names, dequantised, Q/K rows
// un-permuted), strictly: every missing, unknown and mismatched name is reported at once.
#pragma once

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

#include "../io/safetensors.hpp"
#include "../io/weights.hpp"
#include "adapters.hpp"
#include "config.hpp"
#include "gguf.hpp"
#include "model.hpp"

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
