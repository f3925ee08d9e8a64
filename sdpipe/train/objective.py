"""The diffusion training objective, per sample, with noise drawn from per-sample generators.

Noise, timesteps and caption dropout for a sample come from a generator seeded by (seed, epoch, sample index), not
from a process-wide RNG. So a sample gets the same noise whichever rank, world size or resume point it lands on:
two processes with batch b and one with batch 2b compute the same per-sample losses, and an interrupted run plus
its resume sees exactly what an uninterrupted run would.
"""

from __future__ import annotations

import hashlib
from typing import TYPE_CHECKING, Callable

import torch

if TYPE_CHECKING:
    from sdpipe.config import TrainConfig
    from sdpipe.models.families import Family
    from sdpipe.models.objectives import Objective


def sample_generator(seed: int, epoch: int, index: int) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}:{epoch}:{index}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little"))


def draw(
    shape: tuple[int, int, int],
    gens: list[torch.Generator],
    timestep: Callable[[torch.Generator], torch.Tensor],
    cfg: TrainConfig,
) -> dict[str, torch.Tensor]:
    """Noise [B,C,H,W], timesteps [B] and a caption-dropout mask [B], one generator per sample (on the CPU).
    `timestep` draws one sample's timestep from its generator (the family's objective)."""
    c, h, w = shape
    noise, steps, drop = [], [], []
    for g in gens:
        n = torch.randn((c, h, w), generator=g)
        if cfg.noise_offset:  # per-channel offset: lets the model learn very dark and very bright images
            n = n + cfg.noise_offset * torch.randn((c, 1, 1), generator=g)
        noise.append(n)
        steps.append(timestep(g))
        drop.append(torch.rand((1,), generator=g) < cfg.caption_dropout)
    out = {"noise": torch.stack(noise), "timesteps": torch.cat(steps), "drop_caption": torch.cat(drop)}
    if cfg.input_perturbation:
        out["perturb"] = torch.stack([torch.randn((c, h, w), generator=g) for g in gens])
    return out


def variant(gens: list[torch.Generator], counts: list[int]) -> torch.Tensor:
    """Each sample's caption variant (latents.tags), from its generator; no draw where it has one."""
    return torch.tensor([int(torch.randint(n, (1,), generator=g)) if n > 1 else 0 for g, n in zip(gens, counts)])


def noisy_input(objective: Objective, scheduler, latents: torch.Tensor, draws: dict, perturbation: float):
    noise = draws["noise"]
    if perturbation:  # input perturbation (Ning et al. 2023): noise the input slightly differently from the target
        noise = noise + perturbation * draws["perturb"]
    return objective.noisy(scheduler, latents, noise, draws["timesteps"])


def sample_losses(
    forward,
    family: Family,
    scheduler,
    latents: torch.Tensor,
    draws: dict,
    cond: dict,
    t,
    prediction_type: str,
    autocast,
) -> torch.Tensor:
    """The training objective for one batch: per-sample losses [B] of `forward` (the UNet, compiled or not).

    The family says how its denoiser is called and what it is trained to predict (models/families/); `cond` holds
    the text states ("hidden"; SDXL also "pooled" and "time_ids") and, with data.masks, each sample's loss mask
    ("mask" [B, 1, H, W]); `t` is the train config; `autocast` a context factory (the accelerator's). The
    benchmark's parity check calls this very function.
    """
    objective = family.objective
    noisy = noisy_input(objective, scheduler, latents, draws, t.input_perturbation)
    steps = draws["timesteps"]
    with autocast():
        pred = objective.output(family.predict(forward, noisy, steps, cond), noisy, scheduler, steps)
    tgt = objective.target(scheduler, latents, draws["noise"], steps, prediction_type)
    mse = masked_mean((pred.float() - tgt.float()).pow(2), cond.get("mask"), t.masked_loss.unmasked_weight)
    weight = objective.weight(scheduler, steps, prediction_type, t.snr_gamma)
    return mse if weight is None else mse * weight


def masked_mean(err: torch.Tensor, mask: torch.Tensor | None, unmasked_weight: float) -> torch.Tensor:
    """Per-sample mean of `err` [B, C, H, W], weighted by the mask [B, 1, H, W] (1 inside, `unmasked_weight` outside):
    the weighted mean, so a sample's loss keeps its scale whatever its mask's area."""
    if mask is None:
        return err.mean(dim=(1, 2, 3))
    weight = mask + unmasked_weight * (1 - mask)
    total = (weight.sum(dim=(1, 2, 3)) * err.shape[1]).clamp_min(1e-8)  # an all-black mask: loss 0, not NaN
    return (err * weight).sum(dim=(1, 2, 3)) / total
