// SPDX-License-Identifier: MIT OR Apache-2.0
// Gradient trees as values. A model's own type doubles as the tree of its gradients:
// value_and_grad returns one, each trainable Param holding its gradient and each frozen one
// empty. These walk trees of one type leaf by leaf (declaration order, the order of the paths
// summary() prints), so accumulating gradients over micro-batches is two lines:
//
//   if (!sum) sum = std::move(g); else nn::tree_add(*sum, g);   // per micro-batch
//   nn::tree_scale(*sum, 1.0 / n);                              // before the update
//
// The leaves are host tensors (value_and_grad's gradients are), or a device's with the backend
// named: nn::tree_add<nn::cuda>(sum, g) for value_and_grad<nn::cuda>'s trees.
#pragma once

#include <string>
#include <vector>

#include "backend/cpu.hpp"
#include "module.hpp"

namespace nn {

/// f(path, Param& out_leaf) for every parameter leaf of `tree`.
template <class M, class F>
void tree_map(M& tree, F&& f) {
  detail::for_each(tree, [&](const std::string& path, Param& p) { f(path, p); });
}

/// f(path, Param& out_leaf, const Param& in_leaf) for the leaves of two trees of the same type,
/// pairwise. The trees must have the same structure (vectors of the same lengths, the same
/// optionals engaged); a mismatch is an nn::Error naming the first path that differs.
template <class M, class F>
void tree_map(M& out, const M& in, F&& f) {
  std::vector<std::pair<std::string, const Param*>> leaves;
  detail::for_each(in, [&](const std::string& path, const Param& p) { leaves.emplace_back(path, &p); });
  std::size_t i = 0;
  detail::for_each(out, [&](const std::string& path, Param& p) {
    if (i >= leaves.size())
      detail::fail("tree_map", "the trees differ in structure at '", path, "' (the other has no more leaves)");
    if (leaves[i].first != path)
      detail::fail("tree_map", "the trees differ in structure at '", path, "' (the other has '", leaves[i].first, "')");
    f(path, p, *leaves[i++].second);
  });
  if (i != leaves.size())
    detail::fail("tree_map", "the trees differ in structure: the other has more leaves, from '", leaves[i].first, "'");
}

/// acc += g, leaf by leaf, for the leaves g holds (its empty ones, frozen parameters, are
/// skipped); an empty leaf of acc takes a copy of g's. Shapes and dtypes must match. B: the
/// backend whose kernels add (the leaves' device).
template <class B = cpu, class M>
void tree_add(M& acc, const M& g) {
  tree_map(acc, g, [](const std::string& path, Param& a, const Param& b) {
    if (!b.value.defined()) return;
    if (!a.value.defined()) {
      a.value = b.value.clone();
      return;
    }
    if (a.value.shape() != b.value.shape() || a.value.dtype() != b.value.dtype())
      detail::fail("tree_add", "'", path, "' is ", dtype_name(a.value.dtype()), " ", a.value.shape().str(),
                   " in the sum but ", dtype_name(b.value.dtype()), " ", b.value.shape().str(), " in the addend");
    B::copy(b.value, a.value, true);
  });
}

/// t *= s for every leaf t holds.
template <class B = cpu, class M>
void tree_scale(M& t, double s) {
  tree_map(t, [s](const std::string&, Param& p) {
    if (p.value.defined()) B::unary(Unary::scale, s, p.value, p.value);
  });
}

/// Every leaf t holds set to zero (in place: storage shared with t stays shared).
template <class B = cpu, class M>
void tree_zero(M& t) {
  tree_map(t, [](const std::string&, Param& p) {
    if (p.value.defined()) B::fill(p.value, 0.0);
  });
}

/// A deep copy of a model (or gradient tree): every Param and Buffer in fresh storage. A plain
/// copy (`M b = a;`) shares its tensors with `a`, which is what value_and_grad and optimizers
/// rely on; clone() is the snapshot that later updates of `a` leave alone.
template <class M>
  requires detail::ModuleType<M>
M clone(const M& m) {
  M c = m;
  detail::for_each(
      c, [](const std::string&, Param& p) { if (p.value.defined()) p.value = p.value.clone(); },
      [](const std::string&, Buffer& b) { if (b.value.defined()) b.value = b.value.clone(); });
  return c;
}

}  // namespace nn
