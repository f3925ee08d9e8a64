"""The latent cache: keys, sharded store, incremental reruns, several CPU processes, crash and resume."""

from __future__ import annotations

import hashlib
import io as pyio
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml
from PIL import Image

from sdpipe import config, io, records
from sdpipe.cache_store import ShardStore
from sdpipe.errors import UserError
from sdpipe.latents import plan
from sdpipe.preprocess import Preprocess, cover_and_crop
from sdpipe.stages import latents
from tests.conftest import small_config

COLOURS = [(220, 30, 30), (30, 160, 40), (30, 60, 220), (240, 200, 20), (150, 40, 170), (250, 120, 0)]


def _png(colour, size) -> bytes:
    img = Image.new("RGB", size, colour)
    img.paste((255, 255, 255), (0, 0, size[0] // 3, size[1]))  # asymmetric, so a flip changes the latent
    buf = pyio.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


def make_inputs(tmp: Path, count: int, sizes=((64, 64), (96, 48))) -> tuple[Path, Path, Path]:
    """Raw images plus the manifest and captions the two earlier stages would write."""
    raw = tmp / "raw"
    raw.mkdir(parents=True, exist_ok=True)
    manifest, captions = [], []
    for i in range(count):
        size = sizes[i % len(sizes)]
        data = _png(COLOURS[i % len(COLOURS)], size)
        path = f"img_{i:03d}.png"
        if i >= len(COLOURS):  # distinct bytes for every image: vary one pixel
            img = Image.open(pyio.BytesIO(data)).copy()
            img.putpixel((0, 0), (i, i, i))
            buf = pyio.BytesIO()
            img.save(buf, format="PNG")
            data = buf.getvalue()
        (raw / path).write_bytes(data)
        image_id = hashlib.sha256(data).hexdigest()
        bucket = [32, 32] if size[0] == size[1] else [48, 24]
        manifest.append(
            {
                "version": records.MANIFEST_VERSION,
                "id": image_id,
                "path": path,
                "width": size[0],
                "height": size[1],
                "format": "PNG",
                "mode": "RGB",
                "bucket": bucket,
                "split": "train",
                "repeats": 1,
                "folder": "",
                "sidecar": f"caption {i % 4}",
                "sidecar_path": None,
            }
        )
        captions.append(
            {
                "version": records.CAPTIONS_VERSION,
                "id": image_id,
                "path": path,
                "split": "train",
                "caption": f"caption {i % 4}",
                "source": "sidecar",
                "provenance": {"source": "sidecar"},
                "error": None,
            }
        )
    io.write_jsonl(tmp / "manifest.jsonl", manifest)
    io.write_jsonl(tmp / "captions.jsonl", captions)
    return raw, tmp / "manifest.jsonl", tmp / "captions.jsonl"


def run_stage(tmp: Path, raw: Path, model: Path, out: str = "out", **latent_settings) -> dict:
    cfg = config.from_dict(small_config(tmp, raw, model, latents=latent_settings))
    outputs = {"index": tmp / out / "index.json", "summary": tmp / out / "summary.json"}
    return latents.run(cfg, {"manifest": tmp / "manifest.jsonl", "captions": tmp / "captions.jsonl"}, outputs)


def test_cover_and_crop_fills_the_bucket_and_random_crops_repeat():
    img = Image.new("RGB", (100, 40), (0, 0, 0))
    out, (top, left) = cover_and_crop(img, Preprocess(bucket=(32, 32)), "id")
    assert out.size == (32, 32) and top == 0 and left > 0
    p = Preprocess(bucket=(32, 32), crop="random")
    assert cover_and_crop(img, p, "abc")[1] == cover_and_crop(img, p, "abc")[1]


def test_store_ignores_half_written_shards_and_compacts(tmp_path):
    store = ShardStore(tmp_path)
    for i in range(5):
        store.write_shard({f"k{i}": {"latent": torch.full((4, 2, 2), float(i))}})
    (tmp_path / ".shard-123.safetensors.tmp").write_bytes(b"half a shard")
    assert len(store.shards()) == 5
    where = store.compact()
    assert len(store.shards()) == 1 and set(where) == {f"k{i}" for i in range(5)}
    assert torch.equal(store.load("k3")["latent"], torch.full((4, 2, 2), 3.0))
    assert json.loads((tmp_path / "index.json").read_text())["keys"] == where


def test_encodes_then_reuses_everything(tmp_path, tiny_model):
    raw, _, _ = make_inputs(tmp_path, 8)
    first = run_stage(tmp_path, raw, tiny_model, batch_size="auto")
    assert (first["encoded"], first["reused"], first["failed"]) == (8, 0, 0)
    assert first["text_encoded"] == 4 and first["images_per_s"] > 0
    assert first["batch_sizes"] == {"cpu": 8}  # what auto means on a CPU, recorded
    second = run_stage(tmp_path, raw, tiny_model, out="again")
    assert (second["encoded"], second["reused"], second["text_encoded"]) == (0, 8, 0)
    assert second["images_per_s"] is None and second["batch_sizes"] == {}


def test_index_points_at_latents_of_the_bucket_shape(tmp_path, tiny_model):
    raw, _, _ = make_inputs(tmp_path, 4)
    run_stage(tmp_path, raw, tiny_model, flip=True)
    index = io.read_json(tmp_path / "out" / "index.json")
    lat, text = ShardStore(index["latent_store"]), ShardStore(index["text_store"])
    for item in index["items"]:
        w, h = item["bucket"]
        plain, flipped = lat.load(item["latent_key"])["latent"], lat.load(item["flip_key"])["latent"]
        assert plain.shape == flipped.shape == (4, h // 4, w // 4)  # the tiny VAE: 4 latent channels, downsampling 4
        assert not torch.allclose(plain, flipped)
        assert text.load(item["text_key"])["hidden"].shape == (77, 64)
    assert index["model"]["vae_sha256"] and index["model"]["family"] == "sd"


def test_training_sees_latents_scaled_as_pipelines_decode_them(tmp_path, tiny_model):
    """The cache holds raw posterior means; training must scale them by the VAE's scaling_factor, because every
    pipeline decodes `latents / scaling_factor`. Unscaled, a model learns latents several times too small or large,
    and its images come out with shifted colours."""
    from diffusers import AutoencoderKL

    from sdpipe.train.data import LatentData

    raw, _, _ = make_inputs(tmp_path, 2)
    run_stage(tmp_path, raw, tiny_model)
    data = LatentData(tmp_path / "out" / "index.json")
    vae = AutoencoderKL.from_pretrained(tiny_model, subfolder="vae")
    cached = ShardStore(data.index["latent_store"]).load(data.items[0]["latent_key"])["latent"]
    trained_on = data.batch([0], [False], [False])["latents"][0]
    torch.testing.assert_close(trained_on, cached * vae.config.scaling_factor)


def test_dtype_and_preprocessing_are_part_of_the_key(tmp_path, tiny_model):
    raw, _, _ = make_inputs(tmp_path, 4)
    run_stage(tmp_path, raw, tiny_model)
    assert run_stage(tmp_path, raw, tiny_model, out="bf16", dtype="bf16")["encoded"] == 4
    assert run_stage(tmp_path, raw, tiny_model, out="bilinear", interpolation="bilinear")["encoded"] == 4
    index = io.read_json(tmp_path / "bf16" / "index.json")
    assert ShardStore(index["latent_store"]).load(index["items"][0]["latent_key"])["latent"].dtype == torch.bfloat16


def test_two_cpu_processes_match_one(tmp_path, tiny_model):
    raw, _, _ = make_inputs(tmp_path, 6)
    cfg_dirs = {}
    for name, procs in (("one", 1), ("two", 2)):
        work = tmp_path / name
        work.mkdir()
        for f in ("manifest.jsonl", "captions.jsonl"):
            (work / f).write_bytes((tmp_path / f).read_bytes())
        summary = run_stage(work, raw, tiny_model, cpu_processes=procs)
        assert summary["devices"] == ["cpu"] * procs and summary["encoded"] == 6
        cfg_dirs[name] = work
    a, b = (io.read_json(cfg_dirs[n] / "out" / "index.json") for n in ("one", "two"))
    assert [i["latent_key"] for i in a["items"]] == [i["latent_key"] for i in b["items"]]
    for item in a["items"]:
        x = ShardStore(a["latent_store"]).load(item["latent_key"])["latent"]
        y = ShardStore(b["latent_store"]).load(item["latent_key"])["latent"]
        torch.testing.assert_close(x, y, rtol=1e-5, atol=1e-5)


def test_changed_file_fails_only_that_image_and_says_so(tmp_path, tiny_model, caplog):
    raw, _, _ = make_inputs(tmp_path, 4)
    (raw / "img_001.png").write_bytes(_png((1, 2, 3), (64, 64)))
    summary = run_stage(tmp_path, raw, tiny_model)
    assert (summary["encoded"], summary["failed"]) == (3, 1)
    failed = io.read_json(tmp_path / "out" / "index.json")["failed"]
    assert failed[0]["path"] == "img_001.png" and "rerun prepare" in failed[0]["reason"]
    warned = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    assert any("1 image(s) left out of training: img_001.png: " in m for m in warned), warned


def test_no_image_encoded_is_one_line_naming_why(tmp_path, tiny_model):
    """Once seen under S3 storage: every image missing where the job looked, and the stage said only
    "40 failed"."""
    raw, _, _ = make_inputs(tmp_path, 4)
    for image in raw.glob("*.png"):
        image.unlink()
    with pytest.raises(UserError, match=r"no image could be encoded: img_000.png: .* \(and 1 more"):
        run_stage(tmp_path, raw, tiny_model)


def test_bucket_not_divisible_by_vae_is_a_user_error(tmp_path, tiny_model):
    raw, manifest, _ = make_inputs(tmp_path, 2)
    rows = io.read_jsonl(manifest)
    rows[0]["bucket"] = [30, 30]
    io.write_jsonl(manifest, rows)
    with pytest.raises(UserError, match="prepare.buckets.step"):
        run_stage(tmp_path, raw, tiny_model)


def test_kill_during_caching_loses_only_the_batch_in_flight(tmp_path, tiny_model):
    raw, manifest, captions = make_inputs(tmp_path, 40)
    cfg_path = tmp_path / "config.yaml"
    cfg_path.write_text(yaml.safe_dump(small_config(tmp_path, raw, tiny_model, latents={"batch_size": 1})))
    cmd = [
        sys.executable,
        "-m",
        "sdpipe",
        "latents",
        "--config",
        str(cfg_path),
        "--manifest",
        str(manifest),
        "--captions",
        str(captions),
        "--index",
        str(tmp_path / "i.json"),
        "--summary",
        str(tmp_path / "s.json"),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    store = ShardStore(tmp_path / "cache" / "latents")
    deadline = time.time() + 120
    while len(store.shards()) < 3 and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done_before = len(store.scan())
    assert 0 < done_before < 40, "the kill should land mid-run"
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    summary = io.read_json(tmp_path / "s.json")
    assert summary["reused"] == done_before and summary["encoded"] == 40 - done_before


def test_compiled_encoder_uses_plain_attention_only_where_its_scores_fit():
    from types import SimpleNamespace

    from sdpipe.latents import encode as encode_worker

    vae = SimpleNamespace(config=SimpleNamespace(block_out_channels=(128, 256, 512, 512)))  # SD's VAE: 8x down

    def jobs(*sizes):
        return [{"pre": {"bucket": [s, s]}} for s in sizes]

    assert encode_worker._math_attention_fits(vae, 32, jobs(512, 448))  # 4096 tokens: 3.2 GB of scores
    assert encode_worker._math_attention_fits(vae, 64, jobs(512))  # 6.4 GB: auto's batch on an H200
    assert not encode_worker._math_attention_fits(vae, 32, jobs(512, 1024))  # one 1024 px bucket: 51 GB


def test_the_compiled_encoder_turns_on_cudnns_autotuner(tiny_model, monkeypatch):
    """Every encoder speed in benchmarks/NOTES.md was measured with cudnn.benchmark; the stage had left it off
    (batch 64: 389.6 images/s in the stage against 415.8 bare, v10). Compiling is lazy, so this runs on a CPU."""
    from sdpipe.latents import encode as encode_worker

    monkeypatch.setattr(torch.backends.cudnn, "benchmark", False)
    settings = {"pretrained": str(tiny_model), "revision": None, "variant": None, "dtype": "fp32"}
    vae, _ = encode_worker._load_vae("cpu", settings)
    jobs = [{"pre": {"bucket": [64, 64]}}]
    encode_worker._encoder(vae, "cpu", "eager", 2, jobs)
    assert not torch.backends.cudnn.benchmark  # eager encoding changes no process-wide setting
    encode_worker._encoder(vae, "cpu", "compiled", 2, jobs)
    assert torch.backends.cudnn.benchmark


@pytest.mark.parametrize(
    ("free_gib", "bucket", "dtype", "expected"),
    [
        (130, [512, 512], torch.bfloat16, 64),  # an H200 at SD resolution: the fastest batch measured (v10)
        (22, [512, 512], torch.bfloat16, 32),  # a 24 GB card: 64 would need about 20.3 GiB, more than 80 % of 22
        (22, [512, 512], torch.float32, 16),  # float32 activations take twice the memory
        (130, [1024, 1024], torch.float32, 32),  # 2.5 GiB an image: 64 would take 162
        (0.5, [1024, 1024], torch.bfloat16, 1),  # nothing fits: one image at a time rather than no run
    ],
)
def test_auto_batch_is_the_largest_that_fits_in_free_gpu_memory(monkeypatch, free_gib, bucket, dtype, expected):
    from sdpipe.latents import encode as encode_worker

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device: (int(free_gib * 2**30), 141 * 2**30))
    jobs = [{"pre": {"bucket": [256, 256]}}, {"pre": {"bucket": bucket}}]  # the largest bucket decides
    assert encode_worker.batch_size("auto", "cuda:0", dtype, jobs) == expected
    assert encode_worker.batch_size("auto", "cpu", dtype, jobs) == encode_worker.CPU_BATCH
    assert encode_worker.batch_size(12, "cuda:0", dtype, jobs) == 12  # a configured number is kept


@pytest.mark.parametrize("preset, multiple", [("sd15", 64), ("sdxl", 32), ("tiny", 8)])
def test_buckets_must_fit_the_vae_and_the_unet_downsampling(tmp_path, preset, multiple):
    """A bucket step of 8 passed with SD 1.5 (its VAE alone divides by 8) and failed later in the UNet: the rule is
    the VAE's factor times the UNet's, read from the model's config files (no weights loaded)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel

    from sdpipe import model_facts
    from sdpipe.config import from_dict
    from sdpipe.models import presets

    root = tmp_path / preset
    AutoencoderKL.from_config(presets.vae_config(preset)).save_config(root / "vae")
    UNet2DConditionModel.from_config(presets.unet_config(preset)).save_config(root / "unet")
    (root / "model_index.json").write_text('{"_class_name": "StableDiffusionPipeline"}')
    cfg = from_dict({"model": {"pretrained": str(root)}})
    assert model_facts.bucket_multiple(*model_facts.configs(cfg)) == multiple
    plan.check_buckets([{"bucket": [multiple * 3, multiple * 2]}], multiple)
    with pytest.raises(UserError, match=f"set prepare.buckets.step to a multiple of {multiple}"):
        plan.check_buckets([{"bucket": [multiple * 3 + multiple // 2, multiple * 2]}], multiple)
