// SPDX-License-Identifier: MIT OR Apache-2.0
// Model weights by name: save_weights / save_trainable / strict load_weights /
// load_weights_partial, on safetensors files named by module path (MLX's conventions).
#pragma once

#include <map>
#include <sstream>

#include "../module.hpp"
#include "safetensors.hpp"

namespace nn::detail {

/// One tensor slot of a model: its path and the tensor a load writes.
struct WeightSlot {
  std::string path;
  Tensor* target;
};

template <class M>
std::vector<WeightSlot> weight_slots(M& m) {
  std::vector<WeightSlot> out;
  for_each(
      m, [&](const std::string& p, Param& x) { out.push_back({p, &x.value}); },
      [&](const std::string& p, Buffer& x) { out.push_back({p, &x.value}); });
  return out;
}

/// Appends "label: a, b, c" (at most 20 names, then "... and N more").
inline void list_names(std::ostringstream& os, const char* label, const std::vector<std::string>& names) {
  if (names.empty()) return;
  os << "\n  " << names.size() << ' ' << label << ": ";
  for (std::size_t i = 0; i < names.size() && i < 20; ++i) os << (i ? ", " : "") << names[i];
  if (names.size() > 20) os << ", ... and " << names.size() - 20 << " more";
}

/// The plan of a load: which slot gets which tensor. Raises (naming every missing, unknown and
/// mismatched name at once) before anything is written, so a failed load changes nothing.
template <class M>
std::vector<std::pair<Tensor*, const Tensor*>> plan_load(M& m, const NamedTensorList& named, bool strict,
                                                         const std::string& source, const std::string& prefix = "") {
  std::vector<WeightSlot> slots = weight_slots(m);
  std::map<std::string, const Tensor*> given;
  std::vector<std::string> dup, unknown, missing, mismatched;
  for (const auto& [name, t] : named) {
    if (!given.emplace(name, &t).second) dup.push_back(name);
  }
  std::map<std::string, bool> known;
  std::vector<std::pair<Tensor*, const Tensor*>> plan;
  for (const WeightSlot& s : slots) {
    known[s.path] = true;
    auto it = given.find(s.path);
    if (it == given.end()) {
      if (strict) missing.push_back(prefix + s.path);
      continue;
    }
    const Tensor& t = *it->second;
    if (!t.defined()) {
      mismatched.push_back(prefix + s.path + " (empty tensor)");
    } else if (s.target->defined() && (!(t.shape() == s.target->shape()) || t.dtype() != s.target->dtype())) {
      mismatched.push_back(prefix + s.path + " (file " + t.shape().str() + " " + dtype_name(t.dtype()) + ", model " +
                           s.target->shape().str() + " " + dtype_name(s.target->dtype()) + ")");
    } else {
      plan.emplace_back(s.target, &t);
    }
  }
  for (const auto& [name, t] : given)
    if (strict && !known.count(name)) unknown.push_back(prefix + name);
  if (!dup.empty() || !unknown.empty() || !missing.empty() || !mismatched.empty()) {
    std::ostringstream os;
    os << source << ": the weights do not fit the model (nothing was loaded)";
    list_names(os, "missing", missing);
    list_names(os, "unknown", unknown);
    list_names(os, "mismatched", mismatched);
    list_names(os, "duplicated", dup);
    fail("load_weights", os.str());
  }
  return plan;
}

/// Writes a plan: into the existing storage when there is one (so tapes and compiled steps bound
/// to the model stay valid), else as a copy.
inline void apply_load(const std::vector<std::pair<Tensor*, const Tensor*>>& plan) {
  for (auto& [target, t] : plan) {
    if (target->defined() && !t->shares_storage(*target)) cpu::copy(*t, *target, false);
    else if (!target->defined()) *target = t->clone();
  }
}

template <class M>
void load_weights_impl(M& m, const NamedTensorList& named, bool strict, const std::string& source) {
  apply_load(plan_load(m, named, strict, source));
}

template <class M>
void load_weights_file(M& m, const std::filesystem::path& path, bool strict) {
  NamedTensorList named = load_safetensors(path);
  load_weights_impl(m, named, strict, path.string());
}

template <class M>
void save_weights_impl(const M& m, const std::filesystem::path& path, bool trainable_only) {
  save_safetensors(path, tree_parameters(m, trainable_only), {{"format", "mlx"}});
}

}  // namespace nn::detail
