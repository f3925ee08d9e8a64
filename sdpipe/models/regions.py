"""Regional compilation: each of a model's repeated blocks compiled on its own, not the whole model at once.

A whole SD 1.5 UNet compiled for training took 251 s cold on an H200 before its first optimizer step (issue 24):
one graph of the full forward and backward. Its blocks are few kinds repeated at a few sizes (SD 1.5: 4
attention blocks and 14 resnet blocks of distinct shape), and each compiles as a small graph; blocks of one class
and one shape share their compiled code (torch.compile specialises on the module's code and its tensors' shapes,
not on which instance it is). The parts between blocks (time embedding, conv_in/out, up/downsamplers) run eagerly.

Compiled code runs only inside `with regions:`. The training step enters it; validation grids and saving call the
same modules outside it, eagerly, so sampling in inference mode compiles nothing.
"""

from __future__ import annotations

from typing import Callable

import torch

# The blocks that hold nearly all of a UNet's arithmetic: attention (norm, projections, attention, feed-forward)
# and resnet (norms, activations, convolutions) blocks.
REGION_CLASSES = ("Transformer2DModel", "ResnetBlock2D")


class CompiledRegions:
    """torch.compile each module of `model` whose class name is in `classes`, switched on only inside `with`."""

    def __init__(
        self,
        model: torch.nn.Module,
        classes: tuple[str, ...] = REGION_CLASSES,
        dynamic: bool = False,
        backend="inductor",
    ):
        self.blocks = [m for m in model.modules() if type(m).__name__ in classes]
        if not self.blocks:
            raise ValueError(f"no module of {classes} in {type(model).__name__}")
        # One cache entry per distinct block shape (static shapes: no symbolic sizes in the kernels). The default
        # limit (8 per code object) would send the remaining shapes back to eager without a word.
        shapes = len(self.blocks)
        dynamo = torch._dynamo.config
        for key in ("recompile_limit", "cache_size_limit"):  # the name changed across torch releases
            if hasattr(dynamo, key):
                setattr(dynamo, key, max(getattr(dynamo, key), shapes))
        self.compiled = [torch.compile(block._call_impl, dynamic=dynamic, backend=backend) for block in self.blocks]
        self._depth = 0

    def enable(self) -> None:
        # nn.Module.__call__ runs _compiled_call_impl when it is set: what Module.compile() sets, switched here.
        for block, compiled in zip(self.blocks, self.compiled):
            block._compiled_call_impl = compiled

    def disable(self) -> None:
        for block in self.blocks:
            block._compiled_call_impl = None

    def __enter__(self) -> "CompiledRegions":
        if self._depth == 0:
            self.enable()
        self._depth += 1
        return self

    def __exit__(self, *exc) -> None:
        self._depth -= 1
        if self._depth == 0:
            self.disable()

    def wrap(self, model: Callable) -> Callable:
        """`model` called with its regions compiled: what the training step calls instead of the model."""

        def forward(*args, **kwargs):
            with self:
                return model(*args, **kwargs)

        forward.regions = self  # type: ignore[attr-defined]  # the compiled regions, for telemetry
        return forward


def compile_regions(model: torch.nn.Module, dynamic: bool = False) -> Callable:
    """The training step's callable for `model` with its blocks compiled (see the module docstring)."""
    return CompiledRegions(model, dynamic=dynamic).wrap(model)
