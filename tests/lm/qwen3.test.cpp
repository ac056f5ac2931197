// SPDX-License-Identifier: MIT OR Apache-2.0
// Qwen3 (q_norm / k_norm over each head, head_dim wider than hidden / heads, no biases): a tiny
// random Qwen3ForCausalLM from transformers (tests/oracle/gen_qwen3.py) loaded from its HF folder
// and from a GGUF laid out as llama.cpp's qwen3, logits against transformers in float64, a LoRA
// and a DoRA step (compiled equals eager), and the folder and GGUF nn writes read back. KV-cached
// decoding is checked with the other families in model.test.cpp.
#include "support/lm_step.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/gguf_export.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_qwen3 {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

Tensor want() { return SafetensorsFile(kModels + "/qwen3_expected.safetensors").tensor("qwen3.logits"); }

Tensor run_logits(const lm::CausalLM& m) { return test::lm_fixture_logits(m); }

}  // namespace

TEST_CASE("Qwen3: config, parameter paths with q_norm and k_norm, logits equal transformers' in float64") {
  lm::CausalLM m = lm::load_hf(kModels + "/qwen3", DType::f64);
  const lm::ModelConfig& c = m.config();
  CHECK(c.arch == lm::Arch::qwen3);
  CHECK(c.qk_norm);
  CHECK(c.head_dim == 16);
  CHECK(c.q_dim() == 64);  // wider than hidden_size 32, as in the real models
  CHECK_FALSE(c.qkv_bias);
  CHECK(c.tie_word_embeddings);
  std::set<std::string> paths;
  for (const auto& [p, t] : m.parameters()) paths.insert(p);
  CHECK(paths.count("model.layers.1.self_attn.q_norm.weight"));
  CHECK(paths.count("model.layers.1.self_attn.k_norm.weight"));
  CHECK_FALSE(paths.count("model.layers.0.self_attn.q_proj.bias"));
  const double err = test::rel_err(run_logits(m), want());
  MESSAGE("qwen3: logits vs transformers (float64), max relative error " << err);
  CHECK(err <= 1e-10);
  // the norms take part: unit norm weights give other logits
  lm::CausalLM plain = m;
  for (auto& l : plain.model.layers) {
    l.self_attn.q_norm->weight = Param(Tensor::full(Shape{16}, 1.0, DType::f64));
    l.self_attn.k_norm->weight = Param(Tensor::full(Shape{16}, 1.0, DType::f64));
  }
  CHECK(test::rel_err(run_logits(plain), want()) > 1e-3);
}

TEST_CASE("Qwen3: the GGUF (llama.cpp's qwen3 names, attn_q_norm / attn_k_norm) gives the same logits") {
  lm::CausalLM m = lm::load_gguf(lm::GgufFile(kModels + "/gguf/qwen3-F32.gguf"), DType::f64);
  CHECK(m.config().arch == lm::Arch::qwen3);
  CHECK(m.config().head_dim == 16);
  CHECK(test::rel_err(run_logits(m), want()) <= 1e-10);
}

TEST_CASE("Qwen3: a LoRA and a DoRA step, compiled, equal the eager steps bit for bit") {
  for (bool dora : {false, true}) {
    CAPTURE(dora);
    test::check_adapter_step_compiled_equals_eager(kModels + "/qwen3", dora);
  }
}

TEST_CASE("Qwen3: save_hf and save_gguf write files load_hf and load_gguf read back to the same logits") {
  lm::CausalLM m = lm::load_hf(kModels + "/qwen3", DType::f32);
  const Tensor ref = run_logits(m);
  test::TempDir dir("qwen3_out");
  lm::save_hf(dir.path / "hf", m);
  const nlohmann::json cfg = lm::detail::read_json_file(dir.path / "hf" / "config.json", "test");
  CHECK(cfg["model_type"] == "qwen3");
  CHECK(cfg["architectures"][0] == "Qwen3ForCausalLM");
  CHECK(test::rel_err(run_logits(lm::load_hf(dir.path / "hf", DType::f32)), ref) == 0.0);
  lm::save_gguf(dir.path / "m.gguf", m, lm::GgufFile(kModels + "/gguf/qwen3-F32.gguf"), "f32");
  const lm::GgufFile g(dir.path / "m.gguf");
  CHECK(g.at("general.architecture").as_string() == "qwen3");
  CHECK(g.find_tensor("blk.0.attn_q_norm.weight") != nullptr);
  CHECK(test::rel_err(run_logits(lm::load_gguf(g, DType::f32)), ref) == 0.0);
}

}  // namespace lm_qwen3
