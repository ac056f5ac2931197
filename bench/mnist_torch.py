# SPDX-License-Identifier: MIT OR Apache-2.0
# MLX's MNIST example model (mlx-examples mnist/main.py) in PyTorch eager on Fashion-MNIST: the
# second reference for examples/mnist (same MLP, SGD, batch, epochs; see bench/mnist_mlx.py).
#
#   python3 bench/mnist_torch.py [--epochs 10] [--hidden 256] [--layers 2] [--threads N] [--data DIR]
#
# When MLX is importable (--init mlx, the default then), the initial weights and each epoch's
# permutation are MLX's draws for the seed, the ones nn and bench/mnist_mlx.py use, so all three
# train from the same weights on the same batches; --init torch draws them with torch's generator
# from the same distribution (U(+-1/sqrt(in)) for weight and bias, MLX's Linear init). PyTorch
# runs eager (the reference nn is compared with). Prints per-epoch loss, test accuracy and
# training samples/s.
import argparse
import os
import time

import numpy as np

from mnist_mlx import load


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--init", choices=("mlx", "torch"), default=None, help="default: mlx when importable")
    ap.add_argument("--data", default=os.environ.get("NN_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    args = ap.parse_args()
    if args.threads:
        for v in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[v] = str(args.threads)

    import torch

    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    tx, ty, vx, vy = (torch.from_numpy(np.ascontiguousarray(a)) for a in load(args.data))
    ty, vy = ty.long(), vy.long()

    sizes = [784] + [args.hidden] * args.layers + [10]
    mx = None
    if args.init != "torch":
        try:
            import mlx.core as mx
            import mlx.nn as mnn
        except ImportError:
            if args.init == "mlx":
                raise
    layers = []
    if mx is not None:
        mx.random.seed(args.seed)
        mlx_layers = [mnn.Linear(a, b) for a, b in zip(sizes[:-1], sizes[1:])]  # MLX's draw order
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        lin = torch.nn.Linear(a, b)
        with torch.no_grad():
            if mx is not None:
                lin.weight.copy_(torch.from_numpy(np.array(mlx_layers[i].weight)))
                lin.bias.copy_(torch.from_numpy(np.array(mlx_layers[i].bias)))
            else:
                bound = 1.0 / a**0.5
                torch.nn.init.uniform_(lin.weight, -bound, bound)
                torch.nn.init.uniform_(lin.bias, -bound, bound)
        layers.append(lin)
        if i + 2 < len(sizes):
            layers.append(torch.nn.ReLU())
    model = torch.nn.Sequential(*layers)

    def permutation(n):
        if mx is not None:
            return torch.from_numpy(np.array(mx.random.permutation(n)).astype(np.int64))
        return torch.randperm(n)

    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss_fn = torch.nn.CrossEntropyLoss()

    n = ty.numel()
    print(f"torch {torch.__version__} ({torch.get_num_threads()} threads): MLP {args.layers}x{args.hidden}, "
          f"batch {args.batch}, SGD lr {args.lr}, {'MLX' if mx is not None else 'torch'} init and shuffle, "
          f"{n} training / {vy.numel()} test images", flush=True)
    acc = 0.0
    for e in range(args.epochs):
        tic = time.perf_counter()
        perm = permutation(n)
        total, steps = 0.0, 0
        for s in range(0, n, args.batch):
            ids = perm[s : s + args.batch]
            loss = loss_fn(model(tx[ids]), ty[ids])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            total += loss.item()
            steps += 1
        train_s = time.perf_counter() - tic
        with torch.no_grad():
            acc = (model(vx).argmax(1) == vy).float().mean().item()
        print(f"epoch {e + 1}/{args.epochs}: loss {total / steps:.4f}, test accuracy {100 * acc:.2f}%, "
              f"{n / train_s:,.0f} samples/s", flush=True)
    print(f"final test accuracy {100 * acc:.2f}%")


if __name__ == "__main__":
    main()
