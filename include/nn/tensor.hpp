// SPDX-License-Identifier: MIT OR Apache-2.0
// Tensor: a shape, a runtime dtype, a device tag and reference-shared, 64-byte-aligned storage.
// No autodiff here; the tape (tape.hpp) builds on it.
#pragma once

#include <algorithm>
#include <array>
#include <bit>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <iomanip>
#include <memory>
#include <ostream>
#include <span>
#include <string>
#include <type_traits>
#include <vector>

#include "config.hpp"

namespace nn {

inline constexpr int kMaxRank = 8;

/// A row-major shape of rank 0..8. Rank 0 is a scalar with one element.
class Shape {
 public:
  Shape() = default;
  Shape(std::initializer_list<std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(std::span<const std::int64_t> dims) { assign(dims.begin(), dims.end()); }
  explicit Shape(const std::vector<std::int64_t>& dims) { assign(dims.begin(), dims.end()); }

  int rank() const { return rank_; }
  std::int64_t operator[](int i) const { return d_[static_cast<std::size_t>(i)]; }
  std::int64_t& operator[](int i) { return d_[static_cast<std::size_t>(i)]; }
  /// Dimension i, counted from the end when negative (Python style).
  std::int64_t dim(int i) const { return d_[static_cast<std::size_t>(axis(i))]; }
  /// Normalises a possibly negative axis; raises when out of range.
  int axis(int i) const {
    int a = i < 0 ? i + rank_ : i;
    if (a < 0 || a >= rank_) detail::fail("shape", "axis ", i, " out of range for shape ", str());
    return a;
  }
  std::int64_t numel() const {
    std::int64_t n = 1;
    for (int i = 0; i < rank_; ++i) n *= d_[static_cast<std::size_t>(i)];
    return n;
  }
  const std::int64_t* begin() const { return d_.data(); }
  const std::int64_t* end() const { return d_.data() + rank_; }
  std::vector<std::int64_t> vec() const { return {begin(), end()}; }

  void push_back(std::int64_t v) {
    if (rank_ == kMaxRank) detail::fail("shape", "rank above ", kMaxRank, " is not supported");
    if (v < 0) detail::fail("shape", "negative dimension ", v);
    d_[static_cast<std::size_t>(rank_++)] = v;
  }
  /// The product of dims [from, to).
  std::int64_t prod(int from, int to) const {
    std::int64_t n = 1;
    for (int i = from; i < to; ++i) n *= d_[static_cast<std::size_t>(i)];
    return n;
  }

  friend bool operator==(const Shape& a, const Shape& b) {
    if (a.rank_ != b.rank_) return false;
    for (int i = 0; i < a.rank_; ++i)
      if (a[i] != b[i]) return false;
    return true;
  }

  /// "(2, 3)", or "()" for a scalar, as PyTorch prints sizes.
  std::string str() const {
    std::string s = "(";
    for (int i = 0; i < rank_; ++i) {
      if (i) s += ", ";
      s += std::to_string(d_[static_cast<std::size_t>(i)]);
    }
    return s + ")";
  }

 private:
  template <class It>
  void assign(It b, It e) {
    for (; b != e; ++b) push_back(static_cast<std::int64_t>(*b));
  }
  std::array<std::int64_t, kMaxRank> d_{};
  int rank_ = 0;
};

inline std::ostream& operator<<(std::ostream& os, const Shape& s) { return os << s.str(); }

// ---------------------------------------------------------------------------------------------
// bfloat16 and IEEE half <-> float32, exact to the IEEE rules (round to nearest, ties to even;
// NaN stays NaN, overflow goes to infinity, subnormals are kept).
namespace half {

inline float bf16_to_f32(std::uint16_t h) { return std::bit_cast<float>(std::uint32_t(h) << 16); }

inline std::uint16_t f32_to_bf16(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  if ((u & 0x7fffffffu) > 0x7f800000u) return static_cast<std::uint16_t>((u >> 16) | 0x40u);  // quiet NaN
  std::uint32_t lsb = (u >> 16) & 1u;
  u += 0x7fffu + lsb;  // round to nearest even; overflow carries into the exponent -> inf
  return static_cast<std::uint16_t>(u >> 16);
}

/// x rounded to the nearest bfloat16 value (ties to even), as a float.
inline float bf16_round(float x) { return bf16_to_f32(f32_to_bf16(x)); }

inline float f16_to_f32(std::uint16_t h) {
  std::uint32_t sign = std::uint32_t(h & 0x8000u) << 16;
  std::uint32_t exp = (h >> 10) & 0x1fu;
  std::uint32_t man = h & 0x3ffu;
  std::uint32_t bits;
  if (exp == 0) {
    if (man == 0) {
      bits = sign;
    } else {  // subnormal: value = man * 2^-24, exact in f32
      float v = std::ldexp(static_cast<float>(man), -24);
      bits = sign | std::bit_cast<std::uint32_t>(v);
    }
  } else if (exp == 31) {
    bits = sign | 0x7f800000u | (man << 13);
  } else {
    bits = sign | ((exp + 112u) << 23) | (man << 13);
  }
  return std::bit_cast<float>(bits);
}

inline std::uint16_t f32_to_f16(float f) {
  std::uint32_t u = std::bit_cast<std::uint32_t>(f);
  std::uint16_t sign = static_cast<std::uint16_t>((u >> 16) & 0x8000u);
  std::uint32_t a = u & 0x7fffffffu;
  if (a > 0x7f800000u) return static_cast<std::uint16_t>(sign | 0x7e00u);  // NaN
  if (a >= 0x477ff000u) return static_cast<std::uint16_t>(sign | 0x7c00u);  // rounds to >= 65520: inf
  if (a < 0x38800000u) {  // below the smallest normal half (2^-14): subnormal or zero
    // value * 2^24 rounded to an integer, ties to even, is the subnormal mantissa.
    float v = std::bit_cast<float>(a);
    float scaled = v * 16777216.0f;  // exact: a power-of-two scale
    float r = std::nearbyint(scaled);  // default rounding mode: nearest, ties to even
    return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(r));
  }
  // Normal: rebias the exponent, round the 13 dropped mantissa bits to nearest even.
  std::uint32_t lsb = (a >> 13) & 1u;
  a += 0xfffu + lsb;
  a -= 112u << 23;
  return static_cast<std::uint16_t>(sign | static_cast<std::uint16_t>(a >> 13));
}

}  // namespace half

// ---------------------------------------------------------------------------------------------
namespace detail {

/// One block of memory, host or device. The device backend that made it supplies the deleter.
struct Storage {
  void* data = nullptr;
  std::size_t bytes = 0;
  Device device = Device::cpu;
  void (*release)(void*, std::size_t) = nullptr;
  Storage() = default;
  Storage(const Storage&) = delete;
  Storage& operator=(const Storage&) = delete;
  ~Storage() {
    if (data && release) release(data, bytes);
  }
};

inline void host_release(void* p, std::size_t) { std::free(p); }

inline std::shared_ptr<Storage> host_storage(std::size_t bytes) {
  auto s = std::make_shared<Storage>();
  std::size_t padded = (std::max<std::size_t>(bytes, 1) + 63) / 64 * 64;  // aligned_alloc wants a multiple
  s->data = std::aligned_alloc(64, padded);
  if (!s->data) detail::fail("tensor", "out of host memory allocating ", bytes, " bytes");
  s->bytes = bytes;
  s->device = Device::cpu;
  s->release = &host_release;
  return s;
}

/// A non-host device's allocator and its copy to and from the host, installed by that device's
/// backend header when a program includes it (so a CPU-only program links no device runtime).
/// One slot per Device; the tensor layer itself knows no device but the host.
using DeviceAllocFn = std::shared_ptr<Storage> (*)(std::size_t bytes);
using DeviceCopyFn = void (*)(void* dst, Device dst_dev, const void* src, Device src_dev, std::size_t bytes);
inline constexpr std::size_t kDeviceSlots = 8;
inline DeviceAllocFn& device_alloc_hook(Device d) {
  static DeviceAllocFn fns[kDeviceSlots] = {};
  return fns[static_cast<std::size_t>(d) % kDeviceSlots];
}
inline DeviceCopyFn& device_copy_hook(Device d) {
  static DeviceCopyFn fns[kDeviceSlots] = {};
  return fns[static_cast<std::size_t>(d) % kDeviceSlots];
}
/// The error for a device whose backend is not in this program.
[[noreturn]] inline void no_device_backend(const char* op, Device d) {
  fail(op, "a tensor on device '", d, "' needs that device's backend: include its header (<nn/", d,
       ".hpp>) in a build for it");
}

template <class T>
constexpr DType dtype_of() {
  if constexpr (std::is_same_v<T, float>) return DType::f32;
  else if constexpr (std::is_same_v<T, double>) return DType::f64;
  else if constexpr (std::is_same_v<T, std::int32_t>) return DType::i32;
  else if constexpr (std::is_same_v<T, std::int64_t>) return DType::i64;
  else if constexpr (std::is_same_v<T, std::uint32_t>) return DType::u32;
  else if constexpr (std::is_same_v<T, std::uint8_t>) return DType::u8;
  else static_assert(sizeof(T) == 0, "no nn::DType for this C++ type (bf16/f16 are read as std::uint16_t via raw())");
}

/// Reads element i of a host buffer of dtype t as a double (exact for every dtype but i64/u32
/// beyond 2^53, which token ids and packed words never reach through this path).
inline double load_as_double(const void* p, DType t, std::int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<const float*>(p)[i];
    case DType::f64: return static_cast<const double*>(p)[i];
    case DType::bf16: return half::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::f16: return half::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
    case DType::i32: return static_cast<const std::int32_t*>(p)[i];
    case DType::i64: return static_cast<double>(static_cast<const std::int64_t*>(p)[i]);
    case DType::u32: return static_cast<const std::uint32_t*>(p)[i];
    case DType::u8: return static_cast<const std::uint8_t*>(p)[i];
  }
  return 0;
}

/// Writes a double into element i of a host buffer of dtype t, rounding as the IEEE conversion
/// (f64 -> f32 -> bf16/f16 would double-round, so halfs go through f32 only from f32 sources;
/// see convert()).
inline void store_from_double(void* p, DType t, std::int64_t i, double v) {
  switch (t) {
    case DType::f32: static_cast<float*>(p)[i] = static_cast<float>(v); break;
    case DType::f64: static_cast<double*>(p)[i] = v; break;
    case DType::bf16: static_cast<std::uint16_t*>(p)[i] = half::f32_to_bf16(static_cast<float>(v)); break;
    case DType::f16: static_cast<std::uint16_t*>(p)[i] = half::f32_to_f16(static_cast<float>(v)); break;
    case DType::i32: static_cast<std::int32_t*>(p)[i] = static_cast<std::int32_t>(v); break;
    case DType::i64: static_cast<std::int64_t*>(p)[i] = static_cast<std::int64_t>(v); break;
    case DType::u32: static_cast<std::uint32_t*>(p)[i] = static_cast<std::uint32_t>(v); break;
    case DType::u8: static_cast<std::uint8_t*>(p)[i] = static_cast<std::uint8_t>(v); break;
  }
}

}  // namespace detail

/// A row-major, contiguous array. Copying a Tensor shares its storage (cheap); clone() copies
/// the data. Element access from C++ is through data<T>() on host tensors.
class Tensor {
 public:
  Tensor() = default;

  /// Uninitialised storage of the given shape and dtype.
  static Tensor empty(const Shape& shape, DType dtype, Device dev = Device::cpu) {
    Tensor t;
    t.shape_ = shape;
    t.dtype_ = dtype;
    std::size_t bytes = static_cast<std::size_t>(shape.numel()) * dtype_size(dtype);
    if (dev == Device::cpu) {
      t.st_ = detail::host_storage(bytes);
    } else {
      auto fn = detail::device_alloc_hook(dev);
      if (!fn) detail::no_device_backend("tensor", dev);
      t.st_ = fn(bytes);
    }
    return t;
  }
  static Tensor zeros(const Shape& shape, DType dtype = DType::f32) {
    Tensor t = empty(shape, dtype);
    std::memset(t.raw(), 0, t.nbytes());
    return t;
  }
  static Tensor full(const Shape& shape, double value, DType dtype = DType::f32) {
    Tensor t = empty(shape, dtype);
    for (std::int64_t i = 0; i < t.numel(); ++i) detail::store_from_double(t.raw(), dtype, i, value);
    return t;
  }
  static Tensor ones(const Shape& shape, DType dtype = DType::f32) { return full(shape, 1.0, dtype); }
  static Tensor scalar(double value, DType dtype = DType::f32) { return full(Shape{}, value, dtype); }

  /// A host tensor holding a copy of `values` (its element count must match the shape).
  template <class T>
  static Tensor from(const Shape& shape, const std::vector<T>& values) {
    if (static_cast<std::int64_t>(values.size()) != shape.numel())
      detail::fail("tensor", "from(): shape ", shape.str(), " has ", shape.numel(), " elements but ",
                   values.size(), " values were given");
    Tensor t = empty(shape, detail::dtype_of<T>());
    if (!values.empty()) std::memcpy(t.raw(), values.data(), values.size() * sizeof(T));
    return t;
  }
  /// A host tensor of dtype `dtype` from doubles (rounded as store_from_double does).
  static Tensor from_doubles(const Shape& shape, const std::vector<double>& values, DType dtype) {
    if (static_cast<std::int64_t>(values.size()) != shape.numel())
      detail::fail("tensor", "from_doubles(): shape ", shape.str(), " has ", shape.numel(),
                   " elements but ", values.size(), " values were given");
    Tensor t = empty(shape, dtype);
    for (std::size_t i = 0; i < values.size(); ++i)
      detail::store_from_double(t.raw(), dtype, static_cast<std::int64_t>(i), values[i]);
    return t;
  }

  bool defined() const { return st_ != nullptr; }
  const Shape& shape() const { return shape_; }
  int rank() const { return shape_.rank(); }
  std::int64_t dim(int i) const { return shape_.dim(i); }
  std::int64_t numel() const { return shape_.numel(); }
  DType dtype() const { return dtype_; }
  Device device() const { return st_ ? st_->device : Device::cpu; }
  std::size_t nbytes() const { return static_cast<std::size_t>(numel()) * dtype_size(dtype_); }

  void* raw() { return st_ ? st_->data : nullptr; }
  const void* raw() const { return st_ ? st_->data : nullptr; }

  /// Typed host access. Raises when T does not match the dtype or the tensor is on a device.
  template <class T>
  T* data() {
    check_access<T>();
    return static_cast<T*>(raw());
  }
  template <class T>
  const T* data() const {
    check_access<T>();
    return static_cast<const T*>(raw());
  }

  /// True when both tensors use the same storage block.
  bool shares_storage(const Tensor& o) const { return st_ && st_ == o.st_; }

  /// The bytes of the storage block this tensor views (at least nbytes()).
  std::size_t storage_bytes() const { return st_ ? st_->bytes : 0; }
  /// The first bytes of this tensor's storage seen as another shape and dtype: how a buffer pool
  /// (the tape's checkpoint segments) lends one block to tensors of different kinds in turn.
  Tensor view_as(const Shape& s, DType t) const {
    require_defined("view_as");
    const std::size_t need = static_cast<std::size_t>(s.numel()) * dtype_size(t);
    if (need > storage_bytes())
      detail::fail("view_as", "cannot view ", storage_bytes(), " bytes of storage as ", s.str(), " ", dtype_name(t),
                   " (", need, " bytes)");
    Tensor v = *this;
    v.shape_ = s;
    v.dtype_ = t;
    return v;
  }

  /// A copy with its own storage.
  Tensor clone() const {
    require_defined("clone");
    Tensor t = empty(shape_, dtype_, device());
    copy_bytes(t, *this);
    return t;
  }

  /// The same storage seen with another shape of equal element count.
  Tensor reshape(const Shape& s) const {
    require_defined("reshape");
    if (s.numel() != numel())
      detail::fail("reshape", "cannot view ", shape_.str(), " (", numel(), " elements) as ", s.str(),
                   " (", s.numel(), " elements)");
    Tensor t = *this;
    t.shape_ = s;
    return t;
  }

  /// A host copy converted to `to`. Float conversions round to nearest even; bf16/f16 from f32
  /// are exact to the IEEE rules; f64 -> bf16/f16 rounds once through f32 (as PyTorch does).
  Tensor to(DType to) const {
    require_defined("to");
    require_host("to");
    if (to == dtype_) return clone();
    Tensor t = empty(shape_, to);
    const std::int64_t n = numel();
    if (dtype_ == DType::f32 && to == DType::bf16) {
      auto* s = data<float>();
      auto* d = static_cast<std::uint16_t*>(t.raw());
      for (std::int64_t i = 0; i < n; ++i) d[i] = half::f32_to_bf16(s[i]);
    } else if (dtype_ == DType::f32 && to == DType::f16) {
      auto* s = data<float>();
      auto* d = static_cast<std::uint16_t*>(t.raw());
      for (std::int64_t i = 0; i < n; ++i) d[i] = half::f32_to_f16(s[i]);
    } else if (dtype_ == DType::i64 && to == DType::i32) {
      auto* s = data<std::int64_t>();
      auto* d = t.data<std::int32_t>();
      for (std::int64_t i = 0; i < n; ++i) d[i] = static_cast<std::int32_t>(s[i]);
    } else {
      for (std::int64_t i = 0; i < n; ++i)
        detail::store_from_double(t.raw(), to, i, detail::load_as_double(raw(), dtype_, i));
    }
    return t;
  }

  /// Copies src's elements into this tensor's storage (same shape and dtype), wherever either
  /// lives: host or device, through the device's copy hook. Views of this storage see the change.
  void copy_from(const Tensor& src) {
    require_defined("copy_from");
    src.require_defined("copy_from");
    if (!(src.shape_ == shape_) || src.dtype_ != dtype_)
      detail::fail("copy_from", "source ", src.shape_.str(), " ", dtype_name(src.dtype_), " does not match ",
                   shape_.str(), " ", dtype_name(dtype_));
    copy_bytes(*this, src);
  }

  /// Host <-> device copy (a no-op copy when already there).
  Tensor to(Device dev) const {
    require_defined("to");
    Tensor t = empty(shape_, dtype_, dev);
    copy_bytes(t, *this);
    return t;
  }

  /// Element i (flat, row-major) as a double; host only.
  double item(std::int64_t i = 0) const {
    require_defined("item");
    require_host("item");
    if (i < 0 || i >= numel()) detail::fail("item", "index ", i, " out of range for shape ", shape_.str());
    return detail::load_as_double(raw(), dtype_, i);
  }
  /// Every element as a double, row-major; host only.
  std::vector<double> to_doubles() const {
    require_defined("to_doubles");
    require_host("to_doubles");
    std::vector<double> v(static_cast<std::size_t>(numel()));
    for (std::int64_t i = 0; i < numel(); ++i) v[static_cast<std::size_t>(i)] = detail::load_as_double(raw(), dtype_, i);
    return v;
  }

 private:
  template <class T>
  void check_access() const {
    require_defined("data");
    require_host("data");
    if (detail::dtype_of<T>() != dtype_)
      detail::fail("data", "tensor of shape ", shape_.str(), " holds ", dtype_name(dtype_), ", not ",
                   dtype_name(detail::dtype_of<T>()));
  }
  void require_defined(const char* op) const {
    if (!st_) detail::fail(op, "the tensor is empty (default-constructed)");
  }
  void require_host(const char* op) const {
    if (device() != Device::cpu)
      detail::fail(op, "tensor of shape ", shape_.str(), " lives on ", device(), "; copy it to the host first");
  }
  static void copy_bytes(Tensor& dst, const Tensor& src) {
    if (src.nbytes() == 0) return;
    if (dst.device() == Device::cpu && src.device() == Device::cpu) {
      std::memcpy(dst.raw(), src.raw(), src.nbytes());
    } else {
      const Device dev = dst.device() != Device::cpu ? dst.device() : src.device();
      auto fn = detail::device_copy_hook(dev);
      if (!fn) detail::no_device_backend("tensor", dev);
      fn(dst.raw(), dst.device(), src.raw(), src.device(), src.nbytes());
    }
  }

  Shape shape_;
  DType dtype_ = DType::f32;
  std::shared_ptr<detail::Storage> st_;
};

/// Prints like PyTorch: values, then shape and dtype; long dimensions are elided with "...".
inline std::ostream& operator<<(std::ostream& os, const Tensor& t) {
  if (!t.defined()) return os << "Tensor(empty)";
  if (t.device() != Device::cpu)
    return os << "Tensor(shape=" << t.shape() << ", dtype=" << t.dtype() << ", device=" << t.device() << ")";
  const Shape& s = t.shape();
  std::ios::fmtflags f = os.flags();
  auto prec = os.precision();
  os << std::setprecision(6);
  auto elem = [&](std::int64_t i) {
    double v = t.item(i);
    if (is_floating(t.dtype())) os << v;
    else os << static_cast<long long>(v);
  };
  // Recursive printer over dims, eliding the middle of any dim longer than 6.
  auto rec = [&](auto&& self, int d, std::int64_t base) -> void {
    if (d == s.rank()) { elem(base); return; }
    std::int64_t n = s[d], stride = s.prod(d + 1, s.rank());
    os << '[';
    for (std::int64_t i = 0; i < n; ++i) {
      if (n > 6 && i == 3) { os << "..., "; i = n - 3; }
      self(self, d + 1, base + i * stride);
      if (i + 1 < n) os << (d + 1 == s.rank() ? ", " : ",\n" + std::string(static_cast<std::size_t>(d + 8), ' '));
    }
    os << ']';
  };
  os << "Tensor(";
  rec(rec, 0, 0);
  os << ", shape=" << s << ", dtype=" << t.dtype() << ')';
  os.flags(f);
  os.precision(prec);
  return os;
}

}  // namespace nn
