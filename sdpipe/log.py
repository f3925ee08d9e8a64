"""Logging and progress: rich on a terminal, plain timestamped lines in Snakemake logs and CI."""

from __future__ import annotations

import contextlib
import logging
import sys
import time
from typing import Callable, Iterator

LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"


def interactive() -> bool:
    return sys.stderr.isatty()


def setup_logging(verbose: bool = False) -> None:
    level = logging.DEBUG if verbose else logging.INFO
    if interactive():
        from rich.logging import RichHandler

        handler: logging.Handler = RichHandler(show_path=False, rich_tracebacks=False)
        logging.basicConfig(level=level, format="%(message)s", handlers=[handler], force=True)
    else:
        logging.basicConfig(level=level, format=LOG_FORMAT, stream=sys.stderr, force=True)
    for noisy in ("PIL", "urllib3", "filelock", "httpx", "httpx2", "huggingface_hub", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)`. A rich bar on a terminal; otherwise (Snakemake logs, CI) log lines with the rate and the
    time left, both measured after the first item so that loading and compiling do not distort them."""
    if total <= 0:
        yield lambda n=1: None
        return
    if interactive():
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        columns = (
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TimeRemainingColumn(),
        )
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    yield _log_lines(total, description, logging.getLogger("sdpipe.progress"))


def _log_lines(total: int, description: str, log: logging.Logger, every_s: float = 60.0) -> Callable[[int], None]:
    """`advance(n)` for logs: a line about every 10 % or every minute, and at the end. The first item's time is
    the warm-up (loading, compiling): the rate and the time left are those of the items after it."""
    start = time.perf_counter()
    state = {"done": 0, "next": max(1, total // 10), "first": None, "logged": start}

    def advance(n: int = 1) -> None:
        now = time.perf_counter()
        state["done"] += n
        if state["first"] is None:
            state["first"] = (state["done"], now)
            log.info(
                "%s: %d/%d after %.1f s (warm-up: loading, compiling)", description, state["done"], total, now - start
            )
            return
        due = state["done"] >= state["next"] or now - state["logged"] >= every_s or state["done"] == total
        if not due:
            return
        done0, t0 = state["first"]
        rate = (state["done"] - done0) / max(now - t0, 1e-9)
        left = (total - state["done"]) / rate if rate > 0 else float("inf")
        log.info(
            "%s: %d/%d (%.2f/s after warm-up, %s left)", description, state["done"], total, rate, format_seconds(left)
        )
        state["next"], state["logged"] = state["done"] + max(1, total // 10), now

    return advance


def format_seconds(seconds: float) -> str:
    """A duration for people: 42 s, 3 min 05 s, 1 h 07 min."""
    if seconds == float("inf"):
        return "unknown time"
    seconds = int(round(seconds))
    if seconds < 60:
        return f"{seconds} s"
    minutes, sec = divmod(seconds, 60)
    if minutes < 60:
        return f"{minutes} min {sec:02d} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes:02d} min"
