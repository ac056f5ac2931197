// SPDX-License-Identifier: MIT OR Apache-2.0
// quantized_matmul beside the float32 GEMM of the same dequantized matrix, on the finetune's real
// product shapes (SmolLM2-135M: hidden 576, MLP 1536, vocabulary 49152), x @ W^T and x @ W (the
// forward and x's gradient), at batches of 1, 2, 4, 8, 64 and 256 tokens, affine GROUP/BITS (64/4:
// MLX's default; 32/5 and 16/6 are what a Q4_K_M GGUF's Q5_0 and Q6_K blocks become), both through
// the tape's kernels (B::quantized_matmul, B::matmul) on the same threads. Prints the ratio
// f32 time / quantized time (> 1: the quantized product is faster). Where the opt-in int8
// activations apply (nn::set_int8_activations: x @ W^T on 1-8 rows, 4 or 8 bits, a CPU with
// AVX512-VNNI), two more columns time that path too.
//
//   bench_quantized_matmul [threads=1] [repeats=5] [bits=4] [group=64]
#include <chrono>
#include <cstdio>
#include <cstdlib>

#include <nn/nn.hpp>

#include "common.hpp"

namespace {

template <class F>
double best_seconds(int repeats, F&& f) {
  f();  // warm-up: packing space, pages
  double best = 1e30;
  for (int r = 0; r < repeats; ++r) {
    const auto t0 = std::chrono::steady_clock::now();
    f();
    best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
  }
  return best;
}

}  // namespace

int main(int argc, char** argv) {
  const int threads = argc > 1 ? std::atoi(argv[1]) : 1;
  const int repeats = argc > 2 ? std::atoi(argv[2]) : 5;
  const int bits = argc > 3 ? std::atoi(argv[3]) : 4;
  const int group = argc > 4 ? std::atoi(argv[4]) : 64;
  bench::set_threads(threads);
  bench::print_cpu_info();
  std::printf("# threads %d, best of %d, affine group %d bits %d, float32 x\n", threads, repeats, group, bits);
  std::printf("| W (out, in) | product | tokens | f32 GEMM ms | quantized ms | f32 / quantized | int8-x ms | f32 / int8-x "
              "|\n|---|---|---|---|---|---|---|---|\n");
  const std::int64_t shapes[][2] = {{576, 576}, {1536, 576}, {49152, 576}};
  for (const auto& s : shapes) {
    const std::int64_t out = s[0], in = s[1];
    const nn::Tensor w = nn::random::normal({out, in}, nn::DType::f32, 0.0, 0.05);
    const nn::QuantizedMatrix q = nn::quantize(w, nn::Quant::affine(group, bits));
    const nn::Tensor wd = nn::dequantize(q);
    for (const bool transpose : {true, false}) {
      for (const std::int64_t M : {1, 2, 4, 8, 64, 256}) {
        const std::int64_t K = transpose ? in : out, N = transpose ? out : in;
        const nn::Tensor x = nn::random::normal({M, K});
        nn::Tensor y = nn::Tensor::zeros({M, N});
        const double tf = best_seconds(repeats, [&] { nn::cpu::matmul(x, false, wd, transpose, y, false); });
        const auto quantized = [&] {
          nn::cpu::quantized_matmul(x, q.weight, q.scales, q.biases, nn::QuantMatmulAttrs{q.q, transpose}, y, false);
        };
        const double tq = best_seconds(repeats, quantized);
        char int8[64] = "- | -";
        if (transpose && M <= 8 && (bits == 4 || bits == 8) && nn::detail::quant_vnni()) {
          nn::set_int8_activations(true);
          const double ti = best_seconds(repeats, quantized);
          nn::set_int8_activations(false);
          std::snprintf(int8, sizeof int8, "%.3f | %.2fx", ti * 1e3, tf / ti);
        }
        std::printf("| (%lld, %lld) | %s | %lld | %.3f | %.3f | %.2fx | %s |\n", static_cast<long long>(out),
                    static_cast<long long>(in), transpose ? "x @ W^T" : "x @ W", static_cast<long long>(M), tf * 1e3,
                    tq * 1e3, tf / tq, int8);
      }
    }
  }
}
