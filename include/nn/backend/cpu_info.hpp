// SPDX-License-Identifier: MIT OR Apache-2.0
// nn::cpu_info(): what this x86 CPU can run, read from CPUID feature bits and the OS's XCR0 state
// mask -- never from a table of model names -- and which GEMM kernel nn runs on it.
#pragma once

#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <string>
#include <string_view>

#if (defined(__x86_64__) || defined(__i386__)) && (defined(__GNUC__) || defined(__clang__))
#include <cpuid.h>
#define NN_X86_CPUID 1
#endif

namespace nn {

/// The instruction sets nn's own kernels are compiled for, best last. A kernel set runs only
/// where every instruction it uses is both present (CPUID) and enabled by the OS (XCR0).
enum class Isa : std::uint8_t {
  generic,  ///< the compiler's baseline (SSE2 on x86-64): portable vector code, no feature test
  avx2,     ///< AVX2 + FMA3, 16 ymm registers
  avx512,   ///< AVX-512 F/BW/DQ/VL + FMA3, 32 zmm registers
};

constexpr const char* isa_name(Isa i) {
  switch (i) {
    case Isa::generic: return "generic";
    case Isa::avx2: return "avx2";
    case Isa::avx512: return "avx512";
  }
  return "?";
}

/// Feature bits of the running CPU (all false off x86), plus its vendor and brand strings.
struct CpuFeatures {
  std::string vendor;  ///< "GenuineIntel", "AuthenticAMD", ...
  std::string brand;   ///< the CPUID brand string, e.g. "Intel(R) Xeon(R) Processor"
  int family = 0, model = 0;  ///< display family and model: printed, never used to choose a kernel
  bool sse2 = false, avx = false, fma = false, avx2 = false, f16c = false;
  bool avx512f = false, avx512dq = false, avx512bw = false, avx512vl = false;
  bool avx512_vnni = false, avx512_bf16 = false, avx512_fp16 = false;
  bool amx_tile = false, amx_bf16 = false, amx_int8 = false;

  /// The best kernel set this CPU (and OS) can run.
  Isa best_isa() const {
    if (avx512f && avx512dq && avx512bw && avx512vl && fma && avx2) return Isa::avx512;
    if (avx2 && fma) return Isa::avx2;
    return Isa::generic;
  }
};

namespace detail {

#if defined(NN_X86_CPUID)
struct CpuidRegs {
  unsigned a = 0, b = 0, c = 0, d = 0;
};
inline CpuidRegs cpuid(unsigned leaf, unsigned sub = 0) {
  CpuidRegs r;
  if (!__get_cpuid_count(leaf, sub, &r.a, &r.b, &r.c, &r.d)) r = {};
  return r;
}
/// XCR0: which register states the OS saves on a context switch (AVX needs bits 1-2, AVX-512
/// bits 5-7, AMX bits 17-18). Read with the raw opcode so no -mxsave is needed.
inline std::uint64_t xcr0() {
  unsigned lo = 0, hi = 0;
  __asm__ volatile(".byte 0x0f, 0x01, 0xd0" : "=a"(lo), "=d"(hi) : "c"(0));
  return (static_cast<std::uint64_t>(hi) << 32) | lo;
}
#endif

inline CpuFeatures detect_cpu_features() {
  CpuFeatures f;
#if defined(NN_X86_CPUID)
  const auto bit = [](unsigned reg, int n) { return ((reg >> n) & 1u) != 0; };
  const CpuidRegs l0 = cpuid(0);
  char vendor[13] = {};
  std::memcpy(vendor + 0, &l0.b, 4);
  std::memcpy(vendor + 4, &l0.d, 4);
  std::memcpy(vendor + 8, &l0.c, 4);
  f.vendor = vendor;
  const CpuidRegs l1 = l0.a >= 1 ? cpuid(1) : CpuidRegs{};
  const unsigned base_family = (l1.a >> 8) & 0xf, base_model = (l1.a >> 4) & 0xf;
  f.family = static_cast<int>(base_family == 0xf ? base_family + ((l1.a >> 20) & 0xff) : base_family);
  f.model = static_cast<int>((base_family == 0x6 || base_family == 0xf) ? (((l1.a >> 16) & 0xf) << 4) + base_model
                                                                        : base_model);
  f.sse2 = bit(l1.d, 26);
  const bool osxsave = bit(l1.c, 27);
  const std::uint64_t xcr = osxsave ? xcr0() : 0;
  const bool os_avx = (xcr & 0x6) == 0x6;
  const bool os_avx512 = os_avx && (xcr & 0xe0) == 0xe0;
  const bool os_amx = (xcr & 0x60000) == 0x60000;
  f.avx = os_avx && bit(l1.c, 28);
  f.fma = f.avx && bit(l1.c, 12);
  f.f16c = f.avx && bit(l1.c, 29);
  if (l0.a >= 7) {
    const CpuidRegs l7 = cpuid(7, 0), l71 = cpuid(7, 1);
    f.avx2 = f.avx && bit(l7.b, 5);
    f.avx512f = os_avx512 && bit(l7.b, 16);
    f.avx512dq = f.avx512f && bit(l7.b, 17);
    f.avx512bw = f.avx512f && bit(l7.b, 30);
    f.avx512vl = f.avx512f && bit(l7.b, 31);
    f.avx512_vnni = f.avx512f && bit(l7.c, 11);
    f.avx512_fp16 = f.avx512f && bit(l7.d, 23);
    f.avx512_bf16 = f.avx512f && bit(l71.a, 5);
    f.amx_bf16 = os_amx && bit(l7.d, 22);
    f.amx_tile = os_amx && bit(l7.d, 24);
    f.amx_int8 = os_amx && bit(l7.d, 25);
  }
  if (cpuid(0x80000000).a >= 0x80000004) {
    char brand[49] = {};
    for (unsigned i = 0; i < 3; ++i) {
      const CpuidRegs r = cpuid(0x80000002 + i);
      std::memcpy(brand + 16 * i + 0, &r.a, 4);
      std::memcpy(brand + 16 * i + 4, &r.b, 4);
      std::memcpy(brand + 16 * i + 8, &r.c, 4);
      std::memcpy(brand + 16 * i + 12, &r.d, 4);
    }
    std::string_view s(brand);
    while (!s.empty() && s.front() == ' ') s.remove_prefix(1);
    while (!s.empty() && s.back() == ' ') s.remove_suffix(1);
    f.brand = std::string(s);
  }
#endif
  return f;
}

/// The kernel set nn's GEMM runs: the CPU's best, unless NN_CPU_ISA (generic | avx2 | avx512)
/// asks for a lower one -- a way to run and test every kernel set on one machine. Asking for
/// one the CPU lacks keeps the CPU's best (running it would fault).
inline Isa choose_isa(const CpuFeatures& f) {
  const Isa best = f.best_isa();
  const char* env = std::getenv("NN_CPU_ISA");
  if (!env || !*env) return best;
  const std::string_view want(env);
  Isa asked = best;
  if (want == "generic") asked = Isa::generic;
  else if (want == "avx2") asked = Isa::avx2;
  else if (want == "avx512") asked = Isa::avx512;
  return static_cast<int>(asked) <= static_cast<int>(best) ? asked : best;
}

/// The kernel set in use (the GEMM's and simd.hpp's), chosen once per process.
inline Isa active_isa() {
  static const Isa isa = choose_isa(detect_cpu_features());
  return isa;
}

}  // namespace detail

/// What nn detected and what it runs, read once per process by nn::cpu_info() (defined in
/// backend/cpu.hpp, where the GEMM engine is chosen).
struct CpuInfo {
  CpuFeatures features;
  Isa isa = Isa::generic;  ///< the kernel set nn's GEMM uses (see NN_CPU_ISA)
  std::string gemm;        ///< the GEMM engine and micro-kernels in use, e.g. "nn avx512 12x32 f32 / 12x16 f64 + gemv"
  std::string gemm_id;     ///< the same as one word: "nn-avx512", "nn-avx2", "nn-generic", "cblas" or "eigen"
  std::string note;        ///< why an external BLAS is or is not used (empty when none is linked)
  std::string bf16;        ///< how bf16 products run: "amx tdpbf16ps", "native vdpbf16ps" or "emulated (f32 kernels)"

  /// One line for logs: "cpu: <brand> (<vendor> family F model M) | avx2 fma avx512f ... | gemm: ...".
  std::string line() const {
    const CpuFeatures& f = features;
    std::string s = "cpu: " + (f.brand.empty() ? std::string("unknown CPU") : f.brand);
    if (!f.vendor.empty())
      s += " (" + f.vendor + " family " + std::to_string(f.family) + " model " + std::to_string(f.model) + ")";
    s += " | features:";
    const std::pair<bool, const char*> bits[] = {
        {f.avx2, "avx2"},           {f.fma, "fma"},         {f.avx512f, "avx512f"},         {f.avx512bw, "avx512bw"},
        {f.avx512vl, "avx512vl"},   {f.avx512dq, "avx512dq"}, {f.avx512_vnni, "avx512_vnni"}, {f.avx512_bf16, "avx512_bf16"},
        {f.avx512_fp16, "avx512_fp16"}, {f.amx_tile, "amx_tile"}, {f.amx_bf16, "amx_bf16"},   {f.amx_int8, "amx_int8"}};
    bool any = false;
    for (const auto& [on, name] : bits)
      if (on) {
        s += ' ';
        s += name;
        any = true;
      }
    if (!any) s += " (baseline only)";
    s += " | gemm: " + gemm;
    if (!note.empty()) s += " (" + note + ")";
    if (!bf16.empty()) s += " | bf16: " + bf16;
    return s;
  }
};

}  // namespace nn
