// SPDX-License-Identifier: MIT OR Apache-2.0
// Support for the CUDA tests: CUDA-vs-CPU comparisons (recorded for the summary table the main
// prints last), NaN-poisoned outputs, fresh random inputs from a per-run seed, device copies.
#pragma once

#include "support/check.hpp"

#include <nn/cuda.hpp>

#include <chrono>
#include <cstdlib>
#include <mutex>
#include <string>
#include <vector>

namespace nn::test::gpu {

/// One line of the summary table.
struct Row {
  std::string check;
  std::string dtype;
  double err;
  double tol;
  bool pass;
};
inline std::vector<Row>& rows() {
  static std::vector<Row> r;
  return r;
}

/// The tolerance of a CUDA-vs-CPU comparison: relative (infinity norm) 1e-12 in float64, 1e-5 in
/// float32; exact (0) for integers, masks and data movement.
inline double tol_for(DType dt) { return dt == DType::f64 ? 1e-12 : 1e-5; }

/// Records a comparison in the table and as a doctest check.
inline void record(const std::string& check, const std::string& dtype, double err, double tol) {
  const bool pass = err <= tol;  // NaN fails
  rows().push_back({check, dtype, err, tol, pass});
  CHECK_MESSAGE(pass, check << " (" << dtype << "): error " << err << " > tolerance " << tol);
}

/// The run's seed: NN_CUDA_TEST_SEED when set (to reproduce a failure), else the clock, so every
/// run draws fresh inputs. Printed by the main.
inline std::uint64_t& run_seed() {
  static std::uint64_t s = [] {
    if (const char* e = std::getenv("NN_CUDA_TEST_SEED")) return static_cast<std::uint64_t>(std::strtoull(e, nullptr, 10));
    return static_cast<std::uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  }();
  return s;
}
/// A new seed per draw, derived from the run's seed.
inline std::uint64_t next_seed() {
  static std::uint64_t n = 0;
  return run_seed() * 0x9E3779B97F4A7C15ull + (++n) * 0xBF58476D1CE4E5B9ull;
}

/// Uniform in [lo, hi), a fresh draw.
inline Tensor rnd(const Shape& s, DType dt, double lo = -1, double hi = 1) { return random_tensor(s, dt, next_seed(), lo, hi); }
/// Integer ids in [lo, hi), a fresh draw.
inline Tensor ids(const Shape& s, DType dt, std::int64_t lo, std::int64_t hi) {
  std::mt19937_64 g(next_seed());
  std::uniform_int_distribution<std::int64_t> u(lo, hi - 1);
  std::vector<double> v(static_cast<std::size_t>(s.numel()));
  for (auto& x : v) x = static_cast<double>(u(g));
  return Tensor::from_doubles(s, v, dt);
}

/// A host tensor full of NaN (floats) or 0xA5 bytes (other dtypes): an element a kernel forgets
/// to write shows up in the comparison.
inline Tensor poisoned(const Shape& s, DType dt) {
  Tensor t = Tensor::empty(s, dt);
  if (dt == DType::f32 || dt == DType::f64 || dt == DType::bf16 || dt == DType::f16)
    for (std::int64_t i = 0; i < t.numel(); ++i) detail::store_from_double(t.raw(), dt, i, NAN);
  else
    std::memset(t.raw(), 0xA5, t.nbytes());
  return t;
}

inline Tensor dev(const Tensor& h) { return h.to(Device::cuda); }
inline Tensor host(const Tensor& d) { return d.to(Device::cpu); }

/// Relative error of a CUDA result against the CPU's (both brought to the host).
inline double err_of(const Tensor& cpu_out, const Tensor& cuda_out) {
  Tensor g = cuda_out.device() == Device::cpu ? cuda_out : host(cuda_out);
  REQUIRE(g.shape() == cpu_out.shape());
  REQUIRE(g.dtype() == cpu_out.dtype());
  std::vector<double> a = g.to_doubles(), b = cpu_out.to_doubles();
  // rel_err lets NaN == NaN pass (a NaN the CPU also produced); an unwritten (poisoned) element
  // is NaN on one side only and fails.
  return rel_err(a, b);
}
/// True when the two tensors hold the same bytes.
inline bool same_bits(const Tensor& a, const Tensor& b) {
  Tensor x = a.device() == Device::cpu ? a : host(a), y = b.device() == Device::cpu ? b : host(b);
  return x.shape() == y.shape() && x.dtype() == y.dtype() && std::memcmp(x.raw(), y.raw(), x.nbytes()) == 0;
}

/// Compares and records: floats to tol_for(dt) (or `tol` when given), other dtypes bit for bit.
inline void expect_close(const std::string& check, const Tensor& cpu_out, const Tensor& cuda_out, double tol = -1) {
  const DType dt = cpu_out.dtype();
  if (dt == DType::f32 || dt == DType::f64) {
    record(check, dtype_name(dt), err_of(cpu_out, cuda_out), tol >= 0 ? tol : tol_for(dt));
  } else {
    record(check, dtype_name(dt), same_bits(cpu_out, cuda_out) ? 0.0 : INFINITY, 0.0);
  }
}
inline void expect_bitwise(const std::string& check, const Tensor& a, const Tensor& b) {
  record(check, dtype_name(a.dtype()), same_bits(a, b) ? 0.0 : INFINITY, 0.0);
}

inline const std::vector<DType>& float_dtypes() {
  static const std::vector<DType> d = {DType::f32, DType::f64};
  return d;
}

}  // namespace nn::test::gpu
