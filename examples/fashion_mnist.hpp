// SPDX-License-Identifier: MIT OR Apache-2.0
// Fashion-MNIST for the examples (mlp, mnist): Debian's dataset-fashion-mnist, gzip'd IDX files
// in /usr/share/datasets/fashion-mnist, read through `gzip -dc` (gzip is essential on every
// Debian system, so the examples need no zlib).
#pragma once

#include <nn/nn.hpp>

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <string>
#include <vector>

namespace fashion_mnist {

/// Where the files are: $NN_FASHION_MNIST_DIR, else Debian's folder.
inline std::filesystem::path default_dir() {
  if (const char* env = std::getenv("NN_FASHION_MNIST_DIR")) return env;
  return "/usr/share/datasets/fashion-mnist";
}

/// Whether `dir` holds the training images (gzip'd or not).
inline bool present(const std::filesystem::path& dir) {
  return std::filesystem::exists(dir / "train-images-idx3-ubyte.gz") || std::filesystem::exists(dir / "train-images-idx3-ubyte");
}

/// One u8 IDX file (LeCun's format): magic 0x000008RR (rank RR), RR big-endian u32 dims, bytes.
struct Idx {
  std::vector<std::int64_t> dims;
  std::vector<std::uint8_t> bytes;
};

/// Reads `base`, or `base`.gz through gzip; errors start with "[who]".
inline Idx read_idx(const std::filesystem::path& base, const std::string& who) {
  const std::string tag = "[" + who + "] ";
  std::vector<std::uint8_t> raw;
  auto slurp = [&raw](std::FILE* f) {
    std::uint8_t buf[1 << 16];
    for (std::size_t n; (n = std::fread(buf, 1, sizeof buf, f)) > 0;) raw.insert(raw.end(), buf, buf + n);
  };
  if (std::filesystem::exists(base)) {
    std::FILE* f = std::fopen(base.c_str(), "rb");
    if (!f) throw nn::Error(tag + "cannot open " + base.string());
    slurp(f);
    std::fclose(f);
  } else {
    const std::string gz = base.string() + ".gz";
    if (gz.find('\'') != std::string::npos) throw nn::Error(tag + "path contains a quote: " + gz);
    std::FILE* p = popen(("gzip -dc -- '" + gz + "'").c_str(), "r");
    if (!p) throw nn::Error(tag + "cannot run gzip on " + gz);
    slurp(p);
    if (pclose(p) != 0) throw nn::Error(tag + "gzip failed on " + gz);
  }
  auto be32 = [&raw](std::size_t at) {
    return std::uint32_t(raw[at]) << 24 | std::uint32_t(raw[at + 1]) << 16 | std::uint32_t(raw[at + 2]) << 8 |
           std::uint32_t(raw[at + 3]);
  };
  if (raw.size() < 4 || raw[0] != 0 || raw[1] != 0 || raw[2] != 0x08)
    throw nn::Error(tag + base.string() + " is not a u8 IDX file");
  Idx idx;
  const std::size_t rank = raw[3], at = 4 + 4 * rank;
  if (raw.size() < at) throw nn::Error(tag + base.string() + " is truncated");
  std::size_t count = 1;
  for (std::size_t i = 0; i < rank; ++i) {
    idx.dims.push_back(be32(4 + 4 * i));
    count *= static_cast<std::size_t>(idx.dims.back());
  }
  if (raw.size() != at + count) throw nn::Error(tag + base.string() + " has the wrong size");
  idx.bytes.assign(raw.begin() + static_cast<std::ptrdiff_t>(at), raw.end());
  return idx;
}

/// Images as (N, 784) float32 in [0, 1] (mlx-examples mnist.py's scaling), labels as int32 (N).
struct Split {
  nn::Tensor x, y;
  std::int64_t n = 0;
};

/// The split `prefix` ("train" or "t10k"), its first `limit` images (0: all).
inline Split load_split(const std::filesystem::path& dir, const char* prefix, std::int64_t limit, const std::string& who) {
  Idx im = read_idx(dir / (std::string(prefix) + "-images-idx3-ubyte"), who);
  Idx lb = read_idx(dir / (std::string(prefix) + "-labels-idx1-ubyte"), who);
  if (im.dims.size() != 3 || lb.dims.size() != 1 || im.dims[0] != lb.dims[0] || im.dims[1] * im.dims[2] != 784)
    throw nn::Error("[" + who + "] unexpected shapes in " + dir.string() + "/" + prefix);
  Split s;
  s.n = limit > 0 ? std::min(limit, im.dims[0]) : im.dims[0];
  s.x = nn::Tensor::empty({s.n, 784}, nn::DType::f32);
  s.y = nn::Tensor::empty({s.n}, nn::DType::i32);
  float* x = s.x.data<float>();
  for (std::int64_t i = 0; i < s.n * 784; ++i) x[i] = static_cast<float>(im.bytes[static_cast<std::size_t>(i)]) / 255.0f;
  std::int32_t* y = s.y.data<std::int32_t>();
  for (std::int64_t i = 0; i < s.n; ++i) y[i] = lb.bytes[static_cast<std::size_t>(i)];
  return s;
}

}  // namespace fashion_mnist
