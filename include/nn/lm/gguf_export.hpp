// SPDX-License-Identifier: MIT OR Apache-2.0
// Back to llama.cpp: a (fused) model as a GGUF file that llama.cpp, ollama and LM Studio run, and
// a LoRA adapter in llama.cpp's GGUF LoRA format (`llama-cli --lora`).
//
// save_gguf writes every tensor of a float model (fuse LoRA layers and dequantize a quantized
// base first) under llama.cpp's names (load.hpp's GgufNames), with Llama's q/k rows permuted as
// convert_hf_to_gguf.py permutes them, in the types an --outtype picks:
//   f32 | f16 | bf16      every matrix in that type, 1-D tensors (norms, biases) in F32, as
//                         convert_hf_to_gguf.py writes them;
//   q8_0 | q4_0 | q4_k_m | q5_k_m   llama-quantize's mixtures (llama-quant.cpp's
//                         llama_tensor_get_type, no importance matrix), gguf_mixture_type below;
//   same                  each tensor in the source GGUF's type for it.
// The metadata (architecture, hyperparameters, tokenizer, chat template) is carried over from the
// source GGUF key for key, or built from a Hugging Face folder as convert_hf_to_gguf.py builds it
// (config.json's hyperparameters; tokenizer.json's vocabulary, merges and added tokens, its
// pre-tokenizer named as llama.cpp names it; tokenizer_config.json's special tokens and chat
// template); general.file_type and general.quantization_version are set anew.
//
// save_gguf_adapter writes llama.cpp's adapter file, the layout convert_lora_to_gguf.py writes
// from a PEFT adapter: general.type = "adapter", adapter.type = "lora", adapter.lora.alpha, and
// per adapted matrix W (out, in) of llama.cpp name N: N.lora_a (r, in) and N.lora_b (out, r)
// (PEFT's lora_A / lora_B; ggml ne reversed), q/k's lora_b rows permuted as W's. llama.cpp
// applies W + (alpha / r) · lora_b · lora_a, so alpha = effective scale · r.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <filesystem>
#include <fstream>
#include <map>
#include <string>
#include <vector>

#include "../backend/cpu.hpp"  // the GTape<cpu> the writers record on
#include "../tape.hpp"
#include "adapters.hpp"
#include "gguf.hpp"
#include "gguf_quantize.hpp"
#include "gguf_write.hpp"
#include "load.hpp"
#include "model.hpp"
#include "tokenizer.hpp"

namespace nn::lm {

/// The --outtype values save_gguf takes.
inline const std::vector<std::string>& gguf_outtypes() {
  static const std::vector<std::string> v{"f32", "f16", "bf16", "q8_0", "q4_0", "q4_k_m", "q5_k_m", "same"};
  return v;
}

namespace detail {

inline std::uint32_t ggml_block(std::uint32_t type) { return ggml_type_info(type)->block; }

/// llama.cpp's llama_ftype for general.file_type.
inline std::uint32_t gguf_file_type(const std::string& outtype) {
  static const std::map<std::string, std::uint32_t> m{{"f32", 0}, {"f16", 1}, {"q4_0", 2}, {"q8_0", 7},
                                                      {"q4_k_m", 15}, {"q5_k_m", 17}, {"bf16", 32}};
  return m.at(outtype);
}

}  // namespace detail

/// The ggml type llama.cpp gives tensor `name` (llama.cpp's name; `row` = ne[0], its row length;
/// `dims` its dimension count) in mixture `outtype` (not "same"); `layer` / `n_layers` place a
/// blk.N tensor; `tied` says token_embd is also the output matrix. As llama-quant.cpp:
///   1-D tensors and norms stay F32; f32 / f16 / bf16 put every matrix in that type;
///   the output matrix (output.weight, or token_embd when tied) takes Q6_K, unless its rows do
///   not split into the mixture's blocks (then Q8_0) or the mixture is q8_0;
///   q4_k_m: attn_v and ffn_down of the layers use_more_bits picks (the first and last eighth,
///   every third between) take Q6_K; q5_k_m: the same; everything else the mixture's base type
///   (Q8_0, Q4_0, Q4_K, Q5_K);
///   then rows that do not split into 256 fall back: Q4_K -> Q5_0, Q5_K -> Q5_1, Q6_K -> Q8_0,
///   and a type still not fitting (rows not a multiple of 32) -> F16.
inline std::uint32_t gguf_mixture_type(const std::string& outtype, const std::string& name, std::int64_t row, int dims,
                                       int layer, int n_layers, bool tied) {
  constexpr std::uint32_t F32 = 0, F16 = 1, Q4_0 = 2, Q5_0 = 6, Q5_1 = 7, Q8_0 = 8, Q4_K = 12, Q5_K = 13, Q6_K = 14, BF16 = 30;
  const bool matrix = dims >= 2 && name.ends_with("weight") && name.find("_norm.weight") == std::string::npos;
  if (!matrix) return F32;
  if (outtype == "f32") return F32;
  if (outtype == "f16") return F16;
  if (outtype == "bf16") return BF16;
  std::uint32_t t = outtype == "q8_0" ? Q8_0 : outtype == "q4_0" ? Q4_0 : outtype == "q4_k_m" ? Q4_K
                  : outtype == "q5_k_m" ? Q5_K : 0;
  if (t == 0) nn::detail::fail("gguf", "unknown --outtype '", outtype, "' (f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m same)");
  const bool km = outtype == "q4_k_m" || outtype == "q5_k_m";
  auto use_more_bits = [](int i, int n) { return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2; };
  if (name == "output.weight" || (tied && name == "token_embd.weight")) {
    if (row % detail::ggml_block(t) != 0) t = Q8_0;
    else if (t != Q8_0) t = Q6_K;
  } else if (name.ends_with(".attn_v.weight") || name.ends_with(".ffn_down.weight")) {
    if (km && use_more_bits(layer, n_layers)) t = Q6_K;
  }
  if (row % detail::ggml_block(t) != 0) {
    t = t == Q4_K ? Q5_0 : t == Q5_K ? Q5_1 : t == Q6_K ? Q8_0 : t;
    if (row % detail::ggml_block(t) != 0) t = F16;
  }
  return t;
}

struct GgufExportReport {
  std::map<std::string, int> types;  // ggml type name -> tensor count
  std::uint64_t bytes = 0;           // tensor data
};

/// The metadata of a GGUF written from a model loaded from `source`: every key but
/// general.file_type, general.quantization_version and general.alignment, type for type.
inline GgufWriter gguf_metadata(const GgufFile& source) {
  GgufWriter w;
  for (const auto& [key, v] : source.metadata())
    if (key != "general.file_type" && key != "general.quantization_version" && key != "general.alignment") w.copy(key, v);
  return w;
}

namespace detail {

inline nlohmann::json gguf_read_json(const std::filesystem::path& p) { return read_json_file(p, "gguf"); }

/// llama.cpp's name (tokenizer.ggml.pre) for a tokenizer.json pre-tokenizer, as
/// convert_hf_to_gguf.py identifies it: GPT-2's byte-level regex alone ("gpt-2"), digits split
/// one by one before it (SmolLM's, "smollm"), or Llama 3's / Qwen2's split regex ("llama-bpe",
/// "qwen2"). Anything else raises naming it.
inline std::string gguf_pre_name(const nlohmann::json& pre, const std::string& where) {
  static const std::string llama3 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  static const std::string qwen2 = R"((?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+)";
  auto type = [](const nlohmann::json& j) { return j.is_object() ? j.value("type", std::string()) : std::string(); };
  auto byte_level = [&](const nlohmann::json& j, bool regex) { return type(j) == "ByteLevel" && j.value("use_regex", true) == regex; };
  if (byte_level(pre, true)) return "gpt-2";
  if (type(pre) == "Sequence" && pre.contains("pretokenizers") && pre["pretokenizers"].size() == 2) {
    const nlohmann::json &a = pre["pretokenizers"][0], &b = pre["pretokenizers"][1];
    if (type(a) == "Digits" && a.value("individual_digits", false) && byte_level(b, true)) return "smollm";
    if (type(a) == "Split" && a.contains("pattern") && a["pattern"].contains("Regex") && byte_level(b, false)) {
      const std::string r = a["pattern"]["Regex"].get<std::string>();
      if (r == llama3) return "llama-bpe";
      if (r == qwen2) return "qwen2";
    }
  }
  nn::detail::fail("gguf", where, ": the pre-tokenizer ", pre.dump().substr(0, 200),
                   " has no llama.cpp name nn knows (GPT-2's, SmolLM's, Llama 3's and Qwen2's have)");
}

}  // namespace detail

/// The metadata of a GGUF written from a model loaded from the Hugging Face folder `folder` (its
/// config `c`), as convert_hf_to_gguf.py writes it: <arch>.* hyperparameters and the tokenizer --
/// tokens by id (padded to the model's vocabulary with [PAD<i>], type unused), token types
/// (special added tokens control, other added tokens user-defined), BOS / EOS / padding ids,
/// whether BOS is added, and tokenizer_config.json's chat template. A byte-level BPE becomes a
/// "gpt2" tokenizer (merges, the pre-tokenizer's llama.cpp name); a SentencePiece-style one
/// (Llama 2, Mistral, TinyLlama) a "llama" tokenizer: byte tokens typed byte, <unk> unknown,
/// add_space_prefix, and scores that make llama.cpp's rule (join the pair whose joined text scores
/// highest) follow the merges: a token scores minus the rank of the first merge that makes it.
/// (llama.cpp also joins a pair whose text is a token no merge makes; a tokenizer.json converted
/// from SentencePiece lists a merge for every such pair.)
inline GgufWriter gguf_metadata_hf(const std::filesystem::path& folder, const ModelConfig& c) {
  const std::string where = (folder / "tokenizer.json").string();
  const nlohmann::json tj = detail::gguf_read_json(folder / "tokenizer.json");
  const Tokenizer tok = Tokenizer::from_file(where);
  const std::string a = gguf_arch_name(c.arch);
  if (!c.rope_freq_factors.empty() || (c.rope_scaling.type != "default" && !c.rope_scaling.type.empty() && c.rope_scaling.type != "linear"))
    nn::detail::fail("gguf", folder.string(), ": rope_scaling '", c.rope_scaling.type, "' is not written (default, linear are)");
  GgufWriter w;
  w.set("general.architecture", a);
  w.set("general.type", "model");
  w.set("general.name", folder.filename().string().empty() ? folder.parent_path().filename().string() : folder.filename().string());
  w.set(a + ".vocab_size", static_cast<std::uint32_t>(c.vocab_size));
  w.set(a + ".context_length", static_cast<std::uint32_t>(c.max_position_embeddings));
  w.set(a + ".embedding_length", static_cast<std::uint32_t>(c.hidden_size));
  w.set(a + ".block_count", static_cast<std::uint32_t>(c.num_hidden_layers));
  w.set(a + ".feed_forward_length", static_cast<std::uint32_t>(c.intermediate_size));
  w.set(a + ".attention.head_count", static_cast<std::uint32_t>(c.num_attention_heads));
  w.set(a + ".attention.head_count_kv", static_cast<std::uint32_t>(c.num_key_value_heads));
  w.set(a + ".rope.freq_base", static_cast<float>(c.rope_theta));
  w.set(a + ".attention.layer_norm_rms_epsilon", static_cast<float>(c.rms_norm_eps));
  w.set(a + ".rope.dimension_count", static_cast<std::uint32_t>(c.head_dim));
  if (c.head_dim * c.num_attention_heads != c.hidden_size) {
    w.set(a + ".attention.key_length", static_cast<std::uint32_t>(c.head_dim));
    w.set(a + ".attention.value_length", static_cast<std::uint32_t>(c.head_dim));
  }
  // Phi-3 only: Mistral goes out as "llama", and llama.cpp's qwen2 / qwen3 graphs have no window
  // either (convert_hf_to_gguf.py writes none for them)
  if (c.sliding_window > 0 && c.arch == Arch::phi3)
    w.set(a + ".attention.sliding_window", static_cast<std::uint32_t>(c.sliding_window));
  if (c.rope_scaling.type == "linear") {
    w.set(a + ".rope.scaling.type", "linear");
    w.set(a + ".rope.scaling.factor", static_cast<float>(c.rope_scaling.factor));
  }
  // The vocabulary by id: model tokens in their byte-level form, added tokens as written.
  const auto n = static_cast<std::int32_t>(std::max<std::int64_t>(c.vocab_size, static_cast<std::int64_t>(tok.vocab_size())));
  std::vector<std::string> tokens(static_cast<std::size_t>(n));
  std::vector<std::int32_t> types(static_cast<std::size_t>(n), 1);
  for (std::int32_t i = 0; i < n; ++i) {
    std::string t;
    if (static_cast<std::size_t>(i) < tok.vocab_size()) try {
        t = tok.id_to_token(i);
      } catch (const nn::Error&) {  // an id the vocabulary skips
      }
    if (t.empty()) {
      t = "[PAD" + std::to_string(i) + "]";
      types[static_cast<std::size_t>(i)] = 5;
    }
    tokens[static_cast<std::size_t>(i)] = std::move(t);
  }
  for (const AddedToken& t : tok.added_tokens())
    if (t.id >= 0 && t.id < n) types[static_cast<std::size_t>(t.id)] = t.special ? 3 : 4;
  std::vector<std::pair<std::string, std::string>> merges;
  if (tj.contains("model") && tj["model"].contains("merges"))
    for (const auto& m : tj["model"]["merges"]) {
      if (!m.is_string()) {
        merges.emplace_back(m.at(0).get<std::string>(), m.at(1).get<std::string>());
        continue;
      }
      const std::string s = m.get<std::string>();
      const auto sp = s.find(' ', 1);
      merges.emplace_back(s.substr(0, sp), sp == std::string::npos ? std::string() : s.substr(sp + 1));
    }
  if (tok.sentencepiece()) {
    std::vector<float> scores(static_cast<std::size_t>(n), -1e9f);  // made by no merge: joined last, if ever
    std::vector<bool> scored(static_cast<std::size_t>(n), false);
    for (std::size_t r = 0; r < merges.size(); ++r)
      if (auto id = tok.token_to_id(merges[r].first + merges[r].second); id && *id < n && !scored[static_cast<std::size_t>(*id)]) {
        scores[static_cast<std::size_t>(*id)] = -static_cast<float>(r + 1);
        scored[static_cast<std::size_t>(*id)] = true;
      }
    for (std::int32_t i = 0; i < n; ++i)
      if (types[static_cast<std::size_t>(i)] == 1 && detail::spm_byte_token(tokens[static_cast<std::size_t>(i)]) >= 0)
        types[static_cast<std::size_t>(i)] = 6;
    if (tok.unk_id() && *tok.unk_id() < n) types[static_cast<std::size_t>(*tok.unk_id())] = 2;
    w.set("tokenizer.ggml.model", "llama");
    w.set_array("tokenizer.ggml.tokens", tokens);
    w.set_array("tokenizer.ggml.scores", scores);
    w.set_array("tokenizer.ggml.token_type", types);
    w.set("tokenizer.ggml.add_space_prefix", tok.space_prefix());
    if (tok.unk_id()) w.set("tokenizer.ggml.unknown_token_id", static_cast<std::uint32_t>(*tok.unk_id()));
  } else {
    std::vector<std::string> joined;
    for (const auto& [a, b] : merges) joined.push_back(a + " " + b);
    w.set("tokenizer.ggml.model", "gpt2");
    w.set("tokenizer.ggml.pre", detail::gguf_pre_name(tj.value("pre_tokenizer", nlohmann::json()), where));
    w.set_array("tokenizer.ggml.tokens", tokens);
    w.set_array("tokenizer.ggml.token_type", types);
    w.set_array("tokenizer.ggml.merges", joined);
  }
  if (tok.bos_id()) w.set("tokenizer.ggml.bos_token_id", static_cast<std::uint32_t>(*tok.bos_id()));
  if (tok.eos_id()) w.set("tokenizer.ggml.eos_token_id", static_cast<std::uint32_t>(*tok.eos_id()));
  if (tok.pad_id()) w.set("tokenizer.ggml.padding_token_id", static_cast<std::uint32_t>(*tok.pad_id()));
  w.set("tokenizer.ggml.add_bos_token", !tok.prefix_ids().empty());
  if (std::filesystem::exists(folder / "tokenizer_config.json")) {
    const nlohmann::json tc = detail::gguf_read_json(folder / "tokenizer_config.json");
    if (tc.contains("chat_template") && tc["chat_template"].is_string())
      w.set("tokenizer.chat_template", tc["chat_template"].get<std::string>());
  }
  return w;
}

/// Writes `model` (float weights: no LoRA, no quantized layers left) to `path` as a GGUF file in
/// `outtype` (gguf_outtypes()) with the metadata `meta` (gguf_metadata / gguf_metadata_hf).
/// `source` is the GGUF the model came from, if it did: "same" reads each tensor's type there
/// (from a Hugging Face folder, "same" is `same_type`, its torch_dtype), and a rope_freqs tensor is
/// carried over. Raises, leaving no file, for an architecture llama.cpp cannot name, a tensor with
/// no llama.cpp name, a LoRA or quantized layer still in the model, an outtype "same" type nn does
/// not write, and any write error.
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model, GgufWriter w,
                                  const std::string& outtype, const GgufFile* source, std::uint32_t same_type = 0) {
  const ModelConfig& c = model.config();
  const std::string arch = gguf_arch_name(c.arch);  // llama.cpp's names for the families (Mistral: llama)
  if (c.arch == Arch::gemma2 || c.arch == Arch::gemma3)
    nn::detail::fail("gguf", path.string(), ": writing Gemma ", c.arch == Arch::gemma2 ? 2 : 3,
                     " as GGUF is not supported (save_hf writes the folder, which llama.cpp's convert_hf_to_gguf.py converts)");
  if (source)
    if (const GgufValue* a = source->find("general.architecture"); a && a->is_string() && a->as_string() != arch)
      nn::detail::fail("gguf", path.string(), ": the source ", source->path(), " is a '", a->as_string(),
                       "' model, this one '", arch, "'");
  bool known = false;
  for (const std::string& o : gguf_outtypes()) known |= o == outtype;
  if (!known) nn::detail::fail("gguf", path.string(), ": unknown --outtype '", outtype, "' (f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m same)");
  w.set("general.architecture", arch);

  GgufExportReport report;
  const int n_layers = static_cast<int>(c.num_hidden_layers);
  bool quantized = false;
  for (const auto& [hf, t0] : model.parameters()) {
    if (hf.ends_with(".lora_a") || hf.ends_with(".lora_b"))
      nn::detail::fail("gguf", path.string(), ": the model still has LoRA layers (", hf, "): fuse them first");
    if (hf.ends_with(".scales") || hf.ends_with(".biases") || !is_floating(t0.dtype()))
      nn::detail::fail("gguf", path.string(), ": tensor \"", hf, "\" belongs to a quantized layer: dequantize the model first");
  }
  const NamedTensors params = detail::join_fused(c, model.parameters());  // Phi-3: attn_qkv, ffn_up
  for (const auto& [hf, t0] : params) {
    const std::string g = detail::hf_to_gguf_name(hf, path.string(), c.arch);
    Tensor t = t0.to(DType::f32);
    if (uses_llama_rope_layout(c.arch)) {  // llama.cpp runs Llama (and Mistral) with interleaved RoPE pairs
      if (g.find(".attn_q.") != std::string::npos) t = detail::permute_rows(t, c.num_attention_heads, g, true);
      if (g.find(".attn_k.") != std::string::npos) t = detail::permute_rows(t, c.num_key_value_heads, g, true);
    }
    int layer = -1;
    if (g.rfind("blk.", 0) == 0) layer = std::stoi(g.substr(4, g.find('.', 4) - 4));
    std::uint32_t type;
    if (outtype == "same" && !source) {
      type = t.rank() >= 2 ? same_type : 0;
    } else if (outtype == "same") {
      const GgufTensorInfo* src = source->find_tensor(g);
      if (!src) nn::detail::fail("gguf", path.string(), ": --outtype same, but the source has no tensor \"", g, "\"");
      type = src->type;
      if (!gguf_can_quantize(type))
        nn::detail::fail("gguf", path.string(), ": tensor \"", g, "\" is ", src->type_name(),
                         " in the source, a type nn does not write (F32 F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1 Q4_K Q5_K Q6_K); choose --outtype");
    } else {
      type = gguf_mixture_type(outtype, g, t.dim(t.rank() - 1), static_cast<int>(t.rank()), layer, n_layers,
                               c.tie_word_embeddings);
    }
    quantized |= ggml_type_info(type)->block > 1;
    std::vector<std::byte> bytes = gguf_quantize(t, type, g);
    report.bytes += bytes.size();
    ++report.types[ggml_type_info(type)->name];
    w.add_tensor(g, t.shape().vec(), type, std::move(bytes));
  }
  // llama.cpp's Llama 3 frequency remap is a tensor of its own; carried over as it was.
  if (const GgufTensorInfo* rf = source ? source->find_tensor("rope_freqs.weight") : nullptr) {
    const auto b = source->tensor_bytes(*rf);
    w.add_tensor(rf->name, rf->shape(), rf->type, std::vector<std::byte>(b.begin(), b.end()));
  }
  if (outtype == "same" && source) {
    if (const GgufValue* ft = source->find("general.file_type")) w.copy("general.file_type", *ft);
  } else if (outtype == "same") {
    w.set("general.file_type", std::uint32_t{same_type == 1 ? 1u : same_type == 30 ? 32u : 0u});
  } else {
    w.set("general.file_type", detail::gguf_file_type(outtype));
  }
  if (quantized) w.set("general.quantization_version", std::uint32_t{2});
  w.write(path);
  return report;
}

/// `model`, loaded from the GGUF `source`, with its metadata (see the overload above).
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model, const GgufFile& source,
                                  const std::string& outtype = "f16") {
  return save_gguf(path, model, gguf_metadata(source), outtype, &source);
}

/// `model`, loaded from the Hugging Face folder `folder`, with metadata from its config and
/// tokenizer files (gguf_metadata_hf); "same" is the checkpoint's torch_dtype (F32, F16, BF16).
inline GgufExportReport save_gguf(const std::filesystem::path& path, const CausalLM& model,
                                  const std::filesystem::path& folder, const std::string& outtype = "f16") {
  std::uint32_t same = 0;
  if (outtype == "same") {
    const nlohmann::json cfg = detail::gguf_read_json(folder / "config.json");
    const std::string dt = cfg.value("torch_dtype", cfg.value("dtype", std::string("float32")));
    same = dt == "bfloat16" ? 30u : dt == "float16" ? 1u : 0u;
  }
  return save_gguf(path, model, gguf_metadata_hf(folder, model.config()), outtype, nullptr, same);
}

/// Writes the LoRA layers of `model` (trained with `cfg`) as a llama.cpp GGUF LoRA adapter for a
/// base of architecture `arch` ("llama" / "qwen2" / "qwen3"; the base's general.architecture; not phi3). Factors in
/// F32. Raises, leaving no file, when the model has no LoRA layers or one has no llama.cpp name.
template <class M>
void save_gguf_adapter(const std::filesystem::path& path, const M& model, const LoraConfig& cfg, const ModelConfig& c) {
  if (c.arch == Arch::gemma2 || c.arch == Arch::gemma3)
    nn::detail::fail("gguf", path.string(), ": llama.cpp adapters for Gemma ", c.arch == Arch::gemma2 ? 2 : 3,
                     " are not written (use the mlx-lm or PEFT adapter, or fuse)");
  if (!detail::fused_projections(c).empty())
    nn::detail::fail("gguf", path.string(), ": llama.cpp's ", arch_name(c.arch), " graph has one attn_qkv and one ffn_up "
                     "matrix, and nn trains their parts as separate LoRA layers, which a llama.cpp adapter cannot name: "
                     "export the fused model instead (--fuse OUT.gguf)");
  GgufWriter w;
  w.set("general.architecture", gguf_arch_name(c.arch));
  w.set("general.type", "adapter");
  w.set("adapter.type", "lora");
  const double eff = cfg.rslora ? cfg.scale / std::sqrt(static_cast<double>(cfg.rank)) : cfg.scale;
  w.set("adapter.lora.alpha", static_cast<float>(eff * static_cast<double>(cfg.rank)));
  GTape<cpu> tp;
  int n = 0;
  for (auto& [p, v] : model.trainable_parameters()) {
    if (p.ends_with(".m"))  // a DoRA layer: llama.cpp's adapters add b·a to W, nothing rescales rows
      nn::detail::fail("gguf", path.string(), ": '", p, "' is a DoRA magnitude; llama.cpp's LoRA adapters cannot "
                       "express DoRA: fuse the model (DoraLinear::fused) and export that instead");
    const bool a = p.ends_with(".lora_a"), b = p.ends_with(".lora_b");
    if (!a && !b) continue;
    const std::string g = detail::hf_to_gguf_name(p.substr(0, p.size() - 7) + ".weight", path.string());
    // mlx-lm's factors (in, r) and (r, out), transposed to PEFT's (r, in) and (out, r).
    Tensor t = tp.value(transpose(tp, tp.constant(v))).to(DType::f32);
    if (b && uses_llama_rope_layout(c.arch)) {
      if (g.find(".attn_q.") != std::string::npos) t = detail::permute_rows(t, c.num_attention_heads, g, true);
      if (g.find(".attn_k.") != std::string::npos) t = detail::permute_rows(t, c.num_key_value_heads, g, true);
    }
    w.add_tensor(g + (a ? ".lora_a" : ".lora_b"), t.shape().vec(), 0, gguf_quantize(t, 0, g));
    ++n;
  }
  if (n == 0) nn::detail::fail("gguf", path.string(), ": the model has no LoRA layers to export");
  w.write(path);
}

}  // namespace nn::lm
