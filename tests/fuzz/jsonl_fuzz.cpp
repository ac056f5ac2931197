// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for JSONL datasets (nn/lm/data.hpp: read_jsonl, which load_jsonl runs on the
// opened file): any bytes either give examples or raise a "[data] <fuzz>..." nn::Error. The
// tokenizer is a byte encoder (one id per byte, EOS = 256), so what is checked is the record
// reader: every example has tokens, a {"text"} record ends with EOS, and the loss offset lies
// inside the tokens (it counts a prefix of them); the batcher takes every example.
// Built and run by tests/fuzz/run.sh jsonl; replayed by CTest (fuzz_replay).
#include <nn/lm/data.hpp>

#include <numeric>
#include <sstream>

#include "fuzz_common.hpp"

namespace {

constexpr const char* kName = "jsonl_fuzz";

struct ByteEncoder {
  std::vector<std::int32_t> encode(const std::string& s, bool) const {
    std::vector<std::int32_t> out;
    for (char c : s) out.push_back(static_cast<unsigned char>(c));
    return out;
  }
  std::int32_t eos_id() const { return 256; }
};

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::istringstream in{std::string(nn_fuzz::as_text(data, size))};
  nn::lm::DataOptions opt;
  opt.mask_prompt = size % 2 == 0;
  if (size % 3 == 0) opt.chat.default_system = "sys";
  std::vector<nn::lm::Example> ex;
  try {
    ex = nn::lm::read_jsonl(in, nn_fuzz::kLabel, ByteEncoder{}, opt);
  } catch (const nn::Error& e) {
    nn_fuzz::expect_prefix(e, kName, {"[data] <fuzz>:"});
    return 0;
  }
  if (ex.empty()) nn_fuzz::broken(kName, "no examples and no error");
  for (const auto& e : ex) {
    if (e.tokens.empty()) nn_fuzz::broken(kName, "an example without tokens");
    if (e.offset > e.tokens.size()) nn_fuzz::broken(kName, "a loss offset past the example's tokens");
    for (const auto& [b, end] : e.learn)
      if (b > end || end > e.tokens.size()) nn_fuzz::broken(kName, "a learned turn outside the example's tokens");
  }
  std::vector<std::size_t> rows(std::min<std::size_t>(ex.size(), 8));
  std::iota(rows.begin(), rows.end(), std::size_t{0});
  (void)nn::lm::make_batch(ex, rows, 64);
  return 0;
}
