"""The MNIST-style MLP case, written once with torch's DataLoader and once with fastload.

60,000 x 784 float32 samples (synthetic, with a learnable signal: no download), batch 300, a
784-256-10 MLP. Prints the time per epoch of each loader and the ratio.

    python examples/mnist_mlp.py                      # both loaders, 2 epochs
    python examples/mnist_mlp.py --loader fastload --epochs 5
    python examples/mnist_mlp.py --samples 3000 --epochs 1 --steps 5   # the CI smoke run
"""
from __future__ import annotations

import argparse
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import fastload


def make_data(n: int, seed: int = 0) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((n, 784), dtype=np.float32)
    w = rng.standard_normal((784, 10)).astype(np.float32)
    y = (x @ w).argmax(axis=1).astype(np.int64)  # a fixed linear teacher: learnable
    return x, y


def train(batches, model, opt, steps: int | None) -> tuple[float, float, int]:
    """One epoch over (x, y) batches; returns (mean loss, accuracy, samples)."""
    loss_sum = correct = seen = 0
    for i, (x, y) in enumerate(batches):
        if steps is not None and i >= steps:
            break
        out = model(x)
        loss = nn.functional.cross_entropy(out, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        loss_sum += loss.item() * len(y)
        correct += int((out.argmax(1) == y).sum())
        seen += len(y)
    return loss_sum / max(seen, 1), correct / max(seen, 1), seen


def run(name: str, make_batches, epochs: int, steps: int | None, device: torch.device, set_epoch=None) -> float:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(784, 256), nn.ReLU(), nn.Linear(256, 10)).to(device)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    times = []
    for epoch in range(epochs):
        if set_epoch is not None:
            set_epoch(epoch)
        t0 = time.perf_counter()
        loss, acc, seen = train(make_batches(), model, opt, steps)
        times.append(time.perf_counter() - t0)
        print(f"{name:10s} epoch {epoch}: {times[-1]:.2f} s ({seen / times[-1]:,.0f} samples/s), "
              f"loss {loss:.3f}, accuracy {acc:.1%}")
    return float(np.median(times))


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--loader", choices=("torch", "fastload", "both"), default="both")
    ap.add_argument("--samples", type=int, default=60_000)
    ap.add_argument("--batch-size", type=int, default=300)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--steps", type=int, default=None, help="stop each epoch after this many steps")
    ap.add_argument("--workers", type=int, default=0, help="DataLoader num_workers")
    ap.add_argument("--data", default=None, help="keep the fastload dataset here (default: a temp dir)")
    a = ap.parse_args(argv)
    x, y = make_data(a.samples)
    results = {}
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # both loaders feed the same device

    if a.loader in ("torch", "both"):
        cuda = device.type == "cuda"
        dl = DataLoader(TensorDataset(torch.from_numpy(x), torch.from_numpy(y)), batch_size=a.batch_size,
                        shuffle=True, num_workers=a.workers, pin_memory=cuda)

        def batches():
            return ((bx.to(device, non_blocking=cuda), by.to(device, non_blocking=cuda)) for bx, by in dl)

        results["torch"] = run("DataLoader", batches, a.epochs, a.steps, device)

    if a.loader in ("fastload", "both"):
        with tempfile.TemporaryDirectory() as tmp:
            path = Path(a.data) if a.data else Path(tmp) / "mnist"
            if not (path / "manifest.json").exists():  # write the store once
                with fastload.ShardWriter(path, {"x": "float32[784]", "label": "int64"}, label="label") as w:
                    w.write_batch({"x": x, "label": y})
            with fastload.Loader(path, batch_size=a.batch_size, fields=["x", "label"], device=device) as loader:
                results["fastload"] = run("fastload", lambda: ((b["x"], b["label"]) for b in loader),
                                          a.epochs, a.steps, loader.device, set_epoch=loader.set_epoch)
                print(f"fastload stats: waited {loader.stats()['wait_fraction']:.1%} of the last epoch for data")

    if len(results) == 2:
        print(f"median time per epoch: DataLoader {results['torch']:.2f} s, fastload {results['fastload']:.2f} s "
              f"({results['torch'] / results['fastload']:.1f}x)")
    return results


if __name__ == "__main__":
    main()
