"""Issue 28 on a GPU, what one device call can hold (benchmarks/NOTES.md v18):

1. `dag`: the user's path for each flow template: `sdpipe init --template T` on a tiny preset, then
   `snakemake --profile runpod` with bf16 and the GPU (a second config file shrinks steps and images only).
   Prints each DAG's wall time and what export verified, where.
2. `step`: the LoRA training step at real size (flux-dev, sd35-medium; random init in bf16 on the GPU, the
   template's LoRA layers, gradient checkpointing, 1024 px, cached-conditioning shapes): the family's objective
   and forward, fused AdamW on the adapters. Prints warm-up and steady samples/s separately, the peak memory and
   the matmul peak measured in the same run. It is the step alone, not the training loop, and no peer ran beside it.

    python scripts/explore_flow.py dag OUT
    python scripts/explore_flow.py step PRESET BATCH STEPS
    python scripts/explore_flow.py t5 CAPTIONS BATCH

3. `t5`: the text cache's bulk, T5-XXL (random init, bf16) encoding distinct captions at Flux's 512 tokens with
   the real T5 tokenizer: captions/s for the encoding alone (no storage), warm-up apart.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import torch

DAG_JOBS = {"sd35-lora": "tiny-sd3", "flux-lora": "tiny-flux", "sd15-lora": "tiny"}
GPU_FAST = {
    "prepare": {"min_size": 32, "eval_fraction": 0.0, "workers": 1, "buckets": {"resolution": 64, "step": 16}},
    "train": {
        "max_steps": 20,
        "per_device_batch_size": 4,
        "grad_accum_steps": 1,
        "lr_warmup_steps": 0,
        "validation": {"every": 10, "steps": 4},
        "checkpoint_every": 10,
    },
    "export": {"verify": {"steps": 4}},
    "evaluate": {"steps": 4, "seeds": [0], "batch_size": 2, "fid": {"enabled": False}},
}


def dag(out: Path) -> None:
    import yaml

    from sdpipe import demo
    from sdpipe.models import presets

    photos = out / "photos"
    demo.generate(photos, count=24, seed=0)
    for template, preset in DAG_JOBS.items():
        model = presets.build_and_save(preset, out / "models" / preset, seed=0)
        project = out / template
        subprocess.run(
            [
                sys.executable,
                "-m",
                "sdpipe",
                "init",
                str(project),
                "-t",
                template,
                "--images",
                str(photos),
                "--model",
                str(model),
                "--prompt",
                "a red circle",
            ],
            check=True,
        )
        (project / "gpu.yaml").write_text(yaml.safe_dump(GPU_FAST))
        start = time.perf_counter()
        proc = subprocess.run(
            ["snakemake", "--profile", "runpod", "--configfile", "config/config.yaml", "gpu.yaml"],
            cwd=project,
            capture_output=True,
            text=True,
        )
        wall = time.perf_counter() - start
        (out / f"{template}.log").write_text(proc.stdout + proc.stderr)
        result = {"template": template, "preset": preset, "rc": proc.returncode, "wall_s": round(wall, 1)}
        summary = project / "results/export/summary.json"
        if summary.is_file():
            export = json.loads(summary.read_text())
            result["rendered_on"] = export["verify"]["rendered_on"]
            result["formats"] = {k: [v["verified"], v["mean_abs_diff"]] for k, v in export["formats"].items()}
            train = json.loads((project / "results/train/summary.json").read_text())
            result["train"] = {k: train.get(k) for k in ("peak_memory_mb", "mixed_precision", "optimizer_steps")}
            metrics = json.loads((project / "results/evaluate/metrics.json").read_text())
            result["train_samples_per_s"] = metrics.get("train_samples_per_s")
        print("flow dag:", json.dumps(result), flush=True)


def _conditioning(preset: str, batch: int, device, dtype) -> dict:
    from sdpipe.models import presets_flow

    config = presets_flow.denoiser_config(preset)
    width = config["joint_attention_dim"]
    pooled = config["pooled_projection_dim"]
    if presets_flow.FAMILY[preset] == "flux":
        return {
            "t5": torch.randn(batch, 512, width, device=device, dtype=dtype),
            "pooled": torch.randn(batch, pooled, device=device, dtype=dtype),
        }
    return {
        "clip": torch.randn(batch, 77, 2048, device=device, dtype=dtype),
        "t5": torch.randn(batch, 256, width, device=device, dtype=dtype),
        "pooled": torch.randn(batch, pooled, device=device, dtype=dtype),
    }


def step(preset: str, batch: int, steps: int) -> None:
    from sdpipe import templates
    from sdpipe.bench.cli import matmul_peak
    from sdpipe.config import from_dict
    from sdpipe.models import families, presets, presets_flow
    from sdpipe.train.models import add_lora

    device, dtype = torch.device("cuda" if torch.cuda.is_available() else "cpu"), torch.bfloat16  # CPU: a smoke run
    gpu = device.type == "cuda"
    sync = torch.cuda.synchronize if gpu else (lambda: None)
    peak_tflops = matmul_peak(device)
    family = families.named(presets.family(preset))
    template = "flux-lora" if family.name == "flux" else "sd35-lora"
    lora = from_dict(templates.settings(template)).train.lora
    started = time.perf_counter()
    cls = family.denoiser_type()
    torch.set_default_dtype(dtype)  # initialised in bf16: FLUX.1's 12 billion fp32 parameters would take 48 GB first
    with torch.device(device):
        model = cls.from_config(presets_flow.denoiser_config(preset))
    torch.set_default_dtype(torch.float32)
    params = sum(p.numel() for p in model.parameters())
    add_lora(model, lora)
    model.enable_gradient_checkpointing()
    model.train()
    trained = [p for p in model.parameters() if p.requires_grad]
    for p in trained:
        p.data = p.data.float()
    optimizer = torch.optim.AdamW(trained, lr=1e-4, fused=True)
    scheduler = presets_flow.scheduler(preset)
    objective = family.objective
    cond = _conditioning(preset, batch, device, dtype)
    latents = torch.randn(batch, 16, 128 if gpu else 16, 128 if gpu else 16, device=device)
    generator = torch.Generator().manual_seed(0)
    built = time.perf_counter() - started
    times = []
    for _ in range(steps):
        sync()
        t0 = time.perf_counter()
        timesteps = torch.cat([objective.timestep(generator, scheduler) for _ in range(batch)]).to(device)
        noise = torch.randn_like(latents)
        noisy = objective.noisy(scheduler, latents, noise, timesteps)
        with torch.autocast("cuda", dtype=dtype):
            pred = family.predict(model, noisy.to(dtype), timesteps, cond)
        out = objective.output(pred.float(), noisy, scheduler, timesteps)
        target = objective.target(scheduler, latents, noise, timesteps, None)
        loss = torch.nn.functional.mse_loss(out, target)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        sync()
        times.append(time.perf_counter() - t0)
    warm = 3
    steady = batch * (steps - warm) / sum(times[warm:])
    # Model FLOPs of a LoRA step: forward, recomputed forward (checkpointing) and the activation gradients (about
    # two forwards); the frozen base has no weight gradients. 2 FLOPs per parameter per token, attention excluded.
    tokens = 64 * 64 + (512 if family.name == "flux" else 256 + 77)
    flops = 4 * 2 * params * tokens
    print(
        "flow step:",
        json.dumps(
            {
                "preset": preset,
                "batch": batch,
                "steps": steps,
                "params": params,
                "adapters": sum(p.numel() for p in trained),
                "build_s": round(built, 1),
                "first_steps_s": [round(t, 2) for t in times[:warm]],
                "steady_samples_per_s": round(steady, 3),
                "peak_memory_gb": round(torch.cuda.max_memory_allocated() / 1e9, 1) if gpu else None,
                "peak_tflops": round(peak_tflops, 1) if gpu else None,
                "mfu": round(steady * flops / 1e12 / peak_tflops, 3) if gpu else None,
                "gpu": torch.cuda.get_device_name() if gpu else "cpu",
                "torch": torch.__version__,
            }
        ),
        flush=True,
    )


def t5(count: int, batch: int) -> None:
    from transformers import T5EncoderModel

    from sdpipe.models import presets_flow
    from sdpipe.models.tokenizer import build_t5_tokenizer

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = presets_flow.T5_XXL if device.type == "cuda" else presets_flow.T5_TINY
    started = time.perf_counter()
    torch.set_default_dtype(torch.bfloat16)
    with torch.device(device):
        encoder = T5EncoderModel(presets_flow.t5_config(spec)).eval()
    torch.set_default_dtype(torch.float32)
    tokenizer = build_t5_tokenizer(512)
    built = time.perf_counter() - started
    captions = [
        f"a photo of coloured circles, picture {i}, in the style of painter number {i % 97}" for i in range(count)
    ]
    times = []
    with torch.no_grad():
        for start in range(0, count, batch):
            t0 = time.perf_counter()
            ids = tokenizer(
                captions[start : start + batch],
                padding="max_length",
                max_length=512,
                truncation=True,
                return_tensors="pt",
            ).input_ids.to(device)
            states = encoder(ids).last_hidden_state.cpu()
            times.append(time.perf_counter() - t0)
    warm = 2
    print(
        "flow t5:",
        json.dumps(
            {
                "captions": count,
                "batch": batch,
                "build_s": round(built, 1),
                "first_batches_s": [round(t, 2) for t in times[:warm]],
                "steady_captions_per_s": round(batch * (len(times) - warm) / sum(times[warm:]), 1),
                "state_mib_per_caption_bf16": round(states[0].numel() * 2 / 2**20, 2),
            }
        ),
        flush=True,
    )


if __name__ == "__main__":
    if sys.argv[1] == "dag":
        dag(Path(sys.argv[2]))
    elif sys.argv[1] == "t5":
        t5(int(sys.argv[2]), int(sys.argv[3]))
    else:
        step(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]))
