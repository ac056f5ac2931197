// SPDX-License-Identifier: MIT OR Apache-2.0
// The layer library's gate (the seed's): a Qwen2-style decoder block with LoRA on q, k, v, o,
// gate, up, down, a final norm, an LM head and next-token cross-entropy over a padded batch,
// rebuilt from nn's layers and checked against PyTorch float64 (tests/oracle/gen_qwen2_block.py);
// plus a torch-free sanity gate and a replay check.
#include <cmath>

#include "layer_case.hpp"

namespace layers_qwen2_block {  // one unity source with the other layers files: its names stay its own

using namespace nn;

namespace {

const char* const kAdapted[] = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"};

struct BlockConfig {
  std::int64_t B, T, C, n_heads, n_kv_heads, head_dim, intermediate, vocab, rank;
  double lora_scale, eps, theta;
};

/// Everything the block reads, owned by the caller (layers never own weights).
struct BlockWeights {
  std::map<std::string, Tensor> w;  // HF names: "q_proj.weight", "q_proj.lora_a", "norm", "x", ...
  Tensor targets;                   // (B, T - 1) int64, ignore_index where there is no next token
  Tensor keep;                      // (B, T) 1 for a real token, 0 for padding
};

struct Block {
  GVar loss, x;
  std::map<std::string, GVar> adapters;
};

/// The block, as the seed writes it: one layer call per line.
Block build_block(GTape<cpu>& tp, BlockWeights& W, const BlockConfig& c) {
  Block blk;
  auto base = [&](const std::string& n) { return nn::constant(tp, W.w.at(n)); };
  auto adapter = [&](const std::string& n) { return blk.adapters[n] = nn::param(tp, W.w.at(n)); };
  auto lora = [&](GVar x, const std::string& p, bool bias) {
    GVar a = adapter(p + ".lora_a"), b = adapter(p + ".lora_b");
    return bias ? lora_linear(tp, x, base(p + ".weight"), base(p + ".bias"), a, b, c.lora_scale)
                : lora_linear(tp, x, base(p + ".weight"), a, b, c.lora_scale);
  };
  const DType dt = W.w.at("x").dtype();
  blk.x = nn::input(tp, W.w.at("x"), true);  // (B, T, C)
  RopeVars rp = rope_fill(tp, c.T, c.head_dim, c.theta, 1.0, 0, dt);
  GVar mask = attention_mask_fill(tp, W.keep, dt);  // (B, 1, T, T): causal + key padding

  GVar xn = rmsnorm(tp, blk.x, base("input_layernorm"), c.eps);
  GVar q = lora(xn, "q_proj", true);   // (B, T, n_heads * head_dim)
  GVar k = lora(xn, "k_proj", true);   // (B, T, n_kv_heads * head_dim)
  GVar v = lora(xn, "v_proj", true);
  GVar ctx = gqa_attention(tp, q, k, v, {.T = c.T, .n_heads = c.n_heads, .n_kv_heads = c.n_kv_heads,
                                         .head_dim = c.head_dim,
                                         .scale = 1.0 / std::sqrt(static_cast<double>(c.head_dim)), .cos = rp.cos,
                                         .sin = rp.sin, .mask = mask});
  GVar h = add(tp, blk.x, lora(ctx, "o_proj", false));
  GVar hn = rmsnorm(tp, h, base("post_attention_layernorm"), c.eps);
  GVar mlp = lora(swiglu(tp, lora(hn, "gate_proj", false), lora(hn, "up_proj", false)), "down_proj", false);
  GVar out = add(tp, h, mlp);
  GVar logits = linear(tp, rmsnorm(tp, out, base("norm"), c.eps), base("lm_head.weight"));  // (B, T, V)
  blk.loss = cross_entropy_rows(tp, logits, nn::constant(tp, W.targets), c.T - 1);
  return blk;
}

Tensor json_tensor(const nlohmann::json& j) { return test::tensor_from_json(j); }

}  // namespace

TEST_CASE("GATE: Qwen2 block with 14 LoRA adapters matches PyTorch float64") {
  const nlohmann::json fx = test::fixture("layers/qwen2_block.json");
  const nlohmann::json& cj = fx.at("config");
  auto i = [&](const char* k) { return cj.at(k).get<std::int64_t>(); };
  auto d = [&](const char* k) { return cj.at(k).get<double>(); };
  BlockConfig c{i("B"),     i("T"),          i("hidden"),     i("n_heads"), i("n_kv_heads"), i("head_dim"),
                i("intermediate"), i("vocab"), i("rank"), d("lora_scale"), d("rms_eps"), d("rope_theta")};
  BlockWeights W;
  for (const auto& [name, t] : fx.at("weights").items()) W.w[name] = json_tensor(t);
  std::vector<std::int64_t> tg = fx.at("targets").at("data").get<std::vector<std::int64_t>>();
  W.targets = Tensor::from<std::int64_t>({c.B, c.T - 1}, tg);
  std::vector<std::int32_t> keep;
  for (std::int64_t L : cj.at("lengths").get<std::vector<std::int64_t>>())
    for (std::int64_t t = 0; t < c.T; ++t) keep.push_back(t < L ? 1 : 0);
  W.keep = Tensor::from<std::int32_t>({c.B, c.T}, keep);

  GTape<cpu> tp;
  Block blk = build_block(tp, W, c);
  tp.backward(blk.loss);

  const double want = fx.at("loss").get<double>();
  const double loss_err = std::abs(tp.value(blk.loss).item() - want) / std::abs(want);
  double worst_adapter = 0;
  std::string worst_name;
  REQUIRE(blk.adapters.size() == 14);
  for (const auto& [name, var] : blk.adapters) {
    double e = test::rel_err(tp.grad(var).to_doubles(), json_tensor(fx.at("grads").at(name)).to_doubles());
    if (e >= worst_adapter) { worst_adapter = e; worst_name = name; }
    CHECK_MESSAGE(e <= 1e-12, name << " gradient relative error " << e);
  }
  const double x_err = test::rel_err(tp.grad(blk.x).to_doubles(), json_tensor(fx.at("grads").at("x")).to_doubles());
  MESSAGE("GATE qwen2 block vs PyTorch f64: loss " << tp.value(blk.loss).item() << " rel err " << loss_err
                                                   << "; worst adapter grad rel err " << worst_adapter << " (" << worst_name
                                                   << "); input grad rel err " << x_err);
  CHECK(loss_err <= 1e-14);
  CHECK(worst_adapter <= 1e-12);
  CHECK(x_err <= 1e-12);

  // The recorded tape replays to the same numbers (nothing re-recorded).
  const std::size_t nodes = tp.size();
  tp.replay();
  CHECK(tp.size() == nodes);
  CHECK(std::abs(tp.value(blk.loss).item() - want) / std::abs(want) <= 1e-14);
  CHECK(test::rel_err(tp.grad(blk.x).to_doubles(), json_tensor(fx.at("grads").at("x")).to_doubles()) <= 1e-12);
}

TEST_CASE("GATE (torch-free): the block builds, loss ~ ln(vocab) at init, every adapter gradient finite and non-zero") {
  BlockConfig c{2, 6, 16, 4, 2, 4, 24, 40, 2, 2.0, 1e-6, 10000.0};
  for (DType dt : {DType::f64, DType::f32}) {
    BlockWeights W;
    std::uint64_t seed = 500;
    auto rnd = [&](const std::string& n, Shape s, double bound) { W.w[n] = test::random_tensor(s, dt, seed++, -bound, bound); };
    const std::int64_t qd = c.n_heads * c.head_dim, kd = c.n_kv_heads * c.head_dim;
    W.w["x"] = test::random_tensor({c.B, c.T, c.C}, dt, seed++, -1.5, 1.5);
    for (const char* n : {"input_layernorm", "post_attention_layernorm", "norm"}) W.w[n] = Tensor::ones({c.C}, dt);
    const std::map<std::string, std::pair<std::int64_t, std::int64_t>> dims = {
        {"q_proj", {c.C, qd}}, {"k_proj", {c.C, kd}}, {"v_proj", {c.C, kd}}, {"o_proj", {qd, c.C}},
        {"gate_proj", {c.C, c.intermediate}}, {"up_proj", {c.C, c.intermediate}}, {"down_proj", {c.intermediate, c.C}}};
    for (const auto& [p, io] : dims) {
      const double bound = 1.0 / std::sqrt(static_cast<double>(io.first));
      rnd(p + ".weight", {io.second, io.first}, bound);
      rnd(p + ".lora_a", {io.first, c.rank}, bound);
      rnd(p + ".lora_b", {c.rank, io.second}, 0.01);  // small, not zero: every lora_a gradient then lives
    }
    for (const char* p : {"q_proj", "k_proj", "v_proj"}) rnd(std::string(p) + ".bias", {dims.at(p).second}, 0.1);
    rnd("lm_head.weight", {c.vocab, c.C}, 0.02);  // small logits: the loss starts near ln(vocab)
    std::vector<std::int64_t> tg = {3, 17, 5, 39, 0, 8, 1, -100, -100, -100};
    W.targets = Tensor::from<std::int64_t>({c.B, c.T - 1}, tg);
    W.keep = Tensor::from<std::int32_t>({c.B, c.T}, {1, 1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0});

    GTape<cpu> tp;
    Block blk = build_block(tp, W, c);
    tp.backward(blk.loss);
    const double loss = tp.value(blk.loss).item();
    MESSAGE(std::string(dtype_name(dt)) << " torch-free block: loss " << loss << " vs ln(vocab) " << std::log(double(c.vocab)));
    CHECK(std::abs(loss - std::log(static_cast<double>(c.vocab))) < 0.1);
    CHECK(blk.adapters.size() == 14);
    for (const auto& [name, var] : blk.adapters) {
      std::vector<double> g = tp.grad(var).to_doubles();
      bool finite = true, nonzero = false;
      for (double v : g) {
        finite = finite && std::isfinite(v);
        nonzero = nonzero || v != 0.0;
      }
      CHECK_MESSAGE(finite, name);
      CHECK_MESSAGE(nonzero, name);
    }
    std::vector<double> gx = tp.grad(blk.x).to_doubles();
    // padded positions of sequence 1 (t >= 3) are never attended to and have no target
    for (std::int64_t t = 3; t < c.T; ++t)
      for (std::int64_t j = 0; j < c.C; ++j) CHECK(gx[static_cast<std::size_t>((c.T + t) * c.C + j)] == 0.0);
  }
}

}  // namespace layers_qwen2_block
