// SPDX-License-Identifier: MIT OR Apache-2.0
// GGUF out: the writer (round trips through nn's reader, byte-identical re-serialisation of
// gguf-py's files), the quantizers (gguf-py's / ggml's bytes, ggml's error thresholds), the
// llama-quantize mixtures, model and adapter export, and the errors that leave no file behind.
#include <doctest/doctest.h>

#include "support/check.hpp"

#include <csignal>
#include <cmath>
#include <filesystem>
#include <fstream>

#include <nn/lm.hpp>

#if !defined(_WIN32)
#include <sys/resource.h>
#endif

namespace lm_gguf_export {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using namespace nn::lm;
namespace fs = std::filesystem;

namespace {

const std::string kFix = std::string(NN_FIXTURES_DIR) + "/lm";
const std::string kGguf = kFix + "/models/gguf";

fs::path tmp(const std::string& name) {
  const fs::path d = fs::temp_directory_path() / "nn_gguf_export_test";
  fs::create_directories(d);
  return d / name;
}

std::vector<std::byte> file_bytes(const fs::path& p) {
  std::ifstream in(p, std::ios::binary);
  std::vector<char> c((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  std::vector<std::byte> b(c.size());
  std::memcpy(b.data(), c.data(), c.size());
  return b;
}

// Files in the test folder whose name holds `part` (temporary files left behind).
int leftovers(const fs::path& dir, const std::string& part) {
  int n = 0;
  for (const auto& e : fs::directory_iterator(dir))
    if (e.path().filename().string().find(part) != std::string::npos) ++n;
  return n;
}

// Every parameter of two models, bit for bit.
void check_same_weights(const CausalLM& a, const CausalLM& b) {
  const NamedTensors pa = a.parameters(), pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    INFO(pa[i].first);
    CHECK(pa[i].first == pb[i].first);
    CHECK(pa[i].second.to_doubles() == pb[i].second.to_doubles());
  }
}

}  // namespace

TEST_CASE("gguf_write: metadata of every type and tensors read back identically") {
  GgufWriter w;
  w.set("a.u8", std::uint8_t{200});
  w.set("a.i8", std::int8_t{-100});
  w.set("a.u16", std::uint16_t{60000});
  w.set("a.i16", std::int16_t{-30000});
  w.set("a.u32", std::uint32_t{4000000000u});
  w.set("a.i32", std::int32_t{-2000000000});
  w.set("a.u64", std::uint64_t{1} << 60);
  w.set("a.i64", std::int64_t{-(std::int64_t{1} << 60)});
  w.set("a.f32", 0.1f);
  w.set("a.f64", 0.1);
  w.set("a.bool", true);
  w.set("a.str", "héllo");
  w.set_array("a.ints", std::vector<std::int32_t>{1, -2, 3});
  w.set_array("a.floats", std::vector<float>{0.5f, -1.25f});
  w.set_array("a.strings", std::vector<std::string>{"x", "", "a b"});
  w.set("general.alignment", std::uint32_t{64});
  w.set("a.u8", std::uint8_t{201});  // replaced in place
  w.add_tensor("t.f32", {2, 3}, 0, gguf_quantize(Tensor::from_doubles(Shape{2, 3}, {1, 2, 3, 4, 5, 6}, DType::f32), 0));
  Tensor q = test::random_tensor(Shape{3, 64}, DType::f32, 7);
  w.add_tensor("t.q8", {3, 64}, 8, gguf_quantize(q, 8, "t.q8"));

  const fs::path p = tmp("roundtrip.gguf");
  w.write(p);
  CHECK(file_bytes(p) == w.bytes());
  GgufFile f(p);
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 64);
  CHECK(f.metadata().size() == 16);
  CHECK(f.metadata().front().first == "a.u8");
  CHECK(f.at("a.u8").as_int() == 201);
  CHECK(f.at("a.u8").type() == GgufType::u8);
  CHECK(f.at("a.i8").as_int() == -100);
  CHECK(f.at("a.u16").as_int() == 60000);
  CHECK(f.at("a.i16").as_int() == -30000);
  CHECK(f.at("a.u32").as_int() == 4000000000LL);
  CHECK(f.at("a.i32").as_int() == -2000000000);
  CHECK(f.at("a.u64").as_uint() == std::uint64_t{1} << 60);
  CHECK(f.at("a.u64").type() == GgufType::u64);
  CHECK(f.at("a.i64").as_int() == -(std::int64_t{1} << 60));
  CHECK(f.at("a.f32").type() == GgufType::f32);
  CHECK(f.at("a.f32").as_float() == static_cast<double>(0.1f));
  CHECK(f.at("a.f64").as_float() == 0.1);
  CHECK(f.at("a.bool").as_bool());
  CHECK(f.at("a.str").as_string() == "héllo");
  CHECK(f.at("a.ints").ints() == std::vector<std::int64_t>{1, -2, 3});
  CHECK(f.at("a.ints").array_type() == GgufType::i32);
  CHECK(f.at("a.floats").floats() == std::vector<double>{0.5, -1.25});
  CHECK(f.at("a.strings").strings() == std::vector<std::string>{"x", "", "a b"});
  REQUIRE(f.tensors().size() == 2);
  CHECK(f.tensor_info("t.f32").shape() == std::vector<std::int64_t>{2, 3});
  CHECK(f.tensor("t.f32").to_doubles() == std::vector<double>{1, 2, 3, 4, 5, 6});
  CHECK(f.tensor_info("t.q8").offset % 64 == 0);
  const auto qb = f.tensor_bytes(f.tensor_info("t.q8"));
  CHECK(std::vector<std::byte>(qb.begin(), qb.end()) == gguf_quantize(q, 8));
}

TEST_CASE("gguf_write: copying a gguf-py file's metadata and tensors re-serialises it byte for byte") {
  // gguf-py's GGUFWriter lays a file out as GgufWriter does (v3, infos, aligned data), so copying
  // every key (each type, arrays of strings, nested arrays) and tensor reproduces the file.
  for (const std::string& name : {kGguf + "/llama-F32.gguf", kGguf + "/llama-Q8_0.gguf", kGguf + "/qwen2-F16.gguf",
                                 kFix + "/gguf_quants.gguf"}) {
    INFO(name);
    GgufFile f(name);
    GgufWriter w;
    for (const auto& [k, v] : f.metadata()) w.copy(k, v);
    for (const GgufTensorInfo& t : f.tensors()) {
      const auto b = f.tensor_bytes(t);
      w.add_tensor(t.name, t.shape(), t.type, std::vector<std::byte>(b.begin(), b.end()));
    }
    CHECK(w.bytes() == file_bytes(name));
  }
}

TEST_CASE("gguf_quantize: F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 equal gguf-py's bytes; Q4_K Q5_K Q6_K ggml's reference") {
  GgufFile f(kFix + "/gguf_quantize.gguf");
  const Tensor x = f.tensor("x");
  for (const char* name : {"F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K"}) {
    INFO(name);
    const GgufTensorInfo& t = f.tensor_info(name);
    const std::vector<std::byte> got = gguf_quantize(x, t.type, name);
    const auto want = f.tensor_bytes(t);
    REQUIRE(got.size() == want.size());
    std::size_t diff = 0, first = got.size();
    for (std::size_t i = 0; i < got.size(); ++i)
      if (got[i] != want[i]) {
        ++diff;
        first = std::min(first, i);
      }
    CHECK_MESSAGE(diff == 0, diff << " bytes differ, the first at " << first);
  }
}

TEST_CASE("gguf_quantize: round-trip error within ggml's test-quantize-fns thresholds; dequantized by the reader") {
  // test-quantize-fns: 32 * 128 values 0.1 + 2 cos(i), RMSE / n below 0.002 for these types (and
  // its reference-vs-optimised bound is moot: there is one implementation here).
  const std::int64_t n = 32 * 128;
  std::vector<double> v(static_cast<std::size_t>(n));
  for (std::int64_t i = 0; i < n; ++i) v[static_cast<std::size_t>(i)] = 0.1 + 2.0 * std::cos(static_cast<float>(i));
  const Tensor x = Tensor::from_doubles({1, n}, v, DType::f32);
  for (std::uint32_t type : {8u, 2u, 3u, 6u, 7u, 12u, 13u, 14u}) {
    INFO(std::string(ggml_type_info(type)->name));
    const std::vector<std::byte> q = gguf_quantize(x, type);
    std::vector<float> back(static_cast<std::size_t>(n));
    lm::detail::gguf_dequantize_into(q.data(), type, n, back.data());
    double sum = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      const double d = static_cast<double>(x.data<float>()[i]) - back[static_cast<std::size_t>(i)];
      sum += d * d;
    }
    const double err = std::sqrt(sum) / static_cast<double>(n);
    MESSAGE(std::string(ggml_type_info(type)->name) << ": total quantization error " << err);
    CHECK(err < 0.002);
  }
}

TEST_CASE("gguf_mixture_type: llama-quantize's choices for q8_0, q4_0, q4_k_m, q5_k_m") {
  constexpr std::uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14;
  auto ty = [](const std::string& o, const std::string& n, std::int64_t row, int layer = -1, bool tied = false, int dims = 2) {
    return gguf_mixture_type(o, n, row, dims, layer, 32, tied);
  };
  CHECK(ty("q4_k_m", "blk.0.attn_norm.weight", 4096, 0, false, 1) == F32);
  CHECK(ty("f16", "blk.0.attn_q.weight", 4096, 0) == F16);
  CHECK(ty("f16", "blk.0.attn_q.bias", 4096, 0, false, 1) == F32);
  // The output matrix: Q6_K, or Q8_0 when rows do not split into the mixture's blocks.
  CHECK(ty("q4_k_m", "output.weight", 4096) == Q6_K);
  CHECK(ty("q4_0", "output.weight", 4096) == Q6_K);
  CHECK(ty("q8_0", "output.weight", 4096) == Q8_0);
  CHECK(ty("q4_k_m", "output.weight", 576) == Q8_0);
  CHECK(ty("q4_k_m", "token_embd.weight", 4096, -1, true) == Q6_K);   // tied: the output's type
  CHECK(ty("q4_k_m", "token_embd.weight", 4096, -1, false) == Q4_K);  // untied: the base type
  // use_more_bits(i, 32): i < 4, i >= 28, (i - 4) % 3 == 2.
  for (int i : {0, 3, 6, 9, 28, 31}) CHECK(ty("q4_k_m", "blk." + std::to_string(i) + ".attn_v.weight", 4096, i) == Q6_K);
  for (int i : {4, 5, 7, 26}) CHECK(ty("q4_k_m", "blk." + std::to_string(i) + ".attn_v.weight", 4096, i) == Q4_K);
  CHECK(ty("q4_k_m", "blk.0.ffn_down.weight", 11008, 0) == Q6_K);
  CHECK(ty("q5_k_m", "blk.5.ffn_down.weight", 11008, 5) == Q5_K);
  CHECK(ty("q5_k_m", "blk.6.ffn_down.weight", 11008, 6) == Q6_K);
  CHECK(ty("q4_k_m", "blk.5.attn_q.weight", 4096, 5) == Q4_K);
  CHECK(ty("q4_0", "blk.0.attn_v.weight", 4096, 0) == Q4_0);
  // Rows that do not split into 256: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0; not into 32: F16.
  CHECK(ty("q4_k_m", "blk.5.attn_q.weight", 576, 5) == Q5_0);
  CHECK(ty("q5_k_m", "blk.5.attn_q.weight", 576, 5) == Q5_1);
  CHECK(ty("q4_k_m", "blk.0.attn_v.weight", 576, 0) == Q8_0);
  CHECK(ty("q8_0", "blk.0.attn_v.weight", 48, 0) == F16);
  test::check_error([&] { ty("q3_k", "blk.0.attn_q.weight", 256, 0); }, {"unknown --outtype 'q3_k'"});
}

TEST_CASE("save_gguf: an F32 export reloads to the same weights (names, q/k permutation, metadata carried)") {
  for (const std::string& src : {kGguf + "/llama-F32.gguf", kGguf + "/qwen2-F16.gguf"}) {
    INFO(src);
    GgufFile f(src);
    CausalLM m = load_gguf(f);
    const fs::path out = tmp("export-f32.gguf");
    save_gguf(out, m, f, "f32");
    GgufFile g(out);
    check_same_weights(m, load_gguf(g));
    for (const auto& [k, v] : f.metadata()) {
      if (k == "general.file_type" || k == "general.alignment" || k == "general.quantization_version") continue;
      INFO(k);
      REQUIRE(g.find(k) != nullptr);
      CHECK(g.at(k).type() == v.type());
    }
    CHECK(g.at("general.file_type").as_int() == 0);
    // The stored (permuted) tensors equal the source's where the source was F32 or F16: exactly
    // the convert_hf_to_gguf layout.
    for (const GgufTensorInfo& t : f.tensors()) {
      INFO(t.name);
      CHECK(g.tensor(t.name).to_doubles() == f.tensor(t).to_doubles());
    }
  }
}

TEST_CASE("save_gguf: f16, bf16, q8_0, q4_k_m and same exports hold each tensor quantized as gguf_quantize makes it") {
  GgufFile f(kGguf + "/llama-F32.gguf");
  CausalLM m = load_gguf(f);
  for (const char* oc : {"f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m"}) {
    const std::string o = oc;
    INFO(o);
    const fs::path out = tmp("export-" + o + ".gguf");
    const GgufExportReport r = save_gguf(out, m, f, o);
    GgufFile g(out);
    const int n_layers = static_cast<int>(m.config().num_hidden_layers);
    std::uint64_t bytes = 0;
    for (const GgufTensorInfo& t : g.tensors()) {
      INFO(t.name);
      const GgufTensorInfo& s = f.tensor_info(t.name);
      const int layer = t.name.rfind("blk.", 0) == 0 ? std::stoi(t.name.substr(4)) : -1;
      CHECK(t.type == gguf_mixture_type(o, t.name, t.ne[0], static_cast<int>(t.ne.size()), layer, n_layers, false));
      const auto got = g.tensor_bytes(t);
      const auto src = f.tensor(s);  // the source's stored (permuted) F32 values
      CHECK(std::vector<std::byte>(got.begin(), got.end()) == gguf_quantize(src, t.type, t.name));
      bytes += t.nbytes;
    }
    CHECK(r.bytes == bytes);
    // And it loads back as a model.
    CHECK(load_gguf(g).config().hidden_size == m.config().hidden_size);
  }
  // same: each tensor in the source's type.
  GgufFile q(kGguf + "/llama-Q8_0.gguf");
  CausalLM mq = load_gguf(q);
  save_gguf(tmp("export-same.gguf"), mq, q, "same");
  GgufFile gs(tmp("export-same.gguf"));
  for (const GgufTensorInfo& t : q.tensors()) {
    INFO(t.name);
    CHECK(gs.tensor_info(t.name).type == t.type);
    if (t.type == 8) {  // re-quantizing a Q8_0 tensor's own values gives its bytes back
      const auto a = gs.tensor_bytes(gs.tensor_info(t.name)), b = q.tensor_bytes(t);
      CHECK(std::vector<std::byte>(a.begin(), a.end()) == std::vector<std::byte>(b.begin(), b.end()));
    }
  }
}

TEST_CASE("save_gguf_adapter: llama.cpp's LoRA layout; base + (alpha / r) B A equals the fused model") {
  GgufFile f(kGguf + "/llama-F32.gguf");
  CausalLM m = load_gguf(f, DType::f64);
  m.freeze();
  LoraConfig cfg;
  cfg.rank = 4;
  cfg.scale = 3.0;
  cfg.keys = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.down_proj"};
  apply_lora(m, cfg);
  std::uint64_t seed = 3;
  m.map_modules<LoraLinear>([](const std::string&) { return true; }, [&](const std::string&, LoraLinear& l) {
    l.lora_b.value = test::random_tensor(l.lora_b.shape(), DType::f64, seed++);
    l.scale(cfg.scale);
  });
  const fs::path out = tmp("adapter.gguf");
  save_gguf_adapter(out, m, cfg, m.config());
  GgufFile a(out);
  CHECK(a.at("general.type").as_string() == "adapter");
  CHECK(a.at("adapter.type").as_string() == "lora");
  CHECK(a.at("general.architecture").as_string() == "llama");
  const double alpha = a.at("adapter.lora.alpha").as_float();
  CHECK(alpha == 12.0);
  // Fuse in nn, export F32: W_fused (stored layout) must equal W + alpha / r * B A from the files.
  CausalLM fused = m;
  fused.map_modules<LoraLinear>([](const std::string&) { return true; }, [](const std::string&, const LoraLinear& l) {
    return l.fused();
  });
  save_gguf(tmp("fused.gguf"), fused, f, "f32");
  GgufFile gf(tmp("fused.gguf"));
  int pairs = 0;
  for (const GgufTensorInfo& t : a.tensors()) {
    if (!t.name.ends_with(".lora_a")) continue;
    const std::string base = t.name.substr(0, t.name.size() - 7);
    const Tensor A = a.tensor(t, DType::f64), B = a.tensor(base + ".lora_b", DType::f64);
    const Tensor W = f.tensor(base, DType::f64), Wf = gf.tensor(base, DType::f64);
    INFO(base);
    REQUIRE(A.dim(1) == W.dim(1));  // (r, in)
    REQUIRE(B.dim(0) == W.dim(0));  // (out, r)
    REQUIRE(A.dim(0) == 4);
    const std::int64_t out_d = W.dim(0), in_d = W.dim(1), r = A.dim(0);
    std::vector<double> want(static_cast<std::size_t>(out_d * in_d));
    const double* w = W.data<double>();
    const double* pa = A.data<double>();
    const double* pb = B.data<double>();
    for (std::int64_t o = 0; o < out_d; ++o)
      for (std::int64_t i = 0; i < in_d; ++i) {
        double s = 0;
        for (std::int64_t k = 0; k < r; ++k) s += pb[o * r + k] * pa[k * in_d + i];
        want[static_cast<std::size_t>(o * in_d + i)] = w[o * in_d + i] + alpha / static_cast<double>(r) * s;
      }
    CHECK(test::rel_err(Wf.to_doubles(), want) < 1e-6);  // the fused file is f32
    ++pairs;
  }
  CHECK(pairs == 4 * static_cast<int>(m.config().num_hidden_layers));
}

TEST_CASE("gguf export errors name the tensor or file and leave no file behind") {
  GgufFile f(kGguf + "/llama-F32.gguf");
  CausalLM m = load_gguf(f);
  const fs::path dir = fs::temp_directory_path() / "nn_gguf_export_test";
  // A model with LoRA layers still in it.
  CausalLM lm = m;
  lm.freeze();
  LoraConfig cfg;
  cfg.keys = {"self_attn.q_proj"};
  apply_lora(lm, cfg);
  test::check_error([&] { save_gguf(dir / "bad1.gguf", lm, f, "f16"); }, {"bad1.gguf", "LoRA", "fuse them first"});
  CHECK_FALSE(fs::exists(dir / "bad1.gguf"));
  test::check_error([&] { save_gguf(dir / "bad2.gguf", m, f, "q3_k"); }, {"unknown --outtype 'q3_k'"});
  test::check_error([&] { save_gguf_adapter(dir / "bad3.gguf", m, cfg, m.config()); }, {"no LoRA layers"});
  CHECK_FALSE(fs::exists(dir / "bad3.gguf"));
  // A source of another architecture.
  test::check_error([&] { save_gguf(dir / "bad4.gguf", m, GgufFile(kGguf + "/qwen2-F16.gguf"), "f16"); },
                    {"'qwen2' model", "'llama'"});
  // A tensor llama.cpp has no name for (an MoE expert, say), and names that map both ways.
  test::check_error([] { lm::detail::hf_to_gguf_name("model.layers.0.mlp.experts.0.w1.weight", "out.gguf"); },
                    {"out.gguf", "model.layers.0.mlp.experts.0.w1.weight", "no llama.cpp name"});
  for (const auto& [hf, t] : m.parameters())
    CHECK(lm::detail::gguf_to_hf_name(lm::detail::hf_to_gguf_name(hf, "x")) == hf);
  // Rows that do not split into the type's blocks, and names ggml cannot hold.
  test::check_error([&] { gguf_quantize(Tensor::zeros({2, 48}), 12, "blk.0.ffn_up.weight"); },
                    {"blk.0.ffn_up.weight", "rows of 48", "Q4_K blocks of 256"});
  GgufWriter w;
  test::check_error([&] { w.add_tensor("t", {2, 48}, 8, std::vector<std::byte>(100)); }, {"\"t\"", "Q8_0 blocks of 32"});
  test::check_error([&] { w.add_tensor(std::string(64, 'n'), {4}, 0, std::vector<std::byte>(16)); }, {"1 to 63 bytes"});
  test::check_error([&] { w.add_tensor("t", {4}, 0, std::vector<std::byte>(12)); }, {"12 bytes given", "takes 16"});
#if !defined(_WIN32)
  // A full disk: /dev/full refuses every write with ENOSPC.
  if (fs::exists("/dev/full")) {
    test::check_error([&] { save_gguf("/dev/full", m, f, "f16"); }, {"/dev/full", "No space left on device"});
  }
  // A file-size limit hit half way (the way a small disk fills): an error, no target, no temporary.
  struct rlimit old {};
  getrlimit(RLIMIT_FSIZE, &old);
  auto* prev = std::signal(SIGXFSZ, SIG_IGN);
  struct rlimit small = old;
  small.rlim_cur = 20000;
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  bool raised = false;
  try {
    save_gguf(dir / "limited.gguf", m, f, "f32");
  } catch (const nn::Error& e) {
    raised = std::string(e.what()).find("limited.gguf") != std::string::npos;
  }
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, prev);
  CHECK(raised);
  CHECK_FALSE(fs::exists(dir / "limited.gguf"));
  CHECK(leftovers(dir, "limited.gguf.tmp") == 0);
  // An existing file is left as it was when the new write fails.
  save_gguf(dir / "keep.gguf", m, f, "q8_0");
  const auto before = file_bytes(dir / "keep.gguf");
  getrlimit(RLIMIT_FSIZE, &old);
  prev = std::signal(SIGXFSZ, SIG_IGN);
  REQUIRE(setrlimit(RLIMIT_FSIZE, &small) == 0);
  CHECK_THROWS_AS(save_gguf(dir / "keep.gguf", m, f, "f32"), nn::Error);
  setrlimit(RLIMIT_FSIZE, &old);
  std::signal(SIGXFSZ, prev);
  CHECK(file_bytes(dir / "keep.gguf") == before);
  CHECK(leftovers(dir, "keep.gguf.tmp") == 0);
#endif
}

TEST_CASE("save_gguf from a Hugging Face folder: convert_hf_to_gguf's tensors and keys, a tokenizer that encodes as tokenizer.json") {
  const std::string tok_dir = kFix + "/tokenizer";
  nlohmann::json expected;  // transformers' ids for probe texts, per real tokenizer
  {
    std::ifstream in(tok_dir + "/expected.json");
    expected = nlohmann::json::parse(in).at("real");
    std::ifstream spm(tok_dir + "/spm_expected.json");  // SentencePiece-style (Llama 2's layout)
    expected["spm"]["probes"] = nlohmann::json::parse(spm).at("variants").at("llama").at("probes");
  }
  const GgufFile ref(kGguf + "/llama-F32.gguf");  // the tiny llama as convert_hf_to_gguf lays it out
  for (const char* short_name : {"gpt2", "llama3", "qwen2", "spm"}) {
    const bool spm = std::string(short_name) == "spm";
    const std::string name = spm ? "spm_tokenizer" : "real_" + std::string(short_name);
    INFO(name);
    const fs::path folder = tmp("hf-" + name);
    fs::create_directories(folder);
    for (const char* f : {"config.json", "model.safetensors"})
      fs::copy_file(kFix + "/models/llama/" + f, folder / f, fs::copy_options::overwrite_existing);
    fs::copy_file(tok_dir + "/" + name + ".json", folder / "tokenizer.json", fs::copy_options::overwrite_existing);
    {
      std::ofstream tc(folder / "tokenizer_config.json");
      tc << R"({"chat_template": "{% for m in messages %}{{ m.content }}{% endfor %}"})";
    }
    Pretrained pt = load_pretrained(folder);
    const fs::path out = tmp("hf-" + name + ".gguf");
    save_gguf(out, pt.model, folder, "f32");
    GgufFile g(out);
    check_same_weights(pt.model, load_gguf(g));
    for (const GgufTensorInfo& t : ref.tensors()) {  // the same names, layout and bytes
      INFO(t.name);
      const auto a = g.tensor_bytes(g.tensor_info(t.name)), b = ref.tensor_bytes(t);
      CHECK(std::vector<std::byte>(a.begin(), a.end()) == std::vector<std::byte>(b.begin(), b.end()));
    }
    CHECK(g.tensors().size() == ref.tensors().size());
    for (const auto& [k, v] : ref.metadata()) {
      if (k.rfind("llama.", 0) != 0) continue;
      INFO(k);
      REQUIRE(g.find(k) != nullptr);
      CHECK(g.at(k).as_float() == v.as_float());
    }
    CHECK(g.at("tokenizer.chat_template").as_string() == "{% for m in messages %}{{ m.content }}{% endfor %}");
    // The template comes with the model, from the folder and from the GGUF.
    CHECK(pt.chat_template == "{% for m in messages %}{{ m.content }}{% endfor %}");
    CHECK(load_pretrained(out).chat_template == pt.chat_template);
    // The tokenizer llama.cpp gets encodes as tokenizer.json does (and transformers: the
    // recorded ids), on every probe whose text NFC leaves alone: llama.cpp applies no normalizer,
    // and Qwen2's tokenizer.json has NFC.
    const Tokenizer from_gguf = gguf_tokenizer(g);
    int probes = 0;
    for (const auto& p : expected[short_name]["probes"]) {
      if (!p.value("nfc_stable", true)) continue;
      const std::string text = p["text"].get<std::string>();
      CHECK(from_gguf.encode(text) == pt.tokenizer.encode(text));
      CHECK(from_gguf.encode(text) == p["ids"].get<std::vector<std::int32_t>>());
      ++probes;
    }
    CHECK(probes > 50);
    CHECK(g.at("tokenizer.ggml.model").as_string() == (spm ? "llama" : "gpt2"));
    if (spm) {
      // Scores from the merge ranks: llama.cpp's rule gives the merges' ids on the whole sample.
      std::ifstream in(tok_dir + "/corpus_sample.json");
      const nlohmann::json sample = nlohmann::json::parse(in);
      std::size_t chunks = 0;
      for (const auto& c : sample.at("chunks")) {
        const std::string text = c.get<std::string>();
        INFO("chunk ", chunks, ": ", text.substr(0, 60));
        CHECK(from_gguf.encode(text) == pt.tokenizer.encode(text));
        ++chunks;
      }
      CHECK(chunks > 100);
      CHECK(from_gguf.sentencepiece());
      CHECK(from_gguf.unk_id() == 0);
    }
    CHECK(from_gguf.bos_id() == pt.tokenizer.bos_id());
    CHECK(from_gguf.eos_id() == pt.tokenizer.eos_id());
  }
  // same: the checkpoint's torch_dtype (float32 here).
  const fs::path folder = tmp("hf-real_gpt2");
  save_gguf(tmp("hf-same.gguf"), load_pretrained(folder).model, folder, "same");
  CHECK(GgufFile(tmp("hf-same.gguf")).tensor_info("blk.0.attn_q.weight").type == 0);
}

}  // namespace lm_gguf_export
