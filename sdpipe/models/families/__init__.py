"""The model families sdpipe trains, and which one a pipeline folder, a UNet config or a single file is.

The family seam: one `Family` per module of this package (`sd.py`, `sdxl.py`) owns what differs between families:
detection, the denoiser and text components and their classes, how text is embedded and which states condition the
denoiser, the noise objective, extra conditioning, the pipeline class that renders it, the single-file and kohya
names, and the base-model facts exports and cards carry. Code elsewhere asks the family (`named(name)`) instead of
branching on its name. Adding a family is a module here that defines `FAMILY`; docs/ARCHITECTURE.md lists the rest
(presets, templates, tests).

A pipeline sdpipe cannot train (PixArt, Sana, or any other family without a module here) is refused in one line instead
of being taken for SDXL because it too has a second text encoder.
"""

from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, NamedTuple

from sdpipe.errors import UserError

if TYPE_CHECKING:
    import torch

    from sdpipe.models.loading import TextStack
    from sdpipe.models.objectives import Objective


class TextPart(NamedTuple):
    """One tokenizer and text encoder of a pipeline: their subfolders, the classes used when model_index.json
    names none that transformers has, and the token length captions are padded or cut to (None: the tokenizer's
    own, at most the encoder's positions; T5 has no positions of its own, so its pipelines choose the length)."""

    tokenizer: str
    encoder: str
    tokenizer_class: str
    encoder_class: str
    max_length: int | None = None


class Base(NamedTuple):
    """A base model version, as exports and cards name it."""

    version: str  # kohya's ss_base_model_version
    title: str  # what the model card calls it
    architecture: str  # the SAI model spec's modelspec.architecture
    implementation: str  # the model spec's reference implementation
    hub_tag: str  # the Hugging Face Hub tag of the family


@dataclass(frozen=True)
class Family:
    """Everything sdpipe does differently per model family; code elsewhere asks the family instead of branching on
    its name."""

    name: str  # the value caches, presets, configs and template names record: "sd" or "sdxl"
    title: str  # what users call it
    priority: int  # detection asks families in descending priority: a more specific family before its fallback
    # Detection: from a pipeline's model_index.json, a denoiser's config, and a single file's key names.
    detects: Callable[[dict], bool]
    config_matches: Callable[[dict], bool]
    # Key prefixes an original-layout file of this family has, all of them; each may sit under
    # `model.diffusion_model.` (sdpipe.single_file.family)
    single_file_keys: tuple[str, ...]
    pipeline_class: str  # the pipeline that renders it: a diffusers class name, or "module:Class" for one elsewhere
    # from_pretrained arguments that keep rendering plain and comparable across runs: no safety checker (SD), no
    # invisible watermark (SDXL; it alters pixels, and needs an optional package).
    load_args: tuple[tuple[str, object], ...]
    # The denoiser: its pipeline subfolder and diffusers class, how training calls it on a batch's conditioning
    # (predict(model, noisy, timesteps, cond) -> the prediction), and the objective it is trained on.
    denoiser: str
    denoiser_class: str
    predict: Callable[..., torch.Tensor]
    objective: Objective
    # Text conditioning: the tokenizer/encoder pairs in pipeline order (a pipeline may lack some: SDXL's refiner has
    # only the second), the encoder states the denoiser takes (cached per caption), and how they are computed.
    text_parts: tuple[TextPart, ...]
    text_fields: tuple[str, ...]
    embed: Callable[[TextStack, list[str]], dict[str, torch.Tensor]]
    # SDXL's micro-conditioning: each sample's original size, crop corner and target size ("time_ids").
    size_conditioning: bool
    # Exports: the original single-file layout of the denoiser ("ldm_unet" or "mmdit": export/single_file.py's
    # DENOISER_MAPS; None: no single-file export) and of each text encoder ("clip" is OpenAI CLIP's transformer
    # under `clip_prefix`, "open_clip" OpenCLIP's; none: the file holds no text encoder), and kohya's LoRA key
    # prefix per component.
    single_file_denoiser: str | None
    single_file_text: tuple[str, ...]
    clip_prefix: str
    kohya_prefixes: tuple[tuple[str, str], ...]  # component -> its LoRA keys' prefix in kohya's format
    # The base model version from the UNet config and the prediction type (exports' metadata, the card).
    base: Callable[[dict, str], Base]
    bases: tuple[Base, ...]
    # check-config's memory rule of thumb: activation GB per sample-megapixel, measured (sdpipe/plan.py)
    activation_gb_per_mp: float
    # From the denoiser's config: how many latent cells each bucket side must be a multiple of (a UNet halves the
    # latent at every down block but the last; a transformer cuts it into patches), and the latent side the model
    # was made for (None: the VAE's sample_size says it).
    latent_multiple: Callable[[dict], int] = lambda config: 2 ** (len(config["down_block_types"]) - 1)
    native_latent: Callable[[dict], int | None] = lambda config: _side(config.get("sample_size"))
    # kohya's name for a denoiser module: (the original layout's module, the diffusers modules fused into it, in
    # the order their outputs are stacked), or None where the original layout has no such layer. SD's UNet keeps
    # diffusers' names in kohya files; SD 3 and Flux use the original model's, with q, k and v fused.
    kohya_layer: Callable[[str], tuple[str, tuple[str, ...]] | None] = lambda module: (module, (module,))
    # Whether diffusers' load_lora_weights reads this family's kohya files at every model size (export
    # verification reloads them that way); else sdpipe's reader splits the fused layers back first.
    diffusers_reads_kohya: bool = True
    # Whether train.text_encoder may train this family's encoders. Not yet for SD 3 and Flux: diffusers' scripts
    # train their CLIPs only, with T5's states still computed, which sdpipe's cache-or-train-all text stack lacks.
    trains_text_encoders: bool = True

    @property
    def text_encoders(self) -> tuple[str, ...]:
        return tuple(part.encoder for part in self.text_parts)

    def pipeline(self):
        """The pipeline class (a diffusers DiffusionPipeline)."""
        module, _, name = self.pipeline_class.rpartition(":")
        return getattr(importlib.import_module(module or "diffusers"), name)

    def denoiser_type(self):
        """The diffusers model class of the denoiser."""
        import diffusers

        return getattr(diffusers, self.denoiser_class)

    def kohya_prefix(self, component: str) -> str:
        return dict(self.kohya_prefixes)[component]


def fused_layers(
    module: str, blocks: dict[str, str], table: dict[str, tuple[str, ...]]
) -> tuple[str, tuple[str, ...]] | None:
    """A kohya_layer from tables: `blocks` maps a diffusers block list to the original's ("transformer_blocks" ->
    "double_blocks"); `table` maps an original module in a block to the diffusers modules fused into it."""
    block, _, rest = module.partition(".")
    index, _, inner = rest.partition(".")
    if block not in blocks or not index.isdigit():
        return None
    prefix = f"{block}.{index}."
    for original, parts in table.items():
        kind, _, name = original.partition(":")  # "double:img_attn.qkv": a module of a "double" block
        if blocks[block].startswith(kind) and inner in parts:
            return f"{blocks[block]}.{index}.{name}", tuple(prefix + p for p in parts)
    return None


def _side(size) -> int | None:
    return size[0] if isinstance(size, (list, tuple)) else size


@functools.cache
def registered() -> tuple[Family, ...]:
    """Every family module's FAMILY, most specific first. Modules are found in this package, so a new family is a
    new module."""
    found = [importlib.import_module(f"{__name__}.{m.name}").FAMILY for m in pkgutil.iter_modules(__path__)]
    return tuple(sorted(found, key=lambda f: -f.priority))


def names() -> list[str]:
    return [f.name for f in registered()]


def named(name: str) -> Family:
    """The family a cache, a preset or a trained run records by name."""
    for family in registered():
        if family.name == name:
            return family
    raise UserError(f"unknown model family {name!r}; sdpipe knows {', '.join(names())}")


def added_conditioning(cond: dict) -> dict | None:
    """The UNet's added_cond_kwargs for a batch's conditioning: the pooled text state and the size ids where the
    family has them (SDXL), else None."""
    return {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]} if "pooled" in cond else None


def unet_predict(model, noisy: torch.Tensor, timesteps: torch.Tensor, cond: dict) -> torch.Tensor:
    """A text-conditioned UNet's prediction: cross-attention to the text states, plus SDXL's added conditioning."""
    return model(
        noisy, timesteps, encoder_hidden_states=cond["hidden"], added_cond_kwargs=added_conditioning(cond)
    ).sample


def from_denoiser_config(config: dict) -> Family:
    """The family of a denoiser's config (a UNet's or a transformer's)."""
    return next(f for f in registered() if f.config_matches(config))


def from_single_file_keys(has: Callable[[str], bool]) -> Family | None:
    """The family whose original-layout key prefixes a file has (`has(prefix)`), if any."""
    return next((f for f in registered() if all(has(p) for p in f.single_file_keys)), None)


def components() -> tuple[str, ...]:
    """Every family's weighted pipeline components: denoisers, "vae" and text encoders, in a stable order."""
    found = [c for f in registered() for c in (f.denoiser, "vae", *f.text_encoders)]
    return tuple(sorted(set(found), key=found.index))


def base_named(version: str) -> Base | None:
    """The base model of kohya's version name, whichever family has it."""
    return next((b for f in registered() for b in f.bases if b.version == version), None)


# model_index.json class names of families sdpipe does not train, as users know them.
UNSUPPORTED = {
    "PixArt": "PixArt",
    "Sana": "Sana",
    "AuraFlow": "AuraFlow",
    "Lumina": "Lumina",
    "HunyuanDiT": "Hunyuan-DiT",
    "Kandinsky": "Kandinsky",
    "IF": "DeepFloyd IF",
    "Wuerstchen": "Wuerstchen",
    "StableCascade": "Stable Cascade",
}


def present(index: dict, name: str) -> bool:
    """Whether model_index.json lists component `name` (a [library, class] pair, not [null, null])."""
    entry = index.get(name)
    return isinstance(entry, list) and bool(entry) and entry[0] is not None


def detect(index: dict, where: str) -> Family:
    """The family of the pipeline whose model_index.json is `index`, or a UserError naming what it is instead."""
    cls = str(index.get("_class_name", ""))
    known = next((title for prefix, title in UNSUPPORTED.items() if cls.startswith(prefix)), None)
    family = None if known else next((f for f in registered() if f.detects(index)), None)
    if family is None:
        what = known or (f"{cls} " if cls else "") + (
            "pipeline" if present(index, "unet") else "pipeline without a UNet"
        )
        trained = " and ".join(named(n).title for n in sorted(names()))
        raise UserError(
            f"{where} is a {what} model; sdpipe trains {trained} pipelines "
            f"(model_index.json says {cls or 'no _class_name'})"
        )
    return family
