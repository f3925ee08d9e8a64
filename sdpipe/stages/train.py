"""Train the UNet (full or LoRA) on the latent cache with `accelerate launch`, one process per GPU.

A single process (one GPU, or a CPU) runs the training module directly, without the launcher.

Everything that can be wrong with the settings is checked here, before any process is launched: the step plan,
a batch no bucket can fill, LoRA targets, a missing cache, a checkpoint of another model.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.train import lifeline
from sdpipe.train.models import MIXED

if TYPE_CHECKING:
    from sdpipe.config import Config
    from sdpipe.ops.cluster import Topology

log = logging.getLogger(__name__)
INPUTS = {"index": "results/latents/index.json"}
OUTPUTS = {"summary": "results/train/summary.json", "out": "results/train"}
# The config keys the outputs depend on (stages/declared.py).
READS = ("train", "model", "seed", "dreambooth.prior_loss_weight")


def topology(cfg: Config):
    from sdpipe.ops.cluster import topology as from_env

    return from_env(cfg.train.multi_node, dict(os.environ))


def num_processes(cfg: Config) -> int:
    """train.num_processes, or "auto": every visible GPU (1 on a CPU) on each of the job's machines."""
    from sdpipe.parallel import detect_gpu_count

    n = cfg.train.num_processes
    return max(1, detect_gpu_count()) * topology(cfg).num_machines if n == "auto" else int(n)


def preflight(cfg: Config, index: Path, out: Path, world: int) -> None:
    from sdpipe.train import accounting, checkpoint
    from sdpipe.train.data import LatentData
    from sdpipe.train.loop import checkpoint_dir, model_id
    from sdpipe.train.trackers import check_installed

    data = LatentData(index)
    t = cfg.train
    sizes = accounting.count_buckets(data.sample_buckets())
    accounting.check_batch_fits(sizes, world, t.per_device_batch_size)
    plan = accounting.plan_steps(
        sizes, world, t.per_device_batch_size, t.grad_accum_steps, t.max_steps, t.epochs, t.lr_warmup_steps
    )
    if t.mode == "lora":
        _check_lora_targets(cfg)
    if t.text_encoder.mode == "lora":
        _check_text_lora_targets(cfg)
    check_installed(t.tracker)
    _check_topology(cfg, world)
    ident = model_id(cfg, data)
    found = checkpoint.find_resume(checkpoint_dir(cfg, out, ident, data), t.resume)
    if found:  # the newest: resume verifies it and falls back to an older one if it is damaged
        checkpoint.check_compatible(checkpoint.read_state(found[0]), ident, found[0])
        log.info("resuming from %s", found[0])
    log.info("preflight ok: %d optimizer steps, global batch %d", plan.total_optimizer_steps, plan.global_batch_size)


def _check_topology(cfg: Config, world: int) -> None:
    """Process counts that accelerate would only reject (or hang on) after launch."""
    from sdpipe.parallel import detect_gpu_count

    mn, gpus = topology(cfg), detect_gpu_count()
    if mn.machine_rank >= mn.num_machines:
        raise UserError(
            f"train.multi_node.machine_rank = {mn.machine_rank} must be below num_machines = {mn.num_machines}"
        )
    if world % mn.num_machines:
        raise UserError(
            f"train.num_processes = {world} must be a multiple of train.multi_node.num_machines = "
            f"{mn.num_machines} (it counts the processes of every machine)"
        )
    if gpus and world // mn.num_machines > gpus:
        raise UserError(
            f"train.num_processes = {world} needs {world // mn.num_machines} GPUs per machine but {gpus} are visible"
        )


def _check_lora_targets(cfg: Config) -> None:
    """Build the UNet on the meta device (no weights) just to see its module names."""
    import torch

    from sdpipe.models import loading
    from sdpipe.train.models import add_lora

    root, _ = loading.model_index(cfg.model.pretrained, cfg.model.revision)
    family = loading.family_of(cfg.model.pretrained, cfg.model.revision)
    cls = family.denoiser_type()
    with torch.device("meta"):
        unet = cls.from_config(cls.load_config(str(root), subfolder=family.denoiser))
    add_lora(unet, cfg.train.lora)


def _check_text_lora_targets(cfg: Config) -> None:
    import torch
    import transformers

    from sdpipe.models import loading
    from sdpipe.train.models import add_text_lora

    root, index = loading.model_index(cfg.model.pretrained, cfg.model.revision)
    parts = {part.encoder: part for part in loading.family_of(cfg.model.pretrained, cfg.model.revision).text_parts}
    for name in loading.text_component_names(cfg.model.pretrained, cfg.model.revision):
        config = transformers.AutoConfig.from_pretrained(root / name)
        cls = getattr(transformers, index[name][1] or parts[name].encoder_class)
        with torch.device("meta"):
            add_text_lora(cls(config), cfg)


def launch_command(cfg: Config, world: int, config_path: Path, index: Path, out: Path, summary: Path) -> list[str]:
    mn = topology(cfg)
    loop = [
        "-m",
        "sdpipe.train.loop",
        "--config",
        str(config_path),
        "--index",
        str(index),
        "--out",
        str(out),
        "--summary",
        str(summary),
    ]
    if world == 1 and mn.num_machines == 1:
        # One process needs no launcher (the Accelerator sets itself up), and a launcher would wrap the loop's
        # one-line errors in its own traceback.
        return [sys.executable, *loop]
    cmd = [
        sys.executable,
        "-m",
        "accelerate.commands.launch",
        "--num_processes",
        str(world),
        "--num_machines",
        str(mn.num_machines),
        "--machine_rank",
        str(mn.machine_rank),
        "--main_process_port",
        str(rendezvous_port(mn)),
        "--dynamo_backend",
        "no",
        "--mixed_precision",
        MIXED[cfg.train.mixed_precision],
    ]
    if mn.main_process_ip:
        cmd += ["--main_process_ip", mn.main_process_ip]
    if world > 1 or mn.num_machines > 1:
        cmd.append("--multi_gpu")  # on a CPU-only machine this starts gloo processes
    ids = _gpu_ids(world // mn.num_machines)
    if ids:
        cmd += ["--gpu_ids", ids]
    return cmd + loop


def rendezvous_port(mn: Topology) -> int:
    """The configured port across machines, which every node must agree on. On one machine a free port of its own:
    a fixed one is shared by every run on the pod, so a second project training beside the first, or a rerun
    started while a killed run's ranks are still exiting, would meet the other run's rendezvous."""
    if mn.num_machines > 1:
        return mn.main_process_port
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _gpu_ids(local: int) -> str | None:
    """The first `local` GPUs this job may use. accelerate turns --gpu_ids into CUDA_VISIBLE_DEVICES, so keep the
    entries a scheduler already set there rather than renumbering from 0."""
    from sdpipe.parallel import detect_gpu_count

    if not detect_gpu_count():
        return None
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = [d.strip() for d in visible.split(",") if d.strip()] if visible else [str(i) for i in range(local)]
    return ",".join(ids[:local])


def compile_cache_env(cfg: Config) -> dict[str, str]:
    """torch.compile's caches in the project's cache_dir (on a pod, the volume), unless the environment already
    names them: a second run, or a restarted pod, finds the compiled kernels and starts in seconds."""
    root = Path(cfg.cache_dir).resolve() / "torch-compile"
    wanted = {"TORCHINDUCTOR_CACHE_DIR": root / "inductor", "TRITON_CACHE_DIR": root / "triton"}
    return {k: str(v) for k, v in wanted.items() if not os.environ.get(k)}


def run(cfg: Config, inputs: dict[str, Path], outputs: dict[str, Path]) -> None:
    import time

    started = time.time()
    out, summary = Path(outputs["out"]), Path(outputs["summary"])
    # One machine holds the run folder: on a cluster every node runs this stage on the same shared folder.
    with lifeline.run_lock(out) if topology(cfg).machine_rank == 0 else contextlib.nullcontext():
        _train(cfg, inputs, out, summary, started)


def _train(cfg: Config, inputs: dict[str, Path], out: Path, summary: Path, started: float) -> None:
    world = num_processes(cfg)
    preflight(cfg, Path(inputs["index"]), out, world)
    config_path = out / "config.yaml"  # the resolved config every process reads
    io.write_yaml(config_path, cfg.raw)
    cmd = launch_command(cfg, world, config_path, Path(inputs["index"]), out, summary)
    log.info("launching %d training process(es): %s", world, " ".join(cmd))
    from sdpipe.train.loop import STARTED_ENV
    from sdpipe.train.trackers import environment

    # PYTHONSAFEPATH: `python -m` would put the working folder first on sys.path, and a project folder holding an
    # `sdpipe/` folder (a checkout, a copy) would then shadow the installed package in the training processes.
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "PYTHONSAFEPATH": "1",
        STARTED_ENV: str(started),
        lifeline.STAGE_PID_ENV: str(os.getpid()),
        **compile_cache_env(cfg),
        **environment(cfg, dict(os.environ), out),
    }
    rc = subprocess.run(cmd, env=env).returncode
    if rc != 0 and world > 1:
        # The launcher ends every process once one fails, so a dead rank cannot leave the others waiting.
        raise UserError(
            f"training stopped: a training process failed or was killed (launcher exit code {rc}); "
            "the failing rank's error is above"
        )
    if rc != 0:
        raise UserError(f"training exited with code {rc}; its error is above")
