"""A diffusers/peft LoRA (what training saves) -> kohya format, the LoRA file A1111, ComfyUI and most tools load.

A kohya file names each adapted layer `<prefix><module path, dots as underscores>` (prefix lora_unet_; lora_te_ for
SD's text encoder, lora_te1_/lora_te2_ for SDXL's) and stores `.lora_down.weight` (peft's lora_A), `.lora_up.weight`
(lora_B) and `.alpha`; the layer's update is up @ down * alpha / rank, as in peft.

diffusers' convert_state_dict_to_kohya is not used: it writes alpha = rank (which rescales any LoRA trained with
lora_alpha != rank), lora_te1_ for SD 1.x, and text-encoder names without `text_model.` for transformers' flattened
CLIPTextModel. The alphas here come from the adapter configs diffusers stores in the file's metadata.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import torch

from sdpipe import io
from sdpipe.errors import UserError
from sdpipe.export.single_file import meta_model
from sdpipe.models import families, loading

log = logging.getLogger(__name__)

LORA_FILE = "pytorch_lora_weights.safetensors"  # diffusers' save_lora_weights name
_DOWN, _UP = ".lora_A.weight", ".lora_B.weight"


def read_lora(lora: str | Path) -> tuple[dict[str, torch.Tensor], dict[str, dict]]:
    """The LoRA's tensors (keys `<component>.<module>.lora_A/B.weight`) and each component's peft adapter config
    from the metadata (a component is missing there when diffusers saved no metadata for it)."""
    from safetensors import SafetensorError, safe_open

    path = Path(lora) / LORA_FILE if Path(lora).is_dir() else Path(lora)
    try:
        with safe_open(str(path), framework="pt") as f:
            state, meta = {k: f.get_tensor(k) for k in f.keys()}, f.metadata() or {}
    except (OSError, SafetensorError) as exc:
        raise UserError(f"cannot read a diffusers LoRA ({LORA_FILE}) at {lora}: {exc}") from None
    if not state:
        raise UserError(f"{path} holds no tensors: not a LoRA")
    odd = [k for k in state if not (k.split(".")[0] in families.components() and _adapter_tensor(k))]
    if odd:
        raise UserError(
            f"{path} is not a diffusers/peft adapter of UNet/text encoders (unexpected tensor {odd[0]}); "
            "LoRA biases are not exported"
        )
    configs: dict[str, dict] = {}
    for key, value in json.loads(meta.get("lora_adapter_metadata", "{}")).items():
        component, _, field = key.partition(".")
        configs.setdefault(component, {})[field] = value
    return state, configs


def _adapter_tensor(key: str) -> bool:
    from sdpipe.export.dora import MAGNITUDE
    from sdpipe.export.lycoris import KINDS

    return key.endswith((_DOWN, _UP, MAGNITUDE)) or key.rpartition(".")[2] in KINDS


def adapted_shapes(state: dict) -> dict[tuple[str, str], tuple[int, int]]:
    """(component, module) -> the (out, in) features of the layer each adapter (LoRA, LoHa or LoKr) adapts."""
    from sdpipe.export import lycoris

    if lycoris.kind_of(state):
        return {layer: lycoris.out_in(tensors) for layer, tensors in lycoris.layers(state).items()}
    return {layer: (up.shape[0], down.shape[1]) for layer, (down, up) in lora_modules(state).items()}


def lora_modules(state: dict) -> dict[tuple[str, str], tuple[torch.Tensor, torch.Tensor]]:
    """(component, module name) -> (down, up) weights."""
    out = {}
    for key, down in state.items():
        if key.endswith(_DOWN):
            component, _, module = key[: -len(_DOWN)].partition(".")
            out[component, module] = (down, state[key[: -len(_DOWN)] + _UP])
    return out


def pattern_value(config: dict, field: str, module: str, default):
    """A peft config's per-module value (alpha_pattern, rank_pattern) for `module`, else `default`."""
    from peft.utils.other import get_pattern_key

    pattern = config.get(field) or {}
    return pattern.get(get_pattern_key(pattern.keys(), module), default) if pattern else default


def _alpha(config: dict, module: str, rank: int) -> float:
    """kohya's alpha: the value for which alpha / rank equals peft's scaling of this module."""
    # No config: diffusers loads such a LoRA with alpha = rank, so the export keeps that meaning.
    alpha = pattern_value(config, "alpha_pattern", module, config.get("lora_alpha", rank))
    return alpha * math.sqrt(rank) if config.get("use_rslora") else alpha  # rsLoRA scales by alpha / sqrt(rank)


def _text_model(module: str) -> str:
    # transformers >= 5.6 flattens CLIPTextModel (no text_model. level); kohya, A1111 and ComfyUI names keep it.
    return module if module.startswith("text_model.") else f"text_model.{module}"


def kohya_name(component: str, module: str, family: str) -> str:
    fam = families.named(family)
    name = module if component == fam.denoiser else _text_model(module)
    return fam.kohya_prefix(component) + name.replace(".", "_")


def _kohya_layer(family: families.Family, component: str, module: str) -> tuple[str, tuple[str, ...]]:
    if component != family.denoiser:
        return module, (module,)
    found = family.kohya_layer(module)
    if found is None:
        raise UserError(
            f"the LoRA adapts {component} layer {module}, which has no name in kohya's {family.title} format; "
            "train.lora.target_modules lists the layers kohya's format has (see the family's templates)"
        )
    return found


def kohya_state_dict(
    state: dict, configs: dict[str, dict], family: str, out_features: dict | None = None, base: dict | None = None
) -> dict[str, torch.Tensor]:
    """The kohya tensors of a diffusers LoRA. Where the original layout fuses layers (SD 3's and Flux's q, k and
    v), their adapters become one: the downs stacked, the ups block-diagonal with each one's scale folded in (alpha
    = rank), and zeros for a fused part the LoRA does not adapt (its output size from `out_features`). A DoRA
    layer also gets its dora_scale, from the base weight in `base` (sdpipe.export.dora)."""
    from sdpipe.export import dora

    fam, modules, mags = families.named(family), lora_modules(state), dora.magnitudes(state)
    unconfigured = sorted({c for c, _ in modules} - configs.keys())
    if unconfigured:
        log.warning(
            "no adapter metadata for %s in the LoRA: exporting alpha = rank (scale 1), as diffusers loads it",
            ", ".join(unconfigured),
        )
    groups: dict[tuple[str, str], tuple[str, ...]] = {}
    for component, module in modules:
        original, parts = _kohya_layer(fam, component, module)
        groups[component, original] = parts
    kohya = {}
    for (component, original), parts in groups.items():
        name = kohya_name(component, original, family)
        if len(parts) == 1:
            down, up = modules[component, parts[0]]
            alpha = _alpha(configs.get(component, {}), parts[0], down.shape[0])
            if (component, parts[0]) in mags:
                update = up.float().flatten(1) @ down.float().flatten(1) * (alpha / down.shape[0])
                magnitude, weight = mags[component, parts[0]], (base or {})[component, parts[0]]
                kohya[f"{name}.dora_scale"] = dora.comfyui_scale(magnitude, weight, update).to(up.dtype)
        elif any((component, p) in mags for p in parts):
            raise UserError(
                f"{fam.title}'s kohya format fuses {', '.join(parts)} into {original}; a DoRA of fused layers "
                "cannot be written there: train.lora.dora false exports them"
            )
        else:
            down, up = _fused(component, parts, modules, configs, out_features or {})
            alpha = down.shape[0]
        kohya[f"{name}.lora_down.weight"], kohya[f"{name}.lora_up.weight"] = down.contiguous(), up.contiguous()
        kohya[f"{name}.alpha"] = torch.tensor(float(alpha))
    return kohya


def _fused(component: str, parts: tuple[str, ...], modules: dict, configs: dict, out_features: dict):
    adapted = [(p, modules.get((component, p))) for p in parts]
    downs = [pair[0] for _, pair in adapted if pair is not None]
    rank = sum(d.shape[0] for d in downs)
    sizes = [pair[1].shape[0] if pair is not None else out_features[component, p] for p, pair in adapted]
    up = torch.zeros(sum(sizes), rank, dtype=downs[0].dtype)
    row = col = 0
    for (part, pair), size in zip(adapted, sizes):
        if pair is not None:
            down, part_up = pair
            r = down.shape[0]
            scale = _alpha(configs.get(component, {}), part, r) / r
            up[row : row + size, col : col + r] = part_up * scale
            col += r
        row += size
    return torch.cat(downs), up


def diffusers_from_kohya(kohya: dict, family: str, out_features: dict) -> dict[str, torch.Tensor]:
    """kohya_state_dict's inverse for a family whose fused kohya layers diffusers cannot read back (SD 3's, or
    Flux's at other than the published sizes): each fused layer split into its parts, every part given the whole
    down and its rows of the up, the scale folded into the up. Keys as diffusers' LoRA files have them."""
    fam = families.named(family)
    prefix = fam.kohya_prefix(fam.denoiser)
    layers: dict[str, tuple[str, ...]] = {}
    for (component, module), _ in out_features.items():
        found = fam.kohya_layer(module) if component == fam.denoiser else None
        if found:
            layers[kohya_name(component, found[0], family)] = found[1]
    out = {}
    for key in kohya:
        if not key.endswith(".lora_down.weight"):
            continue
        name = key[: -len(".lora_down.weight")]
        if not name.startswith(prefix) or name not in layers:
            raise UserError(f"kohya LoRA layer {name} has no {fam.title} {fam.denoiser} layer of that name")
        down, up = kohya[key], kohya[f"{name}.lora_up.weight"]
        scale = float(kohya.get(f"{name}.alpha", torch.tensor(down.shape[0]))) / down.shape[0]
        sizes = [out_features[fam.denoiser, part] for part in layers[name]]
        for part, rows in zip(layers[name], torch.split(up, sizes)):
            out[f"{fam.denoiser}.{part}.lora_A.weight"] = down
            out[f"{fam.denoiser}.{part}.lora_B.weight"] = rows * scale
    return out


def out_features(base_model: str | Path, component: str) -> dict[tuple[str, str], int]:
    """(component, module) -> output features of every linear layer of a base-model component."""
    root, _ = loading.model_index(str(base_model))
    family = loading.pipeline_family(str(base_model))
    return {
        (component, name): m.weight.shape[0]
        for name, m in meta_model(root, component, family).named_modules()
        if isinstance(m, torch.nn.Linear)
    }


def _check_state(state: dict, base_model: str | Path, lora: str | Path) -> None:
    """Every adapted layer must exist in the base model with the (out, in) shape the LoRA was trained on."""
    root, _ = loading.model_index(str(base_model))
    family = loading.pipeline_family(str(base_model))
    modules, fail = adapted_shapes(state), f"LoRA {lora} does not match base model {base_model}"
    layers = {}
    for component in sorted({c for c, _ in modules}):
        if not (root / component).is_dir():
            raise UserError(f"{fail}: it adapts {component}, which the base model does not have")
        layers.update(
            {
                (component, n.removeprefix("text_model.")): m
                for n, m in meta_model(root, component, family).named_modules()
            }
        )
    for (component, module), got in modules.items():
        layer = layers.get((component, module.removeprefix("text_model.")))
        if not isinstance(getattr(layer, "weight", None), torch.Tensor):
            raise UserError(f"{fail}: its {component} has no layer {module}")
        want = tuple(layer.weight.shape[:2])  # (out, in) features/channels
        if got not in (want, (want[0], layer.weight[0].numel())):  # a LyCORIS conv factor counts the kernel too
            raise UserError(
                f"{fail}: {component} layer {module} maps {want[1]}->{want[0]} features in the base "
                f"model but {got[1]}->{got[0]} in the LoRA"
            )


def check_lora_matches(lora: str | Path, base_model: str | Path) -> None:
    """Raise UserError unless every layer the LoRA adapts exists in the base model with the same shape."""
    _check_state(read_lora(lora)[0], base_model, lora)


def export_kohya(lora: str | Path, out: str | Path, base_model: str | Path, metadata: dict | None = None) -> Path:
    """Write the diffusers LoRA `lora` (folder or file) as a kohya .safetensors, after checking it fits `base_model`
    (whose family also picks the text-encoder prefixes); `metadata` goes into its header (sdpipe.export.metadata)."""
    from safetensors.torch import save_file

    from sdpipe.export.lycoris import kind_of, lycoris_state_dict

    state, configs = read_lora(lora)
    _check_state(state, base_model, lora)
    family = loading.family_of(str(base_model))
    if kind_of(state):
        kohya = lycoris_state_dict(state, configs, family.name)
    else:
        from sdpipe.export.dora import base_weights, magnitudes

        base = base_weights(base_model, list(magnitudes(state))) if magnitudes(state) else None
        kohya = kohya_state_dict(state, configs, family.name, out_features(base_model, family.denoiser), base)
    with io.atomic_path(out) as tmp:
        save_file(kohya, str(tmp), metadata={"format": "pt", **(metadata or {})})
    return Path(out)


def fused_pipeline(base_model: str | Path, lora: str | Path):
    """The base pipeline with `lora` (diffusers folder/file or kohya file) merged into its weights, loaded the way
    users load LoRAs (load_lora_weights + fuse_lora): what an exported LoRA must reproduce."""
    from diffusers import DiffusionPipeline

    root, _ = loading.model_index(str(base_model))
    pipe = DiffusionPipeline.from_pretrained(root, torch_dtype=torch.float32)
    pipe.load_lora_weights(str(lora))
    pipe.fuse_lora()  # every LoRA-loadable component of the pipeline (UNet and text encoders)
    pipe.unload_lora_weights()  # keeps the fused weights, drops the adapter layers
    return pipe
