"""The report stage: every part present, user text escaped, timings marked, missing inputs, determinism."""

from __future__ import annotations

import csv
import re
import shutil
from pathlib import Path

import pytest
from PIL import Image

from sdpipe import config, hashing, io
from sdpipe.errors import UserError
from sdpipe.report import grids
from sdpipe.stages import report
from sdpipe.train.telemetry import COLUMNS

PROMPTS = ["a red <b>circle</b> & friends", "a blue square | on black"]
SEEDS = [0, 1]
CELL = 16
COMMIT = "0123abcd" * 5
FID_REASON = "Inception weights not found in <cache>; run `sdpipe fetch-weights`"
IDS = [hashing.sha256_bytes(bytes([i])) for i in range(6)]
TIMING = "⏱"
SRC = re.compile(r'src="([^"]+)"')
MD_IMAGE = re.compile(r"!\[(?:\\.|[^\]\\])*\]\(([^)]+)\)")


# --- fake but realistic inputs, laid out as the workflow writes them ----------------------------------------------


def _grid(path: Path, rows: int, cols: int, shade: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (cols * CELL, rows * CELL), (shade, 40, 200 - shade)).save(path)


def _metrics_csv(path: Path, speed: float) -> None:
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, COLUMNS)
        writer.writeheader()
        for i, step in enumerate((10, 20, 30, 40)):
            writer.writerow(
                {
                    "step": step,
                    "epoch": i // 2,
                    "loss": 0.9 / (i + 1),
                    "lr": 1e-4 * (4 - i) / 4,
                    "samples_per_s": speed + i,
                    "samples_per_s_per_gpu": (speed + i) / 2,
                    "data_wait": 0.01 * i,
                    "peak_memory_mb": "",
                    "samples_seen": 16 * step,
                }
            )


def _metrics(speed: float) -> dict:
    return {
        "fid": {"value": None, "reason": FID_REASON, "n_fake": 8},
        "clip_score": {"value": 0.2468, "reason": None, "n": 8},
        "colour_accuracy": {"value": 0.75, "reason": None, "n": 8},
        "train_samples_per_s": speed,
        "inference_samples_per_s": speed / 7,
        "scaling": [
            {"gpus": 1, "samples_per_s": speed, "per_gpu_samples_per_s": speed, "efficiency": 1.0},
            {"gpus": 2, "samples_per_s": 1.8 * speed, "per_gpu_samples_per_s": 0.9 * speed, "efficiency": 0.9},
        ],
        "timings": ["train_samples_per_s", "inference_samples_per_s", "scaling"],
        "provenance": {
            "git_commit": COMMIT,
            "packages": {"torch": "2.4.1", "diffusers": "0.30.0"},
            "gpu": {"name": "NVIDIA H200", "count": 2, "driver": "550.54"},
            "seeds": {"seed": 7, "validation": SEEDS},
        },
    }


def write_inputs(root: Path, speed: float = 123.4) -> dict[str, Path]:
    """Every input of the stage under root; `speed` sets every timing, so runs can differ in timings only."""
    p = {name: root / path for name, path in report.INPUTS.items()}
    for path in p.values():
        path.parent.mkdir(parents=True, exist_ok=True)
    io.write_yaml(p["resolved_config"], {"seed": 7, "data": {"raw_dir": str(root / "data" / "raw")}})
    io.write_yaml(root / "data" / "raw.dvc", {"outs": [{"md5": "f00dfeed.dir", "path": "raw"}]})
    io.write_json(
        p["prepare"],
        {
            "scanned": 9,
            "accepted": 6,
            "rejected": 1,
            "train": 5,
            "eval": 1,
            "duplicates": [{"path": "b.png", "duplicate_of": "a.png"}],
            "warnings": [],
            "buckets": {"32x32": 4, "24x40": 2},
        },
    )
    io.write_json(
        p["captions"],
        {
            "total": 6,
            "captioned": 6,
            "reused": 2,
            "failed": 0,
            "by_source": {"sidecar": 4, "template": 2},
            "chain": ["sidecar", "template"],
            "seconds": speed / 100,
        },
    )
    io.write_json(
        p["latents"],
        {
            "items": 5,
            "encoded": 3,
            "reused": 2,
            "failed": 0,
            "devices": ["cpu"],
            "seconds": speed / 50,
            "images_per_s": speed * 2,
            "dtype": "fp32",
            "flip": False,
        },
    )
    io.write_jsonl(p["manifest"], [{"id": i, "split": "eval" if n == 0 else "train"} for n, i in enumerate(IDS)])
    io.write_json(
        p["train_summary"],
        {
            "world_size": 2,
            "per_device_batch_size": 4,
            "grad_accum_steps": 2,
            "global_batch_size": 16,
            "optimizer_steps": 40,
            "epochs": 2,
            "samples_seen": 640,
            "samples_per_s": speed,
            "seconds": 640 / speed,
            "mode": "lora",
            "mixed_precision": "bf16",
            "device": "cuda",
            "peak_memory_mb": 2048.5,
        },
    )
    _metrics_csv(p["train_metrics"], speed)
    for step, shade in ((10, 30), (20, 160)):
        _grid(p["samples_dir"] / f"step-{step:08d}.png", len(PROMPTS), len(SEEDS), shade)
    io.write_json(
        p["export"],
        {
            "dtype": "fp16",
            "components": {"unet": "lora"},
            "formats": {
                "single_file": {
                    "path": "results/export/model.safetensors",
                    "verified": True,
                    "max_abs_diff": 3,
                    "mean_abs_diff": 0.25,
                    "seconds": speed / 30,
                },
                "lora": {"path": "results/export/lora", "verified": False, "max_abs_diff": 9, "mean_abs_diff": 1.5},
            },
        },
    )
    io.write_json(p["metrics"], _metrics(speed))
    _grid(p["eval_grid"], 2, 2, 90)
    io.write_json(
        p["eval_prompts"],
        [{"prompt": prompt, "seed": seed} for prompt in (PROMPTS[0], "a green triangle") for seed in (3, 4)],
    )
    return p


def make_cfg(root: Path):
    return config.from_dict(
        {
            "seed": 7,
            "data": {"raw_dir": str(root / "data" / "raw")},
            "model": {"pretrained": "models/tiny"},
            "train": {"validation": {"every": 10, "prompts": PROMPTS, "seeds": SEEDS}},
        }
    )


def run_report(root: Path, inputs: dict[str, Path]) -> tuple[str, str, Path]:
    outputs = {name: root / path for name, path in report.OUTPUTS.items()}
    report.run(make_cfg(root), inputs, outputs)
    return outputs["html"].read_text(), outputs["markdown"].read_text(), outputs["assets"]


def referenced(html: str, markdown: str) -> set[str]:
    return set(SRC.findall(html)) | set(MD_IMAGE.findall(markdown))


# --- tests ----------------------------------------------------------------------------------------------------------


def test_report_states_every_part(tmp_path):
    inputs = write_inputs(tmp_path)
    html, markdown, assets = run_report(tmp_path, inputs)
    for text in (html, markdown):
        assert COMMIT in text and "NVIDIA H200 × 2, driver 550.54" in text and "f00dfeed.dir" in text
        assert "results/export/lora" in text and "fp16" in text
        assert hashing.key_of(io.read_yaml(inputs["resolved_config"])) in text  # config hash
        assert hashing.key_of(sorted(IDS)) in text  # dataset hash
        assert "timings vary from run to run" in text
        assert "0.2468" in text and "not available" not in text
    assert "null — Inception weights not found in &lt;cache&gt;" in html
    assert "null — Inception weights not found in &lt;cache&gt;" in markdown

    links = referenced(html, markdown)
    assert {Path(link).name for link in links} == {
        "loss_lr.png",
        "throughput.png",
        "scaling.png",
        "step-00000010.png",
        "step-00000020.png",
        "eval_grid.png",
    }
    for link in links:
        assert not Path(link).is_absolute() and (tmp_path / "results" / "report" / link).is_file(), link
    with Image.open(assets / "samples" / "step-00000010.png") as im:  # enlarged, with a label column and headings
        assert im.width > len(SEEDS) * CELL * 2 and im.height > len(PROMPTS) * CELL * 2


def test_user_text_is_escaped(tmp_path):
    html, markdown, _ = run_report(tmp_path, write_inputs(tmp_path))
    assert "<b>" not in html and "&lt;b&gt;circle&lt;/b&gt; &amp;amp; friends" not in html
    assert "a red &lt;b&gt;circle&lt;/b&gt; &amp; friends" in html
    assert "<b>" not in markdown and "a red &lt;b&gt;circle&lt;/b&gt; &amp; friends" in markdown
    assert r"a blue square \| on black" in markdown  # a | would split a Markdown table cell
    assert "columns: seeds 3, 4" in markdown and "row 2: a green triangle" in html


def test_timings_are_marked(tmp_path):
    html, markdown, _ = run_report(tmp_path, write_inputs(tmp_path, speed=123.4))
    timing_values = ["123.4", "246.8", "222.1", "17.63", "5.186", "2.468", "1.234", "4.113"]
    for value in timing_values:
        lines = [line for line in markdown.splitlines() if value in line]
        assert lines and all(TIMING in line for line in lines), value
        assert re.search(rf'<td class="timing">{re.escape(value)} {TIMING}</td>', html), value
    assert any(line.startswith("| generated |") and TIMING in line for line in markdown.splitlines())


def _stable(markdown: str) -> list[str]:
    return [line for line in markdown.splitlines() if TIMING not in line]


def test_two_runs_differ_only_in_marked_lines(tmp_path, monkeypatch):
    first_html, first, assets = run_report(tmp_path, write_inputs(tmp_path))
    kept = tmp_path / "first-assets"
    shutil.copytree(assets, kept)
    monkeypatch.setattr(report, "generated_at", lambda: "2001-02-03 04:05:06 UTC")
    again_html, again, _ = run_report(tmp_path, write_inputs(tmp_path))
    assert _stable(again) == _stable(first) and again != first  # only the generation time changed
    assert again_html.splitlines()[:5] == first_html.splitlines()[:5]
    for png in kept.rglob("*.png"):
        assert png.read_bytes() == (assets / png.relative_to(kept)).read_bytes(), png.name

    # Other timings, same everything else: still only marked lines change, and untimed plots stay byte-equal.
    _, slower, _ = run_report(tmp_path, write_inputs(tmp_path, speed=61.7))
    assert _stable(slower) == _stable(first) and slower != again
    for name in ("loss_lr.png", "samples/step-00000010.png", "eval_grid.png"):
        assert (kept / name).read_bytes() == (assets / name).read_bytes(), name


def test_missing_optional_inputs_are_noted(tmp_path):
    inputs = write_inputs(tmp_path)
    optional = ["prepare", "captions", "latents", "manifest", "samples_dir", "export", "eval_prompts"]
    for name in optional:
        shutil.rmtree(inputs[name]) if inputs[name].is_dir() else inputs[name].unlink()
    (tmp_path / "data" / "raw.dvc").unlink()
    metrics = io.read_json(inputs["metrics"])
    del metrics["provenance"], metrics["colour_accuracy"]
    metrics["scaling"] = None
    io.write_json(inputs["metrics"], metrics)

    html, markdown, assets = run_report(tmp_path, inputs)
    for text in (html, re.sub(r"\\(.)", r"\1", markdown)):  # Markdown as it reads, without its escapes
        for name in optional:
            assert str(inputs[name]) in text, name  # named, with the target that makes it
        for target in ("prepare", "caption", "latents", "train", "export", "evaluate"):
            assert f"`snakemake {target}`" in text, target
        assert "scaling: not available" in text and "raw.dvc not found or without an md5" in text
    assert markdown.count("not available") >= len(optional) + 2
    links = referenced(html, markdown)
    assert {Path(link).name for link in links} == {"loss_lr.png", "throughput.png", "eval_grid.png"}
    assert sorted(p.name for p in assets.rglob("*") if p.is_file()) == [
        "eval_grid.png",
        "loss_lr.png",
        "throughput.png",
    ]


def test_missing_eval_grid_is_noted(tmp_path):
    inputs = write_inputs(tmp_path)
    inputs["eval_grid"].unlink()
    html, markdown, assets = run_report(tmp_path, inputs)
    assert f"evaluation images: not available ({inputs['eval_grid']} not found" in html
    assert "eval_grid.png" not in html + markdown and not (assets / "eval_grid.png").exists()


@pytest.mark.parametrize(
    "name,target",
    [("resolved_config", "report"), ("train_summary", "train"), ("train_metrics", "train"), ("metrics", "evaluate")],
)
def test_missing_required_input_is_one_line(tmp_path, name, target):
    inputs = write_inputs(tmp_path)
    inputs[name].unlink()
    with pytest.raises(UserError) as err:
        run_report(tmp_path, inputs)
    message = str(err.value)
    assert "\n" not in message and str(inputs[name]) in message and f"`snakemake {target}`" in message
    assert not (tmp_path / report.OUTPUTS["html"]).exists()


def test_cli_flags(tmp_path):
    """Every input and output becomes a --flag of `sdpipe report` (none may clash with --config or --set)."""
    import argparse

    from sdpipe import cli

    sub = argparse.ArgumentParser().add_subparsers()
    cli._add_stage(sub, "report", "sdpipe.stages.report")
    args = sub.choices["report"].parse_args(["--resolved-config", "a.yaml", "--samples-dir", "s", "--html", "h"])
    assert (args.input__resolved_config, args.input__samples_dir, args.output__html) == ("a.yaml", "s", "h")
    assert args.output__assets == report.OUTPUTS["assets"] and args.config == cli.DEFAULT_CONFIG


def test_unreadable_input_is_one_line(tmp_path):
    inputs = write_inputs(tmp_path)
    inputs["metrics"].write_text("{not json")
    with pytest.raises(UserError, match=r"metrics.json is unreadable .*`snakemake evaluate`") as err:
        run_report(tmp_path, inputs)
    assert "\n" not in str(err.value)


def test_eval_grid_layout_is_read_from_prompts_json():
    from sdpipe.report.figures import eval_layout

    grid_order = [{"prompt": p, "seed": s} for p in ("a", "b") for s in (1, 2)]
    assert eval_layout(grid_order) == (["a", "b"], [1, 2])
    seed_major = [{"prompt": p, "seed": s} for s in (1, 2) for p in ("a", "b")]
    assert eval_layout(seed_major) is None and eval_layout(grid_order[:3]) is None


def test_grid_of_another_shape_is_shown_unlabelled(tmp_path):
    src, out = tmp_path / "grid.png", tmp_path / "out.png"
    _grid(src, 3, 2, 0)  # three rows, but two prompts
    assert not grids.label_grid(src, out, PROMPTS, SEEDS)
    assert out.read_bytes() == src.read_bytes()
