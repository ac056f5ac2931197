// SPDX-License-Identifier: MIT OR Apache-2.0
// Must NOT compile: a compiled step's loss function that takes the model by non-const reference
// fails with the one static_assert naming the expected form, not pages of std::apply context.
// Built with -DNN_CONTROL (the model taken as const&) it must compile.
#include <nn/nn.hpp>

struct Net {
  nn::Linear l;
  NN_MODULE(Net, l)
};

int main() {
  Net m{nn::Linear(3, 2)};
  nn::Sgd opt(0.1);
#if defined(NN_CONTROL)
  auto step = nn::compile<2>(m, opt, [](nn::GTape<nn::cpu>& tp, const Net& n, nn::GVar x, nn::GVar y) {
#else
  auto step = nn::compile<2>(m, opt, [](nn::GTape<nn::cpu>& tp, Net& n, nn::GVar x, nn::GVar y) {
#endif
    return nn::cross_entropy(tp, n.l(tp, x), y);
  });
  return step.recordings();
}
