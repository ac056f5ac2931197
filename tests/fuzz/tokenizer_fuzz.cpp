// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for the tokenizer loaders (nn/lm/tokenizer.hpp): the input is a tokenizer.json
// (Tokenizer::from_json after the strict JSON reader) or, when it starts with "GGUF", a GGUF file
// whose tokenizer.ggml.* metadata goes through Tokenizer::from_gguf_metadata; text after a
// "\x01TEXT\x01" marker is what gets encoded (else the input's first 512 bytes). Either the
// tokenizer loads or an nn::Error naming the input ("<fuzz>") is raised. A tokenizer that loads
// encodes the text (with and without special tokens) to ids inside its vocabulary, decodes them
// without error to valid UTF-8, and refuses ids outside the vocabulary with an nn::Error.
// Built and run by tests/fuzz/run.sh tokenizer; replayed by CTest (fuzz_replay).
#include <nn/lm/gguf.hpp>
#include <nn/lm/json.hpp>
#include <nn/lm/tokenizer.hpp>

#include <optional>

#include "fuzz_common.hpp"

namespace {

constexpr const char* kName = "tokenizer_fuzz";

bool valid_utf8(std::string_view s) {
  for (std::size_t i = 0; i < s.size();) {
    const auto c = static_cast<unsigned char>(s[i]);
    const std::size_t n = c < 0x80 ? 1 : (c >> 5) == 6 ? 2 : (c >> 4) == 14 ? 3 : (c >> 3) == 30 ? 4 : 0;
    if (n == 0 || i + n > s.size()) return false;
    for (std::size_t k = 1; k < n; ++k)
      if ((static_cast<unsigned char>(s[i + k]) & 0xC0) != 0x80) return false;
    i += n;
  }
  return true;
}

nn::lm::Tokenizer load(std::string_view input) {
  if (input.starts_with("GGUF")) {
    const auto* p = reinterpret_cast<const std::byte*>(input.data());
    auto f = nn::lm::GgufFile::from_bytes(std::vector<std::byte>(p, p + input.size()), nn_fuzz::kLabel);
    return nn::lm::Tokenizer::from_gguf_metadata(f.tokenizer(), nn_fuzz::kLabel);
  }
  return nn::lm::Tokenizer::from_json(nn::lm::detail::parse_json_strict(input, "tokenizer", nn_fuzz::kLabel), nn_fuzz::kLabel);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view input = nn_fuzz::as_text(data, size), text = input.substr(0, 512);
  constexpr std::string_view kMarker = "\x01TEXT\x01";
  if (const std::size_t at = input.find(kMarker); at != std::string_view::npos) {
    text = input.substr(at + kMarker.size());
    input = input.substr(0, at);
  }
  std::optional<nn::lm::Tokenizer> tok;
  try {
    tok.emplace(load(input));
  } catch (const nn::Error& e) {
    nn_fuzz::expect_mention(e, kName);
    return 0;
  }
  const auto vocab = static_cast<std::int64_t>(tok->vocab_size());
  for (bool special : {false, true}) {
    nn::lm::EncodeOptions opt;
    opt.add_special_tokens = special;
    opt.parse_special = special;
    std::vector<std::int32_t> ids;
    try {
      ids = tok->encode(text, opt);
    } catch (const nn::Error& e) {  // e.g. a byte with no token and no unk_token
      nn_fuzz::expect_mention(e, kName);
      continue;
    }
    for (std::int32_t id : ids)
      if (id < 0 || id >= vocab) nn_fuzz::broken(kName, "encode gave an id outside the vocabulary");
    try {
      if (!valid_utf8(tok->decode(ids, special))) nn_fuzz::broken(kName, "decode gave invalid UTF-8");
    } catch (const nn::Error& e) {
      nn_fuzz::broken(kName, std::string("decode refused the ids encode gave: ") + e.what());
    }
  }
  // Ids from the text's bytes, some past the vocabulary: decoded, or refused naming the tokenizer.
  std::vector<std::int32_t> ids;
  for (std::size_t i = 0; i + 1 < text.size() && ids.size() < 64; i += 2)
    ids.push_back(static_cast<std::int32_t>((static_cast<unsigned char>(text[i]) << 8 | static_cast<unsigned char>(text[i + 1])) %
                                            (vocab + 2)) - (text[i] == '-' ? 1 : 0));
  try {
    if (!valid_utf8(tok->decode(ids))) nn_fuzz::broken(kName, "decode gave invalid UTF-8");
  } catch (const nn::Error& e) {
    nn_fuzz::expect_mention(e, kName);
  }
  return 0;
}
