"""A full disk, for real: the project's cache on a 1 MB tmpfs. The pipeline stops with one line that says the disk
is full (no traceback), and once space is freed the rerun finishes with every image, nothing half-written reused."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from tests.services import unavailable
from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow


@pytest.fixture
def small_disk(tmp_path):
    mount = tmp_path / "disk"
    mount.mkdir()
    if os.geteuid() != 0:
        unavailable("mounting a tmpfs needs root")
    proc = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(mount)], capture_output=True, text=True
    )
    if proc.returncode:
        unavailable(f"cannot mount a tmpfs here: {proc.stderr.strip()}")
    try:
        yield mount
    finally:
        subprocess.run(["umount", "-l", str(mount)], check=False)


def test_a_full_disk_stops_with_one_line_and_the_rerun_finishes(tmp_path, demo_source, small_disk):
    proj = make_project(
        tmp_path / "proj",
        demo_source,
        cache_dir=str(small_disk / "cache"),
        prepare={"eval_fraction": 0.0, "workers": 1},
        model={"train_vae": {"enabled": False}},
    )
    full = run(["snakemake", "--cores", "1", "latents"], proj, check=False)
    assert full.returncode != 0
    errors = [
        line for log in (proj / "logs").glob("*.log") for line in log.read_text().splitlines() if ": error: " in line
    ]
    assert len(errors) == 1 and "the disk is full" in errors[0], errors
    assert not any("Traceback" in log.read_text() for log in (proj / "logs").glob("*.log"))

    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)  # space is freed
    run(["snakemake", "--cores", "1", "latents"], proj)
    latents = json.loads((proj / "results" / "latents" / "summary.json").read_text())
    assert latents["encoded"] + latents["reused"] == 40 and latents["failed"] == 0
    check = "from sdpipe.train.data import LatentData; print(len(LatentData('results/latents/index.json').items))"
    assert run([sys.executable, "-c", check], proj).stdout.strip() == "40"  # training can read the cache
