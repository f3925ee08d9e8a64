"""A diffusers pipeline folder -> one .safetensors in the original Stable Diffusion key layout.

A1111, ComfyUI and diffusers' own `from_single_file` read SD 1.x checkpoints in CompVis/ldm naming and SDXL ones in
Stability's SGM naming (same UNet/VAE names, text encoders under `conditioner.embedders.N`). The names are derived
from the UNet/VAE configs (levels, layers_per_block), so every size of these architectures converts, the tiny test
presets included. SDXL's second text encoder is written in OpenCLIP layout (fused qkv, projection stored transposed),
as in Stability's own checkpoints.

SD 3 / 3.5 files hold the MMDiT (sdpipe.export.mmdit) and the VAE, as Stability ships sd3.5_medium.safetensors: the
text encoders, which sdpipe does not train for this family, are separate files (ComfyUI's clip_l, clip_g and t5xxl)
that users already have. Such a file is loaded with the text encoders of a diffusers folder passed alongside it.
"""

from __future__ import annotations

import shutil
import tempfile
from pathlib import Path

import torch

from sdpipe import io, weights
from sdpipe import single_file as base_files
from sdpipe.errors import UserError
from sdpipe.export.mmdit import mmdit_state
from sdpipe.models import families, loading

DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
UNET_PREFIX, VAE_PREFIX = "model.diffusion_model.", "first_stage_model."
OPEN_CLIP_PREFIX = "conditioner.embedders.1.model."

# Sub-module renames inside one block (diffusers name -> original name).
_UNET_RESNET = {
    "norm1": "in_layers.0",
    "conv1": "in_layers.2",
    "time_emb_proj": "emb_layers.1",
    "norm2": "out_layers.0",
    "conv2": "out_layers.3",
    "conv_shortcut": "skip_connection",
}
_VAE_RESNET = {"norm1": "norm1", "conv1": "conv1", "norm2": "norm2", "conv2": "conv2", "conv_shortcut": "nin_shortcut"}
_VAE_ATTN = {"group_norm": "norm", "to_q": "q", "to_k": "k", "to_v": "v", "to_out.0": "proj_out"}
_OPEN_CLIP_LAYER = {
    "self_attn.out_proj": "attn.out_proj",
    "layer_norm1": "ln_1",
    "layer_norm2": "ln_2",
    "mlp.fc1": "mlp.c_fc",
    "mlp.fc2": "mlp.c_proj",
}


def _block(modules: dict, src: str, dst: str, inner: dict) -> None:
    modules.update({f"{src}.{a}": f"{dst}.{b}" for a, b in inner.items()})


def unet_modules(config) -> dict[str, str]:
    """diffusers module -> original module. The original UNet is flat: input_blocks holds, per level,
    layers_per_block [resnet, attention] entries then one [downsampler]; output_blocks holds layers_per_block + 1
    entries per level, the level's upsampler appended to its last one. Attention internals keep their names."""
    if not isinstance(config["layers_per_block"], int):
        raise UserError(
            "single-file export needs one layers_per_block for every UNet level (the original layout "
            "has no per-level counts)"
        )
    n = config["layers_per_block"] + 1  # entries per level
    m = {
        "conv_in": "input_blocks.0.0",
        "time_embedding.linear_1": "time_embed.0",
        "time_embedding.linear_2": "time_embed.2",
        "add_embedding.linear_1": "label_emb.0.0",
        "add_embedding.linear_2": "label_emb.0.2",
        "conv_norm_out": "out.0",
        "conv_out": "out.2",
        "mid_block.attentions.0": "middle_block.1",
    }
    for j in (0, 1):
        _block(m, f"mid_block.resnets.{j}", f"middle_block.{2 * j}", _UNET_RESNET)
    for b in range(len(config["down_block_types"])):
        for j in range(n - 1):
            _block(m, f"down_blocks.{b}.resnets.{j}", f"input_blocks.{1 + b * n + j}.0", _UNET_RESNET)
            m[f"down_blocks.{b}.attentions.{j}"] = f"input_blocks.{1 + b * n + j}.1"
        m[f"down_blocks.{b}.downsamplers.0.conv"] = f"input_blocks.{b * n + n}.0.op"
    for b, kind in enumerate(config["up_block_types"]):
        for j in range(n):
            _block(m, f"up_blocks.{b}.resnets.{j}", f"output_blocks.{b * n + j}.0", _UNET_RESNET)
            m[f"up_blocks.{b}.attentions.{j}"] = f"output_blocks.{b * n + j}.1"
        # the upsampler follows the attention when the level has one
        m[f"up_blocks.{b}.upsamplers.0.conv"] = f"output_blocks.{b * n + n - 1}.{2 if 'Attn' in kind else 1}.conv"
    return m


def vae_modules(config) -> dict[str, str]:
    """diffusers module -> original module for AutoencoderKL. The original decoder numbers its levels from the
    bottom (up.0 is the last to run), diffusers from the top."""
    levels, layers = len(config["down_block_types"]), config["layers_per_block"]
    m = {
        k: k
        for k in (
            "quant_conv",
            "post_quant_conv",
            "encoder.conv_in",
            "encoder.conv_out",
            "decoder.conv_in",
            "decoder.conv_out",
        )
    }
    for part in ("encoder", "decoder"):
        m[f"{part}.conv_norm_out"] = f"{part}.norm_out"
        _block(m, f"{part}.mid_block.attentions.0", f"{part}.mid.attn_1", _VAE_ATTN)
        for j in (0, 1):
            _block(m, f"{part}.mid_block.resnets.{j}", f"{part}.mid.block_{j + 1}", _VAE_RESNET)
    for i in range(levels):
        up = levels - 1 - i
        for j in range(layers):
            _block(m, f"encoder.down_blocks.{i}.resnets.{j}", f"encoder.down.{i}.block.{j}", _VAE_RESNET)
        for j in range(layers + 1):
            _block(m, f"decoder.up_blocks.{i}.resnets.{j}", f"decoder.up.{up}.block.{j}", _VAE_RESNET)
        m[f"encoder.down_blocks.{i}.downsamplers.0.conv"] = f"encoder.down.{i}.downsample.conv"
        m[f"decoder.up_blocks.{i}.upsamplers.0.conv"] = f"decoder.up.{up}.upsample.conv"
    return m


def _rename_key(key: str, modules: dict[str, str]) -> str | None:
    parts = key.split(".")
    for n in range(len(parts) - 1, 0, -1):  # longest mapped module prefix; the rest of the name is kept
        head = ".".join(parts[:n])
        if head in modules:
            return ".".join([modules[head], *parts[n:]])
    return None


def rename(state: dict, modules: dict[str, str], what: str) -> dict:
    out, unmapped = {}, []
    for key, value in state.items():
        new = _rename_key(key, modules)
        if new is None:
            unmapped.append(key)
        else:
            out[new] = value
    if unmapped:
        raise UserError(
            f"cannot write the {what} in the original SD layout: no original name for {unmapped[0]} "
            f"({len(unmapped)} tensors unmapped); only SD 1.x and SDXL architectures are supported"
        )
    return out


def ldm_unet_state(unet) -> dict:
    return rename(unet.state_dict(), unet_modules(unet.config), "UNet")


# The family's single_file_denoiser -> the denoiser's weights under their original names.
DENOISER_MAPS = {"ldm_unet": ldm_unet_state, "mmdit": mmdit_state}


def vae_state(vae) -> dict:
    state = rename(vae.state_dict(), vae_modules(vae.config), "VAE")
    # The original mid-block attention uses 1x1 convolutions where diffusers has linear layers.
    return {k: v[..., None, None] if ".mid.attn_1." in k and v.ndim == 2 else v for k, v in state.items()}


def clip_state(encoder, prefix: str) -> dict:
    # transformers >= 5.6 flattens CLIPTextModel (no text_model. level); the original layout always has it.
    return {
        prefix + (k if k.startswith("text_model.") else f"text_model.{k}"): v for k, v in encoder.state_dict().items()
    }


def open_clip_state(encoder) -> dict:
    """CLIPTextModelWithProjection -> OpenCLIP text tower: q/k/v fused into in_proj, projection applied as x @ P."""
    sd = {k.removeprefix("text_model."): v for k, v in encoder.state_dict().items()}
    out = {
        "text_projection": sd.pop("text_projection.weight").T.contiguous(),
        "positional_embedding": sd.pop("embeddings.position_embedding.weight"),
    }
    modules = {"embeddings.token_embedding": "token_embedding", "final_layer_norm": "ln_final"}
    for i in range(encoder.config.num_hidden_layers):
        src, dst = f"encoder.layers.{i}", f"transformer.resblocks.{i}"
        for kind in ("weight", "bias"):
            out[f"{dst}.attn.in_proj_{kind}"] = torch.cat([sd.pop(f"{src}.self_attn.{x}_proj.{kind}") for x in "qkv"])
        _block(modules, src, dst, _OPEN_CLIP_LAYER)
    out.update(rename(sd, modules, "second text encoder"))
    return {OPEN_CLIP_PREFIX + k: v for k, v in out.items()}


def original_state_dict(unet, vae, encoders: list, family: str) -> dict:
    """All pipeline weights under their original-layout names (views of the models' tensors where the layout
    allows, so exporting does not double the memory)."""
    fam = families.named(family)
    state = {UNET_PREFIX + k: v for k, v in DENOISER_MAPS[fam.single_file_denoiser or ""](unet).items()}
    state.update({VAE_PREFIX + k: v for k, v in vae_state(vae).items()})
    for layout, encoder in zip(fam.single_file_text, encoders):
        state.update(clip_state(encoder, fam.clip_prefix) if layout == "clip" else open_clip_state(encoder))
    return state


def _check_text_encoders(model: str, family: str, encoders: list) -> None:
    if families.named(family).single_file_denoiser not in DENOISER_MAPS:
        raise UserError(f"{model}: sdpipe has no single-file export for {families.named(family).title} models")
    layouts = families.named(family).single_file_text
    if not layouts:  # the file holds no text encoder
        return
    if len(encoders) != len(layouts):
        raise UserError(f"{model}: single-file export supports SDXL base (two text encoders), not the refiner")
    if layouts[0] == "clip" and len(layouts) == 1 and encoders[0].config.hidden_act != "quick_gelu":
        # SD 2.x: its OpenCLIP-H encoder has a different original layout (cond_stage_model.model.)
        raise UserError(f"{model}: single-file export supports SD 1.x and SDXL, not SD 2.x (OpenCLIP text encoder)")


def export_single_file(model: str | Path, out: str | Path, dtype: str = "fp16", metadata: dict | None = None) -> Path:
    """Write the diffusers pipeline `model` (folder or cached hub id) as one original-layout .safetensors, with
    `metadata` in its header (sdpipe.export.metadata)."""
    from safetensors.torch import save_file

    if dtype not in DTYPES:
        raise UserError(f"export dtype {dtype!r} is not one of {', '.join(DTYPES)}")
    model, torch_dtype = str(model), DTYPES[dtype]  # loaded in the file's dtype: no fp32 copy of SDXL in memory
    family = loading.pipeline_family(model)
    in_file = families.named(family).single_file_text
    encoders = loading.load_text_stack(model, dtype=torch_dtype).encoders if in_file else []
    _check_text_encoders(model, family, encoders)
    state = original_state_dict(
        loading.load_unet(model, dtype=torch_dtype), loading.load_vae(model, dtype=torch_dtype), encoders, family
    )
    state = {k: v.detach().to(torch_dtype).contiguous() for k, v in state.items()}
    with io.atomic_path(out) as tmp:
        save_file(state, str(tmp), metadata={"format": "pt", **(metadata or {})})
    return Path(out)


def meta_model(root: Path, name: str, family: str):
    """Pipeline component `name` (the denoiser, vae, or a text encoder) built from its config on the meta device:
    names and shapes, no weights read."""
    import transformers
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL

    fam = families.named(family)
    with init_empty_weights():
        if name in (fam.denoiser, "vae"):
            cls = fam.denoiser_type() if name == fam.denoiser else AutoencoderKL
            return cls.from_config(cls.load_config(root / name))
        cls = getattr(transformers, next(p.encoder_class for p in fam.text_parts if p.encoder == name))
        return cls(transformers.AutoConfig.from_pretrained(root / name))


def _check_keys(path: str | Path, root: Path, family: str) -> None:
    """Every tensor an export of this architecture holds must be in the file: diffusers would fail obscurely
    (a model left on the meta device) or, for a text encoder, fall back to the config folder's weights."""
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(str(path), framework="pt") as f:
            present = set(f.keys())
    except (OSError, SafetensorError) as exc:
        raise UserError(f"cannot read {path} as a .safetensors checkpoint: {exc}") from None
    fam = families.named(family)
    encoders = [meta_model(root, name, family) for name in fam.text_encoders] if fam.single_file_text else []
    expected = original_state_dict(
        meta_model(root, fam.denoiser, family), meta_model(root, "vae", family), encoders, family
    )
    missing = sorted(set(expected) - present)
    if missing:
        raise UserError(
            f"{path} lacks {len(missing)} tensors of this {family} architecture (e.g. {missing[0]}): "
            f"it is not an export of {root}, or an incomplete one"
        )


def load_single_file(path: str | Path, config_dir: str | Path, family: str, dtype: torch.dtype = torch.float32):
    """Load an original-layout checkpoint with diffusers' own loader, the way users' A1111/ComfyUI files are loaded.

    `config=` is required: custom sizes (the tiny presets) are on no hub repo, and without it diffusers guesses a
    hub repo from the keys and downloads its configs. Only config and tokenizer files of `config_dir` are offered,
    so that nothing can come from its weights: diffusers loads a text encoder it does not recognise in the file
    from the config folder instead. The one exception is what a family's files do not hold (SD 3.5's text
    encoders), judged as for a single-file base model (sdpipe.single_file.parts_not_in_file): those components
    are loaded from the config folder and passed explicitly, as users pass theirs.
    """
    from diffusers.loaders.single_file_utils import SingleFileComponentError

    cls = families.named(family).pipeline()
    root, _ = loading.model_index(str(config_dir))
    _check_keys(path, root, family)
    # What the file lacks, by the same presence tests the single-file base-model path uses (sdpipe.single_file).
    lacking = base_files.parts_not_in_file(base_files.tensor_info(path), family)
    alongside = loading.load_components(str(root), lacking, dtype) if lacking else {}
    with tempfile.TemporaryDirectory() as configs:
        shutil.copytree(
            root,
            configs,
            dirs_exist_ok=True,
            ignore=shutil.ignore_patterns(*(f"*{s}" for s in weights.WEIGHT_SUFFIXES)),
        )
        try:
            return cls.from_single_file(
                str(path), config=configs, local_files_only=True, torch_dtype=dtype, **alongside
            )
        except (OSError, ValueError, SingleFileComponentError) as exc:
            first = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
            raise UserError(f"cannot load {path} as a single-file {family} checkpoint: {first}") from None
