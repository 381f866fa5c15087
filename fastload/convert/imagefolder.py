"""imagefolder: ``SRC/<class>/<image>`` like torchvision's ImageFolder.

Classes are the sorted sub-folder names (label i = i-th name); files are taken in sorted
order within each class; the key of a sample is its path relative to SRC (any bytes: names
that are not UTF-8, or hold a newline, are escaped as ``\\xNN`` / ``\\n`` in keys and reports).
Files whose extension is not an image extension are ignored (and counted), as ImageFolder does.

Symbolic links to directories are followed, but every real directory is read at most once
(a link back to an ancestor, or two links to one directory, add no duplicate samples; the
directories skipped are counted in the manifest's metadata as ``repeated_dirs``), and a link
whose real target is SRC or holds SRC (``cat/up -> ..``, a link to ``/``) is never followed.
A class folder that is a link to another class folder (``kitty -> cat``), into one, or to SRC
or a folder holding it, is an error naming the link: a class is one folder. Only
regular files are read (a FIFO, a device or a directory named like an image is an error
naming it), each at most ``files.MAX_SAMPLE_BYTES``.
"""
from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from ..files import NotRegularFile, read_regular
from ..store.format import Field
from ..store.geometry import DEFAULT_MAX_PIXELS
from .common import IMAGE_EXTENSIONS, ConvertError, Source


def _within(path: str, folder: str) -> bool:
    """``path`` is ``folder`` or inside it (real paths)."""
    return path == folder or path.startswith(folder.rstrip(os.sep) + os.sep)


def _check_class_links(root: Path, root_real: str, classes: list[str]) -> None:
    """A class folder that is a link must lead to a folder of its own: not SRC or a folder
    holding it, not another class folder or a folder inside (or around) one."""
    real = {c: os.path.realpath(root / c) for c in classes}
    for c in classes:
        if not os.path.islink(root / c):
            continue
        r = real[c]
        if _within(root_real, r):
            raise ConvertError(f"{root}: class folder {c!r} is a link to {r}, which holds {root} itself; "
                               "a class is one folder of images: remove the link")
        for d in classes:
            if d != c and (_within(r, real[d]) or _within(real[d], r)):
                what = f"to {d!r}, another class folder" if r == real[d] else \
                    (f"into the class folder {d!r}" if _within(r, real[d]) else f"to a folder holding the class folder {d!r}")
                raise ConvertError(f"{root}: class folder {c!r} is a link {what} (its images would be read for "
                                   f"two classes); a class is one folder: remove the link {root / c}, or copy the "
                                   "images that belong to both classes")


def _ident(path) -> tuple[int, int] | None:
    """A directory's identity (device, inode), following links; None if it cannot be read."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return st.st_dev, st.st_ino


class Files(Sequence):
    """The image files of a listing as paths (``root/<path>``), made one at a time: no list
    of a million strings beside the listing's array."""

    def __init__(self, root: Path, paths: np.ndarray):
        self.root, self.paths = os.fspath(root), paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return os.path.join(self.root, str(self.paths[i]))


class ImageFolderSource(Source):
    EXTENSIONS = IMAGE_EXTENSIONS  # the files taken (a media folder takes others, see media.py)
    WHAT = "image"

    def __init__(self, src: str | os.PathLike, max_pixels: int | None = DEFAULT_MAX_PIXELS, *,
                 max_size: int | None = None, quality: int | None = None):
        root = Path(src)
        if not root.is_dir():
            raise ConvertError(f"{root}: not a directory; {self.WHAT}folder expects SRC/<class>/<{self.WHAT} files>")
        try:
            classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        except PermissionError as e:
            raise ConvertError(f"{root}: cannot be read ({e})") from None
        if not classes:
            raise ConvertError(f"{root}: has no class sub-folders; {self.WHAT}folder expects SRC/<class>/<{self.WHAT} "
                               "files>")
        root_real = os.path.realpath(root)
        _check_class_links(root, root_real, classes)
        paths: list[str] = []
        labels: list[int] = []
        ignored = 0
        empty = []
        # Directories are read once each, through their real path when SRC holds one: a link
        # to a directory SRC also holds without links (or to one read already) is not followed.
        plain = {i for c in classes for i in (_ident(d) for d, _, _ in os.walk(root / c)) if i is not None}
        seen: set[tuple[int, int]] = set()
        repeated = 0
        for ci, c in enumerate(classes):
            before = len(paths)
            for dirpath, dirnames, filenames in os.walk(root / c, followlinks=True):
                me = _ident(dirpath)
                if me is not None and me in seen:  # e.g. a class folder linking to another one
                    dirnames[:] = []
                    repeated += 1
                    continue
                if me is not None:
                    seen.add(me)
                keep = []
                for dn in sorted(dirnames):
                    full = os.path.join(dirpath, dn)
                    if os.path.islink(full):
                        target = _ident(full)
                        if target is None or target in seen or target in plain or \
                                _within(root_real, os.path.realpath(full)):
                            repeated += 1  # a loop (to SRC, or above it), or a second way into a directory read anyway
                            continue
                    keep.append(dn)
                dirnames[:] = keep
                for fn in sorted(filenames):
                    if fn.lower().endswith(self.EXTENSIONS):
                        paths.append(os.path.relpath(os.path.join(dirpath, fn), root))
                        labels.append(ci)
                    elif not fn.startswith("."):
                        ignored += 1
            if len(paths) == before:
                empty.append(c)
        if not paths:
            raise ConvertError(f"{root}: no {self.WHAT} files (extensions {', '.join(self.EXTENSIONS)}) in its class "
                               "folders")
        if empty:  # as torchvision's ImageFolder: an empty class would still take a class id
            shown = ", ".join(repr(c) for c in empty[:5]) + (", …" if len(empty) > 5 else "")
            raise ConvertError(f"{root}: class folder(s) {shown} hold no {self.WHAT} files; remove them or add "
                               f"{self.WHAT} files (class ids are the sorted folder names, so an empty folder "
                               "would still be a class)")
        self._init(root, classes, np.array(paths), np.array(labels, dtype=np.int64), ignored, max_pixels, repeated,
                   max_size, quality)

    @classmethod
    def from_listing(cls, root: str | os.PathLike, classes: list[str], paths, labels, ignored: int,
                     max_pixels: int | None = None, repeated_dirs: int = 0, *, max_size: int | None = None,
                     quality: int | None = None) -> ImageFolderSource:
        """The source of an already walked folder (or a slice of its listing: the distributed
        convert's tasks read their row range of the listing instead of walking SRC again)."""
        self = cls.__new__(cls)
        self._init(Path(root), list(classes), np.asarray(paths), np.asarray(labels, dtype=np.int64),
                   int(ignored), max_pixels, int(repeated_dirs), max_size, quality)
        return self

    def _init(self, root: Path, classes: list[str], paths: np.ndarray, labels: np.ndarray, ignored: int,
              max_pixels: int | None, repeated: int = 0, max_size: int | None = None,
              quality: int | None = None) -> None:
        super().__init__(fields={"image": Field("image"), "label": Field("scalar", "int64")},
                         num_samples=len(paths), label="label", class_names=classes,
                         metadata={"source": "imagefolder", "ignored_files": ignored, "repeated_dirs": repeated},
                         max_pixels=max_pixels, max_size=max_size, quality=quality)
        self.root = root
        # One numpy array of fixed-width strings rather than a list of Python str.
        self.paths = paths
        self.labels = labels
        self.ignored = ignored
        self.repeated_dirs = repeated

    def key(self, i: int) -> str:
        return str(self.paths[i])

    def inputs(self) -> Files:
        return Files(self.root, self.paths)

    def read(self, i: int) -> dict:
        p = self.root / str(self.paths[i])
        try:
            data = read_regular(p, what="image file")
        except NotRegularFile as e:  # the key names the file already
            raise ValueError(f"it {e.detail}") from None
        except OSError as e:
            raise ValueError(f"cannot read file ({e.strerror or e})") from None
        return {"image": data, "label": int(self.labels[i])}
