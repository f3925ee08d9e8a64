"""A key-value cache in one SQLite file, for caches that hold one small entry per image: prepare's decode results
and file stats, and captions.

One file per entry made two million files at 10^6 images, and a rerun opened every one of them (issue 30). SQLite
(in the standard library) keeps them in one file, looks up a thousand keys in one query and commits atomically, so
a crash loses at most the batch being written. Values are JSON. Several processes may read and write at once; a
writer waits for another's lock (`timeout`). The default rollback journal is kept, not WAL, which needs shared
memory that network volumes (a pod's /workspace) may not give.

A file SQLite cannot read is set aside as `<name>.damaged` with a warning, and the cache starts empty: its entries
are computed again, as for any miss.
"""

from __future__ import annotations

import json
import logging
import os
import sqlite3
from collections.abc import Iterable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)
CHUNK = 900  # keys per query: under SQLite's limit of host parameters in older builds (999)


class KVStore:
    """One SQLite file holding the named tables (each key -> JSON value); one connection per process."""

    def __init__(self, path: str | Path, tables: tuple[str, ...] = ("entries",), timeout: float = 300.0):
        self.path, self.tables, self.timeout = Path(path), tables, timeout
        self._db: sqlite3.Connection | None = None
        self._inode = -1

    def _connect(self) -> sqlite3.Connection:
        if self._db is not None and _inode(self.path) != self._inode:
            self.close()  # the file was deleted or replaced since: a kept connection would still see the old one
        if self._db is None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            self._db = sqlite3.connect(self.path, timeout=self.timeout, isolation_level=None)
            self._inode = _inode(self.path)
            for table in self.tables:
                self._db.execute(f"CREATE TABLE IF NOT EXISTS {table} (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
        return self._db

    def _guarded(self, work):
        """Run `work(db)`; if the file is damaged, set it aside and run it once more on a fresh one."""
        try:
            return work(self._connect())
        except sqlite3.OperationalError:
            raise  # locked past the timeout, a full disk, a read-only folder: the file is fine, so it stays
        except sqlite3.DatabaseError as exc:  # not a database, or a malformed one
            self._set_aside(exc)
            return work(self._connect())

    def _set_aside(self, exc: Exception) -> None:
        self.close()
        damaged = self.path.with_name(self.path.name + ".damaged")
        if self.path.exists():
            os.replace(self.path, damaged)
        log.warning(
            "cache %s is damaged (%s): set aside as %s; its entries will be computed again", self.path, exc, damaged
        )

    def get_many(self, table: str, keys: Iterable[str]) -> dict[str, Any]:
        """{key: value} for the keys present; an entry whose JSON does not parse counts as missing."""
        keys = list(dict.fromkeys(keys))

        def work(db):
            found = {}
            for i in range(0, len(keys), CHUNK):
                part = keys[i : i + CHUNK]
                marks = ",".join("?" * len(part))
                found.update(db.execute(f"SELECT key, value FROM {table} WHERE key IN ({marks})", part))
            return found

        out = {}
        for key, text in self._guarded(work).items():
            try:
                out[key] = json.loads(text)
            except ValueError:
                log.warning("cache %s: entry %s is damaged; computing it again", self.path, key)
        return out

    def keys(self, table: str) -> list[str]:
        return [row[0] for row in self._guarded(lambda db: db.execute(f"SELECT key FROM {table}").fetchall())]

    def delete_many(self, table: str, keys: Iterable[str]) -> None:
        gone = [(key,) for key in keys]
        if not gone:
            return

        def work(db):
            with db:
                db.execute("BEGIN IMMEDIATE")
                db.executemany(f"DELETE FROM {table} WHERE key = ?", gone)

        self._guarded(work)

    def items(self, table: str) -> dict[str, Any]:
        """Every entry of the table (for small tables: one row per container, not per image)."""
        rows = self._guarded(lambda db: db.execute(f"SELECT key, value FROM {table}").fetchall())
        out = {}
        for key, text in rows:
            try:
                out[key] = json.loads(text)
            except ValueError:
                log.warning("cache %s: entry %s is damaged; computing it again", self.path, key)
        return out

    def get(self, table: str, key: str) -> Any | None:
        return self.get_many(table, [key]).get(key)

    def put_many(self, table: str, items: Iterable[tuple[str, Any]]) -> None:
        """Write the entries in one transaction: all of them or, after a crash, none."""
        rows = [(key, json.dumps(value, sort_keys=True)) for key, value in items]
        if not rows:
            return

        def work(db):
            with db:  # BEGIN ... COMMIT, ROLLBACK on error
                db.execute("BEGIN IMMEDIATE")
                db.executemany(f"INSERT OR REPLACE INTO {table} (key, value) VALUES (?, ?)", rows)

        self._guarded(work)

    def put(self, table: str, key: str, value: Any) -> None:
        self.put_many(table, [(key, value)])

    def count(self, table: str) -> int:
        return self._guarded(lambda db: db.execute(f"SELECT COUNT(*) FROM {table}").fetchone()[0])

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None


def _inode(path: Path) -> int:
    try:
        return path.stat().st_ino
    except OSError:
        return -1
