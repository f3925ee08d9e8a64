"""What other tools read from an exported .safetensors: the SAI model spec (`modelspec.*`) and kohya's `ss_*` keys.

A1111, Forge, ComfyUI and Civitai class a file by them (A1111 lists an SDXL LoRA without them as SD 1 and hides it
from an SDXL checkpoint's LoRA tab) and show how it was trained. Values are strings, as safetensors requires. No
date or time is written: the same training gives the same file.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from sdpipe import io

if TYPE_CHECKING:
    from sdpipe.config import Config
    from sdpipe.models.families import Base


def base(model: Path, family: str, prediction: str = "epsilon") -> Base:
    """The base model the family reads from the exported denoiser's config (SD: 1.x, or 2.x when the UNet attends
    to 1024-wide OpenCLIP-H text states)."""
    from sdpipe.models import families

    fam = families.named(family)
    return fam.base(io.read_json(Path(model) / fam.denoiser / "config.json"), prediction)


def base_version(model: Path, family: str) -> str:
    """kohya's name for the base (ss_base_model_version)."""
    return base(model, family).version


def file_metadata(cfg: Config, info: dict, model: Path, adapter: dict | None = None) -> dict[str, str]:
    """Metadata for an exported single file, or for a LoRA when `adapter` is its UNet's peft adapter config (rank and
    alpha as trained); `info` is the trained run's final.json, `model` the exported diffusers folder."""
    lora = adapter is not None
    prediction = info.get("prediction_type") or cfg.train.prediction_type or "epsilon"
    spec = base(model, info["family"], prediction)
    version, arch, implementation = spec.version, spec.architecture, spec.implementation
    res = cfg.prepare.buckets.resolution
    name = cfg.export.name
    meta = {
        "modelspec.sai_model_spec": "1.0.0",
        "modelspec.architecture": arch + ("/lora" if lora else ""),
        "modelspec.implementation": implementation,
        "modelspec.title": name
        or f"{Path(cfg.model.pretrained).name} {'LoRA' if lora else cfg.train.mode + ' fine-tune'}",
        "modelspec.resolution": f"{res}x{res}",
        "modelspec.prediction_type": prediction,
        "ss_base_model_version": version,
        "ss_v2": str(version == "sd_v2"),
        "ss_sd_model_name": str(cfg.model.pretrained),
        "ss_resolution": f"({res}, {res})",
        "ss_learning_rate": str(cfg.train.learning_rate),
        "ss_max_train_steps": str(info.get("optimizer_steps")),
        "ss_mixed_precision": str(cfg.train.mixed_precision),
        "ss_seed": str(cfg.seed),
        "ss_training_comment": "trained with sdpipe",
        "ss_output_name": name or _default_stem(lora),  # kohya's: the name the file was saved under
    }
    if lora:
        from sdpipe.export.lycoris import NETWORK_ARGS

        rank = adapter.get("r", cfg.train.lora.rank)
        kind = str(adapter.get("peft_type", "LORA")).lower()
        meta |= {
            # LyCORIS' own marks, which kohya's and A1111's readers key on
            "ss_network_module": "lycoris.kohya" if kind in NETWORK_ARGS else "networks.lora",
            "ss_network_dim": str(rank),
            "ss_network_alpha": str(adapter.get("lora_alpha", adapter.get("alpha", rank))),
        }
        if kind in NETWORK_ARGS:
            meta["ss_network_args"] = NETWORK_ARGS[kind]
    return meta


def _default_stem(lora: bool) -> str:
    from sdpipe.export.names import export_files

    files = export_files(None, single_file=True, lora=lora)
    return Path(files.lora_kohya if lora else files.single_file).stem


def add_metadata(path: Path, metadata: dict[str, str]) -> None:
    """Rewrite a .safetensors with `metadata` added to what it carries (atomically)."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    with safe_open(str(path), framework="pt") as f:
        state, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    with io.atomic_path(path) as tmp:
        save_file(state, str(tmp), metadata={**meta, **metadata})
