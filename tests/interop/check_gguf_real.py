#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Development check (not CI; tests/interop/check_gguf_real.sh runs it): nn's reading of a real
GGUF file against gguf-py's, every tensor, bit for bit.

    python3 tests/interop/check_gguf_real.py FILE.gguf NN_DUMP.safetensors

NN_DUMP is what tests/interop/gguf_dequant_dump writes for FILE: each tensor in float32 as nn
holds it kept quantized ("<name>": the blocks repacked into affine groups, then dequantized) and,
for quantized types, as nn's block decoder gives it ("<name>.direct"). Both must equal
gguf.quants.dequantize of the tensor's raw blocks exactly: the same float32 value at every
element (+0 and -0 count as equal: nn's affine form of a symmetric type's zero code is +0 where
gguf-py writes -0; the count of such elements is printed). Prints one line per GGUF type.
"""
import sys
from collections import defaultdict

import numpy as np
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import load_file


def main():
    if len(sys.argv) != 3:
        sys.exit(__doc__)
    reader = GGUFReader(sys.argv[1])
    nn = load_file(sys.argv[2])
    stats = defaultdict(lambda: [0, 0, 0])  # type -> tensors, elements, signed-zero differences
    bad, bad_types = [], set()
    for t in reader.tensors:
        ref = dequantize(t.data, t.tensor_type).astype(np.float32).reshape(-1)
        for key in (t.name, t.name + ".direct"):
            if key not in nn:
                if key == t.name:
                    bad.append(f"{t.name}: missing from the dump")
                continue
            got = nn[key].reshape(-1)
            if got.shape != ref.shape:
                bad.append(f"{key}: {got.shape} elements, gguf-py {ref.shape}")
                continue
            same = (got == ref) | (np.isnan(got) & np.isnan(ref))
            if not same.all():
                i = int(np.argmin(same))
                bad.append(f"{key} ({t.tensor_type.name}): {int((~same).sum())} elements differ, first at {i}: "
                           f"nn {got[i]!r}, gguf-py {ref[i]!r}")
                bad_types.add(t.tensor_type.name)
            s = stats[t.tensor_type.name]
            s[1] += got.size
            s[2] += int((np.signbit(got) != np.signbit(ref)).sum())
        stats[t.tensor_type.name][0] += 1
    for name, (n, elems, zeros) in sorted(stats.items()):
        verdict = "DIFFERENCES (below)" if name in bad_types else "all equal"
        print(f"  {name:5s} {n:4d} tensors, {elems:10d} values compared, {verdict} ({zeros} zeros of the other sign)")
    for b in bad:
        print("MISMATCH", b)
    if bad:
        sys.exit(1)
    print(f"check_gguf_real: {len(reader.tensors)} tensors of {sys.argv[1]} equal gguf-py's dequantize bit for bit")


if __name__ == "__main__":
    main()
