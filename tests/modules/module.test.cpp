// SPDX-License-Identifier: MIT OR Apache-2.0
// NN_MODULE reflection: names, containers, renames, freezing, train(), map_modules, to(),
// summary/display, and value_and_grad returning gradients of the model's own type.
#include "support/check.hpp"

#include <nn/module.hpp>

namespace modules_module {  // one unity source with the other modules files: its names stay its own

using namespace nn;

namespace {

// A minimal dense layer written against the tape, so these tests need no layer classes.
struct Dense {
  Param weight;  // (out, in)
  std::optional<Param> bias;
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    GVar y = matmul(tp, x, nn::param(tp, weight), false, true);
    return bias ? add(tp, y, nn::param(tp, *bias)) : y;
  }
  NN_MODULE(Dense, weight, bias)
};

Dense dense(std::int64_t in, std::int64_t out, std::uint64_t seed, bool with_bias = true) {
  Dense d{test::random_tensor({out, in}, DType::f64, seed), std::nullopt};
  if (with_bias) d.bias = Param(test::random_tensor({out}, DType::f64, seed + 100));
  return d;
}

struct Other {
  Param scale;
  NN_MODULE(Other, scale)
};

struct Norm {
  Param weight;
  Buffer running_mean;
  NN_MODULE(Norm, weight, running_mean)
};

struct Block {
  Dense q_proj;
  std::optional<Norm> qn;                 // reflected as q_norm
  std::variant<Dense, Other> mixer;       // transparent
  int heads = 4;                          // configuration: part of the structure
  NN_MODULE(Block, q_proj, NN_RENAME(qn, "q_norm"), mixer, NN_STATIC(heads))
};

struct Net {
  std::vector<Block> layers;
  Dense head;
  NN_MODULE(Net, layers, head)
};

Net make_net() {
  Net n;
  for (int i = 0; i < 2; ++i) {
    Block b{dense(3, 3, 10 + i), Norm{Param(Tensor::ones({3}, DType::f64)), Buffer(Tensor::zeros({3}, DType::f64))},
            dense(3, 3, 20 + i, false)};
    n.layers.push_back(b);
  }
  n.layers[1].qn.reset();
  n.layers[1].mixer = Other{Param(Tensor::ones({1}, DType::f64))};
  n.head = dense(3, 2, 30);
  return n;
}


}  // namespace

TEST_CASE("parameter paths follow MLX / PyTorch naming, in declaration order") {
  Net n = make_net();
  std::vector<std::string> expect{"layers.0.q_proj.weight", "layers.0.q_proj.bias", "layers.0.q_norm.weight",
                                  "layers.0.q_norm.running_mean", "layers.0.mixer.weight",
                                  "layers.1.q_proj.weight", "layers.1.q_proj.bias", "layers.1.mixer.scale",
                                  "head.weight", "head.bias"};
  // variant alternatives are transparent: "mixer" comes from the field, "weight"/"scale" from the alternative
  CHECK(test::paths(n.parameters()) == expect);
  CHECK(n.num_params() == 9 + 3 + 3 + 3 + 9 + 9 + 3 + 1 + 6 + 2);
  CHECK(n.num_trainable() == n.num_params() - 3);  // the Buffer is never trainable
}

TEST_CASE("freeze / unfreeze by path return how many changed") {
  Net n = make_net();
  CHECK(n.freeze() == 9);  // every Param (buffers are not params)
  CHECK(n.num_trainable() == 0);
  CHECK(n.unfreeze([](const std::string& p) { return p.find("q_proj") != std::string::npos; }) == 4);
  CHECK(n.unfreeze([](const std::string& p) { return p.find("q_proj") != std::string::npos; }) == 0);
  CHECK(test::paths(n.trainable_parameters()) ==
        std::vector<std::string>{"layers.0.q_proj.weight", "layers.0.q_proj.bias", "layers.1.q_proj.weight",
                                 "layers.1.q_proj.bias"});
}

TEST_CASE("train() reaches every module; to() converts every tensor") {
  Net n = make_net();
  n.train(false);
  CHECK_FALSE(n.training());
  CHECK_FALSE(n.layers[0].q_proj.training());
  CHECK_FALSE(std::get<Other>(n.layers[1].mixer).training());
  n.train(true);
  CHECK(n.layers[1].q_proj.training());
  n.to(DType::f32);
  for (auto& [p, t] : n.parameters()) CHECK_MESSAGE(t.dtype() == DType::f32, p);
}

TEST_CASE("map_modules edits in place, or replaces a variant's alternative") {
  Net n = make_net();
  int edited = n.map_modules<Dense>([](const std::string& p) { return p.rfind("layers.", 0) == 0; },
                                    [](const std::string&, Dense& d) { d.bias.reset(); });
  CHECK(edited == 3);  // layers.0.q_proj, layers.0.mixer, layers.1.q_proj
  CHECK_FALSE(n.layers[0].q_proj.bias.has_value());
  CHECK(n.head.bias.has_value());
  int replaced = n.map_modules<Dense>([](const std::string& p) { return p == "layers.0.mixer"; },
                                      [](const std::string&, const Dense&) { return Other{Param(Tensor::ones({1}, DType::f64))}; });
  CHECK(replaced == 1);
  CHECK(std::holds_alternative<Other>(n.layers[0].mixer));
}

TEST_CASE("summary and display") {
  Net n = make_net();
  std::string d = n.display();
  CHECK(d.rfind("Net (48 params, 45 trainable)", 0) == 0);
  CHECK(d.find("\n  layers.0: Block (27 params, 24 trainable)\n") != std::string::npos);
  CHECK(d.find("\n    q_proj: Dense (12 params, 12 trainable)\n") != std::string::npos);
  std::string s = n.summary();
  CHECK(s.find("layers.0.q_norm.running_mean") != std::string::npos);
  CHECK(s.find("buffer") != std::string::npos);
  MESSAGE(d << s);
}

TEST_CASE("value_and_grad returns gradients of the model's own type; frozen leaves are empty") {
  Net n = make_net();
  n.layers[0].q_proj.freeze();
  Tensor X = test::random_tensor({4, 3}, DType::f64, 7);
  auto loss_fn = [&](GTape<cpu>& tp, const Net& m) {
    GVar h = tp.constant(X);
    for (const Block& b : m.layers) {
      h = tanh(tp, b.q_proj(tp, h));
      if (const Dense* d = std::get_if<Dense>(&b.mixer)) h = (*d)(tp, h);
    }
    GVar y = m.head(tp, h);
    return sum(tp, mul(tp, y, y));
  };
  auto [loss, grads] = value_and_grad(n, loss_fn);
  CHECK(loss.numel() == 1);
  CHECK_FALSE(grads.layers[0].q_proj.weight.value.defined());  // frozen
  CHECK(grads.head.weight.value.shape() == n.head.weight.value.shape());
  CHECK(std::get<Other>(grads.layers[1].mixer).scale.value.item() == 0.0);  // unused: zeros
  // each gradient equals a finite difference of the same loss
  double h = 1e-6;
  auto eval = [&]() {
    GTape<cpu> tp;
    return tp.value(loss_fn(tp, n)).item();
  };
  double worst = 0;
  for (auto [pm, pg] : {std::pair{&n.head.weight, &grads.head.weight}, {&n.layers[1].q_proj.weight, &grads.layers[1].q_proj.weight}}) {
    double* w = pm->value.data<double>();
    for (std::int64_t i = 0; i < pm->value.numel(); ++i) {
      double keep = w[i];
      w[i] = keep + h;
      double up = eval();
      w[i] = keep - h;
      double dn = eval();
      w[i] = keep;
      double num = (up - dn) / (2 * h), ana = pg->value.data<double>()[i];
      worst = std::max(worst, std::abs(num - ana) / std::max(1.0, std::abs(num)));
    }
  }
  CHECK(worst < 1e-7);
}

TEST_CASE("a weight bound twice on one tape is one leaf with both contributions") {
  Tensor W = Tensor::from<double>({1}, {3.0});
  GTape<cpu> tp;
  GVar a = tp.param(W), b = tp.param(W);
  CHECK(a.index == b.index);
  GVar l = sum(tp, mul(tp, a, b));
  tp.backward(l);
  CHECK(tp.grad(a).item() == 6.0);
}

}  // namespace modules_module
