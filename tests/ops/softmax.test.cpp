// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/softmax.hpp: softmax and log_softmax over the last axis, including logits in the thousands
// (where a naive exp overflows), checked against tests/fixtures/ops/softmax.json (PyTorch
// float64) in both dtypes, against central differences and for fan-out (golden.hpp); then
// stability, the composite reference, and the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace ops_softmax {  // one unity source with the other ops files: its names stay its own

namespace {

const char* const kFile = "softmax.json";

const test::Cases kCases = {
    {"softmax/matrix", [](Tape& tp, const Vars& v) { return softmax(tp, v[0]); }},
    {"softmax/rank3", [](Tape& tp, const Vars& v) { return softmax(tp, v[0]); }},
    {"softmax/thousands", [](Tape& tp, const Vars& v) { return softmax(tp, v[0]); }},
    {"softmax/one_class", [](Tape& tp, const Vars& v) { return softmax(tp, v[0]); }},
    {"log_softmax/matrix", [](Tape& tp, const Vars& v) { return log_softmax(tp, v[0]); }},
    {"log_softmax/rank3", [](Tape& tp, const Vars& v) { return log_softmax(tp, v[0]); }},
    {"log_softmax/thousands", [](Tape& tp, const Vars& v) { return log_softmax(tp, v[0]); }},
    {"log_softmax/one_class", [](Tape& tp, const Vars& v) { return log_softmax(tp, v[0]); }},
};

}  // namespace

TEST_CASE("softmax: every fixture case has a builder") { test::check_coverage(kFile, kCases); }

TEST_CASE("softmax (stable for logits in the thousands)") { test::check_op(kFile, "softmax", kCases); }
TEST_CASE("log_softmax (stable for logits in the thousands)") { test::check_op(kFile, "log_softmax", kCases); }

TEST_CASE("softmax of huge logits stays finite in float32 and float64") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    Tensor X = Tensor::from_doubles({2, 3}, {1e4, 1e4, -1e4, /**/ -3e4, -3e4 + 1, -3e4 + 2}, dt);
    Tape tp;
    GVar x = tp.param(X);
    GVar p = softmax(tp, x), lp = log_softmax(tp, x);
    for (double v : tp.value(p).to_doubles()) CHECK(std::isfinite(v));
    for (double v : tp.value(lp).to_doubles()) CHECK(std::isfinite(v));
    CHECK(tp.value(p).item(0) == doctest::Approx(0.5));
    CHECK(tp.value(lp).item(2) == doctest::Approx(-2e4 - std::log(2.0)));
    tp.backward(add(tp, sum(tp, mul(tp, p, p)), sum(tp, lp)));
    for (double v : tp.grad(x).to_doubles()) CHECK(std::isfinite(v));
  }
}

TEST_CASE("the fused softmax agrees with its composite reference exp(x - max) / sum") {
  Tensor X = test::random_tensor({4, 7}, DType::f64, 21, -5, 5);
  Tensor W = test::random_tensor({4, 7}, DType::f64, 22);
  auto composite = [](Tape& tp, GVar x) {
    GVar m = stop_gradient(tp, max(tp, x, -1, true));
    GVar e = exp(tp, sub(tp, x, m));
    return div(tp, e, sum(tp, e, {-1}, true));
  };
  auto composite_log = [](Tape& tp, GVar x) {
    GVar m = stop_gradient(tp, max(tp, x, -1, true));
    GVar z = sub(tp, x, m);
    return sub(tp, z, log(tp, sum(tp, exp(tp, z), {-1}, true)));
  };
  for (bool lg : {false, true}) {
    CAPTURE(lg);
    Tape t1, t2;
    GVar x1 = t1.param(X), x2 = t2.param(X);
    GVar y1 = lg ? log_softmax(t1, x1) : softmax(t1, x1);
    GVar y2 = lg ? composite_log(t2, x2) : composite(t2, x2);
    t1.backward(sum(t1, mul(t1, y1, t1.constant(W))));
    t2.backward(sum(t2, mul(t2, y2, t2.constant(W))));
    CHECK(test::rel_err(t1.value(y1), t2.value(y2)) <= 1e-14);
    CHECK(test::rel_err(t1.grad(x1), t2.grad(x2)) <= 1e-14);
  }
}

TEST_CASE("softmax errors name the op and the shape") {
  Tape tp;
  Tensor S = Tensor::scalar(1.0, DType::f64), I = Tensor::zeros({2, 3}, DType::i32);
  GVar s = tp.param(S), i = tp.constant(I);
  test::check_error([&] { softmax(tp, s); }, {"[softmax]", "scalar"});
  test::check_error([&] { log_softmax(tp, s); }, {"[log_softmax]", "scalar"});
  test::check_error([&] { softmax(tp, i); }, {"[softmax]", "int32", "(2, 3)"});
  test::check_error([&] { log_softmax(tp, i); }, {"[log_softmax]", "int32", "(2, 3)"});
}

}  // namespace ops_softmax
