"""A content-addressed tensor cache: a folder of safetensors shards plus an index.

Each entry is a key (a hash of everything that determines it) holding a few named tensors. Shards are written
whole and atomically, so a reader never sees half a shard and a crash loses only the shard being written. Several
processes may write shards at once (names are unique); only the parent process, after they finish, rebuilds the
index and compacts small shards. The index is derived state: it can always be rebuilt from the shard headers.
"""

from __future__ import annotations

import logging
import os
import uuid
from pathlib import Path

from sdpipe import io

log = logging.getLogger(__name__)
SEP = "/"  # tensor name = key + SEP + field
INDEX = "index.json"


def _shard_name() -> str:
    return f"shard-{os.getpid()}-{uuid.uuid4().hex[:12]}.safetensors"


class ShardStore:
    def __init__(self, root: str | Path):
        self.root = Path(root)

    def shards(self) -> list[Path]:
        # Temporary files of an interrupted write start with "." and never match.
        return sorted(self.root.glob("shard-*.safetensors"))

    def scan(self) -> dict[str, str]:
        """key -> shard file name, read from shard headers only (no tensor data)."""
        from safetensors import safe_open

        where: dict[str, str] = {}
        for shard in self.shards():
            with safe_open(str(shard), framework="pt") as f:
                for name in f.keys():
                    where.setdefault(name.split(SEP, 1)[0], shard.name)
        return where

    def write_shard(self, entries: dict[str, dict]) -> Path | None:
        """Write {key: {field: tensor}} as one new shard; return its path."""
        from safetensors.torch import save_file

        if not entries:
            return None
        flat = {f"{key}{SEP}{field}": t.contiguous().cpu() for key, fields in entries.items() for field, t in fields.items()}
        path = self.root / _shard_name()
        with io.atomic_path(path) as tmp:
            save_file(flat, str(tmp), metadata={"format": "sdpipe-cache-v1"})
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
        with safe_open(str(self.root / where[key]), framework="pt") as f:
            return {name[len(prefix):]: f.get_tensor(name) for name in f.keys() if name.startswith(prefix)}

    def compact(self, target_bytes: int = 256 << 20) -> dict[str, str]:
        """Merge shards smaller than target/4 into shards of about `target_bytes`; write and return the index.

        Order matters for crash safety: new shards land first, then the index, then old shards are removed; a
        crash in between leaves duplicate keys, which scan() resolves.
        """
        from safetensors.torch import load_file

        small = [s for s in self.shards() if s.stat().st_size < target_bytes // 4]
        if len(small) > 1:
            self._merge(small, target_bytes, load_file)
        where = self.scan()
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
