// SPDX-License-Identifier: MIT OR Apache-2.0
// Per-layer gradient checkpointing of the decoder (CausalLM::grad_checkpoint, finetune
// --grad-checkpoint): the loss and every gradient equal those without it bit for bit, for the
// Llama and the Qwen2-style fixtures (q/k/v biases, tied head), in f32 and f64, full and LoRA,
// eager and compiled; and the tape holds less.
#include "support/lm_step.hpp"

namespace lm_grad_checkpoint {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using test::lm_batch;
using test::lm_loss;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

std::vector<std::pair<std::string, std::string>> grad_bytes(const lm::CausalLM& grads) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [p, t] : grads.parameters())
    if (t.defined()) out.emplace_back(p, std::string(static_cast<const char*>(t.raw()), t.nbytes()));
  return out;
}

}  // namespace

TEST_CASE("grad_checkpoint: the decoder's loss and gradients are bitwise those without it") {
  for (const char* name : {"llama", "qwen2"})
    for (DType dt : {DType::f32, DType::f64})
      for (bool lora : {false, true}) {
        CAPTURE(name);
        CAPTURE(dtype_name(dt));
        CAPTURE(lora);
        lm::CausalLM m = lm::load_hf(kModels + "/" + name, dt);
        if (lora) test::make_lora<Linear>(m);
        const test::LmBatch bt = lm_batch(m);
        auto run = [&](bool ckpt) {
          m.grad_checkpoint(ckpt);
          return value_and_grad(m, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
            return lm_loss(tp, mm, tp.input(bt.ids), tp.input(bt.mask), tp.input(bt.targets));
          });
        };
        auto [l0, g0] = run(false);
        auto [l1, g1] = run(true);
        CHECK(l0.item() == l1.item());
        const auto b0 = grad_bytes(g0), b1 = grad_bytes(g1);
        REQUIRE(b0.size() == b1.size());
        CHECK(b0.size() > (lora ? 7u : 20u));
        for (std::size_t i = 0; i < b0.size(); ++i)
          CHECK_MESSAGE(b0[i].second == b1[i].second, b0[i].first << "'s gradient differs with grad_checkpoint");
      }
}

TEST_CASE("grad_checkpoint: a compiled LoRA step equals the eager one and re-records when switched") {
  lm::CausalLM eager = lm::load_hf(kModels + "/qwen2", DType::f32), compiled = lm::load_hf(kModels + "/qwen2", DType::f32);
  random::seed(1);  // the same lora_a draws for both
  test::make_lora<Linear>(eager);
  random::seed(1);
  test::make_lora<Linear>(compiled);
  compiled.grad_checkpoint(true);
  Adam opt_e(1e-2), opt_c(1e-2);
  auto step = compile<3>(compiled, opt_c, [](GTape<cpu>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar tg) {
    return lm_loss(tp, m, ids, mask, tg);
  });
  test::step_alongside_eager(eager, opt_e, step, 3);
  CHECK(step.recordings() == 1);
  CHECK(test::flat_values(eager) == test::flat_values(compiled));
  compiled.grad_checkpoint(false);
  const test::LmBatch bt = lm_batch(eager);
  step(bt.ids, bt.mask, bt.targets);
  CHECK(step.recordings() == 2);
}

TEST_CASE("grad_checkpoint: the decoder's tape holds less (GTape::bytes)") {
  lm::CausalLM m = lm::load_hf(kModels + "/llama", DType::f32);
  const test::LmBatch bt = lm_batch(m);
  auto held = [&](bool ckpt) {
    m.grad_checkpoint(ckpt);
    GTape<cpu> tp;
    GVar loss = lm_loss(tp, m, tp.input(bt.ids), tp.input(bt.mask), tp.input(bt.targets));
    tp.backward(loss);
    return tp.bytes();
  };
  const std::size_t without = held(false), with = held(true);
  MESSAGE("2-layer fixture decoder, tape bytes after backward: " << without << " without, " << with << " with grad_checkpoint");
  CHECK(with < without);
}

}  // namespace lm_grad_checkpoint
