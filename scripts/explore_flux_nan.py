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
        out.float().pow(2).mean().backward()
        g = [p.grad for p in m.parameters() if p.requires_grad and p.grad is not None]
        msg += [len(g), all(bool(torch.isfinite(x).all()) for x in g)]
    print(*msg, flush=True)


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
            run(be, m)
    except Exception as e:
        print(be, "failed", type(e).__name__, str(e)[:100])
