// SPDX-License-Identifier: MIT OR Apache-2.0
// The small model the optimizer trajectory fixtures were recorded on (tests/oracle/gen_optim_*.py),
// written with nn primitives, and the helpers that run and compare a trajectory.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

#include "support/check.hpp"

namespace nn::test::optim {

struct Lin {
  Param weight;  // (out, in)
  Param bias;    // (out)
  NN_MODULE(Lin, weight, bias)
};

/// h = tanh(x W1^T + b1); y = h W2^T + b2; z = tanh(x reshape(e, (6, 4))^T);
/// loss = mean((y - t)^2) + mean((z - u)^2). Paths: l1.weight (8, 4), l1.bias (8),
/// l2.weight (3, 8), l2.bias (3), e (3, 2, 4) — the rank-3 one takes Muon's reshape path.
struct Net {
  Lin l1, l2;
  Param e;
  NN_MODULE(Net, l1, l2, e)
};

struct Data {
  Tensor x, t, u;  // x: (6, 4), t: (6, 3), u: (6, 6)
};

inline GVar net_loss(GTape<cpu>& tp, const Net& m, const Data& d) {
  GVar x = tp.constant(d.x);
  GVar h = tanh(tp, add(tp, matmul(tp, x, param(tp, m.l1.weight), false, true), param(tp, m.l1.bias)));  // (6, 8)
  GVar y = add(tp, matmul(tp, h, param(tp, m.l2.weight), false, true), param(tp, m.l2.bias));           // (6, 3)
  GVar e = reshape(tp, param(tp, m.e), {6, 4});
  GVar z = tanh(tp, matmul(tp, x, e, false, true));  // (6, 6)
  GVar dy = sub(tp, y, tp.constant(d.t));
  GVar dz = sub(tp, z, tp.constant(d.u));
  return add(tp, mean(tp, mul(tp, dy, dy)), mean(tp, mul(tp, dz, dz)));
}

/// The model and inputs a fixture saved ("init", "inputs"), in `dt`.
inline Net net_from(const nlohmann::json& fx, DType dt) {
  const auto& in = fx.at("init");
  auto p = [&](const char* k) { return Param(tensor_from_json(in.at(k), dt)); };
  return Net{Lin{p("l1.weight"), p("l1.bias")}, Lin{p("l2.weight"), p("l2.bias")}, p("e")};
}
inline Data data_from(const nlohmann::json& fx, DType dt) {
  const auto& in = fx.at("inputs");
  return Data{tensor_from_json(in.at("x"), dt), tensor_from_json(in.at("t"), dt), tensor_from_json(in.at("u"), dt)};
}

/// {loss, grads} of the model at its current parameters.
inline std::pair<double, Net> loss_and_grads(Net& m, const Data& d) {
  auto [l, g] = value_and_grad(m, [&](GTape<cpu>& tp, const Net& mm) { return net_loss(tp, mm, d); });
  return {l.item(), std::move(g)};
}

/// Parameters by path (as the fixtures key them).
inline std::map<std::string, Tensor> by_path(const Net& m) {
  std::map<std::string, Tensor> out;
  for (auto& [k, t] : m.parameters()) out[k] = t;
  return out;
}

/// A heap optimizer from a temporary (or a setter's reference to one), for the base-class
/// runners. Built afresh per run: a copied optimizer would share its state tensors.
template <class O>
std::unique_ptr<Optimizer> own(O&& o) {
  return std::make_unique<std::remove_cvref_t<O>>(std::move(o));
}

/// |a - b| / |b| for scalars (0 when equal).
inline double rel(double a, double b) {
  if (a == b) return 0;
  return b == 0 ? std::abs(a) : std::abs(a - b) / std::abs(b);
}

/// The worst relative error per optimizer family ("sgd", "adam", ...), printed at exit by the
/// tests that fill it.
struct Worst {
  std::map<std::string, double> by_family;
  void add(const std::string& case_name, double e) {
    auto& w = by_family[case_name.substr(0, case_name.find('/'))];
    w = std::max(w, e);
  }
};

}  // namespace nn::test::optim
