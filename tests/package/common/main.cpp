// SPDX-License-Identifier: MIT OR Apache-2.0
// The consumer program every package test builds: fits y = 3x - 1 with the tape and plain
// gradient descent, and fails unless it recovers the line (so nn must really link and run).
#include <nn/nn.hpp>

#include <cmath>
#include <cstdio>
#include <vector>

int main() {
  std::vector<float> xs, ys;
  for (int i = 0; i < 16; ++i) {
    float x = -1.0f + 2.0f * static_cast<float>(i) / 15.0f;
    xs.push_back(x);
    ys.push_back(3.0f * x - 1.0f);
  }
  nn::Tensor W = nn::Tensor::zeros({1, 1}), b = nn::Tensor::zeros({1});
  nn::GTape<nn::cpu> tp;
  nn::GVar w = tp.param(W), c = tp.param(b);
  nn::GVar x = tp.input(nn::Tensor::from<float>({16, 1}, xs));
  nn::GVar y = tp.constant(nn::Tensor::from<float>({16, 1}, ys));
  nn::GVar err = nn::sub(tp, nn::add(tp, nn::matmul(tp, x, w), c), y);
  nn::GVar loss = nn::mean(tp, nn::mul(tp, err, err));
  tp.backward(loss);
  for (int step = 0; step < 200; ++step) {
    if (step > 0) tp.replay();  // same tape, params re-read after the in-place update below
    W.data<float>()[0] -= 0.2f * tp.grad(w).data<float>()[0];
    b.data<float>()[0] -= 0.2f * tp.grad(c).data<float>()[0];
  }
  float wv = W.data<float>()[0], bv = b.data<float>()[0];
  std::printf("nn %s: fitted y = %.4f x + %.4f\n", NN_VERSION_STRING, wv, bv);
  return std::abs(wv - 3.0f) < 1e-3f && std::abs(bv + 1.0f) < 1e-3f ? 0 : 1;
}
