"""Sources -> fastload datasets. One module per source kind; ``convert()`` dispatches.

``fastload.convert`` names both this package and its :func:`convert` function. Importing
the package (``import fastload.convert``, ``from fastload.convert import ...``) binds the
*package* to the attribute ``convert`` of ``fastload`` whenever that happens — with a lazy
``fastload/__init__`` possibly after the function was bound there — so the package itself is
callable as the function: ``fastload.convert("imagefolder", src, dst)`` works either way.
"""
from __future__ import annotations

import os
import sys
import types
from collections.abc import Mapping
from typing import Any, Sequence

from ..errors import ConvertError
from .common import run_convert
from .objstore import Store, is_remote

from ..validate import check_bool
from .common import check_shard_size
from .kinds import KINDS, check_options, make_source


def convert(kind: str, src: str | os.PathLike, dst: str | os.PathLike, *, workers: int | None = None,
            shard_size: int | str = "256MB", on_error: str = "raise", overwrite: bool = False,
            label: str | None = None, image_columns: Sequence[str] = (), max_pixels: int | None = None,
            progress: bool = True, engine: str = "local", ray_address: str | None = None,
            resume: bool = False, allow_small_shards: bool = False, max_size: int | None = None,
            quality: int | None = None, images: str | os.PathLike | None = None, masks: bool = False,
            skip_empty: bool = False, min_frames: int | None = None, video_codec: str | None = None) -> dict:
    """Convert a source into a fastload dataset at ``dst``; return a summary dict.

    kind: "imagefolder" (SRC/<class>/<images>), "arrays" (.npz / .npy / folder of .npy, or
    a dict of arrays; ragged fields as NAME + NAME_offsets pairs or object arrays),
    "table" (Parquet, CSV, JSON lines), "webdataset" (.tar shards) or "coco" (``src`` a COCO
    instances JSON, ``images`` the folder of its images; ``masks`` adds a category-id mask PNG
    per image, ``skip_empty`` leaves out images without annotations: see
    ``fastload.convert.coco``), "videofolder" or "audiofolder" (SRC/<class>/<video or audio
    files>, probed with PyAV: see ``fastload.convert.media``; ``min_frames`` refuses shorter
    videos, ``video_codec="vp9"`` re-encodes those DALI's CPU decoder cannot read). Refuses a non-empty
    ``dst`` unless ``overwrite`` (which swaps the new dataset in only once it is complete: a
    failed overwrite leaves the old one untouched); on failure nothing that opens is left
    behind. Samples the writer refuses (wrong shape, a value out of the field's range) are
    errors naming the sample, or skipped and reported with ``on_error="skip"``.

    engine: "local" (this process writes, ``workers`` processes validate), "ray" (one Ray
    task per group of about one shard; ``ray_address`` "auto" or HOST:PORT joins a cluster,
    else a private local Ray with ``workers`` CPUs) or "torch" (the ranks of ``torchrun``
    share the groups, rank 0 commits). ``workers`` is the number of tasks converting at once
    (per rank with "torch"). With "ray" and "torch" the samples, keys, labels and image sizes
    are those of "local"; only the cut into shards may differ. ``resume`` (ray, torch)
    finishes an interrupted conversion of the same source into ``dst``, reusing its
    finished parts. It refuses a source whose files were added or removed (an image folder's
    listing) or whose table, ``.npy`` or ``.tar`` files changed, naming them (pass
    ``overwrite`` instead to start over), and converts again the finished groups whose files
    (images) changed in place: the summary's ``resumed_changed`` is ``{group: [paths]}``.
    Every engine records the size and modification time of each file it reads: a file that
    changes while the conversion runs fails it, naming the file, and nothing is committed
    (see ``fastload.convert.sourcestate``).

    ``dst`` may be an object-store URL (``s3://``, ``gs://``, ``az://``): with "local" the
    dataset is converted in a local staging directory and uploaded (shards, then the manifest);
    with "ray" and "torch" every task uploads its own shards and the driver writes the
    manifest last (see ``fastload.convert.objstore``). A failure leaves no new manifest.

    Images are decoded by PIL and by DALI's CPU decoder (the Loader's), and refused above
    ``max_pixels`` (default: the Loader's, 2**26), so a dataset that converts is one the Loader
    decodes. ``max_size`` (at least 16) stores images pre-resized, like FFCV's
    ``max_resolution``: an image whose longer side exceeds it is re-encoded with that longer
    side (aspect kept, Lanczos, EXIF orientation applied; JPEG at ``quality``, default 90, PNG
    stays PNG, other formats become JPEG; see ``fastload.convert.resize``), the others are
    stored byte for byte; the manifest's metadata records ``max_size``, ``quality`` and
    ``resized_images``. ``shard_size`` below 1 MB needs ``allow_small_shards=True``. Options
    a source kind does not take (``label`` for an image folder) are errors.
    """
    from .engines import ENGINES

    if kind not in KINDS:
        raise ValueError(f"unknown source kind {kind!r}; use one of {', '.join(KINDS)}")
    source_options = _source_options(images=images, masks=check_bool("masks", masks),
                                     skip_empty=check_bool("skip_empty", skip_empty), min_frames=min_frames,
                                     video_codec=video_codec)
    check_options(kind, label=label, image_columns=image_columns, max_pixels=max_pixels, max_size=max_size,
                  quality=quality, source_options=source_options)
    check_shard_size(shard_size, check_bool("allow_small_shards", allow_small_shards))
    if engine not in ENGINES:
        raise ValueError(f"engine={engine!r} must be one of {', '.join(ENGINES)}")
    if ray_address is not None and engine != "ray":
        raise ValueError("ray_address (--ray-address) is for engine='ray' (--engine ray)")
    if resume and engine == "local":
        raise ValueError("resume (--resume) needs engine='ray' or 'torch': the local engine writes one dataset "
                         "in one process and leaves nothing to resume after a failure")
    in_memory = kind == "arrays" and isinstance(src, Mapping)  # a dict of arrays, from Python
    if in_memory and engine != "local":
        raise ValueError(f"engine={engine!r} runs tasks in other processes, which cannot see a dict of arrays; "
                         "save it (numpy.savez) and convert the file")
    if not in_memory and not os.path.exists(src):
        raise ConvertError(f"{src}: no such file or directory")
    remote = is_remote(dst)
    if remote:
        Store(str(dst))  # an object store fastload writes to (not http), before any work
    s_abs, d_abs = (None, None) if in_memory or remote else (os.path.realpath(src), os.path.realpath(dst))
    if (s_abs is not None and d_abs is not None and os.path.isdir(s_abs)
            and (d_abs == s_abs or d_abs.startswith(s_abs.rstrip(os.sep) + os.sep))):
        raise ConvertError(f"{dst} is inside the source {src}; choose a destination outside it "
                           "(the dataset would become part of its own source)")
    if remote and engine == "local":  # converted in a local staging directory, then uploaded, manifest last
        from .publish import convert_to_remote

        return convert_to_remote(convert, kind, src, str(dst), overwrite=overwrite, workers=workers,
                                 shard_size=shard_size, on_error=on_error, label=label, image_columns=image_columns,
                                 max_pixels=max_pixels, progress=progress, allow_small_shards=allow_small_shards,
                                 max_size=max_size, quality=quality, **source_options)
    if engine != "local":
        from ..store.format import parse_size
        from ..validate import ON_ERROR
        from .engines import run_engine

        if on_error not in ON_ERROR:
            raise ValueError(f"on_error={on_error!r} must be one of {ON_ERROR}")
        return run_engine(engine, kind, src, dst, workers=workers, shard_size=parse_size(shard_size),
                          on_error=on_error, overwrite=overwrite, resume=resume, progress=progress,
                          ray_address=ray_address, label=label, image_columns=image_columns, max_pixels=max_pixels,
                          max_size=max_size, quality=quality, source_options=source_options)
    source = make_source(kind, src, label=label, image_columns=image_columns, max_pixels=max_pixels,
                         max_size=max_size, quality=quality, source_options=source_options)
    try:
        return run_convert(source, dst, workers=workers, shard_size=shard_size, on_error=on_error,
                           overwrite=overwrite, progress=progress, desc=f"convert {kind}")
    finally:
        close = getattr(source, "close", None)
        if close is not None:
            close()


def _source_options(**given: Any) -> dict:
    """The options of one source kind (coco: ``images``, ``masks``, ``skip_empty``) that were
    given (not None or False), paths made absolute: what the plan of a distributed conversion
    records and its tasks open the source with."""
    out = {k: v for k, v in given.items() if v is not None and v is not False}
    if "images" in out:
        out["images"] = os.path.abspath(os.fspath(out["images"]))
    return out


class _CallablePackage(types.ModuleType):
    def __call__(self, *args: Any, **kwargs: Any) -> dict:
        return convert(*args, **kwargs)


sys.modules[__name__].__class__ = _CallablePackage

__all__ = ["KINDS", "ConvertError", "convert", "make_source"]
