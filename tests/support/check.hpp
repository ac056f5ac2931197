// SPDX-License-Identifier: MIT OR Apache-2.0
// Test support shared by every area: relative errors, golden fixtures (JSON written by the
// generators in tests/oracle/), central finite differences in double, error-message checks.
#pragma once

#include <doctest/doctest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <fstream>
#include <functional>
#include <iostream>
#include <nlohmann/json.hpp>
#include <random>
#include <string>
#include <vector>

#include <nn/nn.hpp>

namespace nn::test {

/// max |a - b| / max |b| (the infinity-norm relative error; 0 when both are all zero).
inline double rel_err(const std::vector<double>& a, const std::vector<double>& b) {
  REQUIRE(a.size() == b.size());
  double num = 0, den = 0;
  for (std::size_t i = 0; i < a.size(); ++i) {
    double d = std::abs(a[i] - b[i]);
    if (std::isnan(a[i]) != std::isnan(b[i])) d = INFINITY;
    num = std::max(num, d);
    den = std::max(den, std::abs(b[i]));
  }
  if (num == 0) return 0;
  return den == 0 ? num : num / den;
}
inline double rel_err(const Tensor& a, const Tensor& b) {
  REQUIRE(a.shape() == b.shape());
  return rel_err(a.to_doubles(), b.to_doubles());
}

/// Loads tests/fixtures/<name> (a JSON document).
inline nlohmann::json fixture(const std::string& name) {
  std::string path = std::string(NN_FIXTURES_DIR) + "/" + name;
  std::ifstream f(path);
  if (!f) FAIL("missing fixture " << path << " (regenerate with tests/oracle/)");
  return nlohmann::json::parse(f);
}

/// A tensor from a fixture entry {"shape": [...], "data": [...]} (data flat, row-major), in `dt`.
inline Tensor tensor_from_json(const nlohmann::json& j, DType dt = DType::f64) {
  std::vector<std::int64_t> shape = j.at("shape").get<std::vector<std::int64_t>>();
  std::vector<double> data = j.at("data").get<std::vector<double>>();
  return Tensor::from_doubles(Shape(shape), data, dt);
}

/// A fixture tensor {"dtype", "shape", "hex"} (the raw little-endian bytes, exactly), as the MLX
/// generators write bit-exact data; dtype names as NumPy spells them.
inline Tensor tensor_from_hex(const nlohmann::json& j) {
  static const std::pair<const char*, DType> names[] = {{"float32", DType::f32},  {"float64", DType::f64},
                                                        {"bfloat16", DType::bf16}, {"float16", DType::f16},
                                                        {"uint32", DType::u32},   {"uint8", DType::u8},
                                                        {"int32", DType::i32},    {"int64", DType::i64}};
  const std::string dn = j.at("dtype").get<std::string>();
  const auto* it = std::find_if(std::begin(names), std::end(names), [&](const auto& n) { return dn == n.first; });
  REQUIRE_MESSAGE(it != std::end(names), "unknown fixture dtype " << dn);
  Tensor t = Tensor::empty(Shape(j.at("shape").get<std::vector<std::int64_t>>()), it->second);
  const std::string h = j.at("hex").get<std::string>();
  REQUIRE(h.size() == 2 * t.nbytes());
  auto* p = static_cast<unsigned char*>(t.raw());
  for (std::size_t i = 0; i < t.nbytes(); ++i) p[i] = static_cast<unsigned char>(std::stoul(h.substr(2 * i, 2), nullptr, 16));
  return t;
}

/// Deterministic random tensor, uniform in [lo, hi).
inline Tensor random_tensor(const Shape& s, DType dt, std::uint64_t seed, double lo = -1, double hi = 1) {
  std::mt19937_64 rng(seed);
  std::uniform_real_distribution<double> u(lo, hi);
  std::vector<double> v(static_cast<std::size_t>(s.numel()));
  for (auto& x : v) x = u(rng);
  return Tensor::from_doubles(s, v, dt);
}

/// Central finite-difference check of d f / d inputs in float64. `f` builds a scalar loss on
/// the tape from one GVar per input (registered as params). Returns the worst relative error
/// over every input (infinity-norm relative, per input), and prints it with `label`.
/// `h` is the probe step; the central difference has O(h^2) truncation error.
inline double gradcheck(const std::string& label, std::vector<Tensor> inputs,
                        const std::function<GVar(GTape<cpu>&, const std::vector<GVar>&)>& f,
                        double h = 1e-6) {
  for (auto& t : inputs) REQUIRE(t.dtype() == DType::f64);
  // analytic
  std::vector<Tensor> analytic;
  {
    GTape<cpu> tp;
    std::vector<GVar> vs;
    for (auto& t : inputs) vs.push_back(tp.param(t));
    GVar loss = f(tp, vs);
    tp.backward(loss);
    for (auto v : vs) analytic.push_back(tp.grad(v).clone());
  }
  auto eval = [&]() {
    GTape<cpu> tp;
    std::vector<GVar> vs;
    for (auto& t : inputs) vs.push_back(tp.param(t));
    return tp.value(f(tp, vs)).item();
  };
  double worst = 0;
  for (std::size_t k = 0; k < inputs.size(); ++k) {
    double* p = inputs[k].data<double>();
    std::vector<double> num(static_cast<std::size_t>(inputs[k].numel()));
    for (std::int64_t i = 0; i < inputs[k].numel(); ++i) {
      double keep = p[i];
      p[i] = keep + h;
      double up = eval();
      p[i] = keep - h;
      double dn = eval();
      p[i] = keep;
      num[static_cast<std::size_t>(i)] = (up - dn) / (2 * h);
    }
    worst = std::max(worst, rel_err(analytic[k].to_doubles(), num));
  }
  MESSAGE("gradcheck " << label << ": worst relative error vs central differences " << worst);
  return worst;
}

/// The bit patterns of a float32 tensor (to compare with MLX fixtures stored as uint32 words).
inline std::vector<std::uint32_t> f32_bits(const Tensor& t) {
  std::vector<std::uint32_t> out(static_cast<std::size_t>(t.numel()));
  std::memcpy(out.data(), t.data<float>(), out.size() * 4);
  return out;
}

/// The paths of a (path, tensor) list, in order (module parameter names).
inline std::vector<std::string> paths(const std::vector<std::pair<std::string, Tensor>>& ps) {
  std::vector<std::string> out;
  for (const auto& p : ps) out.push_back(p.first);
  return out;
}

/// Every parameter and buffer of a model, flattened in tree order (bitwise comparisons of runs).
template <class M>
std::vector<double> flat_values(const M& m) {
  std::vector<double> out;
  for (const auto& [p, t] : m.parameters())
    for (double v : t.to_doubles()) out.push_back(v);
  return out;
}

/// Runs `fn`, expects an nn::Error whose message contains every fragment.
template <class Fn, class Fragments = std::initializer_list<std::string>>
void check_error(Fn&& fn, const Fragments& fragments) {
  try {
    fn();
  } catch (const nn::Error& e) {
    std::string msg = e.what();
    for (const auto& f : fragments) CHECK_MESSAGE(msg.find(f) != std::string::npos, "message: " << msg << " lacks: " << f);
    return;
  }
  FAIL("expected nn::Error containing " << *fragments.begin());
}

}  // namespace nn::test
