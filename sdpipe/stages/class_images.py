"""Generate DreamBooth class images from the base model, spread over the GPUs (one plain process per GPU).

Image i is named by a key of everything that decides its pixels (base weights, prompt, seed, sampler settings),
so a rerun renders only what is missing or stale, and a kill loses only the batch in flight. Each image gets a
sidecar caption (the class prompt); prepare, caption and latents then treat the folder like any data.
"""

from __future__ import annotations

import logging
import re
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import hashing, io, parallel, weights
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS: dict[str, str] = {}
OUTPUTS = {"images": "results/class_images/images", "summary": "results/class_images/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("dreambooth", "model", "seed", "prepare.buckets.resolution")
NAME = re.compile(r"(\d{5})-([0-9a-f]{12})\.png")
VERSION = 1


def _settings(cfg: Config, device_kind: str) -> dict:
    d = cfg.dreambooth
    height, width = d.resolution or [cfg.prepare.buckets.resolution] * 2
    # The resolved folder, not the name: a spawned worker has no config loaded to convert a single file with.
    return {
        "pretrained": str(weights.resolve(cfg.model.pretrained, cfg.model.revision)),
        "revision": None,
        "variant": cfg.model.variant,
        "height": height,
        "width": width,
        "steps": d.steps,
        "guidance": d.guidance,
        "batch_size": d.batch_size,
        "half_on_gpu": device_kind == "cuda",
    }


def _key(cfg: Config, settings: dict, base_sha: str, index: int) -> str:
    pixels = {k: settings[k] for k in ("height", "width", "steps", "guidance", "variant", "half_on_gpu")}
    return hashing.key_of("class", VERSION, base_sha, cfg.dreambooth.class_prompt, cfg.seed, index, pixels)[:12]


def plan(cfg: Config, folder: Path, settings: dict, base_sha: str) -> tuple[list[dict], list[Path]]:
    """(jobs for missing images, stale files to delete); a file's key says whether it is still wanted."""
    wanted = {f"{i:05d}-{_key(cfg, settings, base_sha, i)}.png": i for i in range(cfg.dreambooth.num_class_images)}
    have = {p.name for p in folder.glob("*.png")} if folder.is_dir() else set()
    stale = [folder / n for n in sorted(have - set(wanted))]
    stale += [p.with_suffix(".txt") for p in stale if p.with_suffix(".txt").exists()]
    jobs = [
        {
            "index": i,
            "prompt": cfg.dreambooth.class_prompt,
            "seed": _seed(cfg.seed, i),
            "file": str(folder / name),
            "caption_file": str(folder / name.replace(".png", ".txt")),
        }
        for name, i in wanted.items()
        if name not in have or not (folder / name).with_suffix(".txt").exists()
    ]
    return jobs, stale


def _seed(seed: int, index: int) -> int:
    return int(hashing.key_of("class-seed", seed, index)[:8], 16)


def class_devices(cfg: Config) -> list[str]:
    """Devices to generate on (a seam: tests force several CPU workers here)."""
    return parallel.devices_for(parallel.resolve_gpus(cfg.dreambooth.gpus))


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    d = cfg.dreambooth
    if not d.enabled:
        raise UserError("dreambooth.enabled is false; class images are only generated for DreamBooth runs")
    devices = class_devices(cfg)
    settings = _settings(cfg, devices[0].split(":")[0])
    base_sha = weights.weights_hash(
        cfg.model.pretrained, revision=cfg.model.revision, memo_file=Path(cfg.cache_dir) / "weight-hashes.json"
    )
    folder = Path(outputs["images"])
    folder.mkdir(parents=True, exist_ok=True)
    jobs, stale = plan(cfg, folder, settings, base_sha)
    for path in stale:
        path.unlink()
    log.info(
        "class images: %d to generate, %d kept, %d stale removed, on %s",
        len(jobs),
        d.num_class_images - len(jobs),
        len(stale),
        ",".join(devices[: max(1, len(jobs))]),
    )
    from sdpipe.generate import generate

    start = time.perf_counter()
    generate(jobs, devices, "class images", settings)
    summary = {
        "prompt": d.class_prompt,
        "images": d.num_class_images,
        "generated": len(jobs),
        "kept": d.num_class_images - len(jobs),
        "stale_removed": len([p for p in stale if p.suffix == ".png"]),
        "devices": devices[: max(1, len(jobs))],
        "seconds": round(time.perf_counter() - start, 3),
        "settings": settings,
        "base_sha256": base_sha,
    }
    io.write_json(outputs["summary"], summary)
    return summary
