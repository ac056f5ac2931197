// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/mask.hpp: additive causal, key-padding and combined masks.
#include "layer_case.hpp"

namespace layers_mask {  // one unity source with the other layers files: its names stay its own

using namespace nn;

TEST_CASE("causal_mask_fill: masked strictly above the diagonal") {
  Tensor m = causal_mask_fill(3, DType::f64);
  CHECK(m.shape() == Shape{3, 3});
  const double M = kMaskedValue;
  CHECK(m.to_doubles() == std::vector<double>{0, M, M, 0, 0, M, 0, 0, 0});
  Tensor inf = causal_mask_fill(2, DType::f32, -INFINITY);
  CHECK(std::isinf(inf.item(1)));
  CHECK(inf.item(2) == 0.0);
  Tensor off = causal_mask_fill(2, DType::f64, -1.0, 1);  // 2 queries after 1 cached position
  CHECK(off.shape() == Shape{2, 3});
  CHECK(off.to_doubles() == std::vector<double>{0, 0, -1, 0, 0, 0});
  GTape<cpu> tp;
  GVar g = causal_mask_fill(tp, 4);
  CHECK(tp.shape(g) == Shape{4, 4});
  CHECK_FALSE(tp.requires_grad(g));
  test::check_error([] { causal_mask_fill(-1); }, {"[causal_mask_fill]", "T = -1"});
}

TEST_CASE("padding and attention masks from keep (B, T)") {
  Tensor keep = Tensor::from<std::int32_t>({2, 3}, {1, 1, 1, 1, 1, 0});
  const double M = kMaskedValue;
  Tensor p = padding_mask_fill(keep, DType::f64);
  CHECK(p.shape() == Shape{2, 1, 1, 3});
  CHECK(p.to_doubles() == std::vector<double>{0, 0, 0, 0, 0, M});
  Tensor a = attention_mask_fill(keep, DType::f64);
  CHECK(a.shape() == Shape{2, 1, 3, 3});
  CHECK(a.to_doubles() == std::vector<double>{0, M, M, 0, 0, M, 0, 0, 0,  //
                                              0, M, M, 0, 0, M, 0, 0, M});
  test::check_error([] { attention_mask_fill(Tensor::ones({3})); }, {"[attention_mask_fill]", "(B, S)", "(3)"});
}

}  // namespace layers_mask
