// SPDX-License-Identifier: MIT OR Apache-2.0
// GGUF writer: builds a GGUF v3 file (the layout gguf.hpp reads; ggml docs/gguf.md) from metadata
// of every value type (scalars, strings, arrays of them, nested arrays) and tensors already in
// their ggml type's bytes (gguf_quantize.hpp makes them), and writes it atomically
// (io/atomic_file.hpp: a temporary sibling, fsync, rename; nothing is left behind on failure).
//
// Layout written, all little-endian:
//   "GGUF" · u32 3 · u64 tensor_count · u64 kv_count · kvs (insertion order) · tensor infos
//   · zero padding to general.alignment (32 unless set) · each tensor's bytes at its offset, each
//   padded to the alignment (as gguf-py's GGUFWriter pads them).
// Every check (sizes against the type's blocks, names, alignment) runs before a byte is written.
#pragma once

#include <bit>
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <filesystem>
#include <string>
#include <string_view>
#include <type_traits>
#include <utility>
#include <vector>

#include "../io/atomic_file.hpp"
#include "gguf.hpp"

namespace nn::lm {

class GgufWriter {
 public:
  // ---- metadata: set() replaces a key in place, or appends it -------------------------------
  /// A scalar: uint8..int64 map to GGUF's integer types of the same width and sign, float to
  /// float32, double to float64, bool to bool; strings (std::string, string_view, const char*).
  template <class T>
  void set(std::string key, T v) {
    Bytes b;
    if constexpr (std::is_convertible_v<T, std::string_view> && !std::is_same_v<T, bool>) {
      put_str(b, std::string_view(v));
      put_kv(std::move(key), GgufType::string, std::move(b));
    } else {
      put_scalar(b, v);
      put_kv(std::move(key), scalar_type<T>(), std::move(b));
    }
  }
  /// An array of scalars (as set()) or of strings.
  template <class T>
  void set_array(std::string key, const std::vector<T>& v) {
    Bytes b;
    if constexpr (std::is_same_v<T, std::string>) {
      put_le(b, static_cast<std::uint32_t>(GgufType::string));
      put_le(b, static_cast<std::uint64_t>(v.size()));
      for (const std::string& s : v) put_str(b, s);
    } else {
      put_le(b, static_cast<std::uint32_t>(scalar_type<T>()));
      put_le(b, static_cast<std::uint64_t>(v.size()));
      for (const T& x : v) put_scalar(b, x);
    }
    put_kv(std::move(key), GgufType::array, std::move(b));
  }
  /// A value read from another file, type for type (so carried metadata keeps its exact types).
  void copy(std::string key, const GgufValue& v) {
    Bytes b;
    put_value(b, v);
    put_kv(std::move(key), v.type(), std::move(b));
  }
  void remove(std::string_view key) {
    for (std::size_t i = 0; i < kv_.size(); ++i)
      if (kv_[i].key == key) {
        kv_.erase(kv_.begin() + static_cast<std::ptrdiff_t>(i));
        return;
      }
  }
  bool contains(std::string_view key) const {
    for (const Kv& kv : kv_)
      if (kv.key == key) return true;
    return false;
  }
  std::size_t metadata_count() const { return kv_.size(); }

  // ---- tensors --------------------------------------------------------------------------------
  /// A tensor of row-major `shape` (written as ne = shape reversed) whose bytes are already in
  /// ggml type `type`. Raises when the bytes do not match the shape and type, when the rows do not
  /// split into the type's blocks, or when the name repeats or is too long for ggml (63 bytes).
  void add_tensor(std::string name, const std::vector<std::int64_t>& shape, std::uint32_t type,
                  std::vector<std::byte> data) {
    const GgmlTypeInfo* info = ggml_type_info(type);
    if (!info) nn::detail::fail("gguf_write", "tensor \"", name, "\": unknown ggml type ", type);
    if (name.empty() || name.size() >= 64)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": a ggml tensor name has 1 to 63 bytes, this one ", name.size());
    for (const Tensor_& t : tensors_)
      if (t.name == name) nn::detail::fail("gguf_write", "tensor \"", name, "\" is added twice");
    if (shape.empty() || shape.size() > 4)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": ", shape.size(), " dimensions (ggml holds 1 to 4)");
    std::int64_t numel = 1;
    for (std::int64_t d : shape) {
      if (d <= 0) nn::detail::fail("gguf_write", "tensor \"", name, "\": dimension ", d, " is not positive");
      numel *= d;
    }
    const std::int64_t row = shape.back();
    if (row % info->block != 0)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": rows of ", row, " do not split into ", info->name,
                       " blocks of ", info->block);
    const auto nbytes = static_cast<std::uint64_t>(numel / info->block) * info->bytes;
    if (data.size() != nbytes)
      nn::detail::fail("gguf_write", "tensor \"", name, "\": ", data.size(), " bytes given, ", info->name, " ",
                       shape_str(shape), " takes ", nbytes);
    tensors_.push_back({std::move(name), {shape.rbegin(), shape.rend()}, type, std::move(data)});
  }
  std::size_t tensor_count() const { return tensors_.size(); }

  // ---- output ---------------------------------------------------------------------------------
  /// The whole file image.
  std::vector<std::byte> bytes() const {
    std::vector<std::byte> out;
    emit([&](const std::byte* p, std::size_t k) { out.insert(out.end(), p, p + k); });
    return out;
  }
  /// Writes the file atomically; on error nn::Error names the path and the reason, and neither
  /// the target nor a temporary file is left changed.
  void write(const std::filesystem::path& path) const {
    alignment();  // checked before the file is touched
    nn::detail::write_atomically(path, "gguf_write", [&](const nn::detail::ByteSink& sink) { emit(sink); });
  }

 private:
  using Bytes = std::vector<std::byte>;
  struct Kv {
    std::string key;
    GgufType type;
    Bytes value;  // the encoded value after the type field
  };
  struct Tensor_ {
    std::string name;
    std::vector<std::int64_t> ne;
    std::uint32_t type;
    Bytes data;
  };

  static std::string shape_str(const std::vector<std::int64_t>& s) {
    std::string r = "(";
    for (std::size_t i = 0; i < s.size(); ++i) r += (i ? ", " : "") + std::to_string(s[i]);
    return r + ")";
  }
  template <class T>
  static constexpr GgufType scalar_type() {
    if constexpr (std::is_same_v<T, bool>) return GgufType::boolean;
    else if constexpr (std::is_same_v<T, float>) return GgufType::f32;
    else if constexpr (std::is_same_v<T, double>) return GgufType::f64;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 1) return std::is_signed_v<T> ? GgufType::i8 : GgufType::u8;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 2) return std::is_signed_v<T> ? GgufType::i16 : GgufType::u16;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 4) return std::is_signed_v<T> ? GgufType::i32 : GgufType::u32;
    else if constexpr (std::is_integral_v<T> && sizeof(T) == 8) return std::is_signed_v<T> ? GgufType::i64 : GgufType::u64;
    else static_assert(sizeof(T) == 0, "GGUF metadata holds integers, float, double, bool and strings");
  }
  template <class T>
  static void put_le(Bytes& b, T v) {
    static_assert(std::is_trivially_copyable_v<T>);
    if constexpr (std::endian::native == std::endian::big && sizeof(T) > 1) v = detail::gguf_bswap(v);
    const auto* p = reinterpret_cast<const std::byte*>(&v);
    b.insert(b.end(), p, p + sizeof(T));
  }
  template <class T>
  static void put_scalar(Bytes& b, T v) {
    if constexpr (std::is_same_v<T, bool>) put_le(b, static_cast<std::uint8_t>(v ? 1 : 0));
    else if constexpr (std::is_same_v<T, float>) put_le(b, std::bit_cast<std::uint32_t>(v));
    else if constexpr (std::is_same_v<T, double>) put_le(b, std::bit_cast<std::uint64_t>(v));
    else put_le(b, v);
  }
  static void put_str(Bytes& b, std::string_view s) {
    put_le(b, static_cast<std::uint64_t>(s.size()));
    const auto* p = reinterpret_cast<const std::byte*>(s.data());
    b.insert(b.end(), p, p + s.size());
  }
  /// One element of type t from a reader's value (integers through as_int / as_uint by width).
  static void put_typed(Bytes& b, GgufType t, std::int64_t i, double f) {
    switch (t) {
      case GgufType::u8: put_le(b, static_cast<std::uint8_t>(i)); break;
      case GgufType::i8: put_le(b, static_cast<std::int8_t>(i)); break;
      case GgufType::u16: put_le(b, static_cast<std::uint16_t>(i)); break;
      case GgufType::i16: put_le(b, static_cast<std::int16_t>(i)); break;
      case GgufType::u32: put_le(b, static_cast<std::uint32_t>(i)); break;
      case GgufType::i32: put_le(b, static_cast<std::int32_t>(i)); break;
      case GgufType::u64: put_le(b, static_cast<std::uint64_t>(i)); break;  // bit-cast back
      case GgufType::i64: put_le(b, i); break;
      case GgufType::boolean: put_le(b, static_cast<std::uint8_t>(i != 0)); break;
      case GgufType::f32: put_le(b, std::bit_cast<std::uint32_t>(static_cast<float>(f))); break;  // exact: read from f32
      case GgufType::f64: put_le(b, std::bit_cast<std::uint64_t>(f)); break;
      default: nn::detail::fail("gguf_write", "not a scalar type: ", gguf_type_name(t));
    }
  }
  static void put_value(Bytes& b, const GgufValue& v) {
    switch (v.type()) {
      case GgufType::string: put_str(b, v.as_string()); return;
      case GgufType::array: {
        const GgufType et = v.array_type();
        put_le(b, static_cast<std::uint32_t>(et));
        put_le(b, static_cast<std::uint64_t>(v.size()));
        if (et == GgufType::string) {
          for (const std::string& s : v.strings()) put_str(b, s);
        } else if (et == GgufType::array) {
          for (const GgufValue& a : v.arrays()) put_value(b, a);
        } else if (et == GgufType::f32 || et == GgufType::f64) {
          for (double x : v.floats()) put_typed(b, et, 0, x);
        } else {
          // ints() refuses uint64 elements above 2^63 - 1; their bits go through unchanged here.
          const std::vector<std::int64_t> xs = et == GgufType::u64 ? u64_bits(v) : v.ints();
          for (std::int64_t x : xs) put_typed(b, et, x, 0);
        }
        return;
      }
      case GgufType::f32: case GgufType::f64: put_typed(b, v.type(), 0, v.as_float()); return;
      case GgufType::u64: put_le(b, v.as_uint()); return;
      case GgufType::boolean: put_typed(b, v.type(), v.as_bool(), 0); return;
      default: put_typed(b, v.type(), v.as_int(), 0); return;
    }
  }
  static std::vector<std::int64_t> u64_bits(const GgufValue& v) {
    try {
      return v.ints();
    } catch (const nn::Error&) {
      nn::detail::fail("gguf_write", "key \"", v.key(), "\": uint64 array elements above 2^63 - 1 are not carried");
    }
  }
  void put_kv(std::string key, GgufType t, Bytes b) {
    for (Kv& kv : kv_)
      if (kv.key == key) {
        kv.type = t;
        kv.value = std::move(b);
        return;
      }
    kv_.push_back({std::move(key), t, std::move(b)});
  }
  std::uint64_t alignment() const {
    for (const Kv& kv : kv_)
      if (kv.key == "general.alignment") {
        std::uint32_t a = 0;
        if (kv.type != GgufType::u32) nn::detail::fail("gguf_write", "general.alignment must be a uint32");
        std::memcpy(&a, kv.value.data(), 4);
        if (a == 0 || (a & (a - 1)) != 0) nn::detail::fail("gguf_write", "general.alignment ", a, " is not a power of two");
        return a;
      }
    return 32;
  }
  template <class Sink>
  void emit(Sink&& sink) const {
    const std::uint64_t al = alignment();
    auto pad = [&](std::uint64_t n) { return (n + al - 1) / al * al; };
    Bytes h;
    h.insert(h.end(), {std::byte{'G'}, std::byte{'G'}, std::byte{'U'}, std::byte{'F'}});
    put_le(h, std::uint32_t{3});
    put_le(h, static_cast<std::uint64_t>(tensors_.size()));
    put_le(h, static_cast<std::uint64_t>(kv_.size()));
    for (const Kv& kv : kv_) {
      put_str(h, kv.key);
      put_le(h, static_cast<std::uint32_t>(kv.type));
      h.insert(h.end(), kv.value.begin(), kv.value.end());
    }
    std::uint64_t offset = 0;
    for (const Tensor_& t : tensors_) {
      put_str(h, t.name);
      put_le(h, static_cast<std::uint32_t>(t.ne.size()));
      for (std::int64_t d : t.ne) put_le(h, static_cast<std::uint64_t>(d));
      put_le(h, t.type);
      put_le(h, offset);
      offset += pad(t.data.size());
    }
    h.resize(static_cast<std::size_t>(pad(h.size())), std::byte{0});
    sink(h.data(), h.size());
    static const Bytes zeros(4096, std::byte{0});
    for (const Tensor_& t : tensors_) {
      sink(t.data.data(), t.data.size());
      std::size_t fill = static_cast<std::size_t>(pad(t.data.size()) - t.data.size());
      for (; fill > 0;) {
        const std::size_t k = std::min(fill, zeros.size());
        sink(zeros.data(), k);
        fill -= k;
      }
    }
  }

  std::vector<Kv> kv_;
  std::vector<Tensor_> tensors_;
};

}  // namespace nn::lm
