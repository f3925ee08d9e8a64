"""LoHa and LoKr (train.lora.type): the peft adapter training saves, its LyCORIS export, and that file read back the
way ComfyUI reads it give one and the same model."""

from __future__ import annotations

import pytest
import torch

from sdpipe import config
from sdpipe.export import lycoris


def _trained_adapter(tiny_model, folder, kind: str, alpha: float = 2.0):
    dora = kind == "dora"
    kind = "lora" if dora else kind
    """A tiny UNet with `kind` adapters whose every tensor moved from its initial value (an adapter at
    initialisation is the identity, which would hide a wrong scale), saved as training saves it."""
    from diffusers import UNet2DConditionModel

    from sdpipe.train.models import _save_weights, add_lora

    unet = UNet2DConditionModel.from_pretrained(tiny_model / "unet")
    cfg = config.from_dict({"train": {"mode": "lora", "lora": {"type": kind, "dora": dora, "rank": 4, "alpha": alpha}}})
    add_lora(unet, cfg.train.lora)
    gen = torch.Generator().manual_seed(0)
    for p in unet.parameters():
        if p.requires_grad:
            p.data += 0.05 * torch.randn(p.shape, generator=gen)
    _save_weights({"unet": unet}, {"unet": "lora"}, folder, "sd")
    return folder


def _unet_out(pipe) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    sample = torch.randn(1, pipe.unet.config.in_channels, 8, 8, generator=gen)
    hidden = torch.randn(1, 7, pipe.unet.config.cross_attention_dim, generator=gen)
    with torch.no_grad():
        return pipe.unet(sample, 500, encoder_hidden_states=hidden).sample


FILE_TENSOR = {"loha": "hada_w1_a", "lokr": "lokr_w2_a", "dora": "dora_scale"}


@pytest.mark.parametrize("kind", ["loha", "lokr", "dora"])
def test_the_exported_file_read_as_comfyui_reads_it_is_the_trained_model(tiny_model, tmp_path, kind):
    from diffusers import StableDiffusionPipeline
    from safetensors.torch import load_file

    from sdpipe.export.lora import export_kohya, read_lora
    from sdpipe.export.verify import load_adapter

    folder = _trained_adapter(tiny_model, tmp_path / "final", kind)
    state, _ = read_lora(folder)
    assert lycoris.kind_of(state) == (None if kind == "dora" else kind)
    exported = export_kohya(folder, tmp_path / "lora_kohya.safetensors", tiny_model)
    file = load_file(str(exported))
    assert all(k.startswith("lora_unet_") for k in file), "kohya's layer names"
    assert any(k.endswith(FILE_TENSOR[kind]) for k in file)

    trained = StableDiffusionPipeline.from_pretrained(tiny_model)
    load_adapter(trained, folder, fuse=False)  # as export verification loads the trained adapter
    assert lycoris.adapter_layers(trained) > 0
    reference = _unet_out(trained)
    base = StableDiffusionPipeline.from_pretrained(tiny_model)
    plain = _unet_out(base)
    assert lycoris.merge_file(base, exported, "sd") == len({k.partition(".")[0] for k in file})
    merged = _unet_out(base)
    assert (reference - plain).abs().max() > 1e-3, "the adapter changes the model"
    torch.testing.assert_close(merged, reference, rtol=1e-4, atol=1e-5)

    fused = StableDiffusionPipeline.from_pretrained(tiny_model)
    load_adapter(fused, folder, fuse=True)  # the diffusers folder's weights: the same model, no adapter layers
    assert lycoris.adapter_layers(fused) == 0
    torch.testing.assert_close(_unet_out(fused), reference, rtol=1e-4, atol=1e-5)


def test_a_lokr_of_whole_factors_carries_its_scale_in_w1():
    """ComfyUI applies alpha / rank only to a factor stored as a low-rank product; peft scales every LoKr by
    alpha / r. A layer whose factors peft keeps whole therefore gets alpha / r folded into w1 and no alpha."""
    w1, w2 = torch.randn(2, 2), torch.randn(3, 5)
    peft_delta = torch.kron(w1, w2) * (4.0 / 8)
    state = {
        "unet.down_blocks.0.attentions.0.proj_in.lokr_w1": w1,
        "unet.down_blocks.0.attentions.0.proj_in.lokr_w2": w2,
    }
    file = lycoris.lycoris_state_dict(state, {"unet": {"r": 8, "alpha": 4.0}}, "sd")
    name = "lora_unet_down_blocks_0_attentions_0_proj_in"
    assert f"{name}.alpha" not in file
    torch.testing.assert_close(lycoris.delta({k.partition(".")[2]: v for k, v in file.items()}, None), peft_delta)


def test_loha_formula_against_a_hand_computed_case():
    ones = torch.ones(1, 1)
    tensors = {"hada_w1_a": 2 * ones, "hada_w1_b": 3 * ones, "hada_w2_a": 5 * ones, "hada_w2_b": 7 * ones}
    assert lycoris.delta(tensors, alpha=0.5).item() == pytest.approx(2 * 3 * 5 * 7 * 0.5)  # rank 1


def test_dora_only_with_lora_and_unknown_adapters_fail_in_one_line():
    from sdpipe.errors import UserError

    with pytest.raises(UserError, match="train.lora.type = 'lycoris' is not allowed"):
        config.from_dict({"train": {"lora": {"type": "lycoris"}}})
    with pytest.raises(UserError, match="train.lora.dora = true with train.lora.type = loha"):
        config.from_dict({"train": {"lora": {"type": "loha", "dora": True}}})


def test_comfyuis_dora_reading_of_the_exported_scale_gives_peft_s_layer():
    """peft: m * (W + dW) / ||W + dW|| per output row; ComfyUI divides by ||W|| instead, so the file's scale is
    m * ||W|| / ||W + dW||."""
    from sdpipe.export import dora

    gen = torch.Generator().manual_seed(0)
    w, dw, m = torch.randn(6, 4, generator=gen), 0.3 * torch.randn(6, 4, generator=gen), torch.rand(6, generator=gen)
    peft_layer = m[:, None] * (w + dw) / (w + dw).norm(dim=1, keepdim=True)
    torch.testing.assert_close(dora.comfyui_apply(w, dw, dora.comfyui_scale(m, w, dw)), peft_layer)
