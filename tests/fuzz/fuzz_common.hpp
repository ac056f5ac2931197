// SPDX-License-Identifier: MIT OR Apache-2.0
// Shared by the libFuzzer harnesses of tests/fuzz/ (and by replay_main.cpp, which runs them
// without libFuzzer): a broken invariant aborts, so that libFuzzer records the input as a crash
// and the CTest replay fails; a refusal must be an nn::Error that names the input.
#pragma once

#include <nn/config.hpp>

#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <initializer_list>
#include <string>
#include <string_view>
#include <vector>

namespace nn_fuzz {

/// The name every harness gives its input; every refusal must mention it.
inline constexpr const char* kLabel = "<fuzz>";

[[noreturn]] inline void broken(const char* harness, const std::string& what) {
  std::fprintf(stderr, "%s: invariant broken: %s\n", harness, what.c_str());
  std::abort();
}

/// A refusal whose message starts with one of `prefixes` ("[gguf] <fuzz>: "); anything else aborts.
inline void expect_prefix(const nn::Error& e, const char* harness, std::initializer_list<std::string_view> prefixes) {
  const std::string_view msg = e.what();
  for (std::string_view p : prefixes)
    if (msg.starts_with(p)) return;
  broken(harness, "an error without the expected \"[reader] <fuzz>: \" prefix: " + std::string(msg.substr(0, 300)));
}

/// A refusal that names the input somewhere (readers whose messages lead with a field or an
/// operation rather than the file).
inline void expect_mention(const nn::Error& e, const char* harness) {
  const std::string_view msg = e.what();
  if (msg.find(kLabel) == std::string_view::npos)
    broken(harness, "an error that does not name the input: " + std::string(msg.substr(0, 300)));
}

inline std::string_view as_text(const std::uint8_t* data, std::size_t size) {
  return {reinterpret_cast<const char*>(data), size};
}

inline std::vector<std::byte> as_bytes(const std::uint8_t* data, std::size_t size) {
  const auto* p = reinterpret_cast<const std::byte*>(data);
  return {p, p + size};
}

}  // namespace nn_fuzz
