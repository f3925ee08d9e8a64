"""The plain baseline: the training loop of diffusers' examples/text_to_image (train_text_to_image.py and its
SDXL twin): fp32 master weights under bf16 autocast, AdamW with foreach, eager, default SDPA attention, the
scheduler's add_noise, MSE on the noise, gradient clipping at 1.0. Its data are random tensors already on the GPU,
so it pays nothing for loading (which flatters it)."""

from __future__ import annotations

import time

import torch

from sdpipe.models import families


def shapes(preset: str, resolution: int) -> dict:
    """Latent (C, H, W) and text-conditioning sizes of a preset's UNet at `resolution` px."""
    from sdpipe.models import presets

    u, v = presets.unet_config(preset), presets.vae_config(preset)
    side = resolution // 2 ** (len(v["block_out_channels"]) - 1)
    out = {"latent": (u["in_channels"], side, side), "context": (77, u["cross_attention_dim"])}
    if u.get("addition_embed_type") == "text_time":
        out["pooled"] = u["projection_class_embeddings_input_dim"] - 6 * u["addition_time_embed_dim"]
        out["size"] = resolution
    return out


def random_cond(preset: str, resolution: int, batch: int, device, gen: torch.Generator) -> dict:
    """Latents and text states in the layout sdpipe's cache gives the step ("hidden"; SDXL "pooled", "time_ids")."""
    s = shapes(preset, resolution)
    out = {
        "latents": torch.randn(batch, *s["latent"], generator=gen).to(device),
        "hidden": torch.randn(batch, *s["context"], generator=gen).to(device),
    }
    if "pooled" in s:
        size = s["size"]
        out["pooled"] = torch.randn(batch, s["pooled"], generator=gen).to(device)
        out["time_ids"] = torch.tensor([[size, size, 0, 0, size, size]] * batch, dtype=torch.float32, device=device)
    return out


def build_unet(preset: str, device, seed: int = 0):
    from diffusers import UNet2DConditionModel

    from sdpipe.models import presets

    torch.manual_seed(seed)
    return UNet2DConditionModel(**presets.unet_config(preset)).to(device).train()


def autocast(device):
    return torch.autocast(torch.device(device).type, dtype=torch.bfloat16)


def step(
    unet, optimizer, scheduler, data: dict, noise: torch.Tensor, timesteps: torch.Tensor, mixed: bool = True
) -> torch.Tensor:
    """One optimizer step of the example loop; returns the loss (not read back, so the host never waits)."""
    import contextlib

    noisy = scheduler.add_noise(data["latents"], noise, timesteps)
    added = families.added_conditioning(data)
    with autocast(noise.device) if mixed else contextlib.nullcontext():
        pred = unet(noisy, timesteps, encoder_hidden_states=data["hidden"], added_cond_kwargs=added).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss.detach()


def flops_per_sample(unet, preset: str, resolution: int, device) -> float:
    """Forward + backward FLOPs of one sample, counted by torch.utils.flop_counter on the eager model."""
    from torch.utils.flop_counter import FlopCounterMode

    data = random_cond(preset, resolution, 2, device, torch.Generator().manual_seed(0))
    added = families.added_conditioning(data)
    with FlopCounterMode(display=False) as counter:
        with autocast(device):
            pred = unet(
                data["latents"],
                torch.tensor([10, 500], device=device),
                encoder_hidden_states=data["hidden"],
                added_cond_kwargs=added,
            ).sample
        pred.float().pow(2).mean().backward()
    unet.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


def sync(device) -> None:
    if torch.device(device).type == "cuda":
        torch.cuda.synchronize()


def peak_gib(device) -> float | None:
    if torch.device(device).type != "cuda":
        return None
    return torch.cuda.max_memory_allocated() / 2**30


def _timed_steps(n: int, unet, optimizer, scheduler, data: dict, device) -> float:
    batch = data["latents"].shape[0]
    start = time.perf_counter()
    for _ in range(n):
        noise = torch.randn_like(data["latents"])
        t = torch.randint(0, scheduler.config.num_train_timesteps, (batch,), device=device)
        step(unet, optimizer, scheduler, data, noise, t)
    sync(device)
    return time.perf_counter() - start


def measure(preset: str, resolution: int, batch: int, steps: int, warmup: int, device) -> dict:
    """Samples/s of the example loop after `warmup` steps; also the model's FLOPs per sample."""
    from sdpipe.models import presets

    unet = build_unet(preset, device)
    flops = flops_per_sample(unet, preset, resolution, device)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, foreach=True)
    scheduler = presets.scheduler(preset)
    data = random_cond(preset, resolution, batch, device, torch.Generator().manual_seed(1))
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats()

    warm = _timed_steps(warmup, unet, optimizer, scheduler, data, device)
    seconds = _timed_steps(steps, unet, optimizer, scheduler, data, device)
    row = {
        "name": f"baseline: diffusers example loop, eager, batch {batch}",
        "kind": "baseline",
        "batch": batch,
        "samples_per_s": batch * steps / seconds,
        "warmup_s": warm,
        "peak_memory_gib": peak_gib(device),
    }
    del unet, optimizer
    if torch.device(device).type == "cuda":
        torch.cuda.empty_cache()
    return {**row, "gflops_per_sample": flops / 1e9}
