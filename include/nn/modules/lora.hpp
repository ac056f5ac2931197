// SPDX-License-Identifier: MIT OR Apache-2.0
// LoraLinear: a frozen Linear plus a trainable low-rank update (Hu et al. 2021), laid out as
// mlx-lm's LoRALinear (linear.weight, lora_a (in, r), lora_b (r, out)).
#pragma once

#include <cmath>
#include <tuple>
#include <utility>
#include <variant>

#include "../layers/linear.hpp"
#include "../module.hpp"
#include "../random.hpp"
#include "dropout.hpp"
#include "linear.hpp"
#include "quantized.hpp"

namespace nn {

namespace detail {

/// W + (scale * b^T) @ a^T in W's dtype, computed on backend B where the factors live: the merge
/// LoRA and DoRA fuse share (mlx-lm's fuse). base: a Linear, weight (out, in); a: (in, r),
/// b: (r, out). Returns the Linear with the merged weight, bias kept, trainable.
template <class B>
Linear merge_low_rank(Linear out, const Tensor& lora_a, const Tensor& lora_b, double scale, const char* who) {
  for (const Tensor* t : {&lora_a, &lora_b})
    if (t->device() != B::device)
      fail(who, "the layer lives on ", t->device(), " but the merge runs on backend ", B::name,
           ": call fused<B>() with the backend of ", t->device());
  GTape<B> tp;
  GVar bt = nn::scale(tp, transpose(tp, tp.constant(lora_b)), scale);  // (out, r)
  GVar delta = matmul(tp, bt, tp.constant(lora_a), false, true);       // (out, in)
  if (tp.dtype(delta) == out.weight.dtype()) {
    out.weight = Param(tp.value(add(tp, tp.constant(out.weight.value), delta)).clone());
  } else {
    // a bfloat16/float16 weight (dequantized from such scales): delta cast to it, then the sum
    // rounded to it, as MLX adds two half-precision arrays
    const Tensor d = tp.value(delta).to(Device::cpu).to(out.weight.dtype());
    Tensor w = out.weight.value.to(Device::cpu).clone();
    const DType t = w.dtype();
    for (std::int64_t i = 0; i < w.numel(); ++i)
      store_from_double(w.raw(), t, i, QuantMath::in(t, load_as_double(w.raw(), t, i) + load_as_double(d.raw(), t, i)));
    out.weight = Param(w.to(out.weight.value.device()));
  }
  out.unfreeze();
  return out;
}

/// The adapter factors a LoRA or DoRA layer starts from, as mlx-lm draws them: lora_a (in, r)
/// ~ U(+-1/sqrt(in)) from nn::random's sequence, lora_b (r, out) zero; in dtype dt.
inline std::pair<Param, Param> initial_factors(std::int64_t in, std::int64_t out, std::int64_t rank, DType dt) {
  init::LoraInit f = init::lora(in, out, rank);
  return {Param(f.lora_a.to(dt)), Param(f.lora_b.to(dt))};
}

/// The adapters' dtype over a base: the weight's for a Linear; float32 beside a quantized base
/// (float64 over float64 scales), as QLoRA trains.
inline DType adapter_dtype(const Linear& l) { return l.weight.dtype(); }
inline DType adapter_dtype(const QuantizedLinear& q) {
  return q.scales.dtype() == DType::f64 ? DType::f64 : DType::f32;
}

}  // namespace detail

/// y = linear(x) + scale * (dropout(x) @ lora_a) @ lora_b over a full-precision Linear (LoRA) or
/// a QuantizedLinear (QLoRA), as mlx-lm's LoRALinear over either. from_base(base, r) freezes the
/// base, draws lora_a ~ U(+-1/sqrt(in)) as mlx-lm does and zeroes lora_b, so the layer starts
/// equal to its base. `scale` is mlx-lm's multiplier (default 20); `.rslora()` divides it by
/// sqrt(r) (rank-stabilised LoRA, Kalajdzievski 2023: with scale = alpha this is PEFT's
/// use_rslora scaling alpha / sqrt(r)).
struct LoraLinear {
  std::variant<Linear, QuantizedLinear> base;  // reflected as "linear", frozen
  Param lora_a;                                // (in, r)
  Param lora_b;                                // (r, out)
  Dropout drop{0.0};

  static LoraLinear from_base(Linear base, std::int64_t rank) {
    base.freeze();
    return with_adapters(std::move(base), rank);
  }
  /// QLoRA: adapters in float32 (float64 over float64 scales) beside the quantized base.
  static LoraLinear from_base(QuantizedLinear base, std::int64_t rank) { return with_adapters(std::move(base), rank); }
  /// Whether the base is a QuantizedLinear.
  bool quantized() const { return std::holds_alternative<QuantizedLinear>(base); }
  /// The full-precision base (an nn::Error naming the layer's format when it is quantized).
  const Linear& linear() const {
    if (quantized()) detail::fail("LoraLinear", "the base is quantized (QuantizedLinear); use quantized_base()");
    return std::get<Linear>(base);
  }
  Linear& linear() { return const_cast<Linear&>(std::as_const(*this).linear()); }
  const QuantizedLinear& quantized_base() const {
    if (!quantized()) detail::fail("LoraLinear", "the base is a full-precision Linear; use linear()");
    return std::get<QuantizedLinear>(base);
  }
  std::int64_t in_features() const { return lora_a.value.dim(0); }
  std::int64_t out_features() const { return lora_b.value.dim(1); }
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
    GVar a = nn::param(tp, lora_a), b = nn::param(tp, lora_b);
    const bool no_drop = drop.p() == 0.0 || !drop.training();
    if (const auto* q = std::get_if<QuantizedLinear>(&base))
      return add(tp, (*q)(tp, x), detail::lora_branch(tp, no_drop ? x : drop(tp, x), a, b, effective_scale()));
    const Linear& l = std::get<Linear>(base);
    GVar w = nn::param(tp, l.weight);
    if (no_drop) {
      if (l.bias) return lora_linear(tp, x, w, nn::param(tp, *l.bias), a, b, effective_scale());
      return lora_linear(tp, x, w, a, b, effective_scale());
    }
    detail::check_lora(tp, x, w, a, b, "LoraLinear");
    return add(tp, l(tp, x), detail::lora_branch(tp, drop(tp, x), a, b, effective_scale()));
  }

  /// The merged Linear, mlx-lm's fuse(dequantize=True): W + (scale * b^T) @ a^T in W's dtype (a
  /// quantized base dequantized first, mx.dequantize), bias kept; computed on backend B where
  /// the layer lives (`l.fused<nn::cuda>()` for a layer on the GPU).
  template <class B = cpu>
  Linear fused() const {
    Linear out = quantized() ? std::get<QuantizedLinear>(base).dequantized() : std::get<Linear>(base);
    return detail::merge_low_rank<B>(std::move(out), lora_a.value, lora_b.value, effective_scale(), "LoraLinear::fused");
  }
  /// mlx-lm's fuse() over a quantized base: the dequantized merge above, quantized again in the
  /// base's format (mode, group, bits). An nn::Error over a full-precision base.
  template <class B = cpu>
  QuantizedLinear fused_quantized() const {
    const Quant q = quantized_base().quant();
    Linear l = fused<B>();
    return QuantizedLinear::from_linear(l, q);
  }

  NN_MODULE(LoraLinear, NN_RENAME(base, "linear"), lora_a, lora_b, drop, NN_STATIC(scale_, rslora_))

 private:
  template <class Base>
  static LoraLinear with_adapters(Base base, std::int64_t rank) {
    LoraLinear l;
    std::tie(l.lora_a, l.lora_b) = detail::initial_factors(base.in_features(), base.out_features(), rank, detail::adapter_dtype(base));
    l.base = std::move(base);
    return l;
  }
  double scale_ = 20.0;
  bool rslora_ = false;
};

}  // namespace nn
