// SPDX-License-Identifier: MIT OR Apache-2.0
// A compiled training step (MLX's mx.compile(step, inputs=state, outputs=state)): the first call
// records forward, backward and the optimizer update; later calls replay the same tape into the
// buffers it owns, with no re-recording and no heap allocation.
#pragma once

#include <array>
#include <cstdint>
#include <string>
#include <type_traits>
#include <utility>
#include <vector>

#include "module.hpp"
#include "optim/optimizer.hpp"

namespace nn {

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
/// It re-records, once, when an input's shape or dtype changes, when a module's train/eval mode
/// changes, when a parameter is frozen or unfrozen, when the optimizer's non-tensor
/// hyperparameters change (betas, momentum, ...), or after reset(). The learning rate and step
/// count are tensors and change without re-recording. Random keys drawn on the tape
/// (tp.random_key(), used by Dropout) are refilled from nn::random's global sequence before each
/// replay, in recording order, so a compiled run draws exactly the masks an eager run draws.
/// The model must keep its structure (no map_modules, no reassigned Param tensors) between
/// calls without a reset().
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

  /// How many times the step has been recorded (1 after the first call when nothing changed).
  int recordings() const { return recordings_; }
  /// Forces the next call to record again.
  void reset() { recorded_ = false; }
  /// The tape (for inspection: node count, values).
  const GTape<B>& tape() const { return tp_; }

 private:
  struct Entry {
    std::string path;
    Param* param;
    const Tensor* grad;  // the tape's gradient buffer of this parameter
  };

  bool stale(const std::array<const Tensor*, N>& in) const {
    if (!recorded_) return true;
    for (std::size_t i = 0; i < N; ++i) {
      const Tensor& t = tp_.value(inputs_[i]);
      if (!(in[i]->shape() == t.shape()) || in[i]->dtype() != t.dtype()) return true;
    }
    for (const auto& [flag, value] : modes_)
      if (*flag != value) return true;
    for (const auto& [p, trainable] : params_seen_)
      if (p->trainable != trainable) return true;
    return opt_->hyper_hash() != hyper_;
  }

  void record(const std::array<const Tensor*, N>& in) {
    tp_.clear();
    entries_.clear();
    modes_.clear();
    params_seen_.clear();
    std::array<GVar, N> vars{};
    for (std::size_t i = 0; i < N; ++i) vars[i] = tp_.input(*in[i]);
    for (std::size_t i = 0; i < N; ++i) inputs_[i] = vars[i];
    if constexpr (kFits)  // else only the static_assert above speaks
      loss_ = std::apply([&](auto... v) { return fn_(tp_, static_cast<const M&>(*model_), v...); }, vars);
    tp_.backward(loss_);
    detail::for_each(
        *model_,
        [&](const std::string& path, Param& p) {
          params_seen_.emplace_back(&p, p.trainable);
          if (!p.trainable || !is_floating(p.value.dtype())) return;
          std::optional<GVar> v = tp_.find_param(p.value);
          if (!v) detail::fail("compile", "trainable parameter '", path, "' is not used by the loss");
          opt_->init_param(path, p.value);
          entries_.push_back({path, &p, &tp_.grad(*v)});
        },
        detail::ignore, [&](const std::string&, auto& mod) { modes_.emplace_back(&mod.nn_training_, mod.nn_training_); });
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
    opt_->begin_step();
    for (Entry& e : entries_) opt_->apply(e.path, e.param->value, *e.grad);
  }

  M* model_;
  Optimizer* opt_;
  F fn_;
  GTape<B> tp_;
  detail::TapeReplayer<B> replayer_;
  std::array<GVar, N> inputs_{};
  GVar loss_{};
  std::vector<Entry> entries_;
  std::vector<std::pair<const bool*, bool>> modes_;
  std::vector<std::pair<const Param*, bool>> params_seen_;
  std::uint64_t hyper_ = 0;
  bool recorded_ = false;
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
