// SPDX-License-Identifier: MIT OR Apache-2.0
// ops/linear_cross_entropy.hpp: the LM head's product and the cross-entropy in one primitive,
// checked against its composite (cross_entropy over x @ W^T) in float64 and float32 over several
// vocabulary blocks, dense and quantized heads, keep weights and ignored targets; against central
// differences in float64; a planned backward (the gradient formed in the forward) against the
// eager one bit for bit, also after the data changes; the rows that carry no loss; the errors.
#include <cmath>

#include "support/check.hpp"

using namespace nn;

namespace ops_linear_cross_entropy {  // one unity source with the other ops files

namespace {

// x (2, 5, C) against a head of V rows: V = 9000 spans three blocks of the kernel's 4096
// (block_rows for 10 rows), with targets on both sides of each block edge.
constexpr std::int64_t kC = 32, kV = 9000;  // C: one affine or mxfp4 group of 32
const std::vector<std::int64_t> kTargets = {5, -100, 8999, 0, 4095, 42, 4500, 4096, 8191, 7};
const std::vector<double> kKeep = {1, 1, 0.5, 0, 1, 2, 1, 1, 1, 0};

struct Data {
  Tensor x, w, t, keep;
  QuantizedMatrix q;
  Tensor wq;  // the quantized head dequantized, for the composite
};
Data data(DType dt, Quant qf = Quant::affine(32, 4)) {
  Data d;
  d.x = test::random_tensor({2, 5, kC}, dt, 1, -2, 2);
  d.w = test::random_tensor({kV, kC}, dt, 2, -1.5, 1.5);
  d.t = Tensor::from<std::int64_t>({2, 5}, kTargets);
  d.keep = Tensor::from_doubles({2, 5}, kKeep, dt);
  d.q = quantize(d.w, qf);
  d.wq = dequantize(d.q, dt);
  return d;
}

struct Out {
  Tensor loss, gx, gw;
};
// One loss on a fresh tape, eager: fused or composite, dense (w trainable or not) or quantized.
Out run(const Data& d, bool fused, bool quantized, bool w_grad, bool keep, Reduction r, double g = 1.0) {
  GTape<cpu> tp;
  const GVar x = tp.input(d.x, true);
  HeadVars h;
  GVar w;
  if (quantized) {
    h = HeadVars(tp.constant(d.q.weight), tp.constant(d.q.scales),
                 d.q.biases.defined() ? std::optional<GVar>(tp.constant(d.q.biases)) : std::nullopt, d.q.q);
  } else {
    w = tp.input(d.w, w_grad);
    h = HeadVars(w);
  }
  const GVar t = tp.constant(d.t), k = keep ? tp.constant(d.keep) : GVar{};
  GVar loss = fused ? fused_linear_cross_entropy(tp, x, h, t, k, r)
                    : (quantized ? detail::linear_cross_entropy_composite(tp, x, HeadVars(tp.constant(d.wq)), t, k, r, -100)
                                 : detail::linear_cross_entropy_composite(tp, x, h, t, k, r, -100));
  tp.backward(scale(tp, loss, g));
  Out o{tp.value(loss).clone(), tp.grad(x).clone(), Tensor()};
  if (w_grad && !quantized) o.gw = tp.grad(w).clone();
  return o;
}

bool same_bytes(const Tensor& a, const Tensor& b) {
  return a.nbytes() == b.nbytes() && std::memcmp(a.raw(), b.raw(), a.nbytes()) == 0;
}

}  // namespace

TEST_CASE("linear_cross_entropy equals cross_entropy over the logits: dense and quantized heads, keep, sum and mean") {
  for (DType dt : {DType::f64, DType::f32}) {
    const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
    for (Quant qf : {Quant::affine(32, 4), Quant::mxfp4()}) {
      const Data d = data(dt, qf);
      for (bool quantized : {false, true})
        for (bool w_grad : {false, true})
          for (bool keep : {false, true})
            for (Reduction r : {Reduction::sum, Reduction::mean}) {
              if (quantized && w_grad) continue;  // a quantized head is a frozen buffer
              if (!quantized && qf == Quant::mxfp4()) continue;  // the dense runs once
              CAPTURE(dtype_name(dt));
              CAPTURE(quant_mode_name(qf.mode));
              CAPTURE(quantized);
              CAPTURE(w_grad);
              CAPTURE(keep);
              CAPTURE(reduction_name(r));
              const Out f = run(d, true, quantized, w_grad, keep, r, 0.75), c = run(d, false, quantized, w_grad, keep, r, 0.75);
              CHECK(test::rel_err(f.loss, c.loss) <= tol);
              CHECK(test::rel_err(f.gx, c.gx) <= tol);
              if (f.gw.defined()) CHECK(test::rel_err(f.gw, c.gw) <= tol);
            }
    }
  }
}

TEST_CASE("linear_cross_entropy against central differences in float64 (x across vocabulary blocks; W)") {
  const Tensor x = test::random_tensor({2, 3, 4}, DType::f64, 5, -2, 2);
  const Tensor t = Tensor::from<std::int64_t>({2, 3}, {1, 4100, -100, 299, 4999, 0});
  const Tensor keep = Tensor::from_doubles({2, 3}, {1, 0.5, 1, 2, 1, 1}, DType::f64);
  const Tensor big = test::random_tensor({5000, 4}, DType::f64, 6, -1, 1);  // two blocks
  CHECK(test::gradcheck("linear_cross_entropy x", {x}, [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
    return fused_linear_cross_entropy(tp, v[0], HeadVars(tp.constant(big)), tp.constant(t), tp.constant(keep));
  }) <= 1e-7);
  const Tensor small = test::random_tensor({300, 4}, DType::f64, 7, -1, 1);
  const Tensor ts = Tensor::from<std::int64_t>({2, 3}, {1, 41, -100, 299, 50, 0});
  CHECK(test::gradcheck("linear_cross_entropy x, W", {x, small}, [&](GTape<cpu>& tp, const std::vector<GVar>& v) {
    return fused_linear_cross_entropy(tp, v[0], HeadVars(v[1]), tp.constant(ts), GVar{}, Reduction::sum);
  }) <= 1e-7);
}

TEST_CASE("linear_cross_entropy: a planned backward forms the gradient in the forward, equal to the eager one bit for bit") {
  for (DType dt : {DType::f32, DType::f64})
    for (bool quantized : {false, true}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(quantized);
      Data d = data(dt);
      const Tensor x2 = test::random_tensor({2, 5, kC}, dt, 9, -2, 2);
      const Tensor t2 = Tensor::from<std::int64_t>({2, 5}, {8998, 3, -100, 4096, 1, 2, 3, 4, 5, 6});
      // the planned step: x and the targets are input slots, set anew before each replay
      GTape<cpu> tp;
      GVar x, t;
      const GVar loss = tp.record_planned([&] {
        x = tp.input(d.x, true);
        t = tp.input(d.t);
        const HeadVars h = quantized ? HeadVars(tp.constant(d.q.weight), tp.constant(d.q.scales), tp.constant(d.q.biases), d.q.q)
                                     : HeadVars(tp.constant(d.w));
        return fused_linear_cross_entropy(tp, x, h, t, tp.constant(d.keep));
      });
      const Out first = run(d, true, quantized, false, true, Reduction::mean);
      CHECK(same_bytes(tp.value(loss), first.loss));
      CHECK(same_bytes(tp.grad(x), first.gx));
      tp.set(x, x2);
      tp.set(t, t2);
      tp.replay();
      d.x = x2;
      d.t = t2;
      const Out second = run(d, true, quantized, false, true, Reduction::mean);
      CHECK(same_bytes(tp.value(loss), second.loss));
      CHECK(same_bytes(tp.grad(x), second.gx));
      CHECK(test::rel_err(tp.grad(x), run(d, false, quantized, false, true, Reduction::mean).gx) <= (dt == DType::f64 ? 1e-12 : 2e-5));
    }
}

TEST_CASE("linear_cross_entropy: rows of weight 0 and ignored targets get no gradient; all ignored is NaN's mean, as PyTorch") {
  const Data d = data(DType::f64);
  const Out o = run(d, true, false, false, true, Reduction::mean);
  const std::vector<double> g = o.gx.to_doubles();
  for (std::int64_t r = 0; r < 10; ++r) {
    const bool counts = kTargets[static_cast<std::size_t>(r)] != -100 && kKeep[static_cast<std::size_t>(r)] != 0;
    double m = 0;
    for (std::int64_t c = 0; c < kC; ++c) m = std::max(m, std::abs(g[static_cast<std::size_t>(r * kC + c)]));
    CHECK_MESSAGE((m > 0) == counts, "row " << r);
  }
  GTape<cpu> tp;
  const Tensor none = Tensor::from<std::int64_t>({2, 5}, std::vector<std::int64_t>(10, -100));
  CHECK(std::isnan(tp.value(fused_linear_cross_entropy(tp, tp.constant(d.x), HeadVars(tp.constant(d.w)), tp.constant(none))).item()));
  CHECK(tp.value(fused_linear_cross_entropy(tp, tp.constant(d.x), HeadVars(tp.constant(d.w)), tp.constant(none), GVar{},
                                            Reduction::sum)).item() == 0.0);
}

TEST_CASE("linear_cross_entropy: errors name the op and what is wrong") {
  const Data d = data(DType::f32);
  GTape<cpu> tp;
  const GVar x = tp.constant(d.x), w = tp.constant(d.w), t = tp.constant(d.t);
  test::check_error([&] { fused_linear_cross_entropy(tp, x, HeadVars(w), t, GVar{}, Reduction::none); },
                    {"linear_cross_entropy", "per-row losses need cross_entropy"});
  test::check_error([&] { fused_linear_cross_entropy(tp, x, HeadVars(w), tp.constant(Tensor::zeros({2, 4}, DType::i64))); },
                    {"linear_cross_entropy", "targets (2, 4)", "x (2, 5, 32)"});
  test::check_error([&] { fused_linear_cross_entropy(tp, x, HeadVars(tp.constant(Tensor::zeros({7, 8}))), t); },
                    {"linear_cross_entropy", "inner dimensions differ", "(32 vs 8)"});
  test::check_error([&] { fused_linear_cross_entropy(tp, x, HeadVars(w), t, tp.input(d.keep, true)); },
                    {"linear_cross_entropy", "keep", "cannot require a gradient"});
  test::check_error([&] {
    fused_linear_cross_entropy(tp, x, HeadVars(w), tp.constant(Tensor::from<std::int64_t>({2, 5}, {0, 1, 2, 9000, 4, 5, 6, 7, 8, 9})));
  }, {"linear_cross_entropy", "target 9000 at row 3 is out of range for 9000 classes"});
  // the layer form takes the two ops where the primitive cannot: per-row losses
  const GVar rows = linear_cross_entropy(tp, x, HeadVars(w), t, GVar{}, Reduction::none);
  CHECK(tp.shape(rows) == Shape{2, 5});
}

}  // namespace ops_linear_cross_entropy
