"""dvc.yaml follows the config (sdpipe/dvc_file.py): the committed one is what `sdpipe dvc-yaml` makes from the
demo config, a real job's has no demo paths, and its code dependencies cover every sdpipe module a stage imports,
directly or not, at module level or inside a function (otherwise a code change leaves `dvc repro` saying
everything is up to date)."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from sdpipe import config, dvc_file

REPO = Path(__file__).resolve().parent.parent


def test_the_committed_dvc_yaml_is_the_one_the_demo_config_makes():
    demo = config.load(REPO / "config" / "config.yaml")
    assert (REPO / "dvc.yaml").read_text() == dvc_file.text(demo, REPO), "run `sdpipe dvc-yaml` and commit dvc.yaml"


def test_the_closure_follows_imports_inside_functions():
    assert "sdpipe.generate" in dvc_file.code_modules("sdpipe.stages.evaluate", REPO)  # imported inside render()
    assert "sdpipe.models" in dvc_file.code_modules("sdpipe.models.presets", REPO)
    assert "sdpipe.train.loop" in dvc_file.code_modules("sdpipe.stages.train", REPO)
    # models/families/ imports each family's module at run time: every one is code the latents stage runs
    found = dvc_file.code_modules("sdpipe.stages.latents", REPO)
    assert {f"sdpipe.models.families.{p.stem}" for p in (REPO / "sdpipe/models/families").glob("[!_]*.py")} <= found


@pytest.mark.parametrize("stage", sorted(dvc_file.STAGES))
def test_every_code_dependency_exists_and_each_stage_covers_its_module(stage):
    stages = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
    deps = [d for d in stages[stage].get("deps", []) if d.startswith("sdpipe")]
    assert deps and all((REPO / d).is_file() for d in deps)
    assert f"sdpipe/stages/{stage}.py" in deps or stage == "base_model"


def test_a_real_jobs_dvc_yaml_has_no_demo_paths(tmp_path):
    """A local checkpoint and the user's images folder are dependencies; a hub id is a param, not a path; without
    the sdpipe source in the project there are no code paths (an installed package)."""
    photos = tmp_path / "photos"
    local = config.from_dict(
        {"model": {"pretrained": str(tmp_path / "my-model.safetensors")}, "data": {"raw_dir": str(photos)}}
    )
    stages = dvc_file.render(local, tmp_path)["stages"]
    assert set(stages) == set(dvc_file.STAGES) - {"base_model", "train_vae"}
    text = yaml.safe_dump(stages)
    assert "models/tiny" not in text and "results/vae" not in text and "sdpipe/" not in text
    assert str(photos) in stages["prepare"]["deps"]
    assert str(tmp_path / "my-model.safetensors") in stages["latents"]["deps"]
    hub = config.from_dict({"model": {"pretrained": "stabilityai/stable-diffusion-xl-base-1.0"}})
    stages = dvc_file.render(hub, tmp_path)["stages"]
    assert not any("stabilityai" in d for s in stages.values() for d in s.get("deps", []))
    assert "model" in stages["latents"]["params"][0]["config/config.yaml"]


def test_params_are_only_the_keys_the_project_config_sets(tmp_path):
    """An `sdpipe init` project's config holds its template's keys only; DVC refused `dvc repro` there ("Parameters
    'dreambooth, seed' are missing from 'config/config.yaml'"), found by the bookkeeping benchmark (issue 30)."""
    written = {"model": {"pretrained": "some/model"}, "data": {"raw_dir": "data/raw"}, "prepare": {"buckets": {}}}
    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "config.yaml").write_text(yaml.safe_dump(written))
    stages = dvc_file.render(config.from_dict(written), tmp_path)["stages"]
    keys = {k for s in stages.values() for p in s.get("params", []) for k in p["config/config.yaml"] or []}
    assert keys and all(dvc_file.in_file(k, written) for k in keys)
    assert "seed" not in keys and "dreambooth" not in keys and {"model", "data", "prepare"} <= keys
    assert dvc_file.in_file("seed", None)  # no file to read: every key
