"""The report's figure sections: training curves, throughput and scaling, sample grids.

Each writes its images into the assets folder under fixed names (so two reports of the same run are equal) and
returns a document.Section that refers to them relative to that folder.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe.report import grids, plots, sources
from sdpipe.report.document import Cell, Figure, Note, Section, Table, fmt, kv_table, missing
from sdpipe.report.sources import Sources

if TYPE_CHECKING:
    from sdpipe.config import Config

TRAIN_KEYS = [
    "mode",
    "device",
    "mixed_precision",
    "world_size",
    "per_device_batch_size",
    "grad_accum_steps",
    "global_batch_size",
    "optimizer_steps",
    "epochs",
    "samples_seen",
    "peak_memory_mb",
    "compile",
    "samples_per_s",
    "warmup_s",
    "compile_s",
    "time_to_first_step_s",
    "validation_and_checkpoint_s",
    "seconds",
]


def training(src: Sources, assets: Path) -> Section:
    section = Section("Training", [kv_table(src.data["train_summary"], TRAIN_KEYS, caption="training summary")])
    rows = src.data["train_metrics"]
    if not rows:
        section.blocks.append(Note(f"{src.paths['train_metrics']} has no rows: no step was logged"))
        return section
    plots.loss_lr(rows, assets / "loss_lr.png")
    section.blocks.append(Figure("loss_lr.png", f"loss and learning rate over {rows[-1]['step']} optimizer steps"))
    return section


def throughput(src: Sources, assets: Path) -> Section:
    section = Section("Throughput")
    rows = src.data["train_metrics"]
    if rows:
        plots.throughput(rows, assets / "throughput.png")
        section.blocks.append(
            Figure("throughput.png", "training samples/s and data-wait share per logged step", timing=True)
        )
    entries = src.data["metrics"].get("scaling")
    if not entries:
        section.blocks.append(Note("scaling: not available (evaluate measured no scaling runs)"))
        return section
    columns = ["gpus", "samples_per_s", "per_gpu_samples_per_s", "efficiency"]
    table = [
        [Cell(fmt(e.get("gpus")))] + [Cell(fmt(e.get(k)), True) for k in columns[1:]]
        for e in sorted(entries, key=lambda e: e["gpus"])
    ]  # efficiency is a ratio of timings: a timing too
    plots.scaling(entries, assets / "scaling.png")
    section.blocks += [
        Table(["GPUs", "samples/s", "samples/s per GPU", "efficiency"], table, "scaling"),
        Figure("scaling.png", "samples/s and efficiency against the GPU count; dashed: ideal", timing=True),
    ]
    return section


def samples(src: Sources, cfg: Config, assets: Path) -> Section:
    section = Section("Samples")
    v = cfg.train.validation
    if "samples_dir" in src.missing or not src.data["samples_dir"]:
        why = src.missing.get("samples_dir", f"no step-NNNNNNNN.png in {src.paths['samples_dir']}")
        section.blocks.append(missing("validation grids", f"{why}; train.validation.every = {v.every}"))
    else:
        (assets / "samples").mkdir()
    # Cells are validation.resolution ([height, width]) or, when unset, square buckets.
    aspect = v.resolution[1] / v.resolution[0] if v.resolution else 1.0
    for step, path in src.data.get("samples_dir") or []:
        name = f"samples/step-{step:08d}.png"
        labelled = grids.label_grid(path, assets / name, v.prompts, v.seeds, aspect)
        lines = [f"row {i + 1}: {p}" for i, p in enumerate(v.prompts)] + [f"columns: seeds {fmt(v.seeds)}"]
        if not labelled:
            lines.insert(0, f"the grid is not {len(v.prompts)} prompts x {len(v.seeds)} seeds: shown unlabelled")
        section.blocks.append(Figure(name, f"validation grid at step {step}", lines))
    section.blocks.append(_eval_grid(src, cfg, assets))
    return section


def eval_layout(prompts: list[dict]) -> tuple[list[str], list] | None:
    """(row prompts, column seeds) when prompts.json is in prompt-major grid order (as evaluate writes it)."""
    seeds = list(dict.fromkeys(p.get("seed") for p in prompts))
    rows = [p["prompt"] for p in prompts[:: len(seeds)]] if seeds else []
    if [(p["prompt"], p.get("seed")) for p in prompts] != [(r, s) for r in rows for s in seeds]:
        return None
    return rows, seeds


def _eval_grid(src: Sources, cfg: Config, assets: Path):
    if "eval_grid" in src.missing:
        return missing("evaluation images", src.missing["eval_grid"])
    out, caption = assets / "eval_grid.png", "evaluation images"
    prompts = sources.eval_prompts(src.data.get("eval_prompts"))
    layout = eval_layout(prompts) if prompts else None
    res = cfg.evaluate.resolution  # [height, width], or None for square bucket-sized images
    if layout and grids.label_grid(src.paths["eval_grid"], out, *layout, res[1] / res[0] if res else 1.0):
        lines = [f"row {i + 1}: {p}" for i, p in enumerate(layout[0])] + [f"columns: seeds {fmt(layout[1])}"]
        return Figure(out.name, caption, lines)
    shutil.copyfile(src.paths["eval_grid"], out)
    if prompts is None:
        why = src.missing.get("eval_prompts", f"{src.paths['eval_prompts']} is not a list of prompts")
        return Figure(out.name, caption, [f"prompts: not available ({why})"])
    lines = [f"image {i + 1}: {p['prompt']} (seed {fmt(p.get('seed'))})" for i, p in enumerate(prompts)]
    return Figure(out.name, f"{caption}, in grid order (left to right, top to bottom)", lines)
