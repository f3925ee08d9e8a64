"""`sdpipe bench`'s own logic on the CPU: the parity check (the optimised step against the diffusers-example
step) and the report's targets. The GPU run itself is tests/test_gpu.py's and benchmarks/'s."""

from __future__ import annotations

import json

import pytest

from sdpipe.bench import parity, report


@pytest.mark.parametrize("preset", ["tiny", "tiny-sdxl"])  # tiny-sdxl: pooled embeddings and time ids too
def test_parity_of_the_sdpipe_step_with_the_baseline(tiny_model, preset):
    result = parity.check(preset, 32, str(tiny_model), "cpu", batch=2, steps=2)
    assert result["passed"], result
    # On a CPU both steps run eager with the same kernels: the losses agree far below bf16 tolerance.
    assert result["loss_max_rel_diff"]["sdpipe"] < 1e-5
    assert result["weight_deviation"]["sdpipe"] < result["weight_deviation"]["fp32"]
    assert len(result["losses"]["baseline"]) == 2


def test_parity_fails_a_step_that_computes_something_else():
    base = {"w": parity_tensor([1.0, 1.0])}
    runs = {"baseline": [1.0, 0.9], "sdpipe": [1.0, 0.85], "fp32": [1.0, 0.9]}
    weights = {
        "baseline": {"w": parity_tensor([2.0, 2.0])},
        "sdpipe": {"w": parity_tensor([2.0, 2.0])},
        "fp32": {"w": parity_tensor([2.0, 2.01])},
    }
    assert not parity.verdict(runs, weights, base, 2, 2, 1e-4)["passed"]  # a 5.6 % loss difference
    runs["sdpipe"] = [1.0, 0.9]
    weights["sdpipe"] = {"w": parity_tensor([2.5, 2.0])}  # 50x further from the baseline than fp32
    assert not parity.verdict(runs, weights, base, 2, 2, 1e-4)["passed"]
    weights["sdpipe"] = {"w": parity_tensor([2.0, 2.01])}
    assert parity.verdict(runs, weights, base, 2, 2, 1e-4)["passed"]


def parity_tensor(values):
    import torch

    return torch.tensor(values)


def _results(sdpipe_rate: float, latent_rate: float) -> dict:
    meta = {
        "gpu": {"name": "GPU X", "driver": "1"},
        "packages": {"torch": "2", "diffusers": "0"},
        "git_commit": "abc",
        "steps": 30,
        "warmup": 10,
        "peak_tflops": 800.0,
    }
    rows = [
        {
            "name": "baseline",
            "kind": "baseline",
            "batch": 32,
            "samples_per_s": 100.0,
            "warmup_s": 1.0,
            "peak_memory_gib": 40.0,
            "gflops_per_sample": 2500.0,
        },
        {
            "name": "sdpipe",
            "kind": "sdpipe",
            "batch": 32,
            "samples_per_s": sdpipe_rate,
            "warmup_s": 100.0,
            "peak_memory_gib": 30.0,
        },
    ]
    latents = [
        {
            "name": "default",
            "encoded": 2000,
            "images_per_s": 200.0,
            "images_per_s_after_warmup": latent_rate,
            "seconds": 10.0,
        }
    ]
    return {
        "meta": meta,
        "presets": {
            "sd15": {
                "resolution": 512,
                "rows": rows,
                "latents": latents,
                "loader": {"batch": 32, "samples_per_s": 1000.0},
            }
        },
    }


@pytest.mark.parametrize("rate, latent_rate, met", [(150.0, 300.0, False), (170.0, 450.0, True)])
def test_report_states_each_target_and_ratio(tmp_path, rate, latent_rate, met):
    table = report.write(_results(rate, latent_rate), tmp_path, "bench-test")
    saved = json.loads((tmp_path / "bench-test.json").read_text())["presets"]["sd15"]
    assert saved["target"] == {"samples_per_s": 160.0, "best": rate, "met": met}
    assert saved["latent_target"]["met"] is met
    sdpipe_row = saved["rows"][1]
    assert sdpipe_row["vs_baseline"] == pytest.approx(rate / 100.0)
    assert sdpipe_row["mfu"] == pytest.approx(rate * 2500.0 / 1e3 / 800.0)
    assert saved["loader"]["ratio"] == pytest.approx(1000.0 / rate)
    assert ("not met" in table) is not met and (tmp_path / "bench-test.md").read_text() == table


def test_a_reused_scratch_folder_gets_one_jpeg_folder_per_image_count(tmp_path, monkeypatch):
    """prepare and caption run once per JPEG folder; a second run with another --images must not reuse the first
    run's manifest (it did: 1000 requested, 512 encoded)."""
    import argparse

    import torch

    from sdpipe.bench import cli, pipeline

    folders = []
    monkeypatch.setattr(pipeline, "sdpipe", lambda *args: None)
    monkeypatch.setattr(pipeline, "write_jpegs", lambda out, count, size: folders.append((out.name, count)) or out)
    monkeypatch.setattr(pipeline, "cache_latents", lambda work, name, model, raw, res, settings: {"raw": raw.name})
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)  # the CLI's own defaults
    for images in (512, 1000):
        args = parser.parse_args(
            [
                "--images",
                str(images),
                "--steps",
                "1",
                "--warmup",
                "1",
                "--skip",
                "baseline",
                "--skip",
                "train",
                "--skip",
                "loader",
                "--skip",
                "parity",
            ]
        )
        cli.bench_preset(args, "sd15", torch.device("cpu"), tmp_path)
    assert folders == [("jpeg-512-512", 512)] * 2 + [("jpeg-512-1000", 1000)] * 2  # eager and compiled each


def test_a_partial_run_reports_only_what_it_measured(tmp_path):
    """--skip baseline --skip train: no empty step table, and the loader line says it has nothing to compare."""
    results = _results(150.0, 300.0)
    res = results["presets"]["sd15"]
    res["rows"] = []
    table = report.write(results, tmp_path, "bench-partial")
    assert "training step" not in table and "latent caching" in table
    assert "no sdpipe train row at batch 32 in this run" in table
    res["latents"] = []
    table = report.write(results, tmp_path, "bench-partial")
    assert "latent caching" not in table and "Target" not in table


def _call(tmp_path, stem: str, date: str, measured: dict) -> object:
    """One device call's results file, written by the bench's own report (which adds MFU and ratios)."""
    results = _results(150.0, 390.0)
    results["meta"].update(date=date, command=f"/x/sdpipe/__main__.py bench --preset sd15 --out /o --name {stem}")
    results["presets"]["sd15"] = {"resolution": 512, "rows": [], "latents": [], **measured}
    report.write(results, tmp_path, stem)
    return tmp_path / f"{stem}.json"


def test_summary_puts_split_calls_in_one_table_with_their_provenance(tmp_path):
    from sdpipe.bench import summary

    rows = _results(150.0, 0.0)["presets"]["sd15"]["rows"]
    latents = [
        {
            "name": name,
            "encoded": 512,
            "images_per_s": 50.0,
            "images_per_s_after_warmup": rate,
            "seconds": 9.0,
            "batch": 64,
        }
        for name, rate in (("eager", 184.0), ("torch.compile", 389.0))
    ]
    files = [
        _call(
            tmp_path,
            "latents-call",
            "2026-12-03T15:00:00+00:00",
            {"latents": latents, "loader": {"batch": 32, "samples_per_s": 1000.0}},
        ),
        _call(tmp_path, "train-call", "2026-12-03T14:00:00+00:00", {"rows": rows}),
    ]
    table = summary.write(files, tmp_path, "summary")
    lines = {line["what"].split(",")[0]: line for line in json.loads((tmp_path / "summary.json").read_text())["lines"]}
    assert lines["sd15 training step"]["verdict"] == "not met: 1.50x the baseline"
    assert lines["sd15 training step"]["source"] == "train-call"
    assert lines["sd15 latent caching"]["got"] == 389.0 and "184.0 images/s" in lines["sd15 latent caching"]["baseline"]
    assert lines["sd15 latent caching"]["what"] == "sd15 latent caching, 512 JPEGs at 512 px, batch 64, decode included"
    loader = lines["sd15 training data loader"]
    assert loader["got"] == pytest.approx(1000.0 / 150.0) and loader["source"] == "latents-call"
    assert loader["baseline"] == "the step consumed 150.0 (train-call)"  # borrowed from the other call, and named
    sources = [line for line in table.splitlines() if line.startswith(("| train-call", "| latents-call"))]
    assert [s.split(" | ")[0] for s in sources] == ["| train-call", "| latents-call"]  # oldest first
    assert all("`bench --preset sd15`" in s and "GPU X (1)" in s for s in sources)
    assert (tmp_path / "summary.md").read_text() == table


def test_summary_names_a_file_that_is_not_a_results_file(tmp_path):
    from sdpipe.bench import summary
    from sdpipe.errors import UserError

    (tmp_path / "other.json").write_text('{"rows": []}')
    with pytest.raises(UserError, match="other.json is not an `sdpipe bench` results file"):
        summary.write([tmp_path / "other.json"], tmp_path, "summary")


def test_train_row_rate_comes_from_the_last_full_window_not_a_short_tail():
    from sdpipe.bench.pipeline import last_full_window

    rows = [
        {"step": "6", "samples_per_s": "20.0"},
        {"step": "12", "samples_per_s": "156.0"},
        {"step": "18", "samples_per_s": "156.5"},
        {"step": "20", "samples_per_s": "150.0"},
    ]
    assert last_full_window(rows, 6)["samples_per_s"] == "156.5"
    assert last_full_window(rows[:3], 6)["samples_per_s"] == "156.5"
    assert last_full_window(rows[:1], 6) is rows[0], "a run of one window has only that one"


def test_a_latent_rate_from_few_images_gets_no_verdict(tmp_path):
    results = _results(170.0, 450.0)
    results["presets"]["sd15"]["latents"][0]["encoded"] = 256
    table = report.write(results, tmp_path, "bench-few")
    saved = json.loads((tmp_path / "bench-few.json").read_text())["presets"]["sd15"]
    assert saved["latent_target"]["met"] is None
    assert "no verdict from 256 images" in table


@pytest.mark.parametrize("device, mode, label", [("cuda", "compiled", "torch.compile"), ("cpu", "eager", "eager")])
def test_the_step_rows_compile_on_a_gpu_by_default(tmp_path, monkeypatch, device, mode, label):
    """A bench row trains a few dozen steps, so `train.compile: auto` would pick eager there: the rows ask for the
    compiled UNet on a GPU unless --compile says otherwise."""
    import argparse

    import torch

    from sdpipe.bench import cli, pipeline

    modes = []
    monkeypatch.setattr(pipeline, "sdpipe", lambda *args: None)
    monkeypatch.setattr(pipeline, "write_jpegs", lambda out, count, size: out)
    monkeypatch.setattr(pipeline, "cache_latents", lambda work, name, model, raw, res, settings: {"raw": raw.name})
    monkeypatch.setattr(
        pipeline,
        "train_row",
        lambda work, cache, name, batch, steps, warmup, overrides, base, cap: (
            modes.append(overrides["compile"]) or {"samples_per_s": 1.0}
        ),
    )
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        [
            "--steps",
            "1",
            "--warmup",
            "1",
            "--skip",
            "baseline",
            "--skip",
            "loader",
            "--skip",
            "parity",
            "--skip",
            "latents",
        ]
    )
    out = cli.bench_preset(args, "sd15", torch.device(device), tmp_path)
    assert modes == [mode]
    assert [r["name"] for r in out["rows"]] == [f"sdpipe train ({label}, fused AdamW), batch 32"]


def test_template_and_optimizer_rows_train_with_the_templates_settings(tmp_path, monkeypatch):
    """--train-template x --optimizer: each row's train section is the template's (its batch, accumulation and
    checkpointing), with the bench's timing settings over it and the optimizer over those."""
    import argparse

    import torch
    import yaml

    from sdpipe.bench import cli, pipeline

    stage = tmp_path / "stage.yaml"
    stage.write_text("model: {pretrained: m}\n")
    configs = []

    def fake_row(work, cache, name, batch, steps, warmup, extra, base, cap):
        path = pipeline.train_config(work, str(stage), name, batch, steps, warmup, extra, base)
        configs.append(yaml.safe_load(path.read_text())["train"])
        return {"samples_per_s": 1.0, "batch": batch, "grad_accum_steps": base.get("grad_accum_steps", 1)}

    monkeypatch.setattr(pipeline, "train_row", fake_row)
    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    args = parser.parse_args(
        ["--train-template", "sdxl-lora", "--train-template", "sdxl-lora-24gb", "--optimizer", "adamw"]
        + ["--optimizer", "adamw_8bit", "--compile", "eager", "--steps", "3", "--warmup", "2"]
    )
    rows = list(cli.train_rows(args, "sdxl", torch.device("cpu"), tmp_path, {"config": str(stage)}, None))
    assert [r["name"] for r in rows] == [
        "sdpipe train (sdxl-lora, eager, fused AdamW), batch 4",
        "sdpipe train (sdxl-lora, eager, adamw_8bit), batch 4",
        "sdpipe train (sdxl-lora-24gb, eager, fused AdamW), batch 1 x 4 accumulated",
        "sdpipe train (sdxl-lora-24gb, eager, adamw_8bit), batch 1 x 4 accumulated",
    ]
    assert [c["optimizer"] for c in configs] == ["adamw", "adamw_8bit"] * 2
    assert all(c["mode"] == "lora" and c["lora"]["rank"] == 16 for c in configs)
    assert configs[2]["gradient_checkpointing"] and configs[2]["grad_accum_steps"] == 4
    # the template's validation, checkpoints and warm-up ramp give way to the bench's timing settings
    assert all(c["validation"] == {"every": 0} and c["checkpoint_every"] == 0 for c in configs)
    assert all(c["max_steps"] == 5 and c["lr_warmup_steps"] == 0 for c in configs)


def test_a_row_out_of_memory_under_the_cap_is_reported_as_not_fitting(tmp_path, monkeypatch):
    import subprocess

    from sdpipe.bench import pipeline

    stage = tmp_path / "stage.yaml"
    stage.write_text("model: {pretrained: m}\n")
    monkeypatch.setattr(pipeline, "capped_allocator_env", lambda cap: {"PYTORCH_CUDA_ALLOC_CONF": "x"})

    def oom(cmd, stdout, stderr, env):
        stdout.write("train: CUDA out of memory at batch 4\n")
        return subprocess.CompletedProcess(cmd, 1)

    monkeypatch.setattr(pipeline.subprocess, "run", oom)
    cache = {"config": str(stage), "index": "index.json"}
    row = pipeline.train_row(tmp_path, cache, "r", 4, 3, 1, {}, None, 23.0)
    assert row["fits"] is False and row["memory_cap_gib"] == 23.0
    with pytest.raises(subprocess.CalledProcessError):  # without a cap, the same failure is a failure
        pipeline.train_row(tmp_path, cache, "r", 4, 3, 1, {}, None, None)
    results = _results(170.0, 450.0)
    results["presets"]["sd15"]["rows"].append({"name": "capped", "kind": "sdpipe", **row})
    table = report.write(results, tmp_path, "bench-cap")
    assert "| capped | out of memory under the 23 GiB cap |" in table


def test_the_allocator_cap_is_a_fraction_of_the_first_gpu(monkeypatch):
    import types

    import torch

    from sdpipe.bench import pipeline

    gpu = types.SimpleNamespace(total_memory=80 * 2**30)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda i: gpu)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    env = pipeline.capped_allocator_env(24.0)
    assert env["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True,per_process_memory_fraction:0.3000"


def test_template_rows_are_not_held_to_the_full_fine_tune_target(tmp_path):
    results = _results(170.0, 450.0)
    rows = results["presets"]["sd15"]["rows"]
    rows[1]["template"] = "sd15-lora"  # a LoRA row: issue 5's full fine-tune target is not its yardstick
    table = report.write(results, tmp_path, "bench-template")
    assert "Target 160 samples/s" not in table
