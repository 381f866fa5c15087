"""webdataset: tar shards in the WebDataset layout -> one field per file extension.

Members are grouped into samples by key (the member path up to the first dot of its
basename); each extension is a field: image extensions -> image, ``cls``/``cls2``/``index``
-> int64 scalar (decimal text; ``cls`` becomes the label; ``index`` is stored as the field
``source_index``, since the Loader's ``batch["index"]`` holds the global sample indices), ``npy`` -> tensor (fixed shape,
``allow_pickle=False``), ``txt``/``json`` and other text -> string, anything else -> bytes.
Every sample must carry the extensions of the first one. SRC is a ``.tar`` file or a
directory of them (taken in sorted order).
"""
from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import numpy as np

from ..files import MAX_SAMPLE_BYTES, NotRegularFile, check_regular, printable
from ..store.format import SUPPORTED_DTYPES, Field
from ..store.geometry import DEFAULT_MAX_PIXELS
from .common import ConvertError, Source

_IMAGE = {"jpg", "jpeg", "png", "webp", "bmp", "tif", "tiff", "ppm", "pgm", "pnm"}
_INT = {"cls", "cls2", "index"}
_TEXT = {"txt", "json", "text", "caption"}


def _field_name(ext: str) -> str:
    name = ext.replace(".", "_")
    return "source_index" if name == "index" else name


def _split(name: str) -> tuple[str, str]:
    d, _, base = name.rpartition("/")
    stem, dot, ext = base.partition(".")
    if not dot:
        return "", ""
    return (f"{d}/{stem}" if d else stem), ext.lower()


class WebDatasetSource(Source):
    def __init__(self, src: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS):
        root = Path(src)
        if root.is_dir():
            tars = sorted(root.glob("*.tar"))
        elif root.exists():
            tars = [root]
        else:
            raise ConvertError(f"{root}: no such file or directory")
        if not tars:
            raise ConvertError(f"{root}: holds no .tar files")
        for tp in tars:  # a FIFO named x.tar would block tarfile.open; /dev/zero would never end
            try:
                check_regular(tp, what="tar file")
            except (NotRegularFile, OSError) as e:
                raise ConvertError(f"{printable(str(tp))}: cannot be read ({e})") from None
        keys: list[str] = []
        members: dict[str, list] = {}
        exts: list[str] | None = None
        for ti, tp in enumerate(tars):
            try:
                with tarfile.open(tp, "r:") as tf:
                    groups: dict[str, dict[str, tarfile.TarInfo]] = {}
                    order: list[str] = []
                    for m in tf:
                        if not m.isfile():
                            continue
                        if m.size > MAX_SAMPLE_BYTES:
                            raise ConvertError(f"{printable(str(tp))}: member {printable(m.name)} holds {m.size:,} bytes, "
                                               f"more than the limit of {MAX_SAMPLE_BYTES:,} for one sample file")
                        k, e = _split(m.name)
                        if not k:
                            continue
                        if k not in groups:
                            groups[k] = {}
                            order.append(k)
                        groups[k][e] = m
            except (tarfile.TarError, OSError) as e:
                raise ConvertError(f"{tp}: not a readable tar file ({e})") from None
            for k in order:
                g = groups[k]
                if exts is None:
                    exts = sorted(g)
                if sorted(g) != exts:
                    raise ConvertError(f"{tp}: sample {k!r} has files {sorted(g)} but the first sample has "
                                       f"{exts}; every sample needs the same extensions")
                keys.append(f"{tp.name}:{k}")
                for e in exts:
                    members.setdefault(e, []).append((ti, g[e].offset_data, g[e].size))
        if not keys or not exts:
            raise ConvertError(f"{root}: the tar files hold no samples (files named KEY.EXT)")
        self.tars = [str(t) for t in tars]
        self._keys = np.array(keys)
        self._loc = {e: np.array(v, dtype=np.int64) for e, v in members.items()}
        self._files: dict[int, int] = {}
        fields: dict[str, Field] = {}
        by_name: dict[str, str] = {}
        for e in exts:
            name = _field_name(e)
            if name in by_name:
                raise ConvertError(f"{tars[0]}: members .{by_name[name]} and .{e} would both be stored as the "
                                   f"field {name!r}; rename one of the extensions")
            by_name[name] = e
            if e in _IMAGE:
                fields[name] = Field("image")
            elif e in _INT:
                fields[name] = Field("scalar", "int64")
            elif e == "npy":
                a = self._npy(self._raw(e, 0), 0)
                if a.dtype.name not in SUPPORTED_DTYPES:
                    raise ConvertError(f"{self._keys[0]}.npy has dtype {a.dtype}, which cannot be stored")
                fields[name] = Field("tensor", a.dtype.name, a.shape) if a.ndim else Field("scalar", a.dtype.name)
            elif e in _TEXT:
                fields[name] = Field("string")
            else:
                fields[name] = Field("bytes")
        self._ext = {_field_name(e): e for e in exts}
        super().__init__(fields=fields, num_samples=len(keys), label="cls" if "cls" in fields else None,
                         metadata={"source": "webdataset", "tars": [printable(t.name) for t in tars]},
                         max_pixels=max_pixels)

    def key(self, i: int) -> str:
        return str(self._keys[i])

    def _raw(self, ext: str, i: int) -> bytes:
        ti, off, size = (int(x) for x in self._loc[ext][i])
        fd = self._files.get(ti)
        if fd is None:
            fd = self._files[ti] = os.open(self.tars[ti], os.O_RDONLY)
        # pread: no shared file offset, so forked validation workers can read concurrently.
        return os.pread(fd, size, off)

    def _npy(self, data: bytes, i: int) -> np.ndarray:
        try:
            return np.load(io.BytesIO(data), allow_pickle=False)
        except ValueError as e:
            raise ValueError(f".npy member is not a plain numpy array ({e})") from None

    def read(self, i: int) -> dict:
        out = {}
        for name, f in self.fields.items():
            raw = self._raw(self._ext[name], i)
            if f.kind in ("image", "bytes"):
                out[name] = raw
            elif f.kind == "string":
                out[name] = raw.decode("utf-8")
            elif f.kind == "scalar" and self._ext[name] in _INT:
                try:
                    out[name] = int(raw.decode("ascii").strip())
                except ValueError:
                    raise ValueError(f".{self._ext[name]} member {raw[:20]!r} is not an integer") from None
            else:
                out[name] = self._npy(raw, i)
        return out

    def close(self):
        for fd in self._files.values():
            os.close(fd)
        self._files.clear()
