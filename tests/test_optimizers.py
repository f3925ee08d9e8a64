"""train.optimizer: each optimizer trains (a toy regression's loss falls), 8-bit AdamW keeps a fraction of AdamW's
state (bytes measured), and a missing library stops the config check in one line."""

from __future__ import annotations

import importlib.util

import pytest
import torch

from sdpipe import config
from sdpipe.errors import UserError
from sdpipe.train import optimizers
from sdpipe.train.models import build_optimizer


def _train(name: str) -> config.TrainConfig:
    lr = 1.0 if name == "prodigy" else 1e-2  # Prodigy's learning rate is a multiplier of the step it finds
    return config.from_dict({"train": {"optimizer": name, "learning_rate": lr, "adam_weight_decay": 0.0}}).train


@pytest.mark.parametrize("name", sorted(optimizers.BUILDERS))
def test_each_optimizer_reduces_a_regression_loss(name):
    torch.manual_seed(0)
    x, true = torch.randn(256, 16), torch.randn(16, 4)
    y = x @ true
    layer = torch.nn.Linear(16, 4, bias=False)
    opt = optimizers.build([{"params": list(layer.parameters())}], _train(name))
    first = None
    for _ in range(200):
        loss = (layer(x) - y).pow(2).mean()
        first = first if first is not None else float(loss.detach())
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert float(loss) < 0.5 * first, f"{name}: {first:.3f} -> {float(loss):.3f}"


def test_8bit_adamw_keeps_a_quarter_of_adamws_state(tiny_model):
    """The tiny UNet, fully trained: bitsandbytes keeps tensors under 4,096 values in 32 bits, which is nearly all
    of the tiny LoRA's (an SDXL LoRA's rank-16 matrices have 10,240 and more)."""
    from sdpipe.models import loading

    sizes = {}
    for name in ("adamw", "adamw_8bit"):
        cfg = config.from_dict({"train": {"mode": "full", "optimizer": name}})
        unet = loading.load_unet(str(tiny_model))
        unet.requires_grad_(True)
        opt = build_optimizer(cfg, unet, [])
        for p in unet.parameters():
            if p.requires_grad:
                p.grad = torch.randn_like(p)
        opt.step()
        sizes[name] = optimizers.state_bytes(opt)
    # two fp32 moments (8 bytes a weight) against two uint8 ones plus a float scale per block of 256 or less
    assert sizes["adamw_8bit"] < 0.35 * sizes["adamw"], sizes


def test_a_missing_library_stops_the_config_check_in_one_line(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "prodigyopt" else real(name, *a))
    with pytest.raises(
        UserError, match=r"train.optimizer = prodigy needs prodigyopt.*pip install 'sdpipe\[optimizers\]'"
    ):
        optimizers.check_available("prodigy")
    with pytest.raises(UserError, match="train.optimizer = 'lion' is not allowed"):
        config.from_dict({"train": {"optimizer": "lion"}})


def test_schedule_free_is_used_at_its_averaged_weights():
    """Schedule-free AdamW trains at one point and is used at the average of its iterates: eval_weights swaps the
    average in (for validation, the held-out loss, checkpoints and the saved model) and the training point back."""
    torch.manual_seed(0)
    layer = torch.nn.Linear(8, 2)
    opt = optimizers.build([{"params": list(layer.parameters())}], _train("adamw_schedulefree"))
    for _ in range(5):
        opt.zero_grad()
        layer(torch.randn(16, 8)).pow(2).mean().backward()
        opt.step()
    point = layer.weight.detach().clone()
    with optimizers.eval_weights(opt, when=False):
        assert torch.equal(layer.weight, point), "no swap on a step where nothing is due"
    with optimizers.eval_weights(opt):
        average = layer.weight.detach().clone()
    assert not torch.allclose(average, point)
    torch.testing.assert_close(layer.weight.detach(), point)  # back at the training point
    with optimizers.eval_weights(torch.optim.AdamW(layer.parameters())):  # one set of weights: nothing to swap
        torch.testing.assert_close(layer.weight.detach(), point)


def test_schedule_free_needs_a_constant_schedule():
    with pytest.raises(UserError, match="adamw_schedulefree with train.lr_scheduler = cosine"):
        config.from_dict({"train": {"optimizer": "adamw_schedulefree", "lr_scheduler": "cosine"}})
