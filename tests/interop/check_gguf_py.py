#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Development check (not CI): gguf-py reads every key, tensor shape and tensor byte of the GGUF
files nn writes (finetune --fuse OUT.gguf, --export-adapter OUT.gguf).

    pip install gguf numpy
    python3 tests/interop/check_gguf_py.py FILE.gguf [FILE.gguf ...] [--source BASE.gguf]

For each file, gguf-py's GGUFReader parses it; every field's value is decoded, every tensor's
bytes are read and, where gguf-py can, dequantized (finite values are checked). The file is then
written again by gguf-py's own GGUFWriter from what the reader returned -- every key with its
type, every tensor's raw bytes -- and the result must equal nn's file byte for byte: the two
sides agree on every key, shape, type, offset and byte. With --source, every metadata key of the
source (but general.file_type / quantization_version / alignment) must be in the file with an
equal value, and every tensor of the same name the same shape.
"""
import argparse
import os
import sys
import tempfile

import numpy as np
import gguf
from gguf import GGUFReader, GGUFWriter, GGUFValueType as VT


def nested_value(parts, i):
    """An array from the reader's raw parts at i (its element type, count, elements): nested levels
    kept (ReaderField.contents() flattens them). Returns (value, next index)."""
    et, n = VT(int(parts[i][0])), int(parts[i + 1][0])
    i += 2
    out = []
    for _ in range(n):
        if et == VT.ARRAY:
            v, i = nested_value(parts, i)
        elif et == VT.STRING:
            v, i = bytes(parts[i + 1]).decode("utf-8"), i + 2
        else:
            v, i = parts[i].tolist()[0], i + 1
        out.append(v)
    return out, i


def field_value(f):
    if f.types[0] == VT.ARRAY and len(f.types) > 2:
        return nested_value(f.parts, 3)[0]
    return f.contents()


def rewrite(reader, path):
    arch = field_value(reader.fields["general.architecture"])
    w = GGUFWriter(path, arch)
    for name, f in reader.fields.items():
        if name.startswith("GGUF.") or name == "general.architecture":
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == VT.ARRAY else None
        if vtype == VT.ARRAY and len(f.types) > 2:
            sub = None  # nested arrays: gguf-py's writer infers each level from the values
        w.add_key_value(name, field_value(f), vtype, sub_type=sub)
    for t in reader.tensors:
        w.add_tensor(t.name, np.asarray(t.data), raw_dtype=t.tensor_type)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def check(path, source):
    r = GGUFReader(path)
    n_keys = sum(1 for k in r.fields if not k.startswith("GGUF."))
    types = {}
    for t in r.tensors:
        types[t.tensor_type.name] = types.get(t.tensor_type.name, 0) + 1
        raw = np.asarray(t.data)
        assert raw.nbytes == t.n_bytes, (t.name, raw.nbytes, t.n_bytes)
        try:
            deq = gguf.quants.dequantize(raw, t.tensor_type)
            assert np.isfinite(deq).all(), t.name
        except NotImplementedError:
            pass
    with tempfile.TemporaryDirectory() as d:
        again = os.path.join(d, "again.gguf")
        rewrite(r, again)
        same = open(again, "rb").read() == open(path, "rb").read()
    print(f"{os.path.basename(path)}: {n_keys} keys, {len(r.tensors)} tensors {types}; "
          f"gguf-py re-writes it byte for byte: {same}")
    ok = same
    if source:
        s = GGUFReader(source)
        skip = {"general.file_type", "general.quantization_version", "general.alignment"}
        missing = [k for k in s.fields if not k.startswith("GGUF.") and k not in skip and k not in r.fields]
        differ = [k for k in s.fields if not k.startswith("GGUF.") and k not in skip and k in r.fields
                  and field_value(s.fields[k]) != field_value(r.fields[k])]
        shapes = {t.name: list(t.shape) for t in s.tensors}
        bad = [t.name for t in r.tensors if t.name in shapes and list(t.shape) != shapes[t.name]]
        print(f"  vs {os.path.basename(source)}: {len(missing)} keys missing, {len(differ)} differ, "
              f"{len(bad)} tensor shapes differ")
        ok = ok and not missing and not differ and not bad
    return ok


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("files", nargs="+")
    ap.add_argument("--source")
    a = ap.parse_args()
    ok = all([check(f, a.source if "adapter" not in os.path.basename(f) else None) for f in a.files])
    print("OK" if ok else "FAILED")
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
