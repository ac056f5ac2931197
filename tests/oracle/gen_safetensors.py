#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Writes safetensors fixtures with Python's `safetensors` and with MLX, so tests/io/ can check
that nn reads other writers' files bit for bit.

    python3 tests/oracle/gen_safetensors.py      # rewrites tests/fixtures/io/*

Needs `pip install safetensors numpy "mlx[cpu]"`.

Files (tests/fixtures/io/):
  python_numpy.safetensors   safetensors.numpy.save_file: BOOL U8 I8 I16 U16 F16 I32 U32 F32 F64
                             I64 U64 C64, a scalar, an empty tensor, a UTF-8 name, metadata
  python_raw.safetensors     safetensors.serialize_file from raw buffers: BF16 and the dtypes
                             numpy lacks (F8_E4M3 F8_E4M3FNUZ F8_E5M2 F8_E5M2FNUZ F8_E8M0 F4)
  handmade_f6.safetensors    F6_E2M3 and F6_E3M2, which no Python writer emits; built here byte by
                             byte and checked to load in safetensors.deserialize
  mlx.safetensors            mx.save_safetensors: every dtype its writer takes (BOOL U8 U16 U32
                             U64 I8 I16 I32 I64 F16 BF16 F32 C64; it refuses float64),
                             metadata {"format": "mlx"}
  safetensors_expected.json  per file: metadata, header order, and per tensor the dtype, shape, the
                             raw data bytes as hex, and for dtypes nn loads the values nn must
                             produce (ints exact; floats as numbers, "nan"/"inf"/"-inf" as strings)

Each file is read back here with safetensors.deserialize (the Rust reader) before the expected
values are recorded from the arrays that were written, so a fixture is never its own oracle.
"""
import json
import math
import os
import struct
import sys

import numpy as np
import safetensors
from safetensors import TensorSpec, serialize_file
from safetensors.numpy import save_file

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "io")

# How nn loads each dtype (include/nn/io/safetensors.hpp); dtypes absent here stay raw bytes.
NN_LOADS = {"F64", "F32", "F16", "BF16", "I64", "I32", "I16", "I8", "U16", "U32", "U8", "BOOL"}


def float_json(x):
    x = float(x)
    if math.isnan(x):
        return "nan"
    if math.isinf(x):
        return "inf" if x > 0 else "-inf"
    return x


def values_of(dtype, raw):
    """The values nn must load from `raw` little-endian bytes of `dtype`, computed with numpy."""
    if dtype == "BF16":
        bits = np.frombuffer(raw, dtype="<u2").astype(np.uint32) << 16
        return [float_json(v) for v in bits.view(np.float32)]
    np_type = {"F64": "<f8", "F32": "<f4", "F16": "<f2", "I64": "<i8", "I32": "<i4", "I16": "<i2",
               "I8": "i1", "U16": "<u2", "U32": "<u4", "U8": "u1", "BOOL": "u1"}[dtype]
    a = np.frombuffer(raw, dtype=np_type)
    if dtype == "BOOL":
        return [1 if v else 0 for v in a]
    if dtype.startswith("F"):
        return [float_json(v) for v in a.astype(np.float64)]
    return [int(v) for v in a]


def header_of(path):
    with open(path, "rb") as f:
        (n,) = struct.unpack("<Q", f.read(8))
        text = f.read(n).decode("utf-8")
    return n, json.loads(text, object_pairs_hook=lambda kv: kv)


def record(path, writer):
    """Reads `path` back with the Rust reader and returns its expected-values entry."""
    with open(path, "rb") as f:
        blob = f.read()
    read = dict(safetensors.deserialize(blob))  # raises if the Rust reader refuses the file
    n, pairs = header_of(path)
    order = [k for k, _ in pairs if k != "__metadata__"]
    meta = dict(dict(pairs).get("__metadata__") or []) or None
    tensors = {}
    for name in order:
        t = read[name]
        raw = bytes(t["data"])
        entry = {"dtype": t["dtype"], "shape": list(t["shape"]), "hex": raw.hex()}
        if t["dtype"] in NN_LOADS:
            entry["values"] = values_of(t["dtype"], raw)
        tensors[name] = entry
    return {"writer": writer, "header_length": n, "metadata": meta, "header_order": order, "tensors": tensors}


def py_numpy(path):
    f32 = np.array([1.0, -2.5, np.inf, -np.inf, np.nan, -0.0, 1e-45, 3.4028235e38], np.float32)
    arrays = {
        "bool": np.array([True, False, True, True], dtype=bool),
        "u8": np.array([0, 1, 127, 128, 255], np.uint8),
        "i8": np.array([-128, -1, 0, 1, 127], np.int8),
        "i16": np.array([-32768, -1, 0, 1, 32767], np.int16),
        "u16": np.array([0, 1, 32768, 65535], np.uint16),
        "f16": np.array([1.0, -2.5, 65504.0, 6e-8, np.inf, np.nan, -0.0], np.float16).reshape(7),
        "i32": np.array([[-2147483648, -1, 0], [1, 2, 2147483647]], np.int32),
        "u32": np.array([0, 1, 2**31, 2**32 - 1], np.uint32),
        "f32": f32.reshape(2, 4),
        "f64": np.array([math.pi, -1e300, 5e-324, np.nan, np.inf, -0.0], np.float64).reshape(3, 1, 2),
        "i64": np.array([-(2**63), -1, 0, 2**53 + 1, 2**63 - 1], np.int64),
        "u64": np.array([0, 1, 2**64 - 1], np.uint64),
        "c64": np.array([1 + 2j, -3.5 - 0.25j], np.complex64),
        "scalar": np.array(7.25, np.float32),
        "empty": np.zeros((0, 3), np.float32),
        "model.layers.0.self_attn.q_proj.weight": np.arange(12, dtype=np.float32).reshape(3, 4) / 8,
        "ünï.名": np.array([1, 2], np.int32),
    }
    save_file(arrays, path, metadata={"format": "np", "writer": "safetensors.numpy"})


def py_raw(path):
    keep = []

    def spec(dtype, shape, raw):
        buf = np.frombuffer(raw, dtype=np.uint8).copy()
        keep.append(buf)
        return TensorSpec(dtype=dtype, shape=shape, data_ptr=buf.ctypes.data, data_len=buf.nbytes)

    bf16 = struct.pack("<7H", 0x3F80, 0xC020, 0x7F80, 0xFF80, 0x7FC0, 0x0001, 0x8000)
    every_byte = bytes(range(256))
    tensors = {
        "bf16": spec("bfloat16", [7], bf16),
        "f8_e4m3": spec("float8_e4m3fn", [4, 4], every_byte[:16]),
        "f8_e4m3fnuz": spec("float8_e4m3fnuz", [16], every_byte[16:32]),
        "f8_e5m2": spec("float8_e5m2", [2, 8], every_byte[32:48]),
        "f8_e5m2fnuz": spec("float8_e5m2fnuz", [16], every_byte[48:64]),
        "f8_e8m0": spec("float8_e8m0fnu", [8], every_byte[120:128]),
        # Two F4 values per byte: the spec takes the storage shape and doubles the last dimension.
        "f4": spec("float4_e2m1fn_x2", [2, 3], bytes([0x10, 0x32, 0x54, 0x76, 0x98, 0xBA])),
    }
    serialize_file(tensors, path, metadata={"format": "raw", "writer": "safetensors.serialize_file"})


def handmade_f6(path):
    # 4 F6_E2M3 values = 24 bits = 3 bytes; 2x4 F6_E3M2 = 48 bits = 6 bytes. The format does not
    # say how 6-bit values pack inside bytes, so nn (like the Rust reader) only hands out bytes.
    header = {
        "__metadata__": {"writer": "gen_safetensors.py by hand"},
        "f6_e2m3": {"dtype": "F6_E2M3", "shape": [4], "data_offsets": [0, 3]},
        "f6_e3m2": {"dtype": "F6_E3M2", "shape": [2, 4], "data_offsets": [3, 9]},
    }
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * ((8 - len(text) % 8) % 8)
    data = bytes([0xA5, 0x5A, 0xFF, 0x01, 0x23, 0x45, 0x67, 0x89, 0xAB])
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + data)


def mlx_file(path):
    import mlx.core as mx

    arrays = {
        "bool": mx.array([True, False, False, True]),
        "u8": mx.array([0, 7, 255], dtype=mx.uint8),
        "u16": mx.array([0, 1, 65535], dtype=mx.uint16),
        "u32": mx.array(np.array([0, 4294967295], np.uint32)),
        "u64": mx.array(np.array([0, 2**64 - 1], np.uint64)),  # a Python int above 2^63 is refused
        "i8": mx.array([-128, 5, 127], dtype=mx.int8),
        "i16": mx.array([-32768, -3, 32767], dtype=mx.int16),
        "i32": mx.array([[-7, 0], [3, 2147483647]], dtype=mx.int32),
        "i64": mx.array(np.array([-(2**63), 2**53 + 1, 2**63 - 1], np.int64)),
        "f16": mx.array([1.0, -0.333, 65504.0, float("inf")], dtype=mx.float16),
        "bf16": mx.array([[1.0, -2.5, 3.140625], [1e30, float("-inf"), 0.1]], dtype=mx.bfloat16),
        "f32": mx.array([0.1, -1e-40, float("nan"), 3.0], dtype=mx.float32),
        "c64": mx.array([1 + 1j, 2 - 0.5j], dtype=mx.complex64),
        "model.embed_tokens.weight": (mx.arange(24, dtype=mx.float32).reshape(2, 3, 4) - 12) / 16,
    }
    mx.eval(list(arrays.values()))
    mx.save_safetensors(path, arrays, metadata={"format": "mlx"})


def main():
    os.makedirs(OUT, exist_ok=True)
    expected = {}
    writers = [
        ("python_numpy.safetensors", py_numpy, "safetensors %s (numpy.save_file)" % safetensors.__version__),
        ("python_raw.safetensors", py_raw, "safetensors %s (serialize_file)" % safetensors.__version__),
        ("handmade_f6.safetensors", handmade_f6, "gen_safetensors.py (by hand)"),
    ]
    try:
        import mlx.core as mx

        writers.append(("mlx.safetensors", mlx_file, "mlx %s (mx.save_safetensors)" % mx.__version__))
    except ImportError:
        sys.exit("mlx is missing: pip install 'mlx[cpu]'")
    for name, fn, who in writers:
        path = os.path.join(OUT, name)
        fn(path)
        expected[name] = record(path, who)
        print("wrote", os.path.relpath(path), "-", len(expected[name]["tensors"]), "tensors, by", who)
    with open(os.path.join(OUT, "safetensors_expected.json"), "w") as f:
        json.dump(expected, f, indent=1, ensure_ascii=False)
        f.write("\n")


if __name__ == "__main__":
    main()
