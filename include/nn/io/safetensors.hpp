// SPDX-License-Identifier: MIT OR Apache-2.0
// safetensors: a validating, memory-mapped reader of every dtype the format defines, and an
// atomic (temp file + fsync + rename), MLX-compatible writer.
//
// Format (huggingface/safetensors README, safetensors/src/tensor.rs): an 8-byte little-endian
// u64 N, N bytes of UTF-8 JSON starting with '{' (padded with spaces), then the data buffer.
// Each tensor entry is {"dtype", "shape", "data_offsets": [begin, end)} relative to the buffer;
// the tensors cover the buffer exactly, with no holes and no overlaps. "__metadata__" maps
// strings to strings.
//
// Reading. SafetensorsFile mmaps the file read-only and validates the whole header before any
// tensor is handed out; a bad file raises nn::Error "[safetensors] <file>: tensor "<name>":
// <what> (rule: <rule>)". The rules, by name:
//   file too short · header size limit (N <= 100,000,000) · header length (N inside the file) ·
//   header start ('{' first) · JSON (well-formed UTF-8 JSON, trailing whitespace only) ·
//   header structure (objects where objects belong) · no duplicate names (tensor names,
//   metadata keys and tensor fields; nlohmann's DOM parser would silently keep the last one, so
//   the header is read through a SAX handler) · metadata strings · missing field · known dtype ·
//   shape · data_offsets · byte size (shape x dtype = end - begin, whole bytes, no overflow) ·
//   offsets inside buffer · no overlap · no holes (the buffer is covered exactly).
// Compatibility with the Rust reader: unknown fields inside a tensor entry are skipped and
// "__metadata__": null means no metadata, as there; we are stricter on duplicates and on '{'.
// The mapping is released when the last SafetensorsFile / SafetensorsView that shares it goes.
//
// safetensors dtype -> nn::Tensor (SafetensorsView::to_tensor, always a copy into aligned storage):
//   F64 -> f64   F32 -> f32   F16 -> f16   BF16 -> bf16   (bit-exact; convert with Tensor::to)
//   I64 -> i64   I32 -> i32   I16, I8 -> i32 (sign-extended)   U16 -> i32   U32 -> u32   U8 -> u8
//   BOOL -> u8 (0 or 1; any nonzero byte reads as 1)
//   F4 F6_E2M3 F6_E3M2 F8_* C64 U64: parsed and validated, raw bytes through view().bytes();
//   to_tensor() raises naming the dtype (nn has no such tensor dtype).
//
// Writing. save_safetensors writes the header padded with spaces to a multiple of 8 (as the Rust
// and MLX writers do), "__metadata__" first, then every tensor in the order given, little-endian
// and row-major; to a temporary file in the target's folder, fsync'ed, then renamed over the
// target, so a crash leaves either the old file or the new one, never a truncated one.
// nn::Tensor dtype -> safetensors: f32 F32, f64 F64, bf16 BF16, f16 F16, i32 I32, i64 I64,
// u32 U32, u8 U8.
#pragma once

#include <algorithm>
#include <atomic>
#include <bit>
#include <cerrno>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <limits>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <span>
#include <string>
#include <string_view>
#include <system_error>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "atomic_file.hpp"

#include "../config.hpp"
#include "../tensor.hpp"

#if defined(_WIN32)
#ifndef NOMINMAX
#define NOMINMAX
#endif
#ifndef WIN32_LEAN_AND_MEAN
#define WIN32_LEAN_AND_MEAN
#endif
#include <windows.h>
#else
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace nn {

// ---------------------------------------------------------------------------------------------
// Dtypes of the format

/// Every element type the safetensors format defines, spelled as in the header.
enum class SafetensorsDtype : std::uint8_t {
  BOOL, F4, F6_E2M3, F6_E3M2, U8, I8, F8_E5M2, F8_E4M3, F8_E8M0, F8_E4M3FNUZ, F8_E5M2FNUZ,
  I16, U16, F16, BF16, I32, U32, F32, C64, F64, I64, U64
};
inline constexpr int kSafetensorsDtypeCount = 22;

namespace detail {
struct StDtypeInfo {
  const char* name;
  int bits;  // F4 and F6 pack several elements per byte; a tensor must still fill whole bytes
};
inline constexpr StDtypeInfo kStDtypes[kSafetensorsDtypeCount] = {
    {"BOOL", 8},     {"F4", 4},           {"F6_E2M3", 6},      {"F6_E3M2", 6}, {"U8", 8},
    {"I8", 8},       {"F8_E5M2", 8},      {"F8_E4M3", 8},      {"F8_E8M0", 8}, {"F8_E4M3FNUZ", 8},
    {"F8_E5M2FNUZ", 8}, {"I16", 16},      {"U16", 16},         {"F16", 16},    {"BF16", 16},
    {"I32", 32},     {"U32", 32},         {"F32", 32},         {"C64", 64},    {"F64", 64},
    {"I64", 64},     {"U64", 64}};
}  // namespace detail

/// The header spelling ("BF16", "F8_E4M3", ...).
constexpr const char* safetensors_dtype_name(SafetensorsDtype t) {
  return detail::kStDtypes[static_cast<int>(t)].name;
}
/// Bits per element (4 for F4, 6 for F6_*, 64 for C64).
constexpr int safetensors_dtype_bits(SafetensorsDtype t) { return detail::kStDtypes[static_cast<int>(t)].bits; }

/// The dtype a header spells, or nothing when the name is not one of the 22.
inline std::optional<SafetensorsDtype> parse_safetensors_dtype(std::string_view name) {
  for (int i = 0; i < kSafetensorsDtypeCount; ++i)
    if (name == detail::kStDtypes[i].name) return static_cast<SafetensorsDtype>(i);
  return std::nullopt;
}

/// The nn::Tensor dtype a safetensors dtype loads as (see the table at the top), if any.
constexpr std::optional<DType> safetensors_tensor_dtype(SafetensorsDtype t) {
  switch (t) {
    case SafetensorsDtype::F64: return DType::f64;
    case SafetensorsDtype::F32: return DType::f32;
    case SafetensorsDtype::F16: return DType::f16;
    case SafetensorsDtype::BF16: return DType::bf16;
    case SafetensorsDtype::I64: return DType::i64;
    case SafetensorsDtype::I32:
    case SafetensorsDtype::I16:
    case SafetensorsDtype::U16:
    case SafetensorsDtype::I8: return DType::i32;
    case SafetensorsDtype::U32: return DType::u32;
    case SafetensorsDtype::U8:
    case SafetensorsDtype::BOOL: return DType::u8;
    default: return std::nullopt;
  }
}

/// The safetensors dtype an nn::Tensor of dtype `t` is written as.
constexpr SafetensorsDtype safetensors_dtype_of(DType t) {
  switch (t) {
    case DType::f32: return SafetensorsDtype::F32;
    case DType::f64: return SafetensorsDtype::F64;
    case DType::bf16: return SafetensorsDtype::BF16;
    case DType::f16: return SafetensorsDtype::F16;
    case DType::i32: return SafetensorsDtype::I32;
    case DType::i64: return SafetensorsDtype::I64;
    case DType::u32: return SafetensorsDtype::U32;
    case DType::u8: return SafetensorsDtype::U8;
  }
  return SafetensorsDtype::U8;
}

inline std::ostream& operator<<(std::ostream& os, SafetensorsDtype t) { return os << safetensors_dtype_name(t); }

/// `__metadata__`: free-form string -> string annotations (mlx-lm writes {"format": "mlx"}).
using SafetensorsMetadata = std::map<std::string, std::string>;
/// Tensors in order, by name: what the writer takes and load_safetensors returns.
using NamedTensors = std::vector<std::pair<std::string, Tensor>>;

// ---------------------------------------------------------------------------------------------
// Internals: the bytes of a file, the parsed header, the SAX handler that reads it.
namespace detail {

inline constexpr std::uint64_t kStMaxHeader = 100'000'000;  // the Rust reader's MAX_HEADER_SIZE

/// The whole file's bytes: mapped (the SafetensorsFile constructor) or owned (from_bytes).
struct StBytes {
  const std::byte* data = nullptr;
  std::size_t size = 0;
  StBytes() = default;
  StBytes(const StBytes&) = delete;
  StBytes& operator=(const StBytes&) = delete;
  virtual ~StBytes() = default;
};

struct StOwnedBytes final : StBytes {
  std::vector<std::byte> v;
  explicit StOwnedBytes(std::vector<std::byte> bytes) : v(std::move(bytes)) {
    data = v.data();
    size = v.size();
  }
};

struct StEntry {
  std::string name;
  SafetensorsDtype dtype = SafetensorsDtype::U8;
  std::vector<std::int64_t> shape;
  std::uint64_t begin = 0, end = 0;  // relative to the data buffer
};

/// A validated file: its bytes stay alive (mapped) as long as any view shares this.
struct StFile {
  std::string label;  // the path, or a name for an in-memory buffer; leads every error
  std::shared_ptr<const StBytes> bytes;
  std::size_t data_start = 0;  // 8 + N
  std::vector<StEntry> entries;  // header order
  std::map<std::string, std::size_t, std::less<>> index;
  SafetensorsMetadata metadata;
};

/// At most `max` bytes of a string from the file, for an error message: a hostile header may
/// hold a 100 MB name. Cut at a UTF-8 character boundary.
inline std::string st_clip(std::string_view s, std::size_t max = 200) {
  if (s.size() <= max) return std::string(s);
  while (max > 0 && (static_cast<unsigned char>(s[max]) & 0xC0u) == 0x80u) --max;
  return std::string(s.substr(0, max)) + "...";
}

/// "[safetensors] <label>: tensor "<name>": <what> (rule: <rule>)"; `tensor` may be null.
template <class... Parts>
[[noreturn]] void st_fail(const std::string& label, const std::string* tensor, std::string_view rule,
                          const Parts&... parts) {
  if (tensor)
    fail("safetensors", label, ": tensor \"", st_clip(*tensor), "\": ", parts..., " (rule: ", rule, ")");
  fail("safetensors", label, ": ", parts..., " (rule: ", rule, ")");
}

/// Reads the header JSON as a stream of events, so that duplicates are seen (a DOM keeps only
/// the last of two equal keys), the wrong structure is refused at its first token (no DOM of
/// an arbitrary 100 MB document is ever built), and numbers are checked as they come.
class StHeaderSax {
 public:
  using json = nlohmann::json;
  std::vector<StEntry> entries;
  SafetensorsMetadata metadata;
  // The first rule broken; the parse stops there.
  std::string err_rule, err_what, err_tensor;
  bool err_has_tensor = false;

  bool null() { return scalar(Kind::null, "null"); }
  bool boolean(bool) { return scalar(Kind::other, "a boolean"); }
  bool number_integer(json::number_integer_t v) {
    if (v < 0) return scalar(Kind::negative, "a negative number");
    return integer(static_cast<std::uint64_t>(v));
  }
  bool number_unsigned(json::number_unsigned_t v) { return integer(v); }
  bool number_float(json::number_float_t, const json::string_t&) { return scalar(Kind::other, "a non-integer number"); }
  bool string(json::string_t& s) {
    switch (st_) {
      case St::meta_value:
        metadata.emplace(meta_key_, s);
        st_ = St::meta;
        return true;
      case St::tensor_value:
        if (field_ == Field::dtype) {
          auto d = parse_safetensors_dtype(s);
          if (!d) return bad(&cur_.name, "known dtype", "unknown dtype \"" + st_clip(s, 40) + "\"");
          cur_.dtype = *d;
          st_ = St::tensor;
          return true;
        }
        break;
      default: break;
    }
    return scalar(Kind::other, "a string");
  }
  bool binary(json::binary_t&) { return scalar(Kind::other, "binary data"); }

  bool start_object(std::size_t) {
    switch (st_) {
      case St::start: st_ = St::root; return true;
      case St::root_value:
        if (root_key_ == "__metadata__") {
          st_ = St::meta;
          return true;
        }
        cur_ = StEntry{};
        cur_.name = root_key_;
        seen_ = 0;
        tensor_keys_.clear();
        st_ = St::tensor;
        return true;
      case St::skip: ++skip_depth_; return true;
      case St::tensor_value:
        if (field_ == Field::other) {
          st_ = St::skip;
          skip_depth_ = 1;
          return true;
        }
        break;
      default: break;
    }
    return scalar(Kind::other, "an object");
  }
  bool start_array(std::size_t) {
    switch (st_) {
      case St::skip: ++skip_depth_; return true;
      case St::tensor_value:
        if (field_ == Field::shape) {
          st_ = St::shape;
          return true;
        }
        if (field_ == Field::offsets) {
          st_ = St::offsets;
          noff_ = 0;
          return true;
        }
        if (field_ == Field::other) {
          st_ = St::skip;
          skip_depth_ = 1;
          return true;
        }
        break;
      default: break;
    }
    return scalar(Kind::other, "an array");
  }
  bool key(json::string_t& k) {
    switch (st_) {
      case St::root:
        if (!root_keys_.insert(k).second)
          return k == "__metadata__" ? bad(nullptr, "no duplicate names", "\"__metadata__\" appears twice")
                                     : bad(&k, "no duplicate names", "the name appears twice in the header");
        root_key_ = k;
        st_ = St::root_value;
        return true;
      case St::meta:
        if (metadata.count(k))
          return bad(nullptr, "no duplicate names", "metadata key \"" + st_clip(k) + "\" appears twice");
        meta_key_ = k;
        st_ = St::meta_value;
        return true;
      case St::tensor: {
        if (!tensor_keys_.insert(k).second)
          return bad(&cur_.name, "no duplicate names", "field \"" + st_clip(k) + "\" appears twice");
        if (k == "dtype") field_ = Field::dtype, seen_ |= 1;
        else if (k == "shape") field_ = Field::shape, seen_ |= 2;
        else if (k == "data_offsets") field_ = Field::offsets, seen_ |= 4;
        else field_ = Field::other;  // the Rust reader ignores unknown fields; so do we
        st_ = St::tensor_value;
        return true;
      }
      case St::skip: return true;
      default: return bad(nullptr, "header structure", "unexpected key \"" + st_clip(k) + "\"");
    }
  }
  bool end_object() {
    switch (st_) {
      case St::root: st_ = St::done; return true;
      case St::meta: st_ = St::root; return true;
      case St::tensor:
        if (!(seen_ & 1)) return bad(&cur_.name, "missing field", "the entry has no \"dtype\"");
        if (!(seen_ & 2)) return bad(&cur_.name, "missing field", "the entry has no \"shape\"");
        if (!(seen_ & 4)) return bad(&cur_.name, "missing field", "the entry has no \"data_offsets\"");
        entries.push_back(std::move(cur_));
        st_ = St::root;
        return true;
      case St::skip: return end_skip();
      default: return bad(nullptr, "header structure", "unexpected end of object");
    }
  }
  bool end_array() {
    switch (st_) {
      case St::shape: st_ = St::tensor; return true;
      case St::offsets:
        if (noff_ != 2) return bad(&cur_.name, "data_offsets", "data_offsets must hold exactly two integers [begin, end]");
        st_ = St::tensor;
        return true;
      case St::skip: return end_skip();
      default: return bad(nullptr, "header structure", "unexpected end of array");
    }
  }
  bool parse_error(std::size_t position, const std::string&, const json::exception& ex) {
    if (err_rule.empty())
      bad(nullptr, "JSON", "the header is not well-formed JSON at byte " + std::to_string(position) + ": " +
                               st_clip(ex.what(), 300));
    return false;
  }

 private:
  enum class St { start, root, root_value, meta, meta_value, tensor, tensor_value, shape, offsets, skip, done };
  enum class Field { dtype, shape, offsets, other };
  enum class Kind { null, negative, other };
  St st_ = St::start;
  Field field_ = Field::other;
  StEntry cur_;
  unsigned seen_ = 0;
  int noff_ = 0;
  std::size_t skip_depth_ = 0;
  std::string root_key_, meta_key_;
  std::set<std::string, std::less<>> root_keys_, tensor_keys_;

  bool bad(const std::string* tensor, std::string rule, std::string what) {
    err_rule = std::move(rule);
    err_what = std::move(what);
    err_has_tensor = tensor != nullptr;
    if (tensor) err_tensor = *tensor;
    return false;
  }
  bool end_skip() {
    if (--skip_depth_ == 0) st_ = St::tensor;
    return true;
  }
  bool integer(std::uint64_t v) {
    if (st_ == St::shape) {
      if (v > static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max()))
        return bad(&cur_.name, "shape", "dimension " + std::to_string(v) + " is too large");
      cur_.shape.push_back(static_cast<std::int64_t>(v));
      return true;
    }
    if (st_ == St::offsets) {
      if (noff_ == 2) return bad(&cur_.name, "data_offsets", "data_offsets must hold exactly two integers [begin, end]");
      (noff_++ == 0 ? cur_.begin : cur_.end) = v;
      return true;
    }
    return scalar(Kind::other, "a number");
  }
  // A value arrived where the state allows only some kinds: accept it if it fits, else name the rule.
  bool scalar(Kind kind, const char* what) {
    const std::string w(what);
    switch (st_) {
      case St::skip: return true;
      case St::tensor_value:
        switch (field_) {
          case Field::other: st_ = St::tensor; return true;
          case Field::dtype: return bad(&cur_.name, "known dtype", "dtype is " + w + ", not a dtype name");
          case Field::shape: return bad(&cur_.name, "shape", "shape is " + w + ", not an array of non-negative integers");
          case Field::offsets: return bad(&cur_.name, "data_offsets", "data_offsets is " + w + ", not [begin, end]");
        }
        break;
      case St::shape: return bad(&cur_.name, "shape", "shape holds " + w + "; dimensions are non-negative integers");
      case St::offsets: return bad(&cur_.name, "data_offsets", "data_offsets holds " + w + "; offsets are non-negative integers");
      case St::meta_value:
        return bad(nullptr, "metadata strings", "metadata value for key \"" + st_clip(meta_key_) + "\" is " + w + ", not a string");
      case St::root_value:
        if (root_key_ == "__metadata__") {
          if (kind == Kind::null) {  // as the Rust reader's Option: null is no metadata
            st_ = St::root;
            return true;
          }
          return bad(nullptr, "metadata strings", "\"__metadata__\" is " + w + ", not an object of strings");
        }
        return bad(&root_key_, "header structure", "the entry is " + w + ", not an object");
      case St::start: return bad(nullptr, "header structure", "the header is " + w + ", not an object");
      default: break;
    }
    return bad(nullptr, "header structure", "unexpected " + w);
  }
};

inline std::string st_shape_str(const std::vector<std::int64_t>& shape) {
  std::string s = "(";
  for (std::size_t k = 0; k < shape.size(); ++k) s += (k ? ", " : "") + std::to_string(shape[k]);
  return s + ")";
}

inline std::uint64_t st_load_u64_le(const std::byte* p) {
  std::uint64_t v = 0;
  for (int i = 7; i >= 0; --i) v = (v << 8) | static_cast<std::uint64_t>(p[i]);
  return v;
}

/// Validates a whole file held in `bytes` and indexes it. Never reads outside bytes->size.
inline std::shared_ptr<StFile> st_parse(std::shared_ptr<const StBytes> bytes, std::string label) {
  const std::size_t size = bytes->size;
  const std::byte* p = bytes->data;
  if (size < 8)
    st_fail(label, nullptr, "file too short", "the file has ", size,
            " bytes; a safetensors file starts with an 8-byte header length");
  const std::uint64_t n = st_load_u64_le(p);
  if (n > kStMaxHeader)
    st_fail(label, nullptr, "header size limit", "the header length ", n, " exceeds the limit of ", kStMaxHeader,
            " bytes");
  if (n > size - 8)
    st_fail(label, nullptr, "header length", "the header length ", n, " runs past the end of the file (",
            size, " bytes, so at most ", size - 8, " header bytes)");
  const char* h = reinterpret_cast<const char*>(p + 8);
  if (n == 0 || h[0] != '{')
    st_fail(label, nullptr, "header start", "the header must begin with '{'",
            n == 0 ? " but is empty" : "");

  // nlohmann's lexer takes a NUL byte for the end of input, which would let bytes after it pass
  // unread; JSON allows NUL nowhere unescaped, so any NUL is an error.
  if (const void* z = std::memchr(h, 0, static_cast<std::size_t>(n)))
    st_fail(label, nullptr, "JSON", "the header is not well-formed JSON: a NUL byte at header offset ",
            static_cast<const char*>(z) - h);

  StHeaderSax sax;
  bool ok = false;
  try {
    ok = nlohmann::json::sax_parse(h, h + n, &sax);
  } catch (const nlohmann::json::exception& e) {  // defensive: the SAX path reports via parse_error
    st_fail(label, nullptr, "JSON", "the header is not well-formed JSON: ", e.what());
  }
  if (!ok) {
    if (sax.err_rule.empty()) st_fail(label, nullptr, "JSON", "the header is not well-formed JSON");
    st_fail(label, sax.err_has_tensor ? &sax.err_tensor : nullptr, sax.err_rule, sax.err_what);
  }

  auto f = std::make_shared<StFile>();
  f->label = std::move(label);
  f->data_start = static_cast<std::size_t>(8 + n);
  f->metadata = std::move(sax.metadata);
  f->entries = std::move(sax.entries);
  const std::uint64_t buf = size - f->data_start;
  const std::string& L = f->label;

  for (std::size_t i = 0; i < f->entries.size(); ++i) {
    const StEntry& e = f->entries[i];
    f->index.emplace(e.name, i);
    if (e.end < e.begin)
      st_fail(L, &e.name, "data_offsets", "data_offsets [", e.begin, ", ", e.end, "] end before they begin");
    // Element count and bit count with overflow checks: a hostile shape must not wrap around to
    // a size that happens to match. Every running product must fit an int64 (as Shape::numel
    // computes it, left to right), so [2^32, 2^32, 0] is refused as the Rust reader refuses it;
    // [0, 2^32, 2^32] is zero elements there and here.
    std::uint64_t numel = 1;
    bool overflow = false;
    constexpr auto kMax = static_cast<std::uint64_t>(std::numeric_limits<std::int64_t>::max());
    for (std::int64_t d : e.shape) {
      const auto u = static_cast<std::uint64_t>(d);
      if (u != 0 && numel > kMax / u) overflow = true;
      numel *= u;
    }
    const auto bits = static_cast<std::uint64_t>(safetensors_dtype_bits(e.dtype));
    if (overflow || numel > std::numeric_limits<std::uint64_t>::max() / bits)
      st_fail(L, &e.name, "byte size", "the size of shape ", st_shape_str(e.shape), " of ",
              safetensors_dtype_name(e.dtype), " overflows 64 bits");
    if ((numel * bits) % 8 != 0)
      st_fail(L, &e.name, "byte size", numel, " elements of ", safetensors_dtype_name(e.dtype),
              " do not fill a whole number of bytes");
    const std::uint64_t nbytes = numel * bits / 8;
    if (nbytes != e.end - e.begin)
      st_fail(L, &e.name, "byte size", "shape ", st_shape_str(e.shape), " of ", safetensors_dtype_name(e.dtype),
              " needs ", nbytes, " bytes but data_offsets [", e.begin, ", ", e.end, "] span ", e.end - e.begin);
    if (e.end > buf)
      st_fail(L, &e.name, "offsets inside buffer", "data_offsets [", e.begin, ", ", e.end,
              "] reach past the end of the data buffer (", buf, " bytes)");
  }

  // Coverage: sorted by offsets, each tensor starts where the previous one ended.
  std::vector<std::size_t> order(f->entries.size());
  for (std::size_t i = 0; i < order.size(); ++i) order[i] = i;
  std::sort(order.begin(), order.end(), [&](std::size_t a, std::size_t b) {
    const StEntry &x = f->entries[a], &y = f->entries[b];
    return x.begin != y.begin ? x.begin < y.begin : x.end < y.end;
  });
  std::uint64_t pos = 0;
  const StEntry* prev = nullptr;
  for (std::size_t i : order) {
    const StEntry& e = f->entries[i];
    if (e.begin > pos)
      st_fail(L, &e.name, "no holes", "bytes [", pos, ", ", e.begin,
              ") of the data buffer, before this tensor, belong to no tensor");
    if (e.begin < pos)
      st_fail(L, &e.name, "no overlap", "data_offsets [", e.begin, ", ", e.end, "] overlap tensor \"", st_clip(prev->name),
              "\" [", prev->begin, ", ", prev->end, "]");
    pos = e.end;
    prev = &e;
  }
  if (pos != buf)
    st_fail(L, nullptr, "no holes", "the last ", buf - pos, " bytes of the data buffer (", buf,
            " bytes) belong to no tensor");
  f->bytes = std::move(bytes);
  return f;
}

/// Copies `n` elements of `size` bytes each between little-endian file order and host order.
inline void st_copy_le(void* dst, const std::byte* src, std::size_t n, std::size_t size) {
  if (n == 0) return;
  if constexpr (std::endian::native == std::endian::little) {
    std::memcpy(dst, src, n * size);
  } else {
    auto* d = static_cast<std::byte*>(dst);
    for (std::size_t i = 0; i < n; ++i)
      for (std::size_t b = 0; b < size; ++b) d[i * size + b] = src[i * size + size - 1 - b];
  }
}

template <class T>
T st_load_le(const std::byte* p) {
  T v;
  st_copy_le(&v, p, 1, sizeof(T));
  return v;
}

}  // namespace detail

// ---------------------------------------------------------------------------------------------
// Reader

/// One tensor of an open file: its name, dtype, shape and raw bytes inside the mapping. Holding
/// a view keeps the file mapped.
class SafetensorsView {
 public:
  SafetensorsView() = default;
  const std::string& name() const { return e().name; }
  SafetensorsDtype dtype() const { return e().dtype; }
  const std::vector<std::int64_t>& shape() const { return e().shape; }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (auto d : e().shape) n *= d;
    return n;
  }
  /// [begin, end) relative to the data buffer, as in the header.
  std::pair<std::uint64_t, std::uint64_t> data_offsets() const { return {e().begin, e().end}; }
  /// The raw little-endian, row-major bytes, straight from the mapping (not aligned in general).
  std::span<const std::byte> bytes() const {
    const auto& en = e();
    return {f_->bytes->data + f_->data_start + en.begin, static_cast<std::size_t>(en.end - en.begin)};
  }
  /// The file this view came from (its path, or the label of an in-memory buffer).
  const std::string& file() const { return f_->label; }
  /// The nn dtype to_tensor() produces, if there is one.
  std::optional<DType> tensor_dtype() const { return safetensors_tensor_dtype(dtype()); }

  /// A host tensor holding a copy of the data, converted per the table at the top of this file.
  Tensor to_tensor() const {
    const auto& en = e();
    auto dt = tensor_dtype();
    if (!dt)
      detail::fail("safetensors", file(), ": tensor \"", en.name, "\" has dtype ", safetensors_dtype_name(en.dtype),
                   ", which no nn::Tensor dtype holds (F64 F32 F16 BF16 I64 I32 I16 I8 U16 U32 U8 BOOL load); "
                   "read its raw bytes with SafetensorsView::bytes()");
    if (en.shape.size() > static_cast<std::size_t>(kMaxRank))
      detail::fail("safetensors", file(), ": tensor \"", en.name, "\" has rank ", en.shape.size(),
                   "; nn::Tensor holds at most rank ", kMaxRank);
    Tensor t = Tensor::empty(Shape(en.shape), *dt);
    const std::size_t n = static_cast<std::size_t>(t.numel());
    const std::byte* src = bytes().data();
    switch (en.dtype) {
      case SafetensorsDtype::I16: {
        auto* d = t.data<std::int32_t>();
        for (std::size_t i = 0; i < n; ++i) d[i] = detail::st_load_le<std::int16_t>(src + 2 * i);
        break;
      }
      case SafetensorsDtype::U16: {
        auto* d = t.data<std::int32_t>();
        for (std::size_t i = 0; i < n; ++i) d[i] = detail::st_load_le<std::uint16_t>(src + 2 * i);
        break;
      }
      case SafetensorsDtype::I8: {
        auto* d = t.data<std::int32_t>();
        for (std::size_t i = 0; i < n; ++i) d[i] = static_cast<std::int8_t>(src[i]);
        break;
      }
      case SafetensorsDtype::BOOL: {
        auto* d = t.data<std::uint8_t>();
        for (std::size_t i = 0; i < n; ++i) d[i] = src[i] != std::byte{0} ? 1 : 0;
        break;
      }
      default: detail::st_copy_le(t.raw(), src, n, dtype_size(*dt)); break;
    }
    return t;
  }

 private:
  friend class SafetensorsFile;
  SafetensorsView(std::shared_ptr<const detail::StFile> f, std::size_t i) : f_(std::move(f)), i_(i) {}
  const detail::StEntry& e() const {
    if (!f_) detail::fail("safetensors", "the view is empty (default-constructed)");
    return f_->entries[i_];
  }
  std::shared_ptr<const detail::StFile> f_;
  std::size_t i_ = 0;
};

/// A safetensors file, memory-mapped read-only and validated on open. Cheap to copy (shared).
class SafetensorsFile {
 public:
  /// Maps and validates `path`; raises nn::Error naming the file, the tensor and the rule.
  explicit SafetensorsFile(const std::filesystem::path& path) : f_(detail::st_parse(map(path), path.string())) {}

  /// Validates a file image held in memory (tests, fuzzing, network buffers); `label` leads errors.
  static SafetensorsFile from_bytes(std::vector<std::byte> bytes, std::string label = "<memory>") {
    auto owned = std::make_shared<const detail::StOwnedBytes>(std::move(bytes));
    return SafetensorsFile(detail::st_parse(owned, std::move(label)));
  }

  /// The path it was opened from (or the in-memory label).
  const std::string& path() const { return f_->label; }
  const SafetensorsMetadata& metadata() const { return f_->metadata; }
  /// The number of tensors.
  std::size_t size() const { return f_->entries.size(); }
  /// Tensor names in header order (the writer's order for files written here).
  std::vector<std::string> names() const {
    std::vector<std::string> v;
    v.reserve(size());
    for (const auto& e : f_->entries) v.push_back(e.name);
    return v;
  }
  bool contains(std::string_view name) const { return f_->index.find(name) != f_->index.end(); }
  /// Where the data buffer starts in the file (8 + header length).
  std::size_t data_start() const { return f_->data_start; }

  SafetensorsView view(std::size_t i) const {
    if (i >= size()) detail::fail("safetensors", path(), ": tensor index ", i, " out of range (", size(), " tensors)");
    return SafetensorsView(f_, i);
  }
  /// The tensor called `name`; raises listing what the file holds when there is none.
  SafetensorsView view(std::string_view name) const {
    auto it = f_->index.find(name);
    if (it == f_->index.end()) {
      std::string some;
      for (std::size_t i = 0; i < f_->entries.size() && i < 8; ++i)
        some += (i ? ", \"" : "\"") + f_->entries[i].name + "\"";
      if (f_->entries.size() > 8) some += ", ...";
      detail::fail("safetensors", path(), ": no tensor named \"", name, "\"; the file holds ", size(),
                   " tensors", size() ? ": " : "", some);
    }
    return SafetensorsView(f_, it->second);
  }
  std::vector<SafetensorsView> views() const {
    std::vector<SafetensorsView> v;
    v.reserve(size());
    for (std::size_t i = 0; i < size(); ++i) v.push_back(SafetensorsView(f_, i));
    return v;
  }
  /// A host copy of tensor `name` (see to_tensor()).
  Tensor tensor(std::string_view name) const { return view(name).to_tensor(); }
  /// Every tensor as a host copy, in header order; raises on a dtype nn cannot hold.
  NamedTensors tensors() const {
    NamedTensors out;
    out.reserve(size());
    for (std::size_t i = 0; i < size(); ++i) out.emplace_back(f_->entries[i].name, SafetensorsView(f_, i).to_tensor());
    return out;
  }

 private:
  explicit SafetensorsFile(std::shared_ptr<const detail::StFile> f) : f_(std::move(f)) {}

#if defined(_WIN32)
  struct Mapped final : detail::StBytes {
    const void* view = nullptr;
    ~Mapped() override {
      if (view) UnmapViewOfFile(view);
    }
  };
  static std::shared_ptr<const detail::StBytes> map(const std::filesystem::path& path) {
    const std::string label = path.string();
    HANDLE fh = CreateFileW(path.c_str(), GENERIC_READ, FILE_SHARE_READ | FILE_SHARE_DELETE, nullptr, OPEN_EXISTING,
                            FILE_ATTRIBUTE_NORMAL, nullptr);
    if (fh == INVALID_HANDLE_VALUE)
      detail::fail("safetensors", label, ": cannot open (Windows error ", GetLastError(), ")");
    LARGE_INTEGER sz{};
    if (!GetFileSizeEx(fh, &sz) || GetFileType(fh) != FILE_TYPE_DISK) {
      CloseHandle(fh);
      detail::fail("safetensors", label, ": not a regular file");
    }
    if (static_cast<unsigned long long>(sz.QuadPart) < 8) {
      CloseHandle(fh);
      detail::st_fail(label, nullptr, "file too short", "the file has ", sz.QuadPart,
                      " bytes; a safetensors file starts with an 8-byte header length");
    }
    HANDLE mh = CreateFileMappingW(fh, nullptr, PAGE_READONLY, 0, 0, nullptr);
    CloseHandle(fh);
    if (!mh) detail::fail("safetensors", label, ": cannot map (Windows error ", GetLastError(), ")");
    const void* v = MapViewOfFile(mh, FILE_MAP_READ, 0, 0, 0);
    CloseHandle(mh);  // the view keeps the mapping alive
    if (!v) detail::fail("safetensors", label, ": cannot map (Windows error ", GetLastError(), ")");
    auto m = std::make_shared<Mapped>();
    m->view = v;
    m->data = static_cast<const std::byte*>(v);
    m->size = static_cast<std::size_t>(sz.QuadPart);
    return m;
  }
#else
  struct Mapped final : detail::StBytes {
    void* base = nullptr;
    std::size_t len = 0;
    ~Mapped() override {
      if (base) ::munmap(base, len);
    }
  };
  static std::shared_ptr<const detail::StBytes> map(const std::filesystem::path& path) {
    const std::string label = path.string();
    // O_NONBLOCK: opening a FIFO would otherwise wait for a writer forever.
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0) detail::fail("safetensors", label, ": cannot open: ", std::strerror(errno));
    struct stat sb {};
    if (::fstat(fd, &sb) != 0) {
      int err = errno;
      ::close(fd);
      detail::fail("safetensors", label, ": cannot stat: ", std::strerror(err));
    }
    if (!S_ISREG(sb.st_mode)) {
      ::close(fd);
      detail::fail("safetensors", label, ": not a regular file");
    }
    if (sb.st_size < 8) {  // too short to map usefully (and mmap refuses length 0)
      ::close(fd);
      detail::st_fail(label, nullptr, "file too short", "the file has ", sb.st_size,
                      " bytes; a safetensors file starts with an 8-byte header length");
    }
    if (static_cast<std::uint64_t>(sb.st_size) > std::numeric_limits<std::size_t>::max()) {
      ::close(fd);
      detail::fail("safetensors", label, ": the file is too large to map on this platform");
    }
    const auto len = static_cast<std::size_t>(sb.st_size);
    void* base = ::mmap(nullptr, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int err = errno;
    ::close(fd);  // the mapping keeps the file open
    if (base == MAP_FAILED) detail::fail("safetensors", label, ": cannot mmap: ", std::strerror(err));
    auto m = std::make_shared<Mapped>();
    m->base = base;
    m->len = len;
    m->data = static_cast<const std::byte*>(base);
    m->size = len;
    return m;
  }
#endif

  std::shared_ptr<const detail::StFile> f_;
};

/// Every tensor of `path` as host copies, in header order; the metadata too when asked.
inline NamedTensors load_safetensors(const std::filesystem::path& path, SafetensorsMetadata* metadata = nullptr) {
  SafetensorsFile f(path);
  if (metadata) *metadata = f.metadata();
  return f.tensors();
}

// ---------------------------------------------------------------------------------------------
// Writer
namespace detail {

/// One tensor to write: little-endian bytes when `le` is set, else host-order bytes of
/// elements `elem` bytes wide (swapped on a big-endian host).
struct StOut {
  std::string name;
  SafetensorsDtype dtype;
  std::vector<std::int64_t> shape;
  const std::byte* data = nullptr;
  std::size_t nbytes = 0;
  std::size_t elem = 1;
  bool le = false;
};

/// A JSON string literal; raises naming `what` when the text is not valid UTF-8.
inline std::string st_quote(const std::string& label, const std::string& s, const char* what) {
  try {
    return nlohmann::json(s).dump();
  } catch (const nlohmann::json::exception&) {
    fail("safetensors", label, ": ", what, " is not valid UTF-8");
  }
}

/// The header JSON, padded with spaces to a multiple of 8 so the data buffer starts 8-aligned.
inline std::string st_header(const std::string& label, const std::vector<StOut>& outs, const SafetensorsMetadata& meta) {
  std::string h = "{";
  bool first = true;
  if (!meta.empty()) {
    h += "\"__metadata__\":{";
    bool f2 = true;
    for (const auto& [k, v] : meta) {
      if (!f2) h += ',';
      f2 = false;
      h += st_quote(label, k, ("metadata key \"" + k + "\"").c_str());
      h += ':';
      h += st_quote(label, v, ("the metadata value of \"" + k + "\"").c_str());
    }
    h += '}';
    first = false;
  }
  std::map<std::string_view, int> seen;
  std::uint64_t off = 0;
  for (const auto& o : outs) {
    if (o.name == "__metadata__")
      fail("safetensors", label, ": a tensor cannot be named \"__metadata__\" (the format reserves it)");
    if (!seen.emplace(o.name, 0).second)
      fail("safetensors", label, ": tensor \"", o.name, "\" is given twice (names must be unique)");
    if (!first) h += ',';
    first = false;
    h += st_quote(label, o.name, ("tensor name \"" + o.name + "\"").c_str());
    h += ":{\"dtype\":\"";
    h += safetensors_dtype_name(o.dtype);
    h += "\",\"shape\":[";
    for (std::size_t i = 0; i < o.shape.size(); ++i) {
      if (i) h += ',';
      h += std::to_string(o.shape[i]);
    }
    h += "],\"data_offsets\":[" + std::to_string(off) + "," + std::to_string(off + o.nbytes) + "]}";
    off += o.nbytes;
  }
  h += '}';
  h.append((8 - h.size() % 8) % 8, ' ');
  if (h.size() > kStMaxHeader)
    fail("safetensors", label, ": the header would be ", h.size(), " bytes, above the format's limit of ",
         kStMaxHeader);
  return h;
}

inline std::string st_len_prefix(std::uint64_t n) {
  std::string s(8, '\0');
  for (int i = 0; i < 8; ++i) s[static_cast<std::size_t>(i)] = static_cast<char>((n >> (8 * i)) & 0xffu);
  return s;
}

/// Appends the little-endian bytes of `o` to `sink(const std::byte*, size_t)`, in chunks.
template <class Sink>
void st_emit(const StOut& o, Sink&& sink) {
  if (o.le || o.elem == 1 || std::endian::native == std::endian::little) {
    if (o.nbytes) sink(o.data, o.nbytes);
    return;
  }
  std::vector<std::byte> tmp(std::min<std::size_t>(o.nbytes, 1 << 20));
  for (std::size_t at = 0; at < o.nbytes; at += tmp.size()) {
    const std::size_t k = std::min(tmp.size(), o.nbytes - at);
    st_copy_le(tmp.data(), o.data + at, k / o.elem, o.elem);
    sink(tmp.data(), k);
  }
}

/// Test hook, called after each piece of a file is written (the header, then each tensor) with
/// the bytes written so far; tests make it throw (an I/O error) or _exit (a crash).
inline void (*&st_write_hook())(std::size_t) {
  static void (*hook)(std::size_t) = nullptr;
  return hook;
}

/// Host tensors (copied off a device when needed) as writer entries.
struct StTensorOuts {
  std::vector<Tensor> hold;
  std::vector<StOut> outs;
  StTensorOuts(const std::string& label, const NamedTensors& tensors) {
    hold.reserve(tensors.size());
    for (const auto& [name, t] : tensors) {
      if (!t.defined()) fail("safetensors", label, ": tensor \"", name, "\" is empty (default-constructed)");
      hold.push_back(t.device() == Device::cpu ? t : t.to(Device::cpu));
      const Tensor& h = hold.back();
      outs.push_back(StOut{name, safetensors_dtype_of(h.dtype()), h.shape().vec(),
                           static_cast<const std::byte*>(h.raw()), h.nbytes(), dtype_size(h.dtype()), false});
    }
  }
};

inline std::vector<StOut> st_view_outs(const std::vector<SafetensorsView>& views) {
  std::vector<StOut> outs;
  for (const auto& v : views) {
    auto b = v.bytes();
    outs.push_back(StOut{v.name(), v.dtype(), v.shape(), b.data(), b.size(), 1, true});
  }
  return outs;
}

inline std::vector<std::byte> st_serialize(const std::string& label, const std::vector<StOut>& outs,
                                           const SafetensorsMetadata& meta) {
  const std::string h = st_header(label, outs, meta);
  const std::string n = st_len_prefix(h.size());
  std::vector<std::byte> out;
  std::size_t total = 8 + h.size();
  for (const auto& o : outs) total += o.nbytes;
  out.reserve(total);
  auto sink = [&](const std::byte* p, std::size_t k) { out.insert(out.end(), p, p + k); };
  sink(reinterpret_cast<const std::byte*>(n.data()), n.size());
  sink(reinterpret_cast<const std::byte*>(h.data()), h.size());
  for (const auto& o : outs) st_emit(o, sink);
  return out;
}

inline void st_write_file(const std::filesystem::path& target, const std::vector<StOut>& outs,
                          const SafetensorsMetadata& meta) {
  const std::string label = target.string();
  const std::string h = st_header(label, outs, meta);  // every check before a file is touched
  const std::string n = st_len_prefix(h.size());
  write_atomically(target, "safetensors", [&](const ByteSink& sink) {
    std::size_t written = 0;
    auto counted = [&](const std::byte* p, std::size_t k) {
      sink(p, k);
      written += k;
    };
    auto piece = [&]() {
      if (auto hook = st_write_hook()) hook(written);
    };
    counted(reinterpret_cast<const std::byte*>(n.data()), n.size());
    counted(reinterpret_cast<const std::byte*>(h.data()), h.size());
    piece();
    for (const auto& o : outs) {
      st_emit(o, counted);
      piece();
    }
  });
}

}  // namespace detail

/// Writes `tensors` (in this order) and `metadata` to `path` atomically: a temporary file in the
/// same folder, fsync, rename. On any error the temporary file is removed, the target untouched,
/// and nn::Error names the path. Device tensors are copied to the host first.
inline void save_safetensors(const std::filesystem::path& path, const NamedTensors& tensors,
                             const SafetensorsMetadata& metadata = {}) {
  detail::StTensorOuts t(path.string(), tensors);
  detail::st_write_file(path, t.outs, metadata);
}

/// Writes views of other files byte for byte (any of the 22 dtypes), e.g. to re-save quantized
/// weights nn cannot hold as tensors. Saving over the file a view came from is safe: the view's
/// mapping keeps the old contents.
inline void save_safetensors(const std::filesystem::path& path, const std::vector<SafetensorsView>& views,
                             const SafetensorsMetadata& metadata = {}) {
  detail::st_write_file(path, detail::st_view_outs(views), metadata);
}

/// The bytes save_safetensors would write, in memory.
inline std::vector<std::byte> serialize_safetensors(const NamedTensors& tensors, const SafetensorsMetadata& metadata = {}) {
  detail::StTensorOuts t("<memory>", tensors);
  return detail::st_serialize("<memory>", t.outs, metadata);
}
inline std::vector<std::byte> serialize_safetensors(const std::vector<SafetensorsView>& views,
                                                    const SafetensorsMetadata& metadata = {}) {
  return detail::st_serialize("<memory>", detail::st_view_outs(views), metadata);
}

}  // namespace nn
