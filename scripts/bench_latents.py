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

CASES = [  # preset, resolution, dtype, batch size
    ("sd15", 512, "fp16", 8),
    ("sd15", 512, "fp16", 32),
    ("sd15", 512, "bf16", 32),
    ("sdxl", 1024, "bf16", 16),
]


def sdpipe(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "sdpipe", *args], check=True)


def config(work: Path, preset: str, resolution: int, dtype: str, batch: int, gpus: str) -> Path:
    cfg = {"cache_dir": str(work / f"cache-{preset}-{dtype}-{batch}"), "data": {"raw_dir": str(work / "raw")},
           "model": {"pretrained": str(work / preset)},
           "prepare": {"min_size": 32, "eval_fraction": 0.0, "buckets": {"resolution": resolution, "step": 64}},
           "caption": {"chain": ["sidecar", "template"], "gpus": 0},
           "latents": {"dtype": dtype, "batch_size": batch, "gpus": gpus if gpus == "auto" else int(gpus)}}
    path = work / f"{preset}-{dtype}-{batch}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def run_case(work: Path, case: tuple, gpus: str) -> dict:
    preset, resolution, dtype, batch = case
    if not (work / preset / "model_index.json").is_file():
        sdpipe("build-model", "--preset", preset, "--out", str(work / preset))
    cfg = config(work, *case, gpus)
    out = work / f"out-{preset}-{dtype}-{batch}"
    shutil.rmtree(work / f"cache-{preset}-{dtype}-{batch}", ignore_errors=True)
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
    print("\n| preset | resolution | dtype | batch | devices | images | seconds | images/s |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for (preset, res, dtype, batch), s in rows:
        print(f"| {preset} | {res} | {dtype} | {batch} | {len(s['devices'])}x {s['devices'][0]} | {s['encoded']} "
              f"| {s['seconds']} | {s['images_per_s']} |")


if __name__ == "__main__":
    main()
