"""sdpipe bench-bookkeeping's arithmetic: the line through the two largest sizes and its extrapolation. The runs
themselves are the benchmark's (benchmarks/results/bookkeeping-*), not a test's."""

from __future__ import annotations

import pytest

from sdpipe.bench import bookkeeping


def _row(n: int, seconds: float) -> dict:
    timing = {"s": seconds, "peak_gb": 1.0 + n / 1e6}
    return {
        "images": n,
        "first": timing,
        "noop": timing,
        "dry_run": timing,
        "dvc_add": timing,
        "dvc_noop": timing,
        "add": {**timing, "encoded": 10},
        "cache": {"files": 2 * n + 25, "bytes": 10_000 * n},
        "results": {"files": 8, "bytes": 100 * n},
    }


def test_a_linear_figure_extrapolates_exactly_and_the_table_shows_the_fit():
    rows = [_row(1000, 99.0), _row(10_000, 2.0 + 0.001 * 10_000), _row(100_000, 2.0 + 0.001 * 100_000)]
    fits = bookkeeping.extrapolate(rows)
    noop = fits["no-op `snakemake latents` s"]
    assert noop["a"] == pytest.approx(2.0) and noop["b"] == pytest.approx(0.001)  # the smallest size is left out
    assert noop["1e+06"] == pytest.approx(1002.0)
    assert fits["cache files"]["1e+07"] == pytest.approx(2 * 10**7 + 25)
    text = bookkeeping.markdown({"machine": "m", "commit": "c", "rows": rows, "fits": fits})
    assert "| cache files | 2,025 | 20,025 | 200,025 | 2e+06 | 2e+07 |" in text
    assert bookkeeping.extrapolate(rows[:1]) == {}
