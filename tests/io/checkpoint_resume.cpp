// SPDX-License-Identifier: MIT OR Apache-2.0
// Two-process resume check (run by CTest through resume.cmake): "straight" trains N+M steps and
// writes the final weights; "first" trains N steps and saves a checkpoint; "second", a fresh
// process, loads it, trains M more and writes the final weights. Both files must be identical.
#include <nn/nn.hpp>

#include <cstring>
#include <iostream>

namespace {

struct Net {
  nn::Linear l1;
  nn::Dropout drop{0.25};
  nn::Linear l2;
  template <class B>
  nn::GVar operator()(nn::GTape<B>& tp, nn::GVar x) const {
    return l2(tp, drop(tp, nn::tanh(tp, l1(tp, x))));
  }
  NN_MODULE(Net, l1, drop, l2)
};

// A fixed, deterministic batch for step i (the data pipeline is not part of the checkpoint).
nn::Tensor batch(int i, std::int64_t rows, std::int64_t cols) {
  std::vector<float> v(static_cast<std::size_t>(rows * cols));
  for (std::size_t k = 0; k < v.size(); ++k) v[k] = static_cast<float>(std::sin(0.37 * (k + 1) + i));
  return nn::Tensor::from<float>({rows, cols}, v);
}

void train(Net& m, nn::Optimizer& opt, int from, int to) {
  for (int i = from; i < to; ++i) {
    nn::Tensor x = batch(i, 8, 5), y = batch(i + 1000, 8, 2);
    auto [loss, grads] = nn::value_and_grad(m, [&](nn::GTape<nn::cpu>& tp, const Net& n) {
      nn::GVar d = nn::sub(tp, n(tp, tp.constant(x)), tp.constant(y));
      return nn::mean(tp, nn::mul(tp, d, d));
    });
    opt.update(m, grads);
  }
}

}  // namespace

int main(int argc, char** argv) {
  if (argc != 3) {
    std::cerr << "usage: checkpoint_resume straight|first|second DIR\n";
    return 2;
  }
  const std::string mode = argv[1], dir = argv[2];
  const int N = 7, M = 6;
  nn::random::seed(42);
  Net m{nn::Linear(5, 16), nn::Dropout(0.25), nn::Linear(16, 2)};
  // one frozen tensor: the checkpoint stores only the trainable ones and fingerprints this one
  m.freeze([](const std::string& p) { return p == "l1.bias"; });
  nn::AdamW opt(nn::cosine_decay(1e-2, N + M));
  try {
    if (mode == "straight") {
      train(m, opt, 0, N + M);
      m.save_weights(dir + "/straight.safetensors");
    } else if (mode == "first") {
      train(m, opt, 0, N);
      nn::save(dir + "/run.safetensors", m, opt);
    } else if (mode == "second") {
      nn::random::seed(999);  // a fresh process with another seed: the checkpoint must restore it
      nn::load_into(dir + "/run.safetensors", m, opt);
      if (opt.step() != N) throw nn::Error("resumed at the wrong step");
      train(m, opt, N, N + M);
      m.save_weights(dir + "/resumed.safetensors");
    } else {
      return 2;
    }
  } catch (const nn::Error& e) {
    std::cerr << e.what() << "\n";
    return 1;
  }
  return 0;
}
