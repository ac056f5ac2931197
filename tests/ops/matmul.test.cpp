// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/matmul.hpp: plain, either operand transposed, batched over leading dims, batched@batched,
// and a matrix shared by a batch on either side (x @ W^T, the Linear case), checked against
// tests/fixtures/ops/matmul.json (PyTorch float64) in both dtypes, against central differences and
// for fan-out (golden.hpp); then the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace {

const char* const kFile = "matmul.json";

// The shapes (a, b) are in gen_ops.py; op(x) = x^T where the name says so.
const test::Cases kCases = {
    {"matmul/plain", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1]); }},                      // (3,4)@(4,5)
    {"matmul/trans_a", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], true, false); }},       // (4,3)^T@(4,5)
    {"matmul/trans_b", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], false, true); }},       // (3,4)@(5,4)^T
    {"matmul/trans_both", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], true, true); }},     // (4,3)^T@(5,4)^T
    {"matmul/vector_row", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1]); }},                 // (1,4)@(4,3)
    {"matmul/batched", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1]); }},                    // (2,3,4)@(2,4,5)
    {"matmul/batched_trans_both", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], true, true); }},
    {"matmul/batched4d", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1]); }},                  // (2,2,3,4)@(2,2,4,5)
    {"matmul/shared_xWt", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], false, true); }},    // (2,3,4)@(5,4)^T
    {"matmul/shared_xW", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1]); }},                  // (2,3,4)@(4,5)
    {"matmul/shared_trans_a", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], true, false); }},  // (2,4,3)^T@(4,5)
    {"matmul/shared_left", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1]); }},                // (3,4)@(2,4,5)
    {"matmul/shared_left_trans_b", [](Tape& tp, const Vars& v) { return matmul(tp, v[0], v[1], false, true); }},  // (3,4)@(2,5,4)^T
};

}  // namespace

TEST_CASE("matmul: every fixture case has a builder") { test::check_coverage(kFile, kCases); }

TEST_CASE("matmul: plain, transposed, batched, shared matrix") { test::check_op(kFile, "matmul", kCases); }

TEST_CASE("matmul: a shared weight's gradient sums over the batch, in both dtypes") {
  // x (2, 3, 4) @ W^T with W (5, 4): dW = sum over the 6 rows of g^T x — equal to folding the batch
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dt);
    Tensor X = test::random_tensor({2, 3, 4}, dt, 11), W = test::random_tensor({5, 4}, dt, 12);
    Tensor X2 = X.reshape({6, 4});
    Tape t1, t2;
    GVar w1 = t1.param(W);
    t1.backward(sum(t1, matmul(t1, t1.constant(X), w1, false, true)));
    GVar w2 = t2.param(W);
    t2.backward(sum(t2, matmul(t2, t2.constant(X2), w2, false, true)));
    CHECK(t1.grad(w1).shape() == Shape{5, 4});
    CHECK(test::rel_err(t1.grad(w1), t2.grad(w2)) <= (dt == DType::f64 ? 1e-15 : 1e-6));
  }
}

TEST_CASE("matmul: one variable as both operands, x @ x and x^T @ x") {
  Tensor X = test::random_tensor({3, 3}, DType::f64, 13);
  Tensor W = test::random_tensor({3, 3}, DType::f64, 14);
  for (bool ta : {false, true}) {
    CAPTURE(ta);
    const double e = test::gradcheck(ta ? "x^T @ x" : "x @ x", {X}, [&](Tape& tp, const Vars& v) {
      return sum(tp, mul(tp, matmul(tp, v[0], v[0], ta, false), tp.constant(W)));
    }, test::kFdStep);
    CHECK(e <= test::kTolFd);
  }
}

TEST_CASE("matmul errors name the op and both shapes") {
  Tape tp;
  Tensor A = Tensor::zeros({2, 3}, DType::f32), B = Tensor::zeros({4, 5}, DType::f32), V = Tensor::zeros({3}, DType::f32);
  Tensor A64 = Tensor::zeros({3, 4}, DType::f64), Ba = Tensor::zeros({2, 3, 4}, DType::f32),
         Bb = Tensor::zeros({3, 4, 5}, DType::f32), Bc = Tensor::zeros({1, 2, 4, 5}, DType::f32);
  Tensor I = Tensor::zeros({2, 3}, DType::i32), I2 = Tensor::zeros({3, 2}, DType::i32);
  GVar a = tp.param(A), b = tp.param(B), v = tp.param(V), a64 = tp.param(A64), ba = tp.param(Ba), bb = tp.param(Bb),
       bc = tp.param(Bc), i = tp.constant(I), i2 = tp.constant(I2);
  test::check_error([&] { matmul(tp, a, b); }, {"[matmul]", "inner dimensions", "(2, 3)", "(4, 5)", "3 vs 4"});
  test::check_error([&] { matmul(tp, a, b, true, false); }, {"[matmul]", "(2, 3)^T", "(4, 5)", "2 vs 4"});
  test::check_error([&] { matmul(tp, a, a64, false, true); }, {"[matmul]", "float32", "float64", "(2, 3)", "(3, 4)"});
  test::check_error([&] { matmul(tp, v, b); }, {"[matmul]", "rank >= 2", "(3)", "(4, 5)"});
  test::check_error([&] { matmul(tp, ba, bb); }, {"[matmul]", "batch dims differ", "(2, 3, 4)", "(3, 4, 5)"});
  test::check_error([&] { matmul(tp, ba, bc); }, {"[matmul]", "batch dims differ", "(2, 3, 4)", "(1, 2, 4, 5)"});
  test::check_error([&] { matmul(tp, i, i2); }, {"[matmul]", "int32", "(2, 3)"});
}
