// SPDX-License-Identifier: MIT OR Apache-2.0
// Gemma 2 (embeddings times sqrt(hidden), (1 + w) RMSNorms, four norms a layer, GeGLU, soft caps
// on attention scores and logits, a sliding window on the even layers): a tiny random
// Gemma2ForCausalLM from transformers (tests/oracle/gen_gemma2.py), logits against transformers in
// float64 with and without the caps and the window, gradients against central differences, a LoRA
// and a DoRA step (compiled equals eager), and the folder save_hf writes read back. KV-cached
// decoding equal to the full forward is checked with the other families in model.test.cpp.
#include <functional>

#include "support/lm_step.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/gguf_export.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_gemma2 {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

Tensor want(const std::string& which = "") {
  return SafetensorsFile(kModels + "/gemma2_expected.safetensors").tensor("gemma2." + which + "logits");
}

Tensor run_logits(const lm::CausalLM& m) { return test::lm_fixture_logits(m); }

}  // namespace

TEST_CASE("Gemma 2: config, the four norms a layer, logits equal transformers' in float64") {
  lm::CausalLM m = lm::load_hf(kModels + "/gemma2", DType::f64);
  const lm::ModelConfig& c = m.config();
  CHECK(c.arch == lm::Arch::gemma2);
  CHECK(c.norm_unit_offset);
  CHECK(c.sandwich_norms);
  CHECK(c.gelu_mlp);
  CHECK(c.tie_word_embeddings);
  CHECK(c.embed_scale == std::sqrt(32.0));
  CHECK(c.attention_scale() == 1.0 / std::sqrt(24.0));
  CHECK(c.attn_logit_softcapping == 2.0);
  CHECK(c.final_logit_softcapping == 3.0);
  CHECK(c.sliding_window == 4);
  CHECK(c.window_on(0));
  CHECK_FALSE(c.window_on(1));
  CHECK(c.window_on(2));
  std::set<std::string> paths;
  for (const auto& [p, t] : m.parameters()) paths.insert(p);
  for (const char* p : {"model.layers.2.pre_feedforward_layernorm.weight", "model.layers.2.post_feedforward_layernorm.weight",
                        "model.layers.2.post_attention_layernorm.weight", "model.layers.2.input_layernorm.weight"})
    CHECK(paths.count(p));
  CHECK_FALSE(paths.count("lm_head.weight"));
  const double err = test::rel_err(run_logits(m), want());
  MESSAGE("gemma2: logits vs transformers (float64), max relative error " << err);
  CHECK(err <= 1e-10);

  // without the soft caps: layer 1 (no window) then runs the fused attention kernel
  lm::ModelConfig nocap = c;
  nocap.attn_logit_softcapping = nocap.final_logit_softcapping = 0;
  const double err_nocap = test::rel_err(run_logits(test::with_config(m, nocap)), want("nocap."));
  MESSAGE("gemma2 without the caps: " << err_nocap);
  CHECK(err_nocap <= 1e-10);
  lm::ModelConfig nowindow = c;
  nowindow.sliding_window = 0;
  CHECK(test::rel_err(run_logits(test::with_config(m, nowindow)), want("nowindow.")) <= 1e-10);
  // and each of them matters
  CHECK(test::rel_err(run_logits(test::with_config(m, nocap)), want()) > 1e-3);
  CHECK(test::rel_err(run_logits(test::with_config(m, nowindow)), want()) > 1e-3);
}

TEST_CASE("Gemma 2: gradients through the caps, the window and the (1 + w) norms equal central differences") {
  lm::CausalLM m = lm::load_hf(kModels + "/gemma2", DType::f64);
  auto [l0, g] = test::lm_batch_loss(m);
  const auto& L0 = m.model.layers[0];
  const auto& G0 = g.model.layers[0];
  const double worst = test::check_lm_central_differences(
      m, {{"layer 0 post_feedforward_layernorm", L0.post_feedforward_layernorm->weight.value, G0.post_feedforward_layernorm->weight.value},
          {"layer 0 post_attention_layernorm", L0.post_attention_layernorm.weight.value, G0.post_attention_layernorm.weight.value},
          {"layer 2 q_proj", std::get<Linear>(m.model.layers[2].self_attn.q_proj).weight.value,
           std::get<Linear>(g.model.layers[2].self_attn.q_proj).weight.value},
          {"layer 1 gate_proj", std::get<Linear>(m.model.layers[1].mlp.gate_proj).weight.value,
           std::get<Linear>(g.model.layers[1].mlp.gate_proj).weight.value},
          {"embedding (tied head)", std::get<Embedding>(m.model.embed_tokens).weight.value,
           std::get<Embedding>(g.model.embed_tokens).weight.value}});
  MESSAGE("gemma2: analytic vs central-difference gradients, worst relative difference " << worst);
}

TEST_CASE("Gemma 2 without a padding mask runs its capped and windowed layers in flash attention, as written out") {
  // no mask tensor: every layer's attention is flash_attention (softcap; window on the even
  // layers); an all-ones padding mask keeps them written out (softcap(q k^T) + the causal and
  // window mask, softmax): the same logits and gradients. T = 150 crosses flash's 128-key tile,
  // and the fixture's window of 4 hides most keys.
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const lm::CausalLM m = lm::load_hf(kModels + "/gemma2", dt);
    CHECK(test::check_flash_equals_written_out(m, 150, dt == DType::f64 ? 1e-12 : 2e-5) ==
          static_cast<int>(m.model.layers.size()));
  }
}

TEST_CASE("Gemma 2: a LoRA and a DoRA step, compiled, equal the eager steps bit for bit") {
  for (bool dora : {false, true}) {
    CAPTURE(dora);
    test::check_adapter_step_compiled_equals_eager(kModels + "/gemma2", dora);
  }
}

TEST_CASE("Gemma 2: anomaly mode names each of a layer's four norms by its path") {
  using L = lm::DecoderLayer;
  const std::vector<std::pair<std::string, std::function<RmsNorm&(L&)>>> norms{
      {"input_layernorm", [](L& l) -> RmsNorm& { return l.input_layernorm; }},
      {"post_attention_layernorm", [](L& l) -> RmsNorm& { return l.post_attention_layernorm; }},
      {"pre_feedforward_layernorm", [](L& l) -> RmsNorm& { return *l.pre_feedforward_layernorm; }},
      {"post_feedforward_layernorm", [](L& l) -> RmsNorm& { return *l.post_feedforward_layernorm; }}};
  for (const auto& [name, norm] : norms) {
    lm::CausalLM m = lm::load_hf(kModels + "/gemma2", DType::f64);  // a fresh copy: Tensors share storage
    norm(m.model.layers[1]).weight.value.data<double>()[0] = INFINITY;
    GTape<cpu> tp;
    tp.detect_anomaly(true);
    test::check_error([&] { m.logits(tp, tp.input(test::lm_fixture_inputs().tensor("ids").to(DType::i64))); },
                      {"[anomaly] ", "in 'model.layers.1." + name + "'", "+Inf"});
  }
}

TEST_CASE("Gemma 2: save_hf writes a folder load_hf reads back to the same logits; GGUF is refused by name") {
  lm::CausalLM m = lm::load_hf(kModels + "/gemma2", DType::f32);
  const Tensor ref = run_logits(m);
  test::TempDir dir("gemma2_out");
  lm::save_hf(dir.path / "hf", m);
  const nlohmann::json cfg = lm::detail::read_json_file(dir.path / "hf" / "config.json", "test");
  CHECK(cfg["model_type"] == "gemma2");
  CHECK(cfg["architectures"][0] == "Gemma2ForCausalLM");
  CHECK(cfg["hidden_activation"] == "gelu_pytorch_tanh");
  CHECK(cfg["query_pre_attn_scalar"] == 24.0);
  CHECK(cfg["attn_logit_softcapping"] == 2.0);
  CHECK(cfg["final_logit_softcapping"] == 3.0);
  CHECK(cfg["sliding_window"] == 4);
  CHECK(test::rel_err(run_logits(lm::load_hf(dir.path / "hf", DType::f32)), ref) == 0.0);
  test::check_error([&] { lm::save_gguf(dir.path / "m.gguf", m, lm::GgufWriter(), "f32", nullptr); },
                    {"[gguf]", "m.gguf", "Gemma 2", "save_hf"});
  CHECK_FALSE(std::filesystem::exists(dir.path / "m.gguf"));
}

TEST_CASE("Gemma 2: configs nn cannot run are refused by name") {
  nlohmann::json j = lm::detail::read_json_file(kModels + "/gemma2/config.json", "test");
  j["hidden_activation"] = "gelu";
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "c.json", "hidden_activation", "gelu"});
  j["hidden_activation"] = "gelu_pytorch_tanh";
  j["layer_types"] = {"full_attention", "sliding_attention", "full_attention"};  // not Gemma 2's alternation
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "layer_types", "[0]"});
  j["layer_types"] = {"sliding_attention", "full_attention", "sliding_attention"};
  CHECK(lm::config_from_json(j, "c.json").window_on(2));
  j["query_pre_attn_scalar"] = 0;
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "query_pre_attn_scalar"});
}

}  // namespace lm_gemma2
