#!/usr/bin/env python3
# SPDX-License-Identifier: MIT OR Apache-2.0
# bench_attention's workload in PyTorch: causal scaled_dot_product_attention (its CPU flash
# kernel) forward + backward, H = 9, KV = 3 (enable_gqa), head_dim = 64, B * T = 4096 tokens,
# float32, each case in its own child process (peak RSS per case). One RESULT line per T.
#
#   attention_torch.py [--threads N] [--seconds S] [--t 256,1024,4096]
import argparse
import multiprocessing as mp
import resource
import statistics
import time


def measure(T, seconds, threads, conn):
    import torch
    import torch.nn.functional as F

    torch.set_num_threads(threads)
    H, KV, hd, tokens = 9, 3, 64, 4096
    B = max(1, tokens // T)
    g = torch.Generator().manual_seed(1)
    q = (torch.rand(B, H, T, hd, generator=g) * 2 - 1).requires_grad_()
    k = (torch.rand(B, KV, T, hd, generator=g) * 2 - 1).requires_grad_()
    v = (torch.rand(B, KV, T, hd, generator=g) * 2 - 1).requires_grad_()
    dy = torch.rand(B, H, T, hd, generator=g) * 2 - 1

    def timed(backward):
        ms, start = [], time.perf_counter()
        while time.perf_counter() - start < seconds or len(ms) < 3:
            t0 = time.perf_counter()
            if backward:
                y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
                y.backward(dy)
            else:
                with torch.no_grad():
                    F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            ms.append((time.perf_counter() - t0) * 1e3)
            q.grad = k.grad = v.grad = None
        return statistics.median(ms)

    fwd, step = timed(False), timed(True)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    conn.send((fwd, step, peak, torch.__version__))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--seconds", type=float, default=2.0)
    ap.add_argument("--t", default="256,1024,4096")
    a = ap.parse_args()
    ctx = mp.get_context("fork")
    for T in [int(x) for x in a.t.split(",")]:
        parent, child = ctx.Pipe()
        p = ctx.Process(target=measure, args=(T, a.seconds, a.threads, child))
        p.start()
        fwd, step, peak, version = parent.recv()
        p.join()
        print(f"RESULT kernel=torch T={T} fwd_ms={fwd:.2f} step_ms={step:.2f} peak_mb={peak:.0f} version={version}")


if __name__ == "__main__":
    main()
