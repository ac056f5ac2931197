// SPDX-License-Identifier: MIT OR Apache-2.0
// DoraLinear: weight-decomposed low-rank adaptation (Liu et al. 2024, "DoRA"), laid out as
// mlx-lm's DoRALinear (linear.weight, lora_a (in, r), lora_b (r, out), m (out)).
#pragma once

#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

#include "lora.hpp"

namespace nn {

/// y = m / ||W + s (A B)^T||_row * (x W^T + s (dropout(x) A) B) + bias over a full-precision
/// Linear or a QuantizedLinear (QDoRA), as mlx-lm's DoRALinear over either: the LoRA update
/// re-normalised per output row, with a trained magnitude m per row. The norm is detached (no
/// gradient flows through it), as in mlx-lm, PEFT and the paper's section 4.3; the math is
/// nn::dora_factor (layers/linear.hpp).
///
/// from_base(base, r) freezes the base, draws lora_a and zeroes lora_b as LoraLinear (so the
/// layer starts equal to its base) and sets m to the norms of W's rows (float32 beside a
/// quantized base, from its dequantized weight, as mlx-lm; the adapters' dtype otherwise).
///
/// Relation to PEFT's LoraConfig(use_dora=True): the same layer. PEFT's lora_magnitude_vector is
/// m, lora_A.weight / lora_B.weight are lora_a^T / lora_b^T, scaling = lora_alpha / r is `scale`.
/// PEFT initialises the magnitude to ||W + scaling B A|| (= ||W|| while B is zero). One
/// difference, in training with dropout only: PEFT rescales the base output computed from the
/// dropped-out x, mlx-lm (and nn) from x itself; with dropout 0, or in eval mode, they agree.
struct DoraLinear {
  std::variant<Linear, QuantizedLinear> base;  // reflected as "linear", frozen
  Param lora_a;                                // (in, r)
  Param lora_b;                                // (r, out)
  Param m;                                     // (out) the learned magnitude of each output row
  Dropout drop{0.0};

  static DoraLinear from_base(Linear base, std::int64_t rank) {
    base.freeze();
    return with_adapters(std::move(base), rank);
  }
  /// QDoRA: adapters and m in float32 (float64 over float64 scales) beside the quantized base.
  static DoraLinear from_base(QuantizedLinear base, std::int64_t rank) { return with_adapters(std::move(base), rank); }
  bool quantized() const { return std::holds_alternative<QuantizedLinear>(base); }
  std::int64_t in_features() const { return lora_a.value.dim(0); }
  std::int64_t out_features() const { return lora_b.value.dim(1); }
  std::int64_t rank() const { return lora_a.value.dim(1); }
  DoraLinear& scale(double s) {
    scale_ = s;
    return *this;
  }
  DoraLinear& dropout(double p) {
    drop = Dropout(p);
    return *this;
  }
  DoraLinear& rslora(bool on = true) {
    rslora_ = on;
    return *this;
  }
  /// The multiplier of the update: scale, or scale / sqrt(r) with rslora (PEFT's use_rslora).
  double effective_scale() const { return rslora_ ? scale_ / std::sqrt(static_cast<double>(rank())) : scale_; }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar a = nn::param(tp, lora_a), b = nn::param(tp, lora_b), mag = nn::param(tp, m);
    const double s = effective_scale();
    const bool no_drop = drop.p() == 0.0 || !drop.training();
    if (const auto* l = std::get_if<Linear>(&base)) {
      GVar w = nn::param(tp, l->weight);
      if (no_drop) return l->bias ? dora_linear(tp, x, w, nn::param(tp, *l->bias), a, b, mag, s) : dora_linear(tp, x, w, a, b, mag, s);
      detail::check_lora(tp, x, w, a, b, "DoraLinear");
      const auto [w_sq, wa] = detail::dora_weight_terms(tp, w, a);
      GVar y = add(tp, linear(tp, x, w), detail::lora_branch(tp, drop(tp, x), a, b, s));
      y = mul(tp, y, dora_factor(tp, w_sq, wa, a, b, mag, s));
      return l->bias ? add(tp, y, nn::param(tp, *l->bias)) : y;
    }
    // A quantized base: W A as (A^T W^T)^T through the quantized product; the rows' squared
    // norms of the frozen W once per recording (a Buffer is never trained, so a replay's
    // constant stays exact).
    const QuantizedLinear& q = std::get<QuantizedLinear>(base);
    auto w = detail::bind_quantized(tp, q.weight, q.scales, q.biases);
    GVar y = quantized_matmul(tp, x, w.wq, w.scales, w.biases, q.quant(), true);
    y = add(tp, y, detail::lora_branch(tp, no_drop ? x : drop(tp, x), a, b, s));
    GVar wa = transpose(tp, quantized_matmul(tp, transpose(tp, a), w.wq, w.scales, w.biases, q.quant(), true));
    y = mul(tp, y, dora_factor(tp, tp.constant(row_squares(q)), wa, a, b, mag, s));
    return q.bias ? add(tp, y, nn::param(tp, *q.bias)) : y;
  }

  /// The merged Linear, mlx-lm's DoRALinear.fuse(dequantize=True): W' = W + (s b^T) @ a^T (a
  /// quantized base dequantized first), then each row of W' scaled to norm m_i; bias kept.
  template <class B = cpu>
  Linear fused() const {
    Linear out = quantized() ? std::get<QuantizedLinear>(base).dequantized() : std::get<Linear>(base);
    out = detail::merge_low_rank<B>(std::move(out), lora_a.value, lora_b.value, effective_scale(), "DoraLinear::fused");
    // rows rescaled in double on the CPU, stored in the weight's dtype
    Tensor w = out.weight.value.to(Device::cpu).clone();
    const Tensor mag = m.value.to(Device::cpu);
    const DType t = w.dtype();
    const std::int64_t rows = w.dim(0), cols = w.dim(1);
    const Tensor n2 = detail::row_squares(w, DType::f64);
    for (std::int64_t i = 0; i < rows; ++i) {
      const double f = detail::load_as_double(mag.raw(), mag.dtype(), i) / std::sqrt(n2.data<double>()[i]);
      for (std::int64_t j = 0; j < cols; ++j)
        detail::store_from_double(w.raw(), t, i * cols + j,
                                  detail::QuantMath::in(t, f * detail::load_as_double(w.raw(), t, i * cols + j)));
    }
    out.weight = Param(w.to(out.weight.value.device()));
    return out;
  }
  /// mlx-lm's fuse() over a quantized base: the merge above quantized again in the base's format.
  template <class B = cpu>
  QuantizedLinear fused_quantized() const {
    if (!quantized()) detail::fail("DoraLinear", "the base is a full-precision Linear; use fused()");
    return QuantizedLinear::from_linear(fused<B>(), std::get<QuantizedLinear>(base).quant());
  }

  NN_MODULE(DoraLinear, NN_RENAME(base, "linear"), lora_a, lora_b, m, drop, NN_STATIC(scale_, rslora_))

 private:
  /// The squared norms of a quantized weight's rows, from its dequantized values. -> (out)
  static Tensor row_squares(const QuantizedLinear& q) {
    return detail::row_squares(dequantize(q.matrix()), detail::adapter_dtype(q)).to(q.scales.value.device());
  }
  template <class Base>
  static DoraLinear with_adapters(Base base, std::int64_t rank) {
    DoraLinear l;
    const DType dt = detail::adapter_dtype(base);
    std::tie(l.lora_a, l.lora_b) = detail::initial_factors(base.in_features(), base.out_features(), rank, dt);
    Tensor sq;  // f64, so each norm is rounded once, to dt
    if constexpr (std::is_same_v<Base, QuantizedLinear>) sq = detail::row_squares(dequantize(base.matrix()), DType::f64);
    else sq = detail::row_squares(base.weight.value, DType::f64);
    Tensor mag = Tensor::zeros(sq.shape(), dt);
    for (std::int64_t i = 0; i < sq.dim(0); ++i) detail::store_from_double(mag.raw(), dt, i, std::sqrt(sq.data<double>()[i]));
    l.m = Param(mag.to(l.lora_a.value.device()));
    l.base = std::move(base);
    return l;
  }
  double scale_ = 20.0;
  bool rslora_ = false;
};

}  // namespace nn
