// SPDX-License-Identifier: MIT OR Apache-2.0
// RmsNorm, LayerNorm, Rope and Dropout modules: options, names, and agreement with the layer
// builders they wrap.
#include "support/check.hpp"

namespace modules_norm {  // one unity source with the other modules files: its names stay its own

using namespace nn;

TEST_CASE("RmsNorm and LayerNorm options") {
  RmsNorm r = RmsNorm(6).eps(1e-6);
  CHECK(r.eps() == 1e-6);
  CHECK(test::paths(r.parameters()) == std::vector<std::string>{"weight"});
  CHECK(LayerNorm(6).num_params() == 12);
  CHECK(LayerNorm(6).without_bias().num_params() == 6);
  CHECK(LayerNorm(6).affine(false).num_params() == 0);

  Tensor X = test::random_tensor({2, 6}, DType::f64, 1);
  LayerNorm ln = LayerNorm(6).eps(1e-3);
  ln.to(DType::f64);
  GTape<cpu> tp;
  GVar x = tp.constant(X);
  CHECK(test::rel_err(tp.value(ln(tp, x)), tp.value(layernorm(tp, x, 1e-3))) < 1e-15);  // weight 1, bias 0
  r.to(DType::f64);
  CHECK(test::rel_err(tp.value(r(tp, x)), tp.value(rmsnorm(tp, x, 1e-6))) < 1e-15);
}

TEST_CASE("Rope module equals the layer with its tables; no parameters") {
  Rope rope = Rope(4).base(500.0).scale(0.5);
  CHECK(rope.num_params() == 0);
  Tensor X = test::random_tensor({2, 3, 5, 6}, DType::f64, 2);  // (B, H, T, D), dims 4 < D
  GTape<cpu> tp;
  GVar x = tp.constant(X);
  GVar a = rope(tp, x, 2);
  RopeTable t = rope_fill(5, 4, 500.0, 0.5, 2, DType::f64);
  GVar b = nn::rope(tp, x, tp.constant(t.cos), tp.constant(t.sin), false);
  CHECK(test::rel_err(tp.value(a), tp.value(b)) == 0.0);
  GVar c = Rope(4).traditional()(tp, x);
  GVar d = nn::rope(tp, x, rope_fill(tp, 5, 4, 10000.0, 1.0, 0, DType::f64).cos, rope_fill(tp, 5, 4, 10000.0, 1.0, 0, DType::f64).sin, true);
  CHECK(test::rel_err(tp.value(c), tp.value(d)) == 0.0);
}

TEST_CASE("Dropout follows train(); its mask is MLX's bernoulli for the tape's key") {
  Dropout d(0.25);
  Tensor X = Tensor::ones({4, 8}, DType::f32);
  random::seed(11);
  GTape<cpu> tp;
  GVar y = d(tp, tp.constant(X));
  // the key the tape drew is the global sequence's first one after seed(11)
  random::seed(11);
  Tensor mask = random::bernoulli(0.75, {4, 8}, random::next_key());
  const float* ys = tp.value(y).data<float>();
  const std::uint8_t* ms = mask.data<std::uint8_t>();
  for (int i = 0; i < 32; ++i) CHECK(ys[i] == (ms[i] ? 1.0f / 0.75f : 0.0f));
  d.train(false);
  GTape<cpu> t2;
  GVar x2 = t2.constant(X);
  CHECK(d(t2, x2).index == x2.index);  // identity in evaluation
  test::check_error([] { Dropout(1.0); }, {"[Dropout]", "[0, 1)"});
}

}  // namespace modules_norm
