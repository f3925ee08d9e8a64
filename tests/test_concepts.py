"""data.concepts: per-folder settings under data.raw_dir (repeats, loss weight, caption, caption prefix, bucket
resolution) reach the manifest, the captions, the latent cache and the weight each sample's loss is multiplied by."""

from __future__ import annotations

import shutil

import pytest

from sdpipe import config, io
from sdpipe.errors import UserError
from sdpipe.train.data import LatentData
from tests.conftest import cache_latents, small_config

CONCEPTS = [
    {"folder": "dogs", "repeats": 3, "weight": 0.5, "caption_prefix": "sks", "resolution": 48},
    {"folder": "dogs/puppies", "caption": "a puppy"},  # deeper: wins over dogs for its images
]


@pytest.fixture(scope="module")
def cached(tmp_path_factory, demo_source, tiny_model):
    tmp = tmp_path_factory.mktemp("concepts")
    images = sorted(demo_source.rglob("*.png"))
    for folder, chosen in (("raw/other", images[:3]), ("raw/dogs", images[3:6]), ("raw/dogs/puppies", images[6:8])):
        (tmp / folder).mkdir(parents=True)
        for image in chosen:
            shutil.copy(image, tmp / folder / image.name)
            (tmp / folder / f"{image.stem}.txt").write_text("a shape")
    raw_cfg = small_config(tmp, tmp / "raw", tiny_model, data={"concepts": CONCEPTS})
    return cache_latents(tmp, raw_cfg), tmp


def test_each_folder_trains_with_its_own_settings(cached):
    index, tmp = cached
    manifest = {r["id"]: r for r in io.read_jsonl(tmp / "m.jsonl")}
    where = {i: r["path"].split("/")[-2] for i, r in manifest.items()}
    captions = {c["id"]: c["caption"] for c in io.read_jsonl(tmp / "c.jsonl")}
    assert io.read_json(tmp / "p.json")["concepts"] == {"dogs": 3, "dogs/puppies": 2}
    for i, folder in where.items():
        row = manifest[i]
        if folder == "dogs":
            assert (row["repeats"], row["loss_weight"], captions[i]) == (3, 0.5, "sks, a shape")
            assert row["bucket"][0] * row["bucket"][1] > 40 * 40, "its own 48 px resolution"
        elif folder == "puppies":
            assert (row["repeats"], row.get("loss_weight"), captions[i]) == (1, None, "a puppy")
        else:
            assert (row["repeats"], row.get("loss_weight"), captions[i]) == (1, None, "a shape")
            assert row["bucket"][0] * row["bucket"][1] <= 40 * 40
    data = LatentData(index)
    weight = {item["id"]: w for item, w in zip(data.items, data.loss_weight)}
    assert {weight[i] for i, f in where.items() if f == "dogs"} == {0.5}
    assert {weight[i] for i, f in where.items() if f != "dogs"} == {1.0}
    samples = [data.items[s]["id"] for s in data.sample_items]
    assert all(samples.count(i) == (3 if f == "dogs" else 1) for i, f in where.items())


def test_a_concept_folder_without_images_is_one_line(tmp_path, tiny_model, demo_source):
    from sdpipe.stages import prepare

    outputs = {"manifest": tmp_path / "m.jsonl", "rejected": tmp_path / "r.jsonl", "summary": tmp_path / "p.json"}
    for folder, message in (("nowhere", "does not exist under data.raw_dir"), (".", "")):
        raw_cfg = small_config(tmp_path, demo_source, tiny_model, data={"concepts": [{"folder": folder}]})
        if not message:  # "." holds every image: accepted
            prepare.run(config.from_dict(raw_cfg), {}, outputs)
            continue
        with pytest.raises(UserError, match=f"data.concepts: folder {folder} {message}"):
            prepare.run(config.from_dict(raw_cfg), {}, outputs)
