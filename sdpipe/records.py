"""The records stages pass to each other through files, as types: one place says what each field of a manifest row,
a caption row and the latent index is. Producers and readers annotate with these, and mypy checks the typed core
against them (pyproject.toml's [tool.mypy]).

Each record carries its layout version: every manifest and caption row its own `version`, the latent index one for
the file (sdpipe/latent_index.py). A reader handed records of another version (outputs an older sdpipe wrote, kept
because Snakemake does not rerun a stage when only the installed package changed) fails in one line naming the stage
to rerun, instead of a KeyError deep inside it. Bump a version when its fields change.
"""

from __future__ import annotations

from typing import Literal, TypedDict

MANIFEST_VERSION = 1
CAPTIONS_VERSION = 1
# The stage that writes each versioned JSONL record, and its version (stages.read_upstream checks it).
ROW_VERSIONS = {"prepare": MANIFEST_VERSION, "caption": CAPTIONS_VERSION}

# A training image, a DreamBooth class image (generated), or an image of a data.regularisation folder
Role = Literal["instance", "class", "regularisation"]
Split = Literal["train", "eval"]


class ManifestRow(TypedDict):
    """One usable image: results/prepare/manifest.jsonl."""

    version: int  # MANIFEST_VERSION
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
    # data.regularisation rows also carry "loss_weight" (float) and, with a folder caption, "fixed_caption": true;
    # data.concepts rows may carry those and "caption_prefix" (str)


class CaptionRow(TypedDict):
    """One image's caption: results/captions/captions.jsonl."""

    version: int  # CAPTIONS_VERSION
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
    text_keys: list[str] | None  # latents.tags: the caption's shuffled variants (text_key is the first)
    caption_variants: list[str] | None
    latent_key: str
    flip_key: str | None  # the mirrored image's latent (latents.flip)
    mask_key: str | None  # its loss mask in the latent store (data.masks), and the mirrored one's
    flip_mask_key: str | None
    original_size: list[int]  # (h, w): SDXL's size conditioning
    crop_top_left: list[int]
    flip_crop_top_left: list[int]
    loss_weight: float | None  # a data.regularisation folder's weight; None: 1, or dreambooth.prior_loss_weight


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
    # latents.remote: the S3 prefix of each store ({"latent": url, "text": url}), or None when the cache is local
    remote_stores: dict[str, str] | None
    items: list[LatentItem]
    failed: list[Failure]


class StepPlanRecord(TypedDict):
    """The step accounting of a run (train/accounting.py's StepPlan)."""

    dataset_size: int
    buckets: dict[str, int]  # "WxH" -> samples, sorted by bucket
    world_size: int
    per_device_batch_size: int
    grad_accum_steps: int
    global_batch_size: int  # samples per optimizer step when every batch is full
    micro_steps_per_epoch: int
    optimizer_steps_per_epoch: int
    epochs: int
    total_optimizer_steps: int
    lr_schedule_steps: int
    warmup_steps: int
    samples_per_epoch: int


class TrainRates(TypedDict):
    """Steady throughput and, each under its own name, the seconds that are not steady (train/telemetry.py)."""

    samples_per_s: float | None  # all ranks, the first logging window left out; None: too short to tell
    warmup_s: float | None  # the first window's time beyond what the steady rate would have taken
    compile_s: float | None  # torch.compile's own timers
    time_to_first_step_s: float | None  # from the stage's start: launch, imports, loading, the first step
    steady_steps_samples: int  # the samples the steady rate is measured over
    validation_and_checkpoint_s: float | None  # paused for validation grids and checkpoints, not in the rate


class TrainSummary(StepPlanRecord, TrainRates):
    """results/train/summary.json: the run's plan, what it did, and how fast (rank 0 writes it)."""

    optimizer_steps: int  # reached, over the run and its resumes
    epochs_started: int
    samples_seen: int  # over the run and its resumes
    samples_this_run: int  # since this process started (a resume counts only its own)
    seconds: float  # the training loop's wall time, everything included
    compile: str  # what train.compile meant on this device: whole, blocks or eager
    mode: str  # full or lora
    mixed_precision: str
    prediction_type: str
    device: str
    peak_memory_mb: float | None  # None off CUDA
    cuda_alloc_retries: int | None
