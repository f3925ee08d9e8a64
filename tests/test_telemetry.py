"""The training log's data wait (what the device waited for batches, not what the host spent loading them) and its
rates: steady and warm-up apart, validation and checkpoints in neither."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from sdpipe.train.telemetry import Telemetry


def fake_run(device: str, log_every: int = 1, total: int = 1) -> SimpleNamespace:
    accelerator = SimpleNamespace(
        is_main_process=False,
        num_processes=1,
        device=torch.device(device),
        reduce=lambda t, op: t,
        log=lambda row, step: None,
    )
    return SimpleNamespace(
        accelerator=accelerator,
        cfg=SimpleNamespace(train=SimpleNamespace(log_every=log_every)),
        plan=SimpleNamespace(total_optimizer_steps=total),
        step=0,
        state=SimpleNamespace(epoch=0, samples_seen_total=0),
        lr_scheduler=SimpleNamespace(get_last_lr=lambda: [1e-4]),
    )


def telemetry_on(device: str) -> Telemetry:
    """A Telemetry for a single non-logging process on `device` (no metrics file)."""
    return Telemetry(fake_run(device), time.time())


def test_steady_rate_leaves_out_the_first_window_validation_and_checkpoints():
    """Step 1 takes 0.4 s (a compile), every other step 0.02 s; a 0.3 s checkpoint falls in the second window.
    The steady rate is that of the plain steps, the warm-up is step 1's extra time."""
    started = time.time() - 1.0  # the stage started a second before the loop (imports, loading)
    run = fake_run("cpu", log_every=4, total=12)
    telemetry = Telemetry(run, started)
    for step in range(1, 13):
        time.sleep(0.4 if step == 1 else 0.02)
        run.step = step
        telemetry.step(run, torch.tensor(1.0), 8, 8)
        if step == 6:
            with telemetry.paused():
                time.sleep(0.3)
    rates = telemetry.rates()
    assert 8 / 0.02 * 0.7 < rates["samples_per_s"] <= 8 / 0.02, rates  # sleep overshoots a little, never less
    assert 0.3 < rates["warmup_s"] < 0.5, rates
    assert 1.4 <= rates["time_to_first_step_s"] < 1.7, rates  # rounded to 0.1 s
    assert 0.3 <= rates["validation_and_checkpoint_s"] < 0.4
    assert rates["steady_steps_samples"] == 8 * 8  # the two windows after the first


def test_a_run_of_one_window_reports_the_steps_after_the_first_as_steady():
    run = fake_run("cpu", log_every=10, total=5)
    telemetry = Telemetry(run, time.time())
    for step in range(1, 6):
        time.sleep(0.3 if step == 1 else 0.02)
        run.step = step
        telemetry.step(run, torch.tensor(1.0), 4, 4)
    rates = telemetry.rates()
    assert rates["steady_steps_samples"] == 16 and 4 / 0.02 * 0.7 < rates["samples_per_s"] <= 4 / 0.02, rates
    assert 0.25 < rates["warmup_s"] < 0.4


def test_on_a_cpu_the_host_time_spent_loading_is_the_wait():
    telemetry = telemetry_on("cpu")
    with telemetry.loading():
        time.sleep(0.05)
    with telemetry.loading():
        pass
    assert 0.05 <= telemetry.data_wait(1.0) < 0.5
    assert telemetry.data_wait(0.01) == 1.0  # a share, never more than the whole window


def test_allocator_retries_are_reported_with_what_avoids_them(caplog):
    from sdpipe.train import loop

    assert telemetry_on("cpu").alloc_retries() is None  # no CUDA allocator on a CPU
    run = SimpleNamespace(
        telemetry=SimpleNamespace(alloc_retries=lambda: 7), step=40, accelerator=SimpleNamespace(is_main_process=True)
    )
    with caplog.at_level("WARNING", logger="sdpipe.train"):
        loop.warn_about_alloc_retries(run)
        assert "7 times in 40 optimizer steps" in caplog.text and "expandable_segments:True" in caplog.text
        caplog.clear()
        for none in (0, None):
            run.telemetry.alloc_retries = lambda none=none: none
            loop.warn_about_alloc_retries(run)
        assert not caplog.records


def test_progress_lines_give_the_rate_and_time_left_after_the_warm_up(caplog):
    """The line a Snakemake log shows: the first item (a compile) is the warm-up, the rest gives rate and ETA."""
    import logging

    from sdpipe.log import _log_lines, format_seconds

    advance = _log_lines(10, "training", logging.getLogger("sdpipe.progress"))
    with caplog.at_level("INFO", logger="sdpipe.progress"):
        time.sleep(0.3)
        advance(1)
        for _ in range(9):
            time.sleep(0.02)
            advance(1)
    lines = [r.getMessage() for r in caplog.records]
    assert lines[0].startswith("training: 1/10 after 0.3") and "warm-up" in lines[0]
    assert lines[-1].startswith("training: 10/10") and "0 s left" in lines[-1]
    rate = float(lines[1].split("(")[1].split("/s")[0])
    assert 30 < rate <= 50, lines  # 0.02 s an item after the first, not 10 items over 0.5 s
    assert [format_seconds(s) for s in (42, 185, 4020)] == ["42 s", "3 min 05 s", "1 h 07 min"]


def test_a_resume_keeps_or_mends_the_metrics_header(tmp_path):
    """Issue 26, item 5: a checkpoint saved before the first row carries a metrics.csv without its header; the
    resumed run appended to it and the report could never read the file again."""
    import csv

    from sdpipe.train.telemetry import COLUMNS, open_metrics

    row = dict.fromkeys(COLUMNS, 1)
    for before in ["", "2,0,0.5,1e-4,3,3,0,0,8\r\n", ",".join(COLUMNS) + "\r\n2,0,0.5,1e-4,3,3,0,0,8\r\n"]:
        path = tmp_path / "metrics.csv"
        path.write_text(before)
        with open_metrics(path, resume=True) as f:
            csv.DictWriter(f, COLUMNS).writerow(row)
        rows = list(csv.DictReader(path.open(newline="")))
        assert list(rows[0]) == COLUMNS and len(rows) == (1 if not before else 2)
        assert rows[-1]["step"] == "1"
    with open_metrics(path, resume=False):  # a fresh run starts the file over
        pass
    assert path.read_bytes().decode() == ",".join(COLUMNS) + "\r\n"
