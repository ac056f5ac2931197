// SPDX-License-Identifier: MIT OR Apache-2.0
// Parameter groups (MLX's MultiOptimizer): each parameter goes to the first group whose
// predicate matches its path, else to the default optimizer.
#pragma once

#include <functional>
#include <memory>

#include "optimizer.hpp"

namespace nn {

/// MultiOptimizer(Sgd(1e-2)).group(pred, Adam(1e-3)): the first matching group wins; the
/// optimizer given to the constructor takes every parameter no group claims. Every member steps
/// on every update (as MLX's). Its state is "<k>.step", "<k>.slots.<path>.m", ... with k the
/// group index and the default optimizer last.
class MultiOptimizer : public Optimizer {
 public:
  using Pred = std::function<bool(const std::string&)>;

  template <class Opt>
  explicit MultiOptimizer(Opt fallback) : Optimizer(0.0), fallback_(std::make_unique<Opt>(std::move(fallback))) {}

  template <class Opt>
  MultiOptimizer& group(Pred pred, Opt opt) & {
    groups_.emplace_back(std::move(pred), std::make_unique<Opt>(std::move(opt)));
    return *this;
  }
  /// On a temporary, so `auto opt = MultiOptimizer(a).group(p, b);` moves rather than copies.
  template <class Opt>
  MultiOptimizer&& group(Pred pred, Opt opt) && {
    return std::move(group(std::move(pred), std::move(opt)));
  }

  /// The first member's rate (the first group's, else the default's), as MLX's.
  double learning_rate() const override { return member(0).learning_rate(); }
  void set_learning_rate(double lr) override {
    for (auto& g : groups_) g.second->set_learning_rate(lr);
    fallback_->set_learning_rate(lr);
  }
  void begin_step() override {
    Optimizer::begin_step();  // counts this wrapper's own step
    for (auto& g : groups_) g.second->begin_step();
    fallback_->begin_step();
  }
  void init_param(const std::string& path, const Tensor& p) override { route(path).init_param(path, p); }
  Shape slot_shape(const std::string& path, std::string_view name, const Tensor& p) const override {
    return route(path).slot_shape(path, name, p);
  }
  const char* type_name() const override { return "MultiOptimizer"; }
  /// Each member's type and fields, prefixed by its index ("0.type", "0.b1", ..., the default
  /// optimizer last), as its state is.
  void visit_config(StaticSink& sink) const override {
    struct Prefixed final : StaticSink {
      StaticSink& inner;
      std::string prefix, name;
      explicit Prefixed(StaticSink& s) : inner(s) {}
      void field(std::string_view n, const StaticValue& v) override {
        name = prefix;
        name += n;
        inner.field(name, v);
      }
    } p(sink);
    for (std::size_t k = 0; k <= groups_.size(); ++k) {
      p.prefix = std::to_string(k) + ".";
      p.field("type", detail::static_value(std::string_view(member(k).type_name())));
      member(k).visit_config(p);
    }
  }
  void describe_rate(std::vector<std::pair<std::string, std::string>>& out, const std::string& prefix) const override {
    for (std::size_t k = 0; k <= groups_.size(); ++k) member(k).describe_rate(out, prefix + std::to_string(k) + ".");
  }
  void apply(const std::string& path, Tensor& p, const Tensor& g) override { route(path).apply(path, p, g); }

  std::vector<std::pair<std::string, Tensor>> state() const override {
    std::vector<std::pair<std::string, Tensor>> out;
    for (std::size_t k = 0; k <= groups_.size(); ++k)
      for (auto& [name, t] : member(k).state()) out.emplace_back(std::to_string(k) + "." + name, t);
    return out;
  }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& entries) override {
    auto parts = split(entries);
    // Validate every part first, so a bad entry leaves every group as it was.
    for (std::size_t k = 0; k < parts.size(); ++k) member(k).check_state(parts[k]);
    for (std::size_t k = 0; k < parts.size(); ++k) member(k).load_state(parts[k]);
    step_.data<std::int64_t>()[0] = fallback_->step();  // the members step together; step() is theirs
  }
  void check_state(const std::vector<std::pair<std::string, Tensor>>& entries) const override {
    auto parts = split(entries);
    for (std::size_t k = 0; k < parts.size(); ++k) member(k).check_state(parts[k]);
  }

 protected:
  std::vector<const char*> slot_names(const Tensor&) const override { return {}; }

 private:
  std::vector<std::vector<std::pair<std::string, Tensor>>> split(
      const std::vector<std::pair<std::string, Tensor>>& entries) const {
    std::vector<std::vector<std::pair<std::string, Tensor>>> parts(groups_.size() + 1);
    for (const auto& [name, t] : entries) {
      const std::size_t dot = name.find('.');
      std::size_t k = parts.size();
      try {
        k = std::stoul(name.substr(0, dot));
      } catch (...) {
      }
      if (dot == std::string::npos || k >= parts.size())
        detail::fail("optimizer", "state entry '", name, "' names no group of this MultiOptimizer");
      parts[k].emplace_back(name.substr(dot + 1), t);
    }
    return parts;
  }
  Optimizer& route(const std::string& path) const {
    for (auto& g : groups_)
      if (g.first(path)) return *g.second;
    return *fallback_;
  }
  Optimizer& member(std::size_t k) const { return k < groups_.size() ? *groups_[k].second : *fallback_; }

  std::vector<std::pair<Pred, std::unique_ptr<Optimizer>>> groups_;
  std::unique_ptr<Optimizer> fallback_;
};

}  // namespace nn
