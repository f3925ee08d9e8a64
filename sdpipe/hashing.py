"""Content hashes: image ids, cache keys and model weight hashes all come from bytes, never from names or mtimes."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any, Callable

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
    return hashlib.sha256(_json(parts).encode("utf-8")).hexdigest()


SLOT = object()  # key_with's placeholder for the part that varies


def key_with(*parts: Any) -> Callable[[Any], str]:
    """key_of with every part fixed but the one given as SLOT: f(v) == key_of(*parts with v for SLOT). The fixed
    parts are serialised once, not once per image: 10^6 keys share them."""
    at = next(i for i, p in enumerate(parts) if p is SLOT)
    head = _json(list(parts[:at]))[:-1] + ("," if at else "")
    tail = _json(list(parts[at + 1 :]))[1:]
    tail = ("," + tail) if tail != "]" else tail
    return lambda value: hashlib.sha256((head + _json(value) + tail).encode("utf-8")).hexdigest()


# One encoder, not one per call: json.dumps with options builds a new one each time, half the cost of a key.
_json = json.JSONEncoder(sort_keys=True, separators=(",", ":"), default=str).encode
