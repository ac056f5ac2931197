// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/rope.hpp: rope_fill tables, rope in NEOX and traditional form, partial dims.
#include "layer_case.hpp"

namespace layers_rope {  // one unity source with the other layers files: its names stay its own

using namespace nn;

namespace {
GVar rope_case(GTape<cpu>& tp, test::Vars& v, const nlohmann::json& c) {
  const DType dt = tp.dtype(v["x"]);
  RopeVars t = rope_fill(tp, tp.shape(v["x"]).dim(-2), c["dims"].get<std::int64_t>(), c["base"].get<double>(),
                         c["scale"].get<double>(), c["offset"].get<std::int64_t>(), dt);
  return rope(tp, v["x"], t.cos, t.sin, c["traditional"].get<bool>());
}
}  // namespace

TEST_CASE("rope matches the RoFormer definition in PyTorch (NEOX and traditional, partial dims)") {
  for (const char* name : {"rope/neox_partial", "rope/neox_full", "rope/traditional_partial", "rope/traditional_full"})
    test::check_layer_case(name, rope_case);
}

TEST_CASE("rope_fill: angles (t + offset) * scale * base^(-i/(dims/2))") {
  RopeTable t = rope_fill(4, 6, 100.0, 0.5, 2, DType::f64);
  CHECK(t.cos.shape() == Shape{4, 3});
  CHECK(t.sin.shape() == Shape{4, 3});
  for (int p = 0; p < 4; ++p)
    for (int i = 0; i < 3; ++i) {
      double a = (p + 2) * 0.5 * std::pow(100.0, -i / 3.0);
      CHECK(t.cos.data<double>()[p * 3 + i] == doctest::Approx(std::cos(a)).epsilon(1e-15));
      CHECK(t.sin.data<double>()[p * 3 + i] == doctest::Approx(std::sin(a)).epsilon(1e-15));
    }
  CHECK(rope_fill(3, 4).cos.dtype() == DType::f32);
  GTape<cpu> tp;
  RopeVars v = rope_fill(tp, 3, 4, 10000.0, 1.0, 0, DType::f64);
  CHECK_FALSE(tp.requires_grad(v.cos));
  CHECK(tp.shape(v.sin) == Shape{3, 2});
  test::check_error([] { rope_fill(3, 5); }, {"[rope_fill]", "dims = 5"});
}

TEST_CASE("rope: position 0 is the identity, shapes, finite differences") {
  Tensor x = test::random_tensor({2, 3, 5, 10}, DType::f64, 51);
  GTape<cpu> tp;
  RopeVars t = rope_fill(tp, 5, 8, 10000.0, 1.0, 0, DType::f64);
  for (bool trad : {false, true}) {
    GVar y = rope(tp, tp.constant(x), t.cos, t.sin, trad);
    CHECK(tp.shape(y) == Shape{2, 3, 5, 10});
    const double* yd = tp.value(y).data<double>();
    const double* xd = x.data<double>();
    for (int j = 0; j < 10; ++j) CHECK(yd[j] == xd[j]);  // (b, h, t=0): angle 0
    for (int j = 8; j < 10; ++j) CHECK(yd[40 + j] == xd[40 + j]);  // pass-through features
  }
  RopeTable tab = rope_fill(5, 8, 10000.0, 1.0, 0, DType::f64);
  using V = std::vector<GVar>;
  for (bool trad : {false, true}) {
    double e = test::layer_gradcheck(trad ? "rope (traditional)" : "rope (neox)", {x}, [&](GTape<cpu>& tp2, const V& v) {
      return rope(tp2, v[0], tp2.constant(tab.cos), tp2.constant(tab.sin), trad);
    });
    CHECK(e <= 1e-7);
  }
}

TEST_CASE("rope: errors name the layer and the shapes") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::zeros({2, 5, 6}));
  RopeVars big = rope_fill(tp, 5, 8);
  RopeVars other_t = rope_fill(tp, 4, 6);
  RopeVars f64 = rope_fill(tp, 5, 6, 10000.0, 1.0, 0, DType::f64);
  test::check_error([&] { rope(tp, x, big.cos, big.sin); }, {"[rope]", "(5, 4)", "(2, 5, 6)"});
  test::check_error([&] { rope(tp, x, other_t.cos, other_t.sin); }, {"[rope]", "(4, 3)", "(2, 5, 6)"});
  test::check_error([&] { rope(tp, x, f64.cos, f64.sin); }, {"[rope]", "float64"});
  test::check_error([&] { rope(tp, x, big.cos, other_t.sin); }, {"[rope]", "cos (5, 4)", "sin (4, 3)"});
}

}  // namespace layers_rope
