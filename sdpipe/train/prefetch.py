"""Load the next micro-steps' batches on a background thread while the host launches the current step.

On a GPU the host cannot run far ahead of the device: CUDA's launch queue holds about a thousand kernels and a
compiled SD step launches several thousand, so the host blocks in launches until the GPU is near the end of the
step. A batch loaded on the host thread after that (about 31 ms for 128 SD 1.5 samples) is time the GPU may sit
idle, and after every synchronising log line it idles for the whole load (benchmarks/NOTES.md v9). Here one
thread reads, draws and pins the upcoming batches meanwhile (the torch calls that do most of it release the GIL).
The batches are the ones the loop would have loaded itself: keys are (epoch, indices), and every draw comes from
per-sample generators, so what is trained does not change.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

Key = tuple[int, tuple[int, ...]]


class Prefetcher:
    """`get(wanted)` returns the batch of wanted[0] and keeps the next `depth` of `wanted` loading.

    One worker thread does every load, so the data reader is never used from two threads at once.
    """

    def __init__(self, load: Callable[[int, list[int]], Any], depth: int = 2):
        self._load, self.depth = load, depth
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="sdpipe-prefetch")
        self._pending: dict[Key, Future] = {}

    def get(self, wanted: Sequence[tuple[int, Sequence[int]]]):
        keys = [(int(epoch), tuple(indices)) for epoch, indices in wanted[: self.depth + 1]]
        for key in [k for k in self._pending if k not in keys]:  # the plan moved on (it does not in training)
            self._pending.pop(key).cancel()
        for key in keys:
            if key not in self._pending:
                self._pending[key] = self._pool.submit(self._load, key[0], list(key[1]))
        return self._pending.pop(keys[0]).result()  # a load's error is raised here, in the training thread

    def close(self) -> None:
        for future in self._pending.values():
            future.cancel()
        self._pending.clear()
        self._pool.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> Prefetcher:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
