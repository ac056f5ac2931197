// SPDX-License-Identifier: MIT OR Apache-2.0
// CPUID feature detection (include/nn/backend/cpu_info.hpp) against the kernel's own reading of
// the same bits (/proc/cpuinfo flags, Linux), and the NN_CPU_ISA override.
#include "support/check.hpp"

#include <cstdlib>
#include <fstream>
#include <set>
#include <sstream>

namespace backend_cpu_info {  // one unity source with the other backend files: its names stay its own

using namespace nn;

TEST_CASE("the detected features agree with /proc/cpuinfo's flags") {
  std::ifstream f("/proc/cpuinfo");
  std::string line;
  std::set<std::string> flags;
  while (std::getline(f, line))
    if (line.rfind("flags", 0) == 0) {
      std::istringstream is(line.substr(line.find(':') + 1));
      for (std::string w; is >> w;) flags.insert(w);
      break;
    }
  if (flags.empty()) {
    MESSAGE("no /proc/cpuinfo flags here: nothing to compare");
    return;
  }
  const CpuFeatures c = detail::detect_cpu_features();
  // Linux clears a flag whose register state the OS does not enable, as nn's XCR0 test does.
  CHECK(c.avx2 == flags.count("avx2"));
  CHECK(c.fma == flags.count("fma"));
  CHECK(c.avx512f == flags.count("avx512f"));
  CHECK(c.avx512bw == flags.count("avx512bw"));
  CHECK(c.avx512vl == flags.count("avx512vl"));
  CHECK(c.avx512dq == flags.count("avx512dq"));
  CHECK(c.avx512_vnni == flags.count("avx512_vnni"));
  CHECK(c.avx512_bf16 == flags.count("avx512_bf16"));
  CHECK(c.avx512_fp16 == flags.count("avx512_fp16"));
  CHECK(c.amx_tile == flags.count("amx_tile"));
  MESSAGE(cpu_info().line());
}

TEST_CASE("NN_CPU_ISA lowers the kernel set and can never raise it past the CPU") {
  const CpuFeatures f = detail::detect_cpu_features();
  const char* old = std::getenv("NN_CPU_ISA");
  const std::string saved = old ? old : "";
  setenv("NN_CPU_ISA", "generic", 1);
  CHECK(detail::choose_isa(f) == Isa::generic);
  setenv("NN_CPU_ISA", "avx512", 1);
  CHECK(detail::choose_isa(f) == f.best_isa());  // asked above the CPU: its best, never a fault
  setenv("NN_CPU_ISA", "avx2", 1);
  CHECK(detail::choose_isa(f) == (f.best_isa() == Isa::generic ? Isa::generic : Isa::avx2));
  setenv("NN_CPU_ISA", "", 1);
  CHECK(detail::choose_isa(f) == f.best_isa());
  CpuFeatures none;
  CHECK(none.best_isa() == Isa::generic);
  CpuFeatures avx2_only = none;
  avx2_only.avx2 = avx2_only.fma = true;
  CHECK(avx2_only.best_isa() == Isa::avx2);
  avx2_only.avx512f = true;  // AVX-512F alone (no BW/DQ/VL) is not the AVX-512 set the kernels use
  CHECK(avx2_only.best_isa() == Isa::avx2);
  if (old) setenv("NN_CPU_ISA", saved.c_str(), 1);
  else unsetenv("NN_CPU_ISA");
}

}  // namespace backend_cpu_info
