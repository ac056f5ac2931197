// SPDX-License-Identifier: MIT OR Apache-2.0
// backend/simd.hpp: the float32 row math at each kernel set this CPU can run (each set's entry
// points called directly, whatever NN_CPU_ISA says), against float64 references: exp within 1
// ulp over its whole range and exact at its edges, the row functions on every tail length, and
// each element's result independent of where it sits in a row.
#include <doctest/doctest.h>

#include <cmath>
#include <cstring>
#include <string>
#include <limits>
#include <random>
#include <vector>

#include <nn/nn.hpp>

namespace backend_simd {  // one unity source with the other backend files: its names stay its own

using namespace nn;

namespace {

// One kernel set's entry points.
struct Set {
  const char* name;
  void (*exp_inplace)(float*, std::int64_t);
  float (*max)(const float*, std::int64_t);
  float (*sum_exp)(const float*, std::int64_t, float);
  void (*ce_grad)(const float*, std::int64_t, float, float, float*, bool);
  void (*swiglu)(const float*, const float*, float*, std::int64_t);
  void (*swiglu_vjp)(const float*, const float*, const float*, float*, bool, float*, bool, std::int64_t);
  float (*scale_max)(float*, std::int64_t, float);
  float (*exp_sum)(float*, std::int64_t, float);
  void (*probs_from_lse)(float*, std::int64_t, float, float);
  void (*softmax_vjp)(const float*, float*, std::int64_t, float, float);
  void (*adam)(float*, const float*, float*, float*, std::int64_t, const detail::AdamMath<float>&);
};

#define NN_SIMD_SET(S)                                                                                          \
  Set {                                                                                                         \
    #S, simd::exp_inplace_##S, simd::max_##S, simd::sum_exp_##S, simd::ce_grad_##S, simd::swiglu_##S,           \
        simd::swiglu_vjp_##S, simd::scale_max_##S, simd::exp_sum_##S, simd::probs_from_lse_##S,                \
        simd::softmax_vjp_##S, simd::adam_##S                                                                   \
  }

std::vector<Set> sets() {
  std::vector<Set> out{NN_SIMD_SET(generic)};
#if defined(__x86_64__) || defined(__i386__)
  const Isa best = cpu_info().features.best_isa();
  if (static_cast<int>(best) >= static_cast<int>(Isa::avx2)) out.push_back(NN_SIMD_SET(avx2));
  if (best == Isa::avx512) out.push_back(NN_SIMD_SET(avx512));
#endif
  return out;
}

// |got - want| in units of float's spacing at want.
double ulps(float got, double want) {
  const float w = static_cast<float>(want);
  const double ulp = static_cast<double>(std::nextafter(std::fabs(w), std::numeric_limits<float>::infinity())) -
                     static_cast<double>(std::fabs(w));
  return std::fabs(static_cast<double>(got) - want) / ulp;
}

std::vector<float> random_row(std::int64_t n, unsigned seed, float lo, float hi) {
  std::mt19937 gen(seed);
  std::uniform_real_distribution<float> u(lo, hi);
  std::vector<float> x(static_cast<std::size_t>(n));
  for (float& v : x) v = u(gen);
  return x;
}

}  // namespace

TEST_CASE("simd::exp: within 1 ulp of exp over its range, exact at its edges, at every kernel set") {
  for (const Set& s : sets()) {
    CAPTURE(s.name);
    std::vector<float> x;
    for (float v = -88.7f; v < 88.7f; v += 0.0013f) x.push_back(v);
    for (float v = -1.0f; v < 1.0f; v += 1e-5f) x.push_back(v);
    std::vector<float> y = x;
    s.exp_inplace(y.data(), static_cast<std::int64_t>(y.size()));
    double worst = 0;
    for (std::size_t i = 0; i < x.size(); ++i) worst = std::max(worst, ulps(y[i], std::exp(static_cast<double>(x[i]))));
    CHECK(worst <= 1.0);
    const float inf = std::numeric_limits<float>::infinity();
    std::vector<float> e{0.0f, -0.0f, -inf, inf, std::nanf(""), -88.73f, -1e9f, 88.73f, 1e9f, 1.0f, -88.72f};
    s.exp_inplace(e.data(), static_cast<std::int64_t>(e.size()));
    CHECK(e[0] == 1.0f);
    CHECK(e[1] == 1.0f);
    CHECK(e[2] == 0.0f);  // a masked score contributes exactly nothing
    CHECK(e[3] == inf);
    CHECK(std::isnan(e[4]));
    CHECK(e[5] == 0.0f);
    CHECK(e[6] == 0.0f);
    CHECK(e[7] == inf);
    CHECK(e[8] == inf);
    CHECK(ulps(e[9], std::exp(1.0)) <= 1.0);
    // exp(-88.72) is a denormal (2.9e-39): within two of its spacing (1.4e-45)
    CHECK(std::fabs(static_cast<double>(e[10]) - std::exp(static_cast<double>(-88.72f))) <= 3e-45);
  }
}

TEST_CASE("simd::exp: the FMA kernel sets agree bit for bit on every 61st float, NaNs and denormals included") {
  // AVX-512 scales by 2^n with vscalefps and clamps with vmaxps / vminps, AVX2 with its own max /
  // min and the exponent-field products: the same lane arithmetic otherwise, so the same bits. (The
  // baseline set has no FMA and may differ in the last bit: the top of simd.hpp.)
  std::vector<Set> fma;
  for (const Set& s : sets())
    if (std::string(s.name) != "generic") fma.push_back(s);
  if (fma.size() < 2) return;  // a CPU without AVX-512 has one FMA set: nothing to compare
  std::vector<float> x;
  for (std::uint64_t u = 0; u <= 0xffffffffull; u += 61) {
    const auto bits = static_cast<std::uint32_t>(u);
    float f;
    std::memcpy(&f, &bits, sizeof f);
    x.push_back(f);
  }
  for (float f : {-88.72f, std::nextafter(-88.72f, 0.0f), std::nextafter(-88.72f, -100.0f), 88.72f,
                  std::nextafter(88.72f, 100.0f), -87.33655f, -87.3f, 88.7228f})
    x.push_back(f);
  std::vector<float> a = x, b = x;
  fma[0].exp_inplace(a.data(), static_cast<std::int64_t>(a.size()));
  fma[1].exp_inplace(b.data(), static_cast<std::int64_t>(b.size()));
  std::int64_t differ = 0;
  for (std::size_t i = 0; i < x.size(); ++i) differ += std::memcmp(&a[i], &b[i], sizeof(float)) != 0;
  CHECK(differ == 0);
}

TEST_CASE("simd row functions: float64 references, every tail length, results independent of position") {
  for (const Set& s : sets()) {
    CAPTURE(s.name);
    for (std::int64_t n : {0, 1, 3, 4, 5, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 100}) {
      CAPTURE(n);
      const auto x = random_row(n + 1, static_cast<unsigned>(n) + 1, -30, 30);
      const float* xr = x.data() + 1;  // off the vector alignment
      // max and sum_exp
      double m = -std::numeric_limits<double>::infinity(), se = 0;
      for (std::int64_t i = 0; i < n; ++i) m = std::max(m, static_cast<double>(xr[i]));
      CHECK(s.max(xr, n) == static_cast<float>(m));
      const float mf = n ? static_cast<float>(m) : 0.0f;
      for (std::int64_t i = 0; i < n; ++i) se += std::exp(static_cast<double>(xr[i]) - mf);
      const float got = s.sum_exp(xr, n, mf);
      CHECK(std::fabs(got - se) <= 2e-6 * std::max(se, 1.0));
      // ce_grad: o = g exp(x - lse), then o += the same
      const float lse = mf + std::log(std::max(got, 1e-30f)), g = 0.37f;
      std::vector<float> o(static_cast<std::size_t>(n) + 1, 5.0f);
      s.ce_grad(xr, n, lse, g, o.data(), false);
      for (std::int64_t i = 0; i < n; ++i) {
        const float d = xr[i] - lse;  // the kernel's own argument (x - lse rounds in float)
        const double want = g * std::exp(static_cast<double>(d));
        CHECK(ulps(o[static_cast<std::size_t>(i)], want) <= 3.0);
      }
      CHECK(o[static_cast<std::size_t>(n)] == 5.0f);  // nothing written past the row
      std::vector<float> o2 = o;
      s.ce_grad(xr, n, lse, g, o2.data(), true);
      for (std::int64_t i = 0; i < n; ++i)
        CHECK(o2[static_cast<std::size_t>(i)] == o[static_cast<std::size_t>(i)] + o[static_cast<std::size_t>(i)]);
      // swiglu and its vjp against SwiGluMath in float64
      const auto a = random_row(n, 7 + static_cast<unsigned>(n), -8, 8), u = random_row(n, 9, -2, 2),
                 gr = random_row(n, 11, -1, 1);
      std::vector<float> y(static_cast<std::size_t>(n)), da(y.size(), 1.0f), du(y.size(), 2.0f);
      s.swiglu(a.data(), u.data(), y.data(), n);
      s.swiglu_vjp(a.data(), u.data(), gr.data(), da.data(), true, du.data(), false, n);
      for (std::size_t i = 0; i < y.size(); ++i) {
        const double ad = a[i], ud = u[i], gd = gr[i], sg = detail::SwiGluMath::sig(ad);
        CHECK(std::fabs(y[i] - detail::SwiGluMath::y(ad, ud)) <= 1e-6 * (std::fabs(ad * ud) + 1e-6));
        CHECK(std::fabs(da[i] - (1.0 + detail::SwiGluMath::dgate(ad, ud, gd, sg))) <= 1e-6 * (std::fabs(ad * ud * gd) + 2));
        CHECK(std::fabs(du[i] - detail::SwiGluMath::dup(ad, gd, sg)) <= 1e-6 * (std::fabs(ad * gd) + 1e-6));
      }
    }
    // each element's exp is the same wherever it sits (a tail computed whole, stored in part)
    const auto x = random_row(67, 3, -20, 20);
    std::vector<float> whole = x;
    s.exp_inplace(whole.data(), 67);
    for (std::int64_t off : {1, 5, 13, 30}) {
      std::vector<float> part(x.begin() + off, x.end());
      s.exp_inplace(part.data(), static_cast<std::int64_t>(part.size()));
      for (std::size_t i = 0; i < part.size(); ++i) CHECK(part[i] == whole[i + static_cast<std::size_t>(off)]);
    }
  }
}

TEST_CASE("simd softmax tile rows: scale_max, exp_sum, probs_from_lse, softmax_vjp against float64, every tail") {
  for (const Set& s : sets()) {
    CAPTURE(s.name);
    for (std::int64_t n : {0, 1, 3, 7, 8, 9, 15, 16, 17, 31, 32, 33, 47, 100, 128}) {
      CAPTURE(n);
      const auto x = random_row(n + 2, 40 + static_cast<unsigned>(n), -12, 12);
      const float sc = 0.1767767f;  // 1 / sqrt(32)
      // scale_max: x * sc exactly as float multiplies, and their max; nothing past the row touched
      std::vector<float> y = x;
      const float mx = s.scale_max(y.data() + 1, n, sc);
      float want_max = -std::numeric_limits<float>::infinity();
      for (std::int64_t i = 0; i < n; ++i) {
        const std::size_t k = static_cast<std::size_t>(i) + 1;
        CHECK(y[k] == x[k] * sc);
        want_max = std::max(want_max, x[k] * sc);
      }
      CHECK(mx == want_max);
      CHECK(y[0] == x[0]);
      CHECK(y[static_cast<std::size_t>(n) + 1] == x[static_cast<std::size_t>(n) + 1]);
      // exp_sum: y = exp(y - m) elementwise within 1 ulp of float64, the sum within f32 accumulation
      const float m = n ? mx : 0.0f;
      std::vector<float> e = y;
      const float sum = s.exp_sum(e.data() + 1, n, m);
      double want_sum = 0;
      for (std::int64_t i = 0; i < n; ++i) {
        const std::size_t k = static_cast<std::size_t>(i) + 1;
        const double want = std::exp(static_cast<double>(y[k] - m));
        CHECK(ulps(e[k], want) <= 1.0);
        want_sum += static_cast<double>(e[k]);
      }
      CHECK(std::fabs(sum - want_sum) <= 1e-6 * std::max(want_sum, 1.0));
      CHECK(e[static_cast<std::size_t>(n) + 1] == y[static_cast<std::size_t>(n) + 1]);
      // probs_from_lse on the raw scores gives the same probabilities, normalised by lse
      const float lse = m + std::log(std::max(sum, 1e-30f));
      std::vector<float> p = x;
      s.probs_from_lse(p.data() + 1, n, sc, lse);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::size_t k = static_cast<std::size_t>(i) + 1;
        const double want = std::exp(static_cast<double>(x[k]) * sc - static_cast<double>(lse));
        CHECK(std::fabs(p[k] - want) <= 4e-6 * want + 1e-30);  // sc x - lse rounds once (or fuses)
      }
      // softmax_vjp: d = p (d - dot) sc
      const auto g = random_row(n + 1, 77, -1, 1);
      std::vector<float> d = g;
      const float dot = 0.25f;
      s.softmax_vjp(p.data() + 1, d.data() + 1, n, dot, sc);
      for (std::int64_t i = 0; i < n; ++i) {
        const std::size_t k = static_cast<std::size_t>(i) + 1;
        const double want = static_cast<double>(p[k]) * (static_cast<double>(g[k]) - dot) * sc;
        CHECK(std::fabs(d[k] - want) <= 1e-6 * std::fabs(want) + 1e-12);
      }
      CHECK(d[0] == g[0]);
    }
  }
}

TEST_CASE("simd::adam: one Adam / AdamW step against float64, every tail length, nothing written past the run") {
  for (const Set& s : sets()) {
    CAPTURE(s.name);
    for (const double wd : {0.0, 0.1})
      for (std::int64_t n = 0; n <= 70; ++n) {
        CAPTURE(n);
        const std::vector<float> p0 = random_row(n + 1, 11 + static_cast<unsigned>(n), -1, 1),
                                 g = random_row(n + 1, 12 + static_cast<unsigned>(n), -2, 2),
                                 m0 = random_row(n + 1, 13 + static_cast<unsigned>(n), -0.5f, 0.5f),
                                 v0 = random_row(n + 1, 14 + static_cast<unsigned>(n), 0, 0.5f);
        std::vector<float> p = p0, m = m0, v = v0;
        const auto f = detail::AdamMath<float>::make(3e-3, 5, 0.9, 0.999, 1e-8, wd, true);
        // the reference on f's own (float) coefficients: what is left is float32 arithmetic's rounding
        const detail::AdamMath<double> fd{f.B1, f.B2, f.E, f.C1, f.C2, f.decay, f.c1, f.c2, f.decoupled};
        s.adam(p.data(), g.data(), m.data(), v.data(), n, f);
        for (std::int64_t i = 0; i < n; ++i) {
          const auto k = static_cast<std::size_t>(i);
          const double mw = fd.m(double(m0[k]), double(g[k])), vw = fd.v(double(v0[k]), double(g[k]));
          const double pd = wd ? double(p0[k]) * fd.decay : double(p0[k]), dw = fd.delta(mw, std::sqrt(vw));
          // a few roundings of float32 (2^-24 each) on the terms' magnitudes
          CHECK(std::fabs(m[k] - mw) <= 2.5e-7 * (std::fabs(fd.B1 * m0[k]) + std::fabs(fd.C1 * g[k])));
          CHECK(std::fabs(v[k] - vw) <= 2.5e-7 * (std::fabs(fd.B2 * v0[k]) + std::fabs(fd.C2 * g[k] * g[k])));
          CHECK(std::fabs(p[k] - (pd - dw)) <= 6e-7 * (std::fabs(pd) + std::fabs(dw)));
        }
        const auto e = static_cast<std::size_t>(n);  // one past the run: untouched
        CHECK((p[e] == p0[e] && m[e] == m0[e] && v[e] == v0[e]));
      }
  }
}

}  // namespace backend_simd
