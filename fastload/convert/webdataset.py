"""webdataset: tar shards in the WebDataset layout -> one field per file extension.

Members are grouped into samples by key (the member path up to the first dot of its
basename); each extension is a field: image extensions -> image, ``cls``/``cls2``/``index``
-> int64 scalar (decimal text; ``cls`` becomes the label; ``index`` is stored as the field
``source_index``, since the Loader's ``batch["index"]`` holds the global sample indices), ``npy`` -> tensor (fixed shape,
``allow_pickle=False``; arrays whose first dimension varies between samples -> a ragged field,
``int32[]`` or ``float32[*,4]``: token sequences, audio, boxes), ``txt``/``json`` and other
text -> string, anything else -> bytes.
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


def _kind(ext: str) -> str:
    """How a member is decoded: its last extension ("tokens.npy" is an npy array)."""
    return ext.rsplit(".", 1)[-1]


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
    def __init__(self, src: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS, *,
                 max_size: int | None = None, quality: int | None = None):
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
        from .sourcestate import stat_file

        opened = {os.fspath(tp): stat_file(tp) for tp in tars}  # before reading them
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
            kind = _kind(e)
            if kind in _IMAGE:
                fields[name] = Field("image")
            elif kind in _INT:
                fields[name] = Field("scalar", "int64")
            elif kind == "npy":
                fields[name] = self._npy_field(e)
            elif kind in _TEXT:
                fields[name] = Field("string")
            else:
                fields[name] = Field("bytes")
        self._ext = {_field_name(e): e for e in exts}
        super().__init__(fields=fields, num_samples=len(keys), label="cls" if "cls" in fields else None,
                         metadata={"source": "webdataset", "tars": [printable(t.name) for t in tars]},
                         max_pixels=max_pixels, max_size=max_size, quality=quality)

        self.opened = opened

    def key(self, i: int) -> str:
        return str(self._keys[i])

    def inputs(self) -> list[str]:
        return self.tars

    def _fd(self, ti: int) -> int:
        fd = self._files.get(ti)
        if fd is None:
            fd = self._files[ti] = os.open(self.tars[ti], os.O_RDONLY)
        return fd

    def _raw(self, ext: str, i: int) -> bytes:
        ti, off, size = (int(x) for x in self._loc[ext][i])
        # pread: no shared file offset, so forked validation workers can read concurrently.
        return os.pread(self._fd(ti), size, off)

    def _npy_field(self, ext: str) -> Field:
        """From every sample's ``.npy`` header (not its data): the first sample's shape and
        dtype make a tensor (or scalar) field, or a ragged one when other samples differ from
        it in the first dimension only. Samples that fit neither are refused one by one by the
        writer (``--on-error skip`` leaves them out)."""
        first, dtype = self._npy_header(ext, 0)
        if dtype.name not in SUPPORTED_DTYPES:
            raise ConvertError(f"{self._keys[0]}.{ext} has dtype {dtype}, which cannot be stored")
        ragged = False
        for i in range(1, len(self._keys)):
            shape, _ = self._npy_header(ext, i)
            if shape != first and len(shape) == len(first) >= 1 and shape[1:] == first[1:]:
                ragged = True
                break
        if ragged:
            return Field("ragged", dtype.name, first[1:])
        return Field("tensor", dtype.name, first) if first else Field("scalar", dtype.name)

    def _npy_header(self, ext: str, i: int) -> tuple[tuple[int, ...], np.dtype]:
        ti, off, size = (int(x) for x in self._loc[ext][i])
        head = self._raw(ext, i) if size <= 4096 else os.pread(self._fd(ti), 4096, off)
        f = io.BytesIO(head)
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except ValueError as e:
            raise ConvertError(f"{self._keys[i]}.{ext} is not a plain numpy array ({e})") from None
        if dtype.hasobject:
            raise ConvertError(f"{self._keys[i]}.{ext} holds Python objects (pickle), which fastload never loads")
        return tuple(int(d) for d in shape), dtype

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
            elif f.kind == "scalar" and _kind(self._ext[name]) in _INT:
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
