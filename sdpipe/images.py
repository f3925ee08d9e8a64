"""Decode an image fully and normalise it to 8-bit RGB, the same way in every stage.

prepare uses this to validate (so a bad file is rejected once, with a reason), and captioning and latent caching
use it to read pixels, so what was validated is exactly what gets encoded.
"""

from __future__ import annotations

import io
from pathlib import Path

import numpy as np
from PIL import Image, ImageOps, UnidentifiedImageError

from sdpipe import sources


class ImageRejected(Exception):
    """The file is not a usable image; the message is the one-line reason for the rejected list."""


def _to_rgb(img: Image.Image, background: tuple[int, int, int]) -> Image.Image:
    mode = img.mode
    if mode in ("I;16", "I;16B", "I;16L", "I", "I;16N"):
        # 16/32-bit greyscale: scale the used range to 8 bits rather than clipping at 255.
        arr = np.asarray(img, dtype=np.float64)
        top = 65535.0 if mode.startswith("I;16") else max(float(arr.max()), 1.0)
        arr = np.clip(arr / top * 255.0 + 0.5, 0, 255).astype(np.uint8)
        return Image.fromarray(arr, mode="L").convert("RGB")
    if mode == "F":
        arr = np.asarray(img, dtype=np.float64)
        span = max(float(arr.max() - arr.min()), 1e-12)
        return Image.fromarray(((arr - arr.min()) / span * 255).astype(np.uint8), mode="L").convert("RGB")
    if mode == "P":
        img = img.convert("RGBA")
    elif mode in ("LA", "La", "PA"):
        img = img.convert("RGBA")
    if img.mode in ("RGBA", "RGBa"):
        base = Image.new("RGB", img.size, background)
        base.paste(img, mask=img.getchannel("A"))
        return base
    return img.convert("RGB")


def load_rgb(
    source: str | Path | bytes, background=(255, 255, 255), max_pixels: int = 89478485, min_size: int = 1
) -> Image.Image:
    """Open, fully decode, apply EXIF orientation and convert to RGB. Raise ImageRejected with a reason."""
    data = sources.read_bytes(source) if not isinstance(source, bytes) else source
    if not data:
        raise ImageRejected("empty file (0 bytes)")
    # Our own bomb check below reads only the header, before any pixel is decoded; Pillow's global one would
    # apply its default limit instead of the configured one (and warns through a filter that is not thread-safe).
    Image.MAX_IMAGE_PIXELS = None
    try:
        img = Image.open(io.BytesIO(data))
        if img.width * img.height > max_pixels:
            raise ImageRejected(
                f"too many pixels ({img.width}x{img.height} > {max_pixels}): possible decompression bomb"
            )
        img.load()
        img = ImageOps.exif_transpose(img)
        rgb = _to_rgb(img, tuple(background))
    except ImageRejected:
        raise
    except UnidentifiedImageError:
        raise ImageRejected("not a recognised image format") from None
    except Exception as exc:  # noqa: BLE001 - any decoder failure (struct.error in EXIF, plugin bugs) is a bad file
        detail = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ImageRejected(f"cannot decode: {detail}") from None
    if min(rgb.size) < min_size:
        raise ImageRejected(f"too small ({rgb.width}x{rgb.height}; shorter side must be >= {min_size})")
    return rgb


def load_checked(
    path: str | Path, image_id: str, background=(255, 255, 255), max_pixels: int = 89478485
) -> Image.Image:
    """load_rgb for a later stage: the bytes must still be the ones prepare named `image_id`."""
    from sdpipe.hashing import sha256_bytes

    data = sources.read_bytes(path)
    if sha256_bytes(data) != image_id:
        raise ImageRejected("file changed since prepare; rerun prepare")
    return load_rgb(data, background=background, max_pixels=max_pixels)
