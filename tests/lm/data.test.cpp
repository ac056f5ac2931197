// SPDX-License-Identifier: MIT OR Apache-2.0
// JSONL data in mlx-lm's three forms, ChatML and the model's own chat template, prompt masking,
// batching and errors.
#include "support/check.hpp"

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <memory>
#include <sstream>

#include <nn/lm/data.hpp>

namespace lm_data {  // one unity source with the other lm files: its names stay its own

using namespace nn;
using namespace nn::lm;

namespace {

// A byte tokenizer: one id per byte, EOS = 256. Enough to check offsets and masks exactly.
struct Bytes {
  std::vector<std::int32_t> encode(const std::string& s, bool) const {
    return std::vector<std::int32_t>(s.begin(), s.end());
  }
  std::int32_t eos_id() const { return 256; }
};

std::filesystem::path write(const std::string& name, const std::string& text) {
  auto dir = std::filesystem::temp_directory_path() / "nn_data_test";
  std::filesystem::create_directories(dir);
  std::ofstream(dir / name) << text;
  return dir / name;
}

}  // namespace

TEST_CASE("the three record forms") {
  Bytes tok;
  DataOptions opt;
  auto text = make_example(nlohmann::json{{"text", "ab"}}, tok, opt, "f", 1);
  CHECK(text.tokens == std::vector<std::int32_t>{'a', 'b', 256});
  CHECK(text.offset == 0);

  auto pc = make_example(nlohmann::json{{"prompt", "hi"}, {"completion", "yo"}}, tok, opt, "f", 1);
  const std::string full = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nyo<|im_end|>\n";
  const std::string head = "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n";
  CHECK(pc.tokens == tok.encode(full, false));
  CHECK(pc.offset == head.size());

  auto chat = make_example(nlohmann::json::parse(R"({"messages": [{"role": "system", "content": "s"},
      {"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]})"), tok, opt, "f", 1);
  CHECK(chat.offset == std::string("<|im_start|>system\ns<|im_end|>\n<|im_start|>user\nq<|im_end|>\n<|im_start|>assistant\n").size());

  DataOptions qwen;
  qwen.chat.default_system = "You are a helpful assistant.";
  auto withsys = make_example(nlohmann::json{{"prompt", "hi"}, {"completion", "yo"}}, tok, qwen, "f", 1);
  CHECK(std::string(withsys.tokens.begin(), withsys.tokens.begin() + 40).rfind("<|im_start|>system\nYou are a helpful", 0) == 0);
}

TEST_CASE("a multi-turn conversation learns every assistant turn, and only those") {
  Bytes tok;
  const auto conv = nlohmann::json::parse(R"({"messages": [{"role": "system", "content": "s"},
      {"role": "user", "content": "q1"}, {"role": "assistant", "content": "a1"},
      {"role": "tool", "content": "t"}, {"role": "user", "content": "q2"},
      {"role": "assistant", "content": "a2"}]})");
  const std::string sys = "<|im_start|>system\ns<|im_end|>\n", u1 = "<|im_start|>user\nq1<|im_end|>\n",
                    hdr = "<|im_start|>assistant\n", a1 = "a1<|im_end|>\n", tool = "<|im_start|>tool\nt<|im_end|>\n",
                    u2 = "<|im_start|>user\nq2<|im_end|>\n", a2 = "a2<|im_end|>\n";
  const std::string full = sys + u1 + hdr + a1 + tool + u2 + hdr + a2;
  DataOptions opt;
  const Example ex = make_example(conv, tok, opt, "f", 1);
  REQUIRE(ex.tokens == tok.encode(full, false));
  // the byte positions of the two assistant turns' content and end-of-turn markers
  const std::size_t b1 = (sys + u1 + hdr).size(), e1 = b1 + a1.size();
  const std::size_t b2 = (sys + u1 + hdr + a1 + tool + u2 + hdr).size(), e2 = b2 + a2.size();
  CHECK(ex.learn == std::vector<std::pair<std::size_t, std::size_t>>{{b1, e1}, {b2, e2}});
  for (std::size_t pos = 1; pos < full.size(); ++pos)
    CHECK_MESSAGE(ex.learned(pos) == ((pos >= b1 && pos < e1) || (pos >= b2 && pos < e2)), "position " << pos);
  // the batch's mask: target t + 1 counts exactly on the two turns (the tool's output does not)
  const std::vector<Example> data{ex};
  const std::size_t row[] = {0};
  const Batch b = make_batch(data, row, 1024);
  const std::vector<double> m = b.mask.to_doubles();
  for (std::size_t t = 0; t + 1 < full.size(); ++t) CHECK(m[t] == (ex.learned(t + 1) ? 1.0 : 0.0));
  CHECK(b.tokens == static_cast<std::int64_t>(a1.size() + a2.size()));
  // mlx-lm's rule: the last message only
  DataOptions last;
  last.every_assistant_turn = false;
  const Example ml = make_example(conv, tok, last, "f", 1);
  CHECK(ml.learn.empty());
  CHECK(ml.offset == b2);
  // and no masking at all
  DataOptions none;
  none.mask_prompt = false;
  const Example all = make_example(conv, tok, none, "f", 1);
  CHECK(all.offset == 0);
  CHECK(all.learn.empty());
}

TEST_CASE("the model's chat template: tools and tool calls pass through, keys in file order, turns learned") {
  // Qwen2.5-7B-Instruct's real template (tests/fixtures/lm/chat_templates, checked against
  // transformers in tests/lm/chat_template.test.cpp).
  std::ifstream f(std::string(NN_FIXTURES_DIR) + "/lm/chat_templates/qwen2.5.jinja", std::ios::binary);
  REQUIRE(f);
  DataOptions opt;
  opt.chat_template = std::make_shared<const ChatTemplate>(std::string(std::istreambuf_iterator<char>(f), {}), "qwen2.5.jinja");
  // "unit" before "city" in the file: the template's tojson keeps that order.
  const std::string line = R"({"messages": [{"role": "user", "content": "Weather?"},
      {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "w", "arguments": {"unit": "C", "city": "Oslo"}}}]},
      {"role": "tool", "content": "-3"}, {"role": "assistant", "content": "Cold."}],
      "tools": [{"type": "function", "function": {"name": "w", "parameters": {}}}]})";
  std::string oneline = line;
  std::replace(oneline.begin(), oneline.end(), '\n', ' ');
  std::istringstream in(oneline);
  Bytes tok;
  const std::vector<Example> ex = read_jsonl(in, "chat.jsonl", tok, opt);
  REQUIRE(ex.size() == 1);
  const std::string text(ex[0].tokens.begin(), ex[0].tokens.end());
  const std::string sys = "<|im_start|>system\nYou are Qwen, created by Alibaba Cloud. You are a helpful assistant.\n\n# Tools\n\n";
  CHECK(text.rfind(sys, 0) == 0);
  CHECK(text.find(R"(<tools>
{"type": "function", "function": {"name": "w", "parameters": {}}}
</tools>)") != std::string::npos);
  const std::string call = "<tool_call>\n{\"name\": \"w\", \"arguments\": {\"unit\": \"C\", \"city\": \"Oslo\"}}\n</tool_call><|im_end|>\n";
  const std::string tail = "<|im_start|>user\n<tool_response>\n-3\n</tool_response><|im_end|>\n<|im_start|>assistant\nCold.<|im_end|>\n";
  CHECK(text.size() > call.size() + tail.size());
  CHECK(text.substr(text.size() - tail.size()) == tail);
  // Learned: the tool call (after "<|im_start|>assistant") and the final answer, with their end markers.
  REQUIRE(ex[0].learn.size() == 2);
  auto span = [&](std::size_t k) { return text.substr(ex[0].learn[k].first, ex[0].learn[k].second - ex[0].learn[k].first); };
  CHECK(span(0) == call);
  CHECK(span(1) == "Cold.<|im_end|>\n");
  // Errors inside the template name the record.
  const std::string bad = R"({"messages": [{"role": "user", "content": 5}]})";
  std::istringstream in2(bad);
  CHECK_THROWS_WITH_AS(read_jsonl(in2, "bad.jsonl", tok, opt), doctest::Contains("bad.jsonl:1"), nn::Error);
  // ChatML has no tool format: a record with tools needs a template.
  DataOptions chatml;
  CHECK_THROWS_WITH_AS(make_example(nlohmann::json::parse(oneline), tok, chatml, "f", 3), doctest::Contains("needs the model's chat template"),
                       nn::Error);
}

TEST_CASE("batches: inputs, shifted targets, and a mask over the completion only") {
  std::vector<Example> data{{{1, 2, 3, 4, 5}, 2, {}}, {{7, 8, 9}, 0, {}}};
  std::vector<std::size_t> rows{0, 1};
  Batch b = make_batch(data, rows, 64);
  CHECK(b.inputs.shape() == Shape{2, 4});
  CHECK(b.inputs.to_doubles() == std::vector<double>{1, 2, 3, 4, 7, 8, 0, 0});
  CHECK(b.targets.to_doubles() == std::vector<double>{2, 3, 4, 5, 8, 9, 0, 0});
  // row 0: offset 2 -> targets tokens[2..4] count (t + 1 >= 2); row 1: both real targets count
  CHECK(b.mask.to_doubles() == std::vector<double>{0, 1, 1, 1, 1, 1, 0, 0});
  CHECK(b.tokens == 5);
  Batch t = make_batch(data, rows, 3);  // truncated to 3 tokens: T = 2
  CHECK(t.inputs.shape() == Shape{2, 2});
  CHECK(t.mask.to_doubles() == std::vector<double>{0, 1, 1, 1});
  Batch p = make_batch(data, rows, 64, 8);
  CHECK(p.inputs.shape() == Shape{2, 8});
}

TEST_CASE("batch order: length-sorted groups, shuffled per epoch with a seed") {
  std::vector<Example> data;
  for (int i = 0; i < 10; ++i) data.push_back({std::vector<std::int32_t>(static_cast<std::size_t>(10 - i), 1), 0, {}});
  BatchOrder a(data, 3, 7), b(data, 3, 7);
  CHECK(a.batches_per_epoch() == 3);
  for (int i = 0; i < 6; ++i) CHECK(a.next() == b.next());
  for (auto r : a.next()) CHECK(data[r].tokens.size() <= 10);
}

TEST_CASE("files: a directory with train/valid, a single file split, and clear errors") {
  Bytes tok;
  auto f = write("one.jsonl", "{\"text\": \"a\"}\n\n{\"text\": \"b\"}\n{\"text\": \"c\"}\n{\"text\": \"d\"}\n");
  Splits s = load_splits(f, tok, {}, 0.25, 1);
  CHECK(s.train.size() == 3);
  CHECK(s.valid.size() == 1);
  auto bad = write("bad.jsonl", "{\"text\": \"a\"}\n{\"prompt\": \"x\"}\n");
  test::check_error([&] { load_jsonl(bad, tok); }, {"[data]", "bad.jsonl:2", "missing field \"completion\""});
  auto broken = write("broken.jsonl", "{\"text\": \"a\"\n");
  test::check_error([&] { load_jsonl(broken, tok); }, {"broken.jsonl:1", "not valid JSON"});
  auto kind = write("kind.jsonl", "{\"foo\": 1}\n");
  test::check_error([&] { load_jsonl(kind, tok); }, {"kind.jsonl:1", "needs \"text\""});
  test::check_error([&] { load_jsonl("/nonexistent/x.jsonl", tok); }, {"cannot open"});
}

}  // namespace lm_data
