// SPDX-License-Identifier: MIT OR Apache-2.0
// A fresh scratch folder under the system temp dir, per test case, removed when the object goes.
#pragma once

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <string>
#include <system_error>
#include <vector>
#if !defined(_WIN32)
#include <unistd.h>
#endif

namespace nn::test {

struct TempDir {
  std::filesystem::path path;
  /// `prefix` names the test area, so a leftover folder says whose it is.
  explicit TempDir(const std::string& prefix = "nn_test") {
    static std::atomic<int> n{0};
#if defined(_WIN32)
    const int pid = 0;
#else
    const int pid = static_cast<int>(::getpid());
#endif
    path = std::filesystem::temp_directory_path() / (prefix + "_" + std::to_string(pid) + "_" + std::to_string(n++));
    std::filesystem::remove_all(path);
    std::filesystem::create_directories(path);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  std::filesystem::path operator/(const std::string& name) const { return path / name; }
  /// The folder's entries, sorted by name.
  std::vector<std::string> listing() const {
    std::vector<std::string> v;
    for (const auto& e : std::filesystem::directory_iterator(path)) v.push_back(e.path().filename().string());
    std::sort(v.begin(), v.end());
    return v;
  }
};

}  // namespace nn::test
