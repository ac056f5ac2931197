// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::precompiled's one source: the common CPU instances of nn, compiled once for every file of a
// program built with NN_PRECOMPILED (include/nn/precompiled.hpp).
#include <nn/instantiate.hpp>
