"""fastload.Dataset: a :class:`~fastload.store.reader.DatasetReader` that is also a
``torch.utils.data.Dataset``, so it drops into existing ``DataLoader`` code.

The only module of the store that imports torch; ``fastload.store`` loads it on first
access to ``Dataset``. All reading logic lives in the torch-free reader.
"""
from __future__ import annotations

import torch.utils.data

from .reader import DatasetReader

__all__ = ["Dataset"]


class Dataset(DatasetReader, torch.utils.data.Dataset):
    """A fastload dataset directory, opened read-only, usable as a map-style
    ``torch.utils.data.Dataset``: ``ds[i]`` is one sample (a dict), ``ds.__getitems__``
    fetches a whole batch in one vectorised gather, ``ds.get_batch(indices)`` returns it
    stacked. Pickles as its path (spawn-started DataLoader workers reopen it).
    """

    _repr_name = "fastload.Dataset"
