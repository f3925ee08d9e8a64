"""Where a raw image's bytes come from: a plain file, or a member of a container under data.raw_dir, read as if
the container were a folder.

- Tar shards in the webdataset layout: `000001.tar` holding `key.jpg` with its caption `key.txt`, so
  `shards/000001.tar/key.jpg` names a member and `key.txt` is its sidecar.
- Parquet tables of (image, caption) rows, a LAION subset or a Hugging Face datasets export: row 42 of
  `table.parquet` is `table.parquet/000000042.image`, its caption `table.parquet/000000042.txt`
  (sdpipe/tables.py).

Every stage reads through `read_bytes`, and nothing is unpacked: a container is one file for the fingerprint, for
DVC and on disk, and a member is one seek and one read (a tar) or a row of a decoded row group (a table), from an
index of the container built once per process.

Only uncompressed tars are read: a member of a .tar.gz cannot be reached without decompressing all before it.
A tar cut short keeps its complete members, and prepare lists it as rejected with the reason, as it does a
container it cannot read at all.
"""

from __future__ import annotations

import functools
import os
import tarfile
from pathlib import Path

from sdpipe import tables

TAR = ".tar"
SUFFIXES = (TAR, tables.SUFFIX)


class ShardError(Exception):
    """A container that cannot be read (or only in part): the reason, one line."""


def is_container(name: str) -> bool:
    return name.endswith(SUFFIXES)


def split_member(path: str | Path) -> tuple[Path, str] | None:
    """(container, member name) when `path` goes through a container, else None. String work and a cached check
    that the container is a file: prepare asks this of each of 10^6 paths."""
    text = str(path)
    for suffix in SUFFIXES:
        at = text.find(f"{suffix}{os.sep}")
        while at >= 0:
            end = at + len(suffix)
            if _is_file(text[:end]):
                return Path(text[:end]), text[end + 1 :].replace(os.sep, "/")
            at = text.find(f"{suffix}{os.sep}", end)
    return None


@functools.lru_cache(maxsize=4096)
def _is_file(path: str) -> bool:
    return os.path.isfile(path)


def read_bytes(path: str | Path) -> bytes:
    """The bytes of a file, or of a container's member; OSError (FileNotFoundError for a missing member)."""
    inside = split_member(path)
    if inside is None:
        return Path(path).read_bytes()
    container, name = inside
    where = members(container).get(name)
    if where is None:
        raise FileNotFoundError(2, "no such member in its container", str(path))
    if container.name.endswith(tables.SUFFIX):
        return tables.read(container, where)
    with open(container, "rb") as f:
        f.seek(where[0])
        return f.read(where[1])


def stat(path: str | Path) -> list | None:
    """What prepare's memo compares to know a file unchanged: size, mtime, ctime and inode; for a member, its
    container's, with where the member lies in it (a rewritten container changes them all)."""
    inside = split_member(path)
    try:
        st = os.stat(inside[0] if inside else path)
        extra = list(_index(inside[0], st.st_size, st.st_mtime_ns)[0].get(inside[1], ())) if inside else []
    except (OSError, ShardError):
        return None
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, *extra]


def members(container: Path) -> dict[str, tuple]:
    """{member name: where it lies} of the container's members (empty if it cannot be read)."""
    try:
        return _index(container, *_identity(container))[0]
    except ShardError:
        return {}


def problem(container: Path) -> str | None:
    """Why the container cannot be read whole, or None."""
    try:
        return _index(container, *_identity(container))[1]
    except ShardError as exc:
        return str(exc)


def _identity(container: Path) -> tuple[int, int]:
    st = os.stat(container)
    return st.st_size, st.st_mtime_ns


# (container, size, mtime_ns) -> (members, problem), for the life of the process: prepare walks every shard three
# times (listing, stats, sidecars), and a bounded cache smaller than the shard count re-parsed each one every time.
# prepare keeps them across runs too (prepare/memo.py).
# A container that cannot be read at all is remembered as its ShardError, for this process only.
_INDEXES: dict[tuple[str, int, int], tuple[dict[str, tuple], str | None] | ShardError] = {}


def _index(container: Path, size: int, mtime_ns: int) -> tuple[dict[str, tuple], str | None]:
    key = (str(container), size, mtime_ns)
    found = _INDEXES.get(key)
    if found is None:
        try:
            found = _INDEXES[key] = _read_index(container, size)
        except ShardError as exc:
            _INDEXES[key] = exc
            raise
    if isinstance(found, ShardError):
        raise found
    return found


def parsed_indexes() -> dict[tuple[str, int, int], tuple[dict[str, tuple], str | None]]:
    """Every readable container's index this process holds, by (path, size, mtime_ns)."""
    return {key: found for key, found in _INDEXES.items() if not isinstance(found, ShardError)}


def remember_index(path: str, size: int, mtime_ns: int, members: dict[str, tuple], problem: str | None) -> None:
    """Give the index of a container read before (by a memo that checked its size and mtime)."""
    _INDEXES[(path, size, mtime_ns)] = (members, problem)


def _read_index(container: Path, size: int) -> tuple[dict[str, tuple], str | None]:
    if container.name.endswith(tables.SUFFIX):
        try:
            return tables.index(container), None
        except tables.TableError as exc:
            raise ShardError(str(exc)) from None
    return _tar_index(container, size)


def _tar_index(shard: Path, size: int) -> tuple[dict[str, tuple], str | None]:
    """The shard's members, read from its headers (a seek per member), and why it stopped early, if it did."""
    found: dict[str, tuple] = {}
    short = None
    try:
        with tarfile.open(shard, "r:") as tf:
            for member in _each(tf):
                if member.isfile() and member.offset_data + member.size > size:
                    short = f"member {member.name} is cut short"
                elif member.isfile():
                    found[member.name] = (member.offset_data, member.size)
            short = short or _unended(shard, tf.offset)
    except tarfile.ReadError as exc:
        if not found:
            raise ShardError(f"not a readable uncompressed tar ({exc}); webdataset shards must be plain .tar") from None
        short = str(exc)
    except OSError as exc:
        raise ShardError(f"cannot read: {exc.strerror or exc}") from None
    return found, (f"cut short after {len(found)} complete members ({short}); those are used" if short else None)


def _unended(shard: Path, end: int) -> str | None:
    """Why the archive lacks its end (two zero blocks where its last member ends), or None. tarfile stops without
    a word at a header cut in half."""
    with open(shard, "rb") as f:
        f.seek(end)
        marker = f.read(2 * tarfile.BLOCKSIZE)
    return None if len(marker) == 2 * tarfile.BLOCKSIZE and not any(marker) else f"no end of archive at byte {end}"


def _each(tf: tarfile.TarFile):
    while (member := tf.next()) is not None:
        yield member
