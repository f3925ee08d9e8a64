"""What the exported files are called, from export.name: the one place every reader of them asks.

The export stage writes these names, the card and the plan print them, the workflow declares them as the export
rule's outputs. With export.name null the names are the historical ones (model.safetensors,
lora/pytorch_lora_weights.safetensors, lora_kohya.safetensors). A name replaces `model` and `pytorch_lora_weights`
and prefixes the kohya file, so that A1111/ComfyUI list `<name>_lora_kohya` and the diffusers folder still loads
with `load_lora_weights(folder, weight_name=...)`.

Light on purpose (no torch): the Snakefile and `sdpipe check-config` import it. The schema validates the name
(export.name: letters, digits, -, _ and ., not first).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from sdpipe.config import Config

DIFFUSERS_LORA = "pytorch_lora_weights.safetensors"  # diffusers' save_lora_weights / load_lora_weights default


@dataclass(frozen=True)
class ExportFiles:
    """Paths relative to the export folder; None where this run writes no such file."""

    diffusers: str  # the pipeline folder
    single_file: str | None
    lora_dir: str | None  # the diffusers/peft LoRA folder
    lora_weight: str | None  # its file name: the weight_name load_lora_weights needs when it is not the default
    lora_kohya: str | None
    summary: str = "summary.json"

    @property
    def lora_file(self) -> str | None:
        return f"{self.lora_dir}/{self.lora_weight}" if self.lora_dir else None

    def files(self) -> dict[str, str]:
        """Format name (as in the export summary) -> path, for the formats this run writes."""
        found = {
            "diffusers": self.diffusers,
            "single_file": self.single_file,
            "lora": self.lora_file,
            "lora_kohya": self.lora_kohya,
        }
        return {k: v for k, v in found.items() if v}


def export_files(name: str | None, single_file: bool, lora: bool) -> ExportFiles:
    """The files an export writes: `name` is export.name, `lora` whether the run trains a LoRA (UNet or text
    encoder)."""
    return ExportFiles(
        diffusers="diffusers",
        single_file=f"{name or 'model'}.safetensors" if single_file else None,
        lora_dir="lora" if lora else None,
        lora_weight=(f"{name}_lora.safetensors" if name else DIFFUSERS_LORA) if lora else None,
        lora_kohya=f"{name + '_' if name else ''}lora_kohya.safetensors" if lora else None,
    )


def trains_lora(cfg: Config) -> bool:
    t = cfg.train
    return t.mode == "lora" or t.text_encoder.mode == "lora"


def for_config(cfg: Config) -> ExportFiles:
    """The files this config's export writes."""
    return export_files(cfg.export.name, cfg.export.single_file, trains_lora(cfg))
