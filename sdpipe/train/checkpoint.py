"""Resumable checkpoints: written whole into a hidden folder, then renamed into place.

Every rank calls save() (accelerate's save_state is collective under FSDP/DeepSpeed; under DDP it writes on the
main process). Only the main process renames, writes the sdpipe state and rotates old checkpoints. A kill at any
moment leaves either a complete `checkpoint-NNNNNNNN` folder or an ignored `.tmp-` one, never half a checkpoint
that resume would load.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from sdpipe import io
from sdpipe.errors import UserError

STATE_FILE = "sdpipe_state.json"
PREFIX = "checkpoint-"


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file())


def find_resume(root: Path, resume: str | None) -> Path | None:
    """The checkpoint to resume from: None, the newest complete one ("latest"), or a given folder."""
    if resume is None:
        return None
    if resume == "latest":
        found = complete_checkpoints(root)
        return found[-1] if found else None
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"train.resume: {resume} is not a complete sdpipe checkpoint (no {STATE_FILE})")
    return path


def read_state(path: Path) -> dict:
    return io.read_json(path / STATE_FILE)


def check_compatible(state: dict, model_id: dict, path: Path) -> None:
    """A checkpoint of another base model or another training mode cannot be resumed."""
    theirs = state.get("model_id")
    if theirs != model_id:
        raise UserError(f"checkpoint {path} was trained from another model or mode ({theirs}); this run is "
                        f"{model_id}. Set train.resume: null to start fresh, or delete the old checkpoints")


def restore_metrics(path: Path, metrics: Path, is_main: bool) -> None:
    """Put back metrics.csv as it was at the checkpoint, so rows after it are not duplicated on resume."""
    if is_main and (path / "metrics.csv").is_file():
        shutil.copyfile(path / "metrics.csv", metrics)


def save(accelerator, root: Path, step: int, state: dict, keep: int, metrics: Path | None = None) -> Path:
    final = root / f"{PREFIX}{step:08d}"
    tmp = root / f".tmp-{PREFIX}{step:08d}"
    if accelerator.is_main_process:
        shutil.rmtree(tmp, ignore_errors=True)
        root.mkdir(parents=True, exist_ok=True)
    accelerator.wait_for_everyone()
    accelerator.save_state(str(tmp))
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if metrics is not None and metrics.is_file():
            shutil.copyfile(metrics, tmp / "metrics.csv")
        io.write_json(tmp / STATE_FILE, state)  # written last: its presence marks the folder complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def match_state_layout(optimizer) -> int:
    """Give each optimizer state tensor its parameter's memory layout; return how many were rearranged.

    Fused AdamW pairs a parameter with its moments by memory position, not by index. A checkpoint written by a
    compiled GPU run (channels-last weights) and resumed eager or on a CPU, or the reverse, would otherwise update
    each weight with another weight's moments, silently.
    """
    import torch

    inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
    changed = 0
    for group in inner.param_groups:
        for p in group["params"]:
            state = inner.state.get(p, {})
            for key, value in state.items():
                if torch.is_tensor(value) and value.shape == p.shape and value.stride() != p.stride():
                    state[key] = torch.empty_like(p, dtype=value.dtype).copy_(value)
                    changed += 1
    return changed
