"""GroupNorm that torch.compile turns into fast kernels on channels-last tensors.

Inductor lowers `nn.GroupNorm` by viewing an (N, C, H, W) tensor as (N, groups, C/groups * H * W) and reducing the
last axis. In channels-last memory that axis is not contiguous (a group's few channels repeat every C elements), so
the reduction reads memory in short strided pieces: on an H200 the SD 1.5 VAE encoder spent about 35 % of its time
in GroupNorm kernels (benchmarks/NOTES.md v3). Here the statistics are taken per channel first, a reduction over
H * W that reads whole channel rows of channels-last memory, and then combined per group exactly (the mean of the
channel variances plus the variance of the channel means). Same parameters, same state dict, same results to
float32 rounding. Eager mode keeps PyTorch's own kernel, which is the faster one there for training.

Sampling is different: in eager half precision on an H200 PyTorch's GroupNorm took 30 % of SD 1.5's UNet time,
25 % in its row-moments kernel alone (benchmarks/NOTES.md v13). SamplingGroupNorm takes the statistics with two
plain reductions over H * W (sum and sum of squares, accumulated in float32 without a float32 copy of the input)
and applies them in one fused multiply-add, only for float16 CUDA inputs without gradients (bfloat16's 8-bit
mantissa would round the folded shift too coarsely).
"""

from __future__ import annotations

import torch


class ChannelStatGroupNorm(torch.nn.GroupNorm):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not torch.compiler.is_compiling() or x.dim() < 3:
            return super().forward(x)
        return channel_stat_group_norm(x, self.num_groups, self.weight, self.bias, self.eps)


def channel_stat_group_norm(x: torch.Tensor, groups: int, weight, bias, eps: float) -> torch.Tensor:
    n, c = x.shape[:2]
    xf = x.float()  # what PyTorch's kernel accumulates in; autocast runs group_norm in float32 too
    var_c, mean_c = torch.var_mean(xf, dim=tuple(range(2, x.dim())), correction=0)
    mean_c, var_c = mean_c.view(n, groups, -1), var_c.view(n, groups, -1)
    mean_g = mean_c.mean(-1, keepdim=True)
    var_g = var_c.mean(-1, keepdim=True) + (mean_c - mean_g).square().mean(-1, keepdim=True)
    scale = torch.rsqrt(var_g + eps).expand_as(mean_c).reshape(n, c)
    shift = -mean_g.expand_as(mean_c).reshape(n, c) * scale
    if weight is not None:
        scale, shift = scale * weight.float(), shift * weight.float() + bias.float()
    shape = (n, c) + (1,) * (x.dim() - 2)
    out = xf * scale.view(shape) + shift.view(shape)
    # Under autocast PyTorch's group_norm returns float32; outside it, the input's dtype.
    return out if torch.is_autocast_enabled(x.device.type) else out.to(x.dtype)


class SamplingGroupNorm(torch.nn.GroupNorm):
    """nn.GroupNorm that samples faster on a GPU in float16 (see the module docstring); the same parameters and
    state dict, and PyTorch's own kernel everywhere else (training, bfloat16, float32, CPU)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.is_cuda and x.dtype == torch.float16 and not torch.is_grad_enabled() and x.dim() > 2:
            return half_group_norm(x, self.num_groups, self.weight, self.bias, self.eps)
        return super().forward(x)


def half_group_norm(x: torch.Tensor, groups: int, weight, bias, eps: float) -> torch.Tensor:
    """GroupNorm of a float16 `x` from per-channel sums in float32: E[x^2] - E[x]^2, which cancels only where a
    channel's mean is hundreds of times its spread, and then loses less than the input's own 11-bit mantissa already
    has. The scale and shift are folded per channel and rounded to float16 before the one multiply-add."""
    n, c = x.shape[:2]
    dims = tuple(range(2, x.dim()))
    count = x[0, 0].numel()
    mean_c = torch.mean(x, dims, dtype=torch.float32).view(n, groups, -1)
    square_c = torch.linalg.vector_norm(x, 2, dims, dtype=torch.float32).square().div_(count).view(n, groups, -1)
    mean_g = mean_c.mean(-1, keepdim=True)
    var_g = (square_c.mean(-1, keepdim=True) - mean_g.square()).clamp_min_(0)
    scale = torch.rsqrt(var_g + eps).expand_as(mean_c).reshape(n, c)
    shift = -mean_g.expand_as(mean_c).reshape(n, c) * scale
    if weight is not None:
        scale, shift = scale * weight.float(), shift * weight.float() + bias.float()
    shape = (n, c) + (1,) * (x.dim() - 2)
    return torch.addcmul(shift.to(x.dtype).view(shape), x, scale.to(x.dtype).view(shape))
