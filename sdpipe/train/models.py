"""What training optimises: the UNet (full or LoRA adapters), its optimizer and LR schedule."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

MIXED = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}


def _check_targets(model, targets: list[str], key: str, typical: str) -> None:
    names = {n for n, _ in model.named_modules()}
    missing = [t for t in targets if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise UserError(f"{key}: {missing} match no module of this model (typical: {typical})")


def add_lora(
    model,
    lora_cfg,
    target_modules: list[str] | None = None,
    key: str = "train.lora.target_modules",
    typical: str = "to_q, to_k, to_v, to_out.0",
) -> None:
    """Freeze `model` (a UNet or a text encoder) and add peft adapters (train.lora.type) on the target modules."""
    targets = list(target_modules or lora_cfg.target_modules)
    _check_targets(model, targets, key, typical)
    model.requires_grad_(False)
    config = adapter_config(lora_cfg, targets)
    if hasattr(model, "set_adapters"):  # a diffusers model
        model.add_adapter(config)
    else:
        # transformers' own add_adapter demands a newer peft than diffusers does; peft's injection is the same
        # operation (and what diffusers does for its models).
        from peft import inject_adapter_in_model

        inject_adapter_in_model(config, model, adapter_name="default")
        model.peft_config = {"default": config}


def adapter_config(lora_cfg, targets: list[str]):
    """peft's config for train.lora. Each starts as an identity (an update of zero): LoRA and DoRA with B = 0,
    LoHa with one factor's second matrix 0, LoKr with its second factor 0."""
    from peft import LoHaConfig, LoKrConfig, LoraConfig

    if lora_cfg.type == "loha":
        return LoHaConfig(
            r=lora_cfg.rank, alpha=lora_cfg.alpha, module_dropout=lora_cfg.dropout, target_modules=targets
        )
    if lora_cfg.type == "lokr":
        # peft's default layout is LyCORIS' default too: the small factor w1 whole, the large w2 as w2_a @ w2_b
        return LoKrConfig(
            r=lora_cfg.rank, alpha=lora_cfg.alpha, module_dropout=lora_cfg.dropout, target_modules=targets
        )
    return LoraConfig(
        r=lora_cfg.rank,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        init_lora_weights="gaussian",
        use_dora=lora_cfg.dora,
        target_modules=targets,
    )


def add_text_lora(encoder, cfg: Config) -> None:
    add_lora(
        encoder,
        cfg.train.lora,
        cfg.train.text_encoder.lora_target_modules,
        "train.text_encoder.lora_target_modules",
        "q_proj, k_proj, v_proj, out_proj",
    )


def build_unet(cfg: Config, device):
    from sdpipe.models import loading

    unet = loading.load_unet(
        cfg.model.pretrained, cfg.model.revision, cfg.model.variant, dtype=torch.float32, device="cpu"
    )
    if cfg.train.mode == "lora":
        add_lora(unet, cfg.train.lora)
        freeze_in(unet, cfg.train.mixed_precision)
    if cfg.train.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    unet.to(device)
    prepare_for_gpu_compile(cfg, unet, torch.device(device))  # before DDP wraps it: its buckets take the layout
    return unet


# `train.compile: auto` compiles the whole UNet only for runs that train on at least this many samples per GPU.
# SD 1.5 at batch 32 on an H200 (benchmarks/NOTES.md v12): eager 97.9 samples/s, whole-UNet compiled 146.6 after
# 251 s of compiling on cold caches, so the compile is repaid after about 74,000 samples; the blocks compiled one
# by one took longer still (more than 160 s before the first step).
COMPILE_FROM_SAMPLES = 100_000


def resolve_compile(cfg: Config, device, samples_per_process: int):
    """`cfg` with train.compile: auto decided for this run: the whole UNet compiled on a GPU when the run is long
    enough to repay the compile, else eager."""
    import dataclasses

    if cfg.train.compile != "auto":
        return cfg
    long_run = torch.device(device).type == "cuda" and samples_per_process >= COMPILE_FROM_SAMPLES
    train = dataclasses.replace(cfg.train, compile="compiled" if long_run else "eager")
    resolved = dataclasses.replace(cfg, train=train)
    object.__setattr__(resolved, "raw", cfg.raw)
    return resolved


def compile_mode(cfg: Config, device) -> str:
    """What `train.compile` means on this device: "whole" (the UNet as one graph), "blocks" (each UNet block
    compiled on its own) or "eager". An undecided `auto` (see resolve_compile) compiles the whole UNet on a GPU and
    nothing on a CPU."""
    mode = cfg.train.compile
    if mode == "auto":
        return "whole" if torch.device(device).type == "cuda" else "eager"
    return {"compiled": "whole"}.get(mode, mode)


def compiles(cfg: Config, device) -> bool:
    return compile_mode(cfg, device) != "eager"


def prepare_for_gpu_compile(cfg: Config, unet, device) -> None:
    """When the step is compiled on a GPU, what makes it fast there, measured one by one in benchmarks/NOTES.md:
    the channels-last layers of sdpipe.models.layout, cuDNN's autotuner (the compiled step has one shape per
    bucket, so it tunes once), and the GEGLU without a cat in its backward (+2.2 %, v9)."""
    from sdpipe.models.geglu import use_split_geglu
    from sdpipe.models.layout import channels_last_for_compile

    if device.type != "cuda" or not compiles(cfg, device):
        return
    torch.backends.cudnn.benchmark = True
    channels_last_for_compile(unet)
    use_split_geglu(unet)


def training_forward(cfg: Config, unet, device):
    """The callable the training step runs the UNet through. Only the training step is compiled: validation and
    saving use `unet` itself, so sampling triggers no second compile. "whole": a new bucket shape recompiles the
    UNet once, after that shapes are dynamic; "blocks": each block shape compiles once (sdpipe.models.regions)."""
    from sdpipe.models.regions import compile_regions

    mode = compile_mode(cfg, device)
    if mode == "whole":
        return torch.compile(unet)
    return compile_regions(unet) if mode == "blocks" else unet


def build_text_stack(cfg: Config, device):
    """The text encoder(s) in fp32, trainable (full or LoRA), when train.text_encoder.mode is not none."""
    from sdpipe.models import loading

    mode = cfg.train.text_encoder.mode
    if mode == "none":
        return None
    stack = loading.load_text_stack(
        cfg.model.pretrained, cfg.model.revision, cfg.model.variant, dtype=torch.float32, device="cpu"
    )
    for encoder in stack.encoders:
        if mode == "lora":
            add_text_lora(encoder, cfg)
        else:
            encoder.requires_grad_(True)
        if cfg.train.gradient_checkpointing:
            encoder.gradient_checkpointing_enable()
        encoder.train()
        encoder.to(device)
    stack.device = torch.device(device)  # token ids go where the encoders are
    return stack


def build_optimizer(cfg: Config, unet, text_encoders: list) -> torch.optim.Optimizer:
    """train.optimizer (sdpipe/train/optimizers.py) over the UNet's trainable weights and, in a group with its own
    learning rate, the text encoders'."""
    from sdpipe.train import optimizers

    t = cfg.train
    groups: list[dict[str, Any]] = [{"params": trainable(unet)}]
    if text_encoders:
        groups.append(
            {
                "params": [p for e in text_encoders for p in trainable(e)],
                "lr": t.text_encoder.learning_rate or t.learning_rate,
            }
        )
    return optimizers.build(groups, t)


def build_lr_scheduler(cfg: Config, optimizer, total_steps: int):
    """Stepped by the loop once per optimizer step: never passed through accelerator.prepare, whose wrapper
    would step it once per process and end the schedule early on several GPUs (the known trap)."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(
        cfg.train.lr_scheduler, optimizer, num_warmup_steps=cfg.train.lr_warmup_steps, num_training_steps=total_steps
    )


def build_ema(cfg: Config, params: list, accelerator):
    """An EMA of the trained parameters (on their device), checkpointed with the rest; None when disabled."""
    if not cfg.train.ema.enabled:
        return None
    from diffusers.training_utils import EMAModel

    ema = EMAModel(params, decay=cfg.train.ema.decay)
    ema.to(accelerator.device)
    accelerator.register_for_checkpointing(ema)
    return ema


FROZEN_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def freeze_in(model, mixed_precision: str) -> None:
    """Keep a LoRA run's frozen base weights in the mixed-precision dtype, as diffusers' LoRA scripts do: autocast
    computes in it anyway, and fp32 copies would double the memory (FLUX.1's transformer: 48 GB instead of 24). The
    adapters, which the optimizer updates, stay fp32."""
    dtype = FROZEN_DTYPES.get(mixed_precision)
    if dtype is None:
        return
    for param in model.parameters():
        if not param.requires_grad:
            param.data = param.data.to(dtype)


def trainable(model) -> list[torch.nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def _lora_layers(name: str, model) -> dict:
    from peft.utils import get_peft_model_state_dict

    # The adapter metadata carries lora_alpha: without it diffusers reloads with alpha = rank (wrong scale).
    return {
        f"{name}_lora_layers": get_peft_model_state_dict(model),
        f"{name}_lora_adapter_metadata": model.peft_config["default"].to_dict(),
    }


def _save_weights(models: dict, modes: dict, folder, family: str) -> None:
    """Full models in diffusers folders (unet/, text_encoder/, ...); LoRA adapters in one diffusers/peft file,
    written by the family's pipeline (only SDXL's knows text_encoder_2)."""
    from sdpipe.models import families

    lora = {}
    for name, model in models.items():
        if modes[name] == "lora":
            lora.update(_lora_layers(name, model))
        else:
            model.save_pretrained(str(folder / name))
    if lora:
        families.named(family).pipeline().save_lora_weights(str(folder), **lora)


def save_final(accelerator, trained: dict, modes: dict, out, info: dict, ema=None) -> None:
    """Rank 0 writes the trained weights (component name -> wrapped model, trained fully or as LoRA), with EMA
    the averaged weights too in the same layout under ema/, and final.json saying what the folder holds (`info`,
    with the model family's name)."""
    from sdpipe import io

    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    models = {name: accelerator.unwrap_model(m) for name, m in trained.items()}
    with io.atomic_dir(out) as tmp:
        _save_weights(models, modes, tmp, info["family"])
        if ema is not None:
            params = [p for m in models.values() for p in trainable(m)]
            ema.store(params)
            ema.copy_to(params)
            (tmp / "ema").mkdir()
            _save_weights(models, modes, tmp / "ema", info["family"])
            ema.restore(params)
        io.write_json(tmp / "final.json", {**info, "components": modes, "ema": ema is not None})
