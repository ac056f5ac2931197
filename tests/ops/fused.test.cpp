// SPDX-License-Identifier: MIT OR Apache-2.0
// The fused primitives (ops/norm, rope, attention, glu.hpp) against their composite references
// (nn::reference::*, built from primitives): values and every input's gradient agree, in float64
// and float32, over the shapes and options each layer routes to them; plus central differences.
#include "support/check.hpp"

using namespace nn;

namespace ops_fused {  // one unity source with the other ops files: its names stay its own

namespace {

/// The output and every input's gradient for a random cotangent.
struct Run {
  Tensor value;
  std::vector<Tensor> grads;
};

/// Builds f on a fresh tape with `inputs` bound as trainable params, back-propagates a random
/// cotangent (seeded: the same for both sides of a comparison).
template <class F>
Run run(const std::vector<Tensor>& inputs, F&& f, std::uint64_t seed = 7) {
  GTape<cpu> tp;
  std::vector<GVar> v;
  for (const Tensor& t : inputs) v.push_back(tp.param(t));
  GVar y = f(tp, v);
  tp.backward(y, test::random_tensor(tp.shape(y), tp.dtype(y), seed));
  Run r{tp.value(y).clone(), {}};
  for (GVar x : v) r.grads.push_back(tp.grad(x).clone());
  return r;
}

/// Worst relative error between two runs, over the value and every gradient.
double worst(const Run& a, const Run& b) {
  double e = test::rel_err(a.value, b.value);
  for (std::size_t i = 0; i < a.grads.size(); ++i) e = std::max(e, test::rel_err(a.grads[i], b.grads[i]));
  return e;
}

double tol(DType dt) { return dt == DType::f64 ? 1e-12 : 2e-5; }

}  // namespace

TEST_CASE_TEMPLATE("fused rmsnorm agrees with the composite, with and without a gain", T, float, double) {
  const DType dt = detail::dtype_of<T>();
  for (Shape s : {Shape{7}, Shape{3, 5}, Shape{2, 3, 16}}) {
    const std::int64_t C = s.dim(-1);
    std::vector<Tensor> in{test::random_tensor(s, dt, 1, -2, 2), test::random_tensor({C}, dt, 2, 0.5, 1.5)};
    double e = worst(run(in, [](auto& tp, auto& v) { return rmsnorm(tp, v[0], v[1], 1e-5); }),
                     run(in, [](auto& tp, auto& v) { return reference::rmsnorm(tp, v[0], v[1], 1e-5); }));
    MESSAGE("rmsnorm " << s.str() << " " << dtype_name(dt) << ": " << e);
    CHECK(e <= tol(dt));
    std::vector<Tensor> x{in[0]};
    e = worst(run(x, [](auto& tp, auto& v) { return rmsnorm(tp, v[0], 0.1); }),
              run(x, [](auto& tp, auto& v) { return reference::rmsnorm(tp, v[0], 0.1); }));
    CHECK(e <= tol(dt));
  }
}

TEST_CASE_TEMPLATE("fused swiglu agrees with the composite, also when gate and up are one tensor", T, float, double) {
  const DType dt = detail::dtype_of<T>();
  std::vector<Tensor> in{test::random_tensor({4, 9, 11}, dt, 3, -6, 6), test::random_tensor({4, 9, 11}, dt, 4)};
  double e = worst(run(in, [](auto& tp, auto& v) { return swiglu(tp, v[0], v[1]); }),
                   run(in, [](auto& tp, auto& v) { return reference::swiglu(tp, v[0], v[1]); }));
  CHECK(e <= tol(dt));
  std::vector<Tensor> x{in[0]};  // both inputs one node: the two contributions accumulate
  e = worst(run(x, [](auto& tp, auto& v) { return swiglu(tp, v[0], v[0]); }),
            run(x, [](auto& tp, auto& v) { return reference::swiglu(tp, v[0], v[0]); }));
  CHECK(e <= tol(dt));
}

TEST_CASE_TEMPLATE("fused rope agrees with the composite: NEOX and traditional, partial dims, both table layouts", T,
                   float, double) {
  const DType dt = detail::dtype_of<T>();
  const std::int64_t Bn = 2, Tn = 5, M = 3;
  for (bool trad : {false, true})
    for (std::int64_t D : {8, 12}) {  // 12: features past dims = 8 pass through
      RopeTable tab = rope_fill(Tn, 8, 10000.0, 1.0, 0, dt);
      // x (B, T, D) with tables (T, dims/2)
      std::vector<Tensor> x{test::random_tensor({Bn, Tn, D}, dt, 5)};
      auto fused = [&](auto& tp, auto& v) {
        GVar c = tp.constant(tab.cos), s = tp.constant(tab.sin);
        return fused_rope(tp, v[0], c, s, trad);
      };
      auto ref = [&](auto& tp, auto& v) {
        return reference::rope(tp, v[0], tp.constant(tab.cos), tp.constant(tab.sin), trad);
      };
      double e = worst(run(x, fused), run(x, ref));
      CHECK(e <= tol(dt));
      // x (B, T, M, D) with tables (T, 1, dims/2): the layout gqa_attention uses
      std::vector<Tensor> xm{test::random_tensor({Bn, Tn, M, D}, dt, 6)};
      Tensor c3 = tab.cos.reshape({Tn, 1, 4}), s3 = tab.sin.reshape({Tn, 1, 4});
      e = worst(run(xm, [&](auto& tp, auto& v) { return rope(tp, v[0], tp.constant(c3), tp.constant(s3), trad); }),
                run(xm, [&](auto& tp, auto& v) {
                  return reference::rope(tp, v[0], tp.constant(c3), tp.constant(s3), trad);
                }));
      MESSAGE("rope trad=" << trad << " D=" << D << " " << dtype_name(dt) << ": " << e);
      CHECK(e <= tol(dt));
    }
}

TEST_CASE_TEMPLATE("fused attention agrees with the composite: MHA, GQA, MQA; masks of every broadcast; rows layout",
                   T, float, double) {
  const DType dt = detail::dtype_of<T>();
  const std::int64_t Bn = 2, Tn = 6, nh = 4, hd = 8;
  Tensor causal = causal_mask_fill(Tn, dt);
  std::vector<std::int32_t> keep{1, 1, 1, 1, 0, 0, 1, 1, 1, 1, 1, 1};
  Tensor padded = attention_mask_fill(Tensor::from<std::int32_t>({Bn, Tn}, keep), dt);  // (B, 1, T, T)
  Tensor key_pad = padding_mask_fill(Tensor::from<std::int32_t>({Bn, Tn}, keep), dt);    // (B, 1, 1, T)
  Tensor per_head = test::random_tensor({Bn, nh, Tn, Tn}, dt, 9, -3, 0);
  for (std::int64_t nkv : {4, 2, 1})
    for (int mk = 0; mk < 5; ++mk)
      for (bool roped : {true, false}) {
        const Tensor masks[] = {Tensor(), causal, padded, key_pad, per_head};
        const Tensor& mask = masks[mk];
        RopeTable tab = rope_fill(Tn, 6, 10000.0, 1.0, 0, dt);  // dims 6 < head_dim 8
        std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 10), test::random_tensor({Bn, Tn, nkv * hd}, dt, 11),
                               test::random_tensor({Bn, Tn, nkv * hd}, dt, 12)};
        auto call = [&](bool fused) {
          return [&, fused](auto& tp, auto& v) {
            GVar c = roped ? tp.constant(tab.cos) : GVar{}, s = roped ? tp.constant(tab.sin) : GVar{};
            GVar m = mask.defined() ? tp.constant(mask) : GVar{};
            if (fused) return gqa_attention(tp, v[0], v[1], v[2], {.T = Tn, .n_heads = nh, .n_kv_heads = nkv,
                                                                   .head_dim = hd, .scale = 0.35, .cos = c, .sin = s,
                                                                   .mask = m});
            return reference::gqa_attention(tp, v[0], v[1], v[2], c, s, m, Tn, nh, nkv, hd, 0.35);
          };
        };
        const double e = worst(run(in, call(true)), run(in, call(false)));
        if (e > tol(dt)) MESSAGE("nkv " << nkv << " mask " << mk << " rope " << roped << ": " << e);
        CHECK(e <= tol(dt));
      }
  // rows layout (B*T, n * hd), and k = v one tensor (the gradients of both uses accumulate)
  std::vector<Tensor> in{test::random_tensor({Bn * Tn, nh * hd}, dt, 13), test::random_tensor({Bn * Tn, 2 * hd}, dt, 14)};
  auto call = [&](bool fused) {
    return [&, fused](auto& tp, auto& v) {
      GVar m = tp.constant(causal);
      if (fused) return fused_attention(tp, v[0], v[1], v[1], m, Tn, nh, 2, hd, 0.5);
      return reference::gqa_attention(tp, v[0], v[1], v[1], GVar{}, GVar{}, m, Tn, nh, 2, hd, 0.5);
    };
  };
  CHECK(worst(run(in, call(true)), run(in, call(false))) <= tol(dt));
}

TEST_CASE_TEMPLATE("causal attention (no mask tensor, blocked products) agrees with the composite under a causal mask",
                   T, float, double) {
  const DType dt = detail::dtype_of<T>();
  // T = 75: two full blocks of kAttnBlock = 32 and a ragged one of 11
  const std::int64_t Bn = 2, Tn = 75, nh = 4, hd = 8;
  static_assert(detail::kAttnBlock == 32);
  Tensor causal = causal_mask_fill(Tn, dt);
  std::vector<std::int32_t> keep(static_cast<std::size_t>(Bn * Tn), 1);
  for (std::int64_t t = 65; t < Tn; ++t) keep[static_cast<std::size_t>(Tn + t)] = 0;  // row 1: 10 padding tokens
  Tensor keep_t = Tensor::from<std::int32_t>({Bn, Tn}, keep);
  Tensor key_pad = padding_mask_fill(keep_t, dt);         // (B, 1, 1, T)
  Tensor both = attention_mask_fill(keep_t, dt);          // causal + padding (B, 1, T, T)
  for (std::int64_t nkv : {4, 2, 1})
    for (bool pad : {false, true})
      for (bool roped : {true, false}) {
        RopeTable tab = rope_fill(Tn, 8, 10000.0, 1.0, 0, dt);
        std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 30), test::random_tensor({Bn, Tn, nkv * hd}, dt, 31),
                               test::random_tensor({Bn, Tn, nkv * hd}, dt, 32)};
        auto call = [&](bool fused) {
          return [&, fused](auto& tp, auto& v) {
            GVar c = roped ? tp.constant(tab.cos) : GVar{}, s = roped ? tp.constant(tab.sin) : GVar{};
            if (fused && !pad) return gqa_attention(tp, v[0], v[1], v[2], {.T = Tn, .n_heads = nh, .n_kv_heads = nkv,
                                                                           .head_dim = hd, .scale = 0.35, .cos = c,
                                                                           .sin = s, .causal = true});
            if (fused) return detail::gqa_attention(tp, v[0], v[1], v[2], c, s, tp.constant(key_pad), true, Tn, nh, nkv, hd, 0.35, false);
            return reference::gqa_attention(tp, v[0], v[1], v[2], c, s, tp.constant(pad ? both : causal), Tn, nh, nkv, hd, 0.35);
          };
        };
        const double e = worst(run(in, call(true)), run(in, call(false)));
        if (e > tol(dt)) MESSAGE("nkv " << nkv << " pad " << pad << " rope " << roped << ": " << e);
        CHECK(e <= tol(dt));
      }
  // rows layout and k = v one tensor, causal
  std::vector<Tensor> in{test::random_tensor({Bn * Tn, nh * hd}, dt, 33), test::random_tensor({Bn * Tn, 2 * hd}, dt, 34)};
  auto call = [&](bool fused) {
    return [&, fused](auto& tp, auto& v) {
      if (fused) return fused_attention(tp, v[0], v[1], v[1], GVar{}, Tn, nh, 2, hd, 0.5, true);
      return reference::gqa_attention(tp, v[0], v[1], v[1], GVar{}, GVar{}, tp.constant(causal), Tn, nh, 2, hd, 0.5);
    };
  };
  CHECK(worst(run(in, call(true)), run(in, call(false))) <= tol(dt));
}

TEST_CASE_TEMPLATE("flash attention agrees with the probabilities kernel and the composite, causal or not", T, float,
                   double) {
  const DType dt = detail::dtype_of<T>();
  // T = 300: two full tiles of 128 (rows and keys) and a ragged one of 44; 128: exactly one;
  // 37 and 1: one partial
  static_assert(detail::kFlashRows == 128 && detail::kFlashCols == 128);
  const std::int64_t Bn = 2, nh = 4, hd = 8;
  for (std::int64_t Tn : {1, 37, 128, 300}) {
    Tensor causal = causal_mask_fill(Tn, dt);
    for (std::int64_t nkv : {4, 2, 1})
      for (bool is_causal : {true, false}) {
        std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 40, -2, 2),
                               test::random_tensor({Bn, Tn, nkv * hd}, dt, 41, -2, 2),
                               test::random_tensor({Bn, Tn, nkv * hd}, dt, 42)};
        Run flash = run(in, [&](auto& tp, auto& v) {
          return flash_attention(tp, v[0], v[1], v[2], Tn, nh, nkv, hd, 0.35, is_causal);
        });
        Run probs = run(in, [&](auto& tp, auto& v) {
          return fused_attention(tp, v[0], v[1], v[2], GVar{}, Tn, nh, nkv, hd, 0.35, is_causal);
        });
        Run ref = run(in, [&](auto& tp, auto& v) {
          return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, is_causal ? tp.constant(causal) : GVar{},
                                          Tn, nh, nkv, hd, 0.35);
        });
        const double e = std::max(worst(flash, probs), worst(flash, ref));
        if (e > tol(dt)) MESSAGE("T " << Tn << " nkv " << nkv << " causal " << is_causal << ": " << e);
        CHECK(e <= tol(dt));
      }
  }
  // one tensor as q, k and v (MHA self-attention) and as k and v, in the rows layout: the vjp's
  // writes into the one gradient buffer all accumulate
  const std::int64_t Tn = 140;
  std::vector<Tensor> x{test::random_tensor({Bn * Tn, nh * hd}, dt, 43)};
  auto self = [&](bool flash) {
    return [&, flash](auto& tp, auto& v) {
      if (flash) return flash_attention(tp, v[0], v[0], v[0], Tn, nh, nh, hd, 0.5, true);
      return fused_attention(tp, v[0], v[0], v[0], GVar{}, Tn, nh, nh, hd, 0.5, true);
    };
  };
  CHECK(worst(run(x, self(true)), run(x, self(false))) <= tol(dt));
  std::vector<Tensor> qk{test::random_tensor({Bn * Tn, nh * hd}, dt, 44), test::random_tensor({Bn * Tn, 2 * hd}, dt, 45)};
  auto kv = [&](bool flash) {
    return [&, flash](auto& tp, auto& v) {
      if (flash) return flash_attention(tp, v[0], v[1], v[1], Tn, nh, 2, hd, 0.5, false);
      return fused_attention(tp, v[0], v[1], v[1], GVar{}, Tn, nh, 2, hd, 0.5, false);
    };
  };
  CHECK(worst(run(qk, kv(true)), run(qk, kv(false))) <= tol(dt));
  // a positive scale runs each tile row's math over whole 16-lane vectors, hidden keys at -inf;
  // any other scale over the visible keys alone (scaled, -inf would not stay -inf)
  for (double scale : {-0.35, 0.0}) {
    CAPTURE(scale);
    auto attn = [&](bool flash) {
      return [&, flash](auto& tp, auto& v) {
        if (flash) return flash_attention(tp, v[0], v[1], v[1], Tn, nh, 2, hd, scale, true);
        return fused_attention(tp, v[0], v[1], v[1], GVar{}, Tn, nh, 2, hd, scale, true);
      };
    };
    CHECK(worst(run(qk, attn(true)), run(qk, attn(false))) <= tol(dt));
  }
}

TEST_CASE_TEMPLATE("flash attention with document starts agrees with the composite under a block-diagonal causal mask",
                   T, float, double) {
  const DType dt = detail::dtype_of<T>();
  // Row 0: documents of 1 token (a boundary at the row start), 130 (across the 128 tile edge),
  // 9, 120, 40 (ending at the row end). Row 1: one document of 100, then one-token padding
  // documents to the end. Row 2: one document filling the row (plain causal).
  const std::int64_t Bn = 3, Tn = 300, nh = 4, hd = 8;
  const std::vector<std::vector<std::int64_t>> docs{{1, 130, 9, 120, 40}, {100}, {300}};
  std::vector<std::int32_t> st(static_cast<std::size_t>(Bn * Tn));
  std::vector<double> mask(static_cast<std::size_t>(Bn * Tn * Tn), kMaskedValue);
  for (std::int64_t b = 0; b < Bn; ++b) {
    std::int64_t at = 0;
    for (std::int64_t len : docs[static_cast<std::size_t>(b)]) {
      for (std::int64_t t = at; t < at + len; ++t) st[static_cast<std::size_t>(b * Tn + t)] = static_cast<std::int32_t>(at);
      at += len;
    }
    for (std::int64_t t = at; t < Tn; ++t) st[static_cast<std::size_t>(b * Tn + t)] = static_cast<std::int32_t>(t);
    for (std::int64_t i = 0; i < Tn; ++i)
      for (std::int64_t j = st[static_cast<std::size_t>(b * Tn + i)]; j <= i; ++j)
        mask[static_cast<std::size_t>((b * Tn + i) * Tn + j)] = 0.0;
  }
  const Tensor starts = Tensor::from<std::int32_t>({Bn, Tn}, st);
  const Tensor dense = Tensor::from_doubles({Bn, 1, Tn, Tn}, mask, dt);
  for (std::int64_t nkv : {4, 1}) {
    CAPTURE(nkv);
    std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 50, -2, 2),
                           test::random_tensor({Bn, Tn, nkv * hd}, dt, 51, -2, 2), test::random_tensor({Bn, Tn, nkv * hd}, dt, 52)};
    Run flash = run(in, [&](auto& tp, auto& v) {
      return flash_attention(tp, v[0], v[1], v[2], Tn, nh, nkv, hd, 0.35, true, tp.input(starts));
    });
    Run ref = run(in, [&](auto& tp, auto& v) {
      return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, tp.constant(dense), Tn, nh, nkv, hd, 0.35);
    });
    Run probs = run(in, [&](auto& tp, auto& v) {
      return fused_attention(tp, v[0], v[1], v[2], tp.constant(dense), Tn, nh, nkv, hd, 0.35, true);
    });
    CHECK(worst(flash, ref) <= tol(dt));
    CHECK(worst(flash, probs) <= tol(dt));
  }
  // gqa_attention routes doc_starts to flash even below kFlashMinT; a row that is not whole
  // documents is refused by the kernel, naming the position
  GTape<cpu> tp;
  GVar q = tp.input(test::random_tensor({1, 6, 8}, dt, 53)), k = tp.input(test::random_tensor({1, 6, 8}, dt, 54));
  GVar ok = gqa_attention(tp, q, k, k, {.T = 6, .n_heads = 2, .head_dim = 4, .causal = true,
                                        .doc_starts = tp.input(Tensor::from<std::int32_t>({1, 6}, {0, 0, 2, 2, 2, 5}))});
  CHECK(std::string(tp.node(ok).name()) == "flash_attention");
  test::check_error([&] {
    gqa_attention(tp, q, k, k, {.T = 6, .n_heads = 2, .head_dim = 4, .causal = true,
                                .doc_starts = tp.input(Tensor::from<std::int32_t>({1, 6}, {0, 0, 1, 2, 2, 5}))});
  }, {"[flash_attention]", "position 2 starts at 1"});
  test::check_error([&] {
    gqa_attention(tp, q, k, k, {.T = 6, .n_heads = 2, .head_dim = 4,
                                .doc_starts = tp.input(Tensor::from<std::int32_t>({1, 6}, {0, 0, 0, 0, 0, 0}))});
  }, {"[gqa_attention]", "doc_starts need causal attention"});
}

/// The additive (Bn, 1, T, T) mask of causal attention with a sliding window (query i sees keys
/// i - window < j <= i; 0: no window) inside each row's documents (starts; empty: one document).
Tensor window_mask(std::int64_t Bn, std::int64_t Tn, std::int64_t window, const std::vector<std::int32_t>& starts,
                   DType dt) {
  std::vector<double> m(static_cast<std::size_t>(Bn * Tn * Tn), kMaskedValue);
  for (std::int64_t b = 0; b < Bn; ++b)
    for (std::int64_t i = 0; i < Tn; ++i) {
      std::int64_t j0 = starts.empty() ? 0 : starts[static_cast<std::size_t>(b * Tn + i)];
      if (window > 0) j0 = std::max(j0, i - window + 1);
      for (std::int64_t j = j0; j <= i; ++j) m[static_cast<std::size_t>((b * Tn + i) * Tn + j)] = 0.0;
    }
  return Tensor::from_doubles({Bn, 1, Tn, Tn}, m, dt);
}

TEST_CASE_TEMPLATE("flash attention's sliding window and soft cap agree with the composite (window mask, nn::softcap)",
                   T, float, double) {
  const DType dt = detail::dtype_of<T>();
  // T = 300 over tiles of 128: windows of one key, inside a tile, exactly a tile, one past it
  // (a block's first rows reach two tiles back), most of the row, and as long as the row; each
  // with and without the cap and GQA in turn (every case runs in five ops binaries in CI)
  const std::int64_t Bn = 2, Tn = 300, nh = 4, hd = 8;
  struct Case {
    std::int64_t nkv, window;
    double cap;
  };
  for (const Case& cs : {Case{4, 0, 1.5}, Case{1, 1, 0.0}, Case{4, 7, 1.5}, Case{1, 128, 1.5}, Case{4, 129, 0.0},
                         Case{1, 250, 1.5}, Case{4, 300, 0.0}}) {
    const std::int64_t nkv = cs.nkv, window = cs.window;
    const double cap = cs.cap;
    CAPTURE(nkv);
    CAPTURE(window);
    CAPTURE(cap);
    std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 60, -2, 2),
                           test::random_tensor({Bn, Tn, nkv * hd}, dt, 61, -2, 2),
                           test::random_tensor({Bn, Tn, nkv * hd}, dt, 62)};
    const Tensor dense = window_mask(Bn, Tn, window, {}, dt);
    Run flash = run(in, [&](auto& tp, auto& v) {
      return flash_attention(tp, v[0], v[1], v[2], Tn, nh, nkv, hd, 0.35, true, GVar{}, window, cap);
    });
    Run ref = run(in, [&](auto& tp, auto& v) {
      return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, tp.constant(dense), Tn, nh, nkv, hd, 0.35,
                                      false, cap);
    });
    CHECK(worst(flash, ref) <= tol(dt));
    if (cap == 0) {
      Run probs = run(in, [&](auto& tp, auto& v) {
        return fused_attention(tp, v[0], v[1], v[2], tp.constant(dense), Tn, nh, nkv, hd, 0.35, true);
      });
      CHECK(worst(flash, probs) <= tol(dt));
    }
  }
  // a window inside packed documents (a document longer than the window, one shorter, one across
  // the tile edge), capped, and a soft cap without causality
  const std::vector<std::vector<std::int64_t>> docs{{1, 130, 9, 120, 40}, {300}};
  std::vector<std::int32_t> st(static_cast<std::size_t>(Bn * Tn));
  for (std::int64_t b = 0; b < Bn; ++b) {
    std::int64_t at = 0;
    for (std::int64_t len : docs[static_cast<std::size_t>(b)]) {
      for (std::int64_t t = at; t < at + len; ++t) st[static_cast<std::size_t>(b * Tn + t)] = static_cast<std::int32_t>(at);
      at += len;
    }
  }
  std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 63, -2, 2), test::random_tensor({Bn, Tn, 2 * hd}, dt, 64, -2, 2),
                         test::random_tensor({Bn, Tn, 2 * hd}, dt, 65)};
  const Tensor dense = window_mask(Bn, Tn, 50, st, dt);
  const Tensor starts = Tensor::from<std::int32_t>({Bn, Tn}, st);
  Run flash = run(in, [&](auto& tp, auto& v) {
    return flash_attention(tp, v[0], v[1], v[2], Tn, nh, 2, hd, 0.35, true, tp.input(starts), 50, 2.0);
  });
  Run ref = run(in, [&](auto& tp, auto& v) {
    return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, tp.constant(dense), Tn, nh, 2, hd, 0.35, false, 2.0);
  });
  CHECK(worst(flash, ref) <= tol(dt));
  Run open = run(in, [&](auto& tp, auto& v) {
    return flash_attention(tp, v[0], v[1], v[2], Tn, nh, 2, hd, 0.35, false, GVar{}, 0, 2.0);
  });
  Run open_ref = run(in, [&](auto& tp, auto& v) {
    return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, GVar{}, Tn, nh, 2, hd, 0.35, false, 2.0);
  });
  CHECK(worst(open, open_ref) <= tol(dt));
}

TEST_CASE("gqa_attention runs a window or a soft cap in flash attention at any length; errors name the option") {
  const DType dt = DType::f64;
  const std::int64_t Bn = 2, Tn = 40, nh = 4, nkv = 2, hd = 8;
  RopeTable tab = rope_fill(Tn, hd, 10000.0, 1.0, 0, dt);
  std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 66), test::random_tensor({Bn, Tn, nkv * hd}, dt, 67),
                         test::random_tensor({Bn, Tn, nkv * hd}, dt, 68)};
  const Tensor dense = window_mask(Bn, Tn, 9, {}, dt);
  std::string kernel;
  Run fused = run(in, [&](auto& tp, auto& v) {
    GVar y = gqa_attention(tp, v[0], v[1], v[2], {.T = Tn, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.3,
                                                  .cos = tp.constant(tab.cos), .sin = tp.constant(tab.sin),
                                                  .causal = true, .window = 9, .softcap = 3.0});
    kernel = tp.node(y).name();
    return y;
  });
  Run ref = run(in, [&](auto& tp, auto& v) {
    return reference::gqa_attention(tp, v[0], v[1], v[2], tp.constant(tab.cos), tp.constant(tab.sin), tp.constant(dense),
                                    Tn, nh, nkv, hd, 0.3, false, 3.0);
  });
  CHECK(kernel == "flash_attention");
  CHECK(worst(fused, ref) <= tol(dt));
  GTape<cpu> tp;
  GVar q = tp.input(in[0]), k = tp.input(in[1]);
  test::check_error([&] { flash_attention(tp, q, k, k, Tn, nh, nkv, hd, 1.0, false, GVar{}, 4); },
                    {"[flash_attention]", "window = 4 without causal"});
  test::check_error([&] { flash_attention(tp, q, k, k, Tn, nh, nkv, hd, 1.0, true, GVar{}, -1); },
                    {"[flash_attention]", "window = -1"});
  test::check_error([&] { flash_attention(tp, q, k, k, Tn, nh, nkv, hd, 1.0, true, GVar{}, 0, -2.0); },
                    {"[flash_attention]", "softcap", "-2"});
  test::check_error([&] {
    gqa_attention(tp, q, k, k, {.T = Tn, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .mask = tp.constant(dense),
                                .causal = true, .window = 9});
  }, {"[gqa_attention]", "no mask tensor"});
  test::check_error([&] {
    gqa_attention(tp, q, k, k, {.T = Tn, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .window = 9});
  }, {"[gqa_attention]", "window needs causal"});
}

TEST_CASE("flash attention with a window as long as the row is plain causal attention, bit for bit") {
  const std::int64_t Tn = 1024, nh = 2, hd = 8;
  std::vector<Tensor> in{test::random_tensor({1, Tn, nh * hd}, DType::f64, 69), test::random_tensor({1, Tn, nh * hd}, DType::f64, 70),
                         test::random_tensor({1, Tn, nh * hd}, DType::f64, 71)};
  Run wide = run(in, [&](auto& tp, auto& v) { return flash_attention(tp, v[0], v[1], v[2], Tn, nh, nh, hd, 0.3, true, GVar{}, Tn); });
  Run causal = run(in, [&](auto& tp, auto& v) { return flash_attention(tp, v[0], v[1], v[2], Tn, nh, nh, hd, 0.3, true); });
  CHECK(worst(wide, causal) == 0.0);  // a window of T hides nothing: the same tiles, the same bits
}

TEST_CASE("gqa_attention without a mask tensor runs flash attention from kFlashMinT on, and agrees with the composite") {
  const DType dt = DType::f64;
  const std::int64_t Bn = 1, nh = 4, nkv = 2, hd = 8;
  for (std::int64_t Tn : {detail::kFlashMinT - 1, detail::kFlashMinT}) {
    RopeTable tab = rope_fill(Tn, hd, 10000.0, 1.0, 0, dt);
    std::vector<Tensor> in{test::random_tensor({Bn, Tn, nh * hd}, dt, 50), test::random_tensor({Bn, Tn, nkv * hd}, dt, 51),
                           test::random_tensor({Bn, Tn, nkv * hd}, dt, 52)};
    Tensor causal = causal_mask_fill(Tn, dt);
    std::string kernel;
    Run fused = run(in, [&](auto& tp, auto& v) {
      GVar y = gqa_attention(tp, v[0], v[1], v[2], {.T = Tn, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd,
                                                    .scale = 0.3, .cos = tp.constant(tab.cos),
                                                    .sin = tp.constant(tab.sin), .causal = true});
      kernel = tp.node(y).name();
      return y;
    });
    Run ref = run(in, [&](auto& tp, auto& v) {
      return reference::gqa_attention(tp, v[0], v[1], v[2], tp.constant(tab.cos), tp.constant(tab.sin),
                                      tp.constant(causal), Tn, nh, nkv, hd, 0.3);
    });
    CHECK(kernel == (Tn >= detail::kFlashMinT ? "flash_attention" : "attention"));
    CHECK(worst(fused, ref) <= tol(dt));
  }
}

TEST_CASE("flash attention keeps O(T) for its vjp, not the (T, T) probabilities") {
  // T = 256, H = 4: the probabilities kernel keeps B*H*T*T + B*KV*T*T values; flash keeps two
  // (B, H, T) rows of statistics.
  const std::int64_t Bn = 1, Tn = 256, nh = 4, nkv = 2, hd = 8;
  auto kept = [&](bool flash) {
    Tensor qt = test::random_tensor({Bn, Tn, nh * hd}, DType::f32, 46), kt = test::random_tensor({Bn, Tn, nkv * hd}, DType::f32, 47);
    GTape<cpu> tp;  // params are bound by address: the tensors outlive the tape
    GVar q = tp.param(qt), k = tp.param(kt);
    GVar y = flash ? flash_attention(tp, q, k, k, Tn, nh, nkv, hd, 0.3, true)
                   : fused_attention(tp, q, k, k, GVar{}, Tn, nh, nkv, hd, 0.3, true);
    tp.backward(sum(tp, y));
    std::int64_t n = 0;
    for (const Tensor& t : tp.node(y).saved) n += t.numel();
    return n;
  };
  CHECK(kept(true) == 2 * Bn * nh * Tn);
  CHECK(kept(false) == Bn * nh * Tn * Tn + Bn * nkv * Tn * Tn);
}

TEST_CASE("fused primitives pass central differences in float64") {
  const DType dt = DType::f64;
  Tensor causal = causal_mask_fill(4, dt);
  RopeTable tab = rope_fill(4, 4, 10000.0, 1.0, 0, dt);
  Tensor c3 = tab.cos.reshape({4, 1, 2}), s3 = tab.sin.reshape({4, 1, 2});
  auto sq = [](GTape<cpu>& tp, GVar y) { return sum(tp, mul(tp, y, y)); };  // a loss with a rich cotangent
  CHECK(test::gradcheck("rmsnorm", {test::random_tensor({3, 6}, dt, 20), test::random_tensor({6}, dt, 21)},
                        [&](GTape<cpu>& tp, const std::vector<GVar>& v) { return sq(tp, fused_rmsnorm(tp, v[0], v[1], 1e-5)); }) <= 1e-7);
  CHECK(test::gradcheck("swiglu", {test::random_tensor({3, 6}, dt, 22, -4, 4), test::random_tensor({3, 6}, dt, 23)},
                        [&](GTape<cpu>& tp, const std::vector<GVar>& v) { return sq(tp, fused_swiglu(tp, v[0], v[1])); }) <= 1e-7);
  CHECK(test::gradcheck("rope", {test::random_tensor({2, 4, 3, 6}, dt, 24)}, [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
          return sq(tp, fused_rope(tp, v[0], tp.constant(c3), tp.constant(s3), false));
        }) <= 1e-7);
  CHECK(test::gradcheck("attention",
                        {test::random_tensor({2, 4, 12}, dt, 25), test::random_tensor({2, 4, 6}, dt, 26),
                         test::random_tensor({2, 4, 6}, dt, 27)},
                        [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
                          return sq(tp, fused_attention(tp, v[0], v[1], v[2], tp.constant(causal), 4, 4, 2, 3, 0.6));
                        }) <= 1e-7);
  // causal across blocks (T = 37: a block of 32 and one of 5), no mask tensor
  CHECK(test::gradcheck("causal attention",
                        {test::random_tensor({1, 37, 4}, dt, 28), test::random_tensor({1, 37, 2}, dt, 29),
                         test::random_tensor({1, 37, 2}, dt, 30)},
                        [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
                          return sq(tp, fused_attention(tp, v[0], v[1], v[2], GVar{}, 37, 2, 1, 2, 0.6, true));
                        }) <= 1e-7);
  // flash attention across tiles (T = 140: one of 128 and one of 12), GQA, causal and not
  for (bool is_causal : {true, false})
    CHECK(test::gradcheck(is_causal ? "causal flash attention" : "flash attention",
                          {test::random_tensor({1, 140, 4}, dt, 31), test::random_tensor({1, 140, 2}, dt, 32),
                           test::random_tensor({1, 140, 2}, dt, 33)},
                          [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
                            return sq(tp, flash_attention(tp, v[0], v[1], v[2], 140, 2, 1, 2, 0.6, is_causal));
                          }) <= 1e-7);
  // with a sliding window of 30 across the tile edge and a soft cap of 0.8 (small, so the cap's
  // derivative matters)
  CHECK(test::gradcheck("flash attention, window and soft cap",
                        {test::random_tensor({1, 140, 4}, dt, 34, -2, 2), test::random_tensor({1, 140, 2}, dt, 35, -2, 2),
                         test::random_tensor({1, 140, 2}, dt, 36)},
                        [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
                          return sq(tp, flash_attention(tp, v[0], v[1], v[2], 140, 2, 1, 2, 0.6, true, GVar{}, 30, 0.8));
                        }) <= 1e-7);
}

TEST_CASE("fused primitives: errors name the op and the shapes") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::zeros({2, 4, 6}, DType::f64));
  GVar w5 = tp.constant(Tensor::zeros({5}, DType::f64));
  test::check_error([&] { fused_rmsnorm(tp, x, w5, 1e-5); }, {"[rmsnorm]", "weight (5)", "(2, 4, 6)"});
  GVar c = tp.constant(Tensor::zeros({3, 2}, DType::f64));
  test::check_error([&] { fused_rope(tp, x, c, c); }, {"[rope]", "(2, 4, 6)", "(3, 2)"});
  GVar k = tp.constant(Tensor::zeros({2, 4, 2}, DType::f64));
  GVar bad = tp.constant(Tensor::zeros({3, 4}, DType::f64));
  test::check_error([&] { fused_attention(tp, x, k, k, bad, 4, 3, 1, 2, 1.0); }, {"[attention]", "mask (3, 4)"});
  test::check_error([&] { fused_attention(tp, x, k, k, GVar{}, 4, 3, 1, 3, 1.0); }, {"[attention]", "head_dim = 3"});
  test::check_error([&] { flash_attention(tp, x, k, k, 4, 3, 1, 3, 1.0); }, {"[flash_attention]", "head_dim = 3"});
  test::check_error([&] { flash_attention(tp, x, k, k, 4, 3, 2, 2, 1.0); }, {"[flash_attention]", "n_kv_heads = 2"});
  test::check_error([&] { fused_swiglu(tp, x, k); }, {"[swiglu]", "(2, 4, 6)", "(2, 4, 2)"});
}

}  // namespace ops_fused
