// SPDX-License-Identifier: MIT OR Apache-2.0
// LoraLinear: a frozen Linear plus a trainable low-rank update (Hu et al. 2021), laid out as
// mlx-lm's LoRALinear (linear.weight, lora_a (in, r), lora_b (r, out)).
#pragma once

#include <cmath>

#include "../layers/linear.hpp"
#include "../module.hpp"
#include "../random.hpp"
#include "dropout.hpp"
#include "linear.hpp"

namespace nn {

/// y = linear(x) + scale * (dropout(x) @ lora_a) @ lora_b. from_base(base, r) freezes the base,
/// draws lora_a ~ U(+-1/sqrt(in)) as mlx-lm does and zeroes lora_b, so the layer starts equal to
/// its base. `scale` is mlx-lm's multiplier (default 20); `.rslora()` divides it by sqrt(r)
/// (rank-stabilised LoRA, Kalajdzievski 2023: with scale = alpha this is PEFT's
/// use_rslora scaling alpha / sqrt(r)).
struct LoraLinear {
  Linear base;     // reflected as "linear", frozen
  Param lora_a;    // (in, r)
  Param lora_b;    // (r, out)
  Dropout drop{0.0};

  static LoraLinear from_base(Linear base, std::int64_t rank) {
    LoraLinear l;
    init::LoraInit f = init::lora(base.in_features(), base.out_features(), rank);
    l.base = std::move(base);
    l.base.freeze();
    l.lora_a = Param(f.lora_a.to(l.base.weight.dtype()));
    l.lora_b = Param(f.lora_b.to(l.base.weight.dtype()));
    return l;
  }
  LoraLinear& scale(double s) {
    scale_ = s;
    return *this;
  }
  LoraLinear& dropout(double p) {
    drop = Dropout(p);
    return *this;
  }
  LoraLinear& rslora(bool on = true) {
    rslora_ = on;
    return *this;
  }
  std::int64_t rank() const { return lora_a.value.dim(1); }
  /// The multiplier the forward applies: scale, or scale / sqrt(r) with rslora.
  double effective_scale() const { return rslora_ ? scale_ / std::sqrt(static_cast<double>(rank())) : scale_; }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar w = nn::param(tp, base.weight), a = nn::param(tp, lora_a), b = nn::param(tp, lora_b);
    if (drop.p() == 0.0 || !drop.training()) {
      if (base.bias) return lora_linear(tp, x, w, nn::param(tp, *base.bias), a, b, effective_scale());
      return lora_linear(tp, x, w, a, b, effective_scale());
    }
    detail::check_lora(tp, x, w, a, b, "LoraLinear");
    return add(tp, base(tp, x), detail::lora_branch(tp, drop(tp, x), a, b, effective_scale()));
  }

  /// The merged Linear: W + scale * (a @ b)^T = W + scale * b^T a^T (mlx-lm's fuse), bias kept,
  /// computed on backend B where the layer lives (`l.fused<nn::cuda>()` for a layer on the GPU).
  template <class B = cpu>
  Linear fused() const {
    for (const Tensor* t : {&base.weight.value, &lora_a.value, &lora_b.value})
      if (t->device() != B::device)
        detail::fail("LoraLinear::fused", "the layer lives on ", t->device(), " but the merge runs on backend ",
                     B::name, ": call fused<B>() with the backend of ", t->device());
    GTape<B> tp;
    GVar delta = matmul(tp, tp.constant(lora_b.value), tp.constant(lora_a.value), true, true);  // (out, in)
    GVar w = add(tp, tp.constant(base.weight.value), nn::scale(tp, delta, effective_scale()));
    Linear out = base;
    out.weight = Param(tp.value(w).clone());
    out.unfreeze();
    return out;
  }

  NN_MODULE(LoraLinear, NN_RENAME(base, "linear"), lora_a, lora_b, drop, NN_STATIC(scale_, rslora_))

 private:
  double scale_ = 20.0;
  bool rslora_ = false;
};

}  // namespace nn
