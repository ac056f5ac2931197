// SPDX-License-Identifier: MIT OR Apache-2.0
// Mistral (Llama with a sliding window on every layer): a tiny random MistralForCausalLM from
// transformers (tests/oracle/gen_mistral.py; window 4 over the fixture's 7 positions), logits
// against transformers in float64 with and without the window; the windowed layers in flash
// attention (no mask tensor) equal them written out (padding mask); save_hf reads back; the GGUF
// goes out as llama.cpp's converter writes Mistral, a "llama" model without the window.
#include "support/lm_step.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/gguf_export.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_mistral {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

Tensor want(const std::string& which = "") {
  return SafetensorsFile(kModels + "/mistral_expected.safetensors").tensor("mistral." + which + "logits");
}

Tensor run_logits(const lm::CausalLM& m) { return test::lm_fixture_logits(m); }

}  // namespace

TEST_CASE("Mistral: config (the window on every layer), logits equal transformers' in float64, with and without the window") {
  lm::CausalLM m = lm::load_hf(kModels + "/mistral", DType::f64);
  const lm::ModelConfig& c = m.config();
  CHECK(c.arch == lm::Arch::mistral);
  CHECK(c.sliding_window == 4);
  CHECK(c.window_on(0));
  CHECK(c.window_on(1));
  CHECK_FALSE(c.qkv_bias);
  CHECK_FALSE(c.tie_word_embeddings);
  const double err = test::rel_err(run_logits(m), want());
  MESSAGE("mistral: logits vs transformers (float64), max relative error " << err);
  CHECK(err <= 1e-10);
  lm::ModelConfig nowindow = c;
  nowindow.sliding_window = 0;
  const lm::CausalLM plain = test::with_config(m, nowindow);
  CHECK(test::rel_err(run_logits(plain), want("nowindow.")) <= 1e-10);
  CHECK(test::rel_err(run_logits(plain), want()) > 1e-3);  // the control: the window matters

  // MistralConfig's sliding_window: 4096 when absent, none when null
  nlohmann::json j = lm::detail::read_json_file(kModels + "/mistral/config.json", "test");
  j.erase("sliding_window");
  CHECK(lm::config_from_json(j, "c.json").sliding_window == 4096);
  j["sliding_window"] = nullptr;
  CHECK(lm::config_from_json(j, "c.json").sliding_window == 0);
  CHECK_FALSE(lm::config_from_json(j, "c.json").window_on(0));
  j["sliding_window"] = -2;
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "c.json", "sliding_window"});
}

TEST_CASE("Mistral: windowed layers in flash attention (no mask tensor) equal them written out, values and gradients") {
  // T = 140: across flash's 128-key tile, the window of 4 hiding most keys
  const lm::CausalLM m = lm::load_hf(kModels + "/mistral", DType::f64);
  CHECK(test::check_flash_equals_written_out(m, 140, 1e-12) == 2);
}

TEST_CASE("Mistral: save_hf reads back; the GGUF is a llama.cpp 'llama' model (q/k permuted, no window)") {
  lm::CausalLM m = lm::load_hf(kModels + "/mistral", DType::f32);
  const Tensor ref = run_logits(m);
  test::TempDir dir("mistral_out");
  lm::save_hf(dir.path / "hf", m);
  const nlohmann::json cfg = lm::detail::read_json_file(dir.path / "hf" / "config.json", "test");
  CHECK(cfg["model_type"] == "mistral");
  CHECK(cfg["architectures"][0] == "MistralForCausalLM");
  CHECK(cfg["sliding_window"] == 4);
  CHECK(test::rel_err(run_logits(lm::load_hf(dir.path / "hf", DType::f32)), ref) == 0.0);

  // the metadata gguf_metadata_hf writes from the config (it also needs a tokenizer.json, which
  // the fixture lacks): llama.* keys, and no sliding window
  const lm::ModelConfig& c = m.config();
  lm::GgufWriter w;
  w.set("llama.context_length", static_cast<std::uint32_t>(c.max_position_embeddings));
  w.set("llama.embedding_length", static_cast<std::uint32_t>(c.hidden_size));
  w.set("llama.block_count", static_cast<std::uint32_t>(c.num_hidden_layers));
  w.set("llama.feed_forward_length", static_cast<std::uint32_t>(c.intermediate_size));
  w.set("llama.attention.head_count", static_cast<std::uint32_t>(c.num_attention_heads));
  w.set("llama.attention.head_count_kv", static_cast<std::uint32_t>(c.num_key_value_heads));
  w.set("llama.rope.freq_base", static_cast<float>(c.rope_theta));
  w.set("llama.attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  lm::save_gguf(dir.path / "m.gguf", m, w, "f32", nullptr);
  const lm::GgufFile g(dir.path / "m.gguf");
  CHECK(g.at("general.architecture").as_string() == "llama");
  CHECK_FALSE(g.contains("llama.attention.sliding_window"));
  // q's rows permuted for llama.cpp's interleaved RoPE, as for Llama: the loader undoes it
  const Tensor q_hf = std::get<Linear>(m.model.layers[0].self_attn.q_proj).weight.value;
  CHECK(test::rel_err(g.tensor(*g.find_tensor("blk.0.attn_q.weight"), DType::f32), q_hf) > 1e-3);
  const lm::CausalLM back = lm::load_gguf(g, DType::f64);
  CHECK(back.config().arch == lm::Arch::llama);
  CHECK(back.config().sliding_window == 0);
  // llama.cpp runs it without the window: transformers' logits with sliding_window null (the
  // epsilon went out as float32: 1e-5 is not a float)
  CHECK(test::rel_err(run_logits(back), want("nowindow.")) <= 1e-6);
}

}  // namespace lm_mistral
