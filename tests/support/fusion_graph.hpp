// SPDX-License-Identifier: MIT OR Apache-2.0
// Random elementwise graphs for the fusion tests (tests/core/fusion.test.cpp on the CPU,
// tests/cuda/fusion.test.cu on the GPU): the same graph from the same seed on any backend.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

#include "support/check.hpp"

namespace nn::test {

// One random graph: leaves of the full shape and of broadcast shapes (a trailing suffix, one
// element, a middle dimension of 1), some frozen, then `ops` unary, binary and where nodes over
// random earlier values (so values fan out; a where's mask is a constant of u8 or the graph's
// dtype, of any of those shapes), then loss = sum(out * w) over the last one.
struct FusionGraph {
  Shape full;
  std::vector<Tensor> leaves;
  std::vector<bool> trainable;
  Tensor w;
  std::vector<Tensor> masks;  // the wheres' masks (constants)
  struct Op {
    bool binary;
    int op, a, b;  // a where: op is its mask's index in masks
    double arg;
    bool select = false;
  };
  std::vector<Op> ops;

  FusionGraph(std::uint64_t seed, DType dt) {
    std::mt19937_64 rng(seed);
    auto pick = [&](int n) { return static_cast<int>(rng() % static_cast<std::uint64_t>(n)); };
    const bool big = seed % 25 == 0;  // some past the parallel threshold and many tiles
    full = big ? Shape{3, 200, 70} : Shape{3, 5, 7};
    const Shape shapes[] = {full, Shape{full[2]}, Shape{1}, Shape{full[0], 1, full[2]}};
    const int n_leaves = 2 + pick(3);
    for (int k = 0; k < n_leaves; ++k) {
      leaves.push_back(nn::test::random_tensor(k == 0 ? full : shapes[pick(4)], dt, rng(), -1.5, 1.5));
      trainable.push_back(k == 0 || pick(4) != 0);
    }
    const int n_ops = 2 + pick(9);
    for (int i = 0; i < n_ops; ++i) {
      const int avail = n_leaves + i;
      // mostly the newest values, so chains form; sometimes any earlier one, so values fan out
      auto operand = [&] { return pick(3) ? avail - 1 - pick(std::min(avail, 2)) : pick(avail); };
      if (pick(2)) {
        const int k = pick(8);  // a quarter of them a where
        if (k < 6) {
          ops.push_back({true, k, operand(), operand(), 0});
        } else {  // where(mask, a, b)
          const Shape ms = shapes[pick(4)];
          std::vector<double> mv(static_cast<std::size_t>(ms.numel()));
          for (double& x : mv) x = pick(2);
          masks.push_back(Tensor::from_doubles(ms, mv, pick(2) ? DType::u8 : dt));
          ops.push_back({false, static_cast<int>(masks.size()) - 1, operand(), operand(), 0, true});
        }
      } else {
        // the unary ops with a domain (log, sqrt, rsqrt, pow) get a positive operand: the
        // graph adds abs and add_scalar first, as nodes of their own
        static const Unary safe[] = {Unary::neg,  Unary::tanh, Unary::sigmoid,     Unary::relu,      Unary::abs,
                                     Unary::silu, Unary::gelu, Unary::gelu_approx, Unary::gelu_fast, Unary::scale,
                                     Unary::add_scalar, Unary::exp, Unary::log, Unary::sqrt, Unary::rsqrt, Unary::pow};
        const Unary u = safe[pick(16)];
        int a = operand();
        if (u == Unary::log || u == Unary::sqrt || u == Unary::rsqrt || u == Unary::pow) {
          ops.push_back({false, static_cast<int>(Unary::abs), a, 0, 0});
          ops.push_back({false, static_cast<int>(Unary::add_scalar), n_leaves + static_cast<int>(ops.size()) - 1, 0, 0.5});
          a = n_leaves + static_cast<int>(ops.size()) - 1;
        }
        if (u == Unary::exp) {  // bounded first, so no value overflows
          ops.push_back({false, static_cast<int>(Unary::tanh), a, 0, 0});
          a = n_leaves + static_cast<int>(ops.size()) - 1;
        }
        const double arg = u == Unary::scale ? -1.25 : u == Unary::add_scalar ? 0.75 : u == Unary::pow ? 1.5 : 0.0;
        ops.push_back({false, static_cast<int>(u), a, 0, arg});
      }
      i = static_cast<int>(ops.size()) - 1;
    }
    w = nn::test::random_tensor(full, dt, rng());
  }

  // Records the graph on tp, its leaves `lv` (leaves, or copies of them on B's device, which the
  // caller keeps alive as the tape's parameters); returns the loss, and the last op's value as
  // *out.
  template <class B>
  GVar record(GTape<B>& tp, const std::vector<Tensor>& lv, std::vector<GVar>& params, GVar* out) const {
    std::vector<GVar> v;
    params.clear();
    for (std::size_t k = 0; k < lv.size(); ++k) {
      v.push_back(tp.param(lv[k], trainable[k]));
      params.push_back(v.back());
    }
    for (const Op& o : ops) {
      // a binary op of two broadcast leaves may be smaller than full; that is fine
      const GVar a = v[static_cast<std::size_t>(o.a)];
      if (o.select)
        v.push_back(where(tp, tp.constant(nn::detail::on_backend<B>(masks[static_cast<std::size_t>(o.op)])), a,
                          v[static_cast<std::size_t>(o.b)]));
      else
        v.push_back(o.binary ? binary(tp, static_cast<Binary>(o.op), a, v[static_cast<std::size_t>(o.b)])
                             : unary(tp, static_cast<Unary>(o.op), a, o.arg));
    }
    *out = v.back();
    // w is broadcast against the last value when that one is smaller than full
    // (+ the sum of leaf 0, trainable always, so every graph's loss has a gradient)
    return add(tp, sum(tp, mul(tp, add(tp, v.back(), tp.constant(nn::detail::on_backend<B>(w))), v.back())), sum(tp, v[0]));
  }
};

}  // namespace nn::test
