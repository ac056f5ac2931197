// SPDX-License-Identifier: MIT OR Apache-2.0
// What the process holds: its resident memory now and at its peak, as the kernel counts it
// (Linux's /proc/self/status; -1 where there is none). The benches print them, and the finetune
// program checks that a quantized base loads without a float copy of its matrices.
#pragma once

#include <cstdlib>
#include <fstream>
#include <string>

namespace nn {

/// A "<field>: <n> kB" line of /proc/self/status in kB (VmRSS: resident now; VmHWM: the peak so
/// far), or -1 when the file or the field is missing.
inline long proc_status_kb(const char* field) {
  std::ifstream f("/proc/self/status");
  std::string line;
  const std::string key = std::string(field) + ":";
  while (std::getline(f, line))
    if (line.rfind(key, 0) == 0) return std::atol(line.c_str() + key.size());
  return -1;
}
inline long rss_kb() { return proc_status_kb("VmRSS"); }
inline long peak_rss_kb() { return proc_status_kb("VmHWM"); }

}  // namespace nn
