// SPDX-License-Identifier: MIT OR Apache-2.0
// The elementwise fusion pass (ops/fused.hpp): random graphs of unary and binary nodes (with
// broadcasting, fan-out, frozen leaves), fused against the same graph unfused, values and
// gradients bit for bit in float32 and float64, eager and memory-planned; what the pass must
// leave alone; and the reads it forbids afterwards.
#include <doctest/doctest.h>

#include <cstring>
#include <random>

#include "support/check.hpp"
#include "support/error_of.hpp"
#include "support/fusion_graph.hpp"

namespace core_fusion {  // one unity source with the other core files: its names stay its own

using namespace nn;

namespace {

using nn::test::FusionGraph;

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.shape() == b.shape() && a.dtype() == b.dtype() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

struct Result {
  Tensor out;
  std::vector<Tensor> grads;
};

// Records g, optionally fuses (and plans), runs it forward and backward twice, and returns the loss and the leaves'
// gradients (copies). `stats` receives what the pass did; `wheres`, the where steps it fused.
Result run(const FusionGraph& g, bool fuse, bool plan, FusionStats* stats = nullptr, int* wheres = nullptr) {
  GTape<cpu> tp;
  std::vector<GVar> params;
  GVar last, loss;
  if (plan) loss = tp.record_deferred([&] { return g.record(tp, g.leaves, params, &last); });
  else loss = g.record(tp, g.leaves, params, &last);
  FusionStats s;
  if (fuse) s = fuse_elementwise(tp, loss);
  if (stats) *stats = s;
  for (std::size_t i = 0; wheres && i < tp.size(); ++i) {
    const Node<cpu>& n = tp.at(static_cast<std::int32_t>(i));
    if (!n.def || n.def->prim != Prim::fused) continue;
    const FusedProgram& p = detail::FusedPrim<cpu>::program(tp, n);
    for (int k = 0; k < p.steps; ++k) *wheres += p.step[static_cast<std::size_t>(k)].select;
  }
  if (plan) tp.plan_memory(loss);
  tp.replay_forward();
  tp.backward(loss);
  tp.replay();  // once more: buffers reused, gradients overwritten, not accumulated
  Result r{tp.value(loss).clone(), {}};
  for (std::size_t k = 0; k < params.size(); ++k)
    r.grads.push_back(g.trainable[k] ? tp.grad(params[k]).clone() : Tensor());
  return r;
}

struct FuseMlp {
  Linear fc1{8, 16}, fc2{16, 3};
  GVar operator()(GTape<cpu>& tp, GVar x) const {
    GVar h = fc1(tp, x);
    h = mul(tp, h, scale(tp, relu(tp, add_scalar(tp, h, 3.0)), 1.0 / 6));  // a user's own activation
    return fc2(tp, h);
  }
  NN_MODULE(FuseMlp, fc1, fc2)
};

}  // namespace

TEST_CASE("fusion: 200 random elementwise graphs fused equal unfused bit for bit (f32, f64; eager and planned)") {
  int groups = 0, absorbed = 0, graphs_fused = 0, wheres = 0;
  for (std::uint64_t seed = 1; seed <= 200; ++seed) {
    for (DType dt : {DType::f32, DType::f64}) {
      CAPTURE(seed);
      const std::string dtype = dtype_name(dt);
      CAPTURE(dtype);
      const FusionGraph g(seed, dt);
      for (bool plan : {false, true}) {
        FusionStats st;
        const Result a = run(g, false, plan), b = run(g, true, plan, &st, plan && dt == DType::f32 ? &wheres : nullptr);
        CHECK(same_bytes(a.out, b.out));
        for (std::size_t k = 0; k < a.grads.size(); ++k)
          if (a.grads[k].defined()) CHECK_MESSAGE(same_bytes(a.grads[k], b.grads[k]), "gradient of leaf " << k);
        if (plan && dt == DType::f32) {
          groups += st.groups;
          absorbed += st.absorbed;
          graphs_fused += st.groups > 0;
        }
      }
    }
  }
  MESSAGE(graphs_fused << " of 200 graphs fused: " << groups << " groups absorbing " << absorbed << " nodes, "
                       << wheres << " of them wheres");
  // the loss's own (out + w) * out is one group in every graph; the random chains make the rest
  CHECK(graphs_fused == 200);
  CHECK(groups > 300);
  CHECK(wheres > 20);
}

TEST_CASE("fusion: a chain becomes one node; its intermediates are unreadable, the report lists it") {
  GTape<cpu> tp;
  Tensor X = nn::test::random_tensor({4, 6}, DType::f64, 1), Bv = nn::test::random_tensor({6}, DType::f64, 2);
  GVar x = tp.param(X), b = tp.param(Bv);
  GVar h = add(tp, x, b);        // bias
  GVar s = scale(tp, h, 0.5);    // LoRA-style scale
  GVar y = silu(tp, s);          // an activation
  GVar loss = sum(tp, y);
  const std::size_t before = tp.size();
  const FusionStats st = fuse_elementwise(tp, loss);
  CHECK(st.groups == 1);
  CHECK(st.absorbed == 2);
  CHECK(st.bytes_saved == 2 * 24 * 8 * 4);  // two values of 24 doubles: write + read, gradient write + read
  CHECK(tp.size() == before);                // nodes keep their indices: GVars stay valid
  CHECK(tp.node(y).def->prim == Prim::fused);
  CHECK(tp.node(h).fused_into == y.index);
  const std::string e = nn::test::error_of([&] { (void)tp.value(s); });
  CHECK(e.find("fused into node " + std::to_string(y.index)) != std::string::npos);
  CHECK(nn::test::error_of([&] { (void)add(tp, s, s); }).find("fused into node") != std::string::npos);
  const std::string rep = fusion_report(tp);
  CHECK(rep.find("add#" + std::to_string(h.index)) != std::string::npos);
  CHECK(rep.find("silu#" + std::to_string(y.index)) != std::string::npos);
  CHECK(rep.find("fusion: 1 groups, 2 nodes absorbed") != std::string::npos);
  tp.replay_forward();
  tp.backward(loss);
  // against the closed form: d/dx sum(silu((x + b) / 2)) = silu'(s) / 2
  const auto gx = tp.grad(x).to_doubles();
  const auto xs = X.to_doubles(), bs = Bv.to_doubles();
  for (std::size_t i = 0; i < gx.size(); ++i) {
    const double sv = 0.5 * (xs[i] + bs[i % 6]), sg = 1 / (1 + std::exp(-sv));
    CHECK(gx[i] == doctest::Approx(0.5 * sg * (1 + sv * (1 - sg))).epsilon(1e-14));
  }
}

TEST_CASE("fusion: a where joins a group, its mask (u8, broadcast) an input; gradients as where routes them") {
  GTape<cpu> tp;
  const Tensor X = nn::test::random_tensor({4, 6}, DType::f64, 5);
  const Tensor M = Tensor::from_doubles({6}, {1, 0, 1, 1, 0, 0}, DType::u8);
  GVar x = tp.param(X);
  GVar y = where(tp, tp.constant(M), scale(tp, x, 2.0), neg(tp, x));  // 2x where the mask is set, else -x
  GVar loss = sum(tp, y);
  const FusionStats st = fuse_elementwise(tp, loss);
  CHECK(st.groups == 1);
  CHECK(st.absorbed == 2);
  CHECK(tp.node(y).def->prim == Prim::fused);
  CHECK(fusion_report(tp).find("where#" + std::to_string(y.index)) != std::string::npos);
  tp.replay_forward();
  tp.backward(loss);
  const auto xs = X.to_doubles(), ys = tp.value(y).to_doubles(), gx = tp.grad(x).to_doubles();
  for (std::size_t i = 0; i < xs.size(); ++i) {
    const bool set = M.item(static_cast<std::int64_t>(i % 6)) != 0;
    CHECK(ys[i] == (set ? 2 * xs[i] : -xs[i]));
    CHECK(gx[i] == (set ? 2.0 : -1.0));
  }
}

TEST_CASE("fusion: the fused vjp reads only what its derivatives read") {
  GTape<cpu> tp;
  Tensor Base = nn::test::random_tensor({4, 6}, DType::f32, 5), L = nn::test::random_tensor({4, 6}, DType::f32, 6);
  GVar base = tp.param(Base), l = tp.param(L);
  GVar y = add(tp, base, scale(tp, l, 2.0));  // LoRA's scale-and-add: no derivative reads a value
  GVar z = mul(tp, neg(tp, base), l);         // mul's derivatives read both operands: neg(base) and l
  GVar loss = add(tp, sum(tp, y), sum(tp, z));
  CHECK(fuse_elementwise(tp, loss).groups == 2);
  CHECK(tp.node(y).def->vjp_reads(tp, tp.node(y)) == 0u);  // plan_memory may free base and l early
  CHECK(tp.node(z).def->vjp_reads(tp, tp.node(z)) == 3u);  // both inputs (base, l), not the output
}

TEST_CASE("fusion: what the pass leaves alone") {
  Tensor X = nn::test::random_tensor({4, 6}, DType::f32, 3);
  SUBCASE("the cost rule: a transcendental joins a group only as its last node") {
    GTape<cpu> tp;
    GVar x = tp.param(X);
    GVar s = sigmoid(tp, scale(tp, x, 2.0));  // root of its own group (absorbs the scale)
    GVar y = mul(tp, s, x);                    // would recompute the sigmoid: s is not absorbed
    GVar loss = sum(tp, y);
    const FusionStats st = fuse_elementwise(tp, loss);
    CHECK(st.groups == 1);
    CHECK(tp.node(s).def->prim == Prim::fused);
    CHECK(tp.node(y).def->prim == Prim::binary);
  }
  SUBCASE("a value read twice stays a node of its own") {
    GTape<cpu> tp;
    GVar x = tp.param(X);
    GVar e = exp(tp, x);
    GVar y = mul(tp, e, e);  // e has two uses: it roots its own group at most
    GVar loss = sum(tp, neg(tp, y));
    fuse_elementwise(tp, loss);
    CHECK(tp.node(e).fused_into < 0);
  }
  SUBCASE("the output passed in is never absorbed") {
    GTape<cpu> tp;
    GVar x = tp.param(X);
    GVar y = tanh(tp, neg(tp, x));
    const FusionStats st = fuse_elementwise(tp, y);
    CHECK(st.groups == 1);
    CHECK(tp.node(y).def->prim == Prim::fused);  // y is the group's root, still readable
    tp.replay_forward();
    CHECK(tp.value(y).shape() == X.shape());
  }
  SUBCASE("anomaly mode: no fusion, so a NaN is named at the node that made it") {
    GTape<cpu> tp;
    tp.detect_anomaly(true);
    GVar x = tp.param(X);
    GVar loss = sum(tp, tanh(tp, neg(tp, x)));
    CHECK(fuse_elementwise(tp, loss).groups == 0);
  }
  SUBCASE("a gradient sum the fused vjp would reorder") {
    // x feeds the group (neg -> mul) and, between the group's nodes, a node outside it (exp):
    // the unfused sweep adds x's contributions mul, exp, neg; fused they would come mul, neg, exp
    GTape<cpu> tp;
    GVar x = tp.param(X);
    GVar n = neg(tp, x);
    GVar e = exp(tp, x);
    GVar y = mul(tp, n, x);
    GVar loss = add(tp, sum(tp, y), sum(tp, e));
    fuse_elementwise(tp, loss);
    CHECK(tp.node(n).fused_into < 0);
    CHECK(tp.node(y).def->prim == Prim::binary);
  }
}

// A compiled step with fusion on (an MLP whose hidden activation is a composite chain: x relu(x +
// 3) / 6, hard-swish without its upper clamp) trains
// exactly as the same step with fusion off: losses and weights bit for bit over 4 steps.
TEST_CASE("fusion: a compiled step fused equals it unfused, and reports its groups") {
  auto train = [](bool fuse, std::vector<double>& losses, FusionStats& st) {
    random::seed(3);
    FuseMlp m;
    AdamW opt(1e-2);
    auto step = compile<2>(m, opt, [](GTape<cpu>& tp, const FuseMlp& mm, GVar x, GVar y) { return cross_entropy(tp, mm(tp, x), y); });
    step.fuse(fuse);
    const Tensor x = nn::test::random_tensor({5, 8}, DType::f32, 9);
    const Tensor y = Tensor::from<std::int32_t>({5}, {0, 1, 2, 1, 0});
    for (int i = 0; i < 4; ++i) losses.push_back(step(x, y).item());
    st = step.fusion();
    CHECK(step.recordings() == 1);
    return nn::test::flat_values(m);
  };
  std::vector<double> la, lb;
  FusionStats sa, sb;
  const auto wa = train(false, la, sa), wb = train(true, lb, sb);
  CHECK(sa.groups == 0);
  CHECK(sb.groups == 1);
  CHECK(sb.absorbed == 3);
  CHECK(la == lb);
  CHECK(wa == wb);
}

}  // namespace core_fusion
