"""`sdpipe bench`: the speed of sdpipe's training step, latent caching and data loader on this machine's first
GPU, against the plain diffusers-example loop measured in the same run. Prints a Markdown table last and writes it,
with a JSON twin, under --out."""

from __future__ import annotations

import logging
import time
from pathlib import Path

log = logging.getLogger("sdpipe.bench")
PRESETS = {  # resolution, default per-GPU batch, JPEGs to cache
    "sd15": (512, 32, 2000),
    "sdxl": (1024, 8, 256),
    "tiny": (32, 8, 64),
}


def add_arguments(p) -> None:
    p.add_argument("--preset", action="append", choices=sorted(PRESETS), help="sd15 (default), sdxl; repeatable")
    p.add_argument("--batch", type=int, action="append", help="per-GPU batch; repeatable (default: the preset's)")
    p.add_argument(
        "--baseline-batch",
        type=int,
        action="append",
        help="per-GPU batch of the baseline rows; repeatable (default: --batch). The baseline may run at "
        "its own best batch: eager SDXL runs out of memory at the batch the compiled step trains at",
    )
    p.add_argument("--steps", type=int, default=30, help="timed optimizer steps per row (after --warmup)")
    p.add_argument("--warmup", type=int, default=10, help="untimed steps first (compiling happens here)")
    p.add_argument("--latent-batch", type=int, help="images per batch in the latents stage (default: its auto rule)")
    p.add_argument("--images", type=int, help="JPEGs to cache (default: 2000 for sd15, 256 for sdxl)")
    p.add_argument("--skip", action="append", default=[], choices=["baseline", "parity", "latents", "loader", "train"])
    p.add_argument(
        "--compile",
        action="append",
        choices=["compiled", "eager", "blocks", "auto"],
        help="train.compile for the sdpipe rows (default: compiled on a GPU; a bench's few steps would "
        "make `auto` pick eager); repeatable",
    )
    p.add_argument(
        "--train-template",
        action="append",
        metavar="TEMPLATE",
        help="train the rows with this job template's train settings (sdxl-lora, sdxl-lora-24gb, ...; its "
        "batch unless --batch); repeatable (default: a bf16 full fine-tune)",
    )
    p.add_argument(
        "--optimizer",
        action="append",
        help="train.optimizer of the rows (adamw, adamw_8bit, paged_adamw_8bit, ...); repeatable (default: the "
        "template's, else fused AdamW)",
    )
    p.add_argument(
        "--memory-cap-gib",
        type=float,
        help="limit PyTorch's allocator in the training rows to this much GPU memory, as on a smaller card: a row "
        "that runs out of memory is reported as not fitting (23 leaves a 24 GB card its CUDA context)",
    )
    p.add_argument("--work", default="/tmp/sdpipe-bench", help="scratch: images, caches, runs")
    p.add_argument("--out", default="benchmarks/results")
    p.add_argument("--name", help="results file stem (default: bench-<presets>)")
    p.add_argument("--commit", help="the code's git commit, when the tree has no .git (default: git rev-parse)")
    p.add_argument(
        "--summarize",
        nargs="+",
        type=Path,
        metavar="RESULTS_JSON",
        help="measure nothing: put these results files (from calls that each ran some rows) into one "
        "table with each file's provenance, written to --out as <--name or summary>.md/.json",
    )


def matmul_peak(device, n: int = 8192, reps: int = 20) -> float | None:
    """bf16 dense matmul TFLOP/s measured now: the MFU denominator."""
    import torch

    if torch.device(device).type != "cuda":
        return None
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    return 2 * n**3 * reps / (time.perf_counter() - start) / 1e12


def _show(result: dict) -> None:
    """Each number as soon as it is measured: a run cut short still leaves them in its log."""
    import json

    log.info("bench result: %s", json.dumps(result, default=str))


def _latent_variants(skip: list[str]) -> list[tuple[str, str]]:
    """Latent caching eager and compiled (latents.compile: auto picks by dataset size); the compiled run's cache
    also feeds train and loader. With --skip latents the cache only feeds them: eager, which spares a call the
    encoder's minute of compiling."""
    if "latents" not in skip:
        return [("eager", "eager"), ("torch.compile", "compiled")]
    return [] if {"train", "loader"} <= set(skip) else [("eager", "eager")]


def bench_preset(args, preset: str, device, work: Path) -> dict:
    from sdpipe.bench import baseline, parity, pipeline

    resolution, default_batch, default_images = PRESETS[preset]
    batches = args.batch or [default_batch]
    model = work / preset
    needs_model = not {"latents", "train", "loader"} <= set(args.skip)  # baseline and parity build their own UNet
    if needs_model and not (model / "model_index.json").is_file():
        pipeline.sdpipe("build-model", "--preset", preset, "--out", str(model))
    out: dict = {"resolution": resolution, "rows": [], "latents": []}
    for name, mode in _latent_variants(args.skip):
        count = args.images or default_images
        if "latents" in args.skip and (cache := pipeline.cached_latents(work, f"{preset}-{mode}", count)):
            out["latents"].append({"name": name, **cache})  # only feeding the train rows: an earlier call's cache
            continue
        # The count is in the name: a scratch folder reused with another --images must not feed stale files on.
        raw = pipeline.write_jpegs(work / f"jpeg-{resolution}-{count}", count, resolution)
        log.info("bench %s: latent caching, %s", preset, name)
        settings = {
            "dtype": "bf16",
            "batch_size": args.latent_batch or "auto",
            "loader_threads": 0,
            "compile": mode,
            "gpus": 1 if device.type == "cuda" else 0,
        }
        out["latents"].append(
            {"name": name, **pipeline.cache_latents(work, f"{preset}-{mode}", model, raw, resolution, settings)}
        )
        _show(out["latents"][-1])
    cache = out["latents"][-1] if out["latents"] else None
    if "baseline" not in args.skip:
        for batch in args.baseline_batch or batches:
            log.info("bench %s: baseline, batch %d", preset, batch)
            out["rows"].append(baseline.measure(preset, resolution, batch, args.steps, args.warmup, device))
            _show(out["rows"][-1])
    if "train" not in args.skip:
        for row in train_rows(args, preset, device, work, cache, args.batch):
            out["rows"].append(row)
            _show(row)
    if "loader" not in args.skip:
        batch = max(batches)
        cfg = pipeline.train_config(work, cache["config"], f"{preset}-loader", batch, 1, 1, {})
        out["loader"] = {"batch": batch, **pipeline.loader_rate(cfg, cache["index"], 50)}
        _show(out["loader"])
    if "parity" not in args.skip:
        log.info("bench %s: parity check", preset)
        out["parity"] = parity.check(preset, resolution, str(model), device)
        _show(out["parity"])
    return out


def train_rows(args, preset: str, device, work: Path, cache: dict, batches: list[int] | None):
    """`sdpipe train` rows: each compile mode x template x optimizer x batch (a template's own batch by default)."""
    from sdpipe import templates
    from sdpipe.bench import pipeline

    default_batch = PRESETS[preset][1]
    for mode in args.compile or ["compiled" if device.type == "cuda" else "eager"]:
        for template in args.train_template or [None]:
            base = templates.settings(template).get("train", {}) if template else {}
            for optimizer in args.optimizer or [None]:
                extra = {"compile": mode, **({"optimizer": optimizer} if optimizer else {})}
                for batch in batches or [base.get("per_device_batch_size", default_batch)]:
                    parts = [p for p in (preset, template, optimizer, mode, str(batch)) if p]
                    log.info("bench %s: sdpipe train, %s", preset, " ".join(parts[1:]))
                    steps = args.steps + args.warmup
                    row = pipeline.train_row(
                        work, cache, "-".join(parts), batch, steps, args.warmup, extra, base, args.memory_cap_gib
                    )
                    yield {
                        "name": _row_name(mode, device, template, optimizer or base.get("optimizer"), batch, row),
                        "kind": "sdpipe",
                        "template": template,
                        "optimizer": optimizer,
                        **row,
                    }


OPTIMIZER_LABELS = {None: "fused AdamW", "adamw": "fused AdamW"}


def _row_name(mode: str, device, template: str | None, optimizer: str | None, batch: int, row: dict) -> str:
    label = "torch.compile" if mode == "compiled" and device.type == "cuda" else mode
    what = ", ".join(x for x in (template, label, OPTIMIZER_LABELS.get(optimizer, optimizer)) if x)
    accum = row.get("grad_accum_steps", 1)
    cap = f", {row['memory_cap_gib']:g} GiB cap" if row.get("memory_cap_gib") else ""
    return f"sdpipe train ({what}{cap}), batch {batch}" + (f" x {accum} accumulated" if accum > 1 else "")


def run(args) -> int:
    if args.summarize:
        from sdpipe.bench import summary

        print(summary.write(args.summarize, Path(args.out), args.name or "summary"))
        return 0
    import torch

    from sdpipe.bench import report

    logging.getLogger("sdpipe").setLevel(logging.INFO)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda":
        log.warning("no CUDA GPU: the numbers are a CPU smoke run, not a GPU benchmark")
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    presets = args.preset or ["sd15"]
    meta = {
        **report.provenance(args.commit),
        "steps": args.steps,
        "warmup": args.warmup,
        "peak_tflops": matmul_peak(device),
        "presets": presets,
    }
    _show({"peak_tflops": meta["peak_tflops"], "gpu": meta.get("gpu")})  # a run cut short keeps its MFU denominator
    stem = args.name or "bench-" + "-".join(presets)
    results = {"meta": meta, "presets": {}}
    for preset in presets:
        results["presets"][preset] = bench_preset(args, preset, device, work)
        report.save_partial(results, Path(args.out), stem)  # a later preset's failure keeps this one's numbers
    print(report.write(results, Path(args.out), stem))
    return 0
