// SPDX-License-Identifier: MIT OR Apache-2.0
// Whole-run checkpoints hold the run (optimizer type, hyperparameters, schedule, frozen set and a
// fingerprint of the frozen base) and refuse the wrong one, listing every difference in one
// error and changing nothing; a LoRA run's checkpoint is adapter-sized and resumes bitwise.
#include "support/check.hpp"

#include <filesystem>

namespace io_checkpoint {  // one unity source with the other io files: its names stay its own

using namespace nn;

namespace {

struct Net {
  Linear l1, l2;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return l2(tp, tanh(tp, l1(tp, x)));
  }
  NN_MODULE(Net, l1, l2)
};

struct Adapted {
  LoraLinear q;
  Linear head;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return head(tp, q(tp, x));
  }
  NN_MODULE(Adapted, q, head)
};

Net make_net(std::uint64_t seed) {
  random::seed(seed);
  return Net{Linear(4, 6), Linear(6, 3)};
}

Adapted make_adapted(std::int64_t rank = 2) {
  random::seed(5);
  Linear base(8, 8);
  Adapted m{LoraLinear::from_base(base, rank), Linear(8, 3)};
  m.head.freeze();
  return m;
}

std::filesystem::path tmp(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / "nn_checkpoint_test";
  std::filesystem::create_directories(dir);
  return dir / name;
}

template <class M>
std::vector<std::vector<double>> snapshot(const M& m) {
  std::vector<std::vector<double>> out;
  for (auto& [p, t] : m.parameters()) out.push_back(t.to_doubles());
  return out;
}

// The input width of each test model (train() is shared).
template <class M>
std::int64_t in_width(const M& m) {
  if constexpr (std::is_same_v<M, Net>) return m.l1.in_features();
  else return m.q.in_features();
}

template <class M>
void train_steps(M& m, Optimizer& opt, int from, int to) {
  for (int i = from; i < to; ++i) {
    Tensor x = test::random_tensor({5, in_width(m)}, DType::f32, 100 + static_cast<std::uint64_t>(i));
    auto [loss, grads] = value_and_grad(m, [&](GTape<cpu>& tp, const M& n) {
      GVar y = n(tp, tp.constant(x));
      return mean(tp, mul(tp, y, y));
    });
    opt.update(m, grads);
  }
}

// Checks that load_into refuses with every fragment named, and that nothing changed.
template <class M>
void refused(const std::filesystem::path& file, M& m, Optimizer& opt, std::vector<std::string> fragments,
             const LoadOptions& options = {}) {
  const auto before = snapshot(m);
  const auto state_before = opt.state();
  std::vector<std::vector<double>> opt_before;
  for (auto& [n, t] : state_before) opt_before.push_back(t.to_doubles());
  const std::int64_t step = opt.step();
  const std::vector<double> key = random::state().to_doubles();
  fragments.push_back("nothing was loaded");
  test::check_error([&] { load_into(file, m, opt, options); }, fragments);
  CHECK(snapshot(m) == before);
  CHECK(opt.step() == step);
  std::vector<std::vector<double>> opt_after;
  for (auto& [n, t] : opt.state()) opt_after.push_back(t.to_doubles());
  CHECK(opt_after == opt_before);
  CHECK(random::state().to_doubles() == key);
}

}  // namespace

TEST_CASE("an AdamW checkpoint is refused by an Sgd, and an Sgd one by an AdamW") {
  Net a = make_net(1);
  AdamW adamw(1e-2);
  train_steps(a, adamw, 0, 2);
  save(tmp("adamw.safetensors"), a, adamw);
  Net b = make_net(2);
  Sgd sgd(1e-2);
  sgd.momentum(0.9);
  refused(tmp("adamw.safetensors"), b, sgd, {"optimizer type: AdamW in the file, Sgd given"});
  // even with new hyperparameters allowed: the state would not fit
  refused(tmp("adamw.safetensors"), b, sgd, {"optimizer type: AdamW in the file, Sgd given"},
          LoadOptions{.allow_new_hyperparameters = true});

  Sgd sgd_run(1e-2);
  sgd_run.momentum(0.9);
  train_steps(a, sgd_run, 0, 2);
  save(tmp("sgd.safetensors"), a, sgd_run);
  AdamW fresh(1e-2);  // no slots yet: still checked
  refused(tmp("sgd.safetensors"), b, fresh, {"optimizer type: Sgd in the file, AdamW given"});
}

TEST_CASE("every differing hyperparameter, the schedule and the learning rate are listed in one error") {
  Net a = make_net(1);
  AdamW run(cosine_decay(1e-2, 100));
  run.betas(0.9, 0.95).weight_decay(0.1);
  train_steps(a, run, 0, 2);
  save(tmp("hyper.safetensors"), a, run);

  Net b = make_net(2);
  AdamW other(cosine_decay(1e-2, 200));
  other.betas(0.8, 0.95).weight_decay(0.0);
  refused(tmp("hyper.safetensors"), b, other,
          {"3 differences", "optimizer b1: 0.90000000000000002 in the file, 0.80000000000000004 given",
           "optimizer wd: 0.10000000000000001 in the file, 0 given",
           "optimizer schedule: cosine_decay(init=0.01, decay_steps=100, end=0) in the file, "
           "cosine_decay(init=0.01, decay_steps=200, end=0) given",
           "allow_new_hyperparameters"});

  AdamW constant(1e-3);  // no schedule: the learning rate is compared
  constant.betas(0.9, 0.95).weight_decay(0.1);
  refused(tmp("hyper.safetensors"), b, constant, {"optimizer schedule: cosine_decay", "not set on the given optimizer",
                                                  "optimizer learning_rate: not in the file, 0.001 given"});

  // Deliberately new hyperparameters: the file's state, the given optimizer's configuration.
  load_into(tmp("hyper.safetensors"), b, other, LoadOptions{.allow_new_hyperparameters = true});
  CHECK(other.step() == 2);
  CHECK(snapshot(b) == snapshot(a));
  std::map<std::string, std::string> cfg;
  for (auto& [k, v] : other.describe()) cfg[k] = v;
  CHECK(cfg.at("b1") == "0.80000000000000004");
  CHECK(cfg.at("schedule").find("decay_steps=200") != std::string::npos);
}

TEST_CASE("a constant learning rate that differs is refused, and kept when allowed") {
  Net a = make_net(1);
  Adam run(1e-3);
  train_steps(a, run, 0, 1);
  save(tmp("lr.safetensors"), a, run);
  Net b = make_net(2);
  Adam other(5e-4);
  refused(tmp("lr.safetensors"), b, other, {"optimizer learning_rate: 0.001 in the file, 0.00050000000000000001 given"});
  load_into(tmp("lr.safetensors"), b, other, LoadOptions{.allow_new_hyperparameters = true});
  CHECK(other.learning_rate() == 5e-4);
  CHECK(other.step() == 1);
}

TEST_CASE("the frozen set and the frozen base's content are verified") {
  Adapted a = make_adapted();
  Adam opt(1e-2);
  train_steps(a, opt, 0, 2);
  save(tmp("lora.safetensors"), a, opt);

  // adapter-sized: only what training changes is stored
  SafetensorsFile f(tmp("lora.safetensors"));
  std::vector<std::string> models;
  for (const std::string& n : f.names())
    if (n.rfind("model.", 0) == 0) models.push_back(n);
  CHECK(models == std::vector<std::string>{"model.q.lora_a", "model.q.lora_b"});
  CHECK(f.metadata().at("frozen.q.linear.weight").rfind("float32 (8, 8) ", 0) == 0);
  CHECK(f.metadata().count("frozen.head.weight") == 1);
  CHECK(f.metadata().at("optimizer.type") == "Adam");

  {  // another frozen set: head trainable here
    Adapted b = make_adapted();
    b.head.unfreeze();
    Adam o(1e-2);
    refused(tmp("lora.safetensors"), b, o,
            {"frozen 'head.weight': frozen in the file, trainable or absent here",
             "trainable parameters, 2 missing: model.head.weight, model.head.bias"});
  }
  {  // another base: same names and shapes, other values
    Adapted b = make_adapted();
    random::seed(77);
    b.q.linear().weight.value = random::normal({8, 8});
    Adam o(1e-2);
    refused(tmp("lora.safetensors"), b, o, {"frozen 'q.linear.weight': the file's is float32 (8, 8) "});
  }
  {  // another rank, with a fresh optimizer: the adapters and their slots do not fit
    Adapted b = make_adapted(4);
    Adam o(1e-2);
    refused(tmp("lora.safetensors"), b, o,
            {"mismatched: model.q.lora_a (file (8, 2) float32, model (8, 4) float32)",
             "optimizer 'slots.q.lora_a.m': (8, 2) in the file, the parameter is (8, 4)"});
  }
}

TEST_CASE("a LoRA run resumed from its adapter-sized checkpoint is bitwise the straight run") {
  Adapted straight = make_adapted();
  AdamW o1(cosine_decay(1e-2, 6));
  train_steps(straight, o1, 0, 6);

  Adapted first = make_adapted();
  AdamW o2(cosine_decay(1e-2, 6));
  train_steps(first, o2, 0, 3);
  save(tmp("resume.safetensors"), first, o2);

  Adapted second = make_adapted();  // the base comes from its source again, as the finetune's does
  AdamW o3(cosine_decay(1e-2, 6));
  load_into(tmp("resume.safetensors"), second, o3);
  CHECK(o3.step() == 3);
  train_steps(second, o3, 3, 6);
  CHECK(snapshot(second) == snapshot(straight));
}

TEST_CASE("an Adafactor run (factored slots of their own shapes) resumes bitwise, and its hyperparameters are checked") {
  Net straight = make_net(1);
  Adafactor o1 = Adafactor().beta1(0.9);
  train_steps(straight, o1, 0, 6);

  Net first = make_net(1);
  Adafactor o2 = Adafactor().beta1(0.9);
  train_steps(first, o2, 0, 3);
  save(tmp("adafactor.safetensors"), first, o2);

  Net second = make_net(2);
  Adafactor other = Adafactor().beta1(0.9).clip_threshold(0.5);
  refused(tmp("adafactor.safetensors"), second, other,
          {"optimizer clip_threshold: 1 in the file, 0.5 given"});
  Adafactor o3 = Adafactor().beta1(0.9);
  load_into(tmp("adafactor.safetensors"), second, o3);
  CHECK(o3.step() == 3);
  CHECK(o3.slots("l1.weight").at("exp_avg_sq_row").shape() == Shape{6});
  CHECK(o3.slots("l1.weight").at("exp_avg_sq_col").shape() == Shape{4});
  train_steps(second, o3, 3, 6);
  CHECK(snapshot(second) == snapshot(straight));

  // a slot is checked against the shape the optimizer gives it, not its parameter's
  random::seed(3);
  Net wider{Linear(4, 5), Linear(5, 3)};
  Adafactor o4 = Adafactor().beta1(0.9);
  refused(tmp("adafactor.safetensors"), wider, o4,
          {"optimizer 'slots.l1.weight.exp_avg_sq_row': (6) in the file, the parameter is (5, 4) (the slot should be (5))",
           "optimizer 'slots.l1.weight.exp_avg': (6, 4) in the file, the parameter is (5, 4)"});

  // and through a MultiOptimizer, by the member the parameter goes to
  auto matrices = [](const std::string& p) { return p.ends_with("weight"); };
  MultiOptimizer multi = MultiOptimizer(AdamW(1e-2)).group(matrices, Adafactor());
  Net third = make_net(1);
  train_steps(third, multi, 0, 2);
  save(tmp("adafactor_multi.safetensors"), third, multi);
  Net fourth = make_net(2);
  MultiOptimizer same = MultiOptimizer(AdamW(1e-2)).group(matrices, Adafactor());
  load_into(tmp("adafactor_multi.safetensors"), fourth, same);
  CHECK(snapshot(fourth) == snapshot(third));
}

TEST_CASE("MultiOptimizer's members are checked one by one") {
  Net a = make_net(1);
  auto first_layer = [](const std::string& p) { return p.rfind("l1.", 0) == 0; };
  MultiOptimizer run = MultiOptimizer(Sgd(1e-2)).group(first_layer, Adam(1e-3));
  train_steps(a, run, 0, 1);
  save(tmp("multi.safetensors"), a, run);
  Net b = make_net(2);
  MultiOptimizer other = MultiOptimizer(Sgd(1e-2)).group(first_layer, Lion(1e-3));
  refused(tmp("multi.safetensors"), b, other, {"optimizer 0.type: Adam in the file, Lion given"});
  MultiOptimizer same = MultiOptimizer(Sgd(1e-2)).group(first_layer, Adam(1e-3));
  load_into(tmp("multi.safetensors"), b, same);
  CHECK(snapshot(b) == snapshot(a));
}

TEST_CASE("a version-1 checkpoint (the whole model, no run metadata) still loads") {
  Net a = make_net(1);
  Adam run(1e-3);
  train_steps(a, run, 0, 2);
  NamedTensors v1;
  for (auto& [p, t] : a.parameters()) v1.emplace_back("model." + p, t);
  for (auto& [p, t] : run.state()) v1.emplace_back("optimizer." + p, t);
  v1.emplace_back("rng.key", random::state());
  save_safetensors(tmp("v1.safetensors"), v1, {{"format", "nn-checkpoint"}});
  Net b = make_net(2);
  Adam same(1e-3);
  load_into(tmp("v1.safetensors"), b, same);
  CHECK(snapshot(b) == snapshot(a));
  CHECK(same.step() == 2);

  SUBCASE("its optimizer-state errors name the file, and nothing is loaded") {
    NamedTensors bad;
    for (auto& [n, t] : v1)  // a step count of two elements
      bad.emplace_back(n, n == "optimizer.step" ? Tensor::zeros({2}, t.dtype()) : t);
    save_safetensors(tmp("v1_bad.safetensors"), bad, {{"format", "nn-checkpoint"}});
    Net c = make_net(3);
    const auto before = snapshot(c);
    Adam fresh(1e-3);
    test::check_error([&] { load_into(tmp("v1_bad.safetensors"), c, fresh); },
                      {"[load_into]", "v1_bad.safetensors: optimizer state: ", "'step' must hold one element", "(nothing was loaded)"});
    CHECK(snapshot(c) == before);
    CHECK(fresh.step() == 0);
  }
}

}  // namespace io_checkpoint
