"""Resumable checkpoints: written whole into a hidden folder, then renamed into place.

Every rank calls save() (accelerate's save_state is collective under FSDP/DeepSpeed; under DDP it writes on the
main process). Only the main process renames, writes the sdpipe state and rotates old checkpoints. A kill at any
moment leaves either a complete `checkpoint-NNNNNNNN` folder or an ignored `.tmp-` one, never half a checkpoint
that resume would load.
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from pathlib import Path

from sdpipe import hashing, io
from sdpipe.errors import UserError

log = logging.getLogger("sdpipe.train")
STATE_FILE = "sdpipe_state.json"
PREFIX = "checkpoint-"


def complete_checkpoints(root: Path) -> list[Path]:
    if not root.is_dir():
        return []
    return sorted(p for p in root.iterdir() if p.name.startswith(PREFIX) and (p / STATE_FILE).is_file())


def find_resume(root: Path, resume: str | None) -> list[Path]:
    """The checkpoints to try, best first: none, the complete ones newest first ("latest": resume falls back to
    an older one when the newest is damaged), or a given folder alone."""
    if resume is None:
        return []
    if resume == "latest":
        return complete_checkpoints(root)[::-1]
    path = Path(resume)
    if not (path / STATE_FILE).is_file():
        raise UserError(f"train.resume: {resume} is not a complete sdpipe checkpoint (no {STATE_FILE})")
    return [path]


def file_sums(folder: Path) -> dict[str, list]:
    """[size, sha256] of every file under `folder` but the state file, by relative path."""
    files = sorted(p for p in folder.rglob("*") if p.is_file() and p.name != STATE_FILE)
    return {str(f.relative_to(folder)): [f.stat().st_size, hashing.sha256_file(f)] for f in files}


def damage(path: Path) -> str | None:
    """What is wrong with checkpoint `path` against the sums its state recorded, or None (also for a checkpoint
    written before sums were recorded)."""
    try:
        wanted = read_state(path).get("files")
    except (OSError, ValueError) as exc:
        return f"its {STATE_FILE} is unreadable ({type(exc).__name__})"
    if wanted is None:
        return None
    have = file_sums(path)
    for name, (size, sha) in wanted.items():
        if name not in have:
            return f"{name} is missing"
        if have[name][0] != size:
            return f"{name} is damaged ({have[name][0]} bytes, {size} written)"
        if have[name][1] != sha:
            return f"{name} is damaged (checksum)"
    return None


def read_state(path: Path) -> dict:
    return io.read_json(path / STATE_FILE)


def check_compatible(state: dict, model_id: dict, path: Path) -> None:
    """A checkpoint of another base model or another training mode cannot be resumed."""
    theirs = state.get("model_id")
    if theirs != model_id:
        raise UserError(
            f"checkpoint {path} was trained from another model or mode ({theirs}); this run is "
            f"{model_id}. Set train.resume: null to start fresh, or delete the old checkpoints"
        )


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
    try:
        accelerator.save_state(str(tmp))
    except (OSError, RuntimeError) as exc:
        if not disk_full(exc, root):
            raise
        shutil.rmtree(tmp, ignore_errors=True)
        free_mb = shutil.disk_usage(root).free / 1e6
        raise UserError(
            f"the disk is full: checkpoint {final.name} could not be saved under {root} ({free_mb:.0f} MB "
            f"free); free space (or lower train.keep_checkpoints), then rerun: training resumes from the "
            f"last complete checkpoint"
        ) from exc
    accelerator.wait_for_everyone()
    if accelerator.is_main_process:
        if metrics is not None and metrics.is_file():
            shutil.copyfile(metrics, tmp / "metrics.csv")
        started = time.perf_counter()
        sums = file_sums(tmp)  # what resume verifies before it trusts this checkpoint
        log.info(
            "checkpoint %s: %d files, %.1f MB hashed in %.2f s",
            final.name,
            len(sums),
            sum(size for size, _ in sums.values()) / 1e6,
            time.perf_counter() - started,
        )
        io.write_json(tmp / STATE_FILE, {**state, "files": sums})  # written last: it marks the folder complete
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        for old in complete_checkpoints(root)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    accelerator.wait_for_everyone()
    return final


def save_only_trainable(accelerator) -> None:
    """A checkpoint holds the weights training changes, not the frozen base every run loads again: a LoRA run's
    checkpoint is its adapters (megabytes), not a copy of the transformer (FLUX.1's: 24 GB in bf16)."""

    def drop_frozen(models, weights, _output_dir) -> None:
        for model, state in zip(models, weights):
            for name in frozen_names(accelerator.unwrap_model(model)):
                state.pop(name, None)

    accelerator.register_save_state_pre_hook(drop_frozen)


def frozen_names(model) -> set[str]:
    return {name for name, p in model.named_parameters() if not p.requires_grad}


def trained_weights_missing(path: Path, models: list) -> str | None:
    """After a checkpoint of trainable weights only loaded (non-strict, so the frozen base is not asked for): which
    trained weight the files lack or did not set, or None. Every name is checked in the file's header; one value
    per model is compared, enough to catch names that matched nothing (a wrapper's prefix), without reading a
    fully trained model's weights twice."""
    import torch
    from safetensors import safe_open

    for i, model in enumerate(models):
        file = path / (f"model_{i}.safetensors" if i else "model.safetensors")
        if not file.is_file():
            return f"{file.name} is missing"
        trained = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
        with safe_open(str(file), framework="pt") as f:
            keys = set(f.keys())
            missing = next((name for name, _ in trained if name not in keys), None)
            if missing:
                return f"{file.name} lacks the trained weight {missing}"
            for name, param in trained[:1]:
                if not torch.equal(f.get_tensor(name).to(param.device, param.dtype), param.detach()):
                    return f"the trained weight {name} did not load"
    return None


def disk_full(exc: BaseException, folder: Path) -> bool:
    """Whether a failed save ran out of space: torch says only "file write failed", so the folder's free space
    decides where the error does not carry ENOSPC itself."""
    from sdpipe.errors import disk_full as says_disk_full

    if says_disk_full(exc):
        return True
    return "write failed" in str(exc) and shutil.disk_usage(folder).free < 256 << 20


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
