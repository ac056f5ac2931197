// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::lm::Tokenizer against Hugging Face `tokenizers` (fixtures from tests/oracle/gen_tokenizer.py
// and gen_spm_tokenizer.py): ids of a trained byte-level BPE under seven pre-tokenizer setups, of
// real GPT-2, Qwen2 and Llama-3 vocabularies and of a trained SentencePiece BPE under four
// layouts, decoding, the GGUF constructors ("gpt2" and "llama"), and load errors.
#include <doctest/doctest.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <string>
#include <thread>
#include <vector>

#include <nlohmann/json.hpp>

#include <nn/lm/tokenizer.hpp>

#include "support/error_of.hpp"

namespace lm_tokenizer {  // one unity source with the other lm files: its names stay its own

using nlohmann::json;
using nn::lm::Tokenizer;

namespace {

// The tokenizer needs none of the tape, and neither does its test: support/check.hpp pulls in
// the whole library, so its fixture loader is repeated here (same NN_FIXTURES_DIR layout).
json fixture(const std::string& name) {
  const std::string path = std::string(NN_FIXTURES_DIR) + "/" + name;
  std::ifstream f(path);
  if (!f) FAIL("missing fixture " << path << " (regenerate with tests/oracle/gen_tokenizer.py)");
  return json::parse(f);
}

const std::string kDir = "lm/tokenizer/";

const json& expected() {
  static const json j = fixture(kDir + "expected.json");
  return j;
}
const std::vector<std::string>& sample_chunks() {
  static const std::vector<std::string> c = fixture(kDir + "corpus_sample.json").at("chunks").get<std::vector<std::string>>();
  return c;
}

// FNV-1a 64 of the ids as little-endian int32, as the generator records per corpus chunk.
std::string fnv1a(const std::vector<std::int32_t>& ids) {
  std::uint64_t h = 0xCBF29CE484222325ULL;
  for (std::int32_t id : ids) {
    const auto u = static_cast<std::uint32_t>(id);
    for (int k = 0; k < 4; ++k) {
      h ^= (u >> (8 * k)) & 0xFF;
      h *= 0x100000001B3ULL;
    }
  }
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(h));
  return buf;
}

// The base file with a variant's overrides: top-level keys replaced, "model.x" sets model[x].
json with_overrides(json base, const json& ov) {
  for (auto it = ov.begin(); it != ov.end(); ++it) {
    const std::string& k = it.key();
    if (k == "lossy") continue;  // a note for the test, not a tokenizer.json field
    if (k.rfind("model.", 0) == 0) base["model"][k.substr(6)] = it.value();
    else base[k] = it.value();
  }
  return base;
}

std::string show(const std::vector<std::int32_t>& v, std::size_t from = 0, std::size_t n = 12) {
  std::string s = "[";
  for (std::size_t i = from; i < v.size() && i < from + n; ++i) s += std::to_string(v[i]) + " ";
  return s + "]";
}

// First index where a and b differ.
std::size_t first_diff(const std::vector<std::int32_t>& a, const std::vector<std::int32_t>& b) {
  std::size_t i = 0;
  while (i < a.size() && i < b.size() && a[i] == b[i]) ++i;
  return i;
}

// The round trip decode(encode(s)) == s holds except where the tokenizer itself drops or adds
// text: NFC (then it gives text canonically equivalent to s), an added token with lstrip (the trained "<mask>" swallows
// the spaces before it), ByteLevel's add_prefix_space (the "roberta" setup) and pre-tokenizers
// that remove text (the "whitespace" setup): the last two are `lossy`.
bool round_trips(const std::string& text, bool lossy) {
  return !lossy && text.find("<mask>") == std::string::npos;
}

// With NFC the tokenizer normalizes each stretch between added tokens, so the decoded text is
// canonically equivalent to the input: equal after NFC, as NFC(NFC(a) NFC(b)) = NFC(a b).
bool same_text(const std::string& decoded, const std::string& text, bool nfc) {
  return nfc ? nn::lm::nfc(decoded) == nn::lm::nfc(text) : decoded == text;
}

// Probes: ids with and without the post-processor and with special tokens left as text, and
// the round trip. `nfc`: the tokenizer normalizes, so decode gives NFC of the input.
void check_probes(const Tokenizer& t, const json& probes, bool nfc, const std::string& label, bool lossy = false) {
  int n = 0;
  for (const auto& p : probes) {
    const std::string text = p.at("text").get<std::string>();
    const auto want = p.at("ids").get<std::vector<std::int32_t>>();
    const auto got = t.encode(text);
    INFO(label, " probe ", n, ": \"", text.substr(0, 80), "\"");
    if (got != want) {
      const std::size_t d = first_diff(got, want);
      INFO("first difference at ", d, ": got ", show(got, d > 3 ? d - 3 : 0), " want ", show(want, d > 3 ? d - 3 : 0));
      CHECK(got == want);
    }
    CHECK(t.encode(text, {.add_special_tokens = false}) == p.at("ids_no_special").get<std::vector<std::int32_t>>());
    CHECK(t.encode(text, {.add_special_tokens = false, .parse_special = false}) ==
          p.at("ids_text_specials").get<std::vector<std::int32_t>>());
    if (round_trips(text, lossy)) CHECK(same_text(t.decode(t.encode(text, {.add_special_tokens = false})), text, nfc));
    ++n;
  }
  MESSAGE(label, ": ", n, " probes compared");
}

// Corpus chunks: (count, hash) of the ids, and the round trip.
void check_chunks(const Tokenizer& t, const std::vector<std::string>& chunks, const json& want, bool nfc,
                  const std::string& label, const json* sections = nullptr, bool lossy = false) {
  REQUIRE(want.size() == chunks.size());
  std::size_t bytes = 0, ids = 0, bad = 0;
  for (std::size_t i = 0; i < chunks.size(); ++i) {
    const auto got = t.encode(chunks[i]);
    const auto n = want[i][0].get<std::size_t>();
    const auto h = want[i][1].get<std::string>();
    bytes += chunks[i].size();
    ids += got.size();
    if (got.size() != n || fnv1a(got) != h) {
      ++bad;
      INFO(label, " chunk ", i, (sections ? " (" + (*sections)[i].get<std::string>() + ")" : std::string()), ": ",
           got.size(), " ids, want ", n, "; text starts \"", chunks[i].substr(0, 60), "\"");
      CHECK(false);
    }
    if (!round_trips(chunks[i], lossy)) continue;
    const std::string back = t.decode(t.encode(chunks[i], {.add_special_tokens = false}));
    if (!same_text(back, chunks[i], nfc)) {
      INFO(label, " chunk ", i, " does not round-trip");
      CHECK(false);
    }
  }
  MESSAGE(label, ": ", chunks.size(), " chunks, ", bytes, " bytes, ", ids, " ids, ", bad, " mismatches");
  CHECK(bad == 0);
}

void check_decode(const Tokenizer& t, const json& cases, const std::string& label) {
  int n = 0;
  for (const auto& c : cases) {
    const auto ids = c.at("ids").get<std::vector<std::int32_t>>();
    INFO(label, " decode case ", n++, " ids ", show(ids));
    CHECK(t.decode(ids) == c.at("text").get<std::string>());
    CHECK(t.decode(ids, true) == c.at("text_skip_special").get<std::string>());
  }
}

Tokenizer load(const std::string& file) {
  return Tokenizer::from_file(std::string(NN_FIXTURES_DIR) + "/" + kDir + file);
}

// GGUF metadata as the GGUF reader would hand it over, from a tokenizer.json: dense token list
// (ids the file lacks become unused placeholders), merges as "a b", control tokens for the
// special added tokens, user-defined for the others.
nn::lm::GgufTokenizerData gguf_from_json(const json& j, const std::string& pre) {
  nn::lm::GgufTokenizerData d;
  d.pre = pre;
  std::int32_t n = 0;
  for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) n = std::max(n, it.value().get<std::int32_t>() + 1);
  for (const auto& a : j["added_tokens"]) n = std::max(n, a["id"].get<std::int32_t>() + 1);
  d.tokens.resize(static_cast<std::size_t>(n));
  d.token_types.assign(static_cast<std::size_t>(n), static_cast<std::int32_t>(nn::lm::TokenType::unused));
  for (std::int32_t i = 0; i < n; ++i) d.tokens[static_cast<std::size_t>(i)] = "<nn_unused_" + std::to_string(i) + ">";
  for (auto it = j["model"]["vocab"].begin(); it != j["model"]["vocab"].end(); ++it) {
    const auto id = static_cast<std::size_t>(it.value().get<std::int32_t>());
    d.tokens[id] = it.key();
    d.token_types[id] = static_cast<std::int32_t>(nn::lm::TokenType::normal);
  }
  for (const auto& a : j["added_tokens"]) {
    const auto id = static_cast<std::size_t>(a["id"].get<std::int32_t>());
    d.tokens[id] = a["content"].get<std::string>();
    d.token_types[id] = static_cast<std::int32_t>(a["special"].get<bool>() ? nn::lm::TokenType::control : nn::lm::TokenType::user_defined);
  }
  for (const auto& m : j["model"]["merges"])
    d.merges.push_back(m.is_string() ? m.get<std::string>() : m[0].get<std::string>() + " " + m[1].get<std::string>());
  return d;
}

using nn::test::contains;
using nn::test::error_of;

}  // namespace

TEST_CASE("unicode: categories, whitespace, UTF-8 and NFC") {
  using nn::lm::Gc;
  CHECK(nn::lm::general_category(U'a') == Gc::Ll);
  CHECK(nn::lm::general_category(U'Ä') == Gc::Lu);
  CHECK(nn::lm::general_category(U'中') == Gc::Lo);
  CHECK(nn::lm::general_category(U'٣') == Gc::Nd);
  CHECK(nn::lm::general_category(U'²') == Gc::No);
  CHECK(nn::lm::general_category(U'Ⅻ') == Gc::Nl);
  CHECK(nn::lm::general_category(0x301) == Gc::Mn);
  CHECK(nn::lm::general_category(0x1F600) == Gc::So);
  CHECK(nn::lm::general_category(0x10FFFF) == Gc::Cn);
  CHECK(nn::lm::general_category(0xE000) == Gc::Co);
  CHECK(nn::lm::is_whitespace(0x3000));
  CHECK(nn::lm::is_whitespace(0x85));
  CHECK(!nn::lm::is_whitespace(0x200B));  // zero width space is Cf, not White_Space
  CHECK(!nn::lm::is_whitespace(0x1C));

  // NFC: composition, singletons, Hangul, reordering, blocked marks, exclusions.
  CHECK(nn::lm::nfc("e\xCC\x81") == "\xC3\xA9");                      // e + acute -> é
  CHECK(nn::lm::nfc("\xE2\x84\xAB") == "\xC3\x85");                   // Angstrom sign -> Å
  CHECK(nn::lm::nfc("\xE1\x84\x80\xE1\x85\xA1\xE1\x86\xA8") == "\xEA\xB0\x81");  // jamo -> 각
  CHECK(nn::lm::nfc("A\xCC\x87\xCC\xA3") == "\xE1\xBA\xA0\xCC\x87");  // A + dot above + dot below -> Ạ + dot above
  CHECK(nn::lm::nfc("\xE0\xA5\x98") == "\xE0\xA4\x95\xE0\xA4\xBC");   // U+0958 is excluded: stays decomposed
  CHECK(nn::lm::nfc("plain ascii") == "plain ascii");
  CHECK(nn::lm::nfc_quick_check("caf\xC3\xA9"));
  CHECK(!nn::lm::nfc_quick_check("cafe\xCC\x81"));

  CHECK(nn::lm::utf8_lossy("a\xF0\x9F\x98") == "a\xEF\xBF\xBD");            // cut emoji: one U+FFFD
  CHECK(nn::lm::utf8_lossy("\xE0\x80\x80") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD");  // overlong: three
  CHECK(nn::lm::utf8_lossy("\xED\xA0\x80x") == "\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBDx");  // surrogate
  CHECK(nn::lm::utf8_complete_prefix("ab\xF0\x9F\x98") == 2);
  CHECK(nn::lm::utf8_complete_prefix("ab\xF0\x9F\x98\x80") == 6);
  CHECK(nn::lm::utf8_complete_prefix("ab\xC3") == 2);
  CHECK(nn::lm::utf8_complete_prefix("ab") == 2);
}

TEST_CASE("regex: the pre-tokenizer patterns' constructs") {
  using nn::lm::detail::Regex;
  auto split = [](const Regex& re, const std::u32string& s) {
    std::vector<nn::lm::Gc> g;
    for (char32_t c : s) g.push_back(nn::lm::general_category(c));
    std::vector<std::u32string> out;
    re.find_all(s.data(), g.data(), s.size(), [&](std::size_t b, std::size_t e) { out.push_back(s.substr(b, e - b)); });
    return out;
  };
  Regex gpt2(nn::lm::detail::kGpt2Regex);
  CHECK(split(gpt2, U"Hello world's  end ") == std::vector<std::u32string>{U"Hello", U" world", U"'s", U" ", U" end", U" "});
  Regex llama3(nn::lm::detail::kLlama3Regex);
  CHECK(split(llama3, U"12345 x\n\n y") == std::vector<std::u32string>{U"123", U"45", U" x", U"\n\n", U" y"});
  Regex ci(R"((?i:'s|'ll)|\p{L}+)");
  CHECK(split(ci, U"it'S we'LL x'\u017F") == std::vector<std::u32string>{U"it", U"'S", U"we", U"'LL", U"x", U"'\u017F"});
  Regex counted(R"(\d{2,3}?x|[a-c]{2}|\P{L})");
  CHECK(split(counted, U"12x1234xabc!") == std::vector<std::u32string>{U"12x", U"1", U"234x", U"ab", U"!"});
  Regex look(R"(a(?=b)|a(?!c)|\bq\b)");
  CHECK(split(look, U"ab ac ad q qq") == std::vector<std::u32string>{U"a", U"a", U"q"});

  auto err = [](const char* p) { return error_of([&] { Regex r(p, "t.json"); }); };
  CHECK(contains(err("(?<=a)b"), "lookbehind"));
  CHECK(contains(err("a++"), "possessive"));
  CHECK(contains(err("[a"), "unterminated"));
  CHECK(contains(err("(a"), "missing ')'"));
  CHECK(contains(err("\\p{Han}"), "unsupported property"));
  CHECK(contains(err("(a*)*"), "match empty"));
  CHECK(contains(err("x)"), "[t.json]"));
}

TEST_CASE("tokenizer: trained byte-level BPE, string and pair merges, seven pre-tokenizer setups") {
  const json base_str = fixture(kDir + "trained_string_merges.json");
  const json base_pair = fixture(kDir + "trained_pair_merges.json");
  REQUIRE(base_str["model"]["merges"][0].is_string());
  REQUIRE(base_pair["model"]["merges"][0].is_array());
  const json& exp = expected().at("trained");
  MESSAGE("fixtures recorded with tokenizers ", expected().at("tokenizers_version").get<std::string>());
  for (auto it = exp.begin(); it != exp.end(); ++it) {
    const std::string name = it.key();
    const json& v = it.value();
    SUBCASE(name.c_str()) {
      const bool nfc = v["overrides"].contains("normalizer");
      // "roberta" adds a prefix space and "whitespace" drops whitespace: no round trip.
      const bool lossy = name == "roberta" || v["overrides"].value("lossy", false);
      const Tokenizer ts = Tokenizer::from_json(with_overrides(base_str, v["overrides"]), "trained_string_merges.json");
      const Tokenizer tp = Tokenizer::from_json(with_overrides(base_pair, v["overrides"]), "trained_pair_merges.json");
      CHECK(ts.merges_size() == tp.merges_size());
      check_probes(ts, v["probes"], nfc, "trained/" + name + " (string merges)", lossy);
      check_probes(tp, v["probes"], nfc, "trained/" + name + " (pair merges)", lossy);
      check_chunks(ts, sample_chunks(), v["chunks"], nfc, "trained/" + name, &expected()["chunk_sections"], lossy);
      if (v.contains("decode")) check_decode(ts, v["decode"], "trained/" + name);
    }
  }
}

TEST_CASE("tokenizer: real GPT-2, Qwen2 and Llama-3 vocabularies") {
  const json& exp = expected().at("real");
  for (auto it = exp.begin(); it != exp.end(); ++it) {
    const std::string name = it.key();
    const json& v = it.value();
    SUBCASE(name.c_str()) {
      const Tokenizer t = load(v["file"].get<std::string>());
      const bool nfc = name == "qwen2";
      check_probes(t, v["probes"], nfc, "real/" + name);
      check_chunks(t, sample_chunks(), v["chunks"], nfc, "real/" + name, &expected()["chunk_sections"]);
      check_decode(t, v["decode"], "real/" + name);
      const auto& g = v["gguf"];
      if (name == "llama3") {
        CHECK(t.bos_id() == g["bos"].get<std::int32_t>());  // from the TemplateProcessing post-processor
        CHECK(t.prefix_ids() == std::vector<std::int32_t>{g["bos"].get<std::int32_t>()});
      }
    }
  }
}

TEST_CASE("tokenizer: from GGUF metadata (tokens, merges, token types, pre name)") {
  const json& exp = expected().at("real");
  for (auto it = exp.begin(); it != exp.end(); ++it) {
    const std::string name = it.key();
    const json& v = it.value();
    SUBCASE(name.c_str()) {
      const json j = fixture(kDir + v["file"].get<std::string>());
      const auto& g = v["gguf"];
      auto d = gguf_from_json(j, g["pre"].get<std::string>());
      d.bos_id = g["bos"].get<std::int32_t>();
      d.eos_id = g["eos"].get<std::int32_t>();
      const Tokenizer t = Tokenizer::from_gguf(d, "ggml-vocab-" + g["pre"].get<std::string>() + ".gguf");
      CHECK(t.eos_id() == g["eos"].get<std::int32_t>());
      int n = 0;
      for (const auto& p : v["probes"]) {
        // llama.cpp applies no normalizer, so only NFC-stable text is comparable for Qwen2.
        if (!p["nfc_stable"].get<bool>()) continue;
        INFO(name, " probe \"", p["text"].get<std::string>().substr(0, 60), "\"");
        CHECK(t.encode(p["text"].get<std::string>()) == p["ids"].get<std::vector<std::int32_t>>());
        ++n;
      }
      MESSAGE("gguf/", name, " (pre \"", g["pre"].get<std::string>(), "\"): ", n, " probes compared");
    }
  }
  SUBCASE("smollm pre (digits isolated, then GPT-2's regex) against the SmolLM-style tokenizer.json") {
    const json base = fixture(kDir + "trained_pair_merges.json");
    const json& v = expected()["trained"]["smollm"];
    const Tokenizer t = Tokenizer::from_gguf(gguf_from_json(base, "smollm"), "smollm.gguf");
    int n = 0;
    for (const auto& p : v["probes"]) {
      const std::string text = p["text"].get<std::string>();
      if (contains(text, "<mask>")) continue;  // GGUF has no lstrip attribute for added tokens
      INFO("probe \"", text.substr(0, 60), "\"");
      CHECK(t.encode(text) == p["ids"].get<std::vector<std::int32_t>>());
      ++n;
    }
    MESSAGE("gguf/smollm: ", n, " probes compared");
  }
  SUBCASE("from_gguf_metadata takes the GGUF reader's struct (64-bit ids)") {
    struct Meta {  // the field names and types of gguf.hpp's GgufTokenizerMetadata
      std::string model = "gpt2", pre = "llama-bpe";
      std::vector<std::string> tokens, merges;
      std::vector<std::int32_t> token_types;
      std::optional<std::int64_t> bos_id, eos_id, eot_id, unk_id, pad_id;
      std::optional<bool> add_bos, add_eos;
    } m;
    const json& v = expected()["real"]["llama3"];
    const auto d = gguf_from_json(fixture(kDir + v["file"].get<std::string>()), "llama-bpe");
    m.tokens = d.tokens;
    m.merges = d.merges;
    m.token_types = d.token_types;
    m.bos_id = v["gguf"]["bos"].get<std::int64_t>();
    m.eos_id = v["gguf"]["eos"].get<std::int64_t>();
    const Tokenizer t = Tokenizer::from_gguf_metadata(m, "llama3.gguf");
    const auto& p = v["probes"][11];
    CHECK(t.encode(p["text"].get<std::string>()) == p["ids"].get<std::vector<std::int32_t>>());
    m.pad_id = std::int64_t{1} << 40;
    CHECK(contains(error_of([&] { Tokenizer::from_gguf_metadata(m, "llama3.gguf"); }), "padding_token_id: id"));
  }
  SUBCASE("pre names map to compilable regexes; errors name the field") {
    const json base = fixture(kDir + "trained_pair_merges.json");
    for (const char* pre : {"default", "gpt-2", "llama-bpe", "llama3", "qwen2", "qwen35", "smollm", "starcoder", "dbrx",
                            "falcon", "deepseek-coder", "deepseek-v3", "chatglm-bpe", "glm4", "bloom", "viking",
                            "tekken", "gpt-4o", "mpt", "olmo", "stablelm2"}) {
      INFO("pre ", pre);
      auto d = gguf_from_json(base, pre);
      d.bos_id = 0;
      const Tokenizer t = Tokenizer::from_gguf(d);
      CHECK(t.decode(t.encode("Hello, world! 12345 \xE4\xBD\xA0\xE5\xA5\xBD  ok\n", {.add_special_tokens = false})) ==
            "Hello, world! 12345 \xE4\xBD\xA0\xE5\xA5\xBD  ok\n");
    }
    auto d = gguf_from_json(base, "no-such-pre");
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "[m.gguf] tokenizer.ggml.pre"));
    d.pre = "gpt-2";
    d.model = "bert";
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "tokenizer.ggml.model"));
    d.model = "gpt2";
    d.merges.push_back("nope xyz");
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "tokenizer.ggml.merges["));
    d.merges.pop_back();
    d.bos_id = 1 << 30;
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "bos_token_id"));
    d.bos_id.reset();
    d.add_bos = true;
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "add_bos_token"));
  }
}

namespace {

// GGUF metadata for the SentencePiece model, as convert_hf_to_gguf.py writes it (spm_expected.json "gguf").
nn::lm::GgufTokenizerData spm_gguf(const json& g) {
  nn::lm::GgufTokenizerData d;
  d.model = g.at("model").get<std::string>();
  d.tokens = g.at("tokens").get<std::vector<std::string>>();
  d.scores = g.at("scores").get<std::vector<float>>();
  d.token_types = g.at("token_type").get<std::vector<std::int32_t>>();
  d.bos_id = g.at("bos").get<std::int32_t>();
  d.eos_id = g.at("eos").get<std::int32_t>();
  d.unk_id = g.at("unk").get<std::int32_t>();
  d.add_bos = g.at("add_bos").get<bool>();
  d.add_eos = g.at("add_eos").get<bool>();
  d.add_space_prefix = g.at("add_space_prefix").get<bool>();
  return d;
}

// Text a SentencePiece-style tokenizer gives back unchanged: no added tokens (a space is put
// after each) and no "▁" (it decodes to a space).
bool spm_plain(const std::string& s) {
  for (const char* m : {"\xE2\x96\x81", "<s>", "</s>", "<unk>", "<|im_"})
    if (s.find(m) != std::string::npos) return false;
  return true;
}

}  // namespace

TEST_CASE("tokenizer: SentencePiece-style BPE with byte fallback (Llama 2, Mistral, Gemma layouts; GGUF \"llama\")") {
  const json exp = fixture(kDir + "spm_expected.json");
  const json base = fixture(kDir + "spm_tokenizer.json");
  MESSAGE("fixtures recorded with tokenizers ", exp.at("tokenizers_version").get<std::string>(), ", sentencepiece ",
          exp.at("sentencepiece_version").get<std::string>());
  for (auto it = exp["variants"].begin(); it != exp["variants"].end(); ++it) {
    const std::string name = it.key();
    const json& v = it.value();
    SUBCASE(name.c_str()) {
      const Tokenizer t = Tokenizer::from_json(with_overrides(base, v["overrides"]), "spm_tokenizer.json");
      CHECK(t.vocab_size() == exp["vocab"].get<std::size_t>());
      CHECK(t.merges_size() == exp["merges"].get<std::size_t>());
      check_probes(t, v["probes"], false, "spm/" + name, true);
      check_chunks(t, sample_chunks(), v["chunks"], false, "spm/" + name, &expected()["chunk_sections"], true);
      check_decode(t, v["decode"], "spm/" + name);
      // Llama's layout strips the space it added; Gemma's adds none: both give the text back.
      if (name == "llama" || name == "gemma") {
        std::size_t n = 0;
        for (const auto& c : sample_chunks()) {
          if (!spm_plain(c)) continue;
          INFO("spm/", name, " round trip of \"", c.substr(0, 60), "\"");
          CHECK(t.decode(t.encode(c, {.add_special_tokens = false})) == c);
          ++n;
        }
        CHECK(n > 100);
      }
    }
  }
  SUBCASE("GGUF \"llama\" model: llama.cpp's score-ordered merging gives the tokenizer.json's ids") {
    const json& v = exp["variants"]["llama"];
    const Tokenizer t = Tokenizer::from_gguf(spm_gguf(exp["gguf"]), "spm.gguf");
    CHECK(t.bos_id() == 1);
    CHECK(t.prefix_ids() == std::vector<std::int32_t>{1});
    CHECK(t.merges_size() == 0);
    check_probes(t, v["probes"], false, "gguf/spm", true);
    check_chunks(t, sample_chunks(), v["chunks"], false, "gguf/spm", &expected()["chunk_sections"], true);
    check_decode(t, v["decode"], "gguf/spm");
  }
  SUBCASE("errors name the field") {
    nn::lm::GgufTokenizerData d = spm_gguf(exp["gguf"]);
    d.scores.pop_back();
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "tokenizer.ggml.scores: 3001 entries for 3002 tokens"));
    d = spm_gguf(exp["gguf"]);
    d.model = "bert";
    CHECK(contains(error_of([&] { Tokenizer::from_gguf(d, "m.gguf"); }), "unsupported tokenizer model 'bert'"));
    // A vocabulary without byte tokens: a character it lacks cannot be encoded.
    d = spm_gguf(exp["gguf"]);
    for (std::size_t i = 0; i < d.tokens.size(); ++i)
      if (d.token_types[i] == 6) d.tokens[i] = "<nn_no_byte_" + std::to_string(i) + ">";
    const Tokenizer nb = Tokenizer::from_gguf(d, "m.gguf");
    CHECK(contains(error_of([&] { nb.encode("\xF0\x9F\xA6\x99"); }), "byte 0xF0 has no token"));
    json j = base;
    j["normalizer"] = json::parse(R"({"type": "Replace", "pattern": {"Regex": " +"}, "content": "\u2581"})");
    CHECK(contains(error_of([&] { Tokenizer::from_json(j, "x.json"); }), "normalizer.pattern"));
    j = base;
    j["decoder"] = json::parse(R"({"type": "WordPiece"})");
    CHECK(contains(error_of([&] { Tokenizer::from_json(j, "x.json"); }), "unsupported decoder 'WordPiece'"));
    j = base;
    j["normalizer"] = nullptr;
    j["model"]["byte_fallback"] = false;
    CHECK(contains(error_of([&] { Tokenizer::from_json(j, "x.json"); }), "neither byte-level BPE"));
    j = base;
    j["pre_tokenizer"] = json::parse(R"({"type": "Sequence", "pretokenizers": [{"type": "Digits"}, {"type": "Metaspace"}]})");
    CHECK(contains(error_of([&] { Tokenizer::from_json(j, "x.json"); }), "Metaspace is only supported as the first"));
  }
}

TEST_CASE("tokenizer: vocabulary lookups, special ids, config file, copies and threads") {
  const Tokenizer t = load("trained_pair_merges.json");
  CHECK(t.token_to_id("<|im_start|>") == 1);
  CHECK(t.id_to_token(1) == "<|im_start|>");
  CHECK(t.is_special(1));
  CHECK(!t.is_special(t.token_to_id("<sep>").value()));
  CHECK(!t.token_to_id("definitely not a token").has_value());
  CHECK(t.token_to_id("\xC4\xA0") == t.encode(" ", {.add_special_tokens = false}).at(0));  // "Ġ" is the space byte
  CHECK(t.vocab_size() == 2003);
  CHECK(contains(error_of([&] { t.decode(std::vector<std::int32_t>{5, 99999}); }), "[decode] token id 99999"));
  CHECK(contains(error_of([&] { (void)t.id_to_token(-1); }), "id_to_token"));

  // Streaming: bytes up to a complete character, the rest waits for the next id.
  const auto ids = t.encode("\xF0\x9F\xA6\x99 ok", {.add_special_tokens = false});
  std::string shown, pending;
  for (std::int32_t id : ids) {
    pending += t.decode_bytes(std::vector<std::int32_t>{id});
    const std::size_t n = nn::lm::utf8_complete_prefix(pending);
    shown += pending.substr(0, n);
    pending.erase(0, n);
  }
  CHECK(shown == "\xF0\x9F\xA6\x99 ok");
  CHECK(pending.empty());

  // bos/eos/pad from a tokenizer_config.json beside tokenizer.json.
  const auto dir = std::filesystem::temp_directory_path() / "nn_tokenizer_test_cfg";
  std::filesystem::create_directories(dir);
  std::filesystem::copy_file(std::string(NN_FIXTURES_DIR) + "/" + kDir + "trained_pair_merges.json", dir / "tokenizer.json",
                             std::filesystem::copy_options::overwrite_existing);
  {
    std::ofstream f(dir / "tokenizer_config.json");
    f << R"({"bos_token": "<|im_start|>", "eos_token": {"content": "<|im_end|>", "special": true}, "pad_token": "<|endoftext|>"})";
  }
  const Tokenizer c = Tokenizer::from_file((dir / "tokenizer.json").string());
  CHECK(c.bos_id() == 1);
  CHECK(c.eos_id() == 2);
  CHECK(c.pad_id() == 0);
  {
    std::ofstream f(dir / "tokenizer_config.json");
    f << R"({"eos_token": "<|nope|>"})";
  }
  CHECK(contains(error_of([&] { Tokenizer::from_file((dir / "tokenizer.json").string()); }), "eos_token"));
  std::filesystem::remove_all(dir);

  // Concurrent encodes agree: two threads on one tokenizer (one of them may find the word
  // cache busy and go without it) and a third on a copy (its own cache).
  Tokenizer copy = t;
  const std::string& text = sample_chunks().at(3);
  const auto want = t.encode(text);
  std::vector<std::int32_t> a, b, c2;
  std::thread th1([&] { for (int i = 0; i < 20; ++i) a = copy.encode(text); });
  std::thread th2([&] { for (int i = 0; i < 20; ++i) b = t.encode(text); });
  std::thread th3([&] { for (int i = 0; i < 20; ++i) c2 = t.encode(text); });
  th1.join();
  th2.join();
  th3.join();
  CHECK(a == want);
  CHECK(b == want);
  CHECK(c2 == want);
}

TEST_CASE("tokenizer: a merge listed twice") {
  // `tokenizers` keeps the last rank of a repeated pair (checked: "abc" -> ab c here), llama.cpp
  // the first (-> a bc).
  const json j = json::parse(R"({"added_tokens": [], "normalizer": null,
    "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
    "post_processor": null, "decoder": {"type": "ByteLevel"},
    "model": {"type": "BPE", "vocab": {"a": 0, "b": 1, "c": 2, "ab": 3, "bc": 4}, "merges": ["b c", "a b", "b c"]}})");
  CHECK(Tokenizer::from_json(j).encode("abc") == std::vector<std::int32_t>{3, 2});
  nn::lm::GgufTokenizerData d;
  d.pre = "gpt-2";
  d.tokens = {"a", "b", "c", "ab", "bc"};
  d.merges = {"b c", "a b", "b c"};
  CHECK(Tokenizer::from_gguf(d).encode("abc") == std::vector<std::int32_t>{0, 4});
}

TEST_CASE("tokenizer: malformed tokenizer.json names the file and the field") {
  const json good = fixture(kDir + "trained_pair_merges.json");
  auto err = [](const json& j) { return error_of([&] { Tokenizer::from_json(j, "bad/tokenizer.json"); }); };
  json j = good;
  j.erase("model");
  CHECK(contains(err(j), "[bad/tokenizer.json] model: missing"));
  j = good;
  j["model"].erase("vocab");
  CHECK(contains(err(j), "[bad/tokenizer.json] model.vocab: missing"));
  j = good;
  j["model"].erase("merges");
  CHECK(contains(err(j), "[bad/tokenizer.json] model.merges: missing"));
  j = good;
  j["model"]["merges"][7] = json::array({"\xC4\xA0", "zzzunknown"});
  CHECK(contains(err(j), "model.merges[7]: token 'zzzunknown' is not in the vocabulary"));
  j = good;
  j["model"]["merges"][3] = "onlyone";
  CHECK(contains(err(j), "model.merges[3]"));
  j = good;
  j["model"]["type"] = "Unigram";
  CHECK(contains(err(j), "model.type: unsupported tokenizer model 'Unigram'"));
  j = good;
  j["model"]["type"] = "WordPiece";
  CHECK(contains(err(j), "model.type: unsupported tokenizer model 'WordPiece'"));
  j = good;
  j["normalizer"] = {{"type", "Lowercase"}};
  CHECK(contains(err(j), "normalizer.type: unsupported normalizer 'Lowercase'"));
  j = good;
  j["pre_tokenizer"] = {{"type", "Whitespace"}};  // tokenizers' own character classes: left out
  CHECK(contains(err(j), "pre_tokenizer.type: unsupported pre-tokenizer 'Whitespace'"));
  j = good;
  j["pre_tokenizer"] = {{"type", "CharDelimiterSplit"}, {"delimiter", " "}};
  CHECK(contains(err(j), "pre_tokenizer.type: unsupported pre-tokenizer 'CharDelimiterSplit'"));
  j = good;
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", "(?<=x)y"}}}, {"behavior", "Isolated"}};
  CHECK(contains(err(j), "pre_tokenizer.pattern"));
  j = good;
  j["added_tokens"][0].erase("id");
  CHECK(contains(err(j), "added_tokens[0]"));
  CHECK(contains(error_of([] { Tokenizer::from_file("/nonexistent/tokenizer.json"); }), "[tokenizer] /nonexistent/tokenizer.json: cannot open"));
  j = good;
  j["pre_tokenizer"] = {{"type", "Split"}, {"pattern", {{"Regex", " "}}}, {"behavior", "Isolated"}};
  CHECK(contains(err(j), "pre_tokenizer: neither byte-level BPE"));
  j = good;
  j["decoder"] = {{"type", "WordPiece"}};
  CHECK(contains(err(j), "decoder.type: unsupported decoder 'WordPiece'"));
  j = good;
  j["post_processor"] = {{"type", "TemplateProcessing"}, {"single", json::array({{{"SpecialToken", {{"id", "<nope>"}}}}})}};
  CHECK(contains(err(j), "post_processor.single[0]"));
  // Found by tests/fuzz/tokenizer_fuzz.cpp: a template's special_tokens ids went into every
  // encoding unchecked (an id past the vocabulary, which decode then refused). Found reading the
  // code for it: a non-integer id escaped as nlohmann's exception, an added token's id was
  // truncated to int32, and ids far past the vocabulary sized the tables by the id.
  const json tmpl = {{"type", "TemplateProcessing"},
                     {"single", json::array({{{"SpecialToken", {{"id", "<s>"}}}}, {{"Sequence", {{"id", "A"}}}}})},
                     {"special_tokens", {{"<s>", {{"id", "<s>"}, {"ids", json::array({999999})}, {"tokens", json::array({"<s>"})}}}}}};
  j = good;
  j["post_processor"] = tmpl;
  CHECK(contains(err(j), "[bad/tokenizer.json] post_processor.special_tokens.<s>.ids: id 999999 is not in the vocabulary"));
  j["post_processor"]["special_tokens"]["<s>"]["ids"] = json::array({"0"});
  CHECK(contains(err(j), "post_processor.special_tokens.<s>.ids: id \"0\" is not in the vocabulary"));
  j = good;
  j["added_tokens"][0]["id"] = 4294967296 + 5;  // truncated to 5 before
  CHECK(contains(err(j), "added_tokens[0].id: id 4294967301 is out of range"));
  j = good;
  j["added_tokens"][0]["id"] = 2000000000;
  CHECK(contains(err(j), "id 2000000000 of token '<|endoftext|>' lies more than 2^20 past the"));
  // The audit: an empty added token, and two added tokens with one id, were accepted.
  j = good;
  j["added_tokens"][0]["content"] = "";
  CHECK(contains(err(j), "added_tokens[0].content: an added token cannot be empty"));
  j = good;
  j["added_tokens"].push_back(j["added_tokens"][0]);
  j["added_tokens"].back()["content"] = "<|other|>";
  CHECK(contains(err(j), "added_tokens[" + std::to_string(j["added_tokens"].size() - 1) + "].id: id "));
  CHECK(contains(err(j), "is also added_tokens[0]'s"));
  const Tokenizer empty;  // default-constructed: no vocabulary, nothing to encode with
  CHECK(empty.encode("abc").empty());
  CHECK(empty.vocab_size() == 0);
}

// The ~1 MB check against the full real vocabularies: runs when the generator's --full output
// is named by NN_TOKENIZER_FULL_DIR (it is not committed: the real files are 1.4-7 MB each).
TEST_CASE("tokenizer: full corpus (NN_TOKENIZER_FULL_DIR)") {
  const char* dir = std::getenv("NN_TOKENIZER_FULL_DIR");
  if (!dir) {
    MESSAGE("NN_TOKENIZER_FULL_DIR not set: the 1 MB check is skipped (tests/oracle/gen_tokenizer.py --full DIR)");
    return;
  }
  auto read = [&](const std::string& f) {
    std::ifstream in(std::string(dir) + "/" + f);
    REQUIRE_MESSAGE(in, "missing ", dir, "/", f);
    return json::parse(in);
  };
  const bool byte_level = std::filesystem::exists(std::string(dir) + "/expected.json");  // gen_tokenizer.py --full
  const json exp = byte_level ? read("expected.json") : json::object({{"tokenizers", json::object()}});
  const auto chunks = byte_level ? read("corpus.json").at("chunks").get<std::vector<std::string>>() : std::vector<std::string>{};
  for (auto it = exp["tokenizers"].begin(); it != exp["tokenizers"].end(); ++it) {
    const std::string name = it.key();
    const Tokenizer t = Tokenizer::from_file(std::string(dir) + "/" + it.value()["file"].get<std::string>());
    const bool nfc = name == "real_qwen2" || name == "trained_qwen2";
    const auto t0 = std::chrono::steady_clock::now();
    const bool lossy = name == "trained_roberta" || name == "trained_whitespace";
    check_chunks(t, chunks, it.value()["chunks"], nfc, "full/" + name, &exp["sections"], lossy);
    const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    MESSAGE("full/", name, ": checked in ", s, " s");
  }
  // SentencePiece-style (tests/oracle/gen_spm_tokenizer.py --full DIR), when its files are there.
  if (!std::filesystem::exists(std::string(dir) + "/spm_expected.json")) return;
  const json sexp = read("spm_expected.json");
  const json sbase = read("spm_tokenizer.json");
  const auto schunks = read("spm_corpus.json").at("chunks").get<std::vector<std::string>>();
  for (auto it = sexp["variants"].begin(); it != sexp["variants"].end(); ++it) {
    const Tokenizer t = Tokenizer::from_json(with_overrides(sbase, it.value()["overrides"]), "spm_tokenizer.json");
    check_chunks(t, schunks, it.value()["chunks"], false, "full/spm_" + it.key(), nullptr, true);
  }
  const Tokenizer g = Tokenizer::from_gguf(spm_gguf(sexp["gguf"]), "spm.gguf");
  check_chunks(g, schunks, sexp["variants"]["llama"]["chunks"], false, "full/spm_gguf", nullptr, true);
}

}  // namespace lm_tokenizer
