"""Trackers' set-up before launch: a missing package is one line naming the install, wandb without a login runs
offline and says so. (A real wandb run offline: tests/test_train.py.)"""

from __future__ import annotations

import importlib.util
import logging

import pytest

from sdpipe import config
from sdpipe.errors import UserError
from sdpipe.train import trackers


def test_a_missing_tracker_package_is_one_line_naming_the_install(monkeypatch):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real(name, *a))
    with pytest.raises(UserError, match=r"train.tracker = 'wandb' needs the wandb package: pip install wandb"):
        trackers.check_installed("wandb")
    trackers.check_installed("none")  # nothing to install


def test_wandb_runs_offline_only_without_a_login(tmp_path, caplog):
    cfg = config.from_dict({"train": {"tracker": "wandb", "tracker_project": "dogs"}})
    assert config.from_dict({}).train.tracker_project == "sdpipe"
    no_netrc = {"NETRC": str(tmp_path / "none")}
    with caplog.at_level(logging.INFO, logger="sdpipe.train.trackers"):
        assert trackers.environment(cfg, no_netrc, tmp_path) == {"WANDB_MODE": "offline"}
    assert "WANDB_MODE=offline" in caplog.text and str(tmp_path / "wandb") in caplog.text
    assert trackers.environment(cfg, {**no_netrc, "WANDB_API_KEY": "k"}, tmp_path) == {}
    assert trackers.environment(cfg, {**no_netrc, "WANDB_MODE": "disabled"}, tmp_path) == {}  # the user's choice
    (tmp_path / "netrc").write_text("machine api.wandb.ai\n  login user\n  password secret\n")
    assert trackers.environment(cfg, {"NETRC": str(tmp_path / "netrc")}, tmp_path) == {}  # `wandb login` was run
    assert trackers.environment(config.from_dict({}), {}, tmp_path) == {}  # no tracker, nothing to set
    with pytest.raises(UserError, match="train.tracker_project = 'my dogs' is not allowed"):
        config.from_dict({"train": {"tracker_project": "my dogs"}})


def test_trackers_get_the_whole_config_as_flat_scalars():
    flat = trackers.flat(config.from_dict({"train": {"lora": {"rank": 4}}}).raw)
    assert flat["train.lora.rank"] == 4 and flat["seed"] == 0 and flat["model.revision"] == "None"
    assert all(isinstance(v, (int, float, str, bool)) for v in flat.values())
