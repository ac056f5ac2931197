// SPDX-License-Identifier: MIT OR Apache-2.0
// Causal attention's forward + backward at growing context, flash_attention beside the
// probabilities kernel (fused_attention, which keeps the (B, H, T, T) softmax for its vjp): time
// per call, the bytes each keeps between forward and backward, and each one's peak RSS (every
// case runs in its own child process, so one's peak does not hide another's). SmolLM2-135M's
// heads: H = 9 query heads, KV = 3, head_dim = 64; B * T = 4096 tokens in every row.
// --window W and/or --softcap C (Gemma 2's sliding-window layers and capped scores): flash
// attention with those options beside attention written out as the model ran such layers before
// flash took them (reference::gqa_attention: the causal + window mask (T, T) and nn::softcap on
// the (B, H, T, T) scores), in place of the probabilities kernel, which has neither option.
//
// Usage: bench_attention [--threads N] [--seconds S] [--t 256,1024,4096] [--window W] [--softcap C]
// (bench/run_attention.sh runs it beside PyTorch's scaled_dot_product_attention.)
#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include <sys/wait.h>
#include <unistd.h>

#include "common.hpp"

namespace {

struct Result {
  double fwd_ms = 0, step_ms = 0;
  long kept_kb = 0, peak_kb = 0;
};

constexpr std::int64_t kH = 9, kKV = 3, kHd = 64, kTokens = 4096;
std::int64_t g_window = 0;  // --window, --softcap
double g_softcap = 0;
bool composite_side() { return g_window > 0 || g_softcap > 0; }

/// One kernel at context T, in this process: the median of forward-only and forward + backward
/// calls over `seconds` each.
Result measure(bool flash, std::int64_t T, double seconds) {
  using namespace nn;
  const std::int64_t Bn = std::max<std::int64_t>(1, kTokens / T);
  Tensor q = Tensor::empty({Bn, T, kH * kHd}, DType::f32), k = Tensor::empty({Bn, T, kKV * kHd}, DType::f32),
         v = Tensor::empty({Bn, T, kKV * kHd}, DType::f32), g = Tensor::empty({Bn, T, kH * kHd}, DType::f32);
  std::uint64_t s = 1;
  for (Tensor* t : {&q, &k, &v, &g})
    for (std::int64_t i = 0; i < t->numel(); ++i)
      t->data<float>()[i] = static_cast<float>(bench::splitmix64(s) % 2001) / 1000.0f - 1.0f;
  const double scale = 1.0 / std::sqrt(static_cast<double>(kHd));
  Tensor mask;  // the composite side's causal (+ window) mask
  if (!flash && composite_side()) {
    mask = Tensor::empty({T, T}, DType::f32);
    for (std::int64_t i = 0; i < T; ++i)
      for (std::int64_t j = 0; j < T; ++j)
        mask.data<float>()[i * T + j] = j <= i && (g_window == 0 || i - j < g_window) ? 0.0f : static_cast<float>(kMaskedValue);
  }
  Result r;
  auto timed = [&](bool backward) {
    std::vector<double> ms;
    const auto start = std::chrono::steady_clock::now();
    do {
      GTape<cpu> tp;
      GVar Q = tp.param(q), K = tp.param(k), V = tp.param(v);
      const auto t0 = std::chrono::steady_clock::now();
      GVar y = flash              ? flash_attention(tp, Q, K, V, T, kH, kKV, kHd, scale, true, GVar{}, g_window, g_softcap)
               : composite_side() ? reference::gqa_attention(tp, Q, K, V, GVar{}, GVar{}, tp.constant(mask), T, kH, kKV, kHd,
                                                             scale, false, g_softcap)
                                  : fused_attention(tp, Q, K, V, GVar{}, T, kH, kKV, kHd, scale, true);
      // what the backward keeps: the attention node's saved buffers, or (composite) every node's
      // saved buffers and the values of its ops before the output (views aside), as the tape
      // holds them until backward
      long kept = 0;
      for (std::int32_t n = composite_side() && !flash ? 0 : y.index; n <= y.index; ++n) {
        const auto& node = tp.node(GVar{&tp, n});
        for (const Tensor& t : node.saved) kept += static_cast<long>(t.nbytes() / 1024);
        if (n < y.index && node.def && !node.def->aliases_input) kept += static_cast<long>(node.value.nbytes() / 1024);
      }
      if (backward) tp.backward(y, g);
      ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
      r.kept_kb = kept;
    } while (std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() < seconds || ms.size() < 3);
    std::nth_element(ms.begin(), ms.begin() + static_cast<long>(ms.size() / 2), ms.end());
    return ms[ms.size() / 2];
  };
  r.fwd_ms = timed(false);
  r.step_ms = timed(true);
  r.peak_kb = bench::proc_status_kb("VmHWM");
  return r;
}

/// measure() in a child process, its Result read back through a pipe.
Result isolated(bool flash, std::int64_t T, double seconds) {
  int fd[2];
  if (pipe(fd) != 0) std::exit(1);
  const pid_t pid = fork();
  if (pid == 0) {
    close(fd[0]);
    Result r = measure(flash, T, seconds);
    const ssize_t w = write(fd[1], &r, sizeof r);
    _exit(w == static_cast<ssize_t>(sizeof r) ? 0 : 1);
  }
  close(fd[1]);
  Result r;
  const ssize_t n = read(fd[0], &r, sizeof r);
  close(fd[0]);
  int status = 0;
  waitpid(pid, &status, 0);
  if (n != static_cast<ssize_t>(sizeof r) || !WIFEXITED(status) || WEXITSTATUS(status) != 0) {
    std::fprintf(stderr, "bench_attention: the %s case at T = %lld failed\n", flash ? "flash" : composite_side() ? "composite" : "probabilities",
                 static_cast<long long>(T));
    std::exit(1);
  }
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  int threads = 1;
  double seconds = 2.0;
  std::vector<std::int64_t> ts{256, 1024, 4096};
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--threads" && i + 1 < argc) threads = std::atoi(argv[++i]);
    else if (a == "--seconds" && i + 1 < argc) seconds = std::atof(argv[++i]);
    else if (a == "--window" && i + 1 < argc) g_window = std::atoll(argv[++i]);
    else if (a == "--softcap" && i + 1 < argc) g_softcap = std::atof(argv[++i]);
    else if (a == "--t" && i + 1 < argc) {
      ts.clear();
      for (char* p = std::strtok(argv[++i], ","); p; p = std::strtok(nullptr, ",")) ts.push_back(std::atoll(p));
    } else {
      std::fprintf(stderr, "usage: bench_attention [--threads N] [--seconds S] [--t 256,1024,4096] [--window W] [--softcap C]\n");
      return 2;
    }
  }
  if (threads < 1 || seconds <= 0 || ts.empty() || g_window < 0 || !(g_softcap >= 0)) return 2;
  bench::set_threads(threads);
  bench::print_cpu_info();
  std::printf("# causal attention, H = %lld, KV = %lld, head_dim = %lld, B * T = %lld tokens, f32, %d thread(s), "
              "window %lld, softcap %g\n",
              static_cast<long long>(kH), static_cast<long long>(kKV), static_cast<long long>(kHd),
              static_cast<long long>(kTokens), threads, static_cast<long long>(g_window), g_softcap);
  const char* other = composite_side() ? "composite" : "probabilities";
  std::printf("| T | B | kernel | forward ms | fwd + bwd ms | kept for bwd MiB | peak RSS MiB | flash speed-up (fwd+bwd) |\n");
  std::printf("|---|---|---|---|---|---|---|---|\n");
  std::vector<std::string> results;
  for (std::int64_t T : ts) {
    const Result p = isolated(false, T, seconds), f = isolated(true, T, seconds);
    const long long Bn = std::max<std::int64_t>(1, kTokens / T);
    std::printf("| %lld | %lld | %s | %.2f | %.2f | %.2f | %.0f | |\n", static_cast<long long>(T), Bn, other,
                p.fwd_ms, p.step_ms, p.kept_kb / 1024.0, p.peak_kb / 1024.0);
    std::printf("| %lld | %lld | flash | %.2f | %.2f | %.2f | %.0f | %.2fx |\n", static_cast<long long>(T), Bn, f.fwd_ms,
                f.step_ms, f.kept_kb / 1024.0, f.peak_kb / 1024.0, p.step_ms / f.step_ms);
    for (const auto& [name, r] : {std::pair{other, p}, std::pair{"flash", f}})  // for run_attention.sh
      results.push_back("RESULT kernel=" + std::string(name) + " T=" + std::to_string(T) + " fwd_ms=" +
                        std::to_string(r.fwd_ms) + " step_ms=" + std::to_string(r.step_ms) +
                        " peak_mb=" + std::to_string(r.peak_kb / 1024));
    std::fflush(stdout);
  }
  for (const std::string& r : results) std::printf("%s\n", r.c_str());
}
