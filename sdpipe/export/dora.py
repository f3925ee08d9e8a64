"""DoRA (train.lora.dora): peft's per-output magnitude m, written as the `dora_scale` ComfyUI and Forge read.

peft's DoRA layer is W' = m * (W + dW) / ||W + dW||, the norm taken per output row. ComfyUI reads a `dora_scale` of
shape (out, 1) as that output-axis decomposition, but divides by the base weight's row norm ||W|| instead of
||W + dW|| (comfy/weight_adapter/base.py, weight_decompose). LyCORIS' own reader divides by ||W + dW||. The file
is written for ComfyUI: dora_scale = m * ||W|| / ||W + dW||, which needs the base weights at export time. The
result: ComfyUI and Forge render the trained model exactly; A1111 reads DoRA only along the input axis and renders
something else (docs/jobs.md says to use the diffusers file there).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from sdpipe.errors import UserError

MAGNITUDE = ".lora_magnitude_vector"


def magnitudes(state: dict) -> dict[tuple[str, str], torch.Tensor]:
    """(component, module) -> peft's DoRA magnitude (out,) in a diffusers/peft LoRA state dict."""
    out = {}
    for key, value in state.items():
        if key.endswith(MAGNITUDE):
            component, _, module = key[: -len(MAGNITUDE)].partition(".")
            out[component, module] = value
    return out


def comfyui_scale(magnitude: torch.Tensor, weight: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The (out, 1) dora_scale with which ComfyUI's reading gives peft's layer (see the module's docstring)."""
    w = weight.float().flatten(1)
    return (magnitude.float() * w.norm(dim=1) / (w + delta.float().flatten(1)).norm(dim=1)).unsqueeze(1)


def comfyui_apply(weight: torch.Tensor, delta: torch.Tensor, dora_scale: torch.Tensor) -> torch.Tensor:
    """The weight ComfyUI makes from a base weight, a LoRA update and a dora_scale (its weight_decompose at
    strength 1): by the base's norm on the output axis, by the updated weight's on the input axis."""
    w = weight.float()
    calc = w + delta.float().reshape(w.shape)
    if dora_scale.shape[0] == w.shape[0]:
        norm = w.reshape(w.shape[0], -1).norm(dim=1, keepdim=True).reshape(w.shape[0], *[1] * (w.dim() - 1))
    else:
        flat = calc.transpose(0, 1).reshape(calc.shape[1], -1).norm(dim=1, keepdim=True)
        norm = flat.reshape(calc.shape[1], *[1] * (calc.dim() - 1)).transpose(0, 1)
    return calc * (dora_scale.float().reshape(norm.shape[0], *norm.shape[1:]) / (norm + torch.finfo(w.dtype).eps))


def base_weights(base_model: str | Path, layers: list[tuple[str, str]]) -> dict[tuple[str, str], torch.Tensor]:
    """The base model's weights of these (component, module) layers, read from its safetensors files alone."""
    from safetensors import safe_open

    from sdpipe.models import loading

    root, _ = loading.model_index(str(base_model))
    found: dict[tuple[str, str], torch.Tensor] = {}
    for component in sorted({c for c, _ in layers}):
        wanted = {m for c, m in layers if c == component}
        for file in _weight_files(root / component):
            with safe_open(str(file), framework="pt") as f:
                keys = set(f.keys())
                for module in wanted:
                    # transformers' flattened CLIPTextModel has no text_model. level; older files do
                    for key in (f"{module}.weight", f"text_model.{module}.weight"):
                        if key in keys:
                            found[component, module] = f.get_tensor(key)
    missing = sorted(set(layers) - found.keys())
    if missing:
        raise UserError(f"base model {base_model} has no weight for DoRA layer {missing[0][0]}.{missing[0][1]}")
    return found


def _weight_files(folder: Path) -> list[Path]:
    index = sorted(folder.glob("*.safetensors.index.json"), key=lambda f: len(f.suffixes))
    if index:  # the plain (fp32) index before a variant's (diffusion_pytorch_model.fp16.safetensors.index.json)
        return sorted({folder / f for f in json.loads(index[0].read_text())["weight_map"].values()})
    files = sorted(folder.glob("*.safetensors"))
    return [f for f in files if len(f.suffixes) == 1] or files
