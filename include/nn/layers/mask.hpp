// SPDX-License-Identifier: MIT OR Apache-2.0
// Additive attention masks: 0 where a query may attend to a key, a large negative where it may
// not (added to the scores before the softmax), as mlx.nn.MultiHeadAttention.create_additive_causal_mask
// and Hugging Face's 4-D attention masks.
#pragma once

#include <limits>

#include "helpers.hpp"

namespace nn {

/// The default masked value: MLX's -1e9. Finite on purpose: a row whose keys are all masked
/// gets a uniform softmax instead of the NaN that -inf would give (as HF's finfo.min does), and
/// exp(-1e9 - max) is exactly 0, so a masked key contributes exactly nothing.
inline constexpr double kMaskedValue = -1e9;

/// Causal mask (T, T + offset): entry (i, j) is `masked` when key j lies after query i, i.e.
/// j > i + offset (queries are the last T of T + offset positions, as with a KV cache).
inline Tensor causal_mask_fill(std::int64_t T, DType dtype = DType::f32, double masked = kMaskedValue,
                               std::int64_t offset = 0) {
  if (T < 0 || offset < 0) detail::fail("causal_mask_fill", "needs T >= 0 and offset >= 0, got T = ", T, ", offset = ", offset);
  if (!is_floating(dtype)) detail::fail("causal_mask_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t S = T + offset;
  std::vector<double> m(static_cast<std::size_t>(T * S));
  for (std::int64_t i = 0; i < T; ++i)
    for (std::int64_t j = 0; j < S; ++j) m[static_cast<std::size_t>(i * S + j)] = j > i + offset ? masked : 0.0;
  return Tensor::from_doubles(Shape{T, S}, m, dtype);
}

namespace detail {
inline void check_keep(const Tensor& keep, const char* op) {
  if (!keep.defined() || keep.rank() != 2)
    fail(op, "keep must be (B, S) with 1 for a real token and 0 for padding, got ",
         keep.defined() ? keep.shape().str() : std::string("an empty tensor"));
  if (keep.device() != Device::cpu) fail(op, "keep must be a host tensor, got one on ", keep.device());
}
}  // namespace detail

/// Key-padding mask (B, 1, 1, S) from keep (B, S) (nonzero = a real token): `masked` on the
/// padded keys of each sequence, for every head and query.
inline Tensor padding_mask_fill(const Tensor& keep, DType dtype = DType::f32, double masked = kMaskedValue) {
  detail::check_keep(keep, "padding_mask_fill");
  if (!is_floating(dtype)) detail::fail("padding_mask_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t Bn = keep.dim(0), S = keep.dim(1);
  std::vector<double> m(static_cast<std::size_t>(Bn * S));
  for (std::int64_t i = 0; i < Bn * S; ++i) m[static_cast<std::size_t>(i)] = keep.item(i) != 0 ? 0.0 : masked;
  return Tensor::from_doubles(Shape{Bn, 1, 1, S}, m, dtype);
}

/// Causal and key-padding mask together (B, 1, T, T): the 4-D mask HF builds for a padded
/// batch. keep: (B, T).
inline Tensor attention_mask_fill(const Tensor& keep, DType dtype = DType::f32, double masked = kMaskedValue) {
  detail::check_keep(keep, "attention_mask_fill");
  if (!is_floating(dtype)) detail::fail("attention_mask_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t Bn = keep.dim(0), T = keep.dim(1);
  std::vector<double> m(static_cast<std::size_t>(Bn * T * T));
  for (std::int64_t b = 0; b < Bn; ++b)
    for (std::int64_t i = 0; i < T; ++i)
      for (std::int64_t j = 0; j < T; ++j)
        m[static_cast<std::size_t>((b * T + i) * T + j)] = (j <= i && keep.item(b * T + j) != 0) ? 0.0 : masked;
  return Tensor::from_doubles(Shape{Bn, 1, T, T}, m, dtype);
}

/// The tape forms register the mask as a constant on the tape's device, in the tape's float dtype
/// (GTape::float_dtype) unless given one. (A mask that changes
/// between replays, e.g. padding per batch, belongs in an input slot: nn::input(tp, mask).)
template <class B>
GVar causal_mask_fill(GTape<B>& tp, std::int64_t T, std::optional<DType> dtype = std::nullopt,
                      double masked = kMaskedValue, std::int64_t offset = 0) {
  return tp.constant(detail::on_backend<B>(causal_mask_fill(T, dtype.value_or(tp.float_dtype()), masked, offset)));
}
template <class B>
GVar attention_mask_fill(GTape<B>& tp, const Tensor& keep, std::optional<DType> dtype = std::nullopt,
                         double masked = kMaskedValue) {
  return tp.constant(detail::on_backend<B>(attention_mask_fill(keep, dtype.value_or(tp.float_dtype()), masked)));
}

}  // namespace nn
