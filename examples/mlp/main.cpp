// SPDX-License-Identifier: MIT OR Apache-2.0
// Trains a two-layer MLP on Fashion-MNIST with the tape directly: parameters are plain Tensors
// bound with tp.param, one step is recorded once and replayed for every batch, and SGD is written
// out by hand on data<float>(). Prints the loss per epoch and the test accuracy.
//
//   mlp [--epochs N] [--train N] [--batch N] [--hidden N] [--lr X] [--data DIR]
//
// The data are Debian's dataset-fashion-mnist (gzip'd IDX files in /usr/share/datasets/
// fashion-mnist, read by ../fashion_mnist.hpp); --data or $NN_FASHION_MNIST_DIR point elsewhere.
// Exit 77: data not found.
#include <nn/nn.hpp>

#include "../fashion_mnist.hpp"

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <numeric>
#include <random>
#include <string>
#include <vector>

namespace {

using fashion_mnist::Split;

/// U(-1/sqrt(in), 1/sqrt(in)), the initialisation of PyTorch's and MLX's Linear.
nn::Tensor uniform(const nn::Shape& shape, std::int64_t fan_in, std::mt19937& rng) {
  nn::Tensor t = nn::Tensor::empty(shape, nn::DType::f32);
  float bound = 1.0f / std::sqrt(static_cast<float>(fan_in));
  std::uniform_real_distribution<float> u(-bound, bound);
  for (std::int64_t i = 0; i < t.numel(); ++i) t.data<float>()[i] = u(rng);
  return t;
}

struct Params {
  nn::Tensor w1, b1, w2, b2;  // Linear layout: weight (out, in), as PyTorch and MLX store it
};

/// The parameters' leaves on one tape (frozen for evaluation: no gradient buffers).
struct Leaves {
  nn::GVar w1, b1, w2, b2;
};
Leaves bind(nn::GTape<nn::cpu>& tp, Params& p, bool trainable) {
  return {tp.param(p.w1, trainable), tp.param(p.b1, trainable), tp.param(p.w2, trainable), tp.param(p.b2, trainable)};
}

/// The model. x: (B, 784) -> h = relu(x W1^T + b1): (B, H) -> logits = h W2^T + b2: (B, 10).
nn::GVar logits(nn::GTape<nn::cpu>& tp, const Leaves& v, nn::GVar x) {
  nn::GVar h = nn::relu(tp, nn::add(tp, nn::matmul(tp, x, v.w1, false, true), v.b1));
  return nn::add(tp, nn::matmul(tp, h, v.w2, false, true), v.b2);
}

/// Copies rows idx[from, from+B) of the split into the batch tensors.
void fill_batch(const Split& s, const std::vector<std::int64_t>& idx, std::int64_t from, nn::Tensor& x, nn::Tensor& y) {
  const std::int64_t B = x.dim(0);
  for (std::int64_t i = 0; i < B; ++i) {
    std::int64_t r = idx[static_cast<std::size_t>(from + i)];
    std::copy_n(s.x.data<float>() + r * 784, 784, x.data<float>() + i * 784);
    y.data<std::int32_t>()[i] = s.y.data<std::int32_t>()[r];
  }
}

/// Test accuracy, in chunks of a forward-only tape recorded once and replayed per chunk.
double accuracy(Params& p, const Split& test) {
  const std::int64_t C = 1000, chunks = test.n / C;
  nn::Tensor x = nn::Tensor::empty({C, 784}, nn::DType::f32), y = nn::Tensor::empty({C}, nn::DType::i32);
  std::vector<std::int64_t> order(static_cast<std::size_t>(test.n));
  std::iota(order.begin(), order.end(), 0);
  nn::GTape<nn::cpu> tp;
  nn::GVar xin = tp.input(x);
  nn::GVar out = logits(tp, bind(tp, p, /*trainable=*/false), xin);
  std::int64_t right = 0;
  for (std::int64_t c = 0; c < chunks; ++c) {
    fill_batch(test, order, c * C, x, y);
    tp.set(xin, x);
    tp.replay_forward();
    const float* l = tp.value(out).data<float>();
    for (std::int64_t i = 0; i < C; ++i)
      right += std::max_element(l + i * 10, l + i * 10 + 10) - (l + i * 10) == y.data<std::int32_t>()[i];
  }
  return chunks ? static_cast<double>(right) / static_cast<double>(chunks * C) : 0.0;
}

}  // namespace

int main(int argc, char** argv) {
  int epochs = 5;
  std::int64_t train_n = 0, batch = 100, hidden = 128;  // train_n 0: the whole training set
  float lr = 0.1f;
  std::filesystem::path dir = fashion_mnist::default_dir();
  for (int i = 1; i + 1 < argc; i += 2) {
    std::string k = argv[i], v = argv[i + 1];
    if (k == "--epochs") epochs = std::stoi(v);
    else if (k == "--train") train_n = std::stoll(v);
    else if (k == "--batch") batch = std::stoll(v);
    else if (k == "--hidden") hidden = std::stoll(v);
    else if (k == "--lr") lr = std::stof(v);
    else if (k == "--data") dir = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  if (!fashion_mnist::present(dir)) {
    std::fprintf(stderr, "Fashion-MNIST not found in %s (Debian: apt-get install dataset-fashion-mnist)\n", dir.c_str());
    return 77;
  }

  using clock = std::chrono::steady_clock;
  auto t0 = clock::now();
  Split train = fashion_mnist::load_split(dir, "train", train_n, "mlp");
  Split test = fashion_mnist::load_split(dir, "t10k", 0, "mlp");
  std::printf("nn %s (%s GEMM): %lld training / %lld test images from %s, loaded in %.1f s\n", NN_VERSION_STRING,
#if defined(NN_USE_BLAS)
              "CBLAS",
#else
              "Eigen",
#endif
              static_cast<long long>(train.n), static_cast<long long>(test.n), dir.c_str(),
              std::chrono::duration<double>(clock::now() - t0).count());
  if (train.n < batch) {
    std::fprintf(stderr, "need at least one batch of %lld training images\n", static_cast<long long>(batch));
    return 2;
  }

  std::mt19937 rng(0);
  Params p{uniform({hidden, 784}, 784, rng), uniform({hidden}, 784, rng), uniform({10, hidden}, hidden, rng),
           uniform({10}, hidden, rng)};
  std::vector<std::int64_t> order(static_cast<std::size_t>(train.n));
  std::iota(order.begin(), order.end(), 0);

  // Record one training step: mean cross-entropy of log_softmax, picked at the labels.
  nn::Tensor xb = nn::Tensor::empty({batch, 784}, nn::DType::f32), yb = nn::Tensor::empty({batch}, nn::DType::i32);
  fill_batch(train, order, 0, xb, yb);
  nn::GTape<nn::cpu> tp;
  nn::GVar x = tp.input(xb), y = tp.input(yb);
  const Leaves v = bind(tp, p, /*trainable=*/true);
  nn::GVar loss = nn::neg(tp, nn::mean(tp, nn::pick(tp, nn::log_softmax(tp, logits(tp, v, x)), y)));
  tp.backward(loss);
  const nn::GVar params[] = {v.w1, v.b1, v.w2, v.b2};
  nn::Tensor* tensors[] = {&p.w1, &p.b1, &p.w2, &p.b2};
  const float first_loss = tp.value(loss).data<float>()[0];
  std::printf("before training: loss %.4f, test accuracy %.1f%%\n", first_loss, 100 * accuracy(p, test));

  const std::int64_t steps = train.n / batch;
  float last = first_loss;
  double acc = 0;
  for (int e = 1; e <= epochs; ++e) {
    auto te = clock::now();
    std::shuffle(order.begin(), order.end(), rng);
    double total = 0;
    for (std::int64_t s = 0; s < steps; ++s) {
      fill_batch(train, order, s * batch, xb, yb);
      tp.set(x, xb);
      tp.set(y, yb);
      tp.replay();  // forward + backward into the buffers the recording allocated
      total += tp.value(loss).data<float>()[0];
      for (std::size_t k = 0; k < 4; ++k) {  // plain SGD, in place: the replay re-reads the params
        float* w = tensors[k]->data<float>();
        const float* g = tp.grad(params[k]).data<float>();
        for (std::int64_t i = 0; i < tensors[k]->numel(); ++i) w[i] -= lr * g[i];
      }
    }
    last = static_cast<float>(total / static_cast<double>(steps));
    acc = accuracy(p, test);
    std::printf("epoch %d/%d: loss %.4f, test accuracy %.1f%%  (%.1f s)\n", e, epochs, last, 100 * acc,
                std::chrono::duration<double>(clock::now() - te).count());
    std::fflush(stdout);
  }
  // Self-check, so CTest's smoke run means something: the loss fell and accuracy beats chance.
  if (epochs > 0 && !(last < first_loss && acc > 0.5)) {
    std::fprintf(stderr, "training did not converge (loss %.4f -> %.4f, accuracy %.3f)\n", first_loss, last, acc);
    return 1;
  }
  return 0;
}
