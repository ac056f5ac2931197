// SPDX-License-Identifier: MIT OR Apache-2.0
// Every primitive and layer on GTape<nn::cuda> against GTape<nn::cpu>: the same builder, the same
// fresh random inputs, outputs and every gradient compared (f64 to 1e-12, f32 to 1e-5); and the
// layer library's gate, the Qwen2 block with 14 LoRA adapters, on the GPU against PyTorch float64.
#include <cmath>

#include "cuda_check.hpp"

using namespace nn;
using namespace nn::test::gpu;

namespace {

/// An input of a case: a trainable parameter (its gradient is compared) or a constant.
struct In {
  Tensor value;  // host
  bool param = true;
};
In P(Tensor t) { return {std::move(t), true}; }
In C(Tensor t) { return {std::move(t), false}; }

/// Builds `build(tp, vars)` on both backends from the same host inputs, compares the output, then
/// back-propagates loss = sum(out * w) for a random cotangent w and compares every gradient.
template <class Build>
void tape_case(const std::string& name, const std::vector<In>& ins, Build&& build, double tol = -1) {
  GTape<cpu> tc;
  GTape<cuda> tg;
  std::vector<Tensor> dvals;  // params are bound by reference: storage that does not move
  dvals.reserve(ins.size());
  std::vector<GVar> vc, vg;
  for (const In& in : ins) {
    dvals.push_back(dev(in.value));
    vc.push_back(in.param ? tc.param(in.value) : tc.constant(in.value));
    vg.push_back(in.param ? tg.param(dvals.back()) : tg.constant(dvals.back()));
  }
  GVar oc = build(tc, vc), og = build(tg, vg);
  const DType dt = tc.dtype(oc);
  expect_close(name + " forward", tc.value(oc), tg.value(og), tol);
  if (!is_floating(dt) || !tc.requires_grad(oc)) return;
  Tensor w = rnd(tc.shape(oc), dt);
  tc.backward(sum(tc, mul(tc, oc, tc.constant(w))));
  tg.backward(sum(tg, mul(tg, og, tg.constant(dev(w)))));
  for (std::size_t i = 0; i < ins.size(); ++i)
    if (ins[i].param && is_floating(ins[i].value.dtype()))
      expect_close(name + " grad " + std::to_string(i), tc.grad(vc[i]), tg.grad(vg[i]), tol);
}

}  // namespace

TEST_CASE("cuda tape: elementwise primitives") {
  const Unary ops[] = {Unary::neg,  Unary::exp,  Unary::log,  Unary::sqrt, Unary::rsqrt,       Unary::tanh,
                       Unary::sigmoid, Unary::relu, Unary::abs, Unary::pow, Unary::silu,       Unary::gelu,
                       Unary::gelu_approx, Unary::gelu_fast, Unary::scale, Unary::add_scalar};
  for (DType dt : float_dtypes()) {
    for (Unary op : ops) {
      const bool positive = op == Unary::log || op == Unary::sqrt || op == Unary::rsqrt || op == Unary::pow;
      Tensor x = positive ? rnd({4, 19}, dt, 0.2, 3) : rnd({4, 19}, dt, -3, 3);
      tape_case(std::string("op ") + unary_name(op), {P(x)},
                [op](auto& tp, const std::vector<GVar>& v) { return nn::unary(tp, op, v[0], op == Unary::pow ? 1.5 : 0.7); });
    }
    const Binary bops[] = {Binary::add, Binary::sub, Binary::mul, Binary::div, Binary::maximum, Binary::minimum};
    for (Binary op : bops)
      tape_case(std::string("op ") + binary_name(op) + " broadcast", {P(rnd({3, 4, 5}, dt)), P(rnd({4, 1}, dt, 0.5, 2))},
                [op](auto& tp, const std::vector<GVar>& v) { return nn::binary(tp, op, v[0], v[1]); });
    Tensor mask = ids({3, 1}, DType::i64, 0, 2).to(DType::u8);
    tape_case("op where", {C(mask), P(rnd({3, 6}, dt)), P(rnd({6}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::where(tp, v[0], v[1], v[2]); });
    tape_case("op stop_gradient", {P(rnd({5}, dt))}, [](auto& tp, const std::vector<GVar>& v) {
      return nn::add(tp, nn::stop_gradient(tp, nn::mul(tp, v[0], v[0])), v[0]);
    });
  }
}

TEST_CASE("cuda tape: reductions, shapes, matmul, softmax, indexing, random") {
  for (DType dt : float_dtypes()) {
    Tensor x = rnd({3, 4, 5}, dt);
    tape_case("op sum all", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::sum(tp, v[0]); });
    tape_case("op sum axis 1 keepdims", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::sum(tp, v[0], {1}, true); });
    tape_case("op mean axes 0,2", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::mean(tp, v[0], {0, 2}); });
    tape_case("op max axis 1", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::max(tp, v[0], 1); });
    tape_case("op reshape", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::reshape(tp, nn::exp(tp, v[0]), {12, 5}); });
    tape_case("op permute", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::permute(tp, v[0], {2, 0, 1}); });
    tape_case("op transpose", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::transpose(tp, v[0]); });
    tape_case("op slice", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::slice(tp, v[0], 1, 1, 3); });
    tape_case("op concat", {P(x), P(rnd({3, 2, 5}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::concat(tp, {v[0], v[1], v[0]}, 1); });
    tape_case("op broadcast_to", {P(rnd({4, 1}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::broadcast_to(tp, v[0], Shape{3, 4, 6}); });
    tape_case("op matmul", {P(rnd({7, 9}, dt)), P(rnd({9, 5}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::matmul(tp, v[0], v[1]); });
    tape_case("op matmul a^T b^T", {P(rnd({9, 7}, dt)), P(rnd({5, 9}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::matmul(tp, v[0], v[1], true, true); });
    tape_case("op matmul batched", {P(rnd({2, 3, 7, 9}, dt)), P(rnd({2, 3, 9, 5}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::matmul(tp, v[0], v[1]); });
    tape_case("op matmul folded (x W^T)", {P(rnd({2, 3, 9}, dt)), P(rnd({5, 9}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::matmul(tp, v[0], v[1], false, true); });
    tape_case("op matmul shared b, a^T", {P(rnd({4, 9, 7}, dt)), P(rnd({9, 5}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::matmul(tp, v[0], v[1], true, false); });
    tape_case("op matmul shared a", {P(rnd({7, 9}, dt)), P(rnd({4, 9, 5}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::matmul(tp, v[0], v[1]); });
    tape_case("op softmax", {P(rnd({6, 50}, dt, -5, 5))}, [](auto& tp, const std::vector<GVar>& v) { return nn::softmax(tp, v[0]); });
    tape_case("op log_softmax", {P(rnd({6, 50}, dt, -5, 5))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::log_softmax(tp, v[0]); });
    Tensor t = ids({2, 6}, DType::i64, 0, 40);
    t.data<std::int64_t>()[1] = -100;
    for (Reduction r : {Reduction::none, Reduction::sum, Reduction::mean})
      tape_case(std::string("op softmax_cross_entropy ") + reduction_name(r), {P(rnd({2, 6, 40}, dt, -3, 3)), C(t)},
                [r](auto& tp, const std::vector<GVar>& v) { return nn::softmax_cross_entropy(tp, v[0], v[1], r); });
    Tensor t5 = ids({2, 5}, DType::i32, 0, 40);
    tape_case("op softmax_cross_entropy_rows", {P(rnd({2, 6, 40}, dt, -3, 3)), C(t5)},
              [](auto& tp, const std::vector<GVar>& v) { return nn::softmax_cross_entropy_rows(tp, v[0], v[1]); });
    tape_case("op gather_rows", {P(rnd({11, 6}, dt)), C(ids({3, 8}, DType::i32, 0, 11))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::gather_rows(tp, v[0], v[1]); });
    tape_case("op pick", {P(rnd({9, 13}, dt)), C(ids({9}, DType::i64, -1, 13))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::pick(tp, v[0], v[1]); });
    Tensor key = random::key(next_seed());
    tape_case("op bernoulli", {C(key)}, [](auto& tp, const std::vector<GVar>& v) { return nn::bernoulli(tp, 0.3, Shape{7, 9}, v[0]); });
    tape_case("op dropout", {P(rnd({5, 33}, dt)), C(key)},
              [](auto& tp, const std::vector<GVar>& v) { return nn::dropout(tp, v[0], 0.25, v[1]); });
  }
}

TEST_CASE("cuda tape: layers") {
  for (DType dt : float_dtypes()) {
    Tensor x = rnd({2, 5, 8}, dt);
    tape_case("layer linear", {P(x), P(rnd({6, 8}, dt))}, [](auto& tp, const std::vector<GVar>& v) { return nn::linear(tp, v[0], v[1]); });
    tape_case("layer linear + bias", {P(x), P(rnd({6, 8}, dt)), P(rnd({6}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::linear(tp, v[0], v[1], v[2]); });
    tape_case("layer lora_linear", {P(x), C(rnd({6, 8}, dt)), P(rnd({8, 2}, dt)), P(rnd({2, 6}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::lora_linear(tp, v[0], v[1], v[2], v[3], 2.0); });
    tape_case("layer rmsnorm", {P(x), P(rnd({8}, dt))}, [](auto& tp, const std::vector<GVar>& v) { return nn::rmsnorm(tp, v[0], v[1], 1e-6); });
    tape_case("layer layernorm", {P(x), P(rnd({8}, dt)), P(rnd({8}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::layernorm(tp, v[0], v[1], v[2], 1e-5); });
    tape_case("layer silu", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::silu(tp, v[0]); });
    tape_case("layer gelu", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::gelu(tp, v[0]); });
    tape_case("layer gelu_approx", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::gelu_approx(tp, v[0]); });
    tape_case("layer gelu_fast_approx", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::gelu_fast_approx(tp, v[0]); });
    tape_case("layer swiglu", {P(x), P(rnd({2, 5, 8}, dt))}, [](auto& tp, const std::vector<GVar>& v) { return nn::swiglu(tp, v[0], v[1]); });
    for (bool trad : {false, true})
      tape_case(std::string("layer rope") + (trad ? " traditional" : ""), {P(rnd({2, 3, 5, 8}, dt))},
                [trad, dt](auto& tp, const std::vector<GVar>& v) {
                  RopeVars r = rope_fill(tp, 5, 6, 10000.0, 1.0, 0, dt);
                  return nn::rope(tp, v[0], r.cos, r.sin, trad);
                });
    Tensor keep = Tensor::from<std::int32_t>({2, 5}, {1, 1, 1, 1, 1, 1, 1, 1, 0, 0});
    tape_case("layer gqa_attention (causal + padding)", {P(rnd({2, 5, 16}, dt)), P(rnd({2, 5, 8}, dt)), P(rnd({2, 5, 8}, dt))},
              [keep, dt](auto& tp, const std::vector<GVar>& v) {
                RopeVars r = rope_fill(tp, 5, 4, 10000.0, 1.0, 0, dt);
                GVar mask = attention_mask_fill(tp, keep, dt);
                return nn::gqa_attention(tp, v[0], v[1], v[2], {.T = 5, .n_heads = 4, .n_kv_heads = 2, .head_dim = 4,
                                                                .scale = 0.5, .cos = r.cos, .sin = r.sin, .mask = mask});
              });
    tape_case("layer gqa_attention (causal)", {P(rnd({5, 8}, dt)), P(rnd({5, 8}, dt)), P(rnd({5, 8}, dt))},
              [dt](auto& tp, const std::vector<GVar>& v) {
                RopeVars r = rope_fill(tp, 5, 4, 10000.0, 1.0, 0, dt);
                GVar mask = causal_mask_fill(tp, 5, dt);
                return nn::gqa_attention(tp, v[0], v[1], v[2], {.T = 5, .n_heads = 2, .n_kv_heads = 2, .head_dim = 4,
                                                                .scale = 0.5, .cos = r.cos, .sin = r.sin, .mask = mask});
              });
    tape_case("layer embedding", {C(ids({2, 7}, DType::i64, 0, 20)), P(rnd({20, 8}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::embedding(tp, v[0], v[1]); });
    Tensor t = ids({2, 5}, DType::i64, 0, 30);
    t.data<std::int64_t>()[7] = -100;
    Tensor kp = Tensor::from_doubles({2, 5}, {1, 1, 1, 0, 1, 1, 1, 1, 1, 0}, dt);
    tape_case("layer cross_entropy (keep)", {P(rnd({2, 5, 30}, dt, -2, 2)), C(t), C(kp)},
              [](auto& tp, const std::vector<GVar>& v) { return nn::cross_entropy(tp, v[0], v[1], v[2]); });
    tape_case("layer cross_entropy (probabilities)", {P(rnd({4, 30}, dt, -2, 2)), C(rnd({4, 30}, dt, 0, 1))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::cross_entropy(tp, v[0], v[1]); });
    Tensor t4 = ids({2, 4}, DType::i64, 0, 30);
    tape_case("layer cross_entropy_rows", {P(rnd({2, 5, 30}, dt, -2, 2)), C(t4)},
              [](auto& tp, const std::vector<GVar>& v) { return nn::cross_entropy_rows(tp, v[0], v[1], 4); });
    tape_case("layer dropout", {P(rnd({4, 64}, dt)), C(random::key(next_seed()))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::dropout(tp, v[0], 0.1, v[1]); });
    tape_case("layer rmsnorm (no gain)", {P(x)}, [](auto& tp, const std::vector<GVar>& v) { return nn::rmsnorm(tp, v[0], 1e-5); });
    // The composite references of the fused primitives, on the GPU too.
    tape_case("reference rmsnorm", {P(x), P(rnd({8}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::reference::rmsnorm(tp, v[0], v[1], 1e-6); });
    tape_case("reference swiglu", {P(x), P(rnd({2, 5, 8}, dt))},
              [](auto& tp, const std::vector<GVar>& v) { return nn::reference::swiglu(tp, v[0], v[1]); });
    tape_case("reference rope", {P(rnd({2, 3, 5, 8}, dt))}, [dt](auto& tp, const std::vector<GVar>& v) {
      RopeVars r = rope_fill(tp, 5, 6, 10000.0, 1.0, 0, dt);
      return nn::reference::rope(tp, v[0], r.cos, r.sin, false);
    });
    tape_case("reference gqa_attention", {P(rnd({2, 5, 16}, dt)), P(rnd({2, 5, 8}, dt)), P(rnd({2, 5, 8}, dt))},
              [dt](auto& tp, const std::vector<GVar>& v) {
                RopeVars r = rope_fill(tp, 5, 4, 10000.0, 1.0, 0, dt);
                GVar mask = causal_mask_fill(tp, 5, dt);
                return nn::reference::gqa_attention(tp, v[0], v[1], v[2], r.cos, r.sin, mask, 5, 4, 2, 4, 0.5);
              });
  }
}

// ---- the Qwen2 block gate on the GPU ----------------------------------------------------------

namespace {

const char* const kAdapted[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

struct BlockConfig {
  std::int64_t B, T, C, n_heads, n_kv_heads, head_dim, intermediate, vocab, rank;
  double lora_scale, eps, theta;
};
struct BlockWeights {
  std::map<std::string, Tensor> w;  // on the tape's device
  Tensor targets, keep;             // targets on the device; keep on the host (the mask is built there)
};
struct Block {
  GVar loss, x;
  std::map<std::string, GVar> adapters;
};

/// tests/layers/qwen2_block.test.cpp's block, on any backend.
template <class B>
Block build_block(GTape<B>& tp, BlockWeights& W, const BlockConfig& c) {
  Block blk;
  auto base = [&](const std::string& n) { return nn::constant(tp, W.w.at(n)); };
  auto adapter = [&](const std::string& n) { return blk.adapters[n] = nn::param(tp, W.w.at(n)); };
  auto lora = [&](GVar x, const std::string& p, bool bias) {
    GVar a = adapter(p + ".lora_a"), b = adapter(p + ".lora_b");
    return bias ? lora_linear(tp, x, base(p + ".weight"), base(p + ".bias"), a, b, c.lora_scale)
                : lora_linear(tp, x, base(p + ".weight"), a, b, c.lora_scale);
  };
  const DType dt = W.w.at("x").dtype();
  blk.x = nn::input(tp, W.w.at("x"), true);
  RopeVars rp = rope_fill(tp, c.T, c.head_dim, c.theta, 1.0, 0, dt);
  GVar mask = attention_mask_fill(tp, W.keep, dt);
  GVar xn = rmsnorm(tp, blk.x, base("input_layernorm"), c.eps);
  GVar q = lora(xn, "q_proj", true), k = lora(xn, "k_proj", true), v = lora(xn, "v_proj", true);
  GVar ctx = gqa_attention(tp, q, k, v, {.T = c.T, .n_heads = c.n_heads, .n_kv_heads = c.n_kv_heads,
                                         .head_dim = c.head_dim,
                                         .scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim)), .cos = rp.cos,
                                         .sin = rp.sin, .mask = mask});
  GVar h = add(tp, blk.x, lora(ctx, "o_proj", false));
  GVar hn = rmsnorm(tp, h, base("post_attention_layernorm"), c.eps);
  GVar mlp = lora(swiglu(tp, lora(hn, "gate_proj", false), lora(hn, "up_proj", false)), "down_proj", false);
  GVar out = add(tp, h, mlp);
  GVar logits = linear(tp, rmsnorm(tp, out, base("norm"), c.eps), base("lm_head.weight"));
  blk.loss = cross_entropy_rows(tp, logits, nn::constant(tp, W.targets), c.T - 1);
  return blk;
}

BlockWeights to_device(const BlockWeights& h) {
  BlockWeights d;
  for (const auto& [n, t] : h.w) d.w[n] = dev(t);
  d.targets = dev(h.targets);
  d.keep = h.keep;
  return d;
}

}  // namespace

TEST_CASE("GATE on the GPU: Qwen2 block with 14 LoRA adapters matches PyTorch float64, and replays") {
  const nlohmann::json fx = test::fixture("layers/qwen2_block.json");
  const nlohmann::json& cj = fx.at("config");
  auto i = [&](const char* k) { return cj.at(k).get<std::int64_t>(); };
  auto d = [&](const char* k) { return cj.at(k).get<double>(); };
  BlockConfig c{i("B"), i("T"), i("hidden"), i("n_heads"), i("n_kv_heads"), i("head_dim"), i("intermediate"),
                i("vocab"), i("rank"), d("lora_scale"), d("rms_eps"), d("rope_theta")};
  BlockWeights H;
  for (const auto& [name, t] : fx.at("weights").items()) H.w[name] = test::tensor_from_json(t);
  H.targets = Tensor::from<std::int64_t>({c.B, c.T - 1}, fx.at("targets").at("data").get<std::vector<std::int64_t>>());
  std::vector<std::int32_t> keep;
  for (std::int64_t L : cj.at("lengths").get<std::vector<std::int64_t>>())
    for (std::int64_t t = 0; t < c.T; ++t) keep.push_back(t < L ? 1 : 0);
  H.keep = Tensor::from<std::int32_t>({c.B, c.T}, keep);
  BlockWeights D = to_device(H);

  GTape<cuda> tp;
  Block blk = build_block(tp, D, c);
  tp.backward(blk.loss);
  const double want = fx.at("loss").get<double>();
  record("GATE qwen2 block loss vs PyTorch", "float64", std::abs(host(tp.value(blk.loss)).item() - want) / std::abs(want), 1e-12);
  REQUIRE(blk.adapters.size() == 14);
  double worst = 0;
  for (const auto& [name, var] : blk.adapters)
    worst = std::max(worst, test::rel_err(host(tp.grad(var)).to_doubles(),
                                          test::tensor_from_json(fx.at("grads").at(name)).to_doubles()));
  record("GATE qwen2 block worst adapter grad vs PyTorch", "float64", worst, 1e-12);
  record("GATE qwen2 block input grad vs PyTorch", "float64",
         test::rel_err(host(tp.grad(blk.x)).to_doubles(), test::tensor_from_json(fx.at("grads").at("x")).to_doubles()), 1e-12);

  // The eager GPU results, then a CUDA-graph replay of the same tape: bit for bit.
  Tensor loss0 = host(tp.value(blk.loss)), gx0 = host(tp.grad(blk.x));
  std::map<std::string, Tensor> g0;
  for (const auto& [name, var] : blk.adapters) g0[name] = host(tp.grad(var));
  CudaGraphReplay graph(tp);
  for (int r = 0; r < 3; ++r) {
    graph.replay();
    expect_bitwise("GATE qwen2 block graph replay " + std::to_string(r) + " loss == eager", loss0, tp.value(blk.loss));
    expect_bitwise("GATE qwen2 block graph replay " + std::to_string(r) + " x grad == eager", gx0, tp.grad(blk.x));
    bool all = true;
    for (const auto& [name, var] : blk.adapters) all = all && same_bits(g0.at(name), tp.grad(var));
    record("GATE qwen2 block graph replay " + std::to_string(r) + " adapter grads == eager", "float64", all ? 0.0 : INFINITY, 0);
  }
  CHECK(graph.captures() == 1);
}

TEST_CASE("GATE (torch-free) on the GPU: the block on CUDA equals the block on the CPU, float64 and float32") {
  BlockConfig c{2, 6, 16, 4, 2, 4, 24, 40, 2, 2.0, 1e-6, 10000.0};
  for (DType dt : float_dtypes()) {
    BlockWeights H;
    auto rndw = [&](const std::string& n, Shape s, double bound) { H.w[n] = rnd(s, dt, -bound, bound); };
    const std::int64_t qd = c.n_heads * c.head_dim, kd = c.n_kv_heads * c.head_dim;
    H.w["x"] = rnd({c.B, c.T, c.C}, dt, -1.5, 1.5);
    for (const char* n : {"input_layernorm", "post_attention_layernorm", "norm"}) H.w[n] = rnd({c.C}, dt, 0.5, 1.5);
    const std::map<std::string, std::pair<std::int64_t, std::int64_t>> dims = {
        {"q_proj", {c.C, qd}}, {"k_proj", {c.C, kd}}, {"v_proj", {c.C, kd}}, {"o_proj", {qd, c.C}},
        {"gate_proj", {c.C, c.intermediate}}, {"up_proj", {c.C, c.intermediate}}, {"down_proj", {c.intermediate, c.C}}};
    for (const auto& [p, io] : dims) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(io.first));
      rndw(p + ".weight", {io.second, io.first}, bound);
      rndw(p + ".lora_a", {io.first, c.rank}, bound);
      rndw(p + ".lora_b", {c.rank, io.second}, 0.1);
    }
    for (const char* p : {"q_proj", "k_proj", "v_proj"}) rndw(std::string(p) + ".bias", {dims.at(p).second}, 0.1);
    rndw("lm_head.weight", {c.vocab, c.C}, 0.2);
    H.targets = Tensor::from<std::int64_t>({c.B, c.T - 1}, {3, 17, 5, 39, 0, 8, 1, -100, -100, -100});
    H.keep = Tensor::from<std::int32_t>({c.B, c.T}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0});
    BlockWeights D = to_device(H);
    GTape<cpu> tc;
    GTape<cuda> tg;
    Block bc = build_block(tc, H, c), bg = build_block(tg, D, c);
    tc.backward(bc.loss);
    tg.backward(bg.loss);
    // A whole block is ~150 ops: float32 rounding compounds, so its gate is 1e-4 (each op and
    // layer alone is held to 1e-5 above).
    const double tol = dt == DType::f64 ? 1e-12 : 1e-4;
    expect_close("block CUDA vs CPU loss", tc.value(bc.loss), tg.value(bg.loss), tol);
    expect_close("block CUDA vs CPU input grad", tc.grad(bc.x), tg.grad(bg.x), tol);
    for (const char* p : kAdapted)
      for (const char* ab : {".lora_a", ".lora_b"}) {
        const std::string n = std::string(p) + ab;
        expect_close("block CUDA vs CPU grad " + n, tc.grad(bc.adapters.at(n)), tg.grad(bg.adapters.at(n)), tol);
      }
  }
}
