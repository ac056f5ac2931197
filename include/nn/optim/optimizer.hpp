// SPDX-License-Identifier: MIT OR Apache-2.0
// The optimizer base: a state tree (step, learning_rate, slots by parameter path) and
// update(model, grads) over a gradient tree of the model's own type, following MLX's
// Optimizer.apply_gradients (schedule at the current step, then step += 1, then the updates).
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../anomaly.hpp"
#include "../module.hpp"
#include "schedules.hpp"

namespace nn {

namespace detail {
/// Zeros on `dev` (optimizer state lives where its parameter lives).
inline Tensor zeros_on(const Shape& s, DType t, Device dev) {
  Tensor z = Tensor::zeros(s, t);
  return dev == Device::cpu ? z : z.to(dev);
}

}  // namespace detail

/// The base of every optimizer (usable through std::unique_ptr<Optimizer>).
///
/// State: `step` (0-D int64) and `learning_rate` (0-D float64) are tensors so a replayed step
/// reads new values without re-recording; `slots` hold per-parameter buffers keyed by the
/// parameter's path. Freezing or unfreezing a parameter never moves or resets its slots.
class Optimizer {
 public:
  using Slots = std::map<std::string, Tensor>;

  explicit Optimizer(double lr) : Optimizer(Schedule{}) { set_learning_rate(lr); }
  explicit Optimizer(Schedule schedule) : schedule_(std::move(schedule)) {
    step_ = Tensor::zeros(Shape{}, DType::i64);
    lr_ = Tensor::zeros(Shape{}, DType::f64);
    if (schedule_) lr_.data<double>()[0] = schedule_(0);
  }
  virtual ~Optimizer() = default;
  /// A copy owns its state: step, learning rate and slots are cloned, so two copies train
  /// independently (tensors themselves copy shallowly).
  Optimizer(const Optimizer& o) : schedule_(o.schedule_), skip_nonfinite_(o.skip_nonfinite_), skipped_(o.skipped_) {
    copy_state(o);
  }
  Optimizer& operator=(const Optimizer& o) {
    if (this != &o) {
      schedule_ = o.schedule_;
      skip_nonfinite_ = o.skip_nonfinite_;
      skipped_ = o.skipped_;
      copy_state(o);
    }
    return *this;
  }
  Optimizer(Optimizer&&) = default;
  Optimizer& operator=(Optimizer&&) = default;

  /// Creates the slots of every trainable parameter now (else they are made on first use).
  template <class M>
  void init(const M& model) {
    detail::for_each(model, [&](const std::string& path, const Param& p) {
      if (p.trainable) init_param(path, p.value);
    });
  }

  /// Updates every trainable parameter of `model` from the same-typed gradient tree `grads`
  /// (as returned by value_and_grad); frozen parameters are untouched.
  template <class M>
  void update(M& model, const M& grads) {
    std::vector<std::pair<std::string, Param*>> ps;
    std::vector<const Param*> gs;
    detail::for_each(model, [&](const std::string& path, Param& p) { ps.emplace_back(path, &p); });
    detail::for_each(grads, [&](const std::string&, const Param& g) { gs.push_back(&g); });
    if (ps.size() != gs.size())
      detail::fail("optimizer", "the gradient tree has ", gs.size(), " parameters but the model has ", ps.size());
    // Every check (gradients, slots) before anything changes: a failed update changes nothing.
    for (std::size_t i = 0; i < ps.size(); ++i) {
      Param& p = *ps[i].second;
      if (!p.trainable) continue;
      const Tensor& g = gs[i]->value;
      if (!g.defined()) detail::fail("optimizer", "no gradient for trainable parameter '", ps[i].first, "'");
      if (!(g.shape() == p.value.shape()) || g.dtype() != p.value.dtype())
        detail::fail("optimizer", "gradient of '", ps[i].first, "' is ", g.shape().str(), " ", dtype_name(g.dtype()),
                     " but the parameter is ", p.value.shape().str(), " ", dtype_name(p.value.dtype()));
      init_param(ps[i].first, p.value);
    }
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (ps[i].second->trainable && !admit(ps[i].first, detail::all_finite(gs[i]->value))) return;
    begin_step();
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (ps[i].second->trainable) apply(ps[i].first, ps[i].second->value, gs[i]->value);
  }

  /// What an update does when a gradient holds NaN or Inf (a NaN loss, an overflow): by default
  /// it raises naming the parameter and changes nothing; with skip_nonfinite(true) it skips the
  /// whole step -- no parameter, slot, step count or schedule position changes -- and counts it
  /// (skipped_steps()), as mixed-precision trainers skip overflowed steps.
  Optimizer& skip_nonfinite(bool on = true) {
    skip_nonfinite_ = on;
    return *this;
  }
  std::int64_t skipped_steps() const { return skipped_; }
  /// The update's gate, called for each trainable parameter in order before anything changes:
  /// true lets the step go on; a non-finite gradient raises, or (skip_nonfinite) counts a
  /// skipped step and returns false. Optimizer::update and compiled steps call it.
  bool admit(const std::string& path, bool gradient_finite) {
    if (gradient_finite) return true;
    if (!skip_nonfinite_)
      detail::fail("optimizer", "the gradient of '", path, "' holds NaN or Inf at update ", step() + 1,
                   ": nothing was updated (skip_nonfinite(true) skips such steps and counts them)");
    ++skipped_;
    return false;
  }

  /// The number of updates applied so far.
  std::int64_t step() const { return step_.data<std::int64_t>()[0]; }
  /// The learning rate the next update uses (a schedule overrides it at each update).
  virtual double learning_rate() const { return lr_.data<double>()[0]; }
  virtual void set_learning_rate(double lr) { lr_.data<double>()[0] = lr; }

  /// The state as a flat list of (path, tensor): "step", "learning_rate", "slots.<param>.<slot>"
  /// — how a checkpoint saves it. Tensors are shared, not copied.
  virtual std::vector<std::pair<std::string, Tensor>> state() const {
    std::vector<std::pair<std::string, Tensor>> out{{"step", step_}, {"learning_rate", lr_}};
    for (const auto& [path, slots] : slots_)
      for (const auto& [name, t] : slots) out.emplace_back("slots." + path + "." + name, t);
    return out;
  }
  /// Replaces the state from (path, tensor) pairs as state() wrote them. Strict: an unknown,
  /// missing or mis-shaped entry raises and leaves the optimizer as it was.
  virtual void load_state(const std::vector<std::pair<std::string, Tensor>>& entries) {
    Parsed st = parse_state(entries);
    step_.data<std::int64_t>()[0] = st.step;
    lr_.data<double>()[0] = st.lr;
    slots_ = std::move(st.slots);
  }
  /// Raises exactly when load_state would; changes nothing.
  virtual void check_state(const std::vector<std::pair<std::string, Tensor>>& entries) const {
    parse_state(entries);
  }

  /// The slots of one parameter (empty map when it has none yet).
  const Slots& slots(const std::string& path) const {
    static const Slots none;
    auto it = slots_.find(path);
    return it == slots_.end() ? none : it->second;
  }

  /// MLX's order: scheduled values at the current step, then step += 1. Called once per update.
  virtual void begin_step() {
    if (schedule_) lr_.data<double>()[0] = schedule_(step());
    step_.data<std::int64_t>()[0] += 1;
  }
  /// Creates the slots of one parameter if it has none; checks those it has (they may come from
  /// load_state) against the parameter, so a mis-shaped slot raises before any kernel reads it.
  virtual void init_param(const std::string& path, const Tensor& p) {
    auto it = slots_.find(path);
    if (it == slots_.end()) {
      Slots& s = slots_[path];
      for (const char* name : slot_names(p)) s[name] = detail::zeros_on(slot_shape(path, name, p), p.dtype(), p.device());
      return;
    }
    for (const char* name : slot_names(p)) {
      auto t = it->second.find(name);
      if (t == it->second.end())
        detail::fail("optimizer", "parameter '", path, "' has no slot '", name, "' (state entry 'slots.", path, ".",
                     name, "' is missing)");
      const Shape want = slot_shape(path, name, p);
      if (!(t->second.shape() == want) || t->second.dtype() != p.dtype())
        detail::fail("optimizer", "slot '", name, "' of '", path, "' is ", t->second.shape().str(), " ",
                     dtype_name(t->second.dtype()), " but the parameter is ", p.shape().str(), " ", dtype_name(p.dtype()),
                     want == p.shape() ? std::string() : " (the slot should be " + want.str() + ")");
    }
    // Slots loaded from a checkpoint are host tensors: they follow their parameter to its device.
    for (const char* name : slot_names(p)) {
      Tensor& t = it->second.at(name);
      if (t.device() != p.device()) t = t.to(p.device());
    }
  }
  /// The shape of slot `name` of the parameter at `path` (value p): p's own unless an optimizer
  /// keeps another (Adafactor's factored second moments). Slots are created and checked with it,
  /// and so are a checkpoint's entries (MultiOptimizer asks the member `path` goes to).
  virtual Shape slot_shape(const std::string& /*path*/, std::string_view /*name*/, const Tensor& p) const {
    return p.shape();
  }
  /// The update of one parameter from its gradient, using its slots.
  virtual void apply(const std::string& path, Tensor& p, const Tensor& g) = 0;
  /// The optimizer's type as a checkpoint records it ("AdamW"); NN_OPTIMIZER defines it.
  virtual const char* type_name() const { return "Optimizer"; }
  /// Visits the non-tensor hyperparameters (betas, momentum, weight decay, ...) as
  /// NN_OPTIMIZER lists them, base class first. Not the learning rate or the step: those are
  /// tensors, a replayed step reads them without recording again.
  virtual void visit_config(StaticSink&) const {}
  /// A hash of the type and visit_config's fields (allocation-free: a compiled step computes it on
  /// every call and records again when it changes).
  std::uint64_t hyper_hash() const {
    detail::HashSink h;
    h.field("type", detail::static_value(std::string_view(type_name())));
    visit_config(h);
    return h.fnv.h;
  }
  /// The configuration as a checkpoint's metadata holds it: {"type", "AdamW"}, {"b1", "0.9"},
  /// ..., and {"schedule", "cosine_decay(...)"} or, without one, {"learning_rate", "0.001"}.
  std::vector<std::pair<std::string, std::string>> describe() const {
    struct Collect final : StaticSink {
      std::vector<std::pair<std::string, std::string>> out;
      void field(std::string_view name, const StaticValue& v) override { out.emplace_back(name, v.str()); }
    } c;
    c.out.emplace_back("type", type_name());
    visit_config(c);
    describe_rate(c.out, "");
    return std::move(c.out);
  }
  /// Adds {prefix + "schedule", description}, or {prefix + "learning_rate", value} without a
  /// schedule (MultiOptimizer adds its members' with their group prefix).
  virtual void describe_rate(std::vector<std::pair<std::string, std::string>>& out, const std::string& prefix) const {
    if (schedule_) out.emplace_back(prefix + "schedule", schedule_.description());
    else out.emplace_back(prefix + "learning_rate", detail::static_value(learning_rate()).str());
  }

 protected:
  void copy_state(const Optimizer& o) {
    step_ = o.step_.clone();
    lr_ = o.lr_.clone();
    slots_.clear();
    for (const auto& [path, slots] : o.slots_)
      for (const auto& [name, t] : slots) slots_[path][name] = t.clone();
  }

  struct Parsed {
    std::int64_t step = 0;
    double lr = 0;
    std::map<std::string, Slots> slots;
  };
  /// Parses a state; where this optimizer already holds slots (after init or updates), the
  /// entries must name exactly those slots, with their shapes and dtypes.
  Parsed parse_state(const std::vector<std::pair<std::string, Tensor>>& entries) const {
    Parsed out;
    bool has_step = false, has_lr = false;
    for (const auto& [name, t] : entries) {
      if ((name == "step" || name == "learning_rate") && (!t.defined() || t.numel() != 1))
        detail::fail("optimizer", "state entry '", name, "' must hold one element, got ",
                     t.defined() ? t.shape().str() : std::string("nothing"));
      if (name == "step") {
        out.step = static_cast<std::int64_t>(t.item());
        has_step = true;
      } else if (name == "learning_rate") {
        out.lr = t.item();
        has_lr = true;
      } else if (name.rfind("slots.", 0) == 0 && name.rfind('.') > 6 && t.defined()) {
        const std::size_t dot = name.rfind('.');
        const std::string path = name.substr(6, dot - 6), slot_name = name.substr(dot + 1);
        auto held = slots_.find(path);
        if (held != slots_.end()) {
          auto s = held->second.find(slot_name);
          if (s == held->second.end()) detail::fail("optimizer", "unknown state entry '", name, "'");
          if (!(s->second.shape() == t.shape()) || s->second.dtype() != t.dtype())
            detail::fail("optimizer", "state entry '", name, "' is ", t.shape().str(), " ", dtype_name(t.dtype()),
                         " but the slot is ", s->second.shape().str(), " ", dtype_name(s->second.dtype()));
        }
        out.slots[path][slot_name] = t.clone();
      } else {
        detail::fail("optimizer", "unknown state entry '", name, "'");
      }
    }
    if (!has_step || !has_lr) detail::fail("optimizer", "state needs 'step' and 'learning_rate'");
    for (const auto& [path, slots] : slots_)
      for (const auto& [slot_name, t] : slots) {
        auto got = out.slots.find(path);
        if (got == out.slots.end() || !got->second.count(slot_name))
          detail::fail("optimizer", "state entry 'slots.", path, ".", slot_name, "' is missing");
      }
    return out;
  }

  /// Which zero-initialised slots a parameter needs ("m", "v", ...).
  virtual std::vector<const char*> slot_names(const Tensor& p) const = 0;
  Tensor& slot(const std::string& path, const char* name) { return slots_.at(path).at(name); }

  Tensor step_;  // 0-D int64
  Tensor lr_;    // 0-D float64
  Schedule schedule_;
  bool skip_nonfinite_ = false;
  std::int64_t skipped_ = 0;
  std::map<std::string, Slots> slots_;
};

}  // namespace nn

/// Declares an optimizer's name and hyperparameters inside its class:
/// `NN_OPTIMIZER(Lion, Optimizer, b1_, b2_, wd_)`. The fields are hashed into hyper_hash() (a
/// compiled step records again when one changes) and written to, and checked by, a checkpoint
/// (nn::save / nn::load_into), after the base class's fields.
#define NN_OPTIMIZER(Name, Base, ...)                                          \
  const char* type_name() const override { return #Name; }                    \
  void visit_config(::nn::StaticSink& sink) const override {                   \
    Base::visit_config(sink);                                                  \
    ::nn::detail::statics(#__VA_ARGS__, __VA_ARGS__).visit(sink);              \
  }
