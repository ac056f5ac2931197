// SPDX-License-Identifier: MIT OR Apache-2.0
// Gradient trees as values (include/nn/tree.hpp): accumulating value_and_grad's gradients over
// micro-batches with tree_add / tree_scale equals the gradient of the mean loss over the whole
// batch; tree_zero, tree_map over one and two trees; structure and shape mismatches are errors;
// clone() is a snapshot where a copy shares storage.
#include "support/check.hpp"

#include <nn/module.hpp>
#include <nn/tree.hpp>

#include <algorithm>

namespace modules_tree {  // one unity source with the other modules files: its names stay its own

using namespace nn;

namespace {

struct Lin {
  Param weight;  // (out, in)
  Param bias;    // (out)
  template <class B>
  GVar operator()(GTape<B>& tp, GVar x) const {
    return add(tp, matmul(tp, x, nn::param(tp, weight), false, true), nn::param(tp, bias));
  }
  NN_MODULE(Lin, weight, bias)
};

struct Mlp {
  std::vector<Lin> layers;
  NN_MODULE(Mlp, layers)
};

Mlp make_mlp() {
  Mlp m;
  m.layers.push_back({test::random_tensor({5, 3}, DType::f64, 1), test::random_tensor({5}, DType::f64, 2)});
  m.layers.push_back({test::random_tensor({2, 5}, DType::f64, 3), test::random_tensor({2}, DType::f64, 4)});
  return m;
}

// mean over the rows of x of the squared outputs
GVar loss_of(GTape<cpu>& tp, const Mlp& m, const Tensor& x) {
  GVar h = tp.constant(x);
  h = tanh(tp, m.layers[0](tp, h));
  h = m.layers[1](tp, h);
  return scale(tp, sum(tp, mul(tp, h, h)), 1.0 / static_cast<double>(x.dim(0)));
}

std::vector<Tensor> leaves(const Mlp& m) {
  std::vector<Tensor> out;
  detail::for_each(m, [&](const std::string&, const Param& p) { out.push_back(p.value); });
  return out;
}

}  // namespace

TEST_CASE("tree_add and tree_scale over micro-batches give the whole batch's gradient; frozen leaves stay empty") {
  Mlp m = make_mlp();
  m.layers[0].bias.trainable = false;
  const Tensor X = test::random_tensor({12, 3}, DType::f64, 5);
  // the whole batch at once
  auto [l_all, g_all] = value_and_grad(m, [&](GTape<cpu>& tp, const Mlp& mm) { return loss_of(tp, mm, X); });
  // three micro-batches of 4 rows, each with its own mean: the mean of the three is the whole mean
  std::optional<Mlp> sum;
  for (int k = 0; k < 3; ++k) {
    Tensor xk = Tensor::zeros({4, 3}, DType::f64);
    std::copy_n(X.data<double>() + 12 * k, 12, xk.data<double>());
    auto [l, g] = value_and_grad(m, [&](GTape<cpu>& tp, const Mlp& mm) { return loss_of(tp, mm, xk); });
    if (!sum) sum = std::move(g);
    else tree_add(*sum, g);
  }
  tree_scale(*sum, 1.0 / 3.0);
  CHECK_FALSE(sum->layers[0].bias.value.defined());
  const std::vector<Tensor> a = leaves(*sum), b = leaves(g_all);
  REQUIRE(a.size() == b.size());
  for (std::size_t i = 0; i < a.size(); ++i) {
    CHECK(a[i].defined() == b[i].defined());
    if (a[i].defined()) CHECK(test::rel_err(a[i], b[i]) < 1e-14);
  }
  // an empty leaf of the sum takes the addend's
  Mlp partial = *sum;
  partial.layers[1].weight.value = Tensor();
  tree_add(partial, g_all);
  CHECK(test::rel_err(partial.layers[1].weight.value, g_all.layers[1].weight.value) == 0.0);
  CHECK(partial.layers[1].weight.value.raw() != g_all.layers[1].weight.value.raw());  // a copy, not shared
}

TEST_CASE("tree_zero zeroes in place; tree_map visits every leaf with its path") {
  Mlp m = make_mlp();
  Mlp view = m;  // copies of a model share storage
  tree_zero(m);
  for (const Tensor& t : leaves(view))
    for (std::int64_t i = 0; i < t.numel(); ++i) CHECK(t.data<double>()[i] == 0.0);
  std::vector<std::string> paths;
  tree_map(m, [&](const std::string& p, Param&) { paths.push_back(p); });
  CHECK(paths == std::vector<std::string>{"layers.0.weight", "layers.0.bias", "layers.1.weight", "layers.1.bias"});
  Mlp other = make_mlp();
  int n = 0;
  tree_map(m, other, [&](const std::string&, Param& out, const Param& in) {
    out.value = in.value.clone();
    ++n;
  });
  CHECK(n == 4);
  CHECK(test::rel_err(m.layers[1].bias.value, other.layers[1].bias.value) == 0.0);
}

TEST_CASE("trees of different structure or leaf shapes are an nn::Error naming the path") {
  Mlp a = make_mlp(), b = make_mlp();
  b.layers.pop_back();
  test::check_error([&] { tree_add(a, b); }, {"[tree_map]", "differ in structure", "layers.1.weight"});
  Mlp c = make_mlp();
  c.layers[1].bias.value = test::random_tensor({3}, DType::f64, 9);
  test::check_error([&] { tree_add(a, c); }, {"[tree_add]", "'layers.1.bias'", "(2)", "(3)"});
}

TEST_CASE("copies of a model share storage; nn::clone is a snapshot") {
  Mlp m = make_mlp();
  Mlp shared = m;
  Mlp snap = nn::clone(m);
  const double before = m.layers[0].weight.value.data<double>()[0];
  m.layers[0].weight.value.data<double>()[0] = before + 1.0;
  CHECK(shared.layers[0].weight.value.data<double>()[0] == before + 1.0);
  CHECK(snap.layers[0].weight.value.data<double>()[0] == before);
  CHECK(test::rel_err(snap.layers[1].bias.value, m.layers[1].bias.value) == 0.0);
}

}  // namespace modules_tree
