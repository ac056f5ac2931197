#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Reads the safetensors files nn wrote back with Python's safetensors and with MLX, and checks
every tensor bit for bit against what nn was given.

    ./build/tests/test_io -tc="files for the Python*"                 # writes <temp>/nn_io_readback
    python3 tests/oracle/check_safetensors_readback.py /tmp/nn_io_readback

(NN_IO_READBACK_DIR=<dir> makes test_io write elsewhere.) CI has no Python, so this runs in
development; record its output in tests/fixtures/io/README.md.

For each <name>.safetensors beside a <name>.expected.json (tensor names, dtypes, shapes, the data
bytes as hex, metadata, order), four readers:
  header   the raw header: length a multiple of 8, '{' first, space padding, "__metadata__" first,
           tensors in the given order and their data back to back in that order
  rust     safetensors.deserialize (the Rust reader validates the whole file): every tensor's
           dtype, shape and bytes, and safe_open(...).metadata()
  numpy    safe_open(framework="np").get_tensor for the dtypes numpy has: arr.tobytes()
  mlx      mx.load(return_metadata=True): bytes(memoryview(array)) and metadata; MLX refuses
           files with a dtype its loader lacks (F64, F4, F6_*, F8_E5M2, F8_E*FNUZ), reported so
Exit status 1 on any mismatch or unexpected refusal.
"""
import glob
import json
import os
import struct
import sys

import numpy as np
import safetensors
from safetensors import safe_open

NUMPY_DTYPES = {"F64", "F32", "F16", "I64", "U64", "I32", "U32", "I16", "U16", "I8", "U8", "BOOL", "C64"}
MLX_LACKS = {"F64", "F4", "F6_E2M3", "F6_E3M2", "F8_E5M2", "F8_E4M3FNUZ", "F8_E5M2FNUZ"}


def check_file(path, want):
    problems = []
    lines = []
    tensors = want["tensors"]
    meta = want["metadata"] or None
    blob = open(path, "rb").read()

    # header
    (n,) = struct.unpack("<Q", blob[:8])
    text = blob[8 : 8 + n].decode("utf-8")
    pairs = json.loads(text, object_pairs_hook=lambda kv: kv)
    keys = [k for k, _ in pairs]
    order = [k for k in keys if k != "__metadata__"]
    if n % 8:
        problems.append("header length %d is not a multiple of 8" % n)
    if not text.startswith("{") or text.rstrip(" ") != text.rstrip() or not text.rstrip(" ").endswith("}"):
        problems.append("header is not '{' ... '}' padded with spaces")
    if meta and keys[0] != "__metadata__":
        problems.append("__metadata__ is not first")
    if order != want["header_order"]:
        problems.append("header order %s != given %s" % (order, want["header_order"]))
    end = 0
    for k, info in pairs:
        if k == "__metadata__":
            continue
        b, e = dict(info)["data_offsets"]
        if b != end:
            problems.append("tensor %s starts at %d, not %d" % (k, b, end))
        end = e
    lines.append("header: %d bytes (%% 8 = %d), %d tensors in the given order" % (n, n % 8, len(order)))

    # rust
    got = dict(safetensors.deserialize(blob))
    bad = 0
    for name, t in tensors.items():
        g = got.get(name)
        if g is None or g["dtype"] != t["dtype"] or list(g["shape"]) != t["shape"] or bytes(g["data"]).hex() != t["hex"]:
            bad += 1
            problems.append("rust: tensor %s differs" % name)
    if set(got) != set(tensors):
        problems.append("rust: names %s != %s" % (sorted(got), sorted(tensors)))
    with safe_open(path, framework="np") as f:
        if f.metadata() != meta:
            problems.append("rust: metadata %s != %s" % (f.metadata(), meta))
    dtypes = sorted({t["dtype"] for t in tensors.values()})
    lines.append("rust (safetensors %s deserialize): %d/%d tensors bit-identical, metadata %s; dtypes %s"
                 % (safetensors.__version__, len(tensors) - bad, len(tensors),
                    "equal" if not any(p.startswith("rust: metadata") for p in problems) else "DIFFERS", " ".join(dtypes)))

    # numpy
    checked = 0
    with safe_open(path, framework="np") as f:
        for name, t in tensors.items():
            if t["dtype"] not in NUMPY_DTYPES:
                continue
            arr = f.get_tensor(name)
            checked += 1
            if list(arr.shape) != t["shape"] or arr.astype(arr.dtype.newbyteorder("<")).tobytes().hex() != t["hex"]:
                problems.append("numpy: tensor %s differs" % name)
    lines.append("numpy (safe_open np): %d tensors checked, %d bit-identical (the rest have no numpy dtype)"
                 % (checked, checked - sum(p.startswith("numpy:") for p in problems)))

    # mlx
    try:
        import mlx.core as mx
    except ImportError:
        lines.append("mlx: not installed (pip install 'mlx[cpu]')")
        return lines, problems
    lacks = sorted({t["dtype"] for t in tensors.values()} & MLX_LACKS)
    try:
        arrays, mmeta = mx.load(path, return_metadata=True)
    except Exception as e:  # noqa: BLE001 - MLX raises RuntimeError/ValueError
        if lacks:
            lines.append("mlx %s: refuses the file as expected (it has %s): %s" % (mx.__version__, " ".join(lacks), e))
        else:
            problems.append("mlx: refuses the file: %s" % e)
        return lines, problems
    if lacks:
        problems.append("mlx: loaded a file with %s, which it was expected to refuse" % lacks)
    bad = 0
    for name, t in tensors.items():
        a = arrays.get(name)
        if a is None or list(a.shape) != t["shape"] or bytes(memoryview(a)).hex() != t["hex"]:
            bad += 1
            problems.append("mlx: tensor %s differs" % name)
    if (mmeta or None) != meta:
        problems.append("mlx: metadata %s != %s" % (mmeta, meta))
    lines.append("mlx %s (mx.load): %d/%d tensors bit-identical, metadata %s"
                 % (mx.__version__, len(tensors) - bad, len(tensors), "equal" if (mmeta or None) == meta else "DIFFERS"))
    return lines, problems


def main():
    folder = sys.argv[1] if len(sys.argv) > 1 else "/tmp/nn_io_readback"
    expected = sorted(glob.glob(os.path.join(folder, "*.expected.json")))
    if not expected:
        sys.exit("no *.expected.json in %s: run test_io first" % folder)
    failed = False
    for ej in expected:
        path = ej[: -len(".expected.json")] + ".safetensors"
        want = json.load(open(ej))
        lines, problems = check_file(path, want)
        print(os.path.basename(path))
        for line in lines:
            print("  " + line)
        for p in problems:
            print("  MISMATCH " + p)
        failed |= bool(problems)
    print("FAIL" if failed else "OK: every file nn wrote reads back identically")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
