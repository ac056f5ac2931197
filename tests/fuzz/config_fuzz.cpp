// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for config.json (nn/lm/config.hpp: the strict JSON reader, then
// config_from_json and its validation): any bytes either give a ModelConfig or raise a
// "[config] <fuzz>: ..." nn::Error. A config that is accepted passes validate() again, has
// positive sizes, and its derived sizes (q_dim, kv_dim) and RoPE table compute without signed
// overflow (UBSan) to head_dim / 2 finite positive frequencies.
// Built and run by tests/fuzz/run.sh config; replayed by CTest (fuzz_replay).
#include <nn/lm/config.hpp>
#include <nn/lm/json.hpp>

#include <cmath>
#include <optional>

#include "fuzz_common.hpp"

namespace {
constexpr const char* kName = "config_fuzz";
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<nn::lm::ModelConfig> c;
  try {
    c.emplace(nn::lm::config_from_json(
        nn::lm::detail::parse_json_strict(nn_fuzz::as_text(data, size), "config", nn_fuzz::kLabel), nn_fuzz::kLabel));
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[config] <fuzz>: "});
    return 0;
  }
  try {
    c->validate(nn_fuzz::kLabel);
  } catch (const nn::Error& e) {
    nn_fuzz::broken(kName, std::string("an accepted config fails validate(): ") + e.what());
  }
  if (c->q_dim() <= 0 || c->kv_dim() <= 0 || c->kv_dim() > c->q_dim()) nn_fuzz::broken(kName, "q_dim / kv_dim");
  if (c->head_dim <= (1 << 16)) {  // a table of head_dim / 2 doubles
    const std::vector<double> f = c->inv_freq();
    if (static_cast<std::int64_t>(f.size()) != c->head_dim / 2) nn_fuzz::broken(kName, "inv_freq size");
    for (double x : f)
      if (!std::isfinite(x) || x < 0) nn_fuzz::broken(kName, "a RoPE frequency that is not finite and non-negative");
  }
  return 0;
}
