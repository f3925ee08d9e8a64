"""Latent-caching throughput on this machine's GPUs, through the same `sdpipe` commands the workflow runs.

For each (preset, resolution, dtype, batch size) it builds the randomly initialised preset, prepares the demo
images at that resolution, and times `sdpipe latents` on an empty cache; the table at the end reads the stage's
own summary (images/s = images encoded / wall time of the encoding phase, model loading and text encoding
included). Usage: python scripts/bench_latents.py [--work DIR] [--count N] [--gpus auto|N]
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
from pathlib import Path

import yaml

CASES = [  # preset, resolution, dtype, batch size, loader threads (0 = cores / processes)
    ("sd15", 512, "fp16", 32, 1),  # baseline: one thread decodes and resizes ahead of the VAE
    ("sd15", 512, "fp16", 32, 0),
    ("sd15", 512, "bf16", 32, 0),
    ("sd15", 512, "fp16", 8, 0),
    ("sdxl", 1024, "bf16", 16, 0),
]


def sdpipe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "sdpipe", *args], check=True)


def name_of(case: tuple) -> str:
    return "-".join(str(x) for x in case)


def config(work: Path, case: tuple, gpus: str) -> Path:
    preset, resolution, dtype, batch, threads = case
    cfg = {"cache_dir": str(work / f"cache-{name_of(case)}"), "data": {"raw_dir": str(work / "raw")},
           "model": {"pretrained": str(work / preset)},
           "prepare": {"min_size": 32, "eval_fraction": 0.0, "buckets": {"resolution": resolution, "step": 64}},
           "caption": {"chain": ["sidecar", "template"], "gpus": 0},
           "latents": {"dtype": dtype, "batch_size": batch, "loader_threads": threads,
                       "gpus": gpus if gpus == "auto" else int(gpus)}}
    path = work / f"{name_of(case)}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_case(work: Path, case: tuple, gpus: str) -> dict:
    preset = case[0]
    if not (work / preset / "model_index.json").is_file():
        sdpipe("build-model", "--preset", preset, "--out", str(work / preset))
    cfg = config(work, case, gpus)
    out = work / f"out-{name_of(case)}"
    shutil.rmtree(work / f"cache-{name_of(case)}", ignore_errors=True)
    common = ["--config", str(cfg), "--manifest", str(out / "manifest.jsonl")]
    sdpipe("prepare", *common, "--rejected", str(out / "rejected.jsonl"), "--summary", str(out / "prepare.json"))
    sdpipe("caption", *common, "--captions", str(out / "captions.jsonl"), "--summary", str(out / "captions.json"))
    sdpipe("latents", *common, "--captions", str(out / "captions.jsonl"), "--index", str(out / "index.json"),
           "--summary", str(out / "latents.json"))
    return json.loads((out / "latents.json").read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--work", default="/tmp/sdpipe-bench-latents")
    parser.add_argument("--count", type=int, default=480)
    parser.add_argument("--gpus", default="auto")
    args = parser.parse_args()
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "raw").exists():
        sdpipe("demo", "--out", str(work / "raw"), "--count", str(args.count))
    rows = [(case, run_case(work, case, args.gpus)) for case in CASES]
    print("\n| preset | resolution | dtype | batch | loader threads | devices | images | seconds | images/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    for (preset, res, dtype, batch, threads), s in rows:
        print(f"| {preset} | {res} | {dtype} | {batch} | {threads or 'auto'} | {len(s['devices'])}x {s['devices'][0]} "
              f"| {s['encoded']} | {s['seconds']} | {s['images_per_s']} |")


if __name__ == "__main__":
    main()
