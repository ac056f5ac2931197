#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records gguf-py's dequantization of every GGUF block type nn keeps quantized, as the golden
reference of nn's GGUF block decoding (tests/lm/gguf_quants.test.cpp).

    python3 tests/oracle/gen_gguf_quants.py   # (pip gguf numpy) rewrites
                                              #   tests/fixtures/lm/gguf_quants.gguf

For each of Q4_0 Q4_1 Q5_0 Q5_1 Q8_0 Q2_K Q3_K Q4_K Q5_K Q6_K the file holds
  "<T>"      a (3, 512) matrix of that type (ne = [512, 3]) made of random raw blocks: every code,
             scale and high-bit byte uniformly random, and the float16 fields (d, m, dmin) drawn
             per block from normal values of mixed magnitude and sign, with some rows' blocks
             given adversarial halves: zero, subnormal, +-65504, negative zero;
  "ref.<T>"  an F32 (3, 512) tensor: gguf.quants.dequantize of "<T>"'s bytes, as gguf-py's
             GGUFReader reads them back (so the file round-trips through gguf-py first).
Random bytes, not gguf-py's quantizers (which exist only for some types), so every bit pattern of
a block's layout is exercised; dequantization is what a reader owes bit for bit.
"""
import os

import numpy as np
import gguf
from gguf import GGMLQuantizationType as Q

OUT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "fixtures", "lm", "gguf_quants.gguf")
ROWS, COLS = 3, 512
TYPES = [Q.Q4_0, Q.Q4_1, Q.Q5_0, Q.Q5_1, Q.Q8_0, Q.Q2_K, Q.Q3_K, Q.Q4_K, Q.Q5_K, Q.Q6_K]
# Byte offsets of the float16 fields inside each block (ggml's block_* structs).
HALF_FIELDS = {
    Q.Q4_0: [0], Q.Q4_1: [0, 2], Q.Q5_0: [0], Q.Q5_1: [0, 2], Q.Q8_0: [0],
    Q.Q2_K: [80, 82], Q.Q3_K: [108], Q.Q4_K: [0, 2], Q.Q5_K: [0, 2], Q.Q6_K: [208],
}
SPECIAL = np.array([0.0, -0.0, 6.0e-8, -3.0e-6, 65504.0, -65504.0, 1.0, -0.5], dtype=np.float16)


def blocks_for(qt, rng):
    block, nbytes = gguf.GGML_QUANT_SIZES[qt]
    n = ROWS * COLS // block
    raw = rng.integers(0, 256, size=(n, nbytes), dtype=np.uint8)
    for off in HALF_FIELDS[qt]:
        h = (rng.standard_normal(n) * 10.0 ** rng.integers(-4, 1, size=n)).astype(np.float16)
        # The last row's blocks take the adversarial values in turn.
        last = np.arange(n) >= n - n // ROWS
        h[last] = SPECIAL[np.arange(int(last.sum())) % len(SPECIAL)]
        raw[:, off:off + 2] = h.view(np.uint8).reshape(n, 2)
    return raw.reshape(ROWS, -1)


def main():
    rng = np.random.default_rng(20261203)
    w = gguf.GGUFWriter(OUT, "llama")
    for qt in TYPES:
        w.add_tensor(qt.name, blocks_for(qt, rng), raw_dtype=qt)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    # Read it back through gguf-py and append the references (a second file write: the writer
    # needs all tensors up front).
    reader = gguf.GGUFReader(OUT)
    refs = {}
    for t in reader.tensors:
        deq = gguf.quants.dequantize(t.data, t.tensor_type).reshape(ROWS, COLS).astype(np.float32)
        refs[t.name] = (np.array(t.data).copy(), t.tensor_type, deq)
    w = gguf.GGUFWriter(OUT, "llama")
    for name, (data, qt, deq) in refs.items():
        w.add_tensor(name, data, raw_dtype=qt)
    for name, (data, qt, deq) in refs.items():
        w.add_tensor("ref." + name, deq)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    print(OUT, os.path.getsize(OUT), "bytes;", ", ".join(refs))


if __name__ == "__main__":
    main()
