// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's linear_cross_entropy (ops/linear_cross_entropy.hpp): an LM head's product and the
// softmax cross-entropy over its logits in one pass over blocks of the vocabulary, so the (R, V)
// logits are never held. Per block of the head's rows W_blk (nb, C), for the rows that count:
//   S = x W_blk^T                           (R, nb), the block's logits
//   m_r, l_r: the running max and sum of exp(S - m) (flash attention's online softmax)
//   acc_r = acc_r * exp(m_old - m_new) + exp(S_r - m_new) W_blk     (only when the gradient is wanted)
// and at the end
//   lse_r = m_r + log l_r,   loss_r = lse_r - S[r, t_r],
//   dloss_r / dx_r = acc_r / l_r - W[t_r]   (softmax_r @ W minus the target's row).
// The same two products per block as the logits and their gradient would take, and no more.
// A trainable (dense) head's gradient needs the final lse first, so it takes a second pass:
//   D = c_r (exp(S - lse_r) - onehot(t_r)),  gW_blk (+)= D^T x,  gx (+)= D W_blk.
#pragma once

#include <algorithm>
#include <limits>
#include <optional>

#include "common.hpp"
#include "matmul.hpp"
#include "quantized.hpp"

namespace nn {

namespace cpu_kernels {

// A class template with one instance, `LinearCrossEntropyKernels` (why: backend/cpu.hpp).
template <class = void>
struct LinearCrossEntropyKernelsT {
  /// Vocabulary rows per block for R rows of x: S (R, block) near 1 MB, so it stays in cache
  /// between its product, the row pass and the second product; at least 256, a multiple of 64.
  static std::int64_t block_rows(std::int64_t R, std::int64_t V) {
    const std::int64_t b = (std::int64_t{1} << 18) / std::max<std::int64_t>(R, 1) / 64 * 64;
    return std::max<std::int64_t>(1, std::min(std::clamp<std::int64_t>(b, 256, 4096), V));
  }
  // The workspace's integer part (a counted row's row of x and its target), rounded to 64 bytes.
  static std::size_t ints_bytes(std::int64_t R) { return (2 * sizeof(std::int64_t) * static_cast<std::size_t>(R) + 63) / 64 * 64; }
  /// Bytes of workspace the kernels need for x (R, C) of dtype dt and a head of V rows.
  static std::size_t linear_cross_entropy_workspace(std::int64_t R, std::int64_t C, std::int64_t V, DType dt) {
    return ints_bytes(R) + dtype_size(dt) * static_cast<std::size_t>(R * (2 * C + block_rows(R, V) + 5));
  }

  /// The forward: y = the loss (sum, or mean: over the targets not ignored, or sum(keep * loss) /
  /// sum(keep) with keep), lse (R) per row (0 for a row that does not count), and with dx, the
  /// loss's gradient with respect to x (R, C) for an upstream gradient of 1.
  static void linear_cross_entropy(const Tensor& x, const HeadWeight& w, const Tensor& t, const Tensor& keep,
                                   const LinearCrossEntropyAttrs& a, Tensor& y, Tensor& lse, Tensor& work, Tensor* dx) {
    detail::dispatch_float(x.dtype(), "linear_cross_entropy", [&]<class T>() {
      Pass<T> p(x, w, t, keep, a, work);
      y.data<T>()[0] = p.online(lse.data<T>(), dx ? dx->data<T>() : nullptr);
    });
  }

  /// The vjp: gx (+)= g dx and, for a dense head that wants one, gw (+)= its gradient. dx_fresh:
  /// dx holds the forward's gradient for these inputs (the forward computed it because a backward
  /// pass was planned); otherwise it is computed here, by the same pass, so the result is the
  /// same bit for bit either way.
  static void linear_cross_entropy_vjp(const Tensor& x, const HeadWeight& w, const Tensor& t, const Tensor& keep,
                                       const LinearCrossEntropyAttrs& a, const Tensor& lse, Tensor& dx, bool dx_fresh,
                                       const Tensor& g, Tensor& work, GradOut gx, GradOut gw) {
    detail::dispatch_float(x.dtype(), "linear_cross_entropy", [&]<class T>() {
      const T gs = g.data<T>()[0];
      const std::int64_t C = x.dim(-1), R = x.numel() / std::max<std::int64_t>(C, 1);
      if (!gw.g) {
        if (!gx.g) return;
        if (!dx_fresh) {
          Pass<T> p(x, w, t, keep, a, work);
          p.online(p.lse_scratch(), dx.data<T>());
        }
        detail::ArrayMap<T> o(gx.g->data<T>(), R * C);
        const detail::ConstArrayMap<T> d(dx.data<T>(), R * C);
        if (gx.acc) o += gs * d;
        else o = gs * d;
        return;
      }
      Pass<T> p(x, w, t, keep, a, work);
      p.weight_grad(lse.data<T>(), gs, gx.g ? gx.g->data<T>() : nullptr, gx.acc, gw.g->data<T>(), gw.acc);
    });
  }

 private:
  // One call's state: the rows that count gathered into xa, their weights and the workspace.
  template <class T>
  struct Pass {
    const HeadWeight& w;
    std::optional<detail::QuantReader<T>> q;
    const T* wd = nullptr;                  // the dense head
    std::int64_t R, C, V, NB, Ra = 0;       // rows, width, classes, block, rows that count
    T den = 1;                              // the loss's divisor
    std::int64_t *idx, *kt;                 // workspace: a counted row's row of x, its target
    T *xa, *acc, *s, *m, *l, *st, *c, *lt;  // (Ra, C) x2, (Ra, NB), then per row

    Pass(const Tensor& x, const HeadWeight& hw, const Tensor& t, const Tensor& keep, const LinearCrossEntropyAttrs& a,
         Tensor& work)
        : w(hw) {
      C = x.dim(-1);
      R = x.numel() / std::max<std::int64_t>(C, 1);
      V = hw.rows();
      NB = block_rows(R, V);
      if (hw.quantized()) q.emplace(hw.codes, hw.scales, hw.biases, a.head.q);
      else wd = hw.w.data<T>();
      idx = static_cast<std::int64_t*>(work.raw());
      kt = idx + R;
      xa = reinterpret_cast<T*>(static_cast<unsigned char*>(work.raw()) + ints_bytes(R));
      acc = xa + R * C;
      s = acc + R * C;
      m = s + R * NB;
      l = m + R;
      st = l + R;
      c = st + R;
      lt = c + R;
      const T* kp = a.has_keep ? keep.data<T>() : nullptr;
      const std::int64_t ignore = a.ce.ignore_index;
      T kept = 0;
      for (std::int64_t r = 0; r < R; ++r) {  // serial, in row order: deterministic
        const std::int64_t k = detail::load_index(t, r);
        if (k != ignore && (k < 0 || k >= V))
          detail::fail("linear_cross_entropy", "target ", k, " at row ", r, " is out of range for ", V,
                       " classes (ignore_index is ", ignore, ")");
        const T wr = kp ? kp[r] : T(k != ignore);
        kept += kp ? wr : T(k != ignore);
        if (k == ignore || wr == T(0)) continue;
        idx[Ra] = r;
        kt[Ra] = k;
        c[Ra] = wr;
        ++Ra;
      }
      if (a.ce.reduction == Reduction::mean) den = kept;
      const T* X = x.data<T>();
      for (std::int64_t i = 0; i < Ra; ++i) std::copy_n(X + idx[i] * C, C, xa + i * C);
    }

    T* lse_scratch() { return lt; }  // an lse the caller does not keep (the vjp's recomputation)

    // S = xa W[v0 : v0 + nb]^T
    void logits(std::int64_t v0, std::int64_t nb) const {
      if (q) QuantizedKernelsT<>::quantized_product<T>(q->rows_from(v0), xa, s, Ra, nb, C, true, false);
      else MatmulKernelsT<>::gemm<T>(false, true, Ra, nb, C, xa, C, wd + v0 * C, C, s, false);
    }
    // y (Ra, C) (+)= S W[v0 : v0 + nb]
    void times(T* y, std::int64_t v0, std::int64_t nb, bool add) const {
      if (q) QuantizedKernelsT<>::quantized_product<T>(q->rows_from(v0), s, y, Ra, C, nb, false, add);
      else MatmulKernelsT<>::gemm<T>(false, false, Ra, C, nb, s, nb, wd + v0 * C, C, y, add);
    }
    static T row_max(const T* x, std::int64_t n) {
      if constexpr (std::is_same_v<T, float>) return simd::max(x, n);
      else return detail::ConstArrayMap<T>(x, n).maxCoeff();
    }

    // The online pass; returns the loss, writes lse (R) and, with dx, the gradient (R, C).
    T online(T* lse, T* dx) {
      for (std::int64_t v0 = 0; v0 < V; v0 += NB) {
        const std::int64_t nb = std::min(NB, V - v0);
        logits(v0, nb);
        detail::parallel_for(Ra, Ra * nb > detail::kParallelGrain, [&](std::int64_t i) {
          T* row = s + i * nb;
          const std::int64_t k = kt[i] - v0;
          if (k >= 0 && k < nb) st[i] = row[k];
          const T mn = v0 == 0 ? row_max(row, nb) : std::max(m[i], row_max(row, nb));
          const T sum = detail::exp_sum(row, nb, mn);
          if (v0 == 0) {
            l[i] = sum;
          } else {
            const T alpha = detail::SoftmaxMath::rebase(m[i], mn);  // the earlier blocks' terms, on the new max
            l[i] = l[i] * alpha + sum;
            if (dx && alpha != T(1)) detail::ArrayMap<T>(acc + i * C, C) *= alpha;
          }
          m[i] = mn;
        });
        if (dx) times(acc, v0, nb, v0 > 0);
      }
      T total = 0;  // serial, in row order: deterministic
      std::fill_n(lse, R, T(0));
      for (std::int64_t i = 0; i < Ra; ++i) {
        const T li = detail::SoftmaxMath::lse(m[i], l[i]);
        lse[idx[i]] = li;
        total += c[i] * detail::SoftmaxMath::ce_loss(li, st[i]);
      }
      if (dx) {
        std::fill_n(dx, R * C, T(0));
        detail::parallel_for(Ra, Ra * C > detail::kParallelGrain, [&](std::int64_t i) {
          T* o = dx + idx[i] * C;
          target_row(kt[i], o);
          const T inv = T(1) / l[i], coef = c[i] / den;
          detail::ArrayMap<T>(o, C) = coef * (detail::ConstArrayMap<T>(acc + i * C, C) * inv - detail::ConstArrayMap<T>(o, C));
        });
      }
      return total / den;
    }

    // W[k] into out (C)
    void target_row(std::int64_t k, T* out) const {
      if (q) q->run(k, 0, C, out, 1);
      else std::copy_n(wd + k * C, C, out);
    }

    // The second pass of a trainable head: gw (V, C) (+)= D^T xa and gx (R, C) (+)= D W per block.
    void weight_grad(const T* lse, T gs, T* gx, bool gx_acc, T* gw, bool gw_acc) {
      for (std::int64_t i = 0; i < Ra; ++i) st[i] = lse[idx[i]];
      for (std::int64_t v0 = 0; v0 < V; v0 += NB) {
        const std::int64_t nb = std::min(NB, V - v0);
        logits(v0, nb);
        detail::parallel_for(Ra, Ra * nb > detail::kParallelGrain, [&](std::int64_t i) {
          T* row = s + i * nb;
          const T cf = gs * (c[i] / den);
          if constexpr (std::is_same_v<T, float>) simd::ce_grad(row, nb, st[i], cf, row, false);
          else detail::ArrayMap<T>(row, nb) = detail::SoftmaxMath::ce_grad(detail::ConstArrayMap<T>(row, nb), st[i], cf);
          const std::int64_t k = kt[i] - v0;
          if (k >= 0 && k < nb) row[k] -= cf;
        });
        MatmulKernelsT<>::gemm<T>(true, false, nb, C, Ra, s, nb, xa, C, gw + v0 * C, gw_acc);
        if (gx) times(acc, v0, nb, v0 > 0);
      }
      if (!gx) return;
      if (!gx_acc) std::fill_n(gx, R * C, T(0));
      for (std::int64_t i = 0; i < Ra; ++i)
        detail::ArrayMap<T>(gx + idx[i] * C, C) += detail::ConstArrayMap<T>(acc + i * C, C);
    }
  };
};
using LinearCrossEntropyKernels = LinearCrossEntropyKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
