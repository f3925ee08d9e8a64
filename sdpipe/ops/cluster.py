"""Where a multi-node training job runs, read from the scheduler: Slurm's environment inside an allocation.

`sdpipe train` is started once per node (on Slurm by `srun --ntasks-per-node=1`, see profiles/slurm); each copy
launches accelerate with this node's rank and the first node as the rendezvous host. Inside an srun step each task
is one accelerate machine, ranked by SLURM_PROCID, so a step of 2 tasks on one node (the CI's single-node cluster)
launches the way 2 nodes do. Explicit train.multi_node settings win over the environment.
"""

from __future__ import annotations

import re
from dataclasses import dataclass


@dataclass(frozen=True)
class Topology:
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int


def expand_hostlist(spec: str) -> list[str]:
    """Slurm's compressed host list, e.g. "gpu[01-03,07],login2" -> gpu01 gpu02 gpu03 gpu07 login2 (what
    `scontrol show hostnames` prints), keeping the zero padding."""
    hosts = []
    for prefix, ranges, plain in re.findall(r"([^,\[]+)\[([^\]]+)\]|([^,\[\]]+)", spec):
        if plain:
            hosts.append(plain)
            continue
        for part in ranges.split(","):
            lo, _, hi = part.partition("-")
            for n in range(int(lo), int(hi or lo) + 1):
                hosts.append(f"{prefix}{n:0{len(lo)}d}")
    return hosts


def slurm_nodes(env: dict) -> int:
    return int(env.get("SLURM_JOB_NUM_NODES") or env.get("SLURM_NNODES") or 1)


def slurm_machines(env: dict) -> tuple[int, int]:
    """(machines, this one's rank): the tasks of the srun step that started this process (SLURM_STEP_NUM_TASKS is
    set only inside a step, not in the batch script), else the nodes of the allocation."""
    tasks = int(env.get("SLURM_STEP_NUM_TASKS") or 0)
    if tasks > 1:
        return tasks, int(env.get("SLURM_PROCID", 0))
    return slurm_nodes(env), int(env.get("SLURM_NODEID", 0))


def topology(multi_node, env: dict) -> Topology:
    """train.multi_node as configured or, when it says one machine and Slurm started several, Slurm's."""
    mn = multi_node
    machines, rank = slurm_machines(env)
    if mn.num_machines > 1 or machines < 2:
        return Topology(mn.num_machines, mn.machine_rank, mn.main_process_ip, mn.main_process_port)
    hosts = expand_hostlist(env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or "")
    return Topology(machines, rank, mn.main_process_ip or (hosts[0] if hosts else None), mn.main_process_port)
