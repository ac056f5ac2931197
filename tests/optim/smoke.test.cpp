// SPDX-License-Identifier: MIT OR Apache-2.0
// Optimizer API smoke test: every optimizer steps a tiny model and lowers its loss.
#include "support/check.hpp"

namespace optim_smoke {  // one unity source with the other optim files: its names stay its own

using namespace nn;

namespace {
struct Tiny {
  Param w;
  Param b;
  NN_MODULE(Tiny, w, b)
};
double loss_of(Tiny& m, Tiny* grads) {
  Tensor X = Tensor::from<double>({3, 2}, {1, 2, -1, 0.5, 0.3, -2});
  auto f = [&](GTape<cpu>& tp, const Tiny& t) {
    GVar y = add(tp, matmul(tp, tp.constant(X), nn::param(tp, t.w), false, true), nn::param(tp, t.b));
    return mean(tp, mul(tp, y, y));
  };
  auto [l, g] = value_and_grad(m, f);
  if (grads) *grads = g;
  return l.item();
}
template <class Opt>
void descends(Opt opt, const char* name) {
  Tiny m{Param(Tensor::from<double>({2, 2}, {0.5, -0.3, 0.8, 0.1})), Param(Tensor::from<double>({2}, {0.2, -0.1}))};
  double first = 0, last = 0;
  for (int i = 0; i < 30; ++i) {
    Tiny g;
    last = loss_of(m, &g);
    if (i == 0) first = last;
    opt.update(m, g);
  }
  CHECK_MESSAGE(last < first, name << ": " << first << " -> " << last);
  CHECK(opt.step() == 30);
}
}  // namespace

TEST_CASE("every optimizer lowers a convex loss") {
  descends(Sgd(0.1), "sgd");
  descends(Sgd(0.1).momentum(0.9).nesterov(), "sgd nesterov");
  descends(Adam(0.05), "adam");
  descends(AdamW(0.05).bias_correction(), "adamw");
  descends(Lion(0.01), "lion");
  descends(Muon(0.05), "muon");
  descends(Adafactor(), "adafactor");
  descends(Adafactor(0.05).relative_step(false).beta1(0.9), "adafactor beta1");
  descends(MultiOptimizer(Sgd(0.1)).group([](const std::string& p) { return p == "w"; }, Adam(0.05)), "multi");
  descends(Adam(cosine_decay(0.05, 30)), "adam cosine");
}

TEST_CASE("state is a tree keyed by path") {
  Tiny m{Param(Tensor::ones({2, 2}, DType::f64)), Param(Tensor::ones({2}, DType::f64))};
  Adam opt(1e-2);
  opt.init(m);
  std::vector<std::string> names;
  for (auto& [n, t] : opt.state()) names.push_back(n);
  CHECK(names == std::vector<std::string>{"step", "learning_rate", "slots.b.m", "slots.b.v", "slots.w.m", "slots.w.v"});
  test::check_error([&] { Sgd(0.1).nesterov(); }, {"[sgd]", "Nesterov"});
}

TEST_CASE("a copied optimizer owns its state; MultiOptimizer reports its first member's rate") {
  Tiny m{Param(Tensor::ones({2, 2}, DType::f64)), Param(Tensor::ones({2}, DType::f64))};
  Adam a(1e-2);
  a.init(m);
  Adam b = a;
  Tiny g;
  loss_of(m, &g);
  a.update(m, g);
  CHECK(a.step() == 1);
  CHECK(b.step() == 0);
  for (auto& [name, t] : b.state())
    if (name.rfind("slots.", 0) == 0) CHECK(t.to_doubles() == std::vector<double>(static_cast<std::size_t>(t.numel()), 0.0));
  MultiOptimizer mo = MultiOptimizer(Sgd(0.5)).group([](const std::string& p) { return p == "w"; }, Adam(1e-3));
  CHECK(mo.learning_rate() == 1e-3);
  mo.set_learning_rate(0.25);
  CHECK(mo.learning_rate() == 0.25);
}

}  // namespace optim_smoke
