#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""Records MLX's random numbers so tests/random/ can check nn::random bit for bit.

    python3 tests/oracle/gen_random.py      # rewrites tests/fixtures/random/*.json

Needs `pip install "mlx[cpu]"` (and, for the LoRA case, `pip install --no-deps mlx-lm`: only
mlx_lm/tuner/lora.py is loaded, so mlx-lm's heavy dependencies are not needed).

Every float is stored as its bit pattern (uint32 for float32, uint16 for bfloat16/float16, uint64
for float64), so the C++ side compares integers and a single flipped bit fails. Keys are [k0, k1].

MLX's Python API has no `bits`; raw words of odd-sized draws come from a ten-line C++ program
built against the headers and libmlx.so that the mlx wheel ships (the same library the Python
calls go through). Without a C++ compiler that part is skipped and said so; even-sized raw words
are recorded anyway through `split` (split(key, n) is bits((n, 2), key)).

Files:
  mlx_random.json   keys, split, bits, uniform, normal, bernoulli, the global seed sequence
  mlx_init.json     nn.Linear, nn.Embedding and mlx-lm LoRALinear initial weights after seed(0)
  mlx_dropout.json  dropout masks for given keys, and nn.Dropout outputs under a global seed
"""
import json
import math
import os
import subprocess
import sys
import tempfile
import types

import numpy as np
import mlx.core as mx
import mlx.nn as mnn

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.join(HERE, "..", "fixtures", "random")

DTYPES = {"float32": mx.float32, "float64": mx.float64, "bfloat16": mx.bfloat16, "float16": mx.float16}
UINT_VIEW = {mx.float32: mx.uint32, mx.float64: mx.uint64, mx.bfloat16: mx.uint16, mx.float16: mx.uint16}


def key_list(k):
    return [int(v) for v in np.array(k).ravel()]


def float_bits(a):
    """The bit patterns of a float array, flat, as Python ints."""
    with mx.stream(mx.cpu):
        return [int(v) for v in np.array(a.view(UINT_VIEW[a.dtype])).ravel()]


def dtype_name(dt):
    return {v: k for k, v in DTYPES.items()}[dt]


# --------------------------------------------------------------------------------------------
# Raw bits through MLX's C++ API (random::bits is not exposed to Python).
BITS_CPP = r"""
#include <mlx/mlx.h>
#include <iostream>
#include <string>
int main(int argc, char** argv) {
  namespace mx = mlx::core;
  auto k = mx::random::key(std::stoull(argv[1]));
  mx::Shape shape;
  for (int i = 2; i < argc; ++i) shape.push_back(std::stoi(argv[i]));
  auto b = mx::random::bits(shape, k);
  b.eval();
  for (size_t i = 0; i < b.size(); ++i) std::cout << b.data<uint32_t>()[i] << '\n';
}
"""


def build_bits_tool():
    root = os.path.dirname(mx.__file__)  # the mlx package folder: include/ and lib/ sit beside core*.so
    inc, lib = os.path.join(root, "include"), os.path.join(root, "lib")
    if not (os.path.isdir(inc) and os.path.isdir(lib)):
        return None
    d = tempfile.mkdtemp(prefix="nn_gen_random_")
    src, exe = os.path.join(d, "bits.cpp"), os.path.join(d, "bits")
    with open(src, "w") as f:
        f.write(BITS_CPP)
    cmd = ["g++", "-std=c++20", "-O1", src, f"-I{inc}", f"-L{lib}", "-lmlx", f"-Wl,-rpath,{lib}", "-o", exe]
    try:
        subprocess.run(cmd, check=True, capture_output=True)
    except (OSError, subprocess.CalledProcessError) as e:
        print("gen_random: could not build the MLX bits tool, raw odd-sized bits skipped:", e, file=sys.stderr)
        return None
    return exe


def run_bits(exe, seed, shape):
    out = subprocess.run([exe, str(seed)] + [str(s) for s in shape], check=True, capture_output=True, text=True)
    return [int(v) for v in out.stdout.split()]


# --------------------------------------------------------------------------------------------
SHAPES = [[], [1], [2], [7], [3, 5], [4, 8], [1000], [1001]]


def gen_random():
    doc = {"mlx_version": mx.__version__}

    doc["keys"] = [{"seed": s, "key": key_list(mx.random.key(s))}
                   for s in [0, 1, 42, 2**32 + 5, 2**63 + 12345, 2**64 - 1]]

    doc["split"] = []
    for seed, num in [(0, 2), (42, 3), (7, 1), (2**32 + 5, 5)]:
        k = mx.random.key(seed)
        doc["split"].append({"key": key_list(k), "num": num, "out": key_list(mx.random.split(k, num))})

    exe = build_bits_tool()
    doc["bits"] = []
    for seed in [0, 42, 2**32 + 5]:
        for shape in [[1], [2], [3], [7], [3, 5], [4, 8], [1000], [1001]]:
            k = mx.random.key(seed)
            if exe:
                data = run_bits(exe, seed, shape)
            elif math.prod(shape) % 2 == 0:  # even word counts are split's output, reshaped
                data = key_list(mx.random.split(k, math.prod(shape) // 2))
            else:
                continue
            doc["bits"].append({"key": key_list(k), "shape": shape, "data": data})
    doc["bits_source"] = "mlx C++ random::bits" if exe else "mlx split (even sizes only)"

    doc["uniform"] = []
    ranges = [(0.0, 1.0), (-0.5, 0.5), (-2.0, 7.3), (-0.35355339059327373, 0.35355339059327373), (1e-3, 1e3)]
    for i, shape in enumerate(SHAPES):
        for j, (lo, hi) in enumerate(ranges):
            for dt in [mx.float32, mx.bfloat16, mx.float16]:
                if dt != mx.float32 and shape not in ([7], [1000], [3, 5]):
                    continue
                k = mx.random.key(100 * i + j)
                a = mx.random.uniform(lo, hi, shape, dtype=dt, key=k)
                doc["uniform"].append({"key": key_list(k), "shape": shape, "low": lo, "high": hi,
                                       "dtype": dtype_name(dt), "bits": float_bits(a)})
    # The clip below one must be exercised: some bfloat16 draw in [0, 1) must sit at its largest
    # value below 1 (0.99609375), which only the clip produces from words rounding up to 1.
    big = [c for c in doc["uniform"] if c["dtype"] == "bfloat16" and c["low"] == 0.0]
    assert any(0x3F7F in c["bits"] for c in big), "no bfloat16 draw reached the clip; pick other seeds"

    doc["normal"] = []
    params = [(None, None), (None, 0.31622776601683794), (0.1, 0.3), (-1.0, 2.5)]
    for i, shape in enumerate(SHAPES):
        for j, (loc, scale) in enumerate(params):
            for dt in [mx.float32, mx.float64, mx.bfloat16, mx.float16]:
                if dt != mx.float32 and shape not in ([7], [1000], [3, 5]):
                    continue
                k = mx.random.key(1000 + 10 * i + j)
                with mx.stream(mx.cpu):
                    a = mx.random.normal(shape, dtype=dt, loc=loc, scale=scale, key=k)
                doc["normal"].append({"key": key_list(k), "shape": shape, "dtype": dtype_name(dt),
                                      "loc": loc, "scale": scale, "bits": float_bits(a)})

    doc["bernoulli"] = []
    for i, shape in enumerate(SHAPES):
        for p in [0.5, 0.1, 0.9, 0.75, 0.0, 1.0]:
            k = mx.random.key(2000 + i)
            m = mx.random.bernoulli(p, shape, key=k)
            doc["bernoulli"].append({"key": key_list(k), "shape": shape, "p": p,
                                     "data": [int(v) for v in np.array(m).ravel()]})

    # The global key sequence: seed, then calls without a key, each splitting the global key.
    seq = []
    mx.random.seed(0)
    calls = [("uniform", {"shape": [3], "low": 0.0, "high": 1.0}),
             ("normal", {"shape": [2, 2]}),
             ("bernoulli", {"shape": [5], "p": 0.3}),
             ("uniform", {"shape": [7], "low": -1.0, "high": 1.0}),
             ("normal", {"shape": [3], "loc": 0.5, "scale": 2.0}),
             ("uniform", {"shape": [1001], "low": 0.0, "high": 1.0})]
    for op, kw in calls:
        if op == "uniform":
            a = mx.random.uniform(kw["low"], kw["high"], kw["shape"])
            out = float_bits(a)
        elif op == "normal":
            a = mx.random.normal(kw["shape"], loc=kw.get("loc"), scale=kw.get("scale"))
            out = float_bits(a)
        else:
            out = [int(v) for v in np.array(mx.random.bernoulli(kw["p"], kw["shape"])).ravel()]
        seq.append({"op": op, **kw, "out": out})
    state = mx.random.state[0]
    doc["sequence"] = {"seed": 0, "calls": seq, "final_state": key_list(state)}
    # A second seed, so seeding again really resets the sequence.
    mx.random.seed(123)
    doc["sequence_123"] = {"seed": 123, "uniform_3": [float_bits(mx.random.uniform(shape=[3])) for _ in range(4)]}
    return doc


def load_lora_linear():
    """mlx-lm's LoRALinear without importing mlx_lm/__init__ (which pulls transformers)."""
    try:
        import importlib.util
        spec = importlib.util.find_spec("mlx_lm")
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        return None, None
    root = list(spec.submodule_search_locations)[0]
    pkg = types.ModuleType("mlx_lm")
    pkg.__path__ = [root]
    sys.modules.setdefault("mlx_lm", pkg)
    tuner = types.ModuleType("mlx_lm.tuner")
    tuner.__path__ = [os.path.join(root, "tuner")]
    sys.modules.setdefault("mlx_lm.tuner", tuner)
    from mlx_lm.tuner.lora import LoRALinear  # noqa: E402
    import importlib.metadata
    return LoRALinear, importlib.metadata.version("mlx-lm")


def gen_init():
    doc = {"mlx_version": mx.__version__}
    mx.random.seed(0)
    lin = mnn.Linear(4, 8)
    doc["linear_4_8"] = {"seed": 0, "weight": float_bits(lin.weight), "weight_shape": list(lin.weight.shape),
                         "bias": float_bits(lin.bias), "bias_shape": list(lin.bias.shape)}
    mx.random.seed(0)
    lin = mnn.Linear(3, 5, bias=False)
    doc["linear_3_5_nobias"] = {"seed": 0, "weight": float_bits(lin.weight), "weight_shape": list(lin.weight.shape)}
    mx.random.seed(0)
    emb = mnn.Embedding(10, 6)
    doc["embedding_10_6"] = {"seed": 0, "weight": float_bits(emb.weight), "weight_shape": list(emb.weight.shape)}
    # Draw order across layers: Linear(4, 8) then Embedding(10, 6) then Linear(8, 3) after one seed.
    mx.random.seed(7)
    a, b, c = mnn.Linear(4, 8), mnn.Embedding(10, 6), mnn.Linear(8, 3)
    doc["chain_seed7"] = {"seed": 7, "l1_weight": float_bits(a.weight), "l1_bias": float_bits(a.bias),
                          "emb_weight": float_bits(b.weight), "l2_weight": float_bits(c.weight),
                          "l2_bias": float_bits(c.bias), "final_state": key_list(mx.random.state[0])}
    LoRALinear, lm_version = load_lora_linear()
    if LoRALinear is not None:
        doc["mlx_lm_version"] = lm_version
        mx.random.seed(0)
        base = mnn.Linear(16, 8)
        lora = LoRALinear.from_base(base, r=4)
        doc["lora_from_base_16_8_r4"] = {
            "seed": 0, "base_weight": float_bits(base.weight), "base_bias": float_bits(base.bias),
            "lora_a": float_bits(lora.lora_a), "lora_a_shape": list(lora.lora_a.shape),
            "lora_b_shape": list(lora.lora_b.shape), "final_state": key_list(mx.random.state[0])}
        mx.random.seed(3)
        lora = LoRALinear(10, 6, r=8)
        doc["lora_direct_10_6_r8"] = {
            "seed": 3, "linear_weight": float_bits(lora.linear.weight), "lora_a": float_bits(lora.lora_a),
            "lora_a_shape": list(lora.lora_a.shape), "final_state": key_list(mx.random.state[0])}
    else:
        print("gen_random: mlx_lm not installed, LoRA init fixtures skipped", file=sys.stderr)
    return doc


def gen_dropout():
    doc = {"mlx_version": mx.__version__, "masks": [], "layer": []}
    for i, (p, shape) in enumerate([(0.5, [7]), (0.1, [3, 5]), (0.25, [4, 8]), (0.5, [1001]), (0.9, [2, 3, 4]),
                                    (0.3, [1])]):
        k = mx.random.key(3000 + i)
        m = mx.random.bernoulli(1 - p, shape, key=k)
        doc["masks"].append({"key": key_list(k), "p": p, "shape": shape, "mask": [int(v) for v in np.array(m).ravel()]})
    # nn.Dropout itself under a global seed: its key is the one the sequence hands out next, i.e.
    # split(key(seed))[1]; recorded so the C++ side proves it uses that same key.
    rng = np.random.default_rng(0xD409)
    for seed, p, shape in [(0, 0.5, [4, 6]), (11, 0.2, [3, 7]), (5, 0.1, [1001])]:
        x = mx.array(rng.standard_normal(shape).astype(np.float32))
        x[..., 0] = -0.0 if len(shape) > 1 else x[..., 0]  # a negative zero keeps its sign
        drop = mnn.Dropout(p)
        drop.train()
        mx.random.seed(seed)
        y = drop(x)
        mx.random.seed(seed)
        key = mx.random.split(mx.random.key(seed))[1]
        doc["layer"].append({"seed": seed, "p": p, "shape": shape, "key": key_list(key), "x": float_bits(x),
                             "y": float_bits(y)})
    return doc


def write(name, doc):
    os.makedirs(OUT, exist_ok=True)
    path = os.path.join(OUT, name)
    with open(path, "w") as f:
        json.dump(doc, f, separators=(",", ":"))
        f.write("\n")
    print("wrote", os.path.relpath(path), os.path.getsize(path), "bytes")


if __name__ == "__main__":
    write("mlx_random.json", gen_random())
    write("mlx_init.json", gen_init())
    write("mlx_dropout.json", gen_dropout())
