// SPDX-License-Identifier: MIT OR Apache-2.0
// BPE tokenizer from a Hugging Face tokenizer.json or from GGUF vocabulary metadata, giving the
// same ids as Hugging Face `tokenizers`: byte-level BPE (GPT-2, Qwen2, SmolLM, Llama-3 style) and
// SentencePiece-style BPE with byte fallback (Llama 2, Mistral, TinyLlama, Gemma: GGUF's "llama"
// tokenizer model).
//
// Pipeline, as in `tokenizers`: added tokens that are not normalized are split out of the raw
// text first (leftmost-longest; special ones unless parse_special is off), the normalizer (none
// or NFC) runs on each stretch left, normalized added tokens are split out of that, the
// pre-tokenizer cuts words (Split regexes, ByteLevel's GPT-2 regex, Digits, in sequence), each
// word's UTF-8 bytes become byte-level symbols merged lowest rank first (leftmost on ties), and
// the post-processor adds BOS/EOS when asked. Decoding maps byte-level characters back to bytes
// and repairs broken UTF-8 as Rust's from_utf8_lossy does.
//
// SentencePiece-style BPE (a tokenizer.json whose BPE model has byte_fallback, or a Metaspace
// pre-tokenizer): spaces become "▁" (normalizers Prepend/Replace, or Metaspace), each stretch
// between added tokens is one word (or is cut before each "▁" by a splitting Metaspace), its
// symbols are Unicode characters, and a character not in the vocabulary becomes its <0xXX> byte
// tokens (else <unk>, fused). Decoding runs the file's decoder chain (Replace, ByteFallback, Fuse,
// Strip, Metaspace) token by token, as `tokenizers` does. From GGUF ("llama" model) it is
// llama.cpp's SentencePiece algorithm instead of merges: repeatedly join the adjacent pair whose
// joined text is the best-scoring token (tokenizer.ggml.scores), leftmost on ties, after a " "
// is put before each stretch of text (add_space_prefix) and spaces become "▁"; for a model
// converted from SentencePiece this gives the ids of its tokenizer.json.
//
// Not supported, and reported as nn::Error when a file asks for it: models other than BPE,
// BPE dropout, continuing_subword_prefix / end_of_word_suffix, normalizers other than NFC /
// Prepend / Replace with a string pattern, pre-tokenizers other than ByteLevel / Split / Digits /
// WhitespaceSplit / Metaspace, and files that are neither byte-level nor SentencePiece-style.
#pragma once

#include <algorithm>
#include <array>
#include <cstddef>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <memory>
#include <mutex>
#include <optional>
#include <span>
#include <map>
#include <string>
#include <string_view>
#include <unordered_map>
#include <utility>
#include <vector>

#include <nlohmann/json.hpp>

#include "../config.hpp"
#include "json.hpp"
#include "regex.hpp"
#include "unicode.hpp"

namespace nn::lm {

/// GGUF's token types (llama.cpp's llama_token_type).
enum class TokenType : std::int32_t { undefined = 0, normal = 1, unknown = 2, control = 3, user_defined = 4, unused = 5, byte = 6 };

/// A token matched in the text before pre-tokenization (tokenizer.json "added_tokens").
struct AddedToken {
  std::string content;
  std::int32_t id = -1;
  bool special = false;      // skipped by decode(skip_special_tokens); not split when parse_special is off
  bool single_word = false;  // only matches when not inside a word
  bool lstrip = false;       // swallows the whitespace on its left
  bool rstrip = false;       // swallows the whitespace on its right
  bool normalized = false;   // matched in the normalized text rather than the raw text
};

struct EncodeOptions {
  /// Run the post-processor: BOS/EOS as tokenizer.json's post_processor (TemplateProcessing,
  /// RobertaProcessing, BertProcessing) or GGUF's add_bos/add_eos say. Hugging Face's default.
  bool add_special_tokens = true;
  /// Split special added tokens ("<|im_start|>") out of the text. Off: they are plain text, as
  /// `tokenizers`' split_special_tokens / llama.cpp's parse_special=false.
  bool parse_special = true;
};

/// The tokenizer part of GGUF metadata (tokenizer.ggml.*), as the GGUF reader hands it over.
struct GgufTokenizerData {
  std::string model = "gpt2";              // tokenizer.ggml.model: "gpt2" (byte-level BPE) or "llama" (SentencePiece)
  std::string pre;                         // tokenizer.ggml.pre: names the split regexes
  std::vector<std::string> tokens;         // tokenizer.ggml.tokens (byte-level form)
  std::vector<std::string> merges;         // tokenizer.ggml.merges ("a b")
  std::vector<std::int32_t> token_types;   // tokenizer.ggml.token_type (empty: all normal)
  std::vector<float> scores;               // tokenizer.ggml.scores ("llama": what merges first; empty: all 0)
  std::optional<std::int32_t> bos_id, eos_id, pad_id, unk_id;
  std::optional<bool> add_bos, add_eos;    // tokenizer.ggml.add_bos_token / add_eos_token
  std::optional<bool> add_space_prefix;    // tokenizer.ggml.add_space_prefix ("llama"; default true)
};

namespace detail {

/// GPT-2's reversible byte <-> printable-character table (bytes_to_unicode in GPT-2's encoder.py).
struct ByteAlphabet {
  std::array<char32_t, 256> to_char{};
  std::unordered_map<char32_t, std::uint8_t> to_byte;
  std::array<std::string, 256> utf8;  // to_char[b] encoded
  ByteAlphabet() {
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
      to_char[static_cast<std::size_t>(b)] = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
    }
    for (int b = 0; b < 256; ++b) {
      to_byte[to_char[static_cast<std::size_t>(b)]] = static_cast<std::uint8_t>(b);
      utf8_append(utf8[static_cast<std::size_t>(b)], to_char[static_cast<std::size_t>(b)]);
    }
  }
  static const ByteAlphabet& get() {
    static const ByteAlphabet a;
    return a;
  }
  /// The raw bytes a byte-level token stands for, or nullopt when a character is outside the
  /// alphabet (then the token is plain text, e.g. an added token with a space in it).
  std::optional<std::string> decode(std::string_view token) const {
    std::string out;
    std::size_t i = 0;
    while (i < token.size()) {
      auto it = to_byte.find(utf8_next(token, i));
      if (it == to_byte.end()) return std::nullopt;
      out += static_cast<char>(it->second);
    }
    return out;
  }
  std::string encode(std::string_view bytes) const {
    std::string out;
    for (unsigned char b : bytes) out += utf8[b];
    return out;
  }
};

/// Open-addressing map from a merge pair (left id, right id) to (rank, merged id): the BPE
/// inner loop looks a pair up for every adjacent pair of every word.
class PairMap {
 public:
  void reserve(std::size_t n) {
    std::size_t cap = 16;
    while (cap < n * 2) cap <<= 1;
    keys_.assign(cap, kEmpty);
    vals_.assign(cap, {});
    mask_ = cap - 1;
  }
  /// Inserts; a pair already there keeps its value unless `overwrite`.
  void insert(std::int32_t a, std::int32_t b, std::int32_t rank, std::int32_t id, bool overwrite) {
    const std::uint64_t k = key(a, b);
    for (std::size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == k) {
        if (overwrite) vals_[i] = {rank, id};
        return;
      }
      if (keys_[i] == kEmpty) {
        keys_[i] = k;
        vals_[i] = {rank, id};
        ++size_;
        return;
      }
    }
  }
  const std::pair<std::int32_t, std::int32_t>* find(std::int32_t a, std::int32_t b) const {
    if (keys_.empty()) return nullptr;
    const std::uint64_t k = key(a, b);
    for (std::size_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
      if (keys_[i] == k) return &vals_[i];
      if (keys_[i] == kEmpty) return nullptr;
    }
  }
  std::size_t size() const { return size_; }

 private:
  static constexpr std::uint64_t kEmpty = ~std::uint64_t{0};
  static std::uint64_t key(std::int32_t a, std::int32_t b) {
    return (static_cast<std::uint64_t>(static_cast<std::uint32_t>(a)) << 32) | static_cast<std::uint32_t>(b);
  }
  static std::size_t hash(std::uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    return static_cast<std::size_t>(k);
  }
  std::vector<std::uint64_t> keys_;
  std::vector<std::pair<std::int32_t, std::int32_t>> vals_;
  std::size_t mask_ = 0, size_ = 0;
};

inline std::uint64_t hash_bytes(std::string_view s) {
  std::uint64_t h = 0x9E3779B97F4A7C15ULL ^ s.size();
  std::size_t i = 0;
  for (; i + 8 <= s.size(); i += 8) {
    std::uint64_t w;
    std::memcpy(&w, s.data() + i, 8);
    h = (h ^ w) * 0xBF58476D1CE4E5B9ULL;
    h ^= h >> 31;
  }
  std::uint64_t w = 0;
  std::memcpy(&w, s.data() + i, s.size() - i);
  h = (h ^ w) * 0x94D049BB133111EBULL;
  return h ^ (h >> 29);
}

/// Word -> ids, for words seen before (text repeats its words, and BPE on a word is the costly
/// part). Open addressing over pooled keys and ids; stops growing when full.
class WordCache {
 public:
  static constexpr std::size_t kSlots = std::size_t{1} << 17;
  static constexpr std::size_t kMaxEntries = kSlots / 2;
  static constexpr std::size_t kMaxWord = 256;  // longer words are rare: not cached

  bool find(std::string_view w, std::uint64_t h, std::vector<std::int32_t>& out) const {
    if (slots_.empty()) return false;
    for (std::size_t i = h & (kSlots - 1);; i = (i + 1) & (kSlots - 1)) {
      const Slot& s = slots_[i];
      if (!s.used) return false;
      if (s.hash == h && s.key_len == w.size() && std::memcmp(keys_.data() + s.key_off, w.data(), w.size()) == 0) {
        out.insert(out.end(), vals_.begin() + s.val_off, vals_.begin() + s.val_off + s.val_len);
        return true;
      }
    }
  }
  void insert(std::string_view w, std::uint64_t h, const std::int32_t* ids, std::size_t n) {
    if (size_ >= kMaxEntries) return;
    if (slots_.empty()) slots_.resize(kSlots);
    std::size_t i = h & (kSlots - 1);
    while (slots_[i].used) i = (i + 1) & (kSlots - 1);
    slots_[i] = {h, static_cast<std::uint32_t>(keys_.size()), static_cast<std::uint32_t>(w.size()),
                 static_cast<std::uint32_t>(vals_.size()), static_cast<std::uint32_t>(n), true};
    keys_.append(w);
    vals_.insert(vals_.end(), ids, ids + n);
    ++size_;
  }

 private:
  struct Slot {
    std::uint64_t hash = 0;
    std::uint32_t key_off = 0, key_len = 0, val_off = 0, val_len = 0;
    bool used = false;
  };
  std::vector<Slot> slots_;
  std::string keys_;
  std::vector<std::int32_t> vals_;
  std::size_t size_ = 0;
};

/// Transparent hashing, so lookups by string_view allocate nothing.
struct StringHash {
  using is_transparent = void;
  std::size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
};
using StringMap = std::unordered_map<std::string, std::int32_t, StringHash, std::equal_to<>>;

/// SentencePiece's visible space, U+2581 "▁".
inline constexpr const char* kSpmSpace = "\xE2\x96\x81";

/// The byte a SentencePiece byte token ("<0x0A>") stands for, as tokenizers' ByteFallback
/// decoder reads it (either case of hex digit), or -1.
inline int spm_byte_token(std::string_view t) {
  if (t.size() != 6 || t.substr(0, 3) != "<0x" || t[5] != '>') return -1;
  auto hex = [](char c) { return c >= '0' && c <= '9' ? c - '0' : c >= 'A' && c <= 'F' ? c - 'A' + 10 : c >= 'a' && c <= 'f' ? c - 'a' + 10 : -1; };
  const int hi = hex(t[3]), lo = hex(t[4]);
  return hi < 0 || lo < 0 ? -1 : hi * 16 + lo;
}

// The split regexes: GPT-2's (ByteLevel's use_regex) and those llama.cpp applies for each
// tokenizer.ggml.pre name (src/llama-vocab.cpp), applied one after the other.
inline constexpr const char* kGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";
inline constexpr const char* kLlamaCppGpt2Regex = R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S))";
inline constexpr const char* kLlama3Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kQwen2Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kQwen35Regex =
    R"((?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kGpt4oRegex =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
inline constexpr const char* kTekkenRegex =
    R"([^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+)";

struct GgufPre {
  std::vector<std::string> regexes;
  bool ignore_merges = false;
  bool add_bos = false;
};

inline GgufPre gguf_pre(const std::string& name, const std::string& where) {
  auto is = [&](std::initializer_list<const char*> names) {
    for (const char* n : names)
      if (name == n) return true;
    return false;
  };
  if (name.empty() || name == "default")
    return {{R"([\p{P}\$\+<=>\^~\|]+)", kLlamaCppGpt2Regex, R"(\p{N}+)", "[0-9][0-9][0-9]"}, false, false};
  if (is({"llama3", "llama-v3", "llama-bpe", "falcon3", "falcon-h1", "pixtral", "midm-2.0", "lfm2", "jina-v5-nano"}))
    return {{kLlama3Regex}, true, true};
  if (is({"dbrx", "smaug-bpe"})) return {{kLlama3Regex}, false, false};
  if (is({"chatglm-bpe"})) return {{kLlama3Regex}, false, false};
  if (is({"glm4", "glm5"})) return {{kLlama3Regex}, true, false};
  if (is({"qwen2", "deepseek-r1-qwen", "kormo", "f2llmv2", "stablelm2", "hunyuan", "solar-open"}))
    return {{kQwen2Regex}, false, false};
  if (is({"qwen35"})) return {{kQwen35Regex}, false, false};
  if (is({"gpt-2", "gpt2", "phi-2", "jina-es", "jina-de", "gigachat", "jina-v2-es", "jina-v2-de", "a.x-4.0", "mellum",
          "modern-bert", "mpt", "olmo", "jais", "trillion", "granite-docling", "jina-v1-en", "jina-v2-code", "roberta-bpe"}))
    return {{kLlamaCppGpt2Regex}, false, false};
  if (is({"smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva", "mellum2"}))
    return {{R"(\p{N})", kLlamaCppGpt2Regex}, false, false};
  if (is({"falcon"}))
    return {{R"([\p{P}\$\+<=>\^~\|`]+)", kLlamaCppGpt2Regex, "[0-9][0-9][0-9]"}, false, false};
  if (is({"deepseek-coder"}))
    return {{"[\r\n]", R"(\s?\p{L}+)", R"(\s?\p{P}+)", "[一-龥ࠀ-一가-퟿]+", R"(\p{N})"}, false, false};
  if (is({"deepseek-v3"}))
    return {{R"(\p{N}{1,3})", "[一-龥぀-ゟ゠-ヿ]+",
             R"([!"#$%&'()*+,\-./:;<=>?@\[\\\]^_`{|}~][A-Za-z]+|[^\r\n\p{L}\p{P}\p{S}]?[\p{L}\p{M}]+| ?[\p{P}\p{S}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)"},
            false, false};
  if (is({"poro-chat", "bloom", "gpt3-finnish"})) return {{R"( ?[^(\s|.,!?…。，、।۔،)]+)"}, false, false};
  if (is({"viking"})) return {{R"( ?[^(\s|.,!?…。，、।۔،)]+)", R"(\p{N})"}, false, false};
  if (is({"tekken"})) return {{kTekkenRegex}, true, true};
  if (is({"gpt-4o", "gpt4o", "minimax-m2"})) return {{kGpt4oRegex}, false, false};
  nn::detail::fail(where, "tokenizer.ggml.pre: unsupported pre-tokenizer '", name,
                   "' (supported: default, gpt-2, llama-bpe/llama3, qwen2, qwen35, smollm/starcoder, dbrx, falcon, "
                   "deepseek-coder, deepseek-v3, chatglm-bpe, glm4, bloom, viking, tekken, gpt-4o and their aliases)");
}

}  // namespace detail

class Tokenizer {
 public:
  Tokenizer() = default;

  /// Loads a Hugging Face tokenizer.json. bos/eos/pad/unk ids come from a tokenizer_config.json
  /// in the same folder when there is one (`config_path` overrides where to look), else from the
  /// post-processor (BOS) and model.unk_token.
  static Tokenizer from_file(const std::string& path, const std::string& config_path = "") {
    Tokenizer t = from_json(detail::read_json_file(path, "tokenizer"), path);
    std::filesystem::path cfg = config_path.empty()
                                    ? std::filesystem::path(path).parent_path() / "tokenizer_config.json"
                                    : std::filesystem::path(config_path);
    std::error_code ec;
    if (std::filesystem::exists(cfg, ec)) t.load_config_file(cfg.string());
    else if (!config_path.empty()) nn::detail::fail(config_path, "cannot open tokenizer config");
    return t;
  }

  /// From the parsed JSON of a tokenizer.json; `source` names it in errors.
  static Tokenizer from_json(const nlohmann::json& j, const std::string& source = "tokenizer.json") {
    Tokenizer t;
    t.source_ = source;
    t.load_json(j);
    return t;
  }

  /// From the tokenizer.ggml.* metadata of a GGUF file (llama.cpp's "gpt2" and "llama" tokenizer models).
  static Tokenizer from_gguf(const GgufTokenizerData& d, const std::string& source = "gguf") {
    Tokenizer t;
    t.source_ = source;
    t.load_gguf(d);
    return t;
  }

  /// The same from any struct with GgufTokenizerData's field names, ids of any integer width:
  /// gguf.hpp's GgufTokenizerMetadata (from GgufFile::tokenizer()) goes straight in, and this
  /// header need not include the GGUF reader.
  template <class Meta>
  static Tokenizer from_gguf_metadata(const Meta& m, const std::string& source = "gguf") {
    GgufTokenizerData d;
    d.model = m.model;
    d.pre = m.pre;
    d.tokens = m.tokens;
    d.merges = m.merges;
    d.token_types.assign(m.token_types.begin(), m.token_types.end());
    if constexpr (requires { m.scores; }) d.scores.assign(m.scores.begin(), m.scores.end());  // SentencePiece fields: optional
    if constexpr (requires { m.add_space_prefix; }) d.add_space_prefix = m.add_space_prefix;
    auto id = [&](const auto& v, const char* field) -> std::optional<std::int32_t> {
      if (!v) return std::nullopt;
      if (*v < 0 || *v > INT32_MAX) nn::detail::fail(source, field, ": id ", *v, " is out of range");
      return static_cast<std::int32_t>(*v);
    };
    d.bos_id = id(m.bos_id, "tokenizer.ggml.bos_token_id");
    d.eos_id = id(m.eos_id, "tokenizer.ggml.eos_token_id");
    d.pad_id = id(m.pad_id, "tokenizer.ggml.padding_token_id");
    d.unk_id = id(m.unk_id, "tokenizer.ggml.unknown_token_id");
    d.add_bos = m.add_bos;
    d.add_eos = m.add_eos;
    return from_gguf(d, source);
  }

  /// Reads bos/eos/pad/unk tokens from a transformers tokenizer_config.json (strings or
  /// {"content": ...} objects); tokens not in the vocabulary are an error naming the field.
  void load_config_file(const std::string& path) {
    const nlohmann::json j = detail::read_json_file(path, "tokenizer");
    auto read = [&](const char* field, std::optional<std::int32_t>& out) {
      auto it = j.find(field);
      if (it == j.end() || it->is_null()) return;
      std::string content;
      if (it->is_string()) content = it->get<std::string>();
      else if (it->is_object() && it->contains("content") && (*it)["content"].is_string()) content = (*it)["content"].get<std::string>();
      else nn::detail::fail(path, field, ": expected a string or an object with \"content\"");
      auto id = token_to_id(content);
      if (!id) nn::detail::fail(path, field, ": token '", content, "' is not in the vocabulary");
      out = *id;
    };
    read("bos_token", bos_id_);
    read("eos_token", eos_id_);
    read("pad_token", pad_id_);
    read("unk_token", unk_token_id_);
  }

  // ---- encoding ------------------------------------------------------------------------------

  std::vector<std::int32_t> encode(std::string_view text, const EncodeOptions& opt = {}) const {
    std::vector<std::int32_t> out;
    out.reserve(text.size() / 3 + 4);
    std::unique_lock<std::mutex> lock(cache_.p->mu, std::try_to_lock);
    detail::WordCache* cache = lock.owns_lock() ? &cache_.p->words : nullptr;
    if (opt.add_special_tokens) out.insert(out.end(), prefix_.begin(), prefix_.end());
    // Pass 1 on the raw text: added tokens that are not normalized (special ones only when
    // parse_special); pass 2 on each normalized remainder: the normalized added tokens.
    split_added(text, raw_added_, opt.parse_special, [&](std::string_view seg, std::int32_t id) {
      if (id >= 0) {
        out.push_back(id);
        return;
      }
      std::string norm;
      std::string_view ns = seg;
      if (!norms_.empty()) {
        norm = normalize(seg);
        ns = norm;
      }
      // Metaspace's prepend_scheme "first" looks at where the piece starts in the input.
      const bool seg_first = seg.data() == text.data();
      split_added(ns, norm_added_, opt.parse_special, [&](std::string_view s2, std::int32_t id2) {
        if (id2 >= 0) out.push_back(id2);
        else for_each_word(s2, seg_first && s2.data() == ns.data(), [&](std::string_view w) { encode_word(w, out, cache); });
      });
    });
    if (opt.add_special_tokens) out.insert(out.end(), suffix_.begin(), suffix_.end());
    return out;
  }

  /// The pre-tokenizer's words for `text` (normalized first; added tokens are not split out):
  /// what Hugging Face's pre_tokenizer.pre_tokenize_str gives after the normalizer.
  std::vector<std::string> pre_tokenize(std::string_view text) const {
    std::string norm = normalize(text);
    std::vector<std::string> words;
    for_each_word(norm, true, [&](std::string_view w) { words.emplace_back(w); });
    return words;
  }

  // ---- decoding ------------------------------------------------------------------------------

  /// The raw bytes the ids stand for (may end inside a UTF-8 sequence: see
  /// utf8_complete_prefix for streaming). Throws nn::Error on an id outside the vocabulary.
  /// SentencePiece-style: "▁" is a space and <0xXX> its byte; no leading space is stripped.
  std::string decode_bytes(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const {
    std::string out;
    for (std::int32_t id : ids) {
      check_id(id, "decode");
      if (skip_special_tokens && is_special_[static_cast<std::size_t>(id)]) continue;
      out += id_bytes_[static_cast<std::size_t>(id)];
    }
    return out;
  }

  /// Text for the ids; invalid UTF-8 (a sequence cut by the ids chosen) becomes U+FFFD, as in
  /// Hugging Face's decode. skip_special_tokens drops added tokens marked special.
  /// SentencePiece-style: the decoder chain, so also the leading space Strip removes.
  std::string decode(std::span<const std::int32_t> ids, bool skip_special_tokens = false) const {
    if (!spm_) return utf8_lossy(decode_bytes(ids, skip_special_tokens));
    std::vector<std::string> toks;
    toks.reserve(ids.size());
    for (std::int32_t id : ids) {
      check_id(id, "decode");
      if (skip_special_tokens && is_special_[static_cast<std::size_t>(id)]) continue;
      toks.push_back(id_to_token_[static_cast<std::size_t>(id)]);
    }
    for (const DecStep& d : decoders_) run_decoder(d, toks);
    std::string out;
    for (const auto& t : toks) out += t;
    return out;
  }
  std::string decode(const std::vector<std::int32_t>& ids, bool skip_special_tokens = false) const {
    return decode(std::span<const std::int32_t>(ids), skip_special_tokens);
  }

  // ---- vocabulary ----------------------------------------------------------------------------

  /// Id of a token in its vocabulary form ("Ġhello", "<|im_start|>"), or nullopt.
  std::optional<std::int32_t> token_to_id(std::string_view token) const {
    auto it = token_to_id_.find(token);
    if (it == token_to_id_.end()) return std::nullopt;
    return it->second;
  }
  /// The vocabulary form of token `id`.
  const std::string& id_to_token(std::int32_t id) const {
    check_id(id, "id_to_token");
    return id_to_token_[static_cast<std::size_t>(id)];
  }
  /// One past the largest id (model vocabulary and added tokens).
  std::size_t vocab_size() const { return id_to_token_.size(); }
  bool is_special(std::int32_t id) const {
    return id >= 0 && static_cast<std::size_t>(id) < is_special_.size() && is_special_[static_cast<std::size_t>(id)];
  }
  const std::vector<AddedToken>& added_tokens() const { return added_; }
  std::size_t merges_size() const { return merges_.size(); }

  std::optional<std::int32_t> bos_id() const { return bos_id_; }
  std::optional<std::int32_t> eos_id() const { return eos_id_; }
  std::optional<std::int32_t> pad_id() const { return pad_id_; }
  std::optional<std::int32_t> unk_id() const { return unk_token_id_; }
  void set_bos_id(std::optional<std::int32_t> id) { bos_id_ = id; }
  void set_eos_id(std::optional<std::int32_t> id) { eos_id_ = id; }
  void set_pad_id(std::optional<std::int32_t> id) { pad_id_ = id; }

  /// SentencePiece-style BPE (GGUF's "llama" tokenizer model): characters as symbols, "▁" for
  /// spaces, byte fallback. False for byte-level BPE.
  bool sentencepiece() const { return spm_; }
  /// SentencePiece-style and puts a "▁" before the text (a Prepend normalizer or Metaspace's
  /// prepend scheme): GGUF's add_space_prefix.
  bool space_prefix() const {
    if (!spm_) return false;
    if (metaspace_) return metaspace_->scheme != Metaspace::never;
    return std::any_of(norms_.begin(), norms_.end(), [](const NormStep& n) { return n.kind == NormStep::prepend && n.a == detail::kSpmSpace; });
  }

  /// Ids the post-processor puts before / after a single sequence.
  const std::vector<std::int32_t>& prefix_ids() const { return prefix_; }
  const std::vector<std::int32_t>& suffix_ids() const { return suffix_; }
  const std::string& source() const { return source_; }

 private:
  enum class Behavior { removed, isolated, merged_with_previous, merged_with_next, contiguous };
  struct PreStep {
    enum Kind { split, byte_level, digits } kind = split;
    std::shared_ptr<const detail::Regex> re;  // split; byte_level with use_regex
    Behavior behavior = Behavior::isolated;
    bool invert = false;
    bool individual_digits = false;
  };
  // Normalizer steps, in order (tokenizers' NFC, Prepend, Replace with a String pattern).
  struct NormStep {
    enum Kind { nfc, prepend, replace } kind = nfc;
    std::string a, b;  // prepend: a; replace: a -> b
  };
  // The Metaspace pre-tokenizer: spaces become `replacement`, which is put in front as the
  // scheme says (not when the piece already starts with it), and words are cut before each one
  // when `split`.
  struct Metaspace {
    std::string replacement = detail::kSpmSpace;
    enum Scheme { always, first, never } scheme = always;
    bool split = true;
  };
  // Decoder steps (SentencePiece-style files), run on the token strings in order.
  struct DecStep {
    enum Kind { replace, byte_fallback, fuse, strip, metaspace } kind = fuse;
    std::string a, b;  // replace: a -> b; strip: a is the character; metaspace: a is the replacement
    std::size_t start = 0, stop = 0;
    bool prepend = true;  // metaspace: its prepend_scheme is not "never"
  };
  struct AddedSet {
    std::vector<AddedToken> toks;                         // longest first
    std::array<std::vector<std::uint32_t>, 256> by_first;  // indices into toks by first byte
  };
  // The word cache is taken for a whole encode() with try_lock: no lock per word, and a
  // thread that finds it busy (another thread encoding with the same tokenizer) encodes
  // without it rather than waiting. A copy of the tokenizer gets its own, empty cache, so one
  // copy per thread encodes in parallel at full speed.
  struct Cache {
    std::mutex mu;
    detail::WordCache words;
  };
  struct CacheHolder {
    std::unique_ptr<Cache> p = std::make_unique<Cache>();
    CacheHolder() = default;
    CacheHolder(const CacheHolder&) : p(std::make_unique<Cache>()) {}
    CacheHolder& operator=(const CacheHolder&) {
      p = std::make_unique<Cache>();
      return *this;
    }
    CacheHolder(CacheHolder&&) noexcept = default;
    CacheHolder& operator=(CacheHolder&&) noexcept = default;
  };

  [[noreturn]] void fail(const std::string& field, const std::string& msg) const {
    nn::detail::fail(source_, field, ": ", msg);
  }
  void check_id(std::int32_t id, const char* op) const {
    if (id < 0 || static_cast<std::size_t>(id) >= id_to_token_.size() || !valid_[static_cast<std::size_t>(id)])
      nn::detail::fail(op, "token id ", id, " is not in the vocabulary of ", source_, " (size ", id_to_token_.size(), ")");
  }

  // ---- loading -------------------------------------------------------------------------------

  // Ids may leave gaps (a trimmed vocabulary keeps its added tokens' ids), but the tables are
  // indexed by id: an id this far past the tokens given would allocate gigabytes for nothing.
  static constexpr std::size_t kMaxIdGap = std::size_t{1} << 20;

  void set_token(std::int32_t id, const std::string& tok) {
    if (id < 0) fail("vocab", "negative id for token '" + tok + "'");
    if (static_cast<std::size_t>(id) >= token_to_id_.size() + kMaxIdGap)
      fail("vocab", "id " + std::to_string(id) + " of token '" + tok + "' lies more than 2^20 past the " +
                        std::to_string(token_to_id_.size()) + " tokens read so far (ids this sparse are refused)");
    if (static_cast<std::size_t>(id) >= id_to_token_.size()) {
      id_to_token_.resize(static_cast<std::size_t>(id) + 1);
      valid_.resize(static_cast<std::size_t>(id) + 1, false);
    }
    id_to_token_[static_cast<std::size_t>(id)] = tok;
    valid_[static_cast<std::size_t>(id)] = true;
    token_to_id_[tok] = id;
  }

  /// A pair listed twice: tokenizer.json keeps the last rank (`tokenizers` collects the merges
  /// into a map), GGUF the first (llama.cpp's emplace); `last_wins` picks which.
  void add_merge(const std::string& a, const std::string& b, std::size_t rank, const std::string& field, bool last_wins) {
    auto ia = model_vocab_.find(a);
    if (ia == model_vocab_.end()) fail(field, "token '" + a + "' is not in the vocabulary");
    auto ib = model_vocab_.find(b);
    if (ib == model_vocab_.end()) fail(field, "token '" + b + "' is not in the vocabulary");
    auto im = model_vocab_.find(a + b);
    if (im == model_vocab_.end()) fail(field, "merged token '" + a + b + "' is not in the vocabulary");
    merges_.insert(ia->second, ib->second, static_cast<std::int32_t>(rank), im->second, last_wins);
  }

  void finish() {
    const auto& alpha = detail::ByteAlphabet::get();
    byte_id_.fill(-1);
    for (int b = 0; b < 256; ++b) {
      // Byte-level: the byte's printable character; SentencePiece: its <0xXX> byte token.
      char buf[8];
      std::snprintf(buf, sizeof buf, "<0x%02X>", b);
      const std::string key = spm_ ? std::string(buf) : alpha.utf8[static_cast<std::size_t>(b)];
      const detail::StringMap& vocab = spm_scores_ ? token_to_id_ : model_vocab_;
      auto it = vocab.find(key);
      if (it != vocab.end()) byte_id_[static_cast<std::size_t>(b)] = it->second;
    }
    is_special_.assign(id_to_token_.size(), false);
    for (const auto& a : added_)
      if (a.special) is_special_[static_cast<std::size_t>(a.id)] = true;
    id_bytes_.assign(id_to_token_.size(), std::string());
    for (std::size_t i = 0; i < id_to_token_.size(); ++i) {
      if (!valid_[i]) continue;
      if (spm_) {  // "▁" is a space, a byte token its byte
        const int b = detail::spm_byte_token(id_to_token_[i]);
        id_bytes_[i] = b >= 0 ? std::string(1, static_cast<char>(b)) : replace_all(id_to_token_[i], detail::kSpmSpace, " ");
        continue;
      }
      // The ByteLevel decoder: tokens made of byte-level characters are bytes; any other token
      // (an added token with a space, say) is its own UTF-8 text.
      auto bytes = alpha.decode(id_to_token_[i]);
      id_bytes_[i] = bytes ? std::move(*bytes) : id_to_token_[i];
    }
    if (ignore_merges_) {  // keyed by the word as bpe() receives it
      raw_vocab_.clear();
      for (const auto& [tok, id] : model_vocab_)
        if (spm_) raw_vocab_.emplace(tok, id);
        else if (auto bytes = alpha.decode(tok)) raw_vocab_.emplace(std::move(*bytes), id);
    }
    raw_added_ = AddedSet{};
    norm_added_ = AddedSet{};
    for (const auto& a : added_) {
      if (a.content.empty()) continue;
      (a.normalized && !norms_.empty() ? norm_added_ : raw_added_).toks.push_back(a);
    }
    for (AddedSet* set : {&raw_added_, &norm_added_}) {
      // Longest first, so the first candidate that matches at a position is the longest one.
      std::stable_sort(set->toks.begin(), set->toks.end(),
                       [](const AddedToken& x, const AddedToken& y) { return x.content.size() > y.content.size(); });
      for (std::size_t i = 0; i < set->toks.size(); ++i)
        set->by_first[static_cast<unsigned char>(set->toks[i].content[0])].push_back(static_cast<std::uint32_t>(i));
    }
    cache_ = CacheHolder{};
  }

  static const nlohmann::json* member(const nlohmann::json& j, const char* key) {
    if (!j.is_object()) return nullptr;
    auto it = j.find(key);
    return it == j.end() || it->is_null() ? nullptr : &*it;
  }

  void load_json(const nlohmann::json& j) {
    if (!j.is_object()) fail("(root)", "expected a JSON object");
    const nlohmann::json* model = member(j, "model");
    if (!model) fail("model", "missing");
    if (!model->is_object()) fail("model", "expected an object");
    if (const auto* type = member(*model, "type")) {
      if (!type->is_string()) fail("model.type", "expected a string");
      if (type->get<std::string>() != "BPE")
        fail("model.type", "unsupported tokenizer model '" + type->get<std::string>() + "' (only byte-level BPE)");
    }
    const nlohmann::json* vocab = member(*model, "vocab");
    if (!vocab) fail("model.vocab", "missing");
    if (!vocab->is_object()) fail("model.vocab", "expected an object mapping token to id");
    const nlohmann::json* merges = member(*model, "merges");
    if (!merges) fail("model.merges", "missing");
    if (!merges->is_array()) fail("model.merges", "expected an array");
    if (const auto* p = member(*model, "continuing_subword_prefix"); p && p->is_string() && !p->get<std::string>().empty())
      fail("model.continuing_subword_prefix", "not supported by byte-level BPE");
    if (const auto* p = member(*model, "end_of_word_suffix"); p && p->is_string() && !p->get<std::string>().empty())
      fail("model.end_of_word_suffix", "not supported by byte-level BPE");
    if (const auto* p = member(*model, "dropout"); p && p->is_number() && p->get<double>() > 0)
      fail("model.dropout", "BPE dropout is not supported (the tokenizer is deterministic)");
    if (const auto* p = member(*model, "ignore_merges")) ignore_merges_ = p->is_boolean() && p->get<bool>();
    if (const auto* p = member(*model, "fuse_unk")) fuse_unk_ = p->is_boolean() && p->get<bool>();
    if (const auto* p = member(*model, "byte_fallback")) byte_fallback_ = p->is_boolean() && p->get<bool>();

    token_to_id_.reserve(vocab->size() + 64);
    model_vocab_.reserve(vocab->size());
    id_to_token_.reserve(vocab->size() + 64);
    for (auto it = vocab->begin(); it != vocab->end(); ++it) {
      if (!it.value().is_number_integer()) fail("model.vocab", "id of token '" + it.key() + "' is not an integer");
      const auto id = it.value().get<std::int64_t>();
      if (id < 0 || id > INT32_MAX) fail("model.vocab", "id of token '" + it.key() + "' is out of range");
      set_token(static_cast<std::int32_t>(id), it.key());
      model_vocab_[it.key()] = static_cast<std::int32_t>(id);
    }
    merges_.reserve(merges->size());
    for (std::size_t r = 0; r < merges->size(); ++r) {
      const auto& m = (*merges)[r];
      const std::string field = "model.merges[" + std::to_string(r) + "]";
      if (m.is_string()) {  // "a b": older files
        const std::string s = m.get<std::string>();
        const auto sp = s.find(' ');
        if (sp == std::string::npos || s.find(' ', sp + 1) != std::string::npos)
          fail(field, "expected \"left right\", got \"" + s + "\"");
        add_merge(s.substr(0, sp), s.substr(sp + 1), r, field, true);
      } else if (m.is_array() && m.size() == 2 && m[0].is_string() && m[1].is_string()) {  // ["a", "b"]
        add_merge(m[0].get<std::string>(), m[1].get<std::string>(), r, field, true);
      } else {
        fail(field, "expected \"left right\" or [\"left\", \"right\"]");
      }
    }
    if (const auto* u = member(*model, "unk_token")) {
      if (!u->is_string()) fail("model.unk_token", "expected a string");
      auto it = model_vocab_.find(u->get<std::string>());
      if (it == model_vocab_.end()) fail("model.unk_token", "token '" + u->get<std::string>() + "' is not in the vocabulary");
      unk_token_id_ = it->second;
    }

    if (const auto* added = member(j, "added_tokens")) {
      if (!added->is_array()) fail("added_tokens", "expected an array");
      std::map<std::int32_t, std::size_t> added_ids;  // id -> its entry, so a repeat is named
      for (std::size_t i = 0; i < added->size(); ++i) {
        const auto& a = (*added)[i];
        const std::string field = "added_tokens[" + std::to_string(i) + "]";
        if (!a.is_object() || !member(a, "id") || !member(a, "content") || !a["id"].is_number_integer() || !a["content"].is_string())
          fail(field, "expected an object with integer \"id\" and string \"content\"");
        AddedToken t;
        t.content = a["content"].get<std::string>();
        const auto id = a["id"].get<std::int64_t>();
        if (id < 0 || id > INT32_MAX) fail(field + ".id", "id " + std::to_string(id) + " is out of range");
        t.id = static_cast<std::int32_t>(id);
        if (t.content.empty()) fail(field + ".content", "an added token cannot be empty");
        if (auto [it, fresh] = added_ids.emplace(t.id, i); !fresh)
          fail(field + ".id", "id " + std::to_string(id) + " is also added_tokens[" + std::to_string(it->second) + "]'s");
        auto flag = [&](const char* k, bool dflt) {
          const auto* v = member(a, k);
          return v && v->is_boolean() ? v->get<bool>() : dflt;
        };
        t.special = flag("special", false);
        t.single_word = flag("single_word", false);
        t.lstrip = flag("lstrip", false);
        t.rstrip = flag("rstrip", false);
        t.normalized = flag("normalized", !t.special);
        set_token(t.id, t.content);
        added_.push_back(std::move(t));
      }
    }

    load_normalizer(member(j, "normalizer"), "normalizer");
    if (const auto* pre = member(j, "pre_tokenizer")) load_pre(*pre, "pre_tokenizer");
    // SentencePiece-style: characters as symbols, spaces as "▁" (by the normalizer or Metaspace).
    const bool spaces_replaced = std::any_of(norms_.begin(), norms_.end(), [](const NormStep& n) {
      return n.kind == NormStep::replace && n.a == " " && n.b == detail::kSpmSpace;
    });
    spm_ = !byte_level_ && (byte_fallback_ || metaspace_ || spaces_replaced);
    if (!byte_level_ && !spm_)
      fail("pre_tokenizer", "neither byte-level BPE (a ByteLevel pre-tokenizer) nor SentencePiece-style BPE (model.byte_fallback, "
                            "a Metaspace pre-tokenizer or a \" \" -> \"\u2581\" normalizer): not supported");
    if (byte_level_ && byte_fallback_) fail("model.byte_fallback", "byte fallback with a ByteLevel pre-tokenizer is not supported");
    if (const auto* dec = member(j, "decoder")) load_decoder(*dec, "decoder");
    if (const auto* post = member(j, "post_processor")) load_post(*post, "post_processor");
    if (!prefix_.empty() && !bos_id_) bos_id_ = prefix_.front();
    finish();
  }

  void load_normalizer(const nlohmann::json* n, const std::string& field) {
    if (!n) return;
    const auto* type = member(*n, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (t == "NFC") {
      norms_.push_back({NormStep::nfc, {}, {}});
    } else if (t == "Prepend") {
      const auto* a = member(*n, "prepend");
      if (!a || !a->is_string()) fail(field + ".prepend", "expected a string");
      norms_.push_back({NormStep::prepend, a->get<std::string>(), {}});
    } else if (t == "Replace") {
      norms_.push_back({NormStep::replace, string_pattern(*n, field), replacement_of(*n, field)});
    } else if (t == "Sequence") {
      const auto* list = member(*n, "normalizers");
      if (!list || !list->is_array()) fail(field + ".normalizers", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i)
        load_normalizer(&(*list)[i], field + ".normalizers[" + std::to_string(i) + "]");
    } else {
      fail(field + ".type", "unsupported normalizer '" + t + "' (supported: NFC, Prepend, Replace, Sequence)");
    }
  }

  // Replace's {"String": ...} pattern (a Regex pattern is not supported) and its content.
  std::string string_pattern(const nlohmann::json& n, const std::string& field) const {
    const auto* pat = member(n, "pattern");
    const auto* st = pat ? member(*pat, "String") : nullptr;
    if (!st || !st->is_string()) fail(field + ".pattern", "expected {\"String\": ...} (a Regex pattern is not supported)");
    if (st->get<std::string>().empty()) fail(field + ".pattern", "an empty pattern");
    return st->get<std::string>();
  }
  std::string replacement_of(const nlohmann::json& n, const std::string& field) const {
    const auto* c = member(n, "content");
    if (!c || !c->is_string()) fail(field + ".content", "expected a string");
    return c->get<std::string>();
  }

  // Metaspace's fields, from a pre-tokenizer or a decoder (older files: add_prefix_space).
  Metaspace metaspace_of(const nlohmann::json& p, const std::string& field) const {
    Metaspace m;
    if (const auto* r = member(p, "replacement")) {
      if (!r->is_string() || r->get<std::string>().empty()) fail(field + ".replacement", "expected a character");
      m.replacement = r->get<std::string>();
    }
    if (const auto* sc = member(p, "prepend_scheme")) {
      const std::string v = sc->is_string() ? sc->get<std::string>() : "";
      if (v == "always") m.scheme = Metaspace::always;
      else if (v == "first") m.scheme = Metaspace::first;
      else if (v == "never") m.scheme = Metaspace::never;
      else fail(field + ".prepend_scheme", "expected \"always\", \"first\" or \"never\"");
    } else if (const auto* a = member(p, "add_prefix_space"); a && a->is_boolean()) {
      m.scheme = a->get<bool>() ? Metaspace::always : Metaspace::never;
    }
    if (const auto* sp = member(p, "split"); sp && sp->is_boolean()) m.split = sp->get<bool>();
    return m;
  }

  static Behavior parse_behavior(const std::string& s, bool& ok) {
    ok = true;
    std::string l;
    for (char c : s) l += static_cast<char>(c >= 'A' && c <= 'Z' ? c + 32 : c);
    if (l == "removed") return Behavior::removed;
    if (l == "isolated") return Behavior::isolated;
    if (l == "mergedwithprevious") return Behavior::merged_with_previous;
    if (l == "mergedwithnext") return Behavior::merged_with_next;
    if (l == "contiguous") return Behavior::contiguous;
    ok = false;
    return Behavior::isolated;
  }

  static std::string regex_escape(const std::string& s) {
    std::string out;
    for (char c : s) {
      if (std::string_view("\\^$.|?*+()[]{}").find(c) != std::string_view::npos) out += '\\';
      out += c;
    }
    return out;
  }

  void load_pre(const nlohmann::json& p, const std::string& field) {
    const auto* type = member(p, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (byte_level_) fail(field, "a pre-tokenizer after ByteLevel is not supported");
    if (t == "Sequence") {
      const auto* list = member(p, "pretokenizers");
      if (!list || !list->is_array()) fail(field + ".pretokenizers", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i) load_pre((*list)[i], field + ".pretokenizers[" + std::to_string(i) + "]");
      return;
    }
    if (t == "Metaspace") {
      if (!steps_.empty() || metaspace_) fail(field, "Metaspace is only supported as the first pre-tokenizer");
      metaspace_ = metaspace_of(p, field);
      return;
    }
    PreStep s;
    if (t == "ByteLevel") {
      if (metaspace_) fail(field, "ByteLevel after Metaspace is not supported");
      byte_level_ = true;
      if (const auto* a = member(p, "add_prefix_space"); a && a->is_boolean() && a->get<bool>()) {
        if (!steps_.empty()) fail(field + ".add_prefix_space", "only supported when ByteLevel is the first pre-tokenizer");
        add_prefix_space_ = true;
      }
      const auto* u = member(p, "use_regex");
      if (u && u->is_boolean() && !u->get<bool>()) return;
      s.kind = PreStep::byte_level;
      s.re = std::make_shared<detail::Regex>(detail::kGpt2Regex, source_);
    } else if (t == "Split") {
      const auto* pat = member(p, "pattern");
      if (!pat || !pat->is_object()) fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      std::string re;
      if (const auto* r = member(*pat, "Regex"); r && r->is_string()) re = r->get<std::string>();
      else if (const auto* st = member(*pat, "String"); st && st->is_string()) re = regex_escape(st->get<std::string>());
      else fail(field + ".pattern", "expected {\"Regex\": ...} or {\"String\": ...}");
      s.re = std::make_shared<detail::Regex>(re, source_ + ": " + field + ".pattern");
      bool ok = false;
      const auto* b = member(p, "behavior");
      s.behavior = parse_behavior(b && b->is_string() ? b->get<std::string>() : "", ok);
      if (!ok) fail(field + ".behavior", "unknown split behavior");
      if (const auto* inv = member(p, "invert")) s.invert = inv->is_boolean() && inv->get<bool>();
    } else if (t == "Digits") {
      s.kind = PreStep::digits;
      if (const auto* d = member(p, "individual_digits")) s.individual_digits = d->is_boolean() && d->get<bool>();
    } else if (t == "WhitespaceSplit") {  // Rust's char::is_whitespace is White_Space, as \s
      s.re = std::make_shared<detail::Regex>(R"(\s+)", source_);
      s.behavior = Behavior::removed;
    } else {
      // Whitespace and Punctuation are left out on purpose: `tokenizers` implements them with
      // its own character classes (older Unicode data, ZWJ as a word character), which no
      // byte-level BPE uses; a near miss would give wrong ids silently.
      fail(field + ".type", "unsupported pre-tokenizer '" + t + "'");
    }
    steps_.push_back(std::move(s));
  }

  // Byte-level files decode with ByteLevel only (the byte table); SentencePiece-style files with
  // a chain of Replace / ByteFallback / Fuse / Strip / Metaspace, kept in decoders_.
  void load_decoder(const nlohmann::json& d, const std::string& field) {
    const auto* type = member(d, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (t == "Sequence") {
      const auto* list = member(d, "decoders");
      if (!list || !list->is_array()) fail(field + ".decoders", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i) load_decoder((*list)[i], field + ".decoders[" + std::to_string(i) + "]");
      return;
    }
    if (byte_level_) {
      if (t == "ByteLevel") return;
      fail(field + ".type", "unsupported decoder '" + t + "' (byte-level BPE decodes with ByteLevel)");
    }
    DecStep s;
    if (t == "Replace") {
      s = {DecStep::replace, string_pattern(d, field), replacement_of(d, field)};
    } else if (t == "ByteFallback") {
      s.kind = DecStep::byte_fallback;
    } else if (t == "Fuse") {
      s.kind = DecStep::fuse;
    } else if (t == "Strip") {
      s.kind = DecStep::strip;
      const auto* c = member(d, "content");
      if (!c || !c->is_string()) fail(field + ".content", "expected a character");
      s.a = c->get<std::string>();
      std::size_t at = 0;
      if (s.a.empty() || (utf8_next(s.a, at), at != s.a.size())) fail(field + ".content", "expected one character");
      for (auto [key, dst] : {std::pair{"start", &s.start}, std::pair{"stop", &s.stop}}) {
        const auto* v = member(d, key);
        if (v && (!v->is_number_unsigned() && !(v->is_number_integer() && v->get<std::int64_t>() >= 0)))
          fail(field + "." + key, "expected a count");
        if (v) *dst = v->get<std::size_t>();
      }
    } else if (t == "Metaspace") {
      const Metaspace m = metaspace_of(d, field);
      s.kind = DecStep::metaspace;
      s.a = m.replacement;
      s.prepend = m.scheme != Metaspace::never;
    } else {
      fail(field + ".type", "unsupported decoder '" + t + "' (SentencePiece-style BPE: Replace, ByteFallback, Fuse, Strip, Metaspace)");
    }
    decoders_.push_back(std::move(s));
  }

  /// One decoder over the token strings, as `tokenizers`' decode_chain does it.
  void run_decoder(const DecStep& d, std::vector<std::string>& toks) const {
    switch (d.kind) {
      case DecStep::replace:
        for (auto& t : toks) t = replace_all(t, d.a, d.b);
        break;
      case DecStep::byte_fallback: {
        // A run of byte tokens becomes its bytes if they are valid UTF-8, else one U+FFFD per byte.
        std::vector<std::string> out;
        std::string run;
        std::size_t run_n = 0;
        auto flush = [&] {
          if (run_n == 0) return;
          if (utf8_lossy(run) == run) out.push_back(run);
          else for (std::size_t k = 0; k < run_n; ++k) out.emplace_back("\xEF\xBF\xBD");
          run.clear();
          run_n = 0;
        };
        for (auto& t : toks) {
          const int b = detail::spm_byte_token(t);
          if (b >= 0) {
            run += static_cast<char>(b);
            ++run_n;
          } else {
            flush();
            out.push_back(std::move(t));
          }
        }
        flush();
        toks = std::move(out);
        break;
      }
      case DecStep::fuse: {
        std::string all;
        for (const auto& t : toks) all += t;
        toks.assign(1, std::move(all));
        break;
      }
      case DecStep::strip:
        for (auto& t : toks) {
          std::size_t b = 0, e = t.size();
          for (std::size_t k = 0; k < d.start && t.compare(b, d.a.size(), d.a) == 0 && b < e; ++k) b += d.a.size();
          for (std::size_t k = 0; k < d.stop && e >= b + d.a.size() && t.compare(e - d.a.size(), d.a.size(), d.a) == 0; ++k)
            e -= d.a.size();
          t = t.substr(b, e - b);
        }
        break;
      case DecStep::metaspace:
        // The replacement is a space, except in the first token, where it is dropped (the
        // prefix the pre-tokenizer put there) unless the scheme is "never".
        for (std::size_t i = 0; i < toks.size(); ++i) toks[i] = replace_all(toks[i], d.a, i == 0 && d.prepend ? "" : " ");
        break;
    }
  }

  static std::string replace_all(std::string_view s, std::string_view from, std::string_view to) {
    std::string out;
    out.reserve(s.size());
    for (std::size_t i = 0;;) {
      const std::size_t k = s.find(from, i);
      if (k == std::string_view::npos) {
        out.append(s.substr(i));
        return out;
      }
      out.append(s.substr(i, k - i));
      out.append(to);
      i = k + from.size();
    }
  }

  std::string normalize(std::string_view seg) const {
    std::string s(seg);
    for (const NormStep& n : norms_) {
      if (n.kind == NormStep::nfc) s = nn::lm::nfc(s);
      else if (n.kind == NormStep::prepend) s = s.empty() ? s : n.a + s;  // tokenizers' Prepend skips empty text
      else s = replace_all(s, n.a, n.b);
    }
    return s;
  }

  std::int32_t special_id(const nlohmann::json& v, const std::string& field) {
    // A token given as a string, or as [string, id] (Roberta/Bert processors).
    std::string tok;
    if (v.is_string()) tok = v.get<std::string>();
    else if (v.is_array() && !v.empty() && v[0].is_string()) tok = v[0].get<std::string>();
    else fail(field, "expected a token");
    auto it = token_to_id_.find(tok);
    if (it == token_to_id_.end()) fail(field, "token '" + tok + "' is not in the vocabulary");
    return it->second;
  }

  void load_post(const nlohmann::json& p, const std::string& field) {
    const auto* type = member(p, "type");
    if (!type || !type->is_string()) fail(field + ".type", "missing");
    const std::string t = type->get<std::string>();
    if (t == "ByteLevel") return;  // offsets only
    if (t == "Sequence") {
      const auto* list = member(p, "processors");
      if (!list || !list->is_array()) fail(field + ".processors", "expected an array");
      for (std::size_t i = 0; i < list->size(); ++i) load_post((*list)[i], field + ".processors[" + std::to_string(i) + "]");
      return;
    }
    if (t == "TemplateProcessing") {
      const auto* single = member(p, "single");
      if (!single || !single->is_array()) fail(field + ".single", "expected an array");
      const auto* specials = member(p, "special_tokens");
      bool seen_a = false;
      for (std::size_t i = 0; i < single->size(); ++i) {
        const auto& item = (*single)[i];
        const std::string f = field + ".single[" + std::to_string(i) + "]";
        if (const auto* seq = member(item, "Sequence")) {
          if (seen_a) fail(f, "a single-sequence template with the sequence twice");
          (void)seq;
          seen_a = true;
        } else if (const auto* sp = member(item, "SpecialToken")) {
          const auto* id = member(*sp, "id");
          if (!id || !id->is_string()) fail(f + ".SpecialToken.id", "expected a string");
          const std::string name = id->get<std::string>();
          std::vector<std::int32_t> ids;
          const nlohmann::json* entry = specials ? member(*specials, name.c_str()) : nullptr;
          if (entry) {
            const auto* list = member(*entry, "ids");
            if (!list || !list->is_array()) fail(field + ".special_tokens." + name + ".ids", "expected an array");
            for (const auto& x : *list) {  // ids the encoder emits as they are: each must be a token
              const std::int64_t v = x.is_number_integer() ? x.get<std::int64_t>() : -1;
              if (v < 0 || v > INT32_MAX || static_cast<std::size_t>(v) >= valid_.size() || !valid_[static_cast<std::size_t>(v)])
                fail(field + ".special_tokens." + name + ".ids", "id " + x.dump() + " is not in the vocabulary");
              ids.push_back(static_cast<std::int32_t>(v));
            }
          } else {
            auto it = token_to_id_.find(name);
            if (it == token_to_id_.end()) fail(f, "special token '" + name + "' is not in special_tokens or the vocabulary");
            ids.push_back(it->second);
          }
          auto& dst = seen_a ? suffix_ : prefix_;
          dst.insert(dst.end(), ids.begin(), ids.end());
        } else {
          fail(f, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
        }
      }
      return;
    }
    if (t == "RobertaProcessing" || t == "BertProcessing") {
      const auto* cls = member(p, "cls");
      const auto* sep = member(p, "sep");
      if (!cls || !sep) fail(field, "missing cls or sep");
      prefix_.push_back(special_id(*cls, field + ".cls"));
      suffix_.push_back(special_id(*sep, field + ".sep"));
      return;
    }
    fail(field + ".type", "unsupported post-processor '" + t + "'");
  }

  void load_gguf(const GgufTokenizerData& d) {
    if (d.model != "gpt2" && d.model != "llama")
      nn::detail::fail(source_, "tokenizer.ggml.model: unsupported tokenizer model '", d.model,
                       "' (supported: \"gpt2\", byte-level BPE; \"llama\", SentencePiece BPE)");
    const bool llama = d.model == "llama";
    if (!d.token_types.empty() && d.token_types.size() != d.tokens.size())
      nn::detail::fail(source_, "tokenizer.ggml.token_type: ", d.token_types.size(), " entries for ", d.tokens.size(), " tokens");
    if (llama && !d.scores.empty() && d.scores.size() != d.tokens.size())
      nn::detail::fail(source_, "tokenizer.ggml.scores: ", d.scores.size(), " entries for ", d.tokens.size(), " tokens");
    // llama.cpp ignores tokenizer.ggml.pre (and any merges) for SentencePiece models.
    const detail::GgufPre pre = llama ? detail::GgufPre{} : detail::gguf_pre(d.pre, source_);
    token_to_id_.reserve(d.tokens.size());
    model_vocab_.reserve(d.tokens.size());
    id_to_token_.reserve(d.tokens.size());
    for (std::size_t i = 0; i < d.tokens.size(); ++i) {
      const auto id = static_cast<std::int32_t>(i);
      const std::string field = "tokenizer.ggml.tokens[" + std::to_string(i) + "]";
      const std::string& tok = d.tokens[i];
      // Byte-level tokens are printable code points, each standing for one byte: valid UTF-8.
      for (std::size_t k = 0; k < tok.size();) {
        const std::size_t at = k;
        if (utf8_next(tok, k) == kInvalidByte)
          fail(field, "not valid UTF-8 (byte " + std::to_string(static_cast<unsigned char>(tok[at])) + " at offset " +
                          std::to_string(at) + ")");
      }
      if (auto it = token_to_id_.find(tok); it != token_to_id_.end())
        fail(field, "token \"" + tok + "\" is already tokens[" + std::to_string(it->second) +
                        "] (llama.cpp would map it to one id only)");
      const std::int32_t raw_type = d.token_types.empty() ? 1 : d.token_types[i];
      if (raw_type < 0 || raw_type > static_cast<std::int32_t>(TokenType::byte))
        fail("tokenizer.ggml.token_type[" + std::to_string(i) + "]",
             std::to_string(raw_type) + " is not a token type (0 undefined .. 6 byte)");
      const auto type = static_cast<TokenType>(raw_type);
      set_token(id, tok);
      if (type == TokenType::control || type == TokenType::user_defined || type == TokenType::unknown) {
        // llama.cpp splits all three out of the raw text; user-defined ones even without
        // parse_special, which is what special=false gives here.
        AddedToken a;
        a.content = d.tokens[i];
        a.id = id;
        a.special = type != TokenType::user_defined;
        added_.push_back(std::move(a));
      } else {
        model_vocab_[d.tokens[i]] = id;
      }
    }
    if (llama) {
      spm_ = spm_scores_ = true;
      scores_ = d.scores;
      scores_.resize(d.tokens.size(), 0.0f);
      // llama.cpp puts a " " before each stretch of text, then spaces become "▁": tokenizers'
      // Prepend + Replace normalizers give the same; decoding undoes both.
      const bool space_prefix = d.add_space_prefix.value_or(true);
      if (space_prefix) norms_.push_back({NormStep::prepend, detail::kSpmSpace, {}});
      norms_.push_back({NormStep::replace, " ", detail::kSpmSpace});
      decoders_ = {{DecStep::replace, detail::kSpmSpace, " "}, {DecStep::byte_fallback, {}, {}}, {DecStep::fuse, {}, {}}};
      if (space_prefix) decoders_.push_back({DecStep::strip, " ", {}, 1, 0});
    }
    merges_.reserve(llama ? 0 : d.merges.size());
    for (std::size_t r = 0; r < (llama ? 0 : d.merges.size()); ++r) {
      const std::string& s = d.merges[r];
      const std::string field = "tokenizer.ggml.merges[" + std::to_string(r) + "]";
      // The separator is the first space after the first character (a token never starts
      // with a raw space in byte-level form, but be exact anyway).
      const auto sp = s.find(' ', 1);
      if (sp == std::string::npos) fail(field, "expected \"left right\", got \"" + s + "\"");
      add_merge(s.substr(0, sp), s.substr(sp + 1), r, field, false);
    }
    for (const auto& re : pre.regexes) {
      PreStep s;
      s.re = std::make_shared<detail::Regex>(re, source_ + ": tokenizer.ggml.pre");
      steps_.push_back(std::move(s));
    }
    byte_level_ = !llama;
    ignore_merges_ = pre.ignore_merges;
    auto check = [&](const std::optional<std::int32_t>& id, const char* field) {
      if (id && (*id < 0 || static_cast<std::size_t>(*id) >= d.tokens.size()))
        nn::detail::fail(source_, field, ": id ", *id, " is outside the vocabulary (", d.tokens.size(), " tokens)");
    };
    check(d.bos_id, "tokenizer.ggml.bos_token_id");
    check(d.eos_id, "tokenizer.ggml.eos_token_id");
    check(d.pad_id, "tokenizer.ggml.padding_token_id");
    check(d.unk_id, "tokenizer.ggml.unknown_token_id");
    bos_id_ = d.bos_id;
    eos_id_ = d.eos_id;
    pad_id_ = d.pad_id;
    unk_token_id_ = d.unk_id;
    if (d.add_bos.value_or(llama || pre.add_bos)) {  // llama.cpp: SentencePiece models add BOS by default
      if (!d.bos_id) nn::detail::fail(source_, "tokenizer.ggml.add_bos_token: set but there is no bos_token_id");
      prefix_.push_back(*d.bos_id);
    }
    if (d.add_eos.value_or(false)) {
      if (!d.eos_id) nn::detail::fail(source_, "tokenizer.ggml.add_eos_token: set but there is no eos_token_id");
      suffix_.push_back(*d.eos_id);
    }
    finish();
  }

  // ---- added tokens --------------------------------------------------------------------------

  /// Calls f(segment, -1) for text and f({}, id) for each added token found, in order.
  template <class F>
  void split_added(std::string_view text, const AddedSet& set, bool parse_special, F&& f) const {
    if (set.toks.empty()) {
      if (!text.empty()) f(text, -1);
      return;
    }
    std::size_t start = 0;  // start of the pending text
    std::size_t i = 0;
    while (i < text.size()) {
      const AddedToken* hit = nullptr;
      for (std::uint32_t k : set.by_first[static_cast<unsigned char>(text[i])]) {
        const AddedToken& t = set.toks[k];
        if (t.special && !parse_special) continue;
        if (text.compare(i, t.content.size(), t.content) != 0) continue;
        if (t.single_word && !single_word_ok(text, i, i + t.content.size())) continue;
        hit = &t;
        break;
      }
      if (!hit) {
        ++i;
        continue;
      }
      std::size_t b = i, e = i + hit->content.size();
      if (hit->lstrip)
        while (b > start && is_ascii_or_unicode_space_before(text, b)) b = prev_char(text, b);
      if (hit->rstrip)
        while (e < text.size() && is_space_at(text, e)) e = next_char(text, e);
      if (b > start) f(text.substr(start, b - start), -1);
      f(std::string_view{}, hit->id);
      start = i = e;
    }
    if (start < text.size()) f(text.substr(start), -1);
  }

  static std::size_t prev_char(std::string_view s, std::size_t i) {
    do --i;
    while (i > 0 && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80);
    return i;
  }
  static std::size_t next_char(std::string_view s, std::size_t i) {
    utf8_next(s, i);
    return i;
  }
  static bool is_space_at(std::string_view s, std::size_t i) {
    const char32_t c = utf8_next(s, i);
    return c != kInvalidByte && is_whitespace(c);
  }
  static bool is_ascii_or_unicode_space_before(std::string_view s, std::size_t i) {
    return is_space_at(s, prev_char(s, i));
  }
  static bool single_word_ok(std::string_view s, std::size_t b, std::size_t e) {
    auto word = [](char32_t c) { return c != kInvalidByte && detail::is_word_char(c, general_category(c)); };
    if (b > 0) {
      std::size_t p = prev_char(s, b);
      if (word(utf8_next(s, p))) return false;
    }
    if (e < s.size()) {
      std::size_t p = e;
      if (word(utf8_next(s, p))) return false;
    }
    return true;
  }

  // ---- pre-tokenization ----------------------------------------------------------------------

  struct Piece {
    std::uint32_t b, e;  // code point indices
  };

  /// Splits `pieces` with the step, writing into `out`.
  void apply_step(const PreStep& s, const std::vector<char32_t>& cps, const std::vector<Gc>& gcs,
                  const std::vector<Piece>& pieces, std::vector<Piece>& out) const {
    out.clear();
    thread_local std::vector<std::pair<Piece, bool>> parts;  // (range, is delimiter)
    for (const Piece& p : pieces) {
      parts.clear();
      std::uint32_t prev = p.b;
      auto delim = [&](std::uint32_t b, std::uint32_t e) {
        if (b > prev) parts.push_back({{prev, b}, false});
        parts.push_back({{b, e}, true});
        prev = e;
      };
      Behavior behavior = s.behavior;
      bool invert = s.invert;
      if (s.kind == PreStep::split || s.kind == PreStep::byte_level) {
        s.re->find_all(cps.data() + p.b, gcs.data() + p.b, p.e - p.b,
                       [&](std::size_t b, std::size_t e) { delim(p.b + static_cast<std::uint32_t>(b), p.b + static_cast<std::uint32_t>(e)); });
        if (s.kind == PreStep::byte_level) behavior = Behavior::isolated, invert = false;
      } else {
        // Digits: Rust's char::is_numeric, i.e. Nd, Nl and No.
        for (std::uint32_t i = p.b; i < p.e; ++i)
          if (is_number(gcs[i])) delim(i, i + 1);
        behavior = s.individual_digits ? Behavior::isolated : Behavior::contiguous;
        invert = false;
      }
      if (p.e > prev) parts.push_back({{prev, p.e}, false});
      if (invert)
        for (auto& x : parts) x.second = !x.second;
      emit_parts(parts, behavior, out);
    }
  }

  static void emit_parts(const std::vector<std::pair<Piece, bool>>& parts, Behavior behavior, std::vector<Piece>& out) {
    switch (behavior) {
      case Behavior::removed:
        for (const auto& [r, d] : parts)
          if (!d) out.push_back(r);
        return;
      case Behavior::isolated:
        for (const auto& x : parts) out.push_back(x.first);
        return;
      case Behavior::merged_with_previous: {
        bool prev_is_delim_free = false;  // can the next delimiter join the last piece out?
        for (const auto& [r, d] : parts) {
          if (d && prev_is_delim_free && !out.empty()) {
            out.back().e = r.e;
            prev_is_delim_free = false;
          } else {
            out.push_back(r);
            prev_is_delim_free = !d;
          }
        }
        return;
      }
      case Behavior::merged_with_next: {
        bool pending = false;
        for (const auto& [r, d] : parts) {
          if (pending && !d) {
            out.back().e = r.e;
            pending = false;
          } else {
            out.push_back(r);
            pending = d;
          }
        }
        return;
      }
      case Behavior::contiguous: {
        bool last_delim = false;
        for (const auto& [r, d] : parts) {
          if (d && last_delim && !out.empty()) out.back().e = r.e;
          else out.push_back(r);
          last_delim = d;
        }
        return;
      }
    }
  }

  /// Calls f(word bytes) for each pre-tokenized word of an already normalized segment; `first`:
  /// the segment starts the input (Metaspace's prepend_scheme "first").
  template <class F>
  void for_each_word(std::string_view seg, bool first, F&& f) const {
    if (!metaspace_) return split_words(seg, f);
    const Metaspace& m = *metaspace_;
    if (seg.empty()) return;
    std::string ms = replace_all(seg, " ", m.replacement);
    const bool starts = ms.compare(0, m.replacement.size(), m.replacement) == 0;
    if (!starts && (m.scheme == Metaspace::always || (m.scheme == Metaspace::first && first))) ms.insert(0, m.replacement);
    if (!m.split) return split_words(ms, f);
    // Cut before each replacement character (tokenizers' MergedWithNext).
    std::string_view v = ms;
    std::size_t b = 0;
    for (std::size_t k = v.find(m.replacement, 1); k != std::string_view::npos; k = v.find(m.replacement, k + 1)) {
      if (k > b) split_words(v.substr(b, k - b), f);
      b = k;
    }
    split_words(v.substr(b), f);
  }

  /// The pre-tokenizer steps after Metaspace (all of them when there is none).
  template <class F>
  void split_words(std::string_view seg, F&& f) const {
    std::string prefixed;
    if (add_prefix_space_ && !seg.empty() && seg.front() != ' ') {
      prefixed.reserve(seg.size() + 1);
      prefixed += ' ';
      prefixed += seg;
      seg = prefixed;
    }
    if (seg.empty()) return;
    if (steps_.empty()) {
      f(seg);
      return;
    }
    thread_local std::vector<char32_t> cps;
    thread_local std::vector<Gc> gcs;
    thread_local std::vector<std::uint32_t> offs;
    thread_local std::vector<Piece> a, b;
    cps.clear();
    gcs.clear();
    offs.clear();
    for (std::size_t i = 0; i < seg.size();) {
      offs.push_back(static_cast<std::uint32_t>(i));
      const char32_t c = utf8_next(seg, i);
      cps.push_back(c);
      gcs.push_back(c == kInvalidByte ? Gc::Cn : general_category(c));
    }
    offs.push_back(static_cast<std::uint32_t>(seg.size()));
    a.assign(1, Piece{0, static_cast<std::uint32_t>(cps.size())});
    for (const auto& s : steps_) {
      apply_step(s, cps, gcs, a, b);
      std::swap(a, b);
    }
    for (const Piece& p : a)
      if (p.e > p.b) f(seg.substr(offs[p.b], offs[p.e] - offs[p.b]));
  }

  // ---- BPE -----------------------------------------------------------------------------------

  void encode_word(std::string_view w, std::vector<std::int32_t>& out, detail::WordCache* cache) const {
    const bool cacheable = cache && w.size() <= detail::WordCache::kMaxWord;
    const std::uint64_t h = cacheable ? detail::hash_bytes(w) : 0;
    if (cacheable && cache->find(w, h, out)) return;
    const std::size_t at = out.size();
    // ignore_merges (Llama-3): a word that is a token is that token, whatever the merges say.
    auto it = ignore_merges_ ? raw_vocab_.find(w) : raw_vocab_.end();
    if (it != raw_vocab_.end()) out.push_back(it->second);
    else if (spm_scores_) spm_merge(w, out);
    else bpe(w, out);
    if (cacheable) cache->insert(w, h, out.data() + at, out.size() - at);
  }

  /// Merges the word's byte symbols, lowest rank first and leftmost among equals, as
  /// `tokenizers`' Word::merge_all (a heap of candidate merges, stale entries skipped).
  void bpe(std::string_view w, std::vector<std::int32_t>& out) const {
    struct Sym {
      std::int32_t id, prev, next;
      bool alive;
    };
    thread_local std::vector<Sym> syms;
    syms.clear();
    auto add = [&](std::int32_t id) {
      const auto n = static_cast<std::int32_t>(syms.size());
      syms.push_back({id, n - 1, n + 1, true});
    };
    // A symbol with no token: <unk> if the model has one (fused with a preceding <unk> when
    // fuse_unk), else dropped, as `tokenizers` does.
    auto add_unk = [&] {
      if (!unk_token_id_) return;
      if (fuse_unk_ && !syms.empty() && syms.back().id == *unk_token_id_) return;
      add(*unk_token_id_);
    };
    if (spm_) {
      // SentencePiece-style: one symbol per character; a character not in the vocabulary is
      // its byte tokens when byte_fallback has them all, else <unk>.
      for (std::size_t i = 0; i < w.size();) {
        const std::size_t b = i;
        utf8_next(w, i);  // an invalid byte is a character of its own
        if (auto it = model_vocab_.find(w.substr(b, i - b)); it != model_vocab_.end()) {
          add(it->second);
          continue;
        }
        bool bytes = byte_fallback_;
        for (std::size_t k = b; bytes && k < i; ++k) bytes = byte_id_[static_cast<unsigned char>(w[k])] >= 0;
        if (!bytes) {
          add_unk();
          continue;
        }
        for (std::size_t k = b; k < i; ++k) add(byte_id_[static_cast<unsigned char>(w[k])]);
      }
    } else {
      for (unsigned char c : w) {
        if (byte_id_[c] < 0) add_unk();
        else add(byte_id_[c]);
      }
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    if (syms.size() == 1) {
      out.push_back(syms[0].id);
      return;
    }
    struct Cand {
      std::int32_t rank, pos, new_id;
      bool operator>(const Cand& o) const { return rank != o.rank ? rank > o.rank : pos > o.pos; }
    };
    thread_local std::vector<Cand> heap;
    heap.clear();
    auto push = [&](std::int32_t pos) {
      const std::int32_t nx = syms[static_cast<std::size_t>(pos)].next;
      if (nx < 0) return;
      if (const auto* m = merges_.find(syms[static_cast<std::size_t>(pos)].id, syms[static_cast<std::size_t>(nx)].id)) {
        heap.push_back({m->first, pos, m->second});
        std::push_heap(heap.begin(), heap.end(), std::greater<>{});
      }
    };
    for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(syms.size()); ++i) push(i);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), std::greater<>{});
      const Cand c = heap.back();
      heap.pop_back();
      Sym& l = syms[static_cast<std::size_t>(c.pos)];
      if (!l.alive || l.next < 0) continue;
      Sym& r = syms[static_cast<std::size_t>(l.next)];
      const auto* m = merges_.find(l.id, r.id);
      if (!m || m->second != c.new_id) continue;  // stale: a neighbour changed since it was queued
      l.id = c.new_id;
      r.alive = false;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = c.pos;
      if (l.prev >= 0) push(l.prev);
      push(c.pos);
    }
    for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) out.push_back(syms[static_cast<std::size_t>(i)].id);
  }

  /// llama.cpp's SentencePiece tokenizer (llm_tokenizer_spm): symbols are UTF-8 characters (by
  /// their lead byte); repeatedly join the adjacent pair whose joined text is the token with the
  /// highest score, leftmost on ties; a final symbol that is no token becomes its byte tokens.
  /// (llama.cpp also re-splits a joined symbol that is no token along the joins that made it,
  /// but a join only happens when the joined text is a token, so that never applies.)
  void spm_merge(std::string_view w, std::vector<std::int32_t>& out) const {
    struct Sym {
      std::uint32_t start, n;
      std::int32_t prev, next;
    };
    struct Bigram {
      float score;
      std::int32_t left, right;
      std::uint32_t size;
    };
    // Heap order: highest score on top, then the leftmost.
    auto lower = [](const Bigram& x, const Bigram& y) { return x.score < y.score || (x.score == y.score && x.left > y.left); };
    thread_local std::vector<Sym> syms;
    thread_local std::vector<Bigram> heap;
    syms.clear();
    heap.clear();
    static constexpr std::uint8_t kLen[16] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 3, 4};
    for (std::size_t i = 0; i < w.size();) {
      const std::size_t len = std::min<std::size_t>(w.size() - i, kLen[static_cast<unsigned char>(w[i]) >> 4]);
      const auto n = static_cast<std::int32_t>(syms.size());
      syms.push_back({static_cast<std::uint32_t>(i), static_cast<std::uint32_t>(len), n - 1, n + 1});
      i += len;
    }
    if (syms.empty()) return;
    syms.back().next = -1;
    auto try_add = [&](std::int32_t l, std::int32_t r) {
      if (l < 0 || r < 0) return;
      const Sym& a = syms[static_cast<std::size_t>(l)];
      const std::uint32_t size = a.n + syms[static_cast<std::size_t>(r)].n;
      auto it = token_to_id_.find(w.substr(a.start, size));
      if (it == token_to_id_.end() || static_cast<std::size_t>(it->second) >= scores_.size()) return;
      heap.push_back({scores_[static_cast<std::size_t>(it->second)], l, r, size});
      std::push_heap(heap.begin(), heap.end(), lower);
    };
    for (std::int32_t i = 0; i + 1 < static_cast<std::int32_t>(syms.size()); ++i) try_add(i, i + 1);
    while (!heap.empty()) {
      std::pop_heap(heap.begin(), heap.end(), lower);
      const Bigram bg = heap.back();
      heap.pop_back();
      Sym& l = syms[static_cast<std::size_t>(bg.left)];
      Sym& r = syms[static_cast<std::size_t>(bg.right)];
      if (l.n == 0 || r.n == 0 || l.n + r.n != bg.size) continue;  // stale: a side changed since
      l.n += r.n;
      r.n = 0;
      l.next = r.next;
      if (r.next >= 0) syms[static_cast<std::size_t>(r.next)].prev = bg.left;
      try_add(l.prev, bg.left);
      try_add(bg.left, l.next);
    }
    for (std::int32_t i = 0; i >= 0; i = syms[static_cast<std::size_t>(i)].next) {
      const Sym& a = syms[static_cast<std::size_t>(i)];
      const std::string_view text = w.substr(a.start, a.n);
      if (auto it = token_to_id_.find(text); it != token_to_id_.end()) {
        out.push_back(it->second);
        continue;
      }
      for (char c : text) {
        std::int32_t id = byte_id_[static_cast<unsigned char>(c)];
        if (id < 0)
          if (auto it = token_to_id_.find(std::string_view(&c, 1)); it != token_to_id_.end()) id = it->second;
        if (id < 0)
          nn::detail::fail(source_, ": encode: byte 0x", "0123456789ABCDEF"[(c >> 4) & 15], "0123456789ABCDEF"[c & 15],
                           " has no token (no <0x", "0123456789ABCDEF"[(c >> 4) & 15], "0123456789ABCDEF"[c & 15],
                           "> byte token in the vocabulary)");
        out.push_back(id);
      }
    }
  }

  std::string source_;
  std::vector<std::string> id_to_token_;
  std::vector<bool> valid_;
  detail::StringMap token_to_id_;  // vocabulary form, added tokens included
  detail::StringMap model_vocab_;  // the BPE model's own vocabulary
  detail::StringMap raw_vocab_;    // raw bytes -> id, for ignore_merges
  std::vector<std::string> id_bytes_;
  std::vector<bool> is_special_;
  std::array<std::int32_t, 256> byte_id_ = [] {
    std::array<std::int32_t, 256> a{};
    a.fill(-1);  // an empty tokenizer maps no byte
    return a;
  }();
  detail::PairMap merges_;
  std::vector<AddedToken> added_;
  AddedSet raw_added_, norm_added_;  // matched in the raw text / in the normalized text
  std::vector<PreStep> steps_;
  std::vector<std::int32_t> prefix_, suffix_;
  std::optional<std::int32_t> bos_id_, eos_id_, pad_id_, unk_token_id_;
  std::vector<NormStep> norms_;
  std::optional<Metaspace> metaspace_;
  std::vector<DecStep> decoders_;  // SentencePiece-style only (byte-level decodes by the byte table)
  std::vector<float> scores_;      // GGUF "llama": token scores for spm_merge
  bool byte_level_ = false, add_prefix_space_ = false, ignore_merges_ = false, fuse_unk_ = false;
  bool spm_ = false;          // SentencePiece-style: character symbols, "▁" spaces, byte fallback
  bool spm_scores_ = false;   // ... merged by token score (GGUF) rather than by merges
  bool byte_fallback_ = false;
  CacheHolder cache_;
};

}  // namespace nn::lm
