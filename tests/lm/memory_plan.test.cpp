// SPDX-License-Identifier: MIT OR Apache-2.0
// The compiled step's memory plan (CompiledStep::plan_memory, on by default on the CPU) on the
// decoder: a planned step gives the eager step's losses and weights bit for bit, for the Llama
// and the Qwen2-style fixtures, f32 and f64, full, LoRA and DoRA, over a float or a 4-bit base, with
// and without per-layer checkpointing; it
// holds less than the unplanned step; switching it records again.
#include "support/lm_step.hpp"

namespace lm_memory_plan {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using test::lm_batch;
using test::lm_loss;
using test::make_lora;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

enum class Kind { full, lora, qlora, dora, qdora };

lm::CausalLM make(const char* name, DType dt, Kind kind) {
  lm::CausalLM m = lm::load_hf(kModels + "/" + name, dt);
  if (kind == Kind::qlora || kind == Kind::qdora) quantize(m, Quant::affine(32, 4), [](const std::string& p) { return p.find("layers.") != std::string::npos; });
  random::seed(1);  // the same lora_a draws for every copy
  if (kind == Kind::lora) make_lora<Linear>(m);
  if (kind == Kind::qlora) make_lora<QuantizedLinear>(m);
  if (kind == Kind::dora) make_lora<Linear, DoraLinear>(m);
  if (kind == Kind::qdora) make_lora<QuantizedLinear, DoraLinear>(m);
  return m;
}

}  // namespace

TEST_CASE("memory plan: a planned compiled decoder step equals the eager step bit for bit") {
  for (const char* name : {"llama", "qwen2"})
    for (DType dt : {DType::f32, DType::f64})
      for (Kind kind : {Kind::full, Kind::lora, Kind::qlora, Kind::dora, Kind::qdora})
        for (bool ckpt : {false, true}) {  // with checkpoint segments, planned around the segment pool
          if ((kind == Kind::qlora || kind == Kind::qdora) && dt == DType::f64) continue;  // quantized scales are float32 here
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
          test::step_alongside_eager(eager, opt_e, step, 3);
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
  const test::LmBatch bt = lm_batch(m);
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

}  // namespace lm_memory_plan
