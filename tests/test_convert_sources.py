"""Sources at convert time (issue 19): directory links in an image folder, PIL's own pixel
limit, and keys that tell every file name apart."""
from __future__ import annotations

import io
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

import fastload
from fastload.convert import ConvertError, convert
from fastload.store.keys import escape_key, unescape_key
from _images import write_folder


def _jpeg(seed=0, w=48, h=40) -> bytes:
    b = io.BytesIO()
    Image.fromarray(np.random.default_rng(seed).integers(0, 255, (h, w, 3), dtype=np.uint8)).save(b, "JPEG")
    return b.getvalue()


def _keys(path) -> list[str]:
    ds = fastload.Dataset(path)
    return list(ds.keys(np.arange(len(ds))))


# -- links -----------------------------------------------------------------------------------
def test_a_link_to_src_or_above_it_is_never_followed(tmp_path):
    src = write_folder(tmp_path / "src", {"cat/1.jpg": _jpeg(1), "dog/2.jpg": _jpeg(2), "dog/deep/3.jpg": _jpeg(3)})
    (src / "cat" / "up").symlink_to("..")  # SRC itself: would read dog's images as cats
    (src / "dog" / "deep" / "top").symlink_to(tmp_path)  # a folder holding SRC
    r = convert("imagefolder", src, tmp_path / "o", progress=False, workers=0)
    assert r["num_samples"] == 3
    assert _keys(tmp_path / "o") == ["cat/1.jpg", "dog/2.jpg", "dog/deep/3.jpg"]
    ds = fastload.Dataset(tmp_path / "o")
    assert ds.manifest["label"]["counts"] == [1, 2] and ds.manifest["metadata"]["repeated_dirs"] == 2


def test_a_class_folder_linked_to_another_class_is_an_error_naming_the_link(tmp_path):
    src = write_folder(tmp_path / "src", {"cat/1.jpg": _jpeg(1), "dog/2.jpg": _jpeg(2)})
    (src / "kitty").symlink_to("cat")
    with pytest.raises(ConvertError, match=r"class folder 'kitty' is a link to 'cat', another class folder"):
        convert("imagefolder", src, tmp_path / "o", progress=False, workers=0)
    (src / "kitty").unlink()
    (src / "acat").symlink_to(src / "cat")  # sorted before the folder it links to: still the link is named
    with pytest.raises(ConvertError, match=r"class folder 'acat' is a link to 'cat'"):
        convert("imagefolder", src, tmp_path / "o", progress=False, workers=0)
    (src / "acat").unlink()
    (src / "all").symlink_to(".")  # SRC itself as a class
    with pytest.raises(ConvertError, match=r"class folder 'all' is a link to .*, which holds .*src itself"):
        convert("imagefolder", src, tmp_path / "o", progress=False, workers=0)
    (src / "all").unlink()
    # a class folder that is a link to a folder of its own (outside SRC) is a class like any other
    write_folder(tmp_path / "birds", {"4.jpg": _jpeg(4)})
    (src / "bird").symlink_to(tmp_path / "birds")
    assert convert("imagefolder", src, tmp_path / "o", progress=False, workers=0)["num_samples"] == 3
    assert _keys(tmp_path / "o") == ["bird/4.jpg", "cat/1.jpg", "dog/2.jpg"]


# -- PIL's pixel limit --------------------------------------------------------------------------
def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fastload", "convert", *map(str, args)], capture_output=True,
                          text=True, timeout=600)


def _pil_lines(stderr: str) -> list[str]:
    return [ln for ln in stderr.splitlines() if "DecompressionBomb" in ln or "warn" in ln.lower() or "PIL" in ln]


@pytest.mark.timeout(600)
def test_max_pixels_above_pils_own_limit_takes_a_big_image_without_pil_warnings(tmp_path):
    w, h = 15000, 12000  # 180 MP: PIL refuses more than 2 x 89.5 MP by default, and warns above 89.5 MP
    assert w * h > 2 * Image.MAX_IMAGE_PIXELS
    b = io.BytesIO()
    Image.new("1", (w, h), 1).save(b, "PNG")  # a flat 1-bit PNG: a few KB on disk
    src = write_folder(tmp_path / "src", {"big/flat.png": b.getvalue(), "small/a.jpg": _jpeg()})
    p = _cli("imagefolder", src, tmp_path / "o", "--max-pixels", 200_000_000, "--workers", 1, "-q")
    assert p.returncode == 0, p.stderr
    assert not _pil_lines(p.stderr), p.stderr  # no DecompressionBombWarning
    ds = fastload.Dataset(tmp_path / "o")
    assert _keys(tmp_path / "o") == ["big/flat.png", "small/a.jpg"]
    assert ds.manifest["metadata"]["max_pixels"] == 200_000_000
    # the default limit (the Loader's, 2**26) refuses it with fastload's own line, no PIL lines
    p = _cli("imagefolder", src, tmp_path / "o2", "--workers", 1, "-q", "--on-error", "skip")
    assert p.returncode == 0 and not _pil_lines(p.stderr), p.stderr
    (rec,) = [json.loads(x) for x in (tmp_path / "o2" / "skipped.jsonl").read_text().splitlines()]
    assert rec["key"] == "big/flat.png" and f"image of {w}x{h} = {w * h} pixels exceeds max_pixels=67108864" \
        in rec["reason"]


def test_pils_limit_is_restored_after_a_conversion_in_this_process(tmp_path):
    before = Image.MAX_IMAGE_PIXELS
    src = write_folder(tmp_path / "src", {"a/1.jpg": _jpeg()})
    convert("imagefolder", src, tmp_path / "o", progress=False, workers=0, max_pixels=10**9)
    assert Image.MAX_IMAGE_PIXELS == before


# -- keys ----------------------------------------------------------------------------------------
def test_keys_are_injective_backslashes_escaped(tmp_path):
    names = ["a\\nb.jpg", "a\nb.jpg", "caf\\xe9.jpg", os.fsdecode(b"caf\xe9.jpg"), "x\\\\y.jpg", "x\\y.jpg",
             "plain.jpg", "\x85.jpg", "\\u0085.jpg", "\u00e9t\u00e9.jpg"]
    keys = [escape_key(n) for n in names]
    assert len(set(keys)) == len(names)  # two names never share a key
    assert [unescape_key(k) for k in keys] == names  # and every key reads back to its name
    assert all(k.isprintable() and "\n" not in k for k in keys)
    assert keys[6] == "plain.jpg" and keys[9] == "\u00e9t\u00e9.jpg"  # most names stay as they are
    # through convert: a literal backslash-n and a real newline are two samples with two keys
    src = tmp_path / "src"
    (src / "a").mkdir(parents=True)
    raw = {b"a\\nb.jpg": _jpeg(1), b"a\nb.jpg": _jpeg(2), b"caf\\xe9.jpg": _jpeg(3), b"caf\xe9.jpg": _jpeg(4)}
    for name, data in raw.items():
        with open(os.fsencode(src / "a") + b"/" + name, "wb") as f:
            f.write(data)
    convert("imagefolder", src, tmp_path / "o", progress=False, workers=0)
    keys = _keys(tmp_path / "o")
    assert len(set(keys)) == 4
    by_key = {k: bytes(fastload.Dataset(tmp_path / "o")[i]["image"]) for i, k in enumerate(keys)}
    for name, data in raw.items():  # each key names exactly its own file
        assert by_key[escape_key("a/" + os.fsdecode(name))] == data


def test_a_table_with_two_path_columns_keys_samples_by_its_first_in_every_process(tmp_path):
    """The sample key comes from the first path column in the table's order, never from a
    set's order (which differs between processes with different PYTHONHASHSEEDs)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    for name in ("a.jpg", "b.jpg", "c.jpg", "d.jpg"):
        (tmp_path / name).write_bytes(_jpeg(len(name)))
    pq.write_table(pa.table({"zeta": ["a.jpg", "b.jpg"], "alpha": ["c.jpg", "d.jpg"]}), tmp_path / "t.parquet")
    code = ("import sys; from fastload.convert.table import TableSource; "
            "s = TableSource(sys.argv[1]); print(s.key(0), s.key(1))")
    # fresh interpreters (a hash seed is fixed at start-up: a forked child keeps its parent's), all at once
    procs = [subprocess.Popen([sys.executable, "-c", code, str(tmp_path / "t.parquet")], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONHASHSEED": str(seed)})
             for seed in range(8)]
    seen = set()
    try:
        for p in procs:
            out, err = p.communicate(timeout=120)
            assert p.returncode == 0, err
            seen.add(out.split("\n")[0].strip())
    finally:
        for p in procs:
            p.kill()
            p.wait()
    assert seen == {"a.jpg b.jpg"}, seen
