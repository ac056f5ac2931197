#!/usr/bin/python3
# SPDX-License-Identifier: MIT OR Apache-2.0
"""The LM kit's oracle: tiny random Llama / Qwen2 / SmolLM-style models run by Hugging Face
`transformers` in float64, written as HF folders and GGUF files, with their logits.

    /usr/bin/python3 tests/oracle/gen_lm_models.py    # rewrites tests/fixtures/lm/models/

Needs torch (Debian's python3-torch 1.13 works), transformers 4.44 and gguf (gguf-py):
    /usr/bin/python3 -m pip install --break-system-packages transformers==4.44.2 safetensors gguf

Writes, under tests/fixtures/lm/models/:
  llama/        LlamaForCausalLM, untied head, no biases, GQA 4/2; weights stored F32, one file
  qwen2/        Qwen2ForCausalLM, tied embeddings, q/k/v biases, GQA 4/2, rope_theta 1e6; weights
                stored F64 in two shards with model.safetensors.index.json
  smollm_bf16/  a SmolLM-style Llama (tied, MQA 4/1) with attention_bias and mlp_bias and Llama 3
                rope_scaling; weights stored BF16
  gguf/llama-{F32,F16,BF16,Q8_0,Q4_0,Q4_1}.gguf   the llama model as convert_hf_to_gguf.py lays
                it out (llama.cpp names, q/k rows permuted, 1-D tensors F32), quantised with
                gguf.quants; llama-Q8_0 uses general.alignment 64; llama-F32 also carries metadata
                of every GGUF value type (test.*) and a small tokenizer
  gguf/qwen2-F16.gguf   the qwen2 model (tied, biases, no permutation)
  expected.safetensors  float64: ids (B, T), keep (B, T), and per case "<case>.logits" (B, T, V);
                per GGUF type (float32) the dequantised "gguf_<T>.blk.0.attn_k.weight" (as stored,
                permuted) and "gguf_<T>.blk.1.ffn_down.weight"
  expected.json         the metadata the GGUF reader must return, and the measured errors

Why transformers is patched. Its float64 forward is not float64 throughout: RMSNorm upcasts to
float32 and casts back, the eager softmax runs in float32, RoPE's inverse frequencies and angles
are float32, and the head's logits are cast to float32. Those are precision choices, not the
model's definition, and they would bound any comparison at ~1e-7. So the reference runs the
same modules with those four steps in float64 (the script checks that the patched and stock
forwards agree to float32 accuracy, and that the float64 inverse frequencies match transformers'
own float32 ones, Llama 3 remap included), and the logits come from model.lm_head applied to
model.model's hidden states. Everything else — weight names and layout, GQA, biases, tying, the
4-D causal + padding mask, HF's own loading of each folder (bf16 -> f64, the sharded index) — is
transformers' code as shipped.

The GGUF references are computed the same way from the tensors gguf-py's GGUFReader reads back
and gguf.quants.dequantize dequantises, with the q/k permutation undone: so a reader that
dequantises and un-permutes exactly matches them to float64 rounding, whatever the quantisation
error is (also recorded, against the unquantised model).
"""
import json
import math
import os
import shutil

import numpy as np
import torch
import transformers
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM, Qwen2Config, Qwen2ForCausalLM
from transformers.models.llama import modeling_llama
from transformers.models.qwen2 import modeling_qwen2

import gguf
from gguf import GGMLQuantizationType as Q
from gguf import GGUFValueType as VT

HERE = os.path.dirname(os.path.abspath(__file__))
OUT = os.path.normpath(os.path.join(HERE, "..", "fixtures", "lm", "models"))

torch.set_default_dtype(torch.float64)
torch.manual_seed(0)
rng = np.random.default_rng(0x11A3A)

B, T, V = 2, 7, 64
LENGTHS = [7, 4]  # right padding: HF's forward puts positions 0..T-1 in every row
COMMON = dict(vocab_size=V, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
              rms_norm_eps=1e-6, max_position_embeddings=64)

CASES = {
    "llama": (LlamaConfig(**COMMON, num_key_value_heads=2, rope_theta=10000.0, tie_word_embeddings=False),
              torch.float32, None),
    "qwen2": (Qwen2Config(**COMMON, num_key_value_heads=2, rope_theta=1000000.0, tie_word_embeddings=True),
              torch.float64, "100KB"),
    "smollm_bf16": (LlamaConfig(**COMMON, num_key_value_heads=1, rope_theta=100000.0, tie_word_embeddings=True,
                                attention_bias=True, mlp_bias=True,
                                rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                              "high_freq_factor": 4.0, "original_max_position_embeddings": 16}),
                    torch.bfloat16, None),
}


# ---- float64 patches ---------------------------------------------------------------------------

def inv_freq64(cfg):
    """RoPE inverse frequencies in float64 (transformers' _compute_default_rope_parameters and
    _compute_llama3_parameters / linear scaling, without the float32 casts)."""
    hd = cfg.hidden_size // cfg.num_attention_heads
    f = 1.0 / (cfg.rope_theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd))
    rs = getattr(cfg, "rope_scaling", None)
    if rs:
        kind = rs.get("rope_type", rs.get("type"))
        if kind == "linear":
            f = f / rs["factor"]
        elif kind == "llama3":
            factor, lo, hi, old = rs["factor"], rs["low_freq_factor"], rs["high_freq_factor"], \
                rs["original_max_position_embeddings"]
            wavelen = 2 * math.pi / f
            scaled = np.where(wavelen > old / lo, f / factor, f)
            smooth = (old / wavelen - lo) / (hi - lo)
            smoothed = (1 - smooth) * scaled / factor + smooth * scaled
            medium = ~(wavelen < old / hi) & ~(wavelen > old / lo)
            f = np.where(medium, smoothed, scaled)
        elif kind != "default":
            raise ValueError(kind)
    return torch.tensor(f, dtype=torch.float64)


STOCK = {}


def rms_forward64(self, x):
    variance = x.pow(2).mean(-1, keepdim=True)
    return self.weight * (x * torch.rsqrt(variance + self.variance_epsilon))


def llama_rope_forward64(self, x, position_ids):
    freqs = position_ids[:, :, None].to(torch.float64) * self.inv_freq[None, None, :].to(torch.float64)
    emb = torch.cat((freqs, freqs), dim=-1)
    return emb.cos().to(x.dtype), emb.sin().to(x.dtype)


def softmax64(input, dim=None, _stacklevel=3, dtype=None):
    if dtype == torch.float32 and input.dtype == torch.float64:
        dtype = torch.float64
    return STOCK["softmax"](input, dim=dim, _stacklevel=_stacklevel, dtype=dtype)


def set_patches(on):
    if not STOCK:
        STOCK.update(softmax=torch.nn.functional.softmax, llama_rms=modeling_llama.LlamaRMSNorm.forward,
                     qwen2_rms=modeling_qwen2.Qwen2RMSNorm.forward,
                     llama_rope=modeling_llama.LlamaRotaryEmbedding.forward)
    torch.nn.functional.softmax = softmax64 if on else STOCK["softmax"]
    modeling_llama.LlamaRMSNorm.forward = rms_forward64 if on else STOCK["llama_rms"]
    modeling_qwen2.Qwen2RMSNorm.forward = rms_forward64 if on else STOCK["qwen2_rms"]
    modeling_llama.LlamaRotaryEmbedding.forward = llama_rope_forward64 if on else STOCK["llama_rope"]


def use_f64_rope(model):
    """Replaces every rotary module's float32 inverse frequencies (and Qwen2's cos/sin cache)."""
    inv = inv_freq64(model.config)
    for mod in model.modules():
        name = type(mod).__name__
        if name.endswith("RotaryEmbedding"):
            stock = mod.inv_freq.to(torch.float64)
            assert torch.allclose(stock, inv, rtol=1e-6, atol=0), (stock, inv)  # same formula as transformers'
            assert getattr(mod, "attention_scaling", 1.0) == 1.0
            mod.inv_freq = inv.clone()
            if hasattr(mod, "_set_cos_sin_cache"):  # Qwen2 in transformers 4.44
                mod._set_cos_sin_cache(seq_len=mod.max_position_embeddings, device=inv.device, dtype=torch.float64)


def logits64(model, ids, keep):
    """The patched float64 forward: HF's modules, lm_head on the final hidden states."""
    set_patches(True)
    try:
        with torch.no_grad():
            h = model.model(input_ids=ids, attention_mask=keep).last_hidden_state
            return model.lm_head(h)
    finally:
        set_patches(False)


def stock_logits(model, ids, keep):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=keep).logits.to(torch.float64)


def rel(a, b):
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    return float(np.max(np.abs(a - b)) / np.max(np.abs(b)))


# ---- models -------------------------------------------------------------------------------------

def randomise(model):
    """Weights large enough that every part of the model moves the logits: Linear ~ U(+-1/sqrt(in)),
    biases U(+-0.2), norms 1 + 0.1 N(0, 1), embeddings N(0, 1)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(torch.tensor(1.0 + 0.1 * rng.standard_normal(p.shape)))
            elif "embed_tokens" in name:
                p.copy_(torch.tensor(rng.standard_normal(p.shape)))
            elif name.endswith(".bias"):
                p.copy_(torch.tensor(rng.uniform(-0.2, 0.2, p.shape)))
            else:
                bound = 1 / math.sqrt(p.shape[1])
                p.copy_(torch.tensor(rng.uniform(-bound, bound, p.shape)))


def randomise_f32(model, gen, norm_center=1.0):
    """randomise's draws (no biases) from the generator `gen`, rounded to float32 (the folders store
    F32) and used in float64; norms norm_center + 0.1 N(0, 1) (0 for Gemma, whose norms scale by
    1 + w)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                a = norm_center + 0.1 * gen.standard_normal(p.shape)
            elif "embed_tokens" in name:
                a = gen.standard_normal(p.shape)
            else:
                b = 1 / math.sqrt(p.shape[1])
                a = gen.uniform(-b, b, p.shape)
            p.copy_(torch.tensor(a.astype(np.float32).astype(np.float64)))


def save_f32_folder(model, folder):
    """save_pretrained in float32, keeping config.json and model.safetensors; the model stays float64."""
    shutil.rmtree(folder, ignore_errors=True)
    model.to(torch.float32).save_pretrained(folder, safe_serialization=True)
    for f in os.listdir(folder):
        if f not in ("config.json", "model.safetensors"):
            os.remove(os.path.join(folder, f))
    model.to(torch.float64)


def set_inv_freq64(model, theta, hd):
    """Every rotary module's inverse frequencies in float64 (checked against transformers' own)."""
    inv = torch.tensor(1.0 / (theta ** (np.arange(0, hd, 2, dtype=np.float64) / hd)))
    for mod in model.modules():
        if type(mod).__name__.endswith("RotaryEmbedding"):
            assert torch.allclose(mod.inv_freq.to(torch.float64), inv, rtol=1e-6, atol=0)
            mod.inv_freq = inv.clone()


def family_logits64(model, ids, keep, module, prefix, rms_forward=None, **kwargs):
    """The patched float64 forward of a family with its own RMSNorm and rotary classes (transformers
    4.44: `module`.<prefix>RMSNorm / <prefix>RotaryEmbedding, whose forward takes seq_len too):
    lm_head on model.model's hidden states."""
    rms_cls, rope_cls = getattr(module, prefix + "RMSNorm"), getattr(module, prefix + "RotaryEmbedding")
    stock = (rms_cls.forward, rope_cls.forward)
    with torch.no_grad():
        set_patches(True)
        rms_cls.forward = rms_forward or rms_forward64
        rope_cls.forward = lambda self, x, position_ids, seq_len=None: llama_rope_forward64(self, x, position_ids)
        try:
            return model.lm_head(model.model(input_ids=ids, attention_mask=keep, **kwargs).last_hidden_state)
        finally:
            set_patches(False)
            rms_cls.forward, rope_cls.forward = stock


def make_inputs():
    ids = rng.integers(3, V, size=(B, T))
    keep = np.zeros((B, T), dtype=np.int64)
    for b, n in enumerate(LENGTHS):
        keep[b, :n] = 1
        ids[b, n:] = 0  # the pad id: never attended to
    return torch.tensor(ids), torch.tensor(keep)


def write_folder(name, cfg, storage, shard):
    cls = LlamaForCausalLM if cfg.model_type == "llama" else Qwen2ForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg).to(torch.float64)
    randomise(model)
    folder = os.path.join(OUT, name)
    shutil.rmtree(folder, ignore_errors=True)
    kwargs = {"max_shard_size": shard} if shard else {}
    model.to(storage).save_pretrained(folder, safe_serialization=True, **kwargs)
    for extra in ("generation_config.json",):
        if os.path.exists(os.path.join(folder, extra)):
            os.remove(os.path.join(folder, extra))
    # The reference is HF's own load of what was written, computing in float64.
    ref = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=torch.float64, attn_implementation="eager")
    ref.eval()
    return folder, ref


# ---- GGUF ---------------------------------------------------------------------------------------

def hf_permute(w, n_head, n_head_kv):
    """convert_hf_to_gguf.py LlamaModel.permute."""
    if n_head_kv is not None and n_head != n_head_kv:
        n_head = n_head_kv
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def hf_unpermute(w, n_head):
    return w.reshape(n_head, w.shape[0] // n_head // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


GGUF_PARTS = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
              "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
              "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
              "mlp.down_proj": "ffn_down"}


def gguf_name(hf):
    if hf == "model.embed_tokens.weight":
        return "token_embd.weight"
    if hf == "model.norm.weight":
        return "output_norm.weight"
    if hf == "lm_head.weight":
        return "output.weight"
    parts = hf.split(".")  # model.layers.N.<part...>.<leaf>
    layer, part, leaf = parts[2], ".".join(parts[3:-1]), parts[-1]
    return f"blk.{layer}.{GGUF_PARTS[part]}.{leaf}"


TOKENS = ["<unk>", "<s>", "</s>"] + [f"t{i}" for i in range(3, V)]
MERGES = ["t 1", "t 2", "t1 0", "Ġ t"]
EXTRA_META = [  # (key, value, type, sub_type): every value type the format has
    ("test.u8", 200, VT.UINT8, None), ("test.i8", -100, VT.INT8, None), ("test.u16", 60000, VT.UINT16, None),
    ("test.i16", -30000, VT.INT16, None), ("test.u32", 4000000000, VT.UINT32, None),
    ("test.i32", -2000000000, VT.INT32, None), ("test.f32", 0.25, VT.FLOAT32, None), ("test.bool", True, VT.BOOL, None),
    ("test.string", "héllo", VT.STRING, None), ("test.u64", 18000000000000000000, VT.UINT64, None),
    ("test.i64", -9000000000000000000, VT.INT64, None), ("test.f64", 1e-300, VT.FLOAT64, None),
    ("test.i16s", [-1, 2, -3], VT.ARRAY, VT.INT16), ("test.f64s", [0.5, -1.5], VT.ARRAY, VT.FLOAT64),
    ("test.bools", [True, False, True], VT.ARRAY, VT.BOOL), ("test.nested", [[1, 2], [3]], VT.ARRAY, None),
]


def write_gguf(path, model, arch, qtype, alignment=None, extra=False):
    cfg = model.config
    w = gguf.GGUFWriter(path, arch)
    if alignment:
        w.add_custom_alignment(alignment)
    w.add_name(f"tiny-{arch}")
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_block_count(cfg.num_hidden_layers)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(cfg.num_attention_heads)
    w.add_head_count_kv(cfg.num_key_value_heads)
    w.add_rope_freq_base(cfg.rope_theta)
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_rope_dimension_count(cfg.hidden_size // cfg.num_attention_heads)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("default")
    w.add_token_list(TOKENS)
    w.add_token_types([3, 3, 3] + [1] * (V - 3))
    w.add_token_merges(MERGES)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    if extra:
        for key, val, vt, sub in EXTRA_META:
            w.add_key_value(key, val, vt, sub_type=sub)
    state = {k: v.detach().numpy() for k, v in model.state_dict().items() if "rotary_emb" not in k}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    for hf, t in state.items():
        t = t.astype(np.float32)
        if arch == "llama" and (".q_proj." in hf):
            t = hf_permute(t, cfg.num_attention_heads, cfg.num_attention_heads)
        if arch == "llama" and (".k_proj." in hf):
            t = hf_permute(t, cfg.num_attention_heads, cfg.num_key_value_heads)
        name = gguf_name(hf)
        if t.ndim == 1 or qtype == Q.F32:  # as the converter: 1-D tensors stay F32
            w.add_tensor(name, t)
        elif qtype == Q.F16:
            w.add_tensor(name, gguf.quants.quantize(t, Q.F16))
        else:
            w.add_tensor(name, gguf.quants.quantize(t, qtype), raw_dtype=qtype)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def gguf_reference(path, model, arch):
    """Reads `path` back with gguf-py, dequantises every tensor, undoes the permutation, and runs
    the HF model on those weights. Returns (logits, {gguf name: dequantised array as stored})."""
    cfg = model.config
    reader = gguf.GGUFReader(path)
    deq = {}
    for t in reader.tensors:
        shape = tuple(int(x) for x in reversed(t.shape.tolist()))
        deq[t.name] = gguf.quants.dequantize(t.data, t.tensor_type).reshape(shape).astype(np.float32)
    ref = type(model)(cfg).to(torch.float64)
    sd = {}
    for hf in ref.state_dict():
        if "rotary_emb" in hf or (cfg.tie_word_embeddings and hf == "lm_head.weight"):
            continue
        a = deq[gguf_name(hf)].astype(np.float64)
        if arch == "llama" and ".q_proj." in hf:
            a = hf_unpermute(a, cfg.num_attention_heads)
        if arch == "llama" and ".k_proj." in hf:
            a = hf_unpermute(a, cfg.num_key_value_heads)
        sd[hf] = torch.tensor(a)
    missing, unexpected = ref.load_state_dict(sd, strict=False)
    assert all("rotary_emb" in k or k == "lm_head.weight" for k in missing), missing
    assert not unexpected
    ref.tie_weights()
    ref.eval()
    use_f64_rope(ref)
    return ref, deq


# ---- main ---------------------------------------------------------------------------------------

def main():
    os.makedirs(OUT, exist_ok=True)
    ids, keep = make_inputs()
    tensors = {"ids": ids.to(torch.float64), "keep": keep.to(torch.float64)}
    report = {"transformers": transformers.__version__, "torch": torch.__version__, "gguf": "gguf-py",
              "B": B, "T": T, "lengths": LENGTHS, "errors": {}}
    refs = {}
    for name, (cfg, storage, shard) in CASES.items():
        folder, ref = write_folder(name, cfg, storage, shard)
        stock = stock_logits(ref, ids, keep)
        use_f64_rope(ref)
        lg = logits64(ref, ids, keep)
        err = rel(stock.numpy(), lg.numpy())
        assert err < 2e-5, (name, err)  # the patches change precision, not the model
        report["errors"][f"{name}: stock transformers (float32 internals) vs float64 forward"] = err
        tensors[f"{name}.logits"] = lg
        refs[name] = ref
        print(f"{name}: logits {tuple(lg.shape)}, stock-vs-f64 {err:.2e}, files {sorted(os.listdir(folder))}")

    gdir = os.path.join(OUT, "gguf")
    shutil.rmtree(gdir, ignore_errors=True)
    os.makedirs(gdir)
    llama = refs["llama"]
    for qt in (Q.F32, Q.F16, Q.BF16, Q.Q8_0, Q.Q4_0, Q.Q4_1):
        path = os.path.join(gdir, f"llama-{qt.name}.gguf")
        write_gguf(path, llama, "llama", qt, alignment=64 if qt == Q.Q8_0 else None, extra=qt == Q.F32)
        ref, deq = gguf_reference(path, llama, "llama")
        lg = logits64(ref, ids, keep)
        tensors[f"gguf_{qt.name}.logits"] = lg
        for n in ("blk.0.attn_k.weight", "blk.1.ffn_down.weight"):
            tensors[f"gguf_{qt.name}.{n}"] = torch.tensor(deq[n])  # float32: dequantised values are exact in it
        q_err = rel(lg.numpy(), tensors["llama.logits"].numpy())
        report["errors"][f"gguf {qt.name}: quantised-model logits vs the llama model's"] = q_err
        print(f"gguf {qt.name}: {os.path.getsize(path)} bytes, logits vs unquantised {q_err:.2e}")
    path = os.path.join(gdir, "qwen2-F16.gguf")
    write_gguf(path, refs["qwen2"], "qwen2", Q.F16)
    ref, _ = gguf_reference(path, refs["qwen2"], "qwen2")
    tensors["gguf_qwen2_F16.logits"] = logits64(ref, ids, keep)

    from safetensors.torch import save_file
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(OUT, "expected.safetensors"))
    report["gguf_metadata"] = {
        "tokens": TOKENS, "merges": MERGES, "token_type": [3, 3, 3] + [1] * (V - 3), "bos": 1, "eos": 2,
        "model": "gpt2", "pre": "default",
        "extra": {k: v for k, v, _, _ in EXTRA_META},
    }
    with open(os.path.join(OUT, "expected.json"), "w") as f:
        json.dump(report, f, indent=1, ensure_ascii=False)
        f.write("\n")
    total = sum(os.path.getsize(os.path.join(dp, fn)) for dp, _, fns in os.walk(OUT) for fn in fns)
    print(f"wrote {OUT} ({total} bytes)")


if __name__ == "__main__":
    main()
