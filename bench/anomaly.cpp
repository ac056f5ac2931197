// SPDX-License-Identifier: MIT OR Apache-2.0
// What anomaly mode costs: a compiled training step replayed with GTape::detect_anomaly off and
// on, on a graph of many small nodes (where a per-node cost would show) and on one of a few large
// products (where the checks' reads of every value and gradient show). Prints ms per step and the
// on/off ratio. The "off" column is also the figure to compare with a build from before anomaly
// mode existed: this file compiles against such headers too (the "on" column is then skipped).
//
//   bench_anomaly [steps=200]
#include <nn/nn.hpp>
#include <nn/optim.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <vector>

#if __has_include(<nn/anomaly.hpp>)
#define NN_BENCH_HAS_ANOMALY 1
#endif

namespace {

// An MLP of `depth` tanh layers of width W: 3 nodes per layer (matmul, add, tanh) + the loss.
struct Mlp {
  std::vector<nn::Linear> layers;
  NN_MODULE(Mlp, layers)
};

Mlp make(int depth, std::int64_t W) {
  Mlp m;
  nn::random::seed(1);
  for (int i = 0; i < depth; ++i) m.layers.emplace_back(W, W);
  return m;
}

double ms_per_step(int depth, std::int64_t W, std::int64_t B, int steps, bool anomaly) {
  Mlp m = make(depth, W);
  nn::Sgd opt(1e-3);
  auto step = nn::compile<1>(m, opt, [](nn::GTape<nn::cpu>& tp, const Mlp& net, nn::GVar x) {
    for (const nn::Linear& l : net.layers) x = nn::tanh(tp, l(tp, x));
    return nn::mean(tp, nn::mul(tp, x, x));
  });
#ifdef NN_BENCH_HAS_ANOMALY
  step.detect_anomaly(anomaly);
#else
  if (anomaly) return -1;
#endif
  nn::Tensor x = nn::random::normal({B, W});
  for (int i = 0; i < 5; ++i) step(x);  // record, warm up
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < steps; ++i) step(x);
  return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / steps;
}

}  // namespace

int main(int argc, char** argv) {
  const int steps = argc > 1 ? std::atoi(argv[1]) : 200;
  std::printf("anomaly mode: a compiled step's replay, off and on (ms per step, best of 3)\n");
  std::printf("%-34s %10s %10s %8s\n", "graph", "off", "on", "on/off");
  struct Shape {
    const char* name;
    int depth;
    std::int64_t W, B;
  };
  for (const Shape& s : {Shape{"256 layers, (8, 16) each", 256, 16, 8}, Shape{"4 layers, (256, 1024) each", 4, 1024, 256}}) {
    double off = 1e30, on = 1e30;
    for (int r = 0; r < 3; ++r) {
      off = std::min(off, ms_per_step(s.depth, s.W, s.B, steps, false));
      on = std::min(on, ms_per_step(s.depth, s.W, s.B, steps, true));
    }
    if (on < 0) std::printf("%-34s %10.4f %10s %8s\n", s.name, off, "-", "-");
    else std::printf("%-34s %10.4f %10.4f %8.2f\n", s.name, off, on, on / off);
  }
}
