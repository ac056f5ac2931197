// SPDX-License-Identifier: MIT OR Apache-2.0
// tensor.hpp: Shape (rank <= 8, axis normalisation), Tensor creation, sharing and clone, 64-byte
// alignment, dtype conversion (bf16/f16 <-> f32 against PyTorch and NumPy: every half bit pattern,
// and ~680k float32 values covering every rounding case; fixture from tests/oracle/gen_tensor.py),
// printing, and every misuse raising nn::Error.
#include <bit>
#include <cstdio>
#include <map>
#include <sstream>

#include "support/check.hpp"

namespace core_tensor {  // one unity source with the other core files: its names stay its own

using namespace nn;

namespace {

// ---- the inputs of gen_tensor.py, generated here the same way ---------------------------------

std::vector<std::uint32_t> xorshift32(std::size_t n, std::uint32_t x = 0x9E3779B9u) {
  std::vector<std::uint32_t> out(n);
  for (auto& v : out) {
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    v = x;
  }
  return out;
}

/// Each midpoint between adjacent finite float16 values (by formula, not by the code under test)
/// and its float32 neighbours, for both signs.
std::vector<std::uint32_t> f16_midpoints() {
  std::vector<std::uint32_t> out;
  for (std::uint32_t sign : {0u, 0x80000000u})
    for (int h = 0; h < 0x7C00; ++h) {
      const int e = h >> 10, man = h & 0x3FF;
      const int sig = e == 0 ? man : 1024 + man, ex = e == 0 ? -25 : e - 26;
      const float mid = static_cast<float>(std::ldexp(2.0 * sig + 1, ex));  // exact
      const std::uint32_t m = std::bit_cast<std::uint32_t>(mid);
      out.insert(out.end(), {sign | (m - 1), sign | m, sign | (m + 1)});
    }
  return out;
}

const std::uint32_t kSpecials[] = {
    0x00000000, 0x80000000, 0x7F800000, 0xFF800000, 0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF,
    0x7FFFFFFF, 0x7FC00001, 0x7F7FFFFF, 0xFF7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00800000, 0x80800000, 0x007FFFFF,
    0x00000001, 0x80000001, 0x00008000, 0x00018000, 0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F810000,
    0xBF808000, 0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000, 0x38800000, 0x387FFFFF,
    0x387FE000, 0x387FF000, 0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x32800000, 0x33C00000, 0x34200000,
    0xB3000000, 0xB3000001, 0x3F802000, 0x3F801000, 0x3F803000, 0x3F801001,
};

/// Every upper half with six low halves (all bf16 rounding cases), the f16 midpoints, 100k
/// pseudo-random patterns, the specials: the same order as gen_tensor.py.
std::vector<std::uint32_t> f32_inputs() {
  std::vector<std::uint32_t> x;
  for (std::uint32_t u = 0; u < 65536; ++u)
    for (std::uint32_t low : {0x0000u, 0x0001u, 0x7FFFu, 0x8000u, 0x8001u, 0xFFFFu}) x.push_back(u << 16 | low);
  for (std::uint32_t m : f16_midpoints()) x.push_back(m);
  for (std::uint32_t r : xorshift32(100000)) x.push_back(r);
  for (std::uint32_t s : kSpecials) x.push_back(s);
  return x;
}

bool nan_bf16(std::uint16_t b) { return (b & 0x7F80) == 0x7F80 && (b & 0x7F) != 0; }
bool nan_f16(std::uint16_t b) { return (b & 0x7C00) == 0x7C00 && (b & 0x3FF) != 0; }
bool nan_f32(std::uint32_t b) { return (b & 0x7F800000u) == 0x7F800000u && (b & 0x7FFFFFu) != 0; }

/// Per block of `block` outputs: sum mod 2^64 of splitmix64(value << 32 | index), a NaN counted
/// as the token `nan_token` (gen_tensor.py's block_hashes).
template <class U, class IsNan>
std::vector<std::string> block_hashes(const std::vector<U>& v, IsNan is_nan, std::uint64_t nan_token, std::size_t block) {
  std::vector<std::string> out;
  std::uint64_t acc = 0;
  for (std::size_t i = 0; i < v.size(); ++i) {
    std::uint64_t z = ((is_nan(v[i]) ? nan_token : std::uint64_t(v[i])) << 32) | std::uint64_t(i);
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    z ^= z >> 31;
    acc += z;
    if ((i + 1) % block == 0 || i + 1 == v.size()) {
      char buf[17];
      std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(acc));
      out.emplace_back(buf);
      acc = 0;
    }
  }
  return out;
}

/// Compares block hashes; on a mismatch names the block's index range (rerun gen_tensor.py's
/// expression for that range to see PyTorch's values).
void check_blocks(const char* what, const std::vector<std::string>& got, const nlohmann::json& want, std::size_t block) {
  REQUIRE(got.size() == want.size());
  int bad = 0;
  for (std::size_t b = 0; b < got.size(); ++b)
    if (got[b] != want[b].get<std::string>() && bad++ < 5)
      FAIL_CHECK(what << ": outputs " << b * block << ".." << (b + 1) * block - 1 << " differ from PyTorch");
  CHECK_MESSAGE(bad == 0, what << ": " << bad << " of " << got.size() << " blocks differ");
}

std::uint32_t hex(const nlohmann::json& j) { return static_cast<std::uint32_t>(std::stoul(j.get<std::string>(), nullptr, 16)); }

// Tensors holding raw bit patterns, converted through the public Tensor::to().
Tensor f32_from_bits(const std::vector<std::uint32_t>& bits) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(bits.size())}, DType::f32);
  std::memcpy(t.raw(), bits.data(), bits.size() * 4);
  return t;
}
Tensor half_from_bits(const std::vector<std::uint16_t>& bits, DType dt) {
  Tensor t = Tensor::empty({static_cast<std::int64_t>(bits.size())}, dt);
  std::memcpy(t.raw(), bits.data(), bits.size() * 2);
  return t;
}
template <class U>
std::vector<U> bits_of(const Tensor& t) {
  std::vector<U> v(static_cast<std::size_t>(t.numel()));
  std::memcpy(v.data(), t.raw(), t.nbytes());
  return v;
}

std::string print(const Tensor& t) {
  std::ostringstream os;
  os << t;
  return os.str();
}

}  // namespace

// ---- Shape -----------------------------------------------------------------------------------

TEST_CASE("Shape: rank 0 to 8, numel, str, equality") {
  Shape s0;
  CHECK(s0.rank() == 0);
  CHECK(s0.numel() == 1);
  CHECK(s0.str() == "()");
  Shape s{2, 3, 4};
  CHECK(s.rank() == 3);
  CHECK(s.numel() == 24);
  CHECK(s.prod(1, 3) == 12);
  CHECK(s.str() == "(2, 3, 4)");
  CHECK(s.vec() == std::vector<std::int64_t>{2, 3, 4});
  CHECK(s == Shape(std::vector<std::int64_t>{2, 3, 4}));
  CHECK_FALSE(s == Shape{2, 3});
  CHECK_FALSE(s == Shape{2, 3, 5});
  Shape s8{1, 2, 1, 2, 1, 2, 1, 2};
  CHECK(s8.rank() == kMaxRank);
  CHECK(s8.numel() == 16);
  CHECK(Shape{4, 0}.numel() == 0);
  std::ostringstream os;
  os << s;
  CHECK(os.str() == "(2, 3, 4)");
}

TEST_CASE("Shape: negative axes count from the end") {
  Shape s{2, 3, 4};
  CHECK(s.axis(0) == 0);
  CHECK(s.axis(2) == 2);
  CHECK(s.axis(-1) == 2);
  CHECK(s.axis(-3) == 0);
  CHECK(s.dim(-1) == 4);
  CHECK(s.dim(-2) == 3);
  CHECK(s.dim(0) == 2);
}

TEST_CASE("Shape errors: rank above 8, negative dims, axes out of range") {
  test::check_error([] { Shape s{1, 1, 1, 1, 1, 1, 1, 1, 1}; }, {"[shape]", "rank above 8"});
  test::check_error([] { Shape s(std::vector<std::int64_t>(9, 2)); }, {"[shape]", "rank above 8"});
  test::check_error([] { Shape s{2, -1}; }, {"[shape]", "negative dimension -1"});
  Shape s8{1, 2, 1, 2, 1, 2, 1, 2};
  test::check_error([&] { s8.push_back(3); }, {"[shape]", "rank above 8"});
  Shape s{2, 3};
  test::check_error([&] { s.axis(2); }, {"[shape]", "axis 2", "(2, 3)"});
  test::check_error([&] { s.axis(-3); }, {"[shape]", "axis -3", "(2, 3)"});
  test::check_error([&] { s.dim(5); }, {"[shape]", "axis 5", "(2, 3)"});
  test::check_error([] { Shape().axis(0); }, {"[shape]", "axis 0", "()"});
}

// ---- Tensor creation, sharing, alignment ------------------------------------------------------

TEST_CASE("Tensor creation: zeros, ones, full, scalar, from, from_doubles") {
  Tensor z = Tensor::zeros({2, 3});
  CHECK(z.defined());
  CHECK(z.dtype() == DType::f32);
  CHECK(z.shape() == Shape{2, 3});
  CHECK(z.rank() == 2);
  CHECK(z.dim(-1) == 3);
  CHECK(z.numel() == 6);
  CHECK(z.nbytes() == 24);
  CHECK(z.device() == Device::cpu);
  CHECK(z.to_doubles() == std::vector<double>(6, 0.0));
  CHECK(Tensor::ones({3}, DType::f64).to_doubles() == std::vector<double>(3, 1.0));
  CHECK(Tensor::full({2}, -2.5, DType::bf16).to_doubles() == std::vector<double>(2, -2.5));
  CHECK(Tensor::full({2}, 7, DType::i32).to_doubles() == std::vector<double>(2, 7.0));
  Tensor s = Tensor::scalar(3.5, DType::f64);
  CHECK(s.rank() == 0);
  CHECK(s.numel() == 1);
  CHECK(s.item() == 3.5);
  Tensor f = Tensor::from<float>({2, 2}, {1, 2, 3, 4});
  CHECK(f.dtype() == DType::f32);
  CHECK(f.data<float>()[3] == 4.0f);
  Tensor i = Tensor::from<std::int64_t>({3}, {-1, 0, 1LL << 40});
  CHECK(i.dtype() == DType::i64);
  CHECK(i.data<std::int64_t>()[2] == (1LL << 40));
  CHECK(Tensor::from<std::uint8_t>({2}, {0, 255}).dtype() == DType::u8);
  CHECK(Tensor::from<std::uint32_t>({1}, {0xFFFFFFFFu}).item() == 4294967295.0);
  CHECK(Tensor::from<std::int32_t>({1}, {-7}).dtype() == DType::i32);
  Tensor d = Tensor::from_doubles({3}, {0.1, 1e300, -2}, DType::f32);
  CHECK(d.data<float>()[0] == 0.1f);
  CHECK(std::isinf(d.data<float>()[1]));
  Tensor e = Tensor::empty({0, 5}, DType::f64);
  CHECK(e.defined());
  CHECK(e.numel() == 0);
  CHECK(e.to_doubles().empty());
  CHECK_FALSE(Tensor().defined());
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u32, DType::u8})
    CHECK(Tensor::zeros({3}, t).nbytes() == 3 * dtype_size(t));
}

TEST_CASE("a Tensor copy shares storage; clone() is independent") {
  Tensor a = Tensor::from<double>({3}, {1, 2, 3});
  Tensor b = a;  // shares
  CHECK(b.shares_storage(a));
  b.data<double>()[0] = 10;
  CHECK(a.item(0) == 10);
  Tensor c = a.clone();
  CHECK_FALSE(c.shares_storage(a));
  CHECK(c.to_doubles() == a.to_doubles());
  c.data<double>()[1] = -5;
  CHECK(a.item(1) == 2);
  a.data<double>()[2] = 99;
  CHECK(c.item(2) == 3);
}

TEST_CASE("reshape is a view sharing storage") {
  Tensor a = Tensor::from<float>({2, 3}, {0, 1, 2, 3, 4, 5});
  Tensor r = a.reshape({3, 2});
  CHECK(r.shares_storage(a));
  CHECK(r.shape() == Shape{3, 2});
  CHECK(a.shape() == Shape{2, 3});
  r.data<float>()[5] = 50;
  CHECK(a.data<float>()[5] == 50);
  CHECK(a.reshape({6}).to_doubles() == std::vector<double>{0, 1, 2, 3, 4, 50});
  CHECK(Tensor::scalar(1.0).reshape({1, 1}).shape() == Shape{1, 1});
}

TEST_CASE("storage is 64-byte aligned for every size and dtype") {
  for (std::int64_t n : {0, 1, 3, 15, 16, 17, 63, 64, 65, 1000, 4097})
    for (DType t : {DType::f32, DType::f64, DType::bf16, DType::u8, DType::i64}) {
      Tensor x = Tensor::empty({n}, t);
      CAPTURE(n);
      CAPTURE(t);
      REQUIRE(x.raw() != nullptr);
      CHECK(reinterpret_cast<std::uintptr_t>(x.raw()) % 64 == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(x.clone().raw()) % 64 == 0);
      CHECK(reinterpret_cast<std::uintptr_t>(x.to(DType::f32).raw()) % 64 == 0);
    }
}

// ---- dtype conversion ------------------------------------------------------------------------

TEST_CASE("bf16 and f16 -> f32: all 65536 bit patterns match PyTorch / NumPy") {
  const nlohmann::json fx = test::fixture("core/halfs.json");
  const std::size_t block = fx.at("block");
  std::vector<std::uint16_t> pats(65536);
  for (std::size_t i = 0; i < pats.size(); ++i) pats[i] = static_cast<std::uint16_t>(i);
  const auto bf = bits_of<std::uint32_t>(half_from_bits(pats, DType::bf16).to(DType::f32));
  const auto hf = bits_of<std::uint32_t>(half_from_bits(pats, DType::f16).to(DType::f32));
  check_blocks("bf16 -> f32", block_hashes(bf, nan_f32, 0xFFFFFFFFull, block), fx.at("bf16_to_f32"), block);
  check_blocks("f16 -> f32", block_hashes(hf, nan_f32, 0xFFFFFFFFull, block), fx.at("f16_to_f32"), block);
  // the spelled-out spot values (specials, every 256th pattern)
  int n = 0;
  for (const auto& s : fx.at("spot_half")) {
    const std::uint32_t h = hex(s[0]), want_bf = hex(s[1]), want_hf = hex(s[2]);
    CAPTURE(s.dump());
    if (nan_f32(want_bf)) CHECK(nan_f32(bf[h]));
    else CHECK(bf[h] == want_bf);
    if (nan_f32(want_hf)) CHECK(nan_f32(hf[h]));
    else CHECK(hf[h] == want_hf);
    ++n;
  }
  CHECK(n > 200);
  // and back: every non-NaN half survives f32 -> half unchanged; NaNs stay NaN with their sign
  const auto bf_back = bits_of<std::uint16_t>(f32_from_bits(bf).to(DType::bf16));
  const auto hf_back = bits_of<std::uint16_t>(f32_from_bits(hf).to(DType::f16));
  int bad = 0;
  for (std::size_t i = 0; i < 65536; ++i) {
    const auto p = pats[i];
    bool ok_bf = nan_bf16(p) ? (nan_bf16(bf_back[i]) && (bf_back[i] & 0x8000) == (p & 0x8000)) : bf_back[i] == p;
    bool ok_hf = nan_f16(p) ? (nan_f16(hf_back[i]) && (hf_back[i] & 0x8000) == (p & 0x8000)) : hf_back[i] == p;
    if (!(ok_bf && ok_hf) && bad++ < 5) FAIL_CHECK("round trip of half pattern " << i);
  }
  CHECK(bad == 0);
}

TEST_CASE("f32 -> bf16 and f16: ~680k values (every tie, subnormals, overflow, NaN, +-0) match PyTorch") {
  const nlohmann::json fx = test::fixture("core/halfs.json");
  const std::size_t block = fx.at("block");
  const std::vector<std::uint32_t> x = f32_inputs();
  // the inputs themselves are the generator's (else every later comparison is moot)
  REQUIRE(x.size() == fx.at("f32_inputs").at("count").get<std::size_t>());
  check_blocks("f32 inputs", block_hashes(x, [](std::uint32_t) { return false; }, 0, block),
               fx.at("f32_inputs").at("hashes"), block);

  const Tensor xt = f32_from_bits(x);
  const auto bf = bits_of<std::uint16_t>(xt.to(DType::bf16));
  const auto hf = bits_of<std::uint16_t>(xt.to(DType::f16));
  check_blocks("f32 -> bf16", block_hashes(bf, nan_bf16, 0xFFFF, block), fx.at("f32_to_bf16"), block);
  check_blocks("f32 -> f16", block_hashes(hf, nan_f16, 0xFFFF, block), fx.at("f32_to_f16"), block);

  // spot values, readable on failure
  std::map<std::uint32_t, std::size_t> where;
  for (std::size_t i = 0; i < x.size(); ++i) where.emplace(x[i], i);
  for (const auto& s : fx.at("spot_f32")) {
    const std::uint32_t in = hex(s[0]);
    const auto want_bf = static_cast<std::uint16_t>(hex(s[1])), want_hf = static_cast<std::uint16_t>(hex(s[2]));
    const std::size_t i = where.at(in);
    CAPTURE(s.dump());
    if (nan_bf16(want_bf)) CHECK(nan_bf16(bf[i]));
    else CHECK(bf[i] == want_bf);
    if (nan_f16(want_hf)) CHECK(nan_f16(hf[i]));
    else CHECK(hf[i] == want_hf);
  }
}

TEST_CASE("f32 -> half: the IEEE cases spelled out") {
  auto bf = [](std::uint32_t b) { return half::f32_to_bf16(std::bit_cast<float>(b)); };
  auto hf = [](std::uint32_t b) { return half::f32_to_f16(std::bit_cast<float>(b)); };
  // ties to even
  CHECK(bf(0x3F808000) == 0x3F80);  // 1 + 2^-8: tie, 0x3F80 is even
  CHECK(bf(0x3F818000) == 0x3F82);  // tie, rounds up to even
  CHECK(bf(0x3F808001) == 0x3F81);  // just above the tie
  CHECK(hf(0x3F801000) == 0x3C00);  // 1 + 2^-11: tie to even 1.0
  CHECK(hf(0x3F803000) == 0x3C02);
  // overflow: max finite f32 -> inf in bf16; 65520 (the tie above 65504) -> inf in f16
  CHECK(bf(0x7F7FFFFF) == 0x7F80);
  CHECK(bf(0x7F7F7FFF) == 0x7F7F);
  CHECK(hf(0x477FF000) == 0x7C00);
  CHECK(hf(0x477FEFFF) == 0x7BFF);
  CHECK(hf(0xC77FF000) == 0xFC00);
  CHECK(hf(0x7F7FFFFF) == 0x7C00);
  // subnormals: 2^-25 is the tie between 0 and the smallest f16 subnormal -> 0; above it -> 1
  CHECK(hf(0x33000000) == 0x0000);
  CHECK(hf(0x33000001) == 0x0001);
  CHECK(hf(0x33C00000) == 0x0002);  // 1.5 * 2^-24: tie, to even 2
  CHECK(hf(0xB3000001) == 0x8001);
  CHECK(bf(0x00000001) == 0x0000);  // the smallest f32 subnormal rounds to +0 in bf16
  CHECK(bf(0x00018000) == 0x0002);  // subnormal tie to even
  // signed zeros, infinities
  CHECK(bf(0x80000000) == 0x8000);
  CHECK(hf(0x80000000) == 0x8000);
  CHECK(bf(0xFF800000) == 0xFF80);
  CHECK(hf(0xFF800000) == 0xFC00);
  // NaN stays NaN (quiet), sign kept, never turned into inf by the rounding carry
  for (std::uint32_t n : {0x7F800001u, 0x7FBFFFFFu, 0x7FFFFFFFu, 0xFFC00000u, 0xFF800001u}) {
    CAPTURE(n);
    CHECK(nan_bf16(bf(n)));
    CHECK((bf(n) & 0x40) != 0);
    CHECK((bf(n) & 0x8000) == ((n >> 16) & 0x8000));
    CHECK(nan_f16(hf(n)));
    CHECK((hf(n) & 0x200) != 0);
    CHECK((hf(n) & 0x8000) == ((n >> 16) & 0x8000));
  }
}

TEST_CASE("f64 -> bf16/f16 rounds once through f32, as PyTorch") {
  const nlohmann::json fx = test::fixture("core/halfs.json");
  for (const auto& s : fx.at("f64_to_half")) {
    const double v = std::stod(s[0].get<std::string>());
    CAPTURE(s.dump());
    Tensor t = Tensor::from<double>({1}, {v});
    CHECK(bits_of<std::uint16_t>(t.to(DType::bf16))[0] == hex(s[1]));
    CHECK(bits_of<std::uint16_t>(t.to(DType::f16))[0] == hex(s[2]));
  }
}

TEST_CASE("other dtype conversions") {
  Tensor i = Tensor::from<std::int64_t>({3}, {-3, 0, 1 << 30});
  Tensor i32 = i.to(DType::i32);
  CHECK(i32.dtype() == DType::i32);
  CHECK(i32.data<std::int32_t>()[2] == (1 << 30));
  CHECK(i.to(DType::f32).to_doubles() == std::vector<double>{-3, 0, 1 << 30});
  Tensor f = Tensor::from<float>({3}, {1.5f, -2.75f, 1e-8f});
  CHECK(f.to(DType::f64).to_doubles() == f.to_doubles());
  CHECK(f.to(DType::f64).to(DType::f32).to_doubles() == f.to_doubles());
  Tensor same = f.to(DType::f32);
  CHECK_FALSE(same.shares_storage(f));  // to() always copies
  CHECK(Tensor::from_doubles({2}, {0.1, 1.0 / 3}, DType::f64).to(DType::f32).data<float>()[1] == 1.0f / 3);
  CHECK(Tensor::from<std::uint8_t>({2}, {0, 200}).to(DType::f64).to_doubles() == std::vector<double>{0, 200});
  CHECK(f.to(Device::cpu).to_doubles() == f.to_doubles());
}

// ---- printing --------------------------------------------------------------------------------

TEST_CASE("printing: values, then shape and dtype, like PyTorch") {
  CHECK(print(Tensor::from<float>({3}, {1, 2.5f, -3})) == "Tensor([1, 2.5, -3], shape=(3), dtype=float32)");
  CHECK(print(Tensor::scalar(0.125, DType::f64)) == "Tensor(0.125, shape=(), dtype=float64)");
  CHECK(print(Tensor::from<std::int32_t>({2, 2}, {1, -2, 3, 4})) ==
        "Tensor([[1, -2],\n        [3, 4]], shape=(2, 2), dtype=int32)");
  CHECK(print(Tensor::from<double>({8}, {0, 1, 2, 3, 4, 5, 6, 7})) ==
        "Tensor([0, 1, 2, ..., 5, 6, 7], shape=(8), dtype=float64)");
  CHECK(print(Tensor::from<double>({1}, {1.0 / 3})) == "Tensor([0.333333], shape=(1), dtype=float64)");
  CHECK(print(Tensor::full({2}, 1.5, DType::bf16)) == "Tensor([1.5, 1.5], shape=(2), dtype=bfloat16)");
  CHECK(print(Tensor::zeros({0}, DType::f32)) == "Tensor([], shape=(0), dtype=float32)");
  CHECK(print(Tensor()) == "Tensor(empty)");
  // the stream's own formatting is left as it was
  std::ostringstream os;
  os << std::setprecision(3) << Tensor::scalar(1.0 / 3, DType::f64) << ' ' << 1.0 / 3;
  CHECK(os.str() == "Tensor(0.333333, shape=(), dtype=float64) 0.333");
}

TEST_CASE("copy_from writes into the existing storage, so views see it") {
  Tensor dst = Tensor::zeros({2, 3}, DType::f32);
  Tensor view = dst.reshape({6});
  dst.copy_from(Tensor::from<float>({2, 3}, {1, 2, 3, 4, 5, 6}));
  CHECK(view.to_doubles() == std::vector<double>{1, 2, 3, 4, 5, 6});
}

// ---- misuse ----------------------------------------------------------------------------------

TEST_CASE("every misuse raises nn::Error naming the call, shapes and dtypes") {
  Tensor f64 = Tensor::zeros({2, 3}, DType::f64);
  const Tensor cf64 = f64;
  Tensor empty;
  test::check_error([&] { f64.data<float>(); }, {"[data]", "(2, 3)", "float64", "not float32"});
  test::check_error([&] { cf64.data<std::int32_t>(); }, {"[data]", "float64", "int32"});
  test::check_error([&] { Tensor::zeros({2}, DType::bf16).data<float>(); }, {"[data]", "bfloat16"});
  test::check_error([&] { empty.data<float>(); }, {"[data]", "empty"});
  test::check_error([&] { empty.clone(); }, {"[clone]", "empty"});
  test::check_error([&] { empty.reshape({1}); }, {"[reshape]", "empty"});
  test::check_error([&] { empty.to(DType::f32); }, {"[to]", "empty"});
  test::check_error([&] { empty.to(Device::cpu); }, {"[to]", "empty"});
  test::check_error([&] { empty.item(); }, {"[item]", "empty"});
  test::check_error([&] { empty.to_doubles(); }, {"[to_doubles]", "empty"});
  test::check_error([&] { f64.reshape({4, 2}); }, {"[reshape]", "(2, 3)", "(4, 2)", "6 elements", "8 elements"});
  test::check_error([&] { f64.item(6); }, {"[item]", "index 6", "(2, 3)"});
  test::check_error([&] { f64.item(-1); }, {"[item]", "index -1", "(2, 3)"});
  test::check_error([&] { Tensor::from<float>({2, 2}, {1, 2, 3}); }, {"[tensor]", "(2, 2)", "4 elements", "3 values"});
  test::check_error([&] { Tensor::from_doubles({3}, {1, 2}, DType::f64); }, {"[tensor]", "(3)", "2 values"});
  // a device whose backend this program lacks (the tensor layer knows no device but the host)
  test::check_error([&] { Tensor::empty({2}, DType::f32, Device::cuda); }, {"[tensor]", "device 'cuda'", "<nn/cuda.hpp>"});
  test::check_error([&] { f64.to(Device::cuda); }, {"[tensor]", "device 'cuda'", "backend"});
  test::check_error([&] { f64.copy_from(Tensor::zeros({3, 2}, DType::f64)); }, {"[copy_from]", "(3, 2)", "(2, 3)"});
  test::check_error([&] { f64.copy_from(Tensor::zeros({2, 3}, DType::f32)); }, {"[copy_from]", "float32", "float64"});
  test::check_error([&] { empty.copy_from(f64); }, {"[copy_from]", "empty"});
  test::check_error([&] { Tensor::zeros({-1}); }, {"[shape]", "negative"});
}

}  // namespace core_tensor
