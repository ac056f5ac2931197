// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/linear.hpp: linear (weight (out, in)) and lora_linear (mlx-lm orientation).
#include "layer_case.hpp"

namespace layers_linear {  // one unity source with the other layers files: its names stay its own

using namespace nn;

TEST_CASE("linear and lora_linear match PyTorch (float64 and float32)") {
  test::check_layer_case("linear/nobias", [](auto& tp, auto& v, auto&) { return linear(tp, v["x"], v["w"]); });
  test::check_layer_case("linear/bias", [](auto& tp, auto& v, auto&) { return linear(tp, v["x"], v["w"], v["b"]); });
  test::check_layer_case("linear/vector", [](auto& tp, auto& v, auto&) { return linear(tp, v["x"], v["w"], v["b"]); });
  test::check_layer_case("lora_linear/nobias", [](auto& tp, auto& v, auto& c) {
    return lora_linear(tp, v["x"], v["w0"], v["a"], v["b"], c["scale"].template get<double>());
  });
  test::check_layer_case("lora_linear/bias", [](auto& tp, auto& v, auto& c) {
    return lora_linear(tp, v["x"], v["w0"], v["b0"], v["a"], v["b"], c["scale"].template get<double>());
  });
}

TEST_CASE("linear: shapes, and the weight is read transposed without a copy") {
  GTape<cpu> tp;
  GVar x = tp.constant(test::random_tensor({2, 3, 5}, DType::f32, 1));
  GVar w = tp.constant(test::random_tensor({4, 5}, DType::f32, 2));
  GVar b = tp.constant(test::random_tensor({4}, DType::f32, 3));
  const std::size_t before = tp.size();
  GVar y = linear(tp, x, w);
  CHECK(tp.size() == before + 1);  // one matmul node: no transpose copy of w
  CHECK(tp.shape(y) == Shape{2, 3, 4});
  CHECK(tp.shape(linear(tp, x, w, b)) == Shape{2, 3, 4});
  GVar x2 = tp.constant(test::random_tensor({6, 5}, DType::f32, 4));
  CHECK(tp.shape(linear(tp, x2, w)) == Shape{6, 4});
  GVar a = tp.constant(test::random_tensor({5, 2}, DType::f32, 5));
  GVar bb = tp.constant(test::random_tensor({2, 4}, DType::f32, 6));
  CHECK(tp.shape(lora_linear(tp, x, w, a, bb, 2.0)) == Shape{2, 3, 4});
  CHECK(tp.shape(lora_linear(tp, x, w, b, a, bb, 2.0)) == Shape{2, 3, 4});
}

TEST_CASE("linear: finite differences") {
  Tensor x = test::random_tensor({2, 3, 5}, DType::f64, 11), w = test::random_tensor({4, 5}, DType::f64, 12);
  Tensor b = test::random_tensor({4}, DType::f64, 13);
  double e1 = test::layer_gradcheck("linear", {x, w}, [](GTape<cpu>& tp, const std::vector<GVar>& v) {
    return linear(tp, v[0], v[1]);
  });
  double e2 = test::layer_gradcheck("linear+bias", {x, w, b}, [](GTape<cpu>& tp, const std::vector<GVar>& v) {
    return linear(tp, v[0], v[1], v[2]);
  });
  CHECK(e1 <= 1e-7);
  CHECK(e2 <= 1e-7);
}

TEST_CASE("lora_linear: finite differences, and a zero B leaves the base layer") {
  Tensor x = test::random_tensor({2, 3, 5}, DType::f64, 21), w = test::random_tensor({4, 5}, DType::f64, 22);
  Tensor b0 = test::random_tensor({4}, DType::f64, 23), a = test::random_tensor({5, 2}, DType::f64, 24);
  Tensor bb = test::random_tensor({2, 4}, DType::f64, 25);
  double e = test::layer_gradcheck("lora_linear", {x, w, b0, a, bb}, [](GTape<cpu>& tp, const std::vector<GVar>& v) {
    return lora_linear(tp, v[0], v[1], v[2], v[3], v[4], 1.5);
  });
  CHECK(e <= 1e-7);
  GTape<cpu> tp;
  GVar X = tp.constant(x), W = tp.constant(w), A = tp.constant(a), Z = tp.constant(Tensor::zeros({2, 4}, DType::f64));
  CHECK(test::rel_err(tp.value(lora_linear(tp, X, W, A, Z, 20.0)), tp.value(linear(tp, X, W))) == 0.0);
}

TEST_CASE("linear: shape errors name the layer and the shapes") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::zeros({2, 3, 5}, DType::f32));
  GVar w = tp.constant(Tensor::zeros({4, 6}, DType::f32));
  GVar w5 = tp.constant(Tensor::zeros({4, 5}, DType::f32));
  GVar b = tp.constant(Tensor::zeros({3}, DType::f32));
  GVar w64 = tp.constant(Tensor::zeros({4, 5}, DType::f64));
  test::check_error([&] { linear(tp, x, w); }, {"[linear]", "(2, 3, 5)", "(4, 6)"});
  test::check_error([&] { linear(tp, x, w5, b); }, {"[linear]", "bias (3)", "(4, 5)"});
  test::check_error([&] { linear(tp, x, w64); }, {"[linear]", "float32", "float64"});
  GVar a = tp.constant(Tensor::zeros({4, 2}, DType::f32));  // wrong: (out, r), PEFT's orientation
  GVar bb = tp.constant(Tensor::zeros({2, 4}, DType::f32));
  test::check_error([&] { lora_linear(tp, x, w5, a, bb, 1.0); }, {"[lora_linear]", "(4, 2)", "(2, 4)", "(4, 5)"});
}

}  // namespace layers_linear
