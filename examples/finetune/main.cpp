// SPDX-License-Identifier: MIT OR Apache-2.0
// finetune: LoRA-finetunes a Llama / Qwen2 / SmolLM model from Hugging Face or GGUF files on
// JSONL data (mlx-lm's formats) and writes adapters that mlx-lm and PEFT load. Under mpirun
// (`mpirun -np 2 finetune ...`) it trains data-parallel: each global batch of --batch rows is
// shared out strided over the ranks (rows r, r + N, ...; mlx-lm's rule), gradients are averaged
// token-weighted (nn/distributed.hpp), and rank 0 alone prints, logs and writes files.
#include <nn/nn.hpp>
#include <nn/distributed.hpp>
#include <nn/lm/pretrained.hpp>
#include <nn/lm/gguf_export.hpp>

#if defined(_OPENMP)
#include <omp.h>
#endif
#if defined(NN_USE_BLAS)
extern "C" void openblas_set_num_threads(int);
#endif

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <iterator>
#include <memory>

#include "options.hpp"
#include "progress.hpp"
#include "svg.hpp"
#include "trainer.hpp"

namespace fs = std::filesystem;
using namespace nn;
using namespace nn::lm;

namespace {

using Args = finetune::Options;

/// Greedy decoding with the KV cache: the prompt is prefilled once, then one token per step, up to
/// max_tokens or EOS. Returns the new tokens.
std::vector<std::int32_t> generate_ids(const CausalLM& m, const Tokenizer& tok, const std::vector<std::int32_t>& ids,
                                       int max_tokens) {
  if (max_tokens <= 0 || ids.empty()) return {};
  KVCache cache;
  Tensor logits = m.decode(Tensor::from<std::int32_t>({1, static_cast<std::int64_t>(ids.size())}, ids), cache);
  std::vector<std::int32_t> out;
  for (int i = 0; i < max_tokens; ++i) {
    const std::int64_t V = logits.dim(-1), last = logits.numel() / V - 1;
    std::int32_t best = 0;
    double bv = -INFINITY;
    for (std::int64_t v = 0; v < V; ++v) {
      double x = logits.item(last * V + v);
      if (x > bv) bv = x, best = static_cast<std::int32_t>(v);
    }
    if (tok.eos_id() && best == *tok.eos_id()) break;
    out.push_back(best);
    logits = m.decode(Tensor::from<std::int32_t>({1, 1}, {best}), cache);
  }
  return out;
}

std::string generate(const CausalLM& m, const Tokenizer& tok, const std::string& text, int max_tokens) {
  if (text.empty()) return "";
  return tok.decode(generate_ids(m, tok, tok.encode(text), max_tokens), true);
}

/// The trainer --device names. The model must be complete (adapters applied, frozen as it will
/// train): it moves to the device here.
std::unique_ptr<finetune::Trainer> make_trainer(const Args& a, CausalLM& model) {
  // cuda_trainer.cu in finetune_cuda; no_cuda.cpp (an error that says how to get it) in finetune
  if (a.device == "cuda") return finetune::make_cuda_trainer(a, model);
  return finetune::make_cpu_trainer(a, model);  // cpu_trainer.cpp
}

/// This rank's rows of a global batch: rank, rank + size, ... (mlx-lm's strided shard).
std::vector<std::size_t> my_rows(std::span<const std::size_t> rows, const nn::distributed::Group& g) {
  std::vector<std::size_t> mine;
  for (std::size_t i = static_cast<std::size_t>(g.rank()); i < rows.size(); i += static_cast<std::size_t>(g.size()))
    mine.push_back(rows[i]);
  return mine;
}

/// Mean next-token loss over up to `batches` batches of `data` (-1: all of it), token-weighted,
/// each batch's rows shared out over the group and the sums added up. One row per forward pass:
/// its logits, (T, vocab) in float32, are what an evaluation holds beside the training step's
/// buffers, so a row at a time keeps the run's peak memory at the step's (the sum is the same up
/// to rounding). Rows are padded as the training batches are (mlx-lm: to a multiple of 32).
/// loss_sum(batch): the batch's summed loss on the device the model is on (Trainer::loss_sum
/// while training, finetune::host_loss_sum on the host).
template <class LossSum>
double evaluate(LossSum&& loss_sum, DType dt, const std::vector<Example>& data, int batches, int batch, int max_seq,
                const nn::distributed::Group& g) {
  if (data.empty()) return NAN;
  const std::size_t n_batches = batches < 0 ? (data.size() + static_cast<std::size_t>(batch) - 1) / static_cast<std::size_t>(batch)
                                            : static_cast<std::size_t>(batches);
  double sum = 0;
  std::int64_t count = 0;
  for (std::size_t b = 0; b < n_batches; ++b) {
    std::vector<std::size_t> all;
    for (std::size_t i = 0; i < static_cast<std::size_t>(batch) && b * static_cast<std::size_t>(batch) + i < data.size(); ++i)
      all.push_back(b * static_cast<std::size_t>(batch) + i);
    if (all.empty()) break;
    for (std::size_t row : my_rows(all, g)) {
      const std::size_t one[] = {row};
      Batch bt = make_batch(data, one, max_seq, 32, dt);
      if (bt.tokens == 0) continue;
      sum += loss_sum(bt);
      count += bt.tokens;
    }
  }
  const double total = g.sum(static_cast<double>(count));
  return total > 0 ? g.sum(sum) / total : NAN;
}

/// The training batches' width. mlx-lm pads each batch to a multiple of 32 (at most
/// max_seq_length - 1 positions); here a batch is also never narrower than the widest so far, so
/// the compiled step records again only when the width grows (padding is masked: the same loss).
struct Widths {
  std::int64_t widest = 0;
  Batch make(const std::vector<Example>& data, std::span<const std::size_t> rows, int max_seq, DType dt) {
    Batch b = make_batch(data, rows, max_seq, 32, dt);
    if (b.inputs.dim(1) < widest) b = make_batch(data, rows, max_seq, widest, dt);
    widest = std::max(widest, b.inputs.dim(1));
    return b;
  }
};

/// --fine-tune-type full: the last num_layers decoder layers trainable (mlx-lm: the embedding,
/// the final norm and the head stay frozen). Returns how many layers.
int unfreeze_layers(CausalLM& model, int num_layers) {
  const int n = static_cast<int>(model.config().num_hidden_layers);
  const int first = num_layers < 0 ? 0 : n - num_layers;
  model.freeze();
  model.unfreeze([first](const std::string& p) {
    const auto lp = nn::lm::detail::layer_path(p);
    return lp && lp->first >= first;
  });
  return n - first;
}

/// adapter_config.json as mlx-lm writes it: what the adapters need (`base`) plus every option of
/// the run under mlx_lm.lora's names.
void write_adapter_config(const fs::path& dir, nlohmann::json base, const Args& a) {
  const nlohmann::json run = finetune::run_config_json(a);
  for (const auto& [k, v] : run.items())
    if (!base.contains(k)) base[k] = v;
  nn::lm::detail::write_text(dir / "adapter_config.json", base.dump(2) + "\n");
}

/// mlx-lm's adapter folder for a full finetune: the trained weights (adapters.safetensors) and
/// adapter_config.json; mlx_lm.load(model, adapter_path=...) reads it.
void save_full(const fs::path& dir, const CausalLM& model, const Args& a) {
  fs::create_directories(dir);
  save_safetensors(dir / "adapters.safetensors", model.trainable_parameters(), {{"format", "mlx"}});
  write_adapter_config(dir, {{"fine_tune_type", "full"}, {"num_layers", a.num_layers}}, a);
}

int run(const Args& a) {
  const nn::distributed::Group world = nn::distributed::init();  // size 1 without mpirun
  const bool lead = world.rank() == 0;                           // prints, logs and writes files
  if (!lead) std::freopen("/dev/null", "w", stdout);             // errors still reach stderr
  if (a.batch % world.size() != 0)
    nn::detail::fail("finetune", "--batch-size ", a.batch, " (the global batch) must be a multiple of the ", world.size(),
                     " ranks");
  const bool full = a.fine_tune_type == "full";
#if defined(_OPENMP)
  if (a.threads > 0) omp_set_num_threads(a.threads);
#endif
#if defined(NN_USE_BLAS)
  if (a.threads > 0) openblas_set_num_threads(a.threads);
#endif
  random::seed(a.seed);
  std::printf("%s\n", nn::cpu_info().line().c_str());
  if (world.size() > 1) std::printf("data parallel: %d ranks, %d rows each per global batch of %d\n", world.size(),
                                    a.batch / world.size(), a.batch);
  if (!a.config.empty()) std::printf("config: %s (flags given override it)\n", a.config.c_str());
  std::printf("loading %s\n", a.model.c_str());
  // A full finetune trains float weights: a quantized base is loaded dequantized.
  Pretrained pt = load_pretrained(a.model, DType::f32, !a.dequantize && !full);
  CausalLM& model = pt.model;
  const Tokenizer& tok = pt.tokenizer;
  const ModelConfig& c = model.config();
  std::printf("model: %s, %lld layers, hidden %lld, %lld heads (%lld kv), vocab %lld, %s params\n", arch_name(c.arch),
              static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.num_attention_heads), static_cast<long long>(c.num_key_value_heads),
              static_cast<long long>(c.vocab_size), nn::detail::with_commas(model.num_params()).c_str());
  if (a.num_layers > c.num_hidden_layers)
    nn::detail::fail("finetune", "--num-layers ", a.num_layers, ": the model has only ", c.num_hidden_layers,
                     " layers (-1 trains all)");

  {
    int quantized = 0;
    auto count = [&](const std::string&, const auto&) { ++quantized; };
    model.map_modules<QuantizedLinear>([](const std::string&) { return true; }, count);
    model.map_modules<QuantizedEmbedding>([](const std::string&) { return true; }, count);
    if (quantized > 0)
      std::printf("base: %d matrices kept quantized (GGUF blocks as affine groups, or mlx-lm's; --dequantize for float32)\n",
                  quantized);
    // smoke.sh reads this line: a quantized base must load without a float copy of its matrices
    if (const long kb = nn::peak_rss_kb(); kb > 0) std::printf("peak RSS after loading: %ld MB\n", kb / 1024);
  }

  TokenizerText enc{tok};
  DataOptions dopt;
  dopt.mask_prompt = a.mask_prompt;
  // The chat format: the model's own template (as mlx-lm's apply_chat_template), a file, or ChatML.
  {
    std::string src, from;
    if (a.chat_template == "auto") {
      src = pt.chat_template;
      from = "the model's tokenizer.chat_template";
    } else if (a.chat_template != "chatml") {
      std::ifstream f(a.chat_template, std::ios::binary);
      if (!f) nn::detail::fail("finetune", "--chat-template ", a.chat_template, ": cannot open (auto, chatml or a .jinja file)");
      src.assign(std::istreambuf_iterator<char>(f), {});
      from = a.chat_template;
    }
    if (!src.empty()) {
      dopt.chat_template = std::make_shared<const ChatTemplate>(src, from);
      auto token = [&](std::optional<std::int32_t> id) { return id ? tok.id_to_token(*id) : std::string(); };
      dopt.template_vars = {{"bos_token", token(tok.bos_id())}, {"eos_token", token(tok.eos_id())}};
    }
    std::printf("chat format: %s\n", dopt.chat_template ? from.c_str() : "ChatML");
  }
  Splits data = load_splits(a.data, enc, dopt, 0.1, a.seed);
  std::vector<Example> test_set;
  if (a.test) {
    const fs::path tf = fs::path(a.data) / "test.jsonl";
    if (!fs::is_directory(a.data) || !fs::exists(tf))
      nn::detail::fail("finetune", "--test reads DATA/test.jsonl: no file ", tf.string());
    test_set = load_jsonl(tf, enc, dopt);
  }
  // An example whose learned tokens all lie past --max-seq-length (a long prompt, or a chat
  // template's system prompt, fills the row) adds nothing but a 0/0 loss: drop it, and say so.
  {
    const auto positions = static_cast<std::size_t>(a.positions());
    auto drop = [&](std::vector<Example>& set, const char* name) {
      const std::size_t before = set.size();
      std::erase_if(set, [&](const Example& ex) {
        const std::size_t end = std::min(ex.tokens.size(), positions + 1);
        for (std::size_t pos = 1; pos < end; ++pos)
          if (ex.learned(pos)) return false;
        return true;
      });
      if (set.size() < before)
        std::printf("data: dropped %zu of %zu %s examples: nothing they learn lies within --max-seq-length %d\n", before - set.size(),
                    before, name, a.max_seq_length);
    };
    drop(data.train, "train");
    drop(data.valid, "valid");
    drop(test_set, "test");
    if (data.train.empty())
      nn::detail::fail("finetune", "no train example learns a token within --max-seq-length ", a.max_seq_length,
                       ": raise it (or use --chat-template chatml, without the template's system prompt)");
  }
  std::printf("data: %zu train, %zu valid%s examples%s\n", data.train.size(), data.valid.size(),
              a.test ? (", " + std::to_string(test_set.size()) + " test").c_str() : "",
              a.mask_prompt ? " (loss on the completions only: --mask-prompt)" : "");
  const bool chat = !data.train.empty() && data.train.front().offset > 0;
  const std::string prompt = a.prompt.empty() ? ""
                             : !chat             ? a.prompt
                             : dopt.chat_template
                                 ? dopt.chat_template->apply(nlohmann::ordered_json::array({{{"role", "user"}, {"content", a.prompt}}}), true,
                                                             dopt.template_vars)
                                 : ChatML{}.render({{"user", a.prompt}}, true);

  auto report_test = [&]() {  // on the host: after training, or --test alone
    model.train(false);
    const double t = evaluate([&](const Batch& b) { return finetune::host_loss_sum(model, b); }, model.dtype(),
                              test_set, a.test_batches, a.batch, a.max_seq_length, world);
    std::printf("Test loss %.3f, Test ppl %.3f.\n", t, std::exp(t));
  };
  if (!a.train) {  // --test alone: the adapters in --adapter-path, as mlx-lm
    const fs::path cfg = fs::path(a.adapter_path) / "adapter_config.json";
    if (fs::exists(cfg)) {
      if (nn::lm::detail::read_json_file(cfg, "adapters").value("fine_tune_type", "lora") == "full")
        model.load_weights_partial(fs::path(a.adapter_path) / "adapters.safetensors");
      else load_mlx_adapters(a.adapter_path, model);
      std::printf("adapters: %s\n", a.adapter_path.c_str());
    }
    report_test();
    return 0;
  }

  const std::string before = lead ? generate(model, tok, prompt, a.max_tokens) : std::string();

  if (full) {
    const int n = unfreeze_layers(model, a.num_layers);
    std::printf("full finetune of the last %d layers: %s trainable of %s\n", n,
                nn::detail::with_commas(model.num_trainable()).c_str(), nn::detail::with_commas(model.num_params()).c_str());
  } else {
    model.freeze();
    const int converted = apply_lora(model, a.lora);
    std::printf("%s rank %lld scale %g on %d projections: %s trainable of %s\n", a.lora.dora ? "DoRA" : "LoRA",
                static_cast<long long>(a.lora.rank),
                a.lora.effective_scale(), converted, nn::detail::with_commas(model.num_trainable()).c_str(),
                nn::detail::with_commas(model.num_params()).c_str());
  }
  if (!a.resume_adapter_file.empty()) {  // mlx-lm: load_weights(strict=False) over the new adapters
    const NamedTensors w = load_safetensors(a.resume_adapter_file);
    std::set<std::string> trainable;
    for (const auto& [p, t] : model.trainable_parameters()) trainable.insert(p);
    std::size_t used = 0;
    for (const auto& [p, t] : w) used += trainable.count(p);
    if (used == 0)
      nn::detail::fail("finetune", "--resume-adapter-file ", a.resume_adapter_file, ": none of its ", w.size(),
                       " tensors is a trainable parameter of this run (another --fine-tune-type, keys or --num-layers?)");
    model.load_weights_partial(w);
    std::printf("resumed adapter weights from %s (%zu tensors)\n", a.resume_adapter_file.c_str(), used);
  }

  if (a.grad_checkpoint) {
    model.grad_checkpoint(true);
    std::printf("gradient checkpointing: each of the %lld decoder layers recomputed in the backward pass\n",
                static_cast<long long>(c.num_hidden_layers));
  }

  if (a.precision == "bf16") {
    const int n = set_precision(model, Precision::bf16);
    std::printf("precision bf16: %d frozen matrices stored in bfloat16, bf16 products %s\n", n,
                cpu_info().bf16.c_str());
  }

  // Every rank starts from rank 0's trainable weights (the LoRA matrices, or the layers a full
  // finetune trains; the frozen base came from the same file everywhere), after checking that all
  // ranks built the same tree. Then each rank draws its own dropout masks: nn::random seeded with
  // --seed + rank.
  nn::distributed::broadcast_parameters(model, world, 0, /*trainable_only=*/true);
  if (world.size() > 1) nn::distributed::seed(world, a.seed);

  // The model moves to --device here (it stays put on the CPU), the optimizer's slots made there.
  if (a.device != "cpu" && world.size() > 1)
    nn::detail::fail("finetune", "--device ", a.device, " trains on one process: under mpirun use --device cpu");
  if (a.device != "cpu" && a.pack)
    nn::detail::fail("finetune", "--device ", a.device, " with --pack: packed rows need the flash attention kernels, "
                     "which only the CPU backend has (use --device cpu, or drop --pack)");
  if (a.device != "cpu" && a.grad_accum > 1)
    nn::detail::fail("finetune", "--device ", a.device, " with --grad-accumulation-steps ", a.grad_accum,
                     ": accumulating runs on the CPU only (use --device cpu, or a larger --batch-size)");
  const std::unique_ptr<finetune::Trainer> trainer = make_trainer(a, model);
  Optimizer& opt = trainer->optimizer();
  std::printf("device: %s\n", trainer->device());
  // mlx-lm's run header, on one line
  std::printf("run: %s on %s layers%s; optimizer %s, learning rate %.3e at step 1%s; batch %d, %d iters, "
              "max seq %d%s\n",
              a.fine_tune_type.c_str(), a.num_layers < 0 ? "all" : std::to_string(a.num_layers).c_str(),
              full ? "" : (", rank " + std::to_string(a.lora.rank)).c_str(), a.optimizer.c_str(), opt.learning_rate(),
              a.lr_schedule && a.schedule.empty() ? (" (lr_schedule " + a.lr_schedule->name + ")").c_str() : "",
              a.batch, a.iters, a.max_seq_length, a.grad_accum > 1 ? (", " + std::to_string(a.grad_accum) + " micro-batches per step").c_str() : "");
  if (lead) fs::create_directories(a.adapter_path);
  const fs::path ckpt = fs::path(a.adapter_path) / "checkpoint.safetensors";
  const int T = a.positions();
  // --pack: the training examples in rows of T positions, several per row
  std::vector<std::vector<std::size_t>> packed;
  if (a.pack) {
    packed = pack_examples(data.train, T);
    std::printf("packing: %zu examples into %zu rows of %d positions, %.1f%% of positions used\n", data.train.size(),
                packed.size(), T, 100.0 * pack_fill(data.train, packed, T));
  }
  BatchOrder order = a.pack ? BatchOrder(packed.size(), static_cast<std::size_t>(a.batch), a.seed)
                            : BatchOrder(data.train, static_cast<std::size_t>(a.batch), a.seed);
  Widths widths;
  // This rank's rows of the next batch: padded examples, or packed rows with their documents.
  auto next_batch = [&]() {
    const std::vector<std::size_t> rows = my_rows(order.next(), world);
    if (!a.pack) return PackedBatch{widths.make(data.train, rows, a.max_seq_length, model.dtype()), Tensor(), Tensor()};
    std::vector<std::vector<std::size_t>> sel;
    for (std::size_t r : rows) sel.push_back(packed[r]);
    return make_packed_batch(data.train, std::span(sel), T, model.dtype());
  };
  if (a.resume) {
    if (!fs::exists(ckpt)) nn::detail::fail("finetune", "--resume: no checkpoint at ", ckpt.string());
    try {
      trainer->resume(ckpt, nn::LoadOptions{.allow_new_hyperparameters = a.resume_new_hyper});
    } catch (const nn::Error& e) {
      nn::detail::fail("finetune", e.what(), "\n(finetune: --resume-new-hyperparameters resumes with these flags on purpose)");
    }
    // the batch order is a function of the seed: replay it (and the widths) up to where the run stopped
    for (std::int64_t i = 0; i < opt.step() * a.grad_accum; ++i) next_batch();
    std::printf("resumed at step %lld\n", static_cast<long long>(opt.step()));
  }

  nn::distributed::GradientAverager avg(world);  // token-weighted: each rank's weight is its real targets
  if (world.size() > 1) trainer->reduce_gradients(avg);
  // The savers read host tensors: on a device the model visits the host to be saved (the
  // optimizer's slots stay on the device; the checkpoint writer copies them), and the compiled
  // step records again once on its return.
  auto save_all = [&]() {
    if (!lead) return;
    finetune::OnHost visit(*trainer);
    if (full) {
      save_full(a.adapter_path, model, a);
    } else {
      save_mlx_adapters(a.adapter_path, model, a.lora);
      write_adapter_config(a.adapter_path, nn::lm::detail::read_json_file(fs::path(a.adapter_path) / "adapter_config.json", "finetune"), a);
      if (a.peft) save_peft_adapters(fs::path(a.adapter_path) / "peft", model, a.lora, a.model);
    }
    save(ckpt, model, opt);
  };

  finetune::Progress progress(a.iters, a.steps_per_report,
                              lead ? (fs::path(a.adapter_path) / "metrics.jsonl").string() : std::string());
  finetune::Series train_curve, val_curve;
  auto validate = [&](int it) {
    const auto t0 = std::chrono::steady_clock::now();
    const double v = evaluate([&](const Batch& b) { return trainer->loss_sum(b); }, model.dtype(), data.valid,
                              a.val_batches, a.batch, a.max_seq_length, world);
    if (std::isnan(v)) return;
    progress.validation(it, v, std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
    val_curve.emplace_back(it, v);
  };
  if (!a.resume) validate(0);
  std::int64_t trained = 0;  // target tokens trained on (all ranks), padding and prompts excluded
  for (int it = static_cast<int>(opt.step()) + 1; it <= a.iters; ++it) {
    double loss = 0;
    std::int64_t tokens = 0;
    // The loss logged is the global batch's (token-weighted over the ranks); tokens count every rank's.
    if (a.grad_accum == 1) {
      const PackedBatch pb = next_batch();
      const Batch& b = pb.batch;
      avg.set_weight(static_cast<double>(b.tokens));
      const double l = trainer->step(pb, a.pack);
      loss = nn::distributed::weighted_mean(world, l, static_cast<double>(b.tokens));
      tokens = b.inputs.numel();
      trained += static_cast<std::int64_t>(world.sum(static_cast<double>(b.tokens)));
    } else {  // several micro-batches per update: eager gradients, summed, then one update
      for (int k = 0; k < a.grad_accum; ++k) {
        const PackedBatch pb = next_batch();
        const Batch& b = pb.batch;
        // each micro-batch's gradient is the global micro-batch's, as one process computes it
        avg.set_weight(static_cast<double>(b.tokens));
        const double l = trainer->accumulate(pb, a.pack, world.size() > 1 ? &avg : nullptr);
        loss += nn::distributed::weighted_mean(world, l, static_cast<double>(b.tokens)) / a.grad_accum;
        tokens += b.inputs.numel();
        trained += static_cast<std::int64_t>(world.sum(static_cast<double>(b.tokens)));
      }
      trainer->apply_accumulated(a.grad_accum);
    }
    tokens = static_cast<std::int64_t>(world.sum(static_cast<double>(tokens)));
    train_curve.emplace_back(it, loss);
    progress.step(it, loss, opt.learning_rate(), tokens);
    if (a.steps_per_eval > 0 ? it % a.steps_per_eval == 0 || it == a.iters : it == a.iters) validate(it);
    if (a.save_every > 0 && it % a.save_every == 0) save_all();
  }
  trainer->to_host();  // the rest (saving, generation, exports) runs on the host
  save_all();
  if (a.test) report_test();
  if (!lead) return 0;  // the rest (curve, samples, exports) is rank 0's
  const fs::path svg = fs::path(a.adapter_path) / "loss.svg";
  finetune::write_loss_svg(svg.string(), train_curve, val_curve);
  std::printf("%s: %s (mlx-lm)%s; loss curve: %s; %.1f s\n", full ? "weights" : "adapters", a.adapter_path.c_str(),
              a.peft && !full ? ", peft/ (PEFT)" : "", svg.string().c_str(), progress.seconds());
  std::printf("trained on %lld target tokens, %.1f per second\n", static_cast<long long>(trained),
              static_cast<double>(trained) / std::max(progress.seconds(), 1e-9));
  if (const long kb = nn::peak_rss_kb(); kb > 0) std::printf("peak RSS of the run: %ld MB\n", kb / 1024);

  if (!prompt.empty()) {
    model.train(false);
    const std::string after = generate(model, tok, prompt, a.max_tokens);
    std::printf("\nprompt: %s\n--- before ---\n%s\n--- after ---\n%s\n", a.prompt.c_str(), before.c_str(), after.c_str());
  }
  if (!a.logits_out.empty()) {
    // ids: (1, T) the prompt's tokens (chat-formatted when the data is); logits: (1, T, V) of the
    // trained model in eval mode, for tests/interop/ to compare against PEFT, mlx-lm and llama.cpp;
    // greedy: (1, n) its greedy continuation (up to --max-tokens, EOS excluded).
    model.train(false);
    const std::vector<std::int32_t> ids = tok.encode(prompt);
    Tensor id_t = Tensor::from<std::int32_t>({1, static_cast<std::int64_t>(ids.size())}, ids);
    GTape<cpu> tp;
    GVar logits = model.logits(tp, tp.constant(id_t));
    const std::vector<std::int32_t> greedy = generate_ids(model, tok, ids, a.max_tokens);
    Tensor greedy_t = Tensor::from<std::int32_t>({1, static_cast<std::int64_t>(greedy.size())}, greedy);
    save_safetensors(a.logits_out, NamedTensors{{"ids", id_t}, {"logits", tp.value(logits)}, {"greedy", greedy_t}});
    std::printf("logits of the prompt written to %s\n", a.logits_out.c_str());
  }
  if (!a.export_adapter.empty()) {
    save_gguf_adapter(a.export_adapter, model, a.lora, c);
    std::printf("GGUF LoRA adapter written to %s (%.1f MB)\n", a.export_adapter.c_str(),
                static_cast<double>(fs::file_size(a.export_adapter)) / 1e6);
  }
  if (!a.fuse.empty()) {
    const auto t0 = std::chrono::steady_clock::now();
    set_precision(model, Precision::f32);  // the fused weights: the (bf16-rounded) base + the adapters, in f32
    dequantize_layers(model);              // a quantized base: merged in float32 (LoraLinear::fused), the rest dequantized
    const auto all = [](const std::string&) { return true; };
    model.map_modules<LoraLinear>(all, [](const std::string&, const LoraLinear& l) { return l.fused(); });
    model.map_modules<DoraLinear>(all, [](const std::string&, const DoraLinear& l) { return l.fused(); });
    if (a.fuse.ends_with(".gguf")) {
      const GgufExportReport r = fs::is_directory(a.model) ? save_gguf(a.fuse, model, fs::path(a.model), a.outtype)
                                                           : save_gguf(a.fuse, model, GgufFile(a.model), a.outtype);
      std::string types;
      for (const auto& [t, n] : r.types) types += (types.empty() ? "" : ", ") + std::to_string(n) + " " + t;
      std::printf("fused model written to %s (%s: %s; %.1f MB, %.1f s)\n", a.fuse.c_str(), a.outtype.c_str(), types.c_str(),
                  static_cast<double>(fs::file_size(a.fuse)) / 1e6,
                  std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count());
      return 0;
    }
    save_hf(a.fuse, model);
    if (fs::is_directory(a.model))
      for (const char* f : {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "generation_config.json"})
        if (fs::exists(fs::path(a.model) / f)) fs::copy_file(fs::path(a.model) / f, fs::path(a.fuse) / f, fs::copy_options::overwrite_existing);
    std::printf("fused model written to %s\n", a.fuse.c_str());
  }
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  try {
    return run(finetune::parse_options(argc, argv));
  } catch (const nn::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
