"""Real services the cluster tests start and stop themselves: a single-node Slurm cluster (Debian's slurm-wlm with
munge) and a loopback S3 server (moto's server mode).

`.ci/run` installs the Debian packages (`make services`); on a machine without them, or without root, the tests
skip with the reason, unless SDPIPE_REQUIRE_SERVICES=1 (as in CI) turns the skip into a failure.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

# snakemake's slurm-jobstep plugin drops SLURM_* variables (SLURM_CONF among them) before its inner srun, so the
# cluster's config must sit where Slurm looks by default.
SLURM_CONF = Path("/etc/slurm/slurm.conf")
MARK = "# written by sdpipe's tests (tests/services.py); removed when they end"


def unavailable(reason: str):
    """Skip, or fail where CI requires the services."""
    if os.environ.get("SDPIPE_REQUIRE_SERVICES") == "1":
        pytest.fail(f"{reason} (SDPIPE_REQUIRE_SERVICES=1; `make services` installs them)")
    pytest.skip(reason)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _slurm_conf(state: Path, munge_socket: Path, host: str) -> str:
    # config_overrides: the node may declare more CPUs and memory than this machine has, so the shipped profile's
    # requests (8 CPUs, 32 GB per job) are accepted as they are and only the GPU layout needs overriding.
    return "\n".join(
        [
            MARK,
            "ClusterName=sdpipe-test",
            f"SlurmctldHost={host}(127.0.0.1)",
            "SlurmUser=root",
            "SlurmdUser=root",
            "AuthType=auth/munge",
            f"AuthInfo=socket={munge_socket}",
            "CredType=cred/munge",
            f"SlurmctldPort={free_port()}",
            f"SlurmdPort={free_port()}",
            f"StateSaveLocation={state}/ctld",
            f"SlurmdSpoolDir={state}/spool",
            f"SlurmctldPidFile={state}/slurmctld.pid",
            f"SlurmdPidFile={state}/slurmd.pid",
            f"SlurmctldLogFile={state}/slurmctld.log",
            f"SlurmdLogFile={state}/slurmd.log",
            "ProctrackType=proctrack/linuxproc",
            "TaskPlugin=task/none",
            "MpiDefault=none",
            "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core_Memory",
            "SlurmdParameters=config_overrides",
            "ReturnToService=2",
            "MinJobAge=600",
            "AccountingStorageType=accounting_storage/none",
            "JobCompType=jobcomp/none",
            "JobAcctGatherType=jobacct_gather/none",
            f"NodeName={host} NodeAddr=127.0.0.1 CPUs=128 RealMemory=1000000 State=UNKNOWN",
            "PartitionName=gpu Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
            "",
        ]
    )


def _wait(check, what: str, timeout: float = 30) -> None:
    end = time.time() + timeout
    while time.time() < end:
        if check():
            return
        time.sleep(0.5)
    raise AssertionError(f"{what} did not come up within {timeout:.0f} s")


@contextlib.contextmanager
def slurm_cluster(state: Path):
    """munged, slurmctld and slurmd on this host, one node in partition `gpu` (the profile's default)."""
    missing = [b for b in ("munged", "slurmctld", "slurmd", "sbatch", "srun") if not shutil.which(b)]
    if missing:
        unavailable(f"Slurm is not installed ({', '.join(missing)} missing; Debian: slurm-wlm munge)")
    if os.geteuid() != 0:
        unavailable("a test Slurm cluster runs its daemons as root")
    if SLURM_CONF.exists() and MARK not in SLURM_CONF.read_text():
        unavailable(f"{SLURM_CONF} belongs to a real cluster; the test leaves it alone")
    key = Path("/etc/munge/munge.key")
    if not key.is_file():
        unavailable(f"munge has no key at {key} (Debian's munge package makes one)")
    for sub in ("ctld", "spool"):
        (state / sub).mkdir(parents=True, exist_ok=True)
    host = socket.gethostname().split(".")[0]
    munge_socket = state / "munge.sock"
    subprocess.run(
        [
            "munged",
            f"--socket={munge_socket}",
            f"--pid-file={state}/munged.pid",
            "--force",
            f"--log-file={state}/munged.log",
            f"--seed-file={state}/munge.seed",
            f"--key-file={key}",
        ],
        check=True,
    )
    SLURM_CONF.parent.mkdir(parents=True, exist_ok=True)
    SLURM_CONF.write_text(_slurm_conf(state, munge_socket, host))
    try:
        subprocess.run(["slurmctld", "-i"], check=True)
        subprocess.run(["slurmd"], check=True)
        _wait(
            lambda: "idle" in subprocess.run(["sinfo", "-h", "-o", "%T"], capture_output=True, text=True).stdout,
            "the Slurm node",
        )
        yield host
    finally:
        for pid_file in ("slurmd.pid", "slurmctld.pid", "munged.pid"):
            _kill(state / pid_file)
        SLURM_CONF.unlink(missing_ok=True)


def _kill(pid_file: Path) -> None:
    with contextlib.suppress(FileNotFoundError, ValueError, ProcessLookupError):
        os.kill(int(pid_file.read_text().strip()), 15)


@contextlib.contextmanager
def s3_server():
    """moto's S3 server on a free loopback port; yields its endpoint URL."""
    try:
        import moto.server  # noqa: F401
    except ImportError:
        unavailable("moto[server] is not installed (it is in sdpipe's dev extra)")
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait(lambda: _answers(port), "the S3 server")
        yield f"http://127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def _answers(port: int) -> bool:
    with contextlib.suppress(OSError), socket.create_connection(("127.0.0.1", port), timeout=1):
        return True
    return False


S3_KEYS = {
    "AWS_ACCESS_KEY_ID": "sdpipe-test",
    "AWS_SECRET_ACCESS_KEY": "sdpipe-test",
    "AWS_DEFAULT_REGION": "us-east-1",
}


@pytest.fixture
def s3(monkeypatch):
    """(endpoint, boto3 client) of a fresh loopback S3 server holding one bucket, `sdpipe`; the AWS variables that
    DVC, Snakemake and boto3 read point at it."""
    import boto3

    for key, value in S3_KEYS.items():
        monkeypatch.setenv(key, value)
    with s3_server() as endpoint:
        client = boto3.client("s3", endpoint_url=endpoint)
        client.create_bucket(Bucket="sdpipe")
        yield endpoint, client
