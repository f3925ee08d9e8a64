"""Training through `sdpipe train` (the command the Snakemake rule runs, which starts `accelerate launch`):
2 processes x batch b equal 1 process x batch 2b, resume is exact, world-size changes continue, bad input fails
before launch."""

from __future__ import annotations

import contextlib
import copy
import csv
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file

from sdpipe import config, io, records
from sdpipe.stages import caption, latents, prepare
from tests.conftest import REPO, cache_latents, small_config

pytestmark = pytest.mark.slow
TRAIN = {
    "mode": "full",
    "max_steps": 3,
    "per_device_batch_size": 4,
    "learning_rate": 0.001,
    "lr_scheduler": "cosine",
    "lr_warmup_steps": 1,
    "checkpoint_every": 2,
    "log_every": 1,
    "caption_dropout": 0.2,
}


@pytest.fixture(scope="module")
def cache(tmp_path_factory, demo_source, tiny_model) -> tuple[Path, dict]:
    """The latent cache of 40 demo images, made by the real stages."""
    tmp = tmp_path_factory.mktemp("train")
    raw_cfg = small_config(tmp, demo_source, tiny_model)
    return cache_latents(tmp, raw_cfg), raw_cfg


def train(tmp: Path, cache, out: str, check: bool = True, **settings) -> subprocess.CompletedProcess:
    index, raw_cfg = cache
    cfg = {**raw_cfg, "train": {**TRAIN, **settings}}
    cfg_path = tmp / f"{out}.yaml"
    cfg_path.write_text(yaml.safe_dump(cfg))
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "train",
            "--config",
            str(cfg_path),
            "--index",
            str(index),
            "--out",
            str(tmp / out),
            "--summary",
            str(tmp / out / "summary.json"),
        ],
        capture_output=True,
        text=True,
    )
    if check and proc.returncode != 0:
        raise AssertionError(f"train failed ({proc.returncode}):\n{proc.stderr[-6000:]}")
    return proc


def unet_weights(out: Path) -> dict[str, torch.Tensor]:
    return load_file(str(next((out / "final" / "unet").glob("*.safetensors"))))


def metrics(out: Path) -> list[dict]:
    with open(out / "metrics.csv") as f:
        return list(csv.DictReader(f))


def assert_same_weights(a: dict, b: dict, tol: float) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=tol, atol=tol, msg=name)


def test_two_processes_equal_one_with_twice_the_batch(tmp_path, cache):
    train(tmp_path, cache, "two", num_processes=2, per_device_batch_size=2)
    train(tmp_path, cache, "one", num_processes=1, per_device_batch_size=4)
    two, one = io.read_json(tmp_path / "two" / "summary.json"), io.read_json(tmp_path / "one" / "summary.json")
    assert (two["world_size"], one["world_size"]) == (2, 1)
    for key in ("optimizer_steps", "global_batch_size", "lr_schedule_steps", "samples_seen", "epochs"):
        assert two[key] == one[key], key
    assert [r["lr"] for r in metrics(tmp_path / "two")] == [r["lr"] for r in metrics(tmp_path / "one")]
    base = load_file(str(next((Path(cache[1]["model"]["pretrained"]) / "unet").glob("*.safetensors"))))
    trained_one = unet_weights(tmp_path / "one")
    assert any(not torch.equal(base[k], trained_one[k]) for k in base), "training changed nothing"
    assert_same_weights(unet_weights(tmp_path / "two"), trained_one, 1e-5)
    # Only rank 0 writes: one header and one row per step, no leftover temporary checkpoint folders.
    assert [int(r["step"]) for r in metrics(tmp_path / "two")] == [1, 2, 3]
    assert not list((tmp_path / "two" / "checkpoints").rglob(".tmp-*"))


def _drop_after(out: Path, step: int) -> None:
    """Leave what a run killed right after checkpoint `step` leaves behind."""
    for ckpt in (out / "checkpoints").glob("*/checkpoint-*"):
        if int(ckpt.name.split("-")[1]) > step:
            shutil.rmtree(ckpt)
    shutil.rmtree(out / "final")
    (out / "summary.json").unlink()


def test_interrupted_and_resumed_equals_uninterrupted(tmp_path, cache):
    train(tmp_path, cache, "straight", max_steps=4)
    train(tmp_path, cache, "resumed", max_steps=4)
    _drop_after(tmp_path / "resumed", 2)
    proc = train(tmp_path, cache, "resumed", max_steps=4)
    assert "resuming from" in proc.stderr
    resumed, straight = (io.read_json(tmp_path / name / "summary.json") for name in ("resumed", "straight"))
    assert resumed["optimizer_steps"] == straight["optimizer_steps"] == 4
    assert resumed["samples_seen"] == straight["samples_seen"]
    assert 0 < resumed["samples_this_run"] < straight["samples_this_run"], "the resumed run did only the rest"
    assert_same_weights(unet_weights(tmp_path / "resumed"), unet_weights(tmp_path / "straight"), 1e-6)
    # metrics.csv comes back from the checkpoint: no step is logged twice, none is missing.
    assert [int(r["step"]) for r in metrics(tmp_path / "resumed")] == [1, 2, 3, 4]
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == [r["loss"] for r in metrics(tmp_path / "straight")]


def test_a_schedule_free_run_resumes_exactly(tmp_path, cache):
    """Its checkpoints hold the averaged weights (eval mode) and the run trains on from its iterate after a resume:
    the swaps at checkpoints and at the final save change nothing against an uninterrupted run."""
    sf = {"optimizer": "adamw_schedulefree", "lr_scheduler": "constant", "max_steps": 4}
    train(tmp_path, cache, "straight", **sf)
    train(tmp_path, cache, "resumed", **sf)
    _drop_after(tmp_path / "resumed", 2)
    assert "resuming from" in train(tmp_path, cache, "resumed", **sf).stderr
    assert_same_weights(unet_weights(tmp_path / "resumed"), unet_weights(tmp_path / "straight"), 1e-6)
    assert [r["loss"] for r in metrics(tmp_path / "resumed")] == [r["loss"] for r in metrics(tmp_path / "straight")]


def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(tmp_path, cache):
    """Issue 26, item 6: resume crashed on a damaged newest checkpoint instead of using the older one."""
    train(tmp_path, cache, "straight", max_steps=4)
    train(tmp_path, cache, "resumed", max_steps=4)
    _drop_after(tmp_path / "resumed", 4)
    newest = sorted((tmp_path / "resumed" / "checkpoints").glob("*/checkpoint-*"))[-1]
    weights = next(newest.rglob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 0xFF  # one flipped bit in the weights: it still loads, so only the checksum can tell
    weights.write_bytes(bytes(data))
    named = train(tmp_path, cache, "named", check=False, max_steps=4, resume=str(newest))
    assert named.returncode == 2
    assert f"checkpoint {newest} cannot be used: {weights.relative_to(newest)} is damaged (checksum)" in named.stderr
    assert "Traceback" not in named.stderr
    proc = train(tmp_path, cache, "resumed", max_steps=4)
    assert f"checkpoint {newest} cannot be used ({weights.relative_to(newest)} is damaged (checksum))" in proc.stderr
    assert "checkpoint-00000002 at optimizer step 2" in proc.stderr
    assert_same_weights(unet_weights(tmp_path / "resumed"), unet_weights(tmp_path / "straight"), 1e-6)
    assert [int(r["step"]) for r in metrics(tmp_path / "resumed")] == [1, 2, 3, 4]


def test_a_bf16_lora_run_checkpoints_its_adapters_alone_and_resumes_exactly(tmp_path, cache):
    """A LoRA run keeps its frozen base in the mixed-precision dtype and checkpoints only what trains (a FLUX.1
    LoRA's checkpoints would otherwise copy the 12-billion-parameter transformer); resuming from one still gives
    the uninterrupted run's adapters, and validation renders through the bf16 base."""
    lora = dict(mode="lora", max_steps=4, mixed_precision="bf16", lora={"rank": 4, "alpha": 4})
    train(tmp_path, cache, "straight", **lora, validation={"every": 2, "steps": 2, "prompts": ["a red circle"]})
    train(tmp_path, cache, "resumed", **lora)
    saved = [load_file(str(f)) for f in (tmp_path / "resumed" / "checkpoints").rglob("model.safetensors")]
    assert len(saved) == 2 and all(s and all("lora_" in k for k in s) for s in saved), "adapters only"
    assert all(t.dtype == torch.float32 for s in saved for t in s.values())  # the adapters train in fp32
    _drop_after(tmp_path / "resumed", 2)
    proc = train(tmp_path, cache, "resumed", **lora)
    assert "resuming from" in proc.stderr
    final = "final/pytorch_lora_weights.safetensors"
    resumed, straight = (load_file(str(tmp_path / run / final)) for run in ("resumed", "straight"))
    assert_same_weights(resumed, straight, 1e-6)
    assert list((tmp_path / "straight" / "samples").glob("step-*.png")), "validation rendered"


def test_a_lora_base_is_frozen_in_the_mixed_precision_dtype(cache):
    from sdpipe.train.models import build_unet

    raw = {**cache[1], "train": {**TRAIN, "mode": "lora", "mixed_precision": "bf16"}}
    dtypes = {(p.requires_grad, p.dtype) for p in build_unet(config.from_dict(raw), "cpu").parameters()}
    assert dtypes == {(False, torch.bfloat16), (True, torch.float32)}


def test_a_checkpoint_lacking_a_trained_weight_is_refused(tmp_path):
    from safetensors.torch import save_file

    from sdpipe.train.checkpoint import trained_weights_missing

    model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.Linear(2, 2))
    model[0].requires_grad_(False)
    save_file({"1.weight": model[1].weight.detach().clone()}, str(tmp_path / "model.safetensors"))
    assert trained_weights_missing(tmp_path, [model]) == "model.safetensors lacks the trained weight 1.bias"
    trained = {k: v for k, v in model.state_dict().items() if k.startswith("1.")}
    save_file({k: v + 1 for k, v in trained.items()}, str(tmp_path / "model.safetensors"))
    assert trained_weights_missing(tmp_path, [model]) == "the trained weight 1.weight did not load"
    save_file(trained, str(tmp_path / "model.safetensors"))
    assert trained_weights_missing(tmp_path, [model]) is None


@pytest.mark.skipif(sys.version_info < (3, 11), reason="PYTHONSAFEPATH is Python 3.11's")
def test_a_sdpipe_folder_in_the_project_does_not_shadow_the_installed_package(tmp_path, cache):
    """Issue 26, item 7: `python -m sdpipe.train.loop` imported ./sdpipe instead of the installed package."""
    decoy = tmp_path / "project" / "sdpipe"
    decoy.mkdir(parents=True)
    (decoy / "__init__.py").write_text(f"open({str(tmp_path / 'decoy-ran')!r}, 'w').close()\nraise SystemExit(3)\n")
    index, raw_cfg = cache
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump({**raw_cfg, "train": {**TRAIN, "max_steps": 1}}))
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            shutil.which("sdpipe") or "sdpipe",
            "train",
            "--config",
            str(tmp_path / "cfg.yaml"),
            "--index",
            str(index),
            "--out",
            str(out),
            "--summary",
            str(out / "summary.json"),
        ],
        cwd=decoy.parent,
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert not (tmp_path / "decoy-ran").exists()


def test_resume_on_another_world_size_continues_the_sample_count(tmp_path, cache):
    train(tmp_path, cache, "run", max_steps=4, num_processes=2, per_device_batch_size=2)
    _drop_after(tmp_path / "run", 2)
    train(tmp_path, cache, "run", max_steps=4, num_processes=1, per_device_batch_size=2)
    summary = io.read_json(tmp_path / "run" / "summary.json")
    assert summary["world_size"] == 1 and summary["optimizer_steps"] == 4
    assert summary["cuda_alloc_retries"] is None  # a CPU run has no CUDA allocator to report on
    assert set(summary) == set(records.TrainSummary.__annotations__)  # what sdpipe/records.py says it holds
    # Two steps of 2 ranks x 2 before the switch (8 samples), then two steps of up to 1 x 2 from what is left.
    assert summary["samples_seen"] - summary["samples_this_run"] == 8 and 0 < summary["samples_this_run"] <= 4


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"per_device_batch_size": 64}, "train.per_device_batch_size"),
        ({"mode": "lora", "lora": {"target_modules": ["no_such_layer"]}}, "train.lora.target_modules"),
        ({"mode": "dreambooth"}, "train.mode = 'dreambooth' is not allowed"),
        ({"max_steps": 0}, "train.max_steps = 0"),
    ],
)
def test_bad_settings_fail_before_launch(tmp_path, cache, settings, message):
    proc = train(tmp_path, cache, "bad", check=False, **settings)
    assert proc.returncode == 2 and message in proc.stderr
    assert "Traceback" not in proc.stderr and "launching" not in proc.stderr
    assert not (tmp_path / "bad" / "checkpoints").exists()


def test_checkpoint_of_another_model_is_refused(tmp_path, cache):
    train(tmp_path, cache, "full", max_steps=2)
    ckpt = next((tmp_path / "full" / "checkpoints").glob("*/checkpoint-*"))
    proc = train(tmp_path, cache, "lora", check=False, mode="lora", resume=str(ckpt))
    assert proc.returncode == 2 and "trained from another model or mode" in proc.stderr


def test_missing_latent_cache_is_one_line(tmp_path, cache):
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "train",
            "--index",
            str(tmp_path / "none.json"),
            "--out",
            str(tmp_path / "o"),
            "--summary",
            str(tmp_path / "o" / "s.json"),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 2 and "run `snakemake latents` first" in proc.stderr and "Traceback" not in proc.stderr


def test_ema_tracker_and_validation_outputs(tmp_path, cache):
    project_dvc = (REPO / "dvc.yaml").read_text()
    train(
        tmp_path,
        cache,
        "ema",
        max_steps=2,
        ema={"enabled": True, "decay": 0.5},
        tracker="dvclive",
        validation={"every": 1, "prompts": ["a red circle", "a blue star"], "seeds": [0, 1, 2], "steps": 1},
    )
    out = tmp_path / "ema"
    from PIL import Image

    grids = sorted((out / "samples").glob("step-*.png"))
    assert [g.name for g in grids] == ["step-00000001.png", "step-00000002.png"]
    assert Image.open(grids[-1]).size == (3 * 32, 2 * 32)  # columns = seeds, rows = prompts
    raw, averaged = unet_weights(out), load_file(str(next((out / "final" / "ema" / "unet").glob("*.safetensors"))))
    assert raw.keys() == averaged.keys() and any(not torch.equal(raw[k], averaged[k]) for k in raw)
    assert (out / "dvclive").is_dir() and list((out / "dvclive").rglob("loss*"))
    assert (REPO / "dvc.yaml").read_text() == project_dvc  # DVCLive must not add its plots to the project's file


def wandb_records(path: Path):
    """The records of wandb's offline transaction log (run-*.wandb): a 7-byte header (":W&B", magic, version), then
    LevelDB-log records in 32 KiB blocks (crc 4 bytes, length 2, type 1: 1 full, 2 first, 3 middle, 4 last), each
    a wandb_internal_pb2.Record. wandb ships no reader of its own any more (its core is in Go)."""
    import struct

    from wandb.proto import wandb_internal_pb2 as pb

    data, block, parts = path.read_bytes(), 32768, b""
    assert data[:4] == b":W&B"
    pos = 7
    while pos + 7 <= len(data):
        left = block - pos % block
        _, length, kind = struct.unpack("<IHB", data[pos : pos + 7]) if left >= 7 else (0, 0, 0)
        if kind == 0:  # a block's zero-filled tail
            pos += left
            continue
        chunk, pos = data[pos + 7 : pos + 7 + length], pos + 7 + length
        parts = chunk if kind in (1, 2) else parts + chunk
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(parts)
            yield record


def test_wandb_tracker_runs_offline_without_a_login_and_records_the_metrics(tmp_path, cache, monkeypatch):
    pytest.importorskip("wandb")
    monkeypatch.delenv("WANDB_API_KEY", raising=False)
    monkeypatch.delenv("WANDB_MODE", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.netrc: no wandb login on this machine
    monkeypatch.setenv("NETRC", str(tmp_path / "no-netrc"))
    proc = train(tmp_path, cache, "wb", max_steps=3, tracker="wandb", tracker_project="sdpipe-test")
    assert "WANDB_MODE=offline" in proc.stderr
    runs = list((tmp_path / "wb" / "wandb").glob("offline-run-*/run-*.wandb"))
    assert len(runs) == 1, runs
    import json

    history, config_keys, project = {}, {}, None
    for record in wandb_records(runs[0]):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            project = record.run.project
            config_keys |= {i.key: json.loads(i.value_json) for i in record.run.config.update}
        elif kind == "config":
            config_keys |= {i.key: json.loads(i.value_json) for i in record.config.update}
        elif kind == "history":
            row = {i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in record.history.item}
            history[row["_step"]] = row
    assert project == "sdpipe-test"
    assert config_keys["train.learning_rate"] == TRAIN["learning_rate"] and config_keys["train.tracker"] == "wandb"
    rows = metrics(tmp_path / "wb")
    assert [int(r["step"]) for r in rows] == [1, 2, 3]
    for r in rows:  # the numbers metrics.csv has, at the same optimizer steps
        assert history[int(r["step"])]["loss"] == pytest.approx(float(r["loss"]), rel=1e-6)
        assert history[int(r["step"])]["lr"] == pytest.approx(float(r["lr"]), rel=1e-6)


def test_nan_loss_stops_training_naming_the_step(tmp_path, cache):
    """A corrupt cache entry (NaN latents) must stop training with one line, not train on garbage."""
    index_path, raw_cfg = cache
    poisoned = tmp_path / "poisoned"
    shutil.copytree(Path(raw_cfg["cache_dir"]), poisoned)
    for shard in (poisoned / "latents").glob("shard-*.safetensors"):
        from safetensors.torch import save_file

        save_file({k: torch.full_like(v, float("nan")) for k, v in load_file(str(shard)).items()}, str(shard))
    index = io.read_json(index_path)
    index["latent_store"] = str(poisoned / "latents")
    io.write_json(tmp_path / "index.json", index)
    proc = train(tmp_path, (tmp_path / "index.json", raw_cfg), "nan", check=False, max_steps=3)
    assert proc.returncode == 2 and "loss is nan in the optimizer steps up to 1;" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "nan" / "final").exists()


def test_a_killed_rank_ends_the_run_with_one_line(tmp_path, cache):
    """One of two processes is killed mid-run (as the OOM killer would): the other must not wait in its next
    all-reduce until the collective timeout; the stage must end soon, with one line."""
    import psutil

    index, raw_cfg = cache
    cfg = {
        **raw_cfg,
        "train": {
            **TRAIN,
            "max_steps": 100_000,
            "num_processes": 2,
            "per_device_batch_size": 2,
            "checkpoint_every": 0,
            "ddp": {"timeout_s": 600},
        },
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "train",
            "--config",
            str(tmp_path / "cfg.yaml"),
            "--index",
            str(index),
            "--out",
            str(out),
            "--summary",
            str(out / "summary.json"),
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    tree = psutil.Process(proc.pid)
    everything: list = []
    try:
        _wait_for_rows(proc, out, 2)
        everything = tree.children(recursive=True)
        commands = {p: " ".join(p.cmdline()) for p in everything}
        ranks = [p for p, cmd in commands.items() if "sdpipe.train.loop" in cmd and "accelerate" not in cmd]
        assert len(ranks) == 2, list(commands.values())
        ranks[-1].kill()
        killed = time.monotonic()
        stderr = proc.communicate(timeout=120)[1]
        assert time.monotonic() - killed < 120 and not any(p.is_running() for p in ranks)
    finally:  # a failed assertion must not leave a 100,000-step run behind
        leftovers = [*tree.children(recursive=True), tree] if proc.poll() is None else []
        for p in [*everything, *leftovers]:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
    assert proc.returncode == 2
    assert stderr.strip().splitlines()[-1].startswith("sdpipe train: error: training stopped: a training process")
    assert not (out / "final").exists()


def test_a_kill_of_the_stage_takes_its_ranks_and_a_second_run_is_refused(tmp_path, cache):
    """Issue 26, item 3: the launcher starts each rank in a session of its own, so a kill -9 of the stage's process
    group once left both ranks training; and a second run in the same folder trained beside the first."""
    import psutil

    index, raw_cfg = cache
    cfg = {
        **raw_cfg,
        "train": {**TRAIN, "max_steps": 100_000, "num_processes": 2, "per_device_batch_size": 2, "checkpoint_every": 0},
    }
    (tmp_path / "cfg.yaml").write_text(yaml.safe_dump(cfg))
    out = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "sdpipe",
        "train",
        "--config",
        str(tmp_path / "cfg.yaml"),
        "--index",
        str(index),
        "--out",
        str(out),
        "--summary",
        str(out / "summary.json"),
    ]
    proc = subprocess.Popen(
        cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )  # its own process group, as Snakemake's job is
    ranks: list = []
    try:
        _wait_for_rows(proc, out, 2)
        ranks = [
            p
            for p in psutil.Process(proc.pid).children(recursive=True)
            if "sdpipe.train.loop" in " ".join(p.cmdline()) and "accelerate" not in " ".join(p.cmdline())
        ]
        assert len(ranks) == 2
        second = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
        assert second.returncode == 2
        assert second.stderr.strip().splitlines()[-1].endswith("wait for it to end or stop it, then rerun")
        os.killpg(proc.pid, signal.SIGKILL)
        deadline = time.monotonic() + 30
        while any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(p.is_running() and p.status() != psutil.STATUS_ZOMBIE for p in ranks)
    finally:
        for p in ranks:
            with contextlib.suppress(psutil.NoSuchProcess):
                p.kill()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _wait_for_rows(proc: subprocess.Popen, out: Path, rows: int, seconds: float = 300) -> None:
    deadline = time.monotonic() + seconds
    while not ((out / "metrics.csv").is_file() and len(metrics(out)) >= rows):
        assert proc.poll() is None, proc.stderr.read()[-3000:]
        assert time.monotonic() < deadline, f"no {rows} metrics rows after {seconds} s"
        time.sleep(0.5)


def test_checkpoint_every_zero_saves_only_the_final_model(tmp_path, cache):
    train(tmp_path, cache, "nockpt", checkpoint_every=0)
    assert (tmp_path / "nockpt" / "final" / "unet").is_dir()
    assert not list((tmp_path / "nockpt").glob("checkpoints/*/checkpoint-*"))
    assert [int(r["step"]) for r in metrics(tmp_path / "nockpt")] == [1, 2, 3]
    train(tmp_path, cache, "nofinal", checkpoint_every=0, save_final=False)  # what `sdpipe bench` runs
    assert not (tmp_path / "nofinal" / "final").exists()
    assert io.read_json(tmp_path / "nofinal" / "summary.json")["optimizer_steps"] == 3


def test_resumed_optimizer_state_takes_the_weights_layout():
    """Fused AdamW pairs weights and moments by memory position: moments saved from contiguous weights and loaded
    for channels-last ones (a compiled GPU run resuming an eager checkpoint) must be rearranged, or the step is
    wrong."""
    from sdpipe.train.checkpoint import match_state_layout

    gen = torch.Generator().manual_seed(0)
    start, grad = torch.randn(8, 4, 3, 3, generator=gen), torch.randn(8, 4, 3, 3, generator=gen)
    saved = torch.nn.Parameter(start.clone())
    opt = torch.optim.AdamW([saved], fused=True)
    saved.grad = torch.randn(8, 4, 3, 3, generator=gen)
    opt.step()

    def step_from_saved(channels_last: bool, fix: bool) -> torch.Tensor:
        p = torch.nn.Parameter(
            start.clone().contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        )
        o = torch.optim.AdamW([p], fused=True)
        o.load_state_dict(copy.deepcopy(opt.state_dict()))  # as from disk: loading may share the tensors
        if fix:
            assert match_state_layout(o) == (2 if channels_last else 0)  # exp_avg and exp_avg_sq
        p.grad = grad.clone().contiguous(
            memory_format=torch.channels_last if channels_last else torch.contiguous_format
        )
        o.step()
        return p.detach().contiguous()

    reference = step_from_saved(channels_last=False, fix=True)
    assert not torch.allclose(step_from_saved(channels_last=True, fix=False), reference)  # the silent error
    torch.testing.assert_close(step_from_saved(channels_last=True, fix=True), reference)


def test_padding_a_short_batch_leaves_its_loss_and_gradients_unchanged(tmp_path, cache):
    """A compiled step pads short batches to one shape; the padding must not change what is learned."""
    from types import SimpleNamespace

    from sdpipe.train import loop

    index, raw_cfg = cache
    run = loop.build(config.from_dict({**raw_cfg, "train": {**TRAIN, "num_processes": 1}}), index, tmp_path / "pad")
    loop.resume(run)
    run.telemetry = SimpleNamespace(loading=contextlib.nullcontext)
    short = run.sampler.remaining(run.state)[0][:3]  # a global batch holds one bucket
    results = []
    for pad_to in (0, 4):
        run.pad_to = pad_to
        run.unet.zero_grad(set_to_none=True)
        loss = loop.micro_step(run, short, 3, 0)
        results.append((float(loss), [p.grad.clone() for p in run.params()]))
    (plain, plain_grads), (padded, padded_grads) = results
    assert padded == pytest.approx(plain, rel=1e-6)
    for a, b in zip(plain_grads, padded_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-7)


def test_sdxl_family_trains_with_pooled_embeddings_and_time_ids(tmp_path, demo_source):
    """The SDXL path: two text encoders (hidden 64+96), pooled embeddings and per-image size/crop time ids."""
    from sdpipe.models import presets

    model = presets.build_and_save("tiny-sdxl", tmp_path / "sdxl")
    raw_cfg = small_config(tmp_path, demo_source, model)
    cfg = config.from_dict(raw_cfg)
    prepare.run(
        cfg, {}, {"manifest": tmp_path / "m.jsonl", "rejected": tmp_path / "r.jsonl", "summary": tmp_path / "p.json"}
    )
    caption.run(
        cfg, {"manifest": tmp_path / "m.jsonl"}, {"captions": tmp_path / "c.jsonl", "summary": tmp_path / "cs.json"}
    )
    latents.run(
        cfg,
        {"manifest": tmp_path / "m.jsonl", "captions": tmp_path / "c.jsonl"},
        {"index": tmp_path / "index.json", "summary": tmp_path / "ls.json"},
    )
    index = io.read_json(tmp_path / "index.json")
    assert index["model"]["family"] == "sdxl" and all(len(it["crop_top_left"]) == 2 for it in index["items"])
    # Both text encoders train as LoRA on 2 processes: DDP must accept text_encoder's unused last layer.
    train(
        tmp_path,
        (tmp_path / "index.json", raw_cfg),
        "sdxl",
        mode="lora",
        max_steps=2,
        num_processes=2,
        per_device_batch_size=2,
        text_encoder={"mode": "lora"},
    )
    summary = io.read_json(tmp_path / "sdxl" / "summary.json")
    assert summary["optimizer_steps"] == 2 and summary["world_size"] == 2
    keys = load_file(str(tmp_path / "sdxl" / "final" / "pytorch_lora_weights.safetensors")).keys()
    assert {k.split(".")[0] for k in keys} == {"unet", "text_encoder", "text_encoder_2"}


def test_lora_output_reloads_with_its_alpha(tmp_path, cache):
    """diffusers' load_lora_weights must see lora_alpha, or the adapter is applied at the wrong scale."""
    from diffusers import StableDiffusionPipeline

    train(tmp_path, cache, "lora", mode="lora", max_steps=1, lora={"rank": 4, "alpha": 16})
    pipe = StableDiffusionPipeline.from_pretrained(cache[1]["model"]["pretrained"], safety_checker=None)
    pipe.load_lora_weights(str(tmp_path / "lora" / "final"))
    (adapter,) = pipe.unet.peft_config.values()
    assert (adapter.r, adapter.lora_alpha) == (4, 16)


def test_text_encoder_full_fine_tune_saves_a_changed_encoder(tmp_path, cache):
    from transformers import CLIPTextModel

    train(tmp_path, cache, "te", max_steps=2, text_encoder={"mode": "full", "learning_rate": 0.01})
    final = tmp_path / "te" / "final"
    assert io.read_json(final / "final.json")["components"] == {"unet": "full", "text_encoder": "full"}
    trained = CLIPTextModel.from_pretrained(final / "text_encoder").state_dict()
    base = CLIPTextModel.from_pretrained(Path(cache[1]["model"]["pretrained"]) / "text_encoder").state_dict()
    changed = [k for k in base if not torch.equal(base[k], trained[k])]
    assert len(changed) > len(base) // 2  # the encoder trained (not just, say, one bias)


def test_text_encoder_lora_on_two_processes_reloads_in_diffusers(tmp_path, cache):
    """UNet LoRA + text-encoder LoRA through DDP; diffusers loads both and the encoder's output changes."""
    from diffusers import StableDiffusionPipeline

    train(
        tmp_path,
        cache,
        "telora",
        mode="lora",
        max_steps=2,
        num_processes=2,
        per_device_batch_size=2,
        learning_rate=0.01,
        text_encoder={"mode": "lora"},
        lora={"rank": 4, "alpha": 4},
    )
    pipe = StableDiffusionPipeline.from_pretrained(cache[1]["model"]["pretrained"], safety_checker=None)
    ids = pipe.tokenizer(["a red circle"], padding="max_length", return_tensors="pt").input_ids
    before = pipe.text_encoder(ids)[0]
    pipe.load_lora_weights(str(tmp_path / "telora" / "final"))
    assert pipe.text_encoder.peft_config and pipe.unet.peft_config
    assert not torch.allclose(before, pipe.text_encoder(ids)[0])


def test_text_encoder_lora_targets_are_checked_before_launch(tmp_path, cache):
    proc = train(tmp_path, cache, "badte", check=False, text_encoder={"mode": "lora", "lora_target_modules": ["nope"]})
    assert proc.returncode == 2 and "train.text_encoder.lora_target_modules: ['nope']" in proc.stderr
    assert "Traceback" not in proc.stderr


def test_prefetched_batches_train_exactly_as_batches_loaded_in_the_loop(tmp_path, cache):
    """The prefetch thread must load what the loop would have loaded, in the plan's order and across the epoch's
    end (40 images, batch 4: 10 steps an epoch): the per-step losses with and without it are identical."""
    import threading

    from sdpipe.train import loop
    from sdpipe.train.prefetch import Prefetcher
    from sdpipe.train.telemetry import Telemetry

    index, raw_cfg = cache
    settings = {**TRAIN, "num_processes": 1, "max_steps": 12, "checkpoint_every": 0}

    def losses(name: str, prefetch: bool) -> tuple[list[float], list[str]]:
        run = loop.build(config.from_dict({**raw_cfg, "train": settings}), index, tmp_path / name)
        loop.resume(run)
        run.telemetry, run.advance_bar, threads = Telemetry(run, time.time()), lambda n: None, []

        def load(epoch, indices):
            threads.append(threading.current_thread().name)
            return loop.host_batch(run, indices, epoch)

        with Prefetcher(load) if prefetch else contextlib.nullcontext() as run.prefetch:
            while not loop.finished(run) and not loop.train_epoch(run):
                pass
        run.telemetry.close()
        assert run.state.epoch == 1 and run.step == 12
        return [float(r["loss"]) for r in metrics(tmp_path / name)], threads

    plain, _ = losses("plain", prefetch=False)
    ahead, threads = losses("ahead", prefetch=True)
    assert len(plain) == 12 and ahead == plain
    # Every load on the prefetch thread, and only the 2 batches queued past the last step wasted: the look-ahead
    # named the batches the loop then asked for.
    assert len(threads) <= 12 + 2 and all(t.startswith("sdpipe-prefetch") for t in threads)


def test_the_records_stages_write_have_the_typed_fields(cache):
    """sdpipe/records.py is what prepare, caption and latents really write, field for field."""
    from sdpipe import records

    index_path, _ = cache
    tmp = index_path.parent
    keys = lambda typed: set(typed.__annotations__)
    assert all(set(row) == keys(records.ManifestRow) for row in io.read_jsonl(tmp / "m.jsonl"))
    assert all(set(row) == keys(records.CaptionRow) for row in io.read_jsonl(tmp / "c.jsonl"))
    index = io.read_json(index_path)
    assert set(index) == keys(records.LatentIndex) and set(index["model"]) == keys(records.LatentModel)
    assert index["items"] and all(set(item) == keys(records.LatentItem) for item in index["items"])
