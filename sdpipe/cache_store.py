"""A content-addressed tensor cache: a folder of safetensors shards plus an index.

Each entry is a key (a hash of everything that determines it) holding a few named tensors. Shards are written
whole and atomically, so a reader never sees half a shard and a crash loses only the shard being written. Several
processes may write shards at once (names are unique); only the parent process, after they finish, rebuilds the
index and compacts small shards. The index is derived state: it can always be rebuilt from the shard headers.

Each shard's header carries the sha256 of its tensor data (issue 26). The stage that writes the cache verifies
every shard before reusing it and sets a damaged one aside, so its entries are encoded again; a reader verifies a
shard the first time it opens it, so a damaged one stops the run in one line instead of training on bad bits.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

from sdpipe import hashing, io
from sdpipe.errors import UserError

log = logging.getLogger(__name__)
SEP = "/"  # tensor name = key + SEP + field
INDEX = "index.json"
DAMAGED = "damaged"  # where the writing stage moves shards that fail verification
VERIFIED = "verified.json"  # shard name -> [size, mtime_ns] when it last passed verification


def problem(shard: Path) -> str | None:
    """Why `shard` cannot be trusted (unreadable header, short data, checksum mismatch), or None. A shard written
    before checksums has none to compare and passes when its data is whole."""
    try:
        with open(shard, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            header = json.loads(fh.read(n))
            size = os.fstat(fh.fileno()).st_size
            end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
            if size < 8 + n + end:
                return f"truncated: {size} bytes of {8 + n + end}"
            wanted = (header.get("__metadata__") or {}).get("sha256")
            if wanted and hashing.sha256_file(shard, 8 + n) != wanted:
                return "its data does not match its checksum"
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        return f"unreadable ({type(exc).__name__})"
    return None


def _shard_name() -> str:
    return f"shard-{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"


class ShardStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._verified: set[str] = set()

    def shards(self) -> list[Path]:
        # Temporary files of an interrupted write start with "." and never match.
        return sorted(self.root.glob("shard-*.safetensors"))

    def set_aside_damaged(self) -> list[str]:
        """Verify every shard not verified before; move those that fail to damaged/ (their entries are then missing,
        so encoded again). One line per shard moved.

        A shard is written once and never changed, so one that passed keeps its place in VERIFIED under its name,
        size and mtime: a rerun over a 30 GB cache reads only the shards it has not seen (issue 30). Training still
        verifies each shard the first time it opens one."""
        memo_path = self.root / VERIFIED
        memo = io.read_json(memo_path) if memo_path.is_file() else {}
        moved, passed = [], {}
        for shard in self.shards():
            st = shard.stat()
            seal = [st.st_size, st.st_mtime_ns]
            if memo.get(shard.name) == seal:
                passed[shard.name] = seal
                continue
            why = problem(shard)
            if not why:
                passed[shard.name] = seal
            if why:
                (self.root / DAMAGED).mkdir(exist_ok=True)
                os.replace(shard, self.root / DAMAGED / shard.name)
                log.warning(
                    "cache shard %s is damaged (%s): set aside in %s/, its entries will be recomputed",
                    shard,
                    why,
                    DAMAGED,
                )
                moved.append(shard.name)
        if passed != memo:
            io.write_json(memo_path, passed, indent=None)
        return moved

    def scan(self) -> dict[str, str]:
        """key -> shard file name. From the index when it names exactly the shards present (shards never change,
        so their names are enough): 10^6 keys are a JSON read, not every shard header parsed again. Otherwise read
        from the shard headers (no tensor data)."""
        return self._scan()[0]

    def _scan(self) -> tuple[dict[str, str], bool]:
        """(key -> shard, whether that came from an up-to-date index)."""
        shards = self.shards()
        indexed = self._indexed({s.name for s in shards})
        if indexed is not None:
            return indexed, True
        where: dict[str, str] = {}
        for shard in shards:
            for name in _tensor_names(shard):
                where.setdefault(name.split(SEP, 1)[0], shard.name)
        return where, False

    def _indexed(self, names: set[str]) -> dict[str, str] | None:
        path = self.root / INDEX
        try:
            keys = io.read_json(path)["keys"]
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return keys if isinstance(keys, dict) and set(keys.values()) == names else None

    def write_shard(self, entries: dict[str, dict]) -> Path | None:
        """Write {key: {field: tensor}} as one new shard; return its path."""
        if not entries:
            return None
        flat = {
            f"{key}{SEP}{field}": t.contiguous().cpu() for key, fields in entries.items() for field, t in fields.items()
        }
        path = self.root / _shard_name()
        with io.atomic_path(path) as tmp:
            write_checksummed(flat, tmp)
        return path

    def write_index(self, where: dict[str, str]) -> None:
        io.write_json(self.root / INDEX, {"version": 1, "keys": where})

    def read_index(self) -> dict[str, str]:
        path = self.root / INDEX
        return io.read_json(path)["keys"] if path.is_file() else self.scan()

    def load(self, key: str, where: dict[str, str] | None = None) -> dict:
        from safetensors import safe_open

        where = where if where is not None else self.read_index()
        prefix = key + SEP
        self.check(self.root / where[key])
        with safe_open(str(self.root / where[key]), framework="pt") as f:
            return {name[len(prefix) :]: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}

    def check(self, shard: Path, repair: str = "snakemake --forcerun latents") -> None:
        """Verify `shard` the first time this store reads it; a damaged one is a one-line error naming the fix."""
        if shard.name in self._verified:
            return
        why = problem(shard)
        if why:
            raise UserError(f"cache shard {shard} is damaged ({why}); run `{repair}` to encode its entries again")
        self._verified.add(shard.name)

    def compact(self, target_bytes: int = 256 << 20) -> dict[str, str]:
        """Merge shards smaller than target/4 into shards of about `target_bytes`; write and return the index.

        Order matters for crash safety: new shards land first, then the index, then old shards are removed; a
        crash in between leaves duplicate keys, which scan() resolves.
        """
        small = [s for s in self.shards() if s.stat().st_size < target_bytes // 4]
        if len(small) > 1:
            from safetensors.torch import load_file  # imports torch: 2 s and 0.5 GB, only when there is work

            self._merge(small, target_bytes, load_file)
        where, indexed = self._scan()
        if not indexed:
            self.write_index(where)
        return where

    def _merge(self, small: list[Path], target_bytes: int, load_file) -> None:
        batch: dict = {}
        size, seen = 0, set()
        for shard in small:
            for name, tensor in load_file(str(shard)).items():
                if name in seen:
                    continue
                seen.add(name)
                key, field = name.split(SEP, 1)
                batch.setdefault(key, {})[field] = tensor
                size += tensor.numel() * tensor.element_size()
            if size >= target_bytes:
                self.write_shard(batch)
                batch, size = {}, 0
        self.write_shard(batch)
        self.write_index(self.scan())
        for shard in small:
            shard.unlink(missing_ok=True)
        log.debug("compacted %d small shards in %s", len(small), self.root)


def _tensor_names(shard: Path) -> list[str]:
    """The tensor names in a safetensors file's header (the JSON after its 8-byte length)."""
    with open(shard, "rb") as fh:
        n = int.from_bytes(fh.read(8), "little")
        return [name for name in json.loads(fh.read(n)) if name != "__metadata__"]


PLACEHOLDER = "0" * 64


def write_checksummed(flat: dict, path: Path) -> None:
    """Save `flat` as safetensors at `path` with the sha256 of its tensor data in the header. The header is written
    with a placeholder of the digest's length, which is overwritten in place once the data has been hashed."""
    from safetensors.torch import save_file

    save_file(flat, str(path), metadata={"format": "sdpipe-cache-v1", "sha256": PLACEHOLDER})
    with open(path, "r+b") as fh:
        n = int.from_bytes(fh.read(8), "little")
        at = 8 + fh.read(n).index(f'"{PLACEHOLDER}"'.encode()) + 1
        fh.seek(at)
        fh.write(hashing.sha256_file(path, 8 + n).encode())
