// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::distributed on device tensors (issue 18, item 9): with NN_WITH_NCCL (CMake defines it for
// test_cuda where nccl.h and libnccl are found; gpu_check.sh likewise), collectives and gradient
// averaging on nn::cuda tensors go through NCCL, at one rank too. A 1-rank NCCL group must equal
// no group bit for bit: all_sum and broadcast leave a tensor unchanged, and a compiled CUDA step
// whose gradients pass through GradientAverager (NCCL's pre-multiplied sum with factor 1) trains
// exactly the weights of the same step without it.
#include <nn/distributed.hpp>

#include "cuda_check.hpp"

using namespace nn;
using namespace nn::test::gpu;

namespace cuda_distributed_test {

struct Net {
  Embedding emb;
  RmsNorm norm;
  Linear l1, l2;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    return l2(tp, silu(tp, l1(tp, norm(tp, emb(tp, ids)))));  // (B, T, 24): logits
  }
  NN_MODULE(Net, emb, norm, l1, l2)
};

Net make_net(DType dt) {
  random::seed(7);
  Net n{Embedding(24, 16), RmsNorm(16), Linear(16, 32), Linear(32, 24)};
  n.to(dt);
  return n;
}

}  // namespace cuda_distributed_test
using namespace cuda_distributed_test;

TEST_CASE("cuda distributed: a 1-rank NCCL group equals no group, bit for bit") {
  const distributed::Group world;  // one process: NCCL still runs on device tensors
#if defined(NN_WITH_NCCL)
  const std::string path = "nccl";
#else
  const std::string path = "no NCCL (identity)";
#endif
  for (DType dt : float_dtypes()) {
    const std::string dn = dtype_name(dt);
    Tensor h = rnd({5, 7}, dt);
    Tensor d = dev(h);
    world.all_sum(d);
    record("distributed all_sum, 1 rank (" + path + ")", dn, same_bits(h, host(d)) ? 0.0 : INFINITY, 0);
    world.broadcast(d, 0);
    record("distributed broadcast, 1 rank (" + path + ")", dn, same_bits(h, host(d)) ? 0.0 : INFINITY, 0);

    Net plain = make_net(dt), reduced = plain;
    plain.to(Device::cuda);
    reduced.to(Device::cuda);
    AdamW<cuda> opt_p(3e-2), opt_r(3e-2);
    auto fn = [](GTape<cuda>& tp, const Net& m, GVar x, GVar y) { return cross_entropy(tp, m(tp, x), y); };
    auto step_p = compile<2, cuda>(plain, opt_p, fn);
    auto step_r = compile<2, cuda>(reduced, opt_r, fn);
    distributed::GradientAverager avg(world);
    step_r.reduce_gradients(avg);
    bool same_loss = true;
    for (int i = 0; i < 4; ++i) {
      Tensor x = dev(ids({4, 6}, DType::i32, 0, 24)), y = dev(ids({4, 6}, DType::i64, 0, 24));
      avg.set_weight(24.0);
      same_loss = same_loss && same_bits(host(step_p(x, y)), host(step_r(x, y)));
    }
    bool same_p = true;
    auto pp = plain.parameters(), pr = reduced.parameters();
    for (std::size_t i = 0; i < pp.size(); ++i) same_p = same_p && same_bits(host(pp[i].second), host(pr[i].second));
    record("distributed compiled step, 1-rank averager == none: losses (" + path + ")", dn, same_loss ? 0.0 : INFINITY, 0);
    record("distributed compiled step, 1-rank averager == none: params (" + path + ")", dn, same_p ? 0.0 : INFINITY, 0);
    CHECK(avg.total_weight() == 24.0);
  }
}
