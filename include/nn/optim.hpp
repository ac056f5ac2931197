// SPDX-License-Identifier: MIT OR Apache-2.0
// Every optimizer, schedule and clip_grad_norm (included by nn.hpp).
#pragma once

#include "optim/optimizer.hpp"
#include "optim/schedules.hpp"
#include "optim/sgd.hpp"
#include "optim/adam.hpp"
#include "optim/lion.hpp"
#include "optim/muon.hpp"
#include "optim/adafactor.hpp"
#include "optim/multi.hpp"
#include "optim/clip.hpp"
