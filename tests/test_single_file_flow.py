"""SD 3.5 and Flux single files as the base model, as they ship: Stability's sd3.5_medium.safetensors holds the MMDiT
and the VAE, BFL's flux1-dev.safetensors the transformer alone, ComfyUI's all-in-one files everything. What a file
lacks comes from model.single_file_config's weights; what it holds comes from the file."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdpipe import config, single_file, weights
from sdpipe.errors import UserError
from sdpipe.export.single_file import export_single_file
from sdpipe.models import loading, presets
from tests.conftest import small_config
from tests.test_single_file_base import _same

SD3_TEXT = ["text_encoder", "text_encoder_2", "text_encoder_3"]


@pytest.fixture(scope="module")
def sd3(tmp_path_factory):
    """(tiny-sd3 folder with its weights perturbed, the same model as a Stability-layout file)."""
    from diffusers import DiffusionPipeline

    tmp = tmp_path_factory.mktemp("sd3")
    pipe = DiffusionPipeline.from_pretrained(presets.build_and_save("tiny-sd3", tmp / "base", seed=0))
    torch.manual_seed(3)
    with torch.no_grad():  # no weight left at its init value: a component taken from the wrong place shows
        for name in ["transformer", "vae", *SD3_TEXT]:
            for p in getattr(pipe, name).parameters():
                p.add_(0.01 * torch.randn_like(p))
    pipe.save_pretrained(tmp / "model")
    return tmp / "model", export_single_file(tmp / "model", tmp / "sd3.5_tiny.safetensors", dtype="fp32")


def _configure(tmp: Path, configs: Path) -> None:
    raw = small_config(tmp, tmp / "raw", tmp / "unused")
    raw["model"]["single_file_config"] = str(configs)
    config.from_dict(raw)  # loading a config tells weights.resolve where conversions go


@pytest.mark.parametrize("holds", ["transformer and VAE", "transformer only"])
def test_an_sd35_file_loads_like_its_folder(sd3, tmp_path, monkeypatch, holds) -> None:
    monkeypatch.setattr(single_file, "_converted", {})
    folder, file = sd3
    if holds == "transformer only":
        state = {k: v for k, v in load_file(file).items() if k.startswith(single_file.DENOISER_PREFIX)}
        file = tmp_path / "mmdit-only.safetensors"
        save_file(state, str(file))
    missing = single_file.parts_not_in_file(single_file.tensor_info(file), "sd3")
    assert missing == (["vae"] if holds == "transformer only" else []) + SD3_TEXT
    _configure(tmp_path, folder)
    assert loading.pipeline_family(str(file)) == "sd3"
    _same(loading.load_unet(str(file)), loading.load_unet(str(folder)), "transformer")
    _same(loading.load_vae(str(file)), loading.load_vae(str(folder)), "vae")
    for got, want in zip(loading.load_text_stack(str(file)).encoders, loading.load_text_stack(str(folder)).encoders):
        _same(got, want, "text encoder")


def test_the_file_s_own_weights_win_over_the_config_folder_s(sd3, tmp_path, monkeypatch) -> None:
    """The config folder is another model of the same architecture: only what the file lacks may come from it."""
    monkeypatch.setattr(single_file, "_converted", {})
    folder, file = sd3
    other = presets.build_and_save("tiny-sd3", tmp_path / "other", seed=1)
    _configure(tmp_path, other)
    _same(loading.load_unet(str(file)), loading.load_unet(str(folder)), "transformer from the file")
    _same(loading.load_vae(str(file)), loading.load_vae(str(folder)), "vae from the file")
    _same(loading.load_text_stack(str(file)).encoders[2], loading.load_text_stack(str(other)).encoders[2], "T5")


def test_a_config_folder_without_the_missing_weights_says_what_to_fetch(sd3, tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(single_file, "_converted", {})
    folder, file = sd3
    configs = tmp_path / "configs-only"
    shutil.copytree(folder, configs, ignore=shutil.ignore_patterns("*.safetensors"))
    _configure(tmp_path, configs)
    with pytest.raises(UserError, match=r"holds no text_encoder, text_encoder_2, text_encoder_3; .*sdpipe fetch-model"):
        weights.resolve(str(file))


def _info(keys: list[str]) -> dict:
    return {k: ((4,), "bfloat16") for k in keys}


FLUX_DENOISER = ["double_blocks.0.img_attn.norm.key_norm.scale", "single_blocks.0.linear1.weight", "img_in.weight"]


@pytest.mark.parametrize(
    "layout, keys, missing",
    [
        ("BFL's flux1-dev.safetensors", FLUX_DENOISER, ["vae", "text_encoder", "text_encoder_2"]),
        (
            "ComfyUI's all-in-one checkpoint",
            [f"model.diffusion_model.{k}" for k in FLUX_DENOISER]
            + [
                "vae.encoder.conv_in.weight",
                "text_encoders.clip_l.transformer.text_model.embeddings.position_embedding.weight",
                "text_encoders.t5xxl.transformer.shared.weight",
            ],
            [],
        ),
    ],
)
def test_flux_files_are_recognised_with_what_they_lack(layout, keys, missing) -> None:
    """The conversion itself is diffusers' (convert_flux_transformer_checkpoint_to_diffusers), which assumes
    FLUX.1's published widths, so a tiny Flux file cannot go through it: this checks what sdpipe decides."""
    info = _info(keys)
    assert single_file.family(Path(layout), info) == "flux"
    assert single_file.parts_not_in_file(info, "flux") == missing


def test_a_file_of_no_known_family_names_the_families() -> None:
    with pytest.raises(UserError, match=r"not a checkpoint of a family sdpipe trains \(.*Flux.1.*\)"):
        single_file.family(Path("x.safetensors"), _info(["some.other.weight"]))
