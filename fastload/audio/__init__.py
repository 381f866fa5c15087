"""Audio for ``Loader(transforms={"audio": ...})``: see :mod:`fastload.audio.transforms`."""
from __future__ import annotations

__all__: list[str] = []
