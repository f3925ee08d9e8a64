"""latents.remote (issue 30): the latent cache's shards on a loopback S3 server (moto), published incrementally by
the latents stage and read by training on a node that lacks them, two processes, interrupted and resumed."""

from __future__ import annotations

import shutil

import pytest
import torch

from sdpipe import io
from sdpipe.train.data import LatentData
from tests.conftest import cache_latents, small_config
from tests.services import s3  # noqa: F401  (the loopback S3 fixture)
from tests.test_latents import make_inputs, run_stage
from tests.test_train import _drop_after, assert_same_weights, metrics, train, unet_weights

pytestmark = pytest.mark.slow
REMOTE = "s3://sdpipe/team/cache"


def _every_sample(index) -> list[dict]:
    data = LatentData(index)
    return [data.batch([i], [False], [False]) for i in range(len(data.sample_items))]


def _forget_local_shards(cache) -> None:
    """What another node has: the index (moved by Snakemake storage or DVC), and no cache folder."""
    for store in ("latents", "text"):
        shutil.rmtree(cache / store, ignore_errors=True)


def test_the_stage_publishes_only_new_shards_and_a_node_without_them_reads_the_same_samples(
    tmp_path,
    tiny_model,
    s3,  # noqa: F811
    monkeypatch,
):
    endpoint, client = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    raw, _, _ = make_inputs(tmp_path, 6)
    first = run_stage(tmp_path, raw, tiny_model, remote=REMOTE)
    assert first["remote"]["latent"]["uploaded"] >= 1 and first["remote"]["text"]["uploaded"] >= 1
    listed = {o["Key"] for o in client.list_objects_v2(Bucket="sdpipe", Prefix="team/cache/")["Contents"]}
    assert {"team/cache/latents/index.json", "team/cache/text/index.json"} <= listed
    again = run_stage(tmp_path, raw, tiny_model, remote=REMOTE)
    assert again["encoded"] == 0 and again["remote"]["latent"] == {"uploaded": 0, "present": 1}

    index = tmp_path / "out" / "index.json"
    assert io.read_json(index)["remote_stores"]["latent"] == f"{REMOTE}/latents"
    local = _every_sample(index)
    _forget_local_shards(tmp_path / "cache")
    fetched = _every_sample(index)
    assert len(fetched) == len(local) == 6
    for a, b in zip(local, fetched):
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert len(list((tmp_path / "cache" / "latents").glob("shard-*.safetensors"))) == 1  # fetched whole, once


def test_two_processes_train_from_the_store_resume_and_match_one_local_process(
    tmp_path,
    demo_source,
    tiny_model,
    s3,  # noqa: F811
    monkeypatch,
):
    """2 processes x batch 2 reading the shards from S3 on a node without them, killed after step 2 and resumed
    (its shards fetched again), train exactly as 1 process x batch 4 from the local cache: every sample of every
    global batch once, none dropped, none twice, and the resume continues at the sample."""
    endpoint, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    raw_cfg = small_config(tmp_path, demo_source, tiny_model, latents={"remote": REMOTE})
    cache = (cache_latents(tmp_path, raw_cfg), raw_cfg)
    train(tmp_path, cache, "local", num_processes=1, per_device_batch_size=4, max_steps=4)
    _forget_local_shards(tmp_path / "cache")
    train(tmp_path, cache, "remote", num_processes=2, per_device_batch_size=2, max_steps=4)
    assert list((tmp_path / "cache" / "latents").glob("shard-*.safetensors")), "training fetched the shards"
    _drop_after(tmp_path / "remote", 2)
    _forget_local_shards(tmp_path / "cache")
    proc = train(tmp_path, cache, "remote", num_processes=2, per_device_batch_size=2, max_steps=4)
    assert "resuming from" in proc.stderr
    remote, local = (io.read_json(tmp_path / name / "summary.json") for name in ("remote", "local"))
    assert remote["samples_seen"] == local["samples_seen"] and 0 < remote["samples_this_run"] < local["samples_seen"]
    losses = [float(r["loss"]) for r in metrics(tmp_path / "remote")]
    assert losses == pytest.approx([float(r["loss"]) for r in metrics(tmp_path / "local")], rel=1e-5)
    assert_same_weights(unet_weights(tmp_path / "remote"), unet_weights(tmp_path / "local"), 1e-5)
