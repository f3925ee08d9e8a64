"""No speed from skipping work: sdpipe's optimised step against the baseline, same weights, data and noise.

Three runs start from one set of UNet weights and see the same latents, text states, noise and timesteps (drawn
by sdpipe's own per-sample generators) for a few optimizer steps:
- baseline: the diffusers example step (bf16 autocast, eager, AdamW foreach);
- sdpipe: the train stage's own pieces: `training_forward` (compiled on a GPU), `objective.sample_losses`,
  `build_optimizer` (fused AdamW on a GPU);
- fp32: the example step without autocast, eager, TF32 off: the yardstick of what mixed precision itself moves.
The check passes when sdpipe's losses match the baseline's to bf16 tolerance and its weights stray from the
baseline's no further than twice as far as the fp32 run's do.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from sdpipe.bench import baseline

if TYPE_CHECKING:
    from sdpipe.config import Config

LOSS_RTOL = 2e-2  # bf16 keeps 8 significant bits (relative step 2^-8 = 0.4 %); a mean over a batch drifts more
WEIGHT_FACTOR = 2.0


def _config(pretrained: str, lr: float):
    from sdpipe import config

    return config.from_dict(
        {
            "model": {"pretrained": pretrained},
            "data": {"raw_dir": "unused"},
            "train": {
                "learning_rate": lr,
                "max_grad_norm": 1.0,
                "noise_offset": 0.0,
                "snr_gamma": None,
                "input_perturbation": 0.0,
                "caption_dropout": 0.0,
            },
        }
    )


def _draws(preset: str, resolution: int, batch: int, steps: int, cfg: Config, device) -> list[dict]:
    from sdpipe.models import families, presets
    from sdpipe.train import objective

    shape = baseline.shapes(preset, resolution)["latent"]
    scheduler, family = presets.scheduler(preset), families.named(presets.family(preset))
    out = []
    for s in range(steps):
        gens = [objective.sample_generator(cfg.seed, s, i) for i in range(batch)]
        timestep = lambda g: family.objective.timestep(g, scheduler)
        out.append({k: v.to(device) for k, v in objective.draw(shape, gens, timestep, cfg.train).items()})
    return out


def _baseline_run(unet, cfg: Config, data, draws, scheduler, mixed: bool) -> list[float]:
    t = cfg.train
    opt = torch.optim.AdamW(
        unet.parameters(),
        lr=t.learning_rate,
        betas=(t.adam_beta1, t.adam_beta2),
        weight_decay=t.adam_weight_decay,
        eps=t.adam_epsilon,
        foreach=True,
    )
    return [float(baseline.step(unet, opt, scheduler, data, d["noise"], d["timesteps"], mixed)) for d in draws]


def _sdpipe_run(unet, cfg: Config, data, draws, scheduler, device) -> list[float]:
    from sdpipe.models import families
    from sdpipe.train import objective
    from sdpipe.train.models import build_optimizer, prepare_for_gpu_compile, training_forward

    prepare_for_gpu_compile(cfg, unet, device)  # what build_unet does for the train stage
    forward = training_forward(cfg, unet, device)
    opt = build_optimizer(cfg, unet, [])
    losses, family = [], families.from_denoiser_config(dict(unet.config))
    for d in draws:
        autocast = lambda: baseline.autocast(device)
        loss = objective.sample_losses(
            forward, family, scheduler, data["latents"], d, data, cfg.train, "epsilon", autocast
        ).mean()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), cfg.train.max_grad_norm)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))
    return losses


def _distance(a: dict, b: dict) -> float:
    return float(torch.sqrt(sum(((a[k].double() - b[k].double()) ** 2).sum() for k in a)))


def check(
    preset: str, resolution: int, pretrained: str, device, batch: int = 4, steps: int = 3, lr: float = 1e-4
) -> dict:
    """Run the three trainings; return their losses, the deviations and the verdict."""
    from sdpipe.models import presets

    device = torch.device(device)
    cfg = _config(pretrained, lr)
    scheduler = presets.scheduler(preset)
    unet = baseline.build_unet(preset, device)
    start = {k: v.detach().cpu().clone() for k, v in unet.state_dict().items()}
    data = baseline.random_cond(preset, resolution, batch, device, torch.Generator().manual_seed(2))
    draws = _draws(preset, resolution, batch, steps, cfg, device)
    runs, weights = {}, {}
    for name in ("baseline", "sdpipe", "fp32"):
        unet.load_state_dict(start)
        model = unet  # torch.compile wraps it for the sdpipe run; the module itself stays eager
        tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        if name == "fp32":
            torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = False
        try:
            runs[name] = (
                _sdpipe_run(model, cfg, data, draws, scheduler, device)
                if name == "sdpipe"
                else _baseline_run(model, cfg, data, draws, scheduler, mixed=name == "baseline")
            )
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32
        weights[name] = {k: v.detach().cpu().clone() for k, v in model.state_dict().items()}
        del model
    return verdict(runs, weights, start, batch, steps, lr)


def verdict(runs: dict, weights: dict, start: dict, batch: int, steps: int, lr: float) -> dict:
    rel = lambda name: max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(runs[name], runs["baseline"]))
    moved = _distance(weights["baseline"], start)
    dev = {name: _distance(weights[name], weights["baseline"]) / moved for name in ("sdpipe", "fp32")}
    ok = rel("sdpipe") <= LOSS_RTOL and dev["sdpipe"] <= WEIGHT_FACTOR * dev["fp32"]
    return {
        "batch": batch,
        "steps": steps,
        "learning_rate": lr,
        "losses": runs,
        "loss_max_rel_diff": {"sdpipe": rel("sdpipe"), "fp32": rel("fp32")},
        "weight_deviation": dev,
        "loss_rtol": LOSS_RTOL,
        "weight_factor": WEIGHT_FACTOR,
        "passed": ok,
        "rule": f"sdpipe loss within {LOSS_RTOL:g} relative of the baseline's at every step, and its weights "
        f"at most {WEIGHT_FACTOR:g}x as far from the baseline's as the fp32 run's (distances relative "
        "to how far the baseline moved)",
    }
