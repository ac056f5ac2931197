// SPDX-License-Identifier: MIT OR Apache-2.0
// LoRA by path, and mlx-lm / PEFT adapter directories written and read back (names, shapes,
// orientation, scales); the Python tools' own check is tests/interop/.
#include "support/check.hpp"

#include <filesystem>
#include <fstream>

#include <nn/lm/adapters.hpp>

namespace lm_adapters {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using namespace nn::lm;

namespace {

using Proj = std::variant<Linear, LoraLinear>;
struct Attn {
  Proj q_proj, k_proj, v_proj;
  NN_MODULE(Attn, q_proj, k_proj, v_proj)
};
struct Layer {
  Attn self_attn;
  NN_MODULE(Layer, self_attn)
};
struct Inner {
  std::vector<Layer> layers;
  NN_MODULE(Inner, layers)
};
struct Toy {
  Inner model;
  NN_MODULE(Toy, model)
};

// The base model, frozen as a fine-tune freezes it before applying LoRA.
Toy make() {
  random::seed(0);
  Toy t;
  for (int i = 0; i < 3; ++i) t.model.layers.push_back(Layer{Attn{Linear(6, 4), Linear(6, 2), Linear(6, 2)}});
  t.freeze();
  return t;
}

// Runs every projection of every layer on X and concatenates the outputs (a model "forward").
std::vector<double> forward(const Toy& t, const Tensor& X) {
  std::vector<double> out;
  GTape<cpu> tp;
  GVar x = tp.constant(X);
  for (const Layer& l : t.model.layers)
    for (const Proj* p : {&l.self_attn.q_proj, &l.self_attn.k_proj, &l.self_attn.v_proj}) {
      GVar y = std::visit([&](const auto& m) { return m(tp, x); }, *p);
      for (double v : tp.value(y).to_doubles()) out.push_back(v);
    }
  return out;
}

std::filesystem::path dir(const std::string& n) { return std::filesystem::temp_directory_path() / "nn_adapter_test" / n; }

void perturb_lora(Toy& t) {
  std::uint64_t seed = 10;
  t.map_modules<LoraLinear>([](const std::string&) { return true; }, [&](const std::string&, LoraLinear& l) {
    l.lora_b.value = test::random_tensor(l.lora_b.shape(), DType::f32, seed++);
  });
}

}  // namespace

TEST_CASE("apply_lora converts the keyed projections of the last N layers") {
  Toy t = make();
  LoraConfig cfg;
  cfg.num_layers = 2;
  cfg.keys = {"self_attn.q_proj", "self_attn.v_proj"};
  CHECK(apply_lora(t, cfg) == 4);
  CHECK(std::holds_alternative<Linear>(t.model.layers[0].self_attn.q_proj));
  CHECK(std::holds_alternative<LoraLinear>(t.model.layers[1].self_attn.q_proj));
  CHECK(std::holds_alternative<Linear>(t.model.layers[2].self_attn.k_proj));
  std::vector<std::string> names;
  for (auto& [p, v] : t.trainable_parameters()) names.push_back(p);
  CHECK(names.front() == "model.layers.1.self_attn.q_proj.lora_a");
  CHECK(names.size() == 8);
  cfg.keys = {"self_attn.q_prj"};
  Toy u = make();
  test::check_error([&] { apply_lora(u, cfg); }, {"[apply_lora]", "q_prj"});
}

TEST_CASE("mlx-lm adapters: written with mlx-lm's names and config, read back to the same model") {
  Toy t = make();
  LoraConfig cfg;
  cfg.rank = 2;
  cfg.scale = 3.0;
  apply_lora(t, cfg);
  perturb_lora(t);
  save_mlx_adapters(dir("mlx"), t, cfg);
  SafetensorsFile f(dir("mlx") / "adapters.safetensors");
  CHECK(f.names().front() == "model.layers.0.self_attn.q_proj.lora_a");
  CHECK(f.tensor("model.layers.0.self_attn.q_proj.lora_a").shape() == Shape{6, 2});
  CHECK(f.tensor("model.layers.0.self_attn.q_proj.lora_b").shape() == Shape{2, 4});
  auto j = nlohmann::json::parse(std::ifstream(dir("mlx") / "adapter_config.json"));
  CHECK(j["fine_tune_type"] == "lora");
  CHECK(j["lora_parameters"]["scale"] == 3.0);
  CHECK(j["lora_parameters"]["keys"] == nlohmann::json({"self_attn.q_proj", "self_attn.v_proj"}));

  Toy u = make();  // the same base weights
  LoraConfig back = load_mlx_adapters(dir("mlx"), u);
  CHECK(back.rank == 2);
  Tensor X = test::random_tensor({3, 6}, DType::f32, 99);
  CHECK(forward(u, X) == forward(t, X));
  CHECK(forward(make(), X) != forward(t, X));  // the adapters do change the output
}

TEST_CASE("PEFT adapters: transposed factors, alpha = scale * r, and back") {
  Toy t = make();
  LoraConfig cfg;
  cfg.rank = 2;
  cfg.scale = 1.5;
  cfg.num_layers = 2;
  apply_lora(t, cfg);
  perturb_lora(t);
  save_peft_adapters(dir("peft"), t, cfg, "tiny");
  SafetensorsFile f(dir("peft") / "adapter_model.safetensors");
  const std::string a = "base_model.model.model.layers.1.self_attn.q_proj.lora_A.weight";
  const std::string b = "base_model.model.model.layers.1.self_attn.q_proj.lora_B.weight";
  CHECK(f.tensor(a).shape() == Shape{2, 6});
  CHECK(f.tensor(b).shape() == Shape{4, 2});
  auto j = nlohmann::json::parse(std::ifstream(dir("peft") / "adapter_config.json"));
  CHECK(j["r"] == 2);
  CHECK(j["lora_alpha"] == 3.0);
  CHECK(j["target_modules"] == nlohmann::json({"q_proj", "v_proj"}));
  CHECK(j["layers_to_transform"] == nlohmann::json({1, 2}));

  Toy u = make();
  LoraConfig back = load_peft_adapters(dir("peft"), u);
  CHECK(back.scale == 1.5);
  CHECK(back.num_layers == 2);
  Tensor X = test::random_tensor({3, 6}, DType::f32, 5);
  CHECK(forward(u, X) == forward(t, X));

  cfg.rslora = true;  // PEFT's use_rslora: alpha is the scale itself
  Toy r = make();
  apply_lora(r, cfg);
  perturb_lora(r);
  save_peft_adapters(dir("rs"), r, cfg);
  auto jr = nlohmann::json::parse(std::ifstream(dir("rs") / "adapter_config.json"));
  CHECK(jr["lora_alpha"] == 1.5);
  CHECK(jr["use_rslora"] == true);
  Toy rp = make();
  CHECK(load_peft_adapters(dir("rs"), rp).rslora);
  CHECK(forward(rp, X) == forward(r, X));

  // mlx-lm has no rsLoRA flag: its directory carries the effective scale, the same layer
  save_mlx_adapters(dir("rs_mlx"), r, cfg);
  auto jm = nlohmann::json::parse(std::ifstream(dir("rs_mlx") / "adapter_config.json"));
  CHECK(jm["lora_parameters"]["scale"].get<double>() == cfg.effective_scale());
  Toy rm = make();
  LoraConfig rb = load_mlx_adapters(dir("rs_mlx"), rm);
  CHECK(!rb.rslora);
  CHECK(forward(rm, X) == forward(r, X));
  CHECK(forward(make(), X) != forward(r, X));
}

TEST_CASE("a malformed adapter directory raises, naming the file") {
  Toy t = make();
  std::filesystem::remove_all(dir("bad"));
  std::filesystem::create_directories(dir("bad"));
  std::ofstream(dir("bad") / "adapter_config.json") << "{\"fine_tune_type\": \"lora\"}";
  test::check_error([&] { load_mlx_adapters(dir("bad"), t); }, {"adapter_config.json", "lora_parameters"});
}

TEST_CASE("adapter configs: wrong types and out-of-range numbers raise nn::Error naming the file") {
  // Found reading the code for tests/fuzz/adapter_config_fuzz.cpp: nlohmann's type errors escaped.
  auto mlx = [](const char* text) { return [=] { lm::mlx_adapter_config_from_json(nlohmann::json::parse(text), "a.json"); }; };
  auto peft = [](const char* text) { return [=] { lm::peft_adapter_config_from_json(nlohmann::json::parse(text), "a.json"); }; };
  test::check_error(mlx("[1]"), {"[adapters] a.json: expected a JSON object"});
  test::check_error(mlx(R"({"fine_tune_type": 3})"), {"[adapters] a.json: bad field", "string"});
  test::check_error(mlx(R"({"lora_parameters": {"rank": 0, "scale": 1}})"), {"[adapters] a.json: the rank must be a positive integer, got 0"});
  test::check_error(mlx(R"({"lora_parameters": {"rank": 2, "scale": 1, "dropout": 1}})"), {"a.json", "dropout"});
  test::check_error(mlx(R"({"num_layers": -2, "lora_parameters": {"rank": 2, "scale": 1}})"), {"a.json", "num_layers"});
  test::check_error(peft(R"({"peft_type": null, "r": 2})"), {"[adapters] a.json: bad field"});
  test::check_error(peft(R"({"r": 0, "lora_alpha": 8})"), {"[adapters] a.json: r must be a positive integer, got 0"});
  test::check_error(peft(R"({"r": 2, "lora_alpha": 1e308, "use_rslora": false, "lora_dropout": -0.5})"), {"a.json", "dropout"});
  CHECK(lm::peft_adapter_config_from_json(nlohmann::json::parse(R"({"r": 4, "lora_alpha": 8})"), "a.json").scale == 2.0);
  // PEFT options that change the layer beyond one rank and one scale are refused, not ignored
  test::check_error(peft(R"({"r": 4, "alpha_pattern": {"q_proj": 16}})"), {"a.json", "alpha_pattern"});
  test::check_error(peft(R"({"r": 4, "rank_pattern": {"q_proj": 8}})"), {"a.json", "rank_pattern"});
  test::check_error(peft(R"({"r": 4, "modules_to_save": ["lm_head"]})"), {"a.json", "modules_to_save"});
  test::check_error(peft(R"({"r": 4, "bias": "lora_only"})"), {"a.json", "bias 'lora_only'"});
  CHECK(lm::peft_adapter_config_from_json(
            nlohmann::json::parse(R"({"r": 4, "rank_pattern": {}, "alpha_pattern": {}, "modules_to_save": null, "bias": "none"})"),
            "a.json").rank == 4);
  // mlx-lm's fine_tune_type: lora or dora; full is not an adapter
  CHECK(lm::mlx_adapter_config_from_json(nlohmann::json::parse(R"({"fine_tune_type": "dora", "lora_parameters": {"rank": 2, "scale": 1}})"), "a.json").dora);
  test::check_error(mlx(R"({"fine_tune_type": "full", "lora_parameters": {"rank": 2, "scale": 1}})"), {"a.json", "'full'", "lora or dora"});
}

TEST_CASE("lora_key_path: command-line keys to their paths inside a decoder layer") {
  CHECK(lora_key_path("q_proj") == "self_attn.q_proj");
  CHECK(lora_key_path("o_proj") == "self_attn.o_proj");
  CHECK(lora_key_path("down_proj") == "mlp.down_proj");
  CHECK(lora_key_path("gate_proj") == "mlp.gate_proj");
  CHECK(lora_key_path("mlp.up_proj") == "mlp.up_proj");  // already a path
}

}  // namespace lm_adapters
