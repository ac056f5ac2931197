// SPDX-License-Identifier: MIT OR Apache-2.0
// Fusion of elementwise chains on a recorded tape (the first seed's gpfuse): a pass over the
// tape finds groups of unary, binary and where nodes whose intermediate values nothing else
// reads, and turns each group into one `fused` node that runs the group per element in one loop,
// forward and vjp: backend/cpu/fused.hpp on the CPU, one CUDA kernel per direction (k_fused,
// k_fused_vjp in backend/cuda/kernels.cuh) on nn::cuda, both interpreting the same FusedProgram.
// The fused node is the group's last node (its index, its value buffer, its GVar); the others
// are absorbed (Node::fused_into) and hold no buffers. Values and gradients equal the unfused
// tape's bit for bit: each element goes through the same functors (backend/math.hpp) in the same
// order, and each contribution to an input's gradient is added in the order the backward sweep
// adds it unfused.
#pragma once

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>

#include "../backend/cpu/fused.hpp"
#include "common.hpp"
#include "elementwise.hpp"

namespace nn {

/// A fused node's attributes: its program's index on the tape (GTape::fused_program).
struct FusedAttrs {
  std::int32_t program = -1;
};

namespace detail {

// The fused vjp's contributions to inputs, numbered as backend/cpu/fused.hpp walks them: steps
// in reverse, operand a before b, only operands that are inputs and want a gradient. f(step,
// which, register) per contribution, in that order.
template <class F>
void for_each_fused_contribution(const FusedProgram& p, F&& f) {
  for (int s = p.steps - 1; s >= 0; --s) {
    const FusedStep& st = p.step[static_cast<std::size_t>(s)];
    if (!st.grad) continue;
    if (st.grad_a && st.a < p.inputs) f(s, 0, st.a);
    if ((st.binary || st.select) && st.grad_b && st.b < p.inputs) f(s, 1, st.b);
  }
}

template <class B>
struct FusedPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    std::array<const Tensor*, kMaxFusedInputs> ins{};
    for (std::size_t k = 0; k < n.inputs.size(); ++k) ins[k] = &tp.in(n, k);
    B::fused(program(tp, n), std::span<const Tensor* const>(ins.data(), n.inputs.size()), n.value);
  }
  // Each contribution's destination, taken from the tape in the sweep's order (so the first
  // overwrites and the rest add, as unfused); a broadcast input's contributions go to scratch
  // buffers at the output's shape, each summed down into its gradient afterwards, in order.
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const FusedProgram& p = program(tp, n);
    std::array<const Tensor*, kMaxFusedInputs> ins{};
    for (std::size_t k = 0; k < n.inputs.size(); ++k) ins[k] = &tp.in(n, k);
    std::array<FusedGradDest, 2 * kMaxFusedSteps> dest{};
    std::array<std::int8_t, 2 * kMaxFusedSteps> reduce_into{};  // input k, or -1: written in place
    std::size_t c = 0;
    for_each_fused_contribution(p, [&](int, int, int) { ++c; });
    if (n.saved.size() < c) n.saved.resize(c);  // first run only: later scratch() calls move nothing
    c = 0;
    for_each_fused_contribution(p, [&](int, int, int reg) {
      const std::size_t k = static_cast<std::size_t>(reg);
      if (tp.in(n, k).shape() == n.value.shape()) {
        GradSlot s = tp.grad_slot(n, k);
        dest[c] = {&s.g, s.acc};
        reduce_into[c] = -1;
      } else {
        dest[c] = {&tp.scratch(n, c, n.value.shape(), n.value.dtype()), false};
        reduce_into[c] = static_cast<std::int8_t>(reg);
      }
      ++c;
    });
    B::fused_vjp(p, std::span<const Tensor* const>(ins.data(), n.inputs.size()), n.value, n.grad,
                 std::span<const FusedGradDest>(dest.data(), c));
    for (std::size_t j = 0; j < c; ++j)
      if (reduce_into[j] >= 0) tp.accumulate_reduced(n, static_cast<std::size_t>(reduce_into[j]), *dest[j].g);
  }
  // The inputs the vjp recomputes from, and the output when a derivative reads it.
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    const FusedProgram& p = program(tp, n);
    const std::uint32_t inputs = p.vjp_need & ((1u << p.inputs) - 1u);
    return inputs | (((p.vjp_need >> (p.inputs + p.steps - 1)) & 1u) ? kVjpReadsOutput : 0u);
  }
  static const FusedProgram& program(const GTape<B>& tp, const Node<B>& n) {
    return tp.fused_program(attrs_of<FusedAttrs>(n).program);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> FusedPrim<B>::def{.prim = Prim::fused, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads};

// The cost rule. The fused vjp recomputes a group's intermediates (only the last value is
// stored): cheap for arithmetic, not for a transcendental, whose recomputation costs more than
// the memory pass it saves (bench/fusion.cpp measured fused SwiGLU from silu and mul at 0.6-0.7x
// of unfused when silu was recomputed). So an op with a transcendental (exp, log, sqrt, rsqrt,
// tanh, sigmoid, pow, silu, the GELUs) joins a group only as its last node, whose value the vjp
// reads instead.
inline bool recompute_is_cheap(Unary op) {
  switch (op) {
    case Unary::neg: case Unary::relu: case Unary::abs: case Unary::scale: case Unary::add_scalar: return true;
    default: return false;
  }
}

// Whether node i may join a fused group: a unary, binary or where node of a float dtype, outside
// checkpoint segments (their nodes are recomputed by the sweep), not already planned or fused.
template <class B>
bool fusable(GTape<B>& tp, std::int32_t i) {
  const Node<B>& n = tp.at(i);
  if (!n.def || (n.def->prim != Prim::unary && n.def->prim != Prim::binary && n.def->prim != Prim::where)) return false;
  const DType t = n.value.dtype();
  return (t == DType::f32 || t == DType::f64) && !n.pooled && !n.planned && n.segment < 0 && n.fused_into < 0;
}

}  // namespace detail

/// What fuse_elementwise did: groups made, nodes absorbed into them, and the memory traffic a
/// step no longer makes (each absorbed value's write and read, and, where the group wants a
/// gradient, its gradient's write and read).
struct FusionStats {
  int groups = 0;
  int absorbed = 0;
  std::int64_t bytes_saved = 0;
};

/// The fusion pass, run on a recorded tape before it is planned (nn::compile runs it when
/// asked: CompiledStep::fuse). From the last node back, each unary, binary or where node roots
/// a group that takes in every operand that is itself such a node of the same shape and dtype
/// (a where's mask is always an input), read by nothing but its one consumer in the group, and
/// not `out` (up to kMaxFusedSteps nodes and
/// kMaxFusedInputs distinct inputs); a transcendental op only as a group's last node (the cost
/// rule: detail::recompute_is_cheap). Groups of two or more nodes become one fused node. A group
/// is left unfused where fusing would reorder a gradient's sum: an input of the group that a
/// node outside it also reads, between the group's first and last node, would get its
/// contributions added in another order. No fusion on a tape in anomaly mode (its errors name
/// the node that made a NaN). Intermediates of a fused group cannot be read afterwards (an
/// nn::Error says so), as with plan_memory: fuse only a tape whose intermediates nobody reads.
/// On an eagerly recorded tape (a CUDA one) the group's nodes already ran unfused; their
/// buffers are released here and replays run the fused node.
template <class B>
FusionStats fuse_elementwise(GTape<B>& tp, GVar out) {
  FusionStats stats;
  tp.node(out);  // validates the handle
  if (tp.detect_anomaly()) return stats;
  const auto N = static_cast<std::int32_t>(tp.size());
  std::vector<std::vector<std::int32_t>> readers(static_cast<std::size_t>(N));  // every node reading each node, per use
  for (std::int32_t i = 0; i < N; ++i)
    for (std::int32_t in : tp.at(i).inputs) readers[static_cast<std::size_t>(in)].push_back(i);
  std::vector<char> taken(static_cast<std::size_t>(N), 0);
  std::vector<std::int32_t> group, stack, ext;
  for (std::int32_t r = N - 1; r >= 0; --r) {
    if (taken[static_cast<std::size_t>(r)] || !detail::fusable(tp, r)) continue;
    const Node<B>& root = tp.at(r);
    group.assign(1, r);
    stack.assign(1, r);
    while (!stack.empty()) {
      const std::int32_t j = stack.back();
      stack.pop_back();
      const bool select = tp.at(j).def->prim == Prim::where;
      for (std::size_t q = select ? 1 : 0; q < tp.at(j).inputs.size(); ++q) {  // a where's mask stays an input
        const std::int32_t in = tp.at(j).inputs[q];
        const auto u = static_cast<std::size_t>(in);
        if (group.size() >= static_cast<std::size_t>(kMaxFusedSteps)) break;
        if (in == out.index || taken[u] || readers[u].size() != 1 || !detail::fusable(tp, in)) continue;
        const Node<B>& m = tp.at(in);
        if (m.def->prim == Prim::unary && !detail::recompute_is_cheap(detail::attrs_of<UnaryAttrs>(m).op)) continue;
        if (!(m.value.shape() == root.value.shape()) || m.value.dtype() != root.value.dtype()) continue;
        group.push_back(in);
        stack.push_back(in);
      }
    }
    if (group.size() < 2) continue;
    std::sort(group.begin(), group.end());  // the tape's order is a topological one
    auto member = [&](std::int32_t i) { return std::binary_search(group.begin(), group.end(), i); };
    // the group's inputs, in order of first use; each a register
    ext.clear();
    for (std::int32_t j : group)
      for (std::int32_t in : tp.at(j).inputs)
        if (!member(in) && std::find(ext.begin(), ext.end(), in) == ext.end()) ext.push_back(in);
    if (ext.size() > static_cast<std::size_t>(kMaxFusedInputs)) continue;
    bool reorders = false;
    for (std::int32_t x : ext) {
      if (!tp.at(x).requires_grad) continue;
      for (std::int32_t c : readers[static_cast<std::size_t>(x)])
        reorders = reorders || (!member(c) && c > group.front() && c < r);
    }
    if (reorders) continue;

    FusedProgram p;
    p.inputs = static_cast<int>(ext.size());
    p.steps = static_cast<int>(group.size());
    auto reg = [&](std::int32_t i) -> std::int8_t {
      if (member(i)) return static_cast<std::int8_t>(p.inputs + (std::lower_bound(group.begin(), group.end(), i) - group.begin()));
      return static_cast<std::int8_t>(std::find(ext.begin(), ext.end(), i) - ext.begin());
    };
    for (std::size_t s = 0; s < group.size(); ++s) {
      const Node<B>& n = tp.at(group[s]);
      FusedStep& st = p.step[s];
      st.binary = n.def->prim == Prim::binary;
      st.select = n.def->prim == Prim::where;
      if (st.select) {  // where(mask, a, b): registers m, a, b
        st.m = reg(n.inputs[0]);
        st.a = reg(n.inputs[1]);
        st.b = reg(n.inputs[2]);
        st.grad_a = tp.at(n.inputs[1]).requires_grad;
        st.grad_b = tp.at(n.inputs[2]).requires_grad;
        st.grad = n.requires_grad;
        st.node = group[s];
        continue;
      }
      if (st.binary) {
        st.op = static_cast<std::uint8_t>(detail::attrs_of<BinaryAttrs>(n).op);
      } else {
        const UnaryAttrs& a = detail::attrs_of<UnaryAttrs>(n);
        st.op = static_cast<std::uint8_t>(a.op);
        st.arg = a.arg;
      }
      st.a = reg(n.inputs[0]);
      st.grad_a = tp.at(n.inputs[0]).requires_grad;
      if (st.binary) {
        st.b = reg(n.inputs[1]);
        st.grad_b = tp.at(n.inputs[1]).requires_grad;
      }
      st.grad = n.requires_grad;
      st.node = group[s];
    }
    // what the vjp reads: the derivatives' operands, then (from the last step down) what each
    // recomputed intermediate is computed from; the last step's value comes from the output
    std::uint32_t need = 0;
    for (int s = 0; s < p.steps; ++s) {
      const FusedStep& st = p.step[static_cast<std::size_t>(s)];
      if (!st.grad) continue;
      const std::uint32_t self = 1u << (p.inputs + s), a = 1u << st.a, b = st.binary ? 1u << st.b : 0u;
      if (st.select) {  // where's vjp reads the mask alone
        if (st.grad_a || st.grad_b) need |= 1u << st.m;
      } else if (!st.binary) {
        const unsigned rd = st.grad_a ? detail::unary_df_reads(static_cast<Unary>(st.op)) : 0u;
        need |= ((rd & 1u) ? a : 0u) | ((rd & 2u) ? self : 0u);
      } else {
        for (int which = 0; which < 2; ++which) {
          if (!(which == 0 ? st.grad_a : st.grad_b)) continue;
          const unsigned rd = detail::binary_df_reads(static_cast<Binary>(st.op), which);
          need |= ((rd & 1u) ? a : 0u) | ((rd & 2u) ? b : 0u);
        }
      }
    }
    for (int s = p.steps - 2; s >= 0; --s) {
      const FusedStep& st = p.step[static_cast<std::size_t>(s)];
      if ((need >> (p.inputs + s)) & 1u)
        need |= (1u << st.a) | (st.binary || st.select ? 1u << st.b : 0u) | (st.select ? 1u << st.m : 0u);
    }
    p.vjp_need = need;
    const std::int32_t id = tp.add_fused_program(p);
    const std::int64_t bytes = root.value.numel() * static_cast<std::int64_t>(dtype_size(root.value.dtype()));
    for (std::int32_t j : group) {
      taken[static_cast<std::size_t>(j)] = 1;
      if (j == r) continue;
      Node<B>& n = tp.at(j);
      stats.bytes_saved += bytes * (n.requires_grad ? 4 : 2);
      n.def = nullptr;
      n.fused_into = r;
      n.inputs.clear();
      n.requires_grad = false;
      n.value = Tensor();
      n.grad = Tensor();
      n.saved.clear();
      n.deferred = false;
    }
    Node<B>& f = tp.at(r);
    f.def = &detail::FusedPrim<B>::def;
    f.inputs = ext;
    f.attrs.set(FusedAttrs{id});
    f.saved.clear();
    ++stats.groups;
    stats.absorbed += static_cast<int>(group.size()) - 1;
  }
  return stats;
}

/// One line per fused node of the tape, then the totals: its index and scope, its steps' ops
/// and the nodes they were, its inputs, the elements and dtype, and the bytes per step it saves
/// (as FusionStats counts them). nn::compile prints it to stderr when NN_FUSION_LOG=1.
template <class B>
std::string fusion_report(const GTape<B>& tp) {
  std::ostringstream os;
  int groups = 0, absorbed = 0;
  std::int64_t saved = 0;
  for (std::size_t i = 0; i < tp.size(); ++i) {
    const GVar v{&tp, static_cast<std::int32_t>(i)};
    const Node<B>& n = tp.node(v);
    if (!n.def || n.def->prim != Prim::fused) continue;
    const FusedProgram& p = detail::FusedPrim<B>::program(tp, n);
    const std::int64_t bytes = n.value.numel() * static_cast<std::int64_t>(dtype_size(n.value.dtype()));
    std::int64_t s = 0;
    os << "fused node " << i;
    if (!tp.scope_path(v).empty()) os << " ('" << tp.scope_path(v) << "')";
    os << ":";
    for (int k = 0; k < p.steps; ++k) {
      const FusedStep& st = p.step[static_cast<std::size_t>(k)];
      os << ' ' << (st.select ? "where" : st.binary ? binary_name(static_cast<Binary>(st.op)) : unary_name(static_cast<Unary>(st.op)))
         << '#' << st.node;
      if (k + 1 < p.steps) s += bytes * (st.grad ? 4 : 2);
    }
    os << ", " << p.inputs << " inputs, " << n.value.numel() << ' ' << dtype_name(n.value.dtype()) << ", " << s
       << " bytes saved per step\n";
    ++groups;
    absorbed += p.steps - 1;
    saved += s;
  }
  os << "fusion: " << groups << " groups, " << absorbed << " nodes absorbed, " << saved << " bytes saved per step\n";
  return os.str();
}

}  // namespace nn
