"""Caption every image with the first captioner in the chain that yields one, cached per image.

The chain (caption.chain) is walked in order for each image: sidecar text, a template filled from the folder and
file name, BLIP, open_clip tags. Every result, an empty one included, is cached under <cache_dir>/captions by a
key made of the image id, the captioner and what decides its output (text, template, model parameters and weight
hashes), one small file per image, so a killed run loses only the batch in flight and a rerun picks up there.
"""

from __future__ import annotations

import logging
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import hashing, io, parallel
from sdpipe.records import CAPTIONS_VERSION, CaptionRow
from sdpipe.stages import image_file, read_upstream

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
CACHE_VERSION = 1  # bump when a captioner's output changes for the same inputs, so old entries are not reused
INPUTS = {"manifest": "results/prepare/manifest.jsonl"}
OUTPUTS = {"captions": "results/captions/captions.jsonl", "summary": "results/captions/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("caption", "prepare.alpha_background", "prepare.max_pixels")
NO_CAPTION = "no captioner in the chain yielded a caption"


@dataclass
class Item:
    row: dict
    caption: str | None = None
    source: str | None = None
    provenance: dict | None = None
    error: str | None = None  # the first model error, reported if no later captioner yields
    computed: bool = False  # a cache entry on this image's path was written in this run

    def accept(self, source: str, caption: str | None, provenance: dict) -> None:
        if caption:
            self.caption, self.source, self.provenance = caption, source, provenance


def caption_devices(cfg: Config) -> list[str]:
    """Devices for model captioning (a seam: tests force several CPU workers here)."""
    return parallel.devices_for(parallel.resolve_gpus(cfg.caption.gpus), 1)


def _free_step(cfg: Config, source: str, items: list[Item], root: Path) -> None:
    from sdpipe.captioners import free, read_cache, write_cache

    proposed = [(item, free.propose(source, cfg.caption.template, item.row)) for item in items]
    proposed = [
        (item, p, hashing.key_of(CACHE_VERSION, item.row["id"], source, p.key_inputs)) for item, p in proposed if p
    ]
    cached = read_cache(root, [key for _, _, key in proposed])
    new = []
    for item, proposal, key in proposed:
        if key not in cached:  # cheap to compute, but the cache says what changed since the last run
            new.append((key, source, proposal.caption))
            item.computed = True
        item.accept(source, proposal.caption, proposal.provenance)
    write_cache(root, new)


def _model_step(cfg: Config, source: str, items: list[Item], root: Path, used: list[str]) -> list[str]:
    """Look every item up; caption the misses on the caption devices. Return the devices used (or `used`)."""
    from sdpipe import captioners

    spec = captioners.describe(cfg, source, Path(cfg.cache_dir) / "weight-hashes.json")
    pixels = {"background": tuple(cfg.prepare.alpha_background), "max_pixels": cfg.prepare.max_pixels}
    misses: dict[str, list[Item]] = {}
    keys = [
        hashing.key_of(CACHE_VERSION, it.row["id"], source, spec.key_params, spec.weights_sha256, pixels)
        for it in items
    ]
    cached = captioners.read_cache(root, keys)
    for item, key in zip(items, keys):
        hit = cached.get(key)
        if hit is not None:
            item.accept(source, hit["caption"], spec.provenance)
        else:
            misses.setdefault(key, []).append(item)  # the same image twice is captioned once
    if not misses:
        return used
    devices = caption_devices(cfg)[: len(misses)]  # a device without work would only load the model
    log.info(
        "caption: %s for %d images on %s (%d cached)",
        source,
        len(misses),
        ",".join(devices),
        len(items) - sum(len(v) for v in misses.values()),
    )
    jobs = [
        {"key": key, "id": group[0].row["id"], "file": image_file(cfg, group[0].row)} for key, group in misses.items()
    ]
    parts = parallel.run_sharded(
        captioners.caption_worker,
        jobs,
        devices,
        f"captioning ({source})",
        spec=spec,
        cache_root=str(root),
        batch_size=cfg.caption.batch_size,
        pixels=pixels,
    )
    for result in (r for part in parts for r in part):
        for item in misses[result["key"]]:
            if result["error"]:
                item.error = item.error or result["error"]
                continue
            item.computed = True
            item.accept(source, result["caption"], spec.provenance)
    return devices


def caption_items(cfg: Config, rows: list[dict]) -> tuple[list[Item], list[str]]:
    """Walk the chain for every row; return the items and the devices model captioning used."""
    from sdpipe.captioners import FREE_SOURCES, free

    if "template" in cfg.caption.chain:
        free.template_fields(cfg.caption.template)  # a bad template fails before any work
    root = Path(cfg.cache_dir) / "captions.sqlite"
    items, devices = [Item(row) for row in rows], []
    # DreamBooth class images are captioned by their sidecar, the class prompt they were generated from, and
    # regularisation folders with a fixed caption by that caption.
    fixed = lambda item: item.row.get("role") == "class" or item.row.get("fixed_caption")
    _free_step(cfg, "sidecar", [item for item in items if fixed(item)], root)
    for source in cfg.caption.chain:
        todo = [item for item in items if item.caption is None and not fixed(item)]
        if not todo:
            break
        if source in FREE_SOURCES:
            _free_step(cfg, source, todo, root)
        else:
            devices = _model_step(cfg, source, todo, root, devices)
    return items, devices


def with_prefix(caption: str | None, prefix: str | None) -> str | None:
    """A data.concepts caption_prefix before the caption ("sks" + "a dog" -> "sks, a dog"), unless it starts so."""
    if not caption or not prefix or caption.startswith(prefix):
        return caption
    return f"{prefix}, {caption}"


def _output_row(item: Item) -> CaptionRow:
    row = item.row
    error = None if item.caption else (item.error or NO_CAPTION)
    return {
        "version": CAPTIONS_VERSION,
        "id": row["id"],
        "path": row["path"],
        "split": row.get("split"),
        "caption": with_prefix(item.caption, row.get("caption_prefix")),
        "source": item.source,
        "provenance": item.provenance,
        "error": error,
    }


def _summary(cfg: Config, items: list[Item], devices: list[str], seconds: float) -> dict:
    failed = sum(item.caption is None for item in items)
    captioned = sum(item.caption is not None and item.computed for item in items)
    return {
        "total": len(items),
        "captioned": captioned,
        "reused": len(items) - failed - captioned,
        "failed": failed,
        "by_source": dict(Counter(item.source for item in items if item.source)),
        "errors": sum(item.error is not None and item.caption is None for item in items),
        "chain": list(cfg.caption.chain),
        "devices": devices,
        "seconds": round(seconds, 3),
    }


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    rows = read_upstream(inputs["manifest"], "prepare")
    start = time.perf_counter()
    items, devices = caption_items(cfg, rows)
    summary = _summary(cfg, items, devices, time.perf_counter() - start)
    io.write_jsonl(outputs["captions"], (_output_row(item) for item in items))
    io.write_json(outputs["summary"], summary)
    log.info(
        "caption: %d captioned, %d reused, %d failed of %d (%s)",
        summary["captioned"],
        summary["reused"],
        summary["failed"],
        summary["total"],
        ", ".join(f"{k} {v}" for k, v in summary["by_source"].items()),
    )
    missed = [item for item in items if item.caption is None]
    if missed:  # left out of training by the latents stage: say which, and why, here where it happens
        shown = "; ".join(f"{item.row['path']}: {item.error or NO_CAPTION}" for item in missed[:3])
        more = f" (and {len(missed) - 3} more, with an error in {outputs['captions']})" if len(missed) > 3 else ""
        log.warning("caption: %d image(s) have no caption: %s%s", len(missed), shown, more)
    return summary
