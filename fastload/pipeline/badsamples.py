"""Finding the samples a failed DALI batch fails on (:class:`BadSampleSearch`, a part of
:class:`~fastload.pipeline.runner.Runner`), and DALI's reason in a line a user can read.

DALI fails a whole batch. The runner then searches the batch in chunks of
``CPU_SEARCH_CHUNK`` on a CPU runner of the same graph, bisecting each failing chunk down to
single samples (the pipeline is rebuilt after each failure, ~10 ms), and raises
:class:`~fastload.errors.BadSamples` with their positions and reasons. A batch that fails on
no part of it, or on every image including a valid built-in JPEG, is the pipeline's fault:
a RuntimeError says so. What to *do* with bad samples (raise, or replace them) is the
loader's policy, :mod:`fastload.loader.decode`.
"""
from __future__ import annotations

import re

import numpy as np

from ..errors import BadSamples

__all__ = ["CANARY_SIZE", "CPU_SEARCH_CHUNK", "BadSampleSearch", "canary_jpeg", "reason", "strip_tags"]

CPU_SEARCH_CHUNK = 16  # samples per CPU run when locating the bad samples of a failed GPU batch
CANARY_SIZE = 256


def reason(e: BaseException) -> str:
    """DALI's messages carry the graph's traceback; keep the operator and what went wrong."""
    text = str(e)
    op = ""
    if "operator `" in text:
        op = text.split("operator `", 1)[1].split("`", 1)[0].replace("nvidia.dali.fn.", "") + ": "
    if "encountered:" in text:
        text = text.split("encountered:", 1)[1]
    keep = []
    for ln in text.splitlines():
        ln = ln.strip()
        if not ln or ln.startswith(("C++ context", "Current pipeline object", "Critical error in pipeline")):
            continue
        keep.append(ln)
    msg = " ".join(keep) or type(e).__name__
    if "nvImageCodec failure" in msg:
        msg += " (not a decodable image: corrupt, truncated or an unsupported format)"
    if "cropping window" in msg:
        msg += " (the stored width/height do not match the encoded image)"
    return (op + msg)[:400]


def strip_tags(line: str) -> str:
    """'\x1b[0;31m[ERROR] \x1b[0m[jpeg_parser] Invalid marker' -> '[jpeg_parser] Invalid marker'."""
    return re.sub(r"^\[(?:ERROR|WARNING|WARN|INFO)\]\s*", "", re.sub(r"\x1b\[[0-9;]*m", "", line)).strip()


class BadSampleSearch:
    """The search, as methods of a runner: it uses the runner's ``_try(encoded, params) ->
    (result, reason or None)``, ``device``, ``batch_size``, ``num_threads``, ``seed`` and
    ``transform``, and keeps its CPU runner (on CUDA) in ``_cpu``."""

    def _find_bad(self, encoded: list, params: dict[str, np.ndarray], pos: np.ndarray,
                  err: str, bad: dict[int, str]) -> None:
        """Bisect the failing batch ``pos`` until single failing samples remain."""
        if len(pos) == 1:
            bad[int(pos[0])] = err
            return
        half = len(pos) // 2
        for part in (pos[:half], pos[half:]):
            _, e = self._try([encoded[i] for i in part], {n: a[part] for n, a in params.items()})
            if e is not None:
                self._find_bad(encoded, params, part, e, bad)

    def _raise_bad(self, bad: dict[int, str], n: int, err: str):
        """Raise what a failed batch of ``n`` images means: BadSamples naming ``bad``, or a
        RuntimeError when the pipeline itself is at fault."""
        if not bad:  # the batch failed but no part of it does: not a data problem
            raise RuntimeError(f"DALI failed on a batch of {n} images, but on no part of it: {err}")
        if len(bad) == n:  # every image fails: the data, or the pipeline itself?
            canary = self._canary_error()
            if canary is not None:
                raise RuntimeError(
                    f"the DALI pipeline fails on every image, including a valid built-in "
                    f"{CANARY_SIZE}x{CANARY_SIZE} JPEG, so this is not a data problem: {canary}")
        raise BadSamples(sorted(bad), [bad[p] for p in sorted(bad)])

    def _locate_bad(self, encoded: list, params: dict[str, np.ndarray], err: str) -> dict[int, str]:
        """{position: reason} of the samples a failed batch fails on, searched in chunks of
        CPU_SEARCH_CHUNK on a CPU runner of the same graph (a chunk without a bad sample takes
        one run; on CUDA, a small CPU runner: one GPU rebuild per failing batch, not one per
        bisection step). Only when the CPU decodes every image (a GPU-only failure) does it
        bisect on the GPU."""
        n = len(encoded)
        bad: dict[int, str] = {}
        cpu = self if self.device == "cpu" else self._cpu_runner()
        for start in range(0, n, CPU_SEARCH_CHUNK):
            part = np.arange(start, min(n, start + CPU_SEARCH_CHUNK))
            _, cpu_err = cpu._try([encoded[i] for i in part], {k: a[part] for k, a in params.items()})
            if cpu_err is not None:
                cpu._find_bad(encoded, params, part, cpu_err, bad)
        if not bad and self.device == "cuda":
            self._find_bad(encoded, params, np.arange(n), err, bad)
        return bad

    def _cpu_runner(self):
        if self._cpu is None:
            self._cpu = type(self)(self.transform, device="cpu", batch_size=min(self.batch_size, CPU_SEARCH_CHUNK),
                                   num_threads=min(2, self.num_threads), prefetch=None, seed=self.seed,
                                   device_id=None)
        return self._cpu

    def _canary_error(self) -> str | None:
        """Run one valid JPEG through the graph; DALI's reason if even that fails."""
        w = h = np.array([CANARY_SIZE], np.int32)
        params = self.transform.params(self.seed, 0, np.zeros(1, np.int64), w, h)
        res, err = self._try([canary_jpeg()], params)
        del res
        return err


_CANARY = None


def canary_jpeg() -> np.ndarray:
    """A valid, smooth 256x256 RGB JPEG (made once, in memory)."""
    global _CANARY
    if _CANARY is None:
        import io

        from PIL import Image

        x = np.tile(np.linspace(0, 255, CANARY_SIZE).astype(np.uint8), (CANARY_SIZE, 1))
        rgb = np.stack([x, x.T, np.full_like(x, 128)], -1)
        buf = io.BytesIO()
        Image.fromarray(rgb).save(buf, "JPEG", quality=90)
        _CANARY = np.frombuffer(buf.getvalue(), np.uint8)
    return _CANARY
