"""The kill campaign (issue 26): kill -9 at seeded random moments of caching and of 1- and 2-process training,
each time rerunning to the end and comparing with an uninterrupted run. Prints trials, survived and lost."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

import pytest
import torch
import yaml

from sdpipe.cache_store import ShardStore
from tests.conftest import small_config
from tests.test_latents import make_inputs
from tests.test_train import TRAIN, assert_same_weights, cache, unet_weights  # noqa: F401 (cache: a fixture)

pytestmark = pytest.mark.slow
# A healthy rerun of these runs takes well under a minute here; the CI run at 55ee057 saw one hang for the whole
# 600 s it was then given.
RERUN_TIMEOUT_S = 240


def _killed_then_rerun(cmd: list[str], moment: float) -> tuple[bool, float]:
    """Start `cmd` in its own process group, kill -9 the group after `moment` seconds, rerun it to the end.
    Returns whether the kill landed before the run ended, and the rerun's wall seconds."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    try:
        proc.wait(timeout=moment)
        landed = False
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        landed = True
    start = time.monotonic()
    returncode, stderr = _rerun(cmd)
    # The first lines that name an error: in a multi-process run the one that failed first is not the last word.
    errors = [line for line in stderr.splitlines() if "rror" in line][:20]
    if returncode != 0:  # also as a warning: pytest's summary shows warnings even of an expected failure
        detail = errors[:8] or stderr[-800:].splitlines()
        warnings.warn(f"kill campaign rerun failed ({returncode}): " + " | ".join(detail), stacklevel=1)
    assert returncode == 0, "\n".join(errors) + "\n...\n" + stderr[-3000:]
    took = time.monotonic() - start
    _assert_no_process_left(cmd[cmd.index("--config") + 1])
    return landed, took


def _assert_no_process_left(marker: str, wait_s: float = 30.0) -> None:
    """No process of the killed run, or of its rerun, still runs: a rank left behind holds memory (a GPU on a pod)
    and the run folder's lock. Ranks read the config next to their run folder, so its path names them."""
    deadline = time.monotonic() + wait_s
    while (left := _processes_naming(marker)) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert not left, f"processes left running: {left}"


def _processes_naming(marker: str) -> list[str]:
    found = []
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode()
            state = (proc / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if (
            proc.name.isdigit()
            and int(proc.name) != os.getpid()
            and state != "Z"
            and marker.rsplit(".", 1)[0] in cmdline
        ):
            found.append(f"{proc.name}: {cmdline[:160]}")
    return found


def _rerun(cmd: list[str], timeout_s: float = RERUN_TIMEOUT_S) -> tuple[int | None, str]:
    """Run `cmd` in its own process group: (exit code, stderr). One that hangs is killed whole (launcher and ranks
    too, which would otherwise go on using the CI machine's cores) and reported with exit code None."""
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        _, stderr = proc.communicate()
        return None, f"hung: no exit after {timeout_s:.0f} s\n{stderr}"
    return proc.returncode, stderr


def _timed(cmd: list[str]) -> float:
    start = time.monotonic()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=600)
    return time.monotonic() - start


def _report(kind: str, outcomes: list[bool], landed: list[bool]) -> None:
    print(
        f"kill campaign, {kind}: {len(outcomes)} trials ({sum(landed)} killed mid-run), "
        f"{sum(outcomes)} survived, {len(outcomes) - sum(outcomes)} lost"
    )


def test_kills_during_caching(tmp_path, tiny_model):
    raw, manifest, captions = make_inputs(tmp_path, 40)

    def command(name: str) -> list[str]:
        cfg = small_config(tmp_path / name, raw, tiny_model, latents={"batch_size": 1})
        (tmp_path / name).mkdir(exist_ok=True)
        (tmp_path / name / "c.yaml").write_text(yaml.safe_dump(cfg))
        return [
            sys.executable,
            "-m",
            "sdpipe",
            "latents",
            "--config",
            str(tmp_path / name / "c.yaml"),
            "--manifest",
            str(manifest),
            "--captions",
            str(captions),
            "--index",
            str(tmp_path / name / "i.json"),
            "--summary",
            str(tmp_path / name / "s.json"),
        ]

    wall = _timed(command("reference"))
    reference = _latents(tmp_path / "reference")
    rng, outcomes, landed = random.Random(26), [], []
    for trial in range(3):
        hit, _ = _killed_then_rerun(command(f"t{trial}"), rng.uniform(0.2, 0.9) * wall)
        landed.append(hit)
        got = _latents(tmp_path / f"t{trial}")
        outcomes.append(got.keys() == reference.keys() and all(torch.equal(got[k], reference[k]) for k in got))
    _report("caching", outcomes, landed)
    assert all(outcomes) and any(landed)


def _latents(project) -> dict:
    store = ShardStore(project / "cache" / "latents")
    return {k: store.load(k)["latent"] for k in store.scan()}


# In CI a rerun right after a kill -9 of a 2-process run once failed in gloo's connectFullMesh ("Connection
# refused") and once hung, while every local trial passed. The runs then shared one rendezvous port, so a rank of
# the killed run still starting up could join the rerun's rendezvous; each run on one machine now takes a free port.
@pytest.mark.parametrize("processes, trials", [(1, 2), (2, 2)])
def test_kills_during_training(tmp_path, cache, processes, trials):  # noqa: F811 (the fixture imported above)
    index, raw_cfg = cache
    settings = {
        **TRAIN,
        "max_steps": 8,
        "checkpoint_every": 2,
        "num_processes": processes,
        "per_device_batch_size": 4 // processes,
    }

    def command(name: str) -> list[str]:
        (tmp_path / f"{name}.yaml").write_text(yaml.safe_dump({**raw_cfg, "train": settings}))
        out = tmp_path / name
        return [
            sys.executable,
            "-m",
            "sdpipe",
            "train",
            "--config",
            str(tmp_path / f"{name}.yaml"),
            "--index",
            str(index),
            "--out",
            str(out),
            "--summary",
            str(out / "summary.json"),
        ]

    wall = _timed(command("reference"))
    reference = unet_weights(tmp_path / "reference")
    rng, outcomes, landed = random.Random(26 + processes), [], []
    for trial in range(trials):
        hit, _ = _killed_then_rerun(command(f"t{trial}"), rng.uniform(0.3, 0.95) * wall)
        landed.append(hit)
        try:
            assert_same_weights(unet_weights(tmp_path / f"t{trial}"), reference, 1e-5)
            outcomes.append(True)
        except AssertionError:
            outcomes.append(False)
    _report(f"{processes}-process training", outcomes, landed)
    assert all(outcomes) and any(landed)
