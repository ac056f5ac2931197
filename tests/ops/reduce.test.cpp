// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/reduce.hpp: sum and mean (over all axes, one axis, several, keepdims or not) and max over an
// axis, checked against tests/fixtures/ops/reduce.json (PyTorch float64) in both dtypes, against
// central differences and for fan-out (golden.hpp); then max's tie rule and the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace ops_reduce {  // one unity source with the other ops files: its names stay its own

namespace {

const char* const kFile = "reduce.json";

// (2, 3, 4) inputs unless the name says otherwise; PyTorch's dim= list is in each name.
const test::Cases kCases = {
    {"sum/all", [](Tape& tp, const Vars& v) { return sum(tp, v[0]); }},
    {"sum/all_keepdims", [](Tape& tp, const Vars& v) { return sum(tp, v[0], {}, true); }},
    {"sum/axis1", [](Tape& tp, const Vars& v) { return sum(tp, v[0], {1}); }},
    {"sum/axis-1_keepdims", [](Tape& tp, const Vars& v) { return sum(tp, v[0], {-1}, true); }},
    {"sum/axes01", [](Tape& tp, const Vars& v) { return sum(tp, v[0], {0, 1}); }},
    {"sum/axes02_keepdims", [](Tape& tp, const Vars& v) { return sum(tp, v[0], {0, 2}, true); }},
    {"sum/axis0_matrix", [](Tape& tp, const Vars& v) { return sum(tp, v[0], {0}); }},
    {"mean/all", [](Tape& tp, const Vars& v) { return mean(tp, v[0]); }},
    {"mean/all_keepdims", [](Tape& tp, const Vars& v) { return mean(tp, v[0], {}, true); }},
    {"mean/axis1", [](Tape& tp, const Vars& v) { return mean(tp, v[0], {1}); }},
    {"mean/axis-1_keepdims", [](Tape& tp, const Vars& v) { return mean(tp, v[0], {-1}, true); }},
    {"mean/axes01", [](Tape& tp, const Vars& v) { return mean(tp, v[0], {1, 0}); }},  // order does not matter
    {"mean/axes02_keepdims", [](Tape& tp, const Vars& v) { return mean(tp, v[0], {0, 2}, true); }},
    {"mean/axis0_matrix", [](Tape& tp, const Vars& v) { return mean(tp, v[0], {0}); }},
    {"max/axis0", [](Tape& tp, const Vars& v) { return max(tp, v[0], 0); }},
    {"max/axis1", [](Tape& tp, const Vars& v) { return max(tp, v[0], 1); }},
    {"max/axis2", [](Tape& tp, const Vars& v) { return max(tp, v[0], 2); }},
    {"max/axis-1", [](Tape& tp, const Vars& v) { return max(tp, v[0], -1); }},
    {"max/axis1_keepdims", [](Tape& tp, const Vars& v) { return max(tp, v[0], 1, true); }},
    {"max/vector", [](Tape& tp, const Vars& v) { return max(tp, v[0], 0); }},
};

}  // namespace

TEST_CASE("reduce: every fixture case has a builder") { test::check_coverage(kFile, kCases); }

TEST_CASE("sum over axes, keepdims, all") { test::check_op(kFile, "sum", kCases); }
TEST_CASE("mean over axes, keepdims, all") { test::check_op(kFile, "mean", kCases); }
TEST_CASE("max over an axis") { test::check_op(kFile, "max", kCases); }

TEST_CASE("max: at a tie the gradient goes to the first index (documented in ops/reduce.hpp)") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    // rows: a tie between columns 1 and 3; all equal; a plain max at column 2
    Tensor X = Tensor::from_doubles({3, 4}, {0, 5, 1, 5, /**/ 2, 2, 2, 2, /**/ -1, -3, 4, 0}, dt);
    Tape tp;
    GVar x = tp.param(X);
    GVar m = max(tp, x, 1);
    CHECK(tp.value(m).to_doubles() == std::vector<double>{5, 2, 4});
    tp.backward(m, Tensor::from_doubles({3}, {1, 10, 100}, dt));
    CHECK(tp.grad(x).to_doubles() == std::vector<double>{0, 1, 0, 0, /**/ 10, 0, 0, 0, /**/ 0, 0, 100, 0});
    // along axis 0 the first row wins a tie too
    Tape t2;
    GVar x2 = t2.param(X);
    t2.backward(sum(t2, max(t2, x2, 0)));
    CHECK(t2.grad(x2).to_doubles() == std::vector<double>{0, 1, 0, 1, /**/ 1, 0, 0, 0, /**/ 0, 0, 1, 0});
  }
}

TEST_CASE("sum and mean of a scalar, and over a size-1 axis") {
  Tensor S = Tensor::scalar(2.5, DType::f64);
  Tensor X = Tensor::from<double>({3, 1}, {1, 2, 3});
  Tape tp;
  GVar s = tp.param(S), x = tp.param(X);
  GVar a = sum(tp, s), b = mean(tp, x, {1});
  CHECK(tp.shape(a) == Shape{});
  CHECK(tp.value(a).item() == 2.5);
  CHECK(tp.shape(b) == Shape{3});
  CHECK(tp.value(b).to_doubles() == std::vector<double>{1, 2, 3});
}

TEST_CASE("reduce errors name the op and the shape") {
  Tape tp;
  Tensor X = Tensor::zeros({2, 3}, DType::f32), E = Tensor::zeros({2, 0}, DType::f64), Ids = Tensor::zeros({4}, DType::i64);
  Tensor S = Tensor::scalar(1.0, DType::f64);
  GVar x = tp.param(X), e = tp.param(E), ids = tp.constant(Ids), s = tp.param(S);
  test::check_error([&] { sum(tp, x, {2}); }, {"[sum]", "axis 2", "(2, 3)"});
  test::check_error([&] { mean(tp, x, {0, -3}); }, {"[mean]", "axis -3", "(2, 3)"});
  test::check_error([&] { sum(tp, ids); }, {"[sum]", "int64", "(4)"});
  test::check_error([&] { mean(tp, e, {1}); }, {"[mean]", "empty", "(2, 0)"});
  test::check_error([&] { max(tp, x, 2); }, {"[max]", "axis 2", "(2, 3)"});
  test::check_error([&] { max(tp, x, -3); }, {"[max]", "axis -3", "(2, 3)"});
  test::check_error([&] { max(tp, e, 1); }, {"[max]", "empty", "(2, 0)"});
  test::check_error([&] { max(tp, s, 0); }, {"[max]", "scalar"});
  test::check_error([&] { max(tp, ids, 0); }, {"[max]", "int64", "(4)"});
}

}  // namespace ops_reduce
