"""Tag captions (latents.tags): a booru-style caption ("sks dog, red collar, grass") as several cached variants,
its tags after the first `keep_first` shuffled and some dropped, so a model does not learn one tag order.

Why cached variants rather than shuffling at training time: a text encoder's states for a tag depend on the whole
sequence, so there are no per-tag states to shuffle, and re-encoding every step would load the text encoders for
training (their memory, their time) and make the run depend on the encoders' numerics step by step. A fixed set of
variants per caption keeps the text cache content-addressed (a variant is keyed by its own text, like any
caption) and training free of text encoders; each sample draws its variant from its own generator (seed, epoch,
sample), so the choice is the same on any number of GPUs and across a resume. Variant i of a caption is seeded by
the caption and i: the same caption gives the same variants in every run.
"""

from __future__ import annotations

import random
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sdpipe.config import TagsConfig


def enabled(t: TagsConfig) -> bool:
    return t.shuffle or t.dropout > 0


def variants(caption: str, t: TagsConfig) -> list[str]:
    """The caption's variants, or [caption] when tags are off or the caption has no separator."""
    if not enabled(t) or t.separator not in caption:
        return [caption]
    tags = [tag.strip() for tag in caption.split(t.separator) if tag.strip()]
    fixed, rest = tags[: t.keep_first], tags[t.keep_first :]
    joiner = f"{t.separator.strip()} " if t.separator.strip() else t.separator
    out = []
    for i in range(t.variants):
        rng = random.Random(f"{caption}\0{i}")
        order = rest[:]
        if t.shuffle:
            rng.shuffle(order)
        kept = [tag for tag in order if rng.random() >= t.dropout]
        out.append(joiner.join(fixed + kept))
    return out
