// SPDX-License-Identifier: MIT OR Apache-2.0
// Whole-run checkpoints: a model, its optimizer's state tree and the global RNG key in one
// safetensors file, saved atomically and loaded all-or-nothing.
#pragma once

#include "../optim/optimizer.hpp"
#include "../random.hpp"
#include "weights.hpp"

namespace nn {

/// Saves model ("model.<path>"), optimizer state ("optimizer.step", "optimizer.slots.<path>.m",
/// ...) and the global random key ("rng.key") to `path` (written to a temporary file, then
/// renamed). Resuming with load_into and training on is bitwise the run without the pause.
template <class M>
void save(const std::filesystem::path& path, const M& model, const Optimizer& opt) {
  NamedTensors all;
  for (auto& [p, t] : model.parameters()) all.emplace_back("model." + p, t);
  for (auto& [p, t] : opt.state()) all.emplace_back("optimizer." + p, t);
  all.emplace_back("rng.key", random::state());
  save_safetensors(path, all, {{"format", "nn-checkpoint"}, {"nn_version", NN_VERSION_STRING}});
}

/// Loads a checkpoint written by save() into `model` and `opt` and restores the random key.
/// Everything is checked first (every model name, shape and dtype, the optimizer's entries, the
/// key): on any error nothing is changed.
template <class M>
void load_into(const std::filesystem::path& path, M& model, Optimizer& opt) {
  SafetensorsFile file(path);
  auto fmt = file.metadata().find("format");
  if (fmt == file.metadata().end() || fmt->second != "nn-checkpoint")
    detail::fail("load_into", path.string(), ": not an nn checkpoint (metadata format is '",
                 fmt == file.metadata().end() ? std::string("missing") : fmt->second, "')");
  detail::NamedTensorList model_part, opt_part;
  Tensor key;
  for (auto& [name, t] : file.tensors()) {
    if (name.rfind("model.", 0) == 0) model_part.emplace_back(name.substr(6), t);
    else if (name.rfind("optimizer.", 0) == 0) opt_part.emplace_back(name.substr(10), t);
    else if (name == "rng.key") key = t;
    else detail::fail("load_into", path.string(), ": unknown entry '", name, "'");
  }
  if (!key.defined() || key.dtype() != DType::u32 || !(key.shape() == Shape{2}))
    detail::fail("load_into", path.string(), ": missing or malformed 'rng.key' (uint32 (2))");
  auto plan = detail::plan_load(model, model_part, true, path.string(), "model.");
  opt.check_state(opt_part);
  detail::apply_load(plan);
  opt.load_state(opt_part);
  random::set_state(key);
}

}  // namespace nn
