"""Where SD 1.5 sampling time goes on a GPU (issue 24: evaluation renders 4.5 images/s against a target of 8).

A research tool; its findings go to benchmarks/NOTES.md. It builds the sd15 preset, saves and loads it as the
evaluate stage does (sdpipe.models.pipeline.load_pipeline, fp16, the sampler's preparation), then times apart, with
CUDA events after a warm-up: the whole pipeline call, the UNet alone at the same batch (classifier-free guidance
doubles it), the VAE decode sliced and batched, the text encoder; and prints the attention processors, the SDPA
backends and the top kernels of one profiled call.

    python scripts/profile_sampling.py --batch 16 --steps 20
"""

from __future__ import annotations

import argparse
import tempfile

import torch


def timed(fn, repeat: int = 3) -> float:
    """Mean seconds of fn() over `repeat` runs after one untimed run, by CUDA events."""
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeat):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / 1000 / repeat


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--dtype", default="fp16", choices=["fp16", "bf16"])
    args = parser.parse_args()
    from sdpipe.generate import prepare_sampler
    from sdpipe.models import presets
    from sdpipe.models.pipeline import load_pipeline

    dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}[args.dtype]
    folder = presets.build_and_save("sd15", tempfile.mkdtemp() + "/sd15")
    pipe = load_pipeline(str(folder), device="cuda:0", dtype=dtype)
    prepare_sampler(pipe, "cuda:0")
    b, n = args.batch, args.steps
    print("attention processors:", sorted({type(p).__name__ for p in pipe.unet.attn_processors.values()}))
    print(
        "sdpa flash/mem-efficient/math:",
        torch.backends.cuda.flash_sdp_enabled(),
        torch.backends.cuda.mem_efficient_sdp_enabled(),
        torch.backends.cuda.math_sdp_enabled(),
    )
    prompts = ["a photo of a red balloon over a lake"] * b

    def whole():
        pipe(prompts, num_inference_steps=n, guidance_scale=5.0, height=512, width=512, output_type="pil")

    t_whole = timed(whole, repeat=2)
    print(f"whole pipeline: {t_whole:.3f} s per batch of {b}, {b / t_whole:.2f} images/s", flush=True)

    lat = torch.randn(2 * b, 4, 64, 64, device="cuda", dtype=dtype)
    text = torch.randn(2 * b, 77, 768, device="cuda", dtype=dtype)
    t = torch.tensor([500], device="cuda")
    with torch.no_grad():
        t_unet = timed(lambda: pipe.unet(lat, t, encoder_hidden_states=text), repeat=5)
        flops = 2 * 0.4e12 * 2 * b  # about 0.4 TMAC per SD 1.5 UNet forward at 512 px, per sample
        print(
            f"unet forward at batch {2 * b}: {t_unet * 1000:.1f} ms, x{n} steps = {t_unet * n:.3f} s "
            f"({flops / t_unet / 1e12:.0f} TFLOP/s by the 0.4 TMAC rule)",
            flush=True,
        )
        z = torch.randn(b, 4, 64, 64, device="cuda", dtype=dtype)
        t_sliced = timed(lambda: pipe.vae.decode(z / pipe.vae.config.scaling_factor), repeat=2)
        pipe.vae.disable_slicing()
        t_batched = timed(lambda: pipe.vae.decode(z / pipe.vae.config.scaling_factor), repeat=2)
        pipe.vae.enable_slicing()
        print(f"vae decode of {b}: sliced {t_sliced:.3f} s, batched {t_batched:.3f} s", flush=True)
        t_text = timed(lambda: pipe.encode_prompt(prompts, "cuda", 1, True), repeat=3)
        print(f"text encoding (with the empty prompt): {t_text * 1000:.1f} ms", flush=True)
    rest = t_whole - t_unet * n - t_sliced - t_text
    print(f"unaccounted (scheduler, guidance, PIL, copies): {rest:.3f} s of {t_whole:.3f}", flush=True)

    from sdpipe.generate import generate_worker

    out = tempfile.mkdtemp()
    jobs = [{"prompt": prompts[0], "seed": i, "file": f"{out}/{i:03d}.png"} for i in range(4 * b)]
    for threads in (0, 4):  # PNGs written between batches (before) or by threads beside the GPU (now)
        settings = {
            "pretrained": str(folder),
            "revision": None,
            "variant": None,
            "height": 512,
            "width": 512,
            "steps": n,
            "guidance": 5.0,
            "batch_size": b,
            "half_on_gpu": args.dtype == "fp16",
            "write_threads": threads,
        }
        result = generate_worker("cuda:0", jobs, lambda k=1: None, settings)
        print(
            f"generate_worker, {len(jobs)} PNGs, write_threads={threads}: {len(jobs) / result['seconds']:.2f} "
            f"images/s after warm-up (load {result['load_s']:.1f} s, warm-up {result['warmup_s']:.1f} s)",
            flush=True,
        )

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        pipe(prompts, num_inference_steps=4, guidance_scale=5.0, height=512, width=512, output_type="pil")
        torch.cuda.synchronize()
    averages = prof.key_averages()
    for key in ("device_time_total", "cuda_time_total"):
        try:
            print(averages.table(sort_by=key, row_limit=18, max_name_column_width=60))
            break
        except (AttributeError, KeyError, ValueError):
            continue


if __name__ == "__main__":
    main()
