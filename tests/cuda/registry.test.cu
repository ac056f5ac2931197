// SPDX-License-Identifier: MIT OR Apache-2.0
// The op registry (tests/support/op_registry.hpp) on CUDA: every case the CPU runs, built by the
// same builder on a GTape<cuda> from the same inputs, gives the CPU's output and gradients
// (float64 and float32). A case missing on CUDA fails, unless the CUDA policy lacks the primitive
// (flash attention).
#include "cuda_check.hpp"
#include "support/op_registry.hpp"

using namespace nn;
using namespace nn::test::gpu;
namespace reg = nn::test::registry;

// (A named namespace: NN_MODULE's members in an anonymous one draw nvcc's unused-function warnings.)
namespace cuda_registry_test {

struct Run {
  Tensor out;
  std::vector<Tensor> grads;
};

/// The output and the gradients of sum(out * w) of one case on backend B, brought to the host.
template <class B>
Run run(const reg::OpCase<B>& c, const std::vector<Tensor>& host_in, const Tensor& w) {
  std::vector<Tensor> ts;
  for (const Tensor& t : host_in) ts.push_back(B::device == Device::cpu ? t : t.to(B::device));
  GTape<B> tp;
  std::vector<GVar> vs;
  for (std::size_t k = 0; k < ts.size(); ++k)
    vs.push_back(c.inputs[k].differentiable() ? tp.param(ts[k]) : tp.input(ts[k]));
  GVar out = c.build(tp, vs);
  Run r{tp.value(out).to(Device::cpu), {}};
  if (!w.defined()) return r;
  tp.backward(sum(tp, mul(tp, out, tp.constant(B::device == Device::cpu ? w : w.to(B::device)))));
  for (std::size_t k = 0; k < ts.size(); ++k)
    r.grads.push_back(c.inputs[k].differentiable() ? tp.grad(vs[k]).to(Device::cpu) : Tensor());
  return r;
}

}  // namespace cuda_registry_test
using namespace cuda_registry_test;

TEST_CASE("cuda registry: every registry case on CUDA equals the CPU's, values and gradients") {
  const std::vector<reg::OpCase<cpu>> host = reg::cases<cpu>();
  const std::vector<reg::OpCase<cuda>> device = reg::cases<cuda>();
  for (const reg::OpCase<cpu>& hc : host) {
    const reg::OpCase<cuda>* dc = nullptr;
    for (const reg::OpCase<cuda>& d : device)
      if (d.name == hc.name) dc = &d;
    if (!dc) {
      CHECK_MESSAGE(hc.prim == Prim::flash_attention, "registry case " << hc.name << " is missing on CUDA");
      continue;
    }
    for (DType dt : {DType::f64, DType::f32}) {
      const std::vector<Tensor> in = reg::make_inputs(hc.inputs, dt, 51);
      const Run probe = run(hc, in, Tensor());
      const Tensor w = is_floating(probe.out.dtype()) ? test::random_tensor(probe.out.shape(), dt, 52) : Tensor();
      const Run a = run(hc, in, w), b = run(*dc, in, w);
      const double tol = dt == DType::f64 ? hc.tol.cuda64 : hc.tol.cuda32;
      expect_close("registry " + hc.name + " out", a.out, b.out, tol);
      for (std::size_t k = 0; k < a.grads.size(); ++k)
        if (a.grads[k].defined())
          expect_close("registry " + hc.name + " grad " + std::to_string(k), a.grads[k], b.grads[k], tol);
    }
  }
}
