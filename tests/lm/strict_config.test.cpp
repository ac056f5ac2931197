// SPDX-License-Identifier: MIT OR Apache-2.0
// Configs are validated before anything is allocated: sizes that are zero, negative, past
// ModelConfig's documented limits or inconsistent with the file's tensors are refused by name
// (the field or GGUF key, and the file), and no std::bad_alloc or std::length_error escapes.
#include <doctest/doctest.h>

#include "support/check.hpp"

#include <nn/lm.hpp>

#include <fstream>
#include <limits>
#include <new>
#include <stdexcept>

namespace lm_strict_config {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using namespace nn::lm;

namespace {
const std::string kStrict = std::string(NN_FIXTURES_DIR) + "/lm/strict";
const std::string kLlama = std::string(NN_FIXTURES_DIR) + "/lm/models/llama";
}  // namespace

TEST_CASE("strict config: the audit's config.json files are refused by field and file") {
  test::check_error([] { load_config(kStrict + "/config_layers_2e31.json"); },
                    {"[config]", "config_layers_2e31.json", "\"num_hidden_layers\" must be a positive integer at most 1024, got 2147483647"});
  test::check_error([] { load_config(kStrict + "/config_layers_2e62.json"); },
                    {"config_layers_2e62.json", "\"num_hidden_layers\"", "got 4611686018427387904"});
  test::check_error([] { load_config(kStrict + "/config_vocab_2e40.json"); },
                    {"config_vocab_2e40.json", "\"vocab_size\" must be a positive integer at most 16777216, got 1099511627776"});
  test::check_error([] { load_config(kStrict + "/config_positions_negative.json"); },
                    {"config_positions_negative.json", "\"max_position_embeddings\" must be a positive integer, got -1"});
  test::check_error([] { load_config(kStrict + "/config_too_many_parameters.json"); },
                    {"config_too_many_parameters.json", "parameters, more than the limit of 2^40"});
}

TEST_CASE("strict config: the audit's GGUF files are refused by key and file, before allocation") {
  test::check_error([] { load_gguf(kStrict + "/gguf_head_count_0.gguf"); },
                    {"gguf_head_count_0.gguf", "\"llama.attention.head_count\" must be a positive integer, got 0"});
  test::check_error([] { load_gguf(kStrict + "/gguf_embedding_2e40.gguf"); },
                    {"gguf_embedding_2e40.gguf", "\"llama.embedding_length\" must be a positive integer at most 1048576"});
  test::check_error([] { load_gguf(kStrict + "/gguf_block_count_2e62.gguf"); },
                    {"gguf_block_count_2e62.gguf", "\"llama.block_count\" must be a positive integer at most 1024"});
  test::check_error([] { load_gguf(kStrict + "/gguf_block_count_1000.gguf"); },
                    {"gguf_block_count_1000.gguf", "weights (llama.block_count 1000, embedding_length 1024",
                     "but the file's tensors hold 5120"});
  test::check_error([] { load_gguf(kStrict + "/gguf_vocab_mismatch.gguf"); },
                    {"gguf_vocab_mismatch.gguf", "token_embd.weight is (4, 8) but the config describes (1000, 8)"});
}

TEST_CASE("strict config: a sweep of sizes never lets bad_alloc or length_error out of the loaders") {
  const nlohmann::json base = lm::detail::read_json_file(kLlama + "/config.json", "config");
  const std::vector<std::int64_t> values{-1, 0, 1, 3, 1 << 20, (std::int64_t{1} << 31) - 1, (std::int64_t{1} << 32) + 100,
                                         std::int64_t{1} << 40, std::int64_t{1} << 62, std::numeric_limits<std::int64_t>::max()};
  int refused = 0, accepted = 0;
  for (const char* field : {"hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                            "num_key_value_heads", "head_dim", "vocab_size", "max_position_embeddings"}) {
    for (std::int64_t v : values) {
      INFO(field << " = " << v);
      nlohmann::json j = base;
      j[field] = v;
      try {
        const ModelConfig c = config_from_json(j, "sweep/config.json");
        // accepted: the model it describes is allocated, or refused with an nn::Error
        try {
          (void)lm::detail::allocate(c, DType::f32, "sweep");
        } catch (const Error& e) {
          CHECK(std::string(e.what()).find("[load] sweep: cannot allocate") == 0);
        }
        ++accepted;
      } catch (const Error& e) {
        CHECK(std::string(e.what()).find("sweep/config.json") != std::string::npos);
        ++refused;
      } catch (const std::exception& e) {
        FAIL("a non-nn::Error escaped: " << e.what());
      }
    }
  }
  CHECK(refused > 40);
  CHECK(accepted > 5);
}

TEST_CASE("strict config: a config within the limits that no machine holds fails as nn::Error naming the source") {
  ModelConfig c = config_from_json(lm::detail::read_json_file(kLlama + "/config.json", "config"), "big/config.json");
  c.vocab_size = ModelConfig::kMaxVocab;  // 2^24 x 2^14 embedding: 1 TiB of float32
  c.hidden_size = std::int64_t{1} << 14;
  c.head_dim = c.hidden_size / c.num_attention_heads;
  c.validate("big");
  // A kernel that overcommits without limit (vm.overcommit_memory = 1) hands out the untouched
  // terabyte; the heuristic default (0) refuses it, and the loader must say so as nn::Error.
  bool refused = false;
  try {
    (void)lm::detail::allocate(c, DType::f32, "big/config.json");
  } catch (const Error& e) {
    refused = true;
    const std::string msg = e.what();
    CHECK(msg.find("[load] big/config.json: cannot allocate the model the config describes") == 0);
    CHECK(msg.find("vocabulary 16777216") != std::string::npos);
  } catch (const std::exception& e) {
    FAIL("a non-nn::Error escaped: " << e.what());
  }
  std::ifstream overcommit("/proc/sys/vm/overcommit_memory");
  int mode = -1;
  overcommit >> mode;
  if (mode == 0 || mode == 2) CHECK(refused);
}

TEST_CASE("strict config: a Hugging Face folder's tensors are checked against its config before allocation") {
  test::check_error([] { load_hf(kStrict + "/hf_layers_1000"); },
                    {"[load_hf]", "hf_layers_1000", "weights (num_hidden_layers 1000, hidden_size 1024",
                     "but the file's tensors hold 9216"});
  test::check_error([] { load_hf(kStrict + "/hf_vocab_mismatch"); },
                    {"[load_hf]", "hf_vocab_mismatch", "model.embed_tokens.weight is (4, 32) but the config describes (64, 32)"});
}

TEST_CASE("strict config: a GGUF tokenizer's tokens, types and ids are checked at their real width, naming the file") {
  const auto tok = [](const std::string& name) { return gguf_tokenizer(GgufFile(kStrict + "/" + name)); };
  const Tokenizer ok = tok("gguf_tok_ok.gguf");
  CHECK(ok.encode("ab<|end|>") == std::vector<std::int32_t>{2, 3});
  CHECK(ok.eos_id() == 3);
  test::check_error([&] { tok("gguf_tok_duplicate.gguf"); },
                    {"gguf_tok_duplicate.gguf", "tokenizer.ggml.tokens[3]", "token \"b\" is already tokens[1]"});
  test::check_error([&] { tok("gguf_tok_type_99.gguf"); },
                    {"gguf_tok_type_99.gguf", "tokenizer.ggml.token_type[2]", "99 is not a token type (0 undefined .. 6 byte)"});
  test::check_error([&] { tok("gguf_tok_type_2e32.gguf"); },
                    {"gguf_tok_type_2e32.gguf", "tokenizer.ggml.token_type[2]", "4294967297 is not a token type"});
  test::check_error([&] { tok("gguf_tok_invalid_utf8.gguf"); },
                    {"gguf_tok_invalid_utf8.gguf", "tokenizer.ggml.tokens[2]", "not valid UTF-8 (byte 255 at offset 1)"});
  test::check_error([&] { tok("gguf_tok_eos_2e32.gguf"); },
                    {"gguf_tok_eos_2e32.gguf", "tokenizer.ggml.eos_token_id", "id 4294967299 is out of range"});
}

}  // namespace lm_strict_config
