// SPDX-License-Identifier: MIT OR Apache-2.0
// Strict JSON for the LLM kit's files (config.json, tokenizer.json, tokenizer_config.json,
// adapter configs, safetensors indexes, JSONL records): one reader, so every loader refuses the
// same things with errors that name the file and where.
//
// nlohmann::json ends its input at a NUL byte, so `{"text":"a"}\0{"text":"b"}` would parse as the
// first document and drop the rest silently. JSON text holds no NUL (RFC 8259: control characters
// appear only escaped), so a NUL anywhere is refused with its offset; anything after the document
// but whitespace is refused by the strict parse, with nlohmann's line and column.
#pragma once

#include <cstddef>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <string>
#include <string_view>

#include <nlohmann/json.hpp>

#include "../config.hpp"

namespace nn::lm::detail {

/// Parses `text` (all of it) as one JSON document; `who` and `label` (the file, with a line for
/// JSONL) lead errors.
inline nlohmann::json parse_json_strict(std::string_view text, std::string_view who, const std::string& label) {
  if (const std::size_t nul = text.find('\0'); nul != std::string_view::npos)
    nn::detail::fail(who, label, ": a NUL byte at offset ", nul, " (JSON text holds none; the rest would be dropped)");
  try {
    return nlohmann::json::parse(text.begin(), text.end());
  } catch (const nlohmann::json::exception& e) {
    nn::detail::fail(who, label, ": not valid JSON (", e.what(), ")");
  }
}

/// Reads and parses a whole JSON file strictly (parse_json_strict).
inline nlohmann::json read_json_file(const std::filesystem::path& path, std::string_view who) {
  std::ifstream in(path, std::ios::binary);
  if (!in) nn::detail::fail(who, path.string(), ": cannot open");
  std::stringstream ss;
  ss << in.rdbuf();
  return parse_json_strict(ss.str(), who, path.string());
}

}  // namespace nn::lm::detail
