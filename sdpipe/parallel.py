"""Spread independent work over devices with one plain process per device.

Caching latents or captions is embarrassingly parallel, so no torch.distributed process group is opened: nothing
can hit an NCCL timeout however long one device takes. Each worker writes its results to a content-addressed
cache as it goes, so a crash loses only the items in flight.
"""

from __future__ import annotations

import os
import queue as queue_lib
import shutil
import subprocess
import traceback
from typing import Any, Callable, Sequence

from sdpipe.errors import UserError
from sdpipe.log import progress

# A worker is called as worker(device, items, report, **kwargs) and returns a JSON-able result.
Worker = Callable[..., Any]


def detect_gpu_count() -> int:
    """GPUs visible to this process, without importing torch (the Snakefile calls this at parse time)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return len([d for d in visible.split(",") if d.strip() and d.strip() != "-1"])
    if shutil.which("nvidia-smi") is None:
        return 0
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, timeout=30, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return 0
    return sum(1 for line in out.splitlines() if line.startswith("GPU "))


def resolve_gpus(gpus: int | str) -> int:
    return detect_gpu_count() if gpus == "auto" else int(gpus)


def devices_for(gpus: int, cpu_processes: int = 1) -> list[str]:
    """Exactly `gpus` CUDA devices (the first ones visible), or `cpu_processes` CPU workers when gpus is 0."""
    if gpus <= 0:
        return ["cpu"] * max(1, cpu_processes)
    import torch

    available = torch.cuda.device_count()
    if gpus > available:
        raise UserError(f"{gpus} GPUs requested but {available} visible; lower the stage's gpus setting")
    return [f"cuda:{i}" for i in range(gpus)]


def split(items: Sequence, parts: int) -> list[list]:
    """Deal items round-robin, so every part gets a similar mix (of buckets, of image sizes)."""
    return [list(items[i::parts]) for i in range(parts)]


def _entry(worker: Worker, index: int, device: str, items: list, threads: int, q, kwargs: dict) -> None:
    try:
        import torch

        torch.set_num_threads(threads)
        result = worker(device, items, lambda n=1: q.put(("progress", index, n)), **kwargs)
        q.put(("done", index, result))
    except UserError as exc:  # stays one line in the parent, like in a single process
        q.put(("user_error", index, str(exc)))
    except BaseException:  # noqa: BLE001 - the parent re-raises with this text
        q.put(("error", index, traceback.format_exc()))


def run_sharded(worker: Worker, items: Sequence, devices: list[str], description: str, **kwargs) -> list[Any]:
    """Run `worker` over `items` split across `devices`; return each worker's result, in device order."""
    with progress(len(items), description) as advance:
        if len(devices) == 1:
            return [worker(devices[0], list(items), advance, **kwargs)]
        return _run_processes(worker, split(items, len(devices)), devices, advance, kwargs)


def _run_processes(worker: Worker, parts: list[list], devices: list[str], advance, kwargs: dict) -> list[Any]:
    import multiprocessing as mp

    ctx = mp.get_context("spawn")  # CUDA cannot be used in a forked child
    q = ctx.Queue()
    threads = max(1, (os.cpu_count() or 1) // len(devices))
    procs = [
        ctx.Process(target=_entry, args=(worker, i, dev, part, threads, q, kwargs), daemon=True)
        for i, (dev, part) in enumerate(zip(devices, parts))
    ]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    try:
        while len(results) < len(procs):
            try:
                kind, index, payload = q.get(timeout=1.0)
            except queue_lib.Empty:
                _check_alive(procs, results, devices)
                continue
            if kind == "progress":
                advance(payload)
            elif kind == "done":
                results[index] = payload
            elif kind == "user_error":
                raise UserError(payload)
            else:
                raise RuntimeError(f"worker on {devices[index]} failed:\n{payload}")
    finally:
        for p in procs:
            if p.is_alive() and len(results) < len(procs):
                p.terminate()
            p.join()
    return [results[i] for i in range(len(procs))]


def _check_alive(procs, results: dict, devices: list[str]) -> None:
    for i, p in enumerate(procs):
        if i not in results and not p.is_alive() and p.exitcode not in (None, 0):
            raise RuntimeError(f"worker on {devices[i]} died with exit code {p.exitcode}")
