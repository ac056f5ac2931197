// SPDX-License-Identifier: MIT OR Apache-2.0
// nn 0.1.0 in one header: every header of include/nn reachable from nn/nn.hpp, inlined once.
//
// GENERATED FILE - DO NOT EDIT. Edit include/nn/ and run tools/amalgamate; the CTest test
// amalgamate_fresh (tools/amalgamate --check) fails while this file is stale.
// Needs Eigen 3.3+ and nlohmann_json 3.2+ on the include path (and cblas.h with -DNN_USE_BLAS).
//
// Inlined, in order: nn/nn.hpp, nn/config.hpp, nn/tensor.hpp, nn/quant.hpp,
// nn/backend/cpu_info.hpp, nn/backend/math.hpp, nn/backend/policy.hpp, nn/random.hpp,
// nn/resources.hpp, nn/backend/cpu.hpp, nn/backend/cpu/common.hpp, nn/backend/simd.hpp,
// nn/backend/threads.hpp, nn/backend/cpu/elementwise.hpp, nn/backend/cpu/reduce.hpp,
// nn/backend/cpu/matmul.hpp, nn/backend/gemm.hpp, nn/backend/gemv.hpp, nn/backend/cpu/shape.hpp,
// nn/backend/cpu/index.hpp, nn/backend/cpu/random.hpp, nn/backend/cpu/softmax.hpp,
// nn/backend/cpu/cross_entropy.hpp, nn/backend/cpu/norm.hpp, nn/backend/cpu/rope.hpp,
// nn/backend/cpu/attention.hpp, nn/backend/cpu/glu.hpp, nn/backend/cpu/fused.hpp,
// nn/backend/cpu/quantized.hpp, nn/backend/cpu/linear_cross_entropy.hpp, nn/backend/cpu/optim.hpp,
// nn/tape.hpp, nn/anomaly.hpp, nn/grad_checkpoint.hpp, nn/ops/common.hpp, nn/ops/elementwise.hpp,
// nn/ops/reduce.hpp, nn/ops/matmul.hpp, nn/ops/shape.hpp, nn/ops/index.hpp, nn/ops/softmax.hpp,
// nn/ops/cross_entropy.hpp, nn/ops/random.hpp, nn/ops/norm.hpp, nn/ops/rope.hpp,
// nn/ops/attention.hpp, nn/ops/glu.hpp, nn/ops/quantized.hpp, nn/ops/linear_cross_entropy.hpp,
// nn/ops/fused.hpp, nn/layers/helpers.hpp, nn/layers/linear.hpp, nn/layers/norm.hpp,
// nn/layers/activations.hpp, nn/layers/rope.hpp, nn/layers/mask.hpp, nn/layers/attention.hpp,
// nn/layers/embedding.hpp, nn/layers/loss.hpp, nn/layers/dropout.hpp, nn/io/safetensors.hpp,
// nn/io/atomic_file.hpp, nn/module.hpp, nn/statics.hpp, nn/tree.hpp, nn/modules.hpp,
// nn/modules/linear.hpp, nn/modules/embedding.hpp, nn/modules/norm.hpp, nn/modules/rope.hpp,
// nn/modules/dropout.hpp, nn/modules/quantized.hpp, nn/modules/dora.hpp, nn/modules/lora.hpp,
// nn/optim.hpp, nn/optim/optimizer.hpp, nn/optim/schedules.hpp, nn/optim/sgd.hpp,
// nn/optim/adam.hpp, nn/optim/lion.hpp, nn/optim/muon.hpp, nn/optim/adafactor.hpp,
// nn/optim/multi.hpp, nn/optim/clip.hpp, nn/compile.hpp, nn/io/weights.hpp, nn/io/checkpoint.hpp,
// nn/precompiled.hpp
#pragma once

// ---- begin nn/nn.hpp ----
// The umbrella header: the core CPU library (tensors, tape, ops, layers, modules, optimizers,
// compiled steps, weights and checkpoints). The LLM kit is <nn/lm.hpp>; nn/cuda.hpp adds the CUDA
// policy.

// ---- begin nn/config.hpp ----
// Version, nn::Error ("[op] message"), and the dtype and device enums every other header uses.

#include <cstddef>
#include <cstdint>
#include <sstream>
#include <stdexcept>
#include <string>
#include <string_view>

#define NN_VERSION_MAJOR 0
#define NN_VERSION_MINOR 1
#define NN_VERSION_PATCH 0
#define NN_VERSION_STRING "0.1.0"

#if defined(_OPENMP)
#define NN_OMP 1
#endif

// Marks functions that both backends run: host code for nn::cpu, device code too under nvcc
// (the elementwise math of backend/math.hpp, the threefry hash of random.hpp).
#if defined(__CUDACC__)
#define NN_HD __host__ __device__
#else
#define NN_HD
#endif
// Put before `template <...> NN_HD`: a generic function both backends call, which the CPU also
// instantiates with Eigen array expressions (host-only types). nvcc then compiles each
// instantiation for the side that calls it instead of warning about host calls from device code.
#if defined(__CUDACC__)
#define NN_HD_GENERIC _Pragma("nv_exec_check_disable")
#else
#define NN_HD_GENERIC
#endif
// Put after the template head of such a function that backend/simd.hpp also calls on its lane
// vectors: always inlined on the host, so it is compiled for the calling kernel's instruction set
// (out of line it would run at the baseline's width, behind a call).
#if defined(__CUDACC__)
#define NN_LANES_INLINE
#else
#define NN_LANES_INLINE [[gnu::always_inline]]
#endif

namespace nn {

/// Every error nn raises. The message starts with "[op_or_file] " and names the shapes, dtypes
/// and paths involved, so a user can act on it without a debugger.
class Error : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

namespace detail {
/// Throws nn::Error("[where] a b c ..."), streaming every part.
template <class... Parts>
[[noreturn]] void fail(std::string_view where, const Parts&... parts) {
  std::ostringstream os;
  os << '[' << where << "] ";
  (os << ... << parts);
  throw Error(os.str());
}
}  // namespace detail

/// Element types a Tensor can hold. Arithmetic runs in f32 and f64; bf16/f16 are storage types
/// (converted exactly to and from f32); integers hold token ids, masks and packed weights.
enum class DType : std::uint8_t { f32, f64, bf16, f16, i32, i64, u32, u8 };

constexpr std::size_t dtype_size(DType t) {
  switch (t) {
    case DType::f32: return 4;
    case DType::f64: return 8;
    case DType::bf16: return 2;
    case DType::f16: return 2;
    case DType::i32: return 4;
    case DType::i64: return 8;
    case DType::u32: return 4;
    case DType::u8: return 1;
  }
  return 0;
}

constexpr const char* dtype_name(DType t) {
  switch (t) {
    case DType::f32: return "float32";
    case DType::f64: return "float64";
    case DType::bf16: return "bfloat16";
    case DType::f16: return "float16";
    case DType::i32: return "int32";
    case DType::i64: return "int64";
    case DType::u32: return "uint32";
    case DType::u8: return "uint8";
  }
  return "?";
}

constexpr bool is_floating(DType t) {
  return t == DType::f32 || t == DType::f64 || t == DType::bf16 || t == DType::f16;
}
constexpr bool is_integer(DType t) { return !is_floating(t); }

inline std::ostream& operator<<(std::ostream& os, DType t) { return os << dtype_name(t); }

/// Where a tensor's storage lives.
enum class Device : std::uint8_t { cpu, cuda };
namespace device {
inline constexpr Device cpu = Device::cpu;
inline constexpr Device cuda = Device::cuda;
}  // namespace device

inline std::ostream& operator<<(std::ostream& os, Device d) {
  return os << (d == Device::cpu ? "cpu" : "cuda");
}

}  // namespace nn
// ---- end nn/config.hpp ----
// ---- begin nn/tensor.hpp ----
// Tensor: a shape, a runtime dtype, a device tag and reference-shared, 64-byte-aligned storage.
// No autodiff here; the tape (tape.hpp) builds on it.

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
// ---- end nn/tensor.hpp ----
// ---- begin nn/quant.hpp ----
// Quantized matrices in MLX's formats, bit for bit: nn::quantize / nn::dequantize, and the code
// reader every quantized kernel (ops/quantized.hpp's CPU and CUDA kernels) decodes with.
//
// A quantized (rows, cols) matrix is three tensors, as mx.quantize returns them and
// mlx.nn.QuantizedLinear stores them:
//   weight (rows, cols * bits / 32) u32  the codes, an LSB-first bit stream per row: code j sits
//                                        at bits [j*bits, (j+1)*bits) of the row's little-endian
//                                        bytes (8 x 4-bit or 4 x 8-bit per word; 3/5/6-bit codes
//                                        straddle bytes, as MLX packs them)
//   scales (rows, cols / group)          the weight's float dtype (affine), or u8: E8M0 (mxfp4,
//                                        mxfp8), E4M3 (nvfp4)
//   biases (rows, cols / group)          affine only
// affine:  w = scale * q + bias,  q in [0, 2^bits - 1]               (groups 32/64/128, bits 2-8)
// mxfp4:   w = 2^(e - 127) * E2M1[q], E2M1 = {0, .5, 1, 1.5, 2, 3, 4, 6} with the sign in bit 3
//                                                                     (group 32, 4 bits)
// mxfp8:   w = 2^(e - 127) * E4M3[q]                                  (group 32, 8 bits)
// nvfp4:   w = E4M3[s] * E2M1[q]                                      (group 16, 4 bits)

#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <vector>
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__CUDACC__)
#include <immintrin.h>
#endif

// ---- begin nn/backend/cpu_info.hpp ----
// nn::cpu_info(): what this x86 CPU can run, read from CPUID feature bits and the OS's XCR0 state
// mask -- never from a table of model names -- and which GEMM kernel nn runs on it.

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define NN_X86_CPUID 1
#endif

namespace nn {

/// The instruction sets nn's own kernels are compiled for, best last. A kernel set runs only
/// where every instruction it uses is both present (CPUID) and enabled by the OS (XCR0).
enum class Isa : std::uint8_t {
  generic,  ///< the compiler's baseline (SSE2 on x86-64): portable vector code, no feature test
  avx2,     ///< AVX2 + FMA3, 16 ymm registers
  avx512,   ///< AVX-512 F/BW/DQ/VL + FMA3, 32 zmm registers
};

constexpr const char* isa_name(Isa i) {
  switch (i) {
    case Isa::generic: return "generic";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

/// Feature bits of the running CPU (all false off x86), plus its vendor and brand strings.
struct CpuFeatures {
  std::string vendor;  ///< "GenuineIntel", "AuthenticAMD", ...
  std::string brand;   ///< the CPUID brand string, e.g. "Intel(R) Xeon(R) Processor"
  int family = 0, model = 0;  ///< display family and model: printed, never used to choose a kernel
  bool sse2 = false, avx = false, fma = false, avx2 = false, f16c = false;
  bool avx512f = false, avx512dq = false, avx512bw = false, avx512vl = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_fp16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;

  /// The best kernel set this CPU (and OS) can run.
  Isa best_isa() const {
    if (avx512f && avx512dq && avx512bw && avx512vl && fma && avx2) return Isa::avx512;
    if (avx2 && fma) return Isa::avx2;
    return Isa::generic;
  }
};

namespace detail {

#if defined(NN_X86_CPUID)
struct CpuidRegs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
inline CpuidRegs cpuid(unsigned leaf, unsigned sub = 0) {
  CpuidRegs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = {};
  return r;
}
/// XCR0: which register states the OS saves on a context switch (AVX needs bits 1-2, AVX-512
/// bits 5-7, AMX bits 17-18). Read with the raw opcode so no -mxsave is needed.
inline std::uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}
#endif

inline CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(NN_X86_CPUID)
  const auto bit = [](unsigned reg, int n) { return ((reg >> n) & 1u) != 0; };
  const CpuidRegs l0 = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &l0.b, 4);
  std::memcpy(vendor + 4, &l0.d, 4);
  std::memcpy(vendor + 8, &l0.c, 4);
  f.vendor = vendor;
  const CpuidRegs l1 = l0.a >= 1 ? cpuid(1) : CpuidRegs{};
  const unsigned base_family = (l1.a >> 8) & 0xf, base_model = (l1.a >> 4) & 0xf;
  f.family = static_cast<int>(base_family == 0xf ? base_family + ((l1.a >> 20) & 0xff) : base_family);
  f.model = static_cast<int>((base_family == 0x6 || base_family == 0xf) ? (((l1.a >> 16) & 0xf) << 4) + base_model
                                                                        : base_model);
  f.sse2 = bit(l1.d, 26);
  const bool osxsave = bit(l1.c, 27);
  const std::uint64_t xcr = osxsave ? xcr0() : 0;
  const bool os_avx = (xcr & 0x6) == 0x6;
  const bool os_avx512 = os_avx && (xcr & 0xe0) == 0xe0;
  const bool os_amx = (xcr & 0x60000) == 0x60000;
  f.avx = os_avx && bit(l1.c, 28);
  f.fma = f.avx && bit(l1.c, 12);
  f.f16c = f.avx && bit(l1.c, 29);
  if (l0.a >= 7) {
    const CpuidRegs l7 = cpuid(7, 0), l71 = cpuid(7, 1);
    f.avx2 = f.avx && bit(l7.b, 5);
    f.avx512f = os_avx512 && bit(l7.b, 16);
    f.avx512dq = f.avx512f && bit(l7.b, 17);
    f.avx512bw = f.avx512f && bit(l7.b, 30);
    f.avx512vl = f.avx512f && bit(l7.b, 31);
    f.avx512_vnni = f.avx512f && bit(l7.c, 11);
    f.avx512_fp16 = f.avx512f && bit(l7.d, 23);
    f.avx512_bf16 = f.avx512f && bit(l71.a, 5);
    f.amx_bf16 = os_amx && bit(l7.d, 22);
    f.amx_tile = os_amx && bit(l7.d, 24);
    f.amx_int8 = os_amx && bit(l7.d, 25);
  }
  if (cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const CpuidRegs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i + 0, &r.a, 4);
      std::memcpy(brand + 16 * i + 4, &r.b, 4);
      std::memcpy(brand + 16 * i + 8, &r.c, 4);
      std::memcpy(brand + 16 * i + 12, &r.d, 4);
    }
    std::string_view s(brand);
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
    f.brand = std::string(s);
  }
#endif
  return f;
}

/// The kernel set nn's GEMM runs: the CPU's best, unless NN_CPU_ISA (generic | avx2 | avx512)
/// asks for a lower one -- a way to run and test every kernel set on one machine. Asking for
/// one the CPU lacks keeps the CPU's best (running it would fault).
inline Isa choose_isa(const CpuFeatures& f) {
  const Isa best = f.best_isa();
  const char* env = std::getenv("NN_CPU_ISA");
  if (!env || !*env) return best;
  const std::string_view want(env);
  Isa asked = best;
  if (want == "generic") asked = Isa::generic;
  else if (want == "avx2") asked = Isa::avx2;
  else if (want == "avx512") asked = Isa::avx512;
  return static_cast<int>(asked) <= static_cast<int>(best) ? asked : best;
}

/// The kernel set in use (the GEMM's and simd.hpp's), chosen once per process.
inline Isa active_isa() {
  static const Isa isa = choose_isa(detect_cpu_features());
  return isa;
}

}  // namespace detail

/// What nn detected and what it runs, read once per process by nn::cpu_info() (defined in
/// backend/cpu.hpp, where the GEMM engine is chosen).
struct CpuInfo {
  CpuFeatures features;
  Isa isa = Isa::generic;  ///< the kernel set nn's GEMM uses (see NN_CPU_ISA)
  std::string gemm;        ///< the GEMM engine and micro-kernels in use, e.g. "nn avx512 12x32 f32 / 12x16 f64 + gemv"
  std::string gemm_id;     ///< the same as one word: "nn-avx512", "nn-avx2", "nn-generic", "cblas" or "eigen"
  std::string note;        ///< why an external BLAS is or is not used (empty when none is linked)
  std::string bf16;        ///< how bf16 products run: "amx tdpbf16ps", "native vdpbf16ps" or "emulated (f32 kernels)"

  /// One line for logs: "cpu: <brand> (<vendor> family F model M) | avx2 fma avx512f ... | gemm: ...".
  std::string line() const {
    const CpuFeatures& f = features;
    std::string s = "cpu: " + (f.brand.empty() ? std::string("unknown CPU") : f.brand);
    if (!f.vendor.empty())
      s += " (" + f.vendor + " family " + std::to_string(f.family) + " model " + std::to_string(f.model) + ")";
    s += " | features:";
    const std::pair<bool, const char*> bits[] = {
        {f.avx2, "avx2"},           {f.fma, "fma"},         {f.avx512f, "avx512f"},         {f.avx512bw, "avx512bw"},
        {f.avx512vl, "avx512vl"},   {f.avx512dq, "avx512dq"}, {f.avx512_vnni, "avx512_vnni"}, {f.avx512_bf16, "avx512_bf16"},
        {f.avx512_fp16, "avx512_fp16"}, {f.amx_tile, "amx_tile"}, {f.amx_bf16, "amx_bf16"},   {f.amx_int8, "amx_int8"}};
    bool any = false;
    for (const auto& [on, name] : bits)
      if (on) {
        s += ' ';
        s += name;
        any = true;
      }
    if (!any) s += " (baseline only)";
    s += " | gemm: " + gemm;
    if (!note.empty()) s += " (" + note + ")";
    if (!bf16.empty()) s += " | bf16: " + bf16;
    return s;
  }
};

}  // namespace nn
// ---- end nn/backend/cpu_info.hpp ----
// ---- begin nn/backend/math.hpp ----
// The math of every elementwise primitive, forward and derivative side by side, and the
// per-element math of the fused primitives and the optimizer updates, compiled for the host and
// (under nvcc) for the device, so nn::cpu and nn::cuda run the same formulas: a kernel in
// backend/cpu/ or backend/cuda/ loops, reduces and dispatches, and takes its arithmetic from here.

#include <cmath>
#include <algorithm>
#include <cstdint>
#include <limits>
#include <numbers>
#include <type_traits>

// ---- begin nn/backend/policy.hpp ----
// The backend policy concept: the kernels a backend (nn::cpu, nn::cuda) must supply so the tape
// and the ops can run on it without ever touching tensor memory themselves.

#include <array>
#include <concepts>


namespace nn {

/// Elementwise one-input kernels. `arg` is the op's scalar (the exponent of pow, unused else).
/// The math of each lives in the backend's unary kernel and its vjp next to it.
enum class Unary : std::uint8_t {
  neg,
  exp,
  log,
  sqrt,
  rsqrt,
  tanh,
  sigmoid,
  relu,
  abs,
  pow,         // x^arg
  silu,        // x * sigmoid(x)
  gelu,        // 0.5 x (1 + erf(x / sqrt 2))                      (PyTorch gelu, MLX nn.gelu)
  gelu_approx, // 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))   (MLX nn.gelu_approx)
  gelu_fast,   // x * sigmoid(1.702 x)                              (MLX nn.gelu_fast_approx)
  scale,       // arg * x
  add_scalar,  // x + arg
};

/// Elementwise two-input kernels with NumPy broadcasting.
enum class Binary : std::uint8_t { add, sub, mul, div, maximum, minimum };

constexpr const char* unary_name(Unary u) {
  switch (u) {
    case Unary::neg: return "neg";
    case Unary::exp: return "exp";
    case Unary::log: return "log";
    case Unary::sqrt: return "sqrt";
    case Unary::rsqrt: return "rsqrt";
    case Unary::tanh: return "tanh";
    case Unary::sigmoid: return "sigmoid";
    case Unary::relu: return "relu";
    case Unary::abs: return "abs";
    case Unary::pow: return "pow";
    case Unary::silu: return "silu";
    case Unary::gelu: return "gelu";
    case Unary::gelu_approx: return "gelu_approx";
    case Unary::gelu_fast: return "gelu_fast_approx";
    case Unary::scale: return "scale";
    case Unary::add_scalar: return "add_scalar";
  }
  return "?";
}
constexpr const char* binary_name(Binary b) {
  switch (b) {
    case Binary::add: return "add";
    case Binary::sub: return "sub";
    case Binary::mul: return "mul";
    case Binary::div: return "div";
    case Binary::maximum: return "maximum";
    case Binary::minimum: return "minimum";
  }
  return "?";
}

/// Every primitive the tape records (ops/), one enumerator each. A new primitive adds itself here
/// (beside its kernels' lines below), and
/// tests/ops/registry.test.cpp fails until the op registry (tests/support/op_registry.hpp) lists
/// it with sample inputs, so no primitive ships without its fixture, finite-difference, replay
/// and CUDA checks.
#define NN_PRIMITIVES(X)                                                                                  \
  X(unary) X(binary) X(where) X(stop_gradient) X(reshape) X(permute) X(slice) X(concat) X(broadcast_to)  \
  X(sum) X(max) X(matmul) X(gather_rows) X(pick) X(softmax) X(cross_entropy) X(bernoulli) X(dropout)     \
  X(rmsnorm) X(rope) X(attention) X(flash_attention) X(swiglu) X(quantized_matmul) X(quantized_gather)  \
  X(fused) X(linear_cross_entropy)

enum class Prim : std::uint8_t {
#define NN_PRIM_ENUMERATOR(p) p,
  NN_PRIMITIVES(NN_PRIM_ENUMERATOR)
#undef NN_PRIM_ENUMERATOR
};
#define NN_PRIM_COUNT(p) +1
inline constexpr std::size_t kPrimCount = 0 NN_PRIMITIVES(NN_PRIM_COUNT);
#undef NN_PRIM_COUNT

/// The primitive's name, as errors and summaries print it.
constexpr const char* prim_name(Prim p) {
  switch (p) {
#define NN_PRIM_NAME(n) \
  case Prim::n:         \
    return #n;
    NN_PRIMITIVES(NN_PRIM_NAME)
#undef NN_PRIM_NAME
  }
  return "?";
}

/// How a loss over rows is reduced (PyTorch's `reduction`).
enum class Reduction : std::uint8_t { none, sum, mean };

constexpr const char* reduction_name(Reduction r) {
  return r == Reduction::none ? "none" : (r == Reduction::sum ? "sum" : "mean");
}

// Attribute structs of the primitives whose kernels need more than a flag or two: the node keeps
// them (ops/), and the kernels take them whole, not as long positional lists.

/// Attention's shape and options: q, out (B, T, H * head_dim), k, v (B, T, KV * head_dim) (or
/// the same with B and T merged); query head h reads kv head h / (H / KV). `scale` multiplies the
/// scores; `causal`: query i sees keys 0..i only.
struct AttentionAttrs {
  std::int64_t B = 0, T = 0, H = 0, KV = 0, head_dim = 0;
  double scale = 1.0;
  bool causal = false;
  // flash attention only (0: off): a causal query i sees keys i - window < j <= i (a sliding
  // window, as transformers' Gemma 2 / Mistral / Phi-3 masks); scores soft-capped to
  // softcap * tanh(s / softcap) before the softmax (Gemma 2's attn_logit_softcapping)
  std::int64_t window = 0;
  double softcap = 0;
};

/// Softmax cross-entropy's options: a target equal to ignore_index counts nothing (loss and
/// gradient 0, left out of the mean).
struct CrossEntropyAttrs {
  std::int64_t ignore_index = -100;
  Reduction reduction = Reduction::mean;
};

/// RoPE's kernel options: traditional (interleaved pairs (2i, 2i + 1)) or NEOX halves; inverse
/// rotates by minus the angle (the vjp).
struct RopeArgs {
  bool traditional = false;
  bool inverse = false;
};

/// A quantized matrix's format (quant.hpp): MLX's affine (w = scale * q + bias per group of
/// `group` values along a row, `bits`-bit codes), or one of its floating-point modes: mxfp4 (E2M1
/// codes, an E8M0 scale per 32), mxfp8 (E4M3 codes, an E8M0 scale per 32), nvfp4 (E2M1 codes, an
/// E4M3 scale per 16).
enum class QuantMode : std::uint8_t { affine, mxfp4, mxfp8, nvfp4 };

constexpr const char* quant_mode_name(QuantMode m) {
  switch (m) {
    case QuantMode::affine: return "affine";
    case QuantMode::mxfp4: return "mxfp4";
    case QuantMode::mxfp8: return "mxfp8";
    case QuantMode::nvfp4: return "nvfp4";
  }
  return "?";
}
/// The floating-point modes: u8 scales, no biases, E2M1 or E4M3 codes.
constexpr bool quant_fp(QuantMode m) { return m != QuantMode::affine; }

struct Quant {
  QuantMode mode = QuantMode::affine;
  int group = 64;
  int bits = 4;
  /// MLX's default: affine, groups of 64, 4 bits.
  static constexpr Quant affine(int group = 64, int bits = 4) { return {QuantMode::affine, group, bits}; }
  static constexpr Quant mxfp4() { return {QuantMode::mxfp4, 32, 4}; }
  static constexpr Quant mxfp8() { return {QuantMode::mxfp8, 32, 8}; }
  static constexpr Quant nvfp4() { return {QuantMode::nvfp4, 16, 4}; }
  friend constexpr bool operator==(const Quant&, const Quant&) = default;
};

/// quantized_matmul's options: y = x @ W^T when transpose (W (N, K), a Linear's weight), else
/// x @ W (W (K, N)); W quantized along its rows in format q.
struct QuantMatmulAttrs {
  Quant q;
  bool transpose = true;
};

/// The weight of a linear_cross_entropy's head (ops/linear_cross_entropy.hpp), a (V, C) matrix
/// in nn.Linear's layout: dense `w`, or quantized rows (`codes`, `scales`, `biases`, the last
/// undefined in the fp modes) in format `q`.
struct HeadWeight {
  Tensor w;
  Tensor codes, scales, biases;
  Quant q;
  bool quantized() const { return codes.defined(); }
  std::int64_t rows() const { return quantized() ? codes.dim(0) : w.dim(0); }
};

/// linear_cross_entropy's options: the cross-entropy's (ignore_index; sum or mean), and whether
/// the node has per-row weights `keep` (the mean is then sum(keep * loss) / sum(keep)).
struct LinearCrossEntropyAttrs {
  CrossEntropyAttrs ce;
  bool has_keep = false;
  QuantMatmulAttrs head;  // head.q: the quantized head's format (unused for a dense head)
  bool quantized = false;
};

/// A fused elementwise group's program (ops/fused.hpp makes it; backend/cpu/fused.hpp runs it):
/// registers 0..inputs-1 hold the group's inputs at each element, register inputs + s step s's
/// result, and the last step's result is the output. Each step is a unary or binary primitive,
/// or a where, that was a node of the tape, kept with its attributes, so the fused loop computes
/// exactly what the nodes did, element by element, with the same functors (backend/math.hpp).
/// An input of another dtype than the group's is a where's mask: it is loaded as 1 where it is
/// nonzero and 0 elsewhere (where's own test).
inline constexpr int kMaxFusedSteps = 16;
inline constexpr int kMaxFusedInputs = 8;
struct FusedStep {
  bool binary = false;  // else unary (or a where)
  bool select = false;  // where(mask register m, a, b): a where the mask is nonzero, else b
  std::uint8_t op = 0;  // the Unary or Binary enumerator
  std::int8_t a = 0, b = 0, m = 0;  // operand registers (b: binary and where; m: where only)
  bool grad = false;         // the step's value wants a gradient (its node's requires_grad)
  bool grad_a = false, grad_b = false;  // the gradient flows into operand a / b
  double arg = 0.0;          // a unary's scalar (pow's exponent, scale's factor)
  std::int32_t node = -1;    // the tape node it was (for reports)
};
struct FusedProgram {
  int inputs = 0, steps = 0;
  std::array<FusedStep, kMaxFusedSteps> step{};
  // The registers the vjp reads (bit r: register r): what the steps' derivatives read
  // (unary_df_reads, binary_df_reads) and what those values are computed from. The last step's
  // value comes from the output; a register outside the mask is neither loaded nor recomputed.
  std::uint32_t vjp_need = ~0u;
};

/// Where a vjp kernel writes one input's gradient: the buffer (null when that input needs none)
/// and whether it adds into what is there. The tape hands these out (GTape::grad_outs) with
/// aliasing resolved: when two inputs are one tensor, their slots name one buffer, already
/// zeroed, and both accumulate, so a kernel never tests whether its outputs overlap.
struct GradOut {
  Tensor* g = nullptr;
  bool acc = false;
};

/// What a backend policy provides. Every kernel takes tensors already allocated by the caller
/// (the tape owns all buffers, so a replay allocates nothing); `acc` means "add into the
/// destination" rather than overwrite, which is how gradients accumulate. Shapes are validated
/// by the ops before a kernel runs; kernels trust them.
template <class B>
concept BackendPolicy = requires(Tensor& y, const Tensor& x, const Shape& s, DType dt, double v, bool acc,
                                 int axis, std::int64_t i64, const std::array<int, kMaxRank>& perm,
                                 const AttentionAttrs& att, const CrossEntropyAttrs& ce, GradOut go,
                                 RopeArgs ra, const QuantMatmulAttrs& qa, const Quant& q) {
  { B::device } -> std::convertible_to<Device>;
  { B::name } -> std::convertible_to<const char*>;
  { B::alloc(s, dt) } -> std::same_as<Tensor>;
  B::fill(y, v);
  B::copy(x, y, acc);                          // y (+)= x, same element count
  B::cast(x, y);                               // dtype conversion, same shape
  B::unary(Unary::exp, v, x, y);               // y = f(x)
  B::unary_vjp(Unary::exp, v, x, x, x, y, acc);  // gx (+)= g * f'(x), given x, y = f(x), g
  B::binary(Binary::add, x, x, y);             // y = a op b, broadcast
  B::binary_vjp(Binary::add, 0, x, x, x, y, acc);  // d(a op b)/d(a or b) * g, full output shape
  B::sum_to(x, y, v, acc);                     // y (+)= v * sum of x over y's broadcast dims
  B::broadcast_to(x, y, v, acc);               // y (+)= v * x broadcast to y's shape
  B::where(x, x, x, y);                        // y = mask ? a : b, broadcast
  B::where_vjp(x, x, 0, y, acc);               // g masked to one branch, full output shape
  B::max_axis(x, axis, y, y);                  // y = max over axis (keepdims), index of first max
  B::max_axis_vjp(x, y, axis, y, acc);         // gx (+)= g at the argmax, 0 elsewhere
  B::matmul(x, acc, x, acc, y, acc);           // c (+)= op(a) @ op(b), batched, see cpu.hpp
  B::permute(x, perm, y, acc);                 // y (+)= x permuted
  B::slice_copy(x, axis, i64, y);              // y = x[..., start:start+len, ...]
  B::slice_scatter(x, axis, i64, y, acc);      // y[..., start:start+len, ...] (+)= x
  B::gather_rows(x, x, y);                     // y[i, :] = table[ids[i], :]
  B::scatter_add_rows(x, x, y);                // table_grad[ids[i], :] += g[i, :]
  B::pick(x, x, y);                            // y[i] = x[i, idx[i]] (0 where idx < 0)
  B::pick_vjp(x, x, y);                        // gx[i, idx[i]] += g[i]
  B::bernoulli_mask(x, v, v, y);               // (key, p_keep, value, mask): MLX bernoulli ? value : 0
  B::softmax(x, y, acc);                       // last axis; acc selects log_softmax here
  B::softmax_vjp(x, x, y, acc, acc);           // (y, g, gx, log?, acc)
  B::cross_entropy(x, x, ce, y, y);            // (logits, targets, attrs, y, lse)
  B::cross_entropy_vjp(x, x, ce, x, x, y, acc);  // (logits, targets, attrs, lse, g, gx, acc)
  // fused primitives, each beside its composite reference (ops/norm, rope, attention, glu.hpp);
  // a null gradient pointer means that input needs none
  B::rms_norm(x, x, v, y, y);                    // (x, w or undefined, eps, y, rstd)
  B::rms_norm_vjp(x, x, x, x, go, go);           // (x, w, rstd, g, gx, gw)
  B::rope(x, x, x, ra, y, acc);                  // (x, cos, sin, {traditional, inverse}, y, acc)
  B::attention(x, x, x, x, att, y, y);           // (q, k, v, mask, attrs, out, p)
  B::attention_vjp(x, x, x, x, x, att, y, go, go, go);  // (q, k, v, p, g, attrs, scratch, gq, gk, gv)
  // (optional: B::flash_attention / flash_attention_vjp, see detail::HasFlashAttention in
  // ops/attention.hpp; a backend without them runs attention above for every gqa_attention)
  B::swiglu(x, x, y);                            // (gate, up, y)
  B::swiglu_vjp(x, x, x, go, go);                // (gate, up, g, ggate, gup)
  // quantized weights (quant.hpp, ops/quantized.hpp): W given as (codes, scales, biases)
  B::quantized_matmul(x, x, x, x, qa, y, acc);   // (x, wq, scales, biases, attrs, y, acc): y (+)= x @ op(W)
  B::quantized_gather(x, x, x, x, q, y);         // (ids, wq, scales, biases, format, y): y[i] = W[ids[i]]
  // optimizer updates (optim/): p, g and slots of one parameter; lr/step 0-D tensors
  B::sgd_update(y, x, y, x, v, v, v, acc);
  B::adam_update(y, x, y, y, x, x, v, v, v, v, acc);
  B::lion_update(y, x, y, x, v, v, v);
  B::muon_momentum(x, x, y, y, v, v, acc);
  B::axpby(v, x, v, y);
  { B::sum_squares(x) } -> std::convertible_to<double>;
  B::normalize_frobenius(y, v);
  B::apply_update(y, x, x, v);
};

}  // namespace nn
// ---- end nn/backend/policy.hpp ----

// GCC's -Wpsabi notes, for the formulas below taken on backend/simd.hpp's 32- and 64-byte lane
// vectors, that passing those by value changes the call's ABI without AVX: they are always inlined
// into the kernel compiled for the vectors' instruction set, so no such call exists.
#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace nn::detail {

// The libm functions both backends call: glibc's on the host (what std::exp(float) etc. resolve
// to), CUDA's device versions under nvcc (never the fast intrinsics).
// clang-format off
NN_HD inline float m_exp(float x) { return ::expf(x); }
NN_HD inline double m_exp(double x) { return ::exp(x); }
NN_HD inline float m_log(float x) { return ::logf(x); }
NN_HD inline double m_log(double x) { return ::log(x); }
NN_HD inline float m_sqrt(float x) { return ::sqrtf(x); }
NN_HD inline double m_sqrt(double x) { return ::sqrt(x); }
NN_HD inline float m_tanh(float x) { return ::tanhf(x); }
NN_HD inline double m_tanh(double x) { return ::tanh(x); }
NN_HD inline float m_erf(float x) { return ::erff(x); }
NN_HD inline double m_erf(double x) { return ::erf(x); }
NN_HD inline float m_pow(float x, float a) { return ::powf(x, a); }
NN_HD inline double m_pow(double x, double a) { return ::pow(x, a); }
NN_HD inline float m_abs(float x) { return ::fabsf(x); }
NN_HD inline double m_abs(double x) { return ::fabs(x); }
// clang-format on

// The scalar type of V: V itself, or an Eigen array expression's Scalar. The functions below that
// take a V run on scalars (every backend) and on Eigen arrays (the CPU's vectorised chunks).
template <class V, class = void>
struct scalar_of {
  using type = V;
};
template <class V>
struct scalar_of<V, std::void_t<typename V::Scalar>> {
  using type = typename V::Scalar;
};
template <class V>
using scalar_of_t = typename scalar_of<V>::type;

/// Whether V is a vector of float lanes of backend/simd.hpp (the CPU's per-ISA row kernels run
/// these formulas on them), and its exp (simd::exp; host only, defined there).
template <class V>
struct is_lane_vector : std::false_type {};
template <class V>
NN_LANES_INLINE V simd_exp(V x);

/// exp of a scalar (m_exp), of lane vectors (simd_exp) or of an Eigen array (its vectorised .exp()).
NN_HD_GENERIC template <class V>
NN_LANES_INLINE NN_HD inline auto v_exp(const V& x) {
  if constexpr (std::is_floating_point_v<V>) return m_exp(x);
  else if constexpr (is_lane_vector<V>::value) return simd_exp(x);
  else return x.exp();
}

/// 1 / (1 + exp(-x)), of a scalar or an Eigen array.
NN_HD_GENERIC template <class V>
NN_LANES_INLINE NN_HD inline auto sigmoid(const V& x) {
  using T = scalar_of_t<V>;
  return T(1) / (T(1) + v_exp(-x));
}

/// The forward math of every unary op.
template <class T>
NN_HD inline T unary_f(Unary op, T x, T a) {
  constexpr T kSqrt2OverPi = T(0.7978845608028654);  // sqrt(2/pi)
  switch (op) {
    case Unary::neg: return -x;
    case Unary::exp: return m_exp(x);
    case Unary::log: return m_log(x);
    case Unary::sqrt: return m_sqrt(x);
    case Unary::rsqrt: return T(1) / m_sqrt(x);
    case Unary::tanh: return m_tanh(x);
    case Unary::sigmoid: return sigmoid(x);
    case Unary::relu: return x > T(0) ? x : T(0);
    case Unary::abs: return m_abs(x);
    case Unary::pow: return m_pow(x, a);
    case Unary::silu: return x * sigmoid(x);
    case Unary::gelu: return T(0.5) * x * (T(1) + m_erf(x / std::numbers::sqrt2_v<T>));
    case Unary::gelu_approx: return T(0.5) * x * (T(1) + m_tanh(kSqrt2OverPi * (x + T(0.044715) * x * x * x)));
    case Unary::gelu_fast: return x * sigmoid(T(1.702) * x);
    case Unary::scale: return a * x;
    case Unary::add_scalar: return x + a;
  }
  return x;
}

/// d f(x) / dx for every unary op, given x and y = f(x). Kinks: relu'(0) = 0 (as PyTorch and
/// tinygrad's where(x > 0)), abs'(0) = 0 (sign(0), as PyTorch).
template <class T>
NN_HD inline T unary_df(Unary op, T x, T y, T a) {
  constexpr T kSqrt2OverPi = T(0.7978845608028654);
  switch (op) {
    case Unary::neg: return T(-1);
    case Unary::exp: return y;
    case Unary::log: return T(1) / x;
    case Unary::sqrt: return T(0.5) / y;
    case Unary::rsqrt: return T(-0.5) * y / x;
    case Unary::tanh: return T(1) - y * y;
    case Unary::sigmoid: return y * (T(1) - y);
    case Unary::relu: return x > T(0) ? T(1) : T(0);
    case Unary::abs: return x > T(0) ? T(1) : (x < T(0) ? T(-1) : T(0));
    case Unary::pow: return a == T(0) ? T(0) : a * m_pow(x, a - T(1));
    case Unary::silu: {
      T s = sigmoid(x);
      return s * (T(1) + x * (T(1) - s));
    }
    case Unary::gelu: {
      T cdf = T(0.5) * (T(1) + m_erf(x / std::numbers::sqrt2_v<T>));
      T pdf = m_exp(T(-0.5) * x * x) / m_sqrt(T(2) * std::numbers::pi_v<T>);
      return cdf + x * pdf;
    }
    case Unary::gelu_approx: {
      T u = kSqrt2OverPi * (x + T(0.044715) * x * x * x);
      T t = m_tanh(u);
      T du = kSqrt2OverPi * (T(1) + T(3) * T(0.044715) * x * x);
      return T(0.5) * (T(1) + t) + T(0.5) * x * (T(1) - t * t) * du;
    }
    case Unary::gelu_fast: {
      T s = sigmoid(T(1.702) * x);
      return s + x * T(1.702) * s * (T(1) - s);
    }
    case Unary::scale: return a;
    case Unary::add_scalar: return T(1);
  }
  return T(0);
}

/// Which operands unary_df reads: bit 0 x, bit 1 y. A value no vjp reads may share its memory
/// once its forward consumers ran (GTape::plan_memory); keep this beside unary_df's cases.
constexpr unsigned unary_df_reads(Unary op) {
  switch (op) {
    case Unary::neg: case Unary::scale: case Unary::add_scalar: return 0;
    case Unary::exp: case Unary::sqrt: case Unary::tanh: case Unary::sigmoid: return 2;
    case Unary::rsqrt: return 3;
    default: return 1;  // log relu abs pow silu gelu gelu_approx gelu_fast
  }
}

template <class T>
NN_HD inline T binary_f(Binary op, T a, T b) {
  switch (op) {
    case Binary::add: return a + b;
    case Binary::sub: return a - b;
    case Binary::mul: return a * b;
    case Binary::div: return a / b;
    case Binary::maximum: return a >= b ? a : b;
    case Binary::minimum: return a <= b ? a : b;
  }
  return a;
}

/// d(a op b)/d(a) (which = 0) or d/d(b) (which = 1). Ties of maximum/minimum send the gradient
/// to a (documented in ops/elementwise.hpp).
template <class T>
NN_HD inline T binary_df(Binary op, int which, T a, T b) {
  switch (op) {
    case Binary::add: return T(1);
    case Binary::sub: return which == 0 ? T(1) : T(-1);
    case Binary::mul: return which == 0 ? b : a;
    case Binary::div: return which == 0 ? T(1) / b : -a / (b * b);
    case Binary::maximum: return (a >= b) == (which == 0) ? T(1) : T(0);
    case Binary::minimum: return (a <= b) == (which == 0) ? T(1) : T(0);
  }
  return T(0);
}

/// Which operands binary_df(op, which, a, b) reads: bit 0 a, bit 1 b (see unary_df_reads).
constexpr unsigned binary_df_reads(Binary op, int which) {
  switch (op) {
    case Binary::add: case Binary::sub: return 0;
    case Binary::mul: return which == 0 ? 2 : 1;
    case Binary::div: return which == 0 ? 2 : 3;
    default: return 3;  // maximum, minimum compare a and b
  }
}

template <class T>
NN_HD inline void put(T* y, std::int64_t i, T v, bool acc) {
  if (acc) y[i] += v;
  else y[i] = v;
}

// ---- fused primitives and optimizer updates: the per-element math ----------------------------
// Generic over the value V (see scalar_of): a scalar (a CUDA thread's element, a CPU scalar
// loop) or an Eigen array expression (the CPU's vectorised chunks), so the CPU keeps its vector
// code and both backends still read one formula. Eigen's vectorised exp is not glibc's:
// the formula is shared, the last bits of exp are each backend's (tests compare with tolerance).

/// SwiGLU: y = silu(a) u = (a s) u, s = sigmoid(a); da = (g u) (s (1 + a (1 - s))), du = g (a s).
struct SwiGluMath {
  NN_HD_GENERIC template <class V>
  NN_LANES_INLINE NN_HD static auto sig(const V& a) {
    return sigmoid(a);
  }
  NN_HD_GENERIC template <class V, class U>
  NN_LANES_INLINE NN_HD static auto y(const V& a, const U& u) {
    return (a * sig(a)) * u;
  }
  NN_HD_GENERIC template <class V, class U, class G, class S>
  NN_LANES_INLINE NN_HD static auto dgate(const V& a, const U& u, const G& g, const S& s) {
    using T = scalar_of_t<V>;
    return (g * u) * (s * (T(1) + a * (T(1) - s)));
  }
  NN_HD_GENERIC template <class V, class G, class S>
  NN_LANES_INLINE NN_HD static auto dup(const V& a, const G& g, const S& s) {
    return g * (a * s);
  }
};

/// Softmax along a row, shifted by the row's maximum m so logits in the thousands neither
/// overflow nor lose bits. Softmax, log-softmax, cross-entropy and attention (dense and flash)
/// all run these steps around their row reductions (the CPU's Eigen chunks, CUDA's block
/// reductions), so each formula is written here once:
///   p = exp(x - m) / s, s = sum_j exp(x_j - m)     lse = m + log s;  p = exp(x - lse)
///   log p = (x - m) - log s   (not x - (m + log s): m + log s rounds to m's ulp, an absolute
///                              error of 1e-4 for float32 logits in the thousands)
///   softmax vjp:     gx = p (g - sum_j g_j p_j)
///   log-softmax vjp: gx = g - exp(y) sum_j g_j
///   cross-entropy:   loss = lse - x_t;  gx = g exp(x - lse), then - g at the target
///   online (flash):  partial sums over earlier tiles are re-based by exp(m_old - m_new)
struct SoftmaxMath {
  /// The shift of a row whose entries are all -inf (fully masked): 0, so the row stays finite.
  template <class T>
  NN_HD static T finite_max(T m) {
    return m == -std::numeric_limits<T>::infinity() ? T(0) : m;
  }
  template <class T>
  NN_HD static T lse(T m, T s) {
    return m + m_log(s);
  }
  NN_HD_GENERIC template <class V, class T>
  NN_HD static auto log_p(const V& x, T m, T log_s) {
    return (x - m) - log_s;
  }
  NN_HD_GENERIC template <class V, class T>
  NN_LANES_INLINE NN_HD static auto p_from_lse(const V& x, T lse) {
    return v_exp(x - lse);
  }
  template <class T>
  NN_HD static T rebase(T m_old, T m_new) {
    return m_exp(m_old - m_new);
  }
  NN_HD_GENERIC template <class P, class G, class T>
  NN_HD static auto vjp(const P& p, const G& g, T dot) {
    return p * (g - dot);
  }
  NN_HD_GENERIC template <class G, class Y, class T>
  NN_HD static auto log_vjp(const G& g, const Y& y, T gsum) {
    return g - v_exp(y) * gsum;
  }
  template <class T>
  NN_HD static T ce_loss(T lse, T x_target) {
    return lse - x_target;
  }
  NN_HD_GENERIC template <class V, class T>
  NN_LANES_INLINE NN_HD static auto ce_grad(const V& x, T lse, T g) {
    return g * p_from_lse(x, lse);
  }
};

/// A soft cap on scores (Gemma 2's attn_logit_softcapping; its final logits use the composite
/// nn::softcap): y = cap tanh(x / cap) keeps |y| < cap, dy/dx = 1 - (y / cap)^2. Flash
/// attention caps each tile's scaled scores with it and its vjp multiplies the score gradients by
/// the derivative, recomputed from y.
struct SoftcapMath {
  template <class T>
  NN_HD static T value(T x, T cap) {
    return cap * m_tanh(x / cap);
  }
  template <class T>
  NN_HD static T grad(T y, T cap) {
    const T t = y / cap;
    return T(1) - t * t;
  }
};

/// RMSNorm per row of C values: rstd = 1 / sqrt(inv_c sum(x^2) + eps), y = (x rstd) w; with
/// u = g w (or g), gx = rstd u - c x where c = rstd^3 inv_c sum(u x).
struct RmsNormMath {
  template <class T>
  NN_HD static T rstd(T sum_sq, T inv_c, T eps) {
    return T(1) / m_sqrt(inv_c * sum_sq + eps);
  }
  template <class T>
  NN_HD static T vjp_coef(T rstd, T inv_c, T sum_ux) {
    return rstd * rstd * rstd * inv_c * sum_ux;
  }
  NN_HD_GENERIC template <class T, class U, class X>
  NN_HD static auto gx(T rstd, const U& u, T c, const X& x) {
    return rstd * u - c * x;
  }
};

/// RoPE's rotation of a feature pair (a1, a2) by an angle with cosine c and sine s (the inverse,
/// the vjp, passes -s): (a1 c - a2 s, a1 s + a2 c).
struct RopeMath {
  template <class T>
  NN_HD static T first(T a1, T a2, T c, T s) {
    return a1 * c - a2 * s;
  }
  template <class T>
  NN_HD static T second(T a1, T a2, T c, T s) {
    return a1 * s + a2 * c;
  }
};

// The optimizer updates (MLX's arithmetic order). make() forms the scalars on the host, in the
// parameter's dtype T, as MLX does: 1 - b in double and then rounded (in float32, T(1) - T(0.999)
// is 1.3e-5 away from T(0.001)); the learning rate rounded to T first (MLX's
// learning_rate.astype(gradient.dtype)).

/// SGD: g += wd p; no momentum: p -= lr g; else v = mu v + (1 - tau) g (tau = 0: + g),
/// update = nesterov ? g + mu v : v; p -= lr update.
template <class T>
struct SgdMath {
  T l, mu, d, w;
  bool has_wd, damp, nesterov;
  static SgdMath make(double lr, double momentum, double dampening, double wd, bool nesterov) {
    return {static_cast<T>(lr), static_cast<T>(momentum), static_cast<T>(1 - dampening), static_cast<T>(wd), wd != 0,
            dampening > 0, nesterov};
  }
  /// One element; v is null without momentum.
  NN_HD void operator()(T& p, T g, T* v) const {
    const T gi = has_wd ? g + w * p : g;
    if (!v) {
      p = p - l * gi;
      return;
    }
    T vi = mu * *v;
    vi += damp ? d * gi : gi;
    *v = vi;
    p = p - l * (nesterov ? gi + mu * vi : vi);
  }
};

/// Adam / AdamW: decoupled wd first p *= 1 - lr wd (AdamW); m = b1 m + (1-b1) g;
/// v = b2 v + (1-b2) g^2; p -= c1 m / (sqrt(v) c2 + eps) with c1 = lr / (1 - b1^t),
/// c2 = 1 / sqrt(1 - b2^t) under bias correction, else c1 = lr, c2 = 1 (the same bits as
/// lr m / (sqrt v + eps): x 1 is exact). t = step, already incremented.
template <class T>
struct AdamMath {
  T B1, B2, E, C1, C2, decay, c1, c2;
  bool decoupled;
  static AdamMath make(double lr, double step, double b1, double b2, double eps, double decoupled_wd,
                       bool bias_correction) {
    AdamMath a;
    const T l = static_cast<T>(lr), t = static_cast<T>(step);
    a.B1 = static_cast<T>(b1), a.B2 = static_cast<T>(b2), a.E = static_cast<T>(eps);
    a.C1 = static_cast<T>(1 - b1), a.C2 = static_cast<T>(1 - b2);
    a.decay = T(1) - l * static_cast<T>(decoupled_wd);
    a.c1 = bias_correction ? l / (T(1) - std::pow(a.B1, t)) : l;
    a.c2 = bias_correction ? T(1) / std::sqrt(T(1) - std::pow(a.B2, t)) : T(1);
    a.decoupled = decoupled_wd != 0;
    return a;
  }
  NN_HD_GENERIC template <class M, class G>
  NN_HD auto m(const M& m, const G& g) const {
    return B1 * m + C1 * g;
  }
  NN_HD_GENERIC template <class V, class G>
  NN_HD auto v(const V& v, const G& g) const {
    return B2 * v + C2 * (g * g);
  }
  /// What p loses this step, from the new m and sqrt of the new v.
  NN_HD_GENERIC template <class M, class R>
  NN_HD auto delta(const M& m, const R& root_v) const {
    return (c1 * m) / (root_v * c2 + E);
  }
};

/// Lion: c = b1 m + (1-b1) g; m = b2 m + (1-b2) g; wd > 0: p *= 1 - lr wd; p -= lr sign(c).
template <class T>
struct LionMath {
  T l, B1, B2, C1, C2, decay;
  bool has_wd;
  static LionMath make(double lr, double b1, double b2, double wd) {
    const T l = static_cast<T>(lr);
    return {l, static_cast<T>(b1), static_cast<T>(b2), static_cast<T>(1 - b1), static_cast<T>(1 - b2),
            T(1) - l * static_cast<T>(wd), wd > 0};
  }
  NN_HD void operator()(T& p, T g, T& m) const {
    const T c = B1 * m + C1 * g;
    m = B2 * m + C2 * g;
    const T pi = has_wd ? decay * p : p;
    const T sg = c > T(0) ? T(1) : (c < T(0) ? T(-1) : T(0));
    p = pi - l * sg;
  }
};

/// Muon's momentum: g += wd p; v = mu v + (1-mu) g; u = nesterov ? (1-mu) g + mu v : v.
template <class T>
struct MuonMomentumMath {
  T mu, w, c;
  bool has_wd, nesterov;
  static MuonMomentumMath make(double momentum, double wd, bool nesterov) {
    return {static_cast<T>(momentum), static_cast<T>(wd), static_cast<T>(1 - momentum), wd != 0, nesterov};
  }
  NN_HD void operator()(T p, T g, T& v, T& u) const {
    const T gi = has_wd ? g + w * p : g;
    const T vi = mu * v + c * gi;
    v = vi;
    u = nesterov ? gi * c + vi * mu : vi;
  }
};

/// y = a x + b y (Muon's Newton-Schulz steps).
template <class T>
struct AxpbyMath {
  T a, b;
  NN_HD T operator()(T x, T y) const { return a * x + b * y; }
};

/// p -= (lr factor) x, the rate rounded to T before the factor is applied (MLX's order).
template <class T>
struct ApplyUpdateMath {
  T l;
  static ApplyUpdateMath make(double lr, double factor) {
    return {static_cast<T>(static_cast<T>(lr) * static_cast<T>(factor))};
  }
  NN_HD T operator()(T p, T x) const { return p - l * x; }
};

// ---- quantized formats (quant.hpp) ------------------------------------------------------------

/// MLX's quantization, per value: the code reader of every quantized kernel, mxfp4's E2M1 and
/// E8M0 tables, and the per-group arithmetic of nn::quantize, which follows MLX 0.32.4's CPU
/// kernel operation by operation (so its codes, scales and biases are MLX's bit for bit).
struct QuantMath {
  /// Code c of a row's LSB-first bit stream of row_bytes bytes: bits [c*bits, (c+1)*bits).
  NN_HD static std::uint32_t code(const std::uint8_t* row, std::int64_t c, int bits, std::int64_t row_bytes) {
    const std::int64_t bit = c * bits, byte = bit >> 3;
    std::uint32_t v = row[byte];
    if (byte + 1 < row_bytes) v |= static_cast<std::uint32_t>(row[byte + 1]) << 8;
    return (v >> (bit & 7)) & ((1u << bits) - 1u);
  }
  /// The inverse of code(): ORs code v (< 2^bits) into a zeroed row's bit stream at index c.
  static void put_code(std::uint8_t* row, std::int64_t c, int bits, std::uint32_t v) {
    const std::int64_t bit = c * bits;
    std::uint8_t* p = row + bit / 8;
    const std::uint32_t sh = static_cast<std::uint32_t>(bit % 8), wide = v << sh;
    p[0] = static_cast<std::uint8_t>(p[0] | (wide & 0xffu));
    if (sh + static_cast<std::uint32_t>(bits) > 8) p[1] = static_cast<std::uint8_t>(p[1] | (wide >> 8));
  }
  /// E2M1 code (sign in bit 3) -> {0, .5, 1, 1.5, 2, 3, 4, 6}, negated; code 8 is -0.
  NN_HD static float e2m1(std::uint32_t c) {
    const float lut[8] = {0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f};
    const float v = lut[c & 7u];
    return (c & 8u) ? -v : v;
  }
  /// E4M3 (fn: no infinities; 0x7f / 0xff are NaN) byte -> its value: sign, 4 exponent bits
  /// (bias 7), 3 mantissa bits; exponent 0 is subnormal (m / 8 * 2^-6).
  NN_HD static float e4m3(std::uint32_t b) {
    const std::uint32_t e = (b >> 3) & 15u, m = b & 7u;
    float v;
    if (e == 15 && m == 7) {
      const std::uint32_t nan_bits = 0x7fc00000u;
      __builtin_memcpy(&v, &nan_bits, 4);
    }
    else if (e == 0) v = static_cast<float>(m) * 0.001953125f;  // m / 8 * 2^-6
    else v = ::ldexpf(1.0f + static_cast<float>(m) * 0.125f, static_cast<int>(e) - 7);
    return (b & 0x80u) ? -v : v;
  }
  /// float -> E4M3 byte, rounding to nearest even and saturating to +-448 (0x7e) as PyTorch's
  /// c10::Float8_e4m3fn and MLX's fp8_e4m3 do (bit manipulation on the float's encoding).
  NN_HD static std::uint8_t e4m3_byte(float f) {
    std::uint32_t fb;
    __builtin_memcpy(&fb, &f, 4);
    const std::uint32_t sign = fb & 0x80000000u;
    fb ^= sign;
    std::uint8_t bits;
    if (fb >= (543u << 21)) {
      bits = 0x7e;
    } else if (fb < (121u << 23)) {  // below 2^-6: subnormal; adding 2^-6 rounds the mantissa (RNE)
      const std::uint32_t denorm = 141u << 23;
      float x, d;
      __builtin_memcpy(&x, &fb, 4);
      __builtin_memcpy(&d, &denorm, 4);
      x += d;
      std::uint32_t xb;
      __builtin_memcpy(&xb, &x, 4);
      bits = static_cast<std::uint8_t>(xb - denorm);
    } else {
      const std::uint32_t mant_odd = (fb >> 20) & 1u;
      fb += (static_cast<std::uint32_t>(7 - 127) << 23) + 0x7ffffu;
      fb += mant_odd;
      bits = static_cast<std::uint8_t>(fb >> 20);
    }
    return static_cast<std::uint8_t>(bits | (sign >> 24));
  }
  /// E8M0 scale byte -> 2^(e - 127) (255 gives infinity in float, as MLX's bf16 scale does).
  template <class T>
  NN_HD static T e8m0(std::uint8_t e) {
    return ::ldexp(static_cast<T>(1), static_cast<int>(e) - 127);
  }

  /// One affine group's scale and bias (F = float as MLX; double for float64 weights).
  template <class F>
  struct Affine {
    F scale, bias;
  };
  template <class F>
  static Affine<F> affine_params(const double* g, std::int64_t n, int bits) {
    const F n_bins = static_cast<F>((1 << bits) - 1), eps = static_cast<F>(1e-7);
    F w_min = std::numeric_limits<F>::infinity(), w_max = -w_min;
    for (std::int64_t j = 0; j < n; ++j) {
      w_max = std::max(w_max, static_cast<F>(g[j]));
      w_min = std::min(w_min, static_cast<F>(g[j]));
    }
    const bool mask = std::abs(w_min) > std::abs(w_max);
    F scale = std::max((w_max - w_min) / n_bins, eps);
    scale = mask ? scale : -scale;
    const F edge = mask ? w_min : w_max;
    const F q0 = std::rint(edge / scale);
    F bias = 0;
    if (q0 != 0) {
      scale = edge / q0;
      bias = edge;
    }
    return {scale, bias};
  }
  template <class F>
  static std::uint32_t affine_code(F w, const Affine<F>& p, int bits) {
    const F n_bins = static_cast<F>((1 << bits) - 1);
    F q = std::rint((w - p.bias) / p.scale);
    q = std::min(std::max(q, F(0)), n_bins);
    return static_cast<std::uint32_t>(static_cast<std::uint64_t>(q));
  }

  /// v rounded to dtype t's precision (float32 arithmetic on bf16/f16 values, as MLX computes
  /// half-precision ops: in float, rounded back), kept in double.
  static double in(DType t, double v) {
    if (t == DType::f64) return v;
    const float f = static_cast<float>(v);
    if (t == DType::bf16) return half::bf16_round(f);
    if (t == DType::f16) return half::f16_to_f32(half::f32_to_f16(f));
    return f;
  }
  /// The E8M0 scale exponent of an mxfp4 (elem_max 6) or mxfp8 (elem_max 448) group of n values
  /// of dtype t, as MLX 0.32.4 computes it: s = amax / elem_max rounded to t, e = the smallest
  /// integer with 2^e >= s (rounding the scale up, so no value saturates), 0 for a zero group.
  /// The stored byte is e + 127 (mod 256).
  static std::int32_t mx_exponent(const double* g, std::int64_t n, DType t, float elem_max) {
    double amax = 0;
    for (std::int64_t j = 0; j < n; ++j) amax = std::max(amax, std::abs(g[j]));
    const double s = t == DType::f64 ? amax / elem_max : in(t, static_cast<float>(amax) / elem_max);
    if (s == 0) return 0;
    if (!std::isfinite(s)) return 128;  // 2^128: float's infinity, as MLX stores it
    int k = 0;
    const double m = std::frexp(s, &k);  // s = m 2^k, m in [0.5, 1)
    return m == 0.5 ? k - 1 : k;
  }
  static std::uint8_t mxfp4_byte(std::int32_t e) {
    return static_cast<std::uint8_t>(static_cast<std::uint32_t>(e) + 127u);  // int32 -> uint8 wraps
  }
  /// nvfp4's scale byte of a group: amax / 6 rounded to t, then to E4M3 (MLX 0.32.4, no global
  /// scale).
  static std::uint8_t nvfp4_scale_byte(const double* g, std::int64_t n, DType t) {
    double amax = 0;
    for (std::int64_t j = 0; j < n; ++j) amax = std::max(amax, std::abs(g[j]));
    return e4m3_byte(static_cast<float>(t == DType::f64 ? amax / 6.0 : in(t, static_cast<float>(amax) / 6.0f)));
  }
  /// mxfp8's code of w in a group of exponent e: w / 2^e computed in t, then E4M3.
  static std::uint8_t mxfp8_code(double w, std::int32_t e, DType t) {
    const double p = t == DType::f64 ? std::ldexp(1.0, e) : in(t, std::ldexp(1.0f, e));
    const double v = t == DType::f64 ? w / p : in(t, static_cast<float>(w) / static_cast<float>(p));
    return e4m3_byte(static_cast<float>(v));
  }
  /// The E2M1 code of w in a group whose scale is p (mxfp4: 2^e; nvfp4: its E4M3 scale's value;
  /// zero gives code 0): the nearest table value to w / p, computed in t; the first index wins a
  /// tie (MLX's argmin).
  static std::uint32_t e2m1_code(double w, double p, DType t) {
    if (p == 0) return 0;
    const double v = t == DType::f64 ? w / p : in(t, static_cast<float>(w) / static_cast<float>(p));
    std::uint32_t best = 0;
    double best_d = 0;
    for (std::uint32_t i = 0; i < 16; ++i) {
      const double d = t == DType::f64 ? std::abs(v - e2m1(i)) : in(t, std::abs(static_cast<float>(v) - e2m1(i)));
      if (i == 0 || d < best_d) {
        best = i;
        best_d = d;
      }
    }
    return best;
  }
};

}  // namespace nn::detail

#if defined(__GNUC__) && !defined(__clang__) && !defined(__CUDACC__)
#pragma GCC diagnostic pop
#endif
// ---- end nn/backend/math.hpp ----

namespace nn {

/// A quantized matrix: packed codes, scales, biases (undefined for the fp modes) and the format.
struct QuantizedMatrix {
  Tensor weight, scales, biases;
  Quant q;
  std::int64_t rows() const { return weight.dim(0); }
  std::int64_t cols() const { return weight.dim(-1) * 32 / q.bits; }
  /// The float dtype the matrix dequantizes to: the scales' (affine), float32 (the fp modes).
  DType dtype() const { return q.mode == QuantMode::affine ? scales.dtype() : DType::f32; }
  /// Bytes held: codes, scales and biases.
  std::size_t nbytes() const { return weight.nbytes() + scales.nbytes() + (biases.defined() ? biases.nbytes() : 0); }
};

namespace detail {
inline std::atomic<bool>& int8_activations_flag() {
  static std::atomic<bool> on{false};
  return on;
}
}  // namespace detail

/// Opt-in, off by default: int8 activations for quantized products on few rows (generation).
/// While on, x @ W^T with 1-8 rows of float32 x and an affine 4- or 8-bit W (a power-of-two
/// group of 32 or more: MLX's 32/64/128, GGUF's Q4_0/Q4_1/Q8_0) rounds x to int8 in blocks of 32
/// values -- llama.cpp's Q8_0 rule: d = max|x| / 127, q = nearbyint(x * (127 / max|x|)) -- and
/// multiplies the codes on the integer units (AVX512-VNNI `vpdpbusd`, 64 products an instruction,
/// where float32 takes 16), each 32-block's sum then scaled by s * d; the biases still meet the
/// exact sums of x. This is what llama.cpp does on every CPU product. It changes results (x
/// keeps about 8 bits: ~1e-3 relative on a logit), so it is off by default and meant for
/// generation, not for training or for matching MLX's quantized_matmul (which the default path
/// does to 1e-6). Where it does not apply (no AVX512-VNNI, NN_CPU_ISA=avx2 or generic, another
/// format, more rows) the float32 path runs unchanged. Process-wide; safe to flip between calls.
inline void set_int8_activations(bool on) { detail::int8_activations_flag().store(on, std::memory_order_relaxed); }
inline bool int8_activations() { return detail::int8_activations_flag().load(std::memory_order_relaxed); }

namespace detail {

/// Refuses a format MLX does not define: affine groups 32/64/128 with bits 2/3/4/5/6/8 (and the
/// GGUF-style groups 16 and 256), mxfp4 and mxfp8 with group 32 (4 and 8 bits), nvfp4 with
/// group 16 and 4 bits.
inline void check_quant(const Quant& q, const char* op) {
  if (quant_fp(q.mode)) {
    const Quant want = q.mode == QuantMode::mxfp4 ? Quant::mxfp4() : q.mode == QuantMode::mxfp8 ? Quant::mxfp8() : Quant::nvfp4();
    if (q.group != want.group || q.bits != want.bits)
      fail(op, quant_mode_name(q.mode), " needs group size ", want.group, " and ", want.bits, " bits, got group ", q.group,
           " and ", q.bits, " bits");
    return;
  }
  if (q.bits < 2 || q.bits > 8 || q.bits == 7)
    fail(op, "affine quantization supports 2, 3, 4, 5, 6 and 8 bits, got ", q.bits);
  if (q.group != 16 && q.group != 32 && q.group != 64 && q.group != 128 && q.group != 256)
    fail(op, "affine quantization supports group sizes 32, 64 and 128 (and GGUF's 16 and 256), got ", q.group);
}

/// What the checks read of a tensor: shape and dtype (or absent), so a tape's builder checks
/// without touching data.
struct QuantPart {
  bool defined = false;
  Shape shape;
  DType dtype = DType::f32;
  QuantPart() = default;
  QuantPart(const Shape& s, DType t) : defined(true), shape(s), dtype(t) {}
  QuantPart(const Tensor& t) : defined(t.defined()), shape(t.defined() ? t.shape() : Shape{}), dtype(t.dtype()) {}  // NOLINT
  std::string str() const { return defined ? std::string(dtype_name(dtype)) + " " + shape.str() : std::string("none"); }
};

/// Checks that codes, scales and biases form a (rows, cols) matrix in format q; returns cols.
inline std::int64_t check_quantized(const QuantPart& wq, const QuantPart& scales, const QuantPart& biases,
                                    const Quant& q, const char* op) {
  check_quant(q, op);
  if (!wq.defined || wq.dtype != DType::u32 || wq.shape.rank() != 2)
    fail(op, "the quantized weight must be a (rows, cols * bits / 32) uint32 matrix, got ", wq.str());
  const std::int64_t cols = wq.shape[1] * 32 / q.bits;
  if (wq.shape[1] * 32 % q.bits != 0 || cols % q.group != 0)
    fail(op, "a weight of ", wq.shape.str(), " words holds ", wq.shape[1] * 32, " bits per row, not a whole number of ",
         q.group, "-column groups of ", q.bits, "-bit codes");
  const Shape s{wq.shape[0], cols / q.group};
  if (!scales.defined || scales.shape != s)
    fail(op, "scales must be ", s.str(), " for a weight of ", wq.shape.str(), " (", quant_mode_name(q.mode), ", group ",
         q.group, ", ", q.bits, " bits), got ", scales.str());
  if (quant_fp(q.mode)) {
    if (scales.dtype != DType::u8)
      fail(op, quant_mode_name(q.mode), " scales must be uint8 (", q.mode == QuantMode::nvfp4 ? "E4M3" : "E8M0", "), got ",
           scales.str());
    if (biases.defined) fail(op, quant_mode_name(q.mode), " has no biases, got ", biases.str());
  } else {
    const DType t = scales.dtype;
    if (t != DType::f32 && t != DType::f64 && t != DType::bf16 && t != DType::f16)
      fail(op, "affine scales must be float32, float64, bfloat16 or float16, got ", scales.str());
    if (!biases.defined || biases.shape != s || biases.dtype != t)
      fail(op, "affine biases must be ", dtype_name(t), " ", s.str(), " like the scales, got ", biases.str());
  }
  return cols;
}

/// The same for tensors, which must also be on the host.
inline std::int64_t check_quantized(const Tensor& wq, const Tensor& scales, const Tensor& biases, const Quant& q,
                                    const char* op) {
  const std::int64_t cols = check_quantized(QuantPart(wq), QuantPart(scales), QuantPart(biases), q, op);
  for (const Tensor* t : {&wq, &scales, &biases})
    if (t->defined() && t->device() != Device::cpu) fail(op, "quantized tensors must be on the host here, got ", t->device());
  return cols;
}

/// A scale or bias element widened to T (f32/f64/bf16/f16 storage).
template <class T>
inline T widen_scale(const void* p, DType t, std::int64_t i) {
  switch (t) {
    case DType::f32: return static_cast<T>(static_cast<const float*>(p)[i]);
    case DType::f64: return static_cast<T>(static_cast<const double*>(p)[i]);
    case DType::bf16: return static_cast<T>(half::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]));
    default: return static_cast<T>(half::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]));
  }
}

/// The value stored as T's storage type: f32 as is, bf16/f16 rounded to nearest even.
inline float round_to(DType t, float v) {
  if (t == DType::bf16) return half::bf16_round(v);
  if (t == DType::f16) return half::f16_to_f32(half::f32_to_f16(v));
  return v;
}

/// Keeps the compiler from fusing a product into the next addition (an FMA rounds once; MLX's
/// dequantize rounds the product, then the sum).
template <class T>
inline T rounded(T v) {
#if defined(__GNUC__) && (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDA_ARCH__)
  asm("" : "+x"(v));
#endif
  return v;
}

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__CUDACC__)
#define NN_QUANT_AVX2 1
/// Whether this CPU runs the AVX2 decoders below (checked once; NN_CPU_ISA=generic turns them off
/// with the GEMM's kernels).
inline bool quant_avx2() {
  static const bool yes = choose_isa(detect_cpu_features()) != Isa::generic;
  return yes;
}

/// Codes c .. c + 7 of one row's bit stream (c a multiple of 8) in eight int32 lanes, BITS wide:
/// 4 bits two a byte (low nibble first), 8 bits a byte each, and 2, 3, 5 and 6 bits straddling
/// bytes (the eight fill BITS bytes from byte c * BITS / 8: codes 0-3 in the low 4 * BITS <= 24
/// bits, codes 4-7 in the next 4 * BITS, the two halves shifted apart in one variable shift).
template <int BITS>
[[gnu::target("avx2"), gnu::always_inline]] inline __m256i codes8(const std::uint8_t* row, std::uint64_t c) {
  if constexpr (BITS == 8) {
    return _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c)));
  } else if constexpr (BITS == 4) {
    std::uint32_t w;
    std::memcpy(&w, row + c / 2, 4);
    const __m128i v = _mm_cvtsi32_si128(static_cast<int>(w)), nib = _mm_set1_epi8(0x0f);
    return _mm256_cvtepu8_epi32(_mm_unpacklo_epi8(_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib)));
  } else {
    // The BITS bytes assembled in a register from loads of 4, 2 and 1 bytes: no byte past the
    // eight codes is read, and no partial stores are read back whole (a store-forwarding stall).
    const std::uint8_t* p = row + c / 8 * BITS;
    std::uint32_t lo = 0;
    std::uint16_t mid = 0;
    std::uint64_t w;
    if constexpr (BITS == 2) std::memcpy(&mid, p, 2), w = mid;
    else if constexpr (BITS == 3) std::memcpy(&mid, p, 2), w = mid | static_cast<std::uint64_t>(p[2]) << 16;
    else if constexpr (BITS == 5) std::memcpy(&lo, p, 4), w = lo | static_cast<std::uint64_t>(p[4]) << 32;
    else std::memcpy(&lo, p, 4), std::memcpy(&mid, p + 4, 2), w = lo | static_cast<std::uint64_t>(mid) << 32;
    const __m256i v = _mm256_set_m128i(_mm_set1_epi32(static_cast<int>(w >> (4 * BITS))), _mm_set1_epi32(static_cast<int>(w)));
    const __m256i sh = _mm256_setr_epi32(0, BITS, 2 * BITS, 3 * BITS, 0, BITS, 2 * BITS, 3 * BITS);
    return _mm256_and_si256(_mm256_srlv_epi32(v, sh), _mm256_set1_epi32((1 << BITS) - 1));
  }
}

/// Calls f.template operator()<BITS>() for bits in {2, 3, 4, 5, 6, 8} (a code width known at
/// compile time inside the loops that decode).
template <class F>
inline decltype(auto) with_code_bits(int bits, F&& f) {
  switch (bits) {
    case 2: return f.template operator()<2>();
    case 3: return f.template operator()<3>();
    case 4: return f.template operator()<4>();
    case 5: return f.template operator()<5>();
    case 6: return f.template operator()<6>();
    default: return f.template operator()<8>();
  }
}

/// out[0, n) = values c0 .. c0 + n of one row of mxfp4 or nvfp4 in float32, s * E2M1[q], eight
/// at a time (c0 and n multiples of 8, inside one group). Affine runs go through affine_run_*.
[[gnu::target("avx2")]] inline void decode8_e2m1(const std::uint8_t* row, std::uint64_t c0, std::uint64_t n, float s,
                                                 float* out) {
  const __m256 vs = _mm256_set1_ps(s);
  // E2M1 in two halves of 8 (codes 0-7 positive, 8-15 their negatives, 8 being -0).
  const __m256 pos = _mm256_setr_ps(0.0f, 0.5f, 1.0f, 1.5f, 2.0f, 3.0f, 4.0f, 6.0f);
  const __m256 neg = _mm256_setr_ps(-0.0f, -0.5f, -1.0f, -1.5f, -2.0f, -3.0f, -4.0f, -6.0f);
  for (std::uint64_t i = 0; i < n; i += 8) {
    const __m256i q = codes8<4>(row, c0 + i);
    const __m256 lo = _mm256_permutevar8x32_ps(pos, q), hi = _mm256_permutevar8x32_ps(neg, q);
    _mm256_storeu_ps(out + i, _mm256_mul_ps(vs, _mm256_blendv_ps(lo, hi, _mm256_castsi256_ps(_mm256_slli_epi32(q, 28)))));
  }
}

/// Whether this CPU runs the AVX-512 decoder (16 codes a vector; NN_CPU_ISA=avx2 or generic turns
/// it off with the GEMM's AVX-512 kernels).
inline bool quant_avx512() {
  static const bool yes = choose_isa(detect_cpu_features()) == Isa::avx512;
  return yes;
}

/// Whether this CPU runs the int8-activation kernel (set_int8_activations): the AVX-512 decoders
/// and AVX512-VNNI.
inline bool quant_vnni() {
  static const bool yes = quant_avx512() && detect_cpu_features().avx512_vnni;
  return yes;
}

/// Per lane i of 16: the bytes of code i (from byte i * BITS / 8) gathered into its dword, and
/// the shift that brings the code to bit 0 (codes16's shuffle and shift, as constants).
template <int BITS>
struct Codes16Layout {
  alignas(64) std::uint8_t shuffle[64];
  alignas(64) std::uint32_t shift[16];
  constexpr Codes16Layout() : shuffle(), shift() {
    for (int i = 0; i < 16; ++i) {
      const int byte = i * BITS / 8;
      for (int k = 0; k < 4; ++k) shuffle[4 * i + k] = k < 2 && byte + k < 16 ? static_cast<std::uint8_t>(byte + k) : 0x80;
      shift[i] = static_cast<std::uint32_t>(i * BITS % 8);
    }
  }
};
template <int BITS>
inline constexpr Codes16Layout<BITS> kCodes16{};

#define NN_QUANT_AVX512 "avx512f,avx512bw,avx512vl,avx512dq,avx2,fma"
// The AVX-512 code below uses the zero-masked forms with every lane set (kAll16) where GCC 12's
// plain intrinsics pass an _mm512_undefined_* operand, which -Wmaybe-uninitialized reports
// wherever they are inlined (the same instructions; the GEMM's transposes do the same).
inline constexpr __mmask16 kAll16 = 0xffff;

/// Codes c .. c + 15 of one row's bit stream (c a multiple of 8) in sixteen int32 lanes. 4 and 8
/// bits as in codes8; other widths: the 2 * BITS bytes that hold them (a masked load reads nothing
/// past them) in every 128-bit lane, each code's two bytes shuffled into its lane, shifted down
/// and masked.
template <int BITS>
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline __m512i codes16(const std::uint8_t* row, std::uint64_t c) {
  if constexpr (BITS == 8) {
    return _mm512_maskz_cvtepu8_epi32(kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + c)));
  } else if constexpr (BITS == 4) {
    const __m128i v = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + c / 2)), nib = _mm_set1_epi8(0x0f);
    return _mm512_maskz_cvtepu8_epi32(kAll16, _mm_unpacklo_epi8(_mm_and_si128(v, nib), _mm_and_si128(_mm_srli_epi16(v, 4), nib)));
  } else {
    const __m128i bytes = _mm_maskz_loadu_epi8(static_cast<__mmask16>((1u << (2 * BITS)) - 1), row + c / 8 * BITS);
    const __m512i lanes = _mm512_maskz_shuffle_epi8(0xffffffffffffffffull, _mm512_maskz_broadcast_i32x4(kAll16, bytes),
                                                    _mm512_load_si512(kCodes16<BITS>.shuffle));
    return _mm512_and_si512(_mm512_maskz_srlv_epi32(kAll16, lanes, _mm512_load_si512(kCodes16<BITS>.shift)),
                            _mm512_set1_epi32((1 << BITS) - 1));
  }
}

/// A scale or bias of storage type SDT widened to float (affine_run's loads, the type fixed).
template <DType SDT>
[[gnu::always_inline]] inline float scale_f32(const void* p, std::int64_t i) {
  if constexpr (SDT == DType::f32) return static_cast<const float*>(p)[i];
  else if constexpr (SDT == DType::f64) return static_cast<float>(static_cast<const double*>(p)[i]);
  else if constexpr (SDT == DType::bf16) return half::bf16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
  else return half::f16_to_f32(static_cast<const std::uint16_t*>(p)[i]);
}

/// One affine value, round(s * q) + b, as dequantize() and MLX compute it (the product is kept
/// out of an FMA).
template <int BITS>
[[gnu::always_inline]] inline float affine_value(const std::uint8_t* row, std::int64_t row_bytes, float s, float b,
                                                 std::int64_t c) {
  return rounded(s * static_cast<float>(QuantMath::code(row, c, BITS, row_bytes))) + b;
}

/// Values c .. gend of one group (scale s, bias b) into out, eight at a time from a multiple of 8,
/// the rest one at a time; c and out advance. Shared by both vector widths of affine_run.
template <int BITS>
[[gnu::target("avx2"), gnu::always_inline]] inline void affine_run8(const std::uint8_t* row, std::int64_t row_bytes,
                                                                   float s, float b, std::int64_t& c, std::int64_t gend,
                                                                   float*& out) {
  for (; c < gend && c % 8 != 0; ++c) *out++ = affine_value<BITS>(row, row_bytes, s, b, c);
  const __m256 vs = _mm256_set1_ps(s), vb = _mm256_set1_ps(b);
  for (; c + 8 <= gend; c += 8, out += 8) {
    __m256 p = _mm256_mul_ps(vs, _mm256_cvtepi32_ps(codes8<BITS>(row, static_cast<std::uint64_t>(c))));
    asm("" : "+x"(p));
    _mm256_storeu_ps(out, _mm256_add_ps(p, vb));
  }
  for (; c < gend; ++c) *out++ = affine_value<BITS>(row, row_bytes, s, b, c);
}

/// out[0, n) = W[r, c0 .. c0 + n) of an affine matrix in float32 (row: row r's codes; scales and
/// biases: row r's), the code width and the scales' storage fixed at compile time, so that a run
/// over many groups pays for no dispatch per group: the AVX-512 form decodes 16 codes a vector
/// (from a multiple of 8, after affine_run8's scalar head), the AVX2 form 8.
template <int BITS, DType SDT>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_run_avx512(const std::uint8_t* row, std::int64_t row_bytes,
                                                               const void* scales, const void* biases,
                                                               std::int64_t group, std::int64_t c, std::int64_t n,
                                                               float* out) {
  const std::int64_t end = c + n;
  for (std::int64_t g = c / group; c < end; ++g) {  // one division per run, none per group
    const std::int64_t gend = std::min(end, (g + 1) * group);
    const float s = scale_f32<SDT>(scales, g), b = scale_f32<SDT>(biases, g);
    for (; c < gend && c % 8 != 0; ++c) *out++ = affine_value<BITS>(row, row_bytes, s, b, c);
    const __m512 vs = _mm512_set1_ps(s), vb = _mm512_set1_ps(b);
    for (; c + 16 <= gend; c += 16, out += 16) {
      __m512 p = _mm512_mul_ps(vs, _mm512_maskz_cvtepi32_ps(kAll16, codes16<BITS>(row, static_cast<std::uint64_t>(c))));
      asm("" : "+v"(p));
      _mm512_storeu_ps(out, _mm512_add_ps(p, vb));
    }
    affine_run8<BITS>(row, row_bytes, s, b, c, gend, out);
  }
}
template <int BITS, DType SDT>
[[gnu::target("avx2")]] inline void affine_run_avx2(const std::uint8_t* row, std::int64_t row_bytes, const void* scales,
                                                    const void* biases, std::int64_t group, std::int64_t c,
                                                    std::int64_t n, float* out) {
  const std::int64_t end = c + n;
  for (std::int64_t g = c / group; c < end; ++g) {
    const std::int64_t gend = std::min(end, (g + 1) * group);
    affine_run8<BITS>(row, row_bytes, scale_f32<SDT>(scales, g), scale_f32<SDT>(biases, g), c, gend, out);
  }
}

/// Calls f.template operator()<SDT>() for a scale storage type (f32, f64, bf16, f16).
template <class F>
inline decltype(auto) with_scale_dtype(DType t, F&& f) {
  switch (t) {
    case DType::f32: return f.template operator()<DType::f32>();
    case DType::f64: return f.template operator()<DType::f64>();
    case DType::bf16: return f.template operator()<DType::bf16>();
    default: return f.template operator()<DType::f16>();
  }
}
#endif

/// Reads a quantized matrix's values in T: the decoding every CPU quantized kernel shares.
/// Values are scale * q + bias (affine) or scale * E2M1[q] / E4M3[q] (the fp modes), in T's
/// arithmetic.
template <class T>
struct QuantReader {
  const std::uint8_t* codes;  // row r's bit stream at codes + r * row_bytes
  std::int64_t row_bytes, groups_per_row;
  const void* scales;
  const void* biases;
  DType sdt;
  Quant q;

  QuantReader(const Tensor& wq, const Tensor& s, const Tensor& b, const Quant& quant)
      : codes(static_cast<const std::uint8_t*>(wq.raw())),
        row_bytes(wq.dim(1) * 4),
        groups_per_row(s.dim(1)),
        scales(s.raw()),
        biases(b.defined() ? b.raw() : nullptr),
        sdt(s.dtype()),
        q(quant) {}

  /// The same matrix from row r0 on, its rows r0.. read as rows 0..: a block of rows, no copy
  /// (linear_cross_entropy's vocabulary blocks).
  QuantReader rows_from(std::int64_t r0) const {
    QuantReader r = *this;
    const std::int64_t skip = r0 * groups_per_row * static_cast<std::int64_t>(dtype_size(sdt));
    r.codes += r0 * row_bytes;
    r.scales = static_cast<const char*>(scales) + skip;
    if (biases) r.biases = static_cast<const char*>(biases) + skip;
    return r;
  }

  /// out[i * stride] = W[r, c0 + i] for i < n.
  void run(std::int64_t r, std::int64_t c0, std::int64_t n, T* out, std::int64_t stride) const {
    const std::uint8_t* row = codes + r * row_bytes;
    const std::int64_t end = c0 + n;
#if defined(NN_QUANT_AVX2)
    // affine float32 into a contiguous run (every GEMM packer and streamed product): one dispatch
    // per call on the code width, the scales' type and the vector width, none per group.
    if constexpr (std::is_same_v<T, float>) {
      if (stride == 1 && q.mode == QuantMode::affine && quant_avx2()) {
        const bool wide512 = quant_avx512();
        const void* s = static_cast<const char*>(scales) + r * groups_per_row * dtype_size(sdt);
        const void* b = static_cast<const char*>(biases) + r * groups_per_row * dtype_size(sdt);
        with_code_bits(q.bits, [&]<int BITS>() {
          with_scale_dtype(sdt, [&]<DType SDT>() {
            if (wide512) affine_run_avx512<BITS, SDT>(row, row_bytes, s, b, q.group, c0, n, out);
            else affine_run_avx2<BITS, SDT>(row, row_bytes, s, b, q.group, c0, n, out);
          });
        });
        return;
      }
    }
    // mxfp4 and nvfp4 float32 into a contiguous run: whole runs of 8 codes inside a group go
    // eight at a time (mxfp8's E4M3 bytes take the scalar loop).
    const bool wide = std::is_same_v<T, float> && stride == 1 && quant_fp(q.mode) && q.bits == 4 && quant_avx2();
#endif
    for (std::int64_t c = c0; c < end;) {
      const std::int64_t g = c / q.group, gend = std::min(end, (g + 1) * q.group);
      const std::int64_t si = r * groups_per_row + g;
      const bool fp = quant_fp(q.mode), fp4 = fp && q.bits == 4;
      const std::uint8_t sb = fp ? static_cast<const std::uint8_t*>(scales)[si] : 0;
      const T s = !fp                          ? widen_scale<T>(scales, sdt, si)
                  : q.mode == QuantMode::nvfp4 ? static_cast<T>(QuantMath::e4m3(sb))
                                               : QuantMath::e8m0<T>(sb);
      const T b = fp ? T(0) : widen_scale<T>(biases, sdt, si);
#if defined(NN_QUANT_AVX2)
      if (wide && c % 8 == 0 && gend - c >= 8) {
        if constexpr (std::is_same_v<T, float>) {
          const std::int64_t n8 = (gend - c) / 8 * 8;
          decode8_e2m1(row, static_cast<std::uint64_t>(c), static_cast<std::uint64_t>(n8), s, out);
          c += n8;
          out += n8;
        }
      }
#endif
      if (fp4) {
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>(QuantMath::e2m1(QuantMath::code(row, c, 4, row_bytes)));
      } else if (fp) {  // mxfp8: a byte per code
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>(QuantMath::e4m3(row[c]));
      } else if (q.bits == 4) {  // the common case: two codes a byte
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>((row[c >> 1] >> ((c & 1) * 4)) & 15u) + b;
      } else if (q.bits == 8) {
        for (; c < gend; ++c, out += stride) *out = s * static_cast<T>(row[c]) + b;
      } else {
        for (; c < gend; ++c, out += stride)
          *out = s * static_cast<T>(QuantMath::code(row, c, q.bits, row_bytes)) + b;
      }
    }
  }
};

}  // namespace detail

/// mx.quantize(w, group_size, bits, mode), bit for bit (MLX 0.32.4's CPU kernel): w (rows, cols)
/// float32, bfloat16, float16 (or float64, quantized in double), cols a multiple of the group.
/// Affine, per group of `group` values along a row, in float32:
///   scale = max((max - min) / (2^bits - 1), 1e-7), negated unless |min| > |max|;
///   edge = min or max (whichever is larger in magnitude); q0 = rint(edge / scale);
///   if q0 != 0: scale = edge / q0, bias = edge (so the edge value is exact), else bias = 0;
///   q = clamp(rint((w - bias) / scale), 0, 2^bits - 1); scales and biases stored in w's dtype.
/// mxfp4: e = the smallest integer with 2^e >= amax / 6 (0 for a zero group), codes the nearest
/// E2M1 value of w / 2^e (the first in {+0, .5, ..., 6, -0, -.5, ..., -6} on a tie), scale byte
/// e + 127. mxfp8: the same with amax / 448 and E4M3 codes (round to nearest even, saturating).
/// nvfp4: scale = E4M3(amax / 6), codes the nearest E2M1 value of w / scale (MLX's global scale
/// is not supported). The fp modes' divisions are computed in w's dtype, as MLX does.
inline QuantizedMatrix quantize(const Tensor& w, Quant q = Quant::affine()) {
  detail::check_quant(q, "quantize");
  if (!w.defined() || w.rank() != 2)
    detail::fail("quantize", "needs a (rows, cols) matrix, got ", w.defined() ? w.shape().str() : std::string("none"));
  const DType dt = w.dtype();
  if (dt != DType::f32 && dt != DType::f64 && dt != DType::bf16 && dt != DType::f16)
    detail::fail("quantize", "only float matrices can be quantized, got ", dtype_name(dt), " ", w.shape().str());
  if (w.device() != Device::cpu) detail::fail("quantize", "runs on the host; the matrix is on ", w.device());
  const std::int64_t rows = w.dim(0), cols = w.dim(1);
  if (cols % q.group != 0)
    detail::fail("quantize", "the last dimension of ", w.shape().str(), " is not a multiple of the group size ",
                 q.group);
  if (cols * q.bits % 32 != 0)
    detail::fail("quantize", "a row of ", cols, " ", q.bits, "-bit codes does not fill whole 32-bit words");
  QuantizedMatrix out;
  out.q = q;
  out.weight = Tensor::zeros(Shape{rows, cols * q.bits / 32}, DType::u32);
  const std::int64_t groups = cols / q.group;
  out.scales = Tensor::empty(Shape{rows, groups}, quant_fp(q.mode) ? DType::u8 : dt);
  if (q.mode == QuantMode::affine) out.biases = Tensor::empty(Shape{rows, groups}, dt);
  auto* codes = static_cast<std::uint8_t*>(out.weight.raw());
  const std::int64_t row_bytes = cols * q.bits / 8;
  auto put_code = [&](std::int64_t r, std::int64_t c, std::uint32_t v) {
    detail::QuantMath::put_code(codes + r * row_bytes, c, q.bits, v);
  };
  auto store = [&](Tensor& t, std::int64_t i, double v) { detail::store_from_double(t.raw(), t.dtype(), i, v); };
  std::vector<double> g(static_cast<std::size_t>(q.group));
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t gi = 0; gi < groups; ++gi) {
      for (std::int64_t j = 0; j < q.group; ++j) g[static_cast<std::size_t>(j)] = detail::load_as_double(w.raw(), dt, r * cols + gi * q.group + j);
      const std::int64_t si = r * groups + gi;
      if (quant_fp(q.mode)) {
        using M = detail::QuantMath;
        std::uint8_t& byte = static_cast<std::uint8_t*>(out.scales.raw())[si];
        double p = 0;  // the divisor of an E2M1 code
        if (q.mode == QuantMode::nvfp4) {
          byte = M::nvfp4_scale_byte(g.data(), q.group, dt);
          p = dt == DType::f64 ? static_cast<double>(M::e4m3(byte)) : M::in(dt, M::e4m3(byte));
        } else {
          const std::int32_t e = M::mx_exponent(g.data(), q.group, dt, q.mode == QuantMode::mxfp8 ? 448.0f : 6.0f);
          byte = M::mxfp4_byte(e);
          if (q.mode == QuantMode::mxfp8) {
            for (std::int64_t j = 0; j < q.group; ++j) put_code(r, gi * q.group + j, M::mxfp8_code(g[static_cast<std::size_t>(j)], e, dt));
            continue;
          }
          p = dt == DType::f64 ? std::ldexp(1.0, e) : M::in(dt, std::ldexp(1.0f, e));
        }
        for (std::int64_t j = 0; j < q.group; ++j) put_code(r, gi * q.group + j, M::e2m1_code(g[static_cast<std::size_t>(j)], p, dt));
        continue;
      }
      if (dt == DType::f64) {
        const auto p = detail::QuantMath::affine_params<double>(g.data(), q.group, q.bits);
        for (std::int64_t j = 0; j < q.group; ++j)
          put_code(r, gi * q.group + j, detail::QuantMath::affine_code<double>(g[static_cast<std::size_t>(j)], p, q.bits));
        store(out.scales, si, p.scale);
        store(out.biases, si, p.bias);
      } else {
        // float32 arithmetic on the (exactly widened) values, as MLX's kernel
        const auto p = detail::QuantMath::affine_params<float>(g.data(), q.group, q.bits);
        for (std::int64_t j = 0; j < q.group; ++j)
          put_code(r, gi * q.group + j,
                   detail::QuantMath::affine_code<float>(static_cast<float>(g[static_cast<std::size_t>(j)]), p, q.bits));
        store(out.scales, si, p.scale);  // a float widened to double: store rounds it to dt once
        store(out.biases, si, p.bias);
      }
    }
  return out;
}

/// quantize(w, Quant{mode, group, bits}).
inline QuantizedMatrix quantize(const Tensor& w, int group, int bits, QuantMode mode = QuantMode::affine) {
  return quantize(w, Quant{mode, group, bits});
}

/// mx.dequantize, bit for bit: affine gives the scales' dtype, computed as MLX does in it
/// (scale * q rounded to that dtype, then + bias rounded); the fp modes give `out` (float32 by
/// default; MLX's is bfloat16) = code value * scale, the scale first rounded to `out`: E2M1[q] *
/// 2^(e - 127) (mxfp4), E4M3[q] * 2^(e - 127) (mxfp8), E2M1[q] * E4M3[s] (nvfp4). float64
/// scales dequantize in double.
inline Tensor dequantize(const Tensor& wq, const Tensor& scales, const Tensor& biases, Quant q,
                         DType out = DType::f32) {
  const std::int64_t cols = detail::check_quantized(wq, scales, biases, q, "dequantize");
  const std::int64_t rows = wq.dim(0);
  if (q.mode == QuantMode::affine) out = scales.dtype();
  else if (out != DType::f32 && out != DType::f64 && out != DType::bf16 && out != DType::f16)
    detail::fail("dequantize", quant_mode_name(q.mode), " dequantizes to a float dtype, not ", dtype_name(out));
  Tensor y = Tensor::empty(Shape{rows, cols}, out);
  if (out == DType::f64) {
    detail::QuantReader<double> rd(wq, scales, biases, q);
    for (std::int64_t r = 0; r < rows; ++r) rd.run(r, 0, cols, y.data<double>() + r * cols, 1);
    return y;
  }
  const auto* codes = static_cast<const std::uint8_t*>(wq.raw());
  const std::int64_t row_bytes = wq.dim(1) * 4, groups = cols / q.group;
  for (std::int64_t r = 0; r < rows; ++r)
    for (std::int64_t c = 0; c < cols; ++c) {
      const std::uint32_t code = detail::QuantMath::code(codes + r * row_bytes, c, q.bits, row_bytes);
      const std::int64_t si = r * groups + c / q.group;
      float v;
      if (quant_fp(q.mode)) {
        using M = detail::QuantMath;
        const std::uint8_t sb = scales.data<std::uint8_t>()[si];
        const float s = detail::round_to(out, q.mode == QuantMode::nvfp4 ? M::e4m3(sb) : M::e8m0<float>(sb));
        const float c = q.mode == QuantMode::mxfp8 ? M::e4m3(code) : M::e2m1(code);
        v = detail::round_to(out, detail::rounded(c * s));
      } else {
        const float s = detail::widen_scale<float>(scales.raw(), out, si), b = detail::widen_scale<float>(biases.raw(), out, si);
        const float p = detail::round_to(out, detail::rounded(static_cast<float>(code) * s));
        v = detail::round_to(out, p + b);
      }
      if (out == DType::bf16 && std::isnan(v))  // MLX's float -> bfloat16 makes every NaN 0x7fc0
        static_cast<std::uint16_t*>(y.raw())[r * cols + c] = 0x7fc0;
      else detail::store_from_double(y.raw(), out, r * cols + c, v);
    }
  return y;
}

inline Tensor dequantize(const QuantizedMatrix& m, DType out = DType::f32) {
  return dequantize(m.weight, m.scales, m.biases, m.q, out);
}

}  // namespace nn
// ---- end nn/quant.hpp ----
// ---- begin nn/random.hpp ----
// Counter-based random numbers that reproduce MLX's generator bit for bit (keys, split, bits,
// uniform, normal, bernoulli, the global seed sequence) and the initialisers MLX's layers use.
//
// The algorithm, as MLX implements it (mlx/random.cpp, mlx/backend/cpu/primitives.cpp
// RandomBits, checked against mlx 0.32.4 by tests/random/ on fixtures from tests/oracle/gen_random.py):
//  * a key is a uint32 tensor of shape (2): key(seed) = [seed >> 32, seed & 0xffffffff];
//  * the hash is Threefry-2x32 with 20 rounds (Salmon et al. 2011; JAX's jep/263 variant);
//  * bits(n words, key): with h = n / 2 and o = n % 2, pair j < h hashes the counter
//    (j, h + o + j) and writes its two halves to words j and h + o + j; an odd n's middle word
//    h is the first half of hash(key, (h, 0)). The layout depends on n, so the first words of a
//    7-element draw differ from those of an 8-element draw from the same key;
//  * split(key, num) = bits((num, 2), key); split(key) = rows 0 and 1 of split(key, 2);
//  * uniform float32 in [0, 1): u = min(float(word) / 2^32, 1 - 2^-24) (float(word) rounds to
//    nearest, so words near 2^32 become 1 and are clipped), then low + (high - low) * u, each
//    operation rounded to float32 on its own (MLX runs them as separate ops: no fused multiply-add);
//    bfloat16/float16: the same float32 u clipped to the largest value below 1 of that type, cast,
//    then range * u + low in that type;
//  * normal: e = erfinv(uniform(nextafter(-1, 0), 1)) in float32 (Juffa's erfinvf polynomials,
//    as MLX's CPU kernel; its logf is the C library's, as in MLX's x86 build), cast to the
//    dtype, times sqrt(2) [* scale], [+ loc], each op rounded in the dtype;
//  * bernoulli(p): uniform float32 [0, 1) < float32(p);
//  * the global sequence (KeySequence::next): state = key(seed); each draw without a key takes
//    (state, k) = split(state) and uses k.

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>



namespace nn::random {

namespace detail {

NN_HD constexpr std::uint32_t rotl32(std::uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/// Threefry-2x32, 20 rounds: the block cipher behind every MLX random number.
NN_HD constexpr void threefry2x32(std::uint32_t k0, std::uint32_t k1, std::uint32_t c0, std::uint32_t c1,
                                         std::uint32_t& out0, std::uint32_t& out1) {
  const std::uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  constexpr int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  std::uint32_t x0 = c0 + ks[0], x1 = c1 + ks[1];
  for (int i = 0; i < 5; ++i) {  // five groups of four rounds, a key injection after each
    for (int r : rot[i % 2]) {
      x0 += x1;
      x1 = rotl32(x1, r);
      x1 ^= x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<std::uint32_t>(i + 1);
  }
  out0 = x0;
  out1 = x1;
}

/// How many hash calls an n-word stream takes: one per pair, plus one for an odd middle word.
NN_HD constexpr std::int64_t bits_blocks(std::int64_t n) { return n / 2 + n % 2; }

/// Hash call j of an n-word stream (0 <= j < bits_blocks(n)): calls emit(index, word) for the one
/// or two words it produces. Blocks are independent, so a kernel may run them in any order or in
/// parallel and still lay the words out as MLX's RandomBits does.
template <class Emit>
NN_HD constexpr void bits_block(std::uint32_t k0, std::uint32_t k1, std::int64_t n, std::int64_t j, Emit&& emit) {
  const std::int64_t h = n / 2, o = n % 2;
  std::uint32_t a = 0, b = 0;
  if (j < h) {
    // MLX's counters are 32-bit: a stream past 2^32 words would wrap, as MLX's does.
    threefry2x32(k0, k1, static_cast<std::uint32_t>(j), static_cast<std::uint32_t>(h + o + j), a, b);
    emit(j, a);
    emit(h + o + j, b);
  } else {
    threefry2x32(k0, k1, static_cast<std::uint32_t>(h), 0u, a, b);
    emit(h, a);
  }
}

/// Writes the n words MLX's bits(n, key) produces.
inline void fill_bits(std::uint32_t k0, std::uint32_t k1, std::uint32_t* out, std::int64_t n) {
  const std::int64_t blocks = bits_blocks(n);
  for (std::int64_t j = 0; j < blocks; ++j) bits_block(k0, k1, n, j, [out](std::int64_t i, std::uint32_t w) { out[i] = w; });
}

/// MLX's float32 uniform in [0, 1) from one word. Dividing by float(2^32 - 1), which is 2^32,
/// is an exact scaling, so this is the same float on every IEEE machine.
NN_HD inline float uniform01(std::uint32_t w) {
  const float u = static_cast<float>(w) * 0x1p-32f;
  return u < 0x1.fffffep-1f ? u : 0x1.fffffep-1f;
}

/// A value forced to its own rounding: keeps the compiler from contracting a * b + c into one
/// fused multiply-add (which rounds once), since MLX multiplies and adds as separate ops.
template <class T>
inline T rounded(T v) {
  volatile T r = v;
  return r;
}

/// erfinv in float32 as MLX's CPU kernel computes it (Norbert Juffa's erfinvf polynomials, fma
/// at every step, logf from the C library), so normal() draws MLX's values bit for bit.
inline float erfinv_f32(float a) {
  float t = std::fma(a, 0.0f - a, 1.0f);
  t = std::log(t);
  float p;
  if (std::abs(t) > 6.125f) {  // the tails
    p = 3.03697567e-10f;
    p = std::fma(p, t, 2.93243101e-8f);
    p = std::fma(p, t, 1.22150334e-6f);
    p = std::fma(p, t, 2.84108955e-5f);
    p = std::fma(p, t, 3.93552968e-4f);
    p = std::fma(p, t, 3.02698812e-3f);
    p = std::fma(p, t, 4.83185798e-3f);
    p = std::fma(p, t, -2.64646143e-1f);
    p = std::fma(p, t, 8.40016484e-1f);
  } else {  // the centre
    p = 5.43877832e-9f;
    p = std::fma(p, t, 1.43285448e-7f);
    p = std::fma(p, t, 1.22774793e-6f);
    p = std::fma(p, t, 1.12963626e-7f);
    p = std::fma(p, t, -5.61530760e-5f);
    p = std::fma(p, t, -1.47697632e-4f);
    p = std::fma(p, t, 2.31468678e-3f);
    p = std::fma(p, t, 1.15392581e-2f);
    p = std::fma(p, t, -2.32015476e-1f);
    p = std::fma(p, t, 8.86226892e-1f);
  }
  return a * p;
}

/// Arithmetic "in dtype t": the result of a float (or double) computation rounded to t, as MLX
/// computes bfloat16/float16 ops in float32 and rounds each result.
inline double round_to(DType t, double v) {
  switch (t) {
    case DType::f32: return static_cast<float>(v);
    case DType::bf16: return half::bf16_to_f32(half::f32_to_bf16(static_cast<float>(v)));
    case DType::f16: return half::f16_to_f32(half::f32_to_f16(static_cast<float>(v)));
    default: return v;
  }
}

/// The largest value below 1 in a float dtype: where MLX clips u so that the cast cannot reach 1.
inline float below_one(DType t) {
  switch (t) {
    case DType::bf16: return half::bf16_to_f32(0x3F7F);  // 1 - 2^-8
    case DType::f16: return half::f16_to_f32(0x3BFF);    // 1 - 2^-11
    default: return 0x1.fffffep-1f;                      // 1 - 2^-24
  }
}

inline void require_key(const Tensor& key, const char* op) {
  if (!key.defined()) nn::detail::fail(op, "the key is an empty tensor");
  if (key.dtype() != DType::u32 || !(key.shape() == Shape{2}))
    nn::detail::fail(op, "a key is a uint32 tensor of shape (2) (as mx.random.key), got ", dtype_name(key.dtype()),
                     " ", key.shape().str());
  if (key.device() != Device::cpu) nn::detail::fail(op, "the key lives on ", key.device(), "; copy it to the host first");
}

inline void require_float_dtype(DType t, const char* op) {
  if (!is_floating(t)) nn::detail::fail(op, "needs a floating dtype, got ", dtype_name(t));
}

/// The process-wide key sequence. MLX seeds it from the clock when the program never calls
/// seed(); so does this one, so an unseeded run is not silently reproducible either.
struct GlobalState {
  std::mutex mu;
  std::uint32_t k0 = 0, k1 = 0;
  GlobalState() {
    const auto ms = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                   std::chrono::system_clock::now().time_since_epoch())
                                                   .count());
    k0 = static_cast<std::uint32_t>(ms >> 32);
    k1 = static_cast<std::uint32_t>(ms);
  }
};
inline GlobalState& global_state() {
  static GlobalState g;
  return g;
}

}  // namespace detail

/// A key from a seed, as mx.random.key: uint32 (2) = [seed >> 32, seed & 0xffffffff].
inline Tensor key(std::uint64_t seed) {
  return Tensor::from<std::uint32_t>({2}, {static_cast<std::uint32_t>(seed >> 32), static_cast<std::uint32_t>(seed)});
}

/// Random uint32 words of `shape` from `key`, as MLX's random::bits (width 4). Without a key the
/// global sequence supplies one (see next_key).
inline Tensor bits(const Shape& shape, std::optional<Tensor> key = std::nullopt);

/// `num` new keys from `key`, as mx.random.split(key, num): uint32 (num, 2).
inline Tensor split(const Tensor& key, int num) {
  detail::require_key(key, "random.split");
  if (num < 0) nn::detail::fail("random.split", "num must be >= 0, got ", num);
  return bits(Shape{num, 2}, key);
}

/// Row i of a (num, 2) key table from split(key, num), as a key of shape (2).
inline Tensor subkey(const Tensor& keys, std::int64_t i) {
  if (keys.dtype() != DType::u32 || keys.rank() != 2 || keys.dim(1) != 2)
    nn::detail::fail("random.subkey", "expects the uint32 (num, 2) table split() returns, got ", dtype_name(keys.dtype()),
                     " ", keys.shape().str());
  if (i < 0 || i >= keys.dim(0)) nn::detail::fail("random.subkey", "row ", i, " is out of range for ", keys.shape().str());
  const std::uint32_t* p = keys.data<std::uint32_t>() + 2 * i;
  return Tensor::from<std::uint32_t>({2}, {p[0], p[1]});
}

/// The two keys MLX's split(key) returns (rows 0 and 1 of split(key, 2)).
inline std::pair<Tensor, Tensor> split(const Tensor& key) {
  Tensor two = split(key, 2);
  return {subkey(two, 0), subkey(two, 1)};
}

// ---- the process-wide default sequence ---------------------------------------------------------
// This is the library's one piece of global state. The eager functions below and the initialisers
// read it, and GTape::random_key()/refresh_keys() use it only to fill key input slots; no op ever
// reads it (a dropout on a tape takes its key as an input), so a tape's nodes stay pure data.

/// Seeds the global sequence: state = key(s), as mx.random.seed(s).
inline void seed(std::uint64_t s) {
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  g.k0 = static_cast<std::uint32_t>(s >> 32);
  g.k1 = static_cast<std::uint32_t>(s);
}

/// next_key() written into an existing uint32 (2) tensor: no allocation (a compiled step's
/// replay refills its key slots with it).
inline void next_key_into(Tensor& dst) {
  detail::require_key(dst, "random.next_key_into");
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  std::uint32_t w[4];
  detail::fill_bits(g.k0, g.k1, w, 4);
  g.k0 = w[0];
  g.k1 = w[1];
  std::uint32_t* d = dst.data<std::uint32_t>();
  d[0] = w[2];
  d[1] = w[3];
}

/// The key the next keyless draw uses: (state, k) = split(state); returns k. MLX's
/// KeySequence::next, which every MLX random call without a key makes once.
inline Tensor next_key() {
  Tensor k = Tensor::empty(Shape{2}, DType::u32);
  next_key_into(k);
  return k;
}

/// A copy of the global key (mx.random.state[0]), e.g. to save it in a checkpoint.
inline Tensor state() {
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  return Tensor::from<std::uint32_t>({2}, {g.k0, g.k1});
}

/// Restores a key saved by state().
inline void set_state(const Tensor& key) {
  detail::require_key(key, "random.set_state");
  const std::uint32_t* p = key.data<std::uint32_t>();
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  g.k0 = p[0];
  g.k1 = p[1];
}

namespace detail {
/// The explicit key, or the global sequence's next one.
inline std::pair<std::uint32_t, std::uint32_t> resolve(const std::optional<Tensor>& key, const char* op) {
  Tensor k = key ? *key : next_key();
  require_key(k, op);
  const std::uint32_t* p = k.data<std::uint32_t>();
  return {p[0], p[1]};
}
/// Float32 uniforms in [0, 1), clipped below 1 in `t` (not yet cast), one per element of shape.
inline std::vector<float> uniform01_all(const Shape& shape, DType t, const std::optional<Tensor>& key, const char* op) {
  auto [k0, k1] = resolve(key, op);
  std::vector<std::uint32_t> w(static_cast<std::size_t>(shape.numel()));
  fill_bits(k0, k1, w.data(), shape.numel());
  const float top = below_one(t);
  std::vector<float> u(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) u[i] = std::min(uniform01(w[i]), top);
  return u;
}
}  // namespace detail

inline Tensor bits(const Shape& shape, std::optional<Tensor> key) {
  auto [k0, k1] = detail::resolve(key, "random.bits");
  Tensor out = Tensor::empty(shape, DType::u32);
  detail::fill_bits(k0, k1, out.data<std::uint32_t>(), shape.numel());
  return out;
}

/// Uniform samples in [low, high) as mx.random.uniform(low, high, shape, dtype, key). float32,
/// bfloat16 and float16 are MLX's values bit for bit. float64 (which MLX refuses) is the float32
/// u of the same key mapped in double: low + (high - low) * u.
inline Tensor uniform(const Shape& shape, double low = 0.0, double high = 1.0, DType dtype = DType::f32,
                      std::optional<Tensor> key = std::nullopt) {
  detail::require_float_dtype(dtype, "random.uniform");
  std::vector<float> u = detail::uniform01_all(shape, dtype, key, "random.uniform");
  // low and high become arrays of the dtype first (MLX's astype), then range = high - low in it.
  const double lo = detail::round_to(dtype, low), hi = detail::round_to(dtype, high);
  const double range = detail::round_to(dtype, hi - lo);
  Tensor out = Tensor::empty(shape, dtype);
  for (std::size_t i = 0; i < u.size(); ++i) {
    const auto idx = static_cast<std::int64_t>(i);
    if (dtype == DType::f32) {
      const float prod = detail::rounded(static_cast<float>(range) * u[i]);
      out.data<float>()[i] = prod + static_cast<float>(lo);
    } else if (dtype == DType::f64) {
      const double prod = detail::rounded(range * static_cast<double>(u[i]));
      out.data<double>()[i] = prod + lo;
    } else {  // bf16 / f16: u cast to the type, then each op rounded to it
      const double uc = detail::round_to(dtype, u[i]);
      const double prod = detail::round_to(dtype, detail::rounded(static_cast<float>(range) * static_cast<float>(uc)));
      nn::detail::store_from_double(out.raw(), dtype, idx, static_cast<float>(prod) + static_cast<float>(lo));
    }
  }
  return out;
}

/// Normal samples as mx.random.normal(shape, dtype, loc, scale, key): erfinv of a float32 uniform
/// in (-1, 1), cast to dtype, times sqrt(2) * scale, plus loc. Like MLX's C++ API, scale == 1 and
/// loc == 0 are not applied at all (Python's loc=None / scale=None).
inline Tensor normal(const Shape& shape, DType dtype = DType::f32, double loc = 0.0, double scale = 1.0,
                     std::optional<Tensor> key = std::nullopt) {
  detail::require_float_dtype(dtype, "random.normal");
  // The uniform MLX draws here is float32 in [nextafter(-1, 0), 1): range 2 exactly (the float32
  // sum 1 + (1 - 2^-24) rounds to 2), so u' = 2u + low needs no care about fused rounding.
  std::vector<float> u = detail::uniform01_all(shape, DType::f32, key, "random.normal");
  const float lo = std::nextafter(-1.0f, 0.0f);
  const float range = 1.0f - lo;
  // sqrt(2) [* scale] is one value of the dtype, computed before it meets the samples.
  double mul = detail::round_to(dtype, std::sqrt(2.0));
  if (scale != 1.0) mul = detail::round_to(dtype, mul * detail::round_to(dtype, scale));
  const double loc_t = detail::round_to(dtype, loc);
  Tensor out = Tensor::empty(shape, dtype);
  for (std::size_t i = 0; i < u.size(); ++i) {
    const float s = detail::rounded(range * u[i]) + lo;
    const double e = detail::round_to(dtype, detail::erfinv_f32(s));
    double v;
    if (dtype == DType::f64) v = detail::rounded(mul * e);
    else v = detail::round_to(dtype, detail::rounded(static_cast<float>(mul) * static_cast<float>(e)));
    if (loc != 0.0) {
      if (dtype == DType::f64) v = loc_t + v;
      else v = detail::round_to(dtype, static_cast<float>(loc_t) + static_cast<float>(v));
    }
    nn::detail::store_from_double(out.raw(), dtype, static_cast<std::int64_t>(i), v);
  }
  return out;
}

/// A uint8 mask of `shape`, 1 with probability p, as mx.random.bernoulli(p, shape, key):
/// uniform float32 [0, 1) < float32(p).
inline Tensor bernoulli(double p, const Shape& shape, std::optional<Tensor> key = std::nullopt) {
  std::vector<float> u = detail::uniform01_all(shape, DType::f32, key, "random.bernoulli");
  const float pf = static_cast<float>(p);
  Tensor out = Tensor::empty(shape, DType::u8);
  for (std::size_t i = 0; i < u.size(); ++i) out.data<std::uint8_t>()[i] = u[i] < pf ? 1 : 0;
  return out;
}

}  // namespace nn::random

namespace nn::init {

/// Initial weights of MLX's nn.Linear(in, out, bias): weight (out, in) then bias (out), both
/// uniform in [-s, s) with s = sqrt(1 / in) (computed in double, as Python does), each drawn
/// with the global sequence's next key, in that order.
struct LinearInit {
  Tensor weight;  // (out, in)
  Tensor bias;    // (out), undefined when bias is false
};
/// The bias draw alone (what linear() draws second): uniform (out) in [-sqrt(1/in), sqrt(1/in)).
inline Tensor linear_bias(std::int64_t in, std::int64_t out) {
  if (in <= 0 || out <= 0) nn::detail::fail("init.linear", "dims must be positive, got in=", in, " out=", out);
  const double s = std::sqrt(1.0 / static_cast<double>(in));
  return random::uniform({out}, -s, s);
}
inline LinearInit linear(std::int64_t in, std::int64_t out, bool bias = true) {
  if (in <= 0 || out <= 0) nn::detail::fail("init.linear", "dims must be positive, got in=", in, " out=", out);
  const double s = std::sqrt(1.0 / static_cast<double>(in));
  LinearInit r;
  r.weight = random::uniform({out, in}, -s, s);
  if (bias) r.bias = linear_bias(in, out);
  return r;
}

/// Initial weight of MLX's nn.Embedding(num, dims): normal (num, dims) with scale sqrt(1 / dims).
inline Tensor embedding(std::int64_t num, std::int64_t dims) {
  if (num <= 0 || dims <= 0) nn::detail::fail("init.embedding", "dims must be positive, got ", num, " x ", dims);
  return random::normal({num, dims}, DType::f32, 0.0, std::sqrt(1.0 / static_cast<double>(dims)));
}

/// mlx-lm's LoRALinear factors: lora_a (in, r) uniform in [-s, s) with s = 1 / sqrt(in) (note:
/// not sqrt(1 / in) as nn.Linear), lora_b (r, out) zeros.
struct LoraInit {
  Tensor lora_a;  // (in, r)
  Tensor lora_b;  // (r, out)
};
/// As LoRALinear(in, out, r) / LoRALinear.from_base(linear, r) draw: LoRALinear.__init__ first
/// builds an inner nn.Linear(in, out, bias=False) (one draw, which from_base then discards), and
/// only then draws lora_a. That first key is consumed here too, so every later draw of the
/// program stays in step with mlx-lm.
inline LoraInit lora(std::int64_t in, std::int64_t out, std::int64_t r) {
  if (in <= 0 || out <= 0 || r <= 0)
    nn::detail::fail("init.lora", "dims must be positive, got in=", in, " out=", out, " r=", r);
  (void)random::next_key();  // the inner nn.Linear's weight
  const double s = 1.0 / std::sqrt(static_cast<double>(in));
  return {random::uniform({in, r}, -s, s), Tensor::zeros({r, out})};
}

}  // namespace nn::init
// ---- end nn/random.hpp ----
// ---- begin nn/resources.hpp ----
// What the process holds: its resident memory now and at its peak, as the kernel counts it
// (Linux's /proc/self/status; -1 where there is none). The benches print them, and the finetune
// program checks that a quantized base loads without a float copy of its matrices.

#include <cstdlib>
#include <fstream>
#include <string>

namespace nn {

/// A "<field>: <n> kB" line of /proc/self/status in kB (VmRSS: resident now; VmHWM: the peak so
/// far), or -1 when the file or the field is missing.
inline long proc_status_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + key.size());
  return -1;
}
inline long rss_kb() { return proc_status_kb("VmRSS"); }
inline long peak_rss_kb() { return proc_status_kb("VmHWM"); }

}  // namespace nn
// ---- end nn/resources.hpp ----
// ---- begin nn/backend/cpu.hpp ----
// nn::cpu: the host backend policy. Elementwise kernels are plain loops (OpenMP when built with
// it); GEMM runs on nn's own engine (backend/gemm.hpp, kernels chosen by CPUID features), or on
// CBLAS (OpenBLAS) when NN_USE_BLAS is defined and that BLAS picked real kernels for this CPU, or
// on Eigen's GEMM with NN_GEMM_EIGEN (and compilers without GCC vector extensions). Either way
// nn's OpenMP threads do the splitting (omp_set_num_threads / OMP_NUM_THREADS set the count).
//
// The kernels live in backend/cpu/, one file per family, mirroring ops/: elementwise, reduce,
// matmul (and the GEMM engine), shape, index, random, softmax, cross_entropy, and the fused
// norm, rope, attention and glu, the fused elementwise groups (fused), and optim (the optimizer updates). Per-element math both
// backends share is in backend/math.hpp. nn::cpu gathers the families by inheritance, so
// `cpu::matmul(...)` and `B::matmul(...)` in a template both find them.
//
// Each family is a class template with one instance (`template <class = void> struct
// NormKernelsT`, `using NormKernels = NormKernelsT<>`): its kernels are then compiled only in a
// file that calls one, not in every file that includes this header. That is what lets a program
// built with NN_PRECOMPILED (nn/precompiled.hpp) compile them once, in nn::precompiled.

// ---- begin nn/backend/cpu/common.hpp ----
// What every family of nn::cpu's kernels shares: dtype dispatch, the OpenMP loop helpers,
// broadcasting strides, and the vectorised row math (Eigen array maps, exp, exact sqrt).

#include <cctype>
#include <cmath>
#include <limits>
#include <numbers>
#include <new>

#include <Eigen/Core>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__SSE2__) || defined(__AVX__)
#include <immintrin.h>
#endif

// ---- begin nn/backend/simd.hpp ----
// The float32 row math of the CPU kernels (exp above all: softmax, cross-entropy, attention,
// SwiGLU) on vectors as wide as the CPU's, picked at run time from CPUID feature bits like the
// GEMM's micro-kernels (gemm.hpp): one body per row function, compiled for AVX-512, for AVX2 + FMA
// and for the compiler's baseline (SSE2 on x86-64) into every binary. The kernels ran Eigen's
// vectorised expressions before, whose width is fixed by the flags the user's own file is compiled
// with: SSE2 without -march, so a plain CMake build of the finetune ran its exps at a quarter of
// an AVX-512 machine's width (perf: Eigen's pexp_float<__m128> 6.6% and the cross-entropy vjp 8.3%
// of the decoder's LoRA step, against 2.5% for that vjp built -march=native).
//
// The formulas stay in backend/math.hpp: SwiGluMath and SoftmaxMath are templates over the value
// type, and this header makes its lane vectors one of them (v_exp takes them through
// detail::simd_exp, is_lane_vector, scalar_of). float64 keeps Eigen's expressions.
//
// Each row function gives every element the same lane arithmetic wherever it sits (a partial last
// vector is computed whole and stored in part), so results do not depend on a row's length or
// alignment; they may differ between kernel sets in the last bit (FMA contraction), as the GEMM's
// do. NN_CPU_ISA=avx2|generic runs a lower set (cpu_info.hpp).

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>


#if defined(__CUDACC__)
// Under nvcc the formulas of math.hpp are __host__ __device__, and nvcc rejects (and at times
// crashes on) GCC vector types in them even where only the host calls them. The CPU kernels a .cu
// file compiles (the CUDA tests' CPU references) run these rows one element at a time instead,
// with the same formulas; an inline namespace keeps their names apart from the lane versions that
// g++ compiles into the other files of the same program.
namespace nn::simd {
inline namespace scalar_rows {
inline void exp_inplace(float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = x[i] < -88.72f ? 0.0f : detail::m_exp(x[i]);
}
inline float max(const float* x, std::int64_t n) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) m = x[i] > m ? x[i] : m;
  return m;
}
inline float sum_exp(const float* x, std::int64_t n, float m) {
  float s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += detail::m_exp(x[i] - m);
  return s;
}
inline void ce_grad(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {
  for (std::int64_t i = 0; i < n; ++i) o[i] = detail::SoftmaxMath::ce_grad(x[i], lse, g) + (acc ? o[i] : 0.0f);
}
inline void swiglu(const float* a, const float* u, float* y, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] = detail::SwiGluMath::y(a[i], u[i]);
}
inline void swiglu_vjp(const float* a, const float* u, const float* g, float* da, bool acc_a, float* du, bool acc_u,
                       std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) {
    const float s = detail::SwiGluMath::sig(a[i]);
    if (da) da[i] = detail::SwiGluMath::dgate(a[i], u[i], g[i], s) + (acc_a ? da[i] : 0.0f);
    if (du) du[i] = detail::SwiGluMath::dup(a[i], g[i], s) + (acc_u ? du[i] : 0.0f);
  }
}
inline float scale_max(float* x, std::int64_t n, float sc) {
  float m = -std::numeric_limits<float>::infinity();
  for (std::int64_t i = 0; i < n; ++i) m = (x[i] *= sc) > m ? x[i] : m;
  return m;
}
inline float exp_sum(float* x, std::int64_t n, float m) {
  float s = 0;
  for (std::int64_t i = 0; i < n; ++i) s += (x[i] = x[i] - m < -88.72f ? 0.0f : detail::m_exp(x[i] - m));
  return s;
}
inline void probs_from_lse(float* x, std::int64_t n, float sc, float lse) {
  for (std::int64_t i = 0; i < n; ++i) x[i] = detail::SoftmaxMath::p_from_lse(x[i] * sc, lse);
}
inline void softmax_vjp(const float* p, float* d, std::int64_t n, float dot, float sc) {
  for (std::int64_t i = 0; i < n; ++i) d[i] = detail::SoftmaxMath::vjp(p[i], d[i], dot) * sc;
}
inline void adam(float* p, const float* g, float* m, float* v, std::int64_t n, const detail::AdamMath<float>& f) {
  for (std::int64_t i = 0; i < n; ++i) {
    m[i] = f.m(m[i], g[i]);
    v[i] = f.v(v[i], g[i]);
    p[i] = (f.decoupled ? p[i] * f.decay : p[i]) - f.delta(m[i], std::sqrt(v[i]));
  }
}
}  // namespace scalar_rows
}  // namespace nn::simd
#else

// -Wpsabi: every function here that takes or returns a lane vector is inlined into a kernel
// compiled for that vector's instruction set (as in math.hpp), so no call changes its ABI. GCC
// reports the note where the translation unit ends, past any pop, so it stays off from here on.
#if defined(__clang__)
#pragma clang diagnostic ignored "-Wpsabi"
#elif defined(__GNUC__)
#pragma GCC diagnostic ignored "-Wpsabi"
#endif

namespace nn {

namespace simd {

/// W float32 lanes (W = 4, 8, 16: SSE2, AVX2, AVX-512) and their int32 counterparts. (Spelled
/// out per W: GCC drops a vector_size attribute whose size depends on a template parameter.)
template <int W>
struct lane_types;
#define NN_SIMD_LANE_TYPES(W)                                                             \
  template <>                                                                             \
  struct lane_types<W> {                                                                  \
    typedef float f __attribute__((vector_size(W * sizeof(float))));                      \
    typedef std::int32_t i __attribute__((vector_size(W * sizeof(float))));               \
  };
NN_SIMD_LANE_TYPES(4)
NN_SIMD_LANE_TYPES(8)
NN_SIMD_LANE_TYPES(16)
#undef NN_SIMD_LANE_TYPES
template <int W>
using Vf = typename lane_types<W>::f;
template <int W>
using Vi = typename lane_types<W>::i;

template <class V>
inline constexpr int lanes = static_cast<int>(sizeof(V) / sizeof(float));

// x86 with GCC: AVX-512's and AVX's own max / min and AVX-512's scalef, spelled as GCC's builtins
// (an intrinsic is a function compiled for its own ISA, which GCC will not inline into exp, a
// template compiled for none; a builtin is expanded where exp lands, inside a kernel of that ISA).
#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__) && !defined(__clang__)
#define NN_SIMD_X86_BUILTINS 1
#endif

/// min(hi, max(lo, x)) lane by lane, a NaN lane of x kept (x86's max / min return their second
/// operand where either is NaN, as `lo > x ? lo : x` does): one instruction a bound on AVX2 and
/// AVX-512 where GCC spells the conditional as a compare and a blend.
template <class V>
[[gnu::always_inline]] inline V clamp(V x, float lo, float hi) {
#if defined(NN_SIMD_X86_BUILTINS)
  if constexpr (lanes<V> == 16)
    return __builtin_ia32_minps512_mask(V{} + hi, __builtin_ia32_maxps512_mask(V{} + lo, x, V{}, 0xffff, 4), V{},
                                        0xffff, 4);
  else if constexpr (lanes<V> == 8)
    return __builtin_ia32_minps256(V{} + hi, __builtin_ia32_maxps256(V{} + lo, x));
#endif
  const V xl = (V{} + lo) > x ? (V{} + lo) : x;
  return (V{} + hi) < xl ? (V{} + hi) : xl;
}

/// sqrt of each lane, correctly rounded (IEEE's sqrt, as CUDA's: the optimizers' square roots).
template <class V>
[[gnu::always_inline]] inline V sqrt(V x) {
#if defined(NN_SIMD_X86_BUILTINS)
  if constexpr (lanes<V> == 16) return __builtin_ia32_sqrtps512_mask(x, V{}, 0xffff, 4);
  else if constexpr (lanes<V> == 8) return __builtin_ia32_sqrtps256(x);
  else return __builtin_ia32_sqrtps(x);
#else
  for (int l = 0; l < lanes<V>; ++l) x[l] = std::sqrt(x[l]);
  return x;
#endif
}

/// exp of each lane: Cephes' expf. n = round(x log2(e)), r = x - n ln 2 (ln 2 in two parts,
/// exact products), e^r by a degree-5 polynomial on |r| <= ln(2)/2, times 2^n built in the exponent
/// field in two halves (2^(n/2) 2^(n - n/2): no half is denormal or overflows). About 1 ulp, as
/// Eigen's and glibc's. x < -88.72 gives exactly 0 (where exp is 0 or a denormal: an additively
/// masked score, -1e9, contributes nothing, as layers/mask.hpp promises), x > 88.72 gives +inf,
/// NaN stays NaN.
///
/// AVX-512 multiplies by 2^n with one vscalefps (y 2^n rounded once, which is what the two
/// halves give: the first product is exact, the second rounds) in place of nine integer and float
/// instructions: the same bits for every float (a sweep of every 7th bit pattern, NaNs, infinities
/// and denormals included, found none apart), 16.3 -> 10.9 cycles a vector in a row's sum of
/// exps (Xeon family 6 model 167). tests/backend/simd.test.cpp holds the kernel sets to each other.
template <class V>
[[gnu::always_inline]] inline V exp(V x) {
  using I = Vi<lanes<V>>;
  constexpr float kLo = -88.72f, kHi = 88.72f;
  // clamped, one bound at a time; NaN lanes stay NaN
  const V xc = clamp(x, kLo, kHi);
  // n = x log2(e) rounded to the nearest integer: adding 1.5 * 2^23 leaves n in the low bits of
  // the mantissa (|n| <= 128), and subtracting it again gives n as a float
  constexpr float kRound = 12582912.0f;
  const V t = xc * 1.44269504088896341f + kRound, fn = t - kRound;
  const V r = (xc - fn * 0.693359375f) - fn * -2.12194440e-4f;
  const V r2 = r * r;
  V y = (V{} + 1.9875691500e-4f);
  y = y * r + 1.3981999507e-3f;
  y = y * r + 8.3334519073e-3f;
  y = y * r + 4.1665795894e-2f;
  y = y * r + 1.6666665459e-1f;
  y = y * r + 5.0000001201e-1f;
  y = y * r2 + r + 1.0f;
#if defined(NN_SIMD_X86_BUILTINS)
  if constexpr (lanes<V> == 16) {
    y = __builtin_ia32_scalefps512_mask(y, fn, V{}, 0xffff, 4);  // y 2^fn (fn is integral)
  } else
#endif
  {
    I n;
    std::memcpy(&n, &t, sizeof(V));
    n -= 0x4B400000;  // kRound's bits
    const I n1 = n >> 1, n2 = n - n1;
    const I b1 = (n1 + 127) << 23, b2 = (n2 + 127) << 23;
    V p1, p2;
    std::memcpy(&p1, &b1, sizeof(V));
    std::memcpy(&p2, &b2, sizeof(V));
    y = (y * p1) * p2;
  }
  y = x < kLo ? V{} : y;
  return x > kHi ? (V{} + std::numeric_limits<float>::infinity()) : y;
}

/// Lanes [0, n) of V from p, the rest 0 (a row's partial last vector).
template <class V>
[[gnu::always_inline]] inline V load_part(const float* p, std::int64_t n) {
  V v{};
  std::memcpy(&v, p, sizeof(float) * static_cast<std::size_t>(n));
  return v;
}
template <class V>
[[gnu::always_inline]] inline V load(const float* p) {
  V v;
  std::memcpy(&v, p, sizeof(V));
  return v;
}
template <class V>
[[gnu::always_inline]] inline void store(float* p, V v, std::int64_t n = lanes<V>) {
  std::memcpy(p, &v, sizeof(float) * static_cast<std::size_t>(n));
}

/// f(i, m) for each vector of a row of n, m the number of its lanes in the row (W but for the last).
template <class V, class F>
[[gnu::always_inline]] inline void for_vectors(std::int64_t n, F&& f) {
  constexpr int W = lanes<V>;
  std::int64_t i = 0;
  for (; i + W <= n; i += W) f(i, std::int64_t{W});
  if (i < n) f(i, n - i);
}

/// Lanes summed in a fixed order (lane 0 first).
template <class V>
[[gnu::always_inline]] inline float hsum(V v) {
  float s = 0;
  for (int l = 0; l < lanes<V>; ++l) s += v[l];
  return s;
}

// ---- the row functions: one body each, over V ------------------------------------------------

template <class V>
[[gnu::always_inline]] inline void exp_inplace_body(float* x, std::int64_t n) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    store(x + i, exp(m == lanes<V> ? load<V>(x + i) : load_part<V>(x + i, m)), m);
  });
}

/// max_j sc x_j (-inf for n = 0; NaN lanes lose to numbers, as Eigen's maxCoeff), storing each
/// sc x_j to y unless y is null (an attention tile's scores scaled in place; sc = 1 is exact).
template <class V>
[[gnu::always_inline]] inline float max_body(const float* x, std::int64_t n, float sc, float* y) {
  V mv = (V{} + -std::numeric_limits<float>::infinity());
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    V v = (m == lanes<V> ? load<V>(x + i) : load_part<V>(x + i, m)) * sc;
    if (y) store(y + i, v, m);
    if (m < lanes<V>)
      for (int l = static_cast<int>(m); l < lanes<V>; ++l) v[l] = -std::numeric_limits<float>::infinity();
    mv = v > mv ? v : mv;
  });
  float r = mv[0];
  for (int l = 1; l < lanes<V>; ++l) r = mv[l] > r ? mv[l] : r;
  return r;
}

/// sum_j exp(x_j - m), two vectors of partial sums, storing each exp(x_j - m) to y unless y is
/// null (an online softmax's tile of probabilities, not yet normalised).
template <class V>
[[gnu::always_inline]] inline float sum_exp_body(const float* x, std::int64_t n, float m, float* y) {
  constexpr int W = lanes<V>;
  V s0{}, s1{};
  std::int64_t i = 0;
  for (; i + 2 * W <= n; i += 2 * W) {
    const V e0 = exp(load<V>(x + i) - m), e1 = exp(load<V>(x + i + W) - m);
    if (y) {
      store(y + i, e0);
      store(y + i + W, e1);
    }
    s0 += e0;
    s1 += e1;
  }
  for (; i < n; i += W) {
    const std::int64_t k = std::min<std::int64_t>(W, n - i);
    V e = exp((k == W ? load<V>(x + i) : load_part<V>(x + i, k)) - m);
    if (y) store(y + i, e, k);
    for (std::int64_t l = k; l < W; ++l) e[l] = 0;
    s0 += e;
  }
  return hsum<V>(s0 + s1);
}

/// o (+)= SoftmaxMath::ce_grad(x, lse, g) = g exp(x - lse).
template <class V>
[[gnu::always_inline]] inline void ce_grad_body(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    V v = detail::SoftmaxMath::ce_grad(full ? load<V>(x + i) : load_part<V>(x + i, m), lse, g);
    if (acc) v += full ? load<V>(o + i) : load_part<V>(o + i, m);
    store(o + i, v, m);
  });
}

/// x = SoftmaxMath::p_from_lse(sc x, lse) = exp(sc x - lse) in place: a tile's probabilities
/// recomputed from its raw scores and the forward's log-sum-exp.
template <class V>
[[gnu::always_inline]] inline void probs_from_lse_body(float* x, std::int64_t n, float sc, float lse) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const V v = m == lanes<V> ? load<V>(x + i) : load_part<V>(x + i, m);
    store(x + i, detail::SoftmaxMath::p_from_lse(v * sc, lse), m);
  });
}

/// d = SoftmaxMath::vjp(p, d, dot) sc = p (d - dot) sc in place: a tile's score gradients.
template <class V>
[[gnu::always_inline]] inline void softmax_vjp_body(const float* p, float* d, std::int64_t n, float dot, float sc) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    const V pv = full ? load<V>(p + i) : load_part<V>(p + i, m), dv = full ? load<V>(d + i) : load_part<V>(d + i, m);
    store(d + i, detail::SoftmaxMath::vjp(pv, dv, dot) * sc, m);
  });
}

/// y = SwiGluMath::y(a, u).
template <class V>
[[gnu::always_inline]] inline void swiglu_body(const float* a, const float* u, float* y, std::int64_t n) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    const V av = full ? load<V>(a + i) : load_part<V>(a + i, m), uv = full ? load<V>(u + i) : load_part<V>(u + i, m);
    store(y + i, detail::SwiGluMath::y(av, uv), m);
  });
}

/// da (+)= SwiGluMath::dgate, du (+)= SwiGluMath::dup (either may be null).
template <class V>
[[gnu::always_inline]] inline void swiglu_vjp_body(const float* a, const float* u, const float* g, float* da,
                                                   bool acc_a, float* du, bool acc_u, std::int64_t n) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t m) __attribute__((always_inline)) {
    const bool full = m == lanes<V>;
    const auto in = [&](const float* p) __attribute__((always_inline)) { return full ? load<V>(p + i) : load_part<V>(p + i, m); };
    const V av = in(a), uv = in(u), gv = in(g), s = detail::SwiGluMath::sig(av);
    if (da) store(da + i, detail::SwiGluMath::dgate(av, uv, gv, s) + (acc_a ? in(da) : V{}), m);
    if (du) store(du + i, detail::SwiGluMath::dup(av, gv, s) + (acc_u ? in(du) : V{}), m);
  });
}

/// One Adam / AdamW step over a run of parameters (AdamMath: m, v, then p, decayed when decoupled,
/// less delta(m, sqrt v)), in one pass: each value is read and written once. Its entry points are
/// compiled without FMA contraction: every product and sum rounds on its own, as MLX's and
/// PyTorch's updates do, so float32 trajectories stay bit for bit MLX's
/// (tests/optim/mlx_trajectory.test.cpp) at every kernel set. (As Eigen passes over
/// 4096-value chunks -- m, v, sqrt, decay, delta -- the five arrays' chunks did not fit in L1 and
/// the update took 12.5 ms for the decoder's 7M parameters against 8.8 ms in one pass, Xeon
/// family 6 model 167; and it ran at the build's width, SSE2 in a plain build.)
template <class V>
[[gnu::always_inline]] inline void adam_body(float* p, const float* g, float* m, float* v, std::int64_t n,
                                             const detail::AdamMath<float>& f) {
  for_vectors<V>(n, [&](std::int64_t i, std::int64_t k) __attribute__((always_inline)) {
    const bool full = k == lanes<V>;
    const auto in = [&](const float* q) __attribute__((always_inline)) { return full ? load<V>(q + i) : load_part<V>(q + i, k); };
    const V gv = in(g), mv = f.m(in(m), gv), vv = f.v(in(v), gv), pv = in(p);
    store(m + i, mv, k);
    store(v + i, vv, k);
    store(p + i, (f.decoupled ? pv * f.decay : pv) - f.delta(mv, simd::sqrt(vv)), k);
  });
}

// ---- one entry point per kernel set, and the dispatch ----------------------------------------

// Each set's functions call the bodies above with its own vector width; the bodies are inlined
// into them and so compiled for that set's instructions.
#define NN_SIMD_ENTRIES(SUFFIX, W, ATTR)                                                                       \
  ATTR inline void exp_inplace_##SUFFIX(float* x, std::int64_t n) { exp_inplace_body<Vf<W>>(x, n); }            \
  ATTR inline float max_##SUFFIX(const float* x, std::int64_t n) {                                            \
    return max_body<Vf<W>>(x, n, 1.0f, nullptr);                                                               \
  }                                                                                                            \
  ATTR inline float sum_exp_##SUFFIX(const float* x, std::int64_t n, float m) {                                \
    return sum_exp_body<Vf<W>>(x, n, m, nullptr);                                                              \
  }                                                                                                            \
  ATTR inline void ce_grad_##SUFFIX(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {   \
    ce_grad_body<Vf<W>>(x, n, lse, g, o, acc);                                                                 \
  }                                                                                                            \
  ATTR inline float scale_max_##SUFFIX(float* x, std::int64_t n, float sc) {                                  \
    return max_body<Vf<W>>(x, n, sc, x);                                                                       \
  }                                                                                                            \
  ATTR inline float exp_sum_##SUFFIX(float* x, std::int64_t n, float m) {                                      \
    return sum_exp_body<Vf<W>>(x, n, m, x);                                                                    \
  }                                                                                                            \
  ATTR inline void probs_from_lse_##SUFFIX(float* x, std::int64_t n, float sc, float lse) {                    \
    probs_from_lse_body<Vf<W>>(x, n, sc, lse);                                                                 \
  }                                                                                                            \
  ATTR inline void softmax_vjp_##SUFFIX(const float* p, float* d, std::int64_t n, float dot, float sc) {       \
    softmax_vjp_body<Vf<W>>(p, d, n, dot, sc);                                                                 \
  }                                                                                                            \
  ATTR inline void swiglu_##SUFFIX(const float* a, const float* u, float* y, std::int64_t n) {                 \
    swiglu_body<Vf<W>>(a, u, y, n);                                                                            \
  }                                                                                                            \
  ATTR inline void swiglu_vjp_##SUFFIX(const float* a, const float* u, const float* g, float* da, bool acc_a,   \
                                       float* du, bool acc_u, std::int64_t n) {                                \
    swiglu_vjp_body<Vf<W>>(a, u, g, da, acc_a, du, acc_u, n);                                                  \
  }                                                                                                            \
  ATTR [[gnu::optimize("fp-contract=off")]] inline void adam_##SUFFIX(                                         \
      float* p, const float* g, float* m, float* v, std::int64_t n, const detail::AdamMath<float>& f) {       \
    adam_body<Vf<W>>(p, g, m, v, n, f);                                                                        \
  }

NN_SIMD_ENTRIES(generic, 4, )
#if defined(__x86_64__) || defined(__i386__)
NN_SIMD_ENTRIES(avx2, 8, [[gnu::target("avx2,fma")]])
NN_SIMD_ENTRIES(avx512, 16, [[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]])
#define NN_SIMD_DISPATCH(name, ...)                                         \
  switch (detail::active_isa()) {                                           \
    case Isa::avx512: return name##_avx512(__VA_ARGS__);                    \
    case Isa::avx2: return name##_avx2(__VA_ARGS__);                        \
    case Isa::generic: break;                                               \
  }                                                                         \
  return name##_generic(__VA_ARGS__);
#else
#define NN_SIMD_DISPATCH(name, ...) return name##_generic(__VA_ARGS__);
#endif
#undef NN_SIMD_ENTRIES

/// x = exp(x) in place (exp above: exact 0 below -88.72).
inline void exp_inplace(float* x, std::int64_t n) { NN_SIMD_DISPATCH(exp_inplace, x, n) }
/// max_j x_j (-inf for an empty row).
inline float max(const float* x, std::int64_t n) { NN_SIMD_DISPATCH(max, x, n) }
/// sum_j exp(x_j - m).
inline float sum_exp(const float* x, std::int64_t n, float m) { NN_SIMD_DISPATCH(sum_exp, x, n, m) }
/// o (+)= g exp(x - lse): cross-entropy's row gradient (SoftmaxMath::ce_grad), before the target's -g.
inline void ce_grad(const float* x, std::int64_t n, float lse, float g, float* o, bool acc) {
  NN_SIMD_DISPATCH(ce_grad, x, n, lse, g, o, acc)
}
/// x *= sc in place; returns the row's max (-inf for an empty row).
inline float scale_max(float* x, std::int64_t n, float sc) { NN_SIMD_DISPATCH(scale_max, x, n, sc) }
/// x = exp(x - m) in place (exact 0 below -88.72, as exp_inplace); returns sum_j x_j.
inline float exp_sum(float* x, std::int64_t n, float m) { NN_SIMD_DISPATCH(exp_sum, x, n, m) }
/// x = exp(sc x - lse) in place (SoftmaxMath::p_from_lse of the scaled scores).
inline void probs_from_lse(float* x, std::int64_t n, float sc, float lse) {
  NN_SIMD_DISPATCH(probs_from_lse, x, n, sc, lse)
}
/// d = p (d - dot) sc in place (SoftmaxMath::vjp, scaled).
inline void softmax_vjp(const float* p, float* d, std::int64_t n, float dot, float sc) {
  NN_SIMD_DISPATCH(softmax_vjp, p, d, n, dot, sc)
}
/// y = silu(a) u (SwiGluMath::y).
inline void swiglu(const float* a, const float* u, float* y, std::int64_t n) { NN_SIMD_DISPATCH(swiglu, a, u, y, n) }
/// da (+)= SwiGluMath::dgate, du (+)= SwiGluMath::dup; a null output is skipped.
inline void swiglu_vjp(const float* a, const float* u, const float* g, float* da, bool acc_a, float* du, bool acc_u,
                       std::int64_t n) {
  NN_SIMD_DISPATCH(swiglu_vjp, a, u, g, da, acc_a, du, acc_u, n)
}
/// One Adam / AdamW step over n parameters (adam_body).
inline void adam(float* p, const float* g, float* m, float* v, std::int64_t n, const detail::AdamMath<float>& f) {
  NN_SIMD_DISPATCH(adam, p, g, m, v, n, f)
}
#undef NN_SIMD_DISPATCH

}  // namespace simd

namespace detail {
// backend/math.hpp's formulas on lane vectors: v_exp takes them to simd::exp, and their scalar is
// float.
#define NN_SIMD_LANE_VECTOR(W)                               \
  template <>                                                 \
  struct is_lane_vector<simd::Vf<W>> : std::true_type {};     \
  template <>                                                 \
  struct scalar_of<simd::Vf<W>, void> {                       \
    using type = float;                                       \
  };
NN_SIMD_LANE_VECTOR(4)
NN_SIMD_LANE_VECTOR(8)
NN_SIMD_LANE_VECTOR(16)
#undef NN_SIMD_LANE_VECTOR
template <class V>
[[gnu::always_inline]] inline V simd_exp(V x) {
  return simd::exp(x);
}
}  // namespace detail

}  // namespace nn
#endif  // __CUDACC__
// ---- end nn/backend/simd.hpp ----
// ---- begin nn/backend/threads.hpp ----
// nn's thread teams: every parallel region nn opens goes through team(), which runs it on OpenMP
// threads and notices when the machine's other work keeps those threads from running together.
//
// Why: an OpenMP team is as fast as its slowest thread. On a machine doing something else, a
// thread that shares its core with a busy process is off the CPU half the time, and every region
// (a step opens thousands) waits for it at its barriers: measured on 2 cores with one busy
// process at `nice -n 0`, two threads ran the finetune step at 0.07x of their idle speed, where
// one thread ran at 0.57x (bench/run_contention.sh; PyTorch, whose OpenMP team has the same
// problem, 0.12x). So nn measures it: at the end of each region every thread of the team asks
// the kernel how long it waited, runnable, for a core since its last region (its run-queue
// delay, read only after an involuntary context switch). The longest of those waits stalled the
// whole team at its barriers; when they add up to more than a fifth of a 50 ms window, the team
// is too big for the cores free now, and it gets one thread fewer for a back-off period (0.25 s,
// doubling while the probes at full size that follow find the same, up to 8 s), after which it
// is allowed its full size again. Neither lateness nor the count of preemptions would do: an
// idle virtual CPU can take milliseconds to wake a sleeping thread, and an idle machine's
// kernel threads preempt nn's for microseconds dozens of times a second. An idle machine
// shrinks nothing, and pays two clock reads per region and one getrusage per thread per region.
//
// The results do not depend on it: every parallel product and loop in nn is bit-identical for
// any team size. NN_ADAPTIVE_THREADS=0 in the environment (or set_adaptive_threads(false)) turns
// it off: teams are then always omp_get_max_threads() large.

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(__linux__)
#include <fcntl.h>
#include <sys/resource.h>
#include <unistd.h>
#endif

namespace nn {
namespace detail {

/// The shared record of how long teams lose to the scheduler, and the current cap on team size
/// (one per process).
/// Times are steady-clock nanoseconds, passed in so that tests can drive it.
class TeamLoad {
 public:
  static constexpr std::int64_t kWindowNs = 50'000'000;  // judged every 50 ms of regions
  static constexpr double kLostShare = 0.2;               // more than 20% of it waiting for a core: too big
  static constexpr std::int64_t kFirstBackoffNs = 250'000'000, kMaxBackoffNs = 8'000'000'000;

  static TeamLoad& get() {
    static TeamLoad s;
    return s;
  }
  static std::int64_t now_ns() {
    return std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
        .count();
  }

  /// How many threads a region may use at `now`, out of `max` (omp_get_max_threads()).
  int allowed(int max, std::int64_t now = now_ns()) {
    if (!enabled_.load(std::memory_order_relaxed) || max <= 1) return max;
    const int cap = cap_.load(std::memory_order_relaxed);
    if (cap == 0) return max;
    if (now < until_.load(std::memory_order_relaxed)) return std::min(max, cap);
    // The back-off is over: probe the full team for one window (a window that loses as much
    // again doubles the next back-off; a clean one resets it).
    std::lock_guard<std::mutex> lock(mu_);
    if (cap_.load(std::memory_order_relaxed) != 0) {
      cap_.store(0, std::memory_order_relaxed);
      probing_ = true;
      window_start_ = 0;
    }
    return max;
  }

  /// Records one region of `threads` threads, ending at `now`, that lost `lost_ns` to the
  /// scheduler (the longest any of its threads waited for a core since its previous region).
  void observe(int threads, std::int64_t lost_ns, std::int64_t now = now_ns()) {
    if (threads <= 1 || !enabled_.load(std::memory_order_relaxed)) return;
    std::lock_guard<std::mutex> lock(mu_);
    if (window_start_ == 0) {
      window_start_ = now;
      lost_ = 0;
    }
    lost_ += lost_ns;
    const std::int64_t elapsed = now - window_start_;
    if (elapsed < kWindowNs) return;
    if (static_cast<double>(lost_) > kLostShare * static_cast<double>(elapsed)) {
      backoff_ = probing_ ? std::min(backoff_ * 2, kMaxBackoffNs) : kFirstBackoffNs;
      until_.store(now + backoff_, std::memory_order_relaxed);
      cap_.store(std::max(1, threads - 1), std::memory_order_relaxed);
      reductions_.fetch_add(1, std::memory_order_relaxed);
    } else if (probing_) {
      backoff_ = kFirstBackoffNs;  // a clean window at full size
    }
    probing_ = false;
    window_start_ = 0;
  }

  /// Turns it on or off, forgetting what was seen so far.
  void set_enabled(bool on) {
    std::lock_guard<std::mutex> lock(mu_);
    enabled_.store(on, std::memory_order_relaxed);
    cap_.store(0, std::memory_order_relaxed);
    probing_ = false;
    window_start_ = 0;
    backoff_ = kFirstBackoffNs;
  }
  bool enabled() const { return enabled_.load(std::memory_order_relaxed); }
  /// How many times a team was made smaller since the process started.
  std::int64_t reductions() const { return reductions_.load(std::memory_order_relaxed); }
  /// The current cap on team size (0: none).
  int cap() const { return cap_.load(std::memory_order_relaxed); }

 private:
  TeamLoad() {
    const char* v = std::getenv("NN_ADAPTIVE_THREADS");
    enabled_.store(!(v && std::strcmp(v, "0") == 0), std::memory_order_relaxed);
  }
  // allowed() reads the cap and its end without the lock: a stale read costs at most one region
  // at the old size.
  std::atomic<bool> enabled_{true};
  std::atomic<int> cap_{0};
  std::atomic<std::int64_t> until_{0}, reductions_{0};
  std::mutex mu_;  // guards the window below
  bool probing_ = false;
  std::int64_t window_start_ = 0, lost_ = 0, backoff_ = kFirstBackoffNs;
};

/// How long the calling thread waited, runnable, for a core since it last asked (ns): the time
/// the scheduler kept it off its core for other work. Asked first of getrusage(RUSAGE_THREAD)
/// (an involuntary context switch since the last call, about 0.3 us), and only then of the
/// kernel's run-queue delay in /proc/thread-self/schedstat (kept open, one pread); where that
/// file is missing, each involuntary switch counts as a 3 ms time slice. 0 without either
/// (teams then keep their size).
inline std::int64_t waited_since_last_asked() {
#if defined(__linux__) && defined(RUSAGE_THREAD)
  struct Mine {
    long switches = -1;
    std::int64_t delay = -1;
    int fd = -2;  // -2: not opened yet, -1: unavailable
    ~Mine() {
      if (fd >= 0) ::close(fd);
    }
  };
  thread_local Mine m;
  rusage u{};
  if (getrusage(RUSAGE_THREAD, &u) != 0) return 0;
  const long switched = m.switches < 0 ? 0 : u.ru_nivcsw - m.switches;
  m.switches = u.ru_nivcsw;
  if (switched <= 0 && m.delay >= 0) return 0;
  if (m.fd == -2) m.fd = ::open("/proc/thread-self/schedstat", O_RDONLY | O_CLOEXEC);
  if (m.fd < 0) return switched * 3'000'000;
  char buf[96];
  const ssize_t n = ::pread(m.fd, buf, sizeof buf - 1, 0);
  if (n <= 0) return switched * 3'000'000;
  buf[n] = 0;
  const char* p = std::strchr(buf, ' ');  // "<run time> <run-queue delay> <slices>"
  if (!p) return switched * 3'000'000;
  const std::int64_t delay = std::strtoll(p + 1, nullptr, 10);
  const std::int64_t waited = m.delay < 0 ? 0 : std::max<std::int64_t>(0, delay - m.delay);
  m.delay = delay;
  return waited;
#else
  return 0;
#endif
}

/// How many threads a parallel region may use now: omp_get_max_threads(), less while the
/// machine's other work keeps a team that size from running together; 1 inside a parallel region
/// or without OpenMP.
inline int free_threads() {
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
  return TeamLoad::get().allowed(omp_get_max_threads());
#else
  return 1;
#endif
}

/// body(t, nt) on a team of up to `threads` OpenMP threads (thread t of nt; the body may hold
/// `#pragma omp for` and `#pragma omp barrier`, which bind to this team), telling TeamLoad how
/// long the scheduler kept one of them off its core. `threads` comes from free_threads() or a
/// size rule capped by it.
template <class F>
void team(int threads, F&& body) {
#if defined(_OPENMP)
  if (threads > 1) {
    const std::int64_t t0 = TeamLoad::now_ns();
    std::atomic<std::int64_t> waited{0};  // the longest any thread of the team waited
    int size = threads;
#pragma omp parallel num_threads(threads)
    {
      const int t = omp_get_thread_num(), nt = omp_get_num_threads();
      if (t == 0) size = nt;
      body(t, nt);
      // A thread kept off its core stalls the whole team at the region's barriers.
      const std::int64_t w = waited_since_last_asked();
      std::int64_t seen = waited.load(std::memory_order_relaxed);
      while (w > seen && !waited.compare_exchange_weak(seen, w, std::memory_order_relaxed)) {
      }
    }
    const std::int64_t t1 = TeamLoad::now_ns();
    TeamLoad::get().observe(size, std::min(waited.load(std::memory_order_relaxed), t1 - t0), t1);
    return;
  }
#else
  (void)threads;  // without OpenMP every team is the calling thread
#endif
  body(0, 1);
}

}  // namespace detail

/// Whether nn shrinks its thread teams while other processes keep them from running together
/// (backend/threads.hpp; on by default, NN_ADAPTIVE_THREADS=0 turns it off). Results are the
/// same either way; only the speed on a shared machine differs.
inline void set_adaptive_threads(bool on) { detail::TeamLoad::get().set_enabled(on); }
inline bool adaptive_threads() { return detail::TeamLoad::get().enabled(); }

}  // namespace nn
// ---- end nn/backend/threads.hpp ----

namespace nn {
namespace detail {

/// Runs f.template operator()<T>() for T = float or double; other dtypes are an error naming op.
template <class F>
void dispatch_float(DType t, const char* op, F&& f) {
  if (t == DType::f32) f.template operator()<float>();
  else if (t == DType::f64) f.template operator()<double>();
  else fail(op, "needs a float32 or float64 tensor, got ", dtype_name(t));
}

/// Runs f.template operator()<Op>() with the Binary op as a compile-time constant: the
/// elementwise loops then inline one operation and vectorise (a switch per element does not).
template <class F>
void dispatch_binary(Binary op, F&& f) {
  switch (op) {
    case Binary::add: f.template operator()<Binary::add>(); return;
    case Binary::sub: f.template operator()<Binary::sub>(); return;
    case Binary::mul: f.template operator()<Binary::mul>(); return;
    case Binary::div: f.template operator()<Binary::div>(); return;
    case Binary::maximum: f.template operator()<Binary::maximum>(); return;
    case Binary::minimum: f.template operator()<Binary::minimum>(); return;
  }
}

/// Runs f.template operator()<Op>() with the Unary op as a compile-time constant (as
/// dispatch_binary): the fused kernel's per-step loops.
template <class F>
void dispatch_unary(Unary op, F&& f) {
  switch (op) {
    case Unary::neg: f.template operator()<Unary::neg>(); return;
    case Unary::exp: f.template operator()<Unary::exp>(); return;
    case Unary::log: f.template operator()<Unary::log>(); return;
    case Unary::sqrt: f.template operator()<Unary::sqrt>(); return;
    case Unary::rsqrt: f.template operator()<Unary::rsqrt>(); return;
    case Unary::tanh: f.template operator()<Unary::tanh>(); return;
    case Unary::sigmoid: f.template operator()<Unary::sigmoid>(); return;
    case Unary::relu: f.template operator()<Unary::relu>(); return;
    case Unary::abs: f.template operator()<Unary::abs>(); return;
    case Unary::pow: f.template operator()<Unary::pow>(); return;
    case Unary::silu: f.template operator()<Unary::silu>(); return;
    case Unary::gelu: f.template operator()<Unary::gelu>(); return;
    case Unary::gelu_approx: f.template operator()<Unary::gelu_approx>(); return;
    case Unary::gelu_fast: f.template operator()<Unary::gelu_fast>(); return;
    case Unary::scale: f.template operator()<Unary::scale>(); return;
    case Unary::add_scalar: f.template operator()<Unary::add_scalar>(); return;
  }
}

// dispatch over every dtype a data-movement kernel handles: floats, plus integers when not
// accumulating (permuting token ids is fine; adding them is not a gradient).
template <class F>
void dispatch_any(DType t, const char* op, bool acc, F&& f) {
  switch (t) {
    case DType::f32: f.template operator()<float>(); return;
    case DType::f64: f.template operator()<double>(); return;
    default: break;
  }
  if (acc) fail(op, "cannot accumulate into ", dtype_name(t));
  switch (dtype_size(t)) {
    case 1: f.template operator()<std::uint8_t>(); return;
    case 2: f.template operator()<std::uint16_t>(); return;
    case 4: f.template operator()<std::uint32_t>(); return;
    default: f.template operator()<std::uint64_t>(); return;
  }
}

/// Reads an integer id tensor (i32 or i64) at i.
inline std::int64_t load_index(const Tensor& ids, std::int64_t i) {
  if (ids.dtype() == DType::i32) return static_cast<const std::int32_t*>(ids.raw())[i];
  return static_cast<const std::int64_t*>(ids.raw())[i];
}

/// Elementwise loops run in parallel only past this size: below it thread start-up costs more
/// than it saves.
inline constexpr std::int64_t kParallelGrain = 1 << 15;

/// f(i) for i in [0, n), split over OpenMP threads when `wide` (the caller's size test against
/// kParallelGrain) holds and more than one thread is free: in equal contiguous shares, or one
/// iteration at a time when `uneven` (iterations of different cost). The test is a C++ branch
/// taken before OpenMP is entered, not an `if` clause: libgomp builds a one-thread team (a malloc
/// and a free) even for `#pragma omp parallel if (false)`, so every small replayed op would allocate.
template <class F>
inline void parallel_for(std::int64_t n, bool wide, F&& f, bool uneven = false) {
#if defined(_OPENMP)
  if (const int threads = wide && n > 1 ? free_threads() : 1; threads > 1) {
    // (maybe_unused: nvcc's front end sees _OPENMP but not the pragma that reads it)
    [[maybe_unused]] const std::int64_t share = uneven ? 1 : (n + threads - 1) / threads;
    team(threads, [&](int, int) {
#pragma omp for schedule(dynamic, share)
      for (std::int64_t i = 0; i < n; ++i) f(i);
    });
    return;
  }
#else
  (void)wide;
  (void)uneven;
#endif
  for (std::int64_t i = 0; i < n; ++i) f(i);
}

/// Whether b is a trailing suffix of y's shape (b repeats along y's leading dims: a bias row).
inline bool is_suffix(const Shape& b, const Shape& y) {
  if (b.rank() > y.rank()) return false;
  for (int i = 1; i <= b.rank(); ++i)
    if (b[b.rank() - i] != y[y.rank() - i]) return false;
  return true;
}

/// Strides (in elements) of `in` seen through output shape `out`: the input is aligned to the
/// right, and a dimension of size 1 (or a missing one) gets stride 0, which is broadcasting.
inline std::array<std::int64_t, kMaxRank> broadcast_strides(const Shape& in, const Shape& out) {
  std::array<std::int64_t, kMaxRank> st{};
  std::int64_t s = 1;
  const int off = out.rank() - in.rank();
  for (int i = in.rank() - 1; i >= 0; --i) {
    st[static_cast<std::size_t>(i + off)] = in[i] == 1 ? 0 : s;
    s *= in[i];
  }
  return st;
}

/// Calls f(out_index, offset_0, offset_1, ...) for every element of `out`, with the offsets of
/// each broadcast input, walking an odometer so no division is needed per element.
template <std::size_t N, class F>
void for_each_broadcast(const Shape& out, const std::array<std::array<std::int64_t, kMaxRank>, N>& strides, F&& f) {
  const int r = out.rank();
  const std::int64_t n = out.numel();
  if (n == 0) return;
  std::array<std::int64_t, kMaxRank> idx{};
  std::array<std::int64_t, N> off{};
  const std::int64_t inner = r ? out[r - 1] : 1;
  for (std::int64_t i = 0; i < n; i += inner) {
    for (std::int64_t j = 0; j < inner; ++j) {
      std::array<std::int64_t, N> o = off;
      if (r)
        for (std::size_t k = 0; k < N; ++k) o[k] += j * strides[k][static_cast<std::size_t>(r - 1)];
      std::apply([&](auto... oo) { f(i + j, oo...); }, o);
    }
    // advance the odometer over dims [0, r-1)
    for (int d = r - 2; d >= 0; --d) {
      auto du = static_cast<std::size_t>(d);
      ++idx[du];
      for (std::size_t k = 0; k < N; ++k) off[k] += strides[k][du];
      if (idx[du] < out[d]) break;
      for (std::size_t k = 0; k < N; ++k) off[k] -= strides[k][du] * out[d];
      idx[du] = 0;
    }
  }
}


/// Splits a reduction of `x` to `y` (y's dims equal x's or 1, right-aligned) into
/// (outer, reduced, inner) when the reduced dims are one contiguous block; false otherwise.
inline bool reduction_as_3d(const Shape& x, const Shape& y, std::int64_t& outer, std::int64_t& red,
                            std::int64_t& inner) {
  const int r = x.rank(), off = x.rank() - y.rank();
  int first = -1, last = -1;
  for (int i = 0; i < r; ++i) {
    std::int64_t yd = i < off ? 1 : y[i - off];
    bool reduced = yd == 1 && x[i] != 1;
    if (reduced) {
      if (first < 0) first = i;
      else if (last != i - 1) return false;
      last = i;
    }
  }
  if (first < 0) { outer = x.numel(); red = 1; inner = 1; return true; }
  outer = x.prod(0, first);
  red = x.prod(first, last + 1);
  inner = x.prod(last + 1, r);
  return true;
}

/// A contiguous run of n values as an Eigen array, for the vectorised math (exp above all) of
/// the row kernels: softmax, cross-entropy, SwiGLU.
template <class T>
using ArrayMap = Eigen::Map<Eigen::Array<T, Eigen::Dynamic, 1>>;
template <class T>
using ConstArrayMap = Eigen::Map<const Eigen::Array<T, Eigen::Dynamic, 1>>;

/// x = exp(x) in place, vectorised, and exact zeros where exp underflows (below -88.72 for float,
/// -709.78 for double), where std::exp gives 0 or a denormal. So an additively masked score (-1e9)
/// still contributes exactly nothing, as layers/mask.hpp promises. float runs simd::exp at the
/// CPU's width; double runs Eigen's exp, which clamps its argument there (~1e-308 past it).
template <class T>
inline void exp_inplace(T* x, std::int64_t n) {
  if constexpr (std::is_same_v<T, float>) {
    simd::exp_inplace(x, n);
  } else {
    constexpr T lo = T(-709.78);
    constexpr std::int64_t blk = 256;
    T in[blk];
    for (std::int64_t i0 = 0; i0 < n; i0 += blk) {
      const std::int64_t len = std::min(blk, n - i0);
      std::copy_n(x + i0, len, in);
      ArrayMap<T>(x + i0, len) = ConstArrayMap<T>(in, len).exp();
      for (std::int64_t j = 0; j < len; ++j) x[i0 + j] = in[j] < lo ? T(0) : x[i0 + j];
    }
  }
}

// The row steps of a softmax (cpu::softmax, flash attention's tiles and their vjp), one pass over
// the row each: float at the CPU's vector width (simd.hpp), double through Eigen.

/// x *= sc in place; returns max_j x_j (-inf for n = 0).
template <class T>
inline T scale_max(T* x, std::int64_t n, T sc) {
  if constexpr (std::is_same_v<T, float>) return simd::scale_max(x, n, sc);
  ArrayMap<T> r(x, n);
  r *= sc;
  return n > 0 ? r.maxCoeff() : -std::numeric_limits<T>::infinity();
}

/// x = exp(x - m) in place (exact zeros where exp underflows, as exp_inplace); returns sum_j x_j.
template <class T>
inline T exp_sum(T* x, std::int64_t n, T m) {
  if constexpr (std::is_same_v<T, float>) return simd::exp_sum(x, n, m);
  ArrayMap<T> r(x, n);
  r -= m;
  exp_inplace(x, n);
  return r.sum();
}

/// x = SoftmaxMath::p_from_lse(sc x, lse) in place: probabilities recomputed from raw scores.
template <class T>
inline void probs_from_lse(T* x, std::int64_t n, T sc, T lse) {
  if constexpr (std::is_same_v<T, float>) return simd::probs_from_lse(x, n, sc, lse);
  ArrayMap<T> r(x, n);
  r = r * sc - lse;
  exp_inplace(x, n);
}

/// d = SoftmaxMath::vjp(p, d, dot) sc in place: score gradients from probabilities p and
/// dot = sum_j p_j d_j.
template <class T>
inline void softmax_vjp_row(const T* p, T* d, std::int64_t n, T dot, T sc) {
  if constexpr (std::is_same_v<T, float>) return simd::softmax_vjp(p, d, n, dot, sc);
  ArrayMap<T> r(d, n);
  r = SoftmaxMath::vjp(ConstArrayMap<T>(p, n), r, dot) * sc;
}

/// row = softmax(scale * row + add) in place (add may be null): max-subtracted, a row whose
/// every entry is -inf kept finite in its max, as cpu::softmax.
template <class T>
inline void softmax_row(T* row, std::int64_t n, T scale, const T* add) {
  ArrayMap<T> r(row, n);
  T m;
  if (add) {
    r = r * scale + ConstArrayMap<T>(add, n);
    m = r.maxCoeff();
  } else {
    m = scale_max(row, n, scale);
  }
  r *= T(1) / exp_sum(row, n, SoftmaxMath::finite_max(m));
}

/// y = sqrt(x), correctly rounded (what std::sqrt gives), vectorised with the x86 sqrt
/// instructions where available. Not Eigen's .sqrt(): under EIGEN_FAST_MATH (its default) the
/// float version is rsqrt plus one Newton step, a few ulp off, and the optimizers' updates must
/// match MLX's to the bit; nor a loop over std::sqrt, which compilers keep scalar for errno.
template <class T>
inline void sqrt_exact(const T* x, T* y, std::int64_t n) {
  std::int64_t i = 0;
#if defined(__AVX__)
  if constexpr (std::is_same_v<T, float>)
    for (; i + 8 <= n; i += 8) _mm256_storeu_ps(y + i, _mm256_sqrt_ps(_mm256_loadu_ps(x + i)));
  else
    for (; i + 4 <= n; i += 4) _mm256_storeu_pd(y + i, _mm256_sqrt_pd(_mm256_loadu_pd(x + i)));
#elif defined(__SSE2__)
  if constexpr (std::is_same_v<T, float>)
    for (; i + 4 <= n; i += 4) _mm_storeu_ps(y + i, _mm_sqrt_ps(_mm_loadu_ps(x + i)));
  else
    for (; i + 2 <= n; i += 2) _mm_storeu_pd(y + i, _mm_sqrt_pd(_mm_loadu_pd(x + i)));
#endif
  for (; i < n; ++i) y[i] = std::sqrt(x[i]);
}

/// Elementwise work over n values in chunks: f(i0, i1) per chunk, the chunks in parallel once n
/// passes kParallelGrain.
inline constexpr std::int64_t kChunk = 4096;
template <class F>
inline void parallel_chunks(std::int64_t n, F&& f) {
  const std::int64_t chunks = (n + kChunk - 1) / kChunk;
  parallel_for(chunks, n > kParallelGrain, [&](std::int64_t c) { f(c * kChunk, std::min(n, (c + 1) * kChunk)); });
}

}  // namespace detail
}  // namespace nn
// ---- end nn/backend/cpu/common.hpp ----
// ---- begin nn/backend/cpu/elementwise.hpp ----
// nn::cpu's elementwise kernels: fill, copy, cast, unary and binary ops (math in ../math.hpp)
// and where, each with its vjp (ops/elementwise.hpp builds the primitives on them).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `ElementwiseKernels` (why: backend/cpu.hpp).
template <class = void>
struct ElementwiseKernelsT {
  static void fill(Tensor& y, double v) {
    if (v == 0.0) { std::memset(y.raw(), 0, y.nbytes()); return; }
    if (y.dtype() == DType::f32) std::fill_n(static_cast<float*>(y.raw()), y.numel(), static_cast<float>(v));
    else if (y.dtype() == DType::f64) std::fill_n(static_cast<double*>(y.raw()), y.numel(), v);
    else for (std::int64_t i = 0; i < y.numel(); ++i) detail::store_from_double(y.raw(), y.dtype(), i, v);
  }

  static void copy(const Tensor& x, Tensor& y, bool acc) {
    if (!acc) { std::memcpy(y.raw(), x.raw(), x.nbytes()); return; }
    detail::dispatch_float(y.dtype(), "copy", [&]<class T>() {
      const T* s = static_cast<const T*>(x.raw());
      T* d = static_cast<T*>(y.raw());
      const std::int64_t n = y.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { d[i] += s[i]; });
    });
  }

  static void cast(const Tensor& x, Tensor& y) {
    Tensor t = x.to(y.dtype());
    std::memcpy(y.raw(), t.raw(), y.nbytes());
  }

  static void unary(Unary op, double arg, const Tensor& x, Tensor& y) {
    detail::dispatch_float(x.dtype(), unary_name(op), [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T a = static_cast<T>(arg);
      const std::int64_t n = x.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        ys[i] = detail::unary_f(op, xs[i], a);
      });
    });
  }

  static void unary_vjp(Unary op, double arg, const Tensor& x, const Tensor& y, const Tensor& g, Tensor& gx,
                        bool acc) {
    detail::dispatch_float(x.dtype(), unary_name(op), [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      const T a = static_cast<T>(arg);
      const std::int64_t n = x.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
        detail::put(out, i, gs[i] * detail::unary_df(op, xs[i], ys[i], a), acc);
      });
    });
  }

  static void binary(Binary op, const Tensor& a, const Tensor& b, Tensor& y) {
    detail::dispatch_float(y.dtype(), binary_name(op), [&]<class T>() {
      detail::dispatch_binary(op, [&]<Binary Op>() {
        const T* as = static_cast<const T*>(a.raw());
        const T* bs = static_cast<const T*>(b.raw());
        T* ys = static_cast<T*>(y.raw());
        const std::int64_t n = y.numel();
        if (a.shape() == y.shape() && b.shape() == y.shape()) {
          detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
            ys[i] = detail::binary_f(Op, as[i], bs[i]);
          });
        } else if (a.shape() == y.shape() && b.numel() == 1) {
          const T bv = bs[0];
          detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
            ys[i] = detail::binary_f(Op, as[i], bv);
          });
        } else if (a.shape() == y.shape() && detail::is_suffix(b.shape(), y.shape())) {
          const std::int64_t nb = b.numel(), rows = n / nb;  // b repeats along the leading dims
          detail::parallel_for(rows, n > detail::kParallelGrain, [&](std::int64_t r) {
            for (std::int64_t j = 0; j < nb; ++j) ys[r * nb + j] = detail::binary_f(Op, as[r * nb + j], bs[j]);
          });
        } else {
          std::array<std::array<std::int64_t, kMaxRank>, 2> st{detail::broadcast_strides(a.shape(), y.shape()),
                                                                detail::broadcast_strides(b.shape(), y.shape())};
          detail::for_each_broadcast<2>(y.shape(), st, [&](std::int64_t i, std::int64_t ia, std::int64_t ib) {
            ys[i] = detail::binary_f(Op, as[ia], bs[ib]);
          });
        }
      });
    });
  }

  /// dst (+)= g * d(a op b)/d(input `which`), at the output's full shape (the op reduces it to
  /// the input's shape afterwards with sum_to, the one place broadcasting gradients are summed).
  static void binary_vjp(Binary op, int which, const Tensor& a, const Tensor& b, const Tensor& g, Tensor& dst,
                         bool acc) {
    detail::dispatch_float(g.dtype(), binary_name(op), [&]<class T>() {
      detail::dispatch_binary(op, [&]<Binary Op>() {
        const T* as = static_cast<const T*>(a.raw());
        const T* bs = static_cast<const T*>(b.raw());
        const T* gs = static_cast<const T*>(g.raw());
        T* out = static_cast<T*>(dst.raw());
        const std::int64_t n = g.numel();
        if (a.shape() == g.shape() && b.shape() == g.shape()) {
          detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) {
            detail::put(out, i, gs[i] * detail::binary_df(Op, which, as[i], bs[i]), acc);
          });
        } else {
          std::array<std::array<std::int64_t, kMaxRank>, 2> st{detail::broadcast_strides(a.shape(), g.shape()),
                                                                detail::broadcast_strides(b.shape(), g.shape())};
          detail::for_each_broadcast<2>(g.shape(), st, [&](std::int64_t i, std::int64_t ia, std::int64_t ib) {
            detail::put(out, i, gs[i] * detail::binary_df(Op, which, as[ia], bs[ib]), acc);
          });
        }
      });
    });
  }

  /// y = mask != 0 ? a : b, every input broadcast to y. mask: u8, or the dtype of y.
  static void where(const Tensor& mask, const Tensor& a, const Tensor& b, Tensor& y) {
    detail::dispatch_float(y.dtype(), "where", [&]<class T>() {
      const T* as = static_cast<const T*>(a.raw());
      const T* bs = static_cast<const T*>(b.raw());
      T* ys = static_cast<T*>(y.raw());
      std::array<std::array<std::int64_t, kMaxRank>, 3> st{detail::broadcast_strides(mask.shape(), y.shape()),
                                                            detail::broadcast_strides(a.shape(), y.shape()),
                                                            detail::broadcast_strides(b.shape(), y.shape())};
      detail::for_each_broadcast<3>(y.shape(), st, [&](std::int64_t i, std::int64_t im, std::int64_t ia, std::int64_t ib) {
        ys[i] = mask_at(mask, im) ? as[ia] : bs[ib];
      });
    });
  }

  /// dst (+)= g where the mask selects branch `which` (0: a, taken where mask != 0), else 0.
  static void where_vjp(const Tensor& mask, const Tensor& g, int which, Tensor& dst, bool acc) {
    detail::dispatch_float(g.dtype(), "where", [&]<class T>() {
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(dst.raw());
      std::array<std::array<std::int64_t, kMaxRank>, 1> st{detail::broadcast_strides(mask.shape(), g.shape())};
      detail::for_each_broadcast<1>(g.shape(), st, [&](std::int64_t i, std::int64_t im) {
        bool take = mask_at(mask, im) == (which == 0);
        detail::put(out, i, take ? gs[i] : T(0), acc);
      });
    });
  }

 private:
  static bool mask_at(const Tensor& m, std::int64_t i) {
    switch (m.dtype()) {
      case DType::u8: return static_cast<const std::uint8_t*>(m.raw())[i] != 0;
      case DType::f32: return static_cast<const float*>(m.raw())[i] != 0.0f;
      case DType::f64: return static_cast<const double*>(m.raw())[i] != 0.0;
      case DType::i32: return static_cast<const std::int32_t*>(m.raw())[i] != 0;
      default: return detail::load_as_double(m.raw(), m.dtype(), i) != 0.0;
    }
  }
};
using ElementwiseKernels = ElementwiseKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/elementwise.hpp ----
// ---- begin nn/backend/cpu/reduce.hpp ----
// nn::cpu's reductions: sum_to (sum, mean and every broadcast gradient), broadcast_to and
// max over an axis, with their vjps (ops/reduce.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `ReduceKernels` (why: backend/cpu.hpp).
template <class = void>
struct ReduceKernelsT {
  /// y (+)= scale * (x summed over the dims where y has size 1 or is missing). The one kernel
  /// behind sum, mean and every broadcast gradient. Deterministic: fixed summation order.
  static void sum_to(const Tensor& x, Tensor& y, double scale, bool acc) {
    detail::dispatch_float(x.dtype(), "sum", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sc = static_cast<T>(scale);
      std::int64_t outer, red, inner;
      if (detail::reduction_as_3d(x.shape(), y.shape(), outer, red, inner)) {
        if (inner == 1) {  // reduce contiguous rows
          detail::parallel_for(outer, outer * red > detail::kParallelGrain && outer > 1, [&](std::int64_t o) {
            const T* row = xs + o * red;
            T s = 0;
            for (std::int64_t k = 0; k < red; ++k) s += row[k];
            detail::put(ys, o, sc * s, acc);
          });
        } else {  // reduce a middle dim: accumulate rows of length `inner`
          detail::parallel_for(outer, outer * red * inner > detail::kParallelGrain, [&](std::int64_t o) {
            T* dst = ys + o * inner;
            const T* src = xs + o * red * inner;
            for (std::int64_t i = 0; i < inner; ++i) {
              T s = 0;
              for (std::int64_t k = 0; k < red; ++k) s += src[k * inner + i];
              detail::put(dst, i, sc * s, acc);
            }
          });
        }
        return;
      }
      // General case: several non-adjacent reduced dims. Serial scatter into y.
      if (!acc) std::fill_n(ys, y.numel(), T(0));
      std::array<std::array<std::int64_t, kMaxRank>, 1> st{detail::broadcast_strides(y.shape(), x.shape())};
      detail::for_each_broadcast<1>(x.shape(), st, [&](std::int64_t i, std::int64_t iy) { ys[iy] += sc * xs[i]; });
    });
  }

  /// y (+)= scale * x broadcast to y's shape (the vjp of sum and mean).
  static void broadcast_to(const Tensor& x, Tensor& y, double scale, bool acc) {
    detail::dispatch_float(x.dtype(), "broadcast", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sc = static_cast<T>(scale);
      std::array<std::array<std::int64_t, kMaxRank>, 1> st{detail::broadcast_strides(x.shape(), y.shape())};
      detail::for_each_broadcast<1>(y.shape(), st, [&](std::int64_t i, std::int64_t ix) { detail::put(ys, i, sc * xs[ix], acc); });
    });
  }

  /// y = max of x over `axis` (y has keepdims shape), idx (i32, y's shape) = the first index
  /// attaining it. NaN propagates (a NaN wins, as PyTorch).
  static void max_axis(const Tensor& x, int axis, Tensor& y, Tensor& idx) {
    detail::dispatch_float(x.dtype(), "max", [&]<class T>() {
      const Shape& s = x.shape();
      const std::int64_t outer = s.prod(0, axis), red = s[axis], inner = s.prod(axis + 1, s.rank());
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      auto* is = static_cast<std::int32_t*>(idx.raw());
      detail::parallel_for(outer, x.numel() > detail::kParallelGrain, [&](std::int64_t o) {
        for (std::int64_t i = 0; i < inner; ++i) {
          const T* p = xs + o * red * inner + i;
          T best = p[0];
          std::int32_t bi = 0;
          for (std::int64_t k = 1; k < red && !std::isnan(best); ++k) {
            T v = p[k * inner];
            if (v > best || std::isnan(v)) { best = v; bi = static_cast<std::int32_t>(k); }
          }
          ys[o * inner + i] = best;
          is[o * inner + i] = bi;
        }
      });
    });
  }

  /// gx (+)= g placed at the argmax positions recorded by max_axis.
  static void max_axis_vjp(const Tensor& g, const Tensor& idx, int axis, Tensor& gx, bool acc) {
    detail::dispatch_float(g.dtype(), "max", [&]<class T>() {
      const Shape& s = gx.shape();
      const std::int64_t outer = s.prod(0, axis), red = s[axis], inner = s.prod(axis + 1, s.rank());
      const T* gs = static_cast<const T*>(g.raw());
      const auto* is = static_cast<const std::int32_t*>(idx.raw());
      T* out = static_cast<T*>(gx.raw());
      if (!acc) std::fill_n(out, gx.numel(), T(0));
      for (std::int64_t o = 0; o < outer; ++o)
        for (std::int64_t i = 0; i < inner; ++i)
          out[(o * red + is[o * inner + i]) * inner + i] += gs[o * inner + i];
    });
  }
};
using ReduceKernels = ReduceKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/reduce.hpp ----
// ---- begin nn/backend/cpu/matmul.hpp ----
// nn::cpu's matrix products: the GEMM engine choice (nn's own kernels by CPU features, CBLAS,
// or Eigen's kernel with reusable packing space), gemm_serial for kernels that run many
// products from their own parallel loops, and the batched matmul kernel (ops/matmul.hpp).

#if defined(NN_USE_BLAS)
#include <cblas.h>
#endif

// ---- begin nn/backend/gemm.hpp ----
// nn's own GEMM: a BLIS-style packed, blocked product C (+)= op(A) @ op(B) on row-major matrices,
// with micro-kernels for AVX-512, AVX2+FMA and the compiler's baseline, all in one binary and
// chosen at run time from CPUID feature bits (backend/cpu_info.hpp), never from a CPU model name.
//
// Why nn owns it: a BLAS picks its kernels from a table of CPU models, and Debian's OpenBLAS
// 0.3.21 falls back to SSE3 kernels on CPUs newer than its table (Sapphire Rapids runs at a
// fifth of its speed). Owning the loops also gives the hooks the rest of nn needs: caller-supplied
// packing (quantized weights dequantized straight into packed panels) and an epilogue per tile.
//
// One micro-kernel body serves every instruction set: it is written with GCC/Clang vector
// extensions and inlined into a small entry function per ISA marked with a target attribute, so
// the compiler emits zmm FMAs in one, ymm FMAs in another and SSE2 in the baseline one, with no
// -m flags on the user's command line.

#include <algorithm>
#include <chrono>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <new>
#include <string>
#include <type_traits>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif


#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif
#if defined(__linux__)
#include <sys/syscall.h>
#include <unistd.h>
#endif

#if defined(__GNUC__) || defined(__clang__)
#define NN_OWN_GEMM 1
#endif

// Full unrolling keeps a micro-tile's accumulators in registers (gemv.hpp's too). nvcc's front end knows only the
// plain form (and passes host code on to the host compiler).
#define NN_GEMM_STR2(x) #x
#define NN_GEMM_STR(x) NN_GEMM_STR2(x)
#if defined(__CUDACC__)
#define NN_GEMM_UNROLL(n) _Pragma(NN_GEMM_STR(unroll n))
#else
#define NN_GEMM_UNROLL(n) _Pragma(NN_GEMM_STR(GCC unroll n))
#endif

// NN_PIN_REGISTER(v): v must be in a vector register here (not folded into its users as a memory
// operand). An empty asm with v as its in/out operand; nothing on other targets or under nvcc.
#if (defined(__x86_64__) || defined(__i386__)) && !defined(__CUDACC__)
#define NN_PIN_REGISTER(v) asm("" : "+v"(v))
#else
#define NN_PIN_REGISTER(v) ((void)0)
#endif

namespace nn {
namespace detail {

/// This thread's working space number `slot` (0: its own GEMM panels, 1: B panels it shares with
/// its team, 2: a kernel's tiles around its GEMM calls, such as flash attention's scores, 3: a
/// narrow product's transposed C, see gemm::narrow_product): at
/// least `bytes`, 64-byte aligned. It grows only when a larger request comes, so replaying
/// kernels already seen allocates nothing.
inline void* gemm_workspace(std::size_t bytes, int slot = 0) {
  struct Buffer {
    void* p = nullptr;
    std::size_t n = 0;
    ~Buffer() { std::free(p); }
  };
  thread_local Buffer bufs[4];
  Buffer& buf = bufs[slot];
  if (buf.n < bytes) {
    const std::size_t n = (bytes + 63) / 64 * 64;
    void* p = std::aligned_alloc(64, n);
    if (!p) throw std::bad_alloc();
    std::free(buf.p);
    buf.p = p;
    buf.n = n;
  }
  return buf.p;
}

}  // namespace detail

#if defined(NN_OWN_GEMM)
namespace gemm {

using index = std::int64_t;

/// A row-major operand as the product reads it: element (r, c) of op(X) is X[r*ld + c], or
/// X[c*ld + r] when trans (X stored transposed). The default packers read these.
template <class T>
struct Matrix {
  const T* p;
  index ld;
  bool trans;
  T at(index r, index c) const { return trans ? p[c * ld + r] : p[r * ld + c]; }
};

/// The shape of one micro-kernel: an MR x NR tile of C held in registers, NR = NV vectors of W
/// lanes per row; blocking sizes follow from it (KC: depth of a packed panel; NB: columns of a
/// packed B block, sized for L2; MB: rows of a packed A block).
template <class T, Isa I>
struct Shape;
// Baseline (SSE2 on x86-64, NEON elsewhere): 16 registers of 16 bytes; 6 x 2 accumulators.
template <class T>
struct Shape<T, Isa::generic> {
  static constexpr int W = 16 / sizeof(T), NV = 2, MR = 6, NR = W * NV;
  static constexpr index KC = 256, NB = 512, MB = 960;
};
// AVX2: 16 ymm registers; 6 x 2 accumulators + 2 B vectors + 1 broadcast.
template <class T>
struct Shape<T, Isa::avx2> {
  static constexpr int W = 32 / sizeof(T), NV = 2, MR = 6, NR = W * NV;
  static constexpr index KC = 256, NB = 512, MB = 960;
};
// AVX-512: 32 zmm registers; 12 x 2 accumulators + 2 B vectors + 1 broadcast.
template <class T>
struct Shape<T, Isa::avx512> {
  static constexpr int W = 64 / sizeof(T), NV = 2, MR = 12, NR = W * NV;
  static constexpr index KC = 384, NB = 384, MB = 1536;
};

/// Whether the AVX2 micro-kernel pins each B vector in a register (NN_PIN_REGISTER). Each one
/// feeds MR FMAs, but GCC tuned for AMD Zen 2/3 (-mtune=znver2/znver3, what -march=native gives
/// there) folds the 256-bit load into every FMA instead: 24 loads a depth pair for 4, and the
/// kernel ran at 61-66% of its speed (55-65 -> 86-97 GFLOP/s with the pin, one thread, AMD EPYC
/// family 25 model 1, FMA peak 90). No other tuning folds them (generic, haswell to
/// sapphirerapids, znver1, checked with GCC 12), and there the asm would only move GCC's schedule
/// (3% slower under generic tuning), so the pin is for those tunings alone; the 512- and 128-bit
/// kernels keep their loads in registers under every tuning.
#if defined(__tune_znver2__) || defined(__tune_znver3__) || defined(__tune_znver4__) || defined(__tune_znver5__)
inline constexpr bool kPinAvx2B = true;
#else
inline constexpr bool kPinAvx2B = false;
#endif

/// The one micro-kernel body: C[MR x NR] (row stride ldc) = (or +=, unless overwrite) the sum over
/// k < kc of A(i, k) * B(k, j), k in order. B(k, j) is b[k*ldb + j]: a packed B panel (ldb = NR,
/// packed by pack_b below) or NR columns of a row-major op(B) read in place (ldb its row stride).
/// A(i, k) is a[k*MR + i] from a packed A panel, or a[i*lda + k] read in place (DirectA: rows of a
/// row-major A, which saves packing A when C is narrow and A's rows would be packed for few uses).
/// Either way each C element sees the same products in the same order: in place and packed are
/// bit-identical.
template <class T, int W, int MR, int NV, bool DirectA>
[[gnu::always_inline]] inline void micro_body(index kc, const T* __restrict a, index lda, const T* __restrict b,
                                              index ldb, T* __restrict c, index ldc, bool overwrite) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  V acc[MR][NV] = {};
  // one depth: NV vectors of B's row k, each A(i, k) broadcast against them
  const auto depth = [&](index k) [[gnu::always_inline]] {
    V bv[NV];
    NN_GEMM_UNROLL(8)
    for (int j = 0; j < NV; ++j) {
      if constexpr (kPinAvx2B && sizeof(V) == 32) {
        V v;
        __builtin_memcpy(&v, b + k * ldb + j * W, sizeof(V));
        NN_PIN_REGISTER(v);
        bv[j] = v;
      } else {
        __builtin_memcpy(&bv[j], b + k * ldb + j * W, sizeof(V));
      }
    }
    NN_GEMM_UNROLL(16)
    for (int i = 0; i < MR; ++i) {
      const T ai = DirectA ? a[i * lda + k] : a[k * MR + i];
      NN_GEMM_UNROLL(8)
      for (int j = 0; j < NV; ++j) acc[i][j] += bv[j] * ai;
    }
  };
  // Two depths per trip: the loop's own counter and branch uops then share the FMA ports half as
  // often (one trip of 24 FMAs ran at ~83% of the FMA peak, two at ~88%, Xeon model 167).
  index k = 0;
  for (; k + 2 <= kc; k += 2) {
    depth(k);
    depth(k + 1);
  }
  if (k < kc) depth(k);
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i)
    NN_GEMM_UNROLL(8)
    for (int j = 0; j < NV; ++j) {
      V cv = acc[i][j];
      if (!overwrite) {
        V old;
        __builtin_memcpy(&old, c + i * ldc + j * W, sizeof(V));
        cv += old;
      }
      __builtin_memcpy(c + i * ldc + j * W, &cv, sizeof(V));
    }
}

/// One ISA's pair of micro-kernels: on a packed A panel (lda unused), and on A rows read in place;
/// both read B at b[k*ldb + j].
template <class T>
struct Kernels {
  using Fn = void (*)(index kc, const T* a, index lda, const T* b, index ldb, T* c, index ldc, bool overwrite);
  Fn packed, direct;
};

// The entry points, one per ISA and form: the same body, compiled for each instruction set.
template <class T, bool D>
void micro_generic(index kc, const T* a, index lda, const T* b, index ldb, T* c, index ldc, bool overwrite) {
  using S = Shape<T, Isa::generic>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, ldb, c, ldc, overwrite);
}
#if defined(__x86_64__) || defined(__i386__)
template <class T, bool D>
[[gnu::target("avx2,fma")]] void micro_avx2(index kc, const T* a, index lda, const T* b, index ldb, T* c,
                                            index ldc, bool overwrite) {
  using S = Shape<T, Isa::avx2>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, ldb, c, ldc, overwrite);
}
template <class T, bool D>
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]] void micro_avx512(index kc, const T* a, index lda,
                                                                                const T* b, index ldb, T* c,
                                                                                index ldc, bool overwrite) {
  using S = Shape<T, Isa::avx512>;
  micro_body<T, S::W, S::MR, S::NV, D>(kc, a, lda, b, ldb, c, ldc, overwrite);
}
#endif

/// The kernel entry point of ISA I, form D (direct A or packed).
template <class T, Isa I, bool D>
constexpr auto micro_entry() {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (I == Isa::avx512) return &micro_avx512<T, D>;
  else if constexpr (I == Isa::avx2) return &micro_avx2<T, D>;
  else return &micro_generic<T, D>;
#else
  return &micro_generic<T, D>;
#endif
}

template <class T, Isa I>
constexpr Kernels<T> micro_kernels() {
  return {micro_entry<T, I, false>(), micro_entry<T, I, true>()};
}

// ---- packing ------------------------------------------------------------------------------
// A block (rows i0.., depth k0..) is laid out as ceil(mc/MR) panels of kc x MR values; a B block
// (depth k0.., columns j0..) as ceil(nc/NR) panels of kc x NR. Rows and columns past the edge are
// zero, so every micro-kernel call is a full tile. A caller with its own storage (quantized
// weights) supplies a packer with the same contract in place of these.

/// Packs an L-wide strip of a row-major matrix into a panel of kc x L values: `contiguous` when
/// the strip's L values at depth k lie side by side (src + k*ld), else each of its L lines runs
/// along k (src + l*ld + k). Lines past `n` are zero. This is both pack_a and pack_b: a panel of
/// op(A) rows and a panel of op(B) columns are the same thing seen from either side.
/// An element of a source matrix as the packed type: bf16 bits (std::uint16_t) widened exactly to
/// f32, anything else as it is.
template <class T, class S>
inline T widen(S s) {
  if constexpr (std::is_same_v<S, std::uint16_t>) return half::bf16_to_f32(s);
  else return static_cast<T>(s);
}

/// Whether the packers may use AVX-512 (or AVX2): the kernel set in use is (NN_CPU_ISA lowers
/// both alike).
inline bool pack_avx512() {
  static const bool yes = detail::choose_isa(detail::detect_cpu_features()) == Isa::avx512;
  return yes;
}
inline bool pack_avx2() {
  static const bool yes = detail::choose_isa(detail::detect_cpu_features()) == Isa::avx2;
  return yes;
}

#if defined(__x86_64__) || defined(__i386__)
/// dst[d * L + l] = src[l * ld + d] for d < 16 and l < n (n <= 16; lanes past n are not written):
/// a 16 x 16 block of floats transposed in registers. Packing a strip whose lines run along k (a
/// Linear's weight as op(B) = W^T, activations as op(A)) is this transpose. Element by element it
/// took 12% of the main job's LoRA step (perf); a 576 x 576 weight in L2 packs at 0.34 ns per
/// element that way, 0.24 this way, against 0.15 for a plain copy (Xeon model 207).
/// transpose16 from registers: line l of the block is r[l] (lines past n are not stored). The
/// quantized packer decodes its lines straight into r.
[[gnu::target("avx512f"), gnu::always_inline]] inline void transpose16_store(const __m512 (&r)[16], int n, float* dst,
                                                                           index L) {
  // the all-lanes zero-masked forms: GCC 12's plain ones read an undefined register (-Wuninitialized)
  constexpr __mmask16 all16 = 0xFFFF;
  constexpr __mmask8 all8 = 0xFF;
  __m512 t[16], u[16];
  // within each 128-bit lane q: t pairs lines (depths 4q..4q+3), u gathers 4 lines per depth
  NN_GEMM_UNROLL(8)
  for (int p = 0; p < 8; ++p) {
    t[2 * p] = _mm512_maskz_unpacklo_ps(all16, r[2 * p], r[2 * p + 1]);
    t[2 * p + 1] = _mm512_maskz_unpackhi_ps(all16, r[2 * p], r[2 * p + 1]);
  }
  NN_GEMM_UNROLL(4)
  for (int g = 0; g < 4; ++g) {
    const __m512d a = _mm512_castps_pd(t[4 * g]), b = _mm512_castps_pd(t[4 * g + 1]);
    const __m512d c = _mm512_castps_pd(t[4 * g + 2]), d = _mm512_castps_pd(t[4 * g + 3]);
    u[4 * g] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, a, c));      // depth 4q + 0 of lines 4g..4g+3
    u[4 * g + 1] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, a, c));  // depth 4q + 1
    u[4 * g + 2] = _mm512_castpd_ps(_mm512_maskz_unpacklo_pd(all8, b, d));  // depth 4q + 2
    u[4 * g + 3] = _mm512_castpd_ps(_mm512_maskz_unpackhi_pd(all8, b, d));  // depth 4q + 3
  }
  // across lanes: depth 4q + e takes lane q of u[e], u[4 + e], u[8 + e], u[12 + e]
  const __mmask16 mask = static_cast<__mmask16>((1u << n) - 1);
  NN_GEMM_UNROLL(4)
  for (int e = 0; e < 4; ++e) {
    // EVEN_LANES(x, y): 128-bit lanes x0 x2 y0 y2; ODD_LANES(x, y): x1 x3 y1 y3
#define NN_EVEN_LANES(x, y) _mm512_maskz_shuffle_f32x4(all16, x, y, 0x88)
#define NN_ODD_LANES(x, y) _mm512_maskz_shuffle_f32x4(all16, x, y, 0xDD)
    const __m512 w0 = NN_EVEN_LANES(u[e], u[4 + e]), w1 = NN_ODD_LANES(u[e], u[4 + e]);
    const __m512 w2 = NN_EVEN_LANES(u[8 + e], u[12 + e]), w3 = NN_ODD_LANES(u[8 + e], u[12 + e]);
    _mm512_mask_storeu_ps(dst + e * L, mask, NN_EVEN_LANES(w0, w2));
    _mm512_mask_storeu_ps(dst + (4 + e) * L, mask, NN_EVEN_LANES(w1, w3));
    _mm512_mask_storeu_ps(dst + (8 + e) * L, mask, NN_ODD_LANES(w0, w2));
    _mm512_mask_storeu_ps(dst + (12 + e) * L, mask, NN_ODD_LANES(w1, w3));
#undef NN_EVEN_LANES
#undef NN_ODD_LANES
  }
}
[[gnu::target("avx512f")]] inline void transpose16(const float* src, index ld, int n, float* dst, index L) {
  __m512 r[16];
  NN_GEMM_UNROLL(16)
  for (int l = 0; l < 16; ++l) r[l] = l < n ? _mm512_loadu_ps(src + l * ld) : _mm512_setzero_ps();
  transpose16_store(r, n, dst, L);
}
#endif

#if defined(__x86_64__) || defined(__i386__)
/// dst[d * L + l] = src[l * ld + d] for d < 8 and l < n (n <= 8; lanes past n are not written):
/// transpose16's AVX2 form, an 8 x 8 block of floats transposed in registers.
/// transpose8 from registers: line l of the block is r[l] (lines past n are not stored). The
/// quantized packer decodes its lines straight into r.
[[gnu::target("avx2"), gnu::always_inline]] inline void transpose8_store(const __m256 (&r)[8], int n, float* dst,
                                                                        index L) {
  __m256 t[8], u[8];
  // within each 128-bit half (depths 0-3 | 4-7): t pairs lines, u gathers 4 lines per depth
  NN_GEMM_UNROLL(4)
  for (int p = 0; p < 4; ++p) {
    t[2 * p] = _mm256_unpacklo_ps(r[2 * p], r[2 * p + 1]);      // depths 0, 1 | 4, 5 of 2 lines
    t[2 * p + 1] = _mm256_unpackhi_ps(r[2 * p], r[2 * p + 1]);  // depths 2, 3 | 6, 7
  }
  NN_GEMM_UNROLL(2)
  for (int g = 0; g < 2; ++g) {
    u[4 * g] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0x44);          // depth 0 | 4 of lines 4g..4g+3
    u[4 * g + 1] = _mm256_shuffle_ps(t[4 * g], t[4 * g + 2], 0xEE);      // depth 1 | 5
    u[4 * g + 2] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0x44);  // depth 2 | 6
    u[4 * g + 3] = _mm256_shuffle_ps(t[4 * g + 1], t[4 * g + 3], 0xEE);  // depth 3 | 7
  }
  NN_GEMM_UNROLL(8)
  for (int d = 0; d < 8; ++d) {
    // depth d: its half of u[d % 4] (lines 0-3) beside the same half of u[4 + d % 4] (lines 4-7)
    const __m256 v = d < 4 ? _mm256_permute2f128_ps(u[d], u[4 + d], 0x20)
                           : _mm256_permute2f128_ps(u[d - 4], u[d], 0x31);
    float* o = dst + d * L;
    if (n == 8) {
      _mm256_storeu_ps(o, v);
    } else if (n == 6) {  // an AVX2 A panel (MR = 6): plain stores, not a masked one
      _mm_storeu_ps(o, _mm256_castps256_ps128(v));
      _mm_storel_pi(reinterpret_cast<__m64*>(o + 4), _mm256_extractf128_ps(v, 1));
    } else {
      alignas(32) float row[8];
      _mm256_store_ps(row, v);
      for (int l = 0; l < n; ++l) o[l] = row[l];
    }
  }
}
[[gnu::target("avx2"), gnu::always_inline]] inline void transpose8(const float* src, index ld, int n, float* dst,
                                                                  index L) {
  __m256 r[8];
  NN_GEMM_UNROLL(8)
  for (int l = 0; l < 8; ++l) r[l] = l < n ? _mm256_loadu_ps(src + l * ld) : _mm256_setzero_ps();
  transpose8_store(r, n, dst, L);
}

/// pack_panel's L full lines running along k (src + l*ld + k) on AVX2: 8 depths x 8 lines at a
/// time through transpose8, each panel row stored whole, each line's 16 depths (a cache line) read
/// at once. The element loop it replaces packed a 576 x 576 weight at 0.34 ns per element built
/// for the baseline and at 1.1 built -march=native (GCC turns the strided reads into vgatherdps,
/// slow on Zen 3); this way 0.17-0.20 either way, against 0.14 for a memcpy of the same matrix
/// (AMD EPYC family 25 model 1; 8 depths at a time: 0.26).
template <int L>
[[gnu::target("avx2")]] void pack_lines_avx2(const float* src, index ld, index kc, float* dst) {
  const index k16 = kc / 16 * 16, k8 = kc / 8 * 8;
  for (index k = 0; k < k16; k += 16) {
    NN_GEMM_UNROLL(4)
    for (int l0 = 0; l0 < L; l0 += 8) {
      transpose8(src + l0 * ld + k, ld, std::min(8, L - l0), dst + k * L + l0, L);
      transpose8(src + l0 * ld + k + 8, ld, std::min(8, L - l0), dst + (k + 8) * L + l0, L);
    }
  }
  for (index k = k16; k < k8; k += 8) {
    NN_GEMM_UNROLL(4)
    for (int l0 = 0; l0 < L; l0 += 8) transpose8(src + l0 * ld + k, ld, std::min(8, L - l0), dst + k * L + l0, L);
  }
  for (index k = k8; k < kc; ++k)
    for (int l = 0; l < L; ++l) dst[k * L + l] = src[l * ld + k];
}
#endif

template <int L, class S, class T>
inline void pack_panel(const S* src, index ld, bool contiguous, index n, index kc, T* dst) {
#if defined(__x86_64__) || defined(__i386__)
  if constexpr (std::is_same_v<S, float> && std::is_same_v<T, float>) {
    if (!contiguous && n == L && kc >= 8 && pack_avx2()) {
      pack_lines_avx2<L>(src, ld, kc, dst);
      return;
    }
    if (!contiguous && n == L && kc >= 16 && pack_avx512()) {
      const index k16 = kc / 16 * 16;
      // 16 lines x 16 depths at a time, each line read front to back; the blocks of one 16 depths
      // side by side, so each panel row is stored whole while its line is in L1 (line blocks in
      // the outer loop wrote each half apart: 0.22 ns per element for a 576 x 576 weight in L2,
      // this way 0.18, Xeon model 167)
      for (index k = 0; k < k16; k += 16)
        for (int l0 = 0; l0 < L; l0 += 16) transpose16(src + l0 * ld + k, ld, std::min(16, L - l0), dst + k * L + l0, L);
      for (index k = k16; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = src[l * ld + k];
      return;
    }
  }
#endif
  if (n == L) {
    // full panels (all but the edge): constant trip counts the compiler unrolls and vectorises
    if (contiguous) {  // bf16 widened (lines of one type go to pack_side_by_side)
      for (index k = 0; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = widen<T>(src[k * ld + l]);
    } else {
      // 16 depths at a time: each line's 16 values are one cache line
      index k = 0;
      for (; k + 16 <= kc; k += 16)
        for (int u = 0; u < 16; ++u) {
          T* d = dst + (k + u) * L;
          NN_GEMM_UNROLL(32)
          for (int l = 0; l < L; ++l) d[l] = widen<T>(src[l * ld + k + u]);
        }
      for (; k < kc; ++k)
        for (int l = 0; l < L; ++l) dst[k * L + l] = widen<T>(src[l * ld + k]);
    }
    return;
  }
  for (index k = 0; k < kc; ++k) {
    T* d = dst + k * L;
    for (index l = 0; l < n; ++l) d[l] = widen<T>(contiguous ? src[k * ld + l] : src[l * ld + k]);
    for (index l = n; l < L; ++l) d[l] = T(0);
  }
}

/// Packs n lines that lie side by side at each depth (src + k*ld: line l at depth k is
/// src[k * ld + l]) into ceil(n / L) panels of kc x L at dst, lines past n zero. Eight depths at a
/// time, across all the panels: the eight source rows are read front to back (streams the
/// prefetcher follows) and each panel gets eight depths, whole cache lines, at once. (Panel by
/// panel, a panel's kc reads were a row apart each, a cache line apiece that no prefetcher follows
/// on a wide matrix -- the head's dY^T rows are 32 KB apart -- and made pack_a 5.5% of the
/// decoder's full step, Xeon model 167. Eight panels at a time over all depths took it to 3.6%,
/// and still left the head's dW = dY^T X (8192 x 256 x 1024) at 213 GFLOP/s where this order gives
/// 222-227, Zen 5.)
template <int L, class T>
void pack_side_by_side(const T* src, index ld, index n, index kc, T* dst) {
  constexpr index kDepths = 8;
  const index full = n / L * L;
  for (index k0 = 0; k0 < kc; k0 += kDepths) {
    const index k1 = std::min(kc, k0 + kDepths);
    index p = 0;
    for (; p < full; p += L) {
      T* d = dst + p * kc;
      for (index k = k0; k < k1; ++k) std::memcpy(d + k * L, src + k * ld + p, sizeof(T) * L);
    }
    if (p < n) {
      T* d = dst + p * kc;
      for (index k = k0; k < k1; ++k) {
        std::memcpy(d + k * L, src + k * ld + p, sizeof(T) * static_cast<std::size_t>(n - p));
        std::fill_n(d + k * L + (n - p), L - (n - p), T(0));
      }
    }
  }
}

/// Packs op(A)[i0 : i0+mc, k0 : k0+kc] into MR-row panels at dst.
template <int MR, class T>
void pack_a(const Matrix<T>& A, index i0, index mc, index k0, index kc, T* dst) {
  if (A.trans) {  // op(A) = X^T (a weight gradient's dY^T): depth k's rows lie side by side in X's row k
    pack_side_by_side<MR>(A.p + k0 * A.ld + i0, A.ld, mc, kc, dst);
    return;
  }
  for (index p = 0; p < mc; p += MR, dst += kc * MR) {
    const index rows = std::min<index>(MR, mc - p);
    pack_panel<MR>(A.p + (i0 + p) * A.ld + k0, A.ld, false, rows, kc, dst);  // each row runs along k
  }
}

/// Packs op(B)[k0 : k0+kc, j0 : j0+nc] into NR-column panels at dst (of T; B's elements widened
/// to it, see widen()).
template <int NR, class S, class T>
void pack_b(const Matrix<S>& B, index k0, index kc, index j0, index nc, T* dst) {
  if constexpr (std::is_same_v<S, T>) {
    if (!B.trans) {  // op(B) = X: depth k's columns lie side by side in X's row k
      pack_side_by_side<NR>(B.p + k0 * B.ld + j0, B.ld, nc, kc, dst);
      return;
    }
  }
  for (index q = 0; q < nc; q += NR, dst += kc * NR) {
    const index cols = std::min<index>(NR, nc - q);
    // op(B) = X^T (a Linear's weight): column c of the panel is row j0+q+c of X, running along k
    const S* src = B.trans ? B.p + (j0 + q) * B.ld + k0 : B.p + k0 * B.ld + j0 + q;
    pack_panel<NR>(src, B.ld, !B.trans, cols, kc, dst);
  }
}

/// The dense packers as the driver calls them: pack(dst, outer0, outer_n, k0, kc).
template <int MR, class T>
struct DensePackA {
  Matrix<T> m;
  void operator()(T* dst, index i0, index mc, index k0, index kc) const { pack_a<MR>(m, i0, mc, k0, kc, dst); }
  /// Row i0 of op(A) from column k0, read in place by the direct kernel (null when op(A) is
  /// transposed: its rows are not contiguous). A packer without this method is always packed.
  const T* rows(index i0, index k0) const { return m.trans ? nullptr : m.p + i0 * m.ld + k0; }
  index ld() const { return m.ld; }
};

// ---- epilogues ------------------------------------------------------------------------------
// An epilogue runs on each micro-tile of C once its last K slice is in, while the tile is still in
// L1: epi(c, ldc, i, j, rows, cols) for the tile at C(i, j) (whole-product coordinates), rows x
// cols of it valid. This is where a bias, a scale or a residual fuses into the product instead of
// taking another pass over C; the default does nothing and compiles away.
struct NoEpilogue {
  template <class T>
  void operator()(T*, index, index, index, index, index) const {}
};

/// c = scale * c + bias[j] + residual[i, j] (each part optional): a Linear's bias, a residual
/// stream's add, a LoRA update already in C scaled (y = x W^T + b + r, or C (+)= alpha op(A) op(B)).
template <class T>
struct BiasResidual {
  const T* bias = nullptr;      // (N), or null
  const T* residual = nullptr;  // (M, N) with row stride ldr, or null; may be C itself only if read first
  index ldr = 0;
  T scale = T(1);
  void operator()(T* c, index ldc, index i0, index j0, index rows, index cols) const {
    for (index r = 0; r < rows; ++r) {
      T* row = c + r * ldc;
      const T* res = residual ? residual + (i0 + r) * ldr + j0 : nullptr;
      for (index q = 0; q < cols; ++q) {
        T v = scale == T(1) ? row[q] : scale * row[q];
        if (bias) v += bias[j0 + q];
        if (res) v += res[q];
        row[q] = v;
      }
    }
  }
};

/// An epilogue seen from a sub-product whose C starts at (di, dj) of the whole.
template <class Epi>
struct ShiftedEpilogue {
  const Epi& epi;
  index di, dj;
  template <class T>
  void operator()(T* c, index ldc, index i, index j, index rows, index cols) const {
    epi(c, ldc, i + di, j + dj, rows, cols);
  }
};

template <class Epi>
inline constexpr bool is_no_epilogue = std::is_same_v<Epi, NoEpilogue>;

/// Where block_product finds its operands. A: ceil(mc/MR) packed panels of kc x MR at abuf, except
/// full panels read in place (the direct kernel) from op(A)'s rows at a_rows + ir*lda when set. B:
/// ceil(nc/NR) packed panels of kc x NR at bbuf, except full panels read in place from op(B)'s
/// rows at b + jr (depth k at + k*ldb) when set. Ragged panels are always packed, at the place
/// they would have among the others.
template <class T>
struct BlockOperands {
  T* abuf;
  T* bbuf;
  const T* a_rows = nullptr;
  index lda = 0;
  const T* b = nullptr;
  index ldb = 0;
};

/// Runs C[0:mc, 0:nc] (+)= (A block, mc x kc) @ (B block, kc x nc) tile by tile, the operands where
/// `op` says. An edge tile is computed whole into `tile` and its valid part copied. On the last K
/// slice (`last`) each tile then gets the epilogue, at whole-product offset (ci, cj).
template <class T, class S, class Epi = NoEpilogue>
void block_product(const Kernels<T>& kern, index mc, index nc, index kc, const BlockOperands<T>& op, T* C, index ldc,
                   bool overwrite, T* tile, const Epi& epi = {}, bool last = false, index ci = 0, index cj = 0) {
  constexpr int MR = S::MR, NR = S::NR;
  for (index ir = 0; ir < mc; ir += MR) {
    const index rows = std::min<index>(MR, mc - ir);
    const bool direct = op.a_rows && rows == MR;
    const T* ap = direct ? op.a_rows + ir * op.lda : op.abuf + ir * kc;
    const auto fn = direct ? kern.direct : kern.packed;
    for (index jr = 0; jr < nc; jr += NR) {
      const index cols = std::min<index>(NR, nc - jr);
      const bool b_in_place = op.b && cols == NR;
      const T* bp = b_in_place ? op.b + jr : op.bbuf + jr * kc;
      const index ldb = b_in_place ? op.ldb : NR;
      T* c = C + ir * ldc + jr;
      if (rows == MR && cols == NR) {
        fn(kc, ap, op.lda, bp, ldb, c, ldc, overwrite);
      } else {
        fn(kc, ap, op.lda, bp, ldb, tile, NR, true);
        for (index r = 0; r < rows; ++r)
          for (index q = 0; q < cols; ++q)
            c[r * ldc + q] = overwrite ? tile[r * NR + q] : c[r * ldc + q] + tile[r * NR + q];
      }
      if constexpr (!is_no_epilogue<Epi>)
        if (last) epi(c, ldc, ci + ir, cj + jr, rows, cols);
    }
  }
}

/// The epilogue over all of C (M x N): for a product with K = 0, whose C gets no tiles.
template <class T, class Epi>
void epilogue_all(const Epi& epi, T* C, index ldc, index M, index N) {
  if constexpr (!is_no_epilogue<Epi>)
    if (M > 0 && N > 0) epi(C, ldc, index(0), index(0), M, N);
}

/// Packs what block_product reads of A rows [i0, i0+mc), depth [k0, k0+kc) and sets op's A part:
/// every panel into op.abuf, or, when A is read in place (C narrow: at most 8 NR-wide panels, where
/// packing A would cost as much as the product), only a ragged last panel.
template <class T, class S, class PackA>
void prepare_a(const PackA& pack_a_fn, index N, index i0, index mc, index k0, index kc, BlockOperands<T>& op) {
  constexpr int MR = S::MR;
  op.a_rows = nullptr;
  if constexpr (requires { pack_a_fn.rows(i0, k0); }) {
    if (N <= 8 * S::NR && (op.a_rows = pack_a_fn.rows(i0, k0))) {
      op.lda = pack_a_fn.ld();
      const index full = mc / MR * MR;
      if (full < mc) pack_a_fn(op.abuf + full * kc, i0 + full, mc - full, k0, kc);
      return;
    }
  }
  pack_a_fn(op.abuf, i0, mc, k0, kc);
}

/// Rows of A up to which B is read in place rather than packed: a packed B panel pays for itself
/// by being read once per MR-row A panel from compact, L1-friendly lines; with a few A panels
/// (attention's blocks, LoRA's rank-r products) the packing costs more than it saves. Beyond,
/// strided in-place reads are slower (Xeon model 167: -5 to -30% on 256..1024-row products).
inline constexpr index kInPlaceBRows = 48;

/// The same for B's columns [j0, j0+nc) (or, in a team, the panels [p0, p1) of them this thread
/// packs) for an A block of `a_rows` rows: in place when the packer offers op(B)'s rows (op(B) = X,
/// same type) and a_rows <= kInPlaceBRows; then only a ragged last panel is packed.
template <class T, class S, class PackB>
void prepare_b(const PackB& pack_b_fn, index a_rows, index j0, index nc, index k0, index kc, BlockOperands<T>& op,
               index p0 = 0, index p1 = -1) {
  constexpr int NR = S::NR;
  if (p1 < 0) p1 = (nc + NR - 1) / NR;
  op.b = nullptr;
  if constexpr (requires { pack_b_fn.rows(j0, k0); })
    if (a_rows <= kInPlaceBRows && (op.b = pack_b_fn.rows(j0, k0))) {
      op.ldb = pack_b_fn.ld();
      p0 = std::max(p0, nc / NR);  // full panels are read in place
    }
  if (p0 < p1) pack_b_fn(op.bbuf + p0 * NR * kc, j0 + p0 * NR, std::min(nc, p1 * NR) - p0 * NR, k0, kc);
}

template <int NR, class T, class S = T>
struct DensePackB {
  Matrix<S> m;
  void operator()(T* dst, index j0, index nc, index k0, index kc) const { pack_b<NR>(m, k0, kc, j0, nc, dst); }
  /// op(B)(k0, j0) when op(B) = X holds T: depth k's columns lie side by side in X's row k, ld()
  /// apart, read in place by the kernels (null when op(B) is transposed: a Linear's weight).
  const T* rows(index j0, index k0) const
    requires std::is_same_v<S, T>
  {
    return m.trans ? nullptr : m.p + k0 * m.ld + j0;
  }
  index ld() const { return m.ld; }
};

// ---- the blocked driver --------------------------------------------------------------------

/// C[M x N] (row stride ldc) (+)= op(A) @ op(B) on the calling thread, with the micro-kernels of
/// shape S (a Shape<T, Isa>). Loops, outer to inner: A blocks of MB rows; K in KC slices (pack A);
/// B blocks of NB columns (pack B, kept in L2); A panels (one MR x KC panel stays in L1); B panels
/// -> micro-kernel. pack_a / pack_b follow the DensePack* contract, so packed layouts can come
/// from elsewhere (dequantized weights).
template <class T, class S, class PackA, class PackB, class Epi = NoEpilogue>
void gemm_blocked(const Kernels<T>& kern, index M, index N, index K, const PackA& pack_a_fn, const PackB& pack_b_fn,
                  T* C, index ldc, bool acc, const Epi& epi = {}) {
  constexpr int MR = S::MR, NR = S::NR;
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc)
      for (index i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
    epilogue_all(epi, C, ldc, M, N);
    return;
  }
  const index mb = std::min<index>(S::MB, (M + MR - 1) / MR * MR);
  const index nb = std::min<index>(S::NB, (N + NR - 1) / NR * NR);
  const index kcap = std::min<index>(S::KC, K);
  const std::size_t a_bytes = (static_cast<std::size_t>(mb * kcap) * sizeof(T) + 63) / 64 * 64;
  const std::size_t b_bytes = (static_cast<std::size_t>(nb * kcap) * sizeof(T) + 63) / 64 * 64;
  auto* ws = static_cast<char*>(detail::gemm_workspace(a_bytes + b_bytes + sizeof(T) * MR * NR));
  T* abuf = reinterpret_cast<T*>(ws);
  T* bbuf = reinterpret_cast<T*>(ws + a_bytes);
  T* tile = reinterpret_cast<T*>(ws + a_bytes + b_bytes);
  BlockOperands<T> op{abuf, bbuf};
  for (index i0 = 0; i0 < M; i0 += mb) {
    const index mc = std::min(mb, M - i0);
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0);
      const bool overwrite = !acc && k0 == 0;
      prepare_a<T, S>(pack_a_fn, N, i0, mc, k0, kc, op);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        prepare_b<T, S>(pack_b_fn, mc, j0, nc, k0, kc, op);
        block_product<T, S>(kern, mc, nc, kc, op, C + i0 * ldc + j0, ldc, overwrite, tile, epi, k0 + kc == K, i0, j0);
      }
    }
  }
}

#if defined(_OPENMP)
/// gemm_blocked for a team of `threads` OpenMP threads: each thread owns a slice of C's rows (whole
/// MR tiles) and packs its own A panels; each B block is packed once, its panels shared out over
/// the team, into one buffer they all read (two barriers per block). Every C element sees the same
/// panels and k order as in gemm_blocked, so the result is bit-identical to the serial product.
template <class T, class S, class PackA, class PackB, class Epi = NoEpilogue>
void gemm_team(int threads, const Kernels<T>& kern, index M, index N, index K, const PackA& pack_a_fn,
               const PackB& pack_b_fn, T* C, index ldc, bool acc, const Epi& epi = {}) {
  constexpr int MR = S::MR, NR = S::NR;
  const index nb = std::min<index>(S::NB, (N + NR - 1) / NR * NR);
  const index kcap = std::min<index>(S::KC, K);
  const index rows_per = ((M + threads - 1) / threads + MR - 1) / MR * MR;
  T* bbuf = static_cast<T*>(detail::gemm_workspace(static_cast<std::size_t>(nb * kcap) * sizeof(T), 1));
  detail::team(threads, [&](int thread, int team_size) {
    const index t = thread, nt = team_size;
    const index r0 = std::min(M, t * rows_per), r1 = std::min(M, r0 + rows_per), mine = r1 - r0;
    const index a_rows_n = std::max<index>((mine + MR - 1) / MR * MR, MR);
    const std::size_t a_bytes = (static_cast<std::size_t>(a_rows_n * kcap) * sizeof(T) + 63) / 64 * 64;
    auto* ws = static_cast<char*>(detail::gemm_workspace(a_bytes + sizeof(T) * MR * NR));
    T* abuf = reinterpret_cast<T*>(ws);
    T* tile = reinterpret_cast<T*>(ws + a_bytes);
    BlockOperands<T> op{abuf, bbuf};
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0);
      const bool overwrite = !acc && k0 == 0;
      if (mine > 0) prepare_a<T, S>(pack_a_fn, N, r0, mine, k0, kc, op);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        const index panels = (nc + NR - 1) / NR, per = (panels + nt - 1) / nt;
        const index p0 = std::min(panels, t * per), p1 = std::min(panels, p0 + per);
        prepare_b<T, S>(pack_b_fn, rows_per, j0, nc, k0, kc, op, p0, p1);
#pragma omp barrier
        if (mine > 0)
          block_product<T, S>(kern, mine, nc, kc, op, C + r0 * ldc + j0, ldc, overwrite, tile, epi, k0 + kc == K, r0,
                              j0);
#pragma omp barrier
      }
    }
  });
}
#endif

/// The kernel set in use for T (NN_CPU_ISA may lower it; see cpu_info.hpp), read once.
inline Isa active_isa() { return detail::active_isa(); }

/// f.template operator()<I>() for the run-time ISA `isa`: one instantiation per kernel set.
template <class F>
decltype(auto) with_isa(Isa isa, F&& f) {
  switch (isa) {
    case Isa::avx512: return f.template operator()<Isa::avx512>();
    case Isa::avx2: return f.template operator()<Isa::avx2>();
    case Isa::generic: break;
  }
  return f.template operator()<Isa::generic>();
}

/// Row-major C[M x N] (row stride ldc) (+)= op(A) @ op(B) with the dense packers, on the calling
/// thread, with the micro-kernel of `isa`; then the epilogue on each finished tile.
template <class T, class Epi = NoEpilogue>
void gemm_serial(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                 T* C, index ldc, bool acc, const Epi& epi = {}) {
  const Matrix<T> a{A, lda, ta}, b{B, ldb, tb};
  with_isa(isa, [&]<Isa I>() {
    using S = Shape<T, I>;
    gemm_blocked<T, S>(micro_kernels<T, I>(), M, N, K, DensePackA<S::MR, T>{a}, DensePackB<S::NR, T>{b}, C, ldc, acc,
                       epi);
  });
}

/// The OpenMP team a product of M x N x K pays for from the calling thread: one thread per 2^18
/// multiply-adds (below that a team costs more than it saves), and at least two 12-row tiles (or
/// one 64-column strip) per thread; 1 inside a parallel region.
inline int team_threads(index M, index N, index K) {
#if defined(_OPENMP)
  if (omp_in_parallel() || M <= 0 || N <= 0 || K <= 0) return 1;
  const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
  return std::max(1, static_cast<int>(std::min<double>({static_cast<double>(detail::free_threads()), work / 262144.0,
                                                        static_cast<double>(std::max(M / 24, N / 64))})));
#else
  (void)M, (void)N, (void)K;
  return 1;
#endif
}

/// part(d0, d1) for column ranges of whole 32-wide tiles, one per thread of a team of `threads`:
/// how a short, wide product (too few rows to share out) is split, each thread packing its own.
template <class F>
void split_columns(int threads, index N, F&& part) {
  detail::team(threads, [&](int t, int nt) {
    const index per = ((N + nt - 1) / nt + 31) / 32 * 32;
    const index d0 = std::min(N, t * per), d1 = std::min(N, d0 + per);
    if (d0 < d1) part(d0, d1);
  });
}

/// Whether C (M x N) is so much narrower than a micro-tile (N < NR, and fewer MR-row tiles would
/// hold N than NR-column ones: a LoRA rank, a classifier's outputs) while tall (M >= 2 NR) that
/// its transpose C^T = op(B)^T op(A)^T fills the tiles better: at rank 8 a 12 x 32 tile runs 8 of
/// its 32 columns, its transpose 8 of 12 rows.
template <class T>
bool narrow_product(Isa isa, index M, index N) {
  return with_isa(isa, [&]<Isa I>() {
    using S = Shape<T, I>;
    return N < S::NR && M >= 2 * S::NR && (N + S::MR - 1) / S::MR * S::MR < S::NR;
  });
}

/// dst[c * ldd + r] = src[r * lds + c] for r < rows, c < cols.
template <class T>
void transpose_copy(const T* src, index lds, index rows, index cols, T* dst, index ldd) {
  for (index r = 0; r < rows; ++r)
    for (index c = 0; c < cols; ++c) dst[c * ldd + r] = src[r * lds + c];
}

/// The same, on a team of OpenMP threads (when not already inside a parallel region, and the
/// product is big enough to pay for one): C's rows split over the team, B's packed panels shared
/// (gemm_team); bit-identical to gemm_serial, epilogue included. A narrow_product runs as its
/// transpose into scratch (seeded with C^T when accumulating), then copied back: each element
/// still sums the same products in the same order, so this too is bit-identical.
template <class T, class Epi = NoEpilogue>
void gemm_parallel(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                   T* C, index ldc, bool acc, const Epi& epi = {}) {
  if (K > 0 && narrow_product<T>(isa, M, N)) {
    T* ct = static_cast<T*>(detail::gemm_workspace(sizeof(T) * static_cast<std::size_t>(M * N), 3));  // C^T: (N, M)
    if (acc) transpose_copy(C, ldc, M, N, ct, M);
    gemm_parallel<T>(isa, !tb, !ta, N, M, K, B, ldb, A, lda, ct, M, acc);
    transpose_copy(ct, M, N, M, C, ldc);
    epilogue_all(epi, C, ldc, M, N);
    return;
  }
  const int threads = team_threads(M, N, K);
  if (threads > 1 && M < 24 * threads) {
    split_columns(threads, N, [&](index d0, index d1) {
      gemm_serial<T>(isa, ta, tb, M, d1 - d0, K, A, lda, B + (tb ? d0 * ldb : d0), ldb, C + d0, ldc, acc,
                     ShiftedEpilogue<Epi>{epi, 0, d0});
    });
    return;
  }
#if defined(_OPENMP)
  if (threads > 1) {
    const Matrix<T> a{A, lda, ta}, b{B, ldb, tb};
    with_isa(isa, [&]<Isa I>() {
      using S = Shape<T, I>;
      gemm_team<T, S>(threads, micro_kernels<T, I>(), M, N, K, DensePackA<S::MR, T>{a}, DensePackB<S::NR, T>{b}, C,
                      ldc, acc, epi);
    });
    return;
  }
#endif
  gemm_serial<T>(isa, ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc, epi);
}

/// A batch of products with the same shape, item b at A + b*sa, B + b*sb, C + b*sc: one kernel
/// choice for all, and when each item is too small for a thread team of its own (attention's
/// per-head blocks, a model's batched small matrices), the items shared out over the team, each
/// the single-thread product gemm_parallel would run for it; so bit-identical to calling
/// gemm_parallel per item. Items must not share C (a batch summed into one C is a loop of
/// accumulating calls).
template <class T>
void gemm_batched(Isa isa, index batch, bool ta, bool tb, index M, index N, index K, const T* A, index sa, index lda,
                  const T* B, index sb, index ldb, T* C, index sc, index ldc, bool acc) {
#if defined(_OPENMP)
  int threads = 1;
  if (batch > 1 && team_threads(M, N, K) == 1 && !omp_in_parallel()) {
    const double work = static_cast<double>(batch) * static_cast<double>(M) * static_cast<double>(N) *
                        static_cast<double>(K);
    threads = static_cast<int>(std::min<double>({static_cast<double>(detail::free_threads()),
                                                 static_cast<double>(batch), std::max(1.0, work / 262144.0)}));
  }
  if (threads > 1) {
    detail::team(threads, [&](int, int) {
#pragma omp for schedule(static)
      for (index b = 0; b < batch; ++b)
        gemm_serial<T>(isa, ta, tb, M, N, K, A + b * sa, lda, B + b * sb, ldb, C + b * sc, ldc, acc);
    });
    return;
  }
#endif
  for (index b = 0; b < batch; ++b)
    gemm_parallel<T>(isa, ta, tb, M, N, K, A + b * sa, lda, B + b * sb, ldb, C + b * sc, ldc, acc);
}

// ---- bf16 operands, f32 accumulation -------------------------------------------------------
// Precision::bf16 stores frozen weights in bfloat16 (raw bits in std::uint16_t), and autocast
// rounds float32 weights; either way activations rounded to bf16 multiply them with f32
// accumulation: PyTorch's bf16 autocast contract for a product. Three kernels (Bf16Kernel), equal
// up to the order of f32 additions:
//  - AMX (namespace amx below): bf16 tiles, where the CPU has AMX-BF16 and the OS grants it.
//  - vdpbf16ps, where the CPU has AVX512_BF16: pairs of bf16 (two depths per 32-bit lane) into
//    f32 lanes. A and B panels hold pairs of depths: word (kp, i) = bf16(X(i, 2kp)) |
//    bf16(X(i, 2kp + 1)) << 16.
//  - emulated, on every CPU: the f32 micro-kernels on panels whose values are rounded to bf16 (or
//    widened from it) while packing; bit-identical to the f32 product of the rounded operands.
// The last two reuse the f32 driver (gemm_blocked / gemm_team): a pair panel of kc depths uses the
// first half of the kc x MR floats the driver sets aside for it.

using bf16 = std::uint16_t;

/// Emulated: the f32 packer `Pack` (DensePackA or DensePackB, L-wide panels), then every packed
/// value rounded to bf16. (No in-place rows(): every value must pass through the rounding.)
template <int L, class Pack>
struct Bf16Rounded {
  Pack pack;
  void operator()(float* dst, index o0, index on, index k0, index kc) const {
    pack(dst, o0, on, k0, kc);
    const index n = (on + L - 1) / L * L * kc;
    for (index i = 0; i < n; ++i) dst[i] = half::bf16_round(dst[i]);
  }
};

typedef std::uint32_t pair_word __attribute__((may_alias));  // two bf16 read as one 32-bit lane

#if defined(__x86_64__) || defined(__i386__)
/// vpermw's order that interleaves two rows converted together (vcvtne2ps2bf16: the even depth's
/// 16 bf16 low, the odd one's high) into 16 pair words: word j = bf16 j of each.
alignas(64) inline constexpr std::uint16_t kPairInterleave[32] = {0, 16, 1, 17, 2,  18, 3,  19, 4,  20, 5,
                                                                  21, 6, 22, 7, 23, 8,  24, 9,  25, 10, 26,
                                                                  11, 27, 12, 28, 13, 29, 14, 30, 15, 31};

/// One Bf16PairPackA panel with AVX512_BF16: rows r0..r0+rows (rows <= MR <= 16) of op(A) at
/// depths k0..k0+kc, word (kp, i) at w[kp * MR + i], zero past the edges. vcvtne2ps2bf16 rounds
/// to nearest even and, like every AVX512_BF16 conversion, flushes float32 denormals to zero (as
/// the B and AMX packers do). Element by element, with the scalar rounding, this packing was 21% of
/// the main job's bf16 LoRA step (perf, Zen 5 family 26 model 2).
///  - op(A) = X (activations, dY): a row's pairs lie side by side, so 32 depths convert to its 16
///    words at once; MR such vectors, one per row, are transposed (transpose16_store) into place.
///  - op(A) = X^T (a weight gradient's dY^T): depth k's rows lie side by side in X's row k, so X's
///    rows 2kp and 2kp + 1 convert together and interleave (vpermw) into pair kp's MR words.
template <int MR>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]] inline void pack_pair_rows(
    const Matrix<float>& m, index r0, index rows, index k0, index kc, pair_word* w) {
  static_assert(MR <= 16);
  const index pairs = (kc + 1) / 2;
  if (m.trans) {
    const __m512i inter = _mm512_load_si512(kPairInterleave);
    const __mmask16 in_rows = static_cast<__mmask16>((1u << rows) - 1), out = static_cast<__mmask16>((1u << MR) - 1);
    for (index kp = 0; kp < pairs; ++kp) {
      const float* even = m.p + (k0 + 2 * kp) * m.ld + r0;
      const __m512 lo = _mm512_maskz_loadu_ps(in_rows, even);
      const __m512 hi = 2 * kp + 1 < kc ? _mm512_maskz_loadu_ps(in_rows, even + m.ld) : _mm512_setzero_ps();
      _mm512_mask_storeu_epi32(w + kp * MR, out, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
    return;
  }
  for (index kp0 = 0; kp0 < pairs; kp0 += 16) {
    // depths 2 kp0 .. 2 kp0 + 31 of each row, zero past kc
    const index left = kc - 2 * kp0;
    const __mmask16 m_lo = static_cast<__mmask16>(left >= 16 ? 0xFFFF : (1u << left) - 1);
    const __mmask16 m_hi = static_cast<__mmask16>(left >= 32 ? 0xFFFF : left <= 16 ? 0 : (1u << (left - 16)) - 1);
    __m512 r[16];
    for (int i = 0; i < 16; ++i) {
      r[i] = _mm512_setzero_ps();
      if (i < rows) {
        const float* src = m.p + (r0 + i) * m.ld + k0 + 2 * kp0;
        r[i] = (__m512)_mm512_cvtne2ps_pbh(_mm512_maskz_loadu_ps(m_hi, src + 16), _mm512_maskz_loadu_ps(m_lo, src));
      }
    }
    if (pairs - kp0 >= 16) {
      transpose16_store(r, MR, reinterpret_cast<float*>(w + kp0 * MR), MR);
    } else {  // the last pairs: the transpose writes 16 depths, the panel holds fewer
      alignas(64) pair_word tail[16 * MR];
      transpose16_store(r, MR, reinterpret_cast<float*>(tail), MR);
      std::memcpy(w + kp0 * MR, tail, sizeof(pair_word) * static_cast<std::size_t>((pairs - kp0) * MR));
    }
  }
}
#endif

/// Native: op(A) rows as bf16 pairs, zero past the edge (rows, and the odd last depth).
template <int MR>
struct Bf16PairPackA {
  Matrix<float> m;
  void operator()(float* dst, index i0, index mc, index k0, index kc) const {
    const index pairs = (kc + 1) / 2;
    for (index p = 0; p < mc; p += MR, dst += kc * MR) {
      auto* w = reinterpret_cast<pair_word*>(dst);
      const index rows = std::min<index>(MR, mc - p);
#if defined(__x86_64__) || defined(__i386__)
      if constexpr (MR <= 16) {  // this packer only runs where AVX512_BF16 does (gemm_bf16)
        pack_pair_rows<MR>(m, i0 + p, rows, k0, kc, w);
        continue;
      }
#endif
      for (index kp = 0; kp < pairs; ++kp)
        for (index i = 0; i < MR; ++i) {
          std::uint32_t lo = 0, hi = 0;
          if (i < rows) {
            const index r = i0 + p + i, k = k0 + 2 * kp;
            lo = half::f32_to_bf16(m.at(r, k));
            if (2 * kp + 1 < kc) hi = half::f32_to_bf16(m.at(r, k + 1));
          }
          w[kp * MR + i] = lo | hi << 16;
        }
    }
  }
};

/// The bf16 bits of a B element: bf16 as stored, f32 rounded to nearest even (autocast).
template <class S>
inline std::uint32_t bf16_bits(S v) {
  if constexpr (std::is_same_v<S, bf16>) return v;
  else return half::f32_to_bf16(v);
}

#if defined(__x86_64__) || defined(__i386__)
/// One Bf16PairPackB panel (NR = 32 columns j0.., depths k0..k0+kc) with AVX-512: word (kp, j) =
/// bits(op(B)(k0 + 2kp, j)) | bits(op(B)(k0 + 2kp + 1, j)) << 16, zero past the edges.
///  - op(B) = X^T (a Linear's weight, X[j][k]): each column's pairs lie side by side in X's row j.
///    bf16 rows are already pair words; f32 rows convert 32 floats to 16 words at a time
///    (vcvtne2ps2bf16: round to nearest even, denormals flushed) into a column-major scratch.
///    Either way a transposing copy of 32-bit words (pack_panel) lays the panel out.
///  - op(B) = X (X[k][j]): a pair interleaves rows k and k + 1, 16 columns at a time.
template <class S>
[[gnu::target("avx512f,avx512bw,avx512vl,avx512dq,avx512bf16")]] inline void pack_pair_panel(
    const Matrix<S>& m, index j0, index cols, index k0, index kc, pair_word* w) {
  constexpr int NR = 32;
  const index pairs = (kc + 1) / 2, even = kc / 2;
  auto bits = [&](index k, index c) -> std::uint32_t { return k < k0 + kc && c < j0 + cols ? bf16_bits(m.at(k, c)) : 0; };
  index kp = 0;
  if (m.trans && cols == NR) {
    if constexpr (std::is_same_v<S, bf16>) {
      if (m.ld % 2 == 0 && k0 % 2 == 0) {
        pack_panel<NR>(reinterpret_cast<const pair_word*>(m.p + j0 * m.ld + k0), m.ld / 2, false, cols, even, w);
        kp = even;
      }
    } else {
      // column j's words for pairs 0..full-1 (full: whole 16-word groups), then transposed
      const index full = even / 16 * 16;
      alignas(64) pair_word tmp[NR * 256];
      if (full > 0 && full <= 256) {
        for (index j = 0; j < NR; ++j) {
          const float* src = m.p + (j0 + j) * m.ld + k0;
          for (index q = 0; q < full; q += 16) {
            const __m512 lo = _mm512_loadu_ps(src + 2 * q), hi = _mm512_loadu_ps(src + 2 * q + 16);
            _mm512_store_si512(tmp + j * full + q, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
          }
        }
        pack_panel<NR>(tmp, full, false, NR, full, w);
        kp = full;
      }
    }
  } else if (!m.trans) {
    for (; kp < even; ++kp) {
      const index k = k0 + 2 * kp;
      index j = 0;
      // (the zero-masked forms: GCC 12 warns that the unmasked ones read an undefined register)
      constexpr __mmask16 all = 0xFFFF;
      for (; j + 16 <= cols; j += 16) {
        __m256i lo16, hi16;
        if constexpr (std::is_same_v<S, bf16>) {
          lo16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.p + k * m.ld + j0 + j));
          hi16 = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(m.p + (k + 1) * m.ld + j0 + j));
        } else {
          lo16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(m.p + k * m.ld + j0 + j));
          hi16 = (__m256i)_mm512_cvtneps_pbh(_mm512_loadu_ps(m.p + (k + 1) * m.ld + j0 + j));
        }
        const __m512i lo = _mm512_maskz_cvtepu16_epi32(all, lo16), hi = _mm512_maskz_cvtepu16_epi32(all, hi16);
        _mm512_storeu_si512(w + kp * NR + j, _mm512_or_si512(lo, _mm512_maskz_slli_epi32(all, hi, 16)));
      }
      for (; j < NR; ++j) w[kp * NR + j] = bits(k, j0 + j) | bits(k + 1, j0 + j) << 16;
    }
  }
  for (; kp < pairs; ++kp)
    for (index j = 0; j < NR; ++j) {
      const index k = k0 + 2 * kp;
      w[kp * NR + j] = bits(k, j0 + j) | bits(k + 1, j0 + j) << 16;
    }
}
#endif

/// Native: op(B) columns as bf16 pairs, from bf16 (a stored weight) or f32 (rounded, autocast),
/// one NR = 32 panel at a time (pack_pair_panel).
template <int NR, class S = bf16>
struct Bf16PairPackB {
  static_assert(NR == 32);
  Matrix<S> m;
  void operator()(float* dst, index j0, index nc, index k0, index kc) const {
#if defined(__x86_64__) || defined(__i386__)
    for (index q = 0; q < nc; q += NR, dst += kc * NR)
      pack_pair_panel(m, j0 + q, std::min<index>(NR, nc - q), k0, kc, reinterpret_cast<pair_word*>(dst));
#else
    (void)dst, (void)j0, (void)nc, (void)k0, (void)kc;
#endif
  }
};

#if defined(__x86_64__) || defined(__i386__)
/// The native micro-kernel: a 12 x 32 f32 tile of C from pair panels, 2 x 12 vdpbf16ps per pair.
[[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx512bf16,avx2,fma")]] inline void micro_avx512_bf16(
    index kc, const float* a, index, const float* b, index, float* c, index ldc, bool overwrite) {
  // Pair panels are always packed (Bf16PairPack* offer nothing in place): steps MR and NR pairs.
  constexpr int MR = Shape<float, Isa::avx512>::MR, NR = Shape<float, Isa::avx512>::NR;
  static_assert(NR == 32);
  const auto* aw = reinterpret_cast<const pair_word*>(a);
  const auto* bw = reinterpret_cast<const pair_word*>(b);
  __m512 acc[MR][2];
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i) acc[i][0] = acc[i][1] = _mm512_setzero_ps();
  const index pairs = (kc + 1) / 2;
  for (index kp = 0; kp < pairs; ++kp) {
    const __m512bh b0 = (__m512bh)_mm512_loadu_si512(bw + kp * NR);
    const __m512bh b1 = (__m512bh)_mm512_loadu_si512(bw + kp * NR + 16);
    NN_GEMM_UNROLL(16)
    for (int i = 0; i < MR; ++i) {
      const __m512bh ai = (__m512bh)_mm512_set1_epi32(static_cast<int>(aw[kp * MR + i]));
      acc[i][0] = _mm512_dpbf16_ps(acc[i][0], ai, b0);
      acc[i][1] = _mm512_dpbf16_ps(acc[i][1], ai, b1);
    }
  }
  NN_GEMM_UNROLL(16)
  for (int i = 0; i < MR; ++i)
    for (int j = 0; j < 2; ++j) {
      __m512 v = acc[i][j];
      if (!overwrite) v = _mm512_add_ps(v, _mm512_loadu_ps(c + i * ldc + 16 * j));
      _mm512_storeu_ps(c + i * ldc + 16 * j, v);
    }
}
#endif

#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
// ---- AMX: bf16 tiles (Sapphire Rapids and later) --------------------------------------------
// A core's AMX unit multiplies a 16 x 32 bf16 tile by a 32 x 16 one into 16 x 16 f32 in one
// instruction (tdpbf16ps): 16 times the multiply-adds of an AVX-512 FMA. The micro-tile is 32 x
// 32 of C in four accumulator tiles, fed per 32 depths by two A tiles (16 rows x 16 pairs each,
// row-major pairs: word (r, kp) = bf16(A(r, 2kp)) | bf16(A(r, 2kp + 1)) << 16) and two B tiles
// (16 pairs x 16 columns: Bf16PairPackB's panel layout, 32 columns per panel row).
namespace amx {

inline constexpr index MR = 32, NR = 32, KC = 512, NB = 256, MB = 256;  // KC: depths, a multiple of 32

/// Linux grants the AMX tile state on request (arch_prctl ARCH_REQ_XCOMP_PERM for
/// XFEATURE_XTILEDATA), once per process for all its threads. False when the CPU or the OS (XCR0)
/// has no AMX-BF16, or the request is refused.
inline bool available() {
  static const bool ok = [] {
    const CpuFeatures f = detail::detect_cpu_features();
    constexpr long kReqXcompPerm = 0x1023, kXtiledata = 18;
    return f.amx_tile && f.amx_bf16 && f.avx512_bf16 && syscall(SYS_arch_prctl, kReqXcompPerm, kXtiledata) == 0;
  }();
  return ok;
}

/// Tiles 0-3: C (16 rows x 16 f32), 4-5: A, 6-7: B (16 rows x 64 bytes), set once per thread (the
/// configuration is thread state).
struct alignas(64) TileConfig {
  std::uint8_t palette = 1, start_row = 0, reserved[14] = {};
  std::uint16_t colsb[16] = {};
  std::uint8_t rows[16] = {};
};
[[gnu::target("amx-tile")]] inline void configure_thread() {
  // Static storage, not a local: GCC 12 does not see ldtilecfg read its operand and drops the
  // stores that fill a local configuration (the instruction then faults on garbage).
  static const TileConfig config = [] {
    TileConfig c;
    for (int t = 0; t < 8; ++t) c.colsb[t] = 64, c.rows[t] = 16;
    return c;
  }();
  thread_local bool done = false;
  if (done) return;
  if (!available()) detail::fail("gemm", "AMX tiles are not available in this process (CPU, OS or permission)");
  _tile_loadconfig(&config);
  done = true;
}

/// C[32 x 32] (row stride ldc) (+)= A panel (32 rows x `pairs` words, row-major) @ B panel
/// (`pairs` x 32 words); pairs is a multiple of 16 (zero pairs pad the depth).
[[gnu::target("amx-tile,amx-bf16")]] inline void micro(index pairs, const pair_word* a, const pair_word* b, float* c,
                                                         index ldc, bool overwrite) {
  const long cs = ldc * 4, as = pairs * 4;
  if (overwrite) {
    _tile_zero(0);
    _tile_zero(1);
    _tile_zero(2);
    _tile_zero(3);
  } else {
    _tile_loadd(0, c, cs);
    _tile_loadd(1, c + 16, cs);
    _tile_loadd(2, c + 16 * ldc, cs);
    _tile_loadd(3, c + 16 * ldc + 16, cs);
  }
  for (index k = 0; k < pairs; k += 16) {
    _tile_loadd(4, a + k, as);
    _tile_loadd(5, a + 16 * pairs + k, as);
    _tile_loadd(6, b + k * NR, NR * 4);
    _tile_loadd(7, b + k * NR + 16, NR * 4);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    _tile_dpbf16ps(2, 5, 6);
    _tile_dpbf16ps(3, 5, 7);
  }
  _tile_stored(0, c, cs);
  _tile_stored(1, c + 16, cs);
  _tile_stored(2, c + 16 * ldc, cs);
  _tile_stored(3, c + 16 * ldc + 16, cs);
}

/// The pair words of 16 rows r0.. of a transposed A (op(A) = X^T, so depth k of those rows is
/// X's row k, the rows side by side) at `pairs` pair depths from k0, written to 16 panel rows
/// of stride p16: two X rows (depths 2kp, 2kp + 1) convert to 16 rows' words at once (one
/// vcvtne2ps2bf16, interleaved by vpermw), and 16 such vectors are a 16 x 16 block of words that
/// transpose16 turns into each row's run of 16 words. Rows past nr read as zero. pairs: a
/// multiple of 16.
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] inline void pack_a_transposed(const float* x, index ld,
                                                                                      index nr, index pairs,
                                                                                      index p16, pair_word* dst) {
  alignas(64) pair_word blk[16 * 16];
  const __m512i inter = _mm512_load_si512(kPairInterleave);
  const __mmask16 rows = static_cast<__mmask16>((1u << nr) - 1);
  for (index kp0 = 0; kp0 < pairs; kp0 += 16) {
    for (int u = 0; u < 16; ++u) {
      const float* even = x + 2 * (kp0 + u) * ld;
      const __m512 lo = _mm512_maskz_loadu_ps(rows, even), hi = _mm512_maskz_loadu_ps(rows, even + ld);
      _mm512_store_si512(blk + 16 * u, _mm512_permutexvar_epi16(inter, (__m512i)_mm512_cvtne2ps_pbh(hi, lo)));
    }
    transpose16(reinterpret_cast<const float*>(blk), 16, 16, reinterpret_cast<float*>(dst + kp0), p16);
  }
}

/// Packs op(A)[i0 : i0+mc, k0 : k0+kc] as row-major pair panels of 32 rows x p16 words, zero past
/// the edges. Full rows of an untransposed A convert 32 floats at a time (vcvtne2ps2bf16, round
/// to nearest even; like every AVX512_BF16 conversion it flushes float32 denormals to zero); a
/// transposed A (a weight gradient's dY^T) goes 16 rows x 32 depths at a time (pack_a_transposed).
[[gnu::target("avx512f,avx512bw,avx512vl,avx512bf16")]] inline void pack_a(const Matrix<float>& m, index i0, index mc,
                                                                           index k0, index kc, index p16,
                                                                           pair_word* dst) {
  const index vec_pairs = m.trans ? kc / 32 * 16 : 0;  // pairs the transposed path covers
  for (index p = 0; p < mc; p += MR, dst += MR * p16) {
    if (vec_pairs > 0)
      for (index r0 = 0; r0 < MR && p + r0 < mc; r0 += 16)
        pack_a_transposed(m.p + k0 * m.ld + i0 + p + r0, m.ld, std::min<index>(16, mc - p - r0), vec_pairs, p16,
                          dst + r0 * p16);
    for (index r = 0; r < MR; ++r) {
      pair_word* w = dst + r * p16;
      if (p + r >= mc) {
        std::fill_n(w, p16, 0u);
        continue;
      }
      const index row = i0 + p + r;
      index kp = vec_pairs;
      if (!m.trans)
        for (const float* src = m.p + row * m.ld + k0; 2 * kp + 32 <= kc; kp += 16) {
          const __m512 lo = _mm512_loadu_ps(src + 2 * kp), hi = _mm512_loadu_ps(src + 2 * kp + 16);
          _mm512_storeu_si512(w + kp, (__m512i)_mm512_cvtne2ps_pbh(hi, lo));
        }
      for (; kp < p16; ++kp) {
        const index k = 2 * kp;
        const std::uint32_t lo = k < kc ? half::f32_to_bf16(m.at(row, k0 + k)) : 0;
        const std::uint32_t hi = k + 1 < kc ? half::f32_to_bf16(m.at(row, k0 + k + 1)) : 0;
        w[kp] = lo | hi << 16;
      }
    }
  }
}

/// C[M x N] (row stride ldc) (+)= bf16(op(A)) @ op(B) on the calling thread: A blocks of MB rows,
/// K in KC slices (A packed), B blocks of NB columns (packed), 32 x 32 micro-tiles; an edge tile
/// is computed whole into a scratch tile and its valid part copied.
template <class SB>
void gemm(bool ta, bool tb, index M, index N, index K, const float* A, index lda, const SB* B, index ldb, float* C,
          index ldc, bool acc) {
  configure_thread();
  const Matrix<float> am{A, lda, ta};
  const Bf16PairPackB<NR, SB> pack_b{Matrix<SB>{B, ldb, tb}};
  const index kcap = std::min<index>(KC, (K + 31) / 32 * 32), pcap = kcap / 2;
  const index mb = std::min<index>(MB, (M + MR - 1) / MR * MR), nb = std::min<index>(NB, (N + NR - 1) / NR * NR);
  auto* a_blk = static_cast<pair_word*>(
      detail::gemm_workspace(sizeof(pair_word) * static_cast<std::size_t>(mb * pcap + pcap * nb + MR * NR)));
  pair_word* b_blk = a_blk + mb * pcap;
  float* tile = reinterpret_cast<float*>(b_blk + pcap * nb);
  for (index i0 = 0; i0 < M; i0 += mb) {
    const index mc = std::min(mb, M - i0);
    for (index k0 = 0; k0 < K; k0 += kcap) {
      const index kc = std::min(kcap, K - k0), pairs = (kc + 1) / 2, p16 = (pairs + 15) / 16 * 16;
      const bool overwrite = !acc && k0 == 0;
      pack_a(am, i0, mc, k0, kc, p16, a_blk);
      for (index j0 = 0; j0 < N; j0 += nb) {
        const index nc = std::min(nb, N - j0);
        for (index q = 0; q < nc; q += NR) {
          pair_word* bp = b_blk + q * p16;
          pack_b(reinterpret_cast<float*>(bp), j0 + q, std::min(NR, nc - q), k0, kc);
          std::fill(bp + pairs * NR, bp + p16 * NR, 0u);
        }
        for (index ir = 0; ir < mc; ir += MR)
          for (index jr = 0; jr < nc; jr += NR) {
            const pair_word *ap = a_blk + ir * p16, *bp = b_blk + jr * p16;
            const index rows = std::min(MR, mc - ir), cols = std::min(NR, nc - jr);
            float* c = C + (i0 + ir) * ldc + j0 + jr;
            if (rows == MR && cols == NR) {
              micro(p16, ap, bp, c, ldc, overwrite);
              continue;
            }
            micro(p16, ap, bp, tile, NR, true);
            for (index r = 0; r < rows; ++r)
              for (index x = 0; x < cols; ++x)
                c[r * ldc + x] = overwrite ? tile[r * NR + x] : c[r * ldc + x] + tile[r * NR + x];
          }
      }
    }
  }
}

}  // namespace amx
#endif

/// The bf16 product kernels: the f32 kernels on rounded/widened panels (every CPU), vdpbf16ps
/// (AVX512_BF16 with the AVX-512 set in use), AMX tiles (AMX-BF16, granted by the OS).
enum class Bf16Kernel : std::uint8_t { emulated, avx512_bf16, amx };

inline const char* bf16_kernel_name(Bf16Kernel k) {
  switch (k) {
    case Bf16Kernel::amx: return "amx tdpbf16ps";
    case Bf16Kernel::avx512_bf16: return "native vdpbf16ps";
    case Bf16Kernel::emulated: break;
  }
  return "emulated (f32 kernels)";
}

/// True when kernel k can run here (NN_CPU_ISA=avx2 or generic rules out both native ones).
inline bool bf16_kernel_available(Bf16Kernel k) {
  const bool avx512 = active_isa() == Isa::avx512 && detail::detect_cpu_features().avx512_bf16;
  switch (k) {
    case Bf16Kernel::emulated: return true;
    case Bf16Kernel::avx512_bf16: return avx512;
    case Bf16Kernel::amx:
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
      return avx512 && amx::available();
#else
      return false;
#endif
  }
  return false;
}

template <class SB>
void gemm_bf16(Isa isa, Bf16Kernel kernel, bool ta, bool tb, index M, index N, index K, const float* A, index lda,
               const SB* B, index ldb, float* C, index ldc, bool acc, bool parallel);

/// The bf16 kernel this process runs, decided once by measurement, not by CPU model: every kernel
/// that can run here times one L2-resident product (64 x 256 x 512, best of 5, well under a
/// millisecond each) and the fastest is kept. On the Sapphire Rapids kind AMX wins by far, and
/// vdpbf16ps loses to the emulation (0.6-0.7x the f32 FMA rate). NN_BF16=amx|native|emulated
/// fixes the choice where that kernel can run.
inline Bf16Kernel bf16_kernel() {
  static const Bf16Kernel chosen = [] {
    std::vector<Bf16Kernel> cands;
    for (Bf16Kernel k : {Bf16Kernel::emulated, Bf16Kernel::avx512_bf16, Bf16Kernel::amx})
      if (bf16_kernel_available(k)) cands.push_back(k);
    if (const char* e = std::getenv("NN_BF16")) {
      const std::string want = e;
      for (Bf16Kernel k : cands)
        if ((want == "amx" && k == Bf16Kernel::amx) || (want == "native" && k == Bf16Kernel::avx512_bf16) ||
            (want == "emulated" && k == Bf16Kernel::emulated))
          return k;
    }
    if (cands.size() == 1) return cands[0];
    constexpr index M = 64, N = 256, K = 512;
    std::vector<float> a(M * K, 0.5f), c(M * N);
    std::vector<bf16> b(K * N, 0x3f00);  // 0.5
    auto best = [&](Bf16Kernel k) {
      double t = 1e30;
      for (int r = 0; r < 6; ++r) {  // the first run warms the packing space and the caches
        const auto t0 = std::chrono::steady_clock::now();
        gemm_bf16<bf16>(active_isa(), k, false, true, M, N, K, a.data(), K, b.data(), K, c.data(), N, false, false);
        if (r > 0) t = std::min(t, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      }
      return t;
    };
    Bf16Kernel pick = cands[0];
    double t_pick = best(pick);
    for (std::size_t i = 1; i < cands.size(); ++i) {
      const double t = best(cands[i]);
      if (t < t_pick) pick = cands[i], t_pick = t;
    }
    return pick;
  }();
  return chosen;
}

/// C[M x N] (row stride ldc) (+)= bf16(op(A)) @ bf16(op(B)): A f32 (rounded to bf16 while
/// packing), B bf16 (a stored weight) or f32 (rounded too: autocast), f32 accumulation, on up to
/// team_threads() threads when `parallel`, with `kernel` (one bf16_kernel_available() says can
/// run; the emulation runs on `isa`'s f32 kernels).
template <class SB>
void gemm_bf16(Isa isa, Bf16Kernel kernel, bool ta, bool tb, index M, index N, index K, const float* A, index lda,
               const SB* B, index ldb, float* C, index ldc, bool acc, bool parallel) {
  static_assert(std::is_same_v<SB, bf16> || std::is_same_v<SB, float>);
  const int threads = parallel ? team_threads(M, N, K) : 1;
  // AMX packs its own B columns per thread (each thread's share of the weight), so it always
  // splits by columns; the others share B panels over the team unless C is short and wide.
  if (threads > 1 && (M < 24 * threads || kernel == Bf16Kernel::amx)) {
    split_columns(threads, N, [&](index d0, index d1) {
      gemm_bf16(isa, kernel, ta, tb, M, d1 - d0, K, A, lda, B + (tb ? d0 * ldb : d0), ldb, C + d0, ldc, acc, false);
    });
    return;
  }
  if (M <= 0 || N <= 0) return;
  if (K <= 0) {
    if (!acc)
      for (index i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, 0.0f);
    return;
  }
#if (defined(__x86_64__) || defined(__i386__)) && defined(__linux__)
  if (kernel == Bf16Kernel::amx) return amx::gemm(ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc);
#endif
  const Matrix<float> a{A, lda, ta};
  const Matrix<SB> b{B, ldb, tb};
  auto run = [&]<class S>(const Kernels<float>& kern, const auto& pack_a_fn, const auto& pack_b_fn) {
#if defined(_OPENMP)
    if (threads > 1) return gemm_team<float, S>(threads, kern, M, N, K, pack_a_fn, pack_b_fn, C, ldc, acc);
#endif
    gemm_blocked<float, S>(kern, M, N, K, pack_a_fn, pack_b_fn, C, ldc, acc);
  };
#if defined(__x86_64__) || defined(__i386__)
  if (kernel == Bf16Kernel::avx512_bf16) {
    using S = Shape<float, Isa::avx512>;
    const Kernels<float> kern{&micro_avx512_bf16, &micro_avx512_bf16};
    run.template operator()<S>(kern, Bf16PairPackA<S::MR>{a}, Bf16PairPackB<S::NR, SB>{b});
    return;
  }
#endif
  with_isa(isa, [&]<Isa I>() {
    using S = Shape<float, I>;
    const Bf16Rounded<S::MR, DensePackA<S::MR, float>> pack_a_fn{{a}};
    if constexpr (std::is_same_v<SB, bf16>)  // bf16 B is widened exactly: nothing to round
      run.template operator()<S>(micro_kernels<float, I>(), pack_a_fn, DensePackB<S::NR, float, bf16>{b});
    else
      run.template operator()<S>(micro_kernels<float, I>(), pack_a_fn, Bf16Rounded<S::NR, DensePackB<S::NR, float>>{{b}});
  });
}

/// "nn avx512 12x32 f32 / 12x16 f64 + gemv": the engine and tile shapes for an ISA (gemv.hpp's
/// one-row products run on the same ISA).
inline std::string describe(Isa isa) {
  return with_isa(isa, [&]<Isa I>() {
    return "nn " + std::string(isa_name(I)) + " " + std::to_string(Shape<float, I>::MR) + "x" +
           std::to_string(Shape<float, I>::NR) + " f32 / " + std::to_string(Shape<double, I>::MR) + "x" +
           std::to_string(Shape<double, I>::NR) + " f64 + gemv";
  });
}

}  // namespace gemm
#endif  // NN_OWN_GEMM

}  // namespace nn

// ---- end nn/backend/gemm.hpp ----
// ---- begin nn/backend/gemv.hpp ----
// nn's own matrix-vector products, the one-row (or one-column) products a GEMM's packing does not
// pay for: decoding one token (x (1, C) @ W^T for every projection and the head), a batch of one,
// a vector's gradient; and x @ W^T on 2-4 rows (a few tokens decoded side by side), where the
// GEMM would pack all of W for a 12-row tile. Two forms cover every op(A) @ op(B) with M == 1 or
// N == 1 on row-major matrices (gemv_product below maps them; backend/cpu/matmul.hpp calls it):
//   dot rows:  y[i] (+)= sum_k m[i*ld + k] x[k]   (the matrix's rows run along the vector; up to
//              four vectors x at once, each row read once for all of them)
//   axpy rows: y[j] (+)= sum_k x[k] m[k*ld + j]   (the matrix's rows run along the output)
// Why nn owns them: they went to Eigen's expressions, whose SIMD width is the one the user's
// translation unit was compiled for; without -march (the README's build, a distro's) that is SSE2
// on an AVX-512 machine. Like gemm.hpp's micro-kernels, each body is written once with GCC/Clang
// vector extensions and compiled per ISA under a target attribute, chosen at run time from CPUID.
// Both read the matrix once, front to back along its rows: the products are memory-bound, so
// the bodies keep enough independent accumulators in flight to stream, and no more.


#if defined(NN_OWN_GEMM)
namespace nn {
namespace gemm {

/// v = the W lanes at p (unaligned); the lanes of v added up. Free functions taking vectors by
/// reference, not lambdas: a lambda does not inherit its caller's target attribute, and a vector
/// passed by value crosses an ABI these are inlined away from.
template <class V, class T>
[[gnu::always_inline]] inline void gemv_load(V& v, const T* p) {
  __builtin_memcpy(&v, p, sizeof(V));
}
template <class T, int W, class V>
[[gnu::always_inline]] inline T gemv_lanes(const V& v) {
  // halves added pairwise (log2 W dependent adds, not W: one row's sum cost more than its dot
  // at 576 columns, added lane by lane)
  if constexpr (W == 1) {
    return v[0];
  } else {
    typedef T H __attribute__((vector_size(W / 2 * sizeof(T))));
    H lo, hi;
    __builtin_memcpy(&lo, &v, sizeof(H));
    __builtin_memcpy(&hi, reinterpret_cast<const char*>(&v) + sizeof(H), sizeof(H));
    const H sum = lo + hi;
    return gemv_lanes<T, W / 2>(sum);
  }
}

/// Dot rows for RB rows of m at once (m and y at the block's first row) against NX vectors x
/// (x + n*ldx): y[n*ldy + r] (+)= sum_k m[r*ld + k] x[n*ldx + k]. RB x NX x U accumulators of W
/// lanes, each row's load shared by the NX vectors; the lanes are added at the end, then the
/// k past the last full step (the order differs from a serial dot, within float rounding).
template <class T, int W, int NX, int U, int RB>
[[gnu::always_inline]] inline void gemv_dot_block(index cols, const T* __restrict m, index ld, const T* __restrict x,
                                                  index ldx, T* __restrict y, index ldy, bool acc) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  const index kv = cols / (U * W) * (U * W);
  V a[RB][NX][U] = {};
  for (index k = 0; k < kv; k += U * W) {
    V xv[NX][U];
    NN_GEMM_UNROLL(4)
    for (int n = 0; n < NX; ++n)
      NN_GEMM_UNROLL(4)
      for (int u = 0; u < U; ++u) gemv_load(xv[n][u], x + n * ldx + k + u * W);
    NN_GEMM_UNROLL(4)
    for (int r = 0; r < RB; ++r)
      NN_GEMM_UNROLL(4)
      for (int u = 0; u < U; ++u) {
        V mv;
        gemv_load(mv, m + r * ld + k + u * W);
        NN_GEMM_UNROLL(4)
        for (int n = 0; n < NX; ++n) a[r][n][u] += mv * xv[n][u];
      }
  }
  NN_GEMM_UNROLL(4)
  for (int r = 0; r < RB; ++r)
    NN_GEMM_UNROLL(4)
    for (int n = 0; n < NX; ++n) {
      V sum = a[r][n][0];
      NN_GEMM_UNROLL(4)
      for (int u = 1; u < U; ++u) sum += a[r][n][u];
      T s = gemv_lanes<T, W>(sum);
      for (index k = kv; k < cols; ++k) s += m[r * ld + k] * x[n * ldx + k];
      T& out = y[n * ldy + r];
      out = acc ? out + s : s;
    }
}

/// Dot rows: y[n*ldy + i] (+)= sum_k m[i*ld + k] * x[n*ldx + k] for i < rows, k < cols and NX
/// vectors n (1-4: a token, or a few decoded side by side), reading m once for all of them
/// (overwrite unless acc). Blocks of four rows (two where NX > 2 on 16-register ISAs); with one
/// vector, two accumulators per row, so eight loads stream per step.
template <class T, int W, int NX>
[[gnu::always_inline]] inline void gemv_dot_rows_body(index rows, index cols, const T* __restrict m, index ld,
                                                      const T* __restrict x, index ldx, T* __restrict y, index ldy,
                                                      bool acc) {
  constexpr int U = NX == 1 ? 2 : 1, R = (NX <= 2 || W * sizeof(T) >= 64) ? 4 : 2;
  index i = 0;
  for (; i + R <= rows; i += R) gemv_dot_block<T, W, NX, U, R>(cols, m + i * ld, ld, x, ldx, y + i, ldy, acc);
  for (; i < rows; ++i) gemv_dot_block<T, W, NX, U, 1>(cols, m + i * ld, ld, x, ldx, y + i, ldy, acc);
}

/// Axpy rows: y[j] (+)= sum_k x[k] * m[k*ld + j] for j < cols, k < rows (overwrite unless acc).
/// Four rows at a time, each swept across y in strips of 8 vectors held in registers: the four
/// rows are four front-to-back streams (a strip of one row at a time across all rows was 25%
/// slower past L2, its reads a row apart), and y (one row's width, in L1) is read and written
/// once per four rows. y starts as 0 unless acc; columns past the last full vector go one by one.
template <class T, int W>
[[gnu::always_inline]] inline void gemv_axpy_rows_body(index rows, index cols, const T* __restrict m, index ld,
                                                       const T* __restrict x, T* __restrict y, bool acc) {
  typedef T V __attribute__((vector_size(W * sizeof(T))));
  constexpr int R = 4, NV = 8;
  const index jv = cols / W * W;
  if (!acc) std::fill_n(y, cols, T(0));
  index k = 0;
  for (; k + R <= rows; k += R) {
    V xb[R];
    NN_GEMM_UNROLL(4)
    for (int r = 0; r < R; ++r) xb[r] = V{} + x[k + r];
    index j = 0;
    for (; j + NV * W <= cols; j += NV * W) {
      V a[NV];
      NN_GEMM_UNROLL(8)
      for (int v = 0; v < NV; ++v) gemv_load(a[v], y + j + v * W);
      NN_GEMM_UNROLL(4)
      for (int r = 0; r < R; ++r)
        NN_GEMM_UNROLL(8)
        for (int v = 0; v < NV; ++v) {
          V mv;
          gemv_load(mv, m + (k + r) * ld + j + v * W);
          a[v] += mv * xb[r];
        }
      NN_GEMM_UNROLL(8)
      for (int v = 0; v < NV; ++v) __builtin_memcpy(y + j + v * W, &a[v], sizeof(V));
    }
    for (; j < jv; j += W) {
      V a;
      gemv_load(a, y + j);
      NN_GEMM_UNROLL(4)
      for (int r = 0; r < R; ++r) {
        V mv;
        gemv_load(mv, m + (k + r) * ld + j);
        a += mv * xb[r];
      }
      __builtin_memcpy(y + j, &a, sizeof(V));
    }
    for (; j < cols; ++j)
      for (int r = 0; r < R; ++r) y[j] += x[k + r] * m[(k + r) * ld + j];
  }
  for (; k < rows; ++k) {
    const V xb = V{} + x[k];
    index j = 0;
    for (; j < jv; j += W) {
      V a, mv;
      gemv_load(a, y + j);
      gemv_load(mv, m + k * ld + j);
      a += mv * xb;
      __builtin_memcpy(y + j, &a, sizeof(V));
    }
    for (; j < cols; ++j) y[j] += x[k] * m[k * ld + j];
  }
}

/// The two forms' entry points per ISA: the same bodies, compiled for each instruction set.
/// dot[n - 1] takes n vectors.
template <class T>
struct GemvKernels {
  using Dot = void (*)(index rows, index cols, const T* m, index ld, const T* x, index ldx, T* y, index ldy, bool acc);
  using Axpy = void (*)(index rows, index cols, const T* m, index ld, const T* x, T* y, bool acc);
  Dot dot[4];
  Axpy axpy;
};
#define NN_GEMV_ENTRY(ATTR)                                                                                          \
  static constexpr int W = Shape<T, I>::W;                                                                           \
  template <int NX>                                                                                                  \
  ATTR static void dot(index r, index c, const T* m, index ld, const T* x, index ldx, T* y, index ldy, bool acc) {   \
    gemv_dot_rows_body<T, W, NX>(r, c, m, ld, x, ldx, y, ldy, acc);                                                  \
  }                                                                                                                  \
  ATTR static void axpy(index r, index c, const T* m, index ld, const T* x, T* y, bool acc) {                        \
    gemv_axpy_rows_body<T, W>(r, c, m, ld, x, y, acc);                                                               \
  }
template <class T, Isa I>
struct GemvEntry {
  NN_GEMV_ENTRY()
};
#if defined(__x86_64__) || defined(__i386__)
template <class T>
struct GemvEntry<T, Isa::avx2> {
  static constexpr Isa I = Isa::avx2;
  NN_GEMV_ENTRY([[gnu::target("avx2,fma")]])
};
template <class T>
struct GemvEntry<T, Isa::avx512> {
  static constexpr Isa I = Isa::avx512;
  NN_GEMV_ENTRY([[gnu::target("avx512f,avx512dq,avx512bw,avx512vl,avx2,fma")]])
};
#endif
#undef NN_GEMV_ENTRY

template <class T>
GemvKernels<T> gemv_kernels(Isa isa) {
  return with_isa(isa, [&]<Isa I>() {
    using E = GemvEntry<T, I>;
    return GemvKernels<T>{{&E::template dot<1>, &E::template dot<2>, &E::template dot<3>, &E::template dot<4>},
                          &E::axpy};
  });
}

/// The team a matrix-vector product of rows x cols pays for: one thread per 2^18 multiply-adds
/// (gemm.hpp's rule; a 1536 x 576 matrix ran 116 -> 26-46 us on two threads, a 576 x 576 one
/// is left on one), at least 64 outputs each; 1 inside a parallel region.
inline int gemv_threads(index outputs, index rows, index cols) {
#if defined(_OPENMP)
  if (omp_in_parallel()) return 1;
  const double work = static_cast<double>(rows) * static_cast<double>(cols);
  return std::max(1, static_cast<int>(std::min<double>(
                         {static_cast<double>(detail::free_threads()), work / 262144.0, static_cast<double>(outputs / 64)})));
#else
  (void)outputs, (void)rows, (void)cols;
  return 1;
#endif
}

/// y[n*ldy + i] (+)= sum_k m[i*ld + k] x[n*ldx + k]: the row-major matrix m (rows x cols, row
/// stride ld) dotted with nv vectors (1-4) at once, y = x @ m^T for x (nv, cols), y (nv, rows).
/// The rows are split over a team (split_columns' 32-wide whole pieces) past 2^18 multiply-adds;
/// each output is summed by one thread in one order whatever the team, so the result does not
/// depend on it.
template <class T>
void gemv_dot(Isa isa, int nv, index rows, index cols, const T* m, index ld, const T* x, index ldx, T* y, index ldy,
              bool acc) {
  if (rows == 0 || nv == 0) return;
  const auto dot = gemv_kernels<T>(isa).dot[nv - 1];
  const int threads = gemv_threads(rows, rows, cols * nv);
  if (threads <= 1) return dot(rows, cols, m, ld, x, ldx, y, ldy, acc);
  split_columns(threads, rows, [&](index d0, index d1) { dot(d1 - d0, cols, m + d0 * ld, ld, x, ldx, y + d0, ldy, acc); });
}

/// y (+)= the product of the row-major matrix m (rows x cols, row stride ld) with one vector x:
///   along_rows (dot rows):   y (rows)  = m @ x,   x (cols)
///   !along_rows (axpy rows): y (cols)  = m^T @ x, x (rows)
/// x is read at stride incx (a column of a row-major matrix; copied to a contiguous buffer
/// first). Threads as gemv_dot (the columns of y split for axpy rows).
template <class T>
void gemv(Isa isa, bool along_rows, index rows, index cols, const T* m, index ld, const T* x, index incx, T* y,
          bool acc) {
  const index nx = along_rows ? cols : rows, ny = along_rows ? rows : cols;
  if (ny == 0) return;
  if (nx == 0) {
    if (!acc) std::fill_n(y, ny, T(0));
    return;
  }
  if (incx != 1) {  // rare: a (K, 1) operand has stride 1; grown once per thread, never freed
    thread_local std::vector<T> xc;
    if (xc.size() < static_cast<std::size_t>(nx)) xc.resize(static_cast<std::size_t>(nx));
    for (index k = 0; k < nx; ++k) xc[static_cast<std::size_t>(k)] = x[k * incx];
    x = xc.data();
  }
  if (along_rows) return gemv_dot<T>(isa, 1, rows, cols, m, ld, x, 0, y, 0, acc);
  const auto axpy = gemv_kernels<T>(isa).axpy;
  const int threads = gemv_threads(cols, rows, cols);
  if (threads <= 1) return axpy(rows, cols, m, ld, x, y, acc);
  split_columns(threads, cols, [&](index d0, index d1) { axpy(rows, d1 - d0, m + d0, ld, x, y + d0, acc); });
}

/// The most rows of x @ W^T nn's dot rows take (reading W once for all); more go to the GEMM.
inline constexpr index kGemvRows = 4;

/// Whether row-major C = op(A) @ op(B) (M x N x K) runs as GEMV here rather than the GEMM: one
/// row or one column, or up to kGemvRows rows of x @ W^T (A's rows and B's rows along k: a
/// Linear's forward on a few tokens), where packing W for the GEMM costs more than reading it.
inline bool gemv_applies(bool ta, bool tb, index M, index N) {
  return M == 1 || N == 1 || (M <= kGemvRows && !ta && tb);
}

/// Row-major C (+)= op(A) @ op(B) when gemv_applies (C contiguous, M x N). M == 1: C's row =
/// op(A)'s row (A, or A's column at stride lda) times op(B), whose rows run along k when tb.
/// N == 1: C's column = op(A) times op(B)'s column. Otherwise C = A @ B^T on M <= 4 rows.
template <class T>
void gemv_product(Isa isa, bool ta, bool tb, index M, index N, index K, const T* A, index lda, const T* B, index ldb,
                  T* C, bool acc) {
  if (M > 1 && N > 1) {
    // few rows of x @ W^T: each of W's N rows dotted with the M rows of A
    gemv_dot<T>(isa, static_cast<int>(M), N, K, B, ldb, A, lda, C, N, acc);
  } else if (M == 1) {
    // x_k = op(A)(0, k); op(B) (K x N): B (N x K) dotted row by row when tb, else rows of B (K x N)
    if (tb) gemv<T>(isa, true, N, K, B, ldb, A, ta ? lda : 1, C, acc);
    else gemv<T>(isa, false, K, N, B, ldb, A, ta ? lda : 1, C, acc);
  } else {
    // N == 1: x_k = op(B)(k, 0); op(A) (M x K): A (M x K) dotted row by row, or rows of A (K x M)
    if (!ta) gemv<T>(isa, true, M, K, A, lda, B, tb ? 1 : ldb, C, acc);
    else gemv<T>(isa, false, K, M, A, lda, B, tb ? 1 : ldb, C, acc);
  }
}

}  // namespace gemm
}  // namespace nn
#endif  // NN_OWN_GEMM
// ---- end nn/backend/gemv.hpp ----

namespace nn {

namespace detail {

// ---- GEMM on Eigen's kernel without Eigen's per-call heap allocations ------------------------
// `C.noalias() = A * B` heap-allocates Eigen's packing blocks on every call once they pass
// EIGEN_STACK_ALLOCATION_LIMIT (128 KiB: products past about 180 x 180 floats), and its OpenMP
// path allocates the shared packed A on every call. A replay must not allocate, so nn runs Eigen's
// blocked kernel (internal::general_matrix_matrix_product, stable since 3.3.90) itself, packing
// into a per-thread buffer that only grows, and splits the product over threads itself.
// The serial kernel also serves CBLAS builds where a fused kernel runs many small products at once
// inside its own parallel loop (see gemm_serial).
#if EIGEN_VERSION_AT_LEAST(3, 3, 90)

/// Eigen's blocking descriptor, pointing at nn's packing space instead of owning its own.
template <class T>
struct GemmBlocking : Eigen::internal::level3_blocking<T, T> {
  GemmBlocking(Eigen::Index mc, Eigen::Index nc, Eigen::Index kc, T* a, T* b) {
    this->m_mc = mc;
    this->m_nc = nc;
    this->m_kc = kc;
    this->m_blockA = a;
    this->m_blockB = b;
  }
};

/// Row-major C[M,N] (row stride ldc) += op(A) @ op(B) on the calling thread; OrderA/OrderB say
/// how op(A), op(B) lie in memory (ColMajor = read transposed).
template <class T, int OrderA, int OrderB>
void eigen_gemm_serial(Eigen::Index M, Eigen::Index N, Eigen::Index K, const T* A, Eigen::Index lda, const T* B,
                       Eigen::Index ldb, T* C, Eigen::Index ldc) {
  // Eigen runs a row-major product as the column-major C^T = op(B)^T op(A)^T, so the blocking is
  // sized as its gemm_blocking_space sizes it for a row-major destination: mc along N, nc along M.
  Eigen::Index kc = K, mc = N, nc = M;
  Eigen::internal::computeProductBlockingSizes<T, T, 1>(kc, mc, nc, Eigen::Index(1));
  const std::size_t a_bytes = (static_cast<std::size_t>(mc * kc) * sizeof(T) + 63) / 64 * 64;
  const std::size_t b_bytes = static_cast<std::size_t>(kc * nc) * sizeof(T);
  auto* ws = static_cast<char*>(gemm_workspace(a_bytes + b_bytes));
  GemmBlocking<T> blocking(mc, nc, kc, reinterpret_cast<T*>(ws), reinterpret_cast<T*>(ws + a_bytes));
  Eigen::internal::general_matrix_matrix_product<Eigen::Index, T, OrderA, false, T, OrderB, false, Eigen::RowMajor,
                                                 1>::run(M, N, K, A, lda, B, ldb, C, 1, ldc, T(1), blocking);
}

/// Row-major C[M,N] (+)= op(A) @ op(B), split into row (or column) blocks over as many threads
/// as Eigen's own GEMM would use; each block is one serial Eigen GEMM.
template <class T>
void eigen_gemm(bool ta, bool tb, Eigen::Index M, Eigen::Index N, Eigen::Index K, const T* A, Eigen::Index lda,
                const T* B, Eigen::Index ldb, T* C, bool acc) {
  const Eigen::Index ldc = N;
  auto block = [&](Eigen::Index m0, Eigen::Index m1, Eigen::Index n0, Eigen::Index n1) {
    if (!acc)
      for (Eigen::Index i = m0; i < m1; ++i) std::fill_n(C + i * ldc + n0, n1 - n0, T(0));
    const T* a = A + (ta ? m0 : m0 * lda);
    const T* b = B + (tb ? n0 * ldb : n0);
    T* c = C + m0 * ldc + n0;
    const Eigen::Index m = m1 - m0, n = n1 - n0;
    constexpr int R = Eigen::RowMajor, Cm = Eigen::ColMajor;
    if (ta && tb) eigen_gemm_serial<T, Cm, Cm>(m, n, K, a, lda, b, ldb, c, ldc);
    else if (ta) eigen_gemm_serial<T, Cm, R>(m, n, K, a, lda, b, ldb, c, ldc);
    else if (tb) eigen_gemm_serial<T, R, Cm>(m, n, K, a, lda, b, ldb, c, ldc);
    else eigen_gemm_serial<T, R, R>(m, n, K, a, lda, b, ldb, c, ldc);
  };
#if defined(_OPENMP)
  // Eigen's rule (Parallelizer.h): a thread per 50,000 multiply-adds, at most nbThreads(), none
  // when already inside a parallel region; and here at least 16 rows (or columns) per thread.
  Eigen::Index threads = 1;
  if (!omp_in_parallel()) {
    const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
    threads = std::min<Eigen::Index>({static_cast<Eigen::Index>(std::min(Eigen::nbThreads(), free_threads())),
                                      static_cast<Eigen::Index>(work / 50000.0), std::max(M, N) / 16});
  }
  if (threads > 1) {
    const bool by_rows = M >= N;
    const Eigen::Index D = by_rows ? M : N;
    team(static_cast<int>(threads), [&](int thread, int team_size) {
      const Eigen::Index nt = team_size, t = thread;
      const Eigen::Index per = ((D + nt - 1) / nt + 15) / 16 * 16;
      const Eigen::Index d0 = std::min(D, t * per), d1 = std::min(D, d0 + per);
      if (d0 < d1) {
        if (by_rows) block(d0, d1, 0, N);
        else block(0, M, d0, d1);
      }
    });
    return;
  }
#endif
  block(0, M, 0, N);
}

#endif  // Eigen >= 3.3.90

#if !defined(NN_OWN_GEMM) && !defined(NN_GEMM_EIGEN)
#define NN_GEMM_EIGEN 1  // no GCC/Clang vector extensions: Eigen's GEMM is the portable one
#endif

/// The engine that runs matrix products in this process.
enum class GemmEngine : std::uint8_t { nn, blas, eigen };

#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
/// True when OpenBLAS runs kernels without AVX2/FMA on a CPU that has them: OpenBLAS picks its
/// kernels from a table of CPU models, and a model newer than its table falls back to a generic
/// core (0.3.21 runs Sapphire Rapids on "Prescott", SSE3, at a fifth of the machine's speed).
inline bool blas_core_is_generic(const CpuFeatures& f) {
  if (f.best_isa() == Isa::generic) return false;
  std::string core = openblas_get_corename();
  for (char& ch : core) ch = static_cast<char>(std::tolower(static_cast<unsigned char>(ch)));
  for (const char* good : {"haswell", "zen", "skylakex", "cooperlake", "sapphirerapids", "excavator"})
    if (core == good) return false;
  return true;
}
#endif

struct GemmChoice {
  GemmEngine engine = GemmEngine::nn;
  std::string note;  // why, when an external BLAS was linked
};

/// Decided once: NN_GEMM_EIGEN -> Eigen; NN_USE_BLAS -> CBLAS, unless OpenBLAS chose generic
/// kernels on a better CPU (then nn's engine, said once on stderr); otherwise nn's engine.
inline const GemmChoice& gemm_choice() {
  static const GemmChoice choice = [] {
    GemmChoice c;
#if defined(NN_GEMM_EIGEN)
    c.engine = GemmEngine::eigen;
#elif defined(NN_USE_BLAS)
    c.engine = GemmEngine::blas;
#if defined(OPENBLAS_VERSION)
    const CpuFeatures f = detect_cpu_features();
    const std::string core = openblas_get_corename();
    if (blas_core_is_generic(f)) {
      c.engine = GemmEngine::nn;
      c.note = "OpenBLAS chose its generic '" + core + "' kernels on this " + isa_name(f.best_isa()) +
               " CPU; nn's own GEMM runs instead";
      std::fprintf(stderr, "[nn] %s\n", c.note.c_str());
    } else {
      c.note = "OpenBLAS core " + core;
    }
#endif
#endif
    return c;
  }();
  return choice;
}

/// While alive, OpenBLAS runs each call on the calling thread (its thread count set to 1, then
/// restored): a kernel that splits its own work over OpenMP threads and calls GEMM from each
/// would otherwise have OpenBLAS's pthreads pool contend with them. A no-op for other builds.
struct BlasSerial {
#if defined(NN_USE_BLAS) && defined(OPENBLAS_VERSION)
  int prev = openblas_get_num_threads();
  BlasSerial() {
    if (prev != 1) openblas_set_num_threads(1);
  }
  ~BlasSerial() {
    if (prev != 1) openblas_set_num_threads(prev);
  }
#else
  BlasSerial() = default;
#endif
  BlasSerial(const BlasSerial&) = delete;
  BlasSerial& operator=(const BlasSerial&) = delete;
};

/// How bf16 products run in this process (gemm::bf16_kernel on nn's engine; CBLAS and Eigen
/// multiply f32 copies).
inline std::string gemm_bf16_kernel() {
#if defined(NN_OWN_GEMM)
  if (gemm_choice().engine == GemmEngine::nn) return gemm::bf16_kernel_name(gemm::bf16_kernel());
#endif
  return "f32 copies";
}

template <class T>
void gemm_serial(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
                 const T* B, std::int64_t ldb, T* C, std::int64_t ldc, bool acc);

/// C[M x N] (row stride ldc) (+)= bf16(op(A)) @ bf16(op(B)): A f32 rounded to bf16, B bf16 (a
/// frozen weight, Precision::bf16) or f32 rounded too (autocast), f32 accumulation. nn's engine
/// packs straight from the operands (gemm::gemm_bf16); the CBLAS and Eigen engines get f32 copies
/// of the rounded operands (an allocation per call: those engines have no packing hook).
template <class SB>
void gemm_bf16(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const float* A, std::int64_t lda,
               const SB* B, std::int64_t ldb, float* C, std::int64_t ldc, bool acc, bool parallel) {
#if defined(NN_OWN_GEMM)
  if (gemm_choice().engine == GemmEngine::nn) {
    gemm::gemm_bf16<SB>(gemm::active_isa(), gemm::bf16_kernel(), ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc,
                        parallel);
    return;
  }
#endif
  (void)parallel;
  const std::int64_t ar = ta ? K : M, br = tb ? N : K, bc = tb ? K : N;
  std::vector<float> a(static_cast<std::size_t>(ar * (ta ? M : K))), b(static_cast<std::size_t>(br * bc));
  for (std::int64_t r = 0; r < ar; ++r)
    for (std::int64_t c = 0; c < (ta ? M : K); ++c)
      a[static_cast<std::size_t>(r * (ta ? M : K) + c)] = half::bf16_round(A[r * lda + c]);
  for (std::int64_t r = 0; r < br; ++r)
    for (std::int64_t c = 0; c < bc; ++c) {
      const SB v = B[r * ldb + c];
      if constexpr (std::is_same_v<SB, float>) b[static_cast<std::size_t>(r * bc + c)] = half::bf16_round(v);
      else b[static_cast<std::size_t>(r * bc + c)] = half::bf16_to_f32(v);
    }
  gemm_serial<float>(ta, tb, M, N, K, a.data(), ta ? M : K, b.data(), bc, C, ldc, acc);
}

/// Row-major C[M,N] with row stride ldc (+)= op(A) @ op(B) on the calling thread, for products
/// that a kernel runs many of at once from its own parallel loop (attention's per-head
/// products: strided views into (B, T, n * head_dim), no copies). With CBLAS, hold a
/// BlasSerial around the loop.
template <class T>
void gemm_serial(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
                 const T* B, std::int64_t ldb, T* C, std::int64_t ldc, bool acc) {
  if (M == 0 || N == 0) return;
  if (K == 0) {
    if (!acc)
      for (std::int64_t i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
    return;
  }
  [[maybe_unused]] const GemmEngine engine = gemm_choice().engine;
#if defined(NN_OWN_GEMM)
  if (engine == GemmEngine::nn) {
    gemm::gemm_serial<T>(gemm::active_isa(), ta, tb, M, N, K, A, lda, B, ldb, C, ldc, acc);
    return;
  }
#endif
#if defined(NN_USE_BLAS)
  if (engine == GemmEngine::blas) {
    const auto tA = ta ? CblasTrans : CblasNoTrans, tB = tb ? CblasTrans : CblasNoTrans;
    if constexpr (std::is_same_v<T, float>)
      cblas_sgemm(CblasRowMajor, tA, tB, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0f, A,
                  static_cast<int>(lda), B, static_cast<int>(ldb), acc ? 1.0f : 0.0f, C, static_cast<int>(ldc));
    else
      cblas_dgemm(CblasRowMajor, tA, tB, static_cast<int>(M), static_cast<int>(N), static_cast<int>(K), 1.0, A,
                  static_cast<int>(lda), B, static_cast<int>(ldb), acc ? 1.0 : 0.0, C, static_cast<int>(ldc));
    return;
  }
#endif
  if (!acc)
    for (std::int64_t i = 0; i < M; ++i) std::fill_n(C + i * ldc, N, T(0));
#if EIGEN_VERSION_AT_LEAST(3, 3, 90)
  constexpr int R = Eigen::RowMajor, Cm = Eigen::ColMajor;
  if (ta && tb) eigen_gemm_serial<T, Cm, Cm>(M, N, K, A, lda, B, ldb, C, ldc);
  else if (ta) eigen_gemm_serial<T, Cm, R>(M, N, K, A, lda, B, ldb, C, ldc);
  else if (tb) eigen_gemm_serial<T, R, Cm>(M, N, K, A, lda, B, ldb, C, ldc);
  else eigen_gemm_serial<T, R, R>(M, N, K, A, lda, B, ldb, C, ldc);
#else
  using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
  using CMap = Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>>;
  Eigen::Map<Mat, Eigen::Unaligned, Eigen::OuterStride<>> Cm(C, M, N, Eigen::OuterStride<>(ldc));
  CMap Am(A, ta ? K : M, ta ? M : K, Eigen::OuterStride<>(lda)), Bm(B, tb ? N : K, tb ? K : N, Eigen::OuterStride<>(ldb));
  if (ta && tb) Cm.noalias() += Am.transpose() * Bm.transpose();
  else if (ta) Cm.noalias() += Am.transpose() * Bm;
  else if (tb) Cm.noalias() += Am * Bm.transpose();
  else Cm.noalias() += Am * Bm;
#endif
}

}  // namespace detail

namespace cpu_kernels {

// A class template with one instance, `MatmulKernels` (why: backend/cpu.hpp).
template <class = void>
struct MatmulKernelsT {
  /// c (+)= op(a) @ op(b). Each operand is (batch, rows, cols) with batch = the product of its
  /// leading dims (1 for a matrix); a's and b's batch are equal or 1 (a shared operand); c's is
  /// their batch, or 1 to sum the products over the batch.
  /// op(x) = x^T when the flag is set: read transposed, never copied.
  /// Products whose right operand is a bf16 weight (Precision::bf16) run on bf16 operands with
  /// f32 accumulation (see matmul_bf16).
  static constexpr bool bf16_weights = true;

  static void matmul(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    if (b.dtype() == DType::bf16) return matmul_bf16(a, ta, b, tb, c, acc);
    detail::dispatch_float(c.dtype(), "matmul", [&]<class T>() {
      const Shape &sa = a.shape(), &sb = b.shape(), &sc = c.shape();
      const std::int64_t ar = sa.dim(-2), ac = sa.dim(-1), br = sb.dim(-2), bc = sb.dim(-1);
      const std::int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc;
      const std::int64_t ba = sa.prod(0, sa.rank() - 2), bb = sb.prod(0, sb.rank() - 2);
      const std::int64_t bcnt = sc.prod(0, sc.rank() - 2), batch = std::max(ba, bb);
      const T* A = static_cast<const T*>(a.raw());
      const T* Bp = static_cast<const T*>(b.raw());
      T* C = static_cast<T*>(c.raw());
      // bcnt == 1 < batch: the product is summed over the batch into one C (the gradient of an
      // operand shared across a batch).
#if defined(NN_OWN_GEMM)
      // one C per item: nn's engine shares out a batch of small products item by item
      if (bcnt == batch && batch > 1 && detail::gemm_choice().engine == detail::GemmEngine::nn &&
          !gemm_vector_like(M, N, K)) {
        ::nn::gemm::gemm_batched<T>(::nn::gemm::active_isa(), batch, ta, tb, M, N, K, A, ba == 1 ? 0 : ar * ac, ac, Bp,
                                    bb == 1 ? 0 : br * bc, bc, C, M * N, N, acc);
        return;
      }
#endif
      for (std::int64_t i = 0; i < batch; ++i)
        gemm<T>(ta, tb, M, N, K, A + (ba == 1 ? 0 : i * ar * ac), ac, Bp + (bb == 1 ? 0 : i * br * bc), bc,
                C + (bcnt == 1 ? 0 : i * M * N), acc || (bcnt == 1 && i > 0));
    });
  }

  /// c (+)= bf16(op(a)) @ bf16(op(b)) for a matrix b (bf16: a stored weight; f32: rounded too,
  /// autocast) and f32 a (..., M, K) (its batch shares b; ops/matmul.hpp folds it into rows): f32
  /// accumulation, c f32.
  static void matmul_bf16(const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    if (a.dtype() != DType::f32 || c.dtype() != DType::f32 || b.rank() != 2 ||
        (b.dtype() != DType::bf16 && b.dtype() != DType::f32))
      detail::fail("matmul", "a bf16 product needs a float32 a and a bfloat16 or float32 matrix b, got a ",
                   dtype_name(a.dtype()), " ", a.shape().str(), ", b ", dtype_name(b.dtype()), " ", b.shape().str());
    const Shape& sa = a.shape();
    const std::int64_t ar = sa.dim(-2), ac = sa.dim(-1), br = b.dim(0), bc = b.dim(1);
    const std::int64_t M = ta ? ac : ar, K = ta ? ar : ac, N = tb ? br : bc, batch = sa.prod(0, sa.rank() - 2);
    const float* A = static_cast<const float*>(a.raw());
    float* C = static_cast<float*>(c.raw());
    auto run = [&](const auto* Bp) {
      for (std::int64_t i = 0; i < batch; ++i)
        detail::gemm_bf16(ta, tb, M, N, K, A + i * ar * ac, ac, Bp, bc, C + i * M * N, N, acc, true);
    };
    if (b.dtype() == DType::bf16) run(static_cast<const std::uint16_t*>(b.raw()));
    else run(static_cast<const float*>(b.raw()));
  }

 private:
  /// One row or one column (a batch-1 Linear, a projection to one output) streams the matrix
  /// once: a packed GEMM would copy all of it first. Tiny products stay with coefficient loops.
  static bool gemm_vector_like(std::int64_t M, std::int64_t N, std::int64_t K) {
    return M == 1 || N == 1 || M + N + K < EIGEN_GEMM_TO_COEFFBASED_THRESHOLD;
  }

 public:
  /// One row-major GEMM: C[M,N] (+)= op(A) @ op(B), lda/ldb = the stored row lengths (also the
  /// products of linear_cross_entropy's vocabulary blocks).
  template <class T>
  static void gemm(bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, const T* A, std::int64_t lda,
                   const T* Bp, std::int64_t ldb, T* C, bool acc) {
    if (M == 0 || N == 0) return;
    if (K == 0) {
      if (!acc) std::fill_n(C, M * N, T(0));
      return;
    }
    const detail::GemmEngine engine = detail::gemm_choice().engine;
    const bool vector_like = gemm_vector_like(M, N, K);
#if defined(NN_USE_BLAS)
    if (engine == detail::GemmEngine::blas && (M == 1 || N == 1)) {
      // ?gemv: OpenBLAS 0.3.21's ?gemm is 3-4x slower on these shapes and its small-matrix kernel
      // mallocs on each call. C is zeroed here rather than by beta = 0, so stale NaNs in an
      // uninitialised output never leak through a BLAS that scales by beta.
      if (!acc) std::fill_n(C, M * N, T(0));
      auto gemv = [&](bool trans, std::int64_t rows, std::int64_t cols, const T* mat, std::int64_t ld, const T* x,
                      std::int64_t incx) {
        const auto t = trans ? CblasTrans : CblasNoTrans;
        if constexpr (std::is_same_v<T, float>)
          cblas_sgemv(CblasRowMajor, t, static_cast<int>(rows), static_cast<int>(cols), 1.0f, mat, static_cast<int>(ld),
                      x, static_cast<int>(incx), 1.0f, C, 1);
        else
          cblas_dgemv(CblasRowMajor, t, static_cast<int>(rows), static_cast<int>(cols), 1.0, mat, static_cast<int>(ld),
                      x, static_cast<int>(incx), 1.0, C, 1);
      };
      if (N == 1) gemv(ta, ta ? K : M, ta ? M : K, A, lda, Bp, tb ? 1 : ldb);       // C = op(A) b
      else gemv(!tb, tb ? N : K, tb ? K : N, Bp, ldb, A, ta ? lda : 1);             // C^T = op(B)^T a^T
      return;
    }
    if (engine == detail::GemmEngine::blas) {
#if defined(OPENBLAS_VERSION) && defined(_OPENMP)
      // nn splits a product over its own OpenMP threads, each block one OpenBLAS call on its
      // thread: OpenBLAS's pthreads would otherwise spin-wait beside OpenMP's after every product
      // and take the cores nn's elementwise kernels run on (the two-runtime slowdown in
      // shared/REFERENCE-FACTS.md). OpenBLAS's own rule for going parallel (m n k > 64^3) and at
      // least 16 rows (or columns) per thread.
      int threads = 1;
      if (!omp_in_parallel()) {
        const double work = static_cast<double>(M) * static_cast<double>(N) * static_cast<double>(K);
        threads = static_cast<int>(std::min<double>({static_cast<double>(detail::free_threads()), work / 262144.0,
                                                     static_cast<double>(std::max(M, N) / 16)}));
      }
      detail::BlasSerial serial;
      if (threads > 1) {
        const bool by_rows = M >= N;
        const std::int64_t D = by_rows ? M : N;
        detail::team(threads, [&](int thread, int team_size) {
          const std::int64_t nt = team_size, t = thread;
          const std::int64_t per = ((D + nt - 1) / nt + 15) / 16 * 16;
          const std::int64_t d0 = std::min(D, t * per), d1 = std::min(D, d0 + per);
          if (d0 < d1) {
            if (by_rows) detail::gemm_serial<T>(ta, tb, d1 - d0, N, K, A + (ta ? d0 : d0 * lda), lda, Bp, ldb, C + d0 * N, N, acc);
            else detail::gemm_serial<T>(ta, tb, M, d1 - d0, K, A, lda, Bp + (tb ? d0 * ldb : d0), ldb, C + d0, N, acc);
          }
        });
        return;
      }
#endif
      detail::gemm_serial<T>(ta, tb, M, N, K, A, lda, Bp, ldb, C, N, acc);
      return;
    }
#endif
#if defined(NN_OWN_GEMM)
    if (engine == detail::GemmEngine::nn && ::nn::gemm::gemv_applies(ta, tb, M, N)) {  // gemv.hpp
      ::nn::gemm::gemv_product<T>(::nn::gemm::active_isa(), ta, tb, M, N, K, A, lda, Bp, ldb, C, acc);
      return;
    }
    if (engine == detail::GemmEngine::nn && !vector_like) {
      ::nn::gemm::gemm_parallel<T>(::nn::gemm::active_isa(), ta, tb, M, N, K, A, lda, Bp, ldb, C, N, acc);
      return;
    }
#endif
#if EIGEN_VERSION_AT_LEAST(3, 3, 90)
    // Eigen's kernel with nn's reusable packing space (no allocation per call)
    if (!vector_like) {
      detail::eigen_gemm<T>(ta, tb, M, N, K, A, lda, Bp, ldb, C, acc);
      return;
    }
#endif
    // tiny products (and vectors, on the Eigen engine): Eigen's expressions, which do not allocate
    using Mat = Eigen::Matrix<T, Eigen::Dynamic, Eigen::Dynamic, Eigen::RowMajor>;
    using CMap = Eigen::Map<const Mat, Eigen::Unaligned, Eigen::OuterStride<>>;
    Eigen::Map<Mat> Cm(C, M, N);
    CMap Am(A, ta ? K : M, ta ? M : K, Eigen::OuterStride<>(lda));
    CMap Bm(Bp, tb ? N : K, tb ? K : N, Eigen::OuterStride<>(ldb));
    auto run = [&](const auto& a, const auto& b) {
      if (acc) Cm.noalias() += a * b;
      else Cm.noalias() = a * b;
    };
    if (ta && tb) run(Am.transpose(), Bm.transpose());
    else if (ta) run(Am.transpose(), Bm);
    else if (tb) run(Am, Bm.transpose());
    else run(Am, Bm);
  }
};
using MatmulKernels = MatmulKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/matmul.hpp ----
// ---- begin nn/backend/cpu/shape.hpp ----
// nn::cpu's data movement: permute and slice copies (ops/shape.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `ShapeKernels` (why: backend/cpu.hpp).
template <class = void>
struct ShapeKernelsT {
  /// y (+)= x with its axes permuted: y.shape[i] = x.shape[perm[i]].
  static void permute(const Tensor& x, const std::array<int, kMaxRank>& perm, Tensor& y, bool acc) {
    detail::dispatch_any(x.dtype(), "permute", acc, [&]<class T>() {
      const int r = x.rank();
      std::array<std::int64_t, kMaxRank> xst{}, st{};
      std::int64_t s = 1;
      for (int i = r - 1; i >= 0; --i) { xst[static_cast<std::size_t>(i)] = s; s *= x.shape()[i]; }
      for (int i = 0; i < r; ++i) st[static_cast<std::size_t>(i)] = xst[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])];
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      std::array<std::array<std::int64_t, kMaxRank>, 1> sts{st};
      detail::for_each_broadcast<1>(y.shape(), sts, [&](std::int64_t i, std::int64_t ix) {
        if constexpr (std::is_floating_point_v<T>) detail::put(ys, i, xs[ix], acc);
        else ys[i] = xs[ix];
      });
    });
  }

  /// y = x[..., start:start + y.shape[axis], ...]
  static void slice_copy(const Tensor& x, int axis, std::int64_t start, Tensor& y) {
    const std::size_t es = dtype_size(x.dtype());
    const Shape& s = x.shape();
    const std::int64_t outer = s.prod(0, axis), inner = s.prod(axis + 1, s.rank());
    const std::int64_t len = y.shape()[axis], full = s[axis];
    const auto* xs = static_cast<const char*>(x.raw());
    auto* ys = static_cast<char*>(y.raw());
    for (std::int64_t o = 0; o < outer; ++o)
      std::memcpy(ys + static_cast<std::size_t>(o * len * inner) * es,
                  xs + static_cast<std::size_t>((o * full + start) * inner) * es, static_cast<std::size_t>(len * inner) * es);
  }

  /// y[..., start:start + x.shape[axis], ...] (+)= x; the rest of y is left as it is.
  static void slice_scatter(const Tensor& x, int axis, std::int64_t start, Tensor& y, bool acc) {
    const Shape& s = y.shape();
    const std::int64_t outer = s.prod(0, axis), inner = s.prod(axis + 1, s.rank());
    const std::int64_t len = x.shape()[axis], full = s[axis];
    if (!acc) {
      const std::size_t es = dtype_size(x.dtype());
      const auto* xs = static_cast<const char*>(x.raw());
      auto* ys = static_cast<char*>(y.raw());
      for (std::int64_t o = 0; o < outer; ++o)
        std::memcpy(ys + static_cast<std::size_t>((o * full + start) * inner) * es,
                    xs + static_cast<std::size_t>(o * len * inner) * es, static_cast<std::size_t>(len * inner) * es);
      return;
    }
    detail::dispatch_float(x.dtype(), "slice", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      for (std::int64_t o = 0; o < outer; ++o)
        for (std::int64_t k = 0; k < len * inner; ++k) ys[(o * full + start) * inner + k] += xs[o * len * inner + k];
    });
  }
};
using ShapeKernels = ShapeKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/shape.hpp ----
// ---- begin nn/backend/cpu/index.hpp ----
// nn::cpu's indexed kernels: embedding rows (gather/scatter-add) and pick (ops/index.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `IndexKernels` (why: backend/cpu.hpp).
template <class = void>
struct IndexKernelsT {
  /// y[i, :] = table[ids[i], :]; table: (N, D), ids: any shape of i32/i64 (flattened), y: (n, D).
  /// A bf16 table (Precision::bf16) gives f32 rows, widened exactly.
  static void gather_rows(const Tensor& table, const Tensor& ids, Tensor& y) {
    const std::int64_t D = table.dim(-1), n = ids.numel();
    const bool widen = table.dtype() == DType::bf16 && y.dtype() == DType::f32;
    const std::size_t row = static_cast<std::size_t>(D) * dtype_size(table.dtype());
    const auto* ts = static_cast<const char*>(table.raw());
    auto* ys = static_cast<char*>(y.raw());
    const std::int64_t N = table.dim(0);
    for (std::int64_t i = 0; i < n; ++i) {
      const std::int64_t id = detail::load_index(ids, i);
      if (id < 0 || id >= N)
        detail::fail("gather_rows", "id ", id, " at position ", i, " is out of range for a table of ", N, " rows");
      if (widen) {
        const auto* src = reinterpret_cast<const std::uint16_t*>(ts + static_cast<std::size_t>(id) * row);
        float* dst = reinterpret_cast<float*>(ys) + i * D;
        for (std::int64_t j = 0; j < D; ++j) dst[j] = half::bf16_to_f32(src[j]);
      } else {
        std::memcpy(ys + static_cast<std::size_t>(i) * row, ts + static_cast<std::size_t>(id) * row, row);
      }
    }
  }

  /// gtable[ids[i], :] += g[i, :]; repeated ids accumulate, in order (deterministic).
  static void scatter_add_rows(const Tensor& g, const Tensor& ids, Tensor& gtable) {
    detail::dispatch_float(g.dtype(), "embedding", [&]<class T>() {
      const std::int64_t D = gtable.dim(-1), n = ids.numel();
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gtable.raw());
      for (std::int64_t i = 0; i < n; ++i) {
        T* dst = out + detail::load_index(ids, i) * D;
        const T* src = gs + i * D;
        for (std::int64_t j = 0; j < D; ++j) dst[j] += src[j];
      }
    });
  }

  /// y[i] = x[i, idx[i]] for x: (R, V), idx: (R) i32/i64; y[i] = 0 where idx[i] < 0.
  static void pick(const Tensor& x, const Tensor& idx, Tensor& y) {
    detail::dispatch_float(x.dtype(), "pick", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = idx.numel();
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      for (std::int64_t i = 0; i < R; ++i) {
        std::int64_t k = detail::load_index(idx, i);
        if (k >= V) detail::fail("pick", "index ", k, " at row ", i, " is out of range for ", V, " classes");
        ys[i] = k < 0 ? T(0) : xs[i * V + k];
      }
    });
  }

  /// gx[i, idx[i]] += g[i] (gx must already hold its other values).
  static void pick_vjp(const Tensor& g, const Tensor& idx, Tensor& gx) {
    detail::dispatch_float(g.dtype(), "pick", [&]<class T>() {
      const std::int64_t V = gx.dim(-1), R = idx.numel();
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      for (std::int64_t i = 0; i < R; ++i) {
        std::int64_t k = detail::load_index(idx, i);
        if (k >= 0) out[i * V + k] += gs[i];
      }
    });
  }
};
using IndexKernels = IndexKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/index.hpp ----
// ---- begin nn/backend/cpu/random.hpp ----
// nn::cpu's random kernel: MLX's bernoulli mask, bit for bit (ops/random.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `RandomKernels` (why: backend/cpu.hpp).
template <class = void>
struct RandomKernelsT {
  /// mask[i] = value where MLX's bernoulli(p_keep, mask.shape, key) is true, else 0 (mask: f32,
  /// f64 or u8). key: u32 (2), read here so a replay draws from whatever key its slot holds now.
  /// The word layout and u < float32(p) test are random.hpp's, so the mask is MLX's bit for bit.
  static void bernoulli_mask(const Tensor& key, double p_keep, double value, Tensor& mask) {
    const auto* k = static_cast<const std::uint32_t*>(key.raw());
    const std::uint32_t k0 = k[0], k1 = k[1];
    const float p = static_cast<float>(p_keep);
    const std::int64_t n = mask.numel(), blocks = random::detail::bits_blocks(n);
    auto draw = [&]<class T>() {
      T* m = static_cast<T*>(mask.raw());
      const T on = static_cast<T>(value);
      detail::parallel_for(blocks, n > detail::kParallelGrain, [&](std::int64_t j) {
        random::detail::bits_block(k0, k1, n, j, [&](std::int64_t i, std::uint32_t w) {
          m[i] = random::detail::uniform01(w) < p ? on : T(0);
        });
      });
    };
    switch (mask.dtype()) {
      case DType::f32: draw.template operator()<float>(); break;
      case DType::f64: draw.template operator()<double>(); break;
      case DType::u8: draw.template operator()<std::uint8_t>(); break;
      default: detail::fail("bernoulli_mask", "needs a float32, float64 or uint8 mask, got ", dtype_name(mask.dtype()));
    }
  }
};
using RandomKernels = RandomKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/random.hpp ----
// ---- begin nn/backend/cpu/softmax.hpp ----
// nn::cpu's softmax and log-softmax over the last axis, with their vjp (ops/softmax.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `SoftmaxKernels` (why: backend/cpu.hpp).
template <class = void>
struct SoftmaxKernelsT {
  /// Softmax (or log-softmax) over the last axis, max-subtracted so logits in the thousands
  /// neither overflow nor lose precision.
  static void softmax(const Tensor& x, Tensor& y, bool log) {
    detail::dispatch_float(x.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = x.numel() / std::max<std::int64_t>(V, 1);
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        // Eigen's array exp is vectorised (std::exp is not, and takes a slow path on underflow,
        // which every masked score hits).
        detail::ConstArrayMap<T> in(xs + r * V, V);
        detail::ArrayMap<T> out(ys + r * V, V);
        T m = -std::numeric_limits<T>::infinity();
        for (std::int64_t j = 0; j < V; ++j) m = std::max(m, in[j]);
        m = detail::SoftmaxMath::finite_max(m);  // a fully masked row stays finite
        if (log) {
          const T ls = std::log((in - m).exp().sum());
          out = detail::SoftmaxMath::log_p(in, m, ls);
        } else {
          out = in;
          out *= T(1) / detail::exp_sum(ys + r * V, V, m);
        }
      });
    });
  }

  /// gx (+)= J^T g for y = softmax(x):  y * (g - sum(g*y));  log_softmax: g - softmax * sum(g).
  static void softmax_vjp(const Tensor& y, const Tensor& g, Tensor& gx, bool log, bool acc) {
    detail::dispatch_float(y.dtype(), log ? "log_softmax" : "softmax", [&]<class T>() {
      const std::int64_t V = y.dim(-1), R = y.numel() / std::max<std::int64_t>(V, 1);
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      detail::parallel_for(R, y.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        const T* yr = ys + r * V;
        const T* gr = gs + r * V;
        T* o = out + r * V;
        T s = 0;
        if (log) {
          for (std::int64_t j = 0; j < V; ++j) s += gr[j];
          detail::ConstArrayMap<T> ya(yr, V), ga(gr, V);
          detail::ArrayMap<T> oa(o, V);
          if (acc) oa += detail::SoftmaxMath::log_vjp(ga, ya, s);
          else oa = detail::SoftmaxMath::log_vjp(ga, ya, s);
        } else {
          for (std::int64_t j = 0; j < V; ++j) s += gr[j] * yr[j];
          for (std::int64_t j = 0; j < V; ++j) detail::put(o, j, detail::SoftmaxMath::vjp(yr[j], gr[j], s), acc);
        }
      });
    });
  }
};
using SoftmaxKernels = SoftmaxKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/softmax.hpp ----
// ---- begin nn/backend/cpu/cross_entropy.hpp ----
// nn::cpu's softmax cross-entropy against integer targets, with its vjp (ops/cross_entropy.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `CrossEntropyKernels` (why: backend/cpu.hpp).
template <class = void>
struct CrossEntropyKernelsT {
  /// Softmax cross-entropy against integer targets (i32/i64): loss_r = logsumexp(x_row) -
  /// x_row[t_r], max-subtracted. x: (..., T, V), t: (..., N) with N <= T: target r scores row
  /// (r / N) * T + r % N of x, i.e. the first N rows of each group of T (next-token training
  /// scores T - 1 positions without copying the logits); N == T (x (R, V), t (R)) is one row per
  /// target. A target equal to a.ignore_index contributes nothing. Reduction::none: y (t's shape)
  /// per target (0 where ignored); sum: y (one element) the sum; mean: the mean over the targets not
  /// ignored (NaN when all are, as PyTorch). lse (t.numel()) keeps logsumexp for the vjp. Any
  /// other target outside [0, V) raises.
  static void cross_entropy(const Tensor& x, const Tensor& t, const CrossEntropyAttrs& a, Tensor& y, Tensor& lse) {
    const std::int64_t ignore = a.ignore_index;
    const int reduction = static_cast<int>(a.reduction);  // 0 none, 1 sum, 2 mean
    detail::dispatch_float(x.dtype(), "cross_entropy", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = t.numel();
      const std::int64_t N = t.rank() ? t.dim(-1) : 1, G = x.rank() >= 2 ? x.dim(-2) : 1;
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t k = detail::load_index(t, r);
        if (k != ignore && (k < 0 || k >= V))
          detail::fail("cross_entropy", "target ", k, " at row ", r, " is out of range for ", V,
                       " classes (ignore_index is ", ignore, ")");
      }
      const T* xs = static_cast<const T*>(x.raw());
      T* ls = static_cast<T*>(lse.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_for(R, R * V > detail::kParallelGrain, [&](std::int64_t r) {
        const T* in = xs + ((r / N) * G + r % N) * V;
        T m, s;
        if constexpr (std::is_same_v<T, float>) {  // at the CPU's vector width (simd.hpp)
          m = simd::max(in, V);
          s = simd::sum_exp(in, V, m);
        } else {
          m = V ? detail::ConstArrayMap<T>(in, V).maxCoeff() : -std::numeric_limits<T>::infinity();  // vectorised
          s = (detail::ConstArrayMap<T>(in, V) - m).exp().sum();  // vectorised exp
        }
        ls[r] = detail::SoftmaxMath::lse(m, s);
        if (reduction == 0) {
          const std::int64_t k = detail::load_index(t, r);
          ys[r] = k == ignore ? T(0) : detail::SoftmaxMath::ce_loss(ls[r], in[k]);
        }
      });
      if (reduction == 0) return;
      T total = 0;  // serial, in row order: deterministic
      std::int64_t count = 0;
      for (std::int64_t r = 0; r < R; ++r) {
        const std::int64_t k = detail::load_index(t, r);
        if (k == ignore) continue;
        total += detail::SoftmaxMath::ce_loss(ls[r], xs[((r / N) * G + r % N) * V + k]);
        ++count;
      }
      ys[0] = reduction == 2 ? total / static_cast<T>(count) : total;
    });
  }

  /// gx (+)= g_r (softmax(x_row) - onehot(t_r)) for each target's row (the mapping of
  /// cross_entropy); rows of ignored targets and rows no target scores get 0. g has t's shape
  /// for reduction 0, else one element (divided by the kept-target count for the mean).
  static void cross_entropy_vjp(const Tensor& x, const Tensor& t, const CrossEntropyAttrs& a, const Tensor& lse,
                                const Tensor& g, Tensor& gx, bool acc) {
    const std::int64_t ignore = a.ignore_index;
    const int reduction = static_cast<int>(a.reduction);  // 0 none, 1 sum, 2 mean
    detail::dispatch_float(x.dtype(), "cross_entropy", [&]<class T>() {
      const std::int64_t V = x.dim(-1), R = t.numel();
      const std::int64_t N = t.rank() ? t.dim(-1) : 1, G = x.rank() >= 2 ? x.dim(-2) : 1;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ls = static_cast<const T*>(lse.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* out = static_cast<T*>(gx.raw());
      T g0 = reduction == 0 ? T(0) : gs[0];
      if (reduction == 2) {
        std::int64_t count = 0;
        for (std::int64_t r = 0; r < R; ++r) count += detail::load_index(t, r) != ignore;
        g0 = g0 / static_cast<T>(count);
      }
      if (!acc && N < G) {  // rows past the first N of each group are scored by no target
        const std::int64_t groups = N ? R / N : x.numel() / (G * V);
        for (std::int64_t b = 0; b < groups; ++b) std::fill_n(out + (b * G + N) * V, (G - N) * V, T(0));
      }
      detail::parallel_for(R, R * V > detail::kParallelGrain, [&](std::int64_t r) {
        const std::int64_t k = detail::load_index(t, r), row = (r / N) * G + r % N;
        T* o = out + row * V;
        if (k == ignore) {
          if (!acc) std::fill_n(o, V, T(0));
          return;
        }
        const T* in = xs + row * V;
        const T gr = reduction == 0 ? gs[r] : g0, l = ls[r];
        if constexpr (std::is_same_v<T, float>) {
          simd::ce_grad(in, V, l, gr, o, acc);
        } else {
          detail::ArrayMap<T> oa(o, V);
          if (acc) oa += detail::SoftmaxMath::ce_grad(detail::ConstArrayMap<T>(in, V), l, gr);
          else oa = detail::SoftmaxMath::ce_grad(detail::ConstArrayMap<T>(in, V), l, gr);
        }
        o[k] -= gr;
      });
    });
  }
};
using CrossEntropyKernels = CrossEntropyKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/cross_entropy.hpp ----
// ---- begin nn/backend/cpu/norm.hpp ----
// nn::cpu's fused RMSNorm and its vjp (ops/norm.hpp; the composite reference in layers/norm.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `NormKernels` (why: backend/cpu.hpp).
template <class = void>
struct NormKernelsT {
  /// y = x * rstd (* w) with rstd = 1 / sqrt(mean(x^2) + eps) per row of the last axis (kept in
  /// `rstd` for the vjp). w may be undefined (no gain).
  static void rms_norm(const Tensor& x, const Tensor& w, double eps, Tensor& y, Tensor& rstd) {
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const std::int64_t C = x.dim(-1), R = x.numel() / C;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ws = w.defined() ? static_cast<const T*>(w.raw()) : nullptr;
      T* ys = static_cast<T*>(y.raw());
      T* rs = static_cast<T*>(rstd.raw());
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C)), e = static_cast<T>(eps);
      detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
        detail::ConstArrayMap<T> xr(xs + r * C, C);
        detail::ArrayMap<T> yr(ys + r * C, C);
        const T k = detail::RmsNormMath::rstd(xr.square().sum(), inv_c, e);
        rs[r] = k;
        if (ws) yr = (xr * k) * detail::ConstArrayMap<T>(ws, C);
        else yr = xr * k;
      });
    });
  }

  /// The vjp of rms_norm: with u = g * w (or g), gx (+)= rstd u - rstd^3 x sum(u x) / C per row,
  /// gw (+)= sum over rows of g x rstd (serial over rows: deterministic). Either may be null.
  static void rms_norm_vjp(const Tensor& x, const Tensor& w, const Tensor& rstd, const Tensor& g, GradOut ox,
                           GradOut ow) {
    Tensor *gx = ox.g, *gw = ow.g;
    const bool acc_x = ox.acc, acc_w = ow.acc;
    detail::dispatch_float(x.dtype(), "rmsnorm", [&]<class T>() {
      const std::int64_t C = x.dim(-1), R = x.numel() / C;
      const T* xs = static_cast<const T*>(x.raw());
      const T* ws = w.defined() ? static_cast<const T*>(w.raw()) : nullptr;
      const T* rs = static_cast<const T*>(rstd.raw());
      const T* gs = static_cast<const T*>(g.raw());
      const T inv_c = static_cast<T>(1.0 / static_cast<double>(C));
      if (gx) {
        T* out = static_cast<T*>(gx->raw());
        detail::parallel_for(R, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
          detail::ConstArrayMap<T> xr(xs + r * C, C), gr(gs + r * C, C);
          detail::ArrayMap<T> o(out + r * C, C);
          const T k = rs[r];
          if (ws) {
            detail::ConstArrayMap<T> wr(ws, C);
            const T c = detail::RmsNormMath::vjp_coef(k, inv_c, T((gr * wr * xr).sum()));
            if (acc_x) o += detail::RmsNormMath::gx(k, gr * wr, c, xr);
            else o = detail::RmsNormMath::gx(k, gr * wr, c, xr);
          } else {
            const T c = detail::RmsNormMath::vjp_coef(k, inv_c, T((gr * xr).sum()));
            if (acc_x) o += detail::RmsNormMath::gx(k, gr, c, xr);
            else o = detail::RmsNormMath::gx(k, gr, c, xr);
          }
        });
      }
      if (gw) {
        detail::ArrayMap<T> o(static_cast<T*>(gw->raw()), C);
        if (!acc_w) o.setZero();
        for (std::int64_t r = 0; r < R; ++r)
          o += detail::ConstArrayMap<T>(gs + r * C, C) * detail::ConstArrayMap<T>(xs + r * C, C) * rs[r];
      }
    });
  }
};
using NormKernels = NormKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/norm.hpp ----
// ---- begin nn/backend/cpu/rope.hpp ----
// nn::cpu's fused rotary embedding, forward and inverse (ops/rope.hpp; reference layers/rope.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `RopeKernels` (why: backend/cpu.hpp).
template <class = void>
struct RopeKernelsT {
  /// y (+)= x with the first dims = 2 * cos.shape[-1] features of each row rotated by its
  /// position's angles: NEOX pairs (i, i + dims/2), or traditional pairs (2i, 2i + 1);
  /// (a, b) -> (a cos - b sin, a sin + b cos), and with `inverse` by minus the angle (the vjp).
  /// cos/sin (T, dims/2) against x (..., T, D), or (T, 1, dims/2) against x (..., T, M, D).
  static void rope(const Tensor& x, const Tensor& cos, const Tensor& sin, RopeArgs args, Tensor& y, bool acc) {
    const bool traditional = args.traditional, inverse = args.inverse;
    detail::dispatch_float(x.dtype(), "rope", [&]<class T>() {
      const std::int64_t D = x.dim(-1), half = cos.dim(-1), T_ = cos.dim(0);
      const std::int64_t M = cos.rank() == 3 ? x.dim(-2) : 1, rows = x.numel() / D;
      const T* xs = static_cast<const T*>(x.raw());
      const T* cs = static_cast<const T*>(cos.raw());
      const T* ss = static_cast<const T*>(sin.raw());
      T* ys = static_cast<T*>(y.raw());
      const T sg = inverse ? T(-1) : T(1);
      auto rows_of = [&]<bool Acc, bool Trad>() {
        detail::parallel_for(rows, x.numel() > detail::kParallelGrain, [&](std::int64_t r) {
          const std::int64_t t = (r / M) % T_;
          const T* c = cs + t * half;
          const T* s = ss + t * half;
          const T* a = xs + r * D;
          T* o = ys + r * D;
          for (std::int64_t i = 0; i < half; ++i) {
            const std::int64_t i1 = Trad ? 2 * i : i, i2 = Trad ? 2 * i + 1 : i + half;
            const T si = sg * s[i], o1 = detail::RopeMath::first(a[i1], a[i2], c[i], si),
                  o2 = detail::RopeMath::second(a[i1], a[i2], c[i], si);
            if constexpr (Acc) {
              o[i1] += o1;
              o[i2] += o2;
            } else {
              o[i1] = o1;
              o[i2] = o2;
            }
          }
          for (std::int64_t j = 2 * half; j < D; ++j) {
            if constexpr (Acc) o[j] += a[j];
            else o[j] = a[j];
          }
        });
      };
      if (acc) traditional ? rows_of.template operator()<true, true>() : rows_of.template operator()<true, false>();
      else traditional ? rows_of.template operator()<false, true>() : rows_of.template operator()<false, false>();
    });
  }
};
using RopeKernels = RopeKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/rope.hpp ----
// ---- begin nn/backend/cpu/attention.hpp ----
// nn::cpu's fused attention: the materialised form (probabilities kept) and flash attention,
// each with its vjp (ops/attention.hpp; the composite reference in layers/attention.hpp).

#include <cstring>
#include <limits>
#include <utility>


namespace nn {

namespace detail {

/// Flash attention's tile: kFlashRows queries against kFlashCols keys. A tile's scores (64 KiB in
/// f32) stay in L2 beside the q, k and v rows they come from. Measured on bench_attention at
/// T = 256..4096 against 64 x 64, 96 x 128 and 48 x 256: smaller tiles spend their time packing
/// each product's operands, not multiplying them.
inline constexpr std::int64_t kFlashRows = 128, kFlashCols = 128;

/// The span [a0, a1) of a flash tile's score row (room for kFlashCols; keys [lo, hi) visible)
/// that its row math runs over. With a positive scale, [lo, hi) widened to whole 16-lane vectors,
/// its hidden keys set to -inf, which the exp turns into exact zeros: no vector is partial (on
/// the causal diagonal, where every row ends elsewhere, partial vectors' loads and stores made
/// the row math slower than Eigen's passes, Zen 5). Otherwise -inf would not stay -inf when
/// scaled, and the span is [lo, hi).
template <class T>
inline std::pair<std::int64_t, std::int64_t> flash_span(T* row, std::int64_t lo, std::int64_t hi, T scale) {
  if (!(scale > T(0))) return {lo, hi};
  const std::int64_t a0 = lo / 16 * 16, a1 = std::min(kFlashCols, (hi + 15) / 16 * 16);
  std::fill(row + a0, row + lo, -std::numeric_limits<T>::infinity());
  std::fill(row + hi, row + a1, -std::numeric_limits<T>::infinity());
  return {a0, a1};
}

/// Causal attention's row (and key) block: the products of a block of queries stop at its last
/// key, so the work above the diagonal left undone is all but half a block wide.
inline constexpr std::int64_t kAttnBlock = 32;

/// Packed rows' document starts (B, T) int32 for flash attention, or null when undefined. Each
/// row must be a sequence of whole documents: starts[b, 0] = 0, and starts[b, i] is either
/// starts[b, i - 1] (the same document) or i (a new one). Checked on every call (a replay swaps
/// the tensor in), O(B T).
inline const std::int32_t* check_doc_starts(const Tensor& starts, std::int64_t Bn, std::int64_t T, bool causal) {
  if (!starts.defined()) return nullptr;
  if (!causal) fail("flash_attention", "document starts need causal attention");
  if (starts.dtype() != DType::i32 || starts.numel() != Bn * T)
    fail("flash_attention", "document starts must be (B, T) = (", Bn, ", ", T, ") int32, got ", starts.shape().str(), " ",
         dtype_name(starts.dtype()));
  const std::int32_t* s = starts.data<std::int32_t>();
  for (std::int64_t b = 0; b < Bn; ++b)
    for (std::int64_t i = 0; i < T; ++i) {
      const std::int32_t v = s[b * T + i];
      if (i == 0 ? v != 0 : (v != s[b * T + i - 1] && v != i))
        fail("flash_attention", "document starts of row ", b, " are not whole documents: position ", i, " starts at ", v,
             i == 0 ? " (must be 0)" : " (must be the previous position's start or the position itself)");
    }
  return s;
}

/// The first key query i sees in flash attention: its document's start (packed rows) and, with a
/// sliding window W, i - W + 1 (transformers' sliding-window causal mask: i - j < W).
inline std::int64_t flash_first_key(const std::int32_t* doc_start, std::int64_t i, std::int64_t window) {
  const std::int64_t d = doc_start ? *doc_start : 0;
  return window > 0 ? std::max(d, i - window + 1) : d;
}

/// The keys [j0 + lo, j0 + hi) of the tile [j0, j0 + c) that query i sees (lo >= hi: none).
inline std::pair<std::int64_t, std::int64_t> flash_visible(const std::int32_t* doc_start, std::int64_t i,
                                                           std::int64_t window, bool causal, std::int64_t j0,
                                                           std::int64_t c) {
  const std::int64_t lo = std::clamp<std::int64_t>(flash_first_key(doc_start, i, window) - j0, 0, c);
  return {lo, causal ? std::clamp<std::int64_t>(i + 1 - j0, 0, c) : c};
}

/// Caps a flash tile row's visible scores [lo, hi) in place, y = SoftcapMath::value(sc x, cap), so
/// the row math after it runs at scale 1. In float32 the same formula runs on Eigen's vectorised
/// tanh (a rational approximation within a few ulp of libm's tanhf), which made a capped flash
/// call 2.5x a plain one as a scalar loop; float64 keeps libm's tanh. The forward and the vjp's
/// recomputation both come here, so they agree bit for bit.
template <class T>
inline void flash_softcap(T* row, std::int64_t lo, std::int64_t hi, T sc, T cap) {
  if (hi <= lo) return;
  if constexpr (std::is_same_v<T, float>) {
    ArrayMap<T> x(row + lo, hi - lo);
    x = cap * ((sc * x) / cap).tanh();
  } else {
    for (std::int64_t j = lo; j < hi; ++j) row[j] = SoftcapMath::value(sc * row[j], cap);
  }
}

}  // namespace detail

namespace cpu_kernels {

// A class template with one instance, `AttentionKernels` (why: backend/cpu.hpp).
template <class = void>
struct AttentionKernelsT {
  /// Attention per (batch, query head): P = softmax(scale q k^T + mask) (kept in p: (B, H, T, T)),
  /// out = P v. q, out: (B, T, H * hd); k, v: (B, T, KV * hd); query head h reads kv head
  /// h / (H / KV); mask (may be undefined) broadcasts to (B, H, T, T). `causal`: query i sees keys
  /// 0..i only, besides any mask; the rows are then taken in blocks of kAttnBlock and each block's
  /// products stop at its last key, about half the work of the square. P's row i is then exact 0
  /// from key i + 1 to its block's end, and the rest is left unwritten (never read, here or in
  /// the vjp).
  /// The heads run in parallel, each product a strided GEMM on its thread (no permuted copies).
  static void attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& mask, const AttentionAttrs& a,
                        Tensor& out, Tensor& p) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const std::int64_t g = H / KV, qs = H * hd, ks = KV * hd, rb = causal ? detail::kAttnBlock : T_;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* Mk = mask.defined() ? static_cast<const T*>(mask.raw()) : nullptr;
      T* O = static_cast<T*>(out.raw());
      T* P = static_cast<T*>(p.raw());
      std::array<std::int64_t, kMaxRank> ms{};
      if (Mk) ms = detail::broadcast_strides(mask.shape(), Shape{Bn, H, T_, T_});
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      detail::parallel_for(Bn * H, p.numel() * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / H, h = t % H, kh = h / g;
        T* pt = P + t * T_ * T_;
        const T* qt = Q + b * T_ * qs + h * hd;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ot = O + b * T_ * qs + h * hd;
        for (std::int64_t i0 = 0; i0 < T_; i0 += rb) {  // query rows i0..i1-1 against keys 0..kn-1
          const std::int64_t i1 = std::min(T_, i0 + rb), kn = causal ? i1 : T_;
          detail::gemm_serial<T>(false, true, i1 - i0, kn, hd, qt + i0 * qs, qs, kt, ks, pt + i0 * T_, T_, false);  // q k^T
          for (std::int64_t i = i0; i < i1; ++i) {
            const std::int64_t n = causal ? i + 1 : T_;
            detail::softmax_row(pt + i * T_, n, sc, Mk ? Mk + b * ms[0] + h * ms[1] + i * ms[2] : nullptr);
            std::fill(pt + i * T_ + n, pt + i * T_ + kn, T(0));  // the block's keys past i (all P v and the vjp read)
          }
          detail::gemm_serial<T>(false, false, i1 - i0, hd, kn, pt + i0 * T_, T_, vt, ks, ot + i0 * qs, qs, false);  // P v
        }
      }, /*uneven=*/true);
    });
  }

  /// The vjp of attention, per (batch, kv head) so each kv head's gradient sums its query heads
  /// without races: dv += P^T g; dS = P * (g v^T - rowsum(P * g v^T)) * scale (in `scratch`,
  /// (B * KV, T, T)); dq = dS k; dk += dS^T q. Any of gq, gk, gv may be null. `causal`: P is
  /// attention's causal one, and the products read only the blocks the forward wrote.
  static void attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& p, const Tensor& g,
                            const AttentionAttrs& a, Tensor& scratch, GradOut oq, GradOut ok, GradOut ov) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    Tensor *gq = oq.g, *gk = ok.g, *gv = ov.g;
    const bool acc_q = oq.acc, acc_k = ok.acc, acc_v = ov.acc;
    detail::dispatch_float(q.dtype(), "attention", [&]<class T>() {
      const std::int64_t grp = H / KV, qs = H * hd, ks = KV * hd, rb = causal ? detail::kAttnBlock : T_;
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* P = static_cast<const T*>(p.raw());
      const T* G = static_cast<const T*>(g.raw());
      T* S = static_cast<T*>(scratch.raw());
      T* GQ = gq ? static_cast<T*>(gq->raw()) : nullptr;
      T* GK = gk ? static_cast<T*>(gk->raw()) : nullptr;
      T* GV = gv ? static_cast<T*>(gv->raw()) : nullptr;
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      detail::parallel_for(Bn * KV, p.numel() * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / KV, kh = t % KV;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ds = S + t * T_ * T_;
        for (std::int64_t j = 0; j < grp; ++j) {
          const std::int64_t h = kh * grp + j, qo = b * T_ * qs + h * hd, ko = b * T_ * ks + kh * hd;
          const T* pt = P + (b * H + h) * T_ * T_;
          // Rows by query block [i0, i1) (keys 0..kn-1): dS = P * (g v^T - rowsum) * scale, dq = dS k.
          if (GQ || GK)
            for (std::int64_t i0 = 0; i0 < T_; i0 += rb) {
              const std::int64_t i1 = std::min(T_, i0 + rb), kn = causal ? i1 : T_;
              detail::gemm_serial<T>(false, true, i1 - i0, kn, hd, G + qo + i0 * qs, qs, vt, ks, ds + i0 * T_, T_, false);  // g v^T
              for (std::int64_t i = i0; i < i1; ++i) {
                const T dot = (detail::ArrayMap<T>(ds + i * T_, kn) * detail::ConstArrayMap<T>(pt + i * T_, kn)).sum();
                detail::softmax_vjp_row(pt + i * T_, ds + i * T_, kn, dot, sc);
              }
              if (GQ) detail::gemm_serial<T>(false, false, i1 - i0, hd, kn, ds + i0 * T_, T_, kt, ks, GQ + qo + i0 * qs, qs, acc_q);  // dS k
            }
          // Columns by key block [j0, j1) (queries j0..T-1 see them): dv (+)= P^T g, dk (+)= dS^T q.
          for (std::int64_t j0 = 0; j0 < T_; j0 += rb) {
            const std::int64_t j1 = std::min(T_, j0 + rb), i0 = causal ? j0 : 0;
            if (GV) detail::gemm_serial<T>(true, false, j1 - j0, hd, T_ - i0, pt + i0 * T_ + j0, T_, G + qo + i0 * qs, qs,
                                           GV + ko + j0 * ks, ks, acc_v || j > 0);  // P^T g
            if (GK) detail::gemm_serial<T>(true, false, j1 - j0, hd, T_ - i0, ds + i0 * T_ + j0, T_, Q + qo + i0 * qs, qs,
                                           GK + ko + j0 * ks, ks, acc_k || j > 0);  // dS^T q
          }
        }
      }, /*uneven=*/true);
    });
  }

  /// Flash attention (Dao et al. 2022; FlashAttention-2's loop order, Dao 2023): what attention
  /// computes without a mask tensor, without ever storing the (T, T) probabilities. Per (batch,
  /// query head, block of kFlashRows queries), the keys are read kFlashCols at a time; a tile's
  /// scores s = scale q k^T live in the thread's workspace, and an online softmax keeps per query
  /// row the running max m and sum l: out = sum_j exp(s_j - m) v_j / l, rescaled by
  /// exp(m_old - m_new) whenever the max grows. Saves only lse = m + log l (B, H, T) for the vjp. `causal`: query i
  /// sees keys 0..i; key blocks past a query block's last row are never touched.
  /// q, out: (B, T, H * hd); k, v: (B, T, KV * hd); query head h reads kv head h / (H / KV).
  /// starts (B, T) int32, when defined (packed rows; causal only): starts[b, i] is where query
  /// i's document begins, and it sees keys starts[b, i]..i only (block-diagonal causal); key tiles
  /// before a query block's first document are never touched. a.window > 0 (causal only): query i
  /// sees keys i - window < j <= i too, and key tiles before a block's first row's window are
  /// never touched. a.softcap > 0: the scaled scores are capped (SoftcapMath) before the softmax.
  static void flash_attention(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& starts,
                              const AttentionAttrs& a, Tensor& out, Tensor& lse) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    const std::int64_t W = a.window;
    const std::int32_t* St = detail::check_doc_starts(starts, Bn, T_, causal);
    detail::dispatch_float(q.dtype(), "flash_attention", [&]<class T>() {
      constexpr std::int64_t Br = detail::kFlashRows, Bc = detail::kFlashCols;
      const std::int64_t g = H / KV, qs = H * hd, ks = KV * hd, nqb = (T_ + Br - 1) / Br;
      const T cap = static_cast<T>(a.softcap);
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      T* O = static_cast<T*>(out.raw());
      T* L = static_cast<T*>(lse.raw());
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      const bool wide = Bn * H * T_ * (causal ? T_ / 2 + 1 : T_) * hd > detail::kParallelGrain;
      detail::parallel_for(Bn * H * nqb, wide, [&](std::int64_t t) {
        const std::int64_t bh = t / nqb, b = bh / H, h = bh % H, kh = h / g;
        const std::int64_t i0 = (t % nqb) * Br, r = std::min(T_, i0 + Br) - i0, kend = causal ? i0 + r : T_;
        const std::int32_t* st = St ? St + b * T_ + i0 : nullptr;  // the block's document starts
        const std::int64_t kbeg = detail::flash_first_key(st, i0, W) / Bc * Bc;  // the first key tile any row sees
        const T* qt = Q + (b * T_ + i0) * qs + h * hd;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        T* ot = O + (b * T_ + i0) * qs + h * hd;
        // the tile's scores, then its exp(s - m): (r, c), row stride Bc; then m and l per row
        T* s = static_cast<T*>(detail::gemm_workspace(sizeof(T) * (Br * Bc + 2 * Br), 2));
        T *m = s + Br * Bc, *l = m + Br;
        std::fill(m, m + r, -std::numeric_limits<T>::infinity());  // no key seen yet
        std::fill(l, l + r, T(0));
        for (std::int64_t j0 = kbeg; j0 < kend; j0 += Bc) {
          const std::int64_t c = std::min(kend, j0 + Bc) - j0;
          detail::gemm_serial<T>(false, true, r, c, hd, qt, qs, kt + j0 * ks, ks, s, Bc, false);  // q k^T
          for (std::int64_t i = 0; i < r; ++i) {
            // keys j0+lo..j0+hi-1 of this tile are visible to query i0 + i; the first tile
            // (j0 = kbeg) always has one without documents or window, a later one on the diagonal
            // may have none, and any tile before the row's document or window has none (its
            // m stays -inf, l 0, and the first tile it sees rebases them to nothing)
            const auto [lo, hi] = detail::flash_visible(st ? st + i : nullptr, i0 + i, W, causal, j0, c);
            T* row = s + i * Bc;
            if (hi <= lo) {
              std::fill(row, row + c, T(0));
              continue;
            }
            T rs = sc;  // the row math's scale: 1 once the scores are capped
            if (cap > T(0)) detail::flash_softcap(row, lo, hi, std::exchange(rs, T(1)), cap);
            const auto [a0, a1] = detail::flash_span(row, lo, hi, rs);
            const T mnew = std::max(m[i], detail::scale_max(row + a0, a1 - a0, rs));
            const T sum = detail::exp_sum(row + a0, a1 - a0, mnew);
            std::fill(row, row + a0, T(0));
            std::fill(row + std::min(a1, c), row + c, T(0));
            if (j0 == kbeg) {
              l[i] = sum;
            } else {
              const T alpha = detail::SoftmaxMath::rebase(m[i], mnew);  // the earlier tiles' terms, on the new max
              l[i] = l[i] * alpha + sum;
              if (alpha != T(1)) detail::ArrayMap<T>(ot + i * qs, hd) *= alpha;
            }
            m[i] = mnew;
          }
          detail::gemm_serial<T>(false, false, r, hd, c, s, Bc, vt + j0 * ks, ks, ot, qs, j0 > kbeg);  // (+)= p v
        }
        T* lt = L + bh * T_ + i0;
        for (std::int64_t i = 0; i < r; ++i) {
          detail::ArrayMap<T>(ot + i * qs, hd) *= T(1) / l[i];
          lt[i] = detail::SoftmaxMath::lse(m[i], l[i]);
        }
      }, /*uneven=*/causal);
    });
  }

  /// The vjp of flash_attention, recomputing each tile's probabilities p = exp(scale q k^T - lse)
  /// instead of reading stored ones. With dlt_i = rowsum(g_i * out_i) (in `delta`, (B, H, T)):
  /// dv_j += p^T g, ds = p * (g v_j^T - dlt) * scale, dq_i += ds k_j, dk_j += ds^T q_i. Per
  /// (batch, kv head), so every gradient row has one writer: key blocks outside, the group's
  /// query heads and the query blocks that see the key block inside. Any of gq, gk, gv may be null.
  /// starts: the forward's document starts (or undefined); query blocks whose documents all begin
  /// after a key block are skipped, so dq is zeroed first instead of overwritten by key block 0
  /// (and so with a window, whose query blocks past the key block's reach are skipped too). With
  /// a soft cap, ds is also multiplied by the cap's derivative, recomputed from the capped scores.
  static void flash_attention_vjp(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& starts,
                                  const Tensor& out, const Tensor& lse, const Tensor& g, const AttentionAttrs& a,
                                  Tensor& delta, GradOut oq, GradOut ok, GradOut ov) {
    const std::int64_t Bn = a.B, T_ = a.T, H = a.H, KV = a.KV, hd = a.head_dim;
    const double scale = a.scale;
    const bool causal = a.causal;
    Tensor *gq = oq.g, *gk = ok.g, *gv = ov.g;
    const std::int64_t W = a.window;
    const std::int32_t* St = detail::check_doc_starts(starts, Bn, T_, causal);
    const bool skips = St || W > 0;  // may a query block not meet key block 0?
    if (skips && gq && !oq.acc) std::memset(gq->raw(), 0, gq->nbytes());
    const bool acc_q = oq.acc || skips, acc_k = ok.acc, acc_v = ov.acc;
    detail::dispatch_float(q.dtype(), "flash_attention", [&]<class T>() {
      constexpr std::int64_t Br = detail::kFlashRows, Bc = detail::kFlashCols;
      const std::int64_t grp = H / KV, qs = H * hd, ks = KV * hd;
      const T cap = static_cast<T>(a.softcap);
      const T* Q = static_cast<const T*>(q.raw());
      const T* K = static_cast<const T*>(k.raw());
      const T* V = static_cast<const T*>(v.raw());
      const T* O = static_cast<const T*>(out.raw());
      const T* L = static_cast<const T*>(lse.raw());
      const T* G = static_cast<const T*>(g.raw());
      T* D = static_cast<T*>(delta.raw());
      T* GQ = gq ? static_cast<T*>(gq->raw()) : nullptr;
      T* GK = gk ? static_cast<T*>(gk->raw()) : nullptr;
      T* GV = gv ? static_cast<T*>(gv->raw()) : nullptr;
      const T sc = static_cast<T>(scale);
      [[maybe_unused]] detail::BlasSerial serial;
      const bool wide = Bn * H * T_ * (causal ? T_ / 2 + 1 : T_) * hd > detail::kParallelGrain;
      detail::parallel_for(Bn * H * T_, Bn * H * T_ * hd > detail::kParallelGrain, [&](std::int64_t t) {
        const std::int64_t b = t / (H * T_), h = t / T_ % H, i = t % T_, o = (b * T_ + i) * qs + h * hd;
        D[t] = (detail::ConstArrayMap<T>(G + o, hd) * detail::ConstArrayMap<T>(O + o, hd)).sum();  // t = (b, h, i)
      });
      detail::parallel_for(Bn * KV, wide, [&](std::int64_t t) {
        const std::int64_t b = t / KV, kh = t % KV;
        const T* kt = K + b * T_ * ks + kh * hd;
        const T* vt = V + b * T_ * ks + kh * hd;
        // a tile's probabilities (r, c), score gradients and (soft cap) capped scores
        T* p = static_cast<T*>(detail::gemm_workspace(sizeof(T) * (cap > T(0) ? 3 : 2) * Br * Bc, 2));
        T* ds = p + Br * Bc;
        T* y = ds + Br * Bc;
        for (std::int64_t j0 = 0; j0 < T_; j0 += Bc) {
          const std::int64_t c = std::min(T_, j0 + Bc) - j0;
          bool first_k = !acc_k, first_v = !acc_v;  // the first write to this key block overwrites
          for (std::int64_t jh = 0; jh < grp; ++jh) {
            const std::int64_t h = kh * grp + jh, bh = b * H + h;
            // causal: the first query block holding a row that sees key j0
            for (std::int64_t i0 = causal ? j0 / Br * Br : 0; i0 < T_; i0 += Br) {
              // documents: this block's rows and all later ones begin after the key block; window:
              // they are all past its last key's reach
              if (St && St[b * T_ + i0] >= j0 + c) break;
              if (W > 0 && i0 >= j0 + c - 1 + W) break;
              const std::int64_t r = std::min(T_, i0 + Br) - i0, o = (b * T_ + i0) * qs + h * hd;
              detail::gemm_serial<T>(false, true, r, c, hd, Q + o, qs, kt + j0 * ks, ks, p, Bc, false);  // q k^T
              for (std::int64_t i = 0; i < r; ++i) {
                const auto [lo, hi] = detail::flash_visible(St ? St + b * T_ + i0 + i : nullptr, i0 + i, W, causal, j0, c);
                T* row = p + i * Bc;
                if (hi <= lo) {
                  std::fill(row, row + c, T(0));
                  continue;
                }
                T rs = sc;
                if (cap > T(0)) {  // keep the capped scores for the cap's derivative below
                  detail::flash_softcap(row, lo, hi, std::exchange(rs, T(1)), cap);
                  std::copy(row + lo, row + hi, y + i * Bc + lo);
                }
                const auto [a0, a1] = detail::flash_span(row, lo, hi, rs);
                detail::probs_from_lse(row + a0, a1 - a0, rs, L[bh * T_ + i0 + i]);
                std::fill(row, row + a0, T(0));
                std::fill(row + std::min(a1, c), row + c, T(0));
              }
              if (GV) detail::gemm_serial<T>(true, false, c, hd, r, p, Bc, G + o, qs, GV + (b * T_ + j0) * ks + kh * hd,
                                             ks, !first_v);  // p^T g
              first_v = false;
              if (!GQ && !GK) continue;
              detail::gemm_serial<T>(false, true, r, c, hd, G + o, qs, vt + j0 * ks, ks, ds, Bc, false);  // g v^T
              for (std::int64_t i = 0; i < r; ++i) {
                detail::softmax_vjp_row(p + i * Bc, ds + i * Bc, c, D[bh * T_ + i0 + i], sc);
                if (cap > T(0)) {  // through the cap: ds = ds_capped * (1 - (y / cap)^2), on the visible keys
                  // (sc already applied: d(cap tanh(sc x / cap))/dx = sc (1 - (y / cap)^2))
                  const auto [lo, hi] = detail::flash_visible(St ? St + b * T_ + i0 + i : nullptr, i0 + i, W, causal, j0, c);
                  for (std::int64_t j = lo; j < hi; ++j) ds[i * Bc + j] *= detail::SoftcapMath::grad(y[i * Bc + j], cap);
                }
              }
              if (GQ) detail::gemm_serial<T>(false, false, r, hd, c, ds, Bc, kt + j0 * ks, ks, GQ + o, qs,
                                             acc_q || j0 > 0);  // ds k (query block i0 meets key block 0 first)
              if (GK) detail::gemm_serial<T>(true, false, c, hd, r, ds, Bc, Q + o, qs, GK + (b * T_ + j0) * ks + kh * hd,
                                             ks, !first_k);  // ds^T q
              first_k = false;
            }
          }
        }
      }, /*uneven=*/causal);
    });
  }
};
using AttentionKernels = AttentionKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/attention.hpp ----
// ---- begin nn/backend/cpu/glu.hpp ----
// nn::cpu's fused SwiGLU and its vjp (ops/glu.hpp; reference layers/activations.hpp).


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `GluKernels` (why: backend/cpu.hpp).
template <class = void>
struct GluKernelsT {
  // The math is detail::SwiGluMath (backend/math.hpp), a chunk at a time: on simd.hpp's lane
  // vectors for float32, on Eigen arrays for float64.

  /// y = silu(gate) * up = gate * sigmoid(gate) * up.
  static void swiglu(const Tensor& gate, const Tensor& up, Tensor& y) {
    detail::dispatch_float(y.dtype(), "swiglu", [&]<class T>() {
      const T* gs = static_cast<const T*>(gate.raw());
      const T* us = static_cast<const T*>(up.raw());
      T* ys = static_cast<T*>(y.raw());
      detail::parallel_chunks(y.numel(), [&](std::int64_t i0, std::int64_t i1) {
        if constexpr (std::is_same_v<T, float>) {  // at the CPU's vector width (simd.hpp)
          simd::swiglu(gs + i0, us + i0, ys + i0, i1 - i0);
        } else {
          detail::ConstArrayMap<T> a(gs + i0, i1 - i0), u(us + i0, i1 - i0);
          detail::ArrayMap<T>(ys + i0, i1 - i0) = detail::SwiGluMath::y(a, u);
        }
      });
    });
  }

  /// The vjp of swiglu: ggate (+)= g up s (1 + gate (1 - s)), gup (+)= g gate s, s = sigmoid(gate).
  static void swiglu_vjp(const Tensor& gate, const Tensor& up, const Tensor& g, GradOut og, GradOut ou) {
    Tensor *ggate = og.g, *gup = ou.g;
    const bool acc_gate = og.acc, acc_up = ou.acc;
    detail::dispatch_float(g.dtype(), "swiglu", [&]<class T>() {
      const T* as = static_cast<const T*>(gate.raw());
      const T* us = static_cast<const T*>(up.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* da = ggate ? static_cast<T*>(ggate->raw()) : nullptr;
      T* du = gup ? static_cast<T*>(gup->raw()) : nullptr;
      detail::parallel_chunks(g.numel(), [&](std::int64_t i0, std::int64_t i1) {
        const std::int64_t n = i1 - i0;
        if constexpr (std::is_same_v<T, float>) {  // at the CPU's vector width (simd.hpp)
          simd::swiglu_vjp(as + i0, us + i0, gs + i0, da ? da + i0 : nullptr, acc_gate, du ? du + i0 : nullptr, acc_up, n);
          return;
        }
        detail::ConstArrayMap<T> a(as + i0, n), u(us + i0, n), gr(gs + i0, n);
        alignas(64) T sbuf[detail::kChunk];  // on the stack: a replay allocates nothing
        detail::ArrayMap<T> s(sbuf, n);
        s = detail::SwiGluMath::sig(a);
        if (da) {
          detail::ArrayMap<T> o(da + i0, n);
          if (acc_gate) o += detail::SwiGluMath::dgate(a, u, gr, s);
          else o = detail::SwiGluMath::dgate(a, u, gr, s);
        }
        if (du) {
          detail::ArrayMap<T> o(du + i0, n);
          if (acc_up) o += detail::SwiGluMath::dup(a, gr, s);
          else o = detail::SwiGluMath::dup(a, gr, s);
        }
      });
    });
  }
};
using GluKernels = GluKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/glu.hpp ----
// ---- begin nn/backend/cpu/fused.hpp ----
// nn::cpu's fused elementwise kernel: a FusedProgram (backend/policy.hpp; ops/fused.hpp makes it
// from a group of the tape's unary, binary and where nodes) run over the output in tiles of kTile
// elements. Each step of the program runs over the whole tile before the next (one dispatch per
// step and tile, a loop the compiler vectorises as it does the unfused kernels'), and the tile's
// registers stay in L1: one pass over memory for the group instead of one per node.
//
// The vjp recomputes the tile's intermediates (the last step's value it reads from the output),
// then walks the steps in reverse, as the backward
// sweep walks the nodes: each gradient is the same product (g * f'(...)) the node's own vjp
// forms, and each contribution to an input is added in the order the sweep would add it, so the
// fused step equals the unfused one bit for bit.


namespace nn {

/// Where the fused vjp writes one contribution to an input's gradient: a buffer at the output's
/// shape (the input's gradient, or a scratch the op then sums down to a broadcast input's shape)
/// and whether it adds into what is there.
struct FusedGradDest {
  Tensor* g = nullptr;
  bool acc = false;
};

namespace cpu_kernels {

// A class template with one instance, `FusedKernels` (why: backend/cpu.hpp).
template <class = void>
struct FusedKernelsT {
  static constexpr std::int64_t kTile = 128;
  static constexpr int kMaxRegs = kMaxFusedInputs + kMaxFusedSteps;

  /// y = the program's output; ins: its inputs, each of y's shape or broadcast to it.
  static void fused(const FusedProgram& p, std::span<const Tensor* const> ins, Tensor& y) {
    detail::dispatch_float(y.dtype(), "fused", [&]<class T>() {
      const Readers rd(p, ins, y.shape());
      T* ys = static_cast<T*>(y.raw());
      const std::int64_t n = y.numel(), tiles = (n + kTile - 1) / kTile;
      detail::parallel_for(tiles, n > detail::kParallelGrain, [&](std::int64_t t) {
        alignas(64) T buf[kMaxRegs][kTile];
        const T* r[kMaxRegs];
        const std::int64_t i0 = t * kTile, len = std::min(kTile, n - i0);
        rd.template load<T>(r, buf, i0, len);
        run_steps<T>(p, r, buf, p.steps - 1, len);
        run_step<T>(p, p.steps - 1, r, ys + i0, len);  // the last step straight into y
      });
    });
  }

  /// The program's vjp from the output y and its gradient g: dest[c] receives contribution c,
  /// the contributions numbered as the steps are walked in reverse (operand a before b) over the
  /// operands that are inputs and want a gradient (ops/fused.hpp numbers them the same way).
  /// The intermediates the derivatives read are recomputed from the inputs (FusedProgram::
  /// vjp_need); the last step's value is read from y.
  static void fused_vjp(const FusedProgram& p, std::span<const Tensor* const> ins, const Tensor& y, const Tensor& g,
                        std::span<const FusedGradDest> dest) {
    detail::dispatch_float(g.dtype(), "fused", [&]<class T>() {
      const Readers rd(p, ins, g.shape());
      const T* ys = static_cast<const T*>(y.raw());
      const T* gs = static_cast<const T*>(g.raw());
      const std::int64_t n = g.numel(), tiles = (n + kTile - 1) / kTile;
      detail::parallel_for(tiles, n > detail::kParallelGrain, [&](std::int64_t t) {
        alignas(64) T buf[kMaxRegs][kTile];
        alignas(64) T gbuf[kMaxFusedSteps][kTile];  // d loss / d (step s's value), s < steps - 1
        alignas(64) static const T zeros[kTile] = {};  // what an unread register points at
        const T* r[kMaxRegs];
        const std::int64_t i0 = t * kTile, len = std::min(kTile, n - i0);
        rd.template load<T>(r, buf, i0, len, p.vjp_need, zeros);
        run_steps<T>(p, r, buf, p.steps - 1, len, p.vjp_need, zeros);
        r[p.inputs + p.steps - 1] = needs(p.vjp_need, p.inputs + p.steps - 1) ? ys + i0 : zeros;
        std::size_t c = 0;
        for (int s = p.steps - 1; s >= 0; --s) {
          const FusedStep& st = p.step[static_cast<std::size_t>(s)];
          if (!st.grad) continue;
          const T* go = s == p.steps - 1 ? gs + i0 : gbuf[s];
          const T* a = r[st.a];
          if (st.select) {  // where's vjp: the cotangent where the branch was taken, else 0
            const T* m = r[st.m];
            for (int which = 0; which < 2; ++which) {
              if (!(which == 0 ? st.grad_a : st.grad_b)) continue;
              const int reg = which == 0 ? st.a : st.b;
              T* out = target<T>(p, reg, gbuf, dest, c, i0);
              const bool acc = reg < p.inputs && dest[c - 1].acc;
              for (std::int64_t j = 0; j < len; ++j) detail::put(out, j, (m[j] != T(0)) == (which == 0) ? go[j] : T(0), acc);
            }
            continue;
          }
          if (!st.binary) {
            if (!st.grad_a) continue;
            const T* yv = r[p.inputs + s];
            const T arg = static_cast<T>(st.arg);
            T* out = target<T>(p, st.a, gbuf, dest, c, i0);
            const bool acc = st.a < p.inputs && dest[c - 1].acc;
            detail::dispatch_unary(static_cast<Unary>(st.op), [&]<Unary Op>() {
              for (std::int64_t j = 0; j < len; ++j) detail::put(out, j, go[j] * detail::unary_df(Op, a[j], yv[j], arg), acc);
            });
            continue;
          }
          const T* b = r[st.b];
          detail::dispatch_binary(static_cast<Binary>(st.op), [&]<Binary Op>() {
            for (int which = 0; which < 2; ++which) {
              if (!(which == 0 ? st.grad_a : st.grad_b)) continue;
              const int reg = which == 0 ? st.a : st.b;
              T* out = target<T>(p, reg, gbuf, dest, c, i0);
              const bool acc = reg < p.inputs && dest[c - 1].acc;
              for (std::int64_t j = 0; j < len; ++j) detail::put(out, j, go[j] * detail::binary_df(Op, which, a[j], b[j]), acc);
            }
          });
        }
      });
    });
  }

 private:
  // Where a gradient for register `reg` goes: an intermediate's gradient buffer (written once:
  // a fused intermediate has one consumer), or an input's next destination (at element i0).
  template <class T>
  static T* target(const FusedProgram& p, int reg, T (*gbuf)[kTile], std::span<const FusedGradDest> dest,
                   std::size_t& c, std::int64_t i0) {
    if (reg >= p.inputs) return gbuf[reg - p.inputs];
    return static_cast<T*>(dest[c++].g->raw()) + i0;
  }

  static bool needs(std::uint32_t mask, int reg) { return (mask >> reg) & 1u; }

  // Steps 0..count-1 of the tile into their buffers (register inputs + s points at its buffer);
  // a step outside `mask` is not computed (its register points at `skip`).
  template <class T>
  static void run_steps(const FusedProgram& p, const T** r, T (*buf)[kTile], int count, std::int64_t len,
                        std::uint32_t mask = ~0u, const T* skip = nullptr) {
    for (int s = 0; s < count; ++s) {
      if (!needs(mask, p.inputs + s)) {
        r[p.inputs + s] = skip;
        continue;
      }
      T* y = buf[p.inputs + s];
      run_step<T>(p, s, r, y, len);
      r[p.inputs + s] = y;
    }
  }
  // One step over len elements into y; the op a compile-time constant, so the loop vectorises
  // as the unfused kernel's does.
  template <class T>
  static void run_step(const FusedProgram& p, int s, const T* const* r, T* y, std::int64_t len) {
    const FusedStep& st = p.step[static_cast<std::size_t>(s)];
    const T* a = r[st.a];
    if (st.select) {
      const T *b = r[st.b], *m = r[st.m];
      for (std::int64_t j = 0; j < len; ++j) y[j] = m[j] != T(0) ? a[j] : b[j];
      return;
    }
    if (!st.binary) {
      const T arg = static_cast<T>(st.arg);
      detail::dispatch_unary(static_cast<Unary>(st.op), [&]<Unary Op>() {
        for (std::int64_t j = 0; j < len; ++j) y[j] = detail::unary_f(Op, a[j], arg);
      });
      return;
    }
    const T* b = r[st.b];
    detail::dispatch_binary(static_cast<Binary>(st.op), [&]<Binary Op>() {
      for (std::int64_t j = 0; j < len; ++j) y[j] = detail::binary_f(Op, a[j], b[j]);
    });
  }

  // How each input is read at output element i: at i (its shape is the output's), at 0 (one
  // element), at i mod its size (a trailing suffix of the output's shape: a bias), or through
  // broadcast strides (any other broadcast).
  struct Readers {
    enum class Mode : std::uint8_t { same, scalar, suffix, strided };
    struct In {
      const void* data = nullptr;
      DType dt = DType::f32;  // another than the group's: a where's mask, loaded as 0 / 1
      Mode mode = Mode::same;
      std::int64_t size = 0;
      std::array<std::int64_t, kMaxRank> st{};
    };
    std::array<In, kMaxFusedInputs> in{};
    int count = 0;
    Shape out;

    Readers(const FusedProgram& p, std::span<const Tensor* const> ins, const Shape& o) : count(p.inputs), out(o) {
      for (int k = 0; k < count; ++k) {
        const Tensor& x = *ins[static_cast<std::size_t>(k)];
        In& r = in[static_cast<std::size_t>(k)];
        r.data = x.raw();
        r.dt = x.dtype();
        r.size = x.numel();
        if (x.shape() == o) r.mode = Mode::same;
        else if (x.numel() == 1) r.mode = Mode::scalar;
        else if (detail::is_suffix(x.shape(), o)) r.mode = Mode::suffix;
        else r.mode = Mode::strided, r.st = detail::broadcast_strides(x.shape(), o);
      }
    }
    // Points register k at input k's values for elements i0..i0+len: the input itself where it
    // has the output's shape, else its values gathered into buf[k]; an input outside `mask` at
    // `skip` (it is not read).
    template <class T>
    void load(const T** r, T (*buf)[kTile], std::int64_t i0, std::int64_t len, std::uint32_t mask = ~0u,
              const T* skip = nullptr) const {
      for (int k = 0; k < count; ++k) {
        if (!((mask >> k) & 1u)) {
          r[k] = skip;
          continue;
        }
        const In& x = in[static_cast<std::size_t>(k)];
        const T* s = static_cast<const T*>(x.data);
        T* d = buf[k];
        r[k] = d;
        if (x.dt != detail::dtype_of<T>()) {  // a mask: nonzero -> 1, as where tests it
          for (std::int64_t j = 0; j < len; ++j) {
            const std::int64_t o = x.mode == Mode::same     ? i0 + j
                                   : x.mode == Mode::scalar ? 0
                                   : x.mode == Mode::suffix ? (i0 + j) % x.size
                                                            : offset(x.st, i0 + j);
            d[j] = detail::load_as_double(x.data, x.dt, o) != 0.0 ? T(1) : T(0);
          }
          continue;
        }
        switch (x.mode) {
          case Mode::same: r[k] = s + i0; break;
          case Mode::scalar: std::fill_n(d, len, s[0]); break;
          case Mode::suffix:
            for (std::int64_t j = 0, o = i0 % x.size; j < len; ++j, o = o + 1 == x.size ? 0 : o + 1) d[j] = s[o];
            break;
          case Mode::strided:
            for (std::int64_t j = 0; j < len; ++j) d[j] = s[offset(x.st, i0 + j)];
            break;
        }
      }
    }
    // The input offset of output element i: i unravelled over the output's dims, dotted with
    // the input's broadcast strides (the rare general broadcast; a division per dim).
    std::int64_t offset(const std::array<std::int64_t, kMaxRank>& st, std::int64_t i) const {
      std::int64_t off = 0;
      for (int d = out.rank() - 1; d >= 0; --d) {
        off += (i % out[d]) * st[static_cast<std::size_t>(d)];
        i /= out[d];
      }
      return off;
    }
  };
};
using FusedKernels = FusedKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/fused.hpp ----
// ---- begin nn/backend/cpu/quantized.hpp ----
// nn::cpu's quantized kernels (ops/quantized.hpp): products with a quantized matrix, whose values
// are dequantized panel by panel straight into the GEMM's packed layout (the matrix never exists
// in float), and the row gather of a quantized embedding table.

#include <cstring>


namespace nn {

#if defined(NN_OWN_GEMM)
namespace gemm {

#if defined(NN_QUANT_AVX2) && (defined(__x86_64__) || defined(__i386__))
/// The scales and biases of group g of W's lines j .. j + lines as float32, for the transposed
/// packers below, which walk 8 or 16 lines a depth step at a time: widened once a group into
/// s_/b_, not once a step. float16's widening in software (half::f16_to_f32, branches for the
/// subnormals) once every 8 depths took more than half of the AVX2 packer's time: 0.54 against
/// 0.34 ms a 1536 x 576 matrix (group 32, 4 bits; AMD EPYC family 25 model 1; float32 scales 0.26).
template <DType SDT, int L>
struct LineScales {
  float s_[L], b_[L];
  void load(const detail::QuantReader<float>& rd, index j, int lines, index g) {
    for (int l = 0; l < lines; ++l) {
      const index si = (j + l) * rd.groups_per_row + g;
      s_[l] = detail::scale_f32<SDT>(rd.scales, si);
      b_[l] = detail::scale_f32<SDT>(rd.biases, si);
    }
  }
  float s(int l) const { return s_[l]; }
  float b(int l) const { return b_[l]; }
};

/// float32 scales are read in place (a copy a group cost the AVX2 packer 6%).
template <int L>
struct LineScales<DType::f32, L> {
  const float *sp = nullptr, *bp = nullptr;
  index stride = 0;
  void load(const detail::QuantReader<float>& rd, index j, int, index g) {
    stride = rd.groups_per_row;
    sp = static_cast<const float*>(rd.scales) + j * stride + g;
    bp = static_cast<const float*>(rd.biases) + j * stride + g;
  }
  float s(int l) const { return sp[l * stride]; }
  float b(int l) const { return bp[l * stride]; }
};

/// A panel of op(B) = W^T (x @ W^T) from an affine float32 W, on AVX-512: lines j .. j + n of W
/// (n <= NR; the panel's columns, zero past n) over depths k0 .. k0 + kc (a multiple of 16, whole
/// 16-code steps of a group), 16 lines x 16 depths at a time decoded into registers (codes16, the
/// values round(s * q) + b as everywhere) and transposed there (gemm::transpose16_store): the
/// values never pass through memory before the panel.
template <int NR, int BITS, DType SDT>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_pack_transposed(const detail::QuantReader<float>& rd, index j, index n,
                                                                    index k0, index kc, float* dst) {
  static_assert(NR % 16 == 0);
  LineScales<SDT, 16> sc;  // the lines' scales and biases for group gcur
  for (int l0 = 0; l0 < NR; l0 += 16) {
    const int lines = static_cast<int>(std::clamp<index>(n - l0, 0, 16));
    index gcur = -1;
    for (index k = 0; k < kc; k += 16) {
      if (const index g = (k0 + k) / rd.q.group; g != gcur) {
        gcur = g;
        sc.load(rd, j + l0, lines, g);
      }
      __m512 r[16];
#pragma GCC unroll 16
      for (int l = 0; l < 16; ++l) {
        if (l < lines) {
          const index row = j + l0 + l;
          __m512 p = _mm512_mul_ps(_mm512_set1_ps(sc.s(l)), _mm512_maskz_cvtepi32_ps(detail::kAll16, detail::codes16<BITS>(
                                                                                       rd.codes + row * rd.row_bytes,
                                                                                       static_cast<std::uint64_t>(k0 + k))));
          asm("" : "+v"(p));
          r[l] = _mm512_add_ps(p, _mm512_set1_ps(sc.b(l)));
        } else {
          r[l] = _mm512_setzero_ps();
        }
      }
      transpose16_store(r, 16, dst + k * NR + l0, NR);
    }
  }
}

/// affine_pack_transposed's AVX2 form: 8 lines x 8 depths at a time decoded into ymm registers
/// (codes8) and transposed there (gemm::transpose8_store); k0, kc and the group multiples of 8.
/// Decoding each line into a run and transposing the runs afterwards (the staged path below) wrote
/// and read every value once more: that path's decode and transpose were about 5% of the main
/// job's QLoRA step on AVX2 (perf, AMD EPYC family 25 model 1).
template <int NR, int BITS, DType SDT>
[[gnu::target("avx2")]] inline void affine_pack_transposed_avx2(const detail::QuantReader<float>& rd, index j, index n,
                                                                index k0, index kc, float* dst) {
  static_assert(NR % 8 == 0);
  LineScales<SDT, 8> sc;  // the lines' scales and biases for group gcur
  for (int l0 = 0; l0 < NR; l0 += 8) {
    const int lines = static_cast<int>(std::clamp<index>(n - l0, 0, 8));
    index gcur = -1;
    for (index k = 0; k < kc; k += 8) {
      if (const index g = (k0 + k) / rd.q.group; g != gcur) {
        gcur = g;
        sc.load(rd, j + l0, lines, g);
      }
      __m256 r[8];
#pragma GCC unroll 8
      for (int l = 0; l < 8; ++l) {
        if (l < lines) {
          const index row = j + l0 + l;
          __m256 p = _mm256_mul_ps(_mm256_set1_ps(sc.s(l)), _mm256_cvtepi32_ps(detail::codes8<BITS>(
                                                              rd.codes + row * rd.row_bytes, static_cast<std::uint64_t>(k0 + k))));
          asm("" : "+x"(p));  // round(s * q) + b: the product kept out of an FMA
          r[l] = _mm256_add_ps(p, _mm256_set1_ps(sc.b(l)));
        } else {
          r[l] = _mm256_setzero_ps();
        }
      }
      transpose8_store(r, 8, dst + k * NR + l0, NR);
    }
  }
}

/// The panels of op(B) = W (x @ W, dX = dY @ W in QLoRA's backward) from an affine float32 W on
/// AVX2: depth k of every panel is a run of row k0 + k over columns c0 .. c0 + n, decoded 8 codes
/// at a time straight into the panels (c0 and the group multiples of 8; a last part of 8
/// one code at a time; columns past n zero). Decoding the whole run first and copying it into the
/// panels stored and loaded every value once more.
template <int NR, int BITS, DType SDT>
[[gnu::target("avx2")]] inline void affine_pack_rows_avx2(const detail::QuantReader<float>& rd, index c0, index n,
                                                          index k0, index kc, float* dst) {
  static_assert(NR % 8 == 0);
  const index n8 = n / 8 * 8, padded = (n + NR - 1) / NR * NR, G = rd.q.group;
  // column c of depth k lands at panel c / NR, row k, lane c % NR
  const auto at = [&](index k, index c) { return dst + (c / NR) * NR * kc + k * NR + c % NR; };
  for (index k = 0; k < kc; ++k) {
    const index row = k0 + k, sbase = row * rd.groups_per_row;
    const std::uint8_t* codes = rd.codes + row * rd.row_bytes;
    index g = c0 / G, gend = (g + 1) * G - c0;  // the group's end, as a column of this block
    float s = detail::scale_f32<SDT>(rd.scales, sbase + g), b = detail::scale_f32<SDT>(rd.biases, sbase + g);
    const auto next_group = [&] {
      ++g;
      gend += G;
      s = detail::scale_f32<SDT>(rd.scales, sbase + g), b = detail::scale_f32<SDT>(rd.biases, sbase + g);
    };
    index c = 0;
    for (; c < n8; c += 8) {
      if (c >= gend) next_group();
      __m256 p = _mm256_mul_ps(_mm256_set1_ps(s),
                               _mm256_cvtepi32_ps(detail::codes8<BITS>(codes, static_cast<std::uint64_t>(c0 + c))));
      asm("" : "+x"(p));  // round(s * q) + b: the product kept out of an FMA
      _mm256_storeu_ps(at(k, c), _mm256_add_ps(p, _mm256_set1_ps(b)));
    }
    for (; c < n; ++c) {
      if (c >= gend) next_group();
      *at(k, c) = detail::affine_value<BITS>(codes, rd.row_bytes, s, b, c0 + c);
    }
    for (; c < padded; ++c) *at(k, c) = 0.0f;
  }
}
#endif

/// The B packer (DensePackB's contract) of a quantized matrix W read through `rd`: op(B)(k, j) =
/// W[j0 + j][k] when trans (x @ W^T, a Linear's weight: each panel column is a run of one row of
/// W), else W[k][j0 + j] (each panel depth is a run of one row). Zero past the edge.
template <int NR, class T>
struct QuantPackB {
  const detail::QuantReader<T>* rd;
  bool trans;
  index j_off = 0;  // the first column of op(B) this product sees (a column split's share)
  void operator()(T* dst, index j0, index nc, index k0, index kc) const {
    // trans: the panel's columns are rows of W. Decoding each row into a contiguous run and then
    // transposing the runs (pack_panel: 16 x 16 in registers) beats writing the decoded values
    // NR apart, and lets the decoder run eight codes at a time.
    alignas(64) static thread_local unsigned char rows_buf[49152];
#if defined(NN_QUANT_AVX2) && (defined(__x86_64__) || defined(__i386__))
    if constexpr (std::is_same_v<T, float>) {
      if (!trans && (j_off + j0) % 8 == 0 && rd->q.mode == QuantMode::affine && rd->q.group % 8 == 0 &&
          detail::quant_avx2() && !detail::quant_avx512()) {
        detail::with_code_bits(rd->q.bits, [&]<int BITS>() {
          detail::with_scale_dtype(rd->sdt,
                                   [&]<DType SDT>() { affine_pack_rows_avx2<NR, BITS, SDT>(*rd, j_off + j0, nc, k0, kc, dst); });
        });
        return;
      }
    }
#endif
    if (!trans && sizeof(T) * static_cast<std::size_t>(nc) <= sizeof(rows_buf)) {
      // each depth is a run of one row of W over the block's columns: decoded in one call (one
      // dispatch, whole vectors), then cut into the NR-wide panels
      T* run = reinterpret_cast<T*>(rows_buf);
      for (index k = 0; k < kc; ++k) {
        rd->run(k0 + k, j_off + j0, nc, run, 1);
        for (index q = 0; q < nc; q += NR) {
          const index cols = std::min<index>(NR, nc - q);
          T* to = dst + q * kc + k * NR;  // panel q / NR starts q * kc values in
          if (cols == NR) {  // a fixed size the compiler inlines (a libc memmove call per 64 bytes
            std::memcpy(to, run + q, sizeof(T) * NR);  // was 1.2% of the main job's QLoRA step)
            continue;
          }
          std::copy_n(run + q, cols, to);
          std::fill(to + cols, to + NR, T(0));
        }
      }
      return;
    }
#if defined(NN_QUANT_AVX2) && (defined(__x86_64__) || defined(__i386__))
    if constexpr (std::is_same_v<T, float> && NR % 16 == 0) {
      if (trans && kc % 16 == 0 && rd->q.mode == QuantMode::affine && rd->q.group % 16 == 0 && detail::quant_avx512()) {
        detail::with_code_bits(rd->q.bits, [&]<int BITS>() {
          detail::with_scale_dtype(rd->sdt, [&]<DType SDT>() {
            for (index q = 0; q < nc; q += NR)
              affine_pack_transposed<NR, BITS, SDT>(*rd, j_off + j0 + q, std::min<index>(NR, nc - q), k0, kc,
                                                    dst + q * kc);
          });
        });
        return;
      }
      if (trans && k0 % 8 == 0 && kc % 8 == 0 && rd->q.mode == QuantMode::affine && rd->q.group % 8 == 0 &&
          detail::quant_avx2()) {
        detail::with_code_bits(rd->q.bits, [&]<int BITS>() {
          detail::with_scale_dtype(rd->sdt, [&]<DType SDT>() {
            for (index q = 0; q < nc; q += NR)
              affine_pack_transposed_avx2<NR, BITS, SDT>(*rd, j_off + j0 + q, std::min<index>(NR, nc - q), k0, kc,
                                                         dst + q * kc);
          });
        });
        return;
      }
    }
#endif
    const bool staged = trans && sizeof(T) * static_cast<std::size_t>(NR * kc) <= sizeof(rows_buf);
    for (index q = 0; q < nc; q += NR, dst += kc * NR) {
      const index cols = std::min<index>(NR, nc - q), j = j_off + j0 + q;
      if (staged) {
        T* rows = reinterpret_cast<T*>(rows_buf);
        for (index l = 0; l < cols; ++l) rd->run(j + l, k0, kc, rows + l * kc, 1);
        pack_panel<NR>(static_cast<const T*>(rows), kc, false, cols, kc, dst);
        continue;
      }
      if (trans)
        for (index l = 0; l < cols; ++l) rd->run(j + l, k0, kc, dst + l, NR);
      else
        for (index k = 0; k < kc; ++k) rd->run(k0 + k, j, cols, dst + k * NR, 1);
      if (cols < NR)
        for (index k = 0; k < kc; ++k) std::fill(dst + k * NR + cols, dst + (k + 1) * NR, T(0));
    }
  }
};

}  // namespace gemm
#endif

namespace detail {

/// sum_k a[k] * b[k] in T over two 32-byte vectors of partial sums (a fixed order: the compiler
/// may not reassociate a plain loop's reduction to vectorise it).
template <class T>
[[gnu::always_inline]] inline T dot_lanes(const T* a, const T* b, std::int64_t n) {
  typedef T V __attribute__((vector_size(32)));
  constexpr std::int64_t L = 32 / sizeof(T);
  V s0 = {}, s1 = {};
  std::int64_t k = 0;
  for (; k + 2 * L <= n; k += 2 * L) {
    V a0, a1, b0, b1;
    __builtin_memcpy(&a0, a + k, sizeof(V));
    __builtin_memcpy(&a1, a + k + L, sizeof(V));
    __builtin_memcpy(&b0, b + k, sizeof(V));
    __builtin_memcpy(&b1, b + k + L, sizeof(V));
    s0 += a0 * b0;
    s1 += a1 * b1;
  }
  s0 += s1;
  T t = 0;
  for (std::int64_t l = 0; l < L; ++l) t += s0[l];
  for (; k < n; ++k) t += a[k] * b[k];
  return t;
}
#if defined(NN_QUANT_AVX2)
[[gnu::target("avx2,fma")]] inline float dot_lanes_avx2(const float* a, const float* b, std::int64_t n) {
  return dot_lanes(a, b, n);
}
[[gnu::target("avx2,fma")]] inline void axpy_avx2(float* y, float a, const float* x, std::int64_t n) {
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}
#endif
template <class T>
inline T dot_fast(const T* a, const T* b, std::int64_t n) {
#if defined(NN_QUANT_AVX2)
  if constexpr (std::is_same_v<T, float>)
    if (quant_avx2()) return dot_lanes_avx2(a, b, n);
#endif
  return dot_lanes(a, b, n);
}
template <class T>
inline void axpy_fast(T* y, T a, const T* x, std::int64_t n) {
#if defined(NN_QUANT_AVX2)
  if constexpr (std::is_same_v<T, float>)
    if (quant_avx2()) return axpy_avx2(y, a, x, n);
#endif
  for (std::int64_t i = 0; i < n; ++i) y[i] += a * x[i];
}

#if defined(NN_QUANT_AVX2)
/// y[m, j] (+)= x[m] . W[j] for j in [n0, n1) (x @ W^T), M <= 4 rows of float32 x (M, K) and an
/// affine W of any width whose groups are multiples of 8 codes. No value of W is formed: each
/// row's codes are turned float and multiplied into every row of x as they are, and each group's
/// scale and bias enter once,
///   x . W[j] = sum_g s_g * (sum_{k in g} q_k x_k) + b_g * (sum_{k in g} x_k),
/// with xsum (M, groups) the sums of x per group. Dequantize-then-dot rounded in another order
/// (tests/quant/quant.test.cpp holds it to float64 and to MLX). U sums per row of x run side by
/// side so that one row (a decode step) is not bound by the FMA's latency.
template <int M, int BITS>
[[gnu::target("avx2,fma")]] inline void affine_dot_rows(const QuantReader<float>& rd, const float* X, const float* xsum,
                                                        float* Y, std::int64_t N, std::int64_t K, std::int64_t n0,
                                                        std::int64_t n1, bool acc) {
  constexpr int U = M == 1 ? 4 : M == 2 ? 2 : 1;
  const std::int64_t G = rd.q.group, groups = K / G;
  for (std::int64_t j = n0; j < n1; ++j) {
    const std::uint8_t* row = rd.codes + j * rd.row_bytes;
    __m256 tot[M];
    float bias[M];
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) tot[m] = _mm256_setzero_ps(), bias[m] = 0.0f;
    for (std::int64_t g = 0; g < groups; ++g) {
      __m256 a[M][U];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) a[m][u] = _mm256_setzero_ps();
      std::int64_t c = g * G;
      const std::int64_t e = c + G;
      for (; c + 8 * U <= e; c += 8 * U)
#pragma GCC unroll 4
        for (int u = 0; u < U; ++u) {
          const __m256 qv = _mm256_cvtepi32_ps(codes8<BITS>(row, static_cast<std::uint64_t>(c + 8 * u)));
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) a[m][u] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(X + m * K + c + 8 * u), a[m][u]);
        }
      for (; c < e; c += 8) {
        const __m256 qv = _mm256_cvtepi32_ps(codes8<BITS>(row, static_cast<std::uint64_t>(c)));
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) a[m][0] = _mm256_fmadd_ps(qv, _mm256_loadu_ps(X + m * K + c), a[m][0]);
      }
      const std::int64_t si = j * rd.groups_per_row + g;
      const __m256 sv = _mm256_set1_ps(widen_scale<float>(rd.scales, rd.sdt, si));
      const float b = widen_scale<float>(rd.biases, rd.sdt, si);
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) {
        __m256 sum = a[m][0];
#pragma GCC unroll 4
        for (int u = 1; u < U; ++u) sum = _mm256_add_ps(sum, a[m][u]);
        tot[m] = _mm256_fmadd_ps(sv, sum, tot[m]);
        bias[m] += b * xsum[m * groups + g];
      }
    }
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      alignas(32) float l[8];
      _mm256_store_ps(l, tot[m]);
      const float v = (((l[0] + l[4]) + (l[1] + l[5])) + ((l[2] + l[6]) + (l[3] + l[7]))) + bias[m];
      Y[m * N + j] = acc ? Y[m * N + j] + v : v;
    }
  }
}

/// The sums of the 16 lanes of a, b, c and d, in that order (one tree of adds, the same for all).
// (both halves by masked extracts: GCC 12's _mm512_castps512_ps256 passes an undefined operand; see kAll16)
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline __m256 hsum_half(__m512 x) {
  return _mm256_add_ps(_mm512_maskz_extractf32x8_ps(0xff, x, 0), _mm512_maskz_extractf32x8_ps(0xff, x, 1));
}
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline __m128 hsum4(__m512 a, __m512 b, __m512 c, __m512 d) {
  const __m256 ab = _mm256_hadd_ps(hsum_half(a), hsum_half(b)), cd = _mm256_hadd_ps(hsum_half(c), hsum_half(d));
  // ab: [a01 a23 b01 b23 | a45 a67 b45 b67]
  const __m256 abcd = _mm256_hadd_ps(ab, cd);  // [a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567]
  return _mm_add_ps(_mm256_castps256_ps128(abcd), _mm256_extractf128_ps(abcd, 1));
}

/// out[0, n) = scales (or biases) i0 .. i0 + n of storage type t as float32, 16 at a time.
[[gnu::target(NN_QUANT_AVX512)]] inline void widen_scales(const void* p, DType t, std::int64_t i0, std::int64_t n,
                                                         float* out) {
  std::int64_t i = 0;
  if (t == DType::f16 || t == DType::bf16) {
    const auto* h = static_cast<const std::uint16_t*>(p) + i0;
    for (; i < n; i += 16) {
      const __mmask16 m = n - i >= 16 ? kAll16 : static_cast<__mmask16>((1u << (n - i)) - 1);
      const __m256i v = _mm256_maskz_loadu_epi16(m, h + i);
      const __m512 f = t == DType::f16 ? _mm512_maskz_cvtph_ps(kAll16, v)
                                       : _mm512_castsi512_ps(_mm512_maskz_slli_epi32(kAll16, _mm512_maskz_cvtepu16_epi32(kAll16, v), 16));
      _mm512_mask_storeu_ps(out + i, m, f);
    }
  } else if (t == DType::f32) {
    std::memcpy(out, static_cast<const float*>(p) + i0, static_cast<std::size_t>(n) * sizeof(float));
  } else {
    for (; i < n; ++i) out[i] = widen_scale<float>(p, t, i0 + i);
  }
}

/// Scales per row a block of the few-row dots keeps as float32: groups of 16 codes or more, K <= 8192.
inline constexpr std::int64_t kDotGroups = 8192 / 16 + 16;

/// Asks for rows [r0, r1) of W's codes, scales and biases to be brought into L2; the float few-row
/// dot asks for the rows about 8 KB ahead of each block it starts. It reads J rows side by side
/// with many instructions a byte, and the hardware's prefetch alone often fell behind: the
/// 49152 x 576 head at 8 bits, 1 token, took 4.7-5.1 ms in most runs (2.2 in some) against
/// 1.8-1.9 ms with this, in every run; 4 bits unchanged (bench_quantized_matmul 1 15 8 32, Xeon
/// model 167). The int8 kernel, with a quarter of the instructions, kept up without it (and ran
/// 10% slower with it). An asm statement: GCC deletes a loop of __builtin_prefetch calls (a loop
/// without side effects).
inline void prefetch_rows(const QuantReader<float>& rd, std::int64_t r0, std::int64_t r1) {
  const auto ahead = [](const void* base, std::int64_t from, std::int64_t to) {
    const char* p = static_cast<const char*>(base);
    for (std::int64_t o = from; o < to; o += 64) asm volatile("prefetcht1 %0" : : "m"(p[o]));
  };
  ahead(rd.codes, r0 * rd.row_bytes, r1 * rd.row_bytes);
  const std::int64_t sb = static_cast<std::int64_t>(dtype_size(rd.sdt));
  ahead(rd.scales, r0 * rd.groups_per_row * sb, r1 * rd.groups_per_row * sb);
  if (rd.biases) ahead(rd.biases, r0 * rd.groups_per_row * sb, r1 * rd.groups_per_row * sb);
}

/// How many rows ahead of a block of J the few-row dots prefetch: whole blocks, about 8 KB of codes.
inline std::int64_t prefetch_ahead(const QuantReader<float>& rd, std::int64_t J) {
  return J * ((8192 + J * rd.row_bytes - 1) / (J * rd.row_bytes));
}

/// The start of a block of J rows of W (j .. j + J) in the few-row dots: sp[u] points at row
/// j + u's scales as float32 (read in place, or widened into sf[u]), and tot[u][m] starts as the
/// bias term, sum_g b_g xsum[m, g], spread over 16 lanes (the rest of the dot joins those lanes;
/// xsum: x's sums per group, (M, groups)).
template <int M, int J>
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline void dot_rows_begin(
    const QuantReader<float>& rd, std::int64_t j, std::int64_t groups, const float* xsum, float (*sf)[kDotGroups],
    float* bf, const float* (&sp)[J], __m512 (&tot)[J][M]) {
  const bool f32 = rd.sdt == DType::f32;
#pragma GCC unroll 4
  for (int u = 0; u < J; ++u) {
    const std::int64_t s0 = (j + u) * rd.groups_per_row;
    const float* bp = bf;
    if (f32) {
      sp[u] = static_cast<const float*>(rd.scales) + s0, bp = static_cast<const float*>(rd.biases) + s0;
    } else {
      widen_scales(rd.scales, rd.sdt, s0, groups, sf[u]), widen_scales(rd.biases, rd.sdt, s0, groups, bf);
      sp[u] = sf[u];
    }
    for (int m = 0; m < M; ++m) tot[u][m] = _mm512_setzero_ps();
    for (std::int64_t g = 0; g < groups; g += 16) {
      const __mmask16 gm = groups - g >= 16 ? kAll16 : static_cast<__mmask16>((1u << (groups - g)) - 1);
      const __m512 bv = _mm512_maskz_loadu_ps(gm, bp + g);
      for (int m = 0; m < M; ++m) tot[u][m] = _mm512_fmadd_ps(bv, _mm512_maskz_loadu_ps(gm, xsum + m * groups + g), tot[u][m]);
    }
  }
}

/// The end of that block: each tot[u][m]'s lanes summed (four accumulators at once, one fixed
/// order) into y[m, j + u], added to it when acc.
template <int M, int J>
[[gnu::target(NN_QUANT_AVX512), gnu::always_inline]] inline void dot_rows_end(__m512 (&tot)[J][M], float* Y,
                                                                              std::int64_t N, std::int64_t j, bool acc) {
  constexpr int A = J * M;
  alignas(16) float v[A + 3];
#pragma GCC unroll 4
  for (int i = 0; i + 4 <= A; i += 4)
    _mm_store_ps(v + i, hsum4(tot[i / M][i % M], tot[(i + 1) / M][(i + 1) % M], tot[(i + 2) / M][(i + 2) % M],
                              tot[(i + 3) / M][(i + 3) % M]));
  for (int i = A / 4 * 4; i < A; ++i) {
    const __m512 t = tot[i / M][i % M];
    _mm_store_ss(v + i, hsum4(t, t, t, t));
  }
#pragma GCC unroll 4
  for (int u = 0; u < J; ++u)
#pragma GCC unroll 4
    for (int m = 0; m < M; ++m) {
      float& y = Y[m * N + j + u];
      y = acc ? y + v[u * M + m] : v[u * M + m];
    }
}

/// affine_dot_rows on AVX-512: the same factored sums, 16 codes a vector, and J columns of y at
/// once (each load of x serves J rows of W; J * M chains hide the FMA's latency). 4-bit codes go
/// 32 a step without being put in order: a 16-byte load widened to 16 lanes holds codes 2i in its
/// low nibbles and 2i + 1 in its high ones, so x is read as XP, each 32 values of x reordered
/// once per call into their even then odd positions (a group of 4-bit codes is a multiple of 32).
template <int M, int J, int BITS>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_dot_rows512(const QuantReader<float>& rd, const float* XP,
                                                                const float* xsum, float* Y, std::int64_t N,
                                                                std::int64_t K, std::int64_t n0, std::int64_t n1,
                                                                bool acc) {
  constexpr std::int64_t step = BITS == 4 ? 32 : 16;
  const std::int64_t G = rd.q.group, groups = K / G;
  alignas(64) float sf[J][kDotGroups], bf[kDotGroups];  // scales and biases as float32, where stored narrower
  const std::int64_t ahead = prefetch_ahead(rd, J);
  for (std::int64_t j = n0; j + J <= n1; j += J) {
    __m512 tot[J][M];
    const float* sp[J];
    if (j + ahead < n1) prefetch_rows(rd, j + ahead, std::min(n1, j + ahead + J));
    dot_rows_begin<M, J>(rd, j, groups, xsum, sf, bf, sp, tot);
    for (std::int64_t g = 0; g < groups; ++g) {
      __m512 a[J][M];
#pragma GCC unroll 4
      for (int u = 0; u < J; ++u)
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) a[u][m] = _mm512_setzero_ps();
      for (std::int64_t c = g * G; c < (g + 1) * G; c += step) {
        if constexpr (BITS == 4) {
          __m512 x0[M], x1[M];
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) x0[m] = _mm512_loadu_ps(XP + m * K + c), x1[m] = _mm512_loadu_ps(XP + m * K + c + 16);
#pragma GCC unroll 4
          for (int u = 0; u < J; ++u) {
            const __m512i b = _mm512_maskz_cvtepu8_epi32(
                kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(rd.codes + (j + u) * rd.row_bytes + c / 2)));
            const __m512 lo = _mm512_maskz_cvtepi32_ps(kAll16, _mm512_and_si512(b, _mm512_set1_epi32(15)));
            const __m512 hi = _mm512_maskz_cvtepi32_ps(kAll16, _mm512_maskz_srli_epi32(kAll16, b, 4));
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) a[u][m] = _mm512_fmadd_ps(hi, x1[m], _mm512_fmadd_ps(lo, x0[m], a[u][m]));
          }
        } else {
          __m512 x0[M];
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) x0[m] = _mm512_loadu_ps(XP + m * K + c);
#pragma GCC unroll 4
          for (int u = 0; u < J; ++u) {
            const __m512 qv =
                _mm512_maskz_cvtepi32_ps(kAll16, codes16<BITS>(rd.codes + (j + u) * rd.row_bytes, static_cast<std::uint64_t>(c)));
#pragma GCC unroll 4
            for (int m = 0; m < M; ++m) a[u][m] = _mm512_fmadd_ps(qv, x0[m], a[u][m]);
          }
        }
      }
#pragma GCC unroll 4
      for (int u = 0; u < J; ++u) {
        const __m512 sv = _mm512_set1_ps(sp[u][g]);
#pragma GCC unroll 4
        for (int m = 0; m < M; ++m) tot[u][m] = _mm512_fmadd_ps(sv, a[u][m], tot[u][m]);
      }
    }
    dot_rows_end<M, J>(tot, Y, N, j, acc);
  }
}

/// Whether affine_dot_rows512 serves rd: an affine matrix on a CPU that runs the AVX-512 decoder,
/// its groups whole steps of the kernel.
template <class T>
inline bool affine_dot_rows512_applies(const QuantReader<T>& rd) {
  return std::is_same_v<T, float> && rd.q.mode == QuantMode::affine && quant_avx512() &&
         rd.q.group % (rd.q.bits == 4 ? 32 : 16) == 0;
}

/// Whether affine_dot_rows_int8 serves rd (set_int8_activations): on, an affine 4- or 8-bit
/// matrix whose group is a power of two of 32 or more (a 64-byte chunk of codes then holds whole
/// groups or lies inside one), on a CPU with AVX512-VNNI.
template <class T>
inline bool affine_dot_int8_applies(const QuantReader<T>& rd) {
  const std::int64_t G = rd.q.group;
  return std::is_same_v<T, float> && int8_activations() && rd.q.mode == QuantMode::affine &&
         (rd.q.bits == 4 || rd.q.bits == 8) && G >= 32 && (G & (G - 1)) == 0 && quant_vnni();
}

/// x rounded to int8 for affine_dot_rows_int8, M rows of K (K a multiple of 32) in blocks of 32
/// values: d = max|x| / 127, q = nearbyint(x * (127 / max|x|)), q = 0 and d = 0 for a block of
/// zeros (set_int8_activations). Laid out as the kernel reads: byte i of a row of 4-bit codes
/// holds codes 2i and 2i + 1, so XQ holds x's even positions (K / 2 bytes) then its odd ones; for
/// 8-bit codes x in order. DL: d per int32 lane of a 64-byte chunk of codes (one lane: 4 bytes of
/// codes, 8 (4-bit) or 4 (8-bit) depths, all in one block). Rows padded with zeros to whole
/// chunks (XQ: stride xs bytes; DL: stride ds floats).
struct Int8Rows {
  static constexpr std::int64_t kMaxK = 8192;
  alignas(64) std::int8_t xq[4 * (kMaxK + 64)];
  alignas(64) float dl[4 * (kMaxK / 4 + 16)];
  std::int64_t xs = 0, ds = 0;

  void set(const float* X, std::int64_t M, std::int64_t K, int bits) {
    const std::int64_t bytes = K * bits / 8, chunks = (bytes + 63) / 64;
    xs = bits == 4 ? 2 * chunks * 64 : chunks * 64;  // 4 bits: even then odd positions, each padded
    ds = chunks * 16;
    std::fill_n(xq, M * xs, std::int8_t{0});
    std::fill_n(dl, M * ds, 0.0f);
    for (std::int64_t m = 0; m < M; ++m) {
      const float* x = X + m * K;
      std::int8_t* q = xq + m * xs;
      for (std::int64_t b = 0; b < K / 32; ++b) {
        float amax = 0.0f;
        for (int i = 0; i < 32; ++i) amax = std::max(amax, std::fabs(x[32 * b + i]));
        const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
        for (int i = 0; i < 32; ++i) {
          const std::int64_t k = 32 * b + i;
          const auto v = static_cast<std::int8_t>(std::nearbyint(x[k] * id));
          if (bits == 4) q[(k % 2) * chunks * 64 + k / 2] = v;
          else q[k] = v;
        }
        const std::int64_t lanes = bits == 4 ? 4 : 8;  // int32 lanes a 32-block covers
        std::fill_n(dl + m * ds + b * lanes, lanes, amax / 127.0f);
      }
    }
  }
};

/// y[m, j] (+)= x[m] . W[j] for j in [n0, n1) (x @ W^T), M <= 4 rows, with x as int8 (Int8Rows)
/// and W's codes multiplied in int32 by vpdpbusd (u8 codes x s8 x): per 64-byte chunk of a row of
/// W (128 4-bit or 64 8-bit codes), each int32 lane sums 8 or 4 products of one 32-block (exact,
/// far below 2^24), is turned float and scaled by s * d of its block into a float accumulator;
/// xsum[m * groups + g]: sum_k x[m, k] over group g in float32, which the biases multiply
/// (sum_g b_g xsum_g, 16 groups a vector into the same accumulator). J rows of W share each
/// load of x.
template <int M, int J, int BITS>
[[gnu::target(NN_QUANT_AVX512 ",avx512vnni")]] inline void affine_dot_rows_int8(const QuantReader<float>& rd,
                                                                               const Int8Rows& xr, const float* xsum,
                                                                               float* Y, std::int64_t N, std::int64_t K,
                                                                               std::int64_t n0, std::int64_t n1, bool acc) {
  const std::int64_t G = rd.q.group, groups = K / G, bytes = K * BITS / 8, chunks = (bytes + 63) / 64;
  constexpr std::int64_t cpc = 64 * 8 / BITS;  // codes a chunk
  // Lane l of a chunk -> its group, counted from the chunk's first (0 where a group spans chunks).
  alignas(64) std::int32_t gl[16];
  for (int l = 0; l < 16; ++l) gl[l] = G < cpc ? static_cast<std::int32_t>(l * 4 * (8 / BITS) / G) : 0;
  const __m512i gidx = _mm512_load_si512(gl);
  const __m512i nib = _mm512_set1_epi8(0x0f);
  alignas(64) float sf[J][kDotGroups], bf[kDotGroups];  // scales and biases as float32, where stored narrower
  for (std::int64_t j = n0; j + J <= n1; j += J) {
    __m512 tot[J][M];
    const float* sp[J];
    dot_rows_begin<M, J>(rd, j, groups, xsum, sf, bf, sp, tot);
    for (std::int64_t c = 0; c < chunks; ++c) {
      const std::int64_t o = 64 * c, left = bytes - o;
      const __mmask64 bm = left >= 64 ? ~__mmask64{0} : (__mmask64{1} << left) - 1;
      const std::int64_t g0 = o * (8 / BITS) / G;  // the chunk's first group
      const std::int64_t ng = G < cpc ? std::min<std::int64_t>(cpc, left * (8 / BITS)) / G : 1;
      const __mmask16 sm = static_cast<__mmask16>((1u << ng) - 1);
      __m512 dv[M];
#pragma GCC unroll 4
      for (int m = 0; m < M; ++m) dv[m] = _mm512_load_ps(xr.dl + m * xr.ds + 16 * c);
#pragma GCC unroll 4
      for (int u = 0; u < J; ++u) {
        const __m512i v = _mm512_maskz_loadu_epi8(bm, rd.codes + (j + u) * rd.row_bytes + o);
        const __m512 sv = _mm512_maskz_permutexvar_ps(kAll16, gidx, _mm512_maskz_loadu_ps(sm, sp[u] + g0));
        if constexpr (BITS == 4) {
          const __m512i lo = _mm512_and_si512(v, nib), hi = _mm512_and_si512(_mm512_srli_epi16(v, 4), nib);
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const std::int8_t* q = xr.xq + m * xr.xs;
            const __m512i xe = _mm512_load_si512(q + o), xo = _mm512_load_si512(q + chunks * 64 + o);
            const __m512i is = _mm512_dpbusd_epi32(_mm512_dpbusd_epi32(_mm512_setzero_si512(), lo, xe), hi, xo);
            tot[u][m] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, is), _mm512_mul_ps(sv, dv[m]), tot[u][m]);
          }
        } else {
#pragma GCC unroll 4
          for (int m = 0; m < M; ++m) {
            const __m512i is = _mm512_dpbusd_epi32(_mm512_setzero_si512(), v, _mm512_load_si512(xr.xq + m * xr.xs + o));
            tot[u][m] = _mm512_fmadd_ps(_mm512_maskz_cvtepi32_ps(kAll16, is), _mm512_mul_ps(sv, dv[m]), tot[u][m]);
          }
        }
      }
    }
    dot_rows_end<M, J>(tot, Y, N, j, acc);
  }
}

/// The column blocking of the few-row dots on AVX-512 (the float and the int8 kernel): J columns of
/// y at a time while they last (fewer rows of x: more columns, each load of x serving J rows of W),
/// then one at a time. kern.template operator()<MM, J>(from, to) runs MM rows over columns [from, to).
template <class Kern>
inline void dot_row_blocks(std::int64_t M, std::int64_t n0, std::int64_t n1, const Kern& kern) {
  const auto run = [&]<int MM, int J>() {
    const std::int64_t n_j = n0 + (n1 - n0) / J * J;
    kern.template operator()<MM, J>(n0, n_j);
    if constexpr (J > 1) kern.template operator()<MM, 1>(n_j, n1);
  };
  switch (M) {
    case 1: run.template operator()<1, 4>(); break;
    case 2: run.template operator()<2, 2>(); break;
    case 3: run.template operator()<3, 2>(); break;
    default: run.template operator()<4, 2>(); break;
  }
}

/// affine_dot_rows for M = 1..4 rows (1..8 on AVX-512); false where it does not apply (another format or dtype, a
/// CPU without AVX2, a group that is not a multiple of 8 codes, more rows).
template <class T>
inline bool affine_dot_rows_any(const QuantReader<T>& rd, const T* X, T* Y, std::int64_t M, std::int64_t N,
                                std::int64_t K, std::int64_t n0, std::int64_t n1, bool acc) {
  if constexpr (!std::is_same_v<T, float>) {
    return false;
  } else {
    if (rd.q.mode != QuantMode::affine || rd.q.group % 8 != 0 || K > 8192 || !quant_avx2()) return false;
    if (M > (affine_dot_rows512_applies(rd) ? 8 : 4)) return false;
    if (M > 4) {  // 5-8 rows (AVX-512): two passes over W (each still cheaper than packing it for the GEMM)
      affine_dot_rows_any(rd, X, Y, 4, N, K, n0, n1, acc);
      return affine_dot_rows_any(rd, X + 4 * K, Y + 4 * N, M - 4, N, K, n0, n1, acc);
    }
    const std::int64_t groups = K / rd.q.group;
    alignas(64) static thread_local float xsum[4 * 1024];  // K <= 8192 and groups >= 8 codes
    for (std::int64_t m = 0; m < M; ++m)
      for (std::int64_t g = 0; g < groups; ++g) {
        float t = 0.0f;
        for (std::int64_t k = g * rd.q.group; k < (g + 1) * rd.q.group; ++k) t += X[m * K + k];
        xsum[m * groups + g] = t;
      }
    if (affine_dot_int8_applies(rd)) {  // opt-in (set_int8_activations): x rounded to int8
      alignas(64) static thread_local Int8Rows xr;
      xr.set(X, M, K, rd.q.bits);
      const auto rows = [&]<int BITS>() {
        dot_row_blocks(M, n0, n1, [&]<int MM, int J>(std::int64_t a, std::int64_t b) {
          affine_dot_rows_int8<MM, J, BITS>(rd, xr, xsum, Y, N, K, a, b, acc);
        });
      };
      if (rd.q.bits == 4) rows.template operator()<4>();
      else rows.template operator()<8>();
      return true;
    }
    if (affine_dot_rows512_applies(rd)) {
      const float* XP = X;
      if (rd.q.bits == 4) {  // x's 32-value blocks in even-then-odd order (affine_dot_rows512)
        alignas(64) static thread_local float xp[4 * 8192];
        for (std::int64_t i = 0; i < M * K; i += 32)
          for (int l = 0; l < 16; ++l) xp[i + l] = X[i + 2 * l], xp[i + 16 + l] = X[i + 2 * l + 1];
        XP = xp;
      }
      with_code_bits(rd.q.bits, [&]<int BITS>() {
        dot_row_blocks(M, n0, n1, [&]<int MM, int J>(std::int64_t a, std::int64_t b) {
          affine_dot_rows512<MM, J, BITS>(rd, XP, xsum, Y, N, K, a, b, acc);
        });
      });
      return true;
    }
    with_code_bits(rd.q.bits, [&]<int BITS>() {
      switch (M) {
        case 1: affine_dot_rows<1, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
        case 2: affine_dot_rows<2, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
        case 3: affine_dot_rows<3, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
        default: affine_dot_rows<4, BITS>(rd, X, xsum, Y, N, K, n0, n1, acc); break;
      }
    });
    return true;
  }
}

/// Whether affine_axpy_rows512 serves rd (x @ W): an affine float32 matrix on a CPU that runs the
/// AVX-512 decoder, its groups a power of two of 16 codes or more (a vector of y has one scale per
/// depth, and a block of 2^i vectors holds whole groups or lies inside one).
/// Rows: 1-8 for 4- and 8-bit codes (a plain load a vector), 1-2 for the bit-stream widths, whose
/// decode (a masked load, a shuffle and a shift) the buffered loop, decoding each depth once for
/// all rows, beats at 3-8 rows on a 49152-deep matrix (bench_quantized_matmul 1 5 5 32, AMD Zen 4).
template <class T>
inline bool affine_axpy_rows512_applies(const QuantReader<T>& rd, std::int64_t M) {
  const std::int64_t G = rd.q.group;
  return std::is_same_v<T, float> && rd.q.mode == QuantMode::affine && quant_avx512() && G >= 16 && (G & (G - 1)) == 0 &&
         M <= (rd.q.bits == 4 || rd.q.bits == 8 ? 8 : 2);
}

/// x @ W on 1-4 rows, W (K, N) affine, over depths [k0, k1): R vectors of y per row of x stay in
/// registers across those depths; each depth's codes are decoded into registers as the values
/// round(s q) + b that dequantize() gives (bit for bit: the product kept out of an FMA), and every
/// row of x takes them by an FMA -- no buffer written and read back, y not reloaded per depth.
/// (The factored form sum_k (x s) q + sum_k x b, which the dot of x @ W^T uses within a group,
/// would here carry the bias sum across all K depths: its partial sums outgrow y's and float32
/// loses digits, 5e-4 at K = 5000 against the 1e-5 of this form.) sc, bi: the depths' scales and
/// biases as float32, `groups` a depth from group g0. Columns [c0, c1), c0 a multiple of 16 R;
/// SV = min(R, G / 16) vectors share a group. add: y += the sums, else y = them.
template <int M, int R, int SV, int BITS>
[[gnu::target(NN_QUANT_AVX512)]] inline void affine_axpy_rows512(const QuantReader<float>& rd, const float* X,
                                                                 const float* sc, const float* bi, std::int64_t groups,
                                                                 std::int64_t g0, float* Y, std::int64_t N,
                                                                 std::int64_t K, std::int64_t k0, std::int64_t k1,
                                                                 std::int64_t c0, std::int64_t c1, bool add) {
  static_assert(R % SV == 0);
  // 4-bit codes 32 at a time where a group holds 32 or more: 16 bytes widened to 16 lanes hold the
  // even columns in their low nibbles and the odd ones in their high, so a[.][2i] sums the even
  // columns of its 32 and a[.][2i + 1] the odd ones, put back in order once, at the store.
  constexpr bool kPairs = BITS == 4 && SV % 2 == 0;
  for (std::int64_t cb = c0; cb + 16 * R <= c1; cb += 16 * R) {
    __m512 a[M][R];
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) a[m][r] = _mm512_setzero_ps();
    const std::int64_t first = cb / rd.q.group - g0;  // the block's first group; R / SV groups follow
    for (std::int64_t k = k0; k < k1; ++k) {
      const std::uint8_t* row = rd.codes + k * rd.row_bytes;
      const float* sk = sc + (k - k0) * groups + first;
      const float* bk = bi + (k - k0) * groups + first;
      __m512 xk[M];
#pragma GCC unroll 8
      for (int m = 0; m < M; ++m) xk[m] = _mm512_set1_ps(X[m * K + k]);
#pragma GCC unroll 8
      for (int h = 0; h < R / SV; ++h) {
        const __m512 sv = _mm512_set1_ps(sk[h]), bv = _mm512_set1_ps(bk[h]);
#pragma GCC unroll 8
        for (int v = 0; v < SV; ++v) {
          const int r = h * SV + v;
          __m512 q;
          if constexpr (kPairs) {
            const __m512i b = _mm512_maskz_cvtepu8_epi32(
                kAll16, _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + (cb + 16 * (r & ~1)) / 2)));
            q = _mm512_maskz_cvtepi32_ps(kAll16, r % 2 == 0 ? _mm512_and_si512(b, _mm512_set1_epi32(15))
                                                            : _mm512_maskz_srli_epi32(kAll16, b, 4));
          } else {
            q = _mm512_maskz_cvtepi32_ps(kAll16, codes16<BITS>(row, static_cast<std::uint64_t>(cb + 16 * r)));
          }
          __m512 w = _mm512_mul_ps(sv, q);  // round(s q) + b, as dequantize()
          asm("" : "+v"(w));
          w = _mm512_add_ps(w, bv);
#pragma GCC unroll 8
          for (int m = 0; m < M; ++m) a[m][r] = _mm512_fmadd_ps(xk[m], w, a[m][r]);
        }
      }
    }
#pragma GCC unroll 8
    for (int m = 0; m < M; ++m)
#pragma GCC unroll 8
      for (int r = 0; r < R; ++r) {
        float* y = Y + m * N + cb + 16 * r;
        __m512 v = a[m][r];
        if constexpr (kPairs) {  // back from (even, odd) columns to their order
          const __m512i idx = r % 2 == 0 ? _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0)
                                         : _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
          v = r % 2 == 0 ? _mm512_maskz_permutex2var_ps(kAll16, a[m][r], idx, a[m][r + 1])
                         : _mm512_maskz_permutex2var_ps(kAll16, a[m][r - 1], idx, a[m][r]);
        }
        _mm512_storeu_ps(y, add ? _mm512_add_ps(_mm512_loadu_ps(y), v) : v);
      }
  }
}

/// y (M, N) (+)= x (M, K) @ W over columns [c0, c1) (multiples of 16), 1-8 rows, by
/// affine_axpy_rows512. Depths go in chunks whose codes (256 KB) stay in L2 across every column
/// block and both passes of 4 rows (5-8 rows), their scales and biases widened once to float32;
/// each chunk adds to y. Blocks of 128 columns (1-2 rows) or 64 (3-4) while they last, single
/// vectors at the ends.
inline void affine_axpy_rows_any(const QuantReader<float>& rd, const float* X, float* Y, std::int64_t M,
                                 std::int64_t N, std::int64_t K, std::int64_t c0, std::int64_t c1, bool acc) {
  const std::int64_t G = rd.q.group, g0 = c0 / G, groups = (c1 - 1) / G + 1 - g0;
  const std::int64_t KC = std::min(K, std::clamp<std::int64_t>((std::int64_t{256} << 10) / rd.row_bytes, 16, 4096));
  static thread_local std::vector<float> buf;
  buf.resize(static_cast<std::size_t>(2 * KC * groups));
  float* sc = buf.data();       // (KC, groups) scales of the chunk
  float* bi = sc + KC * groups;  // (KC, groups) biases of the chunk
  for (std::int64_t k0 = 0; k0 < K; k0 += KC) {
    const std::int64_t k1 = std::min(K, k0 + KC);
    for (std::int64_t k = k0; k < k1; ++k) {
      widen_scales(rd.scales, rd.sdt, k * rd.groups_per_row + g0, groups, sc + (k - k0) * groups);
      widen_scales(rd.biases, rd.sdt, k * rd.groups_per_row + g0, groups, bi + (k - k0) * groups);
    }
    const bool add = acc || k0 > 0;
    with_code_bits(rd.q.bits, [&]<int BITS>() {
      const auto run = [&]<int MM, int RR>(const float* Xm, float* Ym, std::int64_t from, std::int64_t to) {
        const std::int64_t vpg = G / 16;  // 16-code vectors a group
        const auto kern = [&]<int SV>() {
          affine_axpy_rows512<MM, RR, SV, BITS>(rd, Xm, sc, bi, groups, g0, Ym, N, K, k0, k1, from, to, add);
        };
        if constexpr (RR == 1) {
          kern.template operator()<1>();
        } else {  // SV = min(RR, vpg)
          if (vpg == 1) kern.template operator()<1>();
          else if (vpg == 2 || RR == 2) kern.template operator()<2>();
          else if constexpr (RR >= 4) {
            if (vpg == 4 || RR == 4) kern.template operator()<4>();
            else if constexpr (RR == 8) kern.template operator()<8>();
          }
        }
      };
      const auto rows = [&]<int MM, int RR>(const float* Xm, float* Ym) {
        // blocks of 16 RR columns from a multiple of 16 RR: whole groups, or inside one
        const std::int64_t a = std::min(c1, (c0 + 16 * RR - 1) / (16 * RR) * (16 * RR));
        const std::int64_t b = a + (c1 - a) / (16 * RR) * (16 * RR);
        run.template operator()<MM, 1>(Xm, Ym, c0, a);
        run.template operator()<MM, RR>(Xm, Ym, a, b);
        run.template operator()<MM, 1>(Xm, Ym, b, c1);
      };
      for (std::int64_t m0 = 0; m0 < M; m0 += 4) {
        const float* Xm = X + m0 * K;
        float* Ym = Y + m0 * N;
        switch (std::min<std::int64_t>(4, M - m0)) {
          case 1: rows.template operator()<1, 8>(Xm, Ym); break;
          case 2: rows.template operator()<2, 8>(Xm, Ym); break;
          case 3: rows.template operator()<3, 4>(Xm, Ym); break;
          default: rows.template operator()<4, 4>(Xm, Ym); break;
        }
      }
    });
  }
}
#endif

/// y (M, N) (+)= x (M, K) @ op(W) for few rows of x (a decode step, a short prompt), columns
/// [n0, n1) of y: W is streamed once, a row (x @ W^T: one output column) or a row segment (x @ W:
/// one depth) at a time, decoded into a small buffer that every row of x then reads -- or, for
/// affine float32 on AVX-512, into registers (affine_dot_rows512: x @ W^T, factored within each
/// group; affine_axpy_rows512: x @ W, y held in registers over the depths). No packing, and no
/// padding of x to the micro-kernel's MR rows. False when a row does not fit the buffer (the
/// caller takes the GEMM path).
template <class T>
inline bool quantized_rows(const QuantReader<T>& rd, const T* X, T* Y, std::int64_t M, std::int64_t N, std::int64_t K,
                           std::int64_t n0, std::int64_t n1, bool transpose, bool acc) {
  alignas(64) static thread_local T buf[8192];
  constexpr std::int64_t cap = 8192;
  if (transpose) {
    if (K > cap) return false;
#if defined(NN_QUANT_AVX2)
    if (affine_dot_rows_any(rd, X, Y, M, N, K, n0, n1, acc)) return true;  // affine float32: no values formed
#endif
    for (std::int64_t j = n0; j < n1; ++j) {
      rd.run(j, 0, K, buf, 1);
      for (std::int64_t m = 0; m < M; ++m) {
        const T v = dot_fast(X + m * K, static_cast<const T*>(buf), K);
        Y[m * N + j] = acc ? Y[m * N + j] + v : v;
      }
    }
    return true;
  }
#if defined(NN_QUANT_AVX2)
  if constexpr (std::is_same_v<T, float>) {
    if (affine_axpy_rows512_applies(rd, M)) {  // whole vectors of y in registers; the ragged ends as below
      const std::int64_t a = std::min(n1, (n0 + 15) / 16 * 16), b = std::max(a, n1 / 16 * 16);
      if (a < b) {
        affine_axpy_rows_any(rd, X, Y, M, N, K, a, b, acc);
        if (n0 < a) quantized_rows(rd, X, Y, M, N, K, n0, a, false, acc);  // not affine_axpy's: a - n0 < 16
        if (b < n1) quantized_rows(rd, X, Y, M, N, K, b, n1, false, acc);
        return true;
      }
    }
  }
#endif
  for (std::int64_t c0 = n0; c0 < n1; c0 += cap) {  // a block of y's columns stays in cache over all of K
    const std::int64_t nc = std::min(cap, n1 - c0);
    if (!acc)
      for (std::int64_t m = 0; m < M; ++m) std::fill_n(Y + m * N + c0, nc, T(0));
    for (std::int64_t k = 0; k < K; ++k) {
      rd.run(k, c0, nc, buf, 1);
      for (std::int64_t m = 0; m < M; ++m) axpy_fast(Y + m * N + c0, X[m * K + k], static_cast<const T*>(buf), nc);
    }
  }
  return true;
}

}  // namespace detail

namespace cpu_kernels {

// A class template with one instance, `QuantizedKernels` (why: backend/cpu.hpp).
template <class = void>
struct QuantizedKernelsT {
  /// Up to this many rows of x, products stream W once (detail::quantized_rows) instead of
  /// packing it for the GEMM: x @ W^T computes a dot product per output (up to twice as many
  /// rows where the AVX-512 factored dot serves the matrix), x @ W an axpy per depth, which holds
  /// its advantage longer (bench_quantized_matmul's 1-8 token rows decide it).
  static constexpr std::int64_t kFewRows = 4, kFewRowsAxpy = 8;

  /// y (M, N) (+)= x (M, K) @ op(W): W^T when a.transpose (W (N, K)), else W (K, N); W given
  /// as codes, scales and biases (undefined for mxfp4) in format a.q. T = y's dtype = x's;
  /// scales of another float dtype are widened to T.
  static void quantized_matmul(const Tensor& x, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const QuantMatmulAttrs& a, Tensor& y, bool acc) {
    detail::dispatch_float(y.dtype(), "quantized_matmul", [&]<class T>() {
      const std::int64_t K = x.dim(-1), M = x.numel() / std::max<std::int64_t>(K, 1), N = y.dim(-1);
      quantized_product<T>(detail::QuantReader<T>(wq, scales, biases, a.q), x.data<T>(), y.data<T>(), M, N, K,
                           a.transpose, acc);
    });
  }

  /// The same on raw rows: Y (M, N) (+)= X (M, K) @ op(W), W read through rd (a block of a
  /// matrix's rows: QuantReader::rows_from), X and Y contiguous.
  template <class T>
  static void quantized_product(const detail::QuantReader<T>& rd, const T* X, T* Y, std::int64_t M, std::int64_t N,
                                std::int64_t K, bool transpose, bool acc) {
    if (M == 0 || N == 0) return;
#if defined(NN_OWN_GEMM)
#if defined(NN_QUANT_AVX2)
    const std::int64_t dot_rows = detail::affine_dot_rows512_applies(rd) ? 2 * kFewRows : kFewRows;
#else
    const std::int64_t dot_rows = kFewRows;
#endif
    if (transpose ? M <= dot_rows && K <= 8192 : M <= kFewRowsAxpy) {
      const int threads = gemm::team_threads(M, N, K);
      if (threads > 1)
        gemm::split_columns(threads, N, [&](gemm::index d0, gemm::index d1) {
          detail::quantized_rows(rd, X, Y, M, N, K, d0, d1, transpose, acc);
        });
      else
        detail::quantized_rows(rd, X, Y, M, N, K, 0, N, transpose, acc);
      return;
    }
    gemm::with_isa(gemm::active_isa(), [&]<Isa I>() {
      using S = gemm::Shape<T, I>;
      const auto kern = gemm::micro_kernels<T, I>();
      const gemm::DensePackA<S::MR, T> pa{gemm::Matrix<T>{X, K, false}};
      const int threads = gemm::team_threads(M, N, K);
      if (threads > 1 && M < 24 * threads) {  // few rows: each thread packs its own columns
        gemm::split_columns(threads, N, [&](gemm::index d0, gemm::index d1) {
          gemm::gemm_blocked<T, S>(kern, M, d1 - d0, K, pa, gemm::QuantPackB<S::NR, T>{&rd, transpose, d0}, Y + d0,
                                   N, acc);
        });
        return;
      }
#if defined(_OPENMP)
      if (threads > 1)
        return gemm::gemm_team<T, S>(threads, kern, M, N, K, pa, gemm::QuantPackB<S::NR, T>{&rd, transpose}, Y, N,
                                     acc);
#endif
      gemm::gemm_blocked<T, S>(kern, M, N, K, pa, gemm::QuantPackB<S::NR, T>{&rd, transpose}, Y, N, acc);
    });
#else
    // no packing hook on this compiler: blocks of 128 rows of W dequantized into a workspace
    constexpr std::int64_t R = 128;
    const std::int64_t wrows = transpose ? N : K, wcols = transpose ? K : N;
    T* buf = static_cast<T*>(detail::gemm_workspace(sizeof(T) * static_cast<std::size_t>(R * wcols), 2));
    for (std::int64_t r0 = 0; r0 < wrows; r0 += R) {
      const std::int64_t nr = std::min(R, wrows - r0);
      for (std::int64_t r = 0; r < nr; ++r) rd.run(r0 + r, 0, wcols, buf + r * wcols, 1);
      if (transpose) detail::gemm_serial<T>(false, true, M, nr, K, X, K, buf, K, Y + r0, N, acc);
      else detail::gemm_serial<T>(false, false, M, N, nr, X + r0, K, buf, N, Y, N, acc || r0 > 0);
    }
#endif
  }

  /// y (n, D) = rows ids[0..n) of the quantized table W (V, D), dequantized to y's dtype.
  /// An id outside [0, V) is an nn::Error naming it.
  static void quantized_gather(const Tensor& ids, const Tensor& wq, const Tensor& scales, const Tensor& biases,
                               const Quant& q, Tensor& y) {
    detail::dispatch_float(y.dtype(), "quantized_gather", [&]<class T>() {
      const detail::QuantReader<T> rd(wq, scales, biases, q);
      const std::int64_t n = ids.numel(), D = y.dim(-1), V = wq.dim(0);
      T* Y = y.data<T>();
      for (std::int64_t i = 0; i < n; ++i) {
        const std::int64_t id = ids.dtype() == DType::i32 ? ids.data<std::int32_t>()[i] : ids.data<std::int64_t>()[i];
        if (id < 0 || id >= V)
          detail::fail("quantized_gather", "id ", id, " at position ", i, " is outside the table's ", V, " rows");
        rd.run(id, 0, D, Y + i * D, 1);
      }
    });
  }
};
using QuantizedKernels = QuantizedKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/quantized.hpp ----
// ---- begin nn/backend/cpu/linear_cross_entropy.hpp ----
// nn::cpu's linear_cross_entropy (ops/linear_cross_entropy.hpp): an LM head's product and the
// softmax cross-entropy over its logits in one pass over blocks of the vocabulary, so the (R, V)
// logits are never held. Per block of the head's rows W_blk (nb, C), for the rows that count:
//   S = x W_blk^T                           (R, nb), the block's logits
//   m_r, l_r: the running max and sum of exp(S - m) (flash attention's online softmax)
//   acc_r = acc_r * exp(m_old - m_new) + exp(S_r - m_new) W_blk     (only when the gradient is wanted)
// and at the end
//   lse_r = m_r + log l_r,   loss_r = lse_r - S[r, t_r],
//   dloss_r / dx_r = acc_r / l_r - W[t_r]   (softmax_r @ W minus the target's row).
// The same two products per block as the logits and their gradient would take, and no more.
// A trainable (dense) head's gradient needs the final lse first, so it takes a second pass:
//   D = c_r (exp(S - lse_r) - onehot(t_r)),  gW_blk (+)= D^T x,  gx (+)= D W_blk.

#include <algorithm>
#include <limits>
#include <optional>


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `LinearCrossEntropyKernels` (why: backend/cpu.hpp).
template <class = void>
struct LinearCrossEntropyKernelsT {
  /// Vocabulary rows per block for R rows of x: S (R, block) near 1 MB, so it stays in cache
  /// between its product, the row pass and the second product; at least 256, a multiple of 64.
  static std::int64_t block_rows(std::int64_t R, std::int64_t V) {
    const std::int64_t b = (std::int64_t{1} << 18) / std::max<std::int64_t>(R, 1) / 64 * 64;
    return std::max<std::int64_t>(1, std::min(std::clamp<std::int64_t>(b, 256, 4096), V));
  }
  // The workspace's integer part (a counted row's row of x and its target), rounded to 64 bytes.
  static std::size_t ints_bytes(std::int64_t R) { return (2 * sizeof(std::int64_t) * static_cast<std::size_t>(R) + 63) / 64 * 64; }
  /// Bytes of workspace the kernels need for x (R, C) of dtype dt and a head of V rows.
  static std::size_t linear_cross_entropy_workspace(std::int64_t R, std::int64_t C, std::int64_t V, DType dt) {
    return ints_bytes(R) + dtype_size(dt) * static_cast<std::size_t>(R * (2 * C + block_rows(R, V) + 5));
  }

  /// The forward: y = the loss (sum, or mean: over the targets not ignored, or sum(keep * loss) /
  /// sum(keep) with keep), lse (R) per row (0 for a row that does not count), and with dx, the
  /// loss's gradient with respect to x (R, C) for an upstream gradient of 1.
  static void linear_cross_entropy(const Tensor& x, const HeadWeight& w, const Tensor& t, const Tensor& keep,
                                   const LinearCrossEntropyAttrs& a, Tensor& y, Tensor& lse, Tensor& work, Tensor* dx) {
    detail::dispatch_float(x.dtype(), "linear_cross_entropy", [&]<class T>() {
      Pass<T> p(x, w, t, keep, a, work);
      y.data<T>()[0] = p.online(lse.data<T>(), dx ? dx->data<T>() : nullptr);
    });
  }

  /// The vjp: gx (+)= g dx and, for a dense head that wants one, gw (+)= its gradient. dx_fresh:
  /// dx holds the forward's gradient for these inputs (the forward computed it because a backward
  /// pass was planned); otherwise it is computed here, by the same pass, so the result is the
  /// same bit for bit either way.
  static void linear_cross_entropy_vjp(const Tensor& x, const HeadWeight& w, const Tensor& t, const Tensor& keep,
                                       const LinearCrossEntropyAttrs& a, const Tensor& lse, Tensor& dx, bool dx_fresh,
                                       const Tensor& g, Tensor& work, GradOut gx, GradOut gw) {
    detail::dispatch_float(x.dtype(), "linear_cross_entropy", [&]<class T>() {
      const T gs = g.data<T>()[0];
      const std::int64_t C = x.dim(-1), R = x.numel() / std::max<std::int64_t>(C, 1);
      if (!gw.g) {
        if (!gx.g) return;
        if (!dx_fresh) {
          Pass<T> p(x, w, t, keep, a, work);
          p.online(p.lse_scratch(), dx.data<T>());
        }
        detail::ArrayMap<T> o(gx.g->data<T>(), R * C);
        const detail::ConstArrayMap<T> d(dx.data<T>(), R * C);
        if (gx.acc) o += gs * d;
        else o = gs * d;
        return;
      }
      Pass<T> p(x, w, t, keep, a, work);
      p.weight_grad(lse.data<T>(), gs, gx.g ? gx.g->data<T>() : nullptr, gx.acc, gw.g->data<T>(), gw.acc);
    });
  }

 private:
  // One call's state: the rows that count gathered into xa, their weights and the workspace.
  template <class T>
  struct Pass {
    const HeadWeight& w;
    std::optional<detail::QuantReader<T>> q;
    const T* wd = nullptr;                  // the dense head
    std::int64_t R, C, V, NB, Ra = 0;       // rows, width, classes, block, rows that count
    T den = 1;                              // the loss's divisor
    std::int64_t *idx, *kt;                 // workspace: a counted row's row of x, its target
    T *xa, *acc, *s, *m, *l, *st, *c, *lt;  // (Ra, C) x2, (Ra, NB), then per row

    Pass(const Tensor& x, const HeadWeight& hw, const Tensor& t, const Tensor& keep, const LinearCrossEntropyAttrs& a,
         Tensor& work)
        : w(hw) {
      C = x.dim(-1);
      R = x.numel() / std::max<std::int64_t>(C, 1);
      V = hw.rows();
      NB = block_rows(R, V);
      if (hw.quantized()) q.emplace(hw.codes, hw.scales, hw.biases, a.head.q);
      else wd = hw.w.data<T>();
      idx = static_cast<std::int64_t*>(work.raw());
      kt = idx + R;
      xa = reinterpret_cast<T*>(static_cast<unsigned char*>(work.raw()) + ints_bytes(R));
      acc = xa + R * C;
      s = acc + R * C;
      m = s + R * NB;
      l = m + R;
      st = l + R;
      c = st + R;
      lt = c + R;
      const T* kp = a.has_keep ? keep.data<T>() : nullptr;
      const std::int64_t ignore = a.ce.ignore_index;
      T kept = 0;
      for (std::int64_t r = 0; r < R; ++r) {  // serial, in row order: deterministic
        const std::int64_t k = detail::load_index(t, r);
        if (k != ignore && (k < 0 || k >= V))
          detail::fail("linear_cross_entropy", "target ", k, " at row ", r, " is out of range for ", V,
                       " classes (ignore_index is ", ignore, ")");
        const T wr = kp ? kp[r] : T(k != ignore);
        kept += kp ? wr : T(k != ignore);
        if (k == ignore || wr == T(0)) continue;
        idx[Ra] = r;
        kt[Ra] = k;
        c[Ra] = wr;
        ++Ra;
      }
      if (a.ce.reduction == Reduction::mean) den = kept;
      const T* X = x.data<T>();
      for (std::int64_t i = 0; i < Ra; ++i) std::copy_n(X + idx[i] * C, C, xa + i * C);
    }

    T* lse_scratch() { return lt; }  // an lse the caller does not keep (the vjp's recomputation)

    // S = xa W[v0 : v0 + nb]^T
    void logits(std::int64_t v0, std::int64_t nb) const {
      if (q) QuantizedKernelsT<>::quantized_product<T>(q->rows_from(v0), xa, s, Ra, nb, C, true, false);
      else MatmulKernelsT<>::gemm<T>(false, true, Ra, nb, C, xa, C, wd + v0 * C, C, s, false);
    }
    // y (Ra, C) (+)= S W[v0 : v0 + nb]
    void times(T* y, std::int64_t v0, std::int64_t nb, bool add) const {
      if (q) QuantizedKernelsT<>::quantized_product<T>(q->rows_from(v0), s, y, Ra, C, nb, false, add);
      else MatmulKernelsT<>::gemm<T>(false, false, Ra, C, nb, s, nb, wd + v0 * C, C, y, add);
    }
    static T row_max(const T* x, std::int64_t n) {
      if constexpr (std::is_same_v<T, float>) return simd::max(x, n);
      else return detail::ConstArrayMap<T>(x, n).maxCoeff();
    }

    // The online pass; returns the loss, writes lse (R) and, with dx, the gradient (R, C).
    T online(T* lse, T* dx) {
      for (std::int64_t v0 = 0; v0 < V; v0 += NB) {
        const std::int64_t nb = std::min(NB, V - v0);
        logits(v0, nb);
        detail::parallel_for(Ra, Ra * nb > detail::kParallelGrain, [&](std::int64_t i) {
          T* row = s + i * nb;
          const std::int64_t k = kt[i] - v0;
          if (k >= 0 && k < nb) st[i] = row[k];
          const T mn = v0 == 0 ? row_max(row, nb) : std::max(m[i], row_max(row, nb));
          const T sum = detail::exp_sum(row, nb, mn);
          if (v0 == 0) {
            l[i] = sum;
          } else {
            const T alpha = detail::SoftmaxMath::rebase(m[i], mn);  // the earlier blocks' terms, on the new max
            l[i] = l[i] * alpha + sum;
            if (dx && alpha != T(1)) detail::ArrayMap<T>(acc + i * C, C) *= alpha;
          }
          m[i] = mn;
        });
        if (dx) times(acc, v0, nb, v0 > 0);
      }
      T total = 0;  // serial, in row order: deterministic
      std::fill_n(lse, R, T(0));
      for (std::int64_t i = 0; i < Ra; ++i) {
        const T li = detail::SoftmaxMath::lse(m[i], l[i]);
        lse[idx[i]] = li;
        total += c[i] * detail::SoftmaxMath::ce_loss(li, st[i]);
      }
      if (dx) {
        std::fill_n(dx, R * C, T(0));
        detail::parallel_for(Ra, Ra * C > detail::kParallelGrain, [&](std::int64_t i) {
          T* o = dx + idx[i] * C;
          target_row(kt[i], o);
          const T inv = T(1) / l[i], coef = c[i] / den;
          detail::ArrayMap<T>(o, C) = coef * (detail::ConstArrayMap<T>(acc + i * C, C) * inv - detail::ConstArrayMap<T>(o, C));
        });
      }
      return total / den;
    }

    // W[k] into out (C)
    void target_row(std::int64_t k, T* out) const {
      if (q) q->run(k, 0, C, out, 1);
      else std::copy_n(wd + k * C, C, out);
    }

    // The second pass of a trainable head: gw (V, C) (+)= D^T xa and gx (R, C) (+)= D W per block.
    void weight_grad(const T* lse, T gs, T* gx, bool gx_acc, T* gw, bool gw_acc) {
      for (std::int64_t i = 0; i < Ra; ++i) st[i] = lse[idx[i]];
      for (std::int64_t v0 = 0; v0 < V; v0 += NB) {
        const std::int64_t nb = std::min(NB, V - v0);
        logits(v0, nb);
        detail::parallel_for(Ra, Ra * nb > detail::kParallelGrain, [&](std::int64_t i) {
          T* row = s + i * nb;
          const T cf = gs * (c[i] / den);
          if constexpr (std::is_same_v<T, float>) simd::ce_grad(row, nb, st[i], cf, row, false);
          else detail::ArrayMap<T>(row, nb) = detail::SoftmaxMath::ce_grad(detail::ConstArrayMap<T>(row, nb), st[i], cf);
          const std::int64_t k = kt[i] - v0;
          if (k >= 0 && k < nb) row[k] -= cf;
        });
        MatmulKernelsT<>::gemm<T>(true, false, nb, C, Ra, s, nb, xa, C, gw + v0 * C, gw_acc);
        if (gx) times(acc, v0, nb, v0 > 0);
      }
      if (!gx) return;
      if (!gx_acc) std::fill_n(gx, R * C, T(0));
      for (std::int64_t i = 0; i < Ra; ++i)
        detail::ArrayMap<T>(gx + idx[i] * C, C) += detail::ConstArrayMap<T>(acc + i * C, C);
    }
  };
};
using LinearCrossEntropyKernels = LinearCrossEntropyKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/linear_cross_entropy.hpp ----
// ---- begin nn/backend/cpu/optim.hpp ----
// nn::cpu's optimizer updates: one fused pass per parameter in MLX's arithmetic order (optim/;
// the formulas in backend/math.hpp), and the small kernels Muon and clip_grad_norm compose.


namespace nn {

namespace cpu_kernels {

// A class template with one instance, `OptimKernels` (why: backend/cpu.hpp).
template <class = void>
struct OptimKernelsT {
  // lr is a 0-D float64 tensor and step a 0-D int64 tensor, read at run time, so a replayed
  // step sees a scheduled learning rate without re-recording. T is the parameter's dtype. The
  // arithmetic of each update is backend/math.hpp's (SgdMath, AdamMath, ...), as on CUDA.

  static void sgd_update(Tensor& p, const Tensor& g, Tensor& v, const Tensor& lr, double momentum, double dampening,
                         double wd, bool nesterov) {
    detail::dispatch_float(p.dtype(), "sgd", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* vs = momentum > 0 ? static_cast<T*>(v.raw()) : nullptr;
      const auto f = detail::SgdMath<T>::make(lr.item(), momentum, dampening, wd, nesterov);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { f(ps[i], gs[i], vs ? vs + i : nullptr); });
    });
  }

  static void adam_update(Tensor& p, const Tensor& g, Tensor& m, Tensor& v, const Tensor& lr, const Tensor& step,
                          double b1, double b2, double eps, double decoupled_wd, bool bias_correction) {
    detail::dispatch_float(p.dtype(), "adam", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* ms = static_cast<T*>(m.raw());
      T* vs = static_cast<T*>(v.raw());
      const auto f = detail::AdamMath<T>::make(lr.item(), step.item(), b1, b2, eps, decoupled_wd, bias_correction);
      const std::int64_t n = p.numel();
      if constexpr (std::is_same_v<T, float>) {  // one pass at the CPU's vector width (simd.hpp)
        detail::parallel_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
          simd::adam(ps + i0, gs + i0, ms + i0, vs + i0, i1 - i0, f);
        });
        return;
      }
      // AdamMath's arithmetic as Eigen array passes over cache-sized chunks (vectorised), the
      // square root by sqrt_exact (correctly rounded, as CUDA's sqrt).
      detail::parallel_chunks(n, [&](std::int64_t i0, std::int64_t i1) {
        const std::int64_t len = i1 - i0;
        detail::ArrayMap<T> pa(ps + i0, len), ma(ms + i0, len), va(vs + i0, len);
        detail::ConstArrayMap<T> ga(gs + i0, len);
        alignas(64) T root[detail::kChunk];
        ma = f.m(ma, ga);
        va = f.v(va, ga);
        detail::sqrt_exact(vs + i0, root, len);
        if (f.decoupled) pa *= f.decay;
        pa -= f.delta(ma, detail::ConstArrayMap<T>(root, len));
      });
    });
  }

  static void lion_update(Tensor& p, const Tensor& g, Tensor& m, const Tensor& lr, double b1, double b2, double wd) {
    detail::dispatch_float(p.dtype(), "lion", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* ms = static_cast<T*>(m.raw());
      const auto f = detail::LionMath<T>::make(lr.item(), b1, b2, wd);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { f(ps[i], gs[i], ms[i]); });
    });
  }

  static void muon_momentum(const Tensor& p, const Tensor& g, Tensor& v, Tensor& u, double momentum, double wd,
                            bool nesterov) {
    detail::dispatch_float(p.dtype(), "muon", [&]<class T>() {
      const T* ps = static_cast<const T*>(p.raw());
      const T* gs = static_cast<const T*>(g.raw());
      T* vs = static_cast<T*>(v.raw());
      T* us = static_cast<T*>(u.raw());
      const auto f = detail::MuonMomentumMath<T>::make(momentum, wd, nesterov);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { f(ps[i], gs[i], vs[i], us[i]); });
    });
  }

  /// sum of x^2 in double (the global norm of clip_grad_norm).
  static double sum_squares(const Tensor& x) {
    double s = 0;
    detail::dispatch_float(x.dtype(), "sum_squares", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      for (std::int64_t i = 0; i < x.numel(); ++i) s += static_cast<double>(xs[i]) * static_cast<double>(xs[i]);
    });
    return s;
  }

  /// y = a x + b y (elementwise; the Newton-Schulz steps of Muon).
  static void axpby(double a, const Tensor& x, double b, Tensor& y) {
    detail::dispatch_float(y.dtype(), "axpby", [&]<class T>() {
      const T* xs = static_cast<const T*>(x.raw());
      T* ys = static_cast<T*>(y.raw());
      const detail::AxpbyMath<T> f{static_cast<T>(a), static_cast<T>(b)};
      const std::int64_t n = y.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { ys[i] = f(xs[i], ys[i]); });
    });
  }

  /// x /= (||x||_F + eps) (Muon's normalisation before Newton-Schulz).
  static void normalize_frobenius(Tensor& x, double eps) {
    detail::dispatch_float(x.dtype(), "normalize", [&]<class T>() {
      T* xs = static_cast<T*>(x.raw());
      const std::int64_t n = x.numel();
      T ss = 0;
      for (std::int64_t i = 0; i < n; ++i) ss += xs[i] * xs[i];
      const T d = std::sqrt(ss) + static_cast<T>(eps);
      for (std::int64_t i = 0; i < n; ++i) xs[i] = xs[i] / d;
    });
  }

  /// p -= (lr * factor) x, lr a 0-D tensor rounded to p's dtype before the factor (MLX order).
  static void apply_update(Tensor& p, const Tensor& x, const Tensor& lr, double factor) {
    detail::dispatch_float(p.dtype(), "update", [&]<class T>() {
      T* ps = static_cast<T*>(p.raw());
      const T* xs = static_cast<const T*>(x.raw());
      const auto f = detail::ApplyUpdateMath<T>::make(lr.item(), factor);
      const std::int64_t n = p.numel();
      detail::parallel_for(n, n > detail::kParallelGrain, [&](std::int64_t i) { ps[i] = f(ps[i], xs[i]); });
    });
  }
};
using OptimKernels = OptimKernelsT<>;

}  // namespace cpu_kernels
}  // namespace nn
// ---- end nn/backend/cpu/optim.hpp ----

namespace nn {

/// The CPU backend policy: every kernel family of backend/cpu/, gathered.
struct cpu : cpu_kernels::ElementwiseKernels,
             cpu_kernels::ReduceKernels,
             cpu_kernels::MatmulKernels,
             cpu_kernels::ShapeKernels,
             cpu_kernels::IndexKernels,
             cpu_kernels::RandomKernels,
             cpu_kernels::SoftmaxKernels,
             cpu_kernels::CrossEntropyKernels,
             cpu_kernels::NormKernels,
             cpu_kernels::RopeKernels,
             cpu_kernels::AttentionKernels,
             cpu_kernels::GluKernels,
             cpu_kernels::FusedKernels,
             cpu_kernels::QuantizedKernels,
             cpu_kernels::LinearCrossEntropyKernels,
             cpu_kernels::OptimKernels {
  static constexpr Device device = Device::cpu;
  static constexpr const char* name = "cpu";

  static Tensor alloc(const Shape& s, DType t) { return Tensor::empty(s, t, Device::cpu); }
};

static_assert(BackendPolicy<cpu>);

/// What this CPU offers and which GEMM nn runs on it (declared in backend/cpu_info.hpp), read
/// once per process. The finetune example and every bench print cpu_info().line() first.
inline const CpuInfo& cpu_info() {
  static const CpuInfo info = [] {
    CpuInfo i;
    i.features = detail::detect_cpu_features();
    const detail::GemmChoice& g = detail::gemm_choice();
    i.note = g.note;
#if defined(NN_OWN_GEMM)
    i.isa = gemm::active_isa();
    if (g.engine == detail::GemmEngine::nn) {
      i.gemm = gemm::describe(i.isa);
      i.gemm_id = std::string("nn-") + isa_name(i.isa);
    }
#endif
    i.bf16 = detail::gemm_bf16_kernel();
    if (g.engine == detail::GemmEngine::blas) i.gemm = "CBLAS", i.gemm_id = "cblas";
    if (g.engine == detail::GemmEngine::eigen) i.gemm = "Eigen's GEMM", i.gemm_id = "eigen";
    return i;
  }();
  return info;
}

}  // namespace nn
// ---- end nn/backend/cpu.hpp ----
// ---- begin nn/tape.hpp ----
// GTape<Backend>: a Wengert list of primitive ops recorded in construction order (already a
// topological order), swept in reverse by backward(), and replayable without re-recording.

#include <algorithm>
#include <array>
#include <cstddef>
#include <deque>
#include <new>
#include <optional>
#include <span>
#include <sstream>
#include <string>
#include <string_view>
#include <type_traits>
#include <unordered_set>
#include <utility>
#include <vector>

// ---- begin nn/anomaly.hpp ----
// Finding NaN and Inf: the finiteness tests the optimizers' gate and the tape's anomaly mode
// (GTape::detect_anomaly, NN_DETECT_ANOMALY=1) share, and the words they report a bad element in.

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>


namespace nn::detail {

/// Whether every element of a floating tensor is finite (integer tensors always are). A device
/// tensor is read through a host copy. The test is on the exponent bits (all ones: Inf or NaN),
/// an integer OR-reduction the compiler vectorises: one read of the tensor, no branch.
inline bool all_finite(const Tensor& t) {
  if (!is_floating(t.dtype())) return true;
  const Tensor h = t.device() == Device::cpu ? t : t.to(Device::cpu);
  auto scan = [](const auto* p, std::int64_t n, auto exp_mask) {
    using U = decltype(exp_mask);
    U bad = 0;
    for (std::int64_t i = 0; i < n; ++i) {
      U u;
      std::memcpy(&u, p + i, sizeof(U));
      bad |= static_cast<U>((u & exp_mask) == exp_mask);
    }
    return bad == 0;
  };
  if (h.dtype() == DType::f32) return scan(h.data<float>(), h.numel(), std::uint32_t{0x7f800000u});
  if (h.dtype() == DType::f64) return scan(h.data<double>(), h.numel(), std::uint64_t{0x7ff0000000000000ull});
  const Tensor f = h.to(DType::f32);  // bf16 / f16: their Inf and NaN stay Inf and NaN
  return scan(f.data<float>(), f.numel(), std::uint32_t{0x7f800000u});
}

/// The first NaN or Inf of a floating tensor, in words: "NaN at [1, 3]" (the row-major position
/// in t's shape). Empty when every element is finite. Only called once all_finite said no.
inline std::string first_nonfinite(const Tensor& t) {
  if (!is_floating(t.dtype())) return {};
  const Tensor h = t.device() == Device::cpu ? t : t.to(Device::cpu);
  const Tensor d = h.dtype() == DType::f64 ? h : h.to(DType::f64);  // exact for every float dtype
  const double* p = d.data<double>();
  for (std::int64_t i = 0; i < d.numel(); ++i) {
    if (std::isfinite(p[i])) continue;
    std::ostringstream os;
    os << (std::isnan(p[i]) ? "NaN" : p[i] > 0 ? "+Inf" : "-Inf") << " at [";
    const Shape& s = t.shape();
    std::int64_t rest = i, stride = s.numel();
    for (int a = 0; a < s.rank(); ++a) {
      stride /= s[a];
      os << (a ? ", " : "") << rest / stride;
      rest %= stride;
    }
    os << "] (element " << i << ")";
    return os.str();
  }
  return {};
}

/// Whether environment switch `name` is on: set, and neither empty nor "0".
inline bool env_flag(const char* name) {
  const char* e = std::getenv(name);
  return e != nullptr && *e != '\0' && std::string_view(e) != "0";
}

/// NN_DETECT_ANOMALY in the environment: set and not "0" turns anomaly mode on for every tape
/// constructed afterwards (read at construction, so a test may set it and unset it).
inline bool anomaly_from_env() { return env_flag("NN_DETECT_ANOMALY"); }

}  // namespace nn::detail
// ---- end nn/anomaly.hpp ----

namespace nn {

/// A handle to one value on a tape: the tape's identity and the node's index. Cheap to copy.
struct GVar {
  const void* tape = nullptr;
  std::int32_t index = -1;
  bool valid() const { return tape != nullptr && index >= 0; }
};

/// What kind of leaf a node is; ops are LeafKind::none.
enum class LeafKind : std::uint8_t { none, param, constant, input };

/// A node's attributes: each primitive declares its own struct (UnaryAttrs{op, arg},
/// AttentionAttrs{B, T, H, KV, head_dim, scale, causal}, ...), trivially copyable, kept in the
/// node by value, so a node is plain data that a replay or another backend runs again. A read
/// names the type it expects; reading another primitive's attributes is an error, not garbage.
class NodeAttrs {
 public:
  static constexpr std::size_t kBytes = 96;

  template <class A>
  void set(const A& a) {
    static_assert(std::is_trivially_copyable_v<A>, "a primitive's attributes are plain data");
    static_assert(sizeof(A) <= kBytes && alignof(A) <= alignof(std::max_align_t), "attributes too large for a node");
    ::new (static_cast<void*>(bytes_)) A(a);
    type_ = &tag<A>;
  }
  template <class A>
  const A& get() const {
    if (type_ != &tag<A>) detail::fail("tape", "a primitive read attributes of another type than it recorded");
    return *std::launder(reinterpret_cast<const A*>(bytes_));
  }

 private:
  template <class A>
  static constexpr char tag = 0;
  alignas(std::max_align_t) unsigned char bytes_[kBytes]{};
  const void* type_ = nullptr;
};

/// The attributes of a primitive that has none.
struct NoAttrs {};

template <class B>
class GTape;
template <class B>
struct Node;

/// A primitive's definition: which primitive (its name, for errors), its forward kernel call and
/// its vjp, side by side in the op's header. Nodes point at a static OpDef, so a node stays data,
/// not a closure.
template <class B>
struct OpDef {
  Prim prim;
  void (*forward)(GTape<B>&, Node<B>&);
  void (*vjp)(GTape<B>&, Node<B>&);
  bool aliases_input = false;  // forward makes value a view of input 0 (reshape): no output buffer
  // The kernel a primitive that runs several ran ("log" for a unary node), read from its
  // attributes, for errors; null when the primitive is one kernel.
  const char* (*kernel)(const Node<B>&) = nullptr;
  // Which values the vjp reads (their data, not only their shapes), for plan_memory: bit k is
  // input k's value (inputs past 30 are always taken as read), kVjpReadsOutput the node's own
  // output. Null: every input and the output (the safe default for a new primitive). A value no
  // later vjp reads can share its memory with other buffers once its forward consumers ran.
  std::uint32_t (*vjp_reads)(const GTape<B>&, const Node<B>&) = nullptr;
  // Input k whose gradient the vjp may write over k's value (element by element, each read
  // before it is written, nothing read after), so plan_memory may give both one block: the
  // cross-entropy's logits. -1: none.
  int vjp_overwrites = -1;
  constexpr const char* name() const { return prim_name(prim); }
};

/// OpDef::vjp_reads's bit for the node's own output value; bit k < 31 is input k's.
inline constexpr std::uint32_t kVjpReadsOutput = 1u << 31;
inline constexpr std::uint32_t vjp_reads_input(int k) { return 1u << k; }

/// An OpDef::vjp_reads for a vjp that always reads the same values (0: none, only shapes).
template <class B, std::uint32_t Mask>
std::uint32_t vjp_reads_fixed(const GTape<B>&, const Node<B>&) {
  return Mask;
}

/// One entry of the tape.
template <class B>
struct Node {
  const OpDef<B>* def = nullptr;  // null for leaves
  LeafKind leaf = LeafKind::none;
  std::vector<std::int32_t> inputs;
  NodeAttrs attrs;
  Tensor value;                   // the output, allocated when recorded, rewritten on replay
  Tensor grad;                    // d loss / d value, allocated on the first backward
  std::vector<Tensor> saved;      // buffers the op keeps between forward and vjp (and scratch)
  const Tensor* bound = nullptr;  // a param leaf's tensor, re-read on every replay
  bool requires_grad = false;
  bool grad_live = false;         // grad holds a contribution from the current backward
  std::int32_t pos = -1;          // its index on the tape
  std::int32_t scope = -1;        // the tape.scope() it was recorded in (GTape::scope_path), or -1
  std::int32_t segment = -1;      // the checkpoint segment it was recorded in (GTape::begin_segment), or -1
  // An intermediate of a closed checkpoint segment: its value, gradient and saved buffers are
  // views of the tape's segment pool, shared with every other segment, and hold its data only
  // while the backward sweep is inside its segment (which recomputes them first).
  bool pooled = false;
  // Its value and gradient are views of blocks that plan_memory() shares between buffers whose
  // lifetimes do not overlap: they hold its data only inside a replay, between its forward and
  // the last use the plan saw.
  bool planned = false;
  bool deferred = false;  // recorded by a deferred tape (defer_kernels): no value until plan_memory()
  // Absorbed by the fusion pass (ops/fused.hpp) into the fused node at this index, which now
  // computes its value inside its own loop: no def, no inputs, no buffers. -1: not absorbed.
  std::int32_t fused_into = -1;

  const char* name() const {
    if (def) return def->name();
    if (fused_into >= 0) return "(fused)";
    switch (leaf) {
      case LeafKind::param: return "param";
      case LeafKind::constant: return "constant";
      case LeafKind::input: return "input";
      default: return "?";
    }
  }
};

/// Where a vjp writes its contribution to one input's gradient: the buffer, and whether to add
/// to it (another consumer already wrote) or overwrite it (first contribution this sweep).
struct GradSlot {
  Tensor& g;
  bool acc;
};

/// What GTape::scope returns: while it lives, the nodes recorded are inside the scope (a layer
/// path, "model.layers.3.self_attn"), which anomaly mode's errors name. Ends at its destruction.
class [[nodiscard]] TapeScope {
 public:
  explicit TapeScope(std::vector<std::int32_t>& stack) : stack_(&stack) {}
  TapeScope(TapeScope&& o) noexcept : stack_(std::exchange(o.stack_, nullptr)) {}
  TapeScope(const TapeScope&) = delete;
  TapeScope& operator=(const TapeScope&) = delete;
  TapeScope& operator=(TapeScope&&) = delete;
  ~TapeScope() {
    if (stack_ && !stack_->empty()) stack_->pop_back();
  }

 private:
  std::vector<std::int32_t>* stack_;
};

/// The tape. Explicit object, passed to every builder; no global state, one tape per thread.
template <class B>
class GTape {
  static_assert(BackendPolicy<B>, "the tape's backend must satisfy nn::BackendPolicy");

 public:
  using backend = B;

  GTape() : anomaly_(detail::anomaly_from_env()) {}
  GTape(const GTape&) = delete;  // GVars name their tape by address
  GTape& operator=(const GTape&) = delete;

  // ---- leaves ------------------------------------------------------------------------------

  /// Binds `t` by reference: the leaf reads t's storage (updated in place by an optimizer, and
  /// re-read by a replay). Its gradient is computed when `trainable` and t is floating point.
  /// Binding the same tensor again returns the same leaf, so a weight used twice (a tied head)
  /// gets one gradient holding both contributions.
  GVar param(const Tensor& t, bool trainable = true) {
    check_leaf(t, "param");
    see_leaf_dtype(t.dtype());
    for (std::int32_t i : params_) {
      const Node<B>& p = nodes_[static_cast<std::size_t>(i)];
      if (p.bound == &t) {
        if (p.requires_grad != (trainable && is_floating(t.dtype())))
          detail::fail("param", "tensor ", t.shape().str(), " was bound ", p.requires_grad ? "trainable" : "frozen",
                       " and is now bound ", trainable ? "trainable" : "frozen");
        return GVar{this, i};
      }
    }
    params_.push_back(static_cast<std::int32_t>(nodes_.size()));
    Node<B>& n = push(LeafKind::param);
    n.value = t;
    n.bound = &t;
    n.requires_grad = trainable && is_floating(t.dtype());
    return checked_leaf();
  }
  /// A temporary cannot be bound: the leaf would point at a destroyed tensor. Keep the tensor in
  /// a variable (or a module's Param) that outlives the tape, or use constant() / input().
  GVar param(Tensor&&, bool = true) = delete;
  /// A value that never gets a gradient (shares t's storage).
  GVar constant(const Tensor& t) {
    check_leaf(t, "constant");
    see_leaf_dtype(t.dtype());
    Node<B>& n = push(LeafKind::constant);
    n.value = t;
    return checked_leaf();
  }
  /// A slot whose value set() may swap between replays (a batch). No gradient unless asked.
  GVar input(const Tensor& t, bool requires_grad = false) {
    check_leaf(t, "input");
    see_leaf_dtype(t.dtype());
    Node<B>& n = push(LeafKind::input);
    n.value = t;
    n.requires_grad = requires_grad && is_floating(t.dtype());
    return checked_leaf();
  }
  /// A fresh MLX key (uint32 (2)) from nn::random's global sequence, held in an input slot that
  /// refresh_keys() refills in recording order: how Dropout gets its key, so that a replayed step
  /// and an eager step draw the same keys (and so the same masks) from the same sequence.
  GVar random_key() {
    Tensor k = random::next_key();
    GVar v = input(B::device == Device::cpu ? k : k.to(B::device));  // the key lives where the tape runs
    key_slots_.push_back(v.index);
    return v;
  }
  /// Refills every random_key() slot with the global sequence's next keys (before a replay), in
  /// place: a device backend's slot keeps its buffer (a captured graph reads that address).
  void refresh_keys() {
    for (std::int32_t i : key_slots_) {
      Tensor& slot = nodes_[static_cast<std::size_t>(i)].value;
      if (slot.device() == Device::cpu) random::next_key_into(slot);
      else B::copy(random::next_key(), slot, false);  // an upload of the host-drawn key
    }
  }

  /// Puts a new value in an input slot; shape and dtype must match what was recorded (a new
  /// shape means a new recording).
  void set(GVar v, const Tensor& t) {
    Node<B>& n = node(v);
    if (n.leaf != LeafKind::input) fail_at(v, "set", "only input slots can be set; this is a ", n.name());
    if (!(t.shape() == n.value.shape()) || t.dtype() != n.value.dtype())
      detail::fail("tape.set", "input slot ", v.index, " was recorded as ", n.value.shape().str(), " ",
                   dtype_name(n.value.dtype()), ", got ", t.shape().str(), " ", dtype_name(t.dtype()),
                   " (a new shape needs a new recording)");
    n.value = t;
  }

  // ---- reading -----------------------------------------------------------------------------

  const Tensor& value(GVar v) const { return unpooled(v, "tape.value").value; }
  const Shape& shape(GVar v) const { return node(v).value.shape(); }
  DType dtype(GVar v) const { return node(v).value.dtype(); }
  bool requires_grad(GVar v) const { return node(v).requires_grad; }

  /// d loss / d v after backward(). Zeros when v needs a gradient the last backward never
  /// reached; an error when v cannot have one (a constant, a frozen param, an integer).
  const Tensor& grad(GVar v) {
    Node<B>& n = const_cast<Node<B>&>(unpooled(v, "tape.grad"));
    if (!n.requires_grad)
      detail::fail("tape.grad", "node ", v.index, " (", n.name(), ", shape ", n.value.shape().str(),
                   ") has no gradient: it does not depend on a trainable leaf");
    if (!n.grad_live) {
      ensure_grad(n);
      B::fill(n.grad, 0.0);
      n.grad_live = true;
    }
    return n.grad;
  }

  std::size_t size() const { return nodes_.size(); }
  /// The param leaf bound to `t`, if any (how value_and_grad finds each parameter's gradient).
  std::optional<GVar> find_param(const Tensor& t) const {
    for (std::int32_t i : params_)
      if (nodes_[static_cast<std::size_t>(i)].bound == &t) return GVar{this, i};
    return std::nullopt;
  }
  /// Forgets every node (a new recording); the tensors bound as params are not touched.
  void clear() {
    nodes_.clear();
    params_.clear();
    key_slots_.clear();
    segments_.clear();
    pool_.clear();
    blocks_.clear();
    placeholder_ = Tensor();
    deferred_count_ = 0;
    open_segment_ = -1;
    loss_ = -1;
    fused_programs_.clear();
    if (scope_stack_.empty()) scope_paths_.clear();  // an open scope keeps its path for what follows
    autocast_ = DType::f32;
    if (!float_dtype_set_) {
      float_dtype_seen_ = false;
      float_dtype_ = DType::f32;
    }
  }

  /// DType::bf16: the products recorded from now on whose right operand is a float32 matrix (a
  /// Linear's weight, a LoRA adapter) run on bf16-rounded operands with f32 accumulation, and so
  /// do both products of their backward, the input's gradient and the weight's
  /// (torch.autocast("cpu", dtype=torch.bfloat16) for matmul; nn keeps each product's f32 result
  /// where PyTorch rounds it to bf16). Operands and gradients stay float32 tensors. DType::f32
  /// (the default; also after clear()) records products in their own dtype. Each product keeps
  /// the choice it was recorded with, so a replay does what the recording did.
  void set_autocast(DType t) {
    if (t != DType::f32 && t != DType::bf16)
      detail::fail("tape", "autocast is float32 (off) or bfloat16, got ", dtype_name(t));
    autocast_ = t;
  }
  DType autocast() const { return autocast_; }

  /// The floating dtype this tape computes in, for what a builder makes without being told one
  /// (rope_fill's tables, causal_mask_fill's mask): set_float_dtype's, or else the dtype of the
  /// first float32 or float64 leaf bound to the tape (param, constant or input), or float32.
  DType float_dtype() const { return float_dtype_; }
  void set_float_dtype(DType t) {
    if (t != DType::f32 && t != DType::f64)
      detail::fail("tape", "the float dtype is float32 or float64, got ", dtype_name(t));
    float_dtype_ = t;
    float_dtype_set_ = true;
  }

  // ---- anomaly mode and scopes ------------------------------------------------------------------

  /// Anomaly mode (torch.autograd.detect_anomaly): every value is checked for NaN and Inf as it
  /// is produced -- each leaf as it is bound (and re-read on replay), each op's output after its
  /// forward, each gradient an op's vjp writes -- in eager recording and in replay. The first bad
  /// element raises nn::Error naming the op, its node index, its scope path (the layer), its
  /// inputs' shapes and the element's position. Off by default (one untaken branch per node);
  /// NN_DETECT_ANOMALY=1 in the environment turns it on for every tape made afterwards.
  void detect_anomaly(bool on) { anomaly_ = on; }
  bool detect_anomaly() const { return anomaly_; }

  /// Opens a scope named `name` inside the current one ("layers.3", then "self_attn" inside it
  /// makes "layers.3.self_attn"); it closes when the returned object is destroyed. Nodes
  /// recorded meanwhile carry the path, for errors:
  ///   { auto s = tp.scope("mlp"); x = mlp(tp, x); }
  TapeScope scope(std::string_view name) {
    std::string path(name);
    if (!scope_stack_.empty()) path = scope_paths_[static_cast<std::size_t>(scope_stack_.back())] + "." + path;
    scope_paths_.push_back(std::move(path));
    scope_stack_.push_back(static_cast<std::int32_t>(scope_paths_.size() - 1));
    return TapeScope(scope_stack_);
  }
  /// The scope path node v was recorded in ("" outside any scope).
  const std::string& scope_path(GVar v) const {
    static const std::string none;
    const std::int32_t s = node(v).scope;
    return s < 0 ? none : scope_paths_[static_cast<std::size_t>(s)];
  }

  // ---- backward ----------------------------------------------------------------------------

  /// Reverse sweep from a scalar loss (d loss / d loss = 1).
  void backward(GVar loss) {
    Node<B>& n = node(loss);
    if (n.value.numel() != 1)
      detail::fail("backward", "the loss must have one element, got shape ", n.value.shape().str(),
                   "; pass an explicit cotangent for a non-scalar output");
    begin_backward(n);
    B::fill(n.grad, 1.0);
    sweep(loss.index);
  }
  /// Reverse sweep from any output with an explicit cotangent of the output's shape.
  void backward(GVar out, const Tensor& cotangent) {
    Node<B>& n = node(out);
    if (!(cotangent.shape() == n.value.shape()) || cotangent.dtype() != n.value.dtype())
      detail::fail("backward", "cotangent ", cotangent.shape().str(), " ", dtype_name(cotangent.dtype()),
                   " does not match the output ", n.value.shape().str(), " ", dtype_name(n.value.dtype()));
    begin_backward(n);
    B::copy(cotangent, n.grad, false);
    if (anomaly_ && !detail::all_finite(n.grad)) report(out.index, n.grad, "the cotangent given to backward() holds");
    sweep(out.index);
  }

  // ---- replay ------------------------------------------------------------------------------

  /// Re-runs every recorded node into the buffers it already owns: params re-read from their
  /// bound tensors (which must keep their shape), inputs as last set(). Allocates nothing.
  void replay_forward() {
    require_materialised("tape.replay");
    for (std::size_t i = 0; i < nodes_.size(); ++i) {
      Node<B>& n = nodes_[i];
      if (n.leaf == LeafKind::param) {
        if (!(n.bound->shape() == n.value.shape()) || n.bound->dtype() != n.value.dtype())
          detail::fail("tape.replay", "a bound parameter changed from ", n.value.shape().str(), " to ",
                       n.bound->shape().str(), "; record the step again");
        n.value = *n.bound;
      } else if (n.def) {
        n.def->forward(*this, n);
      }
      if (anomaly_) check_value(static_cast<std::int32_t>(i));
    }
  }
  /// Replays the forward pass, then the last backward() from a scalar loss.
  void replay() {
    replay_forward();
    if (loss_ >= 0) backward(GVar{this, loss_});
  }

  // ---- memory planning (what a compiled step does: compile.hpp) ------------------------------

  /// Deferred recording: while on, an op recorded gets its output's shape and dtype but no
  /// memory and no kernel run (a reshape still views its input); plan_memory() then gives every
  /// op its buffer and replay() computes the values. A recording whose every buffer is live at
  /// once would otherwise set the process's peak memory before any plan could share them.
  /// Reading such a node's value or recording an op that checks data (an id out of range)
  /// before the replay: the value is an error to read, the data check runs on the replay.
  void defer_kernels(bool on) { deferred_ = on; }
  bool deferred_kernels() const { return deferred_; }

  /// Plans the tape for replay() from `out` (backward included when `backward` is set and `out`
  /// is a scalar that depends on a trainable leaf; an evaluation passes false), then keeps only what outlives a replay: leaves, `out`'s value
  /// and the leaves' gradients. Every other op value and gradient becomes a view of a shared
  /// block, lent to buffers whose lifetimes do not overlap. A value lives from its forward to
  /// its last use: the last op that reads it forward, or the last vjp that reads its data
  /// (OpDef::vjp_reads; quantized_matmul's vjp, for one, never reads x). A gradient lives from
  /// the first vjp that writes it to its own vjp. Saved buffers (tp.scratch) keep their own
  /// memory. Afterwards the planned nodes cannot be read (an nn::Error names the node) and the
  /// tape allocates nothing on replay. Returns the bytes the plan's blocks hold. With checkpoint
  /// segments, their pooled intermediates keep the segment pool (shared already); the rest is
  /// planned, a segment's inputs living until the backward sweep recomputes the segment.
  std::size_t plan_memory(GVar out, bool backward = true) {
    Node<B>& o = const_cast<Node<B>&>(unpooled(out, "plan_memory", true));
    if (open_segment_ >= 0) detail::fail("plan_memory", "a checkpoint segment is still open");
    loss_ = backward && o.requires_grad && o.value.numel() == 1 ? out.index : -1;
    const std::int64_t N = static_cast<std::int64_t>(nodes_.size());
    blocks_.clear();
    plan_blocks(out.index);
    for (Node<B>& n : nodes_) {  // what the plan did not place gets its own buffer
      if (n.deferred && !n.planned && !n.pooled) n.value = B::alloc(n.value.shape(), n.value.dtype());
      n.deferred = false;
    }
    deferred_count_ = 0;
    placeholder_ = Tensor();
    for (std::int64_t i = 0; i < N; ++i) {  // views follow their input onto its buffer
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.def && n.def->aliases_input) n.def->forward(*this, n);
    }
    std::size_t total = 0;
    for (const Tensor& b : blocks_) total += b.storage_bytes();
    return total;
  }

  /// The three steps in one: records build() (which returns the output GVar) with its kernels
  /// deferred, plans the tape for that output and replays it once; returns the output, whose
  /// value (and, with `backward`, the leaves' gradients) is then read as usual.
  ///   GVar loss = tp.record_planned([&] { return cross_entropy(tp, model.logits(tp, ids), tg); }, false);
  template <class F>
  GVar record_planned(F&& build, bool backward = true) {
    const GVar out = record_deferred(std::forward<F>(build));
    plan_memory(out, backward);
    replay();
    return out;
  }
  /// The first step alone: records build() with its kernels deferred and returns its output, to
  /// be planned (plan_memory) before anything runs. A throw from build() leaves deferral off.
  template <class F>
  GVar record_deferred(F&& build) {
    defer_kernels(true);
    try {
      const GVar out = build();
      defer_kernels(false);
      return out;
    } catch (...) {
      defer_kernels(false);
      throw;
    }
  }

  // ---- checkpoint segments (nn::checkpoint, grad_checkpoint.hpp) --------------------------------

  /// Opens a checkpoint segment: the ops recorded until end_segment() are its nodes. Segments do
  /// not nest.
  void begin_segment() {
    if (open_segment_ >= 0) detail::fail("checkpoint", "checkpoint segments do not nest (one is already open)");
    segments_.push_back({static_cast<std::int32_t>(nodes_.size()), -1});
    open_segment_ = static_cast<std::int32_t>(segments_.size() - 1);
  }
  /// Closes the open segment. Its op nodes other than `outputs` (and what those view) become
  /// pooled: their buffers are lent to every segment in turn, so after this only the outputs may
  /// be read or used by later ops; the backward sweep recomputes the rest from the segment's
  /// inputs when it gets there.
  void end_segment(std::span<const GVar> outputs) {
    if (open_segment_ < 0) detail::fail("checkpoint", "end_segment without begin_segment");
    Segment& sg = segments_[static_cast<std::size_t>(open_segment_)];
    open_segment_ = -1;
    sg.end = static_cast<std::int32_t>(nodes_.size());
    std::vector<char> keep(static_cast<std::size_t>(sg.end - sg.begin), 0);
    for (GVar v : outputs) {
      node(v);
      if (v.index >= sg.begin) keep[static_cast<std::size_t>(v.index - sg.begin)] = 1;
    }
    for (std::int32_t i = sg.end - 1; i >= sg.begin; --i) {  // an output that views a node keeps it
      const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (keep[static_cast<std::size_t>(i - sg.begin)] && n.def && n.def->aliases_input && n.inputs[0] >= sg.begin)
        keep[static_cast<std::size_t>(n.inputs[0] - sg.begin)] = 1;
    }
    for (std::int32_t i = sg.begin; i < sg.end; ++i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (!n.def || keep[static_cast<std::size_t>(i - sg.begin)]) continue;
      n.pooled = true;
      sg.needs_grad = sg.needs_grad || n.requires_grad;
    }
    park(static_cast<std::int32_t>(segments_.size() - 1));
  }

  /// Closes the open segment (if any) without pooling anything: its nodes stay ordinary, as if
  /// never in a segment. How nn::checkpoint cleans up when the segment's function throws.
  void abandon_segment() {
    if (open_segment_ < 0) return;
    Segment& sg = segments_[static_cast<std::size_t>(open_segment_)];
    sg.end = static_cast<std::int32_t>(nodes_.size());
    for (std::int32_t i = sg.begin; i < sg.end; ++i) nodes_[static_cast<std::size_t>(i)].segment = -1;
    open_segment_ = -1;
  }

  /// The bytes of the buffers this tape holds (op values, gradients, saved buffers and the
  /// segment pool), each storage block counted once; leaves' tensors are not counted.
  std::size_t bytes() const {
    std::unordered_set<const void*> seen;
    std::size_t total = 0;
    auto count = [&](const Tensor& t) {
      if (t.defined() && seen.insert(t.raw()).second) total += t.storage_bytes();
    };
    for (const Node<B>& n : nodes_) {
      if (n.def && !n.def->aliases_input) count(n.value);
      count(n.grad);
      for (const Tensor& t : n.saved) count(t);
    }
    for (const Tensor& t : pool_) count(t);
    return total;
  }

  // ---- for op implementations ----------------------------------------------------------------

  /// Appends an op node with output shape/dtype, allocates its output, runs its forward.
  template <class A = NoAttrs>
  GVar record(const OpDef<B>& def, std::span<const GVar> inputs, const A& attrs, const Shape& out_shape,
              DType out_dtype) {
    for (GVar v : inputs) unpooled(v, def.name(), true);  // validates ownership; no checkpointed intermediate
    Node<B>& n = push(LeafKind::none);
    n.def = &def;
    n.attrs.set(attrs);
    n.inputs.reserve(inputs.size());
    for (GVar v : inputs) {
      n.inputs.push_back(v.index);
      n.requires_grad = n.requires_grad || nodes_[static_cast<std::size_t>(v.index)].requires_grad;
    }
    n.requires_grad = n.requires_grad && is_floating(out_dtype);
    if (def.aliases_input) {
    } else if (deferred_) {
      n.value = placeholder(out_shape, out_dtype);
      n.deferred = true;
      ++deferred_count_;
      return handle();  // the kernel runs on the first replay, into the buffer plan_memory gives it
    } else {
      n.value = B::alloc(out_shape, out_dtype);
    }
    try {
      def.forward(*this, n);
      if (anomaly_) check_value(static_cast<std::int32_t>(nodes_.size() - 1));
    } catch (...) {
      nodes_.pop_back();  // a failed op (an id out of range) leaves the tape as it was, replayable
      throw;
    }
    return handle();
  }

  Node<B>& node(GVar v) {
    check(v);
    return nodes_[static_cast<std::size_t>(v.index)];
  }
  const Node<B>& node(GVar v) const {
    check(v);
    return nodes_[static_cast<std::size_t>(v.index)];
  }
  Node<B>& at(std::int32_t i) { return nodes_[static_cast<std::size_t>(i)]; }
  /// Input k's value of node n.
  const Tensor& in(const Node<B>& n, std::size_t k) const {
    return nodes_[static_cast<std::size_t>(n.inputs[k])].value;
  }
  /// Whether a backward sweep will follow this forward of node n and reach it: a replay of a
  /// tape planned with its backward (plan_memory), or of one whose backward() already ran. A
  /// primitive whose vjp is cheapest computed inside its forward (linear_cross_entropy) does it
  /// then, and in its vjp otherwise.
  bool backward_follows(const Node<B>& n) const {
    return loss_ >= 0 && n.pos <= loss_ && n.requires_grad;
  }
  /// Whether input k of node n wants a gradient.
  bool needs_grad(const Node<B>& n, std::size_t k) const {
    return nodes_[static_cast<std::size_t>(n.inputs[k])].requires_grad;
  }
  /// The destination for input k's gradient (allocated once, reused by every later sweep).
  GradSlot grad_slot(const Node<B>& n, std::size_t k) {
    Node<B>& in = nodes_[static_cast<std::size_t>(n.inputs[k])];
    ensure_grad(in);
    bool acc = in.grad_live;
    in.grad_live = true;
    return {in.grad, acc};
  }
  /// The gradient destinations of inputs 0..N-1 of n, for a vjp kernel that writes them in one
  /// call ({nullptr, false} where an input needs none, or is past n's inputs). Inputs that are one
  /// node (attention's k = v, swiglu(x, x)) name one buffer: it is zeroed here once, unless it
  /// already holds a contribution, and every slot naming it accumulates, so the kernel may
  /// interleave its writes in any order and never tests whether its outputs overlap.
  template <std::size_t N>
  std::array<GradOut, N> grad_outs(Node<B>& n) {
    std::array<GradOut, N> out{};
    for (std::size_t k = 0; k < N && k < n.inputs.size(); ++k) {
      if (!needs_grad(n, k)) continue;
      std::size_t first = 0;
      while (n.inputs[first] != n.inputs[k]) ++first;
      if (first == k) {
        GradSlot s = grad_slot(n, k);
        out[k] = {&s.g, s.acc};
        continue;
      }
      // the same node again: its one buffer, zeroed once, every write to it accumulating
      if (!out[first].acc) {
        B::fill(*out[first].g, 0.0);
        out[first].acc = true;
      }
      out[k] = out[first];
    }
    return out;
  }
  /// Adds `full` (at the op output's broadcast shape) into input k's gradient, summed down to the
  /// input's shape: the one place broadcasting gradients are reduced.
  void accumulate_reduced(const Node<B>& n, std::size_t k, const Tensor& full) {
    GradSlot s = grad_slot(n, k);
    if (full.shape() == s.g.shape()) B::copy(full, s.g, s.acc);
    else B::sum_to(full, s.g, 1.0, s.acc);
  }
  /// Buffer `slot` of node n with the given shape and dtype, allocated the first time only.
  Tensor& scratch(Node<B>& n, std::size_t slot, const Shape& s, DType t) {
    if (n.saved.size() <= slot) n.saved.resize(slot + 1);
    Tensor& b = n.saved[slot];
    if (!b.defined() || !(b.shape() == s) || b.dtype() != t) b = B::alloc(s, t);
    return b;
  }

  /// The fused groups' programs (ops/fused.hpp): a fused node's attributes name one by index.
  /// A deque, so a program's address stays put while more are added.
  std::int32_t add_fused_program(const FusedProgram& p) {
    fused_programs_.push_back(p);
    return static_cast<std::int32_t>(fused_programs_.size() - 1);
  }
  const FusedProgram& fused_program(std::int32_t id) const { return fused_programs_[static_cast<std::size_t>(id)]; }

  /// Raises "[op] message" naming the node; used by ops when validating.
  template <class... P>
  [[noreturn]] void fail_at(GVar v, const char* op, const P&... parts) const {
    detail::fail(op, parts..., " (node ", v.index, ")");
  }

 private:
  DType autocast_ = DType::f32;  // set_autocast
  DType float_dtype_ = DType::f32;
  bool float_dtype_set_ = false, float_dtype_seen_ = false;
  /// Leaves tell the tape its float dtype, until one has (or set_float_dtype did).
  void see_leaf_dtype(DType t) {
    if (float_dtype_set_ || float_dtype_seen_ || (t != DType::f32 && t != DType::f64)) return;
    float_dtype_ = t;
    float_dtype_seen_ = true;
  }
  Node<B>& push(LeafKind k) {
    nodes_.emplace_back();
    nodes_.back().pos = static_cast<std::int32_t>(nodes_.size() - 1);
    nodes_.back().leaf = k;
    nodes_.back().scope = scope_stack_.empty() ? -1 : scope_stack_.back();
    nodes_.back().segment = open_segment_;
    return nodes_.back();
  }
  GVar handle() const { return GVar{this, static_cast<std::int32_t>(nodes_.size() - 1)}; }
  void check(GVar v) const {
    if (v.tape != this)
      detail::fail("tape", v.tape ? "the variable belongs to another tape" : "the variable is empty (default GVar)");
    if (v.index < 0 || static_cast<std::size_t>(v.index) >= nodes_.size())
      detail::fail("tape", "variable index ", v.index, " is out of range (", nodes_.size(), " nodes)");
  }
  static void check_leaf(const Tensor& t, const char* what) {
    if (!t.defined()) detail::fail(what, "cannot register an empty tensor");
    if (t.device() != B::device)
      detail::fail(what, "tensor ", t.shape().str(), " lives on ", t.device(), " but this tape runs on ", B::name);
  }
  static void ensure_grad(Node<B>& n) {
    if (!n.grad.defined()) n.grad = B::alloc(n.value.shape(), n.value.dtype());
  }
  void begin_backward(Node<B>& out) {
    if (!out.requires_grad)
      detail::fail("backward", "the output does not depend on any trainable parameter or input");
    for (auto& n : nodes_) n.grad_live = false;
    ensure_grad(out);
    out.grad_live = true;
  }
  void sweep(std::int32_t from) {
    if (open_segment_ >= 0) detail::fail("backward", "a checkpoint segment is still open (end_segment was not called)");
    require_materialised("backward");
    loss_ = nodes_[static_cast<std::size_t>(from)].value.numel() == 1 ? from : -1;
    // Entering a checkpoint segment (from above) recomputes its intermediates into the pool;
    // leaving it hands the pool back (after any gradient buffers its vjps made are parked there).
    std::int32_t active = -1;
    for (std::int32_t i = from; i >= 0; --i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.segment != active) {
        if (active >= 0) park(active);
        active = n.segment;
        if (active >= 0) recompute(active);
      }
      if (n.def && n.requires_grad && n.grad_live) {
        n.def->vjp(*this, n);
        if (anomaly_) check_grads(i);
      }
    }
    if (active >= 0) park(active);
  }

  // ---- anomaly mode ------------------------------------------------------------------------

  // A leaf is checked as it is bound; a failing one leaves the tape as it was.
  GVar checked_leaf() {
    if (anomaly_) {
      try {
        check_value(static_cast<std::int32_t>(nodes_.size() - 1));
      } catch (...) {
        if (nodes_.back().leaf == LeafKind::param) params_.pop_back();
        nodes_.pop_back();
        throw;
      }
    }
    return handle();
  }
  void check_value(std::int32_t i) {
    const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
    if (!detail::all_finite(n.value)) report(i, n.value, n.def ? "forward produced" : "its value holds");
  }
  // After node i's vjp: the gradient it wrote into each input (each earlier contribution was
  // checked when it was written, so a bad element now comes from this vjp).
  void check_grads(std::int32_t i) {
    const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      if (!needs_grad(n, k)) continue;
      const Node<B>& in = nodes_[static_cast<std::size_t>(n.inputs[k])];
      if (!detail::all_finite(in.grad))
        report(i, in.grad, ("backward (vjp) wrote into the gradient of input " + std::to_string(k) + " (node " +
                            std::to_string(n.inputs[k]) + ", " + in.name() + ")")
                               .c_str());
    }
  }
  // "[anomaly] softmax (node 7, in 'layers.0.self_attn', inputs (2, 3) float32): forward produced
  // NaN at [1, 2] (element 5) of (2, 3) float32"
  [[noreturn]] void report(std::int32_t i, const Tensor& bad, const char* what) const {
    const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
    std::ostringstream os;
    os << n.name();
    if (n.def && n.def->kernel) os << ' ' << n.def->kernel(n);  // "unary log"
    os << " (node " << i;
    if (n.scope >= 0) os << ", in '" << scope_paths_[static_cast<std::size_t>(n.scope)] << "'";
    if (!n.inputs.empty()) {
      os << ", inputs";
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        const Tensor& v = nodes_[static_cast<std::size_t>(n.inputs[k])].value;
        os << (k ? ", " : " ") << v.shape().str() << ' ' << dtype_name(v.dtype());
      }
    }
    os << "): " << what << ' ' << detail::first_nonfinite(bad) << " of " << bad.shape().str() << ' '
       << dtype_name(bad.dtype());
    detail::fail("anomaly", os.str());
  }

  // ---- memory planning -----------------------------------------------------------------------

  // A deferred node's value: a view of one block that is never written (so never resident).
  Tensor placeholder(const Shape& s, DType t) {
    const std::size_t bytes = std::max<std::size_t>(static_cast<std::size_t>(s.numel()) * dtype_size(t), 1);
    if (!placeholder_.defined() || placeholder_.storage_bytes() < bytes)
      placeholder_ = B::alloc(Shape{static_cast<std::int64_t>(bytes)}, DType::u8);
    return placeholder_.view_as(s, t);
  }
  void require_materialised(const char* op) const {
    if (deferred_count_ > 0)
      detail::fail(op, deferred_count_, " nodes were recorded with their kernels deferred and have no buffers yet: "
                   "call plan_memory() first");
  }
  // Whether node j's vjp reads input k's data (true for k past the mask's bits).
  static bool mask_reads(std::uint32_t mask, std::size_t k) {
    return k >= 31 || (mask & vjp_reads_input(static_cast<int>(k))) != 0;
  }
  // plan_memory's placement. Time runs over the replay: node i's forward at step i, then (when
  // out is a loss) its vjp at step 2N - 1 - i, since the sweep visits nodes in reverse. Step t
  // has a read phase 2t and a write phase 2t + 1, and an ordinary use holds a buffer over both,
  // so an op never gets its output (or the gradients it writes) over a buffer it reads. A vjp
  // that writes input k's gradient over k's value (OpDef::vjp_overwrites) reads that value in
  // phase 2t only and writes the gradient from 2t + 1: the two may share a block. Buffers are
  // placed largest first into the first block whose members' intervals all miss it (a block is
  // as large as its largest buffer).
  void plan_blocks(std::int32_t out) {
    const std::int64_t N = static_cast<std::int64_t>(nodes_.size());
    const bool bwd = loss_ >= 0;
    auto at_vjp = [&](std::int64_t i) { return 2 * N - 1 - i; };
    constexpr std::int64_t kNever = -1;
    std::vector<std::int32_t> root(static_cast<std::size_t>(N));  // whose buffer a value is (views: their input's)
    std::vector<std::int64_t> last(static_cast<std::size_t>(N), kNever), first_grad(static_cast<std::size_t>(N), kNever);
    auto runs_vjp = [&](const Node<B>& n, std::int64_t i) { return bwd && n.def && n.requires_grad && i <= loss_; };
    for (std::int64_t i = 0; i < N; ++i) {
      const Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      const std::size_t u = static_cast<std::size_t>(i);
      root[u] = n.def && n.def->aliases_input ? root[static_cast<std::size_t>(n.inputs[0])] : static_cast<std::int32_t>(i);
      last[u] = 2 * i + 1;
      if (!n.def) continue;
      const std::uint32_t mask = n.def->vjp_reads ? n.def->vjp_reads(*this, n) : ~0u;
      const std::int64_t v = 2 * at_vjp(i);
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        std::int64_t& l = last[static_cast<std::size_t>(root[static_cast<std::size_t>(n.inputs[k])])];
        l = std::max(l, 2 * i + 1);  // its forward reads it
        if (runs_vjp(n, i) && mask_reads(mask, k))  // and so may its vjp
          l = std::max(l, n.def->vjp_overwrites == static_cast<int>(k) ? v : v + 1);
      }
      if (runs_vjp(n, i) && (mask & kVjpReadsOutput)) {
        std::int64_t& l = last[static_cast<std::size_t>(root[u])];
        l = std::max(l, v + 1);
      }
      if (n.pooled && bwd) {  // the sweep runs it forward again on entering its segment (from the top)
        const Segment& sg = segments_[static_cast<std::size_t>(n.segment)];
        const std::int64_t enter = 2 * at_vjp(std::min<std::int64_t>(sg.end - 1, loss_)) + 1;
        for (std::int32_t in : n.inputs) {
          std::int64_t& l = last[static_cast<std::size_t>(root[static_cast<std::size_t>(in)])];
          l = std::max(l, enter);
        }
      }
    }
    // A gradient is first written by the vjp of its last consumer (the sweep runs in reverse).
    for (std::int64_t j = N - 1; j >= 0; --j) {
      const Node<B>& n = nodes_[static_cast<std::size_t>(j)];
      if (!runs_vjp(n, j)) continue;
      for (std::size_t k = 0; k < n.inputs.size(); ++k) {
        const std::size_t in = static_cast<std::size_t>(n.inputs[k]);
        if (nodes_[in].requires_grad && first_grad[in] == kNever)
          first_grad[in] = 2 * at_vjp(j) + (n.def->vjp_overwrites == static_cast<int>(k) ? 1 : 0);
      }
    }
    struct Buf {
      Tensor* t;
      std::size_t bytes;
      std::int64_t begin, end;
      std::int32_t node;
    };
    std::vector<Buf> bufs;
    const std::int32_t out_root = root[static_cast<std::size_t>(out)];
    for (std::int64_t i = 0; i < N; ++i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (!n.def || i == out || n.pooled || nodes_[static_cast<std::size_t>(root[static_cast<std::size_t>(i)])].pooled) continue;
      const std::size_t bytes = static_cast<std::size_t>(n.value.numel()) * dtype_size(n.value.dtype());
      const std::int32_t r = root[static_cast<std::size_t>(i)];
      if (!n.def->aliases_input && i != out_root)
        bufs.push_back({&n.value, bytes, 2 * i, last[static_cast<std::size_t>(i)], static_cast<std::int32_t>(i)});
      if (bwd && n.requires_grad && i <= loss_ && r != out_root) {
        const std::int64_t f = first_grad[static_cast<std::size_t>(i)];
        bufs.push_back({&n.grad, bytes, f == kNever ? 2 * at_vjp(i) : f, 2 * at_vjp(i) + 1, static_cast<std::int32_t>(i)});
      }
      if (r != out_root && nodes_[static_cast<std::size_t>(r)].def) n.planned = true;
    }
    std::stable_sort(bufs.begin(), bufs.end(), [](const Buf& a, const Buf& b) { return a.bytes > b.bytes; });
    std::vector<std::vector<std::pair<std::int64_t, std::int64_t>>> lives;  // per block: its buffers' intervals
    for (const Buf& b : bufs) {
      std::size_t k = 0;
      for (; k < lives.size(); ++k) {
        bool free = true;
        for (const auto& [s, e] : lives[k])
          if (b.begin <= e && s <= b.end) {
            free = false;
            break;
          }
        if (free) break;
      }
      if (k == lives.size()) {
        lives.emplace_back();
        blocks_.push_back(B::alloc(Shape{static_cast<std::int64_t>(std::max<std::size_t>(b.bytes, 1))}, DType::u8));
      }
      lives[k].emplace_back(b.begin, b.end);
      const Node<B>& n = nodes_[static_cast<std::size_t>(b.node)];
      *b.t = blocks_[k].view_as(n.value.shape(), n.value.dtype());
    }
  }

  // ---- checkpoint segments -------------------------------------------------------------------

  struct Segment {
    std::int32_t begin, end;  // node range [begin, end)
    bool needs_grad = false;  // some pooled node wants a gradient: the sweep recomputes it
  };
  // Node v, which must not be a checkpointed intermediate (its buffers belong to the pool).
  const Node<B>& unpooled(GVar v, const char* op, bool deferred_ok = false) const {
    const Node<B>& n = node(v);
    if (n.pooled)
      detail::fail(op, "node ", v.index, " (", n.name(), ", ", n.value.shape().str(),
                   ") is an intermediate of a checkpoint segment, whose values are freed after the forward "
                   "pass; return it from the segment to use it outside");
    if (n.planned)
      detail::fail(op, "node ", v.index, " (", n.name(), ", ", n.value.shape().str(),
                   ") is an intermediate of a memory-planned tape (a compiled step), whose buffers are shared "
                   "with others once their last use has run; read it from an eager tape, or compile with "
                   "plan_memory(false)");
    if (n.fused_into >= 0)
      detail::fail(op, "node ", v.index, " was fused into node ", n.fused_into,
                   " (nn::fuse_elementwise: its value is computed inside that node's loop and never stored); "
                   "read it from a tape that is not fused");
    if (n.deferred && !deferred_ok)
      detail::fail(op, "node ", v.index, " (", n.name(), ", ", n.value.shape().str(),
                   ") was recorded with its kernel deferred (a compiled step's recording): it has no value "
                   "until the tape is planned and replayed");
    return n;
  }
  // Lends segment s's pooled buffers to the pool: value (not for a view), gradient, then saved,
  // each a view of pool block j for the next j. A buffer already on its block stays, so from the
  // second call on (a replay) nothing moves or allocates. What a buffer held is not kept.
  void park(std::int32_t s) {
    const Segment& sg = segments_[static_cast<std::size_t>(s)];
    std::size_t j = 0;
    auto lend = [&](Tensor& t, const Shape& shape, DType dt) {
      if (pool_.size() <= j) pool_.resize(j + 1);
      Tensor& block = pool_[j++];
      const std::size_t bytes = std::max<std::size_t>(static_cast<std::size_t>(shape.numel()) * dtype_size(dt), 1);
      if (!block.defined() || block.storage_bytes() < bytes)
        block = B::alloc(Shape{static_cast<std::int64_t>(bytes)}, DType::u8);
      if (!t.shares_storage(block)) t = block.view_as(shape, dt);
    };
    for (int pass = 0; pass < 2; ++pass)
      for (std::int32_t i = sg.begin; i < sg.end; ++i) {
        Node<B>& n = nodes_[static_cast<std::size_t>(i)];
        if (!n.pooled) continue;
        if (pass == 0) {
          if (!n.def->aliases_input) lend(n.value, n.value.shape(), n.value.dtype());
          if (n.requires_grad) lend(n.grad, n.value.shape(), n.value.dtype());  // made here, never by ensure_grad
        } else {
          for (Tensor& t : n.saved)
            if (t.defined()) lend(t, t.shape(), t.dtype());
        }
      }
    for (std::int32_t i = sg.begin; i < sg.end; ++i) {  // views follow their input onto its block
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.pooled && n.def->aliases_input) n.def->forward(*this, n);
    }
  }
  // Runs segment s's pooled nodes forward again, into their pool views.
  void recompute(std::int32_t s) {
    const Segment& sg = segments_[static_cast<std::size_t>(s)];
    if (!sg.needs_grad || sg.end < 0) return;
    for (std::int32_t i = sg.begin; i < sg.end; ++i) {
      Node<B>& n = nodes_[static_cast<std::size_t>(i)];
      if (n.pooled) n.def->forward(*this, n);
    }
  }

  // A deque, not a vector: appending a node never moves the others, so a `const Tensor&` from
  // value() or grad() stays valid while more ops are recorded.
  std::deque<Node<B>> nodes_;
  std::vector<std::int32_t> params_;  // indices of param leaves, to find a re-bound tensor
  std::vector<std::int32_t> key_slots_;  // random_key() slots, refilled in order by refresh_keys()
  std::int32_t loss_ = -1;
  bool anomaly_ = false;                   // detect_anomaly
  std::vector<std::string> scope_paths_;   // every scope() opened since clear(), by id
  std::vector<std::int32_t> scope_stack_;  // the open scopes' ids, innermost last
  std::vector<Segment> segments_;          // checkpoint segments, in recording order
  std::vector<Tensor> pool_;               // the blocks pooled nodes' buffers view, by park()'s order
  std::int32_t open_segment_ = -1;         // the segment being recorded, or -1
  bool deferred_ = false;                  // defer_kernels
  std::int64_t deferred_count_ = 0;        // nodes recorded deferred and not yet given a buffer
  Tensor placeholder_;                     // what deferred nodes' values view (never written)
  std::vector<Tensor> blocks_;             // plan_memory's shared blocks
  std::deque<FusedProgram> fused_programs_;  // the fusion pass's programs, by id
};

}  // namespace nn
// ---- end nn/tape.hpp ----
// ---- begin nn/grad_checkpoint.hpp ----
// Gradient checkpointing (activation recomputation): nn::checkpoint records a segment of ops whose
// intermediate values are not kept after the forward pass; the backward sweep runs the segment
// forward again when it reaches it (torch.utils.checkpoint, mlx-lm's --grad-checkpoint).
//
// How it works on the tape (tape.hpp, "checkpoint segments"): the segment's ops are ordinary
// nodes. When it closes, every op node but its outputs becomes "pooled": its value, gradient and
// saved buffers become views of a pool of blocks that all segments share, so the tape holds one
// segment's intermediates at a time instead of every segment's. Entering the segment in the
// backward sweep recomputes those nodes into the pool, their vjps run as without checkpointing,
// and leaving it hands the pool to the next segment. Parameters bound inside the segment are
// leaves, never pooled, so their gradients (LoRA adapters over a frozen or quantized base
// included) are accumulated exactly as without it: the results are bitwise equal. A compiled step
// replays the recomputation into the same pool, allocating nothing.

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>


namespace nn {

namespace detail {
inline void segment_outputs(std::vector<GVar>& out, GVar v) { out.push_back(v); }
inline void segment_outputs(std::vector<GVar>& out, const std::vector<GVar>& vs) { out.insert(out.end(), vs.begin(), vs.end()); }
template <class T>
  requires requires(const T& t) { std::tuple_size<T>::value; }
void segment_outputs(std::vector<GVar>& out, const T& t) {  // std::pair, std::tuple, std::array of GVars
  std::apply([&](const auto&... v) { (segment_outputs(out, v), ...); }, t);
}
}  // namespace detail

/// Records f(args...) -- ops on `tp`, returning a GVar, a std::vector<GVar> or a pair/tuple/array
/// of them -- as a checkpoint segment, and returns what f returned. Only the returned values stay
/// readable; the segment's other intermediates are freed after the forward pass and recomputed
/// by the backward sweep, which costs one more forward of the segment per backward. f must be a
/// function of values recorded before it (its arguments, or GVars it captures) and of parameters,
/// and must record the same ops when run again (dropout does: its key is an input slot).
///   x = nn::checkpoint(tp, [&](GVar h) { return layer(tp, h); }, x);
/// Using an intermediate of the segment after it is an nn::Error naming the node; segments do not
/// nest. If f throws, the segment is closed without checkpointing and the exception propagates.
template <class B, class F, class... A>
auto checkpoint(GTape<B>& tp, F&& f, A&&... args) {
  static_assert(std::is_invocable_v<F, A...>, "nn::checkpoint(tp, f, args...) calls f(args...)");
  tp.begin_segment();
  try {
    auto out = std::invoke(std::forward<F>(f), std::forward<A>(args)...);
    std::vector<GVar> outs;
    detail::segment_outputs(outs, out);
    tp.end_segment(outs);
    return out;
  } catch (...) {
    tp.abandon_segment();
    throw;
  }
}

}  // namespace nn
// ---- end nn/grad_checkpoint.hpp ----
// ---- begin nn/ops/common.hpp ----
// Validation shared by every primitive: dtype and shape checks whose errors name the op and the
// shapes, and NumPy broadcasting of shapes.


namespace nn::detail {

/// The attributes a primitive recorded on node n (its own struct, e.g. UnaryAttrs).
template <class A, class B>
const A& attrs_of(const Node<B>& n) {
  return n.attrs.template get<A>();
}

template <class B>
void require_float(const GTape<B>& tp, GVar x, const char* op) {
  DType t = tp.dtype(x);
  if (t != DType::f32 && t != DType::f64)
    fail(op, "needs float32 or float64, got ", dtype_name(t), " ", tp.shape(x).str());
}

template <class B>
void require_same_dtype(const GTape<B>& tp, GVar a, GVar b, const char* op) {
  require_float(tp, a, op);
  if (tp.dtype(a) != tp.dtype(b))
    fail(op, "dtype mismatch: ", dtype_name(tp.dtype(a)), " ", tp.shape(a).str(), " vs ", dtype_name(tp.dtype(b)),
         " ", tp.shape(b).str());
}

/// Precision::bf16: `w` is a weight stored in bfloat16 beside float32 activations `x`, which the
/// products (matmul's right operand) and the embedding lookup read directly. Such a weight must be
/// frozen: bf16 is a storage type here, and what trains stays float32.
template <class B>
void require_frozen_bf16(const GTape<B>& tp, GVar w, const char* op, const char* what) {
  if (tp.requires_grad(w))
    fail(op, "a bfloat16 ", what, " ", tp.shape(w).str(), " must be frozen (bf16 stores frozen weights; what ",
         "trains stays float32)");
}
template <class B>
bool bf16_weight(const GTape<B>& tp, GVar x, GVar w, const char* op) {
  if (tp.dtype(w) != DType::bf16 || tp.dtype(x) != DType::f32) return false;
  require_frozen_bf16(tp, w, op, "weight");
  return true;
}

/// The broadcast of two shapes (NumPy rules, aligned right), or an error naming both.
inline Shape broadcast_shapes(const Shape& a, const Shape& b, const char* op) {
  const int r = std::max(a.rank(), b.rank());
  std::vector<std::int64_t> out(static_cast<std::size_t>(r));
  for (int i = 0; i < r; ++i) {
    std::int64_t da = i < r - a.rank() ? 1 : a[i - (r - a.rank())];
    std::int64_t db = i < r - b.rank() ? 1 : b[i - (r - b.rank())];
    if (da != db && da != 1 && db != 1)
      fail(op, "shapes ", a.str(), " and ", b.str(), " cannot broadcast (dim ", i, ": ", da, " vs ", db, ")");
    out[static_cast<std::size_t>(i)] = da == 1 ? db : da;
  }
  return Shape(out);
}

/// A possibly negative axis of `s`, normalised; out of range raises "[op] axis a out of range for
/// shape (...)" naming the op (Shape::axis would name only "shape").
inline int op_axis(const Shape& s, int axis, const char* op) {
  const int a = axis < 0 ? axis + s.rank() : axis;
  if (a < 0 || a >= s.rank()) fail(op, "axis ", axis, " out of range for shape ", s.str());
  return a;
}

/// True when `from` broadcasts to exactly `to`.
inline bool broadcasts_to(const Shape& from, const Shape& to) {
  if (from.rank() > to.rank()) return false;
  for (int i = 1; i <= from.rank(); ++i) {
    std::int64_t f = from[from.rank() - i], t = to[to.rank() - i];
    if (f != t && f != 1) return false;
  }
  return true;
}

}  // namespace nn::detail
// ---- end nn/ops/common.hpp ----
// ---- begin nn/ops/elementwise.hpp ----
// Elementwise primitives: unary math (the derivative of each sits beside its forward in the
// backend's unary_f / unary_df), broadcasting binary arithmetic, where, stop_gradient.


namespace nn {

/// A unary primitive's kernel and its scalar (pow's exponent, scale's factor; unused else).
struct UnaryAttrs {
  Unary op;
  double arg;
};
/// A binary primitive's kernel.
struct BinaryAttrs {
  Binary op;
};

namespace detail {

template <class B>
struct UnaryPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<UnaryAttrs>(n);
    B::unary(a.op, a.arg, tp.in(n, 0), n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<UnaryAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    B::unary_vjp(a.op, a.arg, tp.in(n, 0), n.value, n.grad, s.g, s.acc);
  }
  static const char* kernel(const Node<B>& n) { return unary_name(attrs_of<UnaryAttrs>(n).op); }
  static std::uint32_t vjp_reads(const GTape<B>&, const Node<B>& n) {
    const unsigned r = unary_df_reads(attrs_of<UnaryAttrs>(n).op);
    return ((r & 1) ? vjp_reads_input(0) : 0u) | ((r & 2) ? kVjpReadsOutput : 0u);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> UnaryPrim<B>::def{.prim = Prim::unary, .forward = &forward, .vjp = &vjp, .kernel = &kernel, .vjp_reads = &vjp_reads};

/// a op b with broadcasting. Each input's gradient is formed at the output's shape, then reduced
/// to the input's shape by the tape's accumulate_reduced (the one place that sums broadcasts).
template <class B>
struct BinaryPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    B::binary(attrs_of<BinaryAttrs>(n).op, tp.in(n, 0), tp.in(n, 1), n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const Binary op = attrs_of<BinaryAttrs>(n).op;
    const Tensor &a = tp.in(n, 0), &b = tp.in(n, 1);
    for (std::size_t k = 0; k < 2; ++k) {
      if (!tp.needs_grad(n, k)) continue;
      if (tp.in(n, k).shape() == n.value.shape()) {
        GradSlot s = tp.grad_slot(n, k);
        B::binary_vjp(op, static_cast<int>(k), a, b, n.grad, s.g, s.acc);
      } else {
        Tensor& full = tp.scratch(n, k, n.value.shape(), n.value.dtype());
        B::binary_vjp(op, static_cast<int>(k), a, b, n.grad, full, false);
        tp.accumulate_reduced(n, k, full);
      }
    }
  }
  static const char* kernel(const Node<B>& n) { return binary_name(attrs_of<BinaryAttrs>(n).op); }
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    unsigned r = 0;
    for (int k = 0; k < 2; ++k)
      if (tp.needs_grad(n, static_cast<std::size_t>(k))) r |= binary_df_reads(attrs_of<BinaryAttrs>(n).op, k);
    return r;  // bit 0 a (input 0), bit 1 b (input 1)
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> BinaryPrim<B>::def{.prim = Prim::binary, .forward = &forward, .vjp = &vjp, .kernel = &kernel, .vjp_reads = &vjp_reads};

/// where(mask, a, b): inputs 0 mask, 1 a, 2 b.
template <class B>
struct WherePrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::where(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.value); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    for (std::size_t k = 1; k < 3; ++k) {
      if (!tp.needs_grad(n, k)) continue;
      if (tp.in(n, k).shape() == n.value.shape()) {
        GradSlot s = tp.grad_slot(n, k);
        B::where_vjp(tp.in(n, 0), n.grad, static_cast<int>(k - 1), s.g, s.acc);
      } else {
        Tensor& full = tp.scratch(n, k, n.value.shape(), n.value.dtype());
        B::where_vjp(tp.in(n, 0), n.grad, static_cast<int>(k - 1), full, false);
        tp.accumulate_reduced(n, k, full);
      }
    }
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> WherePrim<B>::def{.prim = Prim::where, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 1u>};

/// A copy that the backward sweep does not cross.
template <class B>
struct StopGradientPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::copy(tp.in(n, 0), n.value, false); }
  static void vjp(GTape<B>&, Node<B>&) {}
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> StopGradientPrim<B>::def{.prim = Prim::stop_gradient, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

}  // namespace detail

/// y = f(x) for a Unary kernel; `arg` is its scalar (pow's exponent, scale's factor).
template <class B>
GVar unary(GTape<B>& tp, Unary op, GVar x, double arg = 0.0) {
  detail::require_float(tp, x, unary_name(op));
  GVar in[] = {x};
  return tp.record(detail::UnaryPrim<B>::def, in, UnaryAttrs{op, arg}, tp.shape(x), tp.dtype(x));
}

// clang-format off
template <class B> GVar neg(GTape<B>& tp, GVar x) { return unary(tp, Unary::neg, x); }
template <class B> GVar exp(GTape<B>& tp, GVar x) { return unary(tp, Unary::exp, x); }
template <class B> GVar log(GTape<B>& tp, GVar x) { return unary(tp, Unary::log, x); }
template <class B> GVar sqrt(GTape<B>& tp, GVar x) { return unary(tp, Unary::sqrt, x); }
template <class B> GVar rsqrt(GTape<B>& tp, GVar x) { return unary(tp, Unary::rsqrt, x); }
template <class B> GVar tanh(GTape<B>& tp, GVar x) { return unary(tp, Unary::tanh, x); }
template <class B> GVar sigmoid(GTape<B>& tp, GVar x) { return unary(tp, Unary::sigmoid, x); }
/// relu'(0) = 0, as PyTorch.
template <class B> GVar relu(GTape<B>& tp, GVar x) { return unary(tp, Unary::relu, x); }
/// abs'(0) = 0 (sign(0)), as PyTorch.
template <class B> GVar abs(GTape<B>& tp, GVar x) { return unary(tp, Unary::abs, x); }
/// x^p for a scalar exponent p.
template <class B> GVar pow(GTape<B>& tp, GVar x, double p) { return unary(tp, Unary::pow, x, p); }
/// s * x for a scalar s.
template <class B> GVar scale(GTape<B>& tp, GVar x, double s) { return unary(tp, Unary::scale, x, s); }
/// x + c for a scalar c.
template <class B> GVar add_scalar(GTape<B>& tp, GVar x, double c) { return unary(tp, Unary::add_scalar, x, c); }
// clang-format on

/// a op b with NumPy broadcasting (scalars, trailing dims, any dim of size 1).
template <class B>
GVar binary(GTape<B>& tp, Binary op, GVar a, GVar b) {
  detail::require_same_dtype(tp, a, b, binary_name(op));
  Shape out = detail::broadcast_shapes(tp.shape(a), tp.shape(b), binary_name(op));
  GVar in[] = {a, b};
  return tp.record(detail::BinaryPrim<B>::def, in, BinaryAttrs{op}, out, tp.dtype(a));
}

// clang-format off
template <class B> GVar add(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::add, a, b); }
template <class B> GVar sub(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::sub, a, b); }
template <class B> GVar mul(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::mul, a, b); }
template <class B> GVar div(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::div, a, b); }
/// Elementwise maximum; at a tie the gradient goes to a.
template <class B> GVar maximum(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::maximum, a, b); }
/// Elementwise minimum; at a tie the gradient goes to a.
template <class B> GVar minimum(GTape<B>& tp, GVar a, GVar b) { return binary(tp, Binary::minimum, a, b); }
// clang-format on

/// mask != 0 ? a : b, all three broadcast together. The mask (u8, i32 or the float dtype) gets
/// no gradient; each branch gets the cotangent where it was selected and zero elsewhere.
template <class B>
GVar where(GTape<B>& tp, GVar mask, GVar a, GVar b) {
  detail::require_same_dtype(tp, a, b, "where");
  Shape out = detail::broadcast_shapes(detail::broadcast_shapes(tp.shape(mask), tp.shape(a), "where"), tp.shape(b), "where");
  GVar in[] = {mask, a, b};
  return tp.record(detail::WherePrim<B>::def, in, NoAttrs{}, out, tp.dtype(a));
}

/// x in the forward pass; no gradient flows back through it.
template <class B>
GVar stop_gradient(GTape<B>& tp, GVar x) {
  GVar in[] = {x};
  GVar y = tp.record(detail::StopGradientPrim<B>::def, in, NoAttrs{}, tp.shape(x), tp.dtype(x));
  tp.node(y).requires_grad = false;
  return y;
}

}  // namespace nn
// ---- end nn/ops/elementwise.hpp ----
// ---- begin nn/ops/reduce.hpp ----
// Reductions: sum and mean over axes (or all), keepdims or not; max over one axis.

#include <algorithm>
#include <span>


namespace nn {

/// sum / mean: the keepdims shape, and the scale (1, or 1/count for the mean).
struct SumAttrs {
  Shape keep;
  double scale;
};
/// max: the axis, and the keepdims shape.
struct MaxAttrs {
  int axis;
  Shape keep;
};

namespace detail {

/// sum / mean (SumAttrs).
template <class B>
struct SumPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SumAttrs>(n);
    Tensor y = n.value.reshape(a.keep);
    B::sum_to(tp.in(n, 0), y, a.scale, false);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SumAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    B::broadcast_to(n.grad.reshape(a.keep), s.g, a.scale, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SumPrim<B>::def{.prim = Prim::sum, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// max over one axis (MaxAttrs); saved[0] holds the argmax (i32, keepdims shape).
template <class B>
struct MaxPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<MaxAttrs>(n);
    Tensor& idx = tp.scratch(n, 0, a.keep, DType::i32);
    Tensor y = n.value.reshape(a.keep);
    B::max_axis(tp.in(n, 0), a.axis, y, idx);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<MaxAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    B::max_axis_vjp(n.grad.reshape(a.keep), n.saved[0], a.axis, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> MaxPrim<B>::def{.prim = Prim::max, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// Normalised, sorted, de-duplicated axes; an empty list means every axis.
inline std::vector<int> norm_axes(const Shape& s, std::span<const int> axes, const char* op) {
  std::vector<int> out;
  if (axes.size() == 0) {
    for (int i = 0; i < s.rank(); ++i) out.push_back(i);
    return out;
  }
  for (int a : axes) {
    int n = a < 0 ? a + s.rank() : a;
    if (n < 0 || n >= s.rank()) fail(op, "axis ", a, " out of range for shape ", s.str());
    out.push_back(n);
  }
  std::sort(out.begin(), out.end());
  out.erase(std::unique(out.begin(), out.end()), out.end());
  return out;
}

template <class B>
GVar reduce_sum(GTape<B>& tp, GVar x, std::span<const int> axes, bool keepdims, bool mean, const char* op) {
  require_float(tp, x, op);
  const Shape& s = tp.shape(x);
  std::vector<int> ax = norm_axes(s, axes, op);
  Shape keep, out;
  std::int64_t count = 1;
  for (int i = 0; i < s.rank(); ++i) {
    bool red = std::find(ax.begin(), ax.end(), i) != ax.end();
    keep.push_back(red ? 1 : s[i]);
    if (red) count *= s[i];
    else out.push_back(s[i]);
  }
  const SumAttrs a{keep, mean ? 1.0 / static_cast<double>(count) : 1.0};
  if (mean && count == 0) fail(op, "mean over an empty axis of shape ", s.str());
  GVar in[] = {x};
  return tp.record(SumPrim<B>::def, in, a, keepdims ? keep : out, tp.dtype(x));
}

}  // namespace detail

/// Sum over `axes` (all axes when empty); keepdims keeps reduced axes as size 1.
template <class B>
GVar sum(GTape<B>& tp, GVar x, std::span<const int> axes, bool keepdims = false) {
  return detail::reduce_sum(tp, x, axes, keepdims, false, "sum");
}
template <class B>
GVar sum(GTape<B>& tp, GVar x, std::initializer_list<int> axes = {}, bool keepdims = false) {
  return sum(tp, x, std::span<const int>(axes.begin(), axes.size()), keepdims);
}
/// Mean over `axes` (all axes when empty).
template <class B>
GVar mean(GTape<B>& tp, GVar x, std::span<const int> axes, bool keepdims = false) {
  return detail::reduce_sum(tp, x, axes, keepdims, true, "mean");
}
template <class B>
GVar mean(GTape<B>& tp, GVar x, std::initializer_list<int> axes = {}, bool keepdims = false) {
  return mean(tp, x, std::span<const int>(axes.begin(), axes.size()), keepdims);
}

/// Max over one axis. Ties: the gradient goes to the first index attaining the max (NumPy's
/// argmax); PyTorch's amax splits it evenly, its max(dim) picks one index as we do.
template <class B>
GVar max(GTape<B>& tp, GVar x, int axis, bool keepdims = false) {
  detail::require_float(tp, x, "max");
  const Shape& s = tp.shape(x);
  if (s.rank() == 0) detail::fail("max", "needs at least one axis, got a scalar");
  int ax = detail::op_axis(s, axis, "max");
  if (s[ax] == 0) detail::fail("max", "axis ", axis, " of shape ", s.str(), " is empty");
  Shape keep, out;
  for (int i = 0; i < s.rank(); ++i) {
    keep.push_back(i == ax ? 1 : s[i]);
    if (i != ax) out.push_back(s[i]);
  }
  const MaxAttrs a{ax, keep};
  GVar in[] = {x};
  return tp.record(detail::MaxPrim<B>::def, in, a, keepdims ? keep : out, tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/reduce.hpp ----
// ---- begin nn/ops/matmul.hpp ----
// matmul: batched over leading dims, either operand read transposed without a copy.


namespace nn {

/// matmul's flags: A and/or B read transposed; autocast (GTape::set_autocast): the product and
/// its vjp on bf16-rounded operands with f32 accumulation.
struct MatmulAttrs {
  bool trans_a, trans_b, autocast;
};

namespace detail {

/// C = op(A) @ op(B) (MatmulAttrs). When B is a matrix shared by a batched A
/// (x @ W^T, the Linear case), A's batch folds into its rows so every product is one GEMM.
/// Autocast: the forward product, dA and dB on bf16-rounded
/// operands with f32 accumulation (B::matmul_bf16), as torch.autocast's backward runs them.
template <class B>
struct MatmulPrim {
  static void mm(const Node<B>& n, const Tensor& a, bool ta, const Tensor& b, bool tb, Tensor& c, bool acc) {
    if constexpr (requires { B::bf16_weights; })
      if (attrs_of<MatmulAttrs>(n).autocast) return B::matmul_bf16(a, ta, b, tb, c, acc);
    B::matmul(a, ta, b, tb, c, acc);
  }

  // The views every kernel call uses: folded to 2-D when A is batched, B a matrix, A not transposed.
  static bool foldable(const Tensor& a, const Tensor& b, bool ta) { return a.rank() > 2 && b.rank() == 2 && !ta; }
  static Tensor rows(const Tensor& t) { return t.reshape(Shape{t.numel() / t.dim(-1), t.dim(-1)}); }

  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor &a = tp.in(n, 0), &b = tp.in(n, 1);
    const bool ta = attrs_of<MatmulAttrs>(n).trans_a, tb = attrs_of<MatmulAttrs>(n).trans_b;
    if (foldable(a, b, ta)) {
      Tensor c = rows(n.value);
      mm(n, rows(a), false, b, tb, c, false);
    } else {
      mm(n, a, ta, b, tb, n.value, false);
    }
  }

  // C = op(A) op(B):  dA = G op(B)^T  (or op(B) G^T when A is read transposed),
  //                   dB = op(A)^T G  (or G^T op(A) when B is read transposed).
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const Tensor &a = tp.in(n, 0), &b = tp.in(n, 1);
    const bool ta = attrs_of<MatmulAttrs>(n).trans_a, tb = attrs_of<MatmulAttrs>(n).trans_b;
    const bool fold = foldable(a, b, ta);
    const Tensor a2 = fold ? rows(a) : a;
    const Tensor g = fold ? rows(n.grad) : n.grad;
    if (tp.needs_grad(n, 0)) {
      GradSlot s = tp.grad_slot(n, 0);
      Tensor ga = fold ? rows(s.g) : s.g;
      if (!ta) mm(n, g, false, b, !tb, ga, s.acc);
      else mm(n, b, tb, g, true, ga, s.acc);
    }
    if (tp.needs_grad(n, 1)) {
      GradSlot s = tp.grad_slot(n, 1);
      if (!tb) mm(n, a2, !ta, g, false, s.g, s.acc);
      else mm(n, g, true, a2, ta, s.g, s.acc);
    }
  }
  // dA = g B^T reads B, dB = A^T g reads A: a frozen weight's product never keeps its input.
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    return (tp.needs_grad(n, 0) ? vjp_reads_input(1) : 0u) | (tp.needs_grad(n, 1) ? vjp_reads_input(0) : 0u);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> MatmulPrim<B>::def{.prim = Prim::matmul, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads};

}  // namespace detail

/// op(a) @ op(b) where op transposes the last two dims when its flag is set (read transposed,
/// never copied). a: (..., M, K) — or (..., K, M) with trans_a; b: (..., K, N) — or (..., N, K)
/// with trans_b. Leading (batch) dims must be equal, or one operand is a plain matrix shared by
/// every batch element. Result: (..., M, N).
/// b may be a frozen bfloat16 matrix beside a float32 a (Precision::bf16): the product then runs
/// on bf16 operands (a rounded) with f32 accumulation, and so does a's gradient (g op(b)^T).
/// Under GTape::set_autocast(DType::bf16) a float32 matrix b is rounded the same way, and both
/// gradients' products run on bf16-rounded operands too (f32 accumulation and results).
template <class B>
GVar matmul(GTape<B>& tp, GVar a, GVar b, bool trans_a = false, bool trans_b = false) {
  const Shape &sa = tp.shape(a), &sb = tp.shape(b);
  if (detail::bf16_weight(tp, a, b, "matmul")) {
    if constexpr (!requires { B::bf16_weights; })
      detail::fail("matmul", "this backend has no bf16 products (b is a bfloat16 ", sb.str(), ")");
    if (sb.rank() != 2 || trans_a)
      detail::fail("matmul", "a bfloat16 operand must be the right-hand matrix of a product with a untransposed, got ",
                   sa.str(), trans_a ? "^T" : "", " @ ", sb.str());
  } else {
    detail::require_same_dtype(tp, a, b, "matmul");
  }
  if (sa.rank() < 2 || sb.rank() < 2)
    detail::fail("matmul", "operands need rank >= 2, got ", sa.str(), " and ", sb.str());
  const std::int64_t M = trans_a ? sa.dim(-1) : sa.dim(-2), Ka = trans_a ? sa.dim(-2) : sa.dim(-1);
  const std::int64_t Kb = trans_b ? sb.dim(-1) : sb.dim(-2), N = trans_b ? sb.dim(-2) : sb.dim(-1);
  if (Ka != Kb)
    detail::fail("matmul", "inner dimensions differ: ", sa.str(), trans_a ? "^T" : "", " @ ", sb.str(),
                 trans_b ? "^T" : "", " (", Ka, " vs ", Kb, ")");
  Shape out;
  if (sa.rank() > 2 && sb.rank() > 2) {
    if (sa.rank() != sb.rank())
      detail::fail("matmul", "batch dims differ: ", sa.str(), " @ ", sb.str());
    for (int i = 0; i < sa.rank() - 2; ++i) {
      if (sa[i] != sb[i]) detail::fail("matmul", "batch dims differ: ", sa.str(), " @ ", sb.str());
      out.push_back(sa[i]);
    }
  } else {
    const Shape& batched = sa.rank() > 2 ? sa : sb;
    for (int i = 0; i < batched.rank() - 2; ++i) out.push_back(batched[i]);
  }
  out.push_back(M);
  out.push_back(N);
  MatmulAttrs at{trans_a, trans_b, false};
  // autocast: products whose right operand is a float32 matrix (a weight), as torch.autocast;
  // a transposed batched a would not fold into rows, so it keeps float32
  if constexpr (requires { B::bf16_weights; })
    at.autocast = tp.autocast() == DType::bf16 && tp.dtype(a) == DType::f32 && tp.dtype(b) == DType::f32 &&
              sb.rank() == 2 && !(sa.rank() > 2 && trans_a);
  GVar in[] = {a, b};
  return tp.record(detail::MatmulPrim<B>::def, in, at, out, tp.dtype(a));
}

}  // namespace nn
// ---- end nn/ops/matmul.hpp ----
// ---- begin nn/ops/shape.hpp ----
// Data movement: reshape (a view), permute / transpose, slice, concat, broadcast_to.

#include <span>
#include <vector>


namespace nn {

/// reshape's target shape (the node's output is a view, so the shape is kept here).
struct ReshapeAttrs {
  Shape shape;
};
/// permute's order: out.shape[i] = in.shape[perm[i]].
struct PermuteAttrs {
  std::array<int, kMaxRank> perm;
};
/// slice's axis and first index (its length is the output's).
struct SliceAttrs {
  int axis;
  std::int64_t start;
};
/// concat's axis.
struct ConcatAttrs {
  int axis;
};

namespace detail {

/// The output is a view of input 0 (re-taken on every forward, so a swapped input is seen).
template <class B>
struct ReshapePrim {
  static void forward(GTape<B>& tp, Node<B>& n) { n.value = tp.in(n, 0).reshape(attrs_of<ReshapeAttrs>(n).shape); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    GradSlot s = tp.grad_slot(n, 0);
    B::copy(n.grad, s.g, s.acc);  // same element order; only the shape differs
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> ReshapePrim<B>::def{.prim = Prim::reshape, .forward = &forward, .vjp = &vjp, .aliases_input = true, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct PermutePrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::permute(tp.in(n, 0), attrs_of<PermuteAttrs>(n).perm, n.value, false); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& perm = attrs_of<PermuteAttrs>(n).perm;
    std::array<int, kMaxRank> inv{};
    for (int i = 0; i < n.value.rank(); ++i) inv[static_cast<std::size_t>(perm[static_cast<std::size_t>(i)])] = i;
    GradSlot s = tp.grad_slot(n, 0);
    B::permute(n.grad, inv, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> PermutePrim<B>::def{.prim = Prim::permute, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct SlicePrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SliceAttrs>(n);
    B::slice_copy(tp.in(n, 0), a.axis, a.start, n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<SliceAttrs>(n);
    GradSlot s = tp.grad_slot(n, 0);
    if (!s.acc) B::fill(s.g, 0.0);
    B::slice_scatter(n.grad, a.axis, a.start, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SlicePrim<B>::def{.prim = Prim::slice, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct ConcatPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    std::int64_t at = 0;
    const int axis = attrs_of<ConcatAttrs>(n).axis;
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      const Tensor& x = tp.in(n, k);
      B::slice_scatter(x, axis, at, n.value, false);
      at += x.shape()[axis];
    }
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    std::int64_t at = 0;
    const int axis = attrs_of<ConcatAttrs>(n).axis;
    for (std::size_t k = 0; k < n.inputs.size(); ++k) {
      const Shape& s = tp.in(n, k).shape();
      if (tp.needs_grad(n, k)) {
        GradSlot g = tp.grad_slot(n, k);
        if (!g.acc) {
          B::slice_copy(n.grad, axis, at, g.g);
        } else {
          Tensor& part = tp.scratch(n, k, s, n.value.dtype());
          B::slice_copy(n.grad, axis, at, part);
          B::copy(part, g.g, true);
        }
      }
      at += s[axis];
    }
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> ConcatPrim<B>::def{.prim = Prim::concat, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

template <class B>
struct BroadcastPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::broadcast_to(tp.in(n, 0), n.value, 1.0, false); }
  static void vjp(GTape<B>& tp, Node<B>& n) { tp.accumulate_reduced(n, 0, n.grad); }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> BroadcastPrim<B>::def{.prim = Prim::broadcast_to, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

}  // namespace detail

/// The same elements in a new shape; one dim may be -1 (inferred). Costs no copy.
template <class B>
GVar reshape(GTape<B>& tp, GVar x, std::span<const std::int64_t> dims) {
  const Shape& s = tp.shape(x);
  std::vector<std::int64_t> d(dims.begin(), dims.end());
  std::int64_t known = 1;
  int infer = -1;
  for (std::size_t i = 0; i < d.size(); ++i) {
    if (d[i] == -1) {
      if (infer >= 0) detail::fail("reshape", "only one -1 allowed, got ", Shape(std::vector<std::int64_t>(d.size(), 1)).str());
      infer = static_cast<int>(i);
    } else if (d[i] < 0) {
      detail::fail("reshape", "negative dimension ", d[i], " for input ", s.str());
    } else {
      known *= d[i];
    }
  }
  if (infer >= 0) {
    if (known == 0 || s.numel() % known != 0)
      detail::fail("reshape", "cannot infer -1 reshaping ", s.str(), " (", s.numel(), " elements)");
    d[static_cast<std::size_t>(infer)] = s.numel() / known;
  }
  Shape out(d);
  if (out.numel() != s.numel())
    detail::fail("reshape", "cannot reshape ", s.str(), " (", s.numel(), " elements) to ", out.str(), " (",
                 out.numel(), " elements)");
  GVar in[] = {x};
  return tp.record(detail::ReshapePrim<B>::def, in, ReshapeAttrs{out}, out, tp.dtype(x));
}

template <class B>
GVar reshape(GTape<B>& tp, GVar x, std::initializer_list<std::int64_t> dims) {
  return reshape(tp, x, std::span<const std::int64_t>(dims.begin(), dims.size()));
}

/// Axes reordered: out.shape[i] = x.shape[perm[i]].
template <class B>
GVar permute(GTape<B>& tp, GVar x, std::span<const int> perm) {
  const Shape& s = tp.shape(x);
  if (static_cast<int>(perm.size()) != s.rank())
    detail::fail("permute", "permutation of length ", perm.size(), " for shape ", s.str());
  PermuteAttrs a{};
  Shape out;
  std::array<bool, kMaxRank> seen{};
  int i = 0;
  for (int p : perm) {
    int q = p < 0 ? p + s.rank() : p;
    if (q < 0 || q >= s.rank() || seen[static_cast<std::size_t>(q)])
      detail::fail("permute", "invalid permutation for shape ", s.str(), " (axis ", p, ")");
    seen[static_cast<std::size_t>(q)] = true;
    a.perm[static_cast<std::size_t>(i++)] = q;
    out.push_back(s[q]);
  }
  GVar in[] = {x};
  return tp.record(detail::PermutePrim<B>::def, in, a, out, tp.dtype(x));
}

template <class B>
GVar permute(GTape<B>& tp, GVar x, std::initializer_list<int> perm) {
  return permute(tp, x, std::span<const int>(perm.begin(), perm.size()));
}

/// Swaps two axes (a copy; to multiply by a transpose use matmul's flags instead).
template <class B>
GVar transpose(GTape<B>& tp, GVar x, int d0 = -2, int d1 = -1) {
  const Shape& s = tp.shape(x);
  if (s.rank() < 2) detail::fail("transpose", "needs rank >= 2, got ", s.str());
  int a0 = detail::op_axis(s, d0, "transpose"), a1 = detail::op_axis(s, d1, "transpose");
  std::vector<int> p(static_cast<std::size_t>(s.rank()));
  for (int i = 0; i < s.rank(); ++i) p[static_cast<std::size_t>(i)] = i;
  std::swap(p[static_cast<std::size_t>(a0)], p[static_cast<std::size_t>(a1)]);
  PermuteAttrs a{};
  Shape out;
  for (int i = 0; i < s.rank(); ++i) {
    a.perm[static_cast<std::size_t>(i)] = p[static_cast<std::size_t>(i)];
    out.push_back(s[p[static_cast<std::size_t>(i)]]);
  }
  GVar in[] = {x};
  return tp.record(detail::PermutePrim<B>::def, in, a, out, tp.dtype(x));
}

/// x[..., start:stop, ...] along `axis` (step 1; negative start/stop count from the end).
template <class B>
GVar slice(GTape<B>& tp, GVar x, int axis, std::int64_t start, std::int64_t stop) {
  const Shape& s = tp.shape(x);
  if (s.rank() == 0) detail::fail("slice", "cannot slice a scalar");
  int ax = detail::op_axis(s, axis, "slice");
  const std::int64_t n = s[ax];
  std::int64_t b = start < 0 ? start + n : start, e = stop < 0 ? stop + n : stop;
  if (b < 0 || e > n || b > e)
    detail::fail("slice", "range [", start, ", ", stop, ") out of bounds for axis ", axis, " of shape ", s.str());
  Shape out = s;
  out[ax] = e - b;
  GVar in[] = {x};
  return tp.record(detail::SlicePrim<B>::def, in, SliceAttrs{ax, b}, out, tp.dtype(x));
}

/// Joins tensors along `axis`; every other dim must match.
template <class B>
GVar concat(GTape<B>& tp, std::span<const GVar> xs, int axis) {
  if (xs.empty()) detail::fail("concat", "needs at least one input");
  const Shape& s0 = tp.shape(xs[0]);
  if (s0.rank() == 0) detail::fail("concat", "cannot concatenate scalars");
  int ax = detail::op_axis(s0, axis, "concat");
  Shape out = s0;
  out[ax] = 0;
  for (GVar v : xs) {
    const Shape& s = tp.shape(v);
    if (tp.dtype(v) != tp.dtype(xs[0]))
      detail::fail("concat", "dtype mismatch: ", dtype_name(tp.dtype(xs[0])), " ", s0.str(), " vs ",
                   dtype_name(tp.dtype(v)), " ", s.str());
    bool ok = s.rank() == s0.rank();
    for (int i = 0; ok && i < s.rank(); ++i) ok = i == ax || s[i] == s0[i];
    if (!ok) detail::fail("concat", "shapes ", s0.str(), " and ", s.str(), " differ outside axis ", axis);
    out[ax] += s[ax];
  }
  return tp.record(detail::ConcatPrim<B>::def, xs, ConcatAttrs{ax}, out, tp.dtype(xs[0]));
}
template <class B>
GVar concat(GTape<B>& tp, std::initializer_list<GVar> xs, int axis) {
  return concat(tp, std::span<const GVar>(xs.begin(), xs.size()), axis);
}

/// x broadcast (NumPy rules) to `shape`; the gradient is summed back to x's shape.
template <class B>
GVar broadcast_to(GTape<B>& tp, GVar x, const Shape& shape) {
  detail::require_float(tp, x, "broadcast_to");
  if (!detail::broadcasts_to(tp.shape(x), shape))
    detail::fail("broadcast_to", "shape ", tp.shape(x).str(), " cannot broadcast to ", shape.str());
  GVar in[] = {x};
  return tp.record(detail::BroadcastPrim<B>::def, in, NoAttrs{}, shape, tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/shape.hpp ----
// ---- begin nn/ops/index.hpp ----
// Integer indexing: gather_rows (an embedding lookup; vjp scatter-add) and pick (one element per
// row, the target logit of a cross-entropy; vjp scatter into that element).


namespace nn {

namespace detail {

/// inputs: 0 table (N, D), 1 ids (integer, any shape). out: ids.shape + (D).
template <class B>
struct GatherRowsPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    Tensor y = n.value.reshape(Shape{tp.in(n, 1).numel(), tp.in(n, 0).dim(-1)});
    B::gather_rows(tp.in(n, 0), tp.in(n, 1), y);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    if (!s.acc) B::fill(s.g, 0.0);
    B::scatter_add_rows(n.grad, tp.in(n, 1), s.g);  // repeated ids accumulate
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> GatherRowsPrim<B>::def{.prim = Prim::gather_rows, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 2u>};

/// inputs: 0 x (..., V), 1 idx (integer, x.shape[:-1]). out: idx.shape.
template <class B>
struct PickPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::pick(tp.in(n, 0), tp.in(n, 1), n.value); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    if (!s.acc) B::fill(s.g, 0.0);
    B::pick_vjp(n.grad, tp.in(n, 1), s.g);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> PickPrim<B>::def{.prim = Prim::pick, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 2u>};

template <class B>
void require_ids(const GTape<B>& tp, GVar ids, const char* op) {
  DType t = tp.dtype(ids);
  if (t != DType::i32 && t != DType::i64)
    fail(op, "ids must be int32 or int64, got ", dtype_name(t), " ", tp.shape(ids).str());
  if (tp.requires_grad(ids)) fail(op, "ids cannot require a gradient");
}

}  // namespace detail

/// Rows of `table` (N, D) selected by integer `ids` of any shape: out = ids.shape + (D). The
/// vjp scatter-adds into the table's gradient, so a repeated id accumulates. Out-of-range ids
/// raise nn::Error (checked by the kernel on every run, replays included). A frozen bfloat16
/// table (Precision::bf16) gives float32 rows.
template <class B>
GVar gather_rows(GTape<B>& tp, GVar table, GVar ids) {
  const bool bf16 = tp.dtype(table) == DType::bf16;
  if (bf16) detail::require_frozen_bf16(tp, table, "gather_rows", "table");
  else detail::require_float(tp, table, "gather_rows");
  detail::require_ids(tp, ids, "gather_rows");
  const Shape& ts = tp.shape(table);
  if (ts.rank() != 2) detail::fail("gather_rows", "table must be (N, D), got ", ts.str());
  Shape out = tp.shape(ids);
  out.push_back(ts[1]);
  GVar in[] = {table, ids};
  return tp.record(detail::GatherRowsPrim<B>::def, in, NoAttrs{}, out, bf16 ? DType::f32 : tp.dtype(table));
}

/// out[i] = x[i, idx[i]] for x (..., V) and integer idx (...); an index < 0 picks 0 and passes no
/// gradient (how an ignored target is masked).
template <class B>
GVar pick(GTape<B>& tp, GVar x, GVar idx) {
  detail::require_float(tp, x, "pick");
  detail::require_ids(tp, idx, "pick");
  const Shape &xs = tp.shape(x), &is = tp.shape(idx);
  bool ok = xs.rank() == is.rank() + 1;
  for (int i = 0; ok && i < is.rank(); ++i) ok = xs[i] == is[i];
  if (!ok) detail::fail("pick", "indices ", is.str(), " do not match the leading dims of ", xs.str());
  GVar in[] = {x, idx};
  return tp.record(detail::PickPrim<B>::def, in, NoAttrs{}, is, tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/index.hpp ----
// ---- begin nn/ops/softmax.hpp ----
// softmax and log_softmax over the last axis, max-subtracted (stable for logits in the
// thousands); both are single fused primitives whose vjp uses the saved output only.


namespace nn {

/// Softmax's one attribute: log-softmax or softmax.
struct SoftmaxAttrs {
  bool log;
};

namespace detail {

template <class B>
struct SoftmaxPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::softmax(tp.in(n, 0), n.value, attrs_of<SoftmaxAttrs>(n).log); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    GradSlot s = tp.grad_slot(n, 0);
    B::softmax_vjp(n.value, n.grad, s.g, attrs_of<SoftmaxAttrs>(n).log, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SoftmaxPrim<B>::def{.prim = Prim::softmax, .forward = &forward, .vjp = &vjp,
                                   .vjp_reads = &vjp_reads_fixed<B, kVjpReadsOutput>};  // y only

template <class B>
GVar softmax_impl(GTape<B>& tp, GVar x, bool log) {
  const char* op = log ? "log_softmax" : "softmax";
  require_float(tp, x, op);
  if (tp.shape(x).rank() == 0) fail(op, "needs at least one axis, got a scalar");
  GVar in[] = {x};
  return tp.record(SoftmaxPrim<B>::def, in, SoftmaxAttrs{log}, tp.shape(x), tp.dtype(x));
}

}  // namespace detail

/// exp(x - max) / sum(exp(x - max)) over the last axis.
template <class B>
GVar softmax(GTape<B>& tp, GVar x) {
  return detail::softmax_impl(tp, x, false);
}
/// x - logsumexp(x) over the last axis.
template <class B>
GVar log_softmax(GTape<B>& tp, GVar x) {
  return detail::softmax_impl(tp, x, true);
}

}  // namespace nn
// ---- end nn/ops/softmax.hpp ----
// ---- begin nn/ops/cross_entropy.hpp ----
// softmax_cross_entropy: log-softmax and target pick fused into one primitive with integer
// targets, an ignore index and the reduction, for speed and memory at vocab 50k+ (no (R, V)
// log-probabilities kept, one pass back). Its composite reference is -pick(log_softmax(x), t);
// tests/layers/loss.test.cpp checks the two agree.


namespace nn {

namespace detail {

/// inputs: 0 logits (..., T, V), 1 targets (..., N) integer, N <= T (N == T: one row per
/// target; the kernel maps target rows to logit rows). Attributes: CrossEntropyAttrs
/// (backend/policy.hpp). saved[0] = logsumexp per target.
template <class B>
struct CrossEntropyPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor& t = tp.in(n, 1);
    Tensor& lse = tp.scratch(n, 0, Shape{t.numel()}, n.value.dtype());
    B::cross_entropy(tp.in(n, 0), t, attrs_of<CrossEntropyAttrs>(n), n.value, lse);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    B::cross_entropy_vjp(tp.in(n, 0), tp.in(n, 1), attrs_of<CrossEntropyAttrs>(n), n.saved[0], n.grad, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
// The vjp reads the logits and targets (and the saved logsumexp), and writes each logit's
// gradient after reading that logit only: the gradient may take the logits' memory.
template <class B>
const OpDef<B> CrossEntropyPrim<B>::def{.prim = Prim::cross_entropy, .forward = &forward, .vjp = &vjp,
                                        .vjp_reads = &vjp_reads_fixed<B, 3u>, .vjp_overwrites = 0};

}  // namespace detail

namespace detail {
template <class B>
GVar record_cross_entropy(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction, std::int64_t ignore_index,
                          bool first_rows) {
  const char* op = first_rows ? "cross_entropy_rows" : "cross_entropy";
  require_float(tp, logits, op);
  require_ids(tp, targets, op);
  const Shape ls = tp.shape(logits), ts = tp.shape(targets);
  bool ok = ls.rank() == ts.rank() + 1 && ls.dim(-1) > 0;
  for (int i = 0; ok && i < ts.rank(); ++i) ok = ls[i] == ts[i] || (first_rows && i == ts.rank() - 1 && ts[i] <= ls[i]);
  if (!ok)
    fail(op, "targets ", ts.str(), " do not match logits ", ls.str(),
         first_rows ? ": expected logits (..., T, V) and targets (..., N) with N <= T"
                    : ": expected targets of the logits' leading dims (classes on the last axis)");
  GVar in[] = {logits, targets};
  return tp.record(CrossEntropyPrim<B>::def, in, CrossEntropyAttrs{ignore_index, reduction}, reduction == Reduction::none ? ts : Shape{}, tp.dtype(logits));
}
}  // namespace detail

/// -log softmax(logits)[target] per row, over the last axis (classes last, as MLX).
///   logits: (..., V) float, targets: (...) int32/int64 -> (...) for Reduction::none, else ().
/// A target equal to `ignore_index` (PyTorch's default -100) contributes 0 loss and 0 gradient,
/// and the mean is over the other rows (torch.nn.functional.cross_entropy's semantics).
template <class B>
GVar softmax_cross_entropy(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction = Reduction::mean,
                           std::int64_t ignore_index = -100) {
  return detail::record_cross_entropy(tp, logits, targets, reduction, ignore_index, false);
}

/// The same over the first N rows of each sequence, without copying the logits:
///   logits: (..., T, V), targets: (..., N), N <= T -> (..., N) for Reduction::none, else ().
/// Target [..., n] scores logits[..., n, :]; rows n >= N get no loss and a zero gradient (the
/// next-token case: N = T - 1, the last position has no target).
template <class B>
GVar softmax_cross_entropy_rows(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction = Reduction::mean,
                                std::int64_t ignore_index = -100) {
  return detail::record_cross_entropy(tp, logits, targets, reduction, ignore_index, true);
}

}  // namespace nn
// ---- end nn/ops/cross_entropy.hpp ----
// ---- begin nn/ops/random.hpp ----
// Random primitives on the tape, drawn by the backend from a key that is itself a tape value (an
// input slot), so a replay with a new key draws anew and an eager run with the same key agrees.


namespace nn {

namespace detail {

/// Checks that `key` is an MLX key on the tape: uint32, shape (2).
template <class B>
void require_key(const GTape<B>& tp, GVar key, const char* op) {
  if (tp.dtype(key) != DType::u32 || !(tp.shape(key) == Shape{2}))
    fail(op, "the key must be a uint32 tensor of shape (2) (an MLX key, e.g. nn::random::key(seed)), got ",
         dtype_name(tp.dtype(key)), " ", tp.shape(key).str());
}

/// bernoulli's and dropout's probability (of a 1 in the mask; of dropping).
struct ProbabilityAttrs {
  double p;
};

/// bernoulli(p, shape, key) as a uint8 mask: inputs 0 key. No gradient.
template <class B>
struct BernoulliPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::bernoulli_mask(tp.in(n, 0), attrs_of<ProbabilityAttrs>(n).p, 1.0, n.value); }
  static void vjp(GTape<B>&, Node<B>&) {}
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> BernoulliPrim<B>::def{.prim = Prim::bernoulli, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// y = x * bernoulli(1 - p, x.shape, key) / (1 - p): inputs 0 x, 1 key; p the drop probability.
/// saved[0] holds the mask already scaled (0 or 1/(1-p), in x's dtype), drawn by the forward
/// into a buffer the node owns, so the vjp reuses exactly the mask the forward applied and a
/// replay redraws it in place from the key then in the slot.
/// MLX computes (mask * x) * (1/(1-p)); with mask in {0, 1} that equals x * (mask/(1-p)) bit
/// for bit (signed zeros and NaNs included), which is what this computes in one pass.
template <class B>
struct DropoutPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor& x = tp.in(n, 0);
    Tensor& m = tp.scratch(n, 0, x.shape(), x.dtype());
    // 1 - p and 1 / (1 - p) in double, as MLX's Python layer computes them, then rounded to the
    // mask's dtype by the kernel (float32(p_keep) for the test, float32(scale) for the values).
    const double p_keep = 1.0 - attrs_of<ProbabilityAttrs>(n).p;
    B::bernoulli_mask(tp.in(n, 1), p_keep, 1.0 / p_keep, m);
    B::binary(Binary::mul, m, x, n.value);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    // d(m * x)/dx = m: the same scaled mask the forward drew.
    GradSlot s = tp.grad_slot(n, 0);
    B::binary_vjp(Binary::mul, 1, n.saved[0], tp.in(n, 0), n.grad, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> DropoutPrim<B>::def{.prim = Prim::dropout, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

}  // namespace detail

/// A uint8 mask of `shape`, 1 with probability p: mx.random.bernoulli(p, shape, key) on the tape.
template <class B>
GVar bernoulli(GTape<B>& tp, double p, const Shape& shape, GVar key) {
  detail::require_key(tp, key, "bernoulli");
  if (!(p >= 0.0 && p <= 1.0)) detail::fail("bernoulli", "p = ", p, " is not a probability in [0, 1]");
  GVar in[] = {key};
  return tp.record(detail::BernoulliPrim<B>::def, in, detail::ProbabilityAttrs{p}, shape, DType::u8);
}

/// The dropout primitive: x * bernoulli(1 - p, x.shape, key) / (1 - p), for p in [0, 1). Models
/// call nn::dropout (layers/dropout.hpp), which adds MLX's identity cases (p = 0, evaluation).
template <class B>
GVar dropout_mask_mul(GTape<B>& tp, GVar x, double p, GVar key) {
  detail::require_float(tp, x, "dropout");
  detail::require_key(tp, key, "dropout");
  if (!(p >= 0.0 && p < 1.0)) detail::fail("dropout", "the dropout probability ", p, " is not in [0, 1)");
  GVar in[] = {x, key};
  return tp.record(detail::DropoutPrim<B>::def, in, detail::ProbabilityAttrs{p}, tp.shape(x), tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/random.hpp ----
// ---- begin nn/ops/norm.hpp ----
// fused_rmsnorm: RMSNorm over the last axis as one primitive (mlx.core.fast.rms_norm), for
// speed and memory: one pass forward, one back, only the per-row 1/rms kept. Its composite
// reference is nn::reference::rmsnorm (layers/norm.hpp); tests/ops/fused.test.cpp checks that
// the two agree, values and gradients.


namespace nn {

/// RMSNorm's epsilon.
struct NormAttrs {
  double eps;
};

namespace detail {

/// inputs: 0 x (..., C), optionally 1 w (C). saved[0] = 1/rms per row.
template <class B>
struct RmsNormPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor& x = tp.in(n, 0);
    Tensor& rstd = tp.scratch(n, 0, Shape{x.numel() / x.dim(-1)}, x.dtype());
    B::rms_norm(x, n.inputs.size() > 1 ? tp.in(n, 1) : Tensor(), attrs_of<NormAttrs>(n).eps, n.value, rstd);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const bool has_w = n.inputs.size() > 1;
    const auto g = tp.template grad_outs<2>(n);
    B::rms_norm_vjp(tp.in(n, 0), has_w ? tp.in(n, 1) : Tensor(), n.saved[0], n.grad, g[0], g[1]);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> RmsNormPrim<B>::def{.prim = Prim::rmsnorm, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 3u>};

}  // namespace detail

/// y = x / sqrt(mean(x^2) + eps) (* w), over the last axis, in one primitive.
/// x: (..., C), w: (C) or GVar{} for no gain -> (..., C). The reduction runs in x's dtype.
template <class B>
GVar fused_rmsnorm(GTape<B>& tp, GVar x, GVar w, double eps) {
  detail::require_float(tp, x, "rmsnorm");
  const Shape& xs = tp.shape(x);
  if (xs.rank() < 1 || xs.dim(-1) == 0) detail::fail("rmsnorm", "x must have a non-empty last axis, got ", xs.str());
  if (!(eps >= 0)) detail::fail("rmsnorm", "eps must be >= 0, got ", eps);
  const NormAttrs a{eps};
  if (!w.valid()) {
    GVar in[] = {x};
    return tp.record(detail::RmsNormPrim<B>::def, in, a, xs, tp.dtype(x));
  }
  detail::require_same_dtype(tp, x, w, "rmsnorm");
  const Shape& ws = tp.shape(w);
  if (ws.rank() != 1 || ws[0] != xs.dim(-1))
    detail::fail("rmsnorm", "weight ", ws.str(), " does not match x ", xs.str(), ": expected (", xs.dim(-1), ")");
  GVar in[] = {x, w};
  return tp.record(detail::RmsNormPrim<B>::def, in, a, xs, tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/norm.hpp ----
// ---- begin nn/ops/rope.hpp ----
// fused_rope: the rotary position embedding as one primitive (mlx.core.fast.rope), for speed:
// one pass over x instead of the composite's slices, products and concat, and a vjp that is the
// inverse rotation. Its composite reference is nn::reference::rope (layers/rope.hpp);
// tests/ops/fused.test.cpp checks that the two agree, values and gradients.


namespace nn {

/// RoPE's pairing: traditional (interleaved pairs (2i, 2i + 1)) or NEOX (half split).
struct RopeAttrs {
  bool traditional;
};

namespace detail {

/// inputs: 0 x, 1 cos, 2 sin (tables, no gradient).
template <class B>
struct RopePrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    B::rope(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), RopeArgs{attrs_of<RopeAttrs>(n).traditional, false}, n.value, false);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    // the vjp rotates back
    B::rope(n.grad, tp.in(n, 1), tp.in(n, 2), RopeArgs{attrs_of<RopeAttrs>(n).traditional, true}, s.g, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> RopePrim<B>::def{.prim = Prim::rope, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 6u>};

}  // namespace detail

/// Whether fused_rope takes these shapes: cos/sin (T, dims/2) against x (..., T, D), or
/// (T, 1, dims/2) against x (..., T, M, D) (M heads sharing each position's angles), with
/// dims <= D. (Other broadcasts go through the composite.)
inline bool fused_rope_fits(const Shape& x, const Shape& cs) {
  if (x.rank() < 2 || cs.rank() < 2 || cs.rank() > 3 || 2 * cs.dim(-1) > x.dim(-1) || cs.dim(-1) == 0) return false;
  if (cs.rank() == 2) return x.dim(-2) == cs[0];
  return cs[1] == 1 && x.rank() >= 3 && x.dim(-3) == cs[0];
}

/// Rotates the first dims = 2 * cos.shape[-1] features of x by the tables' angles (NEOX pairs
/// (i, i + dims/2), or traditional pairs (2i, 2i + 1)); later features pass through.
///   x: (..., T, D) with cos/sin (T, dims/2), or x: (..., T, M, D) with cos/sin (T, 1, dims/2).
/// cos and sin are tables (constants): they get no gradient.
template <class B>
GVar fused_rope(GTape<B>& tp, GVar x, GVar cos, GVar sin, bool traditional = false) {
  detail::require_same_dtype(tp, x, cos, "rope");
  detail::require_same_dtype(tp, x, sin, "rope");
  const Shape &xs = tp.shape(x), &cs = tp.shape(cos);
  if (!(cs == tp.shape(sin)) || !fused_rope_fits(xs, cs))
    detail::fail("rope", "x ", xs.str(), " and cos ", cs.str(), " / sin ", tp.shape(sin).str(),
                 " do not fit: expected x (..., T, D) with tables (T, dims/2), or x (..., T, M, D) with (T, 1, dims/2)");
  if (tp.requires_grad(cos) || tp.requires_grad(sin))
    detail::fail("rope", "the cos/sin tables cannot require a gradient in the fused primitive");
  GVar in[] = {x, cos, sin};
  return tp.record(detail::RopePrim<B>::def, in, RopeAttrs{traditional}, xs, tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/rope.hpp ----
// ---- begin nn/ops/attention.hpp ----
// fused_attention: scaled dot-product attention with grouped-query sharing as one primitive, for
// speed and memory: it reads q, k, v in their projection layout (B, T, n * head_dim) (no head
// permutes), adds the mask and takes the softmax in place, and keeps only the probabilities for
// the vjp. Its composite reference is nn::reference::gqa_attention (layers/attention.hpp);
// tests/ops/fused.test.cpp checks that the two agree, values and gradients.
// flash_attention: the same math (without a mask tensor) tiled with an online softmax, so the
// (T, T) probabilities are never stored; tests/ops/fused.test.cpp checks it against both.

#include <cmath>


namespace nn {

namespace detail {

/// inputs: 0 q (B, T, H * hd), 1 k, 2 v (B, T, KV * hd) (or the same with B and T merged),
/// optionally 3 an additive mask broadcasting to (B, H, T, T) (no gradient). AttentionAttrs.
/// saved[0] = the probabilities (B, H, T, T); saved[1] = the vjp's scratch (B * KV, T, T).
template <class B>
struct AttentionPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    Tensor& p = tp.scratch(n, 0, Shape{a.B, a.H, a.T, a.T}, n.value.dtype());
    B::attention(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(), a, n.value, p);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    const auto g = tp.template grad_outs<3>(n);
    Tensor& scratch = tp.scratch(n, 1, Shape{a.B * a.KV, a.T, a.T}, n.value.dtype());
    B::attention_vjp(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), n.saved[0], n.grad, a, scratch, g[0], g[1], g[2]);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> AttentionPrim<B>::def{.prim = Prim::attention, .forward = &forward, .vjp = &vjp,
                                     .vjp_reads = &vjp_reads_fixed<B, 7u>};  // q, k, v and the saved probabilities

/// inputs: 0 q (B, T, H * hd), 1 k, 2 v (B, T, KV * hd), optionally 3 the document starts
/// (B, T) int32 of packed rows; AttentionAttrs (no mask).
/// saved[0] = the rows' log-sum-exp (B, H, T); saved[1] = the vjp's rowsum(g * out) (B, H, T).
/// The vjp reads the output (n.value), as the unary ops' vjps do.
template <class B>
struct FlashAttentionPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    Tensor& lse = tp.scratch(n, 0, Shape{a.B, a.H, a.T}, n.value.dtype());
    B::flash_attention(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), starts(tp, n), a, n.value, lse);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto& a = attrs_of<AttentionAttrs>(n);
    const auto g = tp.template grad_outs<3>(n);
    Tensor& delta = tp.scratch(n, 1, Shape{a.B, a.H, a.T}, n.value.dtype());
    B::flash_attention_vjp(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), starts(tp, n), n.value, n.saved[0], n.grad, a, delta,
                           g[0], g[1], g[2]);
  }
  static Tensor starts(GTape<B>& tp, const Node<B>& n) { return n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(); }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> FlashAttentionPrim<B>::def{.prim = Prim::flash_attention, .forward = &forward, .vjp = &vjp,
                                          .vjp_reads = &vjp_reads_fixed<B, 15u | kVjpReadsOutput>};  // q, k, v, starts, out

/// The checks fused_attention and flash_attention share; returns B (q's rows / T).
template <class B>
std::int64_t check_attention(GTape<B>& tp, GVar q, GVar k, GVar v, std::int64_t T, std::int64_t n_heads,
                             std::int64_t n_kv_heads, std::int64_t head_dim, const char* op) {
  require_same_dtype(tp, q, k, op);
  require_same_dtype(tp, q, v, op);
  const Shape &qs = tp.shape(q), &ks = tp.shape(k), &vs = tp.shape(v);
  if (T <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads != 0)
    fail(op, "needs T, head_dim > 0 and n_heads a positive multiple of n_kv_heads, got T = ", T,
         ", n_heads = ", n_heads, ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  const bool ranks_ok = (qs.rank() == 2 || qs.rank() == 3) && ks.rank() == qs.rank() && vs.rank() == qs.rank();
  if (!ranks_ok || qs.dim(-1) != n_heads * head_dim || ks.dim(-1) != n_kv_heads * head_dim || !(ks == vs) ||
      (qs.rank() == 3 && qs[1] != T) || qs.prod(0, qs.rank() - 1) % T != 0 ||
      ks.prod(0, ks.rank() - 1) != qs.prod(0, qs.rank() - 1))
    fail(op, "q ", qs.str(), ", k ", ks.str(), ", v ", vs.str(), " do not fit T = ", T, ", n_heads = ", n_heads,
         ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  return qs.prod(0, qs.rank() - 1) / T;
}

/// gqa_attention runs flash_attention (when it has no mask tensor) from this context length on.
/// Below it the whole (T, T) tile is one or two GEMM blocks, and the probabilities kernel's
/// backward, which reads the stored softmax instead of recomputing q k^T, is faster
/// (bench_attention: 0.8-0.9x at T = 64, 1.1x at 128, 1.5-1.8x at 1024 and 4096).
inline constexpr std::int64_t kFlashMinT = 128;

/// True when backend B has the flash kernels (the CPU backend does; others run the
/// probabilities kernel instead).
template <class B>
concept HasFlashAttention = requires(const Tensor& x, Tensor& y, const AttentionAttrs& a, GradOut g) {
  B::flash_attention(x, x, x, x, a, y, y);                   // (q, k, v, starts, attrs, out, lse)
  B::flash_attention_vjp(x, x, x, x, x, x, x, a, y, g, g, g);  // (q, k, v, starts, out, lse, g, attrs, delta, gq, gk, gv)
};

}  // namespace detail

/// softmax(scale * q k^T + mask) v per query head, heads concatenated:
///   q: (B, T, n_heads * head_dim), k, v: (B, T, n_kv_heads * head_dim) (or rows (B*T, ...))
///   mask: additive, broadcasting to (B, n_heads, T, T) ((T, T) causal, (B, 1, T, T) causal +
///         padding); GVar{} for none. It gets no gradient.
///   causal: query i attends to keys 0..i only (on top of any mask), without a mask tensor, and
///         the kernels skip the products above the diagonal (about half the work).
///   -> q's shape. Query head h reads kv head h / (n_heads / n_kv_heads) (HF's repeat_kv).
/// RoPE, if any, is applied to q and k before (see gqa_attention).
template <class B>
GVar fused_attention(GTape<B>& tp, GVar q, GVar k, GVar v, GVar mask, std::int64_t T, std::int64_t n_heads,
                     std::int64_t n_kv_heads, std::int64_t head_dim, double scale, bool causal = false) {
  const char* op = "attention";
  const std::int64_t Bn = detail::check_attention(tp, q, k, v, T, n_heads, n_kv_heads, head_dim, op);
  const Shape& qs = tp.shape(q);
  const AttentionAttrs a{Bn, T, n_heads, n_kv_heads, head_dim, scale, causal};
  if (!mask.valid()) {
    GVar in[] = {q, k, v};
    return tp.record(detail::AttentionPrim<B>::def, in, a, qs, tp.dtype(q));
  }
  detail::require_same_dtype(tp, q, mask, op);
  const Shape& ms = tp.shape(mask);
  if (ms.rank() < 1 || ms.rank() > 4 || ms.dim(-1) != T || !detail::broadcasts_to(ms, Shape{Bn, n_heads, T, T}))
    detail::fail(op, "mask ", ms.str(), " does not broadcast against the scores (B, n_heads, T, T) = (", Bn, ", ",
                 n_heads, ", ", T, ", ", T, ")");
  if (tp.requires_grad(mask)) detail::fail(op, "the mask cannot require a gradient in the fused primitive");
  GVar in[] = {q, k, v, mask};
  return tp.record(detail::AttentionPrim<B>::def, in, a, qs, tp.dtype(q));
}

/// fused_attention without a mask tensor, as flash attention: the same values and gradients (up
/// to rounding), with O(T) memory in place of the (B, n_heads, T, T) probabilities and their vjp
/// scratch (B, n_kv_heads, T, T), which at T = 4096 is what decides whether a step fits.
///   q: (B, T, n_heads * head_dim), k, v: (B, T, n_kv_heads * head_dim) (or rows (B*T, ...))
///   causal: query i attends to keys 0..i only; the tiles above the diagonal are skipped.
///   starts (optional, causal only): (B, T) int32, packed rows' document starts -- query i sees
///         keys starts[b, i]..i only, so no token attends across a document boundary; each row
///         is whole documents (starts[b, i] is starts[b, i - 1] or i, checked), and the tiles
///         before a block's documents are skipped. It gets no gradient.
///   window (causal only; 0: none): query i sees keys i - window < j <= i only (transformers'
///         sliding-window causal mask, Gemma 2's even layers, Mistral, Phi-3); the key tiles
///         before a block's window are skipped, so the work grows as T * window, not T^2 / 2.
///   softcap (0: none): the scores scale q k^T are capped to softcap * tanh(s / softcap) before
///         the softmax (Gemma 2's attn_logit_softcapping), as nn::softcap written out would.
///   -> q's shape.
/// The backward recomputes each tile's probabilities from the saved log-sum-exp: one more
/// q k^T product per tile, in exchange for never reading a (T, T) buffer.
template <class B>
  requires detail::HasFlashAttention<B>
GVar flash_attention(GTape<B>& tp, GVar q, GVar k, GVar v, std::int64_t T, std::int64_t n_heads,
                     std::int64_t n_kv_heads, std::int64_t head_dim, double scale, bool causal = false,
                     GVar starts = GVar{}, std::int64_t window = 0, double softcap = 0) {
  const char* op = "flash_attention";
  const std::int64_t Bn = detail::check_attention(tp, q, k, v, T, n_heads, n_kv_heads, head_dim, op);
  const Shape& qs = tp.shape(q);
  if (window < 0 || (window > 0 && !causal))
    detail::fail(op, "a sliding window needs causal attention and window >= 0 (0: none), got window = ", window,
                 causal ? "" : " without causal");
  if (!(softcap >= 0) || !std::isfinite(softcap))
    detail::fail(op, "softcap must be finite and >= 0 (0: none), got ", softcap);
  const AttentionAttrs a{Bn, T, n_heads, n_kv_heads, head_dim, scale, causal, window, softcap};
  if (!starts.valid()) {
    GVar in[] = {q, k, v};
    return tp.record(detail::FlashAttentionPrim<B>::def, in, a, qs, tp.dtype(q));
  }
  if (!causal) detail::fail(op, "document starts need causal attention");
  if (tp.dtype(starts) != DType::i32 || !(tp.shape(starts) == Shape{Bn, T}))
    detail::fail(op, "document starts must be (B, T) = (", Bn, ", ", T, ") int32, got ", tp.shape(starts).str(), " ",
                 dtype_name(tp.dtype(starts)));
  GVar in[] = {q, k, v, starts};
  return tp.record(detail::FlashAttentionPrim<B>::def, in, a, qs, tp.dtype(q));
}

}  // namespace nn
// ---- end nn/ops/attention.hpp ----
// ---- begin nn/ops/glu.hpp ----
// fused_swiglu: silu(gate) * up as one primitive, for speed and memory: one pass forward (no
// silu(gate) buffer kept) and one back. Its composite reference is nn::reference::swiglu
// (layers/activations.hpp); tests/ops/fused.test.cpp checks that the two agree.


namespace nn {

namespace detail {

/// inputs: 0 gate, 1 up, same shape.
template <class B>
struct SwigluPrim {
  static void forward(GTape<B>& tp, Node<B>& n) { B::swiglu(tp.in(n, 0), tp.in(n, 1), n.value); }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const auto g = tp.template grad_outs<2>(n);
    B::swiglu_vjp(tp.in(n, 0), tp.in(n, 1), n.grad, g[0], g[1]);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> SwigluPrim<B>::def{.prim = Prim::swiglu, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 3u>};

}  // namespace detail

/// silu(gate) * up = gate * sigmoid(gate) * up, elementwise.  gate, up: same shape.
template <class B>
GVar fused_swiglu(GTape<B>& tp, GVar gate, GVar up) {
  detail::require_same_dtype(tp, gate, up, "swiglu");
  if (!(tp.shape(gate) == tp.shape(up)))
    detail::fail("swiglu", "gate ", tp.shape(gate).str(), " and up ", tp.shape(up).str(), " must have the same shape");
  GVar in[] = {gate, up};
  return tp.record(detail::SwigluPrim<B>::def, in, NoAttrs{}, tp.shape(gate), tp.dtype(gate));
}

}  // namespace nn
// ---- end nn/ops/glu.hpp ----
// ---- begin nn/ops/quantized.hpp ----
// Primitives over quantized matrices (quant.hpp): quantized_matmul (x @ dequant(W)^T, or
// x @ dequant(W); vjp with respect to x only) and quantized_gather (rows of a quantized table: a
// quantized embedding). The matrix is three constants, codes (u32), scales and biases: it is never
// trained, and asking for its gradient is an error naming the op.

#include <optional>
#include <vector>


namespace nn {

namespace detail {

/// inputs: 0 x (..., K), 1 codes, 2 scales, 3 biases (affine only). out: (..., N).
/// y = x @ op(W);  dx = g @ op(W)^T, the same kernel with the transpose flipped.
template <class B>
struct QuantizedMatmulPrim {
  static Tensor rows(const Tensor& t) { return t.reshape(Shape{t.numel() / t.dim(-1), t.dim(-1)}); }
  static Tensor biases(const GTape<B>& tp, const Node<B>& n) { return n.inputs.size() > 3 ? tp.in(n, 3) : Tensor(); }
  static void forward(GTape<B>& tp, Node<B>& n) {
    Tensor y = rows(n.value);
    B::quantized_matmul(rows(tp.in(n, 0)), tp.in(n, 1), tp.in(n, 2), biases(tp, n), attrs_of<QuantMatmulAttrs>(n), y,
                        false);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    if (!tp.needs_grad(n, 0)) return;
    GradSlot s = tp.grad_slot(n, 0);
    QuantMatmulAttrs t = attrs_of<QuantMatmulAttrs>(n);
    t.transpose = !t.transpose;
    Tensor gx = rows(s.g);
    B::quantized_matmul(rows(n.grad), tp.in(n, 1), tp.in(n, 2), biases(tp, n), t, gx, s.acc);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> QuantizedMatmulPrim<B>::def{.prim = Prim::quantized_matmul, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 14u>};

/// inputs: 0 ids (integer, any shape), 1 codes, 2 scales, 3 biases (affine only). out: ids.shape + (D).
template <class B>
struct QuantizedGatherPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    Tensor y = n.value.reshape(Shape{tp.in(n, 0).numel(), n.value.dim(-1)});
    B::quantized_gather(tp.in(n, 0), tp.in(n, 1), tp.in(n, 2), QuantizedMatmulPrim<B>::biases(tp, n),
                        attrs_of<Quant>(n), y);
  }
  static void vjp(GTape<B>&, Node<B>&) {}  // nothing to differentiate: integer ids, a constant table
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> QuantizedGatherPrim<B>::def{.prim = Prim::quantized_gather, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads_fixed<B, 0u>};

/// The checks both builders share: the matrix's three tensors form one (rows, cols) matrix in
/// format q (quant.hpp's check, with the op's name), none asks for a gradient.
template <class B>
std::int64_t check_quantized_inputs(const GTape<B>& tp, GVar wq, GVar scales, std::optional<GVar> biases,
                                    const Quant& q, const char* op) {
  const char* names[] = {"codes", "scales", "biases"};
  GVar vs[] = {wq, scales, biases ? *biases : wq};
  for (int i = 0; i < (biases ? 3 : 2); ++i)
    if (tp.requires_grad(vs[i]))
      fail(op, "the quantized weight's ", names[i], " ", tp.shape(vs[i]).str(),
           " cannot have a gradient: quantized weights are frozen buffers (train a LoRA over them, or dequantize)");
  auto part = [&](GVar v) { return QuantPart(tp.shape(v), tp.dtype(v)); };
  return check_quantized(part(wq), part(scales), biases ? part(*biases) : QuantPart(), q, op);
}

}  // namespace detail

/// x @ dequant(W)^T (transpose, MLX's default: W (N, K), a QuantizedLinear's weight) or
/// x @ dequant(W) (W (K, N)), for x (..., K) float32/float64; W as codes (u32), scales and
/// biases (affine; std::nullopt for the fp modes) in format q (mx.quantized_matmul). The scales may be
/// bfloat16/float16 beside a float32 x (widened). Gradient: x only.
template <class B>
GVar quantized_matmul(GTape<B>& tp, GVar x, GVar wq, GVar scales, std::optional<GVar> biases, Quant q,
                      bool transpose = true) {
  detail::require_float(tp, x, "quantized_matmul");
  const std::int64_t cols = detail::check_quantized_inputs(tp, wq, scales, biases, q, "quantized_matmul");
  const DType sd = tp.dtype(scales);
  if (q.mode == QuantMode::affine && sd != tp.dtype(x) && sd != DType::bf16 && sd != DType::f16)
    detail::fail("quantized_matmul", "scales of ", dtype_name(sd), " beside x of ", dtype_name(tp.dtype(x)),
                 ": they must match, or be bfloat16/float16");
  const Shape& xs = tp.shape(x);
  const std::int64_t rows = tp.shape(wq).dim(0), K = transpose ? cols : rows, N = transpose ? rows : cols;
  if (xs.rank() < 1 || xs.dim(-1) != K)
    detail::fail("quantized_matmul", "x ", xs.str(), " @ W", transpose ? "^T" : "", " with W (", rows, ", ", cols,
                 ") dequantized: inner dimensions differ (", xs.rank() ? xs.dim(-1) : 0, " vs ", K, ")");
  Shape out = xs;
  out[out.rank() - 1] = N;
  std::vector<GVar> in{x, wq, scales};
  if (biases) in.push_back(*biases);
  return tp.record(detail::QuantizedMatmulPrim<B>::def, in, QuantMatmulAttrs{q, transpose}, out, tp.dtype(x));
}

/// Rows `ids` (integer, any shape) of the quantized table W (V, D): out ids.shape + (D), in
/// `dtype` (float32 by default). No gradient flows (the table is frozen; ids are integers).
template <class B>
GVar quantized_gather(GTape<B>& tp, GVar ids, GVar wq, GVar scales, std::optional<GVar> biases, Quant q,
                      DType dtype = DType::f32) {
  detail::require_ids(tp, ids, "quantized_gather");
  const std::int64_t D = detail::check_quantized_inputs(tp, wq, scales, biases, q, "quantized_gather");
  if (dtype != DType::f32 && dtype != DType::f64)
    detail::fail("quantized_gather", "rows are float32 or float64, not ", dtype_name(dtype));
  Shape out = tp.shape(ids);
  out.push_back(D);
  std::vector<GVar> in{ids, wq, scales};
  if (biases) in.push_back(*biases);
  return tp.record(detail::QuantizedGatherPrim<B>::def, in, q, out, dtype);
}

}  // namespace nn
// ---- end nn/ops/quantized.hpp ----
// ---- begin nn/ops/linear_cross_entropy.hpp ----
// linear_cross_entropy: an LM head's product and the softmax cross-entropy over its logits as one
// primitive, so the (rows, vocab) logits are never stored (SmolLM2's 49152-wide head over 256
// tokens: 50 MB of logits, and as much again for their gradient in an unplanned step). The
// kernel (backend/cpu/linear_cross_entropy.hpp) walks the vocabulary in blocks with an online
// softmax, as flash attention walks keys, and skips rows that carry no loss (ignored targets,
// keep = 0: a prompt under --mask-prompt). When a backward pass is planned (a compiled step),
// the forward also forms d loss / d x in the same pass, so the step runs the same two products
// per block as logits + their gradient; otherwise the vjp computes it by the same pass.
// Its composite reference is cross_entropy(x @ W^T, targets[, keep]); tests/ops/
// linear_cross_entropy.test.cpp and the op registry check the two agree.

#include <optional>


namespace nn {

/// An LM head as linear_cross_entropy reads it: a dense weight w (V, C) (nn.Linear's layout; a
/// tied embedding's table), or a quantized one (codes, scales, biases in format q). No bias.
struct HeadVars {
  GVar w;
  GVar codes, scales;
  std::optional<GVar> biases;
  Quant q;

  HeadVars() = default;
  explicit HeadVars(GVar weight) : w(weight) {}
  HeadVars(GVar c, GVar s, std::optional<GVar> b, Quant quant) : codes(c), scales(s), biases(b), q(quant) {}
  bool quantized() const { return codes.valid(); }
};

namespace detail {

/// True when backend B has the fused kernels (the CPU backend does; elsewhere the layer runs the
/// head's product and cross_entropy as two ops).
template <class B>
concept HasLinearCrossEntropy = requires(const Tensor& x, Tensor& y, const HeadWeight& w,
                                         const LinearCrossEntropyAttrs& a, GradOut g) {
  B::linear_cross_entropy(x, w, x, x, a, y, y, y, &y);  // (x, head, targets, keep, attrs, loss, lse, work, dx)
  B::linear_cross_entropy_vjp(x, w, x, x, a, x, y, true, x, y, g, g);  // (..., lse, dx, dx_fresh, g, work, gx, gw)
  { B::linear_cross_entropy_workspace(1, 1, 1, DType::f32) } -> std::convertible_to<std::size_t>;
};

/// inputs: 0 x (..., C), 1 targets (...) integer, [2 keep (...) float, when has_keep], then the
/// head: w (V, C), or codes, scales[, biases]. out: () the summed or mean loss.
/// saved[0] lse per row, saved[1] the kernels' workspace, saved[2] d loss / d x when the forward
/// computed it (a backward pass follows: GTape::backward_follows), absent otherwise.
template <class B>
struct LinearCrossEntropyPrim {
  static const LinearCrossEntropyAttrs& attrs(const Node<B>& n) { return attrs_of<LinearCrossEntropyAttrs>(n); }
  static std::size_t head_at(const Node<B>& n) { return attrs(n).has_keep ? 3 : 2; }
  static HeadWeight head(const GTape<B>& tp, const Node<B>& n) {
    const std::size_t h = head_at(n);
    HeadWeight w;
    if (!attrs(n).quantized) {
      w.w = tp.in(n, h);
      return w;
    }
    w.codes = tp.in(n, h);
    w.scales = tp.in(n, h + 1);
    if (n.inputs.size() > h + 2) w.biases = tp.in(n, h + 2);
    w.q = attrs(n).head.q;
    return w;
  }
  static Tensor keep(const GTape<B>& tp, const Node<B>& n) { return attrs(n).has_keep ? tp.in(n, 2) : Tensor(); }
  static bool head_needs_grad(const GTape<B>& tp, const Node<B>& n) {
    return !attrs(n).quantized && tp.needs_grad(n, head_at(n));
  }
  // The gradient is formed in the forward when only x wants one and a backward pass follows.
  static bool dx_in_forward(const GTape<B>& tp, const Node<B>& n) {
    return tp.backward_follows(n) && tp.needs_grad(n, 0) && !head_needs_grad(tp, n);
  }
  static Tensor rows(const Tensor& x) { return x.reshape(Shape{x.numel() / x.dim(-1), x.dim(-1)}); }
  static Tensor& work(GTape<B>& tp, Node<B>& n, const Tensor& x) {
    const std::size_t bytes = B::linear_cross_entropy_workspace(x.dim(0), x.dim(1), head(tp, n).rows(), x.dtype());
    return tp.scratch(n, 1, Shape{static_cast<std::int64_t>(bytes)}, DType::u8);
  }

  static void forward(GTape<B>& tp, Node<B>& n) {
    const Tensor x = rows(tp.in(n, 0));
    // the highest slot first: a later scratch() never resizes n.saved under a reference taken
    const bool want = dx_in_forward(tp, n);
    if (want) tp.scratch(n, 2, x.shape(), x.dtype());
    else if (n.saved.size() > 2) n.saved.resize(2);  // an older gradient no longer matches
    work(tp, n, x);
    tp.scratch(n, 0, Shape{x.dim(0)}, x.dtype());
    B::linear_cross_entropy(x, head(tp, n), tp.in(n, 1), keep(tp, n), attrs(n), n.value, n.saved[0], n.saved[1],
                            want ? &n.saved[2] : nullptr);
  }
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const bool want_w = head_needs_grad(tp, n);
    if (!tp.needs_grad(n, 0) && !want_w) return;
    const Tensor x = rows(tp.in(n, 0));
    const bool fresh = n.saved.size() > 2 && n.saved[2].defined();
    Tensor none;  // a trainable head's pass forms x's gradient itself
    Tensor& dx = want_w ? none : tp.scratch(n, 2, x.shape(), x.dtype());  // slot 2 before slot 1 (above)
    Tensor& ws = work(tp, n, x);
    const auto g = tp.template grad_outs<6>(n);
    B::linear_cross_entropy_vjp(x, head(tp, n), tp.in(n, 1), keep(tp, n), attrs(n), n.saved[0], dx, fresh, n.grad, ws,
                                g[0], want_w ? g[head_at(n)] : GradOut{});
  }
  // With the gradient formed in the forward, the vjp reads only its saved buffers; else it
  // reruns the pass over every input.
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    return dx_in_forward(tp, n) ? 0u : (1u << n.inputs.size()) - 1u;
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> LinearCrossEntropyPrim<B>::def{.prim = Prim::linear_cross_entropy, .forward = &forward, .vjp = &vjp,
                                              .vjp_reads = &vjp_reads};

}  // namespace detail

/// The fused primitive (backends with detail::HasLinearCrossEntropy; see linear_cross_entropy
/// in layers/loss.hpp for the form that runs everywhere):
///   x: (..., C) float, head: (V, C), targets: (...) integer, keep: (...) x's dtype or GVar{}
///   -> () = sum_r c_r (lse(x_r W^T) - (x_r W^T)[t_r]), divided by sum_r c_r for the mean,
/// where c_r = keep_r (1 without keep) and 0 where t_r == ignore_index; without keep the mean is
/// over the targets not ignored (PyTorch's rule), with keep it is sum(keep * loss) / sum(keep)
/// (mlx-lm's length mask). Gradients: x, and a dense head's weight; keep takes none.
template <class B>
  requires detail::HasLinearCrossEntropy<B>
GVar fused_linear_cross_entropy(GTape<B>& tp, GVar x, const HeadVars& head, GVar targets, GVar keep = {},
                                Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  const char* op = "linear_cross_entropy";
  detail::require_float(tp, x, op);
  detail::require_ids(tp, targets, op);
  const Shape& xs = tp.shape(x);
  const Shape& ts = tp.shape(targets);
  if (reduction == Reduction::none)
    detail::fail(op, "returns a summed or mean loss; per-row losses need cross_entropy over the logits");
  Shape lead;
  for (int i = 0; i + 1 < xs.rank(); ++i) lead.push_back(xs[i]);
  if (xs.rank() < 1 || xs.dim(-1) == 0 || !(ts == lead))
    detail::fail(op, "x ", xs.str(), " and targets ", ts.str(),
                 " do not fit: expected x (..., C) and targets (...) of x's leading dims");
  LinearCrossEntropyAttrs a;
  a.ce = {ignore_index, reduction};
  std::vector<GVar> in{x, targets};
  if (keep.valid()) {
    detail::require_same_dtype(tp, x, keep, op);
    if (!(tp.shape(keep) == ts))
      detail::fail(op, "keep ", tp.shape(keep).str(), " must have the targets' shape ", ts.str());
    if (tp.requires_grad(keep)) detail::fail(op, "keep (the rows' weights) cannot require a gradient here");
    a.has_keep = true;
    in.push_back(keep);
  }
  std::int64_t V = 0, C = 0;
  if (head.quantized()) {
    C = detail::check_quantized_inputs(tp, head.codes, head.scales, head.biases, head.q, op);
    V = tp.shape(head.codes).dim(0);
    const DType sd = tp.dtype(head.scales);
    if (head.q.mode == QuantMode::affine && sd != tp.dtype(x) && sd != DType::bf16 && sd != DType::f16)
      detail::fail(op, "scales of ", dtype_name(sd), " beside x of ", dtype_name(tp.dtype(x)),
                   ": they must match, or be bfloat16/float16");
    a.quantized = true;
    a.head = {head.q, true};
    in.push_back(head.codes);
    in.push_back(head.scales);
    if (head.biases) in.push_back(*head.biases);
  } else {
    detail::require_same_dtype(tp, x, head.w, op);
    const Shape& ws = tp.shape(head.w);
    if (ws.rank() != 2) detail::fail(op, "the head's weight must be (V, C), got ", ws.str());
    V = ws[0];
    C = ws[1];
    in.push_back(head.w);
  }
  if (C != xs.dim(-1) || V == 0)
    detail::fail(op, "x ", xs.str(), " @ W^T with W (", V, ", ", C, "): inner dimensions differ (", xs.dim(-1), " vs ",
                 C, ")");
  return tp.record(detail::LinearCrossEntropyPrim<B>::def, in, a, Shape{}, tp.dtype(x));
}

}  // namespace nn
// ---- end nn/ops/linear_cross_entropy.hpp ----
// ---- begin nn/ops/fused.hpp ----
// Fusion of elementwise chains on a recorded tape (the first seed's gpfuse): a pass over the
// tape finds groups of unary, binary and where nodes whose intermediate values nothing else
// reads, and turns each group into one `fused` node that runs the group per element in one loop,
// forward and vjp: backend/cpu/fused.hpp on the CPU, one CUDA kernel per direction (k_fused,
// k_fused_vjp in backend/cuda/kernels.cuh) on nn::cuda, both interpreting the same FusedProgram.
// The fused node is the group's last node (its index, its value buffer, its GVar); the others
// are absorbed (Node::fused_into) and hold no buffers. Values and gradients equal the unfused
// tape's bit for bit: each element goes through the same functors (backend/math.hpp) in the same
// order, and each contribution to an input's gradient is added in the order the backward sweep
// adds it unfused.

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <sstream>
#include <string>
#include <vector>


namespace nn {

/// A fused node's attributes: its program's index on the tape (GTape::fused_program).
struct FusedAttrs {
  std::int32_t program = -1;
};

namespace detail {

// The fused vjp's contributions to inputs, numbered as backend/cpu/fused.hpp walks them: steps
// in reverse, operand a before b, only operands that are inputs and want a gradient. f(step,
// which, register) per contribution, in that order.
template <class F>
void for_each_fused_contribution(const FusedProgram& p, F&& f) {
  for (int s = p.steps - 1; s >= 0; --s) {
    const FusedStep& st = p.step[static_cast<std::size_t>(s)];
    if (!st.grad) continue;
    if (st.grad_a && st.a < p.inputs) f(s, 0, st.a);
    if ((st.binary || st.select) && st.grad_b && st.b < p.inputs) f(s, 1, st.b);
  }
}

template <class B>
struct FusedPrim {
  static void forward(GTape<B>& tp, Node<B>& n) {
    std::array<const Tensor*, kMaxFusedInputs> ins{};
    for (std::size_t k = 0; k < n.inputs.size(); ++k) ins[k] = &tp.in(n, k);
    B::fused(program(tp, n), std::span<const Tensor* const>(ins.data(), n.inputs.size()), n.value);
  }
  // Each contribution's destination, taken from the tape in the sweep's order (so the first
  // overwrites and the rest add, as unfused); a broadcast input's contributions go to scratch
  // buffers at the output's shape, each summed down into its gradient afterwards, in order.
  static void vjp(GTape<B>& tp, Node<B>& n) {
    const FusedProgram& p = program(tp, n);
    std::array<const Tensor*, kMaxFusedInputs> ins{};
    for (std::size_t k = 0; k < n.inputs.size(); ++k) ins[k] = &tp.in(n, k);
    std::array<FusedGradDest, 2 * kMaxFusedSteps> dest{};
    std::array<std::int8_t, 2 * kMaxFusedSteps> reduce_into{};  // input k, or -1: written in place
    std::size_t c = 0;
    for_each_fused_contribution(p, [&](int, int, int) { ++c; });
    if (n.saved.size() < c) n.saved.resize(c);  // first run only: later scratch() calls move nothing
    c = 0;
    for_each_fused_contribution(p, [&](int, int, int reg) {
      const std::size_t k = static_cast<std::size_t>(reg);
      if (tp.in(n, k).shape() == n.value.shape()) {
        GradSlot s = tp.grad_slot(n, k);
        dest[c] = {&s.g, s.acc};
        reduce_into[c] = -1;
      } else {
        dest[c] = {&tp.scratch(n, c, n.value.shape(), n.value.dtype()), false};
        reduce_into[c] = static_cast<std::int8_t>(reg);
      }
      ++c;
    });
    B::fused_vjp(p, std::span<const Tensor* const>(ins.data(), n.inputs.size()), n.value, n.grad,
                 std::span<const FusedGradDest>(dest.data(), c));
    for (std::size_t j = 0; j < c; ++j)
      if (reduce_into[j] >= 0) tp.accumulate_reduced(n, static_cast<std::size_t>(reduce_into[j]), *dest[j].g);
  }
  // The inputs the vjp recomputes from, and the output when a derivative reads it.
  static std::uint32_t vjp_reads(const GTape<B>& tp, const Node<B>& n) {
    const FusedProgram& p = program(tp, n);
    const std::uint32_t inputs = p.vjp_need & ((1u << p.inputs) - 1u);
    return inputs | (((p.vjp_need >> (p.inputs + p.steps - 1)) & 1u) ? kVjpReadsOutput : 0u);
  }
  static const FusedProgram& program(const GTape<B>& tp, const Node<B>& n) {
    return tp.fused_program(attrs_of<FusedAttrs>(n).program);
  }
  static const OpDef<B> def;  // defined below the struct, so only a call instantiates the kernels
};
template <class B>
const OpDef<B> FusedPrim<B>::def{.prim = Prim::fused, .forward = &forward, .vjp = &vjp, .vjp_reads = &vjp_reads};

// The cost rule. The fused vjp recomputes a group's intermediates (only the last value is
// stored): cheap for arithmetic, not for a transcendental, whose recomputation costs more than
// the memory pass it saves (bench/fusion.cpp measured fused SwiGLU from silu and mul at 0.6-0.7x
// of unfused when silu was recomputed). So an op with a transcendental (exp, log, sqrt, rsqrt,
// tanh, sigmoid, pow, silu, the GELUs) joins a group only as its last node, whose value the vjp
// reads instead.
inline bool recompute_is_cheap(Unary op) {
  switch (op) {
    case Unary::neg: case Unary::relu: case Unary::abs: case Unary::scale: case Unary::add_scalar: return true;
    default: return false;
  }
}

// Whether node i may join a fused group: a unary, binary or where node of a float dtype, outside
// checkpoint segments (their nodes are recomputed by the sweep), not already planned or fused.
template <class B>
bool fusable(GTape<B>& tp, std::int32_t i) {
  const Node<B>& n = tp.at(i);
  if (!n.def || (n.def->prim != Prim::unary && n.def->prim != Prim::binary && n.def->prim != Prim::where)) return false;
  const DType t = n.value.dtype();
  return (t == DType::f32 || t == DType::f64) && !n.pooled && !n.planned && n.segment < 0 && n.fused_into < 0;
}

}  // namespace detail

/// What fuse_elementwise did: groups made, nodes absorbed into them, and the memory traffic a
/// step no longer makes (each absorbed value's write and read, and, where the group wants a
/// gradient, its gradient's write and read).
struct FusionStats {
  int groups = 0;
  int absorbed = 0;
  std::int64_t bytes_saved = 0;
};

/// The fusion pass, run on a recorded tape before it is planned (nn::compile runs it when
/// asked: CompiledStep::fuse). From the last node back, each unary, binary or where node roots
/// a group that takes in every operand that is itself such a node of the same shape and dtype
/// (a where's mask is always an input), read by nothing but its one consumer in the group, and
/// not `out` (up to kMaxFusedSteps nodes and
/// kMaxFusedInputs distinct inputs); a transcendental op only as a group's last node (the cost
/// rule: detail::recompute_is_cheap). Groups of two or more nodes become one fused node. A group
/// is left unfused where fusing would reorder a gradient's sum: an input of the group that a
/// node outside it also reads, between the group's first and last node, would get its
/// contributions added in another order. No fusion on a tape in anomaly mode (its errors name
/// the node that made a NaN). Intermediates of a fused group cannot be read afterwards (an
/// nn::Error says so), as with plan_memory: fuse only a tape whose intermediates nobody reads.
/// On an eagerly recorded tape (a CUDA one) the group's nodes already ran unfused; their
/// buffers are released here and replays run the fused node.
template <class B>
FusionStats fuse_elementwise(GTape<B>& tp, GVar out) {
  FusionStats stats;
  tp.node(out);  // validates the handle
  if (tp.detect_anomaly()) return stats;
  const auto N = static_cast<std::int32_t>(tp.size());
  std::vector<std::vector<std::int32_t>> readers(static_cast<std::size_t>(N));  // every node reading each node, per use
  for (std::int32_t i = 0; i < N; ++i)
    for (std::int32_t in : tp.at(i).inputs) readers[static_cast<std::size_t>(in)].push_back(i);
  std::vector<char> taken(static_cast<std::size_t>(N), 0);
  std::vector<std::int32_t> group, stack, ext;
  for (std::int32_t r = N - 1; r >= 0; --r) {
    if (taken[static_cast<std::size_t>(r)] || !detail::fusable(tp, r)) continue;
    const Node<B>& root = tp.at(r);
    group.assign(1, r);
    stack.assign(1, r);
    while (!stack.empty()) {
      const std::int32_t j = stack.back();
      stack.pop_back();
      const bool select = tp.at(j).def->prim == Prim::where;
      for (std::size_t q = select ? 1 : 0; q < tp.at(j).inputs.size(); ++q) {  // a where's mask stays an input
        const std::int32_t in = tp.at(j).inputs[q];
        const auto u = static_cast<std::size_t>(in);
        if (group.size() >= static_cast<std::size_t>(kMaxFusedSteps)) break;
        if (in == out.index || taken[u] || readers[u].size() != 1 || !detail::fusable(tp, in)) continue;
        const Node<B>& m = tp.at(in);
        if (m.def->prim == Prim::unary && !detail::recompute_is_cheap(detail::attrs_of<UnaryAttrs>(m).op)) continue;
        if (!(m.value.shape() == root.value.shape()) || m.value.dtype() != root.value.dtype()) continue;
        group.push_back(in);
        stack.push_back(in);
      }
    }
    if (group.size() < 2) continue;
    std::sort(group.begin(), group.end());  // the tape's order is a topological one
    auto member = [&](std::int32_t i) { return std::binary_search(group.begin(), group.end(), i); };
    // the group's inputs, in order of first use; each a register
    ext.clear();
    for (std::int32_t j : group)
      for (std::int32_t in : tp.at(j).inputs)
        if (!member(in) && std::find(ext.begin(), ext.end(), in) == ext.end()) ext.push_back(in);
    if (ext.size() > static_cast<std::size_t>(kMaxFusedInputs)) continue;
    bool reorders = false;
    for (std::int32_t x : ext) {
      if (!tp.at(x).requires_grad) continue;
      for (std::int32_t c : readers[static_cast<std::size_t>(x)])
        reorders = reorders || (!member(c) && c > group.front() && c < r);
    }
    if (reorders) continue;

    FusedProgram p;
    p.inputs = static_cast<int>(ext.size());
    p.steps = static_cast<int>(group.size());
    auto reg = [&](std::int32_t i) -> std::int8_t {
      if (member(i)) return static_cast<std::int8_t>(p.inputs + (std::lower_bound(group.begin(), group.end(), i) - group.begin()));
      return static_cast<std::int8_t>(std::find(ext.begin(), ext.end(), i) - ext.begin());
    };
    for (std::size_t s = 0; s < group.size(); ++s) {
      const Node<B>& n = tp.at(group[s]);
      FusedStep& st = p.step[s];
      st.binary = n.def->prim == Prim::binary;
      st.select = n.def->prim == Prim::where;
      if (st.select) {  // where(mask, a, b): registers m, a, b
        st.m = reg(n.inputs[0]);
        st.a = reg(n.inputs[1]);
        st.b = reg(n.inputs[2]);
        st.grad_a = tp.at(n.inputs[1]).requires_grad;
        st.grad_b = tp.at(n.inputs[2]).requires_grad;
        st.grad = n.requires_grad;
        st.node = group[s];
        continue;
      }
      if (st.binary) {
        st.op = static_cast<std::uint8_t>(detail::attrs_of<BinaryAttrs>(n).op);
      } else {
        const UnaryAttrs& a = detail::attrs_of<UnaryAttrs>(n);
        st.op = static_cast<std::uint8_t>(a.op);
        st.arg = a.arg;
      }
      st.a = reg(n.inputs[0]);
      st.grad_a = tp.at(n.inputs[0]).requires_grad;
      if (st.binary) {
        st.b = reg(n.inputs[1]);
        st.grad_b = tp.at(n.inputs[1]).requires_grad;
      }
      st.grad = n.requires_grad;
      st.node = group[s];
    }
    // what the vjp reads: the derivatives' operands, then (from the last step down) what each
    // recomputed intermediate is computed from; the last step's value comes from the output
    std::uint32_t need = 0;
    for (int s = 0; s < p.steps; ++s) {
      const FusedStep& st = p.step[static_cast<std::size_t>(s)];
      if (!st.grad) continue;
      const std::uint32_t self = 1u << (p.inputs + s), a = 1u << st.a, b = st.binary ? 1u << st.b : 0u;
      if (st.select) {  // where's vjp reads the mask alone
        if (st.grad_a || st.grad_b) need |= 1u << st.m;
      } else if (!st.binary) {
        const unsigned rd = st.grad_a ? detail::unary_df_reads(static_cast<Unary>(st.op)) : 0u;
        need |= ((rd & 1u) ? a : 0u) | ((rd & 2u) ? self : 0u);
      } else {
        for (int which = 0; which < 2; ++which) {
          if (!(which == 0 ? st.grad_a : st.grad_b)) continue;
          const unsigned rd = detail::binary_df_reads(static_cast<Binary>(st.op), which);
          need |= ((rd & 1u) ? a : 0u) | ((rd & 2u) ? b : 0u);
        }
      }
    }
    for (int s = p.steps - 2; s >= 0; --s) {
      const FusedStep& st = p.step[static_cast<std::size_t>(s)];
      if ((need >> (p.inputs + s)) & 1u)
        need |= (1u << st.a) | (st.binary || st.select ? 1u << st.b : 0u) | (st.select ? 1u << st.m : 0u);
    }
    p.vjp_need = need;
    const std::int32_t id = tp.add_fused_program(p);
    const std::int64_t bytes = root.value.numel() * static_cast<std::int64_t>(dtype_size(root.value.dtype()));
    for (std::int32_t j : group) {
      taken[static_cast<std::size_t>(j)] = 1;
      if (j == r) continue;
      Node<B>& n = tp.at(j);
      stats.bytes_saved += bytes * (n.requires_grad ? 4 : 2);
      n.def = nullptr;
      n.fused_into = r;
      n.inputs.clear();
      n.requires_grad = false;
      n.value = Tensor();
      n.grad = Tensor();
      n.saved.clear();
      n.deferred = false;
    }
    Node<B>& f = tp.at(r);
    f.def = &detail::FusedPrim<B>::def;
    f.inputs = ext;
    f.attrs.set(FusedAttrs{id});
    f.saved.clear();
    ++stats.groups;
    stats.absorbed += static_cast<int>(group.size()) - 1;
  }
  return stats;
}

/// One line per fused node of the tape, then the totals: its index and scope, its steps' ops
/// and the nodes they were, its inputs, the elements and dtype, and the bytes per step it saves
/// (as FusionStats counts them). nn::compile prints it to stderr when NN_FUSION_LOG=1.
template <class B>
std::string fusion_report(const GTape<B>& tp) {
  std::ostringstream os;
  int groups = 0, absorbed = 0;
  std::int64_t saved = 0;
  for (std::size_t i = 0; i < tp.size(); ++i) {
    const GVar v{&tp, static_cast<std::int32_t>(i)};
    const Node<B>& n = tp.node(v);
    if (!n.def || n.def->prim != Prim::fused) continue;
    const FusedProgram& p = detail::FusedPrim<B>::program(tp, n);
    const std::int64_t bytes = n.value.numel() * static_cast<std::int64_t>(dtype_size(n.value.dtype()));
    std::int64_t s = 0;
    os << "fused node " << i;
    if (!tp.scope_path(v).empty()) os << " ('" << tp.scope_path(v) << "')";
    os << ":";
    for (int k = 0; k < p.steps; ++k) {
      const FusedStep& st = p.step[static_cast<std::size_t>(k)];
      os << ' ' << (st.select ? "where" : st.binary ? binary_name(static_cast<Binary>(st.op)) : unary_name(static_cast<Unary>(st.op)))
         << '#' << st.node;
      if (k + 1 < p.steps) s += bytes * (st.grad ? 4 : 2);
    }
    os << ", " << p.inputs << " inputs, " << n.value.numel() << ' ' << dtype_name(n.value.dtype()) << ", " << s
       << " bytes saved per step\n";
    ++groups;
    absorbed += p.steps - 1;
    saved += s;
  }
  os << "fusion: " << groups << " groups, " << absorbed << " nodes absorbed, " << saved << " bytes saved per step\n";
  return os.str();
}

}  // namespace nn
// ---- end nn/ops/fused.hpp ----
// ---- begin nn/layers/helpers.hpp ----
// The seed's helpers for writing a model as a list of layer calls: registering the caller's
// weights (param / constant / input) and constant fills (ones / zeros / full) on a tape.


namespace nn {

/// Registers `t` as a parameter bound by reference (the seed's nn_param). Its gradient is
/// computed when `trainable`; a frozen base weight is `param(tp, w, false)` or `constant(tp, w)`.
template <class B>
GVar param(GTape<B>& tp, const Tensor& t, bool trainable = true) {
  return tp.param(t, trainable);
}
/// Not for a temporary: the leaf would point at a destroyed tensor (see GTape::param).
template <class B>
GVar param(GTape<B>& tp, Tensor&& t, bool trainable = true) = delete;

/// Registers `t` as a value that never gets a gradient (the seed's nn_const).
template <class B>
GVar constant(GTape<B>& tp, const Tensor& t) {
  return tp.constant(t);
}

/// Registers `t` as an input slot a replay may swap with tp.set() (a batch, a padding mask).
template <class B>
GVar input(GTape<B>& tp, const Tensor& t, bool requires_grad = false) {
  return tp.input(t, requires_grad);
}

/// A constant of `shape` filled with `value`, allocated by the tape's backend (so it lives where
/// the tape runs; a host Tensor would be refused by a CUDA tape).
template <class B>
GVar full(GTape<B>& tp, const Shape& shape, double value, DType dtype = DType::f32) {
  Tensor t = B::alloc(shape, dtype);
  B::fill(t, value);
  return tp.constant(t);
}
/// A constant of ones (the seed's nn_ones).
template <class B>
GVar ones(GTape<B>& tp, const Shape& shape, DType dtype = DType::f32) {
  return full(tp, shape, 1.0, dtype);
}
/// A constant of zeros.
template <class B>
GVar zeros(GTape<B>& tp, const Shape& shape, DType dtype = DType::f32) {
  return full(tp, shape, 0.0, dtype);
}

namespace detail {

/// A host tensor moved to backend B's device (a no-op for the CPU), for tables the layers
/// compute on the host once (RoPE angles, masks) before registering them.
template <class B>
Tensor on_backend(const Tensor& t) {
  return t.device() == B::device ? t : t.to(B::device);
}

/// reshape to a Shape known only at run time (ops' reshape takes a braced list); the same view
/// primitive, so no copy and the same vjp.
template <class B>
GVar view(GTape<B>& tp, GVar x, const Shape& s) {
  if (s.numel() != tp.shape(x).numel())
    fail("reshape", "cannot view ", tp.shape(x).str(), " as ", s.str());
  GVar in[] = {x};
  return tp.record(ReshapePrim<B>::def, in, ReshapeAttrs{s}, s, tp.dtype(x));
}

/// "(2, 3) float64": how layer errors name an operand.
template <class B>
std::string desc(const GTape<B>& tp, GVar v) {
  return tp.shape(v).str() + " " + dtype_name(tp.dtype(v));
}

/// The float checks every layer does first, raised under the layer's name.
template <class B>
void layer_float(const GTape<B>& tp, GVar x, const char* layer, const char* what) {
  DType t = tp.dtype(x);
  if (t != DType::f32 && t != DType::f64)
    fail(layer, what, " must be float32 or float64, got ", desc(tp, x));
}
template <class B>
void layer_same_dtype(const GTape<B>& tp, GVar x, GVar y, const char* layer, const char* xn, const char* yn) {
  layer_float(tp, x, layer, xn);
  if (tp.dtype(x) != tp.dtype(y))
    fail(layer, "dtype mismatch: ", xn, " ", desc(tp, x), " vs ", yn, " ", desc(tp, y));
}

}  // namespace detail

}  // namespace nn
// ---- end nn/layers/helpers.hpp ----
// ---- begin nn/layers/linear.hpp ----
// Linear, LoRA- and DoRA-adapted linear layers, weights laid out as PyTorch, MLX and Hugging Face store
// them: weight (out, in), so y = x W^T + b (torch.nn.Linear, mlx.nn.Linear).

#include <utility>


namespace nn {

namespace detail {

template <class B>
void check_linear(const GTape<B>& tp, GVar x, GVar w, const char* layer) {
  if (!bf16_weight(tp, x, w, layer)) layer_same_dtype(tp, x, w, layer, "x", "weight");
  const Shape &xs = tp.shape(x), &ws = tp.shape(w);
  if (ws.rank() != 2) fail(layer, "weight must be (out, in), got ", ws.str(), " (x ", xs.str(), ")");
  if (xs.rank() < 1 || xs.dim(-1) != ws[1])
    fail(layer, "x ", xs.str(), " does not match weight ", ws.str(), ": x's last dim must equal in = ", ws[1]);
}

template <class B>
void check_bias(const GTape<B>& tp, GVar w, GVar b, const char* layer) {
  if (tp.dtype(w) == DType::bf16) layer_float(tp, b, layer, "bias");  // a bf16 weight's bias stays f32
  else layer_same_dtype(tp, w, b, layer, "weight", "bias");
  const Shape &ws = tp.shape(w), &bs = tp.shape(b);
  if (bs.rank() != 1 || bs[0] != ws[0])
    fail(layer, "bias ", bs.str(), " does not match weight ", ws.str(), ": bias must be (out) = (", ws[0], ")");
}

}  // namespace detail

/// y = x W^T.  x: (..., in), w: (out, in) -> y: (..., out).
/// The transpose is matmul's trans_b flag (read transposed, never copied), and a batched x folds
/// into one GEMM against the shared weight.
template <class B>
GVar linear(GTape<B>& tp, GVar x, GVar w) {
  detail::check_linear(tp, x, w, "linear");
  if (tp.shape(x).rank() == 1) {  // a single vector: (in) -> (out)
    GVar y = matmul(tp, detail::view(tp, x, Shape{1, tp.shape(x)[0]}), w, false, true);
    return detail::view(tp, y, Shape{tp.shape(w)[0]});
  }
  return matmul(tp, x, w, false, true);
}

/// y = x W^T + b.  x: (..., in), w: (out, in), b: (out) -> y: (..., out).
template <class B>
GVar linear(GTape<B>& tp, GVar x, GVar w, GVar b) {
  detail::check_linear(tp, x, w, "linear");
  detail::check_bias(tp, w, b, "linear");
  return add(tp, linear(tp, x, w), b);
}

namespace detail {

template <class B>
void check_lora(const GTape<B>& tp, GVar x, GVar w0, GVar a, GVar b, const char* layer) {
  check_linear(tp, x, w0, layer);
  layer_same_dtype(tp, x, a, layer, "x", "lora_a");
  layer_same_dtype(tp, x, b, layer, "x", "lora_b");
  const Shape &ws = tp.shape(w0), &as = tp.shape(a), &bs = tp.shape(b);
  if (as.rank() != 2 || bs.rank() != 2 || as[0] != ws[1] || bs[1] != ws[0] || as[1] != bs[0])
    fail(layer, "adapters a ", as.str(), " and b ", bs.str(), " do not fit weight ", ws.str(),
         ": expected a (in, r) = (", ws[1], ", r) and b (r, out) = (r, ", ws[0], ") (mlx-lm orientation)");
}

/// x M for a matrix M stored (in, out), x of any rank >= 1.
template <class B>
GVar right_mul(GTape<B>& tp, GVar x, GVar m) {
  if (tp.shape(x).rank() == 1) {
    GVar y = matmul(tp, view(tp, x, Shape{1, tp.shape(x)[0]}), m);
    return view(tp, y, Shape{tp.shape(m)[1]});
  }
  return matmul(tp, x, m);
}

/// scale * (x A) B, the adapter branch. The scale is applied to the (..., r) intermediate:
/// the same product as mlx-lm's scale * ((x A) B), on r columns instead of out.
template <class B>
GVar lora_branch(GTape<B>& tp, GVar x, GVar a, GVar b, double scale) {
  GVar xa = right_mul(tp, x, a);
  if (scale != 1.0) xa = nn::scale(tp, xa, scale);
  return right_mul(tp, xa, b);
}

}  // namespace detail

/// y = x W0^T + scale (x A) B: a frozen base weight plus a low-rank update (Hu et al. 2021,
/// "LoRA"; mlx-lm tuner/lora.py LoRALinear, whose orientation this follows).
/// x: (..., in), w0: (out, in), a: (in, r), b: (r, out) -> y: (..., out).
/// `scale` multiplies the update as given (mlx-lm's `scale`; PEFT's is lora_alpha / r).
template <class B>
GVar lora_linear(GTape<B>& tp, GVar x, GVar w0, GVar a, GVar b, double scale) {
  detail::check_lora(tp, x, w0, a, b, "lora_linear");
  return add(tp, linear(tp, x, w0), detail::lora_branch(tp, x, a, b, scale));
}

/// y = x W0^T + b0 + scale (x A) B (a base layer with a bias, e.g. Qwen2's q/k/v projections).
/// bias0: (out).
template <class B>
GVar lora_linear(GTape<B>& tp, GVar x, GVar w0, GVar bias0, GVar a, GVar b, double scale) {
  detail::check_lora(tp, x, w0, a, b, "lora_linear");
  detail::check_bias(tp, w0, bias0, "lora_linear");
  return add(tp, linear(tp, x, w0, bias0), detail::lora_branch(tp, x, a, b, scale));
}

namespace detail {

/// The squared norms of a dense weight's rows, summed in double, stored in dtype dt (a host
/// tensor). w: (out, in) -> (out)
inline Tensor row_squares(const Tensor& weight, DType dt) {
  const Tensor w = weight.to(Device::cpu);
  Tensor out = Tensor::zeros(Shape{w.dim(0)}, dt);
  for (std::int64_t i = 0; i < w.dim(0); ++i) {
    double n2 = 0;
    for (std::int64_t j = 0; j < w.dim(1); ++j) {
      const double v = load_as_double(w.raw(), w.dtype(), i * w.dim(1) + j);
      n2 += v * v;
    }
    store_from_double(out.raw(), dt, i, n2);
  }
  return out;
}

/// What DoRA's norm reads of a full-precision base weight: its rows' squared norms (out) and
/// W A (out, r), the latter as (A^T W^T)^T through linear, so a bfloat16 weight (set_precision)
/// is read as linear reads it. A bfloat16 weight is frozen by construction: its squared norms are
/// a constant of the recording. w0: (out, in), a: (in, r).
template <class B>
std::pair<GVar, GVar> dora_weight_terms(GTape<B>& tp, GVar w0, GVar a) {
  GVar w_sq = tp.dtype(w0) == DType::bf16 ? tp.constant(row_squares(tp.value(w0), tp.dtype(a)).to(B::device))
                                          : sum(tp, mul(tp, w0, w0), {1});
  return {w_sq, transpose(tp, linear(tp, transpose(tp, a), w0))};
}

}  // namespace detail

/// DoRA's per-output-row factor m / ||W + scale (A B)^T||_row (Liu et al. 2024, "DoRA"; mlx-lm
/// tuner/dora.py DoRALinear; PEFT's use_dora), the norm detached (stop_gradient) as both do,
/// following the paper's section 4.3: m gets its gradient here, A and B only through the branch
/// this factor multiplies. The squared row norm is expanded,
///   ||W_i + s (A B)^T_i||^2 = ||W_i||^2 + 2 s (W A)_i . B_{:,i} + s^2 (B^T (A^T A))_i . B_{:,i},
/// so W enters only as its rows' squared norms and the product W A (r columns): a quantized W is
/// multiplied, never dequantized whole, and no (out, in) temporary is made.
/// w_sq: (out) sums of squares of W's rows, wa: (out, r) = W A, a: (in, r), b: (r, out),
/// m: (out) -> (out).
template <class B>
GVar dora_factor(GTape<B>& tp, GVar w_sq, GVar wa, GVar a, GVar b, GVar m, double scale) {
  GVar bt = transpose(tp, b);                                            // (out, r)
  GVar cross = sum(tp, mul(tp, wa, bt), {1});                            // (out)
  GVar ata = matmul(tp, a, a, true, false);                              // (r, r)
  GVar quad = sum(tp, mul(tp, matmul(tp, bt, ata), bt), {1});            // (out)
  GVar n2 = add(tp, add(tp, w_sq, nn::scale(tp, cross, 2 * scale)), nn::scale(tp, quad, scale * scale));
  return mul(tp, m, stop_gradient(tp, rsqrt(tp, n2)));
}

/// y = m / ||W0 + scale (A B)^T||_row * (x W0^T + scale (x A) B) [+ b0]: DoRA over a full-precision
/// weight (mlx-lm DoRALinear's forward; the bias is added after the rescale, as there and in
/// PEFT). x: (..., in), w0: (out, in), a: (in, r), b: (r, out), m: (out) -> y: (..., out).
template <class B>
GVar dora_linear(GTape<B>& tp, GVar x, GVar w0, GVar a, GVar b, GVar m, double scale) {
  detail::check_lora(tp, x, w0, a, b, "dora_linear");
  if (tp.shape(m) != Shape{tp.shape(w0)[0]})
    detail::fail("dora_linear", "magnitude m ", tp.shape(m).str(), " does not match weight ", tp.shape(w0).str(),
                 ": m must be (out) = (", tp.shape(w0)[0], ")");
  const auto [w_sq, wa] = detail::dora_weight_terms(tp, w0, a);
  return mul(tp, lora_linear(tp, x, w0, a, b, scale), dora_factor(tp, w_sq, wa, a, b, m, scale));
}

/// The same with the base's bias b0: (out), added after the rescale.
template <class B>
GVar dora_linear(GTape<B>& tp, GVar x, GVar w0, GVar bias0, GVar a, GVar b, GVar m, double scale) {
  detail::check_bias(tp, w0, bias0, "dora_linear");
  return add(tp, dora_linear(tp, x, w0, a, b, m, scale), bias0);
}

}  // namespace nn
// ---- end nn/layers/linear.hpp ----
// ---- begin nn/layers/norm.hpp ----
// Normalization over the last axis: RMSNorm (Zhang & Sennrich 2019; mlx.nn.RMSNorm, HF
// LlamaRMSNorm) and LayerNorm (Ba et al. 2016; torch.nn.LayerNorm, mlx.nn.LayerNorm).


namespace nn {

namespace detail {

template <class B>
void check_norm_weight(const GTape<B>& tp, GVar x, GVar w, const char* layer, const char* what) {
  layer_same_dtype(tp, x, w, layer, "x", what);
  const Shape &xs = tp.shape(x), &ws = tp.shape(w);
  if (ws.rank() != 1 || xs.rank() < 1 || ws[0] != xs.dim(-1))
    fail(layer, what, " ", ws.str(), " does not match x ", xs.str(), ": expected (", xs.rank() ? xs.dim(-1) : 0, ")");
}

template <class B>
void check_norm_input(const GTape<B>& tp, GVar x, double eps, const char* layer) {
  layer_float(tp, x, layer, "x");
  if (tp.shape(x).rank() < 1 || tp.shape(x).dim(-1) == 0)
    fail(layer, "x must have a non-empty last axis, got ", tp.shape(x).str());
  if (!(eps >= 0)) fail(layer, "eps must be >= 0, got ", eps);
}

}  // namespace detail

namespace reference {

/// RMSNorm composed from primitives, the reference the fused primitive is tested against
/// (tests/ops/fused.test.cpp).  x: (..., C) -> (..., C).
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  GVar ms = mean(tp, mul(tp, x, x), {-1}, true);  // (..., 1)
  return mul(tp, x, rsqrt(tp, add_scalar(tp, ms, eps)));
}
/// The same with a gain w: (C).
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, GVar w, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  detail::check_norm_weight(tp, x, w, "rmsnorm", "weight");
  return mul(tp, reference::rmsnorm(tp, x, eps), w);
}

}  // namespace reference

/// y = x / sqrt(mean(x^2) + eps), over the last axis, without a gain.  x: (..., C) -> (..., C).
/// One fused primitive (ops/norm.hpp); reference::rmsnorm is the same math composed.
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  return fused_rmsnorm(tp, x, GVar{}, eps);
}

/// y = x / sqrt(mean(x^2) + eps) * w.  x: (..., C), w: (C) -> (..., C).
/// The order (normalise, then scale by w) is HF's Qwen2/Llama RMSNorm and MLX's fast.rms_norm.
template <class B>
GVar rmsnorm(GTape<B>& tp, GVar x, GVar w, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "rmsnorm");
  detail::check_norm_weight(tp, x, w, "rmsnorm", "weight");
  return fused_rmsnorm(tp, x, w, eps);
}

/// y = (x - mean) / sqrt(var + eps), biased variance over the last axis, no affine.
/// x: (..., C) -> (..., C).
template <class B>
GVar layernorm(GTape<B>& tp, GVar x, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "layernorm");
  GVar xc = sub(tp, x, mean(tp, x, {-1}, true));
  GVar var = mean(tp, mul(tp, xc, xc), {-1}, true);  // (..., 1)
  return mul(tp, xc, rsqrt(tp, add_scalar(tp, var, eps)));
}

/// LayerNorm with a gain and no bias (torch.nn.LayerNorm(bias=False)).  w: (C).
template <class B>
GVar layernorm(GTape<B>& tp, GVar x, GVar w, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "layernorm");
  detail::check_norm_weight(tp, x, w, "layernorm", "weight");
  return mul(tp, layernorm(tp, x, eps), w);
}

/// LayerNorm with gain and bias (the default of torch.nn.LayerNorm and mlx.nn.LayerNorm).
/// w, b: (C).
template <class B>
GVar layernorm(GTape<B>& tp, GVar x, GVar w, GVar b, double eps = 1e-5) {
  detail::check_norm_input(tp, x, eps, "layernorm");
  detail::check_norm_weight(tp, x, w, "layernorm", "weight");
  detail::check_norm_weight(tp, x, b, "layernorm", "bias");
  return add(tp, mul(tp, layernorm(tp, x, eps), w), b);
}

}  // namespace nn
// ---- end nn/layers/norm.hpp ----
// ---- begin nn/layers/activations.hpp ----
// Activations at layer level: SiLU, the three GELUs with MLX's definitions, the soft cap and
// SwiGLU.
// relu, sigmoid, tanh, softmax and log_softmax are primitives already (nn::relu etc. in
// ops/elementwise.hpp and ops/softmax.hpp); they are not redefined here.

#include <cmath>


namespace nn {

/// x * sigmoid(x) (Elfwing et al. 2017; mlx.nn.silu, torch.nn.functional.silu).
template <class B>
GVar silu(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "silu", "x");
  return unary(tp, Unary::silu, x);
}

/// 0.5 x (1 + erf(x / sqrt 2)), the exact GELU (Hendrycks & Gimpel 2016; mlx.nn.gelu,
/// torch.nn.functional.gelu).
template <class B>
GVar gelu(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "gelu", "x");
  return unary(tp, Unary::gelu, x);
}

/// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))) (mlx.nn.gelu_approx; torch's
/// gelu(approximate="tanh")).
template <class B>
GVar gelu_approx(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "gelu_approx", "x");
  return unary(tp, Unary::gelu_approx, x);
}

/// x * sigmoid(1.702 x) (mlx.nn.gelu_fast_approx, "QuickGELU").
template <class B>
GVar gelu_fast_approx(GTape<B>& tp, GVar x) {
  detail::layer_float(tp, x, "gelu_fast_approx", "x");
  return unary(tp, Unary::gelu_fast, x);
}

/// cap * tanh(x / cap), a soft cap that keeps |y| < cap (Gemma 2's attn_logit_softcapping on
/// attention scores, final_logit_softcapping on logits; SoftcapMath in backend/math.hpp is the
/// same math inside flash attention's tiles).
template <class B>
GVar softcap(GTape<B>& tp, GVar x, double cap) {
  detail::layer_float(tp, x, "softcap", "x");
  if (!(cap > 0) || !std::isfinite(cap)) detail::fail("softcap", "cap must be finite and > 0, got ", cap);
  return scale(tp, unary(tp, Unary::tanh, scale(tp, x, 1.0 / cap)), cap);
}

namespace detail {
template <class B>
void check_swiglu(const GTape<B>& tp, GVar gate, GVar up) {
  layer_same_dtype(tp, gate, up, "swiglu", "gate", "up");
  if (!(tp.shape(gate) == tp.shape(up)))
    fail("swiglu", "gate ", tp.shape(gate).str(), " and up ", tp.shape(up).str(), " must have the same shape");
}
}  // namespace detail

namespace reference {
/// SwiGLU composed from primitives, the reference the fused primitive is tested against.
template <class B>
GVar swiglu(GTape<B>& tp, GVar gate, GVar up) {
  detail::check_swiglu(tp, gate, up);
  return mul(tp, silu(tp, gate), up);
}
}  // namespace reference

/// silu(gate) * up (Shazeer 2020, "GLU Variants Improve Transformer"; the Llama / Qwen2 MLP).
/// gate, up: (..., I) -> (..., I). One fused primitive (ops/glu.hpp).
template <class B>
GVar swiglu(GTape<B>& tp, GVar gate, GVar up) {
  detail::check_swiglu(tp, gate, up);
  return fused_swiglu(tp, gate, up);
}

}  // namespace nn
// ---- end nn/layers/activations.hpp ----
// ---- begin nn/layers/rope.hpp ----
// Rotary position embedding (Su et al. 2021, "RoFormer"): the cos/sin tables and the rotation,
// in the NEOX half-split form (mlx.nn.RoPE traditional=False, HF rotate_half) and the original
// interleaved form (traditional=True), on the first `dims` features only.

#include <cmath>


namespace nn {

/// cos and sin of the rotation angles, each (T, dims/2):
///   angle[t, i] = (t + offset) * scale * base^(-i / (dims/2)),  i < dims/2
/// (mlx.nn.RoPE / mlx.fast.rope: positions scaled by `scale`; HF's inv_freq = 1/base^(2i/dims)).
/// Angles are computed in double, then rounded once to `dtype`.
struct RopeTable {
  Tensor cos, sin;
};

inline RopeTable rope_fill(std::int64_t T, std::int64_t dims, double base = 10000.0, double scale = 1.0,
                           std::int64_t offset = 0, DType dtype = DType::f32) {
  if (T < 0 || dims <= 0 || dims % 2 != 0)
    detail::fail("rope_fill", "needs T >= 0 and an even dims > 0, got T = ", T, ", dims = ", dims);
  if (!(base > 0)) detail::fail("rope_fill", "base must be > 0, got ", base);
  if (!is_floating(dtype)) detail::fail("rope_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t half = dims / 2;
  std::vector<double> c(static_cast<std::size_t>(T * half)), s(c.size());
  for (std::int64_t i = 0; i < half; ++i) {
    const double inv_freq = std::pow(base, -static_cast<double>(i) / static_cast<double>(half));
    for (std::int64_t t = 0; t < T; ++t) {
      const double a = static_cast<double>(t + offset) * scale * inv_freq;
      c[static_cast<std::size_t>(t * half + i)] = std::cos(a);
      s[static_cast<std::size_t>(t * half + i)] = std::sin(a);
    }
  }
  return {Tensor::from_doubles(Shape{T, half}, c, dtype), Tensor::from_doubles(Shape{T, half}, s, dtype)};
}

/// The tables registered as constants on a tape (on its backend's device), in `dtype`, or else in
/// the tape's float dtype (GTape::float_dtype).
struct RopeVars {
  GVar cos, sin;
};

template <class B>
RopeVars rope_fill(GTape<B>& tp, std::int64_t T, std::int64_t dims, double base = 10000.0, double scale = 1.0,
                   std::int64_t offset = 0, std::optional<DType> dtype = std::nullopt) {
  RopeTable t = rope_fill(T, dims, base, scale, offset, dtype.value_or(tp.float_dtype()));
  return {tp.constant(detail::on_backend<B>(t.cos)), tp.constant(detail::on_backend<B>(t.sin))};
}

namespace detail {

template <class B>
void check_rope(const GTape<B>& tp, GVar x, GVar cos, GVar sin, const char* layer) {
  layer_same_dtype(tp, x, cos, layer, "x", "cos");
  layer_same_dtype(tp, x, sin, layer, "x", "sin");
  const Shape &xs = tp.shape(x), &cs = tp.shape(cos), &ss = tp.shape(sin);
  if (!(cs == ss)) fail(layer, "cos ", cs.str(), " and sin ", ss.str(), " must have the same shape");
  if (xs.rank() < 2 || cs.rank() < 2)
    fail(layer, "x must be (..., T, D) and cos/sin (..., T, dims/2), got x ", xs.str(), " and cos ", cs.str());
  if (2 * cs.dim(-1) > xs.dim(-1))
    fail(layer, "cos/sin ", cs.str(), " rotate ", 2 * cs.dim(-1), " features but x ", xs.str(), " has only ",
         xs.dim(-1));
  Shape rot = xs;
  rot[rot.rank() - 1] = cs.dim(-1);
  if (!broadcasts_to(cs, rot))
    fail(layer, "cos/sin ", cs.str(), " do not broadcast against x ", xs.str(), " (expected (T, dims/2) = (",
         xs.dim(-2), ", ", cs.dim(-1), ") or a broadcastable batch of it)");
}

}  // namespace detail

namespace reference {

/// RoPE composed from primitives (slices, products, concat): the reference the fused primitive
/// is tested against, and the path for table shapes the fused one does not take. The contract
/// is nn::rope's (below).
template <class B>
GVar rope(GTape<B>& tp, GVar x, GVar cos, GVar sin, bool traditional = false) {
  detail::check_rope(tp, x, cos, sin, "rope");
  const Shape xs = tp.shape(x);  // a copy: used after recording
  const std::int64_t D = xs.dim(-1), half = tp.shape(cos).dim(-1), dims = 2 * half;
  GVar rotated;
  if (!traditional) {
    GVar x1 = slice(tp, x, -1, 0, half);     // (..., T, dims/2)
    GVar x2 = slice(tp, x, -1, half, dims);  // (..., T, dims/2)
    GVar o1 = sub(tp, mul(tp, x1, cos), mul(tp, x2, sin));
    GVar o2 = add(tp, mul(tp, x1, sin), mul(tp, x2, cos));
    rotated = concat(tp, {o1, o2}, -1);
  } else {
    // View the rotated features as (..., T, dims/2, 2) pairs and the tables as (..., T, dims/2, 1).
    GVar xr = dims == D ? x : slice(tp, x, -1, 0, dims);
    Shape pairs = xs;
    pairs[pairs.rank() - 1] = half;
    pairs.push_back(2);
    xr = detail::view(tp, xr, pairs);
    Shape tab = tp.shape(cos);
    tab.push_back(1);
    GVar c = detail::view(tp, cos, tab), s = detail::view(tp, sin, tab);
    GVar x1 = slice(tp, xr, -1, 0, 1), x2 = slice(tp, xr, -1, 1, 2);  // (..., T, dims/2, 1)
    GVar o1 = sub(tp, mul(tp, x1, c), mul(tp, x2, s));
    GVar o2 = add(tp, mul(tp, x1, s), mul(tp, x2, c));
    Shape flat = xs;
    flat[flat.rank() - 1] = dims;
    rotated = detail::view(tp, concat(tp, {o1, o2}, -1), flat);
  }
  if (dims == D) return rotated;
  return concat(tp, {rotated, slice(tp, x, -1, dims, D)}, -1);
}

}  // namespace reference

/// Rotates pairs of the first dims = 2 * cos.shape[-1] features of x by the table's angles; the
/// features past dims pass through unchanged.
///   x: (..., T, D), cos/sin: (T, dims/2) (or anything broadcasting to (..., T, dims/2)).
/// NEOX form (traditional = false, the default as in mlx.nn.RoPE and HF Llama/Qwen2): the pairs
/// are (x[i], x[i + dims/2]).  Traditional form: the pairs are (x[2i], x[2i + 1]).
///   (a, b) -> (a cos - b sin, a sin + b cos)
/// Tables (T, dims/2) — or (T, 1, dims/2) against x (..., T, M, D) — that need no gradient take
/// the fused primitive (ops/rope.hpp); other broadcasts take reference::rope, the same math.
template <class B>
GVar rope(GTape<B>& tp, GVar x, GVar cos, GVar sin, bool traditional = false) {
  detail::check_rope(tp, x, cos, sin, "rope");
  if (fused_rope_fits(tp.shape(x), tp.shape(cos)) && !tp.requires_grad(cos) && !tp.requires_grad(sin))
    return fused_rope(tp, x, cos, sin, traditional);
  return reference::rope(tp, x, cos, sin, traditional);
}

}  // namespace nn
// ---- end nn/layers/rope.hpp ----
// ---- begin nn/layers/mask.hpp ----
// Additive attention masks: 0 where a query may attend to a key, a large negative where it may
// not (added to the scores before the softmax), as mlx.nn.MultiHeadAttention.create_additive_causal_mask
// and Hugging Face's 4-D attention masks.

#include <limits>


namespace nn {

/// The default masked value: MLX's -1e9. Finite on purpose: a row whose keys are all masked
/// gets a uniform softmax instead of the NaN that -inf would give (as HF's finfo.min does), and
/// exp(-1e9 - max) is exactly 0, so a masked key contributes exactly nothing.
inline constexpr double kMaskedValue = -1e9;

/// Causal mask (T, T + offset): entry (i, j) is `masked` when key j lies after query i, i.e.
/// j > i + offset (queries are the last T of T + offset positions, as with a KV cache).
inline Tensor causal_mask_fill(std::int64_t T, DType dtype = DType::f32, double masked = kMaskedValue,
                               std::int64_t offset = 0) {
  if (T < 0 || offset < 0) detail::fail("causal_mask_fill", "needs T >= 0 and offset >= 0, got T = ", T, ", offset = ", offset);
  if (!is_floating(dtype)) detail::fail("causal_mask_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t S = T + offset;
  std::vector<double> m(static_cast<std::size_t>(T * S));
  for (std::int64_t i = 0; i < T; ++i)
    for (std::int64_t j = 0; j < S; ++j) m[static_cast<std::size_t>(i * S + j)] = j > i + offset ? masked : 0.0;
  return Tensor::from_doubles(Shape{T, S}, m, dtype);
}

namespace detail {
inline void check_keep(const Tensor& keep, const char* op) {
  if (!keep.defined() || keep.rank() != 2)
    fail(op, "keep must be (B, S) with 1 for a real token and 0 for padding, got ",
         keep.defined() ? keep.shape().str() : std::string("an empty tensor"));
  if (keep.device() != Device::cpu) fail(op, "keep must be a host tensor, got one on ", keep.device());
}
}  // namespace detail

/// Key-padding mask (B, 1, 1, S) from keep (B, S) (nonzero = a real token): `masked` on the
/// padded keys of each sequence, for every head and query.
inline Tensor padding_mask_fill(const Tensor& keep, DType dtype = DType::f32, double masked = kMaskedValue) {
  detail::check_keep(keep, "padding_mask_fill");
  if (!is_floating(dtype)) detail::fail("padding_mask_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t Bn = keep.dim(0), S = keep.dim(1);
  std::vector<double> m(static_cast<std::size_t>(Bn * S));
  for (std::int64_t i = 0; i < Bn * S; ++i) m[static_cast<std::size_t>(i)] = keep.item(i) != 0 ? 0.0 : masked;
  return Tensor::from_doubles(Shape{Bn, 1, 1, S}, m, dtype);
}

/// Causal and key-padding mask together (B, 1, T, T): the 4-D mask HF builds for a padded
/// batch. keep: (B, T).
inline Tensor attention_mask_fill(const Tensor& keep, DType dtype = DType::f32, double masked = kMaskedValue) {
  detail::check_keep(keep, "attention_mask_fill");
  if (!is_floating(dtype)) detail::fail("attention_mask_fill", "dtype must be floating point, got ", dtype_name(dtype));
  const std::int64_t Bn = keep.dim(0), T = keep.dim(1);
  std::vector<double> m(static_cast<std::size_t>(Bn * T * T));
  for (std::int64_t b = 0; b < Bn; ++b)
    for (std::int64_t i = 0; i < T; ++i)
      for (std::int64_t j = 0; j < T; ++j)
        m[static_cast<std::size_t>((b * T + i) * T + j)] = (j <= i && keep.item(b * T + j) != 0) ? 0.0 : masked;
  return Tensor::from_doubles(Shape{Bn, 1, T, T}, m, dtype);
}

/// The tape forms register the mask as a constant on the tape's device, in the tape's float dtype
/// (GTape::float_dtype) unless given one. (A mask that changes
/// between replays, e.g. padding per batch, belongs in an input slot: nn::input(tp, mask).)
template <class B>
GVar causal_mask_fill(GTape<B>& tp, std::int64_t T, std::optional<DType> dtype = std::nullopt,
                      double masked = kMaskedValue, std::int64_t offset = 0) {
  return tp.constant(detail::on_backend<B>(causal_mask_fill(T, dtype.value_or(tp.float_dtype()), masked, offset)));
}
template <class B>
GVar attention_mask_fill(GTape<B>& tp, const Tensor& keep, std::optional<DType> dtype = std::nullopt,
                         double masked = kMaskedValue) {
  return tp.constant(detail::on_backend<B>(attention_mask_fill(keep, dtype.value_or(tp.float_dtype()), masked)));
}

}  // namespace nn
// ---- end nn/layers/mask.hpp ----
// ---- begin nn/layers/attention.hpp ----
// Multi-head attention with grouped-query sharing (Vaswani et al. 2017; Ainslie et al. 2023,
// "GQA"), as HF's LlamaAttention / Qwen2Attention compute it: per-head RoPE, scaled scores, an
// additive mask, softmax, weighted sum of values, heads concatenated.


namespace nn {

/// Head h's slice of a packed projection.  x: (..., n * head_dim) -> (..., head_dim).
template <class B>
GVar head(GTape<B>& tp, GVar x, std::int64_t h, std::int64_t head_dim) {
  const Shape& xs = tp.shape(x);
  if (xs.rank() < 1 || head_dim <= 0 || xs.dim(-1) % head_dim != 0)
    detail::fail("head", "x ", xs.str(), " is not a whole number of heads of size ", head_dim);
  const std::int64_t n = xs.dim(-1) / head_dim;
  if (h < 0 || h >= n) detail::fail("head", "head ", h, " out of range: x ", xs.str(), " holds ", n, " heads of size ", head_dim);
  return slice(tp, x, -1, h * head_dim, (h + 1) * head_dim);
}

namespace detail {

/// Checks that a mask broadcasts against the scores (B, n_heads, T, T) (left-padded with 1s as
/// NumPy broadcasting does; its last dim must be T).
template <class B>
void check_gqa_mask(const GTape<B>& tp, GVar mask, std::int64_t Bn, std::int64_t T, std::int64_t nh) {
  const Shape& ms = tp.shape(mask);
  if (ms.rank() < 1 || ms.rank() > 4 || ms.dim(-1) != T || !broadcasts_to(ms, Shape{Bn, nh, T, T}))
    fail("gqa_attention", "mask ", ms.str(), " does not broadcast against the scores (B, n_heads, T, T) = (", Bn,
         ", ", nh, ", ", T, ", ", T, ")");
}

/// The mask as a rank-5 view that broadcasts against the grouped scores (B, n_kv, group, T, T):
/// a mask of (B | 1, n_heads | 1, T | 1, T), left-padded with 1s as NumPy broadcasting does.
template <class B>
GVar grouped_mask(GTape<B>& tp, GVar mask, std::int64_t Bn, std::int64_t T, std::int64_t nh, std::int64_t nkv) {
  check_gqa_mask(tp, mask, Bn, T, nh);
  const Shape& ms = tp.shape(mask);
  std::int64_t d[4] = {1, 1, 1, 1};
  for (int i = 0; i < ms.rank(); ++i) d[4 - ms.rank() + i] = ms[i];
  const bool per_head = d[1] == nh && nh > 1;
  return view(tp, mask, Shape{d[0], per_head ? nkv : 1, per_head ? nh / nkv : 1, d[2], d[3]});
}

/// gqa_attention's argument checks; returns B (the batch: q's rows / T).
template <class B>
std::int64_t check_gqa(const GTape<B>& tp, GVar q, GVar k, GVar v, std::int64_t T, std::int64_t n_heads,
                       std::int64_t n_kv_heads, std::int64_t head_dim) {
  const char* L = "gqa_attention";
  layer_same_dtype(tp, q, k, L, "q", "k");
  layer_same_dtype(tp, q, v, L, "q", "v");
  if (T <= 0 || n_heads <= 0 || n_kv_heads <= 0 || head_dim <= 0 || n_heads % n_kv_heads != 0)
    fail(L, "needs T, head_dim > 0 and n_heads a positive multiple of n_kv_heads, got T = ", T,
         ", n_heads = ", n_heads, ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim);
  const Shape &qs = tp.shape(q), &ks = tp.shape(k), &vs = tp.shape(v);
  const std::int64_t qc = n_heads * head_dim, kc = n_kv_heads * head_dim;
  const bool ranks_ok = (qs.rank() == 2 || qs.rank() == 3) && ks.rank() == qs.rank() && vs.rank() == qs.rank();
  if (!ranks_ok || qs.dim(-1) != qc || ks.dim(-1) != kc || vs.dim(-1) != kc ||
      (qs.rank() == 3 && qs[1] != T) || qs.prod(0, qs.rank() - 1) % T != 0 ||
      ks.prod(0, ks.rank() - 1) != qs.prod(0, qs.rank() - 1) || !(ks == vs))
    fail(L, "q ", qs.str(), ", k ", ks.str(), ", v ", vs.str(), " do not fit T = ", T, ", n_heads = ", n_heads,
         ", n_kv_heads = ", n_kv_heads, ", head_dim = ", head_dim, ": expected q (B, T, ", qc,
         ") and k, v (B, T, ", kc, ") (or rows B*T)");
  return qs.prod(0, qs.rank() - 1) / T;
}

/// gqa_attention's RoPE table checks (both tables or neither; (T, dims/2), dims <= head_dim).
template <class B>
void check_gqa_rope(const GTape<B>& tp, GVar k, GVar cos, GVar sin, std::int64_t Bn, std::int64_t T,
                    std::int64_t nkv, std::int64_t hd) {
  const char* L = "gqa_attention";
  if (!cos.valid() || !sin.valid()) fail(L, "pass both cos and sin, or neither");
  layer_same_dtype(tp, k, cos, L, "x", "cos");
  layer_same_dtype(tp, k, sin, L, "x", "sin");
  const Shape &cs = tp.shape(cos), &ss = tp.shape(sin);
  if (!(cs == ss)) fail(L, "cos ", cs.str(), " and sin ", ss.str(), " must have the same shape");
  if (cs.rank() != 2 || (cs[0] != T && cs[0] != Bn * T))
    fail(L, "cos/sin must be (T, dims/2) with T = ", T, " (or per token, (B * T, dims/2)), got ", cs.str());
  if (2 * cs[1] > hd)
    fail(L, "cos/sin ", cs.str(), " rotate ", 2 * cs[1], " features but a head has only ", hd,
         " (k as heads: (", Bn, ", ", nkv, ", ", T, ", ", hd, "))");
}

}  // namespace detail

namespace reference {

/// Grouped-query attention composed from primitives (permutes, RoPE, batched matmuls, softmax):
/// the reference the fused primitive is tested against, and the path when the tables or the mask
/// need a gradient. The contract is nn::gqa_attention's (below). q is viewed as
/// (B, n_kv, group, T, head_dim) and merged to (B, n_kv, group*T, head_dim), so one batched
/// matmul per kv head serves its whole group: K and V are never repeated, and their gradients
/// sum over the group inside that matmul's vjp. `scale` multiplies q after RoPE — the same
/// product as scaling the scores, on head_dim columns instead of T. `softcap` > 0 caps the
/// scaled scores (nn::softcap) before the mask is added, as transformers' Gemma 2.
template <class B>
GVar gqa_attention(GTape<B>& tp, GVar q, GVar k, GVar v, GVar cos, GVar sin, GVar mask, std::int64_t T,
                   std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, double scale,
                   bool traditional = false, double softcap = 0) {
  const Shape qs = tp.shape(q);  // a copy: used after recording
  const std::int64_t Bn = detail::check_gqa(tp, q, k, v, T, n_heads, n_kv_heads, head_dim);
  const std::int64_t nkv = n_kv_heads, g = n_heads / n_kv_heads, hd = head_dim;
  GVar qh = permute(tp, detail::view(tp, q, Shape{Bn, T, nkv, g, hd}), {0, 2, 3, 1, 4});  // (B, nkv, g, T, hd)
  GVar kh = permute(tp, detail::view(tp, k, Shape{Bn, T, nkv, hd}), {0, 2, 1, 3});        // (B, nkv, T, hd)
  GVar vh = permute(tp, detail::view(tp, v, Shape{Bn, T, nkv, hd}), {0, 2, 1, 3});        // (B, nkv, T, hd)
  if (cos.valid() || sin.valid()) {
    detail::check_gqa_rope(tp, k, cos, sin, Bn, T, nkv, hd);
    qh = reference::rope(tp, qh, cos, sin, traditional);
    kh = reference::rope(tp, kh, cos, sin, traditional);
  }
  qh = nn::scale(tp, qh, scale);
  GVar scores = matmul(tp, detail::view(tp, qh, Shape{Bn, nkv, g * T, hd}), kh, false, true);  // (B, nkv, g*T, T)
  if (softcap > 0) scores = nn::softcap(tp, scores, softcap);
  if (mask.valid()) {
    detail::layer_same_dtype(tp, q, mask, "gqa_attention", "q", "mask");
    GVar m = detail::grouped_mask(tp, mask, Bn, T, n_heads, nkv);
    scores = add(tp, detail::view(tp, scores, Shape{Bn, nkv, g, T, T}), m);  // (B, nkv, g, T, T)
  }
  GVar p = softmax(tp, scores);
  GVar ctx = matmul(tp, detail::view(tp, p, Shape{Bn, nkv, g * T, T}), vh);  // (B, nkv, g*T, hd)
  ctx = permute(tp, detail::view(tp, ctx, Shape{Bn, nkv, g, T, hd}), {0, 3, 1, 2, 4});  // (B, T, nkv, g, hd)
  return detail::view(tp, ctx, qs);
}

}  // namespace reference

namespace detail {

/// gqa_attention's body: causal adds the causal structure (fused) or mask (composite); a window
/// or a soft cap runs flash attention.
template <class B>
GVar gqa_attention(GTape<B>& tp, GVar q, GVar k, GVar v, GVar cos, GVar sin, GVar mask, bool causal, std::int64_t T,
                   std::int64_t n_heads, std::int64_t n_kv_heads, std::int64_t head_dim, double scale,
                   bool traditional, GVar starts = GVar{}, std::int64_t window = 0, double softcap = 0) {
  const Shape qs = tp.shape(q), ks = tp.shape(k);  // copies: used after recording
  const std::int64_t Bn = detail::check_gqa(tp, q, k, v, T, n_heads, n_kv_heads, head_dim);
  const bool roped = cos.valid() || sin.valid();
  if (roped) detail::check_gqa_rope(tp, k, cos, sin, Bn, T, n_kv_heads, head_dim);
  // per-token tables (B * T, dims/2): positions that restart inside a row (packed documents)
  const bool per_token = roped && Bn > 1 && tp.shape(cos)[0] == Bn * T;
  if (starts.valid()) {
    if (!causal || mask.valid()) fail("gqa_attention", "doc_starts need causal attention without a mask tensor");
    if constexpr (!detail::HasFlashAttention<B>)
      fail("gqa_attention", "doc_starts (packed rows) need flash attention, which the ", B::name, " backend lacks");
  }
  // a window or a soft cap: flash attention's options (fold a window into a mask tensor, or cap
  // with reference::gqa_attention, where it cannot run)
  const bool flash_only = window != 0 || softcap != 0;
  if (flash_only) {
    if (!causal && window != 0) fail("gqa_attention", "a sliding window needs causal attention");
    if (mask.valid()) fail("gqa_attention", "window and softcap run in flash attention, which takes no mask tensor");
    if constexpr (!detail::HasFlashAttention<B>)
      fail("gqa_attention", "window and softcap need flash attention, which the ", B::name, " backend lacks");
  }
  if (mask.valid()) {
    detail::layer_same_dtype(tp, q, mask, "gqa_attention", "q", "mask");
    detail::check_gqa_mask(tp, mask, Bn, T, n_heads);
  }
  if ((roped && (tp.requires_grad(cos) || tp.requires_grad(sin))) || (mask.valid() && tp.requires_grad(mask))) {
    if (per_token || starts.valid() || flash_only)
      fail("gqa_attention", "per-token RoPE tables, doc_starts, window and softcap need constant tables and mask");
    if (causal) mask = causal_mask_fill(tp, T, tp.dtype(q));
    return reference::gqa_attention(tp, q, k, v, cos, sin, mask, T, n_heads, n_kv_heads, head_dim, scale, traditional);
  }
  if (roped) {
    // The tables (T, dims/2) as (T, 1, dims/2): every head of a position turns by its angles
    // (per-token tables: (B * T, 1, dims/2) against the heads of each of the B * T rows).
    const std::int64_t half = tp.shape(cos)[1], P = per_token ? Bn * T : T, Bq = per_token ? 1 : Bn;
    GVar c = detail::view(tp, cos, Shape{P, 1, half}), s = detail::view(tp, sin, Shape{P, 1, half});
    q = detail::view(tp, fused_rope(tp, detail::view(tp, q, Shape{Bq, P, n_heads, head_dim}), c, s, traditional), qs);
    k = detail::view(tp, fused_rope(tp, detail::view(tp, k, Shape{Bq, P, n_kv_heads, head_dim}), c, s, traditional), ks);
  }
  if constexpr (detail::HasFlashAttention<B>)
    if (!mask.valid() && (T >= detail::kFlashMinT || starts.valid() || flash_only))
      return flash_attention(tp, q, k, v, T, n_heads, n_kv_heads, head_dim, scale, causal, starts, window, softcap);
  return fused_attention(tp, q, k, v, mask, T, n_heads, n_kv_heads, head_dim, scale, causal);
}

}  // namespace detail

/// gqa_attention's arguments by name, for the form that cannot mix up its four integers:
///   gqa_attention(tp, q, k, v, {.T = T, .n_heads = 8, .n_kv_heads = 2, .head_dim = 64,
///                               .cos = rope.cos, .sin = rope.sin, .causal = true});
/// (Designated initializers go in declaration order; leave out what you do not need.)
struct AttentionOptions {
  std::int64_t T = 0;           // the sequence length (q's rows split into (B, T))
  std::int64_t n_heads = 0;     // query heads
  std::int64_t n_kv_heads = 0;  // key/value heads; 0: n_heads (MHA)
  std::int64_t head_dim = 0;
  double scale = 0;             // multiplies the scores; 0: 1 / sqrt(head_dim)
  GVar cos{}, sin{};            // RoPE tables from rope_fill; none when empty
  GVar mask{};                  // additive, broadcasting to (B, n_heads, T, T); none when empty
  bool causal = false;          // query i sees keys 0..i, with or without a mask, no (T, T) tensor
  bool traditional = false;     // interleaved RoPE pairs (2i, 2i + 1) instead of NEOX halves
  // Packed rows (causal, no mask): (B, T) int32, where each position's document begins; a query
  // sees only its own document's keys (flash_attention's starts). cos/sin may then be per token,
  // (B * T, dims/2), so that positions restart at each document.
  GVar doc_starts{};
  // Causal only: query i sees keys i - window < j <= i (transformers' sliding window); 0: none.
  std::int64_t window = 0;
  // > 0: the scores are capped to softcap * tanh(s / softcap) before the softmax (Gemma 2).
  double softcap = 0;
};

/// Grouped-query attention over packed projections.
///   q: (B, T, n_heads * head_dim)     k, v: (B, T, n_kv_heads * head_dim)
///   (or the same with B and T merged into rows: (B*T, ...), which T splits)
///   .cos, .sin: RoPE tables (T, dims/2) from rope_fill, dims <= head_dim; none: no RoPE
///   .mask: additive, broadcasting against (B, n_heads, T, T) — (T, T) causal, (B, 1, T, T)
///          causal + padding (attention_mask_fill); none: no mask
///   .causal: query i sees keys 0..i with no (T, T) tensor read and the products above the
///            diagonal skipped (about half the work); with or without a mask
///   .window, .softcap: a sliding window (causal) and a soft cap on the scores, in flash
///            attention only (no mask tensor; backends with the flash kernels: the CPU's)
///   -> (B, T, n_heads * head_dim) (the rank of q), heads concatenated in order.
/// n_heads must be a multiple of n_kv_heads: query head h reads kv head h / (n_heads / n_kv_heads)
/// (HF's repeat_kv); n_kv_heads == n_heads is MHA, n_kv_heads == 1 is MQA.
///
/// Runs as RoPE on q and k in place of layout (B, T, n, head_dim), then one fused attention
/// primitive (ops/attention.hpp: per-head strided GEMMs, mask and softmax in place, no head
/// permutes). Without a mask tensor and from T = detail::kFlashMinT on, that primitive is
/// flash_attention, which never stores the (T, T) probabilities. `.scale` (default
/// 1/sqrt(head_dim)) multiplies the scores. When the tables or the mask need a gradient,
/// reference::gqa_attention computes the same thing from primitives. `.traditional` selects the
/// interleaved RoPE.
///
/// The seed's positional form (tp, q, k, v, cos, sin, mask, T, n_heads, n_kv_heads, head_dim,
/// scale) is gone from the public API: four adjacent integers that compile in any order. Its
/// fields map one to one onto the options; reference::gqa_attention keeps that order.
template <class B>
GVar gqa_attention(GTape<B>& tp, GVar q, GVar k, GVar v, const AttentionOptions& o) {
  const std::int64_t n_kv = o.n_kv_heads == 0 ? o.n_heads : o.n_kv_heads;
  if (o.head_dim <= 0) detail::fail("gqa_attention", "options need head_dim > 0, got ", o.head_dim);
  const double scale = o.scale != 0 ? o.scale : 1.0 / std::sqrt(static_cast<double>(o.head_dim));
  return detail::gqa_attention(tp, q, k, v, o.cos, o.sin, o.mask, o.causal, o.T, o.n_heads, n_kv, o.head_dim, scale,
                               o.traditional, o.doc_starts, o.window, o.softcap);
}

}  // namespace nn
// ---- end nn/layers/attention.hpp ----
// ---- begin nn/layers/embedding.hpp ----
// Token embedding: rows of a table looked up by integer ids (torch.nn.Embedding, mlx.nn.Embedding).


namespace nn {

/// ids: (...) int32/int64, table: (vocab, C) -> (..., C).
/// The gradient scatter-adds into the table's rows, so a repeated id accumulates (the
/// gather_rows primitive); an id outside [0, vocab) raises on every run, replays included.
template <class B>
GVar embedding(GTape<B>& tp, GVar ids, GVar table) {
  if (tp.dtype(table) != DType::bf16) detail::layer_float(tp, table, "embedding", "table");
  DType it = tp.dtype(ids);
  if (it != DType::i32 && it != DType::i64)
    detail::fail("embedding", "ids must be int32 or int64, got ", detail::desc(tp, ids));
  if (tp.shape(table).rank() != 2)
    detail::fail("embedding", "table must be (vocab, C), got ", tp.shape(table).str(), " (ids ", tp.shape(ids).str(), ")");
  return gather_rows(tp, table, ids);
}

}  // namespace nn
// ---- end nn/layers/embedding.hpp ----
// ---- begin nn/layers/loss.hpp ----
// Cross-entropy losses (torch.nn.functional.cross_entropy, mlx.nn.losses.cross_entropy) and the
// next-token form over the first N rows of a sequence (the seed's nn_cross_entropy_rows).


namespace nn {

namespace detail {

template <class B>
GVar reduce_rows(GTape<B>& tp, GVar rows, Reduction reduction) {
  if (reduction == Reduction::none) return rows;
  return reduction == Reduction::sum ? sum(tp, rows) : mean(tp, rows);
}

/// -sum_j p_j log softmax(x)_j per row: probability (or one-hot, or label-smoothed) targets.
template <class B>
GVar prob_cross_entropy_rows(GTape<B>& tp, GVar logits, GVar probs) {
  if (!(tp.shape(logits) == tp.shape(probs)))
    fail("cross_entropy", "probability targets ", tp.shape(probs).str(), " must have the logits' shape ",
         tp.shape(logits).str());
  layer_same_dtype(tp, logits, probs, "cross_entropy", "logits", "targets");
  return neg(tp, sum(tp, mul(tp, probs, log_softmax(tp, logits)), {-1}));
}

/// keep * rows, reduced: sum -> sum(keep * rows), mean -> sum(keep * rows) / sum(keep).
template <class B>
GVar weighted(GTape<B>& tp, GVar rows, GVar keep, Reduction reduction) {
  GVar w = mul(tp, rows, keep);
  if (reduction == Reduction::none) return w;
  GVar total = sum(tp, w);
  return reduction == Reduction::sum ? total : div(tp, total, sum(tp, keep));
}

template <class B>
void check_logits(const GTape<B>& tp, GVar logits) {
  layer_float(tp, logits, "cross_entropy", "logits");
  if (tp.shape(logits).rank() < 1 || tp.shape(logits).dim(-1) == 0)
    fail("cross_entropy", "logits must be (..., V) with V > 0, got ", tp.shape(logits).str());
}

}  // namespace detail

/// Softmax cross-entropy, classes on the last axis (as MLX).
///   logits: (..., V).  targets: integer class ids (...), or probabilities (..., V) (one-hot,
///   label-smoothed) when float.  -> () for mean / sum, (...) for none.
/// Integer targets go through the fused softmax_cross_entropy primitive: no (..., V) one-hot or
/// log-probabilities are materialised, logits in the thousands are safe (max-subtracted), and a
/// target equal to `ignore_index` (default -100, as PyTorch) is left out, the mean being over
/// the rest. Probability targets: mean over all rows (PyTorch's rule); ignore_index unused.
template <class B>
GVar cross_entropy(GTape<B>& tp, GVar logits, GVar targets, Reduction reduction = Reduction::mean,
                   std::int64_t ignore_index = -100) {
  detail::check_logits(tp, logits);
  if (is_floating(tp.dtype(targets)))
    return detail::reduce_rows(tp, detail::prob_cross_entropy_rows(tp, logits, targets), reduction);
  return softmax_cross_entropy(tp, logits, targets, reduction, ignore_index);
}

/// The same with per-row weights `keep` (...) (1 = count the row, 0 = skip it; mlx-lm's length
/// mask): sum -> sum(keep * loss), mean -> sum(keep * loss) / sum(keep), none -> keep * loss.
/// keep may be a constant or an input slot (set per batch on replay).
template <class B>
GVar cross_entropy(GTape<B>& tp, GVar logits, GVar targets, GVar keep, Reduction reduction = Reduction::mean,
                   std::int64_t ignore_index = -100) {
  detail::check_logits(tp, logits);
  detail::layer_same_dtype(tp, logits, keep, "cross_entropy", "logits", "keep");
  Shape rows_shape = tp.shape(logits);
  Shape expect;
  for (int i = 0; i + 1 < rows_shape.rank(); ++i) expect.push_back(rows_shape[i]);
  if (!(tp.shape(keep) == expect))
    detail::fail("cross_entropy", "keep ", tp.shape(keep).str(), " must have the logits' leading dims ", expect.str(),
                 " (logits ", rows_shape.str(), ")");
  GVar rows = is_floating(tp.dtype(targets)) ? detail::prob_cross_entropy_rows(tp, logits, targets)
                                             : softmax_cross_entropy(tp, logits, targets, Reduction::none, ignore_index);
  return detail::weighted(tp, rows, keep, reduction);
}

namespace detail {
template <class B>
void check_rows(const GTape<B>& tp, GVar logits, GVar targets, std::int64_t n_rows) {
  check_logits(tp, logits);
  const Shape &ls = tp.shape(logits), &ts = tp.shape(targets);
  // integer targets are (..., n_rows); probability targets (..., n_rows, V)
  const int row_axis = is_floating(tp.dtype(targets)) ? 2 : 1;
  if (ls.rank() < 2 || n_rows < 0 || n_rows > ls.dim(-2) || ts.rank() < row_axis || ts.dim(-row_axis) != n_rows)
    fail("cross_entropy_rows", "logits ", ls.str(), " and targets ", ts.str(), " do not fit n_rows = ", n_rows,
         ": expected logits (..., T, V) with T >= n_rows and targets (..., n_rows) (or (..., n_rows, V))");
}
template <class B>
GVar first_rows(GTape<B>& tp, GVar logits, GVar targets, std::int64_t n_rows) {
  check_rows(tp, logits, targets, n_rows);
  return n_rows == tp.shape(logits).dim(-2) ? logits : slice(tp, logits, -2, 0, n_rows);
}
}  // namespace detail

/// Next-token cross-entropy: only the first n_rows positions of each sequence are scored (the
/// last position has no next token; the seed's nn_cross_entropy_rows).
///   logits: (..., T, V), targets: (..., n_rows) (the tokens shifted left), n_rows <= T.
/// With integer targets the fused primitive reads the first n_rows rows in place (no copy of
/// the logits); probability targets (..., n_rows, V) go through a slice.
template <class B>
GVar cross_entropy_rows(GTape<B>& tp, GVar logits, GVar targets, std::int64_t n_rows,
                        Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  if (is_floating(tp.dtype(targets)))
    return cross_entropy(tp, detail::first_rows(tp, logits, targets, n_rows), targets, reduction, ignore_index);
  detail::check_rows(tp, logits, targets, n_rows);
  return softmax_cross_entropy_rows(tp, logits, targets, reduction, ignore_index);
}
/// The same with per-row weights keep (..., n_rows).
template <class B>
GVar cross_entropy_rows(GTape<B>& tp, GVar logits, GVar targets, GVar keep, std::int64_t n_rows,
                        Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  if (is_floating(tp.dtype(targets)))
    return cross_entropy(tp, detail::first_rows(tp, logits, targets, n_rows), targets, keep, reduction, ignore_index);
  detail::check_rows(tp, logits, targets, n_rows);
  detail::layer_same_dtype(tp, logits, keep, "cross_entropy_rows", "logits", "keep");
  if (!(tp.shape(keep) == tp.shape(targets)))
    detail::fail("cross_entropy_rows", "keep ", tp.shape(keep).str(), " must have the targets' shape ",
                 tp.shape(targets).str());
  return detail::weighted(tp, softmax_cross_entropy_rows(tp, logits, targets, Reduction::none, ignore_index), keep,
                          reduction);
}

namespace detail {
/// linear_cross_entropy as two ops: the logits x @ W^T, then cross_entropy (its reference, and
/// what runs where the fused primitive cannot).
template <class B>
GVar linear_cross_entropy_composite(GTape<B>& tp, GVar x, const HeadVars& head, GVar targets, GVar keep,
                                    Reduction reduction, std::int64_t ignore_index) {
  GVar logits = head.quantized() ? quantized_matmul(tp, x, head.codes, head.scales, head.biases, head.q, true)
                                 : matmul(tp, x, head.w, false, true);
  return keep.valid() ? cross_entropy(tp, logits, targets, keep, reduction, ignore_index)
                      : cross_entropy(tp, logits, targets, reduction, ignore_index);
}
}  // namespace detail

/// cross_entropy(x @ W^T, targets[, keep]) for an LM head W (V, C), dense or quantized
/// (HeadVars), without storing the (..., V) logits where the backend has the fused primitive
/// (the CPU's: fused_linear_cross_entropy, ops/linear_cross_entropy.hpp): the same loss and
/// gradients up to rounding, in the memory of one block of the vocabulary. Per-row losses
/// (Reduction::none), a keep that wants a gradient, and other backends take the two ops.
///   x: (..., C), targets: (...) integer, keep: (...) or GVar{} -> () for mean / sum.
template <class B>
GVar linear_cross_entropy(GTape<B>& tp, GVar x, const HeadVars& head, GVar targets, GVar keep = {},
                          Reduction reduction = Reduction::mean, std::int64_t ignore_index = -100) {
  if constexpr (detail::HasLinearCrossEntropy<B>) {
    if (reduction != Reduction::none && !(keep.valid() && tp.requires_grad(keep)) && !is_floating(tp.dtype(targets)))
      return fused_linear_cross_entropy(tp, x, head, targets, keep, reduction, ignore_index);
  }
  return detail::linear_cross_entropy_composite(tp, x, head, targets, keep, reduction, ignore_index);
}

}  // namespace nn
// ---- end nn/layers/loss.hpp ----
// ---- begin nn/layers/dropout.hpp ----
// Dropout as MLX's nn.Dropout: in training, y = x * bernoulli(1 - p, x.shape, key) / (1 - p);
// in evaluation, or with p = 0, y = x.


namespace nn {

/// MLX nn.Dropout(p) (python/mlx/nn/layers/dropout.py) on the tape.
///   x:   (...) float32 or float64
///   key: uint32 (2), an MLX key, normally an input slot (tp.input(nn::random::next_key())): a
///        compiled step sets a fresh key into the slot before each replay, as MLX threads its
///        random state through mx.compile, so each replay draws a new mask, and the masks equal
///        mx.random.bernoulli(1 - p, x.shape, key=k) for the same keys.
/// p outside [0, 1) raises, as MLX does. p = 0 and training = false return x itself (no node;
/// switching mode therefore means recording the step again, as the design has it).
template <class B>
GVar dropout(GTape<B>& tp, GVar x, double p, GVar key, bool training = true) {
  if (!(p >= 0.0 && p < 1.0)) detail::fail("dropout", "the dropout probability ", p, " is not in [0, 1)");
  detail::require_key(tp, key, "dropout");
  if (p == 0.0 || !training) return x;
  return dropout_mask_mul(tp, x, p, key);
}

}  // namespace nn
// ---- end nn/layers/dropout.hpp ----
// ---- begin nn/io/safetensors.hpp ----
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

// ---- begin nn/io/atomic_file.hpp ----
// Atomic file writes, shared by every writer of nn (safetensors, GGUF): the bytes go to a hidden
// temporary sibling of the target, are fsync'ed, and the temporary file is renamed over the
// target. On any error (a full disk, a write limit, an exception from the caller's emitter) the
// temporary file is removed and the target is left as it was, so a failed save never leaves a
// half-written file under the target's name.
//
// A save that is killed (SIGKILL, a power cut) cannot remove its temporary file; the next save to
// the same target removes the temporaries of processes that no longer exist (POSIX), so killed
// saves leave no orphans behind for long. What is promised: the target is always either the old
// file or the new one, whole (the data is fsync'ed before the rename, the folder after it).
//
// A target that exists and is not a regular file (a character device such as /dev/full, a FIFO)
// cannot be replaced by a rename; it is written straight through, and errors still surface.

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>


#if defined(_WIN32)
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <csignal>
#include <cstdlib>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace nn::detail {

/// Receives the file's bytes in order.
using ByteSink = std::function<void(const std::byte*, std::size_t)>;

/// Writes what `emit` sends to its sink to `target`, atomically (see the file comment). `who`
/// leads error messages ("[who] <target>: cannot write ...").
#if defined(_WIN32)
inline void write_atomically(const std::filesystem::path& target, std::string_view who,
                             const std::function<void(const ByteSink&)>& emit) {
  const std::string label = target.string();
  static std::atomic<unsigned> counter{0};
  std::filesystem::path tmp = target;
  tmp += L".tmp." + std::to_wstring(GetCurrentProcessId()) + L"." + std::to_wstring(counter++);
  HANDLE fh = CreateFileW(tmp.c_str(), GENERIC_WRITE, 0, nullptr, CREATE_NEW, FILE_ATTRIBUTE_NORMAL, nullptr);
  if (fh == INVALID_HANDLE_VALUE)
    fail(who, label, ": cannot create the temporary file ", tmp.string(), " (Windows error ", GetLastError(), ")");
  struct Guard {
    HANDLE& fh;
    const std::filesystem::path& tmp;
    bool done = false;
    ~Guard() {
      if (fh != INVALID_HANDLE_VALUE) CloseHandle(fh);
      if (!done) DeleteFileW(tmp.c_str());
    }
  } guard{fh, tmp};
  emit([&](const std::byte* p, std::size_t k) {
    while (k) {
      DWORD chunk = static_cast<DWORD>(std::min<std::size_t>(k, 1u << 30)), got = 0;
      if (!WriteFile(fh, p, chunk, &got, nullptr))
        fail(who, label, ": cannot write ", tmp.string(), " (Windows error ", GetLastError(), ")");
      p += got;
      k -= got;
    }
  });
  if (!FlushFileBuffers(fh)) fail(who, label, ": cannot flush ", tmp.string());
  CloseHandle(fh);
  fh = INVALID_HANDLE_VALUE;
  if (!MoveFileExW(tmp.c_str(), target.c_str(), MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH))
    fail(who, label, ": cannot rename ", tmp.string(), " over it (Windows error ", GetLastError(), ")");
  guard.done = true;
}
#else
/// Removes "." + base + ".tmp.<pid>.<n>" files in `dir` whose process <pid> is gone: the
/// leftovers of killed saves to the same target. A live process's temporary is left alone.
inline void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& base) {
  const std::string prefix = "." + base + ".tmp.";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const std::size_t dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789.") != std::string::npos) continue;
    const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
    if (pid <= 0 || pid == static_cast<long>(::getpid())) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) ::unlink(it->path().c_str());
  }
}

inline void write_atomically(const std::filesystem::path& target, std::string_view who,
                             const std::function<void(const ByteSink&)>& emit) {
  namespace fs = std::filesystem;
  const std::string label = target.string();
  const std::string base = target.filename().string();
  if (base.empty() || base == "." || base == "..") fail(who, label, ": the path names no file");
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";

  struct stat st {};
  // (A directory is not special: the rename over it fails, and the temporary file goes.)
  const bool special = ::stat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);

  // A hidden sibling, so rename() stays inside one file system and is atomic there.
  static std::atomic<unsigned> counter{0};
  if (!special) remove_stale_temporaries(dir, base);
  std::string tmp = special ? label : std::string();
  int fd = -1;
  if (special) {
    fd = ::open(target.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
  } else {
    for (int attempt = 0; attempt < 64 && fd < 0; ++attempt) {
      tmp = (dir / ("." + base + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++))).string();
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd < 0 && errno != EEXIST) break;
    }
  }
  if (fd < 0)
    fail(who, label, special ? ": cannot open: " : ": cannot create the temporary file ", special ? "" : tmp,
         special ? "" : ": ", std::strerror(errno));
  struct Guard {  // closes, and removes the temporary file unless it was renamed into place
    int fd;
    const std::string& tmp;
    bool done;
    ~Guard() {
      if (fd >= 0) ::close(fd);
      if (!done) ::unlink(tmp.c_str());
    }
  } g{fd, tmp, special};

  std::size_t written = 0;
  emit([&](const std::byte* p, std::size_t k) {
    while (k) {
      const ssize_t w = ::write(g.fd, p, std::min<std::size_t>(k, std::size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(who, label, ": cannot write", special ? "" : " the temporary file ", special ? "" : tmp, " (", written,
             " bytes written): ", std::strerror(errno));
      }
      p += w;
      k -= static_cast<std::size_t>(w);
      written += static_cast<std::size_t>(w);
    }
  });
  if (special) return;
  // The data must be on disk before the rename makes it the target, or a crash could leave a
  // renamed but empty file.
  if (::fsync(g.fd) != 0) fail(who, label, ": cannot fsync the temporary file ", tmp, ": ", std::strerror(errno));
  const int cfd = g.fd;
  g.fd = -1;
  if (::close(cfd) != 0) fail(who, label, ": cannot close the temporary file ", tmp, ": ", std::strerror(errno));
  if (::rename(tmp.c_str(), target.c_str()) != 0)
    fail(who, label, ": cannot rename the temporary file ", tmp, " over it: ", std::strerror(errno));
  g.done = true;
  // Persist the rename itself; best effort (some file systems refuse fsync on a directory).
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}
#endif

}  // namespace nn::detail
// ---- end nn/io/atomic_file.hpp ----


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
// ---- end nn/io/safetensors.hpp ----
// ---- begin nn/module.hpp ----
// Modules: a model is a plain struct whose fields NN_MODULE reflects into a parameter tree named
// as MLX and PyTorch name it ("layers.0.self_attn.q_proj.weight"), with the tree algorithms
// (parameters, freeze, train, map_modules, to, summary) and value_and_grad over it.

#include <filesystem>
#include <functional>
#include <iomanip>
#include <optional>
#include <sstream>
#include <string>
#include <type_traits>
#include <utility>
#include <variant>
#include <vector>

// ---- begin nn/statics.hpp ----
// Static configuration: the numbers, flags and strings a module or an optimizer is configured
// with (a LoRA scale, a dropout p, Adam's betas). They are part of the structure, as the module
// seed says: a compiled step hashes them and records again when one changes, and a checkpoint
// writes an optimizer's and checks them on resume. A module lists them in NN_MODULE with
// NN_STATIC(...), an optimizer in NN_OPTIMIZER(...); both go through the one visitor here.

#include <cstdint>
#include <cstdio>
#include <string>
#include <string_view>
#include <tuple>
#include <type_traits>

namespace nn {

/// One configuration value as a hash or a checkpoint sees it.
struct StaticValue {
  enum class Kind { number, integer, boolean, text } kind = Kind::number;
  double number = 0;
  std::int64_t integer = 0;
  std::string_view text;

  /// As a checkpoint's metadata writes it: numbers with 17 significant digits (exact round
  /// trip), flags as "true" / "false".
  std::string str() const {
    switch (kind) {
      case Kind::number: {
        char buf[40];
        std::snprintf(buf, sizeof buf, "%.17g", number);
        return buf;
      }
      case Kind::integer: return std::to_string(integer);
      case Kind::boolean: return integer ? "true" : "false";
      case Kind::text: return std::string(text);
    }
    return {};
  }
};

/// Receives configuration fields one by one: field(name, value). Names are the member names as
/// written, without a trailing underscore ("scale_" is reported as "scale").
struct StaticSink {
  virtual void field(std::string_view name, const StaticValue& v) = 0;

 protected:
  ~StaticSink() = default;
};

namespace detail {

/// 64-bit FNV-1a over bytes; used for structure and hyperparameter hashes (allocation-free).
struct Fnv {
  std::uint64_t h = 1469598103934665603ull;
  void bytes(const void* p, std::size_t n) {
    const auto* b = static_cast<const unsigned char*>(p);
    for (std::size_t i = 0; i < n; ++i) h = (h ^ b[i]) * 1099511628211ull;
  }
  template <class T>
  void pod(const T& v) {
    static_assert(std::is_trivially_copyable_v<T>);
    bytes(&v, sizeof v);
  }
};

/// A sink that hashes names and values.
struct HashSink final : StaticSink {
  Fnv fnv;
  void field(std::string_view name, const StaticValue& v) override {
    fnv.bytes(name.data(), name.size());
    fnv.pod(v.kind);
    switch (v.kind) {
      case StaticValue::Kind::number: {
        const double d = v.number == 0 ? 0.0 : v.number;  // -0.0 and 0.0 configure the same
        fnv.pod(d);
        break;
      }
      case StaticValue::Kind::text: fnv.bytes(v.text.data(), v.text.size()); break;
      default: fnv.pod(v.integer);
    }
  }
};

/// Whether a member can be static configuration: a number, a flag, an enum or a string.
template <class T>
constexpr bool static_ok() {
  using U = std::remove_cvref_t<T>;
  return std::is_arithmetic_v<U> || std::is_enum_v<U> || std::is_same_v<U, std::string>;
}

template <class T>
StaticValue static_value(const T& v) {
  StaticValue out;
  if constexpr (std::is_same_v<T, bool>) {
    out.kind = StaticValue::Kind::boolean;
    out.integer = v ? 1 : 0;
  } else if constexpr (std::is_floating_point_v<T>) {
    out.kind = StaticValue::Kind::number;
    out.number = static_cast<double>(v);
  } else if constexpr (std::is_integral_v<T>) {
    out.kind = StaticValue::Kind::integer;
    out.integer = static_cast<std::int64_t>(v);
  } else if constexpr (std::is_enum_v<T>) {
    out.kind = StaticValue::Kind::integer;
    out.integer = static_cast<std::int64_t>(v);
  } else {
    out.kind = StaticValue::Kind::text;
    out.text = v;
  }
  return out;
}

/// The next name of a stringized list "a_, b_, c" from `pos`, trailing underscore dropped.
inline std::string_view next_static_name(std::string_view names, std::size_t& pos) {
  while (pos < names.size() && (names[pos] == ' ' || names[pos] == ',')) ++pos;
  std::size_t end = names.find(',', pos);
  if (end == std::string_view::npos) end = names.size();
  std::string_view name = names.substr(pos, end - pos);
  pos = end;
  while (!name.empty() && name.back() == ' ') name.remove_suffix(1);
  if (name.size() > 1 && name.back() == '_') name.remove_suffix(1);
  return name;
}

/// What NN_STATIC(a, b) expands to inside NN_MODULE: the names as written and references to
/// the members.
template <class... T>
struct Statics {
  const char* names;
  std::tuple<T&...> refs;
  static constexpr std::size_t count = sizeof...(T);

  void visit(StaticSink& sink) const {
    std::size_t pos = 0;
    std::string_view all(names);
    std::apply([&](const auto&... v) { (sink.field(next_static_name(all, pos), static_value(v)), ...); }, refs);
  }
};
template <class... T>
Statics<T...> statics(const char* names, T&... refs) {
  return {names, std::tie(refs...)};
}

/// What NN_UNCHECKED(a, b) expands to: members that are deliberately neither reflected nor
/// configuration (caches, bookkeeping). Only counted, so the field check knows they are meant.
template <class... T>
struct Unchecked {
  static constexpr std::size_t count = sizeof...(T);
};
template <class... T>
Unchecked<T...> unchecked(T&...) {
  return {};
}

template <class T>
struct is_statics : std::false_type {};
template <class... T>
struct is_statics<Statics<T...>> : std::true_type {};
template <class T>
struct is_unchecked : std::false_type {};
template <class... T>
struct is_unchecked<Unchecked<T...>> : std::true_type {};

}  // namespace detail
}  // namespace nn

/// Static configuration of a module, listed in its NN_MODULE: NN_MODULE(LoraLinear, ...,
/// NN_STATIC(scale_, rslora_)). Numbers, flags, enums and strings; hashed into the structure a
/// compiled step checks on every call, so changing one records the step again.
#define NN_STATIC(...) ::nn::detail::statics(#__VA_ARGS__, __VA_ARGS__)
/// Members a module deliberately keeps outside its tree and its configuration (a cached table,
/// RNG bookkeeping): listed so the field check accepts them. A compiled step does not see them
/// change: their values are baked into a recorded step.
#define NN_UNCHECKED(...) ::nn::detail::unchecked(__VA_ARGS__)
// ---- end nn/statics.hpp ----

namespace nn {

/// The host backend (backend/cpu.hpp), declared here only as value_and_grad's default: the
/// module layer sits above the tape and names no backend's kernels.
struct cpu;

/// A trainable tensor of a module. `trainable` is what freeze()/unfreeze() flip.
struct Param {
  Tensor value;
  bool trainable = true;

  Param() = default;
  Param(Tensor t, bool train = true) : value(std::move(t)), trainable(train) {}  // NOLINT: implicit by design
  const Shape& shape() const { return value.shape(); }
  DType dtype() const { return value.dtype(); }
};

/// A tensor saved and loaded with the module but never trained (running statistics, packed
/// quantized weights).
struct Buffer {
  Tensor value;

  Buffer() = default;
  Buffer(Tensor t) : value(std::move(t)) {}  // NOLINT: implicit by design
  const Shape& shape() const { return value.shape(); }
  DType dtype() const { return value.dtype(); }
};

/// Binds a module's Param on the tape (a gradient when trainable) or a Buffer (a constant).
template <class B>
GVar param(GTape<B>& tp, const Param& p) {
  return tp.param(p.value, p.trainable);
}
template <class B>
GVar param(GTape<B>& tp, const Buffer& b) {
  return tp.constant(b.value);
}

namespace detail {

/// A field listed as NN_RENAME(member, "name"): reflected under `name`.
template <class T>
struct Renamed {
  const char* name;
  T& ref;
};
template <class T>
Renamed<T> renamed(T& ref, const char* name) {
  return {name, ref};
}

template <class T>
struct is_vector : std::false_type {};
template <class T, class A>
struct is_vector<std::vector<T, A>> : std::true_type {};
template <class T>
struct is_optional : std::false_type {};
template <class T>
struct is_optional<std::optional<T>> : std::true_type {};
template <class T>
struct is_variant : std::false_type {};
template <class... T>
struct is_variant<std::variant<T...>> : std::true_type {};
template <class T>
struct is_renamed : std::false_type {};
template <class T>
struct is_renamed<Renamed<T>> : std::true_type {};

template <class T>
concept ModuleType = requires { T::nn_type_name; };

/// Whether a field type can be reflected: Param, Buffer, a module, or a vector / optional /
/// variant of those. Checked once per field when the struct is defined.
template <class T>
constexpr bool field_ok() {
  using U = std::remove_cvref_t<T>;
  if constexpr (is_renamed<U>::value) return field_ok<decltype(std::declval<U>().ref)>();
  else if constexpr (is_statics<U>::value || is_unchecked<U>::value) return true;
  else if constexpr (std::is_same_v<U, Param> || std::is_same_v<U, Buffer>) return true;
  else if constexpr (ModuleType<U>) return true;
  else if constexpr (is_vector<U>::value || is_optional<U>::value) return field_ok<typename U::value_type>();
  else if constexpr (is_variant<U>::value)
    return []<class... A>(std::variant<A...>*) { return (field_ok<A>() && ...); }(static_cast<U*>(nullptr));
  else return false;
}

/// Whether every member of an NN_STATIC(...) can be configuration (true for other items).
template <class T>
constexpr bool statics_ok() {
  if constexpr (is_statics<T>::value)
    return []<class... A>(Statics<A...>*) { return (static_ok<A>() && ...); }(static_cast<T*>(nullptr));
  else return true;
}

/// How many data members one NN_MODULE item stands for.
template <class T>
constexpr std::size_t item_members() {
  using U = std::remove_cvref_t<T>;
  if constexpr (is_statics<U>::value || is_unchecked<U>::value) return U::count;
  else return 1;
}

template <class V, class T>
void visit_field(V& v, const char* name, T& field) {
  v(name, field);
}
template <class V, class T>
void visit_field(V& v, const char*, Renamed<T> r) {
  v(r.name, r.ref);
}
template <class V, class... T>
void visit_field(V&, const char*, Statics<T...>) {}  // configuration: not a tree node
template <class V, class... T>
void visit_field(V&, const char*, Unchecked<T...>) {}

template <class T>
void visit_static(StaticSink&, const T&) {}
template <class... T>
void visit_static(StaticSink& s, const Statics<T...>& st) {
  st.visit(s);
}

/// Brace-initialisation probing (as Boost.PFR counts an aggregate's fields): converts to any
/// member type, so T{AnyField{} x n} compiles exactly when the aggregate T has at least n
/// members.
struct AnyField {
  template <class T>
  operator T&() const&& noexcept;  // NOLINT: implicit by design; never defined (unevaluated)
};
template <class T, std::size_t... I>
constexpr bool takes_fields(std::index_sequence<I...>) {
  return requires { T{((void)I, AnyField{})...}; };
}
/// For an aggregate module: true when it has more data members than NN_MODULE accounts for
/// (`listed` items' members plus the training flag NN_MODULE adds).
template <class T, std::size_t listed>
constexpr bool has_unlisted_members() {
  if constexpr (!std::is_aggregate_v<T>) return false;
  else return takes_fields<T>(std::make_index_sequence<listed + 2>{});
}

inline std::string join_path(const std::string& prefix, const std::string& name) {
  return prefix.empty() ? name : prefix + "." + name;
}

/// Walks the tree depth first in declaration order, calling f.param(path, Param&),
/// f.buffer(path, Buffer&) and f.module(path, Module&) (pre-order). Vectors add an index
/// segment; optionals and variants are transparent.
template <class X, class F>
void walk(X& x, const std::string& path, F& f) {
  using U = std::remove_cvref_t<X>;
  if constexpr (std::is_same_v<U, Param>) {
    f.param(path, x);
  } else if constexpr (std::is_same_v<U, Buffer>) {
    f.buffer(path, x);
  } else if constexpr (ModuleType<U>) {
    f.module(path, x);
    auto visitor = [&](const char* name, auto& field) { walk(field, join_path(path, name), f); };
    x.nn_visit(visitor);
  } else if constexpr (is_vector<U>::value) {
    for (std::size_t i = 0; i < x.size(); ++i) walk(x[i], join_path(path, std::to_string(i)), f);
  } else if constexpr (is_optional<U>::value) {
    if (x) walk(*x, path, f);
  } else if constexpr (is_variant<U>::value) {
    std::visit([&](auto& alt) { walk(alt, path, f); }, x);
  } else {
    static_assert(sizeof(U) == 0, "nn: this field type cannot be part of a module tree");
  }
}

/// A walker from lambdas; the ones not given do nothing.
template <class P, class Bf, class M>
struct Walker {
  P on_param;
  Bf on_buffer;
  M on_module;
  template <class T>
  void param(const std::string& p, T& x) { on_param(p, x); }
  template <class T>
  void buffer(const std::string& p, T& x) { on_buffer(p, x); }
  template <class T>
  void module(const std::string& p, T& x) { on_module(p, x); }
};
inline constexpr auto ignore = [](const std::string&, auto&) {};
template <class X, class P = decltype(ignore), class Bf = decltype(ignore), class M = decltype(ignore)>
void for_each(X& x, P on_param, Bf on_buffer = ignore, M on_module = ignore) {
  Walker<P, Bf, M> w{on_param, on_buffer, on_module};
  walk(x, std::string(), w);
}

template <class X>
std::vector<std::pair<std::string, Tensor>> tree_parameters(const X& m, bool trainable_only) {
  std::vector<std::pair<std::string, Tensor>> out;
  for_each(
      m, [&](const std::string& p, const Param& x) { if (!trainable_only || x.trainable) out.emplace_back(p, x.value); },
      [&](const std::string& p, const Buffer& x) { if (!trainable_only) out.emplace_back(p, x.value); });
  return out;
}

template <class X>
std::int64_t tree_count(const X& m, bool trainable_only) {
  std::int64_t n = 0;
  for_each(
      m, [&](const std::string&, const Param& x) { if (!trainable_only || x.trainable) n += x.value.numel(); },
      [&](const std::string&, const Buffer& x) { if (!trainable_only) n += x.value.numel(); });
  return n;
}

template <class X, class Pred>
int tree_set_trainable(X& m, Pred pred, bool trainable) {
  int changed = 0;
  for_each(m, [&](const std::string& p, Param& x) {
    if (x.trainable != trainable && pred(p)) {
      x.trainable = trainable;
      ++changed;
    }
  });
  return changed;
}

/// "1,234,567"
inline std::string with_commas(std::int64_t v) {
  std::string s = std::to_string(v);
  for (int i = static_cast<int>(s.size()) - 3; i > (v < 0 ? 1 : 0); i -= 3) s.insert(s.begin() + i, ',');
  return s;
}

template <class X>
std::string counts(const X& m) {
  return "(" + with_commas(tree_count(m, false)) + " params, " + with_commas(tree_count(m, true)) + " trainable)";
}

template <class X>
std::string tree_summary(const X& m) {
  struct Row {
    std::string path, shape, dtype, trainable, bytes;
  };
  std::vector<Row> rows{{"path", "shape", "dtype", "trainable", "bytes"}};
  std::int64_t total = 0;
  auto add = [&](const std::string& p, const Tensor& t, const char* tr) {
    rows.push_back({p, t.shape().str(), dtype_name(t.dtype()), tr, with_commas(static_cast<std::int64_t>(t.nbytes()))});
    total += static_cast<std::int64_t>(t.nbytes());
  };
  for_each(
      m, [&](const std::string& p, const Param& x) { add(p, x.value, x.trainable ? "yes" : "no"); },
      [&](const std::string& p, const Buffer& x) { add(p, x.value, "buffer"); });
  std::array<std::size_t, 5> w{};
  for (const auto& r : rows) {
    w[0] = std::max(w[0], r.path.size());
    w[1] = std::max(w[1], r.shape.size());
    w[2] = std::max(w[2], r.dtype.size());
    w[3] = std::max(w[3], r.trainable.size());
    w[4] = std::max(w[4], r.bytes.size());
  }
  std::ostringstream os;
  for (const auto& r : rows)
    os << std::left << std::setw(static_cast<int>(w[0])) << r.path << "  " << std::setw(static_cast<int>(w[1]))
       << r.shape << "  " << std::setw(static_cast<int>(w[2])) << r.dtype << "  " << std::setw(static_cast<int>(w[3]))
       << r.trainable << "  " << std::right << std::setw(static_cast<int>(w[4])) << r.bytes << "\n";
  os << counts(m) << ", " << with_commas(total) << " bytes\n";
  return os.str();
}

/// Prints one line per submodule for tree_display, named relative to its parent module
/// ("layers.0" under a model holding a vector of layers) and indented by nesting.
struct DisplayWalker {
  std::ostringstream& os;
  std::vector<std::string> parents;  // paths of the enclosing modules
  void param(const std::string&, const Param&) {}
  void buffer(const std::string&, const Buffer&) {}
  template <class M>
  void module(const std::string& path, const M& mod) {
    if (path.empty()) {
      parents = {""};
      return;
    }
    auto inside = [&](const std::string& parent) {
      return parent.empty() || (path.size() > parent.size() && path.compare(0, parent.size(), parent) == 0 &&
                                path[parent.size()] == '.');
    };
    while (parents.size() > 1 && !inside(parents.back())) parents.pop_back();
    const std::string& parent = parents.back();
    const std::string name = parent.empty() ? path : path.substr(parent.size() + 1);
    os << std::string(2 * parents.size(), ' ') << name << ": " << M::nn_type_name << " " << counts(mod) << "\n";
    parents.push_back(path);
  }
};

/// One line per module, indented by depth: "name: Type (n params, m trainable)".
template <class X>
std::string tree_display(const X& m) {
  std::ostringstream os;
  os << X::nn_type_name << " " << counts(m) << "\n";
  DisplayWalker d{os, {}};
  walk(m, std::string(), d);
  return os.str();
}

template <class X>
void tree_train(X& m, bool mode) {
  for_each(m, ignore, ignore, [&](const std::string&, auto& mod) { mod.nn_training_ = mode; });
}

template <class X>
void tree_to(X& m, DType dt) {
  if (!is_floating(dt)) fail("to", "a module converts to a floating dtype, not ", dtype_name(dt));
  auto conv = [&](const std::string&, auto& x) {
    if (is_floating(x.value.dtype()) && x.value.dtype() != dt) x.value = x.value.to(dt);
  };
  for_each(m, conv, conv);
}

/// Moves every Param and Buffer to `dev` (a no-op for those already there). Tensors are
/// replaced, not written in place: a tape recorded before the move must be recorded again.
template <class X>
void tree_to_device(X& m, Device dev) {
  auto move = [&](const std::string&, auto& x) {
    if (x.value.defined() && x.value.device() != dev) x.value = x.value.to(dev);
  };
  for_each(m, move, move);
}

/// The structure of a module tree as one hash: the tree's shape (field names, vector lengths,
/// which optionals are engaged, which variant alternatives hold), each Param's and Buffer's
/// shape, dtype, device, address and storage identity, the frozen set, every module's train/eval flag and
/// every NN_STATIC value. A compiled step compares it on every call; nothing here allocates.
struct StructureHasher {
  HashSink sink;

  void tensor(const Tensor& t) {
    sink.fnv.pod(&t);  // a tape binds the Tensor object by address (a moved module records again)
    sink.fnv.pod(t.raw());
    sink.fnv.pod(t.dtype());
    sink.fnv.pod(t.device());
    sink.fnv.pod(t.rank());
    for (std::int64_t d : t.shape()) sink.fnv.pod(d);
  }
  template <class X>
  void node(const X& x) {
    using U = std::remove_cvref_t<X>;
    if constexpr (std::is_same_v<U, Param>) {
      tensor(x.value);
      sink.fnv.pod(x.trainable);
    } else if constexpr (std::is_same_v<U, Buffer>) {
      tensor(x.value);
    } else if constexpr (ModuleType<U>) {
      sink.fnv.pod(U::nn_type_name);  // the literal's address: unique per type within a process
      sink.fnv.pod(x.nn_training_);
      x.nn_visit([&](const char* name, const auto& field) {
        sink.fnv.pod(name);
        node(field);
      });
      x.nn_visit_static(sink);
    } else if constexpr (is_vector<U>::value) {
      sink.fnv.pod(x.size());
      for (const auto& e : x) node(e);
    } else if constexpr (is_optional<U>::value) {
      sink.fnv.pod(x.has_value());
      if (x) node(*x);
    } else if constexpr (is_variant<U>::value) {
      sink.fnv.pod(x.index());
      std::visit([&](const auto& alt) { node(alt); }, x);
    }
  }
};

template <class X>
std::uint64_t structure_hash(const X& m) {
  StructureHasher h;
  h.node(m);
  return h.sink.fnv.h;
}

/// map_modules: calls f(path, T&) on every submodule of type T whose path satisfies pred. When
/// the T sits in a std::variant field and f returns a value (say a LoraLinear built from the
/// Linear), the variant is assigned that value: how a layer is replaced in place.
template <class T, class Pred, class F>
struct ModuleMapper {
  Pred& pred;
  F& f;
  int count = 0;

  template <class X>
  void walk_node(X& x, const std::string& path) {
    using U = std::remove_cvref_t<X>;
    if constexpr (std::is_same_v<U, T>) {
      if (pred(path)) {
        ++count;
        using R = decltype(f(path, x));
        if constexpr (std::is_void_v<R>) f(path, x);
        else if constexpr (std::is_assignable_v<U&, R>) x = f(path, x);
        else fail("map_modules", "the module at '", path, "' is not held in a std::variant that can take the replacement");
      }
      recurse(x, path);
    } else if constexpr (is_variant<U>::value) {
      std::visit(
          [&](auto& alt) {
            using A = std::remove_cvref_t<decltype(alt)>;
            if constexpr (std::is_same_v<A, T>) {
              if (pred(path)) {
                ++count;
                using R = decltype(f(path, alt));
                if constexpr (std::is_void_v<R>) {
                  f(path, alt);
                } else if constexpr (std::is_assignable_v<U&, R>) {
                  x = f(path, alt);  // replaces the alternative; alt is dangling from here on
                  return;
                } else {
                  fail("map_modules", "the module at '", path, "' is held in a std::variant that cannot take the replacement");
                }
              }
              recurse(alt, path);
            } else {
              walk_node(alt, path);
            }
          },
          x);
    } else if constexpr (is_vector<U>::value) {
      for (std::size_t i = 0; i < x.size(); ++i) walk_node(x[i], join_path(path, std::to_string(i)));
    } else if constexpr (is_optional<U>::value) {
      if (x) walk_node(*x, path);
    } else if constexpr (ModuleType<U>) {
      recurse(x, path);
    }
  }
  template <class X>
  void recurse(X& x, const std::string& path) {
    if constexpr (ModuleType<std::remove_cvref_t<X>>) {
      auto visitor = [&](const char* name, auto& field) { walk_node(field, join_path(path, name)); };
      x.nn_visit(visitor);
    }
  }
};

// Weight files (defined in io/weights.hpp, which nn.hpp includes): declared here so NN_MODULE's
// members can name them.
using NamedTensorList = std::vector<std::pair<std::string, Tensor>>;
template <class M>
void save_weights_impl(const M& m, const std::filesystem::path& path, bool trainable_only);
template <class M>
void load_weights_impl(M& m, const NamedTensorList& named, bool strict, const std::string& source);
template <class M>
void load_weights_file(M& m, const std::filesystem::path& path, bool strict);

}  // namespace detail

/// Gradients of a model's own type: runs f(tape, model) -> scalar loss GVar, back-propagates,
/// and returns {loss, grads} where grads is a copy of the model whose trainable Params hold their
/// gradients (zeros when the loss does not depend on them) and whose frozen Params are empty.
/// Frozen parameters are bound as constants, so they cost no gradient work.
template <class B = cpu, class M, class F>
std::pair<Tensor, M> value_and_grad(M& model, F&& f) {
  GTape<B> tp;
  GVar loss = f(tp, static_cast<const M&>(model));
  tp.backward(loss);
  M grads = model;
  std::vector<const Param*> src;
  std::vector<Param*> dst;
  detail::for_each(static_cast<const M&>(model), [&](const std::string&, const Param& p) { src.push_back(&p); });
  detail::for_each(grads, [&](const std::string&, Param& p) { dst.push_back(&p); });
  for (std::size_t i = 0; i < src.size(); ++i) {
    if (!src[i]->trainable || !is_floating(src[i]->value.dtype())) {
      dst[i]->value = Tensor();
      continue;
    }
    std::optional<GVar> v = tp.find_param(src[i]->value);
    if (v) {
      dst[i]->value = tp.grad(*v);
    } else {
      dst[i]->value = B::alloc(src[i]->value.shape(), src[i]->value.dtype());
      B::fill(dst[i]->value, 0.0);
    }
  }
  return {tp.value(loss), std::move(grads)};
}

/// How a model's frozen weights are stored. Precision::bf16 keeps every frozen matrix (Linear
/// weights, embedding tables, a LoRA base) in bfloat16, half the memory; products read them as
/// bf16 operands (activations rounded to bf16) with f32 accumulation, on AMX, AVX512_BF16 or the
/// f32 kernels, whichever measures fastest here (gemm::bf16_kernel, backend/gemm.hpp), and the
/// embedding lookup widens its rows. What
/// trains (trainable Params, the optimizer's state), vectors (norm gains, biases), Buffers and
/// every reduction stay float32. PyTorch's bf16 autocast makes the same choice for a product.
enum class Precision { f32, bf16 };

/// Precision::bf16: every frozen float32 Param of rank 2 is stored in bfloat16 (rounded to
/// nearest even). Precision::f32: every bfloat16 Param back in float32 (exact). Returns how many
/// were converted. The tensors are replaced, not written in place: a tape or compiled step
/// recorded before must be recorded again.
template <class X>
int set_precision(X& m, Precision p) {
  int n = 0;
  detail::for_each(m, [&](const std::string&, Param& prm) {
    Tensor& t = prm.value;
    if (!t.defined()) return;
    if (p == Precision::bf16 && !prm.trainable && t.rank() == 2 && t.dtype() == DType::f32) {
      t = t.to(DType::bf16);
      ++n;
    } else if (p == Precision::f32 && t.dtype() == DType::bf16) {
      t = t.to(DType::f32);
      ++n;
    }
  });
  return n;
}

}  // namespace nn

// Applies NN_DETAIL_VISIT_FIELD to each of up to 64 arguments.
#define NN_DETAIL_EXPAND(x) x
#define NN_DETAIL_FE_1(m, x) m(x)
#define NN_DETAIL_FE_2(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_1(m, __VA_ARGS__))
#define NN_DETAIL_FE_3(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_2(m, __VA_ARGS__))
#define NN_DETAIL_FE_4(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_3(m, __VA_ARGS__))
#define NN_DETAIL_FE_5(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_4(m, __VA_ARGS__))
#define NN_DETAIL_FE_6(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_5(m, __VA_ARGS__))
#define NN_DETAIL_FE_7(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_6(m, __VA_ARGS__))
#define NN_DETAIL_FE_8(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_7(m, __VA_ARGS__))
#define NN_DETAIL_FE_9(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_8(m, __VA_ARGS__))
#define NN_DETAIL_FE_10(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_9(m, __VA_ARGS__))
#define NN_DETAIL_FE_11(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_10(m, __VA_ARGS__))
#define NN_DETAIL_FE_12(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_11(m, __VA_ARGS__))
#define NN_DETAIL_FE_13(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_12(m, __VA_ARGS__))
#define NN_DETAIL_FE_14(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_13(m, __VA_ARGS__))
#define NN_DETAIL_FE_15(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_14(m, __VA_ARGS__))
#define NN_DETAIL_FE_16(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_15(m, __VA_ARGS__))
#define NN_DETAIL_FE_17(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_16(m, __VA_ARGS__))
#define NN_DETAIL_FE_18(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_17(m, __VA_ARGS__))
#define NN_DETAIL_FE_19(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_18(m, __VA_ARGS__))
#define NN_DETAIL_FE_20(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_19(m, __VA_ARGS__))
#define NN_DETAIL_FE_21(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_20(m, __VA_ARGS__))
#define NN_DETAIL_FE_22(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_21(m, __VA_ARGS__))
#define NN_DETAIL_FE_23(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_22(m, __VA_ARGS__))
#define NN_DETAIL_FE_24(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_23(m, __VA_ARGS__))
#define NN_DETAIL_FE_25(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_24(m, __VA_ARGS__))
#define NN_DETAIL_FE_26(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_25(m, __VA_ARGS__))
#define NN_DETAIL_FE_27(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_26(m, __VA_ARGS__))
#define NN_DETAIL_FE_28(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_27(m, __VA_ARGS__))
#define NN_DETAIL_FE_29(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_28(m, __VA_ARGS__))
#define NN_DETAIL_FE_30(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_29(m, __VA_ARGS__))
#define NN_DETAIL_FE_31(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_30(m, __VA_ARGS__))
#define NN_DETAIL_FE_32(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_31(m, __VA_ARGS__))
#define NN_DETAIL_FE_33(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_32(m, __VA_ARGS__))
#define NN_DETAIL_FE_34(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_33(m, __VA_ARGS__))
#define NN_DETAIL_FE_35(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_34(m, __VA_ARGS__))
#define NN_DETAIL_FE_36(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_35(m, __VA_ARGS__))
#define NN_DETAIL_FE_37(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_36(m, __VA_ARGS__))
#define NN_DETAIL_FE_38(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_37(m, __VA_ARGS__))
#define NN_DETAIL_FE_39(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_38(m, __VA_ARGS__))
#define NN_DETAIL_FE_40(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_39(m, __VA_ARGS__))
#define NN_DETAIL_FE_41(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_40(m, __VA_ARGS__))
#define NN_DETAIL_FE_42(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_41(m, __VA_ARGS__))
#define NN_DETAIL_FE_43(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_42(m, __VA_ARGS__))
#define NN_DETAIL_FE_44(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_43(m, __VA_ARGS__))
#define NN_DETAIL_FE_45(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_44(m, __VA_ARGS__))
#define NN_DETAIL_FE_46(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_45(m, __VA_ARGS__))
#define NN_DETAIL_FE_47(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_46(m, __VA_ARGS__))
#define NN_DETAIL_FE_48(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_47(m, __VA_ARGS__))
#define NN_DETAIL_FE_49(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_48(m, __VA_ARGS__))
#define NN_DETAIL_FE_50(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_49(m, __VA_ARGS__))
#define NN_DETAIL_FE_51(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_50(m, __VA_ARGS__))
#define NN_DETAIL_FE_52(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_51(m, __VA_ARGS__))
#define NN_DETAIL_FE_53(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_52(m, __VA_ARGS__))
#define NN_DETAIL_FE_54(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_53(m, __VA_ARGS__))
#define NN_DETAIL_FE_55(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_54(m, __VA_ARGS__))
#define NN_DETAIL_FE_56(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_55(m, __VA_ARGS__))
#define NN_DETAIL_FE_57(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_56(m, __VA_ARGS__))
#define NN_DETAIL_FE_58(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_57(m, __VA_ARGS__))
#define NN_DETAIL_FE_59(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_58(m, __VA_ARGS__))
#define NN_DETAIL_FE_60(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_59(m, __VA_ARGS__))
#define NN_DETAIL_FE_61(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_60(m, __VA_ARGS__))
#define NN_DETAIL_FE_62(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_61(m, __VA_ARGS__))
#define NN_DETAIL_FE_63(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_62(m, __VA_ARGS__))
#define NN_DETAIL_FE_64(m, x, ...) m(x) NN_DETAIL_EXPAND(NN_DETAIL_FE_63(m, __VA_ARGS__))
#define NN_DETAIL_FE_PICK(_1, _2, _3, _4, _5, _6, _7, _8, _9, _10, _11, _12, _13, _14, _15, _16, _17, _18, _19, _20, _21, _22, _23, _24, _25, _26, _27, _28, _29, _30, _31, _32, _33, _34, _35, _36, _37, _38, _39, _40, _41, _42, _43, _44, _45, _46, _47, _48, _49, _50, _51, _52, _53, _54, _55, _56, _57, _58, _59, _60, _61, _62, _63, _64, NAME, ...) NAME
#define NN_DETAIL_FOR_EACH(m, ...) NN_DETAIL_EXPAND(NN_DETAIL_FE_PICK(__VA_ARGS__, NN_DETAIL_FE_64, NN_DETAIL_FE_63, NN_DETAIL_FE_62, NN_DETAIL_FE_61, NN_DETAIL_FE_60, NN_DETAIL_FE_59, NN_DETAIL_FE_58, NN_DETAIL_FE_57, NN_DETAIL_FE_56, NN_DETAIL_FE_55, NN_DETAIL_FE_54, NN_DETAIL_FE_53, NN_DETAIL_FE_52, NN_DETAIL_FE_51, NN_DETAIL_FE_50, NN_DETAIL_FE_49, NN_DETAIL_FE_48, NN_DETAIL_FE_47, NN_DETAIL_FE_46, NN_DETAIL_FE_45, NN_DETAIL_FE_44, NN_DETAIL_FE_43, NN_DETAIL_FE_42, NN_DETAIL_FE_41, NN_DETAIL_FE_40, NN_DETAIL_FE_39, NN_DETAIL_FE_38, NN_DETAIL_FE_37, NN_DETAIL_FE_36, NN_DETAIL_FE_35, NN_DETAIL_FE_34, NN_DETAIL_FE_33, NN_DETAIL_FE_32, NN_DETAIL_FE_31, NN_DETAIL_FE_30, NN_DETAIL_FE_29, NN_DETAIL_FE_28, NN_DETAIL_FE_27, NN_DETAIL_FE_26, NN_DETAIL_FE_25, NN_DETAIL_FE_24, NN_DETAIL_FE_23, NN_DETAIL_FE_22, NN_DETAIL_FE_21, NN_DETAIL_FE_20, NN_DETAIL_FE_19, NN_DETAIL_FE_18, NN_DETAIL_FE_17, NN_DETAIL_FE_16, NN_DETAIL_FE_15, NN_DETAIL_FE_14, NN_DETAIL_FE_13, NN_DETAIL_FE_12, NN_DETAIL_FE_11, NN_DETAIL_FE_10, NN_DETAIL_FE_9, NN_DETAIL_FE_8, NN_DETAIL_FE_7, NN_DETAIL_FE_6, NN_DETAIL_FE_5, NN_DETAIL_FE_4, NN_DETAIL_FE_3, NN_DETAIL_FE_2, NN_DETAIL_FE_1)(m, __VA_ARGS__))

/// A field reflected under another name: NN_MODULE(Attention, q_proj, NN_RENAME(qn, "q_norm")).
#define NN_RENAME(member, name) ::nn::detail::renamed(member, name)

#define NN_DETAIL_VISIT_FIELD(f) ::nn::detail::visit_field(nn_v, #f, f);
#define NN_DETAIL_VISIT_STATIC(f) ::nn::detail::visit_static(nn_s, f);
#define NN_DETAIL_COUNT_FIELD(f) +::nn::detail::item_members<decltype(f)>()
#define NN_DETAIL_CHECK_FIELD(f)                                                                    \
  static_assert(::nn::detail::field_ok<decltype(f)>(),                                              \
                "NN_MODULE: field '" #f "' must be an nn::Param, an nn::Buffer, a module, or a "    \
                "std::vector / std::optional / std::variant of those (a bare nn::Tensor needs a "   \
                "role: nn::Param or nn::Buffer; configuration goes in NN_STATIC(...), a cache in "  \
                "NN_UNCHECKED(...))");                                                              \
  static_assert(::nn::detail::statics_ok<decltype(f)>(),                                            \
                "NN_MODULE: every member of " #f " must be a number, a flag, an enum or a std::string");

/// Reflects a module's fields (none, or up to 64 items), in declaration order, and gives it the
/// module API as members: parameters(), trainable_parameters(), num_params(), num_trainable(),
/// summary(), display(), freeze(pred), unfreeze(pred), train(bool), training(),
/// map_modules<T>(pred, f), to(dtype), save_weights(path), save_trainable(path),
/// load_weights(path or tensors), load_weights_partial(path or tensors). Put it last in the
/// struct: it adds one data member (the training flag), and last keeps aggregate initialisation
/// of the fields as written.
///
/// Every data member has a role: a field (a module, Param, Buffer, or a vector / optional /
/// variant of those), configuration in NN_STATIC(a_, b_) (hashed into the structure a compiled
/// step checks, so a change records the step again), or NN_UNCHECKED(c_) (a cache or
/// bookkeeping a recorded step may bake in). For an aggregate (public members, no constructors)
/// a member with no role is a compile error, found by brace-initialisation probing; for a class
/// with private members or constructors C++ cannot count the members, so the list is the
/// author's word (a base class's members are not counted either).
#define NN_MODULE(Type, ...)                                                                              \
  static constexpr const char* nn_type_name = #Type;                                                      \
  bool nn_training_ = true;                                                                               \
  template <class NnV>                                                                                    \
  void nn_visit([[maybe_unused]] NnV&& nn_v) {                                                            \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_VISIT_FIELD, __VA_ARGS__))                                    \
  }                                                                                                       \
  template <class NnV>                                                                                    \
  void nn_visit([[maybe_unused]] NnV&& nn_v) const {                                                      \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_VISIT_FIELD, __VA_ARGS__))                                    \
  }                                                                                                       \
  /** Every NN_STATIC value, as (name, value). */                                                       \
  void nn_visit_static([[maybe_unused]] ::nn::StaticSink& nn_s) const {                                   \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_VISIT_STATIC, __VA_ARGS__))                                   \
  }                                                                                                       \
  void nn_check_fields() const {                                                                          \
    __VA_OPT__(NN_DETAIL_FOR_EACH(NN_DETAIL_CHECK_FIELD, __VA_ARGS__))                                    \
    static_assert(!::nn::detail::has_unlisted_members<Type, 0 __VA_OPT__(NN_DETAIL_FOR_EACH(              \
                                                                NN_DETAIL_COUNT_FIELD, __VA_ARGS__))>(), \
                  "NN_MODULE(" #Type ", ...): " #Type " has a data member that NN_MODULE does not list: "  \
                  "list each as a field (a module, nn::Param, nn::Buffer), as configuration in "         \
                  "NN_STATIC(...) (a compiled step records again when it changes), or in "               \
                  "NN_UNCHECKED(...)");                                                                   \
  }                                                                                                       \
  /** (path, tensor) of every Param and Buffer, in declaration order. */                                  \
  std::vector<std::pair<std::string, ::nn::Tensor>> parameters() const {                                  \
    return ::nn::detail::tree_parameters(*this, false);                                                   \
  }                                                                                                       \
  std::vector<std::pair<std::string, ::nn::Tensor>> trainable_parameters() const {                        \
    return ::nn::detail::tree_parameters(*this, true);                                                    \
  }                                                                                                       \
  std::int64_t num_params() const { return ::nn::detail::tree_count(*this, false); }                      \
  std::int64_t num_trainable() const { return ::nn::detail::tree_count(*this, true); }                    \
  std::string summary() const { return ::nn::detail::tree_summary(*this); }                               \
  std::string display() const { return ::nn::detail::tree_display(*this); }                               \
  template <class NnPred>                                                                                 \
  int freeze(NnPred pred) {                                                                               \
    return ::nn::detail::tree_set_trainable(*this, pred, false);                                          \
  }                                                                                                       \
  int freeze() {                                                                                          \
    return freeze([](const std::string&) { return true; });                                               \
  }                                                                                                       \
  template <class NnPred>                                                                                 \
  int unfreeze(NnPred pred) {                                                                             \
    return ::nn::detail::tree_set_trainable(*this, pred, true);                                           \
  }                                                                                                       \
  int unfreeze() {                                                                                        \
    return unfreeze([](const std::string&) { return true; });                                             \
  }                                                                                                       \
  void train(bool mode = true) { ::nn::detail::tree_train(*this, mode); }                                 \
  bool training() const { return nn_training_; }                                                          \
  template <class NnT, class NnPred, class NnF>                                                           \
  int map_modules(NnPred pred, NnF f) {                                                                   \
    ::nn::detail::ModuleMapper<NnT, NnPred, NnF> m{pred, f};                                              \
    m.recurse(*this, std::string());                                                                      \
    return m.count;                                                                                       \
  }                                                                                                       \
  void to(::nn::DType dt) { ::nn::detail::tree_to(*this, dt); }                                          \
  void to(::nn::Device nn_dev) { ::nn::detail::tree_to_device(*this, nn_dev); }                           \
  /** Every Param and Buffer to a safetensors file MLX loads (model.load_weights). */                    \
  void save_weights(const std::filesystem::path& nn_path) const {                                         \
    ::nn::detail::save_weights_impl(*this, nn_path, false);                                               \
  }                                                                                                       \
  /** Only the trainable Params (an adapter file). */                                                     \
  void save_trainable(const std::filesystem::path& nn_path) const {                                       \
    ::nn::detail::save_weights_impl(*this, nn_path, true);                                                \
  }                                                                                                       \
  /** Strict: every missing, unknown and mismatched name in one error; the model unchanged then. */      \
  void load_weights(const std::filesystem::path& nn_path) { ::nn::detail::load_weights_file(*this, nn_path, true); } \
  void load_weights(const ::nn::detail::NamedTensorList& nn_named) {                                      \
    ::nn::detail::load_weights_impl(*this, nn_named, true, "tensors");                                    \
  }                                                                                                       \
  /** Ignores unknown and missing names; shape and dtype must still match. */                            \
  void load_weights_partial(const std::filesystem::path& nn_path) {                                       \
    ::nn::detail::load_weights_file(*this, nn_path, false);                                               \
  }                                                                                                       \
  void load_weights_partial(const ::nn::detail::NamedTensorList& nn_named) {                              \
    ::nn::detail::load_weights_impl(*this, nn_named, false, "tensors");                                   \
  }
// ---- end nn/module.hpp ----
// ---- begin nn/tree.hpp ----
// Gradient trees as values. A model's own type doubles as the tree of its gradients:
// value_and_grad returns one, each trainable Param holding its gradient and each frozen one
// empty. These walk trees of one type leaf by leaf (declaration order, the order of the paths
// summary() prints), so accumulating gradients over micro-batches is two lines:
//
//   if (!sum) sum = std::move(g); else nn::tree_add(*sum, g);   // per micro-batch
//   nn::tree_scale(*sum, 1.0 / n);                              // before the update
//
// The leaves are host tensors (value_and_grad's gradients are), or a device's with the backend
// named: nn::tree_add<nn::cuda>(sum, g) for value_and_grad<nn::cuda>'s trees.

#include <string>
#include <vector>


namespace nn {

/// f(path, Param& out_leaf) for every parameter leaf of `tree`.
template <class M, class F>
void tree_map(M& tree, F&& f) {
  detail::for_each(tree, [&](const std::string& path, Param& p) { f(path, p); });
}

/// f(path, Param& out_leaf, const Param& in_leaf) for the leaves of two trees of the same type,
/// pairwise. The trees must have the same structure (vectors of the same lengths, the same
/// optionals engaged); a mismatch is an nn::Error naming the first path that differs.
template <class M, class F>
void tree_map(M& out, const M& in, F&& f) {
  std::vector<std::pair<std::string, const Param*>> leaves;
  detail::for_each(in, [&](const std::string& path, const Param& p) { leaves.emplace_back(path, &p); });
  std::size_t i = 0;
  detail::for_each(out, [&](const std::string& path, Param& p) {
    if (i >= leaves.size())
      detail::fail("tree_map", "the trees differ in structure at '", path, "' (the other has no more leaves)");
    if (leaves[i].first != path)
      detail::fail("tree_map", "the trees differ in structure at '", path, "' (the other has '", leaves[i].first, "')");
    f(path, p, *leaves[i++].second);
  });
  if (i != leaves.size())
    detail::fail("tree_map", "the trees differ in structure: the other has more leaves, from '", leaves[i].first, "'");
}

/// acc += g, leaf by leaf, for the leaves g holds (its empty ones, frozen parameters, are
/// skipped); an empty leaf of acc takes a copy of g's. Shapes and dtypes must match. B: the
/// backend whose kernels add (the leaves' device).
template <class B = cpu, class M>
void tree_add(M& acc, const M& g) {
  tree_map(acc, g, [](const std::string& path, Param& a, const Param& b) {
    if (!b.value.defined()) return;
    if (!a.value.defined()) {
      a.value = b.value.clone();
      return;
    }
    if (a.value.shape() != b.value.shape() || a.value.dtype() != b.value.dtype())
      detail::fail("tree_add", "'", path, "' is ", dtype_name(a.value.dtype()), " ", a.value.shape().str(),
                   " in the sum but ", dtype_name(b.value.dtype()), " ", b.value.shape().str(), " in the addend");
    B::copy(b.value, a.value, true);
  });
}

/// t *= s for every leaf t holds.
template <class B = cpu, class M>
void tree_scale(M& t, double s) {
  tree_map(t, [s](const std::string&, Param& p) {
    if (p.value.defined()) B::unary(Unary::scale, s, p.value, p.value);
  });
}

/// Every leaf t holds set to zero (in place: storage shared with t stays shared).
template <class B = cpu, class M>
void tree_zero(M& t) {
  tree_map(t, [](const std::string&, Param& p) {
    if (p.value.defined()) B::fill(p.value, 0.0);
  });
}

/// A deep copy of a model (or gradient tree): every Param and Buffer in fresh storage. A plain
/// copy (`M b = a;`) shares its tensors with `a`, which is what value_and_grad and optimizers
/// rely on; clone() is the snapshot that later updates of `a` leave alone.
template <class M>
  requires detail::ModuleType<M>
M clone(const M& m) {
  M c = m;
  detail::for_each(
      c, [](const std::string&, Param& p) { if (p.value.defined()) p.value = p.value.clone(); },
      [](const std::string&, Buffer& b) { if (b.value.defined()) b.value = b.value.clone(); });
  return c;
}

}  // namespace nn
// ---- end nn/tree.hpp ----
// ---- begin nn/modules.hpp ----
// Every module layer class (included by nn.hpp).

// ---- begin nn/modules/linear.hpp ----
// Linear: y = x W^T + b with weight (out, in), MLX's nn.Linear initialisation and names.


namespace nn {

/// MLX nn.Linear / torch.nn.Linear. Linear(in, out) draws weight then bias from nn::random's
/// global sequence, uniform in [-1/sqrt(in), 1/sqrt(in)) as MLX (so nn::random::seed(s) gives
/// MLX's values bit for bit). `.without_bias()` drops the bias; right after construction it
/// also gives the bias's draw back to the sequence, so the next draws match MLX's
/// nn.Linear(in, out, bias=False).
struct Linear {
  Param weight;               // (out, in)
  std::optional<Param> bias;  // (out)

  Linear() = default;
  Linear(std::int64_t in, std::int64_t out) {
    init::LinearInit w = init::linear(in, out, false);
    before_bias_ = random::state();
    weight = Param(w.weight);
    bias = Param(init::linear_bias(in, out));
    after_bias_ = random::state();
  }
  Linear& without_bias() {
    bias.reset();
    if (after_bias_.defined() && random::state().to_doubles() == after_bias_.to_doubles()) random::set_state(before_bias_);
    return *this;
  }
  std::int64_t in_features() const { return weight.value.dim(1); }
  std::int64_t out_features() const { return weight.value.dim(0); }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return bias ? linear(tp, x, nn::param(tp, weight), nn::param(tp, *bias)) : linear(tp, x, nn::param(tp, weight));
  }

  NN_MODULE(Linear, weight, bias, NN_UNCHECKED(before_bias_, after_bias_))

 private:
  Tensor before_bias_, after_bias_;  // the global RNG state around the bias draw
};

}  // namespace nn
// ---- end nn/modules/linear.hpp ----
// ---- begin nn/modules/embedding.hpp ----
// Embedding: a (num, dims) table looked up by token ids, MLX's nn.Embedding initialisation.


namespace nn {

/// MLX nn.Embedding(num, dims): weight (num, dims) ~ N(0, 1/dims), drawn from nn::random's
/// global sequence as MLX draws it.
struct Embedding {
  Param weight;  // (num, dims)

  Embedding() = default;
  Embedding(std::int64_t num, std::int64_t dims) : weight(init::embedding(num, dims)) {}

  // ids: (...) int32/int64 -> (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    return embedding(tp, ids, nn::param(tp, weight));
  }
  /// The table as an output projection (a tied LM head): x (..., dims) -> logits (..., num).
  template <class B>
  GVar as_linear(GTape<B>& tp, GVar x) const {
    return linear(tp, x, nn::param(tp, weight));
  }

  NN_MODULE(Embedding, weight)
};

}  // namespace nn
// ---- end nn/modules/embedding.hpp ----
// ---- begin nn/modules/norm.hpp ----
// RmsNorm and LayerNorm modules (MLX's nn.RMSNorm and nn.LayerNorm: eps 1e-5, weight ones,
// bias zeros).


namespace nn {

/// x / sqrt(mean(x^2) + eps) * weight over the last axis (Zhang & Sennrich 2019).
struct RmsNorm {
  Param weight;  // (dims)

  RmsNorm() = default;
  explicit RmsNorm(std::int64_t dims) : weight(Tensor::ones({dims})) {}
  RmsNorm& eps(double e) {
    eps_ = e;
    return *this;
  }
  double eps() const { return eps_; }
  /// Scale by (1 + weight) instead of weight: Gemma's RMSNorm (transformers' GemmaRMSNorm,
  /// mlx-lm's gemma RMSNorm), whose stored weight is the offset from 1 (zeros at init).
  RmsNorm& unit_offset(bool on) {
    unit_offset_ = on;
    return *this;
  }
  bool unit_offset() const { return unit_offset_; }

  // x: (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar w = nn::param(tp, weight);
    return rmsnorm(tp, x, unit_offset_ ? add_scalar(tp, w, 1.0) : w, eps_);
  }

  NN_MODULE(RmsNorm, weight, NN_STATIC(eps_), NN_STATIC(unit_offset_))

 private:
  double eps_ = 1e-5;
  bool unit_offset_ = false;
};

/// (x - mean) / sqrt(var + eps) * weight + bias over the last axis (Ba et al. 2016).
/// `.affine(false)`: no weight or bias; `.without_bias()`: weight only.
struct LayerNorm {
  std::optional<Param> weight;  // (dims)
  std::optional<Param> bias;    // (dims)

  LayerNorm() = default;
  explicit LayerNorm(std::int64_t dims) : weight(Param(Tensor::ones({dims}))), bias(Param(Tensor::zeros({dims}))) {}
  LayerNorm& eps(double e) {
    eps_ = e;
    return *this;
  }
  double eps() const { return eps_; }
  LayerNorm& affine(bool on) {
    if (!on) {
      weight.reset();
      bias.reset();
    }
    return *this;
  }
  LayerNorm& without_bias() {
    bias.reset();
    return *this;
  }

  // x: (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    if (!weight) return layernorm(tp, x, eps_);
    if (!bias) return layernorm(tp, x, nn::param(tp, *weight), eps_);
    return layernorm(tp, x, nn::param(tp, *weight), nn::param(tp, *bias), eps_);
  }

  NN_MODULE(LayerNorm, weight, bias, NN_STATIC(eps_))

 private:
  double eps_ = 1e-5;
};

}  // namespace nn
// ---- end nn/modules/norm.hpp ----
// ---- begin nn/modules/rope.hpp ----
// Rope: MLX's nn.RoPE as a module (no parameters; its options are configuration).


namespace nn {

/// Rotary position embedding on the first `dims` features of the last axis, positions along
/// the second-to-last axis: x (..., T, D). NEOX half-split by default (MLX traditional=False),
/// `.traditional()` for interleaved pairs; base 10000 and scale 1 as MLX.
struct Rope {
  Rope() = default;
  explicit Rope(std::int64_t dims) : dims_(dims) {}
  Rope& traditional(bool on = true) {
    traditional_ = on;
    return *this;
  }
  Rope& base(double b) {
    base_ = b;
    return *this;
  }
  Rope& scale(double s) {
    scale_ = s;
    return *this;
  }
  std::int64_t dims() const { return dims_; }

  // x: (..., T, D), D >= dims; positions offset, offset + 1, ...
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x, std::int64_t offset = 0) const {
    const Shape& s = tp.shape(x);
    if (s.rank() < 2) detail::fail("Rope", "expects x (..., T, D), got ", s.str());
    RopeVars t = rope_fill(tp, s.dim(-2), dims_, base_, scale_, offset, tp.dtype(x));
    return rope(tp, x, t.cos, t.sin, traditional_);
  }

  NN_MODULE(Rope, NN_STATIC(dims_, traditional_, base_, scale_))

 private:
  std::int64_t dims_ = 0;
  bool traditional_ = false;
  double base_ = 10000.0, scale_ = 1.0;
};

}  // namespace nn
// ---- end nn/modules/rope.hpp ----
// ---- begin nn/modules/dropout.hpp ----
// Dropout: MLX's nn.Dropout as a module; its key comes from the tape's random_key().


namespace nn {

/// In training, y = x * bernoulli(1 - p) / (1 - p) with a key drawn from nn::random's global
/// sequence through tp.random_key() (so nn::random::seed(s) gives MLX's masks, and a compiled
/// step draws a fresh mask each replay); in evaluation (train(false)), y = x.
struct Dropout {
  Dropout() = default;
  explicit Dropout(double p) : p_(p) {
    if (!(p >= 0.0 && p < 1.0)) detail::fail("Dropout", "the dropout probability ", p, " is not in [0, 1)");
  }
  double p() const { return p_; }

  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    if (!nn_training_ || p_ == 0.0) return x;
    return dropout(tp, x, p_, tp.random_key());
  }

  NN_MODULE(Dropout, NN_STATIC(p_))

 private:
  double p_ = 0.5;
};

}  // namespace nn
// ---- end nn/modules/dropout.hpp ----
// ---- begin nn/modules/quantized.hpp ----
// QuantizedLinear and QuantizedEmbedding (MLX's nn.QuantizedLinear / nn.QuantizedEmbedding: the
// same fields, names and layouts), and nn::quantize(model, ...), which converts a model's Linear
// and Embedding leaves by path as mlx.nn.quantize does.

#include <optional>
#include <type_traits>
#include <variant>


namespace nn {

namespace detail {

/// The three tensors of a quantized layer bound on a tape as constants.
template <class B>
struct BoundQuantized {
  GVar wq, scales;
  std::optional<GVar> biases;
};
template <class B>
BoundQuantized<B> bind_quantized(GTape<B>& tp, const Buffer& w, const Buffer& s, const std::optional<Buffer>& b) {
  return {nn::param(tp, w), nn::param(tp, s), b ? std::optional<GVar>(nn::param(tp, *b)) : std::nullopt};
}

}  // namespace detail

/// y = x @ dequant(weight)^T + bias for a weight quantized in MLX's format (quant.hpp). Every
/// tensor is a Buffer: never trained (unfreeze() leaves it so), saved and loaded under MLX's
/// names: weight (out, in * bits / 32) u32, scales and biases (out, in / group) (no biases for
/// the fp modes), bias (out) when the Linear had one.
struct QuantizedLinear {
  Buffer weight;
  Buffer scales;
  std::optional<Buffer> biases;
  std::optional<Buffer> bias;

  QuantizedLinear() = default;
  /// MLX's QuantizedLinear.from_linear: affine, groups of 64, 4 bits unless q says otherwise.
  static QuantizedLinear from_linear(const Linear& l, Quant q = Quant::affine()) {
    QuantizedLinear out;
    out.set(quantize(l.weight.value, q));
    if (l.bias) out.bias = Buffer(l.bias->value.clone());
    return out;
  }
  static QuantizedLinear from_linear_with(const Linear& l, Quant q) { return from_linear(l, q); }
  /// An already quantized matrix (mx.quantize's output, a GGUF tensor) and an optional bias.
  static QuantizedLinear from_quantized(QuantizedMatrix m, std::optional<Tensor> bias = std::nullopt) {
    QuantizedLinear out;
    out.set(std::move(m));
    if (bias) out.bias = Buffer(std::move(*bias));
    return out;
  }

  Quant quant() const { return Quant{mode_, group_size_, bits_}; }
  std::int64_t in_features() const { return weight.value.dim(1) * 32 / bits_; }
  std::int64_t out_features() const { return weight.value.dim(0); }
  QuantizedMatrix matrix() const { return {weight.value, scales.value, biases ? biases->value : Tensor(), quant()}; }
  /// The full-precision Linear (the scales' dtype; the fp modes: float32): mx.dequantize of the weight.
  Linear dequantized() const {
    Linear l;
    l.weight = Param(dequantize(matrix()));
    if (bias) l.bias = Param(bias->value.clone());
    return l;
  }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    auto w = detail::bind_quantized(tp, weight, scales, biases);
    GVar y = quantized_matmul(tp, x, w.wq, w.scales, w.biases, quant(), true);
    return bias ? add(tp, y, nn::param(tp, *bias)) : y;
  }

  NN_MODULE(QuantizedLinear, weight, scales, biases, bias, NN_STATIC(mode_, group_size_, bits_))

 private:
  void set(QuantizedMatrix m) {
    weight = Buffer(std::move(m.weight));
    scales = Buffer(std::move(m.scales));
    biases = m.biases.defined() ? std::optional<Buffer>(Buffer(std::move(m.biases))) : std::nullopt;
    mode_ = m.q.mode;
    group_size_ = m.q.group;
    bits_ = m.q.bits;
  }
  QuantMode mode_ = QuantMode::affine;
  int group_size_ = 64;
  int bits_ = 4;
};

/// MLX's QuantizedEmbedding: a quantized (num, dims) table; lookups dequantize only the rows
/// asked for (float32, or float64 for float64 scales), and as_linear is the tied LM head.
struct QuantizedEmbedding {
  Buffer weight;
  Buffer scales;
  std::optional<Buffer> biases;

  QuantizedEmbedding() = default;
  static QuantizedEmbedding from_embedding(const Embedding& e, Quant q = Quant::affine()) {
    QuantizedEmbedding out;
    QuantizedMatrix m = quantize(e.weight.value, q);
    out.weight = Buffer(std::move(m.weight));
    out.scales = Buffer(std::move(m.scales));
    if (m.biases.defined()) out.biases = Buffer(std::move(m.biases));
    out.mode_ = q.mode;
    out.group_size_ = q.group;
    out.bits_ = q.bits;
    return out;
  }
  static QuantizedEmbedding from_quantized(QuantizedMatrix m) {
    QuantizedEmbedding out;
    out.weight = Buffer(std::move(m.weight));
    out.scales = Buffer(std::move(m.scales));
    if (m.biases.defined()) out.biases = Buffer(std::move(m.biases));
    out.mode_ = m.q.mode;
    out.group_size_ = m.q.group;
    out.bits_ = m.q.bits;
    return out;
  }

  Quant quant() const { return Quant{mode_, group_size_, bits_}; }
  std::int64_t num_embeddings() const { return weight.value.dim(0); }
  std::int64_t dims() const { return weight.value.dim(1) * 32 / bits_; }
  QuantizedMatrix matrix() const { return {weight.value, scales.value, biases ? biases->value : Tensor(), quant()}; }
  Embedding dequantized() const {
    Embedding e;
    e.weight = Param(dequantize(matrix()));
    return e;
  }

  // ids: (...) int32/int64 -> (..., dims)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    auto w = detail::bind_quantized(tp, weight, scales, biases);
    const DType out = scales.value.dtype() == DType::f64 ? DType::f64 : DType::f32;
    return quantized_gather(tp, ids, w.wq, w.scales, w.biases, quant(), out);
  }
  /// The table as an output projection (a tied LM head): x (..., dims) -> logits (..., num).
  template <class B>
  GVar as_linear(GTape<B>& tp, GVar x) const {
    auto w = detail::bind_quantized(tp, weight, scales, biases);
    return quantized_matmul(tp, x, w.wq, w.scales, w.biases, quant(), true);
  }

  NN_MODULE(QuantizedEmbedding, weight, scales, biases, NN_STATIC(mode_, group_size_, bits_))

 private:
  QuantMode mode_ = QuantMode::affine;
  int group_size_ = 64;
  int bits_ = 4;
};

namespace detail {

/// What a quantize predicate said for one layer: skip it, or its format.
template <class Choose>
std::optional<Quant> quant_choice(Choose& choose, const std::string& path, const Quant& q) {
  using R = std::remove_cvref_t<decltype(choose(path))>;
  if constexpr (std::is_same_v<R, bool>) return choose(path) ? std::optional<Quant>(q) : std::nullopt;
  else return choose(path);
}

}  // namespace detail

/// mlx.nn.quantize(model, group_size, bits, mode, class_predicate): every Linear and Embedding
/// leaf whose path `choose` accepts becomes a QuantizedLinear / QuantizedEmbedding in format q.
/// `choose(path)` returns a bool, or a std::optional<Quant> (a per-layer format, as mlx-lm's
/// per-layer overrides; nullopt skips the layer). The leaves must sit in std::variant fields
/// that can hold the quantized type (std::variant<Linear, QuantizedLinear, ...>). Returns how
/// many layers were converted.
template <class M, class Choose>
  requires detail::ModuleType<M>
int quantize(M& model, Quant q, Choose choose) {
  int n = 0;
  auto keep = [&](const std::string& p) { return detail::quant_choice(choose, p, q).has_value(); };
  n += model.template map_modules<Linear>(keep, [&](const std::string& p, const Linear& l) {
    return QuantizedLinear::from_linear(l, *detail::quant_choice(choose, p, q));
  });
  n += model.template map_modules<Embedding>(keep, [&](const std::string& p, const Embedding& e) {
    return QuantizedEmbedding::from_embedding(e, *detail::quant_choice(choose, p, q));
  });
  return n;
}

/// Every Linear and Embedding leaf, affine with `group` and `bits` (MLX's defaults 64 and 4).
template <class M>
  requires detail::ModuleType<M>
int quantize(M& model, int group = 64, int bits = 4, QuantMode mode = QuantMode::affine) {
  return quantize(model, Quant{mode, group, bits}, [](const std::string&) { return true; });
}

}  // namespace nn
// ---- end nn/modules/quantized.hpp ----
// ---- begin nn/modules/dora.hpp ----
// DoraLinear: weight-decomposed low-rank adaptation (Liu et al. 2024, "DoRA"), laid out as
// mlx-lm's DoRALinear (linear.weight, lora_a (in, r), lora_b (r, out), m (out)).

#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <variant>

// ---- begin nn/modules/lora.hpp ----
// LoraLinear: a frozen Linear plus a trainable low-rank update (Hu et al. 2021), laid out as
// mlx-lm's LoRALinear (linear.weight, lora_a (in, r), lora_b (r, out)).

#include <cmath>
#include <tuple>
#include <utility>
#include <variant>


namespace nn {

namespace detail {

/// W + (scale * b^T) @ a^T in W's dtype, computed on backend B where the factors live: the merge
/// LoRA and DoRA fuse share (mlx-lm's fuse). base: a Linear, weight (out, in); a: (in, r),
/// b: (r, out). Returns the Linear with the merged weight, bias kept, trainable.
template <class B>
Linear merge_low_rank(Linear out, const Tensor& lora_a, const Tensor& lora_b, double scale, const char* who) {
  for (const Tensor* t : {&lora_a, &lora_b})
    if (t->device() != B::device)
      fail(who, "the layer lives on ", t->device(), " but the merge runs on backend ", B::name,
           ": call fused<B>() with the backend of ", t->device());
  GTape<B> tp;
  GVar bt = nn::scale(tp, transpose(tp, tp.constant(lora_b)), scale);  // (out, r)
  GVar delta = matmul(tp, bt, tp.constant(lora_a), false, true);       // (out, in)
  if (tp.dtype(delta) == out.weight.dtype()) {
    out.weight = Param(tp.value(add(tp, tp.constant(out.weight.value), delta)).clone());
  } else {
    // a bfloat16/float16 weight (dequantized from such scales): delta cast to it, then the sum
    // rounded to it, as MLX adds two half-precision arrays
    const Tensor d = tp.value(delta).to(Device::cpu).to(out.weight.dtype());
    Tensor w = out.weight.value.to(Device::cpu).clone();
    const DType t = w.dtype();
    for (std::int64_t i = 0; i < w.numel(); ++i)
      store_from_double(w.raw(), t, i, QuantMath::in(t, load_as_double(w.raw(), t, i) + load_as_double(d.raw(), t, i)));
    out.weight = Param(w.to(out.weight.value.device()));
  }
  out.unfreeze();
  return out;
}

/// The adapter factors a LoRA or DoRA layer starts from, as mlx-lm draws them: lora_a (in, r)
/// ~ U(+-1/sqrt(in)) from nn::random's sequence, lora_b (r, out) zero; in dtype dt.
inline std::pair<Param, Param> initial_factors(std::int64_t in, std::int64_t out, std::int64_t rank, DType dt) {
  init::LoraInit f = init::lora(in, out, rank);
  return {Param(f.lora_a.to(dt)), Param(f.lora_b.to(dt))};
}

/// The adapters' dtype over a base: the weight's for a Linear; float32 beside a quantized base
/// (float64 over float64 scales), as QLoRA trains.
inline DType adapter_dtype(const Linear& l) { return l.weight.dtype(); }
inline DType adapter_dtype(const QuantizedLinear& q) {
  return q.scales.dtype() == DType::f64 ? DType::f64 : DType::f32;
}

}  // namespace detail

/// y = linear(x) + scale * (dropout(x) @ lora_a) @ lora_b over a full-precision Linear (LoRA) or
/// a QuantizedLinear (QLoRA), as mlx-lm's LoRALinear over either. from_base(base, r) freezes the
/// base, draws lora_a ~ U(+-1/sqrt(in)) as mlx-lm does and zeroes lora_b, so the layer starts
/// equal to its base. `scale` is mlx-lm's multiplier (default 20); `.rslora()` divides it by
/// sqrt(r) (rank-stabilised LoRA, Kalajdzievski 2023: with scale = alpha this is PEFT's
/// use_rslora scaling alpha / sqrt(r)).
struct LoraLinear {
  std::variant<Linear, QuantizedLinear> base;  // reflected as "linear", frozen
  Param lora_a;                                // (in, r)
  Param lora_b;                                // (r, out)
  Dropout drop{0.0};

  static LoraLinear from_base(Linear base, std::int64_t rank) {
    base.freeze();
    return with_adapters(std::move(base), rank);
  }
  /// QLoRA: adapters in float32 (float64 over float64 scales) beside the quantized base.
  static LoraLinear from_base(QuantizedLinear base, std::int64_t rank) { return with_adapters(std::move(base), rank); }
  /// Whether the base is a QuantizedLinear.
  bool quantized() const { return std::holds_alternative<QuantizedLinear>(base); }
  /// The full-precision base (an nn::Error naming the layer's format when it is quantized).
  const Linear& linear() const {
    if (quantized()) detail::fail("LoraLinear", "the base is quantized (QuantizedLinear); use quantized_base()");
    return std::get<Linear>(base);
  }
  Linear& linear() { return const_cast<Linear&>(std::as_const(*this).linear()); }
  const QuantizedLinear& quantized_base() const {
    if (!quantized()) detail::fail("LoraLinear", "the base is a full-precision Linear; use linear()");
    return std::get<QuantizedLinear>(base);
  }
  std::int64_t in_features() const { return lora_a.value.dim(0); }
  std::int64_t out_features() const { return lora_b.value.dim(1); }
  LoraLinear& scale(double s) {
    scale_ = s;
    return *this;
  }
  LoraLinear& dropout(double p) {
    drop = Dropout(p);
    return *this;
  }
  LoraLinear& rslora(bool on = true) {
    rslora_ = on;
    return *this;
  }
  std::int64_t rank() const { return lora_a.value.dim(1); }
  /// The multiplier the forward applies: scale, or scale / sqrt(r) with rslora.
  double effective_scale() const { return rslora_ ? scale_ / std::sqrt(static_cast<double>(rank())) : scale_; }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar a = nn::param(tp, lora_a), b = nn::param(tp, lora_b);
    const bool no_drop = drop.p() == 0.0 || !drop.training();
    if (const auto* q = std::get_if<QuantizedLinear>(&base))
      return add(tp, (*q)(tp, x), detail::lora_branch(tp, no_drop ? x : drop(tp, x), a, b, effective_scale()));
    const Linear& l = std::get<Linear>(base);
    GVar w = nn::param(tp, l.weight);
    if (no_drop) {
      if (l.bias) return lora_linear(tp, x, w, nn::param(tp, *l.bias), a, b, effective_scale());
      return lora_linear(tp, x, w, a, b, effective_scale());
    }
    detail::check_lora(tp, x, w, a, b, "LoraLinear");
    return add(tp, l(tp, x), detail::lora_branch(tp, drop(tp, x), a, b, effective_scale()));
  }

  /// The merged Linear, mlx-lm's fuse(dequantize=True): W + (scale * b^T) @ a^T in W's dtype (a
  /// quantized base dequantized first, mx.dequantize), bias kept; computed on backend B where
  /// the layer lives (`l.fused<nn::cuda>()` for a layer on the GPU).
  template <class B = cpu>
  Linear fused() const {
    Linear out = quantized() ? std::get<QuantizedLinear>(base).dequantized() : std::get<Linear>(base);
    return detail::merge_low_rank<B>(std::move(out), lora_a.value, lora_b.value, effective_scale(), "LoraLinear::fused");
  }
  /// mlx-lm's fuse() over a quantized base: the dequantized merge above, quantized again in the
  /// base's format (mode, group, bits). An nn::Error over a full-precision base.
  template <class B = cpu>
  QuantizedLinear fused_quantized() const {
    const Quant q = quantized_base().quant();
    Linear l = fused<B>();
    return QuantizedLinear::from_linear(l, q);
  }

  NN_MODULE(LoraLinear, NN_RENAME(base, "linear"), lora_a, lora_b, drop, NN_STATIC(scale_, rslora_))

 private:
  template <class Base>
  static LoraLinear with_adapters(Base base, std::int64_t rank) {
    LoraLinear l;
    std::tie(l.lora_a, l.lora_b) = detail::initial_factors(base.in_features(), base.out_features(), rank, detail::adapter_dtype(base));
    l.base = std::move(base);
    return l;
  }
  double scale_ = 20.0;
  bool rslora_ = false;
};

}  // namespace nn
// ---- end nn/modules/lora.hpp ----

namespace nn {

/// y = m / ||W + s (A B)^T||_row * (x W^T + s (dropout(x) A) B) + bias over a full-precision
/// Linear or a QuantizedLinear (QDoRA), as mlx-lm's DoRALinear over either: the LoRA update
/// re-normalised per output row, with a trained magnitude m per row. The norm is detached (no
/// gradient flows through it), as in mlx-lm, PEFT and the paper's section 4.3; the math is
/// nn::dora_factor (layers/linear.hpp).
///
/// from_base(base, r) freezes the base, draws lora_a and zeroes lora_b as LoraLinear (so the
/// layer starts equal to its base) and sets m to the norms of W's rows (float32 beside a
/// quantized base, from its dequantized weight, as mlx-lm; the adapters' dtype otherwise).
///
/// Relation to PEFT's LoraConfig(use_dora=True): the same layer. PEFT's lora_magnitude_vector is
/// m, lora_A.weight / lora_B.weight are lora_a^T / lora_b^T, scaling = lora_alpha / r is `scale`.
/// PEFT initialises the magnitude to ||W + scaling B A|| (= ||W|| while B is zero). One
/// difference, in training with dropout only: PEFT rescales the base output computed from the
/// dropped-out x, mlx-lm (and nn) from x itself; with dropout 0, or in eval mode, they agree.
struct DoraLinear {
  std::variant<Linear, QuantizedLinear> base;  // reflected as "linear", frozen
  Param lora_a;                                // (in, r)
  Param lora_b;                                // (r, out)
  Param m;                                     // (out) the learned magnitude of each output row
  Dropout drop{0.0};

  static DoraLinear from_base(Linear base, std::int64_t rank) {
    base.freeze();
    return with_adapters(std::move(base), rank);
  }
  /// QDoRA: adapters and m in float32 (float64 over float64 scales) beside the quantized base.
  static DoraLinear from_base(QuantizedLinear base, std::int64_t rank) { return with_adapters(std::move(base), rank); }
  bool quantized() const { return std::holds_alternative<QuantizedLinear>(base); }
  std::int64_t in_features() const { return lora_a.value.dim(0); }
  std::int64_t out_features() const { return lora_b.value.dim(1); }
  std::int64_t rank() const { return lora_a.value.dim(1); }
  DoraLinear& scale(double s) {
    scale_ = s;
    return *this;
  }
  DoraLinear& dropout(double p) {
    drop = Dropout(p);
    return *this;
  }
  DoraLinear& rslora(bool on = true) {
    rslora_ = on;
    return *this;
  }
  /// The multiplier of the update: scale, or scale / sqrt(r) with rslora (PEFT's use_rslora).
  double effective_scale() const { return rslora_ ? scale_ / std::sqrt(static_cast<double>(rank())) : scale_; }

  // x: (..., in) -> (..., out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar a = nn::param(tp, lora_a), b = nn::param(tp, lora_b), mag = nn::param(tp, m);
    const double s = effective_scale();
    const bool no_drop = drop.p() == 0.0 || !drop.training();
    if (const auto* l = std::get_if<Linear>(&base)) {
      GVar w = nn::param(tp, l->weight);
      if (no_drop) return l->bias ? dora_linear(tp, x, w, nn::param(tp, *l->bias), a, b, mag, s) : dora_linear(tp, x, w, a, b, mag, s);
      detail::check_lora(tp, x, w, a, b, "DoraLinear");
      const auto [w_sq, wa] = detail::dora_weight_terms(tp, w, a);
      GVar y = add(tp, linear(tp, x, w), detail::lora_branch(tp, drop(tp, x), a, b, s));
      y = mul(tp, y, dora_factor(tp, w_sq, wa, a, b, mag, s));
      return l->bias ? add(tp, y, nn::param(tp, *l->bias)) : y;
    }
    // A quantized base: W A as (A^T W^T)^T through the quantized product; the rows' squared
    // norms of the frozen W once per recording (a Buffer is never trained, so a replay's
    // constant stays exact).
    const QuantizedLinear& q = std::get<QuantizedLinear>(base);
    auto w = detail::bind_quantized(tp, q.weight, q.scales, q.biases);
    GVar y = quantized_matmul(tp, x, w.wq, w.scales, w.biases, q.quant(), true);
    y = add(tp, y, detail::lora_branch(tp, no_drop ? x : drop(tp, x), a, b, s));
    GVar wa = transpose(tp, quantized_matmul(tp, transpose(tp, a), w.wq, w.scales, w.biases, q.quant(), true));
    y = mul(tp, y, dora_factor(tp, tp.constant(row_squares(q)), wa, a, b, mag, s));
    return q.bias ? add(tp, y, nn::param(tp, *q.bias)) : y;
  }

  /// The merged Linear, mlx-lm's DoRALinear.fuse(dequantize=True): W' = W + (s b^T) @ a^T (a
  /// quantized base dequantized first), then each row of W' scaled to norm m_i; bias kept.
  template <class B = cpu>
  Linear fused() const {
    Linear out = quantized() ? std::get<QuantizedLinear>(base).dequantized() : std::get<Linear>(base);
    out = detail::merge_low_rank<B>(std::move(out), lora_a.value, lora_b.value, effective_scale(), "DoraLinear::fused");
    // rows rescaled in double on the CPU, stored in the weight's dtype
    Tensor w = out.weight.value.to(Device::cpu).clone();
    const Tensor mag = m.value.to(Device::cpu);
    const DType t = w.dtype();
    const std::int64_t rows = w.dim(0), cols = w.dim(1);
    const Tensor n2 = detail::row_squares(w, DType::f64);
    for (std::int64_t i = 0; i < rows; ++i) {
      const double f = detail::load_as_double(mag.raw(), mag.dtype(), i) / std::sqrt(n2.data<double>()[i]);
      for (std::int64_t j = 0; j < cols; ++j)
        detail::store_from_double(w.raw(), t, i * cols + j,
                                  detail::QuantMath::in(t, f * detail::load_as_double(w.raw(), t, i * cols + j)));
    }
    out.weight = Param(w.to(out.weight.value.device()));
    return out;
  }
  /// mlx-lm's fuse() over a quantized base: the merge above quantized again in the base's format.
  template <class B = cpu>
  QuantizedLinear fused_quantized() const {
    if (!quantized()) detail::fail("DoraLinear", "the base is a full-precision Linear; use fused()");
    return QuantizedLinear::from_linear(fused<B>(), std::get<QuantizedLinear>(base).quant());
  }

  NN_MODULE(DoraLinear, NN_RENAME(base, "linear"), lora_a, lora_b, m, drop, NN_STATIC(scale_, rslora_))

 private:
  /// The squared norms of a quantized weight's rows, from its dequantized values. -> (out)
  static Tensor row_squares(const QuantizedLinear& q) {
    return detail::row_squares(dequantize(q.matrix()), detail::adapter_dtype(q)).to(q.scales.value.device());
  }
  template <class Base>
  static DoraLinear with_adapters(Base base, std::int64_t rank) {
    DoraLinear l;
    const DType dt = detail::adapter_dtype(base);
    std::tie(l.lora_a, l.lora_b) = detail::initial_factors(base.in_features(), base.out_features(), rank, dt);
    Tensor sq;  // f64, so each norm is rounded once, to dt
    if constexpr (std::is_same_v<Base, QuantizedLinear>) sq = detail::row_squares(dequantize(base.matrix()), DType::f64);
    else sq = detail::row_squares(base.weight.value, DType::f64);
    Tensor mag = Tensor::zeros(sq.shape(), dt);
    for (std::int64_t i = 0; i < sq.dim(0); ++i) detail::store_from_double(mag.raw(), dt, i, std::sqrt(sq.data<double>()[i]));
    l.m = Param(mag.to(l.lora_a.value.device()));
    l.base = std::move(base);
    return l;
  }
  double scale_ = 20.0;
  bool rslora_ = false;
};

}  // namespace nn
// ---- end nn/modules/dora.hpp ----
// ---- end nn/modules.hpp ----
// ---- begin nn/optim.hpp ----
// Every optimizer, schedule and clip_grad_norm (included by nn.hpp).

// ---- begin nn/optim/optimizer.hpp ----
// The optimizer base: a state tree (step, learning_rate, slots by parameter path) and
// update(model, grads) over a gradient tree of the model's own type, following MLX's
// Optimizer.apply_gradients (schedule at the current step, then step += 1, then the updates).

#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

// ---- begin nn/optim/schedules.hpp ----
// Learning-rate schedules as functions of the step, with MLX's semantics
// (mlx.optimizers.schedulers): the first update uses schedule(0), and each value is computed in
// float32 as MLX computes it (its scalars rounded to float32, then float32 arithmetic), so a
// schedule gives MLX's learning rate to the bit rather than a rounding of the exact one (which
// drifts: init * 0.9^step in double is 7e-7 away from MLX's by step 29).

#include <cmath>
#include <cstdint>
#include <functional>
#include <numbers>
#include <string>
#include <type_traits>
#include <vector>


namespace nn {

/// A learning rate as a function of the optimizer's step count (0 for the first update), with a
/// description a checkpoint records and checks on resume: "cosine_decay(init=0.001, ...)" for the
/// schedules below, "custom" for any other function (two custom schedules compare equal: name
/// one with Schedule(fn, "my_warmup(...)") to have a resume check it).
class Schedule {
 public:
  Schedule() = default;
  template <class F>
    requires(!std::is_same_v<std::remove_cvref_t<F>, Schedule> && std::is_invocable_r_v<double, F&, std::int64_t>)
  Schedule(F fn, std::string description = "custom") : fn_(std::move(fn)), description_(std::move(description)) {}

  double operator()(std::int64_t step) const { return fn_(step); }
  explicit operator bool() const { return static_cast<bool>(fn_); }
  /// What this schedule is, as a checkpoint writes it ("" for no schedule).
  const std::string& description() const { return description_; }

 private:
  std::function<double(std::int64_t)> fn_;
  std::string description_;
};

namespace detail {
/// "name(a=1, b=2)", numbers as StaticValue writes them (17 significant digits: exact round trip).
inline std::string describe_call(const char* name, std::initializer_list<std::pair<const char*, double>> args) {
  std::string out = std::string(name) + "(";
  bool first = true;
  for (const auto& [k, v] : args) {
    out += (first ? "" : ", ") + std::string(k) + "=" + static_value(v).str();
    first = false;
  }
  return out + ")";
}
}  // namespace detail

/// lr at every step (in double, as a plain learning rate is): a schedule where an API wants one.
inline Schedule constant_schedule(double lr) {
  return Schedule([lr](std::int64_t) { return lr; }, detail::describe_call("constant_schedule", {{"lr", lr}}));
}

/// init * rate^step
inline Schedule exponential_decay(double init, double decay_rate) {
  const float i = static_cast<float>(init), r = static_cast<float>(decay_rate);
  return Schedule([=](std::int64_t step) { return static_cast<double>(i * std::pow(r, static_cast<float>(step))); },
                  detail::describe_call("exponential_decay", {{"init", init}, {"decay_rate", decay_rate}}));
}

/// init * rate^(step / step_size), integer division
inline Schedule step_decay(double init, double decay_rate, std::int64_t step_size) {
  if (step_size <= 0) detail::fail("step_decay", "step_size must be positive, got ", step_size);
  const float i = static_cast<float>(init), r = static_cast<float>(decay_rate);
  return Schedule(
      [=](std::int64_t step) { return static_cast<double>(i * std::pow(r, static_cast<float>(step / step_size))); },
      detail::describe_call("step_decay", {{"init", init}, {"decay_rate", decay_rate}, {"step_size", double(step_size)}}));
}

/// end + 0.5 (1 + cos(pi min(step, decay_steps) / decay_steps)) (init - end)
inline Schedule cosine_decay(double init, std::int64_t decay_steps, double end = 0.0) {
  if (decay_steps <= 0) detail::fail("cosine_decay", "decay_steps must be positive, got ", decay_steps);
  // MLX: (pi / decay_steps) and (init - end) are Python doubles, rounded once to float32.
  const float k = static_cast<float>(std::numbers::pi / static_cast<double>(decay_steps));
  const float e = static_cast<float>(end), span = static_cast<float>(init - end);
  return Schedule(
      [=](std::int64_t step) {
        const float s = static_cast<float>(std::min(step, decay_steps));
        const float decay = 0.5f * (1.0f + std::cos(k * s));
        return static_cast<double>(e + decay * span);
      },
      detail::describe_call("cosine_decay", {{"init", init}, {"decay_steps", double(decay_steps)}, {"end", end}}));
}

/// init + min(step, steps) (end - init) / steps: a linear warm-up when init < end.
inline Schedule linear_schedule(double init, double end, std::int64_t steps) {
  if (steps <= 0) detail::fail("linear_schedule", "steps must be positive, got ", steps);
  const float i = static_cast<float>(init), slope = static_cast<float>((end - init) / static_cast<double>(steps));
  return Schedule(
      [=](std::int64_t step) { return static_cast<double>(static_cast<float>(std::min(step, steps)) * slope + i); },
      detail::describe_call("linear_schedule", {{"init", init}, {"end", end}, {"steps", double(steps)}}));
}

/// schedules[0] until boundaries[0], then schedules[1] on (step - boundaries[0]), and so on.
inline Schedule join_schedules(std::vector<Schedule> schedules, std::vector<std::int64_t> boundaries) {
  if (schedules.empty() || boundaries.size() + 1 != schedules.size())
    detail::fail("join_schedules", "needs one boundary fewer than schedules, got ", schedules.size(),
                 " schedules and ", boundaries.size(), " boundaries");
  std::string description = "join_schedules([";
  for (std::size_t i = 0; i < schedules.size(); ++i) description += (i ? ", " : "") + schedules[i].description();
  description += "], [";
  for (std::size_t i = 0; i < boundaries.size(); ++i) description += (i ? ", " : "") + std::to_string(boundaries[i]);
  description += "])";
  return Schedule(
      [=](std::int64_t step) {
        double out = schedules[0](step);
        for (std::size_t i = 0; i < boundaries.size(); ++i)
          if (step >= boundaries[i]) out = schedules[i + 1](step - boundaries[i]);
        return out;
      },
      std::move(description));
}

}  // namespace nn
// ---- end nn/optim/schedules.hpp ----

namespace nn {

namespace detail {
/// Zeros on `dev` (optimizer state lives where its parameter lives).
inline Tensor zeros_on(const Shape& s, DType t, Device dev) {
  Tensor z = Tensor::zeros(s, t);
  return dev == Device::cpu ? z : z.to(dev);
}

}  // namespace detail

/// The base of every optimizer (usable through std::unique_ptr<Optimizer>).
///
/// State: `step` (0-D int64) and `learning_rate` (0-D float64) are tensors so a replayed step
/// reads new values without re-recording; `slots` hold per-parameter buffers keyed by the
/// parameter's path. Freezing or unfreezing a parameter never moves or resets its slots.
class Optimizer {
 public:
  using Slots = std::map<std::string, Tensor>;

  explicit Optimizer(double lr) : Optimizer(Schedule{}) { set_learning_rate(lr); }
  explicit Optimizer(Schedule schedule) : schedule_(std::move(schedule)) {
    step_ = Tensor::zeros(Shape{}, DType::i64);
    lr_ = Tensor::zeros(Shape{}, DType::f64);
    if (schedule_) lr_.data<double>()[0] = schedule_(0);
  }
  virtual ~Optimizer() = default;
  /// A copy owns its state: step, learning rate and slots are cloned, so two copies train
  /// independently (tensors themselves copy shallowly).
  Optimizer(const Optimizer& o) : schedule_(o.schedule_), skip_nonfinite_(o.skip_nonfinite_), skipped_(o.skipped_) {
    copy_state(o);
  }
  Optimizer& operator=(const Optimizer& o) {
    if (this != &o) {
      schedule_ = o.schedule_;
      skip_nonfinite_ = o.skip_nonfinite_;
      skipped_ = o.skipped_;
      copy_state(o);
    }
    return *this;
  }
  Optimizer(Optimizer&&) = default;
  Optimizer& operator=(Optimizer&&) = default;

  /// Creates the slots of every trainable parameter now (else they are made on first use).
  template <class M>
  void init(const M& model) {
    detail::for_each(model, [&](const std::string& path, const Param& p) {
      if (p.trainable) init_param(path, p.value);
    });
  }

  /// Updates every trainable parameter of `model` from the same-typed gradient tree `grads`
  /// (as returned by value_and_grad); frozen parameters are untouched.
  template <class M>
  void update(M& model, const M& grads) {
    std::vector<std::pair<std::string, Param*>> ps;
    std::vector<const Param*> gs;
    detail::for_each(model, [&](const std::string& path, Param& p) { ps.emplace_back(path, &p); });
    detail::for_each(grads, [&](const std::string&, const Param& g) { gs.push_back(&g); });
    if (ps.size() != gs.size())
      detail::fail("optimizer", "the gradient tree has ", gs.size(), " parameters but the model has ", ps.size());
    // Every check (gradients, slots) before anything changes: a failed update changes nothing.
    for (std::size_t i = 0; i < ps.size(); ++i) {
      Param& p = *ps[i].second;
      if (!p.trainable) continue;
      const Tensor& g = gs[i]->value;
      if (!g.defined()) detail::fail("optimizer", "no gradient for trainable parameter '", ps[i].first, "'");
      if (!(g.shape() == p.value.shape()) || g.dtype() != p.value.dtype())
        detail::fail("optimizer", "gradient of '", ps[i].first, "' is ", g.shape().str(), " ", dtype_name(g.dtype()),
                     " but the parameter is ", p.value.shape().str(), " ", dtype_name(p.value.dtype()));
      init_param(ps[i].first, p.value);
    }
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (ps[i].second->trainable && !admit(ps[i].first, detail::all_finite(gs[i]->value))) return;
    begin_step();
    for (std::size_t i = 0; i < ps.size(); ++i)
      if (ps[i].second->trainable) apply(ps[i].first, ps[i].second->value, gs[i]->value);
  }

  /// What an update does when a gradient holds NaN or Inf (a NaN loss, an overflow): by default
  /// it raises naming the parameter and changes nothing; with skip_nonfinite(true) it skips the
  /// whole step -- no parameter, slot, step count or schedule position changes -- and counts it
  /// (skipped_steps()), as mixed-precision trainers skip overflowed steps.
  Optimizer& skip_nonfinite(bool on = true) {
    skip_nonfinite_ = on;
    return *this;
  }
  std::int64_t skipped_steps() const { return skipped_; }
  /// The update's gate, called for each trainable parameter in order before anything changes:
  /// true lets the step go on; a non-finite gradient raises, or (skip_nonfinite) counts a
  /// skipped step and returns false. Optimizer::update and compiled steps call it.
  bool admit(const std::string& path, bool gradient_finite) {
    if (gradient_finite) return true;
    if (!skip_nonfinite_)
      detail::fail("optimizer", "the gradient of '", path, "' holds NaN or Inf at update ", step() + 1,
                   ": nothing was updated (skip_nonfinite(true) skips such steps and counts them)");
    ++skipped_;
    return false;
  }

  /// The number of updates applied so far.
  std::int64_t step() const { return step_.data<std::int64_t>()[0]; }
  /// The learning rate the next update uses (a schedule overrides it at each update).
  virtual double learning_rate() const { return lr_.data<double>()[0]; }
  virtual void set_learning_rate(double lr) { lr_.data<double>()[0] = lr; }

  /// The state as a flat list of (path, tensor): "step", "learning_rate", "slots.<param>.<slot>"
  /// — how a checkpoint saves it. Tensors are shared, not copied.
  virtual std::vector<std::pair<std::string, Tensor>> state() const {
    std::vector<std::pair<std::string, Tensor>> out{{"step", step_}, {"learning_rate", lr_}};
    for (const auto& [path, slots] : slots_)
      for (const auto& [name, t] : slots) out.emplace_back("slots." + path + "." + name, t);
    return out;
  }
  /// Replaces the state from (path, tensor) pairs as state() wrote them. Strict: an unknown,
  /// missing or mis-shaped entry raises and leaves the optimizer as it was.
  virtual void load_state(const std::vector<std::pair<std::string, Tensor>>& entries) {
    Parsed st = parse_state(entries);
    step_.data<std::int64_t>()[0] = st.step;
    lr_.data<double>()[0] = st.lr;
    slots_ = std::move(st.slots);
  }
  /// Raises exactly when load_state would; changes nothing.
  virtual void check_state(const std::vector<std::pair<std::string, Tensor>>& entries) const {
    parse_state(entries);
  }

  /// The slots of one parameter (empty map when it has none yet).
  const Slots& slots(const std::string& path) const {
    static const Slots none;
    auto it = slots_.find(path);
    return it == slots_.end() ? none : it->second;
  }

  /// MLX's order: scheduled values at the current step, then step += 1. Called once per update.
  virtual void begin_step() {
    if (schedule_) lr_.data<double>()[0] = schedule_(step());
    step_.data<std::int64_t>()[0] += 1;
  }
  /// Creates the slots of one parameter if it has none; checks those it has (they may come from
  /// load_state) against the parameter, so a mis-shaped slot raises before any kernel reads it.
  virtual void init_param(const std::string& path, const Tensor& p) {
    auto it = slots_.find(path);
    if (it == slots_.end()) {
      Slots& s = slots_[path];
      for (const char* name : slot_names(p)) s[name] = detail::zeros_on(slot_shape(path, name, p), p.dtype(), p.device());
      return;
    }
    for (const char* name : slot_names(p)) {
      auto t = it->second.find(name);
      if (t == it->second.end())
        detail::fail("optimizer", "parameter '", path, "' has no slot '", name, "' (state entry 'slots.", path, ".",
                     name, "' is missing)");
      const Shape want = slot_shape(path, name, p);
      if (!(t->second.shape() == want) || t->second.dtype() != p.dtype())
        detail::fail("optimizer", "slot '", name, "' of '", path, "' is ", t->second.shape().str(), " ",
                     dtype_name(t->second.dtype()), " but the parameter is ", p.shape().str(), " ", dtype_name(p.dtype()),
                     want == p.shape() ? std::string() : " (the slot should be " + want.str() + ")");
    }
    // Slots loaded from a checkpoint are host tensors: they follow their parameter to its device.
    for (const char* name : slot_names(p)) {
      Tensor& t = it->second.at(name);
      if (t.device() != p.device()) t = t.to(p.device());
    }
  }
  /// The shape of slot `name` of the parameter at `path` (value p): p's own unless an optimizer
  /// keeps another (Adafactor's factored second moments). Slots are created and checked with it,
  /// and so are a checkpoint's entries (MultiOptimizer asks the member `path` goes to).
  virtual Shape slot_shape(const std::string& /*path*/, std::string_view /*name*/, const Tensor& p) const {
    return p.shape();
  }
  /// The update of one parameter from its gradient, using its slots.
  virtual void apply(const std::string& path, Tensor& p, const Tensor& g) = 0;
  /// The optimizer's type as a checkpoint records it ("AdamW"); NN_OPTIMIZER defines it.
  virtual const char* type_name() const { return "Optimizer"; }
  /// Visits the non-tensor hyperparameters (betas, momentum, weight decay, ...) as
  /// NN_OPTIMIZER lists them, base class first. Not the learning rate or the step: those are
  /// tensors, a replayed step reads them without recording again.
  virtual void visit_config(StaticSink&) const {}
  /// A hash of the type and visit_config's fields (allocation-free: a compiled step computes it on
  /// every call and records again when it changes).
  std::uint64_t hyper_hash() const {
    detail::HashSink h;
    h.field("type", detail::static_value(std::string_view(type_name())));
    visit_config(h);
    return h.fnv.h;
  }
  /// The configuration as a checkpoint's metadata holds it: {"type", "AdamW"}, {"b1", "0.9"},
  /// ..., and {"schedule", "cosine_decay(...)"} or, without one, {"learning_rate", "0.001"}.
  std::vector<std::pair<std::string, std::string>> describe() const {
    struct Collect final : StaticSink {
      std::vector<std::pair<std::string, std::string>> out;
      void field(std::string_view name, const StaticValue& v) override { out.emplace_back(name, v.str()); }
    } c;
    c.out.emplace_back("type", type_name());
    visit_config(c);
    describe_rate(c.out, "");
    return std::move(c.out);
  }
  /// Adds {prefix + "schedule", description}, or {prefix + "learning_rate", value} without a
  /// schedule (MultiOptimizer adds its members' with their group prefix).
  virtual void describe_rate(std::vector<std::pair<std::string, std::string>>& out, const std::string& prefix) const {
    if (schedule_) out.emplace_back(prefix + "schedule", schedule_.description());
    else out.emplace_back(prefix + "learning_rate", detail::static_value(learning_rate()).str());
  }

 protected:
  void copy_state(const Optimizer& o) {
    step_ = o.step_.clone();
    lr_ = o.lr_.clone();
    slots_.clear();
    for (const auto& [path, slots] : o.slots_)
      for (const auto& [name, t] : slots) slots_[path][name] = t.clone();
  }

  struct Parsed {
    std::int64_t step = 0;
    double lr = 0;
    std::map<std::string, Slots> slots;
  };
  /// Parses a state; where this optimizer already holds slots (after init or updates), the
  /// entries must name exactly those slots, with their shapes and dtypes.
  Parsed parse_state(const std::vector<std::pair<std::string, Tensor>>& entries) const {
    Parsed out;
    bool has_step = false, has_lr = false;
    for (const auto& [name, t] : entries) {
      if ((name == "step" || name == "learning_rate") && (!t.defined() || t.numel() != 1))
        detail::fail("optimizer", "state entry '", name, "' must hold one element, got ",
                     t.defined() ? t.shape().str() : std::string("nothing"));
      if (name == "step") {
        out.step = static_cast<std::int64_t>(t.item());
        has_step = true;
      } else if (name == "learning_rate") {
        out.lr = t.item();
        has_lr = true;
      } else if (name.rfind("slots.", 0) == 0 && name.rfind('.') > 6 && t.defined()) {
        const std::size_t dot = name.rfind('.');
        const std::string path = name.substr(6, dot - 6), slot_name = name.substr(dot + 1);
        auto held = slots_.find(path);
        if (held != slots_.end()) {
          auto s = held->second.find(slot_name);
          if (s == held->second.end()) detail::fail("optimizer", "unknown state entry '", name, "'");
          if (!(s->second.shape() == t.shape()) || s->second.dtype() != t.dtype())
            detail::fail("optimizer", "state entry '", name, "' is ", t.shape().str(), " ", dtype_name(t.dtype()),
                         " but the slot is ", s->second.shape().str(), " ", dtype_name(s->second.dtype()));
        }
        out.slots[path][slot_name] = t.clone();
      } else {
        detail::fail("optimizer", "unknown state entry '", name, "'");
      }
    }
    if (!has_step || !has_lr) detail::fail("optimizer", "state needs 'step' and 'learning_rate'");
    for (const auto& [path, slots] : slots_)
      for (const auto& [slot_name, t] : slots) {
        auto got = out.slots.find(path);
        if (got == out.slots.end() || !got->second.count(slot_name))
          detail::fail("optimizer", "state entry 'slots.", path, ".", slot_name, "' is missing");
      }
    return out;
  }

  /// Which zero-initialised slots a parameter needs ("m", "v", ...).
  virtual std::vector<const char*> slot_names(const Tensor& p) const = 0;
  Tensor& slot(const std::string& path, const char* name) { return slots_.at(path).at(name); }

  Tensor step_;  // 0-D int64
  Tensor lr_;    // 0-D float64
  Schedule schedule_;
  bool skip_nonfinite_ = false;
  std::int64_t skipped_ = 0;
  std::map<std::string, Slots> slots_;
};

}  // namespace nn

/// Declares an optimizer's name and hyperparameters inside its class:
/// `NN_OPTIMIZER(Lion, Optimizer, b1_, b2_, wd_)`. The fields are hashed into hyper_hash() (a
/// compiled step records again when one changes) and written to, and checked by, a checkpoint
/// (nn::save / nn::load_into), after the base class's fields.
#define NN_OPTIMIZER(Name, Base, ...)                                          \
  const char* type_name() const override { return #Name; }                    \
  void visit_config(::nn::StaticSink& sink) const override {                   \
    Base::visit_config(sink);                                                  \
    ::nn::detail::statics(#__VA_ARGS__, __VA_ARGS__).visit(sink);              \
  }
// ---- end nn/optim/optimizer.hpp ----
// ---- begin nn/optim/sgd.hpp ----
// Stochastic gradient descent with momentum, dampening, Nesterov and weight decay (MLX's SGD).


namespace nn {

/// MLX's SGD: g += wd p; without momentum p -= lr g; with it v = mu v + (1 - tau) g and
/// p -= lr (nesterov ? g + mu v : v). Matches torch.optim.SGD when dampening is 0.
template <class B = cpu>
class Sgd : public Optimizer {
 public:
  explicit Sgd(double lr) : Optimizer(lr) {}
  explicit Sgd(Schedule s) : Optimizer(std::move(s)) {}

  Sgd& momentum(double m) { momentum_ = m; return check(); }
  Sgd& dampening(double d) { dampening_ = d; return check(); }
  Sgd& weight_decay(double w) { wd_ = w; return *this; }
  /// Nesterov momentum; needs momentum > 0 and no dampening (as MLX and PyTorch).
  Sgd& nesterov(bool on = true) { nesterov_ = on; return check(); }

  NN_OPTIMIZER(Sgd, Optimizer, momentum_, dampening_, wd_, nesterov_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    Tensor none;
    B::sgd_update(p, g, momentum_ > 0 ? slot(path, "v") : none, lr_, momentum_, dampening_, wd_, nesterov_);
  }

 protected:
  std::vector<const char*> slot_names(const Tensor&) const override { return {"v"}; }

 private:
  Sgd& check() {
    if (nesterov_ && (momentum_ <= 0 || dampening_ != 0))
      detail::fail("sgd", "Nesterov momentum needs momentum > 0 and zero dampening (momentum ", momentum_,
                   ", dampening ", dampening_, ")");
    return *this;
  }
  double momentum_ = 0, dampening_ = 0, wd_ = 0;
  bool nesterov_ = false;
};

}  // namespace nn
// ---- end nn/optim/sgd.hpp ----
// ---- begin nn/optim/adam.hpp ----
// Adam and AdamW with MLX's defaults: betas (0.9, 0.999), eps 1e-8, no bias correction unless
// asked; AdamW's decoupled decay (default 0.01) applied before the Adam step.


namespace nn {

/// MLX's Adam: m = b1 m + (1-b1) g, v = b2 v + (1-b2) g^2, p -= lr m / (sqrt v + eps);
/// .bias_correction() gives torch.optim.Adam's update.
template <class B = cpu>
class Adam : public Optimizer {
 public:
  explicit Adam(double lr) : Optimizer(lr) {}
  explicit Adam(Schedule s) : Optimizer(std::move(s)) {}

  Adam& betas(double b1, double b2) { b1_ = b1; b2_ = b2; return *this; }
  Adam& eps(double e) { eps_ = e; return *this; }
  Adam& bias_correction(bool on = true) { bias_correction_ = on; return *this; }

  NN_OPTIMIZER(Adam, Optimizer, b1_, b2_, eps_, bias_correction_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    B::adam_update(p, g, slot(path, "m"), slot(path, "v"), lr_, step_, b1_, b2_, eps_, decoupled_wd(), bias_correction_);
  }

 protected:
  virtual double decoupled_wd() const { return 0.0; }
  std::vector<const char*> slot_names(const Tensor&) const override { return {"m", "v"}; }
  double b1_ = 0.9, b2_ = 0.999, eps_ = 1e-8;
  bool bias_correction_ = false;
};

/// MLX's AdamW: p *= 1 - lr wd, then Adam. With .bias_correction() it is torch.optim.AdamW.
template <class B = cpu>
class AdamW : public Adam<B> {
 public:
  explicit AdamW(double lr) : Adam<B>(lr) {}
  explicit AdamW(Schedule s) : Adam<B>(std::move(s)) {}

  AdamW& weight_decay(double w) { wd_ = w; return *this; }
  AdamW& betas(double b1, double b2) { Adam<B>::betas(b1, b2); return *this; }
  AdamW& eps(double e) { Adam<B>::eps(e); return *this; }
  AdamW& bias_correction(bool on = true) { Adam<B>::bias_correction(on); return *this; }

  NN_OPTIMIZER(AdamW, Adam<B>, wd_)

 protected:
  double decoupled_wd() const override { return wd_; }

 private:
  double wd_ = 0.01;
};

}  // namespace nn
// ---- end nn/optim/adam.hpp ----
// ---- begin nn/optim/lion.hpp ----
// Lion (Chen et al. 2023, "Symbolic Discovery of Optimization Algorithms"), MLX's form.


namespace nn {

/// c = b1 m + (1-b1) g; m = b2 m + (1-b2) g; p *= 1 - lr wd (when wd > 0); p -= lr sign(c).
template <class B = cpu>
class Lion : public Optimizer {
 public:
  explicit Lion(double lr) : Optimizer(lr) {}
  explicit Lion(Schedule s) : Optimizer(std::move(s)) {}

  Lion& betas(double b1, double b2) { b1_ = b1; b2_ = b2; return *this; }
  Lion& weight_decay(double w) { wd_ = w; return *this; }

  NN_OPTIMIZER(Lion, Optimizer, b1_, b2_, wd_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    B::lion_update(p, g, slot(path, "m"), lr_, b1_, b2_, wd_);
  }

 protected:
  std::vector<const char*> slot_names(const Tensor&) const override { return {"m"}; }

 private:
  double b1_ = 0.9, b2_ = 0.99, wd_ = 0.0;
};

}  // namespace nn
// ---- end nn/optim/lion.hpp ----
// ---- begin nn/optim/muon.hpp ----
// Muon (Jordan et al. 2024): momentum orthogonalised by Newton-Schulz iterations, MLX's form.

#include <cmath>


namespace nn {

/// g += wd p (coupled); v = mu v + (1-mu) g; u = nesterov ? (1-mu) g + mu v : v. For a
/// parameter of rank >= 2, u is viewed as (shape[0], -1), orthogonalised by `ns_steps`
/// Newton-Schulz iterations with (a, b, c) = (3.4445, -4.7750, 2.0315) on the wide orientation,
/// and the step is scaled by sqrt(max(1, shape[-2] / shape[-1])) of the parameter's own shape
/// (MLX's choice). Rank < 2: the plain momentum update.
template <class B = cpu>
class Muon : public Optimizer {
 public:
  explicit Muon(double lr) : Optimizer(lr) {}
  explicit Muon(Schedule s) : Optimizer(std::move(s)) {}

  Muon& momentum(double m) { mu_ = m; return *this; }
  Muon& weight_decay(double w) { wd_ = w; return *this; }
  Muon& nesterov(bool on = true) { nesterov_ = on; return *this; }
  Muon& ns_steps(int n) { steps_ = n; return *this; }

  NN_OPTIMIZER(Muon, Optimizer, mu_, wd_, nesterov_, steps_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    Slots& w = work_.at(path);
    Tensor& u = w.at("u");
    B::muon_momentum(p, g, slot(path, "v"), u, mu_, wd_, nesterov_);
    if (p.rank() < 2) {
      B::apply_update(p, u, lr_, 1.0);
      return;
    }
    const std::int64_t rows = p.dim(0), cols = p.numel() / rows;
    const bool tall = rows > cols;  // iterate on X = u^T so that X X^T is the small Gram matrix
    const std::int64_t r = tall ? cols : rows, c = tall ? rows : cols;
    Tensor X = w.at("x"), A = w.at("a"), Bm = w.at("b"), T1 = w.at("t");
    X = X.reshape(Shape{r, c});
    A = A.reshape(Shape{r, r});
    Bm = Bm.reshape(Shape{r, r});
    T1 = T1.reshape(Shape{r, c});
    Tensor u2 = u.reshape(Shape{rows, cols});
    if (tall) B::permute(u2, {1, 0}, X, false);
    else B::copy(u2, X, false);
    B::normalize_frobenius(X, 1e-7);
    for (int i = 0; i < steps_; ++i) {
      B::matmul(X, false, X, true, A, false);  // A = X X^T
      B::copy(A, Bm, false);
      B::matmul(A, false, A, false, Bm, false);  // Bm = A A
      B::axpby(kB, A, kC, Bm);                   // Bm = b A + c A A
      B::matmul(Bm, false, X, false, T1, false); // T1 = Bm X
      B::axpby(kA, X, 1.0, T1);                  // T1 = a X + Bm X
      std::swap(X, T1);
    }
    if (tall) B::permute(X, {1, 0}, u2, false);
    else B::copy(X, u2, false);
    const double ratio = static_cast<double>(p.dim(-2)) / static_cast<double>(p.dim(-1));
    B::apply_update(p, u, lr_, std::sqrt(std::max(1.0, ratio)));
  }

 protected:
  void init_param(const std::string& path, const Tensor& p) override {
    Optimizer::init_param(path, p);
    if (work_.count(path)) return;
    // Workspace, not state (not saved): the update direction and the Newton-Schulz buffers,
    // kept so an update allocates nothing.
    Slots& w = work_[path];
    w["u"] = detail::zeros_on(p.shape(), p.dtype(), p.device());
    if (p.rank() >= 2) {
      const std::int64_t rows = p.dim(0), cols = p.numel() / rows, r = std::min(rows, cols);
      w["x"] = detail::zeros_on(Shape{rows * cols}, p.dtype(), p.device());
      w["t"] = detail::zeros_on(Shape{rows * cols}, p.dtype(), p.device());
      w["a"] = detail::zeros_on(Shape{r * r}, p.dtype(), p.device());
      w["b"] = detail::zeros_on(Shape{r * r}, p.dtype(), p.device());
    }
  }
  std::vector<const char*> slot_names(const Tensor&) const override { return {"v"}; }

 private:
  static constexpr double kA = 3.4445, kB = -4.7750, kC = 2.0315;
  double mu_ = 0.95, wd_ = 0.01;
  bool nesterov_ = true;
  int steps_ = 5;
  std::map<std::string, Slots> work_;
};

}  // namespace nn
// ---- end nn/optim/muon.hpp ----
// ---- begin nn/optim/adafactor.hpp ----
// Adafactor (Shazeer & Stern 2018, "Adafactor: Adaptive Learning Rates with Sublinear Memory
// Cost"), MLX's form, composed from backend kernels (no kernel of its own).

#include <algorithm>
#include <cmath>
#include <memory>
#include <string_view>


namespace nn {

/// MLX's Adafactor. With t the step (already incremented), per parameter p with gradient g:
///
///     beta2 = 1 - t^decay_rate                      rms(x) = sqrt(mean(x^2))
///     rho   = relative_step ? min(warmup_init ? 1e-6 t : 1e-2, 1/sqrt(t)) : learning_rate
///     lr    = scale_parameter ? max(eps2, rms(p)) rho : rho
///     u     = g^2 + eps1
///     rank >= 2 (factored; R over the last axis, C over the second-to-last):
///       row = beta2 row + (1 - beta2) mean(u, -1)          shape[:-1]
///       col = beta2 col + (1 - beta2) mean(u, -2)          shape[:-2] + shape[-1:]
///       u   = rsqrt(row / mean(row, -1))[..., None] * rsqrt(col)[..., None, :] * g
///     rank < 2: v = beta2 v + (1 - beta2) u;  u = rsqrt(v) g
///     u  = lr u / max(1, rms(u) / clip_threshold)
///     beta1 set: m = beta1 m + (1 - beta1) u;  u = m
///     p  = p + p (-weight_decay lr) - u
///
/// Slots as MLX names them: exp_avg_sq_row and exp_avg_sq_col (rank >= 2) or exp_avg_sq, plus
/// exp_avg with .beta1(). Like MLX, relative_step is on unless turned off, even with a learning
/// rate given: Adafactor(lr).relative_step(false) is MLX's Adafactor(learning_rate=lr,
/// relative_step=False). The scalars (beta2, rho, the RMSs, the clip divisor) are computed on the
/// host at each update in MLX's float32 order; the step-derived ones (t^decay_rate, 1/sqrt(t),
/// 1e-6 t) in float32 as MLX does, then rounded to the parameter's dtype (MLX's astype).
template <class B = cpu>
class Adafactor : public Optimizer {
 public:
  /// The relative step size (MLX's Adafactor() without a learning rate).
  Adafactor() : Optimizer(0.0) {}
  explicit Adafactor(double lr) : Optimizer(lr), has_lr_(true) {}
  explicit Adafactor(Schedule s) : Optimizer(std::move(s)), has_lr_(true) {}

  Adafactor& eps(double e1, double e2) { eps1_ = e1; eps2_ = e2; return *this; }
  Adafactor& clip_threshold(double c) { clip_threshold_ = c; return *this; }
  Adafactor& decay_rate(double d) { decay_rate_ = d; return *this; }
  Adafactor& beta1(double b) { beta1_ = b; use_beta1_ = true; return *this; }
  Adafactor& weight_decay(double w) { wd_ = w; return *this; }
  Adafactor& scale_parameter(bool on = true) { scale_parameter_ = on; return *this; }
  Adafactor& relative_step(bool on = true) { relative_step_ = on; return *this; }
  Adafactor& warmup_init(bool on = true) { warmup_init_ = on; return *this; }

  void set_learning_rate(double lr) override {
    Optimizer::set_learning_rate(lr);
    has_lr_ = true;
  }

  NN_OPTIMIZER(Adafactor, Optimizer, eps1_, eps2_, clip_threshold_, decay_rate_, use_beta1_, beta1_, wd_,
               scale_parameter_, relative_step_, warmup_init_)
  void apply(const std::string& path, Tensor& p, const Tensor& g) override {
    if (p.dtype() == DType::f32) update_as<float>(*work_.at(path), path, p, g);
    else update_as<double>(*work_.at(path), path, p, g);
  }

  Shape slot_shape(const std::string&, std::string_view name, const Tensor& p) const override {
    if (p.rank() >= 2 && name == "exp_avg_sq_row") return head(p.shape(), 1);
    if (p.rank() >= 2 && name == "exp_avg_sq_col") return head(p.shape(), 2, {p.shape().dim(-1)});
    return p.shape();
  }

 protected:
  void init_param(const std::string& path, const Tensor& p) override {
    if (!relative_step_ && !has_lr_)
      detail::fail("optimizer", "Adafactor with relative_step(false) needs a learning rate: Adafactor(lr) or Adafactor(schedule)");
    if (p.dtype() != DType::f32 && p.dtype() != DType::f64)
      detail::fail("optimizer", "Adafactor updates float32 and float64 parameters; '", path, "' is ", dtype_name(p.dtype()));
    Optimizer::init_param(path, p);
    auto it = work_.find(path);
    if (it != work_.end() && it->second->u.device() == p.device()) return;
    // Workspace, not state (not saved), so an update allocates nothing: temporaries, shared by
    // the parameters of one shape, dtype and device (they are updated one after another).
    std::shared_ptr<Work>& w = by_shape_[p.shape().str() + dtype_name(p.dtype()) + (p.device() == Device::cpu ? "" : "@dev")];
    if (!w) w = std::make_shared<Work>(make_work(p));
    work_[path] = w;
  }
  std::vector<const char*> slot_names(const Tensor& p) const override {
    std::vector<const char*> names;
    if (p.rank() >= 2) names = {"exp_avg_sq_row", "exp_avg_sq_col"};
    else names = {"exp_avg_sq"};
    if (use_beta1_) names.push_back("exp_avg");
    return names;
  }

 private:
  /// Temporaries of one parameter shape. Factored (rank >= 2) ones are views: rk (shape[:-1] + [1])
  /// holds mean(u, -1) and then r (its shape[:-1] view), ck (shape[:-2] + [1, n]) holds mean(u, -2)
  /// and then c (its shape[:-2] + [n] view), rm (shape[:-2] + [1]) holds mean(row, -1).
  struct Work {
    Tensor u, t;  // the update; squares for an RMS
    Tensor s;     // one element: a mean of squares, then the clip divisor
    Tensor rk, r, ck, c, rm;
  };
  /// shape[:-drop] + tail.
  static Shape head(const Shape& s, int drop, std::initializer_list<std::int64_t> tail = {}) {
    Shape out;
    for (int i = 0; i < s.rank() - drop; ++i) out.push_back(s[i]);
    for (std::int64_t d : tail) out.push_back(d);
    return out;
  }
  static Work make_work(const Tensor& p) {
    auto z = [&](const Shape& s) { return detail::zeros_on(s, p.dtype(), p.device()); };
    const Shape& s = p.shape();
    Shape ones;
    for (int i = 0; i < s.rank(); ++i) ones.push_back(1);
    Work w{z(s), z(s), z(ones), {}, {}, {}, {}, {}};
    if (s.rank() >= 2) {
      w.rk = z(head(s, 1, {1}));
      w.r = w.rk.reshape(head(s, 1));
      w.ck = z(head(s, 2, {1, s.dim(-1)}));
      w.c = w.ck.reshape(head(s, 2, {s.dim(-1)}));
      w.rm = z(head(s, 2, {1}));
    }
    return w;
  }

  /// sqrt(mean(x^2)) in x's dtype, summed in sequence as MLX's CPU reduction (w.t: the squares).
  /// The mean comes back to the host through sum_squares of its one element: s^2 in double,
  /// whose square root is s again (exactly: sqrt(fl(s^2)) = s for s >= 0 in IEEE arithmetic).
  template <class T>
  static T rms(const Tensor& x, Work& w) {
    B::binary(Binary::mul, x, x, w.t);
    B::sum_to(w.t, w.s, 1.0 / static_cast<double>(x.numel()), false);
    return std::sqrt(static_cast<T>(std::sqrt(B::sum_squares(w.s))));
  }

  template <class T>
  void update_as(Work& w, const std::string& path, Tensor& p, const Tensor& g) {
    const Shape& s = p.shape();
    const auto t = static_cast<float>(step());
    // float32 as MLX forms them (the step is a uint64 array, the exponent a weak Python float)
    const T b2 = T(1) - static_cast<T>(std::pow(t, static_cast<float>(decay_rate_)));
    const T c2 = T(1) - b2;
    const T rho = relative_step_ ? static_cast<T>(std::min(warmup_init_ ? 1e-6f * t : 1e-2f, 1.0f / std::sqrt(t)))
                                 : static_cast<T>(learning_rate());
    const T lr = scale_parameter_ ? std::max(static_cast<T>(eps2_), rms<T>(p, w)) * rho : rho;

    B::binary(Binary::mul, g, g, w.u);
    B::unary(Unary::add_scalar, eps1_, w.u, w.u);
    if (s.rank() >= 2) {
      Tensor& row = slot(path, "exp_avg_sq_row");
      Tensor& col = slot(path, "exp_avg_sq_col");
      B::sum_to(w.u, w.rk, 1.0 / static_cast<double>(s.dim(-1)), false);
      B::axpby(c2, w.rk, b2, row);
      B::sum_to(w.u, w.ck, 1.0 / static_cast<double>(s.dim(-2)), false);
      B::axpby(c2, w.ck, b2, col);
      B::sum_to(row, w.rm, 1.0 / static_cast<double>(s.dim(-2)), false);
      B::binary(Binary::div, row, w.rm, w.r);
      B::unary(Unary::rsqrt, 0.0, w.r, w.r);
      B::unary(Unary::rsqrt, 0.0, col, w.c);
      B::binary(Binary::mul, w.rk, w.ck, w.u);  // r[..., None] * c[..., None, :]
    } else {
      Tensor& v = slot(path, "exp_avg_sq");
      B::axpby(c2, w.u, b2, v);
      B::unary(Unary::rsqrt, 0.0, v, w.u);
    }
    B::binary(Binary::mul, w.u, g, w.u);

    const T divisor = std::max(T(1), rms<T>(w.u, w) / static_cast<T>(clip_threshold_));
    if (divisor > T(1)) {  // dividing by 1 changes nothing
      B::fill(w.s, divisor);
      B::binary(Binary::div, w.u, w.s, w.u);
    }
    B::unary(Unary::scale, lr, w.u, w.u);
    const Tensor* u = &w.u;
    if (use_beta1_) {
      Tensor& m = slot(path, "exp_avg");
      B::axpby(1 - beta1_, w.u, beta1_, m);  // 1 - beta1 in double, as MLX's Python float
      u = &m;
    }
    if (wd_ != 0) B::axpby(static_cast<T>(-wd_) * lr, p, 1.0, p);  // p + p (-wd lr)
    B::binary(Binary::sub, p, *u, p);
  }

  double eps1_ = 1e-30, eps2_ = 1e-3, clip_threshold_ = 1.0, decay_rate_ = -0.8;
  bool use_beta1_ = false;
  double beta1_ = 0.0;  // used only with use_beta1_ (MLX's beta_1=None otherwise)
  double wd_ = 0.0;
  bool scale_parameter_ = true, relative_step_ = true, warmup_init_ = false;
  bool has_lr_ = false;  // a learning rate was given (relative_step(false) needs one)
  std::map<std::string, std::shared_ptr<Work>> work_, by_shape_;  // by parameter path; by shape key
};

}  // namespace nn
// ---- end nn/optim/adafactor.hpp ----
// ---- begin nn/optim/multi.hpp ----
// Parameter groups (MLX's MultiOptimizer): each parameter goes to the first group whose
// predicate matches its path, else to the default optimizer.

#include <functional>
#include <memory>


namespace nn {

/// MultiOptimizer(Sgd(1e-2)).group(pred, Adam(1e-3)): the first matching group wins; the
/// optimizer given to the constructor takes every parameter no group claims. Every member steps
/// on every update (as MLX's). Its state is "<k>.step", "<k>.slots.<path>.m", ... with k the
/// group index and the default optimizer last.
class MultiOptimizer : public Optimizer {
 public:
  using Pred = std::function<bool(const std::string&)>;

  template <class Opt>
  explicit MultiOptimizer(Opt fallback) : Optimizer(0.0), fallback_(std::make_unique<Opt>(std::move(fallback))) {}

  template <class Opt>
  MultiOptimizer& group(Pred pred, Opt opt) & {
    groups_.emplace_back(std::move(pred), std::make_unique<Opt>(std::move(opt)));
    return *this;
  }
  /// On a temporary, so `auto opt = MultiOptimizer(a).group(p, b);` moves rather than copies.
  template <class Opt>
  MultiOptimizer&& group(Pred pred, Opt opt) && {
    return std::move(group(std::move(pred), std::move(opt)));
  }

  /// The first member's rate (the first group's, else the default's), as MLX's.
  double learning_rate() const override { return member(0).learning_rate(); }
  void set_learning_rate(double lr) override {
    for (auto& g : groups_) g.second->set_learning_rate(lr);
    fallback_->set_learning_rate(lr);
  }
  void begin_step() override {
    Optimizer::begin_step();  // counts this wrapper's own step
    for (auto& g : groups_) g.second->begin_step();
    fallback_->begin_step();
  }
  void init_param(const std::string& path, const Tensor& p) override { route(path).init_param(path, p); }
  Shape slot_shape(const std::string& path, std::string_view name, const Tensor& p) const override {
    return route(path).slot_shape(path, name, p);
  }
  const char* type_name() const override { return "MultiOptimizer"; }
  /// Each member's type and fields, prefixed by its index ("0.type", "0.b1", ..., the default
  /// optimizer last), as its state is.
  void visit_config(StaticSink& sink) const override {
    struct Prefixed final : StaticSink {
      StaticSink& inner;
      std::string prefix, name;
      explicit Prefixed(StaticSink& s) : inner(s) {}
      void field(std::string_view n, const StaticValue& v) override {
        name = prefix;
        name += n;
        inner.field(name, v);
      }
    } p(sink);
    for (std::size_t k = 0; k <= groups_.size(); ++k) {
      p.prefix = std::to_string(k) + ".";
      p.field("type", detail::static_value(std::string_view(member(k).type_name())));
      member(k).visit_config(p);
    }
  }
  void describe_rate(std::vector<std::pair<std::string, std::string>>& out, const std::string& prefix) const override {
    for (std::size_t k = 0; k <= groups_.size(); ++k) member(k).describe_rate(out, prefix + std::to_string(k) + ".");
  }
  void apply(const std::string& path, Tensor& p, const Tensor& g) override { route(path).apply(path, p, g); }

  std::vector<std::pair<std::string, Tensor>> state() const override {
    std::vector<std::pair<std::string, Tensor>> out;
    for (std::size_t k = 0; k <= groups_.size(); ++k)
      for (auto& [name, t] : member(k).state()) out.emplace_back(std::to_string(k) + "." + name, t);
    return out;
  }
  void load_state(const std::vector<std::pair<std::string, Tensor>>& entries) override {
    auto parts = split(entries);
    // Validate every part first, so a bad entry leaves every group as it was.
    for (std::size_t k = 0; k < parts.size(); ++k) member(k).check_state(parts[k]);
    for (std::size_t k = 0; k < parts.size(); ++k) member(k).load_state(parts[k]);
    step_.data<std::int64_t>()[0] = fallback_->step();  // the members step together; step() is theirs
  }
  void check_state(const std::vector<std::pair<std::string, Tensor>>& entries) const override {
    auto parts = split(entries);
    for (std::size_t k = 0; k < parts.size(); ++k) member(k).check_state(parts[k]);
  }

 protected:
  std::vector<const char*> slot_names(const Tensor&) const override { return {}; }

 private:
  std::vector<std::vector<std::pair<std::string, Tensor>>> split(
      const std::vector<std::pair<std::string, Tensor>>& entries) const {
    std::vector<std::vector<std::pair<std::string, Tensor>>> parts(groups_.size() + 1);
    for (const auto& [name, t] : entries) {
      const std::size_t dot = name.find('.');
      std::size_t k = parts.size();
      try {
        k = std::stoul(name.substr(0, dot));
      } catch (...) {
      }
      if (dot == std::string::npos || k >= parts.size())
        detail::fail("optimizer", "state entry '", name, "' names no group of this MultiOptimizer");
      parts[k].emplace_back(name.substr(dot + 1), t);
    }
    return parts;
  }
  Optimizer& route(const std::string& path) const {
    for (auto& g : groups_)
      if (g.first(path)) return *g.second;
    return *fallback_;
  }
  Optimizer& member(std::size_t k) const { return k < groups_.size() ? *groups_[k].second : *fallback_; }

  std::vector<std::pair<Pred, std::unique_ptr<Optimizer>>> groups_;
  std::unique_ptr<Optimizer> fallback_;
};

}  // namespace nn
// ---- end nn/optim/multi.hpp ----
// ---- begin nn/optim/clip.hpp ----
// Global gradient-norm clipping over a whole gradient tree (MLX's clip_grad_norm).

#include <cmath>
#include <utility>


namespace nn {

namespace detail {
/// The factor clip_grad_norm scales by: min(max_norm / (norm + 1e-6), 1) (MLX's).
inline double clip_scale(double max_norm, double norm) { return std::min(max_norm / (norm + 1e-6), 1.0); }
}  // namespace detail

/// Returns {clipped, norm}: norm = sqrt(sum over every gradient of sum(g^2)) (one global norm,
/// not per tensor), and clipped = grads * min(max_norm / (norm + 1e-6), 1) in new tensors (the
/// input tree is not modified). Empty (frozen) gradients stay empty.
template <class B = cpu, class M>
std::pair<M, double> clip_grad_norm(const M& grads, double max_norm) {
  if (max_norm < 0) detail::fail("clip_grad_norm", "max_norm must be >= 0, got ", max_norm);
  double sq = 0;
  detail::for_each(grads, [&](const std::string&, const Param& g) {
    if (g.value.defined()) sq += B::sum_squares(g.value);
  });
  const double norm = std::sqrt(sq);
  const double scale = detail::clip_scale(max_norm, norm);
  M out = grads;
  detail::for_each(out, [&](const std::string&, Param& g) {
    if (!g.value.defined()) return;
    Tensor t = B::alloc(g.value.shape(), g.value.dtype());
    B::unary(Unary::scale, scale, g.value, t);
    g.value = t;
  });
  return {std::move(out), norm};
}

}  // namespace nn
// ---- end nn/optim/clip.hpp ----
// ---- end nn/optim.hpp ----
// ---- begin nn/compile.hpp ----
// A compiled training step (MLX's mx.compile(step, inputs=state, outputs=state)): the first call
// records forward, backward and the optimizer update; later calls replay the same tape into the
// buffers it owns, with no re-recording and no heap allocation.

#include <array>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>


namespace nn {

/// One trainable parameter's gradient buffer, as a compiled step hands them to a gradient
/// reduction (CompiledStep::reduce_gradients) in tree order.
struct GradBuffer {
  std::string path;  // "layers.0.weight"
  Tensor* grad;      // the buffer the update reads: a reduction writes its result here
};

namespace detail {
/// How a compiled step feeds and replays its recorded tape: tp.set() and tp.replay() here. A
/// device backend may specialise it (nn/cuda.hpp captures the replay into a CUDA graph once and
/// relaunches it, copying each batch into buffers the graph owns).
template <class B>
struct TapeReplayer {
  void set(GTape<B>& tp, GVar slot, const Tensor& t) { tp.set(slot, t); }
  void replay(GTape<B>& tp) { tp.replay(); }
  void reset() {}  // the tape was recorded again
};

/// GVar, once per batch index (a pack of N GVars from an index sequence). A member type, not an
/// alias: nvcc's front end folds an alias that ignores its argument and then sees no pack.
template <std::size_t>
struct BatchVar {
  using type = GVar;
};

/// Whether loss_fn(GTape<B>&, const M&, GVar x N) -> GVar is a valid call.
template <class F, class B, class M, std::size_t... I>
constexpr bool loss_fn_fits(std::index_sequence<I...>) {
  return std::is_invocable_r_v<GVar, F&, GTape<B>&, const M&, typename BatchVar<I>::type...>;
}
}  // namespace detail

/// The step `compile(model, opt, loss_fn)` returns. Calling it with the batch tensors runs one
/// training step (loss, gradients, optimizer update) and returns the loss (a 0-D tensor owned by
/// the step: read it before the next call).
///
/// Configuration is structure (the module seed's rule): every call compares the batch's shapes
/// and dtypes, the model's structure hash (detail::structure_hash: the tree, each Param's and
/// Buffer's shape, dtype and storage, the frozen set, train/eval flags and every NN_STATIC
/// value, such as a LoRA scale, a dropout p or an RMSNorm eps) and the optimizer's
/// hyperparameter hash (its NN_OPTIMIZER fields). Any change records the step again, once: a
/// module replaced through map_modules, a Param given a new tensor, a frozen layer, new betas.
/// The learning rate and step count are tensors and change without re-recording. Random keys
/// drawn on the tape (tp.random_key(), used by Dropout) are refilled from nn::random's global
/// sequence before each replay, in recording order, so a compiled run draws exactly the masks an
/// eager run draws. Members a module lists in NN_UNCHECKED are baked in; reset() forces a
/// recording.
template <class B, class M, class F, std::size_t N>
class CompiledStep {
  static constexpr bool kFits = detail::loss_fn_fits<F, B, M>(std::make_index_sequence<N>{});
  static_assert(kFits,
                "nn::compile<N>(model, opt, loss_fn): loss_fn must be callable as "
                "loss_fn(nn::GTape<B>& tp, const M& model, nn::GVar batch_1, ..., nn::GVar batch_N) -> nn::GVar "
                "(the scalar loss), where N is compile's template argument, the number of batch tensors the step "
                "is called with; take the model as const M& (or auto&)");

 public:
  CompiledStep(M& model, Optimizer& opt, F fn) : model_(&model), opt_(&opt), fn_(std::move(fn)) {}

  template <class... T>
  Tensor operator()(const T&... batch) {
    static_assert(sizeof...(T) == N, "a compiled step is called with the batch tensors it was declared with");
    std::array<const Tensor*, N> in{&batch...};
    if (stale(in)) record(in);
    else replay(in);
    update();
    return tp_.value(loss_);
  }

  /// Clips the gradients to a global norm before each update, as
  /// `opt.update(model, nn::clip_grad_norm(grads, max_norm).first)` does in an eager step: the
  /// norm is summed over the tape's gradient buffers in tree order and they are scaled in place
  /// (no allocation), so the result equals the eager one bit for bit. A negative value turns
  /// clipping off (the default).
  CompiledStep& clip_grad_norm(double max_norm) {
    clip_ = max_norm;
    return *this;
  }
  /// Anomaly mode on the step's tape (GTape::detect_anomaly): the recording and every replay
  /// check each value and gradient for NaN and Inf, and raise naming the op before the update
  /// runs. On already when NN_DETECT_ANOMALY=1 was set as the step was made.
  CompiledStep& detect_anomaly(bool on) {
    tp_.detect_anomaly(on);
    return *this;
  }
  /// Runs reduce(slots) on every call between backward and the update, on the recording and on
  /// every replay: the gradient buffers in tree order, to be rewritten in place. Data-parallel
  /// training passes a nn::distributed::GradientAverager (nn/distributed.hpp), so the finite
  /// check, clipping and the update all see the averaged gradients, identically on every rank.
  /// The reducer is held by reference: it must outlive the step.
  template <class R>
  CompiledStep& reduce_gradients(R& reduce) {
    reduce_ = [&reduce](std::span<const GradBuffer> s) { reduce(s); };
    return *this;
  }
  /// Memory planning (on by default, CPU tapes): buffers whose lifetimes in the step do not
  /// overlap share memory (GTape::plan_memory), so the step holds what its backward pass reads
  /// plus one layer's transients, not every intermediate and every gradient. The results are
  /// the same bit for bit. Off: every node keeps its own buffers (for reading intermediates
  /// through tape()). Changing it records the step again.
  CompiledStep& plan_memory(bool on) {
    if (on != plan_) recorded_ = false;
    plan_ = on;
    return *this;
  }
  /// Elementwise fusion (nn::fuse_elementwise, ops/fused.hpp): the recording's chains of unary
  /// and binary nodes run as one fused node each, forward and backward, one pass over memory
  /// instead of one per node, with results equal bit for bit. CPU tapes with memory planning
  /// only (its intermediates are unreadable anyway), and CUDA tapes (one kernel per group). Off
  /// by default; NN_FUSION=1 in the environment turns it on for steps made afterwards, and
  /// NN_FUSION_LOG=1 prints each recording's groups (nn::fusion_report) to stderr. Changing it
  /// records the step again.
  CompiledStep& fuse(bool on) {
    if (on != fuse_) recorded_ = false;
    fuse_ = on;
    return *this;
  }
  /// What the last recording's fusion pass did (zeros when fusion is off).
  const FusionStats& fusion() const { return fusion_; }

  /// The global gradient norm of the last call, before clipping (0 when not clipping).
  double grad_norm() const { return grad_norm_; }

  /// How many times the step has been recorded (1 after the first call when nothing changed).
  int recordings() const { return recordings_; }
  /// Forces the next call to record again.
  void reset() { recorded_ = false; }
  /// The tape (for inspection: node count, values).
  const GTape<B>& tape() const { return tp_; }

 private:
  struct Entry {
    std::string path;
    Tensor param;  // shares the Param's storage (a handle, so a moved module cannot leave it dangling)
    Tensor* grad;  // the tape's gradient buffer of this parameter
  };

  bool stale(const std::array<const Tensor*, N>& in) const {
    if (!recorded_) return true;
    for (std::size_t i = 0; i < N; ++i) {
      const Tensor& t = tp_.value(inputs_[i]);
      if (!(in[i]->shape() == t.shape()) || in[i]->dtype() != t.dtype()) return true;
    }
    return detail::structure_hash(static_cast<const M&>(*model_)) != structure_ || opt_->hyper_hash() != hyper_;
  }

  void record(const std::array<const Tensor*, N>& in) {
    recorded_ = false;  // until this recording has run: a throw leaves the step to record again
    tp_.clear();
    entries_.clear();
    slots_.clear();
    std::array<GVar, N> vars{};
    for (std::size_t i = 0; i < N; ++i) vars[i] = tp_.input(*in[i]);
    for (std::size_t i = 0; i < N; ++i) inputs_[i] = vars[i];
    // On the CPU the recording defers every kernel and plans the buffers first (GTape::
    // plan_memory), so not even the first call holds every intermediate at once.
    const bool plan = plan_ && std::is_same_v<B, cpu>;
    if constexpr (kFits) {  // else only the static_assert above speaks
      auto build = [&] { return std::apply([&](auto... v) { return fn_(tp_, static_cast<const M&>(*model_), v...); }, vars); };
      loss_ = plan ? tp_.record_deferred(build) : build();
    }
    fusion_ = {};
    // (a CUDA tape is recorded eagerly, unplanned: its groups are fused after their unfused first run)
    if (fuse_ && (plan || B::device != Device::cpu)) {
      fusion_ = fuse_elementwise(tp_, loss_);
      if (detail::env_flag("NN_FUSION_LOG")) std::fputs(fusion_report(tp_).c_str(), stderr);
    }
    if (plan) {
      tp_.plan_memory(loss_);
      tp_.replay_forward();
    }
    tp_.backward(loss_);
    detail::for_each(*model_, [&](const std::string& path, Param& p) {
      if (!p.trainable || !is_floating(p.value.dtype())) return;
      std::optional<GVar> v = tp_.find_param(p.value);
      if (!v) detail::fail("compile", "trainable parameter '", path, "' is not used by the loss");
      opt_->init_param(path, p.value);
      // The tape owns the buffer; clipping scales it in place between backward and the update.
      entries_.push_back({path, p.value, const_cast<Tensor*>(&tp_.grad(*v))});
      slots_.push_back({path, entries_.back().grad});
    });
    structure_ = detail::structure_hash(static_cast<const M&>(*model_));
    hyper_ = opt_->hyper_hash();
    replayer_.reset();
    recorded_ = true;
    ++recordings_;
  }

  void replay(const std::array<const Tensor*, N>& in) {
    for (std::size_t i = 0; i < N; ++i) replayer_.set(tp_, inputs_[i], *in[i]);
    tp_.refresh_keys();
    replayer_.replay(tp_);
  }

  // The optimizer's update over the recorded parameters, in tree order (as Optimizer::update).
  void update() {
    if (reduce_) reduce_(slots_);
    // Optimizer::admit's gate, before clipping (a NaN norm would scale every gradient to NaN).
    for (const Entry& e : entries_) {
      bool finite;
      if constexpr (std::is_same_v<B, cpu>) finite = detail::all_finite(*e.grad);
      else finite = std::isfinite(B::sum_squares(*e.grad));  // one reduction on the device
      if (!opt_->admit(e.path, finite)) return;
    }
    if (clip_ >= 0) clip();
    opt_->begin_step();
    for (Entry& e : entries_) opt_->apply(e.path, e.param, *e.grad);
  }

  // nn::clip_grad_norm's arithmetic (optim/clip.hpp) on the tape's buffers, in place.
  void clip() {
    double sq = 0;
    for (const Entry& e : entries_) sq += B::sum_squares(*e.grad);
    grad_norm_ = std::sqrt(sq);
    const double scale = detail::clip_scale(clip_, grad_norm_);
    for (Entry& e : entries_) B::unary(Unary::scale, scale, *e.grad, *e.grad);
  }

  M* model_;
  Optimizer* opt_;
  F fn_;
  GTape<B> tp_;
  detail::TapeReplayer<B> replayer_;
  std::array<GVar, N> inputs_{};
  GVar loss_{};
  std::vector<Entry> entries_;
  std::vector<GradBuffer> slots_;                             // entries_' paths and buffers, for reduce_
  std::function<void(std::span<const GradBuffer>)> reduce_;  // between backward and the update
  std::uint64_t structure_ = 0, hyper_ = 0;
  double clip_ = -1, grad_norm_ = 0;
  bool recorded_ = false, plan_ = true, fuse_ = detail::env_flag("NN_FUSION");
  FusionStats fusion_;
  int recordings_ = 0;
};

/// Compiles a training step over `model` and `opt`: loss_fn(GTape<B>&, const M&, GVar... batch)
/// returns the scalar loss; the result is called as step(batch_tensor...) and returns the loss.
///   auto step = nn::compile<2>(model, opt, [](auto& tp, const Mlp& m, GVar x, GVar y) {
///     return nn::cross_entropy(tp, m(tp, x), y); });
///   Tensor loss = step(xb, yb);
template <std::size_t N, class B = cpu, class M, class F>
CompiledStep<B, M, F, N> compile(M& model, Optimizer& opt, F loss_fn) {
  return CompiledStep<B, M, F, N>(model, opt, std::move(loss_fn));
}

}  // namespace nn
// ---- end nn/compile.hpp ----
// ---- begin nn/io/weights.hpp ----
// Model weights by name: save_weights / save_trainable / strict load_weights /
// load_weights_partial, on safetensors files named by module path (MLX's conventions).

#include <map>
#include <sstream>


namespace nn::detail {

/// One tensor slot of a model: its path and the tensor a load writes.
struct WeightSlot {
  std::string path;
  Tensor* target;
};

/// Every Param and Buffer of a model (trainable_only: the trainable Params alone, what a
/// checkpoint stores).
template <class M>
std::vector<WeightSlot> weight_slots(M& m, bool trainable_only = false) {
  std::vector<WeightSlot> out;
  for_each(
      m, [&](const std::string& p, Param& x) { if (!trainable_only || x.trainable) out.push_back({p, &x.value}); },
      [&](const std::string& p, Buffer& x) { if (!trainable_only) out.push_back({p, &x.value}); });
  return out;
}

/// "N label: a, b, c" (at most 20 names, then "... and N more").
inline std::string list_names(const char* label, const std::vector<std::string>& names) {
  std::ostringstream os;
  os << names.size() << ' ' << label << ": ";
  for (std::size_t i = 0; i < names.size() && i < 20; ++i) os << (i ? ", " : "") << names[i];
  if (names.size() > 20) os << ", ... and " << names.size() - 20 << " more";
  return os.str();
}

/// A load worked out before anything is written: which slot gets which tensor, and every name
/// that does not fit, by kind.
struct LoadPlan {
  std::vector<std::pair<Tensor*, const Tensor*>> writes;
  std::vector<std::string> missing, unknown, mismatched, duplicated;

  /// One "N kind: names" line per kind that has any (empty when the load fits).
  std::vector<std::string> problems() const {
    std::vector<std::string> out;
    for (const auto& [label, names] : {std::pair{"missing", &missing}, std::pair{"unknown", &unknown},
                                       std::pair{"mismatched", &mismatched}, std::pair{"duplicated", &duplicated}})
      if (!names->empty()) out.push_back(list_names(label, *names));
    return out;
  }
};

/// Plans a load of `named` into the slots of `m` (see weight_slots); names in the plan's lists
/// carry `prefix`. Strict: every slot must be given and every given name must be a slot.
template <class M>
LoadPlan plan_weights(M& m, const NamedTensorList& named, bool strict, const std::string& prefix = "",
                      bool trainable_only = false) {
  std::vector<WeightSlot> slots = weight_slots(m, trainable_only);
  std::map<std::string, const Tensor*> given;
  LoadPlan out;
  auto& [plan, missing, unknown, mismatched, dup] = out;
  for (const auto& [name, t] : named) {
    if (!given.emplace(name, &t).second) dup.push_back(name);
  }
  std::map<std::string, bool> known;
  for (const WeightSlot& s : slots) {
    known[s.path] = true;
    auto it = given.find(s.path);
    if (it == given.end()) {
      if (strict) missing.push_back(prefix + s.path);
      continue;
    }
    const Tensor& t = *it->second;
    if (!t.defined()) {
      mismatched.push_back(prefix + s.path + " (empty tensor)");
    } else if (s.target->defined() && (!(t.shape() == s.target->shape()) || t.dtype() != s.target->dtype())) {
      mismatched.push_back(prefix + s.path + " (file " + t.shape().str() + " " + dtype_name(t.dtype()) + ", model " +
                           s.target->shape().str() + " " + dtype_name(s.target->dtype()) + ")");
    } else {
      plan.emplace_back(s.target, &t);
    }
  }
  for (const auto& [name, t] : given)
    if (strict && !known.count(name)) unknown.push_back(prefix + name);
  return out;
}

/// The plan of a load: which slot gets which tensor. Raises (naming every missing, unknown and
/// mismatched name at once) before anything is written, so a failed load changes nothing.
template <class M>
std::vector<std::pair<Tensor*, const Tensor*>> plan_load(M& m, const NamedTensorList& named, bool strict,
                                                         const std::string& source, const std::string& prefix = "") {
  LoadPlan plan = plan_weights(m, named, strict, prefix);
  const std::vector<std::string> problems = plan.problems();
  if (!problems.empty()) {
    std::ostringstream os;
    os << source << ": the weights do not fit the model (nothing was loaded)";
    for (const std::string& p : problems) os << "\n  " << p;
    fail("load_weights", os.str());
  }
  return std::move(plan.writes);
}

/// Writes a plan: into the existing storage when there is one (so tapes and compiled steps bound
/// to the model stay valid), else as a copy.
inline void apply_load(const std::vector<std::pair<Tensor*, const Tensor*>>& plan) {
  for (auto& [target, t] : plan) {
    if (target->defined() && !t->shares_storage(*target)) target->copy_from(*t);  // host or device
    else if (!target->defined()) *target = t->clone();
  }
}

template <class M>
void load_weights_impl(M& m, const NamedTensorList& named, bool strict, const std::string& source) {
  apply_load(plan_load(m, named, strict, source));
}

template <class M>
void load_weights_file(M& m, const std::filesystem::path& path, bool strict) {
  NamedTensorList named = load_safetensors(path);
  load_weights_impl(m, named, strict, path.string());
}

template <class M>
void save_weights_impl(const M& m, const std::filesystem::path& path, bool trainable_only) {
  save_safetensors(path, tree_parameters(m, trainable_only), {{"format", "mlx"}});
}

}  // namespace nn::detail
// ---- end nn/io/weights.hpp ----
// ---- begin nn/io/checkpoint.hpp ----
// Whole-run checkpoints: what training changes (trainable parameters, the optimizer's state, the
// global RNG key) and what the run was (the optimizer's type, hyperparameters and schedule, the
// frozen set with a fingerprint of the frozen tensors) in one safetensors file, saved atomically
// and loaded all-or-nothing.

#include <cstring>
#include <map>
#include <sstream>


namespace nn {

/// What load_into may accept beyond an exact match.
struct LoadOptions {
  /// Resume with other hyperparameters than the checkpoint's (betas, weight decay, momentum, the
  /// schedule or the constant learning rate): the given optimizer's values are kept, the file's
  /// state (step, slots) is loaded. The optimizer's type must still match: its state would not.
  bool allow_new_hyperparameters = false;
};

namespace detail {

/// A content hash of a tensor's bytes (four 64-bit multiply-xor lanes, then FNV over the tail):
/// fast enough to fingerprint a frozen base of hundreds of MB on every save and load.
inline std::uint64_t content_hash(const Tensor& t0) {
  const Tensor t = t0.device() == Device::cpu ? t0 : t0.to(Device::cpu);
  const auto* p = static_cast<const unsigned char*>(t.raw());
  const std::size_t n = t.nbytes();
  std::uint64_t lane[4] = {0x9E3779B97F4A7C15ull, 0xC2B2AE3D27D4EB4Full, 0x165667B19E3779F9ull, 0x27D4EB2F165667C5ull};
  std::size_t i = 0;
  for (; i + 32 <= n; i += 32)
    for (int k = 0; k < 4; ++k) {
      std::uint64_t w;
      std::memcpy(&w, p + i + 8 * k, 8);
      lane[k] = (lane[k] ^ w) * 0x100000001B3ull;
      lane[k] ^= lane[k] >> 29;
    }
  Fnv f;
  f.pod(lane);
  f.bytes(p + i, n - i);
  f.pod(n);
  return f.h;
}

/// "float32 (576, 49152) 0123456789abcdef": a frozen tensor as the checkpoint's metadata records it.
inline std::string fingerprint(const Tensor& t) {
  char hex[24];
  std::snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(content_hash(t)));
  return std::string(dtype_name(t.dtype())) + " " + t.shape().str() + " " + hex;
}

/// The frozen part of a model: every frozen Param and every Buffer, by path, with its fingerprint.
template <class M>
std::map<std::string, std::string> frozen_fingerprints(const M& model) {
  std::map<std::string, std::string> out;
  for_each(
      model, [&](const std::string& p, const Param& x) { if (!x.trainable && x.value.defined()) out[p] = fingerprint(x.value); },
      [&](const std::string& p, const Buffer& x) { if (x.value.defined()) out[p] = fingerprint(x.value); });
  return out;
}

inline constexpr const char* kOptimizerKey = "optimizer.";  // metadata: the optimizer's configuration
inline constexpr const char* kFrozenKey = "frozen.";        // metadata: one entry per frozen tensor

/// The version-1 load (whole model in the file, nothing but tensors checked), kept so older
/// checkpoints still resume.
template <class M>
void load_checkpoint_v1(const std::string& source, const NamedTensorList& model_part, const NamedTensorList& opt_part,
                        const Tensor& key, M& model, Optimizer& opt) {
  auto plan = plan_load(model, model_part, true, source, "model.");
  try {
    opt.check_state(opt_part);
  } catch (const Error& e) {  // the optimizer's error names the entry; the file is named here
    fail("load_into", source, ": optimizer state: ", e.what(), " (nothing was loaded)");
  }
  apply_load(plan);
  opt.load_state(opt_part);
  random::set_state(key);
}

}  // namespace detail

/// Saves a run to `path` (written to a temporary file, then renamed):
/// - tensors: the trainable parameters ("model.<path>"), the optimizer's state
///   ("optimizer.step", "optimizer.slots.<path>.m", ...) and the global random key ("rng.key");
/// - metadata: the optimizer's type, hyperparameters and schedule ("optimizer.type",
///   "optimizer.b1", "optimizer.schedule", ...) and, for each frozen parameter and buffer, its
///   dtype, shape and a content hash ("frozen.<path>"), which load_into verifies.
/// A LoRA run's checkpoint is adapter-sized: the frozen base is fingerprinted, not stored.
/// Resuming with load_into and training on is bitwise the run without the pause.
template <class M>
void save(const std::filesystem::path& path, const M& model, const Optimizer& opt) {
  NamedTensors all;
  for (auto& [p, t] : detail::tree_parameters(model, true)) all.emplace_back("model." + p, t);
  for (auto& [p, t] : opt.state()) all.emplace_back("optimizer." + p, t);
  all.emplace_back("rng.key", random::state());
  std::map<std::string, std::string> meta{{"format", "nn-checkpoint"}, {"nn_checkpoint", "2"}, {"nn_version", NN_VERSION_STRING}};
  for (auto& [k, v] : opt.describe()) meta[detail::kOptimizerKey + k] = v;
  for (auto& [p, fp] : detail::frozen_fingerprints(model)) meta[detail::kFrozenKey + p] = fp;
  save_safetensors(path, all, meta);
}

/// Loads a checkpoint written by save() into `model` and `opt` and restores the random key.
/// Everything is checked before anything changes, and every difference is reported in one
/// nn::Error: the optimizer's type, each hyperparameter and the schedule (unless
/// options.allow_new_hyperparameters), the frozen set and each frozen tensor's dtype, shape and
/// content, each trainable parameter's name, shape and dtype, and the optimizer's state (also
/// against a fresh optimizer: every slot must belong to a trainable parameter of its shape). On
/// any error the model, the optimizer and the random key are as they were.
/// The overload on an open SafetensorsFile (SafetensorsFile::from_bytes for a checkpoint held in
/// memory) checks and loads the same way; errors name file.path().
template <class M>
void load_into(const SafetensorsFile& file, M& model, Optimizer& opt, const LoadOptions& options = {}) {
  const std::string& src = file.path();
  const auto& meta = file.metadata();
  auto fmt = meta.find("format");
  if (fmt == meta.end() || fmt->second != "nn-checkpoint")
    detail::fail("load_into", src, ": not an nn checkpoint (metadata format is '",
                 fmt == meta.end() ? std::string("missing") : fmt->second, "')");
  detail::NamedTensorList model_part, opt_part;
  Tensor key;
  for (auto& [name, t] : file.tensors()) {
    if (name.rfind("model.", 0) == 0) model_part.emplace_back(name.substr(6), t);
    else if (name.rfind("optimizer.", 0) == 0) opt_part.emplace_back(name.substr(10), t);
    else if (name == "rng.key") key = t;
    else detail::fail("load_into", src, ": unknown entry '", name, "'");
  }
  if (!key.defined() || key.dtype() != DType::u32 || !(key.shape() == Shape{2}))
    detail::fail("load_into", src, ": missing or malformed 'rng.key' (uint32 (2))");
  auto version = meta.find("nn_checkpoint");
  if (version == meta.end()) return detail::load_checkpoint_v1(src, model_part, opt_part, key, model, opt);
  if (version->second != "2")
    detail::fail("load_into", src, ": checkpoint version ", version->second, " is newer than this nn reads (2)");

  std::vector<std::string> diffs;
  auto quote = [](const std::string& s) { return "'" + s + "'"; };

  // The optimizer: its type always, its hyperparameters and schedule unless allowed to differ.
  std::map<std::string, std::string> saved_cfg, given_cfg;
  for (const auto& [k, v] : meta)
    if (k.rfind(detail::kOptimizerKey, 0) == 0) saved_cfg[k.substr(std::strlen(detail::kOptimizerKey))] = v;
  for (auto& [k, v] : opt.describe()) given_cfg[k] = v;
  auto checked = [&](const std::string& k) {  // a type ("type", "0.type") always is
    return !options.allow_new_hyperparameters || k == "type" || k.ends_with(".type");
  };
  for (const auto& [k, v] : saved_cfg) {
    if (!checked(k)) continue;
    auto g = given_cfg.find(k);
    if (g == given_cfg.end()) diffs.push_back("optimizer " + k + ": " + v + " in the file, not set on the given optimizer");
    else if (g->second != v) diffs.push_back("optimizer " + k + ": " + v + " in the file, " + g->second + " given");
  }
  for (const auto& [k, v] : given_cfg)
    if (checked(k) && !saved_cfg.count(k)) diffs.push_back("optimizer " + k + ": not in the file, " + v + " given");

  // The frozen set and its content.
  std::map<std::string, std::string> saved_frozen;
  for (const auto& [k, v] : meta)
    if (k.rfind(detail::kFrozenKey, 0) == 0) saved_frozen[k.substr(std::strlen(detail::kFrozenKey))] = v;
  const std::map<std::string, std::string> frozen = detail::frozen_fingerprints(model);
  for (const auto& [p, fp] : saved_frozen) {
    auto g = frozen.find(p);
    if (g == frozen.end()) diffs.push_back("frozen " + quote(p) + ": frozen in the file, trainable or absent here");
    else if (g->second != fp) diffs.push_back("frozen " + quote(p) + ": the file's is " + fp + ", the model's " + g->second);
  }
  for (const auto& [p, fp] : frozen)
    if (!saved_frozen.count(p)) diffs.push_back("frozen " + quote(p) + ": frozen here, not frozen in the file");

  // The trainable parameters: every one in the file with its shape and dtype, nothing else.
  detail::LoadPlan plan = detail::plan_weights(model, model_part, true, "model.", true);
  for (const std::string& p : plan.problems()) diffs.push_back("trainable parameters, " + p);
  std::map<std::string, const Tensor*> trainable;
  for (const detail::WeightSlot& s : detail::weight_slots(model, true)) trainable[s.path] = s.target;

  // The optimizer's state (when the types match: else the type is the difference): as the
  // optimizer checks it, and every slot against its parameter, so a fresh optimizer (no slots
  // yet) is checked too. MultiOptimizer's entries are "<k>.slots....".
  if (saved_cfg["type"] == given_cfg["type"]) {
    try {
      opt.check_state(opt_part);
    } catch (const Error& e) {
      diffs.push_back(std::string("optimizer state: ") + e.what());
    }
    for (const auto& [name, t] : opt_part) {
      const std::size_t at = name.rfind("slots.", 0) == 0 ? 0 : name.find(".slots.");
      if (at == std::string::npos) continue;
      const std::size_t begin = name.find("slots.", at) + 6, end = name.rfind('.');
      if (end <= begin) continue;
      const std::string p = name.substr(begin, end - begin);
      auto it = trainable.find(p);
      if (it == trainable.end()) {
        diffs.push_back("optimizer " + quote(name) + ": a slot of no trainable parameter here");
        continue;
      }
      if (!t.defined() || !it->second->defined()) continue;
      const Tensor& param = *it->second;
      const Shape want = opt.slot_shape(p, std::string_view(name).substr(end + 1), param);
      if (!(t.shape() == want))
        diffs.push_back("optimizer " + quote(name) + ": " + t.shape().str() + " in the file, the parameter is " +
                        param.shape().str() + (want == param.shape() ? "" : " (the slot should be " + want.str() + ")"));
    }
  }

  if (!diffs.empty()) {
    std::ostringstream os;
    os << src << ": the checkpoint does not fit this run (nothing was loaded); " << diffs.size() << " difference"
       << (diffs.size() == 1 ? "" : "s") << ":";
    for (const std::string& d : diffs) os << "\n  " << d;
    if (!options.allow_new_hyperparameters)
      os << "\n(to resume with other hyperparameters on purpose: load_into(path, model, opt, "
            "nn::LoadOptions{.allow_new_hyperparameters = true}))";
    detail::fail("load_into", os.str());
  }

  if (options.allow_new_hyperparameters)  // keep the given optimizer's learning rate(s)
    for (const auto& [name, t] : opt.state())
      if (name == "learning_rate" || name.ends_with(".learning_rate"))
        for (auto& [n, saved] : opt_part)
          if (n == name) saved = t.clone();
  detail::apply_load(plan.writes);
  opt.load_state(opt_part);
  random::set_state(key);
}

/// Loads the checkpoint at `path` (the overload above, on the mapped file).
template <class M>
void load_into(const std::filesystem::path& path, M& model, Optimizer& opt, const LoadOptions& options = {}) {
  load_into(SafetensorsFile(path), model, opt, options);
}

}  // namespace nn
// ---- end nn/io/checkpoint.hpp ----
// ---- begin nn/precompiled.hpp ----
// Separate compilation of nn's CPU code, opt in: the common GTape<cpu> paths (every primitive's
// forward and vjp with the kernels they call, the tape, the optimizers) compiled once instead of
// in every translation unit.
//
//   every translation unit:  -DNN_PRECOMPILED          (CMake: link nn::precompiled, which sets it)
//   exactly one of them:     #include <nn/instantiate.hpp>   (nn::precompiled's own source does)
//
// With NN_PRECOMPILED, <nn/nn.hpp> ends with `extern template` declarations of the instances
// listed below, so a program's own files parse the headers but generate none of that code; the
// one file that includes <nn/instantiate.hpp> defines them. Without it nothing changes: every
// file instantiates what it uses, as a header-only library does. bench/compile_time.sh measures
// both ways.
//
// Why this works without splitting every kernel into a declaration and a body: the kernel
// families of backend/cpu/ are class templates (instantiated only when called), a primitive's
// OpDef is defined outside its struct (so recording a node names the OpDef without
// instantiating its forward and vjp), and the optimizers' updates are virtual (reached only
// through the vtable, which the explicit instantiation emits).

/// X(kind, instance) for each instance <nn/instantiate.hpp> compiles. A primitive added to
/// NN_PRIMITIVES (backend/policy.hpp) adds its Prim struct here too: <nn/instantiate.hpp> checks
/// the count.
#define NN_CPU_INSTANCES(X)                                                                            \
  X(struct, detail::UnaryPrim<cpu>) X(struct, detail::BinaryPrim<cpu>) X(struct, detail::WherePrim<cpu>) \
  X(struct, detail::StopGradientPrim<cpu>) X(struct, detail::ReshapePrim<cpu>)                         \
  X(struct, detail::PermutePrim<cpu>) X(struct, detail::SlicePrim<cpu>) X(struct, detail::ConcatPrim<cpu>) \
  X(struct, detail::BroadcastPrim<cpu>) X(struct, detail::SumPrim<cpu>) X(struct, detail::MaxPrim<cpu>)  \
  X(struct, detail::MatmulPrim<cpu>) X(struct, detail::GatherRowsPrim<cpu>) X(struct, detail::PickPrim<cpu>) \
  X(struct, detail::SoftmaxPrim<cpu>) X(struct, detail::CrossEntropyPrim<cpu>) X(struct, detail::BernoulliPrim<cpu>)    \
  X(struct, detail::DropoutPrim<cpu>) X(struct, detail::RmsNormPrim<cpu>) X(struct, detail::RopePrim<cpu>) \
  X(struct, detail::AttentionPrim<cpu>) X(struct, detail::FlashAttentionPrim<cpu>)                     \
  X(struct, detail::SwigluPrim<cpu>) X(struct, detail::QuantizedMatmulPrim<cpu>)                       \
  X(struct, detail::QuantizedGatherPrim<cpu>) X(struct, detail::FusedPrim<cpu>)                      \
  X(struct, detail::LinearCrossEntropyPrim<cpu>)                                                       \
  X(class, GTape<cpu>) X(class, Sgd<cpu>) X(class, Adam<cpu>) X(class, AdamW<cpu>) X(class, Lion<cpu>) \
  X(class, Muon<cpu>) X(class, Adafactor<cpu>)

/// The explicit instantiation definitions, once per program: <nn/instantiate.hpp> expands it (with
/// the single header, write `NN_DEFINE_CPU_INSTANCES()` after `#include "nn.hpp"` in one file).
#define NN_DEFINE_CPU_INSTANCE(kind, ...) template kind __VA_ARGS__;
#define NN_DEFINE_CPU_INSTANCES() \
  namespace nn {                  \
  NN_CPU_INSTANCES(NN_DEFINE_CPU_INSTANCE)  \
  }

#if defined(NN_PRECOMPILED)
namespace nn {
#define NN_EXTERN_INSTANCE(kind, ...) extern template kind __VA_ARGS__;
NN_CPU_INSTANCES(NN_EXTERN_INSTANCE)
#undef NN_EXTERN_INSTANCE
}  // namespace nn
#endif
// ---- end nn/precompiled.hpp ----
// ---- end nn/nn.hpp ----
