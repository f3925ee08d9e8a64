"""DreamBooth with prior preservation: class images generated from the base model, then prepare, caption,
latents and training treat them like any data, with their loss weighted by dreambooth.prior_loss_weight."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdpipe import config, io
from sdpipe.stages import caption, class_images, latents, prepare
from sdpipe.train.data import LatentData
from tests.conftest import small_config
from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow
PROMPT = "a photo of a shape"
DREAMBOOTH = {
    "enabled": True,
    "class_prompt": PROMPT,
    "num_class_images": 6,
    "steps": 2,
    "batch_size": 4,
    "gpus": 0,
    "prior_loss_weight": 0.5,
}


def _cfg(tmp: Path, raw: Path, model: Path, **dreambooth):
    cfg = small_config(tmp, raw, model, dreambooth={**DREAMBOOTH, **dreambooth})
    cfg["caption"]["chain"] = ["template"]  # class images are captioned by their sidecar whatever the chain says
    cfg["caption"]["template"] = "sks {stem}"
    return cfg


def _generate(tmp: Path, cfg: dict) -> dict:
    return class_images.run(config.from_dict(cfg), {}, {"images": tmp / "class", "summary": tmp / "class.json"})


def _pixels(folder: Path) -> dict[str, np.ndarray]:
    return {p.name: np.asarray(Image.open(p)) for p in sorted(folder.glob("*.png"))}


@pytest.fixture()
def instance(tmp_path, demo_source) -> Path:
    raw = tmp_path / "raw" / "4_sks shape"  # kohya folder: 4 repeats
    raw.mkdir(parents=True)
    for src in sorted(demo_source.rglob("*.png"))[:3]:
        shutil.copy(src, raw / src.name)
    return raw.parent


def test_class_images_are_incremental_and_independent_of_the_device_count(tmp_path, instance, tiny_model, monkeypatch):
    cfg = _cfg(tmp_path, instance, tiny_model)
    first = _generate(tmp_path, cfg)
    assert first["generated"] == 6 and len(list((tmp_path / "class").glob("*.png"))) == 6
    assert {p.read_text().strip() for p in (tmp_path / "class").glob("*.txt")} == {PROMPT}
    pixels = _pixels(tmp_path / "class")
    assert len({a.tobytes() for a in pixels.values()}) == 6  # one seed per image

    assert _generate(tmp_path, cfg)["generated"] == 0  # nothing is stale
    fewer = _generate(tmp_path, _cfg(tmp_path, instance, tiny_model, num_class_images=4))
    assert (fewer["generated"], fewer["stale_removed"]) == (0, 2)

    shutil.rmtree(tmp_path / "class")  # two CPU processes render what one did
    monkeypatch.setattr(class_images, "class_devices", lambda cfg: ["cpu", "cpu"])
    assert _generate(tmp_path, cfg)["devices"] == ["cpu", "cpu"]
    again = _pixels(tmp_path / "class")
    # Same seeds, same pictures; other batch shapes and thread counts may round a pixel by one level.
    assert again.keys() == pixels.keys()
    assert max(int(np.abs(again[k].astype(int) - pixels[k]).max()) for k in pixels) <= 2


def test_class_images_flow_through_prepare_caption_latents_and_weight_the_loss(tmp_path, instance, tiny_model):
    cfg = config.from_dict(_cfg(tmp_path, instance, tiny_model))
    _generate(tmp_path, cfg.raw)
    t = tmp_path
    prepare.run(
        cfg,
        {"class_images": t / "class"},
        {"manifest": t / "m.jsonl", "rejected": t / "r.jsonl", "summary": t / "p.json"},
    )
    rows = io.read_jsonl(t / "m.jsonl")
    roles = [r["role"] for r in rows]
    assert roles.count("instance") == 3 and roles.count("class") == 6
    # 3 instance images x 4 repeats = 12 instance samples; 6 class images x 2 repeats balance them.
    assert {r["repeats"] for r in rows if r["role"] == "class"} == {2}
    caption.run(cfg, {"manifest": t / "m.jsonl"}, {"captions": t / "c.jsonl", "summary": t / "cs.json"})
    captions = {c["id"]: c["caption"] for c in io.read_jsonl(t / "c.jsonl")}
    assert {captions[r["id"]] for r in rows if r["role"] == "class"} == {PROMPT}
    assert all(captions[r["id"]].startswith("sks ") for r in rows if r["role"] == "instance")
    latents.run(
        cfg,
        {"manifest": t / "m.jsonl", "captions": t / "c.jsonl"},
        {"index": t / "index.json", "summary": t / "ls.json"},
    )
    data = LatentData(t / "index.json", prior_loss_weight=0.5)
    samples = list(range(len(data.sample_items)))
    weights = [float(data.batch([s], [False], [False])["weight"]) for s in samples]
    assert len(samples) == 24 and sorted(weights) == [0.5] * 12 + [1.0] * 12


def test_dreambooth_lora_trains_through_the_workflow(tmp_path, instance):
    """`snakemake train` with DreamBooth on: class_images -> prepare -> caption -> latents -> train."""
    work = make_project(
        tmp_path / "work",
        instance,
        dreambooth=DREAMBOOTH,
        prepare={"eval_fraction": 0.0},
        model={"train_vae": {"enabled": False}},
        caption={"chain": ["template"], "template": "sks {stem}", "gpus": 0},
        train={
            "mode": "lora",
            "max_steps": 2,
            "per_device_batch_size": 4,
            "lr_warmup_steps": 0,
            "validation": {"every": 0},
            "text_encoder": {"mode": "none", "learning_rate": None},
        },
    )
    run([sys.executable, "-m", "snakemake", "--cores", "2", "train"], work)
    assert len(list((work / "results" / "class_images" / "images").glob("*.png"))) == 6
    summary = io.read_json(work / "results" / "train" / "summary.json")
    assert summary["optimizer_steps"] == 2 and summary["samples_seen"] == 8
    assert io.read_json(work / "results" / "prepare" / "summary.json")["class"]["accepted"] == 6


def test_dreambooth_without_a_class_prompt_is_one_line(tmp_path, instance, tiny_model):
    with pytest.raises(Exception, match="dreambooth.enabled needs dreambooth.class_prompt"):
        config.from_dict(_cfg(tmp_path, instance, tiny_model, class_prompt=" "))
