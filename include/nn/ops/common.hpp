// SPDX-License-Identifier: MIT OR Apache-2.0
// Validation shared by every primitive: dtype and shape checks whose errors name the op and the
// shapes, and NumPy broadcasting of shapes.
#pragma once

#include "../tape.hpp"

namespace nn::detail {

/// The attributes a primitive recorded on node n (its own struct, e.g. UnaryAttrs).
template <class A, class B>
const A& attrs_of(const Node<B>& n) {
  return n.attrs.template get<A>();
}

template <class B>
void require_float(const GTape<B>& tp, GVar x, const char* op) {
  DType t = tp.dtype(x);
  if (t != DType::f32 && t != DType::f64)
    fail(op, "needs float32 or float64, got ", dtype_name(t), " ", tp.shape(x).str());
}

template <class B>
void require_same_dtype(const GTape<B>& tp, GVar a, GVar b, const char* op) {
  require_float(tp, a, op);
  if (tp.dtype(a) != tp.dtype(b))
    fail(op, "dtype mismatch: ", dtype_name(tp.dtype(a)), " ", tp.shape(a).str(), " vs ", dtype_name(tp.dtype(b)),
         " ", tp.shape(b).str());
}

/// Precision::bf16: `w` is a weight stored in bfloat16 beside float32 activations `x`, which the
/// products (matmul's right operand) and the embedding lookup read directly. Such a weight must be
/// frozen: bf16 is a storage type here, and what trains stays float32.
template <class B>
void require_frozen_bf16(const GTape<B>& tp, GVar w, const char* op, const char* what) {
  if (tp.requires_grad(w))
    fail(op, "a bfloat16 ", what, " ", tp.shape(w).str(), " must be frozen (bf16 stores frozen weights; what ",
         "trains stays float32)");
}
template <class B>
bool bf16_weight(const GTape<B>& tp, GVar x, GVar w, const char* op) {
  if (tp.dtype(w) != DType::bf16 || tp.dtype(x) != DType::f32) return false;
  require_frozen_bf16(tp, w, op, "weight");
  return true;
}

/// The broadcast of two shapes (NumPy rules, aligned right), or an error naming both.
inline Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const int r = std::max(a.rank(), b.rank());
  std::vector<std::int64_t> out(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) {
    std::int64_t da = i < r - a.rank() ? 1 : a[i - (r - a.rank())];
    std::int64_t db = i < r - b.rank() ? 1 : b[i - (r - b.rank())];
    if (da != db && da != 1 && db != 1)
      fail(op, "shapes ", a.str(), " and ", b.str(), " cannot broadcast (dim ", i, ": ", da, " vs ", db, ")");
    out[static_cast<std::size_t>(i)] = da == 1 ? db : da;
  }
  return Shape(out);
}

/// A possibly negative axis of `s`, normalised; out of range raises "[op] axis a out of range for
/// shape (...)" naming the op (Shape::axis would name only "shape").
inline int op_axis(const Shape& s, int axis, const char* op) {
  const int a = axis < 0 ? axis + s.rank() : axis;
  if (a < 0 || a >= s.rank()) fail(op, "axis ", axis, " out of range for shape ", s.str());
  return a;
}

/// True when `from` broadcasts to exactly `to`.
inline bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.rank() > to.rank()) return false;
  for (int i = 1; i <= from.rank(); ++i) {
    std::int64_t f = from[from.rank() - i], t = to[to.rank() - i];
    if (f != t && f != 1) return false;
  }
  return true;
}

}  // namespace nn::detail
