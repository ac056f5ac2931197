#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Development check (not CI): nn's GGUF LoRA adapter (finetune --export-adapter OUT.gguf) against
llama.cpp's own converter, convert_lora_to_gguf.py, run on the PEFT adapter nn wrote for the same
run (a folder with adapter_config.json + adapter_model.safetensors).

    pip install gguf numpy
    # converter output (llama.cpp checkout, its gguf-py first on PYTHONPATH; needs torch, transformers):
    PYTHONPATH=llama.cpp/gguf-py python3 llama.cpp/convert_lora_to_gguf.py \
        --base HF_BASE_DIR --outtype f32 --outfile CONVERTED.gguf RUN/peft
    python3 tests/interop/check_lora_convert.py CONVERTED.gguf NN.gguf [CONVERTED2.gguf NN2.gguf ...]

Arguments come in pairs: the converter's file first, nn's file second. Both are read with
gguf-py's GGUFReader; tensor values are decoded with gguf.quants.dequantize and compared as
float32 (so the converter may have written F16/BF16/Q8_0 too, but then expect a quantization-sized
difference). For each pair it checks

  * tensors: the same set of names (the names missing on either side are listed), the same GGML
    shape (ne order) per tensor, and per tensor the max |converter - nn| of the values, which must
    be <= --rtol (1e-6) times the tensor's largest magnitude (0 for a tensor that is all zeros);
    the tensor types and whether both files list the tensors in the same order are reported;
  * metadata: the keys present in only one of the files are listed (for information); for the
    keys both have, differing values are printed. general.architecture, general.type, adapter.type
    and adapter.lora.alpha must be in both files with equal values, as must every other adapter.*
    key that both files have.

The exit status is 0 when every pair passes, 1 otherwise (2 for bad arguments).
"""
import argparse
import sys

import numpy as np
import gguf
from gguf import GGUFReader

# keys whose values decide how llama.cpp applies the adapter: must be present in both and equal
REQUIRED_KEYS = ("general.architecture", "general.type", "adapter.type", "adapter.lora.alpha")


def field_value(field):
    """A metadata field's decoded value (strings as str, arrays as lists)."""
    v = field.contents()
    if isinstance(v, float):
        # FLOAT32 keys decode to Python floats; keep them comparable and printable as stored
        v = float(np.float32(v))
    return v


def show(v, limit=120):
    s = repr(v)
    return s if len(s) <= limit else s[:limit] + f"... ({len(v) if hasattr(v, '__len__') else '?'} items)"


def read(path):
    r = GGUFReader(path)
    meta = {k: field_value(f) for k, f in r.fields.items() if not k.startswith("GGUF.")}
    tensors = {}
    order = []
    for t in r.tensors:
        tensors[t.name] = t
        order.append(t.name)
    return r, meta, tensors, order


def compare_pair(conv_path, nn_path, rtol):
    ok = True
    print(f"=== converter: {conv_path}")
    print(f"=== nn:        {nn_path}")
    _, cmeta, ctens, corder = read(conv_path)
    _, nmeta, ntens, norder = read(nn_path)

    # ---- tensors
    cnames, nnames = set(ctens), set(ntens)
    print(f"tensors: converter {len(cnames)}, nn {len(nnames)}, common {len(cnames & nnames)}")
    only_c, only_n = sorted(cnames - nnames), sorted(nnames - cnames)
    if only_c:
        ok = False
        print(f"  FAIL only in converter ({len(only_c)}): {', '.join(only_c)}")
    if only_n:
        ok = False
        print(f"  FAIL only in nn ({len(only_n)}): {', '.join(only_n)}")
    common_c = [n for n in corder if n in nnames]
    common_n = [n for n in norder if n in cnames]
    print(f"  tensor order: {'same' if common_c == common_n else 'differs (not an error)'}")

    worst_abs, worst_rel, worst_name = 0.0, 0.0, None
    types = set()
    nshape_bad = nval_bad = 0
    for name in common_c:
        ct, nt = ctens[name], ntens[name]
        cshape, nshape = [int(x) for x in ct.shape], [int(x) for x in nt.shape]
        types.add((ct.tensor_type.name, nt.tensor_type.name))
        if cshape != nshape:
            ok = False
            nshape_bad += 1
            print(f"  FAIL shape {name}: converter {cshape}, nn {nshape}")
            continue
        cv = gguf.quants.dequantize(ct.data, ct.tensor_type).astype(np.float32)
        nv = gguf.quants.dequantize(nt.data, nt.tensor_type).astype(np.float32)
        if cv.shape != nv.shape:
            ok = False
            nshape_bad += 1
            print(f"  FAIL decoded shape {name}: converter {cv.shape}, nn {nv.shape}")
            continue
        diff = np.abs(cv.astype(np.float64) - nv.astype(np.float64))
        mad = float(diff.max()) if diff.size else 0.0
        scale = float(max(np.abs(cv).max(initial=0.0), np.abs(nv).max(initial=0.0)))
        rel = mad / scale if scale > 0 else (0.0 if mad == 0 else float("inf"))
        if not np.all(np.isfinite(cv)) or not np.all(np.isfinite(nv)):
            ok = False
            nval_bad += 1
            print(f"  FAIL non-finite values in {name}")
        elif rel > rtol:
            ok = False
            nval_bad += 1
            i = np.unravel_index(int(diff.argmax()), diff.shape)
            print(f"  FAIL values {name} {cshape}: max|diff| {mad:.3e} (rel {rel:.3e}) at numpy index {tuple(int(x) for x in i)}:"
                  f" converter {cv[i]:.8g}, nn {nv[i]:.8g}")
        if mad > worst_abs or worst_name is None:
            worst_abs, worst_name = mad, name
        worst_rel = max(worst_rel, rel)
    print("  tensor types (converter, nn): " + ", ".join(f"{a}/{b}" for a, b in sorted(types)))
    print(f"  shapes: {len(common_c) - nshape_bad}/{len(common_c)} equal")
    print(f"  values: {len(common_c) - nshape_bad - nval_bad}/{len(common_c) - nshape_bad} within rtol {rtol:g};"
          f" max|diff| {worst_abs:.3e} (in {worst_name}), max rel {worst_rel:.3e}")

    # ---- metadata
    ckeys, nkeys = set(cmeta), set(nmeta)
    print(f"metadata: converter {len(ckeys)} keys, nn {len(nkeys)} keys")
    for k in sorted(ckeys - nkeys):
        print(f"  only in converter: {k} = {show(cmeta[k])}")
    for k in sorted(nkeys - ckeys):
        print(f"  only in nn:        {k} = {show(nmeta[k])}")
    for k in REQUIRED_KEYS:
        if k not in cmeta or k not in nmeta:
            ok = False
            print(f"  FAIL {k} missing in {'converter' if k not in cmeta else 'nn'}")
    for k in sorted(ckeys & nkeys):
        cv, nv = cmeta[k], nmeta[k]
        checked = k in REQUIRED_KEYS or k.startswith("adapter.")
        if cv == nv:
            if checked:
                print(f"  equal:             {k} = {show(cv)}")
            continue
        if checked:
            ok = False
            print(f"  FAIL differs:      {k}: converter {show(cv)}, nn {show(nv)}")
        else:
            print(f"  differs (info):    {k}: converter {show(cv)}, nn {show(nv)}")

    print(f"result: {'PASS' if ok else 'FAIL'}")
    print()
    return ok


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("files", nargs="+", metavar="CONVERTED.gguf NN.gguf",
                    help="pairs: llama.cpp convert_lora_to_gguf.py output, then nn's adapter")
    ap.add_argument("--rtol", type=float, default=1e-6,
                    help="max |diff| allowed per tensor, relative to its largest magnitude (default 1e-6)")
    args = ap.parse_args()
    if len(args.files) % 2:
        ap.error("files must come in pairs: CONVERTED.gguf NN.gguf")
    ok = True
    for i in range(0, len(args.files), 2):
        ok &= compare_pair(args.files[i], args.files[i + 1], args.rtol)
    print("ALL PASS" if ok else "SOME FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
