// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::checkpoint (grad_checkpoint.hpp, the tape's checkpoint segments): gradients with
// checkpointing equal those without bit for bit (f32 and f64, dropout inside, LoRA over a frozen
// and over a quantized base), a compiled step replays the recomputation and equals the eager run,
// the tape holds less (measured by GTape::bytes()), and misuse is an nn::Error. The whole
// decoder's case is in tests/lm/grad_checkpoint.test.cpp.
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "support/check.hpp"

namespace core_grad_checkpoint {  // one unity source with the other core files: its names stay its own

using namespace nn;

namespace {

// A pre-norm residual block: x + down(dropout(silu(up(rmsnorm(x, g))))).
struct Block {
  Param g, up, down;
  Dropout drop;
  // x: (N, C) -> (N, C)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar h = rmsnorm(tp, x, nn::param(tp, g), 1e-6);
    h = silu(tp, matmul(tp, h, nn::param(tp, up), false, true));  // (N, 4C)
    return add(tp, x, matmul(tp, drop(tp, h), nn::param(tp, down), false, true));
  }
  NN_MODULE(Block, g, up, down, drop)
};

struct Net {
  std::vector<Block> blocks;
  Param head;       // (K, C)
  bool ckpt = false;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    for (const Block& b : blocks) x = ckpt ? checkpoint(tp, [&](GVar h) { return b(tp, h); }, x) : b(tp, x);
    return matmul(tp, x, nn::param(tp, head), false, true);  // (N, K)
  }
  NN_MODULE(Net, blocks, head, NN_STATIC(ckpt))
};

Net make_net(DType dt, int depth, std::int64_t C, double p) {
  Net n;
  for (int i = 0; i < depth; ++i) {
    const auto s = static_cast<std::uint64_t>(10 * i);
    n.blocks.push_back(Block{test::random_tensor({C}, dt, s + 1, 0.5, 1.5), test::random_tensor({4 * C, C}, dt, s + 2, -0.5, 0.5),
                             test::random_tensor({C, 4 * C}, dt, s + 3, -0.5, 0.5), Dropout(p)});
  }
  n.head = test::random_tensor({5, C}, dt, 999);
  return n;
}

// mean squared error against fixed targets
template <class B>
GVar loss_of(GTape<B>& tp, const Net& n, GVar x, GVar y) {
  GVar d = sub(tp, n(tp, x), y);
  return mean(tp, mul(tp, d, d));
}

// Every defined gradient of a tree, flattened with its bytes kept: (path, raw bytes).
template <class M>
std::vector<std::pair<std::string, std::string>> grad_bytes(const M& grads) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [p, t] : grads.parameters()) {
    if (!t.defined()) continue;
    out.emplace_back(p, std::string(static_cast<const char*>(t.raw()), t.nbytes()));
  }
  return out;
}

double norm_of(const Tensor& t) {
  double s = 0;
  for (double v : t.to_doubles()) s += v * v;
  return std::sqrt(s);
}

// Residual LoRA layers: x + silu(lora(x)) each.
struct Adapted {
  std::vector<LoraLinear> layers;
  bool ckpt = false;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    for (const LoraLinear& l : layers) {
      auto f = [&](GVar h) { return add(tp, h, silu(tp, l(tp, h))); };
      x = ckpt ? checkpoint(tp, f, x) : f(x);
    }
    return x;
  }
  NN_MODULE(Adapted, layers, NN_STATIC(ckpt))
};

}  // namespace

TEST_CASE_TEMPLATE("checkpoint: gradients equal those without it bit for bit, dropout inside", T, float, double) {
  const DType dt = detail::dtype_of<T>();
  Net net = make_net(dt, 4, 8, 0.25);
  const Tensor x = test::random_tensor({6, 8}, dt, 7), y = test::random_tensor({6, 5}, dt, 8);
  auto run = [&](bool ckpt) {
    net.ckpt = ckpt;
    random::seed(42);  // the same dropout keys for both runs
    return value_and_grad(net, [&](GTape<cpu>& tp, const Net& n) { return loss_of(tp, n, tp.constant(x), tp.constant(y)); });
  };
  auto [l0, g0] = run(false);
  auto [l1, g1] = run(true);
  CHECK(l0.item() == l1.item());
  const auto b0 = grad_bytes(g0), b1 = grad_bytes(g1);
  REQUIRE(b0.size() == b1.size());
  REQUIRE(b0.size() == 13);  // 4 blocks x (g, up, down) + head
  for (std::size_t i = 0; i < b0.size(); ++i) {
    CHECK_MESSAGE(b0[i].first == b1[i].first, b0[i].first);
    CHECK_MESSAGE(b0[i].second == b1[i].second, "gradient of " << b0[i].first << " differs with checkpointing");
  }
}

TEST_CASE("checkpoint: the tape holds one segment's intermediates, not all of them (GTape::bytes)") {
  Net net = make_net(DType::f32, 12, 32, 0.0);
  const Tensor x = test::random_tensor({64, 32}, DType::f32, 7), y = test::random_tensor({64, 5}, DType::f32, 8);
  auto held = [&](bool ckpt) {
    net.ckpt = ckpt;
    GTape<cpu> tp;
    GVar loss = loss_of(tp, net, tp.constant(x), tp.constant(y));
    const std::size_t after_forward = tp.bytes();
    tp.backward(loss);
    return std::pair{after_forward, tp.bytes()};
  };
  const auto [f0, b0] = held(false);
  const auto [f1, b1] = held(true);
  MESSAGE("tape bytes after forward / backward: " << f0 << " / " << b0 << " without, " << f1 << " / " << b1 << " with checkpointing");
  // 12 blocks, each with about 4 (64, 128) intermediates and their gradients; checkpointing keeps
  // the 12 block outputs, one block's worth of pool and the head.
  CHECK(f1 * 3 < f0);
  CHECK(b1 * 3 < b0);
}

TEST_CASE("checkpoint: LoRA over a frozen and over a quantized base gets the same, nonzero gradients") {
  for (bool quantized : {false, true}) {
    CAPTURE(quantized);
    random::seed(3);
    Adapted m;
    for (int i = 0; i < 3; ++i) {
      Linear base(64, 64);
      LoraLinear l = quantized ? LoraLinear::from_base(QuantizedLinear::from_linear(base), 4) : LoraLinear::from_base(base, 4);
      l.lora_b = test::random_tensor({4, 64}, DType::f32, 50 + static_cast<std::uint64_t>(i));  // a nonzero lora_a gradient
      m.layers.push_back(std::move(l));
    }
    m.freeze();
    m.unfreeze([](const std::string& p) { return p.ends_with("lora_a") || p.ends_with("lora_b"); });
    const Tensor x = test::random_tensor({4, 64}, DType::f32, 9);
    auto run = [&](bool ckpt) {
      m.ckpt = ckpt;
      return value_and_grad(m, [&](GTape<cpu>& tp, const Adapted& a) { return mean(tp, a(tp, tp.constant(x))); });
    };
    auto [l0, g0] = run(false);
    auto [l1, g1] = run(true);
    CHECK(l0.item() == l1.item());
    const auto b0 = grad_bytes(g0), b1 = grad_bytes(g1);
    REQUIRE(b0.size() == b1.size());
    int adapters = 0;
    for (std::size_t i = 0; i < b0.size(); ++i) CHECK_MESSAGE(b0[i].second == b1[i].second, b0[i].first);
    // never silently zero (the failure mode of checkpointing that treats parameters as constants)
    for (const auto& [p, t] : g1.parameters())
      if (p.find("lora_") != std::string::npos) {
        ++adapters;
        CHECK_MESSAGE(norm_of(t) > 0, p << "'s gradient is zero with checkpointing");
      }
    CHECK(adapters == 6);  // lora_a and lora_b of 3 layers
  }
}

TEST_CASE("checkpoint: a compiled step replays the recomputation and equals eager steps, fresh dropout masks each call") {
  Net eager = make_net(DType::f32, 3, 8, 0.3), compiled = make_net(DType::f32, 3, 8, 0.3);
  eager.ckpt = false;  // the eager reference without checkpointing: equality is bitwise regardless
  compiled.ckpt = true;
  Sgd opt_e(0.1), opt_c(0.1);
  auto step = compile<2>(compiled, opt_c, [](GTape<cpu>& tp, const Net& n, GVar x, GVar y) { return loss_of(tp, n, x, y); });
  random::seed(5);
  std::vector<Tensor> eager_losses;
  for (int i = 0; i < 4; ++i) {
    Tensor x = test::random_tensor({6, 8}, DType::f32, 100 + static_cast<std::uint64_t>(i));
    Tensor y = test::random_tensor({6, 5}, DType::f32, 200 + static_cast<std::uint64_t>(i));
    auto [l, g] = value_and_grad(eager, [&](GTape<cpu>& tp, const Net& n) { return loss_of(tp, n, tp.constant(x), tp.constant(y)); });
    opt_e.update(eager, g);
    eager_losses.push_back(l);
  }
  random::seed(5);
  for (int i = 0; i < 4; ++i) {
    Tensor x = test::random_tensor({6, 8}, DType::f32, 100 + static_cast<std::uint64_t>(i));
    Tensor y = test::random_tensor({6, 5}, DType::f32, 200 + static_cast<std::uint64_t>(i));
    CHECK(step(x, y).item() == eager_losses[static_cast<std::size_t>(i)].item());
  }
  CHECK(step.recordings() == 1);
  CHECK(test::flat_values(eager) == test::flat_values(compiled));
  // Turning checkpointing off is a structure change: one more recording, still equal.
  compiled.ckpt = false;
  Tensor x = test::random_tensor({6, 8}, DType::f32, 300), y = test::random_tensor({6, 5}, DType::f32, 301);
  step(x, y);
  CHECK(step.recordings() == 2);
}

TEST_CASE("checkpoint: misuse is an nn::Error, and a throwing segment leaves a working tape") {
  GTape<cpu> tp;
  Tensor w = test::random_tensor({3, 3}, DType::f64, 1);
  GVar x = tp.input(test::random_tensor({2, 3}, DType::f64, 2));
  GVar inner;
  GVar out = checkpoint(tp, [&](GVar h) {
    inner = tanh(tp, matmul(tp, h, tp.param(w), false, true));
    return mul(tp, inner, inner);
  }, x);
  test::check_error([&] { add(tp, inner, out); }, {"intermediate of a checkpoint segment", "return it from the segment"});
  test::check_error([&] { (void)tp.value(inner); }, {"tape.value", "checkpoint segment"});
  test::check_error([&] { checkpoint(tp, [&] { return checkpoint(tp, [&] { return tanh(tp, x); }); }); }, {"do not nest"});
  CHECK_THROWS_AS(checkpoint(tp, [&]() -> GVar {
    tanh(tp, out);
    throw std::runtime_error("inside");
  }), std::runtime_error);
  // The tape goes on: the output is usable, and backward reaches w through the segment.
  GVar loss = sum(tp, add(tp, out, tanh(tp, out)));
  tp.backward(loss);
  CHECK(norm_of(tp.grad(tp.param(w))) > 0);
}

}  // namespace core_grad_checkpoint
