// SPDX-License-Identifier: MIT OR Apache-2.0
// The tape: leaves, accumulation of gradients on fan-out, replay, errors.
#include "support/check.hpp"

namespace core_tape {  // one unity source with the other core files: its names stay its own

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

TEST_CASE("each primitive keeps its own attribute struct; reading another type is an error") {
  NodeAttrs a;
  a.set(UnaryAttrs{Unary::pow, 2.5});
  CHECK(a.get<UnaryAttrs>().op == Unary::pow);
  CHECK(a.get<UnaryAttrs>().arg == 2.5);
  test::check_error([&] { a.get<SoftmaxAttrs>(); }, {"[tape]", "attributes"});
  a.set(AttentionAttrs{2, 8, 4, 2, 16, 0.25, true});
  CHECK(a.get<AttentionAttrs>().KV == 2);
  CHECK(a.get<AttentionAttrs>().causal);
  // on the tape: a recorded node holds what its builder gave it
  GTape<cpu> tp;
  const Tensor X = test::random_tensor({3, 4}, DType::f64, 5);
  GVar x = tp.param(X);
  GVar y = softmax_cross_entropy(tp, x, tp.constant(Tensor::from<std::int64_t>({3}, {1, 0, -7})), Reduction::sum, -7);
  CHECK(detail::attrs_of<CrossEntropyAttrs>(tp.node(y)).ignore_index == -7);
  CHECK(detail::attrs_of<CrossEntropyAttrs>(tp.node(y)).reduction == Reduction::sum);
}

TEST_CASE("the tape resolves gradient aliasing: inputs that are one tensor share one zeroed, accumulating buffer") {
  GTape<cpu> tp;
  const Tensor X = test::random_tensor({2, 3}, DType::f64, 6), W = test::random_tensor({2, 3}, DType::f64, 7);
  const Tensor C = test::random_tensor({2, 3}, DType::f64, 8);
  GVar x = tp.param(X), w = tp.param(W);  // params bind their tensors by reference: keep them alive
  GVar same = fused_swiglu(tp, x, x);
  auto g = tp.grad_outs<2>(tp.node(same));
  REQUIRE(g[0].g != nullptr);
  CHECK(g[0].g == g[1].g);
  CHECK((g[0].acc && g[1].acc));
  for (double v : g[0].g->to_doubles()) CHECK(v == 0.0);
  GVar apart = fused_swiglu(tp, x, w);
  auto h = tp.grad_outs<2>(tp.node(apart));
  CHECK(h[0].g != h[1].g);
  CHECK(h[0].acc);     // x's buffer already holds the first node's contribution in this sweep
  CHECK(!h[1].acc);    // w's first
  // an input without a gradient gets no destination
  GVar c = fused_swiglu(tp, tp.constant(C), w);
  auto k = tp.grad_outs<2>(tp.node(c));
  CHECK(k[0].g == nullptr);
}

TEST_CASE("the tape's float dtype: set, or from the first float32/float64 leaf; builders default to it") {
  GTape<cpu> tp;
  CHECK(tp.float_dtype() == DType::f32);
  tp.constant(Tensor::zeros({2}, DType::bf16));  // a storage type: not the compute dtype
  tp.input(Tensor::zeros({2}, DType::i64));
  CHECK(tp.float_dtype() == DType::f32);
  const Tensor p64 = Tensor::zeros({2}, DType::f64), p32 = Tensor::zeros({3}, DType::f32);
  tp.param(p64);
  CHECK(tp.float_dtype() == DType::f64);
  tp.param(p32);  // the first one decides
  CHECK(tp.float_dtype() == DType::f64);
  CHECK(tp.dtype(causal_mask_fill(tp, 3)) == DType::f64);
  CHECK(tp.dtype(rope_fill(tp, 3, 4).sin) == DType::f64);
  CHECK(tp.dtype(causal_mask_fill(tp, 3, DType::f32)) == DType::f32);  // an explicit dtype wins
  tp.clear();
  CHECK(tp.float_dtype() == DType::f32);
  tp.set_float_dtype(DType::f64);
  tp.param(p32);
  CHECK(tp.float_dtype() == DType::f64);
  tp.clear();
  CHECK(tp.float_dtype() == DType::f64);  // set explicitly: kept
  test::check_error([&] { tp.set_float_dtype(DType::bf16); }, {"[tape]", "bfloat16"});
}

}  // namespace core_tape
