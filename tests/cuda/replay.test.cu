// SPDX-License-Identifier: MIT OR Apache-2.0
// CUDA tensors and memory (copies, the caching allocator, model.to), CUDA-graph replay (equal to
// eager bit for bit, no device allocation per replayed step, re-capture on change), and full
// training steps (compiled, through a graph) against the CPU.
#include "cuda_check.hpp"

using namespace nn;
using namespace nn::test::gpu;

// (A named namespace: NN_MODULE's members in an anonymous one draw nvcc's unused-function warnings.)
namespace cuda_replay_test {

struct Net {
  Embedding emb;
  RmsNorm norm;
  Linear l1, l2;
  Dropout drop{0.1};
  template <class B>
  GVar operator()(GTape<B>& tp, GVar ids) const {
    GVar h = norm(tp, emb(tp, ids));               // (B, T, 16)
    h = drop(tp, silu(tp, l1(tp, h)));             // (B, T, 32)
    return l2(tp, h);                              // (B, T, 24): logits
  }
  NN_MODULE(Net, emb, norm, l1, l2, drop)
};

Net make_net(DType dt, std::uint64_t seed) {
  random::seed(seed);
  Net n{Embedding(24, 16), RmsNorm(16), Linear(16, 32), Linear(32, 24), Dropout(0.1)};
  n.to(dt);
  return n;
}

template <class B>
GVar loss_fn(GTape<B>& tp, const Net& m, GVar ids, GVar targets) {
  return cross_entropy(tp, m(tp, ids), targets);
}

std::vector<Tensor> params_of(const Net& m) {
  std::vector<Tensor> out;
  for (auto& [p, t] : m.parameters()) out.push_back(t.device() == Device::cpu ? t : host(t));
  return out;
}

}  // namespace cuda_replay_test
using namespace cuda_replay_test;

TEST_CASE("cuda memory: device tensors, host<->device copies, the caching allocator") {
  Tensor h = rnd({3, 1000}, DType::f64);
  Tensor d = Tensor::empty({3, 1000}, DType::f64, Device::cuda);
  CHECK(d.device() == Device::cuda);
  d = h.to(Device::cuda);
  CHECK(d.device() == Device::cuda);
  expect_bitwise("host->device->host round trip", h, host(d));
  expect_bitwise("device clone", h, host(d.clone()));
  CHECK_THROWS_AS(d.data<double>(), nn::Error);  // host access to device memory is refused
  CHECK_THROWS_AS(d.item(), nn::Error);

  // A freed block is reused by the next request of its size class: no cudaMalloc.
  { Tensor warm = cuda::alloc({1 << 20}, DType::f32); }
  const CudaMemoryStats before = cuda::memory_stats();
  for (int i = 0; i < 100; ++i) {
    Tensor t = cuda::alloc({1 << 20}, DType::f32);
    cuda::fill(t, 1.0);
  }
  const CudaMemoryStats after = cuda::memory_stats();
  CHECK(after.malloc_calls == before.malloc_calls);
  CHECK(after.alloc_calls == before.alloc_calls + 100);
  CHECK(after.bytes_in_use == before.bytes_in_use);
  cuda::synchronize();
}

TEST_CASE("cuda modules: model.to(cuda) and back, bit for bit; optimizer state on the device") {
  Net cpu_net = make_net(DType::f64, 7);
  Net net = cpu_net;
  net.to(Device::cuda);
  for (auto& [path, t] : net.parameters()) CHECK_MESSAGE(t.device() == Device::cuda, path);
  net.to(Device::cpu);
  const auto a = params_of(cpu_net), b = params_of(net);
  bool same = a.size() == b.size();
  for (std::size_t i = 0; same && i < a.size(); ++i) same = same_bits(a[i], b[i]);
  record("model.to(cuda).to(cpu) round trip", "float64", same ? 0.0 : INFINITY, 0);
}

TEST_CASE("cuda modules: weights load into a model on the device; LoraLinear::fused<cuda> equals the CPU's") {
  // load_weights copies through the tensor's device hook into the existing device storage
  Net src = make_net(DType::f64, 11);
  Net net = make_net(DType::f64, 12);
  net.to(Device::cuda);
  const Tensor before = net.l1.weight.value;  // the device storage a loaded model keeps
  net.load_weights(src.parameters());
  CHECK(net.l1.weight.value.shares_storage(before));
  const auto a = params_of(src), b = params_of(net);
  bool same = a.size() == b.size();
  for (std::size_t i = 0; same && i < a.size(); ++i) same = same_bits(a[i], b[i]);
  record("load_weights into a model on the device", "float64", same ? 0.0 : INFINITY, 0);

  random::seed(5);
  LoraLinear l = LoraLinear::from_base(Linear(12, 10), 4).scale(2.0);
  l.lora_b.value = rnd({4, 10}, DType::f32);  // lora_b starts at zero; give the merge something to add
  const Linear want = l.fused();
  LoraLinear d = l;
  d.to(Device::cuda);
  expect_close("LoraLinear::fused<cuda> against the CPU's", want.weight.value, d.fused<cuda>().weight.value);
}

TEST_CASE("cuda graph: replay equals eager bit for bit, allocates nothing, re-captures on change") {
  for (DType dt : float_dtypes()) {
    const std::string dn = dtype_name(dt);
    Net net = make_net(dt, 11);
    net.to(Device::cuda);
    Tensor ids0 = dev(ids({4, 6}, DType::i32, 0, 24)), tg0 = dev(ids({4, 6}, DType::i64, 0, 24));
    GTape<cuda> tp;
    GVar in_ids = tp.input(ids0), in_t = tp.input(tg0);
    GVar loss = loss_fn(tp, net, in_ids, in_t);
    tp.backward(loss);
    const std::optional<GVar> w1 = tp.find_param(net.l1.weight.value), e = tp.find_param(net.emb.weight.value);
    REQUIRE(w1.has_value());
    REQUIRE(e.has_value());

    CudaGraphReplay graph(tp);
    for (int step = 0; step < 4; ++step) {
      Tensor bi = ids({4, 6}, DType::i32, 0, 24), bt = ids({4, 6}, DType::i64, 0, 24);
      const std::uint64_t s = next_seed();
      // eager: the tape's own replay with the batch in the slots, keys from seed s
      tp.set(in_ids, dev(bi));
      tp.set(in_t, dev(bt));
      random::seed(s);
      tp.refresh_keys();
      tp.replay();
      Tensor l_e = host(tp.value(loss)), g_e = host(tp.grad(*w1)), ge_e = host(tp.grad(*e));
      // graph: the same batch through set(), the same keys
      graph.set(in_ids, bi);
      graph.set(in_t, dev(bt));
      random::seed(s);
      tp.refresh_keys();
      graph.replay();
      const std::string k = " step " + std::to_string(step);
      expect_bitwise("graph replay == eager: loss" + k, l_e, tp.value(loss));
      expect_bitwise("graph replay == eager: l1 grad" + k, g_e, tp.grad(*w1));
      expect_bitwise("graph replay == eager: embedding grad" + k, ge_e, tp.grad(*e));
    }
    // tp.set() above pointed the slots at new tensors each step, so the graph was captured anew
    // at step 0 (owned buffers); from then on set() keeps them.
    const int captures = graph.captures();

    // Steady state: set + refresh + replay allocates no device memory at all.
    Tensor bi = dev(ids({4, 6}, DType::i32, 0, 24)), bt = dev(ids({4, 6}, DType::i64, 0, 24));
    graph.set(in_ids, bi);
    graph.set(in_t, bt);
    tp.refresh_keys();
    graph.replay();
    const int steady = graph.captures();
    const CudaMemoryStats before = cuda::memory_stats();
    for (int r = 0; r < 20; ++r) {
      graph.set(in_ids, bi);
      graph.set(in_t, bt);
      tp.refresh_keys();
      graph.replay();
    }
    const CudaMemoryStats after = cuda::memory_stats();
    record("graph replay x20: cudaMalloc calls " + dn, dn, static_cast<double>(after.malloc_calls - before.malloc_calls), 0);
    record("graph replay x20: device allocations " + dn, dn, static_cast<double>(after.alloc_calls - before.alloc_calls), 0);
    CHECK(graph.captures() == steady);
    CHECK(captures >= 1);

    // A tp.set() to another tensor changes an address: the next replay captures again, once.
    tp.set(in_ids, dev(ids({4, 6}, DType::i32, 0, 24)));
    graph.replay();
    graph.replay();
    CHECK(graph.captures() == steady + 1);
    // An out-of-range id inside the graph raises after the replay.
    graph.set(in_ids, Tensor::full({4, 6}, 99, DType::i32));
    CHECK_THROWS_WITH_AS(graph.replay(), doctest::Contains("out of range"), nn::Error);
  }
}

TEST_CASE("cuda training: compiled steps through a CUDA graph equal the CPU's, and equal eager CUDA steps bit for bit") {
  for (DType dt : float_dtypes()) {
    const std::string dn = dtype_name(dt);
    Net cpu_net = make_net(dt, 21), gpu_net = cpu_net, eager_net = cpu_net;
    gpu_net.to(Device::cuda);
    eager_net.to(Device::cuda);
    AdamW<cpu> opt_c(3e-2);
    AdamW<cuda> opt_g(3e-2), opt_e(3e-2);
    opt_c.bias_correction();
    opt_g.bias_correction();
    opt_e.bias_correction();
    auto step_c = compile<2>(cpu_net, opt_c, [](GTape<cpu>& tp, const Net& m, GVar x, GVar y) { return loss_fn(tp, m, x, y); });
    auto step_g = compile<2, cuda>(gpu_net, opt_g, [](GTape<cuda>& tp, const Net& m, GVar x, GVar y) { return loss_fn(tp, m, x, y); });
    const std::uint64_t seed = next_seed();
    double worst_loss = 0;
    bool eager_same = true;
    for (int i = 0; i < 8; ++i) {
      const std::int64_t T = i < 5 ? 6 : 9;  // a new sequence length at step 5: both re-record once
      Tensor x = ids({4, T}, DType::i32, 0, 24), y = ids({4, T}, DType::i64, 0, 24);
      random::seed(seed + static_cast<std::uint64_t>(i));
      Tensor lc = step_c(x, y);
      random::seed(seed + static_cast<std::uint64_t>(i));
      Tensor lg = step_g(dev(x), dev(y));
      worst_loss = std::max(worst_loss, err_of(lc, lg));
      // eager CUDA: value_and_grad + update, the same keys
      random::seed(seed + static_cast<std::uint64_t>(i));
      Tensor dx = dev(x), dy = dev(y);
      auto [le, grads] = value_and_grad<cuda>(eager_net, [&](GTape<cuda>& tp, const Net& m) {
        return loss_fn(tp, m, tp.constant(dx), tp.constant(dy));
      });
      opt_e.update(eager_net, grads);
      eager_same = eager_same && same_bits(le, lg);
    }
    record("training 8 AdamW steps: loss CUDA graph vs CPU", dn, worst_loss, tol_for(dt));
    const auto pc = params_of(cpu_net), pg = params_of(gpu_net), pe = params_of(eager_net);
    double worst_p = 0;
    bool same_p = true;
    for (std::size_t i = 0; i < pc.size(); ++i) {
      worst_p = std::max(worst_p, err_of(pc[i], pg[i]));
      same_p = same_p && same_bits(pg[i], pe[i]);
    }
    record("training 8 AdamW steps: params CUDA graph vs CPU", dn, worst_p, tol_for(dt));
    record("training: compiled (graph) loss == eager CUDA loss, bitwise", dn, eager_same ? 0.0 : INFINITY, 0);
    record("training: compiled (graph) params == eager CUDA params, bitwise", dn, same_p ? 0.0 : INFINITY, 0);
    CHECK(step_c.recordings() == 2);
    CHECK(step_g.recordings() == 2);
  }
}

TEST_CASE("cuda training: every optimizer on device parameters equals the CPU's (two updates)") {
  for (DType dt : float_dtypes()) {
    const std::string dn = dtype_name(dt);
    auto check_opt = [&](const std::string& name, auto& oc, auto& og) {
      Net cn = make_net(dt, 31), gn = cn;
      gn.to(Device::cuda);
      for (int i = 0; i < 2; ++i) {
        Tensor x = ids({2, 5}, DType::i32, 0, 24), y = ids({2, 5}, DType::i64, 0, 24);
        Tensor dx = dev(x), dy = dev(y);
        cn.drop = Dropout(0.0);
        gn.drop = Dropout(0.0);
        auto [lc, gc] = value_and_grad<cpu>(cn, [&](GTape<cpu>& tp, const Net& m) { return loss_fn(tp, m, tp.constant(x), tp.constant(y)); });
        auto [lg, gg] = value_and_grad<cuda>(gn, [&](GTape<cuda>& tp, const Net& m) { return loss_fn(tp, m, tp.constant(dx), tp.constant(dy)); });
        oc.update(cn, gc);
        og.update(gn, gg);
      }
      const auto pc = params_of(cn), pg = params_of(gn);
      double worst = 0;
      for (std::size_t i = 0; i < pc.size(); ++i) worst = std::max(worst, err_of(pc[i], pg[i]));
      record("optimizer " + name + " two updates: params CUDA vs CPU", dn, worst, dt == DType::f64 ? 1e-12 : 1e-5);
    };
    { Sgd<cpu> a(0.1); Sgd<cuda> b(0.1); a.momentum(0.9).nesterov(); b.momentum(0.9).nesterov(); check_opt("sgd", a, b); }
    { Adam<cpu> a(1e-2); Adam<cuda> b(1e-2); check_opt("adam", a, b); }
    { Lion<cpu> a(1e-3); Lion<cuda> b(1e-3); check_opt("lion", a, b); }
    { Muon<cpu> a(2e-2); Muon<cuda> b(2e-2); check_opt("muon", a, b); }
    // clip_grad_norm's global norm on the device (sum_squares)
    Net cn = make_net(dt, 41), gn = cn;
    gn.to(Device::cuda);
    cn.drop = Dropout(0.0);
    gn.drop = Dropout(0.0);
    Tensor x = ids({2, 5}, DType::i32, 0, 24), y = ids({2, 5}, DType::i64, 0, 24), dx = dev(x), dy = dev(y);
    auto [lc, gc] = value_and_grad<cpu>(cn, [&](GTape<cpu>& tp, const Net& m) { return loss_fn(tp, m, tp.constant(x), tp.constant(y)); });
    auto [lg, gg] = value_and_grad<cuda>(gn, [&](GTape<cuda>& tp, const Net& m) { return loss_fn(tp, m, tp.constant(dx), tp.constant(dy)); });
    const double nc = clip_grad_norm<cpu>(gc, 0.1).second, ng = clip_grad_norm<cuda>(gg, 0.1).second;
    record("clip_grad_norm global norm CUDA vs CPU", dn, std::abs(nc - ng) / nc, dt == DType::f64 ? 1e-12 : 1e-5);
  }
}

TEST_CASE("cuda training: gradient accumulation (tree_add<cuda>, tree_scale<cuda>) equals the CPU's, then one update") {
  // What finetune's --grad-accumulation-steps does per micro-batch, on device gradient trees.
  for (DType dt : float_dtypes()) {
    const std::string dn = dtype_name(dt);
    Net cn = make_net(dt, 51), gn = cn;
    gn.to(Device::cuda);
    cn.drop = Dropout(0.0);
    gn.drop = Dropout(0.0);
    std::optional<Net> sc, sg;
    for (int k = 0; k < 3; ++k) {
      Tensor x = ids({2, 5}, DType::i32, 0, 24), y = ids({2, 5}, DType::i64, 0, 24), dx = dev(x), dy = dev(y);
      auto [lc, gc] = value_and_grad<cpu>(cn, [&](GTape<cpu>& tp, const Net& m) { return loss_fn(tp, m, tp.constant(x), tp.constant(y)); });
      auto [lg, gg] = value_and_grad<cuda>(gn, [&](GTape<cuda>& tp, const Net& m) { return loss_fn(tp, m, tp.constant(dx), tp.constant(dy)); });
      if (!sc) sc = std::move(gc);
      else tree_add(*sc, gc);
      if (!sg) sg = std::move(gg);
      else tree_add<cuda>(*sg, gg);
    }
    tree_scale(*sc, 1.0 / 3);
    tree_scale<cuda>(*sg, 1.0 / 3);
    const auto gc = params_of(*sc), gg = params_of(*sg);
    double worst = 0;
    for (std::size_t i = 0; i < gc.size(); ++i) worst = std::max(worst, err_of(gc[i], gg[i]));
    record("tree_add/tree_scale<cuda> over 3 micro-batches: grads CUDA vs CPU", dn, worst, dt == DType::f64 ? 1e-12 : 1e-5);
    AdamW<cpu> oc(1e-2);
    AdamW<cuda> og(1e-2);
    oc.update(cn, *sc);
    og.update(gn, *sg);
    const auto pc = params_of(cn), pg = params_of(gn);
    worst = 0;
    for (std::size_t i = 0; i < pc.size(); ++i) worst = std::max(worst, err_of(pc[i], pg[i]));
    record("accumulated AdamW update: params CUDA vs CPU", dn, worst, dt == DType::f64 ? 1e-12 : 1e-5);
  }
}
