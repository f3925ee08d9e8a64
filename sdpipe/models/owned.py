"""Which model folders sdpipe built (issue 26): a random-init preset is written only where sdpipe wrote one before,
never over a folder a user put there, since Snakemake removes a rule's output folder before it reruns the rule."""

from __future__ import annotations

from pathlib import Path

from sdpipe import io

MARKER = "sdpipe_preset.json"


def mark(folder: Path, preset: str, seed: int) -> None:
    """Record in `folder` that sdpipe built it, from which preset and seed."""
    io.write_json(Path(folder) / MARKER, {"preset": preset, "seed": seed})


def foreign(folder: Path) -> bool:
    """True when `folder` holds files but no sdpipe marker: someone else's model, which a rebuild would delete."""
    folder = Path(folder)
    if not folder.exists():
        return False
    return not (folder / MARKER).is_file() and (not folder.is_dir() or any(folder.iterdir()))
