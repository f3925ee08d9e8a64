"""ChannelStatGroupNorm computes nn.GroupNorm's function: values, dtypes and gradients, in both memory formats."""

import pytest
import torch

from sdpipe.models.layout import use_channel_stat_group_norm
from sdpipe.models.norms import ChannelStatGroupNorm, channel_stat_group_norm


def _inputs(dtype, channels_last):
    gen = torch.Generator().manual_seed(0)
    # An offset mean: the combination of per-channel statistics must not lose the variance to cancellation.
    x = (torch.randn(3, 64, 9, 7, generator=gen) * 2 + 5).to(dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    weight = torch.randn(64, generator=gen).requires_grad_()
    bias = torch.randn(64, generator=gen).requires_grad_()
    return x.requires_grad_(), weight, bias


@pytest.mark.parametrize("channels_last", [False, True])
def test_matches_group_norm_in_float32_with_gradients(channels_last):
    x, w, b = _inputs(torch.float32, channels_last)
    ours = channel_stat_group_norm(x, 16, w, b, 1e-5)
    ref = torch.nn.functional.group_norm(x, 16, w, b, 1e-5)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    g = torch.randn_like(ref)
    grads = torch.autograd.grad(ours, (x, w, b), g)
    ref_grads = torch.autograd.grad(ref, (x, w, b), g)
    for mine, theirs in zip(grads, ref_grads):
        torch.testing.assert_close(mine, theirs, rtol=1e-4, atol=1e-4)
    if channels_last:
        assert ours.is_contiguous(memory_format=torch.channels_last)


def test_bfloat16_input_gives_bfloat16_output_like_group_norm():
    x, w, b = _inputs(torch.bfloat16, True)
    ours = channel_stat_group_norm(x, 32, w, b, 1e-6)
    ref = torch.nn.functional.group_norm(x, 32, w.bfloat16(), b.bfloat16(), 1e-6)
    assert ours.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(ours.float(), ref.float(), rtol=2e-2, atol=2e-2)


def test_module_swap_keeps_parameters_and_takes_the_compiled_path():
    model = torch.nn.Sequential(torch.nn.Conv2d(3, 32, 3), torch.nn.GroupNorm(8, 32), torch.nn.SiLU())
    keys, params = list(model.state_dict()), list(model.parameters())
    assert use_channel_stat_group_norm(model) == 1
    assert isinstance(model[1], ChannelStatGroupNorm)
    assert list(model.state_dict()) == keys and list(model.parameters()) == params
    x = torch.randn(2, 3, 12, 12)
    eager = model(x)
    traced = {}

    def backend(gm, example_inputs):
        traced["ops"] = {str(n.target) for n in gm.graph.nodes}
        return gm.forward

    compiled = torch.compile(model, backend=backend)(x)
    torch.testing.assert_close(compiled, eager, rtol=1e-5, atol=1e-5)
    assert not any("group_norm" in op for op in traced["ops"]), traced["ops"]  # our reduction, not PyTorch's kernel
