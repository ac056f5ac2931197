// SPDX-License-Identifier: MIT OR Apache-2.0
// libFuzzer harness for the safetensors reader: any bytes either load or raise a
// "[safetensors] ..." nn::Error, and a file that loads survives a write/read round trip unchanged.
// Built and run by tests/fuzz/run.sh (clang++ -fsanitize=fuzzer,address,undefined).
#include <nn/io/safetensors.hpp>

#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <optional>

namespace {

[[noreturn]] void broken(const char* what) {
  std::fprintf(stderr, "safetensors_fuzz: invariant broken: %s\n", what);
  std::abort();  // libFuzzer records the input as a crash
}

bool same_bytes(std::span<const std::byte> a, std::span<const std::byte> b) {
  return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size()) == 0);
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  const auto* p = reinterpret_cast<const std::byte*>(data);
  std::optional<nn::SafetensorsFile> f;
  try {
    f.emplace(nn::SafetensorsFile::from_bytes(std::vector<std::byte>(p, p + size), "<fuzz>"));
  } catch (const nn::Error& e) {
    // Only the reader's own errors; any other exception escapes and is reported as a crash.
    if (std::strncmp(e.what(), "[safetensors] <fuzz>: ", 22) != 0) broken("error message without the file prefix");
    return 0;
  }

  // Accepted: the tensors cover the data buffer exactly, each view lies inside it (ASan checks
  // every byte read), and the loadable ones convert.
  std::uint64_t covered = 0;
  unsigned sink = 0;
  for (const auto& v : f->views()) {
    auto b = v.bytes();
    covered += b.size();
    for (std::byte x : b) sink += static_cast<unsigned>(x);
    if (v.tensor_dtype() && v.shape().size() <= static_cast<std::size_t>(nn::kMaxRank)) {
      nn::Tensor t = v.to_tensor();
      if (t.dtype() != *v.tensor_dtype() || t.numel() != v.numel()) broken("to_tensor shape or dtype");
    }
  }
  if (covered != size - f->data_start()) broken("the tensors do not cover the data buffer");
  (void)sink;

  // Round trip through the writer: the same names, order, dtypes, shapes, bytes and metadata.
  std::vector<std::byte> again = nn::serialize_safetensors(f->views(), f->metadata());
  std::optional<nn::SafetensorsFile> g;
  try {
    g.emplace(nn::SafetensorsFile::from_bytes(std::move(again), "<fuzz round trip>"));
  } catch (const nn::Error& e) {
    std::fprintf(stderr, "%s\n", e.what());
    broken("a file written from an accepted file is refused");
  }
  if (g->names() != f->names() || g->metadata() != f->metadata()) broken("names or metadata changed");
  if (g->data_start() % 8 != 0) broken("the writer did not pad the header to 8 bytes");
  for (std::size_t i = 0; i < f->size(); ++i) {
    auto a = f->view(i), b = g->view(i);
    if (a.dtype() != b.dtype() || a.shape() != b.shape() || !same_bytes(a.bytes(), b.bytes()))
      broken("a tensor changed in the round trip");
  }
  return 0;
}
