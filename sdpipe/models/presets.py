"""Randomly initialised model presets, built from config alone and saved in diffusers format.

Nothing can be downloaded, so every architecture is written out here. `sd15` and `sdxl` are the published
architectures (same configs, same parameter counts) with random weights: they exercise the real memory and speed
profile. `tiny` is the CPU demo model, calibrated on a 2-core machine (see DESIGN.md): 32px images, a VAE with
downsampling 4 and a UNet with downsampling 2, so 8x8x4 latents and demo buckets in steps of 8.
"""

from __future__ import annotations

import logging
import os
import shutil
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

from sdpipe.errors import UserError
from sdpipe.models import owned, presets_flow

if TYPE_CHECKING:
    import torch
    from diffusers import DiffusionPipeline
    from transformers import CLIPTextConfig

# torch, diffusers and transformers are imported where models are built: the workflow reads a preset's configs
# (model_facts) in every `snakemake` start, and those imports would add seconds to each (one per DVC stage).

log = logging.getLogger(__name__)

PRESETS = ("tiny", "sd15", "sdxl", "tiny-sd3", "sd35-medium", "tiny-flux", "flux-dev")
# Not for users: a shrunken SDXL-family model so tests can cover the two-encoder path cheaply.
TEST_PRESETS = ("tiny-sdxl",)
_FAMILY = {"tiny": "sd", "sd15": "sd", "sdxl": "sdxl", "tiny-sdxl": "sdxl", **presets_flow.FAMILY}


def _check(preset: str) -> str:
    if preset not in _FAMILY:
        raise UserError(f"unknown model preset {preset!r}; allowed: {', '.join(PRESETS)}")
    return preset


def family(preset: str) -> str:
    """The family's name: "sd" (SD 1.x/2.x), "sdxl", "sd3" (SD 3.5) or "flux"."""
    return _FAMILY[_check(preset)]


def is_unet(preset: str) -> bool:
    return preset not in presets_flow.FAMILY


def denoiser_config(preset: str) -> dict:
    """The denoiser's kwargs: the UNet's, or the SD 3 / Flux transformer's."""
    return unet_config(preset) if is_unet(_check(preset)) else presets_flow.denoiser_config(preset)


def _clip_text(hidden: int, layers: int, heads: int, inter: int, act: str, proj: int) -> CLIPTextConfig:
    from transformers import CLIPTextConfig

    # eos_token_id 49407: the pooled output is read at the first <|endoftext|>, as in the real tokenizers.
    return CLIPTextConfig(
        vocab_size=49408,
        max_position_embeddings=77,
        hidden_size=hidden,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        intermediate_size=inter,
        hidden_act=act,
        projection_dim=proj,
        bos_token_id=49406,
        eos_token_id=49407,
        pad_token_id=1,
    )


CLIP_L = dict(hidden=768, layers=12, heads=12, inter=3072, act="quick_gelu", proj=768)  # openai ViT-L/14 text
CLIP_BIGG = dict(hidden=1280, layers=32, heads=20, inter=5120, act="gelu", proj=1280)  # OpenCLIP ViT-bigG/14 text
CLIP_TINY = dict(hidden=64, layers=2, heads=2, inter=128, act="quick_gelu", proj=64)


def text_encoder_configs(preset: str) -> list[CLIPTextConfig]:
    """One config per text encoder, in pipeline order (text_encoder, text_encoder_2)."""
    specs: dict[str, list[dict[str, Any]]] = {
        "tiny": [CLIP_TINY],
        "sd15": [CLIP_L],
        "sdxl": [CLIP_L, CLIP_BIGG],
        "tiny-sdxl": [CLIP_TINY, dict(CLIP_TINY, hidden=96, heads=3, inter=192, act="gelu", proj=96)],
    }
    return [_clip_text(**spec) for spec in specs[_check(preset)]]


def _vae(channels: tuple[int, ...], layers: int, sample_size: int, scaling: float, **extra: Any) -> dict:
    n = len(channels)
    return dict(
        dict(
            in_channels=3,
            out_channels=3,
            latent_channels=4,
            block_out_channels=channels,
            down_block_types=("DownEncoderBlock2D",) * n,
            up_block_types=("UpDecoderBlock2D",) * n,
            layers_per_block=layers,
            norm_num_groups=32,
            act_fn="silu",
            sample_size=sample_size,
            scaling_factor=scaling,
        ),
        **extra,
    )


def vae_config(preset: str) -> dict:
    """AutoencoderKL kwargs. The downsampling factor is 2 ** (len(block_out_channels) - 1)."""
    if not is_unet(_check(preset)):
        return presets_flow.vae_config(preset)
    if preset in ("tiny", "tiny-sdxl"):
        # 8 norm groups, not SD's 32: with 32 channels, 32 groups normalise each channel on its own, which erases
        # a flat shape's colour (the from-scratch demo VAE then decoded every shape pinkish; 2-core CPU calibration).
        # 0.18215 is SD's convention; a VAE trained from scratch re-measures it (1 / std of its latents).
        return _vae((32, 32, 64), 1, 32, 0.18215, norm_num_groups=8)
    if preset == "sd15":
        return _vae((128, 256, 512, 512), 2, 512, 0.18215)
    # SDXL's VAE overflows in fp16, hence force_upcast (pipelines and our encoder then run it in fp32).
    return _vae((128, 256, 512, 512), 2, 1024, 0.13025, force_upcast=True)


_UNET_COMMON = dict(
    in_channels=4,
    out_channels=4,
    norm_num_groups=32,
    flip_sin_to_cos=True,
    freq_shift=0,
    downsample_padding=1,
    act_fn="silu",
)


def _sdxl_conditioning(text_dims: list[int], time_dim: int) -> dict:
    # SDXL adds pooled text (last encoder's projection) + 6 micro-conditioning sizes, each embedded in time_dim.
    return dict(
        cross_attention_dim=sum(text_dims),
        addition_embed_type="text_time",
        addition_time_embed_dim=time_dim,
        projection_class_embeddings_input_dim=text_dims[-1] + 6 * time_dim,
        use_linear_projection=True,
    )


def unet_config(preset: str) -> dict:
    """UNet2DConditionModel kwargs. Note diffusers' legacy naming: attention_head_dim is the number of heads."""
    _check(preset)
    if preset == "sd15":
        return dict(
            _UNET_COMMON,
            block_out_channels=(320, 640, 1280, 1280),
            layers_per_block=2,
            down_block_types=("CrossAttnDownBlock2D",) * 3 + ("DownBlock2D",),
            up_block_types=("UpBlock2D",) + ("CrossAttnUpBlock2D",) * 3,
            cross_attention_dim=768,
            attention_head_dim=8,
            sample_size=64,
        )
    if preset == "sdxl":
        return dict(
            _UNET_COMMON,
            block_out_channels=(320, 640, 1280),
            layers_per_block=2,
            down_block_types=("DownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D"),
            up_block_types=("CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "UpBlock2D"),
            transformer_layers_per_block=(1, 2, 10),
            attention_head_dim=(5, 10, 20),
            sample_size=128,
            **_sdxl_conditioning([768, 1280], 256),
        )
    # tiny: 32px images / VAE factor 4 = 8x8 latents; one downsample in the UNet -> 4x4 at the bottom.
    tiny = dict(
        _UNET_COMMON,
        block_out_channels=(64, 96),
        layers_per_block=1,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        attention_head_dim=4,
        sample_size=8,
    )
    if preset == "tiny-sdxl":
        dims = [c.hidden_size for c in text_encoder_configs(preset)]
        return dict(tiny, **_sdxl_conditioning(dims, 16))
    return dict(tiny, cross_attention_dim=CLIP_TINY["hidden"])


def scheduler(preset: str):
    """SD's noise schedule. clip_sample off: latents are not bounded to [-1, 1].

    The tiny demo model, trained from scratch, uses v-prediction on a zero-terminal-SNR schedule with trailing
    timesteps (Lin et al. 2023) and samples with DDIM: with SD's epsilon schedule the model never sees pure noise
    in training, so the colour of a flat shape is decided badly at the first sampling step. Chosen by measuring
    the demo's prompt-colour accuracy (sdpipe.demo.colours) on the 2-core CPU.
    """
    from diffusers import DDIMScheduler, DDPMScheduler

    if not is_unet(_check(preset)):
        return presets_flow.scheduler(preset)
    common = dict(
        num_train_timesteps=1000,
        beta_schedule="scaled_linear",
        beta_start=0.00085,
        beta_end=0.012,
        clip_sample=False,
        steps_offset=1,
    )
    if _check(preset) == "tiny":
        return DDIMScheduler(
            **common,
            prediction_type="v_prediction",
            rescale_betas_zero_snr=True,
            timestep_spacing="trailing",
            set_alpha_to_one=False,
        )
    return DDPMScheduler(**common, prediction_type="epsilon")


def _n_params(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def build_pipeline(preset: str, seed: int = 0) -> DiffusionPipeline:
    """The whole pipeline with random weights; the same preset and seed give the same weights bit for bit."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionPipeline, StableDiffusionXLPipeline, UNet2DConditionModel
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    from sdpipe.models.tokenizer import build_clip_tokenizer

    torch.manual_seed(seed)  # one seed, and a fixed build order below, make every weight reproducible
    if not is_unet(_check(preset)):
        return presets_flow.build_pipeline(preset)
    parts: dict[str, Any] = dict(
        unet=UNet2DConditionModel(**unet_config(preset)),
        vae=AutoencoderKL(**vae_config(preset)),
        scheduler=scheduler(preset),
    )
    te_configs = text_encoder_configs(preset)
    parts["text_encoder"], parts["tokenizer"] = CLIPTextModel(te_configs[0]), build_clip_tokenizer()
    if family(preset) == "sd":
        return StableDiffusionPipeline(
            **parts, safety_checker=None, feature_extractor=None, requires_safety_checker=False
        )
    # SDXL's second tokenizer is OpenCLIP's: the same BPE, padded with "!" (id 0) instead of <|endoftext|>.
    parts["text_encoder_2"] = CLIPTextModelWithProjection(te_configs[1])
    parts["tokenizer_2"] = build_clip_tokenizer(pad_token="!")
    return StableDiffusionXLPipeline(**parts)


def _check_out(out: Path) -> None:
    if (out / "model_index.json").exists():
        raise UserError(f"a model already exists at {out}; delete it to rebuild")
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise UserError(f"{out} exists and is not an empty folder; delete it or choose another model path")


def build_and_save(preset: str, out: Path, seed: int = 0) -> Path:
    """Build `preset` with random weights and save it at `out` in diffusers format (safetensors).

    The folder is written beside `out` under a temporary name and renamed into place, so a crash never leaves a
    half-written model that later stages would take for a real one.
    """
    out = Path(out)
    _check(preset)
    _check_out(out)
    import torch

    from sdpipe.models.tokenizer import write_vocab_files

    pipe = build_pipeline(preset, seed)
    counts = {name: _n_params(m) for name, m in pipe.components.items() if isinstance(m, torch.nn.Module)}
    log.info("built preset %s (seed %d): %s", preset, seed, ", ".join(f"{k} {v:,} params" for k, v in counts.items()))
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.parent / f".{out.name}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"
    tmp.mkdir()  # not mkdtemp: its 0700 mode would stick to the final folder
    try:
        pipe.save_pretrained(tmp, safe_serialization=True)
        for sub, part in pipe.components.items():
            if type(part).__name__ == "CLIPTokenizer":  # also the hub's vocab.json/merges.txt, for tools that read
                write_vocab_files(tmp / sub)  # only those
        owned.mark(tmp, preset, seed)
        if out.is_dir():
            out.rmdir()  # empty (checked above); rename cannot replace a folder on every platform
        os.replace(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("saved %s model to %s", preset, out)
    return out
