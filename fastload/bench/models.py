"""The models of the real-loop benchmarks (``bench/bench_loop.py``, ``fastload bench --step``):
a training step that uses the cores the way a user's does (torch's intra-op threads, forward
and backward), not a sleep that leaves them idle.

* ``mlp(inputs, classes)``: 784-256-10 on MNIST-like rows (``inputs`` features);
* ``small_cnn(classes)``: three strided convolutions on 3-channel images (224x224 crops);
* ``ModelStep(kind)``: one SGD step of the model on each batch (``step(batch)``), built on the
  first batch from its shapes, on the batch's device.

torch is imported when these are called, not when the module is.
"""
from __future__ import annotations

from typing import Any

__all__ = ["STEPS", "ModelStep", "mlp", "small_cnn"]

STEPS = ("mlp", "cnn")


def mlp(inputs: int = 784, classes: int = 10, hidden: int = 256):
    from torch import nn

    return nn.Sequential(nn.Linear(inputs, hidden), nn.ReLU(), nn.Linear(hidden, classes))


def small_cnn(classes: int):
    from torch import nn

    return nn.Sequential(
        nn.Conv2d(3, 16, 5, stride=4, padding=2), nn.ReLU(),
        nn.Conv2d(16, 32, 3, stride=2, padding=1), nn.ReLU(),
        nn.Conv2d(32, 64, 3, stride=2, padding=1), nn.ReLU(),
        nn.AdaptiveAvgPool2d(1), nn.Flatten(), nn.Linear(64, classes))


def sgd(model):
    import torch

    return torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)


class ModelStep:
    """One forward + backward + SGD step of ``kind`` ("mlp" or "cnn") on each batch (a dict).

    The input is the batch's image (``image_key``, a float N x 3 x H x W tensor) for "cnn";
    for "mlp" the first floating-point field with a dimension per row beyond the batch
    (flattened: ``x`` of MNIST rows, or an image). The target is ``label_key`` (an integer
    field, taken modulo ``classes``) or class 0 when the batch has none. The model is made on
    the first batch (its input size), with seed 0, on the batch's device; ``calls`` counts
    the steps taken."""

    def __init__(self, kind: str, *, classes: int = 10, label_key: str | None = "label",
                 image_key: str | None = None):
        if kind not in STEPS:
            raise ValueError(f"step={kind!r} must be one of {', '.join(STEPS)}")
        self.kind, self.classes, self.label_key, self.image_key = kind, int(classes), label_key, image_key
        self.model = self.opt = None
        self.calls = 0

    def _input(self, batch: dict[str, Any]):
        import torch

        if self.kind == "cnn":
            x = batch.get(self.image_key) if self.image_key else None
            if x is None:
                x = next((v for v in batch.values() if isinstance(v, torch.Tensor) and v.ndim == 4), None)
            if x is None or not x.is_floating_point() or x.ndim != 4 or x.shape[1] != 3:
                raise ValueError("step='cnn' needs float32 CHW images (batch x 3 x H x W): use an image "
                                 "dataset with --transform train224 or eval224")
            return x
        x = next((v for k, v in batch.items() if k != self.label_key and isinstance(v, torch.Tensor)
                  and v.is_floating_point() and v.ndim >= 2), None)
        if x is None:
            raise ValueError("step='mlp' needs a floating-point field with values per row (e.g. float32[784])")
        return x.reshape(len(x), -1)

    def __call__(self, batch: dict[str, Any]) -> None:
        import torch
        from torch import nn

        x = self._input(batch)
        if self.model is None:
            torch.manual_seed(0)
            self.model = (small_cnn(self.classes) if self.kind == "cnn" else mlp(x.shape[1], self.classes)).to(x.device)
            self.opt = sgd(self.model)
        y = batch.get(self.label_key) if self.label_key else None
        if isinstance(y, torch.Tensor) and y.ndim == 1 and not y.is_floating_point() and len(y) == len(x):
            y = (y % self.classes).to(x.device, torch.int64)
        else:
            y = torch.zeros(len(x), dtype=torch.int64, device=x.device)
        loss = nn.functional.cross_entropy(self.model(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()
        self.opt.step()
        self.calls += 1
