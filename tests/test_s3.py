"""A loopback S3 server (moto, started by the test) as the store a cluster run moves its data through: the DVC
remote of a push and pull round trip, and the default storage of a `snakemake --default-storage-provider s3` run
of the demo, the way profiles/kubernetes runs."""

from __future__ import annotations

import json
import os
import shutil
import sys
from pathlib import Path

import pytest

from tests.services import S3_KEYS as KEYS
from tests.services import s3  # noqa: F401  (the loopback S3 fixture)
from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow
DVC = str(Path(sys.executable).parent / "dvc")


def _keys(client, prefix: str) -> set[str]:
    pages = client.get_paginator("list_objects_v2").paginate(Bucket="sdpipe", Prefix=prefix)
    return {obj["Key"][len(prefix) :] for page in pages for obj in page.get("Contents", [])}


def test_snakemake_moves_the_demo_through_s3_default_storage(tmp_path, demo_source, s3):  # noqa: F811
    """Every rule's inputs come from the bucket and its outputs go there: a second machine with an empty project
    folder finds the pipeline done."""
    endpoint, client = s3
    settings = {
        "prepare": {"eval_fraction": 0.0, "workers": 1},
        "model": {"train_vae": {"enabled": False}},
        "latents": {"remote": "s3://sdpipe/proj-cache"},  # the latent cache's shards, for the second machine
    }
    env = {**os.environ, "AWS_ENDPOINT_URL": endpoint}
    proj = make_project(tmp_path / "proj", demo_source, **settings)
    for path in sorted((proj / "data" / "raw").rglob("*")):  # the data lives in the bucket, as on a cluster
        if path.is_file():
            client.upload_file(str(path), "sdpipe", f"proj/{path.relative_to(proj).as_posix()}")
    storage = [
        "--default-storage-provider",
        "s3",
        "--default-storage-prefix",
        "s3://sdpipe/proj",
        "--storage-s3-endpoint-url",
        endpoint,
        "--storage-s3-access-key",
        KEYS["AWS_ACCESS_KEY_ID"],
        "--storage-s3-secret-key",
        KEYS["AWS_SECRET_ACCESS_KEY"],
    ]
    run(["snakemake", "--cores", "2", *storage, "--", "latents"], proj, env=env)
    stored = _keys(client, "proj/")
    assert {
        "results/prepare/manifest.jsonl",
        "results/captions/captions.jsonl",
        "results/latents/index.json",
        "models/tiny/model_index.json",
        "logs/latents.log",
    } <= stored
    latents = json.loads(client.get_object(Bucket="sdpipe", Key="proj/results/latents/summary.json")["Body"].read())
    assert latents["encoded"] == 40  # prepare read the 40 images from the bucket's copy of data/raw

    elsewhere = make_project(tmp_path / "elsewhere", None, **settings)
    shutil.copytree(proj / "data" / "raw", elsewhere / "data" / "raw")  # the listing Snakemake globs
    again = run(["snakemake", "-n", "--cores", "1", *storage, "--", "latents"], elsewhere, env=env)
    assert "Nothing to be done" in again.stdout + again.stderr
    assert not (elsewhere / "results" / "latents").exists()

    # Issue 30: the second machine trains with no cache of its own: the index comes through Snakemake's storage,
    # the shards from latents.remote, fetched into its own cache_dir as its samples need them.
    run(["snakemake", "--cores", "2", *storage, "--", "train"], elsewhere, env=env)
    assert "results/train/summary.json" in _keys(client, "proj/")
    assert list((elsewhere / "cache" / "latents").glob("shard-*.safetensors"))
    assert not (elsewhere / "cache" / "prepare.sqlite").exists()  # it never ran a data stage
