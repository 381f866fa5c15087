"""A tiny 3D-conv video classifier trained from a folder of videos (CPU, seconds).

    python examples/train_video.py --data /tmp/vid --make-data 64          # write videos, convert, train
    python examples/train_video.py --data /tmp/vid --epochs 5 --frames 8

``--make-data N`` writes N short VP9 videos into ``DATA/videos/<class>/`` (a random texture
drifting left or right: the class is the direction, so only motion tells them apart) and
converts the folder with ``fastload.convert("videofolder", ...)`` — the same as
``fastload convert videofolder DATA/videos DATA/ds``, which probes every file with PyAV.

The Loader cuts one clip per video per epoch: ``--frames`` frames ``--stride`` apart from a
random start (drawn per seed, epoch and sample, so a resumed or re-sharded run cuts the same
clips), shorter side resized to ``--size`` and a random crop, normalised
float32 in ``(B, C, T, H, W)``, the layout ``nn.Conv3d`` takes; a ``batch_transform``
mirrors half the clips and swaps their labels (a left drift mirrored drifts right). On a GPU the clips are
decoded by NVDEC; on the CPU by PyAV in fastload's threads.
"""
from __future__ import annotations

import argparse
import io
import time
from pathlib import Path

import numpy as np
import torch
from torch import nn

import fastload

CLASSES = ("left", "right")


def make_videos(root: Path, n: int, frames: int = 24, size: int = 48, seed: int = 0) -> None:
    import av

    rng = np.random.default_rng(seed)
    for i in range(n):
        cls = i % 2
        tex = rng.integers(0, 255, (size // 4, (size + 2 * frames) // 4 + 1, 3), dtype=np.uint8)
        tex = np.repeat(np.repeat(tex, 4, 0), 4, 1)
        buf = io.BytesIO()
        with av.open(buf, mode="w", format="webm") as c:
            s = c.add_stream("libvpx-vp9", rate=12)
            s.width = s.height = size
            s.pix_fmt = "yuv420p"
            s.options = {"crf": "30", "b": "0", "deadline": "realtime", "cpu-used": "8"}
            for k in range(frames):
                x = 2 * k if cls else 2 * (frames - k)
                f = av.VideoFrame.from_ndarray(np.ascontiguousarray(tex[:, x:x + size]), format="rgb24")
                for p in s.encode(f):
                    c.mux(p)
            for p in s.encode():
                c.mux(p)
        out = root / CLASSES[cls] / f"{i:04d}.webm"
        out.parent.mkdir(parents=True, exist_ok=True)
        out.write_bytes(buf.getvalue())


def flip_labels(batch: dict) -> dict:
    """batch_transform (a fastload thread, beside the training step): mirror the clips of odd
    samples, and swap their labels, since a mirrored left drift drifts right. (The transform's
    own ``flip=`` is off: a flip the labels do not follow would teach the model noise.)"""
    video, label = batch["video"], batch["label"]
    flip = (batch["index"] % 2 == 1)  # a fixed half of the samples, mirrored every epoch
    video[flip] = video[flip].flip(-1)
    label[flip] = 1 - label[flip]
    return batch


class Tiny3D(nn.Module):
    def __init__(self, classes: int = 2):
        super().__init__()
        self.net = nn.Sequential(
            nn.Conv3d(3, 8, kernel_size=3, padding=1), nn.ReLU(), nn.MaxPool3d(2),
            nn.Conv3d(8, 16, kernel_size=3, padding=1), nn.ReLU(), nn.AdaptiveAvgPool3d(1), nn.Flatten(),
            nn.Linear(16, classes))

    def forward(self, x):
        return self.net(x)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--data", type=Path, required=True)
    p.add_argument("--make-data", type=int, default=0, metavar="N", help="write N videos and convert them first")
    p.add_argument("--epochs", type=int, default=4)
    p.add_argument("--frames", type=int, default=8)
    p.add_argument("--stride", type=int, default=2)
    p.add_argument("--size", type=int, default=32)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    torch.manual_seed(a.seed)
    ds_path = a.data / "ds"
    if a.make_data:
        make_videos(a.data / "videos", a.make_data)
        r = fastload.convert("videofolder", a.data / "videos", ds_path, overwrite=True, progress=False)
        print(f"converted {r['num_samples']} videos into {r['num_shards']} shard(s)")
    clip = fastload.video.clip(a.frames, a.stride, a.size, flip=0.0, dtype="float32", mean=[0.5] * 3, std=[0.25] * 3,
                               layout="CTHW")
    model = Tiny3D(len(CLASSES))
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    with fastload.Loader(ds_path, batch_size=a.batch_size, seed=a.seed, transforms={"video": clip},
                         batch_transform=flip_labels) as loader:
        for epoch in range(a.epochs):
            loader.set_epoch(epoch)
            t0, losses, correct, seen = time.perf_counter(), [], 0, 0
            for batch in loader:
                logits = model(batch["video"])
                loss = nn.functional.cross_entropy(logits, batch["label"])
                opt.zero_grad()
                loss.backward()
                opt.step()
                losses.append(loss.item())
                correct += int((logits.argmax(1) == batch["label"]).sum())
                seen += len(batch["label"])
            print(f"epoch {epoch}: loss {np.mean(losses):.3f}, accuracy {correct / seen:.2f}, "
                  f"{seen / (time.perf_counter() - t0):.0f} clips/s, waited for data "
                  f"{loader.stats()['wait_fraction']:.0%}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
