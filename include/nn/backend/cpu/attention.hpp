// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu's fused attention: the materialised form (probabilities kept) and flash attention,
// each with its vjp (ops/attention.hpp; the composite reference in layers/attention.hpp).
#pragma once

#include <cstring>
#include <limits>
#include <utility>

#include "common.hpp"
#include "matmul.hpp"

namespace nn {

namespace detail {

/// Flash attention's tile: kFlashRows queries against kFlashCols keys. A tile's scores (64 KiB in
/// f32) stay in L2 beside the q, k and v rows they come from. Measured on bench_attention at
/// T = 256..4096 against 64 x 64, 96 x 128 and 48 x 256: smaller tiles spend their time packing
/// each product's operands, not multiplying them.
inline constexpr std::int64_t kFlashRows = 128, kFlashCols = 128;

/// The span [a0, a1) of a flash tile's score row (room for kFlashCols; keys [lo, hi) visible)
/// that its row math runs over. With a positive scale, [lo, hi) widened to whole 16-lane vectors,
/// its hidden keys set to -inf, which the exp turns into exact zeros: no vector is partial (on
/// the causal diagonal, where every row ends elsewhere, partial vectors' loads and stores made
/// the row math slower than Eigen's passes, Zen 5). Otherwise -inf would not stay -inf when
/// scaled, and the span is [lo, hi).
template <class T>
inline std::pair<std::int64_t, std::int64_t> flash_span(T* row, std::int64_t lo, std::int64_t hi, T scale) {
  if (!(scale > T(0))) return {lo, hi};
  const std::int64_t a0 = lo / 16 * 16, a1 = std::min(kFlashCols, (hi + 15) / 16 * 16);
  std::fill(row + a0, row + lo, -std::numeric_limits<T>::infinity());
  std::fill(row + hi, row + a1, -std::numeric_limits<T>::infinity());
  return {a0, a1};
}

/// Causal attention's row (and key) block: the products of a block of queries stop at its last
/// key, so the work above the diagonal left undone is all but half a block wide.
inline constexpr std::int64_t kAttnBlock = 32;

/// Packed rows' document starts (B, T) int32 for flash attention, or null when undefined. Each
/// row must be a sequence of whole documents: starts[b, 0] = 0, and starts[b, i] is either
/// starts[b, i - 1] (the same document) or i (a new one). Checked on every call (a replay swaps
/// the tensor in), O(B T).
inline const std::int32_t* check_doc_starts(const Tensor& starts, std::int64_t Bn, std::int64_t T, bool causal) {
  if (!starts.defined()) return nullptr;
  if (!causal) fail("flash_attention", "document starts need causal attention");
  if (starts.dtype() != DType::i32 || starts.numel() != Bn * T)
    fail("flash_attention", "document starts must be (B, T) = (", Bn, ", ", T, ") int32, got ", starts.shape().str(), " ",
         dtype_name(starts.dtype()));
  const std::int32_t* s = starts.data<std::int32_t>();
  for (std::int64_t b = 0; b < Bn; ++b)
    for (std::int64_t i = 0; i < T; ++i) {
      const std::int32_t v = s[b * T + i];
      if (i == 0 ? v != 0 : (v != s[b * T + i - 1] && v != i))
        fail("flash_attention", "document starts of row ", b, " are not whole documents: position ", i, " starts at ", v,
             i == 0 ? " (must be 0)" : " (must be the previous position's start or the position itself)");
    }
  return s;
}

/// The first key query i sees in flash attention: its document's start (packed rows) and, with a
/// sliding window W, i - W + 1 (transformers' sliding-window causal mask: i - j < W).
inline std::int64_t flash_first_key(const std::int32_t* doc_start, std::int64_t i, std::int64_t window) {
  const std::int64_t d = doc_start ? *doc_start : 0;
  return window > 0 ? std::max(d, i - window + 1) : d;
}

/// The keys [j0 + lo, j0 + hi) of the tile [j0, j0 + c) that query i sees (lo >= hi: none).
inline std::pair<std::int64_t, std::int64_t> flash_visible(const std::int32_t* doc_start, std::int64_t i,
                                                           std::int64_t window, bool causal, std::int64_t j0,
                                                           std::int64_t c) {
  const std::int64_t lo = std::clamp<std::int64_t>(flash_first_key(doc_start, i, window) - j0, 0, c);
  return {lo, causal ? std::clamp<std::int64_t>(i + 1 - j0, 0, c) : c};
}

/// Caps a flash tile row's visible scores [lo, hi) in place, y = SoftcapMath::value(sc x, cap), so
/// the row math after it runs at scale 1. In float32 the same formula runs on Eigen's vectorised
/// tanh (a rational approximation within a few ulp of libm's tanhf), which made a capped flash
/// call 2.5x a plain one as a scalar loop; float64 keeps libm's tanh. The forward and the vjp's
/// recomputation both come here, so they agree bit for bit.
template <class T>
inline void flash_softcap(T* row, std::int64_t lo, std::int64_t hi, T sc, T cap) {
  if (hi <= lo) return;
  if constexpr (std::is_same_v<T, float>) {
    ArrayMap<T> x(row + lo, hi - lo);
    x = cap * ((sc * x) / cap).tanh();
  } else {
    for (std::int64_t j = lo; j < hi; ++j) row[j] = SoftcapMath::value(sc * row[j], cap);
  }
}

}  // namespace detail

namespace cpu_kernels {

// A class template with one instance, `AttentionKernels` (why: backend/cpu.hpp).
template <class = void>
struct AttentionKernelsT {
  /// Attention per (batch, query head): P = softmax(scale q k^T + mask) (kept in p: (B, H, T, T)),
  /// out = P v. q, out: (B, T, H * hd); k, v: (B, T, KV * hd); query head h reads kv head
  /// h / (H / KV); mask (may be undefined) broadcasts to (B, H, T, T). `causal`: query i sees keys
  /// 0..i only, besides any mask; the rows are then taken in blocks of kAttnBlock and each block's
  /// products stop at its last key, about half the work of the square. P's row i is then exact 0
  /// from key i + 1 to its block's end, and the rest is left unwritten (never read, here or in
  /// the vjp).
  /// The heads run in parallel, each product a strided GEMM on its thread (no permuted copies).
  static void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const AttentionAttrs& a,
                        Tensor& out, Tensor& p) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const std::int64_t g = H / KV, qs = H * hd, ks = KV * hd, rb = causal ? detail::kAttnBlock : T_;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* Mk = mask.defined() ? static_cast<const T*>(mask.raw()) : nullptr;
      T* O = static_cast<T*>(out.raw());
      T* P = static_cast<T*>(p.raw());
      std::array<std::int64_t, kMaxRank> ms{};
      if (Mk) ms = detail::broadcast_strides(mask.shape(), Shape{Bn, H, T_, T_});
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      detail::parallel_for(Bn * H, p.numel() * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / H, h = t % H, kh = h / g;
        T* pt = P + t * T_ * T_;
        const T* qt = Q + b * T_ * qs + h * hd;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ot = O + b * T_ * qs + h * hd;
        for (std::int64_t i0 = 0; i0 < T_; i0 += rb) {  // query rows i0..i1-1 against keys 0..kn-1
          const std::int64_t i1 = std::min(T_, i0 + rb), kn = causal ? i1 : T_;
          detail::gemm_serial<T>(false, true, i1 - i0, kn, hd, qt + i0 * qs, qs, kt, ks, pt + i0 * T_, T_, false);  // q k^T
          for (std::int64_t i = i0; i < i1; ++i) {
            const std::int64_t n = causal ? i + 1 : T_;
            detail::softmax_row(pt + i * T_, n, sc, Mk ? Mk + b * ms[0] + h * ms[1] + i * ms[2] : nullptr);
            std::fill(pt + i * T_ + n, pt + i * T_ + kn, T(0));  // the block's keys past i (all P v and the vjp read)
          }
          detail::gemm_serial<T>(false, false, i1 - i0, hd, kn, pt + i0 * T_, T_, vt, ks, ot + i0 * qs, qs, false);  // P v
        }
      }, /*uneven=*/true);
    });
  }

  /// The vjp of attention, per (batch, kv head) so each kv head's gradient sums its query heads
  /// without races: dv += P^T g; dS = P * (g v^T - rowsum(P * g v^T)) * scale (in `scratch`,
  /// (B * KV, T, T)); dq = dS k; dk += dS^T q. Any of gq, gk, gv may be null. `causal`: P is
  /// attention's causal one, and the products read only the blocks the forward wrote.
  static void attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& p, const Tensor& g,
                            const AttentionAttrs& a, Tensor& scratch, GradOut oq, GradOut ok, GradOut ov) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    Tensor *gq = oq.g, *gk = ok.g, *gv = ov.g;
    const bool acc_q = oq.acc, acc_k = ok.acc, acc_v = ov.acc;
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const std::int64_t grp = H / KV, qs = H * hd, ks = KV * hd, rb = causal ? detail::kAttnBlock : T_;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* P = static_cast<const T*>(p.raw());
      const T* G = static_cast<const T*>(g.raw());
      T* S = static_cast<T*>(scratch.raw());
      T* GQ = gq ? static_cast<T*>(gq->raw()) : nullptr;
      T* GK = gk ? static_cast<T*>(gk->raw()) : nullptr;
      T* GV = gv ? static_cast<T*>(gv->raw()) : nullptr;
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      detail::parallel_for(Bn * KV, p.numel() * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / KV, kh = t % KV;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ds = S + t * T_ * T_;
        for (std::int64_t j = 0; j < grp; ++j) {
          const std::int64_t h = kh * grp + j, qo = b * T_ * qs + h * hd, ko = b * T_ * ks + kh * hd;
          const T* pt = P + (b * H + h) * T_ * T_;
          // Rows by query block [i0, i1) (keys 0..kn-1): dS = P * (g v^T - rowsum) * scale, dq = dS k.
          if (GQ || GK)
            for (std::int64_t i0 = 0; i0 < T_; i0 += rb) {
              const std::int64_t i1 = std::min(T_, i0 + rb), kn = causal ? i1 : T_;
              detail::gemm_serial<T>(false, true, i1 - i0, kn, hd, G + qo + i0 * qs, qs, vt, ks, ds + i0 * T_, T_, false);  // g v^T
              for (std::int64_t i = i0; i < i1; ++i) {
                const T dot = (detail::ArrayMap<T>(ds + i * T_, kn) * detail::ConstArrayMap<T>(pt + i * T_, kn)).sum();
                detail::softmax_vjp_row(pt + i * T_, ds + i * T_, kn, dot, sc);
              }
              if (GQ) detail::gemm_serial<T>(false, false, i1 - i0, hd, kn, ds + i0 * T_, T_, kt, ks, GQ + qo + i0 * qs, qs, acc_q);  // dS k
            }
          // Columns by key block [j0, j1) (queries j0..T-1 see them): dv (+)= P^T g, dk (+)= dS^T q.
          for (std::int64_t j0 = 0; j0 < T_; j0 += rb) {
            const std::int64_t j1 = std::min(T_, j0 + rb), i0 = causal ? j0 : 0;
            if (GV) detail::gemm_serial<T>(true, false, j1 - j0, hd, T_ - i0, pt + i0 * T_ + j0, T_, G + qo + i0 * qs, qs,
                                           GV + ko + j0 * ks, ks, acc_v || j > 0);  // P^T g
            if (GK) detail::gemm_serial<T>(true, false, j1 - j0, hd, T_ - i0, ds + i0 * T_ + j0, T_, Q + qo + i0 * qs, qs,
                                           GK + ko + j0 * ks, ks, acc_k || j > 0);  // dS^T q
          }
        }
      }, /*uneven=*/true);
    });
  }

  /// Flash attention (Dao et al. 2022; FlashAttention-2's loop order, Dao 2023): what attention
  /// computes without a mask tensor, without ever storing the (T, T) probabilities. Per (batch,
  /// query head, block of kFlashRows queries), the keys are read kFlashCols at a time; a tile's
  /// scores s = scale q k^T live in the thread's workspace, and an online softmax keeps per query
  /// row the running max m and sum l: out = sum_j exp(s_j - m) v_j / l, rescaled by
  /// exp(m_old - m_new) whenever the max grows. Saves only lse = m + log l (B, H, T) for the vjp. `causal`: query i
  /// sees keys 0..i; key blocks past a query block's last row are never touched.
  /// q, out: (B, T, H * hd); k, v: (B, T, KV * hd); query head h reads kv head h / (H / KV).
  /// starts (B, T) int32, when defined (packed rows; causal only): starts[b, i] is where query
  /// i's document begins, and it sees keys starts[b, i]..i only (block-diagonal causal); key tiles
  /// before a query block's first document are never touched. a.window > 0 (causal only): query i
  /// sees keys i - window < j <= i too, and key tiles before a block's first row's window are
  /// never touched. a.softcap > 0: the scaled scores are capped (SoftcapMath) before the softmax.
  static void flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& starts,
                              const AttentionAttrs& a, Tensor& out, Tensor& lse) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    const std::int64_t W = a.window;
    const std::int32_t* St = detail::check_doc_starts(starts, Bn, T_, causal);
    detail::dispatch_float(q.dtype(), "flash_attention", [&]<class T>() {
      constexpr std::int64_t Br = detail::kFlashRows, Bc = detail::kFlashCols;
      const std::int64_t g = H / KV, qs = H * hd, ks = KV * hd, nqb = (T_ + Br - 1) / Br;
      const T cap = static_cast<T>(a.softcap);
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      T* O = static_cast<T*>(out.raw());
      T* L = static_cast<T*>(lse.raw());
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      const bool wide = Bn * H * T_ * (causal ? T_ / 2 + 1 : T_) * hd > detail::kParallelGrain;
      detail::parallel_for(Bn * H * nqb, wide, [&](std::int64_t t) {
        const std::int64_t bh = t / nqb, b = bh / H, h = bh % H, kh = h / g;
        const std::int64_t i0 = (t % nqb) * Br, r = std::min(T_, i0 + Br) - i0, kend = causal ? i0 + r : T_;
        const std::int32_t* st = St ? St + b * T_ + i0 : nullptr;  // the block's document starts
        const std::int64_t kbeg = detail::flash_first_key(st, i0, W) / Bc * Bc;  // the first key tile any row sees
        const T* qt = Q + (b * T_ + i0) * qs + h * hd;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ot = O + (b * T_ + i0) * qs + h * hd;
        // the tile's scores, then its exp(s - m): (r, c), row stride Bc; then m and l per row
        T* s = static_cast<T*>(detail::gemm_workspace(sizeof(T) * (Br * Bc + 2 * Br), 2));
        T *m = s + Br * Bc, *l = m + Br;
        std::fill(m, m + r, -std::numeric_limits<T>::infinity());  // no key seen yet
        std::fill(l, l + r, T(0));
        for (std::int64_t j0 = kbeg; j0 < kend; j0 += Bc) {
          const std::int64_t c = std::min(kend, j0 + Bc) - j0;
          detail::gemm_serial<T>(false, true, r, c, hd, qt, qs, kt + j0 * ks, ks, s, Bc, false);  // q k^T
          for (std::int64_t i = 0; i < r; ++i) {
            // keys j0+lo..j0+hi-1 of this tile are visible to query i0 + i; the first tile
            // (j0 = kbeg) always has one without documents or window, a later one on the diagonal
            // may have none, and any tile before the row's document or window has none (its
            // m stays -inf, l 0, and the first tile it sees rebases them to nothing)
            const auto [lo, hi] = detail::flash_visible(st ? st + i : nullptr, i0 + i, W, causal, j0, c);
            T* row = s + i * Bc;
            if (hi <= lo) {
              std::fill(row, row + c, T(0));
              continue;
            }
            T rs = sc;  // the row math's scale: 1 once the scores are capped
            if (cap > T(0)) detail::flash_softcap(row, lo, hi, std::exchange(rs, T(1)), cap);
            const auto [a0, a1] = detail::flash_span(row, lo, hi, rs);
            const T mnew = std::max(m[i], detail::scale_max(row + a0, a1 - a0, rs));
            const T sum = detail::exp_sum(row + a0, a1 - a0, mnew);
            std::fill(row, row + a0, T(0));
            std::fill(row + std::min(a1, c), row + c, T(0));
            if (j0 == kbeg) {
              l[i] = sum;
            } else {
              const T alpha = detail::SoftmaxMath::rebase(m[i], mnew);  // the earlier tiles' terms, on the new max
              l[i] = l[i] * alpha + sum;
              if (alpha != T(1)) detail::ArrayMap<T>(ot + i * qs, hd) *= alpha;
            }
            m[i] = mnew;
          }
          detail::gemm_serial<T>(false, false, r, hd, c, s, Bc, vt + j0 * ks, ks, ot, qs, j0 > kbeg);  // (+)= p v
        }
        T* lt = L + bh * T_ + i0;
        for (std::int64_t i = 0; i < r; ++i) {
          detail::ArrayMap<T>(ot + i * qs, hd) *= T(1) / l[i];
          lt[i] = detail::SoftmaxMath::lse(m[i], l[i]);
        }
      }, /*uneven=*/causal);
    });
  }

  /// The vjp of flash_attention, recomputing each tile's probabilities p = exp(scale q k^T - lse)
  /// instead of reading stored ones. With dlt_i = rowsum(g_i * out_i) (in `delta`, (B, H, T)):
  /// dv_j += p^T g, ds = p * (g v_j^T - dlt) * scale, dq_i += ds k_j, dk_j += ds^T q_i. Per
  /// (batch, kv head), so every gradient row has one writer: key blocks outside, the group's
  /// query heads and the query blocks that see the key block inside. Any of gq, gk, gv may be null.
  /// starts: the forward's document starts (or undefined); query blocks whose documents all begin
  /// after a key block are skipped, so dq is zeroed first instead of overwritten by key block 0
  /// (and so with a window, whose query blocks past the key block's reach are skipped too). With
  /// a soft cap, ds is also multiplied by the cap's derivative, recomputed from the capped scores.
  static void flash_attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& starts,
                                  const Tensor& out, const Tensor& lse, const Tensor& g, const AttentionAttrs& a,
                                  Tensor& delta, GradOut oq, GradOut ok, GradOut ov) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    Tensor *gq = oq.g, *gk = ok.g, *gv = ov.g;
    const std::int64_t W = a.window;
    const std::int32_t* St = detail::check_doc_starts(starts, Bn, T_, causal);
    const bool skips = St || W > 0;  // may a query block not meet key block 0?
    if (skips && gq && !oq.acc) std::memset(gq->raw(), 0, gq->nbytes());
    const bool acc_q = oq.acc || skips, acc_k = ok.acc, acc_v = ov.acc;
    detail::dispatch_float(q.dtype(), "flash_attention", [&]<class T>() {
      constexpr std::int64_t Br = detail::kFlashRows, Bc = detail::kFlashCols;
      const std::int64_t grp = H / KV, qs = H * hd, ks = KV * hd;
      const T cap = static_cast<T>(a.softcap);
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* O = static_cast<const T*>(out.raw());
      const T* L = static_cast<const T*>(lse.raw());
      const T* G = static_cast<const T*>(g.raw());
      T* D = static_cast<T*>(delta.raw());
      T* GQ = gq ? static_cast<T*>(gq->raw()) : nullptr;
      T* GK = gk ? static_cast<T*>(gk->raw()) : nullptr;
      T* GV = gv ? static_cast<T*>(gv->raw()) : nullptr;
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      const bool wide = Bn * H * T_ * (causal ? T_ / 2 + 1 : T_) * hd > detail::kParallelGrain;
      detail::parallel_for(Bn * H * T_, Bn * H * T_ * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / (H * T_), h = t / T_ % H, i = t % T_, o = (b * T_ + i) * qs + h * hd;
        D[t] = (detail::ConstArrayMap<T>(G + o, hd) * detail::ConstArrayMap<T>(O + o, hd)).sum();  // t = (b, h, i)
      });
      detail::parallel_for(Bn * KV, wide, [&](std::int64_t t) {
        const std::int64_t b = t / KV, kh = t % KV;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        // a tile's probabilities (r, c), score gradients and (soft cap) capped scores
        T* p = static_cast<T*>(detail::gemm_workspace(sizeof(T) * (cap > T(0) ? 3 : 2) * Br * Bc, 2));
        T* ds = p + Br * Bc;
        T* y = ds + Br * Bc;
        for (std::int64_t j0 = 0; j0 < T_; j0 += Bc) {
          const std::int64_t c = std::min(T_, j0 + Bc) - j0;
          bool first_k = !acc_k, first_v = !acc_v;  // the first write to this key block overwrites
          for (std::int64_t jh = 0; jh < grp; ++jh) {
            const std::int64_t h = kh * grp + jh, bh = b * H + h;
            // causal: the first query block holding a row that sees key j0
            for (std::int64_t i0 = causal ? j0 / Br * Br : 0; i0 < T_; i0 += Br) {
              // documents: this block's rows and all later ones begin after the key block; window:
              // they are all past its last key's reach
              if (St && St[b * T_ + i0] >= j0 + c) break;
              if (W > 0 && i0 >= j0 + c - 1 + W) break;
              const std::int64_t r = std::min(T_, i0 + Br) - i0, o = (b * T_ + i0) * qs + h * hd;
              detail::gemm_serial<T>(false, true, r, c, hd, Q + o, qs, kt + j0 * ks, ks, p, Bc, false);  // q k^T
              for (std::int64_t i = 0; i < r; ++i) {
                const auto [lo, hi] = detail::flash_visible(St ? St + b * T_ + i0 + i : nullptr, i0 + i, W, causal, j0, c);
                T* row = p + i * Bc;
                if (hi <= lo) {
                  std::fill(row, row + c, T(0));
                  continue;
                }
                T rs = sc;
                if (cap > T(0)) {  // keep the capped scores for the cap's derivative below
                  detail::flash_softcap(row, lo, hi, std::exchange(rs, T(1)), cap);
                  std::copy(row + lo, row + hi, y + i * Bc + lo);
                }
                const auto [a0, a1] = detail::flash_span(row, lo, hi, rs);
                detail::probs_from_lse(row + a0, a1 - a0, rs, L[bh * T_ + i0 + i]);
                std::fill(row, row + a0, T(0));
                std::fill(row + std::min(a1, c), row + c, T(0));
              }
              if (GV) detail::gemm_serial<T>(true, false, c, hd, r, p, Bc, G + o, qs, GV + (b * T_ + j0) * ks + kh * hd,
                                             ks, !first_v);  // p^T g
              first_v = false;
              if (!GQ && !GK) continue;
              detail::gemm_serial<T>(false, true, r, c, hd, G + o, qs, vt + j0 * ks, ks, ds, Bc, false);  // g v^T
              for (std::int64_t i = 0; i < r; ++i) {
                detail::softmax_vjp_row(p + i * Bc, ds + i * Bc, c, D[bh * T_ + i0 + i], sc);
                if (cap > T(0)) {  // through the cap: ds = ds_capped * (1 - (y / cap)^2), on the visible keys
                  // (sc already applied: d(cap tanh(sc x / cap))/dx = sc (1 - (y / cap)^2))
                  const auto [lo, hi] = detail::flash_visible(St ? St + b * T_ + i0 + i : nullptr, i0 + i, W, causal, j0, c);
                  for (std::int64_t j = lo; j < hi; ++j) ds[i * Bc + j] *= detail::SoftcapMath::grad(y[i * Bc + j], cap);
                }
              }
              if (GQ) detail::gemm_serial<T>(false, false, r, hd, c, ds, Bc, kt + j0 * ks, ks, GQ + o, qs,
                                             acc_q || j0 > 0);  // ds k (query block i0 meets key block 0 first)
              if (GK) detail::gemm_serial<T>(true, false, c, hd, r, ds, Bc, Q + o, qs, GK + (b * T_ + j0) * ks + kh * hd,
                                             ks, !first_k);  // ds^T q
              first_k = false;
            }
          }
        }
      }, /*uneven=*/causal);
    });
  }
};
using AttentionKernels = AttentionKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
