// SPDX-License-Identifier: MIT OR Apache-2.0
// Replays the committed fuzz inputs without libFuzzer (CTest: fuzz_replay). Every harness of
// tests/fuzz/ is compiled into this program with its LLVMFuzzerTestOneInput renamed
// nn_fuzz_<name> (tests/CMakeLists.txt), and each file of <dir>/corpus/<name>/ and
// <dir>/crashes/<name>/ goes through it: a broken invariant aborts (the file is named first),
// an exception that escapes fails the run. Usage: fuzz_replay <tests/fuzz dir> [name...]
#include <algorithm>
#include <csignal>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <exception>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <string>
#include <vector>

#include <unistd.h>

#define NN_FUZZ_HARNESSES(X) X(safetensors) X(gguf) X(tokenizer) X(config) X(jsonl) X(checkpoint) X(adapter_config) X(chat_template)

#define NN_FUZZ_DECLARE(name) extern "C" int nn_fuzz_##name(const std::uint8_t*, std::size_t);
NN_FUZZ_HARNESSES(NN_FUZZ_DECLARE)

namespace {

struct Harness {
  const char* name;
  int (*run)(const std::uint8_t*, std::size_t);
};
#define NN_FUZZ_ENTRY(name) Harness{#name, nn_fuzz_##name},
const Harness kHarnesses[] = {NN_FUZZ_HARNESSES(NN_FUZZ_ENTRY)};

char current[4096];  // the input being replayed, for the abort handler

extern "C" void on_abort(int) {
  const char head[] = "fuzz_replay: aborted on ";
  (void)!write(2, head, sizeof head - 1);
  (void)!write(2, current, std::strlen(current));
  (void)!write(2, "\n", 1);
  std::signal(SIGABRT, SIG_DFL);
  std::raise(SIGABRT);
}

}  // namespace

int main(int argc, char** argv) {
  namespace fs = std::filesystem;
  if (argc < 2) {
    std::fprintf(stderr, "usage: fuzz_replay <tests/fuzz dir> [harness...]\n");
    return 2;
  }
  std::signal(SIGABRT, on_abort);
  const fs::path root = argv[1];
  std::vector<std::string> only(argv + 2, argv + argc);
  std::size_t total = 0;
  for (const Harness& h : kHarnesses) {
    if (!only.empty() && std::find(only.begin(), only.end(), h.name) == only.end()) continue;
    std::size_t n = 0;
    for (const char* kind : {"corpus", "crashes"}) {
      const fs::path dir = root / kind / h.name;
      if (!fs::is_directory(dir)) continue;
      std::vector<fs::path> files;
      for (const auto& e : fs::directory_iterator(dir))
        if (e.is_regular_file()) files.push_back(e.path());
      std::sort(files.begin(), files.end());
      for (const fs::path& f : files) {
        std::snprintf(current, sizeof current, "%s (harness %s)", f.string().c_str(), h.name);
        std::ifstream in(f, std::ios::binary);
        const std::vector<char> bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        if (!in.good() && !in.eof()) {
          std::fprintf(stderr, "fuzz_replay: cannot read %s\n", current);
          return 1;
        }
        try {
          h.run(reinterpret_cast<const std::uint8_t*>(bytes.data()), bytes.size());
        } catch (const std::exception& e) {
          std::fprintf(stderr, "fuzz_replay: an exception escaped on %s: %s\n", current, e.what());
          return 1;
        } catch (...) {
          std::fprintf(stderr, "fuzz_replay: an unknown exception escaped on %s\n", current);
          return 1;
        }
        ++n;
      }
    }
    if (n == 0) {  // a missing corpus would pass silently otherwise
      std::fprintf(stderr, "fuzz_replay: no inputs for harness %s under %s\n", h.name, root.string().c_str());
      return 1;
    }
    std::printf("fuzz_replay: %-15s %6zu inputs, no crash\n", h.name, n);
    total += n;
  }
  std::printf("fuzz_replay: %zu inputs in all\n", total);
  return 0;
}
