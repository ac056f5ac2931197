// SPDX-License-Identifier: MIT OR Apache-2.0
// Token-by-token generation (CausalLM::decode with the KV cache) on a real model, its matrices
// kept quantized against the same model dequantized to float32 -- the products of one row of x
// that quantized_matmul's "faster at 1-8 tokens, where reading the weights dominates" is about.
// bench_quantized_matmul times one matrix called again and again, which stays in cache; here
// every matrix of every layer is read once a token, as a decode step reads them.
//
//   bench_decode --model PATH [--threads N] [--prompt N] [--tokens N] [--rounds N] [--only quantized|dequantized]
//
// Both models take the same prompt (N token ids), then `--tokens` greedy steps of one token;
// rounds alternate quantized / dequantized. Prints each round, then one `RESULT` line with the
// median tokens/s of each and their ratio, and whether both chose the same tokens (they should:
// the dequantized weights are the quantized values exactly, only the summation order differs).
// --only runs one of the two (to profile it alone: perf record bench_decode ... --only quantized).
// Where nn::set_int8_activations applies (a CPU with AVX512-VNNI), the quantized model also
// runs with it on (quantized_int8): x rounded to int8 in its 1-row products, as llama.cpp does.
#include <nn/nn.hpp>
#include <nn/lm/pretrained.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <string>
#include <vector>

#include "common.hpp"

namespace {

struct Run {
  double ms_per_token = 0;        // decode steps only (after the prefill)
  std::vector<std::int32_t> ids;  // the greedy tokens
};

std::int32_t argmax_last(const nn::Tensor& logits) {
  const std::int64_t V = logits.dim(-1), last = logits.numel() / V - 1;
  std::int32_t best = 0;
  double bv = -1e300;
  for (std::int64_t v = 0; v < V; ++v)
    if (const double x = logits.item(last * V + v); x > bv) bv = x, best = static_cast<std::int32_t>(v);
  return best;
}

Run generate(const nn::lm::CausalLM& m, const std::vector<std::int32_t>& prompt, int tokens) {
  nn::lm::KVCache cache;
  Run r;
  std::int32_t next =
      argmax_last(m.decode(nn::Tensor::from<std::int32_t>({1, static_cast<std::int64_t>(prompt.size())}, prompt), cache));
  const auto t0 = std::chrono::steady_clock::now();
  for (int i = 0; i < tokens; ++i) {
    r.ids.push_back(next);
    next = argmax_last(m.decode(nn::Tensor::from<std::int32_t>({1, 1}, {next}), cache));
  }
  r.ms_per_token = std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count() / tokens;
  return r;
}

double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}

}  // namespace

int main(int argc, char** argv) try {
  bench::print_cpu_info();
  std::string model_path, only;
  int threads = 1, prompt_len = 16, tokens = 32, rounds = 3;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--model") model_path = v;
    else if (k == "--threads") threads = std::stoi(v);
    else if (k == "--prompt") prompt_len = std::stoi(v);
    else if (k == "--tokens") tokens = std::stoi(v);
    else if (k == "--rounds") rounds = std::stoi(v);
    else if (k == "--only") only = v;
    else nn::detail::fail("bench_decode", "unknown option ", k);
  }
  if (model_path.empty() || argc % 2 == 0)
    nn::detail::fail("bench_decode", "usage: bench_decode --model PATH [--threads N] [--prompt N] [--tokens N] [--rounds N]");
  if (threads < 1 || prompt_len < 1 || tokens < 1 || rounds < 1) nn::detail::fail("bench_decode", "counts must be positive");
  if (!only.empty() && only != "quantized" && only != "dequantized")
    nn::detail::fail("bench_decode", "--only is quantized or dequantized, got ", only);
  bench::set_threads(threads);

  const bool run_q = only != "dequantized", run_d = only != "quantized";
  const nn::lm::CausalLM quantized = nn::lm::load_pretrained(model_path, nn::DType::f32, true).model;
  nn::lm::CausalLM dequantized;  // a (0-layer) placeholder when --only quantized
  if (run_d) dequantized = nn::lm::load_pretrained(model_path, nn::DType::f32, false).model;
  std::uint64_t s = 7;
  std::vector<std::int32_t> prompt;
  for (int i = 0; i < prompt_len; ++i)
    prompt.push_back(static_cast<std::int32_t>(bench::splitmix64(s) % static_cast<std::uint64_t>(quantized.config().vocab_size)));

  const auto gen = [&](bool run, const nn::lm::CausalLM& m, int n) { return run ? generate(m, prompt, n) : Run{}; };
  gen(run_q, quantized, 2), gen(run_d, dequantized, 2);  // warm-up: first touches, thread pools
  const bool run_i = run_q && nn::detail::quant_vnni();
  const auto gen_int8 = [&](int n) {
    nn::set_int8_activations(true);
    const Run r = gen(run_i, quantized, n);
    nn::set_int8_activations(false);
    return r;
  };
  gen_int8(2);
  std::vector<double> q_ms, d_ms, i_ms;
  bool same = true, same_int8 = true;
  for (int r = 0; r < rounds; ++r) {
    const Run q = gen(run_q, quantized, tokens), i = gen_int8(tokens), d = gen(run_d, dequantized, tokens);
    q_ms.push_back(q.ms_per_token), d_ms.push_back(d.ms_per_token), i_ms.push_back(i.ms_per_token);
    same = same && q.ids == d.ids;
    same_int8 = same_int8 && i.ids == q.ids;
    std::printf("round %d: quantized %.2f ms/token, quantized_int8 %.2f ms/token, dequantized %.2f ms/token\n", r,
                q.ms_per_token, i.ms_per_token, d.ms_per_token);
  }
  const double q = median(q_ms), d = median(d_ms), i8 = median(i_ms);  // 0 for what did not run
  std::printf("RESULT threads=%d prompt=%d tokens=%d quantized_tok_s=%.1f dequantized_tok_s=%.1f ratio=%.2f "
              "same_tokens=%s quantized_int8_tok_s=%.1f int8_ratio=%.2f int8_same_tokens=%s rss_peak_mb=%.1f\n",
              threads, prompt_len, tokens, q > 0 ? 1e3 / q : 0.0, d > 0 ? 1e3 / d : 0.0, q > 0 ? d / q : 0.0,
              run_q && run_d ? (same ? "yes" : "no") : "n/a", i8 > 0 ? 1e3 / i8 : 0.0, i8 > 0 && d > 0 ? d / i8 : 0.0,
              run_i ? (same_int8 ? "yes" : "no") : "n/a",
              static_cast<double>(bench::proc_status_kb("VmHWM")) / 1024.0);
  return 0;
} catch (const std::exception& e) {
  std::fprintf(stderr, "error: %s\n", e.what());
  return 1;
}
