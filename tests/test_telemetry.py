"""The training log's data wait: what the device waited for batches, not what the host spent loading them."""

from __future__ import annotations

import time
from types import SimpleNamespace

import torch

from sdpipe.train.telemetry import Telemetry


def telemetry_on(device: str) -> Telemetry:
    """A Telemetry for a single non-logging process on `device` (no metrics file)."""
    accelerator = SimpleNamespace(is_main_process=False, num_processes=1, device=torch.device(device),
                                  reduce=lambda t, op: t)
    run = SimpleNamespace(accelerator=accelerator, cfg=SimpleNamespace(train=SimpleNamespace(log_every=1)),
                          plan=SimpleNamespace(total_optimizer_steps=1))
    return Telemetry(run)


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
    run = SimpleNamespace(telemetry=SimpleNamespace(alloc_retries=lambda: 7), step=40,
                          accelerator=SimpleNamespace(is_main_process=True))
    with caplog.at_level("WARNING", logger="sdpipe.train"):
        loop.warn_about_alloc_retries(run)
        assert "7 times in 40 optimizer steps" in caplog.text and "expandable_segments:True" in caplog.text
        caplog.clear()
        for none in (0, None):
            run.telemetry.alloc_retries = lambda: none
            loop.warn_about_alloc_retries(run)
        assert not caplog.records
