// SPDX-License-Identifier: MIT OR Apache-2.0
// The message of the nn::Error a call raises, for tests that check what an error names, without
// pulling in the whole library as support/check.hpp does (the tokenizer and chat-template tests
// compile nothing else).
#pragma once

#include <string>

#include <nn/config.hpp>

namespace nn::test {

/// What `f()` raised as nn::Error, or "(no error)".
template <class F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const nn::Error& e) {
    return e.what();
  }
  return "(no error)";
}

inline bool contains(const std::string& s, const std::string& part) { return s.find(part) != std::string::npos; }

}  // namespace nn::test
