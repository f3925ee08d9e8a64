"""What a cold start costs on this GPU, and how fast sampling and export verification run: a research tool for
issue 24 (findings in benchmarks/NOTES.md v12). The benchmark of record is `sdpipe bench-dag`.

    python scripts/explore_startup.py train --preset sd15 --batch 32 --variant eager --variant blocks
    python scripts/explore_startup.py sample --model /tmp/sd15 --images 64
    python scripts/explore_startup.py export --model /tmp/sd15

`train` runs each variant in a fresh process with an empty compile cache: the seconds from the process's start to
the end of its first optimizer step (imports, model, compile, the step), then the steady rate after warm-up, on
random data already on the GPU. `sample` renders the same images with each sampling setting. `export` verifies a
random LoRA on the model through the export stage itself, on the GPU.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

STARTED = time.time()


def train_variant(preset: str, batch: int, variant: str, steps: int) -> dict:
    import torch

    from sdpipe.bench.baseline import build_unet, random_cond
    from sdpipe.models import presets
    from sdpipe.models.regions import compile_regions
    from sdpipe.train.models import prepare_for_gpu_compile
    from sdpipe.train.telemetry import compile_seconds

    device = torch.device("cuda")
    unet = build_unet(preset, device)
    if variant != "eager":
        cfg = argparse.Namespace(train=argparse.Namespace(compile="compiled"))
        prepare_for_gpu_compile(cfg, unet, device)
    forward = {
        "eager": unet,
        "whole": torch.compile(unet) if variant == "whole" else None,
        "blocks": compile_regions(unet) if variant == "blocks" else None,
        "blocks-dynamic": compile_regions(unet, dynamic=None) if variant == "blocks-dynamic" else None,
    }[variant]
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
    scheduler = presets.scheduler(preset)
    data = random_cond(preset, 512 if preset == "sd15" else 1024, batch, device, torch.Generator().manual_seed(0))

    def step():
        noise = torch.randn_like(data["latents"])
        t = torch.randint(0, 1000, (batch,), device=device)
        noisy = scheduler.add_noise(data["latents"], noise, t)
        added = {"text_embeds": data["pooled"], "time_ids": data["time_ids"]} if "pooled" in data else None
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = forward(noisy, t, encoder_hidden_states=data["hidden"], added_cond_kwargs=added).sample
        torch.nn.functional.mse_loss(pred.float(), noise.float()).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    torch.cuda.synchronize()
    first = time.time() - STARTED
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    rate = batch * steps / (time.perf_counter() - start)
    return {
        "variant": variant,
        "batch": batch,
        "first_step_s": round(first, 1),
        "compile_s": compile_seconds(),
        "samples_per_s": round(rate, 1),
        "peak_gib": round(torch.cuda.max_memory_allocated() / 2**30, 1),
    }


def train(args) -> None:
    """Each variant in its own process, each with an empty inductor and triton cache."""
    for variant in args.variant:
        cache = tempfile.mkdtemp(prefix=f"compile-{variant}-")
        env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": f"{cache}/inductor", "TRITON_CACHE_DIR": f"{cache}/triton"}
        cmd = [
            sys.executable,
            __file__,
            "train-one",
            "--preset",
            args.preset,
            "--batch",
            str(args.batch),
            "--variant",
            variant,
            "--steps",
            str(args.steps),
        ]
        start = time.perf_counter()
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.timeout)
        line = proc.stdout.strip().splitlines()[-1] if proc.returncode == 0 else proc.stderr[-2000:]
        print(f"train {variant}: {line} (process wall {time.perf_counter() - start:.1f} s)", flush=True)


def sample(args) -> None:
    from sdpipe.generate import generate_worker

    prompts = ["a photo of a red balloon over a lake", "a watercolour painting of a lighthouse"]
    for spec in args.setting:
        speed, batch, compile_mode = spec.split(":")
        out = tempfile.mkdtemp(prefix="samples-")
        jobs = [{"prompt": prompts[i % 2], "seed": i, "file": f"{out}/{i:03d}.png"} for i in range(args.images)]
        settings = {
            "pretrained": args.model,
            "revision": None,
            "variant": None,
            "height": 512,
            "width": 512,
            "steps": 20,
            "guidance": 5.0,
            "batch_size": int(batch),
            "half_on_gpu": True,
            "compile": compile_mode,
        }
        if speed == "plain":  # as before issue 24: no speed-ups, the first batch timed with the rest
            import sdpipe.generate as g

            keep, g.prepare_sampler = g.prepare_sampler, lambda *a, **k: None
        result = generate_worker("cuda:0", jobs, lambda n=1: None, settings)
        if speed == "plain":
            g.prepare_sampler = keep
        rate = len(jobs) / result["seconds"]
        print(
            f"sample {spec}: {rate:.2f} images/s after warm-up; load {result['load_s']:.1f} s, warm-up "
            f"{result['warmup_s']:.1f} s, {len(jobs)} images in {result['seconds']:.1f} s",
            flush=True,
        )


def export(args) -> None:
    """A random LoRA (non-zero up-projections, as after training) saved as training saves it, then the export
    stage with verification on the GPU."""
    import torch
    from accelerate import Accelerator

    from sdpipe import config
    from sdpipe.stages import export as stage
    from sdpipe.train.models import build_unet, save_final

    work = tempfile.mkdtemp(prefix="export-")
    cfg = config.from_dict(
        {
            "model": {"pretrained": args.model, "build_preset": None, "train_vae": {"enabled": False}},
            "prepare": {"buckets": {"resolution": args.resolution, "step": 8}},
            "train": {"mode": "lora", "text_encoder": {"mode": "none"}},
        }
    )
    unet = build_unet(cfg, "cpu")
    torch.manual_seed(0)
    for name, p in unet.named_parameters():
        if "lora_B" in name:
            p.data.normal_(0, 0.01)
    start = time.perf_counter()
    save_final(
        Accelerator(cpu=True),
        {"unet": unet},
        {"unet": "lora"},
        f"{work}/final",
        None,
        {"base": args.model, "family": "sd", "prediction_type": "epsilon", "optimizer_steps": 1},
    )
    saved = time.perf_counter()
    summary = stage.run(cfg, {"final": f"{work}/final"}, {"out": f"{work}/export", "summary": f"{work}/summary.json"})
    print(
        f"export: {time.perf_counter() - saved:.1f} s (final saved in {saved - start:.1f} s); "
        + json.dumps(
            {k: {x: v[x] for x in ("verified", "mean_abs_diff", "max_abs_diff")} for k, v in summary["formats"].items()}
        ),
        flush=True,
    )


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("part", choices=["train", "train-one", "sample", "export"])
    p.add_argument("--preset", default="sd15")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--variant", action="append", default=[])
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--timeout", type=int, default=300)
    p.add_argument("--model")
    p.add_argument("--images", type=int, default=64)
    p.add_argument("--resolution", type=int, default=512)
    p.add_argument("--setting", action="append", default=[], help="plain|fast:batch:eager|blocks")
    args = p.parse_args()
    if args.part == "train-one":
        print(json.dumps(train_variant(args.preset, args.batch, args.variant[0], args.steps)), flush=True)
    else:
        {"train": train, "sample": sample, "export": export}[args.part](args)


if __name__ == "__main__":
    main()
