// SPDX-License-Identifier: MIT OR Apache-2.0
// The evidence every primitive gets, run case by case from the PyTorch fixtures written by
// tests/oracle/gen_ops.py (tests/fixtures/ops/<header>.json):
//   1. forward and vjp in float64 against PyTorch's float64, relative error <= 1e-12;
//   2. the same in float32 (inputs are float32-representable), relative error <= a float tolerance;
//   3. the vjp against central finite differences in float64, relative error <= 1e-7;
//   4. fan-out: each input feeding three copies of the op (cotangents w, 2w, -w/2) gets exactly
//      the sum of the three contributions (2.5x the single gradient), so no vjp overwrites;
//   5. every gradient has its input's shape (broadcast gradients are reduced back).
// A test file maps each fixture case name ("add/trailing") to a builder making the same call.
#pragma once

#include <functional>
#include <map>
#include <string>
#include <vector>

#include "support/check.hpp"

namespace nn::test {

using Tape = GTape<cpu>;
using Vars = std::vector<GVar>;
/// Builds one case's output from its inputs (in fixture order).
using Builder = std::function<GVar(Tape&, const Vars&)>;
/// Case name -> builder.
using Cases = std::map<std::string, Builder>;

inline constexpr double kTolF64 = 1e-12;  // vs PyTorch float64
inline constexpr double kTolF32 = 1e-5;   // float32 run vs the same float64 fixture
inline constexpr double kTolFd = 1e-7;    // vs central finite differences (float64)
// The default probe step: a power of two, so x +- h is exact for the float32-representable
// inputs; a case may set "fd_step" (a larger one where the loss value is huge).
inline constexpr double kFdStep = 1.0 / (1 << 20);

/// Worst errors seen per primitive, printed once at the end of the run (summary.test.cpp).
struct OpScore {
  int cases = 0, fd_cases = 0;  // fd_cases: how many had a finite-difference check
  double torch64 = 0, torch32 = 0, fd = 0;
  std::string worst64_case, worst32_case, worst_fd_case;
};
inline std::map<std::string, OpScore>& scoreboard() {
  static std::map<std::string, OpScore> m;
  return m;
}

namespace golden {

inline DType input_dtype(const nlohmann::json& in, DType float_dt) {
  const std::string k = in.at("dtype").get<std::string>();
  if (k == "float") return float_dt;
  if (k == "int64") return DType::i64;
  if (k == "int32") return DType::i32;
  if (k == "uint8") return DType::u8;
  FAIL("unknown input dtype " << k);
  return float_dt;
}
inline bool differentiable(const nlohmann::json& in) { return in.at("dtype") == "float"; }

/// The case's inputs converted to the run's float dtype (integer inputs keep theirs).
inline std::vector<Tensor> load_inputs(const nlohmann::json& c, DType dt) {
  std::vector<Tensor> ts;
  for (const auto& in : c.at("inputs")) ts.push_back(tensor_from_json(in, input_dtype(in, dt)));
  return ts;
}

/// One recording: the op applied `uses` times to the same leaves, combined as
/// out_0 + 2 out_1 - 0.5 out_2 (for uses = 3), then backward with cotangent w.
struct Result {
  Tensor out;
  std::vector<Tensor> grads;  // one per input; undefined for integer inputs
};
inline Result run(const nlohmann::json& c, const Builder& build, DType dt, int uses = 1) {
  std::vector<Tensor> ts = load_inputs(c, dt);  // kept alive: params bind by reference
  Tape tp;
  Vars vs;
  for (std::size_t k = 0; k < ts.size(); ++k)
    vs.push_back(differentiable(c["inputs"][k]) ? tp.param(ts[k]) : tp.constant(ts[k]));
  GVar out = build(tp, vs);
  if (uses == 3) {
    GVar o2 = build(tp, vs), o3 = build(tp, vs);
    out = add(tp, add(tp, out, scale(tp, o2, 2.0)), scale(tp, o3, -0.5));
  }
  tp.backward(out, tensor_from_json(c.at("w"), dt));
  Result r;
  r.out = tp.value(out).clone();
  for (std::size_t k = 0; k < ts.size(); ++k)
    r.grads.push_back(differentiable(c["inputs"][k]) ? tp.grad(vs[k]).clone() : Tensor());
  return r;
}

/// Worst relative error of a run's output and gradients against `factor` x the fixture's
/// (REQUIREs equal shapes).
inline double error_vs_fixture(const nlohmann::json& c, const Result& r, double factor = 1.0) {
  auto scaled = [&](const Tensor& t) {
    std::vector<double> v = t.to_doubles();
    for (double& x : v) x *= factor;
    return v;
  };
  const Tensor want = tensor_from_json(c.at("out"));
  REQUIRE_MESSAGE(r.out.shape() == want.shape(), "output shape " << r.out.shape() << " vs PyTorch " << want.shape());
  double e = rel_err(r.out.to_doubles(), scaled(want));
  for (std::size_t k = 0; k < r.grads.size(); ++k) {
    const auto& in = c["inputs"][k];
    if (!differentiable(in)) continue;
    Tensor g = tensor_from_json(in.at("grad"));
    // (d) a gradient has its input's shape, broadcast or not
    REQUIRE_MESSAGE(r.grads[k].shape() == g.shape(), "gradient of input " << k << " has shape " << r.grads[k].shape()
                                                                          << ", its input " << g.shape());
    e = std::max(e, rel_err(r.grads[k].to_doubles(), scaled(g)));
  }
  return e;
}

inline void note(double e, double& worst, std::string& where, const std::string& name) {
  if (e >= worst) {
    worst = e;
    where = name;
  }
}

}  // namespace golden

/// Runs every fixture case of primitive `op` in tests/fixtures/ops/<file> through the five checks
/// above, each case with the builder of the same name, and MESSAGEs the worst errors.
inline void check_op(const std::string& file, const std::string& op, const Cases& cases, double tol32 = kTolF32) {
  const nlohmann::json fx = fixture("ops/" + file);
  OpScore& score = scoreboard()[op];
  for (const auto& c : fx.at("cases")) {
    if (c.at("op") != op) continue;
    const std::string name = c.at("name");
    INFO("case " << name);
    auto it = cases.find(name);
    REQUIRE_MESSAGE(it != cases.end(), "no builder for fixture case " << name);
    const Builder& build = it->second;
    ++score.cases;

    // 1-2. PyTorch, both dtypes
    const double e64 = golden::error_vs_fixture(c, golden::run(c, build, DType::f64));
    const double e32 = golden::error_vs_fixture(c, golden::run(c, build, DType::f32));
    CHECK_MESSAGE(e64 <= kTolF64, name << ": float64 vs PyTorch " << e64);
    CHECK_MESSAGE(e32 <= tol32, name << ": float32 vs PyTorch " << e32);
    golden::note(e64, score.torch64, score.worst64_case, name);
    golden::note(e32, score.torch32, score.worst32_case, name);

    // 3. central differences (skipped where the fixture says "fd": false: a kink hit on purpose,
    //    stop_gradient, whose gradient is by definition not the derivative)
    if (c.at("fd").get<bool>()) {
      std::vector<Tensor> all = golden::load_inputs(c, DType::f64), diff;
      std::vector<std::size_t> where;
      for (std::size_t k = 0; k < all.size(); ++k)
        if (golden::differentiable(c["inputs"][k])) {
          diff.push_back(all[k]);
          where.push_back(k);
        }
      const Tensor w = tensor_from_json(c.at("w"));
      const double efd = gradcheck(name, diff, [&](Tape& tp, const Vars& dv) {
        Vars vs(all.size());
        for (std::size_t k = 0; k < all.size(); ++k) vs[k] = tp.constant(all[k]);
        for (std::size_t j = 0; j < where.size(); ++j) vs[where[j]] = dv[j];
        return sum(tp, mul(tp, build(tp, vs), tp.constant(w)));
      }, c.value("fd_step", kFdStep));
      CHECK_MESSAGE(efd <= kTolFd, name << ": vs central differences " << efd);
      golden::note(efd, score.fd, score.worst_fd_case, name);
      ++score.fd_cases;
    }

    // 4. three uses accumulate three contributions: w + 2w - w/2 = 2.5w
    const double efan = golden::error_vs_fixture(c, golden::run(c, build, DType::f64, 3), 2.5);
    CHECK_MESSAGE(efan <= kTolF64, name << ": three uses do not accumulate to 2.5x (" << efan << ")");
  }
  REQUIRE_MESSAGE(score.cases > 0, "no fixture case for " << op << " in " << file);
  MESSAGE(op << ": " << score.cases << " cases; worst relative error float64 vs PyTorch " << score.torch64 << " ("
             << score.worst64_case << "), float32 vs PyTorch " << score.torch32 << " (" << score.worst32_case
             << "), float64 vs central differences " << score.fd << " (" << score.worst_fd_case << ")");
}

/// Every case of the fixture file has a builder and every builder a case (no silent gaps).
inline void check_coverage(const std::string& file, const Cases& cases) {
  const nlohmann::json fx = fixture("ops/" + file);
  std::map<std::string, int> seen;
  for (const auto& c : fx.at("cases")) {
    const std::string name = c.at("name");
    CHECK_MESSAGE(cases.count(name) == 1, "fixture case " << name << " has no builder");
    ++seen[name];
  }
  for (const auto& [name, b] : cases) CHECK_MESSAGE(seen.count(name) == 1, "builder " << name << " has no fixture case");
}

}  // namespace nn::test
