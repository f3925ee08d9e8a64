"""The layers a model compiled on a GPU runs with: channels-last throughout.

Two swaps, each in place and each acting only while torch.compile traces:
- nn.GroupNorm becomes ChannelStatGroupNorm (sdpipe.models.norms: statistics per channel, fast on NHWC);
- nn.Conv2d becomes ChannelsLastInputConv2d. diffusers calls `.contiguous()` on a few convolution inputs: every
  Transformer2DModel's output before `proj_out`, every ResnetBlock2D's input before `conv_shortcut`, and
  Upsample2D's input at batch 64 or more. On a channels-last tensor that is a copy into NCHW order, and the traced
  graph then records those convolutions (and their backward) with NCHW inputs: 33 of SD 1.5's 98. cuDNN runs
  channels-last weights on NHWC data, so each cost a layout copy forward and backward, about 60 aten copies per
  training step at batch 64 on an H200, 4 % of the step (benchmarks/NOTES.md v4). ChannelsLastInputConv2d takes
  its input channels-last instead: the same values, and in a compiled graph a `.contiguous()` followed by this
  one is a single layout decision, not two copies.
Eager mode is left as diffusers wrote it.
"""

from __future__ import annotations

import torch

from sdpipe.models.norms import ChannelStatGroupNorm


class ChannelsLastInputConv2d(torch.nn.Conv2d):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling() and self.weight.is_contiguous(memory_format=torch.channels_last):
            x = x.contiguous(memory_format=torch.channels_last)
        return super().forward(x)


def swap_class(model: torch.nn.Module, base: type, replacement: type) -> int:
    """Make every module of exactly type `base` a `replacement` (in place: the same parameters, optimizer state
    and state-dict keys); return how many were changed."""
    changed = 0
    for module in model.modules():
        if type(module) is base:
            module.__class__ = replacement
            changed += 1
    return changed


def use_channels_last_conv_inputs(model: torch.nn.Module) -> int:
    """Every nn.Conv2d becomes a ChannelsLastInputConv2d; returns how many."""
    return swap_class(model, torch.nn.Conv2d, ChannelsLastInputConv2d)


def use_channel_stat_group_norm(model: torch.nn.Module) -> int:
    """Every nn.GroupNorm becomes a ChannelStatGroupNorm (sdpipe.models.norms); returns how many."""
    return swap_class(model, torch.nn.GroupNorm, ChannelStatGroupNorm)


def channels_last_for_compile(model: torch.nn.Module) -> torch.nn.Module:
    """What a model compiled on a GPU runs fastest with, measured one by one in benchmarks/NOTES.md: channels-last
    weights (cuDNN's fastest convolutions take NHWC), GroupNorm statistics per channel (fast reductions on NHWC)
    and convolution inputs kept NHWC. In place; returns `model`."""
    use_channel_stat_group_norm(model)
    use_channels_last_conv_inputs(model)
    return model.to(memory_format=torch.channels_last)
