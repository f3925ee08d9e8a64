"""Atomic file writes: a reader sees the old file or the whole new one, never half of it."""

from __future__ import annotations

import contextlib
import glob
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Iterable, Iterator

# One encoder for every row: json.dumps with options builds a new one per call.
_sorted_json = json.JSONEncoder(sort_keys=True).encode
# mkstemp makes 0600 files; give ours the permissions an ordinary open() would (read once: umask is process-wide).
_UMASK = os.umask(0)
os.umask(_UMASK)


@contextlib.contextmanager
def atomic_path(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path in the target's folder; on success fsync it and rename it over `path`."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, name = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(name)
    try:
        yield tmp
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o666 & ~_UMASK)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def write_bytes(path: str | Path, data: bytes) -> None:
    with atomic_path(path) as tmp:
        tmp.write_bytes(data)


def write_text(path: str | Path, text: str) -> None:
    write_bytes(path, text.encode("utf-8"))


def write_json(path: str | Path, obj: Any, indent: int | None = 2) -> None:
    write_text(path, json.dumps(obj, indent=indent, sort_keys=True) + "\n")


def read_json(path: str | Path) -> Any:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


def write_jsonl(path: str | Path, rows: Iterable[dict]) -> None:
    """One row a line, written as it goes: 10^6 rows never sit in memory as one string."""
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.writelines(_sorted_json(row) + "\n" for row in rows)


def write_json_streamed(path: str | Path, obj: dict, lists: dict[str, Iterable]) -> None:
    """`obj` with the long lists in `lists` (key -> rows) added, as compact JSON (json.dumps(sort_keys=True,
    indent=None) gives the same text), written a row at a time: the rows may come from a generator, and the whole
    text is never one string in memory."""
    keys = sorted(set(obj) | set(lists))
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write("{")
        for n, key in enumerate(keys):
            f.write(("" if n == 0 else ", ") + json.dumps(key) + ": ")
            if key not in lists:
                f.write(_sorted_json(obj[key]))
                continue
            f.write("[")
            for i, row in enumerate(lists[key]):
                f.write(("" if i == 0 else ", ") + _sorted_json(row))
            f.write("]")
        f.write("}\n")


def read_jsonl(path: str | Path) -> list[dict]:
    with open(path, encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def write_yaml(path: str | Path, obj: Any) -> None:
    import yaml

    write_text(path, yaml.safe_dump(obj, sort_keys=False))


def read_yaml(path: str | Path) -> Any:
    import yaml

    with open(path, encoding="utf-8") as f:
        return yaml.safe_load(f)


def _sweep_dead_writers(path: Path) -> None:
    """Remove the temporary folders that killed writers of `path` left beside it (their pid is in the name)."""
    import shutil

    for tmp in path.parent.glob(f".{glob.escape(path.name)}.*"):
        pid = tmp.name[len(path.name) + 2 :].split(".", 1)[0]
        if tmp.is_dir() and pid.isdigit() and not _alive(int(pid)):
            shutil.rmtree(tmp, ignore_errors=True)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


@contextlib.contextmanager
def atomic_dir(path: str | Path) -> Iterator[Path]:
    """Yield a temporary folder beside `path`; on success replace `path` with it (old content removed)."""
    import shutil

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    _sweep_dead_writers(path)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.{os.getpid()}.", dir=path.parent))
    try:
        yield tmp
        os.chmod(tmp, 0o777 & ~_UMASK)
        if path.exists():
            shutil.rmtree(path)
        os.replace(tmp, path)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
