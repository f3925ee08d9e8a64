"""Cache VAE latents and text embeddings for every training image, content-addressed and sharded.

Keys come from content: a latent from (image id, preprocessing, VAE weight hash, dtype), a text embedding from
(caption, text-encoder weight hashes, dtype). Only missing keys are computed, one plain process per GPU (no
process group, so no NCCL timeout), each writing its own shards as it goes.
"""

from __future__ import annotations

import logging
import os
import time
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io, latent_index, model_facts, parallel
from sdpipe.cache_store import ShardStore
from sdpipe.errors import UserError
from sdpipe.latents import masks
from sdpipe.latents.plan import check_buckets, plan, text_key
from sdpipe.records import LatentIndex
from sdpipe.stages import image_files, read_upstream

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {"manifest": "results/prepare/manifest.jsonl", "captions": "results/captions/captions.jsonl"}
OUTPUTS = {"index": "results/latents/index.json", "summary": "results/latents/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = (
    "latents",
    "model",
    "prepare.alpha_background",
    "prepare.max_pixels",
    "data.masks",
    "train.validation.heldout_every",
    "train.validation.heldout_images",
)


def describe_model(cfg: Config) -> dict:
    """Family, weight hashes and VAE facts, read from config files and weight hashes (no model is loaded)."""
    from sdpipe import weights
    from sdpipe.models import pipeline_index as loading

    m = cfg.model
    memo = Path(cfg.cache_dir) / "weight-hashes.json"
    local = str(loading.model_index(m.pretrained, m.revision)[0])  # one-line error if not a diffusers folder
    vae_cfg = io.read_json(Path(local) / "vae" / "config.json")  # read, not through diffusers: its import takes 6 s
    texts = loading.text_component_names(local)
    family = loading.family_of(local)
    tokenizers = [part.tokenizer for part in family.text_parts if part.encoder in texts]
    return {
        "pretrained": m.pretrained,
        "family": family.name,
        "vae_sha256": weights.weights_hash(local, "vae", memo_file=memo),
        # The tokenizer decides the embeddings as much as the encoder does, so both are in the text key.
        "text_sha256": {name: weights.weights_hash(local, name, memo_file=memo) for name in texts}
        | {tok: weights.weights_hash(local, tok, memo_file=memo, every_file=True) for tok in tokenizers},
        "scaling_factor": vae_cfg.get("scaling_factor", 0.18215),
        "shift_factor": vae_cfg.get("shift_factor"),
        "vae_downsample": 2 ** (len(vae_cfg["block_out_channels"]) - 1),
        "dtype": cfg.latents.dtype,
        "variant": m.variant,  # a variant loads other weight files than the hashes above may single out
    }


def heldout_rows(cfg: Config, manifest: list[dict]) -> list[dict]:
    """The eval images whose held-out loss training computes (train.validation.heldout_*): the first by id."""
    v = cfg.train.validation
    if not v.heldout_every:
        return []
    return sorted((r for r in manifest if r["split"] == "eval"), key=lambda r: r["id"])[: v.heldout_images]


def _fixed(lat):
    """The latents settings for held-out images: one caption and no flip, so each image's loss is one fixed thing."""
    import dataclasses

    return dataclasses.replace(lat, flip=False, tags=dataclasses.replace(lat.tags, shuffle=False, dropout=0.0))


# The manifest fields the plan reads: a row is held with these alone (10^6 rows).
MANIFEST_FIELDS = ("id", "path", "file", "role", "loss_weight", "bucket", "repeats", "height", "width", "split")


def _planned_fields(row: dict) -> dict:
    return {k: row[k] for k in MANIFEST_FIELDS if k in row}


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    manifest = read_upstream(inputs["manifest"], "prepare", keep=_planned_fields)
    rows = [r for r in manifest if r["split"] == "train"]
    captions = dict(read_upstream(inputs["captions"], "caption", keep=lambda c: (c["id"], c.get("caption"))))
    model = describe_model(cfg)
    check_buckets(rows, model_facts.bucket_multiple(*model_facts.configs(cfg, convert=True)))
    file_of = image_files(cfg)
    m = cfg.data.masks
    mask_origin = None if m.source == "none" else lambda row: masks.origin(m.source, Path(file_of(row)), m.suffix)
    background = tuple(cfg.prepare.alpha_background)
    items, image_jobs, text_jobs, failed = plan(cfg.latents, background, rows, captions, model, file_of, mask_origin)
    held = heldout_rows(cfg, manifest)
    eval_items, eval_images, eval_texts, eval_failed = plan(
        _fixed(cfg.latents), background, held, captions, model, file_of, mask_origin
    )
    known = {j["key"] for j in image_jobs + text_jobs}
    image_jobs += [j for j in eval_images if j["key"] not in known]
    text_jobs += [j for j in eval_texts if j["key"] not in known]

    root = Path(cfg.cache_dir)
    stores = {"image": ShardStore(root / "latents"), "text": ShardStore(root / "text")}
    for store in stores.values():
        store.set_aside_damaged()  # a damaged shard's entries are then missing, so encoded again
    have = {kind: set(store.scan()) for kind, store in stores.items()}
    todo = [j for j in image_jobs if j["key"] not in have["image"]] + [
        j for j in text_jobs if j["key"] not in have["text"]
    ]
    mask_jobs = [j for j in todo if j["kind"] == "mask"]
    todo = [j for j in todo if j["kind"] != "mask"]
    failed += masks.write(stores["image"], mask_jobs)
    mask_summary = _mask_summary(cfg, image_jobs, mask_jobs)
    gpus = parallel.resolve_gpus(cfg.latents.gpus)
    devices = parallel.devices_for(gpus, cfg.latents.cpu_processes)
    log.info(
        "latents: %d images and %d captions to encode on %s; %d latents and %d embeddings cached",
        sum(j["kind"] == "image" for j in todo),
        sum(j["kind"] == "text" for j in todo),
        ",".join(devices),
        sum(j["kind"] == "image" for j in image_jobs) - sum(j["kind"] == "image" for j in todo),
        len(text_jobs) - sum(j["kind"] == "text" for j in todo),
    )

    start = time.perf_counter()
    from sdpipe.latents.encode import encode

    settings = _worker_settings(cfg, root, len(devices))
    results = parallel.run_sharded(encode, todo, devices, "encoding", settings=settings) if todo else []
    seconds = time.perf_counter() - start
    worker_failed = [f for r in results for f in r["failed"]]
    wheres = {kind: store.compact() for kind, store in stores.items()}
    remotes = publish(cfg, stores)
    kept_eval = _heldout(eval_items, wheres, eval_failed + worker_failed) if held else None
    summary = _finish(
        cfg, outputs, model, items, todo, failed + worker_failed, wheres, devices, seconds, results, kept_eval
    )
    extra = {"masks": mask_summary} if mask_summary else {}
    if remotes:
        extra["remote"] = remotes
    if held:
        extra["heldout_images"] = len(kept_eval or [])
    if extra:
        io.write_json(outputs["summary"], summary | extra)
    return summary | extra


STORES = {"latent": "latents", "text": "text"}  # the index's name for a store -> its folder under cache_dir


def remote_stores(cfg: Config) -> dict[str, str] | None:
    """latents.remote's prefix of each store, as the index records them for training."""
    url = cfg.latents.remote
    return {kind: f"{url.rstrip('/')}/{folder}" for kind, folder in STORES.items()} if url else None


def publish(cfg: Config, stores: dict[str, ShardStore]) -> dict | None:
    """Upload the shards latents.remote lacks (sdpipe/remote_store.py); the counts per store, or None."""
    remotes = remote_stores(cfg)
    if not remotes:
        return None
    from sdpipe import remote_store

    by_kind = {"latent": stores["image"], "text": stores["text"]}
    return {kind: remote_store.publish(store.root, remotes[kind]) for kind, store in by_kind.items()}


def _steady_rate(results: list[dict]) -> float | None:
    """Images/s once every worker has its model loaded (and compiled) and its first batch written: what a large
    dataset sees. The whole-stage images_per_s includes start-up."""
    rates = [r["steady"]["images"] / r["steady"]["seconds"] for r in results if r["steady"]["seconds"] > 0]
    return round(sum(rates), 3) if rates else None


def _worker_settings(cfg: Config, root: Path, processes: int) -> dict:
    threads = cfg.latents.loader_threads or max(1, (os.cpu_count() or 1) // processes)
    from sdpipe import weights

    # The resolved folder, not the name: a spawned worker has no config loaded to convert a single file with.
    return {
        "pretrained": str(weights.resolve(cfg.model.pretrained, cfg.model.revision)),
        "revision": None,
        "variant": cfg.model.variant,
        "dtype": cfg.latents.dtype,
        "batch_size": cfg.latents.batch_size,
        "max_pixels": cfg.prepare.max_pixels,
        "latent_dir": str(root / "latents"),
        "text_dir": str(root / "text"),
        "loader_threads": threads,
        "compile": cfg.latents.compile,
    }


def _finish(
    cfg: Config, outputs, model, items, todo, failed, wheres, devices, seconds, results, eval_items=None
) -> dict:
    bad_paths = {f["path"] for f in failed}
    kept = [it for it in items if it["path"] not in bad_paths and _present(it, wheres)]
    encoded_ids = {j["id"] for j in todo if j["kind"] == "image"} - {f.get("id") for f in failed}
    encoded = len({it["id"] for it in kept} & encoded_ids)  # an image at two resolutions (also_at) counts once
    index: LatentIndex = {
        "version": latent_index.VERSION,
        "model": model,
        "latent_store": str(Path(cfg.cache_dir) / "latents"),
        "empty_text_key": text_key("", model, cfg.latents.dtype),
        "text_store": str(Path(cfg.cache_dir) / "text"),
        "remote_stores": remote_stores(cfg),
        "items": [],  # written row by row below: 10^6 items are never one JSON string in memory
        "failed": failed,
    }
    lists = {"items": kept} | ({"eval_items": eval_items} if eval_items is not None else {})
    io.write_json_streamed(outputs["index"], {k: v for k, v in index.items() if k not in lists}, lists)
    summary = {
        "items": len(kept),
        "encoded": encoded,
        "reused": len(kept) - encoded,
        "failed": len(failed),
        "devices": devices,
        "seconds": round(seconds, 3),
        "images_per_s": round(encoded / seconds, 3) if encoded and seconds > 0 else None,
        "images_per_s_after_warmup": _steady_rate(results),
        # What `latents.batch_size` resolved to on each device that encoded images (auto depends on free memory).
        "batch_sizes": {r["device"]: r["batch_size"] for r in results if r.get("batch_size")},
        "dtype": cfg.latents.dtype,
        "flip": cfg.latents.flip,
    }
    kept_text = {key for it in kept for key in it["text_keys"] or [it["text_key"]]}
    summary["text_encoded"] = len(kept_text & {j["key"] for j in todo if j["kind"] == "text"})
    summary["text_reused"] = len(kept_text) - summary["text_encoded"]
    io.write_json(outputs["summary"], summary)
    log.info(
        "latents: %d encoded, %d reused, %d failed (%s images/s)",
        encoded,
        summary["reused"],
        len(failed),
        summary["images_per_s"],
    )
    _say_what_failed(failed, outputs["index"], none_kept=not kept)
    return summary


def _present(item: dict, wheres: dict) -> bool:
    """Whether everything the item's samples read is in the stores."""
    return (
        item["latent_key"] in wheres["image"]
        and all(key in wheres["text"] for key in item["text_keys"] or [item["text_key"]])
        and all(item[k] is None or item[k] in wheres["image"] for k in ("flip_key", "mask_key", "flip_mask_key"))
    )


def _heldout(eval_items: list, wheres: dict, failed: list) -> list:
    """The held-out images that were encoded, for the index's "eval_items"."""
    bad = {f["path"] for f in failed}
    kept = [it for it in eval_items if it["path"] not in bad and _present(it, wheres)]
    if len(kept) < len(eval_items):
        log.warning("latents: %d held-out image(s) could not be encoded", len(eval_items) - len(kept))
    return kept


def _mask_summary(cfg: Config, image_jobs: list[dict], computed: list[dict]) -> dict | None:
    """The mask source, how many masks were computed this run and, for mask files, how many images have none
    (they train on every pixel)."""
    if cfg.data.masks.source == "none":
        return None
    jobs = [j for j in image_jobs if j["kind"] == "mask"]
    out = {"source": cfg.data.masks.source, "masks": len(jobs), "computed": len(computed)}
    if cfg.data.masks.source == "file":
        out["images_without_a_mask_file"] = len({j["id"] for j in jobs if j["mask_file"] is None})
        if out["images_without_a_mask_file"]:
            log.warning(
                "latents: %d image(s) have no mask file (<stem>%s.png beside them) and train on every pixel",
                out["images_without_a_mask_file"],
                cfg.data.masks.suffix,
            )
    return out


def _say_what_failed(failed: list[dict], index, none_kept: bool) -> None:
    """Name the images that could not be encoded (they are left out of training), and stop when none could."""
    if not failed:
        return
    shown = "; ".join(f"{f['path']}: {f['reason']}" for f in failed[:3])
    more = f' (and {len(failed) - 3} more, listed under "failed" in {index})' if len(failed) > 3 else ""
    if none_kept:
        raise UserError(f"no image could be encoded: {shown}{more}")
    log.warning("latents: %d image(s) left out of training: %s%s", len(failed), shown, more)
