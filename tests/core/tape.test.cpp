// SPDX-License-Identifier: MIT OR Apache-2.0
// The tape: leaves, accumulation of gradients on fan-out, replay, errors.
#include "support/check.hpp"

using namespace nn;

TEST_CASE("a variable used three times accumulates three contributions") {
  GTape<cpu> tp;
  Tensor X = Tensor::from<double>({2}, {1.5, -2.0});
  GVar x = tp.param(X);
  // y = x*x + x  summed  ->  dy/dx = 2x + 1  (x appears three times)
  GVar y = sum(tp, add(tp, mul(tp, x, x), x));
  tp.backward(y);
  const Tensor& g = tp.grad(x);
  CHECK(g.data<double>()[0] == doctest::Approx(4.0));
  CHECK(g.data<double>()[1] == doctest::Approx(-3.0));
}

TEST_CASE("gradcheck through a small composite") {
  Tensor a = test::random_tensor({3, 4}, DType::f64, 1);
  Tensor b = test::random_tensor({4}, DType::f64, 2);
  double worst = test::gradcheck("tanh(a*b) softmax", {a, b}, [](GTape<cpu>& tp, const std::vector<GVar>& v) {
    return sum(tp, mul(tp, softmax(tp, tanh(tp, mul(tp, v[0], v[1]))), v[0]));
  });
  CHECK(worst < 1e-7);
}

TEST_CASE("replay re-reads params and set() inputs without re-recording") {
  GTape<cpu> tp;
  Tensor W = Tensor::from<double>({2, 2}, {1, 2, 3, 4});
  Tensor X = Tensor::from<double>({1, 2}, {1, 1});
  GVar w = tp.param(W);
  GVar x = tp.input(X);
  GVar l = sum(tp, matmul(tp, x, w));
  tp.backward(l);
  CHECK(tp.value(l).item() == 10.0);
  const std::size_t nodes = tp.size();
  W.data<double>()[0] = 11;  // in place, as an optimizer updates
  tp.set(x, Tensor::from<double>({1, 2}, {2, 0}));
  tp.replay();
  CHECK(tp.size() == nodes);
  CHECK(tp.value(l).item() == 2 * (11 + 2));
  CHECK(tp.grad(w).data<double>()[0] == 2.0);
  test::check_error([&] { tp.set(x, Tensor::from<double>({2}, {1, 1})); }, {"tape.set", "(1, 2)", "(2)"});
}

TEST_CASE("a value() reference stays valid while more ops are recorded") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::from<double>({2}, {1.0, 2.0}));
  const Tensor& first = tp.value(exp(tp, x));
  for (int i = 0; i < 1000; ++i) x = add_scalar(tp, x, 1.0);  // grows the tape well past any block
  CHECK(first.item(1) == doctest::Approx(std::exp(2.0)));
}
