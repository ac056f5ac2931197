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

/// Every Param and Buffer of a model (trainable_only: the trainable Params alone, what a
/// checkpoint stores).
template <class M>
std::vector<WeightSlot> weight_slots(M& m, bool trainable_only = false) {
  std::vector<WeightSlot> out;
  for_each(
      m, [&](const std::string& p, Param& x) { if (!trainable_only || x.trainable) out.push_back({p, &x.value}); },
      [&](const std::string& p, Buffer& x) { if (!trainable_only) out.push_back({p, &x.value}); });
  return out;
}

/// "N label: a, b, c" (at most 20 names, then "... and N more").
inline std::string list_names(const char* label, const std::vector<std::string>& names) {
  std::ostringstream os;
  os << names.size() << ' ' << label << ": ";
  for (std::size_t i = 0; i < names.size() && i < 20; ++i) os << (i ? ", " : "") << names[i];
  if (names.size() > 20) os << ", ... and " << names.size() - 20 << " more";
  return os.str();
}

/// A load worked out before anything is written: which slot gets which tensor, and every name
/// that does not fit, by kind.
struct LoadPlan {
  std::vector<std::pair<Tensor*, const Tensor*>> writes;
  std::vector<std::string> missing, unknown, mismatched, duplicated;

  /// One "N kind: names" line per kind that has any (empty when the load fits).
  std::vector<std::string> problems() const {
    std::vector<std::string> out;
    for (const auto& [label, names] : {std::pair{"missing", &missing}, std::pair{"unknown", &unknown},
                                       std::pair{"mismatched", &mismatched}, std::pair{"duplicated", &duplicated}})
      if (!names->empty()) out.push_back(list_names(label, *names));
    return out;
  }
};

/// Plans a load of `named` into the slots of `m` (see weight_slots); names in the plan's lists
/// carry `prefix`. Strict: every slot must be given and every given name must be a slot.
template <class M>
LoadPlan plan_weights(M& m, const NamedTensorList& named, bool strict, const std::string& prefix = "",
                      bool trainable_only = false) {
  std::vector<WeightSlot> slots = weight_slots(m, trainable_only);
  std::map<std::string, const Tensor*> given;
  LoadPlan out;
  auto& [plan, missing, unknown, mismatched, dup] = out;
  for (const auto& [name, t] : named) {
    if (!given.emplace(name, &t).second) dup.push_back(name);
  }
  std::map<std::string, bool> known;
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
  return out;
}

/// The plan of a load: which slot gets which tensor. Raises (naming every missing, unknown and
/// mismatched name at once) before anything is written, so a failed load changes nothing.
template <class M>
std::vector<std::pair<Tensor*, const Tensor*>> plan_load(M& m, const NamedTensorList& named, bool strict,
                                                         const std::string& source, const std::string& prefix = "") {
  LoadPlan plan = plan_weights(m, named, strict, prefix);
  const std::vector<std::string> problems = plan.problems();
  if (!problems.empty()) {
    std::ostringstream os;
    os << source << ": the weights do not fit the model (nothing was loaded)";
    for (const std::string& p : problems) os << "\n  " << p;
    fail("load_weights", os.str());
  }
  return std::move(plan.writes);
}

/// Writes a plan: into the existing storage when there is one (so tapes and compiled steps bound
/// to the model stay valid), else as a copy.
inline void apply_load(const std::vector<std::pair<Tensor*, const Tensor*>>& plan) {
  for (auto& [target, t] : plan) {
    if (target->defined() && !t->shares_storage(*target)) target->copy_from(*t);  // host or device
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
