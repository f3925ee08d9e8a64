"""Noise objectives: how a family's denoiser is trained, given clean latents, noise and timesteps.

A family names its objective (families.Family.objective); the training loop and the benchmark's parity check call
these methods instead of the formulas. SD 1.x/2.x and SDXL share DDPM's: noise the latents on the pipeline's beta
schedule and predict the noise (epsilon) or the velocity (v-prediction, Salimans & Ho 2022).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch


class Objective:
    """The interface: the noisy input, the regression target, and the min-SNR loss weight of each sample."""

    scheduler_class: str  # the diffusers scheduler that holds the training noise schedule

    def noisy(self, scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target(
        self, scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, prediction_type: str
    ) -> torch.Tensor:
        raise NotImplementedError

    def snr_weight(self, scheduler, timesteps: torch.Tensor, prediction_type: str, gamma: float) -> torch.Tensor:
        raise NotImplementedError


class DDPM(Objective):
    """Denoising diffusion on a discrete beta schedule (DDPMScheduler, with the pipeline's betas)."""

    scheduler_class = "DDPMScheduler"

    def noisy(self, scheduler, latents, noise, timesteps):
        return scheduler.add_noise(latents, noise, timesteps)

    def target(self, scheduler, latents, noise, timesteps, prediction_type):
        return noise if prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)

    def snr_weight(self, scheduler, timesteps, prediction_type, gamma):
        """Min-SNR-gamma (Hang et al. 2023): min(SNR, gamma) / SNR for epsilon, / (SNR + 1) for v-prediction."""
        import torch
        from diffusers.training_utils import compute_snr

        snr = compute_snr(scheduler, timesteps)
        weight = torch.minimum(snr, torch.full_like(snr, gamma))
        return weight / snr if prediction_type == "epsilon" else weight / (snr + 1)
