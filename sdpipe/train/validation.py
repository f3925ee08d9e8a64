"""Validation grids during training: fixed prompts x seeds rendered with the very UNet being trained."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from accelerate.utils import gather_object
from PIL import Image

from sdpipe import io
from sdpipe.models.pipeline import load_pipeline

if TYPE_CHECKING:
    from sdpipe.config import Config


def _generate(
    cfg: Config,
    models: dict,
    device,
    pairs: list[tuple[int, str, int]],
    steps: int,
    guidance: float,
    resolution: tuple[int, int],
) -> list[tuple[int, Image.Image]]:
    # The pipeline is only referenced here: its VAE (and any frozen text encoder) go when we return.
    pipe = load_pipeline(
        cfg.model.pretrained,
        cfg.model.revision,
        cfg.model.variant,
        device,
        prediction_type=cfg.train.prediction_type,
        **models,
    )
    # One call per image, CPU generators: an image depends on (prompt, seed) only, not on batch, world or device.
    height, width = resolution
    return [
        (
            index,
            pipe(
                prompt,
                height=height,
                width=width,
                num_inference_steps=steps,
                guidance_scale=guidance,
                generator=torch.Generator(device="cpu").manual_seed(seed),
            ).images[0],
        )
        for index, prompt, seed in pairs
    ]


def grid(images: list, rows: int, cols: int) -> Image.Image:
    w, h = images[0].size
    grid = Image.new("RGB", (cols * w, rows * h))
    for i, image in enumerate(images):
        grid.paste(image, ((i % cols) * w, (i // cols) * h))
    return grid


def render(
    accelerator,
    trained: dict,
    cfg: Config,
    step: int,
    out_dir: Path,
    prompts: list[str],
    seeds: list[int],
    num_inference_steps: int,
    guidance_scale: float,
    resolution: tuple[int, int],
) -> Path | None:
    """Render prompts (rows) x seeds (columns) at (height, width) with the models being trained (pipeline component
    name -> wrapped model); the grid's path on rank 0, None elsewhere. Every rank must call it (it gathers)."""
    models = {name: accelerator.unwrap_model(m) for name, m in trained.items()}
    modes, images = {name: m.training for name, m in models.items()}, []
    pairs = [(p * len(seeds) + s, prompt, seed) for p, prompt in enumerate(prompts) for s, seed in enumerate(seeds)]
    mine = pairs[accelerator.process_index :: accelerator.num_processes]  # rank r: pairs r, r+W, ...
    try:
        for m in models.values():
            m.eval()  # no LoRA dropout while sampling
        # autocast: a LoRA run keeps its frozen weights in the mixed-precision dtype (models.freeze_in)
        with torch.no_grad(), accelerator.autocast():
            if mine:
                images = _generate(
                    cfg, models, accelerator.device, mine, num_inference_steps, guidance_scale, resolution
                )
    finally:
        for name, m in models.items():
            m.train(modes[name])
        gc.collect()
        torch.cuda.empty_cache()  # a no-op where CUDA was never initialised
    images = gather_object(images)  # every rank joins, even one with nothing to render
    if not accelerator.is_main_process:
        return None
    path = Path(out_dir) / f"step-{step:08d}.png"
    with io.atomic_path(path) as tmp:
        grid([im for _, im in sorted(images, key=lambda x: x[0])], len(prompts), len(seeds)).save(tmp, "PNG")
    return path
