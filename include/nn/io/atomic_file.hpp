// SPDX-License-Identifier: MIT OR Apache-2.0
// Atomic file writes, shared by every writer of nn (safetensors, GGUF): the bytes go to a hidden
// temporary sibling of the target, are fsync'ed, and the temporary file is renamed over the
// target. On any error (a full disk, a write limit, an exception from the caller's emitter) the
// temporary file is removed and the target is left as it was, so a failed save never leaves a
// half-written file under the target's name.
//
// A save that is killed (SIGKILL, a power cut) cannot remove its temporary file; the next save to
// the same target removes the temporaries of processes that no longer exist (POSIX), so killed
// saves leave no orphans behind for long. What is promised: the target is always either the old
// file or the new one, whole (the data is fsync'ed before the rename, the folder after it).
//
// A target that exists and is not a regular file (a character device such as /dev/full, a FIFO)
// cannot be replaced by a rename; it is written straight through, and errors still surface.
#pragma once

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstddef>
#include <cstring>
#include <filesystem>
#include <functional>
#include <string>
#include <string_view>

#include "../config.hpp"

#if defined(_WIN32)
#ifndef NOMINMAX
#define NOMINMAX
#endif
#include <windows.h>
#else
#include <csignal>
#include <cstdlib>
#include <fcntl.h>
#include <signal.h>
#include <sys/stat.h>
#include <unistd.h>
#endif

namespace nn::detail {

/// Receives the file's bytes in order.
using ByteSink = std::function<void(const std::byte*, std::size_t)>;

/// Writes what `emit` sends to its sink to `target`, atomically (see the file comment). `who`
/// leads error messages ("[who] <target>: cannot write ...").
#if defined(_WIN32)
inline void write_atomically(const std::filesystem::path& target, std::string_view who,
                             const std::function<void(const ByteSink&)>& emit) {
  const std::string label = target.string();
  static std::atomic<unsigned> counter{0};
  std::filesystem::path tmp = target;
  tmp += L".tmp." + std::to_wstring(GetCurrentProcessId()) + L"." + std::to_wstring(counter++);
  HANDLE fh = CreateFileW(tmp.c_str(), GENERIC_WRITE, 0, nullptr, CREATE_NEW, FILE_ATTRIBUTE_NORMAL, nullptr);
  if (fh == INVALID_HANDLE_VALUE)
    fail(who, label, ": cannot create the temporary file ", tmp.string(), " (Windows error ", GetLastError(), ")");
  struct Guard {
    HANDLE& fh;
    const std::filesystem::path& tmp;
    bool done = false;
    ~Guard() {
      if (fh != INVALID_HANDLE_VALUE) CloseHandle(fh);
      if (!done) DeleteFileW(tmp.c_str());
    }
  } guard{fh, tmp};
  emit([&](const std::byte* p, std::size_t k) {
    while (k) {
      DWORD chunk = static_cast<DWORD>(std::min<std::size_t>(k, 1u << 30)), got = 0;
      if (!WriteFile(fh, p, chunk, &got, nullptr))
        fail(who, label, ": cannot write ", tmp.string(), " (Windows error ", GetLastError(), ")");
      p += got;
      k -= got;
    }
  });
  if (!FlushFileBuffers(fh)) fail(who, label, ": cannot flush ", tmp.string());
  CloseHandle(fh);
  fh = INVALID_HANDLE_VALUE;
  if (!MoveFileExW(tmp.c_str(), target.c_str(), MOVEFILE_REPLACE_EXISTING | MOVEFILE_WRITE_THROUGH))
    fail(who, label, ": cannot rename ", tmp.string(), " over it (Windows error ", GetLastError(), ")");
  guard.done = true;
}
#else
/// Removes "." + base + ".tmp.<pid>.<n>" files in `dir` whose process <pid> is gone: the
/// leftovers of killed saves to the same target. A live process's temporary is left alone.
inline void remove_stale_temporaries(const std::filesystem::path& dir, const std::string& base) {
  const std::string prefix = "." + base + ".tmp.";
  std::error_code ec;
  for (std::filesystem::directory_iterator it(dir, ec), end; !ec && it != end; it.increment(ec)) {
    const std::string name = it->path().filename().string();
    if (name.rfind(prefix, 0) != 0) continue;
    const std::string rest = name.substr(prefix.size());
    const std::size_t dot = rest.find('.');
    if (dot == 0 || dot == std::string::npos || rest.find_first_not_of("0123456789.") != std::string::npos) continue;
    const long pid = std::strtol(rest.substr(0, dot).c_str(), nullptr, 10);
    if (pid <= 0 || pid == static_cast<long>(::getpid())) continue;
    if (::kill(static_cast<pid_t>(pid), 0) == -1 && errno == ESRCH) ::unlink(it->path().c_str());
  }
}

inline void write_atomically(const std::filesystem::path& target, std::string_view who,
                             const std::function<void(const ByteSink&)>& emit) {
  namespace fs = std::filesystem;
  const std::string label = target.string();
  const std::string base = target.filename().string();
  if (base.empty() || base == "." || base == "..") fail(who, label, ": the path names no file");
  fs::path dir = target.parent_path();
  if (dir.empty()) dir = ".";

  struct stat st {};
  // (A directory is not special: the rename over it fails, and the temporary file goes.)
  const bool special = ::stat(target.c_str(), &st) == 0 && !S_ISREG(st.st_mode) && !S_ISDIR(st.st_mode);

  // A hidden sibling, so rename() stays inside one file system and is atomic there.
  static std::atomic<unsigned> counter{0};
  if (!special) remove_stale_temporaries(dir, base);
  std::string tmp = special ? label : std::string();
  int fd = -1;
  if (special) {
    fd = ::open(target.c_str(), O_WRONLY | O_CLOEXEC | O_NONBLOCK);
  } else {
    for (int attempt = 0; attempt < 64 && fd < 0; ++attempt) {
      tmp = (dir / ("." + base + ".tmp." + std::to_string(::getpid()) + "." + std::to_string(counter++))).string();
      fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_EXCL | O_CLOEXEC, 0666);
      if (fd < 0 && errno != EEXIST) break;
    }
  }
  if (fd < 0)
    fail(who, label, special ? ": cannot open: " : ": cannot create the temporary file ", special ? "" : tmp,
         special ? "" : ": ", std::strerror(errno));
  struct Guard {  // closes, and removes the temporary file unless it was renamed into place
    int fd;
    const std::string& tmp;
    bool done;
    ~Guard() {
      if (fd >= 0) ::close(fd);
      if (!done) ::unlink(tmp.c_str());
    }
  } g{fd, tmp, special};

  std::size_t written = 0;
  emit([&](const std::byte* p, std::size_t k) {
    while (k) {
      const ssize_t w = ::write(g.fd, p, std::min<std::size_t>(k, std::size_t{1} << 30));
      if (w < 0) {
        if (errno == EINTR) continue;
        fail(who, label, ": cannot write", special ? "" : " the temporary file ", special ? "" : tmp, " (", written,
             " bytes written): ", std::strerror(errno));
      }
      p += w;
      k -= static_cast<std::size_t>(w);
      written += static_cast<std::size_t>(w);
    }
  });
  if (special) return;
  // The data must be on disk before the rename makes it the target, or a crash could leave a
  // renamed but empty file.
  if (::fsync(g.fd) != 0) fail(who, label, ": cannot fsync the temporary file ", tmp, ": ", std::strerror(errno));
  const int cfd = g.fd;
  g.fd = -1;
  if (::close(cfd) != 0) fail(who, label, ": cannot close the temporary file ", tmp, ": ", std::strerror(errno));
  if (::rename(tmp.c_str(), target.c_str()) != 0)
    fail(who, label, ": cannot rename the temporary file ", tmp, " over it: ", std::strerror(errno));
  g.done = true;
  // Persist the rename itself; best effort (some file systems refuse fsync on a directory).
  int dfd = ::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC);
  if (dfd >= 0) {
    (void)::fsync(dfd);
    ::close(dfd);
  }
}
#endif

}  // namespace nn::detail
