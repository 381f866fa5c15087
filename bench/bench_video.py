"""Video clips: fastload (DALI's video decoder) against a DataLoader decoding with PyAV, in one run.

    .venv/bin/python bench/bench_video.py                  # 96 videos of 64 frames, 320x240 (about a minute)
    .venv/bin/python bench/bench_video.py --smoke          # 16 videos of 40 frames (seconds)
    .venv/bin/python bench/bench_video.py --device cuda    # fastload on the GPU (NVDEC), H.264 and VP9

The data: generated 320x240 videos (moving textured frames, 25 fps), written twice, as
H.264 (libx264, crf 23) and VP9 (libvpx-vp9, crf 32), each a fastload dataset of ``video``
fields (probed at write time). The workload is one 16-frame clip per video, stride 2, from a
random start, shorter side resized to 224 and a random 224x224 crop, uint8 (B, 16, 224, 224, 3),
batch 8, one epoch per row, batches consumed as torch tensors. Rows:

  * fastload Loader, ``fastload.video.clip(16, 2, 224)``: on the CPU PyAV in native threads and
    torch's resize into the batch (fastload/video/cpu.py); on ``--device cuda`` DALI's mixed
    decoder (NVDEC) and the rest of the graph on the GPU; both codecs;
  * DALI's CPU graph alone (``dali_only``: DALI's CPU video decoder, VP9 only), the
    measurement that ruled it out as the CPU path;
  * torch DataLoader, ``num_workers=2``, a map-style dataset decoding with PyAV (seeking to the
    key frame before the start, decoding to the clip's last frame) and resizing/cropping in
    torch (antialiased bilinear, as DALI): the usual recipe, on H.264 and on VP9;
  * PyAV in 2 threads of this process (FFmpeg releases the GIL while decoding), H.264: what a
    PyAV decode path inside the Loader could reach on the CPU.

Figures are clips/s of the second of two epochs (decoders built, workers started),
one run per row (``--repeats`` for more, median shown), and each
row's ratio to the DataLoader on the same codec.
"""
from __future__ import annotations

import argparse
import io
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

FRAMES, STRIDE, SIZE, BATCH = 16, 2, 224, 8


def make_video(i: int, frames: int, codec: str, width: int = 320, height: int = 240) -> bytes:
    """A moving textured scene (a different one per ``i``): compressible like real footage."""
    import av

    rng = np.random.default_rng(i)
    base = rng.integers(0, 255, (height // 8 + 1, (width + 8 * frames) // 8 + 1, 3), dtype=np.uint8)
    scene = np.repeat(np.repeat(base, 8, 0), 8, 1)
    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4" if codec == "h264" else "webm") as c:
        s = c.add_stream("libx264" if codec == "h264" else "libvpx-vp9", rate=25)
        s.width, s.height, s.pix_fmt = width, height, "yuv420p"
        s.options = ({"crf": "23", "preset": "veryfast"} if codec == "h264" else
                     {"crf": "32", "b": "0", "deadline": "realtime", "cpu-used": "8", "row-mt": "1"})
        for k in range(frames):
            f = av.VideoFrame.from_ndarray(np.ascontiguousarray(scene[:height, 4 * k:4 * k + width]), format="rgb24")
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def write_dataset(path: str, videos: list[bytes]) -> None:
    from fastload.store import ShardWriter

    with ShardWriter(path, {"video": "video", "label": "int64"}) as w:
        for i, v in enumerate(videos):
            w.write({"video": v, "label": i % 10})


def shorter_side_window(frames: np.ndarray, rng: np.random.Generator) -> torch.Tensor:
    """(T, H, W, 3) uint8 -> shorter side SIZE (antialiased bilinear), random SIZE x SIZE crop."""
    x = torch.from_numpy(frames).permute(0, 3, 1, 2)  # uint8, channels-last memory: torch's fast path
    h, w = x.shape[-2:]
    s = SIZE / min(h, w)
    x = torch.nn.functional.interpolate(x, size=(max(SIZE, round(h * s)), max(SIZE, round(w * s))), mode="bilinear",
                                        antialias=True, align_corners=False)
    top = int(rng.integers(0, x.shape[-2] - SIZE + 1))
    left = int(rng.integers(0, x.shape[-1] - SIZE + 1))
    x = x[..., top:top + SIZE, left:left + SIZE]
    return x.permute(0, 2, 3, 1).contiguous()


def pyav_clip(data: bytes, start: int) -> np.ndarray:
    """Frames start, start + STRIDE, ... (FRAMES of them; the last repeated past the end)."""
    import av

    want = [start + STRIDE * k for k in range(FRAMES)]
    got = {}
    with av.open(io.BytesIO(data)) as c:
        s = c.streams.video[0]
        s.thread_type = "AUTO"
        last = None
        for i, f in enumerate(c.decode(s)):
            last = i
            if i in want:
                got[i] = f.to_ndarray(format="rgb24")
            if i >= want[-1]:
                break
    return np.stack([got[min(i, last)] if i in got or i > last else got[i] for i in want])


class PyAVClips(torch.utils.data.Dataset):
    """The usual map-style dataset: the encoded videos, decoded and cropped per item."""

    def __init__(self, videos: list[bytes], frames: list[int]):
        self.videos, self.frames = videos, frames

    def __len__(self) -> int:
        return len(self.videos)

    def __getitem__(self, i: int) -> torch.Tensor:
        rng = np.random.default_rng(i + 1000 * torch.initial_seed() % 1000)
        start = int(rng.integers(0, max(1, self.frames[i] - (FRAMES - 1) * STRIDE)))
        return shorter_side_window(pyav_clip(self.videos[i], start), rng)


def time_fastload(path: str, device: str) -> float:
    import fastload
    from fastload.bench.runs import second_epoch_rate

    with fastload.Loader(path, batch_size=BATCH, device=device,
                         transforms={"video": fastload.video.clip(FRAMES, STRIDE, SIZE)}) as lo:
        return second_epoch_rate(lo, "video")  # the second epoch: decoders built and warm


def time_dali_cpu(path: str) -> float:
    import fastload

    ds = fastload.Dataset(path)
    t = fastload.video.clip(FRAMES, STRIDE, SIZE).for_dataset(ds, "video")
    r = t.runner(device="cpu", batch_size=BATCH, dali_only=True)
    try:
        t0 = time.perf_counter()
        order = np.random.default_rng(0).permutation(len(ds))
        for a in range(0, len(ds), BATCH):
            idx = order[a:a + BATCH]
            w, h = ds.image_sizes("video", idx)
            r.run(ds.views("video", idx, copy=True), w, h, idx, 0)
        return len(ds) / (time.perf_counter() - t0)
    finally:
        r.close()


def time_dataloader(videos, frames) -> float:
    dl = torch.utils.data.DataLoader(PyAVClips(videos, frames), batch_size=BATCH, shuffle=True, num_workers=2,
                                     persistent_workers=True)
    for _ in range(2):  # the second epoch is timed: the workers are up
        t0 = time.perf_counter()
        n = sum(len(b) for b in dl)
    return n / (time.perf_counter() - t0)


def time_threads(videos, frames) -> float:
    ds = PyAVClips(videos, frames)
    t0 = time.perf_counter()
    with ThreadPoolExecutor(2) as ex:
        n = sum(1 for _ in ex.map(ds.__getitem__, range(len(ds))))
    return n / (time.perf_counter() - t0)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--videos", type=int, default=96)
    p.add_argument("--frames", type=int, default=64)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--device", choices=["cpu", "cuda"], default="cpu")
    p.add_argument("--smoke", action="store_true", help="16 videos of 40 frames")
    a = p.parse_args(argv)
    from fastload.bench.machine import equal_priority

    equal_priority()  # the rows compared run at one priority (FASTLOAD_NICE=0 unless set)
    if a.smoke:
        a.videos, a.frames = 16, 40
    from fastload.bench.headlines import headline

    tmp = tempfile.mkdtemp(prefix="bench-video-")
    try:
        t0 = time.perf_counter()
        vids = {c: [make_video(i, a.frames, c) for i in range(a.videos)] for c in ("h264", "vp9")}
        for c, v in vids.items():
            write_dataset(f"{tmp}/{c}", v)
        mb = {c: sum(map(len, v)) / 1e6 for c, v in vids.items()}
        print(f"# {a.videos} videos of {a.frames} frames, 320x240 (H.264 {mb['h264']:.1f} MB, VP9 {mb['vp9']:.1f} MB), "
              f"made in {time.perf_counter() - t0:.0f} s; clips of {FRAMES} frames, stride {STRIDE}, {SIZE}x{SIZE}, "
              f"batch {BATCH}", flush=True)
        frames = [a.frames] * a.videos
        rows: dict[str, float] = {}
        runs = {
            f"fastload ({a.device}), VP9": lambda: time_fastload(f"{tmp}/vp9", a.device),
            f"fastload ({a.device}), H.264": lambda: time_fastload(f"{tmp}/h264", a.device),
            "DALI's CPU graph alone, VP9": lambda: time_dali_cpu(f"{tmp}/vp9"),
            "DataLoader + PyAV (2 workers), VP9": lambda: time_dataloader(vids["vp9"], frames),
            "DataLoader + PyAV (2 workers), H.264": lambda: time_dataloader(vids["h264"], frames),
            "PyAV in 2 threads, H.264": lambda: time_threads(vids["h264"], frames),
        }
        for name, fn in runs.items():
            rates = [fn() for _ in range(a.repeats)]
            rows[name] = float(np.median(rates))
            print(f"  {name:42s} {rows[name]:8.1f} clips/s", flush=True)
        base = {"VP9": rows["DataLoader + PyAV (2 workers), VP9"], "H.264": rows["DataLoader + PyAV (2 workers), H.264"]}
        print("\n## video clips, clips/s (ratio to the DataLoader on the same codec)")
        for name, r in rows.items():
            codec = name.rsplit(", ", 1)[1]  # (each row against the DataLoader on its codec)
            print(f"| {name} | {r:.1f} | {r / base[codec]:.2f}x |")
        ours = rows[f"fastload ({a.device}), VP9"]
        headline("video clips (16x224, VP9)", script="bench_video.py", unit="clips/s",
                 ours=(f"fastload {a.device}", ours), baseline=("DataLoader + PyAV, 2 workers", base["VP9"]),
                 smoke=a.smoke)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
