"""What a prepare rerun need not read again (issue 30), kept in cache_dir/prepare.sqlite beside the decode cache:

- each container's member index (a tar shard's headers, a parquet table's rows), under the container's size and
  mtime: parsing a 2,000-member shard's headers takes 0.1 s, so 500 shards took a minute of every rerun;
- each sidecar caption's text, under the stat of its file (or of its member and shard), as prepare's file ids are
  memoised: a rerun opens only the sidecars that changed.

A memo entry is only ever used when the stat it was saved under is the file's stat now, so a stale entry is
harmless; a container or sidecar that is gone leaves an entry nobody asks for.
"""

from __future__ import annotations

from pathlib import Path

from sdpipe import sources
from sdpipe.prepare import decode
from sdpipe.prepare.files import read_sidecar

CONTAINERS, SIDECARS = "containers", "sidecars"


def seed_containers(cache_dir: str) -> set[tuple[str, int, int]]:
    """Hand sources the indexes saved for containers whose size and mtime are unchanged; their keys."""
    seeded = set()
    for path, (size, mtime_ns, members, problem) in decode.store_in(cache_dir).items(CONTAINERS).items():
        try:
            st = Path(path).stat()
        except OSError:
            continue
        if (st.st_size, st.st_mtime_ns) == (size, mtime_ns):
            sources.remember_index(path, size, mtime_ns, {m[0]: tuple(m[1:]) for m in members}, problem)
            seeded.add((path, size, mtime_ns))
    return seeded


def save_containers(cache_dir: str, seeded: set[tuple[str, int, int]]) -> None:
    """Save the indexes this run parsed (those it was not handed)."""
    new = [
        (path, [size, mtime_ns, [[name, *where] for name, where in members.items()], problem])
        for (path, size, mtime_ns), (members, problem) in sources.parsed_indexes().items()
        if (path, size, mtime_ns) not in seeded
    ]
    decode.store_in(cache_dir).put_many(CONTAINERS, new)


def read_sidecars(paths: list[str], cache_dir: str) -> dict[str, tuple[str | None, str | None]]:
    """read_sidecar of each path, from the memo where the file's stat is the one its text was read under."""
    store = decode.store_in(cache_dir)
    memo = store.get_many(SIDECARS, paths)
    out, new = {}, []
    for path in paths:
        stat = sources.stat(path)  # before reading: a file that changes meanwhile is read again next time
        saved = memo.get(path)
        if stat is not None and saved and saved[0] == stat:
            out[path] = (saved[1], saved[2])
            continue
        out[path] = read_sidecar(Path(path))
        if stat is not None:
            new.append((path, [stat, *out[path]]))
    store.put_many(SIDECARS, new)
    return out
