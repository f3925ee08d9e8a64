"""`sdpipe bench-dag` on the CPU: the whole DAG through `snakemake --profile runpod` in a seeded project, and the
per-stage wall times, steady rates and the warm start it reports (the GPU numbers come from the same code).

The tiny job's images are a webdataset tar shard in a bucket on a loopback S3 server, which prepare mirrors
(data.raw_remote); its latent cache is published to the same server and trained from there with no local cache:
issue 30's data path, through Snakemake end to end."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from sdpipe.bench import dag_report, peer
from tests.conftest import REPO
from tests.services import s3  # noqa: F401  (the loopback S3 fixture)


@pytest.mark.slow
def test_the_tiny_job_runs_every_stage_from_shards_in_s3_and_trains_from_s3(tmp_path, s3, monkeypatch):  # noqa: F811
    endpoint, client = s3
    monkeypatch.setenv("AWS_ENDPOINT_URL", endpoint)
    out = tmp_path / "results"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "bench-dag",
            "--job",
            "tiny",
            "--steps",
            "6",
            "--work",
            str(tmp_path / "work"),
            "--out",
            str(out),
            "--source",
            str(REPO),
            "--name",
            "dag-test",
            "--layout",
            "tar",
            "--latents-remote",
            "s3://sdpipe/latents",
            "--raw-remote",
            "s3://sdpipe/raw",
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads((out / "dag-test.json").read_text())["jobs"]["tiny"]
    assert set(res["stages_s"]) == set(dag_report.STAGES)  # every stage ran
    assert sum(res["stages_s"].values()) + res["snakemake_overhead_s"] == pytest.approx(res["dag_s"], abs=1e-2)
    assert 0 < res["non_training_share"] < 1
    t = res["train"]
    assert t["optimizer_steps"] == 6 and t["compile"] == "eager" and t["samples_per_s"] > 0
    assert 0 < t["time_to_first_step_s"] < res["stages_s"]["train"]
    assert res["warm_start"]["time_to_first_step_s"] > 0
    assert all(f["verified"] for k, f in res["export"].items() if isinstance(f, dict))
    assert res["evaluate"]["images"] == 4 and res["evaluate"]["fid"]["value"] is None  # no weights here: null
    table = (out / "dag-test.md").read_text()
    rows = [line.split("|")[1].strip() for line in table.splitlines() if line.startswith("| ")][
        1 : len(dag_report.STAGES) + 1
    ]
    assert rows == list(dag_report.STAGES), rows  # in the DAG's order
    assert "| **whole DAG** |" in table
    project = tmp_path / "work" / "tiny" / "project"
    assert not (project / "sdpipe").exists() and (project / "models" / "tiny" / "model_index.json").is_file()
    raw = project / "data" / "raw"
    assert sorted(p.name for p in raw.iterdir()) == ["000000.tar"]  # 48 images, one shard, mirrored from S3
    assert res["prepare"]["accepted"] == 48 and res["prepare"]["raw_remote"]["downloaded"] == 1
    remote = res["from_remote"]
    assert remote["samples_per_s"] > 0 and remote["fetched_a_subset_of_local"] and remote["fetched_files"] >= 4
    published = {o["Key"] for o in client.list_objects_v2(Bucket="sdpipe")["Contents"]}
    assert {"latents/latents/index.json", "latents/text/index.json", "raw/000000.tar"} <= published
    assert "latents.remote" in table


def test_the_peer_scripts_progress_bar_gives_start_up_and_steady_rate():
    # (step, seconds since start): 20 s before step 1, then 0.5 s a step, the final save 12 s.
    stamps = [(0, 5.0)] + [(s, 20.0 + 0.5 * (s - 1)) for s in range(1, 101)]
    t = peer.timings(wall=stamps[-1][1] + 12.0, stamps=stamps, batch=32, steps=100, projected_steps=1000)
    assert t["startup_s"] == 20.0 and t["samples_per_s"] == pytest.approx(64.0) and t["tail_s"] == 12.0
    assert t["projected"] and t["projected_s"] == pytest.approx(20.0 + 999 * 0.5 + 12.0)
    assert peer.BAR.findall(b"\rSteps:  45%|####5     | 450/1000 [02:10<02:39,  3.45it/s, lr=1e-05]") == [
        (b"450", b"1000")
    ]
