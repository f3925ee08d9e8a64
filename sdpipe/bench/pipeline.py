"""The project's own stages, timed as users run them: `sdpipe latents` on JPEG files, `sdpipe train` on their
latent cache, and the training data loader (`loop.load_batch`) alone."""

from __future__ import annotations

import csv
import json
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import yaml


def sdpipe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "sdpipe", *args], check=True)


def capped_allocator_env(cap_gib: float) -> dict[str, str]:
    """The environment that limits PyTorch's caching allocator, in `sdpipe train` and the process it starts, to
    `cap_gib` of the first GPU: a smaller card on this one. Past the cap an allocation raises out-of-memory, as the
    smaller card would. The CUDA context (about half a GiB) lies outside the allocator: leave it out of the cap."""
    import os

    import torch

    total = torch.cuda.get_device_properties(0).total_memory
    fraction = min(1.0, cap_gib * 2**30 / total)
    conf = [c for c in os.environ.get("PYTORCH_CUDA_ALLOC_CONF", "").split(",") if c]
    return {**os.environ, "PYTORCH_CUDA_ALLOC_CONF": ",".join([*conf, f"per_process_memory_fraction:{fraction:.4f}"])}


def write_jpegs(out: Path, count: int, size: int, seed: int = 0) -> Path:
    """`count` photo-like JPEGs (smooth colour fields, shapes, sensor noise; quality 90) of size x size px: the
    decode cost of real photos at that size, unlike the demo's tiny images."""
    from PIL import Image, ImageDraw

    out.mkdir(parents=True, exist_ok=True)

    def one(i: int) -> None:
        path = out / f"img{i:05d}.jpg"
        if path.exists():
            return
        rng = np.random.default_rng(seed + i)
        yy, xx = np.mgrid[0:size, 0:size] / size
        base = np.stack(
            [
                rng.uniform(40, 215) + rng.uniform(-60, 60) * (xx * rng.uniform(-1, 1) + yy * rng.uniform(-1, 1))
                for _ in range(3)
            ],
            axis=-1,
        )
        img = Image.fromarray(np.clip(base + rng.normal(0, 6, base.shape), 0, 255).astype(np.uint8))
        draw = ImageDraw.Draw(img)
        for _ in range(6):
            x, y, r = rng.integers(0, size, 2).tolist() + [int(rng.integers(size // 16, size // 4))]
            draw.ellipse([x - r, y - r, x + r, y + r], fill=tuple(rng.integers(0, 256, 3).tolist()))
        tmp = path.with_suffix(".tmp")
        img.save(tmp, format="JPEG", quality=90)
        tmp.rename(path)

    with ThreadPoolExecutor() as pool:
        list(pool.map(one, range(count)))
    return out


def stage_config(work: Path, name: str, model: Path, raw: Path, resolution: int, latents: dict) -> Path:
    cfg = {
        "cache_dir": str(work / f"cache-{name}"),
        "data": {"raw_dir": str(raw)},
        "model": {"pretrained": str(model)},
        "prepare": {
            "min_size": 32,
            "eval_fraction": 0.0,
            "buckets": {"resolution": resolution, "step": min(64, resolution // 4)},
        },
        "caption": {"chain": ["template"], "gpus": 0},
        "latents": latents,
    }
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def cached_latents(work: Path, name: str, count: int) -> dict | None:
    """An earlier `cache_latents` of `count` images under this name, for rows that only train on it."""
    out = work / f"out-{name}"
    if not (out / "latents.json").is_file() or not (work / f"cache-{name}").is_dir():
        return None
    summary = json.loads((out / "latents.json").read_text())
    if summary.get("items") != count:
        return None
    batch = max(summary["batch_sizes"].values(), default=None)
    return {**summary, "batch": batch, "index": str(out / "index.json"), "config": str(work / f"{name}.yaml")}


def cache_latents(work: Path, name: str, model: Path, raw: Path, resolution: int, latents: dict) -> dict:
    """prepare -> caption (once per image set) -> latents on an empty cache; the latents stage's own summary."""
    cfg = stage_config(work, name, model, raw, resolution, latents)
    out, upstream = work / f"out-{name}", work / f"upstream-{raw.name}"
    shutil.rmtree(work / f"cache-{name}", ignore_errors=True)
    manifest, captions = upstream / "manifest.jsonl", upstream / "captions.jsonl"
    common = ["--config", str(cfg), "--manifest", str(manifest)]
    if not captions.is_file():
        sdpipe(
            "prepare",
            *common,
            "--rejected",
            str(upstream / "rejected.jsonl"),
            "--summary",
            str(upstream / "prepare.json"),
        )
        sdpipe("caption", *common, "--captions", str(captions), "--summary", str(upstream / "captions.json"))
    sdpipe(
        "latents",
        *common,
        "--captions",
        str(captions),
        "--index",
        str(out / "index.json"),
        "--summary",
        str(out / "latents.json"),
    )
    summary = json.loads((out / "latents.json").read_text())
    batch = max(summary["batch_sizes"].values(), default=None)  # one GPU in the bench
    return {**summary, "batch": batch, "index": str(out / "index.json"), "config": str(cfg)}


def train_config(
    work: Path, stage_cfg: str, name: str, batch: int, steps: int, log_every: int, extra: dict, base: dict | None = None
) -> Path:
    """The latents stage's config with a train section: `base` (a template's train settings, else a bf16 full
    fine-tune), then the bench's timing settings (no validation, checkpoints or warm-up ramp), then `extra`."""
    cfg = yaml.safe_load(Path(stage_cfg).read_text())
    cfg["train"] = {
        "mode": "full",
        "mixed_precision": "bf16",
        **(base or {}),
        "per_device_batch_size": batch,
        "max_steps": steps,
        "log_every": log_every,
        "lr_warmup_steps": 0,
        "checkpoint_every": 0,
        "save_final": False,
        "resume": None,
        "num_processes": 1,
        "validation": {"every": 0},
        **extra,
    }
    path = work / f"train-{name}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def train_row(
    work: Path,
    cache: dict,
    name: str,
    batch: int,
    steps: int,
    log_every: int,
    extra: dict,
    base: dict | None = None,
    cap_gib: float | None = None,
) -> dict:
    """`sdpipe train` (what the Snakemake rule runs) for `steps` optimizer steps; samples/s of the last full logged
    window, warm-up = the first window's time beyond what a steady window takes. Under an allocator cap
    (`cap_gib`), a run that goes out of memory is a row that does not fit, not a failed benchmark."""
    cfg = train_config(work, cache["config"], name, batch, steps, log_every, extra, base)
    out = work / f"train-{name}"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    cmd = [sys.executable, "-m", "sdpipe", "train", "--config", str(cfg), "--index", cache["index"]]
    cmd += ["--out", str(out), "--summary", str(out / "summary.json")]
    env = capped_allocator_env(cap_gib) if cap_gib else None
    start = time.perf_counter()
    with open(out / "stage.log", "w") as log:
        rc = subprocess.run(cmd, stdout=log, stderr=subprocess.STDOUT, env=env).returncode
    wall = time.perf_counter() - start
    text = (out / "stage.log").read_text(errors="replace")
    print(text[-4000:], flush=True)  # the stage's own last lines, in the bench's log
    if rc:
        if cap_gib and "out of memory" in text.lower():
            return {"batch": batch, "fits": False, "memory_cap_gib": cap_gib, "stage_wall_s": wall}
        raise subprocess.CalledProcessError(rc, cmd)
    with open(out / "metrics.csv") as f:
        rows = list(csv.DictReader(f))
    steady, first, last = last_full_window(rows, log_every), rows[0], rows[-1]
    rate = float(steady["samples_per_s"])
    accum = int((base or {}).get("grad_accum_steps", 1))
    window = log_every * batch * accum
    return {
        "samples_per_s": rate,
        "warmup_s": window / float(first["samples_per_s"]) - window / rate,
        "stage_wall_s": wall,
        "peak_memory_gib": float(last["peak_memory_mb"]) / 1024 if last["peak_memory_mb"] else None,
        "data_wait": float(steady["data_wait"]),
        "batch": batch,
        "grad_accum_steps": accum,
        "fits": True if cap_gib else None,
        "memory_cap_gib": cap_gib,
        "final_loss": float(last["loss"]),
        "cuda_alloc_retries": json.loads((out / "summary.json").read_text()).get("cuda_alloc_retries"),
    }


def last_full_window(rows: list[dict], log_every: int) -> dict:
    """The metrics row of the last window of `log_every` steps after the first (warm-up) window. A run whose step
    count is not a multiple of log_every ends in a short window: 2 steps of 128 samples measure too little."""
    full = [row for prev, row in zip(rows, rows[1:]) if int(row["step"]) - int(prev["step"]) == log_every]
    return full[-1] if full else rows[-1]


def loader_rate(train_cfg: Path, index: str, batches: int) -> dict:
    """Samples/s `loop.load_batch` delivers to the device (in a child process: it builds its own accelerator)."""
    proc = subprocess.run(
        [sys.executable, "-m", "sdpipe.bench.loader", str(train_cfg), index, str(batches)],
        check=True,
        capture_output=True,
        text=True,
    )
    return json.loads(proc.stdout.strip().splitlines()[-1])
