"""What training optimises: the UNet (full or LoRA adapters), its optimizer and LR schedule."""

from __future__ import annotations

import torch

from sdpipe.errors import UserError

MIXED = {"fp32": "no", "fp16": "fp16", "bf16": "bf16"}


def add_lora(unet, lora_cfg) -> None:
    """Freeze the UNet and add peft LoRA adapters on the configured modules."""
    from peft import LoraConfig

    names = {name.rsplit(".", 1)[-1] for name, _ in unet.named_modules()} | {n for n, _ in unet.named_modules()}
    missing = [t for t in lora_cfg.target_modules if not any(n == t or n.endswith("." + t) for n in names)]
    if missing:
        raise UserError(f"train.lora.target_modules: {missing} match no module of this UNet "
                        "(typical: to_q, to_k, to_v, to_out.0)")
    unet.requires_grad_(False)
    unet.add_adapter(LoraConfig(r=lora_cfg.rank, lora_alpha=lora_cfg.alpha, lora_dropout=lora_cfg.dropout,
                                init_lora_weights="gaussian", target_modules=list(lora_cfg.target_modules)))


def build_unet(cfg, device):
    from sdpipe.models import loading

    unet = loading.load_unet(cfg.model.pretrained, cfg.model.revision, cfg.model.variant, dtype=torch.float32,
                             device="cpu")
    if cfg.train.mode == "lora":
        add_lora(unet, cfg.train.lora)
    if cfg.train.gradient_checkpointing:
        unet.enable_gradient_checkpointing()
    unet.train()
    return unet.to(device)


def build_optimizer(cfg, params: list, on_gpu: bool) -> torch.optim.Optimizer:
    t = cfg.train
    return torch.optim.AdamW(params, lr=t.learning_rate, betas=(t.adam_beta1, t.adam_beta2),
                             weight_decay=t.adam_weight_decay, eps=t.adam_epsilon, fused=on_gpu)


def build_lr_scheduler(cfg, optimizer, total_steps: int):
    """Stepped by the loop once per optimizer step: never passed through accelerator.prepare, whose wrapper
    would step it once per process and end the schedule early on several GPUs (the known trap)."""
    from diffusers.optimization import get_scheduler

    return get_scheduler(cfg.train.lr_scheduler, optimizer, num_warmup_steps=cfg.train.lr_warmup_steps,
                         num_training_steps=total_steps)


def build_ema(cfg, unet, accelerator):
    """An EMA of the trained parameters (on their device), checkpointed with the rest; None when disabled."""
    if not cfg.train.ema.enabled:
        return None
    from diffusers.training_utils import EMAModel

    ema = EMAModel(trainable(unet), decay=cfg.train.ema.decay)
    ema.to(accelerator.device)
    accelerator.register_for_checkpointing(ema)
    return ema


def trainable(unet) -> list[torch.nn.Parameter]:
    return [p for p in unet.parameters() if p.requires_grad]


def _save_weights(model, mode: str, folder) -> None:
    if mode == "lora":
        from diffusers import StableDiffusionPipeline
        from peft.utils import get_peft_model_state_dict

        # The adapter metadata carries lora_alpha: without it diffusers reloads with alpha = rank (wrong scale).
        StableDiffusionPipeline.save_lora_weights(str(folder), unet_lora_layers=get_peft_model_state_dict(model),
                                                  unet_lora_adapter_metadata=model.peft_config["default"].to_dict())
    else:
        model.save_pretrained(str(folder / "unet"))


def save_final(accelerator, unet, mode: str, out, ema=None) -> None:
    """Rank 0 writes the trained weights: the UNet in diffusers format, or the LoRA in diffusers/peft format;
    with EMA, the averaged weights too, in the same layout under ema/."""
    from sdpipe import io

    accelerator.wait_for_everyone()
    if not accelerator.is_main_process:
        return
    model = accelerator.unwrap_model(unet)
    with io.atomic_dir(out) as tmp:
        _save_weights(model, mode, tmp)
        if ema is not None:
            params = trainable(model)
            ema.store(params)
            ema.copy_to(params)
            (tmp / "ema").mkdir()
            _save_weights(model, mode, tmp / "ema")
            ema.restore(params)
