// SPDX-License-Identifier: MIT OR Apache-2.0
// Every optimizer, option, schedule, parameter-group split and clip_grad_norm trains the same
// float32 model for 20 steps as MLX does (fixture: tests/oracle/gen_optim_mlx.py), within 1e-6.
#include <cstring>
#include <functional>
#include <memory>

#include "optim/net.hpp"

namespace optim_mlx_trajectory {  // one unity source with the other optim files: its names stay its own

using namespace nn;
using namespace nn::test::optim;
using nn::test::rel_err;

namespace {

constexpr double kTol = 1e-6;
// Slots after 20 steps are running averages of gradients (and of their squares), so they carry
// the float32 gradient's own error: MLX's float32 gradient of this model is up to 7e-7 from the
// exact one (measured against a float64 evaluation), nn's likewise, so the two may differ by
// ~1.5e-6 with no optimizer involved. The optimizer arithmetic itself is checked to the bit on
// fixed gradients below ("each update is MLX's float32 arithmetic").
constexpr double kSlotTol = 1e-5;

/// One builder per fixture case, making the optimizer gen_optim_mlx.py made. Driven through
/// std::unique_ptr<Optimizer>: the base class is all the runner sees.
using Make = std::unique_ptr<Optimizer> (*)();
bool has_l1(const std::string& p) { return p.find("l1") != std::string::npos; }
bool is_matrix(const std::string& p) { return p == "l1.weight" || p == "l2.weight" || p == "e"; }

const std::map<std::string, Make>& builders() {
  static const std::map<std::string, Make> b = {
      {"sgd/plain", [] { return own(Sgd(0.1)); }},
      {"sgd/momentum", [] { return own(Sgd(0.1).momentum(0.9)); }},
      {"sgd/momentum_dampening", [] { return own(Sgd(0.1).momentum(0.9).dampening(0.3)); }},
      {"sgd/nesterov", [] { return own(Sgd(0.1).momentum(0.9).nesterov()); }},
      {"sgd/weight_decay", [] { return own(Sgd(0.1).weight_decay(0.05)); }},
      {"sgd/nesterov_weight_decay", [] { return own(Sgd(0.1).momentum(0.8).weight_decay(0.02).nesterov()); }},
      {"adam/default", [] { return own(Adam(0.01)); }},
      {"adam/betas_eps", [] { return own(Adam(0.01).betas(0.8, 0.99).eps(1e-4)); }},
      {"adam/bias_correction", [] { return own(Adam(0.01).bias_correction()); }},
      {"adamw/default", [] { return own(AdamW(0.01)); }},
      {"adamw/decay_bias_correction", [] { return own(AdamW(0.01).weight_decay(0.1).bias_correction()); }},
      {"lion/default", [] { return own(Lion(0.003)); }},
      {"lion/weight_decay", [] { return own(Lion(0.003).betas(0.8, 0.95).weight_decay(0.5)); }},
      {"muon/default", [] { return own(Muon(0.02)); }},
      {"muon/no_nesterov", [] { return own(Muon(0.02).nesterov(false)); }},
      {"muon/ns_steps_3", [] { return own(Muon(0.02).ns_steps(3)); }},
      {"muon/no_weight_decay", [] { return own(Muon(0.02).momentum(0.9).weight_decay(0.0)); }},
      {"adafactor/default", [] { return own(Adafactor()); }},
      {"adafactor/lr", [] { return own(Adafactor(0.003).relative_step(false)); }},
      {"adafactor/beta1_wd", [] { return own(Adafactor(0.01).beta1(0.9).weight_decay(0.01).relative_step(false)); }},
      {"adafactor/warmup_noscale", [] { return own(Adafactor().warmup_init().scale_parameter(false)); }},
      {"adafactor/clip_decay_eps",
       [] { return own(Adafactor(0.01).relative_step(false).clip_threshold(0.3).decay_rate(-0.5).eps(1e-20, 1e-2)); }},
      {"adafactor/schedule", [] { return own(Adafactor(cosine_decay(0.01, 15, 1e-3)).relative_step(false)); }},
      {"schedule/exponential_decay", [] { return own(Sgd(exponential_decay(0.1, 0.9))); }},
      {"schedule/step_decay", [] { return own(Sgd(step_decay(0.1, 0.5, 6)).momentum(0.9)); }},
      {"schedule/cosine_decay", [] { return own(Adam(cosine_decay(0.01, 15, 1e-3))); }},
      {"schedule/linear_warmup", [] { return own(Adam(linear_schedule(0.0, 0.01, 8))); }},
      // mlx-lm's warm-up: join([linear(0, lr, W), cosine(...)], [W + 1])
      {"schedule/warmup_cosine",
       [] { return own(AdamW(join_schedules({linear_schedule(0.0, 0.01, 5), cosine_decay(0.01, 12, 1e-3)}, {6}))); }},
      {"multi/sgd_adam", [] { return own(MultiOptimizer(Sgd(0.1)).group(has_l1, Adam(0.01))); }},
      // MLX's docs: Muon for the matrices, AdamW for the rest
      {"multi/muon_adamw", [] { return own(MultiOptimizer(AdamW(0.01)).group(is_matrix, Muon(0.02))); }},
      {"clip/active", [] { return own(Sgd(0.1).momentum(0.9)); }},
      {"clip/inactive", [] { return own(Sgd(0.1).momentum(0.9)); }},
      {"freeze/adam", [] { return own(Adam(0.01).bias_correction()); }},
      {"set_learning_rate/sgd", [] { return own(Sgd(0.1).momentum(0.9)); }},
  };
  return b;
}
std::unique_ptr<Optimizer> make(const std::string& name) {
  auto it = builders().find(name);
  REQUIRE_MESSAGE(it != builders().end(), "no C++ builder for fixture case " << name);
  return it->second();
}

/// A fixture's float32 values (written as their shortest decimals) back as the exact floats.
std::vector<double> f32s(const nlohmann::json& j) {
  std::vector<double> v = j.get<std::vector<double>>();
  for (double& x : v) x = static_cast<float>(x);
  return v;
}
double f32(const nlohmann::json& j) { return static_cast<float>(j.get<double>()); }

/// The slots of a state tree by "<param path>.<slot>" (a MultiOptimizer's "<k>." prefix dropped).
std::map<std::string, Tensor> slots_of(const Optimizer& opt) {
  std::map<std::string, Tensor> out;
  for (auto& [name, t] : opt.state()) {
    auto at = name.find("slots.");
    if (at != std::string::npos) out[name.substr(at + 6)] = t;
  }
  return out;
}
std::vector<std::int64_t> steps_of(const Optimizer& opt) {
  std::vector<std::int64_t> out;
  for (auto& [name, t] : opt.state())
    if (name == "step" || (name.size() > 5 && name.substr(name.size() - 5) == ".step")) out.push_back(static_cast<std::int64_t>(t.item()));
  return out;
}

Worst& worst_slots() {
  static Worst w;
  return w;
}

/// Runs one fixture case and checks it against MLX; returns the worst relative error seen in the
/// losses, norms and parameters (the slots' goes to worst_slots()).
double run_case(const nlohmann::json& fx, const std::string& name) {
  const auto& c = fx.at("cases").at(name);
  Net model = net_from(fx, DType::f32);
  const Data data = data_from(fx, DType::f32);
  std::unique_ptr<Optimizer> opt = make(name);
  const int steps = fx.at("steps").get<int>();
  const auto& snapshots = c.at("params");
  const bool clip = fx.at("clip").contains(name);
  const bool frozen = fx.at("frozen").contains(name);
  const bool set_lr = fx.at("set_learning_rate").contains(name);
  double worst = 0;
  auto note = [&](double e, const std::string& what) {
    worst = std::max(worst, e);
    CHECK_MESSAGE(e <= kTol, name << ": " << what << " differs from MLX by " << e << " (relative)");
  };
  auto is_l1 = [](const std::string& p) { return p.rfind("l1.", 0) == 0; };
  // While frozen: l1's values and slots are left alone (the same tensors, the same bits).
  std::map<std::string, Tensor> kept_values, kept_slots, slot_objects;

  for (int i = 0; i < steps; ++i) {
    if (set_lr && i == fx["set_learning_rate"][name]["before"].get<int>()) {
      const double lr = fx["set_learning_rate"][name]["lr"].get<double>();
      opt->set_learning_rate(lr);
      CHECK(opt->learning_rate() == lr);
    }
    if (frozen && i == fx["frozen"][name]["from"].get<int>()) {
      CHECK(model.freeze(is_l1) == 2);
      for (auto& [p, t] : by_path(model))
        if (is_l1(p)) kept_values[p] = t.clone();
      for (auto& [p, t] : slots_of(*opt))
        if (is_l1(p)) kept_slots[p] = t.clone(), slot_objects[p] = t;
    }
    if (frozen && i == fx["frozen"][name]["to"].get<int>()) {
      for (auto& [p, t] : by_path(model))
        if (is_l1(p)) CHECK_MESSAGE(rel_err(t, kept_values.at(p)) == 0, p << " moved while frozen");
      auto now = slots_of(*opt);
      REQUIRE(now.size() == 10);  // m and v of all five parameters, frozen ones included
      for (auto& [p, t] : kept_slots) {
        CHECK_MESSAGE(now.at(p).raw() == slot_objects.at(p).raw(), "slot " << p << " was replaced while frozen");
        CHECK_MESSAGE(rel_err(now.at(p), t) == 0, "slot " << p << " changed while frozen");
      }
      CHECK(model.unfreeze(is_l1) == 2);
    }
    auto [loss, grads] = loss_and_grads(model, data);
    if (frozen && !model.l1.weight.trainable) CHECK(!grads.l1.weight.value.defined());
    if (clip) {
      const double max_norm = fx["clip"][name].get<double>();
      auto [clipped, norm] = clip_grad_norm(grads, max_norm);
      // "active" clips at every step, "inactive" at none
      CHECK((name == "clip/active") == (norm > max_norm));
      note(rel(norm, f32(c.at("norm")[static_cast<std::size_t>(i)])), "norm at step " + std::to_string(i + 1));
      grads = std::move(clipped);
    }
    opt->update(model, grads);
    note(rel(loss, f32(c.at("loss")[static_cast<std::size_t>(i)])), "loss at step " + std::to_string(i + 1));
    const std::string k = std::to_string(i + 1);
    if (snapshots.contains(k)) {
      for (auto& [p, t] : by_path(model)) {
        const auto& want = snapshots.at(k).at(p);
        note(rel_err(t.to_doubles(), f32s(want)), p + " after step " + k);
      }
    }
  }
  // The state tree after the last step: every slot MLX has, with MLX's values, and its step.
  auto slots = slots_of(*opt);
  CHECK_MESSAGE(slots.size() == c.at("slots").size(), name << ": " << slots.size() << " slots, MLX has " << c.at("slots").size());
  double worst_slot = 0;
  for (auto& [p, want] : c.at("slots").items()) {
    REQUIRE_MESSAGE(slots.count(p), name << ": no slot " << p);
    const double e = rel_err(slots.at(p).to_doubles(), f32s(want));
    CHECK_MESSAGE(e <= kSlotTol, name << ": slot " << p << " differs from MLX by " << e);
    worst_slots().add(name, e);
    worst_slot = std::max(worst_slot, e);
  }
  CHECK(steps_of(*opt) == c.at("step").get<std::vector<std::int64_t>>());
  MESSAGE(name << ": worst relative error " << worst << " (losses, norms, parameters), " << worst_slot << " (slots)");
  return worst;
}

Worst& worst() {
  static Worst w;
  return w;
}

void run_family(const std::string& prefix) {
  const auto fx = nn::test::fixture("optim/mlx.json");
  int n = 0;
  for (auto& [name, _] : fx.at("cases").items()) {
    if (name.rfind(prefix + "/", 0) != 0) continue;
    worst().add(name, run_case(fx, name));
    ++n;
  }
  CHECK(n > 0);
  MESSAGE("MLX " << fx.at("mlx_version").get<std::string>() << " f32, " << prefix << " (" << n
                 << " cases): worst relative error " << worst().by_family[prefix] << " (losses, norms, parameters), "
                 << worst_slots().by_family[prefix] << " (slots after the last step)");
}

}  // namespace

TEST_CASE("the fixture was recorded by MLX and every case has a builder") {
  const auto fx = nn::test::fixture("optim/mlx.json");
  CHECK(fx.at("mlx_version").get<std::string>() == "0.32.4");
  CHECK(fx.at("steps").get<int>() >= 20);
  std::size_t n = 0;
  for (auto& [name, _] : fx.at("cases").items()) {
    CHECK_MESSAGE(builders().count(name), "no builder for " << name);
    ++n;
  }
  CHECK(n == builders().size());
}

TEST_CASE("Sgd matches MLX's SGD (plain, momentum, dampening, nesterov, weight decay)") { run_family("sgd"); }
TEST_CASE("Adam matches MLX's Adam (default, betas/eps, bias correction)") { run_family("adam"); }
TEST_CASE("AdamW matches MLX's AdamW (default decay, decay with bias correction)") { run_family("adamw"); }
TEST_CASE("Lion matches MLX's Lion (default, weight decay)") { run_family("lion"); }
TEST_CASE("Muon matches MLX's Muon (default, no nesterov, 3 Newton-Schulz steps, no decay)") { run_family("muon"); }
TEST_CASE("Adafactor matches MLX's Adafactor (relative step, learning rate, beta1 + decay, warm-up, clipping, schedule)") {
  run_family("adafactor");
}
TEST_CASE("schedules drive the learning rate as MLX's do") { run_family("schedule"); }
TEST_CASE("MultiOptimizer splits parameters as MLX's does") { run_family("multi"); }
TEST_CASE("clip_grad_norm before an update matches MLX's (active and inactive)") { run_family("clip"); }
TEST_CASE("frozen-then-unfrozen parameters keep their slots and match MLX") { run_family("freeze"); }
TEST_CASE("set_learning_rate takes effect on the next update, as MLX's") { run_family("set_learning_rate"); }

namespace {
/// The distance in float32 units in the last place between a and b (0: the same bits).
std::int64_t ulps(float a, float b) {
  auto ordered = [](float f) {
    std::int32_t i;
    std::memcpy(&i, &f, sizeof i);
    return i < 0 ? std::int64_t{INT32_MIN} - i : std::int64_t{i};
  };
  return std::abs(ordered(a) - ordered(b));
}
}  // namespace

TEST_CASE("each update is MLX's float32 arithmetic, to the bit (Muon: to its GEMMs' rounding)") {
  // No model: fixed gradient trees, so only the optimizer's own arithmetic can differ. Some
  // elements of the second gradient put Lion's c = b1 m + (1 - b1) g exactly on 0 in MLX's order.
  const auto fx = nn::test::fixture("optim/mlx.json");
  std::vector<Net> grads;
  for (const auto& g : fx.at("update_grads")) {
    Net t = net_from(nlohmann::json{{"init", g}}, DType::f32);
    grads.push_back(t);
  }
  for (auto& [name, want] : fx.at("updates").items()) {
    Net model = net_from(fx, DType::f32);
    std::unique_ptr<Optimizer> opt = make(name);
    for (const Net& g : grads) opt->update(model, g);
    const bool gemm = name.find("muon") != std::string::npos;  // Newton-Schulz goes through GEMMs
    std::int64_t worst_ulps = 0;
    double worst_rel = 0;
    auto compare = [&](const std::string& what, const Tensor& got, const nlohmann::json& w) {
      std::vector<double> a = got.to_doubles(), b = f32s(w);
      REQUIRE(a.size() == b.size());
      for (std::size_t i = 0; i < a.size(); ++i) worst_ulps = std::max(worst_ulps, ulps(static_cast<float>(a[i]), static_cast<float>(b[i])));
      const double e = rel_err(a, b);
      worst_rel = std::max(worst_rel, e);
      if (gemm) CHECK_MESSAGE(e <= kTol, name << ": " << what << " differs from MLX by " << e);
      else CHECK_MESSAGE(e == 0, name << ": " << what << " differs from MLX by " << e << " (relative)");
    };
    for (auto& [p, t] : by_path(model)) compare(p, t, want.at("params").at(p));
    auto slots = slots_of(*opt);
    CHECK(slots.size() == want.at("slots").size());
    for (auto& [p, w] : want.at("slots").items()) {
      REQUIRE_MESSAGE(slots.count(p), name << ": no slot " << p);
      compare("slot " + p, slots.at(p), w);
    }
    MESSAGE("MLX f32, " << fx.at("update_grads").size() << " updates of " << name << ": worst " << worst_ulps
                        << " ulp, relative " << worst_rel);
  }
}

TEST_CASE("schedules give MLX's float32 values at every step") {
  const auto fx = nn::test::fixture("optim/mlx.json");
  const std::map<std::string, Schedule> s = {
      {"exponential_decay", exponential_decay(0.1, 0.9)},
      {"step_decay", step_decay(0.1, 0.5, 6)},
      {"cosine_decay", cosine_decay(0.01, 15, 1e-3)},
      {"linear_schedule", linear_schedule(0.0, 0.01, 8)},
      {"warmup_cosine", join_schedules({linear_schedule(0.0, 0.01, 5), cosine_decay(0.01, 12, 1e-3)}, {6})},
  };
  // Bit for bit, but for cos: MLX's CPU cos is a Cephes-style float32 polynomial
  // (mlx/backend/cpu/simd/math.h) that is 1 ulp off the correctly rounded cosf nn uses at some
  // arguments (cos(3 pi / 15): MLX 0.80901694, exact 0.809017); 1 + cos then cancels near
  // cos = -1, so a schedule value may end up a few ulp apart.
  for (auto& [name, want] : fx.at("schedules").items()) {
    REQUIRE(s.count(name));
    const std::int64_t allowed = name.find("cosine") != std::string::npos ? 4 : 0;
    std::int64_t worst = 0;
    for (std::size_t i = 0; i < want.size(); ++i) {
      const float got = static_cast<float>(s.at(name)(static_cast<std::int64_t>(i)));
      const std::int64_t u = ulps(got, static_cast<float>(f32(want[i])));
      worst = std::max(worst, u);
      CHECK_MESSAGE(u <= allowed, name << " at step " << i << ": " << got << " vs MLX " << want[i].get<double>());
    }
    MESSAGE("schedule " << name << ": worst " << worst << " ulp from MLX (float32)");
  }
}

}  // namespace optim_mlx_trajectory
