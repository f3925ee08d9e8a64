"""What a config's base model is, read from its config files alone (no weights, no diffusers): the UNet's and VAE's
configs, its native resolution and the multiple every bucket side must have. For a preset that the workflow will
build, the preset's own configs; for weights not found locally, None (check-config then says where to get them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config


def configs(cfg: Config, convert: bool = False) -> tuple[dict, dict] | None:
    """(unet config, vae config) of the config's base model, or None where its files are not here yet. A single-file
    checkpoint is read only when `convert` allows its (cached) conversion: stages do, checks do not."""
    m = cfg.model
    if m.build_preset:
        from sdpipe.models import presets

        return presets.unet_config(m.build_preset), presets.vae_config(m.build_preset)
    from sdpipe import io, single_file, weights

    if single_file.is_checkpoint(m.pretrained) and not convert:
        return None  # its configs come with the conversion, which a check must not start (minutes for SDXL)
    try:
        root = weights.resolve(m.pretrained, m.revision)
        return io.read_json(root / "unet" / "config.json"), io.read_json(root / "vae" / "config.json")
    except (UserError, OSError, ValueError):
        return None


def family(unet: dict) -> str:
    from sdpipe.models import families

    return families.from_unet_config(unet).name


def vae_factor(vae: dict) -> int:
    """Pixels per latent: every VAE down block but the last halves the image (8 for SD's VAE)."""
    return 2 ** (len(vae["block_out_channels"]) - 1)


def bucket_multiple(unet: dict, vae: dict) -> int:
    """What every bucket side must be a multiple of: the VAE's factor times the UNet's downsampling (each down
    block but the last halves the latent; SD 1.5: 8 x 8 = 64 px, SDXL: 8 x 4 = 32 px)."""
    return vae_factor(vae) * 2 ** (len(unet["down_block_types"]) - 1)


def native_resolution(unet: dict, vae: dict) -> int:
    """The resolution the model was made for (SD 1.5: 512, SDXL: 1024)."""
    size = unet["sample_size"]
    return (size[0] if isinstance(size, (list, tuple)) else size) * vae_factor(vae)


def check(cfg: Config) -> None:
    """Mistakes between the config and its base model, before any stage runs (skipped while the weights are not
    here: check-config's plan says so)."""
    found = configs(cfg)
    if found is None:
        return
    unet, vae = found
    b, multiple, native = cfg.prepare.buckets, bucket_multiple(*found), native_resolution(*found)
    if b.step % multiple:
        raise UserError(
            f"config: prepare.buckets.step = {b.step} must be a multiple of {multiple} for "
            f"{cfg.model.pretrained} (its VAE and UNet downsample by {multiple}); use step: 64 for SD models"
        )
    if b.resolution * 2 < native:
        raise UserError(
            f"config: prepare.buckets.resolution = {b.resolution} for a model made for {native} px "
            f"({cfg.model.pretrained}); train at {native} (or at least {native // 2})"
        )
