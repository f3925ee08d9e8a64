"""Hash and decode raw files for prepare, in a process pool for large folders, with a content-addressed cache.

Decode results (size, format, or the rejection reason) are cached under cache_dir/prepare, keyed by the content
id and the validation parameters. A rerun still reads and hashes every file but decodes only bytes it has not
seen. (prepare's own outputs are no use for this: Snakemake and DVC delete them before rerunning a stage.)
"""

from __future__ import annotations

import logging
from pathlib import Path

from sdpipe import hashing, io
from sdpipe.log import progress

POOL_MIN_FILES = 64  # below this, starting worker processes costs more than decoding in this one
CACHE_VERSION = 2  # bump when decoding changes what it reports, so old entries are not reused (2: checksums)

_WORKER_STATE: dict = {}
log = logging.getLogger(__name__)


def _cache_file(cache_root: str, image_id: str, params: dict) -> Path:
    key = hashing.key_of("prepare", CACHE_VERSION, image_id, params)
    return Path(cache_root) / key[:2] / f"{key}.json"


def inspect_file(path: str, params: dict, cache_root: str) -> dict:
    """Hash the file and decode it unless the cache knows these bytes: {"id", "reason"} | {"id", decoded keys}.

    "reused" is True when the result came from the cache. Rejections are cached too (a bomb is not decoded twice);
    read errors are not, since they say nothing about the bytes.
    """
    try:
        data = Path(path).read_bytes()
    except OSError as exc:
        return {"id": None, "reason": f"cannot read: {exc.strerror or exc}"}
    image_id = hashing.sha256_bytes(data)
    cached = _cache_file(cache_root, image_id, params)
    result = _read_entry(cached)
    if result is not None:
        return {**result, "id": image_id, "reused": True}
    result = _decode(data, params)
    io.write_json(cached, {"result": result, "sha256": hashing.key_of(result)})
    return {**result, "id": image_id, "reused": False}


def _read_entry(path: Path) -> dict | None:
    """A cache entry's result, or None when there is none or it is damaged (unreadable, or not what its checksum
    says: then it is decoded again and rewritten)."""
    if not path.is_file():
        return None
    try:
        entry = io.read_json(path)
        if hashing.key_of(entry["result"]) == entry["sha256"]:
            return entry["result"]
    except (OSError, ValueError, KeyError, TypeError):
        pass
    log.warning("prepare cache entry %s is damaged; decoding its image again", path)
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


def _init_worker(params: dict, cache_root: str) -> None:
    _WORKER_STATE.update(params=params, cache_root=cache_root)


def _inspect_in_worker(path: str) -> dict:
    return inspect_file(path, _WORKER_STATE["params"], _WORKER_STATE["cache_root"])


def inspect_all(raw: Path, rels: list[str], params: dict, cache_root: str, workers: int) -> list[dict]:
    """inspect_file for every path, in order; in a process pool when there are enough files to pay for one."""
    paths = [str(raw / rel) for rel in rels]
    workers = min(workers, len(paths))
    with progress(len(paths), "prepare: hashing and decoding") as advance:
        if workers <= 1 or len(paths) < POOL_MIN_FILES:
            results = []
            for path in paths:
                results.append(inspect_file(path, params, cache_root))
                advance(1)
            return results
        return _inspect_pooled(paths, params, cache_root, workers, advance)


def _inspect_pooled(paths: list[str], params: dict, cache_root: str, workers: int, advance) -> list[dict]:
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    # spawn, not fork: the parent may hold threads (torch, a rich progress bar) and forking those can deadlock.
    # The price is the usual spawn rule: a script that calls run() must guard its entry with __name__ == "__main__".
    context = multiprocessing.get_context("spawn")
    chunk = max(1, min(64, len(paths) // (workers * 8)))
    results = []
    with ProcessPoolExecutor(
        workers, mp_context=context, initializer=_init_worker, initargs=(params, cache_root)
    ) as pool:
        for result in pool.map(_inspect_in_worker, paths, chunksize=chunk):
            results.append(result)
            advance(1)
    return results
