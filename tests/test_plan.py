"""`sdpipe check-config` says what a config will do before any work: model and weights, what trains, images,
schedule, memory, outputs."""

from __future__ import annotations

import subprocess
import sys

import pytest
from PIL import Image

from sdpipe import config, plan


def test_check_config_prints_the_plan_of_the_demo():
    proc = subprocess.run([sys.executable, "-m", "sdpipe", "check-config"], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    out = proc.stdout
    assert "model: a random-init tiny preset built at models/tiny" in out
    assert "training: full fine-tune of the UNet; text encoder: full; the VAE trained first (600 steps)" in out
    assert "global batch 32; 1500 optimizer steps" in out and "memory per GPU: about" in out
    assert "outputs: results/export/diffusers/, results/export/model.safetensors" in out


def test_the_plan_names_a_local_model_and_counts_epochs(tmp_path, tiny_model, monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # no GPU here, whatever the machine
    raw = tmp_path / "raw"
    raw.mkdir()
    for i in range(40):
        Image.new("RGB", (32, 32)).save(raw / f"{i}.png")
        (raw / f"{i}.txt").write_text("a caption")  # sidecars are not images
    cfg = config.from_dict(
        {
            "model": {"pretrained": str(tiny_model)},
            "data": {"raw_dir": str(raw)},
            "prepare": {"eval_fraction": 0.0, "buckets": {"resolution": 32, "step": 8}},
            "train": {"mode": "lora", "max_steps": 10, "per_device_batch_size": 8},
        }
    )
    text = "\n".join(plan.lines(cfg))
    assert f"model: SD 1.x/2.x from {tiny_model}, local folder" in text
    assert "LoRA rank" in text and "0 GPU(s) here, 1 process(es) x 8 per device" in text
    assert "10 optimizer steps, about 2.0 epochs of 40 images" in text
    assert "results/export/lora_kohya.safetensors" in text
    named = config.from_dict({**cfg.raw, "export": {"name": "my-dog", "single_file": False}})
    outputs = next(line for line in plan.lines(named) if line.startswith("outputs:"))
    assert "results/export/lora/my-dog_lora.safetensors, results/export/my-dog_lora_kohya.safetensors" in outputs
    assert ".safetensors, results/export/my-dog.safetensors" not in outputs  # single_file: false


def test_a_missing_model_is_said_in_the_plan(tmp_path):
    cfg = config.from_dict({"model": {"pretrained": str(tmp_path / "nothing")}, "data": {"raw_dir": str(tmp_path)}})
    text = "\n".join(plan.lines(cfg))
    assert "model: NOT FOUND: model path" in text and "memory per GPU: unknown" in text


@pytest.mark.parametrize(
    "family, params, mode, batch, res, peak",
    [
        ("sd", 859.5e6, "full", 32, 512, 50.1),
        ("sd", 859.5e6, "lora", 32, 512, 40.6),
        ("sdxl", 2567.5e6, "lora", 8, 1024, 73.8),
    ],
)
def test_the_memory_rule_of_thumb_reproduces_the_peaks_it_came_from(family, params, mode, batch, res, peak):
    """Its constants come from these NOTES v12 peaks; this keeps the rule and its sources together."""
    state, acts = plan.memory_gb(family, int(params), mode, batch, res, checkpointing=False)
    assert state + acts == pytest.approx(peak, rel=0.12)


def config_only_model(root, preset: str):
    """A model folder with the preset's config files and no weights: all the checks read."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from sdpipe.models import presets

    AutoencoderKL.from_config(presets.vae_config(preset)).save_config(root / "vae")
    UNet2DConditionModel.from_config(presets.unet_config(preset)).save_config(root / "unet")
    (root / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    return root


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"prepare": {"buckets": {"resolution": 32, "step": 64}}}, "resolution = 32 for a model made for 512 px"),
        ({"prepare": {"buckets": {"resolution": 512, "step": 8}}}, "step = 8 must be a multiple of 64"),
        ({"model": {"train_vae": {"enabled": True}}}, "for real weights set model.train_vae.enabled: false"),
    ],
)
def test_demo_settings_on_a_real_model_fail_before_any_work(tmp_path, changes, message):
    """The demo's settings (32 px buckets of step 8, a VAE trained from the images) cannot slip into a run on real
    SD weights: the check reads the model's own config files."""
    model = config_only_model(tmp_path / "sd15", "sd15")
    raw = config.merge({"model": {"pretrained": str(model)}}, changes)
    with pytest.raises(config.UserError, match=message):
        config.check_user_config(config.from_dict(raw))
    config.check_user_config(config.from_dict({"model": {"pretrained": str(model)}}))  # the defaults fit SD 1.5
