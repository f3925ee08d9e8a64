"""`snakemake --profile profiles/slurm` on a real single-node Slurm cluster (started by the test): every rule is a
Slurm job, and training is one job of 2 tasks that launch accelerate the way the multi-node path does, each task's
machine rank taken from Slurm's environment, gloo on the CPU."""

from __future__ import annotations

import json
import re

import pytest

from tests.services import free_port, slurm_cluster
from tests.workflow_helpers import FAST, make_project, run

pytestmark = pytest.mark.slow
# The shipped profile, with what a one-node CPU cluster cannot give: 2 tasks on 1 node instead of 2 nodes x 8 GPUs.
# A --set-resources on the command line replaces the profile's whole list, so the train entries are repeated.
# No sacct without a Slurm database, so job states come from squeue (the cluster keeps finished jobs 10 minutes).
OVERRIDES = [
    "--slurm-status-command",
    "squeue",
    "--slurm-init-seconds-before-status-checks",
    "1",
    "--set-resources",
    "train:nodes=1",
    "train:tasks=2",
    "train:tasks_per_gpu=0",
    "train:gpu=0",
    'train:gres=""',
    'train:mpi="srun --ntasks=2 --kill-on-bad-exit=1"',
    "--slurm-keep-successful-logs",
]


def test_the_demo_trains_as_one_slurm_job_of_two_tasks(tmp_path, demo_source):
    proj = make_project(
        tmp_path / "proj",
        demo_source,
        prepare={"eval_fraction": 0.0, "workers": 1},
        model={"train_vae": {"enabled": False}},
        train={**FAST["train"], "num_processes": "auto", "multi_node": {"main_process_port": free_port()}},
    )
    with slurm_cluster(tmp_path / "slurm"):
        run(["snakemake", "--profile", "profiles/slurm", *OVERRIDES, "--", "train"], proj)
    jobs = sorted(p.parent.name for p in (proj / ".snakemake" / "slurm_logs").glob("rule_*/*.log"))
    assert jobs == ["rule_base_model", "rule_caption", "rule_latents", "rule_prepare", "rule_train"]
    summary = json.loads((proj / "results" / "train" / "summary.json").read_text())
    assert summary["world_size"] == 2 and summary["optimizer_steps"] == 4
    launches = re.findall(r"--num_machines 2 --machine_rank (\d)", (proj / "logs" / "train.log").read_text())
    assert sorted(launches) == ["0", "1"]  # one accelerate launch per Slurm task, ranked by SLURM_PROCID
    assert (proj / "results" / "train" / "final").is_dir()
