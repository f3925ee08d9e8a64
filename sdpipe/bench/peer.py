"""diffusers' examples/text_to_image/train_text_to_image.py beside sdpipe's DAG: the same JPEGs, the same
random-init model, the same batch and steps, bf16, on the same GPU.

The script is not part of sdpipe and is run as it ships: pass the path of a copy fetched from the diffusers
repository. It reads the images through `datasets` (an imagefolder with metadata.jsonl captions), encodes them with
the VAE at every step, and saves the fine-tuned pipeline at the end. Its progress bar is read as it runs, each
update stamped with the time it arrived: the first step's time (start-up: imports, loading, dataset building) and
the steady seconds per step come from those stamps.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from pathlib import Path

from sdpipe import io, templates

BAR = re.compile(rb"Steps:\s+\d+%\|[^|]*\|\s*(\d+)/(\d+)")


def image_folder(project: Path, out: Path) -> Path:
    """The project's JPEGs as a datasets imagefolder: links to the files, captions in metadata.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    rows = []
    for image in sorted((project / "data" / "raw").glob("*.jpg")):
        link = out / image.name
        if not link.exists():
            link.symlink_to(image.resolve())
        rows.append({"file_name": image.name, "text": image.with_suffix(".txt").read_text().strip()})
    io.write_jsonl(out / "metadata.jsonl", rows)
    return out


def command(script: Path, project: Path, job, data: Path, out: Path, steps: int) -> list[str]:
    lr = templates.settings(job.template)["train"]["learning_rate"]  # the job's, as sdpipe trains it
    return [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        "1",
        "--num_machines",
        "1",
        "--mixed_precision",
        "bf16",
        "--dynamo_backend",
        "no",
        str(script),
        "--pretrained_model_name_or_path",
        str(project / "models" / job.preset),
        "--train_data_dir",
        str(data),
        "--resolution",
        str(job.resolution),
        "--center_crop",
        "--train_batch_size",
        str(job.batch),
        "--max_train_steps",
        str(steps),
        "--learning_rate",
        str(lr),
        "--lr_scheduler",
        "constant",
        "--lr_warmup_steps",
        "0",
        "--mixed_precision",
        "bf16",
        "--output_dir",
        str(out),
        "--checkpointing_steps",
        "100000000",
        "--dataloader_num_workers",
        "8",
        "--seed",
        "0",
        "--report_to",
        "tensorboard",
    ]


def stamped_steps(cmd: list[str], logfile: Path) -> tuple[float, list[tuple[int, float]]]:
    """Run `cmd`; return its wall seconds and (step, seconds since start) for every progress-bar update."""
    start = time.perf_counter()
    stamps: list[tuple[int, float]] = []
    with open(logfile, "wb") as log, subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT) as proc:
        while chunk := os.read(proc.stdout.fileno(), 65536):
            now = time.perf_counter() - start
            log.write(chunk)
            stamps += [(int(m.group(1)), now) for m in BAR.finditer(chunk)]
        rc = proc.wait()
    if rc:
        raise RuntimeError(f"train_text_to_image.py failed (exit {rc}); log: {logfile}")
    return time.perf_counter() - start, stamps


def timings(wall: float, stamps: list[tuple[int, float]], batch: int, steps: int, projected_steps: int) -> dict:
    """Start-up (until the first step is done), steady seconds per step (a fit over the second half of the run),
    the tail after the last step (the final save) and, for a run shorter than `projected_steps`, the projection."""
    first = next(t for s, t in stamps if s >= 1)
    last_step, last = max(stamps)
    half = [(s, t) for s, t in stamps if s >= last_step // 2]
    (s0, t0), (s1, t1) = min(half), max(half)
    per_step = (t1 - t0) / (s1 - s0)
    projected = first + (projected_steps - 1) * per_step + (wall - last)
    return {
        "steps": steps,
        "batch": batch,
        "wall_s": round(wall, 3),
        "startup_s": round(first, 3),
        "samples_per_s": round(batch / per_step, 3),
        "tail_s": round(wall - last, 3),
        "projected_steps": projected_steps,
        "projected_s": round(projected if steps < projected_steps else wall, 3),
        "projected": steps < projected_steps,
    }


def run(script: Path, project: Path, job, work: Path, steps: int) -> dict:
    """Train with the peer's script on `project`'s images and model; its timings beside `job.steps`."""
    data = image_folder(project, work / "imagefolder")
    out = work / "output"
    wall, stamps = stamped_steps(command(script, project, job, data, out, steps), work / "train_text_to_image.log")
    return {"script": str(script), **timings(wall, stamps, job.batch, steps, job.steps)}
