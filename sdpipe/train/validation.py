"""Validation grids during training: fixed prompts x seeds rendered with the very UNet being trained."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import torch
from accelerate.utils import gather_object
from diffusers.utils import logging as dlog
from PIL import Image
from transformers.utils import logging as tlog

from sdpipe import io
from sdpipe.models import loading


@contextlib.contextmanager
def _no_load_bars():
    """Silence diffusers' and transformers' loading bars (they would print at every validation), then restore."""
    libs = [lib for lib in (dlog, tlog) if lib.is_progress_bar_enabled()]
    for lib in libs:
        lib.disable_progress_bar()
    try:
        yield
    finally:
        for lib in libs:
            lib.enable_progress_bar()


def _load_pipeline(cfg, unet, device: torch.device):
    """The base pipeline around our UNet object itself (not a copy), so LoRA adapters and the latest weights render."""
    from diffusers import StableDiffusionPipeline, StableDiffusionXLPipeline

    root = loading.model_index(cfg.model.pretrained, cfg.model.revision)[0]
    xl = loading.pipeline_family(cfg.model.pretrained, cfg.model.revision) == "sdxl"
    # SDXL without its watermark: it would alter the pixels compared across steps (and needs an optional package).
    extra = {"add_watermarker": False} if xl else {"safety_checker": None, "requires_safety_checker": False}
    with _no_load_bars():
        pipe = (StableDiffusionXLPipeline if xl else StableDiffusionPipeline).from_pretrained(
            root, unet=unet, dtype=torch.float32, variant=cfg.model.variant, local_files_only=True, **extra)
    pipe.set_progress_bar_config(disable=True)
    if cfg.train.prediction_type:  # sample with the objective the UNet is being trained on
        pipe.scheduler.register_to_config(prediction_type=cfg.train.prediction_type)
    return pipe.to(device)


def _generate(cfg, unet, device, pairs: list[tuple[int, str, int]], steps: int, guidance: float,
              resolution: tuple[int, int]) -> list[tuple[int, Image.Image]]:
    pipe = _load_pipeline(cfg, unet, device)  # only referenced here: the VAE and text encoders go when we return
    # One call per image, CPU generators: an image depends on (prompt, seed) only, not on batch, world or device.
    height, width = resolution
    return [(index, pipe(prompt, height=height, width=width, num_inference_steps=steps, guidance_scale=guidance,
                         generator=torch.Generator(device="cpu").manual_seed(seed)).images[0])
            for index, prompt, seed in pairs]


def _grid(images: list, rows: int, cols: int) -> Image.Image:
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, ((i % cols) * w, (i // cols) * h))
    return grid


def render(accelerator, unet, cfg, step: int, out_dir: Path, prompts: list[str], seeds: list[int],
           num_inference_steps: int, guidance_scale: float, resolution: tuple[int, int]) -> Path | None:
    """Render prompts (rows) x seeds (columns) at (height, width); the grid's path on rank 0, None elsewhere.
    Every rank must call it (it gathers). The VAE and text encoder exist only during the call."""
    model = accelerator.unwrap_model(unet)
    was_training, images = model.training, []
    pairs = [(p * len(seeds) + s, prompt, seed) for p, prompt in enumerate(prompts) for s, seed in enumerate(seeds)]
    mine = pairs[accelerator.process_index::accelerator.num_processes]  # rank r: pairs r, r+W, ...
    try:
        model.eval()  # no LoRA dropout while sampling
        with torch.no_grad():
            if mine:
                images = _generate(cfg, model, accelerator.device, mine, num_inference_steps, guidance_scale,
                                   resolution)
    finally:
        model.train(was_training)
        gc.collect()
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
    images = gather_object(images)  # every rank joins, even one with nothing to render
    if not accelerator.is_main_process:
        return None
    path = Path(out_dir) / f"step-{step:08d}.png"
    with io.atomic_path(path) as tmp:
        _grid([im for _, im in sorted(images, key=lambda x: x[0])], len(prompts), len(seeds)).save(tmp, "PNG")
    return path
