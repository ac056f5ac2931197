// SPDX-License-Identifier: MIT OR Apache-2.0
// Version, nn::Error ("[op] message"), and the dtype and device enums every other header uses.
#pragma once

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
