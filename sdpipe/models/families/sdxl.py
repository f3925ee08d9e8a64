"""SDXL: a UNet conditioned on two CLIP encoders' penultimate states, the second's pooled embedding, and the
image's size and crop ("micro-conditioning")."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.models.families import Base, Family, TextPart, present, unet_predict
from sdpipe.models.objectives import DDPM

if TYPE_CHECKING:
    import torch

    from sdpipe.models.loading import TextStack

BASE = Base(
    "sdxl_base_v1-0",
    "Stable Diffusion XL",
    "stable-diffusion-xl-v1-base",
    "https://github.com/Stability-AI/generative-models",
    "stable-diffusion-xl",
)


def embed(stack: TextStack, captions: list[str]) -> dict[str, torch.Tensor]:
    """Each encoder's penultimate hidden states, concatenated, and the last encoder's projected pooled state."""
    import torch

    hidden, pooled = [], torch.empty(0)
    for tokenizer, encoder in zip(stack.tokenizers, stack.encoders):
        out = encoder(**stack.ids(tokenizer, encoder, captions), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled = out[0]  # text_embeds of CLIPTextModelWithProjection
    return {"hidden": torch.cat(hidden, dim=-1), "pooled": pooled}  # [B, 77, sum D], [B, P]


def detects(index: dict) -> bool:
    """A UNet pipeline named XL, or with a second text encoder (the refiner has only that one)."""
    unet = present(index, "unet") and not present(index, "transformer")
    return unet and ("XL" in str(index.get("_class_name", "")) or present(index, "text_encoder_2"))


FAMILY = Family(
    "sdxl",
    "SDXL",
    priority=10,
    detects=detects,
    config_matches=lambda unet: unet.get("addition_embed_type") == "text_time",  # adds text and time embeddings
    single_file_keys=("conditioner.embedders.1.",),
    pipeline_class="StableDiffusionXLPipeline",
    load_args=(("add_watermarker", False),),
    denoiser="unet",
    denoiser_class="UNet2DConditionModel",
    predict=unet_predict,
    objective=DDPM(),
    text_parts=(
        TextPart("tokenizer", "text_encoder", "CLIPTokenizer", "CLIPTextModel"),
        TextPart("tokenizer_2", "text_encoder_2", "CLIPTokenizer", "CLIPTextModelWithProjection"),
    ),
    text_fields=("hidden", "pooled"),
    embed=embed,
    size_conditioning=True,
    single_file_denoiser="ldm_unet",
    single_file_text=("clip", "open_clip"),
    clip_prefix="conditioner.embedders.0.transformer.",
    kohya_prefixes=(("unet", "lora_unet_"), ("text_encoder", "lora_te1_"), ("text_encoder_2", "lora_te2_")),
    base=lambda unet, prediction: BASE,
    bases=(BASE,),
    activation_gb_per_mp=7.5,
)
