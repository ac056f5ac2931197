// SPDX-License-Identifier: MIT OR Apache-2.0
// --device cpu: the finetune's Trainer (trainer.hpp) on GTape<nn::cpu>, and the host's evaluation
// loss. A translation unit of its own, as cuda_trainer.cu is for --device cuda: the compiled
// training step's code is the heaviest the program generates, and here it compiles beside
// main.cpp (CLI, data, loading, saving, generation) on the build's other core.
#include "trainer.hpp"

#include <nn/nn.hpp>

#include <memory>

namespace finetune {

std::unique_ptr<Trainer> make_cpu_trainer(const Options& a, nn::lm::CausalLM& model) {
  return std::make_unique<TrainerOn<nn::cpu>>(a, model);
}

double host_loss_sum(const nn::lm::CausalLM& m, const nn::lm::Batch& bt) { return batch_loss_sum<nn::cpu>(m, bt); }

}  // namespace finetune
