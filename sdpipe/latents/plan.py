"""The latent cache's plan: every image's and caption's cache key, from their content and everything that decides
what encoding them gives (the preprocessing, the VAE's and text encoders' weights, the dtype). The stage
(stages/latents.py) encodes what the caches lack.
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Callable

from sdpipe import hashing
from sdpipe.errors import UserError
from sdpipe.latents import masks, tags
from sdpipe.preprocess import Preprocess, crop_box

if TYPE_CHECKING:
    from sdpipe.config import LatentsConfig

CACHE_VERSION = 1  # bump when encoding changes its output for the same inputs, so old entries are not reused


def check_buckets(rows: list[dict], factor: int) -> None:
    bad = sorted({tuple(r["bucket"]) for r in rows if r["bucket"][0] % factor or r["bucket"][1] % factor})
    if bad:
        raise UserError(
            f"bucket {bad[0][0]}x{bad[0][1]} is not divisible by {factor}, the model's downsampling (VAE "
            f"times UNet); set prepare.buckets.step to a multiple of {factor} (and the resolution too)"
        )


def text_key(caption: str, model: dict, dtype: str) -> str:
    return text_keyer(model, dtype)(caption)


def text_keyer(model: dict, dtype: str) -> Callable[[str], str]:
    """caption -> its text key, the model's parts serialised once."""
    return hashing.key_with(
        "text", CACHE_VERSION, hashing.SLOT, model["text_sha256"], model["variant"], dtype, model["family"]
    )


def plan(
    lat: LatentsConfig,
    background: tuple[int, ...],
    rows: list[dict],
    captions: dict[str, str | None],
    model: dict,
    file_of: Callable[[dict], str],
    mask_origin: Callable[[dict], dict] | None = None,
):
    """Return (items for the training index, image jobs, text jobs, failures) with every cache key filled in.

    `lat` is the latents section, `background` prepare.alpha_background, `captions` image id -> caption, `model`
    what describe_model found,
    `file_of` where a manifest row's image is, and `mask_origin` where its loss mask comes from (None: no masks;
    sdpipe.latents.masks). Mask jobs ("kind": "mask") are listed with the image jobs: both go to the latent store."""
    items, images, texts, failed = [], {}, {}, []

    @functools.cache  # one per bucket and flip, not one per image: 10^6 images share a few dozen
    def preprocess(bucket: tuple[int, int], flip: bool) -> tuple[Preprocess, dict, Callable[[str], str]]:
        p = Preprocess(
            bucket=bucket,
            resize=lat.resize,
            crop=lat.crop,
            interpolation=lat.interpolation,
            flip=flip,
            background=background,
        )
        pre = p.as_key()
        latent_key = hashing.key_with(
            "latent", CACHE_VERSION, hashing.SLOT, pre, model["vae_sha256"], model["variant"], lat.dtype
        )
        return p, pre, latent_key

    text_key_of = text_keyer(model, lat.dtype)
    # The empty caption too: training replaces a share of captions with it (caption dropout, for CFG).
    texts[text_key_of("")] = {"kind": "text", "key": text_key_of(""), "caption": ""}
    for row in rows:
        caption = captions.get(row["id"])
        if not caption:
            failed.append({"path": row["path"], "reason": "no caption (see results/captions/captions.jsonl)"})
            continue
        shuffled = tags.variants(caption, lat.tags)
        keys = [text_key_of(text) for text in shuffled]
        texts |= {key: {"kind": "text", "key": key, "caption": text} for key, text in zip(keys, shuffled)}
        caption_key = keys[0]
        item = {
            "id": row["id"],
            "path": row["path"],
            "role": row.get("role", "instance"),
            "loss_weight": row.get("loss_weight"),
            "bucket": row["bucket"],
            "repeats": row["repeats"],
            "caption": caption,
            "text_key": caption_key,
            "text_keys": keys if len(shuffled) > 1 else None,  # latents.tags: one drawn per sample and epoch
            "caption_variants": shuffled if len(shuffled) > 1 else None,
            "flip_key": None,
            "mask_key": None,
            "flip_mask_key": None,
            "original_size": [row["height"], row["width"]],
        }  # SDXL's size conditioning is (h, w)
        where = mask_origin(row) if mask_origin else None
        for flip in [False, True] if lat.flip else [False]:
            p, pre, latent_key = preprocess(tuple(row["bucket"]), flip)
            key = latent_key(row["id"])
            item["flip_key" if flip else "latent_key"] = key
            if not flip:
                (resized_w, _), top, left = crop_box(row["width"], row["height"], p, row["id"])
                item["crop_top_left"] = [top, left]
                # A flipped latent was cut at the mirrored position: SDXL conditions on that corner.
                item["flip_crop_top_left"] = [top, resized_w - left - row["bucket"][0]]
            images[key] = {
                "kind": "image",
                "key": key,
                "id": row["id"],
                "path": row["path"],
                "file": file_of(row),
                "pre": pre,
            }
            if where is not None:
                job = _mask_job(row, pre, where, model["vae_downsample"], file_of(row))
                item["flip_mask_key" if flip else "mask_key"] = job["key"]
                images[job["key"]] = job
        items.append(item)
    return items, list(images.values()), list(texts.values()), failed


def _mask_job(row: dict, pre: dict, where: dict, downsample: int, file: str) -> dict:
    return {
        "kind": "mask",
        "key": masks.key(row["id"], pre, where, downsample),
        "id": row["id"],
        "path": row["path"],
        "file": file,
        "mask_file": where["file"],
        "source": where["source"],
        "pre": pre,
        "size": [row["width"], row["height"]],
        "downsample": downsample,
    }
