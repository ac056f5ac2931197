// SPDX-License-Identifier: MIT OR Apache-2.0
// The seed's helpers for writing a model as a list of layer calls: registering the caller's
// weights (param / constant / input) and constant fills (ones / zeros / full) on a tape.
#pragma once

#include "../ops/shape.hpp"

namespace nn {

/// Registers `t` as a parameter bound by reference (the seed's nn_param). Its gradient is
/// computed when `trainable`; a frozen base weight is `param(tp, w, false)` or `constant(tp, w)`.
template <class B>
GVar param(GTape<B>& tp, const Tensor& t, bool trainable = true) {
  return tp.param(t, trainable);
}
/// Not for a temporary: the leaf would point at a destroyed tensor (see GTape::param).
template <class B>
GVar param(GTape<B>& tp, Tensor&& t, bool trainable = true) = delete;

/// Registers `t` as a value that never gets a gradient (the seed's nn_const).
template <class B>
GVar constant(GTape<B>& tp, const Tensor& t) {
  return tp.constant(t);
}

/// Registers `t` as an input slot a replay may swap with tp.set() (a batch, a padding mask).
template <class B>
GVar input(GTape<B>& tp, const Tensor& t, bool requires_grad = false) {
  return tp.input(t, requires_grad);
}

/// A constant of `shape` filled with `value`, allocated by the tape's backend (so it lives where
/// the tape runs; a host Tensor would be refused by a CUDA tape).
template <class B>
GVar full(GTape<B>& tp, const Shape& shape, double value, DType dtype = DType::f32) {
  Tensor t = B::alloc(shape, dtype);
  B::fill(t, value);
  return tp.constant(t);
}
/// A constant of ones (the seed's nn_ones).
template <class B>
GVar ones(GTape<B>& tp, const Shape& shape, DType dtype = DType::f32) {
  return full(tp, shape, 1.0, dtype);
}
/// A constant of zeros.
template <class B>
GVar zeros(GTape<B>& tp, const Shape& shape, DType dtype = DType::f32) {
  return full(tp, shape, 0.0, dtype);
}

namespace detail {

/// A host tensor moved to backend B's device (a no-op for the CPU), for tables the layers
/// compute on the host once (RoPE angles, masks) before registering them.
template <class B>
Tensor on_backend(const Tensor& t) {
  return t.device() == B::device ? t : t.to(B::device);
}

/// reshape to a Shape known only at run time (ops' reshape takes a braced list); the same view
/// primitive, so no copy and the same vjp.
template <class B>
GVar view(GTape<B>& tp, GVar x, const Shape& s) {
  if (s.numel() != tp.shape(x).numel())
    fail("reshape", "cannot view ", tp.shape(x).str(), " as ", s.str());
  GVar in[] = {x};
  return tp.record(ReshapePrim<B>::def, in, ReshapeAttrs{s}, s, tp.dtype(x));
}

/// "(2, 3) float64": how layer errors name an operand.
template <class B>
std::string desc(const GTape<B>& tp, GVar v) {
  return tp.shape(v).str() + " " + dtype_name(tp.dtype(v));
}

/// The float checks every layer does first, raised under the layer's name.
template <class B>
void layer_float(const GTape<B>& tp, GVar x, const char* layer, const char* what) {
  DType t = tp.dtype(x);
  if (t != DType::f32 && t != DType::f64)
    fail(layer, what, " must be float32 or float64, got ", desc(tp, x));
}
template <class B>
void layer_same_dtype(const GTape<B>& tp, GVar x, GVar y, const char* layer, const char* xn, const char* yn) {
  layer_float(tp, x, layer, xn);
  if (tp.dtype(x) != tp.dtype(y))
    fail(layer, "dtype mismatch: ", xn, " ", desc(tp, x), " vs ", yn, " ", desc(tp, y));
}

}  // namespace detail

}  // namespace nn
