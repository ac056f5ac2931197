// SPDX-License-Identifier: MIT OR Apache-2.0
// mlx-lm's quantized model folders (mlx_lm.convert -q) loaded by load_hf, kept quantized: logits
// against mlx-lm's own on the same folders (tests/oracle/gen_mlx_lm_quantized.py: affine 64/4 and
// 64/8, the mixed_3_6 recipe's per-layer overrides with 3- and 6-bit layers, mxfp4, mxfp8, nvfp4), the f64 load
// against the dequantized model, and every way a folder can be wrong.
#include <filesystem>
#include <fstream>
#include <functional>
#include <map>

#include "support/check.hpp"
#include "support/temp_dir.hpp"
#include <nn/lm/load.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_mlx_quantized {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using nn::test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kDir = std::string(NN_FIXTURES_DIR) + "/lm/mlx_quantized";

const SafetensorsFile& expected() {
  static const SafetensorsFile f(kDir + "/expected.safetensors");
  return f;
}

/// Logits of `m` on the fixture ids (2, 8), causal, no padding: a host f64 tensor.
Tensor logits_of(const lm::CausalLM& m) {
  GTape<cpu> tp;
  GVar ids = tp.input(expected().tensor("ids").to(DType::i64));
  return tp.value(m.logits(tp, ids)).to(DType::f64);
}

/// path -> Quant of every quantized layer of `m`.
std::map<std::string, Quant> quantized_layers(lm::CausalLM& m) {
  std::map<std::string, Quant> out;
  auto all = [](const std::string&) { return true; };
  m.map_modules<QuantizedLinear>(all, [&](const std::string& p, const QuantizedLinear& q) { out[p] = q.quant(); });
  m.map_modules<QuantizedEmbedding>(all, [&](const std::string& p, const QuantizedEmbedding& q) { out[p] = q.quant(); });
  return out;
}


/// A copy of fixture case `name` whose config.json is edited by `edit`.
fs::path edited_copy(const TempDir& d, const std::string& name, const std::function<void(nlohmann::json&)>& edit) {
  static int n = 0;
  const fs::path dst = d.path / (name + "_" + std::to_string(n++));
  fs::copy(kDir + "/" + name, dst, fs::copy_options::recursive);
  nlohmann::json j = nlohmann::json::parse(std::ifstream(dst / "config.json"));
  edit(j);
  std::ofstream(dst / "config.json") << j.dump(2);
  return dst;
}

}  // namespace

TEST_CASE("mlx-lm quantized folders: logits equal mlx-lm's (4 and 8 bits, mixed_3_6 overrides, mxfp4, mxfp8, nvfp4)") {
  struct Case {
    const char* name;
    std::size_t quantized;  // layers kept quantized
    Quant first;            // model.layers.0.self_attn.q_proj's format
  };
  // 2 layers x 7 projections, the embedding, and the untied head (the qwen2 model is tied).
  const Case cases[] = {{"llama_q4", 16, Quant::affine(64, 4)},
                        {"llama_q8", 16, Quant::affine(64, 8)},
                        {"qwen2_mixed", 15, Quant::affine(32, 3)},
                        {"llama_mxfp4", 16, Quant::mxfp4()},
                        {"llama_mxfp8", 16, Quant::mxfp8()},
                        {"llama_nvfp4", 16, Quant::nvfp4()}};
  for (const Case& c : cases) {
    const std::string name = c.name;
    CAPTURE(name);
    lm::CausalLM m = lm::load_hf(kDir + "/" + c.name);
    const auto layers = quantized_layers(m);
    CHECK(layers.size() == c.quantized);
    REQUIRE(layers.count("model.layers.0.self_attn.q_proj"));
    CHECK(layers.at("model.layers.0.self_attn.q_proj") == c.first);
    const Tensor want = expected().tensor(std::string(c.name) + ".logits");
    const double err = test::rel_err(logits_of(m), want);
    MESSAGE(name, ": max rel err vs mlx-lm ", err);
    CHECK(err < 1e-5);
  }
}

TEST_CASE("mlx-lm quantized folders: per-layer overrides give each layer its own bits") {
  lm::CausalLM m = lm::load_hf(kDir + "/qwen2_mixed");
  const auto layers = quantized_layers(m);
  CHECK(layers.at("model.embed_tokens") == Quant::affine(32, 3));
  CHECK(layers.at("model.layers.0.self_attn.v_proj") == Quant::affine(32, 3));
  CHECK(layers.at("model.layers.1.self_attn.v_proj") == Quant::affine(32, 6));
  CHECK(layers.at("model.layers.1.mlp.down_proj") == Quant::affine(32, 6));
  CHECK(layers.at("model.layers.1.mlp.up_proj") == Quant::affine(32, 3));
  // The q/k/v biases stay float beside the quantized matrices.
  const auto* q = std::get_if<QuantizedLinear>(&m.model.layers[0].self_attn.q_proj);
  REQUIRE(q);
  REQUIRE(q->bias);
  CHECK(q->bias->value.dtype() == DType::f32);
  CHECK(q->weight.value.dtype() == DType::u32);
}

TEST_CASE("mlx-lm quantized folders: f64 load equals its own dequantized model; load_pretrained dequantizes") {
  // (mxfp4 is left out: a QuantizedEmbedding with u8 scales gathers float32, so an f64 model
  // cannot hold one.)
  for (const std::string name : {"llama_q4", "qwen2_mixed"}) {
    CAPTURE(name);
    lm::CausalLM q = lm::load_hf(kDir + "/" + name, DType::f64);
    lm::CausalLM d = lm::load_hf(kDir + "/" + name, DType::f64);
    CHECK(lm::dequantize_layers(d, DType::f64) > 0);
    CHECK(quantized_layers(d).empty());
    CHECK(test::rel_err(logits_of(q), logits_of(d)) < 1e-12);
    // float32, dequantized as load_pretrained(keep_quantized = false) does: still mlx-lm's logits.
    lm::CausalLM f = lm::load_hf(kDir + "/" + name);
    lm::dequantize_layers(f, DType::f32);
    CHECK(test::rel_err(logits_of(f), expected().tensor(name + ".logits")) < 1e-5);
  }
}

TEST_CASE("mlx-lm quantized folders: errors name the file, the layer and the format") {
  TempDir d;
  auto fails_with = [](const fs::path& folder, const std::string& what) {
    CAPTURE(what);
    try {
      (void)lm::load_hf(folder);
      FAIL("loaded");
    } catch (const Error& e) {
      const std::string msg = e.what();
      CAPTURE(msg);
      CHECK(msg.find(what) != std::string::npos);
    }
  };
  // A layer the config marks as full precision, while its scales are stored.
  fails_with(edited_copy(d, "llama_q4", [](auto& j) { j["quantization"]["model.layers.1.mlp.up_proj"] = false; }),
             "model.layers.1.mlp.up_proj");
  // An override whose bits do not fit the stored codes: named with its format.
  fails_with(edited_copy(d, "llama_q8",
                         [](auto& j) {
                           j["quantization"]["model.layers.0.self_attn.k_proj"] = {
                               {"group_size", 64}, {"bits", 4}, {"mode", "affine"}};
                         }),
             "model.layers.0.self_attn.k_proj\" (affine, group 64, 4 bits)");
  // Formats nn does not read.
  fails_with(edited_copy(d, "llama_q4",
                         [](auto& j) {
                           j["quantization"]["lm_head"] = {{"group_size", 32}, {"bits", 8}, {"mode", "fp8"}};
                         }),
             "quantization mode \"fp8\" is not supported");
  // An fp mode with another group size than its one.
  fails_with(edited_copy(d, "llama_q4",
                         [](auto& j) {
                           j["quantization"]["lm_head"] = {{"group_size", 32}, {"bits", 4}, {"mode", "nvfp4"}};
                         }),
             "nvfp4 needs group_size 16 and bits 4");
  fails_with(edited_copy(d, "llama_q4", [](auto& j) { j["quantization"]["model.norm"] = {{"group_size", 48}, {"bits", 4}}; }),
             "group_size 48 with 4 bits");
  // Scales stored but no quantization block (mlx-lm would not quantize either).
  fails_with(edited_copy(d, "llama_q4",
                         [](auto& j) {
                           j.erase("quantization");
                           j.erase("quantization_config");
                         }),
             "has no \"quantization\" block");
  // Another tool's quantization_config.
  fails_with(edited_copy(d, "llama_q4",
                         [](auto& j) {
                           j.erase("quantization");
                           j["quantization_config"] = {{"quant_method", "gptq"}, {"bits", 4}};
                         }),
             "quant_method \"gptq\" is not supported");
  // A config entry for a layer the file does not store quantized.
  fails_with(edited_copy(d, "qwen2_mixed",
                         [](auto& j) {
                           j["quantization"]["lm_head"] = {{"group_size", 32}, {"bits", 4}, {"mode", "affine"}};
                         }),
             "quantization[\"lm_head\"] quantizes a layer");
  try {
    (void)lm::load_hf(kDir + "/llama_mxfp4", DType::f64);
    FAIL("loaded");
  } catch (const Error& e) {
    CHECK(std::string(e.what()).find("\"model.embed_tokens\" is mxfp4") != std::string::npos);
  }
  // A wrongly shaped model: the config's hidden size is not what the codes hold.
  fails_with(edited_copy(d, "llama_q4", [](auto& j) { j["intermediate_size"] = 192; }), "config makes it");
}

}  // namespace lm_mlx_quantized
