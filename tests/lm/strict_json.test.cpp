// SPDX-License-Identifier: MIT OR Apache-2.0
// The kit's JSON loaders refuse a NUL byte or trailing text after the document (which
// nlohmann::json alone would drop silently), naming the file, the line and the offset.
#include <doctest/doctest.h>

#include "support/check.hpp"

#include <nn/lm.hpp>

namespace lm_strict_json {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using namespace nn::lm;

namespace {
const std::string kStrict = std::string(NN_FIXTURES_DIR) + "/lm/strict";

struct ByteEncoder {  // any TextEncoder will do: the records fail before encoding
  std::vector<std::int32_t> encode(const std::string& s, bool = false) const { return std::vector<std::int32_t>(s.size(), 0); }
  std::int32_t eos_id() const { return 0; }
};
}  // namespace

TEST_CASE("strict JSON: a NUL byte or trailing text is refused by every loader, naming the file and offset") {
  test::check_error([] { load_config(kStrict + "/config_nul.json"); },
                    {"[config]", "config_nul.json", "a NUL byte at offset"});
  test::check_error([] { load_config(kStrict + "/config_trailing.json"); },
                    {"[config]", "config_trailing.json", "not valid JSON", "line 2"});
  test::check_error([] { Tokenizer::from_file(kStrict + "/tokenizer_nul.json"); },
                    {"[tokenizer]", "tokenizer_nul.json", "a NUL byte at offset 53"});
  test::check_error([] { lm::detail::read_json_file(kStrict + "/tokenizer_config_trailing.json", "tokenizer"); },
                    {"tokenizer_config_trailing.json", "not valid JSON"});
  test::check_error([] { load_jsonl(kStrict + "/data_nul.jsonl", ByteEncoder{}); },
                    {"[data]", "data_nul.jsonl:1", "a NUL byte at offset 12"});
  test::check_error([] { load_jsonl(kStrict + "/data_trailing.jsonl", ByteEncoder{}); },
                    {"[data]", "data_trailing.jsonl:1", "not valid JSON"});
  // The valid prefix alone parses: the refusal is about what follows it.
  CHECK(lm::detail::parse_json_strict("{\"a\": 1}  \n", "t", "x")["a"] == 1);
}

}  // namespace lm_strict_json
