"""Multi-node training on Slurm, from a simulated allocation of 2 nodes x 8 GPUs: the topology read from Slurm's
environment and the `accelerate launch` command each node's `sdpipe train` runs."""

from __future__ import annotations

import pytest

from sdpipe import config
from sdpipe.errors import UserError
from sdpipe.ops import cluster
from sdpipe.stages import train

NODE = {
    "SLURM_JOB_NUM_NODES": "2",
    "SLURM_JOB_NODELIST": "gpu[07-08]",
    "SLURM_GPUS_ON_NODE": "8",
    "CUDA_VISIBLE_DEVICES": "0,1,2,3,4,5,6,7",
}


@pytest.mark.parametrize(
    "spec, hosts",
    [
        ("gpu[07-08]", ["gpu07", "gpu08"]),
        ("node3", ["node3"]),
        ("a[1-2,9],b[010-011],login", ["a1", "a2", "a9", "b010", "b011", "login"]),
    ],
)
def test_slurm_hostlist_expands_like_scontrol(spec, hosts):
    assert cluster.expand_hostlist(spec) == hosts


def _cfg(**multi_node):
    return config.from_dict(
        {
            "model": {"pretrained": "m"},
            "data": {"raw_dir": "d"},
            "train": {"num_processes": "auto", "multi_node": multi_node},
        }
    )


@pytest.mark.parametrize("node_id", [0, 1])
def test_each_node_launches_its_rank_of_16_processes(monkeypatch, tmp_path, node_id):
    for key, value in {**NODE, "SLURM_NODEID": str(node_id)}.items():
        monkeypatch.setenv(key, value)
    cfg = _cfg()
    world = train.num_processes(cfg)
    assert world == 16
    train._check_topology(cfg, world)
    cmd = train.launch_command(
        cfg, world, tmp_path / "c.yaml", tmp_path / "i.json", tmp_path / "out", tmp_path / "s.json"
    )
    flags = _flags(cmd[3 : cmd.index("sdpipe.train.loop") - 1])
    assert cmd[1:3] == ["-m", "accelerate.commands.launch"]
    assert flags["--num_processes"] == "16" and flags["--num_machines"] == "2"
    assert flags["--machine_rank"] == str(node_id) and flags["--main_process_ip"] == "gpu07"
    assert flags["--gpu_ids"] == "0,1,2,3,4,5,6,7" and flags["--multi_gpu"] is True


def _flags(args: list[str]) -> dict:
    """accelerate launch's --flag value pairs; a flag without a value maps to True."""
    out = {}
    for i, arg in enumerate(args):
        if arg.startswith("--"):
            nxt = args[i + 1] if i + 1 < len(args) else "--"
            out[arg] = True if nxt.startswith("--") else nxt
    return out


def test_configured_machines_win_over_slurm(monkeypatch):
    for key, value in {**NODE, "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(key, value)
    topo = train.topology(_cfg(num_machines=4, machine_rank=3, main_process_ip="10.0.0.1"))
    assert (topo.num_machines, topo.machine_rank, topo.main_process_ip) == (4, 3, "10.0.0.1")


def test_outside_slurm_nothing_changes(monkeypatch):
    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    assert train.topology(_cfg()).num_machines == 1 and train.num_processes(_cfg()) == 2


def test_a_process_count_that_does_not_split_over_the_nodes_fails_before_launch(monkeypatch):
    for key, value in {**NODE, "SLURM_NODEID": "0"}.items():
        monkeypatch.setenv(key, value)
    with pytest.raises(UserError, match="multiple of"):
        train._check_topology(_cfg(), 15)


@pytest.mark.parametrize("proc_id", [0, 1])
def test_each_task_of_an_srun_step_is_one_machine(monkeypatch, proc_id):
    """Two tasks on one node (srun -n 2), as the CI's single-node cluster runs them: ranked by SLURM_PROCID, since
    both tasks share SLURM_NODEID 0."""
    env = {
        "SLURM_JOB_NUM_NODES": "1",
        "SLURM_JOB_NODELIST": "vm",
        "SLURM_NODEID": "0",
        "SLURM_STEP_NUM_TASKS": "2",
        "SLURM_PROCID": str(proc_id),
    }
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    topo = train.topology(_cfg())
    assert (topo.num_machines, topo.machine_rank, topo.main_process_ip) == (2, proc_id, "vm")


def test_the_batch_script_outside_a_step_counts_nodes(monkeypatch):
    """sbatch --ntasks=2 sets SLURM_NTASKS in the batch script too; only a step's tasks are machines."""
    for key, value in {"SLURM_JOB_NUM_NODES": "1", "SLURM_NTASKS": "2", "SLURM_PROCID": "0"}.items():
        monkeypatch.setenv(key, value)
    monkeypatch.delenv("SLURM_STEP_NUM_TASKS", raising=False)
    assert train.topology(_cfg()).num_machines == 1


def test_one_machine_rendezvous_on_a_free_port_of_its_own(monkeypatch):
    """Two projects training side by side on one pod, or a rerun while a killed run's ranks still exit, must not
    meet on the configured port: with it taken, the launch still gets a port it can bind."""
    import socket

    monkeypatch.delenv("SLURM_JOB_NUM_NODES", raising=False)
    monkeypatch.delenv("SLURM_NNODES", raising=False)
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        taken = busy.getsockname()[1]
        port = train.rendezvous_port(train.topology(_cfg(main_process_port=taken)))
        assert port != taken
        with socket.socket() as s:
            s.bind(("127.0.0.1", port))


def test_several_machines_keep_the_configured_port(monkeypatch):
    for key, value in {**NODE, "SLURM_NODEID": "1"}.items():
        monkeypatch.setenv(key, value)
    assert train.rendezvous_port(train.topology(_cfg(main_process_port=31337))) == 31337
