"""Train the base model's VAE on the training images (optional: model.train_vae), for small domains trained from
scratch such as the embedded demo, whose randomly initialised VAE cannot reconstruct anything.

The output is a new pipeline folder (the base pipeline with the trained VAE and its re-measured scaling factor);
every later stage loads it instead of model.pretrained. A pretrained SD/SDXL VAE needs none of this.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.stages import image_file, read_upstream

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INPUTS = {"manifest": "results/prepare/manifest.jsonl"}
OUTPUTS = {"out": "results/vae/model", "summary": "results/vae/summary.json"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("model", "seed", "prepare.buckets", "prepare.alpha_background")


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> dict:
    import torch

    from sdpipe import vae_train
    from sdpipe.models import loading

    v = cfg.model.train_vae
    if not v.enabled:
        raise UserError("model.train_vae.enabled is false; nothing to train")
    rows = [r for r in read_upstream(inputs["manifest"], "prepare") if r["split"] == "train"]
    base = loading.model_index(cfg.model.pretrained, cfg.model.revision)[0]
    device = "cuda:0" if torch.cuda.is_available() else "cpu"
    stats = vae_train.train_vae(
        base,
        [Path(image_file(cfg, r)) for r in rows],
        Path(outputs["out"]),
        resolution=cfg.prepare.buckets.resolution,
        steps=v.steps,
        batch_size=v.batch_size,
        learning_rate=v.learning_rate,
        kl_weight=v.kl_weight,
        reconstruction=v.reconstruction,
        seed=cfg.seed,
        device=device,
        background=tuple(cfg.prepare.alpha_background),
    )
    summary = {"images": len(rows), "device": device, **stats}
    io.write_json(outputs["summary"], summary)
    log.info("train_vae: %d images, %d steps on %s -> %s", len(rows), v.steps, device, outputs["out"])
    return summary
