"""The report as data: sections of tables, figures and notes, rendered to HTML and to Markdown by render.py.

Every number that is a timing is a Cell with timing=True; both renderers mark it with TIMING, so a reader (and the
determinism test) can tell the values that change from run to run from those that must not.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

TIMING = "⏱"
LEGEND = (
    f"{TIMING} marks timings and the generation time: timings vary from run to run. Every other value and "
    "image is reproducible from the inputs."
)
NOT_AVAILABLE = "not available"


@dataclass
class Cell:
    text: str
    timing: bool = False


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Cell]]
    caption: str = ""
    kind: str = "table"


@dataclass
class Figure:
    src: str  # relative to the assets folder; each renderer prefixes the way from its own file to that folder
    caption: str
    lines: list[str] = field(default_factory=list)  # e.g. the prompts of a grid, one per row
    timing: bool = False
    kind: str = "figure"


@dataclass
class Note:
    text: str
    kind: str = "note"


@dataclass
class Section:
    title: str
    blocks: list = field(default_factory=list)


def is_timing(key: str, timings: frozenset[str] | set[str] = frozenset()) -> bool:
    """Whether a summary key holds a timing: listed by the producer (metrics.json "timings"), or named like one."""
    k = key.lower()
    return (
        key in timings
        or k in ("seconds", "time", "duration")
        or "per_s" in k
        or "per_second" in k
        or k.endswith(("_s", "_seconds", "_ms", "_time", "_duration"))
    )


def fmt(value) -> str:
    """One value as short, stable text (4 significant digits for floats)."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        return f"{value:,.0f}" if abs(value) >= 1e5 else f"{value:.4g}"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, list) and not value:
        return "none"
    if isinstance(value, list) and all(not isinstance(v, (dict, list)) for v in value):
        return ", ".join(fmt(v) for v in value)
    if isinstance(value, list):
        return f"{len(value)} entries"
    if isinstance(value, dict):
        return json.dumps(value, sort_keys=True, separators=(", ", ": "), default=str)
    return str(value)


def label(key: str) -> str:
    return LABELS.get(key, key.replace("_", " "))


LABELS = {
    "samples_per_s": "samples/s (steady)",
    "images_per_s": "images/s",
    "samples_per_s_per_gpu": "samples/s per GPU",
    "per_gpu_samples_per_s": "samples/s per GPU",
    "train_samples_per_s": "training samples/s (steady, after warm-up)",
    "train_warmup_s": "training warm-up (s)",
    "train_compile_s": "training compile (s)",
    "train_time_to_first_step_s": "stage start to first optimizer step (s)",
    "inference_samples_per_s": "inference images/s (after warm-up)",
    "inference_load_s": "inference model loading (s)",
    "inference_warmup_s": "inference warm-up (s)",
    "peak_memory_mb": "peak memory (MB)",
    "warmup_s": "warm-up (s)",
    "compile_s": "compile (s)",
    "time_to_first_step_s": "stage start to first step (s)",
    "world_size": "processes (world size)",
    "global_batch_size": "global batch size",
    "per_device_batch_size": "batch size per device",
    "grad_accum_steps": "gradient accumulation steps",
    "fid": "FID",
    "clip_score": "CLIP score",
    "colour_accuracy": "colour accuracy",
    "max_abs_diff": "max |diff|",
}


def kv_table(summary: dict, keys: list[str] | None = None, timings=frozenset(), caption: str = "") -> Table:
    """A two-column table of a summary dict: the keys listed (in that order) that it has, else all of them."""
    keys = [k for k in keys if k in summary] if keys is not None else sorted(summary)
    rows = [[Cell(label(k)), Cell(fmt(summary[k]), is_timing(k, timings))] for k in keys]
    return Table(["", "value"], rows, caption)


def missing(what: str, hint: str) -> Note:
    return Note(f"{what}: {NOT_AVAILABLE} ({hint})")
