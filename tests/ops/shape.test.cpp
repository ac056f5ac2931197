// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/shape.hpp: reshape (a view), permute, transpose, slice, concat, broadcast_to, checked
// against tests/fixtures/ops/shape.json (PyTorch float64) in both dtypes, against central
// differences and for fan-out (golden.hpp); then views, integer data movement and the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace ops_shape {  // one unity source with the other ops files: its names stay its own

namespace {

const char* const kFile = "shape.json";

const test::Cases kCases = {
    {"reshape/to_matrix", [](Tape& tp, const Vars& v) { return reshape(tp, v[0], {6, 4}); }},
    {"reshape/infer", [](Tape& tp, const Vars& v) { return reshape(tp, v[0], {4, -1}); }},
    {"reshape/flat", [](Tape& tp, const Vars& v) { return reshape(tp, v[0], {24}); }},
    {"reshape/to_scalar", [](Tape& tp, const Vars& v) { return reshape(tp, v[0], {}); }},
    {"permute/201", [](Tape& tp, const Vars& v) { return permute(tp, v[0], {2, 0, 1}); }},
    {"permute/matrix", [](Tape& tp, const Vars& v) { return permute(tp, v[0], {1, 0}); }},
    {"permute/0213", [](Tape& tp, const Vars& v) { return permute(tp, v[0], {0, 2, 1, 3}); }},
    {"transpose/last_two", [](Tape& tp, const Vars& v) { return transpose(tp, v[0]); }},
    {"transpose/0_2", [](Tape& tp, const Vars& v) { return transpose(tp, v[0], 0, 2); }},
    {"slice/axis1", [](Tape& tp, const Vars& v) { return slice(tp, v[0], 1, 1, 3); }},            // x[:, 1:3, :]
    {"slice/negative", [](Tape& tp, const Vars& v) { return slice(tp, v[0], -1, -3, -1); }},      // x[..., -3:-1]
    {"slice/axis0_first", [](Tape& tp, const Vars& v) { return slice(tp, v[0], 0, 0, 1); }},      // x[0:1]
    {"concat/axis0", [](Tape& tp, const Vars& v) { return concat(tp, {v[0], v[1], v[2]}, 0); }},
    {"concat/last", [](Tape& tp, const Vars& v) { return concat(tp, {v[0], v[1]}, -1); }},
    {"concat/middle", [](Tape& tp, const Vars& v) { return concat(tp, {v[0], v[1], v[2]}, 1); }},
    {"broadcast_to/column", [](Tape& tp, const Vars& v) { return broadcast_to(tp, v[0], Shape{2, 3, 4}); }},
    {"broadcast_to/row", [](Tape& tp, const Vars& v) { return broadcast_to(tp, v[0], Shape{3, 4}); }},
    {"broadcast_to/scalar", [](Tape& tp, const Vars& v) { return broadcast_to(tp, v[0], Shape{2, 2}); }},
};

}  // namespace

TEST_CASE("shape: every fixture case has a builder") { test::check_coverage(kFile, kCases); }

TEST_CASE("reshape") { test::check_op(kFile, "reshape", kCases); }
TEST_CASE("permute") { test::check_op(kFile, "permute", kCases); }
TEST_CASE("transpose") { test::check_op(kFile, "transpose", kCases); }
TEST_CASE("slice") { test::check_op(kFile, "slice", kCases); }
TEST_CASE("concat") { test::check_op(kFile, "concat", kCases); }
TEST_CASE("broadcast_to") { test::check_op(kFile, "broadcast_to", kCases); }

TEST_CASE("reshape is a view of its input; permute, slice, concat copy") {
  Tensor X = test::random_tensor({2, 3}, DType::f64, 3);
  Tape tp;
  GVar x = tp.param(X);
  CHECK(tp.value(reshape(tp, x, {3, 2})).shares_storage(X));
  CHECK_FALSE(tp.value(transpose(tp, x)).shares_storage(X));
  CHECK_FALSE(tp.value(slice(tp, x, 0, 0, 2)).shares_storage(X));
  CHECK_FALSE(tp.value(concat(tp, {x}, 0)).shares_storage(X));
}

TEST_CASE("data movement works on integer tensors (token ids), without gradients") {
  Tensor Ids = Tensor::from<std::int32_t>({2, 3}, {1, 2, 3, 4, 5, 6});
  Tensor More = Tensor::from<std::int32_t>({1, 3}, {7, 8, 9});
  Tape tp;
  GVar ids = tp.constant(Ids), more = tp.constant(More);
  GVar t = transpose(tp, ids);
  CHECK(tp.dtype(t) == DType::i32);
  CHECK(tp.value(t).to_doubles() == std::vector<double>{1, 4, 2, 5, 3, 6});
  CHECK(tp.value(slice(tp, ids, 1, 1, 3)).to_doubles() == std::vector<double>{2, 3, 5, 6});
  CHECK(tp.value(concat(tp, {ids, more}, 0)).to_doubles() == std::vector<double>{1, 2, 3, 4, 5, 6, 7, 8, 9});
  CHECK(tp.value(reshape(tp, ids, {-1})).shape() == Shape{6});
  CHECK_FALSE(tp.requires_grad(t));
}

TEST_CASE("one variable three times in one op: concat({x, x, x}) and its gradient") {
  Tensor X = test::random_tensor({2, 3}, DType::f64, 4);
  Tensor W = test::random_tensor({2, 9}, DType::f64, 5);
  const double e = test::gradcheck("concat x three times", {X}, [&](Tape& tp, const Vars& v) {
    return sum(tp, mul(tp, concat(tp, {v[0], v[0], v[0]}, 1), tp.constant(W)));
  }, test::kFdStep);
  CHECK(e <= test::kTolFd);
  Tape tp;
  GVar x = tp.param(X);
  tp.backward(sum(tp, concat(tp, {x, x, x}, 0)));
  CHECK(tp.grad(x).to_doubles() == std::vector<double>(6, 3.0));
}

TEST_CASE("shape errors name the op and the shapes") {
  Tape tp;
  Tensor X = Tensor::zeros({2, 3, 4}, DType::f32), Y = Tensor::zeros({2, 5}, DType::f32), Y64 = Tensor::zeros({2, 3, 4}, DType::f64);
  Tensor S = Tensor::scalar(1.0, DType::f32), Ids = Tensor::zeros({3}, DType::i64);
  GVar x = tp.param(X), y = tp.param(Y), y64 = tp.param(Y64), s = tp.param(S), ids = tp.constant(Ids);
  test::check_error([&] { reshape(tp, x, {5, 5}); }, {"[reshape]", "(2, 3, 4)", "(5, 5)"});
  test::check_error([&] { reshape(tp, x, {-1, -1}); }, {"[reshape]", "only one -1"});
  test::check_error([&] { reshape(tp, x, {5, -1}); }, {"[reshape]", "(2, 3, 4)", "24 elements"});
  test::check_error([&] { reshape(tp, x, {-2, 12}); }, {"[reshape]", "negative dimension", "(2, 3, 4)"});
  test::check_error([&] { permute(tp, x, {0, 1}); }, {"[permute]", "(2, 3, 4)"});
  test::check_error([&] { permute(tp, x, {0, 1, 1}); }, {"[permute]", "(2, 3, 4)"});
  test::check_error([&] { permute(tp, x, {0, 1, 3}); }, {"[permute]", "axis 3", "(2, 3, 4)"});
  test::check_error([&] { transpose(tp, s); }, {"[transpose]", "()"});
  test::check_error([&] { transpose(tp, x, 0, 3); }, {"[transpose]", "axis 3", "(2, 3, 4)"});
  test::check_error([&] { slice(tp, x, 1, 2, 5); }, {"[slice]", "[2, 5)", "(2, 3, 4)"});
  test::check_error([&] { slice(tp, x, 1, 2, 1); }, {"[slice]", "[2, 1)", "(2, 3, 4)"});
  test::check_error([&] { slice(tp, x, 3, 0, 1); }, {"[slice]", "axis 3", "(2, 3, 4)"});
  test::check_error([&] { slice(tp, s, 0, 0, 1); }, {"[slice]", "scalar"});
  test::check_error([&] { concat(tp, {x, y}, 0); }, {"[concat]", "(2, 3, 4)", "(2, 5)"});
  test::check_error([&] { concat(tp, {x, x}, 3); }, {"[concat]", "axis 3", "(2, 3, 4)"});
  test::check_error([&] { concat(tp, {x, y64}, 0); }, {"[concat]", "float32", "float64", "(2, 3, 4)"});
  test::check_error([&] { concat(tp, std::span<const GVar>(), 0); }, {"[concat]", "at least one"});
  test::check_error([&] { broadcast_to(tp, x, Shape{3, 4}); }, {"[broadcast_to]", "(2, 3, 4)", "(3, 4)"});
  test::check_error([&] { broadcast_to(tp, y, Shape{2, 4}); }, {"[broadcast_to]", "(2, 5)", "(2, 4)"});
  test::check_error([&] { broadcast_to(tp, ids, Shape{2, 3}); }, {"[broadcast_to]", "int64", "(3)"});
}

}  // namespace ops_shape
