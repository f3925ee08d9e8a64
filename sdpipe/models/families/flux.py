"""Flux.1 (dev and schnell layouts): the Flux transformer on 2x2-packed latent tokens, conditioned on T5's states
and CLIP-L's pooled embedding, with a guidance embedding in the distilled dev model, trained by rectified flow as
diffusers' Flux training examples do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.models.families import Base, Family, TextPart, fused_layers
from sdpipe.models.objectives import FlowMatching

if TYPE_CHECKING:
    import torch

    from sdpipe.models.loading import TextStack

T5_LENGTH = 512  # FluxPipeline's max_sequence_length default: cached at it, rendered at it
# The guidance a distilled (dev) transformer is told during training: diffusers' Flux examples default to 3.5,
# the value FluxPipeline samples with by default.
TRAIN_GUIDANCE = 3.5
_REPO = "https://github.com/black-forest-labs/flux"
DEV = Base("flux1", "FLUX.1 [dev]", "flux-1-dev", _REPO, "flux")
SCHNELL = Base("flux1", "FLUX.1 [schnell]", "flux-1-schnell", _REPO, "flux")


def embed(stack: TextStack, captions: list[str]) -> dict[str, torch.Tensor]:
    """As FluxPipeline.encode_prompt: T5's last states ("t5", [B, T5_LENGTH, D]) and CLIP-L's pooled output
    ("pooled", [B, D_clip])."""
    (clip_tok, t5_tok), (clip, t5), (clip_len, t5_len) = stack.tokenizers, stack.encoders, stack.lengths
    pooled = clip(**stack.ids(clip_tok, clip, captions, clip_len), output_hidden_states=False).pooler_output
    return {"t5": t5(**stack.ids(t5_tok, t5, captions, t5_len))[0], "pooled": pooled}


def _config(model) -> dict:
    """The transformer's config through DDP's and torch.compile's wrappers."""
    inner = getattr(model, "module", model)
    return getattr(inner, "_orig_mod", inner).config


def pack(latents: torch.Tensor) -> torch.Tensor:
    """[B, C, H, W] -> [B, H/2 * W/2, 4C]: each 2x2 patch one token (FluxPipeline._pack_latents)."""
    b, c, h, w = latents.shape
    x = latents.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """pack's inverse, to [B, C, h, w]."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def image_ids(h: int, w: int, like: torch.Tensor) -> torch.Tensor:
    """Each token's (0, row, column) for the rotary position embedding (FluxPipeline._prepare_latent_image_ids)."""
    import torch

    rows = torch.arange(h // 2, device=like.device).view(-1, 1).expand(h // 2, w // 2)
    cols = torch.arange(w // 2, device=like.device).view(1, -1).expand(h // 2, w // 2)
    ids = torch.stack([torch.zeros_like(rows), rows, cols], dim=-1).reshape(-1, 3)
    return ids.to(like.dtype)


def predict(model, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict) -> torch.Tensor:
    """The transformer's velocity for packed latents, unpacked; it takes the timestep as a fraction (t / 1000),
    and text tokens at position zero."""
    import torch

    h, w = noisy.shape[-2:]
    t5 = cond["t5"]
    guidance = None
    if _config(model).get("guidance_embeds"):
        guidance = torch.full((len(noisy),), TRAIN_GUIDANCE, device=noisy.device, dtype=noisy.dtype)
    out = model(
        hidden_states=pack(noisy),
        timestep=timesteps / 1000,
        guidance=guidance,
        pooled_projections=cond["pooled"],
        encoder_hidden_states=t5,
        txt_ids=torch.zeros(t5.shape[1], 3, device=noisy.device, dtype=noisy.dtype),
        img_ids=image_ids(h, w, noisy),
        return_dict=False,
    )[0]
    return unpack(out, h, w)


# The BFL layout's modules (kohya's and ComfyUI's LoRA names) and the diffusers modules fused into each, as
# diffusers' _convert_kohya_flux_lora_to_diffusers splits them.
KOHYA_TABLE = {
    "double:img_attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "double:img_attn.proj": ("attn.to_out.0",),
    "double:txt_attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "double:txt_attn.proj": ("attn.to_add_out",),
    "double:img_mlp.0": ("ff.net.0.proj",),
    "double:img_mlp.2": ("ff.net.2",),
    "double:txt_mlp.0": ("ff_context.net.0.proj",),
    "double:txt_mlp.2": ("ff_context.net.2",),
    "double:img_mod.lin": ("norm1.linear",),
    "double:txt_mod.lin": ("norm1_context.linear",),
    "single:linear1": ("attn.to_q", "attn.to_k", "attn.to_v", "proj_mlp"),
    "single:linear2": ("proj_out",),
    "single:modulation.lin": ("norm.linear",),
}
KOHYA_BLOCKS = {"transformer_blocks": "double_blocks", "single_transformer_blocks": "single_blocks"}


FAMILY = Family(
    "flux",
    "Flux.1",
    priority=30,
    detects=lambda index: str(index.get("_class_name", "")).startswith("Flux"),
    config_matches=lambda config: "num_single_layers" in config and "joint_attention_dim" in config,
    single_file_keys=("double_blocks.",),
    pipeline_class="FluxPipeline",
    load_args=(),
    denoiser="transformer",
    denoiser_class="FluxTransformer2DModel",
    predict=predict,
    # diffusers' train_dreambooth_lora_flux.py defaults: uniform timesteps ("none"), unshifted (the Hub scheduler
    # shifts by image size only when sampling), no loss weighting, no preconditioning.
    objective=FlowMatching(sampling="uniform", weighting="none", precondition=False),
    text_parts=(
        TextPart("tokenizer", "text_encoder", "CLIPTokenizer", "CLIPTextModel"),
        TextPart("tokenizer_2", "text_encoder_2", "T5TokenizerFast", "T5EncoderModel", T5_LENGTH),
    ),
    text_fields=("t5", "pooled"),
    embed=embed,
    size_conditioning=False,
    single_file_denoiser=None,
    single_file_text=(),
    clip_prefix="text_encoders.clip_l.transformer.",
    kohya_prefixes=(("transformer", "lora_unet_"), ("text_encoder", "lora_te1_"), ("text_encoder_2", "lora_te3_")),
    base=lambda config, prediction: DEV if config.get("guidance_embeds") else SCHNELL,
    bases=(DEV, SCHNELL),
    activation_gb_per_mp=8.0,  # not yet measured: a 12B transformer's order of magnitude at batch 1
    latent_multiple=lambda config: 2,  # 2x2 packing
    native_latent=lambda config: None,  # the VAE's sample_size says it (1024 px)
    kohya_layer=lambda module: fused_layers(module, KOHYA_BLOCKS, KOHYA_TABLE),
    diffusers_reads_kohya=False,  # diffusers' reader assumes FLUX.1's published sizes
    trains_text_encoders=False,
)
