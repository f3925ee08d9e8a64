"""Deterministic bucket batching, sharded over ranks, resumable on the same or another world size.

Every rank builds the same plan from the same inputs (no communication): each bucket's indices are shuffled by a
generator seeded from (seed, epoch, bucket), chunked into global batches of G = W*B, and the chunks are shuffled by
a generator seeded from (seed, epoch). The plan depends on G only, never on W or B alone, so 2 processes x batch b
and 1 process x batch 2b see the same samples in the same order; rank r takes the r-th even slice of each chunk.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

Bucket = tuple[int, int]
_BUCKET_STREAM, _ORDER_STREAM = 1, 2  # keep the two shuffles' random streams apart


def _rng(*key: int) -> np.random.Generator:
    """A generator from integers only: identical on every machine, whatever the dict or set order."""
    return np.random.default_rng([k % 2**63 for k in key])


def _by_bucket(buckets: Sequence[Bucket], available: set[int] | None) -> dict[Bucket, list[int]]:
    groups: dict[Bucket, list[int]] = {}
    for index, bucket in enumerate(buckets):
        if available is None or index in available:
            groups.setdefault((int(bucket[0]), int(bucket[1])), []).append(index)
    return groups


def epoch_plan(
    buckets: Sequence[Bucket], epoch: int, seed: int, global_batch: int, available: set[int] | None = None
) -> list[list[int]]:
    """The epoch's global batches; each available index exactly once, each batch from one bucket."""
    if global_batch < 1:
        raise ValueError(f"global_batch must be >= 1, got {global_batch}")
    chunks: list[list[int]] = []
    for (w, h), indices in sorted(_by_bucket(buckets, available).items()):
        order = _rng(seed, epoch, _BUCKET_STREAM, w, h).permutation(len(indices))
        shuffled = [indices[i] for i in order]
        chunks += [shuffled[i : i + global_batch] for i in range(0, len(shuffled), global_batch)]
    order = _rng(seed, epoch, _ORDER_STREAM).permutation(len(chunks))
    return [chunks[i] for i in order]


def rank_slice(global_batch: Sequence[int], rank: int, world_size: int) -> list[int]:
    """Rank r's share, np.array_split style: the first len % W ranks get one extra; a rank may get none."""
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} is outside world size {world_size}")
    size, extra = divmod(len(global_batch), world_size)
    start = rank * size + min(rank, extra)
    return list(global_batch[start : start + size + (rank < extra)])


def _check_consumed(consumed: int | Sequence[int] | None, chunk: list[int]) -> None:
    """A loop that drifted out of step with the sampler would silently train on the wrong samples: fail loudly."""
    if consumed is None:
        return
    ok = consumed == len(chunk) if isinstance(consumed, int) else list(consumed) == chunk
    if not ok:
        raise ValueError(f"advance: the loop consumed {consumed} but the plan's next global batch is {chunk}")


@dataclass
class SamplerState:
    """Where the sampler stands; saved in checkpoints as JSON.

    `plan_excluded` is the set of indices left out when the current epoch plan was made: empty for a fresh epoch,
    `seen` at the moment of a resume on another world size. With it, the plan can be rebuilt exactly.
    """

    epoch: int = 0
    batches_done: int = 0  # global batches consumed from the current plan
    global_batch: int = 0  # the G the current plan was made with (0 = none yet)
    seen: list[int] = field(default_factory=list)  # sorted indices consumed this epoch
    samples_seen_total: int = 0
    plan_excluded: list[int] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batches_done": self.batches_done,
            "global_batch": self.global_batch,
            "seen": list(self.seen),
            "samples_seen_total": self.samples_seen_total,
            "plan_excluded": list(self.plan_excluded),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SamplerState:
        return cls(
            epoch=int(data["epoch"]),
            batches_done=int(data["batches_done"]),
            global_batch=int(data["global_batch"]),
            seen=sorted(int(i) for i in data["seen"]),
            samples_seen_total=int(data["samples_seen_total"]),
            plan_excluded=sorted(int(i) for i in data.get("plan_excluded", [])),
        )


class BucketSampler:
    """This rank's view of the deterministic plan. The state is passed in and returned, never hidden inside."""

    def __init__(
        self, buckets: Sequence[Bucket], seed: int, world_size: int, per_device_batch_size: int, rank: int
    ) -> None:
        if not buckets:
            raise ValueError("BucketSampler needs at least one sample")
        self.buckets = [(int(w), int(h)) for w, h in buckets]
        self.seed, self.world_size, self.rank = seed, world_size, rank
        self.global_batch = world_size * per_device_batch_size
        self._cache: tuple[tuple[int, tuple[int, ...]], list[list[int]]] | None = None
        self._next: tuple[int, list[list[int]]] | None = None  # a later epoch's full plan, for `upcoming`

    def _plan(self, state: SamplerState) -> list[list[int]]:
        """The state's epoch plan (cached: the loop asks for it every micro-step)."""
        key = (state.epoch, tuple(state.plan_excluded))
        if self._cache is None or self._cache[0] != key:
            available = set(range(len(self.buckets))) - set(state.plan_excluded) if state.plan_excluded else None
            self._cache = (key, epoch_plan(self.buckets, state.epoch, self.seed, self.global_batch, available))
        return self._cache[1]

    def resume(self, state: SamplerState) -> SamplerState:
        """The state in this sampler's terms: same G continues the plan exactly; another G re-plans the rest."""
        if state.global_batch != self.global_batch:
            # Resumed on another world size or batch: the old plan's chunks no longer fit, so plan again from the
            # samples this epoch has not yet seen; none is replayed or skipped.
            state = replace(state, batches_done=0, global_batch=self.global_batch, plan_excluded=sorted(state.seen))
        if state.batches_done >= len(self._plan(state)):  # nothing left in this epoch
            state = replace(state, epoch=state.epoch + 1, batches_done=0, seen=[], plan_excluded=[])
        return state

    def remaining(self, state: SamplerState) -> list[list[int]]:
        """The global batches still to come in the state's epoch (after `resume`)."""
        state = self.resume(state)
        return self._plan(state)[state.batches_done :]

    def upcoming(self, state: SamplerState, n: int) -> list[tuple[int, list[int]]]:
        """The next n global batches from `state` on, as (epoch, batch), running into later epochs as `advance`
        would: what a prefetcher loads ahead."""
        state = self.resume(state)
        out = [(state.epoch, chunk) for chunk in self._plan(state)[state.batches_done : state.batches_done + n]]
        epoch = state.epoch
        while len(out) < n:
            epoch += 1
            if self._next is None or self._next[0] != epoch:
                self._next = (epoch, epoch_plan(self.buckets, epoch, self.seed, self.global_batch))
            out += [(epoch, chunk) for chunk in self._next[1][: n - len(out)]]
        return out

    def batches(self, state: SamplerState) -> Iterator[tuple[list[int], int, bool]]:
        """(this rank's indices, real samples over all ranks, last micro-step of the epoch), to the epoch's end."""
        rest = self.remaining(state)
        for i, chunk in enumerate(rest):
            yield rank_slice(chunk, self.rank, self.world_size), len(chunk), i == len(rest) - 1

    def advance(self, state: SamplerState, global_batch: int | Sequence[int] | None = None) -> SamplerState:
        """The state after one more global batch; the epoch after the last one starts the next epoch.

        `global_batch` (its size, or its indices) is optional and only checked against the plan, to catch a loop
        that drifted out of step with the sampler.
        """
        state = self.resume(state)
        chunk = self._plan(state)[state.batches_done]
        _check_consumed(global_batch, chunk)
        state = replace(
            state,
            batches_done=state.batches_done + 1,
            seen=sorted(state.seen + chunk),
            samples_seen_total=state.samples_seen_total + len(chunk),
        )
        if state.batches_done == len(self._plan(state)):
            state = replace(state, epoch=state.epoch + 1, batches_done=0, seen=[], plan_excluded=[])
        return state
