// SPDX-License-Identifier: MIT OR Apache-2.0
// DoRA (include/nn/modules/dora.hpp, nn::dora_factor in layers/linear.hpp): logits and the
// adapters' gradients against PEFT (use_dora, float64) and mlx-lm (DoRALinear, float32, also over
// a 4-bit base), PEFT's and mlx-lm's own adapter folders loaded, both formats written and read
// back, the fused layer, and the layer at its initial values (tests/oracle/gen_dora.py).
#include <cmath>
#include <string>

#include "support/check.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/adapters.hpp>
#include <nn/lm/load.hpp>

namespace lm_dora {  // one unity source with the other lm files: its names stay its own

using namespace nn;
namespace fs = std::filesystem;

namespace {

const std::string kDir = std::string(NN_FIXTURES_DIR) + "/lm/dora";
const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

const SafetensorsFile& expected() {
  static const SafetensorsFile f(kDir + "/expected.safetensors");
  return f;
}

struct Case {
  std::string name, folder;
  std::vector<std::string> keys;
  double scale;
  int last;
};
const Case kLlama{"llama", kModels + "/llama", {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"}, 2.0, 2};
const Case kQwen2{"qwen2", kModels + "/qwen2", {"self_attn.q_proj", "self_attn.k_proj", "self_attn.o_proj", "mlp.up_proj"}, 0.5, 1};
const Case kQ4{"llama_q4", std::string(NN_FIXTURES_DIR) + "/lm/mlx_quantized/llama_q4",
               {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"}, 2.0, 2};

lm::LoraConfig config_of(const Case& c) {
  lm::LoraConfig cfg;
  cfg.dora = true;
  cfg.rank = 4;
  cfg.scale = c.scale;
  cfg.num_layers = c.last;
  cfg.keys = c.keys;
  return cfg;
}

/// The case's model with DoRA applied and the fixture's adapter values loaded.
lm::CausalLM adapted(const Case& c, DType dt) {
  lm::CausalLM m = lm::load_hf(c.folder, dt);
  m.freeze();
  CHECK(lm::apply_lora(m, config_of(c)) == c.last * static_cast<int>(c.keys.size()));
  NamedTensors w;
  for (const auto& [p, t] : m.trainable_parameters()) w.emplace_back(p, expected().tensor(c.name + "." + p).to(t.dtype()));
  m.load_weights_partial(w);
  return m;
}

struct Result {
  Tensor logits;  // (2, 7, V) f64
  NamedTensors grads;
};
/// Logits and the gradients of the mean cross-entropy against the fixture's targets.
Result run(lm::CausalLM& m, const Case& c) {
  const Tensor ids = expected().tensor(c.name + ".ids").to(DType::i64);
  const Tensor targets = expected().tensor(c.name + ".targets").to(DType::i64);
  Tensor logits;
  auto [loss, g] = value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
    GVar lg = mm.logits(tp, tp.input(ids));
    logits = tp.value(lg).to(DType::f64);
    return cross_entropy(tp, lg, tp.constant(targets));
  });
  CHECK(std::isfinite(loss.item()));
  return {logits, g.trainable_parameters()};
}

/// The largest error of `r` against tool's recorded logits and gradients (each relative to the
/// largest magnitude of the reference).
std::pair<double, double> errors(const Result& r, const std::string& tool, const Case& c) {
  const std::string pre = tool + "_" + c.name;
  const double lerr = test::rel_err(r.logits, expected().tensor(pre + ".logits").to(DType::f64));
  double gerr = 0;
  for (const auto& [p, g] : r.grads) gerr = std::max(gerr, test::rel_err(g.to(DType::f64), expected().tensor(pre + ".grad." + p).to(DType::f64)));
  return {lerr, gerr};
}

}  // namespace

TEST_CASE("DoRA matches PEFT's use_dora in float64: logits and the gradients of lora_a, lora_b, m") {
  for (const Case& c : {kLlama, kQwen2}) {
    CAPTURE(c.name);
    lm::CausalLM m = adapted(c, DType::f64);
    const Result r = run(m, c);
    CHECK(r.grads.size() == 3 * c.keys.size() * static_cast<std::size_t>(c.last));
    const auto [lerr, gerr] = errors(r, "peft", c);
    CHECK(lerr <= 1e-10);
    CHECK(gerr <= 1e-10);
  }
}

TEST_CASE("DoRA matches mlx-lm's DoRALinear in float32, over float and 4-bit quantized bases") {
  for (const Case& c : {kLlama, kQwen2, kQ4}) {
    CAPTURE(c.name);
    lm::CausalLM m = adapted(c, DType::f32);
    if (c.name == "llama_q4") CHECK(std::holds_alternative<QuantizedLinear>(std::get<DoraLinear>(m.model.layers[0].self_attn.q_proj).base));
    const auto [lerr, gerr] = errors(run(m, c), "mlx", c);
    CHECK(lerr <= 1e-5);
    CHECK(gerr <= 1e-4);
  }
}

TEST_CASE("DoRA adapter folders: PEFT's and mlx-lm's own load; ours are written as they write them and read back") {
  SUBCASE("PEFT's save_pretrained (lora_magnitude_vector, use_dora: true)") {
    lm::CausalLM m = lm::load_hf(kLlama.folder, DType::f64);
    m.freeze();
    const lm::LoraConfig cfg = lm::load_peft_adapters(kDir + "/peft_llama", m);
    CHECK(cfg.dora);
    CHECK(cfg.scale == 2.0);
    CHECK(errors(run(m, kLlama), "peft", kLlama).first <= 1e-10);
  }
  SUBCASE("mlx-lm's adapter folder over the 4-bit base (fine_tune_type: dora, .m)") {
    lm::CausalLM m = lm::load_hf(kQ4.folder);
    m.freeze();
    const lm::LoraConfig cfg = lm::load_mlx_adapters(kDir + "/mlx_llama_q4", m);
    CHECK(cfg.dora);
    CHECK(errors(run(m, kQ4), "mlx", kQ4).first <= 1e-5);
  }
  SUBCASE("written in both formats, read back to the same logits") {
    lm::CausalLM m = adapted(kQwen2, DType::f64);
    const Tensor want = run(m, kQwen2).logits;
    test::TempDir dir("dora_adapters");
    lm::save_mlx_adapters(dir.path / "mlx", m, config_of(kQwen2));
    lm::save_peft_adapters(dir.path / "peft", m, config_of(kQwen2));
    const nlohmann::json mc = lm::detail::read_json(dir.path / "mlx" / "adapter_config.json");
    CHECK(mc["fine_tune_type"] == "dora");
    CHECK(lm::detail::read_json(dir.path / "peft" / "adapter_config.json")["use_dora"] == true);
    const NamedTensors peft = load_safetensors(dir.path / "peft" / "adapter_model.safetensors");
    CHECK(std::count_if(peft.begin(), peft.end(), [](const auto& e) { return e.first.ends_with(".lora_magnitude_vector"); }) == 4);
    for (const char* fmt : {"mlx", "peft"}) {
      CAPTURE(fmt);
      lm::CausalLM back = lm::load_hf(kQwen2.folder, DType::f64);
      back.freeze();
      const lm::LoraConfig cfg = std::string(fmt) == "mlx" ? lm::load_mlx_adapters(dir.path / fmt, back)
                                                           : lm::load_peft_adapters(dir.path / fmt, back);
      CHECK(cfg.dora);
      CHECK(test::rel_err(run(back, kQwen2).logits, want) == 0.0);
    }
  }
  SUBCASE("a DoRA magnitude in a PEFT folder without use_dora is an error naming the tensor") {
    test::TempDir dir("dora_peft_bad");
    fs::copy(kDir + "/peft_llama", dir.path / "p");
    nlohmann::json c = lm::detail::read_json(dir.path / "p" / "adapter_config.json");
    c["use_dora"] = false;
    lm::detail::write_text(dir.path / "p" / "adapter_config.json", c.dump());
    lm::CausalLM m = lm::load_hf(kLlama.folder, DType::f64);
    test::check_error([&] { lm::load_peft_adapters(dir.path / "p", m); },
                      {"[adapters]", "lora_magnitude_vector", "is a DoRA magnitude", "use_dora"});
  }
}

TEST_CASE("DoraLinear: starts equal to its base with m = the rows' norms; fused() equals the layer") {
  random::seed(3);
  const Tensor x = test::random_tensor({2, 5, 64}, DType::f64, 11);
  auto out = [&](const auto& layer, DType dt) {
    GTape<cpu> tp;
    return tp.value(layer(tp, tp.constant(x.to(dt)))).to(DType::f64);
  };
  for (bool bias : {false, true}) {
    CAPTURE(bias);
    Linear base(64, 10);
    base.to(DType::f64);
    if (!bias) base.without_bias();
    DoraLinear d = DoraLinear::from_base(base, 3).scale(1.5);
    CHECK(d.m.value.shape() == Shape{10});
    CHECK_FALSE(std::get<Linear>(d.base).weight.trainable);
    const std::vector<double> w = base.weight.value.to_doubles(), m0 = d.m.value.to_doubles();
    for (int i = 0; i < 10; ++i) {
      double n2 = 0;
      for (int j = 0; j < 64; ++j) n2 += w[i * 64 + j] * w[i * 64 + j];
      CHECK(m0[i] == doctest::Approx(std::sqrt(n2)).epsilon(1e-15));
    }
    CHECK(test::rel_err(out(d, DType::f64), out(base, DType::f64)) <= 1e-15);
    // moved adapters: the merged weight W' scaled to row norms m computes the same layer
    d.lora_b = Param(test::random_tensor({3, 10}, DType::f64, 5, -0.5, 0.5));
    d.m = Param(test::random_tensor({10}, DType::f64, 6, 0.5, 2.0));
    const Linear f = d.fused();
    CHECK(f.bias.has_value() == bias);
    CHECK(f.weight.trainable);
    CHECK(test::rel_err(out(f, DType::f64), out(d, DType::f64)) <= 1e-13);
    CHECK(test::rel_err(out(f, DType::f64), out(base, DType::f64)) > 0.1);
  }
  SUBCASE("over a 4-bit base: m from the dequantized weight, fused() dequantizes and merges") {
    const QuantizedLinear q = QuantizedLinear::from_linear(Linear(64, 10));
    DoraLinear d = DoraLinear::from_base(q, 3).scale(2.0);
    const Linear dq = q.dequantized();
    CHECK(test::rel_err(out(d, DType::f32), out(dq, DType::f32)) <= 1e-6);
    d.lora_b = Param(test::random_tensor({3, 10}, DType::f32, 5, -0.5, 0.5));
    d.m = Param(test::random_tensor({10}, DType::f32, 6, 0.5, 2.0));
    CHECK(test::rel_err(out(d.fused(), DType::f32), out(d, DType::f32)) <= 1e-5);
    const QuantizedLinear again = d.fused_quantized();
    CHECK(again.quant().bits == 4);
  }
}

TEST_CASE("DoraLinear over a bfloat16 base (set_precision): the products read it as bf16, the adapters get gradients") {
  random::seed(4);
  Linear base(64, 16);
  DoraLinear d = DoraLinear::from_base(base, 4).scale(2.0);
  d.lora_b = Param(test::random_tensor({4, 16}, DType::f32, 7, -0.5, 0.5));
  d.m = Param(test::random_tensor({16}, DType::f32, 8, 0.5, 2.0));
  const Tensor x = test::random_tensor({3, 64}, DType::f32, 9);
  auto out = [&](const DoraLinear& l) {
    GTape<cpu> tp;
    return tp.value(l(tp, tp.constant(x))).clone();
  };
  const Tensor f32 = out(d);
  DoraLinear h = d;
  CHECK(set_precision(h, Precision::bf16) == 1);
  CHECK(std::get<Linear>(h.base).weight.dtype() == DType::bf16);
  const Tensor bf = out(h);
  CHECK(test::rel_err(bf, f32) <= 2e-2);  // bf16 rounding of W and of x in the product
  CHECK(test::rel_err(bf, f32) > 0.0);
  // gradients reach lora_a, lora_b and m through the bf16 base
  auto [l, g] = value_and_grad(h, [&](GTape<cpu>& tp, const DoraLinear& m) { return sum(tp, m(tp, tp.constant(x))); });
  CHECK(std::isfinite(l.item()));
  for (const auto& [p, t] : g.trainable_parameters()) {
    CAPTURE(p);
    double n = 0;
    for (double v : t.to_doubles()) n += v * v;
    CHECK(n > 0);
  }
}

}  // namespace lm_dora
