// SPDX-License-Identifier: MIT OR Apache-2.0
// Runs one PyTorch-recorded layer case (tests/fixtures/layers/layers.json, written by
// tests/oracle/gen_layers.py) through nn, and a finite-difference check helper for the layers.
#pragma once

#include <map>
#include <string>

#include "support/check.hpp"

namespace nn::test {

using Vars = std::map<std::string, GVar>;
using CaseBuilder = std::function<GVar(GTape<cpu>&, Vars&, const nlohmann::json& config)>;

inline const nlohmann::json& layer_fixtures() {
  static const nlohmann::json j = fixture("layers/layers.json");
  return j;
}

struct CaseResult {
  double out_err = 0, grad_err = 0;
};

/// Registers the case's inputs (floats as trainable params of dtype `dt`, integers as int64
/// constants), builds the layer, takes loss = sum(out * w) with the recorded cotangent w, and
/// compares the output and every recorded gradient with PyTorch's (worst relative error).
inline CaseResult run_layer_case(const std::string& name, DType dt, const CaseBuilder& build) {
  const nlohmann::json& c = layer_fixtures().at(name);
  GTape<cpu> tp;
  Vars vars;
  std::vector<Tensor> keep;  // params are bound by reference: keep the tensors alive
  keep.reserve(c.at("inputs").size());
  for (const auto& [k, v] : c.at("inputs").items()) {
    const bool integer = !v.at("data").empty() && v.at("data")[0].is_number_integer() && !c.at("grads").contains(k);
    if (integer) {
      std::vector<std::int64_t> d = v.at("data").get<std::vector<std::int64_t>>();
      vars[k] = tp.constant(Tensor::from<std::int64_t>(Shape(v.at("shape").get<std::vector<std::int64_t>>()), d));
    } else {
      keep.push_back(tensor_from_json(v, dt));
      vars[k] = c.at("grads").contains(k) ? tp.param(keep.back()) : tp.constant(keep.back());
    }
  }
  GVar out = build(tp, vars, c.at("config"));
  Tensor expect = tensor_from_json(c.at("out"));
  REQUIRE_MESSAGE(tp.shape(out) == expect.shape(), name << ": shape " << tp.shape(out).str() << " vs PyTorch "
                                                         << expect.shape().str());
  CaseResult r;
  r.out_err = rel_err(tp.value(out).to_doubles(), expect.to_doubles());
  GVar w = tp.constant(tensor_from_json(c.at("w"), dt));
  tp.backward(sum(tp, mul(tp, out, w)));
  for (const auto& [k, g] : c.at("grads").items())
    r.grad_err = std::max(r.grad_err, rel_err(tp.grad(vars.at(k)).to_doubles(), tensor_from_json(g).to_doubles()));
  MESSAGE(name << " (" << std::string(dtype_name(dt)) << ") vs PyTorch: out " << r.out_err << ", grads " << r.grad_err);
  return r;
}

/// The case in float64 (to 1e-12) and float32 (to `tol32`; the inputs are exact in float32).
inline void check_layer_case(const std::string& name, const CaseBuilder& build, double tol32 = 2e-5) {
  CaseResult d = run_layer_case(name, DType::f64, build);
  CHECK(d.out_err <= 1e-12);
  CHECK(d.grad_err <= 1e-12);
  CaseResult f = run_layer_case(name, DType::f32, build);
  CHECK(f.out_err <= tol32);
  CHECK(f.grad_err <= tol32);
}

/// Finite-difference check of a layer: loss = sum(f(inputs) * w) for a fixed random cotangent w
/// (every output element weighs in), all inputs float64 params. Returns the worst relative error.
inline double layer_gradcheck(const std::string& label, std::vector<Tensor> inputs,
                              const std::function<GVar(GTape<cpu>&, const std::vector<GVar>&)>& f,
                              std::uint64_t seed = 99, double h = 1e-6) {
  Tensor w;
  {
    GTape<cpu> tp;
    std::vector<GVar> vs;
    for (auto& t : inputs) vs.push_back(tp.constant(t));
    w = random_tensor(tp.shape(f(tp, vs)), DType::f64, seed);
  }
  return gradcheck(
      label, std::move(inputs),
      [&](GTape<cpu>& tp, const std::vector<GVar>& vs) { return sum(tp, mul(tp, f(tp, vs), tp.constant(w))); }, h);
}

}  // namespace nn::test
