// SPDX-License-Identifier: MIT OR Apache-2.0
// The compiled step's memory plan (CompiledStep::plan_memory, on by default on the CPU) on the
// decoder: a planned step gives the eager step's losses and weights bit for bit, for the Llama
// and the Qwen2-style fixtures, f32 and f64, full and LoRA, over a float or a 4-bit base, with
// and without per-layer checkpointing; it
// holds less than the unplanned step; switching it records again.
#include "support/check.hpp"

#include <nn/lm/load.hpp>

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

GVar lm_loss(GTape<cpu>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar targets) {
  return cross_entropy_rows(tp, m.logits(tp, ids, mask), targets, 6);
}

struct Batch {
  Tensor ids, mask, targets;
};
// A fixed right-padded batch of 2 x 7 ids; `shift` makes another.
Batch batch(const lm::CausalLM& m, std::int64_t shift) {
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

// LoRA rank 4 on q_proj and v_proj over L (Linear, or QuantizedLinear: QLoRA), lora_b random.
template <class L>
void make_lora(lm::CausalLM& m) {
  m.freeze();
  m.map_modules<L>([](const std::string& p) { return p.ends_with("q_proj") || p.ends_with("v_proj"); },
                   [&m](const std::string& p, L& l) {
                     LoraLinear a = LoraLinear::from_base(l, 4);
                     a.lora_b = test::random_tensor({4, a.lora_b.value.dim(1)}, m.dtype(), std::hash<std::string>{}(p));
                     return a;
                   });
}

enum class Kind { full, lora, qlora };

lm::CausalLM make(const char* name, DType dt, Kind kind) {
  lm::CausalLM m = lm::load_hf(kModels + "/" + name, dt);
  if (kind == Kind::qlora) quantize(m, Quant::affine(32, 4), [](const std::string& p) { return p.find("layers.") != std::string::npos; });
  random::seed(1);  // the same lora_a draws for every copy
  if (kind == Kind::lora) make_lora<Linear>(m);
  if (kind == Kind::qlora) make_lora<QuantizedLinear>(m);
  return m;
}

}  // namespace

TEST_CASE("memory plan: a planned compiled decoder step equals the eager step bit for bit") {
  for (const char* name : {"llama", "qwen2"})
    for (DType dt : {DType::f32, DType::f64})
      for (Kind kind : {Kind::full, Kind::lora, Kind::qlora})
        for (bool ckpt : {false, true}) {  // with checkpoint segments, planned around the segment pool
          if (kind == Kind::qlora && dt == DType::f64) continue;  // quantized scales are float32 here
          CAPTURE(ckpt);
          CAPTURE(name);
          CAPTURE(dtype_name(dt));
          CAPTURE(static_cast<int>(kind));
          lm::CausalLM eager = make(name, dt, kind), compiled = make(name, dt, kind);
          compiled.grad_checkpoint(ckpt);
          AdamW opt_e(1e-2), opt_c(1e-2);
          auto step = compile<3>(compiled, opt_c, [](GTape<cpu>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar tg) {
            return lm_loss(tp, m, ids, mask, tg);
          });
          for (int i = 0; i < 3; ++i) {
            const Batch bt = batch(eager, i);
            auto [l, g] = value_and_grad(eager, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
              return lm_loss(tp, mm, tp.input(bt.ids), tp.input(bt.mask), tp.input(bt.targets));
            });
            opt_e.update(eager, g);
            CHECK(step(bt.ids, bt.mask, bt.targets).item() == l.item());
          }
          CHECK(step.recordings() == 1);
          CHECK(test::flat_values(eager) == test::flat_values(compiled));
        }
}

TEST_CASE("memory plan: the planned step holds less, and switching the plan records again") {
  lm::CausalLM m = make("llama", DType::f32, Kind::lora);
  Adam opt(1e-3);
  auto step = compile<3>(m, opt, [](GTape<cpu>& tp, const lm::CausalLM& mm, GVar ids, GVar mask, GVar tg) {
    return lm_loss(tp, mm, ids, mask, tg);
  });
  const Batch bt = batch(m, 0);
  const double planned_loss = step(bt.ids, bt.mask, bt.targets).item();
  const std::size_t planned = step.tape().bytes();
  step.plan_memory(false);
  step(bt.ids, bt.mask, bt.targets);
  const std::size_t unplanned = step.tape().bytes();
  CHECK(step.recordings() == 2);
  MESSAGE("2-layer fixture decoder with LoRA, compiled step tape bytes: " << planned << " planned, " << unplanned << " not");
  CHECK(planned * 2 < unplanned);
  CHECK(std::isfinite(planned_loss));
}
