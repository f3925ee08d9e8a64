"""What a diffusers pipeline folder is, read from its model_index.json: its family and its text encoders.

Apart from sdpipe.models.loading, so that stages which only need these facts (the latents stage when every image
is cached, check-config) do not import torch and diffusers: 6 s on a small CPU, in every rerun.
"""

from __future__ import annotations

from pathlib import Path

from sdpipe import io, weights
from sdpipe.errors import UserError
from sdpipe.models import families


def model_index(pretrained: str, revision: str | None = None) -> tuple[Path, dict]:
    """The local folder and its model_index.json (what makes a folder a diffusers pipeline)."""
    root = weights.resolve(str(pretrained), revision)
    index = root / "model_index.json"
    if not index.is_file():
        raise UserError(
            f"{pretrained} is not a diffusers pipeline folder (no model_index.json); convert a single-file "
            f"checkpoint with diffusers' from_single_file(...).save_pretrained(folder) first"
        )
    return root, io.read_json(index)


def pipeline_family(pretrained: str, revision: str | None = None) -> str:
    """The family's name ("sdxl" for SDXL pipelines, base or refiner; "sd" for SD 1.x / 2.x); any pipeline no
    family claims is a UserError."""
    return family_of(pretrained, revision).name


def family_of(pretrained: str, revision: str | None = None) -> families.Family:
    _, index = model_index(pretrained, revision)
    return families.detect(index, str(pretrained))


def text_component_names(pretrained: str, revision: str | None = None) -> list[str]:
    """The text encoder subfolders, in pipeline order: the weights that text embeddings depend on."""
    _, index = model_index(pretrained, revision)
    family = families.detect(index, str(pretrained))
    names = [enc for enc in family.text_encoders if families.present(index, enc)]
    if not names:
        raise UserError(
            f"{pretrained} has no text encoder (model_index.json lists none of {', '.join(family.text_encoders)}); "
            f"sdpipe needs a text-conditioned {family.title} pipeline"
        )
    return names
