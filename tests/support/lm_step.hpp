// SPDX-License-Identifier: MIT OR Apache-2.0
// What the decoder tests that compare a compiled step with the eager one share: the loss, a
// fixed padded batch, a LoRA conversion with random lora_b, and the lock-step loop.
#pragma once

#include "support/check.hpp"

#include <nn/lm/load.hpp>

namespace nn::test {

// The next-token loss on a right-padded batch of 2 x 7 ids (6 targets a row).
template <class B>
GVar lm_loss(GTape<B>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar targets) {
  return cross_entropy_rows(tp, m.logits(tp, ids, mask), targets, 6);
}

struct LmBatch {
  Tensor ids, mask, targets;  // ids: (2, 7); mask: the additive attention mask; targets: (2, 6), -100 on padding
};
// A fixed right-padded batch (row 1 padded after 5 ids); `shift` makes another.
inline LmBatch lm_batch(const lm::CausalLM& m, std::int64_t shift = 0) {
  std::vector<std::int64_t> ids, tg;
  std::vector<double> keep;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 7; ++t) {
      ids.push_back((b * 13 + t * 5 + 1 + shift) % m.config().vocab_size);
      keep.push_back(b == 1 && t >= 5 ? 0.0 : 1.0);
    }
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 6; ++t)
      tg.push_back(keep[static_cast<std::size_t>(b * 7 + t + 1)] != 0 ? ids[static_cast<std::size_t>(b * 7 + t + 1)] : -100);
  return {Tensor::from<std::int64_t>({2, 7}, ids), attention_mask_fill(Tensor::from_doubles({2, 7}, keep, DType::f32), m.dtype()),
          Tensor::from<std::int64_t>({2, 6}, tg)};
}

// LoRA rank 4 on q_proj and v_proj over L (Linear, or QuantizedLinear: QLoRA), lora_b random
// (seeded by the path, so two copies get the same; lora_a comes from nn::random). Adapter
// DoraLinear: DoRA the same way.
template <class L, class Adapter = LoraLinear>
void make_lora(lm::CausalLM& m) {
  m.freeze();
  m.map_modules<L>([](const std::string& p) { return p.ends_with("q_proj") || p.ends_with("v_proj"); },
                   [&m](const std::string& p, L& l) {
                     Adapter a = Adapter::from_base(l, 4);
                     a.lora_b = random_tensor({4, a.lora_b.value.dim(1)}, m.dtype(), std::hash<std::string>{}(p));
                     return a;
                   });
}

// `steps` optimizer steps on `eager` (value_and_grad, then opt_e) beside `step` (a compiled
// step over another copy with its own optimizer), batch lm_batch(eager, i) at step i: the losses
// must be equal bit for bit at every step. The caller compares the weights.
template <class Opt, class Step>
void step_alongside_eager(lm::CausalLM& eager, Opt& opt_e, Step& step, int steps) {
  for (int i = 0; i < steps; ++i) {
    const LmBatch bt = lm_batch(eager, i);
    auto [l, g] = value_and_grad(eager, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
      return lm_loss(tp, mm, tp.input(bt.ids), tp.input(bt.mask), tp.input(bt.targets));
    });
    opt_e.update(eager, g);
    CHECK(step(bt.ids, bt.mask, bt.targets).item() == l.item());
  }
}

// A LoRA and (dora) a DoRA step on the float32 model of a fixture folder: 3 AdamW steps of a
// compiled step beside the eager ones, losses and final weights equal bit for bit. `fuse`: the
// compiled step runs its elementwise chains fused (CompiledStep::fuse); returns what it fused.
inline FusionStats check_adapter_step_compiled_equals_eager(const std::string& folder, bool dora, bool fuse = false) {
  auto make = [&] {
    lm::CausalLM m = lm::load_hf(folder, DType::f32);
    random::seed(1);
    if (dora) make_lora<Linear, DoraLinear>(m);
    else make_lora<Linear>(m);
    return m;
  };
  lm::CausalLM eager = make(), compiled = make();
  AdamW opt_e(1e-2), opt_c(1e-2);
  auto step = compile<3>(compiled, opt_c, [](GTape<cpu>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar tg) {
    return lm_loss(tp, m, ids, mask, tg);
  });
  step.fuse(fuse);
  step_alongside_eager(eager, opt_e, step, 3);
  CHECK(flat_values(eager) == flat_values(compiled));
  if (!fuse) CHECK(step.fusion().groups == 0);
  return step.fusion();
}

// `m`'s weights (shared storage) under another config of the same shapes: a family's control
// without one of its features (the window, a cap, the local RoPE).
inline lm::CausalLM with_config(const lm::CausalLM& m, const lm::ModelConfig& c) {
  lm::CausalLM out(c, m.dtype());
  out.model = m.model;
  out.lm_head = m.lm_head;
  return out;
}

// One parameter's entries to check by central differences: `param` a float64 weight of the model,
// `grad` the same entry of its analytic gradient; `at` the flat indices (default: 3 and the middle).
struct GradProbe {
  std::string what;
  Tensor param, grad;
  std::vector<std::int64_t> at = {};
};
// lm_loss of the float64 model `m` on lm_batch(m): (loss, gradients).
inline std::pair<Tensor, lm::CausalLM> lm_batch_loss(lm::CausalLM& m) {
  const LmBatch bt = lm_batch(m);
  return value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& x) {
    return lm_loss(tp, x, tp.input(bt.ids), tp.input(bt.mask), tp.input(bt.targets));
  });
}
// Each probe's analytic gradient against the central difference (h = 1e-5) of lm_batch_loss,
// relative difference (over max(1e-6, |fd|)) within `tol`; returns the worst.
inline double check_lm_central_differences(lm::CausalLM& m, const std::vector<GradProbe>& probes, double tol = 1e-6) {
  double worst = 0;
  for (const GradProbe& p : probes)
    for (std::int64_t i : p.at.empty() ? std::vector<std::int64_t>{3, p.param.numel() / 2 + 1} : p.at) {
      double* w = static_cast<double*>(const_cast<void*>(p.param.raw())) + i;
      const double keep = *w, h = 1e-5;
      *w = keep + h;
      const double up = lm_batch_loss(m).first.item();
      *w = keep - h;
      const double down = lm_batch_loss(m).first.item();
      *w = keep;
      const double fd = (up - down) / (2 * h), an = p.grad.item(i);
      CAPTURE(p.what);
      CAPTURE(i);
      const double e = std::abs(fd - an) / std::max(1e-6, std::abs(fd));
      worst = std::max(worst, e);
      CHECK(e <= tol);
    }
  return worst;
}

// The right-padded fixture batch of tests/fixtures/lm/models/expected.safetensors ("ids",
// "keep", (2, 7)), whose logits the oracle scripts record per model.
inline const SafetensorsFile& lm_fixture_inputs() {
  static const SafetensorsFile f(std::string(NN_FIXTURES_DIR) + "/lm/models/expected.safetensors");
  return f;
}
// `m`'s logits on that batch (B, T, vocab), as a host f64 tensor.
inline Tensor lm_fixture_logits(const lm::CausalLM& m) {
  GTape<cpu> tp;
  return tp.value(m.logits(tp, tp.input(lm_fixture_inputs().tensor("ids").to(DType::i64)), lm_fixture_inputs().tensor("keep")))
      .to(DType::f64);
}

// `m` on ids (2, T) without a mask tensor -- every layer's attention in the fused kernels, so
// soft-capped and windowed layers in flash attention (CausalLM::hidden) -- against the same
// under an all-ones padding mask, which keeps those layers written out: sum(logits^2) and every
// parameter's gradient agree to `tol`. Returns the first tape's flash_attention nodes.
inline int check_flash_equals_written_out(lm::CausalLM m, std::int64_t T, double tol) {  // a copy shares the weights
  std::vector<std::int64_t> id(static_cast<std::size_t>(2 * T));
  for (std::size_t i = 0; i < id.size(); ++i) id[i] = static_cast<std::int64_t>((i * 7 + 3) % m.config().vocab_size);
  const Tensor ids = Tensor::from<std::int64_t>({2, T}, id), ones = Tensor::ones({2, T}, DType::f32);
  int flash_nodes = 0;
  auto run = [&](bool flash) {
    auto [y, g] = value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
      GVar lg = flash ? mm.logits(tp, tp.input(ids)) : mm.logits(tp, tp.input(ids), ones);
      if (flash)
        for (std::int32_t n = 0; n <= lg.index; ++n) flash_nodes += std::string(tp.node(GVar{&tp, n}).name()) == "flash_attention";
      return sum(tp, mul(tp, lg, lg));
    });
    return std::pair{y.item(), g.parameters()};
  };
  const auto [yf, gf] = run(true);
  const auto [yc, gc] = run(false);
  CHECK(std::abs(yf - yc) <= tol * std::abs(yc));
  REQUIRE(gf.size() == gc.size());
  for (std::size_t i = 0; i < gf.size(); ++i)
    if (gf[i].second.defined()) CHECK_MESSAGE(rel_err(gf[i].second, gc[i].second) <= tol, gf[i].first);
  return flash_nodes;
}

}  // namespace nn::test
