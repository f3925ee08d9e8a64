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
