// SPDX-License-Identifier: MIT OR Apache-2.0
// CausalLM::loss / head_loss: the next-token loss with the LM head and the cross-entropy in one
// primitive (linear_cross_entropy, no logits stored) equals cross_entropy over logits(), loss and
// LoRA gradients, for an untied (llama) and a tied (qwen2) head, float and 4-bit, float32 and
// float64, eager and in a compiled step; a trainable head keeps the logits.
#include "support/lm_step.hpp"

namespace lm_head_loss {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

lm::CausalLM make(const char* name, DType dt, bool quantized) {
  lm::CausalLM m = lm::load_hf(kModels + "/" + name, dt);
  if (quantized) quantize(m, Quant::affine(32, 4), [](const std::string&) { return true; });  // the head too
  random::seed(1);
  if (quantized) test::make_lora<QuantizedLinear>(m);
  else test::make_lora<Linear>(m);
  return m;
}

struct Batch {
  Tensor ids, targets, keep;
};
Batch batch(DType dt) {
  std::vector<std::int64_t> ids, tg;
  for (std::int64_t i = 0; i < 14; ++i) ids.push_back((i * 37 + 11) % 64);
  for (std::int64_t i = 0; i < 14; ++i) tg.push_back(i % 7 == 6 ? -100 : ids[static_cast<std::size_t>(i + 1)]);
  return {Tensor::from<std::int64_t>({2, 7}, ids), Tensor::from<std::int64_t>({2, 7}, tg),
          Tensor::from_doubles({2, 7}, {0, 0, 1, 1, 1, 1, 1, /**/ 0, 1, 1, 1, 0.5, 0, 0}, dt)};
}

// The gradient tree's defined leaves (the trainable ones), flattened in tree order.
std::vector<double> grads(const lm::CausalLM& g) {
  std::vector<double> out;
  for (const auto& [p, t] : g.parameters())
    if (t.defined())
      for (double v : t.to_doubles()) out.push_back(v);
  return out;
}

// How many nodes of primitive p a tape holds.
int count(const GTape<cpu>& tp, Prim p) {
  int n = 0;
  for (std::size_t i = 0; i < tp.size(); ++i) {
    const auto& node = tp.node(GVar{&tp, static_cast<std::int32_t>(i)});
    n += node.def && node.def->prim == p;
  }
  return n;
}

}  // namespace

TEST_CASE("CausalLM::loss equals cross_entropy over the logits: tied and untied heads, float and 4-bit, LoRA") {
  for (const char* name : {"llama", "qwen2"})
    for (DType dt : {DType::f64, DType::f32})
      for (bool quantized : {false, true}) {
        CAPTURE(name);
        CAPTURE(dtype_name(dt));
        CAPTURE(quantized);
        lm::CausalLM m = make(name, dt, quantized);
        const Batch b = batch(dt);
        for (Reduction r : {Reduction::mean, Reduction::sum}) {
          auto [lf, gf] = value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
            const GVar l = mm.loss(tp, tp.input(b.ids), tp.input(b.targets), tp.input(b.keep), r);
            CHECK(count(tp, Prim::linear_cross_entropy) == 1);
            return l;
          });
          auto [lc, gc] = value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
            return cross_entropy(tp, mm.logits(tp, tp.input(b.ids)), tp.input(b.targets), tp.input(b.keep), r);
          });
          const double tol = dt == DType::f64 ? 1e-12 : 2e-5;
          CHECK(test::rel_err(lf, lc) <= tol);
          const std::vector<double> a = grads(gf), c = grads(gc);
          CHECK(a.size() == c.size());
          CHECK(!a.empty());
          CHECK(test::rel_err(a, c) <= tol);
        }
      }
}

TEST_CASE("CausalLM::loss in a compiled step (the gradient formed in the forward) equals the eager steps bit for bit") {
  for (bool quantized : {false, true}) {
    CAPTURE(quantized);
    lm::CausalLM eager = make("qwen2", DType::f32, quantized), compiled = make("qwen2", DType::f32, quantized);
    AdamW opt_e(1e-2), opt_c(1e-2);
    auto step = compile<3>(compiled, opt_c, [](GTape<cpu>& tp, const lm::CausalLM& m, GVar ids, GVar tg, GVar keep) {
      return m.loss(tp, ids, tg, keep);
    });
    const Batch b = batch(DType::f32);
    for (int i = 0; i < 3; ++i) {
      auto [l, g] = value_and_grad(eager, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
        return mm.loss(tp, tp.input(b.ids), tp.input(b.targets), tp.input(b.keep));
      });
      opt_e.update(eager, g);
      CHECK(step(b.ids, b.targets, b.keep).item() == l.item());
    }
    CHECK(test::flat_values(eager) == test::flat_values(compiled));
  }
}

TEST_CASE("CausalLM::loss keeps the logits for a trainable head, and for Gemma 2's soft cap") {
  lm::CausalLM m = lm::load_hf(kModels + "/llama", DType::f64);  // every weight trainable
  const Batch b = batch(DType::f64);
  GTape<cpu> tp;
  tp.backward(m.loss(tp, tp.input(b.ids), tp.input(b.targets), tp.input(b.keep)));
  CHECK(count(tp, Prim::linear_cross_entropy) == 0);
  CHECK(count(tp, Prim::cross_entropy) == 1);
  lm::CausalLM g = lm::load_hf(kModels + "/gemma2", DType::f64);  // final_logit_softcapping
  g.freeze();
  GTape<cpu> tg;
  const GVar l = g.loss(tg, tg.input(b.ids), tg.input(b.targets), tg.input(b.keep));
  CHECK(count(tg, Prim::linear_cross_entropy) == 0);
  CHECK(std::isfinite(tg.value(l).item()));
}

}  // namespace lm_head_loss
