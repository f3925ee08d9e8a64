"""The demo dataset: deterministic, balanced, correctly captioned, and safe to rerun."""

from __future__ import annotations

import itertools
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdpipe import demo
from sdpipe.errors import UserError

CAPTIONS = {demo.caption_for(*combo): combo for combo in itertools.product(demo.SHAPES, demo.COLOURS, demo.BACKGROUNDS)}


def clean_stem(stem: str) -> str:
    """The caption stage's rule for file-name captions: separators to spaces, trailing number dropped."""
    return re.sub(r"[\s\d]+$", "", stem.replace("_", " ").replace("-", " ")).strip()


def caption_of(image: Path) -> str:
    sidecar = image.with_suffix(".txt")
    return sidecar.read_text("utf-8").strip() if sidecar.exists() else clean_stem(image.stem)


def snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*")) if p.is_file()}


def _gen(out: Path, seed: int) -> Path:
    demo.generate(out, count=60, seed=seed)
    return out


@pytest.fixture(scope="module")
def full(tmp_path_factory) -> tuple[Path, list[Path]]:
    out = tmp_path_factory.mktemp("full") / "raw"
    return out, demo.generate(out, count=480, seed=0)


def test_same_seed_gives_identical_bytes_and_other_seed_differs(tmp_path):
    a = snapshot(_gen(tmp_path / "a", seed=3))
    b = snapshot(_gen(tmp_path / "b", seed=3))
    c = snapshot(_gen(tmp_path / "c", seed=4))
    assert a == b
    assert a != c


def test_layout_counts_and_coverage(full):
    out, images = full
    assert len(images) == 480 and all(p.is_file() for p in images)
    assert {p.relative_to(out).parts[0] for p in images} == set(demo.SHAPES)
    assert all(p.parent.name == CAPTIONS[caption_of(p)][0] for p in images)
    # Nothing but images and captions: the raw folder is scanned as data.
    assert {p.suffix for p in out.rglob("*") if p.is_file()} == {".png", ".txt"}
    combos = [CAPTIONS[caption_of(p)] for p in images]
    shapes, colours = Counter(c[0] for c in combos), Counter(c[1] for c in combos)
    assert set(shapes) == set(demo.SHAPES) and min(shapes.values()) >= 80
    assert len(colours) >= 6 and min(colours.values()) >= 50
    assert all(bg != colour for _, colour, bg in combos)
    sizes = {Image.open(p).size for p in images}
    assert len({round(w / h, 2) for w, h in sizes}) >= 5
    assert all(min(s) >= 64 for s in sizes)


def test_sidecar_fraction_and_file_name_captions(full):
    _, images = full
    with_sidecar = [p for p in images if p.with_suffix(".txt").exists()]
    assert 0.70 <= len(with_sidecar) / len(images) <= 0.95
    bare = [p for p in images if not p.with_suffix(".txt").exists()]
    assert bare and all(clean_stem(p.stem) in CAPTIONS for p in bare)
    for p in with_sidecar[:20]:
        text = p.with_suffix(".txt").read_bytes().decode("utf-8")
        assert text.count("\n") <= 1 and text.strip() in CAPTIONS


@pytest.mark.parametrize("index", [0, 7, 101, 250, 479])
def test_dominant_colour_matches_caption(full, index):
    _, images = full
    _, colour, background = CAPTIONS[caption_of(images[index])]
    pixels = np.asarray(Image.open(images[index]).convert("RGB")).reshape(-1, 3).astype(int)
    bg = np.array(demo.BACKGROUNDS[background])
    shape_pixels = pixels[np.abs(pixels - bg).sum(axis=1) > 30]
    values, counts = np.unique(shape_pixels, axis=0, return_counts=True)
    dominant = values[counts.argmax()]
    assert np.abs(dominant - np.array(demo.COLOURS[colour])).max() <= 6


def test_rerun_is_a_no_op(tmp_path, caplog):
    out = _gen(tmp_path / "raw", seed=0)
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    caplog.set_level("INFO", logger="sdpipe.demo")
    demo.generate(out, count=60, seed=0)
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before
    assert "already present" in caplog.text


def test_foreign_file_is_refused_and_kept(tmp_path):
    out = tmp_path / "raw"
    out.mkdir()
    (out / "holiday.jpg").write_bytes(b"not ours")
    with pytest.raises(UserError, match="not the demo dataset"):
        demo.generate(out, count=10)
    assert (out / "holiday.jpg").read_bytes() == b"not ours"
    assert list(out.iterdir()) == [out / "holiday.jpg"]


def test_other_seed_in_same_folder_is_refused(tmp_path):
    out = _gen(tmp_path / "raw", seed=0)
    with pytest.raises(UserError):
        demo.generate(out, count=60, seed=1)


def test_partial_dataset_is_completed(tmp_path):
    out = _gen(tmp_path / "raw", seed=0)
    expected = snapshot(out)
    victim = next(out.rglob("*.png"))
    victim.unlink()
    demo.generate(out, count=60, seed=0)
    assert snapshot(out) == expected


@pytest.mark.parametrize("count", [0, -5])
def test_count_must_be_positive(tmp_path, count):
    with pytest.raises(UserError, match="--count"):
        demo.generate(tmp_path / "raw", count=count)


def test_caption_for_rejects_unknown_names():
    assert demo.caption_for("star", "orange", "black") == "an orange star on a black background"
    with pytest.raises(ValueError):
        demo.caption_for("blob", "red", "white")
