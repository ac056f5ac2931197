// SPDX-License-Identifier: MIT OR Apache-2.0
// Gemma 3's text models (model_type "gemma3_text": Gemma 2's layer with (1 + w) q/k head norms,
// layer kinds from layer_types, and the sliding layers' own RoPE base): a tiny random
// Gemma3ForCausalLM from transformers 4.57 (tests/oracle/gen_layer_types.py), logits against
// transformers in float64 with and without the window, gradients against central differences, the
// windowed layers in flash attention equal to them written out, a LoRA and a DoRA step (compiled
// equals eager), the folder save_hf writes read back, and the config forms of transformers 4.50
// (sliding_window_pattern) and 5 (rope_parameters per layer kind). KV-cached decoding and packed
// rows are checked with the other families (model.test.cpp, packing.test.cpp).
#include "support/lm_step.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/gguf_export.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_gemma3 {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

Tensor want(const std::string& which = "") {
  return SafetensorsFile(kModels + "/gemma3_expected.safetensors").tensor("gemma3." + which + "logits");
}

Tensor run_logits(const lm::CausalLM& m) { return test::lm_fixture_logits(m); }

nlohmann::json fixture_config() { return lm::detail::read_json_file(kModels + "/gemma3/config.json", "test"); }

}  // namespace

TEST_CASE("Gemma 3: config, q/k head norms, two RoPE tables, logits equal transformers' in float64") {
  lm::CausalLM m = lm::load_hf(kModels + "/gemma3", DType::f64);
  const lm::ModelConfig& c = m.config();
  CHECK(c.arch == lm::Arch::gemma3);
  CHECK(c.model_type == "gemma3_text");
  CHECK(c.norm_unit_offset);
  CHECK(c.sandwich_norms);
  CHECK(c.gelu_mlp);
  CHECK(c.qk_norm);
  CHECK(c.tie_word_embeddings);
  CHECK(c.embed_scale == std::sqrt(32.0));
  CHECK(c.attention_scale() == 1.0 / std::sqrt(24.0));
  CHECK(c.attn_logit_softcapping == 0);
  CHECK(c.final_logit_softcapping == 0);
  CHECK(c.sliding_window == 4);
  CHECK(c.rope_local_base_freq == 100.0);
  CHECK(c.rope_scaling.type == "linear");
  for (std::int64_t l : {0, 1, 3}) {
    CHECK(c.window_on(l));
    CHECK(c.local_rope(l));
  }
  CHECK_FALSE(c.window_on(2));
  CHECK_FALSE(c.local_rope(2));
  // the local table is plain RoPE of base 100; the global one rope_theta's divided by the factor
  CHECK(c.inv_freq(true)[1] == 1.0 / std::pow(100.0, 2.0 / 16));
  CHECK(c.inv_freq(false)[1] == 1.0 / std::pow(10000.0, 2.0 / 16) / 4);
  std::set<std::string> paths;
  for (const auto& [p, t] : m.parameters()) paths.insert(p);
  for (const char* p : {"model.layers.3.self_attn.q_norm.weight", "model.layers.3.self_attn.k_norm.weight",
                        "model.layers.3.pre_feedforward_layernorm.weight", "model.layers.3.post_feedforward_layernorm.weight"})
    CHECK(paths.count(p));
  CHECK_FALSE(paths.count("lm_head.weight"));
  const double err = test::rel_err(run_logits(m), want());
  MESSAGE("gemma3: logits vs transformers (float64), max relative error " << err);
  CHECK(err <= 1e-10);

  lm::ModelConfig nowindow = c;  // the window hides no key of 7; the sliding layers keep their RoPE
  nowindow.sliding_window = 64;
  CHECK(test::rel_err(run_logits(test::with_config(m, nowindow)), want("nowindow.")) <= 1e-10);
  // controls: the window, the local RoPE and the q/k norms each move the logits
  CHECK(test::rel_err(run_logits(test::with_config(m, nowindow)), want()) > 1e-3);
  lm::ModelConfig one_rope = c;
  one_rope.rope_local_base_freq = 0;
  CHECK(test::rel_err(run_logits(test::with_config(m, one_rope)), want()) > 1e-3);
  lm::CausalLM no_qk = lm::load_hf(kModels + "/gemma3", DType::f64);
  for (lm::DecoderLayer& l : no_qk.model.layers) l.self_attn.q_norm.reset();
  CHECK(test::rel_err(run_logits(no_qk), want()) > 1e-3);
}

TEST_CASE("Gemma 3: gradients through the q/k norms, both RoPE tables and the window equal central differences") {
  lm::CausalLM m = lm::load_hf(kModels + "/gemma3", DType::f64);
  auto [l0, g] = test::lm_batch_loss(m);
  auto lin = [](lm::CausalLM& x, std::size_t l, bool q) -> Tensor& {
    auto& a = x.model.layers[l].self_attn;
    return std::get<Linear>(q ? a.q_proj : a.k_proj).weight.value;
  };
  const double worst = test::check_lm_central_differences(
      m, {{"layer 1 q_norm", m.model.layers[1].self_attn.q_norm->weight.value, g.model.layers[1].self_attn.q_norm->weight.value},
          {"layer 2 k_norm", m.model.layers[2].self_attn.k_norm->weight.value, g.model.layers[2].self_attn.k_norm->weight.value},
          {"layer 2 (global) q_proj", lin(m, 2, true), lin(g, 2, true)},
          {"layer 3 (sliding) k_proj", lin(m, 3, false), lin(g, 3, false)},
          // rows of tokens the batch holds (the others' gradients, through the tied head's peaked
          // softmax, are 1e-8 and below: no relative check)
          {"embedding (tied head)", std::get<Embedding>(m.model.embed_tokens).weight.value,
           std::get<Embedding>(g.model.embed_tokens).weight.value, {1 * 32 + 3, 19 * 32 + 7}}});
  MESSAGE("gemma3: analytic vs central-difference gradients, worst relative difference " << worst);
}

TEST_CASE("Gemma 3 without a padding mask runs its sliding layers in flash attention, as written out") {
  // T = 150 crosses flash's 128-key tile; the window of 4 hides most keys. The three sliding
  // layers run flash_attention's window; the global layer the causal kernel.
  for (DType dt : {DType::f64, DType::f32}) {
    CAPTURE(dtype_name(dt));
    const lm::CausalLM m = lm::load_hf(kModels + "/gemma3", dt);
    CHECK(test::check_flash_equals_written_out(m, 150, dt == DType::f64 ? 1e-12 : 2e-5) >= 3);
  }
}

TEST_CASE("Gemma 3: a LoRA and a DoRA step, compiled, equal the eager steps bit for bit") {
  for (bool dora : {false, true}) {
    CAPTURE(dora);
    test::check_adapter_step_compiled_equals_eager(kModels + "/gemma3", dora);
  }
}

TEST_CASE("Gemma 3: save_hf writes a folder load_hf reads back to the same logits; GGUF is refused by name") {
  lm::CausalLM m = lm::load_hf(kModels + "/gemma3", DType::f32);
  const Tensor ref = run_logits(m);
  test::TempDir dir("gemma3_out");
  lm::save_hf(dir.path / "hf", m);
  const nlohmann::json cfg = lm::detail::read_json_file(dir.path / "hf" / "config.json", "test");
  CHECK(cfg["model_type"] == "gemma3_text");
  CHECK(cfg["architectures"][0] == "Gemma3ForCausalLM");
  CHECK(cfg["hidden_activation"] == "gelu_pytorch_tanh");
  CHECK(cfg["query_pre_attn_scalar"] == 24.0);
  CHECK(cfg["attn_logit_softcapping"].is_null());
  CHECK(cfg["sliding_window"] == 4);
  CHECK(cfg["layer_types"] == fixture_config()["layer_types"]);
  CHECK(cfg["sliding_window_pattern"] == 3);  // for transformers 4.50-4.52
  CHECK(cfg["rope_local_base_freq"] == 100.0);
  CHECK(cfg["rope_scaling"]["factor"] == 4.0);
  CHECK(test::rel_err(run_logits(lm::load_hf(dir.path / "hf", DType::f32)), ref) == 0.0);
  test::check_error([&] { lm::save_gguf(dir.path / "m.gguf", m, lm::GgufWriter(), "f32", nullptr); },
                    {"[gguf]", "m.gguf", "Gemma 3", "save_hf"});
  CHECK_FALSE(std::filesystem::exists(dir.path / "m.gguf"));
}

TEST_CASE("Gemma 3: transformers 4.50's and 5's config forms read as the same model; others are refused by name") {
  const lm::ModelConfig want_c = lm::config_from_json(fixture_config(), "c.json");
  auto same_layers = [&](const lm::ModelConfig& c) {
    CHECK(c.sliding_layers == want_c.sliding_layers);
    CHECK(c.rope_local_base_freq == want_c.rope_local_base_freq);
    CHECK(c.inv_freq(false) == want_c.inv_freq(false));
    CHECK(c.inv_freq(true) == want_c.inv_freq(true));
  };
  // 4.50-4.52: sliding_window_pattern, no layer_types
  nlohmann::json j = fixture_config();
  j.erase("layer_types");
  j.erase("_sliding_window_pattern");
  j["sliding_window_pattern"] = 3;
  same_layers(lm::config_from_json(j, "c.json"));
  j.erase("sliding_window_pattern");  // Gemma3TextConfig's default: every sixth layer global
  const lm::ModelConfig six = lm::config_from_json(j, "c.json");
  CHECK(six.sliding_layers == std::vector<bool>{true, true, true, true});
  // 5: rope_parameters keyed by layer kind, no rope_theta / rope_local_base_freq / rope_scaling
  j = fixture_config();
  for (const char* k : {"rope_theta", "rope_local_base_freq", "rope_scaling"}) j.erase(k);
  j["rope_parameters"] = {{"sliding_attention", {{"rope_type", "default"}, {"rope_theta", 100.0}}},
                          {"full_attention", {{"rope_type", "linear"}, {"factor", 4.0}, {"rope_theta", 10000.0}}}};
  same_layers(lm::config_from_json(j, "c.json"));
  j["rope_parameters"]["sliding_attention"]["rope_type"] = "linear";
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "rope_parameters.sliding_attention.rope_type"});
  j["rope_parameters"]["sliding_attention"]["rope_type"] = "default";
  j["rope_parameters"]["sliding_attention"]["rope_theta"] = 0.0;  // refused, not read as "no local RoPE"
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "rope_local_base_freq"});
  j["rope_parameters"]["sliding_attention"]["rope_theta"] = 100.0;
  j["rope_parameters"]["full_attention"]["rope_type"] = "yarn";
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "rope_parameters.full_attention", "yarn"});

  j = fixture_config();
  j["layer_types"] = {"sliding_attention", "full_attention"};
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "layer_types", "2 layers", "4"});
  j["layer_types"] = {"sliding_attention", "full_attention", "chunked_attention", "full_attention"};
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "layer_types", "[2]", "chunked_attention"});
  j = fixture_config();
  j["use_bidirectional_attention"] = true;  // EmbeddingGemma
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "use_bidirectional_attention"});
  j = fixture_config();
  j["model_type"] = "gemma3";  // the image-text model's config
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "\"gemma3\"", "Gemma3ForConditionalGeneration", "gemma3_text"});
}

}  // namespace lm_gemma3
