"""What each stage module declares about itself, read from its source without importing it.

A stage module declares, at its top: `INPUTS` and `OUTPUTS` (flag name -> default path) and `READS`, the config
keys its outputs depend on (dotted, e.g. "prepare.buckets"; "*" is the whole config). Those declarations are the
one place these facts live: the Snakemake rules' `params.settings` (what makes Snakemake rerun a stage when the
config changes) and `dvc.yaml`'s params are made from `READS`. The workflow reads them at every `snakemake` start,
so they are parsed from the file (literals only) instead of importing the stage and its libraries.
"""

from __future__ import annotations

import ast
import functools
from dataclasses import dataclass
from pathlib import Path
from typing import Any

WHOLE_CONFIG = "*"


@dataclass(frozen=True)
class Declaration:
    inputs: dict[str, str]
    outputs: dict[str, str]
    reads: tuple[str, ...]


@functools.lru_cache(maxsize=None)
def declared(module: str) -> Declaration:
    """The declarations of a stage module, e.g. declared("caption") for sdpipe/stages/caption.py."""
    path = Path(__file__).with_name(f"{module}.py")
    found: dict[str, Any] = {}
    for node in ast.parse(path.read_text(encoding="utf-8")).body:
        if isinstance(node, ast.Assign) and isinstance(node.targets[0], ast.Name):
            name, value = node.targets[0].id, node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            name, value = node.target.id, node.value
        else:
            continue
        if name in ("INPUTS", "OUTPUTS", "READS"):
            found[name] = ast.literal_eval(value)
    return Declaration(dict(found.get("INPUTS", {})), dict(found.get("OUTPUTS", {})), tuple(found.get("READS", ())))


def lookup(config: dict, key: str) -> object:
    """The value at a dotted key of a raw config (None where a section lacks it)."""
    value: object = config
    for part in key.split("."):
        value = value.get(part) if isinstance(value, dict) else None
    return value


def settings(config: dict, module: str) -> dict:
    """The config values a stage's outputs depend on, by dotted key: what a rule passes as `params.settings`."""
    reads = declared(module).reads
    if WHOLE_CONFIG in reads:
        return config
    return {key: lookup(config, key) for key in reads}
