"""Train the pipeline's VAE (AutoencoderKL) on a small image domain, e.g. the embedded demo from scratch.

A randomly initialised VAE gives meaningless latents, so a diffusion model trained on them cannot learn anything
visible. This trains the VAE's encoder and decoder on the images themselves: reconstruction loss (MSE or L1, in
the [-1, 1] pixel range) plus a small KL term that keeps the latent space smooth, with AdamW and a cosine schedule.
Afterwards the latent scale is re-measured (`scaling_factor` = 1 / std of the latents the latents stage would
cache) and written into the VAE config, so diffusion sees unit-variance latents.

Images are decoded and cropped exactly as the latents stage does (sdpipe.images + sdpipe.preprocess), into a
square `resolution` bucket, and held in memory as uint8: this is for small domains (thousands of images).
The output is a new pipeline folder: a copy of the base pipeline with the trained vae/, written atomically.
"""

from __future__ import annotations

import logging
import math
import shutil
import time
from pathlib import Path

import torch

from sdpipe import images as sd_images
from sdpipe.errors import UserError
from sdpipe.io import atomic_dir
from sdpipe.log import progress
from sdpipe.preprocess import Preprocess, cover_and_crop, to_model_range, to_uint8

log = logging.getLogger(__name__)
EVAL_IMAGES = 256


def load_pixels(
    paths: list[Path], resolution: int, background=(255, 255, 255), interpolation: str = "lanczos"
) -> torch.Tensor:
    """[N, 3, R, R] uint8: each image decoded, scaled to cover the square bucket and centre-cropped."""
    if not paths:
        raise UserError("VAE training needs at least one image")
    p = Preprocess(bucket=(resolution, resolution), interpolation=interpolation, background=tuple(background))
    out = []
    for path in paths:
        try:
            img = sd_images.load_rgb(Path(path), background=p.background)
        except sd_images.ImageRejected as exc:
            raise UserError(f"VAE training: cannot use {path}: {exc}") from None
        out.append(to_uint8(cover_and_crop(img, p, str(path))[0]))
    return torch.stack(out)


@torch.no_grad()
def reconstruction_error(vae, pixels: torch.Tensor, batch_size: int = 64) -> list[float]:
    """Mean absolute error per RGB channel, in 8-bit levels, decoding each image's posterior mean."""
    device, total = next(vae.parameters()).device, torch.zeros(3, dtype=torch.float64)
    for i in range(0, len(pixels), batch_size):
        x = to_model_range(pixels[i : i + batch_size], device)
        y = vae.decode(vae.encode(x).latent_dist.mean).sample.clamp(-1, 1)
        total += ((y - x).abs() * 127.5).mean(dim=(2, 3)).sum(dim=0).double().cpu()
    return [round(float(v), 3) for v in total / len(pixels)]


@torch.no_grad()
def measure_scaling_factor(vae, pixels: torch.Tensor, batch_size: int = 64) -> tuple[float, float]:
    """(1 / std, mean) of the posterior means: the latents the latents stage caches and training scales."""
    device = next(vae.parameters()).device
    means = [
        vae.encode(to_model_range(pixels[i : i + batch_size], device)).latent_dist.mean.cpu()
        for i in range(0, len(pixels), batch_size)
    ]
    latents = torch.cat(means).double()
    return float(1.0 / latents.std()), float(latents.mean())


def vae_loss(
    vae, x: torch.Tensor, generator: torch.Generator, kl_weight: float, reconstruction: str
) -> tuple[torch.Tensor, float]:
    """(loss, reconstruction part): decode a posterior sample; KL is per latent element (mean), times kl_weight."""
    posterior = vae.encode(x).latent_dist
    noise = torch.randn(posterior.mean.shape, generator=generator).to(x.device)
    y = vae.decode(posterior.mean + posterior.std * noise).sample
    recon = (y - x).abs().mean() if reconstruction == "l1" else (y - x).pow(2).mean()
    kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
    return recon + kl_weight * kl, float(recon.detach())


def _check(steps: int, batch_size: int, reconstruction: str, resolution: int, factor: int) -> None:
    if steps < 1 or batch_size < 1:
        raise UserError(f"VAE training needs steps >= 1 and batch_size >= 1 (got {steps}, {batch_size})")
    if reconstruction not in ("l1", "mse"):
        raise UserError(f"VAE reconstruction loss must be l1 or mse, got {reconstruction!r}")
    if resolution % factor:
        raise UserError(f"VAE training resolution {resolution} is not divisible by the VAE's downsampling {factor}")


def _optimise(
    vae,
    pixels: torch.Tensor,
    *,
    steps: int,
    batch_size: int,
    learning_rate: float,
    kl_weight: float,
    seed: int,
    reconstruction: str,
) -> list[float]:
    """The training loop; returns the reconstruction loss of every step."""
    from diffusers.optimization import get_scheduler

    device = next(vae.parameters()).device
    optimizer = torch.optim.AdamW(vae.parameters(), lr=learning_rate, weight_decay=0.01, fused=True)
    schedule = get_scheduler("cosine", optimizer, num_warmup_steps=min(50, steps // 10), num_training_steps=steps)
    gen, order, losses = torch.Generator().manual_seed(seed), torch.empty(0, dtype=torch.long), []
    vae.train()
    with progress(steps, "VAE training") as advance:
        for _ in range(steps):
            if len(order) < batch_size:  # a fresh shuffle per pass, the leftover of the last one first
                order = torch.cat([order, torch.randperm(len(pixels), generator=gen)])
            idx, order = order[:batch_size], order[batch_size:]
            x = to_model_range(pixels[idx], device)
            flip = torch.rand(len(idx), generator=gen) < 0.5  # horizontal flips: free augmentation
            x = torch.where(flip.to(device)[:, None, None, None], x.flip(-1), x)
            loss, recon = vae_loss(vae, x, gen, kl_weight, reconstruction)
            optimizer.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(vae.parameters(), 1.0)
            optimizer.step()
            schedule.step()
            losses.append(recon)
            if not math.isfinite(recon):
                raise UserError(f"VAE loss is {recon} at step {len(losses)}; lower the learning rate")
            advance(1)
    vae.eval()
    return losses


def _write(base_dir: Path, vae, out_dir: Path) -> None:
    """out_dir = the base pipeline with this vae/, replaced atomically (base_dir itself is never modified)."""
    with atomic_dir(out_dir) as tmp:
        shutil.copytree(base_dir, tmp, dirs_exist_ok=True, ignore=shutil.ignore_patterns("vae"))
        vae.save_pretrained(tmp / "vae", safe_serialization=True)


def train_vae(
    base_dir: Path,
    images: list[Path],
    out_dir: Path,
    *,
    resolution: int = 32,
    steps: int = 600,
    batch_size: int = 32,
    learning_rate: float = 1e-3,
    kl_weight: float = 1e-6,
    seed: int = 0,
    device: str = "cpu",
    reconstruction: str = "mse",
    background=(255, 255, 255),
) -> dict:
    """Train base_dir's vae/ on `images`; write base_dir + the trained VAE to out_dir; return statistics."""
    from diffusers import AutoencoderKL

    base_dir, out_dir, start = Path(base_dir), Path(out_dir), time.perf_counter()
    if not (base_dir / "vae" / "config.json").is_file():
        raise UserError(f"{base_dir} has no vae/ folder; VAE training needs a diffusers pipeline folder")
    if out_dir.resolve() == base_dir.resolve():
        raise UserError("VAE training writes a new pipeline folder; choose an output other than the base model")
    torch.manual_seed(seed)
    vae = AutoencoderKL.from_pretrained(base_dir, subfolder="vae", torch_dtype=torch.float32).to(device)
    _check(steps, batch_size, reconstruction, resolution, 2 ** (len(vae.config.block_out_channels) - 1))
    pixels = load_pixels(images, resolution, background)
    probe = pixels[torch.randperm(len(pixels), generator=torch.Generator().manual_seed(seed))[:EVAL_IMAGES]]
    vae.eval()
    before = reconstruction_error(vae, probe)
    losses = _optimise(
        vae,
        pixels,
        steps=steps,
        batch_size=batch_size,
        learning_rate=learning_rate,
        kl_weight=kl_weight,
        seed=seed,
        reconstruction=reconstruction,
    )
    scale, mean = measure_scaling_factor(vae, probe)
    vae.register_to_config(scaling_factor=scale)
    _write(base_dir, vae.to("cpu"), out_dir)
    tail = losses[-min(20, len(losses)) :]
    stats = {
        "images": len(pixels),
        "steps": steps,
        "final_loss": round(sum(tail) / len(tail), 5),
        "rgb_error_before": before,
        "rgb_error": reconstruction_error(vae, probe),
        "scaling_factor": round(scale, 6),
        "latent_mean": round(mean, 4),
        "seconds": round(time.perf_counter() - start, 2),
    }
    log.info("VAE trained: %s", stats)
    return stats
