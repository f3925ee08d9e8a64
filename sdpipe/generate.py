"""Sharded image generation with fixed seeds: class images for DreamBooth, evaluation samples.

A job is one image: (index, prompt, seed, file). Jobs are dealt to one plain process per device (no process
group), each image is written atomically as soon as it exists, and its noise comes from a CPU generator seeded
by the job alone, so a rerun gives the same image, and another device count or batch differs at most by float rounding.
"""

from __future__ import annotations

from pathlib import Path

from sdpipe import io, parallel


def _batches(jobs: list[dict], size: int) -> list[list[dict]]:
    return [jobs[i:i + size] for i in range(0, len(jobs), size)]


def generate_worker(device: str, jobs: list[dict], report, settings: dict) -> dict:
    """Load the pipeline on `device` and render `jobs` batch by batch; return the images written and the seconds
    spent rendering them (model loading excluded: that is the inference speed)."""
    import time

    import torch

    from sdpipe.models.pipeline import load_pipeline

    dtype = torch.float16 if device.startswith("cuda") and settings["half_on_gpu"] else torch.float32
    pipe = load_pipeline(settings["pretrained"], settings["revision"], settings["variant"], device, dtype,
                         prediction_type=settings.get("prediction_type"), **_trained_parts(settings, dtype))
    seconds = 0.0
    for batch in _batches(jobs, settings["batch_size"]):
        start = time.perf_counter()
        gens = [torch.Generator(device="cpu").manual_seed(job["seed"]) for job in batch]
        images = pipe([job["prompt"] for job in batch], height=settings["height"], width=settings["width"],
                      num_inference_steps=settings["steps"], guidance_scale=settings["guidance"],
                      generator=gens).images
        seconds += time.perf_counter() - start
        for job, image in zip(batch, images):
            _write(job, image)
        report(len(batch))
    return {"images": len(jobs), "seconds": seconds}


def _trained_parts(settings: dict, dtype) -> dict:
    """A trained UNet folder to sample with instead of the base one (evaluation); none for class images."""
    if not settings.get("unet"):
        return {}
    from diffusers import UNet2DConditionModel

    return {"unet": UNet2DConditionModel.from_pretrained(settings["unet"], torch_dtype=dtype)}


def _write(job: dict, image) -> None:
    if job.get("caption_file"):  # before the image: an image on disk always has its caption beside it
        io.write_text(job["caption_file"], job["prompt"] + "\n")
    with io.atomic_path(Path(job["file"])) as tmp:
        image.save(tmp, "PNG")


def generate(jobs: list[dict], devices: list[str], description: str, settings: dict) -> dict:
    """Render every job across `devices`; return the images written and the rendering throughput (images over the
    slowest device's rendering time: the devices work side by side)."""
    if not jobs:
        return {"images": 0, "images_per_s": None}
    devices = devices[:len(jobs)]  # a device without work would only load the model
    parts = parallel.run_sharded(generate_worker, jobs, devices, description, settings=settings)
    slowest = max(p["seconds"] for p in parts)
    return {"images": len(jobs), "images_per_s": round(len(jobs) / slowest, 3) if slowest else None}
