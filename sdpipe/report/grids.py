"""Validation grids with their prompts drawn as row labels and their seeds as column headings.

Grids from the tiny demo model are 32 px a cell, so cells are enlarged (nearest neighbour: the pixels stay the
pixels the model made) to a readable size. Text is drawn with the DejaVu font matplotlib ships, so the result is the
same on every machine with the same library versions.
"""

from __future__ import annotations

import math
import shutil
import textwrap
from pathlib import Path

MIN_CELL = 128  # px: smaller cells are enlarged to at least this
LABEL_WIDTH = 240  # px of prompt text left of the grid
HEADER = 22  # px of seed headings above it
FONT_SIZE = 13


def _font():
    import matplotlib
    from PIL import ImageFont

    return ImageFont.truetype(str(Path(matplotlib.get_data_path(), "fonts", "ttf", "DejaVuSans.ttf")), FONT_SIZE)


def _wrapped(text: str, lines: int) -> list[str]:
    """The prompt in at most `lines` lines of about the label width; an ellipsis says when it was cut."""
    wrapped = textwrap.wrap(" ".join(text.split()), width=28) or [""]
    if len(wrapped) > lines:
        wrapped = wrapped[:lines]
        wrapped[-1] = wrapped[-1][:25] + "…"
    return wrapped


def fits(size: tuple[int, int], rows: int, cols: int, aspect: float) -> bool:
    """Whether a (width, height) grid is rows x cols cells of width/height `aspect` (to the pixel)."""
    width, height = size
    if not rows or not cols or width % cols or height % rows:
        return False
    return abs(width // cols - aspect * (height // rows)) < 1


def label_grid(src: Path, out: Path, prompts: list[str], seeds: list[int], aspect: float = 1.0) -> bool:
    """Write the labelled grid to `out`; False (and a plain copy) when the grid is not prompts x seeds cells of the
    given aspect, e.g. when the config changed after training, so labels would be wrong."""
    from PIL import Image, ImageDraw

    with Image.open(src) as im:
        grid = im.convert("RGB")
    rows, cols = len(prompts), len(seeds)
    if not fits(grid.size, rows, cols, aspect):
        shutil.copyfile(src, out)
        return False
    scale = max(1, math.ceil(MIN_CELL / (grid.height // rows)))
    grid = grid.resize((grid.width * scale, grid.height * scale), Image.Resampling.NEAREST)
    cell_w, cell_h = grid.width // cols, grid.height // rows
    canvas = Image.new("RGB", (LABEL_WIDTH + grid.width, HEADER + grid.height), "white")
    canvas.paste(grid, (LABEL_WIDTH, HEADER))
    draw, font = ImageDraw.Draw(canvas), _font()
    line_h = FONT_SIZE + 4
    for c, seed in enumerate(seeds):
        draw.text(
            (LABEL_WIDTH + c * cell_w + cell_w // 2, HEADER // 2), f"seed {seed}", fill="black", font=font, anchor="mm"
        )
    for r, prompt in enumerate(prompts):
        lines = _wrapped(prompt, max(1, cell_h // line_h))
        top = HEADER + r * cell_h + (cell_h - line_h * len(lines)) // 2
        for i, line in enumerate(lines):
            draw.text((6, top + i * line_h), line, fill="black", font=font)
    canvas.save(out, "PNG")
    return True
