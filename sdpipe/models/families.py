"""The model families sdpipe trains, and which one a diffusers pipeline folder is.

The family seam: one object per family owns what differs between families (its pipeline class, how text is
embedded and which states condition the denoiser, the single-file and kohya names of its text encoders). Detection
reads a pipeline's model_index.json and names its family; a pipeline sdpipe cannot train (SD 3, Flux, or any other
transformer-denoised one) is refused in one line instead of being taken for SDXL because it too has a second text
encoder. A new family starts with a Family here; docs/ARCHITECTURE.md lists what is not behind the seam yet
(the component classes, the noise objective, the UNet key maps).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from sdpipe.errors import UserError

if TYPE_CHECKING:
    import torch

    from sdpipe.models.loading import TextStack


def _embed_last_layer(stack: TextStack, captions: list[str]) -> dict[str, torch.Tensor]:
    """SD 1.x/2.x: one encoder's final-layer-normed last hidden states."""
    tokenizer, encoder = stack.tokenizers[0], stack.encoders[0]
    return {"hidden": encoder(**stack.ids(tokenizer, encoder, captions))[0]}


def _embed_penultimate_and_pooled(stack: TextStack, captions: list[str]) -> dict[str, torch.Tensor]:
    """SDXL: each encoder's penultimate hidden states, concatenated, and the last encoder's projected pooled state."""
    import torch

    hidden, pooled = [], torch.empty(0)
    for tokenizer, encoder in zip(stack.tokenizers, stack.encoders):
        out = encoder(**stack.ids(tokenizer, encoder, captions), output_hidden_states=True)
        hidden.append(out.hidden_states[-2])
        pooled = out[0]  # text_embeds of CLIPTextModelWithProjection
    return {"hidden": torch.cat(hidden, dim=-1), "pooled": pooled}  # [B, 77, sum D], [B, P]


@dataclass(frozen=True)
class Family:
    """Everything sdpipe does differently per model family; code elsewhere asks the family instead of branching on
    its name."""

    name: str  # the value caches, presets and configs record: "sd" or "sdxl"
    title: str  # what users call it
    pipeline_class: str  # the diffusers pipeline that renders it
    # from_pretrained arguments that keep rendering plain and comparable across runs: no safety checker (SD), no
    # invisible watermark (SDXL; it alters pixels, and needs an optional package).
    load_args: tuple[tuple[str, object], ...]
    # Text conditioning: the encoder states the denoiser takes (cached per caption), and how they are computed.
    text_fields: tuple[str, ...]
    embed: Callable[[TextStack, list[str]], dict[str, torch.Tensor]]
    # SDXL's micro-conditioning: each sample's original size, crop corner and target size ("time_ids").
    size_conditioning: bool
    # Exports: the original single-file layout of each text encoder, in pipeline order ("clip" is OpenAI CLIP's
    # transformer under `clip_prefix`, "open_clip" OpenCLIP's), and kohya's LoRA prefix per text component.
    text_encoders: tuple[str, ...]
    single_file_text: tuple[str, ...]
    clip_prefix: str
    kohya_text_prefix: tuple[tuple[str, str], ...]
    kohya_base: str | None  # kohya's ss_base_model_version, where the family alone decides it
    # check-config's memory rule of thumb: activation GB per sample-megapixel, measured (sdpipe/plan.py)
    activation_gb_per_mp: float

    def pipeline(self):
        """The diffusers pipeline class."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)

    def kohya_prefix(self, component: str) -> str:
        return dict(self.kohya_text_prefix)[component]


SD = Family(
    "sd",
    "SD 1.x/2.x",
    "StableDiffusionPipeline",
    (("safety_checker", None), ("requires_safety_checker", False)),
    text_fields=("hidden",),
    embed=_embed_last_layer,
    size_conditioning=False,
    text_encoders=("text_encoder",),
    single_file_text=("clip",),
    clip_prefix="cond_stage_model.transformer.",
    kohya_text_prefix=(("text_encoder", "lora_te_"),),
    kohya_base=None,  # v1 or v2, from the UNet's text width (export/metadata.py)
    activation_gb_per_mp=4.3,
)
SDXL = Family(
    "sdxl",
    "SDXL",
    "StableDiffusionXLPipeline",
    (("add_watermarker", False),),
    text_fields=("hidden", "pooled"),
    embed=_embed_penultimate_and_pooled,
    size_conditioning=True,
    text_encoders=("text_encoder", "text_encoder_2"),
    single_file_text=("clip", "open_clip"),
    clip_prefix="conditioner.embedders.0.transformer.",
    kohya_text_prefix=(("text_encoder", "lora_te1_"), ("text_encoder_2", "lora_te2_")),
    kohya_base="sdxl_base_v1-0",
    activation_gb_per_mp=7.5,
)
FAMILIES = {family.name: family for family in (SD, SDXL)}


def added_conditioning(cond: dict) -> dict | None:
    """The UNet's added_cond_kwargs for a batch's conditioning: the pooled text state and the size ids where the
    family has them (SDXL), else None."""
    return {"text_embeds": cond["pooled"], "time_ids": cond["time_ids"]} if "pooled" in cond else None


def named(name: str) -> Family:
    """The family a cache, a preset or a trained run records by name."""
    return FAMILIES[name]


def from_unet_config(unet: dict) -> Family:
    """The family of a UNet config: SDXL's UNet adds text and time embeddings ("text_time")."""
    return SDXL if unet.get("addition_embed_type") == "text_time" else SD


# model_index.json class names of families sdpipe does not train, as users know them.
UNSUPPORTED = {
    "StableDiffusion3": "Stable Diffusion 3 / 3.5",
    "Flux": "Flux",
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
    if known or present(index, "transformer") or not present(index, "unet"):
        what = known or (f"{cls} " if cls else "") + "pipeline without a UNet"
        raise UserError(
            f"{where} is a {what} model; sdpipe trains {SD.title} and {SDXL.title} UNet pipelines "
            f"(model_index.json says {cls or 'no _class_name'})"
        )
    return SDXL if "XL" in cls or present(index, "text_encoder_2") else SD
