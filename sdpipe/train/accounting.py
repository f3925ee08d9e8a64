"""Step accounting: how many micro-steps, optimizer steps and epochs a run has, on any number of processes.

The trap this module exists for (kohya and the diffusers examples both fall into variants of it): with a fixed
per-device batch, doubling the world size doubles the global batch and so halves the optimizer steps per epoch;
and accelerate's prepared LR scheduler steps `num_processes` times per call unless told otherwise. Every count here
is computed once, from the bucket sizes, so the loop, the LR schedule and the summary agree.

Terms: W processes, per-device batch B, accumulation k. A micro-step ("global batch") is one forward/backward on
every rank: up to G = W*B samples of one bucket. An optimizer step follows every k micro-steps and the last
micro-step of an epoch.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass
from typing import cast

from sdpipe.errors import UserError
from sdpipe.records import StepPlanRecord

Bucket = tuple[int, int]


@dataclass(frozen=True)
class StepPlan:
    dataset_size: int
    buckets: dict[str, int]  # "WxH" -> samples, sorted by bucket
    world_size: int
    per_device_batch_size: int
    grad_accum_steps: int
    global_batch_size: int  # W*B*k: samples per optimizer step when every batch is full
    micro_steps_per_epoch: int
    optimizer_steps_per_epoch: int
    epochs: int
    total_optimizer_steps: int
    lr_schedule_steps: int  # the loop steps the scheduler once per optimizer step, never num_processes times
    warmup_steps: int
    samples_per_epoch: int

    @property
    def micro_batch_size(self) -> int:
        """G = W*B: samples in one full micro-step over all ranks."""
        return self.world_size * self.per_device_batch_size

    def as_dict(self) -> StepPlanRecord:
        return cast(StepPlanRecord, asdict(self))


def bucket_key(bucket: Bucket) -> str:
    return f"{bucket[0]}x{bucket[1]}"


def count_buckets(sample_buckets: list[Bucket]) -> dict[Bucket, int]:
    """Bucket -> number of samples, from the bucket of each sample (repeats already expanded)."""
    return dict(Counter((b[0], b[1]) for b in sample_buckets))


def micro_steps(bucket_sizes: dict[Bucket, int], micro_batch: int) -> int:
    """Global batches in one epoch: each bucket is chunked on its own, so each adds its own partial last batch."""
    return sum(math.ceil(n / micro_batch) for n in bucket_sizes.values() if n > 0)


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        if not isinstance(value, int) or value < 1:
            raise UserError(f"train.{name}={value!r} is not allowed; it must be an integer >= 1")


def _check_dataset(dataset_size: int, world_size: int) -> None:
    if dataset_size == 0:
        raise UserError(
            "train: the dataset is empty (0 samples); check data.raw_dir and the prepare stage's rejected list"
        )
    if world_size > dataset_size:
        raise UserError(
            f"train.num_processes={world_size} is larger than the dataset's {dataset_size} samples, "
            f"so some process would never see one; use at most {dataset_size} processes"
        )


def _total_steps(per_epoch: int, max_steps: int | None, epochs: int) -> tuple[int, int]:
    """(epochs, total optimizer steps). max_steps wins; the run then stops mid-epoch at max_steps."""
    if max_steps is not None:
        if max_steps < 1:
            raise UserError(
                f"train.max_steps={max_steps} gives zero optimizer steps; set it to at least 1 "
                "(or null to train for train.epochs)"
            )
        return math.ceil(max_steps / per_epoch), max_steps
    if epochs < 1:
        raise UserError(f"train.epochs={epochs} gives zero optimizer steps; set it to at least 1")
    return epochs, epochs * per_epoch


def plan_steps(
    bucket_sizes: dict[Bucket, int],
    world_size: int,
    per_device_batch_size: int,
    grad_accum_steps: int,
    max_steps: int | None,
    epochs: int,
    warmup_steps: int = 0,
) -> StepPlan:
    """Every step count of a run. Partial batches are allowed here; `check_batch_fits` is the stricter check."""
    _check_positive(
        num_processes=world_size, per_device_batch_size=per_device_batch_size, grad_accum_steps=grad_accum_steps
    )
    sizes = {(b[0], b[1]): n for b, n in sorted(bucket_sizes.items()) if n > 0}
    dataset_size = sum(sizes.values())
    _check_dataset(dataset_size, world_size)
    micro = micro_steps(sizes, world_size * per_device_batch_size)
    per_epoch = math.ceil(micro / grad_accum_steps)
    n_epochs, total = _total_steps(per_epoch, max_steps, epochs)
    if warmup_steps > total:
        raise UserError(
            f"train.lr_warmup_steps={warmup_steps} is longer than the run's {total} optimizer steps; "
            f"lower it to at most {total} or train longer"
        )
    return StepPlan(
        dataset_size=dataset_size,
        buckets={bucket_key(b): n for b, n in sizes.items()},
        world_size=world_size,
        per_device_batch_size=per_device_batch_size,
        grad_accum_steps=grad_accum_steps,
        global_batch_size=world_size * per_device_batch_size * grad_accum_steps,
        micro_steps_per_epoch=micro,
        optimizer_steps_per_epoch=per_epoch,
        epochs=n_epochs,
        total_optimizer_steps=total,
        lr_schedule_steps=total,
        warmup_steps=warmup_steps,
        samples_per_epoch=dataset_size,
    )


def check_batch_fits(bucket_sizes: dict[Bucket, int], world_size: int, per_device_batch_size: int) -> None:
    """Fail before launch when even the largest bucket cannot fill one global batch of W*B samples.

    Smaller buckets may still run partial batches; this only catches a batch no bucket could ever fill, which
    almost always means a typo or a config written for a bigger dataset.
    """
    sizes = {(b[0], b[1]): n for b, n in bucket_sizes.items() if n > 0}
    if not sizes:
        _check_dataset(0, world_size)
    bucket, largest = max(sorted(sizes.items()), key=lambda item: item[1])
    micro = world_size * per_device_batch_size
    if micro <= largest:
        return
    fits = largest // world_size
    fix = f"lower it to at most {fits}" if fits >= 1 else f"set it to 1 and train.num_processes to at most {largest}"
    raise UserError(
        f"train.per_device_batch_size={per_device_batch_size} x {world_size} processes = {micro} samples "
        f"per global batch, but the largest bucket {bucket_key(bucket)} holds only {largest}; {fix}"
    )


def sync_now(micro_steps_done: int, last_of_epoch: bool, grad_accum_steps: int) -> bool:
    """Whether the micro-step just finished ends an optimizer step: every k micro-steps, and at the epoch's end.

    `micro_steps_done` counts micro-steps of this epoch including the one just finished.
    """
    return last_of_epoch or micro_steps_done % grad_accum_steps == 0


def summary_block(plan: StepPlan) -> str:
    """The start-of-run summary, like the diffusers examples' "***** Running training *****" block."""
    buckets = ", ".join(f"{key}: {n}" for key, n in plan.buckets.items())
    rows = [
        ("Samples (per epoch, repeats included)", plan.samples_per_epoch),
        (f"Buckets ({len(plan.buckets)})", buckets),
        ("World size (processes)", plan.world_size),
        ("Batch size per device", plan.per_device_batch_size),
        ("Gradient accumulation steps", plan.grad_accum_steps),
        ("Global batch (W x B x k)", plan.global_batch_size),
        ("Micro-steps per epoch", plan.micro_steps_per_epoch),
        ("Optimizer steps per epoch", plan.optimizer_steps_per_epoch),
        ("Epochs", plan.epochs),
        ("Total optimizer steps", plan.total_optimizer_steps),
        ("LR schedule length (steps)", plan.lr_schedule_steps),
        ("LR warmup steps", plan.warmup_steps),
    ]
    width = max(len(name) for name, _ in rows)
    return "\n".join(["***** Running training *****"] + [f"  {name:<{width}} = {value}" for name, value in rows])
