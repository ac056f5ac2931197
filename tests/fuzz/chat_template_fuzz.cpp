// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for chat templates (nn/lm/chat_template.hpp): the input is a Jinja template;
// after a "\x01CTX\x01" marker, a JSON object of variables (else a short conversation with tools
// is used). The template parses and renders, or an nn::Error naming the input ("<fuzz>") is
// raised: never a crash, a hang (the render's step and output bounds are lowered here so each
// input stays fast) or another exception. Built and run by tests/fuzz/run.sh chat_template;
// replayed by CTest (fuzz_replay).
#include <nn/lm/chat_template.hpp>

#include "fuzz_common.hpp"

namespace {

constexpr const char* kName = "chat_template_fuzz";

const nlohmann::ordered_json& default_context() {
  static const nlohmann::ordered_json c = nlohmann::ordered_json::parse(R"({
    "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi <x>"},
                 {"role": "assistant", "content": "", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": {"a": 1}}}]},
                 {"role": "tool", "content": "2"}, {"role": "assistant", "content": "<think>r</think>ok", "reasoning_content": "r"}],
    "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}],
    "add_generation_prompt": true, "bos_token": "<s>", "eos_token": "</s>"})");
  return c;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  std::string_view input = nn_fuzz::as_text(data, size);
  nlohmann::ordered_json ctx = default_context();
  constexpr std::string_view kMarker = "\x01CTX\x01";
  if (const std::size_t at = input.find(kMarker); at != std::string_view::npos) {
    const std::string_view json = input.substr(at + kMarker.size());
    input = input.substr(0, at);
    auto parsed = nlohmann::ordered_json::parse(json.begin(), json.end(), nullptr, false);
    if (!parsed.is_discarded() && parsed.is_object()) ctx = std::move(parsed);
  }
  try {
    nn::lm::ChatTemplate t{std::string(input), nn_fuzz::kLabel};
    t.max_steps = 20'000;
    t.max_output = 1 << 20;
    const std::string out = t.render(ctx);
    if (out.size() > (std::size_t{1} << 20) + (std::size_t{1} << 16)) nn_fuzz::broken(kName, "output past the bound");
  } catch (const nn::Error& e) {
    nn_fuzz::expect_mention(e, kName);
  }
  return 0;
}
