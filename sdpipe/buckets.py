"""Aspect-ratio buckets: a few (width, height) shapes of about resolution^2 pixels each.

Training on buckets instead of centre squares keeps the whole subject of a tall or wide image; every image goes
to the bucket whose aspect ratio is nearest its own, so the crop that latents caching makes is as small as it can be.
"""

from __future__ import annotations

import math

Bucket = tuple[int, int]


def make_buckets(resolution: int, step: int, max_aspect: float) -> list[Bucket]:
    """(width, height) pairs, sides multiples of `step`, area at most about resolution^2, sorted.

    The square (resolution rounded to step) is always there; max_aspect 1 leaves only it.
    """
    if resolution < 1 or step < 1 or max_aspect < 1:
        raise ValueError(f"bad bucket settings: resolution={resolution}, step={step}, max_aspect={max_aspect}")
    side = max(step, int(resolution / step + 0.5) * step)
    area = resolution * resolution
    longest: dict[int, int] = {}  # short side -> the longest side that fits with it
    # w * h <= area and w / h <= max_aspect give w <= sqrt(area * max_aspect): past that, nothing fits.
    for one in range(step, int(math.sqrt(area * max_aspect)) + step, step):
        other = area // one // step * step
        short, long = min(one, other), max(one, other)
        if step <= short < long and long / short <= max_aspect + 1e-9:
            longest[short] = max(longest.get(short, 0), long)
    widest: dict[int, int] = {}  # then, per long side, only the largest short side: the others waste pixels
    for short, long in longest.items():
        widest[long] = max(widest.get(long, 0), short)
    # The one square is the rounded one, so max_aspect 1 gives exactly one bucket.
    found = {(side, side)}
    for long, short in widest.items():
        found.update({(long, short), (short, long)})
    return sorted(found)


def assign_bucket(width: int, height: int, buckets: list[Bucket]) -> Bucket:
    """The bucket whose log aspect ratio is nearest the image's; a tie goes to the smaller (width, height)."""
    if not buckets:
        raise ValueError("no buckets to choose from")
    if width <= 0 or height <= 0:
        raise ValueError(f"bad image size {width}x{height}")
    aspect = math.log(width / height)
    # Rounding the distance makes mirror-image ties (3:5 vs 5:3 for a square) exact despite float error.
    return min(buckets, key=lambda b: (round(abs(math.log(b[0] / b[1]) - aspect), 9), b))
