"""Training processes end with their run, and one run at a time uses a run folder (issue 26, item 3)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from sdpipe.errors import UserError
from sdpipe.train import lifeline

# A parent that starts a rank-like child (which asks for the parent-death signal) and then sleeps.
PARENT = """
import subprocess, sys, time
child = subprocess.Popen([sys.executable, "-c",
    "from sdpipe.train import lifeline; import time; lifeline.die_with_parent(); print('ready', flush=True); "
    "time.sleep(120)"], start_new_session=True, stdout=subprocess.PIPE, text=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[1].split()[0] != "Z"  # a zombie has exited


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_in_its_own_session_dies_with_a_killed_launcher():
    parent = subprocess.Popen([sys.executable, "-c", PARENT], stdout=subprocess.PIPE, text=True)
    child = int(parent.stdout.readline())
    assert _alive(child)
    parent.kill()  # kill -9: nothing of the parent's runs, and the child is in another session
    parent.wait()
    deadline = time.monotonic() + 10
    while _alive(child) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(child)


# A stage that starts a rank and is killed at once, while the rank still imports: the rank asks for the signal only
# after its parent is gone.
LATE_RANK = """
import os, subprocess, sys
child = subprocess.Popen([sys.executable, "-c",
    "import time; time.sleep(1.5); from sdpipe.train import lifeline; lifeline.die_with_parent(); time.sleep(120)"],
    start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    env={**os.environ, "SDPIPE_STAGE_PID": str(os.getpid())})
print(child.pid, flush=True)
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the parent-death signal is Linux's")
def test_a_rank_whose_stage_died_while_it_started_ends_instead_of_waiting():
    """The CI run at b47bde1 found four ranks of killed 2-process runs alive minutes later, handed to init, each
    waiting out its rendezvous: they had asked for the parent-death signal after their launcher was gone."""
    stage = subprocess.run([sys.executable, "-c", LATE_RANK], capture_output=True, text=True, check=True)
    rank = int(stage.stdout)
    deadline = time.monotonic() + 30
    while _alive(rank) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not _alive(rank)


def test_a_second_run_in_the_same_folder_is_refused(tmp_path):
    with lifeline.run_lock(tmp_path):
        with pytest.raises(UserError, match="another training run is using"):
            with lifeline.run_lock(tmp_path):
                pass
    with lifeline.run_lock(tmp_path):  # free again once the first run ends
        pass


def test_a_run_waits_for_a_dead_runs_rank_then_refuses_a_living_one(tmp_path):
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from sdpipe.train import lifeline; lifeline.hold_rank_lock(Path(sys.argv[1])); "
            "print('held', flush=True); time.sleep(float(sys.argv[2]))",
            str(tmp_path),
            "1.5",
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with lifeline.run_lock(tmp_path, rank_wait_s=30):  # the rank exits after 1.5 s; the run goes on then
        assert holder.poll() is not None
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from sdpipe.train import lifeline; lifeline.hold_rank_lock(Path(sys.argv[1])); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(UserError, match="still hold"):
            with lifeline.run_lock(tmp_path, rank_wait_s=0.5):
                pass
    finally:
        holder.kill()


def test_a_run_waits_for_every_rank_of_a_dead_run_not_only_rank_0(tmp_path):
    """A rank other than 0 that outlives rank 0 by a moment could still reach the new run's rendezvous on the same
    port (suspected in the 2-process kill campaign's lost trial): the new run waits for it too."""
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from sdpipe.train import lifeline; lifeline.hold_ranks_lock(Path(sys.argv[1])); "
            "print('held', flush=True); time.sleep(1.5)",
            str(tmp_path),
        ],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert holder.stdout.readline().strip() == "held"
    with lifeline.run_lock(tmp_path, rank_wait_s=30):
        assert holder.poll() is not None
    assert lifeline.hold_ranks_lock(tmp_path) >= 0  # two ranks of one run share it
    assert lifeline.hold_ranks_lock(tmp_path) >= 0
