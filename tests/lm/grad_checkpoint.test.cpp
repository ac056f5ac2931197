// SPDX-License-Identifier: MIT OR Apache-2.0
// Per-layer gradient checkpointing of the decoder (CausalLM::grad_checkpoint, finetune
// --grad-checkpoint): the loss and every gradient equal those without it bit for bit, for the
// Llama and the Qwen2-style fixtures (q/k/v biases, tied head), in f32 and f64, full and LoRA,
// eager and compiled; and the tape holds less.
#include "support/check.hpp"

#include <nn/lm/load.hpp>

using namespace nn;

namespace {

const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";

// The next-token loss on a fixed right-padded batch of 2 x 7 ids.
template <class B>
GVar lm_loss(GTape<B>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar targets) {
  return cross_entropy_rows(tp, m.logits(tp, ids, mask), targets, 6);
}

struct Batch {
  Tensor ids, mask, targets;
};
Batch batch(const lm::CausalLM& m) {
  std::vector<std::int64_t> ids, tg;
  std::vector<double> keep;
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 7; ++t) {
      ids.push_back((b * 13 + t * 5 + 1) % m.config().vocab_size);
      keep.push_back(b == 1 && t >= 5 ? 0.0 : 1.0);
    }
  for (std::int64_t b = 0; b < 2; ++b)
    for (std::int64_t t = 0; t < 6; ++t) tg.push_back(keep[static_cast<std::size_t>(b * 7 + t + 1)] != 0 ? ids[static_cast<std::size_t>(b * 7 + t + 1)] : -100);
  Batch out;
  out.ids = Tensor::from<std::int64_t>({2, 7}, ids);
  out.mask = attention_mask_fill(Tensor::from_doubles({2, 7}, keep, DType::f32), m.dtype());
  out.targets = Tensor::from<std::int64_t>({2, 6}, tg);
  return out;
}

std::vector<std::pair<std::string, std::string>> grad_bytes(const lm::CausalLM& grads) {
  std::vector<std::pair<std::string, std::string>> out;
  for (const auto& [p, t] : grads.parameters())
    if (t.defined()) out.emplace_back(p, std::string(static_cast<const char*>(t.raw()), t.nbytes()));
  return out;
}

void make_lora(lm::CausalLM& m) {
  m.freeze();
  m.map_modules<Linear>([](const std::string& p) { return p.ends_with("q_proj") || p.ends_with("v_proj"); },
                        [](const std::string& p, Linear& l) {
                          LoraLinear a = LoraLinear::from_base(l, 4);
                          a.lora_b = test::random_tensor({4, l.out_features()}, l.weight.value.dtype(), std::hash<std::string>{}(p));
                          return a;
                        });
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
        if (lora) make_lora(m);
        const Batch bt = batch(m);
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
  make_lora(eager);
  random::seed(1);
  make_lora(compiled);
  compiled.grad_checkpoint(true);
  const Batch bt = batch(eager);
  Adam opt_e(1e-2), opt_c(1e-2);
  auto step = compile<3>(compiled, opt_c, [](GTape<cpu>& tp, const lm::CausalLM& m, GVar ids, GVar mask, GVar tg) {
    return lm_loss(tp, m, ids, mask, tg);
  });
  for (int i = 0; i < 3; ++i) {
    auto [l, g] = value_and_grad(eager, [&](GTape<cpu>& tp, const lm::CausalLM& mm) {
      return lm_loss(tp, mm, tp.input(bt.ids), tp.input(bt.mask), tp.input(bt.targets));
    });
    opt_e.update(eager, g);
    CHECK(step(bt.ids, bt.mask, bt.targets).item() == l.item());
  }
  CHECK(step.recordings() == 1);
  CHECK(test::flat_values(eager) == test::flat_values(compiled));
  compiled.grad_checkpoint(false);
  step(bt.ids, bt.mask, bt.targets);
  CHECK(step.recordings() == 2);
}

TEST_CASE("grad_checkpoint: the decoder's tape holds less (GTape::bytes)") {
  lm::CausalLM m = lm::load_hf(kModels + "/llama", DType::f32);
  const Batch bt = batch(m);
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
