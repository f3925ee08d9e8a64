"""Training processes that end with their run (issue 26, item 3).

accelerate's launcher (torch elastic) starts each rank in a process session of its own, so a kill -9 of the stage's
process group (Snakemake's, a pod's) used to leave the ranks training, and a rerun then trained in the same folder
at the same time. Two guards:

- each rank asks the kernel for SIGTERM when its parent dies (Linux's parent-death signal);
- one lock per run folder: `sdpipe train` holds `.run.lock` for the whole stage, rank 0 holds `.rank.lock` while it
  lives, and every rank holds `.ranks.lock` shared while it lives. A second run refuses while the first is alive,
  and waits, briefly, for every rank of a dead run to go.

A rank of a killed run that is still starting (importing, before it asks for the signal or takes a lock) may retry
its rendezvous for a while; on one machine each run rendezvouses on a free port of its own
(`stages.train.rendezvous_port`), so such a rank never joins the next run's.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import os
import signal
import sys
import time
from pathlib import Path
from typing import Iterator

from sdpipe.errors import UserError

PR_SET_PDEATHSIG = 1
RUN_LOCK, RANK_LOCK, RANKS_LOCK = ".run.lock", ".rank.lock", ".ranks.lock"
# The `sdpipe train` process that started this run: a rank whose stage is gone has nothing to report to.
STAGE_PID_ENV = "SDPIPE_STAGE_PID"


def die_with_parent(sig: int = signal.SIGTERM) -> None:
    """Have the kernel send `sig` to this process when its parent exits (Linux only; elsewhere nothing).

    A rank killed while it still imports reaches this after its launcher is gone: it has been handed to init (or a
    subreaper), which never exits, so the kernel's signal would never come, and the rank would wait out its
    rendezvous timeout (30 minutes) holding memory, a GPU and the run folder's lock. It ends here instead when the
    stage that started the run is no longer alive."""
    if not sys.platform.startswith("linux"):
        return
    parent = os.getppid()
    ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(sig))
    if os.getppid() != parent or not _alive(os.environ.get(STAGE_PID_ENV)):
        os.kill(os.getpid(), sig)


def _alive(pid: str | None) -> bool:
    """Whether process `pid` runs (True when unknown: a loop started by hand has no stage). A zombie, exited but not
    yet reaped by its parent, is not alive."""
    if not pid:
        return True
    try:
        with open(f"/proc/{int(pid)}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def _take(path: Path, wait_s: float) -> int | None:
    """An exclusive lock on `path` (its fd), or None if another process still holds it after `wait_s`."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    deadline = time.monotonic() + wait_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            return fd
        except BlockingIOError:
            if time.monotonic() >= deadline:
                os.close(fd)
                return None
            time.sleep(0.2)


@contextlib.contextmanager
def run_lock(out: Path, rank_wait_s: float = 60.0) -> Iterator[None]:
    """Hold the run folder for one `sdpipe train`: refuse at once if another run holds it; wait up to `rank_wait_s`
    for ranks of a killed run to exit."""
    fd = _take(out / RUN_LOCK, 0)
    if fd is None:
        raise UserError(f"another training run is using {out}; wait for it to end or stop it, then rerun")
    try:
        for name in (RANKS_LOCK, RANK_LOCK):
            rank = _take(out / name, rank_wait_s)
            if rank is None:
                raise UserError(
                    f"training processes of an earlier run still hold {out / name} after "
                    f"{rank_wait_s:.0f} s; stop them (fuser -k {out / name}), then rerun"
                )
            os.close(rank)  # free for this run's ranks
        yield
    finally:
        os.close(fd)


def hold_rank_lock(out: Path) -> int:
    """Rank 0's hold on the run folder for as long as it lives (released by the kernel when it exits)."""
    fd = _take(out / RANK_LOCK, 0)
    if fd is None:
        raise UserError(f"another training process is writing {out}; stop it, then rerun")
    return fd


def hold_ranks_lock(out: Path) -> int:
    """Every rank's shared hold on the run folder for as long as it lives (released by the kernel when it exits)."""
    out.mkdir(parents=True, exist_ok=True)
    fd = os.open(out / RANKS_LOCK, os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_SH)  # waits only while a starting run checks that no earlier rank is left
    return fd
