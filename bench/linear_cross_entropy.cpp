// SPDX-License-Identifier: MIT OR Apache-2.0
// bench_linear_cross_entropy: the finetune's LM head and loss (x (rows, width) against a frozen
// head of `vocab` rows: SmolLM2's 256 x 576 and 49152 by default) as one primitive,
// linear_cross_entropy (no logits stored), beside the two ops it replaces (the logits x @ W^T,
// then cross_entropy), in the same run: a memory-planned tape replayed forward + backward (x's
// gradient, as in a LoRA step), for a float32 head and a 4-bit one (affine, groups of 32), with
// every row counted or half of them (keep = 0: a prompt under --mask-prompt). Prints the median
// time of each, the planned tape's bytes and the ratio.
//
//   bench_linear_cross_entropy [--threads N] [--rows 256] [--width 576] [--vocab 49152] [--reps 10]
#include <nn/nn.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "common.hpp"

namespace {

struct Timing {
  double ms = 0;
  double mb = 0;
  double loss = 0;
};

Timing time_it(bool fused, bool quantized, const nn::Tensor& x, const nn::Tensor& w, const nn::QuantizedMatrix& q,
               const nn::Tensor& t, const nn::Tensor& keep, int reps) {
  nn::GTape<nn::cpu> tp;
  const nn::GVar loss = tp.record_planned([&] {
    const nn::GVar xv = tp.input(x, true);
    const nn::HeadVars h = quantized ? nn::HeadVars(tp.constant(q.weight), tp.constant(q.scales), tp.constant(q.biases), q.q)
                                     : nn::HeadVars(tp.constant(w));
    const nn::GVar tv = tp.constant(t), kv = tp.constant(keep);
    return fused ? nn::fused_linear_cross_entropy(tp, xv, h, tv, kv)
                 : nn::detail::linear_cross_entropy_composite(tp, xv, h, tv, kv, nn::Reduction::mean, -100);
  });
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    tp.replay();
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], static_cast<double>(tp.bytes()) / 1e6, tp.value(loss).item()};
}

}  // namespace

int main(int argc, char** argv) try {
  bench::print_cpu_info();
  int threads = 1, reps = 10;
  std::int64_t R = 256, C = 576, V = 49152;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--threads") threads = std::stoi(v);
    else if (k == "--rows") R = std::stoll(v);
    else if (k == "--width") C = std::stoll(v);
    else if (k == "--vocab") V = std::stoll(v);
    else if (k == "--reps") reps = std::stoi(v);
    else nn::detail::fail("bench_linear_cross_entropy", "unknown option ", k);
  }
  if (argc % 2 == 0 || threads < 1 || reps < 1 || R < 1 || C < 32 || C % 32 != 0 || V < 1)
    nn::detail::fail("bench_linear_cross_entropy", "usage: [--threads N] [--rows R] [--width C (a multiple of 32)] "
                     "[--vocab V] [--reps N]");
  bench::set_threads(threads);
  nn::random::seed(0);
  const nn::Tensor x = nn::random::normal({R, C});
  const nn::Tensor w = nn::random::normal({V, C}, nn::DType::f32, 0.0, 0.05);
  const nn::QuantizedMatrix q = nn::quantize(w, nn::Quant::affine(32, 4));
  const nn::Tensor t = bench::batch(1, 1, R, V).second.reshape({R});
  nn::Tensor all = nn::Tensor::ones({R}), half = nn::Tensor::ones({R});
  for (std::int64_t r = 0; r < R / 2; ++r) half.data<float>()[r] = 0;  // the first half: a prompt
  std::printf("x (%lld, %lld), head (%lld, %lld), %d thread(s), forward + backward (x's gradient), median of %d\n",
              static_cast<long long>(R), static_cast<long long>(C), static_cast<long long>(V), static_cast<long long>(C),
              threads, reps);
  std::printf("%-10s %-10s %12s %12s %8s %12s %12s %14s\n", "head", "rows", "two ops ms", "fused ms", "ratio",
              "two ops MB", "fused MB", "loss diff");
  for (const bool quantized : {false, true})
    for (const bool halved : {false, true}) {
      const nn::Tensor& keep = halved ? half : all;
      const Timing a = time_it(false, quantized, x, w, q, t, keep, reps), b = time_it(true, quantized, x, w, q, t, keep, reps);
      std::printf("%-10s %-10s %12.2f %12.2f %7.2fx %12.1f %12.1f %14.2e\n", quantized ? "4-bit" : "float32",
                  halved ? "half kept" : "all kept", a.ms, b.ms, a.ms / b.ms, a.mb, b.mb, std::abs(a.loss - b.loss));
    }
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
