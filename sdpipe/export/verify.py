"""Export and verify: every exported format is reloaded with the loader users use and renders one fixed prompt,
compared with what the trained model itself renders.

The stage (stages/export.py) reads the config and hands these functions the sections they need; nothing here
reads a config of its own, so the stage's READS stays the whole list of what its outputs depend on.
"""

from __future__ import annotations

import gc
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.models import loading

if TYPE_CHECKING:
    from sdpipe.config import ModelConfig, VerifyConfig

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


@dataclass(frozen=True)
class Check:
    """How every export is verified: the render (export.verify, at `size`), where the images go, and the
    objective the trained model samples with."""

    verify: VerifyConfig
    size: tuple[int, int]  # (height, width)
    out: Path
    prediction_type: str | None
    device: str
    dtype: torch.dtype


def device_for(setting: str) -> tuple[str, torch.dtype]:
    """Where verification renders, in which precision: the first GPU in fp16 for "auto" when there is one, else
    the CPU in fp32."""
    if setting == "auto" and torch.cuda.is_available():
        return "cuda:0", torch.float16
    return "cpu", torch.float32


def release(*pipes) -> None:
    """Free a pipeline's GPU memory before the next one loads (SDXL pipelines are 7-14 GB each)."""
    from diffusers.utils import logging as dlog

    level = dlog.get_verbosity()
    dlog.set_verbosity_error()  # diffusers warns that an fp16 pipeline cannot run on the CPU: it will not
    for pipe in pipes:
        if pipe.device.type != "cpu":
            pipe.to("cpu")
    dlog.set_verbosity(level)
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def trained_pipeline(
    model: ModelConfig,
    prediction_type: str | None,
    source: Path,
    components: dict,
    fuse: bool,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
):
    """The base pipeline with the trained components: full ones replace the base's, LoRA ones are loaded as
    adapters (fused into the weights when `fuse`, the way an exported full model holds them)."""
    import transformers

    from sdpipe.models.pipeline import load_pipeline

    root, index = loading.model_index(model.pretrained, model.revision)
    family = loading.family_of(model.pretrained, model.revision)
    parts = {}
    for name, mode in components.items():
        if mode == "full" and name == family.denoiser:
            parts[name] = family.denoiser_type().from_pretrained(source / name, torch_dtype=dtype)
        elif mode == "full":
            parts[name] = getattr(transformers, index[name][1]).from_pretrained(source / name, torch_dtype=dtype)
    # The trained objective goes into the scheduler config, so the exported pipeline samples with it.
    pipe = load_pipeline(
        model.pretrained, model.revision, model.variant, device, dtype, prediction_type=prediction_type, **parts
    )
    if "lora" in components.values():
        load_adapter(pipe, source, fuse)
    return pipe


def load_adapter(pipe, source: Path, fuse: bool) -> None:
    """The trained adapter file into `pipe`: a LoRA as users load one (load_lora_weights); a LoHa or LoKr, which
    diffusers does not read, through peft's injection (sdpipe.export.lycoris)."""
    from sdpipe.export import lycoris
    from sdpipe.export.lora import read_lora

    state, configs = read_lora(source)
    if lycoris.kind_of(state) is None:
        pipe.load_lora_weights(str(source))
        if fuse:
            pipe.fuse_lora()
            pipe.unload_lora_weights()
        return
    lycoris.load_peft(pipe, state, configs)
    if fuse:
        lycoris.merge_and_unload(pipe)


def render(pipe, check: Check) -> np.ndarray:
    """The verification image: one prompt, one seed, CPU generator, as uint8 RGB; then the pipeline's memory is
    freed."""
    v = check.verify
    try:
        image = pipe(
            v.prompt,
            height=check.size[0],
            width=check.size[1],
            num_inference_steps=v.steps,
            guidance_scale=v.guidance,
            generator=torch.Generator(device="cpu").manual_seed(v.seed),
        ).images[0]
        return np.asarray(image.convert("RGB"))
    finally:
        release(pipe)


def check_reference(image: np.ndarray) -> None:
    """A reference of one flat colour (a NaN in half precision renders black) would match any other flat image:
    verification could not tell a broken export from a good one."""
    if int(image.max()) == int(image.min()):
        raise UserError(
            f"the trained model renders a flat image (every pixel {int(image.max())}) for "
            "export.verify.prompt, so the exports cannot be verified against it; if it renders black on "
            "a GPU, try export.verify.device: cpu (fp32) to see whether fp16 overflows"
        )


def compare(name: str, image: np.ndarray, reference: np.ndarray, check: Check, **details) -> dict:
    """How far a reloaded export's image is from the trained model's own (RGB levels, 0-255)."""
    from PIL import Image

    diff = np.abs(image.astype(np.int16) - reference.astype(np.int16))
    path = check.out / "verify" / f"{name}.png"
    with io.atomic_path(path) as tmp:
        Image.fromarray(image).save(tmp, "PNG")
    mean = float(diff.mean())
    return {
        **details,
        "max_abs_diff": int(diff.max()),
        "mean_abs_diff": round(mean, 4),
        "verified": mean <= check.verify.tolerance,
        "image": str(path),
    }


def save_diffusers(pipe, folder: Path, dtype: str) -> Path:
    """The pipeline as a diffusers folder, in `dtype` (export.dtype)."""
    if folder.exists():
        shutil.rmtree(folder)
    with io.atomic_dir(folder) as tmp:
        pipe.to(DTYPES[dtype]).save_pretrained(tmp, safe_serialization=True)
    release(pipe)
    return folder


def diffusers_folder(folder: Path, reference: np.ndarray, check: Check) -> dict:
    """The folder reloaded with from_pretrained, rendered and compared."""
    from sdpipe.models.pipeline import load_pipeline

    pipe = load_pipeline(str(folder), device=check.device, dtype=check.dtype, prediction_type=check.prediction_type)
    loader = f"{type(pipe).__name__}.from_pretrained"
    return compare("diffusers", render(pipe, check), reference, check, path=str(folder), loader=loader)


def single_file(folder: Path, path: Path, dtype: str, metadata: dict, family: str, reference, check: Check) -> dict:
    """The diffusers folder written as one original-layout file (with `metadata`), reloaded with
    from_single_file, rendered and compared."""
    from sdpipe.export.single_file import export_single_file, load_single_file

    path = export_single_file(folder, path, dtype, metadata)
    pipe = load_single_file(path, folder, family, check.dtype).to(check.device)
    if check.prediction_type:
        pipe.scheduler.register_to_config(prediction_type=check.prediction_type)
    pipe.set_progress_bar_config(disable=True)
    loader = f"{type(pipe).__name__}.from_single_file"
    return compare("single_file", render(pipe, check), reference, check, path=str(path), loader=loader)


def loras(
    model: ModelConfig, source: Path, files, metadata: dict, reference: np.ndarray, check: Check
) -> dict[str, dict]:
    """The LoRA as trained (diffusers/peft, alpha in its metadata) and in kohya format, each with `metadata` for
    other tools and each loaded into a fresh base pipeline with load_lora_weights, as the card tells users to."""
    from sdpipe.export.lora import LORA_FILE, export_kohya
    from sdpipe.export.metadata import add_metadata
    from sdpipe.models.pipeline import load_pipeline

    weight = check.out / files.lora_file
    with io.atomic_path(weight) as tmp:
        shutil.copy2(source / LORA_FILE, tmp)
    add_metadata(weight, metadata)
    kohya = export_kohya(weight, check.out / files.lora_kohya, model.pretrained, metadata)
    family = loading.family_of(model.pretrained, model.revision)
    results = {}
    for name, path in (("lora", weight), ("lora_kohya", kohya)):
        pipe = load_pipeline(
            model.pretrained,
            model.revision,
            model.variant,
            check.device,
            check.dtype,
            prediction_type=check.prediction_type,
        )
        loader, applied = _load_lora(pipe, path, name, family, model.pretrained)
        result = compare(name, render(pipe, check), reference, check, path=str(path), loader=loader)
        results[name] = {**result, "adapted_layers": applied, "verified": result["verified"] and applied > 0}
    return results


def _load_lora(pipe, path: Path, kind: str, family, base_model: str) -> tuple[str, int]:
    """Load the LoRA file `path` into `pipe` as users do: the diffusers one by folder and weight_name (the way a
    renamed diffusers LoRA loads), a kohya one by path, or through sdpipe's reader where diffusers reads none.
    Returns how it was loaded and how many layers it adapted."""
    from sdpipe.export import lycoris
    from sdpipe.export.lora import read_lora

    state, configs = read_lora(path) if kind == "lora" else ({}, {})
    if kind == "lora" and lycoris.kind_of(state):
        layers = lycoris.load_peft(pipe, state, configs)
        return "peft inject_adapter_in_model + set_peft_model_state_dict (diffusers reads no LyCORIS)", layers
    if kind == "lora":
        pipe.load_lora_weights(str(path.parent), weight_name=path.name)
        return "load_lora_weights", lycoris.adapter_layers(pipe)
    if _read_by_sdpipe(path):  # LyCORIS or DoRA, merged as ComfyUI applies them (diffusers drops dora_scale)
        return "sdpipe.export.lycoris.merge_file (ComfyUI's arithmetic)", lycoris.merge_file(pipe, path, family.name)
    if family.diffusers_reads_kohya:
        pipe.load_lora_weights(str(path))
        return "load_lora_weights", lycoris.adapter_layers(pipe)
    from safetensors.torch import load_file

    from sdpipe.export.lora import diffusers_from_kohya, out_features

    state = diffusers_from_kohya(load_file(str(path)), family.name, out_features(base_model, family.denoiser))
    pipe.load_lora_weights(state)
    return "sdpipe.export.lora.diffusers_from_kohya + load_lora_weights", lycoris.adapter_layers(pipe)


def _read_by_sdpipe(path: Path) -> bool:
    from safetensors import safe_open

    from sdpipe.export.lycoris import kind_of

    with safe_open(str(path), framework="pt") as f:
        keys = dict.fromkeys(f.keys())
    return kind_of(keys) is not None or any(k.endswith(".dora_scale") for k in keys)
