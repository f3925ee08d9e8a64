"""Noise objectives: how a family's denoiser is trained, given clean latents, noise and a timestep per sample.

A family names its objective (families.Family.objective); the training loop and the benchmark's parity check call
these methods instead of the formulas. SD 1.x/2.x and SDXL share DDPM's: noise the latents on the pipeline's beta
schedule and predict the noise (epsilon) or the velocity (v-prediction, Salimans & Ho 2022). SD 3 and Flux train by
rectified flow (`FlowMatching`, Esser et al. 2024): a straight path from data to noise, and the velocity along it.

Timesteps are drawn from each sample's own generator (train/objective.py), never from a global RNG, so a sample
gets the same timestep on any rank, world size or resume. diffusers' `compute_density_for_timestep_sampling` draws
from the global RNG, so its three densities are written out here, following its formulas.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch
# torch is imported where it is used: the family registry imports this module, and `snakemake` validates every
# config through the registry, where a torch import would cost seconds per start.


class Objective:
    """The interface: a sample's timestep, the noisy input, what the denoiser's output is compared with, and each
    sample's loss weight."""

    scheduler_class: str  # the diffusers scheduler that holds the training noise schedule

    def timestep(self, generator: torch.Generator, scheduler) -> torch.Tensor:
        """One sample's timestep, shape [1], in the scheduler's units."""
        raise NotImplementedError

    def noisy(self, scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def target(
        self, scheduler, latents: torch.Tensor, noise: torch.Tensor, timesteps: torch.Tensor, prediction_type: str
    ) -> torch.Tensor:
        raise NotImplementedError

    def output(self, pred: torch.Tensor, noisy: torch.Tensor, scheduler, timesteps: torch.Tensor) -> torch.Tensor:
        """The denoiser's output as the loss compares it with the target (a preconditioning may rewrite it)."""
        return pred

    def weight(self, scheduler, timesteps: torch.Tensor, prediction_type: str, snr_gamma: float | None):
        """Each sample's loss weight [B], or None for equal weights."""
        return None

    def prediction(self, scheduler) -> str:
        """What the denoiser predicts, as summaries and exports' metadata record it."""
        raise NotImplementedError

    def at_fractions(self, scheduler, fractions: list[float]) -> torch.Tensor:
        """Fixed timesteps (held-out loss): each fraction of the schedule in the scheduler's units, unshifted."""
        import torch

        return torch.tensor(fractions, dtype=torch.float32) * scheduler.config.num_train_timesteps


class DDPM(Objective):
    """Denoising diffusion on a discrete beta schedule (DDPMScheduler, with the pipeline's betas)."""

    scheduler_class = "DDPMScheduler"

    def timestep(self, generator, scheduler):
        import torch

        return torch.randint(0, scheduler.config.num_train_timesteps, (1,), generator=generator)

    def prediction(self, scheduler) -> str:
        return scheduler.config.prediction_type  # "epsilon" or "v_prediction"

    def at_fractions(self, scheduler, fractions: list[float]) -> torch.Tensor:
        n = scheduler.config.num_train_timesteps
        return super().at_fractions(scheduler, fractions).long().clamp(0, n - 1)  # discrete steps

    def noisy(self, scheduler, latents, noise, timesteps):
        return scheduler.add_noise(latents, noise, timesteps)

    def target(self, scheduler, latents, noise, timesteps, prediction_type):
        return noise if prediction_type == "epsilon" else scheduler.get_velocity(latents, noise, timesteps)

    def weight(self, scheduler, timesteps, prediction_type, snr_gamma):
        """Min-SNR-gamma (Hang et al. 2023), when train.snr_gamma is set: min(SNR, gamma) / SNR for epsilon,
        / (SNR + 1) for v-prediction."""
        if snr_gamma is None:
            return None
        from diffusers.training_utils import compute_snr

        snr = compute_snr(scheduler, timesteps)
        import torch

        weight = torch.minimum(snr, torch.full_like(snr, snr_gamma))
        return weight / snr if prediction_type == "epsilon" else weight / (snr + 1)


# --- rectified flow --------------------------------------------------------------------------------------------


def density_sample(scheme: str, generator: torch.Generator, logit_mean: float, logit_std: float, mode_scale: float):
    """u in (0, 1), the position on the path before any shift: "uniform"; "logit_normal", sigmoid of N(mean, std);
    "mode", 1 - u - s (cos^2(pi u / 2) - 1 + u) for uniform u (SD 3 paper, eq. 20)."""
    import torch

    if scheme == "logit_normal":
        return torch.sigmoid(logit_mean + logit_std * torch.randn((1,), generator=generator))
    u = torch.rand((1,), generator=generator)
    return mode_sample(u, mode_scale) if scheme == "mode" else u


def mode_sample(u: torch.Tensor, scale: float) -> torch.Tensor:
    """The SD 3 paper's mode sampling with heavy tails (eq. 20): 1 - u - s (cos^2(pi u / 2) - 1 + u)."""
    import torch

    return 1 - u - scale * (torch.cos(math.pi * u / 2) ** 2 - 1 + u)


def shift_sigma(sigma: torch.Tensor, shift: float) -> torch.Tensor:
    """SD 3's resolution shift: more of the path near noise, sigma' = s sigma / (1 + (s - 1) sigma)."""
    return shift * sigma / (1 + (shift - 1) * sigma)


def flux_mu(seq_len: int, base_seq: int = 256, max_seq: int = 4096, base_shift: float = 0.5, max_shift: float = 1.15):
    """Flux's shift exponent for an image of `seq_len` latent tokens: linear from base_shift at base_seq tokens to
    max_shift at max_seq (the Flux pipeline's calculate_shift)."""
    slope = (max_shift - base_shift) / (max_seq - base_seq)
    return base_shift + slope * (seq_len - base_seq)


def time_shift(mu: float, sigma: torch.Tensor) -> torch.Tensor:
    """Flux's shift: sigma' = e^mu / (e^mu + 1 / sigma - 1), the same as shift_sigma with s = e^mu."""
    return math.exp(mu) / (math.exp(mu) + 1 / sigma - 1)


def flow_weight(scheme: str, sigma: torch.Tensor) -> torch.Tensor | None:
    """The SD 3 paper's loss weights (diffusers' compute_loss_weighting_for_sd3): "sigma_sqrt", 1 / sigma^2;
    "cosmap", 2 / (pi (1 - 2 sigma + 2 sigma^2)); "none"."""
    if scheme == "sigma_sqrt":
        return sigma.float() ** -2.0
    if scheme == "cosmap":
        return 2 / (math.pi * (1 - 2 * sigma + 2 * sigma**2))
    return None


class FlowMatching(Objective):
    """Rectified flow (FlowMatchEulerDiscreteScheduler): x_t = (1 - sigma) x_0 + sigma noise with sigma = t / N, and
    the denoiser predicts the velocity noise - x_0. With `precondition` (SD 3, as diffusers' SD 3 examples offer)
    the prediction is turned into an x_0 estimate, x_t - sigma * pred, and compared with x_0 instead."""

    scheduler_class = "FlowMatchEulerDiscreteScheduler"

    def __init__(
        self,
        sampling: str = "logit_normal",
        logit_mean: float = 0.0,
        logit_std: float = 1.0,
        mode_scale: float = 1.29,
        shift: float | None = None,
        weighting: str = "none",
        precondition: bool = False,
    ):
        self.sampling, self.logit_mean, self.logit_std, self.mode_scale = sampling, logit_mean, logit_std, mode_scale
        self.shift, self.weighting, self.precondition = shift, weighting, precondition

    def sigma(self, scheduler, timesteps: torch.Tensor) -> torch.Tensor:
        return timesteps.float() / scheduler.config.num_train_timesteps

    def static_shift(self, scheduler) -> float:
        """The shift set here, else the scheduler's static one, as diffusers' training examples take it from the
        scheduler's sigmas; a scheduler that shifts by image size at sampling time (Flux's) trains unshifted."""
        if self.shift is not None:
            return self.shift
        config = scheduler.config
        return 1.0 if config.get("use_dynamic_shifting") else float(config.get("shift", 1.0))

    def timestep(self, generator, scheduler):
        u = density_sample(self.sampling, generator, self.logit_mean, self.logit_std, self.mode_scale)
        return shift_sigma(u.clamp(1e-5, 1.0), self.static_shift(scheduler)) * scheduler.config.num_train_timesteps

    def prediction(self, scheduler) -> str:
        return "flow_x0" if self.precondition else "flow"  # x_0 through SD 3's preconditioning, else the velocity

    def _sigma4(self, scheduler, timesteps, like: torch.Tensor) -> torch.Tensor:
        return self.sigma(scheduler, timesteps).to(like.device, like.dtype).view(-1, *[1] * (like.ndim - 1))

    def noisy(self, scheduler, latents, noise, timesteps):
        sigma = self._sigma4(scheduler, timesteps, latents)
        return (1 - sigma) * latents + sigma * noise

    def target(self, scheduler, latents, noise, timesteps, prediction_type):
        return latents if self.precondition else noise - latents

    def output(self, pred, noisy, scheduler, timesteps):
        if not self.precondition:
            return pred
        return noisy - self._sigma4(scheduler, timesteps, pred) * pred

    def weight(self, scheduler, timesteps, prediction_type, snr_gamma):
        return flow_weight(self.weighting, self.sigma(scheduler, timesteps))
