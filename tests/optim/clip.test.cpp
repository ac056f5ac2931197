// SPDX-License-Identifier: MIT OR Apache-2.0
// clip_grad_norm: one global norm over the whole tree (not per tensor), MLX's
// min(max_norm / (norm + 1e-6), 1) factor, a new tree (the input untouched), frozen leaves empty.
#include "optim/net.hpp"

namespace optim_clip {  // one unity source with the other optim files: its names stay its own

using namespace nn;
using namespace nn::test::optim;

TEST_CASE("clip_grad_norm scales every gradient by one global factor") {
  // l2.bias = (3, 4, 0) and e = 12 e_0: global norm 13, per-tensor norms 5 and 12
  Net g{Lin{Param(Tensor::zeros({8, 4}, DType::f64)), Param(Tensor::zeros({8}, DType::f64))},
        Lin{Param(Tensor::zeros({3, 8}, DType::f64)), Param(Tensor::from<double>({3}, {3, 4, 0}))},
        Param(Tensor::zeros({3, 2, 4}, DType::f64))};
  g.e.value.data<double>()[0] = 12;
  g.l1.weight.value = Tensor();  // a frozen leaf: no gradient

  auto [clipped, norm] = clip_grad_norm(g, 6.5);
  CHECK(norm == 13.0);
  const double s = 6.5 / (13.0 + 1e-6);
  CHECK(clipped.l2.bias.value.to_doubles() == std::vector<double>{3 * s, 4 * s, 0});
  CHECK(clipped.e.value.to_doubles()[0] == 12 * s);
  CHECK(!clipped.l1.weight.value.defined());
  // the input tree is left as it was
  CHECK(g.l2.bias.value.to_doubles() == std::vector<double>{3, 4, 0});
  CHECK(clipped.l2.bias.value.raw() != g.l2.bias.value.raw());

  // inactive: the factor is exactly 1
  auto [same, n2] = clip_grad_norm(g, 100.0);
  CHECK(n2 == 13.0);
  CHECK(same.l2.bias.value.to_doubles() == std::vector<double>{3, 4, 0});
  CHECK(same.e.value.to_doubles() == g.e.value.to_doubles());

  // max_norm 0 zeroes; a negative one is an error, as MLX's
  auto [zero, n3] = clip_grad_norm(g, 0.0);
  CHECK(zero.l2.bias.value.to_doubles() == std::vector<double>{0, 0, 0});
  nn::test::check_error([&] { clip_grad_norm(g, -1.0); }, {"[clip_grad_norm]", "max_norm"});
}

TEST_CASE("clip_grad_norm keeps the gradients' dtype") {
  Net g{Lin{Param(Tensor::ones({8, 4}, DType::f32)), Param(Tensor::ones({8}, DType::f32))},
        Lin{Param(Tensor::ones({3, 8}, DType::f32)), Param(Tensor::ones({3}, DType::f32))},
        Param(Tensor::ones({3, 2, 4}, DType::f32))};
  auto [clipped, norm] = clip_grad_norm(g, 1.0);
  CHECK(norm == doctest::Approx(std::sqrt(32.0 + 8 + 24 + 3 + 24)));
  CHECK(clipped.e.value.dtype() == DType::f32);
  CHECK(clipped.e.value.to_doubles()[0] == doctest::Approx(1.0 / std::sqrt(91.0)).epsilon(1e-6));
}

}  // namespace optim_clip
