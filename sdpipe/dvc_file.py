"""dvc.yaml, made from the config: `dvc repro` runs any job without hand edits.

DVC decides WHAT must rerun, Snakemake HOW: each DVC stage asks Snakemake for exactly one rule (--allowed-rules)
and forces it (--forcerun), so the two never disagree about staleness. The stages, their outputs and the config
keys each one reads are declared once in STAGES below; which model files they depend on follows the config (a
built preset, a trained VAE, a local checkpoint, or nothing for a hub id, whose name and revision are params), and
the code they depend on is every sdpipe module a stage imports, found by following its imports (where the project
holds the sdpipe source; an installed package is versioned by its own version instead).
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io
from sdpipe.stages.declared import WHOLE_CONFIG, declared

if TYPE_CHECKING:
    from sdpipe.config import Config

HEADER = """\
# Made by `sdpipe dvc-yaml` from config/config.yaml (sdpipe/dvc_file.py): run it again after changing the model,
# the images folder or any model.* / dreambooth.enabled setting. DVC decides WHAT must rerun; Snakemake defines HOW
# each stage runs (one rule each, forced, so the two never disagree). The caches under cache/ are not DVC outputs:
# they are keyed by content and persist. Raw data: `dvc add` your images folder (see README "Snakemake and DVC").
"""
MANIFEST, CAPTIONS, LATENTS = (
    "results/prepare/manifest.jsonl",
    "results/captions/captions.jsonl",
    "results/latents/index.json",
)
TRAINED_VAE = "results/vae/model"


@dataclass(frozen=True)
class Stage:
    rules: str  # the rules Snakemake may run ("class_images prepare"); the first one is forced
    target: str  # Snakemake's target
    deps: list[str]
    outs: list = field(default_factory=list)
    metrics: list[str] = field(default_factory=list)
    model: str | None = None  # "base": the base model is a dependency; "stage": the model stages load
    modules: tuple[str, ...] = ()  # the modules whose imports are the stage's code (default sdpipe.stages.<name>)
    extra: dict = field(default_factory=dict)
    # The config keys it reads: those its stage modules declare (READS, stages/declared.py), unless given here.
    params: tuple[str, ...] = ()


# fmt: off
STAGES = {
    "base_model": Stage("base_model", "base_model", [], modules=("sdpipe.models.presets",), params=("model", "seed")),
    "train_vae": Stage("train_vae", "results/vae/summary.json", [MANIFEST], [TRAINED_VAE], ["results/vae/summary.json"],
                       model="base"),
    "prepare": Stage("class_images prepare", "prepare", ["RAW"], [MANIFEST, "results/prepare/rejected.jsonl"],
                     ["results/prepare/summary.json"], modules=("sdpipe.stages.prepare", "sdpipe.stages.class_images")),
    "caption": Stage("caption", "caption", [MANIFEST], [CAPTIONS], ["results/captions/summary.json"]),
    "latents": Stage("latents", "latents", [MANIFEST, CAPTIONS], [LATENTS], ["results/latents/summary.json"],
                     model="stage"),
    "train": Stage("train", "train", [LATENTS], ["results/train/final"], ["results/train/summary.json"], model="stage",
                   extra={"plots": [{"results/train/metrics.csv": {"cache": False, "x": "step", "y": "loss"}}]}),
    "export": Stage("export", "export", ["results/train/final"], ["results/export"], model="stage"),
    "evaluate": Stage("evaluate", "evaluate", ["results/export/diffusers", MANIFEST, "results/train/summary.json"],
                      [{"results/evaluate/samples": {"cache": False}}], ["results/evaluate/metrics.json"]),
    "report": Stage("report", "report",
                    ["results/evaluate/metrics.json", "results/evaluate/samples", "results/export",
                     "results/train/metrics.csv", "results/train/summary.json", MANIFEST,
                     "results/prepare/summary.json", "results/captions/summary.json", "results/latents/summary.json"],
                    [{"results/report": {"cache": False}}]),
    # The model card in its own folder: results/export is the export stage's output, and the card needs evaluate.
    "card": Stage("card", "card", ["results/prepare/summary.json", MANIFEST, CAPTIONS, "results/train/summary.json",
                                   "results/export", "results/evaluate/metrics.json", "results/evaluate/samples"],
                  [{"results/card": {"cache": False}}]),
}
# fmt: on
PLOTS = [
    {"learning_rate": {"x": "step", "y": {"results/train/metrics.csv": "lr"}}},
    {"throughput": {"x": "step", "y": {"results/train/metrics.csv": "samples_per_s"}}},
    "results/evaluate/samples/grid.png",
]
# train.validation.heldout_every: the held-out loss beside the training loss
HELDOUT_PLOT = {"loss": {"x": "step", "y": {"results/train/metrics.csv": ["loss", "heldout_loss"]}}}


def model_paths(cfg: Config) -> tuple[str | None, str | None]:
    """(the base model as a DVC dependency, the model later stages load): a local folder or file is a
    dependency, a hub id is not (its name and revision are params)."""
    from sdpipe import weights

    m = cfg.model
    base = m.pretrained if m.build_preset or weights.is_local(m.pretrained) else None
    return base, (TRAINED_VAE if m.train_vae.enabled else base)


def wanted(name: str, cfg: Config) -> bool:
    return {"base_model": bool(cfg.model.build_preset), "train_vae": cfg.model.train_vae.enabled}.get(name, True)


def stage_modules(name: str, stage: Stage) -> tuple[str, ...]:
    return stage.modules or (f"sdpipe.stages.{name}",)


def config_keys(name: str, stage: Stage) -> tuple[str, ...]:
    """What the stage reads from the config: its modules' READS, in order, once each, without a key that another
    one holds ("prepare.buckets" goes where "prepare" is)."""
    if stage.params:
        return stage.params
    keys = [k for m in stage_modules(name, stage) for k in declared(m.rsplit(".", 1)[-1]).reads]
    return tuple(k for k in dict.fromkeys(keys) if not any(k.startswith(f"{other}.") for other in keys))


def in_file(key: str, written: dict | None) -> bool:
    """Whether the config file sets `key` (dotted). DVC refuses a params key its file lacks, and a project from
    `sdpipe init` writes only the keys its template sets: the others are the schema's defaults, which are code."""
    node = written
    for part in key.split("."):
        if not isinstance(node, dict) or part not in node:
            return written is None  # no file to read: every key, as the demo's complete config has them
        node = node[part]
    return True


def stage_entry(name: str, stage: Stage, cfg: Config, code: list[str], written: dict | None = None) -> dict:
    base, stage_model = model_paths(cfg)
    # With data.raw_remote prepare writes raw_dir itself (its mirror), so it cannot be a DVC dependency; DVC does not
    # see the prefix change, Snakemake does (docs/stages.md#prepare).
    raw = [] if cfg.data.raw_remote else [cfg.data.raw_dir]
    deps = [r for d in stage.deps for r in (raw if d == "RAW" else [d])]
    if name == "prepare" and cfg.dreambooth.enabled and base:
        deps.append(base)  # class images come from the base model
    if name == "prepare":
        deps += [spec.dir for spec in cfg.data.regularisation]
    model = {"base": base, "stage": stage_model}.get(stage.model or "")
    deps += ([model] if model else []) + code
    forced = stage.rules.split()[-1]
    entry: dict[str, object] = {"cmd": f"snakemake --allowed-rules {stage.rules} --forcerun {forced} -- {stage.target}"}
    if deps:
        entry["deps"] = deps
    params = tuple(k for k in config_keys(name, stage) if k == WHOLE_CONFIG or in_file(k, written))
    if params:
        # None: DVC tracks every key of the file
        entry["params"] = [{"config/config.yaml": None if WHOLE_CONFIG in params else list(params)}]
    outs = [cfg.model.pretrained] if name == "base_model" else stage.outs
    if outs:
        entry["outs"] = outs
    if stage.metrics:
        entry["metrics"] = [{m: {"cache": False}} for m in stage.metrics]
    return {**entry, **stage.extra}


def render(cfg: Config, project: Path) -> dict:
    source = project / "sdpipe"
    user = project / "config" / "config.yaml"
    written = (io.read_yaml(user) or {}) if user.is_file() else None
    stages = {}
    for name, stage in STAGES.items():
        if wanted(name, cfg):
            roots = stage_modules(name, stage)
            files = set().union(*(code_files(m, project) for m in roots)) if source.is_dir() else set()
            code = sorted(str(p.relative_to(project)) for p in files)
            stages[name] = stage_entry(name, stage, cfg, code, written)
    plots = PLOTS + [HELDOUT_PLOT] if cfg.train.validation.heldout_every else PLOTS
    return {"stages": stages, "plots": plots}


def text(cfg: Config, project: Path) -> str:
    import yaml

    return HEADER + yaml.safe_dump(render(cfg, project), sort_keys=False, width=120)


def write(project: Path, cfg: Config) -> Path:
    path = project / "dvc.yaml"
    io.write_text(path, text(cfg, project))
    return path


# Code dependencies: the stage's module, every sdpipe module it imports (at module level or inside a function,
# directly or not), and the packages around each (importing a.b runs a/__init__.py).


def _module_file(name: str, project: Path) -> Path | None:
    base = project / Path(*name.split("."))
    return next((p for p in (base.with_suffix(".py"), base / "__init__.py") if p.is_file()), None)


def _runtime_nodes(tree: ast.AST):
    """Every node but those under `if TYPE_CHECKING:`: an import only type checkers see is not code the stage runs."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING":
            yield from (n for child in node.orelse for n in (child, *_runtime_nodes(child)))
            continue
        yield node
        yield from _runtime_nodes(node)


def _imports(name: str, project: Path) -> set[str]:
    found = set()
    path = _module_file(name, project)
    if path is None:
        return set()
    source = path.read_text(encoding="utf-8")
    if path.name == "__init__.py" and "pkgutil.iter_modules(__path__)" in source:
        # a package that imports its modules at run time (models/families/ finds each family's module)
        found |= {f"{name}.{p.stem}" for p in path.parent.glob("*.py") if p.name != "__init__.py"}
    for node in _runtime_nodes(ast.parse(source)):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found |= {node.module} | {f"{node.module}.{a.name}" for a in node.names}
    return {m for m in found if m.split(".")[0] == "sdpipe" and _module_file(m, project)}


def code_modules(root: str, project: Path) -> set[str]:
    seen, todo = set(), [root]
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            parts = name.split(".")
            todo += [*_imports(name, project), *(".".join(parts[:i]) for i in range(1, len(parts)))]
    return seen


def code_files(root: str, project: Path) -> set[Path]:
    return {p for m in code_modules(root, project) if (p := _module_file(m, project))}


def main(args) -> int:
    from sdpipe.config import load

    path = write(Path("."), load(args.config, args.set))
    print(f"wrote {path}")
    return 0
