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
