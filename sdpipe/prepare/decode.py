"""Hash and decode raw files for prepare, in a process pool for large folders, with a content-addressed cache.

Decode results (size, format, or the rejection reason) are cached in cache_dir/prepare.sqlite, keyed by the content
id and the validation parameters, so bytes already seen are never decoded again. The same file memoises each
file's content id under its path, size, mtime, ctime and inode, as git's index and DVC's state do: a rerun reads
and hashes only the files whose stat changed, not every byte of a 10^6-image folder (issue 30). (prepare's own
outputs are no use for this: Snakemake and DVC delete them before rerunning a stage.)
"""

from __future__ import annotations

import functools
import logging
import time
from pathlib import Path

from sdpipe import hashing, sources
from sdpipe.kvstore import KVStore
from sdpipe.log import progress

POOL_MIN_FILES = 64  # below this, starting worker processes costs more than decoding in this one
CACHE_VERSION = 2  # bump when decoding changes what it reports, so old entries are not reused (2: checksums)
CACHE_FILE = "prepare.sqlite"  # under cache_dir
WRITE_EVERY_S = 2.0  # results are committed at least this often, so a crash loses seconds of work

_WORKER_STATE: dict = {}
log = logging.getLogger(__name__)


DECODED, FILE_IDS = "decoded", "file_ids"  # decode results by key; [stat, content id] by path


@functools.cache
def _store(db: str) -> KVStore:
    """The cache file's store: one connection per process, kept open."""
    # containers and sidecars: prepare/memo.py; mirrored: sdpipe/raw_remote.py
    return KVStore(db, (DECODED, FILE_IDS, "containers", "sidecars", "mirrored"))


def store_in(cache_dir: str) -> KVStore:
    """The prepare cache file of a cache_dir (its memos: prepare/memo.py, sdpipe/raw_remote.py)."""
    return _store(str(Path(cache_dir) / CACHE_FILE))


def decode_key(image_id: str, params: dict) -> str:
    return hashing.key_of("prepare", CACHE_VERSION, image_id, params)


def stat_of(path: str) -> list[int] | None:
    return sources.stat(path)


def inspect_file(path: str, params: dict, db: str) -> dict:
    """Hash the file and decode it unless the cache knows these bytes: {"id", "reason"} | {"id", decoded keys}, with
    "stat" (taken before reading) and "entry" (a new cache entry to write, or None).

    "reused" is True when the result came from the cache. Rejections are cached too (a bomb is not decoded twice);
    read errors are not, since they say nothing about the bytes.
    """
    stat = stat_of(path)
    try:
        data = sources.read_bytes(path)
    except OSError as exc:
        return {"id": None, "reason": f"cannot read: {exc.strerror or exc}", "stat": None, "entry": None}
    image_id = hashing.sha256_bytes(data)
    result = _read_entry(_store(db).get(DECODED, decode_key(image_id, params)), image_id)
    if result is not None:
        return {**result, "id": image_id, "reused": True, "stat": stat, "entry": None}
    result = _decode(data, params)
    entry = {"result": result, "sha256": hashing.key_of(result)}
    return {**result, "id": image_id, "reused": False, "stat": stat, "entry": entry}


def _read_entry(entry: dict | None, image_id: str) -> dict | None:
    """A cache entry's result, or None when there is none or it is damaged (not what its checksum says: then the
    image is decoded again and the entry rewritten)."""
    if entry is None:
        return None
    try:
        if hashing.key_of(entry["result"]) == entry["sha256"]:
            return entry["result"]
    except (KeyError, TypeError):
        pass
    log.warning("prepare cache entry for %s is damaged; decoding its image again", image_id)
    return None


def _decode(data: bytes, params: dict) -> dict:
    from sdpipe import images

    try:
        rgb = images.load_rgb(
            data,
            background=tuple(params["alpha_background"]),
            max_pixels=params["max_pixels"],
            min_size=params["min_size"],
        )
        fmt, mode = _format_and_mode(data)
    except images.ImageRejected as exc:
        return {"reason": str(exc)}
    except Exception as exc:  # noqa: BLE001 - one hostile file must not stop a run over thousands
        first = str(exc).splitlines()[0] if str(exc) else ""
        return {"reason": f"cannot decode: {type(exc).__name__} {first}".strip()}
    return {"width": rgb.width, "height": rgb.height, "format": fmt, "mode": mode}


def _format_and_mode(data: bytes) -> tuple[str, str]:
    """The container format and the mode before RGB conversion, from the header (cheap: no pixel decode)."""
    import io as bytes_io

    from PIL import Image

    with Image.open(bytes_io.BytesIO(data)) as img:
        return img.format or "unknown", img.mode


def _init_worker(params: dict, db: str) -> None:
    _WORKER_STATE.update(params=params, db=db)


def _inspect_in_worker(path: str) -> dict:
    return inspect_file(path, _WORKER_STATE["params"], _WORKER_STATE["db"])


def inspect_all(raw: Path, rels: list[str], params: dict, cache_dir: str, workers: int) -> list[dict]:
    """inspect_file's result for every path, in order. Files whose stat matches the memo, with their decode result
    cached, are answered from the cache without a read; the rest are read and hashed, in a process pool when there
    are enough of them to pay for one."""
    db = str(Path(cache_dir) / CACHE_FILE)
    from sdpipe.prepare.files import under

    path_of = under(raw)
    paths = [path_of(rel) for rel in rels]
    results = _from_memo(paths, params, db)
    todo = [i for i, r in enumerate(results) if r is None]
    if len(todo) < len(paths):
        log.info("prepare: %d of %d files unchanged since they were hashed", len(paths) - len(todo), len(paths))
    writer = _Writer(db)
    with progress(len(todo), "prepare: hashing and decoding") as advance:
        for i, result in zip(todo, _inspect_many([paths[i] for i in todo], params, db, workers)):
            results[i] = result
            writer.add(paths[i], result, params)
            advance(1)
    writer.flush()
    return results


def _from_memo(paths: list[str], params: dict, db: str) -> list[dict | None]:
    """The result of each file whose stat is what it was when last hashed and whose decode result is cached."""
    stats = [stat_of(p) for p in paths]
    memo = _store(db).get_many(FILE_IDS, (p for p, st in zip(paths, stats) if st))
    ids = [_unchanged_id(memo.get(p), st) for p, st in zip(paths, stats)]
    keys = {i: decode_key(i, params) for i in ids if i}
    cached = _store(db).get_many(DECODED, keys.values())
    out: list[dict | None] = []
    for image_id in ids:
        entry = cached.get(keys[image_id]) if image_id else None
        result = _read_entry(entry, image_id) if entry is not None else None
        out.append(None if result is None else {**result, "id": image_id, "reused": True})
    return out


def _unchanged_id(memo: list | None, stat: list[int] | None) -> str | None:
    """The content id the memo holds, if the file's stat is what it was when it was hashed."""
    return memo[1] if stat and memo and memo[0] == stat else None


class _Writer:
    """Commits new decode results and file stats in batches: at least every WRITE_EVERY_S seconds."""

    def __init__(self, db: str):
        self.store = _store(db)
        self.entries: list = []
        self.ids: list = []
        self.last = time.monotonic()

    def add(self, path: str, result: dict, params: dict) -> None:
        entry, stat = result.pop("entry", None), result.pop("stat", None)
        if entry is not None:
            self.entries.append((decode_key(result["id"], params), entry))
        if stat is not None and result["id"]:
            self.ids.append((path, [stat, result["id"]]))
        if time.monotonic() - self.last > WRITE_EVERY_S:
            self.flush()

    def flush(self) -> None:
        # Decode results first: a file's memo never names an id whose result is missing.
        self.store.put_many(DECODED, self.entries)
        self.store.put_many(FILE_IDS, self.ids)
        self.entries, self.ids, self.last = [], [], time.monotonic()


def _inspect_many(paths: list[str], params: dict, db: str, workers: int):
    workers = min(workers, len(paths))
    if workers <= 1 or len(paths) < POOL_MIN_FILES:
        return (inspect_file(path, params, db) for path in paths)
    return _inspect_pooled(paths, params, db, workers)


def _inspect_pooled(paths: list[str], params: dict, db: str, workers: int):
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may hold threads (torch, a rich progress bar) and forking those can deadlock.
    # The price is the usual spawn rule: a script that calls run() must guard its entry with __name__ == "__main__".
    context = multiprocessing.get_context("spawn")
    chunk = max(1, min(64, len(paths) // (workers * 8)))
    with ProcessPoolExecutor(workers, mp_context=context, initializer=_init_worker, initargs=(params, db)) as pool:
        yield from pool.map(_inspect_in_worker, paths, chunksize=chunk)
