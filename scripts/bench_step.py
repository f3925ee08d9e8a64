"""Training-step throughput on one GPU: sdpipe's `train` stage against the plain diffusers-example loop, same run.

Rows:
- baseline: the loop of diffusers' train_text_to_image.py on random latents and text states already on the GPU
  (fp32 master weights under bf16 autocast, AdamW with foreach, eager, default SDPA attention). Its data costs
  nothing, which flatters it.
- sdpipe: `sdpipe train` (the command the Snakemake rule runs) on a latent cache that `sdpipe latents` wrote from
  the demo images at the preset's resolution; samples/s is the stage's own last metrics window.
Also: model FLOPs per sample (torch.utils.flop_counter on the eager model, forward + backward), the bf16 matmul
peak measured here, MFU, peak memory. Results: benchmarks/results/step-<preset>.json and .md, printed last.

    python scripts/bench_step.py --preset sd15 --batch 32 --steps 40
"""

from __future__ import annotations

import argparse
import csv
import json
import platform
import shutil
import time
from pathlib import Path

import torch
import yaml

from bench_latents import run_case, sdpipe

SHAPES = {"sd15": dict(resolution=512, latent=64, context=(77, 768)),
          "sdxl": dict(resolution=1024, latent=128, context=(77, 2048))}


def matmul_peak(n: int = 8192, reps: int = 20) -> float:
    """bf16 dense matmul TFLOP/s on this GPU, measured now (the MFU denominator)."""
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def random_batch(preset: str, batch: int) -> dict:
    s = SHAPES[preset]
    out = {"latents": torch.randn(batch, 4, s["latent"], s["latent"], device="cuda"),
           "hidden": torch.randn(batch, *s["context"], device="cuda")}
    if preset == "sdxl":
        out["added"] = {"text_embeds": torch.randn(batch, 1280, device="cuda"),
                        "time_ids": torch.tensor([[1024, 1024, 0, 0, 1024, 1024]] * batch, device="cuda",
                                                 dtype=torch.float32)}
    return out


def baseline_unet(preset: str):
    from diffusers import UNet2DConditionModel

    from sdpipe.models import presets

    torch.manual_seed(0)
    return UNet2DConditionModel(**presets.unet_config(preset)).cuda().train()


def baseline_step(unet, optimizer, batch: dict) -> torch.Tensor:
    """One step of the diffusers text-to-image example: epsilon target, MSE, bf16 autocast."""
    noise = torch.randn_like(batch["latents"])
    t = torch.randint(0, 1000, (len(noise),), device="cuda")
    noisy = batch["latents"] + noise  # the scheduler's scaling costs nothing next to the UNet
    with torch.autocast("cuda", dtype=torch.bfloat16):
        pred = unet(noisy, t, encoder_hidden_states=batch["hidden"], added_cond_kwargs=batch.get("added")).sample
    loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
    loss.backward()
    torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    return loss


def flops_per_sample(unet, preset: str) -> float:
    from torch.utils.flop_counter import FlopCounterMode

    batch = random_batch(preset, 2)
    with FlopCounterMode(display=False) as counter:
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(batch["latents"], torch.tensor([10, 500], device="cuda"),
                        encoder_hidden_states=batch["hidden"], added_cond_kwargs=batch.get("added")).sample
        pred.float().pow(2).mean().backward()
    unet.zero_grad(set_to_none=True)
    return counter.get_total_flops() / 2


def run_baseline(preset: str, batch: int, steps: int, warmup: int) -> dict:
    unet = baseline_unet(preset)
    flops = flops_per_sample(unet, preset)
    optimizer = torch.optim.AdamW(unet.parameters(), lr=1e-5, foreach=True)
    data = random_batch(preset, batch)
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(warmup):
        baseline_step(unet, optimizer, data)
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(steps):
        baseline_step(unet, optimizer, data)
    torch.cuda.synchronize()
    seconds = time.perf_counter() - start
    row = {"name": "baseline (diffusers example loop, eager)", "samples_per_s": batch * steps / seconds,
           "warmup_s": warm, "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30}
    del unet, optimizer
    torch.cuda.empty_cache()
    return row, flops


def run_sdpipe(work: Path, preset: str, batch: int, steps: int, mixed: str) -> dict:
    """`sdpipe train` on the demo latents cached at the preset's resolution."""
    case = (preset, SHAPES[preset]["resolution"], "bf16", 16, 0)
    run_case(work, case, "auto")
    base = yaml.safe_load((work / ("-".join(map(str, case)) + ".yaml")).read_text())
    base["train"] = {"mode": "full", "mixed_precision": mixed, "per_device_batch_size": batch, "max_steps": steps,
                     "log_every": 10, "lr_warmup_steps": 0, "checkpoint_every": 10**6, "resume": None,
                     "num_processes": 1, "validation": {"every": 0}}
    cfg, out = work / f"train-{preset}.yaml", work / f"train-{preset}"
    cfg.write_text(yaml.safe_dump(base))
    shutil.rmtree(out, ignore_errors=True)
    start = time.perf_counter()
    sdpipe("train", "--config", str(cfg), "--index", str(work / f"out-{'-'.join(map(str, case))}" / "index.json"),
           "--out", str(out), "--summary", str(out / "summary.json"))
    wall = time.perf_counter() - start
    with open(out / "metrics.csv") as f:
        last = list(csv.DictReader(f))[-1]
    return {"name": f"sdpipe train ({mixed}, last {base['train']['log_every']} steps)",
            "samples_per_s": float(last["samples_per_s"]), "warmup_s": None, "stage_wall_s": wall,
            "peak_memory_gib": float(last["peak_memory_mb"]) / 1024, "data_wait": last["data_wait"]}


def provenance() -> dict:
    import diffusers

    from sdpipe.doctor import gpu_facts

    props = torch.cuda.get_device_properties(0)
    return {"gpu": props.name, "driver": gpu_facts().get("driver"), "torch": torch.__version__, "cuda": torch.version.cuda, "diffusers": diffusers.__version__,
            "python": platform.python_version()}


def write(rows: list[dict], meta: dict, out: Path) -> str:
    head = (f"{meta['preset']}, batch {meta['batch']} per GPU, {meta['steps']} timed steps, {meta['gpu']}; "
            f"bf16 matmul peak measured {meta['peak_tflops']:.0f} TFLOP/s; model {meta['gflops_per_sample']:.0f} "
            "GFLOP per sample (forward + backward)")
    lines = [head, "", "| row | samples/s | model TFLOP/s | MFU | peak GiB | vs baseline |", "|---|---|---|---|---|---|"]
    base = rows[0]["samples_per_s"]
    for r in rows:
        tflops = r["samples_per_s"] * meta["gflops_per_sample"] / 1e3
        r.update(tflops=tflops, mfu=tflops / meta["peak_tflops"], ratio=r["samples_per_s"] / base)
        lines.append(f"| {r['name']} | {r['samples_per_s']:.1f} | {tflops:.0f} | {r['mfu']:.0%} "
                     f"| {r['peak_memory_gib']:.1f} | {r['ratio']:.2f}x |")
    out.mkdir(parents=True, exist_ok=True)
    (out / f"step-{meta['preset']}.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=1))
    table = "\n".join(lines) + "\n"
    (out / f"step-{meta['preset']}.md").write_text(table)
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", choices=sorted(SHAPES), default="sd15")
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--work", default="/tmp/sdpipe-bench-step")
    parser.add_argument("--out", default="benchmarks/results")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("bench_step needs a CUDA GPU")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "raw").exists():
        sdpipe("demo", "--out", str(work / "raw"))
    peak = matmul_peak()
    baseline, flops = run_baseline(args.preset, args.batch, args.steps, args.warmup)
    rows = [baseline, run_sdpipe(work, args.preset, args.batch, args.steps + args.warmup, "bf16")]
    meta = {"preset": args.preset, "batch": args.batch, "steps": args.steps, "peak_tflops": peak,
            "gflops_per_sample": flops / 1e9, **provenance()}
    print(write(rows, meta, Path(args.out)))


if __name__ == "__main__":
    main()
