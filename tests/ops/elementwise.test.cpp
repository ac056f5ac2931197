// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/elementwise.hpp: every unary kernel, the broadcasting binary ops, where, stop_gradient.
// Each primitive is checked case by case against tests/fixtures/ops/elementwise.json (PyTorch,
// float64) in float64 and float32, against central differences, and for fan-out accumulation
// (see golden.hpp); then the conventions (ties, kinks) and the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace ops_elementwise {  // one unity source with the other ops files: its names stay its own

namespace {

const char* const kFile = "elementwise.json";

// The broadcast patterns of gen_ops.py: (3,4)+(3,4), (3,4)+(), ()+(3,4), (2,3,4)+(4),
// (2,3,4)+(3,1), (3,1)+(1,4), (4)+(2,3,4). Every binary op runs on each.
const char* const kPatterns[] = {"same", "scalar_b", "scalar_a", "trailing", "middle_one", "both", "rank_up"};

test::Cases make_cases() {
  test::Cases c = {
      {"neg/matrix", [](Tape& tp, const Vars& v) { return neg(tp, v[0]); }},
      {"exp/matrix", [](Tape& tp, const Vars& v) { return exp(tp, v[0]); }},
      {"log/positive", [](Tape& tp, const Vars& v) { return log(tp, v[0]); }},
      {"sqrt/positive", [](Tape& tp, const Vars& v) { return sqrt(tp, v[0]); }},
      {"rsqrt/positive", [](Tape& tp, const Vars& v) { return rsqrt(tp, v[0]); }},
      {"tanh/matrix", [](Tape& tp, const Vars& v) { return tanh(tp, v[0]); }},
      {"sigmoid/matrix", [](Tape& tp, const Vars& v) { return sigmoid(tp, v[0]); }},
      {"relu/away_from_zero", [](Tape& tp, const Vars& v) { return relu(tp, v[0]); }},
      {"relu/at_zero", [](Tape& tp, const Vars& v) { return relu(tp, v[0]); }},
      {"abs/away_from_zero", [](Tape& tp, const Vars& v) { return abs(tp, v[0]); }},
      {"abs/at_zero", [](Tape& tp, const Vars& v) { return abs(tp, v[0]); }},
      {"pow/2.5", [](Tape& tp, const Vars& v) { return pow(tp, v[0], 2.5); }},
      {"pow/-1.5", [](Tape& tp, const Vars& v) { return pow(tp, v[0], -1.5); }},
      {"pow/square_negative_base", [](Tape& tp, const Vars& v) { return pow(tp, v[0], 2.0); }},
      {"pow/cube_negative_base", [](Tape& tp, const Vars& v) { return pow(tp, v[0], 3.0); }},
      {"pow/zero", [](Tape& tp, const Vars& v) { return pow(tp, v[0], 0.0); }},
      {"scale/-1.75", [](Tape& tp, const Vars& v) { return scale(tp, v[0], -1.75); }},
      {"add_scalar/0.625", [](Tape& tp, const Vars& v) { return add_scalar(tp, v[0], 0.625); }},
      {"silu/matrix", [](Tape& tp, const Vars& v) { return unary(tp, Unary::silu, v[0]); }},
      {"gelu/matrix", [](Tape& tp, const Vars& v) { return unary(tp, Unary::gelu, v[0]); }},
      {"gelu_approx/matrix", [](Tape& tp, const Vars& v) { return unary(tp, Unary::gelu_approx, v[0]); }},
      {"gelu_fast/matrix", [](Tape& tp, const Vars& v) { return unary(tp, Unary::gelu_fast, v[0]); }},
      {"tanh/rank3", [](Tape& tp, const Vars& v) { return tanh(tp, v[0]); }},
      {"where/same", [](Tape& tp, const Vars& v) { return where(tp, v[0], v[1], v[2]); }},
      {"where/mask_column_scalar_b", [](Tape& tp, const Vars& v) { return where(tp, v[0], v[1], v[2]); }},
      {"where/rank_up", [](Tape& tp, const Vars& v) { return where(tp, v[0], v[1], v[2]); }},
      // x * stop_gradient(x): PyTorch's x * x.detach(), gradient x * w through one path only
      {"stop_gradient/x_times_sg_x", [](Tape& tp, const Vars& v) { return mul(tp, v[0], stop_gradient(tp, v[0])); }},
  };
  const std::pair<const char*, Binary> binaries[] = {{"add", Binary::add},         {"sub", Binary::sub},
                                                     {"mul", Binary::mul},         {"div", Binary::div},
                                                     {"maximum", Binary::maximum}, {"minimum", Binary::minimum}};
  for (auto [name, op] : binaries)
    for (const char* pattern : kPatterns)
      c[std::string(name) + "/" + pattern] = [op](Tape& tp, const Vars& v) { return binary(tp, op, v[0], v[1]); };
  // the named wrappers are the same primitive; make sure each maps to its kernel
  c["add/same"] = [](Tape& tp, const Vars& v) { return add(tp, v[0], v[1]); };
  c["sub/same"] = [](Tape& tp, const Vars& v) { return sub(tp, v[0], v[1]); };
  c["mul/same"] = [](Tape& tp, const Vars& v) { return mul(tp, v[0], v[1]); };
  c["div/same"] = [](Tape& tp, const Vars& v) { return div(tp, v[0], v[1]); };
  c["maximum/same"] = [](Tape& tp, const Vars& v) { return maximum(tp, v[0], v[1]); };
  c["minimum/same"] = [](Tape& tp, const Vars& v) { return minimum(tp, v[0], v[1]); };
  return c;
}

const test::Cases kCases = make_cases();

void check(const char* op) { test::check_op(kFile, op, kCases); }

}  // namespace

TEST_CASE("elementwise: every fixture case has a builder") { test::check_coverage(kFile, kCases); }

TEST_CASE("neg") { check("neg"); }
TEST_CASE("exp") { check("exp"); }
TEST_CASE("log") { check("log"); }
TEST_CASE("sqrt") { check("sqrt"); }
TEST_CASE("rsqrt") { check("rsqrt"); }
TEST_CASE("tanh") { check("tanh"); }
TEST_CASE("sigmoid") { check("sigmoid"); }
TEST_CASE("relu (relu'(0) = 0 as PyTorch)") { check("relu"); }
TEST_CASE("abs (abs'(0) = 0 as PyTorch)") { check("abs"); }
TEST_CASE("pow by a scalar") { check("pow"); }
TEST_CASE("scale") { check("scale"); }
TEST_CASE("add_scalar") { check("add_scalar"); }
TEST_CASE("silu") { check("silu"); }
TEST_CASE("gelu (erf)") { check("gelu"); }
TEST_CASE("gelu_approx (tanh)") { check("gelu_approx"); }
TEST_CASE("gelu_fast (x sigmoid(1.702 x))") { check("gelu_fast"); }
TEST_CASE("add with broadcasting") { check("add"); }
TEST_CASE("sub with broadcasting") { check("sub"); }
TEST_CASE("mul with broadcasting") { check("mul"); }
TEST_CASE("div with broadcasting") { check("div"); }
TEST_CASE("maximum with broadcasting") { check("maximum"); }
TEST_CASE("minimum with broadcasting") { check("minimum"); }
TEST_CASE("where with a broadcast mask") { check("where"); }
TEST_CASE("stop_gradient") { check("stop_gradient"); }

TEST_CASE("relu'(0) = 0 and abs'(0) = 0, in both dtypes") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    Tensor X = Tensor::from_doubles({3}, {0.0, -0.0, 2.0}, dt);
    Tape tp;
    GVar x = tp.param(X);
    tp.backward(sum(tp, add(tp, relu(tp, x), abs(tp, x))));
    CHECK(tp.grad(x).to_doubles() == std::vector<double>{0.0, 0.0, 2.0});
  }
}

TEST_CASE("maximum/minimum: a tie sends the whole gradient to a (documented)") {
  // PyTorch would split a tie 0.5/0.5; nn follows the documented "to a" rule.
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    Tensor A = Tensor::from_doubles({3}, {1.0, 2.0, 3.0}, dt);
    Tensor Bt = Tensor::from_doubles({3}, {1.0, 1.0, 3.5}, dt);
    Tape tp;
    GVar a = tp.param(A), b = tp.param(Bt);
    GVar y = add(tp, maximum(tp, a, b), scale(tp, minimum(tp, a, b), 10.0));
    tp.backward(sum(tp, y));
    // element 0 ties: both max and min send theirs to a (1 + 10); element 1: a wins max, b min.
    CHECK(tp.grad(a).to_doubles() == std::vector<double>{11.0, 1.0, 10.0});
    CHECK(tp.grad(b).to_doubles() == std::vector<double>{0.0, 10.0, 1.0});
  }
}

TEST_CASE("one variable in both operands of one op accumulates both contributions") {
  Tensor X = Tensor::from<double>({3}, {1.5, -2.0, 0.25});
  Tensor M = Tensor::from<std::uint8_t>({3}, {1, 0, 1});
  Tape tp;
  GVar x = tp.param(X);
  // x*x: 2x;  x - x: 0;  x / x: 0;  where(m, x, x): 1;  max(x, x): 1 (the tie goes to a)
  GVar y = add(tp, mul(tp, x, x), sub(tp, x, x));
  y = add(tp, y, add(tp, div(tp, x, x), where(tp, tp.constant(M), x, x)));
  y = add(tp, y, maximum(tp, x, x));
  tp.backward(sum(tp, y));
  CHECK(tp.grad(x).to_doubles() == std::vector<double>{2 * 1.5 + 2, 2 * -2.0 + 2, 2 * 0.25 + 2});
}

TEST_CASE("broadcast gradients have the input's shape") {
  Tensor X = test::random_tensor({2, 3, 4}, DType::f64, 1);
  Tensor Bias = test::random_tensor({4}, DType::f64, 2);
  Tensor Col = test::random_tensor({3, 1}, DType::f64, 3);
  Tensor S = Tensor::scalar(0.5, DType::f64);
  Tape tp;
  GVar x = tp.param(X), bias = tp.param(Bias), col = tp.param(Col), s = tp.param(S);
  GVar y = mul(tp, add(tp, sub(tp, x, col), bias), s);
  y = where(tp, tp.constant(Tensor::from<std::uint8_t>({4}, {1, 0, 1, 0})), y, s);
  tp.backward(sum(tp, y));
  CHECK(tp.grad(x).shape() == Shape{2, 3, 4});
  CHECK(tp.grad(bias).shape() == Shape{4});
  CHECK(tp.grad(col).shape() == Shape{3, 1});
  CHECK(tp.grad(s).shape() == Shape{});
  // bias[j] appears in 6 elements, half of which where() masks for columns 1 and 3
  CHECK(tp.grad(bias).item(1) == 0.0);
  CHECK(tp.grad(bias).item(0) == doctest::Approx(6 * 0.5));
}

TEST_CASE("stop_gradient: nothing flows back through it") {
  Tensor X = Tensor::from<double>({2}, {1.0, -2.0});
  Tape tp;
  GVar x = tp.param(X);
  GVar sg = stop_gradient(tp, x);
  CHECK_FALSE(tp.requires_grad(sg));
  CHECK(tp.value(sg).to_doubles() == X.to_doubles());
  test::check_error([&] { tp.backward(sum(tp, sg)); }, {"[backward]", "does not depend"});
}

TEST_CASE("stop_gradient: x * stop_gradient(x) differentiates as x * (a frozen copy of x)") {
  // The finite-difference evidence for stop_gradient: its gradient is that of the function with
  // the stopped value held constant, which central differences can check.
  Tensor X = test::random_tensor({3, 4}, DType::f64, 7);
  Tensor W = test::random_tensor({3, 4}, DType::f64, 8);
  const Tensor frozen = X.clone();
  auto with_copy = [&](Tape& tp, const Vars& v) { return sum(tp, mul(tp, mul(tp, v[0], tp.constant(frozen)), tp.constant(W))); };
  const double efd = test::gradcheck("stop_gradient: x * frozen x", {X}, with_copy, test::kFdStep);
  CHECK(efd <= test::kTolFd);
  test::OpScore& score = test::scoreboard()["stop_gradient"];
  test::golden::note(efd, score.fd, score.worst_fd_case, "stop_gradient/x_times_frozen_x");
  ++score.fd_cases;
  Tape t1, t2;
  GVar x1 = t1.param(X), x2 = t2.param(X);
  t1.backward(sum(t1, mul(t1, mul(t1, x1, stop_gradient(t1, x1)), t1.constant(W))));
  t2.backward(with_copy(t2, {x2}));
  CHECK(t1.grad(x1).to_doubles() == t2.grad(x2).to_doubles());
}

TEST_CASE("elementwise errors name the op, both shapes and the dtypes") {
  Tape tp;
  Tensor A = Tensor::zeros({2, 3}, DType::f32), B4 = Tensor::zeros({4}, DType::f32);
  Tensor A64 = Tensor::zeros({2, 3}, DType::f64), Ids = Tensor::zeros({3}, DType::i32);
  GVar a = tp.param(A), b4 = tp.param(B4), a64 = tp.param(A64), ids = tp.constant(Ids);
  test::check_error([&] { add(tp, a, b4); }, {"[add]", "(2, 3)", "(4)", "cannot broadcast"});
  test::check_error([&] { sub(tp, b4, a); }, {"[sub]", "(4)", "(2, 3)"});
  test::check_error([&] { mul(tp, a, a64); }, {"[mul]", "float32", "float64", "(2, 3)"});
  test::check_error([&] { div(tp, a64, b4); }, {"[div]", "float64", "float32", "(2, 3)", "(4)"});
  test::check_error([&] { maximum(tp, a, b4); }, {"[maximum]", "(2, 3)", "(4)"});
  test::check_error([&] { minimum(tp, ids, ids); }, {"[minimum]", "int32", "(3)"});
  test::check_error([&] { exp(tp, ids); }, {"[exp]", "int32", "(3)"});
  test::check_error([&] { pow(tp, ids, 2.0); }, {"[pow]", "int32"});
  test::check_error([&] { unary(tp, Unary::gelu, ids); }, {"[gelu]", "int32"});
  test::check_error([&] { where(tp, tp.constant(Tensor::zeros({2}, DType::u8)), a, a); }, {"[where]", "(2)", "(2, 3)"});
  test::check_error([&] { where(tp, tp.constant(Tensor::zeros({2, 1}, DType::u8)), a, b4); },
                    {"[where]", "(2, 3)", "(4)"});
  test::check_error([&] { where(tp, tp.constant(Tensor::zeros({3}, DType::u8)), a, a64); },
                    {"[where]", "float32", "float64"});
}

}  // namespace ops_elementwise
