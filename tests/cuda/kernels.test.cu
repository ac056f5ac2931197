// SPDX-License-Identifier: MIT OR Apache-2.0
// Every kernel of the BackendPolicy concept, nn::cuda against nn::cpu on the same fresh random
// inputs, float32 and float64: outputs NaN-poisoned before each run (or, for kernels that
// accumulate or write part of their output, started from the same random values on both sides).
#include "cuda_check.hpp"

using namespace nn;
using namespace nn::test::gpu;

namespace {

std::string tag(const std::string& kernel, const std::string& what) { return kernel + " " + what; }

/// Runs a kernel writing `out` on both backends: the CPU into a host tensor, CUDA into a device
/// tensor, both starting from `init` (poisoned when the kernel writes every element).
template <class F>
void both(const std::string& check, const Tensor& init, F&& f, double tol = -1) {
  Tensor hc = init.clone(), dc = dev(init);
  f(hc, dc);
  expect_close(check, hc, dc, tol);
}

}  // namespace

TEST_CASE("cuda kernels: fill, copy, cast") {
  for (DType dt : {DType::f32, DType::f64, DType::i32, DType::u8, DType::bf16, DType::f16, DType::i64}) {
    for (double v : {0.0, 1.5, -3.0}) {
      Tensor h = poisoned({3, 37}, dt), d = dev(h);
      cpu::fill(h, v);
      cuda::fill(d, v);
      expect_bitwise("fill " + std::to_string(v), h, d);
    }
  }
  for (DType dt : float_dtypes()) {
    Tensor x = rnd({5, 129}, dt);
    for (bool acc : {false, true})
      both(tag("copy", acc ? "acc" : "set"), acc ? rnd({5, 129}, dt) : poisoned({5, 129}, dt),
           [&](Tensor& h, Tensor& d) {
             cpu::copy(x, h, acc);
             cuda::copy(dev(x), d, acc);
           });
  }
  // an upload into a device buffer (how the tape refreshes random keys)
  {
    Tensor key = random::key(1234), d = dev(poisoned({2}, DType::u32));
    cuda::copy(key, d, false);
    expect_bitwise("copy host->device", key, d);
  }
  const std::pair<DType, DType> casts[] = {{DType::f32, DType::f64}, {DType::f64, DType::f32}, {DType::f32, DType::bf16},
                                           {DType::f32, DType::f16}, {DType::f64, DType::bf16}, {DType::f64, DType::f16},
                                           {DType::i64, DType::i32}, {DType::i32, DType::f32}, {DType::f64, DType::i64}};
  for (auto [from, to] : casts) {
    Tensor x = is_floating(from) ? rnd({7, 33}, from, -70000, 70000) : ids({7, 33}, from, -1000000, 1000000);
    if (from == DType::f32) {  // subnormals, halfway cases, infinities and NaN for the half rounding
      float* p = x.data<float>();
      p[0] = 1e-7f; p[1] = 6.1e-5f; p[2] = 65519.0f; p[3] = 65520.0f; p[4] = INFINITY; p[5] = NAN; p[6] = -0.0f;
      p[7] = 1.0f + 0x1p-8f; p[8] = 1.0f + 0x1p-11f; p[9] = 3e38f;
    }
    Tensor h = poisoned(x.shape(), to), d = dev(h);
    cpu::cast(x, h);
    cuda::cast(dev(x), d);
    // Float results compare as values (a NaN's payload may differ through a double); halves and
    // integers bit for bit.
    expect_close(std::string("cast ") + dtype_name(from) + "->" + dtype_name(to), h, d, 0.0);
  }
  Tensor bf = rnd({4, 9}, DType::f32).to(DType::bf16), h = poisoned({4, 9}, DType::f32), d = dev(h);
  cpu::cast(bf, h);
  cuda::cast(dev(bf), d);
  expect_bitwise("cast bfloat16->float32", h, d);
}

TEST_CASE("cuda kernels: unary and unary_vjp, every op") {
  const Unary ops[] = {Unary::neg,  Unary::exp,  Unary::log,  Unary::sqrt, Unary::rsqrt,       Unary::tanh,
                       Unary::sigmoid, Unary::relu, Unary::abs, Unary::pow, Unary::silu,       Unary::gelu,
                       Unary::gelu_approx, Unary::gelu_fast, Unary::scale, Unary::add_scalar};
  for (DType dt : float_dtypes()) {
    for (Unary op : ops) {
      const bool positive = op == Unary::log || op == Unary::sqrt || op == Unary::rsqrt || op == Unary::pow;
      const double arg = op == Unary::pow ? 2.5 : (op == Unary::scale ? -1.75 : 0.375);
      const Shape s{3, 5, 67};
      Tensor x = positive ? rnd(s, dt, 0.1, 4) : rnd(s, dt, -4, 4);
      Tensor hy = poisoned(s, dt), dy = dev(hy), dx = dev(x);
      cpu::unary(op, arg, x, hy);
      cuda::unary(op, arg, dx, dy);
      expect_close(tag(unary_name(op), "forward"), hy, dy);
      Tensor g = rnd(s, dt);
      for (bool acc : {false, true})
        both(tag(unary_name(op), acc ? "vjp acc" : "vjp"), acc ? rnd(s, dt) : poisoned(s, dt), [&](Tensor& h, Tensor& d) {
          cpu::unary_vjp(op, arg, x, hy, g, h, acc);
          cuda::unary_vjp(op, arg, dx, dy, dev(g), d, acc);
        });
    }
  }
}

TEST_CASE("cuda kernels: binary and binary_vjp with broadcasting") {
  const Binary ops[] = {Binary::add, Binary::sub, Binary::mul, Binary::div, Binary::maximum, Binary::minimum};
  struct Case {
    Shape a, b, y;
  };
  const Case cases[] = {{{4, 130}, {4, 130}, {4, 130}}, {{4, 130}, {130}, {4, 130}}, {{4, 1}, {1, 130}, {4, 130}},
                        {{2, 1, 3}, {4, 1}, {2, 4, 3}},  {{3, 7}, {}, {3, 7}},        {{}, {5}, {5}},
                        {{2, 3, 1, 5}, {3, 4, 1}, {2, 3, 4, 5}}};
  for (DType dt : float_dtypes()) {
    for (Binary op : ops) {
      for (const Case& c : cases) {
        Tensor a = rnd(c.a, dt, -2, 2), b = rnd(c.b, dt, 0.5, 2.5);  // b away from 0 for div
        const std::string shapes = c.a.str() + "," + c.b.str();
        Tensor hy = poisoned(c.y, dt), dy = dev(hy);
        cpu::binary(op, a, b, hy);
        cuda::binary(op, dev(a), dev(b), dy);
        expect_close(tag(binary_name(op), shapes), hy, dy);
        Tensor g = rnd(c.y, dt);
        for (int which : {0, 1})
          for (bool acc : {false, true})
            both(tag(binary_name(op), shapes + " vjp" + std::to_string(which) + (acc ? " acc" : "")),
                 acc ? rnd(c.y, dt) : poisoned(c.y, dt), [&](Tensor& h, Tensor& d) {
                   cpu::binary_vjp(op, which, a, b, g, h, acc);
                   cuda::binary_vjp(op, which, dev(a), dev(b), dev(g), d, acc);
                 });
      }
    }
  }
}

TEST_CASE("cuda kernels: sum_to, broadcast_to (every reduction layout)") {
  struct Case {
    Shape x, y;
  };
  const Case cases[] = {{{6, 7}, {1, 7}},         {{6, 7}, {6, 1}},        {{6, 7}, {}},          {{300, 1000}, {300, 1}},
                        {{1000, 300}, {300}},     {{3, 4, 5}, {4, 1}},     {{3, 4, 5}, {1, 4, 1}}, {{2, 3, 4, 5}, {3, 1, 1}},
                        {{2, 3, 4, 5}, {2, 1, 4, 1}}, {{5, 1, 3}, {1, 1, 3}}, {{4096, 3}, {1, 3}},   {{7}, {1}}};
  for (DType dt : float_dtypes()) {
    for (const Case& c : cases) {
      Tensor x = rnd(c.x, dt);
      for (bool acc : {false, true}) {
        both(tag("sum_to", c.x.str() + "->" + c.y.str() + (acc ? " acc" : "")), acc ? rnd(c.y, dt) : poisoned(c.y, dt),
             [&](Tensor& h, Tensor& d) {
               cpu::sum_to(x, h, 0.5, acc);
               cuda::sum_to(dev(x), d, 0.5, acc);
             });
        Tensor small = rnd(c.y, dt);
        both(tag("broadcast_to", c.y.str() + "->" + c.x.str() + (acc ? " acc" : "")), acc ? rnd(c.x, dt) : poisoned(c.x, dt),
             [&](Tensor& h, Tensor& d) {
               cpu::broadcast_to(small, h, -1.25, acc);
               cuda::broadcast_to(dev(small), d, -1.25, acc);
             });
      }
    }
  }
}

TEST_CASE("cuda kernels: where and where_vjp (mask dtypes, broadcasting)") {
  for (DType dt : float_dtypes()) {
    for (DType mt : {DType::u8, dt, DType::i32}) {
      Tensor mask = ids({4, 1, 9}, DType::i64, 0, 2).to(mt);
      Tensor a = rnd({4, 3, 9}, dt), b = rnd({9}, dt);
      const std::string m = std::string("mask ") + dtype_name(mt);
      Tensor hy = poisoned({4, 3, 9}, dt), dy = dev(hy);
      cpu::where(mask, a, b, hy);
      cuda::where(dev(mask), dev(a), dev(b), dy);
      expect_close(tag("where", m), hy, dy);
      Tensor g = rnd({4, 3, 9}, dt);
      for (int which : {0, 1})
        for (bool acc : {false, true})
          both(tag("where_vjp", m + " branch " + std::to_string(which) + (acc ? " acc" : "")),
               acc ? rnd({4, 3, 9}, dt) : poisoned({4, 3, 9}, dt), [&](Tensor& h, Tensor& d) {
                 cpu::where_vjp(mask, g, which, h, acc);
                 cuda::where_vjp(dev(mask), dev(g), which, d, acc);
               });
    }
  }
}

TEST_CASE("cuda kernels: max_axis and its vjp (ties, NaN)") {
  for (DType dt : float_dtypes()) {
    for (int axis : {0, 1, 2}) {
      Tensor x = rnd({3, 4, 50}, dt);
      std::vector<double> v = x.to_doubles();
      v[5] = v[6] = 9.0;  // a tie: the first index wins
      v[70] = NAN;        // NaN propagates
      x = Tensor::from_doubles(x.shape(), v, dt);
      Shape ys = x.shape();
      ys[axis] = 1;
      Tensor hy = poisoned(ys, dt), hi = poisoned(ys, DType::i32), dy = dev(hy), di = dev(hi);
      cpu::max_axis(x, axis, hy, hi);
      cuda::max_axis(dev(x), axis, dy, di);
      const std::string a = "axis " + std::to_string(axis);
      expect_close(tag("max_axis", a), hy, dy);
      expect_bitwise(tag("max_axis", a + " argmax"), hi, di);
      Tensor g = rnd(ys, dt);
      for (bool acc : {false, true})
        both(tag("max_axis_vjp", a + (acc ? " acc" : "")), acc ? rnd(x.shape(), dt) : poisoned(x.shape(), dt),
             [&](Tensor& h, Tensor& d) {
               cpu::max_axis_vjp(g, hi, axis, h, acc);
               cuda::max_axis_vjp(dev(g), di, axis, d, acc);
             });
    }
  }
}

TEST_CASE("cuda kernels: matmul on cuBLAS (transposes, batch broadcast, batch reduce, accumulate)") {
  struct Case {
    const char* name;
    Shape a, b, c;
    bool ta, tb;
  };
  const Case cases[] = {
      {"plain", {33, 70}, {70, 45}, {33, 45}, false, false},
      {"a^T", {70, 33}, {70, 45}, {33, 45}, true, false},
      {"b^T", {33, 70}, {45, 70}, {33, 45}, false, true},
      {"a^T b^T", {70, 33}, {45, 70}, {33, 45}, true, true},
      {"batched", {2, 3, 17, 20}, {2, 3, 20, 9}, {2, 3, 17, 9}, false, false},
      {"batched b^T", {6, 17, 20}, {6, 9, 20}, {6, 17, 9}, false, true},
      {"shared b, a^T", {4, 20, 17}, {20, 9}, {4, 17, 9}, true, false},
      {"shared a", {17, 20}, {4, 20, 9}, {4, 17, 9}, false, false},
      {"batch-reduce", {5, 17, 20}, {5, 20, 9}, {17, 9}, false, false},
      {"batch-reduce a^T", {5, 20, 17}, {5, 20, 9}, {17, 9}, true, false},
      {"batch-reduce shared b", {5, 17, 20}, {20, 9}, {17, 9}, false, false},
      {"vector", {1, 300}, {300, 1}, {1, 1}, false, false},
      {"K = 0", {4, 0}, {0, 6}, {4, 6}, false, false},
  };
  for (DType dt : float_dtypes()) {
    for (const Case& c : cases) {
      const Shape& cshape = c.c;
      Tensor a = rnd(c.a, dt), b = rnd(c.b, dt);
      for (bool acc : {false, true})
        both(tag("matmul", std::string(c.name) + (acc ? " acc" : "")), acc ? rnd(cshape, dt) : poisoned(cshape, dt),
             [&](Tensor& h, Tensor& d) {
               cpu::matmul(a, c.ta, b, c.tb, h, acc);
               cuda::matmul(dev(a), c.ta, dev(b), c.tb, d, acc);
             });
    }
  }
}

TEST_CASE("cuda kernels: permute, slice_copy, slice_scatter (floats and integers)") {
  for (DType dt : {DType::f32, DType::f64, DType::i32, DType::u8, DType::i64}) {
    const bool fl = is_floating(dt);
    Tensor x = fl ? rnd({2, 3, 4, 5}, dt) : ids({2, 3, 4, 5}, dt, 0, 100);
    const std::array<int, kMaxRank> perm{2, 0, 3, 1};
    Tensor hp = poisoned({4, 2, 5, 3}, dt), dp = dev(hp);
    cpu::permute(x, perm, hp, false);
    cuda::permute(dev(x), perm, dp, false);
    expect_close("permute (2,0,3,1)", hp, dp);
    if (fl) {
      Tensor init = rnd({4, 2, 5, 3}, dt);
      both("permute acc", init, [&](Tensor& h, Tensor& d) {
        cpu::permute(x, perm, h, true);
        cuda::permute(dev(x), perm, d, true);
      });
    }
    for (int axis : {0, 2, 3}) {
      const std::int64_t start = axis == 0 ? 1 : 1, len = axis == 0 ? 1 : 2;
      Shape ys = x.shape();
      ys[axis] = len;
      Tensor hs = poisoned(ys, dt), ds = dev(hs);
      cpu::slice_copy(x, axis, start, hs);
      cuda::slice_copy(dev(x), axis, start, ds);
      expect_close("slice_copy axis " + std::to_string(axis), hs, ds);
      Tensor part = fl ? rnd(ys, dt) : ids(ys, dt, 0, 100);
      Tensor base = fl ? rnd(x.shape(), dt) : ids(x.shape(), dt, 0, 100);
      for (bool acc : fl ? std::vector<bool>{false, true} : std::vector<bool>{false})
        both("slice_scatter axis " + std::to_string(axis) + (acc ? " acc" : ""), base, [&](Tensor& h, Tensor& d) {
          cpu::slice_scatter(part, axis, start, h, acc);
          cuda::slice_scatter(dev(part), axis, start, d, acc);
        });
    }
  }
}

TEST_CASE("cuda kernels: gather_rows, scatter_add_rows (repeated ids, deterministic), pick, pick_vjp") {
  for (DType dt : float_dtypes()) {
    for (DType it : {DType::i32, DType::i64}) {
      const std::string ids_t = std::string("ids ") + dtype_name(it);
      Tensor table = rnd({50, 33}, dt), id = ids({3, 40}, it, 0, 50);  // 120 ids over 50 rows: repeats
      Tensor hy = poisoned({120, 33}, dt), dy = dev(hy);
      cpu::gather_rows(table, id, hy);
      cuda::gather_rows(dev(table), dev(id), dy);
      expect_close(tag("gather_rows", ids_t), hy, dy);
      Tensor g = rnd({120, 33}, dt);
      both(tag("scatter_add_rows", ids_t), rnd({50, 33}, dt), [&](Tensor& h, Tensor& d) {
        cpu::scatter_add_rows(g, id, h);
        cuda::scatter_add_rows(dev(g), dev(id), d);
      }, 0.0);  // the CPU's order exactly: bit for bit
      Tensor big = rnd({7000, 3}, dt), many = ids({5000}, it, 0, 7000), gb = rnd({5000, 3}, dt);
      both(tag("scatter_add_rows", ids_t + " 7000 rows"), rnd({7000, 3}, dt), [&](Tensor& h, Tensor& d) {
        cpu::scatter_add_rows(gb, many, h);
        cuda::scatter_add_rows(dev(gb), dev(many), d);
      }, 0.0);
      Tensor x = rnd({64, 37}, dt), idx = ids({64}, it, -1, 37);  // -1 picks 0, no gradient
      Tensor hp = poisoned({64}, dt), dp = dev(hp);
      cpu::pick(x, idx, hp);
      cuda::pick(dev(x), dev(idx), dp);
      expect_close(tag("pick", ids_t), hp, dp);
      Tensor gp = rnd({64}, dt);
      both(tag("pick_vjp", ids_t), rnd({64, 37}, dt), [&](Tensor& h, Tensor& d) {
        cpu::pick_vjp(gp, idx, h);
        cuda::pick_vjp(dev(gp), dev(idx), d);
      });
    }
  }
  // an integer table moves bit for bit
  Tensor itable = ids({10, 4}, DType::i64, 0, 1 << 30), id = ids({6}, DType::i32, 0, 10);
  Tensor h = poisoned({6, 4}, DType::i64), d = dev(h);
  cpu::gather_rows(itable, id, h);
  cuda::gather_rows(dev(itable), dev(id), d);
  expect_bitwise("gather_rows int64 table", h, d);
}

TEST_CASE("cuda kernels: out-of-range ids raise nn::Error as on the CPU") {
  Tensor table = dev(rnd({5, 3}, DType::f32)), y = cuda::alloc({2, 3}, DType::f32);
  Tensor bad = dev(Tensor::from<std::int32_t>({2}, {1, 7}));
  CHECK_THROWS_WITH_AS(cuda::gather_rows(table, bad, y), doctest::Contains("id 7 at position 1"), nn::Error);
  Tensor ok = dev(Tensor::from<std::int32_t>({2}, {1, 4}));
  CHECK_NOTHROW(cuda::gather_rows(table, ok, y));  // the error was cleared
  Tensor x = dev(rnd({2, 4}, DType::f64)), lse = cuda::alloc({2}, DType::f64), out = cuda::alloc({}, DType::f64);
  Tensor t = dev(Tensor::from<std::int64_t>({2}, {9, 1}));
  CHECK_THROWS_WITH_AS(cuda::cross_entropy(x, t, CrossEntropyAttrs{-100, Reduction::mean}, out, lse), doctest::Contains("target 9 at row 0"), nn::Error);
  Tensor px = dev(rnd({2, 4}, DType::f32)), py = cuda::alloc({2}, DType::f32);
  CHECK_THROWS_WITH_AS(cuda::pick(px, dev(Tensor::from<std::int64_t>({2}, {0, 4})), py), doctest::Contains("index 4 at row 1"),
                       nn::Error);
}

TEST_CASE("cuda kernels: bernoulli_mask draws MLX's masks bit for bit (device and host keys)") {
  for (DType mt : {DType::f32, DType::f64, DType::u8}) {
    for (std::int64_t n : {1, 2, 7, 1000, 4097}) {
      Tensor key = random::key(next_seed());
      Tensor h = poisoned({n}, mt), d = dev(h);
      cpu::bernoulli_mask(key, 0.7, mt == DType::u8 ? 1.0 : 1.0 / 0.7, h);
      cuda::bernoulli_mask(dev(key), 0.7, mt == DType::u8 ? 1.0 : 1.0 / 0.7, d);
      expect_bitwise(std::string("bernoulli_mask device key n=") + std::to_string(n), h, d);
      Tensor d2 = dev(poisoned({n}, mt));
      cuda::bernoulli_mask(key, 0.7, mt == DType::u8 ? 1.0 : 1.0 / 0.7, d2);
      expect_bitwise(std::string("bernoulli_mask host key n=") + std::to_string(n), h, d2);
    }
  }
}

TEST_CASE("cuda kernels: softmax, log_softmax and their vjps (masked rows, large logits)") {
  for (DType dt : float_dtypes()) {
    for (Shape s : {Shape{7, 33}, Shape{3, 5000}, Shape{2, 3, 1}, Shape{4, 300}}) {
      Tensor x = rnd(s, dt, -3, 3);
      std::vector<double> v = x.to_doubles();
      if (s[0] == 4) {
        for (std::int64_t j = 0; j < s[1]; ++j) v[static_cast<std::size_t>(j)] = -INFINITY;  // a fully masked row
        for (std::int64_t j = 0; j < s[1]; ++j) v[static_cast<std::size_t>(s[1] + j)] += 3000;  // large logits
        v[static_cast<std::size_t>(2 * s[1] + 3)] = -INFINITY;                                 // one masked entry
        x = Tensor::from_doubles(s, v, dt);
      }
      for (bool log : {false, true}) {
        const std::string nm = std::string(log ? "log_softmax " : "softmax ") + s.str();
        Tensor hy = poisoned(s, dt), dy = dev(hy);
        cpu::softmax(x, hy, log);
        cuda::softmax(dev(x), dy, log);
        expect_close(nm, hy, dy);
        if (s[0] == 4) continue;  // the vjp of a -inf row is NaN on both sides: skip it
        Tensor g = rnd(s, dt);
        for (bool acc : {false, true})
          both(nm + (acc ? " vjp acc" : " vjp"), acc ? rnd(s, dt) : poisoned(s, dt), [&](Tensor& h, Tensor& d) {
            cpu::softmax_vjp(hy, g, h, log, acc);
            cuda::softmax_vjp(dy, dev(g), d, log, acc);
          });
      }
    }
  }
}

TEST_CASE("cuda kernels: cross_entropy and its vjp (reductions, ignore_index, next-token rows)") {
  struct Case {
    const char* name;
    Shape x, t;
  };
  const Case cases[] = {{"rows", {40, 37}, {40}}, {"batched", {3, 8, 301}, {3, 8}}, {"next-token N<T", {3, 8, 301}, {3, 7}},
                        {"long rows", {4, 5000}, {4}}};
  for (DType dt : float_dtypes()) {
    for (const Case& c : cases) {
      for (DType it : {DType::i32, DType::i64}) {
        const std::int64_t V = c.x.dim(-1);
        Tensor x = rnd(c.x, dt, -4, 4), t = ids(c.t, DType::i64, 0, V);
        std::vector<double> tv = t.to_doubles();
        tv[0] = -100;  // ignored
        if (tv.size() > 3) tv[3] = -100;
        t = Tensor::from_doubles(c.t, tv, it);
        for (int red : {0, 1, 2}) {
          const std::string nm = std::string(c.name) + " " + dtype_name(it) + " reduction " + std::to_string(red);
          const Shape ys = red == 0 ? c.t : Shape{};
          Tensor hy = poisoned(ys, dt), hl = poisoned({t.numel()}, dt), dy = dev(hy), dl = dev(hl);
          const CrossEntropyAttrs ca{-100, static_cast<Reduction>(red)};
          cpu::cross_entropy(x, t, ca, hy, hl);
          cuda::cross_entropy(dev(x), dev(t), ca, dy, dl);
          expect_close(tag("cross_entropy", nm), hy, dy);
          expect_close(tag("cross_entropy", nm + " lse"), hl, dl);
          Tensor g = rnd(ys, dt);
          for (bool acc : {false, true})
            both(tag("cross_entropy_vjp", nm + (acc ? " acc" : "")), acc ? rnd(c.x, dt) : poisoned(c.x, dt),
                 [&](Tensor& h, Tensor& d) {
                   cpu::cross_entropy_vjp(x, t, ca, hl, g, h, acc);
                   cuda::cross_entropy_vjp(dev(x), dev(t), ca, dl, dev(g), d, acc);
                 });
        }
      }
    }
  }
}

TEST_CASE("cuda kernels: optimizer updates (sgd, adam, lion, muon, axpby, sum_squares, normalize, apply)") {
  for (DType dt : float_dtypes()) {
    const Shape s{33, 65};
    Tensor lr = Tensor::scalar(0.03, DType::f64), step = Tensor::full({}, 7, DType::i64);
    auto run = [&](const std::string& nm, auto&& cpu_f, auto&& cuda_f, int nstate) {
      std::vector<Tensor> h, d;
      for (int i = 0; i < nstate; ++i) {
        h.push_back(rnd(s, dt));
        d.push_back(dev(h.back()));
      }
      Tensor g = rnd(s, dt);
      cpu_f(h, g);
      cuda_f(d, dev(g));
      for (int i = 0; i < nstate; ++i) expect_close(nm + " state " + std::to_string(i), h[static_cast<std::size_t>(i)], d[static_cast<std::size_t>(i)]);
    };
    for (double mom : {0.0, 0.9})
      for (double damp : {0.0, 0.1})
        for (bool nest : {false, true}) {
          const std::string nm = "sgd mom " + std::to_string(mom) + " damp " + std::to_string(damp) + (nest ? " nesterov" : "");
          run(nm, [&](auto& st, const Tensor& g) { cpu::sgd_update(st[0], g, st[1], lr, mom, damp, 0.01, nest); },
              [&](auto& st, const Tensor& g) { cuda::sgd_update(st[0], g, st[1], lr, mom, damp, 0.01, nest); }, 2);
        }
    for (bool bc : {false, true})
      for (double wd : {0.0, 0.01}) {
        auto vpos = [&](auto& st) {  // v is a second moment: keep it positive
          cpu::unary(Unary::abs, 0, st[2], st[2]);
        };
        const std::string nm = std::string("adam") + (bc ? " bias-corrected" : "") + (wd > 0 ? " decoupled wd" : "");
        run(nm,
            [&](auto& st, const Tensor& g) {
              vpos(st);
              cpu::adam_update(st[0], g, st[1], st[2], lr, step, 0.9, 0.999, 1e-8, wd, bc);
            },
            [&](auto& st, const Tensor& g) {
              Tensor v = host(st[2]);
              cpu::unary(Unary::abs, 0, v, v);
              st[2] = dev(v);
              cuda::adam_update(st[0], g, st[1], st[2], lr, step, 0.9, 0.999, 1e-8, wd, bc);
            },
            3);
      }
    run("lion", [&](auto& st, const Tensor& g) { cpu::lion_update(st[0], g, st[1], lr, 0.9, 0.99, 0.1); },
        [&](auto& st, const Tensor& g) { cuda::lion_update(st[0], g, st[1], lr, 0.9, 0.99, 0.1); }, 2);
    for (bool nest : {false, true})
      run(std::string("muon_momentum") + (nest ? " nesterov" : ""),
          [&](auto& st, const Tensor& g) { cpu::muon_momentum(st[0], g, st[1], st[2], 0.95, 0.01, nest); },
          [&](auto& st, const Tensor& g) { cuda::muon_momentum(st[0], g, st[1], st[2], 0.95, 0.01, nest); }, 3);
    run("axpby", [&](auto& st, const Tensor& g) { cpu::axpby(-4.775, g, 2.0315, st[0]); },
        [&](auto& st, const Tensor& g) { cuda::axpby(-4.775, g, 2.0315, st[0]); }, 1);
    run("normalize_frobenius", [&](auto& st, const Tensor&) { cpu::normalize_frobenius(st[0], 1e-7); },
        [&](auto& st, const Tensor&) { cuda::normalize_frobenius(st[0], 1e-7); }, 1);
    run("apply_update", [&](auto& st, const Tensor& g) { cpu::apply_update(st[0], g, lr, 1.5); },
        [&](auto& st, const Tensor& g) { cuda::apply_update(st[0], g, lr, 1.5); }, 1);
    Tensor x = rnd({1000, 77}, dt);
    const double hs = cpu::sum_squares(x), ds = cuda::sum_squares(dev(x));
    record("sum_squares", dtype_name(dt), std::abs(hs - ds) / std::abs(hs), 1e-12);
  }
}

TEST_CASE("cuda kernels: fused rms_norm, rope, attention, swiglu and their vjps") {
  for (DType dt : float_dtypes()) {
    // rms_norm, with and without a gain
    for (bool gain : {true, false}) {
      const std::string nm = gain ? "rms_norm" : "rms_norm (no gain)";
      Tensor x = rnd({6, 300}, dt), w = gain ? rnd({300}, dt) : Tensor(), g = rnd({6, 300}, dt);
      Tensor dw = gain ? dev(w) : Tensor();
      Tensor hy = poisoned({6, 300}, dt), hr = poisoned({6}, dt), dy = dev(hy), dr = dev(hr);
      cpu::rms_norm(x, w, 1e-6, hy, hr);
      cuda::rms_norm(dev(x), dw, 1e-6, dy, dr);
      expect_close(nm, hy, dy);
      expect_close(nm + " rstd", hr, dr);
      for (bool acc : {false, true}) {
        Tensor gx0 = acc ? rnd({6, 300}, dt) : poisoned({6, 300}, dt), gw0 = acc ? rnd({300}, dt) : poisoned({300}, dt);
        Tensor hgx = gx0.clone(), hgw = gw0.clone(), dgx = dev(gx0), dgw = dev(gw0);
        cpu::rms_norm_vjp(x, w, hr, g, {&hgx, acc}, {gain ? &hgw : nullptr, acc});
        cuda::rms_norm_vjp(dev(x), dw, dr, dev(g), {&dgx, acc}, {gain ? &dgw : nullptr, acc});
        expect_close(nm + " vjp x" + (acc ? " acc" : ""), hgx, dgx);
        if (gain) expect_close(nm + " vjp w" + (acc ? " acc" : ""), hgw, dgw);
      }
    }
    // rope: (T, dims/2) tables against (B, T, D), and (T, 1, dims/2) against (B, T, M, D)
    struct RopeCase {
      Shape x, cs;
    };
    for (const RopeCase& c : {RopeCase{{2, 5, 8}, {5, 3}}, RopeCase{{2, 5, 3, 8}, {5, 1, 4}}})
      for (bool trad : {false, true})
        for (bool inverse : {false, true})
          for (bool acc : {false, true}) {
            Tensor x = rnd(c.x, dt), cs = rnd(c.cs, dt), sn = rnd(c.cs, dt);
            const std::string nm = "rope " + c.x.str() + (trad ? " traditional" : "") + (inverse ? " inverse" : "") +
                                   (acc ? " acc" : "");
            both(nm, acc ? rnd(c.x, dt) : poisoned(c.x, dt), [&](Tensor& h, Tensor& d) {
              cpu::rope(x, cs, sn, {trad, inverse}, h, acc);
              cuda::rope(dev(x), dev(cs), dev(sn), {trad, inverse}, d, acc);
            });
          }
    // attention: grouped heads, batched over b (B >= KV) and over kv heads (B < KV), masks
    struct AttnCase {
      std::int64_t B, T, H, KV, hd;
      Shape mask;  // rank 0: no mask
    };
    const AttnCase cases[] = {{3, 7, 4, 2, 8, {3, 1, 7, 7}}, {1, 9, 6, 3, 4, {9, 9}}, {2, 5, 2, 2, 16, {}},
                              {4, 33, 8, 2, 16, {4, 1, 1, 33}}};
    for (const AttnCase& c : cases) {
      const std::string nm = "attention B" + std::to_string(c.B) + " T" + std::to_string(c.T) + " H" + std::to_string(c.H) +
                             " KV" + std::to_string(c.KV) + (c.mask.rank() ? " mask " + c.mask.str() : " no mask");
      const Shape qs{c.B, c.T, c.H * c.hd}, ks{c.B, c.T, c.KV * c.hd}, ps{c.B, c.H, c.T, c.T};
      Tensor q = rnd(qs, dt), k = rnd(ks, dt), v = rnd(ks, dt);
      Tensor mask = c.mask.rank() ? rnd(c.mask, dt, -3, 0) : Tensor(), dmask = c.mask.rank() ? dev(mask) : Tensor();
      const double scale = 1.0 / std::sqrt(static_cast<double>(c.hd));
      Tensor ho = poisoned(qs, dt), hp = poisoned(ps, dt), dO = dev(ho), dp = dev(hp);
      const AttentionAttrs at{c.B, c.T, c.H, c.KV, c.hd, scale, false};
      cpu::attention(q, k, v, mask, at, ho, hp);
      cuda::attention(dev(q), dev(k), dev(v), dmask, at, dO, dp);
      expect_close(nm + " out", ho, dO);
      expect_close(nm + " probabilities", hp, dp);
      Tensor g = rnd(qs, dt);
      for (bool acc : {false, true}) {
        Tensor gq0 = acc ? rnd(qs, dt) : poisoned(qs, dt), gk0 = acc ? rnd(ks, dt) : poisoned(ks, dt),
               gv0 = acc ? rnd(ks, dt) : poisoned(ks, dt);
        Tensor hq = gq0.clone(), hk = gk0.clone(), hv = gv0.clone(), dq = dev(gq0), dk = dev(gk0), dv = dev(gv0);
        Tensor hs = poisoned({c.B * c.KV, c.T, c.T}, dt), ds = dev(hs);
        cpu::attention_vjp(q, k, v, hp, g, at, hs, {&hq, acc}, {&hk, acc}, {&hv, acc});
        cuda::attention_vjp(dev(q), dev(k), dev(v), dp, dev(g), at, ds, {&dq, acc}, {&dk, acc}, {&dv, acc});
        const std::string a = acc ? " acc" : "";
        expect_close(nm + " vjp q" + a, hq, dq);
        expect_close(nm + " vjp k" + a, hk, dk);
        expect_close(nm + " vjp v" + a, hv, dv);
      }
      // only some gradients wanted
      Tensor hv = poisoned(ks, dt), dv = dev(hv), hs = poisoned({c.B * c.KV, c.T, c.T}, dt), ds = dev(hs);
      cpu::attention_vjp(q, k, v, hp, g, at, hs, {}, {}, {&hv, false});
      cuda::attention_vjp(dev(q), dev(k), dev(v), dp, dev(g), at, ds, {}, {}, {&dv, false});
      expect_close(nm + " vjp v only", hv, dv);
    }
    // swiglu
    Tensor a = rnd({7, 130}, dt, -4, 4), u = rnd({7, 130}, dt), g = rnd({7, 130}, dt);
    Tensor hy = poisoned({7, 130}, dt), dy = dev(hy);
    cpu::swiglu(a, u, hy);
    cuda::swiglu(dev(a), dev(u), dy);
    expect_close("swiglu", hy, dy);
    for (bool acc : {false, true}) {
      Tensor ga0 = acc ? rnd({7, 130}, dt) : poisoned({7, 130}, dt), gu0 = acc ? rnd({7, 130}, dt) : poisoned({7, 130}, dt);
      Tensor hga = ga0.clone(), hgu = gu0.clone(), dga = dev(ga0), dgu = dev(gu0);
      cpu::swiglu_vjp(a, u, g, {&hga, acc}, {&hgu, acc});
      cuda::swiglu_vjp(dev(a), dev(u), dev(g), {&dga, acc}, {&dgu, acc});
      expect_close(std::string("swiglu vjp gate") + (acc ? " acc" : ""), hga, dga);
      expect_close(std::string("swiglu vjp up") + (acc ? " acc" : ""), hgu, dgu);
    }
  }
}
