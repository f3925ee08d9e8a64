"""The embedded demo dataset: coloured geometric shapes, drawn deterministically and offline.

It exists so every checkout can run the whole pipeline without the network or a real dataset, and it is shaped
to exercise each stage: nested folders, several aspect ratios (bucketing), sidecar captions, and caption-less
files whose names carry the caption (the template captioner). Nothing but images and captions goes into `out`,
because the raw folder is scanned as data.
"""

from __future__ import annotations

import io
import logging
import math
import random
from dataclasses import dataclass
from pathlib import Path

from PIL import Image, ImageDraw

from sdpipe.errors import UserError
from sdpipe.io import write_bytes

log = logging.getLogger(__name__)

SHAPES: tuple[str, ...] = ("circle", "square", "triangle", "star", "hexagon")

# Saturated, well-separated hues: the calibration run showed colours are what a tiny model learns last.
COLOURS: dict[str, tuple[int, int, int]] = {
    "red": (220, 30, 30),
    "orange": (245, 135, 20),
    "yellow": (245, 220, 30),
    "green": (40, 170, 60),
    "blue": (30, 80, 220),
    "purple": (135, 50, 185),
    "pink": (245, 125, 190),
    "brown": (125, 75, 30),
}

BACKGROUNDS: dict[str, tuple[int, int, int]] = {
    "white": (255, 255, 255),
    "black": (0, 0, 0),
    "gray": (128, 128, 128),
    "light blue": (185, 215, 245),
    "beige": (235, 225, 195),
}

# (width, height); the shorter side stays 64 so every image survives the smallest training resolution.
SIZES: tuple[tuple[int, int], ...] = ((64, 64), (96, 64), (64, 96), (80, 64), (64, 80), (112, 64), (64, 112))

SUPERSAMPLE = 4
NO_SIDECAR_FRACTION = 0.15
# A shape must stand out from its background, not merely differ from it (gray vs. purple would be a blur).
MIN_CONTRAST = 100.0


@dataclass(frozen=True)
class _Item:
    """Everything needed to draw one image; geometry is in output pixels."""

    index: int
    shape: str
    colour: str
    background: str
    size: tuple[int, int]
    centre: tuple[float, float]
    radius: float
    angle: float
    sidecar: bool


def _article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption_for(shape: str, colour: str, background: str) -> str:
    """The caption of one image, e.g. 'an orange star on a black background'."""
    if shape not in SHAPES or colour not in COLOURS or background not in BACKGROUNDS:
        raise ValueError(f"unknown demo shape/colour/background: {shape!r}, {colour!r}, {background!r}")
    return f"{_article(colour)} {colour} {shape} on {_article(background)} {background} background"


def _backgrounds_for(colour: str) -> list[str]:
    return [name for name, rgb in BACKGROUNDS.items() if math.dist(rgb, COLOURS[colour]) >= MIN_CONTRAST]


def _combos(count: int, rng: random.Random) -> list[tuple[str, str]]:
    """Shapes x colours in freshly shuffled cycles, so any prefix of the dataset stays balanced."""
    base = [(s, c) for s in SHAPES for c in COLOURS]
    combos: list[tuple[str, str]] = []
    while len(combos) < count:
        cycle = list(base)
        rng.shuffle(cycle)
        combos.extend(cycle)
    return combos[:count]


def _plan(count: int, seed: int) -> list[_Item]:
    rng = random.Random(seed)  # never the global RNG: the dataset must not depend on who else drew numbers
    combos = _combos(count, rng)
    no_sidecar = set(rng.sample(range(count), round(count * NO_SIDECAR_FRACTION)))
    items = []
    for i, (shape, colour) in enumerate(combos):
        w, h = rng.choice(SIZES)
        radius = rng.uniform(0.22, 0.42) * min(w, h)
        margin = radius + 2
        centre = (rng.uniform(margin, w - margin), rng.uniform(margin, h - margin))
        items.append(
            _Item(
                i,
                shape,
                colour,
                rng.choice(_backgrounds_for(colour)),
                (w, h),
                centre,
                radius,
                rng.uniform(-15.0, 15.0),
                i not in no_sidecar,
            )
        )
    return items


def _vertices(item: _Item, scale: int) -> list[tuple[float, float]]:
    """Polygon corners, in supersampled pixels; every shape points up before its small random tilt."""
    sides = {"square": 4, "triangle": 3, "star": 10, "hexagon": 6}[item.shape]
    start = {"square": -135.0, "triangle": -90.0, "star": -90.0, "hexagon": 0.0}[item.shape] + item.angle
    cx, cy = item.centre[0] * scale, item.centre[1] * scale
    points = []
    for k in range(sides):
        r = item.radius * scale * (0.45 if item.shape == "star" and k % 2 else 1.0)
        a = math.radians(start + 360.0 * k / sides)
        points.append((cx + r * math.cos(a), cy + r * math.sin(a)))
    return points


def _render(item: _Item) -> bytes:
    """PNG bytes: drawn at SUPERSAMPLE x and downsampled with LANCZOS, so edges are anti-aliased."""
    s = SUPERSAMPLE
    img = Image.new("RGB", (item.size[0] * s, item.size[1] * s), BACKGROUNDS[item.background])
    draw = ImageDraw.Draw(img)
    fill = COLOURS[item.colour]
    if item.shape == "circle":
        cx, cy, r = item.centre[0] * s, item.centre[1] * s, item.radius * s
        draw.ellipse((cx - r, cy - r, cx + r, cy + r), fill=fill)
    else:
        draw.polygon(_vertices(item, s), fill=fill)
    img = img.resize(item.size, Image.LANCZOS)
    buf = io.BytesIO()
    img.save(buf, format="PNG")  # Pillow writes no timestamp or text chunks unless asked: bytes are reproducible
    return buf.getvalue()


def _stem(item: _Item, digits: int) -> str:
    number = f"{item.index:0{digits}d}"
    if item.sidecar:
        return f"{item.shape}_{number}"
    # The template captioner turns '_'/'-' into spaces and strips the trailing number: this cleans to the caption.
    return caption_for(item.shape, item.colour, item.background).replace(" ", "_") + f"_{number}"


def _files(items: list[_Item], out: Path) -> tuple[list[Path], dict[Path, bytes]]:
    digits = max(4, len(str(len(items) - 1)))
    images: list[Path] = []
    files: dict[Path, bytes] = {}
    for item in items:
        path = out / item.shape / f"{_stem(item, digits)}.png"
        images.append(path)
        files[path] = _render(item)
        if item.sidecar:
            caption = caption_for(item.shape, item.colour, item.background) + "\n"
            files[path.with_suffix(".txt")] = caption.encode("utf-8")
    return images, files


def _present(out: Path, files: dict[Path, bytes]) -> set[Path]:
    """The planned files already on disk. Raise if anything else is there: we never overwrite user data."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file, not a folder; choose another --out")
    present = set()
    for path in sorted(out.rglob("*")) if out.exists() else []:
        if path.is_dir() and not path.is_symlink():
            continue
        if path not in files or path.read_bytes() != files[path]:
            raise UserError(
                f"{out} is not empty and is not the demo dataset (e.g. {path.relative_to(out)}; or it "
                "was made with another --count/--seed); choose another --out"
            )
        present.add(path)
    return present


def generate(out: Path, count: int = 480, seed: int = 0) -> list[Path]:
    """Write `count` shape images (and their sidecar captions) under out/<shape>/; return the image paths."""
    if not isinstance(count, int) or count < 1:
        raise UserError(f"--count must be a whole number >= 1, got {count!r}")
    out = Path(out)
    images, files = _files(_plan(count, seed), out)
    present = _present(out, files)
    if len(present) == len(files):
        log.info("demo dataset already present: %d images in %s", len(images), out)
        return images
    for path, data in files.items():
        if path not in present:
            write_bytes(path, data)
    sidecars = len(files) - len(images)
    log.info(
        "wrote demo dataset: %d images (%d with sidecar captions, %d captioned by file name) to %s [count=%d seed=%d]",
        len(images),
        sidecars,
        len(images) - sidecars,
        out,
        count,
        seed,
    )
    return images
