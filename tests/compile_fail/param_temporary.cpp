// SPDX-License-Identifier: MIT OR Apache-2.0
// Must NOT compile: binding a temporary tensor as a param would leave the tape pointing at a
// destroyed tensor (params bind by reference, so a replay re-reads them). Built with
// -DNN_CONTROL (a named tensor) it must compile.
#include <nn/nn.hpp>

int main() {
  nn::GTape<nn::cpu> tp;
#if defined(NN_CONTROL)
  const nn::Tensor w = nn::Tensor::zeros({2}, nn::DType::f32);
  nn::GVar v = tp.param(w);
#else
  nn::GVar v = tp.param(nn::Tensor::zeros({2}, nn::DType::f32));
#endif
  return v.valid() ? 0 : 1;
}
