"""GEGLU whose compiled backward computes GELU once per element.

diffusers' GEGLU projects to twice the width and splits: `hidden, gate = proj(x).chunk(2, -1)`, then
`hidden * gelu(gate)`. The gradient of that split is a `cat` of the two halves' gradients. On a GPU, inductor
lowers it as one "pointwise cat" kernel, which evaluates both halves' expressions for every output element and
keeps one: every element computes an erf twice, over twice the elements. In the SD 1.5 step at batch 128 on an
H200, those kernels took about 3 times their memory-bound time, 4.7 % of the step (benchmarks/NOTES.md v8).

SplitProjectionGEGLU projects with the two halves of the same weight as two linear layers, so no split and no cat
exist; inductor then writes both gradients from one kernel that shares the erf. Same parameter, same state-dict
keys, same values; it acts only while torch.compile traces, and only where `proj` is a plain nn.Linear (a LoRA
adapter on `proj` keeps diffusers' path, so its weights stay in the graph).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from diffusers.models.activations import GEGLU

from sdpipe.models.layout import swap_class


class SplitProjectionGEGLU(GEGLU):
    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not torch.compiler.is_compiling() or type(self.proj) is not torch.nn.Linear:
            return super().forward(hidden_states, *args, **kwargs)
        half = self.proj.out_features // 2
        weight, bias = self.proj.weight, self.proj.bias
        hidden = F.linear(hidden_states, weight[:half], None if bias is None else bias[:half])
        gate = F.linear(hidden_states, weight[half:], None if bias is None else bias[half:])
        return hidden * self.gelu(gate)


def use_split_geglu(model: torch.nn.Module) -> int:
    """Every diffusers GEGLU becomes a SplitProjectionGEGLU (in place); returns how many."""
    return swap_class(model, GEGLU, SplitProjectionGEGLU)
