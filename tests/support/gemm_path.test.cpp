// SPDX-License-Identifier: MIT OR Apache-2.0
// Guards the build: each ops test binary runs the GEMM path it was set up for (nn's engine, CBLAS
// or Eigen), and that path agrees with a naive triple loop in both float widths and every transpose.
#include "support/check.hpp"

using namespace nn;

// NN_EXPECT_GEMM: 0 = nn's engine, 1 = CBLAS, 2 = Eigen.
TEST_CASE("the GEMM path is the one this target was configured for") {
  const detail::GemmChoice& g = detail::gemm_choice();
#if NN_EXPECT_GEMM == 1
  // CBLAS, unless OpenBLAS picked generic kernels on a better CPU: then nn's engine, and it says why
  if (g.engine == detail::GemmEngine::nn) CHECK(g.note.find("generic") != std::string::npos);
  else CHECK(g.engine == detail::GemmEngine::blas);
  CHECK(!g.note.empty());
#elif NN_EXPECT_GEMM == 2
  CHECK(g.engine == detail::GemmEngine::eigen);
  CHECK(cpu_info().gemm_id == "eigen");
#else
  CHECK(g.engine == detail::GemmEngine::nn);
  CHECK(g.note.empty());
#endif
}

TEST_CASE_TEMPLATE("matmul agrees with a naive loop for every transpose", T, float, double) {
  constexpr DType dt = std::is_same_v<T, float> ? DType::f32 : DType::f64;
  const std::int64_t M = 7, K = 33, N = 5;  // odd sizes: no kernel's tile divides them
  for (int ta = 0; ta < 2; ++ta)
    for (int tb = 0; tb < 2; ++tb) {
      Tensor A = test::random_tensor(ta ? Shape{K, M} : Shape{M, K}, dt, 11);
      Tensor Bm = test::random_tensor(tb ? Shape{N, K} : Shape{K, N}, dt, 12);
      GTape<cpu> tp;
      GVar c = matmul(tp, tp.constant(A), tp.constant(Bm), ta != 0, tb != 0);
      const T* a = A.data<T>();
      const T* b = Bm.data<T>();
      const T* got = tp.value(c).template data<T>();
      double worst = 0;
      for (std::int64_t i = 0; i < M; ++i)
        for (std::int64_t j = 0; j < N; ++j) {
          double want = 0;
          for (std::int64_t k = 0; k < K; ++k)
            want += double(ta ? a[k * M + i] : a[i * K + k]) * double(tb ? b[j * K + k] : b[k * N + j]);
          worst = std::max(worst, std::abs(double(got[i * N + j]) - want));
        }
      CHECK_MESSAGE(worst < (dt == DType::f32 ? 1e-4 : 1e-12), "ta=" << ta << " tb=" << tb);
    }
}
