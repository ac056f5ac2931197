#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records the bytes GGUF's quantizers make from float32 rows, the golden reference of nn's GGUF
quantizers (tests/lm/gguf_export.test.cpp, include/nn/lm/gguf_quantize.hpp).

    pip install gguf numpy llama-cpp-python   # llama-cpp-python builds llama.cpp (ggml) from source
    python3 tests/oracle/gen_gguf_quantize.py # rewrites tests/fixtures/lm/gguf_quantize.gguf

The file holds
  "x"        an F32 (ROWS, 512) matrix of inputs: normal rows of scales 1e-4..10, rows with a
             zero block, a constant block, one huge element, tiny (subnormal-range) values, ties of
             magnitude between signs, and ggml's own test-quantize-fns data 0.1 + 2 cos(i);
  "<T>"      for T in F16 BF16 Q8_0 Q4_0 Q4_1 Q5_0 Q5_1: gguf.quants.quantize(x, T), gguf-py's bytes;
  "<T>"      for T in Q4_K Q5_K Q6_K: ggml's reference quantizer (quantize_row_<t>_ref, reached
             through ggml_quantize_chunk without an importance matrix, as llama-quantize runs it)
             from the libggml-base that llama-cpp-python built; gguf-py has no quantizer for them.
"""
import ctypes
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "lm", "gguf_quantize.gguf")
COLS = 512
PY_TYPES = [Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1]
GGML_TYPES = [Q.Q4_K, Q.Q5_K, Q.Q6_K]


def inputs():
    rng = np.random.default_rng(20261203)
    rows = []
    for s in [1e-4, 1e-2, 0.02, 0.1, 1.0, 10.0]:
        rows.append(rng.standard_normal(COLS) * s)
    r = rng.standard_normal(COLS) * 0.05
    r[0:32] = 0.0                      # a zero block (and a zero group inside a super-block)
    r[64:96] = 0.37                    # a constant block
    r[300] = 40.0                      # one outlier
    rows.append(r)
    rows.append(rng.standard_normal(COLS) * 1e-30)   # tiny: scales underflow float16
    r = rng.standard_normal(COLS)
    r[256:288] = np.where(np.arange(32) % 2 == 0, 1.5, -1.5)  # equal magnitudes, both signs
    r[288:320] = -rng.random(32)       # all-negative block
    r[320:352] = rng.random(32) + 3.0  # all-positive block away from zero
    rows.append(r)
    rows.append(0.1 + 2.0 * np.cos(np.arange(COLS) + 0.0))      # test-quantize-fns' data
    rows.append(0.1 + 1.0 * np.cos(np.arange(COLS) + 3.0))
    rows.append(np.round(rng.standard_normal(COLS) * 8) / 16)     # values on a grid: ties when rounding
    return np.stack(rows).astype(np.float32)


def ggml_lib():
    import llama_cpp
    d = os.path.join(os.path.dirname(llama_cpp.__file__), "lib")
    lib = ctypes.CDLL(os.path.join(d, "libggml-base.so"))
    lib.ggml_quantize_chunk.restype = ctypes.c_size_t
    lib.ggml_quantize_chunk.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64,
                                        ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    lib.ggml_quantize_init.argtypes = [ctypes.c_int]
    return lib


def ggml_quantize(lib, x, qt):
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    rows, cols = x.shape
    out = np.zeros((rows, cols // block * nbytes), dtype=np.uint8)
    xc = np.ascontiguousarray(x, dtype=np.float32)
    lib.ggml_quantize_init(int(qt))
    n = lib.ggml_quantize_chunk(int(qt), xc.ctypes.data, out.ctypes.data, 0, rows, cols, None)
    assert n == out.size, (n, out.size)
    return out


def main():
    x = inputs()
    w = gguf.GGUFWriter(OUT, "llama")
    w.add_tensor("x", x)
    for qt in PY_TYPES:
        q = gguf.quants.quantize(x, qt)
        w.add_tensor(qt.name, q, raw_dtype=qt)
    lib = ggml_lib()
    for qt in GGML_TYPES:
        w.add_tensor(qt.name, ggml_quantize(lib, x, qt), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print("wrote", OUT, os.path.getsize(OUT), "bytes")


if __name__ == "__main__":
    main()
