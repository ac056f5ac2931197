// SPDX-License-Identifier: MIT OR Apache-2.0
// layers/loss.hpp and the fused softmax_cross_entropy primitive (ops/cross_entropy.hpp): PyTorch
// semantics (ignore_index, reductions, probability targets), agreement of the fused primitive
// with its composite reference -pick(log_softmax(x), t), stability, finite differences.
#include "layer_case.hpp"

namespace layers_loss {  // one unity source with the other layers files: its names stay its own

using namespace nn;

namespace {
Reduction reduction_of(const nlohmann::json& c) {
  std::string r = c.value("reduction", std::string("mean"));
  return r == "none" ? Reduction::none : (r == "sum" ? Reduction::sum : Reduction::mean);
}

/// The composite reference: log_softmax, then pick (which gives 0 and no gradient for a negative
/// index), reduced with the kept-row count computed on the host.
GVar composite_ce(GTape<cpu>& tp, GVar logits, const Tensor& targets, Reduction red, std::int64_t ignore) {
  std::vector<std::int64_t> t;
  double kept = 0;
  for (double d : targets.to_doubles()) {
    auto k = static_cast<std::int64_t>(d);
    t.push_back(k == ignore ? -1 : k);
    kept += k != ignore;
  }
  GVar rows = neg(tp, pick(tp, log_softmax(tp, logits), tp.constant(Tensor::from<std::int64_t>(targets.shape(), t))));
  if (red == Reduction::none) return rows;
  GVar s = sum(tp, rows);
  return red == Reduction::sum ? s : nn::scale(tp, s, 1.0 / kept);
}
}  // namespace

TEST_CASE("cross_entropy matches torch.nn.functional.cross_entropy") {
  auto ce = [](auto& tp, auto& v, auto& c) {
    return cross_entropy(tp, v["logits"], v["targets"], reduction_of(c), c.value("ignore_index", std::int64_t{-100}));
  };
  for (const char* name : {"cross_entropy/int_mean", "cross_entropy/int_sum", "cross_entropy/int_none",
                           "cross_entropy/int_ignore_pad", "cross_entropy/prob_mean", "cross_entropy/prob_sum",
                           "cross_entropy/prob_none"})
    test::check_layer_case(name, ce);
  // logits ~ +-3000: float32 keeps ~1e-7 relative of 3000 per logit, so compare loosely there
  test::check_layer_case("cross_entropy/large_logits", ce, 1e-3);
  test::check_layer_case("cross_entropy/keep_mean", [](auto& tp, auto& v, auto&) {
    return cross_entropy(tp, v["logits"], v["targets"], v["keep"]);
  });
  test::check_layer_case("cross_entropy_rows/batched", [](auto& tp, auto& v, auto& c) {
    return cross_entropy_rows(tp, v["logits"], v["targets"], c["n_rows"].template get<std::int64_t>());
  });
}

TEST_CASE("softmax_cross_entropy (fused) agrees with -pick(log_softmax) (values and gradients)") {
  struct Setup {
    std::int64_t R, V;
    DType dt;
    double lo, hi;
  };
  for (Setup s : {Setup{5, 13, DType::f64, -3, 3}, Setup{4, 50257, DType::f32, -10, 10}, Setup{6, 9, DType::f64, -2000, 2000},
                  Setup{3, 32000, DType::f64, -5, 5}}) {
    Tensor x = test::random_tensor({s.R, s.V}, s.dt, 101);
    std::vector<std::int64_t> t;
    for (std::int64_t r = 0; r < s.R; ++r) t.push_back(r == 1 ? -100 : (r * 7919) % s.V);
    Tensor T = Tensor::from<std::int64_t>({s.R}, t);
    for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
      GTape<cpu> tp;
      GVar xf = tp.param(x);
      GVar fused = softmax_cross_entropy(tp, xf, tp.constant(T), red);
      GVar ref = composite_ce(tp, xf, T, red, -100);
      const double tol = s.dt == DType::f64 ? 1e-14 : 1e-6;
      double ev = test::rel_err(tp.value(fused), tp.value(ref));
      Tensor w = test::random_tensor(tp.shape(fused), s.dt, 102);
      tp.backward(fused, w);
      Tensor gf = tp.grad(xf).clone();
      tp.backward(ref, w);
      double eg = test::rel_err(gf, tp.grad(xf));
      MESSAGE("R " << s.R << " V " << s.V << " " << std::string(dtype_name(s.dt)) << " " << std::string(reduction_name(red)) << ": fused vs composite value "
                   << ev << ", grad " << eg);
      CHECK(ev <= tol);
      CHECK(eg <= tol);
    }
  }
}

TEST_CASE("softmax_cross_entropy_rows (in place) agrees with slicing the first N rows") {
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = dt == DType::f64 ? 1e-15 : 1e-6;
    Tensor x = test::random_tensor({3, 5, 7}, dt, 131, -4, 4);
    Tensor t = Tensor::from<std::int64_t>({3, 4}, {1, 2, 3, 4, -100, 6, 0, 1, 2, 2, -100, 5});
    for (Reduction red : {Reduction::mean, Reduction::sum, Reduction::none}) {
      for (bool shared : {false, true}) {  // shared: logits also feed another consumer (gradients accumulate)
        GTape<cpu> tp;
        GVar xv = tp.param(x);
        GVar tv = tp.constant(t);
        auto loss = [&](GVar ce) {
          GVar l = red == Reduction::none ? sum(tp, mul(tp, ce, tp.constant(test::random_tensor({3, 4}, dt, 132)))) : ce;
          return shared ? add(tp, l, nn::scale(tp, sum(tp, mul(tp, xv, xv)), 0.1)) : l;
        };
        GVar fused = loss(softmax_cross_entropy_rows(tp, xv, tv, red));
        GVar ref = loss(softmax_cross_entropy(tp, slice(tp, xv, -2, 0, 4), tv, red));
        CHECK(test::rel_err(tp.value(fused), tp.value(ref)) <= tol);
        tp.backward(fused);
        Tensor gf = tp.grad(xv).clone();
        tp.backward(ref);
        double eg = test::rel_err(gf, tp.grad(xv));
        CHECK(eg <= tol);
        if (!shared)
          for (std::int64_t b = 0; b < 3; ++b)
            for (std::int64_t j = 0; j < 7; ++j) CHECK(gf.item((b * 5 + 4) * 7 + j) == 0.0);  // the unscored last row
      }
    }
  }
}

TEST_CASE("cross_entropy: stable for logits in the thousands, ignored rows pass nothing") {
  GTape<cpu> tp;
  Tensor X = Tensor::from<float>({2, 3}, {3000.f, 1000.f, -2000.f, 5000.f, 5000.f, 4000.f});
  GVar x = tp.param(X);
  GVar l = cross_entropy(tp, x, tp.constant(Tensor::from<std::int32_t>({2}, {1, 0})), Reduction::none);
  CHECK(tp.value(l).item(0) == doctest::Approx(2000.0));
  // lse and the target logit are both ~5000 in float32 (ulp 4.9e-4): the loss keeps that absolute error
  CHECK(tp.value(l).item(1) == doctest::Approx(std::log(2.0)).epsilon(1e-3));
  GVar m = cross_entropy(tp, x, tp.constant(Tensor::from<std::int32_t>({2}, {-100, 2})));
  CHECK(std::isfinite(tp.value(m).item()));
  tp.backward(m);
  for (int j = 0; j < 3; ++j) CHECK(tp.grad(x).item(j) == 0.0);  // the ignored row
  GVar all_ignored = cross_entropy(tp, x, tp.constant(Tensor::from<std::int32_t>({2}, {-100, -100})));
  CHECK(std::isnan(tp.value(all_ignored).item()));  // 0/0, as PyTorch
}

TEST_CASE("cross_entropy: replay with new targets recounts the ignored rows") {
  GTape<cpu> tp;
  Tensor X = test::random_tensor({4, 6}, DType::f64, 111);
  GVar x = tp.param(X);
  GVar t = tp.input(Tensor::from<std::int64_t>({4}, {1, 2, -100, 3}));
  GVar loss = cross_entropy(tp, x, t);
  tp.backward(loss);
  Tensor next = Tensor::from<std::int64_t>({4}, {-100, 5, -100, 0});
  tp.set(t, next);
  tp.replay();
  GTape<cpu> fresh;
  GVar x2 = fresh.param(X);
  GVar l2 = composite_ce(fresh, x2, next, Reduction::mean, -100);
  fresh.backward(l2);
  CHECK(test::rel_err(tp.value(loss), fresh.value(l2)) <= 1e-15);
  CHECK(test::rel_err(tp.grad(x), fresh.grad(x2)) <= 1e-15);
}

TEST_CASE("cross_entropy: finite differences") {
  using V = std::vector<GVar>;
  Tensor x = test::random_tensor({5, 7}, DType::f64, 121, -3, 3);
  Tensor t = Tensor::from<std::int64_t>({5}, {1, -100, 6, 0, 3});
  Tensor p = test::random_tensor({5, 7}, DType::f64, 122, 0, 1);
  Tensor keep = Tensor::from<double>({5}, {1, 0, 1, 1, 0});
  Tensor x3 = test::random_tensor({2, 4, 7}, DType::f64, 123, -3, 3);
  Tensor t3 = Tensor::from<std::int64_t>({2, 3}, {1, 2, 3, 4, -100, 6});
  double e[] = {
      test::gradcheck("cross_entropy (int, mean)", {x},
                      [&](GTape<cpu>& tp, const V& v) { return cross_entropy(tp, v[0], tp.constant(t)); }),
      test::layer_gradcheck("cross_entropy (int, none)", {x},
                            [&](GTape<cpu>& tp, const V& v) { return cross_entropy(tp, v[0], tp.constant(t), Reduction::none); }),
      test::gradcheck("cross_entropy (int, sum)", {x},
                      [&](GTape<cpu>& tp, const V& v) { return cross_entropy(tp, v[0], tp.constant(t), Reduction::sum); }),
      test::gradcheck("cross_entropy (probabilities)", {x, p},
                      [&](GTape<cpu>& tp, const V& v) { return cross_entropy(tp, v[0], v[1]); }),
      test::gradcheck("cross_entropy (keep mask)", {x},
                      [&](GTape<cpu>& tp, const V& v) { return cross_entropy(tp, v[0], tp.constant(t), tp.constant(keep)); }),
      test::gradcheck("cross_entropy_rows", {x3},
                      [&](GTape<cpu>& tp, const V& v) { return cross_entropy_rows(tp, v[0], tp.constant(t3), 3); }),
  };
  for (double err : e) CHECK(err <= 1e-7);
}

TEST_CASE("cross_entropy: shapes and errors name the layer and the shapes") {
  GTape<cpu> tp;
  GVar x = tp.constant(Tensor::zeros({2, 3, 5}));
  GVar t = tp.constant(Tensor::from<std::int32_t>({2, 3}, {0, 1, 2, 3, 4, 0}));
  CHECK(tp.shape(cross_entropy(tp, x, t)) == Shape{});
  CHECK(tp.shape(cross_entropy(tp, x, t, Reduction::none)) == Shape{2, 3});
  GVar t2 = tp.constant(Tensor::from<std::int32_t>({2, 2}, {0, 1, 2, 3}));
  CHECK(tp.shape(cross_entropy_rows(tp, x, t2, 2, Reduction::none)) == Shape{2, 2});
  test::check_error([&] { cross_entropy(tp, x, t2); }, {"[cross_entropy]", "(2, 2)", "(2, 3, 5)"});
  test::check_error([&] { cross_entropy(tp, x, tp.constant(Tensor::zeros({2, 3, 4}))); },
                    {"[cross_entropy]", "(2, 3, 4)", "(2, 3, 5)"});
  test::check_error([&] { cross_entropy(tp, x, t, tp.constant(Tensor::ones({3}))); }, {"[cross_entropy]", "keep (3)", "(2, 3)"});
  test::check_error([&] { cross_entropy_rows(tp, x, t2, 3); }, {"[cross_entropy_rows]", "(2, 3, 5)", "(2, 2)", "n_rows = 3"});
  GVar bad = tp.constant(Tensor::from<std::int32_t>({2, 3}, {0, 1, 2, 3, 5, 0}));
  test::check_error([&] { cross_entropy(tp, x, bad); }, {"cross_entropy", "target 5", "5 classes"});
}

}  // namespace layers_loss
