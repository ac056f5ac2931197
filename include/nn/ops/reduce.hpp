// SPDX-License-Identifier: MIT OR Apache-2.0
// Reductions: sum and mean over axes (or all), keepdims or not; max over one axis.
#pragma once

#include <algorithm>
#include <span>

#include "common.hpp"

namespace nn {

/// sum / mean: the keepdims shape, and the scale (1, or 1/count for the mean).
struct SumAttrs {
  Shape keep;
  double scale;
};
/// max: the axis, and the keepdims shape.
struct MaxAttrs {
  int axis;
  Shape keep;
};

namespace detail {

/// sum / mean (SumAttrs).
template <class B>
struct SumPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SumAttrs>(n);
    Tensor y = n.value.reshape(a.keep);
    B::sum_to(tp.in(n, 0), y, a.scale, false);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SumAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    B::broadcast_to(n.grad.reshape(a.keep), s.g, a.scale, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SumPrim<B>::def{.prim = Prim::sum, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// max over one axis (MaxAttrs); saved[0] holds the argmax (i32, keepdims shape).
template <class B>
struct MaxPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<MaxAttrs>(n);
    Tensor& idx = tp.scratch(n, 0, a.keep, DType::i32);
    Tensor y = n.value.reshape(a.keep);
    B::max_axis(tp.in(n, 0), a.axis, y, idx);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<MaxAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    B::max_axis_vjp(n.grad.reshape(a.keep), n.saved[0], a.axis, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> MaxPrim<B>::def{.prim = Prim::max, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// Normalised, sorted, de-duplicated axes; an empty list means every axis.
inline std::vector<int> norm_axes(const Shape& s, std::span<const int> axes, const char* op) {
  std::vector<int> out;
  if (axes.size() == 0) {
    for (int i = 0; i < s.rank(); ++i) out.push_back(i);
    return out;
  }
  for (int a : axes) {
    int n = a < 0 ? a + s.rank() : a;
    if (n < 0 || n >= s.rank()) fail(op, "axis ", a, " out of range for shape ", s.str());
    out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

template <class B>
GVar reduce_sum(GTape<B>& tp, GVar x, std::span<const int> axes, bool keepdims, bool mean, const char* op) {
  require_float(tp, x, op);
  const Shape& s = tp.shape(x);
  std::vector<int> ax = norm_axes(s, axes, op);
  Shape keep, out;
  std::int64_t count = 1;
  for (int i = 0; i < s.rank(); ++i) {
    bool red = std::find(ax.begin(), ax.end(), i) != ax.end();
    keep.push_back(red ? 1 : s[i]);
    if (red) count *= s[i];
    else out.push_back(s[i]);
  }
  const SumAttrs a{keep, mean ? 1.0 / static_cast<double>(count) : 1.0};
  if (mean && count == 0) fail(op, "mean over an empty axis of shape ", s.str());
  GVar in[] = {x};
  return tp.record(SumPrim<B>::def, in, a, keepdims ? keep : out, tp.dtype(x));
}

}  // namespace detail

/// Sum over `axes` (all axes when empty); keepdims keeps reduced axes as size 1.
template <class B>
GVar sum(GTape<B>& tp, GVar x, std::span<const int> axes, bool keepdims = false) {
  return detail::reduce_sum(tp, x, axes, keepdims, false, "sum");
}
template <class B>
GVar sum(GTape<B>& tp, GVar x, std::initializer_list<int> axes = {}, bool keepdims = false) {
  return sum(tp, x, std::span<const int>(axes.begin(), axes.size()), keepdims);
}
/// Mean over `axes` (all axes when empty).
template <class B>
GVar mean(GTape<B>& tp, GVar x, std::span<const int> axes, bool keepdims = false) {
  return detail::reduce_sum(tp, x, axes, keepdims, true, "mean");
}
template <class B>
GVar mean(GTape<B>& tp, GVar x, std::initializer_list<int> axes = {}, bool keepdims = false) {
  return mean(tp, x, std::span<const int>(axes.begin(), axes.size()), keepdims);
}

/// Max over one axis. Ties: the gradient goes to the first index attaining the max (NumPy's
/// argmax); PyTorch's amax splits it evenly, its max(dim) picks one index as we do.
template <class B>
GVar max(GTape<B>& tp, GVar x, int axis, bool keepdims = false) {
  detail::require_float(tp, x, "max");
  const Shape& s = tp.shape(x);
  if (s.rank() == 0) detail::fail("max", "needs at least one axis, got a scalar");
  int ax = detail::op_axis(s, axis, "max");
  if (s[ax] == 0) detail::fail("max", "axis ", axis, " of shape ", s.str(), " is empty");
  Shape keep, out;
  for (int i = 0; i < s.rank(); ++i) {
    keep.push_back(i == ax ? 1 : s[i]);
    if (i != ax) out.push_back(s[i]);
  }
  const MaxAttrs a{ax, keep};
  GVar in[] = {x};
  return tp.record(detail::MaxPrim<B>::def, in, a, keepdims ? keep : out, tp.dtype(x));
}

}  // namespace nn
