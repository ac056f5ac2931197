// SPDX-License-Identifier: MIT OR Apache-2.0
// --device cuda: the finetune's Trainer (trainer.hpp) on GTape<nn::cuda>. The one translation
// unit of finetune_cuda that nvcc compiles; main.cpp (the object finetune shares, built by the
// host compiler) reaches it through make_cuda_trainer alone, as finetune reaches no_cuda.cpp's.
#include <nn/cuda.hpp>

#include "trainer.hpp"

#include <cstdio>

namespace finetune {

std::unique_ptr<Trainer> make_cuda_trainer(const Options& a, nn::lm::CausalLM& model) {
  if (nn::cuda::device_count() == 0)
    nn::detail::fail("finetune", "--device cuda: no CUDA device (cudaGetDeviceCount found none; --device cpu trains "
                     "on the CPU)");
  cudaDeviceProp prop{};
  if (cudaGetDeviceProperties(&prop, 0) == cudaSuccess)
    std::printf("cuda: %s (sm_%d%d, %.1f GiB)\n", prop.name, prop.major, prop.minor,
                static_cast<double>(prop.totalGlobalMem) / (1024.0 * 1024.0 * 1024.0));
  return std::make_unique<TrainerOn<nn::cuda>>(a, model);
}

}  // namespace finetune
