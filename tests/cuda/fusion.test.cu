// SPDX-License-Identifier: MIT OR Apache-2.0
// Elementwise fusion on GTape<nn::cuda> (ops/fused.hpp's pass; the k_fused / k_fused_vjp kernels):
// random graphs of unary and binary nodes (tests/support/fusion_graph.hpp, the CPU test's), fused
// against the same graph unfused on the GPU, values and gradients bit for bit, and against the
// CPU to the usual tolerance; then a compiled step with fusion on against it off.
#include "cuda_check.hpp"
#include "support/fusion_graph.hpp"

using namespace nn;
using namespace nn::test::gpu;

namespace cuda_fusion_test {

struct Result {
  Tensor out;
  std::vector<Tensor> grads;
};

// Records g on GTape<B>, optionally fuses it, runs forward and backward twice (the second a
// replay: gradients overwritten, not accumulated), and returns the loss and the leaves'
// gradients on the host.
template <class B>
Result run(const nn::test::FusionGraph& g, bool fuse, FusionStats* stats = nullptr) {
  GTape<B> tp;
  std::vector<GVar> params;
  GVar last;
  std::vector<Tensor> leaves;
  for (const Tensor& t : g.leaves) leaves.push_back(nn::detail::on_backend<B>(t));
  const GVar loss = g.record(tp, leaves, params, &last);
  FusionStats s;
  if (fuse) s = fuse_elementwise(tp, loss);
  if (stats) *stats = s;
  tp.replay_forward();
  tp.backward(loss);
  tp.replay();
  Result r{tp.value(loss).to(Device::cpu), {}};
  for (std::size_t k = 0; k < params.size(); ++k)
    r.grads.push_back(g.trainable[k] ? tp.grad(params[k]).to(Device::cpu) : Tensor());
  return r;
}

// An MLP whose activation is a composite chain (x relu(x + 3) / 6): one fused group.
struct FuseMlp {
  Linear fc1{8, 16}, fc2{16, 3};
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar h = fc1(tp, x);
    h = mul(tp, h, scale(tp, relu(tp, add_scalar(tp, h, 3.0)), 1.0 / 6));
    return fc2(tp, h);
  }
  NN_MODULE(FuseMlp, fc1, fc2)
};

}  // namespace cuda_fusion_test
using namespace cuda_fusion_test;

TEST_CASE("cuda fusion: 100 random elementwise graphs fused equal unfused bit for bit, and the CPU's") {
  for (DType dt : float_dtypes()) {
    const std::string dn = dtype_name(dt);
    int not_bitwise = 0, groups = 0;
    double worst = 0;
    for (std::uint64_t seed = 1; seed <= 100; ++seed) {
      const nn::test::FusionGraph g(seed, dt);
      FusionStats st;
      const Result a = run<cuda>(g, false), b = run<cuda>(g, true, &st), c = run<cpu>(g, false);
      groups += st.groups;
      bool same = same_bits(a.out, b.out);
      worst = std::max(worst, err_of(c.out, b.out));
      for (std::size_t k = 0; k < a.grads.size(); ++k) {
        if (!a.grads[k].defined()) continue;
        same = same && same_bits(a.grads[k], b.grads[k]);
        worst = std::max(worst, err_of(c.grads[k], b.grads[k]));
      }
      not_bitwise += !same;
    }
    CHECK(groups > 100);
    record("fusion: 100 graphs, fused vs unfused CUDA (graphs not bitwise)", dn, not_bitwise, 0);
    record("fusion: 100 graphs, fused CUDA vs CPU (values and gradients)", dn, worst, tol_for(dt));
  }
}

TEST_CASE("cuda fusion: a compiled step fused equals it unfused bit for bit") {
  auto train = [](bool fuse, std::vector<double>& losses) {
    random::seed(3);
    FuseMlp m;
    m.to(Device::cuda);
    AdamW<cuda> opt(1e-2);
    auto step = compile<2, cuda>(m, opt, [](GTape<cuda>& tp, const FuseMlp& mm, GVar x, GVar y) { return cross_entropy(tp, mm(tp, x), y); });
    step.fuse(fuse);
    const Tensor x = dev(nn::test::random_tensor({5, 8}, DType::f32, 9));
    const Tensor y = dev(Tensor::from<std::int32_t>({5}, {0, 1, 2, 1, 0}));
    for (int i = 0; i < 4; ++i) losses.push_back(step(x, y).to(Device::cpu).item());
    CHECK(step.fusion().groups == (fuse ? 1 : 0));
    m.to(Device::cpu);
    return nn::test::flat_values(m);
  };
  std::vector<double> la, lb;
  const auto wa = train(false, la), wb = train(true, lb);
  record("fusion: compiled step fused vs unfused CUDA, losses (bitwise)", "float32", la == lb ? 0.0 : INFINITY, 0);
  record("fusion: compiled step fused vs unfused CUDA, weights (bitwise)", "float32", wa == wb ? 0.0 : INFINITY, 0);
}
