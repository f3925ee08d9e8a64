"""Load config/config.yaml, validate it against the JSON schema, and expose it as typed dataclasses.

The schema (sdpipe/config.schema.yaml, shipped inside the package) is the single source of truth for keys, defaults
and allowed values; the Snakefile validates through this module when the workflow loads. The dataclasses give stage
code attribute access and type hints.

One rule for files: whatever the package needs at run time is package data, read with importlib.resources, so a
non-editable install (`pip install .`, a wheel, the Docker image) works from any project folder. The project
folder holds only the workflow (Snakefile, workflow/, profiles/) and the user's config and data.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
from dataclasses import dataclass, field
from functools import lru_cache
from importlib import resources
from pathlib import Path
from typing import Any, Literal

import yaml
from jsonschema import Draft202012Validator, validators

from sdpipe.errors import UserError

SCHEMA = resources.files("sdpipe") / "config.schema.yaml"

Gpus = int | Literal["auto"]


@dataclass(frozen=True)
class MasksConfig:
    source: str
    suffix: str


@dataclass(frozen=True)
class RegularisationConfig:
    dir: str
    weight: float
    repeats: int | Literal["balance"]
    caption: str | None


@dataclass(frozen=True)
class ConceptConfig:
    folder: str
    repeats: int | None
    weight: float
    caption: str | None
    caption_prefix: str | None
    resolution: int | None


@dataclass(frozen=True)
class DataConfig:
    raw_dir: str
    raw_remote: str | None
    caption_extensions: list[str]
    concepts: list[ConceptConfig]
    regularisation: list[RegularisationConfig]
    masks: MasksConfig


@dataclass(frozen=True)
class TrainVaeConfig:
    enabled: bool
    steps: int
    batch_size: int
    learning_rate: float
    kl_weight: float
    reconstruction: str


@dataclass(frozen=True)
class ModelConfig:
    pretrained: str
    build_preset: str | None
    revision: str | None
    variant: str | None
    single_file_config: str | None
    train_vae: TrainVaeConfig


@dataclass(frozen=True)
class BucketConfig:
    resolution: int
    also_at: list[int]
    step: int
    max_aspect: float


@dataclass(frozen=True)
class PrepareConfig:
    min_size: int
    max_pixels: int
    alpha_background: list[int]
    eval_fraction: float
    workers: int
    buckets: BucketConfig


@dataclass(frozen=True)
class BlipConfig:
    model: str
    prompt: str | None
    max_new_tokens: int
    num_beams: int


@dataclass(frozen=True)
class ClipTagsConfig:
    model: str
    pretrained: str
    model_config: str | None
    vocabulary: list[str]
    top_k: int
    min_probability: float
    prompt: str


@dataclass(frozen=True)
class CaptionConfig:
    chain: list[str]
    template: str
    batch_size: int
    gpus: Gpus
    blip: BlipConfig
    clip_tags: ClipTagsConfig


@dataclass(frozen=True)
class TagsConfig:
    shuffle: bool
    keep_first: int
    dropout: float
    separator: str
    variants: int


@dataclass(frozen=True)
class LatentsConfig:
    dtype: str
    batch_size: int | Literal["auto"]
    resize: str
    crop: str
    interpolation: str
    flip: bool
    tags: TagsConfig
    gpus: Gpus
    loader_threads: int
    cpu_processes: int
    compile: str
    remote: str | None


@dataclass(frozen=True)
class LoraConfig:
    rank: int
    alpha: float
    dropout: float
    type: str
    dora: bool
    target_modules: list[str]


@dataclass(frozen=True)
class ValidationConfig:
    every: int
    prompts: list[str]
    seeds: list[int]
    steps: int
    guidance: float
    resolution: list[int] | None
    heldout_every: int
    heldout_timesteps: list[float]
    heldout_images: int


@dataclass(frozen=True)
class MaskedLossConfig:
    unmasked_weight: float


@dataclass(frozen=True)
class EmaConfig:
    enabled: bool
    decay: float


@dataclass(frozen=True)
class DdpConfig:
    bucket_cap_mb: float
    gradient_as_bucket_view: bool
    static_graph: bool
    timeout_s: int


@dataclass(frozen=True)
class MultiNodeConfig:
    num_machines: int
    machine_rank: int
    main_process_ip: str | None
    main_process_port: int


@dataclass(frozen=True)
class TextEncoderConfig:
    mode: str
    learning_rate: float | None
    lora_target_modules: list[str]


@dataclass(frozen=True)
class DreamBoothConfig:
    enabled: bool
    class_prompt: str
    num_class_images: int
    prior_loss_weight: float
    steps: int
    guidance: float
    batch_size: int
    resolution: list[int] | None
    gpus: Gpus


@dataclass(frozen=True)
class TrainConfig:
    mode: str
    num_processes: int | Literal["auto"]
    per_device_batch_size: int
    grad_accum_steps: int
    max_steps: int | None
    epochs: int
    learning_rate: float
    lr_scheduler: str
    lr_warmup_steps: int
    adam_beta1: float
    adam_beta2: float
    adam_weight_decay: float
    adam_epsilon: float
    optimizer: str
    max_grad_norm: float | None
    mixed_precision: str
    gradient_checkpointing: bool
    compile: str
    prediction_type: str | None
    snr_gamma: float | None
    noise_offset: float
    input_perturbation: float
    caption_dropout: float
    checkpoint_every: int
    keep_checkpoints: int
    save_final: bool
    resume: str | None
    log_every: int
    tracker: str
    tracker_project: str
    validation: ValidationConfig
    masked_loss: MaskedLossConfig
    ema: EmaConfig
    lora: LoraConfig
    text_encoder: TextEncoderConfig
    ddp: DdpConfig
    multi_node: MultiNodeConfig


@dataclass(frozen=True)
class VerifyConfig:
    prompt: str
    seed: int
    steps: int
    guidance: float
    resolution: list[int] | None
    device: str
    tolerance: float


@dataclass(frozen=True)
class HubConfig:
    repo_id: str | None
    private: bool
    token_env: str


@dataclass(frozen=True)
class ExportConfig:
    dtype: str
    ema: bool
    single_file: bool
    name: str | None
    hub: HubConfig
    verify: VerifyConfig


@dataclass(frozen=True)
class FidConfig:
    enabled: bool
    inception_weights: str | None
    reference_stats: str | None


@dataclass(frozen=True)
class ClipScoreConfig:
    enabled: bool
    model: str
    pretrained: str
    model_config: str | None


@dataclass(frozen=True)
class EvaluateConfig:
    prompts: list[str]
    seeds: list[int]
    steps: int
    guidance: float
    batch_size: int | Literal["auto"]
    resolution: list[int] | None
    gpus: Gpus
    compile: str
    fid: FidConfig
    clip_score: ClipScoreConfig


@dataclass(frozen=True)
class BenchmarkConfig:
    gpu_counts: list[int]
    steps: int
    warmup_steps: int


@dataclass(frozen=True)
class Config:
    seed: int
    cache_dir: str
    data: DataConfig
    model: ModelConfig
    prepare: PrepareConfig
    caption: CaptionConfig
    latents: LatentsConfig
    dreambooth: DreamBoothConfig
    train: TrainConfig
    export: ExportConfig
    evaluate: EvaluateConfig
    benchmark: BenchmarkConfig
    raw: dict[str, Any] = field(repr=False, compare=False, default_factory=dict)


@lru_cache(maxsize=1)
def load_schema() -> dict:
    return yaml.safe_load(SCHEMA.read_text(encoding="utf-8"))


def _with_defaults(validator_class):
    """A validator that fills in schema defaults while it validates (the recipe from the jsonschema FAQ)."""
    check_properties = validator_class.VALIDATORS["properties"]

    def set_defaults(validator, properties, instance, schema):
        if isinstance(instance, dict):
            for name, sub in properties.items():
                if "default" in sub:
                    instance.setdefault(name, copy.deepcopy(sub["default"]))
                if name in instance:
                    instance[name] = _number_from_text(validator, sub, instance[name])
        yield from check_properties(validator, properties, instance, schema)

    return validators.extend(validator_class, {"properties": set_defaults})


_Validator = _with_defaults(Draft202012Validator)
NUMBER_TEXT = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def _number_from_text(validator, schema: dict, value):
    """`1e-4` as the number it means: YAML 1.1 (PyYAML, which Snakemake uses too) reads a float without a dot as a
    string. Only where the string itself is not allowed by `schema` and the number is."""
    if not isinstance(value, str) or not NUMBER_TEXT.fullmatch(value.strip()):
        return value
    validator = validator.evolve(schema=schema)
    if validator.is_valid(value):
        return value
    number = float(value)
    for candidate in ((int(number),) if number.is_integer() else ()) + (number,):
        if validator.is_valid(candidate):
            return candidate
    return value


def _key_of(error) -> str:
    key = ""
    for part in error.absolute_path:
        key += f"[{part}]" if isinstance(part, int) else f".{part}"
    return key.lstrip(".") or "(top level)"


def _allowed(error) -> str:
    """Say what the schema allows at the failing key, in words."""
    schema, kind = error.schema, error.validator
    if kind == "enum":
        return f"one of {schema['enum']}"
    if kind in ("minLength", "minItems"):
        return f"at least {schema[kind]} {'character' if kind == 'minLength' else 'item'}(s)"
    if kind in ("minimum", "maximum"):
        lo, hi = schema.get("minimum"), schema.get("maximum")
        if lo is not None and hi is not None:
            return f"a value from {lo} to {hi}"
        if lo is not None:
            return f"a value >= {lo}"
        if hi is not None:
            return f"a value <= {hi}"
        return error.message
    if kind == "type":
        return f"a value of type {schema['type']}"
    if kind == "additionalProperties":
        return f"only the keys {sorted(schema.get('properties', {}))}"
    if kind == "oneOf":
        return " or ".join(_describe(s) for s in schema["oneOf"])
    if kind == "pattern":  # x-pattern-means says it in words where a regex would not tell the user much
        return schema.get("x-pattern-means") or f"a string matching {schema['pattern']!r}"
    if kind == "uniqueItems":
        return "a list without repeats"
    return error.message


def _describe(sub: dict) -> str:
    if "$ref" in sub:
        sub = load_schema()["definitions"][sub["$ref"].rsplit("/", 1)[-1]]
        return " or ".join(_describe(s) for s in sub.get("oneOf", [sub]))
    if "enum" in sub:
        return f"one of {sub['enum']}"
    kind = sub.get("type")
    if kind == "null":
        return "null"
    if kind == "integer" and "minimum" in sub:
        return f"an integer from {sub['minimum']} to {sub.get('maximum', 'any')}"
    return f"a {kind}"


def _format_error(error) -> str:
    key = _key_of(error)
    if error.validator == "additionalProperties":
        extra = sorted(set(error.instance) - set(error.schema.get("properties", {})))
        where = f"{key}." if error.absolute_path else ""
        allowed = sorted(error.schema["properties"])
        near = difflib.get_close_matches(extra[0], allowed, n=1)
        hint = f"did you mean {where}{near[0]}? " if near else ""
        return f"config: unknown key {where}{extra[0]}; {hint}allowed here: {allowed}"
    return f"config: {key} = {error.instance!r} is not allowed; expected {_allowed(error)}"


def validate_dict(raw: dict) -> dict:
    """Validate a config dict (defaults filled in, in a copy). Raise UserError naming key, value and what's allowed."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"config: expected a mapping of sections at the top level, got {type(raw).__name__}")
    filled = copy.deepcopy(raw)
    errors = sorted(_Validator(load_schema()).iter_errors(filled), key=lambda e: (list(e.absolute_path), e.message))
    if errors:
        raise UserError(_format_error(errors[0]))
    return filled


def _build(cls, values: dict):
    kwargs = {}
    for f in dataclasses.fields(cls):
        if f.name == "raw":
            continue
        value = values[f.name]
        if dataclasses.is_dataclass(f.type if isinstance(f.type, type) else None):
            value = _build(f.type, value)
        elif item_type := _dataclass_items(f.type):  # e.g. data.regularisation: a list of typed entries
            value = [_build(item_type, item) for item in value]
        kwargs[f.name] = value
    return cls(**kwargs)


def _dataclass_items(hint: Any) -> Any:
    """X for a list[X] hint whose X is a dataclass, else None."""
    args: tuple = getattr(hint, "__args__", ())
    item = args[0] if getattr(hint, "__origin__", None) is list and len(args) == 1 else None
    return item if isinstance(item, type) and dataclasses.is_dataclass(item) else None


def _resolve_types(cls) -> None:
    hints = __import__("typing").get_type_hints(cls)
    for f in dataclasses.fields(cls):
        f.type = hints[f.name]
        if dataclasses.is_dataclass(f.type):
            _resolve_types(f.type)


_resolve_types(Config)


def check_user_config(cfg: Config) -> None:
    """Rules for the config a user writes (the workflow checks it when it loads, and check-config), not for the
    per-stage configs derived from it: after model.train_vae, stages get model.pretrained = the trained pipeline."""
    m = cfg.model
    if m.train_vae.enabled and not m.build_preset:
        raise UserError(
            f"config: model.train_vae.enabled retrains the VAE of {m.pretrained} from your images, a "
            f"setting for the demo's random-init preset; for real weights set model.train_vae.enabled: "
            f"false"
        )
    if m.build_preset and Path(m.pretrained).name != m.build_preset:
        raise UserError(
            f"config: model.build_preset = {m.build_preset} builds a random-init model at model.pretrained "
            f"= {m.pretrained}, which would then hide any real weights there; for your own base model set "
            f"model.build_preset: null (a preset is built only into a folder named after it, e.g. "
            f"models/{m.build_preset})"
        )
    from sdpipe.models import owned

    if m.build_preset and owned.foreign(Path(m.pretrained)):
        raise UserError(
            f"config: model.build_preset = {m.build_preset} would replace {m.pretrained}, which sdpipe did "
            f"not build, with a random-init model; to train on it set model.build_preset: null, or move "
            f"it away to let sdpipe build the preset there"
        )
    _check_folders(cfg)
    from sdpipe import model_facts
    from sdpipe.train import optimizers

    optimizers.check_available(cfg.train.optimizer)
    model_facts.check(cfg)


def _check_folders(cfg: Config) -> None:
    """Paths the stages write folders under must not be files (each stage would otherwise stop in a traceback)."""
    for key, value in (("cache_dir", cfg.cache_dir),):
        path = Path(value)
        blocker = next((p for p in (path, *path.parents) if p.exists()), None)
        if blocker is not None and not blocker.is_dir():
            raise UserError(
                f"config: {key} = {value} must be a folder, but {blocker} is a file; point it at a "
                f"folder (it is made if missing)"
            )


def _check_combinations(cfg: Config) -> None:
    """Rules between keys that a per-key schema cannot say."""
    if cfg.train.optimizer == "adamw_schedulefree" and cfg.train.lr_scheduler != "constant":
        raise UserError(
            f"config: train.optimizer = adamw_schedulefree with train.lr_scheduler = {cfg.train.lr_scheduler}: a "
            "schedule-free optimizer replaces the decaying schedule; set train.lr_scheduler to constant (its warm-up "
            "is train.lr_warmup_steps)"
        )
    if cfg.train.lora.dora and cfg.train.lora.type != "lora":
        raise UserError(
            f"config: train.lora.dora = true with train.lora.type = {cfg.train.lora.type}: DoRA decomposes a LoRA "
            "only; set train.lora.type to lora or train.lora.dora to false"
        )
    if cfg.train.mode == "lora" and cfg.train.text_encoder.mode == "full":
        raise UserError(
            "config: train.mode = lora with train.text_encoder.mode = full: a LoRA file cannot carry a "
            "fully trained text encoder, so its exports would not reproduce the trained model; set "
            "train.text_encoder.mode to lora or none (or train.mode to full)"
        )
    if cfg.train.validation.heldout_every and not cfg.prepare.eval_fraction:
        raise UserError(
            "config: train.validation.heldout_every needs held-out images: set prepare.eval_fraction above 0 "
            "(e.g. 0.05), or train.validation.heldout_every: 0"
        )
    if cfg.dreambooth.enabled and not cfg.dreambooth.class_prompt.strip():
        raise UserError('config: dreambooth.enabled needs dreambooth.class_prompt (e.g. "a photo of a dog")')
    if cfg.dreambooth.enabled and cfg.model.train_vae.enabled:
        raise UserError(
            "config: dreambooth.enabled and model.train_vae.enabled exclude each other: class images come "
            "from the base model, which needs a trained VAE already"
        )


def from_dict(raw: dict) -> Config:
    filled = validate_dict(raw)
    cfg = _build(Config, filled)
    _check_combinations(cfg)
    object.__setattr__(cfg, "raw", filled)
    # weights.resolve turns a single-file model.pretrained into its converted folder from the name alone; where
    # conversions live and which configs they use come from the config loaded in this process.
    from sdpipe import single_file

    single_file.configure(cfg.cache_dir, cfg.model.single_file_config)
    return cfg


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """`section.key=value` strings, each value parsed as YAML, set into `raw` (validated later like any config)."""
    for item in overrides:
        key, sep, text = item.partition("=")
        if not sep or not key:
            raise UserError(f"--set expects section.key=value, got {item!r}")
        try:
            value = yaml.safe_load(text)
        except yaml.YAMLError:
            value = text  # e.g. a template such as "{folder} photo": a plain string; the schema decides
        node = raw
        *parents, leaf = key.split(".")
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise UserError(f"--set {key}: {part} is not a section")
        node[leaf] = value
    return raw


def read_file(path: str | Path) -> dict:
    """One config file as a dict; a missing or malformed file is a one-line UserError."""
    path = Path(path)
    if not path.is_file():
        raise UserError(f"config file not found: {path}")
    try:
        with open(path, encoding="utf-8") as f:
            raw = yaml.safe_load(f)
    except yaml.YAMLError as exc:
        raise UserError(f"config file {path} is not valid YAML: {str(exc).splitlines()[0]}") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise UserError(f"config file {path}: expected a mapping of sections at the top level")
    return raw


def merge(base: dict, update: dict) -> dict:
    """`update` over `base`, section by section (Snakemake's rule for several config files)."""
    out = copy.deepcopy(base)
    for key, value in update.items():
        out[key] = merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def effective(files: list[str | Path], overrides: dict | None = None) -> Config:
    """THE effective config, the same for Snakemake, check-config and every stage: the schema's defaults, then the
    user's files in order, then command-line overrides. Nothing else sits underneath: a user's own file does not
    inherit the demo's settings from config/config.yaml."""
    raw: dict = {}
    for path in files:
        raw = merge(raw, read_file(path))
    return from_dict(merge(raw, overrides or {}))


def load(path: str | Path, overrides: tuple[str, ...] | list[str] = ()) -> Config:
    """Read, override, validate: a bad file or value is a one-line UserError."""
    return effective([path], apply_overrides({}, list(overrides)))
