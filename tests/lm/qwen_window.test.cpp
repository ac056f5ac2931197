// SPDX-License-Identifier: MIT OR Apache-2.0
// Qwen2 / Qwen3 with use_sliding_window: a window on the layers from max_window_layers on (or
// those layer_types names). A tiny random Qwen2ForCausalLM from transformers 4.57
// (tests/oracle/gen_layer_types.py: window 4 on layers 1 and 2 of 3), logits against
// transformers in float64 with and without the window; its windowed layers in flash attention
// equal them written out; save_hf reads back and writes what transformers before and after 4.53
// read; the config's other forms.
#include "support/lm_step.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/pretrained.hpp>

namespace lm_qwen_window {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";
const std::string kFolder = kModels + "/qwen2_window";

Tensor want(const std::string& which = "") {
  return SafetensorsFile(kModels + "/qwen2_window_expected.safetensors").tensor("qwen2_window." + which + "logits");
}

Tensor run_logits(const lm::CausalLM& m) { return test::lm_fixture_logits(m); }

nlohmann::json fixture_config() { return lm::detail::read_json_file(kFolder + "/config.json", "test"); }

}  // namespace

TEST_CASE("Qwen2 with use_sliding_window: the window on the layers from max_window_layers, logits equal transformers'") {
  lm::CausalLM m = lm::load_hf(kFolder, DType::f64);
  const lm::ModelConfig& c = m.config();
  CHECK(c.arch == lm::Arch::qwen2);
  CHECK(c.sliding_window == 4);
  CHECK_FALSE(c.window_on(0));
  CHECK(c.window_on(1));
  CHECK(c.window_on(2));
  CHECK_FALSE(c.local_rope(1));
  const double err = test::rel_err(run_logits(m), want());
  MESSAGE("qwen2 with a window: logits vs transformers (float64), max relative error " << err);
  CHECK(err <= 1e-10);
  lm::ModelConfig nowindow = c;
  nowindow.sliding_window = 0;
  const lm::CausalLM plain = test::with_config(m, nowindow);
  CHECK(test::rel_err(run_logits(plain), want("nowindow.")) <= 1e-10);
  CHECK(test::rel_err(run_logits(plain), want()) > 1e-3);  // the control: the window matters
}

TEST_CASE("Qwen2 with use_sliding_window: the windowed layers in flash attention equal them written out") {
  const lm::CausalLM m = lm::load_hf(kFolder, DType::f64);
  CHECK(test::check_flash_equals_written_out(m, 140, 1e-12) >= 2);
}

TEST_CASE("Qwen2 with use_sliding_window: save_hf writes the window as transformers reads it, before and after 4.53") {
  lm::CausalLM m = lm::load_hf(kFolder, DType::f32);
  test::TempDir dir("qwen_window_out");
  lm::save_hf(dir.path / "hf", m);
  const nlohmann::json cfg = lm::detail::read_json_file(dir.path / "hf" / "config.json", "test");
  CHECK(cfg["use_sliding_window"] == true);
  CHECK(cfg["sliding_window"] == 4);
  CHECK(cfg["max_window_layers"] == 1);
  CHECK(cfg["layer_types"] == fixture_config()["layer_types"]);
  CHECK(test::rel_err(run_logits(lm::load_hf(dir.path / "hf", DType::f32)), run_logits(m)) == 0.0);
}

TEST_CASE("Qwen2 / Qwen3 sliding-window configs: max_window_layers without layer_types, off, null, and bad kinds") {
  const std::vector<bool> want_layers{false, true, true};
  nlohmann::json j = fixture_config();
  j.erase("layer_types");  // transformers < 4.53: the layers from max_window_layers on
  CHECK(lm::config_from_json(j, "c.json").sliding_layers == want_layers);
  j["max_window_layers"] = 2;
  CHECK(lm::config_from_json(j, "c.json").sliding_layers == std::vector<bool>{false, false, true});
  j.erase("max_window_layers");  // Qwen2Config's default 28: no layer of 3
  CHECK_FALSE(lm::config_from_json(j, "c.json").window_on(2));
  j = fixture_config();
  j["model_type"] = "qwen3";  // Qwen3Config reads the same fields
  CHECK(lm::config_from_json(j, "c.json").sliding_layers == want_layers);
  j["use_sliding_window"] = false;  // off: no layer slides, whatever layer_types says
  const lm::ModelConfig off = lm::config_from_json(j, "c.json");
  CHECK(off.sliding_window == 0);
  CHECK_FALSE(off.window_on(1));
  j["use_sliding_window"] = true;
  j["sliding_window"] = nullptr;
  CHECK_FALSE(lm::config_from_json(j, "c.json").window_on(1));
  j["sliding_window"] = 4;
  j["layer_types"] = {"full_attention", "chunked_attention", "full_attention"};
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "layer_types", "[1]", "chunked_attention"});
  j["layer_types"] = {"full_attention"};
  test::check_error([&] { lm::config_from_json(j, "c.json"); }, {"[config]", "layer_types", "1 layers", "3"});
}

}  // namespace lm_qwen_window
