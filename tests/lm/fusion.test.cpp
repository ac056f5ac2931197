// SPDX-License-Identifier: MIT OR Apache-2.0
// Elementwise fusion (ops/fused.hpp) on whole decoders: a compiled LoRA or DoRA step with fusion
// on, beside the eager step, 3 AdamW steps on the Llama-style and Qwen2 fixture models: losses
// and weights equal bit for bit (the unfused compiled step is held to the same in the models'
// own tests). DoRA's magnitude and norm arithmetic and LoRA's scale-and-add are the chains.
#include <doctest/doctest.h>

#include "support/lm_step.hpp"

namespace lm_fusion {  // one unity source with the other lm files: its names stay its own

using namespace nn;

namespace {
const std::string kModels = std::string(NN_FIXTURES_DIR) + "/lm/models";
}

TEST_CASE("fusion: a fused compiled LoRA / DoRA step equals the eager one bit for bit (llama, qwen2)") {
  for (const char* model : {"llama", "qwen2"})
    for (bool dora : {false, true}) {
      const std::string name = model;
      CAPTURE(name);
      CAPTURE(dora);
      const FusionStats st = test::check_adapter_step_compiled_equals_eager(kModels + "/" + model, dora, true);
      // DoRA's norm arithmetic always makes chains; Qwen2's q/v biases meet LoRA's sum in one
      if (dora || std::string(model) == "qwen2") CHECK(st.groups > 0);
    }
}

}  // namespace lm_fusion
