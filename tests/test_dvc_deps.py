"""dvc.yaml's code dependencies cover every sdpipe module a stage imports, directly or not, at module level or
inside a function: otherwise a code change leaves `dvc repro` saying everything is up to date."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parent.parent
STAGES = yaml.safe_load((REPO / "dvc.yaml").read_text())["stages"]
ROOTS = {"base_model": "sdpipe.models.presets"}  # the rest: sdpipe.stages.<stage>


def module_file(name: str) -> Path | None:
    base = REPO / Path(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def imported(name: str) -> set[str]:
    found = set()
    for node in ast.walk(ast.parse(module_file(name).read_text())):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "sdpipe" and module_file(m)}


def closure(root: str) -> set[str]:
    """The module, what it imports, and the packages around each (importing a.b runs a/__init__.py)."""
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            parts = name.split(".")
            todo += [*imported(name), *(".".join(parts[:i]) for i in range(1, len(parts)))]
    return seen


def test_the_closure_follows_imports_inside_functions():
    assert "sdpipe.generate" in closure("sdpipe.stages.evaluate")  # imported inside render()
    assert "sdpipe.models" in closure("sdpipe.models.presets")


@pytest.mark.parametrize("stage", sorted(STAGES))
def test_every_imported_module_is_a_dependency(stage):
    deps = [d.rstrip("/") for d in STAGES[stage].get("deps", []) if d.startswith("sdpipe")]
    files = {str(module_file(m).relative_to(REPO)) for m in closure(ROOTS.get(stage, f"sdpipe.stages.{stage}"))}
    missing = sorted(f for f in files if not any(f == d or f.startswith(d + "/") for d in deps))
    assert not missing, f"dvc.yaml stage {stage} lacks code deps: {missing}"
    assert all((REPO / d).exists() for d in deps), "a dependency that does not exist"
