"""Stable Diffusion 3 / 3.5: the MMDiT transformer, conditioned on two CLIP encoders' penultimate states and T5's
states (one joint sequence) and the CLIPs' pooled embeddings, trained by rectified flow with SD 3's
preconditioning, as diffusers' SD 3 training examples do."""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.models.families import Base, Family, TextPart, fused_layers
from sdpipe.models.objectives import FlowMatching

if TYPE_CHECKING:
    import torch

    from sdpipe.models.loading import TextStack

T5_LENGTH = 256  # StableDiffusion3Pipeline's max_sequence_length default: cached at it, rendered at it
_REPO = "https://github.com/Stability-AI/sd3.5"
SD3_MEDIUM = Base("sd3", "Stable Diffusion 3 Medium", "stable-diffusion-3-medium", _REPO, "stable-diffusion-3")
SD35_MEDIUM = Base(
    "sd3.5_medium", "Stable Diffusion 3.5 Medium", "stable-diffusion-3-5-medium", _REPO, "stable-diffusion-3.5"
)
SD35_LARGE = Base(
    "sd3.5_large", "Stable Diffusion 3.5 Large", "stable-diffusion-3-5-large", _REPO, "stable-diffusion-3.5"
)


def embed(stack: TextStack, captions: list[str]) -> dict[str, torch.Tensor]:
    """As StableDiffusion3Pipeline.encode_prompt: each CLIP's penultimate states, concatenated ("clip", [B, 77,
    sum D]), T5's last states ("t5", [B, T5_LENGTH, D_t5]) and the CLIPs' projected pooled states ("pooled").
    The joint sequence (CLIP zero-padded to T5's width, then T5) is built at training time: the cache keeps no
    padding."""
    import torch

    hidden, pooled = [], []
    clips = list(zip(stack.tokenizers, stack.encoders, stack.lengths))[:2]
    for tokenizer, encoder, length in clips:
        out = encoder(**stack.ids(tokenizer, encoder, captions, length), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled.append(out[0])  # text_embeds of CLIPTextModelWithProjection
    tokenizer, encoder, length = stack.tokenizers[2], stack.encoders[2], stack.lengths[2]
    t5 = encoder(**stack.ids(tokenizer, encoder, captions, length))[0]
    return {"clip": torch.cat(hidden, dim=-1), "t5": t5, "pooled": torch.cat(pooled, dim=-1)}


def joint_states(cond: dict) -> torch.Tensor:
    """The transformer's text sequence: CLIP states zero-padded to T5's width, followed by T5's."""
    import torch

    clip, t5 = cond["clip"], cond["t5"]
    clip = torch.nn.functional.pad(clip, (0, t5.shape[-1] - clip.shape[-1]))
    return torch.cat([clip, t5], dim=-2)


def predict(model, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict) -> torch.Tensor:
    """The MMDiT's output; it takes the timestep in the scheduler's units (0-1000)."""
    return model(
        hidden_states=noisy,
        timestep=timesteps,
        encoder_hidden_states=joint_states(cond),
        pooled_projections=cond["pooled"],
        return_dict=False,
    )[0]


def base(config: dict, prediction: str) -> Base:
    """3.5 Large has 38 layers; 3.5 Medium is 3 Medium's 24 with dual attention (MMDiT-X) in its first layers."""
    if config.get("num_layers", 24) >= 38:
        return SD35_LARGE
    return SD35_MEDIUM if config.get("dual_attention_layers") else SD3_MEDIUM


# MMDiT's original modules (kohya's and ComfyUI's LoRA names) and the diffusers modules fused into each, as
# diffusers' convert_sd3_transformer_checkpoint_to_diffusers splits them. The context block's adaLN is left out:
# its scale and shift are stored swapped in the last block.
KOHYA_TABLE = {
    "joint:x_block.attn.qkv": ("attn.to_q", "attn.to_k", "attn.to_v"),
    "joint:x_block.attn.proj": ("attn.to_out.0",),
    "joint:context_block.attn.qkv": ("attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj"),
    "joint:context_block.attn.proj": ("attn.to_add_out",),
    "joint:x_block.attn2.qkv": ("attn2.to_q", "attn2.to_k", "attn2.to_v"),
    "joint:x_block.attn2.proj": ("attn2.to_out.0",),
    "joint:x_block.mlp.fc1": ("ff.net.0.proj",),
    "joint:x_block.mlp.fc2": ("ff.net.2",),
    "joint:context_block.mlp.fc1": ("ff_context.net.0.proj",),
    "joint:context_block.mlp.fc2": ("ff_context.net.2",),
    "joint:x_block.adaLN_modulation.1": ("norm1.linear",),
}
KOHYA_BLOCKS = {"transformer_blocks": "joint_blocks"}


FAMILY = Family(
    "sd3",
    "SD 3 / 3.5",
    priority=30,
    detects=lambda index: str(index.get("_class_name", "")).startswith("StableDiffusion3"),
    config_matches=lambda config: "caption_projection_dim" in config and "joint_attention_dim" in config,
    single_file_keys=("joint_blocks.",),
    pipeline_class="StableDiffusion3Pipeline",
    load_args=(),
    denoiser="transformer",
    denoiser_class="SD3Transformer2DModel",
    predict=predict,
    # diffusers' train_dreambooth_(lora_)sd3.py defaults: logit-normal(0, 1) timesteps, the scheduler's shift (3),
    # no loss weighting, outputs preconditioned to x_0.
    objective=FlowMatching(sampling="logit_normal", weighting="none", precondition=True),
    text_parts=(
        TextPart("tokenizer", "text_encoder", "CLIPTokenizer", "CLIPTextModelWithProjection"),
        TextPart("tokenizer_2", "text_encoder_2", "CLIPTokenizer", "CLIPTextModelWithProjection"),
        TextPart("tokenizer_3", "text_encoder_3", "T5TokenizerFast", "T5EncoderModel", T5_LENGTH),
    ),
    text_fields=("clip", "t5", "pooled"),
    embed=embed,
    size_conditioning=False,
    single_file_denoiser="mmdit",  # with the VAE; the text encoders are separate files (sd3.5_medium.safetensors)
    single_file_text=(),
    clip_prefix="text_encoders.clip_l.transformer.",
    kohya_prefixes=(
        ("transformer", "lora_unet_"),
        ("text_encoder", "lora_te1_"),
        ("text_encoder_2", "lora_te2_"),
        ("text_encoder_3", "lora_te3_"),
    ),
    base=base,
    bases=(SD3_MEDIUM, SD35_MEDIUM, SD35_LARGE),
    activation_gb_per_mp=6.0,  # not yet measured: SDXL's order of magnitude for a 2.5B transformer at batch 1
    latent_multiple=lambda config: config["patch_size"],
    kohya_layer=lambda module: fused_layers(module, KOHYA_BLOCKS, KOHYA_TABLE),
    diffusers_reads_kohya=False,  # diffusers has no reader for SD 3's kohya files
    trains_text_encoders=False,
)
