"""SD 3 and Flux behind the family seam: their text states, denoiser calls, timesteps and kohya LoRA layout agree
with what diffusers' own pipelines and readers do, on the tiny presets saved and loaded as users' folders are."""

from __future__ import annotations

import re

import pytest
import torch

from sdpipe.errors import UserError
from sdpipe.export import lora as lora_export
from sdpipe.models import families, loading, presets
from sdpipe.models.families import flux, sd3


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    root = tmp_path_factory.mktemp("flow")
    return {p: presets.build_and_save(p, root / p) for p in ("tiny-sd3", "tiny-flux")}


def test_the_presets_are_detected_as_their_families(saved):
    assert loading.pipeline_family(str(saved["tiny-sd3"])) == "sd3"
    assert loading.pipeline_family(str(saved["tiny-flux"])) == "flux"
    assert families.from_denoiser_config(presets.denoiser_config("sd35-medium")).name == "sd3"
    assert families.from_denoiser_config(presets.denoiser_config("flux-dev")).name == "flux"
    assert families.from_denoiser_config(presets.denoiser_config("sdxl")).name == "sdxl"  # a UNet stays a UNet


def test_cached_text_states_are_what_the_pipelines_condition_on(saved):
    from sdpipe.models.pipeline import load_pipeline

    prompt = "a red circle on a white background"
    stack = loading.load_text_stack(str(saved["tiny-sd3"]))
    cached = stack.encode([prompt])
    assert cached["t5"].shape[1] == sd3.T5_LENGTH and cached["clip"].shape[1] == 77
    pipe = load_pipeline(str(saved["tiny-sd3"]))
    joint, _, pooled, _ = pipe.encode_prompt(prompt, None, None, do_classifier_free_guidance=False)
    torch.testing.assert_close(sd3.joint_states(cached), joint)
    torch.testing.assert_close(cached["pooled"], pooled)

    stack = loading.load_text_stack(str(saved["tiny-flux"]))
    cached = stack.encode([prompt])
    pipe = load_pipeline(str(saved["tiny-flux"]))
    t5, pooled, _ = pipe.encode_prompt(prompt, None)
    assert cached["t5"].shape[1] == flux.T5_LENGTH
    torch.testing.assert_close(cached["t5"], t5)
    torch.testing.assert_close(cached["pooled"], pooled)


def test_flux_packing_and_positions_are_the_pipelines():
    from diffusers import FluxPipeline

    latents = torch.randn(2, 16, 6, 10)
    packed = flux.pack(latents)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(latents, 2, 16, 6, 10))
    torch.testing.assert_close(flux.unpack(packed, 6, 10), latents)
    # the pipeline's ids are per token of the packed image; its unpack takes pixel sizes (8 px per latent cell)
    expected = FluxPipeline._prepare_latent_image_ids(2, 3, 5, "cpu", torch.float32)
    torch.testing.assert_close(flux.image_ids(6, 10, latents), expected)


def test_flux_training_call_matches_a_direct_transformer_call(saved):
    model = loading.load_unet(str(saved["tiny-flux"]))
    stack = loading.load_text_stack(str(saved["tiny-flux"]))
    cond = stack.encode(["a blue square", "a red circle"])
    noisy, steps = torch.randn(2, 16, 8, 8), torch.tensor([250.0, 800.0])
    with torch.no_grad():
        got = flux.predict(model, noisy, steps, cond)
        direct = model(
            hidden_states=flux.pack(noisy),
            timestep=steps / 1000,
            guidance=torch.full((2,), flux.TRAIN_GUIDANCE),
            pooled_projections=cond["pooled"],
            encoder_hidden_states=cond["t5"],
            txt_ids=torch.zeros(cond["t5"].shape[1], 3),
            img_ids=flux.image_ids(8, 8, noisy),
        ).sample
    torch.testing.assert_close(got, flux.unpack(direct, 8, 8))


def test_timesteps_take_the_schedulers_shift(saved):
    g = lambda: torch.Generator().manual_seed(3)  # noqa: E731
    u = torch.rand((1,), generator=g()).item()  # Flux's density: uniform
    flux_t = families.named("flux").objective.timestep(g(), loading.load_noise_scheduler(str(saved["tiny-flux"])))
    assert flux_t.item() == pytest.approx(1000 * u, rel=1e-5)  # dynamic shifting: the training draw is unshifted
    sd3_sched = loading.load_noise_scheduler(str(saved["tiny-sd3"]))
    assert sd3_sched.config.shift == 3.0
    s = torch.sigmoid(torch.randn((1,), generator=g())).item()  # SD 3's: logit-normal(0, 1), then shift 3
    sd3_t = families.named("sd3").objective.timestep(g(), sd3_sched)
    assert sd3_t.item() == pytest.approx(1000 * 3 * s / (1 + 2 * s), rel=1e-5)


def _random_lora(model_modules: dict[str, tuple[int, int]], rank: int, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    state = {}
    for module, (out, inp) in model_modules.items():
        state[f"transformer.{module}.lora_A.weight"] = torch.randn(rank, inp, generator=g)
        state[f"transformer.{module}.lora_B.weight"] = torch.randn(out, rank, generator=g)
    return state


def _deltas(state: dict, scale: float) -> dict[str, torch.Tensor]:
    return {
        k.removesuffix(".lora_A.weight"): state[k.replace("lora_A", "lora_B")] @ state[k] * scale
        for k in state
        if k.endswith(".lora_A.weight")
    }


def test_flux_kohya_file_reads_back_in_diffusers_own_converter():
    """At FLUX.1's published widths (diffusers' reader assumes them), q/k/v and the single blocks' MLP input are
    fused as kohya's and ComfyUI's files have them, and diffusers splits them back to the same updates."""
    from diffusers.loaders.lora_conversion_utils import _convert_kohya_flux_lora_to_diffusers

    inner, mlp = 3072, 12288
    modules = {f"transformer_blocks.0.attn.{m}": (inner, inner) for m in ("to_q", "to_k", "to_v", "to_out.0")}
    modules.update({f"transformer_blocks.0.attn.{m}": (inner, inner) for m in ("add_q_proj", "add_v_proj")})
    modules.update({f"single_transformer_blocks.1.attn.{m}": (inner, inner) for m in ("to_q", "to_k", "to_v")})
    state = _random_lora(modules, rank=2, seed=0)
    sizes = {("transformer", "single_transformer_blocks.1.proj_mlp"): mlp}
    sizes[("transformer", "transformer_blocks.0.attn.add_k_proj")] = inner
    config = {"transformer": {"lora_alpha": 4, "r": 2}}
    kohya = lora_export.kohya_state_dict(state, config, "flux", sizes)
    assert {k.rsplit(".", 2)[0] for k in kohya} == {
        "lora_unet_double_blocks_0_img_attn_qkv",
        "lora_unet_double_blocks_0_img_attn_proj",
        "lora_unet_double_blocks_0_txt_attn_qkv",
        "lora_unet_single_blocks_1_linear1",
    }
    theirs = _deltas(_convert_kohya_flux_lora_to_diffusers(dict(kohya)), 1.0)
    ours = _deltas(state, 4 / 2)
    for module, delta in ours.items():
        torch.testing.assert_close(theirs[module], delta, rtol=1e-4, atol=1e-4)
    for unadapted in (
        "transformer.transformer_blocks.0.attn.add_k_proj",
        "transformer.single_transformer_blocks.1.proj_mlp",
    ):
        assert theirs[unadapted].abs().max() == 0  # a fused part the LoRA left alone stays unchanged


@pytest.mark.parametrize("preset", ["tiny-sd3", "tiny-flux"])
def test_kohya_export_and_sdpipes_reader_round_trip(saved, preset):
    family = loading.family_of(str(saved[preset]))
    sizes = lora_export.out_features(saved[preset], family.denoiser)
    linear = {m: (out, 0) for (_, m), out in sizes.items()}
    model = loading.load_unet(str(saved[preset]))
    shapes = {n: tuple(m.weight.shape) for n, m in model.named_modules() if n in linear}
    adapted = {n: s for n, s in shapes.items() if n.endswith(("attn.to_q", "attn.to_k", "attn.to_out.0", "ff.net.2"))}
    state = _random_lora(adapted, rank=3, seed=1)
    kohya = lora_export.kohya_state_dict(state, {"transformer": {"lora_alpha": 6, "r": 3}}, family.name, sizes)
    assert all(k.startswith("lora_unet_") and "transformer_blocks" not in k for k in kohya)  # the original names
    back = _deltas(lora_export.diffusers_from_kohya(kohya, family.name, sizes), 1.0)
    for module, delta in _deltas(state, 2.0).items():
        torch.testing.assert_close(back[module], delta, rtol=1e-5, atol=1e-5)
    assert all(back[m].abs().max() == 0 for m in back if m not in _deltas(state, 2.0))  # to_v: fused, not adapted


def test_a_layer_without_a_kohya_name_is_a_clear_error():

    state = _random_lora({"x_embedder": (8, 4)}, rank=1, seed=0)
    with pytest.raises(UserError, match="x_embedder.*kohya"):
        lora_export.kohya_state_dict(state, {}, "flux", {})


@pytest.mark.parametrize(
    "preset, change, says",
    [
        ("tiny-sd3", {"train": {"snr_gamma": 5.0}}, "train.snr_gamma = 5.0 applies to the DDPM objective of SD"),
        ("tiny-sd3", {"train": {"prediction_type": "epsilon"}}, "train.prediction_type = epsilon applies to the"),
        ("tiny-sd3", {"train": {"text_encoder": {"mode": "lora"}}}, "sdpipe does not train SD 3 / 3.5's text enc"),
        ("tiny-flux", {"export": {"single_file": True}}, "sdpipe writes no single-file Flux.1 checkpoint yet"),
    ],
)
def test_settings_the_family_cannot_use_fail_before_any_work(saved, preset, change, says):
    from sdpipe import config, model_facts

    base = {"model": {"pretrained": str(saved[preset]), "build_preset": None}, "export": {"single_file": False}}
    cfg = config.from_dict(config.merge(base, change))
    with pytest.raises(UserError, match=re.escape(says)):
        model_facts.check(cfg)
    model_facts.check(config.from_dict(base))  # the same base without the setting passes
