"""Evaluate the exported model: fixed prompts x seeds rendered across the GPUs, then FID against the held-out real
images, CLIP score, (on the demo) prompt-colour accuracy, and speed.

Quality metrics are never stand-ins: without their weights they are null with the reason and the fix. Numbers
that are timings are listed under "timings" in metrics.json, since they vary from run to run; everything else is
the same on a rerun of the same config on a CPU.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io, parallel
from sdpipe.errors import UserError
from sdpipe.evaluate import sampling
from sdpipe.stages import image_file, read_upstream

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {
    "model": "results/export/diffusers",
    "manifest": "results/prepare/manifest.jsonl",
    "train_summary": "results/train/summary.json",
    "scaling": "results/benchmark/scaling.json",
}
OUTPUTS = {"metrics": "results/evaluate/metrics.json", "samples": "results/evaluate/samples"}
# The config keys the outputs depend on (stages/declared.py).
READS = (
    "evaluate",
    "seed",
    "benchmark.gpu_counts",
    "prepare.buckets",
    "train.prediction_type",
)
TIMINGS = [
    "train_samples_per_s",
    "train_warmup_s",
    "train_compile_s",
    "train_time_to_first_step_s",
    "inference_samples_per_s",
    "inference_load_s",
    "inference_warmup_s",
    "scaling",
]


def jobs_for(cfg: Config, folder: Path) -> list[dict]:
    """One image per (prompt, seed): the grid's row is the prompt, its column the seed."""
    e = cfg.evaluate
    return [
        {"index": p * len(e.seeds) + s, "prompt": prompt, "seed": seed, "file": str(folder / f"{p:03d}-{s:02d}.png")}
        for p, prompt in enumerate(e.prompts)
        for s, seed in enumerate(e.seeds)
    ]


def real_images(cfg: Config, manifest: Path) -> list[dict]:
    return [r for r in read_upstream(manifest, "prepare") if r["split"] == "eval" and r.get("role") != "class"]


def preflight(cfg: Config, inputs: dict, n_fake: int) -> list[dict]:
    """Everything that can be wrong, before any image is rendered; return the eval split's rows."""
    from sdpipe.evaluate.fid import check_fid_split

    if not (Path(inputs["model"]) / "model_index.json").is_file():
        raise UserError(f"no exported model at {inputs['model']}; run `snakemake export` first")
    rows = real_images(cfg, Path(inputs["manifest"]))
    f = cfg.evaluate.fid
    if f.enabled:
        check_fid_split(None if f.reference_stats else len(rows), n_fake)
    return rows


def render(cfg: Config, model: Path, folder: Path) -> tuple[list[dict], dict]:
    if folder.exists():
        shutil.rmtree(folder)  # a rerun renders everything again: no image of an older model may remain
    folder.mkdir(parents=True)
    e = cfg.evaluate
    height, width = e.resolution or [cfg.prepare.buckets.resolution] * 2
    jobs, devices = jobs_for(cfg, folder), eval_devices(cfg)
    on_gpu = devices[0].startswith("cuda")
    settings = {
        "pretrained": str(model),
        "revision": None,
        "variant": None,
        "height": height,
        "width": width,
        "steps": e.steps,
        "guidance": e.guidance,
        "batch_size": sampling.batch_size(e.batch_size, on_gpu, height, width),
        "half_on_gpu": True,
        "prediction_type": cfg.train.prediction_type,
        "compile": sampling.compile_mode(e.compile, on_gpu, len(jobs) / len(devices)),
    }
    from sdpipe.generate import generate

    return jobs, generate(jobs, devices, "evaluation images", settings)


def eval_devices(cfg: Config) -> list[str]:
    """Devices to render on (a seam: tests force several CPU workers here)."""
    return parallel.devices_for(parallel.resolve_gpus(cfg.evaluate.gpus))


def quality(cfg: Config, images: list, prompts: list[str], real_rows: list[dict], device: str) -> dict:
    from sdpipe.evaluate import clip_score, fid, unavailable
    from sdpipe.images import load_rgb

    e, out = cfg.evaluate, {}
    if e.fid.enabled:
        real = None if e.fid.reference_stats else [load_rgb(image_file(cfg, r)) for r in real_rows]
        out["fid"] = fid.fid(images, real, e.fid.reference_stats, e.fid.inception_weights, device=device)
    else:
        out["fid"] = unavailable("evaluate.fid.enabled is false")
    if e.clip_score.enabled:
        out["clip_score"] = clip_score.clip_score(images, prompts, e.clip_score, device=device)
    else:
        out["clip_score"] = unavailable("evaluate.clip_score.enabled is false")
    out["colour_accuracy"] = colour_accuracy(images, prompts)
    return out


def colour_accuracy(images: list, prompts: list[str]) -> dict:
    """On the demo's colour prompts: the share of images whose shape has the prompt's colour."""
    from sdpipe.demo import COLOURS
    from sdpipe.demo.colours import colour_accuracy as accuracy
    from sdpipe.evaluate import measured, unavailable

    names = lambda prompt: [c for c in COLOURS if c in prompt.lower().split()]
    if not all(len(names(p)) == 1 for p in prompts):
        return unavailable("only for prompts that each name one demo colour (the embedded demo)")
    return measured(accuracy(images, prompts), n=len(images))


def provenance(cfg: Config) -> dict:
    from sdpipe.provenance import git_state, gpu_facts, package_versions

    commit, dirty = git_state()
    return {
        "git_commit": commit,
        "git_dirty": dirty,
        "gpu": gpu_facts(),
        "packages": package_versions(),
        "seeds": {"seed": cfg.seed, "evaluate.seeds": list(cfg.evaluate.seeds)},
    }


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    from PIL import Image

    n_fake = len(cfg.evaluate.prompts) * len(cfg.evaluate.seeds)
    real_rows = preflight(cfg, inputs, n_fake)
    folder = Path(outputs["samples"])
    jobs, speed = render(cfg, Path(inputs["model"]), folder)
    images = [Image.open(j["file"]).convert("RGB") for j in jobs]
    prompts = [j["prompt"] for j in jobs]
    device = parallel.devices_for(min(1, parallel.resolve_gpus(cfg.evaluate.gpus)))[0]
    metrics = quality(cfg, images, prompts, real_rows, device)
    train = io.read_json(inputs["train_summary"]) if Path(inputs["train_summary"]).is_file() else {}
    scaling = Path(inputs["scaling"]) if cfg.benchmark.gpu_counts else None  # only a benchmark of this config
    metrics.update(
        train_samples_per_s=train.get("samples_per_s"),
        train_warmup_s=train.get("warmup_s"),
        train_compile_s=train.get("compile_s"),
        train_time_to_first_step_s=train.get("time_to_first_step_s"),
        inference_samples_per_s=speed["images_per_s"],
        inference_load_s=speed["load_s"],
        inference_warmup_s=speed["warmup_s"],
        scaling=io.read_json(scaling)["scaling"] if scaling else None,
        timings=TIMINGS,
        images=n_fake,
        provenance=provenance(cfg),
    )
    write_grid(images, jobs, cfg, folder)
    io.write_json(outputs["metrics"], metrics)
    log.info(
        "evaluate: fid %s, clip_score %s, colour accuracy %s; %s images/s after warm-up (model loading %s s, "
        "warm-up %s s)",
        _show(metrics["fid"]),
        _show(metrics["clip_score"]),
        _show(metrics["colour_accuracy"]),
        speed["images_per_s"],
        speed["load_s"],
        speed["warmup_s"],
    )
    return metrics


def _show(result: dict) -> str:
    return f"{result['value']:.4g}" if result["value"] is not None else f"null ({result['reason']})"


def write_grid(images: list, jobs: list[dict], cfg: Config, folder: Path) -> None:
    """grid.png (rows = prompts, columns = seeds) and prompts.json, for the report."""
    from sdpipe.train.validation import grid

    cols = len(cfg.evaluate.seeds)
    with io.atomic_path(folder / "grid.png") as tmp:
        grid(images, len(images) // cols, cols).save(tmp, "PNG")
    io.write_json(folder / "prompts.json", [{"prompt": j["prompt"], "seed": j["seed"]} for j in jobs])
