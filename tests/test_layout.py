"""The channels-last layers: a compiled diffusers block traces every convolution with NHWC inputs, and computes
what the block computes eagerly."""

import torch
from torch._dynamo.backends.common import aot_autograd

from sdpipe.models.layout import ChannelsLastInputConv2d, channels_last_for_compile, use_channels_last_conv_inputs


def _resnet_block():
    from diffusers.models.resnet import ResnetBlock2D

    torch.manual_seed(0)
    # in != out channels: diffusers then calls `.contiguous()` on the input before its 1x1 conv_shortcut.
    return ResnetBlock2D(in_channels=8, out_channels=16, temb_channels=None, groups=4)


def _conv_inputs_in_traced_graphs(model, x) -> dict:
    """Compile `model` with a backend that records, for each convolution of the forward and backward graphs,
    whether all of its tensor inputs are channels-last; then run it, backward included."""
    seen = {"fw": [], "bw": []}

    def recorder(tag):
        def compiler(gm, example_inputs):
            for node in gm.graph.nodes:
                if node.op == "call_function" and "convolution" in str(node.target):
                    vals = [a.meta["val"] for a in node.args[:3] if isinstance(a, torch.fx.Node)]
                    seen[tag].append(
                        all(v.is_contiguous(memory_format=torch.channels_last) for v in vals if v.dim() == 4)
                    )  # not the bias
            return gm

        return compiler

    backend = aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw"))
    out = torch.compile(model, backend=backend, dynamic=False)(x, None)
    out.square().mean().backward()
    return {"out": out, **seen}


def _channels_last_input():
    return torch.randn(2, 8, 6, 6, generator=torch.Generator().manual_seed(1)).contiguous(
        memory_format=torch.channels_last
    )


def test_diffusers_contiguous_call_makes_an_nchw_convolution_input_without_the_swap():
    block = _resnet_block().to(memory_format=torch.channels_last)
    traced = _conv_inputs_in_traced_graphs(block, _channels_last_input())
    assert not all(traced["fw"]), "the premise: conv_shortcut's input is NCHW in the traced graph"


def test_with_the_swap_every_traced_convolution_takes_channels_last_inputs_and_values_match():
    eager_block = _resnet_block()
    x = _channels_last_input()
    expected = eager_block(x, None)
    block = _resnet_block()
    assert use_channels_last_conv_inputs(block) == 3  # conv1, conv2, conv_shortcut
    assert isinstance(block.conv_shortcut, ChannelsLastInputConv2d)
    assert list(block.state_dict()) == list(eager_block.state_dict())
    block = block.to(memory_format=torch.channels_last)
    traced = _conv_inputs_in_traced_graphs(block, x)
    assert traced["fw"] and all(traced["fw"]), traced["fw"]
    torch.testing.assert_close(traced["out"], expected, rtol=1e-5, atol=1e-5)
    expected.square().mean().backward()
    for mine, ref in zip(block.parameters(), eager_block.parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-4, atol=1e-5)


def test_eager_mode_keeps_the_input_layout():
    conv = torch.nn.Conv2d(4, 4, 1)
    use_channels_last_conv_inputs(conv)
    conv.to(memory_format=torch.channels_last)
    seen = []
    conv.register_forward_pre_hook(lambda m, args: seen.append(args[0].is_contiguous()))
    conv(torch.randn(1, 4, 3, 3))
    assert seen == [True]


def test_channels_last_for_compile_swaps_both_layer_kinds_and_the_weights():
    from sdpipe.models.norms import ChannelStatGroupNorm

    block = channels_last_for_compile(_resnet_block())
    assert isinstance(block.norm1, ChannelStatGroupNorm) and isinstance(block.conv1, ChannelsLastInputConv2d)
    assert block.conv1.weight.is_contiguous(memory_format=torch.channels_last)
