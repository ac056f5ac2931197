// SPDX-License-Identifier: MIT OR Apache-2.0
// Gradient checkpointing (activation recomputation): nn::checkpoint records a segment of ops whose
// intermediate values are not kept after the forward pass; the backward sweep runs the segment
// forward again when it reaches it (torch.utils.checkpoint, mlx-lm's --grad-checkpoint).
//
// How it works on the tape (tape.hpp, "checkpoint segments"): the segment's ops are ordinary
// nodes. When it closes, every op node but its outputs becomes "pooled": its value, gradient and
// saved buffers become views of a pool of blocks that all segments share, so the tape holds one
// segment's intermediates at a time instead of every segment's. Entering the segment in the
// backward sweep recomputes those nodes into the pool, their vjps run as without checkpointing,
// and leaving it hands the pool to the next segment. Parameters bound inside the segment are
// leaves, never pooled, so their gradients (LoRA adapters over a frozen or quantized base
// included) are accumulated exactly as without it: the results are bitwise equal. A compiled step
// replays the recomputation into the same pool, allocating nothing.
#pragma once

#include <functional>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "tape.hpp"

namespace nn {

namespace detail {
inline void segment_outputs(std::vector<GVar>& out, GVar v) { out.push_back(v); }
inline void segment_outputs(std::vector<GVar>& out, const std::vector<GVar>& vs) { out.insert(out.end(), vs.begin(), vs.end()); }
template <class T>
  requires requires(const T& t) { std::tuple_size<T>::value; }
void segment_outputs(std::vector<GVar>& out, const T& t) {  // std::pair, std::tuple, std::array of GVars
  std::apply([&](const auto&... v) { (segment_outputs(out, v), ...); }, t);
}
}  // namespace detail

/// Records f(args...) -- ops on `tp`, returning a GVar, a std::vector<GVar> or a pair/tuple/array
/// of them -- as a checkpoint segment, and returns what f returned. Only the returned values stay
/// readable; the segment's other intermediates are freed after the forward pass and recomputed
/// by the backward sweep, which costs one more forward of the segment per backward. f must be a
/// function of values recorded before it (its arguments, or GVars it captures) and of parameters,
/// and must record the same ops when run again (dropout does: its key is an input slot).
///   x = nn::checkpoint(tp, [&](GVar h) { return layer(tp, h); }, x);
/// Using an intermediate of the segment after it is an nn::Error naming the node; segments do not
/// nest. If f throws, the segment is closed without checkpointing and the exception propagates.
template <class B, class F, class... A>
auto checkpoint(GTape<B>& tp, F&& f, A&&... args) {
  static_assert(std::is_invocable_v<F, A...>, "nn::checkpoint(tp, f, args...) calls f(args...)");
  tp.begin_segment();
  try {
    auto out = std::invoke(std::forward<F>(f), std::forward<A>(args)...);
    std::vector<GVar> outs;
    detail::segment_outputs(outs, out);
    tp.end_segment(outs);
    return out;
  } catch (...) {
    tp.abandon_segment();
    throw;
  }
}

}  // namespace nn
