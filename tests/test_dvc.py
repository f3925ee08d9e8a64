"""`dvc repro` in a fresh git repo: runs every stage (base model, VAE, data, training, export, evaluation, report),
gives the same metrics as a second run from scratch through Snakemake, does nothing the second time, reruns only
evaluation, the report and the model card when only an evaluation setting changes, and after one image changes
captions only that image (and retrains the VAE and the model on the new data)."""

from __future__ import annotations

import io as pyio
import json
import shutil
import sys
from pathlib import Path

import pytest
import yaml
from PIL import Image

from tests.services import s3  # noqa: F401  (the loopback S3 fixture)
from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow
DVC = str(Path(sys.executable).parent / "dvc")


def summary(project, stage):
    return json.loads((project / "results" / stage / "summary.json").read_text())


def test_dvc_repro_is_incremental(tmp_path, demo_source):
    proj = make_project(
        tmp_path / "repo",
        demo_source,
        with_code=True,
        prepare={"eval_fraction": 0.0, "workers": 1},
        train={"max_steps": 4, "per_device_batch_size": 4, "checkpoint_every": 2, "lr_warmup_steps": 0},
    )
    for cmd in (["git", "init", "-q"], [DVC, "init", "-q"], [DVC, "add", "-q", "data/raw"]):
        run(cmd, proj)
    run([DVC, "repro"], proj)
    assert summary(proj, "latents")["encoded"] == 40
    assert summary(proj, "train")["optimizer_steps"] == 4
    assert (proj / "dvc.lock").is_file() and (proj / "results/train/final/unet").is_dir()

    assert (proj / "results/report/index.html").is_file() and (proj / "results/evaluate/metrics.json").is_file()
    assert (proj / "results/card/README.md").read_text().startswith("---\nlicense: other\n")  # the model card too
    _same_metrics_from_a_second_run_from_scratch(proj, tmp_path / "again", demo_source)
    second = run([DVC, "repro"], proj)
    assert "Data and pipelines are up to date" in second.stdout
    assert summary(proj, "latents")["encoded"] == 40, "nothing ran, so the summary is the first run's"
    metrics = run([DVC, "metrics", "show", "--json"], proj)
    assert "colour_accuracy" in metrics.stdout
    run([DVC, "plots", "show", "-o", "plots"], proj)
    assert (proj / "plots" / "index.html").is_file()
    run([sys.executable, "-m", "snakemake", "--report", "snakemake-report.html"], proj)
    assert (proj / "snakemake-report.html").stat().st_size > 0

    cfg_path = proj / "config" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["evaluate"]["guidance"] += 1.0
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    rerun = run([DVC, "repro"], proj).stdout
    ran = {line.split("'")[1] for line in rerun.splitlines() if line.startswith("Running stage")}
    assert ran == {"evaluate", "report", "card"}, rerun

    victim = sorted((proj / "data" / "raw").rglob("*.png"))[5]
    buf = pyio.BytesIO()
    Image.new("RGB", (64, 64), (10, 200, 90)).save(buf, format="PNG")
    victim.write_bytes(buf.getvalue())
    run([DVC, "repro"], proj)
    cap, lat = summary(proj, "captions"), summary(proj, "latents")
    assert (cap["captioned"], cap["reused"]) == (1, 39)
    # The demo trains its VAE on the training images, so new data means a new VAE and new latents for all; with a
    # pretrained VAE only the changed image is encoded (tests/test_workflow.py).
    assert summary(proj, "vae")["images"] == 40 and lat["encoded"] == 40
    trained = summary(proj, "train")
    assert trained["samples_this_run"] == trained["samples_seen"] > 0, "new data trains afresh, not resumed"


def _same_metrics_from_a_second_run_from_scratch(first: Path, dest: Path, demo_source: Path) -> None:
    """The whole DAG again from nothing, through Snakemake this time, with the same config: every non-timing number
    in metrics.json is the same on a CPU (and `dvc repro` and `snakemake` run the same stages)."""
    again = make_project(dest, demo_source)
    shutil.copy2(first / "config" / "config.yaml", again / "config" / "config.yaml")
    run([sys.executable, "-m", "snakemake", "--cores", "2"], again)
    a, b = (json.loads((p / "results" / "evaluate" / "metrics.json").read_text()) for p in (first, again))
    strip = lambda m: {k: v for k, v in m.items() if k not in m["timings"] and k != "provenance"}
    assert strip(a) == strip(b) and a["colour_accuracy"]["value"] is not None
    assert a["provenance"]["seeds"] == b["provenance"]["seeds"]


@pytest.mark.parametrize("store", ["folder", "s3"])
def test_a_remote_carries_data_between_machines(tmp_path, demo_source, store, request):
    """What a remote does between a pod and a laptop: a local folder, and a real (loopback) S3 server."""
    a = make_project(tmp_path / "a", demo_source)
    remote = [[DVC, "remote", "add", "-d", "shared", str(tmp_path / "remote")]]
    if store == "s3":
        endpoint, _ = request.getfixturevalue("s3")
        remote = [
            [DVC, "remote", "add", "-d", "shared", "s3://sdpipe/dvc"],
            [DVC, "remote", "modify", "shared", "endpointurl", endpoint],
        ]
    git = ["git", "-c", "user.name=sdpipe", "-c", "user.email=sdpipe@example.invalid"]
    for cmd in (
        ["git", "init", "-q"],
        [DVC, "init", "-q"],
        [DVC, "add", "-q", "data/raw"],
        *remote,
        git + ["add", "-A"],
        git + ["commit", "-q", "-m", "data"],
        [DVC, "push", "-q"],
    ):
        run(cmd, a)
    b = tmp_path / "b"
    run(["git", "clone", "-q", str(a), str(b)], tmp_path)
    assert not (b / "data" / "raw").exists()
    run([DVC, "pull", "-q", "data/raw.dvc"], b)  # only the data: this repo has run no pipeline stage yet
    files = sorted(p.relative_to(a / "data" / "raw") for p in (a / "data" / "raw").rglob("*") if p.is_file())
    assert files and files == sorted(
        p.relative_to(b / "data" / "raw") for p in (b / "data" / "raw").rglob("*") if p.is_file()
    )
    assert all((a / "data" / "raw" / f).read_bytes() == (b / "data" / "raw" / f).read_bytes() for f in files)
    if store == "s3":  # the objects are in the bucket, so the pull came from the server
        _, client = request.getfixturevalue("s3")
        assert client.list_objects_v2(Bucket="sdpipe", Prefix="dvc/")["KeyCount"] >= len(files)
