// SPDX-License-Identifier: MIT OR Apache-2.0
// Every check, from the one op registry (tests/support/op_registry.hpp): each primitive of
// nn::Prim has an entry that records it; each entry against its PyTorch fixture case (float64,
// float32), against central differences (float64), against its composite when it is fused, and
// replayed against eager (bit for bit, float32 and float64). tests/cuda/registry.test.cu runs the
// same table on CUDA against the CPU.
#include <cstring>

#include "ops/golden.hpp"
#include "support/op_registry.hpp"

using namespace nn;
namespace reg = nn::test::registry;

namespace ops_registry {  // one unity source with the other ops files: its names stay its own

namespace {

using Case = reg::OpCase<cpu>;

const std::vector<Case>& all() {
  static const std::vector<Case> c = reg::cases<cpu>();
  return c;
}

/// A fixed cotangent for a case's output (its shape and dtype), or none for an integer output.
Tensor cotangent(const Tensor& out, std::uint64_t seed) {
  return is_floating(out.dtype()) ? test::random_tensor(out.shape(), out.dtype(), seed) : Tensor();
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

double worst_err(const reg::Run& a, const reg::Run& b) {
  double e = test::rel_err(a.out.to_doubles(), b.out.to_doubles());
  for (std::size_t k = 0; k < a.grads.size(); ++k)
    if (a.grads[k].defined()) e = std::max(e, test::rel_err(a.grads[k].to_doubles(), b.grads[k].to_doubles()));
  return e;
}

}  // namespace

TEST_CASE("registry: every primitive has an entry, and each entry records the primitive it names") {
  for (std::size_t i = 0; i < kPrimCount; ++i) {
    const Prim p = static_cast<Prim>(i);
    bool listed = false;
    for (const Case& c : all()) listed = listed || c.prim == p;
    CHECK_MESSAGE(listed, "primitive '" << prim_name(p) << "' has no entry in tests/support/op_registry.hpp");
  }
  for (const Case& c : all()) {
    std::vector<Tensor> ts = reg::make_inputs(c.inputs, DType::f64, 1);
    GTape<cpu> tp;
    std::vector<GVar> vs = reg::bind_inputs(tp, c, ts);
    c.build(tp, vs);
    bool recorded = false;
    for (std::size_t i = 0; i < tp.size(); ++i) {
      const Node<cpu>& n = tp.node(GVar{&tp, static_cast<std::int32_t>(i)});
      recorded = recorded || (n.def && n.def->prim == c.prim);
    }
    CHECK_MESSAGE(recorded, c.name << " does not record the primitive '" << prim_name(c.prim) << "'");
  }
}

TEST_CASE("registry: PyTorch fixtures (float64, float32)") {
  int checked = 0;
  for (const Case& c : all()) {
    if (c.fixture.empty()) continue;
    const std::size_t colon = c.fixture.find(':');
    const std::string file = c.fixture.substr(0, colon), name = c.fixture.substr(colon + 1);
    const nlohmann::json fx = test::fixture("ops/" + file);
    const nlohmann::json* found = nullptr;
    for (const auto& fc : fx.at("cases"))
      if (fc.at("name") == name) found = &fc;
    REQUIRE_MESSAGE(found, c.name << ": no case " << name << " in " << file);
    const double e64 = test::golden::error_vs_fixture(*found, test::golden::run(*found, c.build, DType::f64));
    const double e32 = test::golden::error_vs_fixture(*found, test::golden::run(*found, c.build, DType::f32));
    CHECK_MESSAGE(e64 <= test::kTolF64, c.name << ": float64 vs PyTorch " << e64);
    CHECK_MESSAGE(e32 <= c.tol.torch32, c.name << ": float32 vs PyTorch " << e32);
    ++checked;
  }
  MESSAGE(checked << " registry cases against their PyTorch fixture cases");
  CHECK(checked > 30);
}

TEST_CASE("registry: central differences in float64") {
  for (const Case& c : all()) {
    if (!c.fd) continue;
    INFO(c.name);
    const std::vector<Tensor> ts = reg::make_inputs(c.inputs, DType::f64, 11);
    const Tensor w = cotangent(reg::run(c, c.build, ts, Tensor()).out, 12);
    std::vector<Tensor> diff;
    std::vector<std::size_t> where;
    for (std::size_t k = 0; k < ts.size(); ++k)
      if (c.inputs[k].differentiable()) {
        diff.push_back(ts[k].clone());
        where.push_back(k);
      }
    REQUIRE(!diff.empty());
    const double e = test::gradcheck(c.name, diff, [&](GTape<cpu>& tp, const std::vector<GVar>& dv) {
      std::vector<GVar> vs(ts.size());
      for (std::size_t k = 0; k < ts.size(); ++k) vs[k] = tp.constant(ts[k]);
      for (std::size_t j = 0; j < where.size(); ++j) vs[where[j]] = dv[j];
      return sum(tp, mul(tp, c.build(tp, vs), tp.constant(w)));
    }, test::kFdStep);
    CHECK_MESSAGE(e <= c.tol.fd, c.name << ": vs central differences " << e);
  }
}

TEST_CASE("registry: fused primitives equal their composites, values and gradients") {
  int checked = 0;
  for (const Case& c : all()) {
    if (!c.composite) continue;
    for (DType dt : {DType::f64, DType::f32}) {
      const std::vector<Tensor> ts = reg::make_inputs(c.inputs, dt, 31);
      const Tensor w = cotangent(reg::run(c, c.build, ts, Tensor()).out, 32);
      const double e = worst_err(reg::run(c, c.build, ts, w), reg::run(c, c.composite, ts, w));
      const double tol = dt == DType::f64 ? c.tol.composite64 : c.tol.composite32;
      CHECK_MESSAGE(e <= tol, c.name << " " << dtype_name(dt) << ": fused vs composite " << e);
    }
    ++checked;
  }
  CHECK(checked >= 6);
}

TEST_CASE("registry: a replay equals an eager recording on the new data, bit for bit") {
  for (const Case& c : all())
    for (DType dt : {DType::f32, DType::f64}) {
      INFO(c.name << " " << dtype_name(dt));
      const std::vector<Tensor> first = reg::make_inputs(c.inputs, dt, 41), second = reg::make_inputs(c.inputs, dt, 42);
      std::vector<Tensor> bound;  // what the params bind, rewritten in place before the replay
      for (const Tensor& t : first) bound.push_back(t.clone());
      GTape<cpu> tp;
      std::vector<GVar> vs = reg::bind_inputs(tp, c, bound);
      GVar out = c.build(tp, vs);
      const Tensor w = cotangent(tp.value(out), 43);
      if (w.defined() && reg::any_differentiable(c)) tp.backward(sum(tp, mul(tp, out, tp.constant(w))));
      for (std::size_t k = 0; k < bound.size(); ++k) {
        if (c.inputs[k].differentiable()) bound[k].copy_from(second[k]);
        else tp.set(vs[k], second[k]);
      }
      tp.replay();
      const reg::Run want = reg::run(c, c.build, second, w);
      CHECK_MESSAGE(same_bytes(tp.value(out), want.out), c.name << ": replayed output differs");
      for (std::size_t k = 0; k < want.grads.size(); ++k)
        if (want.grads[k].defined())
          CHECK_MESSAGE(same_bytes(tp.grad(vs[k]), want.grads[k]), c.name << ": replayed gradient of input " << k);
    }
}

}  // namespace ops_registry
