"""Read the earlier stages' outputs for the report: required ones fail with one line naming the target that makes
them, optional ones come back as None with the same hint, for the report to print instead of the missing part."""

from __future__ import annotations

import csv
import re
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from sdpipe import hashing, io
from sdpipe.errors import UserError

# The Snakemake target that writes each input. The resolved config is written by the workflow itself when it loads.
MADE_BY = {
    "resolved_config": "report",
    "prepare": "prepare",
    "manifest": "prepare",
    "captions": "caption",
    "latents": "latents",
    "train_summary": "train",
    "train_metrics": "train",
    "samples_dir": "train",
    "export": "export",
    "metrics": "evaluate",
    "eval_grid": "evaluate",
    "eval_prompts": "evaluate",
}
REQUIRED = ("resolved_config", "train_summary", "train_metrics", "metrics")
METRIC_COLUMNS = ("step", "loss", "lr")  # the least of sdpipe/train/telemetry.py COLUMNS that the plots need
GRID_NAME = re.compile(r"step-(\d+)\.png")
OBJECTS = ("resolved_config", "prepare", "captions", "latents", "train_summary", "export", "metrics")  # JSON/YAML {}


def hint(name: str, path: Path) -> str:
    return f"{path} not found; run `snakemake {MADE_BY[name]}` first"


@dataclass
class Sources:
    paths: dict[str, Path]
    missing: dict[str, str] = field(default_factory=dict)  # input name -> the hint saying how to make it
    data: dict = field(default_factory=dict)  # input name -> its parsed content


def load(inputs: dict[str, Path]) -> Sources:
    """Every input parsed; the required ones are checked before anything is read, so a miss costs nothing."""
    paths = {name: Path(p) for name, p in inputs.items()}
    for name in REQUIRED:
        if not paths[name].exists():
            raise UserError(hint(name, paths[name]))
    src = Sources(paths)
    readers = {
        "resolved_config": _read_yaml,
        "train_metrics": read_metrics_csv,
        "samples_dir": find_grids,
        "eval_grid": lambda path: path,
        "manifest": io.read_jsonl,
    }
    for name, path in paths.items():
        if not path.exists():
            src.missing[name] = hint(name, path)
            continue
        try:
            src.data[name] = readers.get(name, io.read_json)(path)
            if name in OBJECTS and not isinstance(src.data[name], dict):
                raise ValueError("not a mapping")
        except (OSError, ValueError) as exc:  # JSONDecodeError and UnicodeDecodeError are ValueErrors
            raise UserError(
                f"{path} is unreadable ({str(exc).splitlines()[0]}); rerun `snakemake {MADE_BY[name]}`"
            ) from None
    return src


def _read_yaml(path: Path):
    import yaml

    try:
        return io.read_yaml(path)
    except yaml.YAMLError as exc:
        raise ValueError(str(exc)) from None


def read_metrics_csv(path: Path) -> list[dict]:
    """metrics.csv rows with numbers as floats (step as int) and empty cells (no CUDA peak memory) as None."""
    with open(path, newline="", encoding="utf-8") as f:
        reader = csv.DictReader(f)
        lacking = [c for c in METRIC_COLUMNS if c not in (reader.fieldnames or [])]
        if lacking:
            raise ValueError(f"no column {lacking[0]!r}")
        rows = [{k: _number(v) for k, v in row.items()} for row in reader]
    for row in rows:
        row["step"] = int(row["step"])
    return rows


def _number(text: str | None):
    if text in (None, ""):
        return None
    try:
        return float(text)
    except ValueError:
        return text


def find_grids(folder: Path) -> list[tuple[int, Path]]:
    """(step, path) of every validation grid, by step."""
    found = ((GRID_NAME.fullmatch(p.name), p) for p in folder.iterdir() if p.is_file())
    return sorted((int(m[1]), p) for m, p in found if m)


def config_hash(config: dict) -> str:
    # Of the parsed YAML, not the bytes: key order and comments do not change what was run.
    return hashing.key_of(config)


def dataset_hash(rows: list[dict]) -> str:
    # Image ids are hashes of the image bytes, so this names the accepted images whatever their file names.
    return hashing.key_of(sorted(r["id"] for r in rows))


def dvc_md5(raw_dir: str) -> str | None:
    """The md5 DVC recorded for the raw folder (`dvc add data/raw` writes data/raw.dvc), or None."""
    import yaml

    path = Path(f"{raw_dir.rstrip('/')}.dvc")
    try:
        return io.read_yaml(path)["outs"][0]["md5"]
    except (OSError, yaml.YAMLError, LookupError, TypeError):  # absent or malformed: the report says so
        return None


def git_commit(recorded: str | None) -> tuple[str, str]:
    """(commit, where it came from): evaluate's record, else this working tree's HEAD, else unknown."""
    if recorded:
        return recorded, "recorded by evaluate"
    try:
        done = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown", "git not available"
    if done.returncode:
        return "unknown", "not a git checkout"
    return done.stdout.strip(), "HEAD of the working tree when the report was made"


def eval_prompts(value) -> list[dict] | None:
    """prompts.json as [{"prompt", "seed"}], or None when it is something else."""
    if isinstance(value, list) and all(isinstance(v, dict) and "prompt" in v for v in value):
        return value
    return None
