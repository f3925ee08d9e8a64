"""Validation grids during training: fixed prompts x seeds rendered with the UNet being trained. Every rank calls
render() (it gathers); the VAE and text encoder live only inside a call, so training never holds them."""

from __future__ import annotations

import contextlib
import gc
from pathlib import Path

import torch
from accelerate.utils import gather_object
from PIL import Image

from sdpipe import io
from sdpipe.models import loading


@contextlib.contextmanager
def _no_load_bars():
    """Silence diffusers' and transformers' loading bars (they would print at every validation), then restore."""
    from diffusers.utils import logging as dlog
    from transformers.utils import logging as tlog

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
    if loading.pipeline_family(cfg.model.pretrained, cfg.model.revision) == "sdxl":
        # No watermark: it would alter the pixels we compare across steps (and needs an optional package).
        cls, extra = StableDiffusionXLPipeline, {"add_watermarker": False}
    else:
        cls, extra = StableDiffusionPipeline, {"safety_checker": None, "requires_safety_checker": False}
    with _no_load_bars():
        pipe = cls.from_pretrained(root, unet=unet, dtype=torch.float32, variant=cfg.model.variant,
                                   local_files_only=True, **extra)
    pipe.set_progress_bar_config(disable=True)
    return pipe.to(device)


def _generate(pipe, pairs: list[tuple[int, str, int]], steps: int, guidance: float,
              resolution: tuple[int, int]) -> list[tuple[int, object]]:
    # One call per image, with a CPU generator: an image depends only on (prompt, seed), not on the batch it
    # shared, the world size or the device.
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
    """Render prompts (rows) x seeds (columns) at resolution (height, width); return the grid's path on rank 0."""
    model = accelerator.unwrap_model(unet)
    was_training, images = model.training, []
    pairs = [(p * len(seeds) + s, prompt, seed) for p, prompt in enumerate(prompts) for s, seed in enumerate(seeds)]
    mine = pairs[accelerator.process_index::accelerator.num_processes]  # rank r: pairs r, r+W, ...
    try:
        model.eval()  # no LoRA dropout while sampling
        with torch.no_grad():
            if mine:
                pipe = _load_pipeline(cfg, model, accelerator.device)
                images = _generate(pipe, mine, num_inference_steps, guidance_scale, resolution)
                del pipe  # frees the VAE and text encoder; the UNet stays referenced by the caller
    finally:
        model.train(was_training)
        gc.collect()
        if accelerator.device.type == "cuda":
            torch.cuda.empty_cache()
    images = gather_object(images)  # every rank joins, even one with nothing to render
    if not accelerator.is_main_process:
        return None
    path = Path(out_dir) / f"step-{step:08d}.png"
    with io.atomic_path(path) as tmp:
        _grid([im for _, im in sorted(images, key=lambda x: x[0])], len(prompts), len(seeds)).save(tmp, "PNG")
    return path
