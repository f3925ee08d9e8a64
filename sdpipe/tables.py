"""Parquet tables of (image, caption) under data.raw_dir, read as folders of their rows (sdpipe/sources.py).

A LAION subset, a Hugging Face datasets export (`dataset.to_parquet(...)`, or the hub's parquet files) or a
table of one's own: one row per image, the image's encoded bytes in one column, its caption in another. Row r of
`captions.parquet` is the image `captions.parquet/000000042.image` with the sidecar `captions.parquet/000000042.txt`.
Nothing is unpacked; a stage reads a row from its row group, and the last row groups read stay decoded in the
process, so reading the rows in order decodes each group once.

The image column is the first of IMAGE_COLUMNS the table has: binary bytes, or the Hugging Face Image feature's
struct {bytes, path}. The caption column is the first of CAPTION_COLUMNS; a table without one gives no sidecars,
and the caption chain's next captioner captions its images.
"""

from __future__ import annotations

import functools
from pathlib import Path

IMAGE_COLUMNS = ("image", "jpg", "png", "webp", "img", "image_bytes")
CAPTION_COLUMNS = ("caption", "text", "txt", "prompt")
SUFFIX = ".parquet"


class TableError(Exception):
    """A table that cannot be read: the reason, one line."""


def _parquet():
    try:
        import pyarrow.parquet as pq
    except ImportError:
        raise TableError("reading .parquet tables needs pyarrow: pip install 'sdpipe[tables]'") from None
    return pq


def index(table: Path) -> dict[str, tuple[int, int, str]]:
    """{member name: (row group, row in the group, column)}: an image and, with a caption column, a caption per
    row. TableError when the file is not a table of images."""
    pq = _parquet()
    try:
        meta = pq.ParquetFile(table)
    except (OSError, ValueError) as exc:  # pyarrow's ArrowInvalid is a ValueError
        raise TableError(f"not a readable parquet table ({_first_line(exc)})") from None
    names = meta.schema_arrow.names
    image = next((c for c in IMAGE_COLUMNS if c in names), None)
    if image is None:
        raise TableError(f"no image column (one of {', '.join(IMAGE_COLUMNS)}) among its columns {names[:8]}")
    caption = next((c for c in CAPTION_COLUMNS if c in names), None)
    ext = f".{image}" if image in ("jpg", "png", "webp") else ".image"
    found: dict[str, tuple[int, int, str]] = {}
    row = 0
    for group in range(meta.metadata.num_row_groups):
        for i in range(meta.metadata.row_group(group).num_rows):
            found[f"{row:09d}{ext}"] = (group, i, image)
            if caption:
                found[f"{row:09d}.txt"] = (group, i, caption)
            row += 1
    return found


def read(table: Path, where: tuple[int, int, str]) -> bytes:
    """A cell's bytes: the image's, or the caption's as UTF-8. OSError for an empty cell."""
    group, i, column = where
    value = _group(table, _identity(table), group, column)[i].as_py()
    if isinstance(value, dict):  # the Hugging Face Image feature: {"bytes": ..., "path": ...}
        value = value.get("bytes")
    if isinstance(value, str):
        value = value.encode("utf-8")
    if value is None:
        raise OSError(f"row {i} of row group {group} has no {column}")
    return bytes(value)


def _identity(table: Path) -> tuple[int, int]:
    st = table.stat()
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=4)
def _group(table: Path, identity: tuple[int, int], group: int, column: str):
    try:
        return _parquet().ParquetFile(table).read_row_group(group, columns=[column]).column(0)
    except (OSError, ValueError) as exc:
        raise OSError(f"cannot read row group {group} of {table.name}: {_first_line(exc)}") from None


def _first_line(exc: BaseException) -> str:
    lines = str(exc).strip().splitlines()
    return lines[0] if lines else type(exc).__name__
