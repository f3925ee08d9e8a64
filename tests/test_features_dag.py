"""Issue 29's training features from a template through the whole DAG on the tiny preset: `sdpipe init --template
sd15-lora`, then `snakemake --profile runpod` with mask files beside half the photos, tag captions shuffled into
cached variants, a second resolution, a regularisation folder, 8-bit AdamW, the held-out loss and a LoHa adapter
instead of a LoRA. One run covers them all, to keep the suite's time."""

from __future__ import annotations

import json
import sys

import pytest
import yaml
from PIL import Image

from sdpipe import config
from tests.workflow_helpers import TEMPLATE_FAST, run

pytestmark = pytest.mark.slow
FEATURES = {
    "data": {"masks": {"source": "file"}},
    "latents": {"tags": {"shuffle": True, "keep_first": 1, "variants": 3}},
    "prepare": {"eval_fraction": 0.5, "buckets": {"also_at": [48]}},  # some photos held out (by content id)
    "train": {"optimizer": "adamw_8bit", "validation": {"heldout_every": 1}, "lora": {"type": "loha"}},
}


@pytest.fixture
def photos(tmp_path, demo_source):
    """Six demo photos; the even ones with a mask of their left half; each with a tag caption. Three others in a
    regularisation folder."""
    out, reg = tmp_path / "photos", tmp_path / "reg"
    out.mkdir()
    reg.mkdir()
    for image in sorted(demo_source.rglob("*.png"))[6:9]:
        (reg / image.name).write_bytes(image.read_bytes())
    for n, image in enumerate(sorted(demo_source.rglob("*.png"))[:6]):
        (out / image.name).write_bytes(image.read_bytes())
        (out / f"{image.stem}.txt").write_text(f"sks shape, tag{n}, bright, flat colours, centred")
        if n % 2 == 0:
            with Image.open(image) as img:
                drawn = Image.new("L", img.size, 0)
                drawn.paste(255, (0, 0, img.width // 2, img.height))
            drawn.save(out / f"{image.stem}_mask.png")
    return out


def test_a_template_job_trains_with_every_feature_through_the_whole_dag(tmp_path, photos):
    from sdpipe.models import presets

    model = presets.build_and_save("tiny", tmp_path / "models" / "tiny", seed=0)
    project = tmp_path / "job"
    init = [sys.executable, "-m", "sdpipe", "init", str(project), "--template", "sd15-lora", "--images", str(photos)]
    run([*init, "--model", str(model), "--prompt", "a red circle"], tmp_path)
    regularisation = {"data": {"regularisation": [{"dir": str(tmp_path / "reg"), "weight": 0.5, "caption": "a shape"}]}}
    fast = config.merge(config.merge(TEMPLATE_FAST, FEATURES), regularisation)
    (project / "fast.yaml").write_text(yaml.safe_dump(fast))
    configs = ["--configfile", "config/config.yaml", "fast.yaml"]
    run(["snakemake", "--profile", "runpod", "--cores", "2", *configs], project)

    read = lambda rel: json.loads((project / rel).read_text())
    manifest = [json.loads(line) for line in (project / "results/prepare/manifest.jsonl").read_text().splitlines()]
    photos = {row["id"] for row in manifest if row["role"] == "instance"}
    assert len(photos) == 6 and not any("_mask" in row["path"] for row in manifest), "masks are not images"
    held = [row for row in manifest if row["split"] == "eval"]
    regs = [item for item in read("results/latents/index.json")["items"] if item["role"] == "regularisation"]
    assert len({item["id"] for item in regs}) == 3
    assert {(item["loss_weight"], item["caption"]) for item in regs} == {(0.5, "a shape")}
    assert read("results/latents/summary.json")["masks"]["images_without_a_mask_file"] == 3 + 3  # and the folder's
    items = [item for item in read("results/latents/index.json")["items"] if item["role"] == "instance"]
    assert all(item["mask_key"] for item in items)
    sizes = {}  # prepare.buckets.also_at: each training photo at 32 and at 48 px
    for item in items:
        sizes.setdefault(item["id"], set()).add(item["bucket"][0] * item["bucket"][1] > 40 * 40)
    assert set(map(frozenset, sizes.values())) == {frozenset({False, True})}
    for item in items:  # the first tag stays first in every cached variant
        assert len(item["text_keys"]) == 3 and all(v.startswith("sks shape, ") for v in item["caption_variants"])
    assert read("results/train/final/final.json")["optimizer_steps"] == TEMPLATE_FAST["train"]["max_steps"]
    assert "optimizer: adamw_8bit" in (project / "results/train/config.yaml").read_text()
    assert read("results/latents/summary.json")["heldout_images"] == len(held) > 0
    rows = (project / "results/train/metrics.csv").read_text().splitlines()
    heldout = [line.split(",")[-1] for line in rows[1:]]
    assert rows[0].endswith(",heldout_loss") and len(heldout) == 3 and all(float(v) > 0 for v in heldout)
    formats = read("results/export/summary.json")["formats"]
    assert all(result["verified"] for result in formats.values())
    assert set(formats) >= {"diffusers", "lora", "lora_kohya"}
    assert "merge_file" in formats["lora_kohya"]["loader"], "the LyCORIS file read with ComfyUI's arithmetic"
    from safetensors import safe_open

    with safe_open(str(project / formats["lora_kohya"]["path"]), framework="pt") as f:
        keys, meta = list(f.keys()), f.metadata()
    assert any(k.endswith(".hada_w1_a") for k in keys) and meta["ss_network_module"] == "lycoris.kohya"
    card = (project / "results/card/README.md").read_text()
    assert "LoHa (LyCORIS)" in card and "pipe.load_lora_weights" not in card, "diffusers reads no LoHa file"


def test_a_dora_with_schedule_free_adamw_and_concepts_through_the_whole_dag(tmp_path, demo_source):
    """The rest of issue 29's rows from the same template: a DoRA (its kohya file verified with ComfyUI's reading
    of dora_scale), schedule-free AdamW, and per-folder settings."""
    from sdpipe.models import presets

    photos = tmp_path / "photos"
    for n, image in enumerate(sorted(demo_source.rglob("*.png"))[:6]):
        folder = photos / ("alice" if n < 3 else "styles")
        folder.mkdir(parents=True, exist_ok=True)
        (folder / image.name).write_bytes(image.read_bytes())
        (folder / f"{image.stem}.txt").write_text("a shape")
    model = presets.build_and_save("tiny", tmp_path / "models" / "tiny", seed=0)
    project = tmp_path / "job"
    init = [sys.executable, "-m", "sdpipe", "init", str(project), "--template", "sd15-lora", "--images", str(photos)]
    run([*init, "--model", str(model), "--prompt", "a red circle"], tmp_path)
    rest = {
        "data": {
            "concepts": [
                {"folder": "alice", "repeats": 2, "caption_prefix": "ohwx"},
                {"folder": "styles", "weight": 0.5},
            ]
        },
        "train": {"lora": {"dora": True}, "optimizer": "adamw_schedulefree", "lr_scheduler": "constant"},
    }
    (project / "fast.yaml").write_text(yaml.safe_dump(config.merge(TEMPLATE_FAST, rest)))
    run(
        ["snakemake", "--profile", "runpod", "--cores", "2", "--configfile", "config/config.yaml", "fast.yaml"], project
    )

    read = lambda rel: json.loads((project / rel).read_text())
    items = read("results/latents/index.json")["items"]
    alice = [i for i in items if "alice" in i["path"]]
    styles = [i for i in items if "styles" in i["path"]]
    assert {i["repeats"] for i in alice} == {2} and {i["loss_weight"] for i in styles} == {0.5}
    captions = [json.loads(line) for line in (project / "results/captions/captions.jsonl").read_text().splitlines()]
    assert {c["caption"] for c in captions if "alice" in c["path"]} == {"ohwx, a shape"}
    assert "optimizer: adamw_schedulefree" in (project / "results/train/config.yaml").read_text()
    formats = read("results/export/summary.json")["formats"]
    assert all(result["verified"] for result in formats.values())
    assert "merge_file" in formats["lora_kohya"]["loader"], "diffusers would drop the dora_scale"
    assert "DoRA" in (project / "results/card/README.md").read_text()
