"""Content hashes: image ids, cache keys and model weight hashes all come from bytes, never from names or mtimes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

CHUNK = 1 << 20


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path, start: int = 0) -> str:
    """The sha256 of a file's bytes from offset `start` on."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        f.seek(start)
        while chunk := f.read(CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


def key_of(*parts: Any) -> str:
    """A cache key from any JSON-serialisable parts; dict order does not matter."""
    text = json.dumps(parts, sort_keys=True, separators=(",", ":"), default=str)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()
