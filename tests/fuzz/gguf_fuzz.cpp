// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for the GGUF reader (nn/lm/gguf.hpp): any bytes either open or raise a
// "[gguf] <fuzz>: ..." nn::Error (no other exception, no out-of-bounds read: ASan). A file that
// opens has every tensor inside the data section, dequantises each tensor of a readable type to
// its element count (float32 and float64 agree), repacks each quantized matrix, and hands its
// tokenizer metadata out or refuses it with a "[gguf] <fuzz>: " nn::Error.
// Built and run by tests/fuzz/run.sh gguf; replayed by CTest (fuzz_replay).
#include <nn/lm/gguf.hpp>

#include <cmath>
#include <optional>

#include "fuzz_common.hpp"

namespace {
constexpr const char* kName = "gguf_fuzz";
}

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::optional<nn::lm::GgufFile> f;
  try {
    f.emplace(nn::lm::GgufFile::from_bytes(nn_fuzz::as_bytes(data, size), nn_fuzz::kLabel));
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[gguf] <fuzz>: "});
    return 0;
  }
  // A file may end before its data section's alignment padding when no tensor has bytes.
  const std::uint64_t data_bytes = f->data_offset() <= size ? size - f->data_offset() : 0;
  for (const auto& t : f->tensors()) {
    if (t.offset > data_bytes || t.nbytes > data_bytes - t.offset) nn_fuzz::broken(kName, "a tensor outside the data section");
    if (f->tensor_bytes(t).size() != t.nbytes) nn_fuzz::broken(kName, "tensor_bytes size");
    if (f->find_tensor(t.name) == nullptr) nn_fuzz::broken(kName, "a listed tensor is not found by name");
    try {
      nn::Tensor a = f->tensor(t, nn::DType::f32);
      if (a.numel() != t.numel()) nn_fuzz::broken(kName, "dequantised element count");
      nn::Tensor b = f->tensor(t, nn::DType::f64);
      const float* pa = a.data<float>();
      const double* pb = b.data<double>();
      for (std::int64_t i = 0; i < a.numel(); ++i)  // the same value, or both NaN
        if (!(static_cast<double>(pa[i]) == static_cast<double>(static_cast<float>(pb[i])) ||
              (std::isnan(pa[i]) && std::isnan(pb[i]))))
          nn_fuzz::broken(kName, "float32 and float64 dequantisation disagree");
    } catch (const nn::Error& e) {
      nn_fuzz::expect_prefix(e, kName, {"[gguf] <fuzz>: "});
    }
    if (nn::lm::GgufFile::keeps_quantized(t.type) && t.ne.size() == 2) {
      try {
        nn::QuantizedMatrix m = f->quantized(t);
        if (m.scales.numel() * m.q.group != t.numel()) nn_fuzz::broken(kName, "quantized group count");
      } catch (const nn::Error& e) {
        nn_fuzz::expect_prefix(e, kName, {"[gguf] <fuzz>: "});
      }
    }
  }
  try {
    (void)f->tokenizer();
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[gguf] <fuzz>: "});
  }
  return 0;
}
