// SPDX-License-Identifier: MIT OR Apache-2.0
// Replay (tape.hpp) against eager recording: a tape built from every primitive, replayed after
// its params changed in place and its inputs were set() to a new batch, must give bitwise the
// values and gradients of a tape freshly recorded on the new data. In float32 and float64.
#include <cstring>

#include "support/check.hpp"

namespace core_replay {  // one unity source with the other core files: its names stay its own

using namespace nn;

namespace {

/// The data of one step: params (bound by reference) and a batch (input slots).
struct Data {
  Tensor W, Bias, Table, Gate;       // params
  Tensor X, Ids, Mask, Targets;      // batch: float input, i64 ids, u8 mask, i32 targets
};

Data make_data(DType dt, std::uint64_t seed) {
  Data d;
  d.W = test::random_tensor({5, 6}, dt, seed + 1);
  d.Bias = test::random_tensor({5}, dt, seed + 2);
  d.Table = test::random_tensor({7, 5}, dt, seed + 3);
  d.Gate = test::random_tensor({2, 5}, dt, seed + 4, 0.5, 1.5);
  d.X = test::random_tensor({2, 3, 6}, dt, seed + 5);
  std::mt19937_64 rng(seed);
  std::vector<std::int64_t> ids(6);
  for (auto& i : ids) i = static_cast<std::int64_t>(rng() % 7);
  d.Ids = Tensor::from<std::int64_t>({2, 3}, ids);
  std::vector<std::uint8_t> mask(5);
  for (auto& m : mask) m = static_cast<std::uint8_t>(rng() % 2);
  d.Mask = Tensor::from<std::uint8_t>({5}, mask);
  d.Targets = Tensor::from<std::int32_t>({2, 3}, {static_cast<std::int32_t>(rng() % 5), -1, 0, 4,
                                                   static_cast<std::int32_t>(rng() % 5), 2});
  return d;
}

struct Slots {
  GVar x, ids, mask, targets;
  GVar loss;
};

/// One step touching every primitive. Shapes: x (2, 3, 6), W (5, 6), h (2, 3, 5).
Slots record(GTape<cpu>& tp, Data& d) {
  Slots s;
  s.x = tp.input(d.X, true);
  s.ids = tp.input(d.Ids);
  s.mask = tp.input(d.Mask);
  s.targets = tp.input(d.Targets);
  GVar w = tp.param(d.W), bias = tp.param(d.Bias), table = tp.param(d.Table), gate = tp.param(d.Gate);

  GVar h = add(tp, matmul(tp, s.x, w, false, true), bias);                  // shared x @ W^T + b
  h = add(tp, h, gather_rows(tp, table, s.ids));                            // (2, 3, 5)
  GVar a = mul(tp, tanh(tp, h), sigmoid(tp, h));
  a = sub(tp, a, div(tp, relu(tp, h), add_scalar(tp, abs(tp, h), 1.0)));
  a = add(tp, a, scale(tp, unary(tp, Unary::silu, h), 0.5));
  a = add(tp, a, unary(tp, Unary::gelu, h));
  a = add(tp, a, unary(tp, Unary::gelu_approx, neg(tp, h)));
  a = add(tp, a, unary(tp, Unary::gelu_fast, h));
  GVar pos = add_scalar(tp, pow(tp, h, 2.0), 0.5);                          // > 0
  a = add(tp, a, mul(tp, log(tp, pos), sqrt(tp, pos)));
  a = add(tp, a, mul(tp, rsqrt(tp, pos), exp(tp, scale(tp, h, 0.1))));
  a = maximum(tp, a, minimum(tp, h, stop_gradient(tp, a)));
  a = where(tp, s.mask, a, mul(tp, h, reshape(tp, slice(tp, gate, 0, 0, 1), {5})));
  GVar p = softmax(tp, a);                                                  // (2, 3, 5)
  GVar lp = log_softmax(tp, h);
  GVar ce = mean(tp, neg(tp, pick(tp, lp, s.targets)));                    // cross entropy by hand
  GVar t = transpose(tp, p);                                               // (2, 5, 3)
  GVar pp = permute(tp, t, {0, 2, 1});                                     // back to (2, 3, 5)
  GVar g = matmul(tp, pp, broadcast_to(tp, gate, Shape{2, 2, 5}), false, true);  // (2,3,5)@(2,5,2)
  GVar c = concat(tp, {g, slice(tp, pp, -1, 1, 3)}, -1);                    // (2, 3, 4)
  GVar m = max(tp, c, 1);                                                  // (2, 4)
  GVar total = add(tp, sum(tp, m), add(tp, ce, sum(tp, mean(tp, c, {0, 2}, true))));
  s.loss = total;
  tp.backward(total);
  return s;
}

bool same_bits(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

/// Every node's value, and every gradient, bitwise equal between two tapes of the same recording.
void check_tapes_equal(GTape<cpu>& a, GTape<cpu>& b) {
  REQUIRE(a.size() == b.size());
  int values = 0, grads = 0;
  for (std::int32_t i = 0; i < static_cast<std::int32_t>(a.size()); ++i) {
    GVar va{&a, i}, vb{&b, i};
    CAPTURE(i);
    CHECK(same_bits(a.value(va), b.value(vb)));
    ++values;
    REQUIRE(a.requires_grad(va) == b.requires_grad(vb));
    if (a.requires_grad(va)) {
      CHECK(same_bits(a.grad(va), b.grad(vb)));
      ++grads;
    }
  }
  MESSAGE("replay == eager: " << values << " node values and " << grads << " gradients bitwise equal");
}

void replay_matches_eager(DType dt) {
  Data d = make_data(dt, 100);
  GTape<cpu> tp;
  Slots s = record(tp, d);
  const std::size_t nodes = tp.size();
  for (int step = 1; step <= 2; ++step) {
    // new params in place (as an optimizer writes them), a new batch into the input slots
    Data next = make_data(dt, 100 + 10 * static_cast<std::uint64_t>(step));
    for (Tensor* p : {&d.W, &d.Bias, &d.Table, &d.Gate}) {
      const Tensor& src = p == &d.W ? next.W : p == &d.Bias ? next.Bias : p == &d.Table ? next.Table : next.Gate;
      std::memcpy(p->raw(), src.raw(), p->nbytes());
    }
    tp.set(s.x, next.X);
    tp.set(s.ids, next.Ids);
    tp.set(s.mask, next.Mask);
    tp.set(s.targets, next.Targets);
    tp.replay();
    CHECK(tp.size() == nodes);

    GTape<cpu> eager;
    Data fresh = d;  // the same param tensors' values (copies share storage: bound by address below)
    fresh.X = next.X;
    fresh.Ids = next.Ids;
    fresh.Mask = next.Mask;
    fresh.Targets = next.Targets;
    record(eager, fresh);
    CAPTURE(step);
    check_tapes_equal(tp, eager);
  }
}

}  // namespace

TEST_CASE("replay of a tape of every primitive is bitwise the eager recording: float64") {
  replay_matches_eager(DType::f64);
}
TEST_CASE("replay of a tape of every primitive is bitwise the eager recording: float32") {
  replay_matches_eager(DType::f32);
}

TEST_CASE("replay really recomputes: a changed param changes the loss and its gradient") {
  Data d = make_data(DType::f64, 7);
  GTape<cpu> tp;
  Slots s = record(tp, d);
  const double loss0 = tp.value(s.loss).item();
  const std::vector<double> gw0 = tp.grad(GVar{&tp, 4}).to_doubles();  // node 4: param W
  d.W.data<double>()[0] += 0.5;
  tp.replay();
  CHECK(tp.value(s.loss).item() != loss0);
  CHECK(tp.grad(GVar{&tp, 4}).to_doubles() != gw0);
}

}  // namespace core_replay
