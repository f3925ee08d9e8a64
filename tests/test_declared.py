"""Each stage is declared once, in its module (INPUTS, OUTPUTS, READS; sdpipe/stages/declared.py): the rules'
params.settings and dvc.yaml's params are made from READS, and READS covers what the module reads."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from sdpipe import cli, dvc_file
from sdpipe.stages.declared import WHOLE_CONFIG, declared, settings

REPO = Path(__file__).resolve().parent.parent
MODULES = sorted(m.rsplit(".", 1)[-1] for m in cli.STAGES.values())
# Settings that say how or where a stage runs, not what it makes: changing them must not rerun it.
OPERATIONAL = {
    "cache_dir",
    "gpus",
    "workers",
    "num_processes",
    "multi_node",
    "cpu_processes",
    "loader_threads",
    "compile",
    "batch_size",
    "raw",
}


def _config_reads(module: str) -> set[str]:
    """Every `cfg.a.b...` attribute chain in the stage module's source, as "a.b"."""
    source = (REPO / "sdpipe" / "stages" / f"{module}.py").read_text(encoding="utf-8")
    chains = set()
    for node in ast.walk(ast.parse(source)):
        parts = []
        while isinstance(node, ast.Attribute):
            parts.append(node.attr)
            node = node.value
        if isinstance(node, ast.Name) and node.id == "cfg" and parts:
            chains.add(".".join(reversed(parts)))
    return chains


def _covered(chain: str, reads: tuple[str, ...]) -> bool:
    return WHOLE_CONFIG in reads or any(
        chain == r or chain.startswith(f"{r}.") or r.startswith(f"{chain}.") for r in reads
    )


@pytest.mark.parametrize("module", MODULES)
def test_every_stage_declares_what_its_outputs_depend_on(module):
    d = declared(module)
    assert d.outputs and d.reads, f"sdpipe/stages/{module}.py declares no OUTPUTS or READS"
    missed = {
        c
        for c in _config_reads(module)
        if not _covered(c, d.reads) and not OPERATIONAL & set(c.split(".")) and c != "get"
    }
    assert not missed, f"{module} reads {sorted(missed)} but READS = {d.reads}"


@pytest.mark.parametrize("module", MODULES)
def test_the_rule_passes_the_declared_settings(module):
    """The rule's params.settings is settings_of(<module>), never a hand-written dict."""
    rules = "\n".join(p.read_text(encoding="utf-8") for p in (REPO / "workflow" / "rules").glob("*.smk"))
    body = re.search(rf"rule {module}:\n(.*?)(?=\n\S|\n    rule |\Z)", rules, re.S)
    assert body, f"no rule {module}"
    assert f'settings=settings_of("{module}")' in body.group(1)


def test_settings_pick_the_declared_keys():
    config = {
        "caption": {"template": "{stem}"},
        "cache_dir": "c",
        "prepare": {"alpha_background": [1, 2, 3]},
        "train": {"lr": 1},
    }
    assert settings(config, "caption") == {
        "caption": {"template": "{stem}"},
        "prepare.alpha_background": [1, 2, 3],
        "prepare.max_pixels": None,
    }
    assert settings(config, "report") is config  # the whole config


def test_dvc_params_are_the_declared_reads():
    assert dvc_file.config_keys("caption", dvc_file.STAGES["caption"]) == declared("caption").reads
    prepare = dvc_file.config_keys("prepare", dvc_file.STAGES["prepare"])
    assert "dreambooth" in prepare and "dreambooth.enabled" not in prepare  # a key its parent holds goes
    assert set(prepare) >= {"data", "prepare", "model", "seed"}  # prepare's and class_images' reads


def test_the_stage_reference_lists_the_declared_keys():
    """docs/stages.md's "config it reads" column is each stage's READS."""
    rows = [line.split(" | ") for line in (REPO / "docs" / "stages.md").read_text(encoding="utf-8").splitlines()]
    listed = {r[0][2:].strip(): r[5] for r in rows if len(r) == 7 and r[0][2:].strip() in MODULES}
    assert set(listed) == set(MODULES)
    for module, cell in listed.items():
        reads = declared(module).reads
        assert cell == ("all" if reads == (WHOLE_CONFIG,) else ", ".join(f"`{r}`" for r in reads)), module


def _covers(path: str, tracked: list[str]) -> bool:
    return any(path == t or path.startswith(f"{t}/") or t.startswith(f"{path}/") for t in tracked)


# Inputs a DVC stage does not track, each for a reason: made by the same DVC stage (prepare runs class_images),
# optional (the benchmark runs only on request), written by every run (the resolved config), or inside another
# tracked output's folder that DVC does not cache (validation samples under results/train).
UNTRACKED_INPUTS = {
    "results/class_images/images",
    "results/benchmark/scaling.json",
    "results/config.resolved.yaml",
    "results/train/samples",
}


# DreamBooth's class images are made inside DVC's prepare stage, for it alone.
UNTRACKED_OUTPUTS = {"results/class_images/images", "results/class_images/summary.json"}


@pytest.mark.parametrize("stage", sorted(dvc_file.STAGES))
def test_the_dvc_stage_tracks_what_its_modules_declare(stage):
    """dvc.yaml's deps, outs and metrics are written in dvc_file.STAGES; they agree with the INPUTS and OUTPUTS the
    stage modules declare, so a path changed in one place and not the other fails here."""
    spec = dvc_file.STAGES[stage]
    modules = [m.rsplit(".", 1)[-1] for m in dvc_file.stage_modules(stage, spec) if m.startswith("sdpipe.stages.")]
    inputs = {p for m in modules for p in declared(m).inputs.values()} - UNTRACKED_INPUTS
    outputs = {p for m in modules for p in declared(m).outputs.values()} - UNTRACKED_OUTPUTS
    tracked_out = [o if isinstance(o, str) else next(iter(o)) for o in spec.outs] + spec.metrics
    assert [p for p in sorted(inputs) if not _covers(p, spec.deps)] == []
    assert all(_covers(p, tracked_out) for p in outputs), (outputs, tracked_out)
    assert all(_covers(p, sorted(outputs)) for p in tracked_out), (tracked_out, outputs)


def _dry_run_commands(tmp_path: Path, dreambooth: bool) -> dict[str, str]:
    """Rule name -> the shell command Snakemake plans for it, for the demo config (it trains its VAE) or with
    DreamBooth on (class images come from the base model instead)."""
    import subprocess
    import sys

    import yaml

    from sdpipe import demo
    from tests.workflow_helpers import make_project

    proj = make_project(tmp_path / f"proj-{dreambooth}", None)
    demo.generate(proj / "data" / "raw", count=4, seed=0)
    cfg = yaml.safe_load((proj / "config/config.yaml").read_text())
    if dreambooth:
        cfg["dreambooth"].update({"enabled": True, "class_prompt": "a shape"})
        cfg["model"]["train_vae"]["enabled"] = False
    (proj / "config/config.yaml").write_text(yaml.safe_dump(cfg, sort_keys=False))
    out = subprocess.run([sys.executable, "-m", "snakemake", "-n", "-p"], cwd=proj, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-3000:]
    jobs = re.findall(r"^rule (\w+):.*?^Shell command: (.*?)$", out.stdout + out.stderr, flags=re.M | re.S)
    return dict(jobs)


def test_the_rules_use_the_paths_the_stages_declare(tmp_path):
    """The paths are declared once, in each stage module's INPUTS and OUTPUTS: every path a rule hands a stage's
    --flag is the one the stage declares under that name, and every declared output is handed over. (A path written
    differently in a rule would run the stage on a file its neighbours do not read.)"""
    commands = {**_dry_run_commands(tmp_path, False), **_dry_run_commands(tmp_path, True)}
    for module in MODULES:
        if module not in commands:
            continue  # the benchmark runs only when asked for
        flags = dict(re.findall(r"--([a-z][a-z-]*) ([^\s>]+)", commands[module]))
        d = declared(module)
        for name, path in {**d.inputs, **d.outputs}.items():
            flag = name.replace("_", "-")
            if flag in flags:
                assert flags[flag] == path, (module, name)
        assert all(name.replace("_", "-") in flags for name in d.outputs), (module, sorted(flags))
    assert set(MODULES) - set(commands) == {"benchmark"}
