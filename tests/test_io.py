"""Atomic writes leave nothing behind, even after a kill (issue 26, item 7: a kill during the final save left a
hidden `.final.*` folder)."""

from __future__ import annotations

import os
import subprocess
import sys

from sdpipe import io

KILLED_WRITER = """
import os, sys
from pathlib import Path
from sdpipe import io
with io.atomic_dir(Path(sys.argv[1])) as tmp:
    (tmp / "half.bin").write_bytes(b"half a model")
    os.kill(os.getpid(), 9)
"""


def test_a_killed_writers_folder_is_swept_by_the_next_write(tmp_path):
    final = tmp_path / "final"
    proc = subprocess.run([sys.executable, "-c", KILLED_WRITER, str(final)])
    assert proc.returncode == -9
    left = [p.name for p in tmp_path.iterdir()]
    assert len(left) == 1 and left[0].startswith(".final.")
    live = tmp_path / f".final.{os.getppid()}.inprogress"  # a living writer's folder stays
    live.mkdir()
    with io.atomic_dir(final) as tmp:
        (tmp / "model.bin").write_bytes(b"whole")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted([live.name, "final"])
    assert (final / "model.bin").read_bytes() == b"whole"


def test_streamed_json_is_the_text_json_dumps_gives(tmp_path):
    """The latent index is written row by row (10^6 items never one string) and must read as before."""
    import json

    head = {"version": 3, "model": {"z": 1, "a": [1, {"y": None, "b": "é"}]}}
    items = [{"id": str(i), "bucket": [i, i]} for i in range(3)]
    io.write_json_streamed(tmp_path / "i.json", head, {"items": iter(items), "failed": []})
    text = (tmp_path / "i.json").read_text()
    assert text == json.dumps(head | {"items": items, "failed": []}, sort_keys=True) + "\n"


def test_a_key_with_one_part_left_open_is_the_key_of_all_parts():
    from sdpipe.hashing import SLOT, key_of, key_with

    fixed = ("latent", 1, SLOT, {"bucket": [64, 48], "crop": "center"}, "vae-sha", None, "fp16")
    for value in ["an id", 'a "quoted" caption, ü', "", {"b": 1, "a": 2}]:
        assert key_with(*fixed)(value) == key_of(*[value if p is SLOT else p for p in fixed])
    assert key_with(SLOT)("x") == key_of("x") and key_with("x", SLOT)("y") == key_of("x", "y")
