// SPDX-License-Identifier: MIT OR Apache-2.0
// The reference decoder on a GPU, nn's side: bench/decoder_model.hpp's model scaled to a GPU
// (Config::gpu(): d 1024, 12 layers, 16/4 heads of 64, SwiGLU 2816, vocab 32000; batch 8 x 1024)
// trained by a compiled step on GTape<nn::cuda>, timed as tokens/s and achieved TFLOP/s, beside
// the rate nn's own cuBLAS product reaches on a large square (the ceiling the step is read
// against). bench/decoder_torch.py --device cuda --size gpu is PyTorch's side (eager and
// torch.compile); bench/run_decoder_cuda.sh runs both and prints the ratios.
//
//   bench_decoder_cuda [--mode full|lora] [--precision f32|bf16] [--steps N] [--warmup N]
//                      [--batch B] [--seq T] [--size gpu|small]
//   bench_decoder_cuda --gemm [--n N]      (nn's cuBLAS product, f32, N x N x N, TFLOP/s)
// Prints one `RESULT key=value ...` line; a step the CUDA policy cannot run (bf16 storage, for
// one) prints `RESULT impl=nn ... error="..."` instead, so the table says why.
#include <nn/cuda.hpp>

#include "common.hpp"
#include "decoder_model.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

namespace {

using namespace bench::decoder;

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

/// nn's CUDA matmul (cuBLAS underneath) on (n, n) x (n, n) in f32: the median of 10 TFLOP/s.
double gemm_tflops(std::int64_t n) {
  nn::random::seed(1);
  nn::Tensor a = nn::random::normal({n, n}, nn::DType::f32).to(nn::Device::cuda);
  nn::Tensor b = nn::random::normal({n, n}, nn::DType::f32).to(nn::Device::cuda);
  nn::Tensor c = nn::cuda::alloc({n, n}, nn::DType::f32);
  for (int i = 0; i < 3; ++i) nn::cuda::matmul(a, false, b, false, c, false);
  nn::cuda::synchronize();
  std::vector<double> t;
  for (int i = 0; i < 10; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    nn::cuda::matmul(a, false, b, false, c, false);
    nn::cuda::synchronize();
    t.push_back(seconds_since(t0));
  }
  std::sort(t.begin(), t.end());
  return 2.0 * static_cast<double>(n) * static_cast<double>(n) * static_cast<double>(n) / t[t.size() / 2] / 1e12;
}

int usage(const char* what, const std::string& arg = "") {
  std::fprintf(stderr,
               "%s%s%s\nusage: bench_decoder_cuda [--mode full|lora] [--precision f32|bf16] [--steps N] [--warmup N] "
               "[--batch B] [--seq T] [--size gpu|small]\n       bench_decoder_cuda --gemm [--n N]\n",
               what, arg.empty() ? "" : " ", arg.c_str());
  return 2;
}

}  // namespace

int main(int argc, char** argv) {
  std::string mode = "full", precision = "f32", size = "gpu";
  int steps = 10, warmup = 2;
  std::int64_t B = 8, T = 1024, n = 8192;
  bool gemm = false;
  for (int i = 1; i < argc; ++i) {
    const std::string k = argv[i];
    if (k == "--gemm") { gemm = true; continue; }
    if (i + 1 >= argc) return usage("missing value for", k);
    const std::string v = argv[++i];
    if (k == "--mode") mode = v;
    else if (k == "--precision") precision = v;
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--batch") B = std::stoll(v);
    else if (k == "--seq") T = std::stoll(v);
    else if (k == "--size") size = v;
    else if (k == "--n") n = std::stoll(v);
    else return usage("unknown option", k);
  }
  if (mode != "full" && mode != "lora") return usage("unknown mode", mode);
  if (precision != "f32" && precision != "bf16") return usage("unknown precision", precision);
  if (size != "gpu" && size != "small") return usage("unknown size", size);
  if (steps < 1 || warmup < 1 || B < 1 || T < 2 || n < 1) return usage("sizes must be positive");
  if (nn::cuda::device_count() == 0) {
    std::printf("RESULT impl=nn mode=%s error=\"no CUDA device\"\n", gemm ? "gemm" : mode.c_str());
    return 77;
  }
  cudaDeviceProp prop{};
  cudaGetDeviceProperties(&prop, 0);
  std::printf("# cuda: %s (sm_%d%d)\n", prop.name, prop.major, prop.minor);
  if (gemm) {
    std::printf("RESULT impl=nn mode=gemm n=%lld tflops=%.2f\n", static_cast<long long>(n), gemm_tflops(n));
    return 0;
  }

  try {
    const Config cfg = size == "gpu" ? Config::gpu() : Config{};
    nn::random::seed(0);
    Decoder model = make_decoder(cfg);
    if (mode == "lora") apply_lora(model);
    const bool bf16 = precision == "bf16";
    if (bf16) nn::set_precision(model, nn::Precision::bf16);
    model.to(nn::Device::cuda);
    nn::AdamW<nn::cuda> opt(1e-4);
    opt.bias_correction();  // torch.optim.AdamW's update
    std::vector<std::pair<nn::Tensor, nn::Tensor>> data;
    for (std::uint64_t i = 0; i < 4; ++i) {
      auto [ids, tg] = bench::batch(i, B, T, cfg.vocab);
      data.emplace_back(ids.to(nn::Device::cuda), tg.to(nn::Device::cuda));
    }
    auto loss_fn = [bf16](nn::GTape<nn::cuda>& tp, const Decoder& m, nn::GVar ids, nn::GVar tg) {
      if (bf16) tp.set_autocast(nn::DType::bf16);
      return m.loss(tp, ids, tg);
    };
    auto step = nn::compile<2, nn::cuda>(model, opt, loss_fn);
    auto run = [&](int i) {
      const auto& [ids, tg] = data[static_cast<std::size_t>(i) % data.size()];
      const nn::Tensor l = step(ids, tg);
      return l.to(nn::Device::cpu).item();  // waits for the step
    };
    const auto t_rec = std::chrono::steady_clock::now();
    double first_loss = run(0), last_loss = 0;  // the first call records
    const double record_s = seconds_since(t_rec);
    for (int i = 1; i < warmup; ++i) run(i);
    const std::int64_t mallocs0 = nn::cuda::memory_stats().malloc_calls;
    std::vector<double> ms;
    for (int i = 0; i < steps; ++i) {
      const auto t0 = std::chrono::steady_clock::now();
      last_loss = run(warmup + i);
      ms.push_back(seconds_since(t0) * 1e3);
    }
    std::sort(ms.begin(), ms.end());
    const double median_ms = ms[ms.size() / 2], flops = step_flops(cfg, mode, B, T);
    const nn::CudaMemoryStats mem = nn::cuda::memory_stats();
    std::printf("RESULT impl=nn mode=%s precision=%s tok_s=%.1f median_ms=%.2f min_ms=%.2f tflops=%.2f record_s=%.2f "
                "loss_first=%.4f loss_last=%.4f params=%lld trainable=%lld timed_cuda_mallocs=%lld reserved_gb=%.2f\n",
                mode.c_str(), precision.c_str(), static_cast<double>(B * T) / (median_ms / 1e3), median_ms, ms[0],
                flops / (median_ms / 1e3) / 1e12, record_s, first_loss, last_loss,
                static_cast<long long>(model.num_params()), static_cast<long long>(model.num_trainable()),
                static_cast<long long>(mem.malloc_calls - mallocs0), static_cast<double>(mem.bytes_reserved) / 1e9);
  } catch (const nn::Error& e) {
    std::string msg = e.what();
    std::replace(msg.begin(), msg.end(), '"', '\'');
    std::replace(msg.begin(), msg.end(), '\n', ' ');
    std::printf("RESULT impl=nn mode=%s precision=%s error=\"%s\"\n", mode.c_str(), precision.c_str(), msg.c_str());
    return 1;
  }
  return 0;
}
