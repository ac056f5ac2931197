// SPDX-License-Identifier: MIT OR Apache-2.0
// Linear and Embedding modules: MLX-identical initialisation (fixtures from
// tests/oracle/gen_random.py), names, forward against the layer builders.
#include "support/check.hpp"

namespace modules_linear {  // one unity source with the other modules files: its names stay its own

using namespace nn;

namespace {
std::vector<std::uint32_t> words(const nlohmann::json& j) { return j.get<std::vector<std::uint32_t>>(); }
}  // namespace

TEST_CASE("nn::random::seed(0); Linear(4, 8) holds MLX's weights bit for bit") {
  auto f = test::fixture("random/mlx_init.json");
  random::seed(f["linear_4_8"]["seed"].get<std::uint64_t>());
  Linear l(4, 8);
  CHECK(l.weight.shape() == Shape{8, 4});
  CHECK(test::f32_bits(l.weight.value) == words(f["linear_4_8"]["weight"]));
  CHECK(test::f32_bits(l.bias->value) == words(f["linear_4_8"]["bias"]));
  CHECK(l.weight.trainable);
}

TEST_CASE("Linear(...).without_bias() draws as MLX's nn.Linear(bias=False)") {
  auto f = test::fixture("random/mlx_init.json");
  random::seed(f["linear_3_5_nobias"]["seed"].get<std::uint64_t>());
  Linear l = Linear(3, 5).without_bias();
  CHECK_FALSE(l.bias.has_value());
  CHECK(test::f32_bits(l.weight.value) == words(f["linear_3_5_nobias"]["weight"]));
  // the sequence is where MLX's is: a second layer drawn now matches a fresh bias=False pair
  Tensor after = random::state();
  random::seed(f["linear_3_5_nobias"]["seed"].get<std::uint64_t>());
  (void)random::next_key();  // MLX's bias=False layer draws once
  CHECK(random::state().to_doubles() == after.to_doubles());
  CHECK(l.parameters().size() == 1);
}

TEST_CASE("a chain of layers after one seed draws MLX's sequence") {
  auto f = test::fixture("random/mlx_init.json")["chain_seed7"];
  random::seed(f["seed"].get<std::uint64_t>());
  Linear l1(4, 8);
  Embedding e(10, 6);
  Linear l2(8, 3);
  CHECK(test::f32_bits(l1.weight.value) == words(f["l1_weight"]));
  CHECK(test::f32_bits(l1.bias->value) == words(f["l1_bias"]));
  CHECK(test::f32_bits(e.weight.value) == words(f["emb_weight"]));
  CHECK(test::f32_bits(l2.weight.value) == words(f["l2_weight"]));
  CHECK(test::f32_bits(l2.bias->value) == words(f["l2_bias"]));
  CHECK(random::state().to_doubles() == Tensor::from<std::uint32_t>({2}, f["final_state"].get<std::vector<std::uint32_t>>()).to_doubles());
}

TEST_CASE("Embedding(10, 6) holds MLX's normal draws; as_linear is the tied head") {
  auto f = test::fixture("random/mlx_init.json");
  random::seed(f["embedding_10_6"]["seed"].get<std::uint64_t>());
  Embedding e(10, 6);
  CHECK(test::f32_bits(e.weight.value) == words(f["embedding_10_6"]["weight"]));
  e.to(DType::f64);
  GTape<cpu> tp;
  GVar ids = tp.constant(Tensor::from<std::int32_t>({2, 3}, {1, 4, 4, 0, 9, 2}));
  GVar h = e(tp, ids);
  CHECK(tp.shape(h) == Shape{2, 3, 6});
  GVar logits = e.as_linear(tp, h);
  CHECK(tp.shape(logits) == Shape{2, 3, 10});
  GVar l = sum(tp, logits);
  tp.backward(l);
  // the table is one leaf used twice: its gradient holds both contributions
  auto w = tp.find_param(e.weight.value);
  REQUIRE(w.has_value());
  CHECK(tp.grad(*w).shape() == Shape{10, 6});
}

TEST_CASE("Linear forward equals x W^T + b from primitives") {
  random::seed(3);
  Linear l(5, 4);
  l.to(DType::f64);
  Tensor X = test::random_tensor({2, 3, 5}, DType::f64, 9);
  GTape<cpu> tp;
  GVar x = tp.constant(X);
  GVar y = l(tp, x);
  GVar r = add(tp, matmul(tp, x, tp.constant(l.weight.value), false, true), tp.constant(l.bias->value));
  CHECK(test::rel_err(tp.value(y), tp.value(r)) == 0.0);
  CHECK(l.in_features() == 5);
  CHECK(l.out_features() == 4);
}

}  // namespace modules_linear
