// SPDX-License-Identifier: MIT OR Apache-2.0
// The Llama / Qwen2 / SmolLM model family (include/nn/lm/model.hpp, config.hpp, load.hpp):
// logits against Hugging Face transformers in float64 and float32 for three checkpoints (F32,
// sharded F64, BF16; tests/oracle/gen_lm_models.py), KV-cached decoding against the full
// forward, LoRA replacement in place, parameter paths, and every config / load error.
#include <cmath>
#include <filesystem>
#include <fstream>
#include <set>

#include "support/check.hpp"
#include "support/temp_dir.hpp"

#include <nn/lm/load.hpp>
#include <nn/lm/pretrained.hpp>

namespace lm_model {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using nn::test::TempDir;
namespace fs = std::filesystem;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

const SafetensorsFile& expected() {
  static const SafetensorsFile f(kModels + "/expected.safetensors");
  return f;
}
// ids (B, T) int64 and keep (B, T) (1 real, 0 padding) of the fixtures: right-padded.
Tensor fixture_ids() { return expected().tensor("ids").to(DType::i64); }
Tensor fixture_keep() { return expected().tensor("keep"); }
Tensor expected_logits(const std::string& name) { return expected().tensor(name + ".logits"); }

/// Logits of `m` on the fixture batch with its padding mask, as a host f64 tensor.
Tensor run_logits(const lm::CausalLM& m) {
  GTape<cpu> tp;
  GVar ids = tp.input(fixture_ids());
  return tp.value(m.logits(tp, ids, fixture_keep())).to(DType::f64);
}


void write_text(const fs::path& p, const std::string& s) {
  std::ofstream(p, std::ios::binary) << s;
}
std::string read_text(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

/// A copy of fixture folder `name` in a temp dir, for tests that break it.
fs::path copy_fixture(const TempDir& d, const std::string& name) {
  fs::path dst = d.path / name;
  fs::copy(kModels + "/" + name, dst, fs::copy_options::recursive);
  return dst;
}

nlohmann::json base_config() {
  return nlohmann::json::parse(read_text(kModels + "/llama/config.json"));
}

}  // namespace

// ---- config ------------------------------------------------------------------------------------

TEST_CASE("config: the three fixture configs parse into the model each describes") {
  lm::ModelConfig l = lm::load_config(kModels + "/llama");
  CHECK(l.arch == lm::Arch::llama);
  CHECK(l.hidden_size == 32);
  CHECK(l.intermediate_size == 64);
  CHECK(l.num_hidden_layers == 2);
  CHECK(l.num_attention_heads == 4);
  CHECK(l.num_key_value_heads == 2);
  CHECK(l.head_dim == 8);
  CHECK(l.vocab_size == 64);
  CHECK(l.rms_norm_eps == 1e-6);
  CHECK(l.rope_theta == 10000.0);
  CHECK_FALSE(l.tie_word_embeddings);
  CHECK_FALSE(l.qkv_bias);
  CHECK_FALSE(l.o_bias);
  CHECK(l.rope_scaling.type == "default");

  lm::ModelConfig q = lm::load_config(kModels + "/qwen2/config.json");
  CHECK(q.arch == lm::Arch::qwen2);
  CHECK(q.tie_word_embeddings);
  CHECK(q.qkv_bias);
  CHECK_FALSE(q.o_bias);
  CHECK_FALSE(q.mlp_bias);
  CHECK(q.rope_theta == 1e6);

  lm::ModelConfig s = lm::load_config(kModels + "/smollm_bf16");
  CHECK(s.arch == lm::Arch::llama);
  CHECK(s.num_key_value_heads == 1);
  CHECK(s.tie_word_embeddings);
  CHECK(s.qkv_bias);
  CHECK(s.o_bias);
  CHECK(s.mlp_bias);
  CHECK(s.rope_scaling.type == "llama3");
  CHECK(s.rope_scaling.factor == 8.0);
  CHECK(s.rope_scaling.original_max_position_embeddings == 16);
}

TEST_CASE("config: llama3 and linear rope scaling remap the inverse frequencies") {
  lm::ModelConfig c = lm::load_config(kModels + "/smollm_bf16");
  const std::vector<double> f = c.inv_freq();
  REQUIRE(f.size() == 4);
  // theta 1e5, head_dim 8: base frequencies 1e5^(-i/4); wavelengths 6.28, 112, 1987, 35k
  // against an original context of 16 (low 16, high 4): the first is in the blended band, the
  // others are slowed by the factor 8.
  const double pi = 3.14159265358979323846;
  const double f0 = 1.0, smooth = (16.0 / (2 * pi / f0) - 1.0) / (4.0 - 1.0);
  CHECK(f[0] == doctest::Approx((1 - smooth) * f0 / 8 + smooth * f0).epsilon(1e-15));
  for (int i = 1; i < 4; ++i) CHECK(f[static_cast<std::size_t>(i)] == doctest::Approx(std::pow(1e5, -i / 4.0) / 8).epsilon(1e-14));

  c.rope_scaling = lm::RopeScaling{"linear", 2.0};
  const std::vector<double> g = c.inv_freq();
  for (int i = 0; i < 4; ++i) CHECK(g[static_cast<std::size_t>(i)] == doctest::Approx(std::pow(1e5, -i / 4.0) / 2).epsilon(1e-14));
}

TEST_CASE("config: head_dim, defaults and smollm") {
  nlohmann::json j = base_config();
  j["head_dim"] = 16;  // q is (heads * head_dim, hidden) = (64, 32), as Qwen3 / newer Llama configs allow
  lm::ModelConfig c = lm::config_from_json(j);
  CHECK(c.head_dim == 16);
  CHECK(c.q_dim() == 64);
  lm::CausalLM m(c);
  CHECK(m.model.layers[0].self_attn.q_proj.index() == 0);
  CHECK(std::get<Linear>(m.model.layers[0].self_attn.q_proj).weight.shape() == Shape{64, 32});
  CHECK(std::get<Linear>(m.model.layers[0].self_attn.o_proj).weight.shape() == Shape{32, 64});

  j = base_config();
  j.erase("num_key_value_heads");
  j.erase("rms_norm_eps");
  j["rope_scaling"] = nullptr;  // HF writes null for "none"
  j["model_type"] = "smollm";
  c = lm::config_from_json(j);
  CHECK(c.num_key_value_heads == c.num_attention_heads);
  CHECK(c.rms_norm_eps == 1e-6);
  CHECK(c.arch == lm::Arch::llama);
}

TEST_CASE("config: transformers 5's rope_parameters (rope_theta and the scaling in one object)") {
  nlohmann::json j = base_config();
  j.erase("rope_theta");
  j["rope_parameters"] = {{"rope_theta", 1e6}, {"rope_type", "default"}};
  lm::ModelConfig c = lm::config_from_json(j);
  CHECK(c.rope_theta == 1e6);
  CHECK(c.rope_scaling.type == "default");
  j["rope_parameters"] = {{"rope_theta", 5e5}, {"rope_type", "llama3"}, {"factor", 8.0}, {"low_freq_factor", 1.0},
                          {"high_freq_factor", 4.0}, {"original_max_position_embeddings", 16}};
  c = lm::config_from_json(j);
  CHECK(c.rope_theta == 5e5);
  CHECK(c.rope_scaling.type == "llama3");
  CHECK(c.rope_scaling.factor == 8.0);
  CHECK(c.rope_scaling.original_max_position_embeddings == 16);
  j["rope_parameters"] = {{"rope_theta", 1e4}, {"rope_type", "yarn"}, {"factor", 4.0}};
  test::check_error([&] { lm::config_from_json(j, "v5/config.json"); }, {"v5/config.json", "\"rope_parameters\"", "\"yarn\""});
}

TEST_CASE("config: errors name the file and the field") {
  auto bad = [](nlohmann::json j, std::initializer_list<std::string> frags) {
    test::check_error([&] { lm::config_from_json(j, "some/config.json"); }, frags);
  };
  nlohmann::json j = base_config();
  j.erase("hidden_size");
  bad(j, {"[config]", "some/config.json", "missing field \"hidden_size\""});
  j = base_config();
  j["num_attention_heads"] = "four";
  bad(j, {"some/config.json", "\"num_attention_heads\"", "expected an integer", "\"four\""});
  j = base_config();
  j["num_hidden_layers"] = 2.5;
  bad(j, {"\"num_hidden_layers\"", "expected an integer"});
  j = base_config();
  j["model_type"] = "gpt2";
  j.erase("architectures");
  bad(j, {"model_type \"gpt2\" is not a supported model family", "llama", "qwen2", "qwen3"});
  j["architectures"] = {"GPT2LMHeadModel"};  // the family is named as transformers names it too
  bad(j, {"model_type \"gpt2\" (architectures [\"GPT2LMHeadModel\"]) is not a supported model family"});
  j = base_config();
  j["rope_scaling"] = {{"rope_type", "yarn"}, {"factor", 4.0}};
  bad(j, {"\"rope_scaling\"", "\"yarn\" is not supported", "linear, llama3"});
  j = base_config();
  j["rope_scaling"] = {{"type", "dynamic"}, {"factor", 2.0}};
  bad(j, {"\"dynamic\" is not supported"});
  j = base_config();
  j["rope_scaling"] = {{"rope_type", "llama3"}, {"factor", 8.0}};
  bad(j, {"rope_scaling.low_freq_factor", "required"});
  j = base_config();
  j["rope_scaling"] = {{"rope_type", "linear"}};
  bad(j, {"rope_scaling.factor", "required"});
  j = base_config();
  j["num_key_value_heads"] = 3;
  bad(j, {"\"num_key_value_heads\" (3) must divide num_attention_heads (4)"});
  j = base_config();
  j["hidden_act"] = "gelu";
  bad(j, {"\"hidden_act\"", "\"gelu\""});
  j = base_config();
  j["tie_word_embeddings"] = 1;
  bad(j, {"\"tie_word_embeddings\"", "true or false"});
  j = base_config();
  j["vocab_size"] = 0;
  bad(j, {"\"vocab_size\" must be a positive integer"});
  j = base_config();
  j["hidden_size"] = 30;  // not a multiple of 4 heads, and no head_dim
  bad(j, {"\"hidden_size\" (30) is not a multiple of num_attention_heads (4)"});
  test::check_error([] { lm::load_config("/nonexistent/folder"); }, {"[config]", "/nonexistent/folder", "cannot open"});
  TempDir d;
  write_text(d.path / "config.json", "{ not json");
  test::check_error([&] { lm::load_config(d.path); }, {"config.json", "not valid JSON"});
}

// ---- module tree -------------------------------------------------------------------------------

TEST_CASE("CausalLM: parameter paths are Hugging Face's, in HF's order, lm_head only when untied") {
  lm::CausalLM m(lm::load_config(kModels + "/llama"));
  std::vector<std::string> paths;
  for (const auto& [p, t] : m.parameters()) paths.push_back(p);
  SafetensorsFile f(kModels + "/llama/model.safetensors");
  std::vector<std::string> file = f.names();
  CHECK(std::set<std::string>(paths.begin(), paths.end()) == std::set<std::string>(file.begin(), file.end()));
  CHECK(paths.front() == "model.embed_tokens.weight");
  CHECK(paths[1] == "model.layers.0.self_attn.q_proj.weight");
  CHECK(paths.back() == "lm_head.weight");
  CHECK(m.parameters().size() == 2 + 2 * 9 + 1);

  lm::CausalLM q(lm::load_config(kModels + "/qwen2"));
  std::vector<std::string> qp;
  for (const auto& [p, t] : q.parameters()) qp.push_back(p);
  CHECK(qp[2] == "model.layers.0.self_attn.q_proj.bias");
  CHECK(std::find(qp.begin(), qp.end(), "lm_head.weight") == qp.end());
  CHECK(std::find(qp.begin(), qp.end(), "model.layers.1.self_attn.o_proj.bias") == qp.end());
  CHECK(q.dtype() == DType::f32);
  CHECK(lm::CausalLM(q.config(), DType::f64).dtype() == DType::f64);
  test::check_error([&] { lm::CausalLM(q.config(), DType::bf16); }, {"float32 or float64", "bfloat16"});
}

// ---- logits against transformers --------------------------------------------------------------

TEST_CASE("GATE: logits equal transformers' in float64 (F32, sharded F64 and BF16 checkpoints)") {
  for (const char* name : {"llama", "qwen2", "smollm_bf16"}) {
    lm::CausalLM m = lm::load_hf(kModels + "/" + name, DType::f64);
    CHECK(m.dtype() == DType::f64);
    Tensor got = run_logits(m), want = expected_logits(name);
    REQUIRE(got.shape() == Shape{2, 7, 64});
    const double err = test::rel_err(got, want);
    MESSAGE(std::string(name) << ": float64 logits vs transformers, max relative error " << err);
    CHECK(err <= 1e-10);
  }
}

TEST_CASE("GATE: logits equal transformers' in float32 (to float32 accuracy)") {
  for (const char* name : {"llama", "qwen2", "smollm_bf16"}) {
    lm::CausalLM m = lm::load_hf(kModels + "/" + name);  // f32 by default
    CHECK(m.dtype() == DType::f32);
    const double err = test::rel_err(run_logits(m), expected_logits(name));
    MESSAGE(std::string(name) << ": float32 logits vs transformers (float64), max relative error " << err);
    CHECK(err <= 1e-5);
  }
}

TEST_CASE("save_hf writes a folder load_hf reads back to the same logits (llama3 RoPE scaling, biases)") {
  TempDir d;
  for (const char* name : {"llama", "qwen2", "smollm_bf16"}) {
    CAPTURE(name);
    lm::CausalLM m = lm::load_hf(kModels + "/" + name, DType::f64);
    const fs::path out = d.path / name;
    lm::save_hf(out, m);
    lm::CausalLM back = lm::load_hf(out, DType::f64);
    CHECK(back.config().rope_scaling.type == m.config().rope_scaling.type);
    CHECK(test::rel_err(run_logits(back), run_logits(m)) == 0.0);
  }
  lm::CausalLM m = lm::load_hf(kModels + "/llama");
  lm::apply_lora(m, lm::LoraConfig{});
  test::check_error([&] { lm::save_hf(d.path / "lora", m); }, {"[save_hf]", "LoRA", "fuse them first"});
}

TEST_CASE("logits: the GVar-mask and causal-only forms agree with the keep form") {
  lm::CausalLM m = lm::load_hf(kModels + "/qwen2", DType::f64);
  Tensor want = run_logits(m);
  GTape<cpu> tp;
  GVar ids = tp.input(fixture_ids());
  GVar mask = tp.input(attention_mask_fill(fixture_keep(), DType::f64));  // a replayable slot
  CHECK(test::rel_err(tp.value(m.logits(tp, ids, mask)), want) == 0.0);
  // Without a padding mask the unpadded row (row 0) is unchanged, and every row's real prefix
  // is too (causality: a real token never sees the padding after it). That form runs the causal
  // attention kernel (softmax over keys 0..i only), so it agrees to rounding, not bit for bit.
  GTape<cpu> tp2;
  Tensor causal = tp2.value(m.logits(tp2, tp2.input(fixture_ids())));
  const std::vector<double> a = causal.to_doubles(), b = want.to_doubles();
  double worst = 0, scale = 0;
  for (std::int64_t t = 0; t < 7; ++t)
    for (std::int64_t v = 0; v < 64; ++v)
      for (std::int64_t row : {std::int64_t{0}, std::int64_t{1}}) {
        if (row == 1 && t >= 4) continue;
        const std::size_t i = static_cast<std::size_t>((row * 7 + t) * 64 + v);
        worst = std::max(worst, std::abs(a[i] - b[i]));
        scale = std::max(scale, std::abs(b[i]));
      }
  CHECK(worst / scale <= 1e-14);
}

TEST_CASE("logits: int32 ids and a replayed tape give the same logits") {
  lm::CausalLM m = lm::load_hf(kModels + "/llama", DType::f64);
  GTape<cpu> tp;
  GVar ids = tp.input(fixture_ids().to(DType::i32));
  GVar out = m.logits(tp, ids, fixture_keep());
  Tensor first = tp.value(out).clone();
  CHECK(test::rel_err(first, expected_logits("llama")) <= 1e-10);
  tp.replay_forward();
  CHECK(test::rel_err(tp.value(out), first) == 0.0);
}

TEST_CASE("logits: shape and dtype errors") {
  lm::CausalLM m(lm::load_config(kModels + "/llama"));
  GTape<cpu> tp;
  test::check_error([&] { m.logits(tp, tp.input(Tensor::zeros({2, 3}, DType::f32))); }, {"[CausalLM]", "int32 or int64", "float32"});
  test::check_error([&] { m.logits(tp, tp.input(Tensor::zeros({6}, DType::i64))); }, {"[CausalLM]", "(B, T)", "(6)"});
  test::check_error([&] { m.logits(tp, tp.input(Tensor::from<std::int64_t>({1, 2}, {1, 64}))); }, {"64"});  // id out of range
}

// ---- KV cache ----------------------------------------------------------------------------------

TEST_CASE("decode: a prompt prefill then one token at a time gives the full forward's logits") {
  for (const char* name : {"llama", "qwen2", "smollm_bf16", "qwen3", "phi3", "gemma2", "gemma3"}) {  // qwen3: q_norm / k_norm before the cache; phi3: split qkv; gemma2: caps, window; gemma3: two RoPE tables
    lm::CausalLM m = lm::load_hf(kModels + "/" + name, DType::f64);
    const Tensor ids = fixture_ids(), keep = fixture_keep();
    const Tensor full = run_logits(m);
    lm::KVCache cache;
    CHECK(cache.length() == 0);
    std::vector<double> got;
    auto step_cols = [&](std::int64_t from, std::int64_t to) {
      std::vector<std::int64_t> i;
      std::vector<double> k;
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t t = from; t < to; ++t) {
          i.push_back(static_cast<std::int64_t>(ids.item(b * 7 + t)));
          k.push_back(keep.item(b * 7 + t));
        }
      return std::pair{Tensor::from<std::int64_t>({2, to - from}, i), Tensor::from_doubles({2, to - from}, k, DType::f32)};
    };
    std::vector<Tensor> outs;
    auto [p_ids, p_keep] = step_cols(0, 3);
    outs.push_back(m.decode(p_ids, cache, p_keep));  // prefill 3 tokens
    CHECK(cache.length() == 3);
    for (std::int64_t t = 3; t < 7; ++t) {
      auto [s_ids, s_keep] = step_cols(t, t + 1);
      outs.push_back(m.decode(s_ids, cache, s_keep));
      CHECK(cache.length() == t + 1);
    }
    CHECK(cache.k.size() == m.model.layers.size());
    CHECK(cache.k[0].shape() == Shape{2, m.config().num_key_value_heads, 7, m.config().head_dim});
    // Reassemble (B, T, V) from the steps and compare.
    std::vector<double> all(2 * 7 * 64);
    std::int64_t t0 = 0;
    for (const Tensor& o : outs) {
      const std::int64_t n = o.dim(1);
      for (std::int64_t b = 0; b < 2; ++b)
        for (std::int64_t t = 0; t < n; ++t)
          for (std::int64_t v = 0; v < 64; ++v)
            all[static_cast<std::size_t>((b * 7 + t0 + t) * 64 + v)] = o.item((b * n + t) * 64 + v);
      t0 += n;
    }
    const double err = test::rel_err(all, full.to_doubles());
    MESSAGE(std::string(name) << ": KV-cached decoding vs the full forward, max relative error " << err);
    CHECK(err <= 1e-12);
  }
}

TEST_CASE("decode: errors leave the cache untouched; clear() starts over") {
  lm::CausalLM m = lm::load_hf(kModels + "/llama", DType::f64);
  lm::KVCache cache;
  m.decode(Tensor::from<std::int64_t>({1, 2}, {5, 6}), cache);
  CHECK(cache.length() == 2);
  test::check_error([&] { m.decode(Tensor::from<std::int64_t>({2, 1}, {5, 6}), cache); }, {"[CausalLM.decode]", "batch 1", "clear()"});
  test::check_error([&] { m.decode(Tensor::zeros({1, 1}, DType::f32), cache); }, {"int32 or int64"});
  test::check_error([&] { m.decode(Tensor::from<std::int64_t>({1, 1}, {99}), cache); }, {"99"});
  test::check_error([&] { m.decode(Tensor::from<std::int64_t>({1, 1}, {3}), cache, Tensor::ones({1, 2})); }, {"keep (1, 2)"});
  CHECK(cache.length() == 2);
  cache.clear();
  CHECK(cache.length() == 0);
  Tensor a = m.decode(Tensor::from<std::int64_t>({1, 2}, {5, 6}), cache);
  GTape<cpu> tp;
  Tensor b = tp.value(m.logits(tp, tp.input(Tensor::from<std::int64_t>({1, 2}, {5, 6}))));
  CHECK(test::rel_err(a, b) <= 1e-13);
}

// ---- LoRA ----------------------------------------------------------------------------------------

TEST_CASE("LoRA: map_modules swaps q/v projections in place; logits unchanged; adapters get gradients") {
  lm::CausalLM m = lm::load_hf(kModels + "/qwen2", DType::f64);
  const Tensor before = run_logits(m);
  m.freeze();
  const int n = m.map_modules<Linear>(
      [](const std::string& p) { return p.ends_with("q_proj") || p.ends_with("v_proj"); },
      [](const std::string&, Linear& l) { return LoraLinear::from_base(l, 4).scale(2.0); });
  CHECK(n == 4);
  CHECK(std::holds_alternative<LoraLinear>(m.model.layers[1].self_attn.v_proj));
  CHECK(std::holds_alternative<Linear>(m.model.layers[1].self_attn.k_proj));
  std::set<std::string> trainable;
  for (const auto& [p, t] : m.trainable_parameters()) trainable.insert(p);
  CHECK(trainable.size() == 8);
  CHECK(trainable.count("model.layers.0.self_attn.q_proj.lora_a"));
  CHECK(trainable.count("model.layers.1.self_attn.v_proj.lora_b"));
  std::set<std::string> all;
  for (const auto& [p, t] : m.parameters()) all.insert(p);
  CHECK(all.count("model.layers.0.self_attn.q_proj.linear.weight"));
  CHECK(all.count("model.layers.0.self_attn.q_proj.linear.bias"));
  CHECK(test::rel_err(run_logits(m), before) == 0.0);  // lora_b starts at zero

  // One next-token loss through the adapted model: every adapter gets a gradient, lora_b's
  // nonzero (lora_a's is zero while lora_b is).
  auto [loss, grads] = value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
    const Tensor ids = fixture_ids();
    std::vector<std::int64_t> tg;
    for (std::int64_t b = 0; b < 2; ++b)
      for (std::int64_t t = 1; t < 7; ++t) tg.push_back(fixture_keep().item(b * 7 + t) != 0 ? static_cast<std::int64_t>(ids.item(b * 7 + t)) : -100);
    GVar lg = mm.logits(tp, tp.input(ids), fixture_keep());
    return cross_entropy_rows(tp, lg, tp.constant(Tensor::from<std::int64_t>({2, 6}, tg)), 6);
  });
  CHECK(std::isfinite(loss.item()));
  const auto& g = std::get<LoraLinear>(grads.model.layers[0].self_attn.q_proj);
  CHECK(g.lora_b.value.shape() == Shape{4, 32});
  double norm = 0;
  for (double x : g.lora_b.value.to_doubles()) norm += x * x;
  CHECK(norm > 0);
  CHECK_FALSE(std::get<LoraLinear>(grads.model.layers[0].self_attn.q_proj).linear().weight.value.defined());  // frozen

  // And the adapted model still decodes through its cache.
  lm::KVCache cache;
  Tensor d = m.decode(fixture_ids(), cache, fixture_keep());
  CHECK(test::rel_err(d, before) <= 1e-12);
}

// ---- loading errors ----------------------------------------------------------------------------

TEST_CASE("load_hf: strict — missing, unknown and mismatched names all reported, by name") {
  TempDir d;
  fs::path dir = copy_fixture(d, "llama");
  NamedTensors t = load_safetensors(dir / "model.safetensors");
  NamedTensors broken;
  for (auto& [n, x] : t)
    if (n != "model.layers.1.mlp.up_proj.weight") broken.emplace_back(n, x);
  broken.emplace_back("model.layers.0.self_attn.rotary_emb.inv_freq", Tensor::ones({4}));  // skipped, as HF does
  broken.emplace_back("model.extra.weight", Tensor::ones({3}));
  for (auto& [n, x] : broken)
    if (n == "model.norm.weight") x = Tensor::ones({31});
  save_safetensors(dir / "model.safetensors", broken);
  test::check_error([&] { lm::load_hf(dir); },
                    {"[load_weights]", "nothing was loaded", "1 missing: model.layers.1.mlp.up_proj.weight",
                     "1 unknown: model.extra.weight", "1 mismatched: model.norm.weight (file (31) float32, model (32) float32)"});
  // A tied model whose file also holds lm_head.weight loads (HF ignores it).
  fs::path q = copy_fixture(d, "smollm_bf16");
  NamedTensors s = load_safetensors(q / "model.safetensors");
  s.emplace_back("lm_head.weight", Tensor::ones({64, 32}, DType::f32).to(DType::bf16));
  save_safetensors(q / "model.safetensors", s);
  CHECK(test::rel_err(run_logits(lm::load_hf(q, DType::f64)), expected_logits("smollm_bf16")) <= 1e-10);
  // Integer weights are refused by name.
  NamedTensors ints = load_safetensors(dir / "model.safetensors");
  ints[0].second = Tensor::zeros(ints[0].second.shape(), DType::i32);
  save_safetensors(dir / "model.safetensors", ints);
  test::check_error([&] { lm::load_hf(dir); }, {"[load_hf]", ints[0].first, "I32", "F32, F16, BF16 or F64"});
}

TEST_CASE("load_hf: a config that does not fit the weights is reported as mismatches") {
  TempDir d;
  fs::path dir = copy_fixture(d, "llama");
  nlohmann::json j = base_config();
  j["intermediate_size"] = 96;
  write_text(dir / "config.json", j.dump());
  test::check_error([&] { lm::load_hf(dir); }, {"mismatched", "model.layers.0.mlp.gate_proj.weight (file (64, 32) float32, model (96, 32)"});
  j = base_config();
  j["tie_word_embeddings"] = true;  // then lm_head.weight is skipped and nothing is missing: loads
  write_text(dir / "config.json", j.dump());
  CHECK_FALSE(lm::load_hf(dir).lm_head.has_value());
}

TEST_CASE("load_hf: the sharded index is checked") {
  TempDir d;
  fs::path dir = copy_fixture(d, "qwen2");
  const fs::path index = dir / "model.safetensors.index.json";
  const nlohmann::json good = nlohmann::json::parse(read_text(index));
  nlohmann::json j = good;
  j["weight_map"]["model.norm.weight"] = "../escape.safetensors";
  write_text(index, j.dump());
  test::check_error([&] { lm::load_hf(dir); }, {"[load_hf]", "../escape.safetensors", "inside the folder"});
  j = good;
  j["weight_map"].erase("model.norm.weight");
  write_text(index, j.dump());
  test::check_error([&] { lm::load_hf(dir); }, {"holds \"model.norm.weight\"", "does not list"});
  j = good;
  const std::string other = j["weight_map"]["model.embed_tokens.weight"] == "model-00001-of-00002.safetensors"
                                ? "model-00002-of-00002.safetensors"
                                : "model-00001-of-00002.safetensors";
  j["weight_map"]["model.embed_tokens.weight"] = other;
  write_text(index, j.dump());
  test::check_error([&] { lm::load_hf(dir); }, {"\"model.embed_tokens.weight\"", "places in"});
  j = good;
  j["weight_map"]["model.layers.9.mlp.up_proj.weight"] = "model-00001-of-00002.safetensors";
  write_text(index, j.dump());
  test::check_error([&] { lm::load_hf(dir); }, {"lists \"model.layers.9.mlp.up_proj.weight\"", "does not hold it"});
  j = good;
  j["weight_map"]["model.norm.weight"] = "model-00009-of-00009.safetensors";
  write_text(index, j.dump());
  test::check_error([&] { lm::load_hf(dir); }, {"shard \"model-00009-of-00009.safetensors\"", "is not in the folder"});
  write_text(index, "[]");
  test::check_error([&] { lm::load_hf(dir); }, {"index.json", "not a JSON object"});
  write_text(index, "{}");
  test::check_error([&] { lm::load_hf(dir); }, {"\"weight_map\" must be a non-empty object"});
  fs::remove(index);
  test::check_error([&] { lm::load_hf(dir); }, {"no model.safetensors and no model.safetensors.index.json"});
}

TEST_CASE("Precision::bf16: frozen matrices stored in bfloat16, logits and LoRA gradients near float32's") {
  for (const char* name : {"llama", "qwen2"}) {
    CAPTURE(name);
    lm::CausalLM f = lm::load_hf(kModels + "/" + name), h = lm::load_hf(kModels + "/" + name);
    lm::LoraConfig lc;
    lc.keys = {"self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj"};
    for (lm::CausalLM* m : {&f, &h}) {
      m->freeze();
      nn::random::seed(1);  // the same adapter a in both
      lm::apply_lora(*m, lc);
      // LoRA b starts at zero; give it values so every adapter gradient is live
      nn::detail::for_each(*m, [&](const std::string& path, Param& p) {
        if (path.find("lora_b") != std::string::npos) p.value = test::random_tensor(p.shape(), DType::f32, 80, -0.05, 0.05);
      });
    }
    std::int64_t frozen_matrices = 0;
    nn::detail::for_each(h, [&](const std::string&, Param& p) { frozen_matrices += !p.trainable && p.value.rank() == 2; });
    CHECK(set_precision(h, Precision::bf16) == frozen_matrices);
    CHECK(h.dtype() == DType::f32);
    nn::detail::for_each(h, [&](const std::string& path, Param& p) {
      CAPTURE(path);
      CHECK(p.dtype() == (!p.trainable && p.value.rank() == 2 ? DType::bf16 : DType::f32));
    });
    const double el = test::rel_err(run_logits(h), run_logits(f));
    auto loss = [&](GTape<cpu>& tp, const lm::CausalLM& m) {
      GVar logits = m.logits(tp, tp.constant(fixture_ids()));
      Tensor t = fixture_ids().clone();  // targets the fixture models do not already predict
      for (std::int64_t i = 0; i < t.numel(); ++i) t.data<std::int64_t>()[i] = (t.data<std::int64_t>()[i] * 7 + 3) % 64;
      return cross_entropy(tp, logits, tp.constant(t), Reduction::mean);
    };
    auto [lf, gf] = value_and_grad(f, loss);
    auto [lh, gh] = value_and_grad(h, loss);
    double eg = 0;
    const auto pf = gf.trainable_parameters(), ph = gh.trainable_parameters();
    REQUIRE(pf.size() == ph.size());
    for (std::size_t i = 0; i < pf.size(); ++i) eg = std::max(eg, test::rel_err(ph[i].second, pf[i].second));
    MESSAGE(std::string(name) << " bf16 vs f32: logits " << el << ", loss " << lh.item() << " vs " << lf.item() << ", LoRA grads " << eg);
    // bf16 keeps 8 bits of mantissa: one rounding is 2^-9 = 0.2% relative; through 2 layers and
    // the head the logits moved by 0.25-0.35% and the adapter gradients by 0.8-1% when recorded
    CHECK(el <= 1e-2);
    CHECK(std::abs(lh.item() - lf.item()) <= 1e-3 * std::abs(lf.item()));
    CHECK(eg <= 3e-2);
    CHECK(set_precision(h, Precision::f32) == frozen_matrices);  // back: exact widening
    nn::detail::for_each(h, [&](const std::string&, Param& p) { CHECK(p.dtype() == DType::f32); });
  }
}

TEST_CASE("anomaly mode names the decoder layer where an Inf first appears") {
  const lm::ModelConfig c = lm::config_from_json(base_config());
  lm::CausalLM m(c);  // zeros, norms ones
  auto fill = [](Tensor& t, float v) { std::fill(t.data<float>(), t.data<float>() + t.numel(), v); };
  fill(std::get<Embedding>(m.model.embed_tokens).weight.value, 1.0f);  // every hidden state is 1
  const std::size_t last = m.model.layers.size() - 1;
  // q = (1, ..., 1) W^T with every W = 1e38: C * 1e38 overflows float32 in the last layer's q_proj
  fill(std::get<Linear>(m.model.layers[last].self_attn.q_proj).weight.value, 1e38f);
  GTape<cpu> tp;
  tp.detect_anomaly(true);
  GVar ids = tp.input(Tensor::from<std::int32_t>({1, 2}, {1, 2}));
  test::check_error([&] { m.logits(tp, ids); },
                    {"[anomaly] ", "in 'model.layers." + std::to_string(last) + ".self_attn'",
                     "forward produced +Inf at [0, 0, 0] (element 0) of (1, 2, "});
}

TEST_CASE("anomaly mode names the norm between attention and MLP by its own path") {
  const lm::ModelConfig c = lm::config_from_json(base_config());
  lm::CausalLM m(c);  // zeros, norms ones
  std::fill_n(std::get<Embedding>(m.model.embed_tokens).weight.value.data<float>(),
              std::get<Embedding>(m.model.embed_tokens).weight.value.numel(), 1.0f);
  const std::size_t last = m.model.layers.size() - 1;
  m.model.layers[last].post_attention_layernorm.weight.value.data<float>()[0] = INFINITY;
  GTape<cpu> tp;
  tp.detect_anomaly(true);
  GVar ids = tp.input(Tensor::from<std::int32_t>({1, 2}, {1, 2}));
  // not 'mlp': the norm feeds the MLP but is a module of the layer
  test::check_error([&] { m.logits(tp, ids); },
                    {"[anomaly] ", "in 'model.layers." + std::to_string(last) + ".post_attention_layernorm'", "+Inf"});
}

}  // namespace lm_model
