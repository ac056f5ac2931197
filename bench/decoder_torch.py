# SPDX-License-Identifier: MIT OR Apache-2.0
# The reference workload, PyTorch's side: the Llama-style decoder of bench/decoder.cpp in PyTorch
# eager, written as Hugging Face's LlamaForCausalLM computes it with attn_implementation="eager"
# (rotate_half RoPE, repeat_kv, matmul + additive causal mask + float32 softmax, manual RMSNorm),
# timed on the same token stream; bench/run_decoder.sh runs both sides.
#
#   python3 bench/decoder_torch.py [--mode full|lora|forward] [--threads N] [--steps N] [--warmup N]
#                                  [--attn eager|sdpa] [--compile] [--device cpu|cuda] [--size small|gpu]
#
# --device cuda --size gpu is bench/decoder_cuda.cu's GPU workload (d 1024, 12 layers, 16/4 heads
# of 64, SwiGLU 2816, vocab 32000; pass --batch 8 --seq 1024), with TF32 off (nn's f32 products
# are full float32) and bf16 under torch.autocast('cuda'); bench/run_decoder_cuda.sh runs it.
#
# --compile runs the model under torch.compile (Inductor, its default mode): the stronger anchor
# for a compiled step. Compilation happens in the warm-up steps (at least 3 with --compile), which
# are not timed.
#
# --attn sdpa swaps in F.scaled_dot_product_attention(is_causal=True) (HF's default on PyTorch 2),
# a fused kernel that also skips the masked half of the scores: a stronger reference than the
# same-algorithm comparison, reported beside it. Prints one `RESULT key=value ...` line; FLOPs are
# counted with the formula bench/decoder.cpp uses (the full T x T attention square, also for sdpa).
import argparse
import math
import os
import resource
import time


def rss_kb(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return -1


def splitmix64(s):
    s = (s + 0x9E3779B97F4A7C15) & 0xFFFFFFFFFFFFFFFF
    z = s
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & 0xFFFFFFFFFFFFFFFF
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & 0xFFFFFFFFFFFFFFFF
    return s, z ^ (z >> 31)


def batch(i, B, T, V):
    """bench/decoder.cpp's batch i: ids and next-token targets from splitmix64 seeded with i."""
    s, ids, tg = i, [], []
    for _ in range(B):
        s, w = splitmix64(s)
        prev, ri, rt = w % V, [], []
        for _ in range(T):
            s, w = splitmix64(s)
            ri.append(prev)
            rt.append(w % V)
            prev = w % V
        ids.append(ri)
        tg.append(rt)
    return ids, tg


def step_flops(c, mode, B, T):
    """bench/decoder.cpp's step_flops."""
    tok, d, q, kv, ff, L, V = B * T, c["dim"], c["heads"] * c["hd"], c["kv"] * c["hd"], c["ff"], c["layers"], c["vocab"]
    weights = L * (d * q + 2 * d * kv + q * d + 3 * d * ff) + d * V
    attn = L * 4.0 * B * c["heads"] * T * T * c["hd"]
    fwd = 2 * tok * weights + attn
    if mode == "forward":
        return fwd
    if mode == "full":
        return 3 * fwd
    r = c["rank"]
    lora = L * tok * 2 * (r * (d + q) + r * (d + kv) * 2 + r * (q + d))
    return fwd + (2 * tok * (weights - (d * q + 2 * d * kv)) + 2 * attn) + 3 * lora


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--mode", choices=("full", "lora", "forward"), default="full")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--attn", choices=("eager", "sdpa"), default="eager")
    ap.add_argument("--compile", action="store_true", help="the model under torch.compile (warm-up compiles)")
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--size", choices=("small", "gpu"), default="small",
                    help="gpu: the decoder scaled to a GPU (bench/decoder_model.hpp's Config::gpu)")
    ap.add_argument("--precision", choices=("f32", "bf16"), default="f32",
                    help="bf16: the forward under torch.autocast('cpu', dtype=torch.bfloat16)")
    args = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = str(args.threads)
    rss_start = rss_kb("VmRSS")

    import torch
    import torch.nn.functional as F
    from torch import nn

    rss_import = rss_kb("VmRSS")  # the libraries' share of the peak
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    c = dict(vocab=8192, dim=256, layers=4, heads=8, kv=2, hd=32, ff=704, eps=1e-5, base=10000.0, rank=8, scale=2.0)
    if args.size == "gpu":
        c.update(vocab=32000, dim=1024, layers=12, heads=16, kv=4, hd=64, ff=2816)
    dev = torch.device(args.device)
    if args.device == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    B, T = args.batch, args.seq

    class RMSNorm(nn.Module):  # HF LlamaRMSNorm
        def __init__(self, d):
            super().__init__()
            self.weight = nn.Parameter(torch.ones(d))

        def forward(self, x):
            var = x.pow(2).mean(-1, keepdim=True)
            return self.weight * (x * torch.rsqrt(var + c["eps"]))

    class LoRALinear(nn.Module):  # mlx-lm's LoRALinear: y = base(x) + scale (x A) B
        def __init__(self, base, r, scale):
            super().__init__()
            self.base, self.scale = base, scale
            self.lora_a = nn.Parameter(torch.empty(base.in_features, r).uniform_(-1, 1) / math.sqrt(base.in_features))
            self.lora_b = nn.Parameter(torch.zeros(r, base.out_features))

        def forward(self, x):
            return self.base(x) + (self.scale * (x @ self.lora_a)) @ self.lora_b

    def rotate_half(x):
        h = x.shape[-1] // 2
        return torch.cat((-x[..., h:], x[..., :h]), dim=-1)

    class Attention(nn.Module):
        def __init__(self):
            super().__init__()
            d, hd = c["dim"], c["hd"]
            self.q_proj = nn.Linear(d, c["heads"] * hd, bias=False)
            self.k_proj = nn.Linear(d, c["kv"] * hd, bias=False)
            self.v_proj = nn.Linear(d, c["kv"] * hd, bias=False)
            self.o_proj = nn.Linear(c["heads"] * hd, d, bias=False)

        def forward(self, x, cos, sin, mask):
            Bn, Tn, _ = x.shape
            hd, H, KV = c["hd"], c["heads"], c["kv"]
            q = self.q_proj(x).view(Bn, Tn, H, hd).transpose(1, 2)
            k = self.k_proj(x).view(Bn, Tn, KV, hd).transpose(1, 2)
            v = self.v_proj(x).view(Bn, Tn, KV, hd).transpose(1, 2)
            q = q * cos + rotate_half(q) * sin
            k = k * cos + rotate_half(k) * sin
            if args.attn == "sdpa":
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            else:
                g = H // KV  # HF repeat_kv
                k = k[:, :, None].expand(Bn, KV, g, Tn, hd).reshape(Bn, H, Tn, hd)
                v = v[:, :, None].expand(Bn, KV, g, Tn, hd).reshape(Bn, H, Tn, hd)
                s = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(hd) + mask
                p = F.softmax(s, dim=-1, dtype=torch.float32)
                o = torch.matmul(p, v)
            return self.o_proj(o.transpose(1, 2).reshape(Bn, Tn, H * hd))

    class Mlp(nn.Module):
        def __init__(self):
            super().__init__()
            self.gate_proj = nn.Linear(c["dim"], c["ff"], bias=False)
            self.up_proj = nn.Linear(c["dim"], c["ff"], bias=False)
            self.down_proj = nn.Linear(c["ff"], c["dim"], bias=False)

        def forward(self, x):
            return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.input_layernorm = RMSNorm(c["dim"])
            self.self_attn = Attention()
            self.post_attention_layernorm = RMSNorm(c["dim"])
            self.mlp = Mlp()

        def forward(self, h, cos, sin, mask):
            h = h + self.self_attn(self.input_layernorm(h), cos, sin, mask)
            return h + self.mlp(self.post_attention_layernorm(h))

    class Decoder(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = nn.Embedding(c["vocab"], c["dim"])
            self.layers = nn.ModuleList(Block() for _ in range(c["layers"]))
            self.norm = RMSNorm(c["dim"])
            self.lm_head = nn.Linear(c["dim"], c["vocab"], bias=False)
            hd = c["hd"]
            inv = 1.0 / (c["base"] ** (torch.arange(0, hd, 2, dtype=torch.float32) / hd))
            ang = torch.outer(torch.arange(T, dtype=torch.float32), inv)
            emb = torch.cat((ang, ang), dim=-1)
            self.register_buffer("cos", emb.cos(), persistent=False)
            self.register_buffer("sin", emb.sin(), persistent=False)
            self.register_buffer("mask", torch.full((T, T), -1e9).triu(1), persistent=False)

        def forward(self, ids, targets):
            h = self.embed_tokens(ids)
            for layer in self.layers:
                h = layer(h, self.cos, self.sin, self.mask)
            logits = self.lm_head(self.norm(h))
            return F.cross_entropy(logits.view(-1, c["vocab"]), targets.view(-1))

    model = Decoder()
    if args.mode == "lora":
        for p in model.parameters():
            p.requires_grad_(False)
        for layer in model.layers:
            a = layer.self_attn
            for name in ("q_proj", "k_proj", "v_proj", "o_proj"):
                setattr(a, name, LoRALinear(getattr(a, name), c["rank"], c["scale"]))
    model.to(dev)
    trainable = [p for p in model.parameters() if p.requires_grad]
    if args.compile:
        model = torch.compile(model)
        args.warmup = max(args.warmup, 3)
    opt = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.01) if trainable else None
    data = [tuple(torch.tensor(t, dtype=torch.long, device=dev) for t in batch(i, B, T, c["vocab"])) for i in range(4)]

    def run(i):
        ids, tg = data[i % len(data)]
        with torch.autocast(args.device, dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            if args.mode == "forward":
                with torch.no_grad():
                    return model(ids, tg).item()
            loss = model(ids, tg)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return loss.item()

    first = None
    for i in range(args.warmup):
        v = run(i)
        first = v if first is None else first
    ms = []
    cpu0 = time.process_time()
    t_all = time.perf_counter()
    for i in range(args.steps):
        t0 = time.perf_counter()
        last = run(args.warmup + i)
        ms.append((time.perf_counter() - t0) * 1e3)
    total = time.perf_counter() - t_all
    cpu_ms = (time.process_time() - cpu0) * 1e3 / args.steps
    med = sorted(ms)[len(ms) // 2]
    flops = step_flops(c, args.mode, B, T)
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    print(f"RESULT impl=torch mode={args.mode} threads={args.threads} tok_s={B * T / (med / 1e3):.1f} "
          f"median_ms={med:.2f} mean_ms={total * 1e3 / args.steps:.2f} min_ms={min(ms):.2f} cpu_ms={cpu_ms:.2f} "
          f"gflops={flops / (med / 1e3) / 1e9:.1f} rss_peak_mb={peak_kb / 1024:.1f} rss_start_mb={rss_start / 1024:.1f} "
          f"rss_import_mb={rss_import / 1024:.1f} "
          f"loss_first={first:.4f} loss_last={last:.4f} params={sum(p.numel() for p in model.parameters())} "
          f"trainable={sum(p.numel() for p in trainable)} attn={args.attn} version={torch.__version__} "
          f"device={args.device} precision={args.precision} compile={int(args.compile)} "
          f"tflops={flops / (med / 1e3) / 1e12:.2f}"
          + (f" gpu_peak_gb={torch.cuda.max_memory_allocated() / 1e9:.2f}" if args.device == "cuda" else ""), flush=True)


if __name__ == "__main__":
    main()
