// SPDX-License-Identifier: MIT OR Apache-2.0
// UTF-8 decoding and encoding, Unicode general categories, and NFC: what the tokenizer's
// pre-tokenizer regexes (\p{L}, \p{N}, \s) and Qwen2's NFC normalizer need.
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

#include "unicode_data.hpp"

namespace nn::lm {

/// Unicode general categories, in the order of the generated tables (tests/oracle/
/// gen_unicode_tables.py).
enum class Gc : std::uint8_t {
  Cn, Lu, Ll, Lt, Lm, Lo, Mn, Mc, Me, Nd, Nl, No, Pc, Pd, Ps,
  Pe, Pi, Pf, Po, Sm, Sc, Sk, So, Zs, Zl, Zp, Cc, Cf, Cs, Co
};
inline constexpr int kGcCount = 30;

namespace detail {

// ASCII categories, so plain English and code never reach the binary search.
inline constexpr std::uint8_t kAsciiGc[128] = {
    26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26,  // controls
    26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26, 26,
    23, 18, 18, 18, 20, 18, 18, 18, 14, 15, 18, 19, 18, 13, 18, 18,  //  !"#$%&'()*+,-./
    9,  9,  9,  9,  9,  9,  9,  9,  9,  9,  18, 18, 19, 19, 19, 18,  // 0-9 :;<=>?
    18, 1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,   // @ A-O
    1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  1,  14, 18, 15, 21, 12,  // P-Z [\]^_
    21, 2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,   // ` a-o
    2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  2,  14, 19, 15, 19, 26,  // p-z {|}~ DEL
};

}  // namespace detail

/// The general category of a code point (Cn for unassigned and for anything past U+10FFFF).
inline Gc general_category(char32_t c) {
  if (c < 128) return static_cast<Gc>(detail::kAsciiGc[c]);
  if (c > 0x10FFFF) return Gc::Cn;
  const std::uint32_t key = (static_cast<std::uint32_t>(c) << 5) | 31u;
  const auto* end = std::end(detail::kGcRuns);
  const auto* it = std::upper_bound(std::begin(detail::kGcRuns), end, key);
  return static_cast<Gc>(*(it - 1) & 31u);
}

inline bool is_letter(Gc g) { return g >= Gc::Lu && g <= Gc::Lo; }
inline bool is_mark(Gc g) { return g >= Gc::Mn && g <= Gc::Me; }
inline bool is_number(Gc g) { return g >= Gc::Nd && g <= Gc::No; }

/// Oniguruma's \s under Unicode (and the White_Space property): \t..\r, U+0085 and the
/// separators Zs, Zl, Zp.
inline bool is_whitespace(char32_t c, Gc g) {
  return (c >= 9 && c <= 13) || c == 0x85 || g == Gc::Zs || g == Gc::Zl || g == Gc::Zp;
}
inline bool is_whitespace(char32_t c) { return is_whitespace(c, general_category(c)); }

/// Stands for a byte that is not part of valid UTF-8: pre-tokenization sees one "other"
/// character and the byte itself still reaches byte-level BPE, so nothing is lost.
inline constexpr char32_t kInvalidByte = 0xFFFFFFFFu;

/// Decodes one code point at s[i], advancing i. Overlong forms, surrogates and values past
/// U+10FFFF are invalid: one byte is consumed and kInvalidByte returned.
inline char32_t utf8_next(std::string_view s, std::size_t& i) {
  const auto b0 = static_cast<unsigned char>(s[i]);
  if (b0 < 0x80) {
    ++i;
    return b0;
  }
  auto cont = [&](std::size_t k) {
    return i + k < s.size() && (static_cast<unsigned char>(s[i + k]) & 0xC0) == 0x80;
  };
  auto cb = [&](std::size_t k) { return static_cast<char32_t>(static_cast<unsigned char>(s[i + k]) & 0x3F); };
  if (b0 >= 0xC2 && b0 < 0xE0 && cont(1)) {
    char32_t c = ((b0 & 0x1Fu) << 6) | cb(1);
    i += 2;
    return c;
  }
  if (b0 >= 0xE0 && b0 < 0xF0 && cont(1) && cont(2)) {
    char32_t c = ((b0 & 0x0Fu) << 12) | (cb(1) << 6) | cb(2);
    if (c >= 0x800 && (c < 0xD800 || c > 0xDFFF)) {
      i += 3;
      return c;
    }
  }
  if (b0 >= 0xF0 && b0 < 0xF5 && cont(1) && cont(2) && cont(3)) {
    char32_t c = ((b0 & 0x07u) << 18) | (cb(1) << 12) | (cb(2) << 6) | cb(3);
    if (c >= 0x10000 && c <= 0x10FFFF) {
      i += 4;
      return c;
    }
  }
  ++i;
  return kInvalidByte;
}

inline void utf8_append(std::string& out, char32_t c) {
  if (c < 0x80) {
    out += static_cast<char>(c);
  } else if (c < 0x800) {
    out += static_cast<char>(0xC0 | (c >> 6));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else if (c < 0x10000) {
    out += static_cast<char>(0xE0 | (c >> 12));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  } else {
    out += static_cast<char>(0xF0 | (c >> 18));
    out += static_cast<char>(0x80 | ((c >> 12) & 0x3F));
    out += static_cast<char>(0x80 | ((c >> 6) & 0x3F));
    out += static_cast<char>(0x80 | (c & 0x3F));
  }
}

/// Replaces every maximal invalid subsequence with U+FFFD, exactly as Rust's
/// String::from_utf8_lossy (and so Hugging Face's decode) does.
inline std::string utf8_lossy(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  std::size_t i = 0;
  while (i < s.size()) {
    const auto b0 = static_cast<unsigned char>(s[i]);
    if (b0 < 0x80) {
      out += static_cast<char>(b0);
      ++i;
      continue;
    }
    // Length and the allowed range of the second byte (Unicode Table 3-7).
    std::size_t need = 0;
    unsigned char lo = 0x80, hi = 0xBF;
    if (b0 >= 0xC2 && b0 <= 0xDF) need = 1;
    else if (b0 == 0xE0) need = 2, lo = 0xA0;
    else if (b0 >= 0xE1 && b0 <= 0xEC) need = 2;
    else if (b0 == 0xED) need = 2, hi = 0x9F;
    else if (b0 >= 0xEE && b0 <= 0xEF) need = 2;
    else if (b0 == 0xF0) need = 3, lo = 0x90;
    else if (b0 >= 0xF1 && b0 <= 0xF3) need = 3;
    else if (b0 == 0xF4) need = 3, hi = 0x8F;
    if (need == 0) {
      out += "\xEF\xBF\xBD";
      ++i;
      continue;
    }
    std::size_t k = 1;
    for (; k <= need; ++k) {
      if (i + k >= s.size()) break;
      const auto b = static_cast<unsigned char>(s[i + k]);
      const unsigned char l = k == 1 ? lo : 0x80, h = k == 1 ? hi : 0xBF;
      if (b < l || b > h) break;
    }
    if (k > need) {
      out.append(s.substr(i, need + 1));
      i += need + 1;
    } else {
      out += "\xEF\xBF\xBD";  // the maximal subpart s[i, i+k) is one replacement
      i += k;
    }
  }
  return out;
}

/// Length of the longest prefix of `s` that does not end inside an incomplete (but so far
/// valid) UTF-8 sequence; a streaming decoder prints that much and keeps the rest for later.
inline std::size_t utf8_complete_prefix(std::string_view s) {
  const std::size_t n = s.size();
  for (std::size_t back = 1; back <= 3 && back <= n; ++back) {
    const auto b = static_cast<unsigned char>(s[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte: keep looking for the lead
    std::size_t len = b >= 0xF0 && b < 0xF5 ? 4 : b >= 0xE0 ? 3 : b >= 0xC2 && b < 0xE0 ? 2 : 1;
    return len > back ? n - back : n;
  }
  return n;
}

// ---- NFC (Unicode Standard Annex #15) --------------------------------------------------------

namespace detail {

inline constexpr char32_t kSBase = 0xAC00, kLBase = 0x1100, kVBase = 0x1161, kTBase = 0x11A7;
inline constexpr int kLCount = 19, kVCount = 21, kTCount = 28, kNCount = kVCount * kTCount,
                     kSCount = kLCount * kNCount;

inline std::uint8_t ccc(char32_t c) {
  if (c < 0x300) return 0;
  const auto* b = std::begin(kCccRuns);
  const auto* e = std::end(kCccRuns);
  const auto* it = std::upper_bound(b, e, c, [](char32_t v, const CccRange& r) { return v < r.first; });
  if (it == b) return 0;
  --it;
  return c <= it->last ? it->ccc : 0;
}

inline const Decomp* find_decomp(char32_t c) {
  const auto* b = std::begin(kDecomp);
  const auto* e = std::end(kDecomp);
  const auto* it = std::lower_bound(b, e, c, [](const Decomp& d, char32_t v) { return d.cp < v; });
  return it != e && it->cp == c ? it : nullptr;
}

inline bool nfc_maybe_unstable(char32_t c) {
  if (c < 0x300) return false;
  const auto* b = std::begin(kNfcCheck);
  const auto* e = std::end(kNfcCheck);
  const auto idx = static_cast<std::size_t>(std::upper_bound(b, e, static_cast<std::uint32_t>(c)) - b);
  // Inside a [first, last] pair when an odd number of bounds are <= c, or c equals a `last`.
  if (idx % 2 == 1) return true;
  return idx > 0 && kNfcCheck[idx - 1] == c;
}

inline void decompose(char32_t c, std::vector<char32_t>& out) {
  if (c >= kSBase && c < kSBase + static_cast<char32_t>(kSCount)) {
    const char32_t s = c - kSBase;
    out.push_back(kLBase + s / kNCount);
    out.push_back(kVBase + (s % kNCount) / kTCount);
    if (s % kTCount) out.push_back(kTBase + s % kTCount);
    return;
  }
  if (const Decomp* d = find_decomp(c)) {
    decompose(d->first, out);
    if (d->second & 0x7FFFFFFFu) decompose(d->second & 0x7FFFFFFFu, out);
    return;
  }
  out.push_back(c);
}

/// The primary composite of (a, b), or 0.
inline char32_t compose_pair(char32_t a, char32_t b) {
  if (a >= kLBase && a < kLBase + kLCount && b >= kVBase && b < kVBase + kVCount)
    return kSBase + ((a - kLBase) * kVCount + (b - kVBase)) * kTCount;
  if (a >= kSBase && a < kSBase + static_cast<char32_t>(kSCount) && (a - kSBase) % kTCount == 0 &&
      b > kTBase && b < kTBase + kTCount)
    return a + (b - kTBase);
  // The composition table is small (~940 pairs); a sorted copy keyed by (a, b) is built once.
  struct Pair { std::uint64_t key; char32_t c; };
  static const std::vector<Pair> pairs = [] {
    std::vector<Pair> v;
    for (const Decomp& d : kDecomp)
      if (!(d.second & 0x80000000u) && d.second)
        v.push_back({(static_cast<std::uint64_t>(d.first) << 32) | d.second, d.cp});
    std::sort(v.begin(), v.end(), [](const Pair& x, const Pair& y) { return x.key < y.key; });
    return v;
  }();
  const std::uint64_t key = (static_cast<std::uint64_t>(a) << 32) | b;
  auto it = std::lower_bound(pairs.begin(), pairs.end(), key, [](const Pair& p, std::uint64_t k) { return p.key < k; });
  return it != pairs.end() && it->key == key ? it->c : 0;
}

}  // namespace detail

/// True when NFC would leave `s` unchanged for certain (the quick check: no character that
/// is not NFC-stable or carries a combining class). Most text passes and skips the work.
inline bool nfc_quick_check(std::string_view s) {
  std::size_t i = 0;
  while (i < s.size()) {
    if (static_cast<unsigned char>(s[i]) < 0xCC) {  // every code point below U+0300 is stable
      ++i;
      if (static_cast<unsigned char>(s[i - 1]) >= 0x80)
        while (i < s.size() && (static_cast<unsigned char>(s[i]) & 0xC0) == 0x80) ++i;
      continue;
    }
    const char32_t c = utf8_next(s, i);
    if (c != kInvalidByte && detail::nfc_maybe_unstable(c)) return false;
  }
  return true;
}

/// Unicode Normalization Form C. Invalid UTF-8 bytes are kept as they are.
inline std::string nfc(std::string_view s) {
  if (nfc_quick_check(s)) return std::string(s);
  std::string out;
  out.reserve(s.size() + 8);
  std::vector<char32_t> buf;  // the decomposed text since the last invalid byte
  auto flush = [&] {
    // Canonical ordering: stable sort of each run of nonzero combining classes.
    for (std::size_t i = 0; i < buf.size();) {
      if (detail::ccc(buf[i]) == 0) {
        ++i;
        continue;
      }
      std::size_t j = i;
      while (j < buf.size() && detail::ccc(buf[j]) != 0) ++j;
      std::stable_sort(buf.begin() + static_cast<std::ptrdiff_t>(i), buf.begin() + static_cast<std::ptrdiff_t>(j),
                       [](char32_t a, char32_t b) { return detail::ccc(a) < detail::ccc(b); });
      i = j;
    }
    // Canonical composition: each character joins the last starter unless blocked.
    std::size_t starter = SIZE_MAX;
    std::size_t w = 0;
    int last_ccc = -1;
    for (std::size_t r = 0; r < buf.size(); ++r) {
      const char32_t c = buf[r];
      const int cc = detail::ccc(c);
      // last_ccc == 0 means the starter itself is the previous character (not blocked).
      if (starter != SIZE_MAX && (last_ccc < cc || last_ccc == 0)) {
        if (char32_t comp = detail::compose_pair(buf[starter], c)) {
          buf[starter] = comp;
          continue;
        }
      }
      if (cc == 0) starter = w;
      last_ccc = cc;
      buf[w++] = c;
    }
    buf.resize(w);
    for (char32_t c : buf) utf8_append(out, c);
    buf.clear();
  };
  std::size_t i = 0;
  while (i < s.size()) {
    const std::size_t at = i;
    const char32_t c = utf8_next(s, i);
    if (c == kInvalidByte) {
      flush();
      out += s[at];
      continue;
    }
    detail::decompose(c, buf);
  }
  flush();
  return out;
}

}  // namespace nn::lm
