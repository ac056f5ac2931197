// SPDX-License-Identifier: MIT OR Apache-2.0
// The optimizer state tree: init up front, use through the base class, set_learning_rate, the
// state()/load_state round trip, strict loading that leaves the optimizer unchanged on error,
// and slots kept across freeze/unfreeze.
#include <memory>

#include "optim/net.hpp"

namespace optim_state {  // one unity source with the other optim files: its names stay its own

using namespace nn;
using namespace nn::test::optim;
using nn::test::check_error;
using nn::test::rel_err;

namespace {

Net small_net(DType dt = DType::f64) {
  auto r = [&](Shape s, std::uint64_t seed) { return Param(nn::test::random_tensor(s, dt, seed, -0.5, 0.5)); };
  return Net{Lin{r({8, 4}, 1), r({8}, 2)}, Lin{r({3, 8}, 3), r({3}, 4)}, r({3, 2, 4}, 5)};
}
Data small_data(DType dt = DType::f64) {
  return Data{nn::test::random_tensor({6, 4}, dt, 6, -1, 1), nn::test::random_tensor({6, 3}, dt, 7, -1, 1),
              nn::test::random_tensor({6, 6}, dt, 8, -0.8, 0.8)};
}
void train(Net& m, Optimizer& opt, const Data& d, int steps) {
  for (int i = 0; i < steps; ++i) {
    auto [loss, g] = loss_and_grads(m, d);
    opt.update(m, g);
  }
}
std::vector<std::string> names(const Optimizer& opt) {
  std::vector<std::string> out;
  for (auto& [n, t] : opt.state()) out.push_back(n);
  return out;
}
/// A deep copy of a state (state() shares its tensors with the optimizer).
std::vector<std::pair<std::string, Tensor>> snapshot(const Optimizer& opt) {
  std::vector<std::pair<std::string, Tensor>> out;
  for (auto& [n, t] : opt.state()) out.emplace_back(n, t.clone());
  return out;
}
void same_state(const Optimizer& opt, const std::vector<std::pair<std::string, Tensor>>& want) {
  auto got = opt.state();
  REQUIRE(got.size() == want.size());
  for (std::size_t i = 0; i < got.size(); ++i) {
    CHECK(got[i].first == want[i].first);
    CHECK(got[i].second.shape() == want[i].second.shape());
    CHECK_MESSAGE(rel_err(got[i].second, want[i].second) == 0, got[i].first << " changed");
  }
}
/// A deep copy of a model (copying a Net shares its tensors).
Net deep_copy(const Net& m) {
  Net out = m;
  detail::for_each(out, [](const std::string&, Param& p) { p.value = p.value.clone(); });
  return out;
}
bool same_values(const Net& a, const Net& b) {
  auto pa = a.parameters(), pb = b.parameters();
  for (std::size_t i = 0; i < pa.size(); ++i)
    if (rel_err(pa[i].second, pb[i].second) != 0) return false;
  return true;
}

}  // namespace

TEST_CASE("init creates the whole state tree up front, trainable parameters only") {
  Net m = small_net();
  std::unique_ptr<Optimizer> opt = std::make_unique<Adam<>>(1e-2);
  CHECK(names(*opt) == std::vector<std::string>{"step", "learning_rate"});
  m.l2.freeze();
  opt->init(m);
  CHECK(names(*opt) == std::vector<std::string>{"step", "learning_rate", "slots.e.m", "slots.e.v", "slots.l1.bias.m",
                                                "slots.l1.bias.v", "slots.l1.weight.m", "slots.l1.weight.v"});
  for (auto& [n, t] : opt->state()) {
    if (n == "step") CHECK(t.item() == 0);
    else if (n == "learning_rate") CHECK(t.item() == 1e-2);
    else CHECK(t.to_doubles() == std::vector<double>(static_cast<std::size_t>(t.numel()), 0.0));
  }
  CHECK(opt->slots("l1.weight").at("m").shape() == Shape{8, 4});
  CHECK(opt->slots("l1.weight").at("m").dtype() == DType::f64);
  CHECK(opt->slots("l2.weight").empty());
  // init again after unfreezing adds the new ones and keeps the old tensors
  const void* kept = opt->slots("e").at("m").raw();
  m.l2.unfreeze();
  opt->init(m);
  CHECK(names(*opt).size() == 2 + 10);
  CHECK(opt->slots("e").at("m").raw() == kept);

  // MultiOptimizer: each member holds the slots of the parameters routed to it
  MultiOptimizer multi = MultiOptimizer(Sgd(0.1)).group([](const std::string& p) { return p.rfind("l1.", 0) == 0; }, Lion(1e-3));
  multi.init(m);
  CHECK(names(multi) == std::vector<std::string>{"0.step", "0.learning_rate", "0.slots.l1.bias.m", "0.slots.l1.weight.m",
                                                 "1.step", "1.learning_rate", "1.slots.e.v", "1.slots.l2.bias.v",
                                                 "1.slots.l2.weight.v"});
}

TEST_CASE("an optimizer is driven through std::unique_ptr<Optimizer> as through its own type") {
  const Data d = small_data();
  Net a = small_net(), b = small_net();
  std::unique_ptr<Optimizer> base = std::make_unique<AdamW<>>(AdamW(1e-2).bias_correction());
  AdamW<> direct = AdamW(1e-2).bias_correction();
  train(a, *base, d, 5);
  train(b, direct, d, 5);
  CHECK(same_values(a, b));
  CHECK(base->step() == 5);
  base.reset();  // virtual destructor: no leak under sanitizers
}

TEST_CASE("set_learning_rate takes effect on the next update") {
  const Data d = small_data();
  Net m = small_net();
  Sgd opt(0.1);
  train(m, opt, d, 2);
  opt.set_learning_rate(0.025);
  CHECK(opt.learning_rate() == 0.025);
  Net before = deep_copy(m);
  auto [loss, g] = loss_and_grads(m, d);
  opt.update(m, g);
  // p1 = p0 - 0.025 g exactly as the kernel computes it
  std::vector<double> p0 = before.l1.weight.value.to_doubles(), gv = g.l1.weight.value.to_doubles(),
                      p1 = m.l1.weight.value.to_doubles();
  for (std::size_t i = 0; i < p0.size(); ++i) CHECK(p1[i] == p0[i] - 0.025 * gv[i]);
  // the state tree holds the rate (a 0-D tensor) and the step
  for (auto& [n, t] : opt.state()) {
    if (n == "learning_rate") CHECK((t.item() == 0.025 && t.rank() == 0));
    if (n == "step") CHECK((t.item() == 3 && t.rank() == 0));
  }
  // With a schedule, each update first writes schedule(step) (as MLX's apply_gradients), so a
  // manually set rate is overwritten before it is used.
  Sgd sched(exponential_decay(0.1, 0.5));
  Net m2 = small_net();
  train(m2, sched, d, 2);
  // schedule(1), the rate of the 2nd update (schedules compute in float32, as MLX's)
  CHECK(sched.learning_rate() == static_cast<double>(0.05f));
  sched.set_learning_rate(1.0);
  train(m2, sched, d, 1);
  CHECK(sched.learning_rate() == static_cast<double>(0.025f));  // schedule(2)

  MultiOptimizer multi = MultiOptimizer(Sgd(0.1)).group([](const std::string&) { return false; }, Adam(0.01));
  multi.set_learning_rate(0.5);
  for (auto& [n, t] : multi.state())
    if (n.find("learning_rate") != std::string::npos) CHECK(t.item() == 0.5);
}

TEST_CASE("state() and load_state round-trip: a resumed run continues bit for bit") {
  const Data d = small_data();
  auto check_resume = [&](auto make, std::string label) {
    CAPTURE(label);
    Net a = small_net();
    auto opt = make();
    train(a, *opt, d, 4);
    // checkpoint: the model's values and a deep copy of the optimizer state
    Net saved = deep_copy(a);
    auto st = snapshot(*opt);
    train(a, *opt, d, 4);

    auto fresh = make();
    fresh->init(saved);
    fresh->load_state(st);
    CHECK(fresh->step() == 4);
    same_state(*fresh, st);
    // load_state copies: changing the loaded-from tensors afterwards does not reach the optimizer
    for (auto& [n, t] : st) cpu::fill(t, 7.0);
    train(saved, *fresh, d, 4);
    CHECK(same_values(saved, a));
    same_state(*fresh, snapshot(*opt));
  };
  check_resume([] { return own(Adam(0.01).bias_correction()); }, "adam");
  check_resume([] { return own(Sgd(0.1).momentum(0.9)); }, "sgd");
  check_resume([] { return own(Lion(1e-3)); }, "lion");
  check_resume([] { return own(Muon(0.02)); }, "muon");
  check_resume([] { return own(Adafactor()); }, "adafactor");
  check_resume([] { return own(Adafactor(0.01).relative_step(false).beta1(0.9).weight_decay(0.01)); }, "adafactor beta1");
  check_resume([] { return own(Adam(cosine_decay(0.01, 6))); }, "adam with a schedule");
  check_resume([] { return own(MultiOptimizer(AdamW(0.01)).group([](const std::string& p) { return p != "l1.bias"; }, Muon(0.02))); },
               "multi");
}

TEST_CASE("a bad state entry raises and leaves the optimizer unchanged") {
  const Data d = small_data();
  Net m = small_net();
  Adam<> opt(0.01);
  train(m, opt, d, 3);
  const auto before = snapshot(opt);
  auto with = [&](auto edit) {
    auto st = snapshot(opt);
    edit(st);
    return st;
  };
  auto drop = [](std::vector<std::pair<std::string, Tensor>>& st, const std::string& name) {
    std::erase_if(st, [&](auto& e) { return e.first == name; });
  };
  auto set = [](std::vector<std::pair<std::string, Tensor>>& st, const std::string& name, Tensor t) {
    for (auto& e : st)
      if (e.first == name) e.second = t;
  };
  // every bad entry is put after the good ones, so a loader that applied entries one by one
  // would already have changed the optimizer when it meets the bad one
  check_error([&] { opt.load_state(with([](auto& st) { st.emplace_back("momentum", Tensor::zeros({}, DType::f64)); })); },
              {"[optimizer]", "unknown state entry 'momentum'"});
  check_error([&] { opt.load_state(with([&](auto& st) { drop(st, "step"); })); }, {"[optimizer]", "step"});
  check_error([&] { opt.load_state(with([&](auto& st) { drop(st, "learning_rate"); })); }, {"[optimizer]", "learning_rate"});
  check_error([&] { opt.load_state(with([&](auto& st) { set(st, "step", Tensor::zeros({2}, DType::i64)); })); },
              {"[optimizer]", "'step'", "one element"});
  check_error([&] { opt.load_state(with([&](auto& st) { set(st, "slots.l1.weight.m", Tensor::zeros({4, 8}, DType::f64)); })); },
              {"[optimizer]", "slots.l1.weight.m", "(4, 8)", "(8, 4)"});
  check_error([&] { opt.load_state(with([&](auto& st) { set(st, "slots.e.v", Tensor::zeros({3, 2, 4}, DType::f32)); })); },
              {"[optimizer]", "slots.e.v", "float32", "float64"});
  check_error([&] { opt.load_state(with([&](auto& st) { drop(st, "slots.l2.bias.v"); })); },
              {"[optimizer]", "slots.l2.bias.v", "missing"});
  check_error([&] { opt.load_state(with([&](auto& st) { st.emplace_back("slots.l2.bias.q", Tensor::zeros({3}, DType::f64)); })); },
              {"[optimizer]", "slots.l2.bias.q"});
  same_state(opt, before);
  CHECK(opt.step() == 3);
  // and it still trains
  train(m, opt, d, 1);
  CHECK(opt.step() == 4);

  // A fresh optimizer (no slots yet) takes the state, and rejects at the next update a slot whose
  // shape is not its parameter's, before touching any memory.
  Adam<> fresh(0.01);
  auto st = snapshot(opt);
  set(st, "slots.l1.weight.m", Tensor::zeros({5}, DType::f64));
  fresh.load_state(st);
  auto [loss, g] = loss_and_grads(m, d);
  check_error([&] { fresh.update(m, g); }, {"[optimizer]", "l1.weight", "(5)", "(8, 4)"});

  // MultiOptimizer: a bad entry for one group leaves every group as it was
  MultiOptimizer multi = MultiOptimizer(Sgd(0.1).momentum(0.9)).group([](const std::string& p) { return p.rfind("l1.", 0) == 0; }, Adam(0.01));
  Net m3 = small_net();
  train(m3, multi, d, 2);
  const auto mb = snapshot(multi);
  auto bad = snapshot(multi);
  bad.emplace_back("1.slots.e.w", Tensor::zeros({3, 2, 4}, DType::f64));
  check_error([&] { multi.load_state(bad); }, {"[optimizer]", "slots.e.w"});
  bad = snapshot(multi);
  bad.emplace_back("7.step", Tensor::zeros({}, DType::i64));
  check_error([&] { multi.load_state(bad); }, {"[optimizer]", "7.step", "no group"});
  same_state(multi, mb);
}

TEST_CASE("Adafactor's factored slots have their own shapes, checked on load and at the update") {
  const Data d = small_data();
  Net m = small_net();
  Adafactor<> opt;
  opt.init(m);
  CHECK(opt.slots("l1.weight").at("exp_avg_sq_row").shape() == Shape{8});
  CHECK(opt.slots("l1.weight").at("exp_avg_sq_col").shape() == Shape{4});
  CHECK(opt.slots("e").at("exp_avg_sq_row").shape() == Shape{3, 2});
  CHECK(opt.slots("e").at("exp_avg_sq_col").shape() == Shape{3, 4});
  CHECK(opt.slots("l1.bias").at("exp_avg_sq").shape() == Shape{8});
  CHECK(opt.slots("l1.bias").size() == 1);
  CHECK(Adafactor().beta1(0.9).hyper_hash() != opt.hyper_hash());
  train(m, opt, d, 2);
  const auto before = snapshot(opt);
  auto st = snapshot(opt);
  for (auto& e : st)
    if (e.first == "slots.l1.weight.exp_avg_sq_row") e.second = Tensor::zeros({8, 4}, DType::f64);
  // held slots: the state entry must have the slot's shape
  check_error([&] { opt.load_state(st); }, {"[optimizer]", "slots.l1.weight.exp_avg_sq_row", "(8, 4)", "(8)"});
  same_state(opt, before);
  // a fresh optimizer takes it, and the update refuses it before changing anything
  Adafactor<> fresh;
  fresh.load_state(st);
  Net kept = deep_copy(m);
  auto [loss, g] = loss_and_grads(m, d);
  check_error([&] { fresh.update(m, g); }, {"[optimizer]", "exp_avg_sq_row", "l1.weight", "(8, 4)", "should be (8)"});
  CHECK(same_values(m, kept));
  CHECK(fresh.step() == 2);
  // MLX raises without a learning rate when the relative step is off; so does nn, changing nothing
  Adafactor<> no_lr = Adafactor().relative_step(false);
  check_error([&] { no_lr.update(m, g); }, {"[optimizer]", "relative_step(false) needs a learning rate"});
  CHECK(no_lr.step() == 0);
  CHECK(no_lr.state().size() == 2);
  no_lr.set_learning_rate(0.01);
  no_lr.update(m, g);
  CHECK(no_lr.step() == 1);
}

}  // namespace optim_state
