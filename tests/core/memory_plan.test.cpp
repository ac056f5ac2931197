// SPDX-License-Identifier: MIT OR Apache-2.0
// GTape::plan_memory (what a compiled step does on the CPU): a deferred recording, planned and
// replayed, gives the loss and every parameter gradient of an eager tape bit for bit, on random
// graphs over every primitive whose OpDef says which values its vjp reads; the plan holds less
// than the eager tape; planned and deferred nodes cannot be read.
#include "support/check.hpp"

#include <functional>
#include <random>

namespace core_memory_plan {  // one unity source with the other core files: its names stay its own

using namespace nn;

namespace {

struct Params {
  Tensor p0, p1, p2, w, v;  // p*: (4, 6); w: (6, 6); v: (6)
  explicit Params(DType dt, std::uint64_t seed)
      : p0(test::random_tensor({4, 6}, dt, seed)), p1(test::random_tensor({4, 6}, dt, seed + 1)),
        p2(test::random_tensor({4, 6}, dt, seed + 2)), w(test::random_tensor({6, 6}, dt, seed + 3)),
        v(test::random_tensor({6}, dt, seed + 4)) {}
};

// A random graph of `ops` nodes over the params, every value (4, 6); the loss sums a few of
// them. The same seed builds the same graph on any tape.
GVar random_graph(GTape<cpu>& tp, const Params& ps, std::uint32_t seed, int ops) {
  std::mt19937 rng(seed);
  auto pick = [&](std::size_t n) { return static_cast<std::size_t>(rng() % n); };
  std::vector<GVar> pool{tp.param(ps.p0), tp.param(ps.p1), tp.param(ps.p2, false)};
  const GVar w = tp.param(ps.w), v = tp.param(ps.v);
  const DType dt = ps.p0.dtype();
  // mostly one of the last few values, so that most values die early and their blocks get reused
  auto any = [&] { return pool[pick(4) ? pool.size() - 1 - pick(std::min<std::size_t>(3, pool.size())) : pick(pool.size())]; };
  auto positive = [&](GVar x) { return add_scalar(tp, mul(tp, x, x), 0.5); };
  const Unary unaries[] = {Unary::neg, Unary::exp, Unary::log, Unary::sqrt, Unary::rsqrt, Unary::tanh, Unary::sigmoid,
                           Unary::relu, Unary::abs, Unary::pow, Unary::silu, Unary::gelu, Unary::gelu_approx,
                           Unary::gelu_fast, Unary::scale, Unary::add_scalar};
  const Binary binaries[] = {Binary::add, Binary::sub, Binary::mul, Binary::div, Binary::maximum, Binary::minimum};
  for (int i = 0; i < ops; ++i) {
    GVar a = any(), b = any(), y;
    switch (pick(14)) {
      case 0: {
        const Unary u = unaries[pick(std::size(unaries))];
        const bool needs_positive = u == Unary::log || u == Unary::sqrt || u == Unary::rsqrt || u == Unary::pow;
        y = unary(tp, u, needs_positive ? positive(a) : (u == Unary::exp ? tanh(tp, a) : a), 1.5);
        break;
      }
      case 1: {
        const Binary op = binaries[pick(std::size(binaries))];
        y = binary(tp, op, a, op == Binary::div ? positive(b) : b);
        break;
      }
      case 2: y = binary(tp, binaries[pick(4)], a, v); break;  // broadcast (6) over (4, 6)
      case 3: {
        std::vector<double> m(24, 0.0);
        for (std::size_t k = 0; k < m.size(); k += 3) m[k] = 1.0;
        y = where(tp, tp.constant(Tensor::from_doubles({4, 6}, m, dt)), a, b);
        break;
      }
      case 4: y = pick(2) ? matmul(tp, a, w) : matmul(tp, matmul(tp, a, b, false, true), any()); break;
      case 5: y = transpose(tp, reshape(tp, a, {6, 4})); break;
      case 6: y = concat(tp, {slice(tp, a, 1, 0, 2), slice(tp, b, 1, 2, 6)}, 1); break;
      case 7: y = add(tp, a, broadcast_to(tp, sum(tp, b, {0}, true), Shape{4, 6})); break;
      case 8: y = mul(tp, a, broadcast_to(tp, max(tp, b, 1, true), Shape{4, 6})); break;
      case 9: y = pick(2) ? softmax(tp, a) : log_softmax(tp, a); break;
      case 10: y = fused_rmsnorm(tp, a, v, 1e-5); break;
      case 11: y = fused_swiglu(tp, a, b); break;
      case 12: y = add(tp, stop_gradient(tp, a), b); break;
      default: y = scale(tp, a, 0.5); break;
    }
    pool.push_back(y);
  }
  GVar loss = sum(tp, mul(tp, pool.back(), pool.back()));
  for (int k = 0; k < 3; ++k) loss = add(tp, loss, mean(tp, any()));
  return loss;
}

// A fresh value of x's shape whose vjp reads x (so x's block is not free until then).
GVar sin_like(GTape<cpu>& tp, GVar x) { return tanh(tp, scale(tp, x, 0.9)); }

std::string bytes_of(const Tensor& t) { return std::string(static_cast<const char*>(t.raw()), t.nbytes()); }

// The nn::Error f raises (empty when it raises none).
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

TEST_CASE("plan_memory: a deferred, planned, replayed tape equals the eager one bit for bit (200 random graphs)") {
  int planned_smaller = 0;
  for (DType dt : {DType::f32, DType::f64})
    for (std::uint32_t seed = 0; seed < 100; ++seed) {
      CAPTURE(dtype_name(dt));
      CAPTURE(seed);
      const Params ps(dt, seed * 7 + 1);
      GTape<cpu> eager;
      const GVar le = random_graph(eager, ps, seed, 24);
      eager.backward(le);
      GTape<cpu> planned;
      const GVar lp = planned.record_planned([&] { return random_graph(planned, ps, seed, 24); });
      for (int rep = 0; rep < 2; ++rep) {  // the planned run, then a replay into the same blocks
        if (rep) planned.replay();
        CHECK(bytes_of(planned.value(lp)) == bytes_of(eager.value(le)));
        for (const Tensor* t : {&ps.p0, &ps.p1, &ps.w, &ps.v}) {
          const auto ge = eager.find_param(*t), gp = planned.find_param(*t);
          REQUIRE(ge.has_value() == gp.has_value());
          if (ge) CHECK(bytes_of(planned.grad(*gp)) == bytes_of(eager.grad(*ge)));
        }
      }
      planned_smaller += planned.bytes() < eager.bytes();
    }
  CHECK(planned_smaller > 150);  // small graphs can have nothing to share
}

TEST_CASE("plan_memory: every primitive's vjp_reads keeps what its vjp reads (inputs that die at once, blocks reused)") {
  // y = op(a, b) for intermediates a, b that nothing else uses; then a chain of fresh values that
  // takes the first free blocks, so an input the plan wrongly frees is overwritten before y's vjp.
  using Op = std::function<GVar(GTape<cpu>&, GVar, GVar, GVar w, GVar v)>;
  std::vector<std::pair<std::string, Op>> ops;
  for (Unary u : {Unary::neg, Unary::exp, Unary::log, Unary::sqrt, Unary::rsqrt, Unary::tanh, Unary::sigmoid, Unary::relu,
                  Unary::abs, Unary::pow, Unary::silu, Unary::gelu, Unary::gelu_approx, Unary::gelu_fast, Unary::scale,
                  Unary::add_scalar})
    ops.emplace_back(unary_name(u), [u](GTape<cpu>& tp, GVar a, GVar, GVar, GVar) {
      return unary(tp, u, add_scalar(tp, a, 2.0), 1.5);  // a in (1, 3): every op defined
    });
  for (Binary o : {Binary::add, Binary::sub, Binary::mul, Binary::div, Binary::maximum, Binary::minimum}) {
    ops.emplace_back(binary_name(o), [o](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) { return binary(tp, o, a, add_scalar(tp, b, 2.0)); });
    ops.emplace_back(std::string(binary_name(o)) + " broadcast",
                     [o](GTape<cpu>& tp, GVar a, GVar, GVar, GVar v) { return binary(tp, o, a, add_scalar(tp, v, 2.0)); });
  }
  ops.emplace_back("matmul", [](GTape<cpu>& tp, GVar a, GVar b, GVar w, GVar) { return matmul(tp, matmul(tp, a, b, false, true), matmul(tp, a, w)); });
  ops.emplace_back("where", [](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) {
    return where(tp, tp.constant(Tensor::full({4, 6}, 1.0, tp.dtype(a))), a, b);
  });
  ops.emplace_back("reshape permute", [](GTape<cpu>& tp, GVar a, GVar, GVar, GVar) { return transpose(tp, reshape(tp, a, {6, 4})); });
  ops.emplace_back("slice concat", [](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) {
    return concat(tp, {slice(tp, a, 1, 0, 2), slice(tp, b, 1, 2, 6)}, 1);
  });
  ops.emplace_back("sum broadcast", [](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) {
    return mul(tp, b, broadcast_to(tp, sum(tp, a, {0}, true), Shape{4, 6}));
  });
  ops.emplace_back("max", [](GTape<cpu>& tp, GVar a, GVar, GVar, GVar) { return broadcast_to(tp, max(tp, a, 1, true), Shape{4, 6}); });
  ops.emplace_back("cross_entropy", [](GTape<cpu>& tp, GVar a, GVar, GVar, GVar) {  // its vjp writes over the logits
    const GVar ce = softmax_cross_entropy(tp, a, tp.constant(Tensor::from<std::int64_t>({4}, {0, 5, 2, 3})), Reduction::none);
    return broadcast_to(tp, reshape(tp, ce, {4, 1}), Shape{4, 6});
  });
  // q (1, 4, 6) as 2 heads of 3, k and v one kv head of 3 each; a causal mask as an input
  auto attention_op = [](bool flash) {
    return [flash](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) {
      const GVar q = reshape(tp, a, {1, 4, 6}), k = reshape(tp, slice(tp, b, 1, 0, 3), {1, 4, 3}),
                 v = reshape(tp, slice(tp, b, 1, 3, 6), {1, 4, 3});
      if (flash) return reshape(tp, flash_attention(tp, q, k, v, 4, 2, 1, 3, 0.5, true), {4, 6});
      const GVar mask = mul(tp, tp.constant(Tensor::full({4, 4}, 1.0, tp.dtype(a))), tp.constant(causal_mask_fill(4, tp.dtype(a))));
      return reshape(tp, fused_attention(tp, q, k, v, mask, 4, 2, 1, 3, 0.5), {4, 6});
    };
  };
  ops.emplace_back("attention", attention_op(false));
  ops.emplace_back("flash_attention", attention_op(true));
  // the head (V 4, C 6) trainable: the vjp reads x and W; frozen: the forward forms x's gradient
  // and the vjp reads neither, so both may be overwritten before it runs
  for (const bool frozen : {false, true})
    ops.emplace_back(frozen ? "linear_cross_entropy frozen head" : "linear_cross_entropy",
                     [frozen](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) {
                       const GVar t = tp.constant(Tensor::from<std::int64_t>({4}, {0, 3, 2, -100}));
                       const GVar l = fused_linear_cross_entropy(tp, a, HeadVars(frozen ? stop_gradient(tp, b) : b), t);
                       return broadcast_to(tp, reshape(tp, l, {1, 1}), Shape{4, 6});
                     });
  ops.emplace_back("softmax", [](GTape<cpu>& tp, GVar a, GVar, GVar, GVar) { return softmax(tp, a); });
  ops.emplace_back("log_softmax", [](GTape<cpu>& tp, GVar a, GVar, GVar, GVar) { return log_softmax(tp, a); });
  ops.emplace_back("rmsnorm", [](GTape<cpu>& tp, GVar a, GVar, GVar, GVar v) { return fused_rmsnorm(tp, a, v, 1e-5); });
  ops.emplace_back("swiglu", [](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) { return fused_swiglu(tp, a, b); });
  ops.emplace_back("stop_gradient", [](GTape<cpu>& tp, GVar a, GVar b, GVar, GVar) { return mul(tp, stop_gradient(tp, a), b); });
  for (DType dt : {DType::f32, DType::f64})
    for (const auto& [name, op] : ops) {
      CAPTURE(name);
      CAPTURE(dtype_name(dt));
      const Params ps(dt, 11);
      auto build = [&](GTape<cpu>& tp) {
        const GVar a = scale(tp, tp.param(ps.p0), 0.7), b = scale(tp, tp.param(ps.p1), 0.7);  // no vjp reads these
        const GVar y = op(tp, a, b, tp.param(ps.w), tp.param(ps.v));
        GVar c = tp.param(ps.p2);
        for (int i = 0; i < 8; ++i) c = sin_like(tp, c);
        return sum(tp, mul(tp, y, c));
      };
      GTape<cpu> eager, planned;
      const GVar le = build(eager);
      eager.backward(le);
      const GVar lp = planned.record_planned([&] { return build(planned); });
      CHECK(bytes_of(planned.value(lp)) == bytes_of(eager.value(le)));
      for (const Tensor* t : {&ps.p0, &ps.p1, &ps.p2, &ps.w, &ps.v}) {
        const auto ge = eager.find_param(*t), gp = planned.find_param(*t);
        if (ge && gp) CHECK_MESSAGE(bytes_of(planned.grad(*gp)) == bytes_of(eager.grad(*ge)), "a gradient differs");
      }
    }
}

TEST_CASE("plan_memory: planned and deferred nodes are errors to read; the loss and leaves stay readable") {
  const Params ps(DType::f64, 3);
  GTape<cpu> tp;
  tp.defer_kernels(true);
  const GVar x = tp.param(ps.p0);
  const GVar h = tanh(tp, matmul(tp, x, tp.param(ps.w)));
  const GVar loss = sum(tp, mul(tp, h, h));
  CHECK(error_of([&] { (void)tp.value(h); }).find("recorded with its kernel deferred") != std::string::npos);
  CHECK(error_of([&] { tp.replay(); }).find("call plan_memory() first") != std::string::npos);
  tp.defer_kernels(false);
  tp.plan_memory(loss);
  tp.replay();
  CHECK(std::isfinite(tp.value(loss).item()));
  CHECK(tp.value(x).numel() == 24);
  CHECK(tp.grad(x).numel() == 24);
  CHECK(error_of([&] { (void)tp.value(h); }).find("memory-planned tape") != std::string::npos);
  CHECK(error_of([&] { (void)tp.grad(h); }).find("memory-planned tape") != std::string::npos);
}

TEST_CASE("plan_memory: a forward-only tape keeps only its output") {
  const Params ps(DType::f32, 5);
  GTape<cpu> eager, planned;
  auto build = [&](GTape<cpu>& tp) {
    GVar h = tp.constant(ps.p0);
    for (int i = 0; i < 6; ++i) h = tanh(tp, matmul(tp, h, tp.constant(ps.w)));
    return h;
  };
  const GVar ye = build(eager);
  const GVar yp = planned.record_planned([&] { return build(planned); });
  CHECK(bytes_of(planned.value(yp)) == bytes_of(eager.value(ye)));
  // Twelve (4, 6) values in the eager tape; the plan needs two blocks (an op's input and output).
  CHECK(planned.bytes() == 2 * 24 * sizeof(float) + 24 * sizeof(float));
}

}  // namespace core_memory_plan
