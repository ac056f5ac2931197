// SPDX-License-Identifier: MIT OR Apache-2.0
// The module seed's examples, ported to C++: they compile and run as written in the README.
#include "support/check.hpp"

// (nn.hpp came with check.hpp: the snippet's own include below adds nothing inside the namespace)
namespace modules_seed_examples {  // one unity source with the other modules files: its names stay its own

// --8<-- [start:mlp]
#include <nn/nn.hpp>

struct Mlp {
  nn::Linear hidden, out;

  template <class B>
  nn::GVar operator()(nn::GTape<B>& tp, nn::GVar x) const {
    return out(tp, nn::relu(tp, hidden(tp, x)));
  }
  NN_MODULE(Mlp, hidden, out)
};

double train(const nn::Tensor& x, const nn::Tensor& y) {
  nn::random::seed(0);
  Mlp model{nn::Linear(784, 512), nn::Linear(512, 10)};
  nn::Adam opt(1e-3);
  auto loss_fn = [&](nn::GTape<nn::cpu>& tp, const Mlp& m) {
    return nn::cross_entropy(tp, m(tp, tp.constant(x)), tp.constant(y));
  };
  double loss = 0;
  for (int i = 0; i < 100; ++i) {
    auto [value, grads] = nn::value_and_grad(model, loss_fn);  // grads: Mlp
    opt.update(model, grads);
    loss = value.item();
  }
  std::cout << model.display();  // Mlp (407,050 params, 407,050 trainable) ...
  return loss;
}
// --8<-- [end:mlp]

// --8<-- [start:attention]
struct Attention {
  nn::Linear q_proj;                 // a submodule: q_proj.weight, q_proj.bias
  std::optional<nn::RmsNorm> qn;     // reflected as q_norm; empty contributes nothing
  int heads = 4;                     // configuration: hashed into the structure, not saved
  nn::Tensor freqs;                  // a computed constant: not saved, not loaded
  nn::Buffer running_mean;           // saved and loaded, never trained
  nn::Param gate;                    // a raw parameter
  NN_MODULE(Attention, q_proj, NN_RENAME(qn, "q_norm"), running_mean, gate, NN_STATIC(heads),
            NN_UNCHECKED(freqs))
};
// --8<-- [end:attention]

TEST_CASE("the seed's Mlp trains with value_and_grad and Adam") {
  nn::random::seed(1);
  nn::Tensor x = nn::random::normal({8, 784});
  nn::Tensor y = nn::Tensor::from<std::int32_t>({8}, {0, 1, 2, 3, 4, 5, 6, 7});
  std::ostringstream captured;
  auto* old = std::cout.rdbuf(captured.rdbuf());
  double loss = train(x, y);
  std::cout.rdbuf(old);
  CHECK(captured.str().rfind("Mlp (407,050 params, 407,050 trainable)\n", 0) == 0);
  CHECK(loss < 0.05);  // 100 Adam steps memorise 8 examples; at init the loss is ~ln 10 = 2.3
}

TEST_CASE("the seed's Attention struct reflects as documented") {
  nn::random::seed(0);
  Attention a{nn::Linear(8, 8), nn::RmsNorm(8), 4, nn::Tensor::zeros({4}), nn::Buffer(nn::Tensor::zeros({8})),
              nn::Param(nn::Tensor::ones({1}))};
  std::vector<std::string> names;
  for (auto& [p, t] : a.parameters()) names.push_back(p);
  CHECK(names == std::vector<std::string>{"q_proj.weight", "q_proj.bias", "q_norm.weight", "running_mean", "gate"});
  a.qn.reset();
  CHECK(a.num_params() == 64 + 8 + 8 + 1);
  CHECK(a.num_trainable() == 64 + 8 + 1);
}

}  // namespace modules_seed_examples
