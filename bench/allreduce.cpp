// SPDX-License-Identifier: MIT OR Apache-2.0
// The cost of data parallelism per step: nn::distributed::GradientAverager on the gradient trees
// of the two workloads (the finetune's LoRA adapters on SmolLM2-135M; the decoder bench's full
// model), timed over the ranks it is launched with. bench/run_allreduce.sh runs it at 2 ranks
// over shared memory and over TCP on loopback.
//
//   mpirun -np 2 bench_allreduce [--rounds 30] [--bucket-mib 32]
//
// Per workload: the bytes each rank contributes, the buckets (allreduces) per step, and the
// median and best time of one averaging (weight sum, layout check, scale, pack, allreduce,
// unpack), with the bus bandwidth of a ring allreduce, 2 (N - 1) / N x bytes / time.
#include <nn/distributed.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

struct Workload {
  const char* name;
  std::vector<std::int64_t> leaves;  // element counts, float32, in tree order
};

// LoRA rank 8 on q_proj (576 -> 576) and v_proj (576 -> 192) of SmolLM2-135M's 30 layers.
Workload finetune_lora() {
  Workload w{"finetune LoRA (SmolLM2-135M, q/v, rank 8)", {}};
  for (int l = 0; l < 30; ++l)
    for (std::int64_t out : {576, 192}) w.leaves.insert(w.leaves.end(), {8 * 576, out * 8});
  return w;
}

// bench_decoder's model, every parameter trained (vocab 8192, width 256, 4 layers, GQA 8/2 x 32,
// SwiGLU 704, untied head).
Workload decoder_full() {
  Workload w{"decoder full step (bench_decoder)", {8192 * 256}};
  for (int l = 0; l < 4; ++l)
    w.leaves.insert(w.leaves.end(), {256, 256 * 256, 64 * 256, 64 * 256, 256 * 256, 256, 704 * 256, 704 * 256, 256 * 704});
  w.leaves.insert(w.leaves.end(), {256, 8192 * 256});
  return w;
}

}  // namespace

int main(int argc, char** argv) {
  int rounds = 30;
  double bucket_mib = 32;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i];
    if (k == "--rounds") rounds = std::atoi(argv[i + 1]);
    else if (k == "--bucket-mib") bucket_mib = std::atof(argv[i + 1]);
  }
  const nn::distributed::Group world = nn::distributed::init();
  const bool lead = world.rank() == 0;
  if (lead) {
    bench::print_cpu_info();
    std::printf("# %d ranks, MPI %s, btl %s, bucket %.0f MiB, %d rounds\n", world.size(),
                nn::distributed::with_mpi() ? "on" : "off", std::getenv("OMPI_MCA_btl") ? std::getenv("OMPI_MCA_btl") : "default",
                bucket_mib, rounds);
    std::printf("| workload | MB per rank | allreduces | median ms | best ms | bus GB/s (median) |\n|---|---|---|---|---|---|\n");
  }
  for (const Workload& w : {finetune_lora(), decoder_full()}) {
    std::vector<nn::Tensor> grads;
    std::vector<nn::GradBuffer> slots;
    for (std::size_t i = 0; i < w.leaves.size(); ++i)
      grads.push_back(nn::Tensor::full(nn::Shape{w.leaves[i]}, 1.0 + world.rank(), nn::DType::f32));
    for (std::size_t i = 0; i < grads.size(); ++i) slots.push_back({"leaf." + std::to_string(i), &grads[i]});
    nn::distributed::GradientAverager avg(world, static_cast<std::size_t>(bucket_mib * (1 << 20)));
    avg(slots);  // plans the buckets
    std::vector<double> ms;
    for (int r = 0; r < rounds; ++r) {
      world.barrier();
      const auto t0 = std::chrono::steady_clock::now();
      avg(slots);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
    }
    // every rank's times: the slowest rank's is the step's
    for (double& m : ms) {
      nn::Tensor t = nn::Tensor::scalar(m, nn::DType::f64);
      nn::Tensor all = world.all_gather(t);
      const std::vector<double> v = all.to_doubles();
      m = *std::max_element(v.begin(), v.end());
    }
    std::sort(ms.begin(), ms.end());
    std::int64_t n = 0;
    for (std::int64_t e : w.leaves) n += e;
    const double mb = static_cast<double>(n) * 4 / 1e6, med = ms[ms.size() / 2];
    const double bus = 2.0 * (world.size() - 1) / world.size() * mb / 1e3 / (med / 1e3);
    if (lead)
      std::printf("| %s | %.2f | %d | %.3f | %.3f | %.2f |\n", w.name, mb, avg.buckets(), med, ms.front(), bus);
  }
  return 0;
}
