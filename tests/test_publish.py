"""`sdpipe publish`: an export folder goes to export.hub.repo_id on a loopback Hub (tests/hub_server.py), which
stores what it receives: the repo is created private, every file lands byte for byte, a second publish sends only
what changed, and a missing or wrong token is one line."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sdpipe import config
from sdpipe.errors import UserError
from sdpipe.export.hub import upload
from tests.conftest import REPO

REPO_ID = "me/my-finetune"


def _export(tmp: Path) -> Path:
    """A small export folder shaped like results/export (a card with YAML metadata, configs, weights)."""
    import torch
    from safetensors.torch import save_file

    out = tmp / "export"
    (out / "diffusers" / "unet").mkdir(parents=True)
    (out / "README.md").write_text("---\nlicense: openrail\ntags: [sdpipe]\n---\n# my fine-tune\n")
    (out / "diffusers" / "model_index.json").write_text(json.dumps({"_class_name": "StableDiffusionPipeline"}))
    (out / "diffusers" / "unet" / "config.json").write_text(json.dumps({"sample_size": 4}))
    save_file({"w": torch.arange(6, dtype=torch.float32)}, str(out / "model.safetensors"))
    return out


def _cfg(tmp: Path, **hub):
    return config.from_dict(
        {
            "cache_dir": str(tmp / "cache"),
            "data": {"raw_dir": str(tmp / "raw")},
            "export": {"hub": {"repo_id": REPO_ID, **hub}},
        }
    )


def _tree(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def test_an_upload_lands_every_file(hub, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", hub.token)
    folder = _export(tmp_path)
    url = upload(_cfg(tmp_path), folder)
    repo = hub.repos[REPO_ID]
    assert repo.private, "export.hub.private defaults to true"
    assert {k: v for k, v in repo.files.items() if k != ".gitattributes"} == _tree(folder)
    assert url.endswith(f"/{REPO_ID}/commit/{repo.sha}")

    (folder / "README.md").write_text("---\nlicense: openrail\n---\n# my fine-tune, trained longer\n")
    upload(_cfg(tmp_path), folder)  # the repo exists now: create_repo(exist_ok) goes on
    assert repo.last_added == ["README.md"], "unchanged files are not sent again"
    assert repo.files["README.md"] == (folder / "README.md").read_bytes() and len(repo.commits) == 3


def test_a_public_repo_when_asked(hub, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("MY_HF_WRITE", hub.token)
    upload(_cfg(tmp_path, private=False, token_env="MY_HF_WRITE"), _export(tmp_path))
    assert not hub.repos[REPO_ID].private


def test_token_and_settings_mistakes_are_one_line(hub, tmp_path, monkeypatch) -> None:
    folder = _export(tmp_path)
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(UserError, match="environment variable HF_TOKEN is not set"):
        upload(_cfg(tmp_path), folder)
    monkeypatch.setenv("HF_TOKEN", "not-the-token")
    with pytest.raises(UserError, match=rf"cannot publish to {REPO_ID}: .*401.*a write token"):
        upload(_cfg(tmp_path), folder)
    assert REPO_ID not in hub.repos
    with pytest.raises(UserError, match="export.hub.repo_id is null"):
        upload(config.from_dict({"data": {"raw_dir": "x"}}), folder)
    monkeypatch.setenv("HF_TOKEN", hub.token)
    with pytest.raises(UserError, match="nothing to publish"):
        upload(_cfg(tmp_path), tmp_path / "no-export")
    with pytest.raises(UserError, match=r"export.hub.repo_id = 'my model' is not allowed"):
        _cfg(tmp_path, repo_id="my model")


def test_the_command_publishes_a_folder(hub, tmp_path) -> None:
    folder = _export(tmp_path)
    cfg_file = tmp_path / "config.yaml"
    cfg_file.write_text(
        yaml.safe_dump(
            {"cache_dir": str(tmp_path / "cache"), "data": {"raw_dir": "raw"}, "export": {"hub": {"repo_id": REPO_ID}}}
        )
    )
    env = {**os.environ, **hub.env, "HF_TOKEN": hub.token}
    done = subprocess.run(
        [sys.executable, "-m", "sdpipe", "publish", "--config", str(cfg_file), "--folder", str(folder)],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == f"{hub.url}/{REPO_ID}/commit/{hub.repos[REPO_ID].sha}"
    assert hub.repos[REPO_ID].files["model.safetensors"] == (folder / "model.safetensors").read_bytes()


def test_the_model_card_goes_up_beside_the_export_in_one_commit(hub, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("HF_TOKEN", hub.token)
    folder = _export(tmp_path)
    (folder / "README.md").unlink()
    card = tmp_path / "card"
    card.mkdir()
    (card / "README.md").write_text("---\nlicense: other\n---\n# the card\n![samples](samples.png)\n")
    (card / "samples.png").write_bytes(b"\x89PNG fake grid")
    upload(_cfg(tmp_path), folder, card)
    repo = hub.repos[REPO_ID]
    assert repo.files["README.md"] == (card / "README.md").read_bytes()
    assert repo.files["samples.png"] == b"\x89PNG fake grid" and "diffusers/model_index.json" in repo.files
    assert len(repo.commits) == 2  # the repo's creation, then one upload with everything
