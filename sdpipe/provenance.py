"""Where a number came from: the code's commit, the package versions, the GPU."""

from __future__ import annotations

PACKAGES = ("sdpipe", "torch", "diffusers", "transformers", "accelerate", "peft", "open-clip-torch", "torch-fidelity",
            "snakemake", "dvc")


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
        dirty = bool(subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], capture_output=True,
                                    text=True, timeout=10).stdout.strip())
    except (OSError, subprocess.SubprocessError):
        commit, dirty = "", False
    return commit or "unknown", dirty
