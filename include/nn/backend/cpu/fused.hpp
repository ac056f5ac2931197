// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's fused elementwise kernel: a FusedProgram (backend/policy.hpp; ops/fused.hpp makes it
// from a group of the tape's unary, binary and where nodes) run over the output in tiles of kTile
// elements. Each step of the program runs over the whole tile before the next (one dispatch per
// step and tile, a loop the compiler vectorises as it does the unfused kernels'), and the tile's
// registers stay in L1: one pass over memory for the group instead of one per node.
//
// The vjp recomputes the tile's intermediates (the last step's value it reads from the output),
// then walks the steps in reverse, as the backward
// sweep walks the nodes: each gradient is the same product (g * f'(...)) the node's own vjp
// forms, and each contribution to an input is added in the order the sweep would add it, so the
// fused step equals the unfused one bit for bit.
#pragma once

#include "common.hpp"

namespace nn {

/// Where the fused vjp writes one contribution to an input's gradient: a buffer at the output's
/// shape (the input's gradient, or a scratch the op then sums down to a broadcast input's shape)
/// and whether it adds into what is there.
struct FusedGradDest {
  Tensor* g = nullptr;
  bool acc = false;
};

namespace cpu_kernels {

// A class template with one instance, `FusedKernels` (why: backend/cpu.hpp).
template <class = void>
struct FusedKernelsT {
  static constexpr std::int64_t kTile = 128;
  static constexpr int kMaxRegs = kMaxFusedInputs + kMaxFusedSteps;

  /// y = the program's output; ins: its inputs, each of y's shape or broadcast to it.
  static void fused(const FusedProgram& p, std::span<const Tensor* const> ins, Tensor& y) {
    detail::dispatch_float(y.dtype(), "fused", [&]<class T>() {
      const Readers rd(p, ins, y.shape());
      T* ys = static_cast<T*>(y.raw());
      const std::int64_t n = y.numel(), tiles = (n + kTile - 1) / kTile;
      detail::parallel_for(tiles, n > detail::kParallelGrain, [&](std::int64_t t) {
        alignas(64) T buf[kMaxRegs][kTile];
        const T* r[kMaxRegs];
        const std::int64_t i0 = t * kTile, len = std::min(kTile, n - i0);
        rd.template load<T>(r, buf, i0, len);
        run_steps<T>(p, r, buf, p.steps - 1, len);
        run_step<T>(p, p.steps - 1, r, ys + i0, len);  // the last step straight into y
      });
    });
  }

  /// The program's vjp from the output y and its gradient g: dest[c] receives contribution c,
  /// the contributions numbered as the steps are walked in reverse (operand a before b) over the
  /// operands that are inputs and want a gradient (ops/fused.hpp numbers them the same way).
  /// The intermediates the derivatives read are recomputed from the inputs (FusedProgram::
  /// vjp_need); the last step's value is read from y.
  static void fused_vjp(const FusedProgram& p, std::span<const Tensor* const> ins, const Tensor& y, const Tensor& g,
                        std::span<const FusedGradDest> dest) {
    detail::dispatch_float(g.dtype(), "fused", [&]<class T>() {
      const Readers rd(p, ins, g.shape());
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      const std::int64_t n = g.numel(), tiles = (n + kTile - 1) / kTile;
      detail::parallel_for(tiles, n > detail::kParallelGrain, [&](std::int64_t t) {
        alignas(64) T buf[kMaxRegs][kTile];
        alignas(64) T gbuf[kMaxFusedSteps][kTile];  // d loss / d (step s's value), s < steps - 1
        alignas(64) static const T zeros[kTile] = {};  // what an unread register points at
        const T* r[kMaxRegs];
        const std::int64_t i0 = t * kTile, len = std::min(kTile, n - i0);
        rd.template load<T>(r, buf, i0, len, p.vjp_need, zeros);
        run_steps<T>(p, r, buf, p.steps - 1, len, p.vjp_need, zeros);
        r[p.inputs + p.steps - 1] = needs(p.vjp_need, p.inputs + p.steps - 1) ? ys + i0 : zeros;
        std::size_t c = 0;
        for (int s = p.steps - 1; s >= 0; --s) {
          const FusedStep& st = p.step[static_cast<std::size_t>(s)];
          if (!st.grad) continue;
          const T* go = s == p.steps - 1 ? gs + i0 : gbuf[s];
          const T* a = r[st.a];
          if (st.select) {  // where's vjp: the cotangent where the branch was taken, else 0
            const T* m = r[st.m];
            for (int which = 0; which < 2; ++which) {
              if (!(which == 0 ? st.grad_a : st.grad_b)) continue;
              const int reg = which == 0 ? st.a : st.b;
              T* out = target<T>(p, reg, gbuf, dest, c, i0);
              const bool acc = reg < p.inputs && dest[c - 1].acc;
              for (std::int64_t j = 0; j < len; ++j) detail::put(out, j, (m[j] != T(0)) == (which == 0) ? go[j] : T(0), acc);
            }
            continue;
          }
          if (!st.binary) {
            if (!st.grad_a) continue;
            const T* yv = r[p.inputs + s];
            const T arg = static_cast<T>(st.arg);
            T* out = target<T>(p, st.a, gbuf, dest, c, i0);
            const bool acc = st.a < p.inputs && dest[c - 1].acc;
            detail::dispatch_unary(static_cast<Unary>(st.op), [&]<Unary Op>() {
              for (std::int64_t j = 0; j < len; ++j) detail::put(out, j, go[j] * detail::unary_df(Op, a[j], yv[j], arg), acc);
            });
            continue;
          }
          const T* b = r[st.b];
          detail::dispatch_binary(static_cast<Binary>(st.op), [&]<Binary Op>() {
            for (int which = 0; which < 2; ++which) {
              if (!(which == 0 ? st.grad_a : st.grad_b)) continue;
              const int reg = which == 0 ? st.a : st.b;
              T* out = target<T>(p, reg, gbuf, dest, c, i0);
              const bool acc = reg < p.inputs && dest[c - 1].acc;
              for (std::int64_t j = 0; j < len; ++j) detail::put(out, j, go[j] * detail::binary_df(Op, which, a[j], b[j]), acc);
            }
          });
        }
      });
    });
  }

 private:
  // Where a gradient for register `reg` goes: an intermediate's gradient buffer (written once:
  // a fused intermediate has one consumer), or an input's next destination (at element i0).
  template <class T>
  static T* target(const FusedProgram& p, int reg, T (*gbuf)[kTile], std::span<const FusedGradDest> dest,
                   std::size_t& c, std::int64_t i0) {
    if (reg >= p.inputs) return gbuf[reg - p.inputs];
    return static_cast<T*>(dest[c++].g->raw()) + i0;
  }

  static bool needs(std::uint32_t mask, int reg) { return (mask >> reg) & 1u; }

  // Steps 0..count-1 of the tile into their buffers (register inputs + s points at its buffer);
  // a step outside `mask` is not computed (its register points at `skip`).
  template <class T>
  static void run_steps(const FusedProgram& p, const T** r, T (*buf)[kTile], int count, std::int64_t len,
                        std::uint32_t mask = ~0u, const T* skip = nullptr) {
    for (int s = 0; s < count; ++s) {
      if (!needs(mask, p.inputs + s)) {
        r[p.inputs + s] = skip;
        continue;
      }
      T* y = buf[p.inputs + s];
      run_step<T>(p, s, r, y, len);
      r[p.inputs + s] = y;
    }
  }
  // One step over len elements into y; the op a compile-time constant, so the loop vectorises
  // as the unfused kernel's does.
  template <class T>
  static void run_step(const FusedProgram& p, int s, const T* const* r, T* y, std::int64_t len) {
    const FusedStep& st = p.step[static_cast<std::size_t>(s)];
    const T* a = r[st.a];
    if (st.select) {
      const T *b = r[st.b], *m = r[st.m];
      for (std::int64_t j = 0; j < len; ++j) y[j] = m[j] != T(0) ? a[j] : b[j];
      return;
    }
    if (!st.binary) {
      const T arg = static_cast<T>(st.arg);
      detail::dispatch_unary(static_cast<Unary>(st.op), [&]<Unary Op>() {
        for (std::int64_t j = 0; j < len; ++j) y[j] = detail::unary_f(Op, a[j], arg);
      });
      return;
    }
    const T* b = r[st.b];
    detail::dispatch_binary(static_cast<Binary>(st.op), [&]<Binary Op>() {
      for (std::int64_t j = 0; j < len; ++j) y[j] = detail::binary_f(Op, a[j], b[j]);
    });
  }

  // How each input is read at output element i: at i (its shape is the output's), at 0 (one
  // element), at i mod its size (a trailing suffix of the output's shape: a bias), or through
  // broadcast strides (any other broadcast).
  struct Readers {
    enum class Mode : std::uint8_t { same, scalar, suffix, strided };
    struct In {
      const void* data = nullptr;
      DType dt = DType::f32;  // another than the group's: a where's mask, loaded as 0 / 1
      Mode mode = Mode::same;
      std::int64_t size = 0;
      std::array<std::int64_t, kMaxRank> st{};
    };
    std::array<In, kMaxFusedInputs> in{};
    int count = 0;
    Shape out;

    Readers(const FusedProgram& p, std::span<const Tensor* const> ins, const Shape& o) : count(p.inputs), out(o) {
      for (int k = 0; k < count; ++k) {
        const Tensor& x = *ins[static_cast<std::size_t>(k)];
        In& r = in[static_cast<std::size_t>(k)];
        r.data = x.raw();
        r.dt = x.dtype();
        r.size = x.numel();
        if (x.shape() == o) r.mode = Mode::same;
        else if (x.numel() == 1) r.mode = Mode::scalar;
        else if (detail::is_suffix(x.shape(), o)) r.mode = Mode::suffix;
        else r.mode = Mode::strided, r.st = detail::broadcast_strides(x.shape(), o);
      }
    }
    // Points register k at input k's values for elements i0..i0+len: the input itself where it
    // has the output's shape, else its values gathered into buf[k]; an input outside `mask` at
    // `skip` (it is not read).
    template <class T>
    void load(const T** r, T (*buf)[kTile], std::int64_t i0, std::int64_t len, std::uint32_t mask = ~0u,
              const T* skip = nullptr) const {
      for (int k = 0; k < count; ++k) {
        if (!((mask >> k) & 1u)) {
          r[k] = skip;
          continue;
        }
        const In& x = in[static_cast<std::size_t>(k)];
        const T* s = static_cast<const T*>(x.data);
        T* d = buf[k];
        r[k] = d;
        if (x.dt != detail::dtype_of<T>()) {  // a mask: nonzero -> 1, as where tests it
          for (std::int64_t j = 0; j < len; ++j) {
            const std::int64_t o = x.mode == Mode::same     ? i0 + j
                                   : x.mode == Mode::scalar ? 0
                                   : x.mode == Mode::suffix ? (i0 + j) % x.size
                                                            : offset(x.st, i0 + j);
            d[j] = detail::load_as_double(x.data, x.dt, o) != 0.0 ? T(1) : T(0);
          }
          continue;
        }
        switch (x.mode) {
          case Mode::same: r[k] = s + i0; break;
          case Mode::scalar: std::fill_n(d, len, s[0]); break;
          case Mode::suffix:
            for (std::int64_t j = 0, o = i0 % x.size; j < len; ++j, o = o + 1 == x.size ? 0 : o + 1) d[j] = s[o];
            break;
          case Mode::strided:
            for (std::int64_t j = 0; j < len; ++j) d[j] = s[offset(x.st, i0 + j)];
            break;
        }
      }
    }
    // The input offset of output element i: i unravelled over the output's dims, dotted with
    // the input's broadcast strides (the rare general broadcast; a division per dim).
    std::int64_t offset(const std::array<std::int64_t, kMaxRank>& st, std::int64_t i) const {
      std::int64_t off = 0;
      for (int d = out.rank() - 1; d >= 0; --d) {
        off += (i % out[d]) * st[static_cast<std::size_t>(d)];
        i /= out[d];
      }
      return off;
    }
  };
};
using FusedKernels = FusedKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
