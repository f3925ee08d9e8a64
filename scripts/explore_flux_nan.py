"""Flux on a GPU (benchmarks/NOTES.md v18): the tiny-flux template DAG's training went NaN on an H100 in bf16 and
the real-size flux-dev step probe hit a CUDA illegal memory access, while the same runs on the CPU (bf16 autocast
included) stay finite. This runs the tiny-flux transformer's forward and LoRA backward on one device in each
precision and attention backend and prints whether the outputs and gradients are finite.

    DEV=cuda python scripts/explore_flux_nan.py     (DEV=cpu for the CPU's answer)
"""

import os

import torch
from torch.nn.attention import SDPBackend, sdpa_kernel

from sdpipe import templates
from sdpipe.config import from_dict
from sdpipe.models import families, presets_flow
from sdpipe.train.models import add_lora, freeze_in

fam = families.named("flux")
cls = fam.denoiser_type()
dev = os.environ.get("DEV", "cuda")


def run(tag, m, autocast=True, backward=False):
    torch.manual_seed(0)
    lat = torch.randn(2, 16, 6, 10, device=dev)
    cond = {"t5": torch.randn(2, 512, 64, device=dev), "pooled": torch.randn(2, 32, device=dev)}
    t = torch.tensor([500.0, 900.0], device=dev)
    with torch.autocast(dev, dtype=torch.bfloat16, enabled=autocast):
        out = fam.predict(m, lat, t, cond)
    msg = [tag, str(out.dtype), bool(torch.isfinite(out).all()), float(out.detach().float().abs().max())]
    if backward:
        m.zero_grad(set_to_none=True)
        out.float().pow(2).mean().backward()
        g = {n: p.grad for n, p in m.named_parameters() if p.requires_grad and p.grad is not None}
        bad = [n for n, x in g.items() if not bool(torch.isfinite(x).all())]
        msg += [len(g), not bad, bad[:3]]
    print(*msg, flush=True)


def first_nonfinite_in_backward(m):
    """The first module, in backward order, whose input gradient is non-finite while its output gradient is
    finite: where the NaN or inf is born."""
    found = []

    def hook(mod, grad_in, grad_out):
        finite = lambda gs: all(g is None or bool(torch.isfinite(g).all()) for g in gs)  # noqa: E731
        if not found and finite(grad_out) and not finite(grad_in):
            found.append(f"{names[mod]} ({type(mod).__name__})")

    names = {mod: n for n, mod in m.named_modules()}
    handles = [mod.register_full_backward_hook(hook) for mod in names if not list(mod.children())]
    run("located", m, backward=True)
    print("first non-finite input gradient:", found or "none", flush=True)
    for h in handles:
        h.remove()


torch.manual_seed(0)
m = cls.from_config(presets_flow.denoiser_config("tiny-flux")).to(dev)
run("fp32 no-autocast", m, autocast=False)
run("fp32 autocast", m)
lora = from_dict(templates.settings("flux-lora")).train.lora
add_lora(m, lora)
freeze_in(m, "bf16")
run("lora bf16-base autocast", m, backward=True)
for be in ("MATH", "EFFICIENT_ATTENTION", "FLASH_ATTENTION", "CUDNN_ATTENTION"):  # cuDNN: H100s pick it
    try:
        with sdpa_kernel(getattr(SDPBackend, be)):
            run(be, m, backward=True)
    except Exception as e:
        print(be, "failed", type(e).__name__, str(e)[:100])
first_nonfinite_in_backward(m)
torch.manual_seed(0)
m32 = cls.from_config(presets_flow.denoiser_config("tiny-flux")).to(dev)
add_lora(m32, lora)
run("lora fp32-base autocast", m32, backward=True)
run("lora fp32-base no-autocast", m32, autocast=False, backward=True)
