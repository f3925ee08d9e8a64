"""The caption stage: chain order, the per-image cache, tiny BLIP and open_clip models saved and loaded from disk."""

from __future__ import annotations

import hashlib
import json
import re
import sqlite3
from pathlib import Path

import pytest

from sdpipe import captioners, config, io, records
from sdpipe.captioners import free
from sdpipe.errors import UserError
from sdpipe.stages import caption

WORDS = "a red green blue circle square triangle on white black background photo of the".split()
VOCAB = ["circle", "square", "triangle"]
HEX64 = re.compile(r"^[0-9a-f]{64}$")


# --- tiny models, built once and saved like a user's checkpoint --------------------------------------------------


def _build_blip(out: Path, silent: bool = False) -> Path:
    import torch
    from transformers import BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor, BlipProcessor

    out.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", "[DEC]"] + WORDS
    (out / "vocab.txt").write_text("\n".join(vocab) + "\n")
    processor = BlipProcessor(
        image_processor=BlipImageProcessor(size={"height": 32, "width": 32}),
        tokenizer=BertTokenizer(str(out / "vocab.txt"), bos_token="[DEC]"),
    )
    vision = dict(
        hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, image_size=32, patch_size=8
    )
    text = dict(
        vocab_size=len(vocab),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        encoder_hidden_size=32,
        max_position_embeddings=64,
        bos_token_id=5,
        sep_token_id=3,
        pad_token_id=0,
        eos_token_id=3,
    )
    torch.manual_seed(0)
    model = BlipForConditionalGeneration(BlipConfig(text_config=text, vision_config=vision, projection_dim=16))
    if silent:  # a BLIP that ends every caption at once: it yields nothing
        with torch.no_grad():
            model.text_decoder.cls.predictions.bias[3] = 100.0
    model.save_pretrained(out)
    processor.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def blip_dir(tmp_path_factory) -> Path:
    return _build_blip(tmp_path_factory.mktemp("blip") / "tiny-blip")


@pytest.fixture(scope="session")
def silent_blip_dir(tmp_path_factory) -> Path:
    return _build_blip(tmp_path_factory.mktemp("blip") / "silent-blip", silent=True)


@pytest.fixture(scope="session")
def clip_files(tmp_path_factory) -> tuple[Path, Path]:
    import open_clip
    import torch

    root = tmp_path_factory.mktemp("clip")
    cfg = {
        "embed_dim": 16,
        "vision_cfg": {"image_size": 32, "layers": 1, "width": 32, "patch_size": 8, "head_width": 16},
        "text_cfg": {"context_length": 77, "vocab_size": 49408, "width": 32, "heads": 2, "layers": 1},
    }
    model_config = root / "sdpipe-tiny-clip.json"
    model_config.write_text(json.dumps(cfg))
    open_clip.add_model_config(model_config)
    torch.manual_seed(0)
    torch.save(open_clip.create_model("sdpipe-tiny-clip").state_dict(), root / "tiny-clip.pt")
    return model_config, root / "tiny-clip.pt"


# --- datasets and runs ---------------------------------------------------------------------------------------------


def add_image(raw: Path, rel: str, index: int, sidecar: str | None = None, folder: str = "") -> dict:
    from PIL import Image

    img = Image.new("RGB", (32, 32), ((index * 67) % 256, (index * 151) % 256, (index * 29) % 256))
    img.putpixel((index % 32, index // 32 % 32), (255, 255, 255))  # every image distinct, so ids differ
    path = raw / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path)
    return row_for(raw, rel, sidecar, folder)


def row_for(raw: Path, rel: str, sidecar: str | None = None, folder: str = "") -> dict:
    return {
        "version": records.MANIFEST_VERSION,
        "id": hashlib.sha256((raw / rel).read_bytes()).hexdigest(),
        "path": rel,
        "width": 32,
        "height": 32,
        "format": "PNG",
        "mode": "RGB",
        "bucket": [32, 32],
        "split": "train",
        "repeats": 1,
        "folder": folder,
        "sidecar": sidecar,
        "sidecar_path": str(Path(rel).with_suffix(".txt")) if sidecar else None,
    }


def make_cfg(tmp: Path, cache: str = "cache", **caption_values):
    caption_values.setdefault("gpus", 0)
    return config.from_dict(
        {"cache_dir": str(tmp / cache), "data": {"raw_dir": str(tmp / "raw")}, "caption": caption_values}
    )


def run_stage(tmp: Path, cfg, rows: list[dict], out: str = "out") -> tuple[dict, dict[str, dict]]:
    io.write_jsonl(tmp / "manifest.jsonl", rows)
    outputs = {"captions": tmp / out / "captions.jsonl", "summary": tmp / out / "summary.json"}
    caption.run(cfg, {"manifest": tmp / "manifest.jsonl"}, outputs)
    out = io.read_jsonl(outputs["captions"])
    assert [r["id"] for r in out] == [r["id"] for r in rows]  # one row per manifest row, same order
    return io.read_json(outputs["summary"]), {r["path"]: r for r in out}


def blip_settings(path: Path, **extra) -> dict:
    return {"model": str(path), "max_new_tokens": 6, "num_beams": 1, **extra}


def clip_settings(clip_files, **extra) -> dict:
    model_config, checkpoint = clip_files
    return {
        "model": "sdpipe-tiny-clip",
        "pretrained": str(checkpoint),
        "model_config": str(model_config),
        "vocabulary": VOCAB,
        "top_k": 2,
        "min_probability": 0.0,
        **extra,
    }


def forbid_loading(monkeypatch, module) -> None:
    monkeypatch.setattr(module, "load", lambda spec, device: pytest.fail(f"{spec.source} was loaded"))


# --- tests -----------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "stem, expected",
    [
        ("a_red_circle_on_a_white_background_0007", "a red circle on a white background"),
        ("sks-dog_12-3", "sks dog"),
        ("photo (3)", "photo"),
        ("IMG_0001", "IMG"),
        ("0001", ""),
        ("r2d2", "r2d2"),
    ],
)
def test_clean_stem(stem, expected):
    assert free.clean_stem(stem) == expected


def test_bad_template_and_missing_manifest(tmp_path):
    for template in ("{bogus}", "a {} photo", "{stem"):
        with pytest.raises(UserError, match="caption.template"):
            free.template_fields(template)
    with pytest.raises(UserError, match="snakemake prepare"):
        caption.run(
            make_cfg(tmp_path),
            {"manifest": tmp_path / "nope.jsonl"},
            {"captions": tmp_path / "c.jsonl", "summary": tmp_path / "s.json"},
        )


def test_a_manifest_an_older_sdpipe_wrote_asks_for_prepare_to_rerun(tmp_path):
    """Rows of another layout version (here: none, as sdpipe wrote them before rows carried one) stop the caption
    stage in one line that names the stage to rerun, before it reads a field."""
    row = add_image(tmp_path / "raw", "a.png", 0)
    for old in ({k: v for k, v in row.items() if k != "version"}, {**row, "version": records.MANIFEST_VERSION + 1}):
        with pytest.raises(UserError, match=r"layout version .* rerun the stage with `snakemake --forcerun prepare`"):
            run_stage(tmp_path, make_cfg(tmp_path, chain=["template"], template="x"), [old])
    assert run_stage(tmp_path, make_cfg(tmp_path, chain=["template"], template="x"), [row])[
        1
    ]  # this version's rows are read


def test_chain_order_and_fallthrough(tmp_path, blip_dir):
    raw = tmp_path / "raw"
    rows = [
        add_image(raw, "dogs/x_0001.png", 0, sidecar="a sidecar caption", folder="sks dog"),
        add_image(raw, "dogs/y_0002.png", 1, folder="sks dog"),
        add_image(raw, "0003.png", 2),
    ]
    cfg = make_cfg(
        tmp_path, chain=["sidecar", "template", "blip"], template="a photo of {folder}", blip=blip_settings(blip_dir)
    )
    summary, out = run_stage(tmp_path, cfg, rows)
    assert out["dogs/x_0001.png"]["caption"] == "a sidecar caption"
    assert out["dogs/x_0001.png"]["provenance"] == {"source": "sidecar", "file": "dogs/x_0001.txt"}
    assert out["dogs/y_0002.png"]["caption"] == "a photo of sks dog"
    assert out["dogs/y_0002.png"]["provenance"]["template"] == "a photo of {folder}"
    blip_row = out["0003.png"]
    assert blip_row["source"] == "blip" and blip_row["caption"] and blip_row["error"] is None
    assert set(blip_row["caption"].split()) <= set(WORDS)
    prov = blip_row["provenance"]
    assert prov["model"] == str(blip_dir) and HEX64.match(prov["weights_sha256"]) and prov["params"]["num_beams"] == 1
    assert summary["by_source"] == {"sidecar": 1, "template": 1, "blip": 1}
    assert (summary["captioned"], summary["reused"], summary["failed"], summary["total"]) == (3, 0, 0, 3)
    assert summary["chain"] == ["sidecar", "template", "blip"] and summary["devices"] == ["cpu"]


def test_empty_model_result_falls_through_to_clip_tags(tmp_path, silent_blip_dir, clip_files, monkeypatch):
    from sdpipe.captioners import blip, clip_tags

    raw = tmp_path / "raw"
    rows = [add_image(raw, f"img_{i}.png", i) for i in range(3)]
    cfg = make_cfg(
        tmp_path, chain=["blip", "clip_tags"], blip=blip_settings(silent_blip_dir), clip_tags=clip_settings(clip_files)
    )
    summary, out = run_stage(tmp_path, cfg, rows)
    for row in out.values():
        words = row["caption"].split(", ")
        assert row["source"] == "clip_tags" and len(words) == 2 and set(words) <= set(VOCAB)
        prov = row["provenance"]
        assert prov["pretrained"] == str(clip_files[1]) and HEX64.match(prov["weights_sha256"])
    assert summary["by_source"] == {"clip_tags": 3}
    # Empty BLIP results are cached too: a rerun loads neither model.
    forbid_loading(monkeypatch, blip)
    forbid_loading(monkeypatch, clip_tags)
    summary, again = run_stage(tmp_path, cfg, rows)
    assert (summary["captioned"], summary["reused"]) == (0, 3) and again == out


def test_clip_tags_below_threshold_fails_with_reason(tmp_path, clip_files, caplog):
    rows = [add_image(tmp_path / "raw", "a.png", 0)]
    cfg = make_cfg(tmp_path, chain=["clip_tags"], clip_tags=clip_settings(clip_files, min_probability=0.99))
    summary, out = run_stage(tmp_path, cfg, rows)
    assert out["a.png"]["caption"] is None and out["a.png"]["error"] == caption.NO_CAPTION
    assert summary["failed"] == 1
    assert f"1 image(s) have no caption: a.png: {caption.NO_CAPTION}" in caplog.text  # said, not only counted


def test_cache_reuse_additions_and_sidecar_change(tmp_path, blip_dir, monkeypatch):
    from sdpipe.captioners import blip

    raw = tmp_path / "raw"
    rows = [add_image(raw, f"s_{i}.png", i, sidecar=f"caption {i}") for i in range(2)]
    rows += [add_image(raw, f"{i:04d}.png", i) for i in range(2, 6)]
    cfg = make_cfg(tmp_path, chain=["sidecar", "template", "blip"], blip=blip_settings(blip_dir), batch_size=3)
    summary, first = run_stage(tmp_path, cfg, rows)
    assert (summary["captioned"], summary["reused"], summary["by_source"]) == (6, 0, {"sidecar": 2, "blip": 4})

    with monkeypatch.context() as m:
        forbid_loading(m, blip)
        summary, again = run_stage(tmp_path, cfg, rows)
    assert (summary["captioned"], summary["reused"], summary["failed"]) == (0, 6, 0) and again == first

    rows += [add_image(raw, f"{i:04d}.png", i) for i in range(6, 9)]
    summary, _ = run_stage(tmp_path, cfg, rows)
    assert (summary["captioned"], summary["reused"]) == (3, 6)

    rows[0] = {**rows[0], "sidecar": "a new caption"}
    summary, out = run_stage(tmp_path, cfg, rows)
    assert (summary["captioned"], summary["reused"]) == (1, 8) and out["s_0.png"]["caption"] == "a new caption"


def test_missing_weights_say_how_to_fix(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    rows = [add_image(tmp_path / "raw", "0001.png", 0)]
    cfg = make_cfg(tmp_path, chain=["blip"], blip={"model": "sdpipe-test/no-such-blip"})
    with pytest.raises(UserError, match=r"not in the local Hugging Face cache.*download"):
        run_stage(tmp_path, cfg, rows)
    cfg = make_cfg(tmp_path, chain=["clip_tags"], clip_tags={"model": "ViT-B-32", "pretrained": "laion2b_s34b_b79k"})
    with pytest.raises(UserError, match=r"not in the local cache; .*hf download laion/"):
        run_stage(tmp_path, cfg, rows)
    cfg = make_cfg(tmp_path, chain=["clip_tags"], clip_tags={"pretrained": str(tmp_path / "missing.pt")})
    with pytest.raises(UserError, match="does not exist"):
        run_stage(tmp_path, cfg, rows)


def test_corrupt_image_fails_only_itself(tmp_path, blip_dir):
    raw = tmp_path / "raw"
    rows = [add_image(raw, f"{i:04d}.png", i) for i in range(3)]
    (raw / "0099.png").write_bytes(b"\x89PNG\r\n\x1a\n not really a png")
    rows.insert(1, row_for(raw, "0099.png"))
    cfg = make_cfg(tmp_path, chain=["blip"], blip=blip_settings(blip_dir), batch_size=4)
    summary, out = run_stage(tmp_path, cfg, rows)
    assert out["0099.png"]["caption"] is None and out["0099.png"]["error"].startswith("blip: cannot read image")
    assert "\n" not in out["0099.png"]["error"]
    assert all(out[f"{i:04d}.png"]["caption"] for i in range(3))
    assert (summary["captioned"], summary["failed"], summary["errors"]) == (3, 1, 1)


def test_a_failing_batch_is_retried_image_by_image():
    def model(images):
        if "bad" in images:
            raise RuntimeError("boom\nsecond line")
        return [f"ok {im}" for im in images]

    assert captioners._run_model(model, ["x", "bad", "y"]) == [
        ("ok x", None),
        (None, "RuntimeError: boom"),
        ("ok y", None),
    ]


def test_two_cpu_workers_match_one(tmp_path, blip_dir, monkeypatch):
    raw = tmp_path / "raw"
    rows = [add_image(raw, f"{i:04d}.png", i) for i in range(6)]
    settings = {"chain": ["blip"], "blip": blip_settings(blip_dir), "batch_size": 2}
    _, one = run_stage(tmp_path, make_cfg(tmp_path, "cache-one", **settings), rows, "one")
    monkeypatch.setattr(caption, "caption_devices", lambda cfg: ["cpu", "cpu"])
    summary, two = run_stage(tmp_path, make_cfg(tmp_path, "cache-two", **settings), rows, "two")
    assert summary["devices"] == ["cpu", "cpu"] and summary["captioned"] == 6
    assert {p: r["caption"] for p, r in two.items()} == {p: r["caption"] for p, r in one.items()}


def test_a_killed_run_resumes_from_its_cache(tmp_path, blip_dir, monkeypatch):
    raw = tmp_path / "raw"
    rows = [add_image(raw, f"{i:04d}.png", i) for i in range(5)]
    cfg = make_cfg(tmp_path, chain=["blip"], blip=blip_settings(blip_dir), batch_size=2)
    real, calls = captioners._caption_batch, []

    def dies_on_second_batch(*args):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt  # what a kill looks like from inside: the batch in flight is lost
        return real(*args)

    monkeypatch.setattr(captioners, "_caption_batch", dies_on_second_batch)
    with pytest.raises(KeyboardInterrupt):
        run_stage(tmp_path, cfg, rows)
    with sqlite3.connect(tmp_path / "cache" / "captions.sqlite") as db:
        assert db.execute("SELECT COUNT(*) FROM captions").fetchone()[0] == 2
    assert not (tmp_path / "out" / "captions.jsonl").exists()
    monkeypatch.setattr(captioners, "_caption_batch", real)
    summary, out = run_stage(tmp_path, cfg, rows)
    assert (summary["captioned"], summary["reused"], summary["failed"]) == (3, 2, 0)
    assert all(r["caption"] for r in out.values())


def test_blip_conditional_prompt(tmp_path, blip_dir):
    rows = [add_image(tmp_path / "raw", f"{i:04d}.png", i) for i in range(2)]
    cfg = make_cfg(tmp_path, chain=["blip"], blip=blip_settings(blip_dir, prompt="a photo of"))
    _, out = run_stage(tmp_path, cfg, rows)
    for row in out.values():
        assert row["caption"].startswith("a photo of ") and row["provenance"]["params"]["prompt"] == "a photo of"
