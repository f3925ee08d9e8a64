"""A single-file base model (.safetensors or .ckpt, as A1111/ComfyUI users have them) works wherever a diffusers
folder does: weights.resolve converts it once, with diffusers' from_single_file, into a folder under cache_dir keyed
by content, and every loader then reads that folder. The files are the tiny presets written in the original SD
layout by sdpipe's own single-file export (the layout diffusers reads), configs from the preset folder."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdpipe import config, single_file, weights
from sdpipe.errors import UserError
from sdpipe.export.single_file import export_single_file
from sdpipe.models import loading, presets
from tests.conftest import small_config
from tests.test_latents import make_inputs


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """preset -> (diffusers folder, the same model as one fp32 original-layout .safetensors)."""
    made = {}

    def get(preset: str):
        if preset not in made:
            tmp = tmp_path_factory.mktemp(preset)
            folder = presets.build_and_save(preset, tmp / preset, seed=0)
            made[preset] = folder, export_single_file(folder, tmp / "user-model.safetensors", dtype="fp32")
        return made[preset]

    return get


@pytest.fixture
def conversions(monkeypatch):
    """Counts real conversions; the in-process memo is emptied, as in a new process."""
    calls = []
    real = single_file.convert

    def counted(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(single_file, "convert", counted)
    monkeypatch.setattr(single_file, "_converted", {})
    return calls


def _configure(tmp: Path, configs: Path | None) -> config.Config:
    raw = small_config(tmp, tmp / "raw", tmp / "unused")
    raw["model"]["single_file_config"] = str(configs) if configs else None
    return config.from_dict(raw)  # loading a config is what tells weights.resolve where conversions go


def _same(got: torch.nn.Module, want: torch.nn.Module, what: str) -> None:
    a, b = got.state_dict(), want.state_dict()
    assert a.keys() == b.keys(), what
    assert all(torch.equal(a[k], b[k]) for k in b), f"{what}: weights differ"


@pytest.mark.parametrize("preset", ["tiny", "tiny-sdxl"])
def test_a_single_file_loads_like_its_folder(base, tmp_path, conversions, preset) -> None:
    folder, file = base(preset)
    _configure(tmp_path, folder)
    converted = weights.resolve(str(file))
    assert converted.parent == tmp_path / "cache" / "base-models" and (converted / "model_index.json").is_file()
    assert loading.pipeline_family(str(file)) == presets.family(preset)
    _same(loading.load_unet(str(file)), loading.load_unet(str(folder)), "unet")
    _same(loading.load_vae(str(file)), loading.load_vae(str(folder)), "vae")
    for got, want in zip(loading.load_text_stack(str(file)).encoders, loading.load_text_stack(str(folder)).encoders):
        _same(got, want, "text encoder")
    assert conversions == [file], "converted once for all those loads"


def test_the_conversion_is_cached_by_content(base, tmp_path, conversions, monkeypatch) -> None:
    folder, file = base("tiny")
    _configure(tmp_path, folder)
    first = weights.resolve(str(file))
    monkeypatch.setattr(single_file, "_converted", {})  # a later process: only the cache on disk is left
    moved = tmp_path / "renamed.safetensors"
    moved.write_bytes(file.read_bytes())
    assert weights.resolve(str(moved)) == first, "same content, same folder, whatever the file's name"
    assert conversions == [file]

    state = load_file(moved)
    state["model.diffusion_model.out.2.bias"] += 1.0  # the user trained it a little more
    save_file(state, str(moved))
    stat = moved.stat()  # hashes are memoised by (path, size, mtime): make the edit visible on coarse-clock disks
    os.utime(moved, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000_000))
    second = weights.resolve(str(moved))
    assert second != first and conversions == [file, moved]
    bias = loading.load_unet(str(moved)).conv_out.bias
    assert torch.equal(bias, loading.load_unet(str(folder)).conv_out.bias + 1.0)


def test_a_ckpt_with_a_state_dict_converts_too(base, tmp_path, conversions) -> None:
    folder, file = base("tiny")
    _configure(tmp_path, folder)
    ckpt = tmp_path / "model.ckpt"
    torch.save({"state_dict": load_file(file), "global_step": 1000}, ckpt)  # how ldm/Lightning checkpoints look
    _same(loading.load_unet(str(ckpt)), loading.load_unet(str(folder)), "unet from .ckpt")
    assert conversions == [ckpt]


def test_the_latents_stage_runs_on_a_single_file(base, tmp_path, conversions) -> None:
    from sdpipe.stages import latents

    folder, file = base("tiny")
    raw, manifest, captions = make_inputs(tmp_path, 6)
    settings = small_config(tmp_path, raw, file, latents={"cpu_processes": 1})
    settings["model"]["single_file_config"] = str(folder)
    cfg = config.from_dict(settings)
    paths = {"manifest": manifest, "captions": captions}
    out = {"index": tmp_path / "out" / "index.json", "summary": tmp_path / "out" / "summary.json"}
    first = latents.run(cfg, paths, out)
    assert first["items"] == 6 and first["encoded"] == 6
    again = latents.run(config.from_dict(settings), paths, out)
    assert again["reused"] == 6 and again["encoded"] == 0, "same converted weights, same cache keys"
    assert conversions == [file]


def test_the_converted_folder_names_the_configs_too(base, tmp_path, conversions) -> None:
    """Another config folder (another tokenizer or scheduler) is another conversion, not a stale reuse."""
    import shutil

    folder, file = base("tiny")
    _configure(tmp_path, folder)
    first = weights.resolve(str(file))
    other = tmp_path / "configs"
    shutil.copytree(folder, other)
    scheduler = other / "scheduler" / "scheduler_config.json"
    scheduler.write_text(scheduler.read_text().replace('"steps_offset": 1', '"steps_offset": 0'))
    _configure(tmp_path, other)
    assert weights.resolve(str(file)) != first and len(conversions) == 2


def test_missing_configs_say_what_to_run(base, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-hf-cache"))
    _, file = base("tiny")
    _configure(tmp_path, None)  # diffusers' default configs for an SD 1.x file: not in this (empty) cache
    with pytest.raises(UserError, match=r"stable-diffusion-v1-5/stable-diffusion-v1-5 .*sdpipe fetch-model"):
        weights.resolve(str(file))
    _configure(tmp_path, tmp_path / "nowhere")
    with pytest.raises(UserError, match="model.single_file_config = .*nowhere: no such folder"):
        weights.resolve(str(file))


def test_files_that_are_not_base_models_are_named(tmp_path) -> None:
    _configure(tmp_path, None)
    lora = tmp_path / "style.safetensors"
    save_file({"lora_unet_down_blocks_0_attentions_0_proj_in.lora_down.weight": torch.zeros(4, 8)}, str(lora))
    with pytest.raises(UserError, match="is a LoRA file, not a base model"):
        weights.resolve(str(lora))
    inpaint = tmp_path / "inpaint.safetensors"
    save_file(
        {
            "model.diffusion_model.input_blocks.0.0.weight": torch.zeros(32, 9, 3, 3),
            "cond_stage_model.transformer.x": torch.zeros(1),
        },
        str(inpaint),
    )
    with pytest.raises(UserError, match="inpainting or other 9-channel checkpoint"):
        weights.resolve(str(inpaint))
    junk = tmp_path / "junk.safetensors"
    junk.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json}......")
    with pytest.raises(UserError, match="header is not JSON"):
        weights.resolve(str(junk))
