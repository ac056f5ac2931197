// SPDX-License-Identifier: MIT OR Apache-2.0
// The one translation unit of a NN_PRECOMPILED program that compiles nn's common CPU code
// (precompiled.hpp lists what, and says how to opt in). Include it in exactly one .cpp file;
// CMake's nn::precompiled target does that for you.
#pragma once

#include "nn.hpp"

NN_DEFINE_CPU_INSTANCES()

namespace nn::detail {
// Every primitive of NN_PRIMITIVES has its Prim struct in NN_CPU_INSTANCES: a new primitive that
// is not listed would compile its kernels in every file again, silently.
#define NN_COUNT_ONE(p) +1
#define NN_COUNT_PRIM_INSTANCE(kind, ...) +(std::string_view(#__VA_ARGS__).find("Prim<") != std::string_view::npos)
static_assert((0 NN_PRIMITIVES(NN_COUNT_ONE)) == (0 NN_CPU_INSTANCES(NN_COUNT_PRIM_INSTANCE)),
              "NN_CPU_INSTANCES (nn/precompiled.hpp) must list the Prim struct of every primitive");
#undef NN_COUNT_ONE
#undef NN_COUNT_PRIM_INSTANCE
}  // namespace nn::detail
