// SPDX-License-Identifier: MIT OR Apache-2.0
// Anomaly mode: the first NaN or Inf a forward or a vjp produces raises an nn::Error naming the
// op, its node, its scope path, its inputs' shapes and the bad element -- eagerly and on replay;
// off, the values flow through as before.
#include "support/check.hpp"

#include <cmath>
#include <cstdlib>
#include <limits>

namespace core_anomaly {  // one unity source with the other core files: its names stay its own

using namespace nn;

namespace {
// The audit's cases, each a one-op graph on a (2, 3) float64 input holding x.
GVar log_of(GTape<cpu>& tp, GVar x) { return nn::log(tp, x); }
GVar sqrt_of(GTape<cpu>& tp, GVar x) { return nn::sqrt(tp, x); }
GVar softmax_of(GTape<cpu>& tp, GVar x) { return softmax(tp, x); }

Tensor with(double bad, std::int64_t at) {
  std::vector<double> v{0.5, 1.0, 2.0, 3.0, 4.0, 5.0};
  v[static_cast<std::size_t>(at)] = bad;
  return Tensor::from<double>({2, 3}, v);
}
}  // namespace

TEST_CASE("anomaly: log(-1), sqrt(-4) and an inf logit in softmax name the op, node, shapes and element") {
  struct Case {
    const char* op;
    GVar (*fn)(GTape<cpu>&, GVar);
    double bad;
    std::vector<std::string> expect;
  };
  const double inf = std::numeric_limits<double>::infinity();
  for (const Case& c : {Case{"log", log_of, -1.0, {"log (node 1", "inputs (2, 3) float64", "NaN at [1, 1] (element 4)"}},
                        Case{"sqrt", sqrt_of, -4.0, {"sqrt (node 1", "NaN at [1, 1]"}},
                        // softmax of a row holding +inf: inf - inf in the max-shifted exponent
                        Case{"softmax", softmax_of, inf, {"softmax (node 1", "NaN at [1, 0]"}}}) {
    INFO(c.op);
    GTape<cpu> tp;
    // off (the default): the value flows through silently, as in PyTorch without detect_anomaly
    CHECK_FALSE(tp.detect_anomaly());
    GVar x = tp.input(with(c.bad, 4));
    GVar y = c.fn(tp, x);
    CHECK_FALSE(detail::all_finite(tp.value(y)));
    tp.clear();
    tp.detect_anomaly(true);
    GVar ok = c.fn(tp, tp.input(with(0.5, 4)));  // finite: no error
    CHECK(detail::all_finite(tp.value(ok)));
    tp.clear();
    tp.detect_anomaly(false);  // so that an Inf input is bound (on, its leaf is refused: next test)
    x = tp.input(with(c.bad, 4));
    tp.detect_anomaly(true);
    std::vector<std::string> expect{"[anomaly]", "forward produced", "of (2, 3) float64"};
    expect.insert(expect.end(), c.expect.begin(), c.expect.end());
    test::check_error([&] { c.fn(tp, x); }, expect);
    CHECK(tp.size() == 1);  // the failed op left the tape as it was
  }
}

TEST_CASE("anomaly: a NaN input is named at its leaf; a NaN parameter names its scope") {
  GTape<cpu> tp;
  tp.detect_anomaly(true);
  Tensor x = Tensor::from<float>({2, 2}, {1.0f, 2.0f, NAN, 4.0f});
  test::check_error([&] { tp.input(x); }, {"[anomaly] input (node 0)", "its value holds NaN at [1, 0] (element 2) of (2, 2) float32"});
  CHECK(tp.size() == 0);
  Tensor w = Tensor::from<float>({2}, {1.0f, INFINITY});
  {
    auto layer = tp.scope("layers.3");
    auto attn = tp.scope("self_attn");
    test::check_error([&] { tp.param(w); }, {"[anomaly] param (node 0, in 'layers.3.self_attn')", "+Inf at [1]"});
  }
  CHECK(tp.size() == 0);
  w.data<float>()[1] = 2.0f;
  GVar p = tp.param(w);  // the failed bind left no leaf behind: binding again works
  CHECK(tp.size() == 1);
  CHECK(tp.scope_path(p).empty());
}

TEST_CASE("anomaly: scopes nest, close, and name the op in the error") {
  GTape<cpu> tp;
  tp.detect_anomaly(true);
  GVar x = tp.input(Tensor::from<double>({3}, {1.0, 0.0, 2.0}));
  GVar a, b;
  {
    auto l = tp.scope("layers.0");
    {
      auto m = tp.scope("mlp");
      a = nn::scale(tp, x, 2.0);
    }
    b = nn::scale(tp, a, 2.0);
  }
  GVar c = nn::scale(tp, b, 2.0);
  CHECK(tp.scope_path(a) == "layers.0.mlp");
  CHECK(tp.scope_path(b) == "layers.0");
  CHECK(tp.scope_path(c).empty());
  auto l = tp.scope("layers.1");
  auto s = tp.scope("self_attn");
  test::check_error([&] { nn::log(tp, x); },
                    {"[anomaly] unary log (node 4, in 'layers.1.self_attn', inputs (3) float64): forward produced -Inf at [1]"});
}

TEST_CASE("anomaly: a vjp that writes NaN or Inf is named, with the input whose gradient it wrote") {
  // sqrt(0) = 0 is finite; its gradient 1 / (2 sqrt(0)) is +Inf.
  GTape<cpu> tp;
  tp.detect_anomaly(true);
  Tensor X = Tensor::from<double>({3}, {4.0, 0.0, 1.0});
  GVar x = tp.param(X);
  GVar y = [&] {
    auto s = tp.scope("layers.2.mlp");
    return nn::sqrt(tp, x);
  }();
  GVar loss = sum(tp, y);
  test::check_error([&] { tp.backward(loss); },
                    {"[anomaly] unary sqrt (node 1, in 'layers.2.mlp', inputs (3) float64)",
                     "backward (vjp) wrote into the gradient of input 0 (node 0, param)", "+Inf at [1] (element 1)"});
  // a cotangent holding NaN is refused before the sweep
  GTape<cpu> t2;
  t2.detect_anomaly(true);
  GVar p = t2.param(X);
  GVar z = nn::scale(t2, p, 3.0);
  test::check_error([&] { t2.backward(z, Tensor::from<double>({3}, {1.0, NAN, 1.0})); },
                    {"[anomaly] unary scale (node 1", "the cotangent given to backward() holds NaN at [1]"});
}

TEST_CASE("anomaly: replay checks what it recomputes; NN_DETECT_ANOMALY=1 turns it on") {
  Tensor W = Tensor::from<double>({2}, {1.0, 2.0});
  Tensor X = Tensor::from<double>({2}, {1.0, 1.0});
  GTape<cpu> tp;
  CHECK_FALSE(tp.detect_anomaly());
  tp.detect_anomaly(true);
  GVar w = tp.param(W);
  GVar x = tp.input(X);
  GVar loss = sum(tp, nn::log(tp, mul(tp, w, x)));
  tp.backward(loss);
  // a new batch that drives the product negative: log's forward is named on replay
  tp.set(x, Tensor::from<double>({2}, {1.0, -1.0}));
  test::check_error([&] { tp.replay(); }, {"[anomaly] unary log (node 3", "forward produced NaN at [1]"});
  // a weight an optimizer wrote NaN into: named at the param leaf on replay
  tp.set(x, X);
  W.data<double>()[0] = NAN;
  test::check_error([&] { tp.replay(); }, {"[anomaly] param (node 0)", "its value holds NaN at [0]"});
  W.data<double>()[0] = 1.0;
  tp.replay();  // finite again: no error
  CHECK(tp.value(loss).item() == doctest::Approx(std::log(2.0)));

  ::setenv("NN_DETECT_ANOMALY", "1", 1);
  GTape<cpu> on;
  ::setenv("NN_DETECT_ANOMALY", "0", 1);
  GTape<cpu> off;
  ::unsetenv("NN_DETECT_ANOMALY");
  CHECK(on.detect_anomaly());
  CHECK_FALSE(off.detect_anomaly());
  GVar v = on.input(Tensor::from<double>({1}, {-1.0}));
  test::check_error([&] { nn::sqrt(on, v); }, {"[anomaly] unary sqrt (node 1"});
}

TEST_CASE("anomaly: the README's example") {
  // --8<-- [start:anomaly]
  std::string message;
  nn::GTape<nn::cpu> tp;
  tp.detect_anomaly(true);  // or NN_DETECT_ANOMALY=1 in the environment
  nn::GVar x = tp.input(nn::Tensor::from<float>({2, 2}, {1.0f, 2.0f, -3.0f, 4.0f}));
  try {
    auto layer = tp.scope("layers.3.mlp");  // the nodes recorded while it lives carry this path
    nn::log(tp, x);
  } catch (const nn::Error& e) {
    // [anomaly] unary log (node 1, in 'layers.3.mlp', inputs (2, 2) float32): forward produced
    // NaN at [1, 0] (element 2) of (2, 2) float32
    message = e.what();
  }
  // --8<-- [end:anomaly]
  CHECK(message ==
        "[anomaly] unary log (node 1, in 'layers.3.mlp', inputs (2, 2) float32): forward produced NaN at [1, 0] "
        "(element 2) of (2, 2) float32");
}

}  // namespace core_anomaly
