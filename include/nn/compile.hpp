// SPDX-License-Identifier: MIT OR Apache-2.0
// A compiled training step (MLX's mx.compile(step, inputs=state, outputs=state)): the first call
// records forward, backward and the optimizer update; later calls replay the same tape into the
// buffers it owns, with no re-recording and no heap allocation.
#pragma once

#include <array>
#include <cstdio>
#include <cmath>
#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "module.hpp"
#include "ops/fused.hpp"
#include "optim/clip.hpp"
#include "optim/optimizer.hpp"

namespace nn {

/// One trainable parameter's gradient buffer, as a compiled step hands them to a gradient
/// reduction (CompiledStep::reduce_gradients) in tree order.
struct GradBuffer {
  std::string path;  // "layers.0.weight"
  Tensor* grad;      // the buffer the update reads: a reduction writes its result here
};

namespace detail {
/// How a compiled step feeds and replays its recorded tape: tp.set() and tp.replay() here. A
/// device backend may specialise it (nn/cuda.hpp captures the replay into a CUDA graph once and
/// relaunches it, copying each batch into buffers the graph owns).
template <class B>
struct TapeReplayer {
  void set(GTape<B>& tp, GVar slot, const Tensor& t) { tp.set(slot, t); }
  void replay(GTape<B>& tp) { tp.replay(); }
  void reset() {}  // the tape was recorded again
};

/// GVar, once per batch index (a pack of N GVars from an index sequence). A member type, not an
/// alias: nvcc's front end folds an alias that ignores its argument and then sees no pack.
template <std::size_t>
struct BatchVar {
  using type = GVar;
};

/// Whether loss_fn(GTape<B>&, const M&, GVar x N) -> GVar is a valid call.
template <class F, class B, class M, std::size_t... I>
constexpr bool loss_fn_fits(std::index_sequence<I...>) {
  return std::is_invocable_r_v<GVar, F&, GTape<B>&, const M&, typename BatchVar<I>::type...>;
}
}  // namespace detail

/// The step `compile(model, opt, loss_fn)` returns. Calling it with the batch tensors runs one
/// training step (loss, gradients, optimizer update) and returns the loss (a 0-D tensor owned by
/// the step: read it before the next call).
///
/// Configuration is structure (the module seed's rule): every call compares the batch's shapes
/// and dtypes, the model's structure hash (detail::structure_hash: the tree, each Param's and
/// Buffer's shape, dtype and storage, the frozen set, train/eval flags and every NN_STATIC
/// value, such as a LoRA scale, a dropout p or an RMSNorm eps) and the optimizer's
/// hyperparameter hash (its NN_OPTIMIZER fields). Any change records the step again, once: a
/// module replaced through map_modules, a Param given a new tensor, a frozen layer, new betas.
/// The learning rate and step count are tensors and change without re-recording. Random keys
/// drawn on the tape (tp.random_key(), used by Dropout) are refilled from nn::random's global
/// sequence before each replay, in recording order, so a compiled run draws exactly the masks an
/// eager run draws. Members a module lists in NN_UNCHECKED are baked in; reset() forces a
/// recording.
template <class B, class M, class F, std::size_t N>
class CompiledStep {
  static constexpr bool kFits = detail::loss_fn_fits<F, B, M>(std::make_index_sequence<N>{});
  static_assert(kFits,
                "nn::compile<N>(model, opt, loss_fn): loss_fn must be callable as "
                "loss_fn(nn::GTape<B>& tp, const M& model, nn::GVar batch_1, ..., nn::GVar batch_N) -> nn::GVar "
                "(the scalar loss), where N is compile's template argument, the number of batch tensors the step "
                "is called with; take the model as const M& (or auto&)");

 public:
  CompiledStep(M& model, Optimizer& opt, F fn) : model_(&model), opt_(&opt), fn_(std::move(fn)) {}

  template <class... T>
  Tensor operator()(const T&... batch) {
    static_assert(sizeof...(T) == N, "a compiled step is called with the batch tensors it was declared with");
    std::array<const Tensor*, N> in{&batch...};
    if (stale(in)) record(in);
    else replay(in);
    update();
    return tp_.value(loss_);
  }

  /// Clips the gradients to a global norm before each update, as
  /// `opt.update(model, nn::clip_grad_norm(grads, max_norm).first)` does in an eager step: the
  /// norm is summed over the tape's gradient buffers in tree order and they are scaled in place
  /// (no allocation), so the result equals the eager one bit for bit. A negative value turns
  /// clipping off (the default).
  CompiledStep& clip_grad_norm(double max_norm) {
    clip_ = max_norm;
    return *this;
  }
  /// Anomaly mode on the step's tape (GTape::detect_anomaly): the recording and every replay
  /// check each value and gradient for NaN and Inf, and raise naming the op before the update
  /// runs. On already when NN_DETECT_ANOMALY=1 was set as the step was made.
  CompiledStep& detect_anomaly(bool on) {
    tp_.detect_anomaly(on);
    return *this;
  }
  /// Runs reduce(slots) on every call between backward and the update, on the recording and on
  /// every replay: the gradient buffers in tree order, to be rewritten in place. Data-parallel
  /// training passes a nn::distributed::GradientAverager (nn/distributed.hpp), so the finite
  /// check, clipping and the update all see the averaged gradients, identically on every rank.
  /// The reducer is held by reference: it must outlive the step.
  template <class R>
  CompiledStep& reduce_gradients(R& reduce) {
    reduce_ = [&reduce](std::span<const GradBuffer> s) { reduce(s); };
    return *this;
  }
  /// Memory planning (on by default, CPU tapes): buffers whose lifetimes in the step do not
  /// overlap share memory (GTape::plan_memory), so the step holds what its backward pass reads
  /// plus one layer's transients, not every intermediate and every gradient. The results are
  /// the same bit for bit. Off: every node keeps its own buffers (for reading intermediates
  /// through tape()). Changing it records the step again.
  CompiledStep& plan_memory(bool on) {
    if (on != plan_) recorded_ = false;
    plan_ = on;
    return *this;
  }
  /// Elementwise fusion (nn::fuse_elementwise, ops/fused.hpp): the recording's chains of unary
  /// and binary nodes run as one fused node each, forward and backward, one pass over memory
  /// instead of one per node, with results equal bit for bit. CPU tapes with memory planning
  /// only (its intermediates are unreadable anyway), and CUDA tapes (one kernel per group). Off
  /// by default; NN_FUSION=1 in the environment turns it on for steps made afterwards, and
  /// NN_FUSION_LOG=1 prints each recording's groups (nn::fusion_report) to stderr. Changing it
  /// records the step again.
  CompiledStep& fuse(bool on) {
    if (on != fuse_) recorded_ = false;
    fuse_ = on;
    return *this;
  }
  /// What the last recording's fusion pass did (zeros when fusion is off).
  const FusionStats& fusion() const { return fusion_; }

  /// The global gradient norm of the last call, before clipping (0 when not clipping).
  double grad_norm() const { return grad_norm_; }

  /// How many times the step has been recorded (1 after the first call when nothing changed).
  int recordings() const { return recordings_; }
  /// Forces the next call to record again.
  void reset() { recorded_ = false; }
  /// The tape (for inspection: node count, values).
  const GTape<B>& tape() const { return tp_; }

 private:
  struct Entry {
    std::string path;
    Tensor param;  // shares the Param's storage (a handle, so a moved module cannot leave it dangling)
    Tensor* grad;  // the tape's gradient buffer of this parameter
  };

  bool stale(const std::array<const Tensor*, N>& in) const {
    if (!recorded_) return true;
    for (std::size_t i = 0; i < N; ++i) {
      const Tensor& t = tp_.value(inputs_[i]);
      if (!(in[i]->shape() == t.shape()) || in[i]->dtype() != t.dtype()) return true;
    }
    return detail::structure_hash(static_cast<const M&>(*model_)) != structure_ || opt_->hyper_hash() != hyper_;
  }

  void record(const std::array<const Tensor*, N>& in) {
    recorded_ = false;  // until this recording has run: a throw leaves the step to record again
    tp_.clear();
    entries_.clear();
    slots_.clear();
    std::array<GVar, N> vars{};
    for (std::size_t i = 0; i < N; ++i) vars[i] = tp_.input(*in[i]);
    for (std::size_t i = 0; i < N; ++i) inputs_[i] = vars[i];
    // On the CPU the recording defers every kernel and plans the buffers first (GTape::
    // plan_memory), so not even the first call holds every intermediate at once.
    const bool plan = plan_ && std::is_same_v<B, cpu>;
    if constexpr (kFits) {  // else only the static_assert above speaks
      auto build = [&] { return std::apply([&](auto... v) { return fn_(tp_, static_cast<const M&>(*model_), v...); }, vars); };
      loss_ = plan ? tp_.record_deferred(build) : build();
    }
    fusion_ = {};
    // (a CUDA tape is recorded eagerly, unplanned: its groups are fused after their unfused first run)
    if (fuse_ && (plan || B::device != Device::cpu)) {
      fusion_ = fuse_elementwise(tp_, loss_);
      if (detail::env_flag("NN_FUSION_LOG")) std::fputs(fusion_report(tp_).c_str(), stderr);
    }
    if (plan) {
      tp_.plan_memory(loss_);
      tp_.replay_forward();
    }
    tp_.backward(loss_);
    detail::for_each(*model_, [&](const std::string& path, Param& p) {
      if (!p.trainable || !is_floating(p.value.dtype())) return;
      std::optional<GVar> v = tp_.find_param(p.value);
      if (!v) detail::fail("compile", "trainable parameter '", path, "' is not used by the loss");
      opt_->init_param(path, p.value);
      // The tape owns the buffer; clipping scales it in place between backward and the update.
      entries_.push_back({path, p.value, const_cast<Tensor*>(&tp_.grad(*v))});
      slots_.push_back({path, entries_.back().grad});
    });
    structure_ = detail::structure_hash(static_cast<const M&>(*model_));
    hyper_ = opt_->hyper_hash();
    replayer_.reset();
    recorded_ = true;
    ++recordings_;
  }

  void replay(const std::array<const Tensor*, N>& in) {
    for (std::size_t i = 0; i < N; ++i) replayer_.set(tp_, inputs_[i], *in[i]);
    tp_.refresh_keys();
    replayer_.replay(tp_);
  }

  // The optimizer's update over the recorded parameters, in tree order (as Optimizer::update).
  void update() {
    if (reduce_) reduce_(slots_);
    // Optimizer::admit's gate, before clipping (a NaN norm would scale every gradient to NaN).
    for (const Entry& e : entries_) {
      bool finite;
      if constexpr (std::is_same_v<B, cpu>) finite = detail::all_finite(*e.grad);
      else finite = std::isfinite(B::sum_squares(*e.grad));  // one reduction on the device
      if (!opt_->admit(e.path, finite)) return;
    }
    if (clip_ >= 0) clip();
    opt_->begin_step();
    for (Entry& e : entries_) opt_->apply(e.path, e.param, *e.grad);
  }

  // nn::clip_grad_norm's arithmetic (optim/clip.hpp) on the tape's buffers, in place.
  void clip() {
    double sq = 0;
    for (const Entry& e : entries_) sq += B::sum_squares(*e.grad);
    grad_norm_ = std::sqrt(sq);
    const double scale = detail::clip_scale(clip_, grad_norm_);
    for (Entry& e : entries_) B::unary(Unary::scale, scale, *e.grad, *e.grad);
  }

  M* model_;
  Optimizer* opt_;
  F fn_;
  GTape<B> tp_;
  detail::TapeReplayer<B> replayer_;
  std::array<GVar, N> inputs_{};
  GVar loss_{};
  std::vector<Entry> entries_;
  std::vector<GradBuffer> slots_;                             // entries_' paths and buffers, for reduce_
  std::function<void(std::span<const GradBuffer>)> reduce_;  // between backward and the update
  std::uint64_t structure_ = 0, hyper_ = 0;
  double clip_ = -1, grad_norm_ = 0;
  bool recorded_ = false, plan_ = true, fuse_ = detail::env_flag("NN_FUSION");
  FusionStats fusion_;
  int recordings_ = 0;
};

/// Compiles a training step over `model` and `opt`: loss_fn(GTape<B>&, const M&, GVar... batch)
/// returns the scalar loss; the result is called as step(batch_tensor...) and returns the loss.
///   auto step = nn::compile<2>(model, opt, [](auto& tp, const Mlp& m, GVar x, GVar y) {
///     return nn::cross_entropy(tp, m(tp, x), y); });
///   Tensor loss = step(xb, yb);
template <std::size_t N, class B = cpu, class M, class F>
CompiledStep<B, M, F, N> compile(M& model, Optimizer& opt, F loss_fn) {
  return CompiledStep<B, M, F, N>(model, opt, std::move(loss_fn));
}

}  // namespace nn
