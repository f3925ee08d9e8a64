"""Experiment trackers through accelerate (train.tracker): dvclive, tensorboard, wandb.

metrics.csv is always written; a tracker gets the same rows (telemetry.py) plus the run's config. Each tracker
writes under the training output folder (results/train/<tracker>), never into the project's files.

wandb needs an account to upload. Without a login (no WANDB_API_KEY, no wandb entry in ~/.netrc) the training
processes get WANDB_MODE=offline: the run is recorded in results/train/wandb/offline-run-*, and `wandb sync` uploads
it later. A WANDB_MODE the user set is kept.
"""

from __future__ import annotations

import importlib.util
import logging
import netrc
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import urlparse

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config

log = logging.getLogger(__name__)
INSTALL = {"wandb": "pip install wandb (or pip install 'sdpipe[wandb]')"}


def check_installed(name: str) -> None:
    """Before any process starts: accelerate would only fail inside the launched processes."""
    if name != "none" and importlib.util.find_spec(name) is None:
        raise UserError(
            f"train.tracker = {name!r} needs the {name} package: {INSTALL.get(name, f'pip install {name}')}"
        )


def wandb_logged_in(environ: dict) -> bool:
    if environ.get("WANDB_API_KEY"):
        return True
    host = urlparse(environ.get("WANDB_BASE_URL") or "https://api.wandb.ai").hostname
    try:
        return netrc.netrc(environ.get("NETRC")).authenticators(host or "") is not None
    except (OSError, netrc.NetrcParseError):  # no ~/.netrc, or one wandb cannot read either
        return False


def environment(cfg: Config, environ: dict, out: Path) -> dict[str, str]:
    """What the training processes' environment needs for the tracker (run by `sdpipe train` before launching)."""
    if cfg.train.tracker != "wandb":
        return {}
    if environ.get("WANDB_MODE"):
        log.info("wandb: WANDB_MODE=%s, as set in the environment", environ["WANDB_MODE"])
        return {}
    if wandb_logged_in(environ):
        log.info("wandb: logging online to project %r", cfg.train.tracker_project)
        return {}
    log.info(
        "wandb: no WANDB_API_KEY and no wandb login found, so wandb runs offline (WANDB_MODE=offline) into "
        "%s; upload it later with `wandb sync <run folder>`, or set WANDB_API_KEY to log online",
        out / "wandb",
    )
    return {"WANDB_MODE": "offline"}


def init_kwargs(out: Path) -> dict:
    return {
        # Inside results/, no git experiment, and no edits to the project's dvc.yaml (which declares its own plots).
        "dvclive": {"dir": str(out / "dvclive"), "save_dvc_exp": False, "dvcyaml": False},
        # wandb makes <dir>/wandb/<run>; without dir it writes into the working directory (the project root).
        "wandb": {"dir": str(out)},
    }


def flat(d: dict, prefix: str = "") -> dict:
    """Trackers take flat scalar hyperparameters: {"train": {"lora": {"rank": 8}}} -> {"train.lora.rank": 8}."""
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v if isinstance(v, (int, float, str, bool)) else str(v)  # tensorboard: no None
    return out


def start(accelerator, cfg: Config, out: Path) -> None:
    """Start the configured tracker on every rank (accelerate keeps the main process's only)."""
    if cfg.train.tracker == "none":
        return
    accelerator.init_trackers(cfg.train.tracker_project, config=flat(cfg.raw), init_kwargs=init_kwargs(out))
