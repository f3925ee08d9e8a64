"""Loss masks (data.masks): which pixels of a training image the loss counts, cached beside its latent at latent
resolution.

A mask is white where the model should learn, black where it should not (a background, a watermark) and grey in
between. It comes from the image's alpha channel (`alpha`) or from a file beside the image, its stem plus
data.masks.suffix (`file`: `cat.jpg` + `cat_mask.png`). An image without one trains on every pixel. The mask goes
through the image's own resize, crop and flip (sdpipe.preprocess), then is averaged over each latent cell. It is
keyed by the image, that preprocessing, the source and the mask file's content: editing a mask recomputes that
mask alone, never a latent, and masks need no model, so they are computed in the stage's own process.
"""

from __future__ import annotations

from io import BytesIO
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

import numpy as np
from PIL import Image, ImageOps

from sdpipe import hashing, sources
from sdpipe.preprocess import Preprocess, cover_and_crop

if TYPE_CHECKING:
    import torch

CACHE_VERSION = 1  # bump when computing a mask changes its output for the same inputs
EXTENSIONS = (".png", ".webp", ".jpg", ".jpeg", ".bmp", ".tif", ".tiff")
SHARD_MASKS = 512  # masks per shard: a 128 x 128 fp16 mask is 32 KiB


def is_mask_file(rel: str, suffix: str) -> bool:
    """Whether a raw file is a mask (source `file`): prepare does not take it for a training image."""
    path = PurePosixPath(rel)
    return path.suffix.lower() in EXTENSIONS and path.stem.endswith(suffix)


def mask_file(image: Path, suffix: str) -> Path | None:
    return next((p for ext in EXTENSIONS if (p := image.with_name(image.stem + suffix + ext)).is_file()), None)


def origin(source: str, image: Path, suffix: str) -> dict:
    """What decides an image's mask besides its preprocessing: the source and, for `file`, the file and its hash."""
    found = mask_file(image, suffix) if source == "file" else None
    return {"source": source, "file": str(found) if found else None, "sha256": found and hashing.sha256_file(found)}


def key(image_id: str, pre: dict, where: dict, downsample: int) -> str:
    return hashing.key_of("mask", CACHE_VERSION, image_id, pre, where["source"], where["sha256"], downsample)


def _grey(job: dict) -> Image.Image | None:
    """The mask at the file's own size (mode L), or None where the image has none."""
    if job["source"] == "file" and job["mask_file"] is None:
        return None
    img = Image.open(BytesIO(sources.read_bytes(job["mask_file"] or job["file"])))  # a tar shard's member too
    img = ImageOps.exif_transpose(img)  # as the image's pixels were (sdpipe.images.load_rgb)
    if job["source"] == "file":
        return img.convert("L")
    if "A" not in img.getbands() and "transparency" not in img.info:
        return None
    return img.convert("RGBA").getchannel("A")


def compute(job: dict) -> torch.Tensor:
    """One mask [1, h, w] in [0, 1] (fp16) on the latent grid of the job's bucket."""
    import torch

    pre = job["pre"]
    p = Preprocess(**{**pre, "bucket": tuple(pre["bucket"]), "background": tuple(pre["background"])})
    (bw, bh), f = p.bucket, job["downsample"]
    grey = _grey(job)
    if grey is None:
        return torch.ones((1, bh // f, bw // f), dtype=torch.float16)
    if grey.size != tuple(job["size"]):  # a mask file drawn at another size covers the same picture
        grey = grey.resize(tuple(job["size"]), Image.Resampling.BILINEAR)
    cropped, _ = cover_and_crop(grey, p, job["id"])
    cells = cropped.resize((bw // f, bh // f), Image.Resampling.BOX)  # each latent cell's mean
    return torch.from_numpy(np.asarray(cells, dtype=np.float32) / 255.0)[None].to(torch.float16)


def write(store, jobs: list[dict]) -> list[dict]:
    """Compute and store the masks of `jobs` (field "mask" under each key); the failures, one reason each. A mask
    that cannot be read leaves its image out of training: training it unmasked would learn what the mask hides."""
    failed, done = [], {}
    for job in jobs:
        try:
            done[job["key"]] = {"mask": compute(job)}
        except (OSError, ValueError, Image.DecompressionBombError) as exc:
            reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
            failed.append({"id": job["id"], "path": job["path"], "reason": f"mask {job['mask_file']}: {reason}"})
        if len(done) >= SHARD_MASKS:
            store.write_shard(done)
            done = {}
    store.write_shard(done)
    return failed
