"""Tag captions (latents.tags): shuffled variants keep the first tags, drop only the others, are the same in every
run, are cached like any caption, and each sample draws one per epoch from its own generator."""

from __future__ import annotations

from pathlib import Path

import torch

from sdpipe import config, io
from sdpipe.latents import tags
from sdpipe.stages import latents
from sdpipe.train import objective
from sdpipe.train.data import LatentData
from tests.conftest import small_config
from tests.test_latents import make_inputs

CAPTION = "sks dog, red collar, grass, sunny, from above, smiling"


def _tags(**changes) -> config.TagsConfig:
    return config.from_dict({"latents": {"tags": {"shuffle": True, **changes}}}).latents.tags


def test_shuffling_keeps_the_first_tags_and_reorders_the_rest():
    variants = tags.variants(CAPTION, _tags(keep_first=2, variants=16))
    assert len(variants) == 16 and variants == tags.variants(CAPTION, _tags(keep_first=2, variants=16))
    rest = sorted(CAPTION.split(", ")[2:])
    for text in variants:
        parts = text.split(", ")
        assert parts[:2] == ["sks dog", "red collar"] and sorted(parts[2:]) == rest
    assert len(set(variants)) > 8, "the orders differ"


def test_tag_dropout_leaves_out_only_tags_after_the_kept_ones():
    variants = tags.variants(CAPTION, _tags(shuffle=False, dropout=0.5, variants=32))
    counts = [len(text.split(", ")) for text in variants]
    assert all(text.startswith("sks dog") for text in variants)
    assert min(counts) < 6 and max(counts) <= 6
    dropped = sum(6 - n for n in counts) / (5 * len(variants))
    assert 0.3 < dropped < 0.7  # each of the 5 other tags left out about half the time


def test_captions_without_tags_and_settings_without_shuffling_are_left_alone():
    assert tags.variants("a photo of a dog on the grass", _tags()) == ["a photo of a dog on the grass"]
    off = config.from_dict({}).latents.tags
    assert tags.variants(CAPTION, off) == [CAPTION]


def _latents(tmp: Path, raw: Path, model: Path, tags_cfg: dict) -> Path:
    raw_cfg = small_config(tmp, raw, model, latents={"tags": tags_cfg})
    out = tmp / "out"
    outputs = {"index": out / "index.json", "summary": out / "summary.json"}
    inputs = {"manifest": tmp / "manifest.jsonl", "captions": tmp / "captions.jsonl"}
    latents.run(config.from_dict(raw_cfg), inputs, outputs)
    return out


def test_variants_are_cached_and_each_sample_draws_one_per_epoch(tmp_path, tiny_model):
    raw, manifest, captions = make_inputs(tmp_path, 4)
    rows = io.read_jsonl(captions)  # tag captions: four tags each, the first kept
    io.write_jsonl(captions, [r | {"caption": f"sks, tag{i % 4}, red, round"} for i, r in enumerate(rows)])
    out = _latents(tmp_path, raw, tiny_model, {"shuffle": True, "keep_first": 1, "variants": 4})
    summary = io.read_json(out / "summary.json")
    index = io.read_json(out / "index.json")
    assert all(len(item["text_keys"]) == 4 for item in index["items"])
    distinct = {key for item in index["items"] for key in item["text_keys"]}
    assert summary["text_encoded"] == len(distinct) > 4  # every distinct variant encoded once
    data = LatentData(out / "index.json")
    states = [data.batch([0], [False], [False], [v])["hidden"] for v in range(4)]
    texts = index["items"][0]["caption_variants"]
    differ = [not torch.equal(states[0], s) for s in states[1:]]
    assert differ == [texts[0] != t for t in texts[1:]], "each variant's own states"
    picks = [
        int(objective.variant([objective.sample_generator(0, epoch, 0)], data.variant_counts([0]))[0])
        for epoch in range(12)
    ]
    again = [
        int(objective.variant([objective.sample_generator(0, epoch, 0)], data.variant_counts([0]))[0])
        for epoch in range(12)
    ]
    assert picks == again and len(set(picks)) > 1, "per epoch, reproducibly"
    assert data.captions([0], [False], [picks[0]]) == [texts[picks[0]]]
