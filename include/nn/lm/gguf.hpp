// SPDX-License-Identifier: MIT OR Apache-2.0
// GGUF: a validating, memory-mapped reader of llama.cpp's model files (versions 2 and 3), with
// dequantisation of F32, F16, BF16, F64, Q8_0, Q4_0 and Q4_1 tensors to float32 / float64.
//
// Layout (ggml docs/gguf.md; gguf-py gguf_reader.py), all little-endian:
//   "GGUF" · u32 version · u64 tensor_count · u64 kv_count
//   kv_count × { string key · u32 value_type · value }
//   tensor_count × { string name · u32 n_dims · u64 ne[n_dims] · u32 ggml_type · u64 offset }
//   padding to `general.alignment` (default 32) · the data section (offsets are relative to it)
// A string is u64 length + bytes (no terminator); an array is u32 element type + u64 count +
// elements. ne[0] is the fastest-varying dimension, so a row-major shape is ne reversed: a
// Linear weight (out, in) is stored with ne = [in, out], and quantisation blocks run along in.
//
// Everything is checked before a value is handed out: the magic and version, every length and
// count against the bytes that remain (so an absurd count fails at once instead of allocating),
// value and tensor types, duplicate keys and names, the alignment (a power of two), each
// tensor's byte size, its offset's alignment, that it lies inside the file, and that no two
// tensors overlap. A bad file raises nn::Error "[gguf] <file>: <what> (at byte N)".
//
// Block layouts (ggml-common.h; gguf-py quants.py), 32 weights per block:
//   Q8_0: f16 d · 32 × int8 q                 w = q · d
//   Q4_0: f16 d · 16 bytes                    w = (q − 8) · d
//   Q4_1: f16 d · f16 m · 16 bytes            w = q · d + m
// In the 16 bytes, byte j holds element j in its low nibble and element j + 16 in its high one.
// Each product is exact in float32 (an 11-bit mantissa times at most 8 bits), so float32 and
// float64 dequantisation give the same values as gguf-py's dequantize.
#pragma once

#include <algorithm>
#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

#include "../config.hpp"
#include "../quant.hpp"
#include "../tensor.hpp"

#if defined(_WIN32)
#include <fstream>
#else
#include <cerrno>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace nn::lm {

/// GGUF metadata value types, numbered as in the file.
enum class GgufType : std::uint32_t {
  u8 = 0, i8 = 1, u16 = 2, i16 = 3, u32 = 4, i32 = 5, f32 = 6, boolean = 7,
  string = 8, array = 9, u64 = 10, i64 = 11, f64 = 12
};

inline const char* gguf_type_name(GgufType t) {
  switch (t) {
    case GgufType::u8: return "uint8";
    case GgufType::i8: return "int8";
    case GgufType::u16: return "uint16";
    case GgufType::i16: return "int16";
    case GgufType::u32: return "uint32";
    case GgufType::i32: return "int32";
    case GgufType::f32: return "float32";
    case GgufType::boolean: return "bool";
    case GgufType::string: return "string";
    case GgufType::array: return "array";
    case GgufType::u64: return "uint64";
    case GgufType::i64: return "int64";
    case GgufType::f64: return "float64";
  }
  return "?";
}

/// ggml tensor types (ggml.h's ggml_type), the ones a reader must at least size.
enum class GgmlType : std::uint32_t {
  F32 = 0, F16 = 1, Q4_0 = 2, Q4_1 = 3, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q8_1 = 9, Q2_K = 10, Q3_K = 11,
  Q4_K = 12, Q5_K = 13, Q6_K = 14, Q8_K = 15, IQ2_XXS = 16, IQ2_XS = 17, IQ3_XXS = 18, IQ1_S = 19,
  IQ4_NL = 20, IQ3_S = 21, IQ2_S = 22, IQ4_XS = 23, I8 = 24, I16 = 25, I32 = 26, I64 = 27, F64 = 28,
  IQ1_M = 29, BF16 = 30, TQ1_0 = 34, TQ2_0 = 35, MXFP4 = 39
};

/// A type's name, its block (elements per block) and the bytes of one block (gguf-py's
/// GGML_QUANT_SIZES); null for a number ggml does not define.
struct GgmlTypeInfo {
  const char* name;
  std::uint32_t block;
  std::uint32_t bytes;
  bool dequantises;  // this reader turns it into floats
};

inline const GgmlTypeInfo* ggml_type_info(std::uint32_t t) {
  static constexpr std::uint32_t K = 256;
  switch (t) {
    case 0: { static constexpr GgmlTypeInfo i{"F32", 1, 4, true}; return &i; }
    case 1: { static constexpr GgmlTypeInfo i{"F16", 1, 2, true}; return &i; }
    case 2: { static constexpr GgmlTypeInfo i{"Q4_0", 32, 2 + 16, true}; return &i; }
    case 3: { static constexpr GgmlTypeInfo i{"Q4_1", 32, 2 + 2 + 16, true}; return &i; }
    case 6: { static constexpr GgmlTypeInfo i{"Q5_0", 32, 2 + 4 + 16, true}; return &i; }
    case 7: { static constexpr GgmlTypeInfo i{"Q5_1", 32, 2 + 2 + 4 + 16, true}; return &i; }
    case 8: { static constexpr GgmlTypeInfo i{"Q8_0", 32, 2 + 32, true}; return &i; }
    case 9: { static constexpr GgmlTypeInfo i{"Q8_1", 32, 4 + 4 + 32, false}; return &i; }
    case 10: { static constexpr GgmlTypeInfo i{"Q2_K", K, 2 + 2 + K / 16 + K / 4, true}; return &i; }
    case 11: { static constexpr GgmlTypeInfo i{"Q3_K", K, 2 + K / 4 + K / 8 + 12, true}; return &i; }
    case 12: { static constexpr GgmlTypeInfo i{"Q4_K", K, 2 + 2 + K / 2 + 12, true}; return &i; }
    case 13: { static constexpr GgmlTypeInfo i{"Q5_K", K, 2 + 2 + K / 2 + K / 8 + 12, true}; return &i; }
    case 14: { static constexpr GgmlTypeInfo i{"Q6_K", K, 2 + K / 2 + K / 4 + K / 16, true}; return &i; }
    case 15: { static constexpr GgmlTypeInfo i{"Q8_K", K, 4 + K + K / 8, false}; return &i; }
    case 16: { static constexpr GgmlTypeInfo i{"IQ2_XXS", K, 2 + K / 4, false}; return &i; }
    case 17: { static constexpr GgmlTypeInfo i{"IQ2_XS", K, 2 + K / 4 + K / 32, false}; return &i; }
    case 18: { static constexpr GgmlTypeInfo i{"IQ3_XXS", K, 2 + K / 4 + K / 8, false}; return &i; }
    case 19: { static constexpr GgmlTypeInfo i{"IQ1_S", K, 2 + K / 8 + K / 16, false}; return &i; }
    case 20: { static constexpr GgmlTypeInfo i{"IQ4_NL", 32, 2 + 16, false}; return &i; }
    case 21: { static constexpr GgmlTypeInfo i{"IQ3_S", K, 2 + K / 4 + K / 8 + K / 32 + 4, false}; return &i; }
    case 22: { static constexpr GgmlTypeInfo i{"IQ2_S", K, 2 + K / 4 + K / 16, false}; return &i; }
    case 23: { static constexpr GgmlTypeInfo i{"IQ4_XS", K, 2 + 2 + K / 2 + K / 64, false}; return &i; }
    case 24: { static constexpr GgmlTypeInfo i{"I8", 1, 1, false}; return &i; }
    case 25: { static constexpr GgmlTypeInfo i{"I16", 1, 2, false}; return &i; }
    case 26: { static constexpr GgmlTypeInfo i{"I32", 1, 4, false}; return &i; }
    case 27: { static constexpr GgmlTypeInfo i{"I64", 1, 8, false}; return &i; }
    case 28: { static constexpr GgmlTypeInfo i{"F64", 1, 8, true}; return &i; }
    case 29: { static constexpr GgmlTypeInfo i{"IQ1_M", K, K / 8 + K / 16 + K / 32, false}; return &i; }
    case 30: { static constexpr GgmlTypeInfo i{"BF16", 1, 2, true}; return &i; }
    case 34: { static constexpr GgmlTypeInfo i{"TQ1_0", K, 2 + 4 * 13, false}; return &i; }
    case 35: { static constexpr GgmlTypeInfo i{"TQ2_0", K, 2 + 64, false}; return &i; }
    case 39: { static constexpr GgmlTypeInfo i{"MXFP4", 32, 1 + 16, false}; return &i; }
    default: return nullptr;
  }
}

class GgufFile;
namespace detail {
class GgufParser;
}

/// One metadata value: a scalar, a string, or an array (of scalars, strings or arrays). Typed
/// reads raise naming the key and the type held.
class GgufValue {
 public:
  GgufType type() const { return type_; }
  /// The element type of an array.
  GgufType array_type() const { return elem_; }
  bool is_array() const { return type_ == GgufType::array; }
  bool is_string() const { return type_ == GgufType::string; }
  bool is_integer() const { return is_int_type(type_); }
  bool is_float() const { return type_ == GgufType::f32 || type_ == GgufType::f64; }
  /// The key it was stored under ("key[3]" inside an array).
  const std::string& key() const { return key_; }

  /// Any integer type, as int64 (a uint64 above 2^63 - 1 raises).
  std::int64_t as_int() const {
    if (!is_integer()) wrong("an integer");
    if (type_ == GgufType::u64 && u_ > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
      nn::detail::fail("gguf", "key \"", key_, "\": ", u_, " does not fit int64");
    return type_ == GgufType::u64 ? static_cast<std::int64_t>(u_) : i_;
  }
  /// A non-negative integer of any integer type.
  std::uint64_t as_uint() const {
    if (!is_integer()) wrong("an integer");
    if (type_ != GgufType::u64 && i_ < 0) nn::detail::fail("gguf", "key \"", key_, "\": ", i_, " is negative");
    return type_ == GgufType::u64 ? u_ : static_cast<std::uint64_t>(i_);
  }
  /// float32 / float64 (and integers, converted).
  double as_float() const {
    if (is_float()) return f_;
    if (is_integer()) return type_ == GgufType::u64 ? static_cast<double>(u_) : static_cast<double>(i_);
    wrong("a number");
  }
  bool as_bool() const {
    if (type_ != GgufType::boolean) wrong("a bool");
    return i_ != 0;
  }
  const std::string& as_string() const {
    if (type_ != GgufType::string) wrong("a string");
    return s_;
  }

  /// Array length.
  std::size_t size() const {
    if (!is_array()) wrong("an array");
    switch (elem_) {
      case GgufType::string: return strings_.size();
      case GgufType::array: return arrays_.size();
      case GgufType::f32: case GgufType::f64: return floats_.size();
      default: return ints_.size();
    }
  }
  /// An array of any integer type (or bool) as int64 (uint64 elements above 2^63 - 1 raise).
  std::vector<std::int64_t> ints() const {
    if (!is_array() || !(is_int_type(elem_) || elem_ == GgufType::boolean)) wrong("an array of integers");
    if (elem_ == GgufType::u64)
      for (std::int64_t v : ints_)
        if (v < 0) nn::detail::fail("gguf", "key \"", key_, "\": a uint64 element does not fit int64");
    return ints_;
  }
  /// An array of float32 / float64.
  const std::vector<double>& floats() const {
    if (!is_array() || !(elem_ == GgufType::f32 || elem_ == GgufType::f64)) wrong("an array of floats");
    return floats_;
  }
  const std::vector<std::string>& strings() const {
    if (!is_array() || elem_ != GgufType::string) wrong("an array of strings");
    return strings_;
  }
  /// An array of arrays.
  const std::vector<GgufValue>& arrays() const {
    if (!is_array() || elem_ != GgufType::array) wrong("an array of arrays");
    return arrays_;
  }

 private:
  friend class detail::GgufParser;
  static bool is_int_type(GgufType t) {
    return t == GgufType::u8 || t == GgufType::i8 || t == GgufType::u16 || t == GgufType::i16 || t == GgufType::u32 ||
           t == GgufType::i32 || t == GgufType::u64 || t == GgufType::i64;
  }
  [[noreturn]] void wrong(const char* expected) const {
    std::string held = gguf_type_name(type_);
    if (is_array()) held = std::string("an array of ") + gguf_type_name(elem_);
    nn::detail::fail("gguf", "key \"", key_, "\": expected ", expected, ", the file holds ", held);
  }

  std::string key_;
  GgufType type_ = GgufType::u8, elem_ = GgufType::u8;
  std::int64_t i_ = 0;   // signed integers and bool
  std::uint64_t u_ = 0;  // uint64
  double f_ = 0;
  std::string s_;
  std::vector<std::int64_t> ints_;  // integer / bool arrays (uint64 bit-cast)
  std::vector<double> floats_;
  std::vector<std::string> strings_;
  std::vector<GgufValue> arrays_;
};

/// One tensor's header entry.
struct GgufTensorInfo {
  std::string name;
  std::vector<std::int64_t> ne;  // ggml order: ne[0] fastest
  std::uint32_t type = 0;        // a GgmlType number
  std::uint64_t offset = 0;      // relative to the data section
  std::uint64_t nbytes = 0;

  /// The row-major shape (ne reversed): a Linear weight reads (out, in).
  std::vector<std::int64_t> shape() const { return {ne.rbegin(), ne.rend()}; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : ne) n *= d;
    return n;
  }
  const char* type_name() const { return ggml_type_info(type)->name; }
};

/// The tokenizer's raw metadata (llama.cpp's tokenizer.ggml.* keys), for building a tokenizer
/// without a tokenizer.json. Absent keys stay empty / nullopt.
struct GgufTokenizerMetadata {
  std::string model;                  // tokenizer.ggml.model: "gpt2" (byte-level BPE), "llama" (SentencePiece), ...
  std::string pre;                    // tokenizer.ggml.pre: the pre-tokenizer ("qwen2", "smollm", "llama-bpe", ...)
  std::vector<std::string> tokens;    // tokenizer.ggml.tokens: id -> token text
  std::vector<std::string> merges;    // tokenizer.ggml.merges: "a b", in rank order
  std::vector<std::int32_t> token_types;  // tokenizer.ggml.token_type: 1 normal, 2 unknown, 3 control, 4 user, 5 unused, 6 byte
  std::vector<float> scores;          // tokenizer.ggml.scores (SentencePiece)
  std::optional<std::int64_t> bos_id, eos_id, eot_id, unk_id, pad_id;
  std::optional<bool> add_bos, add_eos;
  std::optional<bool> add_space_prefix;  // tokenizer.ggml.add_space_prefix (SentencePiece; llama.cpp's default: true)
  std::string chat_template;          // tokenizer.chat_template
};

namespace detail {

/// The file's bytes: mapped read-only (POSIX), or owned (from_bytes, and Windows).
struct GgufBytes {
  const std::byte* data = nullptr;
  std::size_t size = 0;
  std::vector<std::byte> owned;
  void* map_base = nullptr;
  std::size_t map_len = 0;
  GgufBytes() = default;
  GgufBytes(const GgufBytes&) = delete;
  GgufBytes& operator=(const GgufBytes&) = delete;
  ~GgufBytes() {
#if !defined(_WIN32)
    if (map_base) ::munmap(map_base, map_len);
#endif
  }
};

inline std::shared_ptr<GgufBytes> gguf_map(const std::filesystem::path& path) {
  auto b = std::make_shared<GgufBytes>();
  const std::string label = path.string();
#if defined(_WIN32)
  std::ifstream in(path, std::ios::binary);
  if (!in) nn::detail::fail("gguf", label, ": cannot open");
  in.seekg(0, std::ios::end);
  b->owned.resize(static_cast<std::size_t>(in.tellg()));
  in.seekg(0);
  in.read(reinterpret_cast<char*>(b->owned.data()), static_cast<std::streamsize>(b->owned.size()));
  b->data = b->owned.data();
  b->size = b->owned.size();
#else
  int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);  // O_NONBLOCK: a FIFO never blocks
  if (fd < 0) nn::detail::fail("gguf", label, ": cannot open: ", std::strerror(errno));
  struct stat sb {};
  if (::fstat(fd, &sb) != 0 || !S_ISREG(sb.st_mode)) {
    ::close(fd);
    nn::detail::fail("gguf", label, ": not a regular file");
  }
  const auto len = static_cast<std::size_t>(sb.st_size);
  if (len > 0) {
    void* base = ::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, fd, 0);
    const int err = errno;
    if (base == MAP_FAILED) {
      ::close(fd);
      nn::detail::fail("gguf", label, ": cannot mmap: ", std::strerror(err));
    }
    b->map_base = base;
    b->map_len = len;
    b->data = static_cast<const std::byte*>(base);
    b->size = len;
  }
  ::close(fd);  // the mapping keeps the file
#endif
  return b;
}

/// Reverses the bytes of an integer (std::byteswap is C++23); only big-endian hosts need it.
template <class T>
T gguf_bswap(T v) {
  unsigned char b[sizeof(T)];
  std::memcpy(b, &v, sizeof(T));
  std::reverse(b, b + sizeof(T));
  std::memcpy(&v, b, sizeof(T));
  return v;
}

/// The parsed file shared by GgufFile copies.
struct GgufState {
  std::string label;
  std::shared_ptr<GgufBytes> bytes;
  std::uint32_t version = 0;
  std::uint64_t alignment = 32;
  std::uint64_t data_offset = 0;
  std::vector<std::pair<std::string, GgufValue>> kv;  // file order
  std::map<std::string, std::size_t, std::less<>> kv_index;
  std::vector<GgufTensorInfo> tensors;  // file order
  std::map<std::string, std::size_t, std::less<>> tensor_index;
};

/// A bounds-checked cursor over the header: every read names what it was reading and where.
class GgufParser {
 public:
  GgufParser(GgufState& st) : st_(st), p_(st.bytes->data), n_(st.bytes->size) {}

  void parse() {
    if (n_ < 4) fail("the file has ", n_, " bytes; a GGUF file starts with the 4-byte magic \"GGUF\"");
    if (std::memcmp(p_, "GGUF", 4) != 0) {
      if (std::memcmp(p_, "FUGG", 4) == 0) fail("this is a big-endian GGUF file; only little-endian files are read");
      fail("bad magic: the file does not start with \"GGUF\" (a GGUF model file)");
    }
    pos_ = 4;
    st_.version = u32("the version");
    if (st_.version == 1) fail("GGUF version 1 (32-bit counts) is not supported; versions 2 and 3 are");
    if (st_.version != 2 && st_.version != 3) {
      // A byte-swapped small number means a big-endian writer.
      if (st_.version == 0x02000000u || st_.version == 0x03000000u)
        fail("GGUF version ", st_.version, " reads as a big-endian file; only little-endian files are read");
      fail("unsupported GGUF version ", st_.version, " (versions 2 and 3 are)");
    }
    const std::uint64_t n_tensors = u64("the tensor count");
    const std::uint64_t n_kv = u64("the metadata count");
    // The smallest key-value is 13 bytes (empty key, type, one byte) and the smallest tensor
    // info 24 (empty name, n_dims, type, offset); larger counts cannot fit in the file.
    if (n_kv > remaining() / 13) fail("absurd metadata count ", n_kv, " for a file of ", n_, " bytes");
    if (n_tensors > remaining() / 24) fail("absurd tensor count ", n_tensors, " for a file of ", n_, " bytes");

    st_.kv.reserve(static_cast<std::size_t>(n_kv));
    for (std::uint64_t i = 0; i < n_kv; ++i) {
      const std::size_t at = pos_;
      std::string key = str("a metadata key");
      if (st_.kv_index.count(key)) fail_at(at, "duplicate metadata key \"", key, "\"");
      const auto t = static_cast<GgufType>(u32("the type of key \"" + key + "\""));
      GgufValue v = value(t, key, 0);
      st_.kv_index.emplace(key, st_.kv.size());
      st_.kv.emplace_back(std::move(key), std::move(v));
    }
    if (auto it = st_.kv_index.find("general.alignment"); it != st_.kv_index.end()) {
      const GgufValue& a = st_.kv[it->second].second;
      if (a.type() != GgufType::u32) fail("general.alignment must be a uint32, the file holds ", gguf_type_name(a.type()));
      const std::uint64_t al = a.as_uint();
      if (al == 0 || (al & (al - 1)) != 0) fail("general.alignment must be a power of two, got ", al);
      st_.alignment = al;
    }

    st_.tensors.reserve(static_cast<std::size_t>(n_tensors));
    for (std::uint64_t i = 0; i < n_tensors; ++i) tensor_info();
    const std::uint64_t end_of_infos = pos_;
    st_.data_offset = (end_of_infos + st_.alignment - 1) / st_.alignment * st_.alignment;
    const std::uint64_t data_bytes = st_.data_offset <= n_ ? n_ - st_.data_offset : 0;

    std::vector<std::size_t> order(st_.tensors.size());
    for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
    for (const GgufTensorInfo& t : st_.tensors) {
      if (t.offset % st_.alignment != 0)
        fail("tensor \"", t.name, "\": offset ", t.offset, " is not a multiple of the alignment ", st_.alignment);
      if (t.offset > data_bytes || t.nbytes > data_bytes - t.offset)
        fail("tensor \"", t.name, "\": bytes [", t.offset, ", ", t.offset + t.nbytes,
             ") of the data section run past the end of the file (the data section holds ", data_bytes,
             " bytes from byte ", st_.data_offset, ")");
    }
    std::sort(order.begin(), order.end(),
              [&](std::size_t a, std::size_t b) { return st_.tensors[a].offset < st_.tensors[b].offset; });
    for (std::size_t i = 1; i < order.size(); ++i) {
      const GgufTensorInfo &a = st_.tensors[order[i - 1]], &b = st_.tensors[order[i]];
      if (a.offset + a.nbytes > b.offset && a.nbytes > 0 && b.nbytes > 0)
        fail("tensors \"", a.name, "\" and \"", b.name, "\" overlap in the data section");
    }
  }

 private:
  template <class... P>
  [[noreturn]] void fail(const P&... parts) const {
    nn::detail::fail("gguf", st_.label, ": ", parts..., " (at byte ", pos_, ")");
  }
  template <class... P>
  [[noreturn]] void fail_at(std::size_t at, const P&... parts) const {
    nn::detail::fail("gguf", st_.label, ": ", parts..., " (at byte ", at, ")");
  }
  std::size_t remaining() const { return n_ - pos_; }
  void need(std::uint64_t k, const std::string& what) const {
    if (k > remaining())
      fail("the file ends while reading ", what, " (", k, " bytes needed, ", remaining(), " left)");
  }
  template <class T>
  T le(const std::string& what) {
    need(sizeof(T), what);
    T v;
    std::memcpy(&v, p_ + pos_, sizeof(T));
    if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) v = gguf_bswap(v);
    pos_ += sizeof(T);
    return v;
  }
  std::uint32_t u32(const std::string& what) { return le<std::uint32_t>(what); }
  std::uint64_t u64(const std::string& what) { return le<std::uint64_t>(what); }
  std::string str(const std::string& what) {
    const std::uint64_t len = u64("the length of " + what);
    need(len, what + " (a string of " + std::to_string(len) + " bytes)");
    std::string s(reinterpret_cast<const char*>(p_ + pos_), static_cast<std::size_t>(len));
    pos_ += static_cast<std::size_t>(len);
    return s;
  }
  static std::size_t scalar_size(GgufType t) {
    switch (t) {
      case GgufType::u8: case GgufType::i8: case GgufType::boolean: return 1;
      case GgufType::u16: case GgufType::i16: return 2;
      case GgufType::u32: case GgufType::i32: case GgufType::f32: return 4;
      case GgufType::u64: case GgufType::i64: case GgufType::f64: return 8;
      default: return 0;
    }
  }
  /// One scalar into v (its type already set).
  void scalar(GgufValue& v, GgufType t, const std::string& what) {
    switch (t) {
      case GgufType::u8: v.i_ = le<std::uint8_t>(what); break;
      case GgufType::i8: v.i_ = le<std::int8_t>(what); break;
      case GgufType::u16: v.i_ = le<std::uint16_t>(what); break;
      case GgufType::i16: v.i_ = le<std::int16_t>(what); break;
      case GgufType::u32: v.i_ = le<std::uint32_t>(what); break;
      case GgufType::i32: v.i_ = le<std::int32_t>(what); break;
      case GgufType::i64: v.i_ = le<std::int64_t>(what); break;
      case GgufType::u64: v.u_ = le<std::uint64_t>(what); break;
      case GgufType::boolean: v.i_ = le<std::uint8_t>(what); break;  // nonzero is true, as ggml reads it
      case GgufType::f32: v.f_ = std::bit_cast<float>(le<std::uint32_t>(what)); break;
      case GgufType::f64: v.f_ = std::bit_cast<double>(le<std::uint64_t>(what)); break;
      default: break;
    }
  }
  GgufValue value(GgufType t, const std::string& key, int depth) {
    GgufValue v;
    v.key_ = key;
    v.type_ = t;
    const std::string what = "the value of \"" + key + "\"";
    if (scalar_size(t) > 0) {
      scalar(v, t, what);
    } else if (t == GgufType::string) {
      v.s_ = str(what);
    } else if (t == GgufType::array) {
      if (depth >= 8) fail("key \"", key, "\": arrays nested deeper than 8 levels");
      const auto et = static_cast<GgufType>(u32("the element type of \"" + key + "\""));
      v.elem_ = et;
      const std::uint64_t count = u64("the length of \"" + key + "\"");
      const std::size_t es = scalar_size(et);
      // The least each element can take: its size, a string's length field, an array's header.
      const std::uint64_t least = es > 0 ? es : et == GgufType::string ? 8 : et == GgufType::array ? 12 : 0;
      if (least == 0) fail("key \"", key, "\": unknown array element type ", static_cast<std::uint32_t>(et));
      if (count > remaining() / least)
        fail("key \"", key, "\": absurd array length ", count, " (", remaining(), " bytes left in the file)");
      const auto n = static_cast<std::size_t>(count);
      if (es > 0) {
        if (et == GgufType::f32 || et == GgufType::f64) {
          v.floats_.resize(n);
          GgufValue tmp;
          for (std::size_t i = 0; i < n; ++i) {
            scalar(tmp, et, what);
            v.floats_[i] = tmp.f_;
          }
        } else {
          v.ints_.resize(n);
          GgufValue tmp;
          for (std::size_t i = 0; i < n; ++i) {
            scalar(tmp, et, what);
            v.ints_[i] = et == GgufType::u64 ? static_cast<std::int64_t>(tmp.u_) : tmp.i_;
          }
        }
      } else if (et == GgufType::string) {
        v.strings_.resize(n);
        for (std::size_t i = 0; i < n; ++i) v.strings_[i] = str(what);
      } else {
        v.arrays_.reserve(n);
        for (std::size_t i = 0; i < n; ++i)
          v.arrays_.push_back(value(GgufType::array, key + "[" + std::to_string(i) + "]", depth + 1));
      }
    } else {
      fail("key \"", key, "\": unknown value type ", static_cast<std::uint32_t>(t));
    }
    return v;
  }
  void tensor_info() {
    const std::size_t at = pos_;
    GgufTensorInfo t;
    t.name = str("a tensor name");
    if (st_.tensor_index.count(t.name)) fail_at(at, "duplicate tensor name \"", t.name, "\"");
    const std::uint32_t nd = u32("the rank of tensor \"" + t.name + "\"");
    if (nd == 0 || nd > 4) fail("tensor \"", t.name, "\": rank ", nd, " (ggml tensors have 1 to 4 dimensions)");
    // The product of the non-zero dimensions must fit in int64 too: an empty tensor's shape is
    // multiplied out in any order (Shape::numel), so [2^40, 0, 2^40] would overflow.
    std::uint64_t numel = 1, nonzero = 1;
    for (std::uint32_t d = 0; d < nd; ++d) {
      const std::uint64_t e = u64("a dimension of tensor \"" + t.name + "\"");
      if (e > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) ||
          (e != 0 && nonzero > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()) / e))
        fail("tensor \"", t.name, "\": dimension ", e, " makes the element count overflow");
      numel *= e;
      if (e != 0) nonzero *= e;
      t.ne.push_back(static_cast<std::int64_t>(e));
    }
    t.type = u32("the type of tensor \"" + t.name + "\"");
    const GgmlTypeInfo* info = ggml_type_info(t.type);
    if (!info) fail("tensor \"", t.name, "\": unknown ggml type ", t.type);
    if (t.ne[0] % info->block != 0)
      fail("tensor \"", t.name, "\": its first dimension ", t.ne[0], " is not a multiple of ", info->name, "'s block of ",
           info->block);
    const std::uint64_t blocks = numel / info->block;
    if (blocks > std::numeric_limits<std::uint64_t>::max() / info->bytes)
      fail("tensor \"", t.name, "\": its byte size overflows");
    t.nbytes = blocks * info->bytes;
    t.offset = u64("the offset of tensor \"" + t.name + "\"");
    st_.tensor_index.emplace(t.name, st_.tensors.size());
    st_.tensors.push_back(std::move(t));
  }

  GgufState& st_;
  const std::byte* p_;
  std::size_t n_;
  std::size_t pos_ = 0;
};

inline std::uint16_t gguf_u16(const std::byte* p) {
  std::uint16_t v;
  std::memcpy(&v, p, 2);
  if constexpr (std::endian::native == std::endian::big) v = gguf_bswap(v);
  return v;
}

/// How a quantized GGUF block type maps onto affine groups (quant.hpp): `bits`-bit codes in groups
/// of `group` elements; `offset` > 0 for the symmetric types (value d * (code - offset), bias
/// -offset * d), 0 where the block stores the bias (m, or -dmin * min).
struct GgufAffine {
  int bits = 0, group = 0, offset = 0;
};
inline GgufAffine gguf_affine(std::uint32_t type) {
  switch (type) {
    case 2: return {4, 32, 8};     // Q4_0
    case 3: return {4, 32, 0};     // Q4_1
    case 6: return {5, 32, 16};    // Q5_0
    case 7: return {5, 32, 0};     // Q5_1
    case 8: return {8, 32, 128};   // Q8_0
    case 10: return {2, 16, 0};    // Q2_K
    case 11: return {3, 16, 4};    // Q3_K
    case 12: return {4, 32, 0};    // Q4_K
    case 13: return {5, 32, 0};    // Q5_K
    case 14: return {6, 16, 32};   // Q6_K
    default: return {};
  }
}

/// One block of a quantized GGUF type (ggml's block_* layouts) as affine groups, losslessly:
/// code[e] for its elements and, per group g, float32 scale[g] and bias[g], value = scale * code
/// + bias. Each scale is a float16 d times a small integer (a K-quant's sub-block scale), which is
/// exact in float32, and so is scale * code (at most 24 significant bits): the one rounding left
/// is the sum's, as in ggml's d * q + m -- the values are ggml's (and gguf-py's), bit for bit.
inline void gguf_decode_block(std::uint32_t type, const std::byte* blk, std::uint8_t* code, float* scale, float* bias) {
  auto u8 = [&](std::size_t i) { return static_cast<unsigned>(blk[i]); };
  auto f16 = [&](std::size_t i) { return half::f16_to_f32(gguf_u16(blk + i)); };
  auto c8 = [](unsigned v) { return static_cast<std::uint8_t>(v); };
  // 32-element blocks keep element j < 16 in the low nibble of qs[j], j >= 16 in the high nibble of qs[j - 16].
  auto nib32 = [&](std::size_t qs, int j) { return j < 16 ? u8(qs + j) & 15u : u8(qs + j - 16) >> 4; };
  // Q4_K / Q5_K: 12 bytes at 4 hold 8 six-bit scales and mins; groups 4..7 split theirs in two.
  auto k_scale_min = [&](int g, unsigned& sc, unsigned& mn) {
    if (g < 4) {
      sc = u8(4 + g) & 63u;
      mn = u8(8 + g) & 63u;
    } else {
      sc = (u8(12 + g - 4) & 15u) | (u8(4 + g - 4) >> 6) << 4;
      mn = (u8(12 + g - 4) >> 4) | (u8(8 + g - 4) >> 6) << 4;
    }
  };
  switch (type) {
    case 2:    // Q4_0: d, qs[16]
    case 3: {  // Q4_1: d, m, qs[16]
      scale[0] = f16(0);
      bias[0] = type == 2 ? -8.0f * scale[0] : f16(2);
      for (int j = 0; j < 32; ++j) code[j] = c8(nib32(type == 2 ? 2 : 4, j));
      return;
    }
    case 6:    // Q5_0: d, qh (u32), qs[16]; bit 4 of element j is bit j of qh
    case 7: {  // Q5_1: d, m, qh, qs[16]
      const std::size_t qh = type == 6 ? 2 : 4;
      scale[0] = f16(0);
      bias[0] = type == 6 ? -16.0f * scale[0] : f16(2);
      const std::uint32_t h = u8(qh) | u8(qh + 1) << 8 | u8(qh + 2) << 16 | u8(qh + 3) << 24;
      for (int j = 0; j < 32; ++j) code[j] = c8(nib32(qh + 4, j) | ((h >> j) & 1u) << 4);
      return;
    }
    case 8: {  // Q8_0: d, int8 qs[32]; code q + 128
      scale[0] = f16(0);
      bias[0] = -128.0f * scale[0];
      for (int j = 0; j < 32; ++j) code[j] = c8(u8(2 + j) ^ 0x80u);
      return;
    }
    case 10: {  // Q2_K: scales[16] (4-bit scale | 4-bit min << 4), qs[64] at 16, d at 80, dmin at 82
      const float d = f16(80), dmin = f16(82);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * static_cast<float>(u8(g) & 15u);
        bias[g] = -(dmin * static_cast<float>(u8(g) >> 4));
      }
      // Element e = 128h + 32k + l: bits 2k of qs[32h + l].
      for (int e = 0; e < 256; ++e) code[e] = c8((u8(16 + (e / 128) * 32 + e % 32) >> (2 * ((e % 128) / 32))) & 3u);
      return;
    }
    case 11: {  // Q3_K: hmask[32], qs[64] at 32, scales[12] at 96 (6-bit, minus 32), d at 108
      const float d = f16(108);
      for (int g = 0; g < 16; ++g) {
        const unsigned lo = g < 8 ? u8(96 + g) & 15u : u8(96 + g - 8) >> 4, hi = (u8(104 + g % 4) >> (2 * (g / 4))) & 3u;
        scale[g] = d * static_cast<float>(static_cast<int>(lo | hi << 4) - 32);
        bias[g] = -4.0f * scale[g];
      }
      // Low two bits as Q2_K's; the third is bit e/32 of hmask[e % 32] (set: no -4 offset).
      for (int e = 0; e < 256; ++e)
        code[e] = c8(((u8(32 + (e / 128) * 32 + e % 32) >> (2 * ((e % 128) / 32))) & 3u) | ((u8(e % 32) >> (e / 32)) & 1u) << 2);
      return;
    }
    case 12:    // Q4_K: d, dmin, scales[12], qs[128] at 16
    case 13: {  // Q5_K: d, dmin, scales[12], qh[32] at 16, qs[128] at 48
      const float d = f16(0), dmin = f16(2);
      for (int g = 0; g < 8; ++g) {
        unsigned sc = 0, mn = 0;
        k_scale_min(g, sc, mn);
        scale[g] = d * static_cast<float>(sc);
        bias[g] = -(dmin * static_cast<float>(mn));
      }
      const std::size_t qs = type == 12 ? 16 : 48;
      for (int e = 0; e < 256; ++e) {  // group g = e / 32 in nibble g % 2 of qs[32 (g / 2) + e % 32]
        const int g = e / 32;
        unsigned c = (u8(qs + static_cast<std::size_t>(g / 2) * 32 + e % 32) >> (4 * (g % 2))) & 15u;
        if (type == 13) c |= ((u8(16 + e % 32) >> g) & 1u) << 4;
        code[e] = c8(c);
      }
      return;
    }
    case 14: {  // Q6_K: ql[128], qh[64] at 128, int8 scales[16] at 192, d at 208; code q + 32
      const float d = f16(208);
      for (int g = 0; g < 16; ++g) {
        scale[g] = d * static_cast<float>(static_cast<std::int8_t>(u8(192 + g)));
        bias[g] = -32.0f * scale[g];
      }
      for (int e = 0; e < 256; ++e) {  // e = 128h + r: nibble r / 64 of ql[64h + r % 64], bits 2 (r / 32) of qh[32h + r % 32]
        const int h = e / 128, r = e % 128;
        code[e] = c8(((u8(static_cast<std::size_t>(h) * 64 + r % 64) >> (4 * (r / 64))) & 15u) |
                     ((u8(128 + static_cast<std::size_t>(h) * 32 + r % 32) >> (2 * (r / 32))) & 3u) << 4);
      }
      return;
    }
    default: nn::detail::fail("gguf", "block type ", type, " has no affine decoding");
  }
}

/// Dequantises n elements of type `type` from `src` into out[0..n), as T (float or double).
template <class T>
void gguf_dequantize_into(const std::byte* src, std::uint32_t type, std::int64_t n, T* out) {
  const auto N = static_cast<std::size_t>(n);
  switch (type) {
    case 0:  // F32
      for (std::size_t i = 0; i < N; ++i) {
        std::uint32_t u;
        std::memcpy(&u, src + 4 * i, 4);
        if constexpr (std::endian::native == std::endian::big) u = gguf_bswap(u);
        out[i] = static_cast<T>(std::bit_cast<float>(u));
      }
      break;
    case 28:  // F64
      for (std::size_t i = 0; i < N; ++i) {
        std::uint64_t u;
        std::memcpy(&u, src + 8 * i, 8);
        if constexpr (std::endian::native == std::endian::big) u = gguf_bswap(u);
        out[i] = static_cast<T>(std::bit_cast<double>(u));
      }
      break;
    case 1:  // F16
      for (std::size_t i = 0; i < N; ++i) out[i] = static_cast<T>(half::f16_to_f32(gguf_u16(src + 2 * i)));
      break;
    case 30:  // BF16
      for (std::size_t i = 0; i < N; ++i) out[i] = static_cast<T>(half::bf16_to_f32(gguf_u16(src + 2 * i)));
      break;
    default: {  // the quantized block types: one decoder (gguf_decode_block) for these and quantized()
      const GgufAffine a = gguf_affine(type);
      const std::uint32_t block = ggml_type_info(type)->block, bytes = ggml_type_info(type)->bytes;
      std::uint8_t code[256];
      float scale[16], bias[16];
      for (std::size_t b = 0; b < N / block; ++b) {
        gguf_decode_block(type, src + bytes * b, code, scale, bias);
        T* o = out + block * b;
        for (std::uint32_t e = 0; e < block; ++e) {
          const std::uint32_t g = e / static_cast<std::uint32_t>(a.group);
          // The symmetric types as ggml writes them, scale * (code - offset): a zero comes out
          // as d * 0 (-0 for a negative d), as in gguf-py, where scale * code + bias gives +0.
          o[e] = static_cast<T>(a.offset ? scale[g] * static_cast<float>(static_cast<int>(code[e]) - a.offset)
                                         : scale[g] * static_cast<float>(code[e]) + bias[g]);
        }
      }
      break;
    }
  }
}

}  // namespace detail

/// A GGUF file, memory-mapped and validated on open. Cheap to copy (shared).
class GgufFile {
 public:
  explicit GgufFile(const std::filesystem::path& path) {
    auto st = std::make_shared<detail::GgufState>();
    st->label = path.string();
    st->bytes = detail::gguf_map(path);
    detail::GgufParser(*st).parse();
    st_ = std::move(st);
  }
  /// Validates a file image held in memory; `label` leads errors.
  static GgufFile from_bytes(std::vector<std::byte> bytes, std::string label = "<memory>") {
    auto st = std::make_shared<detail::GgufState>();
    st->label = std::move(label);
    st->bytes = std::make_shared<detail::GgufBytes>();
    st->bytes->owned = std::move(bytes);
    st->bytes->data = st->bytes->owned.data();
    st->bytes->size = st->bytes->owned.size();
    detail::GgufParser(*st).parse();
    return GgufFile(std::move(st));
  }

  const std::string& path() const { return st_->label; }
  std::uint32_t version() const { return st_->version; }
  std::uint64_t alignment() const { return st_->alignment; }
  /// Where the data section starts in the file.
  std::uint64_t data_offset() const { return st_->data_offset; }

  /// Every key-value in file order.
  const std::vector<std::pair<std::string, GgufValue>>& metadata() const { return st_->kv; }
  bool contains(std::string_view key) const { return st_->kv_index.find(key) != st_->kv_index.end(); }
  const GgufValue* find(std::string_view key) const {
    auto it = st_->kv_index.find(key);
    return it == st_->kv_index.end() ? nullptr : &st_->kv[it->second].second;
  }
  /// The value of `key`; raises naming the file and the key when absent.
  const GgufValue& at(std::string_view key) const {
    const GgufValue* v = find(key);
    if (!v) nn::detail::fail("gguf", path(), ": missing metadata key \"", key, "\"");
    return *v;
  }

  const std::vector<GgufTensorInfo>& tensors() const { return st_->tensors; }
  const GgufTensorInfo* find_tensor(std::string_view name) const {
    auto it = st_->tensor_index.find(name);
    return it == st_->tensor_index.end() ? nullptr : &st_->tensors[it->second];
  }
  const GgufTensorInfo& tensor_info(std::string_view name) const {
    const GgufTensorInfo* t = find_tensor(name);
    if (!t) nn::detail::fail("gguf", path(), ": no tensor named \"", name, "\" (", st_->tensors.size(), " tensors)");
    return *t;
  }
  /// A tensor's raw (possibly quantised) bytes inside the mapping.
  std::span<const std::byte> tensor_bytes(const GgufTensorInfo& t) const {
    if (t.nbytes == 0) return {};  // the data section may be absent (a file without tensor bytes)
    return {st_->bytes->data + st_->data_offset + t.offset, static_cast<std::size_t>(t.nbytes)};
  }

  /// Tensor `name` dequantised to a host tensor of `dtype` (f32 or f64), row-major shape
  /// (ne reversed). F32 F16 BF16 F64 and the block types Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K
  /// Q5_K Q6_K are read (bit for bit gguf-py's values); other types raise naming it.
  Tensor tensor(std::string_view name, DType dtype = DType::f32) const { return tensor(tensor_info(name), dtype); }
  Tensor tensor(const GgufTensorInfo& t, DType dtype = DType::f32) const {
    if (dtype != DType::f32 && dtype != DType::f64)
      nn::detail::fail("gguf", path(), ": tensors dequantise to float32 or float64, not ", dtype_name(dtype));
    const GgmlTypeInfo* info = ggml_type_info(t.type);
    if (!info->dequantises)
      nn::detail::fail("gguf", path(), ": tensor \"", t.name, "\" has type ", info->name,
                       ", which this reader does not dequantise (F32 F16 BF16 F64 Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K are)");
    Tensor out = Tensor::empty(Shape(t.shape()), dtype);
    const std::byte* src = tensor_bytes(t).data();
    if (dtype == DType::f32) detail::gguf_dequantize_into(src, t.type, t.numel(), out.data<float>());
    else detail::gguf_dequantize_into(src, t.type, t.numel(), out.data<double>());
    return out;
  }

  /// Whether tensors of a GGML type load as quantized matrices, no float copy: Q4_0 Q4_1 Q5_0
  /// Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K.
  static bool keeps_quantized(std::uint32_t type) { return detail::gguf_affine(type).bits != 0; }

  /// A quantized matrix's blocks as an affine quantized matrix (quant.hpp), losslessly
  /// (detail::gguf_decode_block): Q4_0/Q4_1 4-bit, Q5_0/Q5_1 5-bit, Q8_0 8-bit codes in groups of
  /// 32 (a block); the K-quants in their sub-blocks: Q2_K 2-bit, Q3_K 3-bit and Q6_K 6-bit in
  /// groups of 16, Q4_K 4-bit and Q5_K 5-bit in groups of 32. Scales and biases float32 (d * sc and
  /// -dmin * m are exact). The codes are repacked into MLX's LSB-first bit stream. Dequantized,
  /// the values equal gguf-py's (a zero of a symmetric type comes out +0 where gguf-py has -0).
  QuantizedMatrix quantized(const GgufTensorInfo& t) const {
    if (!keeps_quantized(t.type) || t.ne.size() != 2)
      nn::detail::fail("gguf", path(), ": tensor \"", t.name, "\" (", t.type_name(), ", ", t.ne.size(),
                       "-D) is not a matrix of a quantized block type (Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K..Q6_K)");
    // An empty matrix's other dimension is bounded by nothing in the file (its byte size is 0):
    // refused, rather than looping over up to 2^63 rows of nothing or overflowing cols * bits.
    if (t.numel() == 0)
      nn::detail::fail("gguf", path(), ": tensor \"", t.name, "\" (", t.type_name(), ", ne ", t.ne[0], " x ", t.ne[1],
                       ") has no elements; an empty quantized matrix is not loaded");
    const detail::GgufAffine a = detail::gguf_affine(t.type);
    const GgmlTypeInfo* info = ggml_type_info(t.type);
    const std::int64_t rows = t.ne[1], cols = t.ne[0], groups = cols / a.group, block = info->block;
    const std::int64_t blocks = cols / block, per_block = block / a.group, row_bytes = cols * a.bits / 8;
    QuantizedMatrix m;
    m.q = Quant::affine(a.group, a.bits);
    m.weight = Tensor::zeros(Shape{rows, cols * a.bits / 32}, DType::u32);  // put_code ORs into zeros
    m.scales = Tensor::empty(Shape{rows, groups}, DType::f32);
    m.biases = Tensor::empty(Shape{rows, groups}, DType::f32);
    const std::byte* src = tensor_bytes(t).data();
    auto* codes = static_cast<std::uint8_t*>(m.weight.raw());
    float* sc = m.scales.data<float>();
    float* bi = m.biases.data<float>();
    std::uint8_t code[256];
    for (std::int64_t r = 0; r < rows; ++r)
      for (std::int64_t b = 0; b < blocks; ++b) {
        const std::int64_t g0 = r * groups + b * per_block;
        detail::gguf_decode_block(t.type, src + info->bytes * static_cast<std::size_t>(r * blocks + b), code, sc + g0, bi + g0);
        for (std::int64_t e = 0; e < block; ++e)
          nn::detail::QuantMath::put_code(codes + r * row_bytes, b * block + e, a.bits, code[e]);
      }
    return m;
  }

  /// tokenizer.ggml.* and tokenizer.chat_template, raw. A key of the wrong type raises naming
  /// the file and the key.
  GgufTokenizerMetadata tokenizer() const {
    try {
      return tokenizer_metadata();
    } catch (const Error& e) {  // GgufValue's errors name the key, not the file
      std::string_view what = e.what();
      if (what.starts_with("[gguf] ")) what.remove_prefix(7);
      nn::detail::fail("gguf", path(), ": ", what);
    }
  }

 private:
  GgufTokenizerMetadata tokenizer_metadata() const {
    GgufTokenizerMetadata m;
    auto str = [&](const char* k, std::string& dst) {
      if (const GgufValue* v = find(k)) dst = v->as_string();
    };
    auto id = [&](const char* k, std::optional<std::int64_t>& dst) {
      if (const GgufValue* v = find(k)) dst = v->as_int();
    };
    auto flag = [&](const char* k, std::optional<bool>& dst) {
      if (const GgufValue* v = find(k)) dst = v->as_bool();
    };
    str("tokenizer.ggml.model", m.model);
    str("tokenizer.ggml.pre", m.pre);
    str("tokenizer.chat_template", m.chat_template);
    if (const GgufValue* v = find("tokenizer.ggml.tokens")) m.tokens = v->strings();
    if (const GgufValue* v = find("tokenizer.ggml.merges")) m.merges = v->strings();
    if (const GgufValue* v = find("tokenizer.ggml.token_type")) {
      const std::vector<std::int64_t> types = v->ints();
      for (std::size_t i = 0; i < types.size(); ++i) {  // read at the file's width: no wrap to a valid type
        if (types[i] < INT32_MIN || types[i] > INT32_MAX)
          nn::detail::fail("gguf", "key \"tokenizer.ggml.token_type[", i, "]\": ", types[i], " is not a token type (0..6)");
        m.token_types.push_back(static_cast<std::int32_t>(types[i]));
      }
    }
    if (const GgufValue* v = find("tokenizer.ggml.scores"))
      for (double x : v->floats()) m.scores.push_back(static_cast<float>(x));
    id("tokenizer.ggml.bos_token_id", m.bos_id);
    id("tokenizer.ggml.eos_token_id", m.eos_id);
    id("tokenizer.ggml.eot_token_id", m.eot_id);
    id("tokenizer.ggml.unknown_token_id", m.unk_id);
    id("tokenizer.ggml.padding_token_id", m.pad_id);
    flag("tokenizer.ggml.add_bos_token", m.add_bos);
    flag("tokenizer.ggml.add_eos_token", m.add_eos);
    flag("tokenizer.ggml.add_space_prefix", m.add_space_prefix);
    return m;
  }

  explicit GgufFile(std::shared_ptr<detail::GgufState> st) : st_(std::move(st)) {}
  std::shared_ptr<detail::GgufState> st_;
};

}  // namespace nn::lm
