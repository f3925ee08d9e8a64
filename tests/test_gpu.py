"""GPU checks (skipped without CUDA): latent caching on every visible GPU matches the CPU result."""

from __future__ import annotations

import pytest
import torch

from sdpipe import io
from sdpipe.cache_store import ShardStore
from tests.test_latents import make_inputs, run_stage

pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("compile_mode", ["auto", "compiled"])  # 16 images: auto runs eager
def test_latents_on_all_gpus_match_cpu(tmp_path, tiny_model, compile_mode):
    """The compiled encoder (channel-statistics GroupNorm, plain-bmm mid-block attention) computes what eager does."""
    raw, _, _ = make_inputs(tmp_path, 16)
    cpu = run_stage(tmp_path, raw, tiny_model, out="cpu", gpus=0)
    gpu_dir = tmp_path / "gpu"
    gpu_dir.mkdir()
    for f in ("manifest.jsonl", "captions.jsonl"):
        (gpu_dir / f).write_bytes((tmp_path / f).read_bytes())
    gpu = run_stage(gpu_dir, raw, tiny_model, out="out", gpus="auto", compile=compile_mode)
    assert gpu["devices"] == [f"cuda:{i}" for i in range(torch.cuda.device_count())]
    assert cpu["encoded"] == gpu["encoded"] == 16
    a = io.read_json(tmp_path / "cpu" / "index.json")
    b = io.read_json(gpu_dir / "out" / "index.json")
    for x, y in zip(a["items"], b["items"]):
        assert x["latent_key"] == y["latent_key"], "the key must not depend on the device"
        la = ShardStore(a["latent_store"]).load(x["latent_key"])["latent"]
        lb = ShardStore(b["latent_store"]).load(y["latent_key"])["latent"]
        torch.testing.assert_close(la, lb, rtol=2e-2, atol=2e-2)  # cuDNN may use TF32


def test_compiled_training_step_matches_the_baseline(tiny_model):
    """On a GPU the sdpipe step is torch.compile'd with fused AdamW: it must still compute the baseline's loss."""
    from sdpipe.bench import parity

    result = parity.check("tiny", 32, str(tiny_model), "cuda", batch=4, steps=3)
    assert result["passed"], result


def test_bench_runs_end_to_end_on_the_tiny_preset(tmp_path):
    import json
    import subprocess
    import sys

    subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "bench",
            "--preset",
            "tiny",
            "--images",
            "64",
            "--steps",
            "4",
            "--warmup",
            "2",
            "--work",
            str(tmp_path),
            "--out",
            str(tmp_path / "results"),
        ],
        check=True,
    )
    saved = json.loads((tmp_path / "results" / "bench-tiny.json").read_text())["presets"]["tiny"]
    assert {r["kind"] for r in saved["rows"]} == {"baseline", "sdpipe"}
    assert all(r["samples_per_s"] > 0 for r in saved["rows"])
    assert saved["parity"]["passed"] and saved["loader"]["samples_per_s"] > 0
    assert [v["encoded"] for v in saved["latents"]] == [64, 64]


def test_data_wait_counts_what_the_gpu_waited_not_the_hosts_loading_time():
    """A load that the host does while the GPU still works costs the GPU nothing; the same load on an idle GPU
    is all wait."""
    import time

    from tests.test_telemetry import telemetry_on

    telemetry = telemetry_on("cuda")
    x = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    torch.cuda.synchronize()
    for _ in range(200):  # queued work, hundreds of ms on any current GPU
        x = (x @ x).clamp_(-1, 1)
    with telemetry.loading():
        time.sleep(0.05)
    torch.cuda.synchronize()
    hidden = telemetry.data_wait(1.0)
    with telemetry.loading():  # the GPU is idle now
        time.sleep(0.05)
    waited = telemetry.data_wait(1.0) - hidden
    assert hidden < 0.01, hidden
    assert 0.045 <= waited < 0.5, waited


def test_allocator_retries_are_counted_on_a_gpu():
    from tests.test_telemetry import telemetry_on

    retries = telemetry_on("cuda").alloc_retries()
    assert isinstance(retries, int) and retries >= 0
