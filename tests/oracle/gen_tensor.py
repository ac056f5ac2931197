#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records PyTorch's (and NumPy's) bfloat16 / float16 <-> float32 conversions for nn's tensor test.

    /usr/bin/python3 tests/oracle/gen_tensor.py   # rewrites tests/fixtures/core/halfs.json

The C++ test (tests/core/tensor.test.cpp) generates the very same inputs itself, so the fixture
holds only the expected outputs, compactly:
  * half -> float32: all 65536 bf16 and all 65536 f16 bit patterns;
  * float32 -> half: the float32 inputs of `f32_inputs()` below (~690k values): every upper 16-bit
    pattern with the low halves 0000 0001 7fff 8000 8001 ffff (every bf16 rounding case: below,
    at and above a tie, with both parities, over every exponent incl. subnormals, inf and NaN);
    every midpoint between adjacent float16 values and its two float32 neighbours (every f16
    tie, subnormal ones and the 65520 overflow threshold included); 100k xorshift32 patterns;
    and a list of specials (+-0, +-inf, NaNs, max finite, smallest normal/subnormal, ...).
Outputs are checked by block: the sum (mod 2^64) of splitmix64(value << 32 | index) over each run
of 4096 consecutive outputs. A NaN output counts as one canonical token (PyTorch writes 0x7fc0
for every bf16 NaN, NumPy keeps payloads; only NaN-ness is IEEE's rule), and the C++ test checks
its own NaNs separately (quiet, sign kept). `spot_*` list ~600 inputs with their outputs spelled
out, so a failure prints a readable value, and `f64_to_half` records how PyTorch rounds float64
to the halfs (once through float32).
"""
import json
import math
import os

import numpy as np
import torch

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "core", "halfs.json")
BLOCK = 4096
M64 = (1 << 64) - 1
NAN16, NAN32 = 0xFFFF, 0xFFFFFFFF  # canonical NaN tokens in the block hashes

SPECIALS = [
    0x00000000, 0x80000000,  # +-0
    0x7F800000, 0xFF800000,  # +-inf
    0x7FC00000, 0xFFC00000, 0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FFFFFFF, 0x7FC00001,  # NaNs (quiet, signalling)
    0x7F7FFFFF, 0xFF7FFFFF,  # max finite
    0x7F7F8000, 0x7F7F7FFF,  # bf16: rounds to inf at the tie above max bf16 (0x7f7f)
    0x00800000, 0x80800000, 0x007FFFFF, 0x00000001, 0x80000001, 0x00008000, 0x00018000,  # f32 normal/subnormal edges
    0x3F800000, 0x3F808000, 0x3F818000, 0x3F80FFFF, 0x3F810000, 0xBF808000,  # 1.0 and bf16 ties at 1
    0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0xC77FF000,  # 65504, 65520 (f16 overflow tie)
    0x38800000, 0x387FFFFF, 0x387FE000, 0x387FF000,  # 2^-14 (smallest normal f16) and just below
    0x33800000, 0x33000000, 0x33000001, 0x32FFFFFF, 0x32800000, 0x33C00000, 0x34200000,  # 2^-24, 2^-25 ties
    0xB3000000, 0xB3000001,  # negative subnormal tie
    0x3F802000, 0x3F801000, 0x3F803000, 0x3F801001,  # f16 ties at 1 (1 + 2^-11 etc.)
]


def xorshift32(n, state=0x9E3779B9):
    out = np.empty(n, dtype=np.uint32)
    x = state
    for i in range(n):
        x ^= (x << 13) & 0xFFFFFFFF
        x ^= x >> 17
        x ^= (x << 5) & 0xFFFFFFFF
        out[i] = x
    return out


def f16_midpoints():
    """Bits of each midpoint between adjacent finite f16 values (and 65504..65536), with its
    float32 neighbours below and above: m-1, m, m+1 for sign 0 then sign 1."""
    out = []
    for sign in (0, 0x80000000):
        for h in range(0x7C00):
            e, man = h >> 10, h & 0x3FF
            sig, ex = (man, -25) if e == 0 else (1024 + man, e - 26)
            mid = math.ldexp(2 * sig + 1, ex)
            m = int(np.array([mid], dtype=np.float32).view(np.uint32)[0])
            assert float(np.array([m], dtype=np.uint32).view(np.float32)[0]) == mid
            out += [sign | (m - 1), sign | m, sign | (m + 1)]
    return np.array(out, dtype=np.uint32)


def f32_inputs():
    upper = np.arange(65536, dtype=np.uint32) << 16
    lows = np.array([0x0000, 0x0001, 0x7FFF, 0x8000, 0x8001, 0xFFFF], dtype=np.uint32)
    part_a = (upper[:, None] | lows[None, :]).ravel()
    return np.concatenate([part_a, f16_midpoints(), xorshift32(100000), np.array(SPECIALS, dtype=np.uint32)])


def block_hashes(values, nan_mask):
    v = values.astype(np.uint64)
    v[nan_mask] = NAN16 if values.dtype == np.uint16 else NAN32
    idx = np.arange(len(v), dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (v << np.uint64(32)) | idx
        z = z + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z = z ^ (z >> np.uint64(31))
    hashes = []
    for b in range(0, len(z), BLOCK):
        hashes.append("%016x" % (int(z[b:b + BLOCK].sum(dtype=np.uint64)) & M64))
    return hashes


def is_nan16_bf16(bits):
    return ((bits & 0x7F80) == 0x7F80) & ((bits & 0x7F) != 0)


def is_nan16_f16(bits):
    return ((bits & 0x7C00) == 0x7C00) & ((bits & 0x3FF) != 0)


def is_nan32(bits):
    return ((bits & 0x7F800000) == 0x7F800000) & ((bits & 0x7FFFFF) != 0)


def main():
    # ---- half -> float32, exhaustive
    pats = np.arange(65536, dtype=np.uint32).astype(np.uint16)
    bf_t = torch.from_numpy(pats.view(np.int16).copy()).view(torch.bfloat16).float().numpy().view(np.uint32)
    f16_np = pats.view(np.float16).astype(np.float32).view(np.uint32)
    f16_t = torch.from_numpy(pats.view(np.int16).copy()).view(torch.float16).float().numpy().view(np.uint32)
    ok = ~is_nan32(f16_np)
    assert np.array_equal(f16_np[ok], f16_t[ok]) and np.array_equal(is_nan32(f16_np), is_nan32(f16_t)), \
        "NumPy and PyTorch disagree on f16 -> f32"

    # ---- float32 -> half
    x = f32_inputs()
    xt = torch.from_numpy(x.view(np.float32).copy())
    to_bf = xt.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    to_f16 = xt.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    with np.errstate(over="ignore"):  # overflow to inf is one of the cases
        to_f16_np = x.view(np.float32).astype(np.float16).view(np.uint16)
    ok = ~is_nan16_f16(to_f16)
    assert np.array_equal(to_f16[ok], to_f16_np[ok]), "NumPy and PyTorch disagree on f32 -> f16"
    assert np.array_equal(is_nan16_f16(to_f16), is_nan16_f16(to_f16_np))

    # ---- spot values, spelled out
    rng = np.random.default_rng(7)
    n_special = len(SPECIALS)
    spot_idx = sorted(set(list(range(len(x) - n_special, len(x)))
                          + list(rng.choice(len(x) - n_special, 300, replace=False))))
    spot = [["%08x" % x[i], "%04x" % to_bf[i], "%04x" % to_f16[i]] for i in spot_idx]
    hpats = sorted(set(list(range(0, 65536, 256)) + [0x0000, 0x8000, 0x0001, 0x03FF, 0x0400, 0x7BFF, 0x7C00, 0xFC00,
                                                     0x7C01, 0x7E00, 0xFE00, 0x0080, 0x007F, 0x7F7F, 0x7F80, 0x7F81,
                                                     0x7FC0, 0xFF80, 0xFFFF, 0x3C00, 0x3F80, 0x8001]))
    spot_h = [["%04x" % h, "%08x" % bf_t[h], "%08x" % f16_np[h]] for h in hpats]

    # ---- float64 -> half, PyTorch rounds once through float32 (double rounding)
    d = np.array([1 + 2.0**-8 + 2.0**-30, 1 + 2.0**-8 - 2.0**-30, 1 + 2.0**-11 + 2.0**-40, 1 + 2.0**-11 - 2.0**-40,
                  65519.99999999, 65520.0, 3.0e38, 3.5e38, 1e-40, 2.0**-25 + 2.0**-60, -(2.0**-25) - 2.0**-60,
                  0.1, -0.3, 1 / 3, math.pi, 1e10, -1e-10, 0.0, -0.0], dtype=np.float64)
    dt = torch.from_numpy(d)
    d_bf = dt.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)
    d_f16 = dt.to(torch.float16).view(torch.int16).numpy().view(np.uint16)
    f64_to_half = [[repr(float(v)), "%04x" % b, "%04x" % h] for v, b, h in zip(d, d_bf, d_f16)]

    doc = {
        "generator": "tests/oracle/gen_tensor.py",
        "torch": torch.__version__,
        "numpy": np.__version__,
        "block": BLOCK,
        "hash": "per block: sum mod 2^64 of splitmix64(value << 32 | index); NaN outputs -> ffff / ffffffff",
        "f32_inputs": {"count": int(len(x)), "hashes": block_hashes(x, np.zeros(len(x), dtype=bool))},
        "bf16_to_f32": block_hashes(bf_t, is_nan32(bf_t)),
        "f16_to_f32": block_hashes(f16_np, is_nan32(f16_np)),
        "f32_to_bf16": block_hashes(to_bf, is_nan16_bf16(to_bf)),
        "f32_to_f16": block_hashes(to_f16, is_nan16_f16(to_f16)),
        "spot_f32": spot,
        "spot_half": spot_h,
        "f64_to_half": f64_to_half,
    }
    os.makedirs(os.path.dirname(OUT), exist_ok=True)
    with open(OUT, "w") as f:
        f.write("{\n")
        items = list(doc.items())
        for k, (key, val) in enumerate(items):
            f.write(json.dumps(key) + ": " + json.dumps(val) + ("," if k + 1 < len(items) else "") + "\n")
        f.write("}\n")
    print(f"{OUT}: {len(x)} float32 inputs, {len(spot)} + {len(spot_h)} spot values")


if __name__ == "__main__":
    main()
