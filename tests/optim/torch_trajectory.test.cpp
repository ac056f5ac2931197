// SPDX-License-Identifier: MIT OR Apache-2.0
// Sgd, Adam and AdamW train the float64 model as torch.optim's SGD / Adam / AdamW do where the
// semantics coincide (fixture: tests/oracle/gen_optim_torch.py), within 1e-12 over 20 steps.
#include <memory>

#include "optim/net.hpp"

namespace optim_torch_trajectory {  // one unity source with the other optim files: its names stay its own

using namespace nn;
using namespace nn::test::optim;
using nn::test::rel_err;

namespace {

constexpr double kTol = 1e-12;

// torch.optim.SGD without dampening is MLX's SGD; torch's Adam / AdamW are MLX's with
// bias_correction=True (torch's AdamW default decay is MLX's 0.01).
std::unique_ptr<Optimizer> make(const std::string& name) {
  if (name == "sgd/plain") return own(Sgd(0.1));
  if (name == "sgd/momentum") return own(Sgd(0.1).momentum(0.9));
  if (name == "sgd/nesterov") return own(Sgd(0.1).momentum(0.9).nesterov());
  if (name == "sgd/weight_decay") return own(Sgd(0.1).weight_decay(0.05));
  if (name == "sgd/nesterov_weight_decay") return own(Sgd(0.1).momentum(0.8).weight_decay(0.02).nesterov());
  if (name == "adam/bias_correction") return own(Adam(0.01).bias_correction());
  if (name == "adam/betas_eps_bias_correction") return own(Adam(0.01).betas(0.8, 0.99).eps(1e-4).bias_correction());
  if (name == "adamw/bias_correction") return own(AdamW(0.01).bias_correction());
  if (name == "adamw/decay_bias_correction") return own(AdamW(0.01).weight_decay(0.1).bias_correction());
  FAIL("no C++ builder for fixture case " << name);
  return nullptr;
}

}  // namespace

TEST_CASE("Sgd, Adam and AdamW match torch.optim in float64") {
  const auto fx = nn::test::fixture("optim/torch.json");
  const Data data = data_from(fx, DType::f64);
  const int steps = fx.at("steps").get<int>();
  CHECK(steps >= 20);
  Worst worst;
  for (auto& [name, c] : fx.at("cases").items()) {
    Net model = net_from(fx, DType::f64);
    std::unique_ptr<Optimizer> opt = make(name);
    double w = 0;
    auto note = [&](double e, const std::string& what) {
      w = std::max(w, e);
      CHECK_MESSAGE(e <= kTol, name << ": " << what << " differs from PyTorch by " << e << " (relative)");
    };
    for (int i = 0; i < steps; ++i) {
      auto [loss, grads] = loss_and_grads(model, data);
      opt->update(model, grads);
      note(rel(loss, c.at("loss")[static_cast<std::size_t>(i)].get<double>()), "loss at step " + std::to_string(i + 1));
      const std::string k = std::to_string(i + 1);
      if (!c.at("params").contains(k)) continue;
      for (auto& [p, t] : by_path(model))
        note(rel_err(t.to_doubles(), c["params"][k].at(p).get<std::vector<double>>()), p + " after step " + k);
    }
    CHECK(opt->step() == steps);
    worst.add(name, w);
  }
  for (auto& [family, e] : worst.by_family)
    MESSAGE("PyTorch " << fx.at("torch_version").get<std::string>() << " f64, " << family << ": worst relative error " << e);
}

}  // namespace optim_torch_trajectory
