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
    for noisy in ("PIL", "urllib3", "filelock", "httpx", "huggingface_hub", "diffusers", "transformers"):
        logging.getLogger(noisy).setLevel(logging.WARNING)


@contextlib.contextmanager
def progress(total: int, description: str) -> Iterator[Callable[[int], None]]:
    """Yield `advance(n)`. A rich bar on a terminal; otherwise a log line about every 10% and at the end."""
    log = logging.getLogger("sdpipe.progress")
    if total <= 0:
        yield lambda n=1: None
        return
    if interactive():
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
        from rich.progress import TimeRemainingColumn

        columns = (TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                   TimeRemainingColumn())
        with Progress(*columns, transient=False) as bar:
            task = bar.add_task(description, total=total)
            yield lambda n=1: bar.advance(task, n)
        return
    state = {"done": 0, "next": max(1, total // 10)}
    start = time.perf_counter()

    def advance(n: int = 1) -> None:
        state["done"] += n
        if state["done"] >= state["next"] or state["done"] == total:
            rate = state["done"] / max(time.perf_counter() - start, 1e-9)
            log.info("%s: %d/%d (%.1f/s)", description, state["done"], total, rate)
            state["next"] = state["done"] + max(1, total // 10)

    yield advance
