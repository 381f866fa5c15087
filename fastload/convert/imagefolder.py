"""imagefolder: ``SRC/<class>/<image>`` like torchvision's ImageFolder.

Classes are the sorted sub-folder names (label i = i-th name); files are taken in sorted
order within each class; the key of a sample is its path relative to SRC. Files whose
extension is not an image extension are ignored (and counted), as ImageFolder does.
"""
from __future__ import annotations

import os
from pathlib import Path

import numpy as np

from ..store.format import Field
from .common import IMAGE_EXTENSIONS, ConvertError, Source


class ImageFolderSource(Source):
    def __init__(self, src: str | os.PathLike, max_pixels: int | None = None):
        root = Path(src)
        if not root.is_dir():
            raise ConvertError(f"{root}: not a directory; imagefolder expects SRC/<class>/<image files>")
        try:
            classes = sorted(e.name for e in os.scandir(root) if e.is_dir() and not e.name.startswith("."))
        except PermissionError as e:
            raise ConvertError(f"{root}: cannot be read ({e})") from None
        if not classes:
            raise ConvertError(f"{root}: has no class sub-folders; imagefolder expects SRC/<class>/<image files>")
        paths: list[str] = []
        labels: list[int] = []
        ignored = 0
        empty = []
        for ci, c in enumerate(classes):
            before = len(paths)
            for dirpath, dirnames, filenames in os.walk(root / c, followlinks=True):
                dirnames.sort()
                for fn in sorted(filenames):
                    if fn.lower().endswith(IMAGE_EXTENSIONS):
                        paths.append(os.path.relpath(os.path.join(dirpath, fn), root))
                        labels.append(ci)
                    elif not fn.startswith("."):
                        ignored += 1
            if len(paths) == before:
                empty.append(c)
        if not paths:
            raise ConvertError(f"{root}: no image files (extensions {', '.join(IMAGE_EXTENSIONS)}) in its class folders")
        if empty:  # as torchvision's ImageFolder: an empty class would still take a class id
            shown = ", ".join(repr(c) for c in empty[:5]) + (", …" if len(empty) > 5 else "")
            raise ConvertError(f"{root}: class folder(s) {shown} hold no image files; remove them or add "
                               "images (class ids are the sorted folder names, so an empty folder "
                               "would still be a class)")
        self._init(root, classes, np.array(paths), np.array(labels, dtype=np.int64), ignored, max_pixels)

    @classmethod
    def from_listing(cls, root: str | os.PathLike, classes: list[str], paths, labels, ignored: int,
                     max_pixels: int | None = None) -> "ImageFolderSource":
        """The source of an already walked folder (or a slice of its listing: the distributed
        convert's tasks read their row range of the listing instead of walking SRC again)."""
        self = cls.__new__(cls)
        self._init(Path(root), list(classes), np.asarray(paths), np.asarray(labels, dtype=np.int64),
                   int(ignored), max_pixels)
        return self

    def _init(self, root: Path, classes: list[str], paths: np.ndarray, labels: np.ndarray, ignored: int,
              max_pixels: int | None) -> None:
        super().__init__(fields={"image": Field("image"), "label": Field("scalar", "int64")},
                         num_samples=len(paths), label="label", class_names=classes,
                         metadata={"source": "imagefolder", "ignored_files": ignored},
                         max_pixels=max_pixels)
        self.root = root
        # One numpy array of fixed-width strings rather than a list of Python str.
        self.paths = paths
        self.labels = labels
        self.ignored = ignored

    def key(self, i: int) -> str:
        return str(self.paths[i])

    def read(self, i: int) -> dict:
        p = self.root / str(self.paths[i])
        try:
            with open(p, "rb") as f:
                data = f.read()
        except OSError as e:
            raise ValueError(f"cannot read file ({e.strerror or e})") from None
        return {"image": data, "label": int(self.labels[i])}
