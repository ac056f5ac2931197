// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/norm.hpp: rmsnorm and layernorm (affine, gain only, plain).
#include "layer_case.hpp"

namespace layers_norm {  // one unity source with the other layers files: its names stay its own

using namespace nn;

TEST_CASE("rmsnorm and layernorm match PyTorch (float64 and float32)") {
  auto eps = [](auto& c) { return c["eps"].template get<double>(); };
  test::check_layer_case("rmsnorm/weight", [&](auto& tp, auto& v, auto& c) { return rmsnorm(tp, v["x"], v["w"], eps(c)); });
  test::check_layer_case("rmsnorm/noweight", [&](auto& tp, auto& v, auto& c) { return rmsnorm(tp, v["x"], eps(c)); });
  test::check_layer_case("layernorm/affine",
                         [&](auto& tp, auto& v, auto& c) { return layernorm(tp, v["x"], v["w"], v["b"], eps(c)); });
  test::check_layer_case("layernorm/nobias", [&](auto& tp, auto& v, auto& c) { return layernorm(tp, v["x"], v["w"], eps(c)); });
  test::check_layer_case("layernorm/plain", [&](auto& tp, auto& v, auto& c) { return layernorm(tp, v["x"], eps(c)); });
}

TEST_CASE("norms: shapes") {
  GTape<cpu> tp;
  GVar x = tp.constant(test::random_tensor({2, 3, 6}, DType::f32, 1));
  GVar w = tp.constant(Tensor::ones({6}));
  GVar b = tp.constant(Tensor::zeros({6}));
  CHECK(tp.shape(rmsnorm(tp, x, w, 1e-6)) == Shape{2, 3, 6});
  CHECK(tp.shape(rmsnorm(tp, x)) == Shape{2, 3, 6});
  CHECK(tp.shape(layernorm(tp, x, w, b)) == Shape{2, 3, 6});
  CHECK(tp.shape(layernorm(tp, x, w)) == Shape{2, 3, 6});
  CHECK(tp.shape(layernorm(tp, x)) == Shape{2, 3, 6});
  GVar v = tp.constant(test::random_tensor({6}, DType::f32, 2));
  CHECK(tp.shape(rmsnorm(tp, v, w)) == Shape{6});
}

TEST_CASE("norms: finite differences") {
  Tensor x = test::random_tensor({3, 4, 6}, DType::f64, 31, -2, 2), w = test::random_tensor({6}, DType::f64, 32, 0.5, 1.5);
  Tensor b = test::random_tensor({6}, DType::f64, 33);
  using V = std::vector<GVar>;
  double e[5] = {
      test::layer_gradcheck("rmsnorm", {x, w}, [](GTape<cpu>& tp, const V& v) { return rmsnorm(tp, v[0], v[1], 1e-5); }),
      test::layer_gradcheck("rmsnorm (no weight)", {x}, [](GTape<cpu>& tp, const V& v) { return rmsnorm(tp, v[0], 1e-5); }),
      test::layer_gradcheck("layernorm", {x, w, b},
                            [](GTape<cpu>& tp, const V& v) { return layernorm(tp, v[0], v[1], v[2], 1e-5); }),
      test::layer_gradcheck("layernorm (no bias)", {x, w},
                            [](GTape<cpu>& tp, const V& v) { return layernorm(tp, v[0], v[1], 1e-5); }),
      test::layer_gradcheck("layernorm (no affine)", {x}, [](GTape<cpu>& tp, const V& v) { return layernorm(tp, v[0], 1e-5); }),
  };
  for (double err : e) CHECK(err <= 1e-7);
}

TEST_CASE("norms: errors name the layer and the shapes") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::zeros({2, 3, 6}, DType::f32));
  GVar w = tp.constant(Tensor::ones({5}));
  GVar w6 = tp.constant(Tensor::ones({6}));
  GVar ids = tp.constant(Tensor::from<std::int32_t>({2}, {1, 2}));
  test::check_error([&] { rmsnorm(tp, x, w); }, {"[rmsnorm]", "weight (5)", "(2, 3, 6)"});
  test::check_error([&] { layernorm(tp, x, w6, w); }, {"[layernorm]", "bias (5)", "(2, 3, 6)"});
  test::check_error([&] { layernorm(tp, ids); }, {"[layernorm]", "int32", "(2)"});
  test::check_error([&] { rmsnorm(tp, x, -1.0); }, {"[rmsnorm]", "eps"});
}

}  // namespace layers_norm
