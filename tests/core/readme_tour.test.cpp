// SPDX-License-Identifier: MIT OR Apache-2.0
// The README's API tour, compiled and run: the lines between the tour markers are the README's
// snippet verbatim (tools/check_readme fails otherwise); the checks after them keep it true.
#include "support/check.hpp"

#include <iostream>
#include <sstream>
#include <utility>

namespace core_readme_tour {  // one unity source with the other core files: its names stay its own

namespace {
/// Sends std::cout into a string for the lifetime of the guard, so the tour's output is checked.
struct CaptureCout {
  std::ostringstream text;
  std::streambuf* saved = std::cout.rdbuf(text.rdbuf());
  /// Restores std::cout (doctest reports through it) and returns what was printed.
  std::string finish() {
    if (saved) std::cout.rdbuf(std::exchange(saved, nullptr));
    return text.str();
  }
  ~CaptureCout() { finish(); }
};
}  // namespace

TEST_CASE("the README tour runs and says what it claims") {
  CaptureCout out;
  // README tour begin
  using namespace nn;

  // Parameters are plain tensors (row-major, runtime dtype, shared storage).
  Tensor W = Tensor::from<float>({2, 3}, {0.5f, -0.25f, 0.25f, 1.0f, 0.5f, -1.0f});
  Tensor X = Tensor::from<float>({4, 3}, {1, 0, 0, 0, 1, 0, 0, 0, 1, 1, 1, 1});

  // Record: every op appends one node to an explicit tape; nothing is global.
  GTape<cpu> tp;
  GVar w = tp.param(W);                      // bound by reference, trainable
  GVar x = tp.input(X);                      // a slot a replay may refill
  GVar y = matmul(tp, x, w, false, true);    // x @ w^T: (4, 3) @ (3, 2) -> (4, 2)
  GVar loss = mean(tp, mul(tp, y, y));       // a scalar
  tp.backward(loss);                         // every gradient, in one reverse sweep
  std::cout << tp.value(loss) << '\n' << tp.grad(w) << '\n';

  // Train: update W in place, swap the batch, replay the same tape (no re-recording).
  for (int step = 0; step < 50; ++step) {
    float* p = W.data<float>();
    const float* g = tp.grad(w).data<float>();
    for (int i = 0; i < 6; ++i) p[i] -= 0.5f * g[i];
    tp.set(x, X);                            // the next batch goes here
    tp.replay();                             // forward and backward into the same buffers
  }
  std::cout << "loss after 50 steps: " << tp.value(loss).item() << '\n';

  // Errors name the op and the shapes involved.
  try {
    matmul(tp, x, w);                        // (4, 3) @ (2, 3): inner dims differ
  } catch (const nn::Error& e) {
    std::cout << e.what() << '\n';           // [matmul] inner dimensions differ: (4, 3) @ (2, 3) (3 vs 2)
  }
  // README tour end

  // y = x W^T = [[.5 1] [-.25 .5] [.25 -1] [.5 .5]]: loss = mean(y^2) = 3.125 / 8 = 0.390625, and
  // dL/dW = (2/8) y^T x = [[.25 .0625 .1875] [.375 .25 -.125]] (all exact in float32).
  const std::string s = out.finish();
  INFO("the tour printed:\n" << s);
  CHECK(s.find("Tensor(0.390625, shape=(), dtype=float32)") != std::string::npos);
  CHECK(s.find("Tensor([[0.25, 0.0625, 0.1875],") != std::string::npos);
  CHECK(s.find("[0.375, 0.25, -0.125]], shape=(2, 3), dtype=float32)") != std::string::npos);
  CHECK(tp.value(loss).item() < 1e-4);  // W -> 0 minimises the loss; plain gradient descent gets there
  CHECK(s.find("[matmul] inner dimensions differ: (4, 3) @ (2, 3) (3 vs 2)") != std::string::npos);
  CHECK(tp.size() == 5);  // two leaves and three ops: the replays and the failed matmul added none
}

}  // namespace core_readme_tour
