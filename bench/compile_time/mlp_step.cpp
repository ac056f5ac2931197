// SPDX-License-Identifier: MIT OR Apache-2.0
// A 2-layer MLP trained for a few steps with a compiled step: a program that uses only the core
// (bench/compile_time.sh times its compilation).
#include <nn/nn.hpp>

#include <cstdio>

struct Mlp {
  nn::Linear hidden, out;
  template <class B>
  nn::GVar operator()(nn::GTape<B>& tp, nn::GVar x) const {
    return out(tp, nn::relu(tp, hidden(tp, x)));
  }
  NN_MODULE(Mlp, hidden, out)
};

int main() {
  nn::random::seed(0);
  Mlp m{nn::Linear(16, 32), nn::Linear(32, 4)};
  nn::AdamW opt(1e-3);
  auto step = nn::compile<2>(m, opt, [](nn::GTape<nn::cpu>& tp, const Mlp& mm, nn::GVar x, nn::GVar y) {
    return nn::cross_entropy(tp, mm(tp, x), y);
  });
  nn::Tensor x = nn::random::normal({8, 16});
  nn::Tensor y = nn::Tensor::zeros({8}, nn::DType::i64);
  double loss = 0;
  for (int i = 0; i < 10; ++i) loss = step(x, y).item();
  std::printf("%g\n", loss);
}
