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
#include <iostream>
#include <map>
#include <sstream>

#include "progress.hpp"
#include "svg.hpp"

namespace fs = std::filesystem;
using namespace nn;
using namespace nn::lm;

namespace {

struct Args {
  std::string model, data, adapter_path = "adapters", schedule = "cosine", prompt, fuse, logits_out, precision = "f32",
      outtype = "f16", export_adapter;
  LoraConfig lora;
  double lr = 1e-4;
  int warmup = 0, iters = 100, batch = 4, seq = 256, grad_accum = 1, val_every = 25, val_batches = 4,
      save_every = 50, threads = 0, max_tokens = 40;
  std::uint64_t seed = 0;
  bool resume = false, resume_new_hyper = false, peft = true, dequantize = false, grad_checkpoint = false, pack = false;
};

const char* kUsage =
    "usage: finetune --model PATH --data DIR_or_FILE [options]\n"
    "  --model PATH          a Hugging Face folder (config.json, model.safetensors, tokenizer.json) or a .gguf file\n"
    "  --data DIR|FILE       JSONL: DIR/train.jsonl (+ DIR/valid.jsonl), or one file split 90/10\n"
    "                        records: {\"text\"} | {\"prompt\",\"completion\"} | {\"messages\"} (ChatML)\n"
    "  --rank 8 --scale 20 --rslora --dropout 0 --layers N (last N layers, -1 all)\n"
    "  --keys q_proj,v_proj  projections to adapt (q k v o _proj, gate up down _proj)\n"
    "  --lr 1e-4 --schedule cosine|constant --warmup N --iters 100 --batch 4 --seq 256 --grad-accum 1\n"
    "  --val-every 25 --val-batches 4 --save-every 50 --resume --adapter-path adapters --no-peft\n"
    "  --resume              continue from ADAPTER_PATH/checkpoint.safetensors; the schedule and optimizer flags\n"
    "                        must be the run's (checked) unless --resume-new-hyperparameters\n"
    "  --threads N --seed 0 --prompt TEXT --max-tokens 40\n"
    "  --fuse OUT            the merged model (base + LoRA, in float32): a Hugging Face folder, or OUT.gguf for\n"
    "                        llama.cpp (the metadata and tokenizer of the .gguf or Hugging Face --model carry over)\n"
    "  --outtype f16         the GGUF's types: f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m (llama-quantize's mixtures), same\n"
    "  --export-adapter OUT.gguf  the LoRA as a llama.cpp GGUF adapter (llama-cli --lora OUT.gguf)\n"
    "  --dequantize          a quantized base (GGUF Q4_0..Q8_0, Q2_K..Q6_K; an mlx-lm -q folder) in float32 (by default it stays quantized: QLoRA)\n"
    "  --precision f32|bf16  bf16: the frozen base weights stored in bfloat16 (half the memory), products on bf16\n"
    "                        operands with f32 accumulation; adapters, optimizer state and reductions stay f32\n"
    "  --grad-checkpoint     recompute each decoder layer's activations in the backward pass instead of keeping\n"
    "                        them (mlx-lm's flag): less memory for one more forward pass, the same gradients\n"
    "  --pack                pack several examples into each row of --seq positions (first-fit decreasing), each\n"
    "                        attending only to itself, positions restarting per example: no padding to train on\n"
    "  --logits-out FILE     after training, the logits of the prompt's tokens (safetensors: ids, logits)\n";

Args parse(int argc, char** argv) {
  Args a;
  std::map<std::string, std::string> kv;
  for (int i = 1; i < argc; ++i) {
    std::string k = argv[i];
    if (k == "-h" || k == "--help") {
      std::cout << kUsage;
      std::exit(0);
    }
    if (k.rfind("--", 0) != 0) nn::detail::fail("finetune", "unexpected argument '", k, "'\n", kUsage);
    k = k.substr(2);
    if (k == "rslora" || k == "resume" || k == "resume-new-hyperparameters" || k == "no-peft" || k == "dequantize" ||
        k == "grad-checkpoint" || k == "pack") {
      kv[k] = "1";
      continue;
    }
    if (i + 1 >= argc) nn::detail::fail("finetune", "--", k, " needs a value");
    kv[k] = argv[++i];
  }
  auto num = [&](const char* k, auto& out) {
    auto it = kv.find(k);
    if (it == kv.end()) return;
    std::istringstream is(it->second);
    if (!(is >> out) || !is.eof()) nn::detail::fail("finetune", "--", k, " expects a number, got '", it->second, "'");
    kv.erase(it);
  };
  auto str = [&](const char* k, std::string& out) {
    auto it = kv.find(k);
    if (it == kv.end()) return;
    out = it->second;
    kv.erase(it);
  };
  str("model", a.model);
  str("data", a.data);
  str("adapter-path", a.adapter_path);
  str("schedule", a.schedule);
  str("prompt", a.prompt);
  str("fuse", a.fuse);
  str("logits-out", a.logits_out);
  str("precision", a.precision);
  str("outtype", a.outtype);
  str("export-adapter", a.export_adapter);
  num("rank", a.lora.rank);
  num("scale", a.lora.scale);
  num("dropout", a.lora.dropout);
  num("layers", a.lora.num_layers);
  num("lr", a.lr);
  num("warmup", a.warmup);
  num("iters", a.iters);
  num("batch", a.batch);
  num("seq", a.seq);
  num("grad-accum", a.grad_accum);
  num("val-every", a.val_every);
  num("val-batches", a.val_batches);
  num("save-every", a.save_every);
  num("threads", a.threads);
  num("seed", a.seed);
  num("max-tokens", a.max_tokens);
  if (kv.erase("rslora")) a.lora.rslora = true;
  if (kv.erase("resume")) a.resume = true;
  if (kv.erase("resume-new-hyperparameters")) a.resume = a.resume_new_hyper = true;
  if (kv.erase("no-peft")) a.peft = false;
  if (kv.erase("dequantize")) a.dequantize = true;
  if (kv.erase("grad-checkpoint")) a.grad_checkpoint = true;
  if (kv.erase("pack")) a.pack = true;
  std::string keys = "q_proj,v_proj";
  str("keys", keys);
  if (!kv.empty()) nn::detail::fail("finetune", "unknown option --", kv.begin()->first, "\n", kUsage);
  if (a.model.empty() || a.data.empty()) nn::detail::fail("finetune", "--model and --data are required\n", kUsage);
  if (!a.logits_out.empty() && a.prompt.empty()) nn::detail::fail("finetune", "--logits-out needs --prompt");
  // The GGUF outputs are checked before training, not after it.
  if (std::find(gguf_outtypes().begin(), gguf_outtypes().end(), a.outtype) == gguf_outtypes().end())
    nn::detail::fail("finetune", "--outtype is one of f32 f16 bf16 q8_0 q4_0 q4_k_m q5_k_m same, got '", a.outtype, "'");
  if (!a.export_adapter.empty() && !a.export_adapter.ends_with(".gguf"))
    nn::detail::fail("finetune", "--export-adapter writes a .gguf file, got '", a.export_adapter, "'");
  if (a.schedule != "cosine" && a.schedule != "constant") nn::detail::fail("finetune", "--schedule is cosine or constant");
  if (a.precision != "f32" && a.precision != "bf16")
    nn::detail::fail("finetune", "--precision is f32 or bf16, got '", a.precision, "'");
  if (a.iters <= 0 || a.batch <= 0 || a.seq < 2 || a.grad_accum <= 0 || a.warmup < 0 || a.warmup >= a.iters + 1)
    nn::detail::fail("finetune", "need iters > 0, batch > 0, seq >= 2, grad-accum > 0, 0 <= warmup <= iters");
  a.lora.keys.clear();
  std::istringstream ks(keys);
  for (std::string k; std::getline(ks, k, ',');) {
    if (k.empty()) continue;
    a.lora.keys.push_back(lora_key_path(k));
  }
  return a;
}

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

/// This rank's rows of a global batch: rank, rank + size, ... (mlx-lm's strided shard).
std::vector<std::size_t> my_rows(std::span<const std::size_t> rows, const nn::distributed::Group& g) {
  std::vector<std::size_t> mine;
  for (std::size_t i = static_cast<std::size_t>(g.rank()); i < rows.size(); i += static_cast<std::size_t>(g.size()))
    mine.push_back(rows[i]);
  return mine;
}

/// Mean next-token loss over up to `batches` validation batches (token-weighted), each batch's
/// rows shared out over the group and the sums added up. One row per forward pass: its logits,
/// (T, vocab) in float32, are what an evaluation holds beside the training step's buffers, so a
/// row at a time keeps the run's peak memory at the step's (the sum is the same up to rounding).
double evaluate(const CausalLM& m, const std::vector<Example>& data, int batches, int batch, int seq,
                const nn::distributed::Group& g) {
  if (data.empty()) return NAN;
  double sum = 0;
  std::int64_t count = 0;
  for (int b = 0; b < batches; ++b) {
    std::vector<std::size_t> all;
    for (int i = 0; i < batch && static_cast<std::size_t>(b * batch + i) < data.size(); ++i)
      all.push_back(static_cast<std::size_t>(b * batch + i));
    if (all.empty()) break;
    for (std::size_t row : my_rows(all, g)) {
      const std::size_t one[] = {row};
      Batch bt = make_batch(data, one, seq + 1, seq, m.dtype());
      if (bt.tokens == 0) continue;
      // Recorded with its kernels deferred, then planned forward-only and run: the tape holds
      // the logits and a layer's transients, not every intermediate (GTape::plan_memory).
      GTape<cpu> tp;
      const GVar loss = tp.record_planned(
          [&] {
            return cross_entropy(tp, m.logits(tp, tp.constant(bt.inputs)), tp.constant(bt.targets),
                                 tp.constant(bt.mask), Reduction::sum);
          },
          false);
      sum += tp.value(loss).item();
      count += bt.tokens;
    }
  }
  const double total = g.sum(static_cast<double>(count));
  return total > 0 ? g.sum(sum) / total : NAN;
}

Schedule make_schedule(const Args& a) {
  Schedule main = a.schedule == "cosine" ? cosine_decay(a.lr, std::max(1, a.iters - a.warmup)) : constant_schedule(a.lr);
  if (a.warmup == 0) return main;
  // mlx-lm's warm-up: a linear ramp from 0, then the main schedule from step warmup + 1
  return join_schedules({linear_schedule(0.0, a.lr, a.warmup), main}, {a.warmup + 1});
}

int run(const Args& a) {
  const nn::distributed::Group world = nn::distributed::init();  // size 1 without mpirun
  const bool lead = world.rank() == 0;                           // prints, logs and writes files
  if (!lead) std::freopen("/dev/null", "w", stdout);             // errors still reach stderr
  if (a.batch % world.size() != 0)
    nn::detail::fail("finetune", "--batch ", a.batch, " (the global batch) must be a multiple of the ", world.size(),
                     " ranks");
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
  std::printf("loading %s\n", a.model.c_str());
  Pretrained pt = load_pretrained(a.model, DType::f32, !a.dequantize);
  CausalLM& model = pt.model;
  const Tokenizer& tok = pt.tokenizer;
  const ModelConfig& c = model.config();
  std::printf("model: %s, %lld layers, hidden %lld, %lld heads (%lld kv), vocab %lld, %s params\n", arch_name(c.arch),
              static_cast<long long>(c.num_hidden_layers), static_cast<long long>(c.hidden_size),
              static_cast<long long>(c.num_attention_heads), static_cast<long long>(c.num_key_value_heads),
              static_cast<long long>(c.vocab_size), nn::detail::with_commas(model.num_params()).c_str());

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
  Splits data = load_splits(a.data, enc, DataOptions{}, 0.1, a.seed);
  std::printf("data: %zu train, %zu valid examples\n", data.train.size(), data.valid.size());
  const bool chat = !data.train.empty() && data.train.front().offset > 0;
  const std::string prompt = a.prompt.empty() ? "" : chat ? ChatML{}.render({{"user", a.prompt}}, true) : a.prompt;

  const std::string before = lead ? generate(model, tok, prompt, a.max_tokens) : std::string();

  model.freeze();
  const int converted = apply_lora(model, a.lora);
  std::printf("LoRA rank %lld scale %g on %d projections: %s trainable of %s\n", static_cast<long long>(a.lora.rank),
              a.lora.effective_scale(), converted, nn::detail::with_commas(model.num_trainable()).c_str(),
              nn::detail::with_commas(model.num_params()).c_str());

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

  // Every rank starts from rank 0's trainable weights (the LoRA matrices; the frozen base came
  // from the same file everywhere), after checking that all ranks built the same tree. Then each
  // rank draws its own dropout masks: nn::random seeded with --seed + rank.
  nn::distributed::broadcast_parameters(model, world, 0, /*trainable_only=*/true);
  if (world.size() > 1) nn::distributed::seed(world, a.seed);

  Adam opt(make_schedule(a));
  opt.init(model);
  if (lead) fs::create_directories(a.adapter_path);
  const fs::path ckpt = fs::path(a.adapter_path) / "checkpoint.safetensors";
  // --pack: the training examples in rows of --seq positions, several per row (the padded
  // batches are --seq wide too, so the same positions carry more real tokens)
  std::vector<std::vector<std::size_t>> packed;
  if (a.pack) {
    packed = pack_examples(data.train, a.seq);
    std::printf("packing: %zu examples into %zu rows of %d positions, %.1f%% of positions used\n", data.train.size(),
                packed.size(), a.seq, 100.0 * pack_fill(data.train, packed, a.seq));
  }
  BatchOrder order = a.pack ? BatchOrder(packed.size(), static_cast<std::size_t>(a.batch), a.seed)
                            : BatchOrder(data.train, static_cast<std::size_t>(a.batch), a.seed);
  // This rank's rows of the next batch: padded examples, or packed rows with their documents.
  auto next_batch = [&]() {
    const std::vector<std::size_t> rows = my_rows(order.next(), world);
    if (!a.pack) return PackedBatch{make_batch(data.train, rows, a.seq + 1, a.seq, model.dtype()), Tensor(), Tensor()};
    std::vector<std::vector<std::size_t>> sel;
    for (std::size_t r : rows) sel.push_back(packed[r]);
    return make_packed_batch(data.train, std::span(sel), a.seq, model.dtype());
  };
  if (a.resume) {
    if (!fs::exists(ckpt)) nn::detail::fail("finetune", "--resume: no checkpoint at ", ckpt.string());
    try {
      load_into(ckpt, model, opt, nn::LoadOptions{.allow_new_hyperparameters = a.resume_new_hyper});
    } catch (const nn::Error& e) {
      nn::detail::fail("finetune", e.what(), "\n(finetune: --resume-new-hyperparameters resumes with these flags on purpose)");
    }
    // the batch order is a function of the seed: replay it up to where the run stopped
    for (std::int64_t i = 0; i < opt.step() * a.grad_accum; ++i) order.next();
    std::printf("resumed at step %lld\n", static_cast<long long>(opt.step()));
  }

  auto loss_fn = [](GTape<cpu>& tp, const CausalLM& m, GVar ids, GVar targets, GVar mask) {
    return cross_entropy(tp, m.logits(tp, ids), targets, mask, Reduction::mean);
  };
  auto packed_loss_fn = [](GTape<cpu>& tp, const CausalLM& m, GVar ids, GVar targets, GVar mask, GVar starts,
                           GVar positions) {
    return cross_entropy(tp, m.logits(tp, ids, Packing{starts, positions}), targets, mask, Reduction::mean);
  };
  auto step = compile<3>(model, opt, loss_fn);
  auto packed_step = compile<5>(model, opt, packed_loss_fn);  // records on its first call only
  nn::distributed::GradientAverager avg(world);  // token-weighted: each rank's weight is its real targets
  if (world.size() > 1) {
    step.reduce_gradients(avg);
    packed_step.reduce_gradients(avg);
  }
  auto save_all = [&]() {
    if (!lead) return;
    save_mlx_adapters(a.adapter_path, model, a.lora);
    if (a.peft) save_peft_adapters(fs::path(a.adapter_path) / "peft", model, a.lora, a.model);
    save(ckpt, model, opt);
  };

  finetune::Progress progress(a.iters, lead ? (fs::path(a.adapter_path) / "metrics.jsonl").string() : std::string());
  finetune::Series train_curve, val_curve;
  if (!a.resume) {
    const double v0 = evaluate(model, data.valid, a.val_batches, a.batch, a.seq, world);
    if (!std::isnan(v0)) {
      progress.validation(0, v0);
      val_curve.emplace_back(0, v0);
    }
  }
  std::int64_t trained = 0;  // target tokens trained on (all ranks), padding and prompts excluded
  for (int it = static_cast<int>(opt.step()) + 1; it <= a.iters; ++it) {
    double loss = 0;
    std::int64_t tokens = 0;
    // The loss logged is the global batch's (token-weighted over the ranks); tokens count every rank's.
    if (a.grad_accum == 1) {
      const PackedBatch pb = next_batch();
      const Batch& b = pb.batch;
      avg.set_weight(static_cast<double>(b.tokens));
      const double l = a.pack ? packed_step(b.inputs, b.targets, b.mask, pb.starts, pb.positions).item()
                              : step(b.inputs, b.targets, b.mask).item();
      loss = nn::distributed::weighted_mean(world, l, static_cast<double>(b.tokens));
      tokens = b.inputs.numel();
      trained += static_cast<std::int64_t>(world.sum(static_cast<double>(b.tokens)));
    } else {  // several micro-batches per update: eager gradients, summed, then one update
      std::optional<CausalLM> sum;
      for (int k = 0; k < a.grad_accum; ++k) {
        const PackedBatch pb = next_batch();
        const Batch& b = pb.batch;
        auto [l, g] = value_and_grad(model, [&](GTape<cpu>& tp, const CausalLM& m) {
          if (a.pack)
            return packed_loss_fn(tp, m, tp.constant(b.inputs), tp.constant(b.targets), tp.constant(b.mask),
                                  tp.constant(pb.starts), tp.constant(pb.positions));
          return loss_fn(tp, m, tp.constant(b.inputs), tp.constant(b.targets), tp.constant(b.mask));
        });
        // each micro-batch's gradient is the global micro-batch's, as one process computes it
        avg.set_weight(static_cast<double>(b.tokens));
        if (world.size() > 1) avg.average(g);
        loss += nn::distributed::weighted_mean(world, l.item(), static_cast<double>(b.tokens)) / a.grad_accum;
        tokens += b.inputs.numel();
        trained += static_cast<std::int64_t>(world.sum(static_cast<double>(b.tokens)));
        if (!sum) sum = std::move(g);
        else nn::tree_add(*sum, g);
      }
      nn::tree_scale(*sum, 1.0 / a.grad_accum);
      opt.update(model, *sum);
    }
    tokens = static_cast<std::int64_t>(world.sum(static_cast<double>(tokens)));
    train_curve.emplace_back(it, loss);
    progress.step(it, loss, opt.learning_rate(), tokens, std::max(1, a.iters / 20));
    if (a.val_every > 0 && (it % a.val_every == 0 || it == a.iters)) {
      const double v = evaluate(model, data.valid, a.val_batches, a.batch, a.seq, world);
      if (!std::isnan(v)) {
        progress.validation(it, v);
        val_curve.emplace_back(it, v);
      }
    }
    if (a.save_every > 0 && it % a.save_every == 0) save_all();
  }
  save_all();
  if (!lead) return 0;  // the rest (curve, samples, exports) is rank 0's
  const fs::path svg = fs::path(a.adapter_path) / "loss.svg";
  finetune::write_loss_svg(svg.string(), train_curve, val_curve);
  std::printf("adapters: %s (mlx-lm)%s; loss curve: %s; %.1f s\n", a.adapter_path.c_str(),
              a.peft ? ", peft/ (PEFT)" : "", svg.string().c_str(), progress.seconds());
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
    model.map_modules<LoraLinear>([](const std::string&) { return true; },
                                  [](const std::string&, const LoraLinear& l) { return l.fused(); });
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
    return run(parse(argc, argv));
  } catch (const nn::Error& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  } catch (const std::exception& e) {
    std::fprintf(stderr, "error: %s\n", e.what());
    return 1;
  }
}
