// SPDX-License-Identifier: MIT OR Apache-2.0
// What a finetune run does with the model's tensors, written once over the backend B: the
// optimizer, the compiled training step (padded or packed rows), the eager micro-batch
// gradients of --grad-accumulation-steps, a batch's summed loss for evaluation, and a resume
// from a checkpoint. main.cpp drives a Trainer and names the backend once: --device cpu makes a
// TrainerOn<cpu>; --device cuda a TrainerOn<cuda>, made by cuda_trainer.cu, the one translation
// unit nvcc compiles (the finetune_cuda target), so the program's other code (CLI, data, saving,
// generation) stays host C++ and the two devices run the same lines.
//
// On a device the model's tensors and the optimizer's slots live there from construction until
// to_host(); the batches are copied in per step. Saving during training reads the device
// tensors through nn's savers (they copy to the host); evaluation runs on the device.
#pragma once

#include "options.hpp"

#include <nn/distributed.hpp>
#include <nn/lm/data.hpp>

#include <memory>
#include <optional>
#include <string>
#include <type_traits>

namespace finetune {

class Trainer {
 public:
  virtual ~Trainer() = default;
  /// "cpu" or "cuda"
  virtual const char* device() const = 0;
  virtual nn::Optimizer& optimizer() = 0;
  /// Data-parallel runs: the compiled steps average their gradients through `avg` (held by
  /// reference: it must outlive the trainer).
  virtual void reduce_gradients(nn::distributed::GradientAverager& avg) = 0;
  /// One update from one batch (the compiled step); returns this rank's mean loss.
  virtual double step(const nn::lm::PackedBatch& pb, bool packed) = 0;
  /// --grad-accumulation-steps: this micro-batch's gradient (eager), averaged over the ranks
  /// when `avg` is given, added to the running sum; returns its mean loss.
  virtual double accumulate(const nn::lm::PackedBatch& pb, bool packed, nn::distributed::GradientAverager* avg) = 0;
  /// The sum's mean over n micro-batches applied as one update; the sum cleared.
  virtual void apply_accumulated(int n) = 0;
  /// The summed next-token loss of one batch, no gradient (evaluation).
  virtual double loss_sum(const nn::lm::Batch& b) = 0;
  /// load_into(checkpoint, model, optimizer) with the optimizer's slots placed on the device.
  virtual void resume(const std::filesystem::path& ckpt, const nn::LoadOptions& options) = 0;
  /// The model back on the host (after training: the savers, generation and exports run there).
  virtual void to_host() = 0;
  /// The model on the trainer's device again (after a mid-run save).
  virtual void to_device() = 0;
  /// Whether the model is on a device now (a device trainer's, until to_host()).
  virtual bool on_device() const = 0;
};

/// The model on the host for the scope (a mid-run save), back on the device after it.
class OnHost {
 public:
  explicit OnHost(Trainer& t) : t_(t.on_device() ? &t : nullptr) {
    if (t_) t_->to_host();
  }
  ~OnHost() {
    if (t_) t_->to_device();
  }
  OnHost(const OnHost&) = delete;
  OnHost& operator=(const OnHost&) = delete;

 private:
  Trainer* t_;
};

/// The summed next-token loss of one batch on GTape<B>, recorded with its kernels deferred and
/// planned forward-only on the CPU: the tape holds a layer's transients and a block of the
/// vocabulary's logits (CausalLM::loss), not every intermediate (GTape::plan_memory). (Other backends record it plainly.)
template <class B>
double batch_loss_sum(const nn::lm::CausalLM& m, const nn::lm::Batch& bt) {
  using nn::detail::on_backend;
  nn::GTape<B> tp;
  auto build = [&] {
    return m.loss(tp, tp.constant(on_backend<B>(bt.inputs)), tp.constant(on_backend<B>(bt.targets)),
                  tp.constant(on_backend<B>(bt.mask)), nn::Reduction::sum);
  };
  nn::GVar loss;
  if constexpr (B::device == nn::Device::cpu) loss = tp.record_planned(build, false);
  else loss = build();
  const nn::Tensor v = tp.value(loss);
  return (v.device() == nn::Device::cpu ? v : v.to(nn::Device::cpu)).item();
}

template <class B>
class TrainerOn final : public Trainer {
 public:
  using CausalLM = nn::lm::CausalLM;
  // The model moves to B's device first, so the optimizer's slots are made there.
  TrainerOn(const Options& a, CausalLM& model) : model_(model), opt_(make_optimizer<B>(a)) {
    if (on_device_) model_.to(B::device);
    opt_->init(model_);
  }

  const char* device() const override { return B::device == nn::Device::cpu ? "cpu" : "cuda"; }
  nn::Optimizer& optimizer() override { return *opt_; }
  void reduce_gradients(nn::distributed::GradientAverager& avg) override {
    step_.reduce_gradients(avg);
    packed_step_.reduce_gradients(avg);
  }

  double step(const nn::lm::PackedBatch& pb, bool packed) override {
    const nn::lm::Batch& b = pb.batch;
    const nn::Tensor l = packed ? packed_step_(in(b.inputs), in(b.targets), in(b.mask), in(pb.starts), in(pb.positions))
                                : step_(in(b.inputs), in(b.targets), in(b.mask));
    return host(l).item();
  }

  double accumulate(const nn::lm::PackedBatch& pb, bool packed, nn::distributed::GradientAverager* avg) override {
    const nn::lm::Batch& b = pb.batch;
    const nn::Tensor ids = in(b.inputs), targets = in(b.targets), mask = in(b.mask);
    auto [l, g] = nn::value_and_grad<B>(model_, [&](nn::GTape<B>& tp, const CausalLM& m) {
      if (packed)
        return packed_loss(tp, m, tp.constant(ids), tp.constant(targets), tp.constant(mask), tp.constant(in(pb.starts)),
                           tp.constant(in(pb.positions)));
      return loss(tp, m, tp.constant(ids), tp.constant(targets), tp.constant(mask));
    });
    if (avg) avg->average(g);
    if (!sum_) sum_ = std::move(g);
    else nn::tree_add<B>(*sum_, g);
    return host(l).item();
  }

  void apply_accumulated(int n) override {
    if (!sum_) nn::detail::fail("finetune", "no accumulated gradient to apply");
    nn::tree_scale<B>(*sum_, 1.0 / n);
    opt_->update(model_, *sum_);
    sum_.reset();
  }

  double loss_sum(const nn::lm::Batch& b) override { return batch_loss_sum<B>(model_, b); }

  void resume(const std::filesystem::path& ckpt, const nn::LoadOptions& options) override {
    nn::load_into(ckpt, model_, *opt_, options);
    if constexpr (B::device != nn::Device::cpu) {  // the checkpoint's slots arrive on the host
      auto st = opt_->state();
      for (auto& [name, t] : st)
        if (name.starts_with("slots.") && t.device() != B::device) t = t.to(B::device);
      opt_->load_state(st);
    }
  }

  void to_host() override {
    if (on_device_) model_.to(nn::Device::cpu);
    on_device_ = false;
  }
  void to_device() override {
    if (B::device != nn::Device::cpu && !on_device_) model_.to(B::device);
    on_device_ = B::device != nn::Device::cpu;
  }
  bool on_device() const override { return on_device_; }

 private:
  static nn::Tensor in(const nn::Tensor& t) { return t.defined() ? nn::detail::on_backend<B>(t) : t; }
  static nn::Tensor host(const nn::Tensor& t) { return t.device() == nn::Device::cpu ? t : t.to(nn::Device::cpu); }
  static nn::GVar loss(nn::GTape<B>& tp, const CausalLM& m, nn::GVar ids, nn::GVar targets, nn::GVar mask) {
    return m.loss(tp, ids, targets, mask, nn::Reduction::mean);
  }
  static nn::GVar packed_loss(nn::GTape<B>& tp, const CausalLM& m, nn::GVar ids, nn::GVar targets, nn::GVar mask,
                              nn::GVar starts, nn::GVar positions) {
    return m.loss(tp, ids, nn::lm::Packing{starts, positions}, targets, mask, nn::Reduction::mean);
  }
  using LossFn = nn::GVar (*)(nn::GTape<B>&, const CausalLM&, nn::GVar, nn::GVar, nn::GVar);
  using PackedLossFn = nn::GVar (*)(nn::GTape<B>&, const CausalLM&, nn::GVar, nn::GVar, nn::GVar, nn::GVar, nn::GVar);

  CausalLM& model_;
  std::unique_ptr<nn::Optimizer> opt_;
  nn::CompiledStep<B, CausalLM, LossFn, 3> step_ = nn::compile<3, B>(model_, *opt_, static_cast<LossFn>(&loss));
  // records on its first call only
  nn::CompiledStep<B, CausalLM, PackedLossFn, 5> packed_step_ =
      nn::compile<5, B>(model_, *opt_, static_cast<PackedLossFn>(&packed_loss));
  std::optional<CausalLM> sum_;  // --grad-accumulation-steps: the gradients so far
  bool on_device_ = B::device != nn::Device::cpu;
};

/// cpu_trainer.cpp: a TrainerOn<nn::cpu>. Its own translation unit, so the compiled step's code
/// (the heaviest of the program) compiles beside main.cpp on another core.
std::unique_ptr<Trainer> make_cpu_trainer(const Options& a, nn::lm::CausalLM& model);
/// cpu_trainer.cpp: batch_loss_sum<nn::cpu> (evaluation on the host, outside a trainer).
double host_loss_sum(const nn::lm::CausalLM& m, const nn::lm::Batch& bt);

/// cuda_trainer.cu (finetune_cuda): a TrainerOn<nn::cuda>, or an nn::Error when no CUDA device
/// is present; no_cuda.cpp (finetune): an nn::Error saying the program was built without CUDA.
std::unique_ptr<Trainer> make_cuda_trainer(const Options& a, nn::lm::CausalLM& model);

}  // namespace finetune
