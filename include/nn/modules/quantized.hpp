// SPDX-License-Identifier: MIT OR Apache-2.0
// QuantizedLinear and QuantizedEmbedding (MLX's nn.QuantizedLinear / nn.QuantizedEmbedding: the
// same fields, names and layouts), and nn::quantize(model, ...), which converts a model's Linear
// and Embedding leaves by path as mlx.nn.quantize does.
#pragma once

#include <optional>
#include <type_traits>
#include <variant>

#include "../ops/quantized.hpp"
#include "../quant.hpp"
#include "embedding.hpp"
#include "linear.hpp"

namespace nn {

namespace detail {

/// The three tensors of a quantized layer bound on a tape as constants.
template <class B>
struct BoundQuantized {
  GVar wq, scales;
  std::optional<GVar> biases;
};
template <class B>
BoundQuantized<B> bind_quantized(GTape<B>& tp, const Buffer& w, const Buffer& s, const std::optional<Buffer>& b) {
  return {nn::param(tp, w), nn::param(tp, s), b ? std::optional<GVar>(nn::param(tp, *b)) : std::nullopt};
}

}  // namespace detail

/// y = x @ dequant(weight)^T + bias for a weight quantized in MLX's format (quant.hpp). Every
/// tensor is a Buffer: never trained (unfreeze() leaves it so), saved and loaded under MLX's
/// names: weight (out, in * bits / 32) u32, scales and biases (out, in / group) (no biases for
/// the fp modes), bias (out) when the Linear had one.
struct QuantizedLinear {
  Buffer weight;
  Buffer scales;
  std::optional<Buffer> biases;
  std::optional<Buffer> bias;

  QuantizedLinear() = default;
  /// MLX's QuantizedLinear.from_linear: affine, groups of 64, 4 bits unless q says otherwise.
  static QuantizedLinear from_linear(const Linear& l, Quant q = Quant::affine()) {
    QuantizedLinear out;
    out.set(quantize(l.weight.value, q));
    if (l.bias) out.bias = Buffer(l.bias->value.clone());
    return out;
  }
  static QuantizedLinear from_linear_with(const Linear& l, Quant q) { return from_linear(l, q); }
  /// An already quantized matrix (mx.quantize's output, a GGUF tensor) and an optional bias.
  static QuantizedLinear from_quantized(QuantizedMatrix m, std::optional<Tensor> bias = std::nullopt) {
    QuantizedLinear out;
    out.set(std::move(m));
    if (bias) out.bias = Buffer(std::move(*bias));
    return out;
  }

  Quant quant() const { return Quant{mode_, group_size_, bits_}; }
  std::int64_t in_features() const { return weight.value.dim(1) * 32 / bits_; }
  std::int64_t out_features() const { return weight.value.dim(0); }
  QuantizedMatrix matrix() const { return {weight.value, scales.value, biases ? biases->value : Tensor(), quant()}; }
  /// The full-precision Linear (the scales' dtype; the fp modes: float32): mx.dequantize of the weight.
  Linear dequantized() const {
    Linear l;
    l.weight = Param(dequantize(matrix()));
    if (bias) l.bias = Param(bias->value.clone());
    return l;
  }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    auto w = detail::bind_quantized(tp, weight, scales, biases);
    GVar y = quantized_matmul(tp, x, w.wq, w.scales, w.biases, quant(), true);
    return bias ? add(tp, y, nn::param(tp, *bias)) : y;
  }

  NN_MODULE(QuantizedLinear, weight, scales, biases, bias, NN_STATIC(mode_, group_size_, bits_))

 private:
  void set(QuantizedMatrix m) {
    weight = Buffer(std::move(m.weight));
    scales = Buffer(std::move(m.scales));
    biases = m.biases.defined() ? std::optional<Buffer>(Buffer(std::move(m.biases))) : std::nullopt;
    mode_ = m.q.mode;
    group_size_ = m.q.group;
    bits_ = m.q.bits;
  }
  QuantMode mode_ = QuantMode::affine;
  int group_size_ = 64;
  int bits_ = 4;
};

/// MLX's QuantizedEmbedding: a quantized (num, dims) table; lookups dequantize only the rows
/// asked for (float32, or float64 for float64 scales), and as_linear is the tied LM head.
struct QuantizedEmbedding {
  Buffer weight;
  Buffer scales;
  std::optional<Buffer> biases;

  QuantizedEmbedding() = default;
  static QuantizedEmbedding from_embedding(const Embedding& e, Quant q = Quant::affine()) {
    QuantizedEmbedding out;
    QuantizedMatrix m = quantize(e.weight.value, q);
    out.weight = Buffer(std::move(m.weight));
    out.scales = Buffer(std::move(m.scales));
    if (m.biases.defined()) out.biases = Buffer(std::move(m.biases));
    out.mode_ = q.mode;
    out.group_size_ = q.group;
    out.bits_ = q.bits;
    return out;
  }
  static QuantizedEmbedding from_quantized(QuantizedMatrix m) {
    QuantizedEmbedding out;
    out.weight = Buffer(std::move(m.weight));
    out.scales = Buffer(std::move(m.scales));
    if (m.biases.defined()) out.biases = Buffer(std::move(m.biases));
    out.mode_ = m.q.mode;
    out.group_size_ = m.q.group;
    out.bits_ = m.q.bits;
    return out;
  }

  Quant quant() const { return Quant{mode_, group_size_, bits_}; }
  std::int64_t num_embeddings() const { return weight.value.dim(0); }
  std::int64_t dims() const { return weight.value.dim(1) * 32 / bits_; }
  QuantizedMatrix matrix() const { return {weight.value, scales.value, biases ? biases->value : Tensor(), quant()}; }
  Embedding dequantized() const {
    Embedding e;
    e.weight = Param(dequantize(matrix()));
    return e;
  }

  // ids: (...) int32/int64 -> (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    auto w = detail::bind_quantized(tp, weight, scales, biases);
    const DType out = scales.value.dtype() == DType::f64 ? DType::f64 : DType::f32;
    return quantized_gather(tp, ids, w.wq, w.scales, w.biases, quant(), out);
  }
  /// The table as an output projection (a tied LM head): x (..., dims) -> logits (..., num).
  template <class B>
  GVar as_linear(GTape<B>& tp, GVar x) const {
    auto w = detail::bind_quantized(tp, weight, scales, biases);
    return quantized_matmul(tp, x, w.wq, w.scales, w.biases, quant(), true);
  }

  NN_MODULE(QuantizedEmbedding, weight, scales, biases, NN_STATIC(mode_, group_size_, bits_))

 private:
  QuantMode mode_ = QuantMode::affine;
  int group_size_ = 64;
  int bits_ = 4;
};

namespace detail {

/// What a quantize predicate said for one layer: skip it, or its format.
template <class Choose>
std::optional<Quant> quant_choice(Choose& choose, const std::string& path, const Quant& q) {
  using R = std::remove_cvref_t<decltype(choose(path))>;
  if constexpr (std::is_same_v<R, bool>) return choose(path) ? std::optional<Quant>(q) : std::nullopt;
  else return choose(path);
}

}  // namespace detail

/// mlx.nn.quantize(model, group_size, bits, mode, class_predicate): every Linear and Embedding
/// leaf whose path `choose` accepts becomes a QuantizedLinear / QuantizedEmbedding in format q.
/// `choose(path)` returns a bool, or a std::optional<Quant> (a per-layer format, as mlx-lm's
/// per-layer overrides; nullopt skips the layer). The leaves must sit in std::variant fields
/// that can hold the quantized type (std::variant<Linear, QuantizedLinear, ...>). Returns how
/// many layers were converted.
template <class M, class Choose>
  requires detail::ModuleType<M>
int quantize(M& model, Quant q, Choose choose) {
  int n = 0;
  auto keep = [&](const std::string& p) { return detail::quant_choice(choose, p, q).has_value(); };
  n += model.template map_modules<Linear>(keep, [&](const std::string& p, const Linear& l) {
    return QuantizedLinear::from_linear(l, *detail::quant_choice(choose, p, q));
  });
  n += model.template map_modules<Embedding>(keep, [&](const std::string& p, const Embedding& e) {
    return QuantizedEmbedding::from_embedding(e, *detail::quant_choice(choose, p, q));
  });
  return n;
}

/// Every Linear and Embedding leaf, affine with `group` and `bits` (MLX's defaults 64 and 4).
template <class M>
  requires detail::ModuleType<M>
int quantize(M& model, int group = 64, int bits = 4, QuantMode mode = QuantMode::affine) {
  return quantize(model, Quant{mode, group, bits}, [](const std::string&) { return true; });
}

}  // namespace nn
