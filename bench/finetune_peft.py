# SPDX-License-Identifier: MIT OR Apache-2.0
# The finetune workload, PyTorch's side: LoRA steps with Hugging Face transformers + PEFT on the
# same model file bench_finetune loads (a GGUF is dequantised by transformers to float32), the
# same batches (bench::batch's splitmix64 stream), rank, scale (lora_alpha = scale * rank), target
# modules and Adam; bench/run_finetune.sh runs both sides.
#
#   python3 bench/finetune_peft.py --model PATH [--threads N] [--steps N] [--warmup N] [--batch B]
#                                  [--seq T] [--rank 8] [--scale 20] [--keys q_proj,v_proj]
#                                  [--attn sdpa|eager] [--full N]
#
# --full N: no PEFT; the last N decoder layers' own weights trained (-1: all; the embedding, final
# norm and head frozen, as mlx-lm's and bench_finetune's --full).
#
# transformers' default attention on PyTorch 2 is sdpa (what a PEFT user gets); --attn eager is
# the same algorithm nn runs. Prints one `RESULT key=value ...` line (tokens/s from the median step).
import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from decoder_torch import batch, rss_kb  # noqa: E402  (the shared token stream and RSS reader)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--rank", type=int, default=8)
    ap.add_argument("--scale", type=float, default=20.0)
    ap.add_argument("--keys", default="q_proj,v_proj")
    ap.add_argument("--attn", choices=("sdpa", "eager"), default="sdpa")
    ap.add_argument("--full", type=int, default=None, help="train the last N layers' weights (-1: all), no LoRA")
    ap.add_argument("--precision", choices=("f32", "bf16"), default="f32",
                    help="bf16: the forward under torch.autocast('cpu', dtype=torch.bfloat16)")
    args = ap.parse_args()
    for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[v] = str(args.threads)
    rss_start = rss_kb("VmRSS")
    import torch
    import transformers
    import peft

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    path = args.model
    if path.endswith(".gguf"):
        model = transformers.AutoModelForCausalLM.from_pretrained(
            os.path.dirname(path), gguf_file=os.path.basename(path), torch_dtype=torch.float32,
            attn_implementation=args.attn)
    else:
        model = transformers.AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32,
                                                                  attn_implementation=args.attn)
    cfg = peft.LoraConfig(r=args.rank, lora_alpha=args.scale * args.rank, lora_dropout=0.0,
                          target_modules=args.keys.split(","), bias="none", task_type="CAUSAL_LM")
    if args.full is None:
        model = peft.get_peft_model(model, cfg)
    else:
        for p in model.parameters():
            p.requires_grad_(False)
        layers = model.model.layers
        first = 0 if args.full < 0 else len(layers) - args.full
        for layer in layers[first:]:
            for p in layer.parameters():
                p.requires_grad_(True)
    model.train()
    opt = torch.optim.Adam([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    V = model.config.vocab_size
    data = [tuple(torch.tensor(x, dtype=torch.long) for x in batch(i, args.batch, args.seq, V)) for i in range(4)]
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(i):
        ids, tg = data[i % len(data)]
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=args.precision == "bf16"):
            logits = model(input_ids=ids).logits
            loss = loss_fn(logits.reshape(-1, V).float(), tg.reshape(-1))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.item()

    first = run(0)
    for i in range(1, args.warmup):
        run(i)
    ms, last = [], 0.0
    cpu0 = time.process_time()
    for i in range(args.steps):
        t0 = time.perf_counter()
        last = run(args.warmup + i)
        ms.append((time.perf_counter() - t0) * 1e3)
    cpu_ms = (time.process_time() - cpu0) * 1e3 / args.steps
    ms.sort()
    med = ms[len(ms) // 2]
    trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
    print(f"RESULT impl=torch threads={args.threads} tok_s={args.batch * args.seq / (med / 1e3):.1f} "
          f"median_ms={med:.2f} min_ms={ms[0]:.2f} cpu_ms={cpu_ms:.2f} rss_peak_mb={rss_kb('VmHWM') / 1024:.1f} "
          f"rss_start_mb={rss_start / 1024:.1f} rss_now_mb={rss_kb('VmRSS') / 1024:.1f} loss_first={first:.4f} "
          f"loss_last={last:.4f} trainable={trainable} mode={'lora' if args.full is None else 'full'} precision={args.precision} attn={args.attn} version={torch.__version__}/peft-{peft.__version__}/transformers-{transformers.__version__}")


if __name__ == "__main__":
    main()
