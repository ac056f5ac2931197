// SPDX-License-Identifier: MIT OR Apache-2.0
// The seed's helpers: param / constant / input registration and the constant fills.
#include "support/check.hpp"

namespace layers_helpers {  // one unity source with the other layers files: its names stay its own

using namespace nn;

TEST_CASE("helpers: param, constant, input and fills register what they say") {
  GTape<cpu> tp;
  Tensor W = Tensor::from<double>({2, 2}, {1, 2, 3, 4});
  GVar w = nn::param(tp, W);
  const Tensor F = Tensor::ones({2}, DType::f64);  // params bind by reference: a named tensor
  GVar f = nn::param(tp, F, false);
  GVar c = nn::constant(tp, Tensor::zeros({2}, DType::f64));
  GVar x = nn::input(tp, Tensor::ones({2}, DType::f64), true);
  CHECK(tp.requires_grad(w));
  CHECK_FALSE(tp.requires_grad(f));
  CHECK_FALSE(tp.requires_grad(c));
  CHECK(tp.requires_grad(x));
  GVar o = nn::ones(tp, Shape{2, 3}, DType::f64);
  GVar z = nn::zeros(tp, Shape{4});
  GVar h = nn::full(tp, Shape{3}, 0.5, DType::f64);
  CHECK(tp.shape(o) == Shape{2, 3});
  CHECK(tp.dtype(o) == DType::f64);
  CHECK(tp.dtype(z) == DType::f32);
  CHECK(tp.value(o).to_doubles() == std::vector<double>(6, 1.0));
  CHECK(tp.value(z).to_doubles() == std::vector<double>(4, 0.0));
  CHECK(tp.value(h).to_doubles() == std::vector<double>(3, 0.5));
  CHECK_FALSE(tp.requires_grad(o));
  // a block reads as the seed's: rmsnorm with a ones gain is the plain rmsnorm
  GVar xn = rmsnorm(tp, x, nn::ones(tp, Shape{2}, DType::f64), 1e-6);
  GVar xp = rmsnorm(tp, x, 1e-6);
  CHECK(test::rel_err(tp.value(xn), tp.value(xp)) == 0.0);
}

}  // namespace layers_helpers
