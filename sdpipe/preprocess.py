"""Turn a decoded RGB image into the pixel tensor the VAE sees at its bucket resolution.

The crop offsets are returned too: SDXL conditions on the original size and the crop's top-left corner.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import numpy as np
from PIL import Image

RESAMPLE = {
    "lanczos": Image.Resampling.LANCZOS,
    "bicubic": Image.Resampling.BICUBIC,
    "bilinear": Image.Resampling.BILINEAR,
}


@dataclass(frozen=True)
class Preprocess:
    """Everything that decides the pixels; it is part of the latent cache key."""

    bucket: tuple[int, int]  # (width, height)
    resize: str = "cover"
    crop: str = "center"
    interpolation: str = "lanczos"
    flip: bool = False
    background: tuple[int, int, int] = (255, 255, 255)

    def as_key(self) -> dict:
        return asdict(self)


def crop_box(width: int, height: int, p: Preprocess, image_id: str) -> tuple[tuple[int, int], int, int]:
    """(resized (w, h), top, left): scale so the image covers the bucket, then where the overhang is cut.

    Pure arithmetic, so the latents stage can record SDXL's crop conditioning without decoding anything.
    """
    bw, bh = p.bucket
    scale = max(bw / width, bh / height)
    size = (max(bw, round(width * scale)), max(bh, round(height * scale)))
    spare_x, spare_y = size[0] - bw, size[1] - bh
    if p.crop == "random":
        # Seeded by the image id: the same image always gets the same crop, on any machine or GPU count.
        rng = random.Random(image_id)
        left, top = rng.randint(0, spare_x), rng.randint(0, spare_y)
    else:
        left, top = spare_x // 2, spare_y // 2
    return size, top, left


def cover_and_crop(img: Image.Image, p: Preprocess, image_id: str) -> tuple[Image.Image, tuple[int, int]]:
    """Resize and crop to the bucket (see crop_box); return the image and the crop's (top, left)."""
    size, top, left = crop_box(img.width, img.height, p, image_id)
    bw, bh = p.bucket
    img = img.resize(size, RESAMPLE[p.interpolation])
    img = img.crop((left, top, left + bw, top + bh))
    if p.flip:
        img = img.transpose(Image.Transpose.FLIP_LEFT_RIGHT)
    return img, (top, left)


def to_uint8(img: Image.Image):
    """HWC uint8 -> CHW uint8 tensor: a quarter of the float bytes to stack and copy to the device."""
    import torch

    return torch.from_numpy(np.asarray(img, dtype=np.uint8).copy()).permute(2, 0, 1).contiguous()


def to_model_range(pixels, device, dtype=None):
    """uint8 [0, 255] -> [-1, 1] on the device, the VAE's input range: bit for bit what to_tensor makes, cast to
    `dtype` last. On a GPU the copy goes through pinned memory and does not wait."""
    import torch

    if torch.device(device).type == "cuda":
        pixels = pixels.pin_memory().to(device, non_blocking=True)
    x = pixels.to(device=device, dtype=torch.float32) / 127.5 - 1.0
    return x if dtype is None else x.to(dtype)


def to_tensor(img: Image.Image):
    """HWC uint8 -> CHW float in [-1, 1], the VAE's input range."""
    import torch

    arr = np.asarray(img, dtype=np.float32) / 127.5 - 1.0
    return torch.from_numpy(arr).permute(2, 0, 1).contiguous()
