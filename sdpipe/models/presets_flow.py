"""Random-init presets of the flow-matching transformer families: SD 3.5 and Flux.1 (dev layout).

`sd35-medium` and `flux-dev` are the published architectures (the Hub configs' sizes) with random weights, for the
GPU benchmarks; `tiny-sd3` and `tiny-flux` are CPU-sized, shaped like the tiny SD preset: 32 px images, a VAE that
downsamples by 4 (here with SD 3's and Flux's 16 latent channels) and a 2x2 patch (SD 3) or 2x2 packing (Flux), so
4x4 tokens and buckets in steps of 8 px. The text encoders are CLIP (as in presets.py) and T5 v1.1 with its real
SentencePiece vocabulary (models/tokenizer.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from diffusers import DiffusionPipeline

FAMILY = {"tiny-sd3": "sd3", "sd35-medium": "sd3", "tiny-flux": "flux", "flux-dev": "flux"}

# T5 v1.1 XXL's encoder (google/t5-v1_1-xxl, as SD 3 and Flux ship it), and a tiny one of the same kind.
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64)
T5_TINY = dict(d_model=64, d_kv=16, d_ff=128, num_layers=2, num_heads=4)
# The pipelines' default T5 lengths, which training caches at too, so a render sees what training saw.
T5_LENGTH = {"sd3": 256, "flux": 512}


def t5_config(spec: dict):
    from transformers import T5Config

    return T5Config(
        vocab_size=32128,
        feed_forward_proj="gated-gelu",
        relative_attention_num_buckets=32,
        relative_attention_max_distance=128,
        layer_norm_epsilon=1e-6,
        dropout_rate=0.0,
        tie_word_embeddings=False,
        **spec,
    )


def _clip(preset: str, tiny: dict, real: dict) -> dict:
    return tiny if preset.startswith("tiny") else real


def text_specs(preset: str) -> list[dict]:
    """The CLIP text encoders' specs (presets._clip_text kwargs), in pipeline order; T5 comes after them."""
    from sdpipe.models.presets import CLIP_BIGG, CLIP_L, CLIP_TINY

    # SD 3 pads the two CLIP states' concatenation up to T5's width: the tiny ones must fit in 64 together.
    small = dict(CLIP_TINY, hidden=32, inter=64, proj=32)
    if FAMILY[preset] == "sd3":
        return [_clip(preset, small, CLIP_L), _clip(preset, dict(small, act="gelu"), CLIP_BIGG)]
    return [_clip(preset, small, CLIP_L)]


def vae_config(preset: str) -> dict:
    """AutoencoderKL kwargs: 16 latent channels, no quant convs, each family's scale and shift."""
    scale, shift = (1.5305, 0.0609) if FAMILY[preset] == "sd3" else (0.3611, 0.1159)
    tiny = preset.startswith("tiny")
    channels = (32, 32, 64) if tiny else (128, 256, 512, 512)
    return dict(
        in_channels=3,
        out_channels=3,
        latent_channels=16,
        block_out_channels=channels,
        down_block_types=("DownEncoderBlock2D",) * len(channels),
        up_block_types=("UpDecoderBlock2D",) * len(channels),
        layers_per_block=1 if tiny else 2,
        norm_num_groups=8 if tiny else 32,  # 8 for the tiny VAE: see presets.vae_config
        act_fn="silu",
        sample_size=32 if tiny else 1024,
        scaling_factor=scale,
        shift_factor=shift,
        use_quant_conv=False,
        use_post_quant_conv=False,
    )


def denoiser_config(preset: str) -> dict:
    """SD3Transformer2DModel or FluxTransformer2DModel kwargs."""
    t5 = T5_TINY if preset.startswith("tiny") else T5_XXL
    pooled = sum(spec["proj" if FAMILY[preset] == "sd3" else "hidden"] for spec in text_specs(preset))
    if preset == "sd35-medium":  # stabilityai/stable-diffusion-3.5-medium's transformer
        return dict(
            sample_size=128,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=24,
            attention_head_dim=64,
            num_attention_heads=24,
            joint_attention_dim=4096,
            caption_projection_dim=1536,
            pooled_projection_dim=2048,
            pos_embed_max_size=384,
            dual_attention_layers=tuple(range(13)),
            qk_norm="rms_norm",
        )
    if preset == "tiny-sd3":
        return dict(
            sample_size=8,
            patch_size=2,
            in_channels=16,
            out_channels=16,
            num_layers=2,
            attention_head_dim=16,
            num_attention_heads=2,
            joint_attention_dim=t5["d_model"],
            caption_projection_dim=32,
            pooled_projection_dim=pooled,
            pos_embed_max_size=16,
            dual_attention_layers=(0,),  # as 3.5 Medium: the first layers attend to the image twice
            qk_norm="rms_norm",
        )
    tiny = preset == "tiny-flux"
    return dict(  # black-forest-labs/FLUX.1-dev's transformer (guidance-distilled: guidance_embeds)
        patch_size=1,
        in_channels=64,  # 16 latent channels, packed 2x2
        out_channels=None,
        num_layers=1 if tiny else 19,
        num_single_layers=1 if tiny else 38,
        attention_head_dim=16 if tiny else 128,
        num_attention_heads=2 if tiny else 24,
        joint_attention_dim=t5["d_model"],
        pooled_projection_dim=pooled,
        guidance_embeds=True,
        axes_dims_rope=(4, 6, 6) if tiny else (16, 56, 56),
    )


def scheduler(preset: str):
    """The Hub configs' FlowMatchEulerDiscreteScheduler: SD 3's static shift 3; Flux's shift by image size."""
    from diffusers import FlowMatchEulerDiscreteScheduler

    if FAMILY[preset] == "sd3":
        return FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=3.0)
    return FlowMatchEulerDiscreteScheduler(
        num_train_timesteps=1000,
        shift=3.0,
        use_dynamic_shifting=True,
        base_shift=0.5,
        max_shift=1.15,
        base_image_seq_len=256,
        max_image_seq_len=4096,
    )


def build_pipeline(preset: str) -> DiffusionPipeline:
    """The whole pipeline with random weights (the caller seeds torch)."""
    from diffusers import (
        AutoencoderKL,
        FluxPipeline,
        FluxTransformer2DModel,
        SD3Transformer2DModel,
        StableDiffusion3Pipeline,
    )
    from transformers import CLIPTextModel, CLIPTextModelWithProjection, T5EncoderModel

    from sdpipe.models.presets import _clip_text
    from sdpipe.models.tokenizer import build_clip_tokenizer, build_t5_tokenizer

    family = FAMILY[preset]
    t5 = T5EncoderModel(t5_config(T5_TINY if preset.startswith("tiny") else T5_XXL))
    clips = [_clip_text(**spec) for spec in text_specs(preset)]
    parts: dict[str, Any] = dict(vae=AutoencoderKL(**vae_config(preset)), scheduler=scheduler(preset))
    if family == "flux":
        parts["transformer"] = FluxTransformer2DModel(**denoiser_config(preset))
        parts.update(text_encoder=CLIPTextModel(clips[0]), tokenizer=build_clip_tokenizer())
        parts.update(text_encoder_2=t5, tokenizer_2=build_t5_tokenizer(T5_LENGTH[family]))
        return FluxPipeline(**parts)
    parts["transformer"] = SD3Transformer2DModel(**denoiser_config(preset))
    parts.update(text_encoder=CLIPTextModelWithProjection(clips[0]), tokenizer=build_clip_tokenizer())
    # the second CLIP (OpenCLIP bigG) pads with "!", as in SDXL
    parts.update(text_encoder_2=CLIPTextModelWithProjection(clips[1]), tokenizer_2=build_clip_tokenizer(pad_token="!"))
    parts.update(text_encoder_3=t5, tokenizer_3=build_t5_tokenizer(T5_LENGTH[family]))
    return StableDiffusion3Pipeline(**parts)
