"""Export formats, checked by the loaders other tools' users rely on: a single-file checkpoint must come back through
diffusers' from_single_file with the same weights, and a kohya LoRA through load_lora_weights with the same fused
weights as the diffusers LoRA it came from.
Models are the tiny presets with every weight perturbed, so that no two tensors are equal and a swapped name shows."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from sdpipe.errors import UserError
from sdpipe.export import lora as lora_export
from sdpipe.export import single_file
from sdpipe.models import families, presets

PRESETS = ("tiny", "tiny-sdxl")
RANK, ALPHA = 4, 2  # alpha != rank: an export that wrote alpha = rank would double every update
UNET_TARGETS = ["to_q", "to_k", "to_v", "to_out.0", "conv1"]  # conv1: the resnets' 3x3 convs, 4-D LoRA weights
TEXT_TARGETS = ["q_proj", "k_proj", "v_proj", "out_proj", "fc1"]


def _text_encoders(preset: str) -> list[str]:
    return list(families.named(presets.family(preset)).text_encoders)


def _components(preset: str) -> list[str]:
    return [families.named(presets.family(preset)).denoiser, "vae", *_text_encoders(preset)]


def _perturbed_model(preset: str, tmp: Path):
    from diffusers import DiffusionPipeline

    pipe = DiffusionPipeline.from_pretrained(presets.build_and_save(preset, tmp / "base", seed=0))
    torch.manual_seed(1)
    with torch.no_grad():
        for name in _components(preset):
            for p in getattr(pipe, name).parameters():
                p.add_(0.01 * torch.randn_like(p))
    pipe.save_pretrained(tmp / "model")
    return tmp / "model", pipe


def _trained_lora(preset: str, model: Path, out: Path) -> Path:
    """A LoRA on the UNet and text encoder(s), saved as training saves it (diffusers format, adapter configs in the
    metadata), with random up weights (peft starts them at zero, which would make every check trivial)."""
    from diffusers import DiffusionPipeline
    from peft import LoraConfig, inject_adapter_in_model
    from peft.utils import get_peft_model_state_dict

    pipe, layers = DiffusionPipeline.from_pretrained(model), {}
    torch.manual_seed(2)
    for name in ["unet", *_text_encoders(preset)]:
        part = getattr(pipe, name)
        config = LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules=UNET_TARGETS if name == "unet" else TEXT_TARGETS)
        inject_adapter_in_model(config, part, adapter_name="default")
        with torch.no_grad():
            for param_name, p in part.named_parameters():
                if "lora_" in param_name:
                    p.copy_(0.1 * torch.randn_like(p))
        part.peft_config = {"default": config}
        layers.update(
            {f"{name}_lora_layers": get_peft_model_state_dict(part), f"{name}_lora_adapter_metadata": config.to_dict()}
        )
    type(pipe).save_lora_weights(str(out), **layers)
    return out


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """preset -> (model folder, the perturbed pipeline in memory, its LoRA folder); each built once."""
    cache = {}

    def get(preset: str):
        if preset not in cache:
            tmp = tmp_path_factory.mktemp(preset)
            model, pipe = _perturbed_model(preset, tmp)
            unet = families.named(presets.family(preset)).denoiser == "unet"  # the LoRA tests here are the UNet's
            cache[preset] = (model, pipe, _trained_lora(preset, model, tmp / "lora") if unet else None)
        return cache[preset]

    return get


def _assert_same(got: dict, want: dict, what: str) -> None:
    assert got.keys() == want.keys(), f"{what}: names differ: {sorted(set(got) ^ set(want))[:4]}"
    bad = [k for k in want if not torch.equal(got[k], want[k])]
    assert not bad, f"{what}: {len(bad)} of {len(want)} tensors differ, e.g. {bad[0]}"


@pytest.mark.parametrize(
    "preset, dtype",
    [
        ("tiny", "fp32"),
        ("tiny-sdxl", "fp32"),
        ("tiny", "fp16"),
        ("tiny-sdxl", "fp16"),
        ("tiny", "bf16"),
        ("tiny-sd3", "fp32"),
        ("tiny-sd3", "bf16"),
    ],
)
def test_single_file_loads_back_in_diffusers(built, tmp_path, preset, dtype) -> None:
    model, pipe, _ = built(preset)
    path = single_file.export_single_file(model, tmp_path / "model.safetensors", dtype=dtype)
    stored = {v.dtype for v in load_file(path).values()}
    assert stored == {single_file.DTYPES[dtype]}, f"file holds {stored}, asked for {dtype}"
    text_in_file = presets.family(preset) != "sd3"  # SD 3's file is the MMDiT and the VAE, as Stability ships it
    in_file = {"unet", "transformer", "vae", *(_text_encoders(preset) if text_in_file else [])}
    if not text_in_file:
        assert {k.split(".")[0] for k in load_file(path)} == {"model", "first_stage_model"}
    loaded = single_file.load_single_file(path, model, presets.family(preset))
    for name in _components(preset):
        # fp32 must be bit-exact; fp16/bf16 exactly the original rounded once to that precision (round to nearest,
        # i.e. within half an ulp: relative error <= 2**-11 for fp16, 2**-8 for bf16). SD 3's text encoders are
        # not in its file: they come from the folder as they are.
        rounded = single_file.DTYPES[dtype] if name in in_file else torch.float32
        want = {k: v.to(rounded).float() for k, v in getattr(pipe, name).state_dict().items()}
        _assert_same(getattr(loaded, name).state_dict(), want, f"{preset} {dtype} {name}")


@pytest.mark.parametrize("preset, model_type", [("sd15", "v1"), ("sdxl", "xl_base")])
def test_full_size_layout_matches_diffusers_converter(preset, model_type) -> None:
    """The published SD 1.5 / SDXL sizes (4 levels, 2 layers per block, 32-layer OpenCLIP), on the meta device:
    diffusers' own converters must map every exported name back onto the diffusers model, same shapes."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from diffusers.loaders import single_file_utils as ref
    from transformers import CLIPTextModel, CLIPTextModelWithProjection

    family, configs = presets.family(preset), presets.text_encoder_configs(preset)
    with init_empty_weights():
        unet, vae = UNet2DConditionModel(**presets.unet_config(preset)), AutoencoderKL(**presets.vae_config(preset))
        encoders = [CLIPTextModel(configs[0])] + [CLIPTextModelWithProjection(c) for c in configs[1:]]
    state = single_file.original_state_dict(unet, vae, encoders, family)
    assert ref.infer_diffusers_model_type(state) == model_type
    clip = ref.convert_ldm_clip_checkpoint(state)  # keeps text_model., which a flattened CLIPTextModel lacks
    converted = {
        "unet": ref.convert_ldm_unet_checkpoint(state, unet.config),
        "vae": ref.convert_ldm_vae_checkpoint(state, vae.config),
        "text_encoder": {k.removeprefix("text_model."): v for k, v in clip.items()},
    }
    models = {"unet": unet, "vae": vae, "text_encoder": encoders[0]}
    if family == "sdxl":
        converted["text_encoder_2"] = ref.convert_open_clip_checkpoint(encoders[1], state, single_file.OPEN_CLIP_PREFIX)
        models["text_encoder_2"] = encoders[1]
    for name, model in models.items():
        want = {k: v.shape for k, v in model.state_dict().items()}
        assert {k: v.shape for k, v in converted[name].items()} == want, f"{preset} {name}"


def test_sd35_medium_layout_is_what_diffusers_reads_as_35_medium() -> None:
    """SD 3.5 Medium's published size on the meta device: diffusers must class the file as 3.5 Medium (so its
    default configs fit) and its converters must map every name back, same shapes."""
    from accelerate import init_empty_weights
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from diffusers.loaders import single_file_utils as ref

    with init_empty_weights():
        transformer = SD3Transformer2DModel(**presets.denoiser_config("sd35-medium"))
        vae = AutoencoderKL(**presets.vae_config("sd35-medium"))
    state = single_file.original_state_dict(transformer, vae, [], "sd3")
    assert ref.infer_diffusers_model_type(state) == "sd35_medium"
    converted = {
        "transformer": ref.convert_sd3_transformer_checkpoint_to_diffusers(dict(state)),
        "vae": ref.convert_ldm_vae_checkpoint(state, vae.config),
    }
    for name, model in {"transformer": transformer, "vae": vae}.items():
        want = {k: v.shape for k, v in model.state_dict().items()}
        assert {k: v.shape for k, v in converted[name].items()} == want, name


def test_single_file_errors(built, tmp_path) -> None:
    tiny, _, _ = built("tiny")
    with pytest.raises(UserError, match="export dtype 'fp8'"):
        single_file.export_single_file(tiny, tmp_path / "x.safetensors", dtype="fp8")
    path = single_file.export_single_file(tiny, tmp_path / "tiny.safetensors", dtype="fp16")
    xl, _, _ = built("tiny-sdxl")  # a file checked against another model's configs: a clear error, not a traceback
    with pytest.raises(UserError, match=r"lacks \d+ tensors of this sdxl architecture"):
        single_file.load_single_file(path, xl, "sdxl")


def _assert_lora_update(fused: torch.Tensor, base: torch.Tensor, kohya: dict, name: str) -> None:
    """fused - base == alpha / rank * up @ down for a linear layer: both loaders are right, not merely equal."""
    update = ALPHA / RANK * kohya[f"{name}.lora_up.weight"] @ kohya[f"{name}.lora_down.weight"]
    torch.testing.assert_close(fused - base, update)


@pytest.mark.parametrize("preset", PRESETS)
def test_kohya_lora_fuses_like_the_diffusers_lora(built, tmp_path, preset) -> None:
    model, pipe, lora = built(preset)
    family, components = presets.family(preset), ["unet", *_text_encoders(preset)]
    kohya = load_file(lora_export.export_kohya(lora, tmp_path / "lora.safetensors", model))
    alphas = {k: v.item() for k, v in kohya.items() if k.endswith(".alpha")}
    assert alphas and set(alphas.values()) == {ALPHA}, "alpha must be the trained lora_alpha, not the rank"
    assert len(kohya) == 3 * len(alphas)
    want_prefixes = {"sd": {"unet", "te"}, "sdxl": {"unet", "te1", "te2"}}[family]  # A1111/ComfyUI naming
    assert {k.split("_")[1] for k in kohya} == want_prefixes
    assert all("_text_model_encoder_layers_" in k for k in kohya if k.startswith("lora_te"))

    from_diffusers = lora_export.fused_pipeline(model, lora)
    from_kohya = lora_export.fused_pipeline(model, tmp_path / "lora.safetensors")
    for name in components:
        got, want = getattr(from_kohya, name).state_dict(), getattr(from_diffusers, name).state_dict()
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6, msg=lambda m, name=name: f"{preset} {name}: {m}")
    modules = [
        ("unet", "mid_block.attentions.0.transformer_blocks.0.attn1.to_q"),
        *[
            (name, m)
            for name, m in lora_export.lora_modules(lora_export.read_lora(lora)[0])
            if name != "unet" and m.endswith("layers.1.self_attn.q_proj")
        ],
    ]
    assert len(modules) == len(components)
    for name, module in modules:
        fused, base = getattr(from_kohya, name).state_dict(), getattr(pipe, name).state_dict()
        _assert_lora_update(
            fused[f"{module}.weight"], base[f"{module}.weight"], kohya, lora_export.kohya_name(name, module, family)
        )


def test_lora_base_mismatch_is_a_clear_error(built, tmp_path) -> None:
    tiny, _, tiny_lora = built("tiny")
    xl, _, xl_lora = built("tiny-sdxl")
    # tiny's cross-attention reads 64-d text, tiny-sdxl's 160-d: same layer names, other shapes.
    with pytest.raises(UserError, match=r"does not match base model .*attn2.to_k maps 160->64 .* 64->64"):
        lora_export.export_kohya(tiny_lora, tmp_path / "x.safetensors", xl)
    assert not (tmp_path / "x.safetensors").exists()
    with pytest.raises(UserError, match="it adapts text_encoder_2, which the base model does not have"):
        lora_export.check_lora_matches(xl_lora, tiny)
    state = load_file(tiny_lora / lora_export.LORA_FILE)
    save_file(
        {k.replace("down_blocks.0.", "down_blocks.7."): v for k, v in state.items()}, tmp_path / "renamed.safetensors"
    )
    with pytest.raises(UserError, match="its unet has no layer down_blocks.7.attentions.0"):
        lora_export.check_lora_matches(tmp_path / "renamed.safetensors", tiny)


def test_lora_without_metadata_or_not_diffusers(built, tmp_path) -> None:
    tiny, _, tiny_lora = built("tiny")
    # Without adapter metadata diffusers loads a LoRA with alpha = rank; the export keeps that meaning.
    save_file(load_file(tiny_lora / lora_export.LORA_FILE), tmp_path / lora_export.LORA_FILE)
    kohya = load_file(lora_export.export_kohya(tmp_path, tmp_path / "k.safetensors", tiny))
    assert {v.item() for k, v in kohya.items() if k.endswith(".alpha")} == {RANK}
    with pytest.raises(UserError, match="not a diffusers/peft adapter"):
        lora_export.read_lora(tmp_path / "k.safetensors")  # a kohya file is not an input
    with pytest.raises(UserError, match="cannot read a diffusers LoRA"):
        lora_export.read_lora(tmp_path / "missing")
