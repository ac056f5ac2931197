// SPDX-License-Identifier: MIT OR Apache-2.0
// The umbrella header: the whole CPU library. (nn/cuda.hpp adds the CUDA policy.)
#pragma once

#include "config.hpp"
#include "tensor.hpp"
#include "backend/policy.hpp"
#include "backend/cpu.hpp"
#include "tape.hpp"
#include "ops/common.hpp"
#include "ops/elementwise.hpp"
#include "ops/reduce.hpp"
#include "ops/matmul.hpp"
#include "ops/shape.hpp"
#include "ops/index.hpp"
#include "ops/softmax.hpp"
