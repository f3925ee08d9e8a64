"""Step accounting and bucket sampling: counts right on any world size, every sample once per epoch, exact resume."""

from __future__ import annotations

import json
import random

import pytest

from sdpipe.errors import UserError
from sdpipe.train.accounting import StepPlan, check_batch_fits, count_buckets, plan_steps, summary_block, sync_now
from sdpipe.train.sampler import BucketSampler, SamplerState, epoch_plan, rank_slice

UNEVEN = {(512, 512): 10, (640, 384): 7, (384, 640): 3}


def plan(sizes=None, w=1, b=4, k=1, max_steps=None, epochs=1, warmup=0) -> StepPlan:
    return plan_steps({(64, 64): 100} if sizes is None else sizes, w, b, k, max_steps, epochs, warmup)


def sample_buckets(sizes: dict) -> list[tuple[int, int]]:
    """One bucket per sample index, interleaved so a bucket's indices are not contiguous."""
    out = [bucket for bucket, n in sizes.items() for _ in range(n)]
    random.Random(0).shuffle(out)
    return out


# ---- accounting ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "w, b, k, micro, opt",
    [
        (1, 4, 1, 25, 25),  # 100 / 4
        (2, 4, 1, 13, 13),  # ceil(100 / 8): the last global batch holds 4
        (2, 4, 4, 13, 4),  # ceil(13 / 4): the epoch's last optimizer step has one micro-step
        (3, 2, 1, 17, 17),  # ceil(100 / 6)
        (8, 4, 1, 4, 4),  # ceil(100 / 32)
        (8, 1, 4, 13, 4),
    ],
)
def test_single_bucket_counts(w, b, k, micro, opt):
    p = plan(w=w, b=b, k=k, epochs=3)
    assert (p.micro_steps_per_epoch, p.optimizer_steps_per_epoch) == (micro, opt)
    assert p.global_batch_size == w * b * k and p.micro_batch_size == w * b
    assert p.total_optimizer_steps == p.lr_schedule_steps == 3 * opt and p.epochs == 3
    assert p.samples_per_epoch == p.dataset_size == 100


@pytest.mark.parametrize(
    "w, b, k, micro, opt",
    [
        (1, 4, 1, 3 + 2 + 1, 6),
        (2, 2, 1, 3 + 2 + 1, 6),  # same G = 4 as 1 x 4
        (3, 2, 4, 2 + 2 + 1, 2),  # G = 6: 10 -> 6+4, 7 -> 6+1, 3 -> 3
        (8, 1, 1, 2 + 1 + 1, 4),  # G = 8
        (8, 1, 4, 4, 1),
    ],
)
def test_uneven_bucket_counts(w, b, k, micro, opt):
    p = plan(UNEVEN, w=w, b=b, k=k, epochs=2)
    assert (p.micro_steps_per_epoch, p.optimizer_steps_per_epoch, p.total_optimizer_steps) == (micro, opt, 2 * opt)
    assert p.buckets == {"384x640": 3, "512x512": 10, "640x384": 7} and p.dataset_size == 20


def test_max_steps_wins_over_epochs_and_stops_mid_epoch():
    p = plan(max_steps=60, epochs=99)  # 25 steps per epoch
    assert (p.epochs, p.total_optimizer_steps, p.lr_schedule_steps) == (3, 60, 60)
    assert plan(max_steps=25).epochs == 1 and plan(max_steps=26).epochs == 2


def test_doubling_world_size_halves_steps_per_epoch():
    """The known trap: with a fixed per-device batch, more GPUs mean a bigger global batch and fewer steps."""
    steps = {w: plan({(64, 64): 64}, w=w, b=4).optimizer_steps_per_epoch for w in (1, 2, 4, 8)}
    assert steps == {1: 16, 2: 8, 4: 4, 8: 2}


def test_two_ranks_times_b_equals_one_rank_times_2b():
    for k in (1, 4):
        two, one = plan(UNEVEN, w=2, b=3, k=k, epochs=5), plan(UNEVEN, w=1, b=6, k=k, epochs=5)
        keys = (
            "micro_steps_per_epoch",
            "optimizer_steps_per_epoch",
            "total_optimizer_steps",
            "lr_schedule_steps",
            "global_batch_size",
        )
        assert {key: getattr(two, key) for key in keys} == {key: getattr(one, key) for key in keys}
    buckets = sample_buckets(UNEVEN)
    for epoch in range(3):
        state = SamplerState(epoch=epoch)
        two_ranks = [BucketSampler(buckets, 7, 2, 3, r) for r in range(2)]
        merged = [a + b for (a, *_), (b, *_) in zip(*(s.batches(state) for s in two_ranks))]
        single = [idx for idx, *_ in BucketSampler(buckets, 7, 1, 6, 0).batches(state)]
        assert merged == single and len(single) == two.micro_steps_per_epoch


def test_as_dict_and_summary_block():
    p = plan(UNEVEN, w=2, b=2, k=4, epochs=3, warmup=1)
    assert json.loads(json.dumps(p.as_dict()))["total_optimizer_steps"] == 6
    text = summary_block(p)
    for needle in (
        "Running training",
        "384x640: 3",
        "World size",
        "Global batch",
        "Micro-steps per epoch",
        "Total optimizer steps",
        "LR schedule length",
        "LR warmup steps",
    ):
        assert needle in text


def test_count_buckets_and_sync_now():
    assert count_buckets([(8, 8), (8, 16), (8, 8)]) == {(8, 8): 2, (8, 16): 1}
    synced = [sync_now(i, i == 10, 4) for i in range(1, 11)]
    assert [i for i, s in zip(range(1, 11), synced) if s] == [4, 8, 10]


@pytest.mark.parametrize(
    "call, setting",
    [
        (lambda: plan({}), "dataset is empty"),
        (lambda: plan({(64, 64): 0}), "dataset is empty"),
        (lambda: plan(epochs=0), "train.epochs=0"),
        (lambda: plan(max_steps=0), "train.max_steps=0"),
        (lambda: plan(epochs=2, warmup=51), "train.lr_warmup_steps=51"),  # 2 x 25 = 50 steps
        (lambda: plan({(64, 64): 3}, w=4, b=1), "train.num_processes=4"),
        (lambda: plan(b=0), "train.per_device_batch_size=0"),
        (lambda: plan(k=0), "train.grad_accum_steps=0"),
        (lambda: check_batch_fits(UNEVEN, 2, 6), "train.per_device_batch_size=6"),
        (lambda: check_batch_fits(UNEVEN, 11, 1), "train.per_device_batch_size=1"),
        (lambda: check_batch_fits({}, 1, 1), "dataset is empty"),
    ],
)
def test_errors_are_one_line_user_errors(call, setting):
    with pytest.raises(UserError) as err:
        call()
    assert setting in str(err.value) and "\n" not in str(err.value)


def test_batch_fit_message_names_the_bucket_and_the_fix():
    with pytest.raises(UserError, match=r"largest bucket 512x512 holds only 10; lower it to at most 5"):
        check_batch_fits(UNEVEN, 2, 6)
    check_batch_fits(UNEVEN, 2, 5)  # 10 fills exactly one global batch: fine, smaller buckets run partial batches
    assert plan(UNEVEN, w=2, b=6).micro_steps_per_epoch == 3  # plan_steps itself allows partial batches


# ---- sampler ------------------------------------------------------------------------------------------------


def test_rank_slice_is_array_split():
    batch = [9, 3, 5, 1, 7]
    assert [rank_slice(batch, r, 3) for r in range(3)] == [[9, 3], [5, 1], [7]]
    assert [rank_slice([4], r, 3) for r in range(3)] == [[4], [], []]  # a rank may get nothing
    for n in range(12):
        for w in (1, 2, 3, 8):
            slices = [rank_slice(list(range(n)), r, w) for r in range(w)]
            assert sum(slices, []) == list(range(n)) and max(map(len, slices)) - min(map(len, slices)) <= 1


def test_every_index_once_per_epoch_random_configs():
    rng = random.Random(1)
    for _ in range(200):
        shapes = [(64 + 8 * i, 64) for i in range(rng.randint(1, 5))]
        buckets = [rng.choice(shapes) for _ in range(rng.randint(1, 60))]
        g = rng.randint(1, 16)
        available = {i for i in range(len(buckets)) if rng.random() < 0.7} if rng.random() < 0.5 else None
        batches = epoch_plan(buckets, rng.randint(0, 5), rng.randint(0, 2**40), g, available)
        flat = sum(batches, [])
        assert sorted(flat) == sorted(available if available is not None else range(len(buckets)))
        assert all(1 <= len(b) <= g and len({buckets[i] for i in b}) == 1 for b in batches)
        per_bucket = count_buckets([buckets[i] for i in flat])
        assert len(batches) == sum(-(-n // g) for n in per_bucket.values())  # ceil per bucket, as accounting says


def test_plan_is_deterministic_per_seed_and_epoch():
    buckets = sample_buckets(UNEVEN)
    assert epoch_plan(buckets, 3, 11, 4) == epoch_plan(list(buckets), 3, 11, 4)
    assert epoch_plan(buckets, 3, 11, 4) != epoch_plan(buckets, 4, 11, 4)
    assert epoch_plan(buckets, 3, 11, 4) != epoch_plan(buckets, 3, 12, 4)
    # The available set's iteration order does not matter.
    assert epoch_plan(buckets, 0, 1, 4, set(range(20))) == epoch_plan(buckets, 0, 1, 4, set(reversed(range(20))))


def test_ranks_cover_each_global_batch():
    buckets = sample_buckets(UNEVEN)
    ranks = [BucketSampler(buckets, 5, 3, 2, r) for r in range(3)]
    expected = epoch_plan(buckets, 0, 5, 6)
    steps = list(zip(*(s.batches(SamplerState()) for s in ranks)))
    assert len(steps) == len(expected)
    for chunk, per_rank in zip(expected, steps):
        assert sum((idx for idx, _, _ in per_rank), []) == chunk
        assert {n for _, n, _ in per_rank} == {len(chunk)}
    assert [last for _, _, last in (step[0] for step in steps)] == [False] * (len(steps) - 1) + [True]


def consume(sampler: BucketSampler, state: SamplerState, count: int) -> tuple[SamplerState, list[list[int]]]:
    """Run `count` global batches as a single-rank loop would; returns the new state and the batches."""
    taken = []
    while len(taken) < count:
        for _idx, n, _ in sampler.batches(state):
            taken.append(sampler.remaining(state)[0])
            state = sampler.advance(state, n)
            if len(taken) == count:
                break
    return state, taken


def checkpoint(state: SamplerState) -> SamplerState:
    return SamplerState.from_dict(json.loads(json.dumps(state.to_dict())))


def test_advance_rolls_over_and_counts_samples():
    sampler = BucketSampler(sample_buckets(UNEVEN), 0, 1, 4, 0)
    state, taken = consume(sampler, SamplerState(), 6)  # one whole epoch
    assert sorted(sum(taken, [])) == list(range(20))
    assert (state.epoch, state.batches_done, state.seen, state.samples_seen_total) == (1, 0, [], 20)
    with pytest.raises(ValueError):
        sampler.advance(state, 999)  # a loop out of step with the plan fails loudly


def test_resume_same_world_size_continues_exactly():
    buckets = sample_buckets(UNEVEN)
    sampler = BucketSampler(buckets, 3, 2, 2, 0)
    _, straight = consume(sampler, SamplerState(), 15)  # two and a half epochs
    for cut in (1, 4, 6, 9):
        state, first = consume(sampler, SamplerState(), cut)
        fresh = BucketSampler(buckets, 3, 2, 2, 0)  # a new process after the restart
        _, rest = consume(fresh, checkpoint(state), 15 - cut)
        assert first + rest == straight


@pytest.mark.parametrize("old_w, new_w, batch, cut", [(2, 1, 2, 2), (1, 3, 2, 3), (2, 1, 3, 1), (1, 3, 1, 7)])
def test_resume_on_another_world_size_covers_the_rest_once(old_w, new_w, batch, cut):
    buckets = sample_buckets(UNEVEN)
    state, first = consume(BucketSampler(buckets, 9, old_w, batch, 0), SamplerState(), cut)
    state = checkpoint(state)
    resumed = [BucketSampler(buckets, 9, new_w, batch, r) for r in range(new_w)]
    rest = resumed[0].remaining(state)
    per_rank = [[idx for idx, _, _ in s.batches(state)] for s in resumed]
    assert [sum(step, []) for step in zip(*per_rank)] == rest  # the ranks still split the same global batches
    assert all(len(b) <= new_w * batch for b in rest)
    assert sorted(sum(first + rest, [])) == list(range(20))  # nothing replayed, nothing skipped
    end, _ = consume(resumed[0], state, len(rest))
    assert (end.epoch, end.samples_seen_total) == (1, 20)
    assert sorted(sum(resumed[0].remaining(end), [])) == list(range(20))  # the next epoch is whole again


def test_resume_twice_after_a_world_size_change_is_exact():
    """After re-planning on a new world size, a second restart on that size continues the re-planned order."""
    buckets = sample_buckets(UNEVEN)
    state, _ = consume(BucketSampler(buckets, 4, 2, 2, 0), SamplerState(), 2)
    one = BucketSampler(buckets, 4, 1, 2, 0)
    _, straight = consume(one, checkpoint(state), 8)
    mid, first = consume(one, checkpoint(state), 3)
    _, rest = consume(BucketSampler(buckets, 4, 1, 2, 0), checkpoint(mid), 5)
    assert first + rest == straight


@pytest.mark.parametrize("w, b, cut", [(1, 4, 0), (2, 2, 4), (1, 3, 5)])
def test_upcoming_is_what_advance_will_yield_across_epochs(w, b, cut):
    """The prefetcher loads `upcoming` ahead: it must be the plan's next batches, into the following epochs."""
    sampler = BucketSampler(sample_buckets(UNEVEN), 7, w, b, 0)
    state, _ = consume(sampler, SamplerState(), cut)
    expected, probe = [], state
    for _ in range(14):  # more than two epochs of 6-7 global batches
        epoch = sampler.resume(probe).epoch
        chunk = sampler.remaining(probe)[0]
        expected.append((epoch, chunk))
        probe = sampler.advance(probe, chunk)
    assert sampler.upcoming(state, 14) == expected
    assert sampler.upcoming(state, 1) == expected[:1]


def test_upcoming_continues_a_replanned_epoch():
    """After a resume on another world size the current epoch's plan excludes what was seen; later ones are whole."""
    buckets = sample_buckets(UNEVEN)
    state, _ = consume(BucketSampler(buckets, 4, 2, 2, 0), SamplerState(), 2)
    one = BucketSampler(buckets, 4, 1, 2, 0)
    state = one.resume(checkpoint(state))
    rest = one.remaining(state)
    ahead = one.upcoming(state, len(rest) + 3)
    assert ahead[: len(rest)] == [(state.epoch, c) for c in rest]
    assert ahead[len(rest) :] == [(state.epoch + 1, c) for c in epoch_plan(buckets, state.epoch + 1, 4, 2)[:3]]
