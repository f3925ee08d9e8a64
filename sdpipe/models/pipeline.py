"""Whole diffusers pipelines for sampling (validation grids, class images, evaluation), loaded offline.

Components passed in (a UNet being trained, a trained text encoder) replace the saved ones as objects, not copies,
so LoRA adapters and the latest weights are what renders.
"""

from __future__ import annotations

import contextlib

import torch
from diffusers.utils import logging as dlog
from transformers.utils import logging as tlog

from sdpipe.models import loading


@contextlib.contextmanager
def no_load_bars():
    """Silence diffusers' and transformers' loading bars (they would print at every validation), then restore."""
    libs = [lib for lib in (dlog, tlog) if lib.is_progress_bar_enabled()]
    for lib in libs:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libs:
            lib.enable_progress_bar()


def load_pipeline(
    pretrained: str,
    revision: str | None = None,
    variant: str | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
    prediction_type: str | None = None,
    **components,
):
    """StableDiffusion(XL)Pipeline from a diffusers folder or cached hub id; no safety checker, no watermark."""

    root = loading.model_index(pretrained, revision)[0]
    family = loading.family_of(pretrained, revision)
    with no_load_bars(), loading.user_errors(pretrained, "the pipeline", variant):
        pipe = family.pipeline().from_pretrained(
            root, torch_dtype=dtype, variant=variant, local_files_only=True, **dict(family.load_args), **components
        )
    pipe.set_progress_bar_config(disable=True)
    if prediction_type:  # sample with the objective the UNet was trained on
        pipe.scheduler.register_to_config(prediction_type=prediction_type)
    return pipe.to(device)
