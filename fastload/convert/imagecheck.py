"""Images checked with the decoder the Loader uses: DALI's image decoder, on the CPU.

PIL and DALI do not accept the same files: a PNG whose IDAT holds fewer rows than its header
declares decodes in PIL (the missing rows are left black) and fails in DALI ("libpng error:
Not enough image data"), so such an image passed ``convert`` and then failed every epoch. The
convert driver therefore decodes every image a second time, in batches, through
``fn.decoders.image(device="cpu")`` with the Loader's settings (RGB, EXIF orientation applied),
and refuses an image DALI cannot decode or decodes to another size than the one recorded
(the crop windows are drawn from the recorded size). DALI's own threads do the work, so this
runs in the main process beside the PIL validation workers.

The GPU decoder (nvJPEG, ``device="mixed"``) is not the CPU one; an image both PIL and DALI's
CPU decoder accept but nvJPEG refuses is still possible (the Loader then names it, or skips it
with ``on_error="skip"``).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from ..pipeline.quiet import decoder_output_captured, messages_since
from ..runtime.system import usable_cores

__all__ = ["DaliImageCheck"]

# A batch decodes at most this many images / pixels at once (decoded RGB: 3 bytes a pixel).
# No more than the Loader's CPU_RUN: a failed DALI run of more images can crash the process.
MAX_BATCH = 16
MAX_BATCH_PIXELS = 1 << 27


class DaliImageCheck:
    """``check(images, sizes)`` -> one error string (or None) per image. Build on first use;
    ``close()`` joins DALI's threads."""

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or usable_cores()
        self._pipe = None

    def _build(self):
        from nvidia.dali import fn, pipeline_def, types

        @pipeline_def(batch_size=MAX_BATCH, num_threads=self.threads, device_id=None, prefetch_queue_depth=1,
                      exec_dynamic=False)
        def graph():
            enc = fn.external_source(name="encoded", dtype=types.UINT8, no_copy=True)
            images = fn.decoders.image(enc, device="cpu", output_type=types.RGB, adjust_orientation=True)
            return images.shape()

        pipe = graph()
        pipe.build()
        return pipe

    def _run(self, encoded: list[np.ndarray]) -> tuple[list[tuple[int, int]] | None, str | None]:
        """Decoded (width, height) of each image, or (None, DALI's reason)."""
        from ..pipeline.badsamples import reason as _reason, strip_tags as _strip_tags

        if self._pipe is None:
            self._pipe = self._build()
        seen, _ = messages_since(0)
        try:
            self._pipe.feed_input("encoded", encoded)
            with decoder_output_captured():
                out, = self._pipe.run()
            shapes = [tuple(int(x) for x in np.asarray(out[i])) for i in range(len(encoded))]
            return [(s[1], s[0]) for s in shapes], None
        except Exception as e:  # the pipeline is dead after an error: rebuild it next time
            reason = _reason(e)
            _, said = messages_since(seen)
            if said:
                reason = f"{reason} [decoder: {'; '.join(_strip_tags(m) for m in said[-2:])}]"
            self._drop()
            return None, reason[:500]

    def check(self, images: Sequence[bytes], sizes: Sequence[tuple[int, int]]) -> list[str | None]:
        """For each encoded image and its recorded (width, height): None if DALI decodes it to
        that size, else why not. Batches of at most MAX_BATCH images / MAX_BATCH_PIXELS."""
        out: list[str | None] = [None] * len(images)
        start = 0
        while start < len(images):
            stop, pixels = start, 0
            while stop < len(images) and stop - start < MAX_BATCH:
                px = int(sizes[stop][0]) * int(sizes[stop][1])
                if stop > start and pixels + px > MAX_BATCH_PIXELS:
                    break
                pixels += px
                stop += 1
            self._check_range(images, sizes, list(range(start, stop)), out)
            start = stop
        return out

    def _check_range(self, images, sizes, pos: list[int], out: list[str | None]) -> None:
        got, err = self._run([np.frombuffer(images[p], dtype=np.uint8) for p in pos])
        if err is None:
            for p, wh in zip(pos, got):
                want = (int(sizes[p][0]), int(sizes[p][1]))
                if wh != want:
                    out[p] = (f"DALI decodes it as {wh[0]}x{wh[1]} pixels, but its header (as PIL reads it) says "
                              f"{want[0]}x{want[1]}; re-encode the image")
            return
        if len(pos) == 1:
            out[pos[0]] = f"DALI (the Loader's decoder) cannot decode it: {err}"
            return
        half = len(pos) // 2  # bisect down to the images that fail
        self._check_range(images, sizes, pos[:half], out)
        self._check_range(images, sizes, pos[half:], out)

    def _drop(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            shutdown = getattr(pipe, "_shutdown", None)
            if shutdown is not None:
                shutdown()

    def close(self) -> None:
        self._drop()
