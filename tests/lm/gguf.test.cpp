// SPDX-License-Identifier: MIT OR Apache-2.0
// The GGUF reader and loader (include/nn/lm/gguf.hpp, load.hpp): metadata of every value type,
// the tokenizer metadata, dequantisation against gguf-py (bit for bit) and against hand-made
// blocks, GGUF-loaded logits against transformers run on the dequantised weights
// (tests/oracle/gen_lm_models.py), the q/k un-permutation, and malformed files — every
// truncation, bad magic and version, absurd counts and lengths, out-of-range, misaligned and
// overlapping offsets, random byte flips — each raising nn::Error.
#include <cmath>
#include <fstream>
#include <functional>
#include <random>

#include "support/check.hpp"

#include <nn/lm/load.hpp>

namespace lm_gguf {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using lm::GgufFile;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";
const std::string kGguf = kModels + "/gguf";

const SafetensorsFile& expected() {
  static const SafetensorsFile f(kModels + "/expected.safetensors");
  return f;
}
const nlohmann::json& expected_json() {
  static const nlohmann::json j = [] {
    std::ifstream in(kModels + "/expected.json");
    return nlohmann::json::parse(in);
  }();
  return j;
}

Tensor run_logits(const lm::CausalLM& m) {
  GTape<cpu> tp;
  GVar ids = tp.input(expected().tensor("ids").to(DType::i64));
  return tp.value(m.logits(tp, ids, expected().tensor("keep"))).to(DType::f64);
}

// ---- a GGUF writer for hand-made (and broken) files ---------------------------------------------

using Bytes = std::vector<std::byte>;

template <class T>
void put(Bytes& b, T v) {
  const auto* p = reinterpret_cast<const std::byte*>(&v);
  b.insert(b.end(), p, p + sizeof(T));
}
void put_str(Bytes& b, const std::string& s) {
  put<std::uint64_t>(b, s.size());
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  b.insert(b.end(), p, p + s.size());
}

using KvWriter = std::function<void(Bytes&)>;
KvWriter kv_u32(const std::string& k, std::uint32_t v) {
  return [=](Bytes& b) { put_str(b, k); put<std::uint32_t>(b, 4); put(b, v); };
}
KvWriter kv_str(const std::string& k, const std::string& v) {
  return [=](Bytes& b) { put_str(b, k); put<std::uint32_t>(b, 8); put_str(b, v); };
}
KvWriter kv_f32(const std::string& k, float v) {
  return [=](Bytes& b) { put_str(b, k); put<std::uint32_t>(b, 6); put(b, v); };
}

struct TensorSpec {
  std::string name;
  std::vector<std::uint64_t> ne;
  std::uint32_t type = 0;
  Bytes data;
  std::optional<std::uint64_t> offset;  // default: packed in order, aligned
};

struct FileSpec {
  std::string magic = "GGUF";
  std::uint32_t version = 3;
  std::optional<std::uint64_t> n_tensors, n_kv;  // default: the real counts
  std::vector<KvWriter> kv;
  std::vector<TensorSpec> tensors;
  std::uint64_t alignment = 32;  // the layout's (add general.alignment to kv when not 32)
};

Bytes build(const FileSpec& s) {
  Bytes b;
  for (char c : s.magic) b.push_back(static_cast<std::byte>(c));
  put(b, s.version);
  put<std::uint64_t>(b, s.n_tensors.value_or(s.tensors.size()));
  put<std::uint64_t>(b, s.n_kv.value_or(s.kv.size()));
  for (const auto& w : s.kv) w(b);
  std::vector<std::uint64_t> offs;
  std::uint64_t at = 0;
  for (const auto& t : s.tensors) {
    offs.push_back(t.offset.value_or(at));
    at = (at + t.data.size() + s.alignment - 1) / s.alignment * s.alignment;
    put_str(b, t.name);
    put<std::uint32_t>(b, static_cast<std::uint32_t>(t.ne.size()));
    for (auto e : t.ne) put(b, e);
    put(b, t.type);
    put(b, offs.back());
  }
  while (b.size() % s.alignment) b.push_back(std::byte{0});
  const std::size_t data = b.size();
  for (std::size_t i = 0; i < s.tensors.size(); ++i) {
    const auto& t = s.tensors[i];
    if (t.offset) continue;  // a deliberately placed tensor writes no bytes of its own
    if (b.size() < data + offs[i]) b.resize(static_cast<std::size_t>(data + offs[i]), std::byte{0});
    b.insert(b.end(), t.data.begin(), t.data.end());  // no padding after the last tensor
  }
  return b;
}

/// A small valid file: two tensors and a few keys.
FileSpec small_spec() {
  FileSpec s;
  s.kv = {kv_str("general.architecture", "llama"), kv_u32("llama.block_count", 1), kv_f32("x.scale", 0.5f)};
  Bytes a;
  for (int i = 0; i < 64; ++i) put(a, static_cast<float>(i) - 3.5f);
  s.tensors.push_back({"a.weight", {32, 2}, 0, a, std::nullopt});
  Bytes q;  // one Q8_0 block: d = 1, q = -16 .. 15
  put<std::uint16_t>(q, 0x3C00);
  for (int j = 0; j < 32; ++j) q.push_back(static_cast<std::byte>(static_cast<std::int8_t>(j - 16)));
  s.tensors.push_back({"b.weight", {32}, 8, q, std::nullopt});
  return s;
}

void expect_bad(const Bytes& bytes, std::initializer_list<std::string> frags) {
  test::check_error([&] { GgufFile::from_bytes(bytes, "bad.gguf"); }, frags);
}

}  // namespace

// ---- the reader on hand-made files -----------------------------------------------------------

TEST_CASE("gguf: a hand-made file parses; header, metadata and tensors read back") {
  GgufFile f = GgufFile::from_bytes(build(small_spec()), "small.gguf");
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.data_offset() % 32 == 0);
  CHECK(f.metadata().size() == 3);
  CHECK(f.at("general.architecture").as_string() == "llama");
  CHECK(f.at("llama.block_count").as_int() == 1);
  CHECK(f.at("x.scale").as_float() == 0.5);
  REQUIRE(f.tensors().size() == 2);
  const lm::GgufTensorInfo& a = f.tensor_info("a.weight");
  CHECK(a.shape() == std::vector<std::int64_t>{2, 32});
  CHECK(a.nbytes == 256);
  CHECK(std::string(a.type_name()) == "F32");
  Tensor t = f.tensor("a.weight");
  CHECK(t.shape() == Shape{2, 32});
  CHECK(t.item(0) == -3.5);
  CHECK(t.item(63) == 59.5);
  Tensor q = f.tensor("b.weight", DType::f64);
  CHECK(q.dtype() == DType::f64);
  for (int j = 0; j < 32; ++j) CHECK(q.item(j) == j - 16);
  test::check_error([&] { f.tensor("nope"); }, {"[gguf]", "small.gguf", "no tensor named \"nope\""});
  test::check_error([&] { f.at("nope"); }, {"small.gguf", "missing metadata key \"nope\""});
  test::check_error([&] { f.at("llama.block_count").as_string(); }, {"\"llama.block_count\"", "expected a string", "uint32"});
  test::check_error([&] { f.tensor("a.weight", DType::bf16); }, {"float32 or float64"});
  // Version 2 has the same layout.
  FileSpec v2 = small_spec();
  v2.version = 2;
  CHECK(GgufFile::from_bytes(build(v2)).version() == 2);
}

TEST_CASE("gguf: Q4_0, Q4_1, Q8_0, F16, BF16 blocks dequantise as ggml lays them out") {
  FileSpec s;
  Bytes q40;  // d = 0.5; byte j: low nibble j, high nibble 15 - j
  put<std::uint16_t>(q40, 0x3800);
  for (int j = 0; j < 16; ++j) q40.push_back(static_cast<std::byte>(j | ((15 - j) << 4)));
  Bytes q41;  // d = 0.25, m = -1; the same nibbles
  put<std::uint16_t>(q41, 0x3400);
  put<std::uint16_t>(q41, 0xBC00);
  for (int j = 0; j < 16; ++j) q41.push_back(static_cast<std::byte>(j | ((15 - j) << 4)));
  Bytes q80;  // d = -2, q = 3j - 50
  put<std::uint16_t>(q80, 0xC000);
  for (int j = 0; j < 32; ++j) q80.push_back(static_cast<std::byte>(static_cast<std::int8_t>(3 * j - 50)));
  Bytes f16, bf16;
  for (std::uint16_t h : {0x3C00, 0xC000, 0x3555, 0x0001}) put(f16, h);   // 1, -2, 0.333251953125, 2^-24
  for (std::uint16_t h : {0x3F80, 0xC040, 0x3EAB, 0x0001}) put(bf16, h);  // 1, -3, 0.333984375, subnormal
  s.tensors = {{"q40", {32}, 2, q40, {}}, {"q41", {32}, 3, q41, {}}, {"q80", {32}, 8, q80, {}},
               {"f16", {4}, 1, f16, {}}, {"bf16", {4}, 30, bf16, {}}};
  GgufFile f = GgufFile::from_bytes(build(s));
  for (DType dt : {DType::f32, DType::f64}) {
    Tensor a = f.tensor("q40", dt), b = f.tensor("q41", dt), c = f.tensor("q80", dt);
    for (int j = 0; j < 16; ++j) {
      CHECK(a.item(j) == (j - 8) * 0.5);  // low nibbles: elements 0..15
      CHECK(a.item(j + 16) == (15 - j - 8) * 0.5);  // high nibbles: elements 16..31
      CHECK(b.item(j) == j * 0.25 - 1);
      CHECK(b.item(j + 16) == (15 - j) * 0.25 - 1);
    }
    for (int j = 0; j < 32; ++j) CHECK(c.item(j) == (3 * j - 50) * -2.0);
    Tensor h = f.tensor("f16", dt), g = f.tensor("bf16", dt);
    CHECK(h.item(0) == 1.0);
    CHECK(h.item(1) == -2.0);
    CHECK(h.item(2) == 0.333251953125);
    CHECK(h.item(3) == std::ldexp(1.0, -24));
    CHECK(g.item(0) == 1.0);
    CHECK(g.item(1) == -3.0);
    CHECK(g.item(2) == 0.333984375);
    CHECK(g.item(3) == static_cast<double>(std::bit_cast<float>(std::uint32_t{1} << 16)));
  }
}

TEST_CASE("gguf: types it sizes but does not dequantise are refused by name") {
  FileSpec s;
  s.tensors = {{"k", {256}, 23, Bytes(136, std::byte{0}), {}}};  // one IQ4_XS super-block
  GgufFile f = GgufFile::from_bytes(build(s), "k.gguf");
  CHECK(f.tensor_info("k").nbytes == 136);
  test::check_error([&] { f.tensor("k"); }, {"[gguf]", "k.gguf", "\"k\"", "IQ4_XS", "does not dequantise"});
  CHECK_FALSE(GgufFile::keeps_quantized(23));
  test::check_error([&] { (void)f.quantized(f.tensor_info("k")); }, {"[gguf]", "\"k\"", "IQ4_XS", "not a matrix"});
}

// ---- malformed files -------------------------------------------------------------------------

TEST_CASE("gguf: every truncation of a valid file raises nn::Error") {
  const Bytes full = build(small_spec());
  CHECK_NOTHROW(GgufFile::from_bytes(full));
  int raised = 0;
  for (std::size_t n = 0; n < full.size(); ++n) {
    Bytes cut(full.begin(), full.begin() + static_cast<std::ptrdiff_t>(n));
    try {
      GgufFile::from_bytes(cut, "cut.gguf");
      FAIL("a file cut to " << n << " of " << full.size() << " bytes was accepted");
    } catch (const nn::Error& e) {
      ++raised;
      CHECK(std::string(e.what()).rfind("[gguf] cut.gguf: ", 0) == 0);
    }
  }
  CHECK(raised == static_cast<int>(full.size()));
  // And the real fixture, cut inside its metadata, its tensor infos and its data.
  std::ifstream in(kGguf + "/llama-Q4_0.gguf", std::ios::binary);
  in.seekg(0, std::ios::end);
  Bytes real(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(real.data()), static_cast<std::streamsize>(real.size()));
  for (std::size_t n : {std::size_t{3}, std::size_t{23}, std::size_t{500}, real.size() / 4, real.size() / 2, real.size() - 1})
    test::check_error([&] { GgufFile::from_bytes(Bytes(real.begin(), real.begin() + static_cast<std::ptrdiff_t>(n))); },
                      {"[gguf]"});
}

TEST_CASE("gguf: bad magic, versions, counts, lengths, types, offsets and layouts each raise") {
  FileSpec s = small_spec();
  s.magic = "GGML";
  expect_bad(build(s), {"bad.gguf", "bad magic"});
  s.magic = "FUGG";
  expect_bad(build(s), {"big-endian"});
  s = small_spec();
  s.version = 1;
  expect_bad(build(s), {"version 1", "not supported"});
  s.version = 4;
  expect_bad(build(s), {"unsupported GGUF version 4"});
  s.version = 0x03000000;
  expect_bad(build(s), {"big-endian"});
  s = small_spec();
  s.n_tensors = std::uint64_t{1} << 60;
  expect_bad(build(s), {"absurd tensor count"});
  s = small_spec();
  s.n_kv = ~std::uint64_t{0};
  expect_bad(build(s), {"absurd metadata count"});
  s = small_spec();
  s.n_kv = 4;  // one more than written: the 4th key reads tensor-info bytes and runs off
  CHECK_THROWS_AS(GgufFile::from_bytes(build(s)), nn::Error);

  auto with_kv = [](KvWriter w) {
    FileSpec f = small_spec();
    f.kv.push_back(std::move(w));
    return build(f);
  };
  expect_bad(with_kv([](Bytes& b) { put<std::uint64_t>(b, 1ull << 62); }), {"the file ends while reading a metadata key", "left"});
  expect_bad(with_kv([](Bytes& b) { put_str(b, "k"); put<std::uint32_t>(b, 13); }), {"\"k\"", "unknown value type 13"});
  expect_bad(with_kv([](Bytes& b) { put_str(b, "k"); put<std::uint32_t>(b, 8); put<std::uint64_t>(b, 1ull << 40); }),
             {"the value of \"k\"", "1099511627776 bytes"});
  expect_bad(with_kv([](Bytes& b) {
               put_str(b, "arr");
               put<std::uint32_t>(b, 9);
               put<std::uint32_t>(b, 5);
               put<std::uint64_t>(b, 1ull << 61);
             }),
             {"\"arr\"", "absurd array length"});
  expect_bad(with_kv([](Bytes& b) {
               put_str(b, "arr");
               put<std::uint32_t>(b, 9);
               put<std::uint32_t>(b, 8);  // strings: 8 bytes each at least
               put<std::uint64_t>(b, 1ull << 30);
             }),
             {"absurd array length"});
  expect_bad(with_kv([](Bytes& b) {
               put_str(b, "arr");
               put<std::uint32_t>(b, 9);
               put<std::uint32_t>(b, 77);
               put<std::uint64_t>(b, 1);
             }),
             {"\"arr\"", "unknown array element type 77"});
  expect_bad(with_kv([](Bytes& b) {  // an array of arrays of ... 12 deep
               put_str(b, "deep");
               put<std::uint32_t>(b, 9);
               for (int i = 0; i < 12; ++i) {
                 put<std::uint32_t>(b, 9);
                 put<std::uint64_t>(b, 1);
               }
             }),
             {"nested deeper than 8"});
  expect_bad(with_kv(kv_u32("llama.block_count", 2)), {"duplicate metadata key \"llama.block_count\""});
  expect_bad(with_kv(kv_u32("general.alignment", 48)), {"general.alignment must be a power of two, got 48"});
  expect_bad(with_kv(kv_u32("general.alignment", 0)), {"power of two"});
  expect_bad(with_kv(kv_str("general.alignment", "32")), {"general.alignment must be a uint32", "string"});

  auto with_tensor = [](TensorSpec t) {
    FileSpec f = small_spec();
    f.tensors.push_back(std::move(t));
    return build(f);
  };
  expect_bad(with_tensor({"a.weight", {32}, 0, Bytes(128), {}}), {"duplicate tensor name \"a.weight\""});
  expect_bad(with_tensor({"t", {}, 0, Bytes(4), {}}), {"\"t\"", "rank 0"});
  expect_bad(with_tensor({"t", {1, 1, 1, 1, 1}, 0, Bytes(4), {}}), {"\"t\"", "rank 5"});
  expect_bad(with_tensor({"t", {32}, 99, Bytes(128), {}}), {"\"t\"", "unknown ggml type 99"});
  expect_bad(with_tensor({"t", {33}, 8, Bytes(34), {}}), {"\"t\"", "33 is not a multiple of Q8_0's block of 32"});
  expect_bad(with_tensor({"t", {1ull << 40, 1ull << 40}, 0, Bytes(4), {}}), {"\"t\"", "overflow"});
  expect_bad(with_tensor({"t", {1ull << 63}, 0, Bytes(4), {}}), {"\"t\"", "overflow"});
  expect_bad(with_tensor({"t", {8}, 0, {}, std::uint64_t{7}}), {"\"t\"", "offset 7 is not a multiple of the alignment 32"});
  expect_bad(with_tensor({"t", {8}, 0, {}, std::uint64_t{1} << 40}), {"\"t\"", "run past the end of the file"});
  expect_bad(with_tensor({"t", {8}, 0, {}, ~std::uint64_t{31}}), {"\"t\"", "run past the end of the file"});
  expect_bad(with_tensor({"t", {8}, 0, {}, std::uint64_t{0}}), {"overlap"});  // on top of a.weight
  expect_bad(with_tensor({"t", {1ull << 20}, 0, Bytes(16), {}}), {"\"t\"", "run past the end of the file"});
}

TEST_CASE("gguf: empty tensors with huge dimensions (found by tests/fuzz/gguf_fuzz.cpp)") {
  auto with_tensor = [](TensorSpec t) {
    FileSpec f = small_spec();
    f.tensors.push_back(std::move(t));
    return build(f);
  };
  // Zero elements, but the other dimensions multiply past int64 (Shape::numel overflowed).
  expect_bad(with_tensor({"t", {0, 1ull << 40, 1ull << 40}, 0, {}, {}}), {"\"t\"", "dimension 1099511627776", "overflow"});
  // An empty Q4_0 matrix of 2^40 rows: its bytes are 0, so the file holds it; quantized() looped
  // over every row. It is refused by name, and reads as an empty tensor.
  GgufFile f = GgufFile::from_bytes(with_tensor({"q", {0, 1ull << 40}, 2, {}, {}}), "empty.gguf");
  CHECK(f.tensor("q").numel() == 0);
  test::check_error([&] { (void)f.quantized(f.tensor_info("q")); }, {"empty.gguf", "\"q\"", "no elements"});
}

TEST_CASE("gguf: random byte flips either parse or raise nn::Error, never crash") {
  const Bytes full = build(small_spec());
  std::mt19937_64 rng(7);
  int ok = 0, raised = 0;
  for (int trial = 0; trial < 3000; ++trial) {
    Bytes b = full;
    const int flips = 1 + static_cast<int>(rng() % 3);
    for (int k = 0; k < flips; ++k) b[rng() % b.size()] = static_cast<std::byte>(rng() & 0xFF);
    try {
      GgufFile f = GgufFile::from_bytes(b);
      for (const auto& t : f.tensors())
        if (lm::ggml_type_info(t.type)->dequantises) f.tensor(t);
      ++ok;
    } catch (const nn::Error&) {
      ++raised;
    }
  }
  MESSAGE("random flips: " << ok << " parsed, " << raised << " raised nn::Error");
  CHECK(ok + raised == 3000);
  CHECK(raised > 0);
}

// ---- the fixture files (written by gguf-py) ----------------------------------------------------

TEST_CASE("gguf: metadata of every value type, as gguf-py wrote it") {
  GgufFile f(kGguf + "/llama-F32.gguf");
  CHECK(f.version() == 3);
  CHECK(f.alignment() == 32);
  CHECK(f.at("general.architecture").as_string() == "llama");
  auto type_of = [&](const char* k) { return f.at(k).type(); };
  CHECK(type_of("test.u8") == lm::GgufType::u8);
  CHECK(f.at("test.u8").as_int() == 200);
  CHECK(f.at("test.i8").as_int() == -100);
  CHECK(f.at("test.u16").as_int() == 60000);
  CHECK(f.at("test.i16").as_int() == -30000);
  CHECK(type_of("test.u32") == lm::GgufType::u32);
  CHECK(f.at("test.u32").as_uint() == 4000000000u);
  CHECK(f.at("test.i32").as_int() == -2000000000);
  CHECK(f.at("test.f32").as_float() == 0.25);
  CHECK(f.at("test.bool").as_bool());
  CHECK(f.at("test.string").as_string() == "h\xc3\xa9llo");
  CHECK(f.at("test.u64").as_uint() == 18000000000000000000ull);
  test::check_error([&] { f.at("test.u64").as_int(); }, {"\"test.u64\"", "does not fit int64"});
  CHECK(f.at("test.i64").as_int() == -9000000000000000000ll);
  CHECK(f.at("test.f64").as_float() == 1e-300);
  CHECK(f.at("test.i16s").array_type() == lm::GgufType::i16);
  CHECK(f.at("test.i16s").ints() == std::vector<std::int64_t>{-1, 2, -3});
  CHECK(f.at("test.f64s").floats() == std::vector<double>{0.5, -1.5});
  CHECK(f.at("test.bools").ints() == std::vector<std::int64_t>{1, 0, 1});
  const auto& nested = f.at("test.nested").arrays();
  REQUIRE(nested.size() == 2);
  CHECK(nested[0].ints() == std::vector<std::int64_t>{1, 2});
  CHECK(nested[1].ints() == std::vector<std::int64_t>{3});
  CHECK(nested[1].key() == "test.nested[1]");
  test::check_error([&] { f.at("test.i16s").strings(); }, {"\"test.i16s\"", "an array of strings", "an array of int16"});
  test::check_error([&] { f.at("test.string").as_int(); }, {"\"test.string\"", "an integer"});

  // The tokenizer's raw metadata, for the tokenizer's constructor.
  const nlohmann::json& want = expected_json().at("gguf_metadata");
  lm::GgufTokenizerMetadata t = f.tokenizer();
  CHECK(t.model == "gpt2");
  CHECK(t.pre == "default");
  CHECK(t.tokens == want.at("tokens").get<std::vector<std::string>>());
  CHECK(t.merges == want.at("merges").get<std::vector<std::string>>());
  CHECK(t.token_types == want.at("token_type").get<std::vector<std::int32_t>>());
  CHECK(t.bos_id == 1);
  CHECK(t.eos_id == 2);
  CHECK_FALSE(t.pad_id.has_value());
  CHECK(t.scores.empty());

  GgufFile q8(kGguf + "/llama-Q8_0.gguf");
  CHECK(q8.alignment() == 64);
  CHECK(q8.data_offset() % 64 == 0);
  for (const auto& ti : q8.tensors()) CHECK(ti.offset % 64 == 0);
}

TEST_CASE("gguf: dequantised tensors equal gguf-py's dequantize bit for bit") {
  for (const char* type : {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}) {
    GgufFile f(kGguf + "/llama-" + type + ".gguf");
    for (const char* name : {"blk.0.attn_k.weight", "blk.1.ffn_down.weight"}) {
      const Tensor want = expected().tensor(std::string("gguf_") + type + "." + name);
      const Tensor got = f.tensor(name);
      REQUIRE(got.shape() == want.shape());
      CHECK(test::rel_err(got, want) == 0.0);
      CHECK(test::rel_err(f.tensor(name, DType::f64), want) == 0.0);
    }
    CHECK(std::string(f.tensor_info("blk.1.ffn_down.weight").type_name()) == type);
    CHECK(std::string(f.tensor_info("blk.1.ffn_norm.weight").type_name()) == "F32");  // 1-D stays F32
  }
}

TEST_CASE("gguf: the config from metadata equals config.json's") {
  const lm::ModelConfig hf = lm::load_config(kModels + "/llama");
  const lm::ModelConfig g = lm::gguf_config(GgufFile(kGguf + "/llama-Q4_0.gguf"));
  CHECK(g.arch == lm::Arch::llama);
  CHECK(g.hidden_size == hf.hidden_size);
  CHECK(g.intermediate_size == hf.intermediate_size);
  CHECK(g.num_hidden_layers == hf.num_hidden_layers);
  CHECK(g.num_attention_heads == hf.num_attention_heads);
  CHECK(g.num_key_value_heads == hf.num_key_value_heads);
  CHECK(g.head_dim == hf.head_dim);
  CHECK(g.vocab_size == hf.vocab_size);
  CHECK(g.max_position_embeddings == hf.max_position_embeddings);
  CHECK(g.rope_theta == hf.rope_theta);
  CHECK(g.rms_norm_eps == doctest::Approx(hf.rms_norm_eps).epsilon(1e-7));  // stored as float32
  CHECK(g.tie_word_embeddings == hf.tie_word_embeddings);
  CHECK_FALSE(g.qkv_bias);
  const lm::ModelConfig q = lm::gguf_config(GgufFile(kGguf + "/qwen2-F16.gguf"));
  CHECK(q.arch == lm::Arch::qwen2);
  CHECK(q.tie_word_embeddings);
  CHECK(q.qkv_bias);
  CHECK(q.rope_theta == 1e6);
}

TEST_CASE("GATE: GGUF-loaded logits equal transformers' on the dequantised weights (float64)") {
  const Tensor hf = expected().tensor("llama.logits");
  for (const char* type : {"F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1"}) {
    lm::CausalLM m = lm::load_gguf(kGguf + "/llama-" + type + ".gguf", DType::f64);
    const Tensor got = run_logits(m);
    const double err = test::rel_err(got, expected().tensor(std::string("gguf_") + type + ".logits"));
    const double q_err = test::rel_err(got, hf);
    MESSAGE("gguf " << std::string(type) << ": float64 logits vs transformers on the dequantised weights " << err
                    << "; vs the unquantised model " << q_err);
    CHECK(err <= 1e-10);
    if (std::string(type) == "F32") CHECK(q_err <= 1e-10);  // the F32 file holds the model's exact weights
    const double err32 = test::rel_err(run_logits(lm::load_gguf(kGguf + "/llama-" + type + ".gguf")),
                                       expected().tensor(std::string("gguf_") + type + ".logits"));
    MESSAGE("gguf " << std::string(type) << ": float32 logits, error " << err32);
    CHECK(err32 <= 1e-5);
  }
  lm::CausalLM q = lm::load_gguf(kGguf + "/qwen2-F16.gguf", DType::f64);
  CHECK_FALSE(q.lm_head.has_value());
  const double err = test::rel_err(run_logits(q), expected().tensor("gguf_qwen2_F16.logits"));
  MESSAGE("gguf qwen2 F16: float64 logits error " << err);
  CHECK(err <= 1e-10);
}

TEST_CASE("gguf: Q4_0, Q4_1, Q8_0 matrices stay quantized (affine groups of 32), equal to gguf-py's values") {
  for (const char* type : {"Q8_0", "Q4_0", "Q4_1"}) {
    GgufFile f(kGguf + "/llama-" + type + ".gguf");
    // the blocks as an affine matrix, dequantized: gguf-py's dequantize, bit for bit
    for (const char* name : {"blk.0.attn_k.weight", "blk.1.ffn_down.weight"}) {
      const QuantizedMatrix q = f.quantized(f.tensor_info(name));
      CHECK(q.q == Quant::affine(32, std::string(type) == "Q8_0" ? 8 : 4));
      const Tensor want = expected().tensor(std::string("gguf_") + type + "." + name);
      CHECK(test::rel_err(dequantize(q), want) == 0.0);
      CHECK(test::rel_err(dequantize(q, DType::f64), want) == 0.0);
    }
    // the whole model kept quantized: every projection and the embedding, the same logits
    for (const DType dt : {DType::f64, DType::f32}) {
      lm::CausalLM m = lm::load_gguf(kGguf + "/llama-" + type + ".gguf", dt, true);
      int quantized = 0;
      auto count = [&](const std::string&, const auto&) { ++quantized; };
      m.map_modules<QuantizedLinear>([](const std::string&) { return true; }, count);
      m.map_modules<QuantizedEmbedding>([](const std::string&) { return true; }, count);
      CHECK(quantized == 7 * m.config().num_hidden_layers + 1 + (m.lm_head ? 1 : 0));
      const double err = test::rel_err(run_logits(m), expected().tensor(std::string("gguf_") + type + ".logits"));
      MESSAGE("gguf " << type << " kept quantized, " << dtype_name(dt) << " logits error " << err);
      CHECK(err <= (dt == DType::f64 ? 1e-10 : 1e-5));
    }
  }
  GgufFile f(kGguf + "/llama-F16.gguf");
  test::check_error([&] { f.quantized(f.tensor_info("blk.0.attn_k.weight")); }, {"gguf", "blk.0.attn_k.weight", "not a matrix of a quantized block type"});
}

TEST_CASE("gguf: every block type kept quantized (Q4_0..Q8_0, Q2_K..Q6_K) decodes to gguf-py's values") {
  // Random raw blocks of each type and gguf-py's dequantization of them (tests/oracle/gen_gguf_quants.py).
  GgufFile f(std::string(NN_FIXTURES_DIR) + "/lm/gguf_quants.gguf");
  const std::pair<const char*, Quant> types[] = {
      {"Q4_0", Quant::affine(32, 4)}, {"Q4_1", Quant::affine(32, 4)}, {"Q5_0", Quant::affine(32, 5)},
      {"Q5_1", Quant::affine(32, 5)}, {"Q8_0", Quant::affine(32, 8)}, {"Q2_K", Quant::affine(16, 2)},
      {"Q3_K", Quant::affine(16, 3)}, {"Q4_K", Quant::affine(32, 4)}, {"Q5_K", Quant::affine(32, 5)},
      {"Q6_K", Quant::affine(16, 6)}};
  for (const auto& [name, quant] : types) {
    CAPTURE(name);
    const Tensor want = f.tensor(std::string("ref.") + name);  // (3, 512) float32
    REQUIRE(want.shape() == Shape{3, 512});
    // As floats: bit for bit, signed zeros included.
    CHECK(test::f32_bits(f.tensor(name)) == test::f32_bits(want));
    CHECK(f.tensor(name, DType::f64).to_doubles() == want.to_doubles());
    // As affine groups: the same values (a symmetric type's zero is +0 here, -0 in gguf-py).
    CHECK(GgufFile::keeps_quantized(f.tensor_info(name).type));
    const QuantizedMatrix q = f.quantized(f.tensor_info(name));
    CHECK(q.q == quant);
    CHECK(q.weight.shape() == Shape{3, 512 * quant.bits / 32});
    CHECK(dequantize(q).to_doubles() == want.to_doubles());
    CHECK(dequantize(q, DType::f64).to_doubles() == want.to_doubles());
  }
}

TEST_CASE("gguf: the loaded model matches the HF one weight for weight (F32), q/k un-permuted") {
  lm::CausalLM a = lm::load_gguf(kGguf + "/llama-F32.gguf"), b = lm::load_hf(kModels + "/llama");
  auto pa = a.parameters(), pb = b.parameters();
  REQUIRE(pa.size() == pb.size());
  for (std::size_t i = 0; i < pa.size(); ++i) {
    CHECK(pa[i].first == pb[i].first);
    CHECK(test::rel_err(pa[i].second, pb[i].second) == 0.0);
  }
}

TEST_CASE("gguf: unpermute_rows inverts convert_hf_to_gguf's permute; names map to HF's") {
  // permute: rows (H, 2, hd/2) -> (H, hd/2, 2), for H = 2 heads of hd = 6, 3 columns.
  const std::int64_t H = 2, hd = 6, cols = 3;
  std::vector<double> w(static_cast<std::size_t>(H * hd * cols));
  for (std::size_t i = 0; i < w.size(); ++i) w[i] = static_cast<double>(i);
  std::vector<double> p(w.size());
  for (std::int64_t h = 0; h < H; ++h)
    for (std::int64_t s = 0; s < 2; ++s)
      for (std::int64_t i = 0; i < hd / 2; ++i)
        for (std::int64_t c = 0; c < cols; ++c)
          p[static_cast<std::size_t>((h * hd + 2 * i + s) * cols + c)] = w[static_cast<std::size_t>((h * hd + s * hd / 2 + i) * cols + c)];
  const Tensor back = lm::detail::unpermute_rows(Tensor::from_doubles({H * hd, cols}, p, DType::f64), H, "t");
  CHECK(back.to_doubles() == w);
  test::check_error([] { lm::detail::unpermute_rows(Tensor::zeros({10, 2}), 4, "blk.0.attn_q.weight"); },
                    {"blk.0.attn_q.weight", "4 heads of even size"});

  using lm::detail::gguf_to_hf_name;
  CHECK(gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight");
  CHECK(gguf_to_hf_name("output_norm.weight") == "model.norm.weight");
  CHECK(gguf_to_hf_name("output.weight") == "lm_head.weight");
  CHECK(gguf_to_hf_name("blk.11.attn_q.bias") == "model.layers.11.self_attn.q_proj.bias");
  CHECK(gguf_to_hf_name("blk.0.attn_output.weight") == "model.layers.0.self_attn.o_proj.weight");
  CHECK(gguf_to_hf_name("blk.3.attn_norm.weight") == "model.layers.3.input_layernorm.weight");
  CHECK(gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight");
  CHECK(gguf_to_hf_name("blk.3.ffn_gate.weight") == "model.layers.3.mlp.gate_proj.weight");
  CHECK(gguf_to_hf_name("blk.3.ffn_up.weight") == "model.layers.3.mlp.up_proj.weight");
  CHECK(gguf_to_hf_name("blk.3.ffn_down.weight") == "model.layers.3.mlp.down_proj.weight");
  CHECK(gguf_to_hf_name("blk.x.ffn_down.weight") == "blk.x.ffn_down.weight");  // unmapped: reported as unknown
  CHECK(gguf_to_hf_name("blk.0.attn_q_norm.weight") == "model.layers.0.self_attn.q_norm.weight");  // Qwen3
  CHECK(gguf_to_hf_name("blk.1.attn_k_norm.weight") == "model.layers.1.self_attn.k_norm.weight");
  CHECK(gguf_to_hf_name("blk.0.post_attention_norm.weight") == "blk.0.post_attention_norm.weight");  // Gemma 2's: unmapped
}

TEST_CASE("load_gguf: metadata and tensor errors name the file and the key") {
  auto spec = [](std::vector<KvWriter> kv) {
    FileSpec s;
    s.kv = std::move(kv);
    s.tensors = {{"token_embd.weight", {32, 2}, 0, Bytes(256), {}}};
    return s;
  };
  test::check_error([&] { lm::gguf_config(GgufFile::from_bytes(build(spec({})), "m.gguf")); },
                    {"[gguf]", "m.gguf", "missing metadata key \"general.architecture\""});
  test::check_error([&] { lm::gguf_config(GgufFile::from_bytes(build(spec({kv_str("general.architecture", "gpt2")})), "m.gguf")); },
                    {"m.gguf", "general.architecture \"gpt2\" is not a supported model family", "qwen3"});
  test::check_error([&] { lm::gguf_config(GgufFile::from_bytes(build(spec({kv_str("general.architecture", "llama")})), "m.gguf")); },
                    {"m.gguf", "missing metadata key \"llama.embedding_length\""});
  std::vector<KvWriter> kv = {kv_str("general.architecture", "llama"), kv_u32("llama.embedding_length", 32),
                              kv_str("llama.block_count", "two")};
  test::check_error([&] { lm::gguf_config(GgufFile::from_bytes(build(spec(kv)), "m.gguf")); },
                    {"[gguf] m.gguf: key \"llama.block_count\"", "expected an integer", "string"});
  kv = {kv_str("general.architecture", "llama"), kv_u32("llama.embedding_length", 32), kv_u32("llama.block_count", 1),
        kv_u32("llama.feed_forward_length", 64), kv_u32("llama.attention.head_count", 4),
        kv_str("llama.rope.scaling.type", "yarn")};
  test::check_error([&] { lm::gguf_config(GgufFile::from_bytes(build(spec(kv)), "m.gguf")); },
                    {"m.gguf", "rope.scaling.type \"yarn\" is not supported"});
  kv.pop_back();
  kv.push_back(kv_u32("llama.rope.dimension_count", 4));
  test::check_error([&] { lm::gguf_config(GgufFile::from_bytes(build(spec(kv)), "m.gguf")); },
                    {"rope.dimension_count 4 differs from head_dim 8"});
  kv.pop_back();
  // A valid config whose tensors do not fit: the strict load lists them.
  test::check_error([&] { lm::load_gguf(GgufFile::from_bytes(build(spec(kv)), "m.gguf")); },
                    {"[load_weights]", "m.gguf", "missing", "model.norm.weight", "model.layers.0.self_attn.q_proj.weight"});
}

TEST_CASE("gguf_config: rope_freqs (llama.cpp's Llama 3 remap) and linear scaling reach the inverse frequencies") {
  auto file = [](std::vector<float> factors, bool linear) {
    FileSpec s;
    s.kv = {kv_str("general.architecture", "llama"), kv_u32("llama.embedding_length", 32), kv_u32("llama.block_count", 1),
            kv_u32("llama.feed_forward_length", 64), kv_u32("llama.attention.head_count", 4),
            kv_f32("llama.rope.freq_base", 10000.0f)};
    if (linear) {
      s.kv.push_back(kv_str("llama.rope.scaling.type", "linear"));
      s.kv.push_back(kv_f32("llama.rope.scaling.factor", 2.0f));
    }
    Bytes f;
    for (float x : factors) put(f, x);
    s.tensors = {{"rope_freqs.weight", {factors.size()}, 0, f, {}}, {"token_embd.weight", {32, 2}, 0, Bytes(256), {}}};
    return GgufFile::from_bytes(build(s), "r.gguf");
  };
  lm::ModelConfig c = lm::gguf_config(file({1, 2, 4, 8}, false));
  CHECK(c.rope_freq_factors == std::vector<double>{1, 2, 4, 8});
  CHECK(c.vocab_size == 2);  // no tokenizer: token_embd's rows
  std::vector<double> f = c.inv_freq();
  for (int i = 0; i < 4; ++i) CHECK(f[static_cast<std::size_t>(i)] == doctest::Approx(std::pow(1e4, -i / 4.0) / (1 << i)).epsilon(1e-15));
  c = lm::gguf_config(file({1, 1, 1, 1}, true));
  CHECK(c.rope_scaling.type == "linear");
  f = c.inv_freq();
  for (int i = 0; i < 4; ++i) CHECK(f[static_cast<std::size_t>(i)] == doctest::Approx(std::pow(1e4, -i / 4.0) / 2).epsilon(1e-15));
  test::check_error([&] { lm::gguf_config(file({1, 2, 3}, false)); }, {"r.gguf", "3 rope frequency factors for head_dim 8"});
  // The loader consumes rope_freqs.weight (it is not a model weight) and reports the rest.
  test::check_error([&] { lm::load_gguf(file({1, 2, 4, 8}, false)); }, {"missing", "model.norm.weight"});
  try {
    lm::load_gguf(file({1, 2, 4, 8}, false));
  } catch (const nn::Error& e) {
    CHECK(std::string(e.what()).find("rope_freqs") == std::string::npos);
  }
}

}  // namespace lm_gguf
