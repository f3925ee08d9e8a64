"""Where a number came from: the code's commit, the package versions, the GPU."""

from __future__ import annotations

PACKAGES = (
    "sdpipe",
    "torch",
    "diffusers",
    "transformers",
    "accelerate",
    "peft",
    "open-clip-torch",
    "torch-fidelity",
    "snakemake",
    "dvc",
)


def package_versions(names=PACKAGES) -> dict[str, str | None]:
    import importlib.metadata as md

    def version(name: str) -> str | None:
        try:
            return md.version(name)
        except md.PackageNotFoundError:
            return None

    return {n: version(n) for n in names}


def git_state() -> tuple[str, bool]:
    """(commit or "unknown", whether tracked files differ from it)."""
    import subprocess

    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10).stdout.strip()
        dirty = bool(
            subprocess.run(
                ["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True, text=True, timeout=10
            ).stdout.strip()
        )
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return commit or "unknown", dirty


def gpu_facts() -> dict:
    """GPU model, count and driver (for provenance); nulls on a CPU-only machine."""
    import subprocess

    import torch

    count = torch.cuda.device_count()
    driver = None
    if count:
        try:
            out = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True,
                text=True,
                timeout=30,
            ).stdout.split()
            driver = out[0] if out else None
        except (OSError, subprocess.SubprocessError):
            driver = None
    return {
        "name": torch.cuda.get_device_name(0) if count else None,
        "count": count,
        "driver": driver,
        "cuda": torch.version.cuda,
    }
