// SPDX-License-Identifier: MIT OR Apache-2.0
// Fine-tuning data as mlx-lm reads it: JSONL in three forms ({"text"}, {"prompt","completion"},
// {"messages"} through the model's own chat template, or ChatML), tokenized, split, shuffled
// with a seed, and batched with padding and a loss mask.
#pragma once

#include <algorithm>
#include <filesystem>
#include <fstream>
#include <functional>
#include <istream>
#include <numeric>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../tensor.hpp"
#include "chat_template.hpp"
#include "json.hpp"

namespace nn::lm {

/// What the data layer needs of a tokenizer: encode text without adding special tokens (the
/// templates write them), and the end-of-sequence id.
template <class T>
concept TextEncoder = requires(const T& t, const std::string& s) {
  { t.encode(s, false) } -> std::convertible_to<std::vector<std::int32_t>>;
  { t.eos_id() } -> std::convertible_to<std::int32_t>;
};

/// One training sequence: its tokens, the first token position that counts in the loss (0 =
/// all; the prompt's length when only the completion is learned), and, for a conversation
/// learned turn by turn, the token ranges [begin, end) of its assistant turns (empty: everything
/// from `offset` on).
struct Example {
  std::vector<std::int32_t> tokens;
  std::size_t offset = 0;
  std::vector<std::pair<std::size_t, std::size_t>> learn;

  /// Whether the next-token target at token position `pos` (>= 1) counts in the loss.
  bool learned(std::size_t pos) const {
    if (pos < std::max<std::size_t>(offset, 1)) return false;
    if (learn.empty()) return true;
    for (const auto& [b, e] : learn)
      if (pos >= b && pos < e) return true;
    return false;
  }
};

/// A chat message, as mlx-lm's {"role", "content"}.
struct Message {
  std::string role, content;
};

/// ChatML (<|im_start|>role\ncontent<|im_end|>\n), the format of SmolLM2-Instruct and Qwen2.
/// `default_system`, when not empty, is inserted as the system message of a conversation that
/// has none (Qwen2.5's template does this with "You are a helpful assistant.").
struct ChatML {
  std::string default_system;

  std::string render(const std::vector<Message>& messages, bool add_generation_prompt) const {
    std::string out;
    if (!default_system.empty() && (messages.empty() || messages.front().role != "system"))
      out += "<|im_start|>system\n" + default_system + "<|im_end|>\n";
    for (const Message& m : messages) out += "<|im_start|>" + m.role + "\n" + m.content + "<|im_end|>\n";
    if (add_generation_prompt) out += "<|im_start|>assistant\n";
    return out;
  }
};

/// How the three JSONL forms become examples.
struct DataOptions {
  ChatML chat;
  /// The model's own chat template (tokenizer.chat_template), used instead of `chat` when set:
  /// conversations render as apply_chat_template renders them, with every field of each message
  /// (tool_calls, reasoning_content, ...) and the record's "tools" passed through, as mlx-lm
  /// does. `template_vars` go beside them (bos_token, eos_token, options like enable_thinking).
  std::shared_ptr<const ChatTemplate> chat_template;
  nlohmann::ordered_json template_vars = nlohmann::ordered_json::object();
  /// Learn only the completion / the assistant turns (mlx-lm's --mask-prompt).
  bool mask_prompt = true;
  /// With mask_prompt, a {"messages"} conversation learns every assistant turn, each from its
  /// first token to its end-of-turn marker, and nothing else (the user, system and tool turns
  /// are context). False: mlx-lm's rule, the last message only, everything before it masked.
  bool every_assistant_turn = true;
};

namespace detail {

[[noreturn]] inline void data_fail(const std::string& where, std::size_t line, const std::string& what) {
  nn::detail::fail("data", where, ":", line, ": ", what);
}

inline std::string field_string(const nlohmann::json& j, const char* key, const std::string& where, std::size_t line) {
  auto it = j.find(key);
  if (it == j.end()) data_fail(where, line, std::string("missing field \"") + key + "\"");
  if (!it->is_string()) data_fail(where, line, std::string("field \"") + key + "\" must be a string");
  return it->get<std::string>();
}

}  // namespace detail

/// One JSONL record as an example. Forms (as mlx-lm's create_dataset): {"text"}: every token
/// counts, an EOS is appended if missing; {"prompt", "completion"}: a user/assistant exchange in
/// the chat format, the prompt masked; {"messages": [{"role", "content"}, ...], "tools": [...]}:
/// the conversation, all but the last message masked. `where`/`line` name the source in errors.
/// `ordered`, when given, is the same record with its keys in file order (what a chat template's
/// tojson prints); without it they come sorted.
template <TextEncoder Tok>
Example make_example(const nlohmann::json& j, const Tok& tok, const DataOptions& opt, const std::string& where,
                     std::size_t line, const nlohmann::ordered_json* ordered = nullptr) {
  if (!j.is_object()) detail::data_fail(where, line, "a record must be a JSON object");
  Example ex;
  if (j.contains("text")) {
    ex.tokens = tok.encode(detail::field_string(j, "text", where, line), false);
    if (ex.tokens.empty() || ex.tokens.back() != tok.eos_id()) ex.tokens.push_back(tok.eos_id());
    return ex;
  }
  // The conversation as roles and a renderer of its first n messages (with or without the
  // generation prompt): through the chat template, or ChatML.
  std::vector<std::string> roles;
  std::function<std::string(std::size_t, bool)> render;
  std::vector<Message> msgs;
  nlohmann::ordered_json jmsgs = nlohmann::ordered_json::array(), tools;
  if (j.contains("prompt") || j.contains("completion")) {
    msgs = {{"user", detail::field_string(j, "prompt", where, line)},
            {"assistant", detail::field_string(j, "completion", where, line)}};
    for (const Message& m : msgs) jmsgs.push_back({{"role", m.role}, {"content", m.content}});
  } else if (j.contains("messages")) {
    const auto& ms = j["messages"];
    if (!ms.is_array() || ms.empty()) detail::data_fail(where, line, "field \"messages\" must be a non-empty array");
    if (!opt.chat_template && j.contains("tools"))
      detail::data_fail(where, line, "\"tools\" needs the model's chat template (ChatML has no tool format)");
    const nlohmann::ordered_json oj = ordered ? *ordered : nlohmann::ordered_json(j);
    for (std::size_t i = 0; i < ms.size(); ++i) {
      if (!ms[i].is_object())
        detail::data_fail(where, line, "messages[" + std::to_string(i) + "] must be an object");
      const std::string role = detail::field_string(ms[i], "role", where, line);
      // A template takes any message (a tool call's content may be null); ChatML needs text.
      msgs.push_back({role, opt.chat_template ? std::string() : detail::field_string(ms[i], "content", where, line)});
      jmsgs.push_back(oj["messages"][i]);
    }
    if (j.contains("tools")) {
      if (!j["tools"].is_array() && !j["tools"].is_null()) detail::data_fail(where, line, "field \"tools\" must be an array");
      tools = oj["tools"];
    }
  } else {
    detail::data_fail(where, line, "a record needs \"text\", \"prompt\"+\"completion\" or \"messages\"");
  }
  for (const Message& m : msgs) roles.push_back(m.role);
  if (opt.chat_template) {
    render = [&](std::size_t n, bool open) {
      const nlohmann::ordered_json part(jmsgs.begin(), jmsgs.begin() + static_cast<std::ptrdiff_t>(n));
      try {
        return opt.chat_template->apply(part, open, opt.template_vars, tools);
      } catch (const nn::Error& e) {
        detail::data_fail(where, line, e.what());
      }
    };
  } else {
    render = [&](std::size_t n, bool open) {
      return opt.chat.render(std::vector<Message>(msgs.begin(), msgs.begin() + static_cast<std::ptrdiff_t>(n)), open);
    };
  }
  ex.tokens = tok.encode(render(roles.size(), false), false);
  if (!opt.mask_prompt) return ex;
  const auto count = [&](std::size_t n, bool open_turn) { return tok.encode(render(n, open_turn), false).size(); };
  if (opt.every_assistant_turn) {
    // each assistant turn: from after its header (the prefix rendered with a generation prompt)
    // to the end of the prefix that includes it (its content and end-of-turn marker)
    for (std::size_t i = 0; i < roles.size(); ++i)
      if (roles[i] == "assistant")
        ex.learn.emplace_back(std::min(count(i, true), ex.tokens.size()), std::min(count(i + 1, false), ex.tokens.size()));
    if (!ex.learn.empty()) {
      ex.offset = ex.learn.front().first;
      return ex;
    }
  }
  ex.offset = count(roles.size() - 1, roles.back() == "assistant");
  return ex;
}

/// Every record of JSONL text read from `in` (blank lines skipped); `label` (the file) leads
/// errors, with the line.
template <TextEncoder Tok>
std::vector<Example> read_jsonl(std::istream& in, const std::string& label, const Tok& tok, const DataOptions& opt = {}) {
  std::vector<Example> out;
  std::string text;
  std::size_t line = 0;
  while (std::getline(in, text)) {
    ++line;
    if (text.find_first_not_of(" \t\r") == std::string::npos) continue;
    const nlohmann::json j = detail::parse_json_strict(text, "data", label + ":" + std::to_string(line));
    if (opt.chat_template) {  // keys in file order for the template (strictness checked above)
      const nlohmann::ordered_json oj = nlohmann::ordered_json::parse(text);
      out.push_back(make_example(j, tok, opt, label, line, &oj));
    } else {
      out.push_back(make_example(j, tok, opt, label, line));
    }
  }
  if (out.empty()) nn::detail::fail("data", label, ": no records");
  return out;
}

/// Every record of a JSONL file (blank lines skipped). Errors name the file and line.
template <TextEncoder Tok>
std::vector<Example> load_jsonl(const std::filesystem::path& path, const Tok& tok, const DataOptions& opt = {}) {
  std::ifstream f(path);
  if (!f) nn::detail::fail("data", path.string(), ": cannot open the file");
  return read_jsonl(f, path.string(), tok, opt);
}

/// The train and validation sets: from DIR/train.jsonl and DIR/valid.jsonl (mlx-lm's layout),
/// or from one file split with `valid_fraction` of the records (shuffled with `seed`) held out.
struct Splits {
  std::vector<Example> train, valid;
};

template <TextEncoder Tok>
Splits load_splits(const std::filesystem::path& path, const Tok& tok, const DataOptions& opt = {},
                   double valid_fraction = 0.1, std::uint64_t seed = 0) {
  if (std::filesystem::is_directory(path)) {
    Splits s;
    s.train = load_jsonl(path / "train.jsonl", tok, opt);
    if (std::filesystem::exists(path / "valid.jsonl")) s.valid = load_jsonl(path / "valid.jsonl", tok, opt);
    return s;
  }
  std::vector<Example> all = load_jsonl(path, tok, opt);
  std::mt19937_64 rng(seed);
  std::shuffle(all.begin(), all.end(), rng);
  const std::size_t nv = std::min(all.size() - 1, static_cast<std::size_t>(valid_fraction * static_cast<double>(all.size())));
  Splits s;
  s.valid.assign(all.begin(), all.begin() + static_cast<std::ptrdiff_t>(nv));
  s.train.assign(all.begin() + static_cast<std::ptrdiff_t>(nv), all.end());
  return s;
}

/// A padded batch. inputs/targets: (B, T) int32, targets[b, t] = tokens[t + 1] (0 as padding);
/// mask: (B, T) float32, 1 where the target counts: t + 1 in [max(offset, 1), length - 1] (the
/// next-token targets of the sequence's own tokens after the prompt). mlx-lm's default_loss also
/// counts one padding target at t + 1 = length; this mask does not.
struct Batch {
  Tensor inputs, targets, mask;
  std::int64_t tokens = 0;  // how many targets count
};

/// Batch `rows` of `data` (indices), padded to the longest (truncated to max_seq tokens).
/// `pad_to` rounds T up (mlx-lm pads to a multiple of 32; a fixed T lets a compiled step replay).
inline Batch make_batch(const std::vector<Example>& data, std::span<const std::size_t> rows, std::int64_t max_seq,
                        std::int64_t pad_to = 1, DType mask_dtype = DType::f32) {
  if (rows.empty()) nn::detail::fail("data", "an empty batch");
  std::int64_t longest = 0;
  for (std::size_t r : rows) longest = std::max<std::int64_t>(longest, static_cast<std::int64_t>(data[r].tokens.size()));
  longest = std::min(longest, max_seq);
  std::int64_t T = std::max<std::int64_t>(longest - 1, 1);
  if (pad_to > 1) T = std::min((T + pad_to - 1) / pad_to * pad_to, std::max<std::int64_t>(max_seq - 1, 1));
  const std::int64_t B = static_cast<std::int64_t>(rows.size());
  std::vector<std::int32_t> in(static_cast<std::size_t>(B * T), 0), tg(in.size(), 0);
  std::vector<double> mk(in.size(), 0.0);
  std::int64_t count = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    const Example& ex = data[rows[static_cast<std::size_t>(b)]];
    const std::int64_t L = std::min<std::int64_t>(static_cast<std::int64_t>(ex.tokens.size()), max_seq);
    for (std::int64_t t = 0; t < T && t + 1 < L; ++t) {
      const std::size_t i = static_cast<std::size_t>(b * T + t);
      in[i] = ex.tokens[static_cast<std::size_t>(t)];
      tg[i] = ex.tokens[static_cast<std::size_t>(t + 1)];
      if (ex.learned(static_cast<std::size_t>(t + 1))) {
        mk[i] = 1.0;
        ++count;
      }
    }
  }
  return {Tensor::from<std::int32_t>({B, T}, in), Tensor::from<std::int32_t>({B, T}, tg),
          Tensor::from_doubles({B, T}, mk, mask_dtype), count};
}

/// Sequence packing (TRL's packing, kept apart by document): which examples each row of `T`
/// positions holds, first-fit decreasing. An example of L tokens takes L - 1 positions (its
/// input/target pairs), truncated to T as make_batch truncates; rows are filled longest first,
/// each example going into the first row with room. Deterministic; every example is placed once.
inline std::vector<std::vector<std::size_t>> pack_examples(const std::vector<Example>& data, std::int64_t T) {
  if (T < 1) nn::detail::fail("data", "pack_examples needs T >= 1, got ", T);
  auto len = [&](std::size_t i) {
    return std::clamp<std::int64_t>(static_cast<std::int64_t>(data[i].tokens.size()) - 1, 1, T);
  };
  std::vector<std::size_t> idx(data.size());
  std::iota(idx.begin(), idx.end(), 0);
  std::stable_sort(idx.begin(), idx.end(), [&](std::size_t a, std::size_t b) { return len(a) > len(b); });
  std::vector<std::vector<std::size_t>> rows;
  std::vector<std::int64_t> room;
  for (std::size_t i : idx) {
    std::size_t r = 0;
    while (r < rows.size() && room[r] < len(i)) ++r;
    if (r == rows.size()) {
      rows.emplace_back();
      room.push_back(T);
    }
    rows[r].push_back(i);
    room[r] -= len(i);
  }
  return rows;
}

/// The share of a packing's positions that hold an example's token (the rest is padding).
inline double pack_fill(const std::vector<Example>& data, const std::vector<std::vector<std::size_t>>& rows, std::int64_t T) {
  std::int64_t used = 0;
  for (const auto& r : rows)
    for (std::size_t i : r) used += std::clamp<std::int64_t>(static_cast<std::int64_t>(data[i].tokens.size()) - 1, 1, T);
  return rows.empty() ? 0.0 : static_cast<double>(used) / static_cast<double>(T * static_cast<std::int64_t>(rows.size()));
}

/// A batch of packed rows (B, T): inputs, targets and mask as make_batch makes them per example
/// (the prompt of a prompt/completion or chat example stays masked), plus each position's
/// document start and position inside its document (CausalLM's Packing), both int32. Padding
/// after the last document is its own one-token documents with mask 0.
struct PackedBatch {
  Batch batch;
  Tensor starts, positions;
};
inline PackedBatch make_packed_batch(const std::vector<Example>& data, std::span<const std::vector<std::size_t>> rows,
                                     std::int64_t T, DType mask_dtype = DType::f32) {
  if (rows.empty()) nn::detail::fail("data", "an empty batch");
  const std::int64_t B = static_cast<std::int64_t>(rows.size());
  const std::size_t n = static_cast<std::size_t>(B * T);
  std::vector<std::int32_t> in(n, 0), tg(n, 0), st(n), pos(n, 0);
  std::vector<double> mk(n, 0.0);
  std::int64_t count = 0;
  for (std::int64_t b = 0; b < B; ++b) {
    std::int64_t at = 0;  // the next free position of row b
    for (std::size_t e : rows[static_cast<std::size_t>(b)]) {
      const Example& ex = data[e];
      const std::int64_t L = std::min<std::int64_t>(static_cast<std::int64_t>(ex.tokens.size()), T + 1);
      const std::int64_t m = std::max<std::int64_t>(L - 1, 1);
      if (at + m > T) nn::detail::fail("data", "packed row ", b, " holds more than ", T, " positions");
      for (std::int64_t t = 0; t < m; ++t) {
        const std::size_t i = static_cast<std::size_t>(b * T + at + t);
        st[i] = static_cast<std::int32_t>(at);
        pos[i] = static_cast<std::int32_t>(t);
        if (t + 1 >= L) continue;  // a one-token example: no target
        in[i] = ex.tokens[static_cast<std::size_t>(t)];
        tg[i] = ex.tokens[static_cast<std::size_t>(t + 1)];
        if (ex.learned(static_cast<std::size_t>(t + 1))) {
          mk[i] = 1.0;
          ++count;
        }
      }
      at += m;
    }
    for (std::int64_t t = at; t < T; ++t) st[static_cast<std::size_t>(b * T + t)] = static_cast<std::int32_t>(t);
  }
  PackedBatch out;
  out.batch = {Tensor::from<std::int32_t>({B, T}, in), Tensor::from<std::int32_t>({B, T}, tg),
               Tensor::from_doubles({B, T}, mk, mask_dtype), count};
  out.starts = Tensor::from<std::int32_t>({B, T}, st);
  out.positions = Tensor::from<std::int32_t>({B, T}, pos);
  return out;
}

/// Batches over `data` for training: examples sorted by length and grouped (so padding is
/// small), batch order shuffled with `seed` each epoch (as mlx-lm's iterate_batches). Yields
/// index lists; pass them to make_batch.
class BatchOrder {
 public:
  BatchOrder(const std::vector<Example>& data, std::size_t batch, std::uint64_t seed) : rng_(seed) {
    if (data.size() < batch)
      nn::detail::fail("data", "the data set has ", data.size(), " examples, fewer than the batch size ", batch);
    std::vector<std::size_t> idx(data.size());
    std::iota(idx.begin(), idx.end(), 0);
    std::stable_sort(idx.begin(), idx.end(),
                     [&](std::size_t a, std::size_t b) { return data[a].tokens.size() < data[b].tokens.size(); });
    group(idx, batch);
  }
  /// Over `n` items of one length (packed rows, pack_examples): batches of consecutive indices,
  /// their order shuffled each epoch the same way.
  BatchOrder(std::size_t n, std::size_t batch, std::uint64_t seed) : rng_(seed) {
    if (n < batch) nn::detail::fail("data", "the data set packs into ", n, " rows, fewer than the batch size ", batch);
    std::vector<std::size_t> idx(n);
    std::iota(idx.begin(), idx.end(), 0);
    group(idx, batch);
  }
  /// The next batch's rows; a new shuffled epoch starts when one ends.
  const std::vector<std::size_t>& next() {
    if (pos_ == order_.size()) reshuffle();
    return batches_[order_[pos_++]];
  }
  std::size_t batches_per_epoch() const { return batches_.size(); }

 private:
  void group(const std::vector<std::size_t>& idx, std::size_t batch) {
    for (std::size_t i = 0; i + batch <= idx.size(); i += batch)
      batches_.emplace_back(idx.begin() + static_cast<std::ptrdiff_t>(i), idx.begin() + static_cast<std::ptrdiff_t>(i + batch));
    reshuffle();
  }
  void reshuffle() {
    order_.resize(batches_.size());
    std::iota(order_.begin(), order_.end(), 0);
    std::shuffle(order_.begin(), order_.end(), rng_);
    pos_ = 0;
  }
  std::vector<std::vector<std::size_t>> batches_;
  std::vector<std::size_t> order_;
  std::size_t pos_ = 0;
  std::mt19937_64 rng_;
};

}  // namespace nn::lm
