"""The free captioners: a sidecar text file's caption, and a template filled from the folder and file name.

Both are cheap and exact, so they run in the parent process for every image; only their cache entries are shared
with the model captioners (so a rerun can say what changed).
"""

from __future__ import annotations

import re
import string
from dataclasses import dataclass
from pathlib import PurePosixPath
from typing import Any

from sdpipe.errors import UserError

TEMPLATE_FIELDS = ("folder", "stem")
# Trailing numbering such as "_0007", "-1-2", " (3)" or ".001" tells images apart; it does not describe them.
# Digits glued to a word ("r2d2", "v2") are kept: they are likely part of the name.
_TRAILING_NUMBERING = re.compile(r"(?:(?:^|[\s.]+)(?:\d+|\(\d+\)|\[\d+\]))*[\s.]*$")


@dataclass(frozen=True)
class Proposal:
    caption: str
    provenance: dict
    key_inputs: Any  # what the caption depends on besides the image id; part of the cache key


def clean_stem(stem: str) -> str:
    """File stem to words: "a_red_circle-on_white_0007" becomes "a red circle on white"."""
    text = stem.replace("_", " ").replace("-", " ")
    text = _TRAILING_NUMBERING.sub("", text, count=1)
    return " ".join(text.split())


def template_fields(template: str) -> set[str]:
    """The fields a template uses; UserError for a malformed template or an unknown field."""
    try:
        names = {name for _, name, _, _ in string.Formatter().parse(template) if name is not None}
    except ValueError as exc:
        raise UserError(f"caption.template = {template!r} is not a valid template: {exc}") from None
    unknown = sorted(n for n in names if n not in TEMPLATE_FIELDS)
    if unknown:
        shown = "{}" if "" in unknown else "{" + unknown[0] + "}"
        raise UserError(f"caption.template = {template!r} uses {shown}; allowed fields are {{folder}} and {{stem}}")
    return names


def from_sidecar(row: dict) -> Proposal | None:
    text = (row.get("sidecar") or "").strip()
    if not text:
        return None
    return Proposal(text, {"source": "sidecar", "file": row.get("sidecar_path")}, text)


def from_template(template: str, row: dict) -> Proposal | None:
    """Fill the template; None when a field it uses is empty (a top-level image has no folder, "0001" no stem)."""
    values = {
        "folder": " ".join((row.get("folder") or "").split()),
        "stem": clean_stem(PurePosixPath(row["path"]).stem),
    }
    used = {name: values[name] for name in template_fields(template)}
    if any(not value for value in used.values()):
        return None
    caption = " ".join(template.format(**used).split())
    if not caption:
        return None
    return Proposal(caption, {"source": "template", "template": template}, {"template": template, "fields": used})


def propose(source: str, template: str, row: dict) -> Proposal | None:
    return from_sidecar(row) if source == "sidecar" else from_template(template, row)
