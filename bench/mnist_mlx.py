# SPDX-License-Identifier: MIT OR Apache-2.0
# MLX's MNIST example (mlx-examples mnist/main.py) on Fashion-MNIST, the reference that
# examples/mnist reproduces with nn: same MLP, same SGD, same batches, a compiled step.
#
#   python3 bench/mnist_mlx.py [--epochs 10] [--hidden 256] [--layers 2] [--threads N] [--data DIR]
#
# MLX's defaults are kept (num_layers 2, batch 256, SGD lr 0.1, 10 epochs, seed 0, the last
# partial batch included) except hidden_dim: 256 instead of 32, because MLX's exact model ends
# the 10 epochs at 84.9% test accuracy on Fashion-MNIST (seed 0), short of
# the 85% this benchmark holds every implementation to;
# `--hidden 32` runs it. nn (examples/mnist) and PyTorch (bench/mnist_torch.py) use the same
# variant. Two more choices shared by all three: the data are Debian's dataset-fashion-mnist
# (MLX's `--dataset fashion_mnist` downloads the same files), and each epoch is shuffled with
# mx.random.permutation (MLX's own generator; the example uses NumPy's), so nn, whose Linear init
# and permutation draw MLX's values for a seed, starts from the same weights and sees the same
# batches. Prints per-epoch loss, test accuracy and training samples/s.
import argparse
import gzip
import os
import struct
import time

import numpy as np


def read_idx(path):
    """A u8 IDX file (gzip'd or not) as a NumPy array of its dims."""
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    if raw[:3] != b"\x00\x00\x08":
        raise ValueError(f"{path} is not a u8 IDX file")
    rank = raw[3]
    dims = struct.unpack(">" + "I" * rank, raw[4 : 4 + 4 * rank])
    return np.frombuffer(raw, dtype=np.uint8, offset=4 + 4 * rank).reshape(dims)


def find(data_dir, name):
    for p in (os.path.join(data_dir, name), os.path.join(data_dir, name + ".gz")):
        if os.path.exists(p):
            return p
    raise FileNotFoundError(f"{name} not in {data_dir} (Debian: apt-get install dataset-fashion-mnist)")


def load(data_dir):
    """As mlx-examples mnist.py: images (N, 784) float32 in [0, 1], labels uint32."""
    out = []
    for split in ("train", "t10k"):
        x = read_idx(find(data_dir, f"{split}-images-idx3-ubyte")).reshape(-1, 784).astype(np.float32) / 255.0
        y = read_idx(find(data_dir, f"{split}-labels-idx1-ubyte")).astype(np.uint32)
        out += [x, y]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--epochs", type=int, default=10)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--batch", type=int, default=256)
    ap.add_argument("--lr", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=0, help="sets OMP/OpenBLAS thread counts before MLX loads")
    ap.add_argument("--data", default=os.environ.get("NN_FASHION_MNIST_DIR", "/usr/share/datasets/fashion-mnist"))
    args = ap.parse_args()
    if args.threads:
        for v in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
            os.environ[v] = str(args.threads)

    import mlx.core as mx
    import mlx.nn as nn
    import mlx.optimizers as optim
    from functools import partial

    class MLP(nn.Module):
        """mlx-examples mnist/main.py's MLP."""

        def __init__(self, num_layers, input_dim, hidden_dim, output_dim):
            super().__init__()
            sizes = [input_dim] + [hidden_dim] * num_layers + [output_dim]
            self.layers = [nn.Linear(i, o) for i, o in zip(sizes[:-1], sizes[1:])]

        def __call__(self, x):
            for l in self.layers[:-1]:
                x = nn.relu(l(x))
            return self.layers[-1](x)

    mx.set_default_device(mx.cpu)
    mx.random.seed(args.seed)
    tx, ty, vx, vy = map(mx.array, load(args.data))
    model = MLP(args.layers, 784, args.hidden, 10)
    mx.eval(model.parameters())
    opt = optim.SGD(learning_rate=args.lr)

    def loss_fn(m, x, y):
        return nn.losses.cross_entropy(m(x), y, reduction="mean")

    loss_and_grad = nn.value_and_grad(model, loss_fn)

    @partial(mx.compile, inputs=model.state, outputs=model.state)
    def step(x, y):
        loss, grads = loss_and_grad(model, x, y)
        opt.update(model, grads)
        return loss

    @partial(mx.compile, inputs=model.state)
    def eval_fn(x, y):
        return mx.mean(mx.argmax(model(x), axis=1) == y)

    n = ty.size
    print(f"mlx {mx.__version__}: MLP {args.layers}x{args.hidden}, batch {args.batch}, SGD lr {args.lr}, "
          f"{n} training / {vy.size} test images", flush=True)
    acc = 0.0
    for e in range(args.epochs):
        tic = time.perf_counter()
        perm = mx.random.permutation(n)
        losses = []
        for s in range(0, n, args.batch):
            ids = perm[s : s + args.batch]
            losses.append(step(tx[ids], ty[ids]))
            mx.eval(model.state, losses[-1])
        train_s = time.perf_counter() - tic
        loss = mx.mean(mx.stack(losses)).item()
        acc = eval_fn(vx, vy).item()
        print(f"epoch {e + 1}/{args.epochs}: loss {loss:.4f}, test accuracy {100 * acc:.2f}%, "
              f"{n / train_s:,.0f} samples/s", flush=True)
    print(f"final test accuracy {100 * acc:.2f}%")


if __name__ == "__main__":
    main()
