// SPDX-License-Identifier: MIT OR Apache-2.0
// Model weights by name: save/load round trips, strict loading that reports every problem at
// once and leaves the model unchanged, partial loading, adapters, checkpoints' all-or-nothing.
#include "support/check.hpp"

#include <filesystem>

namespace io_weights {  // one unity source with the other io files: its names stay its own

using namespace nn;

namespace {

struct Net {
  Linear l1, l2;
  Buffer stats;
  NN_MODULE(Net, l1, l2, stats)
};

struct Bigger {
  Linear l1, l2, l3;
  Buffer stats;
  NN_MODULE(Bigger, l1, l2, l3, stats)
};

struct Adapted {
  LoraLinear q;
  NN_MODULE(Adapted, q)
};

Net make(std::uint64_t seed) {
  random::seed(seed);
  return Net{Linear(4, 6), Linear(6, 3), Buffer(random::normal({5}))};
}

std::filesystem::path tmp(const std::string& name) {
  auto dir = std::filesystem::temp_directory_path() / "nn_weights_test";
  std::filesystem::create_directories(dir);
  return dir / name;
}

/// Every tensor's bytes, to prove a failed load changed nothing.
std::vector<std::vector<double>> snapshot(const Net& n) {
  std::vector<std::vector<double>> out;
  for (auto& [p, t] : n.parameters()) out.push_back(t.to_doubles());
  return out;
}

}  // namespace

TEST_CASE("save_weights then load_weights restores every tensor, in place") {
  Net a = make(1), b = make(2);
  a.save_weights(tmp("a.safetensors"));
  const float* before = b.l1.weight.value.data<float>();
  b.load_weights(tmp("a.safetensors"));
  CHECK(snapshot(a) == snapshot(b));
  CHECK(b.l1.weight.value.data<float>() == before);  // same storage: bound tapes stay valid
  SafetensorsFile f(tmp("a.safetensors"));
  CHECK(f.names() == std::vector<std::string>{"l1.weight", "l1.bias", "l2.weight", "l2.bias", "stats"});
  CHECK(f.metadata().at("format") == "mlx");
}

TEST_CASE("strict load_weights reports every missing, unknown and mismatched name, and changes nothing") {
  Net a = make(1);
  NamedTensors named;
  for (auto& [p, t] : a.parameters()) named.emplace_back(p, t);
  named.erase(named.begin() + 1);                                   // l1.bias missing
  named.emplace_back("l3.weight", Tensor::zeros({2, 2}));           // unknown
  named[0].second = Tensor::zeros({6, 5});                          // l1.weight: shape
  named[1].second = Tensor::zeros({3, 6}, DType::f64);              // l2.weight: dtype
  Net b = make(2);
  auto before = snapshot(b);
  test::check_error([&] { b.load_weights(named); },
                    {"[load_weights]", "nothing was loaded", "1 missing: l1.bias", "1 unknown: l3.weight",
                     "l1.weight (file (6, 5) float32, model (6, 4) float32)",
                     "l2.weight (file (3, 6) float64, model (3, 6) float32)"});
  CHECK(snapshot(b) == before);
}

TEST_CASE("a failed load from a file names the file and leaves the model unchanged") {
  Net a = make(1);
  a.save_weights(tmp("ok.safetensors"));
  random::seed(3);
  Bigger b{Linear(4, 6), Linear(6, 3), Linear(3, 2), Buffer(Tensor::zeros({5}))};
  std::vector<std::vector<double>> before;
  for (auto& [p, t] : b.parameters()) before.push_back(t.to_doubles());
  test::check_error([&] { b.load_weights(tmp("ok.safetensors")); }, {"ok.safetensors", "2 missing: l3.weight, l3.bias"});
  std::vector<std::vector<double>> after;
  for (auto& [p, t] : b.parameters()) after.push_back(t.to_doubles());
  CHECK(after == before);
  b.load_weights_partial(tmp("ok.safetensors"));  // l3 keeps its values
  CHECK(b.l1.weight.value.to_doubles() == a.l1.weight.value.to_doubles());
  CHECK(b.l3.weight.value.to_doubles() == before[4]);
}

TEST_CASE("save_trainable writes only the adapters") {
  random::seed(0);
  Adapted m{LoraLinear::from_base(Linear(8, 8), 2)};
  m.save_trainable(tmp("adapter.safetensors"));
  CHECK(SafetensorsFile(tmp("adapter.safetensors")).names() == std::vector<std::string>{"q.lora_a", "q.lora_b"});
}

TEST_CASE("load_into checks the whole checkpoint first: a bad optimizer entry changes nothing") {
  Net a = make(1);
  Adam opt(1e-3);
  opt.init(a);
  save(tmp("run.safetensors"), a, opt);
  Net b = make(2);
  auto before = snapshot(b);
  Adam other(1e-3);  // fresh: no slots yet
  Tensor key_before = random::state();
  NamedTensors bad = load_safetensors(tmp("run.safetensors"));
  bad.emplace_back("optimizer.bogus", Tensor::zeros({1}));
  save_safetensors(tmp("bad.safetensors"), bad, SafetensorsFile(tmp("run.safetensors")).metadata());
  test::check_error([&] { load_into(tmp("bad.safetensors"), b, other); }, {"[optimizer]", "bogus"});
  CHECK(snapshot(b) == before);
  CHECK(random::state().to_doubles() == key_before.to_doubles());
  test::check_error([&] { load_into(tmp("a_missing.safetensors"), b, other); }, {"a_missing.safetensors"});
}

}  // namespace io_weights
