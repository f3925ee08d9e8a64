"""Pipeline stages: each module defines INPUTS, OUTPUTS and run(cfg, inputs, outputs), called by `sdpipe <stage>`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from sdpipe.errors import UserError

if TYPE_CHECKING:
    from sdpipe.config import Config


def read_upstream(path: str | Path, made_by: str, keep: Callable[[dict], Any] | None = None) -> list:
    """Rows of an earlier stage's JSONL output, or one line saying which target makes it (or remakes it, when its
    rows are of another layout version than this sdpipe's: sdpipe/records.py). `keep` maps each row as it is read
    to what the caller holds (a few of its fields, or None to drop it): 10^6 whole rows need not sit in memory."""
    import json

    from sdpipe.records import ROW_VERSIONS

    if not Path(path).is_file():
        raise UserError(f"{path} not found; run `snakemake {made_by}` (or `sdpipe {made_by}`) first")
    want = ROW_VERSIONS.get(made_by)
    rows = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            if want is not None and row.get("version") != want:
                raise UserError(
                    f"{path} holds records of layout version {row.get('version')}, and this sdpipe reads version "
                    f"{want}: an older sdpipe wrote it; rerun the stage with `snakemake --forcerun {made_by}`"
                )
            kept = keep(row) if keep else row
            if kept is not None:
                rows.append(kept)
    return rows


def image_files(cfg: Config) -> Callable[[dict], str]:
    """row -> where a manifest row's image is. An instance image is under data.raw_dir as this job sees it: a
    storage provider (S3 on Kubernetes) hands each job its own local copy of the raw folder, so the path prepare saw
    may not exist here. A class image lives outside raw_dir, at its own path. The folder is looked up once, for
    10^6 rows."""
    raw = str(Path(cfg.data.raw_dir))

    def file_of(row: dict) -> str:
        if row.get("role", "instance") == "instance" and row.get("path"):
            return os.path.join(raw, row["path"])
        return row["file"]

    return file_of


def image_file(cfg: Config, row: dict) -> str:
    return image_files(cfg)(row)
