"""Two pipelines at once in one folder (issue 26): the second, started with another config while the first trains,
is refused by Snakemake's lock, and the first finishes with its own settings, its config and outputs untouched."""

from __future__ import annotations

import json
import subprocess
import time

import pytest
import yaml

from tests.workflow_helpers import FAST, make_project, run

pytestmark = pytest.mark.slow
STEPS = 150  # long enough that the first run is still training when the second has given up


def _wait_for(path, text: str, proc, timeout: float = 240) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline and proc.poll() is None:
        if path.is_file() and text in path.read_text(errors="replace"):
            return
        time.sleep(0.1)
    raise AssertionError(f"{text!r} never appeared in {path} (first run exit code {proc.poll()})")


def test_a_second_pipeline_started_while_the_first_trains_changes_nothing(tmp_path, demo_source):
    proj = make_project(
        tmp_path / "p",
        demo_source,
        prepare={"eval_fraction": 0.0, "workers": 1},
        model={"train_vae": {"enabled": False}},
        train={**FAST["train"], "max_steps": STEPS, "checkpoint_every": 1000},
    )
    run(["snakemake", "--cores", "2", "latents"], proj)
    (proj / "other.yaml").write_text(yaml.safe_dump({"train": {"learning_rate": 0.5, "max_steps": 2}}))
    first = subprocess.Popen(
        ["snakemake", "--cores", "1", "train"], cwd=proj, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    try:
        _wait_for(proj / "logs" / "train.log", "training: 1/", first)
        second = run(["snakemake", "--cores", "1", "--configfile", "other.yaml", "--", "train"], proj, check=False)
        assert first.poll() is None, "the first run ended before the second was refused: the test proves nothing"
        assert second.returncode != 0 and "locked" in second.stdout + second.stderr
        out, _ = first.communicate(timeout=600)
    finally:
        first.kill()
    assert first.returncode == 0, out[-3000:]
    summary = json.loads((proj / "results" / "train" / "summary.json").read_text())
    assert summary["optimizer_steps"] == STEPS
    for used in (proj / "results" / "config.resolved.yaml", proj / "results" / "train" / "config.yaml"):
        assert yaml.safe_load(used.read_text())["train"]["learning_rate"] != 0.5
    rows = (proj / "results" / "train" / "metrics.csv").read_text().splitlines()
    assert rows[0].startswith("step") and len(rows) > 1
