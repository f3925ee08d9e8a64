"""A new model family, added the way docs/ARCHITECTURE.md's checklist says, is one module: with nothing else
edited, the whole DAG (cache, train, every export format, evaluate, card) runs on a pipeline of that family, and
each stage asks the family rather than assuming SD. The toy is SD with the text encoder's penultimate layer as its
conditioning ("clip skip 2") and a base model of its own, so the test can see that the cache, the exports' metadata
and the card took the toy's choices."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.workflow_helpers import make_project, run

pytestmark = pytest.mark.slow

FAMILY = '''"""Toy Diffusion (a test family, made by tests/test_toy_family.py): SD's UNet, conditioned on the text
encoder's penultimate hidden states, in a pipeline class of its own."""

from __future__ import annotations

import dataclasses
import functools

from sdpipe.models.families import Base, sd

BASE = Base("toy_v1", "Toy Diffusion", "toy-diffusion-v1", "https://example.invalid/toy", "toy-diffusion")


def embed(stack, captions):
    tokenizer, encoder = stack.tokenizers[0], stack.encoders[0]
    return {"hidden": encoder(**stack.ids(tokenizer, encoder, captions), output_hidden_states=True).hidden_states[-2]}


@functools.cache
def pipeline_class():
    from diffusers import StableDiffusionPipeline

    return type("ToyDiffusionPipeline", (StableDiffusionPipeline,), {})


def __getattr__(name):  # the pipeline class, built on first use: the family registry must not import diffusers
    if name == "ToyDiffusionPipeline":
        return pipeline_class()
    raise AttributeError(name)


FAMILY = dataclasses.replace(
    sd.FAMILY,
    name="toy",
    title="Toy Diffusion",
    priority=20,
    detects=lambda index: index.get("_class_name") == "ToyDiffusionPipeline",
    config_matches=lambda unet: False,  # its UNet is SD's: check-config's estimates are SD's
    single_file_keys=("toy.",),  # an original-layout file is read as SD's
    pipeline_class=f"{__name__}:ToyDiffusionPipeline",
    embed=embed,
    base=lambda unet, prediction: BASE,
    bases=(BASE,),
)
'''

CHECK_CACHE = """
import sys, torch
from sdpipe.models import loading
from sdpipe.train.data import LatentData
data = LatentData(sys.argv[1], verify=False)
stack = loading.load_text_stack(sys.argv[2])
ids = stack.ids(stack.tokenizers[0], stack.encoders[0], [""])
with torch.no_grad():
    out = stack.encoders[0](**ids, output_hidden_states=True)
cached = data.empty["hidden"].float()
print(data.family.name, torch.allclose(cached, out.hidden_states[-2][0], atol=1e-5),
      torch.allclose(cached, out.last_hidden_state[0], atol=1e-5))
"""


def _checklist() -> str:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "ARCHITECTURE.md").read_text(encoding="utf-8")
    return doc.split("## Checklist: adding a model family", 1)[1].split("\\n## ", 1)[0]


def _toy_model(proj: Path, env: dict) -> Path:
    """The tiny preset, saved as a Toy Diffusion pipeline (its model_index.json names the toy's class)."""
    model = proj / "models" / "toy"
    run([sys.executable, "-m", "sdpipe", "build-model", "--preset", "tiny", "--out", str(model)], proj, env=env)
    index = json.loads((model / "model_index.json").read_text())
    (model / "model_index.json").write_text(json.dumps({**index, "_class_name": "ToyDiffusionPipeline"}))
    return model


def test_a_family_added_by_the_checklist_runs_the_whole_dag(tmp_path, demo_source):
    proj = make_project(tmp_path / "proj", demo_source, with_code=True, prepare={"eval_fraction": 0.0, "workers": 1})
    (proj / "sdpipe/models/families/toy.py").write_text(FAMILY)
    assert "`sdpipe/models/families/<family>.py`" in _checklist()
    env = {**os.environ, "PYTHONPATH": str(proj)}  # the project's copy of sdpipe, with the new family
    model = _toy_model(proj, env)
    cfg_path = proj / "config" / "config.yaml"
    cfg = yaml.safe_load(cfg_path.read_text())
    cfg["model"] = {"pretrained": str(model), "build_preset": None}
    cfg["train"].update({"mode": "lora", "max_steps": 2, "text_encoder": {"mode": "lora"}})
    cfg["export"]["single_file"] = True
    cfg_path.write_text(yaml.safe_dump(cfg, sort_keys=False))

    run([sys.executable, "-m", "snakemake", "--cores", "2"], proj, env=env)

    index = proj / "results/latents/index.json"
    check = subprocess.run(
        [sys.executable, "-c", CHECK_CACHE, str(index), str(model)], capture_output=True, text=True, env=env, cwd=proj
    )
    assert check.stdout.split() == ["toy", "True", "False"], check.stderr[-2000:]  # cached: the penultimate layer

    export = json.loads((proj / "results/export/summary.json").read_text())
    formats = export["formats"]
    assert export["base_model_version"] == "toy_v1" and sorted(formats) == [
        "diffusers",
        "lora",
        "lora_kohya",
        "single_file",
    ]
    assert all(f["verified"] for f in formats.values())  # each reloads and renders what training rendered
    folder = json.loads((proj / formats["diffusers"]["path"] / "model_index.json").read_text())
    assert folder["_class_name"] == "ToyDiffusionPipeline"  # the export stays a toy pipeline
    from safetensors import safe_open

    for name in ("single_file", "lora_kohya"):
        with safe_open(str(proj / formats[name]["path"]), framework="pt") as f:
            assert f.metadata()["modelspec.architecture"].startswith("toy-diffusion-v1"), name
    card = (proj / "results/card/README.md").read_text()
    assert "Toy Diffusion" in card and "toy-diffusion" in card
