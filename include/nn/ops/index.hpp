// SPDX-License-Identifier: MIT OR Apache-2.0
// Integer indexing: gather_rows (an embedding lookup; vjp scatter-add) and pick (one element per
// row, the target logit of a cross-entropy; vjp scatter into that element).
#pragma once

#include "common.hpp"

namespace nn {

namespace detail {

/// inputs: 0 table (N, D), 1 ids (integer, any shape). out: ids.shape + (D).
template <class B>
struct GatherRowsPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    Tensor y = n.value.reshape(Shape{tp.in(n, 1).numel(), tp.in(n, 0).dim(-1)});
    B::gather_rows(tp.in(n, 0), tp.in(n, 1), y);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    if (!s.acc) B::fill(s.g, 0.0);
    B::scatter_add_rows(n.grad, tp.in(n, 1), s.g);  // repeated ids accumulate
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> GatherRowsPrim<B>::def{.prim = Prim::gather_rows, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 2u>};

/// inputs: 0 x (..., V), 1 idx (integer, x.shape[:-1]). out: idx.shape.
template <class B>
struct PickPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::pick(tp.in(n, 0), tp.in(n, 1), n.value); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    if (!s.acc) B::fill(s.g, 0.0);
    B::pick_vjp(n.grad, tp.in(n, 1), s.g);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> PickPrim<B>::def{.prim = Prim::pick, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 2u>};

template <class B>
void require_ids(const GTape<B>& tp, GVar ids, const char* op) {
  DType t = tp.dtype(ids);
  if (t != DType::i32 && t != DType::i64)
    fail(op, "ids must be int32 or int64, got ", dtype_name(t), " ", tp.shape(ids).str());
  if (tp.requires_grad(ids)) fail(op, "ids cannot require a gradient");
}

}  // namespace detail

/// Rows of `table` (N, D) selected by integer `ids` of any shape: out = ids.shape + (D). The
/// vjp scatter-adds into the table's gradient, so a repeated id accumulates. Out-of-range ids
/// raise nn::Error (checked by the kernel on every run, replays included). A frozen bfloat16
/// table (Precision::bf16) gives float32 rows.
template <class B>
GVar gather_rows(GTape<B>& tp, GVar table, GVar ids) {
  const bool bf16 = tp.dtype(table) == DType::bf16;
  if (bf16) detail::require_frozen_bf16(tp, table, "gather_rows", "table");
  else detail::require_float(tp, table, "gather_rows");
  detail::require_ids(tp, ids, "gather_rows");
  const Shape& ts = tp.shape(table);
  if (ts.rank() != 2) detail::fail("gather_rows", "table must be (N, D), got ", ts.str());
  Shape out = tp.shape(ids);
  out.push_back(ts[1]);
  GVar in[] = {table, ids};
  return tp.record(detail::GatherRowsPrim<B>::def, in, NoAttrs{}, out, bf16 ? DType::f32 : tp.dtype(table));
}

/// out[i] = x[i, idx[i]] for x (..., V) and integer idx (...); an index < 0 picks 0 and passes no
/// gradient (how an ignored target is masked).
template <class B>
GVar pick(GTape<B>& tp, GVar x, GVar idx) {
  detail::require_float(tp, x, "pick");
  detail::require_ids(tp, idx, "pick");
  const Shape &xs = tp.shape(x), &is = tp.shape(idx);
  bool ok = xs.rank() == is.rank() + 1;
  for (int i = 0; ok && i < is.rank(); ++i) ok = xs[i] == is[i];
  if (!ok) detail::fail("pick", "indices ", is.str(), " do not match the leading dims of ", xs.str());
  GVar in[] = {x, idx};
  return tp.record(detail::PickPrim<B>::def, in, NoAttrs{}, is, tp.dtype(x));
}

}  // namespace nn
