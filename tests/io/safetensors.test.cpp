// SPDX-License-Identifier: MIT OR Apache-2.0
// safetensors: round trips, every dtype, the mmap lifetime, atomic saves, files written by
// Python's safetensors and by MLX, and a malformed file for every rule the reader enforces.
#include "support/check.hpp"
#include "support/temp_dir.hpp"

#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iomanip>
#include <numbers>
#include <set>
#include <sstream>

#if !defined(_WIN32)
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>
#endif

namespace io_safetensors {  // one unity source with the other io files: its names stay its own

using namespace nn;
using nn::test::TempDir;
namespace fs = std::filesystem;

namespace {


std::string le64(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xff);
  return s;
}

/// A file image: length prefix (the header's own length unless `len` is given), header, data.
std::string image(const std::string& header, const std::string& data, std::optional<std::uint64_t> len = {}) {
  return le64(len ? *len : header.size()) + header + data;
}

void write_bytes(const fs::path& p, const std::string& bytes) {
  std::ofstream f(p, std::ios::binary | std::ios::trunc);
  f.write(bytes.data(), static_cast<std::streamsize>(bytes.size()));
  REQUIRE(f.good());
}

std::string read_bytes(const fs::path& p) {
  std::ifstream f(p, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

std::string hex(std::span<const std::byte> b) {
  std::ostringstream os;
  for (std::byte x : b) os << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(x);
  return os.str();
}
std::string hex(const Tensor& t) {
  return hex(std::span<const std::byte>(static_cast<const std::byte*>(t.raw()), t.nbytes()));
}

std::string bits_of(const Tensor& t) { return hex(t); }

/// The message of the nn::Error `fn` raises ("" and a failed check when it raises none).
template <class Fn>
std::string error_of(Fn&& fn) {
  try {
    fn();
  } catch (const nn::Error& e) {
    return e.what();
  }
  FAIL_CHECK("expected an nn::Error");
  return "";
}

std::vector<std::byte> as_bytes(const std::string& s) {
  const auto* p = reinterpret_cast<const std::byte*>(s.data());
  return {p, p + s.size()};
}

// A valid two-tensor file the malformed cases start from: w F32 (2) [0, 8], b I32 (1) [8, 12].
const std::string kW = R"("w":{"dtype":"F32","shape":[2],"data_offsets":[0,8]})";
const std::string kB = R"("b":{"dtype":"I32","shape":[1],"data_offsets":[8,12]})";
const std::string kData12(12, '\x01');

struct Bad {
  std::string what;     // the case, for the report
  std::string bytes;    // the whole file
  std::string rule;     // expected "(rule: ...)"
  std::string tensor;   // expected tensor "<name>" in the message, or empty
};

std::vector<Bad> malformed_cases() {
  const std::string ok = "{" + kW + "," + kB + "}";
  auto t = [](const std::string& name, const std::string& body) { return "\"" + name + "\":" + body; };
  auto wb = [&](const std::string& w_body) { return std::string("{") + t("w", w_body) + "," + kB + "}"; };
  std::vector<Bad> v = {
      {"empty file", "", "file too short", ""},
      {"7 bytes", std::string(7, '\0'), "file too short", ""},
      {"header length above 100,000,000", image(ok, kData12, 100'000'001), "header size limit", ""},
      {"header length 2^64-1", image(ok, kData12, ~std::uint64_t{0}), "header size limit", ""},
      {"header length 2^63", image(ok, kData12, std::uint64_t{1} << 63), "header size limit", ""},
      {"header length one past the file", image(ok, "", ok.size() + 1), "header length", ""},
      {"header length past the file by a lot", image(ok, kData12, 1000), "header length", ""},
      {"header length 0", image("", ok + kData12, 0), "header start", ""},
      {"header starts with a space", image(" " + ok, kData12), "header start", ""},
      {"header starts with [", image("[" + ok.substr(1), kData12), "header start", ""},
      {"header starts with a UTF-8 BOM", image("\xEF\xBB\xBF" + ok, kData12), "header start", ""},
      {"header is a lone {", image("{", ""), "JSON", ""},
      {"header length stops inside the JSON", image(ok, kData12, ok.size() - 3), "JSON", ""},
      {"header length takes in data bytes", image(ok, kData12, ok.size() + 4), "JSON", ""},
      {"garbage after the object", image(ok + "x", kData12), "JSON", ""},
      {"a second object after the first", image(ok + "{}", kData12), "JSON", ""},
      {"NUL padding instead of spaces", image(ok + std::string(3, '\0'), kData12), "JSON", ""},
      {"NUL then garbage", image(ok + std::string(1, '\0') + "garbage", kData12), "JSON", ""},
      {"invalid UTF-8 in a name", image("{\"\xff\":1}", ""), "JSON", ""},
      {"lone surrogate escape", image(R"({"\ud800":{"dtype":"F32","shape":[0],"data_offsets":[0,0]}})", ""), "JSON", ""},
      {"trailing comma", image("{" + kW + "," + kB + ",}", kData12), "JSON", ""},
      {"single quotes", image("{'w':1}", ""), "JSON", ""},
      {"a comment", image("{/* c */" + kW + "," + kB + "}", kData12), "JSON", ""},
      {"NaN literal in a shape", image(wb(R"({"dtype":"F32","shape":[NaN],"data_offsets":[0,8]})"), kData12), "JSON", ""},
      {"raw control character in a name", image("{\"a\nb\":1}", ""), "JSON", ""},
      {"tensor entry is a number", image("{" + t("w", "5") + "," + kB + "}", kData12), "header structure", "w"},
      {"tensor entry is an array", image("{" + t("w", "[]") + "}", ""), "header structure", "w"},
      {"tensor entry is a string", image("{" + t("w", "\"F32\"") + "}", ""), "header structure", "w"},
      {"tensor entry is null", image("{" + t("w", "null") + "}", ""), "header structure", "w"},
      {"__metadata__ is a string", image(R"({"__metadata__":"x",)" + kW + "," + kB + "}", kData12), "metadata strings", ""},
      {"__metadata__ is an array", image(R"({"__metadata__":["a"],)" + kW + "," + kB + "}", kData12), "metadata strings", ""},
      {"metadata value is a number", image(R"({"__metadata__":{"a":1},)" + kW + "," + kB + "}", kData12), "metadata strings", ""},
      {"metadata value is null", image(R"({"__metadata__":{"a":null}})", ""), "metadata strings", ""},
      {"metadata value is an object", image(R"({"__metadata__":{"a":{}}})", ""), "metadata strings", ""},
      {"metadata value is a boolean", image(R"({"__metadata__":{"a":true}})", ""), "metadata strings", ""},
      {"metadata value is an array", image(R"({"__metadata__":{"a":["x"]}})", ""), "metadata strings", ""},
      {"duplicate tensor name", image("{" + kW + "," + kB + "," + kW + "}", kData12), "no duplicate names", "w"},
      {"duplicate tensor name, same offsets", image("{" + kB + "," + kB + "}", std::string(4, '\0')), "no duplicate names", "b"},
      {"duplicate __metadata__", image(R"({"__metadata__":{},"__metadata__":{}})", ""), "no duplicate names", ""},
      {"duplicate metadata key", image(R"({"__metadata__":{"k":"a","k":"b"}})", ""), "no duplicate names", ""},
      {"duplicate dtype field", image(wb(R"({"dtype":"F32","dtype":"I32","shape":[2],"data_offsets":[0,8]})"), kData12), "no duplicate names", "w"},
      {"duplicate unknown field", image(wb(R"({"x":1,"x":2,"dtype":"F32","shape":[2],"data_offsets":[0,8]})"), kData12), "no duplicate names", "w"},
      {"missing dtype", image(wb(R"({"shape":[2],"data_offsets":[0,8]})"), kData12), "missing field", "w"},
      {"missing shape", image(wb(R"({"dtype":"F32","data_offsets":[0,8]})"), kData12), "missing field", "w"},
      {"missing data_offsets", image(wb(R"({"dtype":"F32","shape":[2]})"), kData12), "missing field", "w"},
      {"empty tensor entry", image(wb("{}"), kData12), "missing field", "w"},
      {"unknown dtype F128", image(wb(R"({"dtype":"F128","shape":[2],"data_offsets":[0,8]})"), kData12), "known dtype", "w"},
      {"dtype in lower case", image(wb(R"({"dtype":"f32","shape":[2],"data_offsets":[0,8]})"), kData12), "known dtype", "w"},
      {"empty dtype", image(wb(R"({"dtype":"","shape":[2],"data_offsets":[0,8]})"), kData12), "known dtype", "w"},
      {"dtype is a number", image(wb(R"({"dtype":4,"shape":[2],"data_offsets":[0,8]})"), kData12), "known dtype", "w"},
      {"dtype is an object", image(wb(R"({"dtype":{},"shape":[2],"data_offsets":[0,8]})"), kData12), "known dtype", "w"},
      {"shape is a string", image(wb(R"({"dtype":"F32","shape":"2","data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"shape is an object", image(wb(R"({"dtype":"F32","shape":{},"data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"negative dimension", image(wb(R"({"dtype":"F32","shape":[-2],"data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"fractional dimension", image(wb(R"({"dtype":"F32","shape":[2.0],"data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"string dimension", image(wb(R"({"dtype":"F32","shape":["2"],"data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"nested shape", image(wb(R"({"dtype":"F32","shape":[[2]],"data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"dimension 2^63", image(wb(R"({"dtype":"F32","shape":[9223372036854775808,0],"data_offsets":[0,0]})"), kData12), "shape", "w"},
      {"dimension above 2^64", image(wb(R"({"dtype":"F32","shape":[100000000000000000000],"data_offsets":[0,8]})"), kData12), "shape", "w"},
      {"data_offsets is a number", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":8})"), kData12), "data_offsets", "w"},
      {"one offset", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":[8]})"), kData12), "data_offsets", "w"},
      {"three offsets", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8,8]})"), kData12), "data_offsets", "w"},
      {"no offsets", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":[]})"), kData12), "data_offsets", "w"},
      {"negative offset", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":[-8,0]})"), kData12), "data_offsets", "w"},
      {"fractional offset", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":[0,8.5]})"), kData12), "data_offsets", "w"},
      {"offsets end before they begin", image(wb(R"({"dtype":"F32","shape":[2],"data_offsets":[8,0]})"), kData12), "data_offsets", "w"},
      {"shape and offsets disagree", image(wb(R"({"dtype":"F32","shape":[3],"data_offsets":[0,8]})"), kData12), "byte size", "w"},
      {"dtype and offsets disagree", image(wb(R"({"dtype":"F64","shape":[2],"data_offsets":[0,8]})"), kData12), "byte size", "w"},
      {"element count overflows", image(wb(R"({"dtype":"F32","shape":[4294967296,4294967296,2],"data_offsets":[0,8]})"), kData12), "byte size", "w"},
      {"running element count above int64 before a zero", image(wb(R"({"dtype":"F32","shape":[4294967296,2147483648,0],"data_offsets":[0,0]})"), kData12), "byte size", "w"},
      {"byte count overflows", image(wb(R"({"dtype":"F64","shape":[4611686018427387904],"data_offsets":[0,8]})"), kData12), "byte size", "w"},
      {"wrapped size: 2^61 F64 elements is 0 mod 2^64", image(wb(R"({"dtype":"F64","shape":[2305843009213693952],"data_offsets":[0,0]})"), kData12), "byte size", "w"},
      {"three F4 values are not whole bytes", image(R"({"f":{"dtype":"F4","shape":[3],"data_offsets":[0,2]}})", "ab"), "byte size", "f"},
      {"one F6 value is not a whole byte", image(R"({"f":{"dtype":"F6_E2M3","shape":[1],"data_offsets":[0,1]}})", "a"), "byte size", "f"},
      {"last tensor past the buffer", image(ok, kData12.substr(0, 10)), "offsets inside buffer", "b"},
      {"tensor far past the buffer", image(R"({"w":{"dtype":"U8","shape":[4],"data_offsets":[1000,1004]}})", "abcd"), "offsets inside buffer", "w"},
      {"overlapping tensors", image("{" + kW + "," + R"("b":{"dtype":"I32","shape":[1],"data_offsets":[4,8]})" + "}", std::string(8, 'x')), "no overlap", ""},
      {"two tensors on the same bytes", image("{" + kW + "," + R"("v":{"dtype":"I32","shape":[2],"data_offsets":[0,8]})" + "}", std::string(8, 'x')), "no overlap", ""},
      {"empty tensor inside another", image("{" + kW + "," + R"("e":{"dtype":"F32","shape":[0],"data_offsets":[4,4]})" + "}", std::string(8, 'x')), "no overlap", "e"},
      {"hole before the first tensor", image(R"({"w":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})", kData12), "no holes", "w"},
      {"hole between tensors", image("{" + kW + "," + R"("b":{"dtype":"I32","shape":[1],"data_offsets":[12,16]})" + "}", std::string(16, 'x')), "no holes", "b"},
      {"trailing bytes after the last tensor", image(ok, kData12 + "xx"), "no holes", ""},
      {"data but no tensors", image("{}", "xxxx"), "no holes", ""},
      {"data but only metadata", image(R"({"__metadata__":{"a":"b"}})", "x"), "no holes", ""},
  };
  return v;
}

/// A valid file with metadata and three tensors, for the truncation sweep.
std::string good_file() {
  Tensor a = Tensor::from<float>({2, 2}, {1, 2, 3, 4});
  Tensor b = Tensor::from<std::int64_t>({3}, {-1, 0, 1});
  Tensor c = Tensor::from<std::uint8_t>({5}, {1, 2, 3, 4, 5});
  auto v = serialize_safetensors({{"a", a}, {"b", b}, {"c", c}}, {{"format", "mlx"}});
  return {reinterpret_cast<const char*>(v.data()), v.size()};
}

}  // namespace

// ---------------------------------------------------------------------------------------------

TEST_CASE("safetensors dtype table: 22 names, their bits, the nn mapping") {
  const char* names[] = {"BOOL", "F4", "F6_E2M3", "F6_E3M2", "U8", "I8", "F8_E5M2", "F8_E4M3", "F8_E8M0",
                         "F8_E4M3FNUZ", "F8_E5M2FNUZ", "I16", "U16", "F16", "BF16", "I32", "U32", "F32",
                         "C64", "F64", "I64", "U64"};
  const int bits[] = {8, 4, 6, 6, 8, 8, 8, 8, 8, 8, 8, 16, 16, 16, 16, 32, 32, 32, 64, 64, 64, 64};
  for (int i = 0; i < kSafetensorsDtypeCount; ++i) {
    auto d = parse_safetensors_dtype(names[i]);
    REQUIRE(d);
    CHECK(std::string(safetensors_dtype_name(*d)) == names[i]);
    CHECK(safetensors_dtype_bits(*d) == bits[i]);
  }
  CHECK_FALSE(parse_safetensors_dtype("f32"));
  CHECK_FALSE(parse_safetensors_dtype("F8"));
  CHECK(safetensors_tensor_dtype(SafetensorsDtype::BF16) == DType::bf16);
  CHECK(safetensors_tensor_dtype(SafetensorsDtype::I16) == DType::i32);
  CHECK(safetensors_tensor_dtype(SafetensorsDtype::I8) == DType::i32);
  CHECK(safetensors_tensor_dtype(SafetensorsDtype::BOOL) == DType::u8);
  CHECK_FALSE(safetensors_tensor_dtype(SafetensorsDtype::U64));
  CHECK_FALSE(safetensors_tensor_dtype(SafetensorsDtype::F8_E4M3));
  for (DType t : {DType::f32, DType::f64, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u32, DType::u8})
    CHECK(safetensors_tensor_dtype(safetensors_dtype_of(t)) == t);  // every nn dtype round-trips
}

TEST_CASE("save then open: every nn dtype bit for bit, order, metadata, header layout") {
  TempDir dir;
  const fs::path p = dir / "all.safetensors";
  Tensor f32 = Tensor::from<float>({2, 4}, {1.0f, -2.5f, INFINITY, -INFINITY, NAN, -0.0f, 1e-45f, 3.4028235e38f});
  Tensor f64 = Tensor::from<double>({3}, {std::numbers::pi, -1e300, 5e-324});
  Tensor bf = f32.to(DType::bf16);
  Tensor hf = f32.to(DType::f16);
  Tensor i32 = Tensor::from<std::int32_t>({2, 1}, {-2147483647 - 1, 2147483647});
  Tensor i64 = Tensor::from<std::int64_t>({2}, {INT64_MIN, INT64_MAX});
  Tensor u32 = Tensor::from<std::uint32_t>({1}, {4294967295u});
  Tensor u8 = Tensor::from<std::uint8_t>({3}, {0, 128, 255});
  Tensor scalar = Tensor::scalar(7.25);
  Tensor empty = Tensor::zeros({0, 3});
  Tensor r4 = test::random_tensor({2, 1, 3, 2}, DType::f32, 7);
  NamedTensors in = {{"z.last_alphabetically_first", u8}, {"f32", f32}, {"f64", f64}, {"bf16", bf}, {"f16", hf},
                     {"i32", i32}, {"i64", i64}, {"u32", u32}, {"scalar", scalar}, {"empty", empty},
                     {"model.layers.0.mlp.up_proj.weight", r4}, {"ünï.名", i32}};
  SafetensorsMetadata meta = {{"format", "mlx"}, {"note", "quote \" backslash \\ newline \n tab \t ü"}};
  save_safetensors(p, in, meta);

  SafetensorsFile f(p);
  CHECK(f.path() == p.string());
  CHECK(f.metadata() == meta);
  REQUIRE(f.size() == in.size());
  std::vector<std::string> order;
  for (auto& [n, t] : in) order.push_back(n);
  CHECK(f.names() == order);  // the given order, not sorted
  std::uint64_t expect_begin = 0;
  for (std::size_t i = 0; i < in.size(); ++i) {
    const auto& [name, t] = in[i];
    SafetensorsView v = f.view(name);
    CHECK(v.name() == name);
    CHECK(v.dtype() == safetensors_dtype_of(t.dtype()));
    CHECK(v.shape() == t.shape().vec());
    CHECK(v.data_offsets().first == expect_begin);  // data in the given order, back to back
    expect_begin = v.data_offsets().second;
    Tensor back = v.to_tensor();
    CHECK(back.dtype() == t.dtype());
    CHECK(back.shape() == t.shape());
    CHECK(bits_of(back) == bits_of(t));
    CHECK(hex(v.bytes()) == bits_of(t));
  }
  // Header layout, as the Rust and MLX readers expect it.
  const std::string raw = read_bytes(p);
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(raw[static_cast<std::size_t>(i)]);
  CHECK(n % 8 == 0);
  CHECK(f.data_start() == 8 + n);
  CHECK(raw[8] == '{');
  std::string header = raw.substr(8, n);
  CHECK(header.find("{\"__metadata__\":{") == 0);
  auto last = header.find_last_not_of(' ');
  CHECK(header[last] == '}');
  CHECK(raw.size() == 8 + n + expect_begin);
  // serialize_safetensors produces the very same bytes.
  auto mem = serialize_safetensors(in, meta);
  CHECK(std::string(reinterpret_cast<const char*>(mem.data()), mem.size()) == raw);
  // load_safetensors: the same, with metadata.
  SafetensorsMetadata m2;
  NamedTensors all = load_safetensors(p, &m2);
  CHECK(m2 == meta);
  REQUIRE(all.size() == in.size());
  for (std::size_t i = 0; i < in.size(); ++i) {
    CHECK(all[i].first == in[i].first);
    CHECK(bits_of(all[i].second) == bits_of(in[i].second));
  }
}

TEST_CASE("no metadata: no __metadata__ key; the smallest file is {} padded to 8") {
  auto v = serialize_safetensors(NamedTensors{});
  std::string s(reinterpret_cast<const char*>(v.data()), v.size());
  CHECK(s == le64(8) + "{}      ");  // byte for byte what the Rust writer emits for no tensors
  SafetensorsFile f = SafetensorsFile::from_bytes(as_bytes(s));
  CHECK(f.size() == 0);
  CHECK(f.metadata().empty());
}

TEST_CASE("all 22 dtypes parse; the loadable ones convert exactly, the others raise naming the dtype") {
  // One tensor per dtype, 2 elements each except F4 (2 values = 1 byte) and F6 (4 values = 3 bytes).
  std::string header = "{", data;
  std::uint64_t off = 0;
  for (int i = 0; i < kSafetensorsDtypeCount; ++i) {
    auto d = static_cast<SafetensorsDtype>(i);
    int bits = safetensors_dtype_bits(d);
    int count = bits == 6 ? 4 : 2;
    std::uint64_t nb = static_cast<std::uint64_t>(count * bits / 8);
    if (i) header += ",";
    header += "\"t" + std::to_string(i) + "\":{\"dtype\":\"" + safetensors_dtype_name(d) + "\",\"shape\":[" +
              std::to_string(count) + "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + nb) + "]}";
    for (std::uint64_t k = 0; k < nb; ++k) data += static_cast<char>(0x80 + k);  // 0x80, 0x81, ...
    off += nb;
  }
  header += "}";
  SafetensorsFile f = SafetensorsFile::from_bytes(as_bytes(image(header, data)), "all-dtypes");
  REQUIRE(f.size() == 22);
  for (int i = 0; i < kSafetensorsDtypeCount; ++i) {
    auto d = static_cast<SafetensorsDtype>(i);
    SafetensorsView v = f.view(std::string("t").append(std::to_string(i)));
    CAPTURE(safetensors_dtype_name(d));
    CHECK(v.dtype() == d);
    CHECK(v.bytes().size() == static_cast<std::size_t>(v.numel() * safetensors_dtype_bits(d) / 8));
    if (!v.tensor_dtype()) {
      std::string msg = error_of([&] { v.to_tensor(); });
      CHECK(msg.find("[safetensors] all-dtypes: tensor \"t" + std::to_string(i) + "\" has dtype " +
                     safetensors_dtype_name(d)) == 0);
      continue;
    }
    Tensor t = v.to_tensor();
    CHECK(t.dtype() == *v.tensor_dtype());
    CHECK(t.numel() == 2);
    // The expected values, worked out by hand from the bytes 0x80 0x81 ... (little-endian).
    std::vector<double> want;
    switch (d) {
      case SafetensorsDtype::BOOL: want = {1, 1}; break;
      case SafetensorsDtype::U8: want = {0x80, 0x81}; break;
      case SafetensorsDtype::I8: want = {-128, -127}; break;
      case SafetensorsDtype::I16: want = {static_cast<std::int16_t>(0x8180), static_cast<std::int16_t>(0x8382)}; break;
      case SafetensorsDtype::U16: want = {0x8180, 0x8382}; break;
      case SafetensorsDtype::I32: want = {static_cast<std::int32_t>(0x83828180u), static_cast<std::int32_t>(0x87868584u)}; break;
      case SafetensorsDtype::U32: want = {0x83828180u, 0x87868584u}; break;
      case SafetensorsDtype::F16: want = {half::f16_to_f32(0x8180), half::f16_to_f32(0x8382)}; break;
      case SafetensorsDtype::BF16: want = {half::bf16_to_f32(0x8180), half::bf16_to_f32(0x8382)}; break;
      case SafetensorsDtype::F32: want = {std::bit_cast<float>(0x83828180u), std::bit_cast<float>(0x87868584u)}; break;
      case SafetensorsDtype::F64:
        want = {std::bit_cast<double>(0x8786858483828180ull), std::bit_cast<double>(0x8f8e8d8c8b8a8988ull)};
        break;
      case SafetensorsDtype::I64:
        want = {static_cast<double>(std::bit_cast<std::int64_t>(0x8786858483828180ull)),
                static_cast<double>(std::bit_cast<std::int64_t>(0x8f8e8d8c8b8a8988ull))};
        break;
      default: FAIL("unexpected loadable dtype");
    }
    CHECK(t.to_doubles() == want);
    if (d == SafetensorsDtype::I64) CHECK(t.data<std::int64_t>()[0] == std::bit_cast<std::int64_t>(0x8786858483828180ull));
  }
}

TEST_CASE("BOOL loads as 0/1 u8; I8/I16/U16 widen to i32 with their signs") {
  std::string h = R"({"b":{"dtype":"BOOL","shape":[4],"data_offsets":[0,4]},)"
                  R"("i8":{"dtype":"I8","shape":[3],"data_offsets":[4,7]},)"
                  R"("i16":{"dtype":"I16","shape":[2],"data_offsets":[7,11]},)"
                  R"("u16":{"dtype":"U16","shape":[1],"data_offsets":[11,13]}})";
  std::string d = std::string("\x00\x01\x02\xff", 4) + std::string("\xff\x80\x7f", 3) + std::string("\xff\xff\x00\x80", 4) +
                  std::string("\xff\xff", 2);
  SafetensorsFile f = SafetensorsFile::from_bytes(as_bytes(image(h, d)));
  CHECK(f.tensor("b").to_doubles() == std::vector<double>{0, 1, 1, 1});
  CHECK(f.tensor("b").dtype() == DType::u8);
  CHECK(f.tensor("i8").to_doubles() == std::vector<double>{-1, -128, 127});
  CHECK(f.tensor("i16").to_doubles() == std::vector<double>{-1, -32768});
  CHECK(f.tensor("u16").to_doubles() == std::vector<double>{65535});
  CHECK(f.tensor("u16").dtype() == DType::i32);
}

TEST_CASE("bf16 and f16 load as themselves and convert exactly to f32") {
  Tensor x = test::random_tensor({64}, DType::f32, 3, -100, 100);
  TempDir dir;
  save_safetensors(dir / "h.safetensors", {{"bf", x.to(DType::bf16)}, {"hf", x.to(DType::f16)}});
  SafetensorsFile f(dir / "h.safetensors");
  Tensor bf = f.tensor("bf"), hf = f.tensor("hf");
  CHECK(bf.dtype() == DType::bf16);
  CHECK(hf.dtype() == DType::f16);
  CHECK(bits_of(bf.to(DType::f32)) == bits_of(x.to(DType::bf16).to(DType::f32)));
  CHECK(bits_of(hf.to(DType::f32)) == bits_of(x.to(DType::f16).to(DType::f32)));
}

TEST_CASE("lenient where the Rust reader is: unknown fields skipped, null metadata, trailing whitespace") {
  std::string h = R"({"__metadata__":null,"w":{"extra":{"a":[1,{"b":[[[]]]}],"c":"d"},"dtype":"F32",)"
                  R"("more":[{"x":null}],"shape":[1],"data_offsets":[0,4],"last":true}})";
  SafetensorsFile f = SafetensorsFile::from_bytes(as_bytes(image(h + " \t\r\n ", std::string(4, '\0'))));
  CHECK(f.metadata().empty());
  CHECK(f.names() == std::vector<std::string>{"w"});
  CHECK(f.tensor("w").to_doubles() == std::vector<double>{0});
  // Offsets in any header order; tensors of zero elements anywhere at a boundary.
  std::string h2 = R"({"b":{"dtype":"U8","shape":[2],"data_offsets":[2,4]},"e":{"dtype":"F32","shape":[0,5],"data_offsets":[2,2]},)"
                   R"("a":{"dtype":"U8","shape":[2],"data_offsets":[0,2]},"z":{"dtype":"F64","shape":[0],"data_offsets":[4,4]}})";
  SafetensorsFile g = SafetensorsFile::from_bytes(as_bytes(image(h2, "abcd")));
  CHECK(g.names() == std::vector<std::string>{"b", "e", "a", "z"});  // header order
  CHECK(g.tensor("e").shape() == Shape{0, 5});
  CHECK(g.tensor("b").to_doubles() == std::vector<double>{'c', 'd'});
  // Zero elements whatever follows the zero, as in the Rust reader.
  std::string h3 = R"({"z":{"dtype":"F64","shape":[0,4294967296,4294967296],"data_offsets":[0,0]}})";
  CHECK(SafetensorsFile::from_bytes(as_bytes(image(h3, ""))).tensor("z").numel() == 0);
}

TEST_CASE("lookup errors name the file and what it holds") {
  SafetensorsFile f = SafetensorsFile::from_bytes(as_bytes(good_file()), "g.safetensors");
  std::string msg = error_of([&] { f.view("nope"); });
  CHECK(msg == "[safetensors] g.safetensors: no tensor named \"nope\"; the file holds 3 tensors: \"a\", \"b\", \"c\"");
  CHECK(error_of([&] { f.view(std::size_t{3}); }).find("index 3 out of range") != std::string::npos);
  CHECK(f.contains("b"));
  CHECK_FALSE(f.contains("d"));
  // Rank above nn's limit is readable as bytes, refused as a Tensor.
  std::string h = R"({"r9":{"dtype":"U8","shape":[1,1,1,1,1,1,1,1,1],"data_offsets":[0,1]}})";
  SafetensorsFile g = SafetensorsFile::from_bytes(as_bytes(image(h, "x")), "r9");
  CHECK(g.view("r9").bytes().size() == 1);
  CHECK(error_of([&] { g.tensor("r9"); }).find("has rank 9") != std::string::npos);
}

#if defined(__linux__)
namespace {
bool mapped(const fs::path& p) {
  std::ifstream maps("/proc/self/maps");
  std::string line, want = fs::canonical(p).string();
  while (std::getline(maps, line))
    if (line.size() >= want.size() && line.compare(line.size() - want.size(), want.size(), want) == 0) return true;
  return false;
}
}  // namespace

TEST_CASE("the file is mmapped, and unmapped when the last file object or view goes") {
  TempDir dir;
  const fs::path p = dir / "m.safetensors";
  write_bytes(p, good_file());
  CHECK_FALSE(mapped(p));
  std::optional<SafetensorsView> keep;
  {
    SafetensorsFile f(p);
    CHECK(mapped(p));
    keep = f.view("b");
    SafetensorsFile copy = f;  // copies share the one mapping
  }
  CHECK(mapped(p));  // the view alone keeps it
  CHECK(keep->to_tensor().to_doubles() == std::vector<double>{-1, 0, 1});
  keep.reset();
  CHECK_FALSE(mapped(p));
  { auto t = load_safetensors(p); }
  CHECK_FALSE(mapped(p));  // tensors are copies; they do not pin the file
}
#endif

TEST_CASE("saving over a file that is open replaces it; views of the old one still read the old data") {
  TempDir dir;
  const fs::path p = dir / "w.safetensors";
  save_safetensors(p, {{"x", Tensor::from<float>({2}, {1, 2})}});
  SafetensorsFile old(p);
  SafetensorsView old_x = old.view("x");
  save_safetensors(p, {{"x", Tensor::from<float>({3}, {7, 8, 9})}});
  CHECK(old_x.to_tensor().to_doubles() == std::vector<double>{1, 2});  // rename left the old inode mapped
  CHECK(SafetensorsFile(p).tensor("x").to_doubles() == std::vector<double>{7, 8, 9});
  // Views can be written back byte for byte, even over the file they come from.
  save_safetensors(p, old.views(), {{"again", "yes"}});
  SafetensorsFile again(p);
  CHECK(again.tensor("x").to_doubles() == std::vector<double>{1, 2});
  CHECK(again.metadata().at("again") == "yes");
  CHECK(dir.listing() == std::vector<std::string>{"w.safetensors"});  // no temporary left
}

TEST_CASE("writer refuses what readers would refuse, before touching the disk") {
  TempDir dir;
  const fs::path p = dir / "bad.safetensors";
  Tensor t = Tensor::ones({2});
  test::check_error([&] { save_safetensors(p, {{"a", t}, {"a", t}}); }, {"[safetensors]", p.string(), "\"a\" is given twice"});
  test::check_error([&] { save_safetensors(p, {{"__metadata__", t}}); }, {"[safetensors]", "\"__metadata__\""});
  test::check_error([&] { save_safetensors(p, {{"u", Tensor()}}); }, {"[safetensors]", "\"u\" is empty"});
  test::check_error([&] { save_safetensors(p, {{"bad\xff", t}}); }, {"[safetensors]", "not valid UTF-8"});
  test::check_error([&] { save_safetensors(p, {{"a", t}}, {{"k", "\xc3"}}); }, {"[safetensors]", "metadata value", "not valid UTF-8"});
  CHECK(dir.listing().empty());
  test::check_error([&] { save_safetensors(dir / "no" / "such" / "dir.safetensors", {{"a", t}}); },
                    {"[safetensors]", "cannot create the temporary file"});
  test::check_error([&] { save_safetensors(dir.path / "", {{"a", t}}); }, {"[safetensors]", "names no file"});
}

TEST_CASE("an error while writing removes the temporary file and leaves the old file intact") {
  TempDir dir;
  const fs::path p = dir / "ckpt.safetensors";
  save_safetensors(p, {{"x", Tensor::from<float>({2}, {1, 2})}});
  const std::string before = read_bytes(p);
  NamedTensors big = {{"x", Tensor::ones({1000})}, {"y", Tensor::ones({1000})}};
  for (int fail_at : {1, 2, 3}) {  // after the header, after x, after y (before fsync and rename)
    static int calls;
    static int at;
    calls = 0;
    at = fail_at;
    detail::st_write_hook() = [](std::size_t) {
      if (++calls == at) detail::fail("test", "injected I/O error");
    };
    test::check_error([&] { save_safetensors(p, big); }, {"[test] injected I/O error"});
    detail::st_write_hook() = nullptr;
    CHECK(read_bytes(p) == before);
    CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors"});
  }
  // rename() itself failing (the target is a non-empty folder): the temporary goes too.
  fs::create_directories(dir / "taken.safetensors" / "inside");
  test::check_error([&] { save_safetensors(dir / "taken.safetensors", big); }, {"[safetensors]", "cannot rename"});
  CHECK(dir.listing() == std::vector<std::string>{"ckpt.safetensors", "taken.safetensors"});
}

#if !defined(_WIN32)
TEST_CASE("the next save to a path removes the temporaries killed saves left behind; a live process's stay") {
  TempDir dir;
  pid_t child = ::fork();  // a process that is gone by the time we save
  REQUIRE(child >= 0);
  if (child == 0) ::_exit(0);
  ::waitpid(child, nullptr, 0);
  const std::string dead = std::to_string(child), live = std::to_string(::getppid());
  const std::vector<std::string> made = {".w.safetensors.tmp." + dead + ".0", ".w.safetensors.tmp." + dead + ".7",
                                         ".w.safetensors.tmp." + live + ".0", ".other.safetensors.tmp." + dead + ".0"};
  for (const auto& n : made) std::ofstream(dir / n) << "partial";
  save_safetensors(dir / "w.safetensors", {{"x", Tensor::from<float>({2}, {1, 2})}});
  CHECK(dir.listing() == std::vector<std::string>{".other.safetensors.tmp." + dead + ".0",
                                                  ".w.safetensors.tmp." + live + ".0", "w.safetensors"});
}

TEST_CASE("a crash in the middle of a save leaves the old file in place, whole") {
  TempDir dir;
  const fs::path p = dir / "ckpt.safetensors";
  save_safetensors(p, {{"x", Tensor::from<float>({2}, {1, 2})}});
  const std::string before = read_bytes(p);
  for (int die_at : {1, 2}) {
    static int calls;
    static int at;
    calls = 0;
    at = die_at;
    std::fflush(nullptr);
    pid_t pid = ::fork();
    REQUIRE(pid >= 0);
    if (pid == 0) {  // the child dies mid-write, as a killed process would: no unwinding, no cleanup
      detail::st_write_hook() = [](std::size_t) {
        if (++calls == at) ::_exit(0);
      };
      save_safetensors(p, {{"x", Tensor::ones({4096})}, {"y", Tensor::ones({4096})}});
      ::_exit(1);  // not reached
    }
    int status = 0;
    ::waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status));
    CHECK(read_bytes(p) == before);
    CHECK(SafetensorsFile(p).tensor("x").to_doubles() == std::vector<double>{1, 2});
    // What a crash leaves is a hidden ".ckpt.safetensors.tmp.<pid>.<n>" beside it, never the target.
    auto names = dir.listing();
    REQUIRE(names.size() == 2);
    CHECK(names[0].rfind(".ckpt.safetensors.tmp.", 0) == 0);
    fs::remove(dir / names[0]);
  }
}

TEST_CASE("opening what is not a regular file fails fast, naming it") {
  TempDir dir;
  test::check_error([&] { SafetensorsFile f(dir / "missing.safetensors"); },
                    {"[safetensors]", "missing.safetensors", "cannot open", "No such file"});
  test::check_error([&] { SafetensorsFile f(dir.path); }, {"[safetensors]", "not a regular file"});
  const fs::path fifo = dir / "fifo";
  REQUIRE(::mkfifo(fifo.c_str(), 0600) == 0);
  test::check_error([&] { SafetensorsFile f(fifo); }, {"[safetensors]", "not a regular file"});  // and no hang
}
#endif

TEST_CASE("malformed files: each rule broken once, each refused with the file, tensor and rule named") {
  TempDir dir;
  auto cases = malformed_cases();
  int n = 0;
  std::set<std::string> rules;
  for (const Bad& c : cases) {
    CAPTURE(c.what);
    const fs::path p = dir / ("bad" + std::to_string(n++) + ".safetensors");
    write_bytes(p, c.bytes);
    std::string msg = error_of([&] { SafetensorsFile f(p); });
    CHECK(msg.rfind("[safetensors] " + p.string() + ": ", 0) == 0);
    CHECK_MESSAGE(msg.find("(rule: " + c.rule + ")") != std::string::npos, msg);
    if (!c.tensor.empty()) CHECK_MESSAGE(msg.find("tensor \"" + c.tensor + "\"") != std::string::npos, msg);
    // The same bytes from memory give the same verdict.
    std::string msg2 = error_of([&] { SafetensorsFile::from_bytes(as_bytes(c.bytes), p.string()); });
    CHECK(msg2 == msg);
    rules.insert(c.rule);
  }
  MESSAGE(cases.size() << " malformed files, " << rules.size() << " rules, every one refused");
  CHECK(cases.size() >= 50);
  CHECK(rules.size() == 16);
}

TEST_CASE("error messages quote at most a few hundred bytes of a hostile header") {
  const std::string huge(100000, 'A');
  for (const std::string& h : {R"({"w":{"dtype":")" + huge + R"(","shape":[0],"data_offsets":[0,0]}})",
                               R"({")" + huge + R"(":{"dtype":"F32","shape":[1],"data_offsets":[0,8]}})",
                               R"({"__metadata__":{")" + huge + R"(":1}})", R"({"w":")" + huge}) {
    std::string msg = error_of([&] { SafetensorsFile::from_bytes(as_bytes(image(h, ""))); });
    CHECK(msg.find("(rule: ") != std::string::npos);
    CHECK(msg.size() < 600);
  }
}

TEST_CASE("truncation at every byte: inside the length, inside the JSON, inside the data") {
  const std::string full = good_file();
  std::uint64_t n = 0;
  for (int i = 7; i >= 0; --i) n = (n << 8) | static_cast<unsigned char>(full[static_cast<std::size_t>(i)]);
  REQUIRE(SafetensorsFile::from_bytes(as_bytes(full)).size() == 3);
  int count[3] = {0, 0, 0};
  for (std::size_t len = 0; len < full.size(); ++len) {
    CAPTURE(len);
    std::string msg = error_of([&] { SafetensorsFile::from_bytes(as_bytes(full.substr(0, len)), "cut"); });
    const char* rule = len < 8 ? "file too short" : len < 8 + n ? "header length" : "offsets inside buffer";
    CHECK_MESSAGE(msg.find(std::string("(rule: ") + rule + ")") != std::string::npos, msg);
    ++count[len < 8 ? 0 : len < 8 + n ? 1 : 2];
  }
  MESSAGE("truncations refused: " << count[0] << " in the length, " << count[1] << " in the header, " << count[2]
                                  << " in the data");
  CHECK(count[0] == 8);
  CHECK(count[2] > 0);
  // One byte too many is refused too.
  CHECK(error_of([&] { SafetensorsFile::from_bytes(as_bytes(full + "x")); }).find("(rule: no holes)") != std::string::npos);
}

TEST_CASE("every single-byte change of a header either loads or raises nn::Error, never anything else") {
  const std::string full = good_file();
  const std::size_t header_end = full.size() - 16 - 24 - 5;
  int loaded = 0, refused = 0;
  for (std::size_t i = 0; i < header_end; ++i) {
    for (unsigned char x : {0x00, 0x01, 0x20, 0x22, 0x2c, 0x30, 0x39, 0x5b, 0x5d, 0x7b, 0x7d, 0x7f, 0x80, 0xff}) {
      std::string s = full;
      if (static_cast<unsigned char>(s[i]) == x) continue;
      s[i] = static_cast<char>(x);
      try {
        SafetensorsFile f = SafetensorsFile::from_bytes(as_bytes(s));
        for (const auto& v : f.views())
          if (v.tensor_dtype() && v.shape().size() <= 8) (void)v.to_tensor();
        ++loaded;
      } catch (const nn::Error& e) {
        CHECK(std::string(e.what()).rfind("[safetensors] ", 0) == 0);
        ++refused;
      }
    }
  }
  MESSAGE("single-byte header mutations: " << loaded << " still valid, " << refused << " refused");
  CHECK(refused > 0);
}

// ---------------------------------------------------------------------------------------------
// Files written by others (tests/oracle/gen_safetensors.py).

TEST_CASE("files written by Python's safetensors and by MLX load with exact values") {
  const nlohmann::json all = test::fixture("io/safetensors_expected.json");
  std::set<std::string> dtypes_seen;
  int tensors = 0, valued = 0;
  for (const auto& [file, want] : all.items()) {
    CAPTURE(file);
    SafetensorsFile f(fs::path(NN_FIXTURES_DIR) / "io" / file);
    CHECK(f.data_start() == 8 + want.at("header_length").get<std::size_t>());
    CHECK(f.names() == want.at("header_order").get<std::vector<std::string>>());
    SafetensorsMetadata meta;
    if (!want.at("metadata").is_null()) meta = want.at("metadata").get<SafetensorsMetadata>();
    CHECK(f.metadata() == meta);
    for (const auto& [name, t] : want.at("tensors").items()) {
      CAPTURE(name);
      SafetensorsView v = f.view(name);
      ++tensors;
      CHECK(safetensors_dtype_name(v.dtype()) == t.at("dtype").get<std::string>());
      CHECK(v.shape() == t.at("shape").get<std::vector<std::int64_t>>());
      CHECK(hex(v.bytes()) == t.at("hex").get<std::string>());
      dtypes_seen.insert(safetensors_dtype_name(v.dtype()));
      if (!t.contains("values")) {
        CHECK_FALSE(v.tensor_dtype());
        continue;
      }
      ++valued;
      Tensor x = v.to_tensor();
      const auto& vals = t.at("values");
      REQUIRE(static_cast<std::size_t>(x.numel()) == vals.size());
      for (std::size_t i = 0; i < vals.size(); ++i) {
        const auto& w = vals[i];
        const auto k = static_cast<std::int64_t>(i);
        switch (x.dtype()) {
          case DType::i64: CHECK(x.data<std::int64_t>()[k] == w.get<std::int64_t>()); break;
          case DType::i32: CHECK(x.data<std::int32_t>()[k] == w.get<std::int32_t>()); break;
          case DType::u32: CHECK(x.data<std::uint32_t>()[k] == w.get<std::uint32_t>()); break;
          case DType::u8: CHECK(x.data<std::uint8_t>()[k] == w.get<std::uint8_t>()); break;
          default: {
            double got = x.item(k);
            if (w.is_string()) {
              std::string s = w.get<std::string>();
              if (s == "nan") CHECK(std::isnan(got));
              else CHECK(got == (s == "inf" ? INFINITY : -INFINITY));
            } else {
              double e = w.get<double>();
              CHECK(got == e);
              CHECK(std::signbit(got) == std::signbit(e));
            }
          }
        }
      }
    }
  }
  MESSAGE(all.size() << " fixture files, " << tensors << " tensors (" << valued << " compared by value, all by bytes), "
                     << dtypes_seen.size() << " dtypes");
  CHECK(dtypes_seen.size() == 22);
}

// Writes the files tests/oracle/check_safetensors_readback.py reads back with Python's safetensors
// and MLX: into $NN_IO_READBACK_DIR, or <temp>/nn_io_readback. CI has no Python; the check is run
// in development and its result is recorded in tests/fixtures/io/README.md.
TEST_CASE("files for the Python / MLX read-back check") {
  const char* env = std::getenv("NN_IO_READBACK_DIR");
  const fs::path out = env ? fs::path(env) : fs::temp_directory_path() / "nn_io_readback";
  fs::create_directories(out);
  // What the readers must find, from what was given to the writer (not from reading it back).
  struct Want {
    std::string name, dtype;
    std::vector<std::int64_t> shape;
    std::string hex;
  };
  auto write_expected = [](const fs::path& p, const SafetensorsMetadata& meta, const std::vector<Want>& ws) {
    nlohmann::ordered_json j, ts = nlohmann::ordered_json::object();
    j["metadata"] = meta;
    std::vector<std::string> order;
    for (const auto& w : ws) {
      order.push_back(w.name);
      ts[w.name] = {{"dtype", w.dtype}, {"shape", w.shape}, {"hex", w.hex}};
    }
    j["header_order"] = order;
    j["tensors"] = ts;
    std::ofstream(p) << j.dump(1) << "\n";
  };
  auto wants = [](const NamedTensors& ts) {
    std::vector<Want> ws;
    for (const auto& [n, t] : ts) ws.push_back({n, safetensors_dtype_name(safetensors_dtype_of(t.dtype())), t.shape().vec(), hex(t)});
    return ws;
  };
  // 1. nn tensors of every nn dtype, with special values, through save_safetensors.
  Tensor f32 = Tensor::from<float>({2, 4}, {1.0f, -2.5f, INFINITY, -INFINITY, NAN, -0.0f, 1e-45f, 0.1f});
  NamedTensors in = {
      {"model.layers.0.self_attn.q_proj.weight", test::random_tensor({4, 3}, DType::f32, 11)},
      {"f32", f32},
      {"f64", Tensor::from<double>({3}, {std::numbers::pi, -1e300, 5e-324})},
      {"bf16", f32.to(DType::bf16)},
      {"f16", f32.to(DType::f16)},
      {"i32", Tensor::from<std::int32_t>({2, 2}, {INT32_MIN, -1, 0, INT32_MAX})},
      {"i64", Tensor::from<std::int64_t>({3}, {INT64_MIN, (std::int64_t{1} << 53) + 1, INT64_MAX})},
      {"u32", Tensor::from<std::uint32_t>({2}, {0u, 4294967295u})},
      {"u8", Tensor::from<std::uint8_t>({3}, {0, 1, 255})},
      {"scalar", Tensor::scalar(-3.5)},
      {"empty", Tensor::zeros({0, 4}, DType::bf16)},
      {"ünï.名", Tensor::from<float>({1}, {42})},
  };
  const SafetensorsMetadata meta = {{"format", "mlx"}, {"writer", "nn " NN_VERSION_STRING}};
  save_safetensors(out / "nn_written.safetensors", in, meta);
  write_expected(out / "nn_written.expected.json", meta, wants(in));
  // 2. MLX's safetensors reader has no F64: the same tensors less that one, for mx.load.
  NamedTensors no_f64;
  for (const auto& nt : in)
    if (nt.second.dtype() != DType::f64) no_f64.push_back(nt);
  save_safetensors(out / "nn_mlx.safetensors", no_f64, {{"format", "mlx"}});
  write_expected(out / "nn_mlx.expected.json", {{"format", "mlx"}}, wants(no_f64));
  // 3. Every one of the 22 dtypes, passed through from the fixtures as views.
  std::vector<SafetensorsView> views;
  std::vector<Want> ws;
  for (const char* file : {"python_numpy.safetensors", "python_raw.safetensors", "handmade_f6.safetensors"}) {
    SafetensorsFile f(fs::path(NN_FIXTURES_DIR) / "io" / file);
    for (const auto& v : f.views()) {
      views.push_back(v);
      ws.push_back({v.name(), safetensors_dtype_name(v.dtype()), v.shape(), hex(v.bytes())});
    }
  }
  const SafetensorsMetadata pmeta = {{"writer", "nn " NN_VERSION_STRING}};
  const fs::path b = out / "nn_passthrough.safetensors";
  save_safetensors(b, views, pmeta);
  write_expected(out / "nn_passthrough.expected.json", pmeta, ws);
  SafetensorsFile back(b);
  REQUIRE(back.size() == views.size());
  for (const auto& w : ws) CHECK(hex(back.view(w.name).bytes()) == w.hex);
  MESSAGE("read-back files written to " << out.string()
                                        << " (python3 tests/oracle/check_safetensors_readback.py " << out.string() << ")");
}

}  // namespace io_safetensors
