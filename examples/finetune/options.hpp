// SPDX-License-Identifier: MIT OR Apache-2.0
// The finetune program's options: mlx_lm.lora's flags with its meanings and defaults, its YAML
// config file (-c/--config; command-line flags override the file, as in mlx-lm), and nn's own
// flags. Parsed by CLI11 (generated --help, checked numbers naming the flag); the YAML read by
// yaml-cpp. Also the optimizer and learning-rate schedule the options name.
#pragma once

#include <nn/nn.hpp>
#include <nn/lm/adapters.hpp>
#include <nn/lm/gguf_export.hpp>

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>
#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstdint>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <set>
#include <string>
#include <vector>

namespace finetune {

/// mlx-lm's lr_schedule: an mlx.optimizers.schedulers function by name with its arguments,
/// behind an optional linear warm-up from warmup_init to arguments[0] over `warmup` steps.
struct LrSchedule {
  std::string name;
  std::vector<double> arguments;
  int warmup = 0;
  double warmup_init = 0.0;
};

struct Options {
  // ---- mlx_lm.lora's flags and config keys, with its defaults ----
  std::string model, data, fine_tune_type = "lora", optimizer = "adam", adapter_path = "adapters",
      resume_adapter_file, config;
  bool train = false, test = false, mask_prompt = false, grad_checkpoint = false;
  int num_layers = 16, batch = 4, iters = 1000, val_batches = 25, steps_per_report = 10, steps_per_eval = 200,
      grad_accum = 1, save_every = 100, test_batches = 500, max_seq_length = 2048;
  double lr = 1e-5;
  std::uint64_t seed = 0;
  // lora_parameters (rank, scale, dropout, keys): mlx-lm's defaults; no keys = every projection
  nn::lm::LoraConfig lora{.rank = 8, .scale = 20.0, .dropout = 0.0, .rslora = false, .num_layers = 16,
                          .keys = {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"}};
  std::optional<LrSchedule> lr_schedule;
  YAML::Node optimizer_config;  // {adam: {...}, adamw: {...}, ...}: keyword arguments per optimizer
  // ---- nn's own ----
  std::string schedule, prompt, fuse, logits_out, precision = "f32", outtype = "f16", export_adapter, chat_template = "auto",
      device = "cpu";
  int warmup = 0, threads = 0, max_tokens = 40;
  bool resume = false, resume_new_hyper = false, peft = true, dequantize = false, pack = false;

  /// Positions per row: mlx-lm's max_seq_length counts the extra token the last target needs.
  int positions() const { return max_seq_length - 1; }
};

namespace detail {

inline std::size_t edit_distance(const std::string& a, const std::string& b) {
  std::vector<std::size_t> row(b.size() + 1);
  for (std::size_t j = 0; j <= b.size(); ++j) row[j] = j;
  for (std::size_t i = 1; i <= a.size(); ++i) {
    std::size_t diag = row[0];
    row[0] = i;
    for (std::size_t j = 1; j <= b.size(); ++j) {
      const std::size_t up = row[j];
      row[j] = std::min({row[j] + 1, row[j - 1] + 1, diag + (a[i - 1] == b[j - 1] ? 0 : 1)});
      diag = up;
    }
  }
  return row[b.size()];
}

/// "; did you mean X?" for the closest of `names` within a third of the word's length (or "").
inline std::string did_you_mean(const std::string& word, const std::vector<std::string>& names) {
  std::string best;
  std::size_t bd = std::max<std::size_t>(2, word.size() / 3) + 1;
  for (const auto& n : names)
    if (const std::size_t d = edit_distance(word, n); d < bd) bd = d, best = n;
  return best.empty() ? "" : "; did you mean " + best + "?";
}

/// Every long flag name of the app ("--batch-size", "--batch", ...).
inline std::vector<std::string> long_names(const CLI::App& app) {
  std::vector<std::string> out;
  for (const CLI::Option* o : app.get_options())
    for (const auto& n : o->get_lnames()) out.push_back("--" + n);
  return out;
}

/// A YAML scalar or flat sequence as CLI11 inputs ("key: [a, b]" -> {"a", "b"}).
inline std::vector<std::string> yaml_inputs(const YAML::Node& v, const std::string& key, const std::string& file) {
  std::vector<std::string> in;
  if (v.IsScalar()) in.push_back(v.as<std::string>());
  else if (v.IsSequence())
    for (const auto& e : v) {
      if (!e.IsScalar()) nn::detail::fail("finetune", file, ": ", key, " must be a list of values");
      in.push_back(e.as<std::string>());
    }
  else nn::detail::fail("finetune", file, ": ", key, " must be a value or a list of values");
  return in;
}

/// A CLI11 check that the value is a number (a whole one with `integer`) of at least `lo`, with
/// messages that say so (CLI11 prefixes the flag's name).
inline CLI::Validator at_least(double lo, bool integer = true) {
  return CLI::Validator(
      [lo, integer](std::string& s) -> std::string {
        const char* b = s.c_str();
        char* end = nullptr;
        const double v = integer ? static_cast<double>(std::strtoll(b, &end, 10)) : std::strtod(b, &end);
        if (s.empty() || end != b + s.size() || !std::isfinite(v))
          return std::string(integer ? "expects a whole number" : "expects a number") + ", got '" + s + "'";
        if (v < lo) return "must be at least " + CLI::detail::to_string(lo) + ", got " + s;
        return "";
      },
      std::string(integer ? "INT" : "NUMBER") + " >= " + CLI::detail::to_string(lo));
}

/// mlx-lm's lora_config.yaml as CLI11 config items. Top-level keys are the flags with '-' for
/// '_' (batch_size -> --batch-size); lora_parameters' rank/scale/dropout/keys are the --rank
/// --scale --dropout --keys flags; lr_schedule and optimizer_config are kept in the Options. A
/// null value is as if the key were absent (mlx-lm's `resume_adapter_file: null`). CLI11 applies
/// an item only to a flag the command line did not give.
class YamlConfig : public CLI::Config {
 public:
  YamlConfig(const CLI::App& app, Options& o) : app_(&app), o_(&o) {}

  std::string to_config(const CLI::App*, bool, bool, std::string) const override { return ""; }

  std::vector<CLI::ConfigItem> from_config(std::istream& in) const override {
    const std::string file = o_->config;
    YAML::Node root;
    try {
      root = YAML::Load(in);
    } catch (const YAML::Exception& e) {
      nn::detail::fail("finetune", file, ": not valid YAML: ", e.what());
    }
    if (root.IsNull()) return {};
    if (!root.IsMap()) nn::detail::fail("finetune", file, ": expected a mapping of option names to values");
    const std::vector<std::string> flags = long_names(*app_);
    std::vector<std::string> keys = {"lora_parameters", "lr_schedule", "optimizer_config", "training_mode"};
    for (const auto& f : flags) {
      std::string k = f.substr(2);
      std::replace(k.begin(), k.end(), '-', '_');
      keys.push_back(k);
    }
    std::vector<CLI::ConfigItem> items;
    for (const auto& kv : root) {
      const std::string key = kv.first.as<std::string>();
      const YAML::Node& v = kv.second;
      if (v.IsNull()) continue;
      if (key == "lora_parameters") {
        if (!v.IsMap()) nn::detail::fail("finetune", file, ": lora_parameters must be a mapping");
        for (const auto& p : v) {
          const std::string pk = p.first.as<std::string>();
          if (pk != "rank" && pk != "scale" && pk != "dropout" && pk != "keys")
            nn::detail::fail("finetune", file, ": lora_parameters.", pk, " is not one of rank, scale, dropout, keys",
                             pk == "alpha" ? " (mlx-lm's LoRA config uses scale, PEFT's lora_alpha / r)" : "");
          if (!p.second.IsNull()) items.push_back({{}, pk, yaml_inputs(p.second, "lora_parameters." + pk, file)});
        }
      } else if (key == "lr_schedule") {
        o_->lr_schedule = parse_schedule(v, file);
      } else if (key == "optimizer_config") {
        if (!v.IsMap()) nn::detail::fail("finetune", file, ": optimizer_config must be a mapping");
        o_->optimizer_config = YAML::Clone(v);
      } else if (key == "training_mode") {
        if (!v.IsScalar() || v.as<std::string>() != "normal")
          nn::detail::fail("finetune", file, ": training_mode '", v.IsScalar() ? v.as<std::string>() : "?",
                           "' is not supported (normal only)");
      } else if (key == "hf_dataset") {
        nn::detail::fail("finetune", file, ": hf_dataset needs the Hugging Face hub; give data: a folder of JSONL files");
      } else {
        if (std::find(keys.begin(), keys.end(), key) == keys.end())
          nn::detail::fail("finetune", file, ": unknown option '", key, "'", did_you_mean(key, keys));
        std::string name = key;
        std::replace(name.begin(), name.end(), '_', '-');
        items.push_back({{}, name, yaml_inputs(v, key, file)});
      }
    }
    return items;
  }

 private:
  static LrSchedule parse_schedule(const YAML::Node& v, const std::string& file) {
    if (!v.IsMap()) nn::detail::fail("finetune", file, ": lr_schedule must be a mapping (name, arguments, warmup, warmup_init)");
    LrSchedule s;
    for (const auto& p : v) {
      const std::string k = p.first.as<std::string>();
      try {
        if (k == "name") s.name = p.second.as<std::string>();
        else if (k == "warmup") s.warmup = p.second.as<int>();
        else if (k == "warmup_init") s.warmup_init = p.second.as<double>();
        else if (k == "arguments") s.arguments = p.second.as<std::vector<double>>();
        else nn::detail::fail("finetune", file, ": lr_schedule.", k, " is not one of name, arguments, warmup, warmup_init");
      } catch (const YAML::Exception&) {
        nn::detail::fail("finetune", file, ": lr_schedule.", k, " has the wrong type");
      }
    }
    if (s.name.empty() || s.arguments.empty()) nn::detail::fail("finetune", file, ": lr_schedule needs name and arguments");
    return s;
  }
  const CLI::App* app_;
  Options* o_;
};

}  // namespace detail

/// Parses the command line (and the -c/--config file). --help prints the generated help and
/// exits 0; anything wrong is an nn::Error naming the flag or key.
inline Options parse_options(int argc, char** argv) {
  Options o;
  CLI::App app{"finetune: LoRA, QLoRA or full finetuning of a Llama / Qwen2 / SmolLM model from Hugging Face or GGUF "
               "files on JSONL data, with mlx_lm.lora's flags and config file; writes adapters that mlx-lm and PEFT load.",
               "finetune"};
  app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);  // the last given wins, as argparse
  app.allow_extras();  // unknown flags are reported below, with the closest known one
  app.get_formatter()->column_width(40);
  int seq = 0;
  std::vector<std::string> keys;
  // mlx_lm.lora's flags (the short names before them stay as aliases)
  app.add_option("--model", o.model, "A Hugging Face folder (config.json, model.safetensors, tokenizer.json) or a .gguf file");
  app.add_flag("--train", o.train, "Train (the default when neither --train nor --test is given)");
  app.add_option("--data", o.data,
                 "JSONL: DIR/{train,valid,test}.jsonl, or one file split 90/10; records {text} | {prompt, completion} | "
                 "{messages[, tools]} (through the model's chat template)");
  app.add_option("--fine-tune-type", o.fine_tune_type, "lora, dora or full")
      ->check(CLI::IsMember({"lora", "dora", "full"}))->capture_default_str();
  app.add_option("--optimizer", o.optimizer, "adam, adamw, muon, sgd or adafactor (options: the config's optimizer_config)")
      ->check(CLI::IsMember({"adam", "adamw", "muon", "sgd", "adafactor"}))->capture_default_str();
  app.add_flag("--mask-prompt", o.mask_prompt, "Loss on the completion / the last assistant message only");
  app.add_option("--num-layers,--layers", o.num_layers, "The last N decoder layers to train, -1 all")
      ->check(detail::at_least(-1))->capture_default_str();
  app.add_option("--batch-size,--batch", o.batch, "Minibatch size (the global batch under mpirun)")
      ->check(detail::at_least(1))->capture_default_str();
  app.add_option("--iters", o.iters, "Iterations to train for")->check(detail::at_least(1))->capture_default_str();
  app.add_option("--val-batches", o.val_batches, "Validation batches, -1 the whole validation set")
      ->check(detail::at_least(-1))->capture_default_str();
  app.add_option("--learning-rate,--lr", o.lr, "The learning rate")->check(detail::at_least(0, false))->capture_default_str();
  app.add_option("--steps-per-report", o.steps_per_report, "Steps between loss reports")
      ->check(detail::at_least(1))->capture_default_str();
  app.add_option("--steps-per-eval,--val-every", o.steps_per_eval, "Steps between validations (0: only at the end)")
      ->check(detail::at_least(0))->capture_default_str();
  app.add_option("--grad-accumulation-steps,--grad-accum", o.grad_accum, "Micro-batches accumulated per update")
      ->check(detail::at_least(1))->capture_default_str();
  app.add_option("--resume-adapter-file", o.resume_adapter_file, "Start from these adapter weights (an adapters.safetensors)");
  app.add_option("--adapter-path", o.adapter_path, "Where the adapters, checkpoint and logs go")->capture_default_str();
  app.add_option("--save-every", o.save_every, "Save every N iterations (0: at the end only)")
      ->check(detail::at_least(0))->capture_default_str();
  app.add_flag("--test", o.test, "Report the test loss and perplexity (DATA/test.jsonl) after training");
  app.add_option("--test-batches", o.test_batches, "Test batches, -1 the whole test set")
      ->check(detail::at_least(-1))->capture_default_str();
  app.add_option("--max-seq-length", o.max_seq_length, "Tokens per example (longer ones are truncated)")
      ->check(detail::at_least(3))->capture_default_str();
  app.set_config("-c,--config", "", "A YAML file in mlx_lm.lora's format (flags given here override it)")
      ->check(CLI::ExistingFile);
  app.add_flag("--grad-checkpoint", o.grad_checkpoint,
               "Recompute each decoder layer in the backward pass: less memory, the same gradients");
  app.add_option("--seed", o.seed, "The seed (data order, LoRA initialisation, dropout)")->capture_default_str();
  // lora_parameters, as flags
  app.add_option("--rank", o.lora.rank, "LoRA rank")->check(detail::at_least(1))->capture_default_str();
  app.add_option("--scale", o.lora.scale, "LoRA scale (PEFT's lora_alpha / r)")->capture_default_str();
  app.add_option("--dropout", o.lora.dropout, "LoRA dropout")->check(CLI::Range(0.0, 0.999))->capture_default_str();
  app.add_option("--keys", keys,
                 "Projections to adapt: q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj or paths in a layer "
                 "(default: all seven)")
      ->delimiter(',');
  app.add_flag("--rslora", o.lora.rslora, "rsLoRA: the multiplier is scale / sqrt(rank)");
  // nn's own
  app.add_option("--seq", seq, "Positions per row, T (= --max-seq-length T+1)")->check(detail::at_least(2));
  app.add_option("--schedule", o.schedule,
                 "cosine or constant, after --warmup; overrides the config's lr_schedule (default: constant)")
      ->check(CLI::IsMember({"cosine", "constant"}));
  app.add_option("--warmup", o.warmup, "Linear warm-up steps from 0")->check(detail::at_least(0));
  app.add_flag("--resume", o.resume, "Continue from ADAPTER_PATH/checkpoint.safetensors (the run's flags, checked)");
  app.add_flag("--resume-new-hyperparameters", o.resume_new_hyper, "--resume with other schedule/optimizer flags on purpose");
  app.add_flag("--no-peft{false}", o.peft, "Do not write the PEFT copy of the adapters");
  app.add_option("--threads", o.threads, "Threads (0: all)")->check(detail::at_least(0));
  app.add_option("--prompt", o.prompt, "Generate from this prompt before and after training");
  app.add_option("--chat-template", o.chat_template,
                 "How {messages} / {prompt, completion} render: auto (the model's own tokenizer.chat_template, "
                 "else ChatML), chatml, or a .jinja file")
      ->capture_default_str();
  app.add_option("--max-tokens", o.max_tokens, "Tokens to generate")->check(detail::at_least(0))->capture_default_str();
  app.add_option("--fuse", o.fuse, "Write the merged model: a Hugging Face folder, or OUT.gguf for llama.cpp");
  app.add_option("--outtype", o.outtype, "The fused GGUF's types")
      ->check(CLI::IsMember(nn::lm::gguf_outtypes()))->capture_default_str();
  app.add_option("--export-adapter", o.export_adapter, "The LoRA as a llama.cpp GGUF adapter (OUT.gguf)");
  app.add_flag("--dequantize", o.dequantize, "A quantized base in float32 (by default it stays quantized: QLoRA)");
  app.add_option("--precision", o.precision, "f32, or bf16: the frozen base stored in bfloat16")
      ->check(CLI::IsMember({"f32", "bf16"}))->capture_default_str();
  app.add_option("--device", o.device,
                 "Where training runs: cpu, or cuda (the finetune_cuda build; the model, adapters, optimizer state and "
                 "compiled step on the GPU, batches copied in)")
      ->check(CLI::IsMember({"cpu", "cuda"}))->capture_default_str();
  app.add_flag("--pack", o.pack, "Pack several examples into each row, each attending only to itself");
  app.add_option("--logits-out", o.logits_out, "After training, the prompt's logits (safetensors)");
  app.config_formatter(std::make_shared<detail::YamlConfig>(app, o));
  // the config's name is needed while CLI11 reads it (its errors name the file)
  for (int i = 1; i + 1 < argc; ++i)
    if (std::string a = argv[i]; a == "-c" || a == "--config") o.config = argv[i + 1];
    else if (a.rfind("--config=", 0) == 0) o.config = a.substr(9);
  try {
    app.parse(argc, argv);
  } catch (const CLI::CallForHelp&) {
    std::cout << app.help();
    std::exit(0);
  } catch (const CLI::ParseError& e) {
    nn::detail::fail("finetune", e.what(), "\n(finetune --help lists the options)");
  }
  for (const std::string& x : app.remaining()) {
    if (x.rfind("-", 0) == 0) {
      const std::string flag = x.substr(0, x.find('='));
      nn::detail::fail("finetune", "unknown option ", flag, detail::did_you_mean(flag, detail::long_names(app)),
                       "\n(finetune --help lists the options)");
    }
    nn::detail::fail("finetune", "unexpected argument '", x, "'");
  }
  if (app.count("--seq")) {
    if (app.count("--max-seq-length")) nn::detail::fail("finetune", "give --seq or --max-seq-length, not both");
    o.max_seq_length = seq + 1;
  }
  if (!keys.empty()) {
    o.lora.keys.clear();
    for (const auto& k : keys)
      if (!k.empty()) o.lora.keys.push_back(nn::lm::lora_key_path(k));
  }
  o.lora.num_layers = o.num_layers;
  o.lora.dora = o.fine_tune_type == "dora";
  if (o.resume_new_hyper) o.resume = true;
  if (!o.train && !o.test) o.train = true;
  if (o.model.empty() || o.data.empty()) nn::detail::fail("finetune", "--model and --data are required (finetune --help)");
  if (!o.logits_out.empty() && o.prompt.empty()) nn::detail::fail("finetune", "--logits-out needs --prompt");
  if (!o.export_adapter.empty() && !o.export_adapter.ends_with(".gguf"))
    nn::detail::fail("finetune", "--export-adapter writes a .gguf file, got '", o.export_adapter, "'");
  if (o.warmup >= o.iters + 1) nn::detail::fail("finetune", "--warmup ", o.warmup, " must be at most --iters ", o.iters);
  if (o.fine_tune_type == "dora" && !o.export_adapter.empty())
    nn::detail::fail("finetune", "--export-adapter: llama.cpp's LoRA adapters cannot express DoRA (no magnitude "
                     "vector); --fuse model.gguf writes the merged model instead");
  if (o.fine_tune_type == "full" && (!o.export_adapter.empty() || !o.resume_adapter_file.empty()))
    nn::detail::fail("finetune", "--fine-tune-type full trains the weights themselves: --export-adapter and "
                     "--resume-adapter-file are for LoRA");
  return o;
}

namespace detail {

/// A YAML node as JSON: mappings, sequences, and scalars as booleans, numbers or strings.
inline nlohmann::json yaml_to_json(const YAML::Node& n) {
  if (n.IsMap()) {
    nlohmann::json j = nlohmann::json::object();
    for (const auto& p : n) j[p.first.as<std::string>()] = yaml_to_json(p.second);
    return j;
  }
  if (n.IsSequence()) {
    nlohmann::json j = nlohmann::json::array();
    for (const auto& e : n) j.push_back(yaml_to_json(e));
    return j;
  }
  if (!n.IsScalar()) return nullptr;
  const std::string v = n.as<std::string>();
  if (v == "true" || v == "false") return v == "true";
  char* end = nullptr;
  const double d = std::strtod(v.c_str(), &end);
  if (!v.empty() && end == v.c_str() + v.size()) return d;
  return v;
}

}  // namespace detail

/// The run's options under mlx_lm.lora's names, as mlx-lm records them in adapter_config.json
/// (lora_parameters.scale is the multiplier applied: scale / sqrt(rank) with --rslora).
inline nlohmann::json run_config_json(const Options& o) {
  auto or_null = [](const std::string& s) { return s.empty() ? nlohmann::json(nullptr) : nlohmann::json(s); };
  nlohmann::json j = {{"model", o.model}, {"train", o.train}, {"fine_tune_type", o.fine_tune_type},
                      {"optimizer", o.optimizer}, {"data", o.data}, {"seed", o.seed}, {"num_layers", o.num_layers},
                      {"batch_size", o.batch}, {"iters", o.iters}, {"val_batches", o.val_batches},
                      {"learning_rate", o.lr}, {"steps_per_report", o.steps_per_report},
                      {"steps_per_eval", o.steps_per_eval}, {"resume_adapter_file", or_null(o.resume_adapter_file)},
                      {"adapter_path", o.adapter_path}, {"save_every", o.save_every}, {"test", o.test},
                      {"test_batches", o.test_batches}, {"max_seq_length", o.max_seq_length},
                      {"config", or_null(o.config)}, {"grad_checkpoint", o.grad_checkpoint},
                      {"grad_accumulation_steps", o.grad_accum}, {"mask_prompt", o.mask_prompt}};
  j["optimizer_config"] = o.optimizer_config ? detail::yaml_to_json(o.optimizer_config) : nlohmann::json::object();
  if (o.lr_schedule)
    j["lr_schedule"] = {{"name", o.lr_schedule->name}, {"arguments", o.lr_schedule->arguments},
                        {"warmup", o.lr_schedule->warmup}, {"warmup_init", o.lr_schedule->warmup_init}};
  else j["lr_schedule"] = nullptr;
  if (o.fine_tune_type != "full")
    j["lora_parameters"] = {{"rank", o.lora.rank}, {"scale", o.lora.effective_scale()}, {"dropout", o.lora.dropout},
                            {"keys", o.lora.keys}};
  return j;
}

// ---- the optimizer and schedule the options name ----------------------------------------------

namespace detail {

/// mlx.optimizers.schedulers' functions by name, with their positional arguments.
inline nn::Schedule named_schedule(const LrSchedule& s) {
  const auto& a = s.arguments;
  auto need = [&](std::size_t lo, std::size_t hi, const char* sig) {
    if (a.size() < lo || a.size() > hi)
      nn::detail::fail("finetune", "lr_schedule ", s.name, " takes arguments ", sig, ", got ", a.size());
  };
  if (s.name == "cosine_decay") {
    need(2, 3, "[init, decay_steps, end = 0]");
    return nn::cosine_decay(a[0], static_cast<std::int64_t>(a[1]), a.size() > 2 ? a[2] : 0.0);
  }
  if (s.name == "linear_schedule") {
    need(3, 3, "[init, end, steps]");
    return nn::linear_schedule(a[0], a[1], static_cast<std::int64_t>(a[2]));
  }
  if (s.name == "exponential_decay") {
    need(2, 2, "[init, decay_rate]");
    return nn::exponential_decay(a[0], a[1]);
  }
  if (s.name == "step_decay") {
    need(3, 3, "[init, decay_rate, step_size]");
    return nn::step_decay(a[0], a[1], static_cast<std::int64_t>(a[2]));
  }
  nn::detail::fail("finetune", "lr_schedule name '", s.name,
                   "' is not one of cosine_decay, linear_schedule, exponential_decay, step_decay");
}

/// A warm-up from `init` to the main schedule's first value over `steps`, then the main schedule
/// from step steps + 1 (mlx-lm's build_schedule).
inline nn::Schedule with_warmup(nn::Schedule main, int steps, double init, double target) {
  if (steps <= 0) return main;
  return nn::join_schedules({nn::linear_schedule(init, target, steps), std::move(main)}, {steps + 1});
}

}  // namespace detail

/// --schedule/--warmup when given, else the config's lr_schedule, else the constant --learning-rate.
inline nn::Schedule make_schedule(const Options& o) {
  if (o.schedule.empty() && o.lr_schedule) {
    const LrSchedule& s = *o.lr_schedule;
    return detail::with_warmup(detail::named_schedule(s), s.warmup, s.warmup_init, s.arguments[0]);
  }
  nn::Schedule main = o.schedule == "cosine" ? nn::cosine_decay(o.lr, std::max(1, o.iters - o.warmup))
                                             : nn::constant_schedule(o.lr);
  return detail::with_warmup(std::move(main), o.warmup, 0.0, o.lr);
}

namespace detail {

/// Reads optimizer_config.<name>'s keys through `set(key, node)`, which returns false for a key
/// it does not know.
template <class F>
void optimizer_keys(const Options& o, const std::string& name, F&& set) {
  if (!o.optimizer_config || !o.optimizer_config[name]) return;
  const YAML::Node cfg = o.optimizer_config[name];
  if (cfg.IsNull()) return;
  if (!cfg.IsMap()) nn::detail::fail("finetune", o.config, ": optimizer_config.", name, " must be a mapping");
  for (const auto& p : cfg) {
    const std::string k = p.first.as<std::string>();
    bool known = false;
    try {
      known = set(k, p.second);
    } catch (const YAML::Exception&) {
      nn::detail::fail("finetune", o.config, ": optimizer_config.", name, ".", k, " has the wrong type");
    }
    if (!known) nn::detail::fail("finetune", o.config, ": optimizer_config.", name, ".", k, " is not an option of ", name);
  }
}

inline std::pair<double, double> pair_of(const YAML::Node& n) {
  const auto v = n.as<std::vector<double>>();
  if (v.size() != 2) throw YAML::Exception(YAML::Mark(), "two values");
  return {v[0], v[1]};
}

}  // namespace detail

/// The optimizer --optimizer names, on the schedule, with optimizer_config's keyword arguments
/// for it (MLX's names: betas, eps, weight_decay, bias_correction, momentum, nesterov, ...).
/// The optimizer the options name, its kernels on backend B (the device the model trains on).
template <class B = nn::cpu>
std::unique_ptr<nn::Optimizer> make_optimizer(const Options& o) {
  nn::Schedule s = make_schedule(o);
  const std::string& n = o.optimizer;
  if (n == "adam" || n == "adamw") {
    auto adam = [&](auto& opt, const std::string& k, const YAML::Node& v) {
      if (k == "betas") opt.betas(detail::pair_of(v).first, detail::pair_of(v).second);
      else if (k == "eps") opt.eps(v.as<double>());
      else if (k == "bias_correction") opt.bias_correction(v.as<bool>());
      else return false;
      return true;
    };
    if (n == "adam") {
      auto opt = std::make_unique<nn::Adam<B>>(s);
      detail::optimizer_keys(o, n, [&](const std::string& k, const YAML::Node& v) { return adam(*opt, k, v); });
      return opt;
    }
    auto opt = std::make_unique<nn::AdamW<B>>(s);
    detail::optimizer_keys(o, n, [&](const std::string& k, const YAML::Node& v) {
      if (k == "weight_decay") return opt->weight_decay(v.as<double>()), true;
      return adam(*opt, k, v);
    });
    return opt;
  }
  if (n == "sgd") {
    auto opt = std::make_unique<nn::Sgd<B>>(s);
    detail::optimizer_keys(o, n, [&](const std::string& k, const YAML::Node& v) {
      if (k == "momentum") opt->momentum(v.as<double>());
      else if (k == "weight_decay") opt->weight_decay(v.as<double>());
      else if (k == "dampening") opt->dampening(v.as<double>());
      else if (k == "nesterov") opt->nesterov(v.as<bool>());
      else return false;
      return true;
    });
    return opt;
  }
  if (n == "muon") {
    auto opt = std::make_unique<nn::Muon<B>>(s);
    detail::optimizer_keys(o, n, [&](const std::string& k, const YAML::Node& v) {
      if (k == "momentum") opt->momentum(v.as<double>());
      else if (k == "weight_decay") opt->weight_decay(v.as<double>());
      else if (k == "nesterov") opt->nesterov(v.as<bool>());
      else if (k == "ns_steps") opt->ns_steps(v.as<int>());
      else return false;
      return true;
    });
    return opt;
  }
  auto opt = std::make_unique<nn::Adafactor<B>>(s);  // "adafactor" (CLI11 checked the name)
  detail::optimizer_keys(o, n, [&](const std::string& k, const YAML::Node& v) {
    if (k == "eps") opt->eps(detail::pair_of(v).first, detail::pair_of(v).second);
    else if (k == "clip_threshold") opt->clip_threshold(v.as<double>());
    else if (k == "decay_rate") opt->decay_rate(v.as<double>());
    else if (k == "beta_1" || k == "beta1") opt->beta1(v.as<double>());
    else if (k == "weight_decay") opt->weight_decay(v.as<double>());
    else if (k == "scale_parameter") opt->scale_parameter(v.as<bool>());
    else if (k == "relative_step") opt->relative_step(v.as<bool>());
    else if (k == "warmup_init") opt->warmup_init(v.as<bool>());
    else return false;
    return true;
  });
  return opt;
}

}  // namespace finetune
