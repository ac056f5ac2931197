// SPDX-License-Identifier: MIT OR Apache-2.0
// The reference workload, nn's side: a small Llama-style decoder trained by a compiled step,
// timed as tokens/s, achieved GFLOP/s and peak RSS; bench/decoder_torch.py is PyTorch's side
// and bench/run_decoder.sh runs both and prints the ratios.
//
//   bench_decoder [--mode full|lora|forward] [--threads N] [--steps N] [--warmup N] [--batch B] [--seq T]
//                 [--precision f32|bf16]
// --precision bf16 stores the frozen weights in bfloat16 (set_precision): the LoRA base, and in
// forward mode every weight (nothing trains there); and the tape runs every product of a float32
// weight on bf16-rounded operands (GTape::set_autocast), as torch.autocast does.
//   bench_decoder --peak [--threads N]      (the FMA peak of this machine, GFLOP/s)
//
// Model: vocab 8192, d_model 256, 4 layers, 8 query heads, 2 KV heads, head dim 32, SwiGLU hidden
// 704, RMSNorm eps 1e-5, NEOX RoPE base 10000, untied embedding and head, no biases (HF Llama),
// float32; batch 4 x sequence 256, next-token targets from a fixed splitmix64 token stream that
// decoder_torch.py reproduces. Modes: full = forward, backward and AdamW (torch.optim.AdamW's
// arithmetic: bias correction, decoupled decay 0.01) as one compiled step; lora = the same with
// q, k, v, o wrapped in LoRA (rank 8, scale 2.0) and every base weight frozen; forward = the
// loss alone (a recorded forward tape replayed, PyTorch's torch.no_grad()).
// Under mpirun (`mpirun -np 2 bench_decoder --threads 1 ...`) the full and LoRA steps run
// data-parallel: each rank takes rows r, r + N, ... of every batch of B rows and the gradients
// are averaged (nn::distributed::GradientAverager); tok_s counts the whole batch, and rank 0
// prints (ranks=N in the RESULT line).
// Prints one `RESULT key=value ...` line for run_decoder.sh. FLOPs are counted from the model's
// shapes (the same formula as decoder_torch.py), not measured.
#include <nn/nn.hpp>
#include <nn/distributed.hpp>

#include "common.hpp"
#include "decoder_model.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <fstream>
#include <string>
#include <variant>

#include <sys/resource.h>
#include <vector>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace {

using bench::batch;
using bench::cpu_seconds;
using bench::proc_status_kb;

// The model, its LoRA variant and its FLOP count: bench/decoder_model.hpp (shared with
// bench/decoder_cuda.cu).
using namespace bench::decoder;

int usage(const char* what, const std::string& arg = "") {
  std::fprintf(stderr,
               "%s%s%s\nusage: bench_decoder [--mode full|lora|forward] [--threads N] [--steps N] [--warmup N] "
               "[--batch B] [--seq T] [--precision f32|bf16]\n       bench_decoder --peak [--threads N]\n",
               what, arg.empty() ? "" : " ", arg.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "full", precision = "f32";
  int threads = 1, steps = 10, warmup = 2;
  std::int64_t B = 4, T = 256;
  bool peak = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--peak") { peak = true; continue; }
    if (i + 1 >= argc) return usage("missing value for", k);
    const std::string v = argv[++i];
    if (k == "--mode") mode = v;
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--batch") B = std::stoll(v);
    else if (k == "--seq") T = std::stoll(v);
    else if (k == "--precision") precision = v;
    else return usage("unknown option", k);
  }
  if (mode != "full" && mode != "lora" && mode != "forward") return usage("unknown mode", mode);
  if (precision != "f32" && precision != "bf16") return usage("unknown precision", precision);
  if (threads < 1 || steps < 1 || warmup < 1 || B < 1 || T < 2) return usage("sizes must be positive");
  const nn::distributed::Group world = nn::distributed::init();
  if (world.size() > 1 && (mode == "forward" || B % world.size() != 0))
    return usage("under mpirun: --mode full or lora, and --batch a multiple of the ranks; got", mode);
  if (world.rank() != 0) std::freopen("/dev/null", "w", stdout);
  bench::print_cpu_info();
  bench::set_threads(threads);
  if (peak) {
    bench::fma_peak(threads);  // wakes the cores up
    std::printf("RESULT impl=fma mode=peak threads=%d gflops=%.1f\n", threads, bench::fma_peak(threads));
    return 0;
  }

  const long rss_start_kb = proc_status_kb("VmRSS");
  Config cfg;
  nn::random::seed(0);
  Decoder model = make_decoder(cfg);
  if (mode == "lora") apply_lora(model);
  if (mode == "forward" && precision == "bf16") model.freeze();
  if (precision == "bf16") nn::set_precision(model, nn::Precision::bf16);
  nn::AdamW<> opt(1e-4);
  opt.bias_correction();  // torch.optim.AdamW's update
  std::vector<std::pair<nn::Tensor, nn::Tensor>> data;
  for (std::uint64_t i = 0; i < 4; ++i) data.push_back(batch(i, B, T, cfg.vocab));
  if (world.size() > 1)  // this rank's rows of each batch: r, r + N, ...
    for (auto& [ids, tg] : data) {
      const std::int64_t rows = B / world.size();
      nn::Tensor mi = nn::Tensor::empty({rows, T}, nn::DType::i32), mt = nn::Tensor::empty({rows, T}, nn::DType::i32);
      for (std::int64_t r = 0; r < rows; ++r) {
        const std::int64_t src = world.rank() + r * world.size();
        std::copy_n(ids.data<std::int32_t>() + src * T, T, mi.data<std::int32_t>() + r * T);
        std::copy_n(tg.data<std::int32_t>() + src * T, T, mt.data<std::int32_t>() + r * T);
      }
      ids = mi, tg = mt;
    }

  const bool bf16 = precision == "bf16";
  auto loss_fn = [bf16](nn::GTape<nn::cpu>& tp, const Decoder& m, nn::GVar ids, nn::GVar tg) {
    if (bf16) tp.set_autocast(nn::DType::bf16);
    return m.loss(tp, ids, tg);
  };
  auto step = nn::compile<2>(model, opt, loss_fn);
  nn::distributed::broadcast_parameters(model, world);
  nn::distributed::GradientAverager avg(world);  // equal rows per rank: the plain mean
  if (world.size() > 1) step.reduce_gradients(avg);
  nn::GTape<nn::cpu> fwd;  // forward mode: recorded on the first call, replayed after
  nn::GVar ids_in, tg_in, loss_out;
  auto run = [&](int i) -> double {
    const auto& [ids, tg] = data[static_cast<std::size_t>(i) % data.size()];
    if (mode != "forward") return step(ids, tg).item();
    if (!loss_out.valid()) {
      if (bf16) fwd.set_autocast(nn::DType::bf16);
      ids_in = fwd.input(ids);
      tg_in = fwd.input(tg);
      loss_out = model.loss(fwd, ids_in, tg_in);
    } else {
      fwd.set(ids_in, ids);
      fwd.set(tg_in, tg);
      fwd.replay_forward();
    }
    return fwd.value(loss_out).item();
  };

  double first_loss = 0, last_loss = 0;
  for (int i = 0; i < warmup; ++i) {
    const double l = run(i);  // the first call records
    if (i == 0) first_loss = l;
  }
  std::vector<double> ms;
  const double cpu0 = cpu_seconds();
  const auto t_all = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) {
    world.barrier();  // ranks start each step together: the step's time is the slowest rank's
    const auto t0 = std::chrono::steady_clock::now();
    last_loss = run(warmup + i);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double total_s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t_all).count();
  const double cpu_ms = (cpu_seconds() - cpu0) * 1e3 / steps;
  std::vector<double> sorted = ms;
  std::sort(sorted.begin(), sorted.end());
  const double median_ms = sorted[sorted.size() / 2];
  const double flops = step_flops(cfg, mode, B, T);
  std::printf(
      "RESULT impl=nn mode=%s threads=%d tok_s=%.1f median_ms=%.2f mean_ms=%.2f min_ms=%.2f cpu_ms=%.2f gflops=%.1f "
      "rss_peak_mb=%.1f rss_start_mb=%.1f loss_first=%.4f loss_last=%.4f params=%lld trainable=%lld gemm=%s "
      "precision=%s version=%s team_reductions=%lld ranks=%d\n",
      mode.c_str(), threads, static_cast<double>(B * T) / (median_ms / 1e3), median_ms, total_s * 1e3 / steps, sorted[0], cpu_ms,
      flops / (median_ms / 1e3) / 1e9, static_cast<double>(proc_status_kb("VmHWM")) / 1024.0,
      static_cast<double>(rss_start_kb) / 1024.0, first_loss, last_loss, static_cast<long long>(model.num_params()),
      static_cast<long long>(model.num_trainable()),
      nn::cpu_info().gemm_id.c_str(), precision.c_str(), NN_VERSION_STRING,
      static_cast<long long>(nn::detail::TeamLoad::get().reductions()), world.size());
  return 0;
}
