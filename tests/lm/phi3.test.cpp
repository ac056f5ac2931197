// SPDX-License-Identifier: MIT OR Apache-2.0
// Phi-3 (q/k/v stored as one qkv_proj, gate/up as one gate_up_proj, a sliding window): a tiny
// random Phi3ForCausalLM from transformers (tests/oracle/gen_phi3.py) loaded from its HF folder
// and from a GGUF laid out as llama.cpp's phi3, logits against transformers in float64; the model
// holds the split projections (detail::fused_projections), so a LoRA and a DoRA step run as in
// the other families (compiled equals eager); save_hf / save_gguf join them again. The window:
// the batched forward and decode mask as transformers does (checked on a one-layer model
// against the window run on its own).
// KV-cached decoding equal to the full forward is checked with the other families in
// model.test.cpp.
#include "support/lm_step.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/gguf_export.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_phi3 {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

Tensor want() { return SafetensorsFile(kModels + "/phi3_expected.safetensors").tensor("phi3.logits"); }

Tensor run_logits(const lm::CausalLM& m) { return test::lm_fixture_logits(m); }

std::set<std::string> names(const NamedTensors& t) {
  std::set<std::string> s;
  for (const auto& [n, v] : t) s.insert(n);
  return s;
}

}  // namespace

TEST_CASE("Phi-3: config, the fused projections split into the model's, logits equal transformers' in float64") {
  lm::CausalLM m = lm::load_hf(kModels + "/phi3", DType::f64);
  const lm::ModelConfig& c = m.config();
  CHECK(c.arch == lm::Arch::phi3);
  CHECK(c.sliding_window == 2047);
  CHECK_FALSE(c.qkv_bias);
  CHECK_FALSE(c.tie_word_embeddings);
  const std::set<std::string> paths = names(m.parameters());
  for (const char* p : {"model.layers.1.self_attn.q_proj.weight", "model.layers.1.self_attn.k_proj.weight",
                        "model.layers.1.self_attn.v_proj.weight", "model.layers.1.mlp.gate_proj.weight",
                        "model.layers.1.mlp.up_proj.weight"})
    CHECK(paths.count(p));
  CHECK_FALSE(paths.count("model.layers.0.self_attn.qkv_proj.weight"));
  // q, k, v are the fused matrix's rows in that order: k's first row is row q_dim of qkv_proj
  const Tensor qkv = SafetensorsFile(kModels + "/phi3/model.safetensors").tensor("model.layers.0.self_attn.qkv_proj.weight");
  const Tensor k = std::get<Linear>(m.model.layers[0].self_attn.k_proj).weight.value;
  CHECK(k.item(0) == static_cast<double>(static_cast<float>(qkv.item(c.q_dim() * c.hidden_size))));
  const double err = test::rel_err(run_logits(m), want());
  MESSAGE("phi3: logits vs transformers (float64), max relative error " << err);
  CHECK(err <= 1e-10);
  // gate and up in the MLP's order matter: swapped, the logits move
  lm::CausalLM swapped = m;
  for (auto& l : swapped.model.layers) std::swap(l.mlp.gate_proj, l.mlp.up_proj);
  CHECK(test::rel_err(run_logits(swapped), want()) > 1e-3);
}

TEST_CASE("Phi-3: the GGUF (llama.cpp's attn_qkv, ffn_up holding gate and up) gives the same logits") {
  const lm::GgufFile f(kModels + "/gguf/phi3-F32.gguf");
  lm::CausalLM m = lm::load_gguf(f, DType::f64);
  CHECK(m.config().arch == lm::Arch::phi3);
  CHECK(m.config().sliding_window == 2047);
  CHECK(test::rel_err(run_logits(m), want()) <= 1e-10);
  // kept quantized: a Q8_0 copy's fused matrices split by whole rows (codes, scales, biases)
  lm::CausalLM f32 = lm::load_gguf(f, DType::f32);
  test::TempDir dir("phi3_q8");
  lm::save_gguf(dir.path / "q8.gguf", f32, f, "q8_0");
  const lm::GgufFile q8(dir.path / "q8.gguf");
  CHECK(q8.find_tensor("blk.0.attn_qkv.weight")->type_name() == std::string("Q8_0"));
  lm::CausalLM kept = lm::load_gguf(q8, DType::f32, true), dequantized = lm::load_gguf(q8, DType::f32);
  CHECK(std::holds_alternative<QuantizedLinear>(kept.model.layers[1].self_attn.v_proj));
  CHECK(std::holds_alternative<QuantizedLinear>(kept.model.layers[1].mlp.up_proj));
  const double qerr = test::rel_err(run_logits(kept), run_logits(dequantized));
  MESSAGE("phi3 Q8_0: kept quantized vs dequantized logits " << qerr);
  CHECK(qerr <= 1e-5);
  CHECK(test::rel_err(run_logits(dequantized), want()) < 0.05);  // Q8_0 stays close to the float model
}

TEST_CASE("Phi-3: a LoRA and a DoRA step, compiled, equal the eager steps bit for bit") {
  for (bool dora : {false, true}) {
    CAPTURE(dora);
    test::check_adapter_step_compiled_equals_eager(kModels + "/phi3", dora);
  }
}

TEST_CASE("Phi-3: save_hf and save_gguf join the projections again, and read back to the same logits") {
  lm::CausalLM m = lm::load_hf(kModels + "/phi3", DType::f32);
  const Tensor ref = run_logits(m);
  test::TempDir dir("phi3_out");
  lm::save_hf(dir.path / "hf", m);
  const nlohmann::json cfg = lm::detail::read_json_file(dir.path / "hf" / "config.json", "test");
  CHECK(cfg["model_type"] == "phi3");
  CHECK(cfg["architectures"][0] == "Phi3ForCausalLM");
  CHECK(cfg["sliding_window"] == 2047);
  CHECK_FALSE(cfg.contains("attention_bias"));
  // the same tensors, bit for bit, as transformers saved them
  const NamedTensors saved = load_safetensors(dir.path / "hf" / "model.safetensors"),
                     orig = load_safetensors(kModels + "/phi3/model.safetensors");
  CHECK(names(saved) == names(orig));
  for (const auto& [n, t] : orig) {
    CAPTURE(n);
    const auto it = std::find_if(saved.begin(), saved.end(), [&](const auto& e) { return e.first == n; });
    REQUIRE(it != saved.end());
    CHECK(it->second.shape() == t.shape());
    CHECK(it->second.to_doubles() == t.to_doubles());
  }
  CHECK(test::rel_err(run_logits(lm::load_hf(dir.path / "hf", DType::f32)), ref) == 0.0);
  lm::save_gguf(dir.path / "m.gguf", m, lm::GgufFile(kModels + "/gguf/phi3-F32.gguf"), "f32");
  const lm::GgufFile g(dir.path / "m.gguf");
  CHECK(g.at("general.architecture").as_string() == "phi3");
  CHECK(g.find_tensor("blk.0.attn_qkv.weight") != nullptr);
  CHECK(g.find_tensor("blk.0.ffn_up.weight")->shape() == std::vector<std::int64_t>{96, 32});
  CHECK(g.find_tensor("blk.0.attn_q.weight") == nullptr);
  CHECK(g.find_tensor("blk.0.ffn_gate.weight") == nullptr);
  CHECK(test::rel_err(run_logits(lm::load_gguf(g, DType::f32)), ref) == 0.0);
  // llama.cpp's phi3 adapters name attn_qkv / ffn_up, which nn's split LoRA layers are not
  lm::CausalLM lora = m;
  test::make_lora<Linear>(lora);
  test::check_error([&] { lm::save_gguf_adapter(dir.path / "a.gguf", lora, lm::LoraConfig{}, lora.config()); },
                    {"[gguf]", "a.gguf", "attn_qkv", "--fuse"});
  CHECK_FALSE(std::filesystem::exists(dir.path / "a.gguf"));
}

TEST_CASE("Phi-3: the sliding window: the batched forward and decode see the keys transformers' mask keeps") {
  const lm::CausalLM full = lm::load_hf(kModels + "/phi3", DType::f64);
  // one layer of it, so that a query's logits depend only on the keys it sees
  lm::ModelConfig c = full.config();
  c.num_hidden_layers = 1;
  c.sliding_window = 3;
  lm::CausalLM one(c, DType::f64);
  one.model.embed_tokens = full.model.embed_tokens;
  one.model.layers[0] = full.model.layers[0];
  one.model.norm = full.model.norm;
  one.lm_head = full.lm_head;
  lm::ModelConfig c0 = c;
  c0.sliding_window = 0;
  lm::CausalLM unwindowed(c0, DType::f64);
  unwindowed.model = one.model;
  unwindowed.lm_head = one.lm_head;

  const Tensor ids = test::lm_fixture_inputs().tensor("ids").to(DType::i64);  // row 0: 7 real tokens
  std::vector<std::int64_t> row;
  for (std::int64_t t = 0; t < 7; ++t) row.push_back(static_cast<std::int64_t>(ids.item(t)));
  // the batched forward (flash attention's window: no mask tensor) and decode (attention written
  // out under the window mask), token by token: position i sees i-2 .. i. RoPE depends on
  // offsets only, so position i equals the last position of the 3 tokens ending at i run on
  // their own.
  GTape<cpu> tp;
  const std::vector<double> batched =
      tp.value(one.logits(tp, tp.input(Tensor::from<std::int64_t>({1, 7}, row)))).to_doubles();
  lm::KVCache cache;
  double worst = 0, control = 0;
  for (std::int64_t i = 0; i < 7; ++i) {
    const Tensor got = one.decode(Tensor::from<std::int64_t>({1, 1}, {row[static_cast<std::size_t>(i)]}), cache);
    const std::vector<double> at_i(batched.begin() + i * 64, batched.begin() + (i + 1) * 64);
    worst = std::max(worst, test::rel_err(at_i, got.to_doubles()));
    const std::int64_t from = std::max<std::int64_t>(0, i - 2);
    std::vector<std::int64_t> win(row.begin() + from, row.begin() + i + 1);
    lm::KVCache fresh;
    const Tensor all = unwindowed.decode(Tensor::from<std::int64_t>({1, i + 1 - from}, win), fresh);
    std::vector<double> last = all.to_doubles();
    last.erase(last.begin(), last.end() - 64);
    worst = std::max(worst, test::rel_err(got.to_doubles(), last));
    if (i == 6) {  // without the window the last query sees all 7 tokens
      lm::KVCache plain;
      const Tensor seven = unwindowed.decode(Tensor::from<std::int64_t>({1, 7}, row), plain);
      std::vector<double> s = seven.to_doubles();
      s.erase(s.begin(), s.end() - 64);
      control = test::rel_err(s, last);
    }
  }
  MESSAGE("phi3 window: batched forward and decode vs the window run on its own " << worst << ", unwindowed " << control);
  CHECK(worst <= 1e-12);
  CHECK(control > 1e-3);
}

TEST_CASE("Phi-3: configs nn cannot run are refused by name") {
  nlohmann::json j = lm::detail::read_json_file(kModels + "/phi3/config.json", "test");
  j["partial_rotary_factor"] = 0.75;  // Phi-4-mini
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "c.json", "partial_rotary_factor", "0.75"});
  j.erase("partial_rotary_factor");
  j["rope_scaling"] = {{"type", "longrope"}, {"short_factor", {1.0}}, {"long_factor", {1.0}}};  // Phi-3-*-128k
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "longrope", "not supported"});
  j["rope_scaling"] = nullptr;
  j["sliding_window"] = -1;
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "sliding_window"});
}

}  // namespace lm_phi3
