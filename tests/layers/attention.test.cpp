// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/attention.hpp: head and gqa_attention (MHA, GQA, MQA; RoPE; causal + padding mask).
#include "layer_case.hpp"

namespace layers_attention {  // one unity source with the other layers files: its names stay its own

using namespace nn;

namespace {

Tensor keep_from_lengths(const std::vector<std::int64_t>& lengths, std::int64_t T) {
  std::vector<std::int32_t> k;
  for (auto L : lengths)
    for (std::int64_t t = 0; t < T; ++t) k.push_back(t < L ? 1 : 0);
  return Tensor::from<std::int32_t>({static_cast<std::int64_t>(lengths.size()), T}, k);
}

GVar attention_case(GTape<cpu>& tp, test::Vars& v, const nlohmann::json& c) {
  const DType dt = tp.dtype(v["q"]);
  const auto T = c["T"].get<std::int64_t>(), hd = c["head_dim"].get<std::int64_t>();
  RopeVars r = rope_fill(tp, T, hd, c["base"].get<double>(), 1.0, 0, dt);
  std::vector<std::int64_t> lengths;
  for (double d : tp.value(v["lengths"]).to_doubles()) lengths.push_back(static_cast<std::int64_t>(d));
  GVar mask = attention_mask_fill(tp, keep_from_lengths(lengths, T), dt);
  return gqa_attention(tp, v["q"], v["k"], v["v"], {.T = T, .n_heads = c["n_heads"].get<std::int64_t>(),
                                                    .n_kv_heads = c["n_kv_heads"].get<std::int64_t>(), .head_dim = hd,
                                                    .scale = c["scale"].get<double>(), .cos = r.cos, .sin = r.sin,
                                                    .mask = mask});
}

/// The same attention written head by head with nn::head: an independent composite reference.
GVar attention_per_head(GTape<cpu>& tp, GVar q, GVar k, GVar v, GVar cos, GVar sin, GVar mask, std::int64_t nh,
                        std::int64_t nkv, std::int64_t hd, double scale) {
  std::vector<GVar> heads;
  for (std::int64_t h = 0; h < nh; ++h) {
    const std::int64_t kvh = h / (nh / nkv);
    GVar qh = rope(tp, head(tp, q, h, hd), cos, sin);  // (B, T, hd)
    GVar kh = rope(tp, head(tp, k, kvh, hd), cos, sin);
    GVar s = scale == 1.0 ? matmul(tp, qh, kh, false, true) : nn::scale(tp, matmul(tp, qh, kh, false, true), scale);
    if (mask.valid()) s = add(tp, s, mask);
    heads.push_back(matmul(tp, softmax(tp, s), head(tp, v, kvh, hd)));
  }
  return concat(tp, std::span<const GVar>(heads), -1);
}

}  // namespace

TEST_CASE("gqa_attention matches HF-style attention in PyTorch (MHA, GQA, MQA; RoPE; causal + padding)") {
  for (const char* name : {"attention/mha", "attention/gqa", "attention/mqa"}) test::check_layer_case(name, attention_case);
}

TEST_CASE("gqa_attention agrees with a per-head composite built from nn::head") {
  const std::int64_t Bn = 2, T = 5, nh = 6, hd = 4;
  for (std::int64_t nkv : {6, 3, 2, 1}) {
    GTape<cpu> tp;
    GVar q = tp.constant(test::random_tensor({Bn, T, nh * hd}, DType::f64, 61));
    GVar k = tp.constant(test::random_tensor({Bn, T, nkv * hd}, DType::f64, 62));
    GVar v = tp.constant(test::random_tensor({Bn, T, nkv * hd}, DType::f64, 63));
    RopeVars r = rope_fill(tp, T, hd, 10000.0, 1.0, 0, DType::f64);
    GVar causal = causal_mask_fill(tp, T, DType::f64);
    GVar fast = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.5,
                                            .cos = r.cos, .sin = r.sin, .mask = causal});
    GVar ref = attention_per_head(tp, q, k, v, r.cos, r.sin, causal, nh, nkv, hd, 0.5);
    double e = test::rel_err(tp.value(fast), tp.value(ref));
    MESSAGE("n_kv_heads " << nkv << ": batched vs per-head " << e);
    CHECK(e <= 1e-14);
  }
}

TEST_CASE("gqa_attention: layouts, mask forms and shapes") {
  const std::int64_t Bn = 2, T = 4, nh = 4, nkv = 2, hd = 6;
  GTape<cpu> tp;
  Tensor Q = test::random_tensor({Bn, T, nh * hd}, DType::f64, 71);
  Tensor K = test::random_tensor({Bn, T, nkv * hd}, DType::f64, 72);
  Tensor V = test::random_tensor({Bn, T, nkv * hd}, DType::f64, 73);
  GVar q = tp.constant(Q), k = tp.constant(K), v = tp.constant(V);
  RopeVars r = rope_fill(tp, T, hd, 10000.0, 1.0, 0, DType::f64);
  GVar causal = causal_mask_fill(tp, T, DType::f64);
  GVar y = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.4,
                                       .cos = r.cos, .sin = r.sin, .mask = causal});
  CHECK(tp.shape(y) == Shape{Bn, T, nh * hd});
  // rows layout (B*T, C) gives the same numbers in (B*T, C)
  GVar y2 = gqa_attention(tp, tp.constant(Q.reshape({Bn * T, nh * hd})), tp.constant(K.reshape({Bn * T, nkv * hd})),
                          tp.constant(V.reshape({Bn * T, nkv * hd})),
                          {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.4, .cos = r.cos,
                           .sin = r.sin, .mask = causal});
  CHECK(tp.shape(y2) == Shape{Bn * T, nh * hd});
  CHECK(test::rel_err(tp.value(y2).to_doubles(), tp.value(y).to_doubles()) == 0.0);
  // (B, 1, T, T) and (B, n_heads, T, T) masks with no padding equal the (T, T) causal mask
  Tensor keep = Tensor::ones({Bn, T}, DType::i32);
  GVar y4 = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.4,
                                        .cos = r.cos, .sin = r.sin, .mask = attention_mask_fill(tp, keep, DType::f64)});
  CHECK(test::rel_err(tp.value(y4), tp.value(y)) == 0.0);
  Tensor per_head = Tensor::empty({Bn, nh, T, T}, DType::f64);
  Tensor cm = causal_mask_fill(T, DType::f64);
  for (std::int64_t i = 0; i < per_head.numel(); ++i) per_head.data<double>()[i] = cm.item(i % (T * T));
  GVar yh = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.4,
                                        .cos = r.cos, .sin = r.sin, .mask = tp.constant(per_head)});
  CHECK(test::rel_err(tp.value(yh), tp.value(y)) == 0.0);
  // no RoPE, no mask: still runs; a key-padding-only mask (B, 1, 1, T) broadcasts too
  CHECK(tp.shape(gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd})) ==
        Shape{Bn, T, nh * hd});
  GVar pad = tp.constant(padding_mask_fill(keep, DType::f64));
  CHECK(tp.shape(gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.4,
                                             .cos = r.cos, .sin = r.sin, .mask = pad})) == Shape{Bn, T, nh * hd});
  // head
  CHECK(tp.shape(head(tp, q, 3, hd)) == Shape{Bn, T, hd});
  CHECK(tp.value(head(tp, q, 1, hd)).item(0) == Q.item(hd));
}

TEST_CASE("gqa_attention's options: defaults, and every field reaching the composite reference") {
  const std::int64_t Bn = 2, T = 5, nh = 4, nkv = 2, hd = 6;
  GTape<cpu> tp;
  GVar q = tp.constant(test::random_tensor({Bn, T, nh * hd}, DType::f64, 81));
  GVar k = tp.constant(test::random_tensor({Bn, T, nkv * hd}, DType::f64, 82));
  GVar v = tp.constant(test::random_tensor({Bn, T, nkv * hd}, DType::f64, 83));
  RopeVars r = rope_fill(tp, T, hd);  // the tape's float dtype: float64, from q
  CHECK(tp.dtype(r.cos) == DType::f64);
  const double s = 1.0 / std::sqrt(static_cast<double>(hd));
  // causal, RoPE, GQA, default scale
  GVar a = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = s,
                                       .cos = r.cos, .sin = r.sin, .causal = true});
  GVar b = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .cos = r.cos,
                                       .sin = r.sin, .causal = true});
  CHECK(test::rel_err(tp.value(a), tp.value(b)) == 0.0);
  // a mask tensor (in the tape's dtype by default), traditional RoPE, explicit scale: the fused
  // path equals the composite built from primitives (which takes every field positionally)
  GVar m = causal_mask_fill(tp, T);
  CHECK(tp.dtype(m) == DType::f64);
  GVar c = gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv, .head_dim = hd, .scale = 0.3,
                                       .cos = r.cos, .sin = r.sin, .mask = m, .traditional = true});
  GVar d = reference::gqa_attention(tp, q, k, v, r.cos, r.sin, m, T, nh, nkv, hd, 0.3, true);
  CHECK(test::rel_err(tp.value(c), tp.value(d)) <= 1e-14);
  GVar d2 = reference::gqa_attention(tp, q, k, v, r.cos, r.sin, m, T, nh, nkv, hd, 0.3, false);  // control
  CHECK(test::rel_err(tp.value(c), tp.value(d2)) > 1e-3);
  // n_kv_heads left out: MHA; no RoPE, no mask
  GVar kk = tp.constant(test::random_tensor({Bn, T, nh * hd}, DType::f64, 84));
  GVar e = gqa_attention(tp, q, kk, kk, {.T = T, .n_heads = nh, .n_kv_heads = nh, .head_dim = hd, .scale = s});
  GVar f = gqa_attention(tp, q, kk, kk, {.T = T, .n_heads = nh, .head_dim = hd});
  CHECK(test::rel_err(tp.value(e), tp.value(f)) == 0.0);
  test::check_error([&] { gqa_attention(tp, q, k, v, {.T = T, .n_heads = nh, .n_kv_heads = nkv}); },
                    {"[gqa_attention]", "head_dim"});
}

TEST_CASE("gqa_attention: finite differences (MHA, GQA, MQA, padded)") {
  const std::int64_t Bn = 2, T = 4, nh = 4, hd = 4;
  Tensor keep = Tensor::from<std::int32_t>({2, 4}, {1, 1, 1, 1, 1, 1, 0, 0});
  RopeTable tab = rope_fill(T, hd, 10000.0, 1.0, 0, DType::f64);
  Tensor mask = attention_mask_fill(keep, DType::f64);
  for (std::int64_t nkv : {4, 2, 1}) {
    Tensor q = test::random_tensor({Bn, T, nh * hd}, DType::f64, 81), k = test::random_tensor({Bn, T, nkv * hd}, DType::f64, 82);
    Tensor v = test::random_tensor({Bn, T, nkv * hd}, DType::f64, 83);
    double e = test::layer_gradcheck("gqa_attention n_kv_heads=" + std::to_string(nkv), {q, k, v},
                                     [&](GTape<cpu>& tp, const std::vector<GVar>& x) {
                                       return gqa_attention(tp, x[0], x[1], x[2], {.T = T, .n_heads = nh,
                                                                                   .n_kv_heads = nkv, .head_dim = hd,
                                                                                   .scale = 0.5,
                                                                                   .cos = tp.constant(tab.cos),
                                                                                   .sin = tp.constant(tab.sin),
                                                                                   .mask = tp.constant(mask)});
                                     });
    CHECK(e <= 1e-7);
  }
  Tensor x = test::random_tensor({2, 3, 8}, DType::f64, 84);
  CHECK(test::layer_gradcheck("head", {x}, [](GTape<cpu>& tp, const std::vector<GVar>& v) { return head(tp, v[0], 1, 4); }) <= 1e-7);
}

TEST_CASE("gqa_attention: errors name the layer and the shapes") {
  GTape<cpu> tp;
  GVar q = tp.constant(Tensor::zeros({2, 4, 24}, DType::f64));
  GVar k = tp.constant(Tensor::zeros({2, 4, 12}, DType::f64));
  GVar k5 = tp.constant(Tensor::zeros({2, 5, 12}, DType::f64));
  RopeVars r = rope_fill(tp, 4, 6, 10000.0, 1.0, 0, DType::f64);
  GVar bad_mask = tp.constant(Tensor::zeros({3, 1, 4, 4}, DType::f64));
  test::check_error([&] { gqa_attention(tp, q, k, k, {.T = 4, .n_heads = 4, .n_kv_heads = 3, .head_dim = 6,
                                                      .scale = 1.0, .cos = r.cos, .sin = r.sin}); },
                    {"[gqa_attention]", "n_heads = 4", "n_kv_heads = 3"});
  test::check_error([&] { gqa_attention(tp, q, k5, k5, {.T = 4, .n_heads = 4, .n_kv_heads = 2, .head_dim = 6,
                                                        .scale = 1.0, .cos = r.cos, .sin = r.sin}); },
                    {"[gqa_attention]", "(2, 4, 24)", "(2, 5, 12)"});
  test::check_error([&] { gqa_attention(tp, q, k, k, {.T = 4, .n_heads = 4, .n_kv_heads = 1, .head_dim = 6,
                                                      .scale = 1.0, .cos = r.cos, .sin = r.sin}); },
                    {"[gqa_attention]", "k (2, 4, 12)", "n_kv_heads = 1"});
  test::check_error([&] { gqa_attention(tp, q, k, k, {.T = 4, .n_heads = 4, .n_kv_heads = 2, .head_dim = 6,
                                                      .scale = 1.0, .cos = r.cos, .sin = r.sin, .mask = bad_mask}); },
                    {"[gqa_attention]", "mask (3, 1, 4, 4)", "(2, 4, 4, 4)"});
  RopeVars r5 = rope_fill(tp, 5, 6, 10000.0, 1.0, 0, DType::f64);
  test::check_error([&] { gqa_attention(tp, q, k, k, {.T = 4, .n_heads = 4, .n_kv_heads = 2, .head_dim = 6,
                                                      .scale = 1.0, .cos = r5.cos, .sin = r5.sin}); },
                    {"[gqa_attention]", "(5, 3)"});
  test::check_error([&] { head(tp, q, 4, 6); }, {"[head]", "head 4", "(2, 4, 24)"});
  test::check_error([&] { head(tp, q, 0, 5); }, {"[head]", "(2, 4, 24)", "size 5"});
}

}  // namespace layers_attention
