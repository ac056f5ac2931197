// SPDX-License-Identifier: MIT OR Apache-2.0
// Elementwise fusion (ops/fused.hpp) measured: a replayed step (forward and backward, memory
// planned as nn::compile plans it) of three elementwise workloads, each recorded once unfused and
// once through nn::fuse_elementwise, timed side by side in one run (interleaved, best of
// `repeats`), at 1 and 2 threads:
//   swiglu      silu(a) * u, composed from primitives, beside nn::fused_swiglu (hand-fused)
//   gelu_chain  x + b, then GELU's tanh form built from pow, scale, add, tanh, mul (a user's
//               own activation from primitives)
//   dropout     x * mask * 1/(1-p), mask a constant (dropout's mask-and-scale)
// Each ends in sum(y * w) so the backward pass runs through the group.
//
//   bench_fusion [rows] [cols] [repeats]      (default 1024 704 7: the decoder bench's MLP)
// Prints the CPU, then one line per workload and thread count: milliseconds per step unfused,
// fused (and hand-fused for swiglu), the ratio, and the bytes per step fusion removes.
#include <nn/nn.hpp>

#include "common.hpp"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <functional>
#include <string>

using namespace nn;

namespace {

struct Case {
  const char* name;
  // y from the params; `hand` picks the hand-fused primitive where there is one
  std::function<GVar(GTape<cpu>&, const std::vector<GVar>&, bool hand)> build;
  int params;  // how many (rows, cols) params; a (cols) bias follows when bias
  bool bias, has_hand;
};

struct Tape {
  GTape<cpu> tp;
  FusionStats stats;
};

double ms_per_step(Tape& t, int steps) {
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) t.tp.replay();
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
}

}  // namespace

int main(int argc, char** argv) {
  const std::int64_t R = argc > 1 ? std::atoll(argv[1]) : 1024, C = argc > 2 ? std::atoll(argv[2]) : 704;
  const int repeats = argc > 3 ? std::atoi(argv[3]) : 7;
  bench::print_cpu_info();
  std::printf("# rows %lld, cols %lld, float32; ms per replayed step (forward + backward), best of %d\n",
              static_cast<long long>(R), static_cast<long long>(C), repeats);

  const double k = 0.7978845608028654;  // sqrt(2 / pi)
  const Case cases[] = {
      {"swiglu", [](GTape<cpu>& tp, const std::vector<GVar>& v, bool hand) {
         return hand ? fused_swiglu(tp, v[0], v[1]) : mul(tp, silu(tp, v[0]), v[1]);
       }, 2, false, true},
      {"gelu_chain", [k](GTape<cpu>& tp, const std::vector<GVar>& v, bool) {
         const GVar h = add(tp, v[0], v[1]);
         const GVar inner = add(tp, h, scale(tp, pow(tp, h, 3.0), 0.044715));
         return mul(tp, scale(tp, h, 0.5), add_scalar(tp, tanh(tp, scale(tp, inner, k)), 1.0));
       }, 1, true, false},
      {"dropout", [](GTape<cpu>& tp, const std::vector<GVar>& v, bool) {
         return scale(tp, mul(tp, v[0], v[1]), 1.0 / 0.9);
       }, 1, false, false},
  };

  for (int threads : {1, 2}) {
    bench::set_threads(threads);
    for (const Case& c : cases) {
      std::vector<Tensor> ts;
      for (int p = 0; p < c.params; ++p) ts.push_back(Tensor::from_doubles({R, C}, std::vector<double>(R * C, 0.25 + 0.01 * p), DType::f32));
      if (c.bias) ts.push_back(Tensor::from_doubles({C}, std::vector<double>(C, 0.1), DType::f32));
      std::vector<double> mask(static_cast<std::size_t>(R * C));
      for (std::size_t i = 0; i < mask.size(); ++i) mask[i] = (i * 2654435761u) % 10 ? 1.0 : 0.0;
      const Tensor m = Tensor::from_doubles({R, C}, mask, DType::f32);
      const Tensor w = Tensor::from_doubles({R, C}, std::vector<double>(R * C, 0.5), DType::f32);
      // variant 0 unfused, 1 fused, 2 hand-fused
      const int variants = c.has_hand ? 3 : 2;
      std::vector<std::unique_ptr<Tape>> tapes;
      for (int var = 0; var < variants; ++var) {
        auto t = std::make_unique<Tape>();
        GTape<cpu>& tp = t->tp;
        const GVar loss = tp.record_deferred([&] {
          std::vector<GVar> v;
          for (const Tensor& x : ts) v.push_back(tp.param(x));
          if (std::string(c.name) == "dropout") v.push_back(tp.constant(m));
          return sum(tp, mul(tp, c.build(tp, v, var == 2), tp.constant(w)));
        });
        if (var == 1) t->stats = fuse_elementwise(tp, loss);
        tp.plan_memory(loss);
        tp.replay();
        tapes.push_back(std::move(t));
      }
      std::vector<double> best(static_cast<std::size_t>(variants), 1e300);
      const int steps = std::max<int>(3, static_cast<int>(2e7 / static_cast<double>(R * C)));
      for (int r = 0; r < repeats; ++r)
        for (int var = 0; var < variants; ++var)
          best[static_cast<std::size_t>(var)] = std::min(best[static_cast<std::size_t>(var)], ms_per_step(*tapes[static_cast<std::size_t>(var)], steps));
      std::printf("%-10s threads %d  unfused %8.3f ms  fused %8.3f ms", c.name, threads, best[0], best[1]);
      if (c.has_hand) std::printf("  hand-fused %8.3f ms", best[2]);
      std::printf("  unfused/fused %.2fx  (%d groups, %d nodes absorbed, %.1f MB less traffic per step)\n",
                  best[0] / best[1], tapes[1]->stats.groups, tapes[1]->stats.absorbed,
                  static_cast<double>(tapes[1]->stats.bytes_saved) / 1e6);
    }
  }
  return 0;
}
