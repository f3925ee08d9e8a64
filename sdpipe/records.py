"""The records stages pass to each other through files, as types: one place says what each field of a manifest row,
a caption row and the latent index is. Producers and readers annotate with these, and mypy checks the typed core
against them (pyproject.toml's [tool.mypy]).

The latent index carries its layout version (sdpipe/latent_index.py); training refuses an index of another version
and asks for `snakemake latents`. Manifest and caption rows are read only by the stages right after them, which a
changed layout reruns in the same DAG, so they carry none.
"""

from __future__ import annotations

from typing import Literal, TypedDict

Role = Literal["instance", "class"]  # a training image, or a DreamBooth class (regularisation) image
Split = Literal["train", "eval"]


class ManifestRow(TypedDict):
    """One usable image: results/prepare/manifest.jsonl."""

    id: str  # content id: the hash of the decoded pixels (renames keep it, edits change it)
    path: str  # relative to data.raw_dir (to the class-images folder for class images)
    file: str  # the path prepare read; jobs with their own copy of the raw folder use path instead
    role: Role
    width: int
    height: int
    format: str  # PIL's format name: PNG, JPEG, WEBP, ...
    mode: str  # PIL's mode before conversion: RGB, RGBA, L, P, ...
    bucket: list[int]  # [width, height] it trains at
    split: Split
    repeats: int  # kohya-style N_name folders: N samples per epoch
    folder: str  # the N_name folder's name, the {folder} of caption templates
    sidecar: str | None  # the sidecar caption's text
    sidecar_path: str | None


class CaptionRow(TypedDict):
    """One image's caption: results/captions/captions.jsonl."""

    id: str
    path: str
    split: Split | None
    caption: str | None  # None: no captioner in the chain gave one (error says why)
    source: str | None  # the captioner that gave it: sidecar, template, blip, clip_tags
    provenance: dict | None  # that captioner's settings and weights
    error: str | None


class LatentModel(TypedDict):
    """The model the latent cache was made with: what its keys and training's scaling depend on."""

    pretrained: str
    family: str  # a models.families name
    vae_sha256: str
    text_sha256: dict[str, str]
    scaling_factor: float
    shift_factor: float | None
    vae_downsample: int
    dtype: str
    variant: str | None


class LatentItem(TypedDict):
    """One image in the latent index: where its latent and its caption's text states are cached."""

    id: str
    path: str
    role: Role
    bucket: list[int]
    repeats: int
    caption: str
    text_key: str
    latent_key: str
    flip_key: str | None  # the mirrored image's latent (latents.flip)
    original_size: list[int]  # (h, w): SDXL's size conditioning
    crop_top_left: list[int]
    flip_crop_top_left: list[int]


class Failure(TypedDict):
    path: str
    reason: str


class LatentIndex(TypedDict):
    """results/latents/index.json: everything training reads, and nothing it must recompute."""

    version: int
    model: LatentModel
    latent_store: str
    empty_text_key: str  # the empty caption's text states (caption dropout)
    text_store: str
    items: list[LatentItem]
    failed: list[Failure]
