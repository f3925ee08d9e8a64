"""`sdpipe fetch-model` against a loopback Hub (tests/hub_server.py): only the files the configured job loads come
down (one weight variant, no .bin/ONNX/Flax copies, no safety checker, no repo-root single file), and what came
down is then found offline by the same loaders a run uses."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from sdpipe import config, weights
from sdpipe.errors import UserError
from sdpipe.fetch_model import fetch_model
from sdpipe.models import loading, owned
from sdpipe.ops import doctor
from tests.conftest import REPO, small_config

REPO_ID = "someone/tiny-sd"
EXTRAS = {  # what real diffusers repos carry beside the files a job reads (SD 1.5's repo has all of these kinds)
    "unet/diffusion_pytorch_model.bin": b"bin copy",
    "unet/diffusion_pytorch_model.non_ema.safetensors": b"non-ema copy",
    "text_encoder/pytorch_model.bin": b"bin copy",
    "text_encoder/flax_model.msgpack": b"flax copy",
    "safety_checker/config.json": b"{}",
    "safety_checker/model.safetensors": b"safety checker weights",
    "onnx/unet/model.onnx": b"onnx export",
    "v1-5-pruned-emaonly.safetensors": b"the whole model again, as one file",
    "v1-inference.yaml": b"model: {}",
}


def _repo_files(tiny_model: Path) -> dict[str, bytes]:
    files = {
        p.relative_to(tiny_model).as_posix(): p.read_bytes()
        for p in tiny_model.rglob("*")
        if p.is_file() and p.name != owned.MARKER
    }  # a Hub repository holds no mark of sdpipe's own presets
    index = json.loads(files["model_index.json"])
    index["safety_checker"] = ["stable_diffusion", "StableDiffusionSafetyChecker"]
    files["model_index.json"] = json.dumps(index).encode()
    for name in [f for f in files if f.endswith(".safetensors")]:  # the fp16 variant beside each weight file
        files[name.replace(".safetensors", ".fp16.safetensors")] = files[name]
    return files | EXTRAS


def _cfg(tmp: Path, model: str | Path, **model_keys):
    raw = small_config(tmp, tmp / "raw", model)
    raw["model"].update(model_keys)
    return config.from_dict(raw)


def _small_files(files: dict) -> set[str]:
    return {f for f in files if f.endswith((".json", ".txt")) and not f.startswith("onnx/")}


@pytest.mark.parametrize("variant", [None, "fp16"])
def test_only_the_job_s_files_come_down(hub, tiny_model, tmp_path, variant) -> None:
    files = _repo_files(tiny_model)
    hub.add(REPO_ID, files)
    lines = fetch_model(_cfg(tmp_path, REPO_ID, variant=variant))
    suffix = ".fp16.safetensors" if variant else ".safetensors"
    weights_wanted = {
        f"{c}/{n}{suffix}"
        for c, n in [("unet", "diffusion_pytorch_model"), ("vae", "diffusion_pytorch_model"), ("text_encoder", "model")]
    }
    assert set(hub.downloaded()) == _small_files(files) | weights_wanted
    total = sum(len(files[f]) for f in _small_files(files) | weights_wanted)
    assert lines[-1] == f"total {total / 1e6:.1f} MB in {len(weights_wanted) + len(_small_files(files))} files"
    assert any(line.strip().startswith(f"unet/diffusion_pytorch_model{suffix}") for line in lines)


def test_fetched_files_load_offline(hub, tiny_model, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    hub.add(REPO_ID, _repo_files(tiny_model))
    fetch_model(_cfg(tmp_path, REPO_ID))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # the training machine: the cache, no network
    requests = len(hub.requests)
    unet = loading.load_unet(REPO_ID)
    want = loading.load_unet(str(tiny_model)).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in unet.state_dict().items())
    ((_, status, ok),) = doctor.weight_rows(_cfg(tmp_path, REPO_ID))
    assert ok, status
    assert len(hub.requests) == requests, "nothing asked of the Hub once fetched"


def test_a_variant_the_repo_lacks_is_one_line(hub, tiny_model, tmp_path) -> None:
    hub.add(REPO_ID, _repo_files(tiny_model))
    with pytest.raises(UserError, match=r"no bf16 \.safetensors weights for \w+ \(it has: fp16, (non_ema, )?plain\)"):
        fetch_model(_cfg(tmp_path, REPO_ID, variant="bf16"))
    with pytest.raises(UserError, match="someone/other not found on the Hub"):
        fetch_model(_cfg(tmp_path, "someone/other"))


def test_a_single_file_fetches_configs_only_and_then_converts(hub, tiny_model, tmp_path, monkeypatch) -> None:
    from huggingface_hub import constants

    from sdpipe.export.single_file import export_single_file

    files = _repo_files(tiny_model)
    hub.add("someone/tiny-configs", files)
    single = export_single_file(tiny_model, tmp_path / "mine.safetensors", dtype="fp32")
    cfg = _cfg(tmp_path, single, single_file_config="someone/tiny-configs")
    lines = fetch_model(cfg)
    assert set(hub.downloaded()) == _small_files(files), "configs and tokenizers only: the weights are in the file"
    assert "configs and tokenizers only" in lines[0]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    unet = loading.load_unet(str(single))
    want = loading.load_unet(str(tiny_model)).state_dict()
    assert all(torch.equal(v, want[k]) for k, v in unet.state_dict().items())
    assert weights.resolve(str(single)).parent == tmp_path / "cache" / "base-models"


def test_nothing_to_fetch_for_local_folders(tiny_model, tmp_path) -> None:
    assert fetch_model(_cfg(tmp_path, tiny_model))[0].startswith("nothing to fetch: model.pretrained is a local folder")


def test_the_command_prints_what_it_fetched(hub, tiny_model, tmp_path) -> None:
    hub.add(REPO_ID, _repo_files(tiny_model))
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(yaml.safe_dump(small_config(tmp_path, tmp_path / "raw", REPO_ID)))
    env = {**os.environ, **hub.env}
    run = lambda *extra: subprocess.run(
        [sys.executable, "-m", "sdpipe", "fetch-model", "--config", str(cfg_file), *extra],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    done = run()
    assert done.returncode == 0, done.stderr
    assert f"{REPO_ID}: weights, configs and tokenizers in " in done.stdout and "\ntotal " in done.stdout
    assert Path(hub.env["HF_HUB_CACHE"], "models--someone--tiny-sd", "snapshots").is_dir()
    failed = run("--set", "model.pretrained=someone/missing")
    assert failed.returncode == 2 and failed.stderr.count("\n") == 1 and "not found on the Hub" in failed.stderr


def test_an_sd35_file_fetches_the_text_encoders_it_lacks_and_no_other_weights(hub, tmp_path, monkeypatch) -> None:
    """Stability's sd3.5 files hold the MMDiT and the VAE: fetch-model brings the configs and the three text
    encoders' weights of model.single_file_config, and the conversion then runs offline."""
    from huggingface_hub import constants

    from sdpipe.export.single_file import export_single_file
    from sdpipe.models import presets

    folder = presets.build_and_save("tiny-sd3", tmp_path / "tiny-sd3", seed=0)
    files = {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}
    hub.add("someone/tiny-sd35", {f: b for f, b in files.items() if not f.endswith(owned.MARKER)})
    single = export_single_file(folder, tmp_path / "sd3.5_tiny.safetensors", dtype="fp32")
    lines = fetch_model(_cfg(tmp_path, single, single_file_config="someone/tiny-sd35"))
    fetched = {f.split("/")[0] for f in hub.downloaded() if f.endswith(".safetensors")}
    assert fetched == {"text_encoder", "text_encoder_2", "text_encoder_3"}, "no transformer or VAE weights"
    assert "the weights the single file lacks (text_encoder, text_encoder_2, text_encoder_3)" in lines[0]
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    got, want = loading.load_unet(str(single)).state_dict(), loading.load_unet(str(folder)).state_dict()
    assert got.keys() == want.keys() and all(torch.equal(v, want[k]) for k, v in got.items())
