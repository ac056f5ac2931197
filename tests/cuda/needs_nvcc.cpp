// SPDX-License-Identifier: MIT OR Apache-2.0
// Must not compile: <nn/cuda.hpp> from a plain C++ compiler stops with "compiled by nvcc".
#include <nn/cuda.hpp>

int main() { return 0; }
