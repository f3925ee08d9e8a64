"""What a config's base model is, read from its config files alone (no weights, no diffusers): the denoiser's
(UNet or transformer) and VAE's configs, its native resolution and the multiple every bucket side must have. For a
preset that the workflow will build, the preset's own configs; for weights not found locally, None (check-config
then says where to get them).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config


def configs(cfg: Config, convert: bool = False) -> tuple[dict, dict] | None:
    """(denoiser config, vae config) of the config's base model, or None where its files are not here yet. A single-file
    checkpoint is read only when `convert` allows its (cached) conversion: stages do, checks do not."""
    m = cfg.model
    if m.build_preset:
        from sdpipe.models import presets

        return presets.denoiser_config(m.build_preset), presets.vae_config(m.build_preset)
    from sdpipe import io, single_file, weights

    if single_file.is_checkpoint(m.pretrained) and not convert:
        return None  # its configs come with the conversion, which a check must not start (minutes for SDXL)
    from sdpipe.models import families

    try:
        root = weights.resolve(m.pretrained, m.revision)
        # the families' denoiser folders (unet/, transformer/): whichever this model has
        folder = next(root / f.denoiser for f in families.registered() if (root / f.denoiser / "config.json").is_file())
        return io.read_json(folder / "config.json"), io.read_json(root / "vae" / "config.json")
    except (UserError, OSError, ValueError, StopIteration):
        return None


def family(denoiser: dict) -> str:
    from sdpipe.models import families

    return families.from_denoiser_config(denoiser).name


def vae_factor(vae: dict) -> int:
    """Pixels per latent: every VAE down block but the last halves the image (8 for SD's VAE)."""
    return 2 ** (len(vae["block_out_channels"]) - 1)


def bucket_multiple(denoiser: dict, vae: dict) -> int:
    """What every bucket side must be a multiple of: the VAE's factor times the denoiser's (a UNet halves the
    latent at each down block but the last, a transformer takes patches; SD 1.5: 8 x 8 = 64 px, SDXL: 8 x 4 = 32
    px, SD 3 and Flux: 8 x 2 = 16 px)."""
    from sdpipe.models import families

    return vae_factor(vae) * families.from_denoiser_config(denoiser).latent_multiple(denoiser)


def native_resolution(denoiser: dict, vae: dict) -> int:
    """The resolution the model was made for (SD 1.5: 512, SDXL, SD 3 and Flux: 1024)."""
    from sdpipe.models import families

    latent = families.from_denoiser_config(denoiser).native_latent(denoiser)
    return latent * vae_factor(vae) if latent else int(vae["sample_size"])


def check(cfg: Config) -> None:
    """Mistakes between the config and its base model, before any stage runs (skipped while the weights are not
    here: check-config's plan says so)."""
    found = configs(cfg)
    if found is None:
        return
    b, multiple, native = cfg.prepare.buckets, bucket_multiple(*found), native_resolution(*found)
    if b.step % multiple:
        raise UserError(
            f"config: prepare.buckets.step = {b.step} must be a multiple of {multiple} for "
            f"{cfg.model.pretrained} (its VAE and denoiser downsample by {multiple}); use step: 64 for SD models"
        )
    if b.resolution * 2 < native:
        raise UserError(
            f"config: prepare.buckets.resolution = {b.resolution} for a model made for {native} px "
            f"({cfg.model.pretrained}); train at {native} (or at least {native // 2})"
        )
    _check_family_options(cfg, family(found[0]))


def _check_family_options(cfg: Config, name: str) -> None:
    """Settings that the base model's family has no use for fail here rather than being ignored."""
    from sdpipe.models import families
    from sdpipe.models.objectives import DDPM

    fam, t = families.named(name), cfg.train
    ddpm = isinstance(fam.objective, DDPM)
    for key, value in (("train.prediction_type", t.prediction_type), ("train.snr_gamma", t.snr_gamma)):
        if value is not None and not ddpm:
            raise UserError(
                f"config: {key} = {value} applies to the DDPM objective of SD and SDXL; {fam.title} trains by "
                f"flow matching ({cfg.model.pretrained}): set {key}: null"
            )
    if t.text_encoder.mode != "none" and not fam.trains_text_encoders:
        raise UserError(
            f"config: train.text_encoder.mode = {t.text_encoder.mode}: sdpipe does not train {fam.title}'s text "
            f"encoders yet ({cfg.model.pretrained}); set train.text_encoder.mode: none (their states are cached)"
        )
    if cfg.export.single_file and fam.single_file_denoiser is None:
        raise UserError(
            f"config: export.single_file is true, but sdpipe writes no single-file {fam.title} checkpoint yet "
            f"({cfg.model.pretrained}); set export.single_file: false (the diffusers folder and LoRA files are "
            "written either way)"
        )
