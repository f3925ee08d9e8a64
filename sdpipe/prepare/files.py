"""Reading a raw folder: which files are images and which are their sidecar captions, kohya's repeat folders,
the eval split, and the checks on a file's name against its content. Prepare (stages/prepare.py) builds the
manifest from these; `sdpipe init` and `check-config` count a folder's images with `scan`, as prepare will.
"""

from __future__ import annotations

import codecs
import os
import re
from pathlib import Path, PurePosixPath

from sdpipe import sources

SAME_FORMAT = {"MPO": "JPEG"}  # camera JPEGs with a preview image open as MPO; .jpg is still right for them


# --- scanning and sidecars ---------------------------------------------------------------------------------------


def scan(
    raw: Path, caption_extensions: list[str], skipped: list[str] | None = None, broken: list[dict] | None = None
) -> tuple[list[str], list[str]]:
    """(image candidates, sidecar captions) as sorted posix paths relative to raw. Hidden names and anything but
    plain files are skipped, and listed in `skipped` when it is given. A tar shard is read as a folder of its
    members (sdpipe/sources.py); one that cannot be read whole goes into `broken` as {"path", "reason"}."""
    captions = {ext.lower() for ext in caption_extensions}
    images, sidecars, skipped = [], [], [] if skipped is None else skipped
    broken = [] if broken is None else broken
    for folder, dirs, files in os.walk(raw):
        skipped += [Path(folder, d, "").relative_to(raw).as_posix() + "/" for d in dirs if d.startswith(".")]
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        for name in files:
            path = Path(folder, name)
            if name.startswith(".") or not path.is_file():  # is_file drops FIFOs, which would block a read
                skipped.append(path.relative_to(raw).as_posix())
                continue
            rel = path.relative_to(raw).as_posix()
            names = _shard_members(path, rel, broken) if name.endswith(sources.SHARD_SUFFIX) else [rel]
            for one in names:
                (sidecars if PurePosixPath(one).suffix.lower() in captions else images).append(one)
    return sorted(images), sorted(sidecars)


def _shard_members(path: Path, rel: str, broken: list[dict]) -> list[str]:
    """A tar shard's members as paths under raw (hidden ones left out); a shard read in part goes into `broken`."""
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
    for rel in sorted(sidecars, key=lambda r: (rank[PurePosixPath(r).suffix.lower()], r)):
        p = PurePosixPath(rel)
        key = (str(p.parent), p.stem)
        if key in by_key:
            shadowed[rel] = by_key[key]
        else:
            by_key[key] = rel
    found = {}
    for rel in images:
        p = PurePosixPath(rel)
        side = by_key.get((str(p.parent), p.stem)) or by_key.get((str(p.parent), p.name))
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
    leaf = PurePosixPath(rel).parent.name
    match = re.fullmatch(r"(\d+)_(.+)", leaf)
    if match and int(match[1]) > 0:
        return int(match[1]), match[2]
    return 1, leaf


def split_of(image_id: str, eval_fraction: float) -> str:
    # From the content id alone: adding, removing or renaming other files never moves an image between splits.
    return "eval" if int(image_id[:8], 16) / 2**32 < eval_fraction else "train"


def extension_warning(rel: str, fmt: str) -> str | None:
    from PIL import Image

    ext = PurePosixPath(rel).suffix.lower()
    expected = Image.registered_extensions().get(ext)
    if expected == SAME_FORMAT.get(fmt, fmt):
        return None
    return f"{rel}: the extension is {ext or '(none)'} but the content is {fmt}; accepted as {fmt}"


def fingerprint(raw: Path) -> str:
    """A digest of the folder's listing: each file's relative path, size, mtime and ctime (hidden names skipped, as
    scan skips them). A file added, removed, replaced or edited changes it, and no content is read: one stat per
    file, about 3 us on a slow CPU. It decides whether prepare looks at the folder again; prepare's caches are keyed
    by content, so a file touched but unchanged costs a rehash of that file only."""
    import hashlib

    if not raw.is_dir():
        return "missing"
    lines, stack = [], [""]
    while stack:
        rel = stack.pop()
        with os.scandir(raw / rel if rel else raw) as found:
            entries = sorted((e for e in found if not e.name.startswith(".")), key=lambda e: e.name)
        for e in entries:
            if e.is_dir():
                stack.append(f"{rel}{e.name}/")
            elif e.is_file():
                st = e.stat()
                lines.append(f"{rel}{e.name}\0{st.st_size}\0{st.st_mtime_ns}\0{st.st_ctime_ns}")
    return hashlib.blake2b("\n".join(lines).encode(), digest_size=16).hexdigest()
