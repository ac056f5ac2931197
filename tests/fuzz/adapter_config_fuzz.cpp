// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for adapter_config.json (nn/lm/adapters.hpp): the same bytes are read as an
// mlx-lm config (mlx_adapter_config_from_json) and as a PEFT config
// (peft_adapter_config_from_json), after the strict JSON reader. Each either gives a LoraConfig
// or raises an "[adapters] <fuzz>: ..." nn::Error (nlohmann's type errors must not escape). A
// config that is accepted has rank >= 1, a finite scale, dropout in [0, 1) and num_layers >= -1.
// Built and run by tests/fuzz/run.sh adapter_config; replayed by CTest (fuzz_replay).
#include <nn/nn.hpp>  // adapters.hpp needs the CPU backend declared first
#include <nn/lm/adapters.hpp>

#include <cmath>

#include "fuzz_common.hpp"

namespace {

constexpr const char* kName = "adapter_config_fuzz";

void check(const nn::lm::LoraConfig& c) {
  if (c.rank < 1 || !std::isfinite(c.scale) || !(c.dropout >= 0 && c.dropout < 1) || c.num_layers < -1)
    nn_fuzz::broken(kName, "an accepted adapter config with a rank, scale, dropout or num_layers out of range");
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  nlohmann::json j;
  try {
    j = nn::lm::detail::parse_json_strict(nn_fuzz::as_text(data, size), "adapters", nn_fuzz::kLabel);
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[adapters] <fuzz>: "});
    return 0;
  }
  try {
    check(nn::lm::mlx_adapter_config_from_json(j, nn_fuzz::kLabel));
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[adapters] <fuzz>: "});
  }
  try {
    check(nn::lm::peft_adapter_config_from_json(j, nn_fuzz::kLabel));
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[adapters] <fuzz>: "});
  }
  return 0;
}
