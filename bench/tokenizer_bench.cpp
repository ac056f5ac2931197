// SPDX-License-Identifier: MIT OR Apache-2.0
// Encode and decode throughput of nn::lm::Tokenizer on a text corpus, beside Hugging Face
// `tokenizers` on the same files when python3 can import it; prints both figures and their ratio.
//
// Usage: bench_tokenizer [--tokenizer tokenizer.json] [--corpus corpus.json|file.txt]
//                        [--repeat 5] [--no-reference]
// Defaults: the committed fixtures (tests/fixtures/lm/tokenizer/real_qwen2.json, a Qwen2
// vocabulary pruned to what the sample needs, and corpus_sample.json, ~290 KB). For the figures
// worth quoting use the full files from `tests/oracle/gen_tokenizer.py --full DIR`
// (DIR/real_qwen2.json and DIR/corpus.json, ~1.3 MB).
//
// "cold" is the first pass over the corpus with an empty word cache (a fresh tokenizer), "warm"
// the median of the later passes. Both sides run on one thread (TOKENIZERS_PARALLELISM=false and
// RAYON_NUM_THREADS=1 for the reference, which encodes chunk by chunk as nn does). Each figure
// is MB of UTF-8 input per second of process CPU time (std::clock / time.process_time): on one
// thread that is the wall time of an idle machine, and it stays meaningful on a shared one.
#include <algorithm>
#include <cstdio>
#include <ctime>
#include <cstdlib>
#include <fstream>
#include <sstream>
#include <string>
#include <vector>

#include <nlohmann/json.hpp>

#include <nn/lm/tokenizer.hpp>

#ifndef NN_SOURCE_DIR
#define NN_SOURCE_DIR "."
#endif

namespace {

// Process CPU time, in seconds.
struct Clock {
  using time_point = std::clock_t;
  static time_point now() { return std::clock(); }
};
double seconds_since(Clock::time_point t0) { return static_cast<double>(Clock::now() - t0) / CLOCKS_PER_SEC; }

std::vector<std::string> load_corpus(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) {
    std::fprintf(stderr, "cannot open %s\n", path.c_str());
    std::exit(1);
  }
  if (path.size() > 5 && path.substr(path.size() - 5) == ".json")
    return nlohmann::json::parse(f).at("chunks").get<std::vector<std::string>>();
  std::stringstream ss;
  ss << f.rdbuf();
  std::vector<std::string> chunks;  // ~2 KB pieces cut at line ends, like the generator's
  const std::string all = ss.str();
  std::size_t i = 0;
  while (i < all.size()) {
    std::size_t e = std::min(all.size(), i + 2048);
    const std::size_t nl = all.find('\n', e);
    e = nl == std::string::npos ? all.size() : nl + 1;
    chunks.push_back(all.substr(i, e - i));
    i = e;
  }
  return chunks;
}

// Hugging Face `tokenizers` on the same files, or a negative figure when it cannot run.
struct Reference {
  double load_s = -1, cold = -1, warm = -1, decode = -1;
  long long ids = -1;
};

Reference run_reference(const std::string& tok, const std::string& corpus, int repeat) {
  const std::string script = R"PY(
import json, os, statistics, sys, time
os.environ["TOKENIZERS_PARALLELISM"] = "false"
os.environ["RAYON_NUM_THREADS"] = "1"
from tokenizers import Tokenizer
tok, corpus, repeat = sys.argv[1], sys.argv[2], int(sys.argv[3])
if corpus.endswith(".json"):
    chunks = json.load(open(corpus, encoding="utf-8"))["chunks"]
else:
    text = open(corpus, encoding="utf-8").read()
    chunks, i = [], 0
    while i < len(text):
        e = text.find("\n", i + 2048)
        e = len(text) if e < 0 else e + 1
        chunks.append(text[i:e]); i = e
mb = sum(len(c.encode()) for c in chunks) / 1e6
t0 = time.process_time(); t = Tokenizer.from_file(tok); load = time.process_time() - t0
times, ids = [], None
for r in range(repeat + 1):
    t0 = time.process_time(); out = [t.encode(c).ids for c in chunks]; times.append(time.process_time() - t0)
    ids = out
n = sum(len(x) for x in ids)
t0 = time.process_time(); [t.decode(x, skip_special_tokens=False) for x in ids]; dec = time.process_time() - t0
print(load, mb / times[0], mb / statistics.median(times[1:]), mb / dec, n)
)PY";
  char tmpl[] = "/tmp/nn_tokenizer_bench_XXXXXX";
  const int fd = mkstemp(tmpl);
  if (fd < 0) return {};
  FILE* f = fdopen(fd, "w");
  std::fputs(script.c_str(), f);
  std::fclose(f);
  const std::string cmd = "TOKENIZERS_PARALLELISM=false RAYON_NUM_THREADS=1 python3 " + std::string(tmpl) + " '" + tok +
                          "' '" + corpus + "' " + std::to_string(repeat) + " 2>/dev/null";
  Reference r;
  if (FILE* p = popen(cmd.c_str(), "r")) {
    if (std::fscanf(p, "%lf %lf %lf %lf %lld", &r.load_s, &r.cold, &r.warm, &r.decode, &r.ids) != 5) r = {};
    pclose(p);
  }
  std::remove(tmpl);
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  std::string tok = std::string(NN_SOURCE_DIR) + "/tests/fixtures/lm/tokenizer/real_qwen2.json";
  std::string corpus = std::string(NN_SOURCE_DIR) + "/tests/fixtures/lm/tokenizer/corpus_sample.json";
  int repeat = 5;
  bool reference = true;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--tokenizer" && i + 1 < argc) tok = argv[++i];
    else if (a == "--corpus" && i + 1 < argc) corpus = argv[++i];
    else if (a == "--repeat" && i + 1 < argc) repeat = std::max(1, std::atoi(argv[++i]));
    else if (a == "--no-reference") reference = false;
    else {
      std::fprintf(stderr, "usage: %s [--tokenizer F] [--corpus F] [--repeat N] [--no-reference]\n", argv[0]);
      return 2;
    }
  }
  const auto chunks = load_corpus(corpus);
  double mb = 0;
  for (const auto& c : chunks) mb += static_cast<double>(c.size()) / 1e6;

  auto t0 = Clock::now();
  auto t = nn::lm::Tokenizer::from_file(tok);
  const double load_s = seconds_since(t0);

  std::vector<double> times;
  std::vector<std::vector<std::int32_t>> ids(chunks.size());
  for (int r = 0; r <= repeat; ++r) {
    t0 = Clock::now();
    for (std::size_t i = 0; i < chunks.size(); ++i) ids[i] = t.encode(chunks[i]);
    times.push_back(seconds_since(t0));
  }
  long long n_ids = 0;
  for (const auto& v : ids) n_ids += static_cast<long long>(v.size());
  std::vector<double> warm(times.begin() + 1, times.end());
  std::sort(warm.begin(), warm.end());
  const double cold_mbs = mb / times[0];
  const double warm_mbs = mb / warm[warm.size() / 2];
  t0 = Clock::now();
  std::size_t out_bytes = 0;
  for (const auto& v : ids) out_bytes += t.decode(v).size();
  const double dec_mbs = mb / seconds_since(t0);

  std::printf("tokenizer %s\ncorpus    %s (%.3f MB, %zu chunks; %lld ids, %.2f bytes/id)\n\n", tok.c_str(), corpus.c_str(), mb,
              chunks.size(), n_ids, mb * 1e6 / static_cast<double>(n_ids));
  const Reference ref = reference ? run_reference(tok, corpus, repeat) : Reference{};
  std::printf("| %-16s | %12s | %12s | %8s |\n", "", "nn", "tokenizers", "ratio");
  std::printf("|------------------|--------------|--------------|----------|\n");
  auto row = [&](const char* name, double mine, double theirs, bool higher_better, const char* unit) {
    if (theirs > 0)
      std::printf("| %-16s | %8.2f %-3s | %8.2f %-3s | %7.2fx |\n", name, mine, unit, theirs, unit,
                  higher_better ? mine / theirs : theirs / mine);
    else
      std::printf("| %-16s | %8.2f %-3s | %12s | %8s |\n", name, mine, unit, "n/a", "");
  };
  row("load (s)", load_s, ref.load_s, false, "s");
  row("encode cold", cold_mbs, ref.cold, true, "MB/s");
  row("encode warm", warm_mbs, ref.warm, true, "MB/s");
  row("decode", dec_mbs, ref.decode, true, "MB/s");
  if (ref.ids >= 0 && ref.ids != n_ids) std::printf("\nWARNING: id counts differ: nn %lld, tokenizers %lld\n", n_ids, ref.ids);
  else if (ref.ids >= 0) std::printf("\nid counts agree (%lld)\n", n_ids);
  if (!reference || ref.cold < 0) std::printf("\n(reference not run: needs python3 with `pip install tokenizers`)\n");
  std::printf("(ratio > 1: nn is faster; out %zu bytes decoded)\n", out_bytes);
  return 0;
}
