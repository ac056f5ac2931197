// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::compile: a replayed step equals the eager step bit for bit, and re-records exactly when
// an input shape, the train/eval mode, the frozen set or a hyperparameter changes.
#include "support/check.hpp"

namespace modules_compile {  // one unity source with the other modules files: its names stay its own

using namespace nn;

namespace {

struct Mlp {
  Param w1, b1, w2, b2;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar h = tanh(tp, add(tp, matmul(tp, x, nn::param(tp, w1), false, true), nn::param(tp, b1)));
    return add(tp, matmul(tp, h, nn::param(tp, w2), false, true), nn::param(tp, b2));
  }
  NN_MODULE(Mlp, w1, b1, w2, b2)
};

Mlp make(DType dt) {
  return Mlp{test::random_tensor({8, 4}, dt, 1), test::random_tensor({8}, dt, 2), test::random_tensor({3, 8}, dt, 3),
             test::random_tensor({3}, dt, 4)};
}

// mean squared error with a dropout-free MLP; a dropout variant comes with the Dropout module
template <class B>
GVar mse(GTape<B>& tp, const Mlp& m, GVar x, GVar y) {
  GVar d = sub(tp, m(tp, x), y);
  return mean(tp, mul(tp, d, d));
}

}  // namespace

TEST_CASE_TEMPLATE("replayed steps equal eager steps bit for bit", T, float, double) {
  const DType dt = detail::dtype_of<T>();
  Mlp eager = make(dt), compiled = make(dt);
  AdamW opt_e(1e-2), opt_c(1e-2);
  opt_e.bias_correction();
  opt_c.bias_correction();
  auto step = compile<2>(compiled, opt_c, [](GTape<cpu>& tp, const Mlp& m, GVar x, GVar y) { return mse(tp, m, x, y); });
  for (int i = 0; i < 12; ++i) {
    Tensor x = test::random_tensor({5, 4}, dt, 100 + static_cast<std::uint64_t>(i));
    Tensor y = test::random_tensor({5, 3}, dt, 200 + static_cast<std::uint64_t>(i));
    auto [loss_e, grads] = value_and_grad(eager, [&](GTape<cpu>& tp, const Mlp& m) {
      return mse(tp, m, tp.constant(x), tp.constant(y));
    });
    opt_e.update(eager, grads);
    Tensor loss_c = step(x, y);
    CHECK(loss_c.item() == loss_e.item());  // bitwise
  }
  CHECK(step.recordings() == 1);
  CHECK(test::flat_values(eager) == test::flat_values(compiled));  // bitwise, every parameter
}

TEST_CASE("a compiled step re-records once on a shape, mode, freeze or hyperparameter change") {
  Mlp m = make(DType::f64);
  Adam opt(1e-3);
  auto step = compile<2>(m, opt, [](GTape<cpu>& tp, const Mlp& mm, GVar x, GVar y) { return mse(tp, mm, x, y); });
  Tensor x = test::random_tensor({5, 4}, DType::f64, 1), y = test::random_tensor({5, 3}, DType::f64, 2);
  step(x, y);
  step(x, y);
  CHECK(step.recordings() == 1);
  opt.set_learning_rate(1e-2);  // a tensor: no re-record
  step(x, y);
  CHECK(step.recordings() == 1);
  CHECK(opt.step() == 3);
  Tensor x2 = test::random_tensor({7, 4}, DType::f64, 3), y2 = test::random_tensor({7, 3}, DType::f64, 4);
  step(x2, y2);  // new batch shape
  step(x2, y2);
  CHECK(step.recordings() == 2);
  m.train(false);
  step(x2, y2);
  step(x2, y2);
  CHECK(step.recordings() == 3);
  m.freeze([](const std::string& p) { return p == "w1"; });
  Tensor w1_before = m.w1.value.clone();
  step(x2, y2);
  step(x2, y2);
  CHECK(step.recordings() == 4);
  CHECK(test::rel_err(m.w1.value, w1_before) == 0.0);  // frozen: untouched
  opt.betas(0.8, 0.99);
  step(x2, y2);
  CHECK(step.recordings() == 5);
}

}  // namespace modules_compile
