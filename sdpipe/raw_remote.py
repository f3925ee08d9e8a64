"""data.raw_remote: the raw images under an S3 prefix (issue 30), mirrored into data.raw_dir before prepare reads it.

Large datasets live in object storage: a bucket of tar shards from img2dataset, or of loose images and captions.
prepare mirrors the prefix into data.raw_dir, as `aws s3 sync` would: it lists the prefix and downloads only the
objects whose size and ETag differ from what it downloaded last time (remembered in cache_dir/prepare.sqlite), so
adding k images to 10^6 downloads k files. An object gone from the prefix is removed from the mirror, but only a
file the mirror itself wrote: nothing else in data.raw_dir is touched. Everything after that is prepare as usual,
with its bad-input handling, on a local folder that every later stage reads.

Snakemake decides whether prepare must run from the prefix's listing (fingerprint()), so a changed object
reruns it. The endpoint and keys come from the environment, as for the aws CLI (sdpipe/remote_store.py).
"""

from __future__ import annotations

import hashlib
import logging
import os
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from sdpipe.errors import UserError

log = logging.getLogger(__name__)
KEY = "data.raw_remote"
MIRRORED = "mirrored"  # prepare.sqlite table: path under raw_dir -> [size, etag] as downloaded
THREADS = 16  # downloads at once: object stores answer each request slowly and many in parallel
COMMIT_EVERY = 1000  # downloads remembered per transaction


def listing(url: str) -> list[tuple[str, int, str]]:
    """(path under the prefix, size, ETag) of every object, sorted; hidden names and folder markers skipped, as
    prepare's scan skips hidden files."""
    from botocore.exceptions import BotoCoreError, ClientError

    from sdpipe import remote_store

    bucket, prefix = remote_store.split(url, KEY)
    found = []
    try:
        pages = remote_store.client().get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for page in pages:
            for obj in page.get("Contents", []):
                rel = obj["Key"][len(prefix) :]
                if rel and not rel.endswith("/") and not any(part.startswith(".") for part in rel.split("/")):
                    found.append((rel, obj["Size"], obj["ETag"].strip('"')))
    except (BotoCoreError, ClientError) as exc:
        raise UserError(f"{KEY}: cannot list {url}: {exc}") from None
    return sorted(found)


def fingerprint(url: str) -> str:
    """A digest of the prefix's listing: an object added, removed or rewritten changes it (no content is read)."""
    digest = hashlib.blake2b(digest_size=16)
    for rel, size, etag in listing(url):
        digest.update(f"{rel}\0{size}\0{etag}\n".encode())
    return f"s3:{digest.hexdigest()}"


def mirror(url: str, raw: Path, cache_dir: str) -> dict:
    """Bring raw up to date with the prefix; {"objects", "downloaded", "removed"}."""
    from sdpipe.log import progress
    from sdpipe.prepare import decode

    store = decode.store_in(cache_dir)
    objects = listing(url)
    had = store.get_many(MIRRORED, (rel for rel, _, _ in objects))
    todo = [(rel, size, etag) for rel, size, etag in objects if not _current(raw / rel, had.get(rel), size, etag)]
    raw.mkdir(parents=True, exist_ok=True)
    done: list[tuple[str, list]] = []
    with progress(len(todo), f"prepare: downloading {url}") as advance, ThreadPoolExecutor(THREADS) as pool:
        for rel, size, etag in pool.map(lambda obj: _download(url, raw, *obj), todo):
            done.append((rel, [size, etag]))
            if len(done) >= COMMIT_EVERY:  # a crash keeps what was committed: those are not downloaded again
                store.put_many(MIRRORED, done)
                done = []
            advance(1)
    store.put_many(MIRRORED, done)
    removed = _remove_gone(store, raw, {rel for rel, _, _ in objects})
    log.info("prepare: %s: %d objects, %d downloaded, %d removed", url, len(objects), len(todo), removed)
    return {"objects": len(objects), "downloaded": len(todo), "removed": removed}


def _current(path: Path, had: list | None, size: int, etag: str) -> bool:
    """Whether the mirror's copy is the object as listed (downloaded under this size and ETag, still there)."""
    try:
        return had == [size, etag] and path.stat().st_size == size
    except OSError:
        return False


def _download(url: str, raw: Path, rel: str, size: int, etag: str) -> tuple[str, int, str]:
    """One object to raw/rel, under a temporary hidden name first (scan skips it), so a reader never sees half."""
    from botocore.exceptions import BotoCoreError, ClientError

    from sdpipe import remote_store

    bucket, prefix = remote_store.split(url, KEY)
    path = raw / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.part")
    try:
        remote_store.client().download_file(bucket, prefix + rel, str(tmp))
        os.replace(tmp, path)
    except (BotoCoreError, ClientError, OSError) as exc:
        tmp.unlink(missing_ok=True)
        raise UserError(f"{KEY}: cannot download {url.rstrip('/')}/{rel}: {exc}") from None
    return rel, size, etag


def _remove_gone(store, raw: Path, present: set[str]) -> int:
    """Delete the mirror's own copies of objects no longer under the prefix; how many."""
    gone = [rel for rel in store.keys(MIRRORED) if rel not in present]
    for rel in gone:
        (raw / rel).unlink(missing_ok=True)
    store.delete_many(MIRRORED, gone)
    return len(gone)
