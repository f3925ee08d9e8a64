"""Shared fixtures: a tiny model built once per session and saved in diffusers format, demo images, configs."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

from tests.hub_server import hub  # noqa: F401  (the loopback Hub fixture, for download and upload tests)

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # tests never touch the network
os.environ["PATH"] = f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}"  # rules call `sdpipe` and `snakemake`


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory) -> Path:
    """The tiny preset, saved and then loaded like any user checkpoint (model.pretrained = this folder)."""
    from sdpipe.models import presets

    return presets.build_and_save("tiny", tmp_path_factory.mktemp("model") / "tiny", seed=0)


@pytest.fixture(scope="session")
def demo_source(tmp_path_factory) -> Path:
    """40 demo images; tests copy what they need, so this is generated once."""
    from sdpipe import demo

    out = tmp_path_factory.mktemp("demo") / "raw"
    demo.generate(out, count=40, seed=0)
    return out


def small_config(tmp: Path, raw: Path, model: Path, **sections) -> dict:
    """A config for a small CPU run: 32px buckets for the tiny model, everything under tmp."""
    cfg = {
        "cache_dir": str(tmp / "cache"),
        "data": {"raw_dir": str(raw)},
        "model": {"pretrained": str(model)},
        "prepare": {"min_size": 32, "eval_fraction": 0.0, "workers": 1, "buckets": {"resolution": 32, "step": 8}},
        "caption": {"chain": ["sidecar", "template"], "gpus": 0},
        "latents": {"dtype": "fp32", "gpus": 0, "batch_size": 4},
    }
    for name, values in sections.items():
        cfg.setdefault(name, {}).update(values)
    return cfg


def cache_latents(tmp: Path, raw_cfg: dict) -> Path:
    """prepare, caption and latents run by the real stages into `tmp` (m.jsonl, c.jsonl, index.json); the index."""
    from sdpipe import config
    from sdpipe.stages import caption, latents, prepare

    cfg = config.from_dict(raw_cfg)
    prepare.run(cfg, {}, {"manifest": tmp / "m.jsonl", "rejected": tmp / "r.jsonl", "summary": tmp / "p.json"})
    caption.run(cfg, {"manifest": tmp / "m.jsonl"}, {"captions": tmp / "c.jsonl", "summary": tmp / "cs.json"})
    latents.run(
        cfg,
        {"manifest": tmp / "m.jsonl", "captions": tmp / "c.jsonl"},
        {"index": tmp / "index.json", "summary": tmp / "ls.json"},
    )
    return tmp / "index.json"
