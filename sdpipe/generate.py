"""Sharded image generation with fixed seeds: class images for DreamBooth, evaluation samples.

A job is one image: (index, prompt, seed, file). Jobs are dealt to one plain process per device (no process
group), each image is written atomically as soon as it exists, and its noise comes from a CPU generator seeded
by the job alone, so a rerun gives the same image, and another device count or batch differs at most by float rounding.
"""

from __future__ import annotations

from pathlib import Path

from sdpipe import io, parallel

WRITE_THREADS = 4  # threads encoding PNGs beside the GPU; 0 = write each batch before rendering the next


def _batches(jobs: list[dict], size: int) -> list[list[dict]]:
    """At most `size` jobs a batch, the batches as even as possible (sizes differ by at most one): a tail batch of
    a few images would be a shape of its own, tuned or compiled again for little work."""
    count = -(-len(jobs) // size)
    bounds = [round(i * len(jobs) / count) for i in range(count + 1)]
    return [jobs[a:b] for a, b in zip(bounds, bounds[1:])]


def prepare_sampler(pipe, device: str, compile_mode: str = "eager") -> None:
    """On a GPU: the VAE decodes one image at a time (its full-resolution activations dominate the memory, and one
    image already fills the GPU) and, optionally, each UNet block is compiled (sdpipe.models.regions). Channels-last
    layers, fused q/k/v projections and cuDNN's autotuner were measured too and gained nothing for SD 1.5 at 512 px
    on an H200 (benchmarks/NOTES.md v12), so they are not used."""
    if not device.startswith("cuda"):
        return
    pipe.vae.enable_slicing()
    if compile_mode == "blocks":
        from sdpipe.models.regions import CompiledRegions

        CompiledRegions(pipe.unet).enable()  # this pipeline only samples: its blocks stay compiled


def _render(pipe, batch: list[dict], settings: dict, steps: int | None = None) -> list:
    import torch

    gens = [torch.Generator(device="cpu").manual_seed(job["seed"]) for job in batch]
    return pipe(
        [job["prompt"] for job in batch],
        height=settings["height"],
        width=settings["width"],
        num_inference_steps=steps or settings["steps"],
        guidance_scale=settings["guidance"],
        generator=gens,
    ).images


def generate_worker(device: str, jobs: list[dict], report, settings: dict) -> dict:
    """Load the pipeline on `device` and render `jobs` batch by batch; return the images written and, apart, the
    seconds spent loading the model, warming up (a two-step render of the largest batch: kernel selection,
    compiling) and rendering."""
    import time

    import torch

    from sdpipe.models.pipeline import load_pipeline

    start = time.perf_counter()
    dtype = torch.float16 if device.startswith("cuda") and settings["half_on_gpu"] else torch.float32
    pipe = load_pipeline(
        settings["pretrained"],
        settings["revision"],
        settings["variant"],
        device,
        dtype,
        prediction_type=settings.get("prediction_type"),
    )
    prepare_sampler(pipe, device, settings.get("compile", "eager"))
    batches = _batches(jobs, settings["batch_size"])
    loaded = time.perf_counter()
    if device.startswith("cuda"):
        _render(pipe, batches[0], settings, steps=2)
    warm = time.perf_counter()
    # PNG encoding takes about as long per image as rendering it on a fast GPU: threads encode and write one batch
    # while the GPU renders the next (zlib releases the GIL). Each image is still written atomically.
    from concurrent.futures import ThreadPoolExecutor

    threads = settings.get("write_threads", WRITE_THREADS)
    with ThreadPoolExecutor(max_workers=max(1, threads)) as pool:
        pending = []
        for batch in batches:
            images = _render(pipe, batch, settings)
            writes = [pool.submit(_write, job, image) for job, image in zip(batch, images)]
            if not threads:
                [w.result() for w in writes]
            pending += writes
            report(len(batch))
        for write in pending:
            write.result()  # a failed write fails the stage here
    done = time.perf_counter()
    return {"images": len(jobs), "load_s": loaded - start, "warmup_s": warm - loaded, "seconds": done - warm}


def _write(job: dict, image) -> None:
    if job.get("caption_file"):  # before the image: an image on disk always has its caption beside it
        io.write_text(job["caption_file"], job["prompt"] + "\n")
    with io.atomic_path(Path(job["file"])) as tmp:
        image.save(tmp, "PNG")


def generate(jobs: list[dict], devices: list[str], description: str, settings: dict) -> dict:
    """Render every job across `devices`; return the images written, the rendering throughput after warm-up
    (images over the slowest device's rendering time: the devices work side by side) and, apart, the slowest
    device's model loading and warm-up seconds."""
    if not jobs:
        return {"images": 0, "images_per_s": None, "load_s": None, "warmup_s": None}
    devices = devices[: len(jobs)]  # a device without work would only load the model
    parts = parallel.run_sharded(generate_worker, jobs, devices, description, settings=settings)
    slowest = max(p["seconds"] for p in parts)
    return {
        "images": len(jobs),
        "images_per_s": round(len(jobs) / slowest, 3) if slowest else None,
        "load_s": round(max(p["load_s"] for p in parts), 3),
        "warmup_s": round(max(p["warmup_s"] for p in parts), 3),
        "render_s": round(slowest, 3),
        "devices": len(devices),
    }
