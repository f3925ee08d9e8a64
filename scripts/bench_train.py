"""Training throughput on this machine's GPUs, through `sdpipe train` (the command the Snakemake rule runs).

Builds the randomly initialised sd15 preset, prepares and caches the demo images at 512x512 (scripts/bench_latents
does the same), then trains each case for a fixed number of optimizer steps and prints a table. samples/s is the
last metrics window (after warm-up); the summary's whole-run figure includes the first, compiling steps.
Usage: python scripts/bench_train.py [--work DIR] [--steps N] [--processes N]
"""

from __future__ import annotations

import argparse
import csv
import json
import shutil
from pathlib import Path

import yaml

from bench_latents import run_case, sdpipe

CASES = [  # mode, mixed precision, per-device batch, gradient checkpointing
    ("full", "bf16", 16, False),
    ("full", "bf16", 32, False),
    ("lora", "bf16", 16, False),
    ("full", "fp32", 16, False),
]


def train_case(work: Path, case: tuple, steps: int, processes: int) -> dict:
    mode, precision, batch, checkpointing = case
    base = yaml.safe_load((work / "sd15-512-bf16-32-0.yaml").read_text())
    base["train"] = {"mode": mode, "mixed_precision": precision, "per_device_batch_size": batch,
                     "gradient_checkpointing": checkpointing, "max_steps": steps, "log_every": 10,
                     "checkpoint_every": 10**6, "resume": None, "num_processes": processes}
    name = "-".join(str(x) for x in case)
    cfg = work / f"train-{name}.yaml"
    cfg.write_text(yaml.safe_dump(base))
    out = work / f"train-{name}"
    shutil.rmtree(out, ignore_errors=True)
    sdpipe("train", "--config", str(cfg), "--index", str(work / "out-sd15-512-bf16-32-0" / "index.json"),
           "--out", str(out), "--summary", str(out / "summary.json"))
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "metrics.csv") as f:
        summary["last_window"] = list(csv.DictReader(f))[-1]
    return summary


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/sdpipe-bench-train")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--processes", type=int, default=1)
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "raw").exists():
        sdpipe("demo", "--out", str(work / "raw"))
    run_case(work, ("sd15", 512, "bf16", 32, 0), "auto")
    rows = [(case, train_case(work, case, args.steps, args.processes)) for case in CASES]
    print("\n| mode | precision | batch/GPU | GPUs | steps | samples/s (last 10 steps) | per GPU | data wait | peak MiB |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (mode, precision, batch, _), s in rows:
        w = s["last_window"]
        print(f"| {mode} | {precision} | {batch} | {s['world_size']} | {s['optimizer_steps']} | {w['samples_per_s']} "
              f"| {w['samples_per_s_per_gpu']} | {w['data_wait']} | {w['peak_memory_mb']} |")


if __name__ == "__main__":
    main()
