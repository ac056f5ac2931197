// SPDX-License-Identifier: MIT OR Apache-2.0
// A gradient holding NaN or Inf never reaches the weights: the update raises naming the
// parameter and changes nothing, or, with skip_nonfinite(true), skips the step and counts it --
// in an eager update and in a compiled (replayed) step alike.
#include "support/check.hpp"

#include <cmath>

namespace optim_nonfinite {  // one unity source with the other optim files: its names stay its own

using namespace nn;

namespace {
struct Two {
  Param w;  // (2)
  Param v;  // (2)
  NN_MODULE(Two, w, v)
};
Two make() { return Two{Param(Tensor::from<double>({2}, {0.5, -0.3})), Param(Tensor::from<double>({2}, {0.2, 0.1}))}; }

// loss = sum(w * w) + sum(v * s): a NaN in the data s makes v's gradient NaN (w's stays finite).
GVar loss_fn(GTape<cpu>& tp, const Two& m, GVar s) {
  return add(tp, sum(tp, mul(tp, nn::param(tp, m.w), nn::param(tp, m.w))), sum(tp, mul(tp, nn::param(tp, m.v), s)));
}
}  // namespace

TEST_CASE("a non-finite gradient raises naming the parameter, or skips the step with skip_nonfinite") {
  for (bool compiled : {false, true}) {
    INFO("compiled " << compiled);
    Two m = make();
    Adam opt(0.1);
    opt.init(m);
    auto step = compile<1>(m, opt, loss_fn);
    auto run = [&](double s) {
      const Tensor st = Tensor::from<double>({}, {s});
      if (compiled) return step(st).item();
      auto [l, g] = value_and_grad(m, [&](GTape<cpu>& tp, const Two& t) { return loss_fn(tp, t, tp.constant(st)); });
      opt.update(m, g);
      return l.item();
    };
    run(1.0);  // a finite step
    const std::vector<double> w = m.w.value.to_doubles(), v = m.v.value.to_doubles();
    const std::vector<double> slot = opt.slots("v").begin()->second.to_doubles();
    CHECK(opt.step() == 1);
    test::check_error([&] { run(NAN); }, {"[optimizer]", "gradient of 'v'", "NaN or Inf", "update 2"});
    CHECK(opt.step() == 1);  // nothing changed
    CHECK(m.w.value.to_doubles() == w);
    CHECK(m.v.value.to_doubles() == v);
    CHECK(opt.slots("v").begin()->second.to_doubles() == slot);
    opt.skip_nonfinite();
    CHECK(std::isnan(run(NAN)));
    CHECK(opt.skipped_steps() == 1);
    CHECK(opt.step() == 1);
    CHECK(m.w.value.to_doubles() == w);  // w's gradient was finite, but the whole step is skipped
    run(1.0);                              // and training goes on
    CHECK(opt.step() == 2);
    CHECK(m.w.value.to_doubles() != w);
    CHECK(detail::all_finite(m.v.value));
  }
  CHECK_FALSE(detail::all_finite(Tensor::from<float>({3}, {1.0f, INFINITY, 0.0f})));
  CHECK(detail::all_finite(Tensor::from<std::int32_t>({2}, {1, 2})));
}

TEST_CASE("anomaly mode in a compiled step: a replay names the op, before the update writes anything") {
  Two m = make();
  Sgd opt(1e-3);
  // the step's tape reads NN_DETECT_ANOMALY when it is made; detect_anomaly() sets it later
  ::setenv("NN_DETECT_ANOMALY", "1", 1);
  auto step = compile<1>(m, opt, [](GTape<cpu>& tp, const Two& t, GVar s) {
    auto scope = tp.scope("head");
    GVar w = nn::param(tp, t.w);
    GVar ww = sum(tp, mul(tp, w, w));
    return add(tp, ww, sum(tp, nn::sqrt(tp, mul(tp, nn::param(tp, t.v), s))));
  });
  ::unsetenv("NN_DETECT_ANOMALY");
  const Tensor s = Tensor::from<double>({}, {2.0});
  step(s);
  step(s);  // replayed
  CHECK(step.recordings() == 1);
  const std::vector<double> v = m.v.value.to_doubles();
  test::check_error([&] { step(Tensor::from<double>({}, {-2.0})); },
                    {"[anomaly] unary sqrt (node 6, in 'head', inputs (2) float64)", "forward produced NaN at [0]"});
  CHECK(m.v.value.to_doubles() == v);  // the failed step wrote nothing
  step.detect_anomaly(false);
  // off: the NaN flows to the loss, and the optimizer's own gate stops it at the update
  test::check_error([&] { step(Tensor::from<double>({}, {-2.0})); }, {"[optimizer] the gradient of 'v' holds NaN or Inf"});
  CHECK(m.v.value.to_doubles() == v);
}

}  // namespace optim_nonfinite
