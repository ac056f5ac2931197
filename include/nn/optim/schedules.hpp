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
#include <vector>

#include "../config.hpp"

namespace nn {

/// A learning rate as a function of the optimizer's step count (0 for the first update).
using Schedule = std::function<double(std::int64_t)>;

/// init * rate^step
inline Schedule exponential_decay(double init, double decay_rate) {
  const float i = static_cast<float>(init), r = static_cast<float>(decay_rate);
  return [=](std::int64_t step) { return static_cast<double>(i * std::pow(r, static_cast<float>(step))); };
}

/// init * rate^(step / step_size), integer division
inline Schedule step_decay(double init, double decay_rate, std::int64_t step_size) {
  if (step_size <= 0) detail::fail("step_decay", "step_size must be positive, got ", step_size);
  const float i = static_cast<float>(init), r = static_cast<float>(decay_rate);
  return [=](std::int64_t step) { return static_cast<double>(i * std::pow(r, static_cast<float>(step / step_size))); };
}

/// end + 0.5 (1 + cos(pi min(step, decay_steps) / decay_steps)) (init - end)
inline Schedule cosine_decay(double init, std::int64_t decay_steps, double end = 0.0) {
  if (decay_steps <= 0) detail::fail("cosine_decay", "decay_steps must be positive, got ", decay_steps);
  // MLX: (pi / decay_steps) and (init - end) are Python doubles, rounded once to float32.
  const float k = static_cast<float>(std::numbers::pi / static_cast<double>(decay_steps));
  const float e = static_cast<float>(end), span = static_cast<float>(init - end);
  return [=](std::int64_t step) {
    const float s = static_cast<float>(std::min(step, decay_steps));
    const float decay = 0.5f * (1.0f + std::cos(k * s));
    return static_cast<double>(e + decay * span);
  };
}

/// init + min(step, steps) (end - init) / steps: a linear warm-up when init < end.
inline Schedule linear_schedule(double init, double end, std::int64_t steps) {
  if (steps <= 0) detail::fail("linear_schedule", "steps must be positive, got ", steps);
  const float i = static_cast<float>(init), slope = static_cast<float>((end - init) / static_cast<double>(steps));
  return [=](std::int64_t step) { return static_cast<double>(static_cast<float>(std::min(step, steps)) * slope + i); };
}

/// schedules[0] until boundaries[0], then schedules[1] on (step - boundaries[0]), and so on.
inline Schedule join_schedules(std::vector<Schedule> schedules, std::vector<std::int64_t> boundaries) {
  if (schedules.empty() || boundaries.size() + 1 != schedules.size())
    detail::fail("join_schedules", "needs one boundary fewer than schedules, got ", schedules.size(),
                 " schedules and ", boundaries.size(), " boundaries");
  return [=](std::int64_t step) {
    double out = schedules[0](step);
    for (std::size_t i = 0; i < boundaries.size(); ++i)
      if (step >= boundaries[i]) out = schedules[i + 1](step - boundaries[i]);
    return out;
  };
}

}  // namespace nn
