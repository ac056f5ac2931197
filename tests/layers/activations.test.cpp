// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/activations.hpp: silu, gelu (exact and MLX's two approximations), swiglu; relu,
// softmax and log_softmax through their primitive names.
#include "layer_case.hpp"

namespace layers_activations {  // one unity source with the other layers files: its names stay its own

using namespace nn;

TEST_CASE("activations match PyTorch / MLX's definitions (float64 and float32)") {
  test::check_layer_case("act/relu", [](auto& tp, auto& v, auto&) { return relu(tp, v["x"]); });
  test::check_layer_case("act/silu", [](auto& tp, auto& v, auto&) { return silu(tp, v["x"]); });
  test::check_layer_case("act/gelu", [](auto& tp, auto& v, auto&) { return gelu(tp, v["x"]); });
  test::check_layer_case("act/gelu_approx", [](auto& tp, auto& v, auto&) { return gelu_approx(tp, v["x"]); });
  test::check_layer_case("act/gelu_fast_approx", [](auto& tp, auto& v, auto&) { return gelu_fast_approx(tp, v["x"]); });
  test::check_layer_case("act/softmax", [](auto& tp, auto& v, auto&) { return softmax(tp, v["x"]); });
  test::check_layer_case("act/log_softmax", [](auto& tp, auto& v, auto&) { return log_softmax(tp, v["x"]); });
  test::check_layer_case("act/swiglu", [](auto& tp, auto& v, auto&) { return swiglu(tp, v["gate"], v["up"]); });
}

TEST_CASE("activations: shapes and finite differences") {
  Tensor x = test::random_tensor({3, 7}, DType::f64, 41, -4, 4), u = test::random_tensor({3, 7}, DType::f64, 42);
  using V = std::vector<GVar>;
  using F = GVar (*)(GTape<cpu>&, GVar);
  const std::pair<const char*, F> unaries[] = {
      {"silu", [](GTape<cpu>& tp, GVar a) { return silu(tp, a); }},
      {"gelu", [](GTape<cpu>& tp, GVar a) { return gelu(tp, a); }},
      {"gelu_approx", [](GTape<cpu>& tp, GVar a) { return gelu_approx(tp, a); }},
      {"gelu_fast_approx", [](GTape<cpu>& tp, GVar a) { return gelu_fast_approx(tp, a); }},
      {"relu", [](GTape<cpu>& tp, GVar a) { return relu(tp, a); }},
      {"softmax", [](GTape<cpu>& tp, GVar a) { return softmax(tp, a); }},
      {"log_softmax", [](GTape<cpu>& tp, GVar a) { return log_softmax(tp, a); }},
  };
  for (auto [name, fn] : unaries) {
    GTape<cpu> tp;
    CHECK(tp.shape(fn(tp, tp.constant(x))) == Shape{3, 7});
    CHECK(test::layer_gradcheck(name, {x}, [fn = fn](GTape<cpu>& tp, const V& v) { return fn(tp, v[0]); }) <= 1e-7);
  }
  CHECK(test::layer_gradcheck("swiglu", {x, u}, [](GTape<cpu>& tp, const V& v) { return swiglu(tp, v[0], v[1]); }) <= 1e-7);
}

TEST_CASE("activations: errors name the layer") {
  GTape<cpu> tp;
  GVar g = tp.constant(Tensor::zeros({2, 3}));
  GVar u = tp.constant(Tensor::zeros({3, 2}));
  GVar ids = tp.constant(Tensor::from<std::int64_t>({2}, {1, 2}));
  test::check_error([&] { swiglu(tp, g, u); }, {"[swiglu]", "(2, 3)", "(3, 2)"});
  test::check_error([&] { silu(tp, ids); }, {"[silu]", "int64"});
  test::check_error([&] { gelu(tp, ids); }, {"[gelu]", "int64"});
}

}  // namespace layers_activations
