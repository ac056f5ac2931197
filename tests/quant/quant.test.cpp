// SPDX-License-Identifier: MIT OR Apache-2.0
// Quantized matrices against MLX 0.32.4 (tests/fixtures/quant/mlx.json, written by
// tests/oracle/gen_quant_mlx.py): nn::quantize's codes, scales and biases and nn::dequantize's
// values bit for bit, quantized_matmul against mx.quantized_matmul, and in float64 against
// dequantize-then-matmul; its gradient; the refusals.
#include <array>
#include <cstring>

#include "support/check.hpp"

namespace quant_quant {  // one unity source with the other quant files: its names stay its own

using namespace nn;
using nn::test::check_error;
using nn::test::rel_err;

namespace {

Tensor from_hex(const nlohmann::json& j) { return nn::test::tensor_from_hex(j); }

/// Index of the first differing byte, or -1.
std::int64_t first_diff(const Tensor& a, const Tensor& b) {
  if (a.nbytes() != b.nbytes()) return 0;
  const auto *p = static_cast<const unsigned char*>(a.raw()), *q = static_cast<const unsigned char*>(b.raw());
  for (std::size_t i = 0; i < a.nbytes(); ++i)
    if (p[i] != q[i]) return static_cast<std::int64_t>(i);
  return -1;
}

#define CHECK_SAME_BYTES(a, b, what)                                                                        \
  do {                                                                                                      \
    const Tensor& ta_ = (a);                                                                                \
    const Tensor& tb_ = (b);                                                                                \
    CHECK_MESSAGE(ta_.shape() == tb_.shape(), name << " " << what << ": " << ta_.shape().str() << " vs "     \
                                                   << tb_.shape().str());                                   \
    CHECK_MESSAGE(ta_.dtype() == tb_.dtype(), name << " " << what << " dtype");                             \
    const std::int64_t d_ = first_diff(ta_, tb_);                                                           \
    CHECK_MESSAGE(d_ < 0, name << " " << what << ": first differing byte " << d_ << " (element "            \
                               << d_ / static_cast<std::int64_t>(dtype_size(ta_.dtype())) << ")");          \
  } while (0)

Quant quant_of(const nlohmann::json& c) {
  const std::string mode = c.at("mode").get<std::string>();
  const QuantMode m = mode == "mxfp4"   ? QuantMode::mxfp4
                      : mode == "mxfp8" ? QuantMode::mxfp8
                      : mode == "nvfp4" ? QuantMode::nvfp4
                                        : QuantMode::affine;
  return Quant{m, c.at("group_size").get<int>(), c.at("bits").get<int>()};
}

}  // namespace

TEST_CASE("quantize and dequantize equal MLX's bit for bit (affine 2-8 bits, groups 32/64/128, mxfp4, mxfp8, nvfp4)") {
  const auto fx = nn::test::fixture("quant/mlx.json");
  REQUIRE(fx.at("mlx_version").get<std::string>() == "0.32.4");
  int checked = 0;
  for (const auto& c : fx.at("quantize")) {
    const std::string name = c.at("name").get<std::string>();
    const Quant q = quant_of(c);
    const Tensor w = from_hex(c.at("w"));
    const QuantizedMatrix m = quantize(w, q);
    CHECK_SAME_BYTES(m.weight, from_hex(c.at("wq")), "codes");
    CHECK_SAME_BYTES(m.scales, from_hex(c.at("scales")), "scales");
    if (q.mode == QuantMode::affine) CHECK_SAME_BYTES(m.biases, from_hex(c.at("biases")), "biases");
    else CHECK(c.at("biases").is_null());
    // dequantize from MLX's own tensors (independent of quantize above); MLX's fp modes give bf16
    const Tensor expect = from_hex(c.at("dequantized"));
    const Tensor mb = c.at("biases").is_null() ? Tensor() : from_hex(c.at("biases"));
    const Tensor d = dequantize(from_hex(c.at("wq")), from_hex(c.at("scales")), mb, q, expect.dtype());
    CHECK_SAME_BYTES(d, expect, "dequantized");
    ++checked;
  }
  CHECK(checked == 88);  // 54 random + 16 adversarial affine, 6 each of mxfp4, mxfp8 and nvfp4
}

TEST_CASE("quantized_matmul equals mx.quantized_matmul (float32; affine, mxfp4, mxfp8, nvfp4; x @ W^T and x @ W; one row, five, batched)") {
  const auto fx = nn::test::fixture("quant/mlx.json");
  int checked = 0;
  for (const auto& c : fx.at("quantized_matmul")) {
    const std::string name = c.at("name").get<std::string>();
    const Quant q = quant_of(c);
    const Tensor x = from_hex(c.at("x")), wq = from_hex(c.at("wq")), s = from_hex(c.at("scales"));
    const Tensor expect = from_hex(c.at("out"));
    GTape<cpu> tp;
    std::optional<GVar> b;
    if (!c.at("biases").is_null()) b = tp.constant(from_hex(c.at("biases")));
    GVar y = quantized_matmul(tp, tp.input(x), tp.constant(wq), tp.constant(s), b, q, c.at("transpose").get<bool>());
    CHECK_MESSAGE(rel_err(tp.value(y), expect) < 1e-6, name << ": " << rel_err(tp.value(y), expect));
    ++checked;
  }
  CHECK(checked == 40);  // 8 formats x (t, nt, t3d, and one-row t1, nt1)
}

namespace {

/// A float64 (rows, cols) matrix quantized in format q with float64 scales, its dequantized
/// float64 values, and an x of (2, 3, K) for it.
struct Sample {
  QuantizedMatrix m;
  Tensor w;  // dequantized, float64
};
Sample sample(std::int64_t rows, std::int64_t cols, Quant q, std::uint64_t seed) {
  const Tensor raw = nn::test::random_tensor(Shape{rows, cols}, q.mode == QuantMode::affine ? DType::f64 : DType::f32,
                                             seed, -2, 2);
  Sample s{quantize(raw, q), {}};
  s.w = dequantize(s.m, DType::f64);
  return s;
}

}  // namespace

TEST_CASE("quantized_matmul in float64 equals dequantize-then-matmul, values and x's gradient") {
  for (const Quant q : {Quant::affine(32, 2), Quant::affine(64, 3), Quant::affine(), Quant::affine(128, 5),
                        Quant::affine(32, 6), Quant::affine(64, 8), Quant::mxfp4(), Quant::mxfp8(), Quant::nvfp4()}) {
    for (const bool transpose : {true, false}) {
      CAPTURE(quant_mode_name(q.mode));
      CAPTURE(q.bits);
      CAPTURE(transpose);
      // W (rows, cols): x @ W^T needs K = cols; x @ W needs K = rows. Shapes past one GEMM block
      // (K 768 > KC, N 600 > NB), with ragged edges, so the packer's panels and edges all run.
      const std::int64_t rows = transpose ? 600 : 384, cols = transpose ? 768 : 256;
      const Sample s = sample(rows, cols, q, 7 + static_cast<std::uint64_t>(q.bits));
      const std::int64_t K = transpose ? cols : rows;
      const Tensor x = nn::test::random_tensor(Shape{2, 13, K}, DType::f64, 3);
      const Tensor g = nn::test::random_tensor(Shape{2, 13, transpose ? rows : cols}, DType::f64, 4);
      GTape<cpu> tp;
      GVar xv = tp.param(x);
      std::optional<GVar> b;
      if (s.m.biases.defined()) b = tp.constant(s.m.biases);
      GVar y = quantized_matmul(tp, xv, tp.constant(s.m.weight), tp.constant(s.m.scales), b, q, transpose);
      GVar yr = matmul(tp, xv, tp.constant(s.w), false, transpose);
      CHECK(rel_err(tp.value(y), tp.value(yr)) < 1e-13);
      tp.backward(sum(tp, mul(tp, y, tp.constant(g))));
      const Tensor gq = tp.grad(xv).clone();
      GTape<cpu> tr;
      GVar xr = tr.param(x);
      tr.backward(sum(tr, mul(tr, matmul(tr, xr, tr.constant(s.w), false, transpose), tr.constant(g))));
      CHECK(rel_err(gq, tr.grad(xr)) < 1e-13);
    }
  }
}

TEST_CASE("quantized_matmul: one row (decode), float32 against float64, bf16 scales beside f32 x") {
  const Sample s = sample(96, 128, Quant::affine(64, 4), 11);
  const Tensor x = nn::test::random_tensor(Shape{1, 128}, DType::f64, 5);
  auto run = [&](const Tensor& xs, const QuantizedMatrix& m) {
    GTape<cpu> tp;
    GVar y = quantized_matmul(tp, tp.input(xs), tp.constant(m.weight), tp.constant(m.scales),
                              std::optional<GVar>(tp.constant(m.biases)), m.q);
    return tp.value(y).clone();
  };
  const Tensor y64 = run(x, s.m);
  QuantizedMatrix m32 = s.m;
  m32.scales = s.m.scales.to(DType::f32);
  m32.biases = s.m.biases.to(DType::f32);
  CHECK(rel_err(run(x.to(DType::f32), m32), y64) < 1e-6);
  QuantizedMatrix mb = s.m;
  mb.scales = s.m.scales.to(DType::bf16);
  mb.biases = s.m.biases.to(DType::bf16);
  GTape<cpu> tp;  // the reference: bf16 scales widened, dequantized in float64
  GVar yr = matmul(tp, tp.input(x), tp.constant(dequantize(mb.weight, mb.scales.to(DType::f64), mb.biases.to(DType::f64),
                                                           mb.q)),
                   false, true);
  CHECK(rel_err(run(x.to(DType::f32), mb), tp.value(yr)) < 1e-6);
}

TEST_CASE("the vector decoder equals the scalar one and MLX's dequantize, bit for bit (float32)") {
  // QuantReader::run decodes 8 codes at a time into a contiguous float32 run (AVX2) and one at a
  // time otherwise (a strided run takes the scalar loop): both must give dequantize()'s values,
  // which are MLX's. Runs start and end off group and 8-code boundaries.
  for (const Quant q : {Quant::affine(64, 4), Quant::affine(32, 8), Quant::affine(128, 4), Quant::mxfp4(),
                        Quant::affine(64, 3), Quant::mxfp8(), Quant::nvfp4(), Quant::affine(32, 2), Quant::affine(32, 5),
                        Quant::affine(64, 6), Quant::affine(16, 6), Quant::affine(16, 3), Quant::affine(128, 5)}) {
    const std::string name = std::string(quant_mode_name(q.mode)) + " " + std::to_string(q.group) + "/" + std::to_string(q.bits);
    CAPTURE(name);
    const Tensor raw = nn::test::random_tensor(Shape{5, 256}, DType::f32, 21, -3, 3);
    const QuantizedMatrix m = quantize(raw, q);
    const Tensor want = dequantize(m);
    const detail::QuantReader<float> rd(m.weight, m.scales, m.biases, q);
    for (const auto& [c0, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 256}, {3, 250}, {8, 61}, {64, 64}, {40, 9}}) {
      for (std::int64_t r = 0; r < 5; ++r) {
        std::vector<float> fast(static_cast<std::size_t>(n)), slow(static_cast<std::size_t>(2 * n));
        rd.run(r, c0, n, fast.data(), 1);
        rd.run(r, c0, n, slow.data(), 2);
        const float* w = want.data<float>() + r * 256 + c0;
        int diffs = 0;
        for (std::int64_t i = 0; i < n; ++i) {
          diffs += std::memcmp(&fast[static_cast<std::size_t>(i)], w + i, 4) != 0;
          diffs += std::memcmp(&slow[static_cast<std::size_t>(2 * i)], w + i, 4) != 0;
        }
        CHECK_MESSAGE(diffs == 0, "row " << r << " from " << c0 << " for " << n);
      }
    }
  }
}

TEST_CASE("the float32 reader with bfloat16, float16 and float64 scales: the vector runs equal the scalar loop") {
  // dequantize() rounds to the scales' dtype, QuantReader<float> computes in float32: here the
  // contiguous runs (decoded 16 or 8 codes a vector, the scales' type fixed at compile time) are
  // held to the strided runs (one value at a time) of the same reader, bit for bit.
  for (const DType dt : {DType::bf16, DType::f16, DType::f64}) {
    for (const Quant q : {Quant::affine(32, 4), Quant::affine(64, 8), Quant::affine(16, 6), Quant::affine(32, 5),
                          Quant::affine(128, 3), Quant::affine(64, 2)}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(q.group);
      CAPTURE(q.bits);
      const QuantizedMatrix m = quantize(nn::test::random_tensor(Shape{3, 384}, DType::f32, 9, -2, 2).to(dt), q);
      REQUIRE(m.scales.dtype() == dt);
      const detail::QuantReader<float> rd(m.weight, m.scales, m.biases, q);
      for (const auto& [c0, n] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 384}, {5, 370}, {16, 47}, {96, 33}}) {
        for (std::int64_t r = 0; r < 3; ++r) {
          std::vector<float> fast(static_cast<std::size_t>(n)), slow(static_cast<std::size_t>(2 * n));
          rd.run(r, c0, n, fast.data(), 1);
          rd.run(r, c0, n, slow.data(), 2);
          int diffs = 0;
          for (std::int64_t i = 0; i < n; ++i)
            diffs += std::memcmp(&fast[static_cast<std::size_t>(i)], &slow[static_cast<std::size_t>(2 * i)], 4) != 0;
          CHECK_MESSAGE(diffs == 0, "row " << r << " from " << c0 << " for " << n);
        }
      }
    }
  }
}

#if defined(NN_OWN_GEMM)
TEST_CASE("the quantized B packers (W^T and W) equal the scalar decoder panel for panel, bit for bit") {
  // A panel of op(B) = W^T (x @ W^T, W quantized) is decoded 16 lines x 16 depths into zmm
  // registers and transposed there on AVX-512, 8 x 8 in ymm on AVX2, and through a decoded run
  // per line otherwise: each must hold, at depth k and column c, the scalar decoder's W[j0 + c]
  // [k0 + k] (which is dequantize()'s, above), and 0 past the last line. The AVX2 form is called
  // directly on every AVX2 CPU as well as through the dispatching QuantPackB; 37 lines leave a
  // panel of 5; k0 = 64 starts inside the matrix; kc = 24 is no multiple of 16. Then x @ W's.
  constexpr int NR = 16;
  for (const DType dt : {DType::f32, DType::bf16, DType::f16}) {
    for (const Quant q : {Quant::affine(32, 4), Quant::affine(64, 8), Quant::affine(16, 6), Quant::affine(32, 5),
                          Quant::affine(64, 3), Quant::affine(32, 2), Quant::affine(16, 4)}) {
      CAPTURE(dtype_name(dt));
      CAPTURE(q.group);
      CAPTURE(q.bits);
      const std::int64_t rows = 37, cols = 192;
      const QuantizedMatrix m = quantize(nn::test::random_tensor(Shape{rows, cols}, DType::f32, 13, -2, 2).to(dt), q);
      const detail::QuantReader<float> rd(m.weight, m.scales, m.biases, q);
      for (const auto& [k0, kc] : std::vector<std::pair<std::int64_t, std::int64_t>>{{0, 192}, {64, 128}, {32, 24}}) {
        CAPTURE(k0);
        CAPTURE(kc);
        const std::int64_t panels = (rows + NR - 1) / NR;
        std::vector<float> want(static_cast<std::size_t>(panels * NR * kc), 0.0f), line(static_cast<std::size_t>(2 * kc));
        for (std::int64_t j = 0; j < rows; ++j) {
          rd.run(j, k0, kc, line.data(), 2);  // a strided run: the scalar loop
          for (std::int64_t k = 0; k < kc; ++k)
            want[static_cast<std::size_t>((j / NR) * NR * kc + k * NR + j % NR)] = line[static_cast<std::size_t>(2 * k)];
        }
        const auto same = [&](const std::vector<float>& got) {
          return std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0;
        };
        std::vector<float> got(want.size(), -7.0f);
        gemm::QuantPackB<NR, float>{&rd, true}(got.data(), 0, rows, k0, kc);
        CHECK_MESSAGE(same(got), "QuantPackB");
#if defined(NN_QUANT_AVX2)
        if (detail::detect_cpu_features().best_isa() >= Isa::avx2) {
          std::fill(got.begin(), got.end(), -7.0f);
          detail::with_code_bits(q.bits, [&]<int BITS>() {
            detail::with_scale_dtype(m.scales.dtype(), [&]<DType SDT>() {
              for (std::int64_t p = 0; p < panels; ++p)
                gemm::affine_pack_transposed_avx2<NR, BITS, SDT>(rd, p * NR, std::min<std::int64_t>(NR, rows - p * NR), k0,
                                                                 kc, got.data() + p * NR * kc);
            });
          });
          CHECK_MESSAGE(same(got), "affine_pack_transposed_avx2");
        }
#endif
      }
      // x @ W: depth k of each panel is a run of row k0 + k over columns j0 .. j0 + nc (AVX2: decoded
      // 8 codes at a time into the panels, a part of 8 one at a time; j0 = 4 takes the run buffer)
      for (const auto& [k0, kc, j0, nc] : std::vector<std::array<std::int64_t, 4>>{
               {0, 37, 0, 192}, {5, 30, 64, 101}, {36, 1, 8, 40}, {2, 9, 4, 77}}) {
        CAPTURE(k0);
        CAPTURE(kc);
        CAPTURE(j0);
        CAPTURE(nc);
        const std::int64_t panels = (nc + NR - 1) / NR;
        std::vector<float> want(static_cast<std::size_t>(panels * NR * kc), 0.0f), line(static_cast<std::size_t>(2 * nc));
        for (std::int64_t k = 0; k < kc; ++k) {
          rd.run(k0 + k, j0, nc, line.data(), 2);
          for (std::int64_t c = 0; c < nc; ++c)
            want[static_cast<std::size_t>((c / NR) * NR * kc + k * NR + c % NR)] = line[static_cast<std::size_t>(2 * c)];
        }
        std::vector<float> got(want.size(), -7.0f);
        gemm::QuantPackB<NR, float>{&rd, false}(got.data(), j0, nc, k0, kc);
        CHECK_MESSAGE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0, "QuantPackB, x @ W");
#if defined(NN_QUANT_AVX2)
        if (j0 % 8 == 0 && detail::detect_cpu_features().best_isa() >= Isa::avx2) {
          std::fill(got.begin(), got.end(), -7.0f);
          detail::with_code_bits(q.bits, [&]<int BITS>() {
            detail::with_scale_dtype(m.scales.dtype(), [&]<DType SDT>() {
              gemm::affine_pack_rows_avx2<NR, BITS, SDT>(rd, j0, nc, k0, kc, got.data());
            });
          });
          CHECK_MESSAGE(std::memcmp(got.data(), want.data(), want.size() * sizeof(float)) == 0, "affine_pack_rows_avx2");
        }
#endif
      }
    }
  }
}
#endif

TEST_CASE("quantized_matmul on few rows (streamed W) and many (packed W) equals float64 dequantize-then-matmul") {
  // The 1-8 row products stream W (a dot per output for x @ W^T, an axpy per depth for x @ W);
  // more rows pack it for the GEMM. Both against the float64 product of the dequantized matrix.
  // 1-8 rows of x @ W^T take the factored dot (AVX-512: J columns at a time, 4-bit codes in
  // even/odd order, 5-8 rows in two passes; AVX2: 1-4 rows); 203 columns leave ragged J tails,
  // and 4-bit groups of 16 are not whole steps of the AVX-512 kernel (the AVX2 one serves them).
  for (const Quant q : {Quant::affine(64, 4), Quant::affine(32, 8), Quant::mxfp4(), Quant::affine(32, 2), Quant::mxfp8(),
                        Quant::nvfp4(), Quant::affine(32, 5), Quant::affine(16, 6), Quant::affine(64, 3),
                        Quant::affine(32, 4), Quant::affine(16, 4)}) {
    for (const bool transpose : {true, false}) {
      for (const std::int64_t M : {1, 2, 3, 4, 5, 6, 7, 8, 9, 40}) {
        CAPTURE(quant_mode_name(q.mode));
        CAPTURE(q.bits);
        CAPTURE(transpose);
        CAPTURE(M);
        const std::int64_t rows = 203, cols = 448;  // N ragged against the 32-column splits and J
        const Tensor raw = nn::test::random_tensor(Shape{rows, cols}, DType::f32, 5 + static_cast<std::uint64_t>(M), -2, 2);
        const QuantizedMatrix m = quantize(raw, q);
        const Tensor w64 = dequantize(m).to(DType::f64);
        const std::int64_t K = transpose ? cols : rows;
        const Tensor x = nn::test::random_tensor(Shape{M, K}, DType::f32, 8);
        GTape<cpu> tp;
        std::optional<GVar> b;
        if (m.biases.defined()) b = tp.constant(m.biases);
        GVar y = quantized_matmul(tp, tp.input(x), tp.constant(m.weight), tp.constant(m.scales), b, q, transpose);
        GTape<cpu> tr;
        GVar yr = matmul(tr, tr.input(x.to(DType::f64)), tr.constant(w64), false, transpose);
        CHECK(rel_err(tp.value(y), tr.value(yr)) < 2e-6);
      }
    }
  }
}

TEST_CASE("quantized_matmul x @ W on few rows: depths past one chunk, accumulation, ragged column ranges") {
  // The factored x @ W (AVX-512, affine, groups of 16 codes or more: y held in registers over the
  // depths) takes depths in chunks that stay in L2: 5000 depths of 64 columns are two chunks. acc
  // adds to y (the backward's accumulation); a column range that starts and ends off a 16-column
  // vector (a thread's share) takes the buffered loop at its ends. Scales and biases stored as
  // bfloat16 or float16 (a GGUF's) are widened per depth before the chunk's columns.
  for (const Quant q : {Quant::affine(64, 4), Quant::affine(32, 8), Quant::affine(16, 4), Quant::affine(128, 3)}) {
    for (const std::int64_t M : {1, 2, 3, 5, 8}) {
      for (const DType sdt : {DType::f32, DType::bf16, DType::f16}) {
        CAPTURE(q.group);
        CAPTURE(q.bits);
        CAPTURE(M);
        CAPTURE(std::string(dtype_name(sdt)));
        const std::int64_t K = 5000, N = q.group * 2;
        QuantizedMatrix m = quantize(nn::test::random_tensor(Shape{K, N}, DType::f32, 31, -2, 2), q);
        m.scales = m.scales.to(sdt), m.biases = m.biases.to(sdt);
        QuantizedMatrix wide = m;  // the same scales widened (exactly): dequantize() answers in their dtype
        wide.scales = m.scales.to(DType::f32), wide.biases = m.biases.to(DType::f32);
        const Tensor w64 = dequantize(wide).to(DType::f64);
        const Tensor x = nn::test::random_tensor(Shape{M, K}, DType::f32, 32);
        const Tensor y0 = nn::test::random_tensor(Shape{M, N}, DType::f32, 33);
        Tensor y = y0.clone();
        cpu::quantized_matmul(x, m.weight, m.scales, m.biases, QuantMatmulAttrs{q, false}, y, true);
        GTape<cpu> tr;
        GVar want = add(tr, tr.constant(y0.to(DType::f64)), matmul(tr, tr.constant(x.to(DType::f64)), tr.constant(w64)));
        const Tensor& w = tr.value(want);
        CHECK(rel_err(y, w) < 1e-5);  // float32 sums of 5000 products
        // columns [5, N - 3) alone, as a thread's share: the ends by the buffered loop
        const detail::QuantReader<float> rd(m.weight, m.scales, m.biases, q);
        Tensor part = y0.clone();
        REQUIRE(detail::quantized_rows(rd, x.data<float>(), part.data<float>(), M, N, K, 5, N - 3, false, true));
        double scale = 0;  // rel_err's denominator: the largest |y|
        for (std::int64_t i = 0; i < M * N; ++i) scale = std::max(scale, std::abs(w.item(i)));
        for (std::int64_t i = 0; i < M; ++i)
          for (std::int64_t j = 0; j < N; ++j) {
            const double got = part.item(i * N + j), exact = w.item(i * N + j), before = y0.item(i * N + j);
            if (j < 5 || j >= N - 3) CHECK(got == before);
            else CHECK(std::abs(got - exact) <= 1e-5 * scale);
          }
      }
    }
  }
}

TEST_CASE("set_int8_activations: x @ W^T on 1-8 rows with x as int8 per 32 values (llama.cpp's Q8_0 rule)") {
  // The opt-in integer path (AVX512-VNNI) against its definition in float64: each 32-block of x
  // rounded by d = max|x| / 127, q = nearbyint(x * (127 / max|x|)); each output
  // sum_g s_g sum_{k in g} d_k xq_k code_k + b_g sum_{k in g} x_k. Depths chosen so that the
  // last 64-byte chunk of codes is partial; a block of zeros and an outlier in x; 203 columns
  // leave J tails; 5-8 rows run as two passes. Formats it does not serve (and CPUs without VNNI)
  // must give the float32 path's bits unchanged.
  struct Off {
    ~Off() { set_int8_activations(false); }
  } off;
  const bool vnni = detail::quant_vnni();
  if (!vnni) MESSAGE("no AVX512-VNNI (or NN_CPU_ISA below avx512): only the unchanged float32 path is checked");
  for (const Quant q : {Quant::affine(64, 4), Quant::affine(32, 4), Quant::affine(128, 4), Quant::affine(32, 8),
                        Quant::affine(64, 8), Quant::affine(16, 4), Quant::affine(32, 5), Quant::mxfp4()}) {
    const bool serves = vnni && q.mode == QuantMode::affine && (q.bits == 4 || q.bits == 8) && q.group >= 32;
    const std::int64_t K = q.group == 128 ? 640 : q.group == 64 ? 704 : 736, N = 203;
    const QuantizedMatrix m = quantize(nn::test::random_tensor(Shape{N, K}, DType::f32, 41, -2, 2), q);
    for (const std::int64_t M : {1, 2, 3, 4, 5, 8}) {
      CAPTURE(quant_mode_name(q.mode));
      CAPTURE(q.group);
      CAPTURE(q.bits);
      CAPTURE(M);
      Tensor x = nn::test::random_tensor(Shape{M, K}, DType::f32, 42 + static_cast<std::uint64_t>(M), -1, 1);
      float* xp = x.data<float>();
      std::fill_n(xp + 64, 32, 0.0f);  // a block of zeros: d = 0
      xp[M * K - 5] = 40.0f;           // an outlier: its block's other values round to few levels
      const Tensor y0 = nn::test::random_tensor(Shape{M, N}, DType::f32, 43);
      const auto product = [&](bool int8, bool acc) {
        set_int8_activations(int8);
        Tensor y = y0.clone();
        cpu::quantized_matmul(x, m.weight, m.scales, m.biases, QuantMatmulAttrs{q, true}, y, acc);
        set_int8_activations(false);
        return y;
      };
      const Tensor yf = product(false, false), yi = product(true, false), yia = product(true, true);
      if (!serves) {
        CHECK(first_diff(yi, yf) < 0);
        continue;
      }
      // The definition, in float64 (x's rounding in float32, as specified).
      const auto* codes = static_cast<const std::uint8_t*>(m.weight.raw());
      const std::int64_t row_bytes = m.weight.dim(1) * 4;
      bool differs = false;
      for (std::int64_t i = 0; i < M; ++i) {
        std::vector<double> xq(static_cast<std::size_t>(K)), d(static_cast<std::size_t>(K));
        for (std::int64_t b = 0; b < K / 32; ++b) {
          float amax = 0.0f;
          for (std::int64_t k = 32 * b; k < 32 * b + 32; ++k) amax = std::max(amax, std::fabs(xp[i * K + k]));
          const float id = amax > 0.0f ? 127.0f / amax : 0.0f;
          for (std::int64_t k = 32 * b; k < 32 * b + 32; ++k) {
            xq[static_cast<std::size_t>(k)] = std::nearbyint(xp[i * K + k] * id);
            d[static_cast<std::size_t>(k)] = amax / 127.0f;
          }
        }
        for (std::int64_t j = 0; j < N; ++j) {
          double want = 0, size = 0;
          for (std::int64_t g = 0; g < K / q.group; ++g) {
            const double s = m.scales.item(j * (K / q.group) + g), bias = m.biases.item(j * (K / q.group) + g);
            for (std::int64_t k = g * q.group; k < (g + 1) * q.group; ++k) {
              const std::uint8_t byte = codes[j * row_bytes + k * q.bits / 8];
              const double code = q.bits == 8 ? byte : (k % 2 ? byte >> 4 : byte & 15);
              const double t = s * d[static_cast<std::size_t>(k)] * xq[static_cast<std::size_t>(k)] * code + bias * xp[i * K + k];
              want += t, size += std::abs(t);
            }
          }
          const double got = yi.item(i * N + j), got_acc = yia.item(i * N + j) - y0.item(i * N + j);
          CHECK(std::abs(got - want) <= 1e-5 * size);
          CHECK(std::abs(got_acc - want) <= 1e-5 * size + 1e-6 * std::abs(y0.item(i * N + j)));
          // beside the float32 path: x's 8 bits move the result, boundedly
          CHECK(std::abs(got - yf.item(i * N + j)) <= 2e-2 * size);
          differs = differs || got != yf.item(i * N + j);
        }
      }
      CHECK(differs);  // the integer path ran
    }
  }
}

TEST_CASE("quantized_gather returns the dequantized rows; bad ids and bad matrices are refused") {
  const Sample s = sample(10, 64, Quant::affine(32, 4), 21);
  GTape<cpu> tp;
  const Tensor ids = Tensor::from<std::int64_t>(Shape{2, 2}, {3, 0, 9, 3});
  GVar y = quantized_gather(tp, tp.input(ids), tp.constant(s.m.weight), tp.constant(s.m.scales),
                            std::optional<GVar>(tp.constant(s.m.biases)), s.m.q, DType::f64);
  REQUIRE(tp.shape(y) == Shape{2, 2, 64});
  const std::int64_t rows[] = {3, 0, 9, 3};
  for (int i = 0; i < 4; ++i)
    for (int j = 0; j < 64; ++j) CHECK(tp.value(y).item(i * 64 + j) == s.w.item(rows[i] * 64 + j));
  check_error(
      [&] {
        GTape<cpu> t2;
        quantized_gather(t2, t2.input(Tensor::from<std::int64_t>(Shape{1}, {10})), t2.constant(s.m.weight),
                         t2.constant(s.m.scales), std::optional<GVar>(t2.constant(s.m.biases)), s.m.q);
      },
      {"quantized_gather", "id 10", "10 rows"});
}

TEST_CASE("quantized weights never get a gradient; shapes and formats are checked") {
  const Sample s = sample(8, 64, Quant::affine(32, 4), 1);
  GTape<cpu> tp;
  const Tensor xt = nn::test::random_tensor(Shape{2, 64}, DType::f64, 2);
  GVar x = tp.param(xt);
  GVar w = tp.constant(s.m.weight), b = tp.constant(s.m.biases);
  check_error([&] { quantized_matmul(tp, x, w, tp.param(s.m.scales), b, s.m.q); },
              {"quantized_matmul", "scales", "cannot have a gradient"});
  check_error([&] { quantized_matmul(tp, x, w, tp.constant(s.m.scales), b, Quant::affine(32, 8)); },
              {"quantized_matmul", "scales must be (8, 1)", "8 bits"});
  check_error([&] { quantized_matmul(tp, x, w, tp.constant(s.m.scales), b, Quant::affine(48, 4)); },
              {"quantized_matmul", "group sizes 32, 64 and 128", "48"});
  check_error([&] { quantized_matmul(tp, x, w, tp.constant(s.m.scales), std::nullopt, s.m.q); },
              {"quantized_matmul", "affine biases"});
  check_error([&] { quantized_matmul(tp, x, w, tp.constant(s.m.scales), b, s.m.q, false); },
              {"quantized_matmul", "inner dimensions differ", "(2, 64)"});
  check_error([&] { quantize(nn::test::random_tensor(Shape{4, 40}, DType::f32, 1), Quant::affine(32, 4)); },
              {"quantize", "(4, 40)", "group size 32"});
  check_error([&] { quantize(Tensor::zeros(Shape{4, 64}, DType::i32)); }, {"quantize", "int32"});
  check_error([&] { quantize(nn::test::random_tensor(Shape{4, 64}, DType::f32, 1), Quant{QuantMode::mxfp4, 64, 4}); },
              {"quantize", "mxfp4 needs group size 32"});
  check_error([&] { quantize(nn::test::random_tensor(Shape{4, 64}, DType::f32, 1), Quant{QuantMode::nvfp4, 32, 4}); },
              {"quantize", "nvfp4 needs group size 16 and 4 bits"});
  check_error([&] { quantized_matmul(tp, x, w, tp.constant(Tensor::zeros(Shape{8, 1}, DType::f32)), std::nullopt, Quant::mxfp8()); },
              {"quantized_matmul", "mxfp8 scales must be uint8 (E8M0)"});
}

}  // namespace quant_quant
