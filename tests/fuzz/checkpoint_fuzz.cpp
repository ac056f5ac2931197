// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for whole-run checkpoints (nn/io/checkpoint.hpp: load_into on a
// SafetensorsFile::from_bytes image, the same code the path overload runs): the model is a tiny
// LoRA run (a LoraLinear, a frozen Linear head) and the optimizer is of the type the file's
// "optimizer.type" names (Sgd, Adam, AdamW, Lion, Adafactor; AdamW otherwise), with and without
// allow_new_hyperparameters. Any bytes either load or raise an nn::Error that names the input
// ("<fuzz>"), and a refused load leaves the model's parameters, the optimizer's state and step and
// the global random key as they were (load_into's all-or-nothing promise).
// Built and run by tests/fuzz/run.sh checkpoint; replayed by CTest (fuzz_replay). Built with
// -DNN_FUZZ_WRITE_SEEDS it is instead a program writing one checkpoint per optimizer into argv[1].
#include <nn/nn.hpp>

#include <filesystem>
#include <memory>
#include <optional>

#include "fuzz_common.hpp"

namespace {

constexpr const char* kName = "checkpoint_fuzz";

struct Run {
  nn::LoraLinear q;
  nn::Linear head;
  template <class B>
  nn::GVar operator()(nn::GTape<B>& tp, nn::GVar x) const {
    return head(tp, q(tp, x));
  }
  NN_MODULE(Run, q, head)
};

Run make_run() {
  nn::random::seed(5);
  nn::Linear base(4, 4);
  Run m{nn::LoraLinear::from_base(base, 2), nn::Linear(4, 2)};
  m.head.freeze();
  return m;
}

std::unique_ptr<nn::Optimizer> make_optimizer(std::string_view type) {
  if (type == "Sgd") return std::make_unique<nn::Sgd<>>(0.1);
  if (type == "Adam") return std::make_unique<nn::Adam<>>(1e-2);
  if (type == "Lion") return std::make_unique<nn::Lion<>>(1e-3);
  if (type == "Adafactor") return std::make_unique<nn::Adafactor<>>();
  return std::make_unique<nn::AdamW<>>(nn::cosine_decay(1e-2, 6));
}

std::vector<std::vector<double>> values(const nn::NamedTensors& ts) {
  std::vector<std::vector<double>> out;
  for (const auto& [n, t] : ts) out.push_back(t.defined() ? t.to_doubles() : std::vector<double>{});
  return out;
}

}  // namespace

#ifndef NN_FUZZ_WRITE_SEEDS
extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<nn::SafetensorsFile> file;
  try {
    file.emplace(nn::SafetensorsFile::from_bytes(nn_fuzz::as_bytes(data, size), nn_fuzz::kLabel));
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[safetensors] <fuzz>: "});
    return 0;
  }
  Run model = make_run();
  auto type = file->metadata().find("optimizer.type");
  auto opt = make_optimizer(type == file->metadata().end() ? "" : type->second);
  const auto params = values(model.parameters());
  const auto state = values(opt->state());
  const std::int64_t step = opt->step();
  const std::vector<double> key = nn::random::state().to_doubles();
  try {
    nn::load_into(*file, model, *opt, nn::LoadOptions{.allow_new_hyperparameters = size % 2 == 1});
  } catch (const nn::Error& e) {
    nn_fuzz::expect_mention(e, kName);
    if (values(model.parameters()) != params || values(opt->state()) != state || opt->step() != step ||
        nn::random::state().to_doubles() != key)
      nn_fuzz::broken(kName, std::string("a refused load changed the run: ") + e.what());
  }
  return 0;
}
#else
int main(int argc, char** argv) {  // the seeds: a checkpoint of each optimizer after two steps
  if (argc != 2) return 2;
  for (const char* type : {"Sgd", "Adam", "AdamW", "Lion", "Adafactor"}) {
    Run m = make_run();
    auto opt = make_optimizer(type);
    for (int i = 0; i < 2; ++i) {
      nn::Tensor x = nn::Tensor::from_doubles({3, 4}, {1, -2, 3, 0.5, 0, 1, -1, 2, 0.25, 4, -3, 1}, nn::DType::f32);
      auto [loss, grads] = nn::value_and_grad(m, [&](nn::GTape<nn::cpu>& tp, const Run& n) {
        nn::GVar y = n(tp, tp.constant(x));
        return nn::mean(tp, nn::mul(tp, y, y));
      });
      opt->update(m, grads);
    }
    nn::save(std::filesystem::path(argv[1]) / (std::string("checkpoint_") + type + ".safetensors"), m, *opt);
  }
  return 0;
}
#endif
