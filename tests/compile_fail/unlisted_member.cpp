// SPDX-License-Identifier: MIT OR Apache-2.0
// Must NOT compile: an aggregate module with a data member NN_MODULE does not list (here a
// LoRA-like scale a compiled step could not see change). Built with -DNN_CONTROL, where the
// member is listed as static configuration, it must compile.
#include <nn/nn.hpp>

struct Bad {
  nn::Param w;
  double scale = 1.0;
#if defined(NN_CONTROL)
  NN_MODULE(Bad, w, NN_STATIC(scale))
#else
  NN_MODULE(Bad, w)
#endif
};

int main() { return static_cast<int>(Bad{}.num_params()); }
