"""Copy the workflow into a temporary project and run Snakemake or DVC there, the way a user would."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parent.parent
WORKFLOW_FILES = ["Snakefile", "workflow", "config", "profiles", "runpod", "dvc.yaml", ".dvcignore"]
# The demo config on a CPU-test schedule: every stage runs, each only a few steps.
FAST = {
    "model": {"train_vae": {"enabled": True, "steps": 4, "batch_size": 8}},
    "train": {
        "max_steps": 4,
        "per_device_batch_size": 4,
        "checkpoint_every": 2,
        "lr_warmup_steps": 0,
        "validation": {"every": 0, "heldout_every": 0},
    },
    "export": {"verify": {"prompt": "a red circle on a white background", "steps": 2}},
    "evaluate": {
        "prompts": ["a red circle on a white background", "a blue square on a white background"],
        "seeds": [0],
        "steps": 2,
        "fid": {"enabled": False},
    },
}  # 40 images leave no eval split

# What shrinks a template's job to the tiny preset and a few CPU steps: a second config file on the command line,
# merged over the project's (the effective-config rule), so the project's own file stays the template's.
TEMPLATE_FAST = {
    "prepare": {"min_size": 32, "eval_fraction": 0.0, "workers": 1, "buckets": {"resolution": 32, "step": 8}},
    "latents": {"dtype": "fp32", "gpus": 0},
    "dreambooth": {"num_class_images": 2, "steps": 2, "batch_size": 2, "gpus": 0},
    "train": {
        "max_steps": 3,
        "epochs": 1,
        "per_device_batch_size": 2,
        "grad_accum_steps": 1,
        "lr_warmup_steps": 0,
        "mixed_precision": "fp32",
        "validation": {"every": 0, "heldout_every": 0},
        "gradient_checkpointing": False,
    },
    "export": {"verify": {"steps": 2}},
    "evaluate": {"steps": 2, "seeds": [0], "batch_size": 2, "fid": {"enabled": False}},
}


def make_project(dest: Path, raw_source: Path | None, with_code: bool = False, **config_changes) -> Path:
    dest.mkdir(parents=True, exist_ok=True)
    for name in WORKFLOW_FILES + (["sdpipe"] if with_code else []):
        src = REPO / name
        if src.is_symlink():
            (dest / name).symlink_to(src.readlink())
        elif src.is_dir():
            shutil.copytree(src, dest / name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(src, dest / name)
    if raw_source is not None:
        shutil.copytree(raw_source, dest / "data" / "raw")
    cfg_path = dest / "config" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    for section, values in {**FAST, **config_changes}.items():
        cfg[section].update(values) if isinstance(values, dict) else cfg.__setitem__(section, values)
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))
    return dest


def run(cmd: list[str], cwd: Path, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True, env=env)
    if check and proc.returncode != 0:
        raise AssertionError(
            f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
        )
    return proc
