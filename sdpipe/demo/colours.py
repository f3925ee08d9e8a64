"""Name the colour of the shape in a demo image, and score generated images against their prompts.

A demo image is one flat shape on a flat background (sdpipe.demo). The background colour is estimated from the
image's border (or given), the foreground is the pixels far from it, and the shape's colour is the median of the
pixels farthest from the background (anti-aliased edges, which are blends, are left out), named by the nearest
entry of the demo's COLOURS palette. This is the demo's colour metric: does a model follow the colour word?
"""

from __future__ import annotations

import re
from typing import Sequence

import numpy as np
from PIL import Image

from sdpipe.demo import BACKGROUNDS, COLOURS, SHAPES

MIN_FOREGROUND_DISTANCE = 40.0  # RGB distance from the background below which a pixel is background
CORE_FRACTION = 0.5  # the shape's core: pixels at least this share of the largest distance from the background


def _rgb_array(image) -> np.ndarray:
    if isinstance(image, Image.Image):
        image = np.asarray(image.convert("RGB"))
    arr = np.asarray(image, dtype=np.float64)
    if arr.ndim != 3 or arr.shape[2] != 3:
        raise ValueError(f"expected an RGB image [H, W, 3], got shape {arr.shape}")
    return arr


def border_colour(arr: np.ndarray, width: int = 2) -> np.ndarray:
    """The median RGB of the outermost `width` pixels on every side: the background of a demo image."""
    w = max(1, min(width, min(arr.shape[:2]) // 4))
    ring = np.concatenate(
        [arr[:w].reshape(-1, 3), arr[-w:].reshape(-1, 3), arr[w:-w, :w].reshape(-1, 3), arr[w:-w, -w:].reshape(-1, 3)]
    )
    return np.median(ring, axis=0)


def _background(arr: np.ndarray, hint) -> np.ndarray:
    if hint is None:
        return border_colour(arr)
    if isinstance(hint, str):
        if hint not in BACKGROUNDS:
            raise ValueError(f"unknown background {hint!r}; known: {', '.join(BACKGROUNDS)}")
        return np.asarray(BACKGROUNDS[hint], dtype=np.float64)
    return np.asarray(hint, dtype=np.float64)


def nearest_colour(rgb: Sequence[float]) -> str:
    """The COLOURS name closest to `rgb` (Euclidean in RGB; the palette is saturated and well separated)."""
    names = list(COLOURS)
    palette = np.asarray([COLOURS[n] for n in names], dtype=np.float64)
    return names[int(np.argmin(np.linalg.norm(palette - np.asarray(rgb, dtype=np.float64), axis=1)))]


def foreground_colour(image, background_hint=None) -> np.ndarray | None:
    """The median RGB of the shape's core, or None when no pixel stands out from the background."""
    arr = _rgb_array(image)
    distance = np.linalg.norm(arr - _background(arr, background_hint), axis=2)
    top = float(distance.max())
    if top < MIN_FOREGROUND_DISTANCE:
        return None
    core = distance >= max(MIN_FOREGROUND_DISTANCE, CORE_FRACTION * top)
    return np.median(arr[core], axis=0)


def dominant_colour(image, background_hint=None) -> str:
    """The palette name of the shape's colour; "none" when the image has no foreground (a blank image).

    `image`: a PIL image or an [H, W, 3] array. `background_hint`: a BACKGROUNDS name or an RGB triple to use
    instead of the colour estimated from the image border.
    """
    rgb = foreground_colour(image, background_hint)
    return "none" if rgb is None else nearest_colour(rgb)


_WORDS = re.compile(r"[a-z]+")


def prompt_colour(prompt: str) -> str:
    """The shape's colour word in a demo caption: the palette word before the shape ("a red circle on a light
    blue background" -> "red"; the background's words never count)."""
    words = _WORDS.findall(prompt.lower())
    shape_at = next((i for i, w in enumerate(words) if w in SHAPES), len(words))
    found = [w for w in words[:shape_at] if w in COLOURS]
    if not found:
        raise ValueError(f"no demo colour word before the shape in {prompt!r}; colours: {', '.join(COLOURS)}")
    return found[-1]


def colour_accuracy(images: Sequence, prompts: Sequence[str]) -> float:
    """The share of images whose dominant colour is the colour word of their prompt."""
    if len(images) != len(prompts):
        raise ValueError(f"{len(images)} images but {len(prompts)} prompts")
    if not images:
        raise ValueError("colour_accuracy needs at least one image")
    hits = sum(dominant_colour(im) == prompt_colour(p) for im, p in zip(images, prompts))
    return hits / len(images)
