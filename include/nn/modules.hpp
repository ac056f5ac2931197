// SPDX-License-Identifier: MIT OR Apache-2.0
// Every module layer class (included by nn.hpp).
#pragma once

#include "modules/linear.hpp"
#include "modules/embedding.hpp"
#include "modules/norm.hpp"
#include "modules/rope.hpp"
#include "modules/dropout.hpp"
#include "modules/quantized.hpp"
#include "modules/dora.hpp"
#include "modules/lora.hpp"
