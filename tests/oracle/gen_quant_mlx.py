#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records MLX's weight quantization (mx.quantize / mx.dequantize / mx.quantized_matmul) and a tiny
nn.quantize'd model, bit for bit, as the golden reference of nn's quantization tests.

    python3 tests/oracle/gen_quant_mlx.py   # (pip mlx[cpu], numpy) rewrites tests/fixtures/quant/
                                            #   mlx.json and mlx_model.safetensors

Everything runs on mx.cpu. Every tensor is {"dtype", "shape", "hex"}: dtype one of float32,
bfloat16, float16, uint32, uint8, int32; hex the raw little-endian bytes, row-major, exactly as MLX
holds them (bfloat16 read through a uint16 view). Inputs are stored after their conversion to their
dtype, i.e. the bits MLX was given.

mlx.json:
  "quantize": [{name, mode, group_size, bits, w, wq, scales, biases (null unless affine),
                dequantized}]
      wq, scales[, biases] = mx.quantize(w, group_size, bits, mode)
      dequantized = mx.dequantize(wq, scales, biases, group_size, bits, mode) (default dtype: the
      scales' dtype for affine, bfloat16 for the fp modes, whatever w's dtype was)
    affine_g{32,64,128}_b{2,3,4,5,6,8}_{float32,bfloat16,float16}: w (2, 384) from numpy normal.
    affine_adv_g{32,64}_b{2,3,4,8}_{float32,bfloat16}: w (13, 64), one adversarial kind per row
      (ADV_AFFINE_ROWS, in order): equal positive, equal negative, zero, outliers, subnormals of
      the dtype (mixed sign), +max/-max alternating (range overflows: scale -inf, dequantized NaN),
      +max among small values, all negative with |min| > |max|, exact rounding midpoints with the
      bias at the top / at the bottom, a tiny range on a large offset, a range under the eps
      1e-7 floor, -max among small values.
    {mxfp4_g32_b4, mxfp8_g32_b8, nvfp4_g16_b4}_{float32,bfloat16,float16}: w (2, 384) normal.
    {mode}_adv_{dtype}: w (13, 64), one kind per row (ADV_FP_ROWS): zero, subnormals, +max/-max,
      +max among small values, E2M1 ties (0.25, 0.75, ..., 5 with amax 6, at scales 1 and 2^-3),
      all-negative E2M1 ties and tiny negatives, values one ulp either side of the E2M1 ties,
      E4M3 ties with amax 448, amax/6 exactly a power of two and one ulp below, one ulp above
      (and 448 one ulp above), 448 and one ulp below, nvfp4 scale ties (amax/6 on E4M3
      midpoints, incl. subnormal ones and one that rounds to a zero scale), E4M3-saturating
      scales (amax/6 >= 464).
    All three fp modes (mxfp4, mxfp8, nvfp4) are supported by mlx 0.32.4 on the CPU (no global
    scale is passed for nvfp4).
  "quantized_matmul": [{name, mode, group_size, bits, transpose, x, wq, scales, biases, out}],
      float32 only, out = mx.quantized_matmul(x, wq, scales, biases, transpose, group_size, bits,
      mode), for affine g64b4, g32b8, g128b3, g64b6, g32b2, mxfp4 g32b4, mxfp8 g32b8 and nvfp4
      g16b4 (the last two from a second generator, seed 0x9A48, after the first six):
    {q}_t:    x (5, 384),    w (64, 384),  transpose=True  -> out (5, 64)
    {q}_nt:   x (5, 64),     w (64, 384),  transpose=False -> out (5, 384) = x @ dequant(w)
    {q}_t3d:  x (2, 3, 384), w (16, 384),  transpose=True  -> out (2, 3, 16)
    {q}_t1, {q}_nt1: one row of x (1, 384) / (1, 64), w (64, 384), for all eight formats (the
      decode shape, where nn streams W instead of packing it)
    (w is quantized along its last axis; only wq/scales/biases are stored.)
  "model": {file, group_size: 64, bits: 4, ids (2, 5) int32, logits (2, 5, 64) float32}
    mx.random.seed(0); embed = nn.Embedding(64, 128), proj = nn.Linear(128, 128);
    forward(ids) = embed.as_linear(proj(embed(ids))); nn.quantize(model, group_size=64, bits=4);
    model.save_weights("mlx_model.safetensors"), which holds:
      embed.biases  (64, 2)   float32        proj.bias    (128,)    float32
      embed.scales  (64, 2)   float32        proj.biases  (128, 2)  float32
      embed.weight  (64, 16)  uint32         proj.scales  (128, 2)  float32
                                             proj.weight  (128, 16) uint32

What MLX 0.32.4 does on the CPU (self_check re-derives it in numpy and compares bits, every case):
  affine (CPU kernel, float32 math): per group w_max, w_min; scale = max((w_max - w_min) /
    (2^b - 1), 1e-7), negated unless |w_min| > |w_max|; edge = w_min if |w_min| > |w_max| else
    w_max; q0 = rint(edge / scale); if q0 != 0: scale = edge / q0, bias = edge, else bias = 0;
    q = clamp(rint((w - bias) / scale), 0, 2^b - 1) with rint half to even, using the float32
    scale/bias; the stored scales/biases are then rounded to w's dtype. So scale < 0 and
    bias = group max whenever |max| >= |min|; a constant group gets scale -1e-7 (in w's dtype),
    bias = the value; +max/-max in one group gives scale -inf, bias 0, q 0, dequantized NaN.
    wq is an LSB-first bit stream of b-bit codes per row (uint32 words; 3/5/6 bits straddle them).
    dequantized = round(round(q * scale) + bias) in the scales' dtype (no fma). NaN comes out as
    0xffc00000 in float32 and 0x7fc0 in bfloat16.
  mxfp4/mxfp8 (an op graph on the CPU): s = amax / 6 (or / 448) rounded to w's dtype; e = the
    smallest integer with 2^e >= s (MLX rounds log2(s) and bumps it by one if 2^e < s), e = 0 when
    s == 0; scale byte = uint8(e + 127), wrapping (float32 subnormal groups give e.g. 251, 255);
    x = w / 2^e in w's dtype; E2M1 code = index of the nearest of the LUT (0, .5, 1, 1.5, 2, 3, 4,
    6, -0, -.5, ..., -6), |x - LUT| in w's dtype, ties to the *lower index* (0.75 -> 0.5, 5 -> 4,
    -0.25 -> +0); E4M3 (mxfp8) round to nearest even, |x| >= 464 (and NaN) saturate to 448.
    dequantized (bfloat16) = LUT[code] * 2^(byte - 127), the power a bfloat16 itself (byte 255:
    inf; byte 0: 2^-127).
  nvfp4: scale byte = E4M3(amax / 6 in w's dtype), saturating at 448; x = w / E4M3 scale in w's
    dtype; E2M1 code as above but |x - LUT| in float32 (float32 inputs near +-max give all-equal
    distances, hence code 0), and a zero scale (x = +-inf or NaN) gives code 0.

mlx_model.safetensors's header is {"__metadata__":null, ...} (a JSON null, not an object).
Sizes: mlx.json ~1.67 MB (the _nt case uses K = 64, not 128, and _t3d a (16, 384) w, for size);
mlx_model.safetensors 16412 bytes.
"""
import json
import os
import struct

import mlx.core as mx
import mlx.nn as nn
import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
OUT_DIR = os.path.normpath(os.path.join(HERE, "..", "fixtures", "quant"))
OUT = os.path.join(OUT_DIR, "mlx.json")
MODEL_FILE = "mlx_model.safetensors"

mx.set_default_device(mx.cpu)
rng = np.random.default_rng(0x9A47)

DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
NAMES = {
    mx.float32: "float32",
    mx.bfloat16: "bfloat16",
    mx.float16: "float16",
    mx.uint32: "uint32",
    mx.uint8: "uint8",
    mx.int32: "int32",
}
FP_MODES = [("mxfp4", 32, 4), ("mxfp8", 32, 8), ("nvfp4", 16, 4)]


# ---- tensors ------------------------------------------------------------------------------------


def tensor(a):
    """{"dtype", "shape", "hex"} of an mx.array, raw bytes exactly as MLX holds them."""
    mx.eval(a)
    raw = np.array(a.view(mx.uint16)) if a.dtype == mx.bfloat16 else np.array(a)
    assert raw.dtype.itemsize == a.itemsize, (a.dtype, raw.dtype)
    raw = np.ascontiguousarray(raw).astype(raw.dtype.newbyteorder("<"), copy=False)
    return {"dtype": NAMES[a.dtype], "shape": list(a.shape), "hex": raw.tobytes().hex()}


def to_mx(values, dt):
    """float32 numpy values -> mx.array of dtype dt (MLX's own conversion, round to nearest even)."""
    return mx.array(np.asarray(values, dtype=np.float32)).astype(dt)


def f32(bits):
    return struct.unpack("<f", struct.pack("<I", bits))[0]


# largest finite value of each dtype, as a float32 (exact in the dtype)
DMAX = {mx.float32: f32(0x7F7FFFFF), mx.bfloat16: f32(0x7F7F0000), mx.float16: 65504.0}
# smallest positive subnormal of each dtype
DSUB = {mx.float32: 2.0**-149, mx.bfloat16: 2.0**-133, mx.float16: 2.0**-24}
# number of subnormal steps below the smallest normal
DSUB_STEPS = {mx.float32: 1 << 23, mx.bfloat16: 1 << 7, mx.float16: 1 << 10}


def next_up(x, dt):
    """The next representable value of dt above x (x representable, positive)."""
    a = to_mx([x], dt)
    if dt == mx.float32:
        return float(np.nextafter(np.float32(x), np.float32(np.inf)))
    u = np.array(a.view(mx.uint16)).astype(np.uint16) + 1
    return float(np.array(mx.array(u).view(dt).astype(mx.float32))[0])


def next_down(x, dt):
    a = to_mx([x], dt)
    if dt == mx.float32:
        return float(np.nextafter(np.float32(x), np.float32(0)))
    u = np.array(a.view(mx.uint16)).astype(np.uint16) - 1
    return float(np.array(mx.array(u).view(dt).astype(mx.float32))[0])


def subnormals(n, dt):
    k = rng.integers(1, DSUB_STEPS[dt], size=n).astype(np.float64)
    sign = np.where(rng.integers(0, 2, size=n) == 0, -1.0, 1.0)
    return (sign * k * DSUB[dt]).astype(np.float32)  # exact: k * 2^-149 .. in float32


# ---- affine adversarial rows (width 64: every row fills whole groups of 32 and of 64) -----------

ADV_AFFINE_ROWS = [
    "equal_pos",
    "equal_neg",
    "zero",
    "outlier",
    "subnormal",
    "pm_max",
    "max_small",
    "neg_wide",
    "mid_top",
    "mid_bottom",
    "offset",
    "tiny_range",
    "neg_max_small",
]


def affine_adv_rows(dt, bits):
    W = 64
    n = (1 << bits) - 1
    mx_ = DMAX[dt]
    rows = []
    for kind in ADV_AFFINE_ROWS:
        if kind == "equal_pos":
            r = np.full(W, 0.3)
        elif kind == "equal_neg":
            r = np.full(W, -0.3)
        elif kind == "zero":
            r = np.zeros(W)
        elif kind == "outlier":
            r = rng.normal(0, 0.01, W)
            for b in range(W // 32):
                r[b * 32 + 7 + 5 * b] = 40.0 if b % 2 == 0 else -40.0
        elif kind == "subnormal":
            r = subnormals(W, dt)
        elif kind == "pm_max":
            r = np.array([mx_ if i % 2 == 0 else -mx_ for i in range(W)])
        elif kind == "max_small":
            r = rng.normal(0, 1.0, W)
            r[3::16] = mx_
        elif kind == "neg_max_small":
            r = rng.normal(0, 1.0, W)
            r[5::16] = -mx_
        elif kind == "neg_wide":
            r = rng.uniform(-3.0, -0.5, W)
        elif kind in ("mid_top", "mid_bottom"):
            # every 32-block holds 0 and n (scale -1, bias n) or -n and 0 (scale 1, bias -n), and
            # values on rounding midpoints: +-(k + 0.5), k < 64 so they are exact in bfloat16
            r = np.zeros(W)
            for b in range(W // 32):
                mids = [((7 * j + b) % min(n, 64)) + 0.5 for j in range(30)]
                blk = [0.0, float(n)] + mids if kind == "mid_top" else [-float(n), 0.0] + [-m for m in mids]
                r[b * 32 : (b + 1) * 32] = blk
        elif kind == "offset":
            r = 1000.0 + rng.uniform(0, 1e-3, W)
        elif kind == "tiny_range":
            r = rng.uniform(0, 1e-6, W)
        rows.append(np.asarray(r, dtype=np.float32))
    return to_mx(np.stack(rows), dt)


# ---- fp adversarial rows (width 64: two groups of 32, four of 16) -------------------------------

ADV_FP_ROWS = [
    "zero",
    "subnormal",
    "pm_max",
    "max_small",
    "e2m1_ties",
    "e2m1_ties_neg",
    "e2m1_near_ties",
    "e4m3_ties",
    "amax_pow2",
    "amax_above",
    "amax_448",
    "nv_scale_ties",
    "scale_saturate",
]

E2M1_TIES = [0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0]


def fp_adv_rows(dt):
    W = 64
    mx_ = DMAX[dt]
    rows = []

    def fill(amax, m=16):
        """m values: amax first, then uniform in (-amax, amax)."""
        return np.concatenate([[amax], rng.uniform(-amax, amax, m - 1)])

    for kind in ADV_FP_ROWS:
        if kind == "zero":
            r = np.zeros(W)
        elif kind == "subnormal":
            r = subnormals(W, dt)
        elif kind == "pm_max":
            r = np.array([mx_ if i % 2 == 0 else -mx_ for i in range(W)])
        elif kind == "max_small":
            r = rng.normal(0, 1.0, W)
            r[9::16] = mx_
        elif kind == "e2m1_ties":
            blk = [6.0] + E2M1_TIES + [-t for t in E2M1_TIES] + [-6.0]  # 16 values
            r = np.concatenate([blk, blk[::-1], np.array(blk) / 8, np.array(blk[::-1]) / 8])
        elif kind == "e2m1_ties_neg":
            blk = [-6.0] + [-t for t in E2M1_TIES] + [-0.1, -0.2, -0.0, -1e-3, -0.26, -0.5, -1.0, -4.0]
            r = np.concatenate([blk, blk[::-1], np.array(blk) * 4, np.array(blk[::-1]) * 4])
        elif kind == "e2m1_near_ties":
            up = [next_up(t, dt) for t in E2M1_TIES]
            dn = [next_down(t, dt) for t in E2M1_TIES]
            blk = [6.0] + up + [-d for d in dn] + [-6.0]
            blk2 = [6.0] + dn + [-u for u in up] + [-6.0]
            r = np.concatenate([blk, blk2, blk2[::-1], blk[::-1]])
        elif kind == "e4m3_ties":
            # amax 448: mx scale 1; E4M3 midpoints (normal, subnormal 2^-10, 3*2^-10, large)
            ties = [1.0625, 1.1875, 17.0, 19.0, 2.0**-10, 3 * 2.0**-10, 136.0, 152.0, 0.5 + 2.0**-5, 7.5 + 0.25]
            pos = [448.0] + ties + [1.0, 2.0, 3.0, 0.0, 2.0**-9]
            neg = [-448.0] + [-t for t in ties] + [-1.0, -2.0, -3.0, -0.0, -(2.0**-9)]
            r = np.concatenate([pos, neg, pos[::-1], neg[::-1]])
        elif kind == "amax_pow2":
            # group 0 (and nvfp4 blocks 0, 1): amax = 6 * 2^0 exactly; group 1: one ulp below 6*2^-2
            a1 = next_down(1.5, dt)
            r = np.concatenate([fill(6.0), fill(6.0), fill(a1), fill(a1)])
        elif kind == "amax_above":
            a0 = next_up(6.0, dt)
            a1 = next_up(448.0, dt)
            r = np.concatenate([fill(a0), fill(a0), fill(a1), fill(a1)])
        elif kind == "amax_448":
            a1 = next_down(448.0 * 4, dt)
            r = np.concatenate([fill(448.0), fill(448.0), fill(a1), fill(a1)])
        elif kind == "nv_scale_ties":
            # nvfp4 scale = E4M3(amax/6): 1.0625 and 1.1875 are ties, 1.5*2^-9 and 2^-10 are
            # subnormal ties (the last rounds to a zero scale)
            r = np.concatenate([fill(6 * 1.0625), fill(6 * 1.1875), fill(6 * 1.5 * 2.0**-9), fill(6 * 2.0**-10)])
        elif kind == "scale_saturate":
            # amax/6 = 464 (E4M3 saturation threshold), 450, 1e4/6, and 30000/6
            r = np.concatenate([fill(6 * 464.0), fill(6 * 450.0), fill(1e4), fill(3e4)])
        rows.append(np.asarray(r, dtype=np.float32))
    return to_mx(np.stack(rows), dt)


# ---- cases --------------------------------------------------------------------------------------


def record(name, mode, g, b, **fields):
    """A case: its format, then each field in order, arrays as tensor() (None stays null)."""
    out = {"name": name, "mode": mode, "group_size": g, "bits": b}
    for k, v in fields.items():
        out[k] = tensor(v) if isinstance(v, mx.array) else v
    return out


def quant_case(name, w, mode, g, b):
    out = mx.quantize(w, group_size=g, bits=b, mode=mode)
    if mode == "affine":
        wq, scales, biases = out
    else:
        assert len(out) == 2, (mode, len(out))
        (wq, scales), biases = out, None
    deq = mx.dequantize(wq, scales, biases, group_size=g, bits=b, mode=mode)
    mx.eval(wq, scales, deq)
    return record(name, mode, g, b, w=w, wq=wq, scales=scales, biases=biases, dequantized=deq)


def quantize_cases():
    cases = []
    base = rng.normal(0.0, 1.0, size=(2, 384)).astype(np.float32)
    for dname, dt in DTYPES.items():
        w = to_mx(base, dt)
        for g in (32, 64, 128):
            for b in (2, 3, 4, 5, 6, 8):
                cases.append(quant_case(f"affine_g{g}_b{b}_{dname}", w, "affine", g, b))
    for dname in ("float32", "bfloat16"):
        dt = DTYPES[dname]
        for g in (32, 64):
            for b in (2, 3, 4, 8):
                w = affine_adv_rows(dt, b)
                cases.append(quant_case(f"affine_adv_g{g}_b{b}_{dname}", w, "affine", g, b))
    fp_base = rng.normal(0.0, 1.0, size=(2, 384)).astype(np.float32)
    for mode, g, b in FP_MODES:
        for dname, dt in DTYPES.items():
            cases.append(quant_case(f"{mode}_g{g}_b{b}_{dname}", to_mx(fp_base, dt), mode, g, b))
        for dname, dt in DTYPES.items():
            cases.append(quant_case(f"{mode}_adv_{dname}", fp_adv_rows(dt), mode, g, b))
    return cases


QMM_QUANTS = [("affine", 64, 4), ("affine", 32, 8), ("affine", 128, 3), ("affine", 64, 6), ("affine", 32, 2), ("mxfp4", 32, 4)]
QMM_QUANTS_MORE = [("mxfp8", 32, 8), ("nvfp4", 16, 4)]


def qmm_case(name, x, w, mode, g, b, transpose):
    q = mx.quantize(w, group_size=g, bits=b, mode=mode)
    wq, scales = q[0], q[1]
    biases = q[2] if mode == "affine" else None
    out = mx.quantized_matmul(x, wq, scales, biases, transpose=transpose, group_size=g, bits=b, mode=mode)
    mx.eval(out)
    return record(name, mode, g, b, transpose=transpose, x=x, wq=wq, scales=scales, biases=biases, out=out)


def qmm_cases():
    cases = []
    normal = lambda *s: mx.array(rng.normal(0.0, 1.0, size=s).astype(np.float32))  # noqa: E731
    for mode, g, b in QMM_QUANTS:
        q = f"{mode}_g{g}_b{b}"
        x_t, w_t = normal(5, 384), normal(64, 384)
        x_nt, w_nt = normal(5, 64), normal(64, 384)  # K = 64 (not 128) keeps the JSON near 1.5 MB
        x_3d, w_3d = normal(2, 3, 384), normal(16, 384)
        cases.append(qmm_case(f"{q}_t", x_t, w_t, mode, g, b, True))
        cases.append(qmm_case(f"{q}_nt", x_nt, w_nt, mode, g, b, False))
        cases.append(qmm_case(f"{q}_t3d", x_3d, w_3d, mode, g, b, True))
    # Added later with their own generator, so that the cases above and the model keep their bytes:
    # the other two fp modes in the same three forms, and one row of x (a decode step: nn streams W
    # instead of packing it) in every format.
    rng2 = np.random.default_rng(0x9A48)
    normal2 = lambda *s: mx.array(rng2.normal(0.0, 1.0, size=s).astype(np.float32))  # noqa: E731
    for mode, g, b in QMM_QUANTS_MORE:
        q = f"{mode}_g{g}_b{b}"
        x_t, w_t = normal2(5, 384), normal2(64, 384)
        x_nt, w_nt = normal2(5, 64), normal2(64, 384)
        x_3d, w_3d = normal2(2, 3, 384), normal2(16, 384)
        cases.append(qmm_case(f"{q}_t", x_t, w_t, mode, g, b, True))
        cases.append(qmm_case(f"{q}_nt", x_nt, w_nt, mode, g, b, False))
        cases.append(qmm_case(f"{q}_t3d", x_3d, w_3d, mode, g, b, True))
    for mode, g, b in QMM_QUANTS + QMM_QUANTS_MORE:
        q = f"{mode}_g{g}_b{b}"
        cases.append(qmm_case(f"{q}_t1", normal2(1, 384), normal2(64, 384), mode, g, b, True))
        cases.append(qmm_case(f"{q}_nt1", normal2(1, 64), normal2(64, 384), mode, g, b, False))
    return cases


class TinyModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(64, 128)
        self.proj = nn.Linear(128, 128)

    def __call__(self, ids):
        return self.embed.as_linear(self.proj(self.embed(ids)))


def model_case():
    mx.random.seed(0)
    model = TinyModel()
    mx.eval(model.parameters())
    nn.quantize(model, group_size=64, bits=4)
    assert isinstance(model.embed, nn.QuantizedEmbedding) and isinstance(model.proj, nn.QuantizedLinear)
    path = os.path.join(OUT_DIR, MODEL_FILE)
    model.save_weights(path)
    ids = mx.array([[0, 5, 17, 63, 42], [8, 8, 31, 1, 60]], dtype=mx.int32)
    logits = model(ids)
    mx.eval(logits)
    print("model weights", MODEL_FILE)
    for k, v in sorted(mx.load(path).items()):
        print(f"  {k:14s} {str(tuple(v.shape)):10s} {NAMES[v.dtype]}")
    return {"file": MODEL_FILE, "group_size": 64, "bits": 4, "ids": tensor(ids), "logits": tensor(logits)}


# ---- self check (independent numpy re-derivation) -----------------------------------------------


def decode(t):
    raw = bytes.fromhex(t["hex"])
    if t["dtype"] == "bfloat16":
        u = np.frombuffer(raw, "<u2").astype(np.uint32) << 16
        return u.view(np.float32).reshape(t["shape"])
    if t["dtype"] == "float16":  # widened to float32 (exact)
        return np.frombuffer(raw, "<f2").astype(np.float32).reshape(t["shape"])
    return np.frombuffer(raw, {"float32": "<f4", "uint32": "<u4", "uint8": "u1", "int32": "<i4"}[t["dtype"]]).reshape(t["shape"])


def round_to(x, dname):
    """float32/float64 values -> nearest dname value (ties to even), as float32 (NaN/inf kept)."""
    with np.errstate(over="ignore"):
        x = np.asarray(x, dtype=np.float32)
    if dname == "float32":
        return x
    if dname == "float16":
        return x.astype(np.float16).astype(np.float32)
    u = x.view(np.uint32).astype(np.uint64)
    r = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) << 16
    r = np.where(np.isnan(x), 0x7FC00000, r).astype(np.uint32)  # MLX's bfloat16 NaN is 0x7fc0
    return r.view(np.float32)


def codes(t, bits, n):
    """The b-bit codes of wq (an LSB-first bit stream per row)."""
    raw = np.frombuffer(bytes.fromhex(t["hex"]), np.uint8).reshape(t["shape"][0], -1)
    bitsarr = np.unpackbits(raw, axis=1, bitorder="little").reshape(raw.shape[0], n, bits)
    return (bitsarr.astype(np.uint32) << np.arange(bits, dtype=np.uint32)).sum(-1).astype(np.uint32)


def same_bits(a, b):
    a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
    return a.shape == b.shape and np.array_equal(a.view(np.uint32), b.view(np.uint32))


E2M1 = np.array([0, 0.5, 1, 1.5, 2, 3, 4, 6, -0.0, -0.5, -1, -1.5, -2, -3, -4, -6], np.float32)


def check_affine(c):
    g, b = c["group_size"], c["bits"]
    w = decode(c["w"])
    rows, n = w.shape
    dn = c["w"]["dtype"]
    s, bias = decode(c["scales"]), decode(c["biases"])
    q = codes(c["wq"], b, n).astype(np.float32)
    # dequantize: q*s then +bias, each rounded to the dtype
    se, be = np.repeat(s, g, axis=1), np.repeat(bias, g, axis=1)
    with np.errstate(invalid="ignore", over="ignore"):
        deq = round_to(round_to(q * se, dn) + be, dn)
    assert same_bits(deq, decode(c["dequantized"])), c["name"]
    # quantize: MLX's float32 recipe
    nb = np.float32((1 << b) - 1)
    wg = w.reshape(rows, n // g, g)
    with np.errstate(invalid="ignore", over="ignore", divide="ignore"):
        wmax, wmin = wg.max(-1), wg.min(-1)
        mask = np.abs(wmin) > np.abs(wmax)
        sc = np.maximum((wmax - wmin) / nb, np.float32(1e-7)).astype(np.float32)
        sc = np.where(mask, sc, -sc)
        edge = np.where(mask, wmin, wmax)
        q0 = np.rint(edge / sc)
        bi = np.where(q0 != 0, edge, np.float32(0)).astype(np.float32)
        sc = np.where(q0 != 0, edge / q0, sc).astype(np.float32)
        qq = np.clip(np.rint((wg - bi[..., None]) / sc[..., None]), 0, nb)
    assert np.array_equal(np.nan_to_num(qq.reshape(rows, n), nan=0), q), c["name"]
    assert same_bits(round_to(sc, dn), s) and same_bits(round_to(bi, dn), bias), c["name"]


def check_mx(c):
    """mxfp4/mxfp8 scale bytes: e = min{e : 2^e >= round_dtype(amax / maxval)}, uint8(e + 127) wrapping."""
    g, b = c["group_size"], c["bits"]
    dn = c["w"]["dtype"]
    w = decode(c["w"]).astype(np.float64)
    rows, n = w.shape
    amax = np.abs(w.reshape(rows, n // g, g)).max(-1)
    sv = round_to(amax / (6.0 if b == 4 else 448.0), dn).astype(np.float64)
    with np.errstate(divide="ignore"):
        e = np.ceil(np.log2(sv))
    e = np.where(2.0**e < sv, e + 1, e)  # guard log2 rounding
    e = np.where(2.0 ** (e - 1) >= sv, e - 1, e)
    e = np.where(sv == 0, 0, e).astype(np.int64)
    expect = ((e + 127) % 256).astype(np.uint8)
    got = decode(c["scales"])
    assert np.array_equal(expect, got), (c["name"], expect, got)
    if b == 4:
        # codes: nearest E2M1 entry of round_dtype(w / 2^e), ties to the lower LUT index
        x = round_to(w / np.repeat(2.0**e, g, axis=1), dn).astype(np.float64)
        d = round_to(np.abs(x[..., None] - E2M1.astype(np.float64)), dn)
        expect_codes = np.argmin(d, axis=-1)
        assert np.array_equal(expect_codes, codes(c["wq"], 4, n)), c["name"]
        # dequantize (bfloat16): LUT[code] * 2^(byte - 127)
        # (the power of two is a bfloat16 itself: byte 255 gives inf, and 0 * inf a NaN)
        with np.errstate(over="ignore", invalid="ignore"):
            p2 = round_to(2.0 ** (got.astype(np.float64) - 127), "bfloat16")
            deq = round_to(E2M1[codes(c["wq"], 4, n)] * np.repeat(p2, g, axis=1), "bfloat16")
        assert same_bits(deq, decode(c["dequantized"])), c["name"]
    else:
        # codes: E4M3 of round_dtype(w / 2^e), round to nearest even, saturating at 448
        x = round_to(w / np.repeat(2.0**e, g, axis=1), dn)
        assert np.array_equal(to_e4m3(x), codes(c["wq"], 8, n)), c["name"]


# the 127 non-negative finite E4M3 values, by code
E4M3 = np.array([(m / 8) * 2.0**-6 if (b >> 3) == 0 else (1 + m / 8) * 2.0 ** ((b >> 3) - 7) for b in range(127) for m in [b & 7]])


def to_e4m3(x):
    """E4M3 codes of float32 values: nearest, ties to the even code, |x| >= 464 (and NaN) -> 448."""
    x = np.asarray(x, np.float32)
    sign = np.where(np.signbit(x), 0x80, 0)
    a = np.abs(x.astype(np.float64))
    d = np.abs(a[..., None] - E4M3)
    best = d.min(-1, keepdims=True)
    ties = d == best
    code = np.where(ties & (np.arange(127) % 2 == 0), np.arange(127), 1000).min(-1)
    code = np.where(ties.sum(-1) == 1, np.argmin(d, -1), code)
    code = np.where(np.isnan(x) | (a >= 464), 126, code)
    return (code | sign).astype(np.uint32)


def check_nv(c):
    """nvfp4: scale byte = E4M3(round_dtype(amax / 6)); codes: nearest E2M1 entry of
    round_dtype(w / scale), differences in float32, ties to the lower LUT index (x / 0 -> 0)."""
    g = c["group_size"]
    dn = c["w"]["dtype"]
    w = decode(c["w"]).astype(np.float64)
    rows, n = w.shape
    amax = np.abs(w.reshape(rows, n // g, g)).max(-1)
    sc = to_e4m3(round_to(amax / 6.0, dn))
    assert np.array_equal(sc, decode(c["scales"])), c["name"]
    sv = round_to(E4M3[sc & 0x7F], dn).astype(np.float64)
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        x = round_to(w / np.repeat(sv, g, axis=1), dn).astype(np.float64)
        d = np.abs(x[..., None] - E2M1.astype(np.float64))
        d = np.where(np.isnan(d), np.inf, round_to(d, "float32"))
    assert np.array_equal(np.argmin(d, axis=-1), codes(c["wq"], 4, n)), c["name"]


def self_check(fixture):
    n_aff = n_fp = 0
    for c in fixture["quantize"]:
        if c["mode"] == "affine":
            check_affine(c)
            n_aff += 1
        elif c["mode"] in ("mxfp4", "mxfp8"):
            check_mx(c)
            n_fp += 1
        elif c["mode"] == "nvfp4":
            check_nv(c)
            n_fp += 1
    return n_aff, n_fp


def main():
    os.makedirs(OUT_DIR, exist_ok=True)
    fixture = {
        "generator": "tests/oracle/gen_quant_mlx.py",
        "mlx_version": mx.__version__,
        "device": str(mx.default_device()),
        "quantize": quantize_cases(),
        "quantized_matmul": qmm_cases(),
        "model": model_case(),
    }
    n_aff, n_fp = self_check(fixture)
    text = json.dumps(fixture, separators=(",", ":"))
    json.loads(text)
    with open(OUT, "w") as f:
        f.write(text + "\n")
    modes = {}
    for c in fixture["quantize"]:
        modes[c["mode"]] = modes.get(c["mode"], 0) + 1
    size_model = os.path.getsize(os.path.join(OUT_DIR, MODEL_FILE))
    print(
        f"wrote {OUT} ({len(text) + 1} bytes) and {MODEL_FILE} ({size_model} bytes), mlx {mx.__version__}: "
        f"{len(fixture['quantize'])} quantize cases {modes}, {len(fixture['quantized_matmul'])} quantized_matmul "
        f"cases, 1 model; self-check passed ({n_aff} affine quantize+dequantize, {n_fp} fp scale/code cases)"
    )


if __name__ == "__main__":
    main()
