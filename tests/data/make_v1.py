"""How tests/data/v1/ was made: a format version 1 dataset written by fastload's writer as it
was before ragged fields existed (commit 8d7542b), so tests/test_ragged_store.py checks that
today's reader opens what the old writer wrote — not what today's writer writes as version 1.

    git archive 8d7542b | tar -x -C /tmp/old
    python tests/data/make_v1.py /tmp/old tests/data/v1     # needs numpy, pyarrow, xxhash, Pillow

Do not regenerate it with the current code: the point is that the bytes come from the old one.
The values follow from the sample number ``i`` (see test_ragged_store.py, which rebuilds them).
"""
import io
import shutil
import sys

import numpy as np
from PIL import Image

old, out = sys.argv[1], sys.argv[2]
sys.path.insert(0, old)
import fastload.store  # noqa: E402
from fastload.store import ShardWriter  # noqa: E402

assert fastload.store.__file__.startswith(old), fastload.store.__file__


def jpeg(i: int) -> bytes:
    a = np.zeros((8, 12, 3), np.uint8)
    a[..., 0] = 20 * i
    a[:, :6, 1] = 200
    b = io.BytesIO()
    Image.fromarray(a).save(b, format="JPEG", quality=90)
    return b.getvalue()


shutil.rmtree(out, ignore_errors=True)
fields = {"image": "image", "label": "int64", "x": "float32[3]", "m": "uint8[2,2]", "w": "float64",
          "key": "string", "blob": "bytes"}
with ShardWriter(out, fields, shard_size=4000, label="label", class_names=["a", "b", "c"],
                 metadata={"made_by": "fastload 8d7542b (format v1 writer), tests/data/make_v1.py"}) as w:
    for i in range(12):
        w.write({"image": jpeg(i), "label": i % 3, "x": np.array([i, -i, 0.5 * i], np.float32),
                 "m": (np.arange(4, dtype=np.uint8) + 4 * i).reshape(2, 2), "w": i / 8, "key": f"sample-{i:02d}",
                 "blob": bytes(range(i))}, image_sizes={"image": (12, 8)})
print("written", out)
