"""The held-out loss (train.validation.heldout_every): the training objective on the eval split's images, at fixed
timesteps with fixed noise per image, so one curve compares with another across steps and runs. Where it turns up
while the training loss still falls, the run is over-fitting.

Everything that varies in training is fixed here: no caption dropout, no flip, one caption per image (the latents
stage caches the held-out images that way), no input perturbation, and no timestep weighting (min-SNR would make
runs with other settings incomparable). The masks of data.masks still apply: they say what the loss is about. Each
rank computes its share of the images and the sums are all-reduced, so every rank takes part and gets the same
value; it is the trained weights' loss, not the EMA's.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from sdpipe import io
from sdpipe.train import objective
from sdpipe.train.data import LatentData

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger("sdpipe.train")


def load(cfg: Config, index: Path, verify: bool) -> LatentData | None:
    """The held-out images' data when the held-out loss is on and there are any, else None. A small data set can
    leave prepare.eval_fraction's split empty: training goes on without the curve, and says so."""
    if not cfg.train.validation.heldout_every:
        return None
    if not io.read_json(index).get("eval_items"):
        log.warning(
            "no held-out loss: the eval split has no images (prepare.eval_fraction %s of this data set picked "
            "none, or none could be encoded); raise prepare.eval_fraction to get the curve",
            cfg.prepare.eval_fraction,
        )
        return None
    return LatentData(index, verify=verify, split="eval")


def due(run) -> bool:
    every = run.cfg.train.validation.heldout_every
    from sdpipe.train.loop import finished

    return bool(every) and run.heldout is not None and (run.step % every == 0 or finished(run))


@contextlib.contextmanager
def _eval_mode(models: list[torch.nn.Module]):
    """Dropout (a LoRA's) off while the loss is measured, restored after."""
    was = [m.training for m in models]
    for m in models:
        m.eval()
    try:
        yield
    finally:
        for m, training in zip(models, was):
            m.train(training)


def _chunks(samples: list[int], size: int):
    for i in range(0, len(samples), size):
        yield samples[i : i + size]


def loss(run) -> float:
    """The mean held-out loss over every held-out image and fixed timestep, the same on every rank."""
    acc, data, t = run.accelerator, run.heldout, run.cfg.train
    fixed = dataclasses.replace(t, input_perturbation=0.0, snr_gamma=None)
    timesteps = data.family.objective.at_fractions(run.noise_scheduler, t.validation.heldout_timesteps)
    model = acc.unwrap_model(run.unet)
    buckets = data.sample_buckets()
    mine: dict[tuple, list[int]] = defaultdict(list)
    for s in range(acc.process_index, len(buckets), acc.num_processes):
        mine[buckets[s]].append(s)
    total = torch.zeros(2, device=acc.device)  # loss sum, count
    models = [model] + ([acc.unwrap_model(e) for e in run.text.encoders] if run.text else [])
    with torch.no_grad(), _eval_mode(models):
        for bucket in sorted(mine):
            for chunk in _chunks(mine[bucket], t.per_device_batch_size):
                total += _chunk_losses(run, model, fixed, data, chunk, timesteps)
    total = acc.reduce(total, "sum")
    return float(total[0] / total[1].clamp_min(1))


def _chunk_losses(run, model, fixed, data: LatentData, chunk: list[int], timesteps: torch.Tensor) -> torch.Tensor:
    acc, n = run.accelerator, len(chunk)
    batch = {k: v.to(acc.device) for k, v in data.batch(chunk, [False] * n, [False] * n).items()}
    if run.text is not None:  # the text encoders train too: their current states, as the step uses
        batch.update(run.text.embed(data.captions(chunk, [False] * n)))
    shape = data.latent_shape(chunk[0])
    out = torch.zeros(2, device=acc.device)
    for k, step in enumerate(timesteps):
        # Noise per (image, timestep), from generators no training epoch uses (their epochs are >= 0).
        gens = [objective.sample_generator(run.cfg.seed, -1 - k, s) for s in chunk]
        noise = torch.stack([torch.randn(shape, generator=g) for g in gens]).to(acc.device)
        draws = {"noise": noise, "timesteps": step.repeat(n).to(acc.device)}
        losses = objective.sample_losses(
            model,
            data.family,
            run.noise_scheduler,
            batch["latents"],
            draws,
            batch,
            fixed,
            run.prediction_type,
            acc.autocast,
        )
        out += torch.stack([losses.sum(), torch.tensor(float(n), device=acc.device)])
    return out
