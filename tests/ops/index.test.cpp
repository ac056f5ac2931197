// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/index.hpp: gather_rows (an embedding lookup; its vjp scatter-adds, so repeated ids
// accumulate) and pick (one element per row; a negative index is ignored), checked against
// tests/fixtures/ops/index.json (PyTorch float64) in both dtypes, against central differences and
// for fan-out (golden.hpp); then the conventions and the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace ops_index {  // one unity source with the other ops files: its names stay its own

namespace {

const char* const kFile = "index.json";

const test::Cases kCases = {
    // table (5, 3), ids [1, 3, 1, 1] (int64): row 1 is read three times
    {"gather_rows/repeated_ids", [](Tape& tp, const Vars& v) { return gather_rows(tp, v[0], v[1]); }},
    // table (6, 4), ids (2, 3) int32 -> (2, 3, 4)
    {"gather_rows/ids_matrix_i32", [](Tape& tp, const Vars& v) { return gather_rows(tp, v[0], v[1]); }},
    // x (4, 5), idx [2, -1, 0, 4] (int64): row 1 is ignored (0, no gradient)
    {"pick/ignored_row", [](Tape& tp, const Vars& v) { return pick(tp, v[0], v[1]); }},
    // x (2, 3, 5), idx (2, 3) int32 with a -100 (PyTorch's ignore_index)
    {"pick/rank3_i32", [](Tape& tp, const Vars& v) { return pick(tp, v[0], v[1]); }},
};

}  // namespace

TEST_CASE("index: every fixture case has a builder") { test::check_coverage(kFile, kCases); }

TEST_CASE("gather_rows (vjp scatter-adds)") { test::check_op(kFile, "gather_rows", kCases); }
TEST_CASE("pick (negative index ignored)") { test::check_op(kFile, "pick", kCases); }

TEST_CASE("gather_rows: a repeated id accumulates every row's gradient, in both dtypes") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    Tensor T = Tensor::zeros({3, 2}, dt);
    Tensor Ids = Tensor::from<std::int64_t>({4}, {2, 0, 2, 2});
    Tape tp;
    GVar t = tp.param(T);
    GVar y = gather_rows(tp, t, tp.constant(Ids));
    tp.backward(y, Tensor::from_doubles({4, 2}, {1, 2, 10, 20, 100, 200, 1000, 2000}, dt));
    CHECK(tp.grad(t).to_doubles() == std::vector<double>{10, 20, 0, 0, 1101, 2202});
  }
}

TEST_CASE("pick: a negative index gives 0 and passes no gradient, in both dtypes") {
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    Tensor X = Tensor::from_doubles({2, 3}, {1, 2, 3, 4, 5, 6}, dt);
    Tensor Idx = Tensor::from<std::int32_t>({2}, {-1, 2});
    Tape tp;
    GVar x = tp.param(X);
    GVar y = pick(tp, x, tp.constant(Idx));
    CHECK(tp.value(y).to_doubles() == std::vector<double>{0, 6});
    tp.backward(sum(tp, y));
    CHECK(tp.grad(x).to_doubles() == std::vector<double>{0, 0, 0, 0, 0, 1});
  }
}

TEST_CASE("an id out of range fails the op and leaves the tape as it was, replayable") {
  Tensor T = test::random_tensor({4, 2}, DType::f64, 5);
  Tensor Good = Tensor::from<std::int64_t>({2}, {0, 3}), Bad = Tensor::from<std::int64_t>({2}, {0, 4});
  Tape tp;
  GVar t = tp.param(T);
  GVar loss = sum(tp, gather_rows(tp, t, tp.input(Good)));
  tp.backward(loss);
  const std::size_t nodes = tp.size();
  GVar bad = tp.constant(Bad);
  test::check_error([&] { gather_rows(tp, t, bad); }, {"[gather_rows]", "id 4", "4 rows"});
  test::check_error([&] { pick(tp, t, tp.constant(Tensor::from<std::int64_t>({4}, {0, 2, 0, 0}))); },
                    {"[pick]", "index 2"});
  CHECK(tp.size() == nodes + 2);  // the two constants; no half-built op node
  tp.replay();
  CHECK(tp.value(loss).item() == doctest::Approx(T.item(0) + T.item(1) + T.item(6) + T.item(7)));
}

TEST_CASE("index errors name the op, the shapes and the bad id") {
  Tape tp;
  Tensor T = Tensor::zeros({5, 3}, DType::f32), T3 = Tensor::zeros({2, 5, 3}, DType::f32), X = Tensor::zeros({4, 5}, DType::f64);
  Tensor Ids = Tensor::from<std::int64_t>({2}, {1, 5}), Neg = Tensor::from<std::int32_t>({1}, {-1});
  Tensor Fids = Tensor::zeros({2}, DType::f32), Idx3 = Tensor::zeros({3}, DType::i64), Idx4 = Tensor::from<std::int64_t>({4}, {0, 1, 5, 2});
  GVar t = tp.param(T), t3 = tp.param(T3), x = tp.param(X), ids = tp.constant(Ids), neg = tp.constant(Neg),
       fids = tp.param(Fids), idx3 = tp.constant(Idx3), idx4 = tp.constant(Idx4);
  test::check_error([&] { gather_rows(tp, t, ids); }, {"[gather_rows]", "id 5", "5 rows"});
  test::check_error([&] { gather_rows(tp, t, neg); }, {"[gather_rows]", "id -1"});
  test::check_error([&] { gather_rows(tp, t, fids); }, {"[gather_rows]", "float32", "(2)"});
  test::check_error([&] { gather_rows(tp, t3, idx3); }, {"[gather_rows]", "(N, D)", "(2, 5, 3)"});
  test::check_error([&] { gather_rows(tp, idx3, idx3); }, {"[gather_rows]", "int64", "(3)"});
  test::check_error([&] { pick(tp, x, idx3); }, {"[pick]", "(3)", "(4, 5)"});
  test::check_error([&] { pick(tp, x, idx4); }, {"[pick]", "index 5", "5 classes"});
  test::check_error([&] { pick(tp, x, fids); }, {"[pick]", "float32"});
}

}  // namespace ops_index
