"""The latent-caching worker: one per device, spawned by sdpipe.parallel.run_sharded.

It loads the VAE and the text encoder(s) once, encodes its share in batches (images grouped by bucket, so a batch
has one shape) and writes one shard per batch, so a crash or kill loses only the batch in flight.
"""

from __future__ import annotations

import logging
import time
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sdpipe import images
from sdpipe.cache_store import ShardStore
from sdpipe.preprocess import Preprocess, cover_and_crop, to_model_range, to_uint8

log = logging.getLogger(__name__)
DTYPES = {"fp32": "float32", "fp16": "float16", "bf16": "bfloat16"}


def _dtype(name: str):
    import torch

    return getattr(torch, DTYPES[name])


def encode(device: str, jobs: list[dict], report, settings: dict) -> dict:
    failed, steady, batch = [], {"images": 0, "seconds": 0.0}, None
    image_jobs = [j for j in jobs if j["kind"] == "image"]
    text_jobs = [j for j in jobs if j["kind"] == "text"]
    if image_jobs:
        failed, steady, batch = _encode_images(device, image_jobs, report, settings)
    if text_jobs:
        configured = CPU_BATCH if settings["batch_size"] == "auto" else settings["batch_size"]
        _encode_texts(device, text_jobs, report, {**settings, "batch_size": batch or configured})
    return {"device": device, "failed": failed, "steady": steady, "batch_size": batch}


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
            yield group[i : i + size]


def _load_pixels(job: dict, settings: dict):
    pre = job["pre"]
    p = Preprocess(**{**pre, "bucket": tuple(pre["bucket"]), "background": tuple(pre["background"])})
    img = images.load_checked(Path(job["file"]), job["id"], p.background, settings["max_pixels"])
    return to_uint8(cover_and_crop(img, p, job["id"])[0])


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
    return loading.load_vae(
        settings["pretrained"], settings["revision"], settings["variant"], dtype=compute, device=device
    ), compute


# On an H200 compiling SD 1.5's encoder costs 20-28 s and then encodes 381-410 images/s against eager's 184
# (benchmarks/NOTES.md v5, v7, v11): it pays from about 7,000-10,000 images per process on.
COMPILE_MIN_IMAGES = 8000


# Plain bmm + softmax attention materialises the scores: allowed up to this many bytes per batch. 8 GiB admits
# batch 64 at 512 px (6.4 GB; its whole encoder peaked at 20.3 GiB, NOTES v10), what `batch_size: auto` picks on
# large GPUs; at 4 GiB that batch had fallen back to SDPA, unlike the bare encoder it was measured against.
MATH_ATTENTION_BYTES = 8 * 2**30


def _encoder(vae, device: str, mode: str, batch_size: int, jobs: list[dict]):
    """pixels -> posterior means. `latents.compile: auto` compiles the encoder, channels-last, when a GPU has
    enough images to encode for the compile time to pay; a CPU always runs eager. A short batch (a bucket's tail)
    is padded to the full batch size, so only a new bucket shape compiles again."""
    import torch

    worth_it = device.startswith("cuda") and len(jobs) >= COMPILE_MIN_IMAGES
    if mode == "eager" or (mode == "auto" and not worth_it):
        return lambda x: vae.encode(x).latent_dist.mean
    from sdpipe.models.layout import channels_last_for_compile

    # Each measured on an H200 (benchmarks/NOTES.md v4): the channels-last layers, with GroupNorm statistics per
    # channel (+15 %); the mid-block's single 512-wide attention head as plain bmm + softmax (+7 %), where its
    # scores fit in memory (SD-sized images; 1024 px buckets keep SDPA's memory-efficient kernel).
    if _math_attention_fits(vae, batch_size, jobs):
        from diffusers.models.attention_processor import AttnProcessor

        vae.set_attn_processor(AttnProcessor())
    # cuDNN's autotuner: a padded batch has one shape per bucket, so it tunes once per bucket.
    torch.backends.cudnn.benchmark = True
    vae.encoder = torch.compile(channels_last_for_compile(vae.encoder))

    def encode(x):
        n = len(x)
        if n < batch_size:
            x = torch.cat([x, x[-1:].expand(batch_size - n, *x.shape[1:])])
        return vae.encode(x.contiguous(memory_format=torch.channels_last)).latent_dist.mean[:n]

    return encode


# `latents.batch_size: auto`. SD's encoder at 512 px in bf16 peaked at 10.2 GiB at batch 32 and 20.3 at 64 on an
# H200; the bare encoder ran 415.8 images/s at 64 against 393.7 at 32 (benchmarks/NOTES.md v10), the stage 402-410
# against 382.0 (v11). Larger batches are unmeasured.
CPU_BATCH = 8
AUTO_BATCHES = (64, 32, 16, 8, 4, 2, 1)
ENCODER_GIB_PER_MEGAPIXEL = 20.3 / 64 / 0.25  # bf16; float32 activations take twice that
AUTO_MEMORY_SHARE = 0.8


def batch_size(requested, device: str, compute_dtype, jobs: list[dict]) -> int:
    """The configured batch, or for `auto` the largest of AUTO_BATCHES whose activations at the largest bucket
    fit in AUTO_MEMORY_SHARE of the GPU's free memory (the model is loaded already)."""
    import torch

    if requested != "auto":
        return requested
    if not device.startswith("cuda"):
        return CPU_BATCH
    free, _ = torch.cuda.mem_get_info(torch.device(device))
    megapixels = max(j["pre"]["bucket"][0] * j["pre"]["bucket"][1] for j in jobs) / 2**20
    per_image = ENCODER_GIB_PER_MEGAPIXEL * megapixels * 2**30 * (2 if compute_dtype == torch.float32 else 1)
    return next((b for b in AUTO_BATCHES if b * per_image <= AUTO_MEMORY_SHARE * free), 1)


def _math_attention_fits(vae, batch_size: int, jobs: list[dict]) -> bool:
    """bf16 scores plus their float32 softmax, batch x tokens^2 x 6 bytes, for the largest bucket."""
    factor = 2 ** (len(vae.config.block_out_channels) - 1)
    tokens = max((job["pre"]["bucket"][0] // factor) * (job["pre"]["bucket"][1] // factor) for job in jobs)
    return batch_size * tokens**2 * 6 <= MATH_ATTENTION_BYTES


def _to_host(t):
    """Start copying `t` to the host; return (tensor, event). The caller waits on the event only when it writes,
    so the GPU encodes the next batch meanwhile."""
    import torch

    if t.device.type != "cuda":
        return t, None
    host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    host.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    return host, done


class _Clock:
    """Images/s after the first written batch: compiling and loading the model stay out of the steady rate."""

    def __init__(self):
        self.first, self.last, self.images = None, None, 0

    def written(self, n: int) -> None:
        now = time.perf_counter()
        if self.first is None:
            self.first = now
        else:
            self.images += n
        self.last = now

    def result(self) -> dict:
        seconds = (self.last - self.first) if self.first is not None else 0.0
        return {"images": self.images, "seconds": seconds}


def _write(store, ok: list, means, clock: _Clock) -> None:
    host, done = means
    if done is not None:
        done.synchronize()
    store.write_shard({job["key"]: {"latent": m} for (job, _), m in zip(ok, host)})
    clock.written(len(ok))


def _encode_images(device: str, jobs: list[dict], report, settings: dict) -> tuple[list[dict], dict, int]:
    import torch

    vae, compute = _load_vae(device, settings)
    size = batch_size(settings["batch_size"], device, compute, jobs)
    log.info("latents on %s: batch %d (latents.batch_size: %s)", device, size, settings["batch_size"])
    settings = {**settings, "batch_size": size}
    encode = _encoder(vae, device, settings.get("compile", "auto"), size, jobs)
    store, failed, store_dtype = ShardStore(settings["latent_dir"]), [], _dtype(settings["dtype"])
    pending, clock = None, _Clock()
    for batch, loaded in _prefetched(jobs, settings):
        ok = [(job, px) for job, px in zip(batch, loaded) if not isinstance(px, Exception)]
        failed += [
            {"id": j["id"], "path": j["path"], "reason": str(px)}
            for j, px in zip(batch, loaded)
            if isinstance(px, Exception)
        ]
        current = None
        if ok:
            with torch.no_grad():
                x = to_model_range(torch.stack([px for _, px in ok]), device, compute)
                current = (ok, _to_host(encode(x).to(store_dtype)))
        if pending:  # written while the device encodes `current`: one shard per batch, as before
            _write(store, *pending, clock)
        pending = current
        report(len(batch))
    if pending:
        _write(store, *pending, clock)
    return failed, clock.result(), size


def _encode_texts(device: str, jobs: list[dict], report, settings: dict) -> None:
    from sdpipe.models import loading

    compute = _compute_dtype(device, settings["dtype"])
    stack = loading.load_text_stack(
        settings["pretrained"], settings["revision"], settings["variant"], dtype=compute, device=device
    )
    store, store_dtype = ShardStore(settings["text_dir"]), _dtype(settings["dtype"])
    size = settings["batch_size"] * 4  # text encoding is cheap per item
    for i in range(0, len(jobs), size):
        batch = jobs[i : i + size]
        out = stack.encode([j["caption"] for j in batch])
        store.write_shard(
            {job["key"]: {name: t[n].to(store_dtype) for name, t in out.items()} for n, job in enumerate(batch)}
        )
        report(len(batch))
