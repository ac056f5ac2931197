// SPDX-License-Identifier: MIT OR Apache-2.0
// The finetune workload, nn's side: LoRA steps on a real pretrained model (by default the main
// job's SmolLM2-135M-Instruct, dequantised to float32) as examples/finetune takes them: base
// frozen, LoRA on the chosen projections of every layer, Adam, one compiled step. Batches come
// from bench::batch's splitmix64 stream, which bench/finetune_peft.py (PyTorch + PEFT on the same
// file) reproduces; bench/run_finetune.sh runs both and prints the ratio.
//
//   bench_finetune --model PATH [--threads N] [--steps N] [--warmup N] [--batch B] [--seq T]
//                  [--rank 8] [--scale 20] [--keys q_proj,v_proj] [--precision f32|bf16]
//                  [--base dequantized|quantized] [--grad-checkpoint 0|1] [--full N] [--loss fused|logits]
//
// --full N trains the last N decoder layers' own weights instead (-1: all layers; the embedding,
// final norm and head stay frozen, as mlx-lm's --fine-tune-type full), on a float32 base.
//
// --base quantized keeps a quantized GGUF's matrices quantized (QLoRA over affine blocks, as the
// finetune example does by default); dequantized (the default, what PyTorch + PEFT run) widens
// them to float32 on load. --grad-checkpoint 1 recomputes each decoder layer in the backward pass
// (CausalLM::grad_checkpoint, finetune --grad-checkpoint). --loss fused (the default, what the
// finetune runs) takes the loss through CausalLM::loss (linear_cross_entropy: no logits stored);
// logits records the (B, T, vocab) logits and cross_entropy over them, as before it.
//
// Prints one `RESULT key=value ...` line (tokens/s from the median step; tape_mb: the buffers the
// compiled step's memory-planned tape holds, GTape::bytes), and the cost of the
// compiled step's per-call structure check beside the step.
#include <nn/nn.hpp>
#include <nn/lm/pretrained.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <sstream>
#include <string>
#include <vector>

#include "common.hpp"

int main(int argc, char** argv) try {
  bench::print_cpu_info();
  std::string model_path, keys = "q_proj,v_proj", precision = "f32", base = "dequantized", loss = "fused";
  int threads = 1, steps = 10, warmup = 2, grad_checkpoint = 0, full = 0;
  bool full_given = false;
  std::int64_t B = 4, T = 64;
  nn::lm::LoraConfig lora;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_path = v;
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--steps") steps = std::stoi(v);
    else if (k == "--warmup") warmup = std::stoi(v);
    else if (k == "--batch") B = std::stoll(v);
    else if (k == "--seq") T = std::stoll(v);
    else if (k == "--rank") lora.rank = std::stoll(v);
    else if (k == "--scale") lora.scale = std::stod(v);
    else if (k == "--keys") keys = v;
    else if (k == "--precision") precision = v;
    else if (k == "--base") base = v;
    else if (k == "--grad-checkpoint") grad_checkpoint = std::stoi(v);
    else if (k == "--full") full = std::stoi(v), full_given = true;
    else if (k == "--loss") loss = v;
    else nn::detail::fail("bench_finetune", "unknown option ", k);
  }
  if (model_path.empty() || argc % 2 == 0) nn::detail::fail("bench_finetune", "usage: bench_finetune --model PATH [--threads N] ...");
  if (threads < 1 || steps < 1 || warmup < 1 || B < 1 || T < 2) nn::detail::fail("bench_finetune", "sizes must be positive");
  if (precision != "f32" && precision != "bf16") nn::detail::fail("bench_finetune", "--precision is f32 or bf16");
  if (loss != "fused" && loss != "logits") nn::detail::fail("bench_finetune", "--loss is fused or logits");
  if (base != "dequantized" && base != "quantized") nn::detail::fail("bench_finetune", "--base is dequantized or quantized");
  if (full_given && base == "quantized") nn::detail::fail("bench_finetune", "--full trains float weights: --base dequantized");
  lora.keys.clear();
  std::istringstream ks(keys);
  for (std::string k; std::getline(ks, k, ',');)
    if (!k.empty()) lora.keys.push_back(nn::lm::lora_key_path(k));
  bench::set_threads(threads);

  const long rss_start_kb = bench::proc_status_kb("VmRSS");
  nn::random::seed(0);
  nn::lm::CausalLM model = nn::lm::load_pretrained(model_path, nn::DType::f32, base == "quantized").model;
  model.freeze();
  if (full_given) {
    const int first = full < 0 ? 0 : static_cast<int>(model.config().num_hidden_layers) - full;
    model.unfreeze([first](const std::string& p) {
      const auto lp = nn::lm::detail::layer_path(p);
      return lp && lp->first >= first;
    });
  } else {
    nn::lm::apply_lora(model, lora);
  }
  if (precision == "bf16") nn::set_precision(model, nn::Precision::bf16);  // the frozen base in bfloat16
  model.grad_checkpoint(grad_checkpoint != 0);
  nn::Adam opt(1e-4);
  opt.init(model);
  const std::int64_t V = model.config().vocab_size;
  std::vector<std::pair<nn::Tensor, nn::Tensor>> data;
  for (std::uint64_t i = 0; i < 4; ++i) data.push_back(bench::batch(i, B, T, V));
  nn::Tensor mask = nn::Tensor::full({B, T}, 1.0, model.dtype());
  using LossFn = nn::GVar (*)(nn::GTape<nn::cpu>&, const nn::lm::CausalLM&, nn::GVar, nn::GVar, nn::GVar);
  const LossFn fused = [](nn::GTape<nn::cpu>& tp, const nn::lm::CausalLM& m, nn::GVar ids, nn::GVar tg, nn::GVar keep) {
    return m.loss(tp, ids, tg, keep, nn::Reduction::mean);
  };
  const LossFn logits = [](nn::GTape<nn::cpu>& tp, const nn::lm::CausalLM& m, nn::GVar ids, nn::GVar tg, nn::GVar keep) {
    return nn::cross_entropy(tp, m.logits(tp, ids), tg, keep, nn::Reduction::mean);
  };
  auto step = nn::compile<3>(model, opt, loss == "fused" ? fused : logits);
  auto run = [&](int i) {
    const auto& [ids, tg] = data[static_cast<std::size_t>(i) % data.size()];
    return step(ids, tg, mask).item();
  };
  double first_loss = 0, last_loss = 0;
  for (int i = 0; i < warmup; ++i) {
    const double l = run(i);  // the first call records
    if (i == 0) first_loss = l;
  }
  std::vector<double> ms;
  const double cpu0 = bench::cpu_seconds();
  for (int i = 0; i < steps; ++i) {
    const auto t0 = std::chrono::steady_clock::now();
    last_loss = run(warmup + i);
    ms.push_back(std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count());
  }
  const double cpu_ms = (bench::cpu_seconds() - cpu0) * 1e3 / steps;
  std::sort(ms.begin(), ms.end());
  const double median_ms = ms[ms.size() / 2];
  // What the compiled step's staleness check costs on every call: the model's structure hash
  // (its whole tree, with every NN_STATIC value) and the optimizer's hyperparameter hash.
  std::uint64_t sink = 0;
  const auto h0 = std::chrono::steady_clock::now();
  constexpr int kHashes = 200;
  for (int i = 0; i < kHashes; ++i) sink += nn::detail::structure_hash(model) + opt.hyper_hash();
  const double check_us =
      std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now() - h0).count() / kHashes;
  std::printf("structure check: %.1f us per call (%.4f%% of the median step; checksum %016llx)\n", check_us,
              100.0 * check_us / (median_ms * 1e3), static_cast<unsigned long long>(sink));
  std::printf("RESULT impl=nn threads=%d tok_s=%.1f median_ms=%.2f min_ms=%.2f cpu_ms=%.2f rss_peak_mb=%.1f "
              "rss_start_mb=%.1f rss_now_mb=%.1f loss_first=%.4f loss_last=%.4f params=%lld trainable=%lld "
              "precision=%s base=%s grad_checkpoint=%d seq=%lld batch=%lld team_reductions=%lld tape_mb=%.1f mode=%s loss=%s\n",
              threads, static_cast<double>(B * T) / (median_ms / 1e3), median_ms, ms[0], cpu_ms,
              static_cast<double>(bench::proc_status_kb("VmHWM")) / 1024.0, static_cast<double>(rss_start_kb) / 1024.0,
              static_cast<double>(bench::proc_status_kb("VmRSS")) / 1024.0, first_loss, last_loss,
              static_cast<long long>(model.num_params()), static_cast<long long>(model.num_trainable()),
              precision.c_str(), base.c_str(), grad_checkpoint, static_cast<long long>(T), static_cast<long long>(B),
              static_cast<long long>(nn::detail::TeamLoad::get().reductions()),
              static_cast<double>(step.tape().bytes()) / 1e6, full_given ? "full" : "lora", loss.c_str());
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
