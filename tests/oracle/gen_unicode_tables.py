#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Writes include/nn/lm/unicode_data.hpp: the Unicode tables the tokenizer's regex and NFC need.

    pip install unicodedata2==16.0.0
    python3 tests/oracle/gen_unicode_tables.py      # rewrites include/nn/lm/unicode_data.hpp

The tables come from `unicodedata2` 16.0.0 (pip install unicodedata2==16.0.0), the Unicode
version of the Oniguruma inside Hugging Face `tokenizers` 0.23 (checked: of the 26,872 code points
whose letter/number/space class differs between Unicode 14 and 18, tokenizers agrees with 16.0 on
all, with 14.0 on 17,480, with 17.0 on 22,215). The version is written into the header. Without
unicodedata2 16.0.0 the script stops; `--stdlib` uses Python's own `unicodedata` instead (CPython
3.11: Unicode 14.0), which differs from `tokenizers` on characters assigned since.

The NFC tables (kCccRuns, kDecomp, kNfcCheck) keep only characters assigned by Unicode 9.0:
`tokenizers`' NFC normalizer (the unicode-normalization-alignments crate) carries Unicode 9.0
data, so it neither reorders nor composes characters added since (checked: it leaves
U+0D3B, added in 10.0 with class 9, where 16.0 data would move it; it moves U+08D4, added in 9.0).
Normalization data of an assigned character never changes (Unicode's stability policy), so 16.0
data cut to the characters of 9.0 is 9.0 data. The ages come from DerivedAge.txt of Debian's
unicode-data package (apt-get install unicode-data).

Tables (all sorted, searched by binary search):
  kGcRuns        general category runs over U+0000..U+10FFFF: (first << 5) | category
  kCccRuns       canonical combining class runs (nonzero only): first, last, class
  kDecomp        canonical decompositions, one level: code point, first, second (0 if a
                 singleton); bit 31 of `second` marks a composition exclusion (the pair must
                 not recompose under NFC)
  kNfcCheck      ranges of code points whose presence means a string may not be in NFC (NFC
                 quick check not Yes, or nonzero combining class); absent all of them, NFC is
                 the identity, which is the common case and skips the whole algorithm
Hangul syllables are decomposed and composed arithmetically and are left out of the tables.
"""
import os
import sys

UNICODE_VERSION = "16.0.0"
if "--stdlib" in sys.argv:
    import unicodedata
else:
    try:
        import unicodedata2 as unicodedata
    except ImportError:
        sys.exit(f"pip install unicodedata2=={UNICODE_VERSION} (or pass --stdlib)")
    if unicodedata.unidata_version != UNICODE_VERSION:
        sys.exit(f"unicodedata2 has Unicode {unicodedata.unidata_version}; want {UNICODE_VERSION}: "
                 f"pip install unicodedata2=={UNICODE_VERSION}")

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "..", "include", "nn", "lm", "unicode_data.hpp")

# The order is the enum's in unicode.hpp; keep them in sync.
CATS = ["Cn", "Lu", "Ll", "Lt", "Lm", "Lo", "Mn", "Mc", "Me", "Nd", "Nl", "No", "Pc", "Pd", "Ps",
        "Pe", "Pi", "Pf", "Po", "Sm", "Sc", "Sk", "So", "Zs", "Zl", "Zp", "Cc", "Cf", "Cs", "Co"]
MAXCP = 0x110000
SBASE, SCOUNT = 0xAC00, 11172


def is_hangul_syllable(cp):
    return SBASE <= cp < SBASE + SCOUNT


def runs(values):
    """[(first, value)] where value changes."""
    out = []
    prev = None
    for cp, v in enumerate(values):
        if v != prev:
            out.append((cp, v))
            prev = v
    return out


NFC_AGE = (9, 0)
DERIVED_AGE = "/usr/share/unicode/DerivedAge.txt"


def assigned_by(version):
    """Code points assigned in Unicode `version` or before, from DerivedAge.txt."""
    if not os.path.exists(DERIVED_AGE):
        sys.exit(f"{DERIVED_AGE} missing: apt-get install unicode-data")
    old = [False] * MAXCP
    with open(DERIVED_AGE) as f:
        for line in f:
            line = line.split("#")[0].strip()
            if not line:
                continue
            rng, age = [x.strip() for x in line.split(";")]
            if tuple(int(x) for x in age.split(".")) > version:
                continue
            lo, _, hi = rng.partition("..")
            for cp in range(int(lo, 16), int(hi or lo, 16) + 1):
                old[cp] = True
    return old


def main():
    old = assigned_by(NFC_AGE)
    gc = [CATS.index(unicodedata.category(chr(cp))) for cp in range(MAXCP)]
    gc_runs = runs(gc)

    ccc = [unicodedata.combining(chr(cp)) if old[cp] else 0 for cp in range(MAXCP)]
    ccc_runs = runs(ccc)
    ccc_ranges = []
    for i, (first, v) in enumerate(ccc_runs):
        last = (ccc_runs[i + 1][0] if i + 1 < len(ccc_runs) else MAXCP) - 1
        if v:
            ccc_ranges.append((first, last, v))

    decomp = []
    for cp in range(MAXCP):
        if is_hangul_syllable(cp) or not old[cp]:
            continue
        d = unicodedata.decomposition(chr(cp))
        if not d or d.startswith("<"):
            continue
        parts = [int(x, 16) for x in d.split()]
        assert 1 <= len(parts) <= 2, (hex(cp), d)
        second = parts[1] if len(parts) == 2 else 0
        # A two-part decomposition recomposes unless the character is a composition exclusion
        # (then NFC maps it away: NFC(c) != c). Singletons never recompose.
        excluded = len(parts) == 1 or unicodedata.normalize("NFC", chr(cp)) != chr(cp)
        decomp.append((cp, parts[0], second | (0x80000000 if excluded else 0)))

    # Characters that may change under NFC: quick-check No (NFC(c) != c), Maybe (can combine
    # with what precedes: the second half of a primary composite), or combining class != 0.
    unstable = [False] * MAXCP
    for cp in range(MAXCP):
        if 0xD800 <= cp < 0xE000:
            continue
        c = chr(cp)
        if old[cp] and (unicodedata.normalize("NFC", c) != c or ccc[cp]):
            unstable[cp] = True
    for cp, a, b in decomp:
        if not (b & 0x80000000) and b:
            unstable[b & 0x7FFFFFFF] = True
    for cp in list(range(0x1161, 0x1176)) + list(range(0x11A8, 0x11C3)):  # Hangul V and T jamo
        unstable[cp] = True
    nfc_ranges = []
    for first, v in runs(unstable):
        if v:
            nfc_ranges.append(first)
        elif nfc_ranges and len(nfc_ranges) % 2 == 1:
            nfc_ranges.append(first - 1)
    if len(nfc_ranges) % 2 == 1:
        nfc_ranges.append(MAXCP - 1)

    def rows(items, per_line, fmt):
        lines = []
        for i in range(0, len(items), per_line):
            lines.append("    " + ", ".join(fmt(x) for x in items[i:i + per_line]) + ",")
        return "\n".join(lines)

    h = []
    h.append("// SPDX-License-Identifier: MIT OR Apache-2.0")
    h.append("// Unicode tables for the tokenizer (general categories, canonical decompositions and")
    h.append("// combining classes); generated by tests/oracle/gen_unicode_tables.py, do not edit.")
    h.append("#pragma once")
    h.append("")
    h.append("#include <cstdint>")
    h.append("")
    h.append("namespace nn::lm::detail {")
    h.append("")
    h.append(f'inline constexpr const char* kUnicodeVersion = "{unicodedata.unidata_version}";')
    h.append(f'inline constexpr const char* kNfcUnicodeVersion = "{NFC_AGE[0]}.{NFC_AGE[1]}";  // as tokenizers\' NFC')
    h.append("")
    h.append(f"// (first << 5) | category, one entry per run; {len(gc_runs)} runs.")
    h.append(f"inline constexpr std::uint32_t kGcRuns[{len(gc_runs)}] = {{")
    h.append(rows(gc_runs, 8, lambda r: f"0x{(r[0] << 5) | r[1]:x}"))
    h.append("};")
    h.append("")
    h.append("struct CccRange { std::uint32_t first, last; std::uint8_t ccc; };")
    h.append(f"inline constexpr CccRange kCccRuns[{len(ccc_ranges)}] = {{")
    h.append(rows(ccc_ranges, 5, lambda r: f"{{0x{r[0]:x}, 0x{r[1]:x}, {r[2]}}}"))
    h.append("};")
    h.append("")
    h.append("struct Decomp { std::uint32_t cp, first, second; };")
    h.append(f"inline constexpr Decomp kDecomp[{len(decomp)}] = {{")
    h.append(rows(decomp, 4, lambda r: f"{{0x{r[0]:x}, 0x{r[1]:x}, 0x{r[2]:x}}}"))
    h.append("};")
    h.append("")
    h.append("// [first, last] pairs, flattened.")
    h.append(f"inline constexpr std::uint32_t kNfcCheck[{len(nfc_ranges)}] = {{")
    h.append(rows(nfc_ranges, 8, lambda r: f"0x{r:x}"))
    h.append("};")
    h.append("")
    h.append("}  // namespace nn::lm::detail")
    h.append("")
    with open(OUT, "w") as f:
        f.write("\n".join(h))
    print(f"wrote {OUT}: {len(gc_runs)} category runs, {len(ccc_ranges)} ccc ranges, "
          f"{len(decomp)} decompositions, {len(nfc_ranges) // 2} NFC check ranges "
          f"(Unicode {unicodedata.unidata_version})", file=sys.stderr)


if __name__ == "__main__":
    main()
