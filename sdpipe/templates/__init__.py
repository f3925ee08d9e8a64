"""Job templates: the settings the field uses for each job people run (sd15-lora, sdxl-dreambooth, ...).

A template is a YAML file beside this module listing only the keys its job sets, each with a comment saying why;
every other key takes the schema's default, so a template never carries the demo's settings. `extends: NAME`
makes a variant (a 24 GB card) from another template. `sdpipe init` (sdpipe.project) turns one into a project's
config/config.yaml.
"""

from __future__ import annotations

import re
from importlib import resources

import yaml

from sdpipe.errors import UserError

FOLDER = resources.files("sdpipe") / "templates"
_KEY_LINE = re.compile(r"^(?P<indent> *)(?P<key>[A-Za-z0-9_.]+):(?P<rest>.*)$")


def names() -> list[str]:
    return sorted(p.name[:-5] for p in FOLDER.iterdir() if p.name.endswith(".yaml"))


def _text(name: str) -> str:
    if name not in names():
        raise UserError(f"no template {name!r}; the templates are: {', '.join(names())}")
    return (FOLDER / f"{name}.yaml").read_text(encoding="utf-8")


def summary(name: str) -> str:
    """The template's first comment line: what job it is for."""
    head = []
    for line in _text(name).splitlines():
        if not line.startswith("#"):
            break
        head.append(line.lstrip("# ").strip())
    return re.split(r"(?<=\.)\s", " ".join(head), maxsplit=1)[0]


def family(name: str) -> str:
    """The model family a template is written for: the longest family name its name starts with ("sdxl-lora" is
    "sdxl", "sd15-lora" is "sd")."""
    from sdpipe.models import families

    return max((f for f in families.names() if name.startswith(f)), key=len)


def settings(name: str) -> dict:
    """The template's settings, a variant's merged over the template it extends."""
    from sdpipe.config import merge

    own = yaml.safe_load(_text(name)) or {}
    base = own.pop("extends", None)
    return merge(settings(base), own) if base else own


def comments(name: str) -> dict[tuple[str, ...], str]:
    """Each key's comment, by its path (("train", "learning_rate") -> "diffusers' ..."); a variant's win."""
    found: dict[tuple[str, ...], str] = {}
    base = (yaml.safe_load(_text(name)) or {}).get("extends")
    if base:
        found.update(comments(base))
    stack: list[tuple[int, str]] = []
    for line in _text(name).splitlines():
        match = _KEY_LINE.match(line)
        if not match:
            continue
        indent = len(match["indent"])
        stack = [(i, k) for i, k in stack if i < indent] + [(indent, match["key"])]
        _, sep, comment = match["rest"].partition(" #")
        if sep and comment.strip():
            found[tuple(k for _, k in stack)] = comment.strip()
    return found
