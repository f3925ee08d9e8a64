"""Regional compilation (sdpipe.models.regions): blocks compile only inside the training step, once per distinct
block shape, and compute what the eager model computes."""

from __future__ import annotations

import torch
from torch._dynamo.testing import CompileCounter

from sdpipe.models import loading
from sdpipe.models.regions import CompiledRegions


def _unet_and_inputs(tiny_model):
    unet = loading.load_unet(str(tiny_model))
    torch.manual_seed(0)
    x = torch.randn(2, unet.config.in_channels, 8, 8)
    t = torch.tensor([10, 500])
    hidden = torch.randn(2, 77, unet.config.cross_attention_dim)
    return unet, (x, t), {"encoder_hidden_states": hidden}


def _first(out):
    return out[0] if isinstance(out, tuple) else getattr(out, "sample", out)


def _distinct_shapes(unet, args, kwargs) -> int:
    """(class, input shape, output shape) of every region block in one eager forward."""
    seen, hooks = set(), []
    for m in unet.modules():
        if type(m).__name__ in ("Transformer2DModel", "ResnetBlock2D"):
            hooks.append(
                m.register_forward_hook(
                    lambda mod, inp, out: seen.add((type(mod).__name__, tuple(inp[0].shape), tuple(_first(out).shape)))
                )
            )
    unet(*args, **kwargs)
    for h in hooks:
        h.remove()
    return len(seen)


def test_blocks_compile_once_per_shape_and_only_inside_the_step(tiny_model):
    torch._dynamo.reset()
    unet, args, kwargs = _unet_and_inputs(tiny_model)
    with torch.no_grad():
        eager = unet(*args, **kwargs).sample
        shapes = _distinct_shapes(unet, args, kwargs)
    counter = CompileCounter()
    regions = CompiledRegions(unet, backend=counter)
    assert len(regions.blocks) > shapes, "the tiny UNet repeats block shapes: reuse is what this test checks"
    forward = regions.wrap(unet)
    out = forward(*args, **kwargs).sample
    out.float().pow(2).mean().backward()
    assert counter.frame_count == shapes, (counter.frame_count, shapes)
    torch.testing.assert_close(out.detach(), eager, rtol=1e-5, atol=1e-5)
    forward(*args, **kwargs)
    assert counter.frame_count == shapes, "a second step compiles nothing"
    with torch.no_grad():
        unet(*args, **kwargs)  # outside the step: eager (validation, saving)
    assert counter.frame_count == shapes
    assert all(block._compiled_call_impl is None for block in regions.blocks)
    torch._dynamo.reset()
