// SPDX-License-Identifier: MIT OR Apache-2.0
// Configuration is structure: a compiled step records again, exactly once, after any change of a
// module's NN_STATIC configuration, its tree (map_modules, a reassigned Param) or an optimizer's
// hyperparameters, and then equals the eager step bit for bit; with no change it never records
// again. Also: dropout masks and clip_grad_norm inside a compiled step equal the eager ones.
#include <variant>

#include "support/check.hpp"

namespace modules_structure {  // one unity source with the other modules files: its names stay its own

using namespace nn;

namespace {

// x: (B, T, C) -> (B, T, C)
struct Net {
  RmsNorm norm;
  std::variant<Linear, LoraLinear> proj;
  Dropout drop{0.0};
  Rope rope;

  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar h = norm(tp, x);
    h = std::visit([&](const auto& l) { return l(tp, h); }, proj);
    return rope(tp, drop(tp, h));
  }
  NN_MODULE(Net, norm, proj, drop, rope)
};

constexpr std::int64_t C = 8;

Net make_net() {
  random::seed(7);
  Net n{RmsNorm(C), Linear(C, C), Dropout(0.0), Rope(C)};
  n.to(DType::f64);
  return n;
}

// mean((net(x) - y)^2)
template <class B>
GVar mse(GTape<B>& tp, const Net& m, GVar x, GVar y) {
  GVar d = sub(tp, m(tp, x), y);
  return mean(tp, mul(tp, d, d));
}

// One eager step and one compiled step from the same random state; their losses and every
// parameter afterwards must be equal bit for bit.
template <class Step>
void both_steps(Net& eager, Optimizer& opt_e, Step& step, const Net& compiled, std::uint64_t seed, double clip = -1) {
  Tensor x = test::random_tensor({2, 3, C}, DType::f64, seed);
  Tensor y = test::random_tensor({2, 3, C}, DType::f64, seed + 1000);
  random::seed(seed);
  auto [loss_e, grads] = value_and_grad(eager, [&](GTape<cpu>& tp, const Net& m) {
    return mse(tp, m, tp.constant(x), tp.constant(y));
  });
  if (clip >= 0) {
    auto [clipped, norm] = clip_grad_norm(grads, clip);
    opt_e.update(eager, clipped);
    random::seed(seed);
    Tensor loss_c = step(x, y);
    CHECK(loss_c.item() == loss_e.item());
    CHECK(step.grad_norm() == norm);
  } else {
    opt_e.update(eager, grads);
    random::seed(seed);
    Tensor loss_c = step(x, y);
    CHECK(loss_c.item() == loss_e.item());
  }
  CHECK(test::flat_values(eager) == test::flat_values(compiled));
}

auto loss_fn = [](GTape<cpu>& tp, const Net& m, GVar x, GVar y) { return mse(tp, m, x, y); };

// An optimizer's describe() by field name.
std::map<std::string, std::string> described(const Optimizer& o) {
  const auto d = o.describe();
  return {d.begin(), d.end()};
}

// sum(dropout(x) * w)
struct Probe {
  Param w;
  Dropout drop{0.5};
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return sum(tp, mul(tp, drop(tp, x), nn::param(tp, w)));
  }
  NN_MODULE(Probe, w, drop)
};

}  // namespace

TEST_CASE("every kind of change records the step again, exactly once, and it still equals eager") {
  Net e = make_net(), c = clone(e);
  AdamW opt_e(1e-2), opt_c(1e-2);
  auto step = compile<2>(c, opt_c, loss_fn);
  std::uint64_t seed = 1;
  int expected = 1;
  // Applies `change` to both models and both optimizers, then checks two steps: one recording.
  auto after = [&](const char* what, auto change) {
    INFO(what);
    change(e, opt_e);
    change(c, opt_c);
    both_steps(e, opt_e, step, c, ++seed);
    both_steps(e, opt_e, step, c, ++seed);
    CHECK(step.recordings() == ++expected);
  };
  both_steps(e, opt_e, step, c, seed);
  both_steps(e, opt_e, step, c, ++seed);
  CHECK(step.recordings() == 1);

  after("map_modules replaces the Linear with a LoraLinear", [](Net& n, AdamW<>&) {
    random::seed(99);
    n.map_modules<Linear>([](const std::string& p) { return p == "proj"; },
                          [](const std::string&, const Linear& l) { return LoraLinear::from_base(l, 2).scale(1.0); });
    // lora_b starts at zero: give it values so the scale matters
    std::get<LoraLinear>(n.proj).lora_b.value = test::random_tensor({2, C}, DType::f64, 5);
  });
  after("LoRA scale", [](Net& n, AdamW<>&) { std::get<LoraLinear>(n.proj).scale(100.0); });
  after("LoRA rslora", [](Net& n, AdamW<>&) { std::get<LoraLinear>(n.proj).rslora(); });
  after("dropout p", [](Net& n, AdamW<>&) { n.drop = Dropout(0.5); });
  after("RMSNorm eps", [](Net& n, AdamW<>&) { n.norm.eps(0.5); });
  after("RoPE base", [](Net& n, AdamW<>&) { n.rope.base(100.0); });
  after("RoPE traditional", [](Net& n, AdamW<>&) { n.rope.traditional(); });
  after("Adam betas", [](Net&, AdamW<>& o) { o.betas(0.5, 0.9); });
  after("AdamW weight decay", [](Net&, AdamW<>& o) { o.weight_decay(0.3); });
  after("a Param given a new tensor", [](Net& n, AdamW<>&) { n.norm.weight.value = Tensor::full({C}, 2.0, DType::f64); });
  after("a frozen parameter", [](Net& n, AdamW<>&) { n.freeze([](const std::string& p) { return p == "norm.weight"; }); });
  after("evaluation mode", [](Net& n, AdamW<>&) { n.train(false); });
}

TEST_CASE("Sgd's momentum and weight decay record the step again") {
  Net e = make_net(), c = clone(e);
  Sgd opt_e(1e-2), opt_c(1e-2);
  auto step = compile<2>(c, opt_c, loss_fn);
  both_steps(e, opt_e, step, c, 1);
  opt_e.momentum(0.9);
  opt_c.momentum(0.9);
  both_steps(e, opt_e, step, c, 2);
  both_steps(e, opt_e, step, c, 3);
  CHECK(step.recordings() == 2);
  opt_e.weight_decay(0.1);
  opt_c.weight_decay(0.1);
  both_steps(e, opt_e, step, c, 4);
  CHECK(step.recordings() == 3);
}

TEST_CASE("Adafactor in a compiled step equals eager, and its hyperparameters record the step again") {
  Net e = make_net(), c = clone(e);
  Adafactor opt_e = Adafactor().beta1(0.9), opt_c = Adafactor().beta1(0.9);
  auto step = compile<2>(c, opt_c, loss_fn);
  std::uint64_t seed = 0;
  int expected = 0;
  auto after = [&](auto change) {  // to both optimizers; then one recording for two steps
    change(opt_e);
    change(opt_c);
    for (int i = 0; i < 2; ++i) both_steps(e, opt_e, step, c, ++seed);
    CHECK(step.recordings() == ++expected);
  };
  after([](Adafactor<>&) {});
  after([](Adafactor<>& o) { o.clip_threshold(0.01); });
  after([](Adafactor<>& o) { o.relative_step(false).decay_rate(-0.5).set_learning_rate(1e-2); });
}

TEST_CASE("no change, no recording, over 100 steps (with dropout on)") {
  Net e = make_net(), c = clone(e);
  e.drop = Dropout(0.25);
  c.drop = Dropout(0.25);
  AdamW opt_e(1e-3), opt_c(1e-3);
  auto step = compile<2>(c, opt_c, loss_fn);
  for (std::uint64_t i = 0; i < 100; ++i) both_steps(e, opt_e, step, c, 10 + i);
  CHECK(step.recordings() == 1);
}

TEST_CASE("a compiled step draws a fresh dropout mask each call, the eager run's") {
  // loss = sum(dropout(x) * w) with Sgd(lr 1) and w = 0: after one step w = -mask * x / (1 - p),
  // so the parameter reads out the mask.
  Probe e{Param(Tensor::zeros({64}, DType::f64))}, c{Param(Tensor::zeros({64}, DType::f64))};
  Sgd opt_e(1.0), opt_c(1.0);
  auto step = compile<1>(c, opt_c, [](GTape<cpu>& tp, const Probe& m, GVar x) { return m(tp, x); });
  Tensor x = Tensor::full({64}, 1.0, DType::f64);
  random::seed(3);  // one sequence for both runs, as a program would have
  std::vector<std::vector<double>> masks_e, masks_c;
  Tensor key = random::state();
  for (int i = 0; i < 4; ++i) {
    const std::vector<double> before = e.w.value.to_doubles();
    auto [l, g] = value_and_grad(e, [&](GTape<cpu>& tp, const Probe& m) { return m(tp, tp.constant(x)); });
    opt_e.update(e, g);
    std::vector<double> d = e.w.value.to_doubles();
    for (std::size_t k = 0; k < d.size(); ++k) d[k] = before[k] - d[k];
    masks_e.push_back(d);
  }
  random::set_state(key);
  for (int i = 0; i < 4; ++i) {
    const std::vector<double> before = c.w.value.to_doubles();
    step(x);
    std::vector<double> d = c.w.value.to_doubles();
    for (std::size_t k = 0; k < d.size(); ++k) d[k] = before[k] - d[k];
    masks_c.push_back(d);
  }
  CHECK(step.recordings() == 1);
  CHECK(masks_c == masks_e);
  for (int i = 1; i < 4; ++i) CHECK(masks_c[i] != masks_c[0]);  // fresh each call
  for (double v : masks_c[0]) CHECK((v == 0.0 || v == 2.0));    // x / (1 - p) where kept
}

TEST_CASE("clip_grad_norm inside a compiled step equals the eager clip bit for bit") {
  Net e = make_net(), c = clone(e);
  AdamW opt_e(1e-2), opt_c(1e-2);
  auto step = compile<2>(c, opt_c, loss_fn);
  step.clip_grad_norm(0.05);
  for (std::uint64_t i = 0; i < 5; ++i) both_steps(e, opt_e, step, c, 20 + i, 0.05);
  CHECK(step.grad_norm() > 0.05);  // the clip was active
  step.clip_grad_norm(1e9);        // a bound that never binds: the norm is still reported
  both_steps(e, opt_e, step, c, 40, 1e9);
  CHECK(step.recordings() == 1);  // clipping is not structure
}

TEST_CASE("the structure hash sees configuration, storage and the frozen set") {
  Net n = make_net();
  const std::uint64_t h0 = detail::structure_hash(n);
  CHECK(detail::structure_hash(n) == h0);
  n.norm.eps(1e-3);
  CHECK(detail::structure_hash(n) != h0);
  n.norm.eps(1e-5);
  CHECK(detail::structure_hash(n) == h0);
  n.rope.scale(2.0);
  CHECK(detail::structure_hash(n) != h0);
}

TEST_CASE("an optimizer's hyperparameters come from NN_OPTIMIZER, with its type") {
  AdamW a(1e-3);
  const auto m = described(a);
  CHECK(m.at("type") == "AdamW");
  CHECK(m.at("b1") == "0.90000000000000002");
  CHECK(m.at("wd") == "0.01");
  CHECK(m.at("bias_correction") == "false");
  CHECK(m.at("learning_rate") == "0.001");
  Adam plain(1e-3);
  CHECK(plain.hyper_hash() != a.hyper_hash());  // the type is part of it
  const std::uint64_t h = a.hyper_hash();
  a.set_learning_rate(0.5);  // a tensor: not a hyperparameter of the hash
  CHECK(a.hyper_hash() == h);
  a.eps(1e-6);
  CHECK(a.hyper_hash() != h);
  Sgd s(cosine_decay(1e-2, 100));
  const auto ms = described(s);
  CHECK(ms.at("schedule") == "cosine_decay(init=0.01, decay_steps=100, end=0)");
  CHECK(ms.at("momentum") == "0");
  CHECK(ms.count("learning_rate") == 0);
  MultiOptimizer multi = MultiOptimizer(Sgd(0.1)).group([](const std::string&) { return true; }, Lion(1e-4));
  const auto mm = described(multi);
  CHECK(mm.at("type") == "MultiOptimizer");
  CHECK(mm.at("0.type") == "Lion");
  CHECK(mm.at("1.type") == "Sgd");
  CHECK(mm.at("0.learning_rate") == "0.0001");
  Adafactor af;
  const auto ma = described(af);
  CHECK(ma.at("type") == "Adafactor");
  CHECK(ma.at("eps1") == "1.0000000000000001e-30");
  CHECK(ma.at("decay_rate") == "-0.80000000000000004");
  CHECK(ma.at("use_beta1") == "false");
  CHECK(ma.at("relative_step") == "true");
  const std::uint64_t ha = af.hyper_hash();
  af.warmup_init();
  CHECK(af.hyper_hash() != ha);
}

}  // namespace modules_structure
