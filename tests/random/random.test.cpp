// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::random against MLX, bit for bit: keys, split, bits, uniform, normal, bernoulli, the global
// seed sequence and the layer initialisers (fixtures from tests/oracle/gen_random.py).
#include "support/check.hpp"

namespace random_random {  // one unity source with the other random files: its names stay its own

using namespace nn;
using nlohmann::json;

namespace {

Tensor key_of(const json& j) {
  return Tensor::from<std::uint32_t>({2}, {j.at(0).get<std::uint32_t>(), j.at(1).get<std::uint32_t>()});
}
Shape shape_of(const json& j) { return Shape(j.get<std::vector<std::int64_t>>()); }
DType dtype_of(const std::string& s) {
  if (s == "float32") return DType::f32;
  if (s == "float64") return DType::f64;
  if (s == "bfloat16") return DType::bf16;
  if (s == "float16") return DType::f16;
  FAIL("unknown dtype " << s);
  return DType::f32;
}

/// The bit patterns of a float tensor (or the words of a u32/u8 one), as integers.
std::vector<std::uint64_t> bit_patterns(const Tensor& t) {
  std::vector<std::uint64_t> v(static_cast<std::size_t>(t.numel()));
  for (std::size_t i = 0; i < v.size(); ++i) {
    switch (dtype_size(t.dtype())) {
      case 1: v[i] = static_cast<const std::uint8_t*>(t.raw())[i]; break;
      case 2: v[i] = static_cast<const std::uint16_t*>(t.raw())[i]; break;
      case 4: v[i] = static_cast<const std::uint32_t*>(t.raw())[i]; break;
      default: v[i] = static_cast<const std::uint64_t*>(t.raw())[i]; break;
    }
  }
  return v;
}

std::string hex(std::uint64_t v) {
  std::ostringstream os;
  os << "0x" << std::hex << v;
  return os.str();
}

/// Counts elements whose bits differ from the fixture, reporting the first one.
std::size_t mismatches(const Tensor& got, const json& want, const std::string& what) {
  std::vector<std::uint64_t> g = bit_patterns(got), w = want.get<std::vector<std::uint64_t>>();
  REQUIRE_MESSAGE(g.size() == w.size(), what);
  std::size_t bad = 0;
  for (std::size_t i = 0; i < g.size(); ++i)
    if (g[i] != w[i] && bad++ == 0)
      MESSAGE(what << ": first mismatch at " << i << ": got " << hex(g[i]) << ", MLX " << hex(w[i]));
  return bad;
}

const json& fx() {
  static const json j = test::fixture("random/mlx_random.json");
  return j;
}
const json& fx_init() {
  static const json j = test::fixture("random/mlx_init.json");
  return j;
}

}  // namespace

TEST_CASE("threefry2x32-20 matches the Random123 known-answer vectors") {
  // Random123's kat_vectors (ctr, key -> out), which JAX's and MLX's threefry also pass.
  struct Kat { std::uint32_t c0, c1, k0, k1, o0, o1; };
  const Kat kats[] = {{0, 0, 0, 0, 0x6b200159u, 0x99ba4efeu},
                      {0xffffffffu, 0xffffffffu, 0xffffffffu, 0xffffffffu, 0x1cb996fcu, 0xbb002be7u},
                      {0x243f6a88u, 0x85a308d3u, 0x13198a2eu, 0x03707344u, 0xc4923a9cu, 0x483df7a0u}};
  for (const Kat& k : kats) {
    std::uint32_t a = 0, b = 0;
    random::detail::threefry2x32(k.k0, k.k1, k.c0, k.c1, a, b);
    CHECK(a == k.o0);
    CHECK(b == k.o1);
  }
  static_assert([] {
    std::uint32_t a = 0, b = 0;
    random::detail::threefry2x32(0, 0, 0, 0, a, b);
    return a == 0x6b200159u;
  }(), "threefry is usable at compile time (and so on a device)");
}

TEST_CASE("key(seed) is [seed >> 32, seed & 0xffffffff], as mx.random.key") {
  MESSAGE("fixtures recorded with mlx " << fx().at("mlx_version").get<std::string>());
  for (const auto& c : fx().at("keys")) {
    Tensor k = random::key(c.at("seed").get<std::uint64_t>());
    CHECK(mismatches(k, c.at("key"), "key") == 0);
  }
}

TEST_CASE("split(key, num) and split(key) are MLX's") {
  for (const auto& c : fx().at("split")) {
    Tensor k = key_of(c.at("key"));
    const int num = c.at("num").get<int>();
    Tensor s = random::split(k, num);
    CHECK(s.shape() == Shape{num, 2});
    CHECK(mismatches(s, c.at("out"), "split") == 0);
    if (num >= 2) {
      auto [a, b] = random::split(k);
      Tensor two = random::split(k, 2);
      CHECK(bit_patterns(a) == bit_patterns(random::subkey(two, 0)));
      CHECK(bit_patterns(b) == bit_patterns(random::subkey(two, 1)));
    }
  }
  test::check_error([] { random::subkey(random::split(random::key(0), 2), 2); }, {"random.subkey", "(2, 2)"});
}

TEST_CASE("bits lays out odd and even word counts as MLX's RandomBits") {
  MESSAGE("bits source: " << fx().at("bits_source").get<std::string>());
  std::size_t cases = 0;
  for (const auto& c : fx().at("bits")) {
    Tensor b = random::bits(shape_of(c.at("shape")), key_of(c.at("key")));
    CHECK(b.dtype() == DType::u32);
    CHECK(mismatches(b, c.at("data"), "bits " + c.at("shape").dump()) == 0);
    ++cases;
  }
  CHECK(cases >= 16);
}

TEST_CASE("uniform is MLX's in float32, bfloat16 and float16") {
  std::size_t cases = 0, bad = 0;
  for (const auto& c : fx().at("uniform")) {
    const DType dt = dtype_of(c.at("dtype"));
    Tensor u = random::uniform(shape_of(c.at("shape")), c.at("low").get<double>(), c.at("high").get<double>(), dt,
                               key_of(c.at("key")));
    CHECK(u.dtype() == dt);
    CHECK(u.shape() == shape_of(c.at("shape")));
    bad += mismatches(u, c.at("bits"), "uniform " + c.at("dtype").get<std::string>() + " " + c.at("shape").dump() +
                                           " [" + c.at("low").dump() + ", " + c.at("high").dump() + ")");
    ++cases;
  }
  CHECK(bad == 0);
  CHECK(cases >= 60);
}

TEST_CASE("normal is MLX's in float32, float64, bfloat16 and float16, with loc and scale") {
  std::size_t cases = 0, bad = 0;
  for (const auto& c : fx().at("normal")) {
    const DType dt = dtype_of(c.at("dtype"));
    const double loc = c.at("loc").is_null() ? 0.0 : c.at("loc").get<double>();
    const double scale = c.at("scale").is_null() ? 1.0 : c.at("scale").get<double>();
    Tensor x = random::normal(shape_of(c.at("shape")), dt, loc, scale, key_of(c.at("key")));
    CHECK(x.dtype() == dt);
    bad += mismatches(x, c.at("bits"), "normal " + c.at("dtype").get<std::string>() + " " + c.at("shape").dump() +
                                           " loc " + c.at("loc").dump() + " scale " + c.at("scale").dump());
    ++cases;
  }
  CHECK(bad == 0);
  CHECK(cases >= 60);
}

TEST_CASE("bernoulli is MLX's, p = 0 and p = 1 included") {
  std::size_t cases = 0, bad = 0;
  for (const auto& c : fx().at("bernoulli")) {
    Tensor m = random::bernoulli(c.at("p").get<double>(), shape_of(c.at("shape")), key_of(c.at("key")));
    CHECK(m.dtype() == DType::u8);
    bad += mismatches(m, c.at("data"), "bernoulli p " + c.at("p").dump() + " " + c.at("shape").dump());
    ++cases;
  }
  CHECK(bad == 0);
  CHECK(cases >= 40);
}

TEST_CASE("seed(0) and the same calls without keys draw MLX's global sequence") {
  const json& s = fx().at("sequence");
  random::seed(s.at("seed").get<std::uint64_t>());
  for (const auto& c : s.at("calls")) {
    const std::string op = c.at("op");
    const Shape shape = shape_of(c.at("shape"));
    Tensor out;
    if (op == "uniform") out = random::uniform(shape, c.at("low").get<double>(), c.at("high").get<double>());
    else if (op == "normal") out = random::normal(shape, DType::f32, c.value("loc", 0.0), c.value("scale", 1.0));
    else out = random::bernoulli(c.at("p").get<double>(), shape);
    CHECK(mismatches(out, c.at("out"), "sequence " + op + " " + c.at("shape").dump()) == 0);
  }
  CHECK(mismatches(random::state(), s.at("final_state"), "final state") == 0);

  // Seeding again resets the sequence.
  const json& s2 = fx().at("sequence_123");
  for (int round = 0; round < 2; ++round) {
    random::seed(123);
    for (const auto& w : s2.at("uniform_3")) CHECK(mismatches(random::uniform({3}), w, "seed 123") == 0);
  }

  // state() / set_state() resume the sequence exactly (what a checkpoint saves).
  random::seed(9);
  (void)random::next_key();
  Tensor saved = random::state();
  Tensor a = random::uniform({5});
  random::set_state(saved);
  CHECK(bit_patterns(random::uniform({5})) == bit_patterns(a));
}

TEST_CASE("a keyless draw uses next_key(): (state, k) = split(state)") {
  random::seed(77);
  auto [state1, k] = random::split(random::key(77));
  Tensor with_key = random::uniform({9}, 0, 1, DType::f32, k);
  random::seed(77);
  CHECK(bit_patterns(random::uniform({9})) == bit_patterns(with_key));
  CHECK(bit_patterns(random::state()) == bit_patterns(state1));
}

TEST_CASE("Linear, Embedding and LoRA initialisers draw MLX's weights after a seed") {
  const json& f = fx_init();
  {
    const json& c = f.at("linear_4_8");
    random::seed(0);
    init::LinearInit l = init::linear(4, 8);
    CHECK(l.weight.shape() == shape_of(c.at("weight_shape")));
    CHECK(l.bias.shape() == shape_of(c.at("bias_shape")));
    CHECK(mismatches(l.weight, c.at("weight"), "Linear(4, 8).weight") == 0);
    CHECK(mismatches(l.bias, c.at("bias"), "Linear(4, 8).bias") == 0);
  }
  {
    const json& c = f.at("linear_3_5_nobias");
    random::seed(0);
    init::LinearInit l = init::linear(3, 5, false);
    CHECK_FALSE(l.bias.defined());
    CHECK(mismatches(l.weight, c.at("weight"), "Linear(3, 5, bias=False).weight") == 0);
  }
  {
    const json& c = f.at("embedding_10_6");
    random::seed(0);
    Tensor w = init::embedding(10, 6);
    CHECK(w.shape() == shape_of(c.at("weight_shape")));
    CHECK(mismatches(w, c.at("weight"), "Embedding(10, 6).weight") == 0);
  }
  {
    const json& c = f.at("chain_seed7");
    random::seed(7);
    init::LinearInit a = init::linear(4, 8);
    Tensor e = init::embedding(10, 6);
    init::LinearInit b = init::linear(8, 3);
    CHECK(mismatches(a.weight, c.at("l1_weight"), "chain l1.weight") == 0);
    CHECK(mismatches(a.bias, c.at("l1_bias"), "chain l1.bias") == 0);
    CHECK(mismatches(e, c.at("emb_weight"), "chain emb.weight") == 0);
    CHECK(mismatches(b.weight, c.at("l2_weight"), "chain l2.weight") == 0);
    CHECK(mismatches(b.bias, c.at("l2_bias"), "chain l2.bias") == 0);
    CHECK(mismatches(random::state(), c.at("final_state"), "chain final state") == 0);
  }
  if (!f.contains("lora_from_base_16_8_r4")) {
    MESSAGE("mlx-lm was not installed when the fixtures were recorded: LoRA init unchecked");
    return;
  }
  MESSAGE("LoRA fixtures recorded with mlx-lm " << f.at("mlx_lm_version").get<std::string>());
  {
    const json& c = f.at("lora_from_base_16_8_r4");
    random::seed(0);
    init::LinearInit base = init::linear(16, 8);
    init::LoraInit l = init::lora(16, 8, 4);
    CHECK(mismatches(base.weight, c.at("base_weight"), "base.weight") == 0);
    CHECK(mismatches(base.bias, c.at("base_bias"), "base.bias") == 0);
    CHECK(l.lora_a.shape() == shape_of(c.at("lora_a_shape")));
    CHECK(l.lora_b.shape() == shape_of(c.at("lora_b_shape")));
    CHECK(mismatches(l.lora_a, c.at("lora_a"), "LoRALinear.from_base lora_a") == 0);
    for (double v : l.lora_b.to_doubles()) CHECK(v == 0.0);
    CHECK(mismatches(random::state(), c.at("final_state"), "lora final state") == 0);
  }
  {
    const json& c = f.at("lora_direct_10_6_r8");
    random::seed(3);
    CHECK(mismatches(init::linear(10, 6, false).weight, c.at("linear_weight"), "LoRALinear.linear.weight") == 0);
    random::seed(3);
    init::LoraInit l = init::lora(10, 6, 8);
    CHECK(mismatches(l.lora_a, c.at("lora_a"), "LoRALinear(10, 6, 8).lora_a") == 0);
    CHECK(mismatches(random::state(), c.at("final_state"), "lora direct final state") == 0);
  }
}

TEST_CASE("float64 uniform maps the float32 draw in double (MLX has none)") {
  Tensor k = random::key(5);
  Tensor u32 = random::uniform({101}, 0, 1, DType::f32, k);
  Tensor u64 = random::uniform({101}, 0, 1, DType::f64, k);
  CHECK(u32.to_doubles() == u64.to_doubles());  // range 1, low 0: the same values exactly
  Tensor w = random::uniform({101}, -3, 5, DType::f64, k);
  for (double v : w.to_doubles()) CHECK((v >= -3 && v < 5));
}

TEST_CASE("random errors name the call and what was wrong") {
  test::check_error([] { random::uniform({3}, 0, 1, DType::f32, Tensor::from<std::int32_t>({2}, {0, 1})); },
                    {"[random.uniform]", "uint32", "int32"});
  test::check_error([] { random::normal({3}, DType::f32, 0, 1, Tensor::from<std::uint32_t>({3}, {0, 1, 2})); },
                    {"[random.normal]", "(3)"});
  test::check_error([] { random::uniform({3}, 0, 1, DType::i32); }, {"[random.uniform]", "int32"});
  test::check_error([] { random::split(random::key(0), -1); }, {"[random.split]", "-1"});
  test::check_error([] { init::linear(0, 3); }, {"[init.linear]"});
}

TEST_CASE("draws look uniform and normal (moments over 100k samples)") {
  Tensor k = random::key(2024);
  std::vector<double> u = random::uniform({100000}, 0, 1, DType::f32, k).to_doubles();
  double m = 0, lo = 1, hi = 0;
  for (double v : u) { m += v; lo = std::min(lo, v); hi = std::max(hi, v); }
  m /= static_cast<double>(u.size());
  CHECK(std::abs(m - 0.5) < 0.005);
  CHECK(lo >= 0.0);
  CHECK(hi < 1.0);
  std::vector<double> n = random::normal({100000}, DType::f32, 0, 1, k).to_doubles();
  double mu = 0, var = 0;
  for (double v : n) mu += v;
  mu /= static_cast<double>(n.size());
  for (double v : n) var += (v - mu) * (v - mu);
  var /= static_cast<double>(n.size());
  CHECK(std::abs(mu) < 0.01);
  CHECK(std::abs(var - 1.0) < 0.02);
}

TEST_CASE("next_key_into and linear_bias continue the same sequence as next_key and linear") {
  random::seed(31);
  Tensor a = random::next_key(), b = random::next_key();
  random::seed(31);
  Tensor slot = Tensor::zeros({2}, DType::u32);
  random::next_key_into(slot);
  CHECK(bit_patterns(slot) == bit_patterns(a));
  random::next_key_into(slot);
  CHECK(bit_patterns(slot) == bit_patterns(b));
  test::check_error([] { Tensor bad = Tensor::zeros({3}, DType::u32); random::next_key_into(bad); },
                    {"[random.next_key_into]", "(3)"});

  random::seed(0);
  init::LinearInit full = init::linear(4, 8);
  random::seed(0);
  Tensor w = init::linear(4, 8, false).weight;
  Tensor bias = init::linear_bias(4, 8);
  CHECK(bit_patterns(w) == bit_patterns(full.weight));
  CHECK(bit_patterns(bias) == bit_patterns(full.bias));
}

}  // namespace random_random
