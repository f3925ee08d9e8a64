"""Issue 28's user path for SD 3.5 and Flux: `sdpipe init --template <job>` on a tiny-sd3 or tiny-flux folder,
then `snakemake --profile runpod` (shrunk to a few CPU steps by a second config file) runs every stage. Each
export reloads in diffusers, the cache holds T5 at the family's length, and evaluation and the card name the
family."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from tests.workflow_helpers import TEMPLATE_FAST, run

pytestmark = pytest.mark.slow

# template -> (preset, the export formats it writes, the diffusers pipeline class)
JOBS = {
    "sd35-lora": ("tiny-sd3", ["diffusers", "lora", "lora_kohya"], "StableDiffusion3Pipeline"),
    "sd35-medium-full": ("tiny-sd3", ["diffusers", "single_file"], "StableDiffusion3Pipeline"),
    "flux-lora": ("tiny-flux", ["diffusers", "lora", "lora_kohya"], "FluxPipeline"),
}
PROMPTS = ["a red circle on a white background", "a blue square on a white background"]

CACHED_T5 = """
import json, sys
from sdpipe.train.data import LatentData
data = LatentData(sys.argv[1], verify=False)
print(json.dumps([data.family.name, data.empty["t5"].shape[0]]))
"""


@pytest.fixture(scope="module")
def photos(tmp_path_factory, demo_source) -> Path:
    out = tmp_path_factory.mktemp("photos")
    for image in sorted(demo_source.rglob("*.png"))[:8]:
        (out / image.name).write_bytes(image.read_bytes())
    return out


def _init_and_run(template: str, model: Path, photos: Path, project: Path) -> None:
    cmd = [sys.executable, "-m", "sdpipe", "init", str(project), "--template", template, "--images", str(photos)]
    run([*cmd, "--model", str(model), "--prompt", PROMPTS[0], "--prompt", PROMPTS[1]], project.parent)
    (project / "fast.yaml").write_text(yaml.safe_dump(TEMPLATE_FAST))
    profile = ["snakemake", "--profile", "runpod", "--cores", "2", "--configfile", "config/config.yaml", "fast.yaml"]
    run(profile, project)


@pytest.mark.parametrize("template", sorted(JOBS))
def test_a_flow_template_runs_the_whole_dag_and_each_export_reloads(template, tmp_path, photos):
    from sdpipe.models import families, presets

    preset, formats, pipeline = JOBS[template]
    family = families.named(presets.family(preset))
    model = presets.build_and_save(preset, tmp_path / "models" / preset, seed=0)
    project = tmp_path / "job"
    _init_and_run(template, model, photos, project)

    export = json.loads((project / "results/export/summary.json").read_text())
    assert export["family"] == family.name and sorted(export["formats"]) == formats
    for name, result in export["formats"].items():
        assert result["verified"], f"{name}: {result}"
        if name.startswith("lora"):
            assert result["adapted_layers"] > 0, name  # the file changed the model it was loaded into
    folder = json.loads((project / export["formats"]["diffusers"]["path"] / "model_index.json").read_text())
    assert folder["_class_name"] == pipeline
    if "lora" in formats:
        _lora_loads_into_the_base(pipeline, model, project / "results/export/lora")

    t5 = next(part for part in family.text_parts if part.max_length)
    check = subprocess.run(
        [sys.executable, "-c", CACHED_T5, str(project / "results/latents/index.json")],
        capture_output=True,
        text=True,
        cwd=project,
    )
    assert check.returncode == 0, check.stderr[-2000:]
    assert json.loads(check.stdout) == [family.name, t5.max_length]  # T5 states at the family's length

    metrics = json.loads((project / "results/evaluate/metrics.json").read_text())
    assert metrics["images"] == len(PROMPTS) and metrics["fid"]["value"] is None  # disabled, not faked
    assert (project / "results/evaluate/samples/grid.png").is_file()
    card = (project / "results/card/README.md").read_text()
    assert family.title in card or any(b.title in card for b in family.bases)


def _lora_loads_into_the_base(pipeline: str, model: Path, lora: Path) -> None:
    """diffusers' own loader takes sdpipe's LoRA folder into the base pipeline, and the trained B is not zero."""
    import diffusers

    pipe = getattr(diffusers, pipeline).from_pretrained(model)
    pipe.load_lora_weights(lora)
    assert pipe.get_list_adapters() == {"transformer": ["default_0"]}
    lora_b = [p for n, p in pipe.transformer.named_parameters() if "lora_B" in n]
    assert lora_b and any(p.abs().sum() > 0 for p in lora_b), "the trained adapter (LoRA B starts at zero)"
