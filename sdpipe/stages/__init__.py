"""Pipeline stages: each module defines INPUTS, OUTPUTS and run(cfg, inputs, outputs), called by `sdpipe <stage>`."""

from pathlib import Path

from sdpipe import io
from sdpipe.errors import UserError


def read_upstream(path: str | Path, made_by: str) -> list[dict]:
    """Rows of an earlier stage's JSONL output, or one line saying which target makes it."""
    if not Path(path).is_file():
        raise UserError(f"{path} not found; run `snakemake {made_by}` (or `sdpipe {made_by}`) first")
    return io.read_jsonl(path)
