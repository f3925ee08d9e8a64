"""What a config will do, said before any work (`sdpipe check-config`): the model and where its weights come from,
what trains, resolution and precision, the step plan at this machine's GPU count, a rough memory estimate per GPU,
and the outputs. It reads config files and counts images; it loads no weights.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import model_facts
from sdpipe.errors import UserError
from sdpipe.models import families

if TYPE_CHECKING:
    from sdpipe.config import Config

# Activation memory per sample and megapixel of training resolution (eager, bf16): the whole-DAG peaks of
# benchmarks/NOTES.md v12 less weights, gradients and optimizer state. SD 1.5 at 512 px, batch 32: about 4.3 GB
# (50.1 GB full, 40.6 GB LoRA); SDXL LoRA at 1024 px, batch 8: about 7.5 GB (73.8 GB). Gradient checkpointing
# trades most of it for time; its factor here is a guess, not a measurement.
# Each family holds its figure (Family.activation_gb_per_mp).
CHECKPOINTING_FACTOR = 0.35
# Bytes per UNet parameter: full fine-tune = fp32 weights and gradients plus the optimizer's state; LoRA = frozen
# weights (the adapters' state is small).
BYTES_PER_PARAM = {"full": 8, "lora": 4}
# Optimizer state per trained parameter: AdamW's two fp32 moments, 8-bit AdamW's two uint8 ones (and a scale per
# block: 27 % of AdamW's state on the tiny UNet, tests/test_optimizers.py), Prodigy's four fp32 buffers, Adafactor's
# factored second moments (a row and a column per matrix: about nothing).
OPTIMIZER_BYTES = {"adamw": 8, "adamw_8bit": 2, "paged_adamw_8bit": 2, "prodigy": 16, "adafactor": 0}


def lines(cfg: Config) -> list[str]:
    denoiser = _denoiser_config(cfg)
    name = families.from_denoiser_config(denoiser).denoiser.replace("unet", "UNet") if denoiser else "denoiser"
    return [
        _model(cfg, denoiser),
        _training(cfg, name),
        _images(cfg),
        _schedule(cfg),
        _memory(cfg, denoiser),
        _outputs(cfg),
    ]


def _denoiser_config(cfg: Config) -> dict | None:
    """The denoiser's config (UNet or transformer): the preset's when one is built, else the model's own files
    (None if not found)."""
    found = model_facts.configs(cfg)
    return found[0] if found else None


def _model(cfg: Config, denoiser: dict | None) -> str:
    m = cfg.model
    if m.build_preset:
        return (
            f"model: a random-init {m.build_preset} preset built at {m.pretrained} (the demo's; real weights need "
            f"model.build_preset: null)"
        )
    from sdpipe import single_file, weights

    if single_file.is_checkpoint(m.pretrained):
        try:
            info = single_file.tensor_info(m.pretrained)
            name = families.named(single_file.family(m.pretrained, info)).title
        except UserError as exc:
            return f"model: UNUSABLE: {exc}"
        return f"model: {name} single-file checkpoint {m.pretrained}, converted to a diffusers folder on first use"
    try:
        where = weights.resolve(m.pretrained, m.revision)
    except UserError as exc:
        return f"model: NOT FOUND: {exc}"
    kind = "local folder" if weights.is_local(m.pretrained) else f"hub id in the cache ({where})"
    name = families.named(model_facts.family(denoiser)).title if denoiser else "unknown family (no denoiser config)"
    return f"model: {name} from {m.pretrained}, {kind}" + (f", variant {m.variant}" if m.variant else "")


def _training(cfg: Config, denoiser: str) -> str:
    t = cfg.train
    what = (
        f"LoRA rank {t.lora.rank}, alpha {t.lora.alpha} on the {denoiser}"
        if t.mode == "lora"
        else f"full fine-tune of the {denoiser}"
    )
    extra = [f"text encoder: {t.text_encoder.mode}"]
    if cfg.model.train_vae.enabled:
        extra.append(f"the VAE trained first ({cfg.model.train_vae.steps} steps)")
    if cfg.dreambooth.enabled:
        extra.append(f"DreamBooth with prior preservation (class: {cfg.dreambooth.class_prompt!r})")
    return f"training: {what}; " + "; ".join(extra)


def _images(cfg: Config) -> str:
    b = cfg.prepare.buckets
    return (
        f"images: buckets of about {b.resolution} px (sides multiples of {b.step}, aspect up to {b.max_aspect}); "
        f"latents {cfg.latents.dtype}; mixed precision {cfg.train.mixed_precision}"
    )


def _processes(cfg: Config) -> tuple[int, int]:
    """(GPUs this machine shows, training processes)."""
    from sdpipe.parallel import detect_gpu_count

    gpus = detect_gpu_count()
    wanted = cfg.train.num_processes
    return gpus, (max(1, gpus) if wanted == "auto" else int(wanted))


def _training_images(cfg: Config) -> int | None:
    """Images in data.raw_dir less the held-out share (sidecar captions aside); None without the folder."""
    from sdpipe.prepare.files import scan

    raw = Path(cfg.data.raw_dir)
    if not raw.is_dir():
        return None
    return round(len(scan(raw, cfg.data.caption_extensions)[0]) * (1 - cfg.prepare.eval_fraction))


def _schedule(cfg: Config) -> str:
    t = cfg.train
    gpus, procs = _processes(cfg)
    batch = procs * t.per_device_batch_size * t.grad_accum_steps
    head = (
        f"schedule: {gpus} GPU(s) here, {procs} process(es) x {t.per_device_batch_size} per device x "
        f"{t.grad_accum_steps} accumulation = global batch {batch}"
    )
    images = _training_images(cfg)
    if not images:
        steps = f"{t.max_steps} optimizer steps" if t.max_steps else f"{t.epochs} epoch(s)"
        return f"{head}; {steps} (no images in {cfg.data.raw_dir} yet to count epochs)"
    if t.max_steps:
        return (
            f"{head}; {t.max_steps} optimizer steps, about {t.max_steps * batch / images:.1f} epochs of {images} images"
        )
    return f"{head}; {t.epochs} epoch(s) of {images} images, about {t.epochs * math.ceil(images / batch)} steps"


def memory_gb(
    family: str,
    unet_params: int,
    mode: str,
    per_device_batch: int,
    resolution: int,
    checkpointing: bool,
    optimizer: str = "adamw",
) -> tuple[float, float]:
    """(weights and optimizer state, activations) in GB per GPU, by the rule of thumb above."""
    per_param = BYTES_PER_PARAM[mode] + (OPTIMIZER_BYTES[optimizer] if mode == "full" else 0)
    state = unet_params * per_param / 1e9
    acts = per_device_batch * resolution**2 / 1e6 * families.named(family).activation_gb_per_mp
    return state, acts * (CHECKPOINTING_FACTOR if checkpointing else 1.0)


def _memory(cfg: Config, denoiser: dict | None) -> str:
    if denoiser is None:
        return "memory per GPU: unknown (the denoiser's config is not found)"
    from accelerate import init_empty_weights

    with init_empty_weights():
        family = families.from_denoiser_config(denoiser)
        params = sum(p.numel() for p in family.denoiser_type().from_config(denoiser).parameters())
    t = cfg.train
    state, acts = memory_gb(
        family.name,
        params,
        t.mode,
        t.per_device_batch_size,
        max([cfg.prepare.buckets.resolution, *cfg.prepare.buckets.also_at]),  # the largest sets the peak
        t.gradient_checkpointing,
        t.optimizer,
    )
    return (
        f"memory per GPU: about {state + acts:.0f} GB ({params / 1e6:.0f}M {family.denoiser} parameters: "
        f"{state:.1f} GB of weights and optimizer state, {acts:.1f} GB of activations; a rule of thumb from "
        "measured peaks)"
    )


def _outputs(cfg: Config) -> str:
    from sdpipe.export.names import for_config

    exported = for_config(cfg).files()
    files = [f"results/export/{path}" + ("/" if name == "diffusers" else "") for name, path in exported.items()]
    return "outputs: " + ", ".join(
        files + ["results/evaluate/metrics.json", "results/report/index.html", "results/card/README.md"]
    )
