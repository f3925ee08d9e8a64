"""Damaged cache entries are found and healed, never trained on (issue 26, item 6)."""

from __future__ import annotations

import os

import pytest
import torch

from sdpipe import io
from sdpipe.cache_store import DAMAGED, ShardStore, problem
from sdpipe.errors import UserError
from tests.test_latents import make_inputs, run_stage


def _flip_last_byte(path):
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))


def _truncate(path):
    path.write_bytes(path.read_bytes()[:-7])


def test_every_kind_of_damage_is_found(tmp_path):
    store = ShardStore(tmp_path)
    shards = [store.write_shard({f"k{i}": {"latent": torch.full((4, 8, 8), float(i))}}) for i in range(4)]
    assert all(problem(s) is None for s in shards)
    _flip_last_byte(shards[0])
    _truncate(shards[1])
    shards[2].write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00not json at all!")
    assert "checksum" in problem(shards[0]) and "truncated" in problem(shards[1])
    assert "unreadable" in problem(shards[2]) and problem(shards[3]) is None
    with pytest.raises(UserError, match=r"is damaged .*snakemake --forcerun latents"):
        store.load("k0", {"k0": shards[0].name})
    assert torch.equal(store.load("k3", {"k3": shards[3].name})["latent"], torch.full((4, 8, 8), 3.0))
    assert sorted(store.set_aside_damaged()) == sorted(s.name for s in shards[:3])
    assert store.shards() == [shards[3]] and len(list((tmp_path / DAMAGED).iterdir())) == 3


def test_the_latents_stage_re_encodes_damaged_shards_and_training_refuses_them(tmp_path, tiny_model):
    from sdpipe.train.data import LatentData

    raw, _, _ = make_inputs(tmp_path, 8)
    first = run_stage(tmp_path, raw, tiny_model)
    index = io.read_json(tmp_path / "out" / "index.json")
    latent_shards = ShardStore(index["latent_store"]).shards()
    _flip_last_byte(latent_shards[0])
    with pytest.raises(UserError, match="is damaged"):  # what training meets before the stage reruns
        _read_every_sample(LatentData(tmp_path / "out" / "index.json"))
    text_shards = ShardStore(index["text_store"]).shards()
    _truncate(text_shards[0])
    again = run_stage(tmp_path, raw, tiny_model, out="again")
    assert again["encoded"] == first["encoded"] == 8 and again["text_encoded"] == first["text_encoded"]
    assert all(
        torch.isfinite(b["latents"]).all() for b in _read_every_sample(LatentData(tmp_path / "again" / "index.json"))
    )


def _read_every_sample(data) -> list[dict]:
    return [data.batch([i], [False], [False]) for i in range(len(data.sample_items))]


def test_verified_shards_are_not_read_again_until_they_change(tmp_path, monkeypatch):
    """Issue 30: the latents stage verified every shard on every run, reading the whole cache for a rerun."""
    import sdpipe.cache_store as cache_store

    store = ShardStore(tmp_path)
    shards = [store.write_shard({f"k{i}": {"latent": torch.full((4, 8, 8), float(i))}}) for i in range(3)]
    assert store.set_aside_damaged() == []
    read = []
    real = cache_store.problem
    monkeypatch.setattr(cache_store, "problem", lambda shard: read.append(shard.name) or real(shard))
    assert store.set_aside_damaged() == [] and read == []
    _flip_last_byte(shards[1])  # rewritten: its mtime changes, so it is read again and found damaged
    st = shards[1].stat()
    os.utime(shards[1], ns=(st.st_atime_ns, st.st_mtime_ns + 10**9))  # past the clock's tick, as a later write is
    assert store.set_aside_damaged() == [shards[1].name] and read == [shards[1].name]


def test_the_store_lists_its_keys_from_its_index_until_its_shards_change(tmp_path, monkeypatch):
    """Issue 30: a rerun over 10^6 cached keys read every shard header (0.5 GB and seconds); the index answers while
    it names exactly the shards present, and a shard it does not know sends the store back to the headers."""
    from sdpipe import cache_store

    store = ShardStore(tmp_path / "store")
    store.write_shard({"a": {"x": torch.zeros(2)}, "b": {"x": torch.ones(2)}})
    where = store.compact()
    read = []
    real = cache_store._tensor_names
    monkeypatch.setattr(cache_store, "_tensor_names", lambda shard: read.append(shard.name) or real(shard))
    assert store.scan() == where == {"a": next(iter(where.values())), "b": next(iter(where.values()))}
    assert read == []
    newer = store.write_shard({"c": {"x": torch.ones(1)}})  # a worker's new shard, not yet in the index
    assert store.scan() == where | {"c": newer.name} and len(read) == 2
    (tmp_path / "store" / "index.json").write_text("{ half")  # a damaged index is no answer either
    assert store.scan() == where | {"c": newer.name}
