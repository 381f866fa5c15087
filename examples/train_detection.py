"""A tiny object detector trained on fastload.vision.detection batches.

    python examples/train_detection.py --data /tmp/det --make-data 256     # generate, then train (CPU: seconds)
    python examples/train_detection.py --data /tmp/det --steps 200 --size 256

The dataset holds, per sample, ``image`` (encoded JPEG), ``boxes`` (``float32[*,4]``, xyxy
pixels of the stored image) and ``labels`` (``int64[]``, one per box): the schema
``fastload convert coco`` writes. ``--make-data`` generates one: rectangles of three colours on
a noisy background, the colour being the class.

``transforms=vision.detection(size)`` crops image and boxes together (SSD's IoU crop),
resizes, flips and normalizes. A batch has ``image`` (B, 3, S, S), ``boxes`` (B, Lmax, 4) in
pixels of that image with ``boxes_lengths`` (B,), and ``labels`` (B, Lmax) with
``labels_lengths``. The model is a CenterNet-like grid: each cell of a stride-16 feature map
predicts whether a box centre falls in it, the class, and the box (its offsets to the cell
centre), trained with BCE + cross-entropy + L1.
"""
from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn
from torch.nn import functional as F

import fastload
from fastload import vision

COLOURS = np.array([[230, 40, 40], [40, 200, 40], [40, 80, 230]], np.uint8)  # class 0, 1, 2
STRIDE = 16


def make_data(path: Path, n: int, seed: int = 0) -> None:
    """``n`` 160x120 JPEGs with 1-4 coloured rectangles each (the colour is the label)."""
    from PIL import Image

    rng = np.random.default_rng(seed)
    with fastload.ShardWriter(path, {"image": "image", "boxes": "float32[*,4]", "labels": "int64[]"}) as w:
        for i in range(n):
            img = rng.integers(90, 150, (120, 160, 3)).astype(np.uint8)
            k = int(rng.integers(1, 5))
            wh = rng.uniform(20, 60, (k, 2))
            xy = rng.uniform(0, 1, (k, 2)) * ([160, 120] - wh)
            boxes = np.round(np.concatenate([xy, xy + wh], 1)).astype(np.float32)
            labels = rng.integers(0, len(COLOURS), k)
            for (x0, y0, x1, y1), c in zip(boxes.astype(int), labels):
                img[y0:y1, x0:x1] = COLOURS[c]
            buf = io.BytesIO()
            Image.fromarray(img).save(buf, "JPEG", quality=92)
            w.write({"image": buf.getvalue(), "boxes": boxes, "labels": labels.astype(np.int64)}, key=f"{i:05d}.jpg")


class GridDetector(nn.Module):
    """Per cell of a stride-16 map: objectness, class scores, and the box as (left, top, right,
    bottom) distances from the cell centre in units of the stride."""

    def __init__(self, classes: int):
        super().__init__()
        ch = [3, 16, 32, 48, 64]
        layers = []
        for a, b in zip(ch, ch[1:]):
            layers += [nn.Conv2d(a, b, 3, stride=2, padding=1), nn.BatchNorm2d(b), nn.ReLU()]
        self.body = nn.Sequential(*layers)
        self.head = nn.Conv2d(ch[-1], 1 + classes + 4, 1)

    def forward(self, x):
        return self.head(self.body(x))  # (B, 1 + C + 4, S/16, S/16)


def targets(boxes: torch.Tensor, lengths: torch.Tensor, labels: torch.Tensor, grid: int):
    """Per cell: objectness (B, G, G), class (B, G, G) (-1: none) and box distances (B, 4, G, G)
    from a padded batch of boxes (pixels) and their lengths."""
    b = boxes.shape[0]
    obj = torch.zeros(b, grid, grid)
    cls = torch.full((b, grid, grid), -1, dtype=torch.long)
    reg = torch.zeros(b, 4, grid, grid)
    real = torch.arange(boxes.shape[1])[None, :] < lengths[:, None]  # the padding is not a box
    for i, j in real.nonzero().tolist():
        x0, y0, x1, y1 = boxes[i, j].tolist()
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        gx, gy = min(int(cx // STRIDE), grid - 1), min(int(cy // STRIDE), grid - 1)
        ccx, ccy = (gx + 0.5) * STRIDE, (gy + 0.5) * STRIDE
        obj[i, gy, gx] = 1.0
        cls[i, gy, gx] = int(labels[i, j])
        reg[i, :, gy, gx] = torch.tensor([ccx - x0, ccy - y0, x1 - ccx, y1 - ccy]) / STRIDE
    return obj, cls, reg


def loss_of(out: torch.Tensor, batch: dict) -> torch.Tensor:
    grid = out.shape[-1]
    obj, cls, reg = targets(batch["boxes"], batch["boxes_lengths"], batch["labels"], grid)
    pos = obj > 0
    loss = F.binary_cross_entropy_with_logits(out[:, 0], obj)
    if pos.any():
        scores = out[:, 1:1 + len(COLOURS)].permute(0, 2, 3, 1)[pos]
        loss = loss + F.cross_entropy(scores, cls[pos])
        loss = loss + F.l1_loss(out[:, -4:].permute(0, 2, 3, 1)[pos], reg.permute(0, 2, 3, 1)[pos])
    return loss


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--data", required=True, help="a fastload dataset with image, boxes and labels fields")
    ap.add_argument("--make-data", type=int, default=0, help="first generate this many images (if --data is absent)")
    ap.add_argument("--size", type=int, default=128)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--steps", type=int, default=60)
    a = ap.parse_args(argv)
    data = Path(a.data)
    if a.make_data and not (data / "manifest.json").exists():
        make_data(data, a.make_data)
    torch.manual_seed(0)
    net = GridDetector(len(COLOURS))
    opt = torch.optim.Adam(net.parameters(), lr=3e-3)
    first = last = None
    step = epoch = seen = 0
    t0 = time.perf_counter()
    with fastload.Loader(data, batch_size=a.batch_size, seed=0, transforms=vision.detection(a.size)) as loader:
        while step < a.steps:
            loader.set_epoch(epoch)
            for batch in loader:
                if step == 0:
                    print(f"batch: image {tuple(batch['image'].shape)}, boxes {tuple(batch['boxes'].shape)}, "
                          f"{batch['boxes_lengths'].float().mean():.2f} boxes per image kept by the crop")
                loss = loss_of(net(batch["image"]), batch)
                opt.zero_grad()
                loss.backward()
                opt.step()
                first = loss.item() if first is None else first
                last = loss.item() if last is None else 0.8 * last + 0.2 * loss.item()  # smoothed
                step += 1
                seen += len(batch["index"])
                if step % 10 == 0:
                    print(f"step {step}: loss {loss.item():.3f}")
                if step == a.steps:
                    break
            epoch += 1
    print(f"loss {first:.3f} -> {last:.3f} (smoothed) after {step} steps, {epoch} epoch(s), "
          f"{seen / (time.perf_counter() - t0):.0f} images/s trained")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
