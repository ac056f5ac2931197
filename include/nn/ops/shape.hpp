// SPDX-License-Identifier: MIT OR Apache-2.0
// Data movement: reshape (a view), permute / transpose, slice, concat, broadcast_to.
#pragma once

#include <span>
#include <vector>

#include "common.hpp"

namespace nn {

/// reshape's target shape (the node's output is a view, so the shape is kept here).
struct ReshapeAttrs {
  Shape shape;
};
/// permute's order: out.shape[i] = in.shape[perm[i]].
struct PermuteAttrs {
  std::array<int, kMaxRank> perm;
};
/// slice's axis and first index (its length is the output's).
struct SliceAttrs {
  int axis;
  std::int64_t start;
};
/// concat's axis.
struct ConcatAttrs {
  int axis;
};

namespace detail {

/// The output is a view of input 0 (re-taken on every forward, so a swapped input is seen).
template <class B>
struct ReshapePrim {
  static void forward(GTape<B>& tp, Node<B>& n) { n.value = tp.in(n, 0).reshape(attrs_of<ReshapeAttrs>(n).shape); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    GradSlot s = tp.grad_slot(n, 0);
    B::copy(n.grad, s.g, s.acc);  // same element order; only the shape differs
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> ReshapePrim<B>::def{.prim = Prim::reshape, .forward = &forward, .vjp = &vjp, .aliases_input = true, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct PermutePrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::permute(tp.in(n, 0), attrs_of<PermuteAttrs>(n).perm, n.value, false); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& perm = attrs_of<PermuteAttrs>(n).perm;
    std::array<int, kMaxRank> inv{};
    for (int i = 0; i < n.value.rank(); ++i) inv[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])] = i;
    GradSlot s = tp.grad_slot(n, 0);
    B::permute(n.grad, inv, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> PermutePrim<B>::def{.prim = Prim::permute, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct SlicePrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SliceAttrs>(n);
    B::slice_copy(tp.in(n, 0), a.axis, a.start, n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SliceAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    if (!s.acc) B::fill(s.g, 0.0);
    B::slice_scatter(n.grad, a.axis, a.start, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SlicePrim<B>::def{.prim = Prim::slice, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct ConcatPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    std::int64_t at = 0;
    const int axis = attrs_of<ConcatAttrs>(n).axis;
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      const Tensor& x = tp.in(n, k);
      B::slice_scatter(x, axis, at, n.value, false);
      at += x.shape()[axis];
    }
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    std::int64_t at = 0;
    const int axis = attrs_of<ConcatAttrs>(n).axis;
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      const Shape& s = tp.in(n, k).shape();
      if (tp.needs_grad(n, k)) {
        GradSlot g = tp.grad_slot(n, k);
        if (!g.acc) {
          B::slice_copy(n.grad, axis, at, g.g);
        } else {
          Tensor& part = tp.scratch(n, k, s, n.value.dtype());
          B::slice_copy(n.grad, axis, at, part);
          B::copy(part, g.g, true);
        }
      }
      at += s[axis];
    }
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> ConcatPrim<B>::def{.prim = Prim::concat, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct BroadcastPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::broadcast_to(tp.in(n, 0), n.value, 1.0, false); }
  static void vjp(GTape<B>& tp, Node<B>& n) { tp.accumulate_reduced(n, 0, n.grad); }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> BroadcastPrim<B>::def{.prim = Prim::broadcast_to, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

}  // namespace detail

/// The same elements in a new shape; one dim may be -1 (inferred). Costs no copy.
template <class B>
GVar reshape(GTape<B>& tp, GVar x, std::span<const std::int64_t> dims) {
  const Shape& s = tp.shape(x);
  std::vector<std::int64_t> d(dims.begin(), dims.end());
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (d[i] == -1) {
      if (infer >= 0) detail::fail("reshape", "only one -1 allowed, got ", Shape(std::vector<std::int64_t>(d.size(), 1)).str());
      infer = static_cast<int>(i);
    } else if (d[i] < 0) {
      detail::fail("reshape", "negative dimension ", d[i], " for input ", s.str());
    } else {
      known *= d[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || s.numel() % known != 0)
      detail::fail("reshape", "cannot infer -1 reshaping ", s.str(), " (", s.numel(), " elements)");
    d[static_cast<std::size_t>(infer)] = s.numel() / known;
  }
  Shape out(d);
  if (out.numel() != s.numel())
    detail::fail("reshape", "cannot reshape ", s.str(), " (", s.numel(), " elements) to ", out.str(), " (",
                 out.numel(), " elements)");
  GVar in[] = {x};
  return tp.record(detail::ReshapePrim<B>::def, in, ReshapeAttrs{out}, out, tp.dtype(x));
}

template <class B>
GVar reshape(GTape<B>& tp, GVar x, std::initializer_list<std::int64_t> dims) {
  return reshape(tp, x, std::span<const std::int64_t>(dims.begin(), dims.size()));
}

/// Axes reordered: out.shape[i] = x.shape[perm[i]].
template <class B>
GVar permute(GTape<B>& tp, GVar x, std::span<const int> perm) {
  const Shape& s = tp.shape(x);
  if (static_cast<int>(perm.size()) != s.rank())
    detail::fail("permute", "permutation of length ", perm.size(), " for shape ", s.str());
  PermuteAttrs a{};
  Shape out;
  std::array<bool, kMaxRank> seen{};
  int i = 0;
  for (int p : perm) {
    int q = p < 0 ? p + s.rank() : p;
    if (q < 0 || q >= s.rank() || seen[static_cast<std::size_t>(q)])
      detail::fail("permute", "invalid permutation for shape ", s.str(), " (axis ", p, ")");
    seen[static_cast<std::size_t>(q)] = true;
    a.perm[static_cast<std::size_t>(i++)] = q;
    out.push_back(s[q]);
  }
  GVar in[] = {x};
  return tp.record(detail::PermutePrim<B>::def, in, a, out, tp.dtype(x));
}

template <class B>
GVar permute(GTape<B>& tp, GVar x, std::initializer_list<int> perm) {
  return permute(tp, x, std::span<const int>(perm.begin(), perm.size()));
}

/// Swaps two axes (a copy; to multiply by a transpose use matmul's flags instead).
template <class B>
GVar transpose(GTape<B>& tp, GVar x, int d0 = -2, int d1 = -1) {
  const Shape& s = tp.shape(x);
  if (s.rank() < 2) detail::fail("transpose", "needs rank >= 2, got ", s.str());
  int a0 = detail::op_axis(s, d0, "transpose"), a1 = detail::op_axis(s, d1, "transpose");
  std::vector<int> p(static_cast<std::size_t>(s.rank()));
  for (int i = 0; i < s.rank(); ++i) p[static_cast<std::size_t>(i)] = i;
  std::swap(p[static_cast<std::size_t>(a0)], p[static_cast<std::size_t>(a1)]);
  PermuteAttrs a{};
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    a.perm[static_cast<std::size_t>(i)] = p[static_cast<std::size_t>(i)];
    out.push_back(s[p[static_cast<std::size_t>(i)]]);
  }
  GVar in[] = {x};
  return tp.record(detail::PermutePrim<B>::def, in, a, out, tp.dtype(x));
}

/// x[..., start:stop, ...] along `axis` (step 1; negative start/stop count from the end).
template <class B>
GVar slice(GTape<B>& tp, GVar x, int axis, std::int64_t start, std::int64_t stop) {
  const Shape& s = tp.shape(x);
  if (s.rank() == 0) detail::fail("slice", "cannot slice a scalar");
  int ax = detail::op_axis(s, axis, "slice");
  const std::int64_t n = s[ax];
  std::int64_t b = start < 0 ? start + n : start, e = stop < 0 ? stop + n : stop;
  if (b < 0 || e > n || b > e)
    detail::fail("slice", "range [", start, ", ", stop, ") out of bounds for axis ", axis, " of shape ", s.str());
  Shape out = s;
  out[ax] = e - b;
  GVar in[] = {x};
  return tp.record(detail::SlicePrim<B>::def, in, SliceAttrs{ax, b}, out, tp.dtype(x));
}

/// Joins tensors along `axis`; every other dim must match.
template <class B>
GVar concat(GTape<B>& tp, std::span<const GVar> xs, int axis) {
  if (xs.empty()) detail::fail("concat", "needs at least one input");
  const Shape& s0 = tp.shape(xs[0]);
  if (s0.rank() == 0) detail::fail("concat", "cannot concatenate scalars");
  int ax = detail::op_axis(s0, axis, "concat");
  Shape out = s0;
  out[ax] = 0;
  for (GVar v : xs) {
    const Shape& s = tp.shape(v);
    if (tp.dtype(v) != tp.dtype(xs[0]))
      detail::fail("concat", "dtype mismatch: ", dtype_name(tp.dtype(xs[0])), " ", s0.str(), " vs ",
                   dtype_name(tp.dtype(v)), " ", s.str());
    bool ok = s.rank() == s0.rank();
    for (int i = 0; ok && i < s.rank(); ++i) ok = i == ax || s[i] == s0[i];
    if (!ok) detail::fail("concat", "shapes ", s0.str(), " and ", s.str(), " differ outside axis ", axis);
    out[ax] += s[ax];
  }
  return tp.record(detail::ConcatPrim<B>::def, xs, ConcatAttrs{ax}, out, tp.dtype(xs[0]));
}
template <class B>
GVar concat(GTape<B>& tp, std::initializer_list<GVar> xs, int axis) {
  return concat(tp, std::span<const GVar>(xs.begin(), xs.size()), axis);
}

/// x broadcast (NumPy rules) to `shape`; the gradient is summed back to x's shape.
template <class B>
GVar broadcast_to(GTape<B>& tp, GVar x, const Shape& shape) {
  detail::require_float(tp, x, "broadcast_to");
  if (!detail::broadcasts_to(tp.shape(x), shape))
    detail::fail("broadcast_to", "shape ", tp.shape(x).str(), " cannot broadcast to ", shape.str());
  GVar in[] = {x};
  return tp.record(detail::BroadcastPrim<B>::def, in, NoAttrs{}, shape, tp.dtype(x));
}

}  // namespace nn
