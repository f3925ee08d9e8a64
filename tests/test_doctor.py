"""`sdpipe doctor` says "found" only for weights that would load: a diffusers folder with its index, parsing configs
and whole weight files of the configured variant; a single file whose header reads, whose family is recognised and
whose conversion configs are here. Anything else is "missing: ..." or "unreadable: ..."."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from sdpipe import config
from sdpipe.ops import doctor
from tests.conftest import small_config


@pytest.fixture(scope="module")
def single(tiny_model, tmp_path_factory) -> Path:
    from sdpipe.export.single_file import export_single_file

    return export_single_file(tiny_model, tmp_path_factory.mktemp("single") / "model.safetensors", dtype="fp16")


def _row(tmp: Path, model: Path | str, **model_keys) -> tuple[str, bool]:
    raw = small_config(tmp, tmp / "raw", model)
    raw["model"].update(model_keys)
    ((what, status, ok),) = doctor.weight_rows(config.from_dict(raw))
    return status, ok


def _copy(tiny_model: Path, tmp: Path) -> Path:
    return Path(shutil.copytree(tiny_model, tmp / "copy"))


def test_a_whole_folder_is_found(tiny_model, tmp_path) -> None:
    status, ok = _row(tmp_path, tiny_model)
    assert ok and status.startswith(f"found: {tiny_model} (5 components")


def test_a_truncated_weight_file_is_not_found(tiny_model, tmp_path) -> None:
    model = _copy(tiny_model, tmp_path)
    weights = model / "unet" / "diffusion_pytorch_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])  # an interrupted copy
    status, ok = _row(tmp_path, model)
    assert not ok and status.startswith("unreadable: ") and "truncated" in status and "unet" in status


def test_a_broken_config_or_a_missing_part_is_not_found(tiny_model, tmp_path) -> None:
    model = _copy(tiny_model, tmp_path)
    (model / "vae" / "config.json").write_text('{"block_out_channels": [32, ')
    status, ok = _row(tmp_path, model)
    assert not ok and status.startswith("unreadable: ") and "vae/config.json does not parse" in status
    shutil.rmtree(model / "vae")
    status, ok = _row(tmp_path, model)
    assert not ok and status.startswith("missing: ") and "vae/ (listed in model_index.json)" in status
    (model / "model_index.json").unlink()
    status, ok = _row(tmp_path, model)
    assert not ok and "no model_index.json" in status


def test_the_configured_variant_must_be_there(tiny_model, tmp_path) -> None:
    status, ok = _row(tmp_path, tiny_model, variant="fp16")
    assert not ok and status.startswith("missing: ") and "has no fp16 weights for text_encoder" in status


def test_a_hub_id_not_in_the_cache_is_missing(tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    status, ok = _row(tmp_path, "nobody-sdpipe-test/not-a-model")
    assert not ok and status.startswith("missing: ") and "sdpipe fetch-model" in status


def test_a_single_file_is_found_when_it_can_be_converted(tiny_model, single, tmp_path, monkeypatch) -> None:
    status, ok = _row(tmp_path, single, single_file_config=str(tiny_model))
    assert ok and "single-file sd checkpoint" in status
    assert not (tmp_path / "cache" / "base-models").exists(), "doctor checks; it does not convert"

    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    status, ok = _row(tmp_path, single)  # diffusers' default SD 1.x configs: not in this cache
    assert not ok and status.startswith("missing: ") and "sdpipe fetch-model" in status


def test_an_unreadable_or_unknown_single_file_is_not_found(tiny_model, single, tmp_path) -> None:
    cut = tmp_path / "cut.safetensors"
    cut.write_bytes(single.read_bytes()[: single.stat().st_size // 2])
    status, ok = _row(tmp_path, cut, single_file_config=str(tiny_model))
    assert not ok and status.startswith("unreadable: ") and "truncated" in status
    other = tmp_path / "other.safetensors"
    save_file({"encoder.weight": torch.zeros(2, 2)}, str(other))
    status, ok = _row(tmp_path, other, single_file_config=str(tiny_model))
    assert not ok and status.startswith("unreadable: ") and "not a checkpoint of a family sdpipe trains" in status
