"""Training throughput at each GPU count in benchmark.gpu_counts, and the scaling efficiency against the smallest.

Each count runs the real training stage (same launcher, same data, fresh start) for warmup + timed steps with
per-step telemetry; only the timed steps count, so start-up, compilation and cuDNN autotuning stay out of it.
Efficiency at N GPUs = (samples/s per GPU at N) / (samples/s per GPU at the smallest count).
"""

from __future__ import annotations

import csv
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import config, io
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {"index": "results/latents/index.json"}
OUTPUTS = {"out": "results/benchmark", "scaling": "results/benchmark/scaling.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("benchmark", "train", "model")


def settings_for(cfg: Config, gpus: int) -> list[str]:
    b = cfg.benchmark
    return [
        f"train.num_processes={gpus}",
        f"train.max_steps={b.warmup_steps + b.steps}",
        "train.resume=null",
        "train.lr_warmup_steps=0",
        "train.log_every=1",
        f"train.checkpoint_every={10**9}",
        "train.validation.every=0",
        "train.tracker=none",
    ]


def timed_throughput(metrics_csv: Path, warmup: int) -> float:
    """Samples over seconds across the timed steps. With log_every=1 each row is one step: its samples are the
    growth of samples_seen since the previous row, its seconds those samples over the row's samples/s."""
    with open(metrics_csv) as f:
        rows = list(csv.DictReader(f))
    samples = seconds = 0.0
    for before, row in zip(rows, rows[1:]):
        if int(row["step"]) > warmup:
            n = int(row["samples_seen"]) - int(before["samples_seen"])
            samples, seconds = samples + n, seconds + n / float(row["samples_per_s"])
    if not seconds:
        raise UserError(f"{metrics_csv} has no timed step after the {warmup} warmup steps")
    return samples / seconds


def scaling_table(results: dict[int, float]) -> list[dict]:
    base = min(results)
    per_gpu_base = results[base] / base
    return [
        {
            "gpus": n,
            "samples_per_s": round(s, 3),
            "per_gpu_samples_per_s": round(s / n, 3),
            "efficiency": round((s / n) / per_gpu_base, 4),
        }
        for n, s in sorted(results.items())
    ]


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from sdpipe.stages import train

    counts = cfg.benchmark.gpu_counts
    if not counts:
        raise UserError("benchmark.gpu_counts is empty; list the GPU counts to time, e.g. [1, 2, 4, 8]")
    out, results = Path(outputs["out"]), {}
    for n in counts:
        run_cfg = config.from_dict(config.apply_overrides(dict(cfg.raw), settings_for(cfg, n)))
        folder = out / f"gpus-{n}"
        train.run(run_cfg, {"index": inputs["index"]}, {"out": folder, "summary": folder / "summary.json"})
        results[n] = timed_throughput(folder / "metrics.csv", cfg.benchmark.warmup_steps)
        log.info("benchmark: %d GPU(s): %.2f samples/s", n, results[n])
    table = scaling_table(results)
    io.write_json(
        outputs["scaling"],
        {
            "scaling": table,
            "steps": cfg.benchmark.steps,
            "warmup_steps": cfg.benchmark.warmup_steps,
            "per_device_batch_size": cfg.train.per_device_batch_size,
            "mixed_precision": cfg.train.mixed_precision,
            "timing": True,
        },
    )
    return {"scaling": table}
