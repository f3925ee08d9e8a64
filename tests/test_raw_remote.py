"""data.raw_remote (issue 30): the raw images under an S3 prefix on a loopback server (moto), mirrored into raw_dir
by prepare with only what changed downloaded, read with prepare's usual bad-input handling, and the prefix's
listing deciding in Snakemake whether prepare runs again."""

from __future__ import annotations

import sys

import pytest

from sdpipe import config, io, raw_remote
from sdpipe.errors import UserError
from sdpipe.stages import prepare
from tests.services import s3  # noqa: F401  (the loopback S3 fixture)
from tests.test_prepare import noise, outputs_in, solid
from tests.test_tar_shards import write_shard
from tests.workflow_helpers import make_project, run

URL = "s3://sdpipe/datasets/style"


def _upload(client, objects: dict[str, bytes]) -> None:
    for rel, data in objects.items():
        client.put_object(Bucket="sdpipe", Key=f"datasets/style/{rel}", Body=data)


def _prepare(tmp_path) -> tuple[dict[str, dict], list[dict], dict]:
    cfg = config.from_dict(
        {
            "data": {"raw_dir": str(tmp_path / "raw"), "raw_remote": URL},
            "prepare": {"min_size": 32, "workers": 1, "buckets": {"resolution": 32, "step": 8}},
            "cache_dir": str(tmp_path / "cache"),
        }
    )
    outputs = outputs_in(tmp_path / "out")
    prepare.run(cfg, {}, outputs)
    rows = {r["path"]: r for r in io.read_jsonl(outputs["manifest"])}
    return rows, io.read_jsonl(outputs["rejected"]), io.read_json(outputs["summary"])


@pytest.fixture
def bucket(s3, monkeypatch, tmp_path):  # noqa: F811
    endpoint, client = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    shard = tmp_path / "000000.tar"
    write_shard(shard, {"0001.png": noise((48, 40), seed=1), "0001.txt": b"a noisy square"})
    _upload(
        client,
        {
            "a.png": solid("red"),
            "a.txt": b"a red square",
            "sub/b.jpg": noise(fmt="JPEG", seed=2),
            "bad.png": b"\x89PNG\r\n\x1a\nnot really",
            "shards/000000.tar": shard.read_bytes(),
            ".hidden.png": solid("black"),
            "sub/": b"",  # a folder marker, as consoles make them
        },
    )
    return client


def test_prepare_mirrors_the_prefix_and_downloads_only_what_changed(tmp_path, bucket):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "mine.png").write_bytes(solid("blue"))  # the user's own file: the mirror never removes it
    rows, rejected, summary = _prepare(tmp_path)
    assert set(rows) == {"a.png", "sub/b.jpg", "shards/000000.tar/0001.png", "mine.png"}
    assert rows["a.png"]["sidecar"] == "a red square"
    assert rows["shards/000000.tar/0001.png"]["sidecar"] == "a noisy square"
    assert [r["path"] for r in rejected] == ["bad.png"] and "decode" in rejected[0]["reason"]
    assert summary["raw_remote"] == {"url": URL, "objects": 5, "downloaded": 5, "removed": 0}
    listed = raw_remote.fingerprint(URL)

    assert _prepare(tmp_path)[2]["raw_remote"]["downloaded"] == 0  # nothing changed: nothing fetched
    assert raw_remote.fingerprint(URL) == listed

    _upload(bucket, {"a.txt": b"a new caption", "c.png": solid("green")})
    bucket.delete_object(Bucket="sdpipe", Key="datasets/style/sub/b.jpg")
    rows, _, summary = _prepare(tmp_path)
    assert summary["raw_remote"] == {"url": URL, "objects": 5, "downloaded": 2, "removed": 1}
    assert rows["a.png"]["sidecar"] == "a new caption" and "c.png" in rows and "sub/b.jpg" not in rows
    assert "mine.png" in rows and raw_remote.fingerprint(URL) != listed


def test_a_prefix_that_cannot_be_listed_is_one_line(s3, monkeypatch):  # noqa: F811
    endpoint, _ = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    with pytest.raises(UserError, match=r"data.raw_remote: cannot list s3://no-such-bucket/x: .*NoSuchBucket"):
        raw_remote.listing("s3://no-such-bucket/x")


@pytest.mark.slow
def test_snakemake_reruns_prepare_when_the_prefix_changes(tmp_path, bucket, demo_source):
    project = make_project(tmp_path / "project", None, data={"raw_dir": "data/raw", "raw_remote": URL})
    snake = [sys.executable, "-m", "snakemake", "--cores", "1"]
    run([*snake, "prepare"], project)
    assert (project / "data" / "raw" / "a.png").is_file()
    assert "Nothing to be done" in run([*snake, "-n", "prepare"], project).stdout
    _upload(bucket, {"a.txt": b"another caption"})
    assert "prepare" in run([*snake, "-n", "prepare"], project).stdout.split("Job stats:")[-1]
