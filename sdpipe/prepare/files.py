"""Reading a raw folder: which files are images and which are their sidecar captions, kohya's repeat folders,
the eval split, and the checks on a file's name against its content. Prepare (stages/prepare.py) builds the
manifest from these; `sdpipe init` and `check-config` count a folder's images with `scan`, as prepare will.
"""

from __future__ import annotations

import codecs
import functools
import os
import re
from pathlib import Path
from typing import Callable

from sdpipe import sources, tables

SAME_FORMAT = {"MPO": "JPEG"}  # camera JPEGs with a preview image open as MPO; .jpg is still right for them


# --- scanning and sidecars ---------------------------------------------------------------------------------------


def scan(
    raw: Path, caption_extensions: list[str], skipped: list[str] | None = None, broken: list[dict] | None = None
) -> tuple[list[str], list[str]]:
    """(image candidates, sidecar captions) as sorted posix paths relative to raw. Hidden names and anything but
    plain files are skipped, and listed in `skipped` when it is given. A tar shard or a parquet table is read as a
    folder of its members (sdpipe/sources.py); one that cannot be read whole goes into `broken` as {"path",
    "reason"}.
    Strings and os.scandir rather than Path objects: this walks 10^6 files on every prepare run."""
    captions = {ext.lower() for ext in caption_extensions}
    images, sidecars, skipped = [], [], [] if skipped is None else skipped
    broken = [] if broken is None else broken
    stack = [""]
    while stack:
        rel_dir = stack.pop()
        with os.scandir(os.path.join(raw, rel_dir) if rel_dir else raw) as found:
            entries = list(found)
        for entry in entries:
            rel = rel_dir + entry.name
            if entry.name.startswith("."):
                skipped.append(rel + "/" if entry.is_dir() else rel)
            elif entry.is_dir(follow_symlinks=False):  # as os.walk: a linked folder is not entered (no loops)
                stack.append(rel + "/")
            elif not entry.is_file():  # FIFOs (a read would block), sockets, broken links, linked folders
                skipped.append(rel)
            else:
                names = _shard_members(Path(entry.path), rel, broken) if sources.is_container(rel) else [rel]
                for one in names:
                    (sidecars if split_name(one)[2].lower() in captions else images).append(one)
    return sorted(images), sorted(sidecars)


def under(raw: Path) -> Callable[[str], str]:
    """rel -> str(raw / rel), without a Path object per call (prepare joins 10^6 paths); rel is a clean posix
    path from scan()."""
    root = str(raw)
    if root == ".":
        return lambda rel: rel
    root = root.rstrip("/") + "/"
    return lambda rel: root + rel


def split_name(rel: str) -> tuple[str, str, str]:
    """(parent, stem, suffix) of a posix path, as PurePosixPath gives them ("." for no parent), without one."""
    parent, _, name = rel.rpartition("/")
    dot = name.rfind(".")
    stem, suffix = (name[:dot], name[dot:]) if 0 < dot < len(name) - 1 else (name, "")
    return parent or ".", stem, suffix


def _shard_members(path: Path, rel: str, broken: list[dict]) -> list[str]:
    """A container's members as paths under raw (hidden ones left out); one read in part goes into `broken`."""
    if why := sources.problem(path):
        broken.append({"path": rel, "reason": why})
    visible = (m for m in sources.members(path) if not any(p.startswith(".") for p in m.split("/")))
    return [f"{rel}/{member}" for member in visible]


def match_sidecars(
    images: list[str], sidecars: list[str], caption_extensions: list[str]
) -> tuple[dict[str, str], dict[str, str]]:
    """Map image -> its sidecar (same folder and stem; the earlier extension in the config wins).

    "a.png.txt" also captions "a.png". Also returns sidecar -> the preferred sidecar it lost to.
    """
    rank = {ext.lower(): i for i, ext in enumerate(caption_extensions)}
    by_key: dict[tuple[str, str], str] = {}
    shadowed = {}
    for rel in sorted(sidecars, key=lambda r: (rank[split_name(r)[2].lower()], r)):
        parent, stem, _ = split_name(rel)
        if (parent, stem) in by_key:
            shadowed[rel] = by_key[(parent, stem)]
        else:
            by_key[(parent, stem)] = rel
    found = {}
    for rel in images:
        parent, stem, suffix = split_name(rel)
        side = by_key.get((parent, stem)) or by_key.get((parent, stem + suffix))
        if side:
            found[rel] = side
    return found, shadowed


def read_sidecar(path: Path) -> tuple[str | None, str | None]:
    """(caption or None when empty, None), or (None, reason) when the file cannot be used."""
    try:
        data = sources.read_bytes(path)
    except OSError as exc:
        return None, f"cannot read: {exc.strerror or exc}"
    bom = len(codecs.BOM_UTF8) if data.startswith(codecs.BOM_UTF8) else 0
    try:
        text = data[bom:].decode("utf-8")
    except UnicodeDecodeError as exc:
        at = bom + exc.start
        return None, (
            f"not valid UTF-8 (byte 0x{data[at]:02x} at offset {at}); "
            "the image is kept and captioned by the next captioner"
        )
    return " ".join(text.split()) or None, None


# --- rows --------------------------------------------------------------------------------------------------------


def kohya_folder(rel: str) -> tuple[int, str]:
    """(repeats, folder name): "10_sks dog" -> (10, "sks dog"); any other leaf folder repeats once."""
    leaf = rel.rpartition("/")[0].rpartition("/")[2]
    match = re.fullmatch(r"(\d+)_(.+)", leaf)
    if match and int(match[1]) > 0:
        return int(match[1]), match[2]
    return 1, leaf


def split_of(image_id: str, eval_fraction: float) -> str:
    # From the content id alone: adding, removing or renaming other files never moves an image between splits.
    return "eval" if int(image_id[:8], 16) / 2**32 < eval_fraction else "train"


@functools.cache
def _registered() -> dict[str, str]:
    from PIL import Image

    return Image.registered_extensions()


def extension_warning(rel: str, fmt: str) -> str | None:
    if f"{tables.SUFFIX}/" in rel:
        return None  # a table row's name is sdpipe's (000000042.image), not the user's
    ext = split_name(rel)[2].lower()
    expected = _registered().get(ext)
    if expected == SAME_FORMAT.get(fmt, fmt):
        return None
    return f"{rel}: the extension is {ext or '(none)'} but the content is {fmt}; accepted as {fmt}"


def fingerprint(raw: Path) -> str:
    """A digest of the folder's listing: each file's relative path, size, mtime and ctime (hidden names skipped, as
    scan skips them). A file added, removed, replaced or edited changes it, and no content is read: one stat per
    file, about 3-9 us on a slow CPU. It decides whether prepare looks at the folder again; prepare's caches are
    keyed by content, so a file touched but unchanged costs a rehash of that file only. Hashed a folder at a time,
    so its memory is one folder's listing, not the tree's."""
    import hashlib

    if not raw.is_dir():
        return "missing"
    digest, stack = hashlib.blake2b(digest_size=16), [""]
    while stack:
        rel = stack.pop()
        with os.scandir(raw / rel if rel else raw) as found:
            entries = sorted((e for e in found if not e.name.startswith(".")), key=lambda e: e.name)
        lines = []
        for e in entries:
            if e.is_dir(follow_symlinks=False):
                stack.append(f"{rel}{e.name}/")
            elif e.is_file():
                st = e.stat()
                lines.append(f"{rel}{e.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}\n")
        digest.update("".join(lines).encode())
    return digest.hexdigest()
