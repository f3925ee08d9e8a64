"""The latent-caching worker: one per device, spawned by sdpipe.parallel.run_sharded.

It loads the VAE and the text encoder(s) once, encodes its share in batches (images grouped by bucket, so a batch
has one shape) and writes one shard per batch, so a crash or kill loses only the batch in flight.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sdpipe import images
from sdpipe.cache_store import ShardStore
from sdpipe.preprocess import Preprocess, cover_and_crop, to_tensor

log = logging.getLogger(__name__)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def encode(device: str, jobs: list[dict], report, settings: dict) -> dict:
    failed = []
    image_jobs = [j for j in jobs if j["kind"] == "image"]
    text_jobs = [j for j in jobs if j["kind"] == "text"]
    if image_jobs:
        failed += _encode_images(device, image_jobs, report, settings)
    if text_jobs:
        _encode_texts(device, text_jobs, report, settings)
    return {"device": device, "failed": failed}


def _compute_dtype(device: str, store_dtype: str, force_upcast: bool = False):
    import torch

    # CPUs lack fast half kernels, and SDXL's VAE overflows in fp16: compute in fp32 there, store as configured.
    if device == "cpu" or (force_upcast and store_dtype == "fp16"):
        return torch.float32
    return _dtype(store_dtype)


def _batches(jobs: list[dict], size: int):
    by_bucket = defaultdict(list)
    for job in jobs:
        by_bucket[tuple(job["pre"]["bucket"])].append(job)
    for bucket in sorted(by_bucket):
        group = by_bucket[bucket]
        for i in range(0, len(group), size):
            yield group[i:i + size]


def _load_pixels(job: dict, settings: dict):
    pre = job["pre"]
    p = Preprocess(**{**pre, "bucket": tuple(pre["bucket"]), "background": tuple(pre["background"])})
    img = images.load_checked(Path(job["file"]), job["id"], p.background,
                              settings["max_pixels"])
    return to_tensor(cover_and_crop(img, p, job["id"])[0])


def _try_load(job: dict, settings: dict):
    try:
        return _load_pixels(job, settings)
    except (OSError, images.ImageRejected) as exc:
        return exc


def _prefetched(jobs: list[dict], settings: dict, depth: int = 2):
    """Yield (batch, pixels-or-errors), decoding the next batches in threads while the device encodes this one.

    Decoding and resizing are CPU work that Pillow does outside the GIL, so threads keep a fast GPU fed.
    """
    batches = list(_batches(jobs, settings["batch_size"]))
    with ThreadPoolExecutor(settings.get("loader_threads", 4)) as pool:
        pending = [[pool.submit(_try_load, j, settings) for j in b] for b in batches[:depth]]
        for i, batch in enumerate(batches):
            if i + depth < len(batches):
                pending.append([pool.submit(_try_load, j, settings) for j in batches[i + depth]])
            yield batch, [f.result() for f in pending[i]]
            pending[i] = None  # free the decoded pixels


def _load_vae(device: str, settings: dict):
    from diffusers import AutoencoderKL

    from sdpipe.models import loading

    root, _ = loading.model_index(settings["pretrained"], settings["revision"])  # local folder, never a download
    vae_cfg = AutoencoderKL.load_config(str(root), subfolder="vae")
    compute = _compute_dtype(device, settings["dtype"], vae_cfg.get("force_upcast", False))
    return loading.load_vae(settings["pretrained"], settings["revision"], settings["variant"], dtype=compute,
                            device=device), compute


def _encode_images(device: str, jobs: list[dict], report, settings: dict) -> list[dict]:
    import torch

    vae, compute = _load_vae(device, settings)
    store, failed, store_dtype = ShardStore(settings["latent_dir"]), [], _dtype(settings["dtype"])
    for batch, loaded in _prefetched(jobs, settings):
        ok = [(job, px) for job, px in zip(batch, loaded) if not isinstance(px, Exception)]
        failed += [{"id": j["id"], "path": j["path"], "reason": str(px)} for j, px in zip(batch, loaded)
                   if isinstance(px, Exception)]
        if ok:
            with torch.no_grad():
                x = torch.stack([px for _, px in ok]).to(device=device, dtype=compute)
                mean = vae.encode(x).latent_dist.mean  # [B, C, H/f, W/f]
            store.write_shard({job["key"]: {"latent": m.to(store_dtype)} for (job, _), m in zip(ok, mean)})
        report(len(batch))
    return failed


def _encode_texts(device: str, jobs: list[dict], report, settings: dict) -> None:
    from sdpipe.models import loading

    compute = _compute_dtype(device, settings["dtype"])
    stack = loading.load_text_stack(settings["pretrained"], settings["revision"], settings["variant"],
                                    dtype=compute, device=device)
    store, store_dtype = ShardStore(settings["text_dir"]), _dtype(settings["dtype"])
    size = settings["batch_size"] * 4  # text encoding is cheap per item
    for i in range(0, len(jobs), size):
        batch = jobs[i:i + size]
        out = stack.encode([j["caption"] for j in batch])
        store.write_shard({job["key"]: {name: t[n].to(store_dtype) for name, t in out.items()}
                           for n, job in enumerate(batch)})
        report(len(batch))
