"""Parquet tables of (image, caption) as raw data (issue 30): rows read as members, a Hugging Face Image column
too, with the same bad-input handling as files, and encoded by the later stages without being unpacked."""

from __future__ import annotations

import hashlib

import pytest

from sdpipe.train.data import LatentData
from tests.conftest import cache_latents, small_config
from tests.test_prepare import noise, put, run_prepare

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def tables(raw) -> list[bytes]:
    """A table of bytes and captions in two row groups, with one empty image and one broken one; a Hugging Face
    style table (the Image feature's struct) without captions; a .parquet that is none; a table with no images."""
    images = [noise((48, 40), seed=i) for i in range(4)] + [None, b"\x89PNG\r\n\x1a\nbroken"]
    captions = [f"noise number {i}" for i in range(6)]
    raw.mkdir(parents=True)
    pq.write_table(pa.table({"jpg": images, "caption": captions}), raw / "laion.parquet", row_group_size=3)
    hf = pa.table({"image": [{"bytes": noise((40, 48), seed=9), "path": "x.png"}], "label": [3]})
    pq.write_table(hf, raw / "hf.parquet")
    put(raw, "broken.parquet", b"PAR1 not a table at all")
    pq.write_table(pa.table({"caption": ["only words"]}), raw / "words.parquet")
    return images


def test_rows_are_members_and_bad_rows_and_tables_are_rejected_one_line_each(tmp_path):
    raw = tmp_path / "raw"
    images = tables(raw)
    rows, rejected, summary = run_prepare(raw, tmp_path / "out")
    by_path = {r["path"]: r for r in rows}
    assert sorted(by_path) == ["hf.parquet/000000000.image"] + [f"laion.parquet/00000000{i}.jpg" for i in range(4)]
    third = by_path["laion.parquet/000000003.jpg"]  # in the second row group
    assert third["id"] == hashlib.sha256(images[3]).hexdigest() and third["sidecar"] == "noise number 3"
    assert by_path["hf.parquet/000000000.image"]["sidecar"] is None
    reasons = {r["path"]: r["reason"] for r in rejected}
    assert set(reasons) == {
        "laion.parquet/000000004.jpg",
        "laion.parquet/000000005.jpg",
        "broken.parquet",
        "words.parquet",
    }
    assert "has no jpg" in reasons["laion.parquet/000000004.jpg"]
    assert "not a readable parquet table" in reasons["broken.parquet"] and "no image column" in reasons["words.parquet"]
    assert not any("extension" in w for w in summary["warnings"])  # a row's name is sdpipe's, not the user's
    again = run_prepare(raw, tmp_path / "again")
    assert again[0] == rows and again[2]["decoded"] == 0


def test_rows_are_encoded_without_unpacking(tmp_path, tiny_model):
    raw = tmp_path / "raw"
    tables(raw)
    raw_cfg = small_config(tmp_path, raw, tiny_model, caption={"template": "a noisy picture"})
    data = LatentData(cache_latents(tmp_path, raw_cfg))
    assert len(data.items) == 5 and {it["caption"] for it in data.items} >= {"noise number 0", "a noisy picture"}
