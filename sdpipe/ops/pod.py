"""`sdpipe pod`: what the container image runs when a pod starts (the Dockerfile's entrypoint).

It counts the GPUs, keeps every piece of state on the pod's volume (DVC cache, checkpoints, results, model and
compile caches), writes the matching accelerate config, and runs `snakemake --profile runpod` (or
$SDPIPE_TARGET) in the project on the volume. A restarted pod runs the same command: Snakemake finds the finished
outputs, training resumes from its last checkpoint, and the content-addressed caches recompute nothing.

Environment: SDPIPE_WORKSPACE (the volume, default /workspace), SDPIPE_PROJECT (default $SDPIPE_WORKSPACE/project;
a new one is seeded from the image's copy of the project), SDPIPE_TARGET (Snakemake targets, default: all),
SDPIPE_SNAKEMAKE_ARGS (extra arguments), SDPIPE_KEEP_ALIVE (1 = stay up after the run so results can be synced;
`sdpipe runpod down` ends billing).
"""

from __future__ import annotations

import json
import os
import shlex
import shutil
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

from sdpipe import io

IMAGE_PROJECT = Path(os.environ.get("SDPIPE_IMAGE_PROJECT", "/opt/sdpipe"))
TEMPLATE = ("Snakefile", "workflow", "config", "profiles", "dvc.yaml", "runpod")


@dataclass(frozen=True)
class Plan:
    gpus: int
    workspace: Path
    project: Path
    env: dict
    accelerate_config: Path
    commands: list

    def as_dict(self) -> dict:
        return {
            "gpus": self.gpus,
            "workspace": str(self.workspace),
            "project": str(self.project),
            "env": self.env,
            "accelerate_config": str(self.accelerate_config),
            "commands": self.commands,
        }


def cache_env(workspace: Path) -> dict[str, str]:
    """Every cache on the volume, so a restarted pod downloads and compiles nothing twice."""
    cache = workspace / ".cache"
    return {
        "HF_HOME": str(cache / "huggingface"),
        "TORCH_HOME": str(cache / "torch"),
        "XDG_CACHE_HOME": str(cache),
        "TORCHINDUCTOR_CACHE_DIR": str(cache / "torchinductor"),
        "TRITON_CACHE_DIR": str(cache / "triton"),
        "PIP_CACHE_DIR": str(cache / "pip"),
    }


def accelerate_settings(gpus: int) -> dict:
    """accelerate's default_config.yaml for this machine. `sdpipe train` passes its own launch flags; this makes
    a hand-run `accelerate launch` on the pod match."""
    return {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": "MULTI_GPU" if gpus > 1 else "NO",
        "num_processes": max(gpus, 1),
        "num_machines": 1,
        "machine_rank": 0,
        "gpu_ids": "all",
        "mixed_precision": "bf16",
        "use_cpu": gpus == 0,
        "dynamo_config": {},
        "main_training_function": "main",
        "rdzv_backend": "static",
        "same_network": True,
        "tpu_use_cluster": False,
        "tpu_use_sudo": False,
    }


def snakemake_commands(gpus: int, target: str, extra: str) -> list[list[str]]:
    base = ["snakemake", "--profile", "runpod"]
    # A pod killed mid-run leaves Snakemake's lock behind; this pod is the only one using the project.
    return [base + ["--unlock"], base + ["--resources", f"gpu={gpus}", *shlex.split(extra), *shlex.split(target)]]


def plan(environ: dict, gpus: int) -> Plan:
    workspace = Path(environ.get("SDPIPE_WORKSPACE", "/workspace"))
    project = Path(environ.get("SDPIPE_PROJECT", str(workspace / "project")))
    env = cache_env(workspace)
    return Plan(
        gpus,
        workspace,
        project,
        env,
        Path(env["HF_HOME"]) / "accelerate" / "default_config.yaml",
        snakemake_commands(gpus, environ.get("SDPIPE_TARGET", ""), environ.get("SDPIPE_SNAKEMAKE_ARGS", "")),
    )


def seed_project(project: Path, source: Path = IMAGE_PROJECT) -> bool:
    """Copy the image's workflow into an empty project folder; an existing project is left alone."""
    if (project / "Snakefile").is_file():
        return False
    project.mkdir(parents=True, exist_ok=True)
    for name in TEMPLATE:
        src = source / name
        if src.is_symlink():
            (project / name).symlink_to(os.readlink(src))
        elif src.is_dir():
            shutil.copytree(src, project / name)
        elif src.is_file():
            shutil.copy2(src, project / name)
    return True


def prepare(p: Plan) -> None:
    """Write the settings and the DVC cache location (on the volume, outside the project)."""
    seed_project(p.project)
    io.write_yaml(p.accelerate_config, accelerate_settings(p.gpus))
    if (p.project / ".dvc").is_dir() and shutil.which("dvc"):
        subprocess.run(["dvc", "cache", "dir", "--local", str(p.workspace / ".dvc-cache")], cwd=p.project, check=True)


def add_arguments(parser) -> None:
    parser.add_argument("--dry-run", action="store_true", help="print the plan as JSON; write and run nothing")
    parser.add_argument("--prepare-only", action="store_true", help="write the settings, print the plan, run nothing")


def run(args) -> int:
    from sdpipe.parallel import detect_gpu_count

    p = plan(dict(os.environ), detect_gpu_count())
    if args.dry_run:
        print(json.dumps(p.as_dict(), indent=1))
        return 0
    prepare(p)
    if args.prepare_only:
        print(json.dumps(p.as_dict(), indent=1))
        return 0
    env = {**os.environ, **p.env}
    print(f"sdpipe pod: {p.gpus} GPU(s); project {p.project}; caches under {p.workspace / '.cache'}", flush=True)
    code = 0
    for cmd in p.commands:
        code = subprocess.run(cmd, cwd=p.project, env=env).returncode
        if code:
            break
    if os.environ.get("SDPIPE_KEEP_ALIVE", "1") == "1":
        print(
            f"sdpipe pod: finished with exit code {code}; staying up so results can be synced. "
            "Stop billing with `sdpipe runpod down`.",
            flush=True,
        )
        while True:
            time.sleep(3600)
    return code
