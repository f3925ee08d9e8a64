"""data.regularisation: folders of the user's own regularisation images train beside the raw images with their
folder's loss weight, repeats and caption, and never go to the eval split."""

from __future__ import annotations

import shutil

import pytest
import torch

from sdpipe import config, io
from sdpipe.errors import UserError
from sdpipe.train.data import LatentData
from tests.conftest import cache_latents, small_config


@pytest.fixture(scope="module")
def cached(tmp_path_factory, demo_source, tiny_model):
    """Eight demo images to train on; twelve others in two regularisation folders, one with a fixed caption."""
    tmp = tmp_path_factory.mktemp("reg")
    images = sorted(demo_source.rglob("*.png"))
    for folder, chosen in (("raw", images[:8]), ("dogs", images[8:14]), ("cats", images[14:20])):
        (tmp / folder).mkdir()
        for image in chosen:
            shutil.copy(image, tmp / folder / image.name)
    regs = [
        {"dir": str(tmp / "dogs"), "weight": 0.25, "caption": "a photo of a dog"},
        {"dir": str(tmp / "cats"), "weight": 2.0, "repeats": 3},
    ]
    raw_cfg = small_config(tmp, tmp / "raw", tiny_model, data={"regularisation": regs}, prepare={"eval_fraction": 0.5})
    return cache_latents(tmp, raw_cfg), tmp


def test_each_folder_trains_with_its_weight_repeats_and_caption(cached):
    index, tmp = cached
    manifest = io.read_jsonl(tmp / "m.jsonl")
    regs = [r for r in manifest if r["role"] == "regularisation"]
    assert len(regs) == 12 and all(r["split"] == "train" for r in regs), "never held out"
    train_raw = sum(r["repeats"] for r in manifest if r["role"] == "instance" and r["split"] == "train")
    dogs = [r for r in regs if "/dogs/" in r["file"]]
    assert {r["repeats"] for r in dogs} == {max(1, round(train_raw / 6))}, "balance: as many samples as the raw"
    assert {r["repeats"] for r in regs if "/cats/" in r["file"]} == {3}
    captions = {c["id"]: c["caption"] for c in io.read_jsonl(tmp / "c.jsonl")}
    assert {captions[r["id"]] for r in dogs} == {"a photo of a dog"}

    data = LatentData(index)
    weight_of = {item["id"]: w for item, w in zip(data.items, data.loss_weight)}
    assert {weight_of[r["id"]] for r in dogs} == {0.25}
    assert {weight_of[r["id"]] for r in regs if "/cats/" in r["file"]} == {2.0}
    assert {w for item, w in zip(data.items, data.loss_weight) if item["role"] == "instance"} == {1.0}
    # the weight each sample's loss is multiplied by in the training step (loop.micro_step)
    by_role = {}
    for s, i in enumerate(data.sample_items):
        by_role.setdefault(data.items[i]["role"], s)
    for s in by_role.values():  # one sample per batch: their buckets differ
        weight = data.batch([s], [False], [False])["weight"]
        assert torch.equal(weight, torch.tensor([data.loss_weight[data.sample_items[s]]]))
    assert sorted(weight_of[data.items[data.sample_items[s]]["id"]] for s in by_role.values()) != [1.0] * 2


def test_a_missing_folder_is_one_line(tmp_path, tiny_model, demo_source):
    from sdpipe.stages import prepare

    raw_cfg = small_config(tmp_path, demo_source, tiny_model, data={"regularisation": [{"dir": str(tmp_path / "no")}]})
    outputs = {"manifest": tmp_path / "m.jsonl", "rejected": tmp_path / "r.jsonl", "summary": tmp_path / "p.json"}
    with pytest.raises(UserError, match=r"data.regularisation: folder .*no does not exist"):
        prepare.run(config.from_dict(raw_cfg), {}, outputs)
