"""Which speed-ups pay on this GPU: the bare UNet training step and the bare VAE encoder, variant by variant.

A research tool for issue 5 (its findings are in benchmarks/NOTES.md): it times the model alone, on random data
already on the GPU, so each variant's gain is visible without the pipeline around it. The benchmark of record is
`sdpipe bench`, which times `sdpipe train` itself.

    python scripts/explore_speed.py --part unet --preset sd15
    python scripts/explore_speed.py --part vae
"""

from __future__ import annotations

import argparse
import time

import torch
import torch._inductor.config

from sdpipe.bench.baseline import random_cond

RESOLUTION = {"sd15": 512, "sdxl": 1024}
CAT_DEFAULTS = {
    key: getattr(torch._inductor.config, key)
    for key in ("max_pointwise_cat_inputs", "max_complex_pointwise_cat_inputs")
    if hasattr(torch._inductor.config, key)
}  # not every torch has the second


def compile_regions(model, names=("down_blocks", "mid_block", "up_blocks")) -> None:
    """Compile each UNet/VAE block on its own: graphs stay small (bounded compile time), shapes static."""
    for name in names:
        part = getattr(model, name, None)
        for block in part if isinstance(part, torch.nn.ModuleList) else [part]:
            if block is not None:
                block.compile(dynamic=False)


def set_backends(variant: str) -> None:
    """Process-wide kernel choices a variant names: cuDNN's conv autotuner, inductor's kernel-config search (cdt),
    combo kernels and pointwise cats (nopwcat), and the SDPA attention backend."""
    parts = variant.split("+")
    torch.backends.cudnn.benchmark = "bench" in parts
    torch._inductor.config.coordinate_descent_tuning = "cdt" in parts
    torch._inductor.config.combo_kernels = "combo" in parts  # independent small kernels launched as one
    # nopwcat: every cat of two or more computed inputs becomes one buffer each input's kernel writes into, not one
    # kernel that evaluates all inputs per element (GEGLU's backward, benchmarks/NOTES.md v8)
    for key, default in CAT_DEFAULTS.items():
        setattr(torch._inductor.config, key, 1 if "nopwcat" in parts else default)
    attention = {"cudnnattn": "cudnn", "effattn": "efficient"}.get(next((p for p in parts if p.endswith("attn")), ""))
    torch.backends.cuda.enable_flash_sdp(attention is None)
    torch.backends.cuda.enable_mem_efficient_sdp(attention in (None, "efficient"))
    torch.backends.cuda.enable_cudnn_sdp(attention in (None, "cudnn"))


def prepare(model, variant: str):
    from sdpipe.models.geglu import use_split_geglu
    from sdpipe.models.layout import use_channel_stat_group_norm, use_channels_last_conv_inputs

    parts = variant.split("+")
    set_backends(variant)
    if "geglu" in parts:
        use_split_geglu(model)
    if "gn" in parts:
        use_channel_stat_group_norm(model)
    if "clconv" in parts:
        use_channels_last_conv_inputs(model)
    if "cl" in parts:
        model = model.to(memory_format=torch.channels_last)
    if "full" in parts:
        mode = "reduce-overhead" if "ro" in parts else "max-autotune-no-cudagraphs" if "maxat" in parts else None
        model = torch.compile(model, dynamic=False, mode=mode)
    if "regional" in variant.split("+"):
        compile_regions(model)
    return model


def unet_case(preset: str, variant: str, batch: int, steps: int) -> dict:
    from diffusers import UNet2DConditionModel

    from sdpipe.models import presets

    torch.manual_seed(0)
    unet = prepare(UNet2DConditionModel(**presets.unet_config(preset)).cuda().train(), variant)
    opt = torch.optim.AdamW(unet.parameters(), lr=1e-5, fused=True)
    data = random_cond(preset, RESOLUTION[preset], batch, "cuda", torch.Generator().manual_seed(0))
    added = {"text_embeds": data["pooled"], "time_ids": data["time_ids"]} if "pooled" in data else None
    if "cl" in variant.split("+"):
        data["latents"] = data["latents"].to(memory_format=torch.channels_last)

    def step():
        noise = torch.randn_like(data["latents"])
        t = torch.randint(0, 1000, (batch,), device="cuda")
        with torch.autocast("cuda", dtype=torch.bfloat16):
            pred = unet(
                data["latents"] + noise, t, encoder_hidden_states=data["hidden"], added_cond_kwargs=added
            ).sample
        loss = torch.nn.functional.mse_loss(pred.float(), noise.float())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(unet.parameters(), 1.0, foreach=True)
        opt.step()
        opt.zero_grad(set_to_none=True)

    result = _time(step, batch, steps)
    if "prof" in variant.split("+"):
        profile(step)
    if "copyprof" in variant.split("+"):
        try:
            copy_sources(step)
        except Exception as err:  # noqa: BLE001 - the timing above stands without the copy table
            print(f"copyprof failed: {type(err).__name__}: {err}", flush=True)
    return result


def copy_sources(step, top: int = 15) -> None:
    """Which aten ops launch the `direct_copy` (layout copy) kernels of a step, with their input shapes."""
    import collections

    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof:
        step()
        torch.cuda.synchronize()
    found = collections.Counter()
    for e in prof.events():
        names = [k.name for k in getattr(e, "kernels", [])]
        if e.device_type == torch.autograd.DeviceType.CUDA:
            names = [e.name]
            e = e.cpu_parent or e
        if not any("direct_copy" in n for n in names):  # aten's copies, not inductor's fused `_to_copy` kernels
            continue
        chain, p = [], e
        while p is not None and len(chain) < 5:
            chain.append(p.name[:60])
            p = p.cpu_parent
        found[(" <- ".join(chain), str(e.input_shapes)[:120])] += 1
    for (chain, shapes), n in found.most_common(top):
        print(f"  copies x{n:<4} {chain}  {shapes}", flush=True)


def profile(step, top: int = 25) -> None:
    """Where a step's GPU time goes: the top kernels of two profiled steps, with their share."""
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(2):
            step()
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_time_total > 0]
    total = sum(e.self_device_time_total for e in events)
    for e in sorted(events, key=lambda e: -e.self_device_time_total)[:top]:
        print(
            f"  {100 * e.self_device_time_total / total:5.1f}%  {e.self_device_time_total / 2e3:8.2f} ms/step  "
            f"x{e.count // 2:<4} {e.key[:110]}",
            flush=True,
        )


def vae_case(variant: str, batch: int, steps: int) -> dict:
    from diffusers import AutoencoderKL

    from sdpipe.models import presets

    dtype = torch.float16 if "fp16" in variant.split("+") else torch.bfloat16
    torch.manual_seed(0)
    vae = AutoencoderKL(**presets.vae_config("sd15")).cuda().to(dtype).eval()
    if "mathattn" in variant.split("+"):  # the head-dim-512 mid-block attention as plain bmm + softmax
        from diffusers.models.attention_processor import AttnProcessor

        vae.set_attn_processor(AttnProcessor())
    vae.encoder = prepare(vae.encoder, variant)
    x = torch.rand(batch, 3, 512, 512, device="cuda", dtype=dtype) * 2 - 1
    if "cl" in variant.split("+"):
        x = x.to(memory_format=torch.channels_last)

    @torch.no_grad()
    def step():
        vae.quant_conv(vae.encoder(x))

    result = _time(step, batch, steps)
    if "prof" in variant.split("+"):
        profile(step)
    return result


def _time(step, batch: int, steps: int) -> dict:
    torch.cuda.reset_peak_memory_stats()
    start = time.perf_counter()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    warm = time.perf_counter() - start
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    med = sorted(times)[len(times) // 2]
    return {
        "samples_per_s": batch / med,
        "step_ms": med * 1e3,
        "warmup_s": warm,
        "peak_gib": torch.cuda.max_memory_allocated() / 2**30,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--part", choices=["unet", "vae"], default="unet")
    parser.add_argument("--preset", choices=sorted(RESOLUTION), default="sd15")
    parser.add_argument(
        "--cases",
        nargs="+",
        default=["eager:32", "cl:32", "full+cl:32", "regional+cl:32"],
        help="variant:batch, variant = eager or a '+' list of cl, full, regional, ro (CUDA graphs), "
        "maxat (max-autotune), cdt (coordinate-descent tuning), combo (combo kernels), bench "
        "(cudnn.benchmark), gn (ChannelStatGroupNorm), clconv (ChannelsLastInputConv2d), geglu "
        "(SplitProjectionGEGLU), nopwcat (no pointwise cats), "
        "cudnnattn / effattn (SDPA backend), mathattn (VAE), fp16 (VAE), prof (kernel table), "
        "copyprof (layout copies)",
    )
    parser.add_argument("--budget", type=float, default=1e9, help="seconds: start no case after this")
    parser.add_argument("--steps", type=int, default=10)
    args = parser.parse_args()
    torch._dynamo.config.cache_size_limit = 64
    torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
    rows = []
    start = time.perf_counter()
    for case in args.cases:
        if time.perf_counter() - start > args.budget:
            print(f"skipped {case}: over the time budget", flush=True)
            continue
        variant, batch = case.split(":")
        try:
            if args.part == "unet":
                r = unet_case(args.preset, variant, int(batch), args.steps)
            else:
                r = vae_case(variant, int(batch), args.steps)
        except Exception as err:  # noqa: BLE001 - a failed variant is a row, not the end of the run
            r = {
                "samples_per_s": float("nan"),
                "step_ms": float("nan"),
                "warmup_s": float("nan"),
                "peak_gib": float("nan"),
                "note": f"{type(err).__name__}: {str(err)[:200]}",
            }
        torch._dynamo.reset()
        torch.cuda.empty_cache()
        rows.append((case, r))
        print(f"{args.part} {args.preset} {case}: {r}", flush=True)
    print(
        f"\n| {args.part} {args.preset if args.part == 'unet' else 'sd15 VAE encoder 512px bf16'} | samples/s "
        "| step ms | warm-up s | peak GiB |\n|---|---|---|---|---|"
    )
    for case, r in rows:
        print(f"| {case} | {r['samples_per_s']:.1f} | {r['step_ms']:.1f} | {r['warmup_s']:.1f} | {r['peak_gib']:.1f} |")


if __name__ == "__main__":
    main()
