"""Export (every format reloaded with diffusers' loaders and compared by image), evaluation (sharded, metrics
null with a reason when their weights are missing) and the scaling benchmark, on runs of the tiny preset."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from sdpipe import config, io
from sdpipe.errors import UserError
from sdpipe.stages import benchmark, evaluate, export, train
from tests.conftest import cache_latents, small_config

pytestmark = pytest.mark.slow
TRAIN = {
    "max_steps": 2,
    "per_device_batch_size": 4,
    "lr_warmup_steps": 0,
    "learning_rate": 0.01,
    "checkpoint_every": 100,
    "num_processes": 1,
    "validation": {"every": 0},
}
VERIFY = {"prompt": "a red circle on a white background", "steps": 3, "guidance": 2.0}
EVALUATE = {
    "prompts": ["a red circle on a white background", "a blue square on a black background"],
    "seeds": [0, 1, 2],
    "steps": 3,
    "guidance": 2.0,
    "gpus": 0,
    "fid": {"inception_weights": None},
    "clip_score": {"enabled": True},
}


@pytest.fixture(scope="module")
def data(tmp_path_factory, demo_source, tiny_model):
    """Prepared, captioned and cached demo images (eval split 25%), as the real stages make them."""
    tmp = tmp_path_factory.mktemp("exp")
    raw = small_config(tmp, demo_source, tiny_model)
    raw["prepare"]["eval_fraction"] = 0.25
    cache_latents(tmp, raw)
    return tmp, raw


def _cfg(data, **sections):
    raw = {
        **data[1],
        "train": {**TRAIN, **sections.pop("train", {})},
        "export": {"verify": VERIFY, "dtype": "fp32"},
        "evaluate": EVALUATE,
    }
    for name, values in sections.items():
        raw[name] = {**raw.get(name, {}), **values}
    return config.from_dict(raw)


def _train(data, out: Path, **train_settings):
    cfg = _cfg(data, train=train_settings)
    train.run(cfg, {"index": data[0] / "index.json"}, {"out": out, "summary": out / "summary.json"})
    return out / "final"


@pytest.fixture(scope="module")
def full_run(data, tmp_path_factory):
    return _train(data, tmp_path_factory.mktemp("full") / "train", mode="full")


def test_full_fine_tune_exports_reload_pixel_exact_in_fp32(data, full_run, tmp_path):
    summary = export.run(_cfg(data), {"final": full_run}, {"out": tmp_path, "summary": tmp_path / "s.json"})
    assert set(summary["formats"]) == {"diffusers", "single_file"}
    assert summary["formats"]["single_file"]["path"] == str(tmp_path / "model.safetensors")  # export.name: null
    assert (summary["family"], summary["base_model_version"]) == ("sd", "sd_v1")
    for name, result in summary["formats"].items():
        assert result["verified"] and result["max_abs_diff"] == 0, (name, result)
    assert summary["formats"]["single_file"]["loader"] == "StableDiffusionPipeline.from_single_file"
    assert io.read_json(tmp_path / "s.json") == summary


def test_fp16_export_stays_within_tolerance(data, full_run, tmp_path):
    cfg = _cfg(data, export={"dtype": "fp16"})
    summary = export.run(cfg, {"final": full_run}, {"out": tmp_path, "summary": tmp_path / "s.json"})
    unet = next((tmp_path / "diffusers" / "unet").glob("*.safetensors"))
    import torch
    from safetensors.torch import load_file

    assert all(t.dtype == torch.float16 for t in load_file(str(unet)).values())
    assert all(r["verified"] for r in summary["formats"].values())


def test_lora_run_exports_diffusers_and_kohya_loras_under_the_configured_name(data, tmp_path):
    from sdpipe.export.names import export_files

    final = _train(data, tmp_path / "train", mode="lora", text_encoder={"mode": "lora"}, lora={"rank": 4, "alpha": 2})
    out = tmp_path / "e"
    (out / "lora").mkdir(parents=True)
    for stale in ("model.safetensors", "lora/pytorch_lora_weights.safetensors"):  # an export under no name
        (out / stale).write_bytes(b"old")
    cfg = _cfg(data, export={"name": "my-dog"})
    summary = export.run(cfg, {"final": final}, {"out": out, "summary": tmp_path / "s.json"})
    files = export_files("my-dog", single_file=True, lora=True)
    assert (files.single_file, files.lora_file, files.lora_kohya) == (
        "my-dog.safetensors",
        "lora/my-dog_lora.safetensors",
        "my-dog_lora_kohya.safetensors",
    )
    assert {k: v["path"] for k, v in summary["formats"].items()} == {k: str(out / v) for k, v in files.files().items()}
    assert sorted(str(p.relative_to(out)) for p in out.rglob("*.safetensors") if "diffusers" not in p.parts) == sorted(
        [files.single_file, files.lora_file, files.lora_kohya]
    )  # the old names are gone
    assert all(r["verified"] for r in summary["formats"].values()), summary["formats"]
    assert summary["formats"]["lora"]["max_abs_diff"] == 0  # the adapter as trained, loaded the way users do
    from safetensors import safe_open

    for name in (files.lora_kohya, files.lora_file, files.single_file):
        with safe_open(str(out / name), framework="pt") as f:
            meta = f.metadata()
        lora = "lora" in name
        assert meta["modelspec.title"] == meta["ss_output_name"] == "my-dog"
        # what A1111/Forge/ComfyUI/Civitai read to class the file: the tiny preset is an SD 1.x pipeline
        assert meta["ss_base_model_version"] == "sd_v1" and meta["ss_v2"] == "False"
        assert meta["modelspec.architecture"] == "stable-diffusion-v1" + ("/lora" if lora else "")
        assert meta["modelspec.sai_model_spec"] == "1.0.0" and meta["ss_resolution"] == "(32, 32)"
        assert (meta.get("ss_network_dim"), meta.get("ss_network_alpha")) == (("4", "2") if lora else (None, None))
    with safe_open(str(out / files.lora_file), framework="pt") as f:
        assert "lora_adapter_metadata" in f.metadata()  # diffusers' own alphas stay beside ours
    # the folder loads as the card and README say: load_lora_weights(folder, weight_name=...)
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(str(cfg.model.pretrained))
    pipe.load_lora_weights(str(out / files.lora_dir), weight_name=files.lora_weight)
    assert pipe.get_active_adapters()


def test_lora_against_another_base_and_missing_run_are_one_line(data, tmp_path):
    from sdpipe.models import presets

    final = _train(data, tmp_path / "train", mode="lora")
    other = presets.build_and_save("tiny-sdxl", tmp_path / "xl")
    cfg = _cfg(data, model={"pretrained": str(other)})
    with pytest.raises(UserError, match="LoRA"):
        export.run(cfg, {"final": final}, {"out": tmp_path / "e", "summary": tmp_path / "s.json"})
    assert not (tmp_path / "e" / "verify").exists()  # refused before any rendering
    with pytest.raises(UserError, match="run `snakemake train` first"):
        export.run(_cfg(data), {"final": tmp_path / "nothing"}, {"out": tmp_path / "e", "summary": tmp_path / "s"})


@pytest.fixture(scope="module")
def exported(data, full_run, tmp_path_factory):
    out = tmp_path_factory.mktemp("export")
    export.run(_cfg(data), {"final": full_run}, {"out": out, "summary": out / "summary.json"})
    return out / "diffusers"


def _evaluate(data, exported, out: Path, cfg=None):
    cfg = cfg or _cfg(data)
    inputs = {
        "model": exported,
        "manifest": data[0] / "m.jsonl",
        "train_summary": data[0] / "none.json",
        "scaling": data[0] / "none.json",
    }
    return evaluate.run(cfg, inputs, {"metrics": out / "metrics.json", "samples": out / "samples"})


def test_evaluation_is_sharded_reproducible_and_never_fakes_a_metric(data, exported, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no-weights"))  # no FID weights here, no CLIP weights either
    one = _evaluate(data, exported, tmp_path / "one")
    assert one["fid"]["value"] is None and "sdpipe fetch-weights" in one["fid"]["reason"]
    assert one["clip_score"]["value"] is None and one["clip_score"]["reason"]
    assert one["colour_accuracy"]["value"] is not None and one["images"] == 6
    assert set(one["timings"]) >= {"inference_samples_per_s", "train_samples_per_s"}
    again = _evaluate(data, exported, tmp_path / "again")
    strip = lambda m: {k: v for k, v in m.items() if k not in m["timings"]}
    assert strip(one) == strip(again)
    monkeypatch.setattr(evaluate, "eval_devices", lambda cfg: ["cpu", "cpu"])
    _evaluate(data, exported, tmp_path / "two")
    for name in sorted(p.name for p in (tmp_path / "one" / "samples").glob("0*.png")):
        a, b = (np.asarray(Image.open(tmp_path / run / "samples" / name)).astype(int) for run in ("one", "two"))
        assert np.abs(a - b).max() <= 2  # same seeds, same images (up to float rounding across batch shapes)
    assert Image.open(tmp_path / "one" / "samples" / "grid.png").size == (3 * 32, 2 * 32)


def test_too_small_eval_split_fails_before_rendering(data, exported, tmp_path, monkeypatch):
    rows = io.read_jsonl(data[0] / "m.jsonl")
    manifest = tmp_path / "m.jsonl"
    io.write_jsonl(
        manifest, [r for r in rows if r["split"] == "train"] + [next(r for r in rows if r["split"] == "eval")]
    )
    monkeypatch.setattr(evaluate, "render", lambda *a: pytest.fail("rendered before the check"))
    inputs = {"model": exported, "manifest": manifest, "train_summary": manifest, "scaling": manifest}
    with pytest.raises(UserError, match="eval_fraction"):
        evaluate.run(_cfg(data), inputs, {"metrics": tmp_path / "m.json", "samples": tmp_path / "s"})


def test_empty_prompt_set_is_a_config_error(data):
    with pytest.raises(UserError, match=r"evaluate.prompts = \[\] is not allowed; expected at least 1 item"):
        _cfg(data, evaluate={"prompts": []})


def test_benchmark_times_each_count_and_computes_efficiency(data, tmp_path):
    cfg = _cfg(data, benchmark={"gpu_counts": [1, 2], "steps": 2, "warmup_steps": 1})
    result = benchmark.run(cfg, {"index": data[0] / "index.json"}, {"out": tmp_path, "scaling": tmp_path / "s.json"})
    table = result["scaling"]
    assert [r["gpus"] for r in table] == [1, 2] and table[0]["efficiency"] == 1.0
    assert all(r["samples_per_s"] > 0 for r in table)
    assert io.read_json(tmp_path / "gpus-2" / "summary.json")["world_size"] == 2
    for r in table:
        assert r["efficiency"] == pytest.approx(
            r["per_gpu_samples_per_s"] / table[0]["per_gpu_samples_per_s"], rel=1e-3
        )


def test_sampling_batches_are_even_and_sized_by_the_image():
    from sdpipe.evaluate.sampling import batch_size, compile_mode
    from sdpipe.generate import _batches

    sizes = [len(b) for b in _batches(list(range(20)), 8)]
    assert sorted(sizes) == [6, 7, 7] and sum(sizes) == 20  # not 8, 8, 4: no small tail shape
    assert [len(b) for b in _batches(list(range(64)), 16)] == [16] * 4
    assert (
        batch_size("auto", False, 512, 512),
        batch_size("auto", True, 512, 512),
        batch_size("auto", True, 1024, 1024),
        batch_size(5, True, 512, 512),
    ) == (8, 16, 4, 5)
    assert compile_mode("auto", True, 64) == "eager" and compile_mode("auto", True, 5000) == "blocks"
    assert compile_mode("blocks", False, 5000) == "eager"  # nothing compiles on a CPU


@pytest.mark.parametrize(
    "family, cross_dim, prediction, version, arch",
    [
        ("sdxl", 2048, "epsilon", "sdxl_base_v1-0", "stable-diffusion-xl-v1-base"),
        ("sd", 1024, "v_prediction", "sd_v2", "stable-diffusion-v2-768-v"),
        ("sd", 1024, "epsilon", "sd_v2", "stable-diffusion-v2-512"),
        ("sd", 768, "epsilon", "sd_v1", "stable-diffusion-v1"),
    ],
)
def test_exported_files_name_their_base_as_other_tools_read_it(tmp_path, family, cross_dim, prediction, version, arch):
    from sdpipe.export.metadata import file_metadata

    io.write_json(tmp_path / "unet" / "config.json", {"cross_attention_dim": cross_dim})
    cfg = config.from_dict({"train": {"mode": "lora"}, "prepare": {"buckets": {"resolution": 1024}}})
    info = {"family": family, "prediction_type": prediction, "optimizer_steps": 300}
    meta = file_metadata(cfg, info, tmp_path, {"r": 8, "lora_alpha": 4})
    assert (meta["ss_base_model_version"], meta["modelspec.architecture"]) == (version, arch + "/lora")
    assert meta["ss_v2"] == str(version == "sd_v2") and meta["modelspec.prediction_type"] == prediction
    assert (meta["ss_network_dim"], meta["ss_network_alpha"], meta["ss_max_train_steps"]) == ("8", "4", "300")
    assert meta["modelspec.resolution"] == "1024x1024" and all(isinstance(v, str) for v in meta.values())
    assert "ss_network_dim" not in file_metadata(cfg, info, tmp_path)
    assert (meta["ss_output_name"], file_metadata(cfg, info, tmp_path)["ss_output_name"]) == ("lora_kohya", "model")


def _card(data, train_dir: Path, export_dir: Path, eval_dir: Path, out: Path, cfg=None) -> str:
    from sdpipe.stages import card

    inputs = {
        "prepare": data[0] / "p.json",
        "manifest": data[0] / "m.jsonl",
        "captions": data[0] / "c.jsonl",
        "train_summary": train_dir / "summary.json",
        "export": export_dir / "summary.json",
        "metrics": eval_dir / "metrics.json",
        "eval_grid": eval_dir / "samples" / "grid.png",
        "eval_prompts": eval_dir / "samples" / "prompts.json",
    }
    return card.run(cfg or _cfg(data), inputs, {"card": out / "README.md", "grid": out / "samples.png"})


def _front_matter(text: str) -> dict:
    import yaml

    assert text.startswith("---\n")
    return yaml.safe_load(text.split("---\n")[1])


def _run_card_code(text: str):
    """The card's diffusers code block, run as a user would (on the CPU in fp32 here); returns its `pipe`."""
    code = text.split("```python\n")[1].split("```")[0]
    code = code.replace('.to("cuda")', "").replace("torch.float16", "torch.float32")
    scope = {}
    exec(code, scope)  # noqa: S102 - the test's point: the card's code runs as written
    assert scope["image"].size == (32, 32)
    return scope["pipe"]


def test_the_model_card_describes_the_real_run_and_its_code_runs(data, full_run, exported, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no-weights"))  # FID and CLIP score: null with their reason
    metrics = _evaluate(data, exported, tmp_path / "eval")
    text = _card(data, full_run.parent, exported.parent, tmp_path / "eval", tmp_path / "card")
    assert (tmp_path / "card" / "README.md").read_text() == text
    meta = _front_matter(text)
    assert meta["license"] == "other" and "base_model" not in meta  # a local folder is no Hub id
    assert {"stable-diffusion", "text-to-image", "diffusers"} <= set(meta["tags"]) and "lora" not in meta["tags"]
    assert meta["widget"][0]["output"]["url"] == "samples.png"
    assert (tmp_path / "card" / "samples.png").read_bytes() == (tmp_path / "eval/samples/grid.png").read_bytes()
    summary = io.read_json(exported.parent / "summary.json")
    for result in summary["formats"].values():
        assert f"`{result['path']}`" in text  # every exported file, under its real name
    assert str(data[1]["model"]["pretrained"]) in text and "Stable Diffusion 1.x" in text
    train = io.read_json(full_run.parent / "summary.json")
    assert f"| optimizer steps | {train['optimizer_steps']} (" in text
    assert f"| 32x32 | {io.read_json(data[0] / 'p.json')['buckets']['32x32']} |" in text
    assert f"not measured: {metrics['fid']['reason']}" in text
    assert f"{metrics['colour_accuracy']['value']:.4g}" in text and "![samples](samples.png)" in text
    pipe = _run_card_code(text)
    assert type(pipe).__name__ == "StableDiffusionPipeline"

    hub = "stable-diffusion-v1-5/stable-diffusion-v1-5"  # the card reads the config only: no weights needed
    cfg = _cfg(data, model={"pretrained": hub}, export={"name": "my-model"})
    meta = _front_matter(_card(data, full_run.parent, exported.parent, tmp_path / "eval", tmp_path / "hub", cfg))
    assert (meta["base_model"], meta["base_model_relation"], meta["license"]) == (
        hub,
        "finetune",
        "creativeml-openrail-m",
    )


def test_a_lora_card_loads_the_named_lora_on_its_base(data, tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "no-weights"))
    final = _train(data, tmp_path / "train", mode="lora", lora={"rank": 4, "alpha": 2})
    cfg = _cfg(data, train={"mode": "lora", "lora": {"rank": 4, "alpha": 2}}, export={"name": "my-dog"})
    export.run(cfg, {"final": final}, {"out": tmp_path / "e", "summary": tmp_path / "e" / "summary.json"})
    _evaluate(data, tmp_path / "e" / "diffusers", tmp_path / "eval", cfg)
    text = _card(data, tmp_path / "train", tmp_path / "e", tmp_path / "eval", tmp_path / "card", cfg)
    meta = _front_matter(text)
    assert "lora" in meta["tags"] and "| unet | LoRA, rank 4, alpha 2 |" in text
    assert 'weight_name="my-dog_lora.safetensors"' in text and "my-dog_lora_kohya.safetensors" in text
    pipe = _run_card_code(text)
    assert pipe.get_active_adapters()  # the named LoRA, loaded from its folder by weight_name
