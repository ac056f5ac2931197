// SPDX-License-Identifier: MIT OR Apache-2.0
// Dropout on the tape (ops/random.hpp, layers/dropout.hpp): MLX's masks for the same key, its
// gradient, replay with a new key in the slot, the identity cases and the errors.
#include "support/check.hpp"

namespace random_dropout {  // one unity source with the other random files: its names stay its own

using namespace nn;
using nlohmann::json;

namespace {

Tensor key_of(const json& j) {
  return Tensor::from<std::uint32_t>({2}, {j.at(0).get<std::uint32_t>(), j.at(1).get<std::uint32_t>()});
}
Shape shape_of(const json& j) { return Shape(j.get<std::vector<std::int64_t>>()); }

/// A float32 tensor from the fixture's bit patterns.
Tensor f32_from_bits(const Shape& s, const json& bits) {
  std::vector<std::uint32_t> w = bits.get<std::vector<std::uint32_t>>();
  Tensor t = Tensor::from<std::uint32_t>(s, w);
  Tensor f = Tensor::empty(s, DType::f32);
  std::memcpy(f.raw(), t.raw(), t.nbytes());
  return f;
}
std::vector<std::uint32_t> f32_bits(const Tensor& t) {
  std::vector<std::uint32_t> v(static_cast<std::size_t>(t.numel()));
  std::memcpy(v.data(), t.raw(), t.nbytes());
  return v;
}

const json& fx() {
  static const json j = test::fixture("random/mlx_dropout.json");
  return j;
}

}  // namespace

TEST_CASE("the dropout mask is mx.random.bernoulli(1 - p, shape, key) for the same key") {
  for (const auto& c : fx().at("masks")) {
    const Shape shape = shape_of(c.at("shape"));
    const double p = c.at("p").get<double>();
    const std::vector<int> want = c.at("mask").get<std::vector<int>>();
    GTape<cpu> tp;
    GVar key = tp.input(key_of(c.at("key")));
    GVar x = tp.constant(Tensor::ones(shape, DType::f32));
    const Tensor& y = tp.value(dropout(tp, x, p, key));
    const Tensor& m = tp.value(bernoulli(tp, 1 - p, shape, key));
    Tensor eager = random::bernoulli(1 - p, shape, key_of(c.at("key")));
    const float scale = static_cast<float>(1.0 / (1.0 - p));
    std::size_t bad = 0;
    for (std::int64_t i = 0; i < shape.numel(); ++i) {
      const int w = want[static_cast<std::size_t>(i)];
      bad += (y.data<float>()[i] == (w ? scale : 0.0f)) ? 0 : 1;
      bad += m.data<std::uint8_t>()[i] == w ? 0 : 1;
      bad += eager.data<std::uint8_t>()[i] == w ? 0 : 1;
    }
    CHECK_MESSAGE(bad == 0, "p " << p << " shape " << shape);
  }
}

TEST_CASE("nn::dropout gives nn.Dropout's output bit for bit (the key the global sequence hands it)") {
  for (const auto& c : fx().at("layer")) {
    const Shape shape = shape_of(c.at("shape"));
    Tensor x = f32_from_bits(shape, c.at("x"));
    // nn.Dropout drew with the global sequence's next key after seed(s); so does next_key().
    random::seed(c.at("seed").get<std::uint64_t>());
    Tensor k = random::next_key();
    CHECK(k.data<std::uint32_t>()[0] == c.at("key").at(0).get<std::uint32_t>());
    CHECK(k.data<std::uint32_t>()[1] == c.at("key").at(1).get<std::uint32_t>());
    GTape<cpu> tp;
    GVar y = dropout(tp, tp.constant(x), c.at("p").get<double>(), tp.input(k));
    CHECK(f32_bits(tp.value(y)) == c.at("y").get<std::vector<std::uint32_t>>());
  }
}

TEST_CASE("dropout's gradient: finite differences in double with a fixed key") {
  Tensor X = test::random_tensor({5, 7}, DType::f64, 11);
  Tensor W = test::random_tensor({5, 7}, DType::f64, 12);
  const Tensor key = random::key(99);
  const double p = 0.3;
  auto f = [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
    // tanh before the dropout and a weight after it, so the mask meets a non-trivial cotangent.
    return sum(tp, mul(tp, dropout(tp, tanh(tp, v[0]), p, tp.input(key)), v[1]));
  };
  CHECK(test::gradcheck("dropout p=0.3", {X, W}, f) < 1e-7);

  // And the exact form: d/dx sum(dropout(x) * w) = w * mask / (1 - p).
  GTape<cpu> tp;
  GVar x = tp.param(X);
  GVar w = tp.constant(W);
  GVar kv = tp.input(key);
  tp.backward(sum(tp, mul(tp, dropout(tp, x, p, kv), w)));
  const Tensor mask = random::bernoulli(1 - p, {5, 7}, key);
  const double* g = tp.grad(x).data<double>();
  for (std::int64_t i = 0; i < 35; ++i) {
    const double want = W.data<double>()[i] * (mask.data<std::uint8_t>()[i] ? 1.0 / (1.0 - p) : 0.0);
    CHECK(g[i] == want);
  }
}

TEST_CASE("dropout's gradient accumulates with another use of x") {
  Tensor X = test::random_tensor({4, 3}, DType::f64, 21);
  const Tensor key = random::key(5);
  double worst = test::gradcheck("x + dropout(x)", {X}, [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
    GVar k = tp.input(key);
    return sum(tp, mul(tp, add(tp, v[0], dropout(tp, v[0], 0.5, k)), v[0]));
  });
  CHECK(worst < 1e-7);
}

TEST_CASE("replay with a new key in the slot draws a new mask, equal to an eager run with that key") {
  const Shape s{6, 9};
  Tensor X = test::random_tensor(s, DType::f32, 3);
  Tensor W = test::random_tensor(s, DType::f32, 4);
  auto build = [&](GTape<cpu>& tp, const Tensor& k, GVar& x, GVar& key, GVar& y) {
    x = tp.param(X);
    key = tp.input(k);
    y = dropout(tp, x, 0.4, key);
    GVar loss = sum(tp, mul(tp, y, tp.constant(W)));
    tp.backward(loss);
  };
  random::seed(1);
  Tensor k1 = random::next_key(), k2 = random::next_key();

  GTape<cpu> tp;
  GVar x, key, y;
  build(tp, k1, x, key, y);
  const std::vector<std::uint32_t> y1 = f32_bits(tp.value(y));
  const Tensor mask_buffer = tp.node(y).saved.at(0);
  const std::size_t nodes = tp.size();

  tp.set(key, k2);
  tp.replay();
  CHECK(tp.size() == nodes);
  CHECK(tp.node(y).saved.at(0).shares_storage(mask_buffer));  // redrawn in place, no allocation
  const std::vector<std::uint32_t> y2 = f32_bits(tp.value(y));
  CHECK(y2 != y1);

  GTape<cpu> eager;
  GVar ex, ek, ey;
  build(eager, k2, ex, ek, ey);
  CHECK(f32_bits(eager.value(ey)) == y2);
  CHECK(f32_bits(eager.grad(ex)) == f32_bits(tp.grad(x)));

  // Back to the first key: the first mask again.
  tp.set(key, k1);
  tp.replay();
  CHECK(f32_bits(tp.value(y)) == y1);
}

TEST_CASE("p = 0 and evaluation mode are the identity; the keep rate is 1 - p") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::ones({100000}, DType::f32));
  GVar key = tp.input(random::key(8));
  const std::size_t before = tp.size();
  CHECK(dropout(tp, x, 0.0, key).index == x.index);
  CHECK(dropout(tp, x, 0.5, key, /*training=*/false).index == x.index);
  CHECK(tp.size() == before);
  const Tensor& y = tp.value(dropout(tp, x, 0.25, key));
  std::int64_t kept = 0;
  for (std::int64_t i = 0; i < y.numel(); ++i) kept += y.data<float>()[i] != 0.0f;
  CHECK(std::abs(static_cast<double>(kept) / 100000.0 - 0.75) < 0.01);
}

TEST_CASE("dropout refuses p outside [0, 1) and keys that are not MLX keys") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::ones({3}, DType::f32));
  GVar key = tp.input(random::key(0));
  for (double p : {1.0, -0.1, 1.5, std::nan("")})
    test::check_error([&] { dropout(tp, x, p, key); }, {"[dropout]", "not in [0, 1)"});
  GVar bad = tp.input(Tensor::from<std::int32_t>({2}, {0, 1}));
  test::check_error([&] { dropout(tp, x, 0.5, bad); }, {"[dropout]", "uint32", "int32"});
  GVar bad_shape = tp.input(Tensor::from<std::uint32_t>({4}, {0, 1, 2, 3}));
  test::check_error([&] { dropout(tp, x, 0.5, bad_shape); }, {"[dropout]", "(4)"});
  GVar ints = tp.constant(Tensor::from<std::int32_t>({2}, {1, 2}));
  test::check_error([&] { dropout(tp, ints, 0.5, key); }, {"[dropout]", "int32"});
  test::check_error([&] { bernoulli(tp, 1.5, Shape{3}, key); }, {"[bernoulli]", "1.5"});
}

}  // namespace random_dropout
