"""SplitProjectionGEGLU: the compiled backward has no cat of the two halves' gradients, and the module computes
what diffusers' GEGLU computes, gradients included."""

import torch
from diffusers.models.activations import GEGLU
from torch._dynamo.backends.common import aot_autograd

from sdpipe.models.geglu import SplitProjectionGEGLU, use_split_geglu


def _feed_forward():
    from diffusers.models.attention import FeedForward

    torch.manual_seed(0)
    return FeedForward(16, activation_fn="geglu")  # GEGLU(16 -> 2 x 64), then Linear(64 -> 16), as in SD's blocks


def _x():
    return torch.randn(2, 5, 16, generator=torch.Generator().manual_seed(1))


def _compiled_run(model, x) -> dict:
    """Compile `model` with a backend that records the ops of its forward and backward graphs; run it and its
    backward."""
    ops = {"fw": [], "bw": []}

    def recorder(tag):
        def compiler(gm, example_inputs):
            ops[tag] += [str(n.target) for n in gm.graph.nodes if n.op == "call_function"]
            return gm

        return compiler

    out = torch.compile(
        model, backend=aot_autograd(fw_compiler=recorder("fw"), bw_compiler=recorder("bw")), dynamic=False
    )(x)
    out.square().mean().backward()
    return {"out": out, **ops}


def _cats(ops: list[str]) -> int:
    return sum("aten.cat" in op for op in ops)


def test_diffusers_geglu_backward_concatenates_the_two_halves_gradients():
    traced = _compiled_run(_feed_forward(), _x())
    assert _cats(traced["bw"]) >= 1, "the premise: the gradient of chunk(2) is a cat"


def test_split_projection_geglu_has_no_cat_and_matches_eager():
    reference = _feed_forward()
    expected = reference(_x())
    expected.square().mean().backward()

    model = _feed_forward()
    assert use_split_geglu(model) == 1
    assert isinstance(model.net[0], SplitProjectionGEGLU)
    assert list(model.state_dict()) == list(reference.state_dict())
    traced = _compiled_run(model, _x())
    assert _cats(traced["bw"]) == 0, traced["bw"]
    torch.testing.assert_close(traced["out"], expected, rtol=1e-5, atol=1e-6)
    for (name, mine), ref in zip(model.named_parameters(), reference.parameters()):
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-6, msg=name)


def test_eager_mode_and_adapted_projections_keep_diffusers_path():
    geglu = GEGLU(4, 8)
    use_split_geglu(geglu)
    linears = []
    geglu.proj.register_forward_hook(lambda m, args, out: linears.append(out.shape[-1]))
    geglu(torch.randn(1, 3, 4))
    assert linears == [16], "eager: one projection to both halves, as diffusers wrote it"

    class Adapter(torch.nn.Linear):  # stands for a LoRA layer wrapped around proj
        pass

    adapted = GEGLU(4, 8)
    adapted.proj.__class__ = Adapter
    use_split_geglu(adapted)
    calls = []
    adapted.proj.register_forward_hook(lambda m, args, out: calls.append(1))
    torch.compile(adapted, backend="eager")(torch.randn(1, 3, 4))
    assert calls == [1], "compiled with an adapter on proj: the adapter module itself still runs"
