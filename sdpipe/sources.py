"""Where a raw image's bytes come from: a plain file, or a member of a tar shard under data.raw_dir.

Large datasets travel as tar shards in the webdataset layout: `000001.tar` holding `key.jpg` with its caption
`key.txt`. sdpipe reads a shard as if it were a folder, so `shards/000001.tar/key.jpg` names a member, its
caption pairs with it as a sidecar does with a file, and every stage reads it through `read_bytes`. Nothing is
unpacked: one shard is one file for the fingerprint and the disk, and a member is one seek and one read, from an
index of the shard's members built once per process.

Only uncompressed tars are read: a member of a .tar.gz cannot be reached without decompressing all before it.
A shard cut short keeps its complete members, and prepare lists it as rejected with the reason.
"""

from __future__ import annotations

import functools
import os
import tarfile
from pathlib import Path

SHARD_SUFFIX = ".tar"


class ShardError(Exception):
    """A tar shard that cannot be read (or only in part): the reason, one line."""


def split_member(path: str | Path) -> tuple[Path, str] | None:
    """(shard, member name) when `path` goes through a tar shard, else None."""
    if f"{SHARD_SUFFIX}{os.sep}" not in str(path):
        return None  # the common case, without building a Path (prepare asks this of 10^6 files)
    parts = Path(path).parts
    for i, part in enumerate(parts[:-1]):
        if part.endswith(SHARD_SUFFIX):
            shard = Path(*parts[: i + 1])
            if shard.is_file():
                return shard, "/".join(parts[i + 1 :])
    return None


def read_bytes(path: str | Path) -> bytes:
    """The bytes of a file, or of a tar shard's member; OSError (FileNotFoundError for a missing member)."""
    inside = split_member(path)
    if inside is None:
        return Path(path).read_bytes()
    shard, name = inside
    offset, size = members(shard).get(name, (None, 0))
    if offset is None:
        raise FileNotFoundError(2, "no such member in its tar shard", str(path))
    with open(shard, "rb") as f:
        f.seek(offset)
        return f.read(size)


def stat(path: str | Path) -> list[int] | None:
    """What prepare's memo compares to know a file unchanged: size, mtime, ctime and inode; for a member, its
    shard's, with the member's offset (a rewritten shard changes them all)."""
    inside = split_member(path)
    try:
        st = os.stat(inside[0] if inside else path)
    except OSError:
        return None
    extra = [members(inside[0]).get(inside[1], (-1, 0))[0]] if inside else []
    return [st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, *extra]


def members(shard: Path) -> dict[str, tuple[int, int]]:
    """{member name: (data offset, size)} of the shard's regular files (empty if it cannot be read)."""
    try:
        return _index(shard, *_identity(shard))[0]
    except ShardError:
        return {}


def problem(shard: Path) -> str | None:
    """Why the shard cannot be read whole, or None."""
    try:
        return _index(shard, *_identity(shard))[1]
    except ShardError as exc:
        return str(exc)


def _identity(shard: Path) -> tuple[int, int]:
    st = os.stat(shard)
    return st.st_size, st.st_mtime_ns


@functools.lru_cache(maxsize=64)
def _index(shard: Path, size: int, mtime_ns: int) -> tuple[dict[str, tuple[int, int]], str | None]:
    """The shard's members, read from its headers (a seek per member), and why it stopped early, if it did."""
    found: dict[str, tuple[int, int]] = {}
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
