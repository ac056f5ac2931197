// SPDX-License-Identifier: MIT OR Apache-2.0
// nn's GEMM engine (include/nn/backend/gemm.hpp) against a naive triple loop in long double, for
// every kernel set this CPU runs, both float widths, every transpose, accumulate or overwrite,
// and shapes that cross every block edge (MR, NR, KC, NB, MB); the packing hook; the threaded
// split; the epilogue; the batched entry; and the engine the ops actually run. Also nn's GEMV
// (include/nn/backend/gemv.hpp), the one-row and one-column products, the same ways.
#include "support/check.hpp"

#include <cstdlib>
#include <limits>
#include <tuple>

#if defined(_OPENMP)
#include <omp.h>
#endif

namespace backend_gemm {  // one unity source with the other backend files: its names stay its own

using namespace nn;

namespace {

std::vector<Isa> runnable_isas() {
  std::vector<Isa> out;
  for (Isa i : {Isa::generic, Isa::avx2, Isa::avx512})
    if (static_cast<int>(i) <= static_cast<int>(detail::detect_cpu_features().best_isa())) out.push_back(i);
  return out;
}

template <class T>
std::vector<T> random_values(std::size_t n, unsigned seed) {
  std::mt19937 g(seed);
  std::uniform_real_distribution<double> u(-1, 1);
  std::vector<T> v(n);
  for (T& x : v) x = static_cast<T>(u(g));
  return v;
}

/// max |C - reference| / sqrt(K), with the reference summed in long double from the same inputs.
template <class T>
double gemm_error(Isa isa, bool ta, bool tb, std::int64_t M, std::int64_t N, std::int64_t K, bool acc,
                  std::int64_t ldc_pad = 0) {
  const std::vector<T> A = random_values<T>(static_cast<std::size_t>(M * K), 1);
  const std::vector<T> B = random_values<T>(static_cast<std::size_t>(K * N), 2);
  const std::int64_t ldc = N + ldc_pad;
  std::vector<T> C = random_values<T>(static_cast<std::size_t>(M * ldc), 3);
  if (!acc)  // an output buffer's stale contents must never be read when overwriting
    for (std::int64_t i = 0; i < M; ++i)
      for (std::int64_t j = 0; j < N; ++j) C[i * ldc + j] = std::numeric_limits<T>::quiet_NaN();
  const std::vector<T> C0 = C;
  const std::int64_t lda = ta ? M : K, ldb = tb ? K : N;
  gemm::gemm_serial<T>(isa, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, C.data(), ldc, acc);
  double worst = 0;
  for (std::int64_t i = 0; i < M; ++i) {
    for (std::int64_t j = 0; j < N; ++j) {
      long double s = acc ? C0[i * ldc + j] : 0.0L;
      for (std::int64_t k = 0; k < K; ++k)
        s += static_cast<long double>(ta ? A[k * lda + i] : A[i * lda + k]) *
             static_cast<long double>(tb ? B[j * ldb + k] : B[k * ldb + j]);
      const double d = std::abs(static_cast<double>(C[i * ldc + j] - s));
      worst = std::max(worst, std::isnan(d) ? INFINITY : d);
    }
    for (std::int64_t j = N; j < ldc; ++j)  // the padding past N is never written
      if (!(C[i * ldc + j] == C0[i * ldc + j])) worst = INFINITY;
  }
  return worst / std::sqrt(static_cast<double>(std::max<std::int64_t>(K, 1)));
}

}  // namespace

TEST_CASE_TEMPLATE("nn's GEMM matches a long-double loop on every kernel set, transpose and edge", T, float, double) {
  const double tol = std::is_same_v<T, float> ? 2e-6 : 4e-15;
  using S3 = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  // 1x1x1; ragged tiles; K past KC (384) so several slices accumulate; N past NB (384/512) so B
  // blocks repeat; M past MB (960/1536) so A blocks repeat.
  const std::vector<S3> shapes = {{1, 1, 1},  {13, 37, 5}, {6, 32, 1},   {25, 65, 800},
                                  {7, 530, 9}, {100, 33, 400}, {1601, 3, 2}, {2, 1000, 3},
                                  {40, 70, 27}};  // 27: a 16-deep transposed block and a tail
  for (Isa isa : runnable_isas())
    for (auto [M, N, K] : shapes)
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int acc = 0; acc < 2; ++acc) {
            const double e = gemm_error<T>(isa, ta, tb, M, N, K, acc, acc ? 3 : 0);
            CHECK_MESSAGE(e < tol, isa_name(isa) << " ta=" << ta << " tb=" << tb << " acc=" << acc << " " << M << "x"
                                                 << N << "x" << K << ": " << e);
          }
}

TEST_CASE("a K of zero zeroes or keeps C; an empty M or N touches nothing") {
  for (Isa isa : runnable_isas()) {
    std::vector<float> C(6, 5.0f);
    gemm::gemm_serial<float>(isa, false, false, 2, 3, 0, nullptr, 0, nullptr, 3, C.data(), 3, true);
    CHECK(C == std::vector<float>(6, 5.0f));
    gemm::gemm_serial<float>(isa, false, false, 2, 3, 0, nullptr, 0, nullptr, 3, C.data(), 3, false);
    CHECK(C == std::vector<float>(6, 0.0f));
    gemm::gemm_serial<float>(isa, false, false, 0, 3, 4, nullptr, 4, nullptr, 3, C.data(), 3, false);
    gemm::gemm_serial<float>(isa, false, false, 2, 0, 4, nullptr, 4, nullptr, 0, C.data(), 0, false);
    CHECK(C == std::vector<float>(6, 0.0f));
  }
}

TEST_CASE("a caller-supplied B packer (weights made on the fly) gives the dense product") {
  // B's values come from integer codes and a per-column scale, as a quantized weight's would:
  // the packer writes them straight into the panels, no dense B ever exists.
  const std::int64_t M = 29, N = 70, K = 450;  // ragged in every blocked dimension
  const std::vector<float> A = random_values<float>(static_cast<std::size_t>(M * K), 5);
  std::vector<int> codes(static_cast<std::size_t>(K * N));
  for (std::size_t i = 0; i < codes.size(); ++i) codes[i] = static_cast<int>((i * 7919) % 15) - 7;
  std::vector<float> scale(static_cast<std::size_t>(N));
  for (std::int64_t j = 0; j < N; ++j) scale[j] = 0.01f * static_cast<float>(j + 1);
  std::vector<float> dense(static_cast<std::size_t>(K * N));
  for (std::int64_t k = 0; k < K; ++k)
    for (std::int64_t j = 0; j < N; ++j) dense[k * N + j] = static_cast<float>(codes[k * N + j]) * scale[j];

  using S = gemm::Shape<float, Isa::generic>;
  auto pack_codes = [&](float* dst, std::int64_t j0, std::int64_t nc, std::int64_t k0, std::int64_t kc) {
    for (std::int64_t q = 0; q < nc; q += S::NR, dst += kc * S::NR)
      for (std::int64_t k = 0; k < kc; ++k)
        for (std::int64_t c = 0; c < S::NR; ++c) {
          const std::int64_t j = j0 + q + c;
          dst[k * S::NR + c] = j < j0 + nc ? static_cast<float>(codes[(k0 + k) * N + j]) * scale[j] : 0.0f;
        }
  };
  std::vector<float> got(static_cast<std::size_t>(M * N)), want(got.size());
  gemm::gemm_blocked<float, S>(gemm::micro_kernels<float, Isa::generic>(), M, N, K,
                               gemm::DensePackA<S::MR, float>{{A.data(), K, false}}, pack_codes, got.data(), N, false);
  gemm::gemm_serial<float>(Isa::generic, false, false, M, N, K, A.data(), K, dense.data(), N, want.data(), N, false);
  CHECK(got == want);  // same panels, same kernel, same order: bit for bit
}

TEST_CASE("the threaded split (shared B panels, or columns when rows are few) gives the serial result bit for bit") {
#if defined(_OPENMP)
  const int prev = omp_get_max_threads();
  omp_set_num_threads(2);
#endif
  for (auto [M, N, K, ta, tb] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool>{300, 70, 200, false, true},
                                 {40, 500, 130, true, false}, {97, 97, 97, true, true},
                                 {20, 3000, 50, false, true}, {130, 600, 800, false, false},
                                 // 4 B blocks x 3 K slices: the shared B buffer refilled many times
                                 {200, 1500, 900, true, false}}) {
    const std::vector<float> A = random_values<float>(static_cast<std::size_t>(M * K), 8);
    const std::vector<float> B = random_values<float>(static_cast<std::size_t>(K * N), 9);
    std::vector<float> c1(static_cast<std::size_t>(M * N)), c2(c1.size());
    const std::int64_t lda = ta ? M : K, ldb = tb ? K : N;
    gemm::gemm_serial<float>(gemm::active_isa(), ta, tb, M, N, K, A.data(), lda, B.data(), ldb, c1.data(), N, false);
    gemm::gemm_parallel<float>(gemm::active_isa(), ta, tb, M, N, K, A.data(), lda, B.data(), ldb, c2.data(), N, false);
    CHECK(c1 == c2);
  }
#if defined(_OPENMP)
  omp_set_num_threads(prev);
#endif
}

#if defined(__x86_64__) || defined(__i386__)
namespace {
/// pack(src, ld, kc, dst) against the element loop dst[k * L + l] = src[l * ld + k] for a strip of
/// L lines, every depth from 1 to 41 (whole 16- and 8-depth steps and tails), a padded ld, and
/// guard values past the panel that must stay as they were.
template <int L, class Pack>
void check_line_packer(const char* name, Pack pack) {
  const std::int64_t ld = 61;
  const std::vector<float> src = random_values<float>(static_cast<std::size_t>(L * ld), 31);
  for (std::int64_t kc = 1; kc <= 41; ++kc) {
    std::vector<float> dst(static_cast<std::size_t>(kc * L + 8), -7.0f);
    pack(src.data() + 3, ld, kc, dst.data());
    bool same = true;
    for (std::int64_t k = 0; k < kc; ++k)
      for (int l = 0; l < L; ++l) same = same && dst[k * L + l] == src[l * ld + 3 + k];
    for (std::size_t g = static_cast<std::size_t>(kc * L); g < dst.size(); ++g) same = same && dst[g] == -7.0f;
    CHECK_MESSAGE(same, name << " L=" << L << " kc=" << kc);
  }
}
}  // namespace

TEST_CASE("the packers' register transposes equal the element loop") {
  // The AVX2 one runs only where AVX2 is the kernel set in use, so it is tested here directly on
  // every CPU that has AVX2: A panels of 6 lines, B panels of 8 and 16, and 12 (a part block).
  const auto& f = detail::detect_cpu_features();
  if (f.best_isa() >= Isa::avx2) {
    check_line_packer<6>("avx2", gemm::pack_lines_avx2<6>);
    check_line_packer<8>("avx2", gemm::pack_lines_avx2<8>);
    check_line_packer<16>("avx2", gemm::pack_lines_avx2<16>);
    check_line_packer<12>("avx2", gemm::pack_lines_avx2<12>);  // a part block of 4 lines
  }
  // and the dispatching entry, whichever transpose this CPU's kernel set uses (or none)
  check_line_packer<16>("pack_panel", [](const float* src, std::int64_t ld, std::int64_t kc, float* dst) {
    gemm::pack_panel<16>(src, ld, false, 16, kc, dst);
  });
  check_line_packer<6>("pack_panel", [](const float* src, std::int64_t ld, std::int64_t kc, float* dst) {
    gemm::pack_panel<6>(src, ld, false, 6, kc, dst);
  });
}
#endif

TEST_CASE_TEMPLATE("B read in place (few A rows) and narrow products (run as their transpose) are bit-identical to packed",
                   T, float, double) {
  // In place: op(B) = X with at most kInPlaceBRows rows of A; the same product with X stored
  // transposed (op(B) = (X^T)^T) packs every B panel: same panels, same order, same bits.
  for (Isa isa : runnable_isas())
    for (auto [M, N, K] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{8, 576, 256}, {48, 70, 400},
                           {13, 33, 5}, {49, 64, 30}})
      for (int ta = 0; ta < 2; ++ta)
        for (int acc = 0; acc < 2; ++acc) {
          const std::vector<T> A = random_values<T>(static_cast<std::size_t>(M * K), 21);
          const std::vector<T> B = random_values<T>(static_cast<std::size_t>(K * N), 22);
          std::vector<T> Bt(B.size());
          for (std::int64_t k = 0; k < K; ++k)
            for (std::int64_t j = 0; j < N; ++j) Bt[j * K + k] = B[k * N + j];
          std::vector<T> c1 = random_values<T>(static_cast<std::size_t>(M * N), 23), c2 = c1;
          const std::int64_t lda = ta ? M : K;
          gemm::gemm_serial<T>(isa, ta, false, M, N, K, A.data(), lda, B.data(), N, c1.data(), N, acc);
          gemm::gemm_serial<T>(isa, ta, true, M, N, K, A.data(), lda, Bt.data(), K, c2.data(), N, acc);
          CHECK_MESSAGE(c1 == c2, isa_name(isa) << " in place " << M << "x" << N << "x" << K << " ta=" << ta);
        }
  // Narrow: C (M x N, N < a tile's width) computed as C^T = op(B)^T op(A)^T, seeded with C^T when
  // accumulating, K past KC so slices accumulate, a padded C, and an epilogue after the copy back.
  int narrow = 0;
  for (Isa isa : runnable_isas())
    for (auto [M, N, K] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{576, 8, 256}, {200, 1, 30},
                           {100, 15, 900}, {64, 5, 3}})
      for (int ta = 0; ta < 2; ++ta)
        for (int tb = 0; tb < 2; ++tb)
          for (int acc = 0; acc < 2; ++acc) {
            narrow += gemm::narrow_product<T>(isa, M, N);  // which shapes are narrow depends on the tile
            const std::vector<T> A = random_values<T>(static_cast<std::size_t>(M * K), 24);
            const std::vector<T> B = random_values<T>(static_cast<std::size_t>(K * N), 25);
            const std::vector<T> bias = random_values<T>(static_cast<std::size_t>(N), 26);
            const std::int64_t lda = ta ? M : K, ldb = tb ? K : N, ldc = N + 2;
            std::vector<T> c1 = random_values<T>(static_cast<std::size_t>(M * ldc), 27), c2 = c1;
            const gemm::BiasResidual<T> epi{bias.data()};
            gemm::gemm_serial<T>(isa, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, c1.data(), ldc, acc, epi);
            gemm::gemm_parallel<T>(isa, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, c2.data(), ldc, acc, epi);
            CHECK_MESSAGE(c1 == c2, isa_name(isa) << " narrow " << M << "x" << N << "x" << K << " ta=" << ta
                                                  << " tb=" << tb << " acc=" << acc);
          }
  CHECK(narrow > 0);
  CHECK(gemm::narrow_product<float>(Isa::avx512, 576, 8));        // LoRA rank 8: 8 of 12 rows, not 8 of 32 columns
  CHECK(gemm::narrow_product<float>(Isa::avx2, 576, 8));          // 8 of 12 rows (two 6-row tiles), not 8 of 16
  CHECK_FALSE(gemm::narrow_product<float>(Isa::avx512, 20, 8));   // too short to fill the transpose
  CHECK_FALSE(gemm::narrow_product<float>(Isa::avx512, 500, 32));  // a full tile wide already
}

// ---- matrix-vector products (backend/gemv.hpp) ---------------------------------------------

TEST_CASE_TEMPLATE("nn's GEMV (dot rows, axpy rows) matches a long-double loop on every kernel set and edge", T, float,
                   double) {
  const double tol = std::is_same_v<T, float> ? 2e-6 : 4e-15;
  // rows and columns around the bodies' steps: 4 rows, 2 vectors (dot), 8 vectors (axpy), a tail
  for (Isa isa : runnable_isas())
    for (std::int64_t rows : {1, 3, 4, 5, 9, 70})
      for (std::int64_t cols : {1, 7, 16, 33, 64, 129, 300})
        for (int along = 0; along < 2; ++along)
          for (int acc = 0; acc < 2; ++acc) {
            const std::int64_t ld = cols + 5, nx = along ? cols : rows, ny = along ? rows : cols;
            const std::vector<T> m = random_values<T>(static_cast<std::size_t>(rows * ld), 4);
            const std::vector<T> x = random_values<T>(static_cast<std::size_t>(nx * 2), 5);  // read at stride 2
            std::vector<T> y = random_values<T>(static_cast<std::size_t>(ny), 6);
            if (!acc) std::fill(y.begin(), y.end(), std::numeric_limits<T>::quiet_NaN());  // never read
            const std::vector<T> y0 = y;
            gemm::gemv<T>(isa, along, rows, cols, m.data(), ld, x.data(), 2, y.data(), acc);
            double worst = 0;
            for (std::int64_t o = 0; o < ny; ++o) {
              long double s = acc ? y0[o] : 0.0L;
              for (std::int64_t k = 0; k < nx; ++k)
                s += static_cast<long double>(along ? m[o * ld + k] : m[k * ld + o]) * static_cast<long double>(x[2 * k]);
              const double d = std::abs(static_cast<double>(y[o] - s));
              worst = std::max(worst, std::isnan(d) ? INFINITY : d);
            }
            CHECK_MESSAGE(worst / std::sqrt(static_cast<double>(nx)) < tol,
                          isa_name(isa) << (along ? " dot" : " axpy") << " rows=" << rows << " cols=" << cols
                                        << " acc=" << acc << ": " << worst);
          }
}

TEST_CASE_TEMPLATE("nn's GEMV on 2-4 vectors at once (x @ W^T on a few rows) matches a long-double loop", T, float,
                   double) {
  const double tol = std::is_same_v<T, float> ? 2e-6 : 4e-15;
  for (Isa isa : runnable_isas())
    for (int nv = 1; nv <= 4; ++nv)
      for (std::int64_t rows : {1, 2, 3, 6, 33})
        for (std::int64_t cols : {1, 15, 16, 17, 100})
          for (int acc = 0; acc < 2; ++acc) {
            const std::int64_t ld = cols + 3, ldx = cols + 1, ldy = rows + 2;
            const std::vector<T> m = random_values<T>(static_cast<std::size_t>(rows * ld), 11);
            const std::vector<T> x = random_values<T>(static_cast<std::size_t>(nv * ldx), 12);
            std::vector<T> y = random_values<T>(static_cast<std::size_t>(nv * ldy), 13);
            if (!acc)
              for (int n = 0; n < nv; ++n)
                for (std::int64_t i = 0; i < rows; ++i) y[n * ldy + i] = std::numeric_limits<T>::quiet_NaN();
            const std::vector<T> y0 = y;
            gemm::gemv_dot<T>(isa, nv, rows, cols, m.data(), ld, x.data(), ldx, y.data(), ldy, acc);
            double worst = 0;
            for (int n = 0; n < nv; ++n) {
              for (std::int64_t i = 0; i < rows; ++i) {
                long double s = acc ? y0[n * ldy + i] : 0.0L;
                for (std::int64_t k = 0; k < cols; ++k)
                  s += static_cast<long double>(m[i * ld + k]) * static_cast<long double>(x[n * ldx + k]);
                const double d = std::abs(static_cast<double>(y[n * ldy + i] - s));
                worst = std::max(worst, std::isnan(d) ? INFINITY : d);
              }
              for (std::int64_t i = rows; i < ldy; ++i)  // past the rows: never written
                if (!(y[n * ldy + i] == y0[n * ldy + i])) worst = INFINITY;
            }
            CHECK_MESSAGE(worst / std::sqrt(static_cast<double>(cols)) < tol,
                          isa_name(isa) << " nv=" << nv << " rows=" << rows << " cols=" << cols << " acc=" << acc
                                        << ": " << worst);
          }
}

TEST_CASE("one-row, one-column and few-row products on the tape's matmul go through nn's GEMV and match the GEMM") {
  // every transpose of op(A) @ op(B) with M == 1 or N == 1, as cpu::matmul lays them out, and
  // 2-4 rows of x @ W^T (the others of those go to the GEMM)
  for (auto [M, N, K] : {std::tuple<std::int64_t, std::int64_t, std::int64_t>{1, 300, 70}, {90, 1, 513}, {1, 1, 40},
                         {1, 1000, 700}, {1000, 1, 700}, {2, 300, 70}, {3, 1000, 700}, {4, 65, 33}, {5, 40, 30}})
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb) {
        if (!gemm::gemv_applies(ta, tb, M, N)) {
          CHECK((M == 5 || ta || !tb));
          continue;
        }
        const Tensor a = random::normal(ta ? Shape{K, M} : Shape{M, K}), b = random::normal(tb ? Shape{N, K} : Shape{K, N});
        Tensor got = Tensor::zeros({M, N}), want = Tensor::zeros({M, N});
        cpu::matmul(a, ta, b, tb, got, false);
        Tensor direct = Tensor::zeros({M, N});
        gemm::gemv_product<float>(gemm::active_isa(), ta, tb, M, N, K, a.data<float>(), ta ? M : K, b.data<float>(),
                                  tb ? K : N, direct.data<float>(), false);
        CHECK(std::equal(got.data<float>(), got.data<float>() + M * N, direct.data<float>()));  // the GEMV ran
        gemm::gemm_serial<float>(gemm::active_isa(), ta, tb, M, N, K, a.data<float>(), ta ? M : K, b.data<float>(),
                                 tb ? K : N, want.data<float>(), N, false);
        double worst = 0;
        for (std::int64_t i = 0; i < M * N; ++i)
          worst = std::max(worst, std::abs(static_cast<double>(got.data<float>()[i] - want.data<float>()[i])));
        CHECK_MESSAGE(worst < 2e-6 * std::sqrt(static_cast<double>(K)) * 4, M << "x" << N << "x" << K << " ta=" << ta
                                                                            << " tb=" << tb << ": " << worst);
      }
}

TEST_CASE("a GEMV split over a team gives the one-thread result bit for bit") {
#if defined(_OPENMP)
  const int prev = omp_get_max_threads();
  for (auto [rows, cols, along] : {std::tuple<std::int64_t, std::int64_t, bool>{3000, 400, true}, {400, 3000, false},
                                   {2000, 1000, false}}) {
    const std::vector<float> m = random_values<float>(static_cast<std::size_t>(rows * cols), 7);
    const std::vector<float> x = random_values<float>(static_cast<std::size_t>(along ? cols : rows), 8);
    std::vector<float> y1(static_cast<std::size_t>(along ? rows : cols)), y2(y1.size());
    omp_set_num_threads(1);
    gemm::gemv<float>(gemm::active_isa(), along, rows, cols, m.data(), cols, x.data(), 1, y1.data(), false);
    omp_set_num_threads(2);
    CHECK(gemm::gemv_threads(static_cast<std::int64_t>(y1.size()), rows, cols) == std::min(2, detail::free_threads()));
    gemm::gemv<float>(gemm::active_isa(), along, rows, cols, m.data(), cols, x.data(), 1, y2.data(), false);
    CHECK(y1 == y2);
  }
  // three vectors at once (x @ W^T on 3 tokens)
  const std::vector<float> m = random_values<float>(3000 * 400, 9), x = random_values<float>(3 * 400, 10);
  std::vector<float> y1(3 * 3000), y2(y1.size());
  omp_set_num_threads(1);
  gemm::gemv_dot<float>(gemm::active_isa(), 3, 3000, 400, m.data(), 400, x.data(), 400, y1.data(), 3000, false);
  omp_set_num_threads(2);
  gemm::gemv_dot<float>(gemm::active_isa(), 3, 3000, 400, m.data(), 400, x.data(), 400, y2.data(), 3000, false);
  CHECK(y1 == y2);
  omp_set_num_threads(prev);
#endif
}

TEST_CASE("an epilogue (bias, residual, scale) on each finished tile equals the same math applied after the product") {
#if defined(_OPENMP)
  const int prev = omp_get_max_threads();
  omp_set_num_threads(2);
#endif
  // ragged edges, several K slices (K > KC), K = 0, and both threaded splits (rows; columns)
  for (auto [M, N, K, ta, tb] : {std::tuple<std::int64_t, std::int64_t, std::int64_t, bool, bool>{37, 70, 45, false, true},
                                 {300, 70, 800, false, false}, {20, 3000, 50, true, true}, {13, 9, 0, false, false}})
    for (int acc = 0; acc < 2; ++acc) {
      const std::vector<float> A = random_values<float>(static_cast<std::size_t>(M * K), 11);
      const std::vector<float> B = random_values<float>(static_cast<std::size_t>(K * N), 12);
      const std::vector<float> bias = random_values<float>(static_cast<std::size_t>(N), 13);
      const std::int64_t ldr = N + 5, ldc = N + 2, lda = ta ? M : K, ldb = tb ? K : N;
      const std::vector<float> res = random_values<float>(static_cast<std::size_t>(M * ldr), 14);
      const std::vector<float> c0 = random_values<float>(static_cast<std::size_t>(M * ldc), 15);
      const gemm::BiasResidual<float> epi{bias.data(), res.data(), ldr, 0.5f};
      for (Isa isa : runnable_isas()) {
        std::vector<float> want = c0, fused = c0, team = c0;
        gemm::gemm_serial<float>(isa, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, want.data(), ldc, acc);
        epi(want.data(), ldc, 0, 0, M, N);
        gemm::gemm_serial<float>(isa, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, fused.data(), ldc, acc, epi);
        gemm::gemm_parallel<float>(isa, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, team.data(), ldc, acc, epi);
        CHECK_MESSAGE(fused == want, isa_name(isa) << " " << M << "x" << N << "x" << K << " acc=" << acc);
        CHECK_MESSAGE(team == want, isa_name(isa) << " threaded " << M << "x" << N << "x" << K << " acc=" << acc);
      }
      // and the formula itself, at one element
      if (M > 0 && N > 0 && K > 0) {
        std::vector<float> c = c0;
        gemm::gemm_serial<float>(gemm::active_isa(), ta, tb, M, N, K, A.data(), lda, B.data(), ldb, c.data(), ldc, acc,
                                 epi);
        const std::int64_t i = M - 1, j = N - 1;
        double s = acc ? c0[static_cast<std::size_t>(i * ldc + j)] : 0.0;
        for (std::int64_t k = 0; k < K; ++k)
          s += static_cast<double>(ta ? A[static_cast<std::size_t>(k * lda + i)] : A[static_cast<std::size_t>(i * lda + k)]) *
               (tb ? B[static_cast<std::size_t>(j * ldb + k)] : B[static_cast<std::size_t>(k * ldb + j)]);
        const double want = 0.5 * s + bias[static_cast<std::size_t>(j)] + res[static_cast<std::size_t>(i * ldr + j)];
        CHECK(std::abs(c[static_cast<std::size_t>(i * ldc + j)] - want) < 1e-4);
      }
    }
#if defined(_OPENMP)
  omp_set_num_threads(prev);
#endif
}

TEST_CASE("a batch of small products shared out item by item equals one call per item, bit for bit") {
#if defined(_OPENMP)
  const int prev = omp_get_max_threads();
  omp_set_num_threads(2);
#endif
  // 24 items of 64 x 64 x 64 (attention's per-head block), B shared by all (stride 0) or not
  const std::int64_t batch = 24, M = 64, N = 64, K = 64;
  const std::vector<float> A = random_values<float>(static_cast<std::size_t>(batch * M * K), 16);
  const std::vector<float> B = random_values<float>(static_cast<std::size_t>(batch * K * N), 17);
  for (std::int64_t sb : {std::int64_t(0), K * N})
    for (int tb = 0; tb < 2; ++tb) {
      std::vector<float> c1(static_cast<std::size_t>(batch * M * N)), c2(c1.size());
      for (std::int64_t b = 0; b < batch; ++b)
        gemm::gemm_serial<float>(gemm::active_isa(), false, tb, M, N, K, A.data() + b * M * K, K, B.data() + b * sb,
                                 tb ? K : N, c1.data() + b * M * N, N, false);
      gemm::gemm_batched<float>(gemm::active_isa(), batch, false, tb, M, N, K, A.data(), M * K, K, B.data(), sb,
                                tb ? K : N, c2.data(), M * N, N, false);
      CHECK_MESSAGE(c1 == c2, "B stride " << sb << " tb=" << tb);
    }
#if defined(_OPENMP)
  omp_set_num_threads(prev);
#endif
}

TEST_CASE("matmul on the tape runs nn's engine with the kernel set cpu_info() names") {
  const CpuInfo& info = cpu_info();
  CHECK(info.gemm_id == std::string("nn-") + isa_name(info.isa));
  CHECK(info.gemm.find(isa_name(info.isa)) != std::string::npos);
  CHECK(info.line().find("gemm: nn " + std::string(isa_name(info.isa))) != std::string::npos);
  // NN_CPU_ISA (set by the ops_avx2 / ops_generic CTest runs) lowers the kernel set, never raises it
  const char* env = std::getenv("NN_CPU_ISA");
  if (env && std::string(env) == "generic") CHECK(info.isa == Isa::generic);
  if (!env) CHECK(info.isa == info.features.best_isa());
}

namespace {

/// bf16 bits of n values in [-1, 1).
std::vector<std::uint16_t> random_bf16(std::size_t n, unsigned seed) {
  std::vector<std::uint16_t> out;
  for (float v : random_values<float>(n, seed)) out.push_back(half::f32_to_bf16(v));
  return out;
}

}  // namespace

TEST_CASE("bf16 products: the emulation is the f32 product of the rounded operands, bit for bit; vdpbf16ps and AMX "
          "within f32 accumulation error; threaded = serial; B stored in bf16 or rounded from f32") {
  using S3 = std::tuple<std::int64_t, std::int64_t, std::int64_t>;
  using gemm::Bf16Kernel;
  // odd K (a half pair at the end), K past KC (several slices, the later ones starting on an
  // even depth), K past AMX's 512-depth slice, ragged M and N (edge tiles), a short wide product
  // (column split when threaded)
  const std::vector<S3> shapes = {{1, 1, 1},    {13, 37, 5},   {25, 65, 801}, {100, 33, 400},
                                  {7, 530, 64}, {300, 70, 576}, {64, 96, 1100}};
  std::vector<Bf16Kernel> hw;
  for (Bf16Kernel k : {Bf16Kernel::avx512_bf16, Bf16Kernel::amx})
    if (gemm::bf16_kernel_available(k)) hw.push_back(k);
    else MESSAGE("this CPU (or NN_CPU_ISA) cannot run " << std::string(gemm::bf16_kernel_name(k)) << ": not checked here");
  MESSAGE("bf16 products in this process: " << std::string(gemm::bf16_kernel_name(gemm::bf16_kernel())));
  for (auto [M, N, K] : shapes)
    for (int ta = 0; ta < 2; ++ta)
      for (int tb = 0; tb < 2; ++tb)
        for (int acc = 0; acc < 2; ++acc) {
          const std::int64_t lda = ta ? M : K, ldb = tb ? K : N, ldc = N + 2;
          const std::vector<float> A = random_values<float>(static_cast<std::size_t>(M * K), 11);
          const std::vector<std::uint16_t> B = random_bf16(static_cast<std::size_t>(K * N), 12);
          const std::vector<float> C0 = random_values<float>(static_cast<std::size_t>(M * ldc), 13);
          // the reference operands: A rounded to bf16, B widened, both f32
          std::vector<float> Ar(A.size()), Bw(B.size()), Bf(B.size());
          for (std::size_t i = 0; i < A.size(); ++i) Ar[i] = half::bf16_round(A[i]);
          for (std::size_t i = 0; i < B.size(); ++i) Bw[i] = half::bf16_to_f32(B[i]);
          // B as float32 (autocast) that rounds back to exactly Bw: off by 2^-12 relative, under
          // half a bf16 ulp (2^-9), so the reference below serves both
          for (std::size_t i = 0; i < B.size(); ++i) Bf[i] = Bw[i] * (1.0f + 0x1p-12f);
          for (Isa isa : runnable_isas()) {
            std::vector<float> ref = C0, emu = C0, emu_team = C0;
            gemm::gemm_serial<float>(isa, ta, tb, M, N, K, Ar.data(), lda, Bw.data(), ldb, ref.data(), ldc, acc);
            gemm::gemm_bf16(isa, Bf16Kernel::emulated, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, emu.data(), ldc,
                            acc, false);
            gemm::gemm_bf16(isa, Bf16Kernel::emulated, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, emu_team.data(),
                            ldc, acc, true);
            std::vector<float> emu_f32b = C0;
            gemm::gemm_bf16(isa, Bf16Kernel::emulated, ta, tb, M, N, K, A.data(), lda, Bf.data(), ldb, emu_f32b.data(),
                            ldc, acc, true);
            const bool same = std::memcmp(ref.data(), emu.data(), sizeof(float) * ref.size()) == 0 &&
                              std::memcmp(ref.data(), emu_team.data(), sizeof(float) * ref.size()) == 0 &&
                              std::memcmp(ref.data(), emu_f32b.data(), sizeof(float) * ref.size()) == 0;
            if (!same) MESSAGE(isa_name(isa) << " " << M << "x" << N << "x" << K << " ta " << ta << " tb " << tb);
            CHECK(same);
          }
          for (Bf16Kernel kern : hw) {
            const std::string kname = gemm::bf16_kernel_name(kern);
            CAPTURE(kname);
            std::vector<float> out = C0, team = C0, f32b = C0;
            gemm::gemm_bf16(Isa::avx512, kern, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, out.data(), ldc, acc, false);
            gemm::gemm_bf16(Isa::avx512, kern, ta, tb, M, N, K, A.data(), lda, B.data(), ldb, team.data(), ldc, acc, true);
            gemm::gemm_bf16(Isa::avx512, kern, ta, tb, M, N, K, A.data(), lda, Bf.data(), ldb, f32b.data(), ldc, acc, true);
            CHECK(std::memcmp(out.data(), team.data(), sizeof(float) * out.size()) == 0);
            CHECK(std::memcmp(out.data(), f32b.data(), sizeof(float) * out.size()) == 0);  // B rounded while packed
            // |C - exact| <= (K + 2) u sum_k |a_k b_k| (+ |C0|): the f32 summation bound, u = 2^-24
            // (products of two bf16 are exact in f32)
            double worst = 0;
            for (std::int64_t i = 0; i < M; ++i)
              for (std::int64_t j = 0; j < N; ++j) {
                long double s = acc ? C0[i * ldc + j] : 0.0L, mag = acc ? std::abs(C0[i * ldc + j]) : 0.0L;
                for (std::int64_t k = 0; k < K; ++k) {
                  const long double p = static_cast<long double>(ta ? Ar[k * lda + i] : Ar[i * lda + k]) *
                                        (tb ? Bw[j * ldb + k] : Bw[k * ldb + j]);
                  s += p;
                  mag += std::abs(p);
                }
                const double bound = static_cast<double>((K + 2) * std::ldexp(1.0L, -24) * mag) + 1e-30;
                worst = std::max(worst, static_cast<double>(std::abs(out[i * ldc + j] - s)) / bound);
              }
            if (worst > 1)
              MESSAGE(kname << " " << M << "x" << N << "x" << K << " ta " << ta << " tb " << tb
                                                   << ": " << worst);
            CHECK(worst <= 1);
            for (std::int64_t i = 0; i < M; ++i)  // the padding past N is never written
              for (std::int64_t j = N; j < ldc; ++j) CHECK(out[i * ldc + j] == C0[i * ldc + j]);
          }
        }
}

}  // namespace backend_gemm
