// SPDX-License-Identifier: MIT OR Apache-2.0
// finetune without CUDA: make_cuda_trainer (trainer.hpp) says how to get it. finetune_cuda links
// cuda_trainer.cu in this file's place, so both programs share main.cpp's one compiled object
// (CMakeLists.txt: finetune_main) and differ in this one small translation unit.
#include <nn/config.hpp>

#include <memory>

namespace nn::lm {
struct CausalLM;
}

namespace finetune {

struct Options;
class Trainer;

std::unique_ptr<Trainer> make_cuda_trainer(const Options&, nn::lm::CausalLM&) {
  nn::detail::fail("finetune", "--device cuda: this finetune was built without CUDA (build the finetune_cuda "
                   "target: CMake with nvcc found, -DNN_WITH_CUDA=ON)");
}

}  // namespace finetune
