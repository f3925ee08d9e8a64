"""Pipeline stages: each module defines INPUTS, OUTPUTS and run(cfg, inputs, outputs), called by `sdpipe <stage>`."""

from pathlib import Path

from sdpipe import io
from sdpipe.errors import UserError


def read_upstream(path: str | Path, made_by: str) -> list[dict]:
    """Rows of an earlier stage's JSONL output, or one line saying which target makes it."""
    if not Path(path).is_file():
        raise UserError(f"{path} not found; run `snakemake {made_by}` (or `sdpipe {made_by}`) first")
    return io.read_jsonl(path)


def image_file(cfg, row: dict) -> str:
    """Where a manifest row's image is: its own path (class images live outside data.raw_dir), else under raw_dir
    (manifests written before rows carried a file)."""
    return row.get("file") or str(Path(cfg.data.raw_dir) / row["path"])
