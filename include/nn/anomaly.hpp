// SPDX-License-Identifier: MIT OR Apache-2.0
// Finding NaN and Inf: the finiteness tests the optimizers' gate and the tape's anomaly mode
// (GTape::detect_anomaly, NN_DETECT_ANOMALY=1) share, and the words they report a bad element in.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <sstream>
#include <string>
#include <string_view>

#include "tensor.hpp"

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
