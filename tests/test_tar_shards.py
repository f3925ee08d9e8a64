"""Tar shards in the webdataset layout as raw data (issue 30): read as folders of their members, with the same
bad-input handling as files, cached by content, and encoded by the later stages without being unpacked."""

from __future__ import annotations

import hashlib
import io as bytes_io
import shutil
import tarfile
from pathlib import Path

import torch

from sdpipe import config, sources
from sdpipe.prepare import files, memo
from sdpipe.train.data import LatentData
from tests.conftest import cache_latents, small_config
from tests.test_prepare import noise, put, run_prepare, solid


def write_shard(path: Path, members: dict[str, bytes]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w") as tf:
        for name, data in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tf.addfile(info, bytes_io.BytesIO(data))


def shards(raw: Path) -> dict[str, bytes]:
    """Two good members with captions, a hidden one and a broken one in one shard; a shard cut inside its second
    member; a .tar that is no tar; and a plain file beside them."""
    good = {
        "0001.png": noise((48, 40), seed=1),
        "0001.txt": b"a noisy square",
        "0002.jpg": noise((40, 48), fmt="JPEG", seed=2),
        "0002.txt": b"a noisy jpeg",
        ".0003.png": noise(seed=3),
        "0004.png": b"\x89PNG\r\n\x1a\nnot really",
    }
    write_shard(raw / "shards" / "000000.tar", good)
    write_shard(raw / "shards" / "000001.tar", {"0005.png": noise(seed=5), "0006.png": noise((96, 96), seed=6)})
    cut = raw / "shards" / "000001.tar"
    cut.write_bytes(cut.read_bytes()[: 512 + len(noise(seed=5)) + 700])
    put(raw, "shards/broken.tar", b"no tar at all" * 100)
    put(raw, "plain.png", solid("red"))
    return good


def test_shards_are_folders_of_members_with_bad_input_rejected_one_line_each(tmp_path):
    raw = tmp_path / "raw"
    good = shards(raw)
    rows, rejected, summary = run_prepare(raw, tmp_path / "out")
    by_path = {r["path"]: r for r in rows}
    assert sorted(by_path) == [
        "plain.png",
        "shards/000000.tar/0001.png",
        "shards/000000.tar/0002.jpg",
        "shards/000001.tar/0005.png",
    ]
    first = by_path["shards/000000.tar/0001.png"]
    assert first["id"] == hashlib.sha256(good["0001.png"]).hexdigest() and first["sidecar"] == "a noisy square"
    assert by_path["shards/000000.tar/0002.jpg"]["format"] == "JPEG"
    reasons = {r["path"]: r["reason"] for r in rejected}
    assert set(reasons) == {"shards/000000.tar/0004.png", "shards/000001.tar", "shards/broken.tar"}
    assert "cut short after 1 complete members" in reasons["shards/000001.tar"]
    assert "not a readable uncompressed tar" in reasons["shards/broken.tar"]
    assert all("\n" not in reason for reason in reasons.values())
    assert summary["accepted"] == 4

    again = run_prepare(raw, tmp_path / "again")  # every member's stat is its shard's: nothing is read again
    assert again[0] == rows and again[2]["decoded"] == 0 and again[2]["reused"] == 4


def test_members_are_encoded_and_trained_on_without_unpacking(tmp_path, tiny_model):
    raw = tmp_path / "raw"
    shards(raw)
    raw_cfg = small_config(tmp_path, raw, tiny_model, caption={"template": "a noisy picture"})  # "0005" has none
    index = cache_latents(tmp_path, raw_cfg)
    data = LatentData(index)
    assert sorted(item["path"] for item in data.items) == [
        "plain.png",
        "shards/000000.tar/0001.png",
        "shards/000000.tar/0002.jpg",
        "shards/000001.tar/0005.png",
    ]
    batch = data.batch(list(range(len(data.sample_items))), [False] * 4, [False] * 4)
    assert torch.isfinite(batch["latents"]).all()
    assert not any(p.suffix == ".png" for p in (raw / "shards").rglob("*")), "nothing was unpacked"
    assert config.from_dict(raw_cfg).data.raw_dir == str(raw)


def test_read_bytes_of_a_member_and_of_a_file(tmp_path):
    write_shard(tmp_path / "a.tar", {"x/y.txt": b"inside"})
    (tmp_path / "plain.txt").write_bytes(b"outside")
    assert sources.read_bytes(tmp_path / "a.tar" / "x" / "y.txt") == b"inside"
    assert sources.read_bytes(tmp_path / "plain.txt") == b"outside"
    try:
        sources.read_bytes(tmp_path / "a.tar" / "missing.png")
    except FileNotFoundError as exc:
        assert "no such member" in str(exc)
    else:
        raise AssertionError("a missing member must be an OSError")
    shutil.copy(tmp_path / "a.tar", tmp_path / "b.tar")
    assert sources.members(tmp_path / "b.tar") == sources.members(tmp_path / "a.tar")


def test_a_rerun_parses_no_unchanged_shard_and_reads_no_unchanged_sidecar(tmp_path, monkeypatch):
    """Issue 30: prepare keeps each shard's member index and each sidecar's text under their stat, so a rerun over
    10^3 shards neither walks their headers nor opens their captions; a rewritten shard is read again."""
    raw, out = tmp_path / "raw", tmp_path / "out"
    shards(raw)
    first, _, _ = run_prepare(raw, out)
    parsed, sidecars_read = [], []
    real_index, real_read = sources._tar_index, files.read_sidecar
    monkeypatch.setattr(sources, "_tar_index", lambda shard, size: parsed.append(shard.name) or real_index(shard, size))
    monkeypatch.setattr(memo, "read_sidecar", lambda path: sidecars_read.append(path.name) or real_read(path))
    monkeypatch.setattr(sources, "_INDEXES", {})  # a new process: only the memo in cache/ remembers
    assert run_prepare(raw, out)[0] == first
    assert parsed == ["broken.tar"] and sidecars_read == []  # no tar at all: tried again, once a run

    write_shard(raw / "shards" / "000000.tar", {"0001.png": noise((48, 40), seed=1), "0001.txt": b"a new caption"})
    monkeypatch.setattr(sources, "_INDEXES", {})
    rows = {r["path"]: r for r in run_prepare(raw, out)[0]}
    assert sorted(parsed) == ["000000.tar", "broken.tar", "broken.tar"] and sidecars_read == ["0001.txt"]
    assert rows["shards/000000.tar/0001.png"]["sidecar"] == "a new caption"
