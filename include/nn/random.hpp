// SPDX-License-Identifier: MIT OR Apache-2.0
// Counter-based random numbers that reproduce MLX's generator bit for bit (keys, split, bits,
// uniform, normal, bernoulli, the global seed sequence) and the initialisers MLX's layers use.
//
// The algorithm, as MLX implements it (mlx/random.cpp, mlx/backend/cpu/primitives.cpp
// RandomBits, checked against mlx 0.32.4 by tests/random/ on fixtures from tests/oracle/gen_random.py):
//  * a key is a uint32 tensor of shape (2): key(seed) = [seed >> 32, seed & 0xffffffff];
//  * the hash is Threefry-2x32 with 20 rounds (Salmon et al. 2011; JAX's jep/263 variant);
//  * bits(n words, key): with h = n / 2 and o = n % 2, pair j < h hashes the counter
//    (j, h + o + j) and writes its two halves to words j and h + o + j; an odd n's middle word
//    h is the first half of hash(key, (h, 0)). The layout depends on n, so the first words of a
//    7-element draw differ from those of an 8-element draw from the same key;
//  * split(key, num) = bits((num, 2), key); split(key) = rows 0 and 1 of split(key, 2);
//  * uniform float32 in [0, 1): u = min(float(word) / 2^32, 1 - 2^-24) (float(word) rounds to
//    nearest, so words near 2^32 become 1 and are clipped), then low + (high - low) * u, each
//    operation rounded to float32 on its own (MLX runs them as separate ops: no fused multiply-add);
//    bfloat16/float16: the same float32 u clipped to the largest value below 1 of that type, cast,
//    then range * u + low in that type;
//  * normal: e = erfinv(uniform(nextafter(-1, 0), 1)) in float32 (Juffa's erfinvf polynomials,
//    as MLX's CPU kernel; its logf is the C library's, as in MLX's x86 build), cast to the
//    dtype, times sqrt(2) [* scale], [+ loc], each op rounded in the dtype;
//  * bernoulli(p): uniform float32 [0, 1) < float32(p);
//  * the global sequence (KeySequence::next): state = key(seed); each draw without a key takes
//    (state, k) = split(state) and uses k.
#pragma once

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <mutex>
#include <optional>
#include <utility>
#include <vector>

#include "tensor.hpp"


namespace nn::random {

namespace detail {

NN_HD constexpr std::uint32_t rotl32(std::uint32_t x, int r) { return (x << r) | (x >> (32 - r)); }

/// Threefry-2x32, 20 rounds: the block cipher behind every MLX random number.
NN_HD constexpr void threefry2x32(std::uint32_t k0, std::uint32_t k1, std::uint32_t c0, std::uint32_t c1,
                                         std::uint32_t& out0, std::uint32_t& out1) {
  const std::uint32_t ks[3] = {k0, k1, k0 ^ k1 ^ 0x1BD11BDAu};
  constexpr int rot[2][4] = {{13, 15, 26, 6}, {17, 29, 16, 24}};
  std::uint32_t x0 = c0 + ks[0], x1 = c1 + ks[1];
  for (int i = 0; i < 5; ++i) {  // five groups of four rounds, a key injection after each
    for (int r : rot[i % 2]) {
      x0 += x1;
      x1 = rotl32(x1, r);
      x1 ^= x0;
    }
    x0 += ks[(i + 1) % 3];
    x1 += ks[(i + 2) % 3] + static_cast<std::uint32_t>(i + 1);
  }
  out0 = x0;
  out1 = x1;
}

/// How many hash calls an n-word stream takes: one per pair, plus one for an odd middle word.
NN_HD constexpr std::int64_t bits_blocks(std::int64_t n) { return n / 2 + n % 2; }

/// Hash call j of an n-word stream (0 <= j < bits_blocks(n)): calls emit(index, word) for the one
/// or two words it produces. Blocks are independent, so a kernel may run them in any order or in
/// parallel and still lay the words out as MLX's RandomBits does.
template <class Emit>
NN_HD constexpr void bits_block(std::uint32_t k0, std::uint32_t k1, std::int64_t n, std::int64_t j, Emit&& emit) {
  const std::int64_t h = n / 2, o = n % 2;
  std::uint32_t a = 0, b = 0;
  if (j < h) {
    // MLX's counters are 32-bit: a stream past 2^32 words would wrap, as MLX's does.
    threefry2x32(k0, k1, static_cast<std::uint32_t>(j), static_cast<std::uint32_t>(h + o + j), a, b);
    emit(j, a);
    emit(h + o + j, b);
  } else {
    threefry2x32(k0, k1, static_cast<std::uint32_t>(h), 0u, a, b);
    emit(h, a);
  }
}

/// Writes the n words MLX's bits(n, key) produces.
inline void fill_bits(std::uint32_t k0, std::uint32_t k1, std::uint32_t* out, std::int64_t n) {
  const std::int64_t blocks = bits_blocks(n);
  for (std::int64_t j = 0; j < blocks; ++j) bits_block(k0, k1, n, j, [out](std::int64_t i, std::uint32_t w) { out[i] = w; });
}

/// MLX's float32 uniform in [0, 1) from one word. Dividing by float(2^32 - 1), which is 2^32,
/// is an exact scaling, so this is the same float on every IEEE machine.
NN_HD inline float uniform01(std::uint32_t w) {
  const float u = static_cast<float>(w) * 0x1p-32f;
  return u < 0x1.fffffep-1f ? u : 0x1.fffffep-1f;
}

/// A value forced to its own rounding: keeps the compiler from contracting a * b + c into one
/// fused multiply-add (which rounds once), since MLX multiplies and adds as separate ops.
template <class T>
inline T rounded(T v) {
  volatile T r = v;
  return r;
}

/// erfinv in float32 as MLX's CPU kernel computes it (Norbert Juffa's erfinvf polynomials, fma
/// at every step, logf from the C library), so normal() draws MLX's values bit for bit.
inline float erfinv_f32(float a) {
  float t = std::fma(a, 0.0f - a, 1.0f);
  t = std::log(t);
  float p;
  if (std::abs(t) > 6.125f) {  // the tails
    p = 3.03697567e-10f;
    p = std::fma(p, t, 2.93243101e-8f);
    p = std::fma(p, t, 1.22150334e-6f);
    p = std::fma(p, t, 2.84108955e-5f);
    p = std::fma(p, t, 3.93552968e-4f);
    p = std::fma(p, t, 3.02698812e-3f);
    p = std::fma(p, t, 4.83185798e-3f);
    p = std::fma(p, t, -2.64646143e-1f);
    p = std::fma(p, t, 8.40016484e-1f);
  } else {  // the centre
    p = 5.43877832e-9f;
    p = std::fma(p, t, 1.43285448e-7f);
    p = std::fma(p, t, 1.22774793e-6f);
    p = std::fma(p, t, 1.12963626e-7f);
    p = std::fma(p, t, -5.61530760e-5f);
    p = std::fma(p, t, -1.47697632e-4f);
    p = std::fma(p, t, 2.31468678e-3f);
    p = std::fma(p, t, 1.15392581e-2f);
    p = std::fma(p, t, -2.32015476e-1f);
    p = std::fma(p, t, 8.86226892e-1f);
  }
  return a * p;
}

/// Arithmetic "in dtype t": the result of a float (or double) computation rounded to t, as MLX
/// computes bfloat16/float16 ops in float32 and rounds each result.
inline double round_to(DType t, double v) {
  switch (t) {
    case DType::f32: return static_cast<float>(v);
    case DType::bf16: return half::bf16_to_f32(half::f32_to_bf16(static_cast<float>(v)));
    case DType::f16: return half::f16_to_f32(half::f32_to_f16(static_cast<float>(v)));
    default: return v;
  }
}

/// The largest value below 1 in a float dtype: where MLX clips u so that the cast cannot reach 1.
inline float below_one(DType t) {
  switch (t) {
    case DType::bf16: return half::bf16_to_f32(0x3F7F);  // 1 - 2^-8
    case DType::f16: return half::f16_to_f32(0x3BFF);    // 1 - 2^-11
    default: return 0x1.fffffep-1f;                      // 1 - 2^-24
  }
}

inline void require_key(const Tensor& key, const char* op) {
  if (!key.defined()) nn::detail::fail(op, "the key is an empty tensor");
  if (key.dtype() != DType::u32 || !(key.shape() == Shape{2}))
    nn::detail::fail(op, "a key is a uint32 tensor of shape (2) (as mx.random.key), got ", dtype_name(key.dtype()),
                     " ", key.shape().str());
  if (key.device() != Device::cpu) nn::detail::fail(op, "the key lives on ", key.device(), "; copy it to the host first");
}

inline void require_float_dtype(DType t, const char* op) {
  if (!is_floating(t)) nn::detail::fail(op, "needs a floating dtype, got ", dtype_name(t));
}

/// The process-wide key sequence. MLX seeds it from the clock when the program never calls
/// seed(); so does this one, so an unseeded run is not silently reproducible either.
struct GlobalState {
  std::mutex mu;
  std::uint32_t k0 = 0, k1 = 0;
  GlobalState() {
    const auto ms = static_cast<std::uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                   std::chrono::system_clock::now().time_since_epoch())
                                                   .count());
    k0 = static_cast<std::uint32_t>(ms >> 32);
    k1 = static_cast<std::uint32_t>(ms);
  }
};
inline GlobalState& global_state() {
  static GlobalState g;
  return g;
}

}  // namespace detail

/// A key from a seed, as mx.random.key: uint32 (2) = [seed >> 32, seed & 0xffffffff].
inline Tensor key(std::uint64_t seed) {
  return Tensor::from<std::uint32_t>({2}, {static_cast<std::uint32_t>(seed >> 32), static_cast<std::uint32_t>(seed)});
}

/// Random uint32 words of `shape` from `key`, as MLX's random::bits (width 4). Without a key the
/// global sequence supplies one (see next_key).
inline Tensor bits(const Shape& shape, std::optional<Tensor> key = std::nullopt);

/// `num` new keys from `key`, as mx.random.split(key, num): uint32 (num, 2).
inline Tensor split(const Tensor& key, int num) {
  detail::require_key(key, "random.split");
  if (num < 0) nn::detail::fail("random.split", "num must be >= 0, got ", num);
  return bits(Shape{num, 2}, key);
}

/// Row i of a (num, 2) key table from split(key, num), as a key of shape (2).
inline Tensor subkey(const Tensor& keys, std::int64_t i) {
  if (keys.dtype() != DType::u32 || keys.rank() != 2 || keys.dim(1) != 2)
    nn::detail::fail("random.subkey", "expects the uint32 (num, 2) table split() returns, got ", dtype_name(keys.dtype()),
                     " ", keys.shape().str());
  if (i < 0 || i >= keys.dim(0)) nn::detail::fail("random.subkey", "row ", i, " is out of range for ", keys.shape().str());
  const std::uint32_t* p = keys.data<std::uint32_t>() + 2 * i;
  return Tensor::from<std::uint32_t>({2}, {p[0], p[1]});
}

/// The two keys MLX's split(key) returns (rows 0 and 1 of split(key, 2)).
inline std::pair<Tensor, Tensor> split(const Tensor& key) {
  Tensor two = split(key, 2);
  return {subkey(two, 0), subkey(two, 1)};
}

// ---- the process-wide default sequence ---------------------------------------------------------
// This is the library's one piece of global state. The eager functions below and the initialisers
// read it, and GTape::random_key()/refresh_keys() use it only to fill key input slots; no op ever
// reads it (a dropout on a tape takes its key as an input), so a tape's nodes stay pure data.

/// Seeds the global sequence: state = key(s), as mx.random.seed(s).
inline void seed(std::uint64_t s) {
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  g.k0 = static_cast<std::uint32_t>(s >> 32);
  g.k1 = static_cast<std::uint32_t>(s);
}

/// next_key() written into an existing uint32 (2) tensor: no allocation (a compiled step's
/// replay refills its key slots with it).
inline void next_key_into(Tensor& dst) {
  detail::require_key(dst, "random.next_key_into");
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  std::uint32_t w[4];
  detail::fill_bits(g.k0, g.k1, w, 4);
  g.k0 = w[0];
  g.k1 = w[1];
  std::uint32_t* d = dst.data<std::uint32_t>();
  d[0] = w[2];
  d[1] = w[3];
}

/// The key the next keyless draw uses: (state, k) = split(state); returns k. MLX's
/// KeySequence::next, which every MLX random call without a key makes once.
inline Tensor next_key() {
  Tensor k = Tensor::empty(Shape{2}, DType::u32);
  next_key_into(k);
  return k;
}

/// A copy of the global key (mx.random.state[0]), e.g. to save it in a checkpoint.
inline Tensor state() {
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  return Tensor::from<std::uint32_t>({2}, {g.k0, g.k1});
}

/// Restores a key saved by state().
inline void set_state(const Tensor& key) {
  detail::require_key(key, "random.set_state");
  const std::uint32_t* p = key.data<std::uint32_t>();
  auto& g = detail::global_state();
  std::lock_guard<std::mutex> lock(g.mu);
  g.k0 = p[0];
  g.k1 = p[1];
}

namespace detail {
/// The explicit key, or the global sequence's next one.
inline std::pair<std::uint32_t, std::uint32_t> resolve(const std::optional<Tensor>& key, const char* op) {
  Tensor k = key ? *key : next_key();
  require_key(k, op);
  const std::uint32_t* p = k.data<std::uint32_t>();
  return {p[0], p[1]};
}
/// Float32 uniforms in [0, 1), clipped below 1 in `t` (not yet cast), one per element of shape.
inline std::vector<float> uniform01_all(const Shape& shape, DType t, const std::optional<Tensor>& key, const char* op) {
  auto [k0, k1] = resolve(key, op);
  std::vector<std::uint32_t> w(static_cast<std::size_t>(shape.numel()));
  fill_bits(k0, k1, w.data(), shape.numel());
  const float top = below_one(t);
  std::vector<float> u(w.size());
  for (std::size_t i = 0; i < w.size(); ++i) u[i] = std::min(uniform01(w[i]), top);
  return u;
}
}  // namespace detail

inline Tensor bits(const Shape& shape, std::optional<Tensor> key) {
  auto [k0, k1] = detail::resolve(key, "random.bits");
  Tensor out = Tensor::empty(shape, DType::u32);
  detail::fill_bits(k0, k1, out.data<std::uint32_t>(), shape.numel());
  return out;
}

/// Uniform samples in [low, high) as mx.random.uniform(low, high, shape, dtype, key). float32,
/// bfloat16 and float16 are MLX's values bit for bit. float64 (which MLX refuses) is the float32
/// u of the same key mapped in double: low + (high - low) * u.
inline Tensor uniform(const Shape& shape, double low = 0.0, double high = 1.0, DType dtype = DType::f32,
                      std::optional<Tensor> key = std::nullopt) {
  detail::require_float_dtype(dtype, "random.uniform");
  std::vector<float> u = detail::uniform01_all(shape, dtype, key, "random.uniform");
  // low and high become arrays of the dtype first (MLX's astype), then range = high - low in it.
  const double lo = detail::round_to(dtype, low), hi = detail::round_to(dtype, high);
  const double range = detail::round_to(dtype, hi - lo);
  Tensor out = Tensor::empty(shape, dtype);
  for (std::size_t i = 0; i < u.size(); ++i) {
    const auto idx = static_cast<std::int64_t>(i);
    if (dtype == DType::f32) {
      const float prod = detail::rounded(static_cast<float>(range) * u[i]);
      out.data<float>()[i] = prod + static_cast<float>(lo);
    } else if (dtype == DType::f64) {
      const double prod = detail::rounded(range * static_cast<double>(u[i]));
      out.data<double>()[i] = prod + lo;
    } else {  // bf16 / f16: u cast to the type, then each op rounded to it
      const double uc = detail::round_to(dtype, u[i]);
      const double prod = detail::round_to(dtype, detail::rounded(static_cast<float>(range) * static_cast<float>(uc)));
      nn::detail::store_from_double(out.raw(), dtype, idx, static_cast<float>(prod) + static_cast<float>(lo));
    }
  }
  return out;
}

/// Normal samples as mx.random.normal(shape, dtype, loc, scale, key): erfinv of a float32 uniform
/// in (-1, 1), cast to dtype, times sqrt(2) * scale, plus loc. Like MLX's C++ API, scale == 1 and
/// loc == 0 are not applied at all (Python's loc=None / scale=None).
inline Tensor normal(const Shape& shape, DType dtype = DType::f32, double loc = 0.0, double scale = 1.0,
                     std::optional<Tensor> key = std::nullopt) {
  detail::require_float_dtype(dtype, "random.normal");
  // The uniform MLX draws here is float32 in [nextafter(-1, 0), 1): range 2 exactly (the float32
  // sum 1 + (1 - 2^-24) rounds to 2), so u' = 2u + low needs no care about fused rounding.
  std::vector<float> u = detail::uniform01_all(shape, DType::f32, key, "random.normal");
  const float lo = std::nextafter(-1.0f, 0.0f);
  const float range = 1.0f - lo;
  // sqrt(2) [* scale] is one value of the dtype, computed before it meets the samples.
  double mul = detail::round_to(dtype, std::sqrt(2.0));
  if (scale != 1.0) mul = detail::round_to(dtype, mul * detail::round_to(dtype, scale));
  const double loc_t = detail::round_to(dtype, loc);
  Tensor out = Tensor::empty(shape, dtype);
  for (std::size_t i = 0; i < u.size(); ++i) {
    const float s = detail::rounded(range * u[i]) + lo;
    const double e = detail::round_to(dtype, detail::erfinv_f32(s));
    double v;
    if (dtype == DType::f64) v = detail::rounded(mul * e);
    else v = detail::round_to(dtype, detail::rounded(static_cast<float>(mul) * static_cast<float>(e)));
    if (loc != 0.0) {
      if (dtype == DType::f64) v = loc_t + v;
      else v = detail::round_to(dtype, static_cast<float>(loc_t) + static_cast<float>(v));
    }
    nn::detail::store_from_double(out.raw(), dtype, static_cast<std::int64_t>(i), v);
  }
  return out;
}

/// A uint8 mask of `shape`, 1 with probability p, as mx.random.bernoulli(p, shape, key):
/// uniform float32 [0, 1) < float32(p).
inline Tensor bernoulli(double p, const Shape& shape, std::optional<Tensor> key = std::nullopt) {
  std::vector<float> u = detail::uniform01_all(shape, DType::f32, key, "random.bernoulli");
  const float pf = static_cast<float>(p);
  Tensor out = Tensor::empty(shape, DType::u8);
  for (std::size_t i = 0; i < u.size(); ++i) out.data<std::uint8_t>()[i] = u[i] < pf ? 1 : 0;
  return out;
}

}  // namespace nn::random

namespace nn::init {

/// Initial weights of MLX's nn.Linear(in, out, bias): weight (out, in) then bias (out), both
/// uniform in [-s, s) with s = sqrt(1 / in) (computed in double, as Python does), each drawn
/// with the global sequence's next key, in that order.
struct LinearInit {
  Tensor weight;  // (out, in)
  Tensor bias;    // (out), undefined when bias is false
};
/// The bias draw alone (what linear() draws second): uniform (out) in [-sqrt(1/in), sqrt(1/in)).
inline Tensor linear_bias(std::int64_t in, std::int64_t out) {
  if (in <= 0 || out <= 0) nn::detail::fail("init.linear", "dims must be positive, got in=", in, " out=", out);
  const double s = std::sqrt(1.0 / static_cast<double>(in));
  return random::uniform({out}, -s, s);
}
inline LinearInit linear(std::int64_t in, std::int64_t out, bool bias = true) {
  if (in <= 0 || out <= 0) nn::detail::fail("init.linear", "dims must be positive, got in=", in, " out=", out);
  const double s = std::sqrt(1.0 / static_cast<double>(in));
  LinearInit r;
  r.weight = random::uniform({out, in}, -s, s);
  if (bias) r.bias = linear_bias(in, out);
  return r;
}

/// Initial weight of MLX's nn.Embedding(num, dims): normal (num, dims) with scale sqrt(1 / dims).
inline Tensor embedding(std::int64_t num, std::int64_t dims) {
  if (num <= 0 || dims <= 0) nn::detail::fail("init.embedding", "dims must be positive, got ", num, " x ", dims);
  return random::normal({num, dims}, DType::f32, 0.0, std::sqrt(1.0 / static_cast<double>(dims)));
}

/// mlx-lm's LoRALinear factors: lora_a (in, r) uniform in [-s, s) with s = 1 / sqrt(in) (note:
/// not sqrt(1 / in) as nn.Linear), lora_b (r, out) zeros.
struct LoraInit {
  Tensor lora_a;  // (in, r)
  Tensor lora_b;  // (r, out)
};
/// As LoRALinear(in, out, r) / LoRALinear.from_base(linear, r) draw: LoRALinear.__init__ first
/// builds an inner nn.Linear(in, out, bias=False) (one draw, which from_base then discards), and
/// only then draws lora_a. That first key is consumed here too, so every later draw of the
/// program stays in step with mlx-lm.
inline LoraInit lora(std::int64_t in, std::int64_t out, std::int64_t r) {
  if (in <= 0 || out <= 0 || r <= 0)
    nn::detail::fail("init.lora", "dims must be positive, got in=", in, " out=", out, " r=", r);
  (void)random::next_key();  // the inner nn.Linear's weight
  const double s = 1.0 / std::sqrt(static_cast<double>(in));
  return {random::uniform({in, r}, -s, s), Tensor::zeros({r, out})};
}

}  // namespace nn::init
