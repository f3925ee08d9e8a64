"""The training process: one per GPU, started by `accelerate launch -m sdpipe.train.loop` (see stages/train.py).

build -> resume -> loop over global batches -> save. Every rank runs the same code; only rank 0 logs and writes
files, and every rank joins the collective saves.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import torch

from sdpipe import config, io
from sdpipe.errors import UserError
from sdpipe.log import progress
from sdpipe.records import TrainSummary
from sdpipe.train import accounting, checkpoint, heldout, lifeline, objective, optimizers, trackers
from sdpipe.train.data import LatentData
from sdpipe.train.models import (
    MIXED,
    build_ema,
    build_lr_scheduler,
    build_optimizer,
    build_text_stack,
    build_unet,
    compile_mode,
    resolve_compile,
    save_final,
    trainable,
    training_forward,
)
from sdpipe.train.prefetch import Prefetcher
from sdpipe.train.sampler import BucketSampler, SamplerState, rank_slice
from sdpipe.train.telemetry import Telemetry, check_finite

if TYPE_CHECKING:
    from accelerate import Accelerator
    from diffusers import SchedulerMixin
    from diffusers.training_utils import EMAModel

    from sdpipe.config import Config
    from sdpipe.models.loading import TextStack

log = logging.getLogger("sdpipe.train")


@dataclass
class Run:
    """Everything the loop needs, built once."""

    cfg: Config
    accelerator: Accelerator
    data: LatentData
    plan: accounting.StepPlan
    sampler: BucketSampler
    unet: torch.nn.Module
    noise_scheduler: SchedulerMixin
    optimizer: torch.optim.Optimizer
    lr_scheduler: torch.optim.lr_scheduler.LRScheduler
    out: Path
    model_id: dict
    prediction_type: str
    state: SamplerState = None  # type: ignore[assignment]  # set by resume(), before the loop reads it
    step: int = 0
    telemetry: Telemetry = None  # type: ignore[assignment]  # set once the loop starts
    ckpt_dir: Path = None  # type: ignore[assignment]  # set by build()
    ema: EMAModel | None = None
    advance_bar: Callable[[int], None] | None = None
    text: TextStack | None = None  # the TextStack being trained (train.text_encoder.mode), else None: cached embeddings
    forward: Callable[..., Any] = None  # type: ignore[assignment]  # the (wrapped) UNet the step calls, compiled on GPUs
    pad_to: int = 0  # a compiled step pads short batches to this size (zero loss weight): one shape, no recompile
    prefetch: Prefetcher | None = None  # loads the next batches in the background (while training), else None
    heldout: LatentData | None = None  # the held-out images (train.validation.heldout_every), else None

    def trained(self) -> dict:
        """Pipeline component name -> the (wrapped) model being trained."""
        text = dict(zip(self.text.names, self.text.encoders)) if self.text else {}
        return {self.data.family.denoiser: self.unet, **text}

    def params(self) -> list:
        return [p for m in self.trained().values() for p in trainable(m)]

    def modes(self) -> dict:
        t = self.cfg.train
        return {name: t.mode if name == self.data.family.denoiser else t.text_encoder.mode for name in self.trained()}


# Settings that may change between a run and its resume: they do not change what is being trained.
OPERATIONAL = (
    "num_processes",
    "resume",
    "log_every",
    "checkpoint_every",
    "keep_checkpoints",
    "multi_node",
    "compile",
    "tracker",
    "tracker_project",
    "validation",
    "ddp",
    "save_final",
)


def model_id(cfg: Config, data: LatentData) -> dict:
    """What a checkpoint must match to be resumed: the base model's weights and what is being trained."""
    te = cfg.train.text_encoder
    lora = cfg.train.mode == "lora" or te.mode == "lora"
    return {
        "vae_sha256": data.index["model"]["vae_sha256"],
        "pretrained": cfg.model.pretrained,
        "mode": cfg.train.mode,
        "lora": vars(cfg.train.lora) if lora else None,
        "text_encoder": vars(te) if te.mode != "none" else None,
        "prior_loss_weight": cfg.dreambooth.prior_loss_weight if cfg.dreambooth.enabled else None,
        # These change what a checkpoint holds (an EMA copy; a GradScaler), so accelerate cannot load across them.
        "ema": cfg.train.ema.enabled,
        "fp16": cfg.train.mixed_precision == "fp16",
    }


def checkpoint_dir(cfg: Config, out: Path, ident: dict, data: LatentData) -> Path:
    """Checkpoints of one training setup on one dataset: `resume: latest` never continues a run with other
    hyperparameters or other data (a finished run on old data would otherwise be "resumed" and do nothing)."""
    from sdpipe.hashing import key_of

    settings = {k: v for k, v in cfg.raw["train"].items() if k not in OPERATIONAL}
    samples = [(it["latent_key"], it["flip_key"], it["text_key"], it["repeats"]) for it in data.items]
    return out / "checkpoints" / key_of(ident, settings, cfg.seed, samples)[:12]


def build(cfg: Config, index: Path, out: Path) -> Run:
    from accelerate import Accelerator
    from accelerate.utils import set_seed

    from sdpipe.models import loading

    # cpu=True on a CPU-only machine: without it accelerate treats each process launched with --multi_gpu as a
    # lone single process instead of one gloo rank of several.
    tracker = None if cfg.train.tracker == "none" else cfg.train.tracker
    accelerator = Accelerator(
        mixed_precision=MIXED[cfg.train.mixed_precision],
        project_dir=str(out),
        cpu=not torch.cuda.is_available(),
        log_with=tracker,
        kwargs_handlers=ddp_kwargs(cfg),
    )
    set_seed(cfg.seed)  # the LoRA init and anything else not driven by per-sample generators
    # Rank 0 verifies each cache shard as it first opens it: one pass over the cache; every rank reads the same files.
    data = LatentData(
        index, cfg.dreambooth.prior_loss_weight if cfg.dreambooth.enabled else 1.0, verify=accelerator.is_main_process
    )
    t, world = cfg.train, accelerator.num_processes
    buckets = data.sample_buckets()
    plan = accounting.plan_steps(
        accounting.count_buckets(buckets),
        world,
        t.per_device_batch_size,
        t.grad_accum_steps,
        t.max_steps,
        t.epochs,
        t.lr_warmup_steps,
    )
    cfg = resolve_compile(
        cfg, accelerator.device, plan.total_optimizer_steps * t.per_device_batch_size * t.grad_accum_steps
    )
    unet, text = build_unet(cfg, accelerator.device), build_text_stack(cfg, accelerator.device)
    encoders = text.encoders if text else []
    noise_scheduler = loading.load_noise_scheduler(cfg.model.pretrained, cfg.model.revision)
    optimizer = build_optimizer(cfg, unet, encoders)
    lr_scheduler = build_lr_scheduler(cfg, optimizer, plan.lr_schedule_steps)
    unet, *encoders, optimizer = accelerator.prepare(unet, *encoders, optimizer)
    if text:
        text.encoders = encoders
    accelerator.register_for_checkpointing(lr_scheduler)
    checkpoint.save_only_trainable(accelerator)
    ema = build_ema(cfg, [p for m in [unet, *encoders] for p in trainable(m)], accelerator)
    trackers.start(accelerator, cfg, out)
    sampler = BucketSampler(buckets, cfg.seed, world, t.per_device_batch_size, accelerator.process_index)
    prediction = t.prediction_type or data.family.objective.prediction(noise_scheduler)
    ident = model_id(cfg, data)
    forward = training_forward(cfg, unet, accelerator.device)
    return Run(
        cfg,
        accelerator,
        data,
        plan,
        sampler,
        unet,
        noise_scheduler,
        optimizer,
        lr_scheduler,
        out,
        ident,
        prediction,
        ckpt_dir=checkpoint_dir(cfg, out, ident, data),
        ema=ema,
        text=text,
        forward=forward,
        pad_to=t.per_device_batch_size if forward is not unet else 0,
        heldout=heldout.load(cfg, index, verify=accelerator.is_main_process),
    )


def ddp_kwargs(cfg: Config) -> list:
    """accelerate's handlers for DDP and the process group (they apply only when several processes train)."""
    from datetime import timedelta

    from accelerate.utils import DistributedDataParallelKwargs, InitProcessGroupKwargs

    d = cfg.train.ddp
    # SDXL conditions on the penultimate layer of its first text encoder, so when that encoder trains, its last
    # layer gets no gradient: DDP must expect that.
    ddp = DistributedDataParallelKwargs(
        find_unused_parameters=cfg.train.text_encoder.mode != "none",
        bucket_cap_mb=d.bucket_cap_mb,
        static_graph=d.static_graph,
        gradient_as_bucket_view=d.gradient_as_bucket_view,
    )
    # The timeout bounds how long the live ranks wait in a collective for one that died or hangs (the launcher
    # ends them all when a process exits with an error; this covers a process that stops without exiting).
    return [ddp, InitProcessGroupKwargs(timeout=timedelta(seconds=d.timeout_s))]


def resume(run: Run) -> None:
    path, half_loaded = None, False
    for candidate in checkpoint.find_resume(run.ckpt_dir, run.cfg.train.resume):
        why = checkpoint.damage(candidate)
        if why is None:
            half_loaded, why = True, _load(run, candidate)
        if why is None:
            path = candidate
            break
        if run.cfg.train.resume != "latest":
            raise UserError(f"train.resume: checkpoint {candidate} cannot be used: {why}")
        log.warning("checkpoint %s cannot be used (%s); trying the one before it", candidate, why)
    if path is None and half_loaded:  # the model may hold part of a failed load: no clean start from here
        raise UserError(
            f"no checkpoint under {run.ckpt_dir} could be loaded (see the lines above); move them away "
            f"to train from the start"
        )
    if path is None:
        run.state = SamplerState(
            epoch=0, batches_done=0, global_batch=run.sampler.global_batch, seen=[], samples_seen_total=0
        )
        return
    saved = checkpoint.read_state(path)
    checkpoint.match_state_layout(run.optimizer)  # the weights' layout may differ from the saving run's
    if run.ema is not None:
        run.ema.to(run.accelerator.device)  # accelerate loads registered objects onto the CPU
    checkpoint.restore_metrics(path, run.out / "metrics.csv", run.accelerator.is_main_process)
    run.step = saved["step"]
    run.state = run.sampler.resume(SamplerState.from_dict(saved["sampler"]))
    if run.accelerator.is_main_process:
        log.info("resumed from %s at optimizer step %d (%d samples seen)", path, run.step, run.state.samples_seen_total)


def _load(run: Run, path: Path) -> str | None:
    """Load checkpoint `path` into the run; why it could not be, or None. A later checkpoint that loads replaces
    everything a failed one may have half loaded."""
    from sdpipe import plain_data

    checkpoint.check_compatible(checkpoint.read_state(path), run.model_id, path)
    for custom in sorted(path.glob("custom_checkpoint_*.pkl")):  # accelerate unpickles these with weights_only=False
        plain_data.check(custom, "a checkpoint's LR scheduler or EMA state")
    models = [run.accelerator.unwrap_model(m) for m in run.trained().values()]
    base_frozen = any(checkpoint.frozen_names(m) for m in models)  # the files hold the trained weights only
    try:
        run.accelerator.load_state(str(path), strict=not base_frozen)
    except (OSError, RuntimeError, ValueError, KeyError, EOFError) as exc:
        return f"loading failed: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
    return checkpoint.trained_weights_missing(path, models) if base_frozen else None


def micro_step(
    run: Run, indices: list[int], step_samples: int, epoch: int, ahead: list[tuple[int, list[int]]] | None = None
) -> torch.Tensor:
    """Forward and backward for this rank's share of one global batch; return the sum of its sample losses (a
    device tensor: reading it would make the host wait for the GPU, so only the telemetry does, every log_every).
    `ahead` is this rank's next (epoch, indices), which the prefetcher (when training) loads meanwhile.

    The loss is scaled so that DDP's average over ranks, summed over the accumulated micro-steps, is the mean over
    all `step_samples` samples of the optimizer step: shares may be smaller (or empty) at a bucket's tail.
    """
    acc, t = run.accelerator, run.cfg.train
    indices, real, weight = padded(run, indices)
    with run.telemetry.loading():
        if run.prefetch is None:
            batch, draws = load_batch(run, indices, epoch)
        else:
            wanted = [(epoch, indices)] + [(e, padded(run, ix)[0]) for e, ix in ahead or []]
            batch, draws = (_to_device(part, acc.device) for part in run.prefetch.get(wanted))
    batch["weight"][real:] = 0.0
    if run.text is not None:  # the text encoders train too: condition on their live output, not the cache
        with acc.autocast():
            texts = run.data.captions(indices, draws["drop_caption"].tolist(), draws["variant"].tolist())
            batch.update(run.text.embed(texts))
    losses = (
        objective.sample_losses(
            run.forward,
            run.data.family,
            run.noise_scheduler,
            batch["latents"],
            draws,
            batch,
            t,
            run.prediction_type,
            acc.autocast,
        )
        * batch["weight"]
    )
    acc.backward(losses.sum() * weight * acc.num_processes / step_samples)
    return losses.detach().sum() * weight


def padded(run: Run, indices: list[int]) -> tuple[list[int], int, float]:
    """(indices to load, how many are real, loss weight). DDP needs every rank in the backward, so an empty share
    reuses a sample with zero weight. A compiled step keeps one batch shape: a bucket's short tail batch would
    otherwise recompile the UNet with dynamic shapes, minutes on a GPU. The padding repeats a sample with zero loss
    weight, and a UNet has no cross-sample layer (GroupNorm, attention within a sample), so the real samples'
    gradients are unchanged."""
    weight = 1.0
    if not indices:
        indices, weight = [0], 0.0
    real = len(indices)
    return indices + [indices[0]] * max(0, run.pad_to - real), real, weight


def load_batch(run: Run, indices: list[int], epoch: int) -> tuple[dict, dict]:
    """The cached latents and text states of `indices` and their random draws (noise, timesteps, caption
    dropout, flips), on the device: all the data one micro-step reads. `sdpipe bench` times this very function."""
    batch, draws = host_batch(run, indices, epoch)
    return _to_device(batch, run.accelerator.device), _to_device(draws, run.accelerator.device)


def host_batch(run: Run, indices: list[int], epoch: int) -> tuple[dict, dict]:
    """load_batch's host half: read, draw, and pin on a GPU machine (what the prefetch thread does)."""
    gens = [objective.sample_generator(run.cfg.seed, epoch, i) for i in indices]
    flips = [bool(torch.rand((1,), generator=g) < 0.5) for g in gens]
    shape = run.data.latent_shape(indices[0])
    timestep = lambda g: run.data.family.objective.timestep(g, run.noise_scheduler)
    draws = objective.draw(shape, gens, timestep, run.cfg.train)
    # After every other draw, so runs without caption variants draw exactly what they did before.
    draws["variant"] = objective.variant(gens, run.data.variant_counts(indices))
    batch = run.data.batch(indices, flips, draws["drop_caption"].tolist(), draws["variant"].tolist())
    if run.accelerator.device.type == "cuda":
        batch, draws = ({k: v.pin_memory() for k, v in part.items()} for part in (batch, draws))
    return batch, draws


def _to_device(tensors: dict, device) -> dict:
    """Host batch -> device. From pinned memory the copy does not make the host wait for the GPU."""
    if device.type != "cuda":
        return {k: v.to(device) for k, v in tensors.items()}
    return {k: v.to(device, non_blocking=True) for k, v in tensors.items()}


def optimizer_step(run: Run) -> None:
    """Clip, step, schedule. Nothing here reads a GPU value back, so the host runs ahead of the GPU."""
    acc, t = run.accelerator, run.cfg.train
    if t.max_grad_norm is not None:
        acc.clip_grad_norm_(run.params(), t.max_grad_norm)
    run.optimizer.step()
    run.optimizer.zero_grad(set_to_none=True)
    if not acc.optimizer_step_was_skipped:  # fp16 loss scaling skips steps that overflowed: no LR or EMA step
        run.lr_scheduler.step()
        if run.ema is not None:
            run.ema.step(run.params())
    run.step += 1


def validation_due(run: Run) -> bool:
    v = run.cfg.train.validation
    return bool(v.every and v.prompts and (run.step % v.every == 0 or finished(run)))


def checkpoint_due(run: Run) -> bool:
    every = run.cfg.train.checkpoint_every
    return bool(every and (run.step % every == 0 or finished(run)))


def maybe_validate(run: Run) -> None:
    """Every rank renders its share of the fixed prompts x seeds grid (validation.every steps and at the end)."""
    v = run.cfg.train.validation
    if not validation_due(run):
        return
    from sdpipe.train.validation import render

    size = v.resolution or [run.cfg.prepare.buckets.resolution] * 2
    path = render(
        run.accelerator,
        run.trained(),
        run.cfg,
        run.step,
        run.out / "samples",
        v.prompts,
        v.seeds,
        v.steps,
        v.guidance,
        (size[0], size[1]),
    )
    if path is not None:
        log.info("samples at step %d: %s", run.step, path)


def save_checkpoint(run: Run) -> None:
    state = {"step": run.step, "sampler": run.state.to_dict(), "model_id": run.model_id, "plan": run.plan.as_dict()}
    checkpoint.save(
        run.accelerator, run.ckpt_dir, run.step, state, run.cfg.train.keep_checkpoints, run.out / "metrics.csv"
    )


def train_epoch(run: Run) -> bool:
    """Train until the epoch ends or the step budget is spent; return True when training is complete."""
    acc, k = run.accelerator, run.cfg.train.grad_accum_steps
    epoch = run.state.epoch
    remaining = run.sampler.remaining(run.state)
    for start in range(0, len(remaining), k):
        group = remaining[start : start + k]
        loss_sum: torch.Tensor | int = 0  # the sum of this rank's sample losses, on its device
        samples, step_samples = 0, sum(len(c) for c in group)
        for j, chunk in enumerate(group):
            mine = rank_slice(chunk, acc.process_index, acc.num_processes)
            ahead = (
                [
                    (e, rank_slice(c, acc.process_index, acc.num_processes))
                    for e, c in run.sampler.upcoming(run.state, 1 + run.prefetch.depth)[1:]
                ]
                if run.prefetch
                else []
            )
            # Gradients are all-reduced only on the last micro-step of the optimizer step.
            with contextlib.ExitStack() as stack:
                if j < len(group) - 1:
                    for model in run.trained().values():
                        stack.enter_context(acc.no_sync(model))
                loss_sum += micro_step(run, mine, step_samples, epoch, ahead)
            samples += len(mine)
            run.state = run.sampler.advance(run.state, chunk)
        optimizer_step(run)
        due = heldout.due(run)
        with run.telemetry.paused(), optimizers.eval_weights(run.optimizer, when=due):
            held = heldout.loss(run) if due else None
        run.telemetry.step(run, loss_sum, samples, step_samples, held)
        if run.advance_bar:
            run.advance_bar(1)
        due = validation_due(run) or checkpoint_due(run)
        with run.telemetry.paused(), optimizers.eval_weights(run.optimizer, when=due):
            maybe_validate(run)
            if checkpoint_due(run):
                check_finite(run, run.telemetry.window_loss())  # never checkpoint a diverged model
                save_checkpoint(run)
        if finished(run):
            return True
    return False


def finished(run: Run) -> bool:
    """The step budget is spent or, when training for epochs, the last epoch is done (after a resume on another
    world size the re-planned epoch can take a different number of steps than the plan said)."""
    t = run.cfg.train
    return run.step >= run.plan.total_optimizer_steps or (t.max_steps is None and run.state.epoch >= t.epochs)


def write_summary(run: Run, path: Path, seconds: float, samples_this_run: int) -> None:
    """The run's plan, its steady rate and, each under its own name, warm-up, compile and first-step seconds
    (sdpipe.train.telemetry). `seconds` is the training loop's wall time, everything included."""
    if not run.accelerator.is_main_process:
        return
    summary: TrainSummary = {
        **run.plan.as_dict(),
        **run.telemetry.rates(),
        "optimizer_steps": run.step,
        "epochs_started": run.state.epoch + 1,
        "samples_seen": run.state.samples_seen_total,
        "samples_this_run": samples_this_run,
        "seconds": round(seconds, 3),
        "compile": compile_mode(run.cfg, run.accelerator.device),
        "mode": run.cfg.train.mode,
        "mixed_precision": run.cfg.train.mixed_precision,
        "prediction_type": run.prediction_type,
        "device": str(run.accelerator.device),
        "peak_memory_mb": run.telemetry.peak_memory_mb(),
        "cuda_alloc_retries": run.telemetry.alloc_retries(),
    }
    io.write_json(path, summary)


def warn_about_alloc_retries(run: Run) -> None:
    """Rank 0 warns for its GPU (the ranks run the same shapes, so their allocators behave alike)."""
    retries = run.telemetry.alloc_retries()
    if retries and run.accelerator.is_main_process:
        log.warning(
            "the CUDA allocator ran out of cached memory %d times in %d optimizer steps and synchronised "
            "the GPU each time; PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True or a smaller "
            "train.per_device_batch_size avoids it",
            retries,
            run.step,
        )


STARTED_ENV = "SDPIPE_STAGE_STARTED"  # `sdpipe train` sets it (time.time()) before it launches this process


def stage_started(default: float) -> float:
    """When the training stage started: the launching command's time, else `default`."""
    import os

    value = os.environ.get(STARTED_ENV)
    return float(value) if value else default


def main(argv: list[str] | None = None) -> int:
    from sdpipe.log import setup_logging

    parser = argparse.ArgumentParser(prog="sdpipe.train.loop")
    parser.add_argument("--config", required=True)
    parser.add_argument("--set", action="append", default=[])
    parser.add_argument("--index", required=True)
    parser.add_argument("--out", required=True, help="results/train: checkpoints, metrics, final weights")
    parser.add_argument("--summary", required=True)
    args = parser.parse_args(argv)
    started = stage_started(time.time())
    setup_logging()
    lifeline.die_with_parent()  # a kill -9 of the stage takes the ranks with it
    lifeline.hold_ranks_lock(Path(args.out))  # until this process exits
    try:
        run = build(config.load(args.config, args.set), Path(args.index), Path(args.out))
        if run.accelerator.is_main_process:
            lifeline.hold_rank_lock(Path(args.out))  # until this process exits
        else:
            logging.getLogger().setLevel(logging.WARNING)
        resume(run)
        optimizers.train_mode(run.optimizer)
        run.telemetry = Telemetry(run, started)
        log.info("\n%s", accounting.summary_block(run.plan))
        seen_before, start = run.state.samples_seen_total, time.perf_counter()
        todo = run.plan.total_optimizer_steps - run.step
        with (
            progress(todo if run.accelerator.is_main_process else 0, "training") as run.advance_bar,
            Prefetcher(lambda epoch, indices: host_batch(run, indices, epoch)) as run.prefetch,
        ):
            while not finished(run) and not train_epoch(run):
                pass
        if run.cfg.train.save_final:
            with optimizers.eval_weights(run.optimizer):
                save_final(
                    run.accelerator,
                    run.trained(),
                    run.modes(),
                    run.out / "final",
                    {
                        "base": run.cfg.model.pretrained,
                        "family": run.data.index["model"]["family"],
                        "prediction_type": run.prediction_type,
                        "optimizer_steps": run.step,
                    },
                    run.ema,
                )
        warn_about_alloc_retries(run)
        write_summary(run, Path(args.summary), time.perf_counter() - start, run.state.samples_seen_total - seen_before)
        run.telemetry.close()
        run.accelerator.end_training()
    except UserError as exc:
        print(f"sdpipe train: error: {exc}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
