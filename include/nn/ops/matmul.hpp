// SPDX-License-Identifier: MIT OR Apache-2.0
// matmul: batched over leading dims, either operand read transposed without a copy.
#pragma once

#include "common.hpp"

namespace nn {

/// matmul's flags: A and/or B read transposed; autocast (GTape::set_autocast): the product and
/// its vjp on bf16-rounded operands with f32 accumulation.
struct MatmulAttrs {
  bool trans_a, trans_b, autocast;
};

namespace detail {

/// C = op(A) @ op(B) (MatmulAttrs). When B is a matrix shared by a batched A
/// (x @ W^T, the Linear case), A's batch folds into its rows so every product is one GEMM.
/// Autocast: the forward product, dA and dB on bf16-rounded
/// operands with f32 accumulation (B::matmul_bf16), as torch.autocast's backward runs them.
template <class B>
struct MatmulPrim {
  static void mm(const Node<B>& n, const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    if constexpr (requires { B::bf16_weights; })
      if (attrs_of<MatmulAttrs>(n).autocast) return B::matmul_bf16(a, ta, b, tb, c, acc);
    B::matmul(a, ta, b, tb, c, acc);
  }

  // The views every kernel call uses: folded to 2-D when A is batched, B a matrix, A not transposed.
  static bool foldable(const Tensor& a, const Tensor& b, bool ta) { return a.rank() > 2 && b.rank() == 2 && !ta; }
  static Tensor rows(const Tensor& t) { return t.reshape(Shape{t.numel() / t.dim(-1), t.dim(-1)}); }

  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor &a = tp.in(n, 0), &b = tp.in(n, 1);
    const bool ta = attrs_of<MatmulAttrs>(n).trans_a, tb = attrs_of<MatmulAttrs>(n).trans_b;
    if (foldable(a, b, ta)) {
      Tensor c = rows(n.value);
      mm(n, rows(a), false, b, tb, c, false);
    } else {
      mm(n, a, ta, b, tb, n.value, false);
    }
  }

  // C = op(A) op(B):  dA = G op(B)^T  (or op(B) G^T when A is read transposed),
  //                   dB = op(A)^T G  (or G^T op(A) when B is read transposed).
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const Tensor &a = tp.in(n, 0), &b = tp.in(n, 1);
    const bool ta = attrs_of<MatmulAttrs>(n).trans_a, tb = attrs_of<MatmulAttrs>(n).trans_b;
    const bool fold = foldable(a, b, ta);
    const Tensor a2 = fold ? rows(a) : a;
    const Tensor g = fold ? rows(n.grad) : n.grad;
    if (tp.needs_grad(n, 0)) {
      GradSlot s = tp.grad_slot(n, 0);
      Tensor ga = fold ? rows(s.g) : s.g;
      if (!ta) mm(n, g, false, b, !tb, ga, s.acc);
      else mm(n, b, tb, g, true, ga, s.acc);
    }
    if (tp.needs_grad(n, 1)) {
      GradSlot s = tp.grad_slot(n, 1);
      if (!tb) mm(n, a2, !ta, g, false, s.g, s.acc);
      else mm(n, g, true, a2, ta, s.g, s.acc);
    }
  }
  // dA = g B^T reads B, dB = A^T g reads A: a frozen weight's product never keeps its input.
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    return (tp.needs_grad(n, 0) ? vjp_reads_input(1) : 0u) | (tp.needs_grad(n, 1) ? vjp_reads_input(0) : 0u);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> MatmulPrim<B>::def{.prim = Prim::matmul, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads};

}  // namespace detail

/// op(a) @ op(b) where op transposes the last two dims when its flag is set (read transposed,
/// never copied). a: (..., M, K) — or (..., K, M) with trans_a; b: (..., K, N) — or (..., N, K)
/// with trans_b. Leading (batch) dims must be equal, or one operand is a plain matrix shared by
/// every batch element. Result: (..., M, N).
/// b may be a frozen bfloat16 matrix beside a float32 a (Precision::bf16): the product then runs
/// on bf16 operands (a rounded) with f32 accumulation, and so does a's gradient (g op(b)^T).
/// Under GTape::set_autocast(DType::bf16) a float32 matrix b is rounded the same way, and both
/// gradients' products run on bf16-rounded operands too (f32 accumulation and results).
template <class B>
GVar matmul(GTape<B>& tp, GVar a, GVar b, bool trans_a = false, bool trans_b = false) {
  const Shape &sa = tp.shape(a), &sb = tp.shape(b);
  if (detail::bf16_weight(tp, a, b, "matmul")) {
    if constexpr (!requires { B::bf16_weights; })
      detail::fail("matmul", "this backend has no bf16 products (b is a bfloat16 ", sb.str(), ")");
    if (sb.rank() != 2 || trans_a)
      detail::fail("matmul", "a bfloat16 operand must be the right-hand matrix of a product with a untransposed, got ",
                   sa.str(), trans_a ? "^T" : "", " @ ", sb.str());
  } else {
    detail::require_same_dtype(tp, a, b, "matmul");
  }
  if (sa.rank() < 2 || sb.rank() < 2)
    detail::fail("matmul", "operands need rank >= 2, got ", sa.str(), " and ", sb.str());
  const std::int64_t M = trans_a ? sa.dim(-1) : sa.dim(-2), Ka = trans_a ? sa.dim(-2) : sa.dim(-1);
  const std::int64_t Kb = trans_b ? sb.dim(-1) : sb.dim(-2), N = trans_b ? sb.dim(-2) : sb.dim(-1);
  if (Ka != Kb)
    detail::fail("matmul", "inner dimensions differ: ", sa.str(), trans_a ? "^T" : "", " @ ", sb.str(),
                 trans_b ? "^T" : "", " (", Ka, " vs ", Kb, ")");
  Shape out;
  if (sa.rank() > 2 && sb.rank() > 2) {
    if (sa.rank() != sb.rank())
      detail::fail("matmul", "batch dims differ: ", sa.str(), " @ ", sb.str());
    for (int i = 0; i < sa.rank() - 2; ++i) {
      if (sa[i] != sb[i]) detail::fail("matmul", "batch dims differ: ", sa.str(), " @ ", sb.str());
      out.push_back(sa[i]);
    }
  } else {
    const Shape& batched = sa.rank() > 2 ? sa : sb;
    for (int i = 0; i < batched.rank() - 2; ++i) out.push_back(batched[i]);
  }
  out.push_back(M);
  out.push_back(N);
  MatmulAttrs at{trans_a, trans_b, false};
  // autocast: products whose right operand is a float32 matrix (a weight), as torch.autocast;
  // a transposed batched a would not fold into rows, so it keeps float32
  if constexpr (requires { B::bf16_weights; })
    at.autocast = tp.autocast() == DType::bf16 && tp.dtype(a) == DType::f32 && tp.dtype(b) == DType::f32 &&
              sb.rank() == 2 && !(sa.rank() > 2 && trans_a);
  GVar in[] = {a, b};
  return tp.record(detail::MatmulPrim<B>::def, in, at, out, tp.dtype(a));
}

}  // namespace nn
