// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/matmul.hpp: plain, either operand transposed, batched over leading dims, batched@batched,
// and a matrix shared by a batch on either side (x @ W^T, the Linear case), checked against
// tests/fixtures/ops/matmul.json (PyTorch float64) in both dtypes, against central differences and
// for fan-out (golden.hpp); then the errors.
#include "ops/golden.hpp"

using namespace nn;
using test::Tape;
using test::Vars;

namespace ops_matmul {  // one unity source with the other ops files: its names stay its own

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

namespace {

/// t's values rounded to bf16 (as the bf16 products round their float32 operand), in float64.
Tensor bf16_rounded(const Tensor& t) { return t.to(DType::bf16).to(DType::f64); }

}  // namespace

TEST_CASE("matmul with a frozen bf16 weight: the f64 product of the bf16-rounded operands, value and x's gradient") {
  // x (3, 7, 45) @ W^T (W (19, 45) bf16): the Linear case (x's batch folds into rows); then
  // x (21, 45) @ W (45, 19), untransposed (the layout of x's gradient); K = 45 is odd.
  for (bool tb : {true, false}) {
    CAPTURE(tb);
    Tensor X = test::random_tensor({3, 7, 45}, DType::f32, 70), W = test::random_tensor(tb ? Shape{19, 45} : Shape{45, 19}, DType::f32, 71);
    Tensor Wb = W.to(DType::bf16), G = test::random_tensor({3, 7, 19}, DType::f32, 72);
    Tape tp;
    GVar x = tp.param(X), w = tp.param(Wb, false);
    GVar y = matmul(tp, x, w, false, tb);
    CHECK(tp.dtype(y) == DType::f32);
    tp.backward(y, G);
    // the reference: float64 products of the rounded operands (x and the cotangent rounded to bf16)
    Tape rt;
    GVar xr = rt.constant(bf16_rounded(X)), wr = rt.constant(Wb.to(DType::f64)), gr = rt.constant(bf16_rounded(G));
    Tensor y_ref = rt.value(matmul(rt, xr, wr, false, tb));
    Tensor gx_ref = rt.value(matmul(rt, gr, wr, false, !tb));
    const double ey = test::rel_err(tp.value(y), y_ref), eg = test::rel_err(tp.grad(x), gx_ref);
    MESSAGE("bf16 matmul (" << std::string(tb ? "W^T" : "W") << "): value " << ey << ", x grad " << eg << " (" << cpu_info().bf16 << ")");
    CHECK(ey <= 2e-6);  // f32 accumulation over K = 45 (or 19) exact products
    CHECK(eg <= 2e-6);
  }
}

TEST_CASE("bf16 weights: the embedding lookup widens rows exactly; linear keeps an f32 bias; errors") {
  Tensor E = test::random_tensor({11, 6}, DType::f32, 73).to(DType::bf16);
  Tensor ids = Tensor::from<std::int32_t>({2, 2}, {3, 0, 10, 3});
  Tape tp;
  GVar e = tp.param(E, false), rows = embedding(tp, tp.constant(ids), e);
  CHECK(tp.dtype(rows) == DType::f32);
  const Tensor wide = E.to(DType::f32);
  for (std::int64_t i = 0; i < 4; ++i)
    for (std::int64_t j = 0; j < 6; ++j) CHECK(tp.value(rows).item(i * 6 + j) == wide.item(ids.item(i) * 6 + j));
  Tensor X = test::random_tensor({4, 6}, DType::f32, 74), Bias = test::random_tensor({11}, DType::f32, 75);
  GVar x = tp.param(X), y = linear(tp, x, e, tp.param(Bias));
  CHECK(tp.shape(y) == Shape{4, 11});
  Tensor Et = E.to(DType::f32).to(DType::bf16);  // a second bf16 tensor, bound trainable
  GVar trained = tp.param(Et);
  test::check_error([&] { matmul(tp, x, trained, false, true); }, {"[matmul]", "bfloat16 weight (11, 6) must be frozen"});
  test::check_error([&] { embedding(tp, tp.constant(ids), trained); }, {"[gather_rows]", "bfloat16 table (11, 6) must be frozen"});
  test::check_error([&] { matmul(tp, x, e, true, false); }, {"[matmul]", "right-hand matrix", "(4, 6)^T"});
  test::check_error([&] { matmul(tp, e, x, false, true); }, {"[matmul]", "bfloat16", "(11, 6)"});
}

TEST_CASE("autocast bf16: a float32 weight's product and both gradients on bf16-rounded operands; replayed") {
  for (bool tb : {true, false}) {
    CAPTURE(tb);
    Tensor X = test::random_tensor({3, 7, 45}, DType::f32, 90), W = test::random_tensor(tb ? Shape{19, 45} : Shape{45, 19}, DType::f32, 91);
    Tensor G = test::random_tensor({3, 7, 19}, DType::f32, 92);
    Tape tp;
    tp.set_autocast(DType::bf16);
    GVar x = tp.param(X), w = tp.param(W);
    GVar y = matmul(tp, x, w, false, tb);
    tp.backward(y, G);
    // the reference: float64 products of the rounded operands; dW = g^T x (or x^T g) over the
    // 21 folded rows
    Tape rt;
    GVar xr = rt.constant(bf16_rounded(X)), wr = rt.constant(bf16_rounded(W)), gr = rt.constant(bf16_rounded(G));
    GVar xr2 = rt.constant(bf16_rounded(X).reshape({21, 45})), gr2 = rt.constant(bf16_rounded(G).reshape({21, 19}));
    Tensor y_ref = rt.value(matmul(rt, xr, wr, false, tb));
    Tensor gx_ref = rt.value(matmul(rt, gr, wr, false, !tb));
    Tensor gw_ref = rt.value(tb ? matmul(rt, gr2, xr2, true, false) : matmul(rt, xr2, gr2, true, false));
    const double ey = test::rel_err(tp.value(y), y_ref), ex = test::rel_err(tp.grad(x), gx_ref),
                 ew = test::rel_err(tp.grad(w), gw_ref);
    MESSAGE("autocast matmul (" << std::string(tb ? "W^T" : "W") << "): value " << ey << ", x grad " << ex
                                << ", W grad " << ew);
    CHECK(ey <= 2e-6);
    CHECK(ex <= 2e-6);
    CHECK(ew <= 2e-6);
    // the choice is recorded with the product: a replay with new values does what the recording did
    Tensor y0 = tp.value(y).clone();
    for (std::int64_t i = 0; i < X.numel(); ++i) X.data<float>()[i] *= -0.5f;
    tp.replay();
    Tape et;
    et.set_autocast(DType::bf16);
    GVar ye = matmul(et, et.param(X), et.param(W), false, tb);
    CHECK(test::rel_err(tp.value(y), et.value(ye)) == 0.0);
    CHECK(test::rel_err(tp.value(y), y0) > 0.1);
  }
  // off again: float32 products, bit-equal to a tape that never had autocast
  Tensor X = test::random_tensor({5, 8}, DType::f32, 93), W = test::random_tensor({6, 8}, DType::f32, 94);
  Tape a, b;
  a.set_autocast(DType::bf16);
  a.set_autocast(DType::f32);
  GVar ya = matmul(a, a.param(X), a.param(W), false, true), yb = matmul(b, b.param(X), b.param(W), false, true);
  CHECK(test::rel_err(a.value(ya), b.value(yb)) == 0.0);
  test::check_error([&] { a.set_autocast(DType::i32); }, {"[tape]", "autocast", "int32"});
}

}  // namespace ops_matmul
