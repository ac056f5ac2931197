// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's random kernel: MLX's bernoulli mask, bit for bit (ops/random.hpp).
#pragma once

#include "common.hpp"
#include "../../random.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `RandomKernels` (why: backend/cpu.hpp).
template <class = void>
struct RandomKernelsT {
  /// mask[i] = value where MLX's bernoulli(p_keep, mask.shape, key) is true, else 0 (mask: f32,
  /// f64 or u8). key: u32 (2), read here so a replay draws from whatever key its slot holds now.
  /// The word layout and u < float32(p) test are random.hpp's, so the mask is MLX's bit for bit.
  static void bernoulli_mask(const Tensor& key, double p_keep, double value, Tensor& mask) {
    const auto* k = static_cast<const std::uint32_t*>(key.raw());
    const std::uint32_t k0 = k[0], k1 = k[1];
    const float p = static_cast<float>(p_keep);
    const std::int64_t n = mask.numel(), blocks = random::detail::bits_blocks(n);
    auto draw = [&]<class T>() {
      T* m = static_cast<T*>(mask.raw());
      const T on = static_cast<T>(value);
      detail::parallel_for(blocks, n > detail::kParallelGrain, [&](std::int64_t j) {
        random::detail::bits_block(k0, k1, n, j, [&](std::int64_t i, std::uint32_t w) {
          m[i] = random::detail::uniform01(w) < p ? on : T(0);
        });
      });
    };
    switch (mask.dtype()) {
      case DType::f32: draw.template operator()<float>(); break;
      case DType::f64: draw.template operator()<double>(); break;
      case DType::u8: draw.template operator()<std::uint8_t>(); break;
      default: detail::fail("bernoulli_mask", "needs a float32, float64 or uint8 mask, got ", dtype_name(mask.dtype()));
    }
  }
};
using RandomKernels = RandomKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
