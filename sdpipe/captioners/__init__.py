"""Captioners and their per-image cache.

The free captioners (sidecar, template; see free.py) run inline. A model captioner (blip.py, clip_tags.py) is
first *described* in the parent process: its weights are found offline and hashed, so every cache key is known
before any model loads, and a model whose images are all cached is never loaded. Workers then load it from that
description, one process per device, and write each image's cache entry as soon as its batch is done.

Each module of a model captioner provides describe(cfg, memo_file) -> ModelSpec and load(spec, device) ->
a function from a list of RGB images to a list of captions (None where it yields nothing).
"""

from __future__ import annotations

import functools
import importlib
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.kvstore import KVStore

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)

FREE_SOURCES = ("sidecar", "template")
MODEL_SOURCES = ("blip", "clip_tags")

CaptionFn = Callable[[list], list]


@dataclass(frozen=True)
class ModelSpec:
    source: str
    local: str  # the resolved weights: a folder or a checkpoint file
    weights_sha256: str
    key_params: dict  # everything besides the image and the weights that decides the output
    provenance: dict  # recorded with every caption this model makes
    load_args: dict  # what load() needs beyond `local`


def _module(source: str):
    return importlib.import_module(f"sdpipe.captioners.{source}")


def describe(cfg: Config, source: str, memo_file: str | Path | None) -> ModelSpec:
    return _module(source).describe(cfg, memo_file)


def clean_caption(text: str | None) -> str | None:
    text = " ".join((text or "").split())
    return text or None


def one_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {lines[0]}" if lines else type(exc).__name__


# --- the cache: one SQLite file (sdpipe/kvstore.py), key -> {"key", "source", "caption"} -------------------------

TABLE = "captions"


@functools.cache
def cache(db: str | Path) -> KVStore:
    """The caption cache at `db`; the first open imports the entries of the folder of JSON files that sdpipe kept
    before (<cache_dir>/captions/), so no model caption is computed twice."""
    store = KVStore(db, (TABLE,))
    legacy = Path(db).with_suffix("")
    if legacy.is_dir() and not store.count(TABLE):
        _import_legacy(store, legacy)
    return store


def _import_legacy(store: KVStore, folder: Path) -> None:
    entries = []
    for path in folder.glob("??/*.json"):
        try:
            entry = io.read_json(path)
        except (OSError, ValueError):
            continue  # unreadable: a miss, computed again
        if isinstance(entry, dict) and "caption" in entry and "key" in entry:
            entries.append((entry["key"], entry))
    store.put_many(TABLE, entries)
    log.info(
        "caption cache: %d entries imported from %s into %s (the folder can be deleted)",
        len(entries),
        folder,
        store.path,
    )


def read_cache(db: str | Path, keys: list[str]) -> dict[str, dict]:
    """The cached entries among `keys`; an unreadable entry is a miss, simply recomputed."""
    return {k: v for k, v in cache(db).get_many(TABLE, keys).items() if isinstance(v, dict) and "caption" in v}


def write_cache(db: str | Path, entries: list[tuple[str, str, str | None]]) -> None:
    """(key, source, caption) entries, in one transaction. An empty result is cached too, so a model that found
    nothing to say is not asked again."""
    cache(db).put_many(TABLE, [(key, {"key": key, "source": src, "caption": cap}) for key, src, cap in entries])


# --- the worker: one process per device (run by sdpipe.parallel.run_sharded) ----------------------------------


def caption_worker(
    device: str,
    jobs: list[dict],
    report: Callable[[int], None],
    *,
    spec: ModelSpec,
    cache_root: str,
    batch_size: int,
    pixels: dict,
) -> list[dict]:
    """Caption jobs ({"key", "file", "id"}) in batches; return {"key", "caption", "error"} for each, in order.

    `pixels` holds load_checked's background and max_pixels, so a model sees what prepare validated.
    """
    model = _load(spec, device)
    results: list[dict] = []
    for start in range(0, len(jobs), batch_size):
        batch = jobs[start : start + batch_size]
        results += _caption_batch(model, spec.source, batch, cache_root, pixels)
        report(len(batch))
    return results


def _load(spec: ModelSpec, device: str) -> CaptionFn:
    try:
        return _module(spec.source).load(spec, device)
    except (OSError, ValueError, RuntimeError, KeyError) as exc:
        raise UserError(f"cannot load the {spec.source} model {spec.provenance.get('model')}: {one_line(exc)}") from exc


def _caption_batch(model: CaptionFn, source: str, batch: list[dict], cache_root: str, pixels: dict) -> list[dict]:
    from sdpipe.images import ImageRejected, load_checked

    out: dict[str, dict] = {}
    images, loaded = [], []
    for job in batch:
        try:
            images.append(load_checked(job["file"], job["id"], **pixels))
            loaded.append(job)
        except (ImageRejected, OSError) as exc:
            out[job["key"]] = {"key": job["key"], "caption": None, "error": f"{source}: cannot read image: {exc}"}
    done = []
    for job, (caption, error) in zip(loaded, _run_model(model, images)):
        if error is None:
            done.append((job["key"], source, caption))
        out[job["key"]] = {"key": job["key"], "caption": caption, "error": f"{source}: {error}" if error else None}
    write_cache(cache_root, done)  # each batch as it is done: a crash loses the batch in flight
    return [out[job["key"]] for job in batch]


def _run_model(model: CaptionFn, images: list) -> list[tuple[str | None, str | None]]:
    """(caption, error) per image. If the batch fails, retry image by image so only the culprit fails."""
    if not images:
        return []
    try:
        return [(clean_caption(c), None) for c in model(images)]
    except Exception as exc:  # noqa: BLE001 - one bad image must not fail the stage
        if len(images) == 1:
            return [(None, one_line(exc))]
    return [pair for image in images for pair in _run_model(model, [image])]
