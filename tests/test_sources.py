"""Sources and conversion (issue 19): only regular files are read, with a cap; directory links
followed once per real directory; images checked with the Loader's decoder (DALI on the CPU)
and its max_pixels; MPO accepted; any file name carried, escaped, in keys and reports."""
import io
import json
import os
import struct
import time
import zlib

import numpy as np
import pytest
from PIL import Image

import fastload
from fastload.errors import ConvertError
from _images import write_folder


def _jpeg(w=48, h=40, seed=0) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(b, "JPEG")
    return b.getvalue()


def _png_short_idat(w=64, h=64) -> bytes:
    """A PNG whose IDAT holds half the rows its header declares: PIL decodes it, DALI does not."""
    raw = b"".join(b"\x00" + bytes(w * 3) for _ in range(h // 2))

    def chunk(t, d):
        return struct.pack(">I", len(d)) + t + d + struct.pack(">I", zlib.crc32(t + d) & 0xFFFFFFFF)
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(raw)) + chunk(b"IEND", b""))


def _jpeg_declaring(w: int, h: int) -> bytes:
    """A small JPEG whose frame header claims w x h pixels (the data stays small)."""
    data = bytearray(_jpeg())
    i = data.index(b"\xff\xc0")
    struct.pack_into(">HH", data, i + 5, h, w)
    return bytes(data)


def _mpo() -> bytes:
    b = io.BytesIO()
    first = Image.fromarray(np.random.default_rng(3).integers(0, 255, (40, 48, 3), dtype=np.uint8))
    first.save(b, "MPO", save_all=True, append_images=[Image.new("RGB", (48, 40))])
    return b.getvalue()


def _keys(ds):
    return ds.keys(np.arange(len(ds)))


def _report(d):
    return [json.loads(line) for line in (d / "skipped.jsonl").read_text().splitlines()]


@pytest.mark.timeout(120)
def test_fifos_devices_and_oversized_files_among_the_sources_are_named_not_hung_on(tmp_path):
    src = write_folder(tmp_path / "src", {"a/ok.jpg": _jpeg(), "b/ok.jpg": _jpeg(seed=1)})
    os.mkfifo(src / "a" / "pipe.jpg")
    (src / "b" / "zero.jpg").symlink_to("/dev/zero")
    t0 = time.perf_counter()
    with pytest.raises(ConvertError, match=r"a/pipe.jpg: it is a FIFO \(named pipe\), not a regular file"):
        fastload.convert("imagefolder", src, tmp_path / "o1", progress=False, workers=2)
    r = fastload.convert("imagefolder", src, tmp_path / "o2", progress=False, on_error="skip", workers=2)
    assert r["num_samples"] == 2 and r["skipped"] == 2
    reasons = {x["key"]: x["reason"] for x in _report(tmp_path / "o2")}
    assert "FIFO" in reasons["a/pipe.jpg"] and "character device" in reasons["b/zero.jpg"]
    assert time.perf_counter() - t0 < 60
    # a table naming a FIFO as its image, a FIFO as the table, a FIFO as a tar shard
    (tmp_path / "t.csv").write_text(f"image,label\n{src / 'a' / 'pipe.jpg'},0\n{src / 'a' / 'ok.jpg'},1\n")
    with pytest.raises(ConvertError, match="FIFO"):
        fastload.convert("table", tmp_path / "t.csv", tmp_path / "o3", progress=False)
    os.mkfifo(tmp_path / "fifo.csv")
    with pytest.raises(ConvertError, match=r"fifo.csv is a FIFO"):
        fastload.convert("table", tmp_path / "fifo.csv", tmp_path / "o4", progress=False)
    os.mkfifo(tmp_path / "shard.tar")
    with pytest.raises(ConvertError, match="is a FIFO"):
        fastload.convert("webdataset", tmp_path / "shard.tar", tmp_path / "o5", progress=False)
    os.mkfifo(tmp_path / "x.npy")
    with pytest.raises(ConvertError, match="is a FIFO"):
        fastload.convert("arrays", tmp_path / "x.npy", tmp_path / "o6", progress=False)


def test_an_oversized_source_file_is_refused_by_size_not_read(tmp_path, monkeypatch):
    import fastload.files
    src = write_folder(tmp_path / "src", {"a/ok.jpg": _jpeg(), "a/big.jpg": _jpeg(seed=2) + b"\0" * 5000})
    monkeypatch.setattr(fastload.files, "MAX_SAMPLE_BYTES", 4000)
    r = fastload.convert("imagefolder", src, tmp_path / "o", progress=False, on_error="skip", workers=0)
    assert r["skipped"] == 1 and "more than the limit of 4,000" in _report(tmp_path / "o")[0]["reason"]


def test_directory_links_are_followed_once_per_real_directory(tmp_path):
    src = write_folder(tmp_path / "src", {"a/x/1.jpg": _jpeg(), "a/2.jpg": _jpeg(seed=1), "b/3.jpg": _jpeg(seed=2)})
    (src / "a" / "x" / "loop").symlink_to(src / "a")  # a link back to an ancestor
    (src / "a" / "again").symlink_to(src / "a" / "x")  # a second way into one directory
    (src / "b" / "linked").symlink_to(tmp_path / "elsewhere")  # a link outside SRC: followed
    write_folder(tmp_path / "elsewhere", {"4.jpg": _jpeg(seed=3)})
    r = fastload.convert("imagefolder", src, tmp_path / "o", progress=False)
    ds = fastload.Dataset(tmp_path / "o")
    assert r["num_samples"] == 4 and sorted(_keys(ds)) == ["a/2.jpg", "a/x/1.jpg", "b/3.jpg", "b/linked/4.jpg"]
    assert ds.manifest["metadata"]["repeated_dirs"] == 2


def test_images_the_loaders_decoder_cannot_decode_are_refused_at_convert_time(tmp_path):
    src = write_folder(tmp_path / "src", {"a/ok.jpg": _jpeg(), "a/short.png": _png_short_idat(),
                                     "b/ok.jpg": _jpeg(seed=1), "b/huge.jpg": _jpeg_declaring(9000, 8000),
                                     "b/phone.jpg": _mpo()})
    with Image.open(src / "a" / "short.png") as im:
        im.load()  # PIL accepts it...
    with pytest.raises(ConvertError, match=r"a/short.png: DALI \(the Loader's decoder\) cannot decode it"):
        fastload.convert("imagefolder", src, tmp_path / "o1", progress=False)
    r = fastload.convert("imagefolder", src, tmp_path / "o2", progress=False, on_error="skip")
    reasons = {x["key"]: x["reason"] for x in _report(tmp_path / "o2")}
    assert set(reasons) == {"a/short.png", "b/huge.jpg"}
    assert "Not enough image data" in reasons["a/short.png"]  # what libpng said, not on the terminal
    assert "exceeds max_pixels=67108864" in reasons["b/huge.jpg"] and r["max_pixels"] == 2**26
    ds = fastload.Dataset(tmp_path / "o2")
    assert sorted(_keys(ds)) == ["a/ok.jpg", "b/ok.jpg", "b/phone.jpg"]  # MPO (phones) accepted
    assert ds.manifest["metadata"]["max_pixels"] == 2**26
    with fastload.Loader(ds, batch_size=3, device="cpu", transforms={"image": fastload.vision.eval(32, resize=36)}) as ld:
        assert [b["image"].shape[0] for b in ld] == [3]  # every image converted is decodable
    r = fastload.convert("imagefolder", src, tmp_path / "o3", progress=False, on_error="skip", max_pixels=10**8)
    assert r["skipped"] == 1 and r["max_pixels"] == 10**8  # the limit is raised explicitly
    from fastload.cli import main
    assert main(["convert", "imagefolder", str(src), str(tmp_path / "o4"), "-q", "--on-error", "skip"]) == 0


def test_any_file_name_is_carried_escaped_in_keys_and_reports(tmp_path, capsys):
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    (src / "b").mkdir()
    raw = os.fsencode(src / "a") + b"/caf\xe9.jpg"  # not UTF-8
    with open(raw, "wb") as f:
        f.write(_jpeg())
    with open(os.fsencode(src / "a") + b"/bad\xff.jpg", "wb") as f:
        f.write(b"not an image")
    (src / "b" / "two\nlines.jpg").write_bytes(_jpeg(seed=1))
    (src / "b" / "tab\there.jpg").write_bytes(b"junk")
    r = fastload.convert("imagefolder", src, tmp_path / "o", progress=False, on_error="skip")
    ds = fastload.Dataset(tmp_path / "o")
    assert sorted(_keys(ds)) == ["a/caf\\xe9.jpg", "b/two\\nlines.jpg"] and r["skipped"] == 2
    report = (tmp_path / "o" / "skipped.jsonl").read_text()
    assert report.count("\n") == 2 and {x["key"] for x in _report(tmp_path / "o")} == {"a/bad\\xff.jpg",
                                                                                         "b/tab\\there.jpg"}
    with pytest.raises(ConvertError) as e:
        fastload.convert("imagefolder", src, tmp_path / "o2", progress=False)
    assert "\n" not in str(e.value) and "bad\\xff.jpg" in str(e.value)
    from fastload.cli import main
    assert main(["convert", "imagefolder", str(src), str(tmp_path / "o3"), "-q"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "bad\\xff.jpg" in err
