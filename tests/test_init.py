"""`sdpipe init` and the job templates: each template makes a project whose whole DAG Snakemake plans, the
settings written are the template's, the README's table says what each template does, and the two-command path
(init, then snakemake --profile runpod) ends in a LoRA that diffusers loads."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from sdpipe import config, templates
from sdpipe.errors import UserError
from sdpipe.project import init
from tests.workflow_helpers import REPO, TEMPLATE_FAST, run

DREAMBOOTH = {"instance_prompt": "a photo of sks shape", "class_prompt": "a photo of a shape"}


@pytest.fixture(scope="module")
def tiny_sdxl(tmp_path_factory) -> Path:
    from sdpipe.models import presets

    return presets.build_and_save("tiny-sdxl", tmp_path_factory.mktemp("model") / "tiny-sdxl", seed=0)


@pytest.fixture()
def photos(tmp_path, demo_source) -> Path:
    out = tmp_path / "photos"
    out.mkdir()
    for image in sorted(demo_source.rglob("*.png"))[:8]:
        (out / image.name).write_bytes(image.read_bytes())
    return out


@pytest.fixture(scope="module")
def flow_models(tmp_path_factory) -> dict[str, Path]:
    """tiny-sd3 and tiny-flux, saved as users' folders are, by family."""
    from sdpipe.models import presets

    root = tmp_path_factory.mktemp("flow")
    return {presets.family(p): presets.build_and_save(p, root / p, seed=0) for p in ("tiny-sd3", "tiny-flux")}


def model_for(name: str, tiny_model: Path, tiny_sdxl: Path, flow: dict[str, Path]) -> Path:
    family = templates.family(name)
    return {"sd": tiny_model, "sdxl": tiny_sdxl, **flow}[family]


def extra_for(name: str) -> dict:
    return DREAMBOOTH if templates.settings(name).get("dreambooth", {}).get("enabled") else {}


@pytest.mark.parametrize("name", templates.names())
def test_each_template_makes_a_project_whose_dag_snakemake_plans(
    name, tmp_path, photos, tiny_model, tiny_sdxl, flow_models
):
    project = tmp_path / "job"
    model = model_for(name, tiny_model, tiny_sdxl, flow_models)
    written = init(project, name, photos, str(model), [], **extra_for(name))
    raw = yaml.safe_load(written.read_text())
    assert config.merge(raw, templates.settings(name)) == raw, "every template setting is in the project's config"
    assert raw["data"]["raw_dir"] == str(photos) and raw["evaluate"]["prompts"]
    assert not (project / "models").exists() and "models/tiny" not in (project / "dvc.yaml").read_text()
    assert raw["model"]["pretrained"] == str(model)
    (project / "fast.yaml").write_text(yaml.safe_dump(TEMPLATE_FAST))
    proc = run(["snakemake", "-n", "--cores", "1", "--configfile", "config/config.yaml", "fast.yaml"], project)
    jobs = set(re.findall(r"^rule (\w+):", proc.stdout, re.M))
    expected = {"prepare", "caption", "latents", "train", "export", "evaluate", "report"}
    assert expected <= jobs, proc.stdout[-2000:]
    assert ("class_images" in jobs) == bool(extra_for(name))


@pytest.mark.parametrize("name", templates.names())
def test_the_readme_table_says_what_each_template_sets(name):
    rows = {m[0].strip("` "): [c.strip() for c in m[1:]] for m in readme_rows()}
    assert name in rows, f"README's template table lacks {name}"
    mode, resolution, lr, batch, steps, text_encoder, precision = rows[name]
    s = config.from_dict(config.merge(templates.settings(name), {"dreambooth": {"class_prompt": "a dog"}}))
    t = s.train
    assert mode == ("DreamBooth " if s.dreambooth.enabled else "") + {"lora": "LoRA", "full": "full"}[t.mode]
    assert int(resolution) == s.prepare.buckets.resolution and float(lr) == t.learning_rate
    assert batch == f"{t.per_device_batch_size} x {t.grad_accum_steps}"
    assert steps == (f"{t.max_steps} steps" if t.max_steps else f"{t.epochs} epochs")
    assert text_encoder == t.text_encoder.mode and precision == t.mixed_precision
    if name.endswith("-24gb"):
        assert t.gradient_checkpointing


def readme_rows() -> list[list[str]]:
    text = (REPO / "README.md").read_text()
    table = text.split("<!-- templates -->", 2)[1]
    return [line.strip("|").split("|") for line in table.strip().splitlines()[2:] if line.startswith("|")]


def test_init_refuses_what_it_cannot_do_in_one_line(tmp_path, photos, tiny_model, tiny_sdxl, flow_models):
    with pytest.raises(UserError, match="give --instance-prompt"):
        init(tmp_path / "a", "sd15-dreambooth", photos, str(tiny_model), [])
    with pytest.raises(UserError, match="is an SDXL model and template sd15-lora is for SD 1.x/2.x"):
        init(tmp_path / "b", "sd15-lora", photos, str(tiny_sdxl), [])
    with pytest.raises(UserError, match="is a Flux.1 model and template sd35-lora is for SD 3 / 3.5"):
        init(tmp_path / "c", "sd35-lora", photos, str(flow_models["flux"]), [])
    with pytest.raises(UserError, match="no template 'sd3-lora'; the templates are: flux-lora, sd15-dreambooth"):
        init(tmp_path / "c", "sd3-lora", photos, str(tiny_model), [])
    with pytest.raises(UserError, match="--images .*: no such folder"):
        init(tmp_path / "d", "sd15-lora", tmp_path / "nothing", str(tiny_model), [])
    assert not any((tmp_path / n).exists() for n in "abcd"), "nothing is written when a check fails"
    init(tmp_path / "e", "sd15-lora", photos, str(tiny_model), ["a shape"])
    with pytest.raises(UserError, match="exists; use another folder, or --force"):
        init(tmp_path / "e", "sd15-lora", photos, str(tiny_model), [])


def test_prompts_come_from_the_user_then_the_sidecar_captions(tmp_path, photos, tiny_model):
    raw = yaml.safe_load(init(tmp_path / "a", "sd15-lora", photos, str(tiny_model), ["my prompt"]).read_text())
    assert raw["evaluate"]["prompts"] == ["my prompt"] and raw["export"]["verify"]["prompt"] == "my prompt"
    sidecars = sorted(photos.glob("*.txt"))
    if sidecars:
        raw = yaml.safe_load(init(tmp_path / "b", "sd15-lora", photos, str(tiny_model), []).read_text())
        assert raw["train"]["validation"]["prompts"][0] == sidecars[0].read_text().strip()


@pytest.mark.slow
def test_two_commands_from_photos_to_a_lora_diffusers_loads(tmp_path, photos, tiny_model):
    """The README's path: `sdpipe init` then `snakemake --profile runpod` (shrunk to the tiny preset and 3 CPU
    steps by a second config file), ending in a LoRA that `load_lora_weights` loads into the base model."""
    project = tmp_path / "job"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "sdpipe",
            "init",
            str(project),
            "--template",
            "sd15-lora",
            "--images",
            str(photos),
            "--model",
            str(tiny_model),
        ],
        capture_output=True,
        text=True,
    )
    assert proc.returncode == 0, proc.stderr
    assert "next: cd" in proc.stdout and "snakemake --profile runpod" in proc.stdout
    (project / "fast.yaml").write_text(yaml.safe_dump(TEMPLATE_FAST))
    run(
        ["snakemake", "--profile", "runpod", "--cores", "2", "--configfile", "config/config.yaml", "fast.yaml"], project
    )
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_model)
    pipe.load_lora_weights(project / "results" / "export" / "lora")
    assert pipe.get_list_adapters() == {"unet": ["default_0"]}
    lora_b = [p for n, p in pipe.unet.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "the trained adapter (LoRA B starts at zero)"
    metrics = yaml.safe_load((project / "results" / "evaluate" / "metrics.json").read_text())
    assert metrics["fid"]["value"] is None
