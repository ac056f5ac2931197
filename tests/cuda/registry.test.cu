// SPDX-License-Identifier: MIT OR Apache-2.0
// The op registry (tests/support/op_registry.hpp) on CUDA: every case the CPU runs, built by the
// same builder on a GTape<cuda> from the same inputs, gives the CPU's output and gradients
// (float64 and float32). A case missing on CUDA fails, unless the CUDA policy lacks the primitive
// (flash attention, linear_cross_entropy).
#include "cuda_check.hpp"
#include "support/op_registry.hpp"

using namespace nn;
using namespace nn::test::gpu;
namespace reg = nn::test::registry;

TEST_CASE("cuda registry: every registry case on CUDA equals the CPU's, values and gradients") {
  const std::vector<reg::OpCase<cpu>> host = reg::cases<cpu>();
  const std::vector<reg::OpCase<cuda>> device = reg::cases<cuda>();
  for (const reg::OpCase<cpu>& hc : host) {
    const reg::OpCase<cuda>* dc = nullptr;
    for (const reg::OpCase<cuda>& d : device)
      if (d.name == hc.name) dc = &d;
    if (!dc) {
      CHECK_MESSAGE((hc.prim == Prim::flash_attention || hc.prim == Prim::linear_cross_entropy),
                    "registry case " << hc.name << " is missing on CUDA");
      continue;
    }
    for (DType dt : {DType::f64, DType::f32}) {
      const std::vector<Tensor> in = reg::make_inputs(hc.inputs, dt, 51);
      const reg::Run probe = reg::run(hc, hc.build, in, Tensor());
      const Tensor w = is_floating(probe.out.dtype()) ? test::random_tensor(probe.out.shape(), dt, 52) : Tensor();
      const reg::Run a = reg::run(hc, hc.build, in, w), b = reg::run(*dc, dc->build, in, w);
      const double tol = dt == DType::f64 ? hc.tol.cuda64 : hc.tol.cuda32;
      expect_close("registry " + hc.name + " out", a.out, b.out, tol);
      for (std::size_t k = 0; k < a.grads.size(); ++k)
        if (a.grads[k].defined())
          expect_close("registry " + hc.name + " grad " + std::to_string(k), a.grads[k], b.grads[k], tol);
    }
  }
}
