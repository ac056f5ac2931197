// SPDX-License-Identifier: MIT OR Apache-2.0
// Learning-rate schedules as functions of the step, with MLX's semantics
// (mlx.optimizers.schedulers): the first update uses schedule(0), and each value is computed in
// float32 as MLX computes it (its scalars rounded to float32, then float32 arithmetic), so a
// schedule gives MLX's learning rate to the bit rather than a rounding of the exact one (which
// drifts: init * 0.9^step in double is 7e-7 away from MLX's by step 29).
#pragma once

#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>

#include "../config.hpp"
#include "../statics.hpp"

namespace nn {

/// A learning rate as a function of the optimizer's step count (0 for the first update), with a
/// description a checkpoint records and checks on resume: "cosine_decay(init=0.001, ...)" for the
/// schedules below, "custom" for any other function (two custom schedules compare equal: name
/// one with Schedule(fn, "my_warmup(...)") to have a resume check it).
class Schedule {
 public:
  Schedule() = default;
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, Schedule> && std::is_invocable_r_v<double, F&, std::int64_t>)
  Schedule(F fn, std::string description = "custom") : fn_(std::move(fn)), description_(std::move(description)) {}

  double operator()(std::int64_t step) const { return fn_(step); }
  explicit operator bool() const { return static_cast<bool>(fn_); }
  /// What this schedule is, as a checkpoint writes it ("" for no schedule).
  const std::string& description() const { return description_; }

 private:
  std::function<double(std::int64_t)> fn_;
  std::string description_;
};

namespace detail {
/// "name(a=1, b=2)", numbers as StaticValue writes them (17 significant digits: exact round trip).
inline std::string describe_call(const char* name, std::initializer_list<std::pair<const char*, double>> args) {
  std::string out = std::string(name) + "(";
  bool first = true;
  for (const auto& [k, v] : args) {
    out += (first ? "" : ", ") + std::string(k) + "=" + static_value(v).str();
    first = false;
  }
  return out + ")";
}
}  // namespace detail

/// lr at every step (in double, as a plain learning rate is): a schedule where an API wants one.
inline Schedule constant_schedule(double lr) {
  return Schedule([lr](std::int64_t) { return lr; }, detail::describe_call("constant_schedule", {{"lr", lr}}));
}

/// init * rate^step
inline Schedule exponential_decay(double init, double decay_rate) {
  const float i = static_cast<float>(init), r = static_cast<float>(decay_rate);
  return Schedule([=](std::int64_t step) { return static_cast<double>(i * std::pow(r, static_cast<float>(step))); },
                  detail::describe_call("exponential_decay", {{"init", init}, {"decay_rate", decay_rate}}));
}

/// init * rate^(step / step_size), integer division
inline Schedule step_decay(double init, double decay_rate, std::int64_t step_size) {
  if (step_size <= 0) detail::fail("step_decay", "step_size must be positive, got ", step_size);
  const float i = static_cast<float>(init), r = static_cast<float>(decay_rate);
  return Schedule(
      [=](std::int64_t step) { return static_cast<double>(i * std::pow(r, static_cast<float>(step / step_size))); },
      detail::describe_call("step_decay", {{"init", init}, {"decay_rate", decay_rate}, {"step_size", double(step_size)}}));
}

/// end + 0.5 (1 + cos(pi min(step, decay_steps) / decay_steps)) (init - end)
inline Schedule cosine_decay(double init, std::int64_t decay_steps, double end = 0.0) {
  if (decay_steps <= 0) detail::fail("cosine_decay", "decay_steps must be positive, got ", decay_steps);
  // MLX: (pi / decay_steps) and (init - end) are Python doubles, rounded once to float32.
  const float k = static_cast<float>(std::numbers::pi / static_cast<double>(decay_steps));
  const float e = static_cast<float>(end), span = static_cast<float>(init - end);
  return Schedule(
      [=](std::int64_t step) {
        const float s = static_cast<float>(std::min(step, decay_steps));
        const float decay = 0.5f * (1.0f + std::cos(k * s));
        return static_cast<double>(e + decay * span);
      },
      detail::describe_call("cosine_decay", {{"init", init}, {"decay_steps", double(decay_steps)}, {"end", end}}));
}

/// init + min(step, steps) (end - init) / steps: a linear warm-up when init < end.
inline Schedule linear_schedule(double init, double end, std::int64_t steps) {
  if (steps <= 0) detail::fail("linear_schedule", "steps must be positive, got ", steps);
  const float i = static_cast<float>(init), slope = static_cast<float>((end - init) / static_cast<double>(steps));
  return Schedule(
      [=](std::int64_t step) { return static_cast<double>(static_cast<float>(std::min(step, steps)) * slope + i); },
      detail::describe_call("linear_schedule", {{"init", init}, {"end", end}, {"steps", double(steps)}}));
}

/// schedules[0] until boundaries[0], then schedules[1] on (step - boundaries[0]), and so on.
inline Schedule join_schedules(std::vector<Schedule> schedules, std::vector<std::int64_t> boundaries) {
  if (schedules.empty() || boundaries.size() + 1 != schedules.size())
    detail::fail("join_schedules", "needs one boundary fewer than schedules, got ", schedules.size(),
                 " schedules and ", boundaries.size(), " boundaries");
  std::string description = "join_schedules([";
  for (std::size_t i = 0; i < schedules.size(); ++i) description += (i ? ", " : "") + schedules[i].description();
  description += "], [";
  for (std::size_t i = 0; i < boundaries.size(); ++i) description += (i ? ", " : "") + std::to_string(boundaries[i]);
  description += "])";
  return Schedule(
      [=](std::int64_t step) {
        double out = schedules[0](step);
        for (std::size_t i = 0; i < boundaries.size(); ++i)
          if (step >= boundaries[i]) out = schedules[i + 1](step - boundaries[i]);
        return out;
      },
      std::move(description));
}

}  // namespace nn
