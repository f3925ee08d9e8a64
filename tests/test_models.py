"""Model presets, the CLIP tokenizer and loading: tiny models are built, saved and loaded back through the same
from_pretrained path a real checkpoint takes. No network."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from sdpipe.errors import UserError
from sdpipe.models import loading, presets
from sdpipe.models.tokenizer import build_clip_tokenizer

CAPTIONS = [
    "a photo of a cat",
    "A RED Circle on a blue background.",
    "it's 2024, isn't it? naïve café",
    "a painting of " + "a very large tree and " * 30 + "a house",
]  # the last one is truncated at 77


def _open_clip_ids(texts: list[str]) -> torch.Tensor:
    open_clip = pytest.importorskip("open_clip")
    return open_clip.tokenize(texts)  # [B, 77], padded with 0


def test_tokenizer_ids_match_open_clip(tmp_path: Path) -> None:
    tok = build_clip_tokenizer(tmp_path)
    enc = tok(CAPTIONS, padding="max_length", max_length=tok.model_max_length, truncation=True, return_tensors="pt")
    # open_clip pads with id 0, the HF CLIP tokenizer with <|endoftext|>: compare the unpadded tokens.
    assert torch.equal(enc.input_ids.masked_fill(enc.attention_mask == 0, 0), _open_clip_ids(CAPTIONS))
    assert tok.model_max_length == 77 and len(tok) == 49408
    assert tok.convert_tokens_to_ids(["<|startoftext|>", "<|endoftext|>"]) == [49406, 49407]
    assert (tmp_path / "merges.txt").read_text().startswith("#version: 0.2\ni n\n")
    assert json.loads((tmp_path / "vocab.json").read_text())["<|endoftext|>"] == 49407


def test_tokenizer_pad_bang_matches_open_clip_exactly() -> None:
    # SDXL's tokenizer_2 pads with "!" (id 0) like open_clip, so whole rows agree. ("!" itself becomes a special
    # token there, exactly as in the real SDXL tokenizer_2, so the captions avoid it.)
    tok = build_clip_tokenizer(pad_token="!")
    ids = tok(CAPTIONS, padding="max_length", max_length=77, truncation=True, return_tensors="pt").input_ids
    assert torch.equal(ids, _open_clip_ids(CAPTIONS))


def test_family_and_unknown_preset() -> None:
    assert [presets.family(p) for p in presets.PRESETS] == ["sd", "sd", "sdxl", "sd3", "sd3", "flux", "flux"]
    with pytest.raises(UserError, match="tiny, sd15, sdxl, tiny-sd3"):
        presets.family("sd3")
    with pytest.raises(UserError, match="unknown model preset"):
        presets.build_and_save("sd3", Path("/nonexistent/never-written"))


def _meta_counts(preset: str) -> tuple[int, list[int]]:
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextModel

    count = lambda m: sum(p.numel() for p in m.parameters())  # noqa: E731
    with torch.device("meta"):  # shapes only: no memory, no init time
        unet = UNet2DConditionModel(**presets.unet_config(preset))
        texts = [CLIPTextModel(c) for c in presets.text_encoder_configs(preset)]
    return count(unet), [count(t) for t in texts]


def test_real_architectures_have_published_param_counts() -> None:
    assert _meta_counts("sd15") == (859_520_964, [123_060_480])
    assert _meta_counts("sdxl")[0] == 2_567_463_684
    assert [c.hidden_size for c in presets.text_encoder_configs("sdxl")] == [768, 1280]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(presets.build_and_save("tiny", tmp_path_factory.mktemp("models") / "tiny", seed=0))


@pytest.fixture(scope="module")
def tiny_xl(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(presets.build_and_save("tiny-sdxl", tmp_path_factory.mktemp("models") / "tiny-sdxl", seed=0))


def test_tiny_components_load_and_fit_together(tiny: str) -> None:
    assert loading.pipeline_family(tiny) == "sd"
    assert loading.text_component_names(tiny) == ["text_encoder"]
    vae = loading.load_vae(tiny)
    assert not vae.training and not any(p.requires_grad for p in vae.parameters())
    with torch.no_grad():
        latents = vae.encode(torch.rand(1, 3, 32, 32) * 2 - 1).latent_dist.mean
    assert latents.shape == (1, 4, 8, 8)  # SD's 4 latent channels, 32px / 4 = 8
    hidden = loading.load_text_stack(tiny).encode(["a red circle", "a blue square"])["hidden"]
    assert hidden.shape == (2, 77, 64)
    with torch.no_grad():
        eps = loading.load_unet(tiny)(latents, torch.tensor([500]), encoder_hidden_states=hidden[:1]).sample
    assert eps.shape == latents.shape
    assert loading.load_noise_scheduler(tiny).config.beta_schedule == "scaled_linear"


def test_tiny_loads_as_a_diffusers_pipeline(tiny: str) -> None:
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny)
    pipe.set_progress_bar_config(disable=True)
    image = pipe("a red circle", height=32, width=32, num_inference_steps=2, output_type="np").images
    assert image.shape == (1, 32, 32, 3)
    # Our text conditioning is what the pipeline itself feeds the UNet.
    ours = loading.load_text_stack(tiny).encode(CAPTIONS)["hidden"]
    theirs = pipe.encode_prompt(CAPTIONS, "cpu", 1, False)[0]
    torch.testing.assert_close(ours, theirs)


def test_tiny_sdxl_family(tiny_xl: str) -> None:
    from diffusers import StableDiffusionXLPipeline

    assert loading.pipeline_family(tiny_xl) == "sdxl"
    assert loading.text_component_names(tiny_xl) == ["text_encoder", "text_encoder_2"]
    out = loading.load_text_stack(tiny_xl).encode(CAPTIONS)
    assert out["hidden"].shape == (4, 77, 64 + 96) and out["pooled"].shape == (4, 96)
    pipe = StableDiffusionXLPipeline.from_pretrained(tiny_xl)
    embeds, _, pooled, _ = pipe.encode_prompt(CAPTIONS, device="cpu", do_classifier_free_guidance=False)
    torch.testing.assert_close(out["hidden"], embeds)
    torch.testing.assert_close(out["pooled"], pooled)
    time_ids = torch.tensor([[32.0, 32, 0, 0, 32, 32]] * 4)
    with torch.no_grad():
        eps = loading.load_unet(tiny_xl)(
            torch.randn(4, 4, 8, 8),
            torch.tensor([1, 10, 100, 999]),
            out["hidden"],
            added_cond_kwargs={"text_embeds": out["pooled"], "time_ids": time_ids},
        ).sample
    assert eps.shape == (4, 4, 8, 8)


def _weights(model_dir: Path) -> dict[str, torch.Tensor]:
    return {
        f"{f.parent.name}/{k}": v for f in sorted(model_dir.rglob("*.safetensors")) for k, v in load_file(f).items()
    }


def test_same_seed_same_weights(tiny: str, tmp_path: Path) -> None:
    a, b = _weights(Path(tiny)), _weights(presets.build_and_save("tiny", tmp_path / "again", seed=0))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    c = _weights(presets.build_and_save("tiny", tmp_path / "other", seed=1))
    assert not torch.equal(a["unet/conv_in.weight"], c["unet/conv_in.weight"])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["again", "other"]  # no temporary folders left behind


def test_build_refuses_to_overwrite(tiny: str, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="already exists"):
        presets.build_and_save("tiny", Path(tiny))
    (tmp_path / "busy").mkdir()
    (tmp_path / "busy" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="not an empty folder"):
        presets.build_and_save("tiny", tmp_path / "busy")


def test_a_mistyped_local_path_is_not_taken_for_a_hub_id(tmp_path: Path, monkeypatch) -> None:
    from sdpipe import weights

    monkeypatch.chdir(tmp_path)
    (tmp_path / "models").mkdir()
    for name in ("models/my-sd15", "checkpoints/sd15/model", "sd15-pruned.safetensors"):
        with pytest.raises(UserError, match=f"model path {name} does not exist") as err:
            weights.resolve(name)
        assert "hf download" not in str(err.value)
    with pytest.raises(UserError, match="hf download nobody-sdpipe-test/not-a-model"):
        weights.resolve("nobody-sdpipe-test/not-a-model")


def test_loading_errors_are_user_errors(tiny: str, tmp_path: Path) -> None:
    with pytest.raises(UserError, match="does not exist"):
        loading.load_vae(str(tmp_path / "missing"))
    with pytest.raises(UserError, match="model_index.json"):
        loading.pipeline_family(str(tmp_path))
    with pytest.raises(UserError, match="variant"):
        loading.load_vae(tiny, variant="fp16")
    with pytest.raises(UserError, match="variant"):
        loading.load_text_stack(tiny, variant="fp16")
    with pytest.raises(UserError, match="hf download"):
        loading.load_text_stack("nobody-sdpipe-test/not-a-model")  # a hub id not in the cache: no download tried


@pytest.mark.parametrize(
    "mode, device, kind",
    [
        ("auto", "cpu", "eager"),
        ("auto", "cuda", "whole"),
        ("blocks", "cpu", "blocks"),
        ("eager", "cuda", "eager"),
        ("compiled", "cpu", "whole"),
    ],
)
def test_training_forward_compiles_where_configured(tiny_model, mode, device, kind):
    """train.compile picks the callable; an undecided auto (resolve_compile decides it for a run) compiles the
    whole UNet on GPUs, nothing on a CPU. torch.compile is lazy, so nothing is compiled here."""
    from types import SimpleNamespace

    from sdpipe.train.models import training_forward

    unet = loading.load_unet(str(tiny_model))
    forward = training_forward(SimpleNamespace(train=SimpleNamespace(compile=mode)), unet, torch.device(device))
    got = (
        "whole"
        if isinstance(forward, torch._dynamo.eval_frame.OptimizedModule)
        else "blocks"
        if hasattr(forward, "regions")
        else "eager"
        if forward is unet
        else "?"
    )
    assert got == kind


@pytest.mark.parametrize(
    "mode, device, prepared", [("auto", "cuda", True), ("compiled", "cpu", False), ("eager", "cuda", False)]
)
def test_a_compiled_gpu_step_gets_the_channels_last_layers(mode, device, prepared):
    """Only the compiled GPU step is rearranged (the device is only named here: the decision, not the tensors)."""
    from types import SimpleNamespace

    from sdpipe.models.layout import ChannelsLastInputConv2d
    from sdpipe.models.norms import ChannelStatGroupNorm
    from sdpipe.train.models import prepare_for_gpu_compile

    model = torch.nn.Sequential(torch.nn.Conv2d(3, 8, 3), torch.nn.GroupNorm(4, 8))
    benchmark = torch.backends.cudnn.benchmark
    try:
        prepare_for_gpu_compile(SimpleNamespace(train=SimpleNamespace(compile=mode)), model, torch.device(device))
        assert torch.backends.cudnn.benchmark == (prepared or benchmark)
    finally:
        torch.backends.cudnn.benchmark = benchmark
    assert model[0].weight.is_contiguous(memory_format=torch.channels_last) == prepared
    assert isinstance(model[1], ChannelStatGroupNorm) == prepared
    assert isinstance(model[0], ChannelsLastInputConv2d) == prepared


@pytest.mark.parametrize(
    "device, samples, decided", [("cuda", 32_000, "eager"), ("cuda", 200_000, "compiled"), ("cpu", 10**7, "eager")]
)
def test_auto_compiles_only_runs_long_enough_to_repay_it(device, samples, decided):
    """1000 steps at batch 32 (the issue's sd15 run) stay eager: a cold compile costs more than it saves."""
    from sdpipe import config
    from sdpipe.train.models import resolve_compile

    cfg = config.from_dict({})
    resolved = resolve_compile(cfg, torch.device(device), samples)
    assert resolved.train.compile == decided and resolved.raw is cfg.raw
    explicit = config.from_dict({"train": {"compile": "blocks"}})
    assert resolve_compile(explicit, torch.device(device), samples).train.compile == "blocks"


SD3_INDEX = {
    "_class_name": "StableDiffusion3Pipeline",
    "transformer": ["diffusers", "SD3Transformer2DModel"],
    "text_encoder": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"],
    "text_encoder_3": ["transformers", "T5EncoderModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}
FLUX_INDEX = {
    "_class_name": "FluxPipeline",
    "transformer": ["diffusers", "FluxTransformer2DModel"],
    "text_encoder": ["transformers", "CLIPTextModel"],
    "text_encoder_2": ["transformers", "T5EncoderModel"],
    "vae": ["diffusers", "AutoencoderKL"],
}


@pytest.mark.parametrize("index, family", [(SD3_INDEX, "sd3"), (FLUX_INDEX, "flux")])
def test_sd3_and_flux_folders_are_not_taken_for_sdxl(tmp_path, index, family):
    """Issue 27: a minimal model_index.json of SD3 or Flux was detected as sdxl (it has a text_encoder_2); issue 28
    trains both, so each is known as its own family."""
    from sdpipe.models import loading

    (tmp_path / "model_index.json").write_text(json.dumps(index))
    assert loading.pipeline_family(str(tmp_path)) == family


@pytest.mark.parametrize(
    "index, named",
    [
        ({"_class_name": "PixArtSigmaPipeline", "transformer": ["diffusers", "PixArtTransformer2DModel"]}, "PixArt"),
        (
            {"_class_name": "SomeDiTPipeline", "transformer": ["diffusers", "X"], "text_encoder_2": ["t", "Y"]},
            "SomeDiTPipeline pipeline without a UNet",
        ),
    ],
)
def test_untrained_families_are_refused_by_name(tmp_path, index, named):
    from sdpipe.models import loading

    (tmp_path / "model_index.json").write_text(json.dumps(index))
    trained = "sdpipe trains Flux.1 and SD 1.x/2.x and SD 3 / 3.5 and SDXL pipelines"
    with pytest.raises(UserError, match=re.escape(f"is a {named} model; {trained}")):
        loading.pipeline_family(str(tmp_path))


def test_sd_and_sdxl_folders_keep_their_family(tmp_path):
    from sdpipe.models import loading

    unet = {"unet": ["diffusers", "UNet2DConditionModel"], "text_encoder": ["transformers", "CLIPTextModel"]}
    cases = {
        "StableDiffusionPipeline": (unet, "sd"),
        "StableDiffusionXLPipeline": (unet, "sdxl"),
        "": ({**unet, "text_encoder_2": ["transformers", "CLIPTextModelWithProjection"]}, "sdxl"),
    }
    for cls, (parts, family) in cases.items():
        (tmp_path / "model_index.json").write_text(json.dumps({"_class_name": cls, **parts}))
        assert loading.pipeline_family(str(tmp_path)) == family


@pytest.mark.parametrize("preset", ["tiny", "tiny-sdxl"])
def test_a_family_caches_what_its_embedding_returns_and_is_known_by_its_unet(preset, tiny, tiny_xl):
    """The seam's facts agree with the models: the fields training reads back are those the text stack returns, and
    a UNet config alone names its family (the plan and sdpipe init's check use it)."""
    from sdpipe.models import families, presets

    folder = tiny if preset == "tiny" else tiny_xl
    family = families.from_denoiser_config(presets.unet_config(preset))
    assert family.name == presets.family(preset) == loading.pipeline_family(folder)
    assert tuple(loading.load_text_stack(folder).encode(CAPTIONS)) == family.text_fields
    assert [families.named(family.name).kohya_prefix(c) for c in family.text_encoders] == (
        ["lora_te_"] if family.name == "sd" else ["lora_te1_", "lora_te2_"]
    )
