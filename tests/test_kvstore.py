"""The SQLite key-value cache behind prepare's and caption's per-image entries (issue 30)."""

from __future__ import annotations

import json
import sqlite3

import pytest

from sdpipe import captioners
from sdpipe.errors import disk_full
from sdpipe.kvstore import KVStore


def test_round_trip_in_chunks_and_replace(tmp_path):
    store = KVStore(tmp_path / "c.sqlite", ("a", "b"))
    store.put_many("a", [(f"k{i}", {"i": i}) for i in range(2500)])  # more keys than one query takes
    store.put("b", "k1", [1, 2])
    found = store.get_many("a", [f"k{i}" for i in range(0, 2600, 7)])
    assert found == {f"k{i}": {"i": i} for i in range(0, 2500, 7)}
    assert store.get("b", "k1") == [1, 2] and store.get("b", "k2") is None
    store.put("a", "k1", "new")
    assert store.get("a", "k1") == "new" and store.count("a") == 2500


def test_a_replaced_file_is_reopened(tmp_path):
    path = tmp_path / "c.sqlite"
    store = KVStore(path)
    store.put("entries", "k", 1)
    path.unlink()  # a user clears the cache between two uses in one process
    assert store.get("entries", "k") is None
    store.put("entries", "k", 2)
    assert KVStore(path).get("entries", "k") == 2


def test_a_damaged_file_is_set_aside_and_a_damaged_entry_is_a_miss(tmp_path, caplog):
    path = tmp_path / "c.sqlite"
    path.write_bytes(b"garbage, not SQLite" * 200)
    store = KVStore(path)
    assert store.get("entries", "k") is None and (tmp_path / "c.sqlite.damaged").is_file()
    store.put("entries", "k", {"x": 1})
    store._connect().execute("UPDATE entries SET value = '{\"x\": ' WHERE key = 'k'")
    assert store.get("entries", "k") is None
    assert any("set aside" in r.getMessage() for r in caplog.records)


def test_captions_of_the_old_folder_cache_are_imported(tmp_path):
    old = tmp_path / "captions" / "ab"
    old.mkdir(parents=True)
    (old / "abc.json").write_text(json.dumps({"key": "abc", "source": "blip", "caption": "a dog"}))
    (old / "abd.json").write_text("{ damaged")
    found = captioners.read_cache(tmp_path / "captions.sqlite", ["abc", "abd"])
    assert found == {"abc": {"key": "abc", "source": "blip", "caption": "a dog"}}


def test_a_full_disk_leaves_the_file_in_place_and_reads_as_a_full_disk(tmp_path, monkeypatch):
    """SQLite's full disk (or a lock held past the timeout) is an OperationalError: the cache is fine and stays;
    the CLI then says the disk is full in one line (sdpipe.errors.disk_full)."""
    store = KVStore(tmp_path / "c.sqlite")
    store.put("entries", "k", 1)

    def full(db):
        raise sqlite3.OperationalError("database or disk is full")

    with pytest.raises(sqlite3.OperationalError) as caught:
        store._guarded(full)
    assert disk_full(caught.value) and not (tmp_path / "c.sqlite.damaged").exists()
    assert store.get("entries", "k") == 1
