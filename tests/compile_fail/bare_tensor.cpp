// SPDX-License-Identifier: MIT OR Apache-2.0
// Must NOT compile: a bare nn::Tensor listed in NN_MODULE has no role (Param or Buffer).
// Built with -DNN_CONTROL it must compile, which proves the failure is the one intended.
#include <nn/nn.hpp>

struct Bad {
#if defined(NN_CONTROL)
  nn::Param w;
#else
  nn::Tensor w;
#endif
  NN_MODULE(Bad, w)
};

int main() { return static_cast<int>(Bad{}.num_params()); }
