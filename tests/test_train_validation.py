"""Validation grids: shape, determinism, and that they show the UNet being trained (full weights and LoRA)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from PIL import Image

from sdpipe.models import loading
from sdpipe.train import validation

PROMPTS, SEEDS = ["a red circle", "a blue square"], [0, 1]


@pytest.fixture(scope="module")
def accelerator():
    from accelerate import Accelerator

    return Accelerator(cpu=True)


def _cfg(model):
    from sdpipe import config

    return config.from_dict({"model": {"pretrained": str(model)}})


def _unet(model):
    unet = loading.load_unet(str(model))
    unet.train()  # as in the training loop
    return unet


def _render(accelerator, unet, model, out, step=0) -> np.ndarray:
    path = validation.render(
        accelerator,
        {"unet": unet},
        _cfg(model),
        step,
        out,
        PROMPTS,
        SEEDS,
        num_inference_steps=2,
        guidance_scale=3.0,
        resolution=(32, 32),
    )
    assert path == out / f"step-{step:08d}.png" and path.is_file()
    with Image.open(path) as im:
        assert im.size == (2 * 32, 2 * 32)
        return np.asarray(im.convert("RGB")).copy()


def test_grid_is_deterministic_and_follows_the_weights(accelerator, tiny_model, tmp_path):
    unet = _unet(tiny_model)
    first = _render(accelerator, unet, tiny_model, tmp_path, step=1)
    assert unet.training and not any(p.grad is not None for p in unet.parameters())
    assert np.array_equal(first, _render(accelerator, unet, tiny_model, tmp_path, step=2))
    assert not np.array_equal(first[:32, :32], first[:32, 32:])  # the seeds differ
    with torch.no_grad():
        unet.conv_in.weight.add_(0.1)
    assert not np.array_equal(first, _render(accelerator, unet, tiny_model, tmp_path, step=3))
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"step-0000000{i}.png" for i in (1, 2, 3)]


def test_vae_and_text_encoder_are_freed(accelerator, tiny_model, tmp_path, monkeypatch):
    import weakref

    from diffusers.utils import logging as dlog

    refs, load = [], validation.load_pipeline

    def spy(*args, **kwargs):
        pipe = load(*args, **kwargs)
        refs.extend(weakref.ref(m) for m in (pipe.vae, pipe.text_encoder))
        return pipe

    monkeypatch.setattr(validation, "load_pipeline", spy)
    _render(accelerator, _unet(tiny_model), tiny_model, tmp_path)
    assert len(refs) == 2 and all(r() is None for r in refs)
    assert dlog.is_progress_bar_enabled()  # silenced only while loading


def test_lora_adapters_show_in_the_grid(accelerator, tiny_model, tmp_path):
    from peft import LoraConfig

    plain = _render(accelerator, _unet(tiny_model), tiny_model, tmp_path / "plain")
    unet = _unet(tiny_model)
    unet.add_adapter(LoraConfig(r=4, lora_alpha=4, target_modules=["to_q", "to_k", "to_v", "to_out.0"]))
    unet.train()
    # lora_B starts at zero: the adapters are there but do nothing yet.
    assert np.array_equal(plain, _render(accelerator, unet, tiny_model, tmp_path / "zero"))
    with torch.no_grad():
        for name, p in unet.named_parameters():
            if "lora_B" in name:
                p.fill_(0.05)
    assert not np.array_equal(plain, _render(accelerator, unet, tiny_model, tmp_path / "lora"))
    assert unet.training


def test_sdxl_family_renders(accelerator, tmp_path):
    from sdpipe.models import presets

    model = presets.build_and_save("tiny-sdxl", tmp_path / "xl", seed=0)
    _render(accelerator, _unet(model), model, tmp_path / "out")
