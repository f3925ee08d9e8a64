"""Training telemetry: per-step loss, learning rate, throughput, data-wait share and peak memory.

The data wait is the share of the window the device spent waiting for batches. On a GPU that is not the host's time
in the loader: the host prepares the next batch while the GPU still runs the previous step, so only CUDA events
around the load can tell whether the GPU sat idle (on an H200, SD 1.5 training spent 8-11 % of its host time in the
loader and still ran as fast as the bare step on data already on the GPU). On a CPU the step waits for the host's
load, so its time is the wait.

Rank 0 appends one row per logged step to metrics.csv (which `dvc plots` and the report read), logs a plain line,
and forwards the same numbers to accelerate's trackers when one is configured.

Rates are steady or warm-up, never a mix. The first logged window holds the compile and the first steps' warm-up;
the steady rate is that of every window after it (or, in a run of one window, of the steps after the first). Time
spent validating or checkpointing is no training step and is left out of every window. The summary reports,
under their own names, the steady rate, the warm-up (the first window's time beyond what the steady rate would
have taken), the compile seconds torch measured, and the time from the stage's start to the end of the first
optimizer step (imports, loading, compile and that step).
"""

from __future__ import annotations

import contextlib
import csv
import logging
import math
import time
from pathlib import Path

import torch

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.records import TrainRates

log = logging.getLogger("sdpipe.train")
COLUMNS = [
    "step",
    "epoch",
    "loss",
    "lr",
    "samples_per_s",
    "samples_per_s_per_gpu",
    "data_wait",
    "peak_memory_mb",
    "samples_seen",
    "heldout_loss",  # last: rows written before it existed read as blank here
]


def open_metrics(path: Path, resume: bool):
    """metrics.csv open for appending rows, its header in place. A resumed run appends to the checkpoint's copy,
    which lacks the header when the checkpoint came before the first row; a file left that way is mended too."""
    header = ",".join(COLUMNS)
    rows = path.read_text().splitlines() if resume and path.is_file() else []
    if rows[:1] != [header]:
        path.parent.mkdir(parents=True, exist_ok=True)
        io.write_text(path, "\r\n".join([header] + [r for r in rows if r.strip()]) + "\r\n")  # csv's line ends
    return open(path, "a", newline="")


def check_finite(run, mean: float) -> None:
    """A NaN/inf loss stops the run: checked for each logged window and before every checkpoint."""
    if not math.isfinite(mean):
        from sdpipe.train import checkpoint

        last = checkpoint.complete_checkpoints(run.ckpt_dir)
        raise UserError(
            f"loss is {mean} in the optimizer steps up to {run.step}; stopping. Last good checkpoint: "
            f"{last[-1] if last else 'none'} (lower train.learning_rate or use bf16)"
        )


def compile_seconds() -> float | None:
    """Seconds torch.compile spent in this process: tracing and compiling forward graphs, and the backward graphs
    compiled lazily at their first backward (torch's own timers; None where this torch keeps other names)."""
    try:
        from torch._dynamo.utils import compilation_time_metrics as metrics
    except ImportError:
        return None
    keys = ("_compile.compile_inner", "backward._backward_impl")
    if not any(k in metrics for k in keys):
        return 0.0 if not metrics else None
    return round(sum(sum(metrics.get(k, [])) for k in keys), 3)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


class Telemetry:
    def __init__(self, run, started: float):
        """`started`: the wall-clock time (time.time()) the training stage started."""
        self.started = started
        self.first_step_s: float | None = None
        self.windows: list[tuple[int, float]] = []  # (samples, seconds) of each logged window, in order
        self.after_first: tuple[int, float] | None = None  # (samples, perf_counter) at the end of the first step
        self.paused_s = 0.0
        self.main = run.accelerator.is_main_process
        self.every = run.cfg.train.log_every
        self.world = run.accelerator.num_processes
        self.device = run.accelerator.device
        self.total = run.plan.total_optimizer_steps
        self.reduce = run.accelerator.reduce
        self.last_loss = float("nan")
        self._reset()
        self.file = None
        if self.main:
            self.file = open_metrics(run.out / "metrics.csv", resume=run.step > 0)
            self.writer = csv.DictWriter(self.file, COLUMNS)

    def _reset(self) -> None:
        # The window's loss stays on the device until it is logged: reading it each step would stall the host.
        self.window_start, self.samples, self.waiting, self.steps = time.perf_counter(), 0, 0.0, 0
        self.window_paused = 0.0
        self.loss_sum, self.loss_samples = torch.zeros((), device=self.device), 0
        self.loads: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def loading(self):
        """Wraps the load of one micro-step's batch, copies to the device included."""
        if self.device.type != "cuda":
            start = time.perf_counter()
            yield
            self.waiting += time.perf_counter() - start
            return
        # The GPU reaches `before` when the previous step's work is done and `after` once the batch is on it:
        # between them it ran only the copies, or waited for the host.
        before, after = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        before.record()
        yield
        after.record()
        self.loads.append((before, after))

    def data_wait(self, elapsed: float) -> float:
        """The window's share of waiting for data (reads the GPU's events: call where the host waits anyway)."""
        for before, after in self.loads:
            after.synchronize()
            self.waiting += before.elapsed_time(after) / 1e3
        self.loads = []
        return min(self.waiting / elapsed, 1.0)

    def peak_memory_mb(self) -> float | None:
        if self.device.type != "cuda":
            return None
        return round(torch.cuda.max_memory_allocated(self.device) / 2**20, 1)

    def alloc_retries(self) -> int | None:
        """How often the CUDA caching allocator found no free block, released its cache and retried: each release
        synchronises the device, so a run at the edge of its memory stalls at every one."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.memory_stats(self.device).get("num_alloc_retries", 0)

    def window_loss(self) -> float:
        """Mean loss per sample over every rank's samples since the last logged row (that row's, if none since).
        A collective: every rank calls it at the same step."""
        if not self.steps:
            return self.last_loss
        count = torch.tensor(float(self.loss_samples), device=self.device, dtype=torch.float64)
        totals = self.reduce(torch.stack([self.loss_sum.double(), count]), "sum")
        self.last_loss = float(totals[0] / totals[1]) if float(totals[1]) else float("nan")
        return self.last_loss

    @contextlib.contextmanager
    def paused(self):
        """Wraps work between steps that is no training (validation grids, checkpoints): left out of the rates."""
        sync(self.device)
        start = time.perf_counter()
        try:
            yield
        finally:
            sync(self.device)
            self.window_paused += time.perf_counter() - start
            self.paused_s += time.perf_counter() - start

    def _first_step_done(self) -> None:
        """Once per run: the first optimizer step has run (the GPU waited for, once: that is the compile's end)."""
        sync(self.device)
        self.first_step_s = time.time() - self.started
        self.after_first = (self.samples, time.perf_counter() - self.window_paused)
        if self.main:
            log.info(
                "first optimizer step done %.1f s after the stage started (imports, loading, compile%s included)",
                self.first_step_s,
                f" {compile_seconds():.1f} s" if compile_seconds() else "",
            )

    def step(
        self, run, loss_sum: torch.Tensor | int, rank_samples: int, step_samples: int, heldout: float | None = None
    ) -> None:
        """After an optimizer step: this rank's loss sum over its `rank_samples`; `step_samples` over all ranks;
        the held-out loss when it was measured at this step (which then always gets a row)."""
        self.samples += step_samples
        self.loss_sum = self.loss_sum + loss_sum
        self.loss_samples += rank_samples
        self.steps += 1
        if self.first_step_s is None:
            self._first_step_done()
        if run.step % self.every and run.step != self.total and heldout is None:
            return
        loss = self.window_loss()
        check_finite(run, loss)
        elapsed = max(time.perf_counter() - self.window_start - self.window_paused, 1e-9)
        self._record_window(elapsed)
        row = {
            "step": run.step,
            "epoch": run.state.epoch,
            "loss": round(loss, 6),
            "lr": run.lr_scheduler.get_last_lr()[0],
            "samples_per_s": round(self.samples / elapsed, 3),
            "samples_per_s_per_gpu": round(self.samples / elapsed / self.world, 3),
            "data_wait": round(self.data_wait(elapsed), 4),
            "peak_memory_mb": self.peak_memory_mb(),
            "samples_seen": run.state.samples_seen_total,
            "heldout_loss": None if heldout is None else round(heldout, 6),
        }
        if self.file:  # rank 0 only
            self.writer.writerow(row)
            self.file.flush()
            log.info(
                "step %d/%d loss %.4f lr %.2e %.1f samples/s (%.1f per GPU) data wait %.0f%%",
                run.step,
                self.total,
                row["loss"],
                row["lr"],
                row["samples_per_s"],
                row["samples_per_s_per_gpu"],
                100 * row["data_wait"],
            )
            if heldout is not None:
                log.info("step %d held-out loss %.4f", run.step, heldout)
        run.accelerator.log({k: v for k, v in row.items() if v is not None and k != "step"}, step=run.step)
        self._reset()

    def _record_window(self, elapsed: float) -> None:
        if not self.windows and self.after_first is not None:
            samples, at = self.after_first  # the part of the first window after its first step
            self.after_first = (self.samples - samples, time.perf_counter() - self.window_paused - at)
        self.windows.append((self.samples, elapsed))

    def rates(self) -> TrainRates:
        """Steady samples/s (all ranks) and the warm-up, compile and first-step seconds, for the summary."""
        steady = self.windows[1:]
        if not steady and self.after_first and self.after_first[0] > 0:
            steady = [self.after_first]  # a run of one window: the steps after the first
        samples, seconds = sum(n for n, _ in steady), sum(t for _, t in steady)
        rate = samples / seconds if seconds > 0 else None
        warmup = None
        if rate and self.windows:
            first_samples, first_seconds = self.windows[0]
            warmup = max(first_seconds - first_samples / rate, 0.0)
        return {
            "samples_per_s": _round(rate),
            "warmup_s": _round(warmup),
            "compile_s": compile_seconds(),
            "time_to_first_step_s": _round(self.first_step_s),
            "steady_steps_samples": samples,
            "validation_and_checkpoint_s": _round(self.paused_s),
        }

    def close(self) -> None:
        if self.file:
            self.file.close()


def _round(x: float | None) -> float | None:
    return None if x is None else round(x, 3)
