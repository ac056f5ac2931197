// SPDX-License-Identifier: MIT OR Apache-2.0
// The op registry: one table listing every primitive (nn::Prim) with sample inputs, tolerances,
// the PyTorch fixture case it matches (if any) and the composite it must equal (for the fused
// ones), as PyTorch's OpInfo does. Every check runs from this one table:
//   tests/ops/registry.test.cpp   each primitive has an entry (a new enumerator without one fails),
//                                 each entry records the primitive it names, PyTorch fixture in
//                                 float64 and float32, central differences in float64, fused
//                                 equals composite, replay equals eager bit for bit (f32, f64);
//   tests/cuda/registry.test.cu   (nvcc) CUDA against CPU, values and gradients.
// The per-header tests (tests/ops/*.test.cpp) keep their long case lists against the same fixtures.
#pragma once

#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "support/check.hpp"

namespace nn::test::registry {

/// How a sample input is drawn.
enum class Kind : std::uint8_t {
  real,  // uniform in [lo, hi], differentiable unless `grad` is false
  ids,   // int64 uniform in [0, n)
  mask,  // uint8 0/1
  key,   // an MLX key, uint32 (2)
};

struct Input {
  Shape shape;
  Kind kind = Kind::real;
  double lo = -1, hi = 1;
  std::int64_t n = 0;  // ids: the range
  bool grad = true;    // real: gets a gradient

  bool differentiable() const { return kind == Kind::real && grad; }
};
inline Input real(Shape s, double lo = -1, double hi = 1) { return {s, Kind::real, lo, hi, 0, true}; }
inline Input constant(Shape s, double lo = -1, double hi = 1) { return {s, Kind::real, lo, hi, 0, false}; }
inline Input ids(Shape s, std::int64_t n) { return {s, Kind::ids, 0, 0, n, false}; }
inline Input mask(Shape s) { return {s, Kind::mask, 0, 0, 0, false}; }
inline Input key() { return {Shape{2}, Kind::key, 0, 0, 0, false}; }

template <class B>
using Build = std::function<GVar(GTape<B>&, const std::vector<GVar>&)>;

struct Tol {
  double fd = 1e-7;          // float64 vs central differences
  double torch32 = 1e-5;     // float32 vs the PyTorch float64 fixture (float64: kTolF64 = 1e-12)
  double composite64 = 1e-12, composite32 = 1e-5;  // fused vs composite
  double cuda64 = 1e-12, cuda32 = 1e-5;            // CUDA vs CPU
};

template <class B>
struct OpCase {
  Prim prim;
  std::string name;
  std::vector<Input> inputs;
  Build<B> build;
  bool fd = true;           // smooth at the samples: central differences apply
  std::string fixture;      // "elementwise.json:silu/matrix": the PyTorch case `build` computes
  Build<B> composite = {};  // a fused primitive's reference from other primitives
  Tol tol = {};
};

/// The sample inputs of a case in float dtype `dt` (seeded, so every run draws the same).
inline std::vector<Tensor> make_inputs(const std::vector<Input>& ins, DType dt, std::uint64_t seed) {
  std::vector<Tensor> out;
  std::mt19937_64 rng(seed);
  for (const Input& in : ins) {
    const std::uint64_t s = rng();
    switch (in.kind) {
      case Kind::real: out.push_back(random_tensor(in.shape, dt, s, in.lo, in.hi)); break;
      case Kind::ids: {
        std::vector<std::int64_t> v(static_cast<std::size_t>(in.shape.numel()));
        for (auto& x : v) x = static_cast<std::int64_t>(rng() % static_cast<std::uint64_t>(in.n));
        out.push_back(Tensor::from<std::int64_t>(in.shape, v));
        break;
      }
      case Kind::mask: {
        std::vector<std::uint8_t> v(static_cast<std::size_t>(in.shape.numel()));
        for (auto& x : v) x = static_cast<std::uint8_t>(rng() % 2);
        out.push_back(Tensor::from<std::uint8_t>(in.shape, v));
        break;
      }
      case Kind::key: out.push_back(random::key(s)); break;
    }
  }
  return out;
}

/// Registers a case's inputs, already on B's device: differentiable ones as params (bound to
/// `ts`, which must outlive the tape), the others as input slots (a replay may set them).
template <class B>
std::vector<GVar> bind_inputs(GTape<B>& tp, const OpCase<B>& c, const std::vector<Tensor>& ts) {
  std::vector<GVar> vs;
  for (std::size_t k = 0; k < ts.size(); ++k)
    vs.push_back(c.inputs[k].differentiable() ? tp.param(ts[k]) : tp.input(ts[k]));
  return vs;
}

/// Whether any input of a case gets a gradient (quantized_gather's ids and constant table: none).
template <class B>
bool any_differentiable(const OpCase<B>& c) {
  for (const Input& in : c.inputs)
    if (in.differentiable()) return true;
  return false;
}

/// A case's output and the gradients of sum(out * w) (none when w is empty), host copies.
struct Run {
  Tensor out;
  std::vector<Tensor> grads;  // one per input; undefined where it gets none
};

/// Runs `build` (the case's own, or its composite) on a fresh GTape<B> from host inputs.
template <class B>
Run run(const OpCase<B>& c, const Build<B>& build, const std::vector<Tensor>& host_in, const Tensor& w) {
  auto on = [](const Tensor& t) { return t.to(B::device); };  // a copy: the host tensors stay as given
  std::vector<Tensor> ts;
  for (const Tensor& t : host_in) ts.push_back(on(t));
  GTape<B> tp;
  std::vector<GVar> vs = bind_inputs(tp, c, ts);
  GVar out = build(tp, vs);
  Run r{tp.value(out).to(Device::cpu), {}};
  if (!w.defined() || !any_differentiable(c)) return r;
  tp.backward(sum(tp, mul(tp, out, tp.constant(on(w)))));
  for (std::size_t k = 0; k < ts.size(); ++k)
    r.grads.push_back(c.inputs[k].differentiable() ? tp.grad(vs[k]).to(Device::cpu) : Tensor());
  return r;
}

/// Every primitive, at least once. Builders are generic over the backend: the same table runs on
/// nn::cpu and nn::cuda (a primitive a backend lacks, such as flash attention on CUDA, is left
/// out for it).
template <class B>
std::vector<OpCase<B>> cases() {
  using V = const std::vector<GVar>&;
  using T = GTape<B>&;
  std::vector<OpCase<B>> c;
  auto add = [&](OpCase<B> oc) { c.push_back(std::move(oc)); };

  // ---- elementwise -------------------------------------------------------------------------
  const Shape m{3, 4};
  const struct {
    Unary op;
    const char* fixture;
    double lo, hi, arg;
  } unaries[] = {
      {Unary::neg, "neg/matrix", -2, 2, 0},         {Unary::exp, "exp/matrix", -2, 2, 0},
      {Unary::log, "log/positive", 0.5, 2, 0},      {Unary::sqrt, "sqrt/positive", 0.5, 2, 0},
      {Unary::rsqrt, "rsqrt/positive", 0.5, 2, 0},  {Unary::tanh, "tanh/matrix", -2, 2, 0},
      {Unary::sigmoid, "sigmoid/matrix", -2, 2, 0}, {Unary::relu, "relu/away_from_zero", -2, 2, 0},
      {Unary::abs, "abs/away_from_zero", -2, 2, 0}, {Unary::pow, "pow/2.5", 0.5, 2, 2.5},
      {Unary::silu, "silu/matrix", -2, 2, 0},       {Unary::gelu, "gelu/matrix", -2, 2, 0},
      {Unary::gelu_approx, "gelu_approx/matrix", -2, 2, 0},
      {Unary::gelu_fast, "gelu_fast/matrix", -2, 2, 0},
      {Unary::scale, "scale/-1.75", -2, 2, -1.75},  {Unary::add_scalar, "add_scalar/0.625", -2, 2, 0.625},
  };
  for (const auto& u : unaries)
    add({Prim::unary, std::string("unary/") + unary_name(u.op), {real(m, u.lo, u.hi)},
         [op = u.op, a = u.arg](T tp, V v) { return unary(tp, op, v[0], a); }, true,
         std::string("elementwise.json:") + u.fixture});
  const std::pair<Binary, double> binaries[] = {{Binary::add, -1}, {Binary::sub, -1},     {Binary::mul, -1},
                                                {Binary::div, 0.5}, {Binary::maximum, -1}, {Binary::minimum, -1}};
  for (auto [op, lo] : binaries)
    add({Prim::binary, std::string("binary/") + binary_name(op), {real({2, 3, 4}), real({4}, lo, 1.5)},
         [op = op](T tp, V v) { return binary(tp, op, v[0], v[1]); }, true,
         std::string("elementwise.json:") + binary_name(op) + "/trailing"});
  add({Prim::where, "where", {mask(m), real(m), real(m)}, [](T tp, V v) { return where(tp, v[0], v[1], v[2]); }, true,
       "elementwise.json:where/same"});
  // x * stop_gradient(x): the gradient is x's through one path only, not the derivative of x^2
  add({Prim::stop_gradient, "stop_gradient", {real(m)},
       [](T tp, V v) { return mul(tp, v[0], stop_gradient(tp, v[0])); }, false,
       "elementwise.json:stop_gradient/x_times_sg_x"});

  // ---- shapes, reductions, products, indexing ------------------------------------------------
  const Shape r3{2, 3, 4};
  add({Prim::reshape, "reshape", {real(r3)}, [](T tp, V v) { return reshape(tp, v[0], {6, 4}); }, true,
       "shape.json:reshape/to_matrix"});
  add({Prim::permute, "permute", {real(r3)}, [](T tp, V v) { return permute(tp, v[0], {2, 0, 1}); }, true,
       "shape.json:permute/201"});
  add({Prim::slice, "slice", {real(r3)}, [](T tp, V v) { return slice(tp, v[0], 1, 1, 3); }, true,
       "shape.json:slice/axis1"});
  add({Prim::concat, "concat", {real({2, 3}), real({1, 3}), real({3, 3})},
       [](T tp, V v) { return concat(tp, {v[0], v[1], v[2]}, 0); }, true, "shape.json:concat/axis0"});
  add({Prim::broadcast_to, "broadcast_to", {real({3, 1})},
       [](T tp, V v) { return broadcast_to(tp, v[0], Shape{2, 3, 4}); }, true, "shape.json:broadcast_to/column"});
  add({Prim::sum, "sum", {real(r3)}, [](T tp, V v) { return sum(tp, v[0]); }, true, "reduce.json:sum/all"});
  add({Prim::sum, "mean", {real(r3)}, [](T tp, V v) { return mean(tp, v[0]); }, true, "reduce.json:mean/all"});
  add({Prim::max, "max", {real(r3)}, [](T tp, V v) { return max(tp, v[0], 1); }, true, "reduce.json:max/axis1"});
  add({Prim::matmul, "matmul", {real({3, 4}), real({4, 5})}, [](T tp, V v) { return matmul(tp, v[0], v[1]); }, true,
       "matmul.json:matmul/plain"});
  add({Prim::matmul, "matmul/shared_weight_transposed", {real({2, 3, 4}), real({5, 4})},
       [](T tp, V v) { return matmul(tp, v[0], v[1], false, true); }, true, ""});  // x @ W^T: one GEMM
  add({Prim::gather_rows, "gather_rows", {real({5, 3}), ids({4}, 5)},
       [](T tp, V v) { return gather_rows(tp, v[0], v[1]); }, true, "index.json:gather_rows/repeated_ids"});
  add({Prim::pick, "pick", {real({4, 5}), ids({4}, 5)}, [](T tp, V v) { return pick(tp, v[0], v[1]); }, true,
       "index.json:pick/ignored_row"});
  add({Prim::softmax, "softmax", {real({3, 5}, -2, 2)}, [](T tp, V v) { return softmax(tp, v[0]); }, true,
       "softmax.json:softmax/matrix"});
  add({Prim::softmax, "log_softmax", {real({3, 5}, -2, 2)}, [](T tp, V v) { return log_softmax(tp, v[0]); }, true,
       "softmax.json:log_softmax/matrix"});
  // mean cross-entropy against its composite, -mean(pick(log_softmax(x), t))
  add({Prim::cross_entropy, "cross_entropy", {real({2, 3, 6}, -2, 2), ids({2, 3}, 6)},
       [](T tp, V v) { return softmax_cross_entropy(tp, v[0], v[1]); }, true, "",
       [](T tp, V v) {
         GVar lp = log_softmax(tp, reshape(tp, v[0], {6, 6}));
         return scale(tp, sum(tp, pick(tp, lp, reshape(tp, v[1], {6}))), -1.0 / 6);
       }});

  // ---- random ---------------------------------------------------------------------------------
  add({Prim::bernoulli, "bernoulli", {key()}, [](T tp, V v) { return bernoulli(tp, 0.3, Shape{4, 5}, v[0]); }, false, ""});
  add({Prim::dropout, "dropout", {real(m), key()}, [](T tp, V v) { return dropout_mask_mul(tp, v[0], 0.25, v[1]); }, true, ""});

  // ---- fused, each against its composite --------------------------------------------------------
  add({Prim::rmsnorm, "rmsnorm", {real({2, 3, 8}), real({8}, 0.5, 1.5)},
       [](T tp, V v) { return fused_rmsnorm(tp, v[0], v[1], 1e-5); }, true, "",
       [](T tp, V v) { return reference::rmsnorm(tp, v[0], v[1], 1e-5); }});
  add({Prim::rope, "rope", {real({2, 5, 8})},
       [](T tp, V v) {
         RopeVars r = rope_fill(tp, 5, 6);  // dims 6 of 8: the last two features pass through
         return fused_rope(tp, v[0], r.cos, r.sin);
       },
       true, "",
       [](T tp, V v) {
         RopeVars r = rope_fill(tp, 5, 6);
         return reference::rope(tp, v[0], r.cos, r.sin);
       }});
  // grouped-query attention with an additive mask: B 2, T 4, 4 query heads on 2 kv heads, hd 3
  add({Prim::attention, "attention", {real({2, 4, 12}), real({2, 4, 6}), real({2, 4, 6}), constant({4, 4}, -2, 0)},
       [](T tp, V v) { return fused_attention(tp, v[0], v[1], v[2], v[3], 4, 4, 2, 3, 0.6); }, true, "",
       [](T tp, V v) { return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, v[3], 4, 4, 2, 3, 0.6); }});
  if constexpr (detail::HasFlashAttention<B>)
    add({Prim::flash_attention, "flash_attention/causal", {real({2, 5, 8}), real({2, 5, 4}), real({2, 5, 4})},
         [](T tp, V v) { return flash_attention(tp, v[0], v[1], v[2], 5, 4, 2, 2, 0.7, true); }, true, "",
         [](T tp, V v) {
           return reference::gqa_attention(tp, v[0], v[1], v[2], GVar{}, GVar{}, causal_mask_fill(tp, 5), 5, 4, 2, 2,
                                           0.7);
         }});
  add({Prim::swiglu, "swiglu", {real({3, 8}, -3, 3), real({3, 8})},
       [](T tp, V v) { return fused_swiglu(tp, v[0], v[1]); }, true, "",
       [](T tp, V v) { return reference::swiglu(tp, v[0], v[1]); }});
  // An elementwise chain (bias add with broadcasting, scale, silu, a product that reads an input
  // twice) run as one fused node (nn::fuse_elementwise: the CPU's tiled loop, or one CUDA kernel
  // per direction): equal to the chain unfused, bit for bit.
  auto chain = [](T tp, V v) { return mul(tp, silu(tp, scale(tp, nn::add(tp, v[0], v[1]), 0.5)), v[0]); };
  add({Prim::fused, "fused", {real({3, 8}, -3, 3), real({8})},
       [chain](T tp, V v) {
         const GVar y = chain(tp, v);
         fuse_elementwise(tp, y);
         return y;
       },
       true, "", chain, Tol{.composite64 = 0, .composite32 = 0}});
  // A where inside a group: its mask (u8, broadcast along the rows) stays an input of the group.
  auto chain_where = [](T tp, V v) { return where(tp, v[2], scale(tp, v[0], 0.5), neg(tp, nn::add(tp, v[0], v[1]))); };
  add({Prim::fused, "fused_where", {real({3, 8}, -3, 3), real({8}), mask({8})},
       [chain_where](T tp, V v) {
         const GVar y = chain_where(tp, v);
         fuse_elementwise(tp, y);
         return y;
       },
       true, "", chain_where, Tol{.composite64 = 0, .composite32 = 0}});

  // ---- quantized matrices: against matmul / gather_rows of the dequantized matrix ---------------
  // W (48, 64) drawn once, quantized in x's dtype (affine 32/4, or mxfp4), on B's device.
  struct QW {
    GVar wq, s;
    std::optional<GVar> b;
    Tensor w;  // dequantized, x's dtype, on B's device
  };
  auto qw = [](T tp, DType dt, Quant q) {
    const QuantizedMatrix m = quantize(random_tensor(Shape{48, 64}, dt, 77, -2, 2), q);
    QW r{tp.constant(m.weight.to(B::device)), tp.constant(m.scales.to(B::device)), std::nullopt,
         dequantize(m, dt).to(B::device)};
    if (m.biases.defined()) r.b = tp.constant(m.biases.to(B::device));
    return r;
  };
  for (const Quant q : {Quant::affine(32, 4), Quant::mxfp4()}) {
    const std::string tag = q == Quant::mxfp4() ? "mxfp4" : "affine32x4";
    for (const bool tr : {true, false})
      add({Prim::quantized_matmul, "quantized_matmul/" + tag + (tr ? "/x_Wt" : "/x_W"), {real({2, 3, tr ? 64 : 48})},
           [=](T tp, V v) {
             QW w = qw(tp, tp.dtype(v[0]), q);
             return quantized_matmul(tp, v[0], w.wq, w.s, w.b, q, tr);
           },
           true, "",
           [=](T tp, V v) { return matmul(tp, v[0], tp.constant(qw(tp, tp.dtype(v[0]), q).w), false, tr); }});
  }
  // the LM head's product and cross-entropy in one primitive, against the two ops: a dense head
  // (x's and W's gradients), and a quantized one with keep weights (x's)
  if constexpr (detail::HasLinearCrossEntropy<B>) {
    add({Prim::linear_cross_entropy, "linear_cross_entropy/dense", {real({2, 3, 8}), real({300, 8}), ids({2, 3}, 300)},
         [](T tp, V v) { return fused_linear_cross_entropy(tp, v[0], HeadVars(v[1]), v[2]); }, true, "",
         [](T tp, V v) { return detail::linear_cross_entropy_composite(tp, v[0], HeadVars(v[1]), v[2], GVar{}, Reduction::mean, -100); }});
    add({Prim::linear_cross_entropy, "linear_cross_entropy/quantized_keep", {real({2, 3, 64}), ids({2, 3}, 48), constant({2, 3}, 0, 2)},
         [=](T tp, V v) {
           QW w = qw(tp, tp.dtype(v[0]), Quant::affine(32, 4));
           return fused_linear_cross_entropy(tp, v[0], HeadVars(w.wq, w.s, w.b, Quant::affine(32, 4)), v[1], v[2], Reduction::sum);
         },
         true, "",
         [=](T tp, V v) {
           const GVar w = tp.constant(qw(tp, tp.dtype(v[0]), Quant::affine(32, 4)).w);
           return detail::linear_cross_entropy_composite(tp, v[0], HeadVars(w), v[1], v[2], Reduction::sum, -100);
         }});
  }
  add({Prim::quantized_gather, "quantized_gather", {ids({2, 5}, 48)},
       [=](T tp, V v) {
         QW w = qw(tp, tp.float_dtype(), Quant::affine(32, 4));
         return quantized_gather(tp, v[0], w.wq, w.s, w.b, Quant::affine(32, 4), tp.float_dtype());
       },
       false, "",
       [=](T tp, V v) { return gather_rows(tp, tp.constant(qw(tp, tp.float_dtype(), Quant::affine(32, 4)).w), v[0]); }});
  return c;
}

}  // namespace nn::test::registry
