// SPDX-License-Identifier: MIT OR Apache-2.0
// Whole-run checkpoints: what training changes (trainable parameters, the optimizer's state, the
// global RNG key) and what the run was (the optimizer's type, hyperparameters and schedule, the
// frozen set with a fingerprint of the frozen tensors) in one safetensors file, saved atomically
// and loaded all-or-nothing.
#pragma once

#include <cstring>
#include <map>
#include <sstream>

#include "../optim/optimizer.hpp"
#include "../random.hpp"
#include "weights.hpp"

namespace nn {

/// What load_into may accept beyond an exact match.
struct LoadOptions {
  /// Resume with other hyperparameters than the checkpoint's (betas, weight decay, momentum, the
  /// schedule or the constant learning rate): the given optimizer's values are kept, the file's
  /// state (step, slots) is loaded. The optimizer's type must still match: its state would not.
  bool allow_new_hyperparameters = false;
};

namespace detail {

/// A content hash of a tensor's bytes (four 64-bit multiply-xor lanes, then FNV over the tail):
/// fast enough to fingerprint a frozen base of hundreds of MB on every save and load.
inline std::uint64_t content_hash(const Tensor& t0) {
  const Tensor t = t0.device() == Device::cpu ? t0 : t0.to(Device::cpu);
  const auto* p = static_cast<const unsigned char*>(t.raw());
  const std::size_t n = t.nbytes();
  std::uint64_t lane[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * 0x100000001B3ull;
      lane[k] ^= lane[k] >> 29;
    }
  Fnv f;
  f.pod(lane);
  f.bytes(p + i, n - i);
  f.pod(n);
  return f.h;
}

/// "float32 (576, 49152) 0123456789abcdef": a frozen tensor as the checkpoint's metadata records it.
inline std::string fingerprint(const Tensor& t) {
  char hex[24];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(content_hash(t)));
  return std::string(dtype_name(t.dtype())) + " " + t.shape().str() + " " + hex;
}

/// The frozen part of a model: every frozen Param and every Buffer, by path, with its fingerprint.
template <class M>
std::map<std::string, std::string> frozen_fingerprints(const M& model) {
  std::map<std::string, std::string> out;
  for_each(
      model, [&](const std::string& p, const Param& x) { if (!x.trainable && x.value.defined()) out[p] = fingerprint(x.value); },
      [&](const std::string& p, const Buffer& x) { if (x.value.defined()) out[p] = fingerprint(x.value); });
  return out;
}

inline constexpr const char* kOptimizerKey = "optimizer.";  // metadata: the optimizer's configuration
inline constexpr const char* kFrozenKey = "frozen.";        // metadata: one entry per frozen tensor

/// The version-1 load (whole model in the file, nothing but tensors checked), kept so older
/// checkpoints still resume.
template <class M>
void load_checkpoint_v1(const std::string& source, const NamedTensorList& model_part, const NamedTensorList& opt_part,
                        const Tensor& key, M& model, Optimizer& opt) {
  auto plan = plan_load(model, model_part, true, source, "model.");
  try {
    opt.check_state(opt_part);
  } catch (const Error& e) {  // the optimizer's error names the entry; the file is named here
    fail("load_into", source, ": optimizer state: ", e.what(), " (nothing was loaded)");
  }
  apply_load(plan);
  opt.load_state(opt_part);
  random::set_state(key);
}

}  // namespace detail

/// Saves a run to `path` (written to a temporary file, then renamed):
/// - tensors: the trainable parameters ("model.<path>"), the optimizer's state
///   ("optimizer.step", "optimizer.slots.<path>.m", ...) and the global random key ("rng.key");
/// - metadata: the optimizer's type, hyperparameters and schedule ("optimizer.type",
///   "optimizer.b1", "optimizer.schedule", ...) and, for each frozen parameter and buffer, its
///   dtype, shape and a content hash ("frozen.<path>"), which load_into verifies.
/// A LoRA run's checkpoint is adapter-sized: the frozen base is fingerprinted, not stored.
/// Resuming with load_into and training on is bitwise the run without the pause.
template <class M>
void save(const std::filesystem::path& path, const M& model, const Optimizer& opt) {
  NamedTensors all;
  for (auto& [p, t] : detail::tree_parameters(model, true)) all.emplace_back("model." + p, t);
  for (auto& [p, t] : opt.state()) all.emplace_back("optimizer." + p, t);
  all.emplace_back("rng.key", random::state());
  std::map<std::string, std::string> meta{{"format", "nn-checkpoint"}, {"nn_checkpoint", "2"}, {"nn_version", NN_VERSION_STRING}};
  for (auto& [k, v] : opt.describe()) meta[detail::kOptimizerKey + k] = v;
  for (auto& [p, fp] : detail::frozen_fingerprints(model)) meta[detail::kFrozenKey + p] = fp;
  save_safetensors(path, all, meta);
}

/// Loads a checkpoint written by save() into `model` and `opt` and restores the random key.
/// Everything is checked before anything changes, and every difference is reported in one
/// nn::Error: the optimizer's type, each hyperparameter and the schedule (unless
/// options.allow_new_hyperparameters), the frozen set and each frozen tensor's dtype, shape and
/// content, each trainable parameter's name, shape and dtype, and the optimizer's state (also
/// against a fresh optimizer: every slot must belong to a trainable parameter of its shape). On
/// any error the model, the optimizer and the random key are as they were.
/// The overload on an open SafetensorsFile (SafetensorsFile::from_bytes for a checkpoint held in
/// memory) checks and loads the same way; errors name file.path().
template <class M>
void load_into(const SafetensorsFile& file, M& model, Optimizer& opt, const LoadOptions& options = {}) {
  const std::string& src = file.path();
  const auto& meta = file.metadata();
  auto fmt = meta.find("format");
  if (fmt == meta.end() || fmt->second != "nn-checkpoint")
    detail::fail("load_into", src, ": not an nn checkpoint (metadata format is '",
                 fmt == meta.end() ? std::string("missing") : fmt->second, "')");
  detail::NamedTensorList model_part, opt_part;
  Tensor key;
  for (auto& [name, t] : file.tensors()) {
    if (name.rfind("model.", 0) == 0) model_part.emplace_back(name.substr(6), t);
    else if (name.rfind("optimizer.", 0) == 0) opt_part.emplace_back(name.substr(10), t);
    else if (name == "rng.key") key = t;
    else detail::fail("load_into", src, ": unknown entry '", name, "'");
  }
  if (!key.defined() || key.dtype() != DType::u32 || !(key.shape() == Shape{2}))
    detail::fail("load_into", src, ": missing or malformed 'rng.key' (uint32 (2))");
  auto version = meta.find("nn_checkpoint");
  if (version == meta.end()) return detail::load_checkpoint_v1(src, model_part, opt_part, key, model, opt);
  if (version->second != "2")
    detail::fail("load_into", src, ": checkpoint version ", version->second, " is newer than this nn reads (2)");

  std::vector<std::string> diffs;
  auto quote = [](const std::string& s) { return "'" + s + "'"; };

  // The optimizer: its type always, its hyperparameters and schedule unless allowed to differ.
  std::map<std::string, std::string> saved_cfg, given_cfg;
  for (const auto& [k, v] : meta)
    if (k.rfind(detail::kOptimizerKey, 0) == 0) saved_cfg[k.substr(std::strlen(detail::kOptimizerKey))] = v;
  for (auto& [k, v] : opt.describe()) given_cfg[k] = v;
  auto checked = [&](const std::string& k) {  // a type ("type", "0.type") always is
    return !options.allow_new_hyperparameters || k == "type" || k.ends_with(".type");
  };
  for (const auto& [k, v] : saved_cfg) {
    if (!checked(k)) continue;
    auto g = given_cfg.find(k);
    if (g == given_cfg.end()) diffs.push_back("optimizer " + k + ": " + v + " in the file, not set on the given optimizer");
    else if (g->second != v) diffs.push_back("optimizer " + k + ": " + v + " in the file, " + g->second + " given");
  }
  for (const auto& [k, v] : given_cfg)
    if (checked(k) && !saved_cfg.count(k)) diffs.push_back("optimizer " + k + ": not in the file, " + v + " given");

  // The frozen set and its content.
  std::map<std::string, std::string> saved_frozen;
  for (const auto& [k, v] : meta)
    if (k.rfind(detail::kFrozenKey, 0) == 0) saved_frozen[k.substr(std::strlen(detail::kFrozenKey))] = v;
  const std::map<std::string, std::string> frozen = detail::frozen_fingerprints(model);
  for (const auto& [p, fp] : saved_frozen) {
    auto g = frozen.find(p);
    if (g == frozen.end()) diffs.push_back("frozen " + quote(p) + ": frozen in the file, trainable or absent here");
    else if (g->second != fp) diffs.push_back("frozen " + quote(p) + ": the file's is " + fp + ", the model's " + g->second);
  }
  for (const auto& [p, fp] : frozen)
    if (!saved_frozen.count(p)) diffs.push_back("frozen " + quote(p) + ": frozen here, not frozen in the file");

  // The trainable parameters: every one in the file with its shape and dtype, nothing else.
  detail::LoadPlan plan = detail::plan_weights(model, model_part, true, "model.", true);
  for (const std::string& p : plan.problems()) diffs.push_back("trainable parameters, " + p);
  std::map<std::string, const Tensor*> trainable;
  for (const detail::WeightSlot& s : detail::weight_slots(model, true)) trainable[s.path] = s.target;

  // The optimizer's state (when the types match: else the type is the difference): as the
  // optimizer checks it, and every slot against its parameter, so a fresh optimizer (no slots
  // yet) is checked too. MultiOptimizer's entries are "<k>.slots....".
  if (saved_cfg["type"] == given_cfg["type"]) {
    try {
      opt.check_state(opt_part);
    } catch (const Error& e) {
      diffs.push_back(std::string("optimizer state: ") + e.what());
    }
    for (const auto& [name, t] : opt_part) {
      const std::size_t at = name.rfind("slots.", 0) == 0 ? 0 : name.find(".slots.");
      if (at == std::string::npos) continue;
      const std::size_t begin = name.find("slots.", at) + 6, end = name.rfind('.');
      if (end <= begin) continue;
      const std::string p = name.substr(begin, end - begin);
      auto it = trainable.find(p);
      if (it == trainable.end()) {
        diffs.push_back("optimizer " + quote(name) + ": a slot of no trainable parameter here");
        continue;
      }
      if (!t.defined() || !it->second->defined()) continue;
      const Tensor& param = *it->second;
      const Shape want = opt.slot_shape(p, std::string_view(name).substr(end + 1), param);
      if (!(t.shape() == want))
        diffs.push_back("optimizer " + quote(name) + ": " + t.shape().str() + " in the file, the parameter is " +
                        param.shape().str() + (want == param.shape() ? "" : " (the slot should be " + want.str() + ")"));
    }
  }

  if (!diffs.empty()) {
    std::ostringstream os;
    os << src << ": the checkpoint does not fit this run (nothing was loaded); " << diffs.size() << " difference"
       << (diffs.size() == 1 ? "" : "s") << ":";
    for (const std::string& d : diffs) os << "\n  " << d;
    if (!options.allow_new_hyperparameters)
      os << "\n(to resume with other hyperparameters on purpose: load_into(path, model, opt, "
            "nn::LoadOptions{.allow_new_hyperparameters = true}))";
    detail::fail("load_into", os.str());
  }

  if (options.allow_new_hyperparameters)  // keep the given optimizer's learning rate(s)
    for (const auto& [name, t] : opt.state())
      if (name == "learning_rate" || name.ends_with(".learning_rate"))
        for (auto& [n, saved] : opt_part)
          if (n == name) saved = t.clone();
  detail::apply_load(plan.writes);
  opt.load_state(opt_part);
  random::set_state(key);
}

/// Loads the checkpoint at `path` (the overload above, on the mapped file).
template <class M>
void load_into(const std::filesystem::path& path, M& model, Optimizer& opt, const LoadOptions& options = {}) {
  load_into(SafetensorsFile(path), model, opt, options);
}

}  // namespace nn
