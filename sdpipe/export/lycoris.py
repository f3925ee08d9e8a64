"""LyCORIS adapters (train.lora.type loha and lokr): peft trains them, and diffusers reads neither its own peft files
of them nor the LyCORIS files other tools share, so sdpipe reads and writes both.

- The peft file training saves: keys `<component>.<module>.hada_w1_a` (LoHa) or `.lokr_w1`, `.lokr_w2_a`, ... (LoKr),
  with the peft config in the file's metadata, as for LoRA. `load_peft` injects it back into a pipeline with peft.
- The LyCORIS file that A1111, Forge, ComfyUI and kohya's tools load: the same tensors under kohya's layer names
  (`lora_unet_<module, dots as underscores>.hada_w1_a`, ...) plus `.alpha`. `lycoris_state_dict` writes it.
- `delta` is a layer's weight update as ComfyUI computes it from such a file. Verification merges the file into a
  fresh base model with it and renders, so an export is checked against how other tools read it, not against
  peft.

peft and LyCORIS share the tensor names and the update's formulas (LoHa: (w1_a w1_b) * (w2_a w2_b); LoKr: w1 (x) w2,
each factor whole or a low-rank product), and the scale: peft's is alpha / rank. ComfyUI takes alpha / rank only
where the file holds a low-rank product and 1 otherwise; a LoKr layer whose factors peft keeps whole gets its scale
folded into w1 and no alpha.
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from sdpipe.errors import UserError

log = logging.getLogger(__name__)

TENSORS = {
    "loha": ("hada_w1_a", "hada_w1_b", "hada_w2_a", "hada_w2_b"),
    "lokr": ("lokr_w1", "lokr_w1_a", "lokr_w1_b", "lokr_w2", "lokr_w2_a", "lokr_w2_b"),
}
KINDS = {name: kind for kind, names in TENSORS.items() for name in names}
NETWORK_ARGS = {"loha": '{"algo": "loha"}', "lokr": '{"algo": "lokr"}'}  # kohya/LyCORIS metadata: ss_network_args


def kind_of(state: dict) -> str | None:
    """loha or lokr by the tensors' names; None for a LoRA."""
    kinds = {KINDS.get(key.rpartition(".")[2]) for key in state}
    found = sorted(k for k in kinds if k)
    if len(found) > 1:
        raise UserError(f"the adapter file mixes {' and '.join(found)} tensors; sdpipe writes one kind per file")
    return found[0] if found else None


def layers(state: dict) -> dict[tuple[str, str], dict[str, torch.Tensor]]:
    """(component, module) -> {tensor name: tensor} of a peft LyCORIS state dict."""
    out: dict[tuple[str, str], dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        path, _, name = key.rpartition(".")
        component, _, module = path.partition(".")
        out.setdefault((component, module), {})[name] = value
    return out


def _factor(tensors: dict, name: str) -> tuple[torch.Tensor, int | None]:
    """A LoKr factor (w1 or w2), whole or as its low-rank product, and that product's rank (None when whole)."""
    whole = tensors.get(f"lokr_{name}")
    if whole is not None:
        return whole.float(), None
    a, b = tensors[f"lokr_{name}_a"].float(), tensors[f"lokr_{name}_b"].float()
    return a @ b, b.shape[0]


def delta(tensors: dict[str, torch.Tensor], alpha: float | None) -> torch.Tensor:
    """The layer's weight update from a LyCORIS file's tensors (without the `lora_..._` prefix), as ComfyUI
    computes it; 2-D (out, in), to be reshaped to the weight."""
    if "lora_down.weight" in tensors:  # a LoRA (a DoRA's dora_scale is applied after: merge_file)
        down, up = tensors["lora_down.weight"].float(), tensors["lora_up.weight"].float()
        return up.flatten(1) @ down.flatten(1) * (alpha / down.shape[0] if alpha is not None else 1.0)
    if "hada_w1_a" in tensors:
        w1a, w1b, w2a, w2b = (tensors[n].float() for n in TENSORS["loha"])
        scale = alpha / w1b.shape[0] if alpha is not None else 1.0
        return (w1a @ w1b) * (w2a @ w2b) * scale
    w1, rank1 = _factor(tensors, "w1")
    w2, rank2 = _factor(tensors, "w2")
    rank = rank2 if rank2 is not None else rank1
    scale = alpha / rank if alpha is not None and rank is not None else 1.0
    return torch.kron(w1, w2.flatten(1)) * scale


def out_in(tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    """(out, in) features of the layer a peft LyCORIS adapter adapts (a conv's `in` counts its kernel too)."""
    return tuple(delta(tensors, None).shape)  # type: ignore[return-value]


def lycoris_state_dict(state: dict, configs: dict[str, dict], family: str) -> dict[str, torch.Tensor]:
    """The LyCORIS file's tensors for a peft LoHa/LoKr state dict, named as kohya names the layers."""
    from sdpipe.export.lora import _kohya_layer, kohya_name
    from sdpipe.models import families

    fam, out = families.named(family), {}
    for (component, module), tensors in layers(state).items():
        original, parts = _kohya_layer(fam, component, module)
        if len(parts) > 1:
            raise UserError(
                f"{fam.title}'s kohya format fuses {', '.join(parts)} into {original}; a LyCORIS adapter of fused "
                "layers cannot be written there: train.lora.type lora exports them"
            )
        name = kohya_name(component, original, family)
        alpha = _alpha(configs.get(component, {}), module)
        tensors = {k: v.contiguous() for k, v in tensors.items()}
        low_rank = any(k.endswith(("_a", "_b")) for k in tensors if k.startswith("lokr_")) or "hada_w1_a" in tensors
        if not low_rank:  # a LoKr of two whole factors: ComfyUI applies no alpha there, so the scale goes into w1
            tensors["lokr_w1"] = tensors["lokr_w1"] * (alpha / _rank(configs.get(component, {}), module))
        else:
            out[f"{name}.alpha"] = torch.tensor(float(alpha))
        out.update({f"{name}.{k}": v for k, v in tensors.items()})
    return out


def _rank(config: dict, module: str) -> int:
    from sdpipe.export.lora import pattern_value

    return int(pattern_value(config, "rank_pattern", module, config.get("r", 8)))


def _alpha(config: dict, module: str) -> float:
    from sdpipe.export.lora import pattern_value

    return float(pattern_value(config, "alpha_pattern", module, config.get("alpha", _rank(config, module))))


def load_peft(pipe, state: dict, configs: dict[str, dict]) -> int:
    """Inject a peft LyCORIS state dict (what training saved) into the pipeline's components, as adapters; returns
    how many layers carry one."""
    from peft import inject_adapter_in_model, set_peft_model_state_dict
    from peft.mapping import PEFT_TYPE_TO_CONFIG_MAPPING

    by_component: dict[str, dict] = {}
    for key, value in state.items():
        component, _, rest = key.partition(".")
        by_component.setdefault(component, {})[rest] = value
    for component, part in by_component.items():
        config = dict(configs.get(component) or {})
        kind = kind_of(part)
        if not config:
            raise UserError(f"the {kind} adapter file has no peft config for {component} in its metadata")
        cls = PEFT_TYPE_TO_CONFIG_MAPPING[config.get("peft_type", kind.upper())]
        fields = {k: v for k, v in config.items() if k in cls.__dataclass_fields__ and k != "peft_type"}
        model = getattr(pipe, component)
        inject_adapter_in_model(cls(**fields), model, adapter_name="default")
        set_peft_model_state_dict(model, part, adapter_name="default")
    return adapter_layers(pipe)


def adapter_layers(pipe) -> int:
    from peft.tuners.tuners_utils import BaseTunerLayer

    models = [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]
    return sum(isinstance(layer, BaseTunerLayer) for m in models for layer in m.modules())


def merge_and_unload(pipe) -> None:
    """Merge every injected adapter into its base layer's weight and put the base layer back in its place."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    for model in [m for m in pipe.components.values() if isinstance(m, torch.nn.Module)]:
        for name, module in list(model.named_modules()):
            if isinstance(module, BaseTunerLayer):
                module.merge()
                parent, _, attr = name.rpartition(".")
                setattr(model.get_submodule(parent) if parent else model, attr, module.get_base_layer())


def merge_file(pipe, path: Path, family: str) -> int:
    """Merge a LyCORIS or DoRA file into the pipeline's weights the way ComfyUI applies it (W += delta reshaped to
    W; for DoRA, its weight decomposition); returns how many layers it changed. A layer the file names but the
    pipeline lacks is an error, not a skip."""
    from safetensors.torch import load_file

    from sdpipe.export.dora import comfyui_apply
    from sdpipe.export.lora import kohya_name
    from sdpipe.models import families

    fam, state = families.named(family), load_file(str(path))
    targets = {}
    for component, _ in fam.kohya_prefixes:
        model = getattr(pipe, component, None)
        for module, layer in model.named_modules() if model is not None else []:
            if isinstance(layer, (torch.nn.Linear, torch.nn.Conv2d)):
                found = fam.kohya_layer(module) if component == fam.denoiser else (module, (module,))
                if found and len(found[1]) == 1:
                    targets[kohya_name(component, found[0], family)] = layer
    grouped: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in state.items():
        name, _, tensor = key.partition(".")
        grouped.setdefault(name, {})[tensor] = value
    for name, tensors in grouped.items():
        if name not in targets:
            raise UserError(f"{path}: layer {name} matches no layer of the {fam.title} pipeline")
        alpha, scale = tensors.pop("alpha", None), tensors.pop("dora_scale", None)
        weight = targets[name].weight
        update = delta(tensors, None if alpha is None else float(alpha)).reshape(weight.shape)
        with torch.no_grad():
            weight.copy_(weight + update.to(weight) if scale is None else comfyui_apply(weight, update, scale))
    return len(grouped)
