"""Rules of the codebase's seams (issue 27), checked so they stay true."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "sdpipe"


def test_every_cfg_parameter_says_its_type():
    missing = [
        f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name}"
        for path in sorted(PACKAGE.rglob("*.py"))
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        if isinstance(node, ast.FunctionDef)
        for arg in node.args.args
        if arg.arg == "cfg" and arg.annotation is None
    ]
    assert not missing, missing


LIBRARIES = ("prepare", "latents", "train", "models", "captioners", "export", "evaluate", "report", "card")
# What sits above the libraries: the stages that adapt them, the commands, operations code and the demo.
HIGHER = (
    "sdpipe.stages",
    "sdpipe.cli",
    "sdpipe.bench",
    "sdpipe.project",
    "sdpipe.plan",
    "sdpipe.ops",
    "sdpipe.demo",
    "sdpipe.demo.colours",
)


def _imported(tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found += [node.module, *(f"{node.module}.{a.name}" for a in node.names)]
        elif isinstance(node, ast.Import):
            found += [a.name for a in node.names]
    return found


def test_the_libraries_import_nothing_above_them():
    """train, models, captioners, export, evaluate, report and card read what stages write (files, versions), not
    the stages' code, and know nothing of the commands, the pod, Runpod or the demo (docs/ARCHITECTURE.md)."""
    leaks = [
        f"{path.relative_to(PACKAGE)}: {name}"
        for lib in LIBRARIES
        for path in sorted((PACKAGE / lib).rglob("*.py"))
        for name in _imported(ast.parse(path.read_text(encoding="utf-8")))
        if any(name == h or name.startswith(f"{h}.") for h in HIGHER)
    ]
    assert not leaks, leaks


def test_the_workflow_reads_a_config_without_torch(tmp_path):
    """Every `snakemake` start (one per DVC stage, every dry run) validates the config as common.smk does; for a
    preset that must not import torch or diffusers, which cost seconds each time."""
    import subprocess
    import sys

    (tmp_path / "c.yaml").write_text("model: {pretrained: models/tiny, build_preset: tiny}\ndata: {raw_dir: d}\n")
    code = (
        "import sys; from sdpipe.config import check_user_config, effective; import sdpipe.export.names, "
        "sdpipe.parallel; check_user_config(effective([sys.argv[1]], {})); "
        "print(sorted(m for m in ('torch', 'diffusers', 'transformers') if m in sys.modules))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "c.yaml")], capture_output=True, text=True, cwd=tmp_path, check=True
    ).stdout
    assert out.strip() == "[]"


def _outside_the_seam():
    """sdpipe's modules but the seam (models/families/ and the objectives they name), the presets (presets.py and
    presets_flow.py build models of each family) and the benchmark (it reproduces diffusers' own SD training loop)."""
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if not rel.startswith(("models/families/", "bench/")) and rel not in (
            "models/presets.py",
            "models/presets_flow.py",
            "models/objectives.py",
        ):
            yield rel, path


def test_no_family_class_or_component_named_outside_the_family_seam():
    """The denoiser, text encoder and scheduler classes, and the components only one family has, are the family's
    to name: the code that loads, trains and exports them asks it (a docstring may still mention them)."""
    own = {"UNet2DConditionModel", "CLIPTextModel", "CLIPTextModelWithProjection", "DDPMScheduler", "text_encoder_2"}
    found = []
    for rel, path in _outside_the_seam():
        tree = ast.parse(path.read_text(encoding="utf-8"))
        docstrings = {
            id(node.body[0].value)
            for node in ast.walk(tree)
            if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef)) and ast.get_docstring(node) is not None
        }
        for node in ast.walk(tree):
            if isinstance(node, ast.Name) and node.id in own:
                found.append(f"{rel}:{node.lineno} {node.id}")
            elif isinstance(node, ast.alias) and node.name in own:
                found.append(f"{rel} imports {node.name}")
            elif isinstance(node, ast.Constant) and node.value in own and id(node) not in docstrings:
                found.append(f"{rel}:{node.lineno} {node.value!r}")
    assert not found, found


def test_no_branch_on_a_family_name_outside_the_family_seam():
    """What differs between model families is asked of sdpipe/models/families/, not decided by comparing names."""
    names = {"sd", "sdxl"}
    found = []
    for rel, path in _outside_the_seam():
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Compare):
                consts = [c.value for c in (node.left, *node.comparators) if isinstance(c, ast.Constant)]
                if names & set(consts):
                    found.append(f"{rel}:{node.lineno}")
            elif isinstance(node, ast.Dict) and {getattr(k, "value", None) for k in node.keys} >= names:
                found.append(f"{rel}:{node.lineno} (a table keyed by family name)")
    assert not found, found
