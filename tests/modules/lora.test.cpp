// SPDX-License-Identifier: MIT OR Apache-2.0
// LoraLinear: mlx-lm's init and names, frozen base, scale and rslora, fuse, dropout.
#include "support/check.hpp"

namespace modules_lora {  // one unity source with the other modules files: its names stay its own

using namespace nn;

TEST_CASE("LoraLinear::from_base draws mlx-lm's lora_a and zero lora_b, and freezes the base") {
  auto f = test::fixture("random/mlx_init.json")["lora_from_base_16_8_r4"];
  random::seed(f["seed"].get<std::uint64_t>());
  Linear base(16, 8);
  LoraLinear l = LoraLinear::from_base(base, 4);
  CHECK(test::f32_bits(l.linear().weight.value) == f["base_weight"].get<std::vector<std::uint32_t>>());
  CHECK(test::f32_bits(l.lora_a.value) == f["lora_a"].get<std::vector<std::uint32_t>>());
  CHECK(l.lora_a.shape() == Shape{16, 4});
  CHECK(l.lora_b.shape() == Shape{4, 8});
  CHECK(l.lora_b.value.to_doubles() == std::vector<double>(32, 0.0));
  CHECK(random::state().to_doubles() ==
        Tensor::from<std::uint32_t>({2}, f["final_state"].get<std::vector<std::uint32_t>>()).to_doubles());
  CHECK(test::paths(l.parameters()) == std::vector<std::string>{"linear.weight", "linear.bias", "lora_a", "lora_b"});
  CHECK(test::paths(l.trainable_parameters()) == std::vector<std::string>{"lora_a", "lora_b"});
}

TEST_CASE("LoraLinear computes base + scale (x a) b; fused() merges it; rslora divides by sqrt(r)") {
  random::seed(1);
  LoraLinear l = LoraLinear::from_base(Linear(6, 5), 4).scale(2.0);
  l.to(DType::f64);
  l.lora_b.value = test::random_tensor({4, 5}, DType::f64, 3);  // non-zero so the branch shows
  Tensor X = test::random_tensor({3, 6}, DType::f64, 4);
  auto run = [&](const auto& layer) {
    GTape<cpu> tp;
    return tp.value(layer(tp, tp.constant(X))).clone();
  };
  Tensor y = run(l);
  Tensor expect;
  {
    GTape<cpu> tp;
    GVar x = tp.constant(X);
    GVar base = l.linear()(tp, x);
    GVar branch = matmul(tp, matmul(tp, x, tp.constant(l.lora_a.value)), tp.constant(l.lora_b.value));
    expect = tp.value(add(tp, base, nn::scale(tp, branch, 2.0))).clone();
  }
  CHECK(test::rel_err(y, expect) < 1e-15);
  CHECK(test::rel_err(run(l.fused()), y) < 1e-14);
  CHECK(l.effective_scale() == 2.0);
  l.rslora();
  CHECK(l.effective_scale() == doctest::Approx(1.0));  // 2 / sqrt(4)
}

TEST_CASE("LoraLinear gradients reach only the adapters") {
  random::seed(2);
  LoraLinear l = LoraLinear::from_base(Linear(4, 3), 2);
  l.to(DType::f64);
  Tensor X = test::random_tensor({5, 4}, DType::f64, 1);
  auto [loss, g] = value_and_grad(l, [&](GTape<cpu>& tp, const LoraLinear& m) {
    GVar y = m(tp, tp.constant(X));
    return sum(tp, mul(tp, y, y));
  });
  CHECK_FALSE(g.linear().weight.value.defined());
  CHECK(g.lora_a.value.defined());
  CHECK(g.lora_b.value.shape() == Shape{2, 3});
  // lora_b starts at zero, so d/d lora_a = 0 and d/d lora_b != 0
  CHECK(test::rel_err(g.lora_a.value, Tensor::zeros({4, 2}, DType::f64)) == 0.0);
  CHECK(g.lora_b.value.to_doubles() != std::vector<double>(6, 0.0));
}

TEST_CASE("LoraLinear dropout applies to the adapter input only, and only in training") {
  random::seed(5);
  LoraLinear l = LoraLinear::from_base(Linear(8, 4), 2).dropout(0.5);
  l.lora_b.value = test::random_tensor({2, 4}, DType::f32, 7);
  Tensor X = test::random_tensor({3, 8}, DType::f32, 8);
  GTape<cpu> t1;
  Tensor train = t1.value(l(t1, t1.constant(X))).clone();
  l.train(false);
  GTape<cpu> t2;
  Tensor eval = t2.value(l(t2, t2.constant(X))).clone();
  GTape<cpu> t3;
  Tensor eval2 = t3.value(l(t3, t3.constant(X))).clone();
  CHECK(test::rel_err(eval, eval2) == 0.0);
  CHECK(test::rel_err(train, eval) > 0.0);
}

}  // namespace modules_lora
