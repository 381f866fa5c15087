"""fastload.vision.decode and Dataset(transform=) for plain DataLoader code."""
import io
import pickle

import numpy as np
import pytest
import torch
from PIL import Image

import fastload
from fastload.demo.photos import photos


def _jpeg(arr, exif_orientation=None):
    buf = io.BytesIO()
    im = Image.fromarray(arr)
    if exif_orientation is not None:
        exif = Image.Exif()
        exif[0x0112] = exif_orientation
        im.save(buf, format="JPEG", quality=95, exif=exif.tobytes())
    else:
        im.save(buf, format="JPEG", quality=95)
    return buf.getvalue()


@pytest.fixture(scope="module")
def photo():
    return photos(["chelsea"])["chelsea"][:200, :300]


def test_decode_equals_pillow_in_every_layout_and_input_type(photo):
    data = _jpeg(photo)
    want = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    t = fastload.vision.decode(data)
    assert t.dtype == torch.uint8 and t.shape == (200, 300, 3) and np.array_equal(t.numpy(), want)
    assert torch.equal(fastload.vision.decode(np.frombuffer(data, np.uint8), layout="CHW"), t.permute(2, 0, 1))
    assert torch.equal(fastload.vision.decode(torch.frombuffer(bytearray(data), dtype=torch.uint8)), t)
    assert fastload.vision.decode(data, mode="L").shape == (200, 300, 1)


def test_decode_is_upright_and_can_decode_small(photo):
    rotated = fastload.vision.decode(_jpeg(photo, exif_orientation=6))  # 90 degrees: as displayed
    assert rotated.shape == (300, 200, 3)
    small = fastload.vision.decode(_jpeg(photo), min_size=50)  # 1/4 scale still >= 50 on the short side
    assert small.shape == (50, 75, 3)
    assert fastload.vision.decode(_jpeg(photo), min_size=150).shape == (200, 300, 3)  # 1/2 would be too small


def test_decode_names_bad_input():
    with pytest.raises(ValueError, match="not a decodable image"):
        fastload.vision.decode(b"\xff\xd8\xffjunk")
    with pytest.raises(ValueError, match="encoded image bytes, not str"):
        fastload.vision.decode("a.jpg")
    with pytest.raises(ValueError, match="layout='HW'"):
        fastload.vision.decode(b"", layout="HW")


def to_training_sample(sample):
    """A per-sample transform, importable by DataLoader worker processes."""
    img = fastload.vision.decode(sample["image"], layout="CHW").float() / 255
    return {"image": torch.nn.functional.interpolate(img[None], size=(32, 32))[0], "label": int(sample["label"])}


def test_dataset_transform_in_a_dataloader_with_workers(tmp_path, photo):
    with fastload.ShardWriter(tmp_path / "ds", {"image": "image", "label": "int64"}) as w:
        for i in range(12):
            w.write({"image": _jpeg(photo[i:i + 100 + i, :150]), "label": i})
    ds = fastload.Dataset(tmp_path / "ds", transform=to_training_sample)
    assert pickle.loads(pickle.dumps(ds)).transform is to_training_sample  # spawn-started workers
    assert ds[3]["image"].shape == (3, 32, 32) and ds.get_batch([3])["label"].tolist() == [3]  # raw batches
    dl = torch.utils.data.DataLoader(ds, batch_size=4, num_workers=2, shuffle=False)
    batches = list(dl)
    assert [b["label"].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11]]
    assert batches[0]["image"].shape == (4, 3, 32, 32)
    with pytest.raises(ValueError, match="pass batch_transform="):
        fastload.Loader(ds, batch_size=4)
