"""The training loop's prefetcher: one background thread loads the batches the loop will ask for next."""

from __future__ import annotations

import threading

import pytest

from sdpipe.train.prefetch import Prefetcher


class Recorder:
    def __init__(self, fail: int | None = None):
        self.calls, self.threads, self.fail = [], set(), fail
        self.lock = threading.Lock()

    def __call__(self, epoch: int, indices: list[int]):
        with self.lock:
            self.calls.append((epoch, tuple(indices)))
            self.threads.add(threading.current_thread().name)
        if indices and indices[0] == self.fail:
            raise OSError(f"shard for sample {self.fail} is unreadable")
        return {"epoch": epoch, "indices": list(indices)}


def test_get_returns_the_first_and_loads_the_next_ahead_on_one_other_thread():
    load = Recorder()
    plan = [(0, [i, i + 1]) for i in range(0, 10, 2)] + [(1, [3, 1])]
    with Prefetcher(load, depth=2) as prefetch:
        got = [prefetch.get(plan[i:]) for i in range(len(plan))]
    assert got == [{"epoch": e, "indices": ix} for e, ix in plan]
    assert sorted(load.calls) == sorted((e, tuple(ix)) for e, ix in plan)  # each loaded once, none twice
    assert load.calls[:3] == [(0, (0, 1)), (0, (2, 3)), (0, (4, 5))]  # the first call queued two ahead
    assert load.threads and all(name.startswith("sdpipe-prefetch") for name in load.threads)


def test_a_load_error_is_raised_in_the_caller():
    with Prefetcher(Recorder(fail=4), depth=1) as prefetch:
        assert prefetch.get([(0, [2]), (0, [4])]) == {"epoch": 0, "indices": [2]}
        with pytest.raises(OSError, match="sample 4 is unreadable"):
            prefetch.get([(0, [4])])


def test_a_batch_no_longer_wanted_is_dropped_and_an_unqueued_one_loads_on_demand():
    load = Recorder()
    with Prefetcher(load, depth=1) as prefetch:
        prefetch.get([(0, [0]), (0, [1])])
        assert prefetch.get([(0, [7])]) == {"epoch": 0, "indices": [7]}  # not the queued [1]
        assert prefetch._pending == {}
    assert (0, (7,)) in load.calls
