// SPDX-License-Identifier: MIT OR Apache-2.0
// The GEMM micro-kernels alone (include/nn/backend/gemm.hpp's micro_body), bit for bit against a
// scalar model of what they compute: each C element of a tile is a chain over k = 0..kc-1 in order,
// s = s + A(i, k) B(k, j) from s = 0 (one fused multiply-add per step where the ISA has FMA: the
// AVX2 and AVX-512 kernels; a product and a sum on the SSE2 baseline), then added to C unless
// overwriting. Packed A and A read in place, every kernel set this CPU runs, float and double.
//
// This file is also built as its own program with -mtune=znver3 (tests/CMakeLists.txt:
// micro_kernel_znver3), the tuning under which the AVX2 kernel pins its B vectors in registers
// (gemm::kPinAvx2B): that code path exists only in builds tuned for AMD Zen 2/3 (-march=native
// there), so without that program no test would run it.
#include <doctest/doctest.h>

#include <cmath>
#include <random>
#include <string>
#include <vector>

#include <nn/backend/cpu_info.hpp>
#include <nn/backend/gemm.hpp>

namespace backend_micro_kernel {  // one unity source with the other backend files: its names stay its own

using namespace nn;

namespace {

/// The scalar model of one kernel set's arithmetic: s + a * b, fused where the kernel fuses.
template <class T>
[[gnu::optimize("fp-contract=off")]] T step(bool fused, T s, T a, T b) {
  if (fused) return std::fma(a, b, s);
  const T p = a * b;
  return s + p;
}

template <class T, Isa I>
void check_kernels(unsigned seed) {
  using S = gemm::Shape<T, I>;
  constexpr int MR = S::MR, NR = S::NR;
  const bool fused = I != Isa::generic;  // x86's SSE2 baseline has no FMA
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  for (gemm::index kc : {1, 2, 3, 16, 57}) {
    CAPTURE(kc);
    // packed A panel: a[k * MR + i]; the same values as rows read in place: ar[i * lda + k]
    const gemm::index lda = kc + 3, ldb = NR + 5, ldc = NR + 7;
    std::vector<T> a(static_cast<std::size_t>(kc * MR)), ar(static_cast<std::size_t>(MR * lda));
    std::vector<T> b(static_cast<std::size_t>(kc * ldb));
    for (gemm::index k = 0; k < kc; ++k)
      for (int i = 0; i < MR; ++i) ar[i * lda + k] = a[k * MR + i] = static_cast<T>(u(g));
    for (T& x : b) x = static_cast<T>(u(g));
    std::vector<T> c0(static_cast<std::size_t>(MR * ldc));
    for (T& x : c0) x = static_cast<T>(u(g));
    for (int overwrite = 0; overwrite < 2; ++overwrite) {
      CAPTURE(overwrite);
      std::vector<T> want = c0;
      for (int i = 0; i < MR; ++i)
        for (int j = 0; j < NR; ++j) {
          T s = 0;
          for (gemm::index k = 0; k < kc; ++k) s = step<T>(fused, s, a[k * MR + i], b[k * ldb + j]);
          want[i * ldc + j] = overwrite ? s : want[i * ldc + j] + s;
        }
      const gemm::Kernels<T> kern = gemm::micro_kernels<T, I>();
      std::vector<T> packed = c0, direct = c0;
      kern.packed(kc, a.data(), 0, b.data(), ldb, packed.data(), ldc, overwrite);
      kern.direct(kc, ar.data(), lda, b.data(), ldb, direct.data(), ldc, overwrite);
      CHECK(packed == want);  // every element, padding columns (left alone) included
      CHECK(direct == want);
    }
  }
}

}  // namespace

TEST_CASE_TEMPLATE("each micro-kernel is the in-order multiply-add chain, bit for bit", T, float, double) {
  const Isa best = detail::detect_cpu_features().best_isa();
  MESSAGE("runs " << std::string(isa_name(best)) << " and below; AVX2 B vectors pinned in registers (znver tuning): "
                  << std::string(gemm::kPinAvx2B ? "yes" : "no"));
  check_kernels<T, Isa::generic>(1);
#if defined(__x86_64__) || defined(__i386__)
  if (static_cast<int>(best) >= static_cast<int>(Isa::avx2)) check_kernels<T, Isa::avx2>(2);
  if (static_cast<int>(best) >= static_cast<int>(Isa::avx512)) check_kernels<T, Isa::avx512>(3);
#endif
#if defined(NN_EXPECT_PINNED_AVX2)
  CHECK(gemm::kPinAvx2B);  // the tuned program really builds the pinned path
#endif
}

}  // namespace backend_micro_kernel
