"""The model families sdpipe trains, and which one a diffusers pipeline folder is.

This is where the family seam starts: one place reads a pipeline's model_index.json and names its family, and a
pipeline sdpipe cannot train (SD 3, Flux, or any other transformer-denoised one) is refused in one line instead of
being taken for SDXL because it too has a second text encoder.
"""

from __future__ import annotations

from dataclasses import dataclass

from sdpipe.errors import UserError


@dataclass(frozen=True)
class Family:
    name: str  # the value caches, presets and configs record: "sd" or "sdxl"
    title: str  # what users call it
    pipeline_class: str  # the diffusers pipeline that renders it
    # from_pretrained arguments that keep rendering plain and comparable across runs: no safety checker (SD), no
    # invisible watermark (SDXL; it alters pixels, and needs an optional package).
    load_args: tuple[tuple[str, object], ...] = ()

    def pipeline(self):
        """The diffusers pipeline class."""
        import diffusers

        return getattr(diffusers, self.pipeline_class)


SD = Family(
    "sd", "SD 1.x/2.x", "StableDiffusionPipeline", (("safety_checker", None), ("requires_safety_checker", False))
)
SDXL = Family("sdxl", "SDXL", "StableDiffusionXLPipeline", (("add_watermarker", False),))
FAMILIES = {family.name: family for family in (SD, SDXL)}

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
