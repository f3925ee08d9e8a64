"""Stable Diffusion 1.x and 2.x: a UNet conditioned on one CLIP text encoder's last hidden states."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.models.families import Base, Family, TextPart, present, unet_predict
from sdpipe.models.objectives import DDPM

if TYPE_CHECKING:
    import torch

    from sdpipe.models.loading import TextStack

V1 = Base(
    "sd_v1",
    "Stable Diffusion 1.x",
    "stable-diffusion-v1",
    "https://github.com/CompVis/stable-diffusion",
    "stable-diffusion",
)
V2 = Base(
    "sd_v2",
    "Stable Diffusion 2.x",
    "stable-diffusion-v2-512",
    "https://github.com/Stability-AI/stablediffusion",
    "stable-diffusion",
)
V2_V = V2._replace(architecture="stable-diffusion-v2-768-v")


def embed(stack: TextStack, captions: list[str]) -> dict[str, torch.Tensor]:
    """One encoder's final-layer-normed last hidden states."""
    tokenizer, encoder = stack.tokenizers[0], stack.encoders[0]
    return {"hidden": encoder(**stack.ids(tokenizer, encoder, captions))[0]}


def base(unet: dict, prediction: str) -> Base:
    """SD 2.x when the UNet attends to 1024-wide text states (OpenCLIP-H), else SD 1.x; 2.x's 768-v models predict v."""
    if unet.get("cross_attention_dim") != 1024:
        return V1
    return V2_V if prediction == "v_prediction" else V2


FAMILY = Family(
    "sd",
    "SD 1.x/2.x",
    priority=0,  # the fallback: any text-conditioned UNet pipeline no other family claims
    detects=lambda index: present(index, "unet") and not present(index, "transformer"),
    config_matches=lambda unet: True,
    single_file_keys=("model.diffusion_model.", "cond_stage_model."),
    pipeline_class="StableDiffusionPipeline",
    load_args=(("safety_checker", None), ("requires_safety_checker", False)),
    denoiser="unet",
    denoiser_class="UNet2DConditionModel",
    predict=unet_predict,
    objective=DDPM(),
    text_parts=(TextPart("tokenizer", "text_encoder", "CLIPTokenizer", "CLIPTextModel"),),
    text_fields=("hidden",),
    embed=embed,
    size_conditioning=False,
    single_file_denoiser="ldm_unet",
    single_file_text=("clip",),
    clip_prefix="cond_stage_model.transformer.",
    kohya_prefixes=(("unet", "lora_unet_"), ("text_encoder", "lora_te_")),
    base=base,
    bases=(V1, V2, V2_V),
    activation_gb_per_mp=4.3,
)
