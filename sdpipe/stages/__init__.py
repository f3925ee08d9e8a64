"""Pipeline stages: each module defines INPUTS, OUTPUTS and run(cfg, inputs, outputs), called by `sdpipe <stage>`."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config


def read_upstream(path: str | Path, made_by: str) -> list[dict]:
    """Rows of an earlier stage's JSONL output, or one line saying which target makes it (or remakes it, when its
    rows are of another layout version than this sdpipe's: sdpipe/records.py)."""
    from sdpipe.records import ROW_VERSIONS

    if not Path(path).is_file():
        raise UserError(f"{path} not found; run `snakemake {made_by}` (or `sdpipe {made_by}`) first")
    rows = io.read_jsonl(path)
    want = ROW_VERSIONS.get(made_by)
    found = {row.get("version") for row in rows}
    if want is not None and rows and found != {want}:
        got = ", ".join(sorted(str(v) for v in found))
        raise UserError(
            f"{path} holds records of layout version {got}, and this sdpipe reads version {want}: an older sdpipe "
            f"wrote it; rerun the stage with `snakemake --forcerun {made_by}`"
        )
    return rows


def image_file(cfg: Config, row: dict) -> str:
    """Where a manifest row's image is. An instance image is under data.raw_dir as this job sees it: a storage
    provider (S3 on Kubernetes) hands each job its own local copy of the raw folder, so the path prepare saw may not
    exist here. A class image lives outside raw_dir, at its own path."""
    if row.get("role", "instance") == "instance" and row.get("path"):
        return str(Path(cfg.data.raw_dir) / row["path"])
    return row["file"]
